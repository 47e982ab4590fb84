//! The simulated host's side of `ibal-user`'s OS seam (`DeviceIo`): the
//! counterpart of the library's Windows implementation
//! (`ibal_user::windows`), over the host's PnP file handles and one
//! process's memory. Interface paths come from the devnodes exposing
//! `GUID_IB_AL_DEVICE_INTERFACE`; an IOCTL is sent on the process's handle
//! and the deterministic host runs until it completes (a request nothing
//! would complete is cancelled, as `CancelIoEx` would end a blocked
//! thread's wait), or, on a threaded host ([`ThreadedSimIo`]), the calling
//! thread blocks until the workers completed it; the plugin's doorbell
//! store reaches the device through the process's device mapping in the
//! calling thread.

use std::sync::{Arc, Mutex, PoisonError};

use ib_types::interface::GUID_IB_AL_DEVICE_INTERFACE;
use ib_types::status::NtStatus;
use ibal_user::{DeviceFile, DeviceIo, DevicePath, OsStatus};
use sim_host::file::FileHandle;
use sim_host::host::Host;
use sim_host::memory::Process;
use sim_host::pnp::DevNodeId;

/// The simulated host's side of the library's OS seam: one process of one
/// deterministic host.
#[derive(Debug)]
pub struct SimIo {
    host: Arc<Host>,
    process: Process,
    /// The interface paths handed out, and the devnode each names.
    paths: Mutex<Vec<(DevicePath, DevNodeId)>>,
    waiting: Waiting,
}

/// How the calling thread waits for the machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Waiting {
    /// Deterministic host: run its scheduler until idle.
    Settle,
    /// Threaded host: its workers run the machine; block as Windows does.
    Block,
}

impl SimIo {
    /// The seam of `process` on the deterministic `host`.
    pub fn new(host: &Arc<Host>, process: &Process) -> Arc<Self> {
        Arc::new(Self::with(host, process, Waiting::Settle))
    }

    fn with(host: &Arc<Host>, process: &Process, waiting: Waiting) -> Self {
        Self {
            host: Arc::clone(host),
            process: process.clone(),
            paths: Mutex::new(Vec::new()),
            waiting,
        }
    }

    /// Lets the deterministic machine act on what the caller just did; the
    /// threaded one's workers do by themselves.
    fn settle(&self) {
        if self.waiting == Waiting::Settle {
            settle(&self.host);
        }
    }
}

/// The seam of one process of a **threaded** host: as [`SimIo`], but a
/// synchronous IOCTL blocks the calling thread until the driver completes
/// it (`DeviceIoControl` on Windows), while the host's workers run the
/// machine; nothing is cancelled for it, so a wait for an event that never
/// comes blocks, as it would on Windows.
#[derive(Debug)]
pub struct ThreadedSimIo(SimIo);

impl ThreadedSimIo {
    /// The seam of `process` on the threaded `host`.
    pub fn new(host: &Arc<Host>, process: &Process) -> Arc<Self> {
        Arc::new(Self(SimIo::with(host, process, Waiting::Block)))
    }
}

impl DeviceIo for ThreadedSimIo {
    fn interface_paths(&self) -> Result<Vec<DevicePath>, OsStatus> {
        self.0.interface_paths()
    }
    fn open(&self, path: &DevicePath) -> Result<Box<dyn DeviceFile>, OsStatus> {
        self.0.open(path)
    }
    fn alloc(&self, len: usize) -> Result<u64, OsStatus> {
        self.0.alloc(len)
    }
    fn free(&self, va: u64) {
        self.0.free(va);
    }
    fn read(&self, va: u64, out: &mut [u8]) -> Result<(), OsStatus> {
        self.0.read(va, out)
    }
    fn write(&self, va: u64, data: &[u8]) -> Result<(), OsStatus> {
        self.0.write(va, data)
    }
    fn doorbell_hook(&self) -> uvp_plugin::mmio::MmioHook {
        self.0.doorbell_hook()
    }
}

/// Runs the deterministic host until nothing is left to do: a synchronous
/// IOCTL's wait, on a host that cannot block.
pub fn settle(host: &Host) {
    host.scheduler().run_until_idle(1_000_000).unwrap();
}

/// One handle of the process on an HCA.
#[derive(Debug)]
pub struct SimFile {
    host: Arc<Host>,
    handle: Option<FileHandle>,
    waiting: Waiting,
}

impl DeviceFile for SimFile {
    fn ioctl(&self, code: u32, input: &[u8], output: &mut [u8]) -> Result<usize, OsStatus> {
        let handle = self
            .handle
            .as_ref()
            .ok_or(OsStatus::Nt(NtStatus::INVALID_HANDLE))?;
        let issuer = handle.send(code, input.to_vec(), output.len());
        if self.waiting == Waiting::Block {
            issuer.wait();
        } else {
            settle(&self.host);
            // A request nothing will complete would block the thread
            // forever on Windows; the deterministic host cannot wait, so it
            // is cancelled (`CancelIoEx`) and ends with its driver's status.
            if !issuer.is_done() {
                issuer.cancel();
                settle(&self.host);
            }
        }
        let done = issuer
            .completion()
            .ok_or(OsStatus::Nt(NtStatus::CANCELLED))?;
        if done.status.is_error() {
            return Err(OsStatus::Nt(done.status));
        }
        let n = (done.information as usize)
            .min(output.len())
            .min(done.output.len());
        output[..n].copy_from_slice(&done.output[..n]);
        Ok(n)
    }
}

impl Drop for SimFile {
    fn drop(&mut self) {
        if let Some(handle) = self.handle.take() {
            handle.close();
            if self.waiting == Waiting::Settle {
                settle(&self.host);
            }
        }
    }
}

fn nt(e: sim_host::memory::MemoryError) -> OsStatus {
    let _ = e;
    OsStatus::Nt(NtStatus::INVALID_PARAMETER)
}

impl DeviceIo for SimIo {
    fn interface_paths(&self) -> Result<Vec<DevicePath>, OsStatus> {
        let nodes = self
            .host
            .pnp()
            .devices_with_interface(GUID_IB_AL_DEVICE_INTERFACE);
        let listed: Vec<(DevicePath, DevNodeId)> = nodes
            .into_iter()
            .map(|node| (DevicePath(format!(r"\\?\SIM#HCA#{node:?}#{{ibal}}")), node))
            .collect();
        let paths = listed.iter().map(|(p, _)| p.clone()).collect();
        *self.paths.lock().unwrap_or_else(PoisonError::into_inner) = listed;
        Ok(paths)
    }

    fn open(&self, path: &DevicePath) -> Result<Box<dyn DeviceFile>, OsStatus> {
        let node = self
            .paths
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .find(|(p, _)| p == path)
            .map(|(_, n)| *n)
            .ok_or(OsStatus::Nt(NtStatus::NOT_FOUND))?;
        let handle = self
            .host
            .pnp()
            .open_file(&self.process, node)
            .map_err(OsStatus::Nt)?;
        self.settle();
        Ok(Box::new(SimFile {
            host: Arc::clone(&self.host),
            handle: Some(handle),
            waiting: self.waiting,
        }))
    }

    fn alloc(&self, len: usize) -> Result<u64, OsStatus> {
        self.process.alloc(len).map_err(nt)
    }

    fn free(&self, va: u64) {
        let _ = self.process.free(va);
    }

    fn read(&self, va: u64, out: &mut [u8]) -> Result<(), OsStatus> {
        self.process.read(va, out).map_err(nt)
    }

    fn write(&self, va: u64, data: &[u8]) -> Result<(), OsStatus> {
        self.process.write(va, data).map_err(nt)
    }

    fn doorbell_hook(&self) -> uvp_plugin::mmio::MmioHook {
        let process = self.process.clone();
        // A store to the mapped UAR page reaches the device in the calling
        // thread; one outside the mapping goes nowhere (it would fault).
        Arc::new(move |address: u64, value: u64| {
            let _ = process.write_device64(address, value);
        })
    }
}
