//! A booted simulated machine with the miniport core driving one HCA, for
//! the verbs tests: the miniport's simulated-host shell
//! (`sim_shells::hca_miniport`, the Linux counterpart of the KMDF shell) is
//! registered as `hcaminiport` with a [`CountingSink`] per HCA, and a
//! pass-through `ibalbus` filter sits above it as the INF says.

#![allow(dead_code, reason = "each test binary uses part of the support")]

use std::sync::{Arc, Mutex, MutexGuard};

use driver_platform::RequestorMode;
use hca_miniport_core::eq::{DeviceFailure, EventSink, PortViolation, QpEvent, SrqEvent};
use hca_miniport_core::hca::Hca;
use hca_miniport_core::init::HcaConfig;
use hca_miniport_core::verbs::qp::SendRequest;
use ib_types::ioctl::{Response, Verb, decode_response, encode_request, request_len};
use ib_types::qp::{QpCreate, QpType};
use ib_types::scalars::{PortNum, Qpn};
use ib_types::status::{IbStatus, NtStatus};
use ib_types::wr::SendWr;
use sim_hca::device::DeviceConfig;
use sim_host::dma::HostDmaAdapter;
use sim_host::driver::{DeviceCallbacks, DeviceInit, DriverEntry};
use sim_host::host::{Host, HostConfig};
use sim_host::pci::PciFunction;
use sim_host::platform::SimPlatform;
use sim_host::pnp::DeviceServices;
use sim_host::request::{Completion, HostRequest, RequestHandle};
use sim_shells::hca_miniport::{MiniportDevice, MiniportDriver, MiniportOptions};

// Heap calls the drivers make above DISPATCH_LEVEL are violations
// (docs/host-model.md, "Heap above DISPATCH_LEVEL").
sim_host::install_driver_heap_check!();

/// The driver's service name.
pub(crate) const DRIVER: &str = sim_shells::hca_miniport::SERVICE;

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
    /// Port changes seen: (port, active).
    pub(crate) port_changes: Mutex<Vec<(u8, bool)>>,
}

impl EventSink for CountingSink {
    fn completion(&self, cqn: u32) {
        lock(&self.completions).push(cqn);
    }
    fn qp_event(&self, _: Qpn, _: QpEvent) {}
    fn srq_event(&self, _: u32, _: SrqEvent) {}
    fn cq_error(&self, _: u32) {}
    fn port_change(&self, port: PortNum, active: bool) {
        lock(&self.port_changes).push((port.get(), active));
    }
    fn port_violation(&self, _: PortNum, _: PortViolation) {}
    fn device_failed(&self, _: DeviceFailure) {}
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
    /// The miniport, as registered.
    driver: Arc<MiniportDriver<SimPlatform>>,
    /// Each device's sink, in the order the devices were added.
    sinks: Arc<Mutex<Vec<Arc<CountingSink>>>>,
}

impl World {
    /// Deterministic host with seed `seed`.
    pub(crate) fn deterministic(seed: u64) -> Self {
        Self::with_hcas(seed, vec![two_port_hca()], HcaConfig::default())
    }

    /// Deterministic host with seed `seed` and one HCA per device config,
    /// each driven by a core configured with `config`.
    pub(crate) fn with_hcas(seed: u64, devices: Vec<DeviceConfig>, config: HcaConfig) -> Self {
        let host = Host::new(HostConfig::deterministic(seed, devices)).unwrap();
        let sinks: Arc<Mutex<Vec<Arc<CountingSink>>>> = Arc::default();
        let made = sinks.clone();
        let options = MiniportOptions {
            sink: Arc::new(move || {
                let sink = Arc::new(CountingSink::default());
                lock(&made).push(sink.clone());
                sink as Arc<dyn EventSink>
            }),
            ..MiniportOptions::new(config)
        };
        let driver = MiniportDriver::register_with(&host, options);
        host.register_driver("ibalbus", Arc::new(PassThroughFilter));
        host.boot();
        let w = World {
            host,
            driver,
            sinks,
        };
        w.settle();
        for device in w.driver.devices() {
            assert!(matches!(device.started(), Some(Ok(_))), "bring-up failed");
        }
        w
    }

    /// How many device objects the miniport has added (a device PnP
    /// restarted after a failure is added again, at the end).
    pub(crate) fn device_count(&self) -> usize {
        self.driver.devices().len()
    }

    /// The shell's device object of HCA `i` (in the order the devices were
    /// added).
    pub(crate) fn device_at(&self, i: usize) -> Arc<MiniportDevice<SimPlatform>> {
        self.driver.devices()[i].clone()
    }

    /// The core of HCA `i` (in the order the devices were added).
    pub(crate) fn hca_at(&self, i: usize) -> Arc<Hca<SimPlatform>> {
        self.device_at(i).hca().expect("the HCA was created")
    }

    /// The DMA adapter of HCA `i`.
    pub(crate) fn adapter_at(&self, i: usize) -> HostDmaAdapter {
        self.device_at(i).adapter().expect("started")
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
        self.hca_at(0)
    }

    /// The PCI function.
    pub(crate) fn function(&self) -> Arc<PciFunction> {
        self.device_at(0).function().expect("started")
    }

    /// The function's DMA adapter (for test-owned device memory).
    pub(crate) fn adapter(&self) -> HostDmaAdapter {
        self.adapter_at(0)
    }

    /// The outer sink.
    pub(crate) fn sink(&self) -> Arc<CountingSink> {
        lock(&self.sinks)[0].clone()
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

/// `wrs` as the core's send requests, with neither an address vector nor
/// inline data.
pub(crate) fn plain_sends<'a>(wrs: &[SendWr<'a>]) -> Vec<SendRequest<'a>> {
    wrs.iter()
        .map(|wr| SendRequest {
            wr: *wr,
            av: None,
            inline: None,
        })
        .collect()
}

/// A kernel QP of `qp_type` in PD `pd`, sending and receiving on CQ `cq`:
/// 8 WRs and one SGE each way, no inline data, no SRQ, no port, only
/// signaled WRs completing.
pub(crate) fn small_qp_create(qp_type: QpType, pd: u64, cq: u64) -> QpCreate {
    sim_shells::rc_path::rc_qp_create(qp_type, pd, cq, 8)
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
    /// Installs a kernel-memory locker in HCA `i` (the shell already did,
    /// at prepare-hardware; installing again is harmless): the MR verbs
    /// lock kernel pages with it.
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
        self.device_at(i).function().expect("started")
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

// ----- Power transitions (power.rs, catastrophic.rs) ---------------------

impl World {
    /// System sleep (S3): the power manager moves the stacks below D0
    /// (power-managed queues hold requests from then on) and the shell's
    /// D0 exit calls each core's `d0_exit` (PASSIVE_LEVEL).
    pub(crate) fn sleep(&self) {
        self.host
            .pnp()
            .set_system_power(driver_platform::SystemPowerState::S3)
            .expect("nobody vetoes sleep");
        self.settle();
        for i in 0..self.driver.devices().len() {
            assert!(self.hca_at(i).is_below_d0() || self.hca_at(i).failure().is_some());
        }
    }

    /// Resume (S0): the shell's D0 entry calls each core's `d0_entry`,
    /// then the power manager releases the requests it held. A device that
    /// was working before the sleep is working after it.
    pub(crate) fn resume(&self) {
        let failed: Vec<bool> = (0..self.driver.devices().len())
            .map(|i| self.hca_at(i).failure().is_some())
            .collect();
        self.host
            .pnp()
            .set_system_power(driver_platform::SystemPowerState::S0)
            .expect("resume");
        self.settle();
        for (i, was_failed) in failed.into_iter().enumerate() {
            let hca = self.hca_at(i);
            assert!(!hca.is_below_d0(), "HCA {i} is back in D0");
            if !was_failed {
                assert_eq!(hca.failure(), None, "D0 entry of HCA {i}");
                assert!(hca.report().is_some(), "HCA {i} is up");
            }
        }
    }
}

impl World {
    /// A threaded host (`workers` worker threads, devices wired back to
    /// back and run on the threads that touch them) with one HCA per
    /// device config; waits until every HCA is up with both ports active.
    /// Run it with [`Self::call_in_dpc_waiting_at`], not `settle`.
    pub(crate) fn threaded_with_hcas(
        workers: usize,
        devices: Vec<DeviceConfig>,
        config: HcaConfig,
    ) -> Self {
        let count = devices.len();
        let host = Host::new(HostConfig::threaded(workers, devices)).unwrap();
        let sinks: Arc<Mutex<Vec<Arc<CountingSink>>>> = Arc::default();
        let made = sinks.clone();
        let options = MiniportOptions {
            sink: Arc::new(move || {
                let sink = Arc::new(CountingSink::default());
                lock(&made).push(sink.clone());
                sink as Arc<dyn EventSink>
            }),
            ..MiniportOptions::new(config)
        };
        let driver = MiniportDriver::register_with(&host, options);
        host.register_driver("ibalbus", Arc::new(PassThroughFilter));
        host.boot();
        let w = World {
            host,
            driver,
            sinks,
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            w.host.scheduler().quiesce().unwrap();
            let devices = w.driver.devices();
            let up = devices.len() == count
                && devices.iter().all(|d| matches!(d.started(), Some(Ok(_))));
            let sinks = lock(&w.sinks).clone();
            let ports_up = sinks.len() == count
                && sinks.iter().all(|s| {
                    let changes = lock(&s.port_changes);
                    (1..=2).all(|p| changes.iter().rev().find(|c| c.0 == p) == Some(&(p, true)))
                });
            let up = up && ports_up;
            if up {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "bring-up timed out");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        w
    }

    /// Submits `V` to HCA `i` from a DPC and waits (threaded host) for its
    /// completion.
    pub(crate) fn call_in_dpc_waiting_at<V: Verb>(
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
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            if let Some(done) = issuer.completion() {
                return done;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{} timed out",
                V::ID.name()
            );
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
    }

    /// Posts `wrs` ([`plain_sends`]) on QP `qp` of HCA `i` from a DPC, runs
    /// the machine, and returns what `post_send` answered: (posted, status).
    pub(crate) fn post_send_in_dpc(
        &self,
        i: usize,
        qp: u64,
        wrs: Vec<SendWr<'static>>,
    ) -> (usize, IbStatus) {
        let out = Arc::new(Mutex::new(None));
        let (hca, sink) = (self.hca_at(i), out.clone());
        self.in_dpc(move || {
            *lock(&sink) = Some(hca.post_send(qp, &plain_sends(&wrs)));
        });
        self.settle();
        lock(&out).take().unwrap()
    }

    /// The outer sink of HCA `i`.
    pub(crate) fn sink_at(&self, i: usize) -> Arc<CountingSink> {
        lock(&self.sinks)[i].clone()
    }
}

/// Shared start of the two-HCA kernel verbs tests.
pub(crate) mod kernel_pair;

/// The RC QP path to RTS shared by the data-moving tests.
pub(crate) mod rc_path;
