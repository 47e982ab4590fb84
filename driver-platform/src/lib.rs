//! The contract between the drivers' portable cores and their platform.
//!
//! A driver core (`hca-miniport-core`, `ibal-bus-core`) is `no_std` +
//! `alloc` logic that never touches Windows directly. Everything it needs
//! from the outside world is one of the traits here, bundled by
//! [`Platform`]; the KMDF shells implement them with WDF objects on Windows,
//! and the simulated host (`sim-host`) implements them on Linux while
//! enforcing the same contracts (IRQL rules, DMA discipline, completion
//! exactly once).
//!
//! Shape of the contract, in the sans-IO style of the rest of the stack:
//!
//! - The platform calls the core (device add, prepare hardware, D0
//!   entry/exit, the ISR, the DPC, the timer, the work item, each request);
//!   the core never blocks and never spins on hardware.
//! - The core asks the platform for deferred work — [`Deferred::queue_dpc`],
//!   [`Deferred::queue_work_item`], [`Deferred::set_timer`] — and the
//!   platform calls the core's matching entry point later, at the documented
//!   IRQL. One DPC, one work item and one timer per device suffice: the core
//!   keeps its own queue of what they should do.
//! - Memory the device reaches is handed over as bus addresses of DMA
//!   mappings ([`DmaAdapter`]); the core reads and writes common buffers
//!   through copy methods, so it needs no raw pointers and no `unsafe`,
//!   and orders them with the named barriers [`dma::dma_wmb`] and
//!   [`dma::dma_rmb`].
//! - A PASSIVE_LEVEL caller that wants to wait for a request waits on an
//!   [`Event`] its request's completion sets; the core itself never waits.
//! - A request is completed by consuming it ([`Request::complete`]): the type
//!   system makes "exactly once" structural.
//!
//! Each method's doc states the highest IRQL it may be called at.

#![cfg_attr(not(test), no_std)]
#![forbid(unsafe_code)]

extern crate alloc;

pub mod bus;
pub mod deferred;
pub mod dma;
pub mod event;
pub mod irql;
pub mod mmio;
pub mod power;
pub mod registry;
pub mod request;
pub mod user;

pub use bus::{ChildBus, ChildDescription};
pub use deferred::Deferred;
pub use dma::{CommonBuffer, DmaAdapter, DmaMapping, LockedPages, MemoryLocker};
pub use event::Event;
pub use ib_types::status::NtStatus;
pub use irql::{Irql, IrqlQuery};
pub use mmio::Mmio;
pub use power::{DevicePowerState, SystemPowerState};
pub use registry::{RegValue, Registry, RegistryKey};
pub use request::{Request, RequestorMode};
pub use user::{CallerProcess, UserMapping};

/// Everything a driver core needs from its platform, as associated types.
///
/// A core is generic over one `P: Platform`; the KMDF shell provides the
/// Windows implementation and `sim-host` the simulated one.
pub trait Platform: Send + Sync + 'static {
    /// A spin lock: acquiring raises to DISPATCH_LEVEL, releasing restores
    /// the previous IRQL. Cores use it through [`SpinLock`].
    type RawSpinLock: lock_api::RawMutex + Send + Sync;
    /// A reader-writer spin lock (`EX_SPIN_LOCK`), used through
    /// [`RwSpinLock`]: lookups take it shared and never wait for each
    /// other, only for an exclusive holder.
    ///
    /// IRQL contract, as `ExAcquireSpinLockShared` /
    /// `ExAcquireSpinLockExclusive`:
    /// - Both modes may be acquired at or below DISPATCH_LEVEL; both raise
    ///   to DISPATCH_LEVEL and releasing restores the previous IRQL.
    /// - Any number of shared holders at once; an exclusive acquisition
    ///   waits until every shared holder has released (and keeps new ones
    ///   out while it waits), then excludes everyone.
    /// - No recursive acquisition in any mode combination: a thread that
    ///   holds the lock (shared or exclusive) must not acquire it again.
    ///   Exclusive-after-shared on one thread deadlocks on Windows, and a
    ///   second shared acquisition can deadlock behind a waiting exclusive
    ///   one.
    /// - No upgrade: a shared holder that needs exclusive access releases
    ///   and acquires exclusive, then re-checks what it looked up.
    type RawRwSpinLock: lock_api::RawRwLock + Send + Sync;
    /// The device's register BAR.
    type Mmio: Mmio;
    /// The device's DMA adapter.
    type Dma: DmaAdapter;
    /// Locks user or kernel buffers for DMA (MDLs on Windows).
    type Locker: MemoryLocker<Pages = <Self::Dma as DmaAdapter>::Pages>;
    /// Deferred work and time.
    type Deferred: Deferred;
    /// The device's registry keys.
    type Registry: Registry;
    /// An I/O request (a WDFREQUEST / IRP).
    type Request: Request;
    /// The IRQL of the calling thread.
    type Irql: IrqlQuery;
    /// An event a PASSIVE_LEVEL caller waits on (a `KEVENT`).
    type Event: Event;
    /// The user process a user-mode request came from, in its context
    /// ([`user`]).
    type Caller: CallerProcess<Mmio = Self::Mmio, Locker = Self::Locker>;
}

/// A spin lock protecting `T`, over the platform's raw spin lock.
pub type SpinLock<P, T> = lock_api::Mutex<<P as Platform>::RawSpinLock, T>;

/// The guard of a [`SpinLock`]; the IRQL stays raised while it lives.
pub type SpinLockGuard<'a, P, T> = lock_api::MutexGuard<'a, <P as Platform>::RawSpinLock, T>;

/// A reader-writer spin lock protecting `T`, over the platform's raw
/// reader-writer spin lock (see [`Platform::RawRwSpinLock`] for its IRQL
/// contract): `read` is shared acquisition, `write` exclusive.
pub type RwSpinLock<P, T> = lock_api::RwLock<<P as Platform>::RawRwSpinLock, T>;

/// The guard of a shared acquisition of a [`RwSpinLock`].
pub type RwSpinLockReadGuard<'a, P, T> =
    lock_api::RwLockReadGuard<'a, <P as Platform>::RawRwSpinLock, T>;

/// The guard of an exclusive acquisition of a [`RwSpinLock`].
pub type RwSpinLockWriteGuard<'a, P, T> =
    lock_api::RwLockWriteGuard<'a, <P as Platform>::RawRwSpinLock, T>;
