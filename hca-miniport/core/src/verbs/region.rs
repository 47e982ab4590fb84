//! Memory region verbs (guide 7.1, Table 4-1): RegMr, RegPhysMr,
//! RegSharedMr, ReregMr, ReregPhysMr, QueryMr and DeregMr as thin
//! request-path verbs over [`MemoryTranslation`], which does the work
//! (locking, mapping, MTT, MPT commands, undo on failure).
//!
//! Contract:
//! - **Handles.** A region's handle is generation-checked like every other
//!   kind, and its number is the region's MPT index (stable across
//!   re-registration, `mr` module doc): the entry is stored at that index
//!   of the MR table. A stale handle, or a handle of another kind, is
//!   [`IbStatus::InvalidMrHandle`]; a region of a kernel CA is invisible
//!   to a user request.
//! - **PD uses** (guide 7.1.1.1, 7.1.1.3): a region holds one use of its PD
//!   from the moment its registration is accepted until it is deregistered
//!   (or the registration fails), so DeallocPd answers
//!   [`IbStatus::ResourceBusy`] meanwhile. A re-registration to another PD
//!   takes a use of the new PD first and drops the old PD's only once the
//!   device switched the entry; a failed one drops the new use and leaves
//!   the old.
//! - **One operation at a time.** A re-registration or deregistration holds
//!   the region until its commands complete; meanwhile every verb on it
//!   answers [`IbStatus::ResourceBusy`] and changes nothing.
//! - **Deregistration with windows bound** is refused with
//!   [`IbStatus::ResourceBusy`], the region unchanged: the device keeps the
//!   count of windows bound to each region (PRM 7.1 `window_count`, raised
//!   and lowered by the bind WQEs it executes) and answers `HW2SW_MPT` of
//!   such a region with `RESOURCE_BUSY`, which `mr` hands back with the
//!   region intact. The core cannot count binds itself: a bind posted is
//!   not a bind done (the device may fail it with `MW_BIND_ERR`).
//! - **Caller context** (`mr` module doc, IRQL): locking the pages of a
//!   virtual registration is the one synchronous step; kernel pages may be
//!   locked at DISPATCH_LEVEL with the locker the shell installed with
//!   [`Hca::set_kernel_locker`]; *user* pages only at PASSIVE_LEVEL (or
//!   APC_LEVEL) in the requesting thread's process. A user request
//!   carries its caller ([`Hca::prepare_user_request`], the one
//!   caller-context path, which locks the range there): `verbs::user`
//!   checks that the caller owns the PD or region, and registers or
//!   re-registers with the pages locked in the caller's context and its
//!   IRQL (`verbs::caller::CallerLocks`). A user
//!   registration without its caller (plain [`Hca::submit_request`])
//!   answers [`IbStatus::InvalidState`], as does any kernel registration
//!   before a kernel locker is installed. Close of a user context
//!   deregisters what it still holds.
//! - **Query** is answered from the region the core keeps (guide 7.1.1.4:
//!   "obtained from the region handle maintained by the driver"): PD,
//!   range, rights and keys, no command.
//! - **Physical** registrations (kernel only) use the requested I/O
//!   virtual address as given; RegPhysOut and RegSharedOut answer the
//!   address actually used.
//! - **Re-registration** (guide 7.1.1.3): ReregMr and ReregPhysMr (Table
//!   4-1 "Reregister Physical Memory", kernel only) are one path
//!   (`reregister_region`, then `MemoryTranslation::reregister`): each
//!   changes any of translation, rights and PD and keeps the rest; they
//!   differ only in the new translation (a virtual range; a page list, the
//!   private input, for a region registered either way) and the answer
//!   (keys; keys and I/O virtual address). The handle stays (its number is
//!   the MPT index); the keys are new (the tag moves on, `mr`); the PD use
//!   moves as above. The kernel locker must be installed for either (it
//!   locks only a new virtual range). A failed re-registration leaves the
//!   region as it was.

use alloc::boxed::Box;
use alloc::sync::{Arc, Weak};
use alloc::vec::Vec;

use driver_platform::{Irql, Platform, Request, RequestorMode};
use ib_types::access::AccessFlags;
use ib_types::handle::PdHandle;
use ib_types::ioctl::{
    DeregMr, QueryMr, RegMr, RegPhysMr, RegPhysOut, RegSharedMr, RegSharedOut, ReregMr,
    ReregPhysMr, Verb, decode_request,
};
use ib_types::mr::{MrKeys, MrQuery};
use ib_types::status::IbStatus;

use super::{Accepted, Responder};
use crate::hca::Hca;
use crate::mr::{
    DynLocker, MemoryRegion, MemoryTranslation, NewTranslation, PhysicalPages, PhysicalRegion,
    RegionContinuation, Reregistration, SharedRegion, VirtualRegion,
};
use crate::resources::{Handle, kind};

/// A registered region in the MR table.
pub(crate) struct MrEntry<P: Platform> {
    /// The region; `None` while a re-registration or deregistration has it.
    region: Option<MemoryRegion<P>>,
    /// The PD (raw handle) whose use the region holds.
    pd: u64,
}

/// A locker to use for one request, and the IRQL to tell `mr`.
enum Locking<'a, P: Platform> {
    Caller(&'a DynLocker<P>, Irql),
    Kernel(Arc<P::Locker>),
}

/// The pages a user request locked in its caller's context, and the IRQL
/// it locked them at (`verbs::caller`).
pub(crate) type CallerLocking<'a, P> = (&'a DynLocker<P>, Irql);

impl<P: Platform> Locking<'_, P> {
    fn parts(&self) -> (&DynLocker<P>, Irql) {
        match self {
            Self::Caller(locker, irql) => (*locker, *irql),
            // A kernel client may call at DISPATCH_LEVEL; kernel pages are
            // non-paged and lockable there (`mr`'s ceiling for them).
            Self::Kernel(locker) => (&**locker, Irql::DISPATCH),
        }
    }
}

fn keys_of<P: Platform>(region: &MemoryRegion<P>) -> MrKeys {
    MrKeys {
        lkey: region.lkey(),
        rkey: region.rkey(),
    }
}

/// The keys and the I/O virtual address of a region (RegPhysMr's and
/// ReregPhysMr's answer).
fn phys_out_of<P: Platform>(region: &MemoryRegion<P>) -> RegPhysOut {
    RegPhysOut {
        keys: keys_of(region),
        iova: region.start(),
    }
}

/// What a ReregMr or ReregPhysMr request asks of region `mr`.
struct ReregRequest<'a> {
    mr: u64,
    mode: RequestorMode,
    pd: Option<PdHandle>,
    access: Option<AccessFlags>,
    translation: Option<NewTranslation<'a>>,
}

impl<P: Platform> Hca<P> {
    /// The access rights of the region `raw` (a raw MR handle), if it is
    /// registered and not busy.
    pub(crate) fn region_access(&self, raw: u64) -> Option<AccessFlags> {
        self.with_objects(|o| {
            o.mrs
                .get(Handle::<kind::Mr>::from_raw(raw))
                .and_then(|entry| entry.region.as_ref().map(MemoryRegion::access))
        })
        .ok()
        .flatten()
    }

    /// Installs the locker the core uses for kernel-mode registrations
    /// (kernel memory is non-paged and may be locked in any context at
    /// DISPATCH_LEVEL or below). The shell calls it once after start.
    pub fn set_kernel_locker(&self, locker: P::Locker) {
        *self.verbs.kernel_locker.lock() = Some(Arc::new(locker));
    }

    /// The locker for a request of `mode`: the calling process's when the
    /// request carries its caller (a user request, served in that
    /// process's context), else the kernel locker.
    fn locking<'a>(
        &self,
        mode: RequestorMode,
        caller: Option<CallerLocking<'a, P>>,
    ) -> Result<Locking<'a, P>, IbStatus> {
        match (caller, mode) {
            (Some((locker, irql)), _) => Ok(Locking::Caller(locker, irql)),
            (None, RequestorMode::Kernel) => self
                .verbs
                .kernel_locker
                .lock()
                .clone()
                .map(Locking::Kernel)
                .ok_or(IbStatus::InvalidState),
            (None, RequestorMode::User) => Err(IbStatus::InvalidState),
        }
    }

    /// Takes a use of the PD `pd` for a new region of a `mode` request;
    /// returns the PD's number and the translation service.
    fn take_region_pd(
        &self,
        pd: u64,
        mode: RequestorMode,
    ) -> Result<(u32, MemoryTranslation<P>), IbStatus> {
        self.with_objects_mut(|o| {
            if !Self::ca_visible(o, mode) {
                return Err(IbStatus::InvalidPdHandle);
            }
            let handle = Handle::<kind::Pd>::from_raw(pd);
            o.pds.acquire(handle).map_err(IbStatus::from)?;
            Ok((handle.number(), o.mtt.clone()))
        })?
    }

    /// Stores a fresh region at its MPT index and answers the request;
    /// if it cannot be stored (the device was stopped meanwhile, so it
    /// forgot the entry) the region's host resources are released and the
    /// PD use dropped.
    fn install_region<V: ib_types::ioctl::Verb>(
        self: &Arc<Self>,
        mt: &MemoryTranslation<P>,
        region: MemoryRegion<P>,
        pd: u64,
        responder: Responder<V, P::Request>,
        out: &V::Out,
    ) {
        match self.store_region(mt, region, pd) {
            Ok(handle) => responder.finish(IbStatus::Success, handle, Some(out), &[]),
            Err(status) => responder.fail(status),
        }
    }

    /// The continuation of a registration that took a use of PD `pd`: a
    /// new region is stored and answered with `out_of(&region)`; a failure
    /// drops the PD use and fails the request. Nothing is done once the
    /// HCA is gone.
    fn install_when_registered<V: ib_types::ioctl::Verb>(
        self: &Arc<Self>,
        mt: &MemoryTranslation<P>,
        pd: u64,
        responder: Responder<V, P::Request>,
        out_of: fn(&MemoryRegion<P>) -> V::Out,
    ) -> RegionContinuation<P> {
        let (weak, mt) = (Arc::downgrade(self), mt.clone());
        Box::new(move |result| {
            let Some(hca) = Weak::upgrade(&weak) else {
                return;
            };
            match result {
                Ok(region) => {
                    let out = out_of(&region);
                    hca.install_region(&mt, region, pd, responder, &out);
                }
                Err(error) => {
                    let _ = hca.release_pd(pd);
                    responder.fail(error.ib_status());
                }
            }
        })
    }

    /// Stores a fresh region at its MPT index and returns its handle; if it
    /// cannot be stored its host resources are released and the PD use
    /// dropped.
    pub(super) fn store_region(
        self: &Arc<Self>,
        mt: &MemoryTranslation<P>,
        region: MemoryRegion<P>,
        pd: u64,
    ) -> Result<u64, IbStatus> {
        let index = region.mpt_index();
        let mut slot = Some(region);
        let stored = self.with_objects_mut(|o| {
            if o.mrs.get_by_number(index).is_some() {
                return Err(IbStatus::InvalidState);
            }
            o.mrs
                .insert_at_with(index, |_| MrEntry {
                    region: slot.take(),
                    pd,
                })
                .map_err(IbStatus::from)
        });
        match stored.and_then(|r| r) {
            Ok(handle) => Ok(handle.raw()),
            Err(status) => {
                let _ = self.release_pd(pd);
                if let Some(region) = slot.take() {
                    mt.release_after_reset(self, region);
                }
                Err(status)
            }
        }
    }

    /// Takes the region out of its entry for an operation (`None` in its
    /// place marks it busy); returns it, its PD and the translation service.
    fn take_region(
        &self,
        mr: u64,
        mode: RequestorMode,
    ) -> Result<(MemoryRegion<P>, u64, MemoryTranslation<P>), IbStatus> {
        self.with_objects_mut(|o| {
            if !Self::ca_visible(o, mode) {
                return Err(IbStatus::InvalidMrHandle);
            }
            let mt = o.mtt.clone();
            let entry = o
                .mrs
                .get_mut(Handle::<kind::Mr>::from_raw(mr))
                .ok_or(IbStatus::InvalidMrHandle)?;
            let region = entry.region.take().ok_or(IbStatus::ResourceBusy)?;
            Ok((region, entry.pd, mt))
        })?
    }

    /// Puts a region back into its entry, with its (possibly new) PD.
    /// Returns the region if the entry is gone (the device was stopped).
    fn put_region(&self, mr: u64, region: MemoryRegion<P>, pd: u64) -> Result<(), MemoryRegion<P>> {
        let mut slot = Some(region);
        let _ = self.with_objects_mut(|o| {
            if let Some(entry) = o.mrs.get_mut(Handle::<kind::Mr>::from_raw(mr)) {
                entry.region = slot.take();
                entry.pd = pd;
            }
        });
        match slot {
            None => Ok(()),
            Some(region) => Err(region),
        }
    }

    /// Removes a region's entry (after its deregistration or loss).
    fn forget_region(&self, mr: u64) {
        let _ = self.with_objects_mut(|o| o.mrs.remove(Handle::<kind::Mr>::from_raw(mr)));
    }

    /// Every region still registered, taken out of the table (teardown:
    /// the device no longer uses their entries).
    pub(crate) fn take_all_regions(objects: &mut super::Objects<P>) -> Vec<MemoryRegion<P>> {
        let handles: Vec<Handle<kind::Mr>> = objects.mrs.iter().map(|(h, _)| h).collect();
        handles
            .into_iter()
            .filter_map(|h| objects.mrs.remove(h).ok())
            .filter_map(|entry| entry.region)
            .collect()
    }

    pub(crate) fn reg_mr_request(
        self: &Arc<Self>,
        a: Accepted<RegMr, P::Request>,
        caller: Option<CallerLocking<'_, P>>,
    ) {
        // A kernel region's PD is a kernel one (a user context's: `verbs::user`).
        if let Err(status) = self.refuse_user_parents(&[(a.handle, IbStatus::InvalidPdHandle)]) {
            return a.responder.fail(status);
        }
        let locking = match self.locking(a.mode, caller) {
            Ok(locking) => locking,
            Err(status) => return a.responder.fail(status),
        };
        let (pd_number, mt) = match self.take_region_pd(a.handle, a.mode) {
            Ok(taken) => taken,
            Err(status) => return a.responder.fail(status),
        };
        let request = VirtualRegion {
            mode: a.mode,
            va: a.input.vaddr,
            length: a.input.length,
            access: a.input.access,
            pd: pd_number,
        };
        let (locker, irql) = locking.parts();
        let done = self.install_when_registered(&mt, a.handle, a.responder, keys_of);
        mt.register_virtual(self, locker, irql, request, done);
    }

    pub(crate) fn reg_phys_mr_request(self: &Arc<Self>, a: Accepted<RegPhysMr, P::Request>) {
        // The page list is the private input (`RegPhysMr::check_request`
        // validated its length and alignment when the request was decoded).
        let pages: Option<Vec<u64>> = a.responder.request.as_ref().and_then(|request| {
            let decoded = decode_request::<RegPhysMr>(request.input()).ok()?;
            let list = decoded.input.page_list(decoded.private).ok()?;
            Some(list.iter().map(|p| p.get()).collect())
        });
        let Some(pages) = pages else {
            return a.responder.fail(IbStatus::InvalidParameter);
        };
        if let Err(status) = self.refuse_user_parents(&[(a.handle, IbStatus::InvalidPdHandle)]) {
            return a.responder.fail(status);
        }
        let (pd_number, mt) = match self.take_region_pd(a.handle, a.mode) {
            Ok(taken) => taken,
            Err(status) => return a.responder.fail(status),
        };
        let request = PhysicalRegion {
            iova: a.input.iova,
            length: a.input.length,
            first_byte_offset: a.input.first_byte_offset,
            page_shift: a.input.page_shift,
            pages: &pages,
            access: a.input.access,
            pd: pd_number,
        };
        let done = self.install_when_registered(&mt, a.handle, a.responder, phys_out_of);
        mt.register_physical(self, request, done);
    }

    pub(crate) fn reg_shared_mr_request(self: &Arc<Self>, a: Accepted<RegSharedMr, P::Request>) {
        let new_pd = a.input.pd.raw();
        let (pd_number, _) = match self.take_region_pd(new_pd, a.mode) {
            Ok(taken) => taken,
            Err(status) => return a.responder.fail(status),
        };
        let (existing, existing_pd, mt) = match self.take_region(a.handle, a.mode) {
            Ok(taken) => taken,
            Err(status) => {
                let _ = self.release_pd(new_pd);
                return a.responder.fail(status);
            }
        };
        let request = SharedRegion {
            va: a.input.vaddr,
            access: a.input.access,
            pd: pd_number,
        };
        let done = self.install_when_registered(&mt, new_pd, a.responder, |region| RegSharedOut {
            keys: keys_of(region),
            vaddr: region.start(),
        });
        // `register_shared` reads the existing region only before it
        // returns (it shares the translation and copies the range).
        mt.register_shared(self, &existing, request, done);
        if let Err(region) = self.put_region(a.handle, existing, existing_pd) {
            mt.release_after_reset(self, region);
        }
    }

    pub(crate) fn rereg_mr_request(
        self: &Arc<Self>,
        a: Accepted<ReregMr, P::Request>,
        caller: Option<CallerLocking<'_, P>>,
    ) {
        let request = ReregRequest {
            mr: a.handle,
            mode: a.mode,
            pd: a.input.pd,
            access: a.input.access,
            translation: a
                .input
                .translation
                .map(|(va, length)| NewTranslation::Virtual { va, length }),
        };
        self.reregister_region(request, caller, a.responder, keys_of);
    }

    /// Reregister Physical Memory (guide Table 4-1; kernel only, the verb's
    /// policy): the ReregMr path with a page list as the new translation.
    pub(crate) fn rereg_phys_mr_request(self: &Arc<Self>, a: Accepted<ReregPhysMr, P::Request>) {
        // The page list is the private input (`ReregPhysMr::check_request`
        // validated it against the translation when the request was
        // decoded).
        let pages: Option<Vec<u64>> = a.responder.request.as_ref().and_then(|request| {
            let decoded = decode_request::<ReregPhysMr>(request.input()).ok()?;
            let list = decoded.input.page_list(decoded.private).ok()?;
            Some(list.iter().map(|p| p.get()).collect())
        });
        let Some(pages) = pages else {
            return a.responder.fail(IbStatus::InvalidParameter);
        };
        let request = ReregRequest {
            mr: a.handle,
            mode: a.mode,
            pd: a.input.pd,
            access: a.input.access,
            translation: a.input.translation.map(|t| {
                NewTranslation::Physical(PhysicalPages {
                    iova: t.iova,
                    length: t.length,
                    first_byte_offset: t.first_byte_offset,
                    page_shift: t.page_shift,
                    pages: &pages,
                })
            }),
        };
        self.reregister_region(request, None, a.responder, phys_out_of);
    }

    /// The one re-registration path (guide 7.1.1.3): the new PD's use is
    /// taken first, the region held busy, `mr` re-registers, and the
    /// answer is `out_of` the new region.
    fn reregister_region<V: Verb>(
        self: &Arc<Self>,
        request: ReregRequest<'_>,
        caller: Option<CallerLocking<'_, P>>,
        responder: Responder<V, P::Request>,
        out_of: fn(&MemoryRegion<P>) -> V::Out,
    ) {
        let locking = match self.locking(request.mode, caller) {
            Ok(locking) => locking,
            Err(status) => return responder.fail(status),
        };
        // A new PD is taken before anything else and given back on failure.
        let new_pd = match request.pd.map(PdHandle::raw) {
            Some(pd) => match self.take_region_pd(pd, request.mode) {
                Ok((number, _)) => Some((pd, number)),
                Err(status) => return responder.fail(status),
            },
            None => None,
        };
        let (region, old_pd, mt) = match self.take_region(request.mr, request.mode) {
            Ok(taken) => taken,
            Err(status) => {
                if let Some((pd, _)) = new_pd {
                    let _ = self.release_pd(pd);
                }
                return responder.fail(status);
            }
        };
        let changes = Reregistration {
            pd: new_pd.map(|(_, number)| number),
            access: request.access,
            translation: request.translation,
        };
        let (weak, mr) = (Arc::downgrade(self), request.mr);
        let (locker, irql) = locking.parts();
        let mt2 = mt.clone();
        mt.reregister(
            self,
            locker,
            irql,
            region,
            changes,
            Box::new(move |result| {
                let Some(hca) = Weak::upgrade(&weak) else {
                    return;
                };
                match result {
                    Ok(region) => {
                        let out = out_of(&region);
                        let pd = new_pd.map_or(old_pd, |(pd, _)| pd);
                        if let Err(region) = hca.put_region(mr, region, pd) {
                            mt2.release_after_reset(&hca, region);
                        }
                        if new_pd.is_some() {
                            let _ = hca.release_pd(old_pd);
                        }
                        responder.finish(IbStatus::Success, 0, Some(&out), &[]);
                    }
                    Err(failure) => {
                        if let Some((pd, _)) = new_pd {
                            let _ = hca.release_pd(pd);
                        }
                        match failure.region {
                            Some(region) => {
                                if let Err(region) = hca.put_region(mr, region, old_pd) {
                                    mt2.release_after_reset(&hca, region);
                                }
                            }
                            None => {
                                // Lost (`MrError::RegionLost`): its keys are
                                // dead and its resources freed.
                                hca.forget_region(mr);
                                let _ = hca.release_pd(old_pd);
                            }
                        }
                        responder.fail(failure.error.ib_status());
                    }
                }
            }),
        );
    }

    pub(crate) fn query_mr_request<R: Request>(&self, a: Accepted<QueryMr, R>) {
        let mode = a.mode;
        let answer = self.with_objects(|o| {
            if !Self::ca_visible(o, mode) {
                return Err(IbStatus::InvalidMrHandle);
            }
            let entry = o
                .mrs
                .get(Handle::<kind::Mr>::from_raw(a.handle))
                .ok_or(IbStatus::InvalidMrHandle)?;
            let region = entry.region.as_ref().ok_or(IbStatus::ResourceBusy)?;
            Ok(MrQuery {
                pd: PdHandle::from_raw(entry.pd),
                vaddr: region.start(),
                length: region.length(),
                access: region.access(),
                keys: keys_of(region),
            })
        });
        match answer.and_then(|r| r) {
            Ok(out) => a.responder.finish(IbStatus::Success, 0, Some(&out), &[]),
            Err(status) => a.responder.fail(status),
        }
    }

    pub(crate) fn dereg_mr_request(self: &Arc<Self>, a: Accepted<DeregMr, P::Request>) {
        let responder = a.responder;
        self.dereg_mr_then(a.handle, a.mode, responder.into_done());
    }

    /// Deregisters the region `mr` (see the module doc), then calls `done`
    /// (inline when refused, else from the DPC).
    pub(super) fn dereg_mr_then(
        self: &Arc<Self>,
        mr: u64,
        mode: RequestorMode,
        done: super::Done<P>,
    ) {
        let (region, pd, mt) = match self.take_region(mr, mode) {
            Ok(taken) => taken,
            Err(status) => return done(self, Err(status)),
        };
        let weak = Arc::downgrade(self);
        let mt2 = mt.clone();
        mt.deregister(
            self,
            region,
            Box::new(move |result| {
                let Some(hca) = Weak::upgrade(&weak) else {
                    return;
                };
                match result {
                    Ok(()) => {
                        hca.forget_region(mr);
                        let _ = hca.release_pd(pd);
                        done(&hca, Ok(()));
                    }
                    Err(failure) => {
                        if let Err(region) = hca.put_region(mr, failure.region, pd) {
                            mt2.release_after_reset(&hca, region);
                        }
                        done(&hca, Err(failure.error.ib_status()));
                    }
                }
            }),
        );
    }
}
