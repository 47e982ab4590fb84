//! Scenario: two simulated machines in this process, each a threaded host
//! with one HCA (the real miniport and the real IBAL bus filter, booted
//! from our INFs as the threaded host boots them) whose port is a real
//! UDP endpoint (`HostConfig::threaded_udp`, `sim_hca::udp`): a user
//! process on each (`ThreadedSimIo` and the access library with the
//! linked plugin) connects an RC QP to the other's over the ports' real
//! loopback addresses and they exchange byte-checked sends both ways, as
//! two processes on two hosts would. Both machines end shut down with an
//! empty verifier report.
#![cfg(not(windows))]

mod support;

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ib_types::access::AccessFlags;
use ib_types::qp::{QpCaps, QpType};
use ib_types::scalars::{Gid, PortNum, Qpn};
use ib_types::wc::{WcOpcode, WcStatus, WorkCompletion};
use ib_types::wr::{RecvWr, SendFlags, SendOp, SendWr, Sge};
use ibal_user::{
    Buffer, CaSelector, Context, Cq, DeviceIo, Mr, Pd, PluginSource, Qp, QpInit, UserSend,
};
use sim_hca::device::DeviceConfig;
use sim_hca::udp::PortAddress;
use sim_host::host::{Host, HostConfig};
use sim_host::memory::Process;
use sim_shells::rc_path::rc_to_rts_steps;
use sim_shells::user_io::ThreadedSimIo;

use support::{register_stack, settle};

/// The two machines' HCAs, one port each.
const GUIDS: [u64; 2] = [0x0002_C900_0000_7100, 0x0002_C900_0000_7200];
const TX: usize = 0;
const RX: usize = 4096;
const BYTES: usize = 8192;
const MESSAGE: usize = 3000;

const ACCESS: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_READ);

const RC_INIT: QpInit = QpInit {
    qp_type: QpType::Rc,
    caps: QpCaps {
        max_send_wr: 16,
        max_recv_wr: 16,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    },
    sq_sig_all: false,
};

/// The first of this process's own loopback addresses: 127.x.y.1 with
/// x.y from the process id (never 127.0.0.x), so concurrent runs of this
/// test (other worktrees on one machine) never contend for one.
fn own_addresses() -> Ipv4Addr {
    let pid = std::process::id();
    Ipv4Addr::new(127, 0x80 | (pid >> 8) as u8 & 0x7F, pid as u8, 1)
}

/// A threaded machine with HCA `guid`, its port on the first free one of
/// this process's addresses, the stack booted.
fn machine(guid: u64) -> Arc<Host> {
    let config = HostConfig::threaded_udp(
        2,
        vec![DeviceConfig::with_ports(guid, &[[10, 9, 0, 1]])],
        vec![PortAddress::FirstFree {
            first: own_addresses(),
            count: 32,
        }],
    );
    let host = Arc::new(Host::new(config).expect("a machine on the UDP fabric"));
    let _drivers = register_stack(&host);
    host.boot();
    settle(&host);
    host
}

/// Opens the CA of `guid`, waiting (bounded) for the threaded machine to
/// have started its port child.
fn open(host: &Host, io: &Arc<dyn DeviceIo>, guid: u64) -> Context {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match Context::open(io, CaSelector::Guid(guid), &PluginSource::Linked) {
            Ok(ctx) => return ctx,
            Err(e) => assert!(Instant::now() < deadline, "opening the CA: {e}"),
        }
        settle(host);
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A process's RC endpoint: its objects live on `ctx`.
struct End<'c> {
    pd: &'c Pd<'c>,
    buffer: &'c Buffer<'c>,
    cq: &'c Cq<'c>,
}

impl End<'_> {
    fn sge(&self, mr: &Mr<'_, '_>, offset: usize, len: usize) -> Sge {
        Sge::new(self.buffer.va() + offset as u64, len as u32, mr.keys().lkey)
    }

    /// Completions until one came (or 20 s passed).
    fn completion(&self) -> WorkCompletion {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut wcs = [WorkCompletion::EMPTY; 1];
        loop {
            if self.cq.poll(&mut wcs).unwrap() == 1 {
                return wcs[0];
            }
            assert!(Instant::now() < deadline, "no completion within 20 s");
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

fn message(seed: u8) -> Vec<u8> {
    (0..MESSAGE)
        .map(|i| (i as u8).wrapping_mul(17).wrapping_add(seed))
        .collect()
}

/// `from` sends one message to `to`, checked byte for byte.
fn one_way(
    (from, from_qp, from_mr): (&End<'_>, &mut Qp<'_, '_>, &Mr<'_, '_>),
    (to, to_qp, to_mr): (&End<'_>, &mut Qp<'_, '_>, &Mr<'_, '_>),
    seed: u8,
) {
    let payload = message(seed);
    from.buffer.write(TX, &payload).unwrap();
    let recv_sge = [to.sge(to_mr, RX, MESSAGE)];
    let posted = to_qp
        .post_recv(&[RecvWr {
            wr_id: u64::from(seed),
            sg_list: &recv_sge,
        }])
        .unwrap();
    assert_eq!(posted, 1);
    let send_sge = [from.sge(from_mr, TX, MESSAGE)];
    let send = [UserSend {
        wr: SendWr {
            wr_id: 1000 + u64::from(seed),
            op: SendOp::Send,
            flags: SendFlags::SIGNALED,
            sg_list: &send_sge,
            ud: None,
        },
        inline: None,
    }];
    assert_eq!(from_qp.post_send(&send).unwrap(), 1);
    let sent = from.completion();
    assert_eq!(
        (sent.wr_id, sent.status, sent.opcode),
        (1000 + u64::from(seed), WcStatus::Success, WcOpcode::Send)
    );
    let got = to.completion();
    assert_eq!(
        (got.wr_id, got.status, got.opcode, got.byte_len),
        (
            u64::from(seed),
            WcStatus::Success,
            WcOpcode::Recv,
            MESSAGE as u32
        )
    );
    let mut landed = vec![0; MESSAGE];
    to.buffer.read(RX, &mut landed).unwrap();
    assert_eq!(landed, payload, "message {seed}");
}

#[test]
fn two_machines_on_the_udp_fabric_exchange_rc_sends_between_user_processes() {
    let hosts = [machine(GUIDS[0]), machine(GUIDS[1])];
    let addresses = [0, 1].map(|i| hosts[i].backplane().udp_address(0, 1).unwrap());
    assert_ne!(addresses[0], addresses[1], "each machine its own address");
    let processes = [Process::new(201), Process::new(202)];
    {
        let ios: [Arc<dyn DeviceIo>; 2] =
            [0, 1].map(|i| ThreadedSimIo::new(&hosts[i], &processes[i]) as Arc<dyn DeviceIo>);
        let ctxs = [0, 1].map(|i| open(&hosts[i], &ios[i], GUIDS[i]));
        let pds = [0, 1].map(|i| Pd::new(&ctxs[i]).unwrap());
        let buffers = [0, 1].map(|i| Buffer::new(&ctxs[i], BYTES).unwrap());
        let cqs = [0, 1].map(|i| Cq::new(&ctxs[i], 64).unwrap());
        let ends = [0, 1].map(|i| End {
            pd: &pds[i],
            buffer: &buffers[i],
            cq: &cqs[i],
        });
        let mut qps =
            [0, 1].map(|i| Qp::new(ends[i].pd, ends[i].cq, ends[i].cq, &RC_INIT).unwrap());
        let mrs = [0, 1].map(|i| Mr::new(ends[i].pd, ends[i].buffer, ACCESS).unwrap());
        // Each QP towards the other machine's port GID: its address,
        // IPv4-mapped, as the port reports it.
        let gids = addresses.map(|a| Gid::from_ipv4(a.octets()));
        let port = PortNum::new(1).unwrap();
        for (i, j) in [(0, 1), (1, 0)] {
            let attr = ctxs[i].query_raw().unwrap();
            let view = ib_types::ca::CaAttrView::parse(&attr).unwrap();
            assert_eq!(view.port(port).unwrap().gids()[0], gids[i], "GID 0");
            let dest = Qpn::new(qps[j].qpn()).unwrap();
            let remote = ACCESS - AccessFlags::LOCAL_WRITE;
            for step in rc_to_rts_steps(port, remote, dest, gids[j], 2) {
                qps[i].modify(&step).unwrap();
            }
        }
        let [qp_a, qp_b] = &mut qps;
        for round in 0..4u8 {
            one_way(
                (&ends[0], qp_a, &mrs[0]),
                (&ends[1], qp_b, &mrs[1]),
                2 * round,
            );
            one_way(
                (&ends[1], qp_b, &mrs[1]),
                (&ends[0], qp_a, &mrs[0]),
                2 * round + 1,
            );
        }
        // It all went as real datagrams: four messages of three packets
        // each way, and the acknowledgements back.
        for (i, j) in [(0, 1), (1, 0)] {
            let (mine, theirs) = (
                hosts[i].backplane().udp_stats(0, 1).unwrap(),
                hosts[j].backplane().udp_stats(0, 1).unwrap(),
            );
            assert!(theirs.rx_datagrams >= 4 * 3, "{theirs:?}");
            // (A spurious retransmission may still be in flight.)
            assert!(
                theirs.rx_datagrams <= mine.tx_datagrams,
                "{mine:?} {theirs:?}"
            );
            assert_eq!(theirs.rx_dropped_total(), 0, "{theirs:?}");
        }
    }
    for (host, process) in hosts.iter().zip(&processes) {
        assert_eq!(process.exit(), 0, "nothing left locked");
        host.shut_down();
        host.verifier().assert_clean();
    }
}
