//! The access layer for kernel clients over one CA (issue 11, second
//! increment; docs/ibal-bus.md "The access layer").
//!
//! - **Opening.** [`AccessLayer::open`] registers a client with an opaque
//!   reference object (the client's device or driver object reference,
//!   dropped = dereferenced) and its callbacks; the AL holds the reference
//!   until no callback can follow. [`AccessLayer::close`] is PASSIVE_LEVEL:
//!   it refuses the client's new requests and stops new callbacks, waits on
//!   the caller's event for its requests in flight, destroys what it left
//!   open through the CA in dependency order (QPs, AVs and MRs, CQs, PDs;
//!   a destroy the CA refuses leaves an [`Orphan`], never a silent leak,
//!   sent again by [`AccessLayer::destroy_orphans`]),
//!   waits for callbacks in flight (bounded: a callback runs at
//!   DISPATCH_LEVEL and may not block), then drops the reference.
//! - **Handles.** Each client has its own generation-checked table
//!   (module `handles`); a record maps the client's handle to the CA's. A handle
//!   of another client, of a destroyed object or of the wrong kind is
//!   refused with the kind's invalid-handle status. Destroying a PD that
//!   QPs, MRs or AVs use, or a CQ a QP uses, is refused with
//!   [`IbStatus::ResourceBusy`] before anything reaches the CA.
//! - **Verbs as requests.** [`AccessLayer::submit`] takes a request in the
//!   `ib_types::ioctl` framing (the same code and buffers as the user
//!   path), checks it, translates the client's handles to the CA's, and
//!   sends it to the CA through [`CiRequests`]; its completion translates
//!   the created handle back and completes the client's request with the
//!   status and, for a create, the new handle in the information field
//!   (otherwise the response's length). Never blocks; DISPATCH_LEVEL.
//!   [`AccessLayer::submit_and_wait`] is the PASSIVE_LEVEL helper. Post,
//!   poll and arm are direct calls with no request.
//! - **Events.** A CA's completion and affiliated async events reach only
//!   the client that owns the object, with the client's handle; CA and
//!   port events reach every open client, and so do the P_Key and GID
//!   table changes the shell finds ([`AccessLayer::port_changed`]).
//! - **Removal.** After [`AccessLayer::ca_removed`] every open client has
//!   been told, new requests end at once with `STATUS_DEVICE_REMOVED`,
//!   direct calls are refused, requests at the CA complete once as it
//!   answers (a failure as `STATUS_DEVICE_REMOVED`) or at their client's
//!   close, which does not wait for the gone CA, and `close` frees
//!   records without sending destroys.

mod handles;

use alloc::boxed::Box;
use alloc::collections::BTreeMap;
use alloc::sync::Arc;
use alloc::vec::Vec;
use core::any::Any;
use core::fmt;

use driver_platform::{Event, Irql, IrqlQuery, Request};
use ib_types::cq::CqNotify;
use ib_types::event::{AsyncEventCode, AsyncEventRecord};
use ib_types::handle::CqHandle;
use ib_types::ioctl::{
    DeallocPd, DeregMr, DestroyAv, DestroyCq, DestroyQp, Empty, IoctlCode, ObjectKind,
    REQUEST_HEADER_SIZE, RESPONSE_HEADER_SIZE, Verb, VerbId, encode_request, request_len,
    response_len,
};
use ib_types::status::{IbStatus, NtStatus};
use ib_types::wc::WorkCompletion;
use ib_types::wr::{RecvWr, SendWr};
use lock_api::{Mutex, RawMutex};

use crate::ci::{CaEvents, CiAccess, PortIdentity};
use handles::HandleTable;

/// What the CA calls when a control request the AL sent completes: the
/// request's status and its output buffer. DISPATCH_LEVEL or below.
pub type CaCompletion = Box<dyn FnOnce(NtStatus, &[u8]) + Send>;

/// The AL's way to build a control-verb request for [`CiAccess::submit`]
/// (on Windows an internal device-control IRP with a completion routine;
/// on the simulated host its request).
pub trait CiRequests: CiAccess {
    /// A request with `ioctl`, `input`, an output buffer of `output_len`
    /// bytes, and `done` run exactly once when it completes.
    fn control_request(
        &self,
        ioctl: u32,
        input: Vec<u8>,
        output_len: usize,
        done: CaCompletion,
    ) -> Self::Request;
}

/// A client's callbacks. Called at DISPATCH_LEVEL or below, never after
/// [`AccessLayer::close`] returned; they must not block.
pub trait ClientEvents: Send + Sync {
    /// A completion event on the client's CQ `cq` (its handle).
    fn completion(&self, cq: u64);
    /// An async event: an affiliated one with the client's handle of its
    /// object, or a CA or port event.
    fn async_event(&self, event: &AsyncEventRecord);
    /// The CA is going away ([`AccessLayer::ca_removed`]): from now on
    /// requests end with `STATUS_DEVICE_REMOVED`; the client should close.
    /// Told once, to each client open (not closing) at the removal.
    fn ca_removed(&self) {}
}

/// The reference object a client opens the AL with (its device or driver
/// object reference); dropping it releases the reference.
pub type ClientReference = Box<dyn Any + Send + Sync>;

/// An open client of the AL.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ClientId(u16);

impl ClientId {
    /// Whether `handle` carries this client's tag: how a shell tells which
    /// client a request naming the handle comes from (the AL still checks
    /// the handle itself against the client's table).
    pub fn owns(self, handle: u64) -> bool {
        HandleTable::<Object>::tag_of(handle) == self.0
    }
}

/// A kernel object of a client: the CA's handle for it and what it
/// depends on.
#[derive(Debug)]
struct Object {
    kind: ObjectKind,
    ca_handle: u64,
    /// The client's handles of the objects this one uses.
    parents: Vec<u64>,
    /// Objects (live or being created) that use this one.
    dependents: u32,
    /// A destroy request for it is at the CA.
    destroying: bool,
}

struct Client {
    table: HandleTable<Object>,
    /// The client's handle of the CA.
    ca_handle: u64,
    events: Arc<dyn ClientEvents>,
    reference: Option<ClientReference>,
    callbacks_in_flight: usize,
    /// Its requests at the CA, and the destroys `close` sent for it.
    requests_in_flight: usize,
    /// `close` began: no new request, direct call or callback.
    closing: bool,
    /// `close`'s caller's event, set by whoever leaves it quiet.
    drained: Option<Arc<dyn Event>>,
    /// Its requests at the CA, by sequence number: each ends the request
    /// with the status given, if the CA's answer did not end it first
    /// (returns whether it did). A close after the CA's removal ends them
    /// rather than wait for the gone device.
    pending: BTreeMap<u64, EndRequest>,
}

/// Ends a client's request held at the CA with a status (see
/// [`Client::pending`]); whether it was still there to end.
type EndRequest = Box<dyn FnOnce(NtStatus) -> bool + Send>;

/// An object a closed client left that the CA refused to destroy (or that
/// holds one that was refused, so its destroy was not sent): kept by the
/// AL rather than dropped, so the leak is visible
/// ([`AccessLayer::orphans`]) and the CA's handle known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Orphan {
    /// What it is.
    pub kind: ObjectKind,
    /// The CA's handle of it.
    pub ca_handle: u64,
    /// Why it is left: the CA's answer to its destroy, or
    /// [`IbStatus::ResourceBusy`] for one an orphan still uses.
    pub status: IbStatus,
}

impl Client {
    /// The caller's event of a closing client once nothing of it is in
    /// flight (no request, no destroy, no callback): whoever made it so
    /// sets it, outside the lock.
    fn drained_if_quiet(&self) -> Option<Arc<dyn Event>> {
        (self.closing && self.requests_in_flight == 0 && self.callbacks_in_flight == 0)
            .then(|| self.drained.clone())
            .flatten()
    }
}

struct State {
    clients: BTreeMap<u16, Client>,
    /// The owner of each CA handle of a QP, CQ or SRQ, for routing events:
    /// (kind code, CA handle) to (client, client handle).
    owners: BTreeMap<(u8, u64), (u16, u64)>,
    next_tag: u16,
    /// The sequence number of the next request sent to the CA.
    next_request: u64,
    /// What closed clients left that the CA would not destroy.
    orphans: Vec<Orphan>,
    /// The CA is gone ([`AccessLayer::ca_removed`]): nothing more is sent
    /// to it.
    removed: bool,
    /// A `destroy_orphans` under way.
    orphan_sweep: OrphanSweep,
}

impl State {
    /// A client that is open and not closing; any other is an invalid AL
    /// handle.
    fn open_client(&mut self, client: ClientId) -> Result<&mut Client, IbStatus> {
        self.clients
            .get_mut(&client.0)
            .filter(|entry| !entry.closing)
            .ok_or(IbStatus::InvalidAlHandle)
    }
}

/// The access layer over one CA, opened as `ca` through `ci`. `L` is the
/// platform's raw spin lock.
pub struct AccessLayer<L: RawMutex, C: CiRequests> {
    ci: Arc<C>,
    ca: u64,
    /// Shared with the completions of the destroys `close` sends.
    state: Arc<Mutex<L, State>>,
}

impl<L: RawMutex, C: CiRequests> fmt::Debug for AccessLayer<L, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AccessLayer")
            .field("ca", &self.ca)
            .finish_non_exhaustive()
    }
}

/// The invalid-handle status of each kind.
fn invalid_handle(kind: ObjectKind) -> IbStatus {
    match kind {
        ObjectKind::Ca => IbStatus::InvalidCaHandle,
        ObjectKind::Pd => IbStatus::InvalidPdHandle,
        ObjectKind::Av => IbStatus::InvalidAvHandle,
        ObjectKind::Qp => IbStatus::InvalidQpHandle,
        ObjectKind::Cq => IbStatus::InvalidCqHandle,
        ObjectKind::Srq => IbStatus::InvalidSrqHandle,
        ObjectKind::Mr => IbStatus::InvalidMrHandle,
        ObjectKind::Mw => IbStatus::InvalidMwHandle,
        ObjectKind::Mcast => IbStatus::InvalidMcastHandle,
    }
}

fn kind_code(kind: ObjectKind) -> u8 {
    kind as u8
}

/// What the AL does with a verb.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plan {
    /// Acts on its target; the response carries no handle.
    Use,
    /// Creates an object under its target.
    Create,
    /// Destroys its target.
    Destroy,
}

/// The verbs kernel clients send through the AL. Opening and closing the
/// CA are the AL's own (its clients share its open); waits and async
/// event reads are callbacks here; verbs whose layouts carry handles the
/// AL does not translate yet (SRQs, MWs, multicast, shared and
/// re-registered MRs) are refused.
fn plan(verb: VerbId) -> Option<Plan> {
    use VerbId as V;
    match verb {
        V::QueryCa
        | V::ModifyCa
        | V::QueryAv
        | V::ModifyAv
        | V::QueryQp
        | V::ModifyQp
        | V::QueryCq
        | V::ResizeCq
        | V::QueryMr
        | V::LocalMad => Some(Plan::Use),
        V::AllocPd | V::CreateAv | V::CreateQp | V::CreateCq | V::RegMr | V::RegPhysMr => {
            Some(Plan::Create)
        }
        V::DeallocPd | V::DestroyAv | V::DestroyQp | V::DestroyCq | V::DeregMr => {
            Some(Plan::Destroy)
        }
        _ => None,
    }
}

/// Offsets of the handles in a `CreateQp` request (header + `QpCreateAbi`).
const QP_CREATE_PD: usize = REQUEST_HEADER_SIZE + 8;
const QP_CREATE_SEND_CQ: usize = REQUEST_HEADER_SIZE + 16;
const QP_CREATE_RECV_CQ: usize = REQUEST_HEADER_SIZE + 24;
const QP_CREATE_SRQ: usize = REQUEST_HEADER_SIZE + 32;

fn read_u64(bytes: &[u8], at: usize) -> u64 {
    let mut raw = [0; 8];
    raw.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(raw)
}

fn read_u32(bytes: &[u8], at: usize) -> u32 {
    let mut raw = [0; 4];
    raw.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(raw)
}

fn write_u64(bytes: &mut [u8], at: usize, value: u64) {
    bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
}

/// Undoes what a create counted on its parents.
fn release_parents(table: &mut HandleTable<Object>, parents: &[u64]) {
    for parent in parents {
        if let Some(object) = table.get_mut(*parent) {
            object.dependents -= 1;
        }
    }
}

/// The order `close` destroys a client's objects in: each tier only after
/// everything of the tier before is gone (QPs use CQs and the PD; AVs and
/// MRs the PD).
const TEARDOWN_ORDER: [&[ObjectKind]; 4] = [
    &[ObjectKind::Qp],
    &[ObjectKind::Av, ObjectKind::Mr],
    &[ObjectKind::Cq],
    &[ObjectKind::Pd],
];

/// A destroy request for the CA: its code, input and output length.
type CaDestroy = (u32, Vec<u8>, usize);

/// A destroy request of verb `V` on the CA's `ca_handle`.
fn framed_destroy<V: Verb<In = Empty>>(ca_handle: u64) -> Option<CaDestroy> {
    let mut input = alloc::vec![0; request_len::<V>(0)?];
    encode_request::<V>(ca_handle, &Empty, &[], 0, &mut input).ok()?;
    Some((V::ID.ioctl().raw(), input, response_len::<V>(0)?))
}

/// The destroy request of an object of `kind` (the kinds the AL hands out).
fn destroy_request(kind: ObjectKind, ca_handle: u64) -> Option<CaDestroy> {
    match kind {
        ObjectKind::Qp => framed_destroy::<DestroyQp>(ca_handle),
        ObjectKind::Av => framed_destroy::<DestroyAv>(ca_handle),
        ObjectKind::Mr => framed_destroy::<DeregMr>(ca_handle),
        ObjectKind::Cq => framed_destroy::<DestroyCq>(ca_handle),
        ObjectKind::Pd => framed_destroy::<DeallocPd>(ca_handle),
        _ => None,
    }
}

/// Keeps a record a closing client's table gave up as an orphan; it no
/// longer routes events (its owner is gone).
fn orphan(
    owners: &mut BTreeMap<(u8, u64), (u16, u64)>,
    orphans: &mut Vec<Orphan>,
    object: Object,
    status: IbStatus,
) {
    owners.remove(&(kind_code(object.kind), object.ca_handle));
    orphans.push(Orphan {
        kind: object.kind,
        ca_handle: object.ca_handle,
        status,
    });
}

/// Why the CA did not destroy an object, from its answer to the destroy
/// (`None`: destroyed): the response's status, else the request's.
fn destroy_refusal(status: NtStatus, output: &[u8]) -> Option<IbStatus> {
    let answered = (output.len() >= RESPONSE_HEADER_SIZE)
        .then(|| IbStatus::try_from(read_u32(output, 0)).unwrap_or(IbStatus::GenericError));
    match answered {
        _ if !status.is_success() => Some(
            answered
                .filter(|ib| ib.is_error())
                .unwrap_or(IbStatus::from_ntstatus(status)),
        ),
        Some(IbStatus::Success) => None,
        Some(other) => Some(other),
        None => Some(IbStatus::GenericError),
    }
}

/// The CA answered a destroy [`AccessLayer::destroy_orphans`] sent for
/// `orphan`: gone, or kept with the CA's new reason (unless the CA is gone
/// too).
fn orphan_destroy_done<L: RawMutex>(
    state: &Mutex<L, State>,
    orphan: Orphan,
    status: NtStatus,
    output: &[u8],
) {
    let refusal = destroy_refusal(status, output);
    let drained = {
        let mut state = state.lock();
        state.orphan_sweep.in_flight -= 1;
        if let Some(reason) = refusal.filter(|_| !state.removed) {
            state.orphans.push(Orphan {
                status: reason,
                ..orphan
            });
        }
        (state.orphan_sweep.in_flight == 0)
            .then(|| state.orphan_sweep.drained.clone())
            .flatten()
    };
    if let Some(drained) = drained {
        drained.set();
    }
}

/// A [`AccessLayer::destroy_orphans`] under way: its destroys at the CA and
/// the caller's event, set by the last to come back.
#[derive(Default)]
struct OrphanSweep {
    drained: Option<Arc<dyn Event>>,
    in_flight: usize,
}

/// The CA answered a destroy `close` sent for the closing client `tag`'s
/// object `handle`: the record goes (its parents released), or, refused,
/// becomes an orphan with the CA's status and keeps its parents in use.
fn teardown_done<L: RawMutex>(
    state: &Mutex<L, State>,
    tag: u16,
    handle: u64,
    status: NtStatus,
    output: &[u8],
) {
    let refusal = destroy_refusal(status, output);
    let drained = {
        let mut state = state.lock();
        let State {
            clients,
            owners,
            orphans,
            removed,
            ..
        } = &mut *state;
        let Some(entry) = clients.get_mut(&tag) else {
            // Unreachable: close waits for its destroys.
            return;
        };
        entry.requests_in_flight -= 1;
        if let Some(object) = entry.table.remove(handle) {
            // After a removal a refused destroy orphans nothing: the CA's
            // objects went with it.
            match refusal.filter(|_| !*removed) {
                None => {
                    owners.remove(&(kind_code(object.kind), object.ca_handle));
                    release_parents(&mut entry.table, &object.parents);
                }
                Some(reason) => orphan(owners, orphans, object, reason),
            }
        }
        entry.drained_if_quiet()
    };
    if let Some(drained) = drained {
        drained.set();
    }
}

/// A request the AL accepted and sent on: what its completion needs.
struct InFlight {
    tag: u16,
    /// Its key in the client's `pending`.
    sequence: u64,
    plan: Plan,
    creates: Option<ObjectKind>,
    /// The client's handle of the target (a destroy's object).
    target: u64,
    /// The client's handles of the objects a create uses.
    parents: Vec<u64>,
    /// The verb's fixed output size.
    out_size: usize,
}

impl<L, C> AccessLayer<L, C>
where
    L: RawMutex + Send + Sync + 'static,
    C: CiRequests + 'static,
{
    /// The AL over the CA `ci` opened as `ca` (the shell forwards the
    /// CA's callbacks to [`CaEvents`] of the AL).
    pub fn new(ci: Arc<C>, ca: u64) -> Self {
        Self {
            ci,
            ca,
            state: Arc::new(Mutex::new(State {
                clients: BTreeMap::new(),
                owners: BTreeMap::new(),
                next_tag: 1,
                next_request: 0,
                orphans: Vec::new(),
                removed: false,
                orphan_sweep: OrphanSweep::default(),
            })),
        }
    }

    /// Opens the AL for a client: the AL holds `reference` until no
    /// callback can follow, and calls `events`. DISPATCH_LEVEL or below.
    /// [`IbStatus::InsufficientResources`] when every client tag is taken.
    pub fn open(
        &self,
        reference: ClientReference,
        events: Arc<dyn ClientEvents>,
    ) -> Result<ClientId, IbStatus> {
        let mut state = self.state.lock();
        let start = state.next_tag;
        let mut tag = start;
        while state.clients.contains_key(&tag) {
            tag = tag.wrapping_add(1).max(1);
            if tag == start {
                return Err(IbStatus::InsufficientResources);
            }
        }
        state.next_tag = tag.wrapping_add(1).max(1);
        let mut table = HandleTable::new(tag);
        let ca_handle = table
            .insert(Object {
                kind: ObjectKind::Ca,
                ca_handle: self.ca,
                parents: Vec::new(),
                dependents: 0,
                destroying: false,
            })
            .ok_or(IbStatus::InsufficientResources)?;
        state.clients.insert(
            tag,
            Client {
                table,
                ca_handle,
                events,
                reference: Some(reference),
                callbacks_in_flight: 0,
                requests_in_flight: 0,
                closing: false,
                drained: None,
                pending: BTreeMap::new(),
            },
        );
        Ok(ClientId(tag))
    }

    /// How many clients are open (closing ones included): a shell's
    /// check before it lets the CA go.
    pub fn open_clients(&self) -> usize {
        self.state.lock().clients.len()
    }

    /// The client's handle of the CA (the target of `QueryCa`, `AllocPd`,
    /// `CreateCq`, `CreateQp`), or `None` for a client not open.
    pub fn ca_handle(&self, client: ClientId) -> Option<u64> {
        self.state
            .lock()
            .clients
            .get(&client.0)
            .map(|c| c.ca_handle)
    }

    /// Closes the client, destroying what it left open (process death, a
    /// client that unloads without cleaning up). PASSIVE_LEVEL: refused with
    /// [`IbStatus::InvalidState`] above it (`irql` says), nothing changed;
    /// [`IbStatus::InvalidAlHandle`] for a client not open (or already
    /// closing).
    ///
    /// From the call on, the client's new requests and direct calls are
    /// refused with [`IbStatus::InvalidAlHandle`] and no new callback
    /// starts. Then, each wait on `drained` (cleared here, set by whoever
    /// leaves last; bounded, as requests complete when the CA answers and
    /// callbacks may not block):
    /// 1. requests in flight complete to the client as the CA answers them
    ///    (a create that succeeds is recorded, and destroyed below); after
    ///    [`Self::ca_removed`] they are ended at once with
    ///    `STATUS_DEVICE_REMOVED` instead (the gone device may answer only
    ///    at its driver's command timeout, or never), and an answer that
    ///    comes later ends nothing;
    /// 2. its objects are destroyed through the CA, one control request
    ///    each as [`Self::submit`] sends, tier by tier in dependency
    ///    order: QPs, then AVs and MRs, then CQs, then PDs (after
    ///    [`Self::ca_removed`] none is sent: the records are freed here);
    ///
    /// and every wait also lasts until the callbacks in flight have left.
    ///
    /// A destroy the CA refuses does not drop the record silently: it
    /// becomes an [`Orphan`] of the AL with the CA's status (and what it
    /// still uses, e.g. its PD, too, with [`IbStatus::ResourceBusy`],
    /// unsent). The client is closed regardless: its reference is released
    /// and `Ok` returned.
    pub fn close(
        &self,
        client: ClientId,
        irql: &dyn IrqlQuery,
        drained: Arc<dyn Event>,
    ) -> Result<(), IbStatus> {
        if irql.current_irql() != Irql::PASSIVE {
            return Err(IbStatus::InvalidState);
        }
        let removed = {
            let mut state = self.state.lock();
            let entry = state.open_client(client)?;
            entry.closing = true;
            entry.drained = Some(drained.clone());
            state.removed
        };
        if removed {
            self.end_requests_at_removed_ca(client.0);
        }
        self.wait_until_quiet(client.0, &*drained);
        for tier in TEARDOWN_ORDER {
            let destroys = self.start_teardown(client.0, tier);
            for (handle, ioctl, input, output_len) in destroys {
                let state = Arc::clone(&self.state);
                let tag = client.0;
                let done: CaCompletion = Box::new(move |status, output| {
                    teardown_done(&state, tag, handle, status, output);
                });
                let ca_request = self.ci.control_request(ioctl, input, output_len, done);
                self.ci.submit(ca_request);
            }
            self.wait_until_quiet(client.0, &*drained);
        }
        let removed = self.state.lock().clients.remove(&client.0);
        // Dropping the reference outside the lock: its release may run
        // the client's cleanup.
        drop(removed.and_then(|mut c| c.reference.take()));
        Ok(())
    }

    /// After the CA's removal, for a closing client `tag`: ends its
    /// requests still at the gone CA with `STATUS_DEVICE_REMOVED`, so its
    /// close does not wait for a device that may answer only at its
    /// driver's command timeout, or never. An answer that comes later
    /// finds nothing to end.
    fn end_requests_at_removed_ca(&self, tag: u16) {
        let ends: Vec<EndRequest> = match self.state.lock().clients.get_mut(&tag) {
            Some(entry) => core::mem::take(&mut entry.pending).into_values().collect(),
            None => return,
        };
        let status = IbStatus::DeviceRemoved.to_ntstatus();
        // Outside the lock: completing a request may run its issuer's
        // routine. Only the ends that found their request count: an answer
        // that took one first counted it itself.
        let ended = ends
            .into_iter()
            .filter_map(|end| end(status).then_some(()))
            .count();
        let drained = {
            let mut state = self.state.lock();
            let Some(entry) = state.clients.get_mut(&tag) else {
                return;
            };
            entry.requests_in_flight -= ended;
            entry.drained_if_quiet()
        };
        if let Some(drained) = drained {
            drained.set();
        }
    }

    /// Waits on `drained` until the closing client `tag` has no request,
    /// destroy or callback in flight. A set left over from an earlier wait
    /// only wakes it early to look again; a set that matters comes after
    /// the clear, which is made under the lock the setter decides under.
    fn wait_until_quiet(&self, tag: u16, drained: &dyn Event) {
        loop {
            {
                let state = self.state.lock();
                let Some(entry) = state.clients.get(&tag) else {
                    return;
                };
                if entry.requests_in_flight == 0 && entry.callbacks_in_flight == 0 {
                    return;
                }
                drained.clear();
            }
            drained.wait();
        }
    }

    /// Picks the closing client's objects of the kinds in `tier`: each one
    /// something still uses (a dependent an orphan kept) becomes an orphan
    /// at once; the others are marked and counted in flight, and their
    /// destroy requests returned (client handle, code, input, output
    /// length).
    fn start_teardown(&self, tag: u16, tier: &[ObjectKind]) -> Vec<(u64, u32, Vec<u8>, usize)> {
        let mut state = self.state.lock();
        let State {
            clients,
            owners,
            orphans,
            removed,
            ..
        } = &mut *state;
        let Some(entry) = clients.get_mut(&tag) else {
            return Vec::new();
        };
        let handles = entry
            .table
            .handles_where(|object| tier.contains(&object.kind));
        let mut destroys = Vec::new();
        if *removed {
            // The CA's objects went with it: free the records here.
            for handle in handles {
                if let Some(object) = entry.table.remove(handle) {
                    owners.remove(&(kind_code(object.kind), object.ca_handle));
                }
            }
            return destroys;
        }
        for handle in handles {
            let Some(object) = entry.table.get_mut(handle) else {
                continue;
            };
            let request = destroy_request(object.kind, object.ca_handle);
            match request {
                Some((ioctl, input, output_len)) if object.dependents == 0 => {
                    object.destroying = true;
                    entry.requests_in_flight += 1;
                    destroys.push((handle, ioctl, input, output_len));
                }
                _ => {
                    let status = if object.dependents != 0 {
                        IbStatus::ResourceBusy
                    } else {
                        IbStatus::GenericError
                    };
                    if let Some(object) = entry.table.remove(handle) {
                        orphan(owners, orphans, object, status);
                    }
                }
            }
        }
        destroys
    }

    /// Sends the orphans' destroys to the CA again, tier by tier in the
    /// order `close` uses, waiting on `drained` (cleared here, set by the
    /// last answer) after each: what the CA destroys goes, what it refuses
    /// again stays an orphan with its new status. Returns how many are
    /// left. PASSIVE_LEVEL ([`IbStatus::InvalidState`] above it, nothing
    /// sent); [`IbStatus::ResourceBusy`] while another call is under way.
    /// For the shell before it closes the CA (release-hardware): the
    /// miniport refuses to close a CA whose kernel objects remain. While it
    /// runs, the orphans at the CA are not listed by [`Self::orphans`].
    /// After a removal there are none.
    pub fn destroy_orphans(
        &self,
        irql: &dyn IrqlQuery,
        drained: Arc<dyn Event>,
    ) -> Result<usize, IbStatus> {
        if irql.current_irql() != Irql::PASSIVE {
            return Err(IbStatus::InvalidState);
        }
        {
            let mut state = self.state.lock();
            if state.orphan_sweep.drained.is_some() {
                return Err(IbStatus::ResourceBusy);
            }
            state.orphan_sweep.drained = Some(drained.clone());
        }
        for tier in TEARDOWN_ORDER {
            let sends: Vec<(Orphan, CaDestroy)> = {
                let mut state = self.state.lock();
                if state.removed {
                    break;
                }
                let (picked, kept): (Vec<Orphan>, Vec<Orphan>) =
                    core::mem::take(&mut state.orphans)
                        .into_iter()
                        .partition(|orphan| tier.contains(&orphan.kind));
                state.orphans = kept;
                let mut sends = Vec::new();
                for orphan in picked {
                    match destroy_request(orphan.kind, orphan.ca_handle) {
                        Some(request) => sends.push((orphan, request)),
                        None => state.orphans.push(orphan),
                    }
                }
                state.orphan_sweep.in_flight += sends.len();
                sends
            };
            for (orphan, (ioctl, input, output_len)) in sends {
                let state = Arc::clone(&self.state);
                let done: CaCompletion = Box::new(move |status, output| {
                    orphan_destroy_done(&state, orphan, status, output);
                });
                let ca_request = self.ci.control_request(ioctl, input, output_len, done);
                self.ci.submit(ca_request);
            }
            loop {
                {
                    let state = self.state.lock();
                    if state.orphan_sweep.in_flight == 0 {
                        break;
                    }
                    drained.clear();
                }
                drained.wait();
            }
        }
        let mut state = self.state.lock();
        state.orphan_sweep.drained = None;
        Ok(state.orphans.len())
    }

    /// The CA is gone (surprise removal, or the device leaving): tells
    /// every open client ([`ClientEvents::ca_removed`]), once. From then on
    /// new requests complete at once with `STATUS_DEVICE_REMOVED`
    /// ([`IbStatus::DeviceRemoved`]) and direct calls are refused with it,
    /// nothing reaching the CA; requests already at the CA complete exactly
    /// once as it answers, a failure as `STATUS_DEVICE_REMOVED` (the
    /// removal is its reason), or, if their client closes (or is closing)
    /// first, with `STATUS_DEVICE_REMOVED` at that close, which does not
    /// wait for the gone CA; `close` sends no destroy, freeing the
    /// records here, and the orphans are forgotten (their objects went
    /// with the CA). DISPATCH_LEVEL or below; never blocks.
    pub fn ca_removed(&self) {
        let (tags, closing): (Vec<u16>, Vec<u16>) = {
            let mut state = self.state.lock();
            if state.removed {
                return;
            }
            state.removed = true;
            state.orphans.clear();
            (
                state.clients.keys().copied().collect(),
                state
                    .clients
                    .iter()
                    .filter(|(_, client)| client.closing)
                    .map(|(tag, _)| *tag)
                    .collect(),
            )
        };
        for tag in tags {
            self.deliver(tag, |events| events.ca_removed());
        }
        // A close under way stops waiting for the gone CA.
        for tag in closing {
            self.end_requests_at_removed_ca(tag);
        }
    }

    /// The shell re-queried a port (after a port event, or on its own
    /// schedule) and found it `new`, having known it as `old`: each table
    /// that changed is told to every open client as the port event the CA
    /// itself does not raise, [`AsyncEventCode::PkeyChange`] for the P_Key
    /// table and [`AsyncEventCode::GidChange`] for the GID table, in that
    /// order; nothing when neither changed. DISPATCH_LEVEL or below.
    pub fn port_changed(&self, old: &PortIdentity, new: &PortIdentity) {
        let changes = [
            (old.pkeys != new.pkeys, AsyncEventCode::PkeyChange),
            (old.gids != new.gids, AsyncEventCode::GidChange),
        ];
        for (_, code) in changes.into_iter().filter(|(changed, _)| *changed) {
            if let Ok(event) = AsyncEventRecord::new(code, 0, Some(new.port_num), 0) {
                self.broadcast(&event);
            }
        }
    }

    /// Delivers a CA or port event to every open client.
    fn broadcast(&self, event: &AsyncEventRecord) {
        let tags: Vec<u16> = self.state.lock().clients.keys().copied().collect();
        for tag in tags {
            self.deliver(tag, |events| events.async_event(event));
        }
    }

    /// The objects closed clients left that the CA refused to destroy
    /// (see [`Self::close`]).
    pub fn orphans(&self) -> Vec<Orphan> {
        self.state.lock().orphans.clone()
    }

    /// Runs `call` on the client `tag`'s callbacks unless it is closing,
    /// counting it in flight so `close` can wait for it.
    fn deliver(&self, tag: u16, call: impl FnOnce(&dyn ClientEvents)) {
        let events = {
            let mut state = self.state.lock();
            let Some(client) = state.clients.get_mut(&tag) else {
                return;
            };
            if client.closing {
                return;
            }
            client.callbacks_in_flight += 1;
            client.events.clone()
        };
        call(&*events);
        let drained = {
            let mut state = self.state.lock();
            let Some(client) = state.clients.get_mut(&tag) else {
                return;
            };
            client.callbacks_in_flight -= 1;
            client.drained_if_quiet()
        };
        if let Some(drained) = drained {
            drained.set();
        }
    }

    /// Looks up a live object of `kind` in the client's table.
    fn resolve(client: &Client, handle: u64, kind: ObjectKind) -> Result<u64, IbStatus> {
        match client.table.get(handle) {
            Some(object) if object.kind == kind => Ok(object.ca_handle),
            _ => Err(invalid_handle(kind)),
        }
    }

    /// Sends one control-verb request of `client` to the CA (see the
    /// module doc). The request is always completed, at once (a refusal,
    /// with its status) or when the CA answers; returns `STATUS_PENDING`
    /// in the latter case, else the status it was completed with.
    /// DISPATCH_LEVEL or below; never blocks.
    pub fn submit<R: Request + 'static>(
        self: &Arc<Self>,
        client: ClientId,
        mut request: R,
    ) -> NtStatus {
        match self.accept(client, &mut request) {
            Ok((ioctl, input, output_len, mut in_flight)) => {
                // The request is ended once: by the CA's answer, or by a
                // close after the CA's removal, whichever takes it first.
                let slot: Arc<Mutex<L, Option<R>>> = Arc::new(Mutex::new(Some(request)));
                let end_slot = Arc::clone(&slot);
                let end: EndRequest = Box::new(move |status| {
                    let taken = end_slot.lock().take();
                    taken.map(|request| request.complete(status, 0)).is_some()
                });
                {
                    let mut state = self.state.lock();
                    in_flight.sequence = state.next_request;
                    state.next_request = state.next_request.wrapping_add(1);
                    if let Some(entry) = state.clients.get_mut(&in_flight.tag) {
                        entry.pending.insert(in_flight.sequence, end);
                    }
                }
                let al = Arc::clone(self);
                let done: CaCompletion = Box::new(move |status, output| {
                    // Taken outside the AL's lock; gone if a close ended it.
                    let taken = slot.lock().take();
                    if let Some(request) = taken {
                        al.finish(in_flight, request, status, output);
                    }
                });
                let ca_request = self.ci.control_request(ioctl, input, output_len, done);
                self.ci.submit(ca_request);
                NtStatus::PENDING
            }
            Err(status) => {
                let status = status.to_ntstatus();
                request.complete(status, 0);
                status
            }
        }
    }

    /// Checks a client request and translates it into the CA's request:
    /// its code, input and output length, and what its completion needs.
    fn accept<R: Request>(
        &self,
        client: ClientId,
        request: &mut R,
    ) -> Result<(u32, Vec<u8>, usize, InFlight), IbStatus> {
        if self.state.lock().removed {
            return Err(IbStatus::DeviceRemoved);
        }
        let ioctl = request.ioctl_code();
        let verb = VerbId::from_ioctl(IoctlCode::from_raw(ioctl))
            .map_err(|_| IbStatus::InvalidParameter)?;
        let plan = plan(verb).ok_or(IbStatus::Unsupported)?;
        let input = request.input();
        if input.len() < REQUEST_HEADER_SIZE {
            return Err(IbStatus::InvalidParameter);
        }
        let private_in = read_u32(input, 8) as usize;
        let private_out_max = read_u32(input, 12) as usize;
        if input.len() - REQUEST_HEADER_SIZE != verb.in_size().saturating_add(private_in) {
            return Err(IbStatus::InvalidParameter);
        }
        let output_len = request.output().len();
        let needed = (RESPONSE_HEADER_SIZE + verb.out_size()).saturating_add(private_out_max);
        if output_len < needed {
            return Err(IbStatus::InvalidParameter);
        }
        let mut bytes = request.input().to_vec();
        let target = read_u64(&bytes, 0);
        let target_kind = verb.target().ok_or(IbStatus::Unsupported)?;

        let mut state = self.state.lock();
        let entry = state.open_client(client)?;
        let ca_target = Self::resolve(entry, target, target_kind)?;
        write_u64(&mut bytes, 0, ca_target);
        let mut parents = Vec::new();
        if plan == Plan::Create {
            if target_kind != ObjectKind::Ca {
                parents.push(target);
            }
            if verb == VerbId::CreateQp {
                if read_u64(&bytes, QP_CREATE_SRQ) != 0 {
                    // The AL does not hand out SRQs yet.
                    return Err(IbStatus::InvalidSrqHandle);
                }
                for (at, kind) in [
                    (QP_CREATE_PD, ObjectKind::Pd),
                    (QP_CREATE_SEND_CQ, ObjectKind::Cq),
                    (QP_CREATE_RECV_CQ, ObjectKind::Cq),
                ] {
                    let handle = read_u64(&bytes, at);
                    let ca_handle = Self::resolve(entry, handle, kind)?;
                    write_u64(&mut bytes, at, ca_handle);
                    parents.push(handle);
                }
            }
            if parents
                .iter()
                .any(|p| entry.table.get(*p).is_some_and(|o| o.destroying))
            {
                return Err(IbStatus::ResourceBusy);
            }
            for parent in &parents {
                if let Some(object) = entry.table.get_mut(*parent) {
                    object.dependents += 1;
                }
            }
        }
        if plan == Plan::Destroy {
            let object = entry
                .table
                .get_mut(target)
                .ok_or(invalid_handle(target_kind))?;
            if object.dependents != 0 || object.destroying {
                return Err(IbStatus::ResourceBusy);
            }
            object.destroying = true;
        }
        entry.requests_in_flight += 1;
        Ok((
            ioctl,
            bytes,
            output_len,
            InFlight {
                tag: client.0,
                sequence: 0,
                plan,
                creates: verb.creates(),
                target,
                parents,
                out_size: verb.out_size(),
            },
        ))
    }

    /// The CA answered a request the AL sent for a client: records or
    /// forgets objects, translates the created handle, completes the
    /// client's request.
    fn finish<R: Request>(
        &self,
        in_flight: InFlight,
        mut request: R,
        status: NtStatus,
        output: &[u8],
    ) {
        // The response as the CA framed it, if it did (a request refused
        // before its verb ran has none).
        let response = (output.len() >= RESPONSE_HEADER_SIZE).then(|| {
            (
                IbStatus::try_from(read_u32(output, 0)).unwrap_or(IbStatus::GenericError),
                read_u32(output, 4) as usize,
                read_u64(output, 8),
            )
        });
        let succeeded = status.is_success()
            && response.is_some_and(|(ib_status, _, _)| ib_status == IbStatus::Success);
        let mut information = 0;
        let mut client_handle = 0;
        let mut failed_here = None;
        let drained = {
            let mut state = self.state.lock();
            let State {
                clients,
                owners,
                removed,
                ..
            } = &mut *state;
            let Some(entry) = clients.get_mut(&in_flight.tag) else {
                // Unreachable: close waits for requests in flight.
                drop(state);
                request.complete(status, 0);
                return;
            };
            entry.requests_in_flight -= 1;
            entry.pending.remove(&in_flight.sequence);
            if *removed && !succeeded {
                // The CA went while this was at it: whatever the gone
                // device answered (a command timeout, a failed-over
                // verb), the reason is the removal.
                failed_here = Some(IbStatus::DeviceRemoved);
            }
            match (in_flight.plan, in_flight.creates) {
                (Plan::Create, Some(kind)) if succeeded => {
                    let ca_handle = response.map_or(0, |(_, _, handle)| handle);
                    let inserted = if ca_handle == 0 {
                        None
                    } else {
                        entry.table.insert(Object {
                            kind,
                            ca_handle,
                            parents: in_flight.parents.clone(),
                            dependents: 0,
                            destroying: false,
                        })
                    };
                    match inserted {
                        Some(handle) => {
                            client_handle = handle;
                            owners.insert((kind_code(kind), ca_handle), (in_flight.tag, handle));
                        }
                        None => {
                            // No client handle for it: a success without a
                            // handle is a broken answer from below; a full
                            // table leaves the CA's object without one, so
                            // say so rather than lose it silently.
                            let reason = if ca_handle == 0 {
                                IbStatus::GenericError
                            } else {
                                IbStatus::InsufficientResources
                            };
                            failed_here = Some(reason);
                            release_parents(&mut entry.table, &in_flight.parents);
                        }
                    }
                }
                (Plan::Create, _) => release_parents(&mut entry.table, &in_flight.parents),
                (Plan::Destroy, _) if succeeded => {
                    if let Some(object) = entry.table.remove(in_flight.target) {
                        owners.remove(&(kind_code(object.kind), object.ca_handle));
                        release_parents(&mut entry.table, &object.parents);
                    }
                }
                (Plan::Destroy, _) => {
                    if let Some(object) = entry.table.get_mut(in_flight.target) {
                        object.destroying = false;
                    }
                }
                (Plan::Use, _) => {}
            }
            entry.drained_if_quiet()
        };
        if let Some(drained) = drained {
            drained.set();
        }
        let status = failed_here.map_or(status, IbStatus::to_ntstatus);
        if let Some((_, private_out, _)) = response {
            let out = request.output();
            let length = output.len().min(out.len());
            out[..length].copy_from_slice(&output[..length]);
            if out.len() >= RESPONSE_HEADER_SIZE {
                write_u64(out, 8, client_handle);
                if let Some(reason) = failed_here {
                    out[..4].copy_from_slice(&reason.code().to_le_bytes());
                }
            }
            information = if client_handle != 0 {
                client_handle
            } else {
                (RESPONSE_HEADER_SIZE + in_flight.out_size)
                    .saturating_add(private_out)
                    .min(length) as u64
            };
        }
        request.complete(status, information);
    }

    /// Submits `request` (as [`Self::submit`]) and waits until
    /// `completed` is set, which the caller arranged to happen when the
    /// request completes. PASSIVE_LEVEL only: above it (`irql` says) the
    /// request comes back unsubmitted in `Err`.
    pub fn submit_and_wait<R: Request + 'static>(
        self: &Arc<Self>,
        irql: &dyn IrqlQuery,
        client: ClientId,
        request: R,
        completed: &dyn Event,
    ) -> Result<NtStatus, R> {
        if irql.current_irql() != Irql::PASSIVE {
            return Err(request);
        }
        let status = self.submit(client, request);
        completed.wait();
        Ok(status)
    }

    /// The CA's handle of the client's object, for the direct calls.
    fn ca_object(&self, client: ClientId, handle: u64, kind: ObjectKind) -> Result<u64, IbStatus> {
        let state = self.state.lock();
        if state.removed {
            return Err(IbStatus::DeviceRemoved);
        }
        let entry = state
            .clients
            .get(&client.0)
            .filter(|entry| !entry.closing)
            .ok_or(IbStatus::InvalidAlHandle)?;
        Self::resolve(entry, handle, kind)
    }

    /// Posts send WRs to the client's QP `qp`; a UD WR's AV is the
    /// client's handle. Returns how many were posted and the status of the
    /// first that was not. Direct call, DISPATCH_LEVEL, no allocation.
    pub fn post_send(&self, client: ClientId, qp: u64, wrs: &[SendWr<'_>]) -> (usize, IbStatus) {
        let ca_qp = match self.ca_object(client, qp, ObjectKind::Qp) {
            Ok(handle) => handle,
            Err(status) => return (0, status),
        };
        for (posted, wr) in wrs.iter().enumerate() {
            let mut translated = *wr;
            if let Some(ud) = translated.ud.as_mut() {
                match self.ca_object(client, ud.av.raw(), ObjectKind::Av) {
                    Ok(av) => ud.av = ib_types::handle::AvHandle::from_raw(av),
                    Err(status) => return (posted, status),
                }
            }
            let (_, status) = self.ci.post_send(ca_qp, core::slice::from_ref(&translated));
            if status != IbStatus::Success {
                return (posted, status);
            }
        }
        (wrs.len(), IbStatus::Success)
    }

    /// Posts receive WRs to the client's QP `qp`. Direct call.
    pub fn post_recv(&self, client: ClientId, qp: u64, wrs: &[RecvWr<'_>]) -> (usize, IbStatus) {
        match self.ca_object(client, qp, ObjectKind::Qp) {
            Ok(ca_qp) => self.ci.post_recv(ca_qp, wrs),
            Err(status) => (0, status),
        }
    }

    /// Polls the client's CQ `cq`. Direct call.
    pub fn poll_cq(
        &self,
        client: ClientId,
        cq: u64,
        wcs: &mut [WorkCompletion],
    ) -> Result<usize, IbStatus> {
        let ca_cq = self.ca_object(client, cq, ObjectKind::Cq)?;
        self.ci.poll_cq(ca_cq, wcs)
    }

    /// Arms the client's CQ `cq` for one completion event. Direct call.
    pub fn arm_cq(&self, client: ClientId, cq: u64, notify: CqNotify) -> Result<(), IbStatus> {
        let ca_cq = self.ca_object(client, cq, ObjectKind::Cq)?;
        self.ci.arm_cq(ca_cq, notify)
    }

    /// The owner of a CA object, if a client has it.
    fn owner(&self, kind: ObjectKind, ca_handle: u64) -> Option<(u16, u64)> {
        self.state
            .lock()
            .owners
            .get(&(kind_code(kind), ca_handle))
            .copied()
    }
}

impl<L, C> CaEvents for AccessLayer<L, C>
where
    L: RawMutex + Send + Sync + 'static,
    C: CiRequests + 'static,
{
    fn completion(&self, cq: CqHandle) {
        if let Some((tag, handle)) = self.owner(ObjectKind::Cq, cq.raw()) {
            self.deliver(tag, |events| events.completion(handle));
        }
    }

    fn async_event(&self, event: &AsyncEventRecord) {
        use ib_types::event::EventSubject;
        let kind = match event.code.subject() {
            EventSubject::Qp => ObjectKind::Qp,
            EventSubject::Cq => ObjectKind::Cq,
            EventSubject::Srq => ObjectKind::Srq,
            EventSubject::Ca | EventSubject::Port => {
                self.broadcast(event);
                return;
            }
        };
        if let Some((tag, handle)) = self.owner(kind, event.handle) {
            let translated = AsyncEventRecord { handle, ..*event };
            self.deliver(tag, |events| events.async_event(&translated));
        }
    }
}
