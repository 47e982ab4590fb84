//! The memory region and memory window verbs on the simulated host: two
//! HCAs on one fabric, every verb issued from a DPC (DISPATCH_LEVEL) as a
//! request built by `ib_types::ioctl::encode_request`, kernel memory from
//! the host's pool registered with RegMr, data moved by RDMA and atomics
//! and checked byte for byte. Each test ends with the host shut down and
//! the verifier clean (no leaked mapping, lock or common buffer).

mod support;

use driver_platform::RequestorMode;
use ib_types::access::AccessFlags;
use ib_types::handle::{CqHandle, MwHandle, PdHandle};
use ib_types::ioctl::{
    AllocMw, AllocPd, CreateQp, DeallocMw, DeallocPd, DeregMr, DestroyQp, Empty, ModifyQp, QueryMr,
    QueryMw, RegMr, RegPhysMr, RegSharedMr, ReregMr,
};
use ib_types::mr::{MrRegister, MrRereg, MrShare, MwAttr, MwType, PhysMrRegister};
use ib_types::qp::{QpCaps, QpCreate, QpModify, QpType};
use ib_types::status::IbStatus;
use ib_types::wc::{WcOpcode, WcStatus, WorkCompletion};
use ib_types::wr::{MwBind, RKey, RemoteAddr, SendFlags, SendOp, SendWr, Sge};
use support::kernel_pair::{KernelBuf, Setup, poll_all, setup, teardown};
use support::rc_path::rc_to_rts_steps;
use support::{World, response};

const KERNEL: RequestorMode = RequestorMode::Kernel;

/// The IPv4 address of port 1 of each HCA.
const HCA_IPS: [[[u8; 4]; 2]; 2] = [
    [[10, 0, 0, 1], [10, 0, 1, 1]],
    [[10, 0, 2, 1], [10, 0, 3, 1]],
];
const GUIDS: [u64; 2] = [0x0002_C900_0000_2000, 0x0002_C900_0000_3000];

/// A host with two two-port HCAs on one fabric, kernel lockers installed;
/// returns it and each HCA's index in `GUIDS` order.
fn two_hcas(seed: u64) -> (World, [usize; 2]) {
    support::kernel_pair::two_two_port_hcas(seed, GUIDS, &HCA_IPS)
}

fn alloc_pd(w: &World, i: usize, ca: u64) -> u64 {
    let r = w.call_in_dpc_at::<AllocPd>(i, KERNEL, ca, &Empty, 0);
    let resp = response::<AllocPd>(&r);
    assert_eq!(resp.status, IbStatus::Success);
    resp.handle
}

fn dealloc_pd(w: &World, i: usize, pd: u64) -> IbStatus {
    let r = w.call_in_dpc_at::<DeallocPd>(i, KERNEL, pd, &Empty, 0);
    response::<DeallocPd>(&r).status
}

const ALL_RIGHTS: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_ATOMIC)
    .union(AccessFlags::MW_BIND);

/// Kernel memory of one HCA's side, registered with RegMr.
type Buf = KernelBuf;

const BUF_BYTES: usize = 4 * 4096;

impl Buf {
    fn new(w: &World, s: &Setup, access: AccessFlags) -> Self {
        KernelBuf::register(w, s, *b"MrV ", BUF_BYTES, access)
    }

    fn remote(&self, offset: usize) -> RemoteAddr {
        RemoteAddr {
            addr: self.addr(offset),
            rkey: self.keys.rkey,
        }
    }

    fn read_u64(&self, offset: usize) -> u64 {
        u64::from_le_bytes(self.read(offset, 8).try_into().unwrap())
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed))
        .collect()
}

fn leak_sges(sges: Vec<Sge>) -> &'static [Sge] {
    Box::leak(sges.into_boxed_slice())
}

fn signaled(wr_id: u64, sg_list: &'static [Sge], op: SendOp) -> SendWr<'static> {
    SendWr {
        wr_id,
        op,
        flags: SendFlags::SIGNALED,
        sg_list,
        ud: None,
    }
}

/// Posts one signaled WR on QP `qp` of HCA `i` and returns its completion.
fn run_one(w: &World, s: &Setup, qp: u64, wr: SendWr<'static>) -> WorkCompletion {
    assert_eq!(
        w.post_send_in_dpc(s.i, qp, vec![wr]),
        (1, IbStatus::Success)
    );
    let wcs = poll_all(w, s.i, s.cq);
    assert_eq!(wcs.len(), 1, "{wcs:?}");
    assert_eq!(wcs[0].wr_id, wr.wr_id);
    wcs[0]
}

fn caps() -> QpCaps {
    QpCaps {
        max_send_wr: 16,
        max_recv_wr: 4,
        max_send_sge: 2,
        max_recv_sge: 2,
        max_inline_data: 0,
    }
}

fn create_rc(w: &World, s: &Setup) -> (u64, u32) {
    let input = QpCreate {
        qp_type: QpType::Rc,
        pd: PdHandle::from_raw(s.pd),
        send_cq: CqHandle::from_raw(s.cq),
        recv_cq: CqHandle::from_raw(s.cq),
        srq: None,
        caps: caps(),
        sq_sig_all: false,
        port: None,
    };
    let r = w.call_in_dpc_at::<CreateQp>(s.i, KERNEL, s.ca, &input, 0);
    let resp = response::<CreateQp>(&r);
    assert_eq!(resp.status, IbStatus::Success);
    (resp.handle, resp.output.unwrap().qpn.get())
}

fn modify(w: &World, i: usize, qp: u64, m: &QpModify) {
    let r = w.call_in_dpc_at::<ModifyQp>(i, KERNEL, qp, m, 0);
    assert_eq!(response::<ModifyQp>(&r).status, IbStatus::Success);
}

/// Takes `qp` of HCA `i` (port 1) to RTS towards `dest` at `dest_ip`,
/// accepting remote writes, reads and atomics.
fn connect(w: &World, i: usize, qp: u64, dest: u32, dest_ip: [u8; 4]) {
    let access = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC;
    for m in rc_to_rts_steps(1, access, dest, dest_ip, 4) {
        modify(w, i, qp, &m);
    }
}

/// A connected RC pair: `a` on `sa`'s HCA, `b` on `sb`'s.
fn pair(w: &World, sa: &Setup, sb: &Setup) -> (u64, u64) {
    let (a, qpn_a) = create_rc(w, sa);
    let (b, qpn_b) = create_rc(w, sb);
    connect(w, sa.i, a, qpn_b, HCA_IPS[sb_index(w, sb)][0]);
    connect(w, sb.i, b, qpn_a, HCA_IPS[sb_index(w, sa)][0]);
    (a, b)
}

/// Destroys a pair made by [`pair`] and drains both CQs of what the
/// destroyed QPs left there.
fn unpair(w: &World, sa: &Setup, sb: &Setup, (a, b): (u64, u64)) {
    destroy_qp(w, sa.i, a);
    destroy_qp(w, sb.i, b);
    let _ = poll_all(w, sa.i, sa.cq);
    let _ = poll_all(w, sb.i, sb.cq);
}

/// Which of `GUIDS` the setup's HCA has.
fn sb_index(w: &World, s: &Setup) -> usize {
    let guid = w.hca_at(s.i).report().unwrap().capabilities.node_guid.get();
    GUIDS.iter().position(|&g| g == guid).unwrap()
}

fn destroy_qp(w: &World, i: usize, qp: u64) {
    let r = w.call_in_dpc_at::<DestroyQp>(i, KERNEL, qp, &Empty, 0);
    assert_eq!(response::<DestroyQp>(&r).status, IbStatus::Success);
}

fn query_mr(w: &World, i: usize, mr: u64) -> (IbStatus, Option<ib_types::mr::MrQuery>) {
    let r = w.call_in_dpc_at::<QueryMr>(i, KERNEL, mr, &Empty, 0);
    let resp = response::<QueryMr>(&r);
    (resp.status, resp.output)
}

fn dereg(w: &World, i: usize, mr: u64) -> IbStatus {
    let r = w.call_in_dpc_at::<DeregMr>(i, KERNEL, mr, &Empty, 0);
    response::<DeregMr>(&r).status
}

#[test]
fn rdma_atomics_shared_and_reregistered_regions_through_the_mr_verbs() {
    let (w, [x, y]) = two_hcas(71);
    let (sx, sy) = (setup(&w, x), setup(&w, y));
    let bx = Buf::new(&w, &sx, ALL_RIGHTS);
    let by = Buf::new(&w, &sy, ALL_RIGHTS);
    // Remote rights: the R_Key is the key.
    assert_ne!(by.keys.lkey.get(), 0);
    assert_eq!(by.keys.rkey.get(), by.keys.lkey.get());
    let (status, q) = query_mr(&w, y, by.mr);
    assert_eq!(status, IbStatus::Success);
    let q = q.unwrap();
    assert_eq!(
        (q.pd.raw(), q.vaddr, q.length, q.access, q.keys),
        (sy.pd, by.addr(0), BUF_BYTES as u64, ALL_RIGHTS, by.keys)
    );
    // The region holds a use of its PD.
    assert_eq!(dealloc_pd(&w, y, sy.pd), IbStatus::ResourceBusy);

    let (a, b) = pair(&w, &sx, &sy);

    // RDMA write x -> y and RDMA read y -> x.
    let written = pattern(5, 3000);
    bx.write(0, &written);
    let wc = run_one(
        &w,
        &sx,
        a,
        signaled(
            1,
            leak_sges(vec![bx.sge(0, 3000)]),
            SendOp::RdmaWrite {
                remote: by.remote(1000),
            },
        ),
    );
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(by.read(1000, 3000), written);
    let far = pattern(77, 500);
    by.write(8192, &far);
    let wc = run_one(
        &w,
        &sx,
        a,
        signaled(
            2,
            leak_sges(vec![bx.sge(4096, 500)]),
            SendOp::RdmaRead {
                remote: by.remote(8192),
            },
        ),
    );
    assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 500));
    assert_eq!(bx.read(4096, 500), far);

    // Atomics: the original value comes back, the memory is updated.
    by.write(12288, &0x1111_2222_3333_4444u64.to_le_bytes());
    let original = leak_sges(vec![bx.sge(8192, 8)]);
    let cas = |compare, swap| SendOp::CompareSwap {
        remote: by.remote(12288),
        compare,
        swap,
    };
    let wc = run_one(
        &w,
        &sx,
        a,
        signaled(3, original, cas(0x1111_2222_3333_4444, 0xAAAA)),
    );
    assert_eq!(
        (wc.status, wc.opcode),
        (WcStatus::Success, WcOpcode::CompareSwap)
    );
    assert_eq!(bx.read_u64(8192), 0x1111_2222_3333_4444);
    assert_eq!(by.read_u64(12288), 0xAAAA);
    // A comparison that fails: the original comes back, nothing stored.
    let wc = run_one(&w, &sx, a, signaled(4, original, cas(0x5, 0xBBBB)));
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(bx.read_u64(8192), 0xAAAA);
    assert_eq!(by.read_u64(12288), 0xAAAA);
    let add = SendOp::FetchAdd {
        remote: by.remote(12288),
        add: 0x10,
    };
    let wc = run_one(&w, &sx, a, signaled(5, original, add));
    assert_eq!(
        (wc.status, wc.opcode),
        (WcStatus::Success, WcOpcode::FetchAdd)
    );
    assert_eq!(bx.read_u64(8192), 0xAAAA);
    assert_eq!(by.read_u64(12288), 0xAAAA + 0x10);

    // A shared region over y's pages at another address: new keys, the
    // same memory (written through its R_Key); it holds a use of its PD.
    let share = MrShare {
        pd: PdHandle::from_raw(sy.pd),
        vaddr: 0x5000_0000,
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
    };
    let r = w.call_in_dpc_at::<RegSharedMr>(y, KERNEL, by.mr, &share, 0);
    let resp = response::<RegSharedMr>(&r);
    assert_eq!(resp.status, IbStatus::Success);
    let (shared, shared_out) = (resp.handle, resp.output.unwrap());
    assert_eq!(shared_out.vaddr, 0x5000_0000);
    assert_ne!(shared_out.keys.rkey, by.keys.rkey);
    let (_, q) = query_mr(&w, y, shared);
    let q = q.unwrap();
    assert_eq!(
        (q.pd.raw(), q.vaddr, q.length),
        (sy.pd, 0x5000_0000, BUF_BYTES as u64)
    );
    let via_shared = pattern(61, 900);
    bx.write(0, &via_shared);
    let wc = run_one(
        &w,
        &sx,
        a,
        signaled(
            8,
            leak_sges(vec![bx.sge(0, 900)]),
            SendOp::RdmaWrite {
                remote: RemoteAddr {
                    addr: 0x5000_0000 + 6000,
                    rkey: shared_out.keys.rkey,
                },
            },
        ),
    );
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(by.read(6000, 900), via_shared);
    assert_eq!(dereg(&w, y, shared), IbStatus::Success);

    // Re-register y's region onto its second half with fewer rights: new
    // keys, the handle stays; the new range works with the new key.
    let old_keys = by.keys;
    let rereg = MrRereg {
        translation: Some((by.addr(8192), 8192)),
        pd: None,
        access: Some(AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE),
    };
    let r = w.call_in_dpc_at::<ReregMr>(y, KERNEL, by.mr, &rereg, 0);
    let resp = response::<ReregMr>(&r);
    assert_eq!(resp.status, IbStatus::Success);
    let new_keys = resp.output.unwrap();
    assert_ne!(new_keys.rkey, old_keys.rkey);
    assert_ne!(new_keys.lkey, old_keys.lkey);
    let (_, q) = query_mr(&w, y, by.mr);
    let q = q.unwrap();
    assert_eq!((q.vaddr, q.length, q.keys), (by.addr(8192), 8192, new_keys));
    let again = pattern(140, 1024);
    bx.write(0, &again);
    let wc = run_one(
        &w,
        &sx,
        a,
        signaled(
            6,
            leak_sges(vec![bx.sge(0, 1024)]),
            SendOp::RdmaWrite {
                remote: RemoteAddr {
                    addr: by.addr(9000),
                    rkey: new_keys.rkey,
                },
            },
        ),
    );
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(by.read(9000, 1024), again);
    // The old key is refused by the remote: a remote access error.
    let stale = SendOp::RdmaWrite {
        remote: RemoteAddr {
            addr: by.addr(9000),
            rkey: old_keys.rkey,
        },
    };
    bx.write(0, &[0xEE; 64]);
    let wc = run_one(
        &w,
        &sx,
        a,
        signaled(7, leak_sges(vec![bx.sge(0, 64)]), stale),
    );
    assert_eq!(wc.status, WcStatus::RemAccessErr);
    assert_eq!(by.read(9000, 1024), again, "nothing written");
    let _ = poll_all(&w, y, sy.cq);

    unpair(&w, &sx, &sy, (a, b));
    let by_mr = by.mr;
    by.free(&w, y);
    // Deregistered: the handle is stale, the PD free.
    assert_eq!(query_mr(&w, y, by_mr).0, IbStatus::InvalidMrHandle);
    assert_eq!(dereg(&w, y, by_mr), IbStatus::InvalidMrHandle);
    bx.free(&w, x);
    teardown(&w, &sx);
    teardown(&w, &sy);
    w.finish();
}

#[test]
fn a_reregistration_moves_the_pd_use_and_physical_regions_register() {
    let (w, [x, _]) = two_hcas(72);
    let s = setup(&w, x);
    let pd2 = alloc_pd(&w, x, s.ca);
    let buf = Buf::new(&w, &s, AccessFlags::LOCAL_WRITE);
    // Local rights only: no R_Key.
    assert_eq!(buf.keys.rkey.get(), 0);
    let rereg = MrRereg {
        translation: None,
        pd: Some(PdHandle::from_raw(pd2)),
        access: None,
    };
    let r = w.call_in_dpc_at::<ReregMr>(x, KERNEL, buf.mr, &rereg, 0);
    let resp = response::<ReregMr>(&r);
    assert_eq!(resp.status, IbStatus::Success);
    let keys = resp.output.unwrap();
    assert_ne!(keys.lkey, buf.keys.lkey);
    // The use moved: the first PD is free, the second busy.
    assert_eq!(dealloc_pd(&w, x, pd2), IbStatus::ResourceBusy);
    let (_, q) = query_mr(&w, x, buf.mr);
    assert_eq!(q.unwrap().pd.raw(), pd2);
    let spare = alloc_pd(&w, x, s.ca);
    assert_eq!(dealloc_pd(&w, x, spare), IbStatus::Success);

    // A physical registration (kernel only) of a common buffer's pages.
    use driver_platform::{CommonBuffer, DmaAdapter};
    let common = w.adapter_at(x).alloc_common(8192).unwrap();
    let bus = common.bus_address();
    let input = PhysMrRegister {
        iova: 0x7000_0100,
        length: 7900,
        first_byte_offset: 0x100,
        page_shift: 12,
        num_pages: 2,
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
    };
    let pages: Vec<u8> = [bus, bus + 4096]
        .iter()
        .flat_map(|p| p.to_le_bytes())
        .collect();
    let mut bytes = vec![0; ib_types::ioctl::request_len::<RegPhysMr>(16).unwrap()];
    ib_types::ioctl::encode_request::<RegPhysMr>(s.pd, &input, &pages, 0, &mut bytes).unwrap();
    let out_len = ib_types::ioctl::response_len::<RegPhysMr>(0).unwrap();
    let (request, issuer) = w.raw_request(
        <RegPhysMr as ib_types::ioctl::Verb>::ID.ioctl().raw(),
        KERNEL,
        bytes.clone(),
        out_len,
    );
    let r = w.submit_in_dpc_at(x, request, issuer);
    let resp = response::<RegPhysMr>(&r);
    assert_eq!(resp.status, IbStatus::Success);
    let out = resp.output.unwrap();
    assert_eq!(out.iova, 0x7000_0100);
    assert_eq!(out.keys.rkey, RKey::new(out.keys.lkey.get()));
    let phys = resp.handle;
    let (_, q) = query_mr(&w, x, phys);
    let q = q.unwrap();
    assert_eq!((q.vaddr, q.length, q.pd.raw()), (0x7000_0100, 7900, s.pd));
    // From user mode the verb is refused (kernel only).
    let (request, issuer) = w.raw_request(
        <RegPhysMr as ib_types::ioctl::Verb>::ID.ioctl().raw(),
        RequestorMode::User,
        bytes,
        out_len,
    );
    let r = w.submit_in_dpc_at(x, request, issuer);
    assert_eq!(
        response::<RegPhysMr>(&r).status,
        IbStatus::InvalidPermission
    );
    assert_eq!(dereg(&w, x, phys), IbStatus::Success);
    w.adapter_at(x).free_common(common);

    let mt = w.hca_at(x).memory_translation().unwrap();
    assert_eq!(mt.usage().regions, 1);
    buf.free(&w, x);
    assert_eq!(mt.usage().regions, 0);
    assert_eq!(mt.usage().translations, 0);
    assert_eq!(dealloc_pd(&w, x, pd2), IbStatus::Success);
    teardown(&w, &s);
    w.finish();
}

fn alloc_mw(w: &World, s: &Setup, mw_type: MwType) -> (u64, RKey) {
    let input = MwAttr {
        mw_type,
        rkey: RKey::new(0),
    };
    let r = w.call_in_dpc_at::<AllocMw>(s.i, KERNEL, s.pd, &input, 0);
    let resp = response::<AllocMw>(&r);
    assert_eq!(resp.status, IbStatus::Success);
    let out = resp.output.unwrap();
    assert_eq!(out.mw_type, mw_type);
    (resp.handle, out.rkey)
}

fn query_mw(w: &World, i: usize, mw: u64) -> (IbStatus, Option<ib_types::ioctl::QueryMwOut>) {
    let r = w.call_in_dpc_at::<QueryMw>(i, KERNEL, mw, &Empty, 0);
    let resp = response::<QueryMw>(&r);
    (resp.status, resp.output)
}

fn bind(mw: u64, rkey: RKey, region: &Buf, offset: usize, length: u64) -> SendOp {
    SendOp::BindMw {
        mw: MwHandle::from_raw(mw),
        rkey,
        bind: MwBind {
            mr_lkey: region.keys.lkey,
            addr: region.addr(offset),
            length,
            access: AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        },
    }
}

#[test]
fn memory_windows_of_both_types_bind_grant_access_and_are_revoked() {
    let (w, [x, y]) = two_hcas(73);
    let (sx, sy) = (setup(&w, x), setup(&w, y));
    let bx = Buf::new(&w, &sx, ALL_RIGHTS);
    let by = Buf::new(&w, &sy, ALL_RIGHTS);
    let (a, b) = pair(&w, &sx, &sy);
    let hy = w.hca_at(y);

    let (mw1, first1) = alloc_mw(&w, &sy, MwType::Type1);
    let (mw2, _) = alloc_mw(&w, &sy, MwType::Type2);
    let (status, q) = query_mw(&w, y, mw1);
    assert_eq!(status, IbStatus::Success);
    let q = q.unwrap();
    assert_eq!(
        (q.pd.raw(), q.attr.mw_type, q.attr.rkey),
        (sy.pd, MwType::Type1, first1)
    );

    // Bad binds are refused at post time, nothing posted: a key that
    // names another window, a stale window handle.
    let key1 = hy.next_mw_rkey(mw1).unwrap();
    assert_ne!(key1, first1);
    let key2 = hy.next_mw_rkey(mw2).unwrap();
    assert_eq!(
        w.post_send_in_dpc(y, b, vec![signaled(90, &[], bind(mw1, key2, &by, 0, 64))]),
        (0, IbStatus::InvalidRkey)
    );
    assert_eq!(
        w.post_send_in_dpc(
            y,
            b,
            vec![signaled(91, &[], bind(mw1 + (1 << 24), key1, &by, 0, 64))]
        ),
        (0, IbStatus::InvalidMwHandle)
    );

    // Rights a window cannot have (local ones).
    let local_rights = SendOp::BindMw {
        mw: MwHandle::from_raw(mw1),
        rkey: key1,
        bind: MwBind {
            mr_lkey: by.keys.lkey,
            addr: by.addr(0),
            length: 64,
            access: AccessFlags::LOCAL_WRITE,
        },
    };
    assert_eq!(
        w.post_send_in_dpc(y, b, vec![signaled(92, &[], local_rights)]),
        (0, IbStatus::InvalidPermission)
    );

    // Type 1: bound by a bind WR on y's QP over by[4096..8192].
    let wc = run_one(
        &w,
        &sy,
        b,
        signaled(10, &[], bind(mw1, key1, &by, 4096, 4096)),
    );
    assert_eq!(
        (wc.status, wc.opcode),
        (WcStatus::Success, WcOpcode::BindMw)
    );
    let (_, q) = query_mw(&w, y, mw1);
    assert_eq!(q.unwrap().attr.rkey, key1, "the device's key is the bind's");
    // The region refuses deregistration while a window is bound, and is
    // unchanged.
    assert_eq!(dereg(&w, y, by.mr), IbStatus::ResourceBusy);
    let (status, q) = query_mr(&w, y, by.mr);
    assert_eq!((status, q.unwrap().keys), (IbStatus::Success, by.keys));
    // Remote access through the window's R_Key.
    let through = pattern(9, 2000);
    bx.write(0, &through);
    let via = |rkey: RKey, offset: usize| SendOp::RdmaWrite {
        remote: RemoteAddr {
            addr: by.addr(offset),
            rkey,
        },
    };
    let src = leak_sges(vec![bx.sge(0, 2000)]);
    let wc = run_one(&w, &sx, a, signaled(11, src, via(key1, 5000)));
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(by.read(5000, 2000), through);

    // Type 2: bound to QP b, written through, invalidated by LOCAL_INV.
    let wc = run_one(
        &w,
        &sy,
        b,
        signaled(12, &[], bind(mw2, key2, &by, 8192, 4096)),
    );
    assert_eq!(wc.status, WcStatus::Success);
    let second = pattern(33, 2000);
    bx.write(0, &second);
    let wc = run_one(&w, &sx, a, signaled(13, src, via(key2, 9000)));
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(by.read(9000, 2000), second);
    let wc = run_one(
        &w,
        &sy,
        b,
        signaled(14, &[], SendOp::LocalInvalidate { rkey: key2 }),
    );
    assert_eq!(
        (wc.status, wc.opcode),
        (WcStatus::Success, WcOpcode::LocalInvalidate)
    );
    // Type 1 unbound by a zero-length bind, which changes its key too.
    let unbind_key = hy.next_mw_rkey(mw1).unwrap();
    let wc = run_one(
        &w,
        &sy,
        b,
        signaled(15, &[], bind(mw1, unbind_key, &by, 0, 0)),
    );
    assert_eq!(wc.status, WcStatus::Success);
    let (_, q) = query_mw(&w, y, mw1);
    assert_eq!(q.unwrap().attr.rkey, unbind_key);

    // The old type 1 key is refused by the remote; the pair breaks.
    bx.write(0, &[0x55; 2000]);
    let wc = run_one(&w, &sx, a, signaled(16, src, via(key1, 5000)));
    assert_eq!(wc.status, WcStatus::RemAccessErr);
    assert_eq!(by.read(5000, 2000), through, "nothing written");
    unpair(&w, &sx, &sy, (a, b));
    // The invalidated type 2 key is refused too (a fresh pair).
    let (a, b) = pair(&w, &sx, &sy);
    let wc = run_one(&w, &sx, a, signaled(17, src, via(key2, 9000)));
    assert_eq!(wc.status, WcStatus::RemAccessErr);
    assert_eq!(by.read(9000, 2000), second, "nothing written");
    unpair(&w, &sx, &sy, (a, b));

    // A remote SEND_WITH_INV unbinds a type 2 window too: bound again (a
    // new key) on a fresh pair's responder, the key carried by a send that
    // invalidates it, then refused.
    let (a, b) = pair(&w, &sx, &sy);
    let key2b = hy.next_mw_rkey(mw2).unwrap();
    let wc = run_one(
        &w,
        &sy,
        b,
        signaled(20, &[], bind(mw2, key2b, &by, 8192, 4096)),
    );
    assert_eq!(wc.status, WcStatus::Success);
    let third = pattern(71, 2000);
    bx.write(0, &third);
    let wc = run_one(&w, &sx, a, signaled(21, src, via(key2b, 10000)));
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(by.read(10000, 2000), third);
    let recv_sges = leak_sges(vec![by.sge(0, 64)]);
    let posted = std::sync::Arc::new(std::sync::Mutex::new(None));
    {
        let (hca, posted) = (w.hca_at(y), posted.clone());
        w.in_dpc(move || {
            let wrs = [ib_types::wr::RecvWr {
                wr_id: 22,
                sg_list: recv_sges,
            }];
            *support::lock(&posted) = Some(hca.post_recv(b, &wrs));
        });
        w.settle();
    }
    assert_eq!(*support::lock(&posted), Some((1, IbStatus::Success)));
    let small = leak_sges(vec![bx.sge(0, 16)]);
    let wc = run_one(
        &w,
        &sx,
        a,
        signaled(23, small, SendOp::SendWithInvalidate { rkey: key2b }),
    );
    assert_eq!(wc.status, WcStatus::Success);
    let got = poll_all(&w, y, sy.cq);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!((got[0].wr_id, got[0].status), (22, WcStatus::Success));
    assert!(
        got[0]
            .flags
            .contains(ib_types::wc::WcFlags::WITH_INVALIDATE)
    );
    assert_eq!(got[0].imm_or_invalidated_rkey, key2b.get());
    let wc = run_one(&w, &sx, a, signaled(24, src, via(key2b, 10000)));
    assert_eq!(wc.status, WcStatus::RemAccessErr);
    unpair(&w, &sx, &sy, (a, b));

    // No window bound: the region deregisters. The windows still hold
    // their PD.
    let by_mr = by.mr;
    by.free(&w, y);
    assert_eq!(query_mr(&w, y, by_mr).0, IbStatus::InvalidMrHandle);
    assert_eq!(dealloc_pd(&w, y, sy.pd), IbStatus::ResourceBusy);
    for mw in [mw1, mw2] {
        let r = w.call_in_dpc_at::<DeallocMw>(y, KERNEL, mw, &Empty, 0);
        assert_eq!(response::<DeallocMw>(&r).status, IbStatus::Success);
        let r = w.call_in_dpc_at::<DeallocMw>(y, KERNEL, mw, &Empty, 0);
        assert_eq!(response::<DeallocMw>(&r).status, IbStatus::InvalidMwHandle);
        assert_eq!(query_mw(&w, y, mw).0, IbStatus::InvalidMwHandle);
    }
    bx.free(&w, x);
    teardown(&w, &sx);
    teardown(&w, &sy);
    w.finish();
}

#[test]
fn deallocating_a_bound_window_releases_its_region() {
    let (w, [_, y]) = two_hcas(74);
    let s = setup(&w, y);
    let buf = Buf::new(&w, &s, ALL_RIGHTS);
    let (b, _) = create_rc(&w, &s);
    // A QP in RTS of its own to post the bind from (loopback address).
    connect(&w, y, b, 0, HCA_IPS[1][0]);
    let (mw, _) = alloc_mw(&w, &s, MwType::Type1);
    let key = w.hca_at(y).next_mw_rkey(mw).unwrap();
    let wc = run_one(&w, &s, b, signaled(1, &[], bind(mw, key, &buf, 0, 4096)));
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(dereg(&w, y, buf.mr), IbStatus::ResourceBusy);
    let r = w.call_in_dpc_at::<DeallocMw>(y, KERNEL, mw, &Empty, 0);
    assert_eq!(response::<DeallocMw>(&r).status, IbStatus::Success);
    // The binding went with the window: the region's deregistration at
    // the end succeeds.

    // A region without MW_BIND cannot carry a window: the device fails the
    // bind (MW_BIND_ERR), and the region stays free of windows.
    let plain = Buf::new(&w, &s, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ);
    let (mw, _) = alloc_mw(&w, &s, MwType::Type1);
    let key = w.hca_at(y).next_mw_rkey(mw).unwrap();
    let wc = run_one(&w, &s, b, signaled(2, &[], bind(mw, key, &plain, 0, 4096)));
    assert_eq!(wc.status, WcStatus::MwBindErr);
    destroy_qp(&w, y, b);
    let _ = poll_all(&w, y, s.cq);
    plain.free(&w, y);
    let r = w.call_in_dpc_at::<DeallocMw>(y, KERNEL, mw, &Empty, 0);
    assert_eq!(response::<DeallocMw>(&r).status, IbStatus::Success);
    buf.free(&w, y);
    teardown(&w, &s);
    w.finish();
}

#[test]
fn bad_inputs_get_a_clear_status_and_change_nothing() {
    let (w, [x, _]) = two_hcas(75);
    let s = setup(&w, x);
    let mt = w.hca_at(x).memory_translation().unwrap();
    let idle = mt.usage();
    let block = w
        .host
        .pool()
        .alloc(support::DRIVER, *b"MrB ", 8192)
        .unwrap();
    let good = MrRegister {
        vaddr: block.va(),
        length: 8192,
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
    };
    let reg = |pd: u64, input: &MrRegister| {
        let r = w.call_in_dpc_at::<RegMr>(x, KERNEL, pd, input, 0);
        response::<RegMr>(&r).status
    };
    // Stale and wrong-kind PD handles.
    assert_eq!(reg(s.pd + (1 << 24), &good), IbStatus::InvalidPdHandle);
    assert_eq!(reg(s.cq, &good), IbStatus::InvalidPdHandle);
    // Memory that is not there (nothing allocated at the address).
    let unmapped = MrRegister {
        vaddr: 0x10,
        ..good
    };
    assert_eq!(reg(s.pd, &unmapped), IbStatus::InvalidPermission);
    // What `encode_request` refuses to produce, patched into the bytes
    // (MrRegisterAbi: vaddr @0, length @8, access @16).
    let patched = |patch: fn(&mut [u8])| {
        let (request, issuer) = w.patched_request::<RegMr>(KERNEL, s.pd, &good, patch);
        let r = w.submit_in_dpc_at(x, request, issuer);
        response::<RegMr>(&r).status
    };
    let zero_length: fn(&mut [u8]) = |b| b[8..16].copy_from_slice(&0u64.to_le_bytes());
    let overflowing: fn(&mut [u8]) = |b| {
        b[0..8].copy_from_slice(&(u64::MAX - 100).to_le_bytes());
    };
    let remote_write_alone: fn(&mut [u8]) =
        |b| b[16..20].copy_from_slice(&AccessFlags::REMOTE_WRITE.bits().to_le_bytes());
    let unknown_right: fn(&mut [u8]) = |b| b[16..20].copy_from_slice(&(1u32 << 20).to_le_bytes());
    for patch in [zero_length, overflowing, remote_write_alone, unknown_right] {
        assert_eq!(patched(patch), IbStatus::InvalidParameter);
    }
    assert_eq!(mt.usage(), idle, "nothing registered, locked or taken");
    assert_eq!(dealloc_pd(&w, x, s.pd), IbStatus::Success, "no PD use left");
    let pd = alloc_pd(&w, x, s.ca);
    let s = Setup { pd, ..s };

    // A user-mode registration: without its caller (a DPC) it is
    // refused; carrying its caller at PASSIVE_LEVEL it reaches the PD
    // check, and a kernel CA's PD is invisible to user mode.
    let (request, issuer) = w.request::<RegMr>(RequestorMode::User, s.pd, &good, 0);
    let r = w.submit_in_dpc_at(x, request, issuer);
    assert_eq!(response::<RegMr>(&r).status, IbStatus::InvalidState);
    let process = sim_host::memory::Process::new(7);
    let user_va = process.alloc(8192).unwrap();
    let user_input = MrRegister {
        vaddr: user_va,
        ..good
    };
    let caller = sim_host::caller::HostCaller::new(w.host.pool().kernel_space(), &process);
    let r = w.user_call_at::<RegMr>(x, &caller, s.pd, &user_input, &[], 0);
    assert_eq!(response::<RegMr>(&r).status, IbStatus::InvalidPdHandle);
    assert_eq!(process.space().locked_pages(), 0);

    // A live region: wrong handles for the other verbs, a re-registration
    // to a stale PD, a region query with a PD handle.
    let buf = Buf::new(&w, &s, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND);
    assert_eq!(query_mr(&w, x, s.pd).0, IbStatus::InvalidMrHandle);
    assert_eq!(dereg(&w, x, buf.mr + (1 << 24)), IbStatus::InvalidMrHandle);
    let to_stale_pd = MrRereg {
        pd: Some(PdHandle::from_raw(s.pd + (1 << 24))),
        ..MrRereg::default()
    };
    let r = w.call_in_dpc_at::<ReregMr>(x, KERNEL, buf.mr, &to_stale_pd, 0);
    assert_eq!(response::<ReregMr>(&r).status, IbStatus::InvalidPdHandle);
    // A re-registration to a range that cannot be locked: refused, the old
    // region intact with its keys.
    let bad_range = MrRereg {
        translation: Some((0x10, 4096)),
        ..MrRereg::default()
    };
    let r = w.call_in_dpc_at::<ReregMr>(x, KERNEL, buf.mr, &bad_range, 0);
    assert_eq!(response::<ReregMr>(&r).status, IbStatus::InvalidPermission);
    // Remote write without local write in a re-registration (the device's
    // rule as well, IBA C11-13), patched in (MrReregAbi: flags @0, access
    // @4).
    let rights = MrRereg {
        access: Some(AccessFlags::REMOTE_READ),
        ..MrRereg::default()
    };
    let (request, issuer) = w.patched_request::<ReregMr>(KERNEL, buf.mr, &rights, |b| {
        b[4..8].copy_from_slice(&AccessFlags::REMOTE_WRITE.bits().to_le_bytes());
    });
    let r = w.submit_in_dpc_at(x, request, issuer);
    assert_eq!(response::<ReregMr>(&r).status, IbStatus::InvalidParameter);
    let (status, q) = query_mr(&w, x, buf.mr);
    assert_eq!(status, IbStatus::Success);
    let q = q.unwrap();
    assert_eq!((q.keys, q.pd.raw(), q.vaddr), (buf.keys, s.pd, buf.addr(0)));
    // One operation at a time: a deregistration issued while a
    // re-registration is in flight (one DPC) is busy; the re-registration
    // completes.
    let rights = MrRereg {
        access: Some(AccessFlags::LOCAL_WRITE),
        ..MrRereg::default()
    };
    let (rereg_req, rereg_issuer) = w.request::<ReregMr>(KERNEL, buf.mr, &rights, 0);
    let (dereg_req, dereg_issuer) = w.request::<DeregMr>(KERNEL, buf.mr, &Empty, 0);
    let hca = w.hca_at(x);
    w.in_dpc(move || {
        hca.submit_request(rereg_req);
        hca.submit_request(dereg_req);
    });
    w.settle();
    let r = dereg_issuer.completion().unwrap();
    assert_eq!(response::<DeregMr>(&r).status, IbStatus::ResourceBusy);
    let r = rereg_issuer.completion().unwrap();
    let resp = response::<ReregMr>(&r);
    assert_eq!(resp.status, IbStatus::Success);
    let buf = Buf {
        keys: resp.output.unwrap(),
        ..buf
    };
    let (_, q) = query_mr(&w, x, buf.mr);
    assert_eq!(q.unwrap().access, AccessFlags::LOCAL_WRITE);
    // A shared registration over a stale region.
    let share = MrShare {
        pd: PdHandle::from_raw(s.pd),
        vaddr: 0x9000,
        access: AccessFlags::LOCAL_WRITE,
    };
    let r = w.call_in_dpc_at::<RegSharedMr>(x, KERNEL, buf.mr + (1 << 24), &share, 0);
    assert_eq!(
        response::<RegSharedMr>(&r).status,
        IbStatus::InvalidMrHandle
    );

    // Windows: a stale PD, the wrong kinds of handle.
    let r = w.call_in_dpc_at::<AllocMw>(
        x,
        KERNEL,
        s.pd + (1 << 24),
        &MwAttr {
            mw_type: MwType::Type2,
            rkey: RKey::new(0),
        },
        0,
    );
    assert_eq!(response::<AllocMw>(&r).status, IbStatus::InvalidPdHandle);
    assert_eq!(query_mw(&w, x, buf.mr).0, IbStatus::InvalidMwHandle);
    let r = w.call_in_dpc_at::<DeallocMw>(x, KERNEL, s.pd, &Empty, 0);
    assert_eq!(response::<DeallocMw>(&r).status, IbStatus::InvalidMwHandle);
    assert_eq!(mt.usage().regions, 1);

    let usage = mt.usage();
    buf.free(&w, x);
    assert_eq!(mt.usage().regions, usage.regions - 1);
    assert_eq!(mt.usage(), idle);
    w.host.pool().free(block);
    teardown(&w, &s);
    w.finish();
}

#[test]
fn regions_and_windows_left_at_stop_are_released() {
    let (w, [x, _]) = two_hcas(76);
    let s = setup(&w, x);
    // A kernel client's buffer (its own pool allocation), registered and
    // left so, with a window in the PD, when the device stops: the core
    // unmaps and unlocks the pages itself; the verifier finds no mapping
    // or lock left behind.
    let block = w.host.pool().alloc("kclient", *b"Left", 3 * 4096).unwrap();
    let input = MrRegister {
        vaddr: block.va() + 100,
        length: 2 * 4096,
        access: ALL_RIGHTS,
    };
    let r = w.call_in_dpc_at::<RegMr>(x, KERNEL, s.pd, &input, 0);
    assert_eq!(response::<RegMr>(&r).status, IbStatus::Success);
    let (_mw, _) = alloc_mw(&w, &s, MwType::Type2);
    let mt = w.hca_at(x).memory_translation().unwrap();
    assert_eq!(mt.usage().regions, 1);
    w.host.shut_down();
    w.host.verifier().assert_clean();
    assert_eq!(mt.usage().regions, 0);
    assert_eq!(mt.usage().translations, 0);
    w.host.pool().free(block);
}
