//! A booted simulated machine with the miniport core driving one HCA, for
//! the verbs tests: a function driver `hcaminiport` creates an
//! `Hca<SimPlatform>` in prepare-hardware, connects the ISR (which queues
//! the DPC), wires the DPC, the work item and the timer to the core, and
//! starts it; a pass-through `ibalbus` filter sits above it as the INF
//! says.

#![allow(dead_code, reason = "each test binary uses part of the support")]

use std::sync::{Arc, Mutex, MutexGuard, Weak};

use driver_platform::RequestorMode;
use hca_miniport_core::eq::{DeviceFailure, EventSink, PortViolation, QpEvent, SrqEvent};
use hca_miniport_core::hca::{Hca, HcaResources};
use hca_miniport_core::init::{BringUpReport, HcaConfig, InitError};
use ib_types::ioctl::{Response, Verb, decode_response, encode_request, request_len};
use ib_types::scalars::{PortNum, Qpn};
use ib_types::status::NtStatus;
use sim_hca::device::DeviceConfig;
use sim_host::dma::HostDmaAdapter;
use sim_host::driver::{DeviceCallbacks, DeviceInit, DriverEntry, SUCCESS, UNSUCCESSFUL};
use sim_host::host::{Host, HostConfig};
use sim_host::pci::PciFunction;
use sim_host::platform::SimPlatform;
use sim_host::pnp::DeviceServices;
use sim_host::request::{Completion, HostRequest, RequestHandle};
use sim_host::sched::{DeviceDeferred, SchedulerHandle};

/// The driver's service name.
pub(crate) const DRIVER: &str = "hcaminiport";

/// The node GUID of the test HCA.
pub(crate) const NODE_GUID: u64 = 0x0002_C900_0000_1000;

/// Locks a test mutex, ignoring poisoning.
/// The device number inside a handle the verbs handed out (the low 24
/// bits; `resources::Handle`).
#[allow(dead_code, reason = "not every test binary uses it")]
pub(crate) fn number_of(handle: u64) -> u32 {
    (handle & 0xFF_FFFF) as u32
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The outer sink: counts what reaches it.
#[derive(Default)]
pub(crate) struct CountingSink {
    /// Completion events seen.
    pub(crate) completions: Mutex<Vec<u32>>,
}

impl EventSink for CountingSink {
    fn completion(&self, cqn: u32) {
        lock(&self.completions).push(cqn);
    }
    fn qp_event(&self, _: Qpn, _: QpEvent) {}
    fn srq_event(&self, _: u32, _: SrqEvent) {}
    fn cq_error(&self, _: u32) {}
    fn port_change(&self, _: PortNum, _: bool) {}
    fn port_violation(&self, _: PortNum, _: PortViolation) {}
    fn device_failed(&self, _: DeviceFailure) {}
}

struct Shared {
    config: HcaConfig,
    sink: Arc<CountingSink>,
    hca: Mutex<Option<Arc<Hca<SimPlatform>>>>,
    function: Mutex<Option<Arc<PciFunction>>>,
    adapter: Mutex<Option<HostDmaAdapter>>,
    started: Mutex<Option<Result<BringUpReport, InitError>>>,
}

struct MiniportDriver {
    sched: SchedulerHandle,
    /// One slot per HCA, taken in the order the devices are added.
    shared: Vec<Arc<Shared>>,
    next: std::sync::atomic::AtomicUsize,
}

impl DriverEntry for MiniportDriver {
    fn add_device(
        &self,
        _init: &DeviceInit,
        host: &DeviceServices,
    ) -> Result<Arc<dyn DeviceCallbacks>, NtStatus> {
        let i = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let shared = self.shared.get(i).ok_or(UNSUCCESSFUL)?;
        Ok(Arc::new(MiniportDevice {
            host: host.clone(),
            sched: self.sched.clone(),
            shared: shared.clone(),
        }))
    }
}

struct MiniportDevice {
    host: DeviceServices,
    sched: SchedulerHandle,
    shared: Arc<Shared>,
}

impl DeviceCallbacks for MiniportDevice {
    fn prepare_hardware(&self) -> NtStatus {
        let Some(function) = self.host.resources::<PciFunction>() else {
            return UNSUCCESSFUL;
        };
        let adapter = match function.dma_adapter() {
            Ok(adapter) => adapter,
            Err(status) => return status,
        };
        let mut isr_deferred = None;
        let hca = Arc::new_cyclic(|weak: &Weak<Hca<SimPlatform>>| {
            let (dpc, work, timer) = (weak.clone(), weak.clone(), weak.clone());
            let deferred = DeviceDeferred::new(
                self.sched.clone(),
                DRIVER,
                Arc::new(move || {
                    if let Some(hca) = dpc.upgrade() {
                        hca.dpc();
                    }
                }),
                Arc::new(move || {
                    if let Some(hca) = work.upgrade() {
                        hca.work_item();
                    }
                }),
                Arc::new(move || {
                    if let Some(hca) = timer.upgrade() {
                        hca.timer();
                    }
                }),
            );
            isr_deferred = Some(deferred.clone());
            Hca::new(
                HcaResources {
                    bar0: function.bar0(),
                    dma: adapter.clone(),
                    deferred,
                    msix_vectors: function.message_count(),
                    free_common: Box::new(|dma: &HostDmaAdapter, buffer| dma.free_common(buffer)),
                },
                self.shared.config,
                self.shared.sink.clone(),
            )
        });
        let Some(isr_deferred) = isr_deferred else {
            return UNSUCCESSFUL;
        };
        let isr_hca = Arc::downgrade(&hca);
        let connected = function.connect_interrupt(move |vector| {
            if isr_hca.upgrade().is_some_and(|hca| hca.isr(vector)) {
                isr_deferred.insert_dpc();
            }
        });
        if let Err(status) = connected {
            return status;
        }
        let started = hca.start();
        let ok = started.is_ok();
        *lock(&self.shared.started) = Some(started);
        *lock(&self.shared.hca) = Some(hca);
        *lock(&self.shared.function) = Some(function);
        *lock(&self.shared.adapter) = Some(adapter);
        if ok { SUCCESS } else { UNSUCCESSFUL }
    }

    fn release_hardware(&self) -> NtStatus {
        if let Some(hca) = lock(&self.shared.hca).take() {
            hca.stop();
        }
        if let Some(function) = lock(&self.shared.function).take() {
            function.disconnect_interrupt();
        }
        lock(&self.shared.adapter).take();
        SUCCESS
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

/// A booted machine with the core driving its one two-port HCA.
pub(crate) struct World {
    /// The host.
    pub(crate) host: Host,
    shared: Arc<Shared>,
    /// Every HCA's slot (the first is `shared`).
    all: Vec<Arc<Shared>>,
}

impl World {
    /// Deterministic host with seed `seed`.
    pub(crate) fn deterministic(seed: u64) -> Self {
        Self::with_hcas(seed, vec![two_port_hca()], HcaConfig::default())
    }

    /// Deterministic host with seed `seed` and one HCA per device config,
    /// each driven by a core configured with `config`.
    pub(crate) fn with_hcas(seed: u64, devices: Vec<DeviceConfig>, config: HcaConfig) -> Self {
        let count = devices.len();
        let host = Host::new(HostConfig::deterministic(seed, devices)).unwrap();
        let all: Vec<Arc<Shared>> = (0..count)
            .map(|_| {
                Arc::new(Shared {
                    config,
                    sink: Arc::default(),
                    hca: Mutex::new(None),
                    function: Mutex::new(None),
                    adapter: Mutex::new(None),
                    started: Mutex::new(None),
                })
            })
            .collect();
        host.register_driver(
            DRIVER,
            Arc::new(MiniportDriver {
                sched: host.scheduler_handle(),
                shared: all.clone(),
                next: std::sync::atomic::AtomicUsize::new(0),
            }),
        );
        host.register_driver("ibalbus", Arc::new(PassThroughFilter));
        host.boot();
        let shared = all[0].clone();
        let w = World { host, shared, all };
        w.settle();
        for shared in &w.all {
            assert!(
                matches!(*lock(&shared.started), Some(Ok(_))),
                "bring-up failed"
            );
        }
        w
    }

    /// The core of HCA `i` (in the order the devices were added).
    pub(crate) fn hca_at(&self, i: usize) -> Arc<Hca<SimPlatform>> {
        lock(&self.all[i].hca).clone().expect("the HCA was created")
    }

    /// The DMA adapter of HCA `i`.
    pub(crate) fn adapter_at(&self, i: usize) -> HostDmaAdapter {
        lock(&self.all[i].adapter).clone().expect("started")
    }

    /// Submits `V` to HCA `i` from a DPC, runs the machine, and returns the
    /// completion.
    pub(crate) fn call_in_dpc_at<V: Verb>(
        &self,
        i: usize,
        mode: RequestorMode,
        handle: u64,
        input: &V::In,
        private_out_max: u32,
    ) -> Completion {
        let (request, issuer) = self.request::<V>(mode, handle, input, private_out_max);
        let hca = self.hca_at(i);
        self.in_dpc(move || {
            assert_eq!(sim_host::irql::current(), driver_platform::Irql::DISPATCH);
            hca.submit_request(request);
        });
        self.settle();
        issuer.completion().expect("the request completed")
    }

    /// The core.
    pub(crate) fn hca(&self) -> Arc<Hca<SimPlatform>> {
        lock(&self.shared.hca).clone().expect("the HCA was created")
    }

    /// The PCI function.
    pub(crate) fn function(&self) -> Arc<PciFunction> {
        lock(&self.shared.function).clone().expect("started")
    }

    /// The function's DMA adapter (for test-owned device memory).
    pub(crate) fn adapter(&self) -> HostDmaAdapter {
        lock(&self.shared.adapter).clone().expect("started")
    }

    /// The outer sink.
    pub(crate) fn sink(&self) -> Arc<CountingSink> {
        self.shared.sink.clone()
    }

    /// Runs the scheduler until nothing is left to do.
    pub(crate) fn settle(&self) {
        self.host.scheduler().run_until_idle(100_000).unwrap();
    }

    /// Runs `f` as a DPC of the miniport (DISPATCH_LEVEL).
    pub(crate) fn in_dpc(&self, f: impl FnOnce() + Send + 'static) {
        self.host.scheduler_handle().queue_dpc(DRIVER, f);
    }

    /// A request of verb `V` and its issuer's handle.
    pub(crate) fn request<V: Verb>(
        &self,
        mode: RequestorMode,
        handle: u64,
        input: &V::In,
        private_out_max: u32,
    ) -> (HostRequest, RequestHandle) {
        let mut bytes = vec![0; request_len::<V>(0).unwrap()];
        encode_request::<V>(handle, input, &[], private_out_max, &mut bytes).unwrap();
        let out_len = ib_types::ioctl::response_len::<V>(private_out_max as usize).unwrap();
        self.raw_request(V::ID.ioctl().raw(), mode, bytes, out_len)
    }

    /// A request with raw code and bytes.
    pub(crate) fn raw_request(
        &self,
        code: u32,
        mode: RequestorMode,
        input: Vec<u8>,
        output_len: usize,
    ) -> (HostRequest, RequestHandle) {
        HostRequest::new(self.host.verifier(), code, mode, input, output_len)
    }

    /// Submits `V` at PASSIVE_LEVEL from the test thread, runs the
    /// machine, and returns the completion.
    pub(crate) fn call<V: Verb>(
        &self,
        mode: RequestorMode,
        handle: u64,
        input: &V::In,
        private_out_max: u32,
    ) -> Completion {
        let (request, issuer) = self.request::<V>(mode, handle, input, private_out_max);
        self.hca().submit_request(request);
        self.settle();
        issuer.completion().expect("the request completed")
    }

    /// Submits `V` from a DPC (DISPATCH_LEVEL), runs the machine, and
    /// returns the completion.
    pub(crate) fn call_in_dpc<V: Verb>(
        &self,
        mode: RequestorMode,
        handle: u64,
        input: &V::In,
        private_out_max: u32,
    ) -> Completion {
        let (request, issuer) = self.request::<V>(mode, handle, input, private_out_max);
        let hca = self.hca();
        self.in_dpc(move || {
            assert_eq!(sim_host::irql::current(), driver_platform::Irql::DISPATCH);
            hca.submit_request(request);
        });
        self.settle();
        issuer.completion().expect("the request completed")
    }

    /// Shuts the host down and checks the verifier.
    pub(crate) fn finish(self) {
        self.host.shut_down();
        self.host.verifier().assert_clean();
    }
}

/// The response of a completion, decoded; checks that the NTSTATUS agrees
/// with the response status and `information` with the bytes.
pub(crate) fn response<V: Verb>(completion: &Completion) -> Response<'_, V> {
    let len = completion.information as usize;
    let response = decode_response::<V>(&completion.output[..len]).expect("a valid response");
    assert_eq!(completion.status, response.status.to_ntstatus());
    response
}

/// The test HCA: two ports.
pub(crate) fn two_port_hca() -> DeviceConfig {
    DeviceConfig::with_ports(NODE_GUID, &[[10, 0, 0, 1], [10, 0, 1, 1]])
}

impl World {
    /// Installs a kernel-memory locker in HCA `i`, as a shell does after
    /// start: the MR verbs lock kernel pages with it.
    pub(crate) fn install_kernel_locker(&self, i: usize) {
        let locker = sim_host::dma::HostLocker::new(self.host.pool().kernel_space(), None);
        self.hca_at(i).set_kernel_locker(locker);
    }

    /// A request of verb `V` whose encoded input is then changed by
    /// `patch` (offsets from the start of the fixed input), so tests can
    /// send what `encode_request` refuses to produce.
    pub(crate) fn patched_request<V: Verb>(
        &self,
        mode: RequestorMode,
        handle: u64,
        input: &V::In,
        patch: impl FnOnce(&mut [u8]),
    ) -> (HostRequest, RequestHandle) {
        let mut bytes = vec![0; request_len::<V>(0).unwrap()];
        encode_request::<V>(handle, input, &[], 0, &mut bytes).unwrap();
        patch(&mut bytes[ib_types::ioctl::REQUEST_HEADER_SIZE..]);
        let out_len = ib_types::ioctl::response_len::<V>(0).unwrap();
        self.raw_request(V::ID.ioctl().raw(), mode, bytes, out_len)
    }

    /// The PCI function of HCA `i` (to look at the simulated device).
    pub(crate) fn function_at(&self, i: usize) -> Arc<PciFunction> {
        lock(&self.all[i].function).clone().expect("started")
    }

    /// Submits `request` to HCA `i` from a DPC, runs the machine, and
    /// returns the completion.
    pub(crate) fn submit_in_dpc_at(
        &self,
        i: usize,
        request: HostRequest,
        issuer: RequestHandle,
    ) -> Completion {
        let hca = self.hca_at(i);
        self.in_dpc(move || {
            assert_eq!(sim_host::irql::current(), driver_platform::Irql::DISPATCH);
            hca.submit_request(request);
        });
        self.settle();
        issuer.completion().expect("the request completed")
    }

    /// Submits `V` to HCA `i` as a user-mode request of `caller`, with
    /// `private` input bytes, at PASSIVE_LEVEL from the test thread (the
    /// proxy's caller context); runs the machine and returns the
    /// completion.
    pub(crate) fn user_call_at<V: Verb>(
        &self,
        i: usize,
        caller: &sim_host::caller::HostCaller,
        handle: u64,
        input: &V::In,
        private: &[u8],
        private_out_max: u32,
    ) -> Completion {
        let mut bytes = vec![0; request_len::<V>(private.len()).unwrap()];
        encode_request::<V>(handle, input, private, private_out_max, &mut bytes).unwrap();
        let out_len = ib_types::ioctl::response_len::<V>(private_out_max as usize).unwrap();
        self.user_raw_at(i, caller, V::ID.ioctl().raw(), bytes, out_len)
    }

    /// Submits raw user-mode request bytes to HCA `i` for `caller` at
    /// PASSIVE_LEVEL; runs the machine and returns the completion.
    pub(crate) fn user_raw_at(
        &self,
        i: usize,
        caller: &sim_host::caller::HostCaller,
        code: u32,
        input: Vec<u8>,
        output_len: usize,
    ) -> Completion {
        let (request, issuer) = self.raw_request(code, RequestorMode::User, input, output_len);
        self.hca_at(i).submit_user_request(request, caller.clone());
        self.settle();
        issuer.completion().expect("the request completed")
    }
}
