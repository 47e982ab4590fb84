//! What every entry point shares (no unwinding across the C boundary,
//! errno values for the access library's errors), and the two entry points
//! that need no device: `ibv_read_sysfs_file` and `ibv_wc_status_str`.

use std::ffi::OsStr;
use std::ffi::{CStr, c_char, c_int};
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::{Mutex, MutexGuard, PoisonError};

use ib_types::status::IbStatus;
use ibal_user::Error;
pub(crate) use verbs_side_support::set_errno;

/// Runs `body`; a panic inside it sets `errno = EIO` and returns
/// `on_panic` instead of unwinding into C.
pub(crate) fn guard<T>(on_panic: T, body: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|_| {
        set_errno(libc::EIO);
        on_panic
    })
}

/// Locks `mutex`, poisoned or not: a panic inside a lock is caught at the
/// C boundary ([`guard`]) and leaves no half-made state the library relies
/// on, so later calls go on.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The errno value a C caller gets for `error`.
pub(crate) fn errno_of(error: &Error) -> c_int {
    match error {
        Error::NoSuchCa(_) => libc::ENODEV,
        Error::InvalidArgument(_) => libc::EINVAL,
        Error::Unsupported(_) | Error::NeedsPlugin(_) => libc::EOPNOTSUPP,
        Error::AbiMismatch { .. } => libc::EPROTO,
        _ => match error.status() {
            IbStatus::InsufficientResources | IbStatus::InsufficientMemory => libc::ENOMEM,
            // Sizes past the device's limits: rdma-core's kernel says
            // EINVAL for them.
            IbStatus::InvalidParameter
            | IbStatus::InvalidSetting
            | IbStatus::InvalidMaxWrs
            | IbStatus::InvalidMaxSge
            | IbStatus::InvalidCqSize
            | IbStatus::InvalidSrqSize => libc::EINVAL,
            IbStatus::NotFound => libc::ENOENT,
            IbStatus::Timeout => libc::ETIMEDOUT,
            IbStatus::InvalidPermission => libc::EACCES,
            IbStatus::Unsupported => libc::EOPNOTSUPP,
            IbStatus::ResourceBusy => libc::EBUSY,
            _ => libc::EIO,
        },
    }
}

/// `ibv_read_sysfs_file(dir, file, buf, size)`: reads `dir/file` into
/// `buf` as rdma-core does: the bytes read (a trailing newline replaced by
/// the terminating NUL), or -1 (with `errno`) when the file cannot be read
/// or its contents do not fit with their NUL.
///
/// # Safety
///
/// `dir` and `file` are NUL-terminated strings or NULL; `buf` is NULL or
/// valid for `size` bytes of writes.
pub unsafe extern "C" fn ibv_read_sysfs_file(
    dir: *const c_char,
    file: *const c_char,
    buf: *mut c_char,
    size: usize,
) -> c_int {
    guard(-1, || {
        if dir.is_null() || file.is_null() || buf.is_null() || size == 0 {
            set_errno(libc::EINVAL);
            return -1;
        }
        // SAFETY: non-NULL and NUL-terminated (the contract).
        let dir = unsafe { CStr::from_ptr(dir) };
        // SAFETY: as `dir`.
        let file = unsafe { CStr::from_ptr(file) };
        let path =
            Path::new(OsStr::from_bytes(dir.to_bytes())).join(OsStr::from_bytes(file.to_bytes()));
        let mut contents = Vec::with_capacity(size);
        let read =
            std::fs::File::open(&path).and_then(|f| f.take(size as u64).read_to_end(&mut contents));
        if let Err(error) = read {
            set_errno(error.raw_os_error().unwrap_or(libc::EIO));
            return -1;
        }
        let mut len = contents.len();
        if contents.last() == Some(&b'\n') {
            len -= 1;
        } else if len == size {
            // No room for the NUL: rdma-core fails rather than hand out an
            // unterminated string.
            set_errno(libc::EOVERFLOW);
            return -1;
        }
        // SAFETY: `buf` is valid for `size` bytes and `len < size`.
        let out = unsafe { std::slice::from_raw_parts_mut(buf.cast::<u8>(), size) };
        out[..len].copy_from_slice(&contents[..len]);
        out[len] = 0;
        c_int::try_from(len).unwrap_or(c_int::MAX)
    })
}

/// The text of each `ibv_wc_status`, as rdma-core's (its value indexes
/// the table).
const WC_STATUS_TEXT: [&CStr; 24] = [
    c"success",
    c"local length error",
    c"local QP operation error",
    c"local EE context operation error",
    c"local protection error",
    c"Work Request Flushed Error",
    c"memory management operation error",
    c"bad response error",
    c"local access error",
    c"remote invalid request error",
    c"remote access error",
    c"remote operation error",
    c"transport retry counter exceeded",
    c"RNR retry counter exceeded",
    c"local RDD violation error",
    c"remote invalid RD request",
    c"aborted error",
    c"invalid EE context number",
    c"invalid EE context state",
    c"fatal error",
    c"response timeout error",
    c"general error",
    c"TM error",
    c"TM software rendezvous",
];

/// `ibv_wc_status_str(status)`: a completion status's text, `"unknown"`
/// for a value rdma-core does not name.
pub extern "C" fn ibv_wc_status_str(status: u32) -> *const c_char {
    usize::try_from(status)
        .ok()
        .and_then(|at| WC_STATUS_TEXT.get(at))
        .copied()
        .unwrap_or(c"unknown")
        .as_ptr()
}
