//! I/O requests: the IRP / WDFREQUEST a verb or IOCTL arrives in.

use ib_types::status::NtStatus;

/// Who issued a request: a user-mode caller's buffers and parameters are
/// hostile input; a kernel caller is trusted to the extent of the contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RequestorMode {
    /// A kernel-mode client.
    Kernel,
    /// A user-mode process.
    User,
}

/// An I/O request. Consumed by [`complete`](Request::complete), so it is
/// completed exactly once by its owner; a platform reports a request
/// dropped without completion as a verifier violation.
///
/// Buffers are METHOD_BUFFERED system buffers: the core sees copies, never
/// user addresses.
pub trait Request: Send {
    /// The I/O control code.
    fn ioctl_code(&self) -> u32;
    /// Who issued it.
    fn requestor_mode(&self) -> RequestorMode;
    /// The input buffer.
    fn input(&self) -> &[u8];
    /// The output buffer.
    fn output(&mut self) -> &mut [u8];
    /// Completes the request with `status` and `information` (bytes written
    /// to the output buffer, or a created handle). Callable at DISPATCH_LEVEL
    /// or below.
    fn complete(self, status: NtStatus, information: u64);
    /// True once the issuer asked to cancel; the owner should complete the
    /// request with `STATUS_CANCELLED` soon.
    fn is_canceled(&self) -> bool;
}
