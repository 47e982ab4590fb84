//! The built `libefa.so.1` against Debian's perftest: its exports and
//! soname, perftest loading it, and each entry point's answer.

use std::ffi::{c_int, c_void};
use std::path::PathBuf;
use std::ptr::null_mut;

use verbs_side_support::set_errno;
use verbs_side_support::testing::{
    assert_exports_exactly_the_tools_imports, assert_tool_runs_as_with_debian, built_cdylib,
};

const SONAME: &str = "libefa.so.1";
/// `EOPNOTSUPP` on Linux, written out rather than taken from the library.
const EOPNOTSUPP: i32 = 95;

fn library() -> PathBuf {
    built_cdylib("libefa.so")
}

#[test]
fn it_exports_exactly_the_efadv_symbols_debians_tools_import_with_their_versions() {
    assert_exports_exactly_the_tools_imports(&library(), SONAME, &["EFA_"]);
}

#[test]
fn perftest_loads_it_and_prints_its_usage_as_with_debians_libefa() {
    let scratch = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("verbs-side-efa");
    assert_tool_runs_as_with_debian(&library(), SONAME, &scratch, "ib_read_bw", &["--help"]);
}

#[test]
fn every_entry_point_answers_not_supported() {
    // SAFETY: loading our own library runs no initialisers besides Rust's.
    let lib = unsafe { libloading::Library::new(library()) }.unwrap();
    type QueryDevice = unsafe extern "C" fn(*mut c_void, *mut c_void, u32) -> c_int;
    type CreateQpEx =
        unsafe extern "C" fn(*mut c_void, *mut c_void, *mut c_void, u32) -> *mut c_void;

    // SAFETY: the symbol has this prototype (src/lib.rs).
    let query_device = unsafe { lib.get::<QueryDevice>(b"efadv_query_device") }.unwrap();
    // SAFETY: the entry point reads none of its arguments.
    let status = unsafe { query_device(null_mut(), null_mut(), 0) };
    assert_eq!(status, EOPNOTSUPP);

    // SAFETY: the symbol has this prototype (src/lib.rs).
    let create_qp_ex = unsafe { lib.get::<CreateQpEx>(b"efadv_create_qp_ex") }.unwrap();
    set_errno(0);
    // SAFETY: the entry point reads none of its arguments.
    assert!(unsafe { create_qp_ex(null_mut(), null_mut(), null_mut(), 0) }.is_null());
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(EOPNOTSUPP)
    );
}
