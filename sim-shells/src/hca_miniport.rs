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
//!   `Weak` (the WDF DPC, work item and timer objects), creates one
//!   interrupt object per message, at most [`MAX_MESSAGES`] as the KMDF
//!   shell (`WdfInterruptCreate`: ISR `Hca::isr`,
//!   each with its own DPC running `Hca::dpc`, message 0's being the
//!   device's, which the core queues itself), and installs the
//!   kernel-memory locker for kernel registrations
//!   (`Hca::set_kernel_locker`). It does not touch the device: the host
//!   connects the interrupts only after D0 entry, so an interrupt raised
//!   now would be lost.
//! - `d0_entry` / `d0_exit` (`EvtDeviceD0Entry` / `EvtDeviceD0Exit`):
//!   nothing (KMDF defaults), as in the KMDF shell.
//! - `d0_entry_post_interrupts_enabled` /
//!   `d0_exit_pre_interrupts_disabled`
//!   (`EvtDeviceD0EntryPostInterruptsEnabled` /
//!   `EvtDeviceD0ExitPreInterruptsDisabled`):
//!   [`MiniportDevice::power_up`] / [`MiniportDevice::power_down`], the
//!   one place the start and power entry points of the core are called:
//!   the first time `Hca::start` brings the device up with its ISR
//!   connected; `Hca::d0_exit` keeps every verb object and resets the
//!   device while its interrupts are still connected, `Hca::d0_entry`
//!   brings it up again and restores them (clients' handles stay valid;
//!   the device lost its state in D3).
//! - the core's event sink (`ReportingSink`): every event goes on to the
//!   device's outer sink; a failure only a restart recovers from is
//!   reported with `DeviceServices::set_failed(AttemptRestart)`
//!   (`WdfDeviceSetFailed`, as the KMDF shell's `FailureSink`).
//! - `release_hardware` (`EvtDeviceReleaseHardware`): stops the device if
//!   it still runs (the interrupts were disconnected before D0 exit, and
//!   their DPCs flushed), drops the adapter, and flushes the DPCs, work
//!   item and timer (`DeviceDeferred::flush`), so that nothing of the
//!   driver runs after it unloads; BAR0 must not be touched after it
//!   returns (the host unmaps it).
//! - `io_in_caller_context` (`EvtIoInCallerContext`, in the issuing
//!   thread before the request is queued): a user-mode request that
//!   carries its issuing process (`HostRequest::process`) and arrives at
//!   PASSIVE_LEVEL in that process's context (`sim_host::caller::in_process`)
//!   takes what it needs from the process there:
//!   `Hca::prepare_user_request` with that process as its caller
//!   (`HostCaller`) locks the user buffers the verb will use, maps (OpenCa)
//!   or unmaps (CloseCa) the doorbell page, and the result is kept in the
//!   request's context (`HostRequest::set_context`); the request is then
//!   queued.
//! - `io_request` (`EvtIoDeviceControl` of the power-managed queue, in
//!   whatever context the queue presents the request, e.g. on resume after
//!   being held across sleep): a request with a prepared context goes to
//!   `Hca::execute_user_request`, which uses only what was prepared and
//!   touches no process memory; every other request goes to
//!   `Hca::submit_request` (the verbs decode the code; an unknown one is
//!   `STATUS_INVALID_DEVICE_REQUEST`), where a user request reaches no
//!   user object and touches no user memory.
//! - `io_stop` (`EvtIoStop` of the power-managed queue): a wait the core
//!   holds (`WaitCqEvent`, `GetAsyncEvent`) is acknowledged without
//!   requeue and keeps pending across the power-down; any other request is
//!   left to finish, which the host waits for before D0 exit
//!   (`hca_miniport_core::verbs::on_queue_stop`). No `EvtIoResume`: a
//!   kept wait needs nothing on D0 entry.
//! - `file_create` / `file_cleanup` (`EvtDeviceFileCreate` /
//!   `EvtFileCleanup`): counts each process's open file objects; at the
//!   cleanup of a process's last one, in that process's context, the core
//!   closes every user context it still has (`Hca::close_user_contexts_of`,
//!   waited for), so its doorbell pages are unmapped and its pages
//!   unlocked before the process can exit (`PROCESS_HAS_LOCKED_PAGES`
//!   otherwise).
//! - `query_interface` (`WdfDeviceAddQueryInterface`): answers
//!   `GUID_IB_CI_INTERFACE` asked at the provider's version or above (with
//!   its version, the closest not above: `CiProvider::answer_version`) with
//!   the [`CiProvider`] itself, an `Arc<CiProvider<P>>` in the host's
//!   counted `InterfaceRef` (the KMDF shell hands out the FFI table
//!   `ib_types::interface::CiInterface` over the same provider instead;
//!   see `hca_miniport_core::ci`). The host counts the reference; the
//!   consumer gives it back with `InterfaceRef::dereference`. The
//!   provider's `submit` route (`OwnDeviceRoute`) sends the consumer's
//!   request to this device's own stack
//!   (`DeviceServices::send_to_own_device`, the KMDF shell's `IoCallDriver`
//!   to its device object): it arrives through `io_request` of the
//!   power-managed queue like any IOCTL, held while the device is below
//!   D0 and met by `io_stop` at D0 exit.
//!
//! The shell is generic over the platform so that tests can wrap BAR0
//! (`MiniportOptions::bar0`); everything else is the simulated host's.

use std::any::Any;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use driver_platform::{DevicePowerState, Event, Irql, Platform, Request, RequestorMode};
use hca_miniport_core::ci::{CiProvider, SubmitRoute};
use hca_miniport_core::eq::{DeviceFailure, EventSink, PortViolation, QpEvent, SrqEvent};
use hca_miniport_core::hca::{Hca, HcaResources};
use hca_miniport_core::init::{BringUpReport, HcaConfig, InitError};
use hca_miniport_core::verbs::{OnQueueStop, PreparedUserRequest, on_queue_stop};
use ib_types::interface::{GUID_IB_CI_INTERFACE, InterfaceVersion, WinGuid};
use ib_types::scalars::{PortNum, Qpn};
use ib_types::status::NtStatus;
use sim_host::caller::HostCaller;
use sim_host::dma::{HostDmaAdapter, HostLocker};
use sim_host::driver::{
    DeviceCallbacks, DeviceInit, DriverEntry, Forward, NO_SUCH_DEVICE, ProvidedInterface, SUCCESS,
    UNSUCCESSFUL,
};
use sim_host::event::HostEvent;
use sim_host::file::FileObject;
use sim_host::host::Host;
use sim_host::memory::{AddressSpace, Process};
use sim_host::pci::{InterruptConfig, PciFunction};
use sim_host::platform::SimPlatform;
use sim_host::pnp::{DevNodeId, DeviceFailedAction, DeviceServices};
use sim_host::request::{HostRequest, StoppedRequest};
use sim_host::sched::{DeviceDeferred, SchedulerHandle};

/// The service name `inf/hca-miniport.inf` installs the miniport under.
pub const SERVICE: &str = "hcaminiport";

/// Interrupt messages the shell connects at most, as the KMDF shell
/// (`hca_miniport::kmdf::device`'s `MAX_MESSAGES`): the core uses the
/// first; the rest are connected so the grant is honoured.
pub const MAX_MESSAGES: u16 = 16;

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
            open_files: Mutex::new(BTreeMap::new()),
        });
        lock(&self.devices).push(device.clone());
        Ok(device)
    }
}

/// What a device holds between prepare- and release-hardware.
struct Hardware<P: Platform> {
    hca: Option<Arc<Hca<P>>>,
    /// The interrupts' DPCs, message 0's first (with the device's work
    /// item and timer), flushed at release.
    deferred: Vec<DeviceDeferred>,
    provider: Option<Arc<CiProvider<P>>>,
    function: Option<Arc<PciFunction>>,
    adapter: Option<HostDmaAdapter>,
    started: Option<Result<BringUpReport, InitError>>,
}

impl<P: Platform> Default for Hardware<P> {
    fn default() -> Self {
        Self {
            hca: None,
            deferred: Vec::new(),
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
    /// File objects open on the device, by process id.
    open_files: Mutex<BTreeMap<u32, usize>>,
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

    /// The DPC of each interrupt object, message 0's first, while the
    /// hardware is held (tests: to run several messages' DPCs at once).
    pub fn interrupt_dpcs(&self) -> Vec<DeviceDeferred> {
        lock(&self.state).deferred.clone()
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

    /// Builds the core and creates one interrupt object per MSI-X message
    /// (`WdfInterruptCreate`, as the KMDF shell does in prepare-hardware),
    /// each with its own DPC running `Hca::dpc`: message 0's is the DPC
    /// of the device's `DeviceDeferred` (the one the core queues itself,
    /// as the KMDF shell's `WdfDeferred` queues its first interrupt's
    /// DPC). Returns the core and the DPC objects, message 0's first
    /// (its work item and timer are the device's).
    fn build(
        &self,
        function: &Arc<PciFunction>,
        adapter: &HostDmaAdapter,
    ) -> Option<(Arc<Hca<P>>, Vec<DeviceDeferred>)> {
        let messages = function.message_count().min(MAX_MESSAGES);
        let mut core_deferred = None;
        let hca = Arc::new_cyclic(|weak: &Weak<Hca<P>>| {
            let (work, timer) = (weak.clone(), weak.clone());
            let deferred = DeviceDeferred::new(
                self.sched.clone(),
                SERVICE,
                dpc_routine(weak.clone()),
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
            core_deferred = Some(deferred.clone());
            Hca::new(
                HcaResources {
                    bar0: (self.options.bar0)(function),
                    dma: adapter.clone(),
                    deferred,
                    msix_vectors: messages,
                    free_common: Box::new(|dma: &HostDmaAdapter, buffer| dma.free_common(buffer)),
                },
                self.options.config,
                Arc::new(ReportingSink {
                    outer: self.sink.clone(),
                    host: self.host.clone(),
                }),
            )
        });
        let mut dpcs = vec![core_deferred?];
        for message in 1..messages {
            let idle: Arc<dyn Fn() + Send + Sync> = Arc::new(|| {});
            dpcs.push(DeviceDeferred::new(
                self.sched.clone(),
                SERVICE,
                dpc_routine(Arc::downgrade(&hca)),
                idle.clone(),
                idle,
            ));
            debug_assert_eq!(dpcs.len(), usize::from(message) + 1);
        }
        for (message, dpc) in (0u16..).zip(&dpcs) {
            let isr_hca = Arc::downgrade(&hca);
            function
                .create_interrupt(InterruptConfig {
                    message,
                    // `EvtInterruptIsr`: the core acknowledges and says
                    // whether its DPC must run.
                    isr: Arc::new(move |vector| isr_hca.upgrade().is_some_and(|h| h.isr(vector))),
                    dpc: dpc.clone(),
                    enable: None,
                    disable: None,
                })
                .ok()?;
        }
        Some((hca, dpcs))
    }

    /// `EvtFileCleanup` of a process's last file object on the device, in
    /// its context: the core closes every user context of the process
    /// (`Hca::close_user_contexts_of`: waits cancelled, doorbell pages
    /// unmapped here, objects destroyed, pages unlocked), waited for at
    /// PASSIVE_LEVEL, since the process may exit as soon as this returns.
    fn close_process_contexts(&self, process: &Process) {
        let Some(hca) = self.hca() else {
            return;
        };
        let closed = HostEvent::new(self.sched.clone());
        let set = closed.clone();
        hca.close_user_contexts_of(
            P::caller(&self.kernel_space, process),
            Box::new(move |_left_open| set.set()),
        );
        closed.wait();
    }

    /// Leaving D0, before the interrupts are disabled
    /// (`EvtDeviceD0ExitPreInterruptsDisabled`): the core's `d0_exit`
    /// keeps every verb object and takes the device down with polled
    /// commands (see `hca_miniport_core::verbs::restore`).
    pub fn power_down(&self, _to: DevicePowerState) -> NtStatus {
        if let Some(hca) = self.hca() {
            hca.d0_exit();
        }
        SUCCESS
    }

    /// In D0 with the interrupts connected and enabled
    /// (`EvtDeviceD0EntryPostInterruptsEnabled`): the first time after
    /// prepare-hardware the device is started (`Hca::start`, whose first
    /// EQ interrupts need the ISR); after a D0 exit the core's `d0_entry`
    /// brings it up and restores the objects (success reported to the
    /// power manager either way, so that a device that failed to come
    /// back, which the core then declares failed, can still have its
    /// objects destroyed; the outcome is kept in the state's `started`).
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
        let Some((hca, dpcs)) = self.build(&function, &adapter) else {
            return UNSUCCESSFUL;
        };
        // Kernel registrations lock kernel pages with it (user requests
        // bring their process's locker).
        hca.set_kernel_locker(HostLocker::new(&self.kernel_space, None));
        // Started in `d0_entry_post_interrupts_enabled`, once the
        // interrupts are connected.
        let mut state = lock(&self.state);
        let route = Arc::new(OwnDeviceRoute(self.host.clone()));
        state.provider = Some(Arc::new(CiProvider::new(hca.clone(), route)));
        state.hca = Some(hca);
        state.deferred = dpcs;
        state.function = Some(function);
        state.adapter = Some(adapter);
        SUCCESS
    }

    fn release_hardware(&self) -> NtStatus {
        let (hca, deferred) = {
            let mut state = lock(&self.state);
            state.adapter = None;
            state.provider = None;
            state.function = None;
            (state.hca.take(), std::mem::take(&mut state.deferred))
        };
        // The interrupts were disconnected before D0 exit; the host deletes
        // them after this returns, and unmaps BAR0.
        if let Some(hca) = hca {
            hca.stop();
        }
        // Nothing of the driver may run after it unloads: the work item,
        // the timer and a DPC the core queued itself are flushed now (KMDF
        // flushes a device's DPCs, work item and timer when it deletes
        // them).
        for deferred in deferred {
            deferred.flush();
        }
        SUCCESS
    }

    fn d0_entry_post_interrupts_enabled(&self, from: DevicePowerState) -> NtStatus {
        self.power_up(from)
    }

    fn d0_exit_pre_interrupts_disabled(&self, to: DevicePowerState) -> NtStatus {
        self.power_down(to)
    }

    fn surprise_removal(&self) {
        // EvtDeviceSurpriseRemoval: the core fails over before D0 exit and
        // release-hardware follow.
        if let Some(hca) = self.hca() {
            hca.surprise_removed();
        }
    }

    fn io_in_caller_context(&self, mut req: HostRequest) -> Option<HostRequest> {
        // `EvtIoInCallerContext`: a user-mode request that carries its
        // process, arriving at PASSIVE_LEVEL in the issuing thread, takes
        // what it needs from the process now (`Hca::prepare_user_request`:
        // buffers locked, a doorbell page mapped or unmapped), kept in the
        // request's context; then it is queued
        // (`WdfDeviceEnqueueRequest`). Anything else is queued as it is.
        let Some(hca) = self.hca() else {
            return Some(req);
        };
        let caller = match (req.requestor_mode(), req.process()) {
            (RequestorMode::User, Some(process))
                if sim_host::irql::current() == Irql::PASSIVE
                    && sim_host::caller::in_process(process) =>
            {
                P::caller(&self.kernel_space, process)
            }
            _ => return Some(req),
        };
        let prepared = hca.prepare_user_request(&mut req, &caller);
        req.set_context(prepared);
        Some(req)
    }

    fn io_request(&self, _lower: &dyn Forward, mut req: HostRequest) {
        let Some(hca) = self.hca() else {
            return req.complete(NO_SUCH_DEVICE, 0);
        };
        // `EvtIoDeviceControl` of the power-managed queue, in whatever
        // context the queue presents the request: a user request prepared
        // in its caller's context runs its verb with what was prepared
        // (`Hca::execute_user_request`, touching no process memory);
        // anything else (kernel requests, or a user request without its
        // process, which then reaches no user object) takes the kernel
        // path.
        match req.take_context::<PreparedUserRequest<P>>() {
            Some(prepared) => hca.execute_user_request(req, prepared),
            None => hca.submit_request(req),
        }
    }

    fn io_stop(&self, stopped: &StoppedRequest) {
        // EvtIoStop: a wait stays pending in the core across the power-down
        // (acknowledged, no requeue); every other verb finishes first.
        match on_queue_stop(stopped.ioctl()) {
            OnQueueStop::KeepPending => stopped.acknowledge(),
            OnQueueStop::LetFinish => {}
        }
    }

    fn file_create(&self, file: &FileObject) -> NtStatus {
        *lock(&self.open_files)
            .entry(file.process().pid())
            .or_default() += 1;
        SUCCESS
    }

    fn file_cleanup(&self, file: &FileObject) {
        let pid = file.process().pid();
        let last = {
            let mut open = lock(&self.open_files);
            let count = open.entry(pid).or_default();
            *count = count.saturating_sub(1);
            let last = *count == 0;
            if last {
                open.remove(&pid);
            }
            last
        };
        if last {
            self.close_process_contexts(file.process());
        }
    }

    fn query_interface(&self, guid: &WinGuid, version: u16) -> Option<ProvidedInterface> {
        if *guid != GUID_IB_CI_INTERFACE {
            return None;
        }
        let answered = CiProvider::<P>::answer_version(InterfaceVersion::from_packed(version))?;
        let provider = self.provider()?;
        Some(ProvidedInterface {
            version: answered.packed(),
            // The object is an `Arc<CiProvider<P>>`, so a consumer can keep
            // the provider in its own routines while it holds the reference.
            object: Arc::new(provider) as Arc<dyn Any + Send + Sync>,
        })
    }
}

/// The CI provider's [`SubmitRoute`]: a consumer's request goes to this
/// device's own stack (`DeviceServices::send_to_own_device`, as the KMDF
/// shell's `IoCallDriver` to its device object), so it reaches the core
/// through `io_request` of the power-managed queue, as this driver's own
/// request: held below D0, stopped at D0 exit (`io_stop`), completed by
/// its owner. The host reports completion only through the request.
struct OwnDeviceRoute(DeviceServices);

impl SubmitRoute<HostRequest> for OwnDeviceRoute {
    fn send(&self, request: HostRequest) -> NtStatus {
        self.0.send_to_own_device(request);
        NtStatus::PENDING
    }
}

/// The DPC routine of an interrupt object (`EvtInterruptDpc`): the core's
/// DPC, reached through a `Weak` so the DPC never keeps the core alive.
fn dpc_routine<P: Platform>(hca: Weak<Hca<P>>) -> Arc<dyn Fn() + Send + Sync> {
    Arc::new(move || {
        if let Some(hca) = hca.upgrade() {
            hca.dpc();
        }
    })
}

/// The sink the core reports to: every event goes on to the device's outer
/// sink, and a failure only a restart recovers from is reported to the
/// framework (`WdfDeviceSetFailed` with `AttemptRestart`,
/// `DeviceServices::set_failed`), as the KMDF shell's sink does.
struct ReportingSink {
    outer: Arc<dyn EventSink>,
    host: DeviceServices,
}

impl EventSink for ReportingSink {
    fn completion(&self, cqn: u32) {
        self.outer.completion(cqn);
    }
    fn qp_event(&self, qpn: Qpn, event: QpEvent) {
        self.outer.qp_event(qpn, event);
    }
    fn srq_event(&self, srqn: u32, event: SrqEvent) {
        self.outer.srq_event(srqn, event);
    }
    fn cq_error(&self, cqn: u32) {
        self.outer.cq_error(cqn);
    }
    fn port_change(&self, port: PortNum, active: bool) {
        self.outer.port_change(port, active);
    }
    fn port_violation(&self, port: PortNum, violation: PortViolation) {
        self.outer.port_violation(port, violation);
    }
    fn device_failed(&self, failure: DeviceFailure) {
        self.outer.device_failed(failure);
        if failure.needs_restart() {
            self.host.set_failed(DeviceFailedAction::AttemptRestart);
        }
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
