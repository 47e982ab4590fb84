//! Scenario: the rest of the access library's safe API (`ibal-user`) on
//! the simulated host, through the real IBAL bus filter's proxy over the
//! real miniport, two HCAs with two ports each, every verb through the
//! linked plugin's hooks: SRQs (QPs receiving from one, its limit event),
//! CQ resize with completions outstanding, memory windows bound by a work
//! request and used by a peer's RDMA, RDMA read and atomics, multicast
//! groups, and the queries. Data is checked byte for byte; every test ends
//! with nothing left open (proxy objects, user contexts, handles, locked
//! pages, mappings), the host shut down and the verifier report empty.
#![cfg(not(windows))]

use std::sync::Arc;

use ib_types::access::AccessFlags;
use ib_types::av::{AvAttr, Grh};

use ib_types::event::AsyncEventCode;
use ib_types::ioctl::VerbId;
use ib_types::ioctl::{self as v, Verb};
use ib_types::mcast::McastGroup;
use ib_types::mr::MwType;
use ib_types::qp::{QpCaps, QpModify, QpState, QpType};
use ib_types::scalars::{Gid, Lid, PortNum, PortState, Psn, QKey, Qpn};
use ib_types::srq::SrqAttr;
use ib_types::status::IbStatus;
use ib_types::wc::{WcStatus, WorkCompletion};
use ib_types::wr::{RKey, RecvWr, RemoteAddr, SendFlags, SendOp, SendWr, Sge, UdDest};
use ibal_user::{
    Av, Buffer, CaSelector, Context, Cq, DeviceFile, DeviceIo, DevicePath, Error, Mr, Mw, OsStatus,
    Pd, PluginSource, Qp, QpInit, Srq, UserSend,
};
use sim_host::memory::Process;
use sim_shells::rc_path::rc_to_rts_steps;
use sim_shells::user_io::{SimIo, settle};

#[path = "support/user_world.rs"]
mod user_world;
use user_world::{HCAS, UserWorld as World};
/// Bytes of the GRH a UD receive starts with.
const GRH: usize = 40;
const QKEY: u32 = 0x1111;

/// Deterministic, non-trivial bytes.
fn pattern(seed: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u32)
                .wrapping_mul(31)
                .wrapping_add(seed.wrapping_mul(17))
                .wrapping_add(3) as u8
        })
        .collect()
}

/// The IP of port 1 of the HCA at `at`.
fn ip(at: u8) -> [u8; 4] {
    [10, 2, at, 1]
}

/// An address vector out of port 1 to `dgid`.
fn av_to(dgid: Gid) -> AvAttr {
    AvAttr {
        port: PortNum::new(1).unwrap(),
        sl: 0,
        dlid: Lid::default(),
        path_bits: 0,
        static_rate: 0,
        grh: Some(Grh {
            dgid,
            flow_label: 0,
            hop_limit: 64,
            traffic_class: 0,
            sgid_index: 0,
        }),
    }
}

const CAPS: QpCaps = QpCaps {
    max_send_wr: 8,
    max_recv_wr: 16,
    max_send_sge: 1,
    max_recv_sge: 1,
    max_inline_data: 0,
};

const UD: QpInit = QpInit::new(QpType::Ud, CAPS, false);
const RC: QpInit = QpInit::new(QpType::Rc, CAPS, false);

/// RESET -> INIT -> RTR -> RTS of a UD QP on port 1 with Q_Key [`QKEY`].
fn ud_to_rts(qp: &Qp<'_, '_>) {
    let steps = [
        QpModify {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(PortNum::new(1).unwrap()),
            qkey: Some(QKey::new(QKEY)),
            ..QpModify::default()
        },
        QpModify::to_state(QpState::Rtr),
        QpModify {
            state: Some(QpState::Rts),
            sq_psn: Some(Psn::new(5).unwrap()),
            ..QpModify::default()
        },
    ];
    for step in &steps {
        qp.modify(step).unwrap();
    }
}

/// Takes RC QPs `a` (on the HCA at `a_at`) and `b` (at `b_at`) to RTS,
/// each aimed at the other, granting the peer `access`.
fn connect(a: &Qp<'_, '_>, a_at: u8, b: &Qp<'_, '_>, b_at: u8, access: AccessFlags) {
    let port = PortNum::new(1).unwrap();
    let to = |qp: &Qp<'_, '_>, peer: &Qp<'_, '_>, peer_at| {
        let peer_qpn = Qpn::new(peer.qpn()).unwrap();
        for step in rc_to_rts_steps(port, access, peer_qpn, Gid::from_ipv4(ip(peer_at)), 1) {
            qp.modify(&step).unwrap();
        }
    };
    to(a, b, b_at);
    to(b, a, a_at);
}

/// A signaled send request of `op` over `sges`.
fn send<'a>(wr_id: u64, op: SendOp, sges: &'a [Sge], ud: Option<UdDest>) -> UserSend<'a> {
    UserSend {
        wr: SendWr {
            wr_id,
            op,
            flags: SendFlags::SIGNALED,
            sg_list: sges,
            ud,
        },
        inline: None,
    }
}

/// Lets the device and the wire run, then polls every completion of `cq`.
fn drain(w: &World, cq: &Cq<'_>) -> Vec<WorkCompletion> {
    settle(&w.host);
    let mut all = Vec::new();
    let mut wcs = [WorkCompletion::EMPTY; 8];
    loop {
        let got = cq.poll(&mut wcs).unwrap();
        if got == 0 {
            return all;
        }
        all.extend_from_slice(&wcs[..got]);
    }
}

/// `(wr_id, status)` of each completion.
/// A window's place: its VA in the owner's buffer, that VA's offset in the
/// buffer, its length and R_Key.
struct Window {
    va: u64,
    offset: u64,
    len: u64,
    rkey: RKey,
}

/// The peer (its QP, CQ, buffer and region) writes 512 bytes of
/// `pattern(seed)` at `at` into `window` and reads its last 256 back, both
/// byte-checked against `before` (the owner's buffer before); then a write
/// straddling the window's end fails with a remote access error and
/// writes nothing.
fn peer_uses_the_window(
    w: &World,
    (pqp, pcq, pbuf, pmr): (&mut Qp<'_, '_>, &Cq<'_>, &Buffer<'_>, &Mr<'_, '_>),
    obuf: &Buffer<'_>,
    before: &[u8],
    window: &Window,
    (seed, at): (u32, u64),
) {
    let written = pattern(seed, 512);
    pbuf.write(0, &written).unwrap();
    let psge = [Sge::new(pbuf.va(), 512, pmr.keys().lkey)];
    let remote = RemoteAddr {
        addr: window.va + at,
        rkey: window.rkey,
    };
    pqp.post_send(&[send(10, SendOp::RdmaWrite { remote }, &psge, None)])
        .unwrap();
    assert_eq!(outcomes(&drain(w, pcq)), [(10, WcStatus::Success)]);
    let mut expected = before.to_vec();
    expected[(window.offset + at) as usize..][..512].copy_from_slice(&written);
    let mut now = vec![0; 8192];
    obuf.read(0, &mut now).unwrap();
    assert_eq!(now, expected, "the write landed in the window, only there");
    let rsge = [Sge::new(pbuf.va() + 1024, 256, pmr.keys().lkey)];
    let remote = RemoteAddr {
        addr: window.va + window.len - 256,
        rkey: window.rkey,
    };
    pqp.post_send(&[send(11, SendOp::RdmaRead { remote }, &rsge, None)])
        .unwrap();
    assert_eq!(outcomes(&drain(w, pcq)), [(11, WcStatus::Success)]);
    let mut read = vec![0; 256];
    pbuf.read(1024, &mut read).unwrap();
    assert_eq!(
        read,
        expected[(window.offset + window.len - 256) as usize..][..256]
    );

    // 100 bytes straddling the window's end: a remote access error,
    // nothing written.
    let psge = [Sge::new(pbuf.va(), 100, pmr.keys().lkey)];
    let remote = RemoteAddr {
        addr: window.va + window.len - 10,
        rkey: window.rkey,
    };
    pqp.post_send(&[send(12, SendOp::RdmaWrite { remote }, &psge, None)])
        .unwrap();
    assert_eq!(outcomes(&drain(w, pcq)), [(12, WcStatus::RemAccessErr)]);
    obuf.read(0, &mut now).unwrap();
    assert_eq!(now, expected, "nothing written past the window");
}

fn outcomes(wcs: &[WorkCompletion]) -> Vec<(u64, WcStatus)> {
    wcs.iter().map(|wc| (wc.wr_id, wc.status)).collect()
}

#[test]
fn qps_on_an_srq_take_their_receives_from_it_and_its_limit_event_fires() {
    const LEN: usize = 700;
    const SLOT: usize = 1024;
    let w = World::new(71);
    let process = Process::new(80);
    let io = w.io(&process);
    {
        let sender = Context::open(&io, CaSelector::Index(0), &PluginSource::Linked).unwrap();
        let receiver = Context::open(&io, CaSelector::Index(1), &PluginSource::Linked).unwrap();
        let (spd, rpd) = (Pd::new(&sender).unwrap(), Pd::new(&receiver).unwrap());
        let (sbuf, rbuf) = (
            Buffer::new(&sender, 4096).unwrap(),
            Buffer::new(&receiver, 8 * SLOT).unwrap(),
        );
        let smr = Mr::new(&spd, &sbuf, AccessFlags::LOCAL_WRITE).unwrap();
        let rmr = Mr::new(&rpd, &rbuf, AccessFlags::LOCAL_WRITE).unwrap();
        let (scq, rcq) = (Cq::new(&sender, 8).unwrap(), Cq::new(&receiver, 8).unwrap());
        let srq_attr = SrqAttr {
            max_wr: 8,
            max_sge: 1,
            srq_limit: 0,
        };
        let srq = Srq::new(&rpd, &srq_attr).unwrap();
        assert_eq!(srq.attr().max_wr, 8);
        assert_eq!(srq.query().unwrap(), srq.attr());
        let on_srq = QpInit {
            caps: QpCaps {
                max_recv_wr: 0,
                max_recv_sge: 0,
                ..CAPS
            },
            ..UD
        };
        // An SRQ of another PD is refused before any call.
        let other_pd = Pd::new(&receiver).unwrap();
        let requests = process.requests_issued();
        assert!(matches!(
            Qp::with_srq(&other_pd, &rcq, &rcq, &srq, &on_srq),
            Err(Error::InvalidArgument(_))
        ));
        assert_eq!(process.requests_issued(), requests);
        drop(other_pd);

        let mut sqp = Qp::new(&spd, &scq, &scq, &UD).unwrap();
        let mut members = [
            Qp::with_srq(&rpd, &rcq, &rcq, &srq, &on_srq).unwrap(),
            Qp::with_srq(&rpd, &rcq, &rcq, &srq, &on_srq).unwrap(),
        ];
        for qp in [&sqp, &members[0], &members[1]] {
            ud_to_rts(qp);
        }
        // A QP on an SRQ has no receive queue of its own.
        let sge = [Sge::new(rbuf.va(), 64, rmr.keys().lkey)];
        assert!(matches!(
            members[0].post_recv(&[RecvWr {
                wr_id: 1,
                sg_list: &sge
            }]),
            Err(Error::InvalidArgument(_))
        ));

        // Six receives on the SRQ; the limit armed at 3.
        let sges: Vec<[Sge; 1]> = (0..6)
            .map(|i| {
                [Sge::new(
                    rbuf.va() + (i * SLOT) as u64,
                    SLOT as u32,
                    rmr.keys().lkey,
                )]
            })
            .collect();
        let recvs: Vec<RecvWr<'_>> = sges
            .iter()
            .enumerate()
            .map(|(i, sg)| RecvWr {
                wr_id: 500 + i as u64,
                sg_list: sg,
            })
            .collect();
        srq.arm_limit(3).unwrap();
        assert_eq!(srq.query().unwrap().srq_limit, 3);
        // Bad input is a typed error: an SRQ of no receives (no call), a
        // receive with more SGEs than the SRQ holds (the plugin refuses it,
        // nothing posted).
        assert!(matches!(
            Srq::new(
                &rpd,
                &SrqAttr {
                    max_wr: 0,
                    ..srq_attr
                }
            ),
            Err(Error::InvalidArgument(_))
        ));
        let two = [sges[0][0], sges[1][0]];
        let e = srq
            .post_recv(&[RecvWr {
                wr_id: 9,
                sg_list: &two,
            }])
            .unwrap_err();
        assert!(matches!(e, Error::Refused { posted: 0, .. }), "{e:?}");
        let requests = process.requests_issued();
        assert_eq!(srq.post_recv(&recvs).unwrap(), 6);

        // Four datagrams, to each member in turn: both take receives from
        // the SRQ, in the SRQ's order.
        let av = Av::new(&spd, &av_to(Gid::from_ipv4(ip(1)))).unwrap();
        for round in 0..4u32 {
            let payload = pattern(round, LEN);
            sbuf.write(0, &payload).unwrap();
            let dest = UdDest {
                av: av.handle(),
                remote_qpn: Qpn::new(members[round as usize % 2].qpn()).unwrap(),
                remote_qkey: QKey::new(QKEY),
            };
            let ssge = [Sge::new(sbuf.va(), LEN as u32, smr.keys().lkey)];
            let batch = [send(u64::from(round), SendOp::Send, &ssge, Some(dest))];
            assert_eq!(sqp.post_send(&batch).unwrap(), 1);
            assert_eq!(
                outcomes(&drain(&w, &scq)),
                [(u64::from(round), WcStatus::Success)]
            );
            let got = drain(&w, &rcq);
            assert_eq!(got.len(), 1, "round {round}");
            assert_eq!(
                (got[0].wr_id, got[0].status, got[0].byte_len),
                (
                    500 + u64::from(round),
                    WcStatus::Success,
                    (GRH + LEN) as u32
                )
            );
            assert_eq!(got[0].qp_num.get(), members[round as usize % 2].qpn());
            let mut bytes = vec![0; LEN];
            rbuf.read(round as usize * SLOT + GRH, &mut bytes).unwrap();
            assert_eq!(bytes, payload, "round {round}");
        }
        assert_eq!(
            process.requests_issued(),
            requests,
            "SRQ posts, sends and polls stayed in user mode"
        );
        // Two receives left, fewer than the limit: the event, once, naming
        // the SRQ; the device disarmed the limit.
        let event = receiver.async_event().unwrap();
        assert_eq!(
            (event.code, event.handle),
            (AsyncEventCode::SrqLimitReached, srq.handle())
        );
        assert_eq!(srq.query().unwrap().srq_limit, 0, "disarmed");
        // The SRQ outlives its QPs (the borrow checker allows no other
        // order); its two receives left are the device's until then.
        drop(members);
        drop(sqp);
    }
    w.finish_with(&process);
}

#[test]
fn a_cq_resized_with_completions_outstanding_loses_none() {
    const LEN: usize = 600;
    const SLOT: usize = 1024;
    let w = World::new(72);
    let process = Process::new(81);
    let io = w.io(&process);
    {
        let sender = Context::open(&io, CaSelector::Index(0), &PluginSource::Linked).unwrap();
        let receiver = Context::open(&io, CaSelector::Index(1), &PluginSource::Linked).unwrap();
        let (spd, rpd) = (Pd::new(&sender).unwrap(), Pd::new(&receiver).unwrap());
        let sbuf = Buffer::new(&sender, 4096).unwrap();
        let rbuf = Buffer::new(&receiver, 32 * SLOT).unwrap();
        let smr = Mr::new(&spd, &sbuf, AccessFlags::LOCAL_WRITE).unwrap();
        let rmr = Mr::new(&rpd, &rbuf, AccessFlags::LOCAL_WRITE).unwrap();
        let (scq, rcq) = (Cq::new(&sender, 8).unwrap(), Cq::new(&receiver, 8).unwrap());
        assert_eq!((rcq.cqe(), rcq.query().unwrap()), (8, 8));
        let mut sqp = Qp::new(&spd, &scq, &scq, &UD).unwrap();
        let mut rqp = Qp::new(&rpd, &rcq, &rcq, &UD).unwrap();
        ud_to_rts(&sqp);
        ud_to_rts(&rqp);
        let av = Av::new(&spd, &av_to(Gid::from_ipv4(ip(1)))).unwrap();
        let dest = UdDest {
            av: av.handle(),
            remote_qpn: Qpn::new(rqp.qpn()).unwrap(),
            remote_qkey: QKey::new(QKEY),
        };
        // Datagram `n` lands in receive slot `n % 32`; none is polled.
        let mut sent = 0u32;
        let mut traffic = |sqp: &mut Qp<'_, '_>, rqp: &mut Qp<'_, '_>, count: u32| {
            for _ in 0..count {
                let slot = (sent % 32) as usize;
                let rsge = [Sge::new(
                    rbuf.va() + (slot * SLOT) as u64,
                    SLOT as u32,
                    rmr.keys().lkey,
                )];
                let recv = [RecvWr {
                    wr_id: 1000 + u64::from(sent),
                    sg_list: &rsge,
                }];
                assert_eq!(rqp.post_recv(&recv).unwrap(), 1);
                sbuf.write(0, &pattern(sent, LEN)).unwrap();
                let ssge = [Sge::new(sbuf.va(), LEN as u32, smr.keys().lkey)];
                let batch = [send(u64::from(sent), SendOp::Send, &ssge, Some(dest))];
                assert_eq!(sqp.post_send(&batch).unwrap(), 1);
                assert_eq!(
                    outcomes(&drain(&w, &scq)),
                    [(u64::from(sent), WcStatus::Success)]
                );
                sent += 1;
            }
        };
        // Checks the completions of datagrams `from..to`, in order, and
        // their bytes.
        let check = |wcs: &[WorkCompletion], from: u32, to: u32| {
            assert_eq!(wcs.len(), (to - from) as usize);
            for (wc, n) in wcs.iter().zip(from..to) {
                assert_eq!(
                    (wc.wr_id, wc.status, wc.byte_len),
                    (1000 + u64::from(n), WcStatus::Success, (GRH + LEN) as u32)
                );
                let mut bytes = vec![0; LEN];
                rbuf.read((n % 32) as usize * SLOT + GRH, &mut bytes)
                    .unwrap();
                assert_eq!(bytes, pattern(n, LEN), "datagram {n}");
            }
        };

        // Six completions in the 8-entry ring, unpolled.
        traffic(&mut sqp, &mut rqp, 6);
        // Four entries cannot hold them: refused, the old ring stays.
        assert_eq!(
            rcq.resize(4).unwrap_err(),
            Error::Verb {
                verb: VerbId::ResizeCq,
                status: IbStatus::InvalidCqSize
            }
        );
        assert_eq!(rcq.cqe(), 8);
        assert!(matches!(rcq.resize(0), Err(Error::InvalidArgument(_))));
        // Grown to 32 with the six still in: ten more arrive (sixteen
        // outstanding, twice what the old ring held), all there in order.
        assert_eq!(rcq.resize(20).unwrap(), 32);
        assert_eq!((rcq.cqe(), rcq.query().unwrap()), (32, 32));
        traffic(&mut sqp, &mut rqp, 10);
        check(&drain(&w, &rcq), 0, 16);
        // Shrunk again with three outstanding: they survive that too.
        traffic(&mut sqp, &mut rqp, 3);
        assert_eq!(rcq.resize(4).unwrap(), 4);
        traffic(&mut sqp, &mut rqp, 1);
        check(&drain(&w, &rcq), 16, 20);
        // The resized CQ still raises its event.
        rcq.arm(ibal_user::ArmFor::Next).unwrap();
        traffic(&mut sqp, &mut rqp, 1);
        rcq.wait_event().unwrap();
        check(&drain(&w, &rcq), 20, 21);
    }
    w.finish_with(&process);
}

/// A seam that runs `after_resize` once a `ResizeCq` IOCTL has completed
/// (the device switched rings) and before the library's post hook runs:
/// the window in which another thread's poll would see the old ring.
struct ResizeWindow {
    inner: Arc<SimIo>,
    after_resize: Arc<dyn Fn() + Send + Sync>,
}

impl std::fmt::Debug for ResizeWindow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ResizeWindow")
    }
}

#[derive(Debug)]
struct ResizeWindowFile {
    inner: Box<dyn DeviceFile>,
    window: Arc<ResizeWindow>,
}

impl DeviceFile for ResizeWindowFile {
    fn ioctl(&self, code: u32, input: &[u8], output: &mut [u8]) -> Result<usize, OsStatus> {
        let answer = self.inner.ioctl(code, input, output);
        if code == v::ResizeCq::ID.ioctl().raw() {
            (self.window.after_resize)();
        }
        answer
    }
}

#[derive(Debug)]
struct ResizeWindowIo(Arc<ResizeWindow>);

impl DeviceIo for ResizeWindowIo {
    fn interface_paths(&self) -> Result<Vec<DevicePath>, OsStatus> {
        self.0.inner.interface_paths()
    }
    fn open(&self, path: &DevicePath) -> Result<Box<dyn DeviceFile>, OsStatus> {
        Ok(Box::new(ResizeWindowFile {
            inner: self.0.inner.open(path)?,
            window: Arc::clone(&self.0),
        }))
    }
    fn alloc(&self, len: usize) -> Result<u64, OsStatus> {
        self.0.inner.alloc(len)
    }
    fn free(&self, va: u64) {
        self.0.inner.free(va);
    }
    fn read(&self, va: u64, out: &mut [u8]) -> Result<(), OsStatus> {
        self.0.inner.read(va, out)
    }
    fn write(&self, va: u64, data: &[u8]) -> Result<(), OsStatus> {
        self.0.inner.write(va, data)
    }
    fn doorbell_hook(&self) -> uvp_plugin::mmio::MmioHook {
        self.0.inner.doorbell_hook()
    }
}

/// A poll from another thread while a resize is under way finds nothing
/// (the plugin holds polls off from the resize's pre to its post):
/// polling the old ring after the device copied its entries into the new
/// one would hand them out twice (once there, once from the new ring).
#[test]
fn a_poll_racing_a_resize_sees_each_completion_once() {
    use std::sync::mpsc;
    use std::time::Duration;
    const LEN: usize = 64;
    let w = World::new(77);
    let process = Process::new(86);
    // The seam tells the polling thread when the device has switched,
    // then gives it time to poll before the library's post runs.
    let (switched_tx, switched_rx) = mpsc::channel::<()>();
    let switched_tx = std::sync::Mutex::new(switched_tx);
    let window = Arc::new(ResizeWindow {
        inner: SimIo::new(&w.host, &process),
        after_resize: Arc::new(move || {
            let _ = switched_tx.lock().unwrap().send(());
            std::thread::sleep(Duration::from_millis(200));
        }),
    });
    let io: Arc<dyn DeviceIo> = Arc::new(ResizeWindowIo(window));
    {
        let sender = Context::open(&io, CaSelector::Index(0), &PluginSource::Linked).unwrap();
        let receiver = Context::open(&io, CaSelector::Index(1), &PluginSource::Linked).unwrap();
        let (spd, rpd) = (Pd::new(&sender).unwrap(), Pd::new(&receiver).unwrap());
        let (sbuf, rbuf) = (
            Buffer::new(&sender, 4096).unwrap(),
            Buffer::new(&receiver, 4096).unwrap(),
        );
        let smr = Mr::new(&spd, &sbuf, AccessFlags::LOCAL_WRITE).unwrap();
        let rmr = Mr::new(&rpd, &rbuf, AccessFlags::LOCAL_WRITE).unwrap();
        let (scq, rcq) = (Cq::new(&sender, 8).unwrap(), Cq::new(&receiver, 8).unwrap());
        let mut sqp = Qp::new(&spd, &scq, &scq, &UD).unwrap();
        let mut rqp = Qp::new(&rpd, &rcq, &rcq, &UD).unwrap();
        ud_to_rts(&sqp);
        ud_to_rts(&rqp);
        let av = Av::new(&spd, &av_to(Gid::from_ipv4(ip(1)))).unwrap();
        let dest = UdDest {
            av: av.handle(),
            remote_qpn: Qpn::new(rqp.qpn()).unwrap(),
            remote_qkey: QKey::new(QKEY),
        };
        // Six datagrams received, their completions unpolled.
        for n in 0..6u64 {
            let rsge = [Sge::new(rbuf.va() + n * 512, 512, rmr.keys().lkey)];
            rqp.post_recv(&[RecvWr {
                wr_id: 100 + n,
                sg_list: &rsge,
            }])
            .unwrap();
            let ssge = [Sge::new(sbuf.va(), LEN as u32, smr.keys().lkey)];
            sqp.post_send(&[send(n, SendOp::Send, &ssge, Some(dest))])
                .unwrap();
        }
        settle(&w.host);
        assert_eq!(drain(&w, &scq).len(), 6);

        let (resized, racing) = std::thread::scope(|scope| {
            let rcq = &rcq;
            let poller = scope.spawn(move || {
                switched_rx.recv().unwrap();
                let mut wcs = [WorkCompletion::EMPTY; 16];
                let got = rcq.poll(&mut wcs).unwrap();
                wcs[..got].to_vec()
            });
            let resized = rcq.resize(32).unwrap();
            (resized, poller.join().unwrap())
        });
        assert_eq!(resized, 32);
        let mut all = racing;
        let mut wcs = [WorkCompletion::EMPTY; 16];
        let got = rcq.poll(&mut wcs).unwrap();
        all.extend_from_slice(&wcs[..got]);
        assert_eq!(
            outcomes(&all),
            (0..6)
                .map(|n| (100 + n, WcStatus::Success))
                .collect::<Vec<_>>(),
            "each completion once, in order"
        );
    }
    w.finish_with(&process);
}

/// Two contexts on the two HCAs, each with a PD, a CQ and an RC QP, the
/// QPs connected: the owner of memory (HCA 0) and its peer (HCA 1).
#[test]
fn a_type_2_window_grants_its_range_to_the_peer_and_nothing_else() {
    let w = World::new(73);
    let process = Process::new(82);
    let io = w.io(&process);
    {
        let owner = Context::open(&io, CaSelector::Index(0), &PluginSource::Linked).unwrap();
        let peer = Context::open(&io, CaSelector::Index(1), &PluginSource::Linked).unwrap();
        let (opd, ppd) = (Pd::new(&owner).unwrap(), Pd::new(&peer).unwrap());
        let (ocq, pcq) = (Cq::new(&owner, 8).unwrap(), Cq::new(&peer, 8).unwrap());
        let mut oqp = Qp::new(&opd, &ocq, &ocq, &RC).unwrap();
        let mut pqp = Qp::new(&ppd, &pcq, &pcq, &RC).unwrap();
        connect(
            &oqp,
            0,
            &pqp,
            1,
            AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        );
        // The region grants no remote right itself: only the window will.
        let obuf = Buffer::new(&owner, 8192).unwrap();
        let before = pattern(99, 8192);
        obuf.write(0, &before).unwrap();
        let omr = Mr::new(&opd, &obuf, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND).unwrap();
        let pbuf = Buffer::new(&peer, 4096).unwrap();
        let pmr = Mr::new(&ppd, &pbuf, AccessFlags::LOCAL_WRITE).unwrap();

        let mut mw = Mw::new(&opd, MwType::Type2).unwrap();
        let first = mw.rkey();
        let query = mw.query().unwrap();
        assert_eq!(
            (query.pd.raw(), query.attr.mw_type, query.attr.rkey),
            (opd.handle(), MwType::Type2, first)
        );
        // A range outside the region is refused before any post.
        assert!(matches!(
            mw.bind(&mut oqp, 2, &omr, 8000, 500, AccessFlags::REMOTE_READ),
            Err(Error::InvalidArgument(_))
        ));
        // The window: 2048 bytes from offset 1024, read and write.
        const START: u64 = 1024;
        const LEN: u64 = 2048;
        let requests = process.requests_issued();
        let rkey = mw
            .bind(
                &mut oqp,
                3,
                &omr,
                START,
                LEN,
                AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
            )
            .unwrap();
        assert_ne!(rkey, first, "a bind brings a new key");
        assert_eq!(outcomes(&drain(&w, &ocq)), [(3, WcStatus::Success)]);
        assert_eq!(process.requests_issued(), requests, "bound in user mode");
        assert_eq!(mw.query().unwrap().attr.rkey, rkey, "the device's key");
        let window = obuf.va() + START;

        let window = Window {
            va: window,
            offset: START,
            len: LEN,
            rkey,
        };
        peer_uses_the_window(
            &w,
            (&mut pqp, &pcq, &pbuf, &pmr),
            &obuf,
            &before,
            &window,
            (7, 100),
        );
        // The window goes before its region (its lifetime says so) and
        // the device unbinds it at deallocation.
        drop(mw);
    }
    w.finish_with(&process);
}

/// A type 1 window (IBA 10.6.7.2.1): bound by the plugin's own bind WQE
/// (PRM 10.2, `mw_type` 1) on a QP of its PD, with the consumer's next
/// key; rebound in place with another key (the old one refused); the
/// peer's RDMA write and read through it byte-checked, and a write past
/// its end refused with nothing written.
#[test]
fn a_type_1_window_is_bound_from_user_mode_and_grants_only_its_range() {
    let w = World::new(74);
    let process = Process::new(83);
    let io = w.io(&process);
    {
        let owner = Context::open(&io, CaSelector::Index(0), &PluginSource::Linked).unwrap();
        let peer = Context::open(&io, CaSelector::Index(1), &PluginSource::Linked).unwrap();
        let (opd, ppd) = (Pd::new(&owner).unwrap(), Pd::new(&peer).unwrap());
        let (ocq, pcq) = (Cq::new(&owner, 8).unwrap(), Cq::new(&peer, 8).unwrap());
        let mut oqp = Qp::new(&opd, &ocq, &ocq, &RC).unwrap();
        let mut pqp = Qp::new(&ppd, &pcq, &pcq, &RC).unwrap();
        connect(
            &oqp,
            0,
            &pqp,
            1,
            AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        );
        let obuf = Buffer::new(&owner, 8192).unwrap();
        let before = pattern(41, 8192);
        obuf.write(0, &before).unwrap();
        let omr = Mr::new(&opd, &obuf, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND).unwrap();
        let pbuf = Buffer::new(&peer, 4096).unwrap();
        let pmr = Mr::new(&ppd, &pbuf, AccessFlags::LOCAL_WRITE).unwrap();

        let mut mw = Mw::new(&opd, MwType::Type1).unwrap();
        let first = mw.rkey();
        assert_eq!(mw.query().unwrap().attr.mw_type, MwType::Type1);
        let requests = process.requests_issued();
        // First bound to 512 bytes at 0, then rebound without unbinding
        // (a type 1 window may be bound in any state) to 2048 bytes at
        // 4096: each bind brings a new key, the device's.
        let rw = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        let old = mw.bind(&mut oqp, 1, &omr, 0, 512, rw).unwrap();
        assert_eq!(outcomes(&drain(&w, &ocq)), [(1, WcStatus::Success)]);
        assert_ne!(old, first);
        assert_eq!(mw.query().unwrap().attr.rkey, old);
        const START: u64 = 4096;
        const LEN: u64 = 2048;
        let rkey = mw.bind(&mut oqp, 2, &omr, START, LEN, rw).unwrap();
        assert_eq!(outcomes(&drain(&w, &ocq)), [(2, WcStatus::Success)]);
        assert_ne!(rkey, old);
        assert_eq!(mw.query().unwrap().attr.rkey, rkey, "the device's key");
        assert_eq!(process.requests_issued(), requests + 2, "two queries only");
        let window = obuf.va() + START;

        let window = Window {
            va: window,
            offset: START,
            len: LEN,
            rkey,
        };
        peer_uses_the_window(
            &w,
            (&mut pqp, &pcq, &pbuf, &pmr),
            &obuf,
            &before,
            &window,
            (8, 300),
        );
        // A type 1 window is never invalidated; deallocation unbinds it.
        assert!(matches!(
            mw.invalidate(&mut oqp, 13),
            Err(Error::InvalidArgument(_))
        ));
        drop(mw);
    }
    w.finish_with(&process);
}

#[test]
fn rdma_read_fetch_add_and_compare_swap_from_the_safe_api() {
    let w = World::new(74);
    let process = Process::new(83);
    let io = w.io(&process);
    {
        let owner = Context::open(&io, CaSelector::Index(0), &PluginSource::Linked).unwrap();
        let peer = Context::open(&io, CaSelector::Index(1), &PluginSource::Linked).unwrap();
        let (opd, ppd) = (Pd::new(&owner).unwrap(), Pd::new(&peer).unwrap());
        let (ocq, pcq) = (Cq::new(&owner, 8).unwrap(), Cq::new(&peer, 8).unwrap());
        let oqp = Qp::new(&opd, &ocq, &ocq, &RC).unwrap();
        let mut pqp = Qp::new(&ppd, &pcq, &pcq, &RC).unwrap();
        let rights =
            AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC;
        connect(&oqp, 0, &pqp, 1, rights);
        let obuf = Buffer::new(&owner, 8192).unwrap();
        let content = pattern(5, 8192);
        obuf.write(0, &content).unwrap();
        let omr = Mr::new(&opd, &obuf, AccessFlags::LOCAL_WRITE | rights).unwrap();
        let pbuf = Buffer::new(&peer, 8192).unwrap();
        let pmr = Mr::new(&ppd, &pbuf, AccessFlags::LOCAL_WRITE).unwrap();
        let rkey: RKey = omr.keys().rkey;
        let requests = process.requests_issued();

        // An RDMA read of 3000 bytes across a page boundary.
        let sge = [Sge::new(pbuf.va(), 3000, pmr.keys().lkey)];
        let remote = RemoteAddr {
            addr: obuf.va() + 2500,
            rkey,
        };
        pqp.post_send(&[send(1, SendOp::RdmaRead { remote }, &sge, None)])
            .unwrap();
        assert_eq!(outcomes(&drain(&w, &pcq)), [(1, WcStatus::Success)]);
        let mut got = vec![0; 3000];
        pbuf.read(0, &mut got).unwrap();
        assert_eq!(got, content[2500..5500]);

        // Fetch-add on the word at 4096: the old value comes back.
        let word = |buf: &Buffer<'_>, at: usize| {
            let mut b = [0; 8];
            buf.read(at, &mut b).unwrap();
            u64::from_le_bytes(b)
        };
        obuf.write(4096, &40_u64.to_le_bytes()).unwrap();
        let target = RemoteAddr {
            addr: obuf.va() + 4096,
            rkey,
        };
        let result = [Sge::new(pbuf.va() + 4096, 8, pmr.keys().lkey)];
        let add = SendOp::FetchAdd {
            remote: target,
            add: 2,
        };
        pqp.post_send(&[send(2, add, &result, None)]).unwrap();
        assert_eq!(outcomes(&drain(&w, &pcq)), [(2, WcStatus::Success)]);
        assert_eq!((word(&pbuf, 4096), word(&obuf, 4096)), (40, 42));

        // Compare-swap that holds, then one that does not.
        let swap = |compare, swap| SendOp::CompareSwap {
            remote: target,
            compare,
            swap,
        };
        pqp.post_send(&[send(3, swap(42, 0xABCD), &result, None)])
            .unwrap();
        assert_eq!(outcomes(&drain(&w, &pcq)), [(3, WcStatus::Success)]);
        assert_eq!((word(&pbuf, 4096), word(&obuf, 4096)), (42, 0xABCD));
        pqp.post_send(&[send(4, swap(42, 7), &result, None)])
            .unwrap();
        assert_eq!(outcomes(&drain(&w, &pcq)), [(4, WcStatus::Success)]);
        assert_eq!(
            (word(&pbuf, 4096), word(&obuf, 4096)),
            (0xABCD, 0xABCD),
            "the comparison failed: nothing swapped"
        );
        assert_eq!(process.requests_issued(), requests, "all in user mode");
        // Around the word, the owner's bytes are untouched.
        let mut now = vec![0; 8192];
        obuf.read(0, &mut now).unwrap();
        assert_eq!(now[..4096], content[..4096]);
        assert_eq!(now[4104..], content[4104..]);
    }
    w.finish_with(&process);
}

#[test]
fn a_datagram_to_a_group_reaches_every_attached_qp_and_not_a_detached_one() {
    const LEN: usize = 900;
    const SLOT: usize = 2048;
    let w = World::new(75);
    let process = Process::new(84);
    let io = w.io(&process);
    {
        let sender = Context::open(&io, CaSelector::Index(0), &PluginSource::Linked).unwrap();
        let receiver = Context::open(&io, CaSelector::Index(1), &PluginSource::Linked).unwrap();
        let (spd, rpd) = (Pd::new(&sender).unwrap(), Pd::new(&receiver).unwrap());
        let sbuf = Buffer::new(&sender, 4096).unwrap();
        let rbuf = Buffer::new(&receiver, 3 * SLOT).unwrap();
        let smr = Mr::new(&spd, &sbuf, AccessFlags::LOCAL_WRITE).unwrap();
        let rmr = Mr::new(&rpd, &rbuf, AccessFlags::LOCAL_WRITE).unwrap();
        let (scq, rcq) = (Cq::new(&sender, 8).unwrap(), Cq::new(&receiver, 8).unwrap());
        let mut sqp = Qp::new(&spd, &scq, &scq, &UD).unwrap();
        ud_to_rts(&sqp);
        let mut members: Vec<Qp<'_, '_>> = (0..3)
            .map(|_| Qp::new(&rpd, &rcq, &rcq, &UD).unwrap())
            .collect();
        let mgid = Gid::from_ipv4([239, 1, 2, 3]);
        let group = McastGroup {
            mgid,
            mlid: Lid::UNASSIGNED,
        };
        for (k, qp) in members.iter_mut().enumerate() {
            ud_to_rts(qp);
            qp.attach_mcast(&group).unwrap();
            let sge = [Sge::new(
                rbuf.va() + (k * SLOT) as u64,
                SLOT as u32,
                rmr.keys().lkey,
            )];
            let recv = [RecvWr {
                wr_id: 300 + k as u64,
                sg_list: &sge,
            }];
            assert_eq!(qp.post_recv(&recv).unwrap(), 1);
        }
        // Twice into one group, or out of one it is not in: refused
        // before any call.
        let requests = process.requests_issued();
        assert!(matches!(
            members[0].attach_mcast(&group),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            members[0].detach_mcast(&Gid::from_ipv4([239, 9, 9, 9])),
            Err(Error::InvalidArgument(_))
        ));
        assert_eq!(process.requests_issued(), requests);
        // Only UD QPs join groups: the kernel refuses an RC QP.
        let mut rc = Qp::new(&rpd, &rcq, &rcq, &RC).unwrap();
        assert_eq!(
            rc.attach_mcast(&group).unwrap_err(),
            Error::Verb {
                verb: VerbId::AttachMcast,
                status: IbStatus::InvalidServiceType
            }
        );
        drop(rc);
        // Member 2 leaves.
        members[2].detach_mcast(&mgid).unwrap();
        assert_eq!(members[2].mcast_groups().count(), 0);
        assert_eq!(members[0].mcast_groups().collect::<Vec<_>>(), [&mgid]);

        let av = Av::new(&spd, &av_to(mgid)).unwrap();
        let dest = UdDest {
            av: av.handle(),
            remote_qpn: Qpn::new(0xFF_FFFF).unwrap(),
            remote_qkey: QKey::new(QKEY),
        };
        let datagram = pattern(21, LEN);
        sbuf.write(0, &datagram).unwrap();
        let ssge = [Sge::new(sbuf.va(), LEN as u32, smr.keys().lkey)];
        sqp.post_send(&[send(9, SendOp::Send, &ssge, Some(dest))])
            .unwrap();
        assert_eq!(outcomes(&drain(&w, &scq)), [(9, WcStatus::Success)]);
        let mut got = drain(&w, &rcq);
        got.sort_by_key(|wc| wc.wr_id);
        assert_eq!(
            got.iter()
                .map(|wc| (wc.wr_id, wc.status, wc.byte_len, wc.qp_num.get()))
                .collect::<Vec<_>>(),
            [
                (300, WcStatus::Success, (GRH + LEN) as u32, members[0].qpn()),
                (301, WcStatus::Success, (GRH + LEN) as u32, members[1].qpn()),
            ],
            "the two members received it, the one that left did not"
        );
        for k in 0..3 {
            let mut bytes = vec![0; LEN];
            rbuf.read(k * SLOT + GRH, &mut bytes).unwrap();
            if k < 2 {
                assert_eq!(bytes, datagram, "member {k}");
            } else {
                assert_eq!(bytes, vec![0; LEN], "the detached QP got nothing");
            }
        }
        // Member 2's receive was never consumed: flushed when it errs.
        members[2]
            .modify(&QpModify::to_state(QpState::Err))
            .unwrap();
        assert_eq!(outcomes(&drain(&w, &rcq)), [(302, WcStatus::WrFlushErr)]);
        // Members 0 and 1 are still in the group: destroying them ends
        // their memberships (nothing left in the proxy, checked at the
        // end).
        drop(members);
    }
    w.finish_with(&process);
}

#[test]
fn queries_answer_what_the_kernel_holds() {
    let w = World::new(76);
    let process = Process::new(85);
    let io = w.io(&process);
    {
        let ctx = Context::open(&io, CaSelector::Index(1), &PluginSource::Linked).unwrap();
        let ca = ctx.query().unwrap();
        assert_eq!(ca.node_guid.get(), HCAS[1]);
        assert_eq!(ca.layout.num_ports, 2);
        for port in [1u8, 2] {
            let info = ctx.query_port(PortNum::new(port).unwrap()).unwrap();
            assert_eq!(info.attr.port_num.get(), port);
            assert_eq!(info.attr.state, PortState::Active);
            assert_eq!(info.gids[0], Gid::from_ipv4([10, 2, 1, port]));
            assert!(!info.pkeys.is_empty());
        }
        assert!(matches!(
            ctx.query_port(PortNum::new(3).unwrap()),
            Err(Error::InvalidArgument(_))
        ));

        let pd = Pd::new(&ctx).unwrap();
        let buffer = Buffer::new(&ctx, 8192).unwrap();
        let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ;
        let mr = Mr::new(&pd, &buffer, access).unwrap();
        let region = mr.query().unwrap();
        assert_eq!(
            (
                region.pd.raw(),
                region.vaddr,
                region.length,
                region.access,
                region.keys
            ),
            (pd.handle(), buffer.va(), 8192, access, mr.keys())
        );
        assert_eq!((mr.va(), mr.len()), (buffer.va(), 8192));
        let cq = Cq::new(&ctx, 30).unwrap();
        assert_eq!(cq.query().unwrap(), 32);
        let qp = Qp::new(&pd, &cq, &cq, &UD).unwrap();
        let q = qp.query().unwrap();
        assert_eq!(
            (q.qp_type, q.state, q.qpn.get(), q.caps),
            (QpType::Ud, QpState::Reset, qp.qpn(), qp.caps())
        );
        ud_to_rts(&qp);
        let q = qp.query().unwrap();
        assert_eq!(q.state, QpState::Rts);
        assert_eq!(q.attr.qkey, Some(QKey::new(QKEY)));
        let srq = Srq::new(
            &pd,
            &SrqAttr {
                max_wr: 5,
                max_sge: 1,
                srq_limit: 2,
            },
        )
        .unwrap();
        let s = srq.query().unwrap();
        assert_eq!((s.max_wr, s.srq_limit), (8, 2), "rounded up, armed");
    }
    w.finish_with(&process);
}

fn leak<T>(value: T) -> &'static T {
    Box::leak(Box::new(value))
}

/// The new objects are the kernel's to clean at process exit too: an SRQ
/// with a QP on it, a resized CQ, a bound window and a multicast membership,
/// all leaked on one HCA, leave nothing once the process exits.
#[test]
fn a_process_exiting_with_srqs_windows_and_groups_open_leaves_nothing() {
    let w = World::new(78);
    let process = Process::new(87);
    let io = w.io(&process);
    let ctx = leak(Context::open(&io, CaSelector::Index(0), &PluginSource::Linked).unwrap());
    let pd = leak(Pd::new(ctx).unwrap());
    let cq = leak(Cq::new(ctx, 8).unwrap());
    assert_eq!(cq.resize(64).unwrap(), 64);
    let srq = leak(
        Srq::new(
            pd,
            &SrqAttr {
                max_wr: 8,
                max_sge: 1,
                srq_limit: 2,
            },
        )
        .unwrap(),
    );
    let on_srq = QpInit {
        caps: QpCaps {
            max_recv_wr: 0,
            max_recv_sge: 0,
            ..CAPS
        },
        ..RC
    };
    let rc = Box::leak(Box::new(Qp::with_srq(pd, cq, cq, srq, &on_srq).unwrap()));
    // The RC QP is taken to RTS towards a QP number nobody holds: it
    // binds the window and never sends.
    for step in rc_to_rts_steps(
        PortNum::new(1).unwrap(),
        AccessFlags::REMOTE_READ,
        Qpn::new(0x77).unwrap(),
        Gid::from_ipv4(ip(1)),
        1,
    ) {
        rc.modify(&step).unwrap();
    }
    let buffer = leak(Buffer::new(ctx, 4096).unwrap());
    let mr = leak(Mr::new(pd, buffer, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND).unwrap());
    let mw = Box::leak(Box::new(Mw::new(pd, MwType::Type2).unwrap()));
    mw.bind(rc, 1, mr, 0, 1024, AccessFlags::REMOTE_READ)
        .unwrap();
    assert_eq!(outcomes(&drain(&w, cq)), [(1, WcStatus::Success)]);
    let ud = Box::leak(Box::new(Qp::new(pd, cq, cq, &UD).unwrap()));
    ud_to_rts(ud);
    ud.attach_mcast(&McastGroup {
        mgid: Gid::from_ipv4([239, 4, 4, 4]),
        mlid: Lid::UNASSIGNED,
    })
    .unwrap();
    // CA, PD, CQ, SRQ, two QPs, MR, MW, membership.
    assert_eq!(w.proxy(0).proxy().object_count(), 9);
    assert_eq!(
        w.host.pnp().exit_process(&process),
        0,
        "no page left locked"
    );
    settle(&w.host);
    assert_eq!(w.leftovers(&process), [0; 5]);
    w.host.shut_down();
    w.host.verifier().assert_clean();
}
