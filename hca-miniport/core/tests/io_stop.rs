//! The miniport's power-managed queue across a sleep (sim-host models
//! KMDF's `EvtIoStop`): a user `GetAsyncEvent` or `WaitCqEvent` pends in
//! the core until an event comes, which may be long after the device left
//! D0. KMDF waits, before D0 exit, for every request the driver owns to be
//! completed or acknowledged, so without `EvtIoStop` such a request would
//! hold the sleep for ever. The shell acknowledges the waits (they keep
//! pending and need no hardware) and lets every other request finish.
//! A wait kept this way and still pending when the device is removed is
//! completed by the core's stop as cancelled.

mod power_kit;
mod support;

use driver_platform::RequestorMode;
use ib_types::event::AsyncEventCode;
use ib_types::ioctl::{CloseCa, Empty, GetAsyncEvent, OpenCa, OpenCaIn, Verb};
use ib_types::status::IbStatus;
use power_kit::two_hcas;
use sim_host::memory::Process;
use sim_host::request::{Completion, RequestHandle};
use support::{World, response};

/// Sends `V` down HCA `i`'s stack as a user request of `process`; returns
/// the issuer's handle without waiting for the completion.
fn send_through_stack<V: Verb>(
    w: &World,
    i: usize,
    process: &Process,
    handle: u64,
    input: &V::In,
) -> RequestHandle {
    let mut bytes = vec![0; ib_types::ioctl::request_len::<V>(0).unwrap()];
    ib_types::ioctl::encode_request::<V>(handle, input, &[], 64, &mut bytes).unwrap();
    let (mut request, issuer) = w.raw_request(
        V::ID.ioctl().raw(),
        RequestorMode::User,
        bytes,
        ib_types::ioctl::response_len::<V>(64).unwrap(),
    );
    request.set_process(process.clone());
    w.host.pnp().send_request(w.device_at(i).node(), request);
    issuer
}

fn completed(w: &World, issuer: &RequestHandle) -> Completion {
    w.settle();
    issuer.completion().expect("the request completed")
}

#[test]
fn a_pending_get_async_event_does_not_hold_the_sleep_and_keeps_pending_across_it() {
    let (w, [x, _]) = two_hcas(91, hca_miniport_core::init::HcaConfig::default());
    let process = Process::new(31);
    let open = send_through_stack::<OpenCa>(&w, x, &process, 0, &OpenCaIn::CURRENT);
    let ca = response::<OpenCa>(&completed(&w, &open)).handle;

    let event = send_through_stack::<GetAsyncEvent>(&w, x, &process, ca, &Empty);
    w.settle();
    assert!(!event.is_done(), "nothing happened yet: it pends");

    w.sleep();
    w.host.verifier().assert_clean();
    assert!(!event.is_done(), "kept pending across the power-down");
    w.resume();
    // The ports come up again after D0 entry: the kept wait gets that
    // event, as every open context does.
    let got = event
        .completion()
        .expect("answered by an event after resume");
    let answer = response::<GetAsyncEvent>(&got);
    assert_eq!(answer.status, IbStatus::Success);
    let record = answer.output.expect("an event record");
    assert_eq!(record.code, AsyncEventCode::PortActive, "{record:?}");

    // A second wait, and a second sleep: closing the context ends it.
    let event = send_through_stack::<GetAsyncEvent>(&w, x, &process, ca, &Empty);
    w.settle();
    let queued_before = event.completion();
    w.sleep();
    w.resume();
    let close = send_through_stack::<CloseCa>(&w, x, &process, ca, &Empty);
    assert_eq!(
        response::<CloseCa>(&completed(&w, &close)).status,
        IbStatus::Success
    );
    let ended = event.completion().expect("answered");
    let status = response::<GetAsyncEvent>(&ended).status;
    assert!(
        matches!(status, IbStatus::Success | IbStatus::Canceled),
        "{queued_before:?} {status:?}"
    );
    w.finish();
}

/// Verbs sent down the stack and still in flight (their commands on the
/// device) when the system sleeps, ordinarily or critically: the queue's
/// stop waits for them, so each finishes while the device is still in D0,
/// and succeeds; one sent while asleep is held and runs after the resume.
#[test]
fn verbs_in_flight_through_the_queue_finish_before_the_device_leaves_d0() {
    use driver_platform::SystemPowerState;
    use ib_types::cq::CqAttr;
    use ib_types::ioctl::{AllocPd, CreateCq, DeallocPd, DestroyCq};
    use power_kit::{KERNEL, side};
    use sim_host::power::CriticalSleep;
    const ATTR: CqAttr = CqAttr {
        cqe: 16,
        comp_vector: 0,
    };
    for seed in 200..206 {
        let (w, [x, _]) = two_hcas(seed, hca_miniport_core::init::HcaConfig::default());
        let sx = side(&w, x);
        let node = w.device_at(x).node();
        let send = |req| w.host.pnp().send_request(node, req);
        let cqs: Vec<_> = (0..3)
            .map(|_| {
                let (req, issuer) = w.request::<CreateCq>(KERNEL, sx.ca, &ATTR, 0);
                send(req);
                issuer
            })
            .collect();
        let (req, pd) = w.request::<AllocPd>(KERNEL, sx.ca, &Empty, 0);
        send(req);
        assert!(
            cqs.iter().any(|c| !c.is_done()),
            "seed {seed}: commands still in flight"
        );
        // No settle: the power-down itself must wait for them.
        if seed % 2 == 0 {
            w.host.pnp().set_system_power(SystemPowerState::S3).unwrap();
        } else {
            let vetoes = w
                .host
                .pnp()
                .set_system_power_critical(SystemPowerState::S3, CriticalSleep::Unqueried);
            assert!(vetoes.is_empty());
        }
        w.host.verifier().assert_clean();
        let mut handles = Vec::new();
        for issuer in &cqs {
            let done = issuer
                .completion()
                .unwrap_or_else(|| panic!("seed {seed}: finished before D0 exit"));
            let r = response::<CreateCq>(&done);
            assert_eq!(r.status, IbStatus::Success, "seed {seed}");
            handles.push(r.handle);
        }
        let done = pd.completion().expect("AllocPd finished before D0 exit");
        let pd = response::<AllocPd>(&done);
        assert_eq!(pd.status, IbStatus::Success);

        // Sent while asleep: held by the queue, run after the resume.
        let (req, held) = w.request::<CreateCq>(KERNEL, sx.ca, &ATTR, 0);
        send(req);
        w.settle();
        assert!(!held.is_done(), "held below D0");
        w.resume();
        let done = completed(&w, &held);
        let r = response::<CreateCq>(&done);
        assert_eq!(r.status, IbStatus::Success, "seed {seed}");
        handles.push(r.handle);

        for cq in handles {
            let r = w.call_in_dpc_at::<DestroyCq>(x, KERNEL, cq, &Empty, 0);
            assert_eq!(response::<DestroyCq>(&r).status, IbStatus::Success);
        }
        let r = w.call_in_dpc_at::<DeallocPd>(x, KERNEL, pd.handle, &Empty, 0);
        assert_eq!(response::<DeallocPd>(&r).status, IbStatus::Success);
        w.finish();
    }
}

/// The same on a threaded host: the power-down waits (in real time) for
/// verbs the workers are still completing.
#[test]
fn on_a_threaded_host_the_sleep_waits_for_verbs_in_flight() {
    use driver_platform::SystemPowerState;
    use ib_types::cq::CqAttr;
    use ib_types::ioctl::{AllocPd, CreateCq, DeallocPd, DestroyCq};
    use power_kit::KERNEL;
    let w = World::threaded_with_hcas(
        2,
        vec![support::two_port_hca()],
        hca_miniport_core::init::HcaConfig::default(),
    );
    let ca = w.hca().open_ca(None).unwrap();
    let r = w.call_in_dpc_waiting_at::<AllocPd>(0, KERNEL, ca, &Empty, 0);
    let pd = response::<AllocPd>(&r).handle;
    let node = w.device_at(0).node();
    let attr = CqAttr {
        cqe: 16,
        comp_vector: 0,
    };
    let cqs: Vec<_> = (0..4)
        .map(|_| {
            let (req, issuer) = w.request::<CreateCq>(KERNEL, ca, &attr, 0);
            w.host.pnp().send_request(node, req);
            issuer
        })
        .collect();
    w.host.pnp().set_system_power(SystemPowerState::S3).unwrap();
    w.host.verifier().assert_clean();
    let handles: Vec<u64> = cqs
        .iter()
        .map(|issuer| {
            let done = issuer.completion().expect("finished before D0 exit");
            let r = response::<CreateCq>(&done);
            assert_eq!(r.status, IbStatus::Success);
            r.handle
        })
        .collect();
    w.host.pnp().set_system_power(SystemPowerState::S0).unwrap();
    for cq in handles {
        let r = w.call_in_dpc_waiting_at::<DestroyCq>(0, KERNEL, cq, &Empty, 0);
        assert_eq!(response::<DestroyCq>(&r).status, IbStatus::Success);
    }
    let r = w.call_in_dpc_waiting_at::<DeallocPd>(0, KERNEL, pd, &Empty, 0);
    assert_eq!(response::<DeallocPd>(&r).status, IbStatus::Success);
    w.finish();
}

/// A user `GetAsyncEvent` the core holds when the device is removed
/// (orderly: query-remove then remove; or surprise removal) is completed
/// by the core's stop at release-hardware as Windows drivers complete the
/// requests they hold at removal: cancelled (`IbStatus::Canceled`,
/// `STATUS_CANCELLED`), not as a generic failure.
#[test]
fn a_wait_pending_at_device_removal_ends_cancelled() {
    use ib_types::status::NtStatus;
    for surprise in [false, true] {
        let (w, [x, _]) = two_hcas(93, hca_miniport_core::init::HcaConfig::default());
        let process = Process::new(33);
        let open = send_through_stack::<OpenCa>(&w, x, &process, 0, &OpenCaIn::CURRENT);
        let ca = response::<OpenCa>(&completed(&w, &open)).handle;
        // The ports' first events are taken, so the next wait pends.
        let mut event = send_through_stack::<GetAsyncEvent>(&w, x, &process, ca, &Empty);
        w.settle();
        while event.is_done() {
            event = send_through_stack::<GetAsyncEvent>(&w, x, &process, ca, &Empty);
            w.settle();
        }

        let node = w.device_at(x).node();
        if surprise {
            w.host.pnp().surprise_remove(node);
        } else {
            w.host.pnp().query_and_remove(node).expect("nothing vetoes");
        }
        let ended = completed(&w, &event);
        assert_eq!(ended.status, NtStatus::CANCELLED, "surprise: {surprise}");
        assert_eq!(
            response::<GetAsyncEvent>(&ended).status,
            IbStatus::Canceled,
            "surprise: {surprise}"
        );
        w.finish();
    }
}
