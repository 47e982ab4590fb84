//! The access layer for kernel clients over one CA (issue 11, second
//! increment; docs/ibal-bus.md "The access layer").
//!
//! - **Opening.** [`AccessLayer::open`] registers a client with an opaque
//!   reference object (the client's device or driver object reference,
//!   dropped = dereferenced) and its callbacks; the AL holds the reference
//!   until no callback can follow. [`AccessLayer::close`] is PASSIVE_LEVEL:
//!   it stops new callbacks and waits on the caller's event until those in
//!   flight have left (bounded: a callback runs at DISPATCH_LEVEL and may
//!   not block), then drops the reference.
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
//!   port events reach every open client.

mod handles;

use alloc::boxed::Box;
use alloc::collections::BTreeMap;
use alloc::sync::Arc;
use alloc::vec::Vec;
use core::any::Any;
use core::fmt;

use driver_platform::{Event, Irql, IrqlQuery, Request};
use ib_types::cq::CqNotify;
use ib_types::event::AsyncEventRecord;
use ib_types::handle::CqHandle;
use ib_types::ioctl::{IoctlCode, ObjectKind, REQUEST_HEADER_SIZE, RESPONSE_HEADER_SIZE, VerbId};
use ib_types::status::{IbStatus, NtStatus};
use ib_types::wc::WorkCompletion;
use ib_types::wr::{RecvWr, SendWr};
use lock_api::{Mutex, RawMutex};

use crate::ci::{CaEvents, CiAccess};
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
}

/// The reference object a client opens the AL with (its device or driver
/// object reference); dropping it releases the reference.
pub type ClientReference = Box<dyn Any + Send + Sync>;

/// An open client of the AL.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ClientId(u16);

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
    requests_in_flight: usize,
    closing: bool,
    drained: Option<Arc<dyn Event>>,
}

struct State {
    clients: BTreeMap<u16, Client>,
    /// The owner of each CA handle of a QP, CQ or SRQ, for routing events:
    /// (kind code, CA handle) to (client, client handle).
    owners: BTreeMap<(u8, u64), (u16, u64)>,
    next_tag: u16,
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
    state: Mutex<L, State>,
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

/// A request the AL accepted and sent on: what its completion needs.
struct InFlight {
    tag: u16,
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
            state: Mutex::new(State {
                clients: BTreeMap::new(),
                owners: BTreeMap::new(),
                next_tag: 1,
            }),
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
            },
        );
        Ok(ClientId(tag))
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

    /// The open client whose table holds the live object `handle`, if
    /// any: how a shell attributes a request that does not name its client
    /// (an IRP on a child's queue names only the object in its header).
    pub fn client_of_handle(&self, handle: u64) -> Option<ClientId> {
        self.state
            .lock()
            .clients
            .iter()
            .find(|(_, c)| !c.closing && c.table.get(handle).is_some())
            .map(|(tag, _)| ClientId(*tag))
    }

    /// Closes the client: refused with [`IbStatus::ResourceBusy`] while it
    /// owns objects or has requests in flight (it destroys them first),
    /// with [`IbStatus::InvalidState`] above PASSIVE_LEVEL (`irql` says),
    /// nothing changed. Otherwise no new callback starts; if some are in
    /// flight, it waits on `drained` (cleared here, set by the last one to
    /// leave), which is bounded because callbacks may not block. Then the
    /// reference is released and the client is gone.
    pub fn close(
        &self,
        client: ClientId,
        irql: &dyn IrqlQuery,
        drained: Arc<dyn Event>,
    ) -> Result<(), IbStatus> {
        if irql.current_irql() != Irql::PASSIVE {
            return Err(IbStatus::InvalidState);
        }
        let must_wait = {
            let mut state = self.state.lock();
            let entry = state.open_client(client)?;
            // The CA record is the one object a client always has.
            if entry.table.len() > 1 || entry.requests_in_flight != 0 {
                return Err(IbStatus::ResourceBusy);
            }
            entry.closing = true;
            drained.clear();
            entry.drained = Some(drained.clone());
            entry.callbacks_in_flight != 0
        };
        if must_wait {
            drained.wait();
        }
        let removed = self.state.lock().clients.remove(&client.0);
        // Dropping the reference outside the lock: its release may run
        // the client's cleanup.
        drop(removed.and_then(|mut c| c.reference.take()));
        Ok(())
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
            if client.closing && client.callbacks_in_flight == 0 {
                client.drained.clone()
            } else {
                None
            }
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
            Ok((ioctl, input, output_len, in_flight)) => {
                let al = Arc::clone(self);
                let done: CaCompletion = Box::new(move |status, output| {
                    al.finish(in_flight, request, status, output);
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
        {
            let mut state = self.state.lock();
            let State {
                clients, owners, ..
            } = &mut *state;
            let Some(entry) = clients.get_mut(&in_flight.tag) else {
                // Unreachable while requests are in flight (close refuses).
                drop(state);
                request.complete(status, 0);
                return;
            };
            entry.requests_in_flight -= 1;
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
        let entry = state
            .clients
            .get(&client.0)
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
                let tags: Vec<u16> = self.state.lock().clients.keys().copied().collect();
                for tag in tags {
                    self.deliver(tag, |events| events.async_event(event));
                }
                return;
            }
        };
        if let Some((tag, handle)) = self.owner(kind, event.handle) {
            let translated = AsyncEventRecord { handle, ..*event };
            self.deliver(tag, |events| events.async_event(&translated));
        }
    }
}
