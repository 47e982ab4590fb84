//! Scenario: the user-mode access library (`ibal-user`) on the simulated
//! host, through the real IBAL bus filter's proxy over the real miniport,
//! two HCAs with two ports each. The library reaches the OS only through
//! its device I/O seam; `sim_shells::user_io::SimIo` implements it over the
//! host's file handles and the process's memory (the product crate never
//! depends on a simulator). Enumerating both HCAs and opening each by index and GUID; an
//! ABI mismatch refused on either side with nothing left open; PD, buffer,
//! MR, CQ and QP created through the proxy and destroyed at drop; a CA
//! without its plugin still serving control verbs; completion and
//! asynchronous events delivered; a process exiting with everything open
//! leaving nothing behind. Every test ends with the host shut down and the
//! verifier report empty.
#![cfg(not(windows))]

use std::sync::Arc;

use ib_types::access::AccessFlags;
use ib_types::event::AsyncEventCode;
use ib_types::interface::InterfaceVersion;
use ib_types::ioctl::{
    self as v, PROXY_ABI_VERSION, REQUEST_HEADER_SIZE, RESPONSE_HEADER_SIZE, Verb,
};
use ib_types::qp::{QpCaps, QpModify, QpState, QpType};
use ib_types::scalars::{PortNum, Psn, QKey};
use ib_types::status::{IbStatus, NtStatus};
use ib_types::wc::{WcStatus, WorkCompletion};
use ib_types::wr::{RecvWr, Sge};
use ibal_user::{
    ArmFor, Av, Buffer, CaSelector, Context, Cq, DeviceFile, DeviceIo, DevicePath, Error, Mr,
    OsStatus, Pd, PluginSource, Qp, QpInit, UserSend, list_cas,
};
use sim_host::memory::Process;
use sim_shells::user_io::{SimIo, settle};

#[path = "support/user_world.rs"]
mod user_world;
use user_world::{HCAS, UserWorld as World};

/// A seam that rewrites the `OpenCa` exchange as a library or a kernel of
/// another ABI version would send or answer it, or fails every IOCTL of
/// one code with an OS status (`fail`) without sending it.
#[derive(Debug)]
struct OtherVersion {
    inner: Arc<SimIo>,
    request: Option<InterfaceVersion>,
    answer: Option<InterfaceVersion>,
    fail: Option<(u32, NtStatus)>,
}

#[derive(Debug)]
struct OtherVersionFile {
    inner: Box<dyn DeviceFile>,
    request: Option<InterfaceVersion>,
    answer: Option<InterfaceVersion>,
    fail: Option<(u32, NtStatus)>,
}

impl DeviceFile for OtherVersionFile {
    fn ioctl(&self, code: u32, input: &[u8], output: &mut [u8]) -> Result<usize, OsStatus> {
        if let Some((failing, status)) = self.fail
            && failing == code
        {
            return Err(OsStatus::Nt(status));
        }
        if code != v::OpenCa::ID.ioctl().raw() {
            return self.inner.ioctl(code, input, output);
        }
        let mut input = input.to_vec();
        if let Some(version) = self.request {
            input[REQUEST_HEADER_SIZE..REQUEST_HEADER_SIZE + 2]
                .copy_from_slice(&version.packed().to_le_bytes());
        }
        let n = self.inner.ioctl(code, &input, output)?;
        if let Some(version) = self.answer {
            output[RESPONSE_HEADER_SIZE..RESPONSE_HEADER_SIZE + 2]
                .copy_from_slice(&version.packed().to_le_bytes());
        }
        Ok(n)
    }
}

impl DeviceIo for OtherVersion {
    fn interface_paths(&self) -> Result<Vec<DevicePath>, OsStatus> {
        self.inner.interface_paths()
    }
    fn open(&self, path: &DevicePath) -> Result<Box<dyn DeviceFile>, OsStatus> {
        Ok(Box::new(OtherVersionFile {
            inner: self.inner.open(path)?,
            request: self.request,
            answer: self.answer,
            fail: self.fail,
        }))
    }
    fn alloc(&self, len: usize) -> Result<u64, OsStatus> {
        self.inner.alloc(len)
    }
    fn free(&self, va: u64) {
        self.inner.free(va);
    }
    fn read(&self, va: u64, out: &mut [u8]) -> Result<(), OsStatus> {
        self.inner.read(va, out)
    }
    fn write(&self, va: u64, data: &[u8]) -> Result<(), OsStatus> {
        self.inner.write(va, data)
    }
    fn doorbell_hook(&self) -> uvp_plugin::mmio::MmioHook {
        self.inner.doorbell_hook()
    }
}

#[test]
fn both_hcas_are_enumerated_and_each_opens_by_index_and_by_guid() {
    let w = World::new(51);
    let process = Process::new(60);
    let io = w.io(&process);
    let cas = list_cas(&io).unwrap();
    let guids: Vec<u64> = cas.iter().map(|c| c.guid()).collect();
    assert_eq!(guids, HCAS, "one CA per enabled interface, in order");
    for ca in &cas {
        assert_eq!(ca.open.version, PROXY_ABI_VERSION);
        assert_eq!(
            ca.open.uvp_name.as_str(),
            ibal_user::plugin::LINKED_UVP_NAME
        );
    }
    assert_eq!(
        w.leftovers(&process),
        [0; 5],
        "enumeration leaves nothing open"
    );

    for (at, guid) in HCAS.iter().enumerate() {
        let by_index = Context::open(&io, CaSelector::Index(at), &PluginSource::None).unwrap();
        let by_guid = Context::open(&io, CaSelector::Guid(*guid), &PluginSource::None).unwrap();
        assert_eq!(by_index.info().guid(), *guid);
        assert_eq!(by_guid.info().path, by_index.info().path);
        // Each open has its own doorbell page.
        assert_ne!(by_guid.info().open.doorbell, by_index.info().open.doorbell);
        assert_eq!(w.proxy(at).proxy().object_count(), 2, "two CA contexts");
        assert!(!by_guid.query_raw().unwrap().is_empty());
    }
    assert!(matches!(
        Context::open(&io, CaSelector::Index(2), &PluginSource::None),
        Err(Error::NoSuchCa(_))
    ));
    assert!(matches!(
        Context::open(&io, CaSelector::Guid(0x1234), &PluginSource::None),
        Err(Error::NoSuchCa(_))
    ));
    assert_eq!(w.leftovers(&process), [0; 5]);
    assert_eq!(process.exit(), 0);
    w.finish();
}

#[test]
fn an_abi_mismatch_is_refused_on_either_side_and_leaves_nothing_open() {
    let w = World::new(52);
    let process = Process::new(61);
    let sim = SimIo::new(&w.host, &process);
    // A library of another version: the proxy refuses it.
    for version in [InterfaceVersion::new(2, 0), InterfaceVersion::new(1, 1)] {
        let io: Arc<dyn DeviceIo> = Arc::new(OtherVersion {
            inner: Arc::clone(&sim),
            request: Some(version),
            answer: None,
            fail: None,
        });
        let e = Context::open(&io, CaSelector::Index(0), &PluginSource::None).unwrap_err();
        assert_eq!(
            e,
            Error::AbiMismatch {
                library: PROXY_ABI_VERSION,
                kernel: None
            }
        );
    }
    // A kernel of another version: the library refuses its answer and
    // closes the context the kernel opened.
    for version in [InterfaceVersion::new(2, 0), InterfaceVersion::new(0, 9)] {
        let io: Arc<dyn DeviceIo> = Arc::new(OtherVersion {
            inner: Arc::clone(&sim),
            request: None,
            answer: Some(version),
            fail: None,
        });
        let e = Context::open(&io, CaSelector::Index(1), &PluginSource::Linked).unwrap_err();
        assert_eq!(
            e,
            Error::AbiMismatch {
                library: PROXY_ABI_VERSION,
                kernel: Some(version)
            }
        );
        assert_eq!(w.leftovers(&process), [0; 5], "{version:?}");
    }
    assert_eq!(process.exit(), 0);
    w.finish();
}

/// The modifies RESET -> INIT -> RTR -> RTS of a UD QP on port 1.
fn ud_to_rts(qp: &Qp<'_, '_>) {
    let steps = [
        QpModify {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(PortNum::new(1).unwrap()),
            qkey: Some(QKey::new(0x1111)),
            ..QpModify::default()
        },
        QpModify::to_state(QpState::Rtr),
        QpModify {
            state: Some(QpState::Rts),
            sq_psn: Some(Psn::new(5).unwrap()),
            ..QpModify::default()
        },
    ];
    for step in &steps {
        qp.modify(step).unwrap();
    }
}

const UD_INIT: QpInit = QpInit {
    qp_type: QpType::Ud,
    caps: QpCaps {
        max_send_wr: 8,
        max_recv_wr: 8,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 32,
    },
    sq_sig_all: false,
};

#[test]
fn objects_live_through_the_proxy_and_go_at_drop_in_order() {
    let w = World::new(53);
    let process = Process::new(62);
    let io = w.io(&process);
    let allocations = process.space().allocation_count();
    {
        let ctx = Context::open(&io, CaSelector::Guid(HCAS[0]), &PluginSource::Linked).unwrap();
        assert!(ctx.has_fast_path());
        let pd = Pd::new(&ctx).unwrap();
        let buffer = Buffer::new(&ctx, 8192).unwrap();
        buffer.write(100, b"registered").unwrap();
        let mr = Mr::new(&pd, &buffer, AccessFlags::LOCAL_WRITE).unwrap();
        assert_ne!(mr.keys().lkey.get(), 0);
        let cq = Cq::new(&ctx, 10).unwrap();
        assert_eq!(cq.cqe(), 16, "rounded to a power of two");
        let qp = Qp::new(&pd, &cq, &cq, &UD_INIT).unwrap();
        assert_ne!(qp.qpn(), 0);
        ud_to_rts(&qp);
        // CA, PD, MR, CQ, QP recorded by the proxy of this open.
        assert_eq!(w.proxy(0).proxy().object_count(), 5);
        assert_eq!(w.hca(0).user_context_count(), 1);
        assert!(process.space().locked_pages() > 0);
        // A QP type user mode may not create is refused before any call.
        let smi = QpInit {
            qp_type: QpType::Smi,
            ..UD_INIT
        };
        assert!(matches!(
            Qp::new(&pd, &cq, &cq, &smi),
            Err(Error::InvalidArgument(_))
        ));
        // A refused verb is a typed error with its IB status.
        let bad = QpModify::to_state(QpState::Rtr);
        let e = qp.modify(&bad).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Verb {
                    verb: v::VerbId::ModifyQp,
                    ..
                }
            ),
            "{e:?}"
        );
        let mut read = [0; 10];
        buffer.read(100, &mut read).unwrap();
        assert_eq!(&read, b"registered");
        // Each drop destroys its object through the proxy at once, while
        // the open stays; the borrow checker allows no other order.
        let count = || w.proxy(0).proxy().object_count();
        drop(qp);
        assert_eq!(count(), 4);
        drop(cq);
        assert_eq!(count(), 3);
        drop(mr);
        assert_eq!(count(), 2);
        assert!(
            process.space().locked_pages() == 0,
            "rings and region unpinned"
        );
        drop(buffer);
        drop(pd);
        assert_eq!(count(), 1);
        drop(ctx);
        assert_eq!(count(), 0);
        assert_eq!(w.hca(0).user_context_count(), 0, "the context closed");
    }
    assert_eq!(w.leftovers(&process), [0; 5]);
    assert_eq!(
        process.space().allocation_count(),
        allocations,
        "every ring and record freed"
    );
    assert_eq!(process.exit(), 0);
    w.finish();
}

#[test]
fn a_ca_without_its_plugin_still_serves_control_verbs() {
    let w = World::new(54);
    let process = Process::new(63);
    let io = w.io(&process);
    {
        let ctx = Context::open(&io, CaSelector::Index(1), &PluginSource::None).unwrap();
        assert!(!ctx.has_fast_path());
        let pd = Pd::new(&ctx).unwrap();
        let buffer = Buffer::new(&ctx, 4096).unwrap();
        let mr = Mr::new(&pd, &buffer, AccessFlags::LOCAL_WRITE).unwrap();
        assert_ne!(mr.keys().lkey.get(), 0);
        assert_eq!(w.proxy(1).proxy().object_count(), 3);
        assert_eq!(
            Cq::new(&ctx, 4).unwrap_err(),
            Error::NeedsPlugin("CreateCq")
        );
        // A plugin directory without the plugin: the open fails, closed.
        let empty = std::env::temp_dir().join(format!("ibal-user-empty-{}", std::process::id()));
        std::fs::create_dir_all(&empty).unwrap();
        let e = Context::open(
            &io,
            CaSelector::Index(1),
            &PluginSource::Directory(empty.clone()),
        )
        .unwrap_err();
        assert!(
            matches!(e, Error::Plugin(ibal_user::PluginError::Absent { .. })),
            "{e:?}"
        );
        std::fs::remove_dir(&empty).unwrap();
        assert_eq!(
            w.proxy(1).proxy().object_count(),
            3,
            "the refused open closed its CA"
        );
    }
    assert_eq!(w.leftovers(&process), [0; 5]);
    assert_eq!(process.exit(), 0);
    w.finish();
}

#[test]
fn completion_and_async_events_reach_the_application() {
    let w = World::new(55);
    let process = Process::new(64);
    let io = w.io(&process);
    {
        let ctx = Context::open(&io, CaSelector::Index(0), &PluginSource::Linked).unwrap();
        let pd = Pd::new(&ctx).unwrap();
        let buffer = Buffer::new(&ctx, 4096).unwrap();
        let mr = Mr::new(&pd, &buffer, AccessFlags::LOCAL_WRITE).unwrap();
        let cq = Cq::new(&ctx, 8).unwrap();
        let mut qp = Qp::new(&pd, &cq, &cq, &UD_INIT).unwrap();
        ud_to_rts(&qp);

        // Drain the send queue with notification: the SQ-drained event.
        qp.modify(&QpModify {
            state: Some(QpState::Sqd),
            en_sqd_async_notify: Some(true),
            ..QpModify::default()
        })
        .unwrap();
        let event = ctx.async_event().unwrap();
        assert_eq!(
            (event.code, event.handle),
            (AsyncEventCode::SqDrained, qp.handle())
        );

        // Two receives posted in user mode, the CQ armed, the QP errored:
        // its flushed receives complete and raise the CQ's event.
        let sges = [0u64, 1].map(|i| Sge::new(buffer.va() + i * 512, 512, mr.keys().lkey));
        let lists = [[sges[0]], [sges[1]]];
        let recvs = [
            RecvWr {
                wr_id: 70,
                sg_list: &lists[0],
            },
            RecvWr {
                wr_id: 71,
                sg_list: &lists[1],
            },
        ];
        assert_eq!(qp.post_recv(&recvs).unwrap(), 2);
        cq.arm(ArmFor::Next).unwrap();
        qp.modify(&QpModify::to_state(QpState::Err)).unwrap();
        cq.wait_event().unwrap();
        let mut wcs = [WorkCompletion::EMPTY; 4];
        let got = cq.poll(&mut wcs).unwrap();
        assert_eq!(got, 2);
        assert_eq!(
            wcs[..2]
                .iter()
                .map(|wc| (wc.wr_id, wc.status))
                .collect::<Vec<_>>(),
            [(70, WcStatus::WrFlushErr), (71, WcStatus::WrFlushErr)]
        );
        // No event pending: a wait ends cancelled, not hung.
        assert_eq!(cq.wait_event().unwrap_err().status(), IbStatus::Canceled);
    }
    assert_eq!(w.leftovers(&process), [0; 5]);
    assert_eq!(process.exit(), 0);
    w.finish();
}

fn leak<T>(value: T) -> &'static T {
    Box::leak(Box::new(value))
}

#[test]
fn a_process_exiting_with_everything_open_leaves_nothing_behind() {
    let w = World::new(56);
    let process = Process::new(65);
    let io = w.io(&process);
    for at in 0..2 {
        // The process never destroys them (leaked): it dies holding them.
        let ctx = leak(Context::open(&io, CaSelector::Index(at), &PluginSource::Linked).unwrap());
        let pd = leak(Pd::new(ctx).unwrap());
        let buffer = leak(Buffer::new(ctx, 4096).unwrap());
        leak(Mr::new(pd, buffer, AccessFlags::LOCAL_WRITE).unwrap());
        let cq = leak(Cq::new(ctx, 8).unwrap());
        ud_to_rts(leak(Qp::new(pd, cq, cq, &UD_INIT).unwrap()));
    }
    assert_eq!(w.proxy(0).proxy().object_count(), 5);
    assert_eq!(w.proxy(1).proxy().object_count(), 5);
    assert_eq!(
        w.host.pnp().exit_process(&process),
        0,
        "no page left locked"
    );
    settle(&w.host);
    assert_eq!(w.leftovers(&process), [0; 5]);
    w.finish();
}

/// Deterministic, non-trivial bytes.
fn pattern(seed: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u32)
                .wrapping_mul(37)
                .wrapping_add(seed.wrapping_mul(11)) as u8
        })
        .collect()
}

/// A datagram to port 1 of the HCA at `ip`.
fn av_to(ip: [u8; 4]) -> ib_types::av::AvAttr {
    use ib_types::av::{AvAttr, Grh};
    use ib_types::scalars::{Gid, Lid};
    AvAttr {
        port: PortNum::new(1).unwrap(),
        sl: 0,
        dlid: Lid::default(),
        path_bits: 0,
        static_rate: 0,
        grh: Some(Grh {
            dgid: Gid::from_ipv4(ip),
            flow_label: 0,
            hop_limit: 64,
            traffic_class: 0,
            sgid_index: 0,
        }),
    }
}

#[test]
fn datagrams_move_between_the_hcas_with_post_and_poll_alone() {
    use ib_types::scalars::Qpn;
    use ib_types::wr::{SendFlags, SendOp, SendWr, UdDest};
    const GRH: usize = 40;
    const LEN: usize = 1000;
    let w = World::new(57);
    let process = Process::new(66);
    let io = w.io(&process);
    {
        let sender = Context::open(&io, CaSelector::Index(0), &PluginSource::Linked).unwrap();
        let receiver = Context::open(&io, CaSelector::Index(1), &PluginSource::Linked).unwrap();
        let (spd, rpd) = (Pd::new(&sender).unwrap(), Pd::new(&receiver).unwrap());
        let (sbuf, rbuf) = (
            Buffer::new(&sender, 4096).unwrap(),
            Buffer::new(&receiver, 4096).unwrap(),
        );
        let smr = Mr::new(&spd, &sbuf, AccessFlags::LOCAL_WRITE).unwrap();
        let rmr = Mr::new(&rpd, &rbuf, AccessFlags::LOCAL_WRITE).unwrap();
        let (scq, rcq) = (Cq::new(&sender, 8).unwrap(), Cq::new(&receiver, 8).unwrap());
        let mut sqp = Qp::new(&spd, &scq, &scq, &UD_INIT).unwrap();
        let mut rqp = Qp::new(&rpd, &rcq, &rcq, &UD_INIT).unwrap();
        ud_to_rts(&sqp);
        ud_to_rts(&rqp);
        let av = Av::new(&spd, &av_to([10, 2, 1, 1])).unwrap();
        let dest = UdDest {
            av: av.handle(),
            remote_qpn: Qpn::new(rqp.qpn()).unwrap(),
            remote_qkey: QKey::new(0x1111),
        };

        let requests = process.requests_issued();
        // 40 rounds: the 8-entry queues and CQs wrap five times.
        for round in 0..40u32 {
            let payload = pattern(round, LEN);
            sbuf.write(0, &payload).unwrap();
            let rsge = [Sge::new(rbuf.va(), 2048, rmr.keys().lkey)];
            let recv = [RecvWr {
                wr_id: 1000 + u64::from(round),
                sg_list: &rsge,
            }];
            assert_eq!(rqp.post_recv(&recv).unwrap(), 1);
            let ssge = [Sge::new(sbuf.va(), LEN as u32, smr.keys().lkey)];
            let send = [UserSend {
                wr: SendWr {
                    wr_id: u64::from(round),
                    op: SendOp::Send,
                    flags: SendFlags::SIGNALED,
                    sg_list: &ssge,
                    ud: Some(dest),
                },
                inline: None,
            }];
            assert_eq!(sqp.post_send(&send).unwrap(), 1);
            // The device and the wire run; the process makes no call.
            settle(&w.host);
            let mut wcs = [WorkCompletion::EMPTY; 2];
            assert_eq!(scq.poll(&mut wcs).unwrap(), 1, "round {round}");
            assert_eq!(
                (wcs[0].wr_id, wcs[0].status),
                (u64::from(round), WcStatus::Success)
            );
            assert_eq!(rcq.poll(&mut wcs).unwrap(), 1, "round {round}");
            assert_eq!(
                (wcs[0].wr_id, wcs[0].status, wcs[0].byte_len),
                (
                    1000 + u64::from(round),
                    WcStatus::Success,
                    (GRH + LEN) as u32
                )
            );
            let mut got = vec![0; LEN];
            rbuf.read(GRH, &mut got).unwrap();
            assert_eq!(got, payload, "round {round}");
        }
        assert_eq!(
            process.requests_issued(),
            requests,
            "post and poll stayed in user mode"
        );
    }
    assert_eq!(w.leftovers(&process), [0; 5]);
    assert_eq!(process.exit(), 0);
    w.finish();
}

#[test]
fn each_row_of_table_10_1_is_forced_through_the_library() {
    use uvp_plugin::faults::{Fault, FaultInjector, HookEvent};
    use v::VerbId;
    let pre = |verb, result| HookEvent::Pre { verb, result };
    let post = |verb, ioctl, result| HookEvent::Post {
        verb,
        ioctl,
        result,
    };
    let w = World::new(58);
    let process = Process::new(67);
    let io = w.io(&process);
    let uvp = Arc::new(FaultInjector::new(ibal_user::linked_provider(&io)));
    let allocations = process.space().allocation_count();
    {
        let source = PluginSource::LinkedProvider(uvp.clone());
        let ctx = Context::open(&io, CaSelector::Index(0), &source).unwrap();
        assert_eq!(
            uvp.take_events(),
            [
                pre(VerbId::OpenCa, Ok(true)),
                post(VerbId::OpenCa, IbStatus::Success, Ok(()))
            ],
            "the open itself goes through the hooks"
        );
        let pd = Pd::new(&ctx).unwrap();
        uvp.take_events();

        // Row 1: pre, IOCTL and post succeed.
        let cq = Cq::new(&ctx, 8).unwrap();
        assert_eq!(
            uvp.take_events(),
            [
                pre(VerbId::CreateCq, Ok(true)),
                post(VerbId::CreateCq, IbStatus::Success, Ok(()))
            ]
        );
        let objects = || w.proxy(0).proxy().object_count();
        assert_eq!(objects(), 3, "CA, PD, CQ");
        let (with_cq, pinned) = (
            process.space().allocation_count(),
            process.space().locked_pages(),
        );

        // Row 4: pre fails; no IOCTL, no post.
        let requests = process.requests_issued();
        uvp.arm(
            VerbId::CreateQp,
            Fault::FailPre(IbStatus::InsufficientMemory),
        );
        assert_eq!(
            Qp::new(&pd, &cq, &cq, &UD_INIT).unwrap_err(),
            Error::PreCall {
                verb: VerbId::CreateQp,
                status: IbStatus::InsufficientMemory
            }
        );
        assert_eq!(process.requests_issued(), requests, "no IOCTL");
        assert_eq!(
            uvp.take_events(),
            [pre(VerbId::CreateQp, Err(IbStatus::InsufficientMemory))]
        );

        // Row 2: the kernel creates the QP, post fails: the library
        // destroys it through the hooks and returns post's status.
        uvp.arm(
            VerbId::CreateQp,
            Fault::FailPost(IbStatus::InsufficientResources),
        );
        assert_eq!(
            Qp::new(&pd, &cq, &cq, &UD_INIT).unwrap_err(),
            Error::PostCall {
                verb: VerbId::CreateQp,
                status: IbStatus::InsufficientResources
            }
        );
        assert_eq!(
            uvp.take_events(),
            [
                pre(VerbId::CreateQp, Ok(true)),
                post(
                    VerbId::CreateQp,
                    IbStatus::Success,
                    Err(IbStatus::InsufficientResources)
                ),
                pre(VerbId::DestroyQp, Ok(true)),
                post(VerbId::DestroyQp, IbStatus::Success, Ok(())),
            ]
        );
        assert_eq!(process.requests_issued(), requests + 2, "create, destroy");
        assert_eq!(objects(), 3, "the created QP released");
        assert_eq!(
            (
                process.space().allocation_count(),
                process.space().locked_pages()
            ),
            (with_cq, pinned),
            "its rings freed and unpinned"
        );
        assert_eq!(
            uvp.inner().allocations(),
            1,
            "the provider holds the CQ only"
        );

        // Row 3: the IOCTL fails (a transition the QP cannot take); post
        // runs, sees the kernel's status and answers it.
        let qp = Qp::new(&pd, &cq, &cq, &UD_INIT).unwrap();
        uvp.take_events();
        let bad = QpModify::to_state(QpState::Rtr);
        let Error::Verb { verb, status } = qp.modify(&bad).unwrap_err() else {
            panic!("the kernel refuses RESET -> RTR");
        };
        assert_eq!(verb, VerbId::ModifyQp);
        assert_ne!(status, IbStatus::Success);
        assert_eq!(
            uvp.take_events(),
            [
                pre(VerbId::ModifyQp, Ok(true)),
                post(VerbId::ModifyQp, status, Err(status))
            ],
            "post saw the IOCTL's status"
        );
        // Row 3 broken: a post claiming success after the failed IOCTL is
        // caught by the library.
        uvp.arm(VerbId::ModifyQp, Fault::PostClaimsSuccess);
        assert_eq!(
            qp.modify(&bad).unwrap_err(),
            Error::PluginBug {
                verb: VerbId::ModifyQp,
                status
            }
        );
    }
    assert_eq!(uvp.inner().allocations(), 0);
    assert_eq!(process.space().allocation_count(), allocations);
    assert_eq!(w.leftovers(&process), [0; 5]);
    assert_eq!(process.exit(), 0);
    w.finish();
}

#[test]
fn address_vector_calls_stay_in_user_mode() {
    let w = World::new(59);
    let process = Process::new(68);
    let io = w.io(&process);
    {
        let ctx = Context::open(&io, CaSelector::Index(0), &PluginSource::Linked).unwrap();
        let pd = Pd::new(&ctx).unwrap();
        let requests = process.requests_issued();
        let (first, second) = (av_to([10, 2, 1, 1]), av_to([10, 2, 1, 2]));
        let av = Av::new(&pd, &first).unwrap();
        let query = av.query().unwrap();
        assert_eq!((query.pd.raw(), query.av), (pd.handle(), first));
        av.modify(&second).unwrap();
        assert_eq!(av.query().unwrap().av, second);
        // An AV the plugin refuses (RoCE needs a GRH) stops in pre.
        let no_grh = ib_types::av::AvAttr { grh: None, ..first };
        assert!(matches!(
            Av::new(&pd, &no_grh),
            Err(Error::PreCall {
                verb: v::VerbId::CreateAv,
                ..
            })
        ));
        drop(av);
        assert_eq!(
            process.requests_issued(),
            requests,
            "create, query, modify, refuse and destroy made no request"
        );
        let bare = Context::open(&io, CaSelector::Index(1), &PluginSource::None).unwrap();
        let bare_pd = Pd::new(&bare).unwrap();
        assert_eq!(
            Av::new(&bare_pd, &first).unwrap_err(),
            Error::NeedsPlugin("CreateAv")
        );
    }
    assert_eq!(w.leftovers(&process), [0; 5]);
    assert_eq!(process.exit(), 0);
    w.finish();
}

#[test]
fn a_create_whose_ioctl_fails_lets_post_free_the_rings_and_report_the_status() {
    use uvp_plugin::faults::{FaultInjector, HookEvent};
    let w = World::new(60);
    let process = Process::new(69);
    let io: Arc<dyn DeviceIo> = Arc::new(OtherVersion {
        inner: SimIo::new(&w.host, &process),
        request: None,
        answer: None,
        fail: Some((
            v::CreateQp::ID.ioctl().raw(),
            NtStatus::INSUFFICIENT_RESOURCES,
        )),
    });
    let uvp = Arc::new(FaultInjector::new(ibal_user::linked_provider(&io)));
    {
        let source = PluginSource::LinkedProvider(uvp.clone());
        let ctx = Context::open(&io, CaSelector::Index(0), &source).unwrap();
        let pd = Pd::new(&ctx).unwrap();
        let cq = Cq::new(&ctx, 8).unwrap();
        let allocations = process.space().allocation_count();
        uvp.take_events();
        // Row 3: pre laid the rings out, the IOCTL failed at the OS level;
        // post ran, saw that status as the IB status, and freed them.
        let e = Qp::new(&pd, &cq, &cq, &UD_INIT).unwrap_err();
        let status = IbStatus::from_ntstatus(NtStatus::INSUFFICIENT_RESOURCES);
        assert_eq!(
            e,
            Error::Verb {
                verb: v::VerbId::CreateQp,
                status
            }
        );
        assert_eq!(
            uvp.take_events(),
            [
                HookEvent::Pre {
                    verb: v::VerbId::CreateQp,
                    result: Ok(true)
                },
                HookEvent::Post {
                    verb: v::VerbId::CreateQp,
                    ioctl: status,
                    result: Err(status)
                },
            ]
        );
        assert_eq!(process.space().allocation_count(), allocations);
        assert_eq!(uvp.inner().allocations(), 1, "the CQ only");

        // CQs of another context are refused before any call.
        let other = Context::open(&io, CaSelector::Index(1), &PluginSource::Linked).unwrap();
        let foreign = Cq::new(&other, 8).unwrap();
        let requests = process.requests_issued();
        assert!(matches!(
            Qp::new(&pd, &cq, &foreign, &UD_INIT),
            Err(Error::InvalidArgument(_))
        ));
        assert_eq!(process.requests_issued(), requests);
    }
    assert_eq!(uvp.inner().allocations(), 0);
    assert_eq!(w.leftovers(&process), [0; 5]);
    assert_eq!(process.exit(), 0);
    w.finish();
}

/// Two threads of one process on the deterministic host: one waiting for
/// an asynchronous event in a loop (what our libibverbs' per-context
/// thread does; nothing completes it, so the seam cancels it), the other
/// making and destroying objects. Every verb of the second thread
/// succeeds: a thread's request is never cancelled because another
/// thread's run of the machine was still completing it.
#[test]
fn a_threads_waits_on_the_deterministic_host_never_cancel_another_threads_verbs() {
    let w = World::new(59);
    let process = Process::new(64);
    let io = w.io(&process);
    let ctx = Arc::new(Context::open(&io, CaSelector::Index(0), &PluginSource::Linked).unwrap());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let waiter = {
        let (ctx, stop) = (Arc::clone(&ctx), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut waits = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                // Cancelled: no event comes on this machine.
                assert!(ctx.async_event().is_err());
                waits += 1;
            }
            waits
        })
    };
    for round in 0..300 {
        let pd = Pd::new(&ctx).unwrap_or_else(|e| panic!("round {round}: PD: {e:?}"));
        let cq = Cq::new(&ctx, 16).unwrap_or_else(|e| panic!("round {round}: CQ: {e:?}"));
        drop((cq, pd));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(
        waiter.join().unwrap() > 0,
        "the other thread waited meanwhile"
    );
    drop(ctx);
    settle(&w.host);
    w.finish_with(&process);
}
