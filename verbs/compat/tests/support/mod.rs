//! What the in-process tests of the library share: the embedded machine
//! behind the library's `Machine` seam, booted once per test process.

use std::ffi::c_int;
use std::sync::{Arc, OnceLock};

use ibal_user::{DeviceIo, PluginSource};
use ibverbs_compat::Machine;
use sim_shells::embedded::{EmbeddedMachine, Fabric};

pub(crate) struct TestMachine(pub(crate) EmbeddedMachine);

impl Machine for TestMachine {
    fn io(&self) -> Arc<dyn DeviceIo> {
        self.0.io()
    }
    fn plugin(&self) -> PluginSource {
        PluginSource::Linked
    }
    unsafe fn expose_user_memory(&self, addr: *mut u8, len: usize) -> Result<(), c_int> {
        // SAFETY: the caller promised `expose_user_memory`'s contract,
        // which is `Process::adopt`'s for the program's memory.
        unsafe { self.0.adopt_user_memory(addr, len) }
            .map(drop)
            .map_err(|_| libc::EFAULT)
    }
    fn release_user_memory(&self, addr: u64, len: usize) -> Result<(), c_int> {
        self.0
            .release_user_memory(addr, len)
            .map_err(|_| libc::EBUSY)
    }
}

pub(crate) static MACHINE: OnceLock<Arc<TestMachine>> = OnceLock::new();

pub(crate) fn boot() -> Result<Arc<dyn Machine>, String> {
    let machine = Arc::new(TestMachine(EmbeddedMachine::boot(Fabric::DEFAULT, 8)?));
    assert!(MACHINE.set(Arc::clone(&machine)).is_ok(), "booted once");
    Ok(machine)
}

pub(crate) fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap()
}
