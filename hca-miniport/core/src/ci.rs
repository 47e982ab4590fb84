//! The CI interface (guide 4; docs/miniport.md "ci"): what the miniport
//! hands the bus filter above it for `IRP_MN_QUERY_INTERFACE` with
//! `ib_types::interface::GUID_IB_CI_INTERFACE`.
//!
//! [`CiProvider`] is the Rust side of the interface, one per HCA. Both
//! shells hand it out; they differ only in the wrapping:
//! - the KMDF shell builds the FFI table `ib_types::interface::CiInterface`
//!   (`extern "system"` entry points, the provider behind its `context`,
//!   `InterfaceReference`/`InterfaceDereference` counting an `Arc`), whose
//!   entry points call the methods below one for one;
//! - the simulated host's shell (`sim_shells::hca_miniport`) answers the query
//!   with the provider itself (an `Arc<CiProvider<SimPlatform>>` inside the
//!   host's counted `InterfaceRef`): in one Rust process there is no ABI
//!   to cross, and the host counts the reference the FFI header would.
//!
//! Contract, entry by entry:
//! - **Version.** [`CiProvider::VERSION`] is `CI_INTERFACE_VERSION`. As
//!   `IRP_MN_QUERY_INTERFACE` requires, a query is answered with the
//!   closest version supported not above the one asked for
//!   ([`CiProvider::answer_version`]), or not at all if that is lower than
//!   any supported; the consumer checks what it got
//!   ([`CiProvider::check_version`]: same major, at least the minor).
//! - **Identity.** [`CiProvider::identity`] (CA GUID, vendor, device,
//!   revision, from `QUERY_DEV_CAP`) and [`CiProvider::uvp_name`] (the
//!   user-mode verbs provider user mode must load for this HCA,
//!   [`UVP_NAME`]).
//! - **Open/close.** [`CiProvider::open_ca`] registers the client's
//!   callbacks ([`CaClient`]: called from the DPC at DISPATCH_LEVEL, never
//!   after close returned); one open at a time. [`CiProvider::close_ca`]
//!   is PASSIVE_LEVEL only (it waits for callbacks in flight).
//! - **Control verbs.** [`CiProvider::submit`] takes a request carrying
//!   an `ib_types::ioctl` verb code and buffers in the same framing as the
//!   user-mode proxy IOCTLs, and sends it along the provider's
//!   [`SubmitRoute`]: the shell's path into the miniport's own device, so
//!   the request reaches the core exactly as an IOCTL does — through the
//!   miniport's power-managed queue, as the miniport's own request (a
//!   request is completed only by its owner), then `Hca::submit_request`.
//!   The KMDF shell's route passes the consumer's IRP to its device object
//!   (`IoCallDriver`); the simulated shell's sends the request to its own
//!   stack (`DeviceServices::send_to_own_device`). So, as on Windows, a
//!   request submitted while the device is below D0 is held by the queue
//!   and runs after D0 entry, and one in flight when the device leaves D0
//!   meets `EvtIoStop` ([`crate::verbs::on_queue_stop`]): a control verb
//!   finishes before D0 exit, a wait is kept pending. It never blocks and
//!   may be called at DISPATCH_LEVEL; the request is completed exactly
//!   once with the verb's status and, for creates, the new handle in the
//!   response header — at once, or later (from the DPC or work item while
//!   a device command or a common-buffer allocation is outstanding, or
//!   after resume); `submit` returns what the route reports at once
//!   (`IoCallDriver`'s status, `STATUS_PENDING` when it completes later).
//! - **Synchronous wrapper.** [`CiProvider::submit_and_wait`] is for
//!   PASSIVE_LEVEL callers: it submits along the same route and waits on
//!   the caller's event, which the caller arranged to be set by the
//!   request's completion (the `Event` of `IoBuildDeviceIoControlRequest`;
//!   a completion routine on the simulated host). Above PASSIVE_LEVEL it
//!   refuses (the request is not submitted but handed back) rather than
//!   wait.
//! - **Fast path.** [`CiProvider::post_send`], [`CiProvider::post_recv`],
//!   [`CiProvider::post_srq_recv`], [`CiProvider::poll_cq`],
//!   [`CiProvider::arm_cq`]: direct calls, DISPATCH_LEVEL, no allocation,
//!   no request. A UD send names its destination by an AV handle
//!   (`CreateAv`), resolved here. An INLINE send's SGEs are kernel
//!   virtual addresses of resident memory (as IBAL's inline option): the
//!   core copies their bytes into the WQE through the shell's kernel
//!   memory access (`MemoryLocker::read_kernel`), up to the QP's granted
//!   `max_inline_data`, under the ring lock; every other SGE is a registered address the
//!   device translates, never dereferenced by the CPU.

use alloc::sync::Arc;

use driver_platform::{Event, Irql, IrqlQuery, Platform};
use ib_types::interface::{CI_INTERFACE_VERSION, InterfaceVersion, UvpName};
use ib_types::scalars::NodeGuid;
use ib_types::status::{IbStatus, NtStatus};
use ib_types::wc::WorkCompletion;
use ib_types::wr::{RecvWr, SendWr};

use crate::hca::Hca;
use crate::verbs::{CaClient, CqNotify, UVP_NAME};

/// UD send WRs handed to the core per doorbell by [`CiProvider::post_send`]
/// (their AVs resolved into a stack array: the fast path does not
/// allocate).
const SEND_BATCH: usize = 16;

/// [`UVP_NAME`] as the interface carries it, checked when the crate is
/// compiled (a name the rules refuse fails the build, not a caller).
const UVP: UvpName = match UvpName::new(UVP_NAME) {
    Ok(name) => name,
    Err(_) => panic!("UVP_NAME is not a valid bare DLL name"),
};

/// The name of the user-mode verbs provider for this miniport's HCAs
/// ([`UVP_NAME`]), as the interface carries it.
pub const fn uvp_name() -> UvpName {
    UVP
}

pub use ib_types::ca::CaIdentity;

/// The path [`CiProvider::submit`] sends a consumer's request along: into
/// the miniport's own device, whose power-managed queue delivers it to the
/// core as the miniport's own request (see the module doc). Each shell
/// supplies one; `R` is what crosses the interface (an IRP for the KMDF
/// shell, the platform's request on the simulated host).
pub trait SubmitRoute<R>: Send + Sync {
    /// Sends `request` to the miniport's own device. Never blocks;
    /// callable at DISPATCH_LEVEL. Returns the status the path reports at
    /// once: `IoCallDriver`'s, or [`NtStatus::PENDING`] when completion is
    /// reported only through the request (the caller then learns the
    /// result from its completion, whenever that comes).
    fn send(&self, request: R) -> NtStatus;
}

/// The CI interface of one HCA (see the module doc). `R` is the request
/// type its [`SubmitRoute`] carries.
pub struct CiProvider<P: Platform, R = <P as Platform>::Request> {
    hca: Arc<Hca<P>>,
    route: Arc<dyn SubmitRoute<R>>,
}

impl<P: Platform, R> core::fmt::Debug for CiProvider<P, R> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("CiProvider")
            .field("version", &Self::VERSION)
            .finish_non_exhaustive()
    }
}

impl<P: Platform, R> CiProvider<P, R>
where
    P::Request: 'static,
{
    /// The version this provider implements.
    pub const VERSION: InterfaceVersion = CI_INTERFACE_VERSION;

    /// The provider of `hca`, whose control verbs go along `route` (the
    /// shell's path into its own device's queue).
    pub fn new(hca: Arc<Hca<P>>, route: Arc<dyn SubmitRoute<R>>) -> Self {
        Self { hca, route }
    }

    /// The version a query for `asked` is answered with: the closest this
    /// provider supports not above it (it supports one, [`Self::VERSION`]),
    /// or `None` when `asked` is below it.
    pub fn answer_version(asked: InterfaceVersion) -> Option<InterfaceVersion> {
        (Self::VERSION.packed() <= asked.packed()).then_some(Self::VERSION)
    }

    /// Whether this provider can serve a consumer that needs `required`
    /// (same major version, at least the minor); else
    /// [`IbStatus::InvalidParameter`].
    pub fn check_version(required: InterfaceVersion) -> Result<(), IbStatus> {
        if Self::VERSION.satisfies(required) {
            Ok(())
        } else {
            Err(IbStatus::InvalidParameter)
        }
    }

    /// The device behind the interface.
    pub fn hca(&self) -> &Arc<Hca<P>> {
        &self.hca
    }

    /// The name of the user-mode verbs provider for this HCA.
    pub fn uvp_name(&self) -> UvpName {
        UVP
    }

    /// The CA's identity; [`IbStatus::InvalidState`] while the device is
    /// not started. Below D0 it is answered from the bring-up report saved
    /// at D0 exit: the identity does not change across sleep (D0 entry
    /// fails the device if the layout came back different).
    pub fn identity(&self) -> Result<CaIdentity, IbStatus> {
        let report = self.hca.report().or_else(|| *self.hca.saved_layout.lock());
        let cap = report.ok_or(IbStatus::InvalidState)?.capabilities;
        Ok(CaIdentity {
            ca_guid: NodeGuid::new(cap.node_guid.get()),
            vendor_id: cap.vendor_id.get() & 0x00FF_FFFF,
            device_id: cap.device_id.get(),
            revision: cap.revision.get(),
        })
    }

    /// Opens the CA for the consumer and registers its callbacks; returns
    /// the CA handle. [`IbStatus::ResourceBusy`] while open,
    /// [`IbStatus::InvalidState`] while the device is not started.
    /// Callable at DISPATCH_LEVEL.
    pub fn open_ca(&self, client: Arc<dyn CaClient>) -> Result<u64, IbStatus> {
        self.hca.open_ca(Some(client))
    }

    /// Closes the CA: refused with [`IbStatus::ResourceBusy`] while PDs or
    /// CQs live; on success no callback runs after it returns.
    /// PASSIVE_LEVEL (it waits for callbacks in flight).
    pub fn close_ca(&self, ca: u64) -> Result<(), IbStatus> {
        self.hca.close_ca(ca)
    }

    /// Sends one control verb request along the route into the
    /// miniport's queue (see the module doc); returns what the route
    /// reports at once ([`SubmitRoute::send`]). Callable at DISPATCH_LEVEL;
    /// never blocks.
    pub fn submit(&self, request: R) -> NtStatus {
        self.route.send(request)
    }

    /// Submits `request` (as [`Self::submit`]: through the queue, so below
    /// D0 the wait lasts until the device is back) and waits until
    /// `completed` is set, which the
    /// caller arranged to happen when the request completes. PASSIVE_LEVEL
    /// only: at a higher IRQL (`irql` says which) the request comes back
    /// unsubmitted in `Err`, for the caller to complete or submit
    /// asynchronously.
    pub fn submit_and_wait(
        &self,
        irql: &P::Irql,
        request: R,
        completed: &P::Event,
    ) -> Result<(), R> {
        if irql.current_irql() != Irql::PASSIVE {
            return Err(request);
        }
        self.route.send(request);
        completed.wait();
        Ok(())
    }

    /// Posts send WRs to the kernel QP `qp`; returns how many were posted
    /// and the status of the first that was not (earlier ones stay
    /// posted). A UD WR's AV handle is resolved to the device's address
    /// vector ([`IbStatus::InvalidAvHandle`] if stale). An INLINE WR's
    /// SGEs are kernel virtual addresses of resident memory whose bytes
    /// the core copies into the WQE ([`Hca::post_kernel_sends`]); more
    /// than the QP's granted `max_inline_data` is refused by the core's
    /// checks with [`IbStatus::InvalidParameter`], nothing of it posted.
    /// Callable at DISPATCH_LEVEL; no allocation. WRs for a connected QP
    /// go to the core in one call (one doorbell), one WR without a batch's
    /// set-up ([`Hca::post_kernel_send`]); UD WRs `SEND_BATCH` at
    /// a time, their AVs resolved into a stack array first (the object
    /// tables are never looked up under a ring lock).
    #[inline]
    pub fn post_send(&self, qp: u64, wrs: &[SendWr<'_>]) -> (usize, IbStatus) {
        if wrs.is_empty() {
            // Nothing to post, nothing looked up (as a batch loop that
            // never runs).
            return (0, IbStatus::Success);
        }
        if let [wr] = wrs
            && wr.ud.is_none()
        {
            // One WR to a connected QP, the common call: no batch set-up.
            return self.hca.post_kernel_send(qp, wr, None);
        }
        if wrs.iter().all(|wr| wr.ud.is_none()) {
            return self
                .hca
                .post_kernel_sends(qp, wrs.iter().map(|wr| (wr, None)));
        }
        self.post_ud_sends(qp, wrs)
    }

    /// [`post_send`](Self::post_send) of a batch with UD WRs: their AVs
    /// resolved `SEND_BATCH` at a time into a stack array, apart so a
    /// connected QP's post does not set up that array's frame.
    #[inline(never)]
    fn post_ud_sends(&self, qp: u64, wrs: &[SendWr<'_>]) -> (usize, IbStatus) {
        let mut posted = 0;
        for batch in wrs.chunks(SEND_BATCH) {
            let mut avs = [None; SEND_BATCH];
            let mut ready = 0;
            let mut refusal = None;
            for (wr, av) in batch.iter().zip(avs.iter_mut()) {
                if let Some(dest) = wr.ud {
                    match self.hca.av_for_post(dest.av.raw()) {
                        Some(found) => *av = Some(found),
                        None => {
                            refusal = Some(IbStatus::InvalidAvHandle);
                            break;
                        }
                    }
                }
                ready += 1;
            }
            if ready > 0 {
                let requests = batch[..ready]
                    .iter()
                    .zip(avs.iter())
                    .map(|(wr, av)| (wr, av.as_ref()));
                let (done, status) = self.hca.post_kernel_sends(qp, requests);
                posted += done;
                if status != IbStatus::Success {
                    return (posted, status);
                }
            }
            if let Some(status) = refusal {
                return (posted, status);
            }
        }
        (posted, IbStatus::Success)
    }

    /// Posts receive WRs to the kernel QP `qp` (as
    /// [`Hca::post_recv`]). Callable at DISPATCH_LEVEL.
    pub fn post_recv(&self, qp: u64, wrs: &[RecvWr<'_>]) -> (usize, IbStatus) {
        self.hca.post_recv(qp, wrs)
    }

    /// Posts receive WRs to the kernel SRQ `srq` (as
    /// [`Hca::post_srq_recv`]). Callable at DISPATCH_LEVEL.
    pub fn post_srq_recv(&self, srq: u64, wrs: &[RecvWr<'_>]) -> (usize, IbStatus) {
        let (posted, status) = self.hca.post_srq_recv(srq, wrs);
        (posted as usize, status)
    }

    /// Polls up to `wcs.len()` completions of the CQ `cq`; returns how
    /// many. Callable at DISPATCH_LEVEL.
    pub fn poll_cq(&self, cq: u64, wcs: &mut [WorkCompletion]) -> Result<usize, IbStatus> {
        self.hca.poll_cq(cq, wcs)
    }

    /// Arms the CQ `cq` for one completion event. Callable at
    /// DISPATCH_LEVEL.
    pub fn arm_cq(&self, cq: u64, notify: CqNotify) -> Result<(), IbStatus> {
        self.hca.arm_cq(cq, notify)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_uvp_name_is_a_valid_bare_name() {
        assert_eq!(UvpName::new(UVP_NAME).unwrap().as_str(), UVP_NAME);
    }
}
