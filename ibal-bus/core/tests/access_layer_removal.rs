//! The access layer when its CA goes away (surprise removal or the device
//! leaving): every open client is told; new requests complete at once with
//! STATUS_DEVICE_REMOVED and direct calls are refused, nothing reaching the
//! CA; requests already at the CA complete exactly once with the CA's
//! answer; clients still close, their records freed without a destroy
//! sent to the removed CA.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread;

use driver_platform::{Event, Irql};
use ib_types::cq::CqNotify;
use ib_types::ioctl::{AllocPd, CreateAv, DestroyQp, Empty, ObjectKind};
use ib_types::status::{IbStatus, NtStatus};

mod al_support;
use al_support::*;

fn close(f: &Fixture, client: &OpenClient) -> Result<(), IbStatus> {
    let drained: Arc<dyn Event> = Arc::new(TestEvent::default());
    f.al.close(client.id, &AtIrql(Irql::PASSIVE), drained)
}

/// Waits (boundedly) until the mock CA holds `count` requests.
fn until_held(f: &Fixture, count: usize) {
    wait_until("the CA never got the request", || {
        f.ca.held.lock().unwrap().len() >= count
    });
}

#[test]
fn after_removal_new_requests_end_at_once_and_those_at_the_ca_complete_once() {
    let f = Fixture::new();
    let a = f.open();
    let b = f.open();
    let (pd, cq, qp) = f.pd_cq_qp(a.id);
    let ca_a = f.al.ca_handle(a.id).unwrap();
    // A create and a destroy already at the CA when it goes.
    f.ca.hold.store(true, Ordering::SeqCst);
    let av = f.send::<CreateAv>(a.id, pd, &av_attr());
    let destroy_qp = f.send::<DestroyQp>(a.id, qp, &Empty);
    until_held(&f, 2);

    f.al.ca_removed();
    f.al.ca_removed();

    // Every open client is told, once.
    assert_eq!(a.events.removals.load(Ordering::SeqCst), 1);
    assert_eq!(b.events.removals.load(Ordering::SeqCst), 1);
    // New requests end at once, nothing sent.
    let removed = NtStatus::DEVICE_REMOVED;
    assert_eq!(IbStatus::DeviceRemoved.to_ntstatus(), removed);
    let (status, information, _) = f.call::<AllocPd>(a.id, ca_a, &Empty);
    assert_eq!((status, information), (removed, 0));
    let ca_b = f.al.ca_handle(b.id).unwrap();
    assert_eq!(f.call::<AllocPd>(b.id, ca_b, &Empty).0, removed);
    assert_eq!(
        f.ca.held.lock().unwrap().len(),
        2,
        "nothing new reached the CA"
    );
    // Direct calls are refused.
    assert_eq!(f.al.post_recv(a.id, qp, &[]), (0, IbStatus::DeviceRemoved));
    assert_eq!(
        f.al.arm_cq(a.id, cq, CqNotify::NextCompletion),
        Err(IbStatus::DeviceRemoved)
    );
    assert_eq!(
        f.al.poll_cq(a.id, cq, &mut []),
        Err(IbStatus::DeviceRemoved)
    );
    assert!(f.ca.armed.lock().unwrap().is_empty());
    assert!(av.lock().unwrap().is_none() && destroy_qp.lock().unwrap().is_none());

    // The CA answers what it had (here: as it would have anyway); each
    // request completes once (the client request panics on a second).
    f.ca.release_held();
    let (status, av_handle, _) = av.lock().unwrap().take().expect("create completed");
    assert_eq!(status, NtStatus::SUCCESS);
    assert_ne!(av_handle, 0);
    assert_eq!(
        destroy_qp
            .lock()
            .unwrap()
            .take()
            .expect("destroy completed")
            .0,
        NtStatus::SUCCESS
    );

    // Both close; no destroy goes to the removed CA, the records are
    // freed locally, nothing is orphaned.
    let destroyed_before = f.ca.destroyed.lock().unwrap().len();
    let live_before = f.ca.live();
    assert_eq!(close(&f, &a), Ok(()));
    assert_eq!(close(&f, &b), Ok(()));
    assert_eq!(f.ca.destroyed.lock().unwrap().len(), destroyed_before);
    assert_eq!(f.ca.live(), live_before);
    assert!(f.al.orphans().is_empty());
    assert!(a.released.load(Ordering::SeqCst) && b.released.load(Ordering::SeqCst));
    // A client opened after the removal is told nothing more and is
    // refused the same way.
    let c = f.open();
    let ca_c = f.al.ca_handle(c.id).unwrap();
    assert_eq!(f.call::<AllocPd>(c.id, ca_c, &Empty).0, removed);
}

#[test]
fn a_removal_during_close_stops_the_destroys_and_frees_the_rest_locally() {
    let f = Fixture::new();
    let a = f.open();
    f.pd_cq_qp(a.id);
    let ca_qp = f.ca.handles_of(ObjectKind::Qp)[0];
    // The QP's destroy is held at the CA and will be refused: after a
    // removal that is no orphan (the CA's objects went with it).
    f.ca.refuse_destroy.lock().unwrap().insert(ca_qp);
    f.ca.hold.store(true, Ordering::SeqCst);
    let closer = {
        let al = f.al.clone();
        let id = a.id;
        thread::spawn(move || {
            let drained: Arc<dyn Event> = Arc::new(TestEvent::default());
            al.close(id, &AtIrql(Irql::PASSIVE), drained)
        })
    };
    until_held(&f, 1);
    f.al.ca_removed();
    // A closing client is not told: it is going anyway.
    assert_eq!(a.events.removals.load(Ordering::SeqCst), 0);
    f.ca.release_held();
    assert_eq!(closer.join().unwrap(), Ok(()));
    // Only the QP's destroy was ever sent; the CQ and PD were freed here.
    assert!(f.ca.destroyed.lock().unwrap().is_empty());
    assert_eq!(f.ca.held.lock().unwrap().len(), 0);
    assert!(f.al.orphans().is_empty());
    assert!(a.released.load(Ordering::SeqCst));
}

#[test]
fn orphans_of_a_removed_ca_are_released() {
    let f = Fixture::new();
    let a = f.open();
    let _pd = f.pd(a.id);
    let ca_pd = f.ca.handles_of(ObjectKind::Pd)[0];
    f.ca.refuse_destroy.lock().unwrap().insert(ca_pd);
    assert_eq!(close(&f, &a), Ok(()));
    assert_eq!(f.al.orphans().len(), 1);
    f.al.ca_removed();
    assert!(f.al.orphans().is_empty());
}

#[test]
fn a_removal_racing_a_client_ends_every_request_once_and_sends_nothing_after_it() {
    let f = Arc::new(Fixture::new());
    let a = f.open();
    let ca = f.al.ca_handle(a.id).unwrap();
    // What reaches the CA before the removal is held there (a CA that
    // answers late), so it is in flight when the removal comes.
    f.ca.hold.store(true, Ordering::SeqCst);
    let issued = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let client = {
        let f = f.clone();
        let issued = issued.clone();
        let id = a.id;
        thread::spawn(move || {
            (0..200)
                .map(|_| {
                    let outcome = f.send::<AllocPd>(id, ca, &Empty);
                    issued.fetch_add(1, Ordering::SeqCst);
                    thread::yield_now();
                    outcome
                })
                .collect::<Vec<_>>()
        })
    };
    wait_until("the client stalled", || issued.load(Ordering::SeqCst) >= 20);
    // Every request issued before the removal reached the CA; of those
    // issued after it, only the one in the middle of its submit at the
    // removal may have.
    let issued_before = issued.load(Ordering::SeqCst);
    f.al.ca_removed();
    let issued_after = issued.load(Ordering::SeqCst);
    let outcomes = client.join().unwrap();
    let sent = f.ca.held.lock().unwrap().len();
    assert!(
        (issued_before..=issued_after + 1).contains(&sent),
        "{sent} sent; {issued_before} issued before the removal, {issued_after} after it"
    );
    f.ca.release_held();

    // Each request ended once: those at the CA with its answer, all later
    // ones at once with the device-removed status, in that order.
    let ends: Vec<(NtStatus, u64)> = outcomes
        .iter()
        .map(|o| {
            let (status, information, _) = o.lock().unwrap().take().expect("completed");
            (status, information)
        })
        .collect();
    let answered = ends
        .iter()
        .take_while(|(status, _)| *status == NtStatus::SUCCESS)
        .count();
    assert_eq!(answered, sent);
    assert!(
        ends[answered..]
            .iter()
            .all(|end| *end == (NtStatus::DEVICE_REMOVED, 0))
    );
    assert_eq!(f.ca.live(), sent);
    assert_eq!(close(&f, &a), Ok(()));
    assert_eq!(f.ca.live(), sent, "no destroy sent to the removed CA");
}

#[test]
fn a_request_at_the_ca_that_fails_after_the_removal_ends_with_device_removed() {
    let f = Fixture::new();
    let a = f.open();
    let (pd, _, qp) = f.pd_cq_qp(a.id);
    let ca_qp = f.ca.handles_of(ObjectKind::Qp)[0];
    // Two requests at the CA when it goes: one it fails (the gone device
    // did not answer it: here a refused destroy), one it answers.
    f.ca.refuse_destroy.lock().unwrap().insert(ca_qp);
    f.ca.hold.store(true, Ordering::SeqCst);
    let failing = f.send::<DestroyQp>(a.id, qp, &Empty);
    let answered = f.send::<CreateAv>(a.id, pd, &av_attr());
    until_held(&f, 2);
    f.al.ca_removed();
    f.ca.release_held();
    // The failure is the removal's: one clear status, in the completion
    // and in the response header; the success stands.
    let (status, _, output) = failing.lock().unwrap().take().expect("completed");
    assert_eq!(status, NtStatus::DEVICE_REMOVED);
    assert_eq!(
        u32::from_le_bytes(output[..4].try_into().unwrap()),
        IbStatus::DeviceRemoved.code()
    );
    let (status, av, _) = answered.lock().unwrap().take().expect("completed");
    assert_eq!(status, NtStatus::SUCCESS);
    assert_ne!(av, 0);
    assert_eq!(close(&f, &a), Ok(()));
}

#[test]
fn a_close_after_the_removal_ends_requests_at_the_gone_ca_instead_of_waiting() {
    let f = Arc::new(Fixture::new());
    let a = f.open();
    let ca = f.al.ca_handle(a.id).unwrap();
    // A CA that never answers (a vanished device): the request stays.
    f.ca.hold.store(true, Ordering::SeqCst);
    let stuck = f.send::<AllocPd>(a.id, ca, &Empty);
    until_held(&f, 1);
    f.al.ca_removed();
    let closer = {
        let (f, id) = (f.clone(), a.id);
        thread::spawn(move || {
            let drained: Arc<dyn Event> = Arc::new(TestEvent::default());
            f.al.close(id, &AtIrql(Irql::PASSIVE), drained)
        })
    };
    wait_until("close waits for the gone CA to answer", || {
        closer.is_finished()
    });
    assert_eq!(closer.join().unwrap(), Ok(()));
    let (status, information, _) = stuck.lock().unwrap().take().expect("ended by the close");
    assert_eq!((status, information), (NtStatus::DEVICE_REMOVED, 0));
    assert!(a.released.load(Ordering::SeqCst));
    // The CA's late answer ends nothing more (a second completion of the
    // client's request would panic) and touches no freed record.
    f.ca.release_held();
    assert!(stuck.lock().unwrap().is_none());
}
