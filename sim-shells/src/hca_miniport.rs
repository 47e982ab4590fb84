//! The miniport's shell on the simulated Windows host (`sim-host`): the
//! Linux counterpart of the KMDF shell in `kmdf/`, doing for the host's
//! driver model what that one does for WDF, callback for callback. Tests
//! and the main job register it under the service name the INF installs
//! ([`SERVICE`]) and boot the host; the host binds it from
//! `inf/hca-miniport.inf`.
//!
//! What each callback does (KMDF name in brackets):
//! - [`DriverEntry::add_device`] (`EvtDriverDeviceAdd`): a
//!   [`MiniportDevice`] with no hardware yet, remembered by the driver in
//!   the order the devices are added.
//! - `prepare_hardware` (`EvtDevicePrepareHardware`): finds the PCI
//!   function (BAR0 "mapped", the MSI-X message count), takes its DMA
//!   adapter (`WdfDmaEnablerCreate`), builds the `Hca` inside
//!   `Arc::new_cyclic` with one `DeviceDeferred` whose DPC, work item and
//!   timer call `Hca::dpc`, `Hca::work_item` and `Hca::timer` through a
//!   `Weak` (the WDF DPC, work item and timer objects), connects the ISR
//!   (`WdfInterruptCreate`: `Hca::isr`, queueing the DPC when it says
//!   so) *before* starting, installs the kernel-memory locker for kernel
//!   registrations (`Hca::set_kernel_locker`), then brings the device up
//!   (`Hca::start`).
//! - `d0_exit` / `d0_entry` (`EvtDeviceD0Exit` / `EvtDeviceD0Entry`):
//!   [`MiniportDevice::power_down`] / [`MiniportDevice::power_up`], the
//!   one place the power entry points of the core are called:
//!   `Hca::d0_exit` keeps every verb object and resets the device,
//!   `Hca::d0_entry` brings it up again and restores them (clients'
//!   handles stay valid); the first D0 entry after prepare-hardware finds
//!   the device started and does nothing.
//! - `release_hardware` (`EvtDeviceReleaseHardware`): stops the device if
//!   it still runs, disconnects the ISR, drops the adapter, and flushes the
//!   DPC, work item and timer (`DeviceDeferred::flush`), so that nothing of
//!   the driver runs after it unloads.
//! - `io_request` (`EvtIoInCallerContext` + `EvtIoDeviceControl` of the
//!   power-managed queue): a user-mode request that carries its issuing
//!   process (`HostRequest::process`) and arrives at PASSIVE_LEVEL goes to
//!   `Hca::submit_user_request` with that process as its caller
//!   (`HostCaller`); every other request goes to `Hca::submit_request`
//!   (the verbs decode the code; an unknown one is
//!   `STATUS_INVALID_DEVICE_REQUEST`).
//! - `query_interface` (`WdfDeviceAddQueryInterface`): answers
//!   `GUID_IB_CI_INTERFACE` at any version the provider satisfies with
//!   the [`CiProvider`] itself, an `Arc<CiProvider<P>>` in the host's
//!   counted `InterfaceRef` (the KMDF shell hands out the FFI table
//!   `ib_types::interface::CiInterface` over the same provider instead;
//!   see `hca_miniport_core::ci`). The host counts the reference; the
//!   consumer gives it back with `InterfaceRef::dereference`.
//!
//! The shell is generic over the platform so that tests can wrap BAR0
//! (`MiniportOptions::bar0`); everything else is the simulated host's.

use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use driver_platform::{DevicePowerState, Irql, Platform, Request, RequestorMode};
use hca_miniport_core::ci::CiProvider;
use hca_miniport_core::eq::{DeviceFailure, EventSink, PortViolation, QpEvent, SrqEvent};
use hca_miniport_core::hca::{Hca, HcaResources};
use hca_miniport_core::init::{BringUpReport, HcaConfig, InitError};
use ib_types::interface::{GUID_IB_CI_INTERFACE, InterfaceVersion, WinGuid};
use ib_types::scalars::{PortNum, Qpn};
use ib_types::status::NtStatus;
use sim_host::caller::HostCaller;
use sim_host::dma::{HostDmaAdapter, HostLocker};
use sim_host::driver::{
    DeviceCallbacks, DeviceInit, DriverEntry, Forward, NO_SUCH_DEVICE, ProvidedInterface, SUCCESS,
    UNSUCCESSFUL,
};
use sim_host::host::Host;
use sim_host::memory::{AddressSpace, Process};
use sim_host::pci::PciFunction;
use sim_host::platform::SimPlatform;
use sim_host::pnp::{DevNodeId, DeviceServices};
use sim_host::request::HostRequest;
use sim_host::sched::{DeviceDeferred, SchedulerHandle};

/// The service name `inf/hca-miniport.inf` installs the miniport under.
pub const SERVICE: &str = "hcaminiport";

/// What the simulated host's platform must be for this shell: its DMA
/// adapter, deferred work and requests (BAR0 may be wrapped).
pub trait ShellPlatform:
    Platform<
        Dma = HostDmaAdapter,
        Deferred = DeviceDeferred,
        Request = HostRequest,
        Locker = HostLocker,
    >
{
    /// The caller of a user-mode request issued by `process` (its memory
    /// locked with kernel memory in `kernel` beside it).
    fn caller(kernel: &AddressSpace, process: &Process) -> Self::Caller;
}

impl<P, M> ShellPlatform for P
where
    P: Platform<
            Dma = HostDmaAdapter,
            Deferred = DeviceDeferred,
            Request = HostRequest,
            Locker = HostLocker,
            Mmio = M,
            Caller = HostCaller<M>,
        >,
{
    fn caller(kernel: &AddressSpace, process: &Process) -> HostCaller<M> {
        HostCaller::new(kernel, process)
    }
}

/// Builds BAR0 as the platform presents it from the PCI function.
pub type Bar0Fn<P> = Arc<dyn Fn(&Arc<PciFunction>) -> <P as Platform>::Mmio + Send + Sync>;

/// Builds the outer event sink of each new device (the core's verbs route
/// events to their clients first, then pass every event on to it).
pub type SinkFn = Arc<dyn Fn() -> Arc<dyn EventSink> + Send + Sync>;

/// How the driver builds its devices.
pub struct MiniportOptions<P: Platform> {
    /// The core's configuration for every device.
    pub config: HcaConfig,
    /// The outer sink of each device.
    pub sink: SinkFn,
    /// BAR0 of each device.
    pub bar0: Bar0Fn<P>,
}

impl<P: Platform> Clone for MiniportOptions<P> {
    fn clone(&self) -> Self {
        Self {
            config: self.config,
            sink: self.sink.clone(),
            bar0: self.bar0.clone(),
        }
    }
}

impl<P: Platform> std::fmt::Debug for MiniportOptions<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MiniportOptions")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl MiniportOptions<SimPlatform> {
    /// `config`, a [`ShellSink`] per device, BAR0 as the function has it.
    pub fn new(config: HcaConfig) -> Self {
        Self {
            config,
            sink: Arc::new(|| Arc::new(ShellSink::default()) as Arc<dyn EventSink>),
            bar0: Arc::new(|function: &Arc<PciFunction>| function.bar0()),
        }
    }
}

/// The driver: `DriverEntry` state, and every device it added.
pub struct MiniportDriver<P: Platform> {
    sched: SchedulerHandle,
    /// Kernel memory, for the locker of kernel registrations.
    kernel_space: AddressSpace,
    options: MiniportOptions<P>,
    devices: Mutex<Vec<Arc<MiniportDevice<P>>>>,
}

impl<P: Platform> std::fmt::Debug for MiniportDriver<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MiniportDriver")
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl MiniportDriver<SimPlatform> {
    /// Registers the miniport on `host` under [`SERVICE`] with `config`
    /// (replacing a stand-in registered there before); returns the
    /// driver, through which the devices it adds can be reached.
    pub fn register(host: &Host, config: HcaConfig) -> Arc<Self> {
        Self::register_with(host, MiniportOptions::new(config))
    }
}

impl<P: ShellPlatform> MiniportDriver<P> {
    /// Registers the miniport on `host` under [`SERVICE`] with `options`.
    pub fn register_with(host: &Host, options: MiniportOptions<P>) -> Arc<Self> {
        let driver = Arc::new(Self {
            sched: host.scheduler_handle(),
            kernel_space: host.pool().kernel_space().clone(),
            options,
            devices: Mutex::new(Vec::new()),
        });
        host.register_driver(SERVICE, driver.clone());
        driver
    }

    /// The devices added so far, in the order they were added.
    pub fn devices(&self) -> Vec<Arc<MiniportDevice<P>>> {
        lock(&self.devices).clone()
    }
}

impl<P: ShellPlatform> DriverEntry for MiniportDriver<P> {
    fn add_device(
        &self,
        _init: &DeviceInit,
        host: &DeviceServices,
    ) -> Result<Arc<dyn DeviceCallbacks>, NtStatus> {
        let device = Arc::new(MiniportDevice {
            host: host.clone(),
            sched: self.sched.clone(),
            kernel_space: self.kernel_space.clone(),
            options: self.options.clone(),
            sink: (self.options.sink)(),
            state: Mutex::new(Hardware::default()),
        });
        lock(&self.devices).push(device.clone());
        Ok(device)
    }
}

/// What a device holds between prepare- and release-hardware.
struct Hardware<P: Platform> {
    hca: Option<Arc<Hca<P>>>,
    /// The device's DPC, work item and timer, flushed at release.
    deferred: Option<DeviceDeferred>,
    provider: Option<Arc<CiProvider<P>>>,
    function: Option<Arc<PciFunction>>,
    adapter: Option<HostDmaAdapter>,
    started: Option<Result<BringUpReport, InitError>>,
}

impl<P: Platform> Default for Hardware<P> {
    fn default() -> Self {
        Self {
            hca: None,
            deferred: None,
            provider: None,
            function: None,
            adapter: None,
            started: None,
        }
    }
}

/// One HCA function's device object.
pub struct MiniportDevice<P: Platform> {
    host: DeviceServices,
    sched: SchedulerHandle,
    kernel_space: AddressSpace,
    options: MiniportOptions<P>,
    sink: Arc<dyn EventSink>,
    state: Mutex<Hardware<P>>,
}

impl<P: Platform> std::fmt::Debug for MiniportDevice<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MiniportDevice")
            .field("node", &self.host.node())
            .finish_non_exhaustive()
    }
}

impl<P: ShellPlatform> MiniportDevice<P> {
    /// The devnode.
    pub fn node(&self) -> DevNodeId {
        self.host.node()
    }

    /// The core, once prepare-hardware built it.
    pub fn hca(&self) -> Option<Arc<Hca<P>>> {
        lock(&self.state).hca.clone()
    }

    /// The CI provider, once prepare-hardware built it.
    pub fn provider(&self) -> Option<Arc<CiProvider<P>>> {
        lock(&self.state).provider.clone()
    }

    /// The PCI function, while the hardware is held.
    pub fn function(&self) -> Option<Arc<PciFunction>> {
        lock(&self.state).function.clone()
    }

    /// The DMA adapter, while the hardware is held.
    pub fn adapter(&self) -> Option<HostDmaAdapter> {
        lock(&self.state).adapter.clone()
    }

    /// How the last bring-up went.
    pub fn started(&self) -> Option<Result<BringUpReport, InitError>> {
        lock(&self.state).started
    }

    /// The outer event sink.
    pub fn sink(&self) -> Arc<dyn EventSink> {
        self.sink.clone()
    }

    /// Builds the core and connects the ISR; returns the core and its
    /// deferred work.
    fn build(
        &self,
        function: &Arc<PciFunction>,
        adapter: &HostDmaAdapter,
    ) -> Option<(Arc<Hca<P>>, DeviceDeferred)> {
        let mut isr_deferred = None;
        let hca = Arc::new_cyclic(|weak: &Weak<Hca<P>>| {
            let (dpc, work, timer) = (weak.clone(), weak.clone(), weak.clone());
            let deferred = DeviceDeferred::new(
                self.sched.clone(),
                SERVICE,
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
                    bar0: (self.options.bar0)(function),
                    dma: adapter.clone(),
                    deferred,
                    msix_vectors: function.message_count(),
                    free_common: Box::new(|dma: &HostDmaAdapter, buffer| dma.free_common(buffer)),
                },
                self.options.config,
                self.sink.clone(),
            )
        });
        let deferred = isr_deferred?;
        let (isr_deferred, isr_hca) = (deferred.clone(), Arc::downgrade(&hca));
        function
            .connect_interrupt(move |vector| {
                if isr_hca.upgrade().is_some_and(|hca| hca.isr(vector)) {
                    isr_deferred.insert_dpc();
                }
            })
            .ok()?;
        Some((hca, deferred))
    }

    /// Leaving D0 (`EvtDeviceD0Exit`): the core's `d0_exit` keeps every
    /// verb object and takes the device down (see
    /// `hca_miniport_core::verbs::restore`).
    pub fn power_down(&self, _to: DevicePowerState) -> NtStatus {
        if let Some(hca) = self.hca() {
            hca.d0_exit();
        }
        SUCCESS
    }

    /// Returning to D0 (`EvtDeviceD0Entry`): after a D0 exit the core's
    /// `d0_entry` brings the device up and restores the objects (success
    /// reported to the power manager either way, so that a device that
    /// failed to come back, which the core then declares failed, can
    /// still have its objects destroyed; the outcome is kept in the
    /// state's `started`); the first D0 entry after prepare-hardware finds
    /// the device started and leaves it; a stopped device is started
    /// afresh.
    pub fn power_up(&self, _from: DevicePowerState) -> NtStatus {
        let Some(hca) = self.hca() else {
            return UNSUCCESSFUL;
        };
        if hca.report().is_some() {
            return SUCCESS;
        }
        if hca.is_below_d0() {
            let entered = hca.d0_entry();
            lock(&self.state).started = Some(entered.and_then(|()| {
                hca.report()
                    .ok_or(InitError::Capabilities("no report after D0 entry"))
            }));
            return SUCCESS;
        }
        if hca.failure().is_some() {
            // A failed device stays down until PnP restarts it.
            return SUCCESS;
        }
        let started = hca.start();
        let ok = started.is_ok();
        lock(&self.state).started = Some(started);
        if ok { SUCCESS } else { UNSUCCESSFUL }
    }
}

impl<P: ShellPlatform> DeviceCallbacks for MiniportDevice<P> {
    fn prepare_hardware(&self) -> NtStatus {
        let Some(function) = self.host.resources::<PciFunction>() else {
            return UNSUCCESSFUL;
        };
        // The KMDF shell's enabler declares the same maximum transfer.
        let description = sim_host::dma::DmaDescription {
            maximum_length: hca_miniport_core::mr::MAX_DMA_TRANSFER,
        };
        let adapter = match function.dma_adapter_for(description) {
            Ok(adapter) => adapter,
            Err(status) => return status,
        };
        let Some((hca, deferred)) = self.build(&function, &adapter) else {
            return UNSUCCESSFUL;
        };
        // Kernel registrations lock kernel pages with it (user requests
        // bring their process's locker).
        hca.set_kernel_locker(HostLocker::new(&self.kernel_space, None));
        let started = hca.start();
        let ok = started.is_ok();
        let mut state = lock(&self.state);
        state.provider = Some(Arc::new(CiProvider::new(hca.clone())));
        state.started = Some(started);
        state.hca = Some(hca);
        state.deferred = Some(deferred);
        state.function = Some(function);
        state.adapter = Some(adapter);
        if ok { SUCCESS } else { UNSUCCESSFUL }
    }

    fn release_hardware(&self) -> NtStatus {
        let (hca, deferred, function) = {
            let mut state = lock(&self.state);
            state.adapter = None;
            state.provider = None;
            (
                state.hca.take(),
                state.deferred.take(),
                state.function.take(),
            )
        };
        if let Some(hca) = hca {
            hca.stop();
        }
        if let Some(function) = function {
            function.disconnect_interrupt();
        }
        // Nothing of the driver may run after it unloads: what the device
        // raised while stopping is flushed now (KMDF flushes a device's
        // DPC, work item and timer when it deletes them).
        if let Some(deferred) = deferred {
            deferred.flush();
        }
        SUCCESS
    }

    fn d0_entry(&self, from: DevicePowerState) -> NtStatus {
        self.power_up(from)
    }

    fn d0_exit(&self, to: DevicePowerState) -> NtStatus {
        self.power_down(to)
    }

    fn surprise_removal(&self) {
        // EvtDeviceSurpriseRemoval: the core fails over before D0 exit and
        // release-hardware follow.
        if let Some(hca) = self.hca() {
            hca.surprise_removed();
        }
    }

    fn io_request(&self, _lower: &dyn Forward, req: HostRequest) {
        let Some(hca) = self.hca() else {
            return req.complete(NO_SUCH_DEVICE, 0);
        };
        // `EvtIoInCallerContext`: a user-mode request that carries its
        // process, arriving at PASSIVE_LEVEL in the issuing thread, goes to
        // the user path with that process as its caller. Anything else
        // (kernel requests, or a user request without its process, which
        // then reaches no user object) takes the kernel path.
        let caller = match (req.requestor_mode(), req.process()) {
            (RequestorMode::User, Some(process)) if sim_host::irql::current() == Irql::PASSIVE => {
                Some(P::caller(&self.kernel_space, process))
            }
            _ => None,
        };
        match caller {
            Some(caller) => hca.submit_user_request(req, caller),
            None => hca.submit_request(req),
        }
    }

    fn query_interface(&self, guid: &WinGuid, version: u16) -> Option<ProvidedInterface> {
        if *guid != GUID_IB_CI_INTERFACE
            || CiProvider::<P>::check_version(InterfaceVersion::from_packed(version)).is_err()
        {
            return None;
        }
        let provider = self.provider()?;
        Some(ProvidedInterface {
            version: CiProvider::<P>::VERSION.packed(),
            // The object is an `Arc<CiProvider<P>>`, so a consumer can keep
            // the provider in its own routines while it holds the reference.
            object: Arc::new(provider) as Arc<dyn Any + Send + Sync>,
        })
    }
}

/// The outer sink of the shell's devices: counts what reaches it (a
/// production shell would trace; the verbs already routed every event to
/// its client).
#[derive(Debug, Default)]
pub struct ShellSink {
    events: AtomicU64,
    failures: AtomicU64,
}

impl ShellSink {
    /// Events seen.
    pub fn events(&self) -> u64 {
        self.events.load(Ordering::Relaxed)
    }

    /// Device failures seen.
    pub fn failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }

    fn note(&self) {
        self.events.fetch_add(1, Ordering::Relaxed);
    }
}

impl EventSink for ShellSink {
    fn completion(&self, _: u32) {
        self.note();
    }
    fn qp_event(&self, _: Qpn, _: QpEvent) {
        self.note();
    }
    fn srq_event(&self, _: u32, _: SrqEvent) {
        self.note();
    }
    fn cq_error(&self, _: u32) {
        self.note();
    }
    fn port_change(&self, _: PortNum, _: bool) {
        self.note();
    }
    fn port_violation(&self, _: PortNum, _: PortViolation) {
        self.note();
    }
    fn device_failed(&self, _: DeviceFailure) {
        self.note();
        self.failures.fetch_add(1, Ordering::Relaxed);
    }
}
