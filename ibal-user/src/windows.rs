//! The device I/O seam on Windows: `CM_Get_Device_Interface_ListW` for the
//! HCAs' proxy interfaces, `CreateFileW`, synchronous `DeviceIoControl`,
//! `VirtualAlloc` for memory the device pins (the plugin writes the
//! doorbell page the kernel mapped itself). Type-checked for `x86_64-pc-windows-msvc`
//! (`cargo check -p ibal-user --target x86_64-pc-windows-msvc`); never run
//! (docs/ibal-user.md).

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::{Mutex, PoisonError};

use ib_types::interface::{GUID_IB_AL_DEVICE_INTERFACE, WinGuid};
use windows_sys::Win32::Devices::DeviceAndDriverInstallation::{
    CM_GET_DEVICE_INTERFACE_LIST_PRESENT, CM_Get_Device_Interface_List_SizeW,
    CM_Get_Device_Interface_ListW, CR_SUCCESS,
};
use windows_sys::Win32::Foundation::{
    CloseHandle, ERROR_MORE_DATA, GENERIC_READ, GENERIC_WRITE, GetLastError, HANDLE,
    INVALID_HANDLE_VALUE,
};
use windows_sys::Win32::Storage::FileSystem::{
    CreateFileW, FILE_ATTRIBUTE_NORMAL, FILE_SHARE_READ, FILE_SHARE_WRITE, OPEN_EXISTING,
};
use windows_sys::Win32::System::IO::DeviceIoControl;
use windows_sys::Win32::System::Memory::{
    MEM_COMMIT, MEM_RELEASE, MEM_RESERVE, PAGE_READWRITE, VirtualAlloc, VirtualFree,
};
use windows_sys::core::GUID;

use crate::device::{DeviceFile, DeviceIo, DevicePath, OsStatus};

fn guid(g: &WinGuid) -> GUID {
    GUID {
        data1: g.data1.get(),
        data2: g.data2.get(),
        data3: g.data3.get(),
        data4: g.data4,
    }
}

fn last_error() -> OsStatus {
    // SAFETY: reads the calling thread's last-error value; no arguments.
    OsStatus::Win32(unsafe { GetLastError() })
}

/// The OS seam of a Windows process. Tracks its allocations, so `read`
/// and `write` touch only memory it allocated.
#[derive(Debug, Default)]
pub struct WindowsIo {
    allocations: Mutex<BTreeMap<u64, usize>>,
}

impl WindowsIo {
    /// The seam.
    pub fn new() -> Self {
        Self::default()
    }

    /// The pointer to `len` bytes at `va`, if they lie in one allocation.
    fn checked(&self, va: u64, len: usize) -> Result<*mut u8, OsStatus> {
        let allocations = self
            .allocations
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let inside = allocations
            .range(..=va)
            .next_back()
            .is_some_and(|(start, size)| {
                va.checked_add(len as u64)
                    .is_some_and(|end| end <= start + *size as u64)
            });
        if inside {
            Ok(va as usize as *mut u8)
        } else {
            // ERROR_INVALID_ADDRESS
            Err(OsStatus::Win32(487))
        }
    }
}

/// An open handle on an HCA's proxy.
#[derive(Debug)]
pub struct WindowsFile {
    /// The `HANDLE`, as an integer (handles may be used from any thread).
    handle: usize,
}

impl WindowsFile {
    fn handle(&self) -> HANDLE {
        self.handle as HANDLE
    }
}

impl DeviceFile for WindowsFile {
    fn ioctl(&self, code: u32, input: &[u8], output: &mut [u8]) -> Result<usize, OsStatus> {
        let in_len = u32::try_from(input.len()).map_err(|_| OsStatus::Win32(87))?;
        let out_len = u32::try_from(output.len()).map_err(|_| OsStatus::Win32(87))?;
        let mut returned = 0u32;
        // SAFETY: the buffers are valid for their lengths for the whole
        // (synchronous: no OVERLAPPED) call; the handle is open.
        let ok = unsafe {
            DeviceIoControl(
                self.handle(),
                code,
                input.as_ptr().cast::<c_void>(),
                in_len,
                output.as_mut_ptr().cast::<c_void>(),
                out_len,
                &mut returned,
                core::ptr::null_mut(),
            )
        };
        if ok != 0 {
            return Ok(returned as usize);
        }
        match last_error() {
            // A warning status (STATUS_BUFFER_OVERFLOW): the output was
            // copied and `returned` counts it.
            OsStatus::Win32(ERROR_MORE_DATA) => Ok(returned as usize),
            status => Err(status),
        }
    }
}

impl Drop for WindowsFile {
    fn drop(&mut self) {
        // SAFETY: the handle is open and owned by this value alone.
        unsafe { CloseHandle(self.handle()) };
    }
}

impl DeviceIo for WindowsIo {
    fn interface_paths(&self) -> Result<Vec<DevicePath>, OsStatus> {
        let class = guid(&GUID_IB_AL_DEVICE_INTERFACE);
        loop {
            let mut len = 0u32;
            // SAFETY: `len` and `class` are valid for the call.
            let status = unsafe {
                CM_Get_Device_Interface_List_SizeW(
                    &mut len,
                    &class,
                    core::ptr::null(),
                    CM_GET_DEVICE_INTERFACE_LIST_PRESENT,
                )
            };
            if status != CR_SUCCESS {
                return Err(OsStatus::Win32(status));
            }
            let mut list = vec![0u16; len as usize];
            // SAFETY: `list` holds `len` UTF-16 units.
            let status = unsafe {
                CM_Get_Device_Interface_ListW(
                    &class,
                    core::ptr::null(),
                    list.as_mut_ptr(),
                    len,
                    CM_GET_DEVICE_INTERFACE_LIST_PRESENT,
                )
            };
            // CR_BUFFER_SMALL: an interface arrived between the calls.
            if status == 0x1A {
                continue;
            }
            if status != CR_SUCCESS {
                return Err(OsStatus::Win32(status));
            }
            return Ok(list
                .split(|unit| *unit == 0)
                .filter(|path| !path.is_empty())
                .map(|path| DevicePath(String::from_utf16_lossy(path)))
                .collect());
        }
    }

    fn open(&self, path: &DevicePath) -> Result<Box<dyn DeviceFile>, OsStatus> {
        let wide: Vec<u16> = path.0.encode_utf16().chain([0]).collect();
        // SAFETY: `wide` is NUL-terminated and outlives the call.
        let handle = unsafe {
            CreateFileW(
                wide.as_ptr(),
                GENERIC_READ | GENERIC_WRITE,
                FILE_SHARE_READ | FILE_SHARE_WRITE,
                core::ptr::null(),
                OPEN_EXISTING,
                FILE_ATTRIBUTE_NORMAL,
                core::ptr::null_mut(),
            )
        };
        if handle == INVALID_HANDLE_VALUE {
            return Err(last_error());
        }
        Ok(Box::new(WindowsFile {
            handle: handle as usize,
        }))
    }

    fn alloc(&self, len: usize) -> Result<u64, OsStatus> {
        // SAFETY: a fresh reservation; no memory of ours is touched.
        let at = unsafe {
            VirtualAlloc(
                core::ptr::null(),
                len,
                MEM_COMMIT | MEM_RESERVE,
                PAGE_READWRITE,
            )
        };
        if at.is_null() {
            return Err(last_error());
        }
        let va = at as usize as u64;
        self.allocations
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(va, len);
        Ok(va)
    }

    fn free(&self, va: u64) {
        let known = self
            .allocations
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&va)
            .is_some();
        if known {
            // SAFETY: `va` is an allocation of `alloc`, released once.
            unsafe { VirtualFree(va as usize as *mut c_void, 0, MEM_RELEASE) };
        }
    }

    fn read(&self, va: u64, out: &mut [u8]) -> Result<(), OsStatus> {
        let from = self.checked(va, out.len())?;
        // SAFETY: `from..from + len` lies in a live allocation of ours;
        // `out` is a distinct Rust buffer.
        unsafe { core::ptr::copy_nonoverlapping(from, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    fn write(&self, va: u64, data: &[u8]) -> Result<(), OsStatus> {
        let to = self.checked(va, data.len())?;
        // SAFETY: as in `read`, the other way.
        unsafe { core::ptr::copy_nonoverlapping(data.as_ptr(), to, data.len()) };
        Ok(())
    }
}
