//! Memory windows (guide 7.2, Table 4-1; PRM 7.1, 10.2): AllocMw,
//! QueryMw, DeallocMw, and what `post_send` needs to bind them.
//!
//! Contract:
//! - **Allocate**: an MPT index from the translation service's key
//!   allocator (windows share the table with regions), then `SW2HW_MPT`
//!   of a window of the requested type, free (unbound, `state` 0) in the
//!   PD, as the PRM requires. The window holds a use of its PD until it is
//!   deallocated, so DeallocPd answers [`IbStatus::ResourceBusy`]
//!   meanwhile. The handle's number is the MPT index; the answer carries
//!   the first R_Key (index and tag), which names no memory until a bind.
//! - **Bind** is a work request on a QP of the window's PD (guide 7.2; PRM
//!   10.2 `BIND_MW`): [`SendOp::BindMw`](ib_types::wr::SendOp::BindMw)
//!   posted with [`Hca::post_send`], for both types (the request surface
//!   has no separate Bind MW verb). `post_send` resolves the window (a
//!   stale handle is [`IbStatus::InvalidMwHandle`]), requires the WR's new
//!   R_Key to name the window's MPT index ([`IbStatus::InvalidRkey`]
//!   otherwise) and writes the window's type into the bind segment. A
//!   type 1 bind must bring a new R_Key (guide 7.2: the R_Key changes on
//!   every bind, so stale requests fail): one equal to the key of the
//!   window's last posted bind (or its first key) is refused with
//!   [`IbStatus::InvalidRkey`], nothing posted; [`Hca::next_mw_rkey`]
//!   gives a new one. A type 2 window's key is its binder's
//!   (`LOCAL_INV` ends each binding). A zero-length bind unbinds a type 1
//!   window; a type 2 window is unbound by `LOCAL_INV` (or a remote
//!   `SEND_WITH_INV`) of its key. The device checks the rest (PRM 7.1:
//!   region valid with MW_BIND, window inside it, PDs, rights) and
//!   completes a bad bind with `MW_BIND_ERR`.
//! - **Query** reads the entry back (`QUERY_MPT`): the current R_Key is the
//!   device's (the tag of the last bind it executed), not a guess from the
//!   posts.
//! - **Deallocate**: `HW2SW_MPT` (the device unbinds a bound window from
//!   its region first), then the index is freed and the PD use dropped.
//!   One operation at a time: a deallocation in flight makes other verbs
//!   on the window answer [`IbStatus::ResourceBusy`].

use alloc::boxed::Box;
use alloc::sync::Arc;
use alloc::vec;
use core::sync::atomic::AtomicU32;

use driver_platform::{Platform, RequestorMode};
use hca_prm::Le32;
use hca_prm::cmd::Opcode;
use hca_prm::mpt::{MptEntry, MptKind};
use ib_types::handle::PdHandle;
use ib_types::ioctl::{AllocMw, DeallocMw, QueryMw, QueryMwOut};
use ib_types::mr::{MwAttr, MwType};
use ib_types::status::IbStatus;
use ib_types::wr::RKey;
use zerocopy::{FromBytes, IntoBytes};

use super::Accepted;
use crate::cmd::Command;
use crate::hca::Hca;
use crate::resources::{Handle, MemoryKey, kind};

/// A memory window in the MW table (its number is its MPT index).
#[derive(Debug, Clone)]
pub(crate) struct Mw {
    pub(super) mw_type: MwType,
    /// The PD (raw handle) whose use the window holds.
    pub(super) pd: u64,
    /// A deallocation is in flight.
    busy: bool,
    /// The entry's tag as the device last had it: set at allocation, read
    /// back at D0 exit, given back at D0 entry ([`super::restore`]).
    pub(super) saved_tag: u8,
    /// The R_Key of the last bind posted (the first key until then): a
    /// type 1 bind must bring another (guide 7.2), checked and replaced by
    /// `post_send` as it writes the bind.
    last_bind_rkey: Arc<AtomicU32>,
}

/// What `post_send` needs of the window a bind names.
#[derive(Debug, Clone)]
pub(crate) struct BindTarget {
    /// The window's type.
    pub(crate) mw_type: MwType,
    /// Its MPT index, which the bind's new R_Key must name.
    pub(crate) index: u32,
    /// The R_Key of its last posted bind ([`Mw`]).
    pub(crate) last_bind_rkey: Arc<AtomicU32>,
}

/// The PRM entry kind of a window type.
pub(super) fn mpt_kind(mw_type: MwType) -> MptKind {
    match mw_type {
        MwType::Type1 => MptKind::WindowType1,
        MwType::Type2 => MptKind::WindowType2,
    }
}

/// The bind segment's window type (PRM 10.2).
pub(crate) fn wqe_type(mw_type: MwType) -> hca_prm::wqe::MwType {
    match mw_type {
        MwType::Type1 => hca_prm::wqe::MwType::Type1,
        MwType::Type2 => hca_prm::wqe::MwType::Type2,
    }
}

impl<P: Platform> Hca<P> {
    /// The type and MPT index of the live window `mw` of a kernel CA, for
    /// a bind work request.
    pub(crate) fn window_for_bind(&self, mw: u64) -> Result<BindTarget, IbStatus> {
        self.with_objects(|o| {
            if !Self::ca_visible(o, RequestorMode::Kernel) {
                return Err(IbStatus::InvalidMwHandle);
            }
            let handle = Handle::<kind::Mw>::from_raw(mw);
            let window = o.mws.get(handle).ok_or(IbStatus::InvalidMwHandle)?;
            Ok(BindTarget {
                mw_type: window.mw_type,
                index: handle.number(),
                last_bind_rkey: window.last_bind_rkey.clone(),
            })
        })?
    }

    /// A new R_Key for the next bind of window `mw`: its MPT index with a
    /// tag the previous key of the index did not have (guide 7.2). Kernel
    /// clients put it in the bind work request.
    pub fn next_mw_rkey(&self, mw: u64) -> Result<RKey, IbStatus> {
        let index = self.window_for_bind(mw)?.index;
        let mt = self.memory_translation()?;
        let key = mt.next_window_key(index).map_err(|e| e.ib_status())?;
        Ok(RKey::new(key.raw()))
    }

    pub(crate) fn alloc_mw_request(self: &Arc<Self>, a: Accepted<AllocMw, P::Request>) {
        let mode = a.mode;
        let pd = a.handle;
        let taken = self.with_objects_mut(|o| {
            if !Self::ca_visible(o, mode) {
                return Err(IbStatus::InvalidPdHandle);
            }
            let handle = Handle::<kind::Pd>::from_raw(pd);
            o.pds.acquire(handle).map_err(IbStatus::from)?;
            match o.mtt.alloc_window_key() {
                Ok(key) => Ok((handle.number(), key, o.mtt.clone())),
                Err(error) => {
                    let _ = o.pds.release(handle);
                    Err(error.ib_status())
                }
            }
        });
        let (pd_number, key, mt) = match taken.and_then(|r| r) {
            Ok(taken) => taken,
            Err(status) => return a.responder.fail(status),
        };
        let mw_type = a.input.mw_type;
        // PRM 7.1: a window is created free, with no range of its own.
        let entry = MptEntry {
            kind: mpt_kind(mw_type).code(),
            state: 0,
            tag: key.tag(),
            pd: Le32::new(pd_number),
            ..MptEntry::default()
        };
        let responder = a.responder;
        self.run_commands(
            vec![
                Command::new(Opcode::Sw2HwMpt, key.index()).with_mailbox(entry.as_bytes().to_vec()),
            ],
            Box::new(move |hca, result| {
                if let Err(error) = result {
                    let _ = mt.free_window_key(key.index());
                    let _ = hca.release_pd(pd);
                    return responder.fail(error.ib_status());
                }
                let window = Mw {
                    mw_type,
                    pd,
                    busy: false,
                    saved_tag: key.tag(),
                    last_bind_rkey: Arc::new(AtomicU32::new(key.raw())),
                };
                let stored = hca.with_objects_mut(|o| {
                    o.mws
                        .insert_at_with(key.index(), |_| window)
                        .map_err(IbStatus::from)
                });
                match stored.and_then(|r| r) {
                    Ok(handle) => {
                        let out = MwAttr {
                            mw_type,
                            rkey: RKey::new(key.raw()),
                        };
                        responder.finish(IbStatus::Success, handle.raw(), Some(&out), &[]);
                    }
                    Err(status) => {
                        // Stopped meanwhile: the device forgot the entry.
                        let _ = mt.free_window_key(key.index());
                        let _ = hca.release_pd(pd);
                        responder.fail(status);
                    }
                }
            }),
        );
    }

    pub(crate) fn query_mw_request(self: &Arc<Self>, a: Accepted<QueryMw, P::Request>) {
        let mode = a.mode;
        let found = self.with_objects(|o| {
            if !Self::ca_visible(o, mode) {
                return Err(IbStatus::InvalidMwHandle);
            }
            let handle = Handle::<kind::Mw>::from_raw(a.handle);
            let window = o.mws.get(handle).ok_or(IbStatus::InvalidMwHandle)?;
            if window.busy {
                return Err(IbStatus::ResourceBusy);
            }
            Ok((window.clone(), handle.number()))
        });
        let (window, index) = match found.and_then(|r| r) {
            Ok(found) => found,
            Err(status) => return a.responder.fail(status),
        };
        let responder = a.responder;
        self.run_commands(
            vec![Command::new(Opcode::QueryMpt, index).with_output(size_of::<MptEntry>())],
            Box::new(move |_, result| {
                let outputs = match result {
                    Ok(outputs) => outputs,
                    Err(error) => return responder.fail(error.ib_status()),
                };
                let entry = outputs
                    .first()
                    .and_then(|o| MptEntry::read_from_prefix(&o.mailbox).ok())
                    .map(|(entry, _)| entry);
                let key = entry.and_then(|e| {
                    (e.kind == mpt_kind(window.mw_type).code())
                        .then(|| MemoryKey::new(index, e.tag))
                        .flatten()
                });
                match key {
                    Some(key) => {
                        let out = QueryMwOut {
                            pd: PdHandle::from_raw(window.pd),
                            attr: MwAttr {
                                mw_type: window.mw_type,
                                rkey: RKey::new(key.raw()),
                            },
                        };
                        responder.finish(IbStatus::Success, 0, Some(&out), &[]);
                    }
                    // The device reports another kind at the index: a
                    // device or core bug, not the client's.
                    None => responder.fail(IbStatus::GenericError),
                }
            }),
        );
    }

    pub(crate) fn dealloc_mw_request(self: &Arc<Self>, a: Accepted<DeallocMw, P::Request>) {
        let responder = a.responder;
        self.dealloc_mw_then(a.handle, a.mode, responder.into_done());
    }

    /// Deallocates the window `mw` (see the module doc), then calls `done`
    /// (inline when refused, else from the DPC).
    pub(super) fn dealloc_mw_then(
        self: &Arc<Self>,
        mw: u64,
        mode: RequestorMode,
        done: super::Done<P>,
    ) {
        let handle = Handle::<kind::Mw>::from_raw(mw);
        let claimed = self.with_objects_mut(|o| {
            if !Self::ca_visible(o, mode) {
                return Err(IbStatus::InvalidMwHandle);
            }
            let window = o.mws.get_mut(handle).ok_or(IbStatus::InvalidMwHandle)?;
            if window.busy {
                return Err(IbStatus::ResourceBusy);
            }
            window.busy = true;
            Ok((window.pd, o.mtt.clone()))
        });
        let (pd, mt) = match claimed.and_then(|r| r) {
            Ok(claimed) => claimed,
            Err(status) => return done(self, Err(status)),
        };
        self.run_commands(
            vec![Command::new(Opcode::Hw2SwMpt, handle.number())],
            Box::new(move |hca, result| match hca.forgive_when_failed(result) {
                Ok(_) => {
                    let _ = hca.with_objects_mut(|o| o.mws.remove(handle));
                    let _ = mt.free_window_key(handle.number());
                    let _ = hca.release_pd(pd);
                    done(hca, Ok(()));
                }
                Err(error) => {
                    let _ = hca.with_objects_mut(|o| {
                        if let Some(window) = o.mws.get_mut(handle) {
                            window.busy = false;
                        }
                    });
                    done(hca, Err(error.ib_status()));
                }
            }),
        );
    }
}
