//! File objects and process handles: `IRP_MJ_CREATE`, `IRP_MJ_CLEANUP`,
//! `IRP_MJ_CLOSE` (KMDF's `EvtDeviceFileCreate`, `EvtFileCleanup`,
//! `EvtFileClose`), the handles a process holds on a device, and process
//! exit.
//!
//! Contract (`docs/host-model.md`, "File objects and processes"):
//! - [`PnpManager::open_file`] (or [`PnpManager::open_interface`]) opens a
//!   handle as a process, asking read and write access: a stack with a
//!   security descriptor that does not grant both to the process's token
//!   refuses with `STATUS_ACCESS_DENIED` before any layer sees it
//!   (`crate::security`); then a new [`FileObject`] goes to the stack's layers
//!   top-down, down to the function driver, each layer's
//!   [`DeviceCallbacks::file_create`] at PASSIVE_LEVEL in the process's
//!   context. A failure fails the open; the layers above that had
//!   accepted get [`DeviceCallbacks::file_close`] (the framework deletes
//!   their file object).
//! - A request sent on a handle ([`FileHandle::send`]) is a user-mode
//!   request carrying its process and file object, delivered in the
//!   process's context; it references the file object until completed.
//! - Closing the last handle ([`FileHandle::close`], or process exit)
//!   sends `file_cleanup` to the layers, top-down, in the closing
//!   process's context; `file_close` follows once the last reference is
//!   gone (every request on the file completed), on a system thread.
//! - [`PnpManager::exit_process`]: the process's pending requests are
//!   cancelled first, then its handles are closed, then its address space
//!   goes; user pages still locked then are `PROCESS_HAS_LOCKED_PAGES`
//!   ([`ViolationKind::ProcessHasLockedPages`]), charged to the driver that
//!   locked them.
//! - Each layer may keep a per-file-object context
//!   ([`FileObject::set_context`], the WDF object context of the
//!   `WDFFILEOBJECT`), one per driver.

use std::any::Any;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use driver_platform::{Irql, RequestorMode};
use ib_types::interface::WinGuid;
use ib_types::status::NtStatus;

use crate::caller::{enter_arbitrary_thread, enter_process};
use crate::driver::{DELETE_PENDING, DeviceCallbacks, NO_SUCH_DEVICE, StackRole};
use crate::memory::Process;
use crate::pnp::{DevNodeId, HOST_PDO, PnpManager, PnpState};
use crate::request::{HostRequest, RequestHandle};
use crate::sched::SchedulerHandle;
use crate::security::AccessMask;
use crate::verifier::{Verifier, ViolationKind};

/// `STATUS_PROCESS_IS_TERMINATING`: an exited process opens nothing.
pub const PROCESS_IS_TERMINATING: NtStatus = NtStatus::from_raw(0xC000_010A);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

type Layers = Vec<(Arc<str>, Arc<dyn DeviceCallbacks>)>;

#[derive(Default)]
struct FileState {
    /// Handles open on it, in any process.
    handles: usize,
    /// One for the handles together (until cleanup), one per request in
    /// flight.
    references: usize,
    /// The layers that accepted the create, top-down.
    layers: Layers,
    /// Requests sent on it, to cancel at process exit.
    sent: Vec<RequestHandle>,
    cleaned_up: bool,
    /// `file_close` is queued or running.
    close_due: bool,
    /// `file_close` ran.
    closed: bool,
}

struct FileInner {
    id: u64,
    node: DevNodeId,
    process: Process,
    /// Per-driver contexts (`WdfObjectAllocateContext` on the file object).
    contexts: Mutex<BTreeMap<Arc<str>, Arc<dyn Any + Send + Sync>>>,
    state: Mutex<FileState>,
    table: Weak<TableInner>,
}

/// A file object: one open of a device by a process (`WDFFILEOBJECT`).
/// Cloning gives another pointer to the same object (not another handle).
#[derive(Clone)]
pub struct FileObject {
    inner: Arc<FileInner>,
}

impl fmt::Debug for FileObject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FileObject")
            .field("id", &self.inner.id)
            .field("node", &self.inner.node)
            .field("pid", &self.inner.process.pid())
            .finish_non_exhaustive()
    }
}

impl FileObject {
    /// Identifies the file object on its host.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// The devnode it was opened on.
    pub fn node(&self) -> DevNodeId {
        self.inner.node
    }

    /// The process that opened it.
    pub fn process(&self) -> &Process {
        &self.inner.process
    }

    /// Handles open on it now.
    pub fn handle_count(&self) -> usize {
        lock(&self.inner.state).handles
    }

    /// True once `file_cleanup` was sent (its last handle closed).
    pub fn is_cleaned_up(&self) -> bool {
        lock(&self.inner.state).cleaned_up
    }

    /// True once `file_close` was sent.
    pub fn is_closed(&self) -> bool {
        lock(&self.inner.state).closed
    }

    fn context_key() -> Arc<str> {
        crate::context::current_driver().unwrap_or_else(|| Arc::from(""))
    }

    /// Sets the running driver's context on this file object (replacing
    /// one set before).
    pub fn set_context<T: Any + Send + Sync>(&self, value: T) {
        lock(&self.inner.contexts).insert(Self::context_key(), Arc::new(value));
    }

    /// The running driver's context on this file object, if it is a `T`.
    pub fn context<T: Any + Send + Sync>(&self) -> Option<Arc<T>> {
        let any = lock(&self.inner.contexts)
            .get(&Self::context_key())?
            .clone();
        any.downcast().ok()
    }

    /// A reference for a request in flight on this file.
    pub(crate) fn reference(&self) -> FileReference {
        lock(&self.inner.state).references += 1;
        FileReference { file: self.clone() }
    }

    /// Drops one reference; the last one sends `file_close` (scheduled on
    /// a system thread if the host has a scheduler and `deferred`).
    fn release(&self, deferred: bool) {
        let close = {
            let mut s = lock(&self.inner.state);
            s.references = s.references.saturating_sub(1);
            if s.references == 0 && s.cleaned_up && !s.close_due {
                s.close_due = true;
                Some(std::mem::take(&mut s.layers))
            } else {
                None
            }
        };
        let Some(layers) = close else {
            return;
        };
        let table = self.inner.table.upgrade();
        let sched = table.as_ref().and_then(|t| lock(&t.closer).clone());
        let file = self.clone();
        match sched {
            Some(sched) if deferred => {
                sched.schedule_task("IRP_MJ_CLOSE", move || file.send_close(&layers));
            }
            _ => file.send_close(&layers),
        }
    }

    /// `IRP_MJ_CLOSE`: every layer that accepted the create, top-down, on
    /// a system thread (arbitrary context).
    fn send_close(&self, layers: &Layers) {
        let _system_thread = enter_arbitrary_thread();
        for (_, cb) in layers {
            cb.file_close(self);
        }
        lock(&self.inner.state).closed = true;
        if let Some(table) = self.inner.table.upgrade() {
            lock(&table.files).remove(&self.inner.id);
            let closed = table.closed_hooks();
            for hook in closed {
                hook(self.inner.node);
            }
        }
    }
}

/// A request's reference on its file object (the IRP's `FileObject`):
/// released when the request is completed or dropped.
pub struct FileReference {
    file: FileObject,
}

impl FileReference {
    /// The file object.
    pub fn file(&self) -> &FileObject {
        &self.file
    }
}

impl fmt::Debug for FileReference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.file.fmt(f)
    }
}

impl Drop for FileReference {
    fn drop(&mut self) {
        self.file.release(true);
    }
}

type ClosedHook = Arc<dyn Fn(DevNodeId) + Send + Sync>;

#[derive(Default)]
struct TableInner {
    next_id: AtomicU64,
    /// File objects not yet closed, by id.
    files: Mutex<BTreeMap<u64, FileObject>>,
    /// Each process's handle table: one entry per handle (a duplicated
    /// handle is a second entry for the same file object).
    handles: Mutex<BTreeMap<u32, Vec<FileObject>>>,
    /// Runs `IRP_MJ_CLOSE` for a reference released by a completion.
    closer: Mutex<Option<SchedulerHandle>>,
    /// Called with the devnode after a file object on it closed.
    on_closed: Mutex<Vec<ClosedHook>>,
}

impl TableInner {
    fn closed_hooks(&self) -> Vec<ClosedHook> {
        lock(&self.on_closed).clone()
    }
}

/// Every file object and process handle of one host (kept by its PnP
/// manager).
#[derive(Clone, Default)]
pub(crate) struct FileTable {
    inner: Arc<TableInner>,
}

impl FileTable {
    fn open_handles_on(&self, node: DevNodeId) -> usize {
        lock(&self.inner.files)
            .values()
            .filter(|f| f.node() == node)
            .map(FileObject::handle_count)
            .sum()
    }

    fn files_on(&self, node: DevNodeId) -> usize {
        lock(&self.inner.files)
            .values()
            .filter(|f| f.node() == node)
            .count()
    }
}

/// A handle a process holds on a device (`CreateFile`'s result). Dropping
/// it leaves the handle open in the process's handle table, as a leaked
/// handle is on Windows: process exit closes it.
pub struct FileHandle {
    pnp: PnpManager,
    file: FileObject,
}

impl fmt::Debug for FileHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FileHandle")
            .field("file", &self.file)
            .finish()
    }
}

impl FileHandle {
    /// The file object the handle refers to.
    pub fn file(&self) -> &FileObject {
        &self.file
    }

    /// Sends a user-mode `DeviceIoControl` on the handle from a thread of
    /// its process: the request carries the process and the file object
    /// and is delivered to the top of the stack in the process's context.
    pub fn send(&self, ioctl: u32, input: Vec<u8>, output_len: usize) -> RequestHandle {
        let verifier = self.pnp.verifier();
        let (mut req, issuer) =
            HostRequest::new(&verifier, ioctl, RequestorMode::User, input, output_len);
        req.set_process(self.file.process().clone());
        req.set_file(self.file.reference());
        lock(&self.file.inner.state).sent.push(issuer.clone());
        self.pnp.send_request(self.file.node(), req);
        issuer
    }

    /// `DuplicateHandle` within the process: another handle to the same
    /// file object.
    pub fn duplicate(&self) -> FileHandle {
        lock(&self.file.inner.state).handles += 1;
        lock(&self.pnp.inner.files.inner.handles)
            .entry(self.file.process().pid())
            .or_default()
            .push(self.file.clone());
        FileHandle {
            pnp: self.pnp.clone(),
            file: self.file.clone(),
        }
    }

    /// `CloseHandle`: the last handle's close sends `file_cleanup` in the
    /// process's context; `file_close` follows when no request references
    /// the file any more.
    pub fn close(self) {
        let pid = self.file.process().pid();
        let removed = {
            let mut table = lock(&self.pnp.inner.files.inner.handles);
            let entries = table.entry(pid).or_default();
            let at = entries
                .iter()
                .position(|f| Arc::ptr_eq(&f.inner, &self.file.inner));
            at.map(|i| entries.remove(i))
        };
        if let Some(file) = removed {
            close_handle(&file);
        }
    }
}

/// Drops one handle of `file`; the last one cleans it up.
fn close_handle(file: &FileObject) {
    let cleanup = {
        let mut s = lock(&file.inner.state);
        s.handles = s.handles.saturating_sub(1);
        if s.handles == 0 && !s.cleaned_up {
            s.cleaned_up = true;
            Some(s.layers.clone())
        } else {
            None
        }
    };
    let Some(layers) = cleanup else {
        return;
    };
    {
        // IRP_MJ_CLEANUP runs in the closing process's context.
        let _process = enter_process(file.process());
        for (_, cb) in &layers {
            cb.file_cleanup(file);
        }
    }
    // The handles' reference: CLOSE now if no request is in flight.
    file.release(false);
}

impl PnpManager {
    /// The verifier of this host.
    fn verifier(&self) -> Verifier {
        self.inner.verifier.clone()
    }

    /// Runs `IRP_MJ_CLOSE` that a request's completion makes due as a host
    /// task of `sched` (set with the PnP manager's scheduler; without one,
    /// it runs at once).
    pub(crate) fn set_file_close_scheduler(&self, sched: SchedulerHandle) {
        *lock(&self.inner.files.inner.closer) = Some(sched);
    }

    /// Calls `hook` with the devnode each time a file object on it closes
    /// (removal waiting for the last handle listens here).
    pub fn on_file_closed(&self, hook: impl Fn(DevNodeId) + Send + Sync + 'static) {
        lock(&self.inner.files.inner.on_closed).push(Arc::new(hook));
    }

    /// Handles open on `node`'s devnode now, in every process (what
    /// query-remove and removal after a surprise removal wait on).
    pub fn open_handle_count(&self, node: DevNodeId) -> usize {
        self.inner.files.open_handles_on(node)
    }

    /// File objects on `node` not yet closed (handles open, or requests on
    /// a cleaned-up file still in flight).
    pub fn file_object_count(&self, node: DevNodeId) -> usize {
        self.inner.files.files_on(node)
    }

    /// `CreateFile` on the devnode `node` as `process`: `IRP_MJ_CREATE`
    /// through the stack (see the module doc). Fails with the status of
    /// the layer that refused, `STATUS_NO_SUCH_DEVICE` or
    /// `STATUS_DELETE_PENDING` for a device not started, or
    /// [`PROCESS_IS_TERMINATING`] for an exited process.
    pub fn open_file(&self, process: &Process, node: DevNodeId) -> Result<FileHandle, NtStatus> {
        crate::irql::check_max("IRP_MJ_CREATE", Irql::PASSIVE);
        if process.has_exited() {
            return Err(PROCESS_IS_TERMINATING);
        }
        match self.state(node) {
            Some(PnpState::Started) => {}
            Some(PnpState::SurpriseRemoved | PnpState::Removed) | None => {
                return Err(NO_SUCH_DEVICE);
            }
            Some(_) => return Err(DELETE_PENDING),
        }
        // The I/O manager's access check comes before any driver sees the
        // create (`crate::security`).
        if let Some(descriptor) = self.security(node) {
            descriptor.access_check(process.token(), AccessMask::READ_WRITE)?;
        }
        // Top-down, down to the function driver (which completes the
        // create; KMDF filters pass it on).
        let roles = self.stack_services(node);
        let layers: Layers = self
            .layers(node)
            .into_iter()
            .zip(roles)
            .rev()
            .filter(|((service, _), _)| &**service != HOST_PDO)
            .scan(false, |below_function, (layer, (_, role))| {
                if *below_function {
                    return None;
                }
                *below_function = role == StackRole::Function;
                Some(layer)
            })
            .collect();
        let table = &self.inner.files;
        let file = FileObject {
            inner: Arc::new(FileInner {
                id: table.inner.next_id.fetch_add(1, Ordering::Relaxed) + 1,
                node,
                process: process.clone(),
                contexts: Mutex::new(BTreeMap::new()),
                state: Mutex::new(FileState::default()),
                table: Arc::downgrade(&table.inner),
            }),
        };
        let mut accepted: Layers = Vec::new();
        {
            let _process = enter_process(process);
            for (service, cb) in layers {
                let status = cb.file_create(&file);
                if !status.is_success() {
                    let _system_thread = enter_arbitrary_thread();
                    for (_, cb) in &accepted {
                        cb.file_close(&file);
                    }
                    return Err(status);
                }
                accepted.push((service, cb));
            }
        }
        {
            let mut s = lock(&file.inner.state);
            s.handles = 1;
            s.references = 1;
            s.layers = accepted;
        }
        lock(&table.inner.files).insert(file.id(), file.clone());
        lock(&table.inner.handles)
            .entry(process.pid())
            .or_default()
            .push(file.clone());
        Ok(FileHandle {
            pnp: self.clone(),
            file,
        })
    }

    /// `CreateFile` on the first device with an enabled interface of
    /// `class` (the path `SetupDiGetDeviceInterfaceDetail` gives).
    pub fn open_interface(
        &self,
        process: &Process,
        class: WinGuid,
    ) -> Result<FileHandle, NtStatus> {
        let node = self
            .devices_with_interface(class)
            .into_iter()
            .next()
            .ok_or(NO_SUCH_DEVICE)?;
        self.open_file(process, node)
    }

    /// Handles `process` holds now, on every device.
    pub fn process_handle_count(&self, process: &Process) -> usize {
        lock(&self.inner.files.inner.handles)
            .get(&process.pid())
            .map_or(0, Vec::len)
    }

    /// Process exit, as the I/O manager and the process manager do it: the
    /// process's requests still pending are cancelled (`IoCancelIrp`;
    /// those a power-managed queue still holds are completed with
    /// `STATUS_CANCELLED` by the framework, dropping their request
    /// context), then every handle it holds is closed (the last one of a file
    /// object sends `file_cleanup` in its context), then its address space
    /// goes. Pages still locked then are
    /// [`ViolationKind::ProcessHasLockedPages`], one per driver that holds
    /// them. Returns the pages still locked.
    pub fn exit_process(&self, process: &Process) -> usize {
        crate::irql::check_max("process exit", Irql::PASSIVE);
        let handles = lock(&self.inner.files.inner.handles)
            .remove(&process.pid())
            .unwrap_or_default();
        // The process's threads' I/O is cancelled before the handle table
        // is run down.
        let files: Vec<FileObject> = lock(&self.inner.files.inner.files)
            .values()
            .filter(|f| f.process().space().same_space(process.space()))
            .cloned()
            .collect();
        for file in &files {
            let sent = std::mem::take(&mut lock(&file.inner.state).sent);
            for request in sent.iter().filter(|r| !r.is_done()) {
                request.cancel();
            }
        }
        // Requests still in a power-managed queue (held below D0) belong
        // to the framework, which completes them cancelled itself.
        self.complete_canceled_held();
        for file in &handles {
            close_handle(file);
        }
        let locked = process.exit();
        for (driver, pages) in process.space().locked_pages_by_driver() {
            self.inner.verifier.report(
                driver.as_deref(),
                ViolationKind::ProcessHasLockedPages {
                    pid: process.pid(),
                    pages,
                },
            );
        }
        locked
    }
}
