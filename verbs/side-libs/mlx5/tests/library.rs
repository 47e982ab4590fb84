//! The built `libmlx5.so.1` against Debian's perftest: its exports and
//! soname, perftest loading it, and each entry point's answer.

use std::ffi::{c_int, c_void};
use std::path::PathBuf;
use std::ptr::null_mut;

use verbs_side_support::set_errno;
use verbs_side_support::testing::{
    assert_exports_exactly_the_tools_imports, assert_tool_runs_as_with_debian, built_cdylib,
};

const SONAME: &str = "libmlx5.so.1";
/// `EOPNOTSUPP` on Linux, written out rather than taken from the library.
const EOPNOTSUPP: i32 = 95;

fn library() -> PathBuf {
    built_cdylib("libmlx5.so")
}

#[test]
fn it_exports_exactly_the_mlx5dv_symbols_debians_tools_import_with_their_versions() {
    assert_exports_exactly_the_tools_imports(&library(), SONAME, &["MLX5_"]);
}

#[test]
fn perftest_loads_it_and_prints_its_usage_as_with_debians_libmlx5() {
    let scratch = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("verbs-side-mlx5");
    assert_tool_runs_as_with_debian(&library(), SONAME, &scratch, "ib_write_bw", &["--help"]);
}

fn last_errno() -> Option<i32> {
    std::io::Error::last_os_error().raw_os_error()
}

#[test]
fn every_entry_point_answers_not_supported() {
    // SAFETY: loading our own library runs no initialisers besides Rust's.
    let lib = unsafe { libloading::Library::new(library()) }.unwrap();
    type Ptr2 = unsafe extern "C" fn(*mut c_void, *mut c_void) -> *mut c_void;
    type Ptr3 = unsafe extern "C" fn(*mut c_void, *mut c_void, *mut c_void) -> *mut c_void;
    type Ptr1 = unsafe extern "C" fn(*mut c_void) -> *mut c_void;
    type Int1 = unsafe extern "C" fn(*mut c_void) -> c_int;
    type Int2 = unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int;
    type Devx =
        unsafe extern "C" fn(*mut c_void, *const c_void, usize, *mut c_void, usize) -> c_int;

    for name in ["mlx5dv_open_device", "mlx5dv_dek_create"] {
        // SAFETY: the symbol has this prototype (src/lib.rs).
        let function = unsafe { lib.get::<Ptr2>(name.as_bytes()) }.unwrap();
        set_errno(0);
        // SAFETY: the entry point reads none of its arguments.
        let result = unsafe { function(null_mut(), null_mut()) };
        assert!(result.is_null(), "{name}");
        assert_eq!(last_errno(), Some(EOPNOTSUPP), "{name}");
    }
    // SAFETY: the symbol has this prototype.
    let create_qp = unsafe { lib.get::<Ptr3>(b"mlx5dv_create_qp") }.unwrap();
    set_errno(0);
    // SAFETY: the entry point reads none of its arguments.
    assert!(unsafe { create_qp(null_mut(), null_mut(), null_mut()) }.is_null());
    assert_eq!(last_errno(), Some(EOPNOTSUPP));
    for name in ["mlx5dv_create_mkey", "mlx5dv_qp_ex_from_ibv_qp_ex"] {
        // SAFETY: the symbol has this prototype.
        let function = unsafe { lib.get::<Ptr1>(name.as_bytes()) }.unwrap();
        set_errno(0);
        // SAFETY: the entry point reads none of its arguments.
        assert!(unsafe { function(null_mut()) }.is_null(), "{name}");
        assert_eq!(last_errno(), Some(EOPNOTSUPP), "{name}");
    }
    for name in ["mlx5dv_destroy_mkey", "mlx5dv_dek_destroy"] {
        // SAFETY: the symbol has this prototype.
        let function = unsafe { lib.get::<Int1>(name.as_bytes()) }.unwrap();
        // SAFETY: the entry point reads none of its arguments.
        assert_eq!(unsafe { function(null_mut()) }, EOPNOTSUPP, "{name}");
    }
    // SAFETY: the symbol has this prototype.
    let crypto_login = unsafe { lib.get::<Int2>(b"mlx5dv_crypto_login") }.unwrap();
    // SAFETY: the entry point reads none of its arguments.
    assert_eq!(unsafe { crypto_login(null_mut(), null_mut()) }, EOPNOTSUPP);
    // SAFETY: the symbol has this prototype.
    let devx = unsafe { lib.get::<Devx>(b"mlx5dv_devx_general_cmd") }.unwrap();
    // SAFETY: the entry point reads none of its arguments.
    let status = unsafe { devx(null_mut(), std::ptr::null(), 0, null_mut(), 0) };
    // perftest reads a non-zero status as "ask ibv_query_device instead".
    assert_eq!(status, EOPNOTSUPP);
}
