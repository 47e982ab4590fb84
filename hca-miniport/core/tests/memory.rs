//! The memory translation service on the simulated host (guide 7.1; PRM
//! 6.0, 7.1): the miniport's simulated-host shell (`sim_shells::hca_miniport`)
//! brings the HCA up, and the tests register kernel pool buffers and user
//! process buffers through [`MemoryTranslation`], check what the device
//! holds (`QUERY_MPT`, and the MTT entries it wrote into its MTT table),
//! and free everything. Each test ends with the host shut down and the
//! verifier clean, which also proves no DMA mapping leaked.
//!
//! The PRM has no command that reads MTT entries back; the device writes
//! every `WRITE_MTT` through to its MTT context table in host memory (PRM
//! 3 step 5), so the test (not the driver: software must not read context
//! memory) reads that table through the device's own view of the bus.

use std::sync::{Arc, Mutex, MutexGuard};

use driver_platform::{DmaAdapter, DmaMapping, Irql, MemoryLocker, RequestorMode};
use hca_miniport_core::eq::{DeviceFailure, EventSink, PortViolation, QpEvent, SrqEvent};
use hca_miniport_core::hca::Hca;
use hca_miniport_core::init::{BringUpReport, HcaConfig};
use hca_miniport_core::mr::{
    DeregFailure, MemoryRegion, MemoryTranslation, MptQuery, MrError, NewTranslation,
    PhysicalRegion, ReregFailure, Reregistration, SharedRegion, TranslationUsage, VirtualRegion,
};
use hca_miniport_core::resources::ResourceError;
use hca_prm::cmd::{MAX_MTT_PER_WRITE, Table};
use hca_prm::mpt::MptKind;
use hca_prm::regs::FatalSyndrome;
use ib_types::access::AccessFlags;
use ib_types::scalars::{PortNum, Qpn};
use ib_types::status::{IbStatus, NtStatus};
use sim_hca::device::DeviceConfig;
use sim_hca::host::HostMemory;
use sim_host::dma::{DmaLeak, HostDmaAdapter, HostLocker};
use sim_host::driver::{DeviceCallbacks, DeviceInit, DriverEntry};
use sim_host::host::{Host, HostConfig};
use sim_host::memory::{PoolBlock, Process};
use sim_host::pci::PciFunction;
use sim_host::platform::SimPlatform;
use sim_host::pnp::DeviceServices;
use sim_shells::hca_miniport::{MiniportDevice, MiniportDriver, MiniportOptions};

// Heap calls the drivers make above DISPATCH_LEVEL are violations
// (docs/host-model.md, "Heap above DISPATCH_LEVEL").
sim_host::install_driver_heap_check!();

const DRIVER: &str = sim_shells::hca_miniport::SERVICE;
const PAGE: u64 = 4096;

type Region = MemoryRegion<SimPlatform>;
type Service = MemoryTranslation<SimPlatform>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Events are not what these tests look at.
struct NullSink;

impl EventSink for NullSink {
    fn completion(&self, _cqn: u32) {}
    fn qp_event(&self, _qpn: Qpn, _event: QpEvent) {}
    fn srq_event(&self, _srqn: u32, _event: SrqEvent) {}
    fn cq_error(&self, _cqn: u32) {}
    fn port_change(&self, _port: PortNum, _active: bool) {}
    fn port_violation(&self, _port: PortNum, _violation: PortViolation) {}
    fn device_failed(&self, _failure: DeviceFailure) {}
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

/// Table sizes small enough to tell the MTT table apart from every other
/// common buffer by its size.
fn small_tables() -> HcaConfig {
    HcaConfig {
        max_log_qps: 8,
        max_log_cqs: 8,
        max_log_srqs: 6,
        max_log_mpts: 10,
        max_log_mtts: 15,
        ..HcaConfig::default()
    }
}

/// A booted machine with the core driving its HCA, and the memory
/// translation service over it.
struct World {
    host: Host,
    device: Arc<MiniportDevice<SimPlatform>>,
    mt: Service,
    hca: Arc<Hca<SimPlatform>>,
}

/// Where a request runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Level {
    /// A work item of the miniport: PASSIVE_LEVEL, the caller's context.
    Passive,
    /// A DPC of the miniport: DISPATCH_LEVEL.
    Dispatch,
}

type Slot<T> = Arc<Mutex<Option<T>>>;

impl World {
    fn new(seed: u64, config: HcaConfig) -> Self {
        let host = Host::new(HostConfig::deterministic(
            seed,
            vec![DeviceConfig::with_ports(
                0x0002_C900_0000_2000,
                &[[10, 0, 0, 1]],
            )],
        ))
        .unwrap();
        let options = MiniportOptions {
            sink: Arc::new(|| Arc::new(NullSink) as Arc<dyn EventSink>),
            ..MiniportOptions::new(config)
        };
        let driver = MiniportDriver::register_with(&host, options);
        host.register_driver("ibalbus", Arc::new(PassThroughFilter));
        host.boot();
        host.scheduler().run_until_idle(100_000).unwrap();
        let device = driver.devices()[0].clone();
        let report = device
            .started()
            .expect("bring-up ran")
            .expect("bring-up succeeded");
        let hca = device.hca().expect("the HCA exists");
        let mt = Service::new(&report).expect("the service");
        World {
            host,
            device,
            mt,
            hca,
        }
    }

    fn report(&self) -> BringUpReport {
        self.device
            .hca()
            .and_then(|hca| hca.report())
            .expect("started")
    }

    fn adapter(&self) -> HostDmaAdapter {
        self.device.adapter().expect("started")
    }

    fn function(&self) -> Arc<PciFunction> {
        self.device.function().expect("started")
    }

    fn settle(&self) {
        self.host.scheduler().run_until_idle(1_000_000).unwrap();
    }

    /// Runs `f` at `level` in the miniport's context and settles.
    fn run(&self, level: Level, f: impl FnOnce() + Send + 'static) {
        let sched = self.host.scheduler_handle();
        match level {
            Level::Passive => sched.queue_work_item(DRIVER, f),
            Level::Dispatch => sched.queue_dpc(DRIVER, f),
        }
        self.settle();
    }

    /// A kernel-only locker, or one for `process` too.
    fn locker(&self, process: Option<&Process>) -> HostLocker {
        HostLocker::new(self.host.pool().kernel_space(), process)
    }

    fn kernel_buffer(&self, len: usize) -> PoolBlock {
        self.host.pool().alloc(DRIVER, *b"MrT ", len).unwrap()
    }

    fn register(
        &self,
        level: Level,
        locker: &HostLocker,
        request: VirtualRegion,
    ) -> Result<Region, MrError> {
        let slot: Slot<Result<Region, MrError>> = Arc::default();
        let (mt, hca, locker, out) = (
            self.mt.clone(),
            self.hca.clone(),
            locker.clone(),
            slot.clone(),
        );
        // PASSIVE_LEVEL stands for the caller's own thread: in its process.
        let caller = locker
            .process()
            .cloned()
            .filter(|_| level == Level::Passive);
        self.run(level, move || {
            let _caller = caller.as_ref().map(sim_host::caller::enter_process);
            let irql = sim_host::irql::current();
            mt.register_virtual(
                &hca,
                &locker,
                irql,
                request,
                Box::new(move |r| *lock(&out) = Some(r)),
            );
        });
        lock(&slot).take().expect("the registration completed")
    }

    fn register_physical(
        &self,
        pages: Vec<u64>,
        template: PhysicalRegion<'static>,
    ) -> Result<Region, MrError> {
        let slot: Slot<Result<Region, MrError>> = Arc::default();
        let (mt, hca, out) = (self.mt.clone(), self.hca.clone(), slot.clone());
        self.run(Level::Dispatch, move || {
            let request = PhysicalRegion {
                pages: &pages,
                ..template
            };
            mt.register_physical(&hca, request, Box::new(move |r| *lock(&out) = Some(r)));
        });
        lock(&slot).take().expect("the registration completed")
    }

    fn share(&self, existing: &Region, request: SharedRegion) -> Result<Region, MrError> {
        let slot: Slot<Result<Region, MrError>> = Arc::default();
        let out = slot.clone();
        self.mt.register_shared(
            &self.hca,
            existing,
            request,
            Box::new(move |r| *lock(&out) = Some(r)),
        );
        self.settle();
        lock(&slot).take().expect("the registration completed")
    }

    fn reregister(
        &self,
        locker: &HostLocker,
        region: Region,
        changes: Reregistration<'static>,
    ) -> Result<Region, ReregFailure<SimPlatform>> {
        let slot: Slot<Result<Region, ReregFailure<SimPlatform>>> = Arc::default();
        let (mt, hca, locker, out) = (
            self.mt.clone(),
            self.hca.clone(),
            locker.clone(),
            slot.clone(),
        );
        let caller = locker.process().cloned();
        self.run(Level::Passive, move || {
            let _caller = caller.as_ref().map(sim_host::caller::enter_process);
            let irql = sim_host::irql::current();
            mt.reregister(
                &hca,
                &locker,
                irql,
                region,
                changes,
                Box::new(move |r| *lock(&out) = Some(r)),
            );
        });
        lock(&slot).take().expect("the re-registration completed")
    }

    fn deregister(&self, region: Region) -> Result<(), DeregFailure<SimPlatform>> {
        let slot: Slot<Result<(), DeregFailure<SimPlatform>>> = Arc::default();
        let (mt, hca, out) = (self.mt.clone(), self.hca.clone(), slot.clone());
        self.run(Level::Dispatch, move || {
            mt.deregister(&hca, region, Box::new(move |r| *lock(&out) = Some(r)));
        });
        lock(&slot).take().expect("the deregistration completed")
    }

    fn query(&self, region: &Region) -> MptQuery {
        let slot: Slot<Result<MptQuery, MrError>> = Arc::default();
        let out = slot.clone();
        self.mt
            .query(&self.hca, region, Box::new(move |r| *lock(&out) = Some(r)));
        self.settle();
        lock(&slot)
            .take()
            .expect("the query completed")
            .expect("QUERY_MPT")
    }

    /// The bus address of the device's MTT table: the one live common
    /// buffer of its size (asserted unique).
    fn mtt_table(&self) -> u64 {
        let report = self.report();
        let bytes = |t: Table| report.table(t).bytes().div_ceil(PAGE) * PAGE;
        let mtt = bytes(Table::Mtt);
        let candidates: Vec<u64> = self
            .adapter()
            .leaks()
            .into_iter()
            .filter_map(|leak| match leak {
                DmaLeak::CommonBuffer { bus, len } if len as u64 == mtt => Some(bus),
                _ => None,
            })
            .collect();
        assert_eq!(candidates.len(), 1, "the MTT table's size is unique");
        candidates[0]
    }

    /// MTT entries `first..first + count` as the device wrote them.
    fn device_mtt(&self, first: u32, count: usize) -> Vec<u64> {
        let base = self.mtt_table();
        let mut bytes = vec![0u8; count * 8];
        self.adapter()
            .device_view()
            .read(base + u64::from(first) * 8, &mut bytes)
            .expect("the MTT table is live");
        bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    fn finish(self) {
        let usage = self.mt.usage();
        assert_eq!(usage.regions, 0, "{usage:?}");
        assert_eq!(usage.translations, 0, "{usage:?}");
        assert_eq!(usage.mtt_free, usage.mtt_capacity, "{usage:?}");
        drop(self.mt);
        drop(self.hca);
        self.host.shut_down();
        self.host.verifier().assert_clean();
    }
}

/// The usage of a fresh service: nothing handed out.
fn idle(usage: TranslationUsage) -> bool {
    usage.regions == 0 && usage.translations == 0 && usage.mtt_free == usage.mtt_capacity
}

/// Checks the device's MPT entry and MTT entries against `region`.
fn assert_on_device(w: &World, region: &Region) {
    let q = w.query(region);
    assert_eq!(q.kind(), Some(MptKind::Region));
    assert!(q.valid);
    assert_eq!(q.key, region.key(), "the entry's tag is the key's");
    assert_eq!(q.key.raw(), region.lkey().get());
    assert_eq!(q.start, region.start());
    assert_eq!(q.length, region.length());
    assert_eq!(q.access(), Some(region.access()));
    assert_eq!(q.pd, region.pd());
    assert_eq!(q.mtt_index, region.mtt_index());
    assert_eq!(q.page_offset, region.page_offset());
    assert_eq!(q.log_page_size, region.log_page_size());
    assert_eq!(q.window_count, 0);
    let range = region.mtt_range();
    assert!(
        range.start() >= w.report().reserved_mtt_entries,
        "not the EQ's"
    );
    assert_eq!(
        w.device_mtt(range.start(), range.len() as usize),
        region.bus_pages(),
        "the device holds the mapping's bus addresses"
    );
}

fn kernel(va: u64, length: u64, access: AccessFlags, pd: u32) -> VirtualRegion {
    VirtualRegion {
        mode: RequestorMode::Kernel,
        va,
        length,
        access,
        pd,
    }
}

fn user(va: u64, length: u64, access: AccessFlags, pd: u32) -> VirtualRegion {
    VirtualRegion {
        mode: RequestorMode::User,
        ..kernel(va, length, access, pd)
    }
}

#[test]
fn kernel_and_user_buffers_are_registered_with_the_mappings_bus_addresses() {
    let w = World::new(1, small_tables());
    let adapter = w.adapter();
    let window = adapter.window();
    let block = w.kernel_buffer(64 * PAGE as usize);
    let process = Process::new(7);
    let user_va = process.alloc(48 * PAGE as usize).unwrap();
    let locker = w.locker(Some(&process));

    // A kernel buffer, registered from a DPC, starting mid-page.
    let rw = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    let k = w
        .register(
            Level::Dispatch,
            &locker,
            kernel(block.va() + 100, 60 * PAGE, rw, 3),
        )
        .expect("kernel registration at DISPATCH_LEVEL");
    assert_eq!(k.mtt_range().len(), 61, "100 bytes in: one more page");
    assert_eq!(k.page_offset(), 100);
    assert_eq!(k.rkey().get(), k.lkey().get(), "remote rights: R_Key = key");
    assert_ne!(k.key().index(), 0, "MPT index 0 is never handed out");
    assert!(k.device_writable());
    assert_on_device(&w, &k);

    // A user buffer, registered at PASSIVE_LEVEL in the process's context,
    // local read only: locked read-only, no R_Key.
    let u = w
        .register(
            Level::Passive,
            &locker,
            user(user_va, 48 * PAGE, AccessFlags::empty(), 4),
        )
        .expect("user registration at PASSIVE_LEVEL");
    assert_eq!(u.rkey().get(), 0, "no remote rights: no R_Key");
    assert!(!u.device_writable());
    assert_ne!(u.key(), k.key());
    assert_on_device(&w, &u);

    // Never a CPU address: every page is a live bus address of this
    // adapter, and the seeded mappings are not contiguous.
    for region in [&k, &u] {
        for &bus in region.bus_pages() {
            assert!(window.contains(&bus) && adapter.is_live(bus), "{bus:#x}");
        }
        let contiguous = region.bus_pages().windows(2).all(|p| p[1] == p[0] + PAGE);
        assert!(
            !contiguous,
            "the host split the mapping; the MTT follows it"
        );
    }
    let k_pages = k.bus_pages().to_vec();
    w.deregister(k).expect("deregister kernel region");
    w.deregister(u).expect("deregister user region");
    assert!(k_pages.iter().all(|&bus| !adapter.is_live(bus)), "unmapped");
    assert!(idle(w.mt.usage()));
    assert_eq!(process.space().locked_pages(), 0, "unlocked");
    w.host.pool().free(block);
    w.finish();
}

#[test]
fn a_large_region_takes_several_write_mtt_commands() {
    let w = World::new(2, small_tables());
    let pages = 2 * MAX_MTT_PER_WRITE + 40;
    let block = w.kernel_buffer(pages * PAGE as usize);
    let locker = w.locker(None);
    let before = w.hca.command_counters().issued;
    let region = w
        .register(
            Level::Dispatch,
            &locker,
            kernel(
                block.va(),
                (pages as u64) * PAGE,
                AccessFlags::LOCAL_WRITE,
                1,
            ),
        )
        .unwrap();
    // Three WRITE_MTT mailboxes and one SW2HW_MPT.
    assert_eq!(w.hca.command_counters().issued - before, 4);
    assert_eq!(region.bus_pages().len(), pages);
    assert_on_device(&w, &region);
    w.deregister(region).unwrap();
    w.host.pool().free(block);
    w.finish();
}

#[test]
fn user_memory_cannot_be_locked_from_a_dpc_kernel_memory_can() {
    let w = World::new(3, small_tables());
    let process = Process::new(9);
    let va = process.alloc(4 * PAGE as usize).unwrap();
    let block = w.kernel_buffer(PAGE as usize);
    let locker = w.locker(Some(&process));
    let issued = w.hca.command_counters().issued;
    let error = w
        .register(
            Level::Dispatch,
            &locker,
            user(va, 4 * PAGE, AccessFlags::LOCAL_WRITE, 1),
        )
        .unwrap_err();
    assert_eq!(
        error,
        MrError::IrqlTooHigh {
            irql: Irql::DISPATCH
        }
    );
    assert_eq!(error.ib_status(), IbStatus::InvalidState);
    assert_eq!(w.hca.command_counters().issued, issued, "no command");
    assert_eq!(
        process.space().locked_pages(),
        0,
        "the locker was not called"
    );
    assert!(idle(w.mt.usage()));
    // The same verb from the caller's thread at PASSIVE_LEVEL works, and a
    // kernel buffer works from the DPC.
    let u = w
        .register(
            Level::Passive,
            &locker,
            user(va, 4 * PAGE, AccessFlags::LOCAL_WRITE, 1),
        )
        .unwrap();
    let k = w
        .register(
            Level::Dispatch,
            &locker,
            kernel(block.va(), 8, AccessFlags::LOCAL_WRITE, 1),
        )
        .unwrap();
    w.deregister(u).unwrap();
    w.deregister(k).unwrap();
    w.host.pool().free(block);
    // The verifier has no IRQL violation so far: the core never called
    // the locker for user memory above APC_LEVEL. Doing so is one (the
    // host checks MmProbeAndLockPages' ceiling), which is why it refuses.
    assert!(w.host.verifier().take().is_empty());
    let direct = w.locker(Some(&process));
    w.run(Level::Dispatch, move || {
        drop(direct.lock(RequestorMode::User, va, PAGE, false));
    });
    // From a DPC it is also outside the process's context.
    let violations = w.host.verifier().take();
    assert!(
        matches!(
            violations.as_slice(),
            [irql, context]
                if matches!(irql.kind, sim_host::verifier::ViolationKind::IrqlTooHigh { .. })
                && matches!(context.kind, sim_host::verifier::ViolationKind::UserMemoryOutsideProcessContext { .. })
        ),
        "{violations:?}"
    );
    w.finish();
}

#[test]
fn bad_input_is_refused_and_changes_nothing() {
    let w = World::new(4, small_tables());
    let block = w.kernel_buffer(2 * PAGE as usize);
    let process = Process::new(11);
    let read_only = process
        .alloc_with(PAGE as usize, sim_host::memory::Protection::ReadOnly)
        .unwrap();
    let locker = w.locker(Some(&process));
    let usage = w.mt.usage();
    let issued = w.hca.command_counters().issued;
    let va = block.va();
    let lw = AccessFlags::LOCAL_WRITE;
    let capacity = usage.mtt_capacity;
    let cases: Vec<(VirtualRegion, MrError)> = vec![
        (kernel(va, 0, lw, 1), MrError::ZeroLength),
        (
            kernel(u64::MAX - 10, 100, lw, 1),
            MrError::RangeOverflow {
                start: u64::MAX - 10,
                length: 100,
            },
        ),
        (
            kernel(va, 8, AccessFlags::REMOTE_WRITE, 1),
            MrError::InvalidAccess {
                access: AccessFlags::REMOTE_WRITE,
            },
        ),
        (
            kernel(
                va,
                8,
                AccessFlags::REMOTE_ATOMIC | AccessFlags::REMOTE_READ,
                1,
            ),
            MrError::InvalidAccess {
                access: AccessFlags::REMOTE_ATOMIC | AccessFlags::REMOTE_READ,
            },
        ),
        (
            kernel(va, 8, lw, 1 << 24),
            MrError::InvalidPd { pd: 1 << 24 },
        ),
        (
            kernel(va, (u64::from(capacity) + 1) * PAGE, lw, 1),
            MrError::TooManyPages {
                pages: u64::from(capacity) + 1,
                capacity,
            },
        ),
        // A range past the pool block (its guard page).
        (
            kernel(va, 3 * PAGE, lw, 1),
            MrError::Lock(sim_host::dma::STATUS_ACCESS_VIOLATION),
        ),
        // Writable access to read-only user memory.
        (
            user(read_only, 8, lw, 1),
            MrError::Lock(sim_host::dma::STATUS_ACCESS_VIOLATION),
        ),
        // A kernel address claimed as user memory.
        (
            user(va, 8, AccessFlags::empty(), 1),
            MrError::Lock(sim_host::dma::STATUS_ACCESS_VIOLATION),
        ),
    ];
    for (request, expected) in cases {
        let level = match request.mode {
            RequestorMode::User => Level::Passive,
            RequestorMode::Kernel => Level::Dispatch,
        };
        let error = w.register(level, &locker, request).unwrap_err();
        assert_eq!(error, expected, "{request:?}");
        assert!(!error.ib_status().is_success());
    }
    // Physical lists: bad page size, offset, count, alignment.
    let good = PhysicalRegion {
        iova: 0x10_0000,
        length: 2 * PAGE,
        first_byte_offset: 0,
        page_shift: 12,
        pages: &[],
        access: lw,
        pd: 1,
    };
    let window = w.adapter().window().start;
    let two = vec![window, window + 8 * PAGE];
    let physical: Vec<(Vec<u64>, PhysicalRegion<'static>, MrError)> = vec![
        (
            two.clone(),
            PhysicalRegion {
                page_shift: 11,
                ..good
            },
            MrError::InvalidPageShift(11),
        ),
        (
            two.clone(),
            PhysicalRegion {
                page_shift: 31,
                ..good
            },
            MrError::InvalidPageShift(31),
        ),
        (
            two.clone(),
            PhysicalRegion {
                first_byte_offset: 4096,
                ..good
            },
            MrError::InvalidPageOffset {
                offset: 4096,
                page_shift: 12,
            },
        ),
        (
            vec![window],
            good,
            MrError::PageCountMismatch {
                given: 1,
                needed: 2,
            },
        ),
        (
            vec![window, window + 8 * PAGE, window + 16 * PAGE],
            good,
            MrError::PageCountMismatch {
                given: 3,
                needed: 2,
            },
        ),
        (
            vec![window, window + 100],
            good,
            MrError::UnalignedPage {
                index: 1,
                address: window + 100,
                page_shift: 12,
            },
        ),
        (
            two.clone(),
            PhysicalRegion {
                page_shift: 21,
                length: 3 << 20,
                ..good
            },
            // The window starts 2 MiB aligned; its ninth page does not.
            MrError::UnalignedPage {
                index: 1,
                address: window + 8 * PAGE,
                page_shift: 21,
            },
        ),
        (
            two,
            PhysicalRegion { length: 0, ..good },
            MrError::ZeroLength,
        ),
    ];
    for (pages, template, expected) in physical {
        let error = w.register_physical(pages, template).unwrap_err();
        assert_eq!(error, expected);
    }
    assert_eq!(w.mt.usage(), usage, "nothing allocated");
    assert_eq!(w.hca.command_counters().issued, issued, "no command issued");
    assert_eq!(process.space().locked_pages(), 0);
    w.host.pool().free(block);
    w.finish();
}

#[test]
fn a_physical_page_list_is_written_as_given() {
    let w = World::new(5, small_tables());
    let adapter = w.adapter();
    // A kernel client's pages, locked and mapped by the client itself.
    let block = w.kernel_buffer(6 * PAGE as usize);
    let locked = w
        .locker(None)
        .lock(RequestorMode::Kernel, block.va(), 6 * PAGE, true)
        .unwrap();
    let mapping = adapter.map(&locked).unwrap();
    let pages: Vec<u64> = (0..mapping.page_count())
        .map(|i| mapping.page_bus_address(i).unwrap())
        .collect();
    let region = w
        .register_physical(
            pages.clone(),
            PhysicalRegion {
                iova: 0x7700_0000_0123,
                length: 5 * PAGE,
                first_byte_offset: 0x123,
                page_shift: 12,
                pages: &[],
                access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
                pd: 2,
            },
        )
        .unwrap();
    assert!(!region.is_virtual());
    assert_eq!(region.bus_pages(), pages.as_slice());
    assert_eq!(region.start(), 0x7700_0000_0123, "the IOVA asked for");
    assert_on_device(&w, &region);
    w.deregister(region).unwrap();
    assert!(
        adapter.is_live(pages[0]),
        "the client's mapping is the client's"
    );
    adapter.unmap(mapping);
    drop(locked);
    w.host.pool().free(block);
    w.finish();
}

#[test]
fn shared_regions_share_the_mtt_and_free_it_with_the_last() {
    let w = World::new(6, small_tables());
    let adapter = w.adapter();
    let process = Process::new(12);
    let va = process.alloc(8 * PAGE as usize).unwrap();
    let locker = w.locker(Some(&process));
    let ro = w
        .register(
            Level::Passive,
            &locker,
            user(va, 8 * PAGE, AccessFlags::REMOTE_READ, 1),
        )
        .unwrap();
    // Writable rights over read-only pages are refused.
    let error = w
        .share(
            &ro,
            SharedRegion {
                va: 0x5000,
                access: AccessFlags::LOCAL_WRITE,
                pd: 2,
            },
        )
        .unwrap_err();
    assert_eq!(
        error,
        MrError::ReadOnlyPages {
            access: AccessFlags::LOCAL_WRITE
        }
    );
    let a = w
        .register(
            Level::Passive,
            &locker,
            user(va + 10, 8 * PAGE - 10, AccessFlags::LOCAL_WRITE, 1),
        )
        .unwrap();
    let usage = w.mt.usage();
    let b = w
        .share(
            &a,
            SharedRegion {
                va: 0x9000_000a,
                access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
                pd: 5,
            },
        )
        .unwrap();
    assert!(b.shares_translation_with(&a));
    assert_eq!(b.translation_users(), 2);
    assert_ne!(b.key(), a.key(), "new keys");
    assert_eq!(
        (b.pd(), b.start(), b.length()),
        (5, 0x9000_000a, a.length())
    );
    assert_eq!(b.mtt_index(), a.mtt_index());
    let after = w.mt.usage();
    assert_eq!(after.mtt_free, usage.mtt_free, "no MTT entries taken");
    assert_eq!(after.regions, usage.regions + 1);
    assert_eq!(after.translations, usage.translations);
    assert_on_device(&w, &b);
    assert_on_device(&w, &a);

    // The first deregistration keeps the translation for the other.
    let pages = a.bus_pages().to_vec();
    w.deregister(a).unwrap();
    assert_eq!(w.mt.usage().mtt_free, usage.mtt_free);
    assert!(pages.iter().all(|&bus| adapter.is_live(bus)));
    assert_on_device(&w, &b);
    w.deregister(b).unwrap();
    assert!(pages.iter().all(|&bus| !adapter.is_live(bus)));
    w.deregister(ro).unwrap();
    assert_eq!(process.space().locked_pages(), 0);
    w.finish();
}

#[test]
fn reregistration_reuses_or_rebuilds_the_translation_and_changes_the_keys() {
    let w = World::new(7, small_tables());
    let adapter = w.adapter();
    let process = Process::new(13);
    let va = process.alloc(16 * PAGE as usize).unwrap();
    let locker = w.locker(Some(&process));
    let region = w
        .register(
            Level::Passive,
            &locker,
            user(va, 4 * PAGE, AccessFlags::LOCAL_WRITE, 1),
        )
        .unwrap();
    let range = region.mtt_range();
    let old_key = region.key();

    // PD and rights only: same entry, same translation, next tag.
    let region = w
        .reregister(
            &locker,
            region,
            Reregistration {
                pd: Some(8),
                access: Some(AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ),
                translation: None,
            },
        )
        .unwrap();
    assert_eq!(region.mpt_index(), old_key.index(), "the same MPT entry");
    assert_eq!(region.key().tag(), old_key.tag().wrapping_add(1), "new tag");
    assert_eq!(region.mtt_range(), range);
    assert_eq!(region.pd(), 8);
    assert_eq!(region.rkey().get(), region.key().raw());
    assert_on_device(&w, &region);

    // A range inside the locked pages: the translation is reused, the MPT
    // entry points into it.
    let region = w
        .reregister(
            &locker,
            region,
            Reregistration {
                translation: Some(NewTranslation::Virtual {
                    va: va + PAGE + 16,
                    length: 2 * PAGE,
                }),
                ..Reregistration::default()
            },
        )
        .unwrap();
    assert_eq!(region.mtt_range(), range, "reused");
    assert_eq!(region.mtt_index(), range.start() + 1);
    assert_eq!(region.page_offset(), 16);
    assert_on_device(&w, &region);
    assert_eq!(w.mt.usage().translations, 1);

    // A range beyond them: a new translation; the old one is released.
    let old_pages = region.bus_pages().to_vec();
    let region = w
        .reregister(
            &locker,
            region,
            Reregistration {
                translation: Some(NewTranslation::Virtual {
                    va: va + 8 * PAGE,
                    length: 8 * PAGE,
                }),
                ..Reregistration::default()
            },
        )
        .unwrap();
    assert_ne!(region.mtt_range(), range, "rebuilt");
    assert_eq!(region.mtt_range().len(), 8);
    assert_eq!(w.mt.usage().translations, 1, "the old one was released");
    assert!(old_pages.iter().all(|&bus| !adapter.is_live(bus)));
    assert_on_device(&w, &region);

    // Rights that need writable pages on read-only ones rebuild too.
    let ro = w
        .register(
            Level::Passive,
            &locker,
            user(va, PAGE, AccessFlags::empty(), 1),
        )
        .unwrap();
    let ro_range = ro.mtt_range();
    let rw = w
        .reregister(
            &locker,
            ro,
            Reregistration {
                access: Some(AccessFlags::LOCAL_WRITE),
                ..Reregistration::default()
            },
        )
        .unwrap();
    assert!(rw.device_writable());
    assert_ne!(rw.mtt_range(), ro_range);
    assert_on_device(&w, &rw);

    // Refusals leave the region as it was.
    let key = rw.key();
    let failure = w
        .reregister(&locker, rw, Reregistration::default())
        .unwrap_err();
    assert_eq!(failure.error, MrError::NothingToChange);
    let rw = failure.region.expect("intact");
    let failure = w
        .reregister(
            &locker,
            rw,
            Reregistration {
                translation: Some(NewTranslation::Virtual {
                    va: va + 100 * PAGE,
                    length: PAGE,
                }),
                ..Reregistration::default()
            },
        )
        .unwrap_err();
    assert!(matches!(failure.error, MrError::Lock(_)), "{failure:?}");
    let rw = failure.region.expect("intact");
    assert_eq!(rw.key(), key);
    assert_on_device(&w, &rw);

    w.deregister(region).unwrap();
    w.deregister(rw).unwrap();
    assert_eq!(process.space().locked_pages(), 0);
    w.finish();
}

#[test]
fn deregistration_and_reregistration_are_refused_while_a_window_is_bound() {
    let w = World::new(8, small_tables());
    let block = w.kernel_buffer(PAGE as usize);
    let locker = w.locker(None);
    let mut region = w
        .register(
            Level::Dispatch,
            &locker,
            kernel(
                block.va(),
                PAGE,
                AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND,
                1,
            ),
        )
        .unwrap();
    assert_eq!(region.unbind_window(), Err(MrError::NoWindowBound));
    region.bind_window();
    let usage = w.mt.usage();
    let issued = w.hca.command_counters().issued;
    let refused = w.deregister(region).unwrap_err();
    assert_eq!(refused.error, MrError::WindowsBound { count: 1 });
    assert_eq!(refused.error.ib_status(), IbStatus::ResourceBusy);
    let region = refused.region;
    let refused = w
        .reregister(
            &locker,
            region,
            Reregistration {
                pd: Some(2),
                ..Reregistration::default()
            },
        )
        .unwrap_err();
    assert_eq!(refused.error, MrError::WindowsBound { count: 1 });
    let mut region = refused.region.expect("intact");
    assert_eq!(w.mt.usage(), usage);
    assert_eq!(w.hca.command_counters().issued, issued, "no command");
    assert_on_device(&w, &region);
    region.unbind_window().unwrap();
    w.deregister(region).unwrap();
    w.host.pool().free(block);
    w.finish();
}

#[test]
fn mtt_exhaustion_fails_cleanly() {
    // A small MTT table: 2^10 entries, some of them the EQ's.
    let config = HcaConfig {
        max_log_mtts: 10,
        ..small_tables()
    };
    let w = World::new(9, config);
    let capacity = w.mt.usage().mtt_capacity;
    let block = w.kernel_buffer(capacity as usize * PAGE as usize);
    let locker = w.locker(None);
    let lw = AccessFlags::LOCAL_WRITE;
    let big = w
        .register(
            Level::Dispatch,
            &locker,
            kernel(block.va(), u64::from(capacity - 3) * PAGE, lw, 1),
        )
        .unwrap();
    let usage = w.mt.usage();
    assert_eq!(usage.mtt_free, 3);
    let error = w
        .register(
            Level::Dispatch,
            &locker,
            kernel(block.va(), 4 * PAGE, lw, 1),
        )
        .unwrap_err();
    assert_eq!(error, MrError::Resources(ResourceError::Exhausted));
    assert_eq!(error.ib_status(), IbStatus::InsufficientResources);
    assert_eq!(w.mt.usage(), usage, "nothing allocated");
    // The pages were locked and mapped before the MTT ran out: all undone.
    assert_eq!(
        w.adapter()
            .leaks()
            .iter()
            .filter(|l| matches!(l, DmaLeak::Mapping { .. }))
            .count(),
        1
    );
    let small = w
        .register(
            Level::Dispatch,
            &locker,
            kernel(block.va(), 3 * PAGE, lw, 1),
        )
        .unwrap();
    w.deregister(big).unwrap();
    w.deregister(small).unwrap();
    w.host.pool().free(block);
    w.finish();
}

#[test]
fn a_device_failure_mid_registration_releases_everything() {
    let w = World::new(10, small_tables());
    let pages = 3 * MAX_MTT_PER_WRITE;
    let block = w.kernel_buffer(pages * PAGE as usize);
    let locker = w.locker(None);
    let slot: Slot<Result<Region, MrError>> = Arc::default();
    let out = slot.clone();
    let completed = w.hca.command_counters().completed;
    w.mt.register_virtual(
        &w.hca,
        &locker,
        Irql::PASSIVE,
        kernel(
            block.va(),
            (pages as u64) * PAGE,
            AccessFlags::LOCAL_WRITE,
            1,
        ),
        Box::new(move |r| *lock(&out) = Some(r)),
    );
    // Let the first WRITE_MTT complete, then the device dies.
    while w.hca.command_counters().completed == completed {
        w.host.scheduler().run_one().unwrap().expect("work to do");
    }
    assert!(lock(&slot).is_none(), "still writing the MTT");
    w.function()
        .with_device(|d| d.declare_fatal(FatalSyndrome::Internal));
    w.settle();
    let error = lock(&slot).take().expect("completed").unwrap_err();
    assert!(
        matches!(error, MrError::Command(e) if e.prm_status().is_none()
            || e.ib_status() != IbStatus::Success),
        "{error:?}"
    );
    assert!(idle(w.mt.usage()), "{:?}", w.mt.usage());
    assert!(
        !w.adapter()
            .leaks()
            .iter()
            .any(|l| matches!(l, DmaLeak::Mapping { .. })),
        "unmapped"
    );
    // Later requests fail at once, inline, and leave nothing either.
    let error = w
        .register(
            Level::Dispatch,
            &locker,
            kernel(block.va(), PAGE, AccessFlags::LOCAL_WRITE, 1),
        )
        .unwrap_err();
    assert!(matches!(error, MrError::Command(_)), "{error:?}");
    assert!(idle(w.mt.usage()));
    w.host.pool().free(block);
    w.finish();
}

#[test]
fn regions_left_at_a_device_failure_are_released_by_deregistration() {
    let w = World::new(11, small_tables());
    let block = w.kernel_buffer(4 * PAGE as usize);
    let locker = w.locker(None);
    let region = w
        .register(
            Level::Dispatch,
            &locker,
            kernel(block.va(), 4 * PAGE, AccessFlags::LOCAL_WRITE, 1),
        )
        .unwrap();
    let shared = w
        .share(
            &region,
            SharedRegion {
                va: 0x1000,
                access: AccessFlags::empty(),
                pd: 1,
            },
        )
        .unwrap();
    w.function()
        .with_device(|d| d.declare_fatal(FatalSyndrome::Internal));
    w.settle();
    // HW2SW_MPT cannot run; the device will be reset; the host side is
    // released so the IOMMU keeps the device out.
    w.deregister(region).expect("released on a failed device");
    w.mt.release_after_reset(&w.hca, shared);
    assert!(idle(w.mt.usage()));
    w.host.pool().free(block);
    w.finish();
}

#[test]
fn many_registrations_from_one_dpc_interleave_and_all_complete() {
    // More registrations than command slots, each a chain of commands,
    // under several seeds (the scheduler interleaves DPCs and the device
    // differently with each).
    for seed in [20, 21, 22] {
        let w = World::new(seed, small_tables());
        let count = 3 * w.hca.command_slots() + 1;
        let block = w.kernel_buffer(count * 3 * PAGE as usize);
        let locker = w.locker(None);
        let results: Arc<Mutex<Vec<Result<Region, MrError>>>> = Arc::default();
        let (mt, hca, out, va) = (w.mt.clone(), w.hca.clone(), results.clone(), block.va());
        w.run(Level::Dispatch, move || {
            for i in 0..count as u64 {
                let out = out.clone();
                mt.register_virtual(
                    &hca,
                    &locker,
                    Irql::DISPATCH,
                    kernel(va + i * 3 * PAGE + i, 2 * PAGE, AccessFlags::LOCAL_WRITE, 1),
                    Box::new(move |r| lock(&out).push(r)),
                );
            }
        });
        let regions: Vec<Region> = lock(&results)
            .drain(..)
            .map(|r| r.expect("registered"))
            .collect();
        assert_eq!(regions.len(), count, "seed {seed}");
        let mut keys: Vec<u32> = regions.iter().map(|r| r.key().index()).collect();
        keys.sort_unstable();
        keys.dedup();
        assert_eq!(keys.len(), count, "distinct MPT entries");
        let mut ranges: Vec<(u32, u32)> = regions
            .iter()
            .map(|r| (r.mtt_range().start(), r.mtt_range().len()))
            .collect();
        ranges.sort_unstable();
        assert!(
            ranges.windows(2).all(|p| p[0].0 + p[0].1 <= p[1].0),
            "disjoint MTT ranges"
        );
        for region in &regions {
            assert_on_device(&w, region);
        }
        for region in regions {
            w.deregister(region).unwrap();
        }
        w.host.pool().free(block);
        w.finish();
    }
}

/// An unbound type 1 window's MPT entry: what a squatter creates at an
/// index the re-registration has just freed on the device.
fn squatter_entry() -> Vec<u8> {
    use zerocopy::IntoBytes;
    let entry = hca_prm::mpt::MptEntry {
        kind: MptKind::WindowType1.code(),
        pd: hca_prm::Le32::new(1),
        ..Default::default()
    };
    entry.as_bytes().to_vec()
}

/// Re-registers `region` (PD only) from a DPC while, in the same DPC, a
/// squatter takes the MPT index the moment `HW2SW_MPT` has freed it: the
/// new `SW2HW_MPT` is refused. With `leave`, the squatter's own
/// continuation removes it again before the old entry is re-created.
fn rereg_against_a_squatter(
    w: &World,
    region: Region,
    leave: bool,
) -> Result<Region, ReregFailure<SimPlatform>> {
    use hca_miniport_core::cmd::Command;
    let slot: Slot<Result<Region, ReregFailure<SimPlatform>>> = Arc::default();
    let (mt, hca, out, locker) = (w.mt.clone(), w.hca.clone(), slot.clone(), w.locker(None));
    let index = region.mpt_index();
    w.run(Level::Dispatch, move || {
        mt.reregister(
            &hca,
            &locker,
            Irql::DISPATCH,
            region,
            Reregistration {
                pd: Some(2),
                ..Reregistration::default()
            },
            Box::new(move |r| *lock(&out) = Some(r)),
        );
        let hca2 = hca.clone();
        hca.submit(
            Command::new(hca_prm::cmd::Opcode::Sw2HwMpt, index).with_mailbox(squatter_entry()),
            Box::new(move |squatted| {
                assert!(squatted.is_ok(), "{squatted:?}");
                if leave {
                    hca2.submit(
                        Command::new(hca_prm::cmd::Opcode::Hw2SwMpt, index),
                        Box::new(|left| assert!(left.is_ok(), "{left:?}")),
                    );
                }
            }),
        );
    });
    lock(&slot).take().expect("the re-registration completed")
}

#[test]
fn a_refused_new_entry_is_replaced_by_the_old_one() {
    let w = World::new(12, small_tables());
    let block = w.kernel_buffer(2 * PAGE as usize);
    let locker = w.locker(None);
    let region = w
        .register(
            Level::Dispatch,
            &locker,
            kernel(block.va(), 2 * PAGE, AccessFlags::LOCAL_WRITE, 1),
        )
        .unwrap();
    let key = region.key();
    let failure = rereg_against_a_squatter(&w, region, true).unwrap_err();
    assert_eq!(
        failure.error.ib_status(),
        IbStatus::InvalidState,
        "BAD_RES_STATE: {failure:?}"
    );
    let region = failure.region.expect("the old entry was re-created");
    assert_eq!(region.key(), key, "with its old key");
    assert_eq!(region.pd(), 1);
    assert_on_device(&w, &region);
    // The allocator's tag did not move: a later re-registration gets the
    // next key, and the device agrees.
    let region = w
        .reregister(
            &locker,
            region,
            Reregistration {
                pd: Some(3),
                ..Reregistration::default()
            },
        )
        .unwrap();
    assert_eq!(region.key().tag(), key.tag().wrapping_add(1));
    assert_on_device(&w, &region);
    w.deregister(region).unwrap();
    w.host.pool().free(block);
    w.finish();
}

#[test]
fn a_region_whose_old_entry_cannot_be_restored_is_lost_and_released() {
    let w = World::new(14, small_tables());
    let block = w.kernel_buffer(2 * PAGE as usize);
    let locker = w.locker(None);
    let region = w
        .register(
            Level::Dispatch,
            &locker,
            kernel(block.va(), 2 * PAGE, AccessFlags::LOCAL_WRITE, 1),
        )
        .unwrap();
    let index = region.mpt_index();
    let failure = rereg_against_a_squatter(&w, region, false).unwrap_err();
    assert!(
        matches!(failure.error, MrError::RegionLost(_)),
        "{failure:?}"
    );
    assert!(failure.region.is_none());
    assert!(idle(w.mt.usage()), "the lost region's resources were freed");
    // The squatter leaves; the index is free on both sides again.
    let done: Slot<bool> = Arc::default();
    let out = done.clone();
    w.hca.submit(
        hca_miniport_core::cmd::Command::new(hca_prm::cmd::Opcode::Hw2SwMpt, index),
        Box::new(move |r| *lock(&out) = Some(r.is_ok())),
    );
    w.settle();
    assert_eq!(*lock(&done), Some(true));
    w.host.pool().free(block);
    w.finish();
}

#[test]
fn a_physical_region_cannot_move_to_a_new_virtual_range() {
    let w = World::new(13, small_tables());
    let window = w.adapter().window().start;
    let region = w
        .register_physical(
            vec![window],
            PhysicalRegion {
                iova: 0x1000,
                length: 64,
                first_byte_offset: 0,
                page_shift: 12,
                pages: &[],
                access: AccessFlags::empty(),
                pd: 1,
            },
        )
        .unwrap();
    let failure = w
        .reregister(
            &w.locker(None),
            region,
            Reregistration {
                translation: Some(NewTranslation::Virtual {
                    va: 0x2000,
                    length: 64,
                }),
                ..Reregistration::default()
            },
        )
        .unwrap_err();
    assert_eq!(failure.error, MrError::PhysicalRange);
    let region = failure.region.expect("intact");
    // Rights and PD can change; the page list stays.
    let region = w
        .reregister(
            &w.locker(None),
            region,
            Reregistration {
                access: Some(AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE),
                ..Reregistration::default()
            },
        )
        .unwrap();
    assert_eq!(region.bus_pages(), &[window]);
    assert_on_device(&w, &region);
    w.deregister(region).unwrap();
    w.finish();
}

#[test]
fn window_keys_come_from_the_same_mpt_table() {
    let w = World::new(15, small_tables());
    let before = w.mt.usage();
    let key = w.mt.alloc_window_key().unwrap();
    assert_ne!(key.index(), 0);
    assert_eq!(w.mt.usage().mpt_free, before.mpt_free - 1);
    let next = w.mt.next_window_key(key.index()).unwrap();
    assert_eq!(
        (next.index(), next.tag()),
        (key.index(), key.tag().wrapping_add(1))
    );
    assert!(w.mt.free_window_key(0).is_err(), "index 0 is held back");
    w.mt.free_window_key(key.index()).unwrap();
    assert!(w.mt.free_window_key(key.index()).is_err(), "double free");
    assert!(w.mt.next_window_key(key.index()).is_err());
    assert_eq!(w.mt.usage(), before);
    w.finish();
}
