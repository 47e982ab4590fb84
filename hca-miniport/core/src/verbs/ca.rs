//! CA verbs (guide 6.1): OpenCa, CloseCa, QueryCa, ModifyCa.
//!
//! Contract:
//! - **One open at a time** (guide 6.1.1: the access layer is the only
//!   caller and opens once; further opens are denied with
//!   [`IbStatus::ResourceBusy`]). The CI's typed entry
//!   [`Hca::open_ca`] registers the client's callbacks ([`CaClient`]); the
//!   `OpenCa` request opens without callbacks. User processes open
//!   contexts of their own through [`Hca::submit_user_request`]
//!   (`verbs::user`: a doorbell page each, any number beside this open);
//!   a user-mode `OpenCa` given to `submit_request` has no process to map
//!   the page into and is [`IbStatus::Unsupported`].
//! - **Close** (guide 6.1.4) refuses with [`IbStatus::ResourceBusy`] while
//!   a PD or CQ of this CA (not of a user context, `verbs::user`) lives,
//!   and otherwise waits (spinning: callbacks run at
//!   DISPATCH_LEVEL and never block) until no callback is in flight; none
//!   follows its return. It must not be called from inside a callback.
//! - **Query** (guide 6.1.2) builds the `ib_types::ca` attribute block from
//!   the bring-up report's capabilities and a `QUERY_PORT` per port (PRM
//!   5.4), issued one after another from the DPC. When the block does not
//!   fit the caller's private output the answer is [`IbStatus::Overflow`]
//!   carrying the size needed (the framing's size report). Every limit
//!   is what the verbs accept, exactly (`tests/verbs_caps.rs` creates each
//!   up to it and one more): the tables' sizes (QPs counting every port's
//!   SMI and GSI QP; regions and windows share the MPT table without its
//!   index 0; PDs and AVs the core's tables), the device's per-queue
//!   maxima (`max_wrs_per_qp` for a one-SGE RC QP, whose WQEs take one
//!   basic block), inline bytes, multicast and read/atomic depths.
//! - **Modify** (guide 6.1.3) is one `SET_PORT` (PRM 5.5): the capability
//!   bits to set and clear as PortInfo CapabilityMask bits, the counter
//!   resets as its flags. Query reads the mask back into port
//!   capabilities, so a modification shows in the next query.

use alloc::boxed::Box;
use alloc::sync::Arc;
use alloc::vec;
use alloc::vec::Vec;

use driver_platform::{Platform, Request, RequestorMode};
use hca_prm::Le32;
use hca_prm::cmd::{DevCapFlags, Opcode, PortInfo, SetPort, SetPortFlags, Table};
use ib_types::ca::{
    Atomicity, CaAttr, CaAttrParts, CaCaps, CaLayout, CaLimits, CaModifyFlags, PortAttr, PortCaps,
    PortData, PortTables,
};
use ib_types::event::AsyncEventRecord;
use ib_types::handle::CqHandle;
use ib_types::interface::UvpName;
use ib_types::ioctl::{
    CloseCa, Empty, ModifyCa, OpenCa, OpenCaOut, PROXY_ABI_VERSION, QueryCa, QueryCaOut,
};
use ib_types::scalars::{
    Gid, Lid, LinkLayer, Mtu, NodeGuid, PKey, PortGuid, PortNum, PortState, SystemImageGuid,
};
use ib_types::status::IbStatus;
use zerocopy::{FromBytes, IntoBytes};

use super::{Accepted, MAX_PDS, OpenCa as OpenCaState, visible};
use crate::cmd::{Command, CommandOutput};
use crate::hca::Hca;
use crate::init::BringUpReport;

/// The base name of the user-mode verbs provider for this HCA (the
/// `uvp-plugin` crate's DLL).
pub const UVP_NAME: &str = "uvp_plugin";

/// The page sizes the core registers memory with.
const PAGE_SIZES: [u32; 1] = [4096];

/// Bytes asked for a `QUERY_PORT` answer: a whole mailbox, which holds the
/// fixed part and the tables of any port the PRM allows.
const QUERY_PORT_BYTES: usize = hca_prm::cmd::MAX_MAILBOX_BYTES;

/// A client's event callbacks (the CI's `EventCallbacks`, as a Rust
/// trait). Called from the DPC at DISPATCH_LEVEL, never from the ISR, with
/// no core lock held, never after [`Hca::close_ca`] returned. They must not
/// block and must not close the CA.
pub trait CaClient: Send + Sync {
    /// A completion event on `cq` (one-shot: re-arm to get another).
    fn completion(&self, cq: CqHandle);
    /// An asynchronous event (CQ error, port up or down).
    fn async_event(&self, event: &AsyncEventRecord);
}

impl<P: Platform> Hca<P> {
    /// The CI's `open_ca`: opens the CA for a kernel client and registers
    /// its callbacks; returns the CA handle. Fails with
    /// [`IbStatus::ResourceBusy`] while the CA is open and
    /// [`IbStatus::InvalidState`] while the device is not started.
    pub fn open_ca(&self, client: Option<Arc<dyn CaClient>>) -> Result<u64, IbStatus> {
        self.open_ca_as(RequestorMode::Kernel, client)
    }

    fn open_ca_as(
        &self,
        mode: RequestorMode,
        client: Option<Arc<dyn CaClient>>,
    ) -> Result<u64, IbStatus> {
        self.with_objects_mut(|o| {
            if o.ca.is_some() {
                return Err(IbStatus::ResourceBusy);
            }
            o.ca_generation = match o.ca_generation.wrapping_add(1) {
                0 => 1,
                g => g,
            };
            let handle = u64::from(o.ca_generation) << 32 | 0xCA;
            o.ca = Some(OpenCaState {
                handle,
                mode,
                client,
            });
            Ok(handle)
        })?
    }

    /// The CI's `close_ca`: closes the CA `ca`. Fails with
    /// [`IbStatus::InvalidCaHandle`] for another handle and
    /// [`IbStatus::ResourceBusy`] while PDs or CQs live; on success no
    /// callback runs after it returns (see the module doc).
    pub fn close_ca(&self, ca: u64) -> Result<(), IbStatus> {
        self.close_ca_as(ca, RequestorMode::Kernel)
    }

    fn close_ca_as(&self, ca: u64, mode: RequestorMode) -> Result<(), IbStatus> {
        self.with_objects_mut(|o| {
            match &o.ca {
                Some(open) if open.handle == ca && visible(open.mode, mode) => {}
                _ => return Err(IbStatus::InvalidCaHandle),
            }
            // Only the CA's own objects count: user contexts' are theirs.
            let (user_pds, user_cqs) = o.user.owned_pds_and_cqs();
            if o.pds.len() > user_pds || o.cqs.len() > user_cqs {
                return Err(IbStatus::ResourceBusy);
            }
            o.ca = None;
            Ok(())
        })??;
        self.wait_for_callbacks();
        Ok(())
    }

    pub(crate) fn open_ca_request<R: Request>(&self, a: Accepted<OpenCa, R>) {
        if a.mode == RequestorMode::User {
            a.responder.fail(IbStatus::Unsupported);
            return;
        }
        let Some(report) = self.report() else {
            a.responder.fail(IbStatus::InvalidState);
            return;
        };
        let Ok(uvp_name) = UvpName::new(UVP_NAME) else {
            a.responder.fail(IbStatus::GenericError);
            return;
        };
        let cap = &report.capabilities;
        let out = OpenCaOut {
            version: PROXY_ABI_VERSION,
            ca_guid: NodeGuid::new(cap.node_guid.get()),
            vendor_id: cap.vendor_id.get() & OpenCaOut::MAX_VENDOR_ID,
            device_id: cap.device_id.get(),
            revision: cap.revision.get(),
            doorbell: None,
            uvp_name,
        };
        match self.open_ca_as(a.mode, None) {
            Ok(handle) => a
                .responder
                .finish(IbStatus::Success, handle, Some(&out), &[]),
            Err(status) => a.responder.fail(status),
        }
    }

    pub(crate) fn close_ca_request<R: Request>(&self, a: Accepted<CloseCa, R>) {
        match self.close_ca_as(a.handle, a.mode) {
            Ok(()) => a.responder.finish(IbStatus::Success, 0, Some(&Empty), &[]),
            Err(status) => a.responder.fail(status),
        }
    }
}

impl<P: Platform> Hca<P>
where
    P::Request: 'static,
{
    pub(crate) fn modify_ca_request(self: &Arc<Self>, a: Accepted<ModifyCa, P::Request>) {
        if let Err(status) = self.check_ca(a.handle, a.mode) {
            a.responder.fail(status);
            return;
        }
        let Some(report) = self.report() else {
            a.responder.fail(IbStatus::InvalidState);
            return;
        };
        let modify = a.input;
        let port = modify.port().get();
        if port > report.capabilities.num_ports {
            a.responder.fail(IbStatus::InvalidPort);
            return;
        }
        let mut flags = SetPortFlags::empty();
        if modify.set().contains(CaModifyFlags::RESET_QKEY_COUNTER) {
            flags |= SetPortFlags::RESET_QKEY_COUNTER;
        }
        if modify.set().contains(CaModifyFlags::RESET_PKEY_COUNTER) {
            flags |= SetPortFlags::RESET_PKEY_COUNTER;
        }
        let input = SetPort {
            set_caps: Le32::new(modify.set().port_caps().port_info_capability_mask()),
            clear_caps: Le32::new(modify.clear().port_caps().port_info_capability_mask()),
            flags: Le32::new(flags.bits()),
            ..SetPort::default()
        };
        let responder = a.responder;
        self.run_commands(
            vec![
                Command::new(Opcode::SetPort, u32::from(port))
                    .with_mailbox(input.as_bytes().to_vec()),
            ],
            Box::new(move |_hca, result| match result {
                Ok(_) => responder.finish(IbStatus::Success, 0, Some(&Empty), &[]),
                Err(error) => responder.fail(error.ib_status()),
            }),
        );
    }

    pub(crate) fn query_ca_request(self: &Arc<Self>, a: Accepted<QueryCa, P::Request>) {
        if let Err(status) = self.check_ca(a.handle, a.mode) {
            a.responder.fail(status);
            return;
        }
        self.query_ca_answer(a.responder);
    }

    /// Answers a QueryCa whose CA handle was checked.
    pub(crate) fn query_ca_answer(
        self: &Arc<Self>,
        responder: super::Responder<QueryCa, P::Request>,
    ) {
        let Some(report) = self.report() else {
            responder.fail(IbStatus::InvalidState);
            return;
        };
        let commands = (1..=report.capabilities.num_ports)
            .map(|port| {
                Command::new(Opcode::QueryPort, u32::from(port)).with_output(QUERY_PORT_BYTES)
            })
            .collect();
        self.run_commands(
            commands,
            Box::new(move |_hca, result| match result {
                Err(error) => responder.fail(error.ib_status()),
                Ok(outputs) => match ca_attributes(&report, &outputs) {
                    Err(status) => responder.fail(status),
                    Ok(block) => {
                        let size = QueryCaOut {
                            total_size: block.len() as u32,
                        };
                        if block.len() > responder.private_room() {
                            responder.finish(IbStatus::Overflow, 0, Some(&size), &[]);
                        } else {
                            responder.finish(IbStatus::Success, 0, Some(&size), &block);
                        }
                    }
                },
            }),
        );
    }
}

/// One port's attributes and tables from its `QUERY_PORT` answer.
struct PortAnswer {
    attr: PortAttr,
    pkeys: Vec<PKey>,
    gids: Vec<Gid>,
}

fn port_answer(port: u8, answer: &CommandOutput) -> Result<PortAnswer, IbStatus> {
    let bad = IbStatus::GenericError;
    let (info, tables) = PortInfo::read_from_prefix(&answer.mailbox).map_err(|_| bad)?;
    let gid_len = usize::from(info.gid_table_len.get());
    let pkey_len = usize::from(info.pkey_table_len.get());
    let gid_bytes = tables.get(..16 * gid_len).ok_or(bad)?;
    let pkey_bytes = tables
        .get(16 * gid_len..16 * gid_len + 2 * pkey_len)
        .ok_or(bad)?;
    let gids = gid_bytes
        .chunks_exact(16)
        .map(|c| {
            let mut octets = [0u8; 16];
            octets.copy_from_slice(c);
            Gid::from_octets(octets)
        })
        .collect();
    // Device structures are little-endian (PRM conventions); the CA block
    // carries P_Keys in network order, which `PKey` keeps.
    let pkeys = pkey_bytes
        .chunks_exact(2)
        .map(|c| PKey::new(u16::from_le_bytes([c[0], c[1]])))
        .collect();
    let attr = PortAttr {
        port_num: PortNum::new(port).map_err(|_| bad)?,
        link_layer: LinkLayer::from_code(info.link_layer).map_err(|_| bad)?,
        state: PortState::from_code(info.state).map_err(|_| bad)?,
        active_mtu: Mtu::from_code(info.active_mtu).map_err(|_| bad)?,
        max_mtu: Mtu::from_code(info.max_mtu).map_err(|_| bad)?,
        port_guid: PortGuid::new(info.port_guid.get()),
        lid: Lid::new(0),
        lmc: 0,
        sm_lid: Lid::new(0),
        sm_sl: 0,
        subnet_timeout: 0,
        max_msg_size: info.max_msg_size.get(),
        caps: port_caps(info.capability_mask.get()),
        qkey_violations: info.qkey_violations.get(),
        pkey_violations: info.pkey_violations.get(),
        tables: PortTables::default(),
    };
    Ok(PortAnswer { attr, pkeys, gids })
}

/// The port capabilities a PortInfo CapabilityMask advertises (the
/// inverse of [`PortCaps::port_info_capability_mask`]), plus the two
/// violation counters every port of this device keeps.
fn port_caps(mask: u32) -> PortCaps {
    let mut caps = PortCaps::QKEY_COUNTER | PortCaps::PKEY_COUNTER;
    for cap in PortCaps::all().iter() {
        if cap.port_info_capability_mask() & mask != 0 {
            caps |= cap;
        }
    }
    caps
}

/// The most inline bytes a QP can be granted: the device's limit, within
/// the largest send WQE the QP verbs build less its control segment, the
/// smallest transport prefix (UC's remote-address segment) and the inline
/// header (`qp::geometry`).
fn max_inline_data(cap: &hca_prm::cmd::DevCap) -> u32 {
    use hca_prm::wqe::{MAX_SEND_WQE_BYTES, SEG_SIZE};
    let log = cap.log_max_wqe_size.min(super::qp::MAX_LOG_WQE_SIZE);
    let wqe = (1usize << log).min(MAX_SEND_WQE_BYTES);
    let room = wqe.saturating_sub(2 * SEG_SIZE + 4) as u32;
    u32::from(cap.max_inline_bytes.get()).min(room)
}

/// The CA attribute block (guide 6.1.2, `ib_types::ca`) from the bring-up
/// report and one `QUERY_PORT` answer per port, in port order.
fn ca_attributes(report: &BringUpReport, ports: &[CommandOutput]) -> Result<Vec<u8>, IbStatus> {
    let cap = &report.capabilities;
    let flags = DevCapFlags::from_bits_truncate(cap.flags.get());
    let count = |table: Table| 1u32 << report.table(table).log_count;
    let mut caps = CaCaps::BAD_PKEY_COUNTER | CaCaps::BAD_QKEY_COUNTER | CaCaps::SYSTEM_IMAGE_GUID;
    for (dev, ca) in [
        (DevCapFlags::RC, CaCaps::RC),
        (DevCapFlags::UC, CaCaps::UC),
        (DevCapFlags::UD, CaCaps::UD),
        (DevCapFlags::SRQ, CaCaps::SRQ),
        (DevCapFlags::MW_TYPE1, CaCaps::MW_TYPE1),
        (DevCapFlags::MW_TYPE2, CaCaps::MW_TYPE2),
        (DevCapFlags::MULTICAST, CaCaps::MULTICAST),
        (DevCapFlags::PORT_ACTIVE_EVENT, CaCaps::PORT_ACTIVE_EVENT),
        (DevCapFlags::LOCAL_MAD, CaCaps::LOCAL_MAD),
    ] {
        if flags.contains(dev) {
            caps |= ca;
        }
    }
    let pow = |log: u8| 1u32.checked_shl(u32::from(log)).unwrap_or(u32::MAX);
    // Regions and windows share the MPT table, stored at their index (at
    // most `MAX_OBJECTS` of them), and index 0 is never a key (`mr`).
    let mpt_keys = count(Table::Mpt).min(crate::resources::MAX_OBJECTS) - 1;
    let attr = CaAttr {
        node_guid: NodeGuid::new(cap.node_guid.get()),
        system_image_guid: SystemImageGuid::new(cap.system_image_guid.get()),
        vendor_id: cap.vendor_id.get() & 0x00FF_FFFF,
        device_id: cap.device_id.get(),
        revision: cap.revision.get(),
        fw_version: report.fw_version,
        limits: CaLimits {
            max_qps: count(Table::Qpc),
            // The depths the QP and SRQ verbs accept: the device's, within
            // the core's own bounds.
            max_wrs_per_qp: pow(cap.log_max_wqes.min(super::qp::MAX_LOG_WQES)),
            max_sges: cap.max_send_sges.into(),
            max_cqs: count(Table::Cqc),
            max_cqes: pow(cap.log_max_cqes),
            max_srqs: count(Table::Srqc),
            max_srq_wrs: pow(cap.log_max_srq_wqes.min(super::srq::LOG_MAX_INDEX)),
            max_srq_sges: cap.max_recv_sges.into(),
            max_pds: MAX_PDS,
            max_mrs: mpt_keys,
            max_mr_size: cap.max_mr_size.get(),
            max_mws: mpt_keys,
            // The AV table's size (AVs are software objects).
            max_avs: super::av::MAX_AVS,
            max_mcast_groups: cap.max_mcast_groups.get(),
            max_qps_per_mcast_group: cap.max_qps_per_mcast_group.get(),
            max_qp_rd_atomic: cap.max_rd_atomic.into(),
            max_qp_resp_res: cap.max_rd_atomic.into(),
            max_inline_data: max_inline_data(cap),
        },
        local_ack_delay: cap.local_ack_delay.min(31),
        atomicity: if flags.contains(DevCapFlags::ATOMICS) {
            Atomicity::Hca
        } else {
            Atomicity::None
        },
        caps,
        layout: CaLayout::default(),
    };
    let answers = ports
        .iter()
        .enumerate()
        .map(|(i, answer)| port_answer(i as u8 + 1, answer))
        .collect::<Result<Vec<_>, _>>()?;
    let port_data: Vec<PortData<'_>> = answers
        .iter()
        .map(|p| PortData {
            attr: p.attr,
            pkeys: &p.pkeys,
            gids: &p.gids,
        })
        .collect();
    let parts = CaAttrParts {
        attr,
        page_sizes: &PAGE_SIZES,
        ports: &port_data,
        vendor_data: &[],
    };
    let len = parts.encoded_len().map_err(|_| IbStatus::GenericError)?;
    let mut block = vec![0u8; len];
    parts
        .encode(&mut block)
        .map_err(|_| IbStatus::GenericError)?;
    Ok(block)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_capabilities_survive_the_port_info_mask() {
        let modifiable = CaModifyFlags::CAPABILITIES.port_caps();
        let mask = modifiable.port_info_capability_mask();
        assert_eq!(
            port_caps(mask),
            modifiable | PortCaps::QKEY_COUNTER | PortCaps::PKEY_COUNTER
        );
        assert_eq!(
            port_caps(0),
            PortCaps::QKEY_COUNTER | PortCaps::PKEY_COUNTER
        );
    }
}
