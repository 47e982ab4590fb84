//! User-mode verbs provider (UVP) for the project's HCA: the kernel-bypass
//! fast path — post send, post receive, post SRQ receive, poll CQ, arm CQ —
//! on rings in the process's own memory and the context's UAR page
//! (PRM 9, 10, 13). `docs/uvp.md` describes it.
//!
//! Layer contract:
//! - No call here enters the kernel. The control path (creating the
//!   context, CQs, QPs and SRQs through the proxy) hands this crate what
//!   the kernel answered ([`Context::new`], [`Context::cq`],
//!   [`Context::qp`], [`Context::srq`]); from then on every post, poll and
//!   arm is loads and stores on shared memory and one doorbell store.
//! - Shared memory is touched only in [`dma`] (64-bit atomics through raw
//!   pointers, named barriers) and the device only in [`mmio`] (one 64-bit
//!   store on the UAR page; on Linux through a hook the simulator hands
//!   over). Those two modules hold every `unsafe` block.
//! - Thread safety, made true by the types: every object is `Send`; posts
//!   and polls take `&mut` of their own queue or CQ, so a queue has one
//!   poster and a CQ one poller at a time, and posters and pollers share
//!   no lock (they meet only in atomics, `queue`'s protocol).
//! - Every refused post says how many requests went before it and leaves
//!   nothing of the refused one in the ring ([`PostError`]).
//!
//! The control path is [`provider::Provider`]: the pre/post hooks of every
//! proxy verb (guide Table 10-1) behind `ib_types::uvp::UserVerbsProvider`,
//! which allocate the rings, build the objects above from the kernel's
//! answers and keep user address vectors in user mode. The `faults` module
//! (feature `fault-injection`, tests only) wraps a provider to force each
//! row of Table 10-1.

pub mod context;
pub mod cq;
pub mod dma;
pub mod error;
pub mod export;
#[cfg(feature = "fault-injection")]
pub mod faults;
pub mod mmio;
pub mod provider;
pub mod qp;
mod queue;
pub mod srq;
mod sync;

pub use context::{Context, QpCreated};
pub use cq::{ArmFor, Cq};
pub use error::{PostError, PostErrorKind, SetupError};
pub use mmio::UarPage;
pub use provider::{CqFastPath, Platform, Provider, QpFastPath, SrqFastPath, UserMemory};
pub use qp::{Qp, RecvQueue, SendQueue, SendRequest};
pub use srq::Srq;

// The thread-safety the module docs promise, checked by the compiler:
// every object may move to another thread; the context (shared by the
// objects' setup) and the UAR page may be shared.
const _: () = {
    const fn send<T: Send>() {}
    const fn sync<T: Sync>() {}
    send::<Cq>();
    send::<Qp>();
    send::<SendQueue>();
    send::<RecvQueue>();
    send::<Srq>();
    send::<Context>();
    sync::<Context>();
    sync::<UarPage>();
};
