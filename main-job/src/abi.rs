//! The stack's ABI contract, checked (what the main job showed before the
//! simulated platform existed; now one line of its report, the full
//! tables with `--abi`): the contract the Windows build and user-mode
//! clients must agree on.
//!
//! Checks (each failure is collected and reported, not panicked on):
//! - every proxy/CI verb code decodes back to its verb, with our device type,
//!   buffered transfer and the verb's declared access;
//! - an RC and a UD QP walk RESET -> INIT -> RTR -> RTS through the state
//!   machine, and every illegal jump out of RESET is refused;
//! - a two-port CA attribute block encodes to exactly the guide's 6.1.2 size
//!   and decodes back to the same values.

use std::fmt::Write as _;

use ib_types::ca::{CaAttrHeaderAbi, PortAttrAbi};
use ib_types::qp::{QpModify, QpState, QpType};
use ib_types::qp_state::{attr_rule, check_modify};

type Problems = Vec<String>;

/// Appends a line to the report text (writing to a `String` cannot fail).
macro_rules! say {
    ($out:expr, $($arg:tt)*) => {{
        let _ = writeln!($out, $($arg)*);
    }};
}

/// What the contract check found.
#[derive(Debug, Default)]
pub struct AbiReport {
    /// The full tables: layouts, verbs, state transitions, bring-up, CA
    /// attributes.
    pub text: String,
    /// Verb codes checked.
    pub verbs: usize,
    /// What is wrong, if anything.
    pub problems: Vec<String>,
}

/// Checks the contract and writes its tables.
pub fn check() -> AbiReport {
    let mut problems = Problems::new();
    let mut text = String::new();
    print_layouts(&mut text);
    print_state_machine(&mut text);
    check_verbs(&mut text, &mut problems);
    check_bring_up(&mut text, &mut problems);
    check_ca_attributes(&mut text, &mut problems);
    AbiReport {
        text,
        verbs: ib_types::ioctl::VerbId::ALL.len(),
        problems,
    }
}

/// Sizes of the ABI layouts, for comparison with a C view of the contract.
fn print_layouts(out: &mut String) {
    macro_rules! layouts {
        ($($ty:path),+ $(,)?) => {{
            say!(out, "== ABI layouts (bytes) ==");
            $(
                say!(out, "  {:<40} {:>5}", stringify!($ty), core::mem::size_of::<$ty>());
            )+
        }};
    }
    layouts!(
        ib_types::av::AvAbi,
        ib_types::qp::QpCapsAbi,
        ib_types::qp::QpCreateAbi,
        ib_types::qp::QpModifyAbi,
        ib_types::cq::CqAttrAbi,
        ib_types::cq::CqNotifyAbi,
        ib_types::srq::SrqAttrAbi,
        ib_types::srq::SrqCreateAbi,
        ib_types::srq::SrqModifyAbi,
        ib_types::mr::MrRegisterAbi,
        ib_types::mr::PhysMrRegisterAbi,
        ib_types::mr::MrShareAbi,
        ib_types::mr::MrReregAbi,
        ib_types::mr::MrQueryAbi,
        ib_types::mr::MrKeys,
        ib_types::mr::MwAttrAbi,
        ib_types::mcast::McastGroupAbi,
        ib_types::event::AsyncEventRecordAbi,
        ib_types::wr::Sge,
        ib_types::wc::WorkCompletion,
        ib_types::wr_desc::SendWrDesc,
        ib_types::wr_desc::RecvWrDesc,
        CaAttrHeaderAbi,
        PortAttrAbi,
        ib_types::ca::CaModifyAbi,
        ib_types::interface::WinGuid,
        ib_types::interface::UvpNameAbi,
        ib_types::interface::PortInterfaceDataAbi,
        ib_types::interface::InterfaceHeader,
        ib_types::interface::CiInterface,
        ib_types::interface::AlInterface,
    );
}

/// The verbs table: every code, decoded, with its buffer sizes and policy.
fn check_verbs(out: &mut String, problems: &mut Problems) {
    use ib_types::ioctl::{
        FILE_DEVICE_INFINIBAND, REQUEST_HEADER_SIZE, RESPONSE_HEADER_SIZE, TransferMethod, VerbId,
    };

    say!(out, "== Verbs (proxy IOCTLs and CI/AL submit codes) ==");
    say!(
        out,
        "  {:<14} {:>10} {:>5} {:<10} {:<6} {:>6} {:>6}",
        "verb",
        "code",
        "fn",
        "access",
        "caller",
        "in",
        "out"
    );
    let mut seen = std::collections::HashSet::new();
    for &verb in VerbId::ALL {
        let code = verb.ioctl();
        say!(
            out,
            "  {:<14} {:#010x} {:#05x} {:<10} {:<6} {:>6} {:>6}",
            verb.name(),
            code.raw(),
            code.function(),
            access_text(code.access()),
            if verb.user_mode_allowed() {
                "user"
            } else {
                "kernel"
            },
            REQUEST_HEADER_SIZE + verb.in_size(),
            RESPONSE_HEADER_SIZE + verb.out_size(),
        );
        if !seen.insert(code.raw()) {
            problems.push(format!(
                "{}: code {:#x} used twice",
                verb.name(),
                code.raw()
            ));
        }
        if VerbId::from_ioctl(code) != Ok(verb) {
            problems.push(format!("{}: code does not decode back", verb.name()));
        }
        if code.device_type() != FILE_DEVICE_INFINIBAND || code.method() != TransferMethod::Buffered
        {
            problems.push(format!("{}: not a buffered InfiniBand code", verb.name()));
        }
    }
    say!(
        out,
        "  (sizes include the 16-byte request/response headers; private bytes follow)"
    );
}

/// `read`, `read+write` or `any`.
fn access_text(access: ib_types::ioctl::RequiredAccess) -> &'static str {
    use ib_types::ioctl::RequiredAccess;
    match (
        access.contains(RequiredAccess::READ),
        access.contains(RequiredAccess::WRITE),
    ) {
        (true, true) => "read+write",
        (true, false) => "read",
        (false, true) => "write",
        (false, false) => "any",
    }
}

/// IBA Table 91 as this stack implements it.
fn print_state_machine(out: &mut String) {
    say!(out, "== QP state transitions (IBA Table 91) ==");
    for &qp_type in QpType::ALL {
        say!(out, "{qp_type:?}:");
        for &from in QpState::ALL {
            for &to in QpState::ALL {
                if let Some(rule) = attr_rule(qp_type, from, to) {
                    say!(
                        out,
                        "  {:<5} -> {:<5} required {}; optional {}",
                        format!("{from:?}"),
                        format!("{to:?}"),
                        mask_names(rule.required),
                        mask_names(rule.optional)
                    );
                }
            }
        }
    }
}

/// Walks an RC and a UD QP to RTS, and checks RESET refuses every jump.
fn check_bring_up(out: &mut String, problems: &mut Problems) {
    use ib_types::access::AccessFlags;
    use ib_types::av::AvAttr;
    use ib_types::scalars::{Gid, Mtu, PortNum, Psn, QKey, Qpn};

    let port = PortNum::FIRST;
    let psn = Psn::new(0x12_3456).expect("24-bit");
    let rc = [
        QpModify {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(port),
            access: Some(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ),
            ..QpModify::default()
        },
        QpModify {
            state: Some(QpState::Rtr),
            av: Some(AvAttr::roce(port, Gid::from_ipv4([10, 0, 0, 2]), 0)),
            path_mtu: Some(Mtu::Mtu4096),
            dest_qpn: Some(Qpn::new(0x42).expect("24-bit")),
            rq_psn: Some(psn),
            max_dest_rd_atomic: Some(16),
            min_rnr_timer: Some(12),
            ..QpModify::default()
        },
        QpModify {
            state: Some(QpState::Rts),
            timeout: Some(14),
            retry_cnt: Some(7),
            rnr_retry: Some(7),
            sq_psn: Some(psn),
            max_rd_atomic: Some(16),
            ..QpModify::default()
        },
    ];
    let ud = [
        QpModify {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(port),
            qkey: Some(QKey::new(0x1111_1111)),
            ..QpModify::default()
        },
        QpModify::to_state(QpState::Rtr),
        QpModify {
            state: Some(QpState::Rts),
            sq_psn: Some(psn),
            ..QpModify::default()
        },
    ];
    say!(out, "== QP bring-up through the validator ==");
    for (qp_type, steps) in [(QpType::Rc, &rc), (QpType::Ud, &ud)] {
        let mut state = QpState::Reset;
        for step in steps {
            match check_modify(qp_type, state, step) {
                Ok(next) => {
                    say!(
                        out,
                        "  {qp_type:?}: {state:?} -> {next:?} with {}",
                        mask_names(step.mask())
                    );
                    state = next;
                }
                Err(e) => problems.push(format!("{qp_type:?} bring-up refused: {e}")),
            }
        }
        if state != QpState::Rts {
            problems.push(format!("{qp_type:?} ended in {state:?}, not RTS"));
        }
        for to in [QpState::Rtr, QpState::Rts, QpState::Sqd, QpState::Sqe] {
            if check_modify(qp_type, QpState::Reset, &QpModify::to_state(to)).is_ok() {
                problems.push(format!("{qp_type:?}: RESET -> {to:?} was accepted"));
            }
        }
    }
}

/// `A|B|C`, or `-` for the empty mask.
fn mask_names(mask: ib_types::qp::QpAttrMask) -> String {
    let names: Vec<&str> = mask.iter_names().map(|(name, _)| name).collect();
    if names.is_empty() {
        "-".into()
    } else {
        names.join("|")
    }
}

/// Encodes a two-port RoCEv2 CA's attributes (guide 6.1.2 layout), checks
/// the size against the guide's formula, and decodes them back.
fn check_ca_attributes(out: &mut String, problems: &mut Problems) {
    use ib_types::ca::{
        Atomicity, CaAttr, CaAttrParts, CaAttrView, CaCaps, CaLayout, CaLimits, PortAttr, PortCaps,
        PortData, PortTables,
    };
    use ib_types::scalars::{
        Gid, Lid, LinkLayer, Mtu, NodeGuid, PKey, PortGuid, PortNum, PortState, SystemImageGuid,
    };

    let guid = 0x0200_00ff_fe00_0100_u64;
    let attr = CaAttr {
        node_guid: NodeGuid::new(guid),
        system_image_guid: SystemImageGuid::new(guid),
        vendor_id: 0x00_0000,
        device_id: 0x0001,
        revision: 1,
        fw_version: 0x0001_0000,
        limits: CaLimits {
            max_qps: 1 << 16,
            max_wrs_per_qp: 1 << 14,
            max_sges: 16,
            max_cqs: 1 << 16,
            max_cqes: 1 << 22,
            max_mr_size: 1 << 40,
            ..CaLimits::default()
        },
        local_ack_delay: 8,
        atomicity: Atomicity::Hca,
        caps: CaCaps::RC | CaCaps::UC | CaCaps::UD | CaCaps::SRQ | CaCaps::PORT_ACTIVE_EVENT,
        layout: CaLayout::default(),
    };
    let port = |n: u8| PortAttr {
        port_num: PortNum::new(n).expect("ports start at 1"),
        link_layer: LinkLayer::Ethernet,
        state: PortState::Active,
        active_mtu: Mtu::Mtu4096,
        max_mtu: Mtu::Mtu4096,
        port_guid: PortGuid::new(guid + u64::from(n)),
        lid: Lid::UNASSIGNED,
        lmc: 0,
        sm_lid: Lid::UNASSIGNED,
        sm_sl: 0,
        subnet_timeout: 18,
        max_msg_size: 1 << 31,
        caps: PortCaps::IS_CM,
        qkey_violations: 0,
        pkey_violations: 0,
        tables: PortTables::default(),
    };
    let pkeys = [PKey::DEFAULT, PKey::new(0x8001)];
    let gids_1 = [Gid::from_ipv4([10, 0, 0, 1])];
    let gids_2 = [
        Gid::from_ipv4([10, 0, 1, 1]),
        Gid::from_parts(Gid::LINK_LOCAL_PREFIX, guid),
    ];
    let ports = [
        PortData {
            attr: port(1),
            pkeys: &pkeys,
            gids: &gids_1,
        },
        PortData {
            attr: port(2),
            pkeys: &pkeys[..1],
            gids: &gids_2,
        },
    ];
    let parts = CaAttrParts {
        attr,
        page_sizes: &[4096, 2 << 20],
        ports: &ports,
        vendor_data: &[],
    };

    say!(out, "== CA attributes (guide 6.1.2 layout) ==");
    let header = core::mem::size_of::<CaAttrHeaderAbi>();
    let port_record = core::mem::size_of::<PortAttrAbi>();
    // The guide's formula, written out independently of the encoder.
    let formula = header + 2 * 4 + 2 * port_record + (2 + 1) * 2 + (1 + 2) * 16;
    let mut buf = vec![0u8; formula];
    match parts.encode(&mut buf) {
        Ok(written) if written == formula => {
            say!(out, "  2 ports: {written} bytes, as the formula says")
        }
        Ok(written) => problems.push(format!("CA attributes: wrote {written}, formula {formula}")),
        Err(e) => problems.push(format!("CA attributes did not encode: {e}")),
    }
    match CaAttrView::parse(&buf) {
        Ok(view) => {
            let gid_counts: Vec<usize> = view.ports().map(|p| p.gids().len()).collect();
            say!(
                out,
                "  decoded: {} ports, GIDs per port {gid_counts:?}",
                view.ports().count()
            );
            if view.attr().node_guid != attr.node_guid || gid_counts != [1, 2] {
                problems.push("CA attributes decoded to different values".into());
            }
            if view
                .port(PortNum::new(2).expect("port 2"))
                .map(|p| p.gids()[0])
                != Some(gids_2[0])
            {
                problems.push("port 2's first GID did not survive the round trip".into());
            }
        }
        Err(e) => problems.push(format!("CA attributes did not decode: {e}")),
    }
}
