//! Requests while the HCA is below D0: the miniport's power-managed queue
//! holds them and runs them after D0 entry. The access layer neither times
//! them out nor fails them: a client that keeps issuing requests through a
//! sleep and the resume gets every completion, once, with the CA's answer.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::Duration;

use ib_types::cq::CqAttr;
use ib_types::ioctl::{AllocPd, CreateAv, CreateCq, DeallocPd, Empty};
use ib_types::status::NtStatus;
use ibal_bus_core::al::ClientId;

mod al_support;
use al_support::*;

/// The `n`th request of a client that keeps working: PDs, CQs and AVs on
/// `pd`, in turn. Returns the outcome to watch.
fn issue(f: &Fixture, client: ClientId, ca: u64, pd: u64, n: usize) -> Outcome {
    match n % 3 {
        0 => f.send::<AllocPd>(client, ca, &Empty),
        1 => f.send::<CreateCq>(
            client,
            ca,
            &CqAttr {
                cqe: 16,
                comp_vector: 0,
            },
        ),
        _ => f.send::<CreateAv>(client, pd, &av_attr()),
    }
}

#[test]
fn requests_held_below_d0_all_complete_after_resume_while_the_client_keeps_issuing() {
    let f = Arc::new(Fixture::new());
    let a = f.open();
    let ca = f.al.ca_handle(a.id).unwrap();
    let pd = f.pd(a.id);
    let spare = f.pd(a.id);

    // The HCA goes below D0: its queue holds every request.
    f.ca.hold.store(true, Ordering::SeqCst);
    let mut outcomes: Vec<Outcome> = (0..30).map(|n| issue(&f, a.id, ca, pd, n)).collect();
    let dealloc = f.send::<DeallocPd>(a.id, spare, &Empty);
    // Long past any timeout a layer might invent: still pending, not
    // failed.
    thread::sleep(Duration::from_millis(100));
    assert!(outcomes.iter().all(|o| o.lock().unwrap().is_none()));
    assert!(dealloc.lock().unwrap().is_none());
    assert_eq!(f.ca.held.lock().unwrap().len(), 31);

    // The client keeps issuing while the HCA resumes under it.
    let issued = Arc::new(AtomicUsize::new(0));
    let client = {
        let f = f.clone();
        let issued = issued.clone();
        let id = a.id;
        thread::spawn(move || {
            (30..130)
                .map(|n| {
                    let outcome = issue(&f, id, ca, pd, n);
                    issued.fetch_add(1, Ordering::SeqCst);
                    thread::yield_now();
                    outcome
                })
                .collect::<Vec<_>>()
        })
    };
    wait_until("the client stalled", || issued.load(Ordering::SeqCst) >= 40);
    f.ca.release_held();
    outcomes.extend(client.join().expect("no completion came twice"));

    // Every request completed, successfully, with its own new handle.
    let mut handles = HashSet::new();
    for (n, outcome) in outcomes.iter().enumerate() {
        let (status, handle, _) = outcome
            .lock()
            .unwrap()
            .take()
            .unwrap_or_else(|| panic!("request {n} never completed"));
        assert_eq!(status, NtStatus::SUCCESS, "request {n}");
        assert!(
            handle != 0 && handles.insert(handle),
            "request {n}: {handle:#x}"
        );
    }
    assert_eq!(handles.len(), 130);
    assert_eq!(dealloc.lock().unwrap().take().unwrap().0, NtStatus::SUCCESS);
    // The CA has exactly what the client was told it has.
    assert_eq!(f.ca.live(), 1 + 130);
    assert!(f.ca.held.lock().unwrap().is_empty());
}
