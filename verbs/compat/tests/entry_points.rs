//! The entry points called in-process, as a C program calls them, on the
//! embedded simulated machine (`sim_shells::embedded`): every answer
//! checked against what the access library reports for the same CA, every
//! argument check (NULL, a pointer that is not ours, a bad port or index)
//! answering as rdma-core does, the objects laid out where `verbs.h`'s
//! inlines look, and the machine ending with an empty verifier report.

use std::ffi::{CStr, c_int};
use std::mem::{offset_of, size_of};
use std::ptr::{null, null_mut};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use ib_types::scalars::{PortNum, PortState};
use ibal_user::{CaSelector, Context, DeviceIo, PluginSource};
use ibverbs_abi::{
    IBV_GID_TYPE_ROCE_V2, IBV_GID_TYPE_SYSFS_ROCE_V2, IBV_LINK_LAYER_ETHERNET, IBV_PORT_ACTIVE,
    IbvContext, IbvDevice, IbvDeviceAttr, IbvGid, IbvGidEntry, IbvPortAttr, VERBS_ABI_IS_EXTENDED,
    VerbsContext,
};
use ibverbs_compat::{self as verbs, Machine, unsupported};
use sim_shells::embedded::{EmbeddedMachine, Fabric};

struct TestMachine(EmbeddedMachine);

impl Machine for TestMachine {
    fn io(&self) -> Arc<dyn DeviceIo> {
        self.0.io()
    }
    fn plugin(&self) -> PluginSource {
        PluginSource::Linked
    }
}

static MACHINE: OnceLock<Arc<TestMachine>> = OnceLock::new();

fn boot() -> Result<Arc<dyn Machine>, String> {
    let machine = Arc::new(TestMachine(EmbeddedMachine::boot(Fabric::DEFAULT, 7)?));
    assert!(MACHINE.set(Arc::clone(&machine)).is_ok(), "booted once");
    Ok(machine)
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap()
}

fn clear_errno() {
    verbs_side_support::set_errno(0);
}

/// `verbs_get_ctx_op(ctx, query_port)` as `verbs.h` computes it: the
/// `verbs_context` before the context, if extended and large enough.
fn query_port_op(context: *mut IbvContext) -> Option<&'static VerbsContext> {
    // SAFETY: `context` is an open context of ours.
    let ctx = unsafe { &*context };
    if ctx.abi_compat as usize != VERBS_ABI_IS_EXTENDED {
        return None;
    }
    let at = offset_of!(VerbsContext, context);
    // SAFETY: an extended context is preceded by its `verbs_context` (the
    // same allocation).
    let vctx = unsafe { context.byte_sub(at) }.cast::<VerbsContext>();
    // SAFETY: which lives while the context is open.
    let vctx = unsafe { &*vctx };
    (vctx.sz >= size_of::<VerbsContext>() - offset_of!(VerbsContext, query_port)
        && vctx.query_port.is_some())
    .then_some(vctx)
}

/// Safe front ends of the entry points. The library checks every context
/// and device pointer against the ones it handed out before using it, so
/// any address may be passed; the output pointers are `Option<&mut T>`
/// (valid, or NULL).
mod c {
    use super::*;

    fn out<T>(value: Option<&mut T>) -> *mut T {
        value.map_or(null_mut(), std::ptr::from_mut)
    }

    pub(crate) fn get_device_list(count: &mut c_int) -> *mut *mut IbvDevice {
        // SAFETY: `count` is valid for a write.
        unsafe { verbs::ibv_get_device_list(count) }
    }
    pub(crate) fn free_device_list(list: *mut *mut IbvDevice) {
        // SAFETY: checked against the lists handed out.
        unsafe { verbs::ibv_free_device_list(list) }
    }
    pub(crate) fn device_name(device: *mut IbvDevice) -> Option<String> {
        // SAFETY: checked against the devices listed.
        let name = unsafe { verbs::ibv_get_device_name(device) };
        (!name.is_null()).then(|| {
            // SAFETY: a non-NULL name is the device's NUL-terminated string.
            unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned()
        })
    }
    pub(crate) fn device_guid(device: *mut IbvDevice) -> u64 {
        // SAFETY: checked against the devices listed.
        unsafe { verbs::ibv_get_device_guid(device) }
    }
    pub(crate) fn open(device: *mut IbvDevice) -> *mut IbvContext {
        // SAFETY: checked against the devices listed.
        unsafe { verbs::ibv_open_device(device) }
    }
    pub(crate) fn close(context: *mut IbvContext) -> c_int {
        // SAFETY: checked against the open contexts.
        unsafe { verbs::ibv_close_device(context) }
    }
    pub(crate) fn query_device(
        context: *mut IbvContext,
        attr: Option<&mut IbvDeviceAttr>,
    ) -> c_int {
        // SAFETY: the output is valid or NULL.
        unsafe { verbs::ibv_query_device(context, out(attr)) }
    }
    pub(crate) fn query_port_compat(
        context: *mut IbvContext,
        port: u8,
        attr: Option<&mut IbvPortAttr>,
    ) -> c_int {
        // SAFETY: the output is valid (for more than the compat bytes) or NULL.
        unsafe { verbs::ibv_query_port(context, port, out(attr)) }
    }
    pub(crate) fn query_port_op(
        op: &VerbsContext,
        context: *mut IbvContext,
        port: u8,
        attr: Option<&mut IbvPortAttr>,
    ) -> c_int {
        let query_port = op.query_port.unwrap();
        // SAFETY: the output is valid for the struct's size, or NULL.
        unsafe { query_port(context, port, out(attr), size_of::<IbvPortAttr>()) }
    }
    pub(crate) fn query_gid(
        context: *mut IbvContext,
        port: u8,
        index: c_int,
        gid: Option<&mut IbvGid>,
    ) -> c_int {
        // SAFETY: the output is valid or NULL.
        unsafe { verbs::ibv_query_gid(context, port, index, out(gid)) }
    }
    pub(crate) fn query_gid_type(
        context: *mut IbvContext,
        port: u8,
        index: u32,
        kind: Option<&mut u32>,
    ) -> c_int {
        // SAFETY: the output is valid or NULL.
        unsafe { verbs::ibv_query_gid_type(context, port, index, out(kind)) }
    }
    pub(crate) fn query_gid_ex(
        context: *mut IbvContext,
        port: u32,
        index: u32,
        entry: Option<&mut IbvGidEntry>,
        flags: u32,
        size: usize,
    ) -> c_int {
        let size = size.min(size_of::<IbvGidEntry>());
        // SAFETY: the output is valid for `size` bytes or NULL.
        unsafe { verbs::_ibv_query_gid_ex(context, port, index, out(entry), flags, size) }
    }
    pub(crate) fn query_pkey(
        context: *mut IbvContext,
        port: u8,
        index: c_int,
        pkey: Option<&mut u16>,
    ) -> c_int {
        // SAFETY: the output is valid or NULL.
        unsafe { verbs::ibv_query_pkey(context, port, index, out(pkey)) }
    }
}

#[test]
fn the_entry_points_answer_what_the_access_library_reports_and_refuse_bad_arguments() {
    // No machine registered: no verbs support, as rdma-core without a
    // kernel driver.
    let mut count: c_int = -1;
    assert!(c::get_device_list(&mut count).is_null());
    assert_eq!(errno(), libc::ENOSYS);
    assert!(verbs::set_boot(boot));
    assert!(!verbs::set_boot(boot), "the first registration wins");

    let list = c::get_device_list(&mut count);
    assert!(!list.is_null());
    assert_eq!(count, 1);
    // SAFETY: a list of `count` (1) devices and a NULL.
    let entries = unsafe { std::slice::from_raw_parts(list, 2) };
    let device = entries[0];
    assert!(entries[1].is_null());

    // What the access library says about the same CA.
    let machine = MACHINE.get().unwrap();
    let io = machine.io();
    let (attr, port) = {
        let ca = Context::open(&io, CaSelector::Index(0), &PluginSource::Linked).unwrap();
        (ca.query().unwrap(), ca.query_port(PortNum::FIRST).unwrap())
    };

    assert_eq!(c::device_name(device).as_deref(), Some("simhca0"));
    assert_eq!(u64::from_be(c::device_guid(device)), attr.node_guid.get());
    // A device that is not ours (a copy elsewhere), and NULL.
    // SAFETY: `device` points to a live device.
    let mut stranger: IbvDevice = unsafe { *device };
    let stranger = std::ptr::from_mut(&mut stranger);
    clear_errno();
    assert_eq!(c::device_name(stranger), None);
    assert_eq!(errno(), libc::EINVAL);
    assert_eq!(c::device_guid(null_mut()), 0);
    assert!(c::open(stranger).is_null());
    assert_eq!(errno(), libc::EINVAL);

    let context = c::open(device);
    assert!(!context.is_null());
    assert_eq!(
        machine.0.user_contexts(),
        1,
        "the CA open (the check closed its own)"
    );
    // SAFETY: an open context.
    let ctx = unsafe { &*context };
    assert_eq!(ctx.device, device);
    assert_eq!(ctx.num_comp_vectors, 1);

    // ibv_query_device.
    // SAFETY: all-zero bytes are a valid `IbvDeviceAttr`.
    let mut device_attr: IbvDeviceAttr = unsafe { std::mem::zeroed() };
    assert_eq!(c::query_device(context, Some(&mut device_attr)), 0);
    assert_eq!(u64::from_be(device_attr.node_guid), attr.node_guid.get());
    assert_eq!(device_attr.vendor_id, attr.vendor_id);
    assert_eq!(device_attr.vendor_part_id, u32::from(attr.device_id));
    assert_eq!(device_attr.hw_ver, u32::from(attr.revision));
    assert_eq!(device_attr.max_qp as u32, attr.limits.max_qps);
    assert_eq!(device_attr.max_cqe as u32, attr.limits.max_cqes);
    assert_eq!(device_attr.max_mr_size, attr.limits.max_mr_size);
    assert_eq!(
        device_attr.max_qp_rd_atom as u32,
        attr.limits.max_qp_rd_atomic
    );
    assert_eq!(device_attr.phys_port_cnt, attr.layout.num_ports);
    // SAFETY: `fw_ver` is NUL-terminated.
    let fw = unsafe { CStr::from_ptr(device_attr.fw_ver.as_ptr()) };
    let v = attr.fw_version;
    assert_eq!(
        fw.to_str().unwrap(),
        format!("{}.{}.{}", v >> 32 & 0xffff, v >> 16 & 0xffff, v & 0xffff)
    );
    assert_eq!(c::query_device(context, None), libc::EINVAL);
    assert_eq!(
        c::query_device(context.wrapping_byte_add(8), Some(&mut device_attr)),
        libc::EINVAL
    );

    // ibv_query_port through the verbs_context, as the inline reaches it,
    // and through the exported compat entry.
    let op = query_port_op(context).expect("the inline finds query_port");
    let mut port_attr = IbvPortAttr {
        port_cap_flags2: 0xabcd,
        ..IbvPortAttr::default()
    };
    assert_eq!(c::query_port_op(op, context, 1, Some(&mut port_attr)), 0);
    assert_eq!(port.attr.state, PortState::Active);
    assert_eq!(port_attr.state, IBV_PORT_ACTIVE);
    assert_eq!(port_attr.max_mtu, u32::from(port.attr.max_mtu.code()));
    assert_eq!(port_attr.active_mtu, u32::from(port.attr.active_mtu.code()));
    assert_eq!(port_attr.link_layer, IBV_LINK_LAYER_ETHERNET);
    assert_eq!(port_attr.gid_tbl_len as usize, port.gids.len());
    assert_eq!(usize::from(port_attr.pkey_tbl_len), port.pkeys.len());
    assert_eq!(port_attr.max_msg_sz, port.attr.max_msg_size);
    assert_eq!(port_attr.lid, port.attr.lid.get());
    assert_eq!(port_attr.port_cap_flags2, 0, "the whole struct written");
    let mut compat = IbvPortAttr {
        port_cap_flags2: 0xabcd,
        ..IbvPortAttr::default()
    };
    assert_eq!(c::query_port_compat(context, 1, Some(&mut compat)), 0);
    assert_eq!(
        compat.port_cap_flags2, 0xabcd,
        "only the compat bytes written"
    );
    compat.port_cap_flags2 = 0;
    assert_eq!(compat, port_attr);
    for bad_port in [0, 2, 255] {
        let status = c::query_port_op(op, context, bad_port, Some(&mut port_attr));
        assert_eq!(status, libc::EINVAL, "port {bad_port}");
    }
    assert_eq!(c::query_port_op(op, context, 1, None), libc::EINVAL);
    assert_eq!(
        c::query_port_compat(null_mut(), 1, Some(&mut port_attr)),
        libc::EINVAL
    );

    // GIDs, their types, P_Keys.
    let mut gid = IbvGid::default();
    assert_eq!(c::query_gid(context, 1, 0, Some(&mut gid)), 0);
    assert_eq!(gid.raw, port.gids[0].octets());
    assert_eq!(gid, IbvGid::from_ipv4_mapped([127, 0, 0, 1]));
    let mut gid_type = 99;
    assert_eq!(c::query_gid_type(context, 1, 0, Some(&mut gid_type)), 0);
    assert_eq!(gid_type, IBV_GID_TYPE_SYSFS_ROCE_V2);
    let mut entry = IbvGidEntry::default();
    assert_eq!(c::query_gid_ex(context, 1, 0, Some(&mut entry), 0, 32), 0);
    assert_eq!(
        (entry.gid, entry.gid_index, entry.port_num, entry.gid_type),
        (gid, 0, 1, IBV_GID_TYPE_ROCE_V2)
    );
    let last = port.gids.len() - 1;
    assert!(port.gids[last].octets() == [0; 16], "an empty slot");
    // An empty slot: zeros for the plain query, ENODATA for the ex one.
    gid = IbvGid::from_ipv4_mapped([1, 2, 3, 4]);
    assert_eq!(c::query_gid(context, 1, last as c_int, Some(&mut gid)), 0);
    assert_eq!(gid, IbvGid::default());
    assert_eq!(
        c::query_gid_ex(context, 1, last as u32, Some(&mut entry), 0, 32),
        libc::ENODATA
    );
    // Bad index, port, flags, size, pointers.
    clear_errno();
    assert_eq!(
        c::query_gid(context, 1, last as c_int + 1, Some(&mut gid)),
        -1
    );
    assert_eq!(errno(), libc::EINVAL);
    assert_eq!(c::query_gid(context, 1, -1, Some(&mut gid)), -1);
    assert_eq!(c::query_gid(context, 2, 0, Some(&mut gid)), -1);
    assert_eq!(c::query_gid(context, 1, 0, None), -1);
    assert_eq!(c::query_gid_type(context, 0, 0, Some(&mut gid_type)), -1);
    assert_eq!(
        c::query_gid_ex(context, 1, 0, Some(&mut entry), 1, 32),
        libc::EINVAL
    );
    assert_eq!(
        c::query_gid_ex(context, 1, 0, Some(&mut entry), 0, 16),
        libc::EINVAL
    );
    assert_eq!(
        c::query_gid_ex(null_mut(), 1, 0, Some(&mut entry), 0, 32),
        libc::EINVAL
    );
    let mut pkey = 0u16;
    assert_eq!(c::query_pkey(context, 1, 0, Some(&mut pkey)), 0);
    assert_eq!(u16::from_be(pkey), port.pkeys[0].get());
    let past = port.pkeys.len() as c_int;
    assert_eq!(c::query_pkey(context, 1, past, Some(&mut pkey)), -1);
    assert_eq!(c::query_pkey(context, 1, 0, None), -1);

    // What this milestone does not offer answers "not supported", and
    // what names an object refuses it (none exists).
    assert_eq!(
        unsupported::ibv_attach_mcast(null_mut(), std::ptr::null(), 0),
        libc::EINVAL
    );
    assert!(unsupported::ibv_qp_to_qp_ex(null_mut()).is_null());

    // Closing: once; a second close, or a close of NULL, refused.
    assert_eq!(c::close(context), 0);
    clear_errno();
    assert_eq!(c::close(context), -1);
    assert_eq!(errno(), libc::EINVAL);
    assert_eq!(c::close(null_mut()), -1);
    assert_eq!(
        c::query_device(context, Some(&mut device_attr)),
        libc::EINVAL
    );
    assert_eq!(machine.0.user_contexts(), 0, "the CA closed");

    // The list: freed once; a second free, NULL or a stranger left alone.
    c::free_device_list(list);
    c::free_device_list(list);
    c::free_device_list(null_mut());
    let mut fake = [device, null_mut()];
    c::free_device_list(fake.as_mut_ptr());
    // The device outlives its list, as rdma-core's.
    assert_eq!(c::device_name(device).as_deref(), Some("simhca0"));

    drop(io);
    let report = machine.0.shut_down(Duration::from_secs(10));
    assert_eq!(
        report.problems,
        Vec::<String>::new(),
        "a clean shutdown, the verifier empty"
    );
    assert_eq!(report.left_open, 0);
}

#[test]
fn wc_status_text_is_rdma_cores() {
    // SAFETY: Debian's libibverbs runs no constructor that needs anything
    // of ours; the symbol has this prototype (verbs.h).
    let debian = unsafe { libloading::Library::new("libibverbs.so.1") }
        .expect("Debian's libibverbs.so.1 (apt-get install libibverbs1)");
    type StatusStr = unsafe extern "C" fn(u32) -> *const std::ffi::c_char;
    // SAFETY: the prototype of `ibv_wc_status_str`.
    let theirs = unsafe { debian.get::<StatusStr>(b"ibv_wc_status_str") }.unwrap();
    for status in (0..40).chain([u32::MAX]) {
        // SAFETY: Debian's answer is a static NUL-terminated string.
        let theirs = unsafe { theirs(status) };
        // SAFETY: as above.
        let expected = unsafe { CStr::from_ptr(theirs) };
        // SAFETY: ours is a static NUL-terminated string too.
        let ours = unsafe { CStr::from_ptr(verbs::ibv_wc_status_str(status)) };
        assert_eq!(ours, expected, "status {status}");
    }
}

#[test]
fn read_sysfs_file_reads_as_rdma_cores() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("ibverbs-compat-sysfs");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("board_id"), "SIM_0001\n").unwrap();
    std::fs::write(dir.join("raw"), "12345678").unwrap();
    let c_dir = std::ffi::CString::new(dir.to_str().unwrap()).unwrap();
    let mut buf = [0x55 as std::ffi::c_char; 9];
    let read = |file: &CStr, buf: &mut [std::ffi::c_char]| {
        // SAFETY: NUL-terminated names, a buffer of `buf.len()` bytes.
        unsafe {
            verbs::ibv_read_sysfs_file(c_dir.as_ptr(), file.as_ptr(), buf.as_mut_ptr(), buf.len())
        }
    };
    // The newline becomes the terminator.
    assert_eq!(read(c"board_id", &mut buf), 8);
    assert_eq!(
        CStr::from_bytes_until_nul(&buf.map(|b| b as u8)),
        Ok(c"SIM_0001")
    );
    // Contents that fill the buffer with no room for the NUL are refused.
    assert_eq!(read(c"raw", &mut buf[..8]), -1);
    assert_eq!(read(c"raw", &mut buf), 8);
    // A missing file: -1, errno ENOENT.
    assert_eq!(read(c"absent", &mut buf), -1);
    assert_eq!(errno(), libc::ENOENT);
    // NULL arguments.
    let (file, out) = (c"x".as_ptr(), buf.as_mut_ptr());
    // SAFETY: NULLs are checked first.
    let status = unsafe { verbs::ibv_read_sysfs_file(null(), file, out, 9) };
    assert_eq!(status, -1);
}
