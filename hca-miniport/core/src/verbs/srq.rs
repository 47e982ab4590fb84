//! Shared receive queues (PRM 6.4, 9.2, 10.3): being built; every SRQ
//! verb answers [`IbStatus::Unsupported`](ib_types::status::IbStatus) for
//! now.

use core::marker::PhantomData;

use driver_platform::Platform;

/// A shared receive queue.
pub struct Srq<P: Platform> {
    platform: PhantomData<fn() -> P>,
}

impl<P: Platform> core::fmt::Debug for Srq<P> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Srq").finish_non_exhaustive()
    }
}
