//! Address handles: `ibv_create_ah`, `ibv_destroy_ah`, over the access
//! library's address vectors, which the plugin keeps in user mode
//! ([`ibal_user::SharedAv`], owning its PD as the regions do,
//! `crate::memory`), and the address back to a datagram's sender,
//! `ibv_init_ah_from_wc` and `ibv_create_ah_from_wc`.
//!
//! **An address from a completion** follows rdma-core's
//! `ibv_init_ah_from_wc`: the LID, SL and path bits from the completion,
//! the flow label from the GRH area's first word, and, when the
//! completion says `IBV_WC_GRH`, a global route back to the sender read
//! from the 40 bytes the receive buffer starts with. For RoCEv2 over IPv4
//! those are 20 bytes of zeros then the packet's IPv4 header (PRM 10.4),
//! recognised as rdma-core does (not an IPv6 version nibble, or an IPv4
//! header of 5 words with a valid checksum): the peer's GID is
//! `::ffff:` + the source address, the hop limit the TTL, the traffic
//! class the TOS, and the source GID index that of `::ffff:` + the
//! destination address in the port's table. An IPv6 GRH gives the source
//! GID, the hop limit and the traffic class; its next header says the
//! GID's type (UDP: RoCEv2, 0x1B: InfiniBand or RoCEv1), which the local
//! GID must have. A multicast destination is `EINVAL` (no such GID in
//! the table), so is a destination the port does not have; another
//! header version is `EPROTONOSUPPORT`.

use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use ib_types::av::{AvAttr, Grh};
use ib_types::scalars::{Gid, Lid, LinkLayer, PortNum};
use ibal_user::SharedAv;
use ibverbs_abi::{IBV_WC_GRH, IbvAh, IbvAhAttr, IbvContext, IbvGid, IbvGlobalRoute, IbvPd, IbvWc};

use crate::device::open_context;
use crate::memory::{ProtectionDomain, pd_at, pd_for_child, truncated_handle};
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
/// the CA does not have (checked here with `QueryCa`, before the plugin's
/// own port check). The plugin checks the rest as for every AV, as the
/// kernel's AV verbs do: a service level past 15, a static rate other than
/// 0 and, on an Ethernet (RoCE) port, an address without a GRH
/// (`is_global` 0: RoCE addresses the peer by its GID) are refused there,
/// `EINVAL`.
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
        create_ah(pd, &attr).unwrap_or_else(|errno| {
            set_errno(errno);
            std::ptr::null_mut()
        })
    })
}

/// An address handle for `attr` in the PD `pd` names, live in [`AHS`]:
/// `ibv_create_ah`'s and `ibv_create_ah_from_wc`'s common end.
fn create_ah(pd: *mut IbvPd, attr: &IbvAhAttr) -> Result<*mut IbvAh, c_int> {
    let pd = pd_for_child(pd)?;
    let made = av_attr(&pd, attr)
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
            Ok(ptr)
        }
        Err(errno) => {
            pd.children.fetch_sub(1, Ordering::AcqRel);
            Err(errno)
        }
    }
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

/// The bytes a UD receive's buffer starts with (`struct ibv_grh`).
const GRH_LEN: usize = 40;
/// Where a RoCEv2 IPv4 packet's header sits in them (after 20 zeros).
const IPV4_AT: usize = 20;
/// An IPv4 header without options: 5 32-bit words.
const IPV4_WORDS: u8 = 5;
/// The GRH's next header naming a BTH: InfiniBand or RoCEv1 (IBA 8.3.1).
const NEXT_HEADER_BTH: u8 = 0x1B;
/// The GRH's next header naming UDP: RoCEv2.
const NEXT_HEADER_UDP: u8 = 17;

/// What the GRH area of a receive holds.
enum GrhArea {
    /// A RoCEv2 IPv4 packet's header (in the area's last 20 bytes).
    Ipv4,
    /// An IPv6 (or InfiniBand) GRH.
    Ipv6,
}

/// Whether the 20-byte IPv4 header `header` carries a valid checksum
/// (RFC 1071: the one's complement sum of its 16-bit words is all ones).
fn ipv4_checksum_ok(header: &[u8]) -> bool {
    let mut sum: u32 = header
        .chunks_exact(2)
        .map(|word| u32::from(u16::from_be_bytes([word[0], word[1]])))
        .sum();
    while sum > 0xFFFF {
        sum = (sum & 0xFFFF) + (sum >> 16);
    }
    sum == 0xFFFF
}

/// The kind of header in `grh`, recognised as rdma-core does: a version
/// nibble other than 6 is IPv4 if the IPv4 header says 4 (else
/// `EPROTONOSUPPORT`); with 6 (which a RoCEv2 IPv4 packet's zeros do not
/// give), an IPv4 header of 5 words with a valid checksum still wins.
fn grh_area(grh: &[u8; GRH_LEN]) -> Result<GrhArea, c_int> {
    let ipv6_version = grh[0] >> 4;
    let ipv4 = &grh[IPV4_AT..];
    let (ipv4_version, ipv4_words) = (ipv4[0] >> 4, ipv4[0] & 0x0F);
    if ipv6_version != 6 {
        return if ipv4_version == 4 {
            Ok(GrhArea::Ipv4)
        } else {
            Err(libc::EPROTONOSUPPORT)
        };
    }
    if ipv4_words == IPV4_WORDS && ipv4_checksum_ok(ipv4) {
        Ok(GrhArea::Ipv4)
    } else {
        Ok(GrhArea::Ipv6)
    }
}

/// The index of `gid` in port `port`'s table, when the port's GIDs are
/// of the type a `roce_v2` (or not) header needs; `EINVAL` when it has
/// none such (as rdma-core's search, which ends past the table).
fn gid_index(ca: &ibal_user::Context, port: u8, gid: Gid, roce_v2: bool) -> Result<u8, c_int> {
    let port = PortNum::new(port).map_err(|_| libc::EINVAL)?;
    let info = ca.query_port(port).map_err(|error| errno_of(&error))?;
    // An Ethernet port's GIDs are RoCEv2; an InfiniBand port's are of the
    // type rdma-core calls "IB/RoCEv1".
    if (info.attr.link_layer == LinkLayer::Ethernet) != roce_v2 {
        return Err(libc::EINVAL);
    }
    let at = info
        .gids
        .iter()
        .position(|g| *g == gid)
        .ok_or(libc::EINVAL)?;
    u8::try_from(at).map_err(|_| libc::EINVAL)
}

/// rdma-core's `ibv_init_ah_from_wc` on the access library's context
/// `ca` (the module docs): the address back to the sender of `wc`.
fn ah_attr_from_wc(
    ca: &ibal_user::Context,
    port_num: u8,
    wc: &IbvWc,
    grh: &[u8; GRH_LEN],
) -> Result<IbvAhAttr, c_int> {
    let version_class_flow = u32::from_be_bytes([grh[0], grh[1], grh[2], grh[3]]);
    let mut attr = IbvAhAttr {
        grh: IbvGlobalRoute {
            flow_label: version_class_flow & 0xF_FFFF,
            ..IbvGlobalRoute::default()
        },
        dlid: wc.slid,
        sl: wc.sl,
        src_path_bits: wc.dlid_path_bits,
        port_num,
        ..IbvAhAttr::default()
    };
    if wc.wc_flags & IBV_WC_GRH == 0 {
        return Ok(attr);
    }
    attr.is_global = 1;
    let mapped = |address: &[u8]| {
        let mut gid = [0; 16];
        gid[10..12].copy_from_slice(&[0xFF, 0xFF]);
        gid[12..].copy_from_slice(address);
        Gid::from_octets(gid)
    };
    match grh_area(grh)? {
        GrhArea::Ipv4 => {
            let ipv4 = &grh[IPV4_AT..];
            let (source, destination) = (&ipv4[12..16], &ipv4[16..20]);
            // Class D (224.0.0.0/4): no multicast GID is in the table.
            if destination[0] >> 4 == 0xE {
                return Err(libc::EINVAL);
            }
            attr.grh.sgid_index = gid_index(ca, port_num, mapped(destination), true)?;
            attr.grh.dgid = IbvGid {
                raw: mapped(source).octets(),
            };
            attr.grh.hop_limit = ipv4[8];
            attr.grh.traffic_class = ipv4[1];
        }
        GrhArea::Ipv6 => {
            let (source, destination) = (&grh[8..24], &grh[24..40]);
            if destination[0] == 0xFF {
                return Err(libc::EINVAL);
            }
            let roce_v2 = match grh[6] {
                NEXT_HEADER_UDP => true,
                NEXT_HEADER_BTH => false,
                _ => return Err(libc::EPROTONOSUPPORT),
            };
            let mut octets = [0; 16];
            octets.copy_from_slice(destination);
            attr.grh.sgid_index = gid_index(ca, port_num, Gid::from_octets(octets), roce_v2)?;
            attr.grh.dgid.raw.copy_from_slice(source);
            attr.grh.hop_limit = grh[7];
            attr.grh.traffic_class = (version_class_flow >> 20) as u8;
        }
    }
    Ok(attr)
}

/// `ibv_init_ah_from_wc(context, port_num, wc, grh, ah_attr)`: fills
/// `ah_attr` with the address back to the sender of the receive `wc`
/// (the module docs), as rdma-core does. 0, or -1 with `errno`: `EINVAL`
/// for a context that is not open, a NULL pointer, a port the CA does not
/// have, a multicast destination or one the port's GID table lacks;
/// `EPROTONOSUPPORT` for a header that is neither IPv4 nor IPv6, or an
/// IPv6 next header other than UDP or a BTH.
///
/// # Safety
///
/// `wc` is NULL or valid for reads of an `ibv_wc`, `grh` NULL or valid
/// for reads of the 40 bytes a UD receive's buffer starts with, `ah_attr`
/// NULL or valid for a write of an `ibv_ah_attr`.
pub unsafe extern "C" fn ibv_init_ah_from_wc(
    context: *mut IbvContext,
    port_num: u8,
    wc: *mut IbvWc,
    grh: *mut c_void,
    ah_attr: *mut IbvAhAttr,
) -> c_int {
    guard(-1, || {
        // SAFETY: NULL or valid for reads (the contract).
        let inputs = unsafe { wc_and_grh(wc, grh) };
        let made = inputs.and_then(|(wc, grh)| {
            if ah_attr.is_null() {
                return Err(libc::EINVAL);
            }
            let context = open_context(context)?;
            ah_attr_from_wc(&context.ca, port_num, &wc, &grh)
        });
        match made {
            Ok(attr) => {
                // SAFETY: non-NULL (checked) and valid for the write (the
                // contract).
                unsafe { ah_attr.write(attr) };
                0
            }
            Err(errno) => {
                set_errno(errno);
                -1
            }
        }
    })
}

/// Copies of the completion and the GRH area; `EINVAL` for NULL.
///
/// # Safety
/// `wc` and `grh` are NULL or valid for reads of an `ibv_wc` and of 40
/// bytes.
unsafe fn wc_and_grh(
    wc: *const IbvWc,
    grh: *const c_void,
) -> Result<(IbvWc, [u8; GRH_LEN]), c_int> {
    // SAFETY: NULL or valid for reads (the contract).
    let wc = unsafe { wc.as_ref() }.copied().ok_or(libc::EINVAL)?;
    // SAFETY: as above; 40 bytes, any alignment.
    let grh = unsafe { grh.cast::<[u8; GRH_LEN]>().as_ref() }
        .copied()
        .ok_or(libc::EINVAL)?;
    Ok((wc, grh))
}

/// `ibv_create_ah_from_wc(pd, wc, grh, port_num)`: an address handle back
/// to the sender of the receive `wc` (`ibv_init_ah_from_wc`, then
/// `ibv_create_ah`); NULL with `errno` from either (`EINVAL` also for a
/// PD that is not ours, and for a completion without a GRH on the RoCE
/// port, whose addresses need one).
///
/// # Safety
///
/// As [`ibv_init_ah_from_wc`] for `wc` and `grh`; `pd` is checked against
/// the live PDs.
pub unsafe extern "C" fn ibv_create_ah_from_wc(
    pd: *mut IbvPd,
    wc: *mut IbvWc,
    grh: *mut c_void,
    port_num: u8,
) -> *mut IbvAh {
    guard(std::ptr::null_mut(), || {
        // SAFETY: NULL or valid for reads (the contract).
        let inputs = unsafe { wc_and_grh(wc, grh) };
        let made = inputs.and_then(|(wc, grh)| {
            let ca = Arc::clone(pd_at(pd).ok_or(libc::EINVAL)?.pd.context());
            let attr = ah_attr_from_wc(&ca, port_num, &wc, &grh)?;
            create_ah(pd, &attr)
        });
        made.unwrap_or_else(|errno| {
            set_errno(errno);
            std::ptr::null_mut()
        })
    })
}
