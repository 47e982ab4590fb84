//! Builds for a Windows target configure the WDK (bindings, link flags) and
//! compile the KMDF shell's SEH shim (`src/kmdf/probe.c`) with the WDK's
//! include paths and preprocessor definitions; builds for other targets do
//! nothing here. The decision follows the *target*
//! (`CARGO_CFG_TARGET_OS`), so `cargo xtask wdk-check`, which builds for
//! Windows from Linux against a stand-in WDK, runs this script and
//! compiles the shim too (with its `wdk-cross-check` feature supplying the
//! build dependencies a non-Windows host lacks).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("windows") {
        kmdf::configure()?;
    }
    Ok(())
}

#[cfg(any(windows, feature = "wdk-cross-check"))]
mod kmdf {
    pub(crate) fn configure() -> Result<(), Box<dyn std::error::Error>> {
        let config = wdk_build::Config::from_env_auto()?;
        config.configure_binary_build()?;
        // `MmProbeAndLockPages` and a user-mode
        // `MmMapLockedPagesSpecifyCache` raise on failure; Rust cannot
        // catch SEH, so these two calls live in C under `__try`.
        let mut shim = cc::Build::new();
        shim.file("src/kmdf/probe.c")
            // Kernel-mode C: no CRT, no C++ exceptions, SEH only.
            .flag("/kernel")
            .flag("/GS-")
            .warnings_into_errors(true);
        for path in config.include_paths()? {
            shim.include(path);
        }
        for (name, value) in config.preprocessor_definitions() {
            shim.define(&name, value.as_deref());
        }
        shim.compile("hca_kmdf_probe");
        println!("cargo:rerun-if-changed=src/kmdf/probe.c");
        Ok(())
    }
}

#[cfg(not(any(windows, feature = "wdk-cross-check")))]
mod kmdf {
    pub(crate) fn configure() -> Result<(), Box<dyn std::error::Error>> {
        Err(
            "a Windows target from a non-Windows host needs the WDK build \
             configuration: run `cargo xtask wdk-check` (it type-checks the \
             KMDF shells against a stand-in WDK)"
                .into(),
        )
    }
}
