//! The built `libibumad.so.3` against Debian's perftest: its exports and
//! soname, the send tests loading it, and each entry point's answer.

use std::ffi::{c_char, c_int, c_void};
use std::path::PathBuf;

use verbs_side_support::set_errno;
use verbs_side_support::testing::{
    assert_exports_exactly_the_tools_imports, assert_tool_runs_as_with_debian, built_cdylib,
};

const SONAME: &str = "libibumad.so.3";
/// `EOPNOTSUPP` on Linux, written out rather than taken from the library.
const EOPNOTSUPP: i32 = 95;

fn library() -> PathBuf {
    built_cdylib("libibumad.so")
}

#[test]
fn it_exports_exactly_the_umad_symbols_debians_tools_import_with_their_versions() {
    assert_exports_exactly_the_tools_imports(&library(), SONAME, &["IBUMAD_"]);
}

#[test]
fn the_send_tests_load_it_and_print_their_usage_as_with_debians_libibumad() {
    let scratch = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("verbs-side-ibumad");
    assert_tool_runs_as_with_debian(&library(), SONAME, &scratch, "ib_send_bw", &["--help"]);
    assert_tool_runs_as_with_debian(&library(), SONAME, &scratch, "ib_send_lat", &["--help"]);
}

#[test]
fn mad_services_answer_not_supported_and_the_layout_helpers_answer_the_abi() {
    // SAFETY: loading our own library runs no initialisers besides Rust's.
    let lib = unsafe { libloading::Library::new(library()) }.unwrap();
    type Init = unsafe extern "C" fn() -> c_int;
    type OpenPort = unsafe extern "C" fn(*const c_char, c_int) -> c_int;
    type Size = unsafe extern "C" fn() -> usize;
    type GetMad = unsafe extern "C" fn(*mut c_void) -> *mut c_void;

    // SAFETY: the symbol has this prototype (src/lib.rs).
    let init = unsafe { lib.get::<Init>(b"umad_init") }.unwrap();
    set_errno(0);
    // SAFETY: no arguments.
    assert_eq!(unsafe { init() }, -EOPNOTSUPP);
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(EOPNOTSUPP)
    );

    // SAFETY: the symbol has this prototype (src/lib.rs).
    let open_port = unsafe { lib.get::<OpenPort>(b"umad_open_port") }.unwrap();
    // SAFETY: a valid C string.
    assert_eq!(unsafe { open_port(c"rocep0".as_ptr(), 1) }, -EOPNOTSUPP);

    // SAFETY: the symbol has this prototype (src/lib.rs).
    let size = unsafe { lib.get::<Size>(b"umad_size") }.unwrap();
    // SAFETY: no arguments.
    let header = unsafe { size() };
    // struct ib_user_mad: agent_id, status, timeout_ms, retries, length
    // (4 bytes each), then ib_mad_addr (44 bytes), then the MAD.
    assert_eq!(header, 64);
    // SAFETY: the symbol has this prototype (src/lib.rs).
    let get_mad = unsafe { lib.get::<GetMad>(b"umad_get_mad") }.unwrap();
    let mut buffer = [0u8; 64 + 256];
    let base = buffer.as_mut_ptr().cast::<c_void>();
    // SAFETY: the entry point only computes an address inside the buffer.
    let mad = unsafe { get_mad(base) };
    assert_eq!(mad as usize - base as usize, 64);
}
