//! Closing a client of the access layer that left objects open (process
//! death, a client that unloads without cleaning up): its objects are
//! destroyed through the CA in dependency order, its requests in flight
//! are waited for (a create that completes meanwhile is destroyed too), and
//! a destroy the CA refuses leaves the record with the AL as an orphan.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::Duration;

use driver_platform::{Event, Irql};
use ib_types::cq::CqNotify;
use ib_types::ioctl::{
    AllocPd, CreateAv, DeallocPd, DeregMr, DestroyAv, DestroyCq, DestroyQp, Empty, ObjectKind,
    RegMr,
};
use ib_types::status::{IbStatus, NtStatus};
use ibal_bus_core::al::{ClientId, Orphan};
use proptest::prelude::*;

mod al_support;
use al_support::*;

fn close(f: &Fixture, client: &OpenClient) -> Result<(), IbStatus> {
    let drained: Arc<dyn Event> = Arc::new(TestEvent::default());
    f.al.close(client.id, &AtIrql(Irql::PASSIVE), drained)
}

#[test]
fn close_destroys_what_the_client_left_open_in_dependency_order() {
    let f = Fixture::new();
    let a = f.open();
    let b = f.open();
    let (pd, _, _qp) = f.pd_cq_qp(a.id);
    let _av = f.create::<CreateAv>(a.id, pd, &av_attr());
    let _mr = f.create::<RegMr>(a.id, pd, &mr_register());
    let _lone_pd = f.pd(a.id);
    let pd_b = f.pd(b.id);
    assert_eq!(f.ca.live(), 7);

    assert_eq!(close(&f, &a), Ok(()));

    // Only B's PD is left at the CA; A's went QPs first, then AVs and MRs,
    // then CQs, then PDs (the mock refuses a parent with dependents, so
    // any other order would have left objects behind).
    assert_eq!(f.ca.live(), 1);
    let order = f.ca.destroyed.lock().unwrap().clone();
    assert_eq!(order.len(), 6);
    assert_eq!(order[0], ObjectKind::Qp);
    let mut middle = order[1..3].to_vec();
    middle.sort_by_key(|kind| *kind as u8);
    let mut expected = vec![ObjectKind::Av, ObjectKind::Mr];
    expected.sort_by_key(|kind| *kind as u8);
    assert_eq!(middle, expected);
    assert_eq!(order[3], ObjectKind::Cq);
    assert_eq!(&order[4..], &[ObjectKind::Pd, ObjectKind::Pd]);
    assert!(f.al.orphans().is_empty());
    assert!(a.released.load(Ordering::SeqCst));
    assert_eq!(f.al.ca_handle(a.id), None);
    // B is untouched and still served.
    assert!(!b.released.load(Ordering::SeqCst));
    assert_eq!(f.call::<DeallocPd>(b.id, pd_b, &Empty).0, NtStatus::SUCCESS);
    assert_eq!(f.ca.live(), 0);
}

#[test]
fn close_waits_for_requests_in_flight_and_destroys_a_create_that_completes_meanwhile() {
    let f = Fixture::new();
    let a = f.open();
    let pd = f.pd(a.id);
    let cq = f.cq(a.id);
    // The CA holds requests (as the miniport's queue does below D0).
    f.ca.hold.store(true, Ordering::SeqCst);
    let av = f.send::<CreateAv>(a.id, pd, &av_attr());
    let closed = Arc::new(AtomicBool::new(false));
    let closer = {
        let al = f.al.clone();
        let id = a.id;
        let closed = closed.clone();
        thread::spawn(move || {
            let drained: Arc<dyn Event> = Arc::new(TestEvent::default());
            let result = al.close(id, &AtIrql(Irql::PASSIVE), drained);
            closed.store(true, Ordering::SeqCst);
            result
        })
    };
    // Once closing, the client's direct calls and new requests are refused
    // (an arm is the probe: it changes nothing but the mock's log).
    let ca_handle = f.al.ca_handle(a.id).unwrap();
    wait_until("the client never started closing", || {
        f.al.arm_cq(a.id, cq, CqNotify::NextCompletion).is_err()
    });
    assert_eq!(
        f.al.arm_cq(a.id, cq, CqNotify::NextCompletion),
        Err(IbStatus::InvalidAlHandle)
    );
    assert_eq!(
        f.call::<AllocPd>(a.id, ca_handle, &Empty).0,
        IbStatus::InvalidAlHandle.to_ntstatus()
    );
    thread::sleep(Duration::from_millis(50));
    assert!(
        !closed.load(Ordering::SeqCst),
        "close returned with a request in flight"
    );
    assert!(!a.released.load(Ordering::SeqCst));
    assert_eq!(
        f.ca.live(),
        2,
        "nothing destroyed before the create came back"
    );

    // The CA answers (resume): the create completes to the client with its
    // handle, then close destroys it with everything else.
    f.ca.release_held();
    assert_eq!(closer.join().unwrap(), Ok(()));
    let (status, handle, _) = av.lock().unwrap().take().expect("create completed");
    assert_eq!(status, NtStatus::SUCCESS);
    assert_ne!(handle, 0);
    assert_eq!(
        f.ca.live(),
        0,
        "the create completed during close was destroyed"
    );
    assert!(f.al.orphans().is_empty());
    assert!(a.released.load(Ordering::SeqCst));
}

#[test]
fn a_destroy_the_ca_refuses_at_close_leaves_an_orphan_record_not_a_silent_leak() {
    let f = Fixture::new();
    let a = f.open();
    let pd = f.pd(a.id);
    let _cq = f.cq(a.id);
    let _mr = f.create::<RegMr>(a.id, pd, &mr_register());
    let ca_pd = f.ca.handles_of(ObjectKind::Pd)[0];
    let ca_mr = f.ca.handles_of(ObjectKind::Mr)[0];
    f.ca.refuse_destroy.lock().unwrap().insert(ca_mr);

    assert_eq!(close(&f, &a), Ok(()));

    // The client is gone either way (its reference released), the CQ is
    // destroyed; the MR the CA kept, and the PD it holds, stay recorded
    // with the AL with the reason, and no destroy of the PD was sent (it
    // would only be refused as busy).
    assert!(a.released.load(Ordering::SeqCst));
    assert_eq!(f.al.ca_handle(a.id), None);
    assert_eq!(*f.ca.destroyed.lock().unwrap(), vec![ObjectKind::Cq]);
    let mut orphans = f.al.orphans();
    orphans.sort_by_key(|orphan| orphan.ca_handle);
    assert_eq!(
        orphans,
        vec![
            Orphan {
                kind: ObjectKind::Pd,
                ca_handle: ca_pd,
                status: IbStatus::ResourceBusy,
            },
            Orphan {
                kind: ObjectKind::Mr,
                ca_handle: ca_mr,
                status: IbStatus::ResourceBusy,
            },
        ]
    );
    assert_eq!(f.ca.live(), 2);
}

#[test]
fn close_is_refused_above_passive_and_for_a_client_not_open() {
    let f = Fixture::new();
    let a = f.open();
    let _pd = f.pd(a.id);
    let drained: Arc<dyn Event> = Arc::new(TestEvent::default());
    assert_eq!(
        f.al.close(a.id, &AtIrql(Irql::DISPATCH), drained.clone()),
        Err(IbStatus::InvalidState)
    );
    assert_eq!(f.ca.live(), 1, "nothing changed");
    assert_eq!(close(&f, &a), Ok(()));
    assert_eq!(close(&f, &a), Err(IbStatus::InvalidAlHandle));
    assert_eq!(f.ca.live(), 0);
}

/// The client's own destroy of its object `handle` of `kind`.
fn destroy(f: &Fixture, client: ClientId, handle: u64, kind: ObjectKind) -> NtStatus {
    match kind {
        ObjectKind::Pd => f.call::<DeallocPd>(client, handle, &Empty).0,
        ObjectKind::Cq => f.call::<DestroyCq>(client, handle, &Empty).0,
        ObjectKind::Qp => f.call::<DestroyQp>(client, handle, &Empty).0,
        ObjectKind::Av => f.call::<DestroyAv>(client, handle, &Empty).0,
        ObjectKind::Mr => f.call::<DeregMr>(client, handle, &Empty).0,
        other => panic!("the steps create no {other:?}"),
    }
}

/// One step of a client building up objects before it dies.
#[derive(Debug, Clone)]
enum Step {
    AllocPd,
    CreateCq,
    /// A QP on the `pd`th PD and the `cq`th CQ (modulo how many there are).
    CreateQp {
        pd: usize,
        cq: usize,
    },
    CreateAv {
        pd: usize,
    },
    RegMr {
        pd: usize,
    },
    /// The client destroys its `nth` object (the AL may answer busy).
    Destroy {
        nth: usize,
    },
}

fn step() -> impl Strategy<Value = (Step, bool)> {
    let step = prop_oneof![
        Just(Step::AllocPd),
        Just(Step::CreateCq),
        (any::<usize>(), any::<usize>()).prop_map(|(pd, cq)| Step::CreateQp { pd, cq }),
        any::<usize>().prop_map(|pd| Step::CreateAv { pd }),
        any::<usize>().prop_map(|pd| Step::RegMr { pd }),
        any::<usize>().prop_map(|nth| Step::Destroy { nth }),
    ];
    // Whether the CA will refuse to destroy what the step creates.
    (step, prop::bool::weighted(0.15))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Whatever a client left, closing it leaves at the CA exactly the
    /// orphans: each one refused by the CA or holding an orphan; nothing
    /// else of the client, nothing of another client touched.
    #[test]
    fn close_leaves_at_the_ca_exactly_the_orphans(steps in prop::collection::vec(step(), 0..40)) {
        let f = Fixture::new();
        let a = f.open();
        let b = f.open();
        let pd_b = f.pd(b.id);
        let _cq_b = f.cq(b.id);
        let ca_a = f.al.ca_handle(a.id).unwrap();
        // The client's live objects: (its handle, kind); the CA handles
        // the CA will refuse to destroy.
        let mut live: Vec<(u64, ObjectKind)> = Vec::new();
        let mut refused = HashSet::new();
        let of = |live: &Vec<(u64, ObjectKind)>, kind, nth: usize| {
            let matching: Vec<u64> =
                live.iter().filter(|(_, k)| *k == kind).map(|(h, _)| *h).collect();
            (!matching.is_empty()).then(|| matching[nth % matching.len()])
        };
        for (step, refuse) in steps {
            let created = match step {
                Step::AllocPd => Some((f.call::<AllocPd>(a.id, ca_a, &Empty), ObjectKind::Pd)),
                Step::CreateCq => Some((
                    f.call::<ib_types::ioctl::CreateCq>(
                        a.id,
                        ca_a,
                        &ib_types::cq::CqAttr { cqe: 8, comp_vector: 0 },
                    ),
                    ObjectKind::Cq,
                )),
                Step::CreateQp { pd, cq } => {
                    match (of(&live, ObjectKind::Pd, pd), of(&live, ObjectKind::Cq, cq)) {
                        (Some(pd), Some(cq)) => Some((
                            f.call::<ib_types::ioctl::CreateQp>(a.id, ca_a, &qp_create(pd, cq)),
                            ObjectKind::Qp,
                        )),
                        _ => None,
                    }
                }
                Step::CreateAv { pd } => of(&live, ObjectKind::Pd, pd)
                    .map(|pd| (f.call::<CreateAv>(a.id, pd, &av_attr()), ObjectKind::Av)),
                Step::RegMr { pd } => of(&live, ObjectKind::Pd, pd)
                    .map(|pd| (f.call::<RegMr>(a.id, pd, &mr_register()), ObjectKind::Mr)),
                Step::Destroy { nth } => {
                    if !live.is_empty() {
                        let (handle, kind) = live[nth % live.len()];
                        if destroy(&f, a.id, handle, kind) == NtStatus::SUCCESS {
                            live.retain(|(h, _)| *h != handle);
                        }
                    }
                    None
                }
            };
            if let Some(((status, handle, _), kind)) = created {
                prop_assert_eq!(status, NtStatus::SUCCESS);
                live.push((handle, kind));
                if refuse {
                    // The CA's handle of what was just created: the newest.
                    let ca_handle = 0x1000 + f.ca.next.load(Ordering::SeqCst) - 1;
                    f.ca.refuse_destroy.lock().unwrap().insert(ca_handle);
                    refused.insert(ca_handle);
                }
            }
        }
        let objects_of_b: Vec<u64> = f.ca.objects.lock().unwrap().keys().copied()
            .filter(|h| *h <= 0x1001).collect();
        prop_assert_eq!(objects_of_b.len(), 2);
        let alive_before: HashSet<u64> = f.ca.objects.lock().unwrap().keys().copied().collect();

        prop_assert_eq!(close(&f, &a), Ok(()));

        prop_assert!(a.released.load(Ordering::SeqCst));
        let objects = f.ca.objects.lock().unwrap().clone();
        let orphans: HashSet<u64> = f.al.orphans().iter().map(|o| o.ca_handle).collect();
        let left: HashSet<u64> = objects.keys().copied()
            .filter(|h| !objects_of_b.contains(h)).collect();
        prop_assert_eq!(&left, &orphans, "the CA holds exactly the orphans");
        for orphan in &orphans {
            let holds_an_orphan = objects.values().any(|o| {
                o.parents.contains(orphan)
            });
            prop_assert!(refused.contains(orphan) || holds_an_orphan, "{:#x} orphaned for nothing", orphan);
        }
        for handle in refused.iter().filter(|h| alive_before.contains(h)) {
            prop_assert!(orphans.contains(handle));
        }
        // B's objects are untouched and still its own.
        for handle in &objects_of_b {
            prop_assert!(objects.contains_key(handle));
        }
        // Once the CA lets them go, the orphans go, and only B's are left.
        f.ca.refuse_destroy.lock().unwrap().clear();
        let drained: Arc<dyn Event> = Arc::new(TestEvent::default());
        prop_assert_eq!(f.al.destroy_orphans(&AtIrql(Irql::PASSIVE), drained), Ok(0));
        prop_assert_eq!(f.ca.live(), objects_of_b.len());
        prop_assert_eq!(
            f.call::<DeallocPd>(b.id, pd_b, &Empty).0,
            NtStatus::SUCCESS
        );
    }
}

#[test]
fn orphans_are_destroyed_when_the_ca_lets_them_go_and_kept_while_it_does_not() {
    let f = Fixture::new();
    let a = f.open();
    let pd = f.pd(a.id);
    let _mr = f.create::<RegMr>(a.id, pd, &mr_register());
    let ca_mr = f.ca.handles_of(ObjectKind::Mr)[0];
    f.ca.refuse_destroy.lock().unwrap().insert(ca_mr);
    assert_eq!(close(&f, &a), Ok(()));
    assert_eq!(f.al.orphans().len(), 2);
    let drained: Arc<dyn Event> = Arc::new(TestEvent::default());

    // Not above PASSIVE_LEVEL (it waits).
    assert_eq!(
        f.al.destroy_orphans(&AtIrql(Irql::DISPATCH), drained.clone()),
        Err(IbStatus::InvalidState)
    );
    // The CA still refuses the MR: both stay (the PD's destroy is sent
    // and refused as busy by the CA this time).
    assert_eq!(
        f.al.destroy_orphans(&AtIrql(Irql::PASSIVE), drained.clone()),
        Ok(2)
    );
    assert_eq!(f.al.orphans().len(), 2);
    assert_eq!(f.ca.live(), 2);
    // Once the CA lets the MR go, the MR goes first, then the PD.
    f.ca.refuse_destroy.lock().unwrap().clear();
    assert_eq!(f.al.destroy_orphans(&AtIrql(Irql::PASSIVE), drained), Ok(0));
    assert!(f.al.orphans().is_empty());
    assert_eq!(f.ca.live(), 0);
    assert_eq!(
        *f.ca.destroyed.lock().unwrap(),
        vec![ObjectKind::Mr, ObjectKind::Pd]
    );
}
