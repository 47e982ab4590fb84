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

use std::sync::Arc;

use driver_platform::{CallerProcess, Irql, Mmio, UserMapping};
use ib_types::status::NtStatus;

use crate::dma::HostLocker;
use crate::memory::{AddressSpace, DevicePage, PAGE_SIZE, Process};
use crate::pci::Bar0;

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
        // A process that exited took its mappings with it.
        let _ = mapping.process.space().unmap_device(mapping.va);
    }
}
