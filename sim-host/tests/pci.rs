//! The PCI bus presents simulated HCAs to a function driver: BAR0 through
//! `Mmio`, DMA only through the function's adapter and IOMMU, interrupts to
//! an ISR at device IRQL that queues a DPC. A small probe driver brings the
//! device up in polled mode, sets up an event queue and takes the
//! port-change interrupt — in both the deterministic and threaded modes.
//! The binary runs under the driver heap check (`sim_host::alloc_hook`): an
//! ISR that allocates is caught.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use driver_platform::{CommonBuffer, DevicePowerState, DmaAdapter, Irql, Mmio};
use hca_prm::cmd::{
    CMD_ENTRY_SIZE, CmdEntry, CmdStatus, DevCap, InitHca, Opcode, Table, TableDesc,
};
use hca_prm::ctx::{BufDesc, Eqc};
use hca_prm::doorbell::EqDoorbell;
use hca_prm::eqe::{Eqe, Event, EventClass};
use hca_prm::regs::{self, CmdqConfig, offset};
use hca_prm::{Le16, Le32, Le64};
use ib_types::status::NtStatus;
use sim_hca::device::DeviceConfig;
use sim_host::dma::{HostCommonBuffer, HostDmaAdapter};
use sim_host::driver::{DeviceCallbacks, DeviceInit, DriverEntry, SUCCESS, UNSUCCESSFUL};
use sim_host::host::{Host, HostConfig};
use sim_host::pci::{HCA_DIRQL, InterruptConfig, PciFunction};
use sim_host::pnp::{DeviceServices, PnpState};
use sim_host::sched::DeviceDeferred;
use sim_host::verifier::ViolationKind;
use zerocopy::{FromBytes, FromZeros, IntoBytes};

sim_host::install_driver_heap_check!();

const PAGE: usize = 4096;
const EQ_LOG: u8 = 4;

/// What the probe saw, for the test to check.
#[derive(Default)]
struct Seen {
    magic: u32,
    cap: Option<DevCap>,
    events: Vec<Event>,
    /// ISR runs, and those not at HCA_DIRQL (counters: the ISR must not
    /// allocate, so it cannot push to a list).
    isr_runs: u32,
    isr_off_dirql: u32,
    /// The broken sample: the ISR allocates (a `Box`, as `format!`, a
    /// growing `Vec` or `Arc::new` would).
    isr_allocates: bool,
    /// The broken sample: the DPC keeps a 128 KiB array on its stack.
    dpc_big_array: bool,
    dpc_irql: Vec<Irql>,
    hand_cpu_address: bool,
    skip_free: bool,
    /// The broken driver of the interrupt contract: programs its device
    /// and brings its port up in prepare-hardware, before the host
    /// connects its interrupt.
    start_in_prepare_hardware: bool,
    /// The broken driver of the D3 contract: programs its device once and
    /// keeps using it after a D3 exit as if it had kept its state.
    keep_state_across_d3: bool,
    /// Callbacks in order (PnP, power, interrupt enable/disable).
    calls: Vec<&'static str>,
    /// IRQLs `EvtInterruptEnable` and `EvtInterruptDisable` ran at.
    enable_irql: Vec<Irql>,
    /// `QUERY_DEV_CAP`'s status after a return to D0, when the driver did
    /// not program the device again.
    resume_command: Option<CmdStatus>,
    /// The driver's BAR0 mapping, for the test to use as the driver would.
    bar0: Option<sim_host::pci::Bar0>,
    /// `MAGIC` as read in `EvtDeviceSurpriseRemoval`.
    magic_at_surprise_removal: Option<u32>,
    /// The driver's interrupt object.
    interrupt: Option<sim_host::pci::HostInterrupt>,
}

type Shared = Arc<Mutex<Seen>>;

struct ProbeDriver {
    sched: sim_host::sched::SchedulerHandle,
    seen: Shared,
}

impl DriverEntry for ProbeDriver {
    fn add_device(
        &self,
        _init: &DeviceInit,
        host: &DeviceServices,
    ) -> Result<Arc<dyn DeviceCallbacks>, NtStatus> {
        Ok(Arc::new(Probe {
            host: host.clone(),
            sched: self.sched.clone(),
            seen: self.seen.clone(),
            hw: Mutex::new(None),
        }))
    }
}

struct Probe {
    host: DeviceServices,
    sched: sim_host::sched::SchedulerHandle,
    seen: Shared,
    hw: Mutex<Option<Hardware>>,
}

/// What the probe holds while started.
struct Hardware {
    deferred: DeviceDeferred,
    rings: Arc<Rings>,
    adapter: HostDmaAdapter,
    buffers: Vec<HostCommonBuffer>,
    /// The device was programmed (and not since lost in D3 as far as the
    /// probe knows).
    programmed: bool,
}

/// The probe's device state shared with its ISR and DPC.
struct Rings {
    bar0: sim_host::pci::Bar0,
    cmdq: HostCommonBuffer,
    mailbox_in: HostCommonBuffer,
    mailbox_out: HostCommonBuffer,
    eq: HostCommonBuffer,
    produced: AtomicU32,
    eq_consumer: AtomicU32,
}

impl Rings {
    /// One polled command; returns its status.
    fn command(&self, op: Opcode, in_mod: u32, input: &[u8], out: bool) -> CmdStatus {
        let mut e = CmdEntry {
            opcode: Le16::new(op.code()),
            in_mod: Le32::new(in_mod),
            ..CmdEntry::default()
        };
        if !input.is_empty() {
            assert!(self.mailbox_in.write(0, input));
            e.in_param = Le64::new(self.mailbox_in.bus_address());
            e.in_len = Le32::new(input.len() as u32);
        }
        if out {
            e.out_param = Le64::new(self.mailbox_out.bus_address());
            e.out_len = Le32::new(PAGE as u32);
        }
        self.submit(e)
    }

    fn submit(&self, e: CmdEntry) -> CmdStatus {
        let counter = self.produced.fetch_add(1, Ordering::AcqRel);
        assert!(self.cmdq.write(0, e.as_bytes()));
        self.bar0
            .write32(offset::CMDQ_DOORBELL, counter.wrapping_add(1));
        let mut raw = [0u8; CMD_ENTRY_SIZE];
        assert!(self.cmdq.read(0, &mut raw));
        let done = CmdEntry::read_from_bytes(&raw).unwrap();
        if done.done != hca_prm::owner::phase_for(counter, 0) {
            return CmdStatus::Internal; // never completed
        }
        CmdStatus::from_code(done.status).unwrap_or(CmdStatus::Internal)
    }

    fn arm(&self) {
        let db = EqDoorbell {
            consumer: self.eq_consumer.load(Ordering::Acquire),
            arm: true,
        };
        self.bar0
            .write32(regs::eq_doorbell_offset(0).unwrap(), db.encode());
    }

    /// The DPC: takes every new EQE, then re-arms.
    fn drain_eq(&self, seen: &Shared) {
        loop {
            let consumer = self.eq_consumer.load(Ordering::Acquire);
            let slot = (consumer & ((1 << EQ_LOG) - 1)) as usize * 32;
            let mut raw = [0u8; 32];
            assert!(self.eq.read(slot, &mut raw));
            let eqe = Eqe::read_from_bytes(&raw).unwrap();
            if !eqe.is_valid(consumer, EQ_LOG) {
                break;
            }
            if let Ok(event) = eqe.decode() {
                seen.lock().unwrap().events.push(event);
            }
            self.eq_consumer
                .store(consumer.wrapping_add(1), Ordering::Release);
        }
        self.arm();
    }
}

impl Probe {
    fn note(&self, call: &'static str) {
        self.seen.lock().unwrap().calls.push(call);
    }

    /// Allocates the rings and context tables (prepare-hardware).
    fn allocate(
        &self,
        function: &Arc<PciFunction>,
        adapter: &HostDmaAdapter,
    ) -> Result<(Arc<Rings>, Vec<HostCommonBuffer>), NtStatus> {
        let rings = Arc::new(Rings {
            bar0: function.bar0(),
            cmdq: adapter.alloc_common(PAGE)?,
            mailbox_in: adapter.alloc_common(PAGE)?,
            mailbox_out: adapter.alloc_common(PAGE)?,
            eq: adapter.alloc_common(PAGE)?,
            produced: AtomicU32::new(0),
            eq_consumer: AtomicU32::new(0),
        });
        let tables = (0..6)
            .map(|_| adapter.alloc_common(PAGE))
            .collect::<Result<Vec<_>, _>>()?;
        Ok((rings, tables))
    }

    /// Programs the device from reset: command queue, `QUERY_DEV_CAP`,
    /// `INIT_HCA`, EQ 0 on vector 0 armed, then the port brought up
    /// (its state change raises the EQ's vector).
    fn program(&self, rings: &Rings, tables: &[HostCommonBuffer]) -> Result<(), NtStatus> {
        let bar0 = &rings.bar0;
        self.seen.lock().unwrap().magic = bar0.read32(offset::MAGIC);
        rings.produced.store(0, Ordering::Release);
        rings.eq_consumer.store(0, Ordering::Release);
        let cmdq_bus = if self.seen.lock().unwrap().hand_cpu_address {
            // The bug under test: a CPU address instead of a bus address.
            0xFFFF_A000_0000_0000
        } else {
            rings.cmdq.bus_address()
        };
        assert!(rings.cmdq.write(0, &[0; CMD_ENTRY_SIZE]));
        assert!(rings.eq.write(0, &[0; PAGE]));
        bar0.write64(offset::CMDQ_BASE, cmdq_bus);
        bar0.write32(
            offset::CMDQ_CONFIG,
            CmdqConfig {
                log_size: 0,
                enable: true,
            }
            .to_bits(),
        );
        if rings.command(Opcode::QueryDevCap, 0, &[], true) != CmdStatus::Ok {
            return Err(UNSUCCESSFUL);
        }
        let mut out = vec![0u8; 256];
        rings.mailbox_out.read(0, &mut out);
        self.seen.lock().unwrap().cap = DevCap::read_from_bytes(&out).ok();

        // Small context tables, one page each except the MTT.
        let mut init = InitHca::new_zeroed();
        for ((table, log), buf) in [
            (Table::Qpc, 2),
            (Table::Cqc, 1),
            (Table::Eqc, 1),
            (Table::Srqc, 0),
            (Table::Mpt, 1),
            (Table::Mtt, 4),
        ]
        .into_iter()
        .zip(tables)
        {
            assert!(buf.write(0, &[0; PAGE]));
            init.tables[usize::from(table.code())] = TableDesc {
                base: Le64::new(buf.bus_address()),
                log_count: log,
                ..TableDesc::default()
            };
        }
        init.num_uars = Le16::new(1);
        init.log_page_size = 12;
        if rings.command(Opcode::InitHca, 0, init.as_bytes(), false) != CmdStatus::Ok {
            return Err(UNSUCCESSFUL);
        }
        // EQ 0 on vector 0, its ring described by MTT entry 0.
        let mut mtt = Vec::new();
        mtt.extend_from_slice(&0u64.to_le_bytes());
        mtt.extend_from_slice(&rings.eq.bus_address().to_le_bytes());
        if rings.command(Opcode::WriteMtt, 0, &mtt, false) != CmdStatus::Ok {
            return Err(UNSUCCESSFUL);
        }
        let eqc = Eqc {
            ring: BufDesc {
                mtt_index: Le32::new(0),
                log_page_size: 12,
                log_entries: EQ_LOG,
                log_stride: 5,
                ..BufDesc::default()
            },
            ..Eqc::default()
        };
        if rings.command(Opcode::Sw2HwEq, 0, eqc.as_bytes(), false) != CmdStatus::Ok {
            return Err(UNSUCCESSFUL);
        }
        let map = CmdEntry {
            opcode: Le16::new(Opcode::MapEq.code()),
            in_param: Le64::new(EventClass::all().bits()),
            ..CmdEntry::default()
        };
        if rings.submit(map) != CmdStatus::Ok {
            return Err(UNSUCCESSFUL);
        }
        rings.arm();
        if rings.command(Opcode::InitPort, 1, &[], false) != CmdStatus::Ok {
            return Err(UNSUCCESSFUL);
        }
        Ok(())
    }

    /// Programs the device unless the probe thinks it already is.
    fn program_once(&self) -> NtStatus {
        let mut hw = self.hw.lock().unwrap();
        let Some(hw) = hw.as_mut() else {
            return UNSUCCESSFUL;
        };
        if hw.programmed {
            return SUCCESS;
        }
        match self.program(&hw.rings, &hw.buffers) {
            Ok(()) => {
                hw.programmed = true;
                SUCCESS
            }
            Err(status) => status,
        }
    }
}

impl DeviceCallbacks for Probe {
    fn prepare_hardware(&self) -> NtStatus {
        self.note("prepare-hardware");
        {
            // EvtInterruptEnable/Disable run at DIRQL, where the heap is off
            // limits: room for what they record is made here.
            let mut seen = self.seen.lock().unwrap();
            seen.calls.reserve(64);
            seen.enable_irql.reserve(64);
        }
        let Some(function) = self.host.resources::<PciFunction>() else {
            return UNSUCCESSFUL;
        };
        let adapter = match function.dma_adapter() {
            Ok(a) => a,
            Err(s) => return s,
        };
        let (rings, tables) = match self.allocate(&function, &adapter) {
            Ok(r) => r,
            Err(s) => return s,
        };
        self.seen.lock().unwrap().bar0 = Some(rings.bar0.clone());
        // The interrupt's DPC drains the EQ and re-arms. It holds the
        // rings weakly: the interrupt object (and so its DPC) outlives
        // release-hardware, which takes the rings back.
        let dpc_rings = Arc::downgrade(&rings);
        let dpc_seen = self.seen.clone();
        let deferred = DeviceDeferred::new(
            self.sched.clone(),
            "hcaminiport",
            Arc::new(move || {
                let big_array = {
                    let mut seen = dpc_seen.lock().unwrap();
                    seen.dpc_irql.push(sim_host::irql::current());
                    seen.dpc_big_array
                };
                if big_array {
                    dpc_with_a_128_kib_array();
                }
                if let Some(rings) = dpc_rings.upgrade() {
                    rings.drain_eq(&dpc_seen);
                }
            }),
            Arc::new(|| {}),
            Arc::new(|| {}),
        );
        let isr_seen = self.seen.clone();
        let (enable_seen, disable_seen) = (self.seen.clone(), self.seen.clone());
        let created = function.create_interrupt(InterruptConfig {
            message: 0,
            isr: Arc::new(move |vector| {
                let mut seen = isr_seen.lock().unwrap();
                seen.isr_runs += 1;
                if sim_host::irql::current() != HCA_DIRQL {
                    seen.isr_off_dirql += 1;
                }
                if seen.isr_allocates {
                    std::hint::black_box(Box::new(u64::from(vector)));
                }
                true
            }),
            dpc: deferred.clone(),
            enable: Some(Arc::new(move || {
                let mut seen = enable_seen.lock().unwrap();
                seen.calls.push("interrupt-enable");
                seen.enable_irql.push(sim_host::irql::current());
                SUCCESS
            })),
            disable: Some(Arc::new(move || {
                let mut seen = disable_seen.lock().unwrap();
                seen.calls.push("interrupt-disable");
                seen.enable_irql.push(sim_host::irql::current());
                SUCCESS
            })),
        });
        match created {
            Ok(interrupt) => self.seen.lock().unwrap().interrupt = Some(interrupt),
            Err(status) => return status,
        }
        *self.hw.lock().unwrap() = Some(Hardware {
            deferred,
            rings,
            adapter,
            buffers: tables,
            programmed: false,
        });
        if self.seen.lock().unwrap().start_in_prepare_hardware {
            return self.program_once();
        }
        SUCCESS
    }

    fn d0_entry(&self, _from: DevicePowerState) -> NtStatus {
        self.note("d0-entry");
        SUCCESS
    }

    fn d0_entry_post_interrupts_enabled(&self, _from: DevicePowerState) -> NtStatus {
        self.note("d0-entry-post-interrupts-enabled");
        let programmed = self
            .hw
            .lock()
            .unwrap()
            .as_ref()
            .is_some_and(|h| h.programmed);
        if programmed && self.seen.lock().unwrap().keep_state_across_d3 {
            // The bug under test: the device is assumed to remember the
            // command queue it was given before D3.
            let status = {
                let hw = self.hw.lock().unwrap();
                let rings = &hw.as_ref().unwrap().rings;
                rings.command(Opcode::QueryDevCap, 0, &[], true)
            };
            self.seen.lock().unwrap().resume_command = Some(status);
            return SUCCESS;
        }
        self.program_once()
    }

    fn d0_exit_pre_interrupts_disabled(&self, _to: DevicePowerState) -> NtStatus {
        self.note("d0-exit-pre-interrupts-disabled");
        SUCCESS
    }

    fn d0_exit(&self, _to: DevicePowerState) -> NtStatus {
        self.note("d0-exit");
        // The device loses its state in D3: program it again in D0 (unless
        // the bug under test forgets to).
        if let Some(hw) = self.hw.lock().unwrap().as_mut()
            && !self.seen.lock().unwrap().keep_state_across_d3
        {
            hw.programmed = false;
        }
        SUCCESS
    }

    fn surprise_removal(&self) {
        self.note("surprise-removal");
        let magic = self
            .hw
            .lock()
            .unwrap()
            .as_ref()
            .map(|hw| hw.rings.bar0.read32(offset::MAGIC));
        self.seen.lock().unwrap().magic_at_surprise_removal = magic;
    }

    fn release_hardware(&self) -> NtStatus {
        self.note("release-hardware");
        if let Some(hw) = self.hw.lock().unwrap().take() {
            // The interrupt was disconnected (and its DPC flushed) before
            // D0 exit: the rings are ours alone.
            hw.deferred.flush();
            drop(hw.deferred);
            let mut buffers = hw.buffers;
            match Arc::try_unwrap(hw.rings) {
                Ok(r) => buffers.extend([r.cmdq, r.mailbox_in, r.mailbox_out, r.eq]),
                Err(_) => return UNSUCCESSFUL,
            }
            if !self.seen.lock().unwrap().skip_free {
                for b in buffers {
                    hw.adapter.free_common(b);
                }
            }
        }
        SUCCESS
    }
}

/// What the broken sample's DPC calls: 128 KiB of locals, as a driver that
/// keeps a large buffer on the stack instead of in pool.
#[inline(never)]
fn dpc_with_a_128_kib_array() {
    let mut scratch = [0u8; 128 * 1024];
    std::hint::black_box(&mut scratch);
}

/// A machine from our INFs with the probe as the HCA's function driver
/// (service `hcaminiport`) under a pass-through `ibalbus` filter.
struct World {
    host: Host,
    seen: Shared,
}

impl std::ops::Deref for World {
    type Target = Host;
    fn deref(&self) -> &Host {
        &self.host
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

fn host(threaded: bool, seen: Seen) -> World {
    let cfg = DeviceConfig::with_ports(0x0002_C900_0000_1000, &[[10, 0, 0, 1]]);
    let config = if threaded {
        HostConfig::threaded(1, vec![cfg])
    } else {
        HostConfig::deterministic(11, vec![cfg])
    };
    host_with(config, seen)
}

/// A booted machine with the probe on its one HCA.
fn host_with(config: HostConfig, seen: Seen) -> World {
    let host = Host::new(config).unwrap();
    let seen: Shared = Arc::new(Mutex::new(seen));
    host.register_driver(
        "hcaminiport",
        Arc::new(ProbeDriver {
            sched: host.scheduler_handle(),
            seen: seen.clone(),
        }),
    );
    host.register_driver("ibalbus", Arc::new(PassThroughFilter));
    host.boot();
    World { host, seen }
}

fn settle(h: &World) {
    match h.scheduler().run_until_idle(10_000) {
        Ok(_) => {}
        Err(sim_host::sched::SchedulerError::WrongMode { .. }) => {
            // Threaded: wait until the DPC has seen the port event.
            for _ in 0..2000 {
                if !h.seen.lock().unwrap().events.is_empty() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            h.scheduler().quiesce().unwrap();
        }
        Err(e) => panic!("{e:?}"),
    }
}

fn the_hca_comes_up_and_interrupts(threaded: bool) {
    let h = host(threaded, Seen::default());
    let hca = the_hca(&h);
    assert_eq!(
        h.pnp().state(hca),
        Some(PnpState::Started),
        "{:?}",
        h.verifier().violations()
    );
    assert!(h.pnp().instance_path(hca).unwrap().ends_with("00.0"));
    settle(&h);
    {
        let seen = h.seen.lock().unwrap();
        assert_eq!(seen.magic, regs::MAGIC_VALUE, "BAR0 reads the device");
        let cap = seen.cap.as_ref().expect("QUERY_DEV_CAP through the IOMMU");
        assert_eq!(cap.device_id.get(), regs::PCI_DEVICE_ID);
        assert!(
            seen.events
                .iter()
                .any(|e| matches!(e, Event::PortChange { active: true, .. })),
            "{:?}",
            seen.events
        );
        assert!(seen.isr_runs > 0 && seen.isr_off_dirql == 0);
        assert!(seen.dpc_irql.iter().all(|&i| i == Irql::DISPATCH) && !seen.dpc_irql.is_empty());
    }
    h.pnp().query_and_remove(pci_bus(&h)).unwrap();
    assert_eq!(h.backplane().faults_before_adapter(), 0);
    h.verifier().assert_clean();
}

#[test]
fn deterministic_mode_brings_the_hca_up_and_delivers_its_interrupt() {
    the_hca_comes_up_and_interrupts(false);
}

#[test]
fn threaded_mode_brings_the_hca_up_and_delivers_its_interrupt() {
    the_hca_comes_up_and_interrupts(true);
}

fn an_isr_that_allocates_is_an_irql_violation(threaded: bool) {
    assert!(sim_host::alloc_hook::is_installed());
    let h = host(
        threaded,
        Seen {
            isr_allocates: true,
            ..Seen::default()
        },
    );
    settle_and_remove(&h);
    let isr_runs = h.seen.lock().unwrap().isr_runs;
    assert!(isr_runs > 0);
    let v = h.verifier().take();
    // Each ISR run that allocated (and freed) is reported once per service.
    let expected = ViolationKind::IrqlTooHigh {
        service: sim_host::alloc_hook::ALLOC_SERVICE,
        at: HCA_DIRQL.level(),
        max: Irql::DISPATCH.level(),
    };
    let allocations = v.iter().filter(|x| x.kind == expected).count();
    assert_eq!(allocations, isr_runs as usize, "{v:?}");
    assert!(
        v.iter().all(|x| x.driver.as_deref() == Some("hcaminiport")
            && matches!(x.kind, ViolationKind::IrqlTooHigh { service, .. }
                if service == sim_host::alloc_hook::ALLOC_SERVICE
                    || service == sim_host::alloc_hook::FREE_SERVICE)),
        "only the ISR's heap calls are reported: {v:?}"
    );
}

#[test]
fn an_isr_that_allocates_is_an_irql_violation_deterministic() {
    an_isr_that_allocates_is_an_irql_violation(false);
}

#[test]
fn an_isr_that_allocates_is_an_irql_violation_threaded() {
    an_isr_that_allocates_is_an_irql_violation(true);
}

#[test]
fn a_dpc_with_a_128_kib_array_overflows_the_kernel_stack() {
    for threaded in [false, true] {
        let h = host(
            threaded,
            Seen {
                dpc_big_array: true,
                ..Seen::default()
            },
        );
        settle_and_remove(&h);
        let dpc_runs = h.seen.lock().unwrap().dpc_irql.len();
        assert!(dpc_runs > 0);
        let v = h.verifier().take();
        let overflows: Vec<_> = v
            .iter()
            .filter_map(|x| match x.kind {
                ViolationKind::KernelStackOverflow {
                    routine,
                    used,
                    budget,
                } => Some((x.driver.as_deref(), routine, used, budget)),
                _ => None,
            })
            .collect();
        assert_eq!(overflows.len(), dpc_runs, "threaded {threaded}: {v:?}");
        for (driver, routine, used, budget) in overflows {
            assert_eq!((driver, routine), (Some("hcaminiport"), "DPC"));
            assert_eq!(budget, sim_host::stack::budget());
            // The array, or as deep as the host measures.
            let measurable = sim_host::stack::budget() + sim_host::stack::MEASURED_BEYOND_BUDGET;
            // (to the last byte the scan can see: one short of `measurable`).
            assert!(
                used > budget && used + 8 >= measurable.min(128 * 1024),
                "measured {used} bytes"
            );
        }
        assert_eq!(v.len(), dpc_runs, "nothing else is reported: {v:?}");
    }
}

#[test]
fn a_cpu_address_handed_to_the_device_is_a_dma_fault() {
    let h = host(
        false,
        Seen {
            hand_cpu_address: true,
            ..Seen::default()
        },
    );
    let hca = the_hca(&h);
    assert!(matches!(h.pnp().state(hca), Some(PnpState::FailedStart(_))));
    let v = h.verifier().take();
    assert!(
        v.iter().any(|x| matches!(
            x.kind,
            ViolationKind::DmaFault {
                addr: 0xFFFF_A000_0000_0000,
                ..
            }
        )),
        "{v:?}"
    );
}

#[test]
fn buffers_left_at_release_are_dma_leaks() {
    let h = host(
        false,
        Seen {
            skip_free: true,
            ..Seen::default()
        },
    );
    settle_and_remove(&h);
    let v = h.verifier().take();
    assert!(
        v.iter()
            .filter(|x| matches!(x.kind, ViolationKind::DmaLeak { .. }))
            .count()
            >= 10,
        "{v:?}"
    );
    assert!(
        v.iter().all(|x| x.driver.as_deref() == Some("hcaminiport")),
        "{v:?}"
    );
}

/// Runs a deterministic world to idle, recording what ran when.
fn trace(seed: u64) -> (Vec<(String, u64)>, Vec<Event>) {
    let cfg = DeviceConfig::with_ports(0x0002_C900_0000_1000, &[[10, 0, 0, 1]]);
    let World { host, seen } =
        host_with(HostConfig::deterministic(seed, vec![cfg]), Seen::default());
    let mut ran = Vec::new();
    while let Some(item) = host.scheduler().run_one().unwrap() {
        ran.push((format!("{:?} {}", item.kind, item.label), item.at_ns));
    }
    host.shut_down();
    host.verifier().assert_clean();
    let events = seen.lock().unwrap().events.clone();
    (ran, events)
}

#[test]
fn a_seed_reproduces_the_run_exactly() {
    for seed in [1, 2, 99] {
        let first = trace(seed);
        assert!(!first.0.is_empty());
        assert_eq!(first, trace(seed), "seed {seed}");
    }
}

struct PoolLeaker(sim_host::memory::Pool);
impl DriverEntry for PoolLeaker {
    fn add_device(
        &self,
        _init: &DeviceInit,
        _host: &DeviceServices,
    ) -> Result<Arc<dyn DeviceCallbacks>, NtStatus> {
        // Allocated per device and never freed.
        std::mem::forget(self.0.alloc("ibalbus", *b"Ibal", 100).unwrap());
        Ok(Arc::new(PassThrough))
    }
}

#[test]
fn pool_left_at_unload_is_a_leak() {
    let cfg = DeviceConfig::with_ports(0x0002_C900_0000_1000, &[[10, 0, 0, 1]]);
    let host = Host::new(HostConfig::deterministic(3, vec![cfg])).unwrap();
    host.register_driver(
        "hcaminiport",
        Arc::new(ProbeDriver {
            sched: host.scheduler_handle(),
            seen: Arc::default(),
        }),
    );
    host.register_driver("ibalbus", Arc::new(PoolLeaker(host.pool().clone())));
    host.boot();
    host.scheduler().run_until_idle(10_000).unwrap();
    host.shut_down();
    let v = host.verifier().take();
    assert!(
        matches!(&v[..], [x] if x.driver.as_deref() == Some("ibalbus")
            && x.kind == ViolationKind::PoolLeak { tag: *b"Ibal", bytes: 100 }),
        "{v:?}"
    );
}

fn port_ups(h: &World) -> usize {
    h.seen
        .lock()
        .unwrap()
        .events
        .iter()
        .filter(|e| matches!(e, Event::PortChange { active: true, .. }))
        .count()
}

fn pci_bus(h: &World) -> sim_host::pnp::DevNodeId {
    h.pnp().find("ACPI\\PNP0A08\\0").unwrap()
}

fn the_hca(h: &World) -> sim_host::pnp::DevNodeId {
    h.pnp().children(pci_bus(h))[0]
}

/// Lets the machine run, then removes the PCI bus and everything on it.
fn settle_and_remove(h: &World) {
    settle(h);
    h.pnp().query_and_remove(pci_bus(h)).unwrap();
}

fn sleep_and_wake(h: &World) {
    use driver_platform::SystemPowerState;
    h.pnp().set_system_power(SystemPowerState::S3).unwrap();
    settle(h);
    h.pnp().set_system_power(SystemPowerState::S0).unwrap();
    settle(h);
}

/// KMDF's order, per layer: D0 entry, then the interrupts connected and
/// `EvtInterruptEnable` (at DIRQL), then `EvtDeviceD0EntryPostInterruptsEnabled`;
/// going down the reverse, with `EvtInterruptDisable`.
fn interrupts_are_connected_only_between_d0_entry_and_d0_exit(threaded: bool) {
    let h = host(threaded, Seen::default());
    settle(&h);
    assert_eq!(
        port_ups(&h),
        1,
        "the port came up after the interrupt was connected"
    );
    sleep_and_wake(&h);
    assert_eq!(
        port_ups(&h),
        2,
        "the device, reset in D3, was programmed again"
    );
    h.pnp().query_and_remove(the_hca(&h)).unwrap();
    let seen = h.seen.lock().unwrap();
    let power_cycle = [
        "d0-entry",
        "interrupt-enable",
        "d0-entry-post-interrupts-enabled",
        "d0-exit-pre-interrupts-disabled",
        "interrupt-disable",
        "d0-exit",
    ];
    let expected: Vec<&str> = std::iter::once("prepare-hardware")
        .chain(power_cycle)
        .chain(power_cycle)
        .chain(["release-hardware"])
        .collect();
    assert_eq!(seen.calls, expected);
    assert_eq!(seen.enable_irql, vec![HCA_DIRQL; 4]);
    drop(seen);
    assert_eq!(h.backplane().unclaimed_interrupts(), 0);
    h.verifier().assert_clean();
}

#[test]
fn deterministic_mode_connects_interrupts_only_between_d0_entry_and_d0_exit() {
    interrupts_are_connected_only_between_d0_entry_and_d0_exit(false);
}

#[test]
fn threaded_mode_connects_interrupts_only_between_d0_entry_and_d0_exit() {
    interrupts_are_connected_only_between_d0_entry_and_d0_exit(true);
}

/// The broken driver starts its device in prepare-hardware: the port's
/// interrupt fires before the host connected the ISR and is lost, as on
/// Windows, so the driver never hears its port come up.
fn an_interrupt_raised_in_prepare_hardware_is_lost(threaded: bool) {
    let h = host(
        threaded,
        Seen {
            start_in_prepare_hardware: true,
            ..Seen::default()
        },
    );
    assert_eq!(h.pnp().state(the_hca(&h)), Some(PnpState::Started));
    if threaded {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    settle(&h);
    {
        let seen = h.seen.lock().unwrap();
        assert!(seen.cap.is_some(), "the device was programmed");
        assert_eq!(seen.isr_runs, 0, "no ISR ran");
        assert!(seen.events.is_empty(), "{:?}", seen.events);
    }
    assert!(h.backplane().unclaimed_interrupts() >= 1);
    h.pnp().query_and_remove(the_hca(&h)).unwrap();
    h.verifier().assert_clean();
}

#[test]
fn deterministic_mode_loses_an_interrupt_raised_in_prepare_hardware() {
    an_interrupt_raised_in_prepare_hardware_is_lost(false);
}

#[test]
fn threaded_mode_loses_an_interrupt_raised_in_prepare_hardware() {
    an_interrupt_raised_in_prepare_hardware_is_lost(true);
}

/// The broken driver assumes its device kept its command queue across
/// D3: the device was reset, so its command is never answered.
#[test]
fn a_driver_that_keeps_using_device_state_across_d3_finds_the_device_reset() {
    let h = host(
        false,
        Seen {
            keep_state_across_d3: true,
            ..Seen::default()
        },
    );
    settle(&h);
    assert_eq!(port_ups(&h), 1);
    sleep_and_wake(&h);
    assert_eq!(
        h.seen.lock().unwrap().resume_command,
        Some(CmdStatus::Internal),
        "the command queue the driver set up before D3 is gone"
    );
    assert_eq!(port_ups(&h), 1);
    let status = h
        .backplane()
        .with_device(0, |d| d.mmio_read32(offset::CMDQ_CONFIG));
    assert_eq!(
        status,
        CmdqConfig::default().to_bits(),
        "the device is as reset"
    );
}

/// BAR0 in D3 reads all ones and drops writes; after release-hardware
/// the driver's mapping is gone and using it is a violation.
#[test]
fn bar0_reads_all_ones_in_d3_and_a_mapping_used_after_release_is_a_violation() {
    use driver_platform::SystemPowerState;
    let h = host(false, Seen::default());
    settle(&h);
    let bar0 = h.seen.lock().unwrap().bar0.clone().unwrap();
    assert_eq!(bar0.read32(offset::MAGIC), regs::MAGIC_VALUE);
    h.pnp().set_system_power(SystemPowerState::S3).unwrap();
    assert_eq!(bar0.read32(offset::MAGIC), u32::MAX);
    assert_eq!(bar0.read64(offset::FW_VERSION), u64::MAX);
    bar0.write64(offset::CMDQ_BASE, 0x1234_5000);
    let base = h
        .backplane()
        .with_device(0, |d| d.mmio_read64(offset::CMDQ_BASE));
    assert_eq!(base, 0, "a write in D3 is dropped");
    h.pnp().set_system_power(SystemPowerState::S0).unwrap();
    settle(&h);
    assert_eq!(bar0.read32(offset::MAGIC), regs::MAGIC_VALUE);
    h.verifier().assert_clean();

    h.pnp().query_and_remove(the_hca(&h)).unwrap();
    h.verifier().assert_clean();
    assert_eq!(bar0.read32(offset::MAGIC), u32::MAX);
    bar0.write32(offset::CMDQ_DOORBELL, 1);
    let v = h.verifier().take();
    assert_eq!(v.len(), 2, "{v:?}");
    assert!(
        v.iter().all(|x| x.driver.as_deref() == Some("hcaminiport")
            && matches!(x.kind, ViolationKind::BarAccessAfterUnmap { .. })),
        "{v:?}"
    );
}

/// After a surprise removal the function is gone: the driver's
/// `EvtDeviceSurpriseRemoval` reads all ones, the interrupt is
/// disconnected without `EvtInterruptDisable` (the hardware is gone).
#[test]
fn a_surprise_removed_function_reads_all_ones() {
    let h = host(false, Seen::default());
    settle(&h);
    h.pnp().surprise_remove(the_hca(&h));
    let seen = h.seen.lock().unwrap();
    assert_eq!(seen.magic_at_surprise_removal, Some(u32::MAX));
    let tail: Vec<&str> = seen.calls.iter().rev().take(4).rev().copied().collect();
    assert_eq!(
        tail,
        [
            "surprise-removal",
            "d0-exit-pre-interrupts-disabled",
            "d0-exit",
            "release-hardware"
        ]
    );
    drop(seen);
    h.verifier().assert_clean();
}

/// `WdfInterruptAcquireLock`: the holder runs at DIRQL and no ISR of the
/// function runs until it releases; what the device raised meanwhile is
/// delivered then (threaded mode: the device's timer thread and the
/// raising thread both try).
#[test]
fn the_interrupt_lock_raises_to_dirql_and_holds_off_the_isr() {
    let h = host(true, Seen::default());
    settle(&h);
    let interrupt = h.seen.lock().unwrap().interrupt.clone().unwrap();
    let isrs = || h.seen.lock().unwrap().isr_runs;
    let before = isrs();
    {
        let _lock = interrupt.acquire_lock();
        assert_eq!(sim_host::irql::current(), HCA_DIRQL);
        // The port goes down: the device raises the EQ's vector now.
        h.backplane().with_device(0, |d| d.set_link(1, false));
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(isrs(), before, "no ISR while the lock is held");
    }
    assert_eq!(sim_host::irql::current(), Irql::PASSIVE);
    for _ in 0..2000 {
        if port_downs(&h) > 0 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    h.scheduler().quiesce().unwrap();
    assert!(isrs() > before);
    assert_eq!(port_downs(&h), 1);
    h.pnp().query_and_remove(the_hca(&h)).unwrap();
    h.verifier().assert_clean();

    // Once disconnected, the lock may not be taken.
    drop(interrupt.acquire_lock());
    let v = h.verifier().take();
    assert!(
        matches!(&v[..], [x] if matches!(x.kind, ViolationKind::Protocol { .. })),
        "{v:?}"
    );
}

fn port_downs(h: &World) -> usize {
    h.seen
        .lock()
        .unwrap()
        .events
        .iter()
        .filter(|e| matches!(e, Event::PortChange { active: false, .. }))
        .count()
}

/// What the long-transfer sample saw when it mapped.
#[derive(Debug, Default)]
struct TransferResults {
    map_registers: usize,
    remapping: Option<sim_host::dma::DmaRemapping>,
    too_long: Option<Result<usize, NtStatus>>,
    fits: Option<Result<usize, NtStatus>>,
}

/// A broken sample: it declares a 64 KiB maximum transfer for its device
/// (`DEVICE_DESCRIPTION.MaximumLength`) and then maps a 128 KiB buffer as
/// one scatter/gather list.
struct LongTransferDriver {
    pool: sim_host::memory::Pool,
    results: Arc<Mutex<TransferResults>>,
}

impl DriverEntry for LongTransferDriver {
    fn add_device(
        &self,
        _init: &DeviceInit,
        host: &DeviceServices,
    ) -> Result<Arc<dyn DeviceCallbacks>, NtStatus> {
        Ok(Arc::new(LongTransfer {
            host: host.clone(),
            pool: self.pool.clone(),
            results: self.results.clone(),
        }))
    }
}

struct LongTransfer {
    host: DeviceServices,
    pool: sim_host::memory::Pool,
    results: Arc<Mutex<TransferResults>>,
}

impl DeviceCallbacks for LongTransfer {
    fn prepare_hardware(&self) -> NtStatus {
        use driver_platform::{DmaMapping, MemoryLocker, RequestorMode};
        let Some(function) = self.host.resources::<PciFunction>() else {
            return UNSUCCESSFUL;
        };
        let description = sim_host::dma::DmaDescription {
            maximum_length: 64 * 1024,
        };
        let adapter = match function.dma_adapter_for(description) {
            Ok(a) => a,
            Err(s) => return s,
        };
        let block = self
            .pool
            .alloc("hcaminiport", *b"Xfer", 128 * 1024)
            .unwrap();
        let locker = sim_host::dma::HostLocker::new(self.pool.kernel_space(), None);
        let locked = locker
            .lock(RequestorMode::Kernel, block.va(), 128 * 1024, false)
            .unwrap();
        let map = |offset: usize, len: usize| {
            adapter.map_transfer(&locked, offset, len).map(|mapping| {
                let pages = mapping.page_count();
                adapter.unmap(mapping);
                pages
            })
        };
        let too_long = map(0, 128 * 1024);
        // 64 KiB not page aligned spans 17 pages: what the registers allow.
        let fits = map(PAGE + 100, 64 * 1024);
        *self.results.lock().unwrap() = TransferResults {
            map_registers: adapter.map_registers(),
            remapping: Some(adapter.remapping()),
            too_long: Some(too_long),
            fits: Some(fits),
        };
        drop(locked);
        self.pool.free(block);
        SUCCESS
    }
}

fn long_transfer_host(results: &Arc<Mutex<TransferResults>>) -> Host {
    let cfg = DeviceConfig::with_ports(0x0002_C900_0000_1000, &[[10, 0, 0, 1]]);
    let host = Host::new(HostConfig::deterministic(5, vec![cfg])).unwrap();
    host.register_driver(
        "hcaminiport",
        Arc::new(LongTransferDriver {
            pool: host.pool().clone(),
            results: results.clone(),
        }),
    );
    host.register_driver("ibalbus", Arc::new(PassThroughFilter));
    host.boot();
    host
}

#[test]
fn a_transfer_longer_than_the_adapter_maps_fails_as_on_windows() {
    let results = Arc::default();
    let host = long_transfer_host(&results);
    host.scheduler().run_until_idle(10_000).unwrap();
    host.shut_down();
    let r = results.lock().unwrap();
    assert_eq!(r.map_registers, 17, "64 KiB / 4 KiB + 1");
    assert_eq!(
        r.remapping,
        Some(sim_host::dma::DmaRemapping::Enforced),
        "our INF opts in"
    );
    assert_eq!(r.too_long, Some(Err(NtStatus::INSUFFICIENT_RESOURCES)));
    assert_eq!(r.fits, Some(Ok(17)));
    // The refused list mapped nothing, so nothing leaked.
    host.verifier().assert_clean();
}

#[test]
fn a_device_whose_inf_lacks_the_dma_remapping_opt_in_is_flagged() {
    use sim_host::registry::{device_parameters_key, service_parameters_key};
    let results = Arc::default();
    let host = long_transfer_host(&results);
    host.scheduler().run_until_idle(10_000).unwrap();
    host.verifier().assert_clean();
    let hca = host.hcas()[0];
    let path = host.pnp().instance_path(hca).unwrap();
    // What an INF without either directive leaves: no per-device
    // `DMA Management\RemappingSupported`, no per-driver
    // `DmaRemappingCompatible`. The device restarts and takes its adapter
    // again.
    let registry = host.registry();
    registry
        .delete_value(
            &format!("{}\\DMA Management", device_parameters_key(&path)),
            "RemappingSupported",
        )
        .unwrap();
    registry
        .delete_value(
            &service_parameters_key("hcaminiport"),
            "DmaRemappingCompatible",
        )
        .unwrap();
    host.pnp().stop(hca).unwrap();
    host.pnp().restart(hca);
    host.scheduler().run_until_idle(10_000).unwrap();
    assert_eq!(
        results.lock().unwrap().remapping,
        Some(sim_host::dma::DmaRemapping::NotEnforced)
    );
    let v = host.verifier().take();
    assert!(
        matches!(&v[..], [x] if x.driver.as_deref() == Some("hcaminiport")
            && matches!(&x.kind, ViolationKind::Protocol { detail }
                if detail.contains("without DMA remapping (NotEnforced)"))),
        "{v:?}"
    );
    // An explicit opt-out is flagged too.
    registry
        .set_value(
            &service_parameters_key("hcaminiport"),
            "DmaRemappingCompatible",
            driver_platform::RegValue::Dword(0),
        )
        .unwrap();
    host.pnp().stop(hca).unwrap();
    host.pnp().restart(hca);
    host.scheduler().run_until_idle(10_000).unwrap();
    assert_eq!(
        results.lock().unwrap().remapping,
        Some(sim_host::dma::DmaRemapping::OptedOut)
    );
    assert_eq!(host.verifier().take().len(), 1);
    host.shut_down();
    host.verifier().assert_clean();
}
