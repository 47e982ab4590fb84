//! Protection domains and the registration of the program's own memory,
//! called in-process as a C program calls them, on the embedded simulated
//! machine: each verb's success and refusals in rdma-core's convention,
//! the `ibv_mr` filled as the kernel answered, the program's buffer
//! adopted by the simulated process at its own address while registered
//! (and locked by the driver), dereg leaving no adopted or locked page,
//! and address handles (a GRH required on the RoCE port).

use std::ffi::{c_int, c_void};
use std::ptr::null_mut;

use ibverbs_abi::{
    IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_ON_DEMAND, IBV_ACCESS_RELAXED_ORDERING,
    IBV_ACCESS_REMOTE_READ, IBV_ACCESS_REMOTE_WRITE, IbvAh, IbvAhAttr, IbvContext, IbvGid,
    IbvGlobalRoute, IbvMr, IbvPd,
};
use ibverbs_compat::{self as verbs};

mod support;
use support::*;

fn alloc_pd(context: *mut IbvContext) -> *mut IbvPd {
    // SAFETY: checked against the open contexts.
    unsafe { verbs::ibv_alloc_pd(context) }
}

fn dealloc_pd(pd: *mut IbvPd) -> c_int {
    // SAFETY: checked against the live PDs.
    unsafe { verbs::ibv_dealloc_pd(pd) }
}

fn reg_mr(pd: *mut IbvPd, addr: *mut c_void, length: usize, access: u32) -> *mut IbvMr {
    // SAFETY: the test's buffers outlive their regions; the other
    // addresses are refused before anything is exposed or registered, or
    // are never dereferenced by the library.
    unsafe { verbs::ibv_reg_mr(pd, addr, length, access as c_int) }
}

fn reg_mr_iova2(
    pd: *mut IbvPd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: u32,
) -> *mut IbvMr {
    // SAFETY: as `reg_mr`.
    unsafe { verbs::ibv_reg_mr_iova2(pd, addr, length, iova, access) }
}

fn create_ah(pd: *mut IbvPd, attr: Option<&mut IbvAhAttr>) -> *mut IbvAh {
    let attr = attr.map_or(null_mut(), std::ptr::from_mut);
    // SAFETY: `attr` is valid or NULL; the PD is checked.
    unsafe { verbs::ibv_create_ah(pd, attr) }
}

fn destroy_ah(ah: *mut IbvAh) -> c_int {
    // SAFETY: checked against the live handles.
    unsafe { verbs::ibv_destroy_ah(ah) }
}

fn dereg_mr(mr: *mut IbvMr) -> c_int {
    // SAFETY: checked against the live regions.
    unsafe { verbs::ibv_dereg_mr(mr) }
}

#[test]
fn protection_domains_registrations_of_the_programs_memory_and_address_handles() {
    let (list, context) = open_the_device(boot);
    let machine = MACHINE.get().unwrap();
    let process = machine.0.process();

    // PDs: one per call, naming their context; foreign pointers refused.
    let pd = alloc_pd(context);
    assert!(!pd.is_null());
    // SAFETY: a live PD of ours.
    assert_eq!(unsafe { (*pd).context }, context);
    let other_pd = alloc_pd(context);
    assert!(!other_pd.is_null() && other_pd != pd);
    assert!(alloc_pd(null_mut()).is_null());
    assert_eq!(errno(), libc::EINVAL);
    assert!(alloc_pd(pd.cast()).is_null(), "a PD is not a context");
    assert_eq!(errno(), libc::EINVAL);
    assert_eq!(dealloc_pd(null_mut()), libc::EINVAL);
    assert_eq!(dealloc_pd(context.cast()), libc::EINVAL);
    assert_eq!(dealloc_pd(other_pd), 0);
    assert_eq!(dealloc_pd(other_pd), libc::EINVAL, "a second dealloc");

    // A registration of the program's own buffer, not page aligned: the
    // whole pages around it are adopted at their own addresses and locked.
    let buffer = ProgramBuffer::new(3);
    let (offset, length) = (100, 5000);
    let access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    assert_eq!(process.space().adopted_page_count(), 0);
    let mr = reg_mr(pd, buffer.at(offset), length, access);
    assert!(!mr.is_null(), "errno {}", errno());
    // SAFETY: a live region of ours.
    let region = unsafe { &*mr };
    assert_eq!(region.context, context);
    assert_eq!(region.pd, pd);
    assert_eq!(region.addr, buffer.at(offset));
    assert_eq!(region.length, length);
    assert_ne!(region.lkey, 0);
    assert_ne!(region.rkey, 0, "remote access gives an R_Key");
    assert_eq!(process.space().adopted_page_count(), 2, "pages 0 and 1");
    assert!(process.space().locked_pages() >= 2, "RegMr locked them");
    // The simulated process's view of the address is the program's bytes,
    // both ways.
    buffer.store(offset, b"hello");
    let mut seen = [0u8; 5];
    process
        .read(buffer.at(offset).addr() as u64, &mut seen)
        .unwrap();
    assert_eq!(&seen, b"hello");
    process
        .write(buffer.at(offset + 4000).addr() as u64, b"world")
        .unwrap();
    assert_eq!(buffer.load(offset + 4000, 5), b"world");

    // A second registration sharing those pages (perftest's path: iova2
    // with the optional relaxed-ordering bit), local only: no R_Key.
    let local = reg_mr_iova2(
        pd,
        buffer.at(0),
        64,
        buffer.at(0).addr() as u64,
        IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_RELAXED_ORDERING,
    );
    assert!(!local.is_null(), "errno {}", errno());
    // SAFETY: a live region of ours.
    let local_region = unsafe { &*local };
    assert_eq!(local_region.rkey, 0, "no remote access, no R_Key");
    assert_ne!(local_region.lkey, region.lkey);
    assert_eq!(process.space().adopted_page_count(), 2, "shared pages");

    // Refusals, each leaving nothing adopted beyond the two regions.
    let refused = |mr: *mut IbvMr, expected: i32, what: &str| {
        assert!(mr.is_null(), "{what}");
        assert_eq!(errno(), expected, "{what}");
        assert_eq!(process.space().adopted_page_count(), 2, "{what}");
    };
    let spare = buffer.at(2 * PAGE);
    refused(
        reg_mr(null_mut(), spare, 8, access),
        libc::EINVAL,
        "NULL PD",
    );
    refused(
        reg_mr(context.cast(), spare, 8, access),
        libc::EINVAL,
        "not a PD",
    );
    refused(
        reg_mr(other_pd, spare, 8, access),
        libc::EINVAL,
        "a deallocated PD",
    );
    refused(
        reg_mr(pd, null_mut(), 8, access),
        libc::EINVAL,
        "NULL address",
    );
    refused(reg_mr(pd, spare, 0, access), libc::EINVAL, "zero length");
    refused(
        reg_mr(pd, spare, 8, 1 << 12),
        libc::EINVAL,
        "an unknown mandatory bit",
    );
    refused(
        reg_mr(pd, spare, 8, 1 << 30),
        libc::EINVAL,
        "a bit past the optional range",
    );
    refused(
        reg_mr(pd, spare, 8, IBV_ACCESS_REMOTE_WRITE),
        libc::EINVAL,
        "remote write without local write",
    );
    refused(
        reg_mr(pd, spare, 8, IBV_ACCESS_ON_DEMAND),
        libc::EOPNOTSUPP,
        "on-demand paging",
    );
    refused(
        reg_mr_iova2(pd, spare, 8, 0x1000, IBV_ACCESS_LOCAL_WRITE),
        libc::EOPNOTSUPP,
        "an IOVA other than the address",
    );
    // Memory the simulator owns in the process cannot be adopted.
    let simulator_owned = process.alloc(PAGE).unwrap();
    refused(
        reg_mr(
            pd,
            std::ptr::without_provenance_mut(simulator_owned as usize),
            8,
            access,
        ),
        libc::EFAULT,
        "the simulator's memory",
    );
    process.free(simulator_owned).unwrap();

    // A PD with regions is busy; a region is deregistered once.
    assert_eq!(dealloc_pd(pd), libc::EBUSY);
    assert_eq!(dereg_mr(null_mut()), libc::EINVAL);
    assert_eq!(dereg_mr(pd.cast()), libc::EINVAL);
    assert_eq!(dereg_mr(mr), 0);
    assert_eq!(dereg_mr(mr), libc::EINVAL, "a second dereg");
    assert_eq!(
        process.space().adopted_page_count(),
        1,
        "page 0 still held by the other region"
    );
    assert_eq!(dealloc_pd(pd), libc::EBUSY);
    assert_eq!(dereg_mr(local), 0);
    assert_eq!(process.space().adopted_page_count(), 0);
    assert_eq!(process.space().locked_pages(), 0, "every page unlocked");

    // Address handles: on this Ethernet (RoCE) port the GRH with the
    // peer's GID is required; the PD is busy while one remains.
    let mut own_gid = IbvGid::default();
    assert_eq!(
        // SAFETY: a checked context; the output is valid.
        unsafe { verbs::ibv_query_gid(context, 1, 0, &mut own_gid) },
        0
    );
    let mut ah_attr = IbvAhAttr {
        grh: IbvGlobalRoute {
            dgid: own_gid,
            flow_label: 0,
            sgid_index: 0,
            hop_limit: 1,
            traffic_class: 0,
        },
        is_global: 1,
        port_num: 1,
        ..IbvAhAttr::default()
    };
    let ah = create_ah(pd, Some(&mut ah_attr));
    assert!(!ah.is_null(), "errno {}", errno());
    // SAFETY: a live address handle of ours.
    let handle = unsafe { &*ah };
    assert_eq!((handle.context, handle.pd), (context, pd));
    let refused_ah = |ah: *mut IbvAh, expected: i32, what: &str| {
        assert!(ah.is_null(), "{what}");
        assert_eq!(errno(), expected, "{what}");
    };
    let mut no_grh = IbvAhAttr {
        is_global: 0,
        ..ah_attr
    };
    refused_ah(
        create_ah(pd, Some(&mut no_grh)),
        libc::EINVAL,
        "no GRH on RoCE",
    );
    let mut port_0 = IbvAhAttr {
        port_num: 0,
        ..ah_attr
    };
    refused_ah(create_ah(pd, Some(&mut port_0)), libc::EINVAL, "port 0");
    let mut port_2 = IbvAhAttr {
        port_num: 2,
        ..ah_attr
    };
    refused_ah(create_ah(pd, Some(&mut port_2)), libc::EINVAL, "port 2");
    refused_ah(create_ah(pd, None), libc::EINVAL, "NULL attributes");
    refused_ah(
        create_ah(null_mut(), Some(&mut ah_attr)),
        libc::EINVAL,
        "NULL PD",
    );
    refused_ah(
        create_ah(other_pd, Some(&mut ah_attr)),
        libc::EINVAL,
        "a deallocated PD",
    );
    let mut bad_sl = IbvAhAttr { sl: 16, ..ah_attr };
    refused_ah(
        create_ah(pd, Some(&mut bad_sl)),
        libc::EINVAL,
        "service level 16",
    );
    assert_eq!(dealloc_pd(pd), libc::EBUSY, "an AH remains");
    assert_eq!(destroy_ah(null_mut()), libc::EINVAL);
    assert_eq!(destroy_ah(pd.cast()), libc::EINVAL);
    assert_eq!(destroy_ah(ah), 0);
    assert_eq!(destroy_ah(ah), libc::EINVAL, "a second destroy");

    // A PD keeps its CA open past ibv_close_device, until it goes.
    // SAFETY: checked against the open contexts.
    assert_eq!(unsafe { verbs::ibv_close_device(context) }, 0);
    assert_eq!(machine.0.user_contexts(), 1, "the PD holds the CA");
    assert_eq!(dealloc_pd(pd), 0);
    assert_eq!(machine.0.user_contexts(), 0, "the CA closed with its PD");
    drop(buffer);

    // SAFETY: the list handed out above.
    unsafe { verbs::ibv_free_device_list(list) };
    shut_down_cleanly(machine);
}
