//! Enumerating the HCAs and opening one: a [`Context`] (one `OpenCa`).

use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

use hca_prm::uverbs::OpenCaPriv;
use ib_types::event::AsyncEventRecord;
use ib_types::interface::InterfaceVersion;
use ib_types::ioctl::{
    self as v, Empty, OpenCaIn, OpenCaOut, PROXY_ABI_VERSION, RESPONSE_HEADER_SIZE,
    ResponseHeaderAbi,
};
use ib_types::status::IbStatus;
use zerocopy::FromBytes;

use crate::device::{DeviceFile, DeviceIo, DevicePath, OsStatus};
use crate::error::{ERROR_REVISION_MISMATCH, Error, Result, STATUS_REVISION_MISMATCH};
use crate::plugin::{LINKED_UVP_NAME, LoadedPlugin, PluginError};
use crate::proxy::{self, ExchangeError, ROOM};

/// Which HCA to open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaSelector {
    /// The `n`th enabled interface, in the OS's order.
    Index(usize),
    /// The HCA whose node GUID is this (host order).
    Guid(u64),
}

/// Where the CA's UVP plugin comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PluginSource {
    /// No plugin: control verbs through the proxy only.
    None,
    /// The `uvp-plugin` crate linked into this program (the kernel must
    /// name it, [`LINKED_UVP_NAME`]).
    Linked,
    /// The plugin the kernel names, loaded from this verified directory
    /// ([`crate::plugin`]).
    Directory(PathBuf),
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

/// The fast-path state of a context with its plugin.
#[derive(Debug)]
pub(crate) struct Fast {
    pub(crate) plugin: uvp_plugin::Context,
    /// The page doorbell records are cut from, and the next free offset.
    records: Mutex<Vec<(u64, usize)>>,
}

const RECORD_PAGE: usize = 4096;

/// One open CA (one `OpenCa` on one handle). Every object borrows it;
/// dropping it closes the CA (`CloseCa`) and then the handle.
///
/// `Send + Sync`: its calls are `DeviceIoControl`s on a handle, which any
/// thread may issue at any time.
#[derive(Debug)]
pub struct Context {
    pub(crate) io: Arc<dyn DeviceIo>,
    pub(crate) file: Box<dyn DeviceFile>,
    pub(crate) ca: u64,
    info: CaInfo,
    pub(crate) fast: Option<Fast>,
    loaded: Option<LoadedPlugin>,
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
        let bytes = match proxy::exchange::<v::OpenCa>(&*file, 0, &OpenCaIn::CURRENT, &[], ROOM) {
            Ok(bytes) => bytes,
            Err(ExchangeError::Os(
                OsStatus::Nt(STATUS_REVISION_MISMATCH) | OsStatus::Win32(ERROR_REVISION_MISMATCH),
            )) => return Err(mismatch(None)),
            Err(ExchangeError::Os(status)) => return Err(proxy::os_failure::<v::OpenCa>(status)),
            Err(ExchangeError::Library(e)) => return Err(e),
        };
        let answer = match proxy::decode::<v::OpenCa>(&bytes) {
            Ok(answer) => answer,
            Err(e) => {
                // The kernel may have opened a context whose answer we
                // refuse: close it, so nothing stays open.
                let header = ResponseHeaderAbi::read_from_prefix(&bytes).ok();
                if let Some((header, _)) = header
                    && header.status.get() == IbStatus::Success as u32
                    && header.handle.get() != 0
                {
                    let _ = proxy::call::<v::CloseCa>(&*file, header.handle.get(), &Empty, &[], 0);
                }
                let version = bytes
                    .get(RESPONSE_HEADER_SIZE..RESPONSE_HEADER_SIZE + 2)
                    .map(|b| InterfaceVersion::from_packed(u16::from_le_bytes([b[0], b[1]])));
                return Err(match version {
                    Some(kernel) if kernel.check(PROXY_ABI_VERSION).is_err() => {
                        mismatch(Some(kernel))
                    }
                    _ => e,
                });
            }
        };
        let mut context = Self {
            io: Arc::clone(io),
            file,
            ca: answer.handle,
            info: CaInfo {
                path: path.clone(),
                open: answer.output,
            },
            fast: None,
            loaded: None,
        };
        // Dropping `context` on an error below closes the CA.
        match plugin {
            PluginSource::None => {}
            PluginSource::Linked => {
                let name = context.info.open.uvp_name;
                if name.as_str() != LINKED_UVP_NAME {
                    return Err(PluginError::NotLinked(name.as_str().to_owned()).into());
                }
                let limits = OpenCaPriv::parse(&answer.private).map_err(|error| Error::Abi {
                    verb: v::VerbId::OpenCa,
                    error,
                })?;
                let doorbell = context.info.open.doorbell.ok_or(Error::Verb {
                    verb: v::VerbId::OpenCa,
                    status: IbStatus::InvalidParameter,
                })?;
                let page = context.io.doorbell_page(doorbell.va);
                context.fast = Some(Fast {
                    plugin: uvp_plugin::Context::new(limits, page),
                    records: Mutex::new(Vec::new()),
                });
            }
            PluginSource::Directory(dir) => {
                context.loaded = Some(LoadedPlugin::load(dir, &context.info.open.uvp_name)?);
            }
        }
        Ok(context)
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
        self.fast.is_some()
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
            let bytes = match proxy::exchange::<v::QueryCa>(&*self.file, self.ca, &Empty, &[], room)
            {
                Ok(bytes) => bytes,
                Err(ExchangeError::Os(status)) => {
                    return Err(proxy::os_failure::<v::QueryCa>(status));
                }
                Err(ExchangeError::Library(e)) => return Err(e),
            };
            let response =
                v::decode_response::<v::QueryCa>(&bytes).map_err(|error| Error::Abi {
                    verb: v::VerbId::QueryCa,
                    error,
                })?;
            match (response.status, response.output) {
                (IbStatus::Success, _) => return Ok(response.private.to_vec()),
                (IbStatus::Overflow, Some(out)) if out.total_size > room => room = out.total_size,
                (status, _) => {
                    return Err(Error::Verb {
                        verb: v::VerbId::QueryCa,
                        status,
                    });
                }
            }
        }
    }

    /// Waits for the CA's next asynchronous event (`GetAsyncEvent`): an
    /// event of one of this context's QPs, CQs or SRQs, or of a port. The
    /// kernel keeps events that arrive with no wait pending, so none is
    /// lost between two calls. Blocks the calling thread.
    pub fn async_event(&self) -> Result<AsyncEventRecord> {
        let answer = proxy::call::<v::GetAsyncEvent>(&*self.file, self.ca, &Empty, &[], 0)?;
        Ok(answer.output)
    }

    /// A 4-byte doorbell record in a page of this process.
    pub(crate) fn record(&self) -> Result<u64> {
        let fast = self
            .fast
            .as_ref()
            .ok_or(Error::NeedsPlugin("a doorbell record"))?;
        let mut pages = fast.records.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((va, used)) = pages.last_mut()
            && *used + 4 <= RECORD_PAGE
        {
            let at = *va + *used as u64;
            *used += 4;
            return Ok(at);
        }
        let va = self.alloc(RECORD_PAGE)?;
        pages.push((va, 4));
        Ok(va)
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
        // The plugin's context (its view of the UAR page) goes before
        // `CloseCa` unmaps the page; the records after it.
        let pages = self.fast.take().map(|fast| {
            drop(fast.plugin);
            fast.records
                .into_inner()
                .unwrap_or_else(PoisonError::into_inner)
        });
        let _ = proxy::call::<v::CloseCa>(&*self.file, self.ca, &Empty, &[], 0);
        for (va, _) in pages.into_iter().flatten() {
            self.io.free(va);
        }
    }
}
