//! The device I/O seam: what the library needs from the OS, and nothing
//! more. Windows implements it with SetupAPI/CfgMgr32, `CreateFileW`,
//! `DeviceIoControl` and `VirtualAlloc` (`crate::windows`, Windows only); the simulated
//! host implements it over its file handles and process memory (in the
//! simulator-side tests, `sim-shells/tests/ibal_user.rs`). The library never
//! calls the OS any other way.

use core::fmt;

use ib_types::status::NtStatus;

/// A status the OS answered: an `NTSTATUS` where the OS reports one (the
/// simulated host, `DeviceIoControl` through `NtDeviceIoControlFile`), or
/// a Win32 error code (`GetLastError`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OsStatus {
    /// An `NTSTATUS`.
    Nt(NtStatus),
    /// A Win32 error code.
    Win32(u32),
}

/// The path of one enabled device interface (on Windows the
/// `\\?\...#{guid}` symbolic link `CM_Get_Device_Interface_List` lists).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DevicePath(pub String);

impl fmt::Display for DevicePath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// One open handle on an HCA's proxy (`CreateFile`'s result). Dropping it
/// closes the handle (`CloseHandle`).
pub trait DeviceFile: Send + Sync + fmt::Debug {
    /// `DeviceIoControl(code, input, output)`, synchronous: the bytes the
    /// driver wrote into `output` (`lpBytesReturned`), or the status it
    /// failed with. A warning status (`STATUS_BUFFER_OVERFLOW`) still
    /// copies the output and is `Ok`, as the I/O manager does for buffered
    /// I/O. A request that pends blocks the calling thread until the driver
    /// completes it.
    fn ioctl(&self, code: u32, input: &[u8], output: &mut [u8]) -> Result<usize, OsStatus>;
}

/// The OS services the library uses: the HCAs' interfaces, opening one,
/// and memory the device may pin (ring buffers, registered regions).
pub trait DeviceIo: Send + Sync + fmt::Debug {
    /// The paths of every enabled `GUID_IB_AL_DEVICE_INTERFACE` (one per
    /// started HCA), in the OS's order.
    fn interface_paths(&self) -> Result<Vec<DevicePath>, OsStatus>;

    /// Opens `path` for read and write (`CreateFileW`).
    fn open(&self, path: &DevicePath) -> Result<Box<dyn DeviceFile>, OsStatus>;

    /// Allocates `len` bytes of zero-filled, page-aligned memory of this
    /// process (`VirtualAlloc(MEM_COMMIT | MEM_RESERVE, PAGE_READWRITE)`):
    /// its address.
    fn alloc(&self, len: usize) -> Result<u64, OsStatus>;

    /// Frees an allocation of [`alloc`](Self::alloc) (`VirtualFree`).
    fn free(&self, va: u64);

    /// Copies `out.len()` bytes of this process's memory at `va`.
    fn read(&self, va: u64, out: &mut [u8]) -> Result<(), OsStatus>;

    /// Copies `data` into this process's memory at `va`.
    fn write(&self, va: u64, data: &[u8]) -> Result<(), OsStatus>;

    /// Where the plugin's doorbell stores go on a platform with no mapped
    /// device page (the simulated host: the hook delivers each store to
    /// the device in the calling thread). On Windows the plugin writes the
    /// page the kernel mapped itself.
    #[cfg(not(windows))]
    fn doorbell_hook(&self) -> uvp_plugin::mmio::MmioHook;
}
