//! The logic of our `libibverbs.so.1` (issue 14, docs/libibverbs.md):
//! rdma-core's `ibv_*` entry points in Rust over the access library
//! (`ibal-user`) and the plugin it loads.
//!
//! **The machine seam.** The library does not know where its HCAs come
//! from: a [`Machine`] gives it the access library's OS seam
//! ([`ibal_user::DeviceIo`]) and the plugin source. On Windows that is
//! `ibal_user::WindowsIo`; on Linux the simulator-side cdylib
//! (`verbs/sim-lib`, `libibverbs.so.1`) registers a [`BootFn`] that boots
//! the process's own simulated machine, which the library calls on first
//! use ([`set_boot`]). This crate never depends on a simulator.
//!
//! **Objects.** A program holds pointers to rdma-core's structs and reads
//! them directly (`verbs.h`'s inline functions): each is the
//! [`ibverbs_abi`] struct at the front of one of our allocations, found
//! again by its address in a registry (so a pointer that is not ours is
//! refused with `EINVAL`, never dereferenced as ours). QPs, CQs, SRQs
//! and address handles, which the data path reaches on every post, poll
//! and UD send, live in tables of slots instead (the `slots` module): found by arithmetic on the pointer, no
//! lock, lookup or allocation, a destroyed one's pointer still refused. A context is a
//! [`VerbsContext`](ibverbs_abi::VerbsContext) followed by its
//! `ibv_context`, `abi_compat` all ones and `sz` covering `query_port`, so
//! the `ibv_query_port` inline reaches [`query`]'s extended entry.
//!
//! **Entry points.** Every one validates its arguments (NULL, an object
//! that is not ours, a bad port or index) and answers as rdma-core does
//! (NULL or -1 with `errno`, or an errno value, per verb); none unwinds
//! across the C boundary (a panic becomes `EIO`). The C names and their
//! symbol versions come from [`export_libibverbs!`], which the cdylib
//! invokes, and the version script `libibverbs.map` beside this crate.
//!
//! **This milestone:** the device list, open and close, the queries
//! `ibv_devinfo` and `ibv_devices` make, protection domains, address
//! handles and the registration of the program's own memory (the `memory` module's docs:
//! how the C objects own the access library's), completion queues and
//! completion channels (real file descriptors, `cq`'s module docs), queue
//! pairs and the data path (`qp`'s module docs), shared receive queues
//! (`srq`'s module docs), asynchronous events (`async_fd` a real file
//! descriptor, `async_events`' module docs). The other entry points the
//! surveyed tools import exist (the binaries are linked `BIND_NOW`) and
//! answer "not supported" ([`unsupported`]).

mod ah;
mod async_events;
mod cq;
mod device;
mod event_fd;
mod memory;
mod qp;
pub mod query;
mod slots;
mod srq;
mod state;
pub mod unsupported;
mod util;

pub use ah::{ibv_create_ah, ibv_create_ah_from_wc, ibv_destroy_ah, ibv_init_ah_from_wc};
pub use async_events::{ibv_ack_async_event, ibv_get_async_event};
pub use cq::{
    ibv_ack_cq_events, ibv_create_comp_channel, ibv_create_cq, ibv_destroy_comp_channel,
    ibv_destroy_cq, ibv_get_cq_event,
};
pub use device::{
    ibv_close_device, ibv_free_device_list, ibv_get_device_guid, ibv_get_device_list,
    ibv_get_device_name, ibv_open_device,
};
pub use memory::{ibv_alloc_pd, ibv_dealloc_pd, ibv_dereg_mr, ibv_reg_mr, ibv_reg_mr_iova2};
pub use qp::{ibv_create_qp, ibv_destroy_qp, ibv_modify_qp, ibv_query_qp};
pub use query::{
    _ibv_query_gid_ex, ibv_query_device, ibv_query_gid, ibv_query_gid_type, ibv_query_pkey,
    ibv_query_port,
};
pub use srq::{ibv_create_srq, ibv_destroy_srq, ibv_modify_srq, ibv_query_srq};
pub use state::{BootFn, Machine, set_boot};
pub use util::{ibv_read_sysfs_file, ibv_wc_status_str};

/// Defines the C symbol `$symbol` in the invoking crate as a jump to
/// `$function` (an `extern "C" fn` of this crate with `$symbol`'s C
/// prototype), whose version node the linker's version script gives.
///
/// The side libraries alias their C names (`.set`, verbs-side-support's
/// `export_versioned!`), which works because the alias and the function
/// sit in the same object; here the functions are in this crate and the
/// names in the cdylib's, and an alias of a symbol another object defines
/// stays undefined. A tail jump keeps every argument register and the
/// stack as the caller left them, and names the function as an ordinary
/// reference the linker resolves from this crate's rlib. As with
/// `export_versioned!`, the names are not `#[no_mangle]`, so rustc's own
/// version script does not list them (it would leave them unversioned).
#[doc(hidden)]
#[macro_export]
macro_rules! __export_jump {
    ($($symbol:literal => $function:path;)*) => {$(
        #[cfg(target_arch = "x86_64")]
        ::core::arch::global_asm!(
            ".pushsection .text",
            concat!(".globl ", $symbol),
            concat!(".type ", $symbol, ", @function"),
            ".p2align 4",
            concat!($symbol, ":"),
            "jmp {function}",
            concat!(".size ", $symbol, ", . - ", $symbol),
            ".popsection",
            function = sym $function,
        );
        #[cfg(target_arch = "aarch64")]
        ::core::arch::global_asm!(
            ".pushsection .text",
            concat!(".globl ", $symbol),
            concat!(".type ", $symbol, ", %function"),
            ".p2align 2",
            concat!($symbol, ":"),
            "b {function}",
            concat!(".size ", $symbol, ", . - ", $symbol),
            ".popsection",
            function = sym $function,
        );
    )*};
}

/// Exports every entry point under its C name (the cdylib that is
/// `libibverbs.so.1` invokes it once); `libibverbs.map` gives each its
/// version node.
#[macro_export]
macro_rules! export_libibverbs {
    () => {
        $crate::__export_jump! {
            "ibv_get_device_list" => $crate::ibv_get_device_list;
            "ibv_free_device_list" => $crate::ibv_free_device_list;
            "ibv_get_device_name" => $crate::ibv_get_device_name;
            "ibv_get_device_guid" => $crate::ibv_get_device_guid;
            "ibv_open_device" => $crate::ibv_open_device;
            "ibv_close_device" => $crate::ibv_close_device;
            "ibv_query_device" => $crate::ibv_query_device;
            "ibv_query_port" => $crate::ibv_query_port;
            "ibv_query_gid" => $crate::ibv_query_gid;
            "ibv_query_gid_type" => $crate::ibv_query_gid_type;
            "_ibv_query_gid_ex" => $crate::_ibv_query_gid_ex;
            "ibv_query_pkey" => $crate::ibv_query_pkey;
            "ibv_read_sysfs_file" => $crate::ibv_read_sysfs_file;
            "ibv_wc_status_str" => $crate::ibv_wc_status_str;
            "ibv_create_comp_channel" => $crate::ibv_create_comp_channel;
            "ibv_destroy_comp_channel" => $crate::ibv_destroy_comp_channel;
            "ibv_alloc_pd" => $crate::ibv_alloc_pd;
            "ibv_dealloc_pd" => $crate::ibv_dealloc_pd;
            "ibv_reg_mr" => $crate::ibv_reg_mr;
            "ibv_reg_mr_iova2" => $crate::ibv_reg_mr_iova2;
            "ibv_dereg_mr" => $crate::ibv_dereg_mr;
            "ibv_create_cq" => $crate::ibv_create_cq;
            "ibv_destroy_cq" => $crate::ibv_destroy_cq;
            "ibv_get_cq_event" => $crate::ibv_get_cq_event;
            "ibv_ack_cq_events" => $crate::ibv_ack_cq_events;
            "ibv_create_qp" => $crate::ibv_create_qp;
            "ibv_destroy_qp" => $crate::ibv_destroy_qp;
            "ibv_modify_qp" => $crate::ibv_modify_qp;
            "ibv_query_qp" => $crate::ibv_query_qp;
            "ibv_qp_to_qp_ex" => $crate::unsupported::ibv_qp_to_qp_ex;
            "ibv_create_srq" => $crate::ibv_create_srq;
            "ibv_modify_srq" => $crate::ibv_modify_srq;
            "ibv_query_srq" => $crate::ibv_query_srq;
            "ibv_destroy_srq" => $crate::ibv_destroy_srq;
            "ibv_create_ah" => $crate::ibv_create_ah;
            "ibv_create_ah_from_wc" => $crate::ibv_create_ah_from_wc;
            "ibv_init_ah_from_wc" => $crate::ibv_init_ah_from_wc;
            "ibv_destroy_ah" => $crate::ibv_destroy_ah;
            "ibv_get_async_event" => $crate::ibv_get_async_event;
            "ibv_ack_async_event" => $crate::ibv_ack_async_event;
            "ibv_attach_mcast" => $crate::unsupported::ibv_attach_mcast;
            "ibv_detach_mcast" => $crate::unsupported::ibv_detach_mcast;
        }
    };
}
