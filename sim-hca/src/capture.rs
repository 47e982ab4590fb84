//! A scripted traffic mix written to a pcap capture (`cargo xtask capture`).
//!
//! Two simulated HCAs on the deterministic cluster exchange every operation
//! each transport supports — RC: send (+immediate, +invalidate), RDMA write
//! (+immediate), RDMA read, compare-swap, fetch-add, memory window bind and
//! local invalidate; UC: send and write (+immediate); UD: send
//! (+immediate) — with multi-packet messages, a retransmission (a link flap
//! loses packets in flight), an RNR NAK (a send before its receive is posted)
//! and a remote access error NAK (a write with a wrong R_Key). Every frame is
//! recorded once, when it is transmitted.
//!
//! The mix also checks what it did: every expected completion arrived with
//! the expected status, and the data landed.

use std::io::Write;

use hca_prm::cmd::CmdStatus;
use hca_prm::cqe::Cqe;
use hca_prm::mpt::MptKind;
use hca_prm::wqe::WqeOpcode;
use ib_types::abi::Be32;
use ib_types::access::AccessFlags;
use ib_types::av::AvAttr;
use ib_types::handle::{AvHandle, MwHandle};
use ib_types::qp::QpType;
use ib_types::scalars::{Gid, Mtu, PortNum, QKey, Qpn};
use ib_types::wc::WcStatus;
use ib_types::wr::{MwBind, RKey, RemoteAddr, SendFlags, SendOp, SendWr, Sge, UdDest};

use crate::cluster::{CaptureDirections, Cluster, NodeId};
use crate::fabric::FabricConfig;
use crate::testkit::{Cq, Driver, Mr, Qp, bring_up};

/// What the mix did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MixReport {
    /// Frames captured.
    pub frames: u64,
    /// Work completions checked.
    pub completions: usize,
}

/// Why the mix failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MixError {
    /// A step did not behave as scripted.
    #[error("step `{step}`: {what}")]
    Step {
        /// The step.
        step: &'static str,
        /// What went wrong.
        what: String,
    },
    /// Writing the capture failed.
    #[error("capture: {0}")]
    Capture(String),
}

fn fail(step: &'static str, what: impl Into<String>) -> MixError {
    MixError::Step {
        step,
        what: what.into(),
    }
}

const PD: u32 = 1;
const IP: [[u8; 4]; 2] = [[10, 0, 0, 1], [10, 0, 0, 2]];
const UD_QKEY: u32 = 0x0000_1111;

struct Side {
    id: NodeId,
    drv: Driver,
    cq: Cq,
    mr: Mr,
}

struct World {
    cluster: Cluster,
    a: Side,
    b: Side,
}

impl World {
    fn settle(&mut self, step: &'static str) -> Result<(), MixError> {
        self.cluster
            .run_until_idle(1_000_000)
            .map(|_| ())
            .map_err(|e| fail(step, e.to_string()))
    }

    /// Creates a QP on each side of `qp_type` and brings both to RTS.
    fn qp_pair(&mut self, qp_type: QpType, mtu: Mtu) -> Result<(Qp, Qp), MixError> {
        let mut qps = Vec::new();
        for side in [&mut self.a, &mut self.b] {
            let dev = self.cluster.device(side.id);
            let qp = side
                .drv
                .create_qp(dev, qp_type, 1, PD, &side.cq, &side.cq, None, (7, 7))
                .map_err(|s| fail("create QP", format!("{s:?}")))?;
            qps.push(qp);
        }
        let qpns = [qps[0].qpn, qps[1].qpn];
        let access =
            AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC;
        let access = if qp_type == QpType::Uc {
            AccessFlags::REMOTE_WRITE
        } else {
            access
        };
        for (i, side) in [&mut self.a, &mut self.b].into_iter().enumerate() {
            let dev = self.cluster.device(side.id);
            let peer = 1 - i;
            let steps = [
                bring_up::to_init(qp_type, access, UD_QKEY),
                bring_up::to_rtr(qp_type, IP[peer], qpns[peer], 0, mtu),
                bring_up::to_rts(qp_type, 0, 8, 7, 7),
            ];
            for m in &steps {
                let status = side.drv.modify_qp(dev, &qps[i], m);
                if status != CmdStatus::Ok {
                    return Err(fail("bring up QP", format!("{qp_type:?}: {status:?}")));
                }
            }
        }
        let b = qps.pop().expect("two QPs");
        let a = qps.pop().expect("two QPs");
        Ok((a, b))
    }

    fn post(
        &mut self,
        on_a: bool,
        qp: &mut Qp,
        wr: &SendWr<'_>,
        ud: Option<&hca_prm::av::Av>,
    ) -> Result<(), MixError> {
        let side = if on_a { &mut self.a } else { &mut self.b };
        let dev = self.cluster.device(side.id);
        side.drv
            .post_send(dev, qp, wr, ud, None, true)
            .map_err(|e| fail("post send", e.to_string()))
    }

    fn completions(&mut self, on_a: bool) -> Vec<Cqe> {
        let side = if on_a { &mut self.a } else { &mut self.b };
        side.drv.drain_cq(&mut side.cq)
    }
}

fn wr<'a>(wr_id: u64, op: SendOp, sg: &'a [Sge]) -> SendWr<'a> {
    SendWr {
        wr_id,
        op,
        flags: SendFlags::SIGNALED,
        sg_list: sg,
        ud: None,
    }
}

/// Expects exactly these (opcode, status) completions, in order.
fn expect(step: &'static str, got: &[Cqe], want: &[(u8, WcStatus)]) -> Result<usize, MixError> {
    let got_pairs: Vec<(u8, u8)> = got.iter().map(|c| (c.opcode, c.status)).collect();
    let want_pairs: Vec<(u8, u8)> = want.iter().map(|&(o, s)| (o, s.code())).collect();
    if got_pairs != want_pairs {
        return Err(fail(
            step,
            format!("completions {got_pairs:?}, expected {want_pairs:?}"),
        ));
    }
    Ok(got.len())
}

/// Runs the mix and writes its capture to `out`.
pub fn scripted_mix<W: Write + Send + 'static>(
    out: W,
    seed: u64,
) -> Result<(MixReport, W), MixError> {
    let (mut cluster, a_id, b_id) = Cluster::pair_with(FabricConfig::default(), seed);
    cluster
        .capture_to(out, CaptureDirections::Transmitted)
        .map_err(|e| MixError::Capture(e.to_string()))?;
    let mut sides = Vec::new();
    for id in [a_id, b_id] {
        let mem = cluster.memory(id);
        let dev = cluster.device(id);
        let mut drv = Driver::bring_up(dev, mem);
        let cq = drv
            .create_cq(dev, 8)
            .map_err(|s| fail("create CQ", format!("{s:?}")))?;
        let rights = AccessFlags::LOCAL_WRITE
            | AccessFlags::REMOTE_READ
            | AccessFlags::REMOTE_WRITE
            | AccessFlags::REMOTE_ATOMIC
            | AccessFlags::MW_BIND;
        let mr = drv
            .reg_mr(dev, 64 * 1024, PD, rights)
            .map_err(|s| fail("register", format!("{s:?}")))?;
        sides.push(Side { id, drv, cq, mr });
    }
    let b = sides.pop().expect("two sides");
    let a = sides.pop().expect("two sides");
    let mut w = World { cluster, a, b };
    let mut checked = 0usize;
    let rc = QpType::Rc;
    use WcStatus::Success as Ok_;
    use WqeOpcode as O;

    // ----- RC: every operation, multi-packet at MTU 1024. -----
    let (mut qa, mut qb) = w.qp_pair(rc, Mtu::Mtu1024)?;
    let pattern: Vec<u8> = (0..6000u32).map(|i| (i % 253) as u8).collect();
    w.a.drv.write_mr(&w.a.mr, 0, &pattern);
    for i in 0..3 {
        let sge = Driver::sge(&w.b.mr, 8192 * i, 8192);
        w.b.drv.post_recv(&mut qb, i, &[sge]);
    }
    let big = [Driver::sge(&w.a.mr, 0, 5000)];
    let small = [Driver::sge(&w.a.mr, 0, 64)];
    w.post(true, &mut qa, &wr(1, SendOp::Send, &big), None)?;
    w.post(
        true,
        &mut qa,
        &wr(
            2,
            SendOp::SendWithImm {
                imm: Be32::new(0x1234_5678),
            },
            &small,
        ),
        None,
    )?;
    let remote = |off: u64, mr: &Mr| RemoteAddr {
        addr: mr.va + off,
        rkey: mr.rkey,
    };
    let b_mr = w.b.mr;
    w.post(
        true,
        &mut qa,
        &wr(
            3,
            SendOp::RdmaWrite {
                remote: remote(32768, &b_mr),
            },
            &big,
        ),
        None,
    )?;
    w.post(
        true,
        &mut qa,
        &wr(
            4,
            SendOp::RdmaWriteWithImm {
                remote: remote(40000, &b_mr),
                imm: Be32::new(7),
            },
            &small,
        ),
        None,
    )?;
    let read_into = [Driver::sge(&w.a.mr, 16384, 5000)];
    w.post(
        true,
        &mut qa,
        &wr(
            5,
            SendOp::RdmaRead {
                remote: remote(32768, &b_mr),
            },
            &read_into,
        ),
        None,
    )?;
    w.b.drv.write_mr(&w.b.mr, 60000, &10u64.to_le_bytes());
    let word = [Driver::sge(&w.a.mr, 30000, 8)];
    w.post(
        true,
        &mut qa,
        &wr(
            6,
            SendOp::FetchAdd {
                remote: remote(60000, &b_mr),
                add: 5,
            },
            &word,
        ),
        None,
    )?;
    w.post(
        true,
        &mut qa,
        &wr(
            7,
            SendOp::CompareSwap {
                remote: remote(60000, &b_mr),
                compare: 15,
                swap: 100,
            },
            &word,
        ),
        None,
    )?;
    w.settle("RC operations")?;
    let got = w.completions(true);
    checked += expect(
        "RC operations (requester)",
        &got,
        &[
            (O::Send.code(), Ok_),
            (O::SendImm.code(), Ok_),
            (O::RdmaWrite.code(), Ok_),
            (O::RdmaWriteImm.code(), Ok_),
            (O::RdmaRead.code(), Ok_),
            (O::AtomicFa.code(), Ok_),
            (O::AtomicCs.code(), Ok_),
        ],
    )?;
    if w.a.drv.read_mr(&w.a.mr, 16384, 5000) != pattern[..5000] {
        return Err(fail("RC read", "read-back data differs"));
    }
    if w.b.drv.read_mr(&w.b.mr, 60000, 8) != 100u64.to_le_bytes() {
        return Err(fail("RC atomics", "the remote word is not 100"));
    }
    checked += w.completions(false).len();

    // Memory window: A's QP binds a type 2 window over B? Windows are local:
    // B binds a window over its region, A writes through it, B invalidates
    // it with a SEND WITH INVALIDATE from A.
    let mw_index = {
        let dev = w.cluster.device(w.b.id);
        w.b.drv
            .alloc_mw(dev, PD, MptKind::WindowType2)
            .map_err(|s| fail("alloc MW", format!("{s:?}")))?
    };
    let window_key = RKey::new(mw_index << 8 | 0x42);
    let bind = SendOp::BindMw {
        mw: MwHandle::from_raw(u64::from(mw_index)),
        rkey: window_key,
        bind: MwBind {
            mr_lkey: w.b.mr.lkey,
            addr: w.b.mr.va + 4096,
            length: 4096,
            access: AccessFlags::REMOTE_WRITE,
        },
    };
    w.post(false, &mut qb, &wr(8, bind, &[]), None)?;
    w.settle("bind MW")?;
    checked += expect("bind MW", &w.completions(false), &[(O::BindMw.code(), Ok_)])?;
    let via_window = RemoteAddr {
        addr: w.b.mr.va + 4096,
        rkey: window_key,
    };
    w.post(
        true,
        &mut qa,
        &wr(9, SendOp::RdmaWrite { remote: via_window }, &small),
        None,
    )?;
    let sge = Driver::sge(&w.b.mr, 0, 64);
    w.b.drv.post_recv(&mut qb, 10, &[sge]);
    w.post(
        true,
        &mut qa,
        &wr(10, SendOp::SendWithInvalidate { rkey: window_key }, &small),
        None,
    )?;
    w.settle("write through the window, send with invalidate")?;
    checked += expect(
        "window",
        &w.completions(true),
        &[(O::RdmaWrite.code(), Ok_), (O::SendInv.code(), Ok_)],
    )?;
    checked += w.completions(false).len();
    // B binds it again and invalidates it locally.
    let window_key2 = RKey::new(mw_index << 8 | 0x43);
    let bind2 = SendOp::BindMw {
        mw: MwHandle::from_raw(u64::from(mw_index)),
        rkey: window_key2,
        bind: MwBind {
            mr_lkey: w.b.mr.lkey,
            addr: w.b.mr.va,
            length: 128,
            access: AccessFlags::REMOTE_READ,
        },
    };
    w.post(false, &mut qb, &wr(11, bind2, &[]), None)?;
    w.post(
        false,
        &mut qb,
        &wr(12, SendOp::LocalInvalidate { rkey: window_key2 }, &[]),
        None,
    )?;
    w.settle("bind and local invalidate")?;
    checked += expect(
        "local invalidate",
        &w.completions(false),
        &[(O::BindMw.code(), Ok_), (O::LocalInv.code(), Ok_)],
    )?;

    // RNR NAK: a send with no receive posted, then the receive.
    w.post(true, &mut qa, &wr(13, SendOp::Send, &small), None)?;
    // RNR retries are unlimited (7): the QP keeps trying until a receive is
    // posted, so run for a while rather than until idle.
    w.cluster
        .run_for(1_000_000)
        .map_err(|e| fail("RNR NAK", e.to_string()))?;
    if !w.completions(true).is_empty() {
        return Err(fail("RNR NAK", "the send completed without a receive"));
    }
    let sge = Driver::sge(&w.b.mr, 0, 64);
    w.b.drv.post_recv(&mut qb, 13, &[sge]);
    w.cluster
        .run_for(50_000_000)
        .map_err(|e| fail("RNR retry", e.to_string()))?;
    w.settle("RNR retry")?;
    checked += expect("RNR retry", &w.completions(true), &[(O::Send.code(), Ok_)])?;
    checked += w.completions(false).len();

    // Retransmission: the link drops the packets in flight.
    let sge = Driver::sge(&w.b.mr, 0, 8192);
    w.b.drv.post_recv(&mut qb, 14, &[sge]);
    w.post(true, &mut qa, &wr(14, SendOp::Send, &big), None)?;
    w.cluster
        .set_link(w.b.id, 1, false)
        .map_err(|e| fail("link down", e.to_string()))?;
    w.cluster
        .run_for(1_000)
        .map_err(|e| fail("link down", e.to_string()))?;
    w.cluster
        .set_link(w.b.id, 1, true)
        .map_err(|e| fail("link up", e.to_string()))?;
    w.cluster
        .run_for(100_000_000)
        .map_err(|e| fail("retransmission", e.to_string()))?;
    w.settle("retransmission")?;
    checked += expect(
        "retransmission",
        &w.completions(true),
        &[(O::Send.code(), Ok_)],
    )?;
    checked += w.completions(false).len();

    // Remote access error NAK: a write with a wrong R_Key.
    let bad = RemoteAddr {
        addr: w.b.mr.va,
        rkey: RKey::new(w.b.mr.rkey.get() ^ 0x01),
    };
    w.post(
        true,
        &mut qa,
        &wr(15, SendOp::RdmaWrite { remote: bad }, &small),
        None,
    )?;
    w.settle("remote access error")?;
    checked += expect(
        "remote access error",
        &w.completions(true),
        &[(O::RdmaWrite.code(), WcStatus::RemAccessErr)],
    )?;

    // ----- UC: send and write (+immediate), multi-packet. -----
    let (mut ua, mut ub) = w.qp_pair(QpType::Uc, Mtu::Mtu1024)?;
    for i in 0..2 {
        let sge = Driver::sge(&w.b.mr, 8192 * i, 8192);
        w.b.drv.post_recv(&mut ub, 20 + i, &[sge]);
    }
    w.post(true, &mut ua, &wr(20, SendOp::Send, &big), None)?;
    w.post(
        true,
        &mut ua,
        &wr(
            21,
            SendOp::RdmaWrite {
                remote: remote(32768, &b_mr),
            },
            &big,
        ),
        None,
    )?;
    w.post(
        true,
        &mut ua,
        &wr(
            22,
            SendOp::RdmaWriteWithImm {
                remote: remote(40000, &b_mr),
                imm: Be32::new(9),
            },
            &small,
        ),
        None,
    )?;
    w.settle("UC")?;
    checked += expect(
        "UC",
        &w.completions(true),
        &[
            (O::Send.code(), Ok_),
            (O::RdmaWrite.code(), Ok_),
            (O::RdmaWriteImm.code(), Ok_),
        ],
    )?;
    let recvd = w.completions(false);
    if recvd.len() != 2 {
        return Err(fail(
            "UC",
            format!("{} receive completions, expected 2", recvd.len()),
        ));
    }
    checked += recvd.len();

    // ----- UD: send (+immediate). -----
    let (mut da, mut db) = w.qp_pair(QpType::Ud, Mtu::Mtu1024)?;
    let sge = Driver::sge(&w.b.mr, 0, 2048);
    w.b.drv.post_recv(&mut db, 30, &[sge]);
    let sge = Driver::sge(&w.b.mr, 2048, 2048);
    w.b.drv.post_recv(&mut db, 31, &[sge]);
    let av = hca_prm::av::Av::try_from(&AvAttr::roce(PortNum::FIRST, Gid::from_ipv4(IP[1]), 0))
        .map_err(|e| fail("UD AV", e.to_string()))?;
    let dest = UdDest {
        av: AvHandle::from_raw(1),
        remote_qpn: Qpn::from_low_bits(db.qpn),
        remote_qkey: QKey::new(UD_QKEY),
    };
    let mut ud_wr = wr(30, SendOp::Send, &small);
    ud_wr.ud = Some(dest);
    w.post(true, &mut da, &ud_wr, Some(&av))?;
    let mut ud_wr = wr(31, SendOp::SendWithImm { imm: Be32::new(3) }, &small);
    ud_wr.ud = Some(dest);
    w.post(true, &mut da, &ud_wr, Some(&av))?;
    w.settle("UD")?;
    checked += expect(
        "UD",
        &w.completions(true),
        &[(O::Send.code(), Ok_), (O::SendImm.code(), Ok_)],
    )?;
    checked += expect(
        "UD receive",
        &w.completions(false),
        &[(0x01, Ok_), (0x02, Ok_)],
    )?;

    let frames = w.cluster.fabric().total_counters().tx_frames;
    let out = w
        .cluster
        .finish_capture::<W>()
        .map_err(|e| MixError::Capture(e.to_string()))?;
    Ok((
        MixReport {
            frames,
            completions: checked,
        },
        out,
    ))
}
