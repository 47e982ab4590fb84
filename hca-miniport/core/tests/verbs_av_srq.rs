//! The AV and SRQ verbs on the simulated host: requests built with
//! `ib_types::ioctl::encode_request`, submitted through
//! `Hca::submit_request` from DPCs where the verb allows, answers decoded
//! byte for byte. Each test ends with the host shut down and the verifier
//! clean.

mod support;

use driver_platform::RequestorMode;
use ib_types::abi::Repr;
use ib_types::av::{AvAbi, AvAttr, Grh};
use ib_types::handle::PdHandle;
use ib_types::ioctl::{
    AllocPd, CloseCa, CreateAv, DeallocPd, DestroyAv, Empty, ModifyAv, OpenCa, OpenCaIn, QueryAv,
    Verb,
};
use ib_types::scalars::{Gid, Lid, PortNum};
use ib_types::status::IbStatus;
use support::{World, response};
use zerocopy::IntoBytes;

const KERNEL: RequestorMode = RequestorMode::Kernel;
const USER: RequestorMode = RequestorMode::User;

fn status_of<V: Verb>(done: &sim_host::request::Completion) -> IbStatus {
    response::<V>(done).status
}

/// Opens the CA and allocates a PD; returns both handles.
fn open_with_pd(w: &World) -> (u64, u64) {
    let done = w.call::<OpenCa>(KERNEL, 0, &OpenCaIn::CURRENT, 0);
    let ca = response::<OpenCa>(&done).handle;
    let done = w.call_in_dpc::<AllocPd>(KERNEL, ca, &Empty, 0);
    let r = response::<AllocPd>(&done);
    assert_eq!(r.status, IbStatus::Success);
    (ca, r.handle)
}

/// A RoCEv2 AV on `port` to `10.0.0.ip`, with every GRH field set.
fn av(port: u8, ip: u8) -> AvAttr {
    AvAttr {
        port: PortNum::new(port).unwrap(),
        sl: 3,
        dlid: Lid::UNASSIGNED,
        path_bits: 0,
        static_rate: 0,
        grh: Some(Grh {
            dgid: Gid::from_ipv4([10, 0, 0, ip]),
            flow_label: 0x1_2345,
            hop_limit: 17,
            traffic_class: 0x28,
            sgid_index: 0,
        }),
    }
}

fn create_av(w: &World, pd: u64, attr: &AvAttr) -> (IbStatus, u64) {
    let done = w.call_in_dpc::<CreateAv>(KERNEL, pd, attr, 0);
    let r = response::<CreateAv>(&done);
    (r.status, r.handle)
}

/// QueryAv's answer: the PD and the attributes, as ABI bytes.
fn query_av(w: &World, av: u64) -> (PdHandle, [u8; 32]) {
    let done = w.call_in_dpc::<QueryAv>(KERNEL, av, &Empty, 0);
    let r = response::<QueryAv>(&done);
    assert_eq!(r.status, IbStatus::Success);
    let out = r.output.unwrap();
    let mut bytes = [0u8; 32];
    bytes.copy_from_slice(out.av.emit().as_bytes());
    (out.pd, bytes)
}

#[test]
fn av_create_query_modify_destroy_from_dpcs() {
    let w = World::deterministic(31);
    let (ca, pd) = open_with_pd(&w);
    let attr = av(1, 9);
    let (status, handle) = create_av(&w, pd, &attr);
    assert_eq!(status, IbStatus::Success);
    assert_ne!(handle, 0);

    // Byte for byte what was given (AvAbi layout, ib_types::av).
    let (got_pd, bytes) = query_av(&w, handle);
    assert_eq!(got_pd, PdHandle::from_raw(pd));
    let expected: [u8; 32] = [
        1, 3, 0, 0, // port, sl, path bits, static rate
        0, 0, // dlid
        1, 0, // grh_valid, sgid_index
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xFF, 10, 0, 0, 9, // dgid
        0x45, 0x23, 0x01, 0x00, // flow label
        17, 0x28, 0, 0, // hop limit, traffic class, reserved
    ];
    assert_eq!(bytes, expected);
    assert_eq!(AvAbi::default().as_bytes().len(), 32);

    // Modify to port 2, another destination.
    let moved = av(2, 77);
    let done = w.call_in_dpc::<ModifyAv>(KERNEL, handle, &moved, 0);
    assert_eq!(status_of::<ModifyAv>(&done), IbStatus::Success);
    let (_, bytes) = query_av(&w, handle);
    assert_eq!(bytes[0], 2);
    assert_eq!(bytes[8..24], Gid::from_ipv4([10, 0, 0, 77]).as_bytes()[..]);

    // A PD with an AV cannot be deallocated.
    let done = w.call_in_dpc::<DeallocPd>(KERNEL, pd, &Empty, 0);
    assert_eq!(status_of::<DeallocPd>(&done), IbStatus::ResourceBusy);

    let done = w.call_in_dpc::<DestroyAv>(KERNEL, handle, &Empty, 0);
    assert_eq!(status_of::<DestroyAv>(&done), IbStatus::Success);
    for status in [
        status_of::<DestroyAv>(&w.call::<DestroyAv>(KERNEL, handle, &Empty, 0)),
        status_of::<QueryAv>(&w.call::<QueryAv>(KERNEL, handle, &Empty, 0)),
        status_of::<ModifyAv>(&w.call::<ModifyAv>(KERNEL, handle, &moved, 0)),
    ] {
        assert_eq!(status, IbStatus::InvalidAvHandle);
    }
    let done = w.call_in_dpc::<DeallocPd>(KERNEL, pd, &Empty, 0);
    assert_eq!(status_of::<DeallocPd>(&done), IbStatus::Success);
    let done = w.call::<CloseCa>(KERNEL, ca, &Empty, 0);
    assert_eq!(status_of::<CloseCa>(&done), IbStatus::Success);
    w.finish();
}

#[test]
fn invalid_avs_are_refused_and_change_nothing() {
    let w = World::deterministic(32);
    let (ca, pd) = open_with_pd(&w);
    let good = av(1, 5);
    let (status, handle) = create_av(&w, pd, &good);
    assert_eq!(status, IbStatus::Success);
    let (_, before) = query_av(&w, handle);

    let bad_port = av(3, 5);
    let mut bad_gid = av(1, 5);
    if let Some(grh) = bad_gid.grh.as_mut() {
        grh.sgid_index = 200;
    }
    // Index 1 is inside the table but never set (SET_GID not issued).
    let mut unset_gid = av(1, 5);
    if let Some(grh) = unset_gid.grh.as_mut() {
        grh.sgid_index = 1;
    }
    let rated = AvAttr {
        static_rate: 2,
        ..good
    };
    let no_grh = AvAttr { grh: None, ..good };
    let cases = [
        (bad_port, IbStatus::InvalidPort),
        (bad_gid, IbStatus::InvalidGid),
        (unset_gid, IbStatus::InvalidGid),
        (rated, IbStatus::InvalidSetting),
        (no_grh, IbStatus::InvalidParameter),
    ];
    for (attr, expected) in cases {
        let (status, made) = create_av(&w, pd, &attr);
        assert_eq!((status, made), (expected, 0), "create {attr:?}");
        let done = w.call_in_dpc::<ModifyAv>(KERNEL, handle, &attr, 0);
        assert_eq!(status_of::<ModifyAv>(&done), expected, "modify {attr:?}");
        assert_eq!(query_av(&w, handle).1, before, "unchanged");
    }
    // Wrong handles: a CA is not a PD; nor is a stale PD handle. (An AV
    // handle is not checked here: handles of different kinds share one
    // `generation << 32 | number` space, so AV 0 and PD 0 look alike.)
    assert_eq!(create_av(&w, ca, &good).0, IbStatus::InvalidPdHandle);
    assert_eq!(
        create_av(&w, pd ^ (1 << 40), &good).0,
        IbStatus::InvalidPdHandle
    );
    // User mode: not yet.
    let done = w.call::<CreateAv>(USER, pd, &good, 0);
    assert_eq!(status_of::<CreateAv>(&done), IbStatus::Unsupported);
    let done = w.call::<QueryAv>(USER, handle, &Empty, 0);
    assert_eq!(status_of::<QueryAv>(&done), IbStatus::InvalidAvHandle);

    // The failed creates left no use of the PD behind: one AV, one use.
    assert_eq!(w.hca().reference_pd(pd), Ok(2));
    assert_eq!(w.hca().release_pd(pd), Ok(1));
    let done = w.call::<DestroyAv>(KERNEL, handle, &Empty, 0);
    assert_eq!(status_of::<DestroyAv>(&done), IbStatus::Success);
    let done = w.call::<DeallocPd>(KERNEL, pd, &Empty, 0);
    assert_eq!(status_of::<DeallocPd>(&done), IbStatus::Success);
    w.finish();
}
