//! The calling user process ([`driver_platform::CallerProcess`]): what a
//! proxy hands the core with a user-mode request, in the caller's context.
//!
//! Model: a [`HostCaller`] is a [`Process`] plus a [`HostLocker`] for it.
//! Mapping a BAR page gives the process a device mapping at a fresh
//! virtual address; the process rings doorbells with
//! [`Process::write_device64`] at that address, and each store reaches the
//! device at the mapped BAR page only (the rest of BAR0 stays out of the
//! process's reach). Mapping and unmapping are PASSIVE_LEVEL services, as
//! `MmMapLockedPagesSpecifyCache(UserMode)` is: a call above is recorded as
//! an IRQL violation.
//!
//! **Process context.** A thread runs in one process's context at a time
//! ([`enter_process`]): the host enters the issuing process's context
//! while it delivers a user request from the issuing thread (KMDF's
//! `EvtIoInCallerContext` and, for a request delivered there, the
//! driver's `EvtIoDeviceControl`) and while it sends `IRP_MJ_CREATE` and
//! `IRP_MJ_CLEANUP` for a process's handle; scheduler items (DPCs, work
//! items, timers) run in an arbitrary thread's, i.e. no process's. A
//! driver that probes or locks a process's pages, or maps or unmaps a page
//! in it, from any other context is a
//! [`ViolationKind::UserMemoryOutsideProcessContext`] (the access still
//! happens, so the violation, not a changed outcome, fails the test). Host
//! code outside any driver (a test playing the process) is not checked.

use std::cell::RefCell;
use std::marker::PhantomData;
use std::sync::Arc;

use driver_platform::{CallerProcess, Irql, Mmio, UserMapping};
use ib_types::status::NtStatus;

use crate::dma::HostLocker;
use crate::memory::{AddressSpace, DevicePage, PAGE_SIZE, Process};
use crate::pci::Bar0;
use crate::verifier::ViolationKind;

thread_local! {
    /// The process whose context this thread runs in, if any.
    static PROCESS: RefCell<Option<Process>> = const { RefCell::new(None) };
}

/// Restores the thread's previous process context when dropped. Not
/// `Send`: the context belongs to the thread that entered it.
#[derive(Debug)]
#[must_use = "the process context is left as soon as the guard is dropped"]
pub struct ProcessContextGuard {
    previous: Option<Process>,
    _not_send: PhantomData<*const ()>,
}

impl Drop for ProcessContextGuard {
    fn drop(&mut self) {
        let previous = self.previous.take();
        PROCESS.with_borrow_mut(|current| *current = previous);
    }
}

fn switch_process(to: Option<Process>) -> ProcessContextGuard {
    let previous = PROCESS.with_borrow_mut(|current| std::mem::replace(current, to));
    ProcessContextGuard {
        previous,
        _not_send: PhantomData,
    }
}

/// Runs the calling thread in `process`'s context until the guard drops
/// (`KeStackAttachProcess`, or a thread of that process).
pub fn enter_process(process: &Process) -> ProcessContextGuard {
    switch_process(Some(process.clone()))
}

/// Runs the calling thread in no process's context until the guard drops:
/// an arbitrary thread (what a DPC, timer or system work item runs in).
pub fn enter_arbitrary_thread() -> ProcessContextGuard {
    switch_process(None)
}

/// The process whose context the calling thread runs in.
pub fn current_process() -> Option<Process> {
    PROCESS.with_borrow(Clone::clone)
}

/// True if the calling thread runs in `process`'s context.
pub fn in_process(process: &Process) -> bool {
    PROCESS.with_borrow(|current| {
        current
            .as_ref()
            .is_some_and(|p| p.space().same_space(process.space()))
    })
}

/// Checks that a driver reaching into `process` with `service` does so in
/// that process's context; records
/// [`ViolationKind::UserMemoryOutsideProcessContext`] against the running
/// driver otherwise (host code, with no driver running, is not checked).
/// Returns whether the access is in context.
pub fn check_process_context(process: &Process, service: &'static str) -> bool {
    if in_process(process) {
        return true;
    }
    if crate::context::current_driver().is_some() {
        crate::context::report(ViolationKind::UserMemoryOutsideProcessContext {
            pid: process.pid(),
            current: current_process().map(|p| p.pid()),
            service,
        });
    }
    false
}

/// A user process making a request (see the module doc).
/// Generic over the BAR type, so a test platform with a wrapped BAR0
/// maps through its wrapper.
#[derive(Debug)]
pub struct HostCaller<M = Bar0> {
    process: Process,
    locker: HostLocker,
    bar: std::marker::PhantomData<fn() -> M>,
}

impl<M> Clone for HostCaller<M> {
    fn clone(&self) -> Self {
        Self {
            process: self.process.clone(),
            locker: self.locker.clone(),
            bar: std::marker::PhantomData,
        }
    }
}

impl<M> HostCaller<M> {
    /// The caller `process`, locking kernel memory in `kernel` too.
    pub fn new(kernel: &AddressSpace, process: &Process) -> Self {
        Self {
            process: process.clone(),
            locker: HostLocker::new(kernel, Some(process)),
            bar: std::marker::PhantomData,
        }
    }

    /// The process.
    pub fn process(&self) -> &Process {
        &self.process
    }
}

/// One BAR0 page as a process sees it.
#[derive(Debug)]
struct BarPage<M> {
    bar: M,
    base: u64,
}

impl<M: Mmio + std::fmt::Debug> DevicePage for BarPage<M> {
    fn write64(&self, offset: u64, value: u64) {
        self.bar.write64(self.base + offset, value);
    }
}

/// A BAR page mapped into a process.
#[derive(Debug)]
pub struct HostUserMapping {
    va: u64,
    process: Process,
}

impl UserMapping for HostUserMapping {
    fn user_va(&self) -> u64 {
        self.va
    }

    fn len(&self) -> u64 {
        PAGE_SIZE as u64
    }
}

impl<M: Mmio + Clone + std::fmt::Debug + 'static> CallerProcess for HostCaller<M> {
    type Mmio = M;
    type Locker = HostLocker;
    type Mapping = HostUserMapping;

    fn process_id(&self) -> u64 {
        self.process.pid().into()
    }

    fn current_irql(&self) -> Irql {
        crate::irql::current()
    }

    fn locker(&self) -> &HostLocker {
        &self.locker
    }

    fn map_device_page(&self, bar: &M, offset: u64) -> Result<HostUserMapping, NtStatus> {
        crate::irql::check_max("MmMapLockedPagesSpecifyCache", Irql::PASSIVE);
        // The mapping goes into the current process: only the caller's.
        check_process_context(&self.process, "MmMapLockedPagesSpecifyCache(UserMode)");
        let page = PAGE_SIZE as u64;
        if !offset.is_multiple_of(page)
            || offset.checked_add(page).is_none_or(|end| end > bar.len())
        {
            return Err(NtStatus::INVALID_PARAMETER);
        }
        let va = self
            .process
            .space()
            .map_device(Arc::new(BarPage {
                bar: bar.clone(),
                base: offset,
            }))
            .map_err(NtStatus::from)?;
        Ok(HostUserMapping {
            va,
            process: self.process.clone(),
        })
    }

    fn unmap_device_page(&self, mapping: HostUserMapping) {
        crate::irql::check_max("MmUnmapLockedPages", Irql::PASSIVE);
        if !mapping.process.has_exited() {
            check_process_context(&mapping.process, "MmUnmapLockedPages(UserMode)");
        }
        // A process that exited took its mappings with it.
        let _ = mapping.process.space().unmap_device(mapping.va);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::{Context, enter};
    use crate::memory::AddressSpace;
    use crate::verifier::Verifier;
    use driver_platform::{LockedPages, MemoryLocker, RequestorMode};

    fn outside(v: &Verifier) -> Vec<(u32, Option<u32>)> {
        v.take()
            .into_iter()
            .filter_map(|x| match x.kind {
                ViolationKind::UserMemoryOutsideProcessContext { pid, current, .. } => {
                    Some((pid, current))
                }
                _ => None,
            })
            .collect()
    }

    #[test]
    fn user_pages_are_locked_only_in_their_process_context() {
        let v = Verifier::new();
        let kernel = AddressSpace::kernel();
        let (a, b) = (Process::new(51), Process::new(52));
        let va = a.alloc(4096).unwrap();
        let locker = HostLocker::new(&kernel, Some(&a));
        let lock = || locker.lock(RequestorMode::User, va, 16, false).unwrap();

        // Host code playing the process: not checked.
        drop(lock());
        let _driver = enter(Context::driver(v.clone(), "sample"));
        // In its own process: fine.
        {
            let _a = enter_process(&a);
            assert!(in_process(&a) && !in_process(&b));
            drop(lock());
        }
        assert!(outside(&v).is_empty());
        // In another process's thread, and in an arbitrary thread (a DPC's
        // or a work item's): the access happens and is recorded.
        {
            let _b = enter_process(&b);
            assert_eq!(lock().page_count(), 1);
        }
        {
            let _a = enter_process(&a);
            let _dpc = enter_arbitrary_thread();
            drop(lock());
            assert!(current_process().is_none());
        }
        assert!(!in_process(&a));
        assert_eq!(outside(&v), [(51, Some(52)), (51, None)]);
    }
}
