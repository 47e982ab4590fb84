//! The exported entry point and the table's refusals: versions, null
//! tables, no platform, and call records whose pointers, lengths or codes
//! are wrong, each answered with a status and no panic. (The table's
//! hooks and fast path against the real miniport:
//! `hca-miniport-core --test uvp_hooks`.)

#![cfg(not(windows))]

use std::mem::MaybeUninit;
use std::sync::Arc;

use ib_types::interface::InterfaceVersion;
use ib_types::ioctl::VerbId;
use ib_types::status::{IbStatus, NtStatus};
use ib_types::uvp::{UVP_INTERFACE_VERSION, UvpCallAbi, UvpInterface, hook_slot};
use ib_types::wc::WorkCompletion;
use uvp_plugin::export::{self, Table, uvp_get_interface};
use uvp_plugin::{Platform, UserMemory};

/// Memory that has none: the table tests below never allocate.
struct NoMemory;

impl UserMemory for NoMemory {
    fn alloc(&self, _: usize) -> Option<u64> {
        None
    }

    fn free(&self, _: u64) {}
}

fn get(version: InterfaceVersion) -> (NtStatus, Option<UvpInterface>) {
    let mut table = MaybeUninit::<UvpInterface>::uninit();
    // SAFETY: `table` is writable for one table.
    let status = unsafe { uvp_get_interface(version.packed(), table.as_mut_ptr()) };
    // SAFETY: filled exactly when the entry point succeeded.
    (
        status,
        (status == NtStatus::SUCCESS).then(|| unsafe { table.assume_init() }),
    )
}

fn empty_call(verb: u16) -> UvpCallAbi {
    UvpCallAbi {
        verb,
        reserved_at_0x2: 0,
        status: 0,
        handle: 0,
        input: core::ptr::null(),
        input_len: 0,
        private_in: core::ptr::null_mut(),
        private_in_capacity: 0,
        private_in_len: 0,
        private_out_max: 0,
        cookie: 0,
        output: core::ptr::null_mut(),
        output_len: 0,
        created: 0,
        private_out: core::ptr::null(),
        private_out_len: 0,
    }
}

// One test, so the process-wide platform is not raced by another.
#[test]
fn the_entry_point_and_the_table_refuse_what_they_cannot_serve() {
    // No platform installed: nothing to serve.
    assert_eq!(get(UVP_INTERFACE_VERSION).0, NtStatus::INVALID_DEVICE_STATE);
    export::set_platform(Some(Platform {
        memory: Arc::new(NoMemory),
        mmio: Arc::new(|_, _| {}),
    }));
    // A null table, another major version, a newer minor.
    // SAFETY: a null table is refused before any write.
    let null = unsafe { uvp_get_interface(UVP_INTERFACE_VERSION.packed(), core::ptr::null_mut()) };
    assert_eq!(null, NtStatus::INVALID_PARAMETER);
    assert_eq!(get(InterfaceVersion::new(2, 0)).0, NtStatus::NOT_SUPPORTED);
    let newer = InterfaceVersion::new(UVP_INTERFACE_VERSION.major, UVP_INTERFACE_VERSION.minor + 1);
    assert_eq!(get(newer).0, NtStatus::NOT_SUPPORTED);

    let (status, table) = get(UVP_INTERFACE_VERSION);
    export::set_platform(None);
    assert_eq!(status, NtStatus::SUCCESS);
    let table = table.unwrap();
    assert_eq!(table.check(UVP_INTERFACE_VERSION), Ok(()));
    let pre = table.hooks[hook_slot(VerbId::CreateCq)].pre.unwrap();
    let post = table.hooks[hook_slot(VerbId::CreateCq)].post.unwrap();
    let invalid = IbStatus::InvalidParameter.code();

    // A null record; an unknown verb; a null input with a length; an
    // input of the wrong length; an unknown status code for post; a
    // private length past its capacity. Each is refused before any buffer
    // is read.
    let run_pre = |call: *mut UvpCallAbi| {
        // SAFETY: the table's context; the record is null or the test's.
        unsafe { pre(table.context, call) }
    };
    let run_post = |call: *const UvpCallAbi| {
        // SAFETY: as above.
        unsafe { post(table.context, call) }
    };
    assert_eq!(run_pre(core::ptr::null_mut()), invalid);
    assert_eq!(run_post(core::ptr::null()), invalid);
    let mut unknown = empty_call(0x7FF);
    assert_eq!(run_pre(&mut unknown), invalid);
    let mut null_input = empty_call(VerbId::CreateCq.code());
    null_input.input_len = 8;
    assert_eq!(run_pre(&mut null_input), invalid);
    let short = [0u8; 4];
    let mut wrong_len = empty_call(VerbId::CreateCq.code());
    wrong_len.input = short.as_ptr();
    wrong_len.input_len = 4;
    assert_eq!(run_pre(&mut wrong_len), invalid);
    let mut bad_status = empty_call(VerbId::CreateCq.code());
    bad_status.status = 0xFFFF;
    assert_eq!(run_post(&bad_status), invalid);
    let mut overlong = empty_call(VerbId::CreateCq.code());
    overlong.private_in_len = 1;
    assert_eq!(run_post(&overlong), invalid);

    // Through the safe wrapper: objects the provider does not have.
    // SAFETY: the plug-in's own table, released only by `Table`.
    let uvp = unsafe { Table::new(table) }.unwrap();
    use ib_types::uvp::UserVerbsProvider;
    let mut wcs = [WorkCompletion::EMPTY; 2];
    assert_eq!(uvp.poll_cq(5, &mut wcs), Err(IbStatus::InvalidCqHandle));
    assert_eq!(
        uvp.arm_cq(5, ib_types::cq::CqNotify::Solicited),
        Err(IbStatus::InvalidCqHandle)
    );
    let refused = uvp.post_recv(7, &[]).unwrap_err();
    assert_eq!(
        (refused.posted, refused.status),
        (0, IbStatus::InvalidQpHandle)
    );
    let refused = uvp.post_send(7, &[]).unwrap_err();
    assert_eq!(
        (refused.posted, refused.status),
        (0, IbStatus::InvalidQpHandle)
    );
    drop(uvp);

    // A table of another major version or missing an entry point is
    // refused by the wrapper (its check).
    export::set_platform(Some(Platform {
        memory: Arc::new(NoMemory),
        mmio: Arc::new(|_, _| {}),
    }));
    let (_, table) = get(UVP_INTERFACE_VERSION);
    export::set_platform(None);
    let mut table = table.unwrap();
    let release = table.release.unwrap();
    table.arm_cq = None;
    // SAFETY: the table is refused, not kept; it is released below.
    assert!(unsafe { Table::new(table) }.is_err());
    // SAFETY: the context from the entry point, released once.
    unsafe { release(table.context) };
}
