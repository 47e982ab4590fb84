//! Event queues (PRM 6.3, 8; guide 5.4 and 9): sizing, the ISR's half and
//! the DPC's half of event processing, and the [`EventSink`] the higher
//! layers implement.
//!
//! Contract:
//! - **Sizing** ([`size_event_queue`], guide 5.4.1): the EQ must hold every
//!   event that can be outstanding, `MAX_QP*4 + MAX_CQ*2 + ports*5`, plus
//!   one command completion per command slot for the EQ that takes them
//!   (PRM 6.3), rounded up to a power of two. If that exceeds the device's
//!   `log_max_eqes` the ring is capped at the device maximum and
//!   [`EqSizing::capped`] says so: the decision is part of the bring-up
//!   report, never silent. A capped EQ can overflow under a storm of
//!   events, which the device treats as a catastrophic error (PRM 6.3,
//!   `STATUS.FATAL` with syndrome `EQ_OVERFLOW`); its `CATASTROPHIC` event
//!   cannot reach the full EQ, so the core learns of it from the command
//!   watchdog.
//! - **ISR** ([`EventQueue::note_interrupt`]): runs at DIRQL, only counts
//!   the interrupt and answers whether the DPC must run (the vector is the
//!   live EQ's). It touches no ring and calls no client (guide 9, NOTE: no
//!   callbacks from interrupt context).
//! - **DPC** ([`EventQueue::drain`]): at DISPATCH_LEVEL, takes every valid
//!   EQE (owner bit per PRM 8.1) in batches, frees ring space after each
//!   batch (doorbell without `ARM`), hands each decoded event to the
//!   caller outside the lock, and finally writes the consumer counter with
//!   `ARM`. The device raises the vector again at once if EQEs arrived
//!   after the consumer counter written (PRM 8.3), so no wake-up is lost.
//! - An EQE that is valid by its owner bit but does not decode (unknown
//!   type, bad port, bad subtype) is counted and skipped, never a panic.
//! - At most one drain runs at a time, so events (and command
//!   completions) are delivered in ring order even when the platform runs
//!   the DPC on two processors at once. The hand-off (`DrainHandoff`, one
//!   atomic count of requests) loses no request by construction: a DPC
//!   that finds a drain running leaves its request in the count, and the
//!   drainer cannot stop while a request it has not answered is there
//!   (model-checked by the `loom_` tests, `cargo xtask loom`).
//! - Interrupts are one-shot (PRM 8.3): the EQ is re-armed at the end of
//!   every drain, and nowhere else once running.

use crate::sync::{AtomicU64, AtomicUsize, Ordering};
use alloc::vec::Vec;

use driver_platform::dma::dma_wmb;
use driver_platform::{CommonBuffer, DmaAdapter, Mmio, Platform, SpinLock};
use hca_prm::cmd::Opcode;
use hca_prm::ctx::{BufDesc, EQE_LOG_STRIDE, Eqc};
use hca_prm::doorbell::{EqDoorbell, eq_doorbell_offset};
use hca_prm::eqe::{Eqe, Event};
use hca_prm::{Le16, Le32, owner};
use ib_types::scalars::{PortNum, Qpn};
use zerocopy::FromBytes;

use crate::ring::read_owned_entry;

/// Bytes of one EQE.
pub const EQE_BYTES: usize = 32;

/// EQEs taken per lock hold in the DPC; bounds the time the lock is held
/// and the stack used for the batch.
const DRAIN_BATCH: usize = 16;

/// The largest EQ the core creates, whatever the device reports: the
/// ring's counters are 32-bit (PRM conventions), so a ring of 2^31 entries
/// is the largest whose phase bit still flips within the counter space.
pub const MAX_LOG_EQ_ENTRIES: u8 = 31;

/// The outcome of the guide's 5.4.1 sizing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EqSizing {
    /// Events that can be outstanding: `qps*4 + cqs*2 + ports*5 +
    /// command_slots` (saturating).
    pub wanted_events: u64,
    /// `log2` of the ring entries chosen.
    pub log_entries: u8,
    /// True when the wanted size exceeded the device's `log_max_eqes` (or
    /// [`MAX_LOG_EQ_ENTRIES`]) and the ring was capped at it: the EQ can
    /// then overflow under load, which the device reports as a
    /// catastrophic error.
    pub capped: bool,
}

impl EqSizing {
    /// Ring entries.
    pub fn entries(&self) -> u64 {
        1u64.checked_shl(u32::from(self.log_entries))
            .unwrap_or(u64::MAX)
    }
}

/// `ceil(log2(n))`, with 0 for `n <= 1`.
fn ceil_log2(n: u64) -> u8 {
    if n <= 1 {
        0
    } else {
        (u64::BITS - (n - 1).leading_zeros()) as u8
    }
}

/// Sizes the EQ by the guide's 5.4.1 formula, `MAX_QP*4 + MAX_CQ*2 +
/// ports*5`, plus `command_slots` for command completions, rounded up to a
/// power of two and capped at `2^min(log_max_eqes, MAX_LOG_EQ_ENTRIES)`
/// (see [`EqSizing::capped`]).
pub fn size_event_queue(
    max_qps: u64,
    max_cqs: u64,
    ports: u64,
    command_slots: u64,
    log_max_eqes: u8,
) -> EqSizing {
    let wanted_events = max_qps
        .saturating_mul(4)
        .saturating_add(max_cqs.saturating_mul(2))
        .saturating_add(ports.saturating_mul(5))
        .saturating_add(command_slots);
    let wanted_log = ceil_log2(wanted_events);
    let limit = log_max_eqes.min(MAX_LOG_EQ_ENTRIES);
    EqSizing {
        wanted_events,
        log_entries: wanted_log.min(limit),
        capped: wanted_log > limit,
    }
}

/// Asynchronous events affiliated with a QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpEvent {
    /// Communication established (`COMM_EST`).
    CommunicationEstablished,
    /// The send queue drained in SQD (`SQ_DRAINED`).
    SendQueueDrained,
    /// Path migrated.
    PathMigrated,
    /// Local work queue catastrophic error (`QP_FATAL`).
    Fatal,
    /// Invalid request local work queue error.
    InvalidRequest,
    /// Local access violation work queue error.
    AccessError,
    /// Last WQE reached on a QP attached to an SRQ (`SRQ_LAST_WQE`).
    LastWqeReached,
}

/// Asynchronous events affiliated with an SRQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SrqEvent {
    /// The SRQ fell below its armed limit.
    LimitReached,
    /// SRQ catastrophic error.
    Catastrophic,
}

/// Port events other than state changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PortViolation {
    /// A P_Key violation was counted.
    Pkey,
    /// A Q_Key violation was counted.
    Qkey,
}

/// Why the device is considered failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DeviceFailure {
    /// The device posted `CATASTROPHIC` (PRM 2); `syndrome` is
    /// `STATUS.FATAL_SYNDROME` read when the event was processed.
    Catastrophic {
        /// The fatal syndrome byte (0 if `STATUS` did not show one).
        syndrome: u8,
    },
    /// A command did not complete within the command timeout.
    CommandTimeout {
        /// The command that timed out.
        opcode: Opcode,
    },
    /// The device was surprise-removed (`EvtDeviceSurpriseRemoval`):
    /// nothing of it answers any more.
    SurpriseRemoval,
    /// D0 entry could not bring the device up again or give the verb
    /// objects back (`Hca::d0_entry`).
    ResumeFailed,
}

impl DeviceFailure {
    /// Whether the shell reports this failure to the framework
    /// (`WdfDeviceSetFailed` with `WdfDeviceFailedAttemptRestart`): a
    /// driver must report an unrecoverable error, and only a restart (reset
    /// and bring-up) recovers from these; a surprise removal is already the
    /// framework's own doing.
    pub fn needs_restart(self) -> bool {
        !matches!(self, Self::SurpriseRemoval)
    }
}

/// Where the DPC delivers events other than command completions; the
/// verbs and CI layers implement it. Every method is called from the DPC
/// (or the timer routine for [`device_failed`](Self::device_failed)) at
/// DISPATCH_LEVEL, never from the ISR, with no lock of the core held; it
/// must not block.
pub trait EventSink: Send + Sync {
    /// A CQ has a completion to report (`COMPLETION`, guide 8.3).
    fn completion(&self, cqn: u32);
    /// A QP-affiliated asynchronous event.
    fn qp_event(&self, qpn: Qpn, event: QpEvent);
    /// An SRQ-affiliated asynchronous event.
    fn srq_event(&self, srqn: u32, event: SrqEvent);
    /// A CQ overflowed (`CQ_ERROR`).
    fn cq_error(&self, cqn: u32);
    /// A port became active (`active`) or went down.
    fn port_change(&self, port: PortNum, active: bool);
    /// A P_Key or Q_Key violation was counted on a port.
    fn port_violation(&self, port: PortNum, violation: PortViolation);
    /// The device failed: no command will complete any more; only a reset
    /// (a restart of the device) recovers. Called once per failure.
    fn device_failed(&self, failure: DeviceFailure);
}

/// Hands one decoded event (other than a command completion) to `sink`.
/// Returns the event back if it is a command completion or catastrophic,
/// which the caller handles itself.
pub fn dispatch_to_sink(sink: &dyn EventSink, event: Event) -> Option<Event> {
    match event {
        Event::Completion { cqn } => sink.completion(cqn),
        Event::CommEst { qpn } => sink.qp_event(qpn, QpEvent::CommunicationEstablished),
        Event::SqDrained { qpn } => sink.qp_event(qpn, QpEvent::SendQueueDrained),
        Event::PathMigrated { qpn } => sink.qp_event(qpn, QpEvent::PathMigrated),
        Event::QpFatal { qpn } => sink.qp_event(qpn, QpEvent::Fatal),
        Event::WqInvalidRequest { qpn } => sink.qp_event(qpn, QpEvent::InvalidRequest),
        Event::WqAccessError { qpn } => sink.qp_event(qpn, QpEvent::AccessError),
        Event::SrqLastWqe { qpn } => sink.qp_event(qpn, QpEvent::LastWqeReached),
        Event::SrqLimit { srqn } => sink.srq_event(srqn, SrqEvent::LimitReached),
        Event::SrqCatastrophic { srqn } => sink.srq_event(srqn, SrqEvent::Catastrophic),
        Event::CqError { cqn } => sink.cq_error(cqn),
        Event::PortChange { port, active } => sink.port_change(port, active),
        Event::PkeyViolation { port } => sink.port_violation(port, PortViolation::Pkey),
        Event::QkeyViolation { port } => sink.port_violation(port, PortViolation::Qkey),
        Event::CmdCompletion { .. } | Event::Catastrophic => return Some(event),
    }
    None
}

/// Counters of event processing, for diagnostics and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EqCounters {
    /// Interrupts the ISR claimed.
    pub interrupts: u64,
    /// EQEs consumed (decoded or not).
    pub eqes: u64,
    /// EQEs valid by their owner bit that did not decode: skipped.
    pub garbage_eqes: u64,
    /// Times the DPC drained the ring.
    pub drains: u64,
}

/// The hand-off between callers that want the EQ drained (DPCs, which
/// Windows may run on two processors at once): at most one drains at a
/// time, and no request is lost, by construction.
///
/// One word counts the requests not yet answered. The caller that moves
/// it from 0 becomes the drainer; any other caller only adds its request
/// and leaves. The drainer may stop only by moving the count from the value
/// it last saw back to 0; if a request came meanwhile that exchange fails,
/// and it drains again, so every request is followed by a drain that
/// started after it. (The count would have to wrap through 2^64 requests
/// during one drain pass to break this.)
#[derive(Debug)]
pub(crate) struct DrainHandoff {
    requests: AtomicUsize,
}

impl DrainHandoff {
    /// No request.
    pub(crate) fn new() -> Self {
        Self {
            requests: AtomicUsize::new(0),
        }
    }

    /// Requests a drain: if no drain is running, runs `drain` until no
    /// request is left unanswered and returns true; otherwise leaves the
    /// request to the running drainer and returns false at once.
    pub(crate) fn run(&self, mut drain: impl FnMut()) -> bool {
        // Release: what this caller saw (the interrupt, so the EQE behind
        // it) is visible to the drainer that acquires the count.
        if self.requests.fetch_add(1, Ordering::AcqRel) != 0 {
            return false;
        }
        let mut seen = 1;
        loop {
            drain();
            match self
                .requests
                .compare_exchange(seen, 0, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return true,
                Err(now) => seen = now,
            }
        }
    }
}

/// One EQ's ring and software state.
#[derive(Debug)]
pub struct EqRing<B> {
    /// The ring's common buffer (zero-filled at allocation, PRM 8.1).
    pub buffer: B,
    /// The EQ number (its slot in the EQC table and its doorbell).
    pub eqn: u32,
    /// The MSI-X vector it raises.
    pub vector: u16,
    /// `log2` of its entries.
    pub log_entries: u8,
    /// The consumer counter: EQEs taken so far.
    pub consumer: u32,
}

impl<B: CommonBuffer> EqRing<B> {
    /// The EQ context for `SW2HW_EQ`: the ring described by MTT entries
    /// from `mtt_index`, one per `2^log_page_size` page.
    pub fn context(&self, mtt_index: u32, log_page_size: u8) -> Eqc {
        Eqc {
            vector: Le16::new(self.vector),
            ring: BufDesc {
                mtt_index: Le32::new(mtt_index),
                page_offset: Le32::new(0),
                log_page_size,
                log_entries: self.log_entries,
                log_stride: EQE_LOG_STRIDE,
                ..BufDesc::default()
            },
            ..Eqc::default()
        }
    }

    /// The bus address of each page of the ring, for `WRITE_MTT`: a common
    /// buffer is contiguous in bus space, so page `i` is at base + i pages.
    pub fn page_addresses(&self, page_size: usize) -> Vec<u64> {
        // A ring too large to express has no pages to describe (bring-up
        // never builds one: see `MAX_LOG_EQ_ENTRIES`).
        let Some(bytes) = (EQE_BYTES as u64).checked_shl(u32::from(self.log_entries)) else {
            return Vec::new();
        };
        let page = (page_size as u64).max(1);
        let pages = bytes.div_ceil(page);
        (0..pages)
            .map(|i| self.buffer.bus_address() + i * page)
            .collect()
    }
}

/// The event queue of one device: the ring (once created) and the state
/// the ISR and the DPC share.
pub struct EventQueue<P: Platform> {
    ring: SpinLock<P, Option<EqRing<<P::Dma as DmaAdapter>::Buffer>>>,
    /// The vector of the live EQ, `u64::MAX` when there is none; read by
    /// the ISR without a lock.
    live_vector: AtomicU64,
    /// Who drains, and whether again (see [`EventQueue::drain`]).
    handoff: DrainHandoff,
    interrupts: AtomicU64,
    eqes: AtomicU64,
    garbage_eqes: AtomicU64,
    drains: AtomicU64,
}

impl<P: Platform> core::fmt::Debug for EventQueue<P> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("EventQueue")
            .field("counters", &self.counters())
            .finish_non_exhaustive()
    }
}

impl<P: Platform> Default for EventQueue<P> {
    fn default() -> Self {
        Self::new()
    }
}

impl<P: Platform> EventQueue<P> {
    /// No EQ yet.
    pub fn new() -> Self {
        Self {
            ring: SpinLock::<P, _>::new(None),
            live_vector: AtomicU64::new(u64::MAX),
            handoff: DrainHandoff::new(),
            interrupts: AtomicU64::new(0),
            eqes: AtomicU64::new(0),
            garbage_eqes: AtomicU64::new(0),
            drains: AtomicU64::new(0),
        }
    }

    /// Takes a ring the device now owns (after `SW2HW_EQ`); the ISR starts
    /// claiming its vector.
    pub fn attach(&self, ring: EqRing<<P::Dma as DmaAdapter>::Buffer>) {
        self.live_vector
            .store(u64::from(ring.vector), Ordering::Release);
        *self.ring.lock() = Some(ring);
    }

    /// Gives the ring back (after `HW2SW_EQ`, or after a reset); the ISR
    /// stops claiming interrupts.
    pub fn detach(&self) -> Option<EqRing<<P::Dma as DmaAdapter>::Buffer>> {
        self.live_vector.store(u64::MAX, Ordering::Release);
        self.ring.lock().take()
    }

    /// The ISR's half, at DIRQL: counts the interrupt and returns whether
    /// the DPC must run (the vector is the live EQ's). Touches no ring,
    /// takes no lock. With one EQ the DPC needs no more than that; with an
    /// EQ per vector this is where the fired vectors would be recorded.
    pub fn note_interrupt(&self, vector: u16) -> bool {
        if self.live_vector.load(Ordering::Acquire) != u64::from(vector) {
            return false;
        }
        self.interrupts.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Arms the EQ with its current consumer counter (PRM 8.3).
    pub fn arm(&self, bar0: &P::Mmio) {
        let ring = self.ring.lock();
        if let Some(ring) = ring.as_ref() {
            Self::write_doorbell(bar0, ring, true);
        }
    }

    fn write_doorbell(bar0: &P::Mmio, ring: &EqRing<<P::Dma as DmaAdapter>::Buffer>, arm: bool) {
        if let Some(offset) = eq_doorbell_offset(ring.eqn) {
            let doorbell = EqDoorbell {
                consumer: ring.consumer,
                arm,
            };
            // The EQEs were read before the device may reuse their slots.
            dma_wmb();
            bar0.write32(offset, doorbell.encode());
        }
    }

    /// The DPC's half, at DISPATCH_LEVEL: takes every valid EQE, calls
    /// `handle` for each decoded event with no lock held, and re-arms.
    /// Returns the number of events handed to `handle`.
    ///
    /// Events are handed out one drain at a time, in ring order: Windows
    /// may run a DPC on a second processor while it still runs on the
    /// first (it can be queued again once it started), so a second caller
    /// finding a drain in progress leaves its request to that one, which
    /// drains again before it stops (`DrainHandoff`).
    pub fn drain(&self, bar0: &P::Mmio, mut handle: impl FnMut(Event)) -> usize {
        let mut handled = 0;
        self.handoff
            .run(|| handled += self.drain_once(bar0, &mut handle));
        handled
    }

    /// One pass: takes valid EQEs in batches until none is left, then arms.
    fn drain_once(&self, bar0: &P::Mmio, handle: &mut impl FnMut(Event)) -> usize {
        self.drains.fetch_add(1, Ordering::Relaxed);
        let mut handled = 0;
        loop {
            let mut batch = [None::<Event>; DRAIN_BATCH];
            let mut taken = 0;
            {
                let mut guard = self.ring.lock();
                let Some(ring) = guard.as_mut() else {
                    return handled;
                };
                while taken < DRAIN_BATCH {
                    let Some(eqe) = Self::read_valid(ring) else {
                        break;
                    };
                    ring.consumer = ring.consumer.wrapping_add(1);
                    self.eqes.fetch_add(1, Ordering::Relaxed);
                    match eqe.decode() {
                        Ok(event) => batch[taken] = Some(event),
                        Err(_) => {
                            self.garbage_eqes.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    taken += 1;
                }
                // Nothing more: arm, which fires at once if the device
                // wrote past the consumer we report (no lost wake-up).
                // Otherwise just free the ring space taken so far.
                Self::write_doorbell(bar0, ring, taken < DRAIN_BATCH);
            }
            for event in batch.into_iter().flatten() {
                handled += 1;
                handle(event);
            }
            if taken < DRAIN_BATCH {
                return handled;
            }
        }
    }

    /// The EQE at the consumer counter, if the device has written it.
    fn read_valid(ring: &EqRing<<P::Dma as DmaAdapter>::Buffer>) -> Option<Eqe> {
        let slot = owner::slot(ring.consumer, ring.log_entries) as usize;
        let mut raw = [0u8; EQE_BYTES];
        let owner_at = core::mem::offset_of!(Eqe, owner);
        if !read_owned_entry(&ring.buffer, slot * EQE_BYTES, owner_at, &mut raw, |b| {
            owner::is_valid(b, ring.consumer, ring.log_entries)
        }) {
            return None;
        }
        let eqe = Eqe::read_from_bytes(&raw).ok()?;
        eqe.is_valid(ring.consumer, ring.log_entries).then_some(eqe)
    }

    /// Where the consumer stands, while an EQ is attached.
    pub fn position(&self) -> Option<crate::hca::EqPosition> {
        let ring = self.ring.lock();
        ring.as_ref().map(|ring| crate::hca::EqPosition {
            ring_bus_address: ring.buffer.bus_address(),
            log_entries: ring.log_entries,
            consumer: ring.consumer,
        })
    }

    /// The counters.
    pub fn counters(&self) -> EqCounters {
        EqCounters {
            interrupts: self.interrupts.load(Ordering::Relaxed),
            eqes: self.eqes.load(Ordering::Relaxed),
            garbage_eqes: self.garbage_eqes.load(Ordering::Relaxed),
            drains: self.drains.load(Ordering::Relaxed),
        }
    }
}

/// loom models of the drain hand-off (`cargo xtask loom`): DPCs that
/// overlap (as Windows runs a DPC queued again while it still runs) and a
/// device that publishes EQEs and fires one-shot when armed (PRM 8.3).
#[cfg(all(test, loom))]
mod loom_drain_handoff {
    use super::DrainHandoff;
    use crate::sync::{AtomicBool, Ordering};
    use alloc::vec::Vec;
    use loom::sync::{Arc, Mutex};

    /// The device's side of one EQ and the platform's DPC queue, as the
    /// simulated device keeps them (under its lock).
    #[derive(Debug)]
    struct Device {
        /// EQEs written.
        producer: u32,
        /// The consumer counter the driver last wrote.
        consumer: u32,
        /// One-shot: the next EQE fires the vector.
        armed: bool,
        /// The DPC is queued and not started (queueing coalesces).
        dpc_queued: bool,
    }

    impl Device {
        fn fire(&mut self) {
            self.armed = false;
            self.dpc_queued = true;
        }
    }

    struct Model {
        device: Mutex<Device>,
        /// The driver's consumer counter (the ring lock).
        ring: Mutex<u32>,
        /// Events handed out, in the order the driver handled them.
        handled: Mutex<Vec<u32>>,
        handoff: DrainHandoff,
        /// A drain pass is running: two at once break ring order.
        in_drain: AtomicBool,
    }

    impl Model {
        fn new() -> Self {
            Self {
                device: Mutex::new(Device {
                    producer: 0,
                    consumer: 0,
                    armed: true,
                    dpc_queued: false,
                }),
                ring: Mutex::new(0),
                handled: Mutex::new(Vec::new()),
                handoff: DrainHandoff::new(),
                in_drain: AtomicBool::new(false),
            }
        }

        /// The device writes EQE number `producer` and fires if armed.
        fn publish(&self) {
            let mut device = self.device.lock().unwrap();
            device.producer += 1;
            if device.armed {
                device.fire();
            }
        }

        /// One drain pass, shaped like `EventQueue::drain_once`: take the
        /// valid EQEs under the ring lock, write the consumer with ARM
        /// (which fires at once if EQEs arrived past it), then hand the
        /// events out with no lock held.
        fn drain_once(&self) {
            assert!(
                !self.in_drain.swap(true, Ordering::AcqRel),
                "two drains at once"
            );
            let taken = {
                let mut consumer = self.ring.lock().unwrap();
                let producer = self.device.lock().unwrap().producer;
                let first = *consumer;
                *consumer = producer;
                let mut device = self.device.lock().unwrap();
                device.consumer = producer;
                if device.producer != device.consumer {
                    device.fire();
                } else {
                    device.armed = true;
                }
                first..producer
            };
            self.handled.lock().unwrap().extend(taken);
            self.in_drain.store(false, Ordering::Release);
        }

        /// A DPC invocation: runs only if the DPC was queued (a fire), and
        /// dequeues it before running, so a fire meanwhile queues it again.
        fn dpc(&self) {
            let queued = {
                let mut device = self.device.lock().unwrap();
                core::mem::replace(&mut device.dpc_queued, false)
            };
            if queued {
                self.handoff.run(|| self.drain_once());
            }
        }

        /// After every thread finished: no EQE may be left behind an EQ
        /// that will never fire again. Then the DPCs still queued run, and
        /// every event must have been handled once, in ring order.
        fn check(&self, events: u32) {
            {
                let device = self.device.lock().unwrap();
                let consumer = *self.ring.lock().unwrap();
                let stranded = consumer != device.producer;
                assert!(
                    !stranded || device.armed || device.dpc_queued,
                    "lost wake-up: EQEs {consumer}..{} unconsumed, EQ unarmed, no DPC queued",
                    device.producer
                );
            }
            while self.device.lock().unwrap().dpc_queued {
                self.dpc();
            }
            let handled = self.handled.lock().unwrap().clone();
            assert_eq!(handled, (0..events).collect::<Vec<_>>());
        }
    }

    fn overlapping_dpcs(dpcs: usize, events: u32, preemption_bound: usize) {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(preemption_bound);
        builder.check(move || {
            let model = Arc::new(Model::new());
            let device = {
                let model = model.clone();
                loom::thread::spawn(move || {
                    for _ in 0..events {
                        model.publish();
                    }
                })
            };
            let dpcs: Vec<_> = (0..dpcs)
                .map(|_| {
                    let model = model.clone();
                    loom::thread::spawn(move || model.dpc())
                })
                .collect();
            device.join().unwrap();
            for dpc in dpcs {
                dpc.join().unwrap();
            }
            model.check(events);
        });
    }

    #[test]
    fn loom_two_overlapping_dpcs_lose_no_wakeup() {
        overlapping_dpcs(2, 3, 3);
    }

    #[test]
    fn loom_three_overlapping_dpcs_lose_no_wakeup() {
        overlapping_dpcs(3, 2, 2);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::DrainHandoff;
    use core::cell::Cell;

    #[test]
    fn a_request_during_a_drain_is_answered_by_another_drain_not_a_second_drainer() {
        let handoff = DrainHandoff::new();
        let passes = Cell::new(0);
        let nested_drained = Cell::new(None);
        let drained = handoff.run(|| {
            passes.set(passes.get() + 1);
            if passes.get() == 1 {
                // Another DPC arrives while this one drains: it must not
                // drain itself, and its request must not be dropped.
                nested_drained.set(Some(handoff.run(|| panic!("second drainer"))));
            }
        });
        assert!(drained);
        assert_eq!(nested_drained.get(), Some(false));
        assert_eq!(passes.get(), 2, "the request made during pass 1 got pass 2");
        // Quiet again: the next caller drains once.
        passes.set(0);
        assert!(handoff.run(|| passes.set(passes.get() + 1)));
        assert_eq!(passes.get(), 1);
    }
}
