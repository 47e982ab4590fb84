//! Every verb of `ib_types::ioctl::VerbId` issued at DISPATCH_LEVEL (from a
//! DPC of the miniport) with valid inputs, as one table: each verb's
//! expected answer is given by an exhaustive `match` over `VerbId` (no
//! wildcard), so a verb added to the ABI does not compile here until it is
//! given an expectation, and the run then fails until the scenario issues
//! it. Ends with the host shut down and the verifier clean.

mod support;

use std::collections::BTreeMap;

use driver_platform::{CommonBuffer, DmaAdapter, RequestorMode};
use ib_types::access::AccessFlags;
use ib_types::av::{AvAttr, Grh};
use ib_types::ca::{CaModify, CaModifyFlags};
use ib_types::cq::CqAttr;
use ib_types::handle::{CqHandle, PdHandle};
use ib_types::ioctl::{
    AllocMw, AllocPd, AttachMcast, CloseCa, CreateAv, CreateCq, CreateQp, CreateSrq, DeallocMw,
    DeallocPd, DeregMr, DestroyAv, DestroyCq, DestroyQp, DestroySrq, DetachMcast, Empty,
    GetAsyncEvent, LocalMad, LocalMadIn, MAD_SIZE, ModifyAv, ModifyCa, ModifyQp, ModifySrq, OpenCa,
    OpenCaIn, QueryAv, QueryCa, QueryCq, QueryMr, QueryMw, QueryQp, QuerySrq, RegMr, RegPhysMr,
    RegSharedMr, ReregMr, ReregPhysMr, ResizeCq, Response, Verb, VerbId, WaitCqEvent,
    encode_request, request_len, response_len,
};
use ib_types::mcast::McastGroup;
use ib_types::mr::{
    MrRegister, MrRereg, MrShare, MwAttr, MwType, PhysMrRegister, PhysMrRereg, PhysTranslation,
};
use ib_types::qp::{QpCaps, QpCreate, QpModify, QpState, QpType};
use ib_types::scalars::{Gid, Lid, PortNum, Psn, QKey};
use ib_types::srq::{SrqAttr, SrqCreate, SrqModify};
use ib_types::status::IbStatus;
use ib_types::wr::RKey;
use support::{World, response};

const KERNEL: RequestorMode = RequestorMode::Kernel;

/// What each verb answers when issued from a DPC with valid inputs.
/// Exhaustive on purpose: a new verb must be given a row.
fn expected_at_dispatch(verb: VerbId) -> IbStatus {
    match verb {
        // User-context verbs (`verbs::user`: a provider waits on its CQ's
        // events and its context's async events); a kernel client gets
        // callbacks instead, so a kernel CA's request is answered
        // Unsupported at once, whatever the IRQL.
        VerbId::WaitCqEvent | VerbId::GetAsyncEvent => IbStatus::Unsupported,
        VerbId::OpenCa
        | VerbId::CloseCa
        | VerbId::QueryCa
        | VerbId::ModifyCa
        | VerbId::AllocPd
        | VerbId::DeallocPd
        | VerbId::CreateAv
        | VerbId::QueryAv
        | VerbId::ModifyAv
        | VerbId::DestroyAv
        | VerbId::CreateQp
        | VerbId::QueryQp
        | VerbId::ModifyQp
        | VerbId::DestroyQp
        | VerbId::CreateCq
        | VerbId::QueryCq
        | VerbId::ResizeCq
        | VerbId::DestroyCq
        | VerbId::CreateSrq
        | VerbId::QuerySrq
        | VerbId::ModifySrq
        | VerbId::DestroySrq
        // Kernel memory is locked with the kernel locker, which is usable
        // at DISPATCH_LEVEL (user memory is not: `memory.rs` checks that
        // refusal, and no user CA exists yet to issue it from).
        | VerbId::RegMr
        | VerbId::RegSharedMr
        | VerbId::ReregMr
        | VerbId::QueryMr
        | VerbId::DeregMr
        | VerbId::AllocMw
        | VerbId::QueryMw
        | VerbId::DeallocMw
        | VerbId::AttachMcast
        | VerbId::DetachMcast
        | VerbId::RegPhysMr
        | VerbId::ReregPhysMr
        | VerbId::LocalMad => IbStatus::Success,
    }
}

/// Issues verbs from DPCs and records each verb's answer.
struct Table<'w> {
    w: &'w World,
    answers: BTreeMap<u16, (VerbId, IbStatus)>,
}

impl Table<'_> {
    /// Issues `V` from a DPC with `private` input bytes, checks the answer
    /// is the table's, records it, and returns the response's handle and
    /// output.
    fn issue_with<V: Verb>(
        &mut self,
        handle: u64,
        input: &V::In,
        private: &[u8],
        private_out_max: u32,
    ) -> (u64, Option<V::Out>, Vec<u8>) {
        let mut bytes = vec![0; request_len::<V>(private.len()).unwrap()];
        encode_request::<V>(handle, input, private, private_out_max, &mut bytes).unwrap();
        let out_len = response_len::<V>(private_out_max as usize).unwrap();
        let (request, issuer) = self
            .w
            .raw_request(V::ID.ioctl().raw(), KERNEL, bytes, out_len);
        // `submit_in_dpc_at` asserts the submit runs at DISPATCH_LEVEL.
        let done = self.w.submit_in_dpc_at(0, request, issuer);
        let r: Response<'_, V> = response::<V>(&done);
        assert_eq!(
            r.status,
            expected_at_dispatch(V::ID),
            "{} from a DPC",
            V::ID.name()
        );
        let previous = self.answers.insert(V::ID as u16, (V::ID, r.status));
        assert!(previous.is_none(), "{} issued twice", V::ID.name());
        (r.handle, r.output, r.private.to_vec())
    }

    fn issue<V: Verb>(&mut self, handle: u64, input: &V::In) -> (u64, Option<V::Out>) {
        let (handle, out, _) = self.issue_with::<V>(handle, input, &[], 0);
        (handle, out)
    }
}

fn av(ip: [u8; 4], sl: u8) -> AvAttr {
    AvAttr {
        port: PortNum::new(1).unwrap(),
        sl,
        dlid: Lid::UNASSIGNED,
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
fn every_verb_completes_when_issued_at_dispatch_level() {
    let w = World::deterministic(97);
    let mut t = Table {
        w: &w,
        answers: BTreeMap::new(),
    };

    // CA.
    let (ca, opened) = t.issue::<OpenCa>(0, &OpenCaIn::CURRENT);
    assert!(opened.is_some());
    let (_, out, block) = t.issue_with::<QueryCa>(ca, &Empty, &[], 4096);
    assert!(out.unwrap().total_size as usize <= block.len() + 4096 && !block.is_empty());
    let modify = CaModify::new(
        PortNum::FIRST,
        CaModifyFlags::RESET_QKEY_COUNTER,
        CaModifyFlags::empty(),
    )
    .unwrap();
    t.issue::<ModifyCa>(ca, &modify);

    // PD, AV.
    let (pd, _) = t.issue::<AllocPd>(ca, &Empty);
    let (av_handle, _) = t.issue::<CreateAv>(pd, &av([10, 0, 0, 1], 1));
    let (_, queried) = t.issue::<QueryAv>(av_handle, &Empty);
    assert_eq!(queried.unwrap().pd, PdHandle::from_raw(pd));
    t.issue::<ModifyAv>(av_handle, &av([10, 0, 1, 1], 2));

    // CQ.
    let cq_attr = CqAttr {
        cqe: 32,
        comp_vector: 0,
    };
    let (cq, created) = t.issue::<CreateCq>(ca, &cq_attr);
    let cqe = created.unwrap().cqe;
    assert!(cqe >= 32);
    let (_, q) = t.issue::<QueryCq>(cq, &Empty);
    assert_eq!(q.unwrap().cqe, cqe);
    let grow = CqAttr {
        cqe: 100,
        comp_vector: 0,
    };
    let (_, resized) = t.issue::<ResizeCq>(cq, &grow);
    assert!(resized.unwrap().cqe >= 100);

    // SRQ.
    let srq_create = SrqCreate {
        pd: PdHandle::from_raw(pd),
        attr: SrqAttr {
            max_wr: 16,
            max_sge: 1,
            srq_limit: 0,
        },
    };
    let (srq, _) = t.issue::<CreateSrq>(ca, &srq_create);
    t.issue::<ModifySrq>(
        srq,
        &SrqModify {
            max_wr: None,
            srq_limit: Some(4),
        },
    );
    let (_, srq_q) = t.issue::<QuerySrq>(srq, &Empty);
    assert_eq!(srq_q.unwrap().srq_limit, 4);

    // QP (UD, so it can join a multicast group).
    let qp_create = QpCreate {
        qp_type: QpType::Ud,
        pd: PdHandle::from_raw(pd),
        send_cq: CqHandle::from_raw(cq),
        recv_cq: CqHandle::from_raw(cq),
        srq: None,
        caps: QpCaps {
            max_send_wr: 4,
            max_recv_wr: 4,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        sq_sig_all: false,
        port: None,
    };
    let (qp, _) = t.issue::<CreateQp>(ca, &qp_create);
    let to_init = QpModify {
        state: Some(QpState::Init),
        pkey_index: Some(0),
        port: Some(PortNum::new(1).unwrap()),
        qkey: Some(QKey::new(0x1111)),
        ..QpModify::default()
    };
    t.issue::<ModifyQp>(qp, &to_init);
    let (_, qq) = t.issue::<QueryQp>(qp, &Empty);
    assert_eq!(qq.unwrap().state, QpState::Init);
    // The rest of the path to RTS through the (already counted) verb.
    for m in [
        QpModify::to_state(QpState::Rtr),
        QpModify {
            state: Some(QpState::Rts),
            sq_psn: Some(Psn::new(1).unwrap()),
            ..QpModify::default()
        },
    ] {
        let done = w.call_in_dpc::<ModifyQp>(KERNEL, qp, &m, 0);
        assert_eq!(response::<ModifyQp>(&done).status, IbStatus::Success);
    }
    let group = McastGroup {
        mgid: Gid::from_ipv4([239, 1, 2, 3]),
        mlid: Lid::UNASSIGNED,
    };
    let (membership, _) = t.issue::<AttachMcast>(qp, &group);

    // Memory: kernel pool memory, a shared region, a re-registration, a
    // physical region of a common buffer, windows.
    let block = w
        .host
        .pool()
        .alloc(support::DRIVER, *b"Disp", 4 * 4096)
        .unwrap();
    let reg = MrRegister {
        vaddr: block.va(),
        length: 4 * 4096,
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::MW_BIND,
    };
    let (mr, keys) = t.issue::<RegMr>(pd, &reg);
    let keys = keys.unwrap();
    let share = MrShare {
        pd: PdHandle::from_raw(pd),
        vaddr: 0x5000_0000,
        access: AccessFlags::LOCAL_WRITE,
    };
    let (shared, _) = t.issue::<RegSharedMr>(mr, &share);
    let rereg = MrRereg {
        translation: Some((block.va() + 4096, 4096)),
        pd: None,
        access: Some(AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND),
    };
    let (_, new_keys) = t.issue::<ReregMr>(mr, &rereg);
    assert_ne!(new_keys.unwrap().lkey, keys.lkey);
    let (_, mq) = t.issue::<QueryMr>(mr, &Empty);
    assert_eq!(mq.unwrap().length, 4096);
    let common = w.adapter_at(0).alloc_common(4096).unwrap();
    let phys = PhysMrRegister {
        iova: 0x7000_0000,
        length: 4096,
        first_byte_offset: 0,
        page_shift: 12,
        num_pages: 1,
        access: AccessFlags::LOCAL_WRITE,
    };
    let (phys_mr, phys_out, _) =
        t.issue_with::<RegPhysMr>(pd, &phys, &common.bus_address().to_le_bytes(), 0);
    assert_eq!(phys_out.unwrap().iova, 0x7000_0000);
    // Reregister Physical Memory: the region moves to the buffer's other
    // half (kernel only, from a DPC like the rest).
    let moved = PhysMrRereg {
        translation: Some(PhysTranslation {
            iova: 0x7100_0800,
            length: 2048,
            first_byte_offset: 2048,
            page_shift: 12,
            num_pages: 1,
        }),
        ..PhysMrRereg::default()
    };
    let (_, moved_out, _) =
        t.issue_with::<ReregPhysMr>(phys_mr, &moved, &common.bus_address().to_le_bytes(), 0);
    assert_eq!(moved_out.unwrap().iova, 0x7100_0800);
    let (mw, mw_out) = t.issue::<AllocMw>(
        pd,
        &MwAttr {
            mw_type: MwType::Type2,
            rkey: RKey::new(0),
        },
    );
    assert_eq!(mw_out.unwrap().mw_type, MwType::Type2);
    let (_, mw_q) = t.issue::<QueryMw>(mw, &Empty);
    assert_eq!(mw_q.unwrap().pd, PdHandle::from_raw(pd));

    // Local MAD: a SubnGet(NodeInfo) answered by the device's agent.
    let mut mad = [0u8; MAD_SIZE];
    mad[0] = 1; // base version
    mad[1] = 0x01; // subnet management, LID routed
    mad[2] = 1; // class version
    mad[3] = 0x01; // Get
    mad[16..18].copy_from_slice(&0x0011u16.to_be_bytes()); // NodeInfo
    let (_, reply) = t.issue::<LocalMad>(
        ca,
        &LocalMadIn {
            port: PortNum::new(1).unwrap(),
            mad,
        },
    );
    assert_eq!(reply.unwrap().mad[3], 0x81, "a GetResp");

    // Kernel CA: user-context verbs are answered Unsupported (the table).
    t.issue::<WaitCqEvent>(cq, &Empty);
    t.issue::<GetAsyncEvent>(ca, &Empty);

    // Teardown, every destroy from a DPC.
    t.issue::<DeallocMw>(mw, &Empty);
    let done = w.call_in_dpc::<DeregMr>(KERNEL, phys_mr, &Empty, 0);
    assert_eq!(response::<DeregMr>(&done).status, IbStatus::Success);
    let done = w.call_in_dpc::<DeregMr>(KERNEL, shared, &Empty, 0);
    assert_eq!(response::<DeregMr>(&done).status, IbStatus::Success);
    t.issue::<DeregMr>(mr, &Empty);
    t.issue::<DetachMcast>(membership, &Empty);
    t.issue::<DestroyQp>(qp, &Empty);
    t.issue::<DestroySrq>(srq, &Empty);
    t.issue::<DestroyCq>(cq, &Empty);
    t.issue::<DestroyAv>(av_handle, &Empty);
    t.issue::<DeallocPd>(pd, &Empty);
    t.issue::<CloseCa>(ca, &Empty);

    // Every verb of the ABI was issued, with the table's answer.
    let missing: Vec<&str> = VerbId::ALL
        .iter()
        .filter(|v| !t.answers.contains_key(&(**v as u16)))
        .map(|v| v.name())
        .collect();
    assert!(
        missing.is_empty(),
        "verbs not issued at DISPATCH: {missing:?}"
    );
    assert_eq!(t.answers.len(), VerbId::ALL.len());

    w.adapter_at(0).free_common(common);
    w.host.pool().free(block);
    w.finish();
}
