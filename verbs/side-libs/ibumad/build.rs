//! The soname and the symbol versions (`libibumad.map`) of the library.

fn main() {
    println!("cargo:rerun-if-changed=libibumad.map");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux") {
        return;
    }
    let manifest_dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libibumad.so.3");
    println!("cargo:rustc-cdylib-link-arg=-Wl,--version-script={manifest_dir}/libibumad.map");
}
