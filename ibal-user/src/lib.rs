//! User-mode access library: opens a CA through the proxy, binds the ABI
//! version, loads the UVP the kernel names, and runs verbs with the plug-in's
//! pre/post hooks (implementer's guide Table 10-1).
//!
//! Status: not written yet. The crate exists so the workspace has its final
//! shape; it exports nothing.
