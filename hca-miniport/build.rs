//! Windows builds configure the WDK (bindings, link flags); other hosts build
//! nothing here, because wdk-build cannot run without the WDK.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    #[cfg(windows)]
    wdk_build::configure_wdk_binary_build()?;
    Ok(())
}
