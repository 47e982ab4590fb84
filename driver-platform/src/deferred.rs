//! Deferred work and time: the DPC, the work item and the timer of a device.
//!
//! The core asks; the platform calls the core's matching entry point later:
//! its DPC routine at DISPATCH_LEVEL, its work routine at PASSIVE_LEVEL, its
//! timer routine at DISPATCH_LEVEL. Asking again before the call coalesces
//! (one DPC, one work item, one timer per device).

/// Deferred work of one device.
pub trait Deferred: Send + Sync {
    /// Queues the device's DPC. Callable at any IRQL (ISRs queue DPCs).
    fn queue_dpc(&self);
    /// Queues the device's work item. Callable at DISPATCH_LEVEL or below.
    fn queue_work_item(&self);
    /// Arms the device's one-shot timer for absolute time `due_ns`, or
    /// cancels it with `None`. Callable at DISPATCH_LEVEL or below.
    fn set_timer(&self, due_ns: Option<u64>);
    /// Monotonic time in nanoseconds. Callable at any IRQL.
    fn now_ns(&self) -> u64;
}
