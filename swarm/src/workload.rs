//! The workload generator and its model. Each step picks an operation by
//! the seed's mix, runs it through the CI (control verbs submitted from a
//! DPC, posts and polls in DPCs the seeded scheduler interleaves), feeds
//! what came back into the model, and checks the invariants:
//!
//! - every posted WR completes exactly once, on the CQ it was posted to
//!   with the QP number it was posted on and its own `wr_id` (`wr_id`s
//!   are unique over the run, so a stranger's or a second completion is
//!   caught at once); a WR the post refused never completes;
//! - a successful receive holds the bytes of a message sent to that QP
//!   (each payload names its message), a successful RC RDMA WRITE left
//!   its bytes at the target, a successful RDMA READ fetched the source;
//! - no completion event or asynchronous event names a destroyed CQ or QP;
//! - the host's verifier is clean (DMA faults, IRQL, leaks, requests).
//!
//! Then [`Swarm::liveness`]: faults off, every send WR must resolve within
//! a bound of virtual time, and after every QP is moved to ERR nothing
//! may be left outstanding.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use driver_platform::SystemPowerState;
use hca_miniport_core::verbs::CqNotify;
use hca_miniport_core::verbs::qp::QPN_QUIET_PERIOD_NS;
use hca_prm::regs::FatalSyndrome;
use ib_types::access::AccessFlags;
use ib_types::cq::CqAttr;
use ib_types::handle::{AvHandle, CqHandle, PdHandle};
use ib_types::ioctl::{
    CreateAv, CreateCq, CreateQp, DestroyAv, DestroyCq, DestroyQp, Empty, ModifyQp, ReregMr,
    ResizeCq,
};
use ib_types::mr::MrRereg;
use ib_types::qp::{QpCaps, QpCreate, QpModify, QpState, QpType};
use ib_types::scalars::{Mtu, Psn, QKey, Qpn};
use ib_types::status::IbStatus;
use ib_types::wc::{WcStatus, WorkCompletion};
use ib_types::wr::{RecvWr, RemoteAddr, SendFlags, SendOp, SendWr, Sge, UdDest};
use sim_hca::fabric::FaultConfig;
use sim_hca::rng::Rng;

use crate::Report;
use crate::machine::{
    FIRST_FREE_SLOT, Machine, READ_SOURCE_SLOTS, SLOT, SLOTS, Submitted, av_to, decode, lock,
    port1, read_source_pattern, region_access,
};
use crate::mix::{Knobs, Mix, Op};

mod clients;

/// The Q_Key of every UD QP.
const UD_QKEY: u32 = 0x5157_0001;
/// Most QPs alive per HCA.
const MAX_QPS: usize = 12;
/// Most CQs alive per HCA.
const MAX_CQS: usize = 5;
/// Largest message at the path MTU (single packet).
const SMALL_MAX: usize = 1024;
/// Largest message overall (RC/UC; four packets).
const BIG_MAX: usize = SLOT;
/// The header every payload starts with: message id and length.
const HEADER: usize = 12;
/// A UD receive buffer starts with the 40-byte GRH.
const GRH: usize = 40;
/// Virtual time the liveness phase grants every send WR to resolve.
const LIVENESS_BOUND_NS: u64 = 4_000_000_000;

type Id = usize;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Connected (RC/UC) or ready (UD): posts are carried.
    Ready,
    /// In ERR: posts are flushed.
    Err,
    /// In RESET: posts are refused.
    Reset,
}

#[derive(Debug)]
struct CqModel {
    side: usize,
    handle: u64,
    size: u32,
    /// WRs in the model whose completion goes here.
    outstanding: usize,
    /// Live QPs using it.
    users: usize,
    /// The CQEs the live QPs' work queues can have outstanding here: the
    /// granted depth of each send and receive queue completing here
    /// (guide 8.2.3 item 1; the miniport's `cq::Room`). A QP that would
    /// take it past `size` is refused, and so is a resize below it.
    committed: u32,
    alive: bool,
    busy: bool,
    /// Reported `CqError` (overflow; only with the `cq-overflow` knob):
    /// its completions may be lost.
    overflowed: bool,
}

#[derive(Debug)]
struct QpModel {
    side: usize,
    handle: u64,
    qpn: u32,
    ty: QpType,
    send_cq: Id,
    recv_cq: Id,
    peer: Option<Id>,
    phase: Phase,
    alive: bool,
    busy: bool,
    max_send: usize,
    max_recv: usize,
    inline: u32,
    sends: usize,
    recvs: usize,
    /// An RC/UC QP that reached RTR since its last reset: its next reset
    /// starts a TIME WAIT (guide 6.5.2).
    reached_rtr: bool,
    /// The TIME WAIT of its last reset, as the earliest and latest virtual
    /// time it can end: the reset's command completes somewhere between
    /// the submit and the answer, and the quiet period runs from there.
    time_wait: Option<(u64, u64)>,
}

#[derive(Debug, Clone, Copy)]
enum WrKind {
    Send {
        slot: usize,
        msg: u64,
    },
    Recv {
        slot: usize,
    },
    Write {
        slot: usize,
        len: usize,
        target: Option<(usize, usize)>,
        msg: u64,
    },
    Read {
        slot: usize,
        len: usize,
        source: usize,
    },
}

#[derive(Debug)]
struct WrModel {
    side: usize,
    qp: Id,
    cq: Id,
    kind: WrKind,
    /// The post accepted it (until the post's answer is in, unknown).
    posted: bool,
}

/// A message a send carried: where it went and how long it is.
#[derive(Debug, Clone, Copy)]
struct Message {
    /// Sent by an RC QP: a successful send completion means delivered.
    rc: bool,
    /// The receiving QP in the model.
    to_qp: Id,
    to_side: usize,
    to_qpn: u32,
    len: usize,
}

/// What an outstanding control request does to the model when it
/// completes.
#[derive(Debug, Clone, Copy)]
enum Effect {
    Destroyed(Id),
    Errored(Id),
    /// A CQ resize: the CQ's size before it, the ring it asked for, and
    /// the CQ's `committed` when it was submitted.
    Resized(Id, u32, u32, u32),
}

struct Pending {
    submitted: Submitted,
    effect: Effect,
}

/// The run: machine, model, mix and knobs.
pub(crate) struct Swarm {
    m: Machine,
    rng: Rng,
    mix: Mix,
    knobs: Knobs,
    cqs: Vec<CqModel>,
    qps: Vec<QpModel>,
    wrs: BTreeMap<u64, WrModel>,
    done: HashSet<u64>,
    messages: HashMap<u64, Message>,
    /// RC messages whose send completed successfully.
    acked: HashSet<u64>,
    /// Messages a receive completed with.
    received: HashSet<u64>,
    free_slots: [Vec<usize>; 2],
    avs: [u64; 2],
    next_wr_id: u64,
    next_msg: u64,
    fabric_faulty: bool,
    /// HCA whose command completions are held, and the step it releases.
    hold: Option<(usize, usize)>,
    /// Function whose link is down, and the step it comes back.
    link_down: Option<(usize, usize)>,
    pending: Vec<Pending>,
    catastrophe: bool,
    /// HCA that failed and was let go, and the step by which the PnP
    /// manager's pass restarts it (sooner if a resume runs the pass).
    restart_due: Option<(usize, usize)>,
    /// The HCAs the PnP manager restarted under the client (their
    /// completions are counted apart, to show the new device carries
    /// traffic).
    restarted: [bool; 2],
    step: usize,
    steps: usize,
    /// Print every operation as it runs (`SWARM_TRACE=1`).
    echo: bool,
    /// The issue-11 actors: extra AL clients, child-list entries, user
    /// processes (`clients`).
    extra: clients::Extras,
    pub(crate) report: Report,
    /// The last operations, for a failure's context.
    pub(crate) trace: Vec<String>,
}

/// The bytes of message `id`, `len` long: its id and length, then a
/// pattern of both.
fn payload(id: u64, len: usize) -> Vec<u8> {
    let mut bytes: Vec<u8> = (0..len)
        .map(|i| {
            (i as u8)
                .wrapping_mul(31)
                .wrapping_add(id as u8)
                .rotate_left((id % 7) as u32)
        })
        .collect();
    if len >= HEADER {
        bytes[..8].copy_from_slice(&id.to_le_bytes());
        bytes[8..12].copy_from_slice(&(len as u32).to_le_bytes());
    }
    bytes
}

fn psn(v: u32) -> Result<Psn, String> {
    Psn::new(v & 0xFF_FFFF).map_err(|e| e.to_string())
}

fn qpn(v: u32) -> Result<Qpn, String> {
    Qpn::new(v).map_err(|e| e.to_string())
}

impl Swarm {
    pub(crate) fn new(
        seed: u64,
        knobs: Knobs,
        steps: usize,
        threaded: bool,
    ) -> Result<Self, String> {
        let mut rng = Rng::from_seed(seed ^ 0x5A4D_5357_4152_4D21);
        let mut mix = Mix::draw(&mut rng);
        mix.draw_issue_11(&mut Rng::from_seed(seed ^ 0x4953_5355_4531_3131));
        mix.apply_knobs(knobs);
        if threaded {
            mix.restrict_to_threaded();
        }
        let mut fabric = sim_hca::fabric::FabricConfig::default();
        if mix.faults_at_start {
            fabric.faults = mix.faults;
        }
        let m = Machine::boot(seed, fabric, threaded)?;
        let free = || (FIRST_FREE_SLOT..SLOTS).collect::<Vec<_>>();
        let mut swarm = Self {
            m,
            rng,
            knobs,
            cqs: Vec::new(),
            qps: Vec::new(),
            wrs: BTreeMap::new(),
            done: HashSet::new(),
            messages: HashMap::new(),
            acked: HashSet::new(),
            received: HashSet::new(),
            free_slots: [free(), free()],
            avs: [0; 2],
            next_wr_id: 0x1000,
            next_msg: 1,
            fabric_faulty: mix.faults_at_start && mix.faults != FaultConfig::default(),
            hold: None,
            link_down: None,
            pending: Vec::new(),
            catastrophe: false,
            restart_due: None,
            restarted: [false; 2],
            step: 0,
            steps,
            echo: std::env::var_os("SWARM_TRACE").is_some(),
            extra: clients::Extras::default(),
            report: Report {
                seed,
                threaded,
                mix: mix.describe(),
                ..Report::default()
            },
            trace: Vec::new(),
            mix,
        };
        for side in 0..2 {
            let peer_ip = swarm.m.sides[1 - side].ip;
            let pd = swarm.m.sides[side].pd;
            let (av, _) = swarm.m.call::<CreateAv>(side, pd, &av_to(peer_ip)?)?;
            swarm.avs[side] = av;
            // The first CQs hold QPs, so every seed has traffic.
            swarm.create_cq(side, false)?;
            swarm.create_cq(side, false)?;
        }
        for _ in 0..2 {
            swarm.create_pair()?;
        }
        Ok(swarm)
    }

    fn note(&mut self, what: String) {
        if self.echo {
            println!("step {}: {what}", self.step);
        }
        if self.trace.len() >= 24 {
            self.trace.remove(0);
        }
        self.trace.push(format!("step {}: {what}", self.step));
    }

    fn count(&mut self, what: &'static str) {
        *self.report.ops.entry(what).or_default() += 1;
    }

    fn side_ok(&self, side: usize) -> bool {
        !self.m.sides[side].failed()
    }

    fn held(&self, side: usize) -> bool {
        self.hold.is_some_and(|(s, _)| s == side)
    }

    /// Control verbs that need a synchronous answer can run on `side`.
    fn sync_ok(&self, side: usize) -> bool {
        self.side_ok(side) && !self.held(side)
    }

    /// One step: an operation, then the invariants.
    pub(crate) fn step(&mut self, step: usize) -> Result<(), String> {
        self.step = step;
        let op = self.mix.pick(&mut self.rng);
        self.run_op(op)?;
        self.after_step()
    }

    fn run_op(&mut self, op: Op) -> Result<(), String> {
        match op {
            Op::CreatePair => self.create_pair(),
            Op::DestroyQp => self.destroy_qp(),
            Op::Reconnect => self.reconnect(),
            Op::PostSend => self.post_and_poll(true, false),
            Op::PostRecv => self.post_and_poll(false, false),
            Op::Poll => self.poll_op(),
            Op::PostAndPoll => {
                let send = self.rng.below(2) == 0;
                self.post_and_poll(send, true)
            }
            Op::Arm => self.arm(),
            Op::ForceErr => self.force_err(true),
            Op::ResizeCq => self.resize_cq(true),
            Op::CreateCq => {
                let side = self.rng.below(2) as usize;
                let live = self
                    .cqs
                    .iter()
                    .filter(|c| c.alive && c.side == side)
                    .count();
                if live < MAX_CQS && self.sync_ok(side) {
                    self.create_cq(side, true)?;
                }
                Ok(())
            }
            Op::DestroyCq => self.destroy_cq(),
            Op::ReregMr => self.rereg_mr(),
            Op::Run => self.run_time(),
            Op::LinkFlap => self.link_flap(),
            Op::FabricToggle => self.fabric_toggle(),
            Op::Catastrophic => self.catastrophic(),
            Op::SleepResume => self.sleep_resume(),
            Op::HoldCommands => self.hold_commands(),
            Op::AlClient => self.al_client_op(),
            Op::ChildChurn => self.child_churn(),
            Op::UserOpen => self.user_op(),
            Op::ForgeHandle => self.forge_handle(),
        }
    }

    // ----- invariants ------------------------------------------------

    fn after_step(&mut self) -> Result<(), String> {
        if let Some((side, due)) = self.restart_due
            && self.step >= due
        {
            self.restart(side)?;
        }
        if let Some((side, until)) = self.hold
            && self.step >= until
        {
            self.release_hold(side);
        }
        if let Some((function, until)) = self.link_down
            && self.step >= until
        {
            self.set_link(function, true);
        }
        self.check_pending()?;
        self.check_events()?;
        self.check_extras()?;
        let violations = self.m.host.verifier().violations();
        if !violations.is_empty() {
            return Err(format!("verifier: {violations:?}"));
        }
        Ok(())
    }

    fn check_events(&mut self) -> Result<(), String> {
        for side in 0..2 {
            let mut log = lock(&self.m.sides[side].log);
            if let Some(breach) = log.breaches.first() {
                return Err(breach.clone());
            }
            self.report.async_events += log.async_events.len() as u64;
            let events = std::mem::take(&mut log.async_events);
            drop(log);
            for event in events {
                if self.echo {
                    println!(
                        "step {}: HCA {side} event {:?} for {:#x}",
                        self.step, event.code, event.handle
                    );
                }
                if event.code != ib_types::event::AsyncEventCode::CqError {
                    continue;
                }
                let Some(cq) = self
                    .cqs
                    .iter_mut()
                    .find(|c| c.side == side && c.handle == event.handle)
                else {
                    continue;
                };
                if !self.knobs.cq_overflow {
                    return Err(format!(
                        "CqError on CQ {:#x} of HCA {side} without the cq-overflow knob ({} WRs outstanding, {} entries)",
                        event.handle, cq.outstanding, cq.size
                    ));
                }
                cq.overflowed = true;
                *self
                    .report
                    .ops
                    .entry("CQ overflowed (CqError)")
                    .or_default() += 1;
            }
        }
        Ok(())
    }

    /// Applies the outstanding requests that completed. A resize is judged
    /// last: a destroy that completed meanwhile may have given its room
    /// back before the resize was checked.
    fn check_pending(&mut self) -> Result<(), String> {
        let (done, waiting): (Vec<Pending>, Vec<Pending>) = std::mem::take(&mut self.pending)
            .into_iter()
            .partition(|p| p.submitted.issuer.completion().is_some());
        self.pending = waiting;
        let (resizes, others): (Vec<Pending>, Vec<Pending>) = done
            .into_iter()
            .partition(|p| matches!(p.effect, Effect::Resized(..)));
        for done in others.into_iter().chain(resizes) {
            self.apply(done)?;
        }
        Ok(())
    }

    fn apply(&mut self, done: Pending) -> Result<(), String> {
        match done.effect {
            Effect::Destroyed(id) => {
                let (status, _, _) = decode::<DestroyQp>(&done.submitted)?;
                self.destroyed_qp(id, status)
            }
            Effect::Errored(id) => {
                let (status, _, _) = decode::<ModifyQp>(&done.submitted)?;
                self.qps[id].busy = false;
                if status == IbStatus::Success {
                    self.qps[id].phase = Phase::Err;
                } else if self.side_ok(self.qps[id].side) {
                    return Err(format!(
                        "ModifyQp to ERR of QP {:#x}: {status:?}",
                        self.qps[id].qpn
                    ));
                }
                Ok(())
            }
            Effect::Resized(id, before, ring, committed_then) => {
                let (status, _, out) = decode::<ResizeCq>(&done.submitted)?;
                let side_ok = self.side_ok(self.cqs[id].side);
                let cq = &mut self.cqs[id];
                cq.busy = false;
                // Below the QPs' queues: refused (`InvalidCqSize`). QPs may
                // have gone meanwhile, so `committed` when the request ran
                // lies between now and the submit. A ring too small for the
                // entries in it is refused too (possible only with the
                // `cq-overflow` knob, which posts past the size).
                let must_refuse = ring < cq.committed;
                let may_refuse = ring < committed_then || ring < cq.outstanding as u32;
                let refused = status == IbStatus::InvalidCqSize;
                match (status, out) {
                    (IbStatus::Success, Some(out)) if !must_refuse => cq.size = out.cqe,
                    _ if refused && may_refuse => {
                        cq.size = before;
                        *self
                            .report
                            .ops
                            .entry("refused: resize below the QPs' queues")
                            .or_default() += 1;
                    }
                    (status, _) if !side_ok => {
                        cq.size = before;
                        *self.report.ops.entry(status_name(status)).or_default() += 1;
                    }
                    (status, _) => {
                        return Err(format!(
                            "ResizeCq {:#x} to {ring} entries ({} committed to QPs, {} when submitted, {} outstanding): {status:?}",
                            cq.handle, cq.committed, committed_then, cq.outstanding
                        ));
                    }
                }
                Ok(())
            }
        }
    }

    // ----- objects ---------------------------------------------------

    /// Creates a CQ; `tiny_ok`: with the `cq-overflow` knob it may be too
    /// small for any QP (1 to 4 entries).
    fn create_cq(&mut self, side: usize, tiny_ok: bool) -> Result<Id, String> {
        let cqe = if tiny_ok && self.knobs.cq_overflow && self.rng.below(3) == 0 {
            1 + self.rng.below(4) as u32
        } else {
            32 + self.rng.below(224) as u32
        };
        let attr = CqAttr {
            cqe,
            comp_vector: 0,
        };
        let ca = self.m.sides[side].ca;
        let (handle, out) = self.m.call::<CreateCq>(side, ca, &attr)?;
        let size = out.ok_or("CreateCq without output")?.cqe;
        if size < cqe {
            return Err(format!("CreateCq granted {size} entries for {cqe}"));
        }
        self.count("create CQ");
        self.cqs.push(CqModel {
            side,
            handle,
            size,
            outstanding: 0,
            users: 0,
            committed: 0,
            alive: true,
            busy: false,
            overflowed: false,
        });
        Ok(self.cqs.len() - 1)
    }

    fn pick_cq(&mut self, side: usize) -> Option<Id> {
        let live: Vec<Id> = (0..self.cqs.len())
            .filter(|&i| self.cqs[i].alive && self.cqs[i].side == side && !self.cqs[i].busy)
            .collect();
        (!live.is_empty()).then(|| live[self.rng.below(live.len() as u64) as usize])
    }

    fn destroy_cq(&mut self) -> Result<(), String> {
        let side = self.rng.below(2) as usize;
        let unused: Vec<Id> = (0..self.cqs.len())
            .filter(|&i| {
                let c = &self.cqs[i];
                c.alive && c.side == side && c.users == 0 && c.outstanding == 0 && !c.busy
            })
            .collect();
        // Keep two CQs per HCA so there is always somewhere to complete.
        let live = self
            .cqs
            .iter()
            .filter(|c| c.alive && c.side == side)
            .count();
        if unused.is_empty() || live <= 2 || !self.sync_ok(side) {
            return Ok(());
        }
        let id = unused[self.rng.below(unused.len() as u64) as usize];
        let (status, _, _) =
            self.m
                .call_status::<DestroyCq>(side, self.cqs[id].handle, &Empty, &[])?;
        if status != IbStatus::Success {
            return Err(format!("DestroyCq of an unused CQ: {status:?}"));
        }
        self.note(format!(
            "destroy CQ {:#x} on HCA {side}",
            self.cqs[id].handle
        ));
        self.count("destroy CQ");
        self.cqs[id].alive = false;
        lock(&self.m.sides[side].log)
            .dead_cqs
            .insert(self.cqs[id].handle);
        Ok(())
    }

    /// Resizes a random CQ; with `wait` false (or its HCA's command
    /// completions held) the request is left outstanding.
    fn resize_cq(&mut self, wait: bool) -> Result<(), String> {
        let side = self.rng.below(2) as usize;
        let Some(id) = self.pick_cq(side) else {
            return Ok(());
        };
        if !self.side_ok(side) {
            return Ok(());
        }
        // Sometimes below what the QPs' queues need: refused.
        let floor = if self.knobs.cq_overflow || self.rng.below(8) == 0 {
            1
        } else {
            (self.cqs[id].outstanding as u32 + 1).max(self.cqs[id].committed)
        };
        let cqe = floor.max(self.rng.below(300) as u32);
        let attr = CqAttr {
            cqe,
            comp_vector: 0,
        };
        let handle = self.cqs[id].handle;
        self.note(format!("resize CQ {handle:#x} to {cqe}"));
        self.count("resize CQ");
        let submitted = self.m.submit::<ResizeCq>(side, handle, &attr, &[])?;
        // Until the answer, the budget is the smaller of the two sizes:
        // posts go on meanwhile and must fit either.
        let before = self.cqs[id].size;
        let ring = cqe.next_power_of_two();
        self.cqs[id].size = before.min(ring);
        self.cqs[id].busy = true;
        let pending = Pending {
            submitted,
            effect: Effect::Resized(id, before, ring, self.cqs[id].committed),
        };
        if self.held(side) || !wait {
            self.pending.push(pending);
            Ok(())
        } else {
            // Judged with the room of the requests that completed meanwhile.
            self.m.wait(&pending.submitted)?;
            self.pending.push(pending);
            self.check_pending()
        }
    }

    fn caps(&mut self) -> QpCaps {
        QpCaps {
            max_send_wr: 4 + self.rng.below(13) as u32,
            max_recv_wr: 4 + self.rng.below(13) as u32,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: if self.rng.below(2) == 0 { 0 } else { 128 },
        }
    }

    /// Whether a QP's queues of `send_need` and `recv_need` WRs fit what
    /// its CQs have left (guide 8.2.3 item 1), as the model counts now.
    fn qp_fits(&self, send_cq: Id, recv_cq: Id, send_need: u32, recv_need: u32) -> bool {
        let (send, recv) = (&self.cqs[send_cq], &self.cqs[recv_cq]);
        if send_cq == recv_cq {
            send.committed + send_need + recv_need <= send.size
        } else {
            send.committed + send_need <= send.size && recv.committed + recv_need <= recv.size
        }
    }

    fn create_qp(&mut self, side: usize, ty: QpType, port: bool) -> Result<Option<Id>, String> {
        let (Some(send_cq), Some(recv_cq)) = (self.pick_cq(side), self.pick_cq(side)) else {
            return Ok(None);
        };
        let caps = self.caps();
        let create = QpCreate {
            qp_type: ty,
            pd: PdHandle::from_raw(self.m.sides[side].pd),
            send_cq: CqHandle::from_raw(self.cqs[send_cq].handle),
            recv_cq: CqHandle::from_raw(self.cqs[recv_cq].handle),
            srq: None,
            caps,
            sq_sig_all: false,
            port: if port { Some(port1()?) } else { None },
        };
        // Guide 8.2.3 item 1: the QP's queues (granted depths: the asked
        // ones rounded up to a power of two) must fit in what its CQs have
        // left, or it is refused.
        let (send_need, recv_need) = (
            caps.max_send_wr.next_power_of_two(),
            caps.max_recv_wr.next_power_of_two(),
        );
        let fits_then = self.qp_fits(send_cq, recv_cq, send_need, recv_need);
        let ca = self.m.sides[side].ca;
        let (status, handle, out) = self.m.call_status::<CreateQp>(side, ca, &create, &[])?;
        // Held requests (a destroy, a resize) may have completed while this
        // one was awaited, before or after the miniport checked its room:
        // the room it saw lies between the model's before and after them.
        self.check_pending()?;
        let fits_now = self.qp_fits(send_cq, recv_cq, send_need, recv_need);
        if status != IbStatus::Success {
            if ty == QpType::Gsi && status == IbStatus::ResourceBusy {
                return Ok(None);
            }
            if status == IbStatus::InsufficientResources && !fits_then {
                self.count("refused: QP's queues past its CQ");
                return Ok(None);
            }
            // A QP on a CQ in error after an overflow is refused.
            if status == IbStatus::InvalidParameter
                && (self.cqs[send_cq].overflowed || self.cqs[recv_cq].overflowed)
            {
                self.count("refused: CQ in error");
                return Ok(None);
            }
            return Err(format!(
                "CreateQp {ty:?} {caps:?} on CQs of {} and {} entries: {status:?}",
                self.cqs[send_cq].size, self.cqs[recv_cq].size
            ));
        }
        let created = out.ok_or("CreateQp without output")?;
        let granted = created.caps;
        if granted.max_send_wr < caps.max_send_wr
            || granted.max_recv_wr < caps.max_recv_wr
            || granted.max_inline_data < caps.max_inline_data
        {
            return Err(format!("CreateQp granted {granted:?} for {caps:?}"));
        }
        if !fits_now {
            return Err(format!(
                "CreateQp {ty:?} {caps:?} accepted on CQs of {} and {} entries with {} and {} committed",
                self.cqs[send_cq].size,
                self.cqs[recv_cq].size,
                self.cqs[send_cq].committed,
                self.cqs[recv_cq].committed
            ));
        }
        self.cqs[send_cq].users += 1;
        self.cqs[recv_cq].users += 1;
        self.cqs[send_cq].committed += granted.max_send_wr;
        self.cqs[recv_cq].committed += granted.max_recv_wr;
        self.qps.push(QpModel {
            side,
            handle,
            qpn: created.qpn.get(),
            ty,
            send_cq,
            recv_cq,
            peer: None,
            phase: Phase::Reset,
            alive: true,
            busy: false,
            max_send: granted.max_send_wr as usize,
            max_recv: granted.max_recv_wr as usize,
            inline: granted.max_inline_data,
            sends: 0,
            recvs: 0,
            reached_rtr: false,
            time_wait: None,
        });
        Ok(Some(self.qps.len() - 1))
    }

    fn modify(&mut self, id: Id, modify: &QpModify) -> Result<IbStatus, String> {
        let (side, handle) = (self.qps[id].side, self.qps[id].handle);
        let (status, _, _) = self.m.call_status::<ModifyQp>(side, handle, modify, &[])?;
        Ok(status)
    }

    /// Brings QP `id` to RTS aimed at `peer` (RC/UC) or ready to send
    /// datagrams (UD). False if it was refused: RTR in TIME WAIT (then
    /// the QP is left in INIT), or its HCA failed.
    fn connect(&mut self, id: Id, peer: Id, sq_psn: u32, rq_psn: u32) -> Result<bool, String> {
        let ty = self.qps[id].ty;
        let peer_ip = self.m.sides[self.qps[peer].side].ip;
        let access = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        let steps = match ty {
            QpType::Ud => vec![
                QpModify {
                    state: Some(QpState::Init),
                    pkey_index: Some(0),
                    port: Some(port1()?),
                    qkey: Some(QKey::new(UD_QKEY)),
                    ..QpModify::default()
                },
                QpModify::to_state(QpState::Rtr),
                QpModify {
                    state: Some(QpState::Rts),
                    sq_psn: Some(psn(sq_psn)?),
                    ..QpModify::default()
                },
            ],
            QpType::Rc => vec![
                QpModify {
                    state: Some(QpState::Init),
                    pkey_index: Some(0),
                    port: Some(port1()?),
                    access: Some(access),
                    ..QpModify::default()
                },
                QpModify {
                    state: Some(QpState::Rtr),
                    av: Some(av_to(peer_ip)?),
                    path_mtu: Some(Mtu::Mtu1024),
                    dest_qpn: Some(qpn(self.qps[peer].qpn)?),
                    rq_psn: Some(psn(rq_psn)?),
                    max_dest_rd_atomic: Some(4),
                    min_rnr_timer: Some(1 + self.rng.below(12) as u8),
                    ..QpModify::default()
                },
                QpModify {
                    state: Some(QpState::Rts),
                    sq_psn: Some(psn(sq_psn)?),
                    timeout: Some(8 + self.rng.below(7) as u8),
                    retry_cnt: Some(1 + self.rng.below(7) as u8),
                    // Finite: an RNR retry count of 7 retries forever,
                    // and the liveness phase needs every send to resolve.
                    rnr_retry: Some(self.rng.below(7) as u8),
                    max_rd_atomic: Some(1 + self.rng.below(4) as u8),
                    ..QpModify::default()
                },
            ],
            _ => vec![
                QpModify {
                    state: Some(QpState::Init),
                    pkey_index: Some(0),
                    port: Some(port1()?),
                    access: Some(AccessFlags::REMOTE_WRITE),
                    ..QpModify::default()
                },
                QpModify {
                    state: Some(QpState::Rtr),
                    av: Some(av_to(peer_ip)?),
                    path_mtu: Some(Mtu::Mtu1024),
                    dest_qpn: Some(qpn(self.qps[peer].qpn)?),
                    rq_psn: Some(psn(rq_psn)?),
                    ..QpModify::default()
                },
                QpModify {
                    state: Some(QpState::Rts),
                    sq_psn: Some(psn(sq_psn)?),
                    ..QpModify::default()
                },
            ],
        };
        for step in &steps {
            let before = self.now();
            let status = self.modify(id, step)?;
            let after = self.now();
            if step.state == Some(QpState::Rtr) {
                // TIME WAIT (guide 6.5.2): refused exactly while the quiet
                // period of the QP's last reset may not have passed.
                let wait = self.qps[id].time_wait;
                let must_refuse = wait.is_some_and(|(earliest, _)| after < earliest);
                let must_accept = wait.is_none_or(|(_, latest)| before >= latest);
                let refused = status == IbStatus::QpInTimewait;
                if (refused && must_accept) || (!refused && must_refuse) {
                    return Err(format!(
                        "ModifyQp to RTR of {ty:?} QP {:#x} at {before}..{after} ns, TIME WAIT {wait:?}: {status:?}",
                        self.qps[id].qpn
                    ));
                }
                if refused {
                    self.count("refused: RTR in TIME WAIT");
                    return Ok(false);
                }
                if status == IbStatus::Success && ty.is_connected() {
                    self.qps[id].reached_rtr = true;
                }
            }
            if status != IbStatus::Success {
                if !self.side_ok(self.qps[id].side) {
                    return Ok(false);
                }
                return Err(format!(
                    "ModifyQp {:?} of {ty:?} QP {:#x}: {status:?}",
                    step.state, self.qps[id].qpn
                ));
            }
        }
        self.qps[id].phase = Phase::Ready;
        Ok(true)
    }

    /// Virtual time now.
    fn now(&self) -> u64 {
        self.m.host.scheduler_handle().now_ns()
    }

    /// Moves QP `id` to RESET (from any state) and notes the TIME WAIT
    /// the reset starts if it had reached RTR.
    fn reset_qp(&mut self, id: Id) -> Result<(), String> {
        let before = self.now();
        let status = self.modify(id, &QpModify::to_state(QpState::Reset))?;
        if status != IbStatus::Success {
            return Err(format!("ModifyQp to RESET: {status:?}"));
        }
        let after = self.now();
        let q = &mut self.qps[id];
        q.phase = Phase::Reset;
        if std::mem::take(&mut q.reached_rtr) {
            q.time_wait = Some((before + QPN_QUIET_PERIOD_NS, after + QPN_QUIET_PERIOD_NS));
        }
        Ok(())
    }

    fn create_pair(&mut self) -> Result<(), String> {
        if !(self.sync_ok(0) && self.sync_ok(1)) {
            return Ok(());
        }
        let live = |s: usize| self.qps.iter().filter(|q| q.alive && q.side == s).count();
        if live(0) >= MAX_QPS || live(1) >= MAX_QPS {
            return Ok(());
        }
        if self.knobs.reuse_unpolled && self.rng.below(4) == 0 {
            return self.cycle_gsi();
        }
        let types: Vec<QpType> = [QpType::Rc, QpType::Uc, QpType::Ud]
            .into_iter()
            .zip(self.mix.transports)
            .filter(|(_, on)| *on)
            .map(|(t, _)| t)
            .collect();
        let ty = types[self.rng.below(types.len() as u64) as usize];
        let (Some(a), Some(b)) = (self.create_qp(0, ty, false)?, self.create_qp(1, ty, false)?)
        else {
            return Ok(());
        };
        self.qps[a].peer = Some(b);
        self.qps[b].peer = Some(a);
        let (pa, pb) = (
            self.rng.below(1 << 24) as u32,
            self.rng.below(1 << 24) as u32,
        );
        // New QPs never wait: their numbers had their quiet period.
        if !(self.connect(a, b, pa, pb)? && self.connect(b, a, pb, pa)?)
            && self.side_ok(0)
            && self.side_ok(1)
        {
            return Err(format!("connecting new {ty:?} QPs was refused"));
        }
        self.note(format!(
            "create {ty:?} pair {:#x} <-> {:#x}",
            self.qps[a].qpn, self.qps[b].qpn
        ));
        self.count("create QP pair");
        Ok(())
    }

    /// Special QP number reuse (knob `reuse-unpolled`): a GSI QP with
    /// receives posted is destroyed with its flushes unpolled and created
    /// again at once; it gets the same number (special QPs have no quiet
    /// period), and the old receives must still come back with their own
    /// `wr_id`s.
    fn cycle_gsi(&mut self) -> Result<(), String> {
        let side = self.rng.below(2) as usize;
        let gsi = (0..self.qps.len()).find(|&i| {
            self.qps[i].alive && self.qps[i].side == side && self.qps[i].ty == QpType::Gsi
        });
        if gsi.is_some_and(|i| self.qps[i].busy) {
            return Ok(());
        }
        if let Some(old) = gsi {
            self.note(format!(
                "destroy GSI QP {:#x} with receives outstanding",
                self.qps[old].qpn
            ));
            let submitted = self
                .m
                .submit::<DestroyQp>(side, self.qps[old].handle, &Empty, &[])?;
            self.m.wait(&submitted)?;
            let (status, _, _) = decode::<DestroyQp>(&submitted)?;
            self.destroyed_qp(old, status)?;
        }
        let Some(id) = self.create_qp(side, QpType::Gsi, true)? else {
            return Ok(());
        };
        let init = QpModify {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            qkey: Some(QKey::GSI),
            ..QpModify::default()
        };
        let status = self.modify(id, &init)?;
        if status != IbStatus::Success {
            return Err(format!("ModifyQp INIT of the GSI QP: {status:?}"));
        }
        self.qps[id].phase = Phase::Ready;
        self.note(format!(
            "create GSI QP {:#x} on HCA {side}",
            self.qps[id].qpn
        ));
        self.count("cycle GSI QP");
        self.post_recvs(id, 2)
    }

    fn pick_qp(&mut self, pred: impl Fn(&QpModel) -> bool) -> Option<Id> {
        let ids: Vec<Id> = (0..self.qps.len())
            .filter(|&i| self.qps[i].alive && pred(&self.qps[i]))
            .collect();
        (!ids.is_empty()).then(|| ids[self.rng.below(ids.len() as u64) as usize])
    }

    fn destroy_qp(&mut self) -> Result<(), String> {
        let reuse = self.knobs.reuse_unpolled;
        let Some(id) = self.pick_qp(|q| !q.busy && q.ty != QpType::Gsi) else {
            return Ok(());
        };
        let side = self.qps[id].side;
        if !self.side_ok(side) {
            return Ok(());
        }
        if !reuse {
            // Without the knob a QP's completions are all polled before it
            // goes, so no later QP can inherit them (issue 9 defect 2).
            if self.held(side) {
                return Ok(());
            }
            if self.qps[id].phase == Phase::Ready {
                let status = self.modify(id, &QpModify::to_state(QpState::Err))?;
                if status != IbStatus::Success && self.side_ok(side) {
                    return Err(format!("ModifyQp to ERR before destroy: {status:?}"));
                }
                self.qps[id].phase = Phase::Err;
            }
            self.drain_qp(id)?;
        }
        self.note(format!("destroy QP {:#x} on HCA {side}", self.qps[id].qpn));
        self.count("destroy QP");
        let submitted = self
            .m
            .submit::<DestroyQp>(side, self.qps[id].handle, &Empty, &[])?;
        self.qps[id].busy = true;
        let pending = Pending {
            submitted,
            effect: Effect::Destroyed(id),
        };
        if self.held(side) {
            self.pending.push(pending);
            Ok(())
        } else {
            self.m.wait(&pending.submitted)?;
            self.apply(pending)
        }
    }

    fn destroyed_qp(&mut self, id: Id, status: IbStatus) -> Result<(), String> {
        self.qps[id].busy = false;
        if status != IbStatus::Success {
            return Err(format!("DestroyQp {:#x}: {status:?}", self.qps[id].qpn));
        }
        let q = &mut self.qps[id];
        q.alive = false;
        let (side, handle, send_cq, recv_cq, peer) =
            (q.side, q.handle, q.send_cq, q.recv_cq, q.peer);
        let (max_send, max_recv) = (q.max_send as u32, q.max_recv as u32);
        self.cqs[send_cq].users -= 1;
        self.cqs[recv_cq].users -= 1;
        self.cqs[send_cq].committed -= max_send;
        self.cqs[recv_cq].committed -= max_recv;
        if let Some(peer) = peer {
            self.qps[peer].peer = None;
        }
        lock(&self.m.sides[side].log).dead_qps.insert(handle);
        Ok(())
    }

    /// Polls QP `id`'s CQs until none of its WRs is outstanding (it is in
    /// ERR, so each is flushed if not done).
    fn drain_qp(&mut self, id: Id) -> Result<(), String> {
        // 20 ms of virtual time, or (threaded host, 100 us sleeps that
        // a loaded machine stretches) at least 2 s of real time.
        let rounds = if self.m.threaded { 20_000 } else { 200 };
        for _ in 0..rounds {
            self.check_events()?;
            if !self
                .wrs
                .values()
                .any(|w| w.qp == id && !self.cqs[w.cq].overflowed)
            {
                return Ok(());
            }
            self.m.run_for(100_000, 1_000_000)?;
            let (a, b) = (self.qps[id].send_cq, self.qps[id].recv_cq);
            self.poll_cq(a, 64, false)?;
            if b != a {
                self.poll_cq(b, 64, false)?;
            }
        }
        let left: Vec<u64> = self
            .wrs
            .iter()
            .filter(|(_, w)| w.qp == id)
            .map(|(id, _)| *id)
            .collect();
        Err(format!(
            "QP {:#x} in ERR: WRs {left:x?} neither completed nor flushed after {rounds} rounds of 100 us",
            self.qps[id].qpn
        ))
    }

    fn reconnect(&mut self) -> Result<(), String> {
        // Pairs in ERR first: reconnecting them is what brings traffic back.
        let pair =
            |q: &QpModel| matches!(q.ty, QpType::Rc | QpType::Uc) && !q.busy && q.peer.is_some();
        let Some(a) = self
            .pick_qp(|q| pair(q) && q.phase != Phase::Ready)
            .or_else(|| self.pick_qp(pair))
        else {
            return Ok(());
        };
        let Some(b) = self.qps[a].peer else {
            return Ok(());
        };
        if self.qps[b].busy || !(self.sync_ok(0) && self.sync_ok(1)) {
            return Ok(());
        }
        self.note(format!(
            "reconnect {:?} pair {:#x} <-> {:#x}",
            self.qps[a].ty, self.qps[a].qpn, self.qps[b].qpn
        ));
        self.count("reconnect pair");
        for id in [a, b] {
            if self.qps[id].phase != Phase::Reset {
                let status = self.modify(id, &QpModify::to_state(QpState::Err))?;
                if status != IbStatus::Success {
                    return Err(format!("ModifyQp to ERR: {status:?}"));
                }
                self.qps[id].phase = Phase::Err;
            }
        }
        for id in [a, b] {
            self.drain_qp(id)?;
            self.reset_qp(id)?;
        }
        // Mostly wait out the TIME WAIT of the resets; sometimes try at
        // once, and a refusal is the answer the model predicts.
        // The threaded host's time is real: it never waits 2 s, so its
        // RTR right after a reset is always refused.
        if self.rng.below(4) != 0 && !self.m.threaded {
            let end = [a, b]
                .iter()
                .filter_map(|&id| self.qps[id].time_wait.map(|(_, latest)| latest))
                .max()
                .unwrap_or(0);
            let now = self.now();
            if end > now {
                self.count("wait out TIME WAIT");
                self.m
                    .run_for(end - now, 2_000_000)
                    .map_err(|e| format!("waiting out the TIME WAIT: {e}"))?;
            }
        }
        let (pa, pb) = (
            self.rng.below(1 << 24) as u32,
            self.rng.below(1 << 24) as u32,
        );
        if self.connect(a, b, pa, pb)? && self.connect(b, a, pb, pa)? {
            return Ok(());
        }
        // Refused (TIME WAIT) or an HCA failed: both back to RESET for a
        // later reconnect.
        for id in [a, b] {
            if self.side_ok(self.qps[id].side) {
                if self.qps[id].phase == Phase::Ready {
                    let status = self.modify(id, &QpModify::to_state(QpState::Err))?;
                    if status != IbStatus::Success {
                        return Err(format!("ModifyQp to ERR: {status:?}"));
                    }
                    self.qps[id].phase = Phase::Err;
                    self.drain_qp(id)?;
                }
                self.reset_qp(id)?;
            }
        }
        Ok(())
    }

    /// Moves a random QP to ERR; with `wait` false (or its HCA's command
    /// completions held) the request is left outstanding.
    fn force_err(&mut self, wait: bool) -> Result<(), String> {
        let Some(id) = self.pick_qp(|q| !q.busy && q.phase != Phase::Reset) else {
            return Ok(());
        };
        let side = self.qps[id].side;
        if !self.side_ok(side) {
            return Ok(());
        }
        self.note(format!(
            "force QP {:#x} on HCA {side} to ERR",
            self.qps[id].qpn
        ));
        self.count("force ERR");
        let submitted = self.m.submit::<ModifyQp>(
            side,
            self.qps[id].handle,
            &QpModify::to_state(QpState::Err),
            &[],
        )?;
        self.qps[id].busy = true;
        let pending = Pending {
            submitted,
            effect: Effect::Errored(id),
        };
        if self.held(side) || !wait {
            self.pending.push(pending);
            Ok(())
        } else {
            self.m.wait(&pending.submitted)?;
            self.apply(pending)
        }
    }

    fn rereg_mr(&mut self) -> Result<(), String> {
        let side = self.rng.below(2) as usize;
        if !self.sync_ok(side) {
            return Ok(());
        }
        let rereg = MrRereg {
            translation: None,
            pd: None,
            access: Some(region_access()),
        };
        let mr = self.m.sides[side].mr;
        let (status, _, out) = self.m.call_status::<ReregMr>(side, mr, &rereg, &[])?;
        let keys = match (status, out) {
            (IbStatus::Success, Some(keys)) => keys,
            // The AL does not serve re-registration yet (its layout carries
            // a PD handle it does not translate; docs/ibal-bus.md "Verbs as
            // requests"): refused at once, nothing reaching the CA, the
            // region and its keys unchanged.
            (IbStatus::Unsupported, _) => {
                self.count("rereg MR refused by the AL (not served)");
                return Ok(());
            }
            (status, _) => return Err(format!("ReregMr: {status:?}")),
        };
        let s = &mut self.m.sides[side];
        if keys.rkey == s.rkey {
            return Err(format!("ReregMr kept the R_Key {:?}", keys.rkey));
        }
        s.lkey = keys.lkey;
        s.rkey = keys.rkey;
        self.note(format!("re-register the region of HCA {side}: new keys"));
        self.count("rereg MR");
        Ok(())
    }

    // ----- data path -------------------------------------------------

    fn alloc_slot(&mut self, side: usize) -> Option<usize> {
        let free = &mut self.free_slots[side];
        if free.is_empty() {
            return None;
        }
        let i = self.rng.below(free.len() as u64) as usize;
        Some(free.swap_remove(i))
    }

    fn free_slot(&mut self, side: usize, slot: usize) {
        self.free_slots[side].push(slot);
    }

    fn cq_room(&self, cq: Id) -> usize {
        if self.knobs.cq_overflow {
            usize::MAX
        } else {
            (self.cqs[cq].size as usize).saturating_sub(self.cqs[cq].outstanding)
        }
    }

    fn new_wr(&mut self, side: usize, qp: Id, cq: Id, kind: WrKind) -> u64 {
        let wr_id = self.next_wr_id;
        self.next_wr_id += 1;
        self.wrs.insert(
            wr_id,
            WrModel {
                side,
                qp,
                cq,
                kind,
                posted: false,
            },
        );
        self.cqs[cq].outstanding += 1;
        match kind {
            WrKind::Recv { .. } => self.qps[qp].recvs += 1,
            _ => self.qps[qp].sends += 1,
        }
        wr_id
    }

    /// Forgets a WR the post refused (or that completed): its slots and
    /// counts.
    fn forget(&mut self, wr_id: u64, success: bool) -> Option<WrModel> {
        let wr = self.wrs.remove(&wr_id)?;
        self.cqs[wr.cq].outstanding -= 1;
        match wr.kind {
            WrKind::Recv { slot } => {
                self.qps[wr.qp].recvs -= 1;
                self.free_slot(wr.side, slot);
            }
            WrKind::Send { slot, .. } | WrKind::Read { slot, .. } => {
                self.qps[wr.qp].sends -= 1;
                self.free_slot(wr.side, slot);
            }
            WrKind::Write { slot, target, .. } => {
                self.qps[wr.qp].sends -= 1;
                self.free_slot(wr.side, slot);
                // A failed RC write may still land later (a retransmitted
                // packet in flight): its target stays out of use.
                if let Some((peer, target)) = target
                    && (success || !wr.posted)
                {
                    self.free_slot(peer, target);
                }
            }
        }
        Some(wr)
    }

    /// A post of send (or receive) WRs on a random QP, from a DPC; with
    /// `poll_too` a poll of a random CQ of the same HCA in a second DPC
    /// queued with it.
    fn post_and_poll(&mut self, send: bool, poll_too: bool) -> Result<(), String> {
        let Some(id) = self.pick_qp(|q| !q.busy && q.phase != Phase::Reset && q.ty != QpType::Gsi)
        else {
            return Ok(());
        };
        let side = self.qps[id].side;
        let posted = if send {
            self.post_sends(id)?
        } else {
            let n = 1 + self.rng.below(4) as usize;
            self.post_recvs_queued(id, n)?
        };
        let (poll, second) = if poll_too {
            let max = 4 + self.rng.below(28) as usize;
            let mut cq = self.pick_cq(side);
            let mut two = false;
            if self.m.threaded {
                // The workers really run these DPCs at once: poll the CQ
                // the post completes on, from two processors with
                // `concurrent-polls`, while the post rings its doorbell.
                let q = &self.qps[id];
                let own = if send { q.send_cq } else { q.recv_cq };
                if self.cqs[own].alive && !self.cqs[own].busy {
                    cq = Some(own);
                }
                two = self.knobs.concurrent_polls;
            }
            let first = cq.map(|cq| self.queue_poll(cq, max));
            let second = cq.filter(|_| two).map(|cq| self.queue_poll(cq, max));
            (first, second)
        } else {
            (None, None)
        };
        self.run_until(|| {
            posted.as_ref().is_none_or(|p| lock(&p.1).is_some())
                && poll.as_ref().is_none_or(|p| lock(&p.1).is_some())
                && second.as_ref().is_none_or(|p| lock(&p.1).is_some())
        })?;
        if let Some(posted) = posted {
            self.posted(posted)?;
        }
        for poll in [poll, second].into_iter().flatten() {
            self.polled(poll)?;
        }
        Ok(())
    }

    fn post_recvs(&mut self, id: Id, n: usize) -> Result<(), String> {
        if let Some(posted) = self.post_recvs_queued(id, n)? {
            self.run_until(|| lock(&posted.1).is_some())?;
            self.posted(posted)?;
        }
        Ok(())
    }

    fn post_recvs_queued(&mut self, id: Id, n: usize) -> Result<Option<Posted>, String> {
        let (side, cq) = (self.qps[id].side, self.qps[id].recv_cq);
        // Now and then one more than the queue holds: the refusal must
        // lose nothing.
        let room = self.qps[id].max_recv.saturating_sub(self.qps[id].recvs) + 1;
        let n = n.min(room).min(self.cq_room(cq));
        let mut batch = Vec::new();
        for _ in 0..n {
            let Some(slot) = self.alloc_slot(side) else {
                break;
            };
            let wr_id = self.new_wr(side, id, cq, WrKind::Recv { slot });
            let s = &self.m.sides[side];
            batch.push((wr_id, Sge::new(s.addr(slot, 0), SLOT as u32, s.lkey)));
        }
        if batch.is_empty() {
            return Ok(None);
        }
        self.note(format!(
            "post {} receive(s) on QP {:#x}",
            batch.len(),
            self.qps[id].qpn
        ));
        self.count("post recv");
        let ids: Vec<u64> = batch.iter().map(|(id, _)| *id).collect();
        let result = Arc::new(Mutex::new(None));
        let (ci, qp, sink) = (
            self.m.sides[side].ci.clone(),
            self.qps[id].handle,
            result.clone(),
        );
        self.m.queue_dpc(move || {
            let sges: Vec<[Sge; 1]> = batch.iter().map(|(_, sge)| [*sge]).collect();
            let wrs: Vec<RecvWr<'_>> = batch
                .iter()
                .zip(&sges)
                .map(|((wr_id, _), sge)| RecvWr {
                    wr_id: *wr_id,
                    sg_list: sge,
                })
                .collect();
            *lock(&sink) = Some(ci.post_recv(qp, &wrs));
        });
        Ok(Some((ids, result, id, false)))
    }

    /// Queues a post of 1 to 4 send WRs on QP `id`.
    fn post_sends(&mut self, id: Id) -> Result<Option<Posted>, String> {
        let (side, ty, cq) = (self.qps[id].side, self.qps[id].ty, self.qps[id].send_cq);
        let peer_side = 1 - side;
        let Some(peer) = self.qps[id].peer.or_else(|| {
            (0..self.qps.len()).find(|&i| {
                self.qps[i].alive && self.qps[i].side == peer_side && self.qps[i].ty == ty
            })
        }) else {
            return Ok(None);
        };
        let dest_qpn = self.qps[peer].qpn;
        let faulty = self.fabric_faulty || self.link_down.is_some();
        let big = !faulty || self.knobs.big_under_loss;
        let reads = ty == QpType::Rc && (!faulty || self.knobs.read_under_loss);
        let room = self.qps[id].max_send.saturating_sub(self.qps[id].sends) + 1;
        let n = (1 + self.rng.below(4) as usize)
            .min(room)
            .min(self.cq_room(cq));
        let mut batch: Vec<(u64, SendOp, SendFlags, Sge)> = Vec::new();
        let mut inline_any = false;
        for _ in 0..n {
            let max = match ty {
                QpType::Ud => SMALL_MAX,
                _ if big => BIG_MAX,
                _ => SMALL_MAX,
            };
            let len = HEADER + self.rng.below((max - HEADER + 1) as u64) as usize;
            let Some(slot) = self.alloc_slot(side) else {
                break;
            };
            let s = &self.m.sides[side];
            let (local_addr, lkey) = (s.addr(slot, 0), s.lkey);
            let kind_draw = if ty == QpType::Ud {
                0
            } else {
                self.rng.below(3)
            };
            let msg = self.next_msg;
            self.next_msg += 1;
            let bytes = payload(msg, len);
            self.m.sides[side].write(slot, 0, &bytes)?;
            let (op, kind) = match kind_draw {
                1 => {
                    let target = if ty == QpType::Rc {
                        self.alloc_slot(peer_side).map(|t| (peer_side, t))
                    } else {
                        None
                    };
                    let at = target.map_or(READ_SOURCE_SLOTS + (msg as usize % 2), |(_, t)| t);
                    let p = &self.m.sides[peer_side];
                    let remote = RemoteAddr {
                        addr: p.addr(at, 0),
                        rkey: p.rkey,
                    };
                    (
                        SendOp::RdmaWrite { remote },
                        WrKind::Write {
                            slot,
                            len,
                            target,
                            msg,
                        },
                    )
                }
                2 if reads => {
                    // Multi-packet reads while the fabric is faulty (knob
                    // `read-under-loss`): a lost response leaves a gap.
                    let len = if faulty {
                        (2 * SMALL_MAX
                            + self.rng.below((BIG_MAX - 2 * SMALL_MAX + 1) as u64) as usize)
                            .min(SLOT)
                    } else {
                        len
                    };
                    let len = len.min(READ_SOURCE_SLOTS * SLOT);
                    let source =
                        self.rng.below((READ_SOURCE_SLOTS * SLOT - len + 1) as u64) as usize;
                    let p = &self.m.sides[peer_side];
                    let remote = RemoteAddr {
                        addr: p.addr(0, source),
                        rkey: p.rkey,
                    };
                    (
                        SendOp::RdmaRead { remote },
                        WrKind::Read { slot, len, source },
                    )
                }
                _ => {
                    self.messages.insert(
                        msg,
                        Message {
                            rc: ty == QpType::Rc,
                            to_qp: peer,
                            to_side: peer_side,
                            to_qpn: dest_qpn,
                            len,
                        },
                    );
                    (SendOp::Send, WrKind::Send { slot, msg })
                }
            };
            let len = match kind {
                WrKind::Read { len, .. } => len,
                _ => len,
            };
            let mut flags = SendFlags::SIGNALED;
            if self.knobs.inline_sends
                && !matches!(kind, WrKind::Read { .. })
                && len as u32 <= self.qps[id].inline
                && self.rng.below(2) == 0
            {
                flags |= SendFlags::INLINE;
                inline_any = true;
            }
            // An INLINE SGE names kernel memory the provider copies from
            // (the CI contract), so its bytes are staged in the pool.
            let local_addr = if flags.contains(SendFlags::INLINE) {
                let bytes = self.m.sides[side].read(slot, 0, len)?;
                self.m.sides[side].stage_inline(&bytes)?
            } else {
                local_addr
            };
            let wr_id = self.new_wr(side, id, cq, kind);
            batch.push((wr_id, op, flags, Sge::new(local_addr, len as u32, lkey)));
        }
        if batch.is_empty() {
            return Ok(None);
        }
        let sends = batch
            .iter()
            .filter(|(_, op, ..)| matches!(op, SendOp::Send))
            .count();
        // Mostly the receiver is ready first, so SENDs land rather than
        // end in RNR retries.
        let q = &self.qps[peer];
        if sends > 0 && q.alive && q.phase == Phase::Ready && !q.busy && self.rng.below(4) != 0 {
            self.post_recvs(peer, sends)?;
        }
        self.note(format!(
            "post {} send WR(s) {:?} on {ty:?} QP {:#x} -> {dest_qpn:#x}",
            batch.len(),
            batch
                .iter()
                .map(|(_, op, f, s)| (op_name(op), f.contains(SendFlags::INLINE), s.length.get()))
                .collect::<Vec<_>>(),
            self.qps[id].qpn
        ));
        self.count("post send");
        let ids: Vec<u64> = batch.iter().map(|(id, ..)| *id).collect();
        let ud = (ty == QpType::Ud).then(|| UdDest {
            av: AvHandle::from_raw(self.avs[side]),
            remote_qpn: Qpn::new(dest_qpn).unwrap_or_default(),
            remote_qkey: QKey::new(UD_QKEY),
        });
        let result = Arc::new(Mutex::new(None));
        let (ci, qp, sink) = (
            self.m.sides[side].ci.clone(),
            self.qps[id].handle,
            result.clone(),
        );
        self.m.queue_dpc(move || {
            let sges: Vec<[Sge; 1]> = batch.iter().map(|(.., sge)| [*sge]).collect();
            let wrs: Vec<SendWr<'_>> = batch
                .iter()
                .zip(&sges)
                .map(|((wr_id, op, flags, _), sge)| SendWr {
                    wr_id: *wr_id,
                    op: *op,
                    flags: *flags,
                    sg_list: sge,
                    ud,
                })
                .collect();
            *lock(&sink) = Some(ci.post_send(qp, &wrs));
        });
        Ok(Some((ids, result, id, inline_any)))
    }

    /// Takes in a post's answer: the first `posted` WRs are outstanding,
    /// the rest are forgotten.
    fn posted(&mut self, (ids, result, id, inline): Posted) -> Result<(), String> {
        let (count, status) = lock(&result).take().ok_or("the post did not run")?;
        if count > ids.len() || (count < ids.len()) == (status == IbStatus::Success) {
            return Err(format!(
                "post answered {count} of {} with {status:?}",
                ids.len()
            ));
        }
        for &wr_id in &ids[..count] {
            if let Some(wr) = self.wrs.get_mut(&wr_id) {
                wr.posted = true;
            }
        }
        for &wr_id in &ids[count..] {
            if self.done.contains(&wr_id) {
                return Err(format!(
                    "WR {wr_id:#x} completed although its post was refused"
                ));
            }
            self.forget(wr_id, false);
        }
        if status != IbStatus::Success {
            self.count(status_name(status));
            let q = &self.qps[id];
            if inline && status == IbStatus::InvalidParameter && q.phase == Phase::Ready {
                return Err(format!(
                    "an INLINE send within the {} inline bytes CreateQp granted QP {:#x} was refused: {status:?}",
                    q.inline, q.qpn
                ));
            }
        }
        Ok(())
    }

    fn queue_poll(&mut self, cq: Id, max: usize) -> PollResult {
        let result = Arc::new(Mutex::new(None));
        let side = self.cqs[cq].side;
        let (ci, handle, sink) = (
            self.m.sides[side].ci.clone(),
            self.cqs[cq].handle,
            result.clone(),
        );
        self.m.queue_dpc(move || {
            let mut all = Vec::new();
            let mut wcs = [WorkCompletion::EMPTY; 4];
            let outcome = loop {
                if all.len() >= max {
                    break Ok(all);
                }
                match ci.poll_cq(handle, &mut wcs) {
                    Ok(0) => break Ok(all),
                    Ok(n) => all.extend_from_slice(&wcs[..n]),
                    Err(status) => break Err(status),
                }
            };
            *lock(&sink) = Some(outcome);
        });
        (cq, result)
    }

    fn poll_op(&mut self) -> Result<(), String> {
        let side = self.rng.below(2) as usize;
        let Some(cq) = self.pick_cq(side) else {
            return Ok(());
        };
        let two = self.knobs.concurrent_polls && self.rng.below(2) == 0;
        self.note(format!(
            "poll CQ {:#x} on HCA {side}{}",
            self.cqs[cq].handle,
            if two { " from two DPCs" } else { "" }
        ));
        let max = 4 + self.rng.below(60) as usize;
        self.poll_cq(cq, max, two)
    }

    fn poll_cq(&mut self, cq: Id, max: usize, two: bool) -> Result<(), String> {
        let first = self.queue_poll(cq, max);
        let second = two.then(|| self.queue_poll(cq, max));
        self.run_until(|| {
            lock(&first.1).is_some() && second.as_ref().is_none_or(|p| lock(&p.1).is_some())
        })?;
        self.count("poll");
        self.polled(first)?;
        if let Some(second) = second {
            self.polled(second)?;
        }
        Ok(())
    }

    fn polled(&mut self, (cq, result): PollResult) -> Result<(), String> {
        let outcome = lock(&result).take().ok_or("the poll did not run")?;
        let wcs =
            outcome.map_err(|s| format!("poll of live CQ {:#x}: {s:?}", self.cqs[cq].handle))?;
        for wc in wcs {
            self.completion(cq, &wc)?;
        }
        Ok(())
    }

    /// One completion against the model.
    fn completion(&mut self, cq: Id, wc: &WorkCompletion) -> Result<(), String> {
        let wr_id = wc.wr_id;
        let Some(wr) = self.wrs.get(&wr_id) else {
            return Err(if self.done.contains(&wr_id) {
                format!("second completion of wr_id {wr_id:#x}: {wc:?}")
            } else {
                format!("completion with a wr_id never posted ({wr_id:#x}): {wc:?}")
            });
        };
        if !wr.posted {
            return Err(format!(
                "completion of wr_id {wr_id:#x} before its post answered: {wc:?}"
            ));
        }
        let (qp, side, kind) = (wr.qp, wr.side, wr.kind);
        if wr.cq != cq {
            return Err(format!(
                "wr_id {wr_id:#x} completed on CQ {:#x}, posted for CQ {:#x}",
                self.cqs[cq].handle, self.cqs[wr.cq].handle
            ));
        }
        if wc.qp_num.get() != self.qps[qp].qpn {
            return Err(format!(
                "wr_id {wr_id:#x} of QP {:#x} completed naming QP {:#x}",
                self.qps[qp].qpn,
                wc.qp_num.get()
            ));
        }
        let success = wc.status == WcStatus::Success;
        if self.echo && !success {
            println!(
                "step {}: HCA {side} QP {:#x} wr_id {wr_id:#x} ({kind:?}): {:?}",
                self.step, self.qps[qp].qpn, wc.status
            );
        }
        if success {
            self.check_data(side, qp, kind, wc)?;
            if let WrKind::Send { msg, .. } = kind
                && self.qps[qp].ty == QpType::Rc
            {
                self.acked.insert(msg);
            }
        }
        self.forget(wr_id, success);
        self.done.insert(wr_id);
        self.report.completions += 1;
        if self.restarted[side] && success {
            self.count("successful completion on a restarted HCA");
        }
        *self
            .report
            .statuses
            .entry(format!("{:?}", wc.status))
            .or_default() += 1;
        Ok(())
    }

    fn check_data(
        &mut self,
        side: usize,
        qp: Id,
        kind: WrKind,
        wc: &WorkCompletion,
    ) -> Result<(), String> {
        let q = &self.qps[qp];
        match kind {
            WrKind::Recv { slot } => {
                let skip = if matches!(q.ty, QpType::Ud | QpType::Gsi) {
                    GRH
                } else {
                    0
                };
                let got = wc.byte_len as usize;
                if got < skip + HEADER {
                    return Err(format!(
                        "receive of {got} bytes on QP {:#x}: no message header",
                        q.qpn
                    ));
                }
                let header = self.m.sides[side].read(slot, skip, HEADER)?;
                let id = u64::from_le_bytes(header[..8].try_into().unwrap_or_default());
                let Some(msg) = self.messages.get(&id).copied() else {
                    return Err(format!(
                        "receive on QP {:#x} holds bytes of no message sent ({id:#x})",
                        q.qpn
                    ));
                };
                if (msg.to_side, msg.to_qpn) != (side, q.qpn) || got != skip + msg.len {
                    return Err(format!(
                        "receive on HCA {side} QP {:#x} of {got} bytes holds message {id} of {} bytes sent to HCA {} QP {:#x}",
                        q.qpn, msg.len, msg.to_side, msg.to_qpn
                    ));
                }
                if self.m.sides[side].read(slot, skip, msg.len)? != payload(id, msg.len) {
                    return Err(format!(
                        "receive of message {id} on QP {:#x}: payload differs",
                        q.qpn
                    ));
                }
                if !self.received.insert(id) && msg.rc {
                    return Err(format!(
                        "RC message {id} received twice (on QP {:#x})",
                        q.qpn
                    ));
                }
                self.report.bytes_checked += msg.len as u64;
            }
            WrKind::Write {
                len,
                target: Some((peer, at)),
                msg,
                ..
            } => {
                if self.m.sides[peer].read(at, 0, len)? != payload(msg, len) {
                    return Err(format!(
                        "RDMA WRITE of {len} bytes from QP {:#x} succeeded but the target holds other bytes",
                        q.qpn
                    ));
                }
                self.report.bytes_checked += len as u64;
            }
            WrKind::Read { slot, len, source } => {
                let want = &read_source_pattern()[source..source + len];
                if self.m.sides[side].read(slot, 0, len)? != want {
                    return Err(format!(
                        "RDMA READ of {len} bytes on QP {:#x}: bytes differ",
                        q.qpn
                    ));
                }
                self.report.bytes_checked += len as u64;
            }
            WrKind::Send { .. } | WrKind::Write { target: None, .. } => {}
        }
        Ok(())
    }

    fn arm(&mut self) -> Result<(), String> {
        let side = self.rng.below(2) as usize;
        let Some(cq) = self.pick_cq(side) else {
            return Ok(());
        };
        let notify = if self.rng.below(3) == 0 {
            CqNotify::Solicited
        } else {
            CqNotify::NextCompletion
        };
        let result = Arc::new(Mutex::new(None));
        let (ci, handle, sink) = (
            self.m.sides[side].ci.clone(),
            self.cqs[cq].handle,
            result.clone(),
        );
        self.m
            .queue_dpc(move || *lock(&sink) = Some(ci.arm_cq(handle, notify)));
        self.run_until(|| lock(&result).is_some())?;
        self.count("arm CQ");
        if let Some(Err(status)) = lock(&result).take()
            && self.side_ok(side)
        {
            return Err(format!("arm of live CQ {handle:#x}: {status:?}"));
        }
        Ok(())
    }

    // ----- time and faults --------------------------------------------

    /// Runs the scheduler one item at a time until `done` holds.
    fn run_until(&self, done: impl Fn() -> bool) -> Result<(), String> {
        self.m.run_until("a queued DPC", 100_000, done)
    }

    fn run_time(&mut self) -> Result<(), String> {
        let ns = match self.rng.below(4) {
            0 => 1_000 + self.rng.below(10_000),
            1 | 2 => 10_000 + self.rng.below(500_000),
            _ => 500_000 + self.rng.below(5_000_000),
        };
        self.count("run");
        self.m
            .run_for(ns, 2_000_000)
            .map_err(|e| format!("running {ns} ns: {e}"))
    }

    fn set_link(&mut self, function: usize, up: bool) {
        self.m.host.backplane().with_cluster(|c| {
            if let Some(node) = c.nodes().nth(function) {
                let _ = c.set_link(node, 1, up);
            }
        });
        if up {
            self.link_down = None;
        }
    }

    fn link_flap(&mut self) -> Result<(), String> {
        if self.link_down.is_some() {
            return Ok(());
        }
        let side = self.rng.below(2) as usize;
        let function = self.m.sides[side].function;
        let until = self.step + 1 + self.rng.below(6) as usize;
        self.note(format!("link of HCA {side} down until step {until}"));
        self.count("fault: link flap");
        self.set_link(function, false);
        self.link_down = Some((function, until));
        Ok(())
    }

    fn set_fabric_faults(&mut self, on: bool) {
        let faults = if on {
            self.mix.faults
        } else {
            FaultConfig::default()
        };
        self.m
            .host
            .backplane()
            .with_cluster(|c| c.fabric_mut().set_faults(faults));
        self.fabric_faulty = on && faults != FaultConfig::default();
    }

    fn fabric_toggle(&mut self) -> Result<(), String> {
        let on = !self.fabric_faulty;
        self.note(format!("fabric faults {}", if on { "on" } else { "off" }));
        self.count("fault: fabric toggle");
        self.set_fabric_faults(on);
        Ok(())
    }

    fn catastrophic(&mut self) -> Result<(), String> {
        // One per run: the shell reports the failed HCA to PnP
        // (WdfDeviceSetFailed, AttemptRestart); the client lets go of it
        // at once (`let_go`) and takes hold of the restarted one after
        // the PnP manager's next pass (`restart`).
        // In the second half of the run, so that the first half moves
        // traffic on two working HCAs.
        if self.catastrophe
            || self.step < self.steps / 2
            || !self.pending.is_empty()
            || self.hold.is_some()
        {
            return Ok(());
        }
        self.catastrophe = true;
        let side = self.rng.below(2) as usize;
        self.note(format!("catastrophic error on HCA {side}"));
        self.count("fault: catastrophic");
        let function = self.m.sides[side].function;
        self.m
            .host
            .backplane()
            .with_device(function, |d| d.declare_fatal(FatalSyndrome::Internal));
        self.m.run_for(100_000, 1_000_000)?;
        if !self.m.sides[side].failed() {
            return Err(format!("HCA {side} not failed after a catastrophic error"));
        }
        for q in self.qps.iter_mut().filter(|q| q.side == side) {
            q.phase = Phase::Err;
        }
        self.let_go(side)?;
        // Mostly the PnP worker gets round to it within a few steps;
        // sometimes only the next resume's pass (or the liveness phase)
        // restarts it, so the machine sleeps with the failed HCA let go.
        let due = if self.rng.below(3) == 0 {
            usize::MAX
        } else {
            self.step + 1 + self.rng.below(16) as usize
        };
        self.restart_due = Some((side, due));
        Ok(())
    }

    /// The client lets go of failed HCA `side` (the bus filter does so on
    /// the surprise removal `WdfDeviceSetFailed` begins): every WR on it
    /// completes exactly once (the failed core flushes them all), its QPs,
    /// CQs and AV are destroyed, its memory freed, the CA closed and the
    /// CI interface given back. The other HCA's QPs connected to it go to
    /// ERR: their partner is gone, and the restarted device hands out the
    /// same QP numbers again to strangers.
    fn let_go(&mut self, side: usize) -> Result<(), String> {
        self.check_events()?;
        // The other port clients let go too: the extra AL clients close
        // with whatever they own (the AL destroys it on the failed CA),
        // and the applications with opens on it exit.
        self.close_extras(Some(side))?;
        self.kill_users(Some(side))?;
        self.forget_stale_handles(side);
        let mine = |w: &WrModel| w.side == side;
        for _ in 0..64 {
            if !self.wrs.values().any(mine) {
                break;
            }
            let cqs: Vec<Id> = (0..self.cqs.len())
                .filter(|&i| self.cqs[i].alive && self.cqs[i].side == side)
                .collect();
            for cq in cqs {
                self.poll_cq(cq, 256, false)?;
            }
        }
        let left: Vec<u64> = self
            .wrs
            .iter()
            .filter(|(_, w)| mine(w) && !self.cqs[w.cq].overflowed)
            .map(|(id, _)| *id)
            .collect();
        if !left.is_empty() {
            return Err(format!(
                "HCA {side} failed: WRs {left:x?} neither completed nor flushed"
            ));
        }
        // Lost with an overflowed CQ (knob `cq-overflow`).
        let lost: Vec<u64> = self
            .wrs
            .iter()
            .filter(|(_, w)| mine(w))
            .map(|(id, _)| *id)
            .collect();
        for wr_id in lost {
            self.forget(wr_id, false);
        }
        // Every RC/UC QP of the other HCA was connected to this one (pairs
        // span the two), also one whose partner was destroyed before (no
        // `peer` any more) but is still connected to its number: the
        // restarted core hands QP numbers out again at once, with no quiet
        // period, so such a QP left in RTS would deliver into a stranger.
        let orphans: Vec<Id> = (0..self.qps.len())
            .filter(|&i| {
                let q = &self.qps[i];
                q.alive
                    && q.side != side
                    && matches!(q.ty, QpType::Rc | QpType::Uc)
                    && q.peer.is_none_or(|p| self.qps[p].side == side)
            })
            .collect();
        for id in 0..self.qps.len() {
            if self.qps[id].alive && self.qps[id].side == side {
                let submitted =
                    self.m
                        .submit::<DestroyQp>(side, self.qps[id].handle, &Empty, &[])?;
                self.m.wait(&submitted)?;
                let (status, _, _) = decode::<DestroyQp>(&submitted)?;
                self.destroyed_qp(id, status)?;
            }
        }
        for id in 0..self.cqs.len() {
            if self.cqs[id].alive && self.cqs[id].side == side {
                let handle = self.cqs[id].handle;
                self.m.call::<DestroyCq>(side, handle, &Empty)?;
                self.cqs[id].alive = false;
            }
        }
        self.m.call::<DestroyAv>(side, self.avs[side], &Empty)?;
        // The other HCA's RDMA WRITEs into the failed HCA's memory can no
        // longer be checked (the memory is freed) and their target slots
        // belong to the old region.
        for w in self.wrs.values_mut() {
            if let WrKind::Write { target, .. } = &mut w.kind
                && target.is_some_and(|(s, _)| s == side)
            {
                *target = None;
            }
        }
        self.m.let_go(side)?;
        self.free_slots[side] = (FIRST_FREE_SLOT..SLOTS).collect();
        for id in orphans {
            if self.qps[id].phase != Phase::Reset {
                let status = self.modify(id, &QpModify::to_state(QpState::Err))?;
                if status != IbStatus::Success {
                    return Err(format!(
                        "ModifyQp to ERR of QP {:#x}, its partner on the failed HCA gone: {status:?}",
                        self.qps[id].qpn
                    ));
                }
                self.qps[id].phase = Phase::Err;
            }
        }
        self.note(format!("HCA {side} let go: objects freed, CA closed"));
        Ok(())
    }

    /// The PnP manager's pass (unless a resume ran it already) restarts
    /// the failed HCA `side`'s stack; the client takes hold of the new
    /// device and builds its objects again: an AV, two CQs, two QP pairs
    /// connected afresh.
    fn restart(&mut self, side: usize) -> Result<(), String> {
        self.restart_due = None;
        self.check_events()?;
        // The PnP pass and the bring-up settle the machine: a device
        // holding its command completions would run into its command
        // timeout meanwhile and be failed too, so a hold ends first.
        if let Some((held, _)) = self.hold {
            self.note(format!("release HCA {held}'s held command completions"));
            self.release_hold(held);
        }
        let node = self.m.sides[side].device.node();
        let restarted = self
            .m
            .driver
            .devices()
            .iter()
            .any(|d| d.node() == node && d.hca().is_some_and(|h| h.failure().is_none()));
        if restarted {
            self.count("PnP restart by the resume's pass");
        } else {
            self.m.host.pnp().process_bus_relations();
            self.m.settle()?;
        }
        self.restarted[side] = true;
        self.m.reattach(side)?;
        self.note(format!("HCA {side} restarted by PnP: CA opened again"));
        self.count("PnP restart of the failed HCA");
        let peer_ip = self.m.sides[1 - side].ip;
        let pd = self.m.sides[side].pd;
        let (av, _) = self.m.call::<CreateAv>(side, pd, &av_to(peer_ip)?)?;
        self.avs[side] = av;
        self.create_cq(side, false)?;
        self.create_cq(side, false)?;
        for _ in 0..2 {
            self.create_pair()?;
        }
        Ok(())
    }

    fn sleep_resume(&mut self) -> Result<(), String> {
        // The host waits for requests its power-managed queues delivered
        // before D0 exit: a device holding its command completions would
        // never let it go on, so a hold ends here.
        if let Some((side, _)) = self.hold {
            self.note(format!("release HCA {side}'s held command completions"));
            self.release_hold(side);
        }
        // Control verbs in flight: some reach the miniport's queue before
        // the sleep (D0 exit waits for them), some are sent while asleep
        // (the queue holds them until resume).
        let in_flight = self.rng.below(4);
        for _ in 0..in_flight {
            if self.rng.below(2) == 0 {
                self.force_err(false)?;
            } else {
                self.resize_cq(false)?;
            }
        }
        let al_requests = self.sleep_requests()?;
        for _ in 0..self.rng.below(4) {
            self.m.run_one()?;
        }
        let outstanding = self
            .pending
            .iter()
            .filter(|p| p.submitted.issuer.completion().is_none())
            .count();
        self.note(format!(
            "sleep (S3) and resume with {outstanding} request(s) outstanding"
        ));
        self.count("fault: sleep and resume");
        if outstanding > 0 {
            self.count("sleep with requests outstanding");
        }
        if self.catastrophe {
            self.count("sleep after the catastrophic error");
        }
        let pnp = self.m.host.pnp();
        pnp.set_system_power(SystemPowerState::S3)
            .map_err(|veto| format!("S3 vetoed: {veto}"))?;
        pnp.set_system_power(SystemPowerState::S0)
            .map_err(|veto| format!("resume: {veto}"))?;
        self.m.run_for(1_000_000, 2_000_000)?;
        if !al_requests.is_empty() {
            self.count("sleep with AL requests in flight");
        }
        self.after_sleep_requests(al_requests)?;
        // Connected QPs come back in ERR (docs/miniport.md "Power").
        for q in self
            .qps
            .iter_mut()
            .filter(|q| matches!(q.ty, QpType::Rc | QpType::Uc))
        {
            if q.phase == Phase::Ready {
                q.phase = Phase::Err;
            }
        }
        // The resume ran the PnP manager's pass: a failed HCA let go of
        // is restarted now.
        if let Some((side, _)) = self.restart_due {
            self.restart(side)?;
        }
        Ok(())
    }

    fn hold_commands(&mut self) -> Result<(), String> {
        if self.hold.is_some() {
            return Ok(());
        }
        let side = self.rng.below(2) as usize;
        if !self.side_ok(side) {
            return Ok(());
        }
        let until = self.step + 1 + self.rng.below(8) as usize;
        self.note(format!(
            "hold HCA {side}'s command completions until step {until}"
        ));
        self.count("fault: hold commands");
        let function = self.m.sides[side].function;
        self.m
            .host
            .backplane()
            .with_device(function, |d| d.hold_command_completions());
        self.hold = Some((side, until));
        Ok(())
    }

    fn release_hold(&mut self, side: usize) {
        let function = self.m.sides[side].function;
        self.m
            .host
            .backplane()
            .with_device(function, |d| d.release_command_completions());
        self.hold = None;
    }

    // ----- liveness and teardown ----------------------------------------

    fn poll_everything(&mut self) -> Result<(), String> {
        let live: Vec<Id> = (0..self.cqs.len()).filter(|&i| self.cqs[i].alive).collect();
        for cq in live {
            for _ in 0..64 {
                let before = self.report.completions;
                self.poll_cq(cq, 256, false)?;
                if self.report.completions == before {
                    break;
                }
            }
        }
        Ok(())
    }

    /// Faults off; every send WR resolves within [`LIVENESS_BOUND_NS`] of
    /// virtual time; then, every QP in ERR, nothing is left outstanding.
    pub(crate) fn liveness(&mut self) -> Result<(), String> {
        self.step += 1;
        self.note("liveness: faults off".to_owned());
        if let Some((side, _)) = self.hold {
            self.release_hold(side);
        }
        if let Some((function, _)) = self.link_down {
            self.set_link(function, true);
        }
        self.set_fabric_faults(false);
        if let Some((side, _)) = self.restart_due {
            self.restart(side)?;
        }
        for pending in std::mem::take(&mut self.pending) {
            self.m.wait(&pending.submitted)?;
            self.apply(pending)?;
        }
        let start = self.m.host.scheduler_handle().now_ns();
        let is_send = |w: &WrModel, cqs: &[CqModel]| {
            !matches!(w.kind, WrKind::Recv { .. }) && !cqs[w.cq].overflowed
        };
        while self.wrs.values().any(|w| is_send(w, &self.cqs)) {
            if self.m.host.scheduler_handle().now_ns() - start > LIVENESS_BOUND_NS {
                let left: Vec<String> = self
                    .wrs
                    .iter()
                    .filter(|(_, w)| is_send(w, &self.cqs))
                    .take(8)
                    .map(|(id, w)| {
                        format!("{id:#x} on QP {:#x} ({:?})", self.qps[w.qp].qpn, w.kind)
                    })
                    .collect();
                return Err(format!(
                    "liveness: send WRs still outstanding {} ms after the faults stopped: {}",
                    LIVENESS_BOUND_NS / 1_000_000,
                    left.join(", ")
                ));
            }
            self.m.run_for(10_000_000, 5_000_000)?;
            self.poll_everything()?;
            self.check_events()?;
        }
        // Every QP to ERR: the receives still posted are flushed.
        for id in 0..self.qps.len() {
            let q = &self.qps[id];
            if q.alive && q.phase != Phase::Reset && self.side_ok(q.side) {
                let status = self.modify(id, &QpModify::to_state(QpState::Err))?;
                if status != IbStatus::Success && self.side_ok(self.qps[id].side) {
                    return Err(format!("liveness: ModifyQp to ERR: {status:?}"));
                }
            }
        }
        let rounds = if self.m.threaded { 500 } else { 20 };
        for _ in 0..rounds {
            self.m.run_for(1_000_000, 5_000_000)?;
            self.poll_everything()?;
            if self.wrs.is_empty() {
                break;
            }
        }
        // An overflowed CQ (knob `cq-overflow`) may have lost any of its
        // completions.
        let lost: Vec<u64> = self
            .wrs
            .iter()
            .filter(|(_, w)| self.cqs[w.cq].overflowed)
            .map(|(id, _)| *id)
            .collect();
        for wr_id in lost {
            self.forget(wr_id, false);
        }
        if !self.wrs.is_empty() {
            let left: Vec<String> = self
                .wrs
                .iter()
                .take(8)
                .map(|(id, w)| {
                    let q = &self.qps[w.qp];
                    let c = &self.cqs[w.cq];
                    format!(
                        "{id:#x} on HCA {} {:?} QP {:#x} ({}{:?}; CQ {:#x}, {} of {} entries outstanding)",
                        w.side,
                        q.ty,
                        q.qpn,
                        if q.alive { "" } else { "destroyed, " },
                        w.kind,
                        c.handle,
                        c.outstanding,
                        c.size
                    )
                })
                .collect();
            return Err(format!(
                "liveness: {} WR(s) neither completed nor flushed with every QP in ERR: {}",
                self.wrs.len(),
                left.join(", ")
            ));
        }
        // RC is reliable: a send the requester saw succeed was received
        // (IBA 9.7.5: no ACK for a request whose execution failed).
        let mut lost: Vec<u64> = self
            .acked
            .iter()
            .filter(|id| !self.received.contains(id))
            .copied()
            .collect();
        if !lost.is_empty() {
            lost.sort_unstable();
            let m = self.messages[&lost[0]];
            let overflowed = self.cqs[self.qps[m.to_qp].recv_cq].overflowed;
            return Err(format!(
                "liveness: {} RC message(s) acknowledged to the sender but never received, e.g. message {} ({} bytes) to HCA {} QP {:#x}{}: {:?}",
                lost.len(),
                lost[0],
                m.len,
                m.to_side,
                m.to_qpn,
                if overflowed {
                    " (its receive CQ overflowed)"
                } else {
                    ""
                },
                &lost[..lost.len().min(8)]
            ));
        }
        self.check_events()?;
        self.report.virtual_ns = self.m.host.scheduler_handle().now_ns();
        self.report.overlapping_dpcs = self.m.overlapping_dpcs();
        if let Some(counters) = self
            .m
            .host
            .backplane()
            .with_cluster(|c| c.fabric().total_counters())
        {
            self.report.frames = counters.tx_frames;
        }
        Ok(())
    }

    /// Destroys everything, closes the CAs, shuts the machine down and
    /// requires an empty verifier report.
    pub(crate) fn teardown(mut self) -> Result<Report, String> {
        self.close_extras(None)?;
        self.kill_users(None)?;
        self.check_extras()?;
        for id in 0..self.qps.len() {
            if self.qps[id].alive {
                let side = self.qps[id].side;
                let submitted =
                    self.m
                        .submit::<DestroyQp>(side, self.qps[id].handle, &Empty, &[])?;
                self.m.wait(&submitted)?;
                let (status, _, _) = decode::<DestroyQp>(&submitted)?;
                self.destroyed_qp(id, status)?;
            }
        }
        for side in 0..2 {
            self.m.call::<DestroyAv>(side, self.avs[side], &Empty)?;
        }
        for id in 0..self.cqs.len() {
            if self.cqs[id].alive {
                let (side, handle) = (self.cqs[id].side, self.cqs[id].handle);
                self.m.call::<DestroyCq>(side, handle, &Empty)?;
                self.cqs[id].alive = false;
            }
        }
        for side in 0..2 {
            self.m.deregister_memory(side)?;
            let pd = self.m.sides[side].pd;
            self.m
                .call::<ib_types::ioctl::DeallocPd>(side, pd, &Empty)?;
            self.m.close_client(side)?;
        }
        self.check_events()?;
        self.m.host.shut_down();
        let violations = self.m.host.verifier().violations();
        if !violations.is_empty() {
            return Err(format!("verifier after shutdown: {violations:?}"));
        }
        let _ = &self.m.driver;
        Ok(self.report)
    }
}

/// A queued post: its WR ids, the DPC's answer, the QP, and whether an
/// INLINE WR is among them.
type Posted = (Vec<u64>, Arc<Mutex<Option<(usize, IbStatus)>>>, Id, bool);
/// A queued poll: the CQ and the DPC's answer.
type PollResult = (
    Id,
    Arc<Mutex<Option<Result<Vec<WorkCompletion>, IbStatus>>>>,
);

fn op_name(op: &SendOp) -> &'static str {
    match op {
        SendOp::Send => "SEND",
        SendOp::RdmaWrite { .. } => "WRITE",
        SendOp::RdmaRead { .. } => "READ",
        _ => "other",
    }
}

fn status_name(status: IbStatus) -> &'static str {
    match status {
        IbStatus::InsufficientResources => "refused: InsufficientResources",
        IbStatus::InvalidQpState => "refused: InvalidQpState",
        IbStatus::InvalidParameter => "refused: InvalidParameter",
        IbStatus::InvalidState => "refused: InvalidState",
        IbStatus::InvalidCqSize => "refused: InvalidCqSize",
        _ => "refused: other status",
    }
}
