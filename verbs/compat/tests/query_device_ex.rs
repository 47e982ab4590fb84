//! `ibv_query_device_ex` as the `verbs.h` inline reaches it, called
//! in-process on the embedded simulated machine: the `verbs_context` before
//! the context (`abi_compat` all ones, `sz` covering the slot) offers
//! `query_device_ex`; with `sizeof(struct ibv_device_attr_ex)` it writes the
//! base attributes exactly as `ibv_query_device` does, the extended
//! fields the CA has (`device_cap_flags_ex` the base flags,
//! `phys_port_cnt_ex`) and zero for every other; a larger size (a newer
//! header) gets the bytes past the struct zeroed, a size of `orig_attr`
//! alone gets only those bytes written; a smaller size, NULL attributes,
//! input `comp_mask` bits and a context that is not ours are `EINVAL`.

use std::ffi::c_int;
use std::mem::{offset_of, size_of};
use std::ptr::null;

use ibverbs_abi::{
    IbvContext, IbvDeviceAttr, IbvDeviceAttrEx, IbvQueryDeviceExInput, VERBS_ABI_IS_EXTENDED,
    VerbsContext,
};
use ibverbs_compat::{self as verbs};

mod support;
use support::*;

/// Bytes past `struct ibv_device_attr_ex` a newer header could add.
const NEWER: usize = 24;
/// What the library must not touch.
const UNTOUCHED: u8 = 0xA5;

/// The context's `verbs_context.query_device_ex`, found as the inline finds
/// it.
fn query_device_ex_slot(
    context: *mut IbvContext,
) -> unsafe extern "C" fn(
    *mut IbvContext,
    *const IbvQueryDeviceExInput,
    *mut IbvDeviceAttrEx,
    usize,
) -> c_int {
    let at = offset_of!(VerbsContext, context);
    let vctx = context.cast::<u8>().wrapping_sub(at).cast::<VerbsContext>();
    // SAFETY: the library lays a `verbs_context` out before each context.
    let vctx = unsafe { &*vctx };
    assert_eq!(vctx.context.abi_compat as usize, VERBS_ABI_IS_EXTENDED);
    assert!(vctx.sz >= size_of::<VerbsContext>() - offset_of!(VerbsContext, query_device_ex));
    vctx.query_device_ex.expect("query_device_ex is offered")
}

fn read<T: Copy>(bytes: &[u8], offset: usize) -> T {
    assert!(offset + size_of::<T>() <= bytes.len());
    // SAFETY: in bounds (checked); `T` is a plain-data type.
    unsafe { bytes[offset..].as_ptr().cast::<T>().read_unaligned() }
}

#[test]
fn query_device_ex_fills_what_the_ca_has_and_zeroes_the_rest() {
    let (list, context) = open_the_device(boot);
    let machine = MACHINE.get().unwrap();
    let query_device_ex = query_device_ex_slot(context);
    // SAFETY: all zeros is a valid `ibv_device_attr` (plain data).
    let mut base: IbvDeviceAttr = unsafe { std::mem::zeroed() };
    // SAFETY: `base` is valid for a write.
    assert_eq!(unsafe { verbs::ibv_query_device(context, &mut base) }, 0);
    assert_ne!(base.device_cap_flags, 0);

    // The size a program compiled against a newer header passes.
    let size = size_of::<IbvDeviceAttrEx>();
    let mut bytes = vec![UNTOUCHED; size + NEWER + 8];
    let input = IbvQueryDeviceExInput { comp_mask: 0 };
    // SAFETY: `bytes` holds `size + NEWER` writable bytes.
    let answer =
        unsafe { query_device_ex(context, &input, bytes.as_mut_ptr().cast(), size + NEWER) };
    assert_eq!(answer, 0);
    // (No `PartialEq` on the mirror: every field compared through `Debug`.)
    let same = |got: IbvDeviceAttr| format!("{got:?}") == format!("{base:?}");
    assert!(same(read::<IbvDeviceAttr>(&bytes, 0)), "orig_attr");
    let flags_at = offset_of!(IbvDeviceAttrEx, device_cap_flags_ex);
    let ports_at = offset_of!(IbvDeviceAttrEx, phys_port_cnt_ex);
    assert_eq!(
        read::<u64>(&bytes, flags_at),
        u64::from(base.device_cap_flags)
    );
    assert_eq!(read::<u32>(&bytes, ports_at), u32::from(base.phys_port_cnt));
    // Every other extended byte is zero (ODP, timestamps and the clock,
    // TSO, RSS, WQs, pacing, raw packet, tag matching, CQ moderation,
    // device memory, PCI atomics, `comp_mask`), and so are the newer
    // header's; past `attr_size` nothing is written.
    for (at, &byte) in bytes.iter().enumerate().skip(size_of::<IbvDeviceAttr>()) {
        let in_flags = (flags_at..flags_at + 8).contains(&at);
        let in_ports = (ports_at..ports_at + 4).contains(&at);
        if at >= size + NEWER {
            assert_eq!(byte, UNTOUCHED, "byte {at} past attr_size");
        } else if !in_flags && !in_ports {
            assert_eq!(byte, 0, "byte {at}");
        }
    }
    // NULL input is no input.
    let mut again = vec![0u8; size];
    // SAFETY: `again` holds `size` writable bytes.
    let answer = unsafe { query_device_ex(context, null(), again.as_mut_ptr().cast(), size) };
    assert_eq!(answer, 0);
    assert_eq!(&again[..], &bytes[..size]);

    // An older caller's size: `orig_attr` alone, nothing past it written.
    let base_size = size_of::<IbvDeviceAttr>();
    let mut short = vec![UNTOUCHED; size];
    // SAFETY: `short` holds `base_size` (and more) writable bytes.
    let answer = unsafe { query_device_ex(context, null(), short.as_mut_ptr().cast(), base_size) };
    assert_eq!(answer, 0);
    assert!(same(read::<IbvDeviceAttr>(&short, 0)));
    assert!(short[base_size..].iter().all(|&b| b == UNTOUCHED));

    // Refusals, writing nothing.
    let mut refused = vec![UNTOUCHED; size];
    let target = refused.as_mut_ptr().cast::<IbvDeviceAttrEx>();
    // SAFETY: `refused` holds `size` writable bytes.
    let answer = unsafe { query_device_ex(context, null(), target, base_size - 1) };
    assert_eq!(answer, libc::EINVAL, "a size below orig_attr's");
    let unknown = IbvQueryDeviceExInput { comp_mask: 1 };
    // SAFETY: as above.
    let answer = unsafe { query_device_ex(context, &unknown, target, size) };
    assert_eq!(answer, libc::EINVAL, "an input comp_mask bit");
    // SAFETY: NULL is checked.
    let answer = unsafe { query_device_ex(context, null(), std::ptr::null_mut(), size) };
    assert_eq!(answer, libc::EINVAL, "NULL attributes");
    // SAFETY: a list of one device and a NULL.
    let device = unsafe { *list };
    // SAFETY: a pointer that is not a context is checked.
    let answer = unsafe { query_device_ex(device.cast(), null(), target, size) };
    assert_eq!(answer, libc::EINVAL, "a context that is not ours");
    assert!(refused.iter().all(|&b| b == UNTOUCHED));

    close_the_device(context, list);
    shut_down_cleanly(machine);
}
