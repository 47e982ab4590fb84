//! The access layer over a mock CA that keeps real object tables (creates
//! hand out fresh handles, destroys free them, unknown handles and
//! dependents are refused as a CA does): two clients, handle isolation,
//! busy on dependents, close with a callback in flight, events to the
//! owner only, malformed requests refused with a clear status.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::Duration;

use driver_platform::{Event, Irql, IrqlQuery, Request, RequestorMode};
use ib_types::av::AvAttr;
use ib_types::cq::{CqAttr, CqNotify};
use ib_types::event::{AsyncEventCode, AsyncEventRecord};
use ib_types::handle::{AvHandle, CqHandle, PdHandle};
use ib_types::interface::InterfaceVersion;
use ib_types::ioctl::{
    AllocPd, CqOut, CreateAv, CreateCq, CreateQp, DeallocPd, DeregMr, DestroyAv, DestroyCq,
    DestroyQp, Empty, IoctlCode, ObjectKind, QpCreated, QueryCa, RegMr, Verb, VerbId,
    decode_request, decode_response, encode_request, encode_response, request_len, response_len,
};
use ib_types::mr::{MrKeys, MrRegister};
use ib_types::qp::{QpCaps, QpCreate, QpType};
use ib_types::scalars::{Lid, PortNum, QKey, Qpn};
use ib_types::status::{IbStatus, NtStatus};
use ib_types::wc::WorkCompletion;
use ib_types::wr::{LKey, RKey, RecvWr, SendFlags, SendOp, SendWr, UdDest};
use ibal_bus_core::al::{AccessLayer, CaCompletion, CiRequests, ClientEvents, ClientId};
use ibal_bus_core::ci::{CaEvents, CaIdentity, CiAccess, REQUIRED_CI_VERSION};

// ---------------------------------------------------------------------------
// A test spin lock for the AL's state.

struct TestRawMutex(AtomicBool);

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

const CA: u64 = 0xCA0;

#[derive(Debug, Clone)]
struct MockObject {
    kind: ObjectKind,
    parents: Vec<u64>,
}

struct MockRequest {
    ioctl: u32,
    input: Vec<u8>,
    output_len: usize,
    done: CaCompletion,
}

#[derive(Default)]
struct MockCa {
    objects: Mutex<HashMap<u64, MockObject>>,
    next: AtomicU64,
    /// Hold requests instead of answering them (a CA below D0).
    hold: AtomicBool,
    held: Mutex<Vec<MockRequest>>,
    /// (CA QP, wr_id, CA AV) of every posted send.
    sends: Mutex<Vec<(u64, u64, Option<u64>)>>,
    armed: Mutex<Vec<u64>>,
    /// The next verb fails with this status (the CA out of resources).
    fail_next: Mutex<Option<IbStatus>>,
    /// The next create answers success with handle 0 and keeps nothing (a
    /// broken CA).
    drop_next_handle: AtomicBool,
}

impl MockCa {
    fn live(&self) -> usize {
        self.objects.lock().unwrap().len()
    }

    fn need(&self, handle: u64, kind: ObjectKind, invalid: IbStatus) -> Result<(), IbStatus> {
        if kind == ObjectKind::Ca {
            return if handle == CA { Ok(()) } else { Err(invalid) };
        }
        match self.objects.lock().unwrap().get(&handle) {
            Some(object) if object.kind == kind => Ok(()),
            _ => Err(invalid),
        }
    }

    fn create(&self, kind: ObjectKind, parents: Vec<u64>) -> u64 {
        let handle = 0x1000 + self.next.fetch_add(1, Ordering::Relaxed);
        self.objects
            .lock()
            .unwrap()
            .insert(handle, MockObject { kind, parents });
        handle
    }

    fn destroy(&self, handle: u64, kind: ObjectKind, invalid: IbStatus) -> Result<(), IbStatus> {
        let mut objects = self.objects.lock().unwrap();
        match objects.get(&handle) {
            Some(object) if object.kind == kind => {}
            _ => return Err(invalid),
        }
        if objects.values().any(|o| o.parents.contains(&handle)) {
            return Err(IbStatus::ResourceBusy);
        }
        objects.remove(&handle);
        Ok(())
    }

    /// Decodes a request of `V`, runs `verb` on it, frames the response.
    fn respond<V: Verb>(
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

    fn answer(&self, request: MockRequest) {
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
    fn release_held(&self) {
        self.hold.store(false, Ordering::SeqCst);
        let held: Vec<_> = self.held.lock().unwrap().drain(..).collect();
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
        if self.hold.load(Ordering::SeqCst) {
            self.held.lock().unwrap().push(request);
            return NtStatus::PENDING;
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

type Outcome = Arc<Mutex<Option<(NtStatus, u64, Vec<u8>)>>>;

struct ClientRequest {
    ioctl: u32,
    input: Vec<u8>,
    output: Vec<u8>,
    outcome: Outcome,
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
struct Recorder {
    completions: Mutex<Vec<u64>>,
    events: Mutex<Vec<AsyncEventRecord>>,
    /// While set, a completion callback waits here (a callback in flight).
    gate: Mutex<bool>,
    gate_changed: Condvar,
    entered: AtomicBool,
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
}

/// The client's device object reference: records its release.
struct Reference(Arc<AtomicBool>);

impl Drop for Reference {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

#[derive(Default)]
struct TestEvent {
    set: Mutex<bool>,
    changed: Condvar,
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

struct AtIrql(Irql);

impl IrqlQuery for AtIrql {
    fn current_irql(&self) -> Irql {
        self.0
    }
}

type Al = AccessLayer<TestRawMutex, MockCa>;

struct Fixture {
    ca: Arc<MockCa>,
    al: Arc<Al>,
}

struct OpenClient {
    id: ClientId,
    events: Arc<Recorder>,
    released: Arc<AtomicBool>,
}

impl Fixture {
    fn new() -> Self {
        let ca = Arc::new(MockCa::default());
        let al = Arc::new(AccessLayer::new(ca.clone(), CA));
        Self { ca, al }
    }

    fn open(&self) -> OpenClient {
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
    fn call<V: Verb>(
        &self,
        client: ClientId,
        handle: u64,
        input: &V::In,
    ) -> (NtStatus, u64, Vec<u8>) {
        let outcome = self.send::<V>(client, handle, input);
        let result = outcome.lock().unwrap().take();
        result.expect("request completed")
    }

    fn send<V: Verb>(&self, client: ClientId, handle: u64, input: &V::In) -> Outcome {
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
    fn create<V: Verb>(&self, client: ClientId, parent: u64, input: &V::In) -> u64 {
        let (status, information, output) = self.call::<V>(client, parent, input);
        assert_eq!(status, NtStatus::SUCCESS, "{:?}", V::ID);
        let response = decode_response::<V>(&output).unwrap();
        assert_eq!(response.handle, information);
        assert_ne!(information, 0);
        information
    }

    fn pd(&self, client: ClientId) -> u64 {
        let ca = self.al.ca_handle(client).unwrap();
        self.create::<AllocPd>(client, ca, &Empty)
    }

    fn cq(&self, client: ClientId) -> u64 {
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

    fn qp(&self, client: ClientId, pd: u64, cq: u64) -> u64 {
        let ca = self.al.ca_handle(client).unwrap();
        self.create::<CreateQp>(client, ca, &qp_create(pd, cq))
    }
}

fn qp_create(pd: u64, cq: u64) -> QpCreate {
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

fn av_attr() -> AvAttr {
    AvAttr {
        port: PortNum::new(1).unwrap(),
        sl: 0,
        dlid: Lid::new(7),
        path_bits: 0,
        static_rate: 0,
        grh: None,
    }
}

fn mr_register() -> MrRegister {
    MrRegister {
        vaddr: 0x10_0000,
        length: 4096,
        access: ib_types::access::AccessFlags::LOCAL_WRITE,
    }
}

// ---------------------------------------------------------------------------

#[test]
fn creates_map_client_handles_to_fresh_ca_handles_and_destroys_free_them() {
    let f = Fixture::new();
    let a = f.open();
    let pd = f.pd(a.id);
    let cq = f.cq(a.id);
    let qp = f.qp(a.id, pd, cq);
    let av = f.create::<CreateAv>(a.id, pd, &av_attr());
    let mr = f.create::<RegMr>(a.id, pd, &mr_register());
    assert_eq!(f.ca.live(), 5);
    // The fixed output comes through: the CQ's granted size.
    let (status, _, output) = f.call::<CreateCq>(
        a.id,
        f.al.ca_handle(a.id).unwrap(),
        &CqAttr {
            cqe: 5,
            comp_vector: 0,
        },
    );
    assert_eq!(status, NtStatus::SUCCESS);
    let created = decode_response::<CreateCq>(&output).unwrap();
    assert_eq!(created.output.unwrap().cqe, 8);
    let extra_cq = created.handle;
    // Destroys in dependency order free the CA's objects.
    for (status, _, _) in [
        f.call::<DestroyCq>(a.id, extra_cq, &Empty),
        f.call::<DestroyQp>(a.id, qp, &Empty),
        f.call::<DestroyAv>(a.id, av, &Empty),
        f.call::<DeregMr>(a.id, mr, &Empty),
        f.call::<DestroyCq>(a.id, cq, &Empty),
        f.call::<DeallocPd>(a.id, pd, &Empty),
    ] {
        assert_eq!(status, NtStatus::SUCCESS);
    }
    assert_eq!(f.ca.live(), 0);
    // A destroyed object's handle is refused from then on.
    let (status, _, _) = f.call::<DeallocPd>(a.id, pd, &Empty);
    assert_eq!(status, IbStatus::InvalidPdHandle.to_ntstatus());
}

#[test]
fn a_handle_of_another_client_is_refused_as_invalid() {
    let f = Fixture::new();
    let a = f.open();
    let b = f.open();
    let pd_a = f.pd(a.id);
    let cq_a = f.cq(a.id);
    let pd_b = f.pd(b.id);
    let cq_b = f.cq(b.id);
    // B names A's objects: refused before the CA sees anything.
    let before = f.ca.live();
    assert_eq!(
        f.call::<DeallocPd>(b.id, pd_a, &Empty).0,
        IbStatus::InvalidPdHandle.to_ntstatus()
    );
    assert_eq!(
        f.call::<CreateAv>(b.id, pd_a, &av_attr()).0,
        IbStatus::InvalidPdHandle.to_ntstatus()
    );
    let ca_b = f.al.ca_handle(b.id).unwrap();
    assert_eq!(
        f.call::<CreateQp>(b.id, ca_b, &qp_create(pd_b, cq_a)).0,
        IbStatus::InvalidCqHandle.to_ntstatus()
    );
    // A's CA handle is not B's either.
    let ca_a = f.al.ca_handle(a.id).unwrap();
    assert_eq!(
        f.call::<AllocPd>(b.id, ca_a, &Empty).0,
        IbStatus::InvalidCaHandle.to_ntstatus()
    );
    // A handle of the wrong kind is refused as well.
    assert_eq!(
        f.call::<DestroyCq>(a.id, pd_a, &Empty).0,
        IbStatus::InvalidCqHandle.to_ntstatus()
    );
    assert_eq!(f.ca.live(), before);
    // The direct calls check the same way.
    assert_eq!(
        f.al.poll_cq(b.id, cq_a, &mut []),
        Err(IbStatus::InvalidCqHandle)
    );
    assert_eq!(
        f.al.arm_cq(a.id, cq_b, CqNotify::NextCompletion),
        Err(IbStatus::InvalidCqHandle)
    );
    assert_eq!(f.al.arm_cq(a.id, cq_a, CqNotify::NextCompletion), Ok(()));
    assert_eq!(f.ca.armed.lock().unwrap().len(), 1);
}

/// A request that reaches a shell without naming its client (an IRP on a
/// child's queue) is attributed by the handle it names: the client whose
/// table holds that live object, and no other.
#[test]
fn a_live_handle_names_its_client_and_nothing_else_does() {
    let f = Fixture::new();
    let a = f.open();
    let b = f.open();
    let pd_a = f.pd(a.id);
    let ca_b = f.al.ca_handle(b.id).unwrap();
    assert_eq!(f.al.client_of_handle(pd_a), Some(a.id));
    assert_eq!(f.al.client_of_handle(ca_b), Some(b.id));
    // A destroyed object, zero and a made-up handle name no client.
    assert_eq!(f.call::<DeallocPd>(a.id, pd_a, &Empty).0, NtStatus::SUCCESS);
    assert_eq!(f.al.client_of_handle(pd_a), None);
    assert_eq!(f.al.client_of_handle(0), None);
    assert_eq!(f.al.client_of_handle(u64::MAX), None);
    // A closed client's handles name nothing.
    let drained: Arc<dyn Event> = Arc::new(TestEvent::default());
    f.al.close(b.id, &AtIrql(Irql::PASSIVE), drained).unwrap();
    assert_eq!(f.al.client_of_handle(ca_b), None);
}

#[test]
fn destroying_an_object_others_depend_on_is_busy() {
    let f = Fixture::new();
    let a = f.open();
    let pd = f.pd(a.id);
    let cq = f.cq(a.id);
    let qp = f.qp(a.id, pd, cq);
    let busy = IbStatus::ResourceBusy.to_ntstatus();
    assert_eq!(f.call::<DeallocPd>(a.id, pd, &Empty).0, busy);
    assert_eq!(f.call::<DestroyCq>(a.id, cq, &Empty).0, busy);
    assert_eq!(f.call::<DestroyQp>(a.id, qp, &Empty).0, NtStatus::SUCCESS);
    // An AV and an MR keep the PD busy too, and the CQ is free now.
    let av = f.create::<CreateAv>(a.id, pd, &av_attr());
    let mr = f.create::<RegMr>(a.id, pd, &mr_register());
    assert_eq!(f.call::<DestroyCq>(a.id, cq, &Empty).0, NtStatus::SUCCESS);
    assert_eq!(f.call::<DeallocPd>(a.id, pd, &Empty).0, busy);
    assert_eq!(f.call::<DestroyAv>(a.id, av, &Empty).0, NtStatus::SUCCESS);
    assert_eq!(f.call::<DeallocPd>(a.id, pd, &Empty).0, busy);
    assert_eq!(f.call::<DeregMr>(a.id, mr, &Empty).0, NtStatus::SUCCESS);
    assert_eq!(f.call::<DeallocPd>(a.id, pd, &Empty).0, NtStatus::SUCCESS);
    assert_eq!(f.ca.live(), 0);
}

#[test]
fn a_pending_create_keeps_its_parent_busy_and_completes_later() {
    let f = Fixture::new();
    let a = f.open();
    let pd = f.pd(a.id);
    f.ca.hold.store(true, Ordering::SeqCst);
    let av = f.send::<CreateAv>(a.id, pd, &av_attr());
    assert!(
        av.lock().unwrap().is_none(),
        "pending while the CA holds it"
    );
    assert_eq!(
        f.call::<DeallocPd>(a.id, pd, &Empty).0,
        IbStatus::ResourceBusy.to_ntstatus()
    );
    f.ca.release_held();
    let (status, handle, _) = av.lock().unwrap().take().unwrap();
    assert_eq!(status, NtStatus::SUCCESS);
    assert_eq!(
        f.call::<DestroyAv>(a.id, handle, &Empty).0,
        NtStatus::SUCCESS
    );
    assert_eq!(f.call::<DeallocPd>(a.id, pd, &Empty).0, NtStatus::SUCCESS);
}

#[test]
fn ud_sends_name_the_clients_av_and_reach_the_cas() {
    let f = Fixture::new();
    let a = f.open();
    let b = f.open();
    let pd = f.pd(a.id);
    let cq = f.cq(a.id);
    let qp = f.qp(a.id, pd, cq);
    let av = f.create::<CreateAv>(a.id, pd, &av_attr());
    let pd_b = f.pd(b.id);
    let av_b = f.create::<CreateAv>(b.id, pd_b, &av_attr());
    let wr = |av: u64| SendWr {
        wr_id: 42,
        op: SendOp::Send,
        flags: SendFlags::SIGNALED,
        sg_list: &[],
        ud: Some(UdDest {
            av: AvHandle::from_raw(av),
            remote_qpn: Qpn::new(9).unwrap(),
            remote_qkey: QKey::new(0x1111),
        }),
    };
    assert_eq!(f.al.post_send(a.id, qp, &[wr(av)]), (1, IbStatus::Success));
    let sends = f.ca.sends.lock().unwrap().clone();
    assert_eq!(sends.len(), 1);
    let (ca_qp, wr_id, ca_av) = sends[0];
    assert_eq!(wr_id, 42);
    assert_eq!(f.ca.objects.lock().unwrap()[&ca_qp].kind, ObjectKind::Qp);
    assert_eq!(
        f.ca.objects.lock().unwrap()[&ca_av.unwrap()].kind,
        ObjectKind::Av
    );
    // Another client's AV, or QP, is refused.
    assert_eq!(
        f.al.post_send(a.id, qp, &[wr(av_b)]),
        (0, IbStatus::InvalidAvHandle)
    );
    assert_eq!(
        f.al.post_send(b.id, qp, &[wr(av_b)]),
        (0, IbStatus::InvalidQpHandle)
    );
    assert_eq!(
        f.al.post_recv(b.id, qp, &[]),
        (0, IbStatus::InvalidQpHandle)
    );
}

#[test]
fn events_reach_only_the_owner_with_its_handle() {
    let f = Fixture::new();
    let a = f.open();
    let b = f.open();
    let pd = f.pd(a.id);
    let cq = f.cq(a.id);
    let qp = f.qp(a.id, pd, cq);
    let _cq_b = f.cq(b.id);
    // The CA's handles, as the CA's callbacks name them.
    let objects = f.ca.objects.lock().unwrap().clone();
    let ca_of = |kind| *objects.iter().find(|(_, o)| o.kind == kind).unwrap().0;
    let ca_qp = ca_of(ObjectKind::Qp);
    // A's CQ is the first CQ the CA created.
    let ca_cq = *objects
        .iter()
        .filter(|(_, o)| o.kind == ObjectKind::Cq)
        .map(|(h, _)| h)
        .min()
        .unwrap();
    f.al.completion(CqHandle::from_raw(ca_cq));
    f.al.async_event(&AsyncEventRecord::new(AsyncEventCode::QpFatal, ca_qp, None, 0).unwrap());
    assert_eq!(*a.events.completions.lock().unwrap(), vec![cq]);
    assert_eq!(a.events.events.lock().unwrap()[0].handle, qp);
    assert!(b.events.completions.lock().unwrap().is_empty());
    assert!(b.events.events.lock().unwrap().is_empty());
    // A port event reaches everyone.
    let port_down = AsyncEventRecord::new(
        AsyncEventCode::PortDown,
        0,
        Some(PortNum::new(1).unwrap()),
        0,
    )
    .unwrap();
    f.al.async_event(&port_down);
    assert_eq!(a.events.events.lock().unwrap().len(), 2);
    assert_eq!(*b.events.events.lock().unwrap(), vec![port_down]);
    // An unknown CA handle reaches nobody.
    f.al.completion(CqHandle::from_raw(0xDEAD));
    assert_eq!(a.events.completions.lock().unwrap().len(), 1);
}

#[test]
fn close_waits_for_a_callback_in_flight_and_then_releases_the_reference() {
    let f = Fixture::new();
    let a = f.open();
    let cq = f.cq(a.id);
    let ca_cq = *f.ca.objects.lock().unwrap().keys().next().unwrap();
    // Busy while it owns objects.
    let drained: Arc<dyn Event> = Arc::new(TestEvent::default());
    let passive = AtIrql(Irql::PASSIVE);
    assert_eq!(
        f.al.close(a.id, &passive, drained.clone()),
        Err(IbStatus::ResourceBusy)
    );
    assert_eq!(f.call::<DestroyCq>(a.id, cq, &Empty).0, NtStatus::SUCCESS);
    // Re-create, then hold a completion callback in flight.
    let cq = f.cq(a.id);
    let ca_cq_2 = *f
        .ca
        .objects
        .lock()
        .unwrap()
        .keys()
        .find(|h| **h != ca_cq)
        .unwrap();
    *a.events.gate.lock().unwrap() = true;
    let al = f.al.clone();
    let callback = thread::spawn(move || al.completion(CqHandle::from_raw(ca_cq_2)));
    while !a.events.entered.load(Ordering::SeqCst) {
        thread::yield_now();
    }
    assert_eq!(f.call::<DestroyCq>(a.id, cq, &Empty).0, NtStatus::SUCCESS);
    // Not at DISPATCH_LEVEL: nothing changes.
    assert_eq!(
        f.al.close(a.id, &AtIrql(Irql::DISPATCH), drained.clone()),
        Err(IbStatus::InvalidState)
    );
    let al = f.al.clone();
    let id = a.id;
    let closed = Arc::new(AtomicBool::new(false));
    let closer = {
        let closed = closed.clone();
        let drained = drained.clone();
        thread::spawn(move || {
            al.close(id, &AtIrql(Irql::PASSIVE), drained).unwrap();
            closed.store(true, Ordering::SeqCst);
        })
    };
    thread::sleep(Duration::from_millis(50));
    assert!(
        !closed.load(Ordering::SeqCst),
        "close returned with a callback in flight"
    );
    assert!(
        !a.released.load(Ordering::SeqCst),
        "reference released too early"
    );
    *a.events.gate.lock().unwrap() = false;
    a.events.gate_changed.notify_all();
    callback.join().unwrap();
    closer.join().unwrap();
    assert!(a.released.load(Ordering::SeqCst));
    assert_eq!(a.events.completions.lock().unwrap().len(), 1);
    // Gone: its requests and events are refused or dropped.
    assert_eq!(f.al.ca_handle(a.id), None);
    assert_eq!(
        f.call::<AllocPd>(a.id, 1, &Empty).0,
        IbStatus::InvalidAlHandle.to_ntstatus()
    );
}

fn raw_request(ioctl: u32, input: Vec<u8>, output_len: usize) -> (ClientRequest, Outcome) {
    let outcome = Outcome::default();
    let request = ClientRequest {
        ioctl,
        input,
        output: vec![0; output_len],
        outcome: outcome.clone(),
    };
    (request, outcome)
}

#[test]
fn malformed_requests_are_refused_with_a_clear_status() {
    let f = Fixture::new();
    let a = f.open();
    let ca = f.al.ca_handle(a.id).unwrap();
    let mut good = vec![0; request_len::<AllocPd>(0).unwrap()];
    encode_request::<AllocPd>(ca, &Empty, &[], 0, &mut good).unwrap();
    let out_len = response_len::<AllocPd>(0).unwrap();
    let code = AllocPd::ID.ioctl().raw();
    let invalid = IbStatus::InvalidParameter.to_ntstatus();
    let cases: Vec<(&str, u32, Vec<u8>, usize, NtStatus)> = vec![
        ("unknown code", 0x1234_5678, good.clone(), out_len, invalid),
        ("short input", code, good[..8].to_vec(), out_len, invalid),
        (
            "trailing bytes",
            code,
            [good.clone(), vec![0]].concat(),
            out_len,
            invalid,
        ),
        ("output too small", code, good.clone(), out_len - 1, invalid),
        (
            "private length lies",
            code,
            {
                let mut bytes = good.clone();
                bytes[8] = 4;
                bytes
            },
            out_len,
            invalid,
        ),
        (
            "private_out_max beyond the output",
            code,
            {
                let mut bytes = good.clone();
                bytes[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
                bytes
            },
            out_len,
            invalid,
        ),
        (
            "CA verb the AL owns",
            VerbId::CloseCa.ioctl().raw(),
            good.clone(),
            out_len,
            IbStatus::Unsupported.to_ntstatus(),
        ),
        (
            "forged handle",
            code,
            {
                let mut bytes = good.clone();
                bytes[..8].copy_from_slice(&(ca ^ 0x0001_0000_0000).to_le_bytes());
                bytes
            },
            out_len,
            IbStatus::InvalidCaHandle.to_ntstatus(),
        ),
    ];
    for (what, ioctl, input, output_len, expected) in cases {
        let (request, outcome) = raw_request(ioctl, input, output_len);
        let returned = f.al.submit(a.id, request);
        let (status, information, _) = outcome.lock().unwrap().take().expect(what);
        assert_eq!((status, information), (expected, 0), "{what}");
        assert_eq!(returned, expected, "{what}");
    }
    assert_eq!(f.ca.live(), 0, "nothing reached the CA");
    // And the good one still works.
    let (request, outcome) = raw_request(code, good, out_len);
    assert_eq!(f.al.submit(a.id, request), NtStatus::PENDING);
    assert_eq!(outcome.lock().unwrap().take().unwrap().0, NtStatus::SUCCESS);
    assert_eq!(f.ca.live(), 1);
}

#[test]
fn a_failure_at_the_ca_reaches_the_client_and_undoes_the_bookkeeping() {
    let f = Fixture::new();
    let a = f.open();
    let pd = f.pd(a.id);
    // A create the CA refuses: its status, no handle, the PD not left busy.
    *f.ca.fail_next.lock().unwrap() = Some(IbStatus::InsufficientResources);
    let (status, information, output) = f.call::<CreateAv>(a.id, pd, &av_attr());
    assert_eq!(status, IbStatus::InsufficientResources.to_ntstatus());
    assert_eq!(
        information as usize,
        output.len(),
        "a non-create reports the response length"
    );
    assert_eq!(decode_response::<CreateAv>(&output).unwrap().handle, 0);
    // A destroy the CA refuses: the object stays usable and destroyable.
    *f.ca.fail_next.lock().unwrap() = Some(IbStatus::InvalidState);
    assert_eq!(
        f.call::<DeallocPd>(a.id, pd, &Empty).0,
        IbStatus::InvalidState.to_ntstatus()
    );
    let av = f.create::<CreateAv>(a.id, pd, &av_attr());
    assert_eq!(f.call::<DestroyAv>(a.id, av, &Empty).0, NtStatus::SUCCESS);
    assert_eq!(f.call::<DeallocPd>(a.id, pd, &Empty).0, NtStatus::SUCCESS);
    assert_eq!(f.ca.live(), 0);
}

#[test]
fn a_create_answered_without_a_handle_fails_cleanly() {
    let f = Fixture::new();
    let a = f.open();
    let pd = f.pd(a.id);
    f.ca.drop_next_handle.store(true, Ordering::SeqCst);
    let (status, information, output) = f.call::<CreateAv>(a.id, pd, &av_attr());
    assert_eq!(status, IbStatus::GenericError.to_ntstatus());
    assert_eq!(information as usize, output.len());
    assert_eq!(
        decode_response::<CreateAv>(&output).unwrap().status,
        IbStatus::GenericError
    );
    // The PD is not held by the create that failed.
    assert_eq!(f.call::<DeallocPd>(a.id, pd, &Empty).0, NtStatus::SUCCESS);
}

#[test]
fn the_synchronous_helper_waits_at_passive_and_refuses_above() {
    let f = Fixture::new();
    let a = f.open();
    let ca = f.al.ca_handle(a.id).unwrap();
    let mut bytes = vec![0; request_len::<AllocPd>(0).unwrap()];
    encode_request::<AllocPd>(ca, &Empty, &[], 0, &mut bytes).unwrap();
    let done = Arc::new(TestEvent::default());
    let (request, outcome) = raw_request(AllocPd::ID.ioctl().raw(), bytes.clone(), 16);
    let refused =
        f.al.submit_and_wait(&AtIrql(Irql::DISPATCH), a.id, request, &*done);
    assert!(refused.is_err());
    assert!(outcome.lock().unwrap().is_none());
    // At PASSIVE the caller's event is set by its completion (here: the
    // test sets it once the outcome is there, as a completion routine would).
    f.ca.hold.store(true, Ordering::SeqCst);
    let (request, outcome) = raw_request(AllocPd::ID.ioctl().raw(), bytes, 16);
    let ca_dev = f.ca.clone();
    let setter = {
        let done = done.clone();
        let outcome = outcome.clone();
        thread::spawn(move || {
            thread::sleep(Duration::from_millis(20));
            ca_dev.release_held();
            assert!(outcome.lock().unwrap().is_some());
            done.set();
        })
    };
    let status =
        f.al.submit_and_wait(&AtIrql(Irql::PASSIVE), a.id, request, &*done);
    assert!(matches!(status, Ok(NtStatus::PENDING)));
    assert_eq!(outcome.lock().unwrap().take().unwrap().0, NtStatus::SUCCESS);
    setter.join().unwrap();
}
