//! What a seed explores: the knobs (verb and fault mixes that reached the
//! defects of issue 9, and the issue-11 actors; all on by default) and the
//! per-seed mix drawn from the seed — which operations and faults are
//! enabled and how often ("swarm testing": different seeds explore
//! different mixes instead of every run averaging over everything).

use sim_hca::fabric::FaultConfig;
use sim_hca::rng::Rng;

/// Switches for the verb and fault mixes that reached the defects of
/// issue 9 (all fixed now). The default, and the default suite, is every
/// knob on ([`Knobs::ALL`]); `--knobs none` or a list narrows a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Knobs {
    /// Destroy a QP while its completions are still unpolled and create
    /// QPs again at once, and cycle special (GSI) QPs, whose numbers are
    /// reused with no quiet period (issue 9 defect 2). Off: a QP is moved
    /// to ERR and its completions polled before it is destroyed.
    pub reuse_unpolled: bool,
    /// Poll one CQ from two DPCs queued together (defect 3).
    pub concurrent_polls: bool,
    /// RDMA READs while the fabric loses, duplicates or reorders packets
    /// (defect 4: read-response gaps livelock). Off: READs only while the
    /// fabric is clean.
    pub read_under_loss: bool,
    /// CQs of 1 to 4 entries (every QP on them is refused, guide 8.2.3
    /// item 1), resizes to any size (below the QPs' queues: refused), and
    /// posts not held to a CQ's size. Posting past a CQ's capacity is
    /// now impossible by construction for kernel QPs (their queues must
    /// fit their CQs); only the CQEs a destroyed QP left unpolled
    /// (`reuse-unpolled`) are not counted. Off: the workload keeps every
    /// CQ's outstanding WRs within its size (defect 5 was an ACK for a
    /// message whose receive CQE could not be written).
    pub cq_overflow: bool,
    /// Multi-packet messages (up to 4 KiB at MTU 1024) while the fabric
    /// loses packets (defect 6: retransmission restarts at the first
    /// packet). Off: messages fit one packet while the fabric is faulty.
    pub big_under_loss: bool,
    /// INLINE sends on QPs granted inline capacity (defect 8: the CI fast
    /// path refuses them although QueryCA advertises inline).
    pub inline_sends: bool,
    /// More AL clients (issue 11) opening on the port children and closing
    /// at random, often with live objects (the AL destroys them in
    /// dependency order), also when their HCA fails.
    pub al_clients: bool,
    /// Children added and removed at runtime: entries of the filter's
    /// registry list written and deleted, then `registry_changed`.
    pub child_churn: bool,
    /// User-mode opens through the proxy (`GUID_IB_AL_DEVICE_INTERFACE`)
    /// creating a CA context, PDs, CQs and a region, and their processes
    /// dying at random.
    pub user_opens: bool,
    /// Handles forged across opens: another client's, a closed client's,
    /// another process's open's; each must be refused, nothing changed.
    pub forged_handles: bool,
    /// Sleeps with the extra AL clients' requests in flight (sent before
    /// the sleep and while asleep): each completes exactly once.
    pub sleep_al_requests: bool,
}

impl Default for Knobs {
    /// Every knob on: the defects they reached are fixed.
    fn default() -> Self {
        Self::ALL
    }
}

impl Knobs {
    /// Every knob's name, as `--knobs` takes them.
    pub const NAMES: [&'static str; 11] = [
        "reuse-unpolled",
        "concurrent-polls",
        "read-under-loss",
        "cq-overflow",
        "big-under-loss",
        "inline-sends",
        "al-clients",
        "child-churn",
        "user-opens",
        "forged-handles",
        "sleep-al-requests",
    ];

    /// Every knob off.
    pub const NONE: Self = Self {
        reuse_unpolled: false,
        concurrent_polls: false,
        read_under_loss: false,
        cq_overflow: false,
        big_under_loss: false,
        inline_sends: false,
        al_clients: false,
        child_churn: false,
        user_opens: false,
        forged_handles: false,
        sleep_al_requests: false,
    };

    /// Every knob on.
    pub const ALL: Self = Self {
        reuse_unpolled: true,
        concurrent_polls: true,
        read_under_loss: true,
        cq_overflow: true,
        big_under_loss: true,
        inline_sends: true,
        al_clients: true,
        child_churn: true,
        user_opens: true,
        forged_handles: true,
        sleep_al_requests: true,
    };

    /// The knobs of issue 9 on, the issue-11 actors off: a seed then runs
    /// exactly the workload it ran before those actors existed (their
    /// weights come from a generator of their own), so replays of seeds
    /// found then keep replaying.
    pub const ISSUE_9: Self = Self {
        al_clients: false,
        child_churn: false,
        user_opens: false,
        forged_handles: false,
        sleep_al_requests: false,
        ..Self::ALL
    };

    /// Parses a comma-separated list of knob names, `all` or `none`.
    pub fn parse(list: &str) -> Result<Self, String> {
        let mut knobs = Self::NONE;
        for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            match name {
                "all" => knobs = Self::ALL,
                "none" => knobs = Self::NONE,
                _ => {
                    *knobs.flag(name).ok_or_else(|| {
                        format!("unknown knob {name:?}; knobs: {}", Self::NAMES.join(", "))
                    })? = true
                }
            }
        }
        Ok(knobs)
    }

    fn flag(&mut self, name: &str) -> Option<&mut bool> {
        Some(match name {
            "reuse-unpolled" => &mut self.reuse_unpolled,
            "concurrent-polls" => &mut self.concurrent_polls,
            "read-under-loss" => &mut self.read_under_loss,
            "cq-overflow" => &mut self.cq_overflow,
            "big-under-loss" => &mut self.big_under_loss,
            "inline-sends" => &mut self.inline_sends,
            "al-clients" => &mut self.al_clients,
            "child-churn" => &mut self.child_churn,
            "user-opens" => &mut self.user_opens,
            "forged-handles" => &mut self.forged_handles,
            "sleep-al-requests" => &mut self.sleep_al_requests,
            _ => return None,
        })
    }

    /// The knobs that are on, comma-separated (`none` if none): what
    /// `--knobs` takes back.
    pub fn list(&self) -> String {
        let mut copy = *self;
        let on: Vec<&str> = Self::NAMES
            .into_iter()
            .filter(|name| copy.flag(name).is_some_and(|f| *f))
            .collect();
        if on.is_empty() {
            "none".to_owned()
        } else {
            on.join(",")
        }
    }
}

/// The workload's operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Op {
    /// Create an RC, UC or UD QP on each HCA and connect them.
    CreatePair,
    /// Destroy a QP.
    DestroyQp,
    /// Move a connected pair to ERR, drain, RESET and connect it again.
    Reconnect,
    /// Post send WRs (SEND, RDMA WRITE, RDMA READ) from a DPC.
    PostSend,
    /// Post receive WRs from a DPC.
    PostRecv,
    /// Poll a CQ from a DPC.
    Poll,
    /// Post on one QP and poll a CQ in two DPCs queued together.
    PostAndPoll,
    /// Arm a CQ for its next completion.
    Arm,
    /// Move a QP to ERR (`ModifyQp`).
    ForceErr,
    /// Resize a CQ.
    ResizeCq,
    /// Create a CQ.
    CreateCq,
    /// Destroy an unused CQ.
    DestroyCq,
    /// Re-register a region (new keys).
    ReregMr,
    /// Let virtual time pass.
    Run,
    /// Fault: take a port's link down for a while.
    LinkFlap,
    /// Fault: switch the fabric's loss, duplication, reordering and
    /// corruption on or off.
    FabricToggle,
    /// Fault: a catastrophic error on one HCA.
    Catastrophic,
    /// Fault: sleep (S3) and resume.
    SleepResume,
    /// Fault: hold one HCA's command completions back while a control
    /// verb is outstanding.
    HoldCommands,
    /// An extra AL client: open one, build or destroy one of its objects,
    /// or close it with whatever it owns (knob `al-clients`).
    AlClient,
    /// Add or remove an entry of the child list (knob `child-churn`).
    ChildChurn,
    /// A user process: open an HCA through the proxy, create objects, or
    /// die (knob `user-opens`).
    UserOpen,
    /// Use a handle across opens (knob `forged-handles`).
    ForgeHandle,
}

impl Op {
    pub(crate) const ALL: [Op; 19] = [
        Op::CreatePair,
        Op::DestroyQp,
        Op::Reconnect,
        Op::PostSend,
        Op::PostRecv,
        Op::Poll,
        Op::PostAndPoll,
        Op::Arm,
        Op::ForceErr,
        Op::ResizeCq,
        Op::CreateCq,
        Op::DestroyCq,
        Op::ReregMr,
        Op::Run,
        Op::LinkFlap,
        Op::FabricToggle,
        Op::Catastrophic,
        Op::SleepResume,
        Op::HoldCommands,
    ];

    /// The operations of issue 11 (AL clients, children, user opens,
    /// forged handles), drawn apart ([`Mix::draw_issue_11`]).
    pub(crate) const ISSUE_11: [Op; 4] =
        [Op::AlClient, Op::ChildChurn, Op::UserOpen, Op::ForgeHandle];

    /// Operations every mix keeps, with at least this weight: without
    /// them nothing moves.
    fn floor(self) -> u64 {
        match self {
            Op::CreatePair | Op::PostSend | Op::PostRecv | Op::Poll | Op::Run => 2,
            _ => 0,
        }
    }

    /// The most a mix gives an operation (faults are rarer).
    fn ceiling(self) -> u64 {
        match self {
            Op::Catastrophic => 1,
            Op::SleepResume | Op::LinkFlap | Op::FabricToggle | Op::HoldCommands => 3,
            Op::PostSend | Op::PostRecv | Op::Poll | Op::PostAndPoll => 20,
            _ => 6,
        }
    }
}

/// One seed's mix.
#[derive(Debug, Clone)]
pub(crate) struct Mix {
    pub(crate) weights: Vec<(Op, u64)>,
    /// Fabric faults while "on" (the mix may leave them all zero).
    pub(crate) faults: FaultConfig,
    /// Whether the fabric starts faulty.
    pub(crate) faults_at_start: bool,
    /// Transport types the mix creates: RC, UC, UD.
    pub(crate) transports: [bool; 3],
}

impl Mix {
    /// Draws the mix of one seed.
    pub(crate) fn draw(rng: &mut Rng) -> Self {
        let weights: Vec<(Op, u64)> = Op::ALL
            .into_iter()
            .map(|op| {
                // A quarter of the optional operations are off for this
                // seed; the rest get a weight up to their ceiling.
                let on = op.floor() > 0 || rng.below(4) != 0;
                let weight = if on {
                    (1 + rng.below(op.ceiling())).max(op.floor())
                } else {
                    0
                };
                (op, weight)
            })
            .collect();
        let mut ppm = |max: u64| {
            if rng.below(2) == 0 {
                0
            } else {
                rng.below(max + 1) as u32
            }
        };
        let faults = FaultConfig {
            drop_ppm: ppm(50_000),
            duplicate_ppm: ppm(30_000),
            reorder_ppm: ppm(30_000),
            reorder_window_ns: 20_000,
            corrupt_ppm: ppm(20_000),
        };
        let faults_at_start = rng.below(2) == 0;
        let mut transports = [rng.below(4) != 0, rng.below(3) != 0, rng.below(3) != 0];
        if !transports.contains(&true) {
            transports[0] = true;
        }
        Self {
            weights,
            faults,
            faults_at_start,
            transports,
        }
    }

    /// Drops what the threaded host cannot do (docs/swarm.md "Threaded"):
    /// its HCAs sit back to back on a lossless fabric with no fault
    /// injection or link control, and its time is real, so the faults
    /// that need the fabric or a deterministic order of device and host
    /// (link flaps, fabric faults, a catastrophic error, sleep and resume,
    /// held command completions) are off, and so are the issue-11 actors,
    /// whose checks need a quiet machine (rings measured at a create). The seed still draws them, so
    /// the rest of the mix is the deterministic run's.
    pub(crate) fn restrict_to_threaded(&mut self) {
        for (op, weight) in &mut self.weights {
            if matches!(
                op,
                Op::LinkFlap
                    | Op::FabricToggle
                    | Op::Catastrophic
                    | Op::SleepResume
                    | Op::HoldCommands
                    | Op::AlClient
                    | Op::ChildChurn
                    | Op::UserOpen
                    | Op::ForgeHandle
            ) {
                *weight = 0;
            }
        }
        self.faults = FaultConfig::default();
        self.faults_at_start = false;
    }

    /// Draws the weights of the issue-11 operations from their own
    /// generator (`rng`, seeded apart from the workload's), so that with
    /// their knobs off a seed runs exactly the workload it ran before
    /// them. A quarter of them are off for a seed.
    pub(crate) fn draw_issue_11(&mut self, rng: &mut Rng) {
        for op in Op::ISSUE_11 {
            let weight = if rng.below(4) != 0 {
                1 + rng.below(op.ceiling())
            } else {
                0
            };
            self.weights.push((op, weight));
        }
    }

    /// Switches off the operations whose knob is off.
    pub(crate) fn apply_knobs(&mut self, knobs: Knobs) {
        for (op, weight) in &mut self.weights {
            let on = match op {
                Op::AlClient => knobs.al_clients,
                Op::ChildChurn => knobs.child_churn,
                Op::UserOpen => knobs.user_opens,
                Op::ForgeHandle => knobs.forged_handles,
                _ => true,
            };
            if !on {
                *weight = 0;
            }
        }
    }

    /// Picks the next operation by weight.
    pub(crate) fn pick(&self, rng: &mut Rng) -> Op {
        let total: u64 = self.weights.iter().map(|(_, w)| w).sum();
        let mut draw = rng.below(total);
        for (op, weight) in &self.weights {
            if draw < *weight {
                return *op;
            }
            draw -= weight;
        }
        Op::Run
    }

    /// One line describing the mix.
    pub(crate) fn describe(&self) -> String {
        let ops: Vec<String> = self
            .weights
            .iter()
            .filter(|(_, w)| *w > 0)
            .map(|(op, w)| format!("{op:?}:{w}"))
            .collect();
        let types: Vec<&str> = ["RC", "UC", "UD"]
            .into_iter()
            .zip(self.transports)
            .filter(|(_, on)| *on)
            .map(|(t, _)| t)
            .collect();
        format!(
            "ops [{}]; transports {}; fabric faults {} (drop {} dup {} reorder {} corrupt {} ppm)",
            ops.join(" "),
            types.join("+"),
            if self.faults_at_start {
                "on at start"
            } else {
                "off at start"
            },
            self.faults.drop_ppm,
            self.faults.duplicate_ppm,
            self.faults.reorder_ppm,
            self.faults.corrupt_ppm
        )
    }
}
