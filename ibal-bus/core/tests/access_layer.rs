//! The access layer over a mock CA that keeps real object tables (creates
//! hand out fresh handles, destroys free them, unknown handles and
//! dependents are refused as a CA does): two clients, handle isolation,
//! busy on dependents, close with a callback in flight, events to the
//! owner only, malformed requests refused with a clear status.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::Duration;

use driver_platform::{Event, Irql};
use ib_types::cq::{CqAttr, CqNotify};
use ib_types::event::{AsyncEventCode, AsyncEventRecord};
use ib_types::handle::{AvHandle, CqHandle};
use ib_types::ioctl::{
    AllocPd, CreateAv, CreateCq, CreateQp, DeallocPd, DeregMr, DestroyAv, DestroyCq, DestroyQp,
    Empty, ObjectKind, RegMr, Verb, VerbId, decode_response, encode_request, request_len,
    response_len,
};
use ib_types::scalars::{PortNum, QKey, Qpn};
use ib_types::status::{IbStatus, NtStatus};
use ib_types::wr::{SendFlags, SendOp, SendWr, UdDest};
use ibal_bus_core::ci::CaEvents;

mod al_support;
use al_support::*;

#[test]
fn creates_map_client_handles_to_fresh_ca_handles_and_destroys_free_them() {
    let f = Fixture::new();
    let a = f.open();
    let (pd, cq, qp) = f.pd_cq_qp(a.id);
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
/// child's queue) is attributed by the handle it names: every handle a
/// client was given carries that client's tag and no other's (the AL then
/// checks the handle itself against that client's table).
#[test]
fn a_clients_handles_carry_its_tag_and_no_other_clients() {
    let f = Fixture::new();
    let a = f.open();
    let b = f.open();
    let pd_a = f.pd(a.id);
    let ca_a = f.al.ca_handle(a.id).unwrap();
    let ca_b = f.al.ca_handle(b.id).unwrap();
    for handle in [pd_a, ca_a] {
        assert!(a.id.owns(handle) && !b.id.owns(handle));
    }
    assert!(b.id.owns(ca_b) && !a.id.owns(ca_b));
    for made_up in [0, u64::MAX] {
        assert!(!a.id.owns(made_up) && !b.id.owns(made_up));
    }
}

#[test]
fn destroying_an_object_others_depend_on_is_busy() {
    let f = Fixture::new();
    let a = f.open();
    let (pd, cq, qp) = f.pd_cq_qp(a.id);
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
    let (pd, _, qp) = f.pd_cq_qp(a.id);
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
    let (_, cq, qp) = f.pd_cq_qp(a.id);
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
    let drained: Arc<dyn Event> = Arc::new(TestEvent::default());
    // Hold a completion callback in flight.
    let cq = f.cq(a.id);
    let ca_cq_2 = *f.ca.objects.lock().unwrap().keys().next().unwrap();
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
