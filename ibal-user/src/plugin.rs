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

use std::path::{Path, PathBuf};

use ib_types::interface::{InterfaceVersion, UvpName};

/// The plugin interface version this library drives.
pub const UVP_INTERFACE_VERSION: InterfaceVersion = InterfaceVersion::new(1, 0);

/// The exported entry point every plugin has: `extern "C" fn() -> u16`,
/// the packed interface version it implements. Provisional: the plugin's
/// interface table (issue 12, in progress in `uvp-plugin`) replaces it
/// with its get-interface entry point.
pub const UVP_VERSION_SYMBOL: &[u8] = b"uvp_interface_version\0";

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

/// A plugin loaded by absolute path, its version checked. Unloaded when
/// dropped (after every object of its context).
#[derive(Debug)]
pub struct LoadedPlugin {
    path: PathBuf,
    version: InterfaceVersion,
    _library: libloading::Library,
}

impl LoadedPlugin {
    /// Loads plugin `name` from the verified directory `dir`.
    pub fn load(dir: &Path, name: &UvpName) -> Result<Self, PluginError> {
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
        // signature (`UVP_VERSION_SYMBOL`); the library stays loaded while
        // the symbol is used (it is called once, here).
        let entry = unsafe { library.get::<extern "C" fn() -> u16>(UVP_VERSION_SYMBOL) }
            .map_err(|_| PluginError::NoEntryPoint(path.clone()))?;
        let version = InterfaceVersion::from_packed(entry());
        if version.check(UVP_INTERFACE_VERSION).is_err() {
            return Err(PluginError::Version {
                found: version,
                required: UVP_INTERFACE_VERSION,
            });
        }
        Ok(Self {
            path,
            version,
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
}
