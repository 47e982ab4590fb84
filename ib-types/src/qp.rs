//! Queue pair types, states, creation attributes and the attributes of a
//! Modify QP (IBA 11.2.4, 11.2.5).
//!
//! [`QpModify`] holds one `Option` per attribute, so the attribute mask is
//! derived from which attributes are present and can never disagree with
//! them. In the ABI the mask travels explicitly; attributes outside it must be
//! zero. Whether a modify is legal for a QP's type and state is decided by
//! [`crate::qp_state`].

use bitflags::bitflags;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::abi::{AbiError, Be32, Le16, Le32, Repr, ensure_zero, parse_bool};
use crate::access::AccessFlags;
use crate::av::{AvAbi, AvAttr};
use crate::handle::{CqHandle, PdHandle, SrqHandle};
use crate::scalars::{Mtu, PortNum, Psn, QKey, Qpn};

code_enum! {
    /// The transport service of a QP. Reliable datagram is not supported.
    pub enum QpType: u8 {
        /// Reliable connected.
        Rc = 0,
        /// Unreliable connected.
        Uc = 1,
        /// Unreliable datagram.
        Ud = 2,
        /// QP0 of a port: subnet management (datagram).
        Smi = 3,
        /// QP1 of a port: general services (datagram).
        Gsi = 4,
    }
}

impl QpType {
    /// Connected QPs talk to exactly one peer QP.
    pub const fn is_connected(self) -> bool {
        matches!(self, Self::Rc | Self::Uc)
    }

    /// Special QPs (QP0/QP1) exist once per port.
    pub const fn is_special(self) -> bool {
        matches!(self, Self::Smi | Self::Gsi)
    }
}

code_enum! {
    /// QP states (IBA 10.3.1).
    pub enum QpState: u8 {
        /// Reset: no work is processed; posted WRs are not accepted.
        Reset = 0,
        /// Initialized: receives may be posted, nothing is processed.
        Init = 1,
        /// Ready to receive.
        Rtr = 2,
        /// Ready to send.
        Rts = 3,
        /// Send queue drain(ing/ed).
        Sqd = 4,
        /// Send queue error (UC and UD only).
        Sqe = 5,
        /// Error: all work completes with a flush error.
        Err = 6,
    }
}

impl QpState {
    /// Whether Post Send is accepted in this state (guide 8.1.1: an
    /// immediate error in Reset, Init and RTR; in SQE and Error the WR is
    /// accepted and completes with a flush error).
    pub const fn accepts_send(self) -> bool {
        !matches!(self, Self::Reset | Self::Init | Self::Rtr)
    }

    /// Whether Post Receive is accepted in this state (all but Reset).
    pub const fn accepts_recv(self) -> bool {
        !matches!(self, Self::Reset)
    }
}

code_enum! {
    /// Automatic path migration state (IBA 17.2.8).
    pub enum PathMigState: u8 {
        /// Migrated: the alternate path is not loaded.
        Migrated = 0,
        /// Rearm: the alternate path is being loaded.
        Rearm = 1,
        /// Armed: ready to migrate.
        Armed = 2,
    }
}

bitflags! {
    /// Which attributes a Modify QP carries (IBA 11.2.5.2 Table 91 names).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct QpAttrMask: u32 {
        /// Next state.
        const STATE = 1 << 0;
        /// The consumer's idea of the current state.
        const CUR_STATE = 1 << 1;
        /// Raise an async event when the SQ has drained.
        const EN_SQD_ASYNC_NOTIFY = 1 << 2;
        /// Remote access rights of the QP.
        const ACCESS_FLAGS = 1 << 3;
        /// Primary P_Key index.
        const PKEY_INDEX = 1 << 4;
        /// Primary port.
        const PORT = 1 << 5;
        /// Q_Key (datagram QPs).
        const QKEY = 1 << 6;
        /// Primary path address vector.
        const AV = 1 << 7;
        /// Path MTU.
        const PATH_MTU = 1 << 8;
        /// Local ACK timeout.
        const TIMEOUT = 1 << 9;
        /// Transport retry count.
        const RETRY_CNT = 1 << 10;
        /// RNR retry count.
        const RNR_RETRY = 1 << 11;
        /// Receive PSN.
        const RQ_PSN = 1 << 12;
        /// Outstanding RDMA reads/atomics as initiator.
        const MAX_QP_RD_ATOMIC = 1 << 13;
        /// Alternate path (address vector, P_Key index, timeout).
        const ALT_PATH = 1 << 14;
        /// Minimum RNR NAK timer.
        const MIN_RNR_TIMER = 1 << 15;
        /// Send PSN.
        const SQ_PSN = 1 << 16;
        /// Outstanding RDMA reads/atomics as responder.
        const MAX_DEST_RD_ATOMIC = 1 << 17;
        /// Path migration state.
        const PATH_MIG_STATE = 1 << 18;
        /// Queue capacities (resize WQs).
        const CAP = 1 << 19;
        /// Destination QP number.
        const DEST_QPN = 1 << 20;
    }
}

/// Work queue capacities.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct QpCaps {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth (0 when the QP uses an SRQ).
    pub max_recv_wr: u32,
    /// Scatter/gather entries per send WR.
    pub max_send_sge: u32,
    /// Scatter/gather entries per receive WR.
    pub max_recv_sge: u32,
    /// Largest inline send payload in bytes.
    pub max_inline_data: u32,
}

/// ABI layout of [`QpCaps`]: 20 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct QpCapsAbi {
    /// Send queue depth.
    pub max_send_wr: Le32,
    /// Receive queue depth.
    pub max_recv_wr: Le32,
    /// SGEs per send WR.
    pub max_send_sge: Le32,
    /// SGEs per receive WR.
    pub max_recv_sge: Le32,
    /// Inline bytes.
    pub max_inline_data: Le32,
}

assert_layout!(QpCapsAbi, size = 20, max_send_wr @ 0, max_recv_wr @ 4,
    max_send_sge @ 8, max_recv_sge @ 12, max_inline_data @ 16);

impl Repr for QpCaps {
    type Abi = QpCapsAbi;

    fn parse(abi: &QpCapsAbi) -> Result<Self, AbiError> {
        Ok(Self {
            max_send_wr: abi.max_send_wr.get(),
            max_recv_wr: abi.max_recv_wr.get(),
            max_send_sge: abi.max_send_sge.get(),
            max_recv_sge: abi.max_recv_sge.get(),
            max_inline_data: abi.max_inline_data.get(),
        })
    }

    fn emit(&self) -> QpCapsAbi {
        QpCapsAbi {
            max_send_wr: Le32::new(self.max_send_wr),
            max_recv_wr: Le32::new(self.max_recv_wr),
            max_send_sge: Le32::new(self.max_send_sge),
            max_recv_sge: Le32::new(self.max_recv_sge),
            max_inline_data: Le32::new(self.max_inline_data),
        }
    }
}

/// Create QP attributes (IBA 11.2.5.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QpCreate {
    /// Transport service.
    pub qp_type: QpType,
    /// Protection domain.
    pub pd: PdHandle,
    /// CQ for send completions.
    pub send_cq: CqHandle,
    /// CQ for receive completions.
    pub recv_cq: CqHandle,
    /// Shared receive queue, if receives come from one.
    pub srq: Option<SrqHandle>,
    /// Requested capacities; the provider may round up and reports the
    /// actual values.
    pub caps: QpCaps,
    /// Every send WR completes signaled, whatever its flags.
    pub sq_sig_all: bool,
    /// The port of a special QP (SMI/GSI); `None` for other types.
    pub port: Option<PortNum>,
}

/// ABI layout of [`QpCreate`]: 64 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct QpCreateAbi {
    /// [`QpType`] code.
    pub qp_type: u8,
    /// 0 or 1.
    pub sq_sig_all: u8,
    /// Port of a special QP, else 0.
    pub port_num: u8,
    /// Reserved, zero.
    pub reserved_at_0x3: [u8; 5],
    /// Protection domain.
    pub pd: PdHandle,
    /// Send CQ.
    pub send_cq: CqHandle,
    /// Receive CQ.
    pub recv_cq: CqHandle,
    /// SRQ, or null.
    pub srq: SrqHandle,
    /// Capacities.
    pub caps: QpCapsAbi,
    /// Reserved, zero.
    pub reserved_at_0x3c: [u8; 4],
}

assert_layout!(QpCreateAbi, size = 64, qp_type @ 0, sq_sig_all @ 1, port_num @ 2,
    reserved_at_0x3 @ 3, pd @ 8, send_cq @ 16, recv_cq @ 24, srq @ 32, caps @ 40,
    reserved_at_0x3c @ 60);

impl Repr for QpCreate {
    type Abi = QpCreateAbi;

    fn parse(abi: &QpCreateAbi) -> Result<Self, AbiError> {
        ensure_zero("QpCreateAbi.reserved_at_0x3", &abi.reserved_at_0x3)?;
        ensure_zero("QpCreateAbi.reserved_at_0x3c", &abi.reserved_at_0x3c)?;
        let qp_type = QpType::from_code(abi.qp_type)?;
        let port = match (qp_type.is_special(), abi.port_num) {
            (true, n) => Some(PortNum::new(n)?),
            (false, 0) => None,
            (false, n) => {
                return Err(AbiError::OutOfRange {
                    field: "QpCreateAbi.port_num (not a special QP)",
                    value: n.into(),
                });
            }
        };
        for (field, handle) in [
            ("QpCreateAbi.pd", abi.pd.raw()),
            ("QpCreateAbi.send_cq", abi.send_cq.raw()),
            ("QpCreateAbi.recv_cq", abi.recv_cq.raw()),
        ] {
            if handle == 0 {
                return Err(AbiError::OutOfRange { field, value: 0 });
            }
        }
        let caps = QpCaps::parse(&abi.caps)?;
        let srq = (!abi.srq.is_null()).then_some(abi.srq);
        if srq.is_some() && (caps.max_recv_wr != 0 || caps.max_recv_sge != 0) {
            return Err(AbiError::OutOfRange {
                field: "QpCreateAbi.caps (receive queue with an SRQ)",
                value: caps.max_recv_wr.into(),
            });
        }
        Ok(Self {
            qp_type,
            pd: abi.pd,
            send_cq: abi.send_cq,
            recv_cq: abi.recv_cq,
            srq,
            caps,
            sq_sig_all: parse_bool("QpCreateAbi.sq_sig_all", abi.sq_sig_all)?,
            port,
        })
    }

    fn emit(&self) -> QpCreateAbi {
        QpCreateAbi {
            qp_type: self.qp_type.code(),
            sq_sig_all: self.sq_sig_all.into(),
            port_num: self.port.map_or(0, PortNum::get),
            pd: self.pd,
            send_cq: self.send_cq,
            recv_cq: self.recv_cq,
            srq: self.srq.unwrap_or(SrqHandle::NULL),
            caps: self.caps.emit(),
            ..QpCreateAbi::default()
        }
    }
}

/// An alternate path for automatic path migration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AltPath {
    /// Address vector (its port is the alternate port).
    pub av: AvAttr,
    /// P_Key index on the alternate port.
    pub pkey_index: u16,
    /// Local ACK timeout on the alternate path (0..=31).
    pub timeout: u8,
}

/// The attributes of a Modify QP; present attributes form the mask.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct QpModify {
    /// Next state; absent means "stay in the current state".
    pub state: Option<QpState>,
    /// The state the consumer believes the QP is in.
    pub cur_state: Option<QpState>,
    /// Ask for an async event once the SQ has drained (to SQD).
    pub en_sqd_async_notify: Option<bool>,
    /// Remote access rights allowed on the QP.
    pub access: Option<AccessFlags>,
    /// Primary P_Key index.
    pub pkey_index: Option<u16>,
    /// Primary port.
    pub port: Option<PortNum>,
    /// Q_Key.
    pub qkey: Option<QKey>,
    /// Primary path.
    pub av: Option<AvAttr>,
    /// Path MTU.
    pub path_mtu: Option<Mtu>,
    /// Local ACK timeout exponent, 0..=31 (4.096 us * 2^timeout; 0 = none).
    pub timeout: Option<u8>,
    /// Transport retries, 0..=7.
    pub retry_cnt: Option<u8>,
    /// RNR retries, 0..=7 (7 = retry forever).
    pub rnr_retry: Option<u8>,
    /// Expected PSN of the next incoming request.
    pub rq_psn: Option<Psn>,
    /// Outstanding RDMA reads/atomics as initiator.
    pub max_rd_atomic: Option<u8>,
    /// Alternate path.
    pub alt_path: Option<AltPath>,
    /// Minimum RNR NAK timer code, 0..=31.
    pub min_rnr_timer: Option<u8>,
    /// PSN of the next outgoing request.
    pub sq_psn: Option<Psn>,
    /// Outstanding RDMA reads/atomics as responder.
    pub max_dest_rd_atomic: Option<u8>,
    /// Path migration state.
    pub path_mig_state: Option<PathMigState>,
    /// New capacities.
    pub cap: Option<QpCaps>,
    /// Destination QP.
    pub dest_qpn: Option<Qpn>,
}

impl QpModify {
    /// Largest ACK timeout and RNR timer codes (5 bits).
    pub const MAX_TIMER_CODE: u8 = 31;
    /// Largest retry counts (3 bits).
    pub const MAX_RETRY: u8 = 7;

    /// A modify that only moves the QP to `state`.
    pub fn to_state(state: QpState) -> Self {
        Self {
            state: Some(state),
            ..Self::default()
        }
    }

    /// The attribute mask: exactly the attributes present.
    pub fn mask(&self) -> QpAttrMask {
        let present = [
            (self.state.is_some(), QpAttrMask::STATE),
            (self.cur_state.is_some(), QpAttrMask::CUR_STATE),
            (
                self.en_sqd_async_notify.is_some(),
                QpAttrMask::EN_SQD_ASYNC_NOTIFY,
            ),
            (self.access.is_some(), QpAttrMask::ACCESS_FLAGS),
            (self.pkey_index.is_some(), QpAttrMask::PKEY_INDEX),
            (self.port.is_some(), QpAttrMask::PORT),
            (self.qkey.is_some(), QpAttrMask::QKEY),
            (self.av.is_some(), QpAttrMask::AV),
            (self.path_mtu.is_some(), QpAttrMask::PATH_MTU),
            (self.timeout.is_some(), QpAttrMask::TIMEOUT),
            (self.retry_cnt.is_some(), QpAttrMask::RETRY_CNT),
            (self.rnr_retry.is_some(), QpAttrMask::RNR_RETRY),
            (self.rq_psn.is_some(), QpAttrMask::RQ_PSN),
            (self.max_rd_atomic.is_some(), QpAttrMask::MAX_QP_RD_ATOMIC),
            (self.alt_path.is_some(), QpAttrMask::ALT_PATH),
            (self.min_rnr_timer.is_some(), QpAttrMask::MIN_RNR_TIMER),
            (self.sq_psn.is_some(), QpAttrMask::SQ_PSN),
            (
                self.max_dest_rd_atomic.is_some(),
                QpAttrMask::MAX_DEST_RD_ATOMIC,
            ),
            (self.path_mig_state.is_some(), QpAttrMask::PATH_MIG_STATE),
            (self.cap.is_some(), QpAttrMask::CAP),
            (self.dest_qpn.is_some(), QpAttrMask::DEST_QPN),
        ];
        present
            .into_iter()
            .filter(|(is_present, _)| *is_present)
            .fold(QpAttrMask::empty(), |mask, (_, bit)| mask | bit)
    }
}

/// ABI layout of [`QpModify`]: 128 bytes. Attributes outside `attr_mask`
/// must be zero.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct QpModifyAbi {
    /// [`QpAttrMask`] bits.
    pub attr_mask: Le32,
    /// [`QpState`] code.
    pub qp_state: u8,
    /// [`QpState`] code.
    pub cur_qp_state: u8,
    /// [`Mtu`] code.
    pub path_mtu: u8,
    /// [`PathMigState`] code.
    pub path_mig_state: u8,
    /// Q_Key.
    pub qkey: QKey,
    /// Receive PSN, 24 bits.
    pub rq_psn: Be32,
    /// Send PSN, 24 bits.
    pub sq_psn: Be32,
    /// Destination QPN, 24 bits.
    pub dest_qpn: Be32,
    /// [`AccessFlags`] bits.
    pub access_flags: Le32,
    /// Primary P_Key index.
    pub pkey_index: Le16,
    /// Alternate P_Key index.
    pub alt_pkey_index: Le16,
    /// 0 or 1.
    pub en_sqd_async_notify: u8,
    /// Initiator depth.
    pub max_rd_atomic: u8,
    /// Responder resources.
    pub max_dest_rd_atomic: u8,
    /// RNR timer code.
    pub min_rnr_timer: u8,
    /// Primary port.
    pub port_num: u8,
    /// ACK timeout code.
    pub timeout: u8,
    /// Retry count.
    pub retry_cnt: u8,
    /// RNR retry count.
    pub rnr_retry: u8,
    /// Alternate path ACK timeout code.
    pub alt_timeout: u8,
    /// Reserved, zero.
    pub reserved_at_0x29: [u8; 3],
    /// Capacities.
    pub cap: QpCapsAbi,
    /// Primary path.
    pub av: AvAbi,
    /// Alternate path.
    pub alt_av: AvAbi,
}

assert_layout!(QpModifyAbi, size = 128,
    attr_mask @ 0, qp_state @ 4, cur_qp_state @ 5, path_mtu @ 6, path_mig_state @ 7,
    qkey @ 8, rq_psn @ 12, sq_psn @ 16, dest_qpn @ 20, access_flags @ 24,
    pkey_index @ 28, alt_pkey_index @ 30, en_sqd_async_notify @ 32, max_rd_atomic @ 33,
    max_dest_rd_atomic @ 34, min_rnr_timer @ 35, port_num @ 36, timeout @ 37,
    retry_cnt @ 38, rnr_retry @ 39, alt_timeout @ 40, reserved_at_0x29 @ 41,
    cap @ 44, av @ 64, alt_av @ 96);

/// `Some(parse(raw))` when `bit` is in `mask`, else `None`.
fn masked<T>(
    mask: QpAttrMask,
    bit: QpAttrMask,
    parse: impl FnOnce() -> Result<T, AbiError>,
) -> Result<Option<T>, AbiError> {
    if mask.contains(bit) {
        parse().map(Some)
    } else {
        Ok(None)
    }
}

fn bounded(field: &'static str, value: u8, max: u8) -> Result<u8, AbiError> {
    if value <= max {
        Ok(value)
    } else {
        Err(AbiError::OutOfRange {
            field,
            value: value.into(),
        })
    }
}

impl Repr for QpModify {
    type Abi = QpModifyAbi;

    fn parse(abi: &QpModifyAbi) -> Result<Self, AbiError> {
        use QpAttrMask as M;
        let mask = QpAttrMask::from_bits(abi.attr_mask.get()).ok_or(AbiError::ReservedNotZero {
            field: "QpModifyAbi.attr_mask",
        })?;
        let timer = Self::MAX_TIMER_CODE;
        let modify = Self {
            state: masked(mask, M::STATE, || QpState::from_code(abi.qp_state))?,
            cur_state: masked(mask, M::CUR_STATE, || QpState::from_code(abi.cur_qp_state))?,
            en_sqd_async_notify: masked(mask, M::EN_SQD_ASYNC_NOTIFY, || {
                parse_bool("QpModifyAbi.en_sqd_async_notify", abi.en_sqd_async_notify)
            })?,
            access: masked(mask, M::ACCESS_FLAGS, || {
                AccessFlags::from_raw(abi.access_flags.get())
            })?,
            pkey_index: masked(mask, M::PKEY_INDEX, || Ok(abi.pkey_index.get()))?,
            port: masked(mask, M::PORT, || PortNum::new(abi.port_num))?,
            qkey: masked(mask, M::QKEY, || Ok(abi.qkey))?,
            av: masked(mask, M::AV, || AvAttr::parse(&abi.av))?,
            path_mtu: masked(mask, M::PATH_MTU, || Mtu::from_code(abi.path_mtu))?,
            timeout: masked(mask, M::TIMEOUT, || {
                bounded("QpModifyAbi.timeout", abi.timeout, timer)
            })?,
            retry_cnt: masked(mask, M::RETRY_CNT, || {
                bounded("QpModifyAbi.retry_cnt", abi.retry_cnt, Self::MAX_RETRY)
            })?,
            rnr_retry: masked(mask, M::RNR_RETRY, || {
                bounded("QpModifyAbi.rnr_retry", abi.rnr_retry, Self::MAX_RETRY)
            })?,
            rq_psn: masked(mask, M::RQ_PSN, || Psn::from_be(abi.rq_psn))?,
            max_rd_atomic: masked(mask, M::MAX_QP_RD_ATOMIC, || Ok(abi.max_rd_atomic))?,
            alt_path: masked(mask, M::ALT_PATH, || {
                Ok(AltPath {
                    av: AvAttr::parse(&abi.alt_av)?,
                    pkey_index: abi.alt_pkey_index.get(),
                    timeout: bounded("QpModifyAbi.alt_timeout", abi.alt_timeout, timer)?,
                })
            })?,
            min_rnr_timer: masked(mask, M::MIN_RNR_TIMER, || {
                bounded("QpModifyAbi.min_rnr_timer", abi.min_rnr_timer, timer)
            })?,
            sq_psn: masked(mask, M::SQ_PSN, || Psn::from_be(abi.sq_psn))?,
            max_dest_rd_atomic: masked(mask, M::MAX_DEST_RD_ATOMIC, || Ok(abi.max_dest_rd_atomic))?,
            path_mig_state: masked(mask, M::PATH_MIG_STATE, || {
                PathMigState::from_code(abi.path_mig_state)
            })?,
            cap: masked(mask, M::CAP, || QpCaps::parse(&abi.cap))?,
            dest_qpn: masked(mask, M::DEST_QPN, || Qpn::from_be(abi.dest_qpn))?,
        };
        // Everything outside the mask (and the reserved bytes) must be zero:
        // the canonical re-emission must reproduce the input exactly.
        if modify.emit().as_bytes() != abi.as_bytes() {
            return Err(AbiError::ReservedNotZero {
                field: "QpModifyAbi (attribute outside attr_mask, or reserved)",
            });
        }
        Ok(modify)
    }

    fn emit(&self) -> QpModifyAbi {
        let mut abi = QpModifyAbi {
            attr_mask: Le32::new(self.mask().bits()),
            ..QpModifyAbi::default()
        };
        if let Some(s) = self.state {
            abi.qp_state = s.code();
        }
        if let Some(s) = self.cur_state {
            abi.cur_qp_state = s.code();
        }
        if let Some(n) = self.en_sqd_async_notify {
            abi.en_sqd_async_notify = n.into();
        }
        if let Some(a) = self.access {
            abi.access_flags = Le32::new(a.bits());
        }
        if let Some(i) = self.pkey_index {
            abi.pkey_index = Le16::new(i);
        }
        if let Some(p) = self.port {
            abi.port_num = p.get();
        }
        if let Some(k) = self.qkey {
            abi.qkey = k;
        }
        if let Some(av) = self.av {
            abi.av = av.emit();
        }
        if let Some(m) = self.path_mtu {
            abi.path_mtu = m.code();
        }
        abi.timeout = self.timeout.unwrap_or(0);
        abi.retry_cnt = self.retry_cnt.unwrap_or(0);
        abi.rnr_retry = self.rnr_retry.unwrap_or(0);
        if let Some(p) = self.rq_psn {
            abi.rq_psn = p.to_be();
        }
        abi.max_rd_atomic = self.max_rd_atomic.unwrap_or(0);
        if let Some(alt) = self.alt_path {
            abi.alt_av = alt.av.emit();
            abi.alt_pkey_index = Le16::new(alt.pkey_index);
            abi.alt_timeout = alt.timeout;
        }
        abi.min_rnr_timer = self.min_rnr_timer.unwrap_or(0);
        if let Some(p) = self.sq_psn {
            abi.sq_psn = p.to_be();
        }
        abi.max_dest_rd_atomic = self.max_dest_rd_atomic.unwrap_or(0);
        if let Some(s) = self.path_mig_state {
            abi.path_mig_state = s.code();
        }
        if let Some(c) = self.cap {
            abi.cap = c.emit();
        }
        if let Some(q) = self.dest_qpn {
            abi.dest_qpn = q.to_be();
        }
        abi
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::abi::testing::{
        Corruption, assert_corruptions_rejected, assert_decode_total, assert_round_trip,
    };
    use crate::av::tests::any_av;
    use crate::scalars::Gid;
    use proptest::prelude::*;

    fn h(raw: u64) -> (PdHandle, CqHandle, CqHandle) {
        (
            PdHandle::from_raw(raw),
            CqHandle::from_raw(raw + 1),
            CqHandle::from_raw(raw + 2),
        )
    }

    fn rc_create() -> QpCreate {
        let (pd, send_cq, recv_cq) = h(0x10);
        QpCreate {
            qp_type: QpType::Rc,
            pd,
            send_cq,
            recv_cq,
            srq: None,
            caps: QpCaps {
                max_send_wr: 128,
                max_recv_wr: 64,
                max_send_sge: 4,
                max_recv_sge: 2,
                max_inline_data: 64,
            },
            sq_sig_all: false,
            port: None,
        }
    }

    #[test]
    fn create_round_trips_and_checks_rules() {
        let rc = rc_create();
        assert_round_trip(&rc);
        let gsi = QpCreate {
            qp_type: QpType::Gsi,
            port: Some(PortNum::new(2).unwrap()),
            ..rc
        };
        assert_round_trip(&gsi);

        let mut abi = rc.emit();
        abi.port_num = 1;
        assert!(QpCreate::parse(&abi).is_err(), "port on a non-special QP");
        let mut abi = gsi.emit();
        abi.port_num = 0;
        assert!(QpCreate::parse(&abi).is_err(), "special QP without a port");
        let mut abi = rc.emit();
        abi.srq = SrqHandle::from_raw(9);
        assert!(QpCreate::parse(&abi).is_err(), "SRQ with a receive queue");
        abi.caps.max_recv_wr = Le32::new(0);
        abi.caps.max_recv_sge = Le32::new(0);
        assert_eq!(
            QpCreate::parse(&abi).unwrap().srq,
            Some(SrqHandle::from_raw(9))
        );
        let mut abi = rc.emit();
        abi.recv_cq = CqHandle::NULL;
        assert!(QpCreate::parse(&abi).is_err(), "null CQ");
        let mut abi = rc.emit();
        abi.qp_type = 9;
        assert!(QpCreate::parse(&abi).is_err(), "unknown QP type");
        let mut abi = rc.emit();
        abi.reserved_at_0x3c = [0, 0, 1, 0];
        assert!(QpCreate::parse(&abi).is_err(), "reserved bytes");
    }

    /// An RC INIT->RTR modify as a consumer would build it.
    pub(crate) fn rc_to_rtr() -> QpModify {
        QpModify {
            state: Some(QpState::Rtr),
            av: Some(AvAttr::roce(
                PortNum::FIRST,
                Gid::from_ipv4([10, 0, 0, 2]),
                0,
            )),
            path_mtu: Some(Mtu::Mtu1024),
            dest_qpn: Some(Qpn::new(0x1234).unwrap()),
            rq_psn: Some(Psn::new(0xABCDEF).unwrap()),
            max_dest_rd_atomic: Some(4),
            min_rnr_timer: Some(12),
            ..QpModify::default()
        }
    }

    #[test]
    fn mask_follows_present_attributes() {
        let m = rc_to_rtr();
        use QpAttrMask as M;
        assert_eq!(
            m.mask(),
            M::STATE
                | M::AV
                | M::PATH_MTU
                | M::DEST_QPN
                | M::RQ_PSN
                | M::MAX_DEST_RD_ATOMIC
                | M::MIN_RNR_TIMER
        );
        assert_eq!(QpModify::default().mask(), M::empty());
        assert_round_trip(&m);
        let abi = m.emit();
        assert_eq!(abi.rq_psn.as_bytes(), &[0, 0xAB, 0xCD, 0xEF]);
        assert_eq!(abi.dest_qpn.as_bytes(), &[0, 0, 0x12, 0x34]);
    }

    #[test]
    fn modify_rejects_bad_layouts() {
        let good = rc_to_rtr().emit();
        let cases: &[Corruption<QpModifyAbi>] = &[
            (|a| a.attr_mask = Le32::new(1 << 21 | 1), "unknown mask bit"),
            (|a| a.qp_state = 7, "unknown state"),
            (|a| a.path_mtu = 6, "unknown MTU"),
            (|a| a.min_rnr_timer = 32, "timer code"),
            (|a| a.rq_psn = Be32::new(1 << 24), "PSN wider than 24 bits"),
            (|a| a.sq_psn = Be32::new(5), "attribute outside the mask"),
            (|a| a.reserved_at_0x29 = [0, 0, 1], "reserved"),
            (|a| a.av.port_num = 0, "AV port 0"),
        ];
        assert_corruptions_rejected::<QpModify>(&good, cases);
    }

    fn any_modify() -> impl Strategy<Value = QpModify> {
        let state = || proptest::option::of(proptest::sample::select(QpState::ALL));
        let timer = || proptest::option::of(0..=QpModify::MAX_TIMER_CODE);
        let retry = || proptest::option::of(0..=QpModify::MAX_RETRY);
        let psn = || proptest::option::of((0u32..1 << 24).prop_map(|v| Psn::new(v).unwrap()));
        let caps = (any::<[u32; 5]>()).prop_map(|c| QpCaps {
            max_send_wr: c[0],
            max_recv_wr: c[1],
            max_send_sge: c[2],
            max_recv_sge: c[3],
            max_inline_data: c[4],
        });
        let alt = (any_av(), any::<u16>(), 0..=QpModify::MAX_TIMER_CODE).prop_map(
            |(av, pkey_index, timeout)| AltPath {
                av,
                pkey_index,
                timeout,
            },
        );
        (
            (
                state(),
                state(),
                proptest::option::of(any::<bool>()),
                proptest::option::of((0u32..32).prop_map(AccessFlags::from_bits_truncate)),
                proptest::option::of(any::<u16>()),
                proptest::option::of((1u8..).prop_map(|p| PortNum::new(p).unwrap())),
                proptest::option::of(any::<u32>().prop_map(QKey::new)),
            ),
            (
                proptest::option::of(any_av()),
                proptest::option::of(proptest::sample::select(Mtu::ALL)),
                timer(),
                retry(),
                retry(),
                psn(),
                proptest::option::of(any::<u8>()),
            ),
            (
                proptest::option::of(alt),
                timer(),
                psn(),
                proptest::option::of(any::<u8>()),
                proptest::option::of(proptest::sample::select(PathMigState::ALL)),
                proptest::option::of(caps),
                proptest::option::of((0u32..1 << 24).prop_map(|v| Qpn::new(v).unwrap())),
            ),
        )
            .prop_map(|(a, b, c)| QpModify {
                state: a.0,
                cur_state: a.1,
                en_sqd_async_notify: a.2,
                access: a.3,
                pkey_index: a.4,
                port: a.5,
                qkey: a.6,
                av: b.0,
                path_mtu: b.1,
                timeout: b.2,
                retry_cnt: b.3,
                rnr_retry: b.4,
                rq_psn: b.5,
                max_rd_atomic: b.6,
                alt_path: c.0,
                min_rnr_timer: c.1,
                sq_psn: c.2,
                max_dest_rd_atomic: c.3,
                path_mig_state: c.4,
                cap: c.5,
                dest_qpn: c.6,
            })
    }

    proptest! {
        #[test]
        fn any_modify_round_trips(m in any_modify()) {
            assert_round_trip(&m);
        }

        #[test]
        fn modify_decode_is_total(bytes in proptest::collection::vec(any::<u8>(), 0..140)) {
            assert_decode_total::<QpModify>(&bytes);
        }

        #[test]
        fn create_decode_is_total(bytes in proptest::collection::vec(any::<u8>(), 0..70)) {
            assert_decode_total::<QpCreate>(&bytes);
        }
    }
}
