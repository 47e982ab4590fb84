//! The UDP fabric (`sim_hca::udp`): two devices, each on its own fabric
//! instance in this process, each port a real UDP socket at its own
//! loopback address, exchanging RC, UC and UD traffic as two processes
//! would. Every test binds its own range of this process's addresses
//! (tests run in parallel threads, and other worktrees may run them at
//! once), except the one that checks the automatic choice. QPs use a
//! 134 ms ACK timeout (7 retries): a loaded machine's scheduling delays
//! never exhaust them.
//!
//! `tshark_decodes_the_udp_fabric_traffic` is ignored by default (it needs
//! tshark and capture rights on `lo`):
//! `cargo test -p sim-hca --test udp_fabric -- --ignored tshark`.

use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hca_prm::av::Av;
use hca_prm::cqe::{Cqe, CqeFlags};
use ib_types::access::AccessFlags;
use ib_types::av::AvAttr;
use ib_types::handle::AvHandle;
use ib_types::qp::QpType;
use ib_types::scalars::{Gid, Mtu, PortNum, QKey, Qpn};
use ib_types::wc::WcStatus;
use ib_types::wr::{RemoteAddr, SendFlags, SendOp, SendWr, UdDest};
use sim_hca::device::{Device, DeviceConfig};
use sim_hca::host::{InterruptSink, SimMemory};
use sim_hca::testkit::{Cq, Driver, Mr, Qp, bring_up};
use sim_hca::udp::{FRAME_HEADROOM, PortAddress, UdpFabric, datagram_from_frame};
use sim_hca::wire::DropReason;
use sim_hca::wire::udp::ROCEV2_PORT;

struct NoIrq;
impl InterruptSink for NoIrq {
    fn raise(&self, _vector: u16) {}
}

const PD: u32 = 3;
const UD_QKEY: u32 = 0x1111;
/// Bytes of each side's region: a send/receive area, a target area for
/// the peer's writes and reads, and an 8-byte atomic word at the end.
const REGION: usize = 1 << 16;
const TARGET: usize = REGION / 2;
const ATOMIC: usize = REGION - 8;
/// 4.096 µs * 2^15: 134 ms.
const ACK_TIMEOUT: u8 = 15;

/// One simulated machine: a fabric with one device, its driver and one QP.
struct Host {
    fabric: UdpFabric,
    drv: Driver,
    cq: Cq,
    qp: Qp,
    mr: Mr,
    ip: [u8; 4],
}

/// Test range `range` (0..=15) of this process's own addresses:
/// 127.x.y.(16 * range + 1) onwards (15 of them), with x.y from the process id, so
/// concurrent runs of these tests (other worktrees on one machine) never
/// contend for an address, and never for the automatic 127.0.0.x.
fn in_range(range: u8) -> PortAddress {
    PortAddress::FirstFree {
        first: range_start(range),
        count: 15,
    }
}

fn range_start(range: u8) -> Ipv4Addr {
    let pid = std::process::id();
    Ipv4Addr::new(
        127,
        0x80 | (pid >> 8) as u8 & 0x7F,
        pid as u8,
        16 * range + 1,
    )
}

/// The `n`th address (from 0) of test range `range`.
fn nth(range: u8, n: u8) -> Ipv4Addr {
    let [a, b, c, d] = range_start(range).octets();
    Ipv4Addr::new(a, b, c, d + n)
}

fn host(guid: u64, address: PortAddress, qp_type: QpType) -> Host {
    let mem = Arc::new(SimMemory::new(0x40_0000_0000 * guid));
    let dev = Device::new(
        DeviceConfig::with_ports(guid, &[[10, 0, 0, guid as u8]]),
        mem.clone(),
        Arc::new(NoIrq),
    );
    let fabric = UdpFabric::new(vec![dev], &[address]).expect("bind a loopback address");
    let ip = fabric.address(0, 1).expect("port 1 is bound").octets();
    let (drv, cq, qp, mr) = fabric.with_device(0, |dev| {
        let mut drv = Driver::bring_up(dev, mem);
        let cq = drv.create_cq(dev, 8).unwrap();
        let qp = drv
            .create_qp(dev, qp_type, 1, PD, &cq, &cq, None, (6, 6))
            .unwrap();
        let access = AccessFlags::LOCAL_WRITE
            | AccessFlags::REMOTE_WRITE
            | AccessFlags::REMOTE_READ
            | AccessFlags::REMOTE_ATOMIC;
        let mr = drv.reg_mr(dev, REGION, PD, access).unwrap();
        (drv, cq, qp, mr)
    });
    Host {
        fabric,
        drv,
        cq,
        qp,
        mr,
        ip,
    }
}

/// Two RC hosts with a 4096-byte path MTU, connected.
fn big_pair(range: u8) -> (Host, Host) {
    let mut a = host(1, in_range(range), QpType::Rc);
    let mut b = host(2, in_range(range), QpType::Rc);
    let peers = [(b.ip, b.qp.qpn), (a.ip, a.qp.qpn)];
    for (h, (peer_ip, peer_qpn)) in [&mut a, &mut b].into_iter().zip(peers) {
        let Host {
            fabric, drv, qp, ..
        } = h;
        let steps = [
            bring_up::to_init(QpType::Rc, AccessFlags::empty(), 0),
            bring_up::to_rtr(QpType::Rc, peer_ip, peer_qpn, 0, Mtu::Mtu4096),
            bring_up::to_rts(QpType::Rc, 0, ACK_TIMEOUT, 7, 7),
        ];
        for m in &steps {
            let status = fabric.with_device(0, |dev| drv.modify_qp(dev, qp, m));
            assert_eq!(status, hca_prm::cmd::CmdStatus::Ok);
        }
    }
    (a, b)
}

/// Two hosts in distinct ranges of addresses, their QPs connected (RC,
/// UC) or ready (UD).
fn pair(range: u8, qp_type: QpType) -> (Host, Host) {
    let mut a = host(1, in_range(range), qp_type);
    let mut b = host(2, in_range(range), qp_type);
    assert_ne!(a.ip, b.ip, "two instances get distinct addresses");
    let peers = [(b.ip, b.qp.qpn), (a.ip, a.qp.qpn)];
    for (h, (peer_ip, peer_qpn)) in [&mut a, &mut b].into_iter().zip(peers) {
        let Host {
            fabric, drv, qp, ..
        } = h;
        if qp_type == QpType::Ud {
            let steps = [
                bring_up::to_init(QpType::Ud, AccessFlags::empty(), UD_QKEY),
                bring_up::to_rtr(QpType::Ud, [0; 4], 0, 0, Mtu::Mtu1024),
                bring_up::to_rts(QpType::Ud, 0, 0, 0, 0),
            ];
            for m in &steps {
                let status = fabric.with_device(0, |dev| drv.modify_qp(dev, qp, m));
                assert_eq!(status, hca_prm::cmd::CmdStatus::Ok);
            }
        } else {
            let access =
                AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC;
            let steps = [
                bring_up::to_init(qp_type, access, 0),
                bring_up::to_rtr(qp_type, peer_ip, peer_qpn, 0, Mtu::Mtu1024),
                bring_up::to_rts(qp_type, 0, ACK_TIMEOUT, 7, 7),
            ];
            for m in &steps {
                let status = fabric.with_device(0, |dev| drv.modify_qp(dev, qp, m));
                assert_eq!(status, hca_prm::cmd::CmdStatus::Ok);
            }
        }
    }
    (a, b)
}

impl Host {
    fn post(&mut self, wr_id: u64, op: SendOp, at: usize, len: u32, ud: Option<(&Host, Av)>) {
        let sg = [Driver::sge(&self.mr, at as u64, len)];
        let wr = SendWr {
            wr_id,
            op,
            flags: SendFlags::SIGNALED,
            sg_list: &sg,
            ud: ud.as_ref().map(|(peer, _)| UdDest {
                av: AvHandle::from_raw(1),
                remote_qpn: Qpn::new(peer.qp.qpn).unwrap(),
                remote_qkey: QKey::new(UD_QKEY),
            }),
        };
        let av = ud.map(|(_, av)| av);
        let Host {
            fabric, drv, qp, ..
        } = self;
        fabric
            .with_device(0, |dev| {
                drv.post_send(dev, qp, &wr, av.as_ref(), None, true)
            })
            .expect("post_send");
    }

    fn post_recv(&mut self, wr_id: u64, at: usize, len: u32) {
        let sge = Driver::sge(&self.mr, at as u64, len);
        self.drv.post_recv(&mut self.qp, wr_id, &[sge]);
    }

    /// The next completion, waiting (bounded) for the fabric's threads.
    fn completion(&mut self) -> Cqe {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(cqe) = self.drv.poll_cq(&mut self.cq) {
                return cqe;
            }
            assert!(Instant::now() < deadline, "no completion within 10 s");
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    fn remote(&self, at: usize) -> RemoteAddr {
        RemoteAddr {
            addr: self.mr.va + at as u64,
            rkey: self.mr.rkey,
        }
    }

    fn av(&self) -> Av {
        Av::try_from(&AvAttr::roce(PortNum::FIRST, Gid::from_ipv4(self.ip), 0)).unwrap()
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn assert_success(cqe: &Cqe, what: &str) {
    assert_eq!(cqe.status, WcStatus::Success.code(), "{what}: {cqe:?}");
}

#[test]
fn rc_send_write_read_and_atomics_cross_real_udp() {
    let (mut a, mut b) = pair(1, QpType::Rc);

    // A send of three MTUs, checked byte for byte.
    let message = pattern(1, 3000);
    a.drv.write_mr(&a.mr, 0, &message);
    b.post_recv(10, 0, 4096);
    a.post(1, SendOp::Send, 0, 3000, None);
    assert_success(&a.completion(), "send");
    let got = b.completion();
    assert_success(&got, "receive");
    assert_eq!(got.byte_count.get(), 3000);
    assert_eq!(b.drv.read_mr(&b.mr, 0, 3000), message);

    // An RDMA write into B's target area.
    let written = pattern(2, 5000);
    a.drv.write_mr(&a.mr, 0, &written);
    a.post(
        2,
        SendOp::RdmaWrite {
            remote: b.remote(TARGET),
        },
        0,
        5000,
        None,
    );
    assert_success(&a.completion(), "RDMA write");
    assert_eq!(b.drv.read_mr(&b.mr, TARGET, 5000), written);

    // An RDMA read of what B holds.
    let held = pattern(3, 4500);
    b.drv.write_mr(&b.mr, TARGET, &held);
    a.post(
        3,
        SendOp::RdmaRead {
            remote: b.remote(TARGET),
        },
        8192,
        4500,
        None,
    );
    assert_success(&a.completion(), "RDMA read");
    assert_eq!(a.drv.read_mr(&a.mr, 8192, 4500), held);

    // Fetch-and-add, then compare-and-swap, on B's atomic word.
    b.drv.write_mr(&b.mr, ATOMIC, &40u64.to_le_bytes());
    a.post(
        4,
        SendOp::FetchAdd {
            remote: b.remote(ATOMIC),
            add: 2,
        },
        16384,
        8,
        None,
    );
    assert_success(&a.completion(), "fetch and add");
    assert_eq!(a.drv.read_mr(&a.mr, 16384, 8), 40u64.to_le_bytes());
    assert_eq!(b.drv.read_mr(&b.mr, ATOMIC, 8), 42u64.to_le_bytes());
    a.post(
        5,
        SendOp::CompareSwap {
            remote: b.remote(ATOMIC),
            compare: 42,
            swap: 7,
        },
        16384,
        8,
        None,
    );
    assert_success(&a.completion(), "compare and swap");
    assert_eq!(a.drv.read_mr(&a.mr, 16384, 8), 42u64.to_le_bytes());
    assert_eq!(b.drv.read_mr(&b.mr, ATOMIC, 8), 7u64.to_le_bytes());

    // All of it went as real datagrams, none refused.
    let (sa, sb) = (a.fabric.stats(0, 1).unwrap(), b.fabric.stats(0, 1).unwrap());
    assert!(sa.tx_datagrams >= 3 + 5 + 2, "{sa:?}");
    // (A spurious retransmission may still be in flight.)
    assert!(sb.rx_datagrams <= sa.tx_datagrams, "{sa:?} {sb:?}");
    assert!(sa.rx_datagrams <= sb.tx_datagrams, "{sa:?} {sb:?}");
    assert!(sb.rx_datagrams >= 3 + 5 + 2, "{sb:?}");
    assert_eq!(sa.rx_dropped_total() + sb.rx_dropped_total(), 0);
    assert_eq!(sa.tx_errors + sb.tx_errors, 0);
}

#[test]
fn uc_send_and_write_cross_real_udp() {
    let (mut a, mut b) = pair(2, QpType::Uc);
    let message = pattern(4, 2500);
    a.drv.write_mr(&a.mr, 0, &message);
    b.post_recv(1, 0, 4096);
    a.post(1, SendOp::Send, 0, 2500, None);
    assert_success(&a.completion(), "UC send");
    let got = b.completion();
    assert_success(&got, "UC receive");
    assert_eq!(b.drv.read_mr(&b.mr, 0, 2500), message);

    let written = pattern(5, 3333);
    a.drv.write_mr(&a.mr, 0, &written);
    a.post(
        2,
        SendOp::RdmaWrite {
            remote: b.remote(TARGET),
        },
        0,
        3333,
        None,
    );
    assert_success(&a.completion(), "UC write");
    // UC has no acknowledgement: the write lands when its last datagram
    // has been received.
    let deadline = Instant::now() + Duration::from_secs(10);
    while b.drv.read_mr(&b.mr, TARGET, 3333) != written {
        assert!(Instant::now() < deadline, "the UC write never landed");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn ud_sends_cross_real_udp_both_ways() {
    let (mut a, mut b) = pair(3, QpType::Ud);
    ud_round(&mut a, &mut b, 6);
    ud_round(&mut b, &mut a, 7);
}

/// One checked UD send from `from` to `to`.
fn ud_round(from: &mut Host, to: &mut Host, seed: u8) {
    let message = pattern(seed, 900);
    from.drv.write_mr(&from.mr, 0, &message);
    to.post_recv(1, 0, 40 + 900);
    let av = to.av();
    from.post(1, SendOp::Send, 0, 900, Some((to, av)));
    assert_success(&from.completion(), "UD send");
    let got = to.completion();
    assert_success(&got, "UD receive");
    assert!(got.flags().contains(CqeFlags::GRH | CqeFlags::RECV));
    assert_eq!(got.src_qp.get(), from.qp.qpn);
    let data = to.drv.read_mr(&to.mr, 0, 940);
    assert_eq!(&data[40..], &message[..]);
    // The GRH holds the rebuilt IPv4 header: the sender's address.
    assert_eq!(data[20], 0x45);
    assert_eq!(&data[32..36], &from.ip);
}

#[test]
fn a_dropped_datagram_is_recovered_by_retransmission() {
    let (mut a, mut b) = pair(4, QpType::Rc);
    let message = pattern(8, 3000);
    a.drv.write_mr(&a.mr, 0, &message);
    b.post_recv(1, 0, 4096);
    // The first of the send's three datagrams is lost.
    a.fabric.drop_next_datagrams(1);
    a.post(1, SendOp::Send, 0, 3000, None);
    assert_success(&a.completion(), "send after a loss");
    assert_success(&b.completion(), "receive after a loss");
    assert_eq!(b.drv.read_mr(&b.mr, 0, 3000), message);
    let sa = a.fabric.stats(0, 1).unwrap();
    assert_eq!(sa.tx_dropped, 1, "{sa:?}");
    assert!(sa.tx_datagrams >= 3, "the send went again: {sa:?}");
}

/// Every datagram of a send lost: no NAK can tell the requester, only its
/// ACK timer, which the fabric starts once it has sent the datagrams
/// (`Device::set_ack_timers_at_hand_off`): it fires after the timeout and
/// the send goes again.
#[test]
fn a_send_lost_whole_is_recovered_by_the_ack_timer() {
    let (mut a, mut b) = pair(8, QpType::Rc);
    let message = pattern(9, 3000);
    a.drv.write_mr(&a.mr, 0, &message);
    b.post_recv(1, 0, 4096);
    a.fabric.drop_next_datagrams(3);
    let posted = Instant::now();
    a.post(1, SendOp::Send, 0, 3000, None);
    assert_success(&a.completion(), "send after losing it whole");
    assert!(
        posted.elapsed() >= Duration::from_nanos(4096 << ACK_TIMEOUT),
        "recovered by the ACK timer, not before it fired"
    );
    assert_success(&b.completion(), "receive after the retry");
    assert_eq!(b.drv.read_mr(&b.mr, 0, 3000), message);
    let sa = a.fabric.stats(0, 1).unwrap();
    assert_eq!(sa.tx_dropped, 3, "{sa:?}");
    assert_eq!(sa.tx_datagrams, 3, "the send went once more: {sa:?}");
}

#[test]
fn garbage_datagrams_are_counted_and_ignored() {
    let (mut a, mut b) = pair(5, QpType::Rc);
    let target = SocketAddrV4::new(Ipv4Addr::from(b.ip), ROCEV2_PORT);
    let stranger = UdpSocket::bind((nth(5, 14), 0)).expect("a stranger's socket");

    let message = pattern(9, 100);
    a.drv.write_mr(&a.mr, 0, &message);
    b.post_recv(1, 0, 4096);
    a.post(1, SendOp::Send, 0, 100, None);
    assert_success(&a.completion(), "send");
    assert_success(&b.completion(), "receive");
    let before = b.fabric.stats(0, 1).unwrap();

    // Short, not RoCEv2 (BTH TVer 1), a bad ICRC, and empty.
    let sent: &[&[u8]] = &[
        &[0x04, 0x00, 0xFF],
        &[0x04, 0x01, 0xFF, 0xFF, 0, 0, 0, 1, 0, 0, 0, 0, 1, 2, 3, 4],
        &[
            0x04, 0x00, 0xFF, 0xFF, 0, 0, 0, 1, 0, 0, 0, 0, 0xDE, 0xAD, 0xBE, 0xEF,
        ],
        &[],
    ];
    for datagram in sent {
        stranger.send_to(datagram, target).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    let after = loop {
        let s = b.fabric.stats(0, 1).unwrap();
        if s.rx_datagrams >= before.rx_datagrams + sent.len() as u64 {
            break s;
        }
        assert!(Instant::now() < deadline, "the datagrams never arrived");
        std::thread::sleep(Duration::from_millis(1));
    };
    assert_eq!(after.rx_dropped(DropReason::Truncated), 2, "{after:?}");
    assert_eq!(after.rx_dropped(DropReason::BadTver), 1, "{after:?}");
    assert_eq!(after.rx_dropped(DropReason::BadIcrc), 1, "{after:?}");
    assert_eq!(
        after.rx_bytes, before.rx_bytes,
        "nothing reached the device"
    );
    let counters = b.fabric.with_device(0, |d| d.port_counters(1).unwrap());
    assert_eq!(counters.rx_errors, 0, "the fabric refused them first");

    // The connection goes on.
    b.post_recv(2, 0, 4096);
    a.post(2, SendOp::Send, 0, 100, None);
    assert_success(&a.completion(), "send after garbage");
    assert_success(&b.completion(), "receive after garbage");
}

#[test]
fn the_address_chooser_takes_the_first_free_address() {
    let make = |guid| {
        let dev = Device::new(
            DeviceConfig::with_ports(guid, &[[10, 0, 0, 1]]),
            Arc::new(SimMemory::new(0x1000_0000)),
            Arc::new(NoIrq),
        );
        UdpFabric::new(vec![dev], &[in_range(6)]).expect("a free address")
    };
    let first = make(1);
    let second = make(2);
    let third = make(3);
    let addr = |f: &UdpFabric| f.address(0, 1).unwrap();
    assert_eq!(addr(&first), nth(6, 0));
    assert_eq!(addr(&second), nth(6, 1));
    assert_eq!(addr(&third), nth(6, 2));
    // The port's GID and MAC follow its address.
    let mac = second.with_device(0, |d| d.port_mac(1).unwrap());
    let [a, b, c, d] = nth(6, 1).octets();
    assert_eq!(mac, [0x02, 0x00, a, b, c, d]);
    // A fixed address another fabric holds is refused; a freed one is
    // taken again.
    let taken = PortAddress::Fixed(addr(&second));
    assert_eq!(
        taken.bind().unwrap_err().kind(),
        std::io::ErrorKind::AddrInUse
    );
    drop(second);
    let again = make(4);
    assert_eq!(addr(&again), nth(6, 1));
    // No configuration at all: two instances on distinct 127.0.0.x.
    let automatic = |guid| {
        let dev = Device::new(
            DeviceConfig::with_ports(guid, &[[10, 0, 0, 1]]),
            Arc::new(SimMemory::new(0x1000_0000)),
            Arc::new(NoIrq),
        );
        UdpFabric::new(vec![dev], &[]).expect("a free 127.0.0.x")
    };
    let (x, y) = (automatic(5), automatic(6));
    assert_ne!(addr(&x), addr(&y));
    for f in [&x, &y] {
        assert_eq!(addr(f).octets()[..3], [127, 0, 0]);
    }
    drop(third);
}

#[test]
fn a_frame_becomes_its_datagram_and_back() {
    // The frame A's device sends for a one-byte-short-of-a-word send,
    // rebuilt on the other side, is the same packet.
    let (mut a, b) = pair(7, QpType::Rc);
    let _ = &b;
    let frames = std::sync::Mutex::new(Vec::new());
    a.drv.write_mr(&a.mr, 0, &pattern(1, 7));
    let Host {
        fabric,
        drv,
        qp,
        mr,
        ..
    } = &mut a;
    let sg = [Driver::sge(mr, 0, 7)];
    let wr = SendWr {
        wr_id: 1,
        op: SendOp::Send,
        flags: SendFlags::SIGNALED,
        sg_list: &sg,
        ud: None,
    };
    fabric.with_device(0, |dev| {
        // Built but held back: taken here before the fabric sends it.
        drv.post_send(dev, qp, &wr, None, None, true).unwrap();
        dev.drain_tx(|_, f| frames.lock().unwrap().push(f.to_vec()));
    });
    let mut frame = frames.into_inner().unwrap().remove(0);
    let original = *sim_hca::wire::RocePacket::parse(&frame).unwrap().repr();
    let from = SocketAddrV4::new(Ipv4Addr::from(a.ip), ROCEV2_PORT);
    let (dst, range) = datagram_from_frame(&mut frame, from).unwrap();
    assert_eq!(dst, Ipv4Addr::from(b.ip));
    let datagram = frame[range].to_vec();
    let mut buf = vec![0u8; FRAME_HEADROOM + datagram.len()];
    buf[FRAME_HEADROOM..].copy_from_slice(&datagram);
    let len = sim_hca::udp::frame_from_datagram(&mut buf, datagram.len(), from, dst).unwrap();
    let rebuilt = *sim_hca::wire::RocePacket::parse(&buf[..len])
        .unwrap()
        .repr();
    assert_eq!(rebuilt.bth, original.bth);
    assert_eq!(rebuilt.ext, original.ext);
    assert_eq!(rebuilt.payload_len, 7);
    assert_eq!(rebuilt.src_ip, Ipv4Addr::from(a.ip));
    assert_eq!(rebuilt.src_port, ROCEV2_PORT);
}

#[test]
#[ignore = "needs tshark and capture rights on lo: cargo test -p sim-hca --test udp_fabric -- --ignored tshark"]
fn tshark_decodes_the_udp_fabric_traffic() {
    let tshark = std::path::Path::new("/usr/bin/tshark");
    if !tshark.exists() {
        eprintln!("no /usr/bin/tshark: nothing to check");
        return;
    }
    let pcap = std::env::temp_dir().join(format!("udp-fabric-{}.pcap", std::process::id()));
    let mut capture = std::process::Command::new(tshark)
        .args(["-i", "lo", "-f", "udp port 4791", "-w"])
        .arg(&pcap)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start tshark");
    // Let the capture start before the traffic does.
    std::thread::sleep(Duration::from_secs(2));
    let (mut a, mut b) = pair(0, QpType::Rc);
    let message = pattern(10, 3000);
    a.drv.write_mr(&a.mr, 0, &message);
    b.post_recv(1, 0, 4096);
    a.post(1, SendOp::Send, 0, 3000, None);
    assert_success(&a.completion(), "send");
    assert_success(&b.completion(), "receive");
    std::thread::sleep(Duration::from_secs(1));
    // SIGINT lets tshark finish the file.
    let _ = std::process::Command::new("kill")
        .args(["-INT", &capture.id().to_string()])
        .status();
    let _ = capture.wait();
    let out = std::process::Command::new(tshark)
        .arg("-r")
        .arg(&pcap)
        .args([
            "-Y",
            "infiniband",
            "-T",
            "fields",
            "-e",
            "infiniband.bth.opcode",
        ])
        .args(["-e", "ip.src", "-e", "ip.dst"])
        .output()
        .expect("run tshark -r");
    let _ = std::fs::remove_file(&pcap);
    let text = String::from_utf8_lossy(&out.stdout);
    let (sa, sb) = (
        Ipv4Addr::from(a.ip).to_string(),
        Ipv4Addr::from(b.ip).to_string(),
    );
    let lines: Vec<&str> = text.lines().collect();
    // Send first, middle, last (opcodes 0, 1, 2) from A to B, and an ACK
    // (17) back.
    for opcode in ["0", "1", "2"] {
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with(&format!("{opcode}\t{sa}\t{sb}"))),
            "no opcode {opcode} from {sa} to {sb} decoded:\n{text}"
        );
    }
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with(&format!("17\t{sb}\t{sa}"))),
        "no ACK decoded:\n{text}"
    );
}

#[test]
fn a_window_of_large_messages_crosses_without_a_retransmission() {
    // 16 sends of 64 KiB in one burst: 256 datagrams, 1 MiB. A socket
    // receive buffer of the usual default (about 200 KiB) drops most of
    // the burst; the fabric's enlarged one holds it, where the machine's
    // limit (net.core.rmem_max) allows.
    const MESSAGES: u64 = 16;
    const SIZE: usize = 65536;
    let rmem_max: usize = std::fs::read_to_string("/proc/sys/net/core/rmem_max")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    let (mut a, mut b) = big_pair(9);
    let payload = pattern(11, SIZE);
    a.drv.write_mr(&a.mr, 0, &payload);
    for i in 0..MESSAGES {
        b.post_recv(i, 0, SIZE as u32);
    }
    let before = a.fabric.stats(0, 1).unwrap();
    {
        let Host {
            fabric,
            drv,
            qp,
            mr,
            ..
        } = &mut a;
        let sg = [Driver::sge(mr, 0, SIZE as u32)];
        fabric.with_device(0, |dev| {
            for i in 0..MESSAGES {
                let wr = SendWr {
                    wr_id: i,
                    op: SendOp::Send,
                    flags: SendFlags::SIGNALED,
                    sg_list: &sg,
                    ud: None,
                };
                let last = i + 1 == MESSAGES;
                drv.post_send(dev, qp, &wr, None, None, last).unwrap();
            }
        });
    }
    for _ in 0..MESSAGES {
        assert_success(&a.completion(), "send");
        assert_success(&b.completion(), "receive");
    }
    assert_eq!(b.drv.read_mr(&b.mr, 0, SIZE), payload);
    let sent = a.fabric.stats(0, 1).unwrap().tx_datagrams - before.tx_datagrams;
    let packets = MESSAGES * (SIZE as u64 / 4096);
    if rmem_max >= 4 << 20 {
        assert_eq!(sent, packets, "no datagram went twice");
    } else {
        eprintln!("net.core.rmem_max {rmem_max}: {sent} datagrams for {packets} packets");
    }
}
