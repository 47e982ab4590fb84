//! What the side libraries perftest links share (docs/libibverbs.md, "Side
//! libraries").
//!
//! Each side library is a cdylib exporting C entry points under rdma-core's
//! symbol versions (`mlx5dv_open_device@MLX5_1.7`, ...). rustc gives every
//! cdylib an anonymous version script listing its `#[no_mangle]` symbols, and
//! a symbol named there stays unversioned whatever the crate's own script
//! says. So the entry points are plain Rust functions, and
//! [`export_versioned!`] defines each C name as an assembler alias of one:
//! only the crate's version script (passed by its `build.rs`) names it, and
//! the linker puts it in the node that script gives.

#![cfg_attr(not(feature = "testing"), no_std)]

#[cfg(feature = "testing")]
pub mod testing;

/// Exports `$function` under the C symbol `$symbol` (whose version node the
/// crate's linker version script assigns).
///
/// `$function` must be an `extern "C" fn` with the C prototype of `$symbol`.
#[macro_export]
macro_rules! export_versioned {
    ($($symbol:literal => $function:path;)*) => {$(
        ::core::arch::global_asm!(
            concat!(".globl ", $symbol),
            concat!(".type ", $symbol, ", @function"),
            concat!(".set ", $symbol, ", {function}"),
            function = sym $function,
        );
    )*};
}

/// Sets the calling thread's `errno`, which C callers read after a failed
/// call.
pub fn set_errno(code: i32) {
    // SAFETY: `__errno_location` has no preconditions.
    let errno = unsafe { libc::__errno_location() };
    // SAFETY: it points to the calling thread's `errno`, valid for writes
    // for the thread's lifetime.
    unsafe { *errno = code };
}

/// `EOPNOTSUPP`: the operation needs a device this stack does not have.
pub const EOPNOTSUPP: i32 = libc::EOPNOTSUPP;
/// `ENOSYS`: the service (the RDMA connection manager) is not provided.
pub const ENOSYS: i32 = libc::ENOSYS;
