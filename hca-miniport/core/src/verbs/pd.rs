//! Protection domains (guide 6.2): AllocPd and DeallocPd over an
//! [`ObjectTable`](crate::resources::ObjectTable).
//!
//! Contract:
//! - A PD is a number (its table slot, 24-bit in contexts) with a
//!   generation-checked handle; the device keeps no PD object.
//! - Objects that live in a PD (QPs, MRs, AVs, MWs) record a use with
//!   [`Hca::reference_pd`] and drop it with [`Hca::release_pd`] (guide
//!   6.2.1, Figure 6-6's reference count). DeallocPd while any use is
//!   outstanding answers [`IbStatus::ResourceBusy`] and changes nothing
//!   (guide 6.8.3's rule for PDs).
//! - The guide's optional CQ-to-PD association (guide 4.4, note 3) is not
//!   used: the request surface creates CQs on the CA.

use driver_platform::{Platform, Request};
use ib_types::ioctl::{AllocPd, DeallocPd, Empty};
use ib_types::status::IbStatus;

use super::Accepted;
use crate::hca::Hca;
use crate::resources::{Handle, kind};

/// A protection domain. Its number is its table slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pd;

impl<P: Platform> Hca<P> {
    /// Records that an object lives in the PD `pd` (raw handle); returns the
    /// new use count. Fails with [`IbStatus::InvalidPdHandle`] for a stale
    /// handle.
    pub fn reference_pd(&self, pd: u64) -> Result<u32, IbStatus> {
        self.reference_object::<kind::Pd>(pd)
    }

    /// Drops a use recorded by [`reference_pd`](Self::reference_pd);
    /// returns the new use count.
    pub fn release_pd(&self, pd: u64) -> Result<u32, IbStatus> {
        self.release_object::<kind::Pd>(pd)
    }

    pub(crate) fn alloc_pd_request<R: Request>(&self, a: Accepted<AllocPd, R>) {
        if let Err(status) = self.check_ca(a.handle, a.mode) {
            a.responder.fail(status);
            return;
        }
        let made = self.with_objects_mut(|o| o.pds.insert_with(|_| Pd).map_err(IbStatus::from));
        match made.and_then(|r| r) {
            Ok(pd) => a
                .responder
                .finish(IbStatus::Success, pd.raw(), Some(&Empty), &[]),
            Err(status) => a.responder.fail(status),
        }
    }

    pub(crate) fn dealloc_pd_request<R: Request>(&self, a: Accepted<DeallocPd, R>) {
        let mode = a.mode;
        let removed = self.with_objects_mut(|o| {
            if !Self::ca_visible(o, mode) {
                return Err(IbStatus::InvalidPdHandle);
            }
            o.pds
                .remove(Handle::<kind::Pd>::from_raw(a.handle))
                .map(|_| ())
                .map_err(IbStatus::from)
        });
        match removed.and_then(|r| r) {
            Ok(()) => a.responder.finish(IbStatus::Success, 0, Some(&Empty), &[]),
            Err(status) => a.responder.fail(status),
        }
    }
}
