//! Scenario: a user process's access library (`ibal-user`, the linked
//! UVP plugin) against peers on the other HCA, over the real IBAL bus
//! filter and miniport, two HCAs with two ports each and a kernel client
//! (`ibportclient`) on every port child. Every data verb a user QP has,
//! byte-checked, against a kernel client of the other HCA's port child and
//! against another process on the other HCA; and a process dying
//! mid-traffic (on the deterministic host at several points of the
//! traffic, and on a threaded host): what it held is released, its peers'
//! QPs fail with error completions, and the peers recreate their QPs and
//! talk to a new process; and a doorbell rung on one process's page for
//! another process's QP, which moves nothing. Every test ends with the
//! host shut down and the verifier report empty.
#![cfg(not(windows))]

mod support;

use std::sync::Arc;

use ib_types::access::AccessFlags;
use ib_types::cq::{CqAttr, CqNotify};
use ib_types::ioctl::{AllocPd, CreateCq, CreateQp, DeallocPd, DestroyCq, Empty, ModifyQp};
use ib_types::qp::{QpCaps, QpModify, QpState, QpType};
use ib_types::scalars::{Gid, PortNum, Psn, QKey, Qpn};
use ib_types::status::IbStatus;
use ib_types::wc::{WcOpcode, WcStatus, WorkCompletion};
use ib_types::wr::{RecvWr, RemoteAddr, SendFlags, SendOp, SendWr, Sge, UdDest};
use ibal_user::{
    ArmFor, Av, Buffer, CaSelector, Context, Cq, DeviceIo, Mr, Pd, PluginSource, Qp, QpInit,
    UserSend,
};
use sim_host::host::{Host, HostConfig};
use sim_host::memory::Process;
use sim_shells::rc_path::{grh_av, rc_qp_create, rc_to_rts_steps};
use sim_shells::user_io::{SimIo, ThreadedSimIo};

use support::*;

/// Both ends' memory (a kernel client's common buffer, a process's
/// buffer) laid out alike: what a side sends from, receives into, exposes
/// to RDMA, the atomic word, and where datagrams land.
const TX: usize = 0;
const RX: usize = 2048;
const RDMA: usize = 4096;
const ATOMIC: usize = 6144;
const UD_RX: usize = 6400;
/// A UD receive starts with the 40-byte GRH.
const GRH: usize = 40;
const QKEY: u32 = 0x1111;
/// Reads and atomics in flight, each way.
const RD_ATOMIC: u8 = 2;

/// Local write and every remote right: the target of RDMA and atomics.
const ACCESS: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_ATOMIC);

const RC_INIT: QpInit = QpInit {
    qp_type: QpType::Rc,
    caps: QpCaps {
        max_send_wr: 16,
        max_recv_wr: 16,
        max_send_sge: 2,
        max_recv_sge: 2,
        max_inline_data: 64,
    },
    sq_sig_all: false,
};

const UD_INIT: QpInit = QpInit {
    qp_type: QpType::Ud,
    caps: QpCaps {
        max_send_wr: 8,
        max_recv_wr: 8,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    },
    sq_sig_all: false,
};

/// Port 1 of HCA `hca` (support's addressing: 10.0.`hca`.1).
fn gid_of(hca: u8) -> Gid {
    Gid::from_ipv4([10, 0, hca, 1])
}

fn port1() -> PortNum {
    PortNum::new(1).unwrap()
}

/// RESET -> INIT -> RTR -> RTS of an RC QP on port 1 towards QP `dest` on
/// port 1 of HCA `dest_hca`, granting remote writes, reads and atomics.
fn rc_steps(dest: u32, dest_hca: u8) -> [QpModify; 3] {
    rc_to_rts_steps(
        port1(),
        ACCESS - AccessFlags::LOCAL_WRITE,
        Qpn::new(dest).unwrap(),
        gid_of(dest_hca),
        RD_ATOMIC,
    )
}

/// RESET -> INIT -> RTR -> RTS of a UD QP on port 1.
fn ud_steps() -> [QpModify; 3] {
    [
        QpModify {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(port1()),
            qkey: Some(QKey::new(QKEY)),
            ..QpModify::default()
        },
        QpModify::to_state(QpState::Rtr),
        QpModify {
            state: Some(QpState::Rts),
            sq_psn: Some(Psn::new(5).unwrap()),
            ..QpModify::default()
        },
    ]
}

/// Deterministic, non-trivial bytes.
fn bytes(seed: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u32)
                .wrapping_mul(29)
                .wrapping_add(seed.wrapping_mul(13)) as u8
        })
        .collect()
}

/// One side of the traffic: an RC QP and a UD QP on one CQ, over memory
/// laid out as [`TX`] .. [`UD_RX`] say, registered with [`ACCESS`].
trait End {
    fn rc_qpn(&self) -> u32;
    fn ud_qpn(&self) -> u32;
    /// Modifies its RC (`rc`) or UD QP.
    fn modify(&self, rc: bool, step: &QpModify);
    fn write(&self, offset: usize, data: &[u8]);
    fn read(&self, offset: usize, len: usize) -> Vec<u8>;
    /// The RDMA address of `offset` in its memory.
    fn remote(&self, offset: usize) -> RemoteAddr;
    /// Posts one receive of `len` bytes at `offset` on its RC (`rc`) or UD
    /// QP.
    fn post_recv(&mut self, rc: bool, wr_id: u64, offset: usize, len: u32);
    /// Posts one signaled send on its RC QP gathering `pieces` (offset,
    /// length) of its memory.
    fn post_send(&mut self, wr_id: u64, pieces: &[(usize, u32)]);
    /// Posts one signaled RDMA write of `len` bytes at `offset` of its
    /// memory to `remote`.
    fn post_write(&mut self, wr_id: u64, offset: usize, len: u32, remote: RemoteAddr);
    /// Everything its CQ holds.
    fn poll(&self) -> Vec<WorkCompletion>;
}

/// Connects `a` (on HCA `a_hca`) and `b` (on `b_hca`): their RC QPs to
/// each other, their UD QPs to RTS.
fn connect(a: &dyn End, a_hca: u8, b: &dyn End, b_hca: u8) {
    for step in rc_steps(b.rc_qpn(), b_hca) {
        a.modify(true, &step);
    }
    for step in rc_steps(a.rc_qpn(), a_hca) {
        b.modify(true, &step);
    }
    for end in [a, b] {
        for step in ud_steps() {
            end.modify(false, &step);
        }
    }
}

// ---------------------------------------------------------------------
// A kernel client's end: its AL on the port child, a common buffer
// registered physically.

struct KernelEnd {
    host: Arc<Host>,
    client: Arc<PortClient>,
    pd: u64,
    cq: u64,
    rc: (u64, u32),
    ud: (u64, u32),
    memory: Memory,
}

impl KernelEnd {
    fn new(host: &Arc<Host>, client: Arc<PortClient>) -> Self {
        let (_, id) = client.al();
        let ca = id.ca_handle();
        let pd = call::<AllocPd>(host, &client, ca, &Empty).unwrap();
        let attr = CqAttr {
            cqe: 64,
            comp_vector: 0,
        };
        let cq = call::<CreateCq>(host, &client, ca, &attr).unwrap();
        let memory = register_with(host, &client, pd, ACCESS);
        let mut end = Self {
            host: Arc::clone(host),
            client,
            pd,
            cq,
            rc: (0, 0),
            ud: (0, 0),
            memory,
        };
        end.create_qps();
        end
    }

    /// Creates its RC QP (two SGEs each way) and its UD QP, on its PD and
    /// CQ.
    fn create_qps(&mut self) {
        let (_, id) = self.client.al();
        let qp = |qp_type| {
            let mut create = rc_qp_create(qp_type, self.pd, self.cq, 8);
            if qp_type == QpType::Rc {
                create.caps.max_send_sge = 2;
                create.caps.max_recv_sge = 2;
            }
            let (qp, out) =
                call_out::<CreateQp>(&self.host, &self.client, id.ca_handle(), &create, &[])
                    .unwrap();
            (qp, out.unwrap().qpn.get())
        };
        self.rc = qp(QpType::Rc);
        self.ud = qp(QpType::Ud);
    }

    /// Destroys its QPs (and creates new ones when `again`).
    fn destroy_qps(&mut self, again: bool) {
        for qp in [self.rc.0, self.ud.0] {
            call::<ib_types::ioctl::DestroyQp>(&self.host, &self.client, qp, &Empty).unwrap();
        }
        self.poll();
        if again {
            self.create_qps();
        }
    }

    fn destroy(mut self) {
        self.destroy_qps(false);
        call::<ib_types::ioctl::DeregMr>(&self.host, &self.client, self.memory.mr, &Empty).unwrap();
        call::<DestroyCq>(&self.host, &self.client, self.cq, &Empty).unwrap();
        call::<DeallocPd>(&self.host, &self.client, self.pd, &Empty).unwrap();
        free_dma(&self.memory.dma);
    }

    fn sge(&self, offset: usize, len: u32) -> Sge {
        Sge::new(self.memory.start + offset as u64, len, self.memory.lkey)
    }
}

impl End for KernelEnd {
    fn rc_qpn(&self) -> u32 {
        self.rc.1
    }
    fn ud_qpn(&self) -> u32 {
        self.ud.1
    }
    fn modify(&self, rc: bool, step: &QpModify) {
        let qp = if rc { self.rc.0 } else { self.ud.0 };
        call::<ModifyQp>(&self.host, &self.client, qp, step).unwrap();
    }
    fn write(&self, offset: usize, data: &[u8]) {
        assert!(self.memory.write(offset, data));
    }
    fn read(&self, offset: usize, len: usize) -> Vec<u8> {
        let mut out = vec![0; len];
        assert!(self.memory.read(offset, &mut out));
        out
    }
    fn remote(&self, offset: usize) -> RemoteAddr {
        RemoteAddr {
            addr: self.memory.start + offset as u64,
            rkey: self.memory.rkey,
        }
    }
    /// Posted by a direct call of the AL from this (PASSIVE_LEVEL) thread,
    /// which runs nothing of the machine: the traffic moves when the test
    /// settles it.
    fn post_recv(&mut self, rc: bool, wr_id: u64, offset: usize, len: u32) {
        let (al, id) = self.client.al();
        let qp = if rc { self.rc.0 } else { self.ud.0 };
        let sges = [self.sge(offset, len)];
        let wrs = [RecvWr {
            wr_id,
            sg_list: &sges,
        }];
        assert_eq!(al.post_recv(id, qp, &wrs), (1, IbStatus::Success));
    }
    fn post_send(&mut self, wr_id: u64, pieces: &[(usize, u32)]) {
        let (al, id) = self.client.al();
        let sges: Vec<Sge> = pieces.iter().map(|&(o, l)| self.sge(o, l)).collect();
        let wrs = [SendWr {
            wr_id,
            op: SendOp::Send,
            flags: SendFlags::SIGNALED,
            sg_list: &sges,
            ud: None,
        }];
        assert_eq!(al.post_send(id, self.rc.0, &wrs), (1, IbStatus::Success));
    }
    fn post_write(&mut self, wr_id: u64, offset: usize, len: u32, remote: RemoteAddr) {
        let (al, id) = self.client.al();
        let sges = [self.sge(offset, len)];
        let wrs = [SendWr {
            wr_id,
            op: SendOp::RdmaWrite { remote },
            flags: SendFlags::SIGNALED,
            sg_list: &sges,
            ud: None,
        }];
        assert_eq!(al.post_send(id, self.rc.0, &wrs), (1, IbStatus::Success));
    }
    fn poll(&self) -> Vec<WorkCompletion> {
        poll(&self.host, &self.client, self.cq)
    }
}

// ---------------------------------------------------------------------
// A process's end, through the access library.

/// What a process's QPs live on: one PD, one buffer, one CQ.
struct Resources<'c> {
    pd: Pd<'c>,
    buffer: Buffer<'c>,
    cq: Cq<'c>,
}

impl<'c> Resources<'c> {
    fn new(ctx: &'c Context) -> Self {
        Self {
            pd: Pd::new(ctx).unwrap(),
            buffer: Buffer::new(ctx, MEM_BYTES).unwrap(),
            cq: Cq::new(ctx, 64).unwrap(),
        }
    }
}

struct UserEnd<'r> {
    // Dropped in this order: the QPs, then the region.
    rc: Qp<'r, 'r>,
    ud: Qp<'r, 'r>,
    mr: Mr<'r, 'r>,
    res: &'r Resources<'r>,
}

impl<'r> UserEnd<'r> {
    fn new(res: &'r Resources<'r>) -> Self {
        Self {
            rc: Qp::new(&res.pd, &res.cq, &res.cq, &RC_INIT).unwrap(),
            ud: Qp::new(&res.pd, &res.cq, &res.cq, &UD_INIT).unwrap(),
            mr: Mr::new(&res.pd, &res.buffer, ACCESS).unwrap(),
            res,
        }
    }

    fn sge(&self, offset: usize, len: u32) -> Sge {
        Sge::new(
            self.res.buffer.va() + offset as u64,
            len,
            self.mr.keys().lkey,
        )
    }

    /// Posts `op` with `sges` on its RC QP, signaled.
    fn post_rc(&mut self, wr_id: u64, op: SendOp, sges: &[Sge], inline: Option<&[u8]>) {
        let flags = if inline.is_some() {
            SendFlags::SIGNALED | SendFlags::INLINE
        } else {
            SendFlags::SIGNALED
        };
        let send = [UserSend {
            wr: SendWr {
                wr_id,
                op,
                flags,
                sg_list: sges,
                ud: None,
            },
            inline,
        }];
        assert_eq!(self.rc.post_send(&send).unwrap(), 1);
    }
}

impl End for UserEnd<'_> {
    fn rc_qpn(&self) -> u32 {
        self.rc.qpn()
    }
    fn ud_qpn(&self) -> u32 {
        self.ud.qpn()
    }
    fn modify(&self, rc: bool, step: &QpModify) {
        let qp = if rc { &self.rc } else { &self.ud };
        qp.modify(step).unwrap();
    }
    fn write(&self, offset: usize, data: &[u8]) {
        self.res.buffer.write(offset, data).unwrap();
    }
    fn read(&self, offset: usize, len: usize) -> Vec<u8> {
        let mut out = vec![0; len];
        self.res.buffer.read(offset, &mut out).unwrap();
        out
    }
    fn remote(&self, offset: usize) -> RemoteAddr {
        RemoteAddr {
            addr: self.res.buffer.va() + offset as u64,
            rkey: self.mr.keys().rkey,
        }
    }
    fn post_recv(&mut self, rc: bool, wr_id: u64, offset: usize, len: u32) {
        let sges = [self.sge(offset, len)];
        let wrs = [RecvWr {
            wr_id,
            sg_list: &sges,
        }];
        let qp = if rc { &mut self.rc } else { &mut self.ud };
        assert_eq!(qp.post_recv(&wrs).unwrap(), 1);
    }
    fn post_send(&mut self, wr_id: u64, pieces: &[(usize, u32)]) {
        let sges: Vec<Sge> = pieces.iter().map(|&(o, l)| self.sge(o, l)).collect();
        self.post_rc(wr_id, SendOp::Send, &sges, None);
    }
    fn post_write(&mut self, wr_id: u64, offset: usize, len: u32, remote: RemoteAddr) {
        let sges = [self.sge(offset, len)];
        self.post_rc(wr_id, SendOp::RdmaWrite { remote }, &sges, None);
    }
    fn poll(&self) -> Vec<WorkCompletion> {
        let mut all = Vec::new();
        let mut wcs = [WorkCompletion::EMPTY; 8];
        loop {
            match self.res.cq.poll(&mut wcs).unwrap() {
                0 => break all,
                n => all.extend_from_slice(&wcs[..n]),
            }
        }
    }
}

/// `(wr_id, status, opcode, byte_len)` of each completion; the length is
/// defined for receives, reads and atomics only (zero here for the rest).
fn summary(wcs: &[WorkCompletion]) -> Vec<(u64, WcStatus, WcOpcode, u32)> {
    wcs.iter()
        .map(|wc| {
            let defined = matches!(
                wc.opcode,
                WcOpcode::Recv
                    | WcOpcode::RecvRdmaWithImm
                    | WcOpcode::RdmaRead
                    | WcOpcode::CompareSwap
                    | WcOpcode::FetchAdd
            );
            let len = if defined { wc.byte_len } else { 0 };
            (wc.wr_id, wc.status, wc.opcode, len)
        })
        .collect()
}

// ---------------------------------------------------------------------
// The world: kernel clients on every port child, processes on the HCAs.

/// Objects the proxies record, user contexts the miniports hold, and
/// `process`'s handles, locked pages and device mappings.
fn leftovers(w: &SharedWorld, process: &Process) -> [usize; 5] {
    [
        w.driver
            .devices()
            .iter()
            .map(|d| d.proxy().object_count())
            .sum(),
        w.miniport
            .devices()
            .iter()
            .filter_map(|d| d.hca())
            .map(|h| h.user_context_count())
            .sum(),
        w.host.pnp().process_handle_count(process),
        process.space().locked_pages(),
        process.space().device_mapping_count(),
    ]
}

fn finish_shared(w: SharedWorld) {
    w.host.shut_down();
    w.host.verifier().assert_clean();
}

/// The process's OS seam: the calling thread settles a deterministic
/// host, and blocks while a threaded host's workers run.
fn io_of(w: &SharedWorld, process: &Process) -> Arc<dyn DeviceIo> {
    if threaded(&w.host) {
        ThreadedSimIo::new(&w.host, process)
    } else {
        SimIo::new(&w.host, process)
    }
}

fn threaded(host: &Host) -> bool {
    host.scheduler().mode() == sim_host::sched::Mode::Threaded
}

/// Runs the machine until `done` holds: on a deterministic host once
/// (settled, every timer through); on a threaded one until it holds or
/// 20 s passed, since what a timer starts (an interrupt's moderation, a
/// teardown's quiet period) is not waited for by a quiesce.
fn eventually(host: &Host, done: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    settle(host);
    while threaded(host) && !done() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(1));
        settle(host);
    }
}

/// What `end`'s CQ yields once the machine ran: at once on a
/// deterministic host (settled, every timer through), or as it arrives on
/// a threaded one, until `expected` completions came (or 20 s passed).
fn completions(host: &Host, end: &dyn End, expected: usize) -> Vec<WorkCompletion> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut all = Vec::new();
    loop {
        settle(host);
        all.extend(end.poll());
        if !threaded(host) || all.len() >= expected || std::time::Instant::now() > deadline {
            return all;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Opens the CA of HCA `hca` through the linked plugin.
fn open(io: &Arc<dyn DeviceIo>, hca: usize) -> Context {
    Context::open(io, CaSelector::Guid(HCAS[hca]), &PluginSource::Linked).unwrap()
}

/// Every data verb of `user` (on HCA 0) against `peer` (on HCA 1), bytes
/// checked at both ends: RC sends both ways (gathered, inline, and
/// scattered into two receive SGEs), an RDMA write, an RDMA read,
/// fetch-and-add and compare-and-swap (the old value returned and the
/// memory after, a failing compare included), and a datagram through a
/// user address vector. `user` makes no request to the kernel throughout.
fn every_verb(host: &Host, user: &mut UserEnd<'_>, process: &Process, peer: &mut dyn End) {
    connect(user, 0, peer, 1);
    let requests = process.requests_issued();

    // RC send, gathered from two pieces.
    let (first, second) = (bytes(1, 300), bytes(2, 700));
    user.write(TX, &first);
    user.write(TX + 1024, &second);
    peer.post_recv(true, 10, RX, 2048);
    user.post_send(1, &[(TX, 300), (TX + 1024, 700)]);
    settle(host);
    assert_eq!(
        summary(&user.poll()),
        [(1, WcStatus::Success, WcOpcode::Send, 0)]
    );
    assert_eq!(
        summary(&peer.poll()),
        [(10, WcStatus::Success, WcOpcode::Recv, 1000)]
    );
    assert_eq!(peer.read(RX, 1000), [first, second].concat(), "gathered");

    // RC send, inline: the bytes travel in the WQE, not from the memory
    // its SGE names (left zero).
    let inline = bytes(3, 48);
    peer.post_recv(true, 11, RX, 2048);
    let sge = [user.sge(TX + 1536, 48)];
    user.post_rc(2, SendOp::Send, &sge, Some(&inline));
    settle(host);
    assert_eq!(
        summary(&user.poll()),
        [(2, WcStatus::Success, WcOpcode::Send, 0)]
    );
    assert_eq!(
        summary(&peer.poll()),
        [(11, WcStatus::Success, WcOpcode::Recv, 48)]
    );
    assert_eq!(peer.read(RX, 48), inline, "inline");

    // RC send the other way, gathered by the peer and scattered into two
    // receive SGEs of the user.
    let from_peer = bytes(4, 900);
    peer.write(TX, &from_peer[..400]);
    peer.write(TX + 1024, &from_peer[400..]);
    let scatter = [user.sge(RX, 100), user.sge(RX + 512, 1024)];
    assert_eq!(
        user.rc
            .post_recv(&[RecvWr {
                wr_id: 12,
                sg_list: &scatter
            }])
            .unwrap(),
        1
    );
    peer.post_send(13, &[(TX, 400), (TX + 1024, 500)]);
    settle(host);
    assert_eq!(
        summary(&peer.poll()),
        [(13, WcStatus::Success, WcOpcode::Send, 0)]
    );
    assert_eq!(
        summary(&user.poll()),
        [(12, WcStatus::Success, WcOpcode::Recv, 900)]
    );
    assert_eq!(user.read(RX, 100), from_peer[..100], "first receive SGE");
    assert_eq!(
        user.read(RX + 512, 800),
        from_peer[100..],
        "second receive SGE"
    );

    // RDMA write of more than one MTU into the peer's memory: no receive
    // consumed there.
    let written = bytes(5, 1500);
    user.write(TX, &written);
    let sge = [user.sge(TX, 1500)];
    let remote = peer.remote(RDMA);
    user.post_rc(3, SendOp::RdmaWrite { remote }, &sge, None);
    settle(host);
    assert_eq!(
        summary(&user.poll()),
        [(3, WcStatus::Success, WcOpcode::RdmaWrite, 0)]
    );
    assert!(peer.poll().is_empty(), "a write consumes no receive");
    assert_eq!(peer.read(RDMA, 1500), written, "RDMA write");

    // RDMA read of the peer's memory.
    let exposed = bytes(6, 1800);
    peer.write(RDMA, &exposed);
    let sge = [user.sge(RX, 1800)];
    user.post_rc(4, SendOp::RdmaRead { remote }, &sge, None);
    settle(host);
    assert_eq!(
        summary(&user.poll()),
        [(4, WcStatus::Success, WcOpcode::RdmaRead, 1800)]
    );
    assert_eq!(user.read(RX, 1800), exposed, "RDMA read");
    assert!(peer.poll().is_empty());

    // Atomics on the peer's word: fetch-and-add, then a compare-and-swap
    // that holds, then one that does not.
    let start = 0x0102_0304_0506_0708_u64;
    peer.write(ATOMIC, &start.to_le_bytes());
    let word = peer.remote(ATOMIC);
    let sge = [user.sge(ATOMIC, 8)];
    let cases = [
        (
            SendOp::FetchAdd {
                remote: word,
                add: 0x10,
            },
            start,
            start + 0x10,
        ),
        (
            SendOp::CompareSwap {
                remote: word,
                compare: start + 0x10,
                swap: 0xDEAD_BEEF_0000_0001,
            },
            start + 0x10,
            0xDEAD_BEEF_0000_0001,
        ),
        (
            SendOp::CompareSwap {
                remote: word,
                compare: 1,
                swap: 2,
            },
            0xDEAD_BEEF_0000_0001,
            0xDEAD_BEEF_0000_0001,
        ),
    ];
    for (i, (op, old, after)) in cases.into_iter().enumerate() {
        let wr_id = 20 + i as u64;
        let opcode = if matches!(op, SendOp::FetchAdd { .. }) {
            WcOpcode::FetchAdd
        } else {
            WcOpcode::CompareSwap
        };
        user.write(ATOMIC, &[0xEE; 8]);
        user.post_rc(wr_id, op, &sge, None);
        settle(host);
        assert_eq!(
            summary(&user.poll()),
            [(wr_id, WcStatus::Success, opcode, 8)]
        );
        let returned = u64::from_le_bytes(user.read(ATOMIC, 8).try_into().unwrap());
        let memory = u64::from_le_bytes(peer.read(ATOMIC, 8).try_into().unwrap());
        assert_eq!((returned, memory), (old, after), "atomic {i}: {op:?}");
    }
    assert!(peer.poll().is_empty());

    // A datagram through a user address vector.
    let av = Av::new(&user.res.pd, &grh_av(port1(), gid_of(1))).unwrap();
    let datagram = bytes(7, 1000);
    user.write(TX, &datagram);
    peer.post_recv(false, 30, UD_RX, (GRH + 1000) as u32);
    let sge = [user.sge(TX, 1000)];
    let send = [UserSend {
        wr: SendWr {
            wr_id: 31,
            op: SendOp::Send,
            flags: SendFlags::SIGNALED,
            sg_list: &sge,
            ud: Some(UdDest {
                av: av.handle(),
                remote_qpn: Qpn::new(peer.ud_qpn()).unwrap(),
                remote_qkey: QKey::new(QKEY),
            }),
        },
        inline: None,
    }];
    assert_eq!(user.ud.post_send(&send).unwrap(), 1);
    settle(host);
    assert_eq!(
        summary(&user.poll()),
        [(31, WcStatus::Success, WcOpcode::Send, 0)]
    );
    let got = peer.poll();
    assert_eq!(
        summary(&got),
        [(30, WcStatus::Success, WcOpcode::Recv, (GRH + 1000) as u32)]
    );
    assert_eq!(got[0].src_qp.get(), user.ud.qpn(), "the sender named");
    assert_eq!(peer.read(UD_RX + GRH, 1000), datagram, "datagram");

    assert_eq!(
        process.requests_issued(),
        requests,
        "posts, polls and the AV stayed in user mode"
    );
}

#[test]
fn every_data_verb_from_user_mode_against_a_kernel_client_of_the_other_hca() {
    let w = shared_world(81);
    let process = Process::new(90);
    let io = io_of(&w, &process);
    let mut kernel = KernelEnd::new(&w.host, w.clients.client(1, 1));
    {
        let ctx = open(&io, 0);
        let res = Resources::new(&ctx);
        let mut user = UserEnd::new(&res);
        every_verb(&w.host, &mut user, &process, &mut kernel);
    }
    kernel.destroy();
    assert_eq!(leftovers(&w, &process), [0; 5]);
    assert_eq!(process.exit(), 0);
    finish_shared(w);
}

#[test]
fn every_data_verb_from_user_mode_against_another_process_on_the_other_hca() {
    let w = shared_world(82);
    let (process, other) = (Process::new(91), Process::new(92));
    let (io, other_io) = (io_of(&w, &process), io_of(&w, &other));
    {
        let (ctx, other_ctx) = (open(&io, 0), open(&other_io, 1));
        let (res, other_res) = (Resources::new(&ctx), Resources::new(&other_ctx));
        let mut user = UserEnd::new(&res);
        let mut peer = UserEnd::new(&other_res);
        let requests = other.requests_issued();
        every_verb(&w.host, &mut user, &process, &mut peer);
        assert_eq!(
            other.requests_issued(),
            requests + 6,
            "the peer's six modifies only: its posts and polls stayed in user mode"
        );
    }
    for p in [&process, &other] {
        assert_eq!(leftovers(&w, p), [0; 5]);
        assert_eq!(p.exit(), 0);
    }
    finish_shared(w);
}

// ---------------------------------------------------------------------
// A process dying mid-traffic.

/// `a` sends 777 bytes to `b` on their RC QPs and `b` answers with as
/// many, settled and checked byte for byte at both ends.
fn exchange(host: &Host, a: &mut dyn End, b: &mut dyn End, seed: u32) {
    one_way(host, a, b, seed);
    one_way(host, b, a, seed + 1);
}

fn one_way(host: &Host, from: &mut dyn End, to: &mut dyn End, seed: u32) {
    let payload = bytes(seed, 777);
    from.write(TX, &payload);
    to.post_recv(true, u64::from(seed), RX, 2048);
    from.post_send(u64::from(seed) + 1000, &[(TX, 777)]);
    assert_eq!(
        summary(&completions(host, from, 1)),
        [(u64::from(seed) + 1000, WcStatus::Success, WcOpcode::Send, 0)]
    );
    assert_eq!(
        summary(&completions(host, to, 1)),
        [(u64::from(seed), WcStatus::Success, WcOpcode::Recv, 777)]
    );
    assert_eq!(to.read(RX, 777), payload, "seed {seed}");
}

/// What `process` holds on HCA `hca`: the proxy's objects, the miniport's
/// user contexts, and the process's handles, locked pages and device
/// mappings.
fn held_on(w: &SharedWorld, process: &Process, hca: usize) -> [usize; 5] {
    let proxy = w
        .driver
        .devices()
        .into_iter()
        .find(|d| {
            d.bound()
                .is_some_and(|b| b.identity().ca_guid.get() == HCAS[hca])
        })
        .expect("the filter of that HCA");
    let node = w.host.hcas()[hca];
    let miniport = w
        .miniport
        .devices()
        .into_iter()
        .find(|d| d.node() == node)
        .and_then(|d| d.hca())
        .expect("the miniport of that HCA");
    [
        proxy.proxy().object_count(),
        miniport.user_context_count(),
        w.host.pnp().process_handle_count(process),
        process.space().locked_pages(),
        process.space().device_mapping_count(),
    ]
}

/// An object the process never destroys.
fn never_destroyed<T>(value: T) -> &'static T {
    Box::leak(Box::new(value))
}

/// What a peer of the dead process saw on its CQ: each of its `sends`
/// and `recvs` (wr_ids) completed exactly once; each queue's successes
/// (what went through while the process lived) come first, then the
/// failures. The requester's first failure is RETRY_EXC_ERR (its
/// retransmissions reached no QP, IBA 9.7.6.1.3) and the rest flush
/// (IBA 10.7.3.1); posted receives flush once the QP is in ERR. Returns
/// how many sends and receives succeeded.
fn check_peer_of_the_dead(wcs: &[WorkCompletion], sends: &[u64], recvs: &[u64]) -> (usize, usize) {
    let of = |ids: &[u64]| -> Vec<WcStatus> {
        ids.iter()
            .map(|id| {
                let mine: Vec<&WorkCompletion> = wcs.iter().filter(|wc| wc.wr_id == *id).collect();
                assert_eq!(mine.len(), 1, "wr {id} completed once: {wcs:?}");
                mine[0].status
            })
            .collect()
    };
    let (sent, received) = (of(sends), of(recvs));
    assert_eq!(wcs.len(), sends.len() + recvs.len(), "{wcs:?}");
    let ok_sends = sent.iter().take_while(|s| **s == WcStatus::Success).count();
    assert!(
        ok_sends < sends.len(),
        "some send outlived the peer: {sent:?}"
    );
    assert_eq!(sent[ok_sends], WcStatus::RetryExcErr, "{sent:?}");
    assert!(
        sent[ok_sends + 1..]
            .iter()
            .all(|s| *s == WcStatus::WrFlushErr),
        "{sent:?}"
    );
    let ok_recvs = received
        .iter()
        .take_while(|s| **s == WcStatus::Success)
        .count();
    assert!(
        received[ok_recvs..]
            .iter()
            .all(|s| *s == WcStatus::WrFlushErr),
        "{received:?}"
    );
    (ok_sends, ok_recvs)
}

#[test]
fn a_process_dying_mid_traffic_releases_everything_and_its_peers_fail_cleanly_then_recover() {
    // The machine steps so many times between the last post and the death:
    // none (nothing of the peers' requests reached it), two (one peer's
    // went through), three and fifty (both peers' went through, their
    // surplus sends waiting on RNR NAKs).
    for steps in [0, 2, 3, 50] {
        dies_mid_traffic(shared_world(83), Some(steps));
    }
}

/// The same on a threaded host: the process dies while the host's workers
/// run its peers' traffic (and the peers' ACK timeouts run in real time,
/// about half a second).
#[test]
fn a_process_dying_mid_traffic_on_a_threaded_host() {
    dies_mid_traffic(
        shared_world_on(HostConfig::threaded(2, hca_configs())),
        None,
    );
}

/// One run of [`a_process_dying_mid_traffic_releases_everything_and_its_peers_fail_cleanly_then_recover`]:
/// on a deterministic host, `steps` steps of the machine between the last
/// post and the death; on a threaded one (`None`), whatever its workers
/// did meanwhile.
fn dies_mid_traffic(w: SharedWorld, steps: Option<usize>) {
    // The peers on HCA 1: a kernel client and a process.
    let mut kernel = KernelEnd::new(&w.host, w.clients.client(1, 1));
    let peer_process = Process::new(93);
    let peer_io = io_of(&w, &peer_process);
    let peer_ctx = open(&peer_io, 1);
    let peer_res = Resources::new(&peer_ctx);
    let mut peer = UserEnd::new(&peer_res);

    // The process that dies, on HCA 0: an RC QP to each peer (and a UD
    // QP each), one CQ, one buffer. Its objects are leaked: it never
    // destroys them.
    let dying = Process::new(94);
    let dying_io = io_of(&w, &dying);
    let res = never_destroyed(Resources::new(never_destroyed(open(&dying_io, 0))));
    let mut to_kernel = UserEnd::new(res);
    let mut to_peer = UserEnd::new(res);
    connect(&to_kernel, 0, &kernel, 1);
    connect(&to_peer, 0, &peer, 1);
    exchange(&w.host, &mut to_kernel, &mut kernel, 100);
    exchange(&w.host, &mut to_peer, &mut peer, 200);
    assert_eq!(
        held_on(&w, &dying, 0)[..2],
        [9, 1],
        "CA, PD, CQ, 4 QPs, 2 MRs"
    );
    assert!(held_on(&w, &dying, 0)[2..].iter().all(|n| *n > 0));
    let peer_held = held_on(&w, &peer_process, 1);

    // Both peers armed for solicited completions: an error completion
    // counts as solicited, so the failures to come must wake them.
    let (al, id) = kernel.client.al();
    al.arm_cq(id, kernel.cq, CqNotify::Solicited).unwrap();
    peer_res.cq.arm(ArmFor::Solicited).unwrap();
    lock(&kernel.client.recorder.completions).clear();

    // Mid-stream: the dying process has two receives on each RC QP and
    // three sends to each peer posted (its doorbells rung); each peer has
    // four receives and four sends posted to it, more than it can take.
    // Nothing of this has run yet.
    for (qp, base) in [(&mut to_kernel, 300), (&mut to_peer, 400)] {
        for i in 0..2 {
            qp.post_recv(true, base + i, RX + 512 * i as usize, 512);
        }
        for i in 0..3 {
            qp.post_send(base + 10 + i, &[(TX, 256)]);
        }
    }
    // Each peer's first request is an RDMA write of three packets into
    // the dying process's memory.
    let (sends, recvs): (Vec<u64>, Vec<u64>) = ((9..14).collect(), (20..24).collect());
    let targets = [to_kernel.remote(RDMA), to_peer.remote(RDMA)];
    for (end, target) in [&mut kernel as &mut dyn End, &mut peer]
        .into_iter()
        .zip(targets)
    {
        for (i, id) in recvs.iter().enumerate() {
            end.post_recv(true, *id, 512 * i, 512);
        }
        end.post_write(sends[0], TX, 2500, target);
        for id in &sends[1..] {
            end.post_send(*id, &[(TX, 256)]);
        }
    }

    for _ in 0..steps.unwrap_or(0) {
        w.host.scheduler().run_one().unwrap();
    }
    // It dies: its requests are cancelled, its handles close, its address
    // space goes; what it posted dies with it.
    assert_eq!(w.host.pnp().exit_process(&dying), 0, "no page left locked");
    std::mem::forget((to_kernel, to_peer));
    // The machine runs (a deterministic host to idle, virtual time through
    // the peers' ACK timeouts): no hang.
    let expected = sends.len() + recvs.len();
    let (kernel_wcs, peer_wcs) = (
        completions(&w.host, &kernel, expected),
        completions(&w.host, &peer, expected),
    );
    eventually(&w.host, || held_on(&w, &dying, 0) == [0; 5]);
    assert_eq!(
        held_on(&w, &dying, 0),
        [0; 5],
        "everything it held released"
    );
    assert_eq!(
        held_on(&w, &peer_process, 1),
        peer_held,
        "the peer's untouched"
    );

    // Each peer's solicited arm fired for the errors (the wait keeps an
    // event that fired before it).
    eventually(&w.host, || {
        !lock(&kernel.client.recorder.completions).is_empty()
    });
    assert_eq!(
        *lock(&kernel.client.recorder.completions),
        [(kernel.cq, driver_platform::Irql::DISPATCH)],
        "the kernel client's completion callback ran once"
    );
    peer_res.cq.wait_event().unwrap();

    // Each peer's RC QP failed: error completions for all it had posted.
    let (kernel_sent, kernel_received) = check_peer_of_the_dead(&kernel_wcs, &sends, &recvs);
    let (peer_sent, peer_received) = check_peer_of_the_dead(&peer_wcs, &sends, &recvs);
    assert!(
        kernel_sent <= 3 && peer_sent <= 3,
        "at most the write and two sends (two receives were posted to each)"
    );
    assert!(
        kernel_received <= 3 && peer_received <= 3,
        "three sends came to each"
    );
    // A transport error is reported in the completion; the IB spec raises
    // no affiliated asynchronous event for it: none reached either peer.
    let kernel_events = lock(&kernel.client.recorder.events).clone();
    assert!(
        kernel_events
            .iter()
            .all(|e| e.code.subject() != ib_types::event::EventSubject::Qp),
        "{kernel_events:?}"
    );
    if !threaded(&w.host) {
        // (A threaded host's wait would block, as on Windows.)
        assert_eq!(
            peer_ctx.async_event().unwrap_err().status(),
            IbStatus::Canceled,
            "no event pending for the peer process"
        );
    }

    // The peers destroy their QPs, create new ones and talk to a new
    // process on HCA 0.
    kernel.destroy_qps(true);
    drop(peer);
    let mut peer = UserEnd::new(&peer_res);
    let newcomer = Process::new(95);
    let new_io = io_of(&w, &newcomer);
    {
        let ctx = open(&new_io, 0);
        let res = Resources::new(&ctx);
        let (mut to_kernel, mut to_peer) = (UserEnd::new(&res), UserEnd::new(&res));
        connect(&to_kernel, 0, &kernel, 1);
        connect(&to_peer, 0, &peer, 1);
        exchange(&w.host, &mut to_kernel, &mut kernel, 500);
        exchange(&w.host, &mut to_peer, &mut peer, 600);
    }
    drop(peer);
    drop(peer_res);
    drop(peer_ctx);
    kernel.destroy();
    for p in [&newcomer, &peer_process] {
        assert_eq!(leftovers(&w, p), [0; 5]);
        assert_eq!(p.exit(), 0);
    }
    finish_shared(w);
}

// ---------------------------------------------------------------------
// Doorbell isolation between processes, through the library.

/// Doorbells the device of HCA `hca` dropped because the page did not own
/// the object they named (PRM 9.1).
fn dropped_doorbells(w: &SharedWorld, hca: usize) -> u32 {
    use driver_platform::Mmio;
    let node = w.host.hcas()[hca];
    w.miniport
        .devices()
        .into_iter()
        .find(|d| d.node() == node)
        .and_then(|d| d.function())
        .expect("the HCA's function")
        .bar0()
        .read32(hca_prm::regs::offset::DROPPED_DOORBELLS)
}

#[test]
fn a_doorbell_on_another_processs_page_moves_nothing_of_this_processs_qp() {
    use hca_prm::doorbell::{SQ_DOORBELL, SqDoorbell};
    let w = shared_world(84);
    let mut kernel = KernelEnd::new(&w.host, w.clients.client(1, 1));
    let (owner, intruder) = (Process::new(96), Process::new(97));
    let (owner_io, intruder_io) = (io_of(&w, &owner), io_of(&w, &intruder));
    {
        let ctx = open(&owner_io, 0);
        let res = Resources::new(&ctx);
        let mut user = UserEnd::new(&res);
        connect(&user, 0, &kernel, 1);
        exchange(&w.host, &mut user, &mut kernel, 700);
        // The other process's own page on the same HCA.
        let other = open(&intruder_io, 0);
        let page = other.info().open.doorbell.expect("a user open maps a page");
        assert_ne!(Some(page), ctx.info().open.doorbell);

        // The owner's QP has posted one send WQE (two basic blocks:
        // control, address and the 80-byte inline segment); a producer of
        // eight announces three more, zeroed slots. Rung on the other
        // process's page, the device drops it: no completion, nothing on
        // the wire.
        kernel.post_recv(true, 71, RX, 2048);
        let dropped = dropped_doorbells(&w, 0);
        let doorbell = SqDoorbell {
            qpn: Qpn::new(user.rc_qpn()).unwrap(),
            producer: 8,
        };
        intruder
            .write_device64(page.va + SQ_DOORBELL, doorbell.encode())
            .unwrap();
        settle(&w.host);
        assert_eq!(dropped_doorbells(&w, 0), dropped + 1, "dropped and counted");
        assert!(user.poll().is_empty(), "the owner's QP ran nothing");
        assert!(kernel.poll().is_empty(), "nothing was sent");

        // The owner's own page still moves its QP: one send arrives intact.
        let payload = bytes(72, 333);
        user.write(TX, &payload);
        user.post_send(72, &[(TX, 333)]);
        settle(&w.host);
        assert_eq!(
            summary(&user.poll()),
            [(72, WcStatus::Success, WcOpcode::Send, 0)]
        );
        assert_eq!(
            summary(&kernel.poll()),
            [(71, WcStatus::Success, WcOpcode::Recv, 333)]
        );
        assert_eq!(kernel.read(RX, 333), payload);
        assert_eq!(dropped_doorbells(&w, 0), dropped + 1);
    }
    kernel.destroy();
    for p in [&owner, &intruder] {
        assert_eq!(leftovers(&w, p), [0; 5]);
        assert_eq!(p.exit(), 0);
    }
    finish_shared(w);
}
