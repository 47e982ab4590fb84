//! The device object of the core: one [`Hca`] per HCA function, with the
//! platform entry points (ISR, DPC, timer) and the command submission that
//! the verbs build on.
//!
//! Contract:
//! - [`Hca::new`] builds the object without touching the device, so the
//!   KMDF shell (or a test) can create it inside `Arc::new_cyclic` and hand
//!   its DPC and timer routines a `Weak<Hca<P>>` (the shells do this in
//!   `EvtDevicePrepareHardware`); [`Hca::start`] then brings the device up
//!   (PASSIVE_LEVEL, `EvtDeviceD0EntryPostInterruptsEnabled`, once the
//!   framework connected the interrupts) and [`Hca::stop`] tears it down
//!   (`EvtDeviceReleaseHardware`); see [`crate::init`].
//! - The platform routes the device's interrupts to [`Hca::isr`] (DIRQL),
//!   queues the device's DPC when it returns true, and calls [`Hca::dpc`]
//!   from it and [`Hca::timer`] from the device's timer (both
//!   DISPATCH_LEVEL). The ISR must be connected before `start`, or the
//!   first interrupts are lost.
//! - Events reach the [`EventSink`] only from the DPC (and a command
//!   timeout from the timer routine), never from the ISR (guide 9).
//! - A device failure (catastrophic event, command timeout, or
//!   [`Hca::surprise_removed`]) is reported to the sink once; afterwards
//!   every command fails at once, and the verbs fail over to software
//!   ([`crate::verbs::fatal`]: QPs to ERR, posted WRs flushed, the client
//!   told, outstanding requests completed with an error, destroy still
//!   frees).
//! - Power: [`Hca::d0_exit`] and [`Hca::d0_entry`] (PASSIVE_LEVEL,
//!   `EvtDeviceD0ExitPreInterruptsDisabled`/`EvtDeviceD0EntryPostInterruptsEnabled`)
//!   take the device down and back keeping every client handle valid (the
//!   device itself loses its state in D3); see [`crate::init`] and
//!   [`crate::verbs::restore`].

use alloc::boxed::Box;
use alloc::sync::Arc;
use alloc::vec::Vec;
use core::sync::atomic::{AtomicBool, Ordering};

use driver_platform::{Deferred, DmaAdapter, Mmio, Platform, SpinLock};
use hca_prm::eqe::Event;
use hca_prm::regs::{Status, offset};

use crate::cmd::{Command, CommandCounters, CommandInterface, Continuation};
use crate::eq::{DeviceFailure, EqCounters, EventQueue, EventSink, dispatch_to_sink};
use crate::init::{BringUpReport, HcaConfig};

/// Returns a common buffer to the DMA adapter (`FreeCommonBuffer`). The
/// platform's `DmaAdapter` trait has no free operation, so the shell
/// supplies it.
pub type FreeCommonBuffer<P> =
    Box<dyn Fn(&<P as Platform>::Dma, <<P as Platform>::Dma as DmaAdapter>::Buffer) + Send + Sync>;

/// What the core needs from the platform for one HCA function.
pub struct HcaResources<P: Platform> {
    /// BAR0, mapped.
    pub bar0: P::Mmio,
    /// The function's DMA adapter.
    pub dma: P::Dma,
    /// The device's DPC, timer and clock.
    pub deferred: P::Deferred,
    /// MSI-X messages the PnP manager granted (at least 1).
    pub msix_vectors: u16,
    /// How to free a common buffer.
    pub free_common: FreeCommonBuffer<P>,
}

impl<P: Platform> core::fmt::Debug for HcaResources<P> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("HcaResources")
            .field("msix_vectors", &self.msix_vectors)
            .finish_non_exhaustive()
    }
}

/// Where the EQ's consumer stands, for diagnostics and fault-injection
/// tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EqPosition {
    /// Bus address of the ring's first entry.
    pub ring_bus_address: u64,
    /// `log2` of the ring's entries.
    pub log_entries: u8,
    /// The consumer counter: the next EQE the DPC will look at.
    pub consumer: u32,
}

/// One HCA function, generic over the platform.
pub struct Hca<P: Platform> {
    pub(crate) bar0: P::Mmio,
    pub(crate) dma: P::Dma,
    pub(crate) deferred: P::Deferred,
    pub(crate) msix_vectors: u16,
    pub(crate) free_common: FreeCommonBuffer<P>,
    pub(crate) config: HcaConfig,
    pub(crate) sink: Arc<dyn EventSink>,
    pub(crate) cmd: CommandInterface<P>,
    pub(crate) eq: EventQueue<P>,
    /// The context tables the device owns while running.
    pub(crate) tables: SpinLock<P, Vec<<P::Dma as DmaAdapter>::Buffer>>,
    pub(crate) report: SpinLock<P, Option<BringUpReport>>,
    pub(crate) failure: SpinLock<P, Option<DeviceFailure>>,
    /// Set once the failure was reported to the sink.
    failure_reported: AtomicBool,
    /// Set between [`Hca::d0_exit`] and the end of [`Hca::d0_entry`]: verbs
    /// are refused ([`ib_types::status::IbStatus::InvalidState`]).
    pub(crate) powered_down: AtomicBool,
    /// The bring-up report of the last D0 exit: D0 entry must find the same
    /// layout.
    pub(crate) saved_layout: SpinLock<P, Option<BringUpReport>>,
    /// The verb objects (`crate::verbs`).
    pub(crate) verbs: crate::verbs::Verbs<P>,
}

impl<P: Platform> core::fmt::Debug for Hca<P> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Hca")
            .field("cmd", &self.cmd)
            .field("eq", &self.eq)
            .field("failure", &*self.failure.lock())
            .finish_non_exhaustive()
    }
}

impl<P: Platform> Hca<P> {
    /// The device object, not yet touching the device. Events go to `sink`.
    pub fn new(resources: HcaResources<P>, config: HcaConfig, sink: Arc<dyn EventSink>) -> Self {
        Self {
            bar0: resources.bar0,
            dma: resources.dma,
            deferred: resources.deferred,
            msix_vectors: resources.msix_vectors,
            free_common: resources.free_common,
            cmd: CommandInterface::new(config.command_timeout_ns, config.max_command_polls),
            config,
            sink,
            eq: EventQueue::new(),
            tables: SpinLock::<P, _>::new(Vec::new()),
            report: SpinLock::<P, _>::new(None),
            failure: SpinLock::<P, _>::new(None),
            failure_reported: AtomicBool::new(false),
            powered_down: AtomicBool::new(false),
            saved_layout: SpinLock::<P, _>::new(None),
            verbs: crate::verbs::Verbs::new(),
        }
    }

    /// The ISR's entry point, at DIRQL: notes that `vector` fired and
    /// returns whether the platform must queue the DPC. Touches no ring
    /// and calls no client.
    pub fn isr(&self, vector: u16) -> bool {
        self.eq.note_interrupt(vector)
    }

    /// The DPC's entry point, at DISPATCH_LEVEL: drains the EQ, completes
    /// commands, delivers events to the sink, re-arms, and checks command
    /// timeouts.
    pub fn dpc(&self) {
        // Events software produced for clients (flushes, restored QPs'
        // errors) go out from here, at DISPATCH_LEVEL like the device's.
        self.deliver_soft_events();
        self.eq.drain(&self.bar0, |event| {
            // The verbs route CQ and port events to their clients first,
            // then pass every event on to `self.sink`.
            let router = crate::verbs::VerbsRouter { hca: self };
            match dispatch_to_sink(&router, event) {
                Some(Event::CmdCompletion {
                    token,
                    status,
                    out_imm,
                }) => {
                    let now = self.deferred.now_ns();
                    self.cmd.complete(&self.bar0, now, token, status, out_imm);
                }
                Some(Event::Catastrophic) => {
                    let status = Status::from_bits_retain(self.bar0.read32(offset::STATUS));
                    self.declare_failed(DeviceFailure::Catastrophic {
                        syndrome: status.fatal_syndrome(),
                    });
                }
                _ => {}
            }
        });
        self.watchdog();
    }

    /// The timer routine's entry point, at DISPATCH_LEVEL: the command
    /// watchdog.
    pub fn timer(&self) {
        self.watchdog();
    }

    /// Submits a command (see [`CommandInterface::submit`]): never blocks;
    /// `continuation` runs from the DPC when the device answers, or with an
    /// error on a timeout or failure. Callable at DISPATCH_LEVEL or below.
    pub fn submit(&self, command: Command, continuation: Continuation) {
        let now = self.deferred.now_ns();
        self.cmd.submit(&self.bar0, now, command, continuation);
        self.arm_watchdog();
    }

    /// Fails outstanding commands that are overdue, then arms the timer
    /// for the next deadline.
    fn watchdog(&self) {
        if let Some(opcode) = self.cmd.check_timeouts(self.deferred.now_ns()) {
            self.declare_failed(DeviceFailure::CommandTimeout { opcode });
        }
        self.arm_watchdog();
    }

    fn arm_watchdog(&self) {
        self.deferred.set_timer(self.cmd.next_deadline_ns());
    }

    /// Marks the device failed: commands fail from now on, and the sink
    /// hears of it once.
    pub(crate) fn declare_failed(&self, failure: DeviceFailure) {
        // The first failure is the one kept and reported, whichever of two
        // racing reporters gets to the sink.
        let first = *self.failure.lock().get_or_insert(failure);
        self.cmd.fail();
        if !self.failure_reported.swap(true, Ordering::AcqRel) {
            self.fail_verbs();
            self.sink.device_failed(first);
        }
    }

    /// The shell's `EvtDeviceSurpriseRemoval`: the device is gone, so it is
    /// declared failed ([`DeviceFailure::SurpriseRemoval`]) with everything
    /// that implies for the verbs. The events for the client are delivered
    /// before this returns, from the caller's context (PASSIVE_LEVEL in the
    /// shell's callback, or DISPATCH_LEVEL): D0 exit and release-hardware
    /// follow at once, and no DPC may run after them.
    pub fn surprise_removed(&self) {
        self.declare_failed(DeviceFailure::SurpriseRemoval);
        self.deliver_soft_events();
    }

    /// Whether the failure was reported, lock-free: set before the verbs
    /// fail over (`verbs::fatal` flushes under each ring's lock), so a post
    /// that reads it false under its ring lock is flushed with the rest.
    pub(crate) fn failure_reported(&self) -> bool {
        self.failure_reported.load(Ordering::Acquire)
    }

    /// Whether the device is between [`Hca::d0_exit`] and the end of
    /// [`Hca::d0_entry`] (for the shells: a D0 entry then restores rather
    /// than starts).
    pub fn is_below_d0(&self) -> bool {
        self.powered_down.load(Ordering::Acquire)
    }

    /// The failure the device was declared in, if any.
    pub fn failure(&self) -> Option<DeviceFailure> {
        *self.failure.lock()
    }

    /// What bring-up found and chose, while started.
    pub fn report(&self) -> Option<BringUpReport> {
        *self.report.lock()
    }

    /// The command interface's counters.
    pub fn command_counters(&self) -> CommandCounters {
        self.cmd.counters()
    }

    /// Command slots (the bound on outstanding commands); 0 when stopped.
    pub fn command_slots(&self) -> usize {
        self.cmd.slot_count()
    }

    /// Event processing counters.
    pub fn eq_counters(&self) -> EqCounters {
        self.eq.counters()
    }

    /// Where the EQ's consumer stands, while started.
    pub fn eq_position(&self) -> Option<EqPosition> {
        self.eq.position()
    }

    /// The configuration.
    pub fn config(&self) -> &HcaConfig {
        &self.config
    }

    /// Clears the failure marks for a new start.
    pub(crate) fn reset_failure(&self) {
        *self.failure.lock() = None;
        self.failure_reported.store(false, Ordering::Release);
    }
}
