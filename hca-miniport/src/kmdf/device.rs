//! The device's shell state and its PnP/power callbacks:
//! `EvtDevicePrepareHardware`, `EvtDeviceReleaseHardware`,
//! `EvtDeviceD0Entry`/`Exit` and the interrupt-aware power callbacks.
//!
//! The framework connects a device's interrupts only *after*
//! `EvtDeviceD0Entry`, and the core must have its ISR connected before
//! `Hca::start` (or the first EQ interrupts are lost). So prepare-hardware
//! maps BAR0, creates the interrupts and builds the `Hca`, and the device
//! is started in `EvtDeviceD0EntryPostInterruptsEnabled` and stopped in
//! `EvtDeviceD0ExitPreInterruptsDisabled` — [`DeviceShell::power_up`] and
//! [`DeviceShell::power_down`], the one place the core's start and power
//! entry points are called. The simulated shell
//! (`sim_shells::hca_miniport`) does the same, callback for callback, on a
//! host that connects interrupts in the same order.

use alloc::boxed::Box;
use alloc::collections::BTreeMap;
use alloc::sync::Arc;
use alloc::vec::Vec;
use core::ptr;
use core::sync::atomic::{AtomicPtr, Ordering};

use driver_platform::SpinLock;
use hca_miniport_core::ci::CiProvider;
use hca_miniport_core::eq::{DeviceFailure, EventSink, PortViolation, QpEvent, SrqEvent};
use hca_miniport_core::hca::{Hca, HcaResources};
use hca_miniport_core::init::HcaConfig;
use ib_types::scalars::{PortNum, Qpn};
use wdk_sys::ntddk::{MmMapIoSpaceEx, MmUnmapIoSpace};
use wdk_sys::{
    _WDF_DEVICE_FAILED_ACTION, BOOLEAN, NTSTATUS, PAGE_NOCACHE, PAGE_READWRITE, SIZE_T,
    STATUS_DEVICE_CONFIGURATION_ERROR, STATUS_SUCCESS, STATUS_UNSUCCESSFUL, TRUE,
    WDF_INTERRUPT_CONFIG, WDF_NO_OBJECT_ATTRIBUTES, WDF_POWER_DEVICE_STATE, WDFCMRESLIST,
    WDFDEVICE, WDFINTERRUPT, WDFTIMER, WDFWORKITEM, call_unsafe_wdf_function_binding,
};

use super::context::shell_of;
use super::interface;
use super::interrupt::{evt_interrupt_dpc, evt_interrupt_isr};
use super::platform::{Bar0, MdlLocker, WdfDeferred, WdfDma, WdfPlatform};

/// `CmResourceTypeInterrupt`.
const CM_RESOURCE_TYPE_INTERRUPT: u8 = 2;
/// `CmResourceTypeMemory`.
const CM_RESOURCE_TYPE_MEMORY: u8 = 3;
/// `CM_RESOURCE_INTERRUPT_MESSAGE`.
const CM_RESOURCE_INTERRUPT_MESSAGE: u16 = 0x0002;
/// Interrupt messages the shell connects (the core uses vector 0; the
/// rest are connected so the PnP manager's grant is honoured).
const MAX_MESSAGES: usize = 16;

/// What prepare-hardware built, released by release-hardware.
struct Hardware {
    hca: Option<Arc<Hca<WdfPlatform>>>,
    provider: Option<Arc<interface::Provider>>,
    /// The BAR0 mapping and its length in bytes.
    bar0: Option<(*mut u8, SIZE_T)>,
    interrupts: Vec<WDFINTERRUPT>,
}

// SAFETY: the raw BAR0 pointer and interrupt handles are only used from
// PnP/power callbacks, which the framework serialises.
unsafe impl Send for Hardware {}

/// The shell state of one HCA device object (owned by its context).
pub struct DeviceShell {
    /// The device.
    pub device: WDFDEVICE,
    /// The DMA enabler.
    pub dma: WdfDma,
    /// The work item.
    pub work_item: WDFWORKITEM,
    /// The command watchdog's timer.
    pub timer: WDFTIMER,
    state: SpinLock<WdfPlatform, Hardware>,
    /// The core as the ISR reaches it, without a lock (a spin lock cannot
    /// be taken at DIRQL): an `Arc::into_raw` pointer set in
    /// prepare-hardware before the framework connects the interrupts, and
    /// released in release-hardware after it disconnected them.
    isr_hca: AtomicPtr<Hca<WdfPlatform>>,
    /// File objects open on the device, by process id (`file`).
    open_files: SpinLock<WdfPlatform, BTreeMap<u64, usize>>,
}

impl core::fmt::Debug for DeviceShell {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("DeviceShell")
            .field("device", &self.device)
            .field("prepared", &self.hca().is_some())
            .finish_non_exhaustive()
    }
}

// SAFETY: WDF handles are valid from any thread; the mutable state is
// behind a spin lock.
unsafe impl Send for DeviceShell {}
// SAFETY: as above.
unsafe impl Sync for DeviceShell {}

impl DeviceShell {
    /// The shell of a device whose enabler, work item and timer
    /// `EvtDriverDeviceAdd` created.
    pub fn new(device: WDFDEVICE, dma: WdfDma, work_item: WDFWORKITEM, timer: WDFTIMER) -> Self {
        Self {
            device,
            dma,
            work_item,
            timer,
            state: SpinLock::<WdfPlatform, _>::new(Hardware {
                hca: None,
                provider: None,
                bar0: None,
                interrupts: Vec::new(),
            }),
            isr_hca: AtomicPtr::new(ptr::null_mut()),
            open_files: SpinLock::<WdfPlatform, _>::new(BTreeMap::new()),
        }
    }

    /// `EvtDeviceFileCreate` of `process`: one more file object open.
    pub fn file_opened(&self, process: u64) {
        *self.open_files.lock().entry(process).or_default() += 1;
    }

    /// `EvtFileCleanup` of `process`: one file object fewer; true when it
    /// was the process's last on the device.
    pub fn file_cleaned_up(&self, process: u64) -> bool {
        let mut open = self.open_files.lock();
        let Some(count) = open.get_mut(&process) else {
            return true;
        };
        *count = count.saturating_sub(1);
        if *count > 0 {
            return false;
        }
        open.remove(&process);
        true
    }

    /// The ISR's entry: `Hca::isr` without taking a lock or a reference.
    /// Callable at DIRQL.
    pub fn isr(&self, message_id: u16) -> bool {
        let hca = self.isr_hca.load(Ordering::Acquire);
        if hca.is_null() {
            return false;
        }
        // SAFETY: a non-null pointer is an `Arc<Hca>` reference this shell
        // holds from prepare-hardware until release-hardware, which runs
        // only after the framework disconnected the interrupts (field
        // doc), so it outlives every ISR.
        unsafe { &*hca }.isr(message_id)
    }

    /// The core, while prepared.
    pub fn hca(&self) -> Option<Arc<Hca<WdfPlatform>>> {
        self.state.lock().hca.clone()
    }

    /// The CI provider, while prepared.
    pub fn provider(&self) -> Option<Arc<interface::Provider>> {
        self.state.lock().provider.clone()
    }

    /// The device leaves its working state (before its interrupts are
    /// disconnected): `Hca::d0_exit` keeps every verb object and resets
    /// the device (polled commands, no interrupt needed).
    pub fn power_down(&self) -> NTSTATUS {
        if let Some(hca) = self.hca() {
            hca.d0_exit();
        }
        STATUS_SUCCESS
    }

    /// The device returns to its working state, interrupts connected: the
    /// first time after prepare-hardware `Hca::start`, after a D0 exit
    /// `Hca::d0_entry` (objects restored; success reported either way, so
    /// that a device that failed to come back, declared failed by the
    /// core, can still have its objects destroyed).
    pub fn power_up(&self) -> NTSTATUS {
        let Some(hca) = self.hca() else {
            return STATUS_UNSUCCESSFUL;
        };
        if hca.report().is_some() {
            return STATUS_SUCCESS;
        }
        if hca.is_below_d0() {
            let _ = hca.d0_entry();
            return STATUS_SUCCESS;
        }
        if hca.failure().is_some() {
            // A failed device stays down until PnP restarts it.
            return STATUS_SUCCESS;
        }
        match hca.start() {
            Ok(_) => STATUS_SUCCESS,
            Err(_) => STATUS_DEVICE_CONFIGURATION_ERROR,
        }
    }
}

/// `EvtDevicePrepareHardware`: maps BAR0, creates one interrupt per MSI-X
/// message, builds the core and its CI provider.
///
/// # Safety
/// A KMDF callback: called only by the framework, with the live device
/// `evt_driver_device_add` created.
pub unsafe extern "C" fn evt_prepare_hardware(
    device: WDFDEVICE,
    resources_raw: WDFCMRESLIST,
    resources_translated: WDFCMRESLIST,
) -> NTSTATUS {
    // SAFETY: the framework calls this on a live device created by
    // `evt_driver_device_add`.
    let Some(shell) = (unsafe { shell_of(device) }) else {
        return STATUS_UNSUCCESSFUL;
    };
    // SAFETY: a live resource list for the duration of the callback.
    let count = unsafe {
        call_unsafe_wdf_function_binding!(WdfCmResourceListGetCount, resources_translated)
    };
    let mut bar0 = None;
    let mut interrupts = Vec::new();
    for index in 0..count {
        // SAFETY: `index` < count of the live list.
        let translated = unsafe {
            call_unsafe_wdf_function_binding!(
                WdfCmResourceListGetDescriptor,
                resources_translated,
                index
            )
        };
        if translated.is_null() {
            continue;
        }
        // SAFETY: a non-null descriptor the framework owns for the callback.
        let descriptor = unsafe { &*translated };
        let kind = descriptor.Type;
        if kind == CM_RESOURCE_TYPE_MEMORY && bar0.is_none() {
            // SAFETY: `Type` says the `Memory` member of the union is the
            // live one.
            let memory = unsafe { descriptor.u.Memory };
            let length = SIZE_T::from(memory.Length);
            // SAFETY: the PnP manager assigned this range to the device;
            // non-cached read/write is how registers are mapped.
            let base =
                unsafe { MmMapIoSpaceEx(memory.Start, length, PAGE_READWRITE | PAGE_NOCACHE) };
            if base.is_null() {
                return STATUS_UNSUCCESSFUL;
            }
            bar0 = Some((base.cast::<u8>(), length));
        } else if kind == CM_RESOURCE_TYPE_INTERRUPT && interrupts.len() < MAX_MESSAGES {
            if descriptor.Flags & CM_RESOURCE_INTERRUPT_MESSAGE == 0 {
                continue;
            }
            // SAFETY: the raw list has the same layout and count.
            let raw = unsafe {
                call_unsafe_wdf_function_binding!(
                    WdfCmResourceListGetDescriptor,
                    resources_raw,
                    index
                )
            };
            let mut config = WDF_INTERRUPT_CONFIG {
                Size: size_of::<WDF_INTERRUPT_CONFIG>() as u32,
                EvtInterruptIsr: Some(evt_interrupt_isr),
                EvtInterruptDpc: Some(evt_interrupt_dpc),
                InterruptRaw: raw,
                InterruptTranslated: translated,
                ..WDF_INTERRUPT_CONFIG::default()
            };
            let mut interrupt: WDFINTERRUPT = ptr::null_mut();
            // SAFETY: creating interrupts in prepare-hardware with their
            // descriptors is allowed (KMDF 1.11+); out pointer valid.
            let status = unsafe {
                call_unsafe_wdf_function_binding!(
                    WdfInterruptCreate,
                    device,
                    &mut config,
                    WDF_NO_OBJECT_ATTRIBUTES,
                    &mut interrupt
                )
            };
            if status < 0 {
                return status;
            }
            interrupts.push(interrupt);
        }
    }
    let (Some((base, len)), Some(&first)) = (bar0, interrupts.first()) else {
        return STATUS_DEVICE_CONFIGURATION_ERROR;
    };
    // SAFETY: `base` maps `len` bytes of BAR0 until release-hardware, which
    // stops the core before unmapping.
    let mmio = unsafe { Bar0::new(base, len) };
    let dma = shell.dma;
    let hca = Arc::new(Hca::new(
        HcaResources {
            bar0: mmio,
            dma,
            deferred: WdfDeferred::new(first, shell.work_item, shell.timer),
            msix_vectors: interrupts.len() as u16,
            free_common: Box::new(|dma: &WdfDma, buffer| dma.free_common(buffer)),
        },
        HcaConfig::default(),
        Arc::new(FailureSink { device }),
    ));
    // Kernel registrations lock pages with it (not implemented yet: it
    // answers STATUS_NOT_SUPPORTED; see `platform`).
    hca.set_kernel_locker(MdlLocker::kernel());
    // Before the framework connects the interrupts (after this callback).
    let previous = shell
        .isr_hca
        .swap(Arc::into_raw(hca.clone()).cast_mut(), Ordering::AcqRel);
    if !previous.is_null() {
        // SAFETY: a reference an earlier prepare-hardware left (none should).
        drop(unsafe { Arc::from_raw(previous) });
    }
    let mut state = shell.state.lock();
    let route = Arc::new(interface::DeviceObjectRoute::new(device));
    state.provider = Some(Arc::new(CiProvider::new(hca.clone(), route)));
    state.hca = Some(hca);
    state.bar0 = Some((base, len));
    state.interrupts = interrupts;
    STATUS_SUCCESS
}

/// `EvtDeviceReleaseHardware`: stops the core if it still runs, waits for
/// a running timer or work item routine, then unmaps BAR0. The framework
/// deletes the interrupts.
///
/// # Safety
/// A KMDF callback: called only by the framework, with the live device
/// `evt_driver_device_add` created.
pub unsafe extern "C" fn evt_release_hardware(
    device: WDFDEVICE,
    _resources_translated: WDFCMRESLIST,
) -> NTSTATUS {
    // SAFETY: as in `evt_prepare_hardware`.
    let Some(shell) = (unsafe { shell_of(device) }) else {
        return STATUS_SUCCESS;
    };
    let (hca, bar0) = {
        let mut state = shell.state.lock();
        state.provider = None;
        state.interrupts.clear();
        (state.hca.take(), state.bar0.take())
    };
    if let Some(hca) = hca {
        hca.stop();
    }
    // The timer and work item routines reach the core, and through it
    // BAR0: let any running one finish before the unmapping. Started from
    // now on, they find no core (taken above) and do nothing.
    // SAFETY: the device's timer, live until the device is deleted;
    // PASSIVE_LEVEL, not from the timer's own routine.
    let _ =
        unsafe { call_unsafe_wdf_function_binding!(WdfTimerStop, shell.timer, TRUE as BOOLEAN) };
    // SAFETY: the device's work item, live until the device is deleted;
    // PASSIVE_LEVEL, not from the work item's own routine.
    unsafe { call_unsafe_wdf_function_binding!(WdfWorkItemFlush, shell.work_item) };
    // The framework disconnected the interrupts before this callback.
    let isr_hca = shell.isr_hca.swap(ptr::null_mut(), Ordering::AcqRel);
    if !isr_hca.is_null() {
        // SAFETY: the reference prepare-hardware stored; no ISR can run.
        drop(unsafe { Arc::from_raw(isr_hca) });
    }
    if let Some((base, len)) = bar0 {
        // SAFETY: the mapping made in prepare-hardware; the core, the only
        // user, has stopped.
        unsafe { MmUnmapIoSpace(base.cast(), len) };
    }
    STATUS_SUCCESS
}

/// `EvtDeviceD0Entry`: nothing to do before the interrupts are connected.
///
/// # Safety
/// A KMDF callback: called only by the framework, with the live device
/// `evt_driver_device_add` created.
pub unsafe extern "C" fn evt_d0_entry(
    _device: WDFDEVICE,
    _from: WDF_POWER_DEVICE_STATE,
) -> NTSTATUS {
    STATUS_SUCCESS
}

/// `EvtDeviceD0Exit`: the device was stopped before its interrupts were
/// disconnected.
///
/// # Safety
/// A KMDF callback: called only by the framework, with the live device
/// `evt_driver_device_add` created.
pub unsafe extern "C" fn evt_d0_exit(_device: WDFDEVICE, _to: WDF_POWER_DEVICE_STATE) -> NTSTATUS {
    STATUS_SUCCESS
}

/// `EvtDeviceSurpriseRemoval`: the device is gone; the core fails over
/// (`Hca::surprise_removed`: outstanding requests answered, posted work
/// flushed, the client told) before D0 exit and release-hardware follow.
///
/// # Safety
/// A KMDF callback: called only by the framework, with the live device
/// `evt_driver_device_add` created.
pub unsafe extern "C" fn evt_surprise_removal(device: WDFDEVICE) {
    // SAFETY: as in `evt_prepare_hardware`.
    if let Some(hca) = unsafe { shell_of(device) }.and_then(|shell| shell.hca()) {
        hca.surprise_removed();
    }
}

/// `EvtDeviceD0EntryPostInterruptsEnabled`: starts the device.
///
/// # Safety
/// A KMDF callback: called only by the framework, with the live device
/// `evt_driver_device_add` created.
pub unsafe extern "C" fn evt_d0_entry_post_interrupts(
    device: WDFDEVICE,
    _from: WDF_POWER_DEVICE_STATE,
) -> NTSTATUS {
    // SAFETY: as in `evt_prepare_hardware`.
    match unsafe { shell_of(device) } {
        Some(shell) => shell.power_up(),
        None => STATUS_UNSUCCESSFUL,
    }
}

/// `EvtDeviceD0ExitPreInterruptsDisabled`: stops the device.
///
/// # Safety
/// A KMDF callback: called only by the framework, with the live device
/// `evt_driver_device_add` created.
pub unsafe extern "C" fn evt_d0_exit_pre_interrupts(
    device: WDFDEVICE,
    _to: WDF_POWER_DEVICE_STATE,
) -> NTSTATUS {
    // SAFETY: as in `evt_prepare_hardware`.
    match unsafe { shell_of(device) } {
        Some(shell) => shell.power_down(),
        None => STATUS_SUCCESS,
    }
}

/// The outer sink: the verbs already routed every event to its client;
/// what is left is a device failure, which a driver must report with
/// `WdfDeviceSetFailed` when it cannot recover: only a restart (reset and
/// bring-up) does, so `WdfDeviceFailedAttemptRestart` (a surprise removal
/// is the framework's own doing and is not reported). The simulated
/// shell's sink does the same through `DeviceServices::set_failed`.
struct FailureSink {
    device: WDFDEVICE,
}

// SAFETY: a WDFDEVICE handle may be used from any thread, and this one is
// used only while the device lives: the core reports a failure only from
// its DPC, timer, D0 entry or surprise-removal path, all of which end by
// release-hardware (the core is stopped there, and the framework deletes
// the interrupts, timer and work item with the device, after it).
unsafe impl Send for FailureSink {}
// SAFETY: as above; the sink only reads the handle.
unsafe impl Sync for FailureSink {}

impl EventSink for FailureSink {
    fn completion(&self, _: u32) {}
    fn qp_event(&self, _: Qpn, _: QpEvent) {}
    fn srq_event(&self, _: u32, _: SrqEvent) {}
    fn cq_error(&self, _: u32) {}
    fn port_change(&self, _: PortNum, _: bool) {}
    fn port_violation(&self, _: PortNum, _: PortViolation) {}
    fn device_failed(&self, failure: DeviceFailure) {
        if failure.needs_restart() {
            // SAFETY: the live device (see the Send impl); called at
            // DISPATCH_LEVEL or below, as WdfDeviceSetFailed allows.
            unsafe {
                call_unsafe_wdf_function_binding!(
                    WdfDeviceSetFailed,
                    self.device,
                    _WDF_DEVICE_FAILED_ACTION::WdfDeviceFailedAttemptRestart
                )
            }
        }
    }
}
