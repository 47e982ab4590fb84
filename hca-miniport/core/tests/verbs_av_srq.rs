//! The AV and SRQ verbs on the simulated host: requests built with
//! `ib_types::ioctl::encode_request`, submitted through
//! `Hca::submit_request` from DPCs where the verb allows, answers decoded
//! byte for byte. Each test ends with the host shut down and the verifier
//! clean.

mod support;

use std::sync::{Arc, Mutex};

use driver_platform::{Irql, RequestorMode};
use hca_miniport_core::cmd::Command;
use hca_miniport_core::verbs::CaClient;
use hca_prm::cmd::Opcode;
use hca_prm::ctx::{SrqState, Srqc};
use ib_types::abi::Repr;
use ib_types::av::{AvAbi, AvAttr, Grh};
use ib_types::cq::CqAttr;
use ib_types::event::{AsyncEventCode, AsyncEventRecord};
use ib_types::handle::CqHandle;
use ib_types::handle::PdHandle;
use ib_types::ioctl::{
    AllocPd, CloseCa, CreateAv, CreateCq, CreateSrq, DeallocPd, DestroyAv, DestroyCq, DestroySrq,
    Empty, ModifyAv, ModifySrq, OpenCa, OpenCaIn, QueryAv, QuerySrq, Verb,
};
use ib_types::scalars::{Gid, Lid, PortNum};
use ib_types::srq::{SrqAttr, SrqCreate, SrqModify};
use ib_types::status::IbStatus;
use ib_types::wc::{WcOpcode, WcStatus, WorkCompletion};
use ib_types::wr::{LKey, RecvWr, Sge};
use support::{World, lock, response};
use zerocopy::{FromBytes, IntoBytes};

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
    // Wrong handles: a CA is not a PD, nor is an AV (handles carry their
    // kind), nor is a stale PD handle.
    assert_eq!(create_av(&w, ca, &good).0, IbStatus::InvalidPdHandle);
    assert_eq!(create_av(&w, handle, &good).0, IbStatus::InvalidPdHandle);
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

// ----- shared receive queues ------------------------------------------------

/// Runs one device command through the core and returns its result.
fn command(
    w: &World,
    command: Command,
) -> Result<hca_miniport_core::cmd::CommandOutput, hca_miniport_core::cmd::CommandError> {
    let out = Arc::new(Mutex::new(None));
    let sink = out.clone();
    w.hca()
        .submit(command, Box::new(move |result| *lock(&sink) = Some(result)));
    w.settle();
    lock(&out).take().expect("the command completed")
}

/// The SRQ's context as the device reports it (`QUERY_SRQ`).
fn query_srqc(w: &World, srqn: u32) -> Srqc {
    let answer = command(
        w,
        Command::new(Opcode::QuerySrq, srqn).with_output(size_of::<Srqc>()),
    )
    .expect("QUERY_SRQ succeeded");
    Srqc::read_from_bytes(&answer.mailbox).unwrap()
}

fn create_srq(w: &World, ca: u64, pd: u64, attr: SrqAttr) -> (IbStatus, u64, Option<SrqAttr>) {
    let create = SrqCreate {
        pd: PdHandle::from_raw(pd),
        attr,
    };
    let done = w.call_in_dpc::<CreateSrq>(KERNEL, ca, &create, 0);
    let r = response::<CreateSrq>(&done);
    (r.status, r.handle, r.output)
}

fn srq_attr(max_wr: u32, max_sge: u32, srq_limit: u32) -> SrqAttr {
    SrqAttr {
        max_wr,
        max_sge,
        srq_limit,
    }
}

fn query_srq(w: &World, srq: u64) -> SrqAttr {
    let done = w.call_in_dpc::<QuerySrq>(KERNEL, srq, &Empty, 0);
    let r = response::<QuerySrq>(&done);
    assert_eq!(r.status, IbStatus::Success);
    r.output.unwrap()
}

#[test]
fn srq_create_query_modify_destroy_from_dpcs() {
    let w = World::deterministic(41);
    let (ca, pd) = open_with_pd(&w);
    let report = w.hca().report().unwrap();
    let cap = report.capabilities;

    // 100 WRs of 2 SGEs: 128 entries of 64 bytes, which hold 3 SGEs.
    let (status, srq, out) = create_srq(&w, ca, pd, srq_attr(100, 2, 0));
    assert_eq!(status, IbStatus::Success);
    assert_eq!(out, Some(srq_attr(128, 3, 0)));
    let srqn = support::number_of(srq);
    let srqc = query_srqc(&w, srqn);
    assert_eq!(srqc.state, SrqState::Ready.code());
    assert_eq!(srqc.pd.get(), support::number_of(pd), "the PD's number");
    assert_eq!(srqc.cqn.get(), 0);
    assert_eq!(srqc.limit.get(), 0);
    assert_eq!(
        (
            srqc.ring.log_entries,
            srqc.ring.log_stride,
            srqc.ring.log_page_size
        ),
        (7, 6, 12)
    );
    assert!(srqc.ring.mtt_index.get() >= report.reserved_mtt_entries);
    assert_ne!(srqc.dbr.get(), 0);
    assert_eq!(srqc.consumer.get(), 0);
    assert_eq!(query_srq(&w, srq), srq_attr(128, 3, 0));

    // Arm the limit: the device's context has it, and so does the query.
    let arm = SrqModify {
        max_wr: None,
        srq_limit: Some(16),
    };
    let done = w.call_in_dpc::<ModifySrq>(KERNEL, srq, &arm, 0);
    assert_eq!(status_of::<ModifySrq>(&done), IbStatus::Success);
    assert_eq!(query_srqc(&w, srqn).limit.get(), 16);
    assert_eq!(query_srq(&w, srq), srq_attr(128, 3, 16));
    // No resize in the PRM; a limit above the depth; both change nothing.
    let resize = SrqModify {
        max_wr: Some(256),
        srq_limit: None,
    };
    let done = w.call_in_dpc::<ModifySrq>(KERNEL, srq, &resize, 0);
    assert_eq!(status_of::<ModifySrq>(&done), IbStatus::Unsupported);
    let too_high = SrqModify {
        max_wr: None,
        srq_limit: Some(129),
    };
    let done = w.call_in_dpc::<ModifySrq>(KERNEL, srq, &too_high, 0);
    assert_eq!(status_of::<ModifySrq>(&done), IbStatus::InvalidParameter);
    assert_eq!(query_srq(&w, srq), srq_attr(128, 3, 16));
    // Disarm.
    let disarm = SrqModify {
        max_wr: None,
        srq_limit: Some(0),
    };
    let done = w.call_in_dpc::<ModifySrq>(KERNEL, srq, &disarm, 0);
    assert_eq!(status_of::<ModifySrq>(&done), IbStatus::Success);
    assert_eq!(query_srqc(&w, srqn).limit.get(), 0);

    // Sizes the device cannot give: clear statuses, nothing created.
    let max = 1u32 << cap.log_max_srq_wqes.min(16);
    let sge = u32::from(cap.max_recv_sges);
    for (attr, expected) in [
        (srq_attr(max + 1, 1, 0), IbStatus::InvalidSrqSize),
        (srq_attr(8, sge + 1, 0), IbStatus::InvalidMaxSge),
    ] {
        assert_eq!(create_srq(&w, ca, pd, attr), (expected, 0, None));
    }
    // A stale PD, a user request.
    assert_eq!(
        create_srq(&w, ca, pd ^ (1 << 40), srq_attr(8, 1, 0)).0,
        IbStatus::InvalidPdHandle
    );
    let create = SrqCreate {
        pd: PdHandle::from_raw(pd),
        attr: srq_attr(8, 1, 0),
    };
    let done = w.call::<CreateSrq>(USER, ca, &create, 0);
    assert_eq!(status_of::<CreateSrq>(&done), IbStatus::InvalidCaHandle);
    // The largest SRQ, with a limit at its depth.
    let (status, big, out) = create_srq(&w, ca, pd, srq_attr(max, sge, max));
    assert_eq!(
        (status, out),
        (IbStatus::Success, Some(srq_attr(max, sge, max)))
    );
    assert_eq!(query_srqc(&w, support::number_of(big)).limit.get(), max);

    // A PD with SRQs cannot be deallocated; a referenced SRQ not destroyed.
    let done = w.call_in_dpc::<DeallocPd>(KERNEL, pd, &Empty, 0);
    assert_eq!(status_of::<DeallocPd>(&done), IbStatus::ResourceBusy);
    assert_eq!(w.hca().reference_srq(srq), Ok(1));
    let done = w.call_in_dpc::<DestroySrq>(KERNEL, srq, &Empty, 0);
    assert_eq!(status_of::<DestroySrq>(&done), IbStatus::ResourceBusy);
    assert_eq!(query_srqc(&w, srqn).state, SrqState::Ready.code());
    assert_eq!(w.hca().release_srq(srq), Ok(0));
    for handle in [srq, big] {
        let done = w.call_in_dpc::<DestroySrq>(KERNEL, handle, &Empty, 0);
        assert_eq!(status_of::<DestroySrq>(&done), IbStatus::Success);
    }
    assert!(command(&w, Command::new(Opcode::QuerySrq, srqn).with_output(64)).is_err());
    for status in [
        status_of::<DestroySrq>(&w.call::<DestroySrq>(KERNEL, srq, &Empty, 0)),
        status_of::<QuerySrq>(&w.call::<QuerySrq>(KERNEL, srq, &Empty, 0)),
        status_of::<ModifySrq>(&w.call::<ModifySrq>(KERNEL, srq, &arm, 0)),
    ] {
        assert_eq!(status, IbStatus::InvalidSrqHandle);
    }
    assert_eq!(w.hca().reference_srq(srq), Err(IbStatus::InvalidSrqHandle));
    assert_eq!(
        w.hca().post_srq_recv(srq, &[]),
        (0, IbStatus::InvalidSrqHandle)
    );
    let done = w.call_in_dpc::<DeallocPd>(KERNEL, pd, &Empty, 0);
    assert_eq!(status_of::<DeallocPd>(&done), IbStatus::Success);
    let done = w.call::<CloseCa>(KERNEL, ca, &Empty, 0);
    assert_eq!(status_of::<CloseCa>(&done), IbStatus::Success);
    w.finish();
}

#[test]
fn post_srq_recv_fills_to_capacity_and_a_failing_wr_leaves_earlier_ones_posted() {
    let w = World::deterministic(42);
    let (ca, pd) = open_with_pd(&w);
    let (status, srq, out) = create_srq(&w, ca, pd, srq_attr(8, 1, 0));
    assert_eq!((status, out), (IbStatus::Success, Some(srq_attr(8, 1, 0))));
    let results = Arc::new(Mutex::new(Vec::new()));
    {
        let (hca, results) = (w.hca(), results.clone());
        w.in_dpc(move || {
            assert_eq!(sim_host::irql::current(), Irql::DISPATCH);
            let one = [Sge::new(0x1000, 64, LKey::new(0x100))];
            let two = [one[0], one[0]];
            let wr = |wr_id: u64| RecvWr {
                wr_id,
                sg_list: &one,
            };
            let mut r = lock(&results);
            // Five, then a batch whose third WR has too many SGEs.
            r.push(hca.post_srq_recv(srq, &[wr(1), wr(2), wr(3), wr(4), wr(5)]));
            let bad = RecvWr {
                wr_id: 99,
                sg_list: &two,
            };
            r.push(hca.post_srq_recv(srq, &[wr(6), wr(7), bad, wr(8)]));
            // One slot left: the second WR finds the queue full.
            r.push(hca.post_srq_recv(srq, &[wr(8), wr(9)]));
            r.push(hca.post_srq_recv(srq, &[wr(10)]));
            r.push(hca.post_srq_recv(srq, &[]));
        });
    }
    w.settle();
    assert_eq!(
        *lock(&results),
        vec![
            (5, IbStatus::Success),
            (2, IbStatus::InvalidMaxSge),
            (1, IbStatus::InsufficientResources),
            (0, IbStatus::InsufficientResources),
            (0, IbStatus::Success),
        ]
    );
    // The device saw none of them taken; the SRQ still destroys cleanly.
    assert_eq!(query_srqc(&w, support::number_of(srq)).consumer.get(), 0);
    let done = w.call_in_dpc::<DestroySrq>(KERNEL, srq, &Empty, 0);
    assert_eq!(status_of::<DestroySrq>(&done), IbStatus::Success);
    let done = w.call::<DeallocPd>(KERNEL, pd, &Empty, 0);
    assert_eq!(status_of::<DeallocPd>(&done), IbStatus::Success);
    w.finish();
}

/// A client that records its asynchronous events and the IRQL they came at.
#[derive(Default)]
struct Client {
    events: Mutex<Vec<(AsyncEventRecord, Irql)>>,
}

impl CaClient for Client {
    fn completion(&self, _: CqHandle) {}
    fn async_event(&self, event: &AsyncEventRecord) {
        lock(&self.events).push((*event, sim_host::irql::current()));
    }
}

/// A UD QP built with raw commands (QPs are not verbs of the core yet)
/// that receives from an SRQ; its send ring uses MTT entry `mtt`, which
/// the core's allocator does not reach in these tests.
struct RawUdQp {
    qpn: u32,
    sq: sim_host::dma::HostCommonBuffer,
    sq_producer: u32,
}

impl RawUdQp {
    const QKEY: u32 = 0x1111;

    fn create(w: &World, qpn: u32, port: u8, pd: u32, cqn: u32, srqn: u32, mtt: u64) -> Self {
        use driver_platform::{CommonBuffer, DmaAdapter};
        use hca_prm::ctx::{BufDesc, ModifyQp, Qpc, QpcFlags};
        use ib_types::qp::{QpModify, QpState, QpType};
        use ib_types::scalars::{Psn, QKey};
        use zerocopy::FromZeros;
        let sq = w.adapter().alloc_common(4096).unwrap();
        let mut mailbox = mtt.to_le_bytes().to_vec();
        mailbox.extend_from_slice(&sq.bus_address().to_le_bytes());
        command(w, Command::new(Opcode::WriteMtt, 0).with_mailbox(mailbox)).unwrap();
        let mut qpc = Qpc::new_zeroed();
        qpc.qp_type = QpType::Ud.code();
        qpc.port = port;
        qpc.flags = QpcFlags::HAS_SRQ.bits();
        qpc.pd = hca_prm::Le32::new(pd);
        qpc.send_cqn = hca_prm::Le32::new(cqn);
        qpc.recv_cqn = hca_prm::Le32::new(cqn);
        qpc.srqn = hca_prm::Le32::new(srqn);
        qpc.sq = BufDesc {
            mtt_index: hca_prm::Le32::new(mtt as u32),
            log_page_size: 12,
            log_entries: 6,
            log_stride: 6,
            ..BufDesc::default()
        };
        command(
            w,
            Command::new(Opcode::Sw2HwQp, qpn).with_mailbox(qpc.as_bytes().to_vec()),
        )
        .unwrap();
        let steps = [
            QpModify {
                state: Some(QpState::Init),
                pkey_index: Some(0),
                port: Some(PortNum::new(port).unwrap()),
                qkey: Some(QKey::new(Self::QKEY)),
                ..QpModify::default()
            },
            QpModify::to_state(QpState::Rtr),
            QpModify {
                state: Some(QpState::Rts),
                sq_psn: Some(Psn::new(0).unwrap()),
                ..QpModify::default()
            },
        ];
        for m in steps {
            let mut input = ModifyQp::new_zeroed();
            input.attr_mask = hca_prm::Le32::new(m.mask().bits());
            input.next_state = m.state.map_or(0, QpState::code);
            input.qpc.port = port;
            input.qpc.qkey = hca_prm::Le32::new(Self::QKEY);
            command(
                w,
                Command::new(Opcode::ModifyQp, qpn).with_mailbox(input.as_bytes().to_vec()),
            )
            .unwrap();
        }
        RawUdQp {
            qpn,
            sq,
            sq_producer: 0,
        }
    }

    /// Sends an empty datagram to `dest_ip`'s QP `dest_qpn` and rings the
    /// send doorbell.
    fn send_to(&mut self, w: &World, port: u8, dest_ip: [u8; 4], dest_qpn: u32) {
        use driver_platform::{CommonBuffer, Mmio};
        use hca_prm::doorbell::{SQ_DOORBELL, SqDoorbell, uar_offset};
        use ib_types::handle::AvHandle;
        use ib_types::scalars::{QKey, Qpn};
        use ib_types::wr::{SendFlags, SendOp, SendWr, UdDest};
        let attr = AvAttr::roce(PortNum::new(port).unwrap(), Gid::from_ipv4(dest_ip), 0);
        let av = hca_prm::av::Av::try_from(&attr).unwrap();
        let wr = SendWr {
            wr_id: 1,
            op: SendOp::Send,
            flags: SendFlags::SIGNALED,
            sg_list: &[],
            ud: Some(UdDest {
                av: AvHandle::from_raw(1),
                remote_qpn: Qpn::new(dest_qpn).unwrap(),
                remote_qkey: QKey::new(Self::QKEY),
            }),
        };
        let mut scratch = [0u8; 512];
        let index = self.sq_producer as u16;
        let len = hca_prm::wqe::build_send_wqe(&wr, Some(&av), index, None, &mut scratch).unwrap();
        let bbs = len.div_ceil(64) as u32;
        for i in 0..bbs {
            let slot = (self.sq_producer.wrapping_add(i) & 63) as usize * 64;
            let bb = &scratch[i as usize * 64..(i as usize + 1) * 64];
            assert!(self.sq.write(slot, bb));
        }
        self.sq_producer = self.sq_producer.wrapping_add(bbs);
        let doorbell = SqDoorbell {
            qpn: Qpn::from_low_bits(self.qpn),
            producer: self.sq_producer,
        };
        w.function()
            .bar0()
            .write64(uar_offset(0) + SQ_DOORBELL, doorbell.encode());
        w.settle();
    }

    fn destroy(self, w: &World) {
        command(w, Command::new(Opcode::Hw2SwQp, self.qpn)).unwrap();
        w.adapter().free_common(self.sq);
    }
}

#[test]
fn the_srq_limit_event_reaches_the_client_from_the_dpc() {
    let w = World::deterministic(43);
    let client = Arc::new(Client::default());
    let hca = w.hca();
    let ca = hca.open_ca(Some(client.clone())).unwrap();
    let done = w.call_in_dpc::<AllocPd>(KERNEL, ca, &Empty, 0);
    let pd = response::<AllocPd>(&done).handle;
    let cq_attr = CqAttr {
        cqe: 16,
        comp_vector: 0,
    };
    let done = w.call_in_dpc::<CreateCq>(KERNEL, ca, &cq_attr, 0);
    let cq = response::<CreateCq>(&done).handle;
    let (status, srq, _) = create_srq(&w, ca, pd, srq_attr(4, 1, 0));
    assert_eq!(status, IbStatus::Success);
    let srqn = support::number_of(srq);

    // Four receives posted (one 64-byte buffer each, under a key no region
    // has), then the limit armed at four.
    let sge = [Sge::new(0x10_0000, 64, LKey::new(0x4242))];
    let wrs: Vec<RecvWr<'_>> = (0..4)
        .map(|i| RecvWr {
            wr_id: 100 + i,
            sg_list: &sge,
        })
        .collect();
    assert_eq!(hca.post_srq_recv(srq, &wrs), (4, IbStatus::Success));
    let arm = SrqModify {
        max_wr: None,
        srq_limit: Some(4),
    };
    let done = w.call_in_dpc::<ModifySrq>(KERNEL, srq, &arm, 0);
    assert_eq!(status_of::<ModifySrq>(&done), IbStatus::Success);
    assert!(lock(&client.events).is_empty());

    // A datagram from port 2 to a QP on port 1 that receives from the SRQ:
    // the device takes one WQE, three are left, below the limit.
    let report = hca.report().unwrap();
    let top = (1u64 << report.table(hca_prm::cmd::Table::Mtt).log_count) - 2;
    let receiver = RawUdQp::create(
        &w,
        4,
        1,
        support::number_of(pd),
        support::number_of(cq),
        srqn,
        top,
    );
    let mut sender = RawUdQp::create(
        &w,
        5,
        2,
        support::number_of(pd),
        support::number_of(cq),
        srqn,
        top + 1,
    );
    for _ in 0..2 {
        assert_eq!(hca.reference_srq(srq).map(|n| n > 0), Ok(true));
    }
    sender.send_to(&w, 2, [10, 0, 0, 1], receiver.qpn);
    assert_eq!(query_srqc(&w, srqn).consumer.get(), 1);
    // The device parsed the WQE's data segment: its key names no region,
    // so the receive completes with a protection error (the send itself
    // succeeded). The receiver is a raw QP the core does not know, so
    // the poll path finds no QP (and no SRQ) for it: `wr_id` stays 0.
    let mut wcs = [WorkCompletion::EMPTY; 4];
    assert_eq!(hca.poll_cq(cq, &mut wcs), Ok(2));
    let summary: Vec<_> = wcs[..2]
        .iter()
        .map(|wc| (wc.qp_num.get(), wc.status, wc.opcode))
        .collect();
    assert_eq!(
        summary,
        vec![
            (5, WcStatus::Success, WcOpcode::Send),
            (4, WcStatus::LocProtErr, WcOpcode::Recv),
        ]
    );
    assert_eq!(wcs[1].src_qp.get(), 5);
    // The taken WQE's slot stays held until the CQ poll path hands its
    // wr_id back (the device stores none), which it does only for the
    // core's own QPs: the SRQ is still full.
    let one_more = [RecvWr {
        wr_id: 104,
        sg_list: &[],
    }];
    assert_eq!(
        hca.post_srq_recv(srq, &one_more),
        (0, IbStatus::InsufficientResources)
    );

    // One event, at DISPATCH_LEVEL, with the SRQ's handle; the limit is
    // one-shot, so the device and the query now say 0.
    let events = lock(&client.events).clone();
    let record = AsyncEventRecord::new(AsyncEventCode::SrqLimitReached, srq, None, 0).unwrap();
    assert_eq!(events, vec![(record, Irql::DISPATCH)]);
    assert_eq!(query_srq(&w, srq).srq_limit, 0);

    // Busy while the QPs use it; destroyed after.
    let done = w.call_in_dpc::<DestroySrq>(KERNEL, srq, &Empty, 0);
    assert_eq!(status_of::<DestroySrq>(&done), IbStatus::ResourceBusy);
    receiver.destroy(&w);
    sender.destroy(&w);
    for _ in 0..2 {
        hca.release_srq(srq).unwrap();
    }
    let done = w.call_in_dpc::<DestroySrq>(KERNEL, srq, &Empty, 0);
    assert_eq!(status_of::<DestroySrq>(&done), IbStatus::Success);
    let done = w.call::<DestroyCq>(KERNEL, cq, &Empty, 0);
    assert_eq!(status_of::<DestroyCq>(&done), IbStatus::Success);
    let done = w.call::<DeallocPd>(KERNEL, pd, &Empty, 0);
    assert_eq!(status_of::<DeallocPd>(&done), IbStatus::Success);
    assert_eq!(hca.close_ca(ca), Ok(()));
    w.finish();
}
