//! A `WDFREQUEST` as the cores' `driver_platform::Request`.

use alloc::vec::Vec;
use core::ffi::c_void;
use core::ptr;

use driver_platform::{NtStatus, Request, RequestorMode};
use wdk_sys::{WDFREQUEST, call_unsafe_wdf_function_binding};

/// A `WDFREQUEST` with METHOD_BUFFERED buffers. The input is copied when
/// the request is wrapped: with METHOD_BUFFERED the input and output share
/// one system buffer, and the core holds the input while it writes the
/// output.
///
/// # Invariants
/// `request` is owned by the driver until `complete`; `output` points at
/// `output_len` bytes of its system buffer until then.
#[derive(Debug)]
pub struct WdfRequest {
    request: WDFREQUEST,
    code: u32,
    mode: RequestorMode,
    input: Vec<u8>,
    output: *mut u8,
    output_len: usize,
}

// SAFETY: a request may be completed from any thread at DISPATCH_LEVEL or
// below; the buffers are non-paged system buffers.
unsafe impl Send for WdfRequest {}

impl WdfRequest {
    /// Wraps a request a queue delivered (or a direct-call IRP's request),
    /// copying its input; hands the request back when the copy cannot be
    /// allocated.
    ///
    /// # Safety
    /// `request` is a live request the driver owns, whose buffers are
    /// METHOD_BUFFERED.
    pub unsafe fn new(
        request: WDFREQUEST,
        code: u32,
        mode: RequestorMode,
    ) -> Result<Self, WDFREQUEST> {
        // SAFETY: `request` is live and METHOD_BUFFERED (caller).
        let (input_ptr, input_len) = unsafe { system_buffer(request, Buffer::Input) };
        let mut input = Vec::new();
        if !input_ptr.is_null() {
            if input.try_reserve_exact(input_len).is_err() {
                return Err(request);
            }
            // SAFETY: the framework returned `input_len` readable bytes.
            let bytes = unsafe { core::slice::from_raw_parts(input_ptr, input_len) };
            input.extend_from_slice(bytes);
        }
        // SAFETY: as above.
        let (output_ptr, output_len) = unsafe { system_buffer(request, Buffer::Output) };
        Ok(Self {
            request,
            code,
            mode,
            input,
            output: output_ptr,
            output_len,
        })
    }

    /// Completes a request that was not wrapped (or could not be) with
    /// `status` and `information` (bytes written, for a success).
    ///
    /// # Safety
    /// `request` is a live request this driver owns; it is consumed.
    pub unsafe fn complete_raw(request: WDFREQUEST, status: NtStatus, information: u64) {
        // SAFETY: the caller owned `request` (contract); this consumes it.
        unsafe {
            call_unsafe_wdf_function_binding!(
                WdfRequestCompleteWithInformation,
                request,
                status.raw() as i32,
                information
            )
        };
    }
}

/// One of a request's METHOD_BUFFERED buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Buffer {
    /// `WdfRequestRetrieveInputBuffer`.
    Input,
    /// `WdfRequestRetrieveOutputBuffer`.
    Output,
}

/// The address and length of `request`'s `which` buffer (null and 0 when
/// it has none). With METHOD_BUFFERED both are the one system buffer.
///
/// # Safety
/// `request` is a live request the driver owns; the buffer is valid while
/// it does.
pub unsafe fn system_buffer(request: WDFREQUEST, which: Buffer) -> (*mut u8, usize) {
    let mut buffer: *mut c_void = ptr::null_mut();
    let mut length: usize = 0;
    let status = match which {
        // SAFETY: a live request (caller); out pointers valid; 0: any
        // length.
        Buffer::Input => unsafe {
            call_unsafe_wdf_function_binding!(
                WdfRequestRetrieveInputBuffer,
                request,
                0,
                &mut buffer,
                &mut length
            )
        },
        // SAFETY: as above.
        Buffer::Output => unsafe {
            call_unsafe_wdf_function_binding!(
                WdfRequestRetrieveOutputBuffer,
                request,
                0,
                &mut buffer,
                &mut length
            )
        },
    };
    if status < 0 || buffer.is_null() {
        return (ptr::null_mut(), 0);
    }
    (buffer.cast::<u8>(), length)
}

impl Request for WdfRequest {
    fn ioctl_code(&self) -> u32 {
        self.code
    }

    fn requestor_mode(&self) -> RequestorMode {
        self.mode
    }

    fn input(&self) -> &[u8] {
        &self.input
    }

    fn output(&mut self) -> &mut [u8] {
        if self.output.is_null() {
            return &mut [];
        }
        // SAFETY: `output` points at `output_len` bytes of the request's
        // system buffer while the driver owns it (type invariants); the
        // input was copied out, so nothing else aliases it.
        unsafe { core::slice::from_raw_parts_mut(self.output, self.output_len) }
    }

    fn complete(self, status: NtStatus, information: u64) {
        // SAFETY: the driver owns the request until now (type invariants);
        // the wrapper is consumed.
        unsafe { Self::complete_raw(self.request, status, information) };
    }

    fn is_canceled(&self) -> bool {
        // SAFETY: the driver owns the live request.
        let canceled =
            unsafe { call_unsafe_wdf_function_binding!(WdfRequestIsCanceled, self.request) };
        canceled != 0
    }
}
