//! The CI interface as a consumer gets it: `IRP_MN_QUERY_INTERFACE` for
//! `GUID_IB_CI_INTERFACE` sent to the HCA's stack on the simulated host,
//! answered by the miniport's shell with the core's `CiProvider`; version
//! checks, identity and UVP name, open/close with callbacks, control verbs
//! through `submit` (and the same request through the device stack's
//! IOCTL path), the synchronous wrapper in both scheduler modes and its
//! refusal above PASSIVE_LEVEL, and the fast path's refusals. Each test
//! ends with the interface dereferenced, the host shut down and the
//! verifier clean.

mod support;

use std::sync::{Arc, Mutex};

use driver_platform::{Event, Irql, RequestorMode};
use hca_miniport_core::ci::CiProvider;
use hca_miniport_core::init::HcaConfig;
use hca_miniport_core::verbs::{CaClient, CqNotify};
use ib_types::cq::CqAttr;
use ib_types::event::AsyncEventRecord;
use ib_types::handle::{AvHandle, CqHandle};
use ib_types::interface::{
    CI_INTERFACE_VERSION, GUID_IB_AL_INTERFACE, GUID_IB_CI_INTERFACE, InterfaceVersion,
};
use ib_types::ioctl::{AllocPd, CreateCq, DeallocPd, DestroyCq, Empty, Verb};
use ib_types::scalars::{QKey, Qpn};
use ib_types::status::IbStatus;
use ib_types::wc::WorkCompletion;
use ib_types::wr::{SendFlags, SendOp, SendWr, UdDest};
use sim_host::driver::InterfaceRef;
use sim_host::event::HostEvent;
use sim_host::host::{Host, HostConfig};
use sim_host::irql::IrqlTracker;
use sim_host::platform::SimPlatform;
use sim_host::request::{HostRequest, RequestHandle};
use sim_shells::hca_miniport::{MiniportDriver, SERVICE};
use support::{NODE_GUID, World, lock, response};

const KERNEL: RequestorMode = RequestorMode::Kernel;

type Provider = CiProvider<SimPlatform>;

/// Records callbacks with the IRQL they arrived at.
#[derive(Default)]
struct Client {
    completions: Mutex<Vec<(CqHandle, Irql)>>,
    events: Mutex<Vec<AsyncEventRecord>>,
}

impl CaClient for Client {
    fn completion(&self, cq: CqHandle) {
        lock(&self.completions).push((cq, sim_host::irql::current()));
    }
    fn async_event(&self, event: &AsyncEventRecord) {
        lock(&self.events).push(*event);
    }
}

/// Queries the CI interface of HCA 0 at `version`.
fn query(w: &World, version: InterfaceVersion) -> Option<InterfaceRef> {
    let node = w.device_at(0).node();
    w.host
        .pnp()
        .query_interface(node, &GUID_IB_CI_INTERFACE, version.packed())
}

/// A request of verb `V` whose completion also sets `event`.
fn request_setting<V: Verb>(
    w: &World,
    handle: u64,
    input: &V::In,
    event: &HostEvent,
) -> (HostRequest, RequestHandle) {
    let (mut request, issuer) = w.request::<V>(KERNEL, handle, input, 0);
    request.set_completion_event(event.clone());
    (request, issuer)
}

#[test]
fn query_interface_answers_the_provider_by_version_with_identity_and_uvp_name() {
    let w = World::deterministic(61);
    let node = w.device_at(0).node();
    assert_eq!(Provider::VERSION, CI_INTERFACE_VERSION);

    // A newer version asked for (a newer minor, another major) is answered
    // with the closest the provider has not above it, its own: the
    // consumer sees which and decides. An older one than it has gets no
    // interface; neither does a GUID the miniport does not provide.
    let (major, minor) = (CI_INTERFACE_VERSION.major, CI_INTERFACE_VERSION.minor);
    for newer in [
        InterfaceVersion::new(major + 1, 0),
        InterfaceVersion::new(major, minor + 1),
    ] {
        let answered = query(&w, newer).expect("the closest version not above");
        assert_eq!(answered.version(), CI_INTERFACE_VERSION.packed());
        assert!(
            !InterfaceVersion::from_packed(answered.version()).satisfies(newer),
            "a consumer needing {newer:?} sees it cannot use it"
        );
        answered.dereference();
    }
    let older = InterfaceVersion::from_packed(CI_INTERFACE_VERSION.packed() - 1);
    assert!(query(&w, older).is_none());
    assert!(
        w.host
            .pnp()
            .query_interface(node, &GUID_IB_AL_INTERFACE, CI_INTERFACE_VERSION.packed())
            .is_none()
    );
    assert_eq!(w.host.pnp().interface_references(node), 0);

    let interface = query(&w, CI_INTERFACE_VERSION).expect("the CI interface");
    assert_eq!(interface.guid(), GUID_IB_CI_INTERFACE);
    assert_eq!(w.host.pnp().interface_references(node), 1);
    let ci = interface.get::<Arc<Provider>>().expect("a CiProvider");
    assert!(Arc::ptr_eq(ci.hca(), &w.hca()));
    assert_eq!(ci.uvp_name().as_str(), hca_miniport_core::verbs::UVP_NAME);
    let cap = w.hca().report().unwrap().capabilities;
    let id = ci.identity().unwrap();
    assert_eq!(id.ca_guid.get(), NODE_GUID);
    assert_eq!(id.vendor_id, cap.vendor_id.get() & 0xFF_FFFF);
    assert_eq!(
        (id.device_id, id.revision),
        (cap.device_id.get(), cap.revision.get())
    );
    assert_eq!(
        Provider::check_version(InterfaceVersion::new(major + 1, 0)),
        Err(IbStatus::InvalidParameter)
    );

    interface.dereference();
    assert_eq!(w.host.pnp().interface_references(node), 0);
    w.finish();
}

#[test]
fn verbs_through_submit_the_ioctl_path_and_the_synchronous_wrapper() {
    let w = World::deterministic(62);
    let interface = query(&w, CI_INTERFACE_VERSION).unwrap();
    let ci = interface.get::<Arc<Provider>>().unwrap().clone();
    let client = Arc::new(Client::default());
    let ca = ci.open_ca(client.clone()).unwrap();
    assert_eq!(ci.open_ca(client.clone()), Err(IbStatus::ResourceBusy));

    // submit from a DPC: the request completes later with the handle in
    // the response header.
    let (request, issuer) = w.request::<AllocPd>(KERNEL, ca, &Empty, 0);
    let submitter = ci.clone();
    w.in_dpc(move || {
        submitter.submit(request);
    });
    w.settle();
    let pd = response::<AllocPd>(&issuer.completion().unwrap()).handle;
    assert_ne!(pd, 0);

    // The same framing through the device stack (the IOCTL path): the
    // filter above passes it down, the shell hands it to the core.
    let (request, issuer) = w.request::<AllocPd>(KERNEL, ca, &Empty, 0);
    w.host.pnp().send_request(w.device_at(0).node(), request);
    w.settle();
    let second_pd = response::<AllocPd>(&issuer.completion().unwrap()).handle;
    assert!(second_pd != 0 && second_pd != pd);

    // The synchronous wrapper at PASSIVE_LEVEL (the test thread): a CQ
    // create needs a common buffer from the work item and a device
    // command from the DPC; the deterministic wait runs them.
    let attr = CqAttr {
        cqe: 32,
        comp_vector: 0,
    };
    let event = HostEvent::new(w.host.scheduler_handle());
    let (request, issuer) = request_setting::<CreateCq>(&w, ca, &attr, &event);
    assert_eq!(sim_host::irql::current(), Irql::PASSIVE);
    assert!(ci.submit_and_wait(&IrqlTracker, request, &event).is_ok());
    assert!(event.is_set());
    let created = issuer
        .completion()
        .expect("completed before the wait returned");
    let created = response::<CreateCq>(&created);
    assert_eq!(created.status, IbStatus::Success);
    let cq = created.handle;

    // Above PASSIVE_LEVEL the wrapper hands the request back unsubmitted.
    let event = HostEvent::new(w.host.scheduler_handle());
    let (request, issuer) = request_setting::<DestroyCq>(&w, cq, &Empty, &event);
    let refused = Arc::new(Mutex::new(None));
    {
        let (ci, refused, event) = (ci.clone(), refused.clone(), event.clone());
        w.in_dpc(move || {
            let back = ci.submit_and_wait(&IrqlTracker, request, &event);
            *lock(&refused) = Some(back.is_err());
            if let Err(request) = back {
                // Submitted asynchronously instead.
                ci.submit(request);
            }
        });
    }
    w.settle();
    assert_eq!(*lock(&refused), Some(true));
    assert_eq!(
        response::<DestroyCq>(&issuer.completion().unwrap()).status,
        IbStatus::Success
    );

    // Close refuses while PDs live, then succeeds once.
    assert_eq!(ci.close_ca(ca), Err(IbStatus::ResourceBusy));
    for pd in [pd, second_pd] {
        let r = w.call_in_dpc::<DeallocPd>(KERNEL, pd, &Empty, 0);
        assert_eq!(response::<DeallocPd>(&r).status, IbStatus::Success);
    }
    assert_eq!(ci.close_ca(ca), Ok(()));
    assert_eq!(ci.close_ca(ca), Err(IbStatus::InvalidCaHandle));
    interface.dereference();
    w.finish();
}

#[test]
fn the_fast_path_refuses_bad_input_and_changes_nothing() {
    let w = World::deterministic(63);
    let interface = query(&w, CI_INTERFACE_VERSION).unwrap();
    let ci = interface.get::<Arc<Provider>>().unwrap().clone();
    let ca = ci.open_ca(Arc::new(Client::default())).unwrap();
    let attr = CqAttr {
        cqe: 8,
        comp_vector: 0,
    };
    let r = w.call_in_dpc::<CreateCq>(KERNEL, ca, &attr, 0);
    let cq = response::<CreateCq>(&r).handle;

    let outcome = Arc::new(Mutex::new(Vec::new()));
    {
        let (ci, outcome) = (ci.clone(), outcome.clone());
        w.in_dpc(move || {
            let ud = Some(UdDest {
                av: AvHandle::from_raw(0x77),
                remote_qpn: Qpn::new(5).unwrap(),
                remote_qkey: QKey::new(1),
            });
            let wr = SendWr {
                wr_id: 1,
                op: SendOp::Send,
                flags: SendFlags::SIGNALED,
                sg_list: &[],
                ud,
            };
            let inline = SendWr {
                flags: SendFlags::INLINE,
                ud: None,
                ..wr
            };
            let mut log = lock(&outcome);
            // Checked before the QP is looked up: nothing is posted.
            log.push(ci.post_send(0x1234, &[inline]));
            log.push(ci.post_send(0x1234, &[wr]));
            log.push(ci.post_send(0x1234, &[]));
            log.push(ci.post_recv(0x1234, &[]));
            log.push(ci.post_srq_recv(0x1234, &[]));
            let mut wcs = [WorkCompletion::EMPTY; 4];
            log.push(match ci.poll_cq(cq, &mut wcs) {
                Ok(n) => (n, IbStatus::Success),
                Err(status) => (0, status),
            });
            log.push(match ci.poll_cq(cq ^ (1 << 30), &mut wcs) {
                Ok(n) => (n, IbStatus::Success),
                Err(status) => (0, status),
            });
            log.push(match ci.arm_cq(cq, CqNotify::NextCompletion) {
                Ok(()) => (0, IbStatus::Success),
                Err(status) => (0, status),
            });
        });
    }
    w.settle();
    let log = lock(&outcome).clone();
    assert_eq!(log[0], (0, IbStatus::InvalidQpHandle), "no such QP");
    assert_eq!(log[1], (0, IbStatus::InvalidAvHandle), "stale AV refused");
    assert_eq!(log[2], (0, IbStatus::Success), "an empty batch");
    assert_eq!(log[3].0, 0);
    assert_ne!(log[3].1, IbStatus::Success, "no such QP");
    assert_eq!(log[4].0, 0);
    assert_ne!(log[4].1, IbStatus::Success, "no such SRQ");
    assert_eq!(log[5], (0, IbStatus::Success), "an empty CQ polls empty");
    assert_eq!(log[6], (0, IbStatus::InvalidCqHandle), "a stale CQ handle");
    assert_eq!(log[7], (0, IbStatus::Success), "armed");

    let r = w.call_in_dpc::<DestroyCq>(KERNEL, cq, &Empty, 0);
    assert_eq!(response::<DestroyCq>(&r).status, IbStatus::Success);
    assert_eq!(ci.close_ca(ca), Ok(()));
    interface.dereference();
    w.finish();
}

#[test]
fn the_synchronous_wrapper_blocks_in_threaded_mode_until_the_dpc_completes() {
    let host = Host::new(HostConfig::threaded(2, vec![support::two_port_hca()])).unwrap();
    // The host's stand-ins for the filter and the port client; the real
    // miniport replaces the stand-in under its service name.
    let _log = sim_host::samples::register_stand_ins(&host);
    let driver = MiniportDriver::register(&host, HcaConfig::default());
    host.boot();
    host.scheduler().quiesce().unwrap();
    let device = driver.devices()[0].clone();
    assert!(matches!(device.started(), Some(Ok(_))));
    let interface = host
        .pnp()
        .query_interface(
            device.node(),
            &GUID_IB_CI_INTERFACE,
            CI_INTERFACE_VERSION.packed(),
        )
        .unwrap();
    let ci = interface.get::<Arc<Provider>>().unwrap().clone();
    let ca = ci.open_ca(Arc::new(Client::default())).unwrap();

    let mut handles = Vec::new();
    for verb in 0..2 {
        let event = HostEvent::new(host.scheduler_handle());
        let (mut bytes, out_len, code) = if verb == 0 {
            encode::<AllocPd>(ca, &Empty)
        } else {
            let attr = CqAttr {
                cqe: 16,
                comp_vector: 0,
            };
            encode::<CreateCq>(ca, &attr)
        };
        let (mut request, issuer) = HostRequest::new(
            host.verifier(),
            code,
            KERNEL,
            std::mem::take(&mut bytes),
            out_len,
        );
        request.set_completion_event(event.clone());
        assert!(ci.submit_and_wait(&IrqlTracker, request, &event).is_ok());
        let done = issuer
            .completion()
            .expect("the wait returned after completion");
        let handle = if verb == 0 {
            let r = response::<AllocPd>(&done);
            assert_eq!(r.status, IbStatus::Success);
            r.handle
        } else {
            let r = response::<CreateCq>(&done);
            assert_eq!(r.status, IbStatus::Success);
            r.handle
        };
        handles.push(handle);
    }
    // Clean up through the same wrapper.
    for (i, handle) in handles.into_iter().enumerate().rev() {
        let event = HostEvent::new(host.scheduler_handle());
        let (bytes, out_len, code) = if i == 0 {
            encode::<DeallocPd>(handle, &Empty)
        } else {
            encode::<DestroyCq>(handle, &Empty)
        };
        let (mut request, issuer) = HostRequest::new(host.verifier(), code, KERNEL, bytes, out_len);
        request.set_completion_event(event.clone());
        assert!(ci.submit_and_wait(&IrqlTracker, request, &event).is_ok());
        assert!(issuer.completion().unwrap().status.is_success());
    }
    assert_eq!(ci.close_ca(ca), Ok(()));
    interface.dereference();
    host.scheduler().quiesce().unwrap();
    host.shut_down();
    host.scheduler().quiesce().unwrap();
    host.verifier().assert_clean();
    assert_eq!(SERVICE, "hcaminiport");
}

/// A request's bytes, output length and IOCTL code for verb `V`.
fn encode<V: Verb>(handle: u64, input: &V::In) -> (Vec<u8>, usize, u32) {
    use ib_types::ioctl::{encode_request, request_len, response_len};
    let mut bytes = vec![0; request_len::<V>(0).unwrap()];
    encode_request::<V>(handle, input, &[], 0, &mut bytes).unwrap();
    (bytes, response_len::<V>(0).unwrap(), V::ID.ioctl().raw())
}

#[test]
fn a_request_sent_while_asleep_is_held_and_answered_after_wake() {
    use driver_platform::SystemPowerState;
    let w = World::deterministic(64);
    let node = w.device_at(0).node();
    let interface = query(&w, CI_INTERFACE_VERSION).unwrap();
    let ci = interface.get::<Arc<Provider>>().unwrap().clone();
    let ca = ci.open_ca(Arc::new(Client::default())).unwrap();
    let awake = ci.identity().unwrap();

    w.host.pnp().set_system_power(SystemPowerState::S3).unwrap();
    // Below D0 the core keeps its objects but no device: the CI answers,
    // with nothing running behind it; the identity from the saved
    // bring-up report.
    assert_eq!(ci.identity(), Ok(awake));
    let (request, issuer) = w.request::<AllocPd>(KERNEL, ca, &Empty, 0);
    w.host.pnp().send_request(node, request);
    w.settle();
    assert!(
        !issuer.is_done(),
        "the power-managed queue holds it below D0"
    );

    w.host.pnp().set_system_power(SystemPowerState::S0).unwrap();
    w.settle();
    // Restored on D0 entry: the CA opened before sleep survived, so the
    // held request runs on it.
    let done = issuer.completion().expect("delivered after wake");
    let allocated = response::<AllocPd>(&done);
    assert_eq!(allocated.status, IbStatus::Success);
    assert_eq!(ci.identity(), Ok(awake));
    let r = w.call_in_dpc::<DeallocPd>(KERNEL, allocated.handle, &Empty, 0);
    assert_eq!(response::<DeallocPd>(&r).status, IbStatus::Success);
    assert_eq!(ci.close_ca(ca), Ok(()));
    interface.dereference();
    w.finish();
}

/// A kernel client's request goes through `submit`, which sends it into
/// the miniport's own queue (as the KMDF shell's `IoCallDriver`): made
/// while the device sleeps, it is held, not refused, and runs after
/// resume — from a DPC, and a CQ create that needs a common buffer and a
/// device command.
#[test]
fn a_kernel_clients_submit_while_the_device_sleeps_is_held_until_resume() {
    let w = World::deterministic(65);
    let interface = query(&w, CI_INTERFACE_VERSION).unwrap();
    let ci = interface.get::<Arc<Provider>>().unwrap().clone();
    let ca = ci.open_ca(Arc::new(Client::default())).unwrap();

    w.sleep();
    let (pd_request, pd_issuer) = w.request::<AllocPd>(KERNEL, ca, &Empty, 0);
    let attr = CqAttr {
        cqe: 16,
        comp_vector: 0,
    };
    let (cq_request, cq_issuer) = w.request::<CreateCq>(KERNEL, ca, &attr, 0);
    let submitter = ci.clone();
    w.in_dpc(move || {
        submitter.submit(pd_request);
        submitter.submit(cq_request);
    });
    w.settle();
    assert!(!pd_issuer.is_done(), "held by the queue below D0");
    assert!(!cq_issuer.is_done(), "held by the queue below D0");
    w.host.verifier().assert_clean();

    w.resume();
    let pd_done = pd_issuer.completion().expect("ran after resume");
    let pd = response::<AllocPd>(&pd_done);
    assert_eq!(pd.status, IbStatus::Success);
    let cq_done = cq_issuer.completion().expect("ran after resume");
    let cq = response::<CreateCq>(&cq_done);
    assert_eq!(cq.status, IbStatus::Success);
    let r = w.call_in_dpc::<DestroyCq>(KERNEL, cq.handle, &Empty, 0);
    assert_eq!(response::<DestroyCq>(&r).status, IbStatus::Success);
    let r = w.call_in_dpc::<DeallocPd>(KERNEL, pd.handle, &Empty, 0);
    assert_eq!(response::<DeallocPd>(&r).status, IbStatus::Success);
    assert_eq!(ci.close_ca(ca), Ok(()));
    interface.dereference();
    w.finish();
}

/// Control verbs a kernel client submitted and still in flight (their
/// commands on the device) when the system sleeps: they are the
/// miniport's requests in its power-managed queue, so EvtIoStop lets them
/// finish and the power-down waits for them; each succeeds before the
/// device leaves D0.
#[test]
fn kernel_clients_verbs_in_flight_at_d0_exit_finish_before_it() {
    use driver_platform::SystemPowerState;
    let w = World::deterministic(66);
    let interface = query(&w, CI_INTERFACE_VERSION).unwrap();
    let ci = interface.get::<Arc<Provider>>().unwrap().clone();
    let ca = ci.open_ca(Arc::new(Client::default())).unwrap();
    let attr = CqAttr {
        cqe: 16,
        comp_vector: 0,
    };
    let cqs: Vec<_> = (0..3)
        .map(|_| {
            let (request, issuer) = w.request::<CreateCq>(KERNEL, ca, &attr, 0);
            ci.submit(request);
            issuer
        })
        .collect();
    assert!(cqs.iter().any(|c| !c.is_done()), "commands in flight");
    // No settle: the power-down itself waits for them.
    w.host.pnp().set_system_power(SystemPowerState::S3).unwrap();
    w.host.verifier().assert_clean();
    let handles: Vec<u64> = cqs
        .iter()
        .map(|issuer| {
            let done = issuer.completion().expect("finished before D0 exit");
            let created = response::<CreateCq>(&done);
            assert_eq!(created.status, IbStatus::Success);
            created.handle
        })
        .collect();
    w.host.pnp().set_system_power(SystemPowerState::S0).unwrap();
    w.settle();
    for cq in handles {
        let r = w.call_in_dpc::<DestroyCq>(KERNEL, cq, &Empty, 0);
        assert_eq!(response::<DestroyCq>(&r).status, IbStatus::Success);
    }
    assert_eq!(ci.close_ca(ca), Ok(()));
    interface.dereference();
    w.finish();
}

/// The threaded counterpart: a PASSIVE_LEVEL kernel client's synchronous
/// call made while the device sleeps waits in the queue (not refused)
/// until another thread resumes the system, then returns with success.
#[test]
fn a_synchronous_call_while_the_device_sleeps_waits_for_resume_in_threaded_mode() {
    use driver_platform::SystemPowerState;
    let w = World::threaded_with_hcas(2, vec![support::two_port_hca()], HcaConfig::default());
    let interface = query(&w, CI_INTERFACE_VERSION).unwrap();
    let ci = interface.get::<Arc<Provider>>().unwrap().clone();
    let ca = ci.open_ca(Arc::new(Client::default())).unwrap();

    w.host.pnp().set_system_power(SystemPowerState::S3).unwrap();
    assert!(w.hca().is_below_d0());
    let event = HostEvent::new(w.host.scheduler_handle());
    let (request, issuer) = request_setting::<AllocPd>(&w, ca, &Empty, &event);
    let caller = {
        let (ci, event) = (ci.clone(), event.clone());
        std::thread::spawn(move || {
            assert_eq!(sim_host::irql::current(), Irql::PASSIVE);
            ci.submit_and_wait(&IrqlTracker, request, &event).is_ok()
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert!(!issuer.is_done(), "held by the queue while asleep");
    assert!(!caller.is_finished(), "the caller still waits");

    w.host.pnp().set_system_power(SystemPowerState::S0).unwrap();
    assert!(caller.join().unwrap(), "submitted at PASSIVE_LEVEL");
    let done = issuer.completion().expect("completed after resume");
    let pd = response::<AllocPd>(&done);
    assert_eq!(pd.status, IbStatus::Success);
    let r = w.call_in_dpc_waiting_at::<DeallocPd>(0, KERNEL, pd.handle, &Empty, 0);
    assert_eq!(response::<DeallocPd>(&r).status, IbStatus::Success);
    assert_eq!(ci.close_ca(ca), Ok(()));
    interface.dereference();
    w.host.scheduler().quiesce().unwrap();
    w.finish();
}
