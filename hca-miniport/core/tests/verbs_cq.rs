//! The verbs framework and the CA, PD and CQ verbs on the simulated host:
//! requests built with `ib_types::ioctl::encode_request`, submitted through
//! `Hca::submit_request` as `HostRequest`s (kernel and user requestors,
//! from the test thread and from DPCs), answers decoded byte for byte.
//! Each test ends with the host shut down and the verifier clean.

mod support;

use std::sync::{Arc, Mutex};

use driver_platform::{Irql, RequestorMode};
use hca_miniport_core::cmd::Command;
use hca_miniport_core::verbs::{CaClient, STATUS_BUFFER_TOO_SMALL, UVP_NAME, poll_and_rearm};
use hca_prm::cmd::Opcode;
use hca_prm::ctx::{CqState, Cqc};
use ib_types::ca::{CaAttrView, CaCaps, CaModify, CaModifyFlags, PortCaps};
use ib_types::cq::{CqAttr, CqNotify};
use ib_types::event::AsyncEventRecord;
use ib_types::handle::CqHandle;
use ib_types::ioctl::{
    AllocPd, CloseCa, CqOut, CreateCq, DeallocPd, DestroyCq, Empty, LocalMad, LocalMadIn, ModifyCa,
    OpenCa, OpenCaIn, PROXY_ABI_VERSION, QueryCa, QueryCq, ResizeCq, Verb, VerbId,
};
use ib_types::scalars::{Gid, PortGuid, PortNum};
use ib_types::status::{IbStatus, NtStatus};
use ib_types::wc::WorkCompletion;
use support::{NODE_GUID, World, lock, response};
use zerocopy::FromBytes;

const KERNEL: RequestorMode = RequestorMode::Kernel;
const USER: RequestorMode = RequestorMode::User;

/// Opens the CA through a kernel request; returns its handle.
fn open(w: &World) -> u64 {
    let done = w.call::<OpenCa>(KERNEL, 0, &OpenCaIn::CURRENT, 0);
    let r = response::<OpenCa>(&done);
    assert_eq!(r.status, IbStatus::Success);
    r.handle
}

fn create_cq(w: &World, ca: u64, cqe: u32) -> (IbStatus, u64, Option<CqOut>) {
    let attr = CqAttr {
        cqe,
        comp_vector: 0,
    };
    let done = w.call_in_dpc::<CreateCq>(KERNEL, ca, &attr, 0);
    let r = response::<CreateCq>(&done);
    (r.status, r.handle, r.output)
}

fn status_of<V: Verb>(done: &sim_host::request::Completion) -> IbStatus {
    response::<V>(done).status
}

#[test]
fn open_query_close_ca_reports_the_device() {
    let w = World::deterministic(11);
    let done = w.call::<OpenCa>(KERNEL, 0, &OpenCaIn::CURRENT, 0);
    let r = response::<OpenCa>(&done);
    assert_eq!(r.status, IbStatus::Success);
    assert_ne!(r.handle, 0);
    let ca = r.handle;
    let out = r.output.unwrap();
    assert_eq!(out.version, PROXY_ABI_VERSION);
    assert_eq!(out.ca_guid.get(), NODE_GUID);
    assert_eq!(out.uvp_name.as_str(), UVP_NAME);
    assert_eq!(out.doorbell, None, "a kernel caller gets no doorbell page");

    // One open at a time (guide 6.1.1).
    let again = w.call::<OpenCa>(KERNEL, 0, &OpenCaIn::CURRENT, 0);
    assert_eq!(status_of::<OpenCa>(&again), IbStatus::ResourceBusy);

    // Too little room: the size report (Overflow carries total_size).
    let small = w.call::<QueryCa>(KERNEL, ca, &Empty, 16);
    let r = response::<QueryCa>(&small);
    assert_eq!(r.status, IbStatus::Overflow);
    assert!(r.private.is_empty());
    let needed = r.output.unwrap().total_size;

    // With room, from a DPC: the block parses and matches the device.
    let full = w.call_in_dpc::<QueryCa>(KERNEL, ca, &Empty, needed);
    let r = response::<QueryCa>(&full);
    assert_eq!(r.status, IbStatus::Success);
    assert_eq!(r.private.len() as u32, needed);
    let view = CaAttrView::parse(r.private).unwrap();
    let attr = view.attr();
    assert_eq!(attr.node_guid.get(), NODE_GUID);
    assert_eq!(attr.layout.num_ports, 2);
    assert!(attr.caps.contains(CaCaps::RC | CaCaps::UD));
    let report = w.hca().report().unwrap();
    assert_eq!(attr.limits.max_cqes, 1 << report.capabilities.log_max_cqes);
    for (port, ipv4) in [(1u8, [10, 0, 0, 1]), (2, [10, 0, 1, 1])] {
        let p = view.port(PortNum::new(port).unwrap()).unwrap();
        assert_eq!(
            p.attr().port_guid,
            PortGuid::new(NODE_GUID + u64::from(port))
        );
        assert_eq!(p.gids()[0], Gid::from_ipv4(ipv4));
        assert_eq!(p.pkeys()[0].get(), 0xFFFF);
    }

    // ModifyCa: SET_PORT, visible in the next query.
    let port_caps = |w: &World, port: u8| {
        let done = w.call::<QueryCa>(KERNEL, ca, &Empty, needed);
        let r = response::<QueryCa>(&done);
        let view = CaAttrView::parse(r.private).unwrap();
        view.port(PortNum::new(port).unwrap()).unwrap().attr().caps
    };
    assert!(!port_caps(&w, 1).contains(PortCaps::IS_CM));
    let modify = CaModify::new(
        PortNum::FIRST,
        CaModifyFlags::IS_CM_SUPPORTED | CaModifyFlags::RESET_QKEY_COUNTER,
        CaModifyFlags::empty(),
    )
    .unwrap();
    let done = w.call_in_dpc::<ModifyCa>(KERNEL, ca, &modify, 0);
    assert_eq!(status_of::<ModifyCa>(&done), IbStatus::Success);
    assert!(port_caps(&w, 1).contains(PortCaps::IS_CM));
    assert!(!port_caps(&w, 2).contains(PortCaps::IS_CM));
    let clear = CaModify::new(
        PortNum::FIRST,
        CaModifyFlags::empty(),
        CaModifyFlags::IS_CM_SUPPORTED,
    )
    .unwrap();
    let done = w.call::<ModifyCa>(KERNEL, ca, &clear, 0);
    assert_eq!(status_of::<ModifyCa>(&done), IbStatus::Success);
    assert!(!port_caps(&w, 1).contains(PortCaps::IS_CM));
    let no_port = CaModify::new(
        PortNum::new(3).unwrap(),
        CaModifyFlags::IS_SM,
        CaModifyFlags::empty(),
    )
    .unwrap();
    let done = w.call::<ModifyCa>(KERNEL, ca, &no_port, 0);
    assert_eq!(status_of::<ModifyCa>(&done), IbStatus::InvalidPort);

    let done = w.call::<CloseCa>(KERNEL, ca, &Empty, 0);
    assert_eq!(status_of::<CloseCa>(&done), IbStatus::Success);
    // The handle is stale now, and a new open gets another one.
    let done = w.call::<CloseCa>(KERNEL, ca, &Empty, 0);
    assert_eq!(status_of::<CloseCa>(&done), IbStatus::InvalidCaHandle);
    let reopened = open(&w);
    assert_ne!(reopened, ca);
    let done = w.call::<QueryCa>(KERNEL, ca, &Empty, needed);
    assert_eq!(status_of::<QueryCa>(&done), IbStatus::InvalidCaHandle);
    w.finish();
}

#[test]
fn pds_allocate_deallocate_and_refuse_while_referenced() {
    let w = World::deterministic(12);
    let ca = open(&w);
    let done = w.call_in_dpc::<AllocPd>(KERNEL, ca, &Empty, 0);
    let r = response::<AllocPd>(&done);
    assert_eq!(r.status, IbStatus::Success);
    let pd = r.handle;
    let done = w.call::<AllocPd>(KERNEL, ca, &Empty, 0);
    let other = response::<AllocPd>(&done).handle;
    assert_ne!(pd, other);

    // A CA with PDs cannot close.
    let done = w.call::<CloseCa>(KERNEL, ca, &Empty, 0);
    assert_eq!(status_of::<CloseCa>(&done), IbStatus::ResourceBusy);

    // Referenced: busy, and still there.
    assert_eq!(w.hca().reference_pd(pd), Ok(1));
    let done = w.call_in_dpc::<DeallocPd>(KERNEL, pd, &Empty, 0);
    assert_eq!(status_of::<DeallocPd>(&done), IbStatus::ResourceBusy);
    assert_eq!(w.hca().release_pd(pd), Ok(0));
    let done = w.call_in_dpc::<DeallocPd>(KERNEL, pd, &Empty, 0);
    assert_eq!(status_of::<DeallocPd>(&done), IbStatus::Success);
    // Stale now.
    let done = w.call::<DeallocPd>(KERNEL, pd, &Empty, 0);
    assert_eq!(status_of::<DeallocPd>(&done), IbStatus::InvalidPdHandle);
    assert_eq!(w.hca().reference_pd(pd), Err(IbStatus::InvalidPdHandle));
    // A CQ handle is not a PD handle.
    let (_, cq, _) = create_cq(&w, ca, 8);
    let done = w.call::<DeallocPd>(KERNEL, cq, &Empty, 0);
    assert_eq!(status_of::<DeallocPd>(&done), IbStatus::InvalidPdHandle);

    let done = w.call::<DestroyCq>(KERNEL, cq, &Empty, 0);
    assert_eq!(status_of::<DestroyCq>(&done), IbStatus::Success);
    let done = w.call::<DeallocPd>(KERNEL, other, &Empty, 0);
    assert_eq!(status_of::<DeallocPd>(&done), IbStatus::Success);
    let done = w.call::<CloseCa>(KERNEL, ca, &Empty, 0);
    assert_eq!(status_of::<CloseCa>(&done), IbStatus::Success);
    w.finish();
}

/// The CQ's context as the device reports it (`QUERY_CQ`).
fn query_cqc(w: &World, cqn: u32) -> Cqc {
    let out = Arc::new(Mutex::new(None));
    let sink = out.clone();
    w.hca().submit(
        Command::new(Opcode::QueryCq, cqn).with_output(size_of::<Cqc>()),
        Box::new(move |result| *lock(&sink) = Some(result)),
    );
    w.settle();
    let result = lock(&out).take().expect("QUERY_CQ completed");
    Cqc::read_from_bytes(&result.expect("QUERY_CQ succeeded").mailbox).unwrap()
}

#[test]
fn cq_create_query_resize_destroy_from_dpcs() {
    let w = World::deterministic(13);
    let ca = open(&w);
    let report = w.hca().report().unwrap();
    let max = 1u32 << report.capabilities.log_max_cqes;

    let (status, cq, out) = create_cq(&w, ca, 100);
    assert_eq!(status, IbStatus::Success);
    assert_eq!(out, Some(CqOut { cqe: 128 }), "rounded to a power of two");
    let cqn = support::number_of(cq);
    let cqc = query_cqc(&w, cqn);
    assert_eq!(cqc.ring.log_entries, 7);
    assert_eq!(cqc.eqn.get(), report.eqn);
    assert!(
        cqc.ring.mtt_index.get() >= report.reserved_mtt_entries,
        "CQ MTT entries come after the EQ's"
    );
    assert_eq!(cqc.state, CqState::Unarmed.code());

    let done = w.call_in_dpc::<QueryCq>(KERNEL, cq, &Empty, 0);
    assert_eq!(response::<QueryCq>(&done).output, Some(CqOut { cqe: 128 }));

    // Too large for the device: a clear status, nothing created.
    let (status, handle, _) = create_cq(&w, ca, max + 1);
    assert_eq!((status, handle), (IbStatus::InvalidCqSize, 0));
    let (status, _, out) = create_cq(&w, ca, max);
    assert_eq!((status, out), (IbStatus::Success, Some(CqOut { cqe: max })));

    // Resize up, to the same size, and down, all from DPCs.
    let grow = CqAttr {
        cqe: 1000,
        comp_vector: 0,
    };
    let done = w.call_in_dpc::<ResizeCq>(KERNEL, cq, &grow, 0);
    let r = response::<ResizeCq>(&done);
    assert_eq!(
        (r.status, r.output),
        (IbStatus::Success, Some(CqOut { cqe: 1024 }))
    );
    assert_eq!(query_cqc(&w, cqn).ring.log_entries, 10);
    let done = w.call_in_dpc::<ResizeCq>(KERNEL, cq, &grow, 0);
    assert_eq!(
        response::<ResizeCq>(&done).output,
        Some(CqOut { cqe: 1024 })
    );
    let shrink = CqAttr {
        cqe: 16,
        comp_vector: 0,
    };
    let done = w.call_in_dpc::<ResizeCq>(KERNEL, cq, &shrink, 0);
    assert_eq!(response::<ResizeCq>(&done).output, Some(CqOut { cqe: 16 }));
    let too_big = CqAttr {
        cqe: max + 1,
        comp_vector: 0,
    };
    let done = w.call_in_dpc::<ResizeCq>(KERNEL, cq, &too_big, 0);
    assert_eq!(status_of::<ResizeCq>(&done), IbStatus::InvalidCqSize);
    assert_eq!(query_cqc(&w, cqn).ring.log_entries, 4, "the old ring stays");

    // Busy while referenced (a QP would hold it).
    assert_eq!(w.hca().reference_cq(cq), Ok(1));
    let done = w.call_in_dpc::<DestroyCq>(KERNEL, cq, &Empty, 0);
    assert_eq!(status_of::<DestroyCq>(&done), IbStatus::ResourceBusy);
    assert_eq!(w.hca().release_cq(cq), Ok(0));

    let done = w.call_in_dpc::<DestroyCq>(KERNEL, cq, &Empty, 0);
    assert_eq!(status_of::<DestroyCq>(&done), IbStatus::Success);
    for verb_status in [
        status_of::<DestroyCq>(&w.call::<DestroyCq>(KERNEL, cq, &Empty, 0)),
        status_of::<QueryCq>(&w.call::<QueryCq>(KERNEL, cq, &Empty, 0)),
        status_of::<ResizeCq>(&w.call::<ResizeCq>(KERNEL, cq, &grow, 0)),
    ] {
        assert_eq!(verb_status, IbStatus::InvalidCqHandle);
    }
    let mut wcs = [WorkCompletion::EMPTY; 4];
    assert_eq!(
        w.hca().poll_cq(cq, &mut wcs),
        Err(IbStatus::InvalidCqHandle)
    );
    // The number is reused, under a new handle.
    let (status, again, _) = create_cq(&w, ca, 8);
    assert_eq!(status, IbStatus::Success);
    assert_ne!(again, cq);
    w.finish();
}

#[test]
fn poll_on_an_empty_cq_and_arming_follow_the_prm() {
    let w = World::deterministic(14);
    let ca = open(&w);
    let (_, cq, _) = create_cq(&w, ca, 32);
    let hca = w.hca();
    let mut wcs = [WorkCompletion::EMPTY; 8];
    assert_eq!(hca.poll_cq(cq, &mut wcs), Ok(0));
    hca.arm_cq(cq, CqNotify::Solicited).unwrap();
    assert_eq!(
        query_cqc(&w, support::number_of(cq)).state,
        CqState::ArmedSolicited.code()
    );

    // The guide's 8.3 helper from a DPC: poll (empty), arm, poll again.
    let processed = Arc::new(Mutex::new(None));
    {
        let (hca, processed) = (hca.clone(), processed.clone());
        w.in_dpc(move || {
            let mut wcs = [WorkCompletion::EMPTY; 8];
            let mut batches = 0;
            let total = poll_and_rearm(&hca, cq, CqNotify::NextCompletion, &mut wcs, |_| {
                batches += 1;
            });
            *lock(&processed) = Some((total, batches));
        });
    }
    w.settle();
    assert_eq!(*lock(&processed), Some((Ok(0), 1)));
    assert_eq!(
        query_cqc(&w, support::number_of(cq)).state,
        CqState::ArmedNext.code()
    );
    // No CQE arrived, so no completion event.
    assert!(lock(&w.sink().completions).is_empty());
    w.finish();
}

#[test]
fn bad_requests_get_clear_statuses_and_change_nothing() {
    let w = World::deterministic(15);
    let ca = open(&w);
    let hca = w.hca();

    // An unknown code: no verb to answer in.
    let (request, issuer) = w.raw_request(0x0022_0000, KERNEL, vec![0; 16], 64);
    hca.submit_request(request);
    w.settle();
    assert_eq!(
        issuer.completion().unwrap().status,
        NtStatus::INVALID_DEVICE_REQUEST
    );

    // Bad framing: a request cut short, and one with a stray byte.
    for cut in [0usize, 8, 16, 23] {
        let (mut bytes, _) = (vec![0u8; 24], ());
        ib_types::ioctl::encode_request::<CreateCq>(
            ca,
            &CqAttr {
                cqe: 8,
                comp_vector: 0,
            },
            &[],
            0,
            &mut bytes,
        )
        .unwrap();
        bytes.truncate(cut);
        let (request, issuer) = w.raw_request(VerbId::CreateCq.ioctl().raw(), KERNEL, bytes, 24);
        hca.submit_request(request);
        w.settle();
        let done = issuer.completion().unwrap();
        assert_eq!(status_of::<CreateCq>(&done), IbStatus::InvalidParameter);
    }
    // An output buffer too small for the response header.
    let (request, issuer) = w.raw_request(
        VerbId::QueryCq.ioctl().raw(),
        KERNEL,
        ca.to_le_bytes().into(),
        8,
    );
    hca.submit_request(request);
    w.settle();
    assert_eq!(issuer.completion().unwrap().status, STATUS_BUFFER_TOO_SMALL);

    // Stale and wrong-kind handles.
    let done = w.call::<QueryCq>(KERNEL, ca, &Empty, 0);
    assert_eq!(status_of::<QueryCq>(&done), IbStatus::InvalidCqHandle);
    let done = w.call::<AllocPd>(KERNEL, ca ^ (1 << 40), &Empty, 0);
    assert_eq!(status_of::<AllocPd>(&done), IbStatus::InvalidCaHandle);
    let attr = CqAttr {
        cqe: 8,
        comp_vector: 3,
    };
    let done = w.call::<CreateCq>(KERNEL, ca, &attr, 0);
    assert_eq!(status_of::<CreateCq>(&done), IbStatus::InvalidParameter);

    // User mode: kernel-only verbs, a kernel CA's objects, open.
    let mad = LocalMadIn {
        port: PortNum::FIRST,
        mad: [0; 256],
    };
    let done = w.call::<LocalMad>(USER, ca, &mad, 0);
    assert_eq!(status_of::<LocalMad>(&done), IbStatus::InvalidPermission);
    let done = w.call::<AllocPd>(USER, ca, &Empty, 0);
    assert_eq!(status_of::<AllocPd>(&done), IbStatus::InvalidCaHandle);
    let done = w.call::<CreateCq>(
        USER,
        ca,
        &CqAttr {
            cqe: 8,
            comp_vector: 0,
        },
        0,
    );
    assert_eq!(status_of::<CreateCq>(&done), IbStatus::InvalidCaHandle);
    let done = w.call::<CloseCa>(USER, ca, &Empty, 0);
    assert_eq!(status_of::<CloseCa>(&done), IbStatus::InvalidCaHandle);
    let done = w.call::<OpenCa>(USER, 0, &OpenCaIn::CURRENT, 0);
    assert_eq!(status_of::<OpenCa>(&done), IbStatus::Unsupported);

    // Nothing changed: the CA is open, empty, and closes.
    let done = w.call::<CloseCa>(KERNEL, ca, &Empty, 0);
    assert_eq!(status_of::<CloseCa>(&done), IbStatus::Success);
    w.finish();
}

/// A client that records its callbacks and the IRQL they came at.
#[derive(Default)]
struct Client {
    completions: Mutex<Vec<(CqHandle, Irql)>>,
    events: Mutex<Vec<(AsyncEventRecord, Irql)>>,
}

impl CaClient for Client {
    fn completion(&self, cq: CqHandle) {
        lock(&self.completions).push((cq, sim_host::irql::current()));
    }
    fn async_event(&self, event: &AsyncEventRecord) {
        lock(&self.events).push((*event, sim_host::irql::current()));
    }
}

#[test]
fn the_ci_open_registers_callbacks_and_close_waits() {
    let w = World::deterministic(16);
    let client = Arc::new(Client::default());
    let hca = w.hca();
    let ca = hca.open_ca(Some(client.clone())).unwrap();
    assert_eq!(hca.open_ca(None), Err(IbStatus::ResourceBusy));
    let (status, cq, _) = create_cq(&w, ca, 8);
    assert_eq!(status, IbStatus::Success);
    assert_eq!(hca.close_ca(ca), Err(IbStatus::ResourceBusy));
    let done = w.call::<DestroyCq>(KERNEL, cq, &Empty, 0);
    assert_eq!(status_of::<DestroyCq>(&done), IbStatus::Success);
    assert_eq!(hca.close_ca(ca), Ok(()));
    assert_eq!(hca.close_ca(ca), Err(IbStatus::InvalidCaHandle));
    w.finish();
}

/// Runs one device command through the core and returns its result.
fn command(
    w: &World,
    command: Command,
) -> Result<hca_miniport_core::cmd::CommandOutput, hca_miniport_core::cmd::CommandError> {
    let out = Arc::new(Mutex::new(None));
    let sink = out.clone();
    w.hca()
        .submit(command, Box::new(move |result| *lock(&sink) = Some(result)));
    w.settle();
    lock(&out).take().expect("the command completed")
}

/// A UD QP built by hand (QPs are not verbs of the core yet) whose receive
/// queue holds posted WQEs; moving it to ERR makes the device flush them
/// into the CQ (PRM 6.1.3, 10.5): real CQEs without a fabric.
struct FlushQp {
    qpn: u32,
    sq: sim_host::dma::HostCommonBuffer,
    rq: sim_host::dma::HostCommonBuffer,
    dbr: sim_host::dma::HostCommonBuffer,
    posted: u32,
}

impl FlushQp {
    const QPN: u32 = 4;

    /// Creates the QP on `cqn` (both queues); its rings use the last two
    /// MTT entries, which the core's allocator does not reach in these
    /// tests.
    fn create(w: &World, cqn: u32) -> Self {
        use driver_platform::{CommonBuffer, DmaAdapter};
        use hca_prm::ctx::{BufDesc, Qpc};
        use hca_prm::{Le32, Le64};
        use zerocopy::{FromZeros, IntoBytes};
        let adapter = w.adapter();
        let (sq, rq, dbr) = (
            adapter.alloc_common(4096).unwrap(),
            adapter.alloc_common(4096).unwrap(),
            adapter.alloc_common(4096).unwrap(),
        );
        let report = w.hca().report().unwrap();
        let top = (1u64 << report.table(hca_prm::cmd::Table::Mtt).log_count) - 2;
        let mut mailbox = top.to_le_bytes().to_vec();
        mailbox.extend_from_slice(&sq.bus_address().to_le_bytes());
        mailbox.extend_from_slice(&rq.bus_address().to_le_bytes());
        command(w, Command::new(Opcode::WriteMtt, 0).with_mailbox(mailbox)).unwrap();
        let desc = |mtt: u64, log_entries: u8, log_stride: u8| BufDesc {
            mtt_index: Le32::new(mtt as u32),
            log_page_size: 12,
            log_entries,
            log_stride,
            ..BufDesc::default()
        };
        let mut qpc = Qpc::new_zeroed();
        qpc.qp_type = ib_types::qp::QpType::Ud.code();
        qpc.port = 1;
        qpc.send_cqn = Le32::new(cqn);
        qpc.recv_cqn = Le32::new(cqn);
        qpc.sq = desc(top, 6, 6);
        qpc.rq = desc(top + 1, 7, 5);
        qpc.rq_dbr = Le64::new(dbr.bus_address());
        command(
            w,
            Command::new(Opcode::Sw2HwQp, Self::QPN).with_mailbox(qpc.as_bytes().to_vec()),
        )
        .unwrap();
        FlushQp {
            qpn: Self::QPN,
            sq,
            rq,
            dbr,
            posted: 0,
        }
    }

    /// Posts `n` receive WQEs (no scatter entries).
    fn post_recvs(&mut self, n: u32) {
        use driver_platform::CommonBuffer;
        for _ in 0..n {
            let mut wqe = [0u8; 32];
            wqe[2..4].copy_from_slice(&(self.posted as u16).to_le_bytes());
            let slot = (self.posted & 127) as usize * 32;
            assert!(self.rq.write(slot, &wqe));
            self.posted += 1;
        }
        assert!(self.dbr.write(0, &self.posted.to_le_bytes()));
    }

    /// `MODIFY_QP` to `state` (no other attributes). RESET returns the
    /// device's queue counters to 0, so the posting counter restarts too.
    fn modify(&mut self, w: &World, state: ib_types::qp::QpState) {
        use driver_platform::CommonBuffer;
        if state == ib_types::qp::QpState::Reset {
            self.posted = 0;
            assert!(self.dbr.write(0, &0u32.to_le_bytes()));
        }
        use hca_prm::ctx::ModifyQp;
        use zerocopy::{FromZeros, IntoBytes};
        let mut input = ModifyQp::new_zeroed();
        input.attr_mask = hca_prm::Le32::new(ib_types::qp::QpAttrMask::STATE.bits());
        input.next_state = state.code();
        command(
            w,
            Command::new(Opcode::ModifyQp, self.qpn).with_mailbox(input.as_bytes().to_vec()),
        )
        .unwrap();
    }

    /// Destroys the QP and frees its memory.
    fn destroy(self, w: &World) {
        command(w, Command::new(Opcode::Hw2SwQp, self.qpn)).unwrap();
        let adapter = w.adapter();
        for buffer in [self.sq, self.rq, self.dbr] {
            adapter.free_common(buffer);
        }
    }
}

#[test]
fn completions_are_polled_and_their_events_reach_the_client_from_the_dpc() {
    use ib_types::qp::QpState;
    use ib_types::wc::WcStatus;
    let w = World::deterministic(17);
    let client = Arc::new(Client::default());
    let hca = w.hca();
    let ca = hca.open_ca(Some(client.clone())).unwrap();
    let (_, cq, _) = create_cq(&w, ca, 16);
    let cqn = support::number_of(cq);
    let mut qp = FlushQp::create(&w, cqn);
    hca.arm_cq(cq, CqNotify::NextCompletion).unwrap();
    qp.post_recvs(5);
    qp.modify(&w, QpState::Err);

    // The flush wrote 5 CQEs; the armed CQ raised one event, delivered to
    // the client's callback from the DPC with the CQ's handle.
    let events = lock(&client.completions).clone();
    assert_eq!(events, vec![(CqHandle::from_raw(cq), Irql::DISPATCH)]);
    assert_eq!(lock(&w.sink().completions).clone(), vec![cqn]);

    // Poll in two batches, from a DPC.
    let polled = Arc::new(Mutex::new(Vec::new()));
    {
        let (hca, polled) = (hca.clone(), polled.clone());
        w.in_dpc(move || {
            let mut wcs = [WorkCompletion::EMPTY; 3];
            loop {
                let n = hca.poll_cq(cq, &mut wcs).unwrap();
                if n == 0 {
                    break;
                }
                lock(&polled).extend_from_slice(&wcs[..n]);
            }
        });
    }
    w.settle();
    let polled = lock(&polled).clone();
    assert_eq!(polled.len(), 5);
    for wc in &polled {
        assert_eq!(wc.status, WcStatus::WrFlushErr);
        assert_eq!(wc.qp_num.get(), qp.qpn);
    }
    let cqc = query_cqc(&w, cqn);
    assert_eq!(cqc.producer.get(), 5);

    // More flushes while not armed: no event; the 8.3 helper takes them
    // and re-arms.
    qp.modify(&w, QpState::Reset);
    qp.post_recvs(3);
    qp.modify(&w, QpState::Err);
    assert_eq!(lock(&client.completions).len(), 1);
    let mut wcs = [WorkCompletion::EMPTY; 2];
    let mut seen = 0;
    let total = poll_and_rearm(&hca, cq, CqNotify::NextCompletion, &mut wcs, |batch| {
        seen += batch.len()
    });
    assert_eq!((total, seen), (Ok(3), 3));
    assert_eq!(query_cqc(&w, cqn).state, CqState::ArmedNext.code());

    // A CQ a QP uses cannot be destroyed: the device refuses, the CQ stays.
    let done = w.call::<DestroyCq>(KERNEL, cq, &Empty, 0);
    assert_eq!(status_of::<DestroyCq>(&done), IbStatus::ResourceBusy);
    let mut empty = [WorkCompletion::EMPTY; 1];
    assert_eq!(hca.poll_cq(cq, &mut empty), Ok(0));

    qp.destroy(&w);
    let done = w.call::<DestroyCq>(KERNEL, cq, &Empty, 0);
    assert_eq!(status_of::<DestroyCq>(&done), IbStatus::Success);
    assert_eq!(hca.close_ca(ca), Ok(()));
    w.finish();
}

#[test]
fn resize_keeps_outstanding_completions_and_refuses_a_ring_too_small() {
    use ib_types::qp::QpState;
    let w = World::deterministic(18);
    let ca = open(&w);
    let hca = w.hca();
    let (_, cq, _) = create_cq(&w, ca, 16);
    let mut qp = FlushQp::create(&w, support::number_of(cq));
    qp.post_recvs(10);
    qp.modify(&w, QpState::Err);
    let mut wcs = [WorkCompletion::EMPTY; 16];
    assert_eq!(hca.poll_cq(cq, &mut wcs[..3]), Ok(3));

    // 7 outstanding do not fit 4 entries: refused, the old ring stays.
    let small = CqAttr {
        cqe: 4,
        comp_vector: 0,
    };
    let done = w.call_in_dpc::<ResizeCq>(KERNEL, cq, &small, 0);
    assert_eq!(status_of::<ResizeCq>(&done), IbStatus::InvalidCqSize);
    // Grow: the 7 move to the new ring, in order, none lost or doubled.
    let big = CqAttr {
        cqe: 64,
        comp_vector: 0,
    };
    let done = w.call_in_dpc::<ResizeCq>(KERNEL, cq, &big, 0);
    assert_eq!(response::<ResizeCq>(&done).output, Some(CqOut { cqe: 64 }));
    assert_eq!(hca.poll_cq(cq, &mut wcs), Ok(7));
    assert_eq!(hca.poll_cq(cq, &mut wcs), Ok(0));
    // And the new ring keeps working.
    qp.modify(&w, QpState::Reset);
    qp.post_recvs(2);
    qp.modify(&w, QpState::Err);
    assert_eq!(hca.poll_cq(cq, &mut wcs), Ok(2));

    qp.destroy(&w);
    let done = w.call::<DestroyCq>(KERNEL, cq, &Empty, 0);
    assert_eq!(status_of::<DestroyCq>(&done), IbStatus::Success);
    w.finish();
}

#[test]
fn a_cq_overflow_reaches_the_client_as_an_async_event() {
    use ib_types::event::AsyncEventCode;
    use ib_types::qp::QpState;
    let w = World::deterministic(19);
    let client = Arc::new(Client::default());
    let hca = w.hca();
    let ca = hca.open_ca(Some(client.clone())).unwrap();
    let (_, cq, out) = create_cq(&w, ca, 4);
    assert_eq!(out, Some(CqOut { cqe: 4 }));
    let mut qp = FlushQp::create(&w, support::number_of(cq));
    qp.post_recvs(6);
    qp.modify(&w, QpState::Err);
    let events = lock(&client.events).clone();
    let overflow: Vec<_> = events
        .iter()
        .filter(|(e, _)| e.code == AsyncEventCode::CqError)
        .collect();
    assert_eq!(overflow.len(), 1, "{events:?}");
    assert_eq!(overflow[0].0.handle, cq);
    assert_eq!(overflow[0].1, Irql::DISPATCH);
    assert_eq!(
        query_cqc(&w, support::number_of(cq)).state,
        CqState::Error.code()
    );
    // The entries that fitted are still there (PRM 6.2).
    let mut wcs = [WorkCompletion::EMPTY; 8];
    assert_eq!(hca.poll_cq(cq, &mut wcs), Ok(4));
    qp.destroy(&w);
    let done = w.call::<DestroyCq>(KERNEL, cq, &Empty, 0);
    assert_eq!(status_of::<DestroyCq>(&done), IbStatus::Success);
    assert_eq!(hca.close_ca(ca), Ok(()));
    w.finish();
}
