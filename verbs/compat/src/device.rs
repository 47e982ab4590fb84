//! The device list, and opening and closing a device.

use std::ffi::{c_char, c_int, c_void};
use std::mem::size_of;
use std::sync::Arc;

use ibal_user::{CaSelector, list_cas};
use ibverbs_abi::{IbvContext, IbvDevice, VERBS_ABI_IS_EXTENDED, VerbsContext};

use crate::async_events::AsyncEvents;
use crate::query::{query_device_ex, query_port_ex};
use crate::state::{
    Context, NoMachine, context_at, device_at, device_for, forget_context, forget_list, machine,
    remember_context, remember_list,
};
use crate::util::{errno_of, guard, set_errno};

/// `ibv_get_device_list(num_devices)`: the machine's HCAs, booting it on
/// the first call. A NULL-terminated array the caller frees with
/// [`ibv_free_device_list`]; `*num_devices` (when not NULL) is its length.
/// NULL with `errno` when there is no machine (`ENOSYS`, as rdma-core
/// without kernel support), it did not boot (`ENODEV`) or the HCAs cannot
/// be listed.
///
/// # Safety
///
/// `num_devices` is NULL or valid for a write.
pub unsafe extern "C" fn ibv_get_device_list(num_devices: *mut c_int) -> *mut *mut IbvDevice {
    guard(std::ptr::null_mut(), || {
        let machine = match machine() {
            Ok(machine) => machine,
            Err(NoMachine::NotRegistered) => {
                set_errno(libc::ENOSYS);
                return std::ptr::null_mut();
            }
            Err(NoMachine::BootFailed) => {
                set_errno(libc::ENODEV);
                return std::ptr::null_mut();
            }
        };
        let cas = match list_cas(&machine.io()) {
            Ok(cas) => cas,
            Err(error) => {
                set_errno(errno_of(&error));
                return std::ptr::null_mut();
            }
        };
        let devices: Vec<*mut IbvDevice> = cas
            .iter()
            .map(|ca| device_for(ca.guid()).as_ptr())
            .collect();
        // A C array (the caller may hold it as long as it likes), freed by
        // `ibv_free_device_list`.
        // SAFETY: `calloc` has no preconditions; the result is checked.
        let list = unsafe { libc::calloc(devices.len() + 1, size_of::<*mut IbvDevice>()) }
            .cast::<*mut IbvDevice>();
        if list.is_null() {
            set_errno(libc::ENOMEM);
            return std::ptr::null_mut();
        }
        // SAFETY: `list` holds `devices.len() + 1` zeroed pointers, so the
        // first `devices.len()` are ours to fill.
        let slots = unsafe { std::slice::from_raw_parts_mut(list, devices.len()) };
        slots.copy_from_slice(&devices);
        if !num_devices.is_null() {
            // SAFETY: non-NULL, valid for a write (the contract).
            unsafe { num_devices.write(c_int::try_from(devices.len()).unwrap_or(c_int::MAX)) };
        }
        remember_list(list);
        list
    })
}

/// `ibv_free_device_list(list)`: frees a list [`ibv_get_device_list`]
/// returned (the devices stay valid). NULL, or a pointer that is not such
/// a list, is left alone.
///
/// # Safety
///
/// None beyond C's: the pointer is checked against the lists handed out.
pub unsafe extern "C" fn ibv_free_device_list(list: *mut *mut IbvDevice) {
    guard((), || {
        if forget_list(list) {
            // SAFETY: `list` came from `calloc` in `ibv_get_device_list`
            // and was not freed before (it was still recorded).
            unsafe { libc::free(list.cast::<c_void>()) };
        }
    });
}

/// `ibv_get_device_name(device)`: its name (`simhca0`, ...); NULL (with
/// `errno = EINVAL`) for NULL or a device that is not ours.
///
/// # Safety
///
/// None beyond C's: the pointer is checked against the devices listed.
pub unsafe extern "C" fn ibv_get_device_name(device: *mut IbvDevice) -> *const c_char {
    guard(std::ptr::null(), || match device_at(device) {
        Some(device) => device.raw.name.as_ptr(),
        None => {
            set_errno(libc::EINVAL);
            std::ptr::null()
        }
    })
}

/// `ibv_get_device_guid(device)`: its node GUID in network byte order; 0
/// (with `errno = EINVAL`) for NULL or a device that is not ours.
///
/// # Safety
///
/// None beyond C's: the pointer is checked against the devices listed.
pub unsafe extern "C" fn ibv_get_device_guid(device: *mut IbvDevice) -> u64 {
    guard(0, || match device_at(device) {
        Some(device) => device.guid.to_be(),
        None => {
            set_errno(libc::EINVAL);
            0
        }
    })
}

/// `ibv_open_device(device)`: opens the HCA through the access library
/// (`OpenCa`, with the machine's plugin). NULL with `errno`: `EINVAL` for
/// NULL or a device that is not ours, else the open's error.
///
/// # Safety
///
/// None beyond C's: the pointer is checked against the devices listed.
pub unsafe extern "C" fn ibv_open_device(device: *mut IbvDevice) -> *mut IbvContext {
    guard(std::ptr::null_mut(), || {
        let Some(device) = device_at(device) else {
            set_errno(libc::EINVAL);
            return std::ptr::null_mut();
        };
        let Ok(machine) = machine() else {
            set_errno(libc::ENODEV);
            return std::ptr::null_mut();
        };
        let ca = match ibal_user::Context::open(
            &machine.io(),
            CaSelector::Guid(device.guid),
            &machine.plugin(),
        ) {
            Ok(ca) => ca,
            Err(error) => {
                set_errno(errno_of(&error));
                return std::ptr::null_mut();
            }
        };
        let events = match AsyncEvents::new() {
            Ok(events) => events,
            Err(errno) => {
                set_errno(errno);
                return std::ptr::null_mut();
            }
        };
        let context = Arc::new(Context {
            verbs: new_verbs_context(device.as_ptr(), events.raw_fd()),
            ca: Arc::new(ca),
            device,
            events,
        });
        if let Err(errno) = context.events.start(Arc::clone(&context.ca)) {
            set_errno(errno);
            return std::ptr::null_mut();
        }
        remember_context(context)
    })
}

/// The `verbs_context` of a new context on `device`: extended
/// (`abi_compat` all ones), its size covering every member, the extended
/// operations the surveyed tools' inlines reach (`query_port`,
/// `query_device_ex`), and `async_fd` the context's event descriptor; the
/// other operations stay NULL, which the inlines turn into a fallback or
/// `EOPNOTSUPP` (docs/libibverbs.md).
fn new_verbs_context(device: *mut IbvDevice, async_fd: c_int) -> VerbsContext {
    VerbsContext {
        query_port: Some(query_port_ex),
        advise_mr: None,
        alloc_null_mr: None,
        read_counters: None,
        attach_counters_point_flow: None,
        create_counters: None,
        destroy_counters: None,
        reg_dm_mr: None,
        alloc_dm: None,
        free_dm: None,
        modify_flow_action_esp: None,
        destroy_flow_action: None,
        create_flow_action_esp: None,
        modify_qp_rate_limit: None,
        alloc_parent_domain: None,
        dealloc_td: None,
        alloc_td: None,
        modify_cq: None,
        post_srq_ops: None,
        destroy_rwq_ind_table: None,
        create_rwq_ind_table: None,
        destroy_wq: None,
        modify_wq: None,
        create_wq: None,
        query_rt_values: None,
        create_cq_ex: None,
        priv_: std::ptr::null_mut(),
        query_device_ex: Some(query_device_ex),
        ibv_destroy_flow: None,
        abi_placeholder2: None,
        ibv_create_flow: None,
        abi_placeholder1: None,
        open_qp: None,
        create_qp_ex: None,
        get_srq_num: None,
        create_srq_ex: None,
        open_xrcd: None,
        close_xrcd: None,
        _abi_placeholder3: 0,
        sz: size_of::<VerbsContext>(),
        context: IbvContext {
            device,
            ops: ibverbs_abi::IbvContextOps {
                _compat_query_device: None,
                _compat_query_port: None,
                _compat_alloc_pd: None,
                _compat_dealloc_pd: None,
                _compat_reg_mr: None,
                _compat_rereg_mr: None,
                _compat_dereg_mr: None,
                alloc_mw: None,
                bind_mw: None,
                dealloc_mw: None,
                _compat_create_cq: None,
                poll_cq: Some(crate::cq::poll_cq),
                req_notify_cq: Some(crate::cq::req_notify_cq),
                _compat_cq_event: None,
                _compat_resize_cq: None,
                _compat_destroy_cq: None,
                _compat_create_srq: None,
                _compat_modify_srq: None,
                _compat_query_srq: None,
                _compat_destroy_srq: None,
                post_srq_recv: Some(crate::srq::post_srq_recv),
                _compat_create_qp: None,
                _compat_query_qp: None,
                _compat_modify_qp: None,
                _compat_destroy_qp: None,
                post_send: Some(crate::qp::post_send),
                post_recv: Some(crate::qp::post_recv),
                _compat_create_ah: None,
                _compat_destroy_ah: None,
                _compat_attach_mcast: None,
                _compat_detach_mcast: None,
                _compat_async_event: None,
            },
            // No kernel command descriptor: the verbs go through the
            // access library.
            cmd_fd: -1,
            async_fd,
            num_comp_vectors: 1,
            // PTHREAD_MUTEX_INITIALIZER is all zeros in glibc.
            mutex: Default::default(),
            abi_compat: VERBS_ABI_IS_EXTENDED as *mut c_void,
        },
    }
}

/// `ibv_close_device(context)`: closes the HCA (`CloseCa`) once no call
/// on the context is running. 0, or -1 with `errno = EINVAL` for NULL or a
/// context that is not open.
///
/// # Safety
///
/// None beyond C's: the pointer is checked against the open contexts.
pub unsafe extern "C" fn ibv_close_device(context: *mut IbvContext) -> c_int {
    guard(-1, || match forget_context(context) {
        Some(context) => {
            drop(context);
            0
        }
        None => {
            set_errno(libc::EINVAL);
            -1
        }
    })
}

/// The open context `ptr` names, or `errno = EINVAL`.
pub(crate) fn open_context(ptr: *const IbvContext) -> Result<Arc<Context>, c_int> {
    context_at(ptr).ok_or(libc::EINVAL)
}
