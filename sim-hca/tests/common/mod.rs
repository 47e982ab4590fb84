//! Shared setup for the device tests: two simulated HCAs, each brought up
//! by the test driver, wired back to back by a zero-latency pump (the
//! cluster stepper adds latency, loss and capture on top of this).

#![allow(
    dead_code,
    unreachable_pub,
    reason = "a module shared by test binaries, each using a subset"
)]

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use hca_prm::cqe::Cqe;
use hca_prm::ctx::QpcFlags;
use hca_prm::eqe::Event;
use ib_types::access::AccessFlags;
use ib_types::qp::{QpState, QpType};
use ib_types::scalars::Mtu;
use sim_hca::device::{Device, DeviceConfig};
use sim_hca::host::{InterruptSink, SimMemory};
pub use sim_hca::testkit::bring_up;
use sim_hca::testkit::{Cq, Driver, Mr, Qp};

/// Records raised vectors.
#[derive(Debug, Default)]
pub struct IrqLog(pub Mutex<Vec<u16>>);

impl InterruptSink for IrqLog {
    fn raise(&self, vector: u16) {
        self.0.lock().unwrap().push(vector);
    }
}

/// One node: a device, its memory, its driver and its interrupts.
pub struct Node {
    pub dev: Device,
    pub drv: Driver,
    pub irq: Arc<IrqLog>,
}

impl Node {
    pub fn new(guid: u64, ip: [u8; 4], bus_base: u64) -> Self {
        Self::with_config(DeviceConfig::with_ports(guid, &[ip]), bus_base)
    }

    /// A node built from `cfg`, its port 1 link up, brought up.
    pub fn with_config(cfg: DeviceConfig, bus_base: u64) -> Self {
        let mem = Arc::new(SimMemory::new(bus_base));
        let irq = Arc::new(IrqLog::default());
        let mut dev = Device::new(cfg, mem.clone(), irq.clone());
        dev.set_link(1, true);
        let drv = Driver::bring_up(&mut dev, mem);
        Self { dev, drv, irq }
    }

    /// Polls the EQ and takes every event read so far, oldest first.
    pub fn events(&mut self) -> Vec<Event> {
        self.drv.poll_eq(&mut self.dev);
        self.drv.events.drain(..).collect()
    }

    /// The QP's state as `QUERY_QP` reports it.
    pub fn qp_state(&mut self, qpn: u32) -> QpState {
        let qpc = self.drv.query_qp(&mut self.dev, qpn).expect("QUERY_QP");
        QpState::from_code(qpc.state).expect("a valid state")
    }
}

/// Decides per frame (direction, bytes) whether it is delivered.
pub type FrameFilter = Box<dyn FnMut(bool, &[u8]) -> bool>;

/// Two nodes back to back, with a virtual clock.
pub struct Pair {
    pub a: Node,
    pub b: Node,
    pub now: u64,
    /// Frames in flight, for tests that tamper with them: (to_b, frame).
    pub wire: VecDeque<(bool, Vec<u8>)>,
    /// When set, decides per frame whether it is delivered.
    pub filter: Option<FrameFilter>,
}

pub const IP_A: [u8; 4] = [10, 0, 0, 1];
pub const IP_B: [u8; 4] = [10, 0, 0, 2];

impl Pair {
    pub fn new() -> Self {
        Self::of(
            Node::new(0x0200_00ff_fe00_0a00, IP_A, 0x10_0000_0000),
            Node::new(0x0200_00ff_fe00_0b00, IP_B, 0x20_0000_0000),
        )
    }

    /// Two given nodes (A at [`IP_A`], B at [`IP_B`]) back to back.
    pub fn of(a: Node, b: Node) -> Self {
        Self {
            a,
            b,
            now: 0,
            wire: VecDeque::new(),
            filter: None,
        }
    }

    /// Moves frames between the devices until none is left.
    pub fn pump(&mut self) {
        for _ in 0..100_000 {
            let wire = &mut self.wire;
            self.a
                .dev
                .drain_tx(|_, f| wire.push_back((true, f.to_vec())));
            self.b
                .dev
                .drain_tx(|_, f| wire.push_back((false, f.to_vec())));
            let Some((to_b, frame)) = self.wire.pop_front() else {
                return;
            };
            if let Some(filter) = self.filter.as_mut()
                && !filter(to_b, &frame)
            {
                continue;
            }
            let dst = if to_b {
                &mut self.b.dev
            } else {
                &mut self.a.dev
            };
            dst.set_time(self.now);
            dst.receive(1, &frame);
        }
        panic!("the pump never went quiet");
    }

    /// Advances time by `ns`, running timers and the pump.
    pub fn advance(&mut self, ns: u64) {
        let end = self.now + ns;
        loop {
            self.pump();
            let next = [self.a.dev.poll_timeout(), self.b.dev.poll_timeout()]
                .into_iter()
                .flatten()
                .min();
            match next {
                Some(t) if t <= end => {
                    self.now = self.now.max(t);
                    self.a.dev.handle_timeout(self.now);
                    self.b.dev.handle_timeout(self.now);
                }
                _ => break,
            }
        }
        self.now = end;
        self.a.dev.set_time(end);
        self.b.dev.set_time(end);
        self.pump();
    }
}

/// A connected or datagram endpoint: CQ, QP and a data region.
pub struct Endpoint {
    pub cq: Cq,
    pub qp: Qp,
    pub mr: Mr,
}

pub const PD: u32 = 7;

pub fn endpoint(node: &mut Node, qp_type: QpType, access: AccessFlags) -> Endpoint {
    endpoint_with(node, qp_type, 8, QpcFlags::empty(), access)
}

/// An endpoint whose CQ has `2^cq_log` entries and whose QP has `flags`.
pub fn endpoint_with(
    node: &mut Node,
    qp_type: QpType,
    cq_log: u8,
    flags: QpcFlags,
    access: AccessFlags,
) -> Endpoint {
    let cq = node.drv.create_cq(&mut node.dev, cq_log).unwrap();
    let rcq = &cq;
    let qp = node
        .drv
        .create_qp_with_flags(
            &mut node.dev,
            qp_type,
            // No port until RESET->INIT names one (PRM 6.1.2).
            0,
            PD,
            (rcq, rcq),
            None,
            (6, 6),
            flags,
        )
        .unwrap();
    let rights = AccessFlags::LOCAL_WRITE
        | AccessFlags::REMOTE_READ
        | AccessFlags::REMOTE_WRITE
        | AccessFlags::REMOTE_ATOMIC
        | AccessFlags::MW_BIND;
    let mr = node
        .drv
        .reg_mr(&mut node.dev, 64 * 1024, PD, rights)
        .unwrap();
    let _ = access;
    Endpoint { cq, qp, mr }
}

/// The RC requester's ACK timeout exponent and retry counts.
#[derive(Debug, Clone, Copy)]
pub struct Retries {
    pub timeout: u8,
    pub retry: u8,
    pub rnr_retry: u8,
}

impl Retries {
    /// A 67 ms ACK timeout, 7 retries, RNR retries forever.
    pub const PATIENT: Self = Self {
        timeout: 14,
        retry: 7,
        rnr_retry: 7,
    };
}

/// Connects two RC or UC QPs (both to RTS) with the given MTU.
pub fn connect(
    pair: &mut Pair,
    ea: &Endpoint,
    eb: &Endpoint,
    qp_type: QpType,
    mtu: Mtu,
    retries: Retries,
) {
    let access = AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC;
    for (node, me, peer_ip, peer_qpn, psn) in [
        (&mut pair.a, ea, IP_B, eb.qp.qpn, 100u32),
        (&mut pair.b, eb, IP_A, ea.qp.qpn, 5000u32),
    ] {
        let access = if qp_type == QpType::Uc {
            AccessFlags::REMOTE_WRITE
        } else {
            access
        };
        assert_eq!(
            node.drv.modify_qp(
                &mut node.dev,
                &me.qp,
                &bring_up::to_init(qp_type, access, 0)
            ),
            hca_prm::cmd::CmdStatus::Ok
        );
        let peer_psn = if psn == 100 { 5000 } else { 100 };
        assert_eq!(
            node.drv.modify_qp(
                &mut node.dev,
                &me.qp,
                &bring_up::to_rtr(qp_type, peer_ip, peer_qpn, peer_psn, mtu)
            ),
            hca_prm::cmd::CmdStatus::Ok
        );
        assert_eq!(
            node.drv.modify_qp(
                &mut node.dev,
                &me.qp,
                &bring_up::to_rts(
                    qp_type,
                    psn,
                    retries.timeout,
                    retries.retry,
                    retries.rnr_retry
                )
            ),
            hca_prm::cmd::CmdStatus::Ok
        );
    }
}

/// Status and opcode of CQEs, for assertions.
pub fn summary(cqes: &[Cqe]) -> Vec<(u8, u8, u16)> {
    cqes.iter()
        .map(|c| (c.opcode, c.status, c.wqe_index.get()))
        .collect()
}
