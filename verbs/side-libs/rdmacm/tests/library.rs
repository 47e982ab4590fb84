//! The built `librdmacm.so.1` against Debian's perftest and librdmacm: its
//! exports and soname, perftest loading it, and each entry point's answer.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::path::PathBuf;
use std::ptr::null_mut;

use verbs_side_support::set_errno;
use verbs_side_support::testing::{
    assert_exports_exactly_the_tools_imports, assert_tool_runs_as_with_debian, built_cdylib,
};

const SONAME: &str = "librdmacm.so.1";
/// `ENOSYS` on Linux, written out rather than taken from the library.
const ENOSYS: i32 = 38;

fn library() -> PathBuf {
    built_cdylib("librdmacm.so")
}

#[test]
fn it_exports_exactly_the_rdma_cm_symbols_debians_tools_import_with_their_versions() {
    assert_exports_exactly_the_tools_imports(&library(), SONAME, &["RDMACM_"]);
}

#[test]
fn perftest_loads_it_and_prints_its_usage_as_with_debians_librdmacm() {
    let scratch = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("verbs-side-rdmacm");
    assert_tool_runs_as_with_debian(&library(), SONAME, &scratch, "ib_atomic_bw", &["--help"]);
}

fn last_errno() -> Option<i32> {
    std::io::Error::last_os_error().raw_os_error()
}

#[test]
fn the_connection_manager_answers_not_implemented() {
    // SAFETY: loading our own library runs no initialisers besides Rust's.
    let lib = unsafe { libloading::Library::new(library()) }.unwrap();
    type CreateChannel = unsafe extern "C" fn() -> *mut c_void;
    type OneArgument = unsafe extern "C" fn(*mut c_void) -> c_int;
    type TwoArguments = unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int;
    type GetAddrInfo = unsafe extern "C" fn(
        *const c_char,
        *const c_char,
        *const c_void,
        *mut *mut c_void,
    ) -> c_int;

    // SAFETY: the symbol has this prototype (src/lib.rs).
    let create_channel = unsafe { lib.get::<CreateChannel>(b"rdma_create_event_channel") }.unwrap();
    set_errno(0);
    // SAFETY: no arguments.
    assert!(unsafe { create_channel() }.is_null());
    assert_eq!(last_errno(), Some(ENOSYS));

    for name in ["rdma_destroy_id", "rdma_disconnect", "rdma_ack_cm_event"] {
        // SAFETY: the symbol has this prototype (src/lib.rs).
        let function = unsafe { lib.get::<OneArgument>(name.as_bytes()) }.unwrap();
        set_errno(0);
        // SAFETY: the entry point reads none of its arguments.
        assert_eq!(unsafe { function(null_mut()) }, -1, "{name}");
        assert_eq!(last_errno(), Some(ENOSYS), "{name}");
    }
    for name in [
        "rdma_bind_addr",
        "rdma_connect",
        "rdma_accept",
        "rdma_get_cm_event",
    ] {
        // SAFETY: the symbol has this prototype (src/lib.rs).
        let function = unsafe { lib.get::<TwoArguments>(name.as_bytes()) }.unwrap();
        set_errno(0);
        // SAFETY: the entry point reads none of its arguments.
        assert_eq!(unsafe { function(null_mut(), null_mut()) }, -1, "{name}");
        assert_eq!(last_errno(), Some(ENOSYS), "{name}");
    }

    // SAFETY: the symbol has this prototype (src/lib.rs).
    let getaddrinfo = unsafe { lib.get::<GetAddrInfo>(b"rdma_getaddrinfo") }.unwrap();
    let mut result: *mut c_void = null_mut();
    set_errno(0);
    // SAFETY: valid C strings and a valid place for the result.
    let status = unsafe {
        getaddrinfo(
            c"127.0.0.1".as_ptr(),
            c"18515".as_ptr(),
            std::ptr::null(),
            &mut result,
        )
    };
    assert_eq!((status, last_errno()), (-1, Some(ENOSYS)));
    assert!(result.is_null(), "nothing to free");
}

#[test]
fn event_names_match_debians_librdmacm() {
    type EventStr = unsafe extern "C" fn(u32) -> *const c_char;
    // SAFETY: loading our own library runs no initialisers besides Rust's.
    let ours = unsafe { libloading::Library::new(library()) }.unwrap();
    // SAFETY: Debian's librdmacm (a perftest dependency) only registers
    // its own state when loaded.
    let debian = unsafe { libloading::Library::new("/usr/lib/x86_64-linux-gnu/librdmacm.so.1") }
        .or_else(|_| {
            // SAFETY: as above, found through the loader's search path.
            unsafe { libloading::Library::new("librdmacm.so.1") }
        })
        .expect("Debian's librdmacm1 (a perftest dependency) is installed");
    // SAFETY: both symbols have this prototype (rdma_cma.h).
    let ours = unsafe { ours.get::<EventStr>(b"rdma_event_str") }.unwrap();
    // SAFETY: as above.
    let debian = unsafe { debian.get::<EventStr>(b"rdma_event_str") }.unwrap();
    for event in (0..20).chain([u32::MAX]) {
        // SAFETY: takes any number.
        let our_name = unsafe { ours(event) };
        // SAFETY: takes any number.
        let debian_name = unsafe { debian(event) };
        // SAFETY: both return a static NUL-terminated string.
        let our_name = unsafe { CStr::from_ptr(our_name) };
        // SAFETY: as above.
        let debian_name = unsafe { CStr::from_ptr(debian_name) };
        assert_eq!(our_name, debian_name, "event {event}");
    }
}
