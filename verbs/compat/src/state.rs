//! The library's process-wide state: the machine it runs on (booted on
//! first use), the devices it has listed, the device lists and contexts
//! it handed out.

use std::collections::HashMap;
use std::ffi::{c_char, c_int};
use std::sync::{Arc, Mutex, OnceLock};

use ibal_user::{DeviceIo, PluginSource};

use crate::async_events::AsyncEvents;
use crate::util::lock;
use ibverbs_abi::{
    IBV_NODE_CA, IBV_SYSFS_NAME_MAX, IBV_SYSFS_PATH_MAX, IBV_TRANSPORT_IB, IbvContext, IbvDevice,
    IbvDeviceOps, VerbsContext,
};

/// What the library runs on: the HCAs of this process's machine.
pub trait Machine: Send + Sync {
    /// The access library's OS seam for this process.
    fn io(&self) -> Arc<dyn DeviceIo>;
    /// Where each opened CA's plugin comes from.
    fn plugin(&self) -> PluginSource;

    /// Makes the whole pages around `addr..addr+len` of the program's own
    /// memory reachable by the machine's device, for a registration
    /// (`ibv_reg_mr`); an errno value when it cannot. Overlapping calls
    /// are counted: each is undone by one
    /// [`release_user_memory`](Self::release_user_memory). On Windows the
    /// program's memory is the process's memory: nothing to do (the
    /// default).
    ///
    /// # Safety
    /// `ibv_reg_mr`'s contract: the whole pages around the range are the
    /// program's memory, mapped readable and writable, and stay so until
    /// the matching release succeeds; the program touches the bytes only
    /// as verbs allow while the device may access them.
    unsafe fn expose_user_memory(&self, addr: *mut u8, len: usize) -> Result<(), c_int> {
        let _ = (addr, len);
        Ok(())
    }

    /// Undoes one [`expose_user_memory`](Self::expose_user_memory) of the
    /// same range, once the registration over it is gone; an errno value
    /// when it cannot (the pages are then left reachable).
    fn release_user_memory(&self, addr: u64, len: usize) -> Result<(), c_int> {
        let _ = (addr, len);
        Ok(())
    }
}

/// Boots (or finds) the machine; called once, on the library's first use.
/// An error is the reason, which the library prints once.
pub type BootFn = fn() -> Result<Arc<dyn Machine>, String>;

static BOOT: OnceLock<BootFn> = OnceLock::new();
static MACHINE: OnceLock<Result<Arc<dyn Machine>, String>> = OnceLock::new();

/// Registers how to boot the machine. The first registration wins: `false`
/// when one was already made.
pub fn set_boot(boot: BootFn) -> bool {
    BOOT.set(boot).is_ok()
}

/// Why the machine is not there.
#[derive(Debug)]
pub(crate) enum NoMachine {
    /// Nothing registered a machine (no verbs support: rdma-core's
    /// `ENOSYS`).
    NotRegistered,
    /// The machine did not boot.
    BootFailed,
}

/// The machine, booted on the first call.
pub(crate) fn machine() -> Result<Arc<dyn Machine>, NoMachine> {
    let boot = BOOT.get().ok_or(NoMachine::NotRegistered)?;
    let booted = MACHINE.get_or_init(|| {
        let booted = boot();
        if let Err(reason) = &booted {
            eprintln!("libibverbs: the machine did not boot: {reason}");
        }
        booted
    });
    booted
        .as_ref()
        .map(Arc::clone)
        .map_err(|_| NoMachine::BootFailed)
}

/// One device of the list: rdma-core's `ibv_device` first (the pointer a
/// program holds), then what the library knows of it. Devices live as
/// long as the process, as rdma-core's do while a program may hold them.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct Device {
    pub(crate) raw: IbvDevice,
    /// The CA's node GUID (host order): what opens it.
    pub(crate) guid: u64,
}

impl Device {
    fn new(index: usize, guid: u64) -> Self {
        let name = format!("simhca{index}");
        let mut raw = IbvDevice {
            _ops: IbvDeviceOps {
                _dummy1: None,
                _dummy2: None,
            },
            node_type: IBV_NODE_CA,
            // RoCE devices report the InfiniBand transport; the port's link
            // layer says Ethernet.
            transport_type: IBV_TRANSPORT_IB,
            name: [0; IBV_SYSFS_NAME_MAX],
            dev_name: [0; IBV_SYSFS_NAME_MAX],
            dev_path: [0; IBV_SYSFS_PATH_MAX],
            ibdev_path: [0; IBV_SYSFS_PATH_MAX],
        };
        copy_c_string(&mut raw.name, &name);
        copy_c_string(&mut raw.dev_name, &format!("uverbs{index}"));
        copy_c_string(
            &mut raw.dev_path,
            &format!("/sys/class/infiniband_verbs/uverbs{index}"),
        );
        // No sysfs directory exists for it: `ibv_devinfo` reads
        // `board_id` there, fails, and leaves that line out.
        copy_c_string(
            &mut raw.ibdev_path,
            &format!("/sys/class/infiniband/{name}"),
        );
        Self { raw, guid }
    }

    /// The pointer programs hold.
    pub(crate) fn as_ptr(&'static self) -> *mut IbvDevice {
        std::ptr::from_ref(&self.raw).cast_mut()
    }
}

/// Writes `text` NUL-terminated into `out` (truncated to fit).
pub(crate) fn copy_c_string(out: &mut [c_char], text: &str) {
    let len = text.len().min(out.len().saturating_sub(1));
    for (slot, byte) in out.iter_mut().zip(&text.as_bytes()[..len]) {
        *slot = *byte as c_char;
    }
    if let Some(end) = out.get_mut(len) {
        *end = 0;
    }
}

/// Every device listed so far, in the order first seen.
static DEVICES: Mutex<Vec<&'static Device>> = Mutex::new(Vec::new());

/// The device with node GUID `guid`, made (and kept) on first sight.
pub(crate) fn device_for(guid: u64) -> &'static Device {
    let mut devices = lock(&DEVICES);
    if let Some(device) = devices.iter().find(|d| d.guid == guid) {
        return device;
    }
    let device: &'static Device = Box::leak(Box::new(Device::new(devices.len(), guid)));
    devices.push(device);
    device
}

/// The device `ptr` points to, if it is one of ours.
pub(crate) fn device_at(ptr: *const IbvDevice) -> Option<&'static Device> {
    if ptr.is_null() {
        return None;
    }
    lock(&DEVICES)
        .iter()
        .copied()
        .find(|d| std::ptr::eq(&d.raw, ptr))
}

/// The device lists handed out and not yet freed (their addresses).
static LISTS: Mutex<Vec<usize>> = Mutex::new(Vec::new());

pub(crate) fn remember_list(list: *mut *mut IbvDevice) {
    lock(&LISTS).push(list as usize);
}

/// Forgets `list`; `false` if it is not a list we handed out.
pub(crate) fn forget_list(list: *mut *mut IbvDevice) -> bool {
    let mut lists = lock(&LISTS);
    match lists.iter().position(|&l| l == list as usize) {
        Some(at) => {
            lists.swap_remove(at);
            true
        }
        None => false,
    }
}

/// An open device: rdma-core's `verbs_context` (ending with the
/// `ibv_context` programs hold) first, then the access library's context.
#[repr(C)]
pub(crate) struct Context {
    pub(crate) verbs: VerbsContext,
    /// Shared with the PDs made on it ([`ibal_user::SharedPd`]), which
    /// keep the CA open until they are gone.
    pub(crate) ca: Arc<ibal_user::Context>,
    pub(crate) device: &'static Device,
    /// Its asynchronous events (`async_fd`, the thread feeding it).
    pub(crate) events: Arc<AsyncEvents>,
}

impl Drop for Context {
    /// The last reference (nothing made on the context remains, and it was
    /// closed): ends the event thread, which closes the CA.
    fn drop(&mut self) {
        self.events.stop(&self.ca);
    }
}

// SAFETY: the raw pointers in `verbs` are the device (a `&'static Device`,
// immutable), `abi_compat` (a marker, never dereferenced) and `priv_`
// (NULL); the library never writes through them, and the rest
// (`ibal_user::Context`) is `Send + Sync`.
unsafe impl Send for Context {}
// SAFETY: as for `Send`: nothing in `verbs` is written after the context is
// built, so shared references from several threads only read it.
unsafe impl Sync for Context {}

impl Context {
    /// The pointer programs hold.
    pub(crate) fn as_ptr(&self) -> *mut IbvContext {
        std::ptr::from_ref(&self.verbs.context).cast_mut()
    }
}

/// The open contexts, by the address of their `ibv_context`.
static CONTEXTS: Mutex<Option<HashMap<usize, Arc<Context>>>> = Mutex::new(None);

pub(crate) fn remember_context(context: Arc<Context>) -> *mut IbvContext {
    let ptr = context.as_ptr();
    lock(&CONTEXTS)
        .get_or_insert_with(HashMap::new)
        .insert(ptr as usize, context);
    ptr
}

/// The context `ptr` points to, if it is one of ours and open.
pub(crate) fn context_at(ptr: *const IbvContext) -> Option<Arc<Context>> {
    lock(&CONTEXTS).as_ref()?.get(&(ptr as usize)).cloned()
}

/// Takes the context `ptr` points to out of the open ones.
pub(crate) fn forget_context(ptr: *const IbvContext) -> Option<Arc<Context>> {
    lock(&CONTEXTS).as_mut()?.remove(&(ptr as usize))
}
