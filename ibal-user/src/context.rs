//! Enumerating the HCAs and opening one: a [`Context`] (one `OpenCa`).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use ib_types::event::AsyncEventRecord;
use ib_types::interface::InterfaceVersion;
use ib_types::ioctl::{
    self as v, Empty, OpenCaIn, OpenCaOut, PROXY_ABI_VERSION, RESPONSE_HEADER_SIZE, Verb,
};
use ib_types::status::IbStatus;
use ib_types::uvp::UserVerbsProvider;

use crate::device::{DeviceFile, DeviceIo, DevicePath, OsStatus};
use crate::error::{ERROR_REVISION_MISMATCH, Error, Result, STATUS_REVISION_MISMATCH};
use crate::plugin::{LINKED_UVP_NAME, LoadedPlugin, PluginError};
use crate::proxy::{self, Failure, ROOM};

/// Which HCA to open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaSelector {
    /// The `n`th enabled interface, in the OS's order.
    Index(usize),
    /// The HCA whose node GUID is this (host order).
    Guid(u64),
}

/// Where the CA's UVP plugin comes from.
#[derive(Clone)]
pub enum PluginSource {
    /// No plugin: control verbs through the proxy only.
    None,
    /// The `uvp-plugin` crate linked into this program (the kernel must
    /// name it, [`LINKED_UVP_NAME`]): a new [`linked_provider`] per open.
    Linked,
    /// The linked plugin as the caller built it (for instance wrapped in
    /// `uvp_plugin::faults::FaultInjector` by a test); the kernel must
    /// name it, as for [`Linked`](Self::Linked).
    LinkedProvider(Arc<dyn UserVerbsProvider>),
    /// The plugin the kernel names, loaded from this verified directory
    /// ([`crate::plugin`]).
    Directory(PathBuf),
}

impl core::fmt::Debug for PluginSource {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::None => f.write_str("None"),
            Self::Linked => f.write_str("Linked"),
            Self::LinkedProvider(_) => f.write_str("LinkedProvider(..)"),
            Self::Directory(dir) => f.debug_tuple("Directory").field(dir).finish(),
        }
    }
}

/// The process memory the plugin lays its rings out in: the seam's.
struct SeamMemory(Arc<dyn DeviceIo>);

impl uvp_plugin::UserMemory for SeamMemory {
    fn alloc(&self, len: usize) -> Option<u64> {
        self.0.alloc(len).ok()
    }

    fn free(&self, va: u64) {
        self.0.free(va);
    }
}

/// A new instance of the linked plugin over the seam `io`: its rings in
/// the process's memory, its doorbell stores through the seam.
pub fn linked_provider(io: &Arc<dyn DeviceIo>) -> uvp_plugin::Provider {
    uvp_plugin::Provider::new(seam_platform(io))
}

/// The plugin's platform over the seam `io`: its memory and doorbell hook.
fn seam_platform(io: &Arc<dyn DeviceIo>) -> uvp_plugin::Platform {
    uvp_plugin::Platform {
        memory: Arc::new(SeamMemory(Arc::clone(io))),
        #[cfg(not(windows))]
        mmio: io.doorbell_hook(),
    }
}

/// What an HCA says about itself at open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaInfo {
    /// The interface path it was opened through.
    pub path: DevicePath,
    /// The kernel's answer to `OpenCa`.
    pub open: OpenCaOut,
}

impl CaInfo {
    /// The CA's node GUID (host order).
    pub fn guid(&self) -> u64 {
        self.open.ca_guid.get()
    }
}

/// Every HCA with an enabled interface, each opened and closed again to
/// learn its identity (an HCA refusing the open is skipped).
pub fn list_cas(io: &Arc<dyn DeviceIo>) -> Result<Vec<CaInfo>> {
    let paths = io.interface_paths().map_err(|status| Error::Os {
        what: "enumerating the HCA interfaces",
        status,
    })?;
    let mut cas = Vec::with_capacity(paths.len());
    for path in paths {
        if let Ok(context) = Context::open_path(io, &path, &PluginSource::None) {
            cas.push(context.info.clone());
        }
    }
    Ok(cas)
}

/// One open CA (one `OpenCa` on one handle). Every object borrows it;
/// dropping it closes the CA (`CloseCa`) and then the handle.
///
/// `Send + Sync`: its calls are `DeviceIoControl`s on a handle, which any
/// thread may issue at any time.
pub struct Context {
    pub(crate) io: Arc<dyn DeviceIo>,
    pub(crate) file: Box<dyn DeviceFile>,
    pub(crate) ca: u64,
    info: CaInfo,
    /// The plugin every verb is called through; `None` only without one
    /// (and inside `Drop`).
    pub(crate) uvp: Option<Arc<dyn UserVerbsProvider>>,
    /// The same plugin when it is the linked one ([`PluginSource::Linked`]):
    /// its QPs and CQs hand out fast paths the objects hold, so a post or
    /// poll finds no handle (a plugin behind the DLL table, or wrapped by
    /// the caller, is called by handle).
    pub(crate) linked: Option<Arc<uvp_plugin::Provider>>,
    /// The plugin's library, unloaded after `uvp` is released.
    loaded: Option<LoadedPlugin>,
    /// `CloseCa` was sent ([`Context::close`]): the drop sends no other.
    closed: AtomicBool,
}

impl core::fmt::Debug for Context {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Context")
            .field("ca", &self.ca)
            .field("info", &self.info)
            .field("plugin", &self.uvp.is_some())
            .field("loaded", &self.loaded)
            .finish_non_exhaustive()
    }
}

impl Context {
    /// Opens the HCA `selector` names, with its plugin from `plugin`.
    pub fn open(
        io: &Arc<dyn DeviceIo>,
        selector: CaSelector,
        plugin: &PluginSource,
    ) -> Result<Self> {
        let paths = io.interface_paths().map_err(|status| Error::Os {
            what: "enumerating the HCA interfaces",
            status,
        })?;
        match selector {
            CaSelector::Index(i) => {
                let path = paths
                    .get(i)
                    .ok_or_else(|| Error::NoSuchCa(format!("index {i}")))?;
                Self::open_path(io, path, plugin)
            }
            CaSelector::Guid(guid) => {
                for path in &paths {
                    let context = Self::open_path(io, path, &PluginSource::None)?;
                    if context.info.guid() == guid {
                        drop(context);
                        return Self::open_path(io, path, plugin);
                    }
                }
                Err(Error::NoSuchCa(format!("GUID {guid:#018x}")))
            }
        }
    }

    /// Opens the HCA at `path`: the handle, then `OpenCa`, whose version is
    /// checked on both sides (the proxy refuses ours with
    /// `STATUS_REVISION_MISMATCH`; we refuse an answer whose version does
    /// not satisfy ours, closing the CA the kernel opened).
    pub fn open_path(
        io: &Arc<dyn DeviceIo>,
        path: &DevicePath,
        plugin: &PluginSource,
    ) -> Result<Self> {
        let file = io.open(path).map_err(|status| Error::Os {
            what: "opening the HCA",
            status,
        })?;
        let mismatch = |kernel| Error::AbiMismatch {
            library: PROXY_ABI_VERSION,
            kernel,
        };
        // The plugin comes first: `OpenCa` itself goes through its hooks
        // (its post takes the context's limits and doorbell page).
        let linked = matches!(plugin, PluginSource::Linked).then(|| Arc::new(linked_provider(io)));
        let uvp: Option<Arc<dyn UserVerbsProvider>> = match plugin {
            PluginSource::Linked => linked
                .as_ref()
                .map(|p| Arc::clone(p) as Arc<dyn UserVerbsProvider>),
            PluginSource::LinkedProvider(uvp) => Some(Arc::clone(uvp)),
            PluginSource::None | PluginSource::Directory(_) => None,
        };
        let loaded = None;
        let answer = match proxy::run::<v::OpenCa>(
            &*file,
            uvp.as_deref(),
            0,
            &OpenCaIn::CURRENT,
            if uvp.is_some() { 0 } else { ROOM },
        ) {
            Ok(answer) => answer,
            Err(Failure::Os(
                OsStatus::Nt(STATUS_REVISION_MISMATCH) | OsStatus::Win32(ERROR_REVISION_MISMATCH),
            )) => return Err(mismatch(None)),
            Err(Failure::Malformed { error, bytes }) => {
                // The context the kernel opened is closed already.
                let version = bytes
                    .get(RESPONSE_HEADER_SIZE..RESPONSE_HEADER_SIZE + 2)
                    .map(|b| InterfaceVersion::from_packed(u16::from_le_bytes([b[0], b[1]])));
                return Err(match version {
                    Some(kernel) if kernel.check(PROXY_ABI_VERSION).is_err() => {
                        mismatch(Some(kernel))
                    }
                    _ => error,
                });
            }
            Err(failure) => return Err(failure.into_error()),
        };
        let mut context = Self {
            io: Arc::clone(io),
            file,
            ca: answer.handle,
            info: CaInfo {
                path: path.clone(),
                open: answer.output,
            },
            uvp,
            linked,
            loaded,
            closed: AtomicBool::new(false),
        };
        // Dropping `context` on an error below closes the CA.
        let name = context.info.open.uvp_name;
        match plugin {
            PluginSource::None => {}
            PluginSource::Linked | PluginSource::LinkedProvider(_) => {
                if name.as_str() != LINKED_UVP_NAME {
                    return Err(PluginError::NotLinked(name.as_str().to_owned()).into());
                }
            }
            PluginSource::Directory(dir) => {
                // Loaded after the open, which names it: this open went
                // without hooks, so it is closed and opened again through
                // the loaded plugin's.
                // On Linux the loaded library reaches the process and the
                // device through the seam's platform, handed over at load.
                let platform = cfg!(not(windows)).then(|| seam_platform(io));
                let loaded = LoadedPlugin::load(dir, &name, platform)?;
                let uvp = loaded.provider();
                drop(context);
                let file = io.open(path).map_err(|status| Error::Os {
                    what: "opening the HCA",
                    status,
                })?;
                let answer = proxy::call::<v::OpenCa>(&*file, Some(&*uvp), 0, &OpenCaIn::CURRENT)?;
                context = Self {
                    io: Arc::clone(io),
                    file,
                    ca: answer.handle,
                    info: CaInfo {
                        path: path.clone(),
                        open: answer.output,
                    },
                    uvp: Some(uvp),
                    linked: None,
                    loaded: Some(loaded),
                    closed: AtomicBool::new(false),
                };
            }
        }
        Ok(context)
    }

    /// The plugin, if any.
    pub(crate) fn uvp(&self) -> Option<&dyn UserVerbsProvider> {
        self.uvp.as_deref()
    }

    /// Calls `V` on `target` as Table 10-1 prescribes (through the
    /// plugin's hooks; `crate::proxy`).
    pub(crate) fn call<V: Verb>(&self, target: u64, input: &V::In) -> Result<proxy::Answer<V>> {
        proxy::call::<V>(&*self.file, self.uvp(), target, input)
    }

    /// The plugin, or `NeedsPlugin(what)`.
    pub(crate) fn plugin(&self, what: &'static str) -> Result<&dyn UserVerbsProvider> {
        self.uvp().ok_or(Error::NeedsPlugin(what))
    }

    /// What the CA said at open.
    pub fn info(&self) -> &CaInfo {
        &self.info
    }

    /// The CA handle (the proxy's, of this open).
    pub fn handle(&self) -> u64 {
        self.ca
    }

    /// True when the fast path (post, poll, arm, user rings) is available.
    pub fn has_fast_path(&self) -> bool {
        self.uvp.is_some()
    }

    /// The plugin loaded from a directory, if any.
    pub fn loaded_plugin(&self) -> Option<&LoadedPlugin> {
        self.loaded.as_ref()
    }

    /// The CA's attribute block (`QueryCa`'s private output, the
    /// `ib_types::ca` layout), retried once with the size the kernel
    /// reports when it did not fit.
    pub fn query_raw(&self) -> Result<Vec<u8>> {
        let mut room = 4096u32;
        loop {
            match proxy::run::<v::QueryCa>(&*self.file, self.uvp(), self.ca, &Empty, room) {
                Ok(answer) => return Ok(answer.private),
                Err(Failure::Status {
                    status: IbStatus::Overflow,
                    output: Some(out),
                }) if out.total_size > room => room = out.total_size,
                Err(failure) => return Err(failure.into_error()),
            }
        }
    }

    /// Waits for the CA's next asynchronous event (`GetAsyncEvent`): an
    /// event of one of this context's QPs, CQs or SRQs, or of a port. The
    /// kernel keeps events that arrive with no wait pending, so none is
    /// lost between two calls. Blocks the calling thread.
    pub fn async_event(&self) -> Result<AsyncEventRecord> {
        let answer = self.call::<v::GetAsyncEvent>(self.ca, &Empty)?;
        Ok(answer.output)
    }

    /// Closes the CA now (`CloseCa`), while other threads may still hold
    /// the context: a wait of this context pending in another thread
    /// ([`async_event`](Self::async_event)) ends with `Canceled`, as the
    /// kernel ends its waits at close, and every later call on the context
    /// or its objects fails with the kernel's invalid-handle status.
    /// Dropping the context then closes nothing more. The owner's way to
    /// end a thread blocked in `async_event` (the seam offers no
    /// `CancelIoEx`). A second close does nothing.
    pub fn close(&self) -> Result<()> {
        if self.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        self.call::<v::CloseCa>(self.ca, &Empty).map(drop)
    }

    /// Process memory the device may pin.
    pub(crate) fn alloc(&self, len: usize) -> Result<u64> {
        self.io.alloc(len).map_err(|status| Error::Os {
            what: "allocating memory",
            status,
        })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // Every object borrowed the context, so all are destroyed by now.
        // `CloseCa`'s post drops the plugin's context (its view of the UAR
        // page) once the kernel closed it; then the plugin instance is
        // released, then its library unloaded.
        if !self.closed.swap(true, Ordering::AcqRel) {
            let _ = self.call::<v::CloseCa>(self.ca, &Empty);
        }
        drop(self.linked.take());
        drop(self.uvp.take());
        drop(self.loaded.take());
    }
}
