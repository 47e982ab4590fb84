//! What the in-process tests of the library share: the embedded machine
//! behind the library's `Machine` seam, booted once per test process, and
//! the set-ups the tests repeat as a C program would write them.

#![allow(dead_code, reason = "each test binary uses part of the support")]

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ffi::{c_int, c_void};
use std::ptr::null_mut;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use ibverbs_abi::{IbvContext, IbvCq, IbvDevice, IbvPd, IbvQpCap, IbvQpInitAttr, IbvQpType, IbvWc};

use ibal_user::{DeviceIo, PluginSource};
use ibverbs_compat::{self as verbs, BootFn, Machine};
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

pub(crate) fn clear_errno() {
    verbs_side_support::set_errno(0);
}

pub(crate) const PAGE: usize = 4096;

/// Whole pages of the program's own heap (as `posix_memalign` gives a C
/// program), so the pages adopted around a registration hold nothing of
/// the simulator's.
pub(crate) struct ProgramBuffer {
    pub(crate) ptr: *mut u8,
    layout: Layout,
}

impl ProgramBuffer {
    pub(crate) fn new(pages: usize) -> Self {
        let layout = Layout::from_size_align(pages * PAGE, PAGE).unwrap();
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        assert!(!ptr.is_null());
        Self { ptr, layout }
    }

    pub(crate) fn at(&self, offset: usize) -> *mut c_void {
        self.ptr.wrapping_add(offset).cast()
    }

    /// The program's plain store of `data` at `offset` (between verbs).
    pub(crate) fn store(&self, offset: usize, data: &[u8]) {
        assert!(offset + data.len() <= self.layout.size());
        // SAFETY: in bounds of the live allocation (checked above); no
        // work request is outstanding.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.wrapping_add(offset), data.len())
        }
    }

    /// The program's plain load of `len` bytes at `offset`.
    pub(crate) fn load(&self, offset: usize, len: usize) -> Vec<u8> {
        assert!(offset + len <= self.layout.size());
        let mut out = vec![0; len];
        // SAFETY: as `store`.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.wrapping_add(offset), out.as_mut_ptr(), len)
        }
        out
    }
}

impl Drop for ProgramBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout in `new`.
        unsafe { dealloc(self.ptr, self.layout) }
    }
}

/// What a C program does first: the library booted by `boot`, the device
/// list (one device), that device opened. The list (freed at the end)
/// and the context.
pub(crate) fn open_the_device(boot: BootFn) -> (*mut *mut IbvDevice, *mut IbvContext) {
    assert!(verbs::set_boot(boot));
    let mut count: c_int = 0;
    // SAFETY: `count` is valid for a write.
    let list = unsafe { verbs::ibv_get_device_list(&mut count) };
    assert!(!list.is_null(), "errno {}", errno());
    assert_eq!(count, 1);
    // SAFETY: a list of one device and a NULL.
    let device = unsafe { *list };
    // SAFETY: checked against the devices listed.
    let context = unsafe { verbs::ibv_open_device(device) };
    assert!(!context.is_null(), "errno {}", errno());
    (list, context)
}

/// A PD and a CQ of `cqe` entries (no channel) on `context`.
pub(crate) fn pd_and_cq(context: *mut IbvContext, cqe: c_int) -> (*mut IbvPd, *mut IbvCq) {
    // SAFETY: checked against the open contexts.
    let pd = unsafe { verbs::ibv_alloc_pd(context) };
    // SAFETY: as above.
    let cq = unsafe { verbs::ibv_create_cq(context, cqe, null_mut(), null_mut(), 0) };
    assert!(!pd.is_null() && !cq.is_null(), "errno {}", errno());
    (pd, cq)
}

/// A QP of `qp_type` completing on `cq`, `max_wr` requests deep each way,
/// one scatter/gather entry each, no SRQ, no inline data.
pub(crate) fn qp_init_attr(cq: *mut IbvCq, qp_type: IbvQpType, max_wr: u32) -> IbvQpInitAttr {
    IbvQpInitAttr {
        qp_context: null_mut(),
        send_cq: cq,
        recv_cq: cq,
        srq: null_mut(),
        cap: IbvQpCap {
            max_send_wr: max_wr,
            max_recv_wr: max_wr,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        qp_type,
        sq_sig_all: 0,
    }
}

/// Polls `cq` (through the context's `ops.poll_cq`) for one completion,
/// for at most 20 s.
pub(crate) fn poll_one(context: *mut IbvContext, cq: *mut IbvCq) -> IbvWc {
    // SAFETY: the open context.
    let poll_cq = unsafe { (*context).ops.poll_cq }.unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut wc = IbvWc::default();
    loop {
        // SAFETY: one entry.
        match unsafe { poll_cq(cq, 1, &mut wc) } {
            1 => return wc,
            0 => assert!(Instant::now() < deadline, "no completion in 20 s"),
            other => panic!("poll_cq: {other}"),
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// What a C program does last: closes the context and frees the device
/// list [`open_the_device`] handed out.
pub(crate) fn close_the_device(context: *mut IbvContext, list: *mut *mut IbvDevice) {
    // SAFETY: checked against the open contexts.
    assert_eq!(unsafe { verbs::ibv_close_device(context) }, 0);
    // SAFETY: the list handed out by `open_the_device`, freed once.
    unsafe { verbs::ibv_free_device_list(list) };
}

/// Shuts the machine down: no problem reported, nothing left open.
pub(crate) fn shut_down_cleanly(machine: &TestMachine) {
    let report = machine.0.shut_down(Duration::from_secs(10));
    assert_eq!(report.problems, Vec::<String>::new(), "a clean shutdown");
    assert_eq!(report.left_open, 0);
}
