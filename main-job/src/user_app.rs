//! The user application of the main job: a process of the simulated host
//! that opens two HCA ports through the access library (`ibal-user`, its
//! OS seam `sim_shells::user_io::SimIo`) with the plugin linked
//! (`PluginSource::Linked`: every verb through its pre/post hooks, posts
//! and polls on its own rings and doorbell page), connects an RC QP pair
//! between them and moves, round after round, a send, an RDMA write, an
//! RDMA read, a fetch-and-add and a compare-and-swap, each checked byte
//! for byte (the atomics by the values they returned and left).

use std::sync::Arc;
use std::time::{Duration, Instant};

use ib_types::access::AccessFlags;
use ib_types::qp::{QpCaps, QpType};
use ib_types::scalars::{Gid, PortNum, Qpn};
use ib_types::wc::{WcStatus, WorkCompletion};
use ib_types::wr::{RecvWr, RemoteAddr, SendFlags, SendOp, SendWr, Sge};
use ibal_user::{
    Buffer, CaSelector, Context, Cq, DeviceIo, Mr, Pd, PluginSource, Qp, QpInit, UserSend,
};
use sim_host::host::Host;
use sim_host::memory::Process;
use sim_shells::rc_path::rc_to_rts_steps;
use sim_shells::user_io::SimIo;

/// One end of the application's connection: an HCA port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortAddress {
    /// The HCA's node GUID (the library opens the CA by it).
    pub guid: u64,
    /// The port number.
    pub port: u8,
    /// The port's IPv4 address (its GID 0 is the IPv4-mapped GID).
    pub ip: [u8; 4],
}

/// What the application moved, every operation checked.
#[derive(Debug, Default, Clone, Copy)]
pub struct UserTraffic {
    /// Sends received as sent.
    pub sends: u64,
    /// RDMA writes found in the target's memory.
    pub writes: u64,
    /// RDMA reads that brought the source's bytes.
    pub reads: u64,
    /// Fetch-and-adds and compare-and-swaps with the expected results.
    pub atomics: u64,
    /// Payload bytes compared with what was sent.
    pub bytes_checked: u64,
    /// Wall time of the rounds (not the set-up).
    pub elapsed: Duration,
}

/// A deliberately broken step, to prove the checks catch it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sabotage {
    /// One byte of the first RDMA read's landing buffer is flipped after
    /// the read completed and before it is checked.
    CorruptRead,
}

/// The remote access the QPs grant.
const REMOTE: AccessFlags = AccessFlags::REMOTE_WRITE
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_ATOMIC);

/// The regions' access: the remote rights and local write (a remote
/// write right needs it).
const REGION: AccessFlags = REMOTE.union(AccessFlags::LOCAL_WRITE);

/// RDMA reads and atomics in flight each way.
const RD_ATOMIC: u8 = 4;

/// Deterministic, non-trivial bytes of one round and operation.
fn pattern(round: u32, what: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u8)
                .wrapping_mul(31)
                .wrapping_add(what)
                .wrapping_add((round as u8).wrapping_mul(7))
        })
        .collect()
}

fn err(what: &'static str) -> impl Fn(ibal_user::Error) -> String {
    move |e| format!("{what}: {e}")
}

/// One side: its region's layout is four `bytes`-long slots (send, write,
/// read, spare) then the atomic word and the atomic result.
struct Layout {
    bytes: usize,
}

impl Layout {
    fn send(&self) -> usize {
        0
    }
    fn write(&self) -> usize {
        self.bytes
    }
    fn read(&self) -> usize {
        2 * self.bytes
    }
    fn word(&self) -> usize {
        (3 * self.bytes).next_multiple_of(8)
    }
    fn result(&self) -> usize {
        self.word() + 8
    }
    fn total(&self) -> usize {
        (self.result() + 8).next_multiple_of(4096)
    }
}

/// Waits (runs the host) for the one completion `wr_id` on `cq`, which
/// must be successful.
fn reap(host: &Host, cq: &Cq<'_>, wr_id: u64, what: &str) -> Result<WorkCompletion, String> {
    // The deterministic host runs until nothing is ready and no timer is
    // armed: the wire, the devices, retransmissions, interrupts and DPCs.
    host.scheduler()
        .run_until_idle(crate::SETTLE_STEPS)
        .map_err(|e| format!("{what}: {e}"))?;
    let mut wcs = [WorkCompletion::EMPTY; 4];
    let found = cq.poll(&mut wcs).map_err(err("poll"))?;
    match found {
        0 => Err(format!("{what}: no completion")),
        1 if wcs[0].wr_id == wr_id && wcs[0].status == WcStatus::Success => Ok(wcs[0]),
        1 => Err(format!(
            "{what}: completion of wr_id {} with {:?}",
            wcs[0].wr_id, wcs[0].status
        )),
        n => Err(format!("{what}: {n} completions, one expected")),
    }
}

fn signaled<'a>(wr_id: u64, op: SendOp, sg_list: &'a [Sge]) -> [UserSend<'a>; 1] {
    [UserSend {
        wr: SendWr {
            wr_id,
            op,
            flags: SendFlags::SIGNALED,
            sg_list,
            ud: None,
        },
        inline: None,
    }]
}

fn check(what: &str, round: u32, got: &[u8], want: &[u8]) -> Result<(), String> {
    match got.iter().zip(want).position(|(g, w)| g != w) {
        None if got.len() == want.len() => Ok(()),
        None => Err(format!(
            "{what} round {round}: {} bytes, {} sent",
            got.len(),
            want.len()
        )),
        Some(at) => Err(format!(
            "{what} round {round}: byte {at} is {:#04x}, {:#04x} was sent",
            got[at], want[at]
        )),
    }
}

/// Opens `a` and `b` in `process`, connects an RC pair between them and
/// runs `rounds` rounds of send, RDMA write, RDMA read, fetch-and-add and
/// compare-and-swap of `bytes`-byte payloads from `a` to `b`; `progress`
/// is told each round done. Everything is destroyed through the library
/// before it returns.
pub fn run(
    host: &Arc<Host>,
    process: &Process,
    (a, b): (PortAddress, PortAddress),
    rounds: u32,
    bytes: usize,
    sabotage: Option<Sabotage>,
    progress: &mut dyn FnMut(u32),
) -> Result<UserTraffic, String> {
    let io: Arc<dyn DeviceIo> = SimIo::new(host, process);
    let ctx_a = Context::open(&io, CaSelector::Guid(a.guid), &PluginSource::Linked)
        .map_err(err("open the first CA"))?;
    let ctx_b = Context::open(&io, CaSelector::Guid(b.guid), &PluginSource::Linked)
        .map_err(err("open the second CA"))?;
    if !ctx_a.has_fast_path() || !ctx_b.has_fast_path() {
        return Err("the plugin's fast path is not there".into());
    }
    let layout = Layout { bytes };
    let (pd_a, pd_b) = (
        Pd::new(&ctx_a).map_err(err("PD"))?,
        Pd::new(&ctx_b).map_err(err("PD"))?,
    );
    let (buf_a, buf_b) = (
        Buffer::new(&ctx_a, layout.total()).map_err(err("buffer"))?,
        Buffer::new(&ctx_b, layout.total()).map_err(err("buffer"))?,
    );
    let (mr_a, mr_b) = (
        Mr::new(&pd_a, &buf_a, REGION).map_err(err("MR"))?,
        Mr::new(&pd_b, &buf_b, REGION).map_err(err("MR"))?,
    );
    let (cq_a, cq_b) = (
        Cq::new(&ctx_a, 16).map_err(err("CQ"))?,
        Cq::new(&ctx_b, 16).map_err(err("CQ"))?,
    );
    let init = QpInit {
        qp_type: QpType::Rc,
        caps: QpCaps {
            max_send_wr: 8,
            max_recv_wr: 8,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        sq_sig_all: false,
    };
    let mut qp_a = Qp::new(&pd_a, &cq_a, &cq_a, &init).map_err(err("QP"))?;
    let mut qp_b = Qp::new(&pd_b, &cq_b, &cq_b, &init).map_err(err("QP"))?;
    for (qp, me, peer, peer_qpn) in [(&qp_a, a, b, qp_b.qpn()), (&qp_b, b, a, qp_a.qpn())] {
        let port = PortNum::new(me.port).map_err(|e| e.to_string())?;
        let dest = Qpn::new(peer_qpn).map_err(|e| e.to_string())?;
        for step in rc_to_rts_steps(port, REMOTE, dest, Gid::from_ipv4(peer.ip), RD_ATOMIC) {
            qp.modify(&step).map_err(err("connect the RC pair"))?;
        }
    }

    let (va_a, va_b) = (buf_a.va(), buf_b.va());
    let (lkey_a, lkey_b, rkey_b) = (mr_a.keys().lkey, mr_b.keys().lkey, mr_b.keys().rkey);
    let remote = |offset: usize| RemoteAddr {
        addr: va_b + offset as u64,
        rkey: rkey_b,
    };
    let len = bytes as u32;
    let mut traffic = UserTraffic::default();
    let mut word = 0u64;
    buf_b
        .write(layout.word(), &word.to_le_bytes())
        .map_err(err("write"))?;
    let started = Instant::now();
    for round in 0..rounds {
        let id = u64::from(round) * 8;
        // Send: B's receive posted first, then A's send.
        let payload = pattern(round, 1, bytes);
        buf_a.write(layout.send(), &payload).map_err(err("write"))?;
        let landing = [Sge::new(va_b + layout.send() as u64, len, lkey_b)];
        let recv = [RecvWr {
            wr_id: id,
            sg_list: &landing,
        }];
        qp_b.post_recv(&recv).map_err(err("post receive"))?;
        let source = [Sge::new(va_a + layout.send() as u64, len, lkey_a)];
        qp_a.post_send(&signaled(id, SendOp::Send, &source))
            .map_err(err("post send"))?;
        reap(host, &cq_a, id, "send (sender)")?;
        let wc = reap(host, &cq_b, id, "send (receiver)")?;
        if wc.byte_len != len {
            return Err(format!(
                "send round {round}: {} bytes received",
                wc.byte_len
            ));
        }
        let mut got = vec![0; bytes];
        buf_b.read(layout.send(), &mut got).map_err(err("read"))?;
        check("send", round, &got, &payload)?;
        traffic.sends += 1;

        // RDMA write into B's write slot.
        let payload = pattern(round, 2, bytes);
        buf_a
            .write(layout.write(), &payload)
            .map_err(err("write"))?;
        let source = [Sge::new(va_a + layout.write() as u64, len, lkey_a)];
        let op = SendOp::RdmaWrite {
            remote: remote(layout.write()),
        };
        qp_a.post_send(&signaled(id + 1, op, &source))
            .map_err(err("post RDMA write"))?;
        reap(host, &cq_a, id + 1, "RDMA write")?;
        buf_b.read(layout.write(), &mut got).map_err(err("read"))?;
        check("RDMA write", round, &got, &payload)?;
        traffic.writes += 1;

        // RDMA read of B's read slot into A's.
        let payload = pattern(round, 3, bytes);
        buf_b.write(layout.read(), &payload).map_err(err("write"))?;
        let landing = [Sge::new(va_a + layout.read() as u64, len, lkey_a)];
        let op = SendOp::RdmaRead {
            remote: remote(layout.read()),
        };
        qp_a.post_send(&signaled(id + 2, op, &landing))
            .map_err(err("post RDMA read"))?;
        reap(host, &cq_a, id + 2, "RDMA read")?;
        if round == 0 && sabotage == Some(Sabotage::CorruptRead) {
            let mut byte = [0u8];
            buf_a.read(layout.read(), &mut byte).map_err(err("read"))?;
            buf_a
                .write(layout.read(), &[byte[0] ^ 0x40])
                .map_err(err("write"))?;
        }
        buf_a.read(layout.read(), &mut got).map_err(err("read"))?;
        check("RDMA read", round, &got, &payload)?;
        traffic.reads += 1;
        traffic.bytes_checked += 3 * u64::from(len);

        // Fetch-and-add, then compare-and-swap, on B's word.
        let result = [Sge::new(va_a + layout.result() as u64, 8, lkey_a)];
        let add = u64::from(round) + 1;
        let op = SendOp::FetchAdd {
            remote: remote(layout.word()),
            add,
        };
        qp_a.post_send(&signaled(id + 3, op, &result))
            .map_err(err("post fetch-and-add"))?;
        reap(host, &cq_a, id + 3, "fetch-and-add")?;
        let mut returned = [0u8; 8];
        buf_a
            .read(layout.result(), &mut returned)
            .map_err(err("read"))?;
        if u64::from_le_bytes(returned) != word {
            return Err(format!(
                "fetch-and-add round {round}: returned {}, the word held {word}",
                u64::from_le_bytes(returned)
            ));
        }
        word = word.wrapping_add(add);
        let swap = word ^ 0x5A5A_0000_0000_5A5A;
        let op = SendOp::CompareSwap {
            remote: remote(layout.word()),
            compare: word,
            swap,
        };
        qp_a.post_send(&signaled(id + 4, op, &result))
            .map_err(err("post compare-and-swap"))?;
        reap(host, &cq_a, id + 4, "compare-and-swap")?;
        buf_a
            .read(layout.result(), &mut returned)
            .map_err(err("read"))?;
        let mut held = [0u8; 8];
        buf_b.read(layout.word(), &mut held).map_err(err("read"))?;
        if u64::from_le_bytes(returned) != word || u64::from_le_bytes(held) != swap {
            return Err(format!(
                "compare-and-swap round {round}: returned {}, left {}; expected {word} and {swap}",
                u64::from_le_bytes(returned),
                u64::from_le_bytes(held)
            ));
        }
        word = swap;
        traffic.atomics += 2;
        traffic.bytes_checked += 24;
        progress(round + 1);
    }
    traffic.elapsed = started.elapsed();
    Ok(traffic)
}
