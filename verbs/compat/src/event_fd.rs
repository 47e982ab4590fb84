//! The event descriptor completion channels (`crate::cq`) and a context's
//! asynchronous events (`crate::async_events`) share: an `eventfd` in
//! semaphore mode counting the entries queued beside it, which programs
//! `poll` or make `O_NONBLOCK`. A destroy may drop queued entries and leave
//! their counts in the descriptor; [`EventFd::take`] reads past those.

use std::ffi::c_int;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// An `eventfd` (semaphore mode, close-on-exec) counting queued entries.
pub(crate) struct EventFd {
    fd: OwnedFd,
}

impl EventFd {
    /// A fresh descriptor; `Err` with the `eventfd` call's errno.
    pub(crate) fn new() -> Result<Self, c_int> {
        // SAFETY: plain system call; the descriptor is checked below.
        let raw_fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_SEMAPHORE) };
        if raw_fd < 0 {
            return Err(last_errno(libc::EMFILE));
        }
        // SAFETY: a descriptor eventfd just opened, owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw_fd) };
        Ok(Self { fd })
    }

    /// The descriptor programs see.
    pub(crate) fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Counts one entry the caller just queued, waking a reader. `what`
    /// names the descriptor in the message printed if it refuses.
    pub(crate) fn post_one(&self, what: &str) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our own eventfd.
        let written = unsafe {
            libc::write(
                self.fd.as_raw_fd(),
                std::ptr::from_ref(&one).cast(),
                size_of::<u64>(),
            )
        };
        if written != size_of::<u64>() as isize {
            // Only a counter at its maximum refuses: 2^64 - 2 entries
            // unread. The entry stays queued for the next read.
            eprintln!("libibverbs: {what} refused an event");
        }
    }

    /// The next queued entry: reads one count (blocking unless the program
    /// made the descriptor non-blocking), then asks `take_queued` for its
    /// entry; a count whose entry was dropped (`None`) is skipped and the
    /// next one read. `Err` with the read's errno (`EAGAIN` on a
    /// non-blocking descriptor with nothing counted).
    pub(crate) fn take<T>(&self, mut take_queued: impl FnMut() -> Option<T>) -> Result<T, c_int> {
        loop {
            let mut count: u64 = 0;
            // SAFETY: reads 8 bytes into a live u64 from our own eventfd
            // (open while `self` lives).
            let read = unsafe {
                libc::read(
                    self.fd.as_raw_fd(),
                    std::ptr::from_mut(&mut count).cast(),
                    size_of::<u64>(),
                )
            };
            if read != size_of::<u64>() as isize {
                return Err(last_errno(libc::EIO));
            }
            if let Some(entry) = take_queued() {
                return Ok(entry);
            }
        }
    }
}

/// The errno of the system call that just failed, `fallback` if none.
fn last_errno(fallback: c_int) -> c_int {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(fallback)
}
