//! The ABI contract, frozen: the sizes and byte images that separately built
//! drivers, the user-mode library and the UVP must agree on. A failure here
//! means an ABI change: bump the version it belongs to and update the table
//! on purpose, never to make the test pass.
//!
//! Expected bytes are written out from the documented field offsets, not
//! produced by the code under test.

use ib_types::abi::Repr;
use ib_types::access::AccessFlags;
use ib_types::av::AvAttr;
use ib_types::handle::{CqHandle, PdHandle};
use ib_types::interface::{
    GUID_IB_AL_DEVICE_INTERFACE, GUID_IB_AL_INTERFACE, GUID_IB_CI_INTERFACE, GUID_IB_PORT_BUS_TYPE,
};
use ib_types::qp::{QpCaps, QpCreate, QpModify, QpState, QpType};
use ib_types::scalars::{Gid, Mtu, PortNum, Psn, Qpn};
use ib_types::status::{IbStatus, NtStatus};
use zerocopy::IntoBytes;

#[test]
fn layout_sizes_are_frozen() {
    use core::mem::size_of;
    let sizes = [
        ("AvAbi", size_of::<ib_types::av::AvAbi>(), 32),
        ("QpCapsAbi", size_of::<ib_types::qp::QpCapsAbi>(), 20),
        ("QpCreateAbi", size_of::<ib_types::qp::QpCreateAbi>(), 64),
        ("QpModifyAbi", size_of::<ib_types::qp::QpModifyAbi>(), 128),
        ("CqAttrAbi", size_of::<ib_types::cq::CqAttrAbi>(), 8),
        ("SrqCreateAbi", size_of::<ib_types::srq::SrqCreateAbi>(), 24),
        (
            "MrRegisterAbi",
            size_of::<ib_types::mr::MrRegisterAbi>(),
            24,
        ),
        (
            "PhysMrRegisterAbi",
            size_of::<ib_types::mr::PhysMrRegisterAbi>(),
            32,
        ),
        ("MrQueryAbi", size_of::<ib_types::mr::MrQueryAbi>(), 40),
        (
            "McastGroupAbi",
            size_of::<ib_types::mcast::McastGroupAbi>(),
            20,
        ),
        (
            "AsyncEventRecordAbi",
            size_of::<ib_types::event::AsyncEventRecordAbi>(),
            24,
        ),
        ("Sge", size_of::<ib_types::wr::Sge>(), 16),
        (
            "WorkCompletion",
            size_of::<ib_types::wc::WorkCompletion>(),
            40,
        ),
        ("SendWrDesc", size_of::<ib_types::wr_desc::SendWrDesc>(), 88),
        ("RecvWrDesc", size_of::<ib_types::wr_desc::RecvWrDesc>(), 24),
        ("WinGuid", size_of::<ib_types::interface::WinGuid>(), 16),
        (
            "UvpNameAbi",
            size_of::<ib_types::interface::UvpNameAbi>(),
            64,
        ),
        (
            "PortInterfaceDataAbi",
            size_of::<ib_types::interface::PortInterfaceDataAbi>(),
            24,
        ),
        (
            "CiInterface",
            size_of::<ib_types::interface::CiInterface>(),
            176,
        ),
        (
            "AlInterface",
            size_of::<ib_types::interface::AlInterface>(),
            120,
        ),
    ];
    for (name, actual, frozen) in sizes {
        assert_eq!(actual, frozen, "{name} changed size: an ABI break");
    }
}

#[test]
fn interface_guids_are_frozen() {
    let text = |g: ib_types::interface::WinGuid| g.to_string();
    assert_eq!(
        text(GUID_IB_CI_INTERFACE),
        "{d464ab57-0634-4589-a89d-ecb6a915035b}"
    );
    assert_eq!(
        text(GUID_IB_AL_INTERFACE),
        "{4f888bd5-cfd6-4341-b004-5e77989e8072}"
    );
    assert_eq!(
        text(GUID_IB_AL_DEVICE_INTERFACE),
        "{e1c2b307-5059-4d8b-8a23-04bff7dfe8b7}"
    );
    assert_eq!(
        text(GUID_IB_PORT_BUS_TYPE),
        "{edf5a7d1-5f9e-4483-beaf-f51ac27dc444}"
    );
}

/// Create QP: type at 0, sq_sig_all at 1, port at 2, handles at 8/16/24/32
/// (little-endian u64), capacities at 40 (five little-endian u32).
#[test]
fn qp_create_byte_image() {
    let create = QpCreate {
        qp_type: QpType::Ud,
        pd: PdHandle::from_raw(0x1122),
        send_cq: CqHandle::from_raw(0x33),
        recv_cq: CqHandle::from_raw(0x44),
        srq: None,
        caps: QpCaps {
            max_send_wr: 256,
            max_recv_wr: 512,
            max_send_sge: 2,
            max_recv_sge: 1,
            max_inline_data: 64,
        },
        sq_sig_all: true,
        port: None,
    };
    let mut expected = [0u8; 64];
    expected[0] = 2; // UD
    expected[1] = 1; // sq_sig_all
    expected[8..10].copy_from_slice(&[0x22, 0x11]);
    expected[16] = 0x33;
    expected[24] = 0x44;
    for (i, v) in [256u32, 512, 2, 1, 64].into_iter().enumerate() {
        expected[40 + 4 * i..44 + 4 * i].copy_from_slice(&v.to_le_bytes());
    }
    assert_eq!(create.emit().as_bytes(), &expected);
    assert_eq!(QpCreate::decode(&expected).unwrap().0, create);
}

/// Modify QP to RTR: the mask at 0 (little-endian), the state at 4, the MTU
/// code at 6, the PSN and QPN at 12 and 20 in network order (24 bits), the
/// responder resources at 34, the RNR timer at 35, the AV at 64.
#[test]
fn qp_modify_byte_image() {
    let modify = QpModify {
        state: Some(QpState::Rtr),
        av: Some(AvAttr::roce(
            PortNum::FIRST,
            Gid::from_ipv4([192, 168, 0, 9]),
            1,
        )),
        path_mtu: Some(Mtu::Mtu2048),
        dest_qpn: Some(Qpn::new(0xAB_CDEF).unwrap()),
        rq_psn: Some(Psn::new(0x01_0203).unwrap()),
        max_dest_rd_atomic: Some(4),
        min_rnr_timer: Some(12),
        ..QpModify::default()
    };
    // STATE | AV | PATH_MTU | RQ_PSN | MIN_RNR_TIMER | MAX_DEST_RD_ATOMIC | DEST_QPN
    let mask: u32 = 1 | 1 << 7 | 1 << 8 | 1 << 12 | 1 << 15 | 1 << 17 | 1 << 20;
    let mut expected = [0u8; 128];
    expected[0..4].copy_from_slice(&mask.to_le_bytes());
    expected[4] = 2; // RTR
    expected[6] = 4; // 2048
    expected[12..16].copy_from_slice(&[0, 1, 2, 3]);
    expected[20..24].copy_from_slice(&[0, 0xAB, 0xCD, 0xEF]);
    expected[34] = 4;
    expected[35] = 12;
    // AV: port 1, GRH valid, SGID index 1, DGID ::ffff:192.168.0.9, hop limit 64.
    expected[64] = 1;
    expected[64 + 6] = 1;
    expected[64 + 7] = 1;
    expected[64 + 8 + 10..64 + 8 + 16].copy_from_slice(&[0xFF, 0xFF, 192, 168, 0, 9]);
    expected[64 + 28] = 64;
    assert_eq!(modify.emit().as_bytes(), &expected);
    assert_eq!(QpModify::decode(&expected).unwrap().0, modify);
}

/// IB-specific statuses travel as customer NTSTATUS values; common ones as
/// the standard values Windows callers already test for.
#[test]
fn status_mapping_is_frozen() {
    assert_eq!(IbStatus::Success.to_ntstatus().raw(), 0);
    assert_eq!(IbStatus::Pending.to_ntstatus().raw(), 0x0000_0103);
    assert_eq!(IbStatus::InvalidParameter.to_ntstatus().raw(), 0xC000_000D);
    assert_eq!(
        IbStatus::InsufficientResources.to_ntstatus().raw(),
        0xC000_009A
    );
    let busy = IbStatus::ResourceBusy.to_ntstatus();
    assert_eq!(IbStatus::from_ntstatus(busy), IbStatus::ResourceBusy);
    let custom = IbStatus::QpInTimewait.to_ntstatus();
    assert!(custom.is_customer() && custom.is_error());
    assert_eq!(
        IbStatus::from_ntstatus(NtStatus::from_raw(custom.raw())),
        IbStatus::QpInTimewait
    );
}

/// Registration rights follow IBA C11-13 everywhere the ABI carries them.
#[test]
fn registration_rights_rule_holds_at_the_boundary() {
    let reg = ib_types::mr::MrRegister {
        vaddr: 0x1000,
        length: 0x1000,
        access: AccessFlags::REMOTE_WRITE | AccessFlags::LOCAL_WRITE,
    };
    let mut abi = reg.emit();
    assert!(ib_types::mr::MrRegister::parse(&abi).is_ok());
    abi.access = AccessFlags::REMOTE_WRITE.bits().into();
    assert!(ib_types::mr::MrRegister::parse(&abi).is_err());
}

/// Verb codes are `CTL_CODE(0x3B, 0x800 + n, METHOD_BUFFERED, access)`,
/// computed here by hand: `0x3B << 16 | access << 14 | function << 2`.
#[test]
fn verb_codes_are_frozen() {
    use ib_types::ioctl::VerbId;
    let rw = 3 << 14;
    let read = 1 << 14;
    let code = |function: u32, access: u32| 0x003B_0000 | access | function << 2;
    let frozen = [
        (VerbId::OpenCa, code(0x800, rw), 0x003B_E000),
        (VerbId::QueryCa, code(0x802, read), 0x003B_6008),
        (VerbId::CreateQp, code(0x80A, rw), 0x003B_E028),
        (VerbId::ModifyQp, code(0x80C, rw), 0x003B_E030),
        (VerbId::WaitCqEvent, code(0x820, read), 0x003B_6080),
        (VerbId::LocalMad, code(0x823, rw), 0x003B_E08C),
        (VerbId::ReregPhysMr, code(0x824, rw), 0x003B_E090),
    ];
    for (verb, computed, literal) in frozen {
        assert_eq!(computed, literal, "the hand computation itself");
        assert_eq!(verb.ioctl().raw(), literal, "{} changed code", verb.name());
    }
    assert_eq!(VerbId::ALL.len(), 37, "verbs are only ever appended");
    assert!(!VerbId::LocalMad.user_mode_allowed());
    assert!(!VerbId::RegPhysMr.user_mode_allowed());
    assert!(!VerbId::ReregPhysMr.user_mode_allowed());
}
