//! Loading the UVP the kernel names, from a verified directory only.
//!
//! The kernel reports the plugin's name in `OpenCa`'s answer
//! (`OpenCaOut::uvp_name`, also in the CI identity the bus filter reads):
//! a bare base name of `[A-Za-z0-9_-]` (checked when the answer decodes,
//! `ib_types::interface::UvpName`), so it can name no directory. The
//! library joins it to a directory the caller vouches for (the driver
//! package's directory, or a configured path), canonicalizes the result,
//! requires it to be a regular file still inside that directory (no
//! symbolic link out of it), and loads it by that absolute path: never by
//! bare name, so the DLL search order is never consulted. The plugin's
//! entry point then reports its interface version, which must satisfy
//! [`UVP_INTERFACE_VERSION`].
//!
//! On Linux (the simulated host) there is no device page for the plugin to
//! map, and the loaded library has its own copy of every static: the
//! library hands it the seam's process memory and doorbell store through
//! its exported `uvp_set_platform` (`uvp_plugin::export::PlatformAbi`, a C
//! record) right before `uvp_get_interface`, then clears it again, so only
//! the new instance holds it. On Windows the plugin allocates and rings the
//! page the kernel mapped itself, and no platform is handed over.

use std::path::{Path, PathBuf};

use std::sync::Arc;

use ib_types::interface::{InterfaceVersion, UvpName};
use ib_types::status::NtStatus;
use ib_types::uvp::{
    UVP_HOOK_SLOTS, UserVerbsProvider, UvpGetInterfaceFn, UvpInterface, UvpVerbHooks,
};
use uvp_plugin::Platform;
use uvp_plugin::export::Table;

/// The plugin interface version this library drives.
pub const UVP_INTERFACE_VERSION: InterfaceVersion = ib_types::uvp::UVP_INTERFACE_VERSION;

/// The exported entry point every plugin has
/// (`ib_types::uvp::UVP_GET_INTERFACE_SYMBOL`, a [`UvpGetInterfaceFn`]),
/// NUL-terminated for the loader.
pub const UVP_ENTRY_SYMBOL: &[u8] = b"uvp_get_interface\0";

/// The name the kernel reports for the plugin linked into this library
/// (the `uvp-plugin` crate, `hca_miniport_core::verbs::UVP_NAME`).
pub const LINKED_UVP_NAME: &str = "uvp_plugin";

/// Why a plugin was not loaded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PluginError {
    /// No file of the plugin's name in the verified directory.
    #[error("plugin {name} not found in {dir:?}")]
    Absent {
        /// The kernel's name.
        name: String,
        /// The directory.
        dir: PathBuf,
    },
    /// The file resolves outside the verified directory or is no regular
    /// file.
    #[error("plugin path {0:?} leaves the verified directory or is no file")]
    Unverified(PathBuf),
    /// The OS loader refused the file.
    #[error("the loader refused {path:?}: {reason}")]
    Load {
        /// The file.
        path: PathBuf,
        /// The loader's message.
        reason: String,
    },
    /// The file exports no entry point.
    #[error("{0:?} exports no UVP entry point")]
    NoEntryPoint(PathBuf),
    /// A platform was to be handed over (Linux) and the file exports no
    /// `uvp_set_platform`.
    #[error("{0:?} exports no uvp_set_platform")]
    NoPlatformEntryPoint(PathBuf),
    /// The entry point refused the library's version or its table.
    #[error("{path:?}'s entry point answered {status:?}")]
    Refused {
        /// The file.
        path: PathBuf,
        /// Its status.
        status: NtStatus,
    },
    /// The table the plugin filled is too small or lacks an entry point.
    #[error("{path:?} filled an unusable table: {reason}")]
    Table {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The plugin's interface version does not satisfy the library's.
    #[error("the plugin implements interface {found:?}, the library needs {required:?}")]
    Version {
        /// The plugin's.
        found: InterfaceVersion,
        /// The library's.
        required: InterfaceVersion,
    },
    /// The kernel names another plugin than the one linked in.
    #[error("the kernel names plugin {0}, not the linked {LINKED_UVP_NAME}")]
    NotLinked(String),
}

/// The file name of plugin `name` on this OS.
pub fn file_name(name: &UvpName) -> String {
    if cfg!(windows) {
        format!("{}.dll", name.as_str())
    } else {
        format!("lib{}.so", name.as_str())
    }
}

/// The absolute path of plugin `name` in `dir`, verified: it exists, is a
/// regular file, and (symbolic links resolved) is inside `dir`.
pub fn verified_path(dir: &Path, name: &UvpName) -> Result<PathBuf, PluginError> {
    let absent = || PluginError::Absent {
        name: name.as_str().to_owned(),
        dir: dir.to_owned(),
    };
    let dir = dir.canonicalize().map_err(|_| absent())?;
    let path = dir
        .join(file_name(name))
        .canonicalize()
        .map_err(|_| absent())?;
    let is_file = path.metadata().map(|m| m.is_file()).unwrap_or(false);
    if path.parent() != Some(dir.as_path()) || !is_file {
        return Err(PluginError::Unverified(path));
    }
    Ok(path)
}

/// A table for the plugin to fill: empty.
fn empty_table() -> UvpInterface {
    UvpInterface {
        size: 0,
        version: 0,
        reserved_at_0x6: 0,
        context: core::ptr::null_mut(),
        release: None,
        hooks: [UvpVerbHooks {
            pre: None,
            post: None,
        }; UVP_HOOK_SLOTS],
        post_send: None,
        post_recv: None,
        post_srq_recv: None,
        poll_cq: None,
        arm_cq: None,
    }
}

/// A plugin loaded by absolute path: its interface table, checked, held as
/// a provider. Unloaded when dropped (after every object of its context,
/// and after the table is released).
pub struct LoadedPlugin {
    path: PathBuf,
    version: InterfaceVersion,
    table: Arc<Table>,
    // Last: unloaded after the table's release ran.
    _library: libloading::Library,
}

impl core::fmt::Debug for LoadedPlugin {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("LoadedPlugin")
            .field("path", &self.path)
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

/// Serializes handing a platform to a loaded library and taking its table:
/// one library (loaded twice, it is one) serves one platform at a time.
#[cfg(not(windows))]
static PLATFORM_HANDOVER: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Hands `platform` to the library's `uvp_set_platform`, runs `take` (which
/// calls its entry point), then clears the library's platform again.
#[cfg(not(windows))]
fn with_platform<T>(
    library: &libloading::Library,
    path: &Path,
    platform: Platform,
    take: impl FnOnce() -> T,
) -> Result<T, PluginError> {
    use uvp_plugin::export::{PlatformAbi, UVP_SET_PLATFORM_SYMBOL, UvpSetPlatformFn};
    // SAFETY: the symbol's type is the documented `UvpSetPlatformFn`; the
    // library stays loaded while it is called (here).
    let set = unsafe { library.get::<UvpSetPlatformFn>(UVP_SET_PLATFORM_SYMBOL) }
        .map_err(|_| PluginError::NoPlatformEntryPoint(path.to_owned()))?;
    let _handover = PLATFORM_HANDOVER.lock().unwrap_or_else(|p| p.into_inner());
    let abi = PlatformAbi::new(platform);
    // SAFETY: `abi` keeps `PlatformAbi`'s contract (`PlatformAbi::new`);
    // on success the library owns it.
    let status = unsafe { set(&abi) };
    if status.is_error() {
        abi.release_unused();
        return Err(PluginError::Refused {
            path: path.to_owned(),
            status,
        });
    }
    let taken = take();
    // SAFETY: null clears the library's platform (the instance `take` made
    // keeps its own reference).
    unsafe { set(core::ptr::null()) };
    Ok(taken)
}

impl LoadedPlugin {
    /// Loads plugin `name` from the verified directory `dir` and takes its
    /// table from `uvp_get_interface`, checked with
    /// [`UvpInterface::check`]. On Linux a `platform` (the seam's memory
    /// and doorbell store) is handed to the library's `uvp_set_platform`
    /// first, which it must then export; on Windows `platform` is not used
    /// (the plugin maps and allocates for itself).
    pub fn load(
        dir: &Path,
        name: &UvpName,
        platform: Option<Platform>,
    ) -> Result<Self, PluginError> {
        let path = verified_path(dir, name)?;
        // SAFETY: loading runs the library's initializers. The path is a
        // regular file inside the directory the caller vouches for as the
        // driver package's (or its configured plugin directory), the trust
        // every plugin host gives the DLL it loads.
        let library =
            unsafe { libloading::Library::new(&path) }.map_err(|e| PluginError::Load {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        // SAFETY: the symbol's type is the entry point's documented
        // signature (`ib_types::uvp::UvpGetInterfaceFn`); the library stays
        // loaded while it is called (here, once).
        let entry = unsafe { library.get::<UvpGetInterfaceFn>(UVP_ENTRY_SYMBOL) }
            .map_err(|_| PluginError::NoEntryPoint(path.clone()))?;
        let mut table = empty_table();
        let get = |table: &mut UvpInterface| {
            // SAFETY: `table` is writable memory for one `UvpInterface`, as
            // the entry point requires.
            unsafe { entry(UVP_INTERFACE_VERSION.packed(), table) }
        };
        #[cfg(not(windows))]
        let status = match platform {
            Some(platform) => with_platform(&library, &path, platform, || get(&mut table))?,
            None => get(&mut table),
        };
        #[cfg(windows)]
        let status = {
            drop(platform);
            get(&mut table)
        };
        if status.is_error() {
            return Err(PluginError::Refused { path, status });
        }
        let version = InterfaceVersion::from_packed(table.version);
        if let Err(e) = table.check(UVP_INTERFACE_VERSION) {
            if let Some(release) = table.release {
                // SAFETY: the instance the entry point just created, which
                // nothing else holds, released once.
                unsafe { release(table.context) };
            }
            return Err(if version.check(UVP_INTERFACE_VERSION).is_err() {
                PluginError::Version {
                    found: version,
                    required: UVP_INTERFACE_VERSION,
                }
            } else {
                PluginError::Table {
                    path,
                    reason: e.to_string(),
                }
            });
        }
        // SAFETY: the plugin's entry point filled the table (checked
        // above); it is released only by the `Table`, which is dropped
        // before the library is unloaded (field order; the context drops
        // its clone first).
        let table = unsafe { Table::new(table) }.map_err(|e| PluginError::Table {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        Ok(Self {
            path,
            version,
            table: Arc::new(table),
            _library: library,
        })
    }

    /// The absolute path it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its interface version.
    pub fn version(&self) -> InterfaceVersion {
        self.version
    }

    /// The plugin as the library calls it.
    pub fn provider(&self) -> Arc<dyn UserVerbsProvider> {
        Arc::clone(&self.table) as Arc<dyn UserVerbsProvider>
    }
}
