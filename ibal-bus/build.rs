//! Builds for a Windows target configure the WDK (bindings, link flags);
//! builds for other targets do nothing here. The decision follows the
//! *target* (`CARGO_CFG_TARGET_OS`), so `cargo xtask wdk-check`, which
//! builds for Windows from Linux against a stand-in WDK, runs this script
//! too (with the `wdk-cross-check` feature supplying the build dependency
//! a non-Windows host lacks), as it does the miniport's.

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
        wdk_build::configure_wdk_binary_build()?;
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
