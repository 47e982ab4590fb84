//! Windows builds configure the WDK (bindings, link flags) and compile the
//! KMDF shell's SEH shim (`src/kmdf/probe.c`) with the WDK's include paths
//! and preprocessor definitions; other hosts build nothing here, because
//! wdk-build cannot run without the WDK. **Never run yet** (no Windows
//! here): the first Windows build checks the shim's flags.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    #[cfg(windows)]
    {
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
    }
    Ok(())
}
