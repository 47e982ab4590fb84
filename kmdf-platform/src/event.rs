//! The current IRQL and the kernel's notification event.

use alloc::boxed::Box;
use core::cell::UnsafeCell;
use core::ptr;

use driver_platform::{Event, Irql, IrqlQuery};
use wdk_sys::ntddk::{
    KeClearEvent, KeGetCurrentIrql, KeInitializeEvent, KeReadStateEvent, KeSetEvent,
    KeWaitForSingleObject,
};
use wdk_sys::{_EVENT_TYPE, _KWAIT_REASON, _MODE, FALSE, KEVENT};

/// `KeGetCurrentIrql`.
#[derive(Debug, Clone, Copy, Default)]
pub struct KeIrql;

impl IrqlQuery for KeIrql {
    fn current_irql(&self) -> Irql {
        // SAFETY: callable at any IRQL.
        let level = unsafe { KeGetCurrentIrql() };
        match level {
            0 => Irql::PASSIVE,
            1 => Irql::APC,
            2 => Irql::DISPATCH,
            n => Irql::device(n),
        }
    }
}

/// A notification `KEVENT` in non-paged pool (boxed: a KEVENT must not
/// move once initialised).
pub struct KernelEvent {
    event: Box<UnsafeCell<KEVENT>>,
}

// SAFETY: a KEVENT is made to be signalled and waited on from any thread;
// it is only touched through the kernel's event routines.
unsafe impl Send for KernelEvent {}
// SAFETY: as above.
unsafe impl Sync for KernelEvent {}

impl core::fmt::Debug for KernelEvent {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("KernelEvent")
            .field("set", &self.is_set())
            .finish()
    }
}

impl Default for KernelEvent {
    fn default() -> Self {
        Self::new()
    }
}

impl KernelEvent {
    /// A cleared notification event.
    pub fn new() -> Self {
        let event = Box::new(UnsafeCell::new(KEVENT::default()));
        // SAFETY: `event` is non-paged (wdk-alloc), pinned in its box for
        // the event's life.
        unsafe { KeInitializeEvent(event.get(), _EVENT_TYPE::NotificationEvent, FALSE as u8) };
        Self { event }
    }

    /// The KEVENT, for `IoBuildDeviceIoControlRequest`'s `Event`.
    pub fn as_ptr(&self) -> *mut KEVENT {
        self.event.get()
    }
}

impl Event for KernelEvent {
    fn set(&self) {
        // SAFETY: an initialised event; DISPATCH_LEVEL or below.
        unsafe { KeSetEvent(self.event.get(), 0, FALSE as u8) };
    }

    fn clear(&self) {
        // SAFETY: as above.
        unsafe { KeClearEvent(self.event.get()) };
    }

    fn is_set(&self) -> bool {
        // SAFETY: as above.
        let state = unsafe { KeReadStateEvent(self.event.get()) };
        state != 0
    }

    fn wait(&self) {
        // SAFETY: an initialised event; PASSIVE_LEVEL (the trait's
        // contract), no timeout.
        let _ = unsafe {
            KeWaitForSingleObject(
                self.event.get().cast(),
                _KWAIT_REASON::Executive,
                _MODE::KernelMode as i8,
                FALSE as u8,
                ptr::null_mut(),
            )
        };
    }
}
