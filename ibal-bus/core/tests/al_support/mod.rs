//! The access-layer tests' fixture: a mock CA that keeps real object
//! tables (creates hand out fresh handles, destroys free them, unknown
//! handles and dependents are refused as a CA does; it can hold requests
//! as a CA below D0 does and refuse chosen destroys), a client's request,
//! its recorded callbacks and reference, a test spin lock and event.

#![allow(dead_code)]

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use driver_platform::{Event, Irql, IrqlQuery, Request, RequestorMode};
use ib_types::av::AvAttr;
use ib_types::cq::{CqAttr, CqNotify};
use ib_types::event::AsyncEventRecord;
use ib_types::handle::{CqHandle, PdHandle};
use ib_types::interface::InterfaceVersion;
use ib_types::ioctl::{
    AllocPd, CqOut, CreateAv, CreateCq, CreateQp, DeallocPd, DeregMr, DestroyAv, DestroyCq,
    DestroyQp, Empty, IoctlCode, ObjectKind, QpCreated, QueryCa, RegMr, Verb, VerbId,
    decode_request, decode_response, encode_request, encode_response, request_len, response_len,
};
use ib_types::mr::{MrKeys, MrRegister};
use ib_types::qp::{QpCaps, QpCreate, QpType};
use ib_types::scalars::{Lid, PortNum, Qpn};
use ib_types::status::{IbStatus, NtStatus};
use ib_types::wc::WorkCompletion;
use ib_types::wr::{LKey, RKey, RecvWr, SendWr};
use ibal_bus_core::al::{AccessLayer, CaCompletion, CiRequests, ClientEvents, ClientId};
use ibal_bus_core::ci::{CaEvents, CaIdentity, CiAccess, REQUIRED_CI_VERSION};

// ---------------------------------------------------------------------------
// A test spin lock for the AL's state.

pub(crate) struct TestRawMutex(AtomicBool);

// SAFETY: `lock` returns only once it swapped the flag from false to true,
// so one holder at a time; `unlock` clears it, called by the holder only
// (lock_api's contract).
unsafe impl lock_api::RawMutex for TestRawMutex {
    #[allow(clippy::declare_interior_mutable_const)]
    const INIT: Self = Self(AtomicBool::new(false));
    type GuardMarker = lock_api::GuardSend;

    fn lock(&self) {
        while !self.try_lock() {
            std::hint::spin_loop();
        }
    }

    fn try_lock(&self) -> bool {
        self.0
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }

    unsafe fn unlock(&self) {
        self.0.store(false, Ordering::Release);
    }
}

// ---------------------------------------------------------------------------
// The mock CA.

pub(crate) const CA: u64 = 0xCA0;

#[derive(Debug, Clone)]
pub(crate) struct MockObject {
    pub kind: ObjectKind,
    pub parents: Vec<u64>,
}

pub(crate) struct MockRequest {
    pub ioctl: u32,
    pub input: Vec<u8>,
    pub output_len: usize,
    pub done: CaCompletion,
}

#[derive(Default)]
pub(crate) struct MockCa {
    pub objects: Mutex<HashMap<u64, MockObject>>,
    pub next: AtomicU64,
    /// Hold requests instead of answering them (a CA below D0).
    pub hold: AtomicBool,
    pub held: Mutex<Vec<MockRequest>>,
    /// (CA QP, wr_id, CA AV) of every posted send.
    pub sends: Mutex<Vec<(u64, u64, Option<u64>)>>,
    pub armed: Mutex<Vec<u64>>,
    /// The next verb fails with this status (the CA out of resources).
    pub fail_next: Mutex<Option<IbStatus>>,
    /// The next create answers success with handle 0 and keeps nothing (a
    /// broken CA).
    pub drop_next_handle: AtomicBool,
    /// CA handles whose destroy the CA refuses with `ResourceBusy` (as a
    /// CA does for an object it still uses, e.g. a region a window is
    /// bound to).
    pub refuse_destroy: Mutex<HashSet<u64>>,
    /// The kind of every object destroyed, in order.
    pub destroyed: Mutex<Vec<ObjectKind>>,
}

impl MockCa {
    pub(crate) fn live(&self) -> usize {
        self.objects.lock().unwrap().len()
    }

    /// The CA's handles of its live objects of `kind`, oldest first.
    pub(crate) fn handles_of(&self, kind: ObjectKind) -> Vec<u64> {
        let mut handles: Vec<u64> = self
            .objects
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, object)| object.kind == kind)
            .map(|(handle, _)| *handle)
            .collect();
        handles.sort_unstable();
        handles
    }

    pub(crate) fn need(
        &self,
        handle: u64,
        kind: ObjectKind,
        invalid: IbStatus,
    ) -> Result<(), IbStatus> {
        if kind == ObjectKind::Ca {
            return if handle == CA { Ok(()) } else { Err(invalid) };
        }
        match self.objects.lock().unwrap().get(&handle) {
            Some(object) if object.kind == kind => Ok(()),
            _ => Err(invalid),
        }
    }

    pub(crate) fn create(&self, kind: ObjectKind, parents: Vec<u64>) -> u64 {
        let handle = 0x1000 + self.next.fetch_add(1, Ordering::Relaxed);
        self.objects
            .lock()
            .unwrap()
            .insert(handle, MockObject { kind, parents });
        handle
    }

    pub(crate) fn destroy(
        &self,
        handle: u64,
        kind: ObjectKind,
        invalid: IbStatus,
    ) -> Result<(), IbStatus> {
        let mut objects = self.objects.lock().unwrap();
        match objects.get(&handle) {
            Some(object) if object.kind == kind => {}
            _ => return Err(invalid),
        }
        if objects.values().any(|o| o.parents.contains(&handle))
            || self.refuse_destroy.lock().unwrap().contains(&handle)
        {
            return Err(IbStatus::ResourceBusy);
        }
        objects.remove(&handle);
        self.destroyed.lock().unwrap().push(kind);
        Ok(())
    }

    /// Decodes a request of `V`, runs `verb` on it, frames the response.
    pub(crate) fn respond<V: Verb>(
        &self,
        input: &[u8],
        out: &mut [u8],
        verb: impl FnOnce(&Self, &ib_types::ioctl::Request<'_, V>) -> Result<(u64, V::Out), IbStatus>,
    ) -> NtStatus {
        let Ok(request) = decode_request::<V>(input) else {
            return NtStatus::INVALID_PARAMETER;
        };
        let injected = self.fail_next.lock().unwrap().take();
        match injected.map_or_else(|| verb(self, &request), Err) {
            Ok((handle, output)) => {
                encode_response::<V>(IbStatus::Success, handle, Some(&output), &[], out).unwrap();
                NtStatus::SUCCESS
            }
            Err(status) => {
                encode_response::<V>(status, 0, None, &[], out).unwrap();
                status.to_ntstatus()
            }
        }
    }

    pub(crate) fn answer(&self, request: MockRequest) {
        let mut out = vec![0; request.output_len];
        let input = &request.input[..];
        let o = &mut out[..];
        let status = match VerbId::from_ioctl(IoctlCode::from_raw(request.ioctl)) {
            Ok(VerbId::QueryCa) => self.respond::<QueryCa>(input, o, |ca, r| {
                ca.need(r.handle, ObjectKind::Ca, IbStatus::InvalidCaHandle)?;
                Err(IbStatus::Overflow)
            }),
            Ok(VerbId::AllocPd) => self.respond::<AllocPd>(input, o, |ca, r| {
                ca.need(r.handle, ObjectKind::Ca, IbStatus::InvalidCaHandle)?;
                Ok((ca.create(ObjectKind::Pd, vec![]), Empty))
            }),
            Ok(VerbId::DeallocPd) => self.respond::<DeallocPd>(input, o, |ca, r| {
                ca.destroy(r.handle, ObjectKind::Pd, IbStatus::InvalidPdHandle)?;
                Ok((0, Empty))
            }),
            Ok(VerbId::CreateCq) => self.respond::<CreateCq>(input, o, |ca, r| {
                ca.need(r.handle, ObjectKind::Ca, IbStatus::InvalidCaHandle)?;
                let cqe = r.input.cqe.next_power_of_two();
                Ok((ca.create(ObjectKind::Cq, vec![]), CqOut { cqe }))
            }),
            Ok(VerbId::DestroyCq) => self.respond::<DestroyCq>(input, o, |ca, r| {
                ca.destroy(r.handle, ObjectKind::Cq, IbStatus::InvalidCqHandle)?;
                Ok((0, Empty))
            }),
            Ok(VerbId::CreateQp) => self.respond::<CreateQp>(input, o, |ca, r| {
                ca.need(r.handle, ObjectKind::Ca, IbStatus::InvalidCaHandle)?;
                let q = &r.input;
                ca.need(q.pd.raw(), ObjectKind::Pd, IbStatus::InvalidPdHandle)?;
                ca.need(q.send_cq.raw(), ObjectKind::Cq, IbStatus::InvalidCqHandle)?;
                ca.need(q.recv_cq.raw(), ObjectKind::Cq, IbStatus::InvalidCqHandle)?;
                let parents = vec![q.pd.raw(), q.send_cq.raw(), q.recv_cq.raw()];
                let handle = ca.create(ObjectKind::Qp, parents);
                let qpn = Qpn::new(handle as u32 & 0xFF_FFFF).unwrap();
                Ok((handle, QpCreated { qpn, caps: q.caps }))
            }),
            Ok(VerbId::DestroyQp) => self.respond::<DestroyQp>(input, o, |ca, r| {
                ca.destroy(r.handle, ObjectKind::Qp, IbStatus::InvalidQpHandle)?;
                Ok((0, Empty))
            }),
            Ok(VerbId::CreateAv) => self.respond::<CreateAv>(input, o, |ca, r| {
                ca.need(r.handle, ObjectKind::Pd, IbStatus::InvalidPdHandle)?;
                Ok((ca.create(ObjectKind::Av, vec![r.handle]), Empty))
            }),
            Ok(VerbId::DestroyAv) => self.respond::<DestroyAv>(input, o, |ca, r| {
                ca.destroy(r.handle, ObjectKind::Av, IbStatus::InvalidAvHandle)?;
                Ok((0, Empty))
            }),
            Ok(VerbId::RegMr) => self.respond::<RegMr>(input, o, |ca, r| {
                ca.need(r.handle, ObjectKind::Pd, IbStatus::InvalidPdHandle)?;
                let handle = ca.create(ObjectKind::Mr, vec![r.handle]);
                let key = handle as u32;
                Ok((
                    handle,
                    MrKeys {
                        lkey: LKey::new(key),
                        rkey: RKey::new(key),
                    },
                ))
            }),
            Ok(VerbId::DeregMr) => self.respond::<DeregMr>(input, o, |ca, r| {
                ca.destroy(r.handle, ObjectKind::Mr, IbStatus::InvalidMrHandle)?;
                Ok((0, Empty))
            }),
            _ => NtStatus::INVALID_DEVICE_REQUEST,
        };
        if self.drop_next_handle.swap(false, Ordering::SeqCst) {
            let handle = u64::from_le_bytes(out[8..16].try_into().unwrap());
            self.objects.lock().unwrap().remove(&handle);
            out[8..16].fill(0);
        }
        (request.done)(status, &out);
    }

    /// Answers the requests held so far (the CA back in D0).
    pub(crate) fn release_held(&self) {
        // Under the queue's lock, so a request submitted meanwhile is
        // either held here or answered at once, never left behind.
        let held: Vec<_> = {
            let mut held = self.held.lock().unwrap();
            self.hold.store(false, Ordering::SeqCst);
            held.drain(..).collect()
        };
        for request in held {
            self.answer(request);
        }
    }
}

impl CiAccess for MockCa {
    type Request = MockRequest;
    fn version(&self) -> InterfaceVersion {
        REQUIRED_CI_VERSION
    }
    fn identity(&self) -> Result<CaIdentity, IbStatus> {
        Err(IbStatus::Unsupported)
    }
    fn open_ca(&self, _events: Arc<dyn CaEvents>) -> Result<u64, IbStatus> {
        Ok(CA)
    }
    fn close_ca(&self, _ca: u64) -> Result<(), IbStatus> {
        Ok(())
    }
    fn submit(&self, request: MockRequest) -> NtStatus {
        {
            let mut held = self.held.lock().unwrap();
            if self.hold.load(Ordering::SeqCst) {
                held.push(request);
                return NtStatus::PENDING;
            }
        }
        self.answer(request);
        NtStatus::PENDING
    }
    fn post_send(&self, qp: u64, wrs: &[SendWr<'_>]) -> (usize, IbStatus) {
        if self
            .need(qp, ObjectKind::Qp, IbStatus::InvalidQpHandle)
            .is_err()
        {
            return (0, IbStatus::InvalidQpHandle);
        }
        for (i, wr) in wrs.iter().enumerate() {
            let av = wr.ud.map(|ud| ud.av.raw());
            if let Some(av) = av
                && self
                    .need(av, ObjectKind::Av, IbStatus::InvalidAvHandle)
                    .is_err()
            {
                return (i, IbStatus::InvalidAvHandle);
            }
            self.sends.lock().unwrap().push((qp, wr.wr_id, av));
        }
        (wrs.len(), IbStatus::Success)
    }
    fn post_recv(&self, qp: u64, wrs: &[RecvWr<'_>]) -> (usize, IbStatus) {
        match self.need(qp, ObjectKind::Qp, IbStatus::InvalidQpHandle) {
            Ok(()) => (wrs.len(), IbStatus::Success),
            Err(status) => (0, status),
        }
    }
    fn poll_cq(&self, cq: u64, _wcs: &mut [WorkCompletion]) -> Result<usize, IbStatus> {
        self.need(cq, ObjectKind::Cq, IbStatus::InvalidCqHandle)?;
        Ok(0)
    }
    fn arm_cq(&self, cq: u64, _notify: CqNotify) -> Result<(), IbStatus> {
        self.need(cq, ObjectKind::Cq, IbStatus::InvalidCqHandle)?;
        self.armed.lock().unwrap().push(cq);
        Ok(())
    }
}

impl CiRequests for MockCa {
    fn control_request(
        &self,
        ioctl: u32,
        input: Vec<u8>,
        output_len: usize,
        done: CaCompletion,
    ) -> MockRequest {
        MockRequest {
            ioctl,
            input,
            output_len,
            done,
        }
    }
}

// ---------------------------------------------------------------------------
// A client's request, its events, its reference.

pub(crate) type Outcome = Arc<Mutex<Option<(NtStatus, u64, Vec<u8>)>>>;

pub(crate) struct ClientRequest {
    pub ioctl: u32,
    pub input: Vec<u8>,
    pub output: Vec<u8>,
    pub outcome: Outcome,
}

impl Request for ClientRequest {
    fn ioctl_code(&self) -> u32 {
        self.ioctl
    }
    fn requestor_mode(&self) -> RequestorMode {
        RequestorMode::Kernel
    }
    fn input(&self) -> &[u8] {
        &self.input
    }
    fn output(&mut self) -> &mut [u8] {
        &mut self.output
    }
    fn complete(self, status: NtStatus, information: u64) {
        let previous = self
            .outcome
            .lock()
            .unwrap()
            .replace((status, information, self.output));
        assert!(previous.is_none(), "completed twice");
    }
    fn is_canceled(&self) -> bool {
        false
    }
}

#[derive(Default)]
pub(crate) struct Recorder {
    pub completions: Mutex<Vec<u64>>,
    pub events: Mutex<Vec<AsyncEventRecord>>,
    /// While set, a completion callback waits here (a callback in flight).
    pub gate: Mutex<bool>,
    pub gate_changed: Condvar,
    pub entered: AtomicBool,
    /// How many times the client was told its CA is going away.
    pub removals: AtomicUsize,
}

impl ClientEvents for Recorder {
    fn completion(&self, cq: u64) {
        self.entered.store(true, Ordering::SeqCst);
        let mut gate = self.gate.lock().unwrap();
        while *gate {
            gate = self.gate_changed.wait(gate).unwrap();
        }
        self.completions.lock().unwrap().push(cq);
    }
    fn async_event(&self, event: &AsyncEventRecord) {
        self.events.lock().unwrap().push(*event);
    }
    fn ca_removed(&self) {
        self.removals.fetch_add(1, Ordering::SeqCst);
    }
}

/// The client's device object reference: records its release.
pub(crate) struct Reference(pub Arc<AtomicBool>);

impl Drop for Reference {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

#[derive(Default)]
pub(crate) struct TestEvent {
    pub set: Mutex<bool>,
    pub changed: Condvar,
}

impl Event for TestEvent {
    fn set(&self) {
        *self.set.lock().unwrap() = true;
        self.changed.notify_all();
    }
    fn clear(&self) {
        *self.set.lock().unwrap() = false;
    }
    fn is_set(&self) -> bool {
        *self.set.lock().unwrap()
    }
    fn wait(&self) {
        let mut set = self.set.lock().unwrap();
        while !*set {
            set = self.changed.wait(set).unwrap();
        }
    }
}

pub(crate) struct AtIrql(pub Irql);

impl IrqlQuery for AtIrql {
    fn current_irql(&self) -> Irql {
        self.0
    }
}

pub(crate) type Al = AccessLayer<TestRawMutex, MockCa>;

pub(crate) struct Fixture {
    pub ca: Arc<MockCa>,
    pub al: Arc<Al>,
}

pub(crate) struct OpenClient {
    pub id: ClientId,
    pub events: Arc<Recorder>,
    pub released: Arc<AtomicBool>,
}

impl Fixture {
    pub(crate) fn new() -> Self {
        let ca = Arc::new(MockCa::default());
        let al = Arc::new(AccessLayer::new(ca.clone(), CA));
        Self { ca, al }
    }

    pub(crate) fn open(&self) -> OpenClient {
        let events = Arc::new(Recorder::default());
        let released = Arc::new(AtomicBool::new(false));
        let id = self
            .al
            .open(Box::new(Reference(released.clone())), events.clone())
            .unwrap();
        OpenClient {
            id,
            events,
            released,
        }
    }

    /// Sends a verb request; returns the completion, which must have come.
    pub(crate) fn call<V: Verb>(
        &self,
        client: ClientId,
        handle: u64,
        input: &V::In,
    ) -> (NtStatus, u64, Vec<u8>) {
        let outcome = self.send::<V>(client, handle, input);
        let result = outcome.lock().unwrap().take();
        result.expect("request completed")
    }

    pub(crate) fn send<V: Verb>(&self, client: ClientId, handle: u64, input: &V::In) -> Outcome {
        let mut bytes = vec![0; request_len::<V>(0).unwrap()];
        encode_request::<V>(handle, input, &[], 0, &mut bytes).unwrap();
        let outcome = Outcome::default();
        let request = ClientRequest {
            ioctl: V::ID.ioctl().raw(),
            input: bytes,
            output: vec![0; response_len::<V>(0).unwrap()],
            outcome: outcome.clone(),
        };
        self.al.submit(client, request);
        outcome
    }

    /// A create that must succeed: the new handle, as the information
    /// field and the response header both give it.
    pub(crate) fn create<V: Verb>(&self, client: ClientId, parent: u64, input: &V::In) -> u64 {
        let (status, information, output) = self.call::<V>(client, parent, input);
        assert_eq!(status, NtStatus::SUCCESS, "{:?}", V::ID);
        let response = decode_response::<V>(&output).unwrap();
        assert_eq!(response.handle, information);
        assert_ne!(information, 0);
        information
    }

    pub(crate) fn pd(&self, client: ClientId) -> u64 {
        let ca = self.al.ca_handle(client).unwrap();
        self.create::<AllocPd>(client, ca, &Empty)
    }

    pub(crate) fn cq(&self, client: ClientId) -> u64 {
        let ca = self.al.ca_handle(client).unwrap();
        self.create::<CreateCq>(
            client,
            ca,
            &CqAttr {
                cqe: 100,
                comp_vector: 0,
            },
        )
    }

    pub(crate) fn qp(&self, client: ClientId, pd: u64, cq: u64) -> u64 {
        let ca = self.al.ca_handle(client).unwrap();
        self.create::<CreateQp>(client, ca, &qp_create(pd, cq))
    }

    /// A PD, a CQ and a QP on both of the client's: (PD, CQ, QP).
    pub(crate) fn pd_cq_qp(&self, client: ClientId) -> (u64, u64, u64) {
        let pd = self.pd(client);
        let cq = self.cq(client);
        (pd, cq, self.qp(client, pd, cq))
    }
}

/// Waits (at most 5 s, yielding) until `done` holds; `never` says what
/// never happened if it does not.
pub(crate) fn wait_until(never: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !done() {
        assert!(Instant::now() < deadline, "{never}");
        thread::yield_now();
    }
}

pub(crate) fn qp_create(pd: u64, cq: u64) -> QpCreate {
    QpCreate {
        qp_type: QpType::Ud,
        pd: PdHandle::from_raw(pd),
        send_cq: CqHandle::from_raw(cq),
        recv_cq: CqHandle::from_raw(cq),
        srq: None,
        caps: QpCaps {
            max_send_wr: 16,
            max_recv_wr: 16,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        sq_sig_all: false,
        port: None,
    }
}

pub(crate) fn av_attr() -> AvAttr {
    AvAttr {
        port: PortNum::new(1).unwrap(),
        sl: 0,
        dlid: Lid::new(7),
        path_bits: 0,
        static_rate: 0,
        grh: None,
    }
}

pub(crate) fn mr_register() -> MrRegister {
    MrRegister {
        vaddr: 0x10_0000,
        length: 4096,
        access: ib_types::access::AccessFlags::LOCAL_WRITE,
    }
}

pub(crate) fn raw_request(
    ioctl: u32,
    input: Vec<u8>,
    output_len: usize,
) -> (ClientRequest, Outcome) {
    let outcome = Outcome::default();
    let request = ClientRequest {
        ioctl,
        input,
        output: vec![0; output_len],
        outcome: outcome.clone(),
    };
    (request, outcome)
}
