//! Address handles: `ibv_create_ah`, `ibv_destroy_ah`, over the access
//! library's address vectors, which the plugin keeps in user mode
//! ([`ibal_user::SharedAv`], owning its PD as the regions do,
//! `crate::memory`).

use std::ffi::c_int;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use ib_types::av::{AvAttr, Grh};
use ib_types::scalars::{Gid, Lid, PortNum};
use ibal_user::SharedAv;
use ibverbs_abi::{IbvAh, IbvAhAttr, IbvPd};

use crate::memory::{ProtectionDomain, pd_for_child, truncated_handle};
use crate::slots::{Lease, Table};
use crate::util::{errno_of, guard, set_errno};

/// An address handle: rdma-core's `ibv_ah` at the front of its slot in
/// [`AHS`] (a UD send finds it by the pointer, `crate::slots`), then the
/// access library's AV and the PD it was made in.
pub(crate) struct AddressHandle {
    raw: Lease<IbvAh, AddressHandle>,
    av: SharedAv,
    pd: Arc<ProtectionDomain>,
}

// SAFETY: the `ibv_ah` in `raw`'s slot names the PD and context this
// handle holds (`pd`), written when the slot was reserved and never after,
// only read.
unsafe impl Send for AddressHandle {}
// SAFETY: as for `Send`: shared references only read `raw`.
unsafe impl Sync for AddressHandle {}

/// The live address handles, found by the `ibv_ah` pointer.
static AHS: Table<IbvAh, AddressHandle> = Table::new();

/// The AV of the address handle `ptr` names (a UD send's destination), if
/// it is one of ours and live: no lock, lookup or allocation.
pub(crate) fn av_handle_at(ptr: *const IbvAh) -> Option<ib_types::handle::AvHandle> {
    AHS.with(ptr, |handle| handle.av.handle())
}

/// The access library's AV for `attr` on `pd`'s CA: `EINVAL` for a port
/// the CA does not have (checked here with `QueryCa`: the plugin does not
/// check an AV's port). The plugin checks the rest as for every AV: a
/// service level past 15 and, on an Ethernet (RoCE) port, an address
/// without a GRH (`is_global` 0: RoCE addresses the peer by its GID) are
/// refused there, `EINVAL`.
pub(crate) fn av_attr(pd: &ProtectionDomain, attr: &IbvAhAttr) -> Result<AvAttr, c_int> {
    let port = PortNum::new(attr.port_num).map_err(|_| libc::EINVAL)?;
    pd.pd
        .context()
        .query_port(port)
        .map_err(|error| errno_of(&error))?;
    let grh = (attr.is_global != 0).then(|| Grh {
        dgid: Gid::from_octets(attr.grh.dgid.raw),
        flow_label: attr.grh.flow_label,
        hop_limit: attr.grh.hop_limit,
        traffic_class: attr.grh.traffic_class,
        sgid_index: attr.grh.sgid_index,
    });
    Ok(AvAttr {
        port,
        sl: attr.sl,
        dlid: Lid::new(attr.dlid),
        path_bits: attr.src_path_bits,
        static_rate: attr.static_rate,
        grh,
    })
}

/// `ibv_create_ah(pd, attr)`: an address handle (`CreateAv`, kept by the
/// plugin); NULL with `errno`: `EINVAL` for a PD that is not ours, NULL
/// `attr`, a bad port, no GRH on an Ethernet port, or attributes the
/// plugin refuses.
///
/// # Safety
///
/// `attr` is NULL or valid for reads of an `ibv_ah_attr`; `pd` is checked
/// against the live PDs.
pub unsafe extern "C" fn ibv_create_ah(pd: *mut IbvPd, attr: *mut IbvAhAttr) -> *mut IbvAh {
    guard(std::ptr::null_mut(), || {
        // SAFETY: NULL or valid for reads (the contract); copied at once.
        let Some(attr) = (unsafe { attr.as_ref() }).copied() else {
            set_errno(libc::EINVAL);
            return std::ptr::null_mut();
        };
        let pd = match pd_for_child(pd) {
            Ok(pd) => pd,
            Err(errno) => {
                set_errno(errno);
                return std::ptr::null_mut();
            }
        };
        let made = av_attr(&pd, &attr)
            .and_then(|av_attr| SharedAv::new(&pd.pd, &av_attr).map_err(|error| errno_of(&error)));
        let made = made.and_then(|av| {
            let raw = AHS.reserve(IbvAh {
                context: pd.raw.context,
                pd: pd.as_ptr(),
                handle: truncated_handle(av.handle().raw()),
            });
            // Dropping the AV destroys it.
            Ok((raw.ok_or(libc::ENOMEM)?, av))
        });
        match made {
            Ok((raw, av)) => {
                let handle = Arc::new(AddressHandle {
                    raw,
                    av,
                    pd: Arc::clone(&pd),
                });
                let ptr = handle.raw.get();
                AHS.publish(&handle.raw, Arc::clone(&handle));
                ptr
            }
            Err(errno) => {
                pd.children.fetch_sub(1, Ordering::AcqRel);
                set_errno(errno);
                std::ptr::null_mut()
            }
        }
    })
}

/// `ibv_destroy_ah(ah)`: 0, or an errno value: `EINVAL` for a handle that
/// is not ours (or a second destroy), the plugin's refusal (the handle
/// stays) otherwise.
///
/// # Safety
///
/// None beyond C's: the pointer is checked against the live handles.
pub unsafe extern "C" fn ibv_destroy_ah(ah: *mut IbvAh) -> c_int {
    guard(libc::EIO, || {
        // Waits for the sends converting with it; every later one is
        // refused.
        let Some(handle) = AHS.take(ah) else {
            return libc::EINVAL;
        };
        if let Err(error) = handle.av.destroy() {
            AHS.publish(&handle.raw, Arc::clone(&handle));
            return errno_of(&error);
        }
        handle.pd.children.fetch_sub(1, Ordering::AcqRel);
        0
    })
}
