//! The miniport's power-managed queue across a sleep (sim-host models
//! KMDF's `EvtIoStop`): a user `GetAsyncEvent` or `WaitCqEvent` pends in
//! the core until an event comes, which may be long after the device left
//! D0. KMDF waits, before D0 exit, for every request the driver owns to be
//! completed or acknowledged, so without `EvtIoStop` such a request would
//! hold the sleep for ever. The shell acknowledges the waits (they keep
//! pending and need no hardware) and lets every other request finish.

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
