//! The UVP's pre/post hooks (`uvp_plugin::Provider`, guide 6.2.2, 6.4.2,
//! 6.5.3, 6.8.1, Table 10-1) against the real miniport on the simulated
//! host: a small access library here calls every verb as Table 10-1 says
//! (pre, the proxy IOCTL of the process, post; `VerbsProcessingDone`
//! completes in user mode; a failed post after a successful create
//! destroys the object), the provider allocates the rings in the process
//! and builds the fast-path objects from the kernel's answers, and data
//! moves through the provider's fast path by handle, byte-checked. Address
//! vectors are shown never to reach the kernel (`Process::requests_issued`),
//! each Table 10-1 row is forced with `uvp_plugin::faults::FaultInjector`,
//! and hostile responses are refused with every ring allocation freed.
//! Each test ends with the host shut down and the verifier clean.

mod support;

use std::sync::Arc;

use driver_platform::RequestorMode;
use ib_types::abi::Repr;
use ib_types::access::AccessFlags;
use ib_types::cq::{CqAttr, CqNotify};
use ib_types::handle::{AvHandle, CqHandle, PdHandle, SrqHandle};
use ib_types::ioctl::{
    AllocMw, AllocPd, CloseCa, CreateAv, CreateCq, CreateQp, CreateSrq, DeallocMw, DeallocPd,
    DeregMr, DestroyAv, DestroyCq, DestroyQp, DestroySrq, Empty, ModifyAv, ModifyQp, OpenCa,
    OpenCaIn, QueryAv, RegMr, ResizeCq, Verb, VerbId, decode_response, encode_request, request_len,
    response_len,
};
use ib_types::mr::{MrRegister, MwAttr, MwType};
use ib_types::qp::{QpCaps, QpCreate, QpModify, QpState, QpType};
use ib_types::scalars::{PortNum, Psn, QKey, Qpn};
use ib_types::srq::{SrqAttr, SrqCreate};
use ib_types::status::IbStatus;
use ib_types::uvp::{
    PostCall, PreCall, PreOutcome, UVP_INTERFACE_VERSION, UserSend, UserVerbsProvider, UvpInterface,
};
use ib_types::wc::{WcStatus, WorkCompletion};
use ib_types::wr::{LKey, RKey, RecvWr, SendFlags, SendOp, SendWr, Sge, UdDest};
use sim_host::memory::Process;
use support::World;
use support::kernel_pair;
use support::rc_path::{grh_av, rc_to_rts_steps};
use uvp_plugin::faults::{Fault, FaultInjector, HookEvent};
use uvp_plugin::provider::USER_AV_TAG;
use uvp_plugin::{Platform, Provider, UserMemory, export};
use zerocopy::IntoBytes;

const GUIDS: [u64; 2] = [0x0002_C900_0000_7000, 0x0002_C900_0000_8000];
const IPS: [[[u8; 4]; 2]; 2] = [
    [[10, 0, 0, 1], [10, 0, 1, 1]],
    [[10, 0, 2, 1], [10, 0, 3, 1]],
];

/// Deterministic, non-trivial bytes.
fn pattern(seed: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(13).wrapping_add(seed * 5) as u8)
        .collect()
}

/// The process's memory as the provider allocates it.
struct SimMemory(Process);

impl UserMemory for SimMemory {
    fn alloc(&self, len: usize) -> Option<u64> {
        self.0.alloc(len).ok()
    }

    fn free(&self, va: u64) {
        // A provider freeing what it never allocated would be its bug.
        self.0
            .free(va)
            .expect("the provider frees its own allocation");
    }
}

/// A response changed between the kernel and post (a hostile or buggy
/// kernel): `(verb, V::Out bytes, private bytes)`.
type Tamper = Box<dyn Fn(VerbId, &mut Vec<u8>, &mut Vec<u8>)>;

/// A small access library: one process on HCA `i`, calling verbs through
/// `uvp`'s hooks as Table 10-1 prescribes.
struct Lib<'a, P> {
    w: &'a World,
    i: usize,
    process: Process,
    uvp: &'a P,
    tamper: std::cell::RefCell<Option<Tamper>>,
}

/// A call the library refused: whose status.
#[derive(Debug, PartialEq, Eq)]
enum Failed {
    /// Pre failed; no IOCTL.
    Pre(IbStatus),
    /// The IOCTL failed and post said so.
    Ioctl(IbStatus),
    /// The IOCTL succeeded, post failed; the object was destroyed.
    Post(IbStatus),
    /// Post answered success after a failed IOCTL: a plug-in bug (the
    /// guide's access layer asserts).
    PluginBug(IbStatus),
}

impl<'a, P: UserVerbsProvider> Lib<'a, P> {
    fn new(w: &'a World, i: usize, process: Process, uvp: &'a P) -> Self {
        Self {
            w,
            i,
            process,
            uvp,
            tamper: std::cell::RefCell::new(None),
        }
    }

    /// One verb: `(created handle, V::Out)`.
    fn call<V: Verb>(&self, handle: u64, input: &V::In) -> Result<(u64, V::Out), Failed> {
        let in_abi = input.emit();
        let mut private_in = vec![0u8; 256];
        let mut output = vec![0u8; V::ID.out_size()];
        let mut pre = PreCall {
            verb: V::ID,
            handle,
            input: in_abi.as_bytes(),
            private_in: &mut private_in,
            output: &mut output,
        };
        let (private_in_len, private_out_max, cookie) = match self.uvp.pre(&mut pre) {
            Err(status) => return Err(Failed::Pre(status)),
            Ok(PreOutcome::Done { handle }) => {
                let (out, _) = V::Out::decode(&output).expect("the plug-in's output parses");
                return Ok((handle, out));
            }
            Ok(PreOutcome::Ioctl {
                private_in_len,
                private_out_max,
                cookie,
            }) => (private_in_len, private_out_max, cookie),
        };
        let private = &private_in[..private_in_len];
        let out_max = private_out_max as u32;
        let mut bytes = vec![0; request_len::<V>(private.len()).unwrap()];
        encode_request::<V>(handle, input, private, out_max, &mut bytes).unwrap();
        let (mut request, issuer) = self.w.raw_request(
            V::ID.ioctl().raw(),
            RequestorMode::User,
            bytes,
            response_len::<V>(private_out_max).unwrap(),
        );
        request.set_process(self.process.clone());
        self.w
            .host
            .pnp()
            .send_request(self.w.device_at(self.i).node(), request);
        self.w.settle();
        let done = issuer.completion().expect("the request completed");
        // A failed METHOD_BUFFERED IOCTL returns no output: the status is
        // all the caller sees.
        let status = IbStatus::from_ntstatus(done.status);
        let (created, mut out_bytes, mut private_out) = if status == IbStatus::Success {
            let raw = &done.output[..done.information as usize];
            let r = decode_response::<V>(raw).expect("a valid response");
            let fixed = 16..16 + V::ID.out_size();
            (r.handle, raw[fixed].to_vec(), r.private.to_vec())
        } else {
            (0, vec![0; V::ID.out_size()], Vec::new())
        };
        if let Some(tamper) = &*self.tamper.borrow() {
            tamper(V::ID, &mut out_bytes, &mut private_out);
        }
        let post = PostCall {
            verb: V::ID,
            handle,
            input: in_abi.as_bytes(),
            private_in: private,
            cookie,
            status,
            created,
            output: &out_bytes,
            private_out: &private_out,
        };
        match (status, self.uvp.post(&post)) {
            (IbStatus::Success, Ok(())) => {
                let (out, _) = V::Out::decode(&out_bytes).expect("a checked output");
                Ok((created, out))
            }
            (IbStatus::Success, Err(post_status)) => {
                self.destroy(V::ID, created);
                Err(Failed::Post(post_status))
            }
            (failed, Err(post_status)) => {
                assert_eq!(post_status, failed, "post reports the IOCTL's status");
                Err(Failed::Ioctl(failed))
            }
            (failed, Ok(())) => Err(Failed::PluginBug(failed)),
        }
    }

    /// Row 2: the object a create made, destroyed through the hooks.
    fn destroy(&self, created_by: VerbId, handle: u64) {
        let result = match created_by {
            VerbId::OpenCa => self.call::<CloseCa>(handle, &Empty).map(drop),
            VerbId::AllocPd => self.call::<DeallocPd>(handle, &Empty).map(drop),
            VerbId::CreateCq => self.call::<DestroyCq>(handle, &Empty).map(drop),
            VerbId::CreateQp => self.call::<DestroyQp>(handle, &Empty).map(drop),
            VerbId::CreateSrq => self.call::<DestroySrq>(handle, &Empty).map(drop),
            VerbId::RegMr => self.call::<DeregMr>(handle, &Empty).map(drop),
            VerbId::AllocMw => self.call::<DeallocMw>(handle, &Empty).map(drop),
            _ => Ok(()),
        };
        assert_eq!(result, Ok(()), "destroying what {created_by:?} made");
    }

    #[track_caller]
    fn ok<V: Verb>(&self, handle: u64, input: &V::In) -> (u64, V::Out) {
        match self.call::<V>(handle, input) {
            Ok(done) => done,
            Err(e) => panic!("{:?}: {e:?}", V::ID),
        }
    }

    fn open(&self) -> u64 {
        self.ok::<OpenCa>(0, &OpenCaIn::CURRENT).0
    }

    fn cq(&self, ca: u64, cqe: u32) -> u64 {
        let attr = CqAttr {
            cqe,
            comp_vector: 0,
        };
        self.ok::<CreateCq>(ca, &attr).0
    }

    fn qp(&self, ca: u64, qp_type: QpType, pd: u64, cq: u64, srq: Option<u64>) -> (u64, u32) {
        let create = qp_create(qp_type, pd, cq, srq);
        let (handle, out) = self.ok::<CreateQp>(ca, &create);
        (handle, out.qpn.get())
    }

    fn register(&self, pd: u64, len: usize) -> (u64, u64, LKey) {
        let va = self.process.alloc(len).unwrap();
        let input = MrRegister {
            vaddr: va,
            length: len as u64,
            access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        };
        let (handle, keys) = self.ok::<RegMr>(pd, &input);
        (va, handle, keys.lkey)
    }

    fn modify(&self, qp: u64, steps: &[QpModify]) {
        for m in steps {
            self.ok::<ModifyQp>(qp, m);
        }
    }

    /// Polls `cq` (the machine settled) until `n` completions.
    #[track_caller]
    fn poll(&self, cq: u64, n: usize) -> Vec<WorkCompletion> {
        let mut out = vec![WorkCompletion::EMPTY; n + 4];
        let got = self.uvp.poll_cq(cq, &mut out).unwrap();
        assert_eq!(got, n, "completions: {:?}", &out[..got]);
        out.truncate(got);
        out
    }

    fn read(&self, va: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0; len];
        self.process.read(va, &mut out).unwrap();
        out
    }

    fn allocations(&self) -> usize {
        self.process.space().allocation_count()
    }
}

fn qp_create(qp_type: QpType, pd: u64, cq: u64, srq: Option<u64>) -> QpCreate {
    QpCreate {
        qp_type,
        pd: PdHandle::from_raw(pd),
        send_cq: CqHandle::from_raw(cq),
        recv_cq: CqHandle::from_raw(cq),
        srq: srq.map(SrqHandle::from_raw),
        caps: QpCaps {
            max_send_wr: 8,
            max_recv_wr: if srq.is_some() { 0 } else { 8 },
            max_send_sge: 2,
            max_recv_sge: if srq.is_some() { 0 } else { 1 },
            max_inline_data: 64,
        },
        sq_sig_all: false,
        port: None,
    }
}

fn ud_to_rts() -> Vec<QpModify> {
    vec![
        QpModify {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(PortNum::FIRST),
            qkey: Some(QKey::new(0x11)),
            ..QpModify::default()
        },
        QpModify::to_state(QpState::Rtr),
        QpModify {
            sq_psn: Some(Psn::new(1).unwrap()),
            ..QpModify::to_state(QpState::Rts)
        },
    ]
}

fn provider(process: &Process) -> Provider {
    Provider::new(platform(process))
}

fn platform(process: &Process) -> Platform {
    let mapped = process.clone();
    Platform {
        memory: Arc::new(SimMemory(process.clone())),
        // The simulator's side of the doorbell: the store reaches the
        // device in the calling thread.
        mmio: Arc::new(move |address, value| {
            let _ = mapped.write_device64(address, value);
        }),
    }
}

fn world(seed: u64) -> (World, [usize; 2]) {
    kernel_pair::two_two_port_hcas(seed, GUIDS, &IPS)
}

fn send(wr_id: u64, sges: &[Sge], ud: Option<UdDest>) -> SendWr<'_> {
    SendWr {
        wr_id,
        op: SendOp::Send,
        flags: SendFlags::SIGNALED,
        sg_list: sges,
        ud,
    }
}

#[test]
fn every_hook_creates_its_object_through_the_miniport_and_data_moves_byte_for_byte() {
    let (w, [a_hca, b_hca]) = world(5);
    let (a_process, b_process) = (Process::new(41), Process::new(42));
    let (a_uvp, b_uvp) = (provider(&a_process), provider(&b_process));
    hooks_and_data(&w, [a_hca, b_hca], [a_process, b_process], [&a_uvp, &b_uvp]);
    assert_eq!((a_uvp.allocations(), b_uvp.allocations()), (0, 0));
    w.finish();
}

/// The same through the DLL form: each process's provider is the table
/// the exported `uvp_get_interface` returns for its platform, called
/// through its C entry points (`export::Table`).
#[test]
fn the_exported_table_runs_the_same_hooks_and_fast_path() {
    let (w, [a_hca, b_hca]) = world(9);
    let (a_process, b_process) = (Process::new(43), Process::new(44));
    let table = |process: &Process| {
        export::set_platform(Some(platform(process)));
        let mut table = std::mem::MaybeUninit::<UvpInterface>::uninit();
        // SAFETY: `table` is writable for one table.
        let status = unsafe {
            export::uvp_get_interface(UVP_INTERFACE_VERSION.packed(), table.as_mut_ptr())
        };
        export::set_platform(None);
        assert_eq!(status, ib_types::status::NtStatus::SUCCESS);
        // SAFETY: the entry point succeeded, so it filled the table.
        let table = unsafe { table.assume_init() };
        // SAFETY: the plug-in's own table, released by `Table`'s drop only.
        unsafe { export::Table::new(table) }.unwrap()
    };
    let (a_uvp, b_uvp) = (table(&a_process), table(&b_process));
    hooks_and_data(&w, [a_hca, b_hca], [a_process, b_process], [&a_uvp, &b_uvp]);
    w.finish();
}

/// Two processes on two HCAs, each with its provider: every object made
/// through the hooks, RC both ways and UD through a user AV with data
/// checked byte for byte and no request in the data phase, then every
/// object destroyed through the hooks and every ring freed.
fn hooks_and_data<P: UserVerbsProvider>(
    w: &World,
    [a_hca, b_hca]: [usize; 2],
    [a_process, b_process]: [Process; 2],
    [a_uvp, b_uvp]: [&P; 2],
) {
    let a = Lib::new(w, a_hca, a_process, a_uvp);
    let b = Lib::new(w, b_hca, b_process, b_uvp);
    let (a_baseline, b_baseline) = (a.allocations(), b.allocations());

    // Control path, every object through pre, the IOCTL and post.
    let a_ca = a.open();
    let b_ca = b.open();
    let a_pd = a.ok::<AllocPd>(a_ca, &Empty).0;
    let b_pd = b.ok::<AllocPd>(b_ca, &Empty).0;
    let a_cq = a.cq(a_ca, 16);
    let b_cq = b.cq(b_ca, 8);
    let srq_create = SrqCreate {
        pd: PdHandle::from_raw(b_pd),
        attr: SrqAttr {
            max_wr: 8,
            max_sge: 1,
            srq_limit: 0,
        },
    };
    let b_srq = b.ok::<CreateSrq>(b_ca, &srq_create).0;
    let (a_rc, a_rc_qpn) = a.qp(a_ca, QpType::Rc, a_pd, a_cq, None);
    let (b_rc, b_rc_qpn) = b.qp(b_ca, QpType::Rc, b_pd, b_cq, Some(b_srq));
    let (a_ud, a_ud_qpn) = a.qp(a_ca, QpType::Ud, a_pd, a_cq, None);
    let (b_ud, b_ud_qpn) = b.qp(b_ca, QpType::Ud, b_pd, b_cq, None);
    let mw = MwAttr {
        mw_type: MwType::Type2,
        rkey: RKey::new(0),
    };
    let a_mw = a.ok::<AllocMw>(a_pd, &mw).0;
    // The rings are the provider's allocations in each process: one per
    // CQ, QP and SRQ.
    assert_eq!(a.allocations(), a_baseline + 3);
    assert_eq!(b.allocations(), b_baseline + 4);
    let (a_buf, a_mr, a_lkey) = a.register(a_pd, 1 << 14);
    let (b_buf, b_mr, b_lkey) = b.register(b_pd, 1 << 14);
    a.modify(
        a_rc,
        &rc_to_rts_steps(1, AccessFlags::REMOTE_WRITE, b_rc_qpn, IPS[1][0], 1),
    );
    b.modify(
        b_rc,
        &rc_to_rts_steps(1, AccessFlags::REMOTE_WRITE, a_rc_qpn, IPS[0][0], 1),
    );
    a.modify(a_ud, &ud_to_rts());
    b.modify(b_ud, &ud_to_rts());
    // B grows its CQ before traffic: polling goes on in the new ring.
    b.ok::<ResizeCq>(
        b_cq,
        &CqAttr {
            cqe: 64,
            comp_vector: 0,
        },
    );

    let a_requests = a.process.requests_issued();
    let b_requests = b.process.requests_issued();

    // RC, A -> B's SRQ: one gathered send (two SGEs) and one inline send.
    let first = pattern(1, 700);
    let second = pattern(2, 300);
    let inline = pattern(3, 48);
    a.process.write(a_buf, &first).unwrap();
    a.process.write(a_buf + 1024, &second).unwrap();
    a.process.write(a_buf + 2048, &inline).unwrap();
    let recvs: Vec<[Sge; 1]> = (0..2)
        .map(|n| [Sge::new(b_buf + n * 2048, 2048, b_lkey)])
        .collect();
    let wrs: Vec<RecvWr<'_>> = recvs
        .iter()
        .enumerate()
        .map(|(n, list)| RecvWr {
            wr_id: 100 + n as u64,
            sg_list: list,
        })
        .collect();
    assert_eq!(b_uvp.post_srq_recv(b_srq, &wrs), Ok(2));
    let gathered = [
        Sge::new(a_buf, 700, a_lkey),
        Sge::new(a_buf + 1024, 300, a_lkey),
    ];
    let inline_sge = [Sge::new(a_buf + 2048, 48, a_lkey)];
    let mut inline_wr = send(2, &inline_sge, None);
    inline_wr.flags |= SendFlags::INLINE;
    let sends = [
        UserSend {
            wr: send(1, &gathered, None),
            inline: None,
        },
        UserSend {
            wr: inline_wr,
            inline: Some(&inline),
        },
    ];
    assert_eq!(a_uvp.post_send(a_rc, &sends), Ok(2));
    w.settle();
    let wcs = b.poll(b_cq, 2);
    assert_eq!(
        wcs.iter()
            .map(|wc| (wc.wr_id, wc.status, wc.byte_len))
            .collect::<Vec<_>>(),
        [(100, WcStatus::Success, 1000), (101, WcStatus::Success, 48)]
    );
    assert_eq!(b.read(b_buf, 700), first);
    assert_eq!(b.read(b_buf + 700, 300), second);
    assert_eq!(b.read(b_buf + 2048, 48), inline);
    assert_eq!(a.poll(a_cq, 2).len(), 2);

    // RC, B -> A's own receive queue, with A's CQ armed first.
    let back = pattern(4, 1500);
    b.process.write(b_buf + 8192, &back).unwrap();
    let a_recv = [Sge::new(a_buf + 8192, 2048, a_lkey)];
    assert_eq!(
        a_uvp.post_recv(
            a_rc,
            &[RecvWr {
                wr_id: 7,
                sg_list: &a_recv
            }]
        ),
        Ok(1)
    );
    a_uvp.arm_cq(a_cq, CqNotify::NextCompletion).unwrap();
    let b_send = [Sge::new(b_buf + 8192, 1500, b_lkey)];
    let sends = [UserSend {
        wr: send(9, &b_send, None),
        inline: None,
    }];
    assert_eq!(b_uvp.post_send(b_rc, &sends), Ok(1));
    w.settle();
    let wc = a.poll(a_cq, 1)[0];
    assert_eq!(
        (wc.wr_id, wc.status, wc.byte_len),
        (7, WcStatus::Success, 1500)
    );
    assert_eq!(a.read(a_buf + 8192, 1500), back);
    assert_eq!(b.poll(b_cq, 1)[0].wr_id, 9);

    // UD, A -> B through an address vector the provider keeps.
    let av = a.ok::<CreateAv>(a_pd, &grh_av(1, IPS[1][0])).0;
    let datagram = pattern(5, 900);
    a.process.write(a_buf + 4096, &datagram).unwrap();
    let b_recv = [Sge::new(b_buf + 4096, 2048, b_lkey)];
    assert_eq!(
        b_uvp.post_recv(
            b_ud,
            &[RecvWr {
                wr_id: 11,
                sg_list: &b_recv
            }]
        ),
        Ok(1)
    );
    let ud_sge = [Sge::new(a_buf + 4096, 900, a_lkey)];
    let dest = UdDest {
        av: AvHandle::from_raw(av),
        remote_qpn: Qpn::new(b_ud_qpn).unwrap(),
        remote_qkey: QKey::new(0x11),
    };
    let sends = [UserSend {
        wr: send(12, &ud_sge, Some(dest)),
        inline: None,
    }];
    assert_eq!(a_uvp.post_send(a_ud, &sends), Ok(1));
    w.settle();
    let wc = b.poll(b_cq, 1)[0];
    assert_eq!(
        (wc.wr_id, wc.status, wc.byte_len),
        (11, WcStatus::Success, 940)
    );
    assert_eq!(wc.src_qp.get(), a_ud_qpn);
    assert_eq!(b.read(b_buf + 4096 + 40, 900), datagram);
    assert_eq!(a.poll(a_cq, 1)[0].wr_id, 12);
    // The data phase (and the AV) made no request.
    assert_eq!(a.process.requests_issued(), a_requests);
    assert_eq!(b.process.requests_issued(), b_requests);

    // Teardown through the hooks: every ring allocation freed.
    a.ok::<DestroyAv>(av, &Empty);
    a.ok::<DeallocMw>(a_mw, &Empty);
    for (lib, qps, mr) in [(&a, vec![a_rc, a_ud], a_mr), (&b, vec![b_rc, b_ud], b_mr)] {
        for qp in qps {
            lib.ok::<DestroyQp>(qp, &Empty);
        }
        lib.ok::<DeregMr>(mr, &Empty);
    }
    b.ok::<DestroySrq>(b_srq, &Empty);
    a.ok::<DestroyCq>(a_cq, &Empty);
    b.ok::<DestroyCq>(b_cq, &Empty);
    a.ok::<DeallocPd>(a_pd, &Empty);
    b.ok::<DeallocPd>(b_pd, &Empty);
    a.ok::<CloseCa>(a_ca, &Empty);
    b.ok::<CloseCa>(b_ca, &Empty);
    a.process.free(a_buf).unwrap();
    b.process.free(b_buf).unwrap();
    assert_eq!(a.allocations(), a_baseline);
    assert_eq!(b.allocations(), b_baseline);
    for lib in [&a, &b] {
        assert_eq!(lib.process.space().locked_pages(), 0);
        assert_eq!(lib.process.exit(), 0);
    }
}

/// `pre_create_qp` takes the CQs and the SRQ only from the context the
/// QP is created on: another context's (of the same provider and process)
/// is refused before any IOCTL, with no ring allocated.
#[test]
fn pre_create_qp_refuses_another_contexts_cq_or_srq() {
    let (w, [u, _]) = world(7);
    let process = Process::new(52);
    let uvp = provider(&process);
    let lib = Lib::new(&w, u, process, &uvp);
    let (mine, theirs) = (lib.open(), lib.open());
    let pd = lib.ok::<AllocPd>(mine, &Empty).0;
    let cq = lib.cq(mine, 8);
    let their_pd = lib.ok::<AllocPd>(theirs, &Empty).0;
    let their_cq = lib.cq(theirs, 8);
    let srq_in = |pd: u64| SrqCreate {
        pd: PdHandle::from_raw(pd),
        attr: SrqAttr {
            max_wr: 8,
            max_sge: 1,
            srq_limit: 0,
        },
    };
    let srq = lib.ok::<CreateSrq>(mine, &srq_in(pd)).0;
    let their_srq = lib.ok::<CreateSrq>(theirs, &srq_in(their_pd)).0;
    let (requests, allocations) = (lib.process.requests_issued(), uvp.allocations());

    let on_their_srq = qp_create(QpType::Rc, pd, cq, Some(their_srq));
    assert_eq!(
        lib.call::<CreateQp>(mine, &on_their_srq).err(),
        Some(Failed::Pre(IbStatus::InvalidSrqHandle))
    );
    let on_their_cq = qp_create(QpType::Rc, pd, their_cq, None);
    assert_eq!(
        lib.call::<CreateQp>(mine, &on_their_cq).err(),
        Some(Failed::Pre(IbStatus::InvalidCqHandle))
    );
    assert_eq!(lib.process.requests_issued(), requests, "no IOCTL");
    assert_eq!(uvp.allocations(), allocations, "no ring allocated");

    // With its own SRQ the same create goes through.
    let qp = lib.qp(mine, QpType::Rc, pd, cq, Some(srq)).0;
    lib.ok::<DestroyQp>(qp, &Empty);
    lib.ok::<CloseCa>(mine, &Empty);
    lib.ok::<CloseCa>(theirs, &Empty);
    assert_eq!(uvp.allocations(), 0);
    assert_eq!(lib.process.exit(), 0);
    w.finish();
}

#[test]
fn address_vector_calls_finish_in_user_mode_and_make_no_request() {
    let (w, [u, _]) = world(6);
    let process = Process::new(51);
    let uvp = provider(&process);
    let lib = Lib::new(&w, u, process, &uvp);
    let ca = lib.open();
    let pd = lib.ok::<AllocPd>(ca, &Empty).0;
    let before = lib.process.requests_issued();

    let attr = grh_av(1, IPS[1][0]);
    let av = lib.ok::<CreateAv>(pd, &attr).0;
    assert_ne!(av & USER_AV_TAG, 0, "never a kernel handle");
    let queried = lib.ok::<QueryAv>(av, &Empty).1;
    assert_eq!((queried.pd.raw(), queried.av), (pd, attr));
    let other = grh_av(2, IPS[1][1]);
    lib.ok::<ModifyAv>(av, &other);
    assert_eq!(lib.ok::<QueryAv>(av, &Empty).1.av, other);

    // Refusals, each before any IOCTL, and nothing changed by them.
    let mut no_grh = attr;
    no_grh.grh = None;
    assert_eq!(
        lib.call::<CreateAv>(pd + 0x100, &attr).err(),
        Some(Failed::Pre(IbStatus::InvalidPdHandle))
    );
    assert_eq!(
        lib.call::<CreateAv>(pd, &no_grh).err(),
        Some(Failed::Pre(IbStatus::InvalidParameter))
    );
    assert_eq!(
        lib.call::<ModifyAv>(av, &no_grh).err(),
        Some(Failed::Pre(IbStatus::InvalidParameter))
    );
    assert_eq!(lib.ok::<QueryAv>(av, &Empty).1.av, other);
    assert_eq!(
        lib.call::<DeallocPd>(pd, &Empty).err(),
        Some(Failed::Pre(IbStatus::ResourceBusy)),
        "a PD still holding an AV"
    );
    lib.ok::<DestroyAv>(av, &Empty);
    for result in [
        lib.call::<QueryAv>(av, &Empty).err(),
        lib.call::<DestroyAv>(av, &Empty).err(),
        lib.call::<ModifyAv>(av, &attr).err(),
    ] {
        assert_eq!(result, Some(Failed::Pre(IbStatus::InvalidAvHandle)));
    }
    assert_eq!(uvp.address_vectors(), 0);
    assert_eq!(
        lib.process.requests_issued(),
        before,
        "no AV call reached the kernel"
    );

    lib.ok::<DeallocPd>(pd, &Empty);
    lib.ok::<CloseCa>(ca, &Empty);
    assert_eq!(lib.process.exit(), 0);
    w.finish();
}

/// The kernel's answer to `V` (CreateAv or ModifyAv) on HCA `i` with
/// `attr`'s bytes as input, sent raw: attributes the typed encoder refuses
/// (SL, flow label, port 0) reach the kernel's decoder.
fn kernel_av_call<V: Verb<In = ib_types::av::AvAttr>>(
    w: &World,
    i: usize,
    handle: u64,
    attr: ib_types::av::AvAbi,
) -> (IbStatus, u64) {
    let mut bytes = vec![0; request_len::<V>(0).unwrap()];
    let carrier = grh_av(1, [10, 0, 0, 1]);
    encode_request::<V>(handle, &carrier, &[], 0, &mut bytes).unwrap();
    let carrier = carrier.emit();
    let at = bytes
        .windows(carrier.as_bytes().len())
        .position(|window| window == carrier.as_bytes())
        .expect("the AV's bytes are in the request");
    bytes[at..at + carrier.as_bytes().len()].copy_from_slice(attr.as_bytes());
    let (request, issuer) = w.raw_request(
        V::ID.ioctl().raw(),
        RequestorMode::Kernel,
        bytes,
        response_len::<V>(0).unwrap(),
    );
    w.hca_at(i).submit_request(request);
    w.settle();
    let done = issuer.completion().expect("the request completed");
    let r = support::response::<V>(&done);
    (r.status, r.handle)
}

/// IBA 11.2.2 (Create/Modify Address Handle) refuses an invalid port; the
/// user path (the provider's AVs, guide 6.4.2) must refuse what the kernel
/// path (`verbs::av`) refuses, with the same status: port past the HCA's
/// ports, a static rate the layout cannot carry, SL and flow label out of
/// range, no GRH. (The kernel also checks the source GID entry with
/// `QUERY_PORT`, which the provider cannot do without a request: not
/// compared here.)
#[test]
fn user_and_kernel_address_vectors_refuse_the_same_attributes_with_the_same_status() {
    let (w, [u, _]) = world(7);
    let kernel = kernel_pair::setup(&w, u);
    let good = grh_av(1, IPS[1][0]);
    let (status, kernel_av) = kernel_av_call::<CreateAv>(&w, u, kernel.pd, good.emit());
    assert_eq!(status, IbStatus::Success);
    let process = Process::new(52);
    let uvp = provider(&process);
    let lib = Lib::new(&w, u, process, &uvp);
    let ca = lib.open();
    let pd = lib.ok::<AllocPd>(ca, &Empty).0;
    let user_av = lib.ok::<CreateAv>(pd, &good).0;

    let with = |change: fn(&mut ib_types::av::AvAttr)| {
        let mut attr = good;
        change(&mut attr);
        attr
    };
    let cases = [
        ("port 2 of 2", grh_av(2, IPS[1][1])),
        ("port 3 of 2", grh_av(3, IPS[1][1])),
        ("port 255", grh_av(255, IPS[1][1])),
        ("static rate", with(|a| a.static_rate = 3)),
        ("SL 16", with(|a| a.sl = 16)),
        (
            "flow label over 20 bits",
            with(|a| a.grh.as_mut().unwrap().flow_label = 1 << 20),
        ),
        ("no GRH", with(|a| a.grh = None)),
        (
            "port 3 and a static rate",
            ib_types::av::AvAttr {
                static_rate: 2,
                ..grh_av(3, IPS[1][1])
            },
        ),
        (
            "static rate and no GRH",
            ib_types::av::AvAttr {
                static_rate: 2,
                grh: None,
                ..good
            },
        ),
    ];
    let user_status = |result: Result<(u64, Empty), Failed>| match result {
        Ok(_) => IbStatus::Success,
        Err(Failed::Pre(status)) => status,
        Err(other) => panic!("an AV call left user mode: {other:?}"),
    };
    for (what, attr) in cases {
        let (expected, made) = kernel_av_call::<CreateAv>(&w, u, kernel.pd, attr.emit());
        if expected == IbStatus::Success {
            let done = w.call_in_dpc_at::<DestroyAv>(u, RequestorMode::Kernel, made, &Empty, 0);
            assert_eq!(
                support::response::<DestroyAv>(&done).status,
                IbStatus::Success
            );
        }
        let user = lib.call::<CreateAv>(pd, &attr).map(|(h, _)| (h, Empty));
        if let Ok((made, _)) = user {
            lib.ok::<DestroyAv>(made, &Empty);
        }
        assert_eq!(user_status(user), expected, "CreateAv, {what}");

        let expected = kernel_av_call::<ModifyAv>(&w, u, kernel_av, attr.emit()).0;
        let user = lib.call::<ModifyAv>(user_av, &attr);
        assert_eq!(user_status(user), expected, "ModifyAv, {what}");
        if expected != IbStatus::Success {
            assert_ne!(lib.ok::<QueryAv>(user_av, &Empty).1.av, attr, "unchanged");
        }
        lib.ok::<ModifyAv>(user_av, &good);
    }
    // Port 0 has no encoding (`PortNum`): both paths refuse the bytes.
    let mut port0 = good.emit();
    port0.port_num = 0;
    assert_eq!(
        kernel_av_call::<CreateAv>(&w, u, kernel.pd, port0).0,
        IbStatus::InvalidParameter
    );
    let mut private = [0u8; 0];
    let mut output = [0u8; 0];
    let mut pre = PreCall {
        verb: VerbId::CreateAv,
        handle: pd,
        input: port0.as_bytes(),
        private_in: &mut private,
        output: &mut output,
    };
    assert_eq!(uvp.pre(&mut pre).err(), Some(IbStatus::InvalidParameter));

    lib.ok::<DestroyAv>(user_av, &Empty);
    lib.ok::<DeallocPd>(pd, &Empty);
    lib.ok::<CloseCa>(ca, &Empty);
    assert_eq!(lib.process.exit(), 0);
    w.finish();
}

#[test]
fn each_row_of_table_10_1_is_forced_with_the_fault_injector() {
    let (w, [u, _]) = world(7);
    let process = Process::new(61);
    let uvp = FaultInjector::new(provider(&process));
    let lib = Lib::new(&w, u, process, &uvp);
    let baseline = lib.allocations();
    let ca = lib.open();
    let pd = lib.ok::<AllocPd>(ca, &Empty).0;
    uvp.take_events();

    // Row 1: pre, IOCTL and post succeed.
    let cq = lib.cq(ca, 8);
    assert_eq!(
        uvp.take_events(),
        [
            HookEvent::Pre {
                verb: VerbId::CreateCq,
                result: Ok(true)
            },
            HookEvent::Post {
                verb: VerbId::CreateCq,
                ioctl: IbStatus::Success,
                result: Ok(())
            },
        ]
    );
    let with_cq = lib.allocations();
    assert_eq!(uvp.inner().allocations(), 1);

    // Row 4: pre fails; no IOCTL, no post, nothing allocated.
    let requests = lib.process.requests_issued();
    uvp.arm(
        VerbId::CreateQp,
        Fault::FailPre(IbStatus::InsufficientMemory),
    );
    let create = qp_create(QpType::Rc, pd, cq, None);
    assert_eq!(
        lib.call::<CreateQp>(ca, &create).err(),
        Some(Failed::Pre(IbStatus::InsufficientMemory))
    );
    assert_eq!(lib.process.requests_issued(), requests);
    assert_eq!(
        uvp.take_events(),
        [HookEvent::Pre {
            verb: VerbId::CreateQp,
            result: Err(IbStatus::InsufficientMemory)
        }]
    );
    assert_eq!((lib.allocations(), uvp.inner().allocations()), (with_cq, 1));

    // Row 3: the IOCTL fails (a PD the process does not have); post runs,
    // sees that status, fails with it, and frees the rings pre allocated.
    let foreign_pd = qp_create(QpType::Rc, pd + 0x1000, cq, None);
    let Some(Failed::Ioctl(status)) = lib.call::<CreateQp>(ca, &foreign_pd).err() else {
        panic!("the kernel refuses a PD the process does not own");
    };
    assert_ne!(status, IbStatus::Success);
    assert_eq!(lib.process.requests_issued(), requests + 1);
    assert_eq!(
        uvp.take_events(),
        [
            HookEvent::Pre {
                verb: VerbId::CreateQp,
                result: Ok(true)
            },
            HookEvent::Post {
                verb: VerbId::CreateQp,
                ioctl: status,
                result: Err(status)
            },
        ]
    );
    assert_eq!((lib.allocations(), uvp.inner().allocations()), (with_cq, 1));

    // Row 3 broken by a buggy plug-in (post claims success after a failed
    // IOCTL): the library catches it; the provider still freed its rings.
    uvp.arm(VerbId::CreateQp, Fault::PostClaimsSuccess);
    assert_eq!(
        lib.call::<CreateQp>(ca, &foreign_pd).err(),
        Some(Failed::PluginBug(status))
    );
    uvp.take_events();
    assert_eq!((lib.allocations(), uvp.inner().allocations()), (with_cq, 1));

    // Row 2: the IOCTL created the QP, post fails: the library destroys
    // the QP through the hooks and returns post's status.
    uvp.arm(
        VerbId::CreateQp,
        Fault::FailPost(IbStatus::InsufficientResources),
    );
    assert_eq!(
        lib.call::<CreateQp>(ca, &create).err(),
        Some(Failed::Post(IbStatus::InsufficientResources))
    );
    assert_eq!(
        uvp.take_events(),
        [
            HookEvent::Pre {
                verb: VerbId::CreateQp,
                result: Ok(true)
            },
            HookEvent::Post {
                verb: VerbId::CreateQp,
                ioctl: IbStatus::Success,
                result: Err(IbStatus::InsufficientResources)
            },
            HookEvent::Pre {
                verb: VerbId::DestroyQp,
                result: Ok(true)
            },
            HookEvent::Post {
                verb: VerbId::DestroyQp,
                ioctl: IbStatus::Success,
                result: Ok(())
            },
        ]
    );
    assert_eq!((lib.allocations(), uvp.inner().allocations()), (with_cq, 1));

    // Row 2 on a context: a second OpenCa whose post fails is closed.
    uvp.arm(VerbId::OpenCa, Fault::FailPost(IbStatus::GenericError));
    assert_eq!(
        lib.call::<OpenCa>(0, &OpenCaIn::CURRENT).err(),
        Some(Failed::Post(IbStatus::GenericError))
    );
    let events = uvp.take_events();
    assert_eq!(
        events.last(),
        Some(&HookEvent::Post {
            verb: VerbId::CloseCa,
            ioctl: IbStatus::Success,
            result: Ok(())
        })
    );

    // The failed creates left nothing in the kernel: the CQ (which a QP
    // on it would keep busy) and the PD go.
    lib.ok::<DestroyCq>(cq, &Empty);
    lib.ok::<DeallocPd>(pd, &Empty);
    lib.ok::<CloseCa>(ca, &Empty);
    assert_eq!(
        (lib.allocations(), uvp.inner().allocations()),
        (baseline, 0)
    );
    assert_eq!(lib.process.space().locked_pages(), 0);
    assert_eq!(lib.process.exit(), 0);
    w.finish();
}

/// Changes `verb`'s response before post.
fn tamper(verb: VerbId, change: impl Fn(&mut Vec<u8>, &mut Vec<u8>) + 'static) -> Option<Tamper> {
    Some(Box::new(move |v, out, private| {
        if v == verb {
            change(out, private)
        }
    }))
}

#[test]
fn hostile_responses_are_refused_by_post_and_leak_no_ring() {
    let (w, [u, _]) = world(8);
    let process = Process::new(71);
    let uvp = provider(&process);
    let lib = Lib::new(&w, u, process, &uvp);
    let baseline = lib.allocations();
    let ca = lib.open();
    let pd = lib.ok::<AllocPd>(ca, &Empty).0;
    let cq = lib.cq(ca, 8);
    let srq_create = SrqCreate {
        pd: PdHandle::from_raw(pd),
        attr: SrqAttr {
            max_wr: 8,
            max_sge: 1,
            srq_limit: 0,
        },
    };
    let allocations = lib.allocations();
    let requests = lib.process.requests_issued();

    let cases: Vec<(&str, Option<Tamper>)> = vec![
        (
            "CQ private output cut short",
            tamper(VerbId::CreateCq, |_, p| p.truncate(8)),
        ),
        (
            "CQ number past 24 bits",
            tamper(VerbId::CreateCq, |_, p| p[3] = 0xFF),
        ),
        (
            "CQ of another size than laid out",
            tamper(VerbId::CreateCq, |_, p| p[4] += 1),
        ),
        (
            "QP private number not the output's",
            tamper(VerbId::CreateQp, |_, p| p[0] ^= 1),
        ),
        (
            "QP on another context's doorbell page",
            tamper(VerbId::CreateQp, |_, p| p[4] = p[4].wrapping_add(1)),
        ),
        (
            "QP fixed output cut short",
            tamper(VerbId::CreateQp, |out, _| out.truncate(8)),
        ),
        (
            "SRQ with no private output",
            tamper(VerbId::CreateSrq, |_, p| p.clear()),
        ),
        (
            "SRQ private reserved bytes set",
            tamper(VerbId::CreateSrq, |_, p| p[7] = 1),
        ),
    ];
    let cases_run = cases.len() as u64;
    for (what, change) in cases {
        *lib.tamper.borrow_mut() = change;
        let result = if what.starts_with("CQ") {
            lib.call::<CreateCq>(
                ca,
                &CqAttr {
                    cqe: 8,
                    comp_vector: 0,
                },
            )
            .map(|r| r.0)
        } else if what.starts_with("QP") {
            lib.call::<CreateQp>(ca, &qp_create(QpType::Rc, pd, cq, None))
                .map(|r| r.0)
        } else {
            lib.call::<CreateSrq>(ca, &srq_create).map(|r| r.0)
        };
        *lib.tamper.borrow_mut() = None;
        assert_eq!(
            result.err(),
            Some(Failed::Post(IbStatus::InvalidParameter)),
            "{what}"
        );
        assert_eq!(
            (lib.allocations(), uvp.allocations()),
            (allocations, 1),
            "{what}: the rings are freed"
        );
    }
    // Each create reached the kernel, and so did the destroy of what it
    // made.
    assert_eq!(lib.process.requests_issued(), requests + 2 * cases_run);

    // A context whose private limits carry a reserved byte, or no port:
    // closed.
    *lib.tamper.borrow_mut() = tamper(VerbId::OpenCa, |_, p| p[0x15] = 1);
    assert_eq!(
        lib.call::<OpenCa>(0, &OpenCaIn::CURRENT).err(),
        Some(Failed::Post(IbStatus::InvalidParameter))
    );
    *lib.tamper.borrow_mut() = tamper(VerbId::OpenCa, |_, p| p[0x14] = 0);
    assert_eq!(
        lib.call::<OpenCa>(0, &OpenCaIn::CURRENT).err(),
        Some(Failed::Post(IbStatus::InvalidParameter))
    );
    *lib.tamper.borrow_mut() = None;

    lib.ok::<DestroyCq>(cq, &Empty);
    lib.ok::<DeallocPd>(pd, &Empty);
    lib.ok::<CloseCa>(ca, &Empty);
    assert_eq!((lib.allocations(), uvp.allocations()), (baseline, 0));
    assert_eq!(lib.process.space().locked_pages(), 0);
    assert_eq!(lib.process.space().device_mapping_count(), 0);
    assert_eq!(lib.process.exit(), 0);
    w.finish();
}

thread_local! {
    /// True while [`allocations_of`] runs its call.
    static COUNTING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// A doorbell stored while counting: forwarded to the device after,
    /// so the simulated device's own work is not counted as the
    /// provider's.
    static DEFERRED_DOORBELL: std::cell::Cell<Option<(u64, u64)>> =
        const { std::cell::Cell::new(None) };
}

/// Allocations `f` makes on this thread (its doorbell deferred), and its
/// result; then the deferred doorbell reaches the device.
fn allocations_of<R>(process: &Process, f: impl FnOnce() -> R) -> (u64, R) {
    assert!(sim_host::alloc_hook::is_installed());
    COUNTING.with(|on| on.set(true));
    let before = sim_host::alloc_hook::thread_allocations();
    let result = f();
    let allocated = sim_host::alloc_hook::thread_allocations() - before;
    COUNTING.with(|on| on.set(false));
    if let Some((address, value)) = DEFERRED_DOORBELL.with(|d| d.take()) {
        process.write_device64(address, value).unwrap();
    }
    (allocated, result)
}

/// As [`platform`], with a doorbell stored while counting deferred.
fn counted_platform(process: &Process) -> Platform {
    let mapped = process.clone();
    Platform {
        memory: Arc::new(SimMemory(process.clone())),
        mmio: Arc::new(move |address, value| {
            if COUNTING.with(|on| on.get()) {
                DEFERRED_DOORBELL.with(|d| d.set(Some((address, value))));
            } else {
                let _ = mapped.write_device64(address, value);
            }
        }),
    }
}

/// The fast paths the access library holds instead of handles
/// (`Provider::qp_fast_path`, `cq_fast_path`) cannot reach a destroyed
/// object: once `DestroyQp`'s and `DestroyCq`'s posts ran, every post,
/// poll and arm through them is refused with the handle's status, nothing
/// is written and no doorbell rings; the handles are refused too; and the
/// rings' memory, which a held fast path keeps, is freed when the last one
/// is dropped.
#[test]
fn a_destroyed_objects_fast_path_and_handle_are_refused() {
    let (w, [hca, _]) = world(23);
    let process = Process::new(47);
    let doorbells = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = {
        let mapped = process.clone();
        let doorbells = Arc::clone(&doorbells);
        Platform {
            memory: Arc::new(SimMemory(process.clone())),
            mmio: Arc::new(move |address, value| {
                doorbells.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let _ = mapped.write_device64(address, value);
            }),
        }
    };
    let uvp = Provider::new(counted);
    let lib = Lib::new(&w, hca, process.clone(), &uvp);
    let ca = lib.open();
    let pd = lib.ok::<AllocPd>(ca, &Empty).0;
    let cq = lib.cq(ca, 16);
    let (qp, _) = lib.qp(ca, QpType::Rc, pd, cq, None);
    let (buf, mr, lkey) = lib.register(pd, 4096);
    let qp_path = uvp.qp_fast_path(qp).expect("a QP of this provider");
    let cq_path = uvp.cq_fast_path(cq).expect("a CQ of this provider");
    assert!(uvp.qp_fast_path(cq).is_none() && uvp.cq_fast_path(qp).is_none());
    // Alive: a receive posts through the fast path, an arm rings.
    let sge = [Sge::new(buf, 64, lkey)];
    let recv = [RecvWr {
        wr_id: 1,
        sg_list: &sge,
    }];
    assert_eq!(qp_path.post_recv(&recv), Ok(1));
    assert_eq!(cq_path.arm(CqNotify::NextCompletion), Ok(()));
    let mut wcs = [WorkCompletion::EMPTY; 2];
    assert_eq!(cq_path.poll(&mut wcs), Ok(0));

    lib.ok::<DestroyQp>(qp, &Empty);
    let rung = doorbells.load(std::sync::atomic::Ordering::Relaxed);
    let no_qp = Err(ib_types::uvp::PostRefused {
        posted: 0,
        status: IbStatus::InvalidQpHandle,
    });
    let sends = [UserSend {
        wr: send(2, &sge, None),
        inline: None,
    }];
    assert_eq!(qp_path.post_send(&sends), no_qp);
    assert_eq!(qp_path.post_recv(&recv), no_qp);
    assert_eq!(uvp.post_send(qp, &sends), no_qp);
    assert_eq!(uvp.post_recv(qp, &recv), no_qp);
    assert_eq!(doorbells.load(std::sync::atomic::Ordering::Relaxed), rung);
    assert!(uvp.qp_fast_path(qp).is_none());

    lib.ok::<DestroyCq>(cq, &Empty);
    assert_eq!(cq_path.poll(&mut wcs), Err(IbStatus::InvalidCqHandle));
    assert_eq!(
        cq_path.arm(CqNotify::NextCompletion),
        Err(IbStatus::InvalidCqHandle)
    );
    assert_eq!(uvp.poll_cq(cq, &mut wcs), Err(IbStatus::InvalidCqHandle));
    assert_eq!(doorbells.load(std::sync::atomic::Ordering::Relaxed), rung);

    // The held fast paths keep the rings' memory (never reused under
    // them) until they go.
    let held = lib.allocations();
    drop(qp_path);
    assert_eq!(lib.allocations(), held - 1, "the QP's rings");
    drop(cq_path);
    assert_eq!(lib.allocations(), held - 2, "the CQ's ring");
    lib.ok::<DeregMr>(mr, &Empty);
    lib.ok::<DeallocPd>(pd, &Empty);
    lib.ok::<CloseCa>(ca, &Empty);
    process.free(buf).unwrap();
    assert_eq!(process.space().locked_pages(), 0);
    assert_eq!(process.exit(), 0);
    drop(lib);
    w.finish();
}

/// The provider's fast path allocates nothing per call (issue 13,
/// measurement 4): RC inline sends, UD sends through user AVs (one batch
/// stopped at an AV the provider does not hold, the request before it
/// posted), receives and polls, every one counted, with the data checked;
/// by handle on even rounds, through the fast paths the access library
/// holds (`qp_fast_path`, `cq_fast_path`) on odd ones.
#[test]
fn the_fast_path_posts_and_polls_without_allocating() {
    let (w, [a_hca, b_hca]) = world(17);
    let (a_process, b_process) = (Process::new(45), Process::new(46));
    let (a_uvp, b_uvp) = (
        Provider::new(counted_platform(&a_process)),
        Provider::new(counted_platform(&b_process)),
    );
    let a = Lib::new(&w, a_hca, a_process.clone(), &a_uvp);
    let b = Lib::new(&w, b_hca, b_process.clone(), &b_uvp);
    let (a_ca, b_ca) = (a.open(), b.open());
    let a_pd = a.ok::<AllocPd>(a_ca, &Empty).0;
    let b_pd = b.ok::<AllocPd>(b_ca, &Empty).0;
    let (a_cq, b_cq) = (a.cq(a_ca, 16), b.cq(b_ca, 16));
    let (a_rc, a_rc_qpn) = a.qp(a_ca, QpType::Rc, a_pd, a_cq, None);
    let (b_rc, b_rc_qpn) = b.qp(b_ca, QpType::Rc, b_pd, b_cq, None);
    let (a_ud, _) = a.qp(a_ca, QpType::Ud, a_pd, a_cq, None);
    let (b_ud, b_ud_qpn) = b.qp(b_ca, QpType::Ud, b_pd, b_cq, None);
    let (a_buf, a_mr, a_lkey) = a.register(a_pd, 1 << 14);
    let (b_buf, b_mr, b_lkey) = b.register(b_pd, 1 << 14);
    a.modify(
        a_rc,
        &rc_to_rts_steps(1, AccessFlags::REMOTE_WRITE, b_rc_qpn, IPS[1][0], 1),
    );
    b.modify(
        b_rc,
        &rc_to_rts_steps(1, AccessFlags::REMOTE_WRITE, a_rc_qpn, IPS[0][0], 1),
    );
    a.modify(a_ud, &ud_to_rts());
    b.modify(b_ud, &ud_to_rts());
    let av = a.ok::<CreateAv>(a_pd, &grh_av(1, IPS[1][0])).0;
    let dest = |av: u64| UdDest {
        av: AvHandle::from_raw(av),
        remote_qpn: Qpn::new(b_ud_qpn).unwrap(),
        remote_qkey: QKey::new(0x11),
    };
    let mut wcs = [WorkCompletion::EMPTY; 4];
    let (a_rc_path, a_ud_path) = (
        a_uvp.qp_fast_path(a_rc).unwrap(),
        a_uvp.qp_fast_path(a_ud).unwrap(),
    );
    let (b_rc_path, a_cq_path, b_cq_path) = (
        b_uvp.qp_fast_path(b_rc).unwrap(),
        a_uvp.cq_fast_path(a_cq).unwrap(),
        b_uvp.cq_fast_path(b_cq).unwrap(),
    );

    for round in 0..12u64 {
        let by_handle = round % 2 == 0;
        // RC: one 64-byte inline send into B's receive queue.
        let payload = pattern(round as u32, 64);
        let b_recv = [Sge::new(b_buf, 2048, b_lkey)];
        let recv = [RecvWr {
            wr_id: 100 + round,
            sg_list: &b_recv,
        }];
        let (allocated, posted) = allocations_of(&b_process, || {
            if by_handle {
                b_uvp.post_recv(b_rc, &recv)
            } else {
                b_rc_path.post_recv(&recv)
            }
        });
        assert_eq!((allocated, posted), (0, Ok(1)), "post_recv, round {round}");
        let inline_sge = [Sge::new(a_buf, 64, a_lkey)];
        let mut wr = send(round, &inline_sge, None);
        wr.flags |= SendFlags::INLINE;
        let sends = [UserSend {
            wr,
            inline: Some(&payload),
        }];
        let (allocated, posted) = allocations_of(&a_process, || {
            if by_handle {
                a_uvp.post_send(a_rc, &sends)
            } else {
                a_rc_path.post_send(&sends)
            }
        });
        assert_eq!(
            (allocated, posted),
            (0, Ok(1)),
            "RC post_send, round {round}"
        );
        w.settle();
        let (allocated, polled) = allocations_of(&b_process, || {
            if by_handle {
                b_uvp.poll_cq(b_cq, &mut wcs)
            } else {
                b_cq_path.poll(&mut wcs)
            }
        });
        assert_eq!((allocated, polled), (0, Ok(1)), "poll_cq, round {round}");
        assert_eq!(
            (wcs[0].wr_id, wcs[0].status, wcs[0].byte_len),
            (100 + round, WcStatus::Success, 64)
        );
        assert_eq!(b.read(b_buf, 64), payload);
        let (allocated, polled) = allocations_of(&a_process, || {
            if by_handle {
                a_uvp.poll_cq(a_cq, &mut wcs)
            } else {
                a_cq_path.poll(&mut wcs)
            }
        });
        assert_eq!((allocated, polled), (0, Ok(1)), "poll_cq, round {round}");
        assert_eq!(wcs[0].wr_id, round);

        // UD: a batch whose second request names an AV A never created:
        // the first is posted, the second refused.
        let b_recv = [Sge::new(b_buf + 4096, 2048, b_lkey)];
        let recv = [RecvWr {
            wr_id: 200 + round,
            sg_list: &b_recv,
        }];
        assert_eq!(b_uvp.post_recv(b_ud, &recv), Ok(1));
        let ud_sge = [Sge::new(a_buf, 64, a_lkey)];
        let sends = [
            UserSend {
                wr: send(300 + round, &ud_sge, Some(dest(av))),
                inline: None,
            },
            UserSend {
                wr: send(400 + round, &ud_sge, Some(dest(av + 1))),
                inline: None,
            },
        ];
        let (allocated, posted) = allocations_of(&a_process, || {
            if by_handle {
                a_uvp.post_send(a_ud, &sends)
            } else {
                a_ud_path.post_send(&sends)
            }
        });
        assert_eq!(allocated, 0, "UD post_send, round {round}");
        assert_eq!(
            posted,
            Err(ib_types::uvp::PostRefused {
                posted: 1,
                status: IbStatus::InvalidAvHandle
            })
        );
        w.settle();
        let wc = b.poll(b_cq, 1)[0];
        assert_eq!((wc.wr_id, wc.status), (200 + round, WcStatus::Success));
        assert_eq!(a.poll(a_cq, 1)[0].wr_id, 300 + round);
    }
    drop((a_rc_path, a_ud_path, b_rc_path, a_cq_path, b_cq_path));
    a.ok::<DestroyAv>(av, &Empty);
    let objects = [
        (&a, [a_rc, a_ud], a_mr, a_cq, a_pd, a_ca, a_buf),
        (&b, [b_rc, b_ud], b_mr, b_cq, b_pd, b_ca, b_buf),
    ];
    for (lib, qps, mr, cq, pd, ca, buf) in objects {
        for qp in qps {
            lib.ok::<DestroyQp>(qp, &Empty);
        }
        lib.ok::<DeregMr>(mr, &Empty);
        lib.ok::<DestroyCq>(cq, &Empty);
        lib.ok::<DeallocPd>(pd, &Empty);
        lib.ok::<CloseCa>(ca, &Empty);
        lib.process.free(buf).unwrap();
        assert_eq!(lib.process.space().locked_pages(), 0);
        assert_eq!(lib.process.exit(), 0);
    }
    drop((a, b));
    w.finish();
}
