//! The soname and the symbol versions (`verbs/compat/libibverbs.map`, the
//! product's script) of the library.

fn main() {
    let manifest_dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let map = format!("{manifest_dir}/../compat/libibverbs.map");
    println!("cargo:rerun-if-changed={map}");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux") {
        return;
    }
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libibverbs.so.1");
    println!("cargo:rustc-cdylib-link-arg=-Wl,--version-script={map}");
}
