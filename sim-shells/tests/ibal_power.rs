//! Scenario: power and removal across the IBAL bus filter's port children
//! and their kernel clients (`sim_shells::ibal_bus`, docs/ibal-bus.md
//! "Power and removal"), over the real miniport on two HCAs with two ports
//! each. A client driver bound to every child (`ibportclient`) gets the AL
//! interface from its PDO, opens the AL, and closes it in its own
//! release-hardware. The tests sleep (S3, S4) while clients keep issuing
//! requests, query-remove an HCA whose client cannot let go, and remove and
//! re-plug an HCA. Every test ends with the host shut down and the
//! verifier report empty.
#![cfg(not(windows))]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use driver_platform::{DevicePowerState, RegValue, SystemPowerState};
use hca_miniport_core::cmd::DEFAULT_COMMAND_TIMEOUT_NS;
use hca_prm::regs::FatalSyndrome;
use ib_types::cq::CqNotify;
use ib_types::event::AsyncEventCode;
use ib_types::ioctl::{AllocPd, CreateCq, DeallocPd, DestroyCq, DestroyQp, Empty, QueryQp};
use ib_types::qp::QpState;
use ib_types::status::{IbStatus, NtStatus};
use ib_types::wc::{WcStatus, WorkCompletion};
use ib_types::wr::{RecvWr, SendFlags, SendOp, SendWr, Sge};
use sim_host::host::HostConfig;
use sim_host::pnp::PnpState;
use sim_host::power::CriticalSleep;
use sim_host::registry::service_parameters_key;
use sim_shells::ibal_bus::SERVICE;

use support::*;

/// While the system sleeps in `state`, a client keeps issuing requests on
/// both paths (direct submits from DPCs, IOCTLs to its PDO) and direct
/// calls; none completes before resume, every one completes after it, and
/// the objects they created work.
fn requests_during_sleep_complete_after_resume(state: SystemPowerState, critical: bool, seed: u64) {
    let w = world(seed);
    let hca = w.host.hcas()[0];
    let x = w.client(0, 1);
    let (al, id) = x.al();
    let ca = id.ca_handle();
    // A CQ from before the sleep, for the direct calls during it.
    let cq = call::<CreateCq>(&w.host, &x, ca, &CQ_ATTR).unwrap();
    // Requests in flight when the sleep begins: the child goes down only
    // once they are done, while its HCA still works.
    let in_flight = [
        send_ioctl::<AllocPd>(&w.host, &x, ca, &Empty),
        send_ioctl::<CreateCq>(&w.host, &x, ca, &CQ_ATTR),
    ];
    if critical {
        let overridden = w
            .host
            .pnp()
            .set_system_power_critical(state, CriticalSleep::Unqueried);
        assert!(overridden.is_empty());
    } else {
        w.host.pnp().set_system_power(state).unwrap();
    }
    let before_sleep = (
        answer::<AllocPd>(&in_flight[0].completion().expect("done before the sleep")).unwrap(),
        answer::<CreateCq>(&in_flight[1].completion().expect("done before the sleep")).unwrap(),
    );
    settle(&w.host);
    assert_ne!(w.host.pnp().power(hca), Some(DevicePowerState::D0));
    assert_ne!(
        w.host.pnp().power(x.host.node()),
        Some(DevicePowerState::D0)
    );
    // The client went down before its HCA: its exchange on the way down
    // was answered.
    assert_eq!(*lock(&x.d0_exit_queries), [NtStatus::SUCCESS]);

    let mut direct = Vec::new();
    let mut ioctls = Vec::new();
    for _ in 0..3 {
        let (issuer, status) = submit_in_dpc::<AllocPd>(&w.host, &x, ca, Empty);
        assert_eq!(status, NtStatus::PENDING, "held, not refused");
        direct.push(issuer);
        let (issuer, status) = submit_in_dpc::<CreateCq>(&w.host, &x, ca, CQ_ATTR);
        assert_eq!(status, NtStatus::PENDING);
        direct.push(issuer);
        ioctls.push(send_ioctl::<AllocPd>(&w.host, &x, ca, &Empty));
        ioctls.push(send_ioctl::<CreateCq>(&w.host, &x, ca, &CQ_ATTR));
        settle(&w.host);
    }
    // Direct calls cannot be held: arming answers at once with a clear
    // status, polling works on the CQ's host memory.
    assert_eq!(
        al.arm_cq(id, cq, CqNotify::NextCompletion),
        Err(IbStatus::InvalidState)
    );
    let mut wcs = [WorkCompletion::EMPTY; 4];
    assert_eq!(al.poll_cq(id, cq, &mut wcs), Ok(0));
    for issuer in direct.iter().chain(&ioctls) {
        assert!(issuer.completion().is_none(), "held while the HCA sleeps");
    }

    w.host.pnp().set_system_power(SystemPowerState::S0).unwrap();
    settle(&w.host);
    assert_eq!(w.host.pnp().power(hca), Some(DevicePowerState::D0));
    let mut pds = vec![before_sleep.0];
    let mut cqs = vec![cq, before_sleep.1];
    for (i, issuer) in direct.iter().chain(&ioctls).enumerate() {
        let done = issuer.completion().expect("completed after resume");
        if i % 2 == 0 {
            pds.push(answer::<AllocPd>(&done).unwrap());
        } else {
            cqs.push(answer::<CreateCq>(&done).unwrap());
        }
    }
    // The created objects are the client's and work.
    for &cq in &cqs {
        assert!(id.id().owns(cq));
        al.arm_cq(id, cq, CqNotify::NextCompletion).unwrap();
        call::<DestroyCq>(&w.host, &x, cq, &Empty).unwrap();
    }
    for &pd in &pds {
        call::<DeallocPd>(&w.host, &x, pd, &Empty).unwrap();
    }
    finish(w.host);
}

#[test]
fn requests_issued_during_s3_complete_after_resume() {
    requests_during_sleep_complete_after_resume(SystemPowerState::S3, false, 41);
}

#[test]
fn requests_issued_during_s4_complete_after_resume() {
    requests_during_sleep_complete_after_resume(SystemPowerState::S4, false, 42);
}

#[test]
fn requests_issued_during_an_unqueried_critical_sleep_complete_after_resume() {
    requests_during_sleep_complete_after_resume(SystemPowerState::S3, true, 46);
}

/// Query-remove of an HCA asks its children first; a client that cannot
/// let go vetoes, the veto reaches the caller and nothing changes; once it
/// lets go, the removal goes through.
#[test]
fn a_client_that_cannot_let_go_vetoes_the_hcas_query_remove() {
    let w = world(43);
    let hca = w.host.hcas()[0];
    let children_before = w.started_children(hca);
    assert_eq!(children_before.len(), 2);
    let x = w.client(0, 2);
    let (_, id) = x.al();
    let pd = call::<AllocPd>(&w.host, &x, id.ca_handle(), &Empty).unwrap();
    *lock(&x.pinned) = Some(pd);

    let veto = w.host.pnp().query_and_remove(hca).unwrap_err();
    assert_eq!(veto.what, "query-remove");
    assert_eq!(veto.service, CLIENT);
    assert_eq!(veto.status, NtStatus::DEVICE_BUSY);
    assert_eq!(
        Some(veto.instance_path.as_str()),
        w.host.pnp().instance_path(x.host.node()).as_deref(),
        "the veto names the client's child"
    );
    settle(&w.host);
    // Nothing changed: the HCA, its children and their clients are as
    // they were, and the pinned PD is still the client's.
    assert_eq!(w.host.pnp().state(hca), Some(PnpState::Started));
    assert_eq!(w.started_children(hca), children_before);
    assert_eq!(w.driver.registered_cas().len(), 2);
    assert_eq!(w.references(), 4);
    for port in [1, 2] {
        let c = w.client(0, port);
        assert!(lock(&c.closed).is_none());
        let (_, cid) = c.al();
        let pd = call::<AllocPd>(&w.host, &c, cid.ca_handle(), &Empty).unwrap();
        call::<DeallocPd>(&w.host, &c, pd, &Empty).unwrap();
    }

    // The client lets go: the removal succeeds, children first.
    call::<DeallocPd>(&w.host, &x, pd, &Empty).unwrap();
    *lock(&x.pinned) = None;
    w.host.pnp().query_and_remove(hca).unwrap();
    settle(&w.host);
    assert_eq!(w.host.pnp().state(hca), Some(PnpState::Removed));
    assert_eq!(w.driver.registered_cas().len(), 1);
    assert_eq!(w.references(), 2, "the other HCA's clients hold theirs");
    assert_eq!(*lock(&x.closed), Some(Ok(())));
    assert_eq!(*lock(&x.d0_exit_queries), [NtStatus::SUCCESS]);
    finish(w.host);
}

/// An HCA removed in order and plugged in again: its children come back
/// with the same instance paths and instance IDs, their clients open the
/// AL again and work, and the other HCA's clients never noticed.
#[test]
fn an_hca_removed_and_plugged_in_again_gets_its_children_back_the_same() {
    let w = world(44);
    let hca = w.host.hcas()[0];
    let hca_path = w.host.pnp().instance_path(hca).unwrap();
    let paths_before = w.started_children(hca);
    let ids_before: Vec<String> = w
        .driver
        .devices()
        .iter()
        .flat_map(|d| d.children())
        .filter(|c| c.ca_guid.get() == HCAS[0])
        .map(|c| c.instance_id().to_owned())
        .collect();
    assert_eq!((paths_before.len(), ids_before.len()), (2, 2));
    let other = w.client(1, 1);

    w.host.pnp().query_and_remove(hca).unwrap();
    settle(&w.host);
    assert_eq!(w.driver.registered_cas().len(), 1);
    assert_eq!(w.references(), 2);
    w.host.replug_hca(0).unwrap();
    settle(&w.host);

    let again = w.host.hcas()[0];
    assert_ne!(again, hca);
    assert_eq!(w.host.pnp().instance_path(again), Some(hca_path));
    assert_eq!(w.started_children(again), paths_before);
    let ids_after: Vec<String> = w
        .driver
        .devices()
        .iter()
        .filter(|d| d.bound().is_some())
        .flat_map(|d| d.children())
        .filter(|c| c.ca_guid.get() == HCAS[0])
        .map(|c| c.instance_id().to_owned())
        .collect();
    assert_eq!(ids_after, ids_before);
    assert_eq!(w.driver.registered_cas().len(), 2);
    assert_eq!(w.references(), 4, "the new clients opened the AL");
    // The new clients work; so does the other HCA's, which stayed.
    for client in [w.client(0, 1), w.client(0, 2), other.clone()] {
        let (_, id) = client.al();
        let pd = call::<AllocPd>(&w.host, &client, id.ca_handle(), &Empty).unwrap();
        call::<DeallocPd>(&w.host, &client, pd, &Empty).unwrap();
    }
    assert!(Arc::ptr_eq(&w.client(1, 1), &other), "never re-created");
    finish(w.host);
}

/// A connected RC QP cannot survive a sleep (the miniport brings it back
/// in ERR, docs/miniport.md "Power"): posting to it during the sleep is
/// refused with a clear status, a query held during the sleep answers
/// ERR after resume, its owner alone is told (`QpFatal` with its own
/// handle); reconnected, it carries checked traffic again.
#[test]
fn a_connected_qp_that_cannot_survive_sleep_ends_with_a_clear_status() {
    let w = world(45);
    let (x, y) = (w.client(0, 1), w.client(1, 1));
    let (sx, sy) = (rc_side(&w.host, &x), rc_side(&w.host, &y));
    connect(&w.host, &x, sx.qp, sy.qpn, 1);
    connect(&w.host, &y, sy.qp, sx.qpn, 0);
    let posted = start_transfer(&w.host, (&x, &sx), (&y, &sy), 3000, 7);
    assert_eq!(posted, ((1, IbStatus::Success), (1, IbStatus::Success)));
    settle(&w.host);
    check_transfer(&w.host, (&x, &sx), (&y, &sy), 3000, 7);

    w.host.pnp().set_system_power(SystemPowerState::S3).unwrap();
    settle(&w.host);
    // Posting is a direct call: refused at once while the HCA sleeps,
    // nothing posted.
    let (xal, xid) = x.al();
    let send_sge = leak(vec![Sge::new(sx.memory.start, 16, sx.memory.lkey)]);
    let xqp = sx.qp;
    let refused = in_dpc(&w.host, move || {
        xal.post_send(
            xid,
            xqp,
            &[SendWr {
                wr_id: 99,
                op: SendOp::Send,
                flags: SendFlags::SIGNALED,
                sg_list: send_sge,
                ud: None,
            }],
        )
    });
    assert_eq!(refused, (0, IbStatus::InvalidState));
    // A query on each path, held until after resume.
    let (direct, _) = submit_in_dpc::<QueryQp>(&w.host, &x, sx.qp, Empty);
    let ioctl = send_ioctl::<QueryQp>(&w.host, &x, sx.qp, &Empty);
    settle(&w.host);
    assert!(direct.completion().is_none() && ioctl.completion().is_none());

    w.host.pnp().set_system_power(SystemPowerState::S0).unwrap();
    settle(&w.host);
    for issuer in [&direct, &ioctl] {
        let (_, out) = answer_out::<QueryQp>(&issuer.completion().unwrap()).unwrap();
        assert_eq!(out.unwrap().state, QpState::Err, "it could not survive");
    }
    let fatal = |client: &PortClient| -> Vec<u64> {
        lock(&client.recorder.events)
            .iter()
            .filter(|e| e.code == AsyncEventCode::QpFatal)
            .map(|e| e.handle)
            .collect()
    };
    assert_eq!(fatal(&x), [sx.qp], "told with its own handle");
    assert_eq!(fatal(&y), [sy.qp]);
    assert!(fatal(&w.client(0, 2)).is_empty() && fatal(&w.client(1, 2)).is_empty());

    // The rest survived: new QPs on the same PDs, CQs and memory carry
    // traffic again (the old QPNs are in timewait, so not those).
    let mut sx = sx;
    let mut sy = sy;
    for (client, side) in [(&x, &mut sx), (&y, &mut sy)] {
        call::<DestroyQp>(&w.host, client, side.qp, &Empty).unwrap();
        poll(&w.host, client, side.cq);
        (side.qp, side.qpn) = create_qp(&w.host, client, side.pd, side.cq);
    }
    connect(&w.host, &x, sx.qp, sy.qpn, 1);
    connect(&w.host, &y, sy.qp, sx.qpn, 0);
    let posted = start_transfer(&w.host, (&x, &sx), (&y, &sy), 2000, 9);
    assert_eq!(posted, ((1, IbStatus::Success), (1, IbStatus::Success)));
    settle(&w.host);
    check_transfer(&w.host, (&x, &sx), (&y, &sy), 2000, 9);
    destroy(&w.host, &x, sx);
    destroy(&w.host, &y, sy);
    finish(w.host);
}

/// On the threaded host, a client thread keeps issuing requests on both
/// paths (direct submits, and IOCTLs through its own device to its PDO)
/// while the system goes to S3 and S4 and back: every request completes,
/// successfully, after resume at the latest; nothing hangs.
#[test]
fn a_client_issuing_without_pause_through_s3_and_s4_on_the_threaded_host_gets_every_completion() {
    let w = world_on(HostConfig::threaded(2, hca_configs()));
    settle(&w.host);
    let x = w.client(0, 1);
    let (al, id) = x.al();
    let ca = id.ca_handle();
    let verifier = w.host.verifier().clone();
    let stop = Arc::new(AtomicBool::new(false));
    let issuing = {
        let (stop, services) = (stop.clone(), x.host.clone());
        std::thread::spawn(move || {
            let mut issued = Vec::new();
            while !stop.load(Ordering::Acquire) {
                let (req, issuer) = request::<AllocPd>(&verifier, ca, &Empty);
                if issued.len() % 2 == 0 {
                    al.submit(id, req);
                } else {
                    services.send_to_own_device(req);
                }
                issued.push(issuer);
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
            issued
        })
    };
    for state in [SystemPowerState::S3, SystemPowerState::S4] {
        std::thread::sleep(std::time::Duration::from_millis(5));
        w.host.pnp().set_system_power(state).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(5));
        w.host.pnp().set_system_power(SystemPowerState::S0).unwrap();
    }
    std::thread::sleep(std::time::Duration::from_millis(5));
    stop.store(true, Ordering::Release);
    let issued = issuing.join().unwrap();
    settle(&w.host);
    assert!(issued.len() > 10, "the client kept issuing");
    for issuer in &issued {
        let done = issuer.completion().expect("every request completed");
        let pd = answer::<AllocPd>(&done).unwrap();
        call::<DeallocPd>(&w.host, &x, pd, &Empty).unwrap();
    }
    assert_eq!(lock(&x.d0_exit_queries).len(), 2, "one exchange per sleep");
    assert!(
        lock(&x.d0_exit_queries)
            .iter()
            .all(|s| *s == NtStatus::SUCCESS)
    );
    finish(w.host);
}

/// Surprise removal of one HCA while its clients have objects, requests
/// in flight and posted work, and the other HCA's clients move traffic:
/// the removed HCA's requests all complete (none hangs, none succeeds
/// after the hardware went), its clients' AL closes reclaim everything,
/// and the other HCA keeps moving checked traffic.
#[test]
fn surprise_removal_of_one_hca_under_load_leaves_the_other_working() {
    surprise_removal_under_load(HostConfig::deterministic(47, hca_configs()));
}

#[test]
fn surprise_removal_under_load_on_the_threaded_host() {
    surprise_removal_under_load(HostConfig::threaded(2, hca_configs()));
}

fn surprise_removal_under_load(config: HostConfig) {
    let w = world_on(config);
    settle(&w.host);
    let hca0 = w.host.hcas()[0];
    let (a, b) = (w.client(0, 1), w.client(0, 2));
    let (y, z) = (w.client(1, 1), w.client(1, 2));
    // A pair on each HCA, port 1 to port 2.
    let (sa, sb) = (rc_side(&w.host, &a), rc_side(&w.host, &b));
    let (sy, sz) = (rc_side(&w.host, &y), rc_side(&w.host, &z));
    connect_ports(&w.host, &a, sa.qp, 1, sb.qpn, (0, 2));
    connect_ports(&w.host, &b, sb.qp, 2, sa.qpn, (0, 1));
    connect_ports(&w.host, &y, sy.qp, 1, sz.qpn, (1, 2));
    connect_ports(&w.host, &z, sz.qp, 2, sy.qpn, (1, 1));
    for (pair, seed) in [
        (((&*a, &sa), (&*b, &sb)), 3u8),
        (((&*y, &sy), (&*z, &sz)), 4),
    ] {
        let posted = start_transfer(&w.host, pair.0, pair.1, 1500, seed);
        assert_eq!(posted, ((1, IbStatus::Success), (1, IbStatus::Success)));
        settle(&w.host);
        check_transfer(&w.host, pair.0, pair.1, 1500, seed);
    }

    // Load on both HCAs: transfers posted, requests in flight on both
    // paths of the HCA that goes.
    let posted = start_transfer(&w.host, (&a, &sa), (&b, &sb), 1000, 5);
    assert_eq!(posted, ((1, IbStatus::Success), (1, IbStatus::Success)));
    let posted = start_transfer(&w.host, (&y, &sy), (&z, &sz), 1000, 6);
    assert_eq!(posted, ((1, IbStatus::Success), (1, IbStatus::Success)));
    let (_, aid) = a.al();
    let in_flight = [
        send_ioctl::<AllocPd>(&w.host, &a, aid.ca_handle(), &Empty),
        send_ioctl::<QueryQp>(&w.host, &a, sa.qp, &Empty),
        send_ioctl::<CreateCq>(&w.host, &b, b.al().1.ca_handle(), &CQ_ATTR),
    ];
    let started_ns = w.host.scheduler_handle().now_ns();
    w.host.pnp().surprise_remove(hca0);
    // Nothing of the removal waited for the gone device to time out (the
    // miniport's command timeout, 2 s of platform time).
    let took_ns = w.host.scheduler_handle().now_ns() - started_ns;
    assert!(
        took_ns < DEFAULT_COMMAND_TIMEOUT_NS / 2,
        "the removal took {took_ns} ns"
    );
    settle(&w.host);

    // Every request of the removed HCA completed (none hangs); one the
    // device did not answer before it went ends with the removal's
    // status.
    let statuses: Vec<NtStatus> = in_flight
        .iter()
        .map(|issuer| issuer.completion().expect("completed, not stuck").status)
        .collect();
    assert!(
        statuses
            .iter()
            .all(|s| s.is_success() || *s == NtStatus::DEVICE_REMOVED),
        "{statuses:?}"
    );
    if w.host.scheduler().mode() == sim_host::sched::Mode::Deterministic {
        // The stepped device answers a command only when its task runs:
        // the CreateCq's was outstanding when the device went.
        assert!(statuses.contains(&NtStatus::DEVICE_REMOVED), "{statuses:?}");
    }
    for client in [&a, &b] {
        // Told once, before its own removal went on: the exchange in its
        // D0 exit ended at once with the removal's status.
        assert_eq!(client.recorder.removals.load(Ordering::Acquire), 1);
        assert_eq!(*lock(&client.d0_exit_queries), [NtStatus::DEVICE_REMOVED]);
        // Its close destroyed what it left (nothing sent to the gone CA)
        // and no callback came after it.
        assert_eq!(*lock(&client.closed), Some(Ok(())));
        assert_eq!(client.recorder.late.load(Ordering::Acquire), 0);
    }
    assert_eq!(w.host.pnp().state(hca0), Some(PnpState::Removed));
    assert_eq!(w.driver.registered_cas().len(), 1);
    assert_eq!(w.references(), 2, "the removed HCA's clients let go");

    // The other HCA kept working: its transfer arrived, and more do.
    check_transfer(&w.host, (&y, &sy), (&z, &sz), 1000, 6);
    let posted = start_transfer(&w.host, (&y, &sy), (&z, &sz), 2500, 8);
    assert_eq!(posted, ((1, IbStatus::Success), (1, IbStatus::Success)));
    settle(&w.host);
    check_transfer(&w.host, (&y, &sy), (&z, &sz), 2500, 8);
    destroy(&w.host, &y, sy);
    destroy(&w.host, &z, sz);
    drop((sa, sb));

    // Plugged in again, the HCA's new clients move checked traffic.
    w.host.replug_hca(0).unwrap();
    settle(&w.host);
    assert_eq!(w.references(), 4);
    let (a, b) = (w.client(0, 1), w.client(0, 2));
    let (sa, sb) = (rc_side(&w.host, &a), rc_side(&w.host, &b));
    connect_ports(&w.host, &a, sa.qp, 1, sb.qpn, (0, 2));
    connect_ports(&w.host, &b, sb.qp, 2, sa.qpn, (0, 1));
    let posted = start_transfer(&w.host, (&a, &sa), (&b, &sb), 1200, 10);
    assert_eq!(posted, ((1, IbStatus::Success), (1, IbStatus::Success)));
    settle(&w.host);
    check_transfer(&w.host, (&a, &sa), (&b, &sb), 1200, 10);
    destroy(&w.host, &a, sa);
    destroy(&w.host, &b, sb);
    finish(w.host);
}

/// A child that goes alone (its list entry removed at runtime: the bus
/// reports it missing and PnP surprise-removes it) does not take its HCA's
/// CA with it: its client, which holds an object, closes cleanly; the
/// HCA's other clients are told of no removal and keep working.
#[test]
fn a_child_removed_alone_leaves_its_hcas_ca_and_other_clients_alone() {
    let w = world(48);
    let params = service_parameters_key(SERVICE);
    let entry = format!("{params}\\IPoIB-8001");
    let registry = w.host.registry();
    registry.create_key(&entry).unwrap();
    registry
        .set_value(&entry, "DeviceId", RegValue::String("IBA\\IPOIB".into()))
        .unwrap();
    registry
        .set_value(
            &entry,
            "HardwareId",
            RegValue::MultiString(vec!["IBA\\IPOIB".into()]),
        )
        .unwrap();
    registry
        .set_value(&entry, "PartitionKey", RegValue::Dword(0x8001))
        .unwrap();
    let set_list = |names: &[&str]| {
        registry
            .set_value(
                &params,
                "StaticChild",
                RegValue::MultiString(names.iter().map(|s| s.to_string()).collect()),
            )
            .unwrap();
        w.driver.registry_changed();
        settle(&w.host);
    };
    set_list(&["IPoIB", "IPoIB-8001"]);
    assert_eq!(w.references(), 8, "a client per port and partition");
    let on_partition = |pkey: u16| -> Vec<Arc<PortClient>> {
        lock(&w.clients.devices)
            .iter()
            .filter(|c| c.port.get().is_some_and(|d| d.pkey.get() == pkey))
            .cloned()
            .collect()
    };
    let going = on_partition(0x8001);
    let staying = on_partition(0xFFFF);
    assert_eq!((going.len(), staying.len()), (4, 4));
    // The going clients hold a PD each.
    for client in &going {
        let (_, id) = client.al();
        call::<AllocPd>(&w.host, client, id.ca_handle(), &Empty).unwrap();
    }

    set_list(&["IPoIB"]);
    assert_eq!(w.references(), 4);
    for client in &going {
        assert_eq!(*lock(&client.closed), Some(Ok(())));
        assert_eq!(client.recorder.removals.load(Ordering::Acquire), 0);
        assert_eq!(*lock(&client.d0_exit_queries), [NtStatus::SUCCESS]);
    }
    assert_eq!(w.driver.registered_cas().len(), 2);
    for client in &staying {
        assert_eq!(client.recorder.removals.load(Ordering::Acquire), 0);
        let (_, id) = client.al();
        let pd = call::<AllocPd>(&w.host, client, id.ca_handle(), &Empty).unwrap();
        call::<DeallocPd>(&w.host, client, pd, &Empty).unwrap();
    }
    finish(w.host);
}

/// A catastrophic error (the device failed; its function is still on the
/// bus) leaves the CA unusable for new work, but the failed miniport still
/// hands every outstanding WR back as `WR_FLUSH_ERR` and frees what its
/// clients destroy (docs/miniport.md "Catastrophic error"). The filter
/// routes `LocalCatastrophic` to the clients and lets them drain: polls
/// return each posted receive exactly once, flushed, and the destroys
/// reach the CA; PnP then takes the failed stack down, the clients close
/// cleanly, and the restarted HCA gets new clients that work. (The filter
/// once treated the event as the CA's removal: the polls were refused
/// with `DeviceRemoved` and the flushed WRs were lost to their owners.)
#[test]
fn after_a_catastrophic_error_the_clients_drain_their_flushed_wrs_then_let_go() {
    let w = world(49);
    let (a, b) = (w.client(0, 1), w.client(0, 2));
    let (sa, sb) = (rc_side(&w.host, &a), rc_side(&w.host, &b));
    connect_ports(&w.host, &a, sa.qp, 1, sb.qpn, (0, 2));
    connect_ports(&w.host, &b, sb.qp, 2, sa.qpn, (0, 1));
    // A receive on each side that no send will consume.
    for (client, side, wr_id) in [(&a, &sa, 0xA1u64), (&b, &sb, 0xB1)] {
        let (al, id) = client.al();
        let sge = leak(vec![Sge::new(side.memory.start, 64, side.memory.lkey)]);
        let qp = side.qp;
        let posted = in_dpc(&w.host, move || {
            al.post_recv(
                id,
                qp,
                &[RecvWr {
                    wr_id,
                    sg_list: sge,
                }],
            )
        });
        assert_eq!(posted, (1, IbStatus::Success));
    }

    w.host
        .backplane()
        .with_device(0, |d| d.declare_fatal(FatalSyndrome::Internal));
    run_queued(&w.host);
    for (client, side, wr_id) in [(&a, &sa, 0xA1u64), (&b, &sb, 0xB1)] {
        let told = lock(&client.recorder.events)
            .iter()
            .filter(|e| e.code == AsyncEventCode::LocalCatastrophic)
            .count();
        assert_eq!(told, 1, "the client hears of the failure once");
        // New work is refused by the failed CA; what was posted drains.
        let (al, id) = client.al();
        let qp = side.qp;
        let sge = leak(vec![Sge::new(side.memory.start, 64, side.memory.lkey)]);
        let refused = in_dpc(&w.host, move || {
            al.post_recv(
                id,
                qp,
                &[RecvWr {
                    wr_id: 0xEE,
                    sg_list: sge,
                }],
            )
        });
        assert_ne!(refused.1, IbStatus::Success, "no new work on a failed CA");
        let flushed = poll(&w.host, client, side.cq);
        assert_eq!(flushed.len(), 1, "each WR once: {flushed:?}");
        assert_eq!(
            (flushed[0].wr_id, flushed[0].status),
            (wr_id, WcStatus::WrFlushErr)
        );
    }
    // The clients let go of the failed CA's objects: each destroy succeeds.
    for (client, side) in [(&a, sa), (&b, sb)] {
        destroy(&w.host, client, side);
    }

    // PnP takes the failed stack down and starts it again.
    settle(&w.host);
    for client in [&a, &b] {
        assert_eq!(*lock(&client.closed), Some(Ok(())));
        assert_eq!(client.recorder.late.load(Ordering::Acquire), 0);
    }
    settle(&w.host);
    assert_eq!(
        w.references(),
        4,
        "the restarted HCA's children have clients"
    );
    assert_eq!(w.driver.registered_cas().len(), 2);
    let (a, b) = (w.client(0, 1), w.client(0, 2));
    let (sa, sb) = (rc_side(&w.host, &a), rc_side(&w.host, &b));
    connect_ports(&w.host, &a, sa.qp, 1, sb.qpn, (0, 2));
    connect_ports(&w.host, &b, sb.qp, 2, sa.qpn, (0, 1));
    let posted = start_transfer(&w.host, (&a, &sa), (&b, &sb), 1200, 11);
    assert_eq!(posted, ((1, IbStatus::Success), (1, IbStatus::Success)));
    settle(&w.host);
    check_transfer(&w.host, (&a, &sa), (&b, &sb), 1200, 11);
    destroy(&w.host, &a, sa);
    destroy(&w.host, &b, sb);
    finish(w.host);
}
