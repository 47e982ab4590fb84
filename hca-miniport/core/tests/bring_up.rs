//! Bring-up and events of the miniport core on the simulated host, driven
//! through the miniport's simulated-host shell (`sim_shells::hca_miniport`: the
//! `Hca` built in prepare-hardware from the PCI function's resources, the
//! ISR calling `Hca::isr` and queueing the DPC, then started), with BAR0
//! wrapped where a test needs a lying device; a pass-through `ibalbus`
//! filter sits above it as the INF says. Each test ends with the host shut down and the verifier clean.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use driver_platform::{Irql, Mmio, Platform};
use hca_miniport_core::cmd::{Command, CommandError, CommandOutput};
use hca_miniport_core::eq::{
    DeviceFailure, EventSink, MAX_LOG_EQ_ENTRIES, PortViolation, QpEvent, SrqEvent,
    size_event_queue,
};
use hca_miniport_core::hca::Hca;
use hca_miniport_core::init::{BringUpReport, HcaConfig, InitError, choose_table_sizes};
use hca_prm::cmd::{CmdStatus, Opcode, PortInfo, Table};
use hca_prm::regs::{CmdqConfig, FatalSyndrome, Status, offset};
use ib_types::scalars::{PortNum, Qpn};
use ib_types::status::{IbStatus, NtStatus};
use proptest::prelude::*;
use sim_hca::device::DeviceConfig;
use sim_hca::host::HostMemory;
use sim_host::dma::{HostDmaAdapter, HostLocker};
use sim_host::driver::{DeviceCallbacks, DeviceInit, DriverEntry};
use sim_host::host::{Host, HostConfig};
use sim_host::irql::{HostSpinLock, IrqlTracker};
use sim_host::pci::{Bar0, PciFunction};
use sim_host::platform::SimPlatform;
use sim_host::pnp::{DeviceServices, PnpState};
use sim_host::registry::RegistryView;
use sim_host::request::HostRequest;
use sim_host::sched::DeviceDeferred;
use sim_shells::hca_miniport::{MiniportDevice, MiniportDriver, MiniportOptions, ShellPlatform};
use zerocopy::FromBytes;

// Heap calls the drivers make above DISPATCH_LEVEL are violations
// (docs/host-model.md, "Heap above DISPATCH_LEVEL").
sim_host::install_driver_heap_check!();

const DRIVER: &str = sim_shells::hca_miniport::SERVICE;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// An event as the sink saw it, with the IRQL it was delivered at.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    Completion(u32),
    Qp(Qpn, QpEvent),
    Srq(u32, SrqEvent),
    CqError(u32),
    PortChange(PortNum, bool),
    PortViolation(PortNum, PortViolation),
    DeviceFailed(DeviceFailure),
}

/// The higher layers' stand-in: records every event and its IRQL.
#[derive(Default)]
struct RecordingSink {
    seen: Mutex<Vec<(Seen, Irql)>>,
}

impl RecordingSink {
    fn record(&self, event: Seen) {
        lock(&self.seen).push((event, sim_host::irql::current()));
    }

    fn events(&self) -> Vec<(Seen, Irql)> {
        lock(&self.seen).clone()
    }
}

impl EventSink for RecordingSink {
    fn completion(&self, cqn: u32) {
        self.record(Seen::Completion(cqn));
    }
    fn qp_event(&self, qpn: Qpn, event: QpEvent) {
        self.record(Seen::Qp(qpn, event));
    }
    fn srq_event(&self, srqn: u32, event: SrqEvent) {
        self.record(Seen::Srq(srqn, event));
    }
    fn cq_error(&self, cqn: u32) {
        self.record(Seen::CqError(cqn));
    }
    fn port_change(&self, port: PortNum, active: bool) {
        self.record(Seen::PortChange(port, active));
    }
    fn port_violation(&self, port: PortNum, violation: PortViolation) {
        self.record(Seen::PortViolation(port, violation));
    }
    fn device_failed(&self, failure: DeviceFailure) {
        self.record(Seen::DeviceFailed(failure));
    }
}

/// A platform the test driver can run the core on: the simulated host's
/// types, with BAR0 possibly wrapped.
trait TestPlatform: ShellPlatform + Sized {
    /// BAR0 as this platform presents it.
    fn bar0(function: &Arc<PciFunction>, overrides: &RegisterOverrides) -> Self::Mmio;
}

impl TestPlatform for SimPlatform {
    fn bar0(function: &Arc<PciFunction>, _overrides: &RegisterOverrides) -> Bar0 {
        function.bar0()
    }
}

/// Register values a [`LyingBar0`] reports instead of the device's, and
/// (with [`DROP_WRITES`] as the value) registers whose writes it drops.
type RegisterOverrides = Arc<Mutex<Vec<(u64, u32)>>>;

/// An override value meaning "writes to this register never arrive".
const DROP_WRITES: u32 = 0xDEAD_0000;

/// BAR0 of a device that is not what it seems: reads of the overridden
/// registers return the given values; everything else reaches the device.
#[derive(Debug, Clone)]
struct LyingBar0 {
    inner: Bar0,
    overrides: RegisterOverrides,
}

impl Mmio for LyingBar0 {
    fn len(&self) -> u64 {
        self.inner.len()
    }
    fn read32(&self, offset: u64) -> u32 {
        let lie = lock(&self.overrides)
            .iter()
            .find(|&&(at, lie)| at == offset && lie != DROP_WRITES)
            .map(|(_, value)| *value);
        lie.unwrap_or_else(|| self.inner.read32(offset))
    }
    fn write32(&self, offset: u64, value: u32) {
        let dropped = lock(&self.overrides)
            .iter()
            .any(|&(at, lie)| at == offset && lie == DROP_WRITES);
        if !dropped {
            self.inner.write32(offset, value);
        }
    }
    fn read64(&self, offset: u64) -> u64 {
        u64::from(self.read32(offset)) | u64::from(self.read32(offset + 4)) << 32
    }
    fn write64(&self, offset: u64, value: u64) {
        self.inner.write64(offset, value);
    }
}

/// The simulated host with a [`LyingBar0`].
#[derive(Debug, Clone, Copy, Default)]
struct LyingPlatform;

impl Platform for LyingPlatform {
    type RawSpinLock = HostSpinLock;
    type RawRwSpinLock = sim_host::rw_spin_lock::HostRwSpinLock;
    type Mmio = LyingBar0;
    type Dma = HostDmaAdapter;
    type Locker = HostLocker;
    type Deferred = DeviceDeferred;
    type Registry = RegistryView;
    type Request = HostRequest;
    type Irql = IrqlTracker;
    type Caller = sim_host::caller::HostCaller<LyingBar0>;
    type Event = sim_host::event::HostEvent;
}

impl TestPlatform for LyingPlatform {
    fn bar0(function: &Arc<PciFunction>, overrides: &RegisterOverrides) -> LyingBar0 {
        LyingBar0 {
            inner: function.bar0(),
            overrides: overrides.clone(),
        }
    }
}

struct PassThroughFilter;
impl DriverEntry for PassThroughFilter {
    fn add_device(
        &self,
        _init: &DeviceInit,
        _host: &DeviceServices,
    ) -> Result<Arc<dyn DeviceCallbacks>, NtStatus> {
        Ok(Arc::new(PassThrough))
    }
}
struct PassThrough;
impl DeviceCallbacks for PassThrough {
    fn power_managed_queue(&self) -> bool {
        false
    }
}

/// A booted machine with the core driving its one HCA, through the
/// miniport's simulated-host shell.
struct World<P: Platform = SimPlatform> {
    host: Host,
    driver: Arc<MiniportDriver<P>>,
    sink: Arc<RecordingSink>,
}

impl World<SimPlatform> {
    fn new(config: HostConfig, hca_config: HcaConfig) -> Self {
        Self::with_overrides(config, hca_config, Vec::new())
    }
}

impl<P: TestPlatform> World<P> {
    fn with_overrides(config: HostConfig, hca_config: HcaConfig, lies: Vec<(u64, u32)>) -> Self {
        let host = Host::new(config).unwrap();
        let overrides: RegisterOverrides = Arc::new(Mutex::new(lies));
        let sink = Arc::new(RecordingSink::default());
        let device_sink = sink.clone();
        let driver = MiniportDriver::<P>::register_with(
            &host,
            MiniportOptions {
                config: hca_config,
                sink: Arc::new(move || device_sink.clone() as Arc<dyn EventSink>),
                bar0: Arc::new(move |function: &Arc<PciFunction>| P::bar0(function, &overrides)),
            },
        );
        host.register_driver("ibalbus", Arc::new(PassThroughFilter));
        host.boot();
        World { host, driver, sink }
    }

    fn device(&self) -> Arc<MiniportDevice<P>> {
        self.driver.devices()[0].clone()
    }

    fn hca(&self) -> Arc<Hca<P>> {
        self.device().hca().expect("the HCA was created")
    }

    fn function(&self) -> Arc<PciFunction> {
        self.device().function().expect("started")
    }

    fn adapter(&self) -> HostDmaAdapter {
        self.device().adapter().expect("started")
    }

    fn started(&self) -> Option<Result<BringUpReport, InitError>> {
        self.device().started()
    }

    fn report(&self) -> BringUpReport {
        match self.started() {
            Some(Ok(report)) => report,
            other => panic!("bring-up did not succeed: {other:?}"),
        }
    }

    fn settle(&self) {
        self.host.scheduler().run_until_idle(100_000).unwrap();
    }

    /// Runs `f` as a DPC of the miniport (DISPATCH_LEVEL), like a verb
    /// issued from a client's DPC.
    fn in_dpc(&self, f: impl FnOnce() + Send + 'static) {
        self.host.scheduler_handle().queue_dpc(DRIVER, f);
    }

    fn hca_devnode_state(&self) -> Option<PnpState> {
        let bus = self.host.pnp().find("ACPI\\PNP0A08\\0").unwrap();
        let hca = self.host.pnp().children(bus)[0];
        self.host.pnp().state(hca)
    }

    fn finish(self) {
        self.host.shut_down();
        self.host.verifier().assert_clean();
    }
}

impl World<SimPlatform> {
    fn deterministic(seed: u64) -> Self {
        Self::deterministic_with(seed, HcaConfig::default())
    }

    fn deterministic_with(seed: u64, hca_config: HcaConfig) -> Self {
        Self::new(
            HostConfig::deterministic(seed, vec![two_port_hca()]),
            hca_config,
        )
    }
}

fn two_port_hca() -> DeviceConfig {
    DeviceConfig::with_ports(0x0002_C900_0000_1000, &[[10, 0, 0, 1], [10, 0, 1, 1]])
}

/// A command's outcome as its continuation saw it.
type Outcome = (usize, Result<CommandOutput, CommandError>, Irql);

fn recorder() -> Arc<Mutex<Vec<Outcome>>> {
    Arc::default()
}

/// A continuation that records `(index, result, IRQL)`.
fn record_into(
    log: &Arc<Mutex<Vec<Outcome>>>,
    index: usize,
) -> hca_miniport_core::cmd::Continuation {
    let log = log.clone();
    Box::new(move |result| lock(&log).push((index, result, sim_host::irql::current())))
}

#[test]
fn bring_up_succeeds_and_port_changes_reach_the_sink_from_the_dpc() {
    let w = World::deterministic(1);
    assert_eq!(
        w.hca_devnode_state(),
        Some(PnpState::Started),
        "{:?}",
        w.started()
    );
    w.settle();
    let report = w.report();
    let cap = report.capabilities;
    assert_eq!(report.prm_version.0, hca_prm::regs::PRM_VERSION_MAJOR);
    assert_eq!(cap.num_ports, 2);
    assert_eq!(report.command_slots, 1 << cap.log_max_cmds.min(4));
    assert_eq!(w.hca().command_slots(), report.command_slots);
    // The EQ follows the guide's formula over the tables enabled.
    let qpc = report.table(Table::Qpc);
    let cqc = report.table(Table::Cqc);
    assert!(qpc.log_count <= qpc.device_max_log && cqc.log_count <= cqc.device_max_log);
    let expected = size_event_queue(
        1 << qpc.log_count,
        1 << cqc.log_count,
        2,
        report.command_slots as u64,
        cap.log_max_eqes,
    );
    assert_eq!(report.eq_sizing, expected);
    assert!(report.eq_sizing.entries() >= report.eq_sizing.wanted_events || expected.capped);
    assert!(report.reserved_mtt_entries as u64 * 4096 >= 32 * report.eq_sizing.entries());

    // Both ports came up; their events arrived through ISR -> DPC, at
    // DISPATCH_LEVEL, never at DIRQL.
    let events = w.sink.events();
    for port in [1, 2] {
        let port = PortNum::new(port).unwrap();
        assert!(
            events.contains(&(Seen::PortChange(port, true), Irql::DISPATCH)),
            "{events:?}"
        );
    }
    assert!(
        events.iter().all(|(_, irql)| *irql == Irql::DISPATCH),
        "{events:?}"
    );
    let counters = w.hca().eq_counters();
    assert!(
        counters.interrupts >= 1 && counters.drains >= 1,
        "{counters:?}"
    );
    assert_eq!(counters.garbage_eqes, 0);
    w.finish();
}

#[test]
fn commands_issued_at_dispatch_level_complete_asynchronously_through_events() {
    let w = World::deterministic(2);
    w.settle();
    let log = recorder();
    let hca = w.hca();
    let eqes_before = hca.eq_counters().eqes;
    let inline = Arc::new(Mutex::new(None));
    {
        let (log, inline, hca) = (log.clone(), inline.clone(), hca.clone());
        w.in_dpc(move || {
            assert_eq!(sim_host::irql::current(), Irql::DISPATCH);
            hca.submit(Command::new(Opcode::Nop, 0), record_into(&log, 0));
            let answer = Command::new(Opcode::QueryPort, 1).with_output(4096);
            hca.submit(answer, record_into(&log, 1));
            // A command the device refuses: port 9 does not exist.
            hca.submit(
                Command::new(Opcode::QueryPort, 9).with_output(4096),
                record_into(&log, 2),
            );
            // Nothing completed inside the submitting DPC.
            *lock(&inline) = Some(lock(&log).len());
        });
    }
    w.settle();
    assert_eq!(*lock(&inline), Some(0), "continuations ran inline");
    let outcomes = lock(&log).clone();
    assert_eq!(outcomes.len(), 3, "{outcomes:?}");
    assert!(outcomes.iter().all(|(_, _, irql)| *irql == Irql::DISPATCH));
    assert!(outcomes[0].1.is_ok(), "{outcomes:?}");
    // QUERY_PORT's mailbox came back through the slot's output mailbox.
    let port = outcomes[1].1.as_ref().expect("QUERY_PORT");
    let info = PortInfo::read_from_prefix(&port.mailbox).unwrap().0;
    assert_eq!(info.state, 4, "port 1 is ACTIVE");
    let error = outcomes[2].1.as_ref().unwrap_err();
    assert_eq!(
        *error,
        CommandError::Status {
            opcode: Opcode::QueryPort,
            status: CmdStatus::BadPort
        }
    );
    assert_eq!(error.prm_status(), Some(CmdStatus::BadPort));
    assert_eq!(error.ib_status(), IbStatus::InvalidPort);
    // Each answer came as a CMD_COMPLETION EQE taken by the DPC.
    assert!(hca.eq_counters().eqes >= eqes_before + 3);
    let counters = hca.command_counters();
    assert_eq!(counters.stray_completions, 0);
    w.finish();
}

#[test]
fn more_commands_than_slots_all_complete_in_fifo_order() {
    // Several seeds: the scheduler interleaves the DPCs, the device stepper
    // and interrupts differently with each.
    for seed in [3, 30, 300, 3000] {
        fifo_order_with_seed(seed);
    }
}

fn fifo_order_with_seed(seed: u64) {
    let w = World::deterministic(seed);
    w.settle();
    let hca = w.hca();
    let slots = hca.command_slots();
    assert!(slots >= 1);
    let total = 3 * slots + 1;
    let log = recorder();
    {
        let (log, hca) = (log.clone(), hca.clone());
        w.in_dpc(move || {
            for i in 0..total {
                let command = if i % 2 == 0 {
                    Command::new(Opcode::Nop, 0)
                } else {
                    Command::new(Opcode::QueryPort, 1 + (i % 4 == 1) as u32).with_output(4096)
                };
                hca.submit(command, record_into(&log, i));
            }
        });
    }
    w.settle();
    let outcomes = lock(&log).clone();
    let order: Vec<usize> = outcomes.iter().map(|(i, _, _)| *i).collect();
    assert_eq!(order, (0..total).collect::<Vec<_>>());
    assert!(
        outcomes
            .iter()
            .all(|(_, r, irql)| r.is_ok() && *irql == Irql::DISPATCH)
    );
    let counters = hca.command_counters();
    assert!(
        counters.queued_for_slot >= (total - slots) as u64,
        "{counters:?}"
    );
    w.finish();
}

#[test]
fn oversized_mailboxes_fail_their_command_and_nothing_else() {
    let w = World::deterministic(11);
    w.settle();
    let hca = w.hca();
    let log = recorder();
    {
        let (log, hca) = (log.clone(), hca.clone());
        w.in_dpc(move || {
            let too_long = Command::new(Opcode::WriteMtt, 0).with_mailbox(vec![0; 4097]);
            hca.submit(too_long, record_into(&log, 0));
            let too_much_out = Command::new(Opcode::QueryPort, 1).with_output(8192);
            hca.submit(too_much_out, record_into(&log, 1));
            hca.submit(Command::new(Opcode::Nop, 0), record_into(&log, 2));
        });
    }
    w.settle();
    let outcomes = lock(&log).clone();
    assert!(
        matches!(
            outcomes.as_slice(),
            [
                (0, Err(CommandError::MailboxTooLarge { len: 4097, .. }), _),
                (1, Err(CommandError::MailboxTooLarge { len: 8192, .. }), _),
                (2, Ok(_), _),
            ]
        ),
        "{outcomes:?}"
    );
    assert!(hca.failure().is_none());
    w.finish();
}

#[test]
fn a_command_timeout_fails_the_device_and_every_outstanding_command() {
    let timeout_ns = 50_000_000;
    let w = World::deterministic_with(
        4,
        HcaConfig {
            command_timeout_ns: timeout_ns,
            ..HcaConfig::default()
        },
    );
    w.settle();
    let hca = w.hca();
    let slots = hca.command_slots();
    // The device stops taking commands: its doorbells are dropped from now
    // on, so nothing submitted will ever complete.
    w.function()
        .bar0()
        .write32(offset::CMDQ_CONFIG, CmdqConfig::default().to_bits());
    let log = recorder();
    let submitted_at = w.host.scheduler().now_ns();
    {
        let (log, hca) = (log.clone(), hca.clone());
        w.in_dpc(move || {
            for i in 0..slots + 3 {
                hca.submit(Command::new(Opcode::Nop, 0), record_into(&log, i));
            }
        });
    }
    w.settle();
    let elapsed = w.host.scheduler().now_ns() - submitted_at;
    assert!(elapsed >= timeout_ns, "failed after {elapsed} ns");
    let outcomes = lock(&log).clone();
    assert_eq!(outcomes.len(), slots + 3, "{outcomes:?}");
    for (i, result, irql) in &outcomes {
        assert_eq!(*irql, Irql::DISPATCH);
        let expected = if *i < slots {
            CommandError::Timeout {
                opcode: Opcode::Nop,
            }
        } else {
            CommandError::DeviceFailed {
                opcode: Opcode::Nop,
            }
        };
        assert_eq!(result.as_ref().unwrap_err(), &expected, "command {i}");
    }
    let failure = DeviceFailure::CommandTimeout {
        opcode: Opcode::Nop,
    };
    assert_eq!(hca.failure(), Some(failure));
    let failures: Vec<_> = w
        .sink
        .events()
        .into_iter()
        .filter(|(e, _)| matches!(e, Seen::DeviceFailed(_)))
        .collect();
    assert_eq!(
        failures,
        vec![(Seen::DeviceFailed(failure), Irql::DISPATCH)]
    );
    // Later submissions fail at once.
    let late = recorder();
    hca.submit(Command::new(Opcode::Nop, 0), record_into(&late, 0));
    assert!(matches!(
        lock(&late).as_slice(),
        [(0, Err(CommandError::DeviceFailed { .. }), _)]
    ));
    // Teardown of a failed device resets it and still frees everything.
    w.finish();
}

#[test]
fn a_catastrophic_error_reaches_the_sink_and_fails_later_commands() {
    let w = World::deterministic(5);
    w.settle();
    let hca = w.hca();
    w.function()
        .with_device(|d| d.declare_fatal(FatalSyndrome::Internal));
    w.settle();
    let failure = DeviceFailure::Catastrophic {
        syndrome: FatalSyndrome::Internal as u8,
    };
    assert_eq!(hca.failure(), Some(failure));
    assert!(
        w.sink
            .events()
            .contains(&(Seen::DeviceFailed(failure), Irql::DISPATCH))
    );
    let log = recorder();
    hca.submit(Command::new(Opcode::Nop, 0), record_into(&log, 0));
    assert!(matches!(
        lock(&log).as_slice(),
        [(0, Err(CommandError::DeviceFailed { .. }), _)]
    ));
    w.finish();
}

#[test]
fn a_garbage_eqe_is_counted_and_skipped() {
    let w = World::deterministic(6);
    w.settle();
    let hca = w.hca();
    let before = w.sink.events().len();
    let position = hca.eq_position().expect("EQ live");
    // The link of port 1 drops: the device writes PORT_CHANGE(down) at the
    // consumer's slot. Before the DPC sees it, corrupt its event type
    // (keeping its owner bit valid), as a broken device would.
    let function = w.function();
    function.with_device(|d| d.set_link(1, false));
    let slot = u64::from(position.consumer) & ((1 << position.log_entries) - 1);
    let eqe_address = position.ring_bus_address + 32 * slot;
    let adapter = w.adapter();
    adapter.device_view().write(eqe_address, &[0xEE]).unwrap();
    // Then the link comes back: a well-formed event after the garbage.
    function.with_device(|d| d.set_link(1, true));
    w.settle();
    let counters = hca.eq_counters();
    assert_eq!(counters.garbage_eqes, 1, "{counters:?}");
    let port1 = PortNum::new(1).unwrap();
    let after: Vec<_> = w.sink.events().split_off(before);
    assert_eq!(after, vec![(Seen::PortChange(port1, true), Irql::DISPATCH)]);
    // The EQ keeps working: a command still completes by event.
    let log = recorder();
    {
        let (log, hca) = (log.clone(), hca.clone());
        w.in_dpc(move || hca.submit(Command::new(Opcode::Nop, 0), record_into(&log, 0)));
    }
    w.settle();
    assert!(matches!(
        lock(&log).as_slice(),
        [(0, Ok(_), Irql::DISPATCH)]
    ));
    w.finish();
}

#[test]
fn teardown_returns_every_buffer_and_a_restart_works() {
    let w = World::deterministic(7);
    w.settle();
    let hca = w.hca();
    hca.stop();
    assert!(hca.report().is_none());
    assert_eq!(hca.command_slots(), 0);
    let adapter = w.adapter();
    assert!(adapter.leaks().is_empty(), "{:?}", adapter.leaks());
    // The device is closed: INITIALIZED is clear.
    let status = w.function().bar0().read32(offset::STATUS);
    assert_eq!(status & 0b10, 0, "STATUS {status:#x}");
    // Start again (as on D0 re-entry) and run a command.
    let report = hca.start().expect("restart");
    assert_eq!(report.capabilities.num_ports, 2);
    w.settle();
    let log = recorder();
    {
        let (log, hca) = (log.clone(), hca.clone());
        w.in_dpc(move || hca.submit(Command::new(Opcode::Nop, 0), record_into(&log, 0)));
    }
    w.settle();
    assert!(matches!(lock(&log).as_slice(), [(0, Ok(_), _)]));
    w.finish();
}

#[test]
fn threaded_mode_brings_up_runs_commands_and_tears_down_cleanly() {
    let w = World::new(
        HostConfig::threaded(2, vec![two_port_hca()]),
        HcaConfig::default(),
    );
    assert_eq!(w.hca_devnode_state(), Some(PnpState::Started));
    let hca = w.hca();
    let total = 2 * hca.command_slots() + 1;
    let log = recorder();
    {
        let (log, hca) = (log.clone(), hca.clone());
        w.in_dpc(move || {
            for i in 0..total {
                hca.submit(Command::new(Opcode::Nop, 0), record_into(&log, i));
            }
        });
    }
    for _ in 0..5000 {
        let ports_up = w
            .sink
            .events()
            .iter()
            .filter(|(e, _)| matches!(e, Seen::PortChange(_, true)))
            .count();
        if lock(&log).len() == total && ports_up == 2 {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    w.host.scheduler().quiesce().unwrap();
    let order: Vec<usize> = lock(&log).iter().map(|(i, _, _)| *i).collect();
    assert_eq!(order, (0..total).collect::<Vec<_>>());
    assert!(
        lock(&log)
            .iter()
            .all(|(_, r, irql)| r.is_ok() && *irql == Irql::DISPATCH)
    );
    let events = w.sink.events();
    assert!(
        events.iter().all(|(_, irql)| *irql == Irql::DISPATCH),
        "{events:?}"
    );
    w.finish();
}

#[test]
fn an_eq_capped_by_the_device_is_reported_and_still_works() {
    let mut device = two_port_hca();
    device.limits.log_max_eqes = 8;
    let w = World::new(
        HostConfig::deterministic(8, vec![device]),
        HcaConfig::default(),
    );
    w.settle();
    let report = w.report();
    assert!(report.eq_sizing.capped, "{:?}", report.eq_sizing);
    assert_eq!(report.eq_sizing.log_entries, 8);
    assert!(report.eq_sizing.wanted_events > 256);
    let port1 = PortNum::new(1).unwrap();
    assert!(
        w.sink
            .events()
            .contains(&(Seen::PortChange(port1, true), Irql::DISPATCH))
    );
    w.finish();
}

#[test]
fn stop_fails_commands_whose_answers_have_not_arrived() {
    let w = World::deterministic(9);
    w.settle();
    let hca = w.hca();
    let log = recorder();
    {
        let (log, hca) = (log.clone(), hca.clone());
        w.in_dpc(move || {
            for i in 0..3 {
                hca.submit(Command::new(Opcode::Nop, 0), record_into(&log, i));
            }
        });
    }
    // Run only the submitting DPC: the completion events are posted but no
    // DPC has taken them yet when the device is stopped.
    let ran = w.host.scheduler().run_one().unwrap().expect("the DPC ran");
    assert_eq!(&*ran.label, DRIVER);
    assert!(lock(&log).is_empty());
    hca.stop();
    let outcomes = lock(&log).clone();
    assert_eq!(outcomes.len(), 3, "{outcomes:?}");
    assert!(
        outcomes
            .iter()
            .all(|(_, r, _)| matches!(r, Err(CommandError::DeviceFailed { .. })))
    );
    w.settle();
    assert_eq!(lock(&log).len(), 3, "nothing completes twice");
    w.finish();
}

/// Boots a machine whose BAR0 lies about `lies` and returns why bring-up
/// failed; the failed start must leave nothing allocated.
fn failed_start(lies: Vec<(u64, u32)>) -> InitError {
    let w = World::<LyingPlatform>::with_overrides(
        HostConfig::deterministic(10, vec![two_port_hca()]),
        HcaConfig {
            max_reset_polls: 1000,
            max_command_polls: 1000,
            ..HcaConfig::default()
        },
        lies,
    );
    assert!(matches!(
        w.hca_devnode_state(),
        Some(PnpState::FailedStart(_))
    ));
    let error = match w.started() {
        Some(Err(error)) => error,
        other => panic!("bring-up should have failed: {other:?}"),
    };
    // Release-hardware followed the failed start: the adapter is back
    // with the PDO, which reports anything left allocated or mapped on it
    // as a DmaLeak (the verifier must be clean).
    assert!(w.device().adapter().is_none(), "hardware released");
    assert!(w.device().hca().is_none());
    w.finish();
    error
}

#[test]
fn a_device_that_is_not_ours_is_refused() {
    assert_eq!(
        failed_start(vec![(offset::MAGIC, 0x1234_5678)]),
        InitError::WrongDevice { magic: 0x1234_5678 }
    );
}

#[test]
fn an_unsupported_prm_major_is_refused() {
    assert_eq!(
        failed_start(vec![(offset::PRM_VERSION, 2 << 16 | 3)]),
        InitError::UnsupportedPrm { major: 2, minor: 3 }
    );
}

#[test]
fn a_device_that_never_becomes_ready_is_an_error_not_a_hang() {
    assert_eq!(
        failed_start(vec![(offset::STATUS, 0)]),
        InitError::ResetTimeout { status: 0 }
    );
}

#[test]
fn a_command_queue_that_does_not_enable_fails_bring_up_and_frees_its_memory() {
    // READY, but CMDQ_ENABLED never shows.
    let status = Status::READY.bits();
    assert_eq!(
        failed_start(vec![(offset::STATUS, status)]),
        InitError::CommandQueueNotEnabled { status }
    );
}

#[test]
fn a_polled_command_that_never_completes_is_an_error_not_a_hang() {
    // The command doorbell never reaches the device.
    assert_eq!(
        failed_start(vec![(offset::CMDQ_DOORBELL, DROP_WRITES)]),
        InitError::Command {
            step: "QUERY_DEV_CAP",
            error: CommandError::Timeout {
                opcode: Opcode::QueryDevCap
            }
        }
    );
}

#[test]
fn context_tables_use_the_device_maximum_within_the_configured_caps() {
    let cap = two_port_hca().dev_cap();
    let config = HcaConfig {
        max_log_mpts: 10,
        ..HcaConfig::default()
    };
    let tables = choose_table_sizes(&cap, &config).unwrap();
    let qpc = tables[usize::from(Table::Qpc.code())];
    assert_eq!(qpc.log_count, cap.log_max_qps.min(config.max_log_qps));
    assert_eq!(qpc.device_max_log, cap.log_max_qps);
    assert_eq!(tables[usize::from(Table::Mpt.code())].log_count, 10);
    for t in &tables {
        assert!(t.log_count <= t.device_max_log, "{t:?}");
    }
}

#[test]
fn context_tables_shrink_to_the_memory_budget_but_keep_the_special_qps() {
    let cap = two_port_hca().dev_cap();
    let budget = 256 << 10;
    let tables = choose_table_sizes(
        &cap,
        &HcaConfig {
            max_context_bytes: budget,
            ..HcaConfig::default()
        },
    )
    .unwrap();
    let total: u64 = tables.iter().map(|t| t.bytes()).sum();
    assert!(total <= budget, "{total} > {budget}");
    assert!(1 << tables[usize::from(Table::Qpc.code())].log_count >= 4);
    // A budget below the minimum layout is refused, not ignored.
    let tiny = choose_table_sizes(
        &cap,
        &HcaConfig {
            max_context_bytes: 64,
            ..HcaConfig::default()
        },
    );
    assert!(matches!(
        tiny,
        Err(InitError::ContextBudget { budget: 64, .. })
    ));
    // A zero entry size from a broken device is an error, not a divide or
    // an empty table.
    let mut broken = cap;
    broken.cqc_entry_size = hca_prm::Le16::new(0);
    assert!(matches!(
        choose_table_sizes(&broken, &HcaConfig::default()),
        Err(InitError::Capabilities(_))
    ));
}

#[test]
fn eq_sizing_follows_the_guide_formula() {
    // Guide 5.4.1: MAX_EVENTS = QPs*4 + CQs*2 + ports*5, plus the command
    // slots, rounded up to a power of two.
    let s = size_event_queue(4096, 4096, 2, 16, 16);
    assert_eq!(s.wanted_events, 4096 * 4 + 4096 * 2 + 2 * 5 + 16);
    assert_eq!(s.log_entries, 15);
    assert!(!s.capped);
    // An exact power of two is not rounded further.
    let exact = size_event_queue(0, 0, 0, 16, 16);
    assert_eq!((exact.wanted_events, exact.log_entries), (16, 4));
    // Beyond the device's maximum: capped, and it says so.
    let capped = size_event_queue(1 << 20, 1 << 20, 2, 16, 12);
    assert_eq!(capped.log_entries, 12);
    assert!(capped.capped);
    // Garbage limits saturate instead of overflowing.
    let huge = size_event_queue(u64::MAX, u64::MAX, u64::MAX, u64::MAX, 255);
    assert_eq!(huge.wanted_events, u64::MAX);
    assert_eq!(huge.log_entries, MAX_LOG_EQ_ENTRIES);
    assert!(huge.capped);
}

proptest! {
    #[test]
    fn eq_sizing_holds_every_event_unless_capped(
        qps in 0u64..1 << 24,
        cqs in 0u64..1 << 24,
        ports in 0u64..8,
        slots in 0u64..=16,
        log_max in 0u8..31,
    ) {
        let s = size_event_queue(qps, cqs, ports, slots, log_max);
        prop_assert_eq!(s.wanted_events, qps * 4 + cqs * 2 + ports * 5 + slots);
        prop_assert!(s.log_entries <= log_max.min(MAX_LOG_EQ_ENTRIES));
        if s.capped {
            prop_assert_eq!(s.log_entries, log_max);
            prop_assert!(s.entries() < s.wanted_events);
        } else {
            prop_assert!(s.entries() >= s.wanted_events);
            // The smallest power of two that holds them.
            prop_assert!(s.log_entries == 0 || s.entries() / 2 < s.wanted_events);
        }
    }
}
