//! What the bus filter needs from one HCA's CI interface
//! (`GUID_IB_CI_INTERFACE`, docs/miniport.md "ci"), as a trait each shell
//! implements over what the miniport below hands out: the simulated
//! host's shell over the miniport core's `CiProvider` it receives in the
//! host's counted interface reference; the KMDF shell (`ibal-bus`, `kmdf::ci::FfiCi`)
//! over the FFI table `ib_types::interface::CiInterface`. Every argument
//! and result is a plain `ib-types` value, a handle (`u64`) or a callback
//! object, so the FFI implementation is a one-for-one call through the
//! table's entry points.
//!
//! The ports are learnt the way any CI consumer learns them: a `QueryCa`
//! control verb sent through [`CiAccess::submit`], whose answer (the CA
//! attribute block, `ib_types::ca::CaAttrView`) [`ports_from_attributes`]
//! reads. [`PortQuery`] builds the request's bytes and the output room;
//! the shell wraps them in the platform's request, sends it, and hands
//! the completion's status and output to [`ports_from_answer`]. That may
//! be at DISPATCH_LEVEL and after the stack's D0 entry, when the
//! miniport's power-managed queue runs it.

use alloc::sync::Arc;
use alloc::vec::Vec;

use ib_types::ca::CaAttrView;
use ib_types::cq::CqNotify;
use ib_types::event::AsyncEventRecord;
use ib_types::handle::CqHandle;
use ib_types::interface::{CI_INTERFACE_VERSION, InterfaceVersion};
use ib_types::ioctl::{
    Empty, QueryCa, Verb, decode_response, encode_request, request_len, response_len,
};
use ib_types::scalars::{Gid, PKey, PortGuid, PortNum};
use ib_types::status::{IbStatus, NtStatus};
use ib_types::wc::WorkCompletion;
use ib_types::wr::{RecvWr, SendWr};

/// The CI interface version this filter is written against: a provider
/// must satisfy it (same major, at least this minor).
pub const REQUIRED_CI_VERSION: InterfaceVersion = CI_INTERFACE_VERSION;

pub use ib_types::ca::CaIdentity;

/// One port as the CA's attribute query reports it: what the children of
/// the port are built from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortIdentity {
    /// The port's number (1-based).
    pub port_num: PortNum,
    /// The port GUID (part of each child's instance ID).
    pub port_guid: PortGuid,
    /// The port's P_Key table.
    pub pkeys: Vec<PKey>,
    /// The port's GID table (the access layer tells its clients when it
    /// changes, `al::AccessLayer::port_changed`).
    pub gids: Vec<Gid>,
}

/// The callbacks a consumer registers when it opens the CA. Called at
/// DISPATCH_LEVEL, never after `close_ca` returned.
pub trait CaEvents: Send + Sync {
    /// A completion event on `cq` (one-shot: re-arm for another).
    fn completion(&self, cq: CqHandle);
    /// An asynchronous event of the CA (port up or down, an object's
    /// error).
    fn async_event(&self, event: &AsyncEventRecord);
}

/// The bus filter's access to one HCA's CI interface. `Request` is what
/// the interface's control-verb path carries (an IRP on Windows, the
/// simulated host's request on Linux).
pub trait CiAccess: Send + Sync {
    /// What [`CiAccess::submit`] carries.
    type Request;

    /// The version the provider answered the query with.
    fn version(&self) -> InterfaceVersion;

    /// The CA's identity.
    fn identity(&self) -> Result<CaIdentity, IbStatus>;

    /// Opens the CA and registers `events`; returns the CA handle.
    /// DISPATCH_LEVEL or below.
    fn open_ca(&self, events: Arc<dyn CaEvents>) -> Result<u64, IbStatus>;

    /// Closes the CA opened as `ca`; no callback follows once it returned.
    /// PASSIVE_LEVEL (it waits for callbacks in flight).
    fn close_ca(&self, ca: u64) -> Result<(), IbStatus>;

    /// Sends one control verb request into the miniport's queue; returns
    /// what the path reports at once (`STATUS_PENDING` when it completes
    /// later). Never blocks; DISPATCH_LEVEL or below.
    fn submit(&self, request: Self::Request) -> NtStatus;

    /// Posts send WRs to the kernel QP `qp` (direct call, no request).
    fn post_send(&self, qp: u64, wrs: &[SendWr<'_>]) -> (usize, IbStatus);

    /// Posts receive WRs to the kernel QP `qp` (direct call).
    fn post_recv(&self, qp: u64, wrs: &[RecvWr<'_>]) -> (usize, IbStatus);

    /// Polls up to `wcs.len()` completions of `cq` (direct call).
    fn poll_cq(&self, cq: u64, wcs: &mut [WorkCompletion]) -> Result<usize, IbStatus>;

    /// Arms `cq` for one completion event (direct call).
    fn arm_cq(&self, cq: u64, notify: CqNotify) -> Result<(), IbStatus>;
}

/// The ports of a CA from its `QueryCa` answer (the attribute block, as
/// untrusted bytes from below: any inconsistency is
/// [`IbStatus::GenericError`]). DISPATCH_LEVEL or below.
pub fn ports_from_attributes(block: &[u8]) -> Result<Vec<PortIdentity>, IbStatus> {
    let view = CaAttrView::parse(block).map_err(|_| IbStatus::GenericError)?;
    Ok(view
        .ports()
        .map(|port| PortIdentity {
            port_num: port.port_num(),
            port_guid: port.attr().port_guid,
            pkeys: port.pkeys().to_vec(),
            gids: port.gids().to_vec(),
        })
        .collect())
}

/// Room for the CA attribute block a port query asks for: a CA of up to a
/// few ports with full tables (the guide's `QueryCa`; a larger block is
/// answered `Overflow`, which [`ports_from_answer`] reports as it is).
pub const QUERY_CA_ROOM: u32 = 16 * 1024;

/// The `QueryCa` control verb that learns a CA's ports, built for the
/// shell to wrap in its platform's request: the IOCTL code, the input
/// bytes and the output room, with [`QUERY_CA_ROOM`] for the attribute
/// block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortQuery {
    /// The request's IOCTL code (`QueryCa`).
    pub ioctl: u32,
    /// The request's input bytes.
    pub input: Vec<u8>,
    /// The output buffer's length the request must carry.
    pub output_len: usize,
}

impl PortQuery {
    /// The port query on the CA opened as `ca`.
    /// [`IbStatus::InsufficientResources`] when the lengths do not fit the
    /// platform, [`IbStatus::InvalidParameter`] when the request does not
    /// encode; nothing to send then. DISPATCH_LEVEL or below.
    pub fn new(ca: u64) -> Result<Self, IbStatus> {
        let (Some(input_len), Some(output_len)) = (
            request_len::<QueryCa>(0),
            response_len::<QueryCa>(QUERY_CA_ROOM as usize),
        ) else {
            return Err(IbStatus::InsufficientResources);
        };
        let mut input = alloc::vec![0; input_len];
        encode_request::<QueryCa>(ca, &Empty, &[], QUERY_CA_ROOM, &mut input)
            .map_err(|_| IbStatus::InvalidParameter)?;
        Ok(Self {
            ioctl: QueryCa::ID.ioctl().raw(),
            input,
            output_len,
        })
    }
}

/// The ports from a completed [`PortQuery`]: the request's completion
/// `status` and the `output` bytes it wrote. A failed request is its
/// status as an [`IbStatus`]; a verb the CA refused is the answer's
/// status; an answer that does not decode, or whose attribute block does
/// not parse, is [`IbStatus::GenericError`]. DISPATCH_LEVEL or below.
pub fn ports_from_answer(status: NtStatus, output: &[u8]) -> Result<Vec<PortIdentity>, IbStatus> {
    if !status.is_success() {
        return Err(IbStatus::from_ntstatus(status));
    }
    match decode_response::<QueryCa>(output) {
        Ok(response) if response.status == IbStatus::Success => {
            ports_from_attributes(response.private)
        }
        Ok(response) => Err(response.status),
        Err(_) => Err(IbStatus::GenericError),
    }
}

/// The ports known before (`old`) and answered now (`new`), paired by
/// port number, whose P_Key or GID table differs: what
/// `al::AccessLayer::port_changed` tells the clients of. A port in only
/// one of the lists has nothing to compare and is left out.
pub fn changed_ports(
    old: &[PortIdentity],
    new: &[PortIdentity],
) -> Vec<(PortIdentity, PortIdentity)> {
    new.iter()
        .filter_map(|new| {
            old.iter()
                .find(|old| old.port_num == new.port_num)
                .filter(|old| old.pkeys != new.pkeys || old.gids != new.gids)
                .map(|old| (old.clone(), new.clone()))
        })
        .collect()
}

/// A port re-query answered `answered`: it replaces the ports `known`,
/// and the ports whose tables changed ([`changed_ports`]) are returned for
/// `al::AccessLayer::port_changed`.
pub fn update_known_ports(
    known: &mut Vec<PortIdentity>,
    answered: Vec<PortIdentity>,
) -> Vec<(PortIdentity, PortIdentity)> {
    let changed = changed_ports(known, &answered);
    *known = answered;
    changed
}
