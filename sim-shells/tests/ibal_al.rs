//! Scenario: kernel clients of the access layer on the IBAL bus filter's
//! port children (`sim_shells::ibal_bus`), over the real miniport on two
//! HCAs with two ports each. A client driver bound to every child (the
//! `ibportclient` service of `inf/ib-port-client.inf`) gets the AL
//! interface from its PDO with the port's data, opens the AL with a
//! reference on its driver object, and closes it in its own
//! release-hardware; the tests drive its verbs through the interface and
//! through the IOCTL path of its PDO. Every test ends with the host shut
//! down and the verifier report empty.
#![cfg(not(windows))]

mod support;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use driver_platform::SystemPowerState;
use driver_platform::{Irql, RequestorMode};
use ib_types::cq::{CqAttr, CqNotify};
use ib_types::event::{AsyncEventCode, EventSubject};
use ib_types::interface::{AL_INTERFACE_VERSION, GUID_IB_AL_INTERFACE, InterfaceVersion};
use ib_types::ioctl::{
    AllocPd, CreateCq, CreateQp, DeallocPd, DestroyCq, Empty, QueryCa, Verb, decode_response,
    encode_request, request_len, response_len,
};
use ib_types::qp::QpType;
use ib_types::scalars::PKey;
use ib_types::status::{IbStatus, NtStatus};
use ib_types::wc::{WcStatus, WorkCompletion};
use ib_types::wr::{RecvWr, SendFlags, SendOp, SendWr, Sge};
use ibal_bus_core::ci::ports_from_attributes;
use sim_host::event::HostEvent;
use sim_host::host::{Host, HostConfig};
use sim_host::request::{HostRequest, RequestHandle};
use sim_host::verifier::ViolationKind;
use sim_shells::rc_path::rc_qp_create;

use support::*;

/// Verb `V` as an internal device-control request sent to the client's
/// child (the IOCTL path), run to completion.
fn ioctl<V: Verb>(
    host: &Host,
    client: &PortClient,
    handle: u64,
    input: &V::In,
) -> Result<(u64, Option<V::Out>), IbStatus> {
    let (req, issuer) = request::<V>(host.verifier(), handle, input);
    host.pnp().send_request(client.host.node(), req);
    settle(host);
    answer_out::<V>(&issuer.completion().expect("completed"))
}

#[test]
fn a_kernel_client_on_a_child_gets_the_al_interface_with_its_ports_data_counted() {
    let w = world(21);
    let devices = lock(&w.clients.devices).clone();
    assert_eq!(devices.len(), 4, "one client per port of each HCA");
    for client in &devices {
        let (al, _) = client.al();
        let data = al.port_data();
        let node = client.host.node();
        // The data is the child's: its CA, port, port GUID and P_Key.
        let filter_child = w
            .driver
            .devices()
            .iter()
            .flat_map(|d| d.children())
            .find(|c| {
                w.host
                    .pnp()
                    .instance_path(node)
                    .is_some_and(|p| p.ends_with(c.instance_id()))
            })
            .expect("the client's child");
        assert_eq!(data.ca_guid, filter_child.ca_guid);
        assert_eq!(data.port_guid, filter_child.port_guid);
        assert_eq!(data.port, filter_child.port_num);
        assert_eq!(data.pkey, PKey::new(0xFFFF));
        let opened = lock(&client.opened);
        let version = opened.as_ref().unwrap().interface.version();
        assert_eq!(InterfaceVersion::from_packed(version), AL_INTERFACE_VERSION);
        // The client's reference is counted against its child.
        assert_eq!(w.host.pnp().interface_references(node), 1);
    }
    // Asked at a newer minor, the child answers with its own version (the
    // closest not above); below its version, not at all.
    let node = devices[0].host.node();
    let newer = InterfaceVersion::new(1, 7).packed();
    let answered = w
        .host
        .pnp()
        .query_interface(node, &GUID_IB_AL_INTERFACE, newer)
        .expect("answered");
    assert_eq!(answered.version(), AL_INTERFACE_VERSION.packed());
    answered.dereference();
    let older = InterfaceVersion::new(0, 9).packed();
    assert!(
        w.host
            .pnp()
            .query_interface(node, &GUID_IB_AL_INTERFACE, older)
            .is_none()
    );
    // Every client holds one reference on the client driver's object.
    assert_eq!(w.references(), 4);
    let World { host, clients, .. } = w;
    finish(host);
    // Each closed its AL at its removal, before the HCA's filter let go.
    for client in lock(&clients.devices).iter() {
        assert_eq!(*lock(&client.closed), Some(Ok(())));
        assert_eq!(client.references.load(Ordering::Acquire), 0);
    }
}

#[test]
fn a_leaked_al_interface_reference_is_the_hosts_reference_leak() {
    let w = world_with(HostConfig::deterministic(22, hca_configs()), true);
    w.host.shut_down();
    let leaks = w
        .host
        .verifier()
        .take()
        .into_iter()
        .filter(|v| {
            matches!(&v.kind, ViolationKind::ReferenceLeak { what } if what.contains(&GUID_IB_AL_INTERFACE.to_string()))
        })
        .count();
    assert_eq!(leaks, 4, "one per client");
}

/// AllocPd and CreateCq, then CreateQp, all submitted from DPCs (at
/// DISPATCH_LEVEL) with completion routines; returns (PD, CQ, QP, QPN).
fn create_at_dispatch(host: &Host, client: &PortClient, qp_type: QpType) -> (u64, u64, u64, u32) {
    let (al, id) = client.al();
    let first = {
        let (al, host2) = (al.clone(), host.verifier().clone());
        in_dpc(host, move || {
            assert_eq!(sim_host::irql::current(), Irql::DISPATCH);
            let issuers: Vec<RequestHandle> = [0, 1]
                .into_iter()
                .map(|i| {
                    let (req, issuer) = if i == 0 {
                        request::<AllocPd>(&host2, id.ca_handle(), &Empty)
                    } else {
                        let attr = CqAttr {
                            cqe: 64,
                            comp_vector: 0,
                        };
                        request::<CreateCq>(&host2, id.ca_handle(), &attr)
                    };
                    assert_eq!(al.submit(id, req), NtStatus::PENDING);
                    issuer
                })
                .collect();
            issuers
        })
    };
    settle(host);
    let pd = answer_out::<AllocPd>(&first[0].completion().unwrap())
        .unwrap()
        .0;
    let cq = answer_out::<CreateCq>(&first[1].completion().unwrap())
        .unwrap()
        .0;
    let create = rc_qp_create(qp_type, pd, cq, 8);
    let verifier = host.verifier().clone();
    let issuer = in_dpc(host, move || {
        let (req, issuer) = request::<CreateQp>(&verifier, id.ca_handle(), &create);
        assert_eq!(al.submit(id, req), NtStatus::PENDING);
        issuer
    });
    settle(host);
    let (qp, out) = answer_out::<CreateQp>(&issuer.completion().unwrap()).unwrap();
    (pd, cq, qp, out.unwrap().qpn.get())
}

/// Arms the CQ and polls everything from DPCs.
fn arm(host: &Host, client: &PortClient, cq: u64) {
    let (al, id) = client.al();
    in_dpc(host, move || al.arm_cq(id, cq, CqNotify::NextCompletion)).unwrap();
}

/// An RC side whose PD, CQ and QP were created at DISPATCH_LEVEL.
fn rc_side(host: &Host, client: &PortClient) -> RcSide {
    rc_side_of(host, client, create_at_dispatch(host, client, QpType::Rc))
}

#[test]
fn clients_on_two_hcas_create_at_dispatch_move_checked_rc_traffic_and_get_their_events() {
    let w = world(23);
    let (x, y) = (w.client(0, 1), w.client(1, 1));
    let (sx, sy) = (rc_side(&w.host, &x), rc_side(&w.host, &y));
    connect(&w.host, &x, sx.qp, sy.qpn, 1);
    connect(&w.host, &y, sy.qp, sx.qpn, 0);

    // Y receives into its second page; X sends 3000 bytes of a pattern.
    let payload: Vec<u8> = (0..3000u32).map(|i| (i * 31 + 7) as u8).collect();
    assert!(sx.memory.write(0, &payload));
    let (yal, yid) = y.al();
    let recv_sge = leak(vec![Sge::new(sy.memory.start + 4096, 4096, sy.memory.lkey)]);
    let yqp = sy.qp;
    let posted = in_dpc(&w.host, move || {
        yal.post_recv(
            yid,
            yqp,
            &[RecvWr {
                wr_id: 9,
                sg_list: recv_sge,
            }],
        )
    });
    assert_eq!(posted, (1, IbStatus::Success));
    arm(&w.host, &x, sx.cq);
    arm(&w.host, &y, sy.cq);
    let (xal, xid) = x.al();
    let send_sge = leak(vec![Sge::new(sx.memory.start, 3000, sx.memory.lkey)]);
    let xqp = sx.qp;
    let posted = in_dpc(&w.host, move || {
        xal.post_send(
            xid,
            xqp,
            &[SendWr {
                wr_id: 8,
                op: SendOp::Send,
                flags: SendFlags::SIGNALED,
                sg_list: send_sge,
                ud: None,
            }],
        )
    });
    assert_eq!(posted, (1, IbStatus::Success));
    settle(&w.host);
    let sent = poll(&w.host, &x, sx.cq);
    let got = poll(&w.host, &y, sy.cq);
    assert!(sent.len() == 1 && sent[0].wr_id == 8 && sent[0].status == WcStatus::Success);
    assert!(got.len() == 1 && got[0].wr_id == 9 && got[0].status == WcStatus::Success);
    assert_eq!(got[0].byte_len, 3000);
    let mut seen = vec![0; 3000];
    assert!(sy.memory.read(4096, &mut seen));
    assert_eq!(seen, payload, "the bytes arrived");

    // The completion events reached the owners only, with their handles,
    // at DISPATCH_LEVEL.
    assert_eq!(*lock(&x.recorder.completions), [(sx.cq, Irql::DISPATCH)]);
    assert_eq!(*lock(&y.recorder.completions), [(sy.cq, Irql::DISPATCH)]);
    for other in [w.client(0, 2), w.client(1, 2)] {
        assert!(lock(&other.recorder.completions).is_empty());
        assert!(lock(&other.recorder.events).is_empty());
    }

    // Sleep with the connection up: the children leave D0 before their
    // HCAs and the AL stays; on resume the connected QPs come back in ERR
    // and each owner, only, is told with its own handle.
    w.host.pnp().set_system_power(SystemPowerState::S3).unwrap();
    w.host.pnp().set_system_power(SystemPowerState::S0).unwrap();
    settle(&w.host);
    for (client, side) in [(&x, &sx), (&y, &sy)] {
        let events = lock(&client.recorder.events).clone();
        assert!(
            events
                .iter()
                .any(|e| e.code == AsyncEventCode::QpFatal && e.handle == side.qp),
            "{events:?}"
        );
    }
    for other in [w.client(0, 2), w.client(1, 2)] {
        let events = lock(&other.recorder.events).clone();
        assert!(
            events
                .iter()
                .all(|e| e.code.subject() != EventSubject::Qp
                    && e.code.subject() != EventSubject::Cq),
            "no object event for a client owning none: {events:?}"
        );
    }

    destroy(&w.host, &x, sx);
    destroy(&w.host, &y, sy);
    finish(w.host);
}

#[test]
fn the_same_verbs_through_the_ioctl_path_of_the_child() {
    let w = world(24);
    let x = w.client(0, 1);
    let (_, id) = x.al();
    let ca = id.ca_handle();
    // QueryCa: the CA's ports through the AL.
    let room = 16 * 1024;
    let mut bytes = vec![0; request_len::<QueryCa>(0).unwrap()];
    encode_request::<QueryCa>(ca, &Empty, &[], room, &mut bytes).unwrap();
    let (req, issuer) = HostRequest::new(
        w.host.verifier(),
        QueryCa::ID.ioctl().raw(),
        RequestorMode::Kernel,
        bytes,
        response_len::<QueryCa>(room as usize).unwrap(),
    );
    w.host.pnp().send_request(x.host.node(), req);
    settle(&w.host);
    let done = issuer.completion().unwrap();
    assert_eq!(done.status, NtStatus::SUCCESS);
    let len = done.information as usize;
    let response = decode_response::<QueryCa>(&done.output[..len]).unwrap();
    let ports = ports_from_attributes(response.private).unwrap();
    let (al, _) = x.al();
    assert_eq!(ports.len(), 2);
    assert!(
        ports
            .iter()
            .any(|p| p.port_guid == al.port_data().port_guid)
    );

    // Create and destroy, each answered with the client's handles.
    let (pd, _) = ioctl::<AllocPd>(&w.host, &x, ca, &Empty).unwrap();
    let attr = CqAttr {
        cqe: 16,
        comp_vector: 0,
    };
    let (cq, _) = ioctl::<CreateCq>(&w.host, &x, ca, &attr).unwrap();
    assert!(id.id().owns(pd) && id.id().owns(cq), "the client's handles");
    // The interface path sees the same objects: one implementation.
    assert_eq!(
        call_out::<DeallocPd>(&w.host, &x, cq, &Empty, &[]),
        Err(IbStatus::InvalidPdHandle),
        "a CQ is no PD on either path"
    );
    ioctl::<DestroyCq>(&w.host, &x, cq, &Empty).unwrap();
    call_out::<DeallocPd>(&w.host, &x, pd, &Empty, &[]).unwrap();
    assert_eq!(
        ioctl::<DestroyCq>(&w.host, &x, cq, &Empty),
        Err(IbStatus::InvalidCqHandle),
        "destroyed"
    );

    // A user-mode request is no internal device control.
    let mut bytes = vec![0; request_len::<AllocPd>(0).unwrap()];
    encode_request::<AllocPd>(ca, &Empty, &[], 0, &mut bytes).unwrap();
    let (req, issuer) = HostRequest::new(
        w.host.verifier(),
        AllocPd::ID.ioctl().raw(),
        RequestorMode::User,
        bytes,
        response_len::<AllocPd>(0).unwrap(),
    );
    w.host.pnp().send_request(x.host.node(), req);
    settle(&w.host);
    assert_eq!(
        issuer.completion().unwrap().status,
        NtStatus::INVALID_DEVICE_REQUEST
    );
    // No header: refused.
    let (req, issuer) = HostRequest::new(
        w.host.verifier(),
        AllocPd::ID.ioctl().raw(),
        RequestorMode::Kernel,
        vec![1, 2, 3],
        64,
    );
    w.host.pnp().send_request(x.host.node(), req);
    settle(&w.host);
    assert_eq!(
        issuer.completion().unwrap().status,
        NtStatus::INVALID_PARAMETER
    );
    finish(w.host);
}

#[test]
fn handles_of_one_client_are_refused_for_another() {
    let w = world(25);
    // Two clients of the same CA (its two ports' children), and one on
    // the other HCA.
    let (a, b, c) = (w.client(0, 1), w.client(0, 2), w.client(1, 1));
    let (_, aid) = a.al();
    let (pd, _) = call_out::<AllocPd>(&w.host, &a, aid.ca_handle(), &Empty, &[]).unwrap();
    let attr = CqAttr {
        cqe: 16,
        comp_vector: 0,
    };
    let (cq, _) = call_out::<CreateCq>(&w.host, &a, aid.ca_handle(), &attr, &[]).unwrap();
    for other in [&b, &c] {
        // Through the interface: the AL refuses another client's handles.
        assert_eq!(
            call_out::<DeallocPd>(&w.host, other, pd, &Empty, &[]),
            Err(IbStatus::InvalidPdHandle)
        );
        let (al, id) = other.al();
        // A's handle of the CA names no CA of B's (tags are per client of
        // one access layer; on the other HCA's AL the same number may be
        // C's own CA handle, which reaches only C's objects).
        if id.ca_handle() != aid.ca_handle() {
            assert_eq!(
                call_out::<AllocPd>(&w.host, other, aid.ca_handle(), &Empty, &[]),
                Err(IbStatus::InvalidCaHandle)
            );
        }
        assert_eq!(
            al.arm_cq(id, cq, CqNotify::NextCompletion),
            Err(IbStatus::InvalidCqHandle)
        );
        let mut wcs = [WorkCompletion::EMPTY; 1];
        assert_eq!(al.poll_cq(id, cq, &mut wcs), Err(IbStatus::InvalidCqHandle));
        // Through the IOCTL path of its own child: the handle names no
        // client opened there (STATUS_INVALID_HANDLE), or, where its tag
        // is that of the child's own client (another AL's), that client's
        // table refuses it.
        let (req, issuer) = request::<DestroyCq>(w.host.verifier(), cq, &Empty);
        w.host.pnp().send_request(other.host.node(), req);
        settle(&w.host);
        let expected = if id.id().owns(cq) {
            IbStatus::InvalidCqHandle.to_ntstatus()
        } else {
            NtStatus::INVALID_HANDLE
        };
        assert_eq!(issuer.completion().unwrap().status, expected);
    }
    // A's objects are untouched: A still destroys them.
    call_out::<DestroyCq>(&w.host, &a, cq, &Empty, &[]).unwrap();
    call_out::<DeallocPd>(&w.host, &a, pd, &Empty, &[]).unwrap();
    finish(w.host);
}

#[test]
fn clients_close_before_their_hca_goes_and_a_stop_waits_for_them() {
    let w = world(26);
    let hca = w.host.hcas()[0];
    let filter = w
        .driver
        .devices()
        .into_iter()
        .find(|d| {
            d.bound()
                .is_some_and(|b| b.identity().ca_guid.get() == HCAS[0])
        })
        .unwrap();
    let al = filter.access_layer().expect("an access layer per bound CA");
    assert_eq!(al.open_clients(), 2);
    // A stop would close the CA under the open clients: vetoed.
    assert!(w.host.pnp().stop(hca).is_err());
    assert_eq!(al.open_clients(), 2);
    assert_eq!(w.references(), 4);

    // Removal: the children go first, their clients close there, then the
    // filter lets the CA go.
    w.host.pnp().query_and_remove(hca).unwrap();
    settle(&w.host);
    assert_eq!(al.open_clients(), 0);
    assert!(filter.access_layer().is_none());
    assert_eq!(w.references(), 2, "the other HCA's clients hold theirs");
    for client in lock(&w.clients.devices).iter() {
        let guid = client.port.get().unwrap().ca_guid.get();
        let closed = *lock(&client.closed);
        if guid == HCAS[0] {
            assert_eq!(closed, Some(Ok(())));
        } else {
            assert_eq!(closed, None);
        }
    }
    // The other HCA's clients keep working.
    let c = w.client(1, 1);
    let (_, id) = c.al();
    let (pd, _) = call_out::<AllocPd>(&w.host, &c, id.ca_handle(), &Empty, &[]).unwrap();
    call_out::<DeallocPd>(&w.host, &c, pd, &Empty, &[]).unwrap();
    finish(w.host);
}

/// A client that still owns objects when its HCA leaves: its close at its
/// own removal destroys them (the AL closes what a client left open, in
/// dependency order), the filter drops the access layer at release-hardware,
/// the client's reference on its driver is given back, and every later call
/// of the client is refused; nothing leaks.
#[test]
fn a_client_owning_objects_when_its_hca_leaves_closes_cleanly_and_later_calls_are_refused() {
    for surprise in [false, true] {
        let w = world(27);
        let a = w.client(0, 1);
        let (al, id) = a.al();
        let (pd, _) = call_out::<AllocPd>(&w.host, &a, id.ca_handle(), &Empty, &[]).unwrap();
        let hca = w.host.hcas()[0];
        if surprise {
            w.host.pnp().surprise_remove(hca);
            w.host.pnp().remove_when_no_handles_remain(hca, 0);
        } else {
            w.host.pnp().query_and_remove(hca).unwrap();
        }
        settle(&w.host);
        assert_eq!(
            *lock(&a.closed),
            Some(Ok(())),
            "its PD destroyed by the close"
        );
        assert_eq!(w.references(), 2, "only the other HCA's clients' remain");
        let (req, issuer) = request::<DeallocPd>(w.host.verifier(), pd, &Empty);
        assert_eq!(al.submit(id, req), NtStatus::INVALID_DEVICE_STATE);
        assert_eq!(
            issuer.completion().unwrap().status,
            NtStatus::INVALID_DEVICE_STATE
        );
        let mut wcs = [WorkCompletion::EMPTY; 1];
        assert_eq!(al.poll_cq(id, 1, &mut wcs), Err(IbStatus::InvalidState));
        let drained = Arc::new(HostEvent::new(w.host.scheduler_handle()));
        assert_eq!(al.close(id, drained), Ok(()), "gone with the access layer");
        assert_eq!(w.host.verifier().violations(), [], "surprise: {surprise}");
        finish(w.host);
    }
}

/// On the threaded host (requests completing on worker threads while the
/// test thread waits) every client's verbs go through its AL, and the
/// clients close and the filters let go cleanly at shutdown.
#[test]
fn clients_use_the_al_on_the_threaded_host_too() {
    for round in 0..3 {
        let w = world_on(HostConfig::threaded(2, hca_configs()));
        // The children's stacks start on worker threads.
        for _ in 0..3 {
            settle(&w.host);
        }
        for (hca, port) in [(0, 1), (0, 2), (1, 1), (1, 2)] {
            let client = w.client(hca, port);
            let (_, id) = client.al();
            let (pd, _) =
                call_out::<AllocPd>(&w.host, &client, id.ca_handle(), &Empty, &[]).unwrap();
            let attr = CqAttr {
                cqe: 16,
                comp_vector: 0,
            };
            let (cq, _) =
                call_out::<CreateCq>(&w.host, &client, id.ca_handle(), &attr, &[]).unwrap();
            let (al, id) = client.al();
            assert_eq!(al.arm_cq(id, cq, CqNotify::NextCompletion), Ok(()));
            call_out::<DestroyCq>(&w.host, &client, cq, &Empty, &[]).unwrap();
            call_out::<DeallocPd>(&w.host, &client, pd, &Empty, &[]).unwrap();
        }
        assert_eq!(w.references(), 4, "round {round}");
        finish(w.host);
    }
}
