//! rdma-core 44's libibverbs ABI (`<infiniband/verbs.h>`) as `#[repr(C)]` Rust.
//!
//! Programs compiled against rdma-core call some verbs through `static inline`
//! functions that read the library's objects directly (`ibv_post_send` jumps
//! through `qp->context->ops.post_send`, `ibv_query_port` looks for the
//! `verbs_context` placed just before the `ibv_context`, ...). A library that
//! stands in for `libibverbs.so.1` must therefore lay its objects out exactly
//! as the header does. These are the mirrors of the structs and constants that
//! Debian's `ibverbs-utils` and `perftest` reach (docs/libibverbs.md), written
//! from the header's meaning: explicit integer widths, C enums as `u32`/`i32`
//! aliases with their values as constants under the C names, pointers as raw
//! pointers and function pointers as `Option<unsafe extern "C" fn>`.
//!
//! Every struct carries a compile-time size assertion; the test
//! `tests/layout_against_headers.rs` compiles a C program over the installed
//! header and checks every mirrored field offset, every size and alignment,
//! and every constant against it.
//!
//! Layouts are those of Linux glibc on x86_64 and aarch64, the two targets
//! rdma-core's Debian packages serve; `pthread_mutex_t` is the one type whose
//! size differs between them.

#![no_std]
#![forbid(unsafe_code)]

mod attr;
mod consts;
mod context;
mod objects;
mod opaque;
mod wr;

pub use attr::*;
pub use consts::*;
pub use context::*;
pub use objects::*;
pub use opaque::*;
pub use wr::*;

/// glibc's `pthread_mutex_t` (opaque; only its size and alignment matter here).
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
pub type PthreadMutex = [u64; 5];
/// glibc's `pthread_mutex_t` (opaque; only its size and alignment matter here).
#[cfg(all(target_os = "linux", target_arch = "aarch64"))]
pub type PthreadMutex = [u64; 6];
#[cfg(not(all(
    target_os = "linux",
    any(target_arch = "x86_64", target_arch = "aarch64")
)))]
compile_error!(
    "ibverbs-abi mirrors rdma-core's layouts for Linux glibc on x86_64 and aarch64 only"
);

/// glibc's `pthread_cond_t` (opaque: 48 bytes, 8-aligned on both targets).
pub type PthreadCond = [u64; 6];
