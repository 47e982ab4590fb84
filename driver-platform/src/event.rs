//! Events: what a PASSIVE_LEVEL caller waits on until something running
//! at DISPATCH_LEVEL or below says "done" (a notification `KEVENT`).
//!
//! The core never waits (it runs at DISPATCH_LEVEL); the synchronous
//! wrappers it offers to PASSIVE_LEVEL callers do, on an event the caller
//! owns and arranged to be set when its request completes (on Windows the
//! `Event` argument of `IoBuildDeviceIoControlRequest`).

/// A notification event: once set it stays set until cleared, and every
/// waiter is released.
pub trait Event: Send + Sync {
    /// Sets the event (`KeSetEvent`), releasing the waiters. Callable at
    /// DISPATCH_LEVEL or below.
    fn set(&self);
    /// Clears the event (`KeClearEvent`). Callable at DISPATCH_LEVEL or
    /// below.
    fn clear(&self);
    /// Whether the event is set (`KeReadStateEvent`). Callable at
    /// DISPATCH_LEVEL or below.
    fn is_set(&self) -> bool;
    /// Waits until the event is set (`KeWaitForSingleObject`, no
    /// timeout). PASSIVE_LEVEL only: a wait at DISPATCH_LEVEL would stop
    /// the processor that must run the code that sets it.
    fn wait(&self);
}
