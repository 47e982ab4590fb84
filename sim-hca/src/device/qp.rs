//! Queue pairs (PRM 6.1): the QP object, its commands, and the send
//! doorbell. The transport engine that moves a QP's data is in
//! `crate::transport`.

use hca_prm::av::Av;
use hca_prm::cmd::{CmdEntry, CmdStatus, Table};
use hca_prm::ctx::{BufDesc, ModifyQp, Qpc, QpcFlags, SQ_LOG_STRIDE};
use hca_prm::{Le16, Le32, Le64};
use ib_types::access::AccessFlags;
use ib_types::qp::{QpAttrMask, QpState, QpType};
use ib_types::qp_state::check_mask;
use ib_types::scalars::{Mtu, Psn, Qpn};
use zerocopy::{FromZeros, IntoBytes};

use super::Device;
use super::command::{CmdResult, reserved};
use super::resource::{max_recv_log_stride, ring_status};
use crate::transport::{Requester, Responder};

/// The attributes a QP's transport runs with (the QPC fields `MODIFY_QP`
/// sets).
#[derive(Debug, Clone, Copy)]
pub(crate) struct QpAttrs {
    pub dest_qpn: Qpn,
    pub qkey: u32,
    pub sq_psn: Psn,
    pub rq_psn: Psn,
    pub access: AccessFlags,
    pub pkey_index: u16,
    pub path_mtu: Mtu,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub min_rnr_timer: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub av: Av,
}

impl Default for QpAttrs {
    fn default() -> Self {
        Self {
            dest_qpn: Qpn::default(),
            qkey: 0,
            sq_psn: Psn::default(),
            rq_psn: Psn::default(),
            access: AccessFlags::empty(),
            pkey_index: 0,
            path_mtu: Mtu::Mtu1024,
            timeout: 0,
            retry_cnt: 0,
            rnr_retry: 0,
            min_rnr_timer: 0,
            max_rd_atomic: 0,
            max_dest_rd_atomic: 0,
            av: Av::default(),
        }
    }
}

/// A queue pair.
#[derive(Debug)]
pub(crate) struct Qp {
    /// Table index (the QP number for general QPs).
    pub index: u32,
    pub qp_type: QpType,
    pub state: QpState,
    pub port: u8,
    pub flags: QpcFlags,
    pub pd: u32,
    pub send_cqn: u32,
    pub recv_cqn: u32,
    pub srqn: Option<u32>,
    pub uar: u32,
    pub sq: BufDesc,
    pub rq: BufDesc,
    pub rq_dbr: u64,
    pub attrs: QpAttrs,
    /// Send basic blocks posted (the doorbell's counter).
    pub sq_producer: u32,
    /// Receive WQEs taken from the RQ.
    pub rq_consumer: u32,
    pub req: Requester,
    pub resp: Responder,
}

impl Qp {
    /// The QPN this QP has on the wire: 0 and 1 for the special QPs.
    pub(crate) fn wire_qpn(&self) -> Qpn {
        match self.qp_type {
            QpType::Smi => Qpn::SMI,
            QpType::Gsi => Qpn::GSI,
            _ => Qpn::from_low_bits(self.index),
        }
    }

    pub(crate) fn sq_entries(&self) -> u32 {
        1 << self.sq.log_entries
    }

    pub(crate) fn rq_entries(&self) -> u32 {
        1 << self.rq.log_entries
    }

    /// The context as `QUERY_QP` reports it.
    pub(crate) fn context(&self) -> Qpc {
        let a = &self.attrs;
        let mut c = Qpc::new_zeroed();
        c.state = self.state.code();
        c.qp_type = self.qp_type.code();
        c.port = self.port;
        c.flags = self.flags.bits();
        c.pd = Le32::new(self.pd);
        c.send_cqn = Le32::new(self.send_cqn);
        c.recv_cqn = Le32::new(self.recv_cqn);
        c.srqn = Le32::new(self.srqn.unwrap_or(0));
        c.uar_index = Le32::new(self.uar);
        c.sq = self.sq;
        c.rq = self.rq;
        c.rq_dbr = Le64::new(self.rq_dbr);
        c.dest_qpn = Le32::new(a.dest_qpn.get());
        c.qkey = Le32::new(a.qkey);
        c.sq_psn = Le32::new(a.sq_psn.get());
        c.rq_psn = Le32::new(a.rq_psn.get());
        c.access = Le32::new(a.access.bits());
        c.pkey_index = Le16::new(a.pkey_index);
        c.path_mtu = a.path_mtu.code();
        c.timeout = a.timeout;
        c.retry_cnt = a.retry_cnt;
        c.rnr_retry = a.rnr_retry;
        c.min_rnr_timer = a.min_rnr_timer;
        c.max_rd_atomic = a.max_rd_atomic;
        c.max_dest_rd_atomic = a.max_dest_rd_atomic;
        c.av = a.av;
        c.sq_wqe_counter = Le32::new(self.req.fetch);
        c.rq_wqe_counter = Le32::new(self.rq_consumer);
        c
    }
}

/// The table index of a special QP: `2·(port−1)` (SMI) and `+1` (GSI).
pub(crate) fn special_index(port: u8, qp_type: QpType) -> Option<u32> {
    let base = 2 * (u32::from(port).checked_sub(1)?);
    match qp_type {
        QpType::Smi => Some(base),
        QpType::Gsi => Some(base + 1),
        _ => None,
    }
}

impl Device {
    /// `SW2HW_QP` (PRM 6.1.2).
    pub(super) fn sw2hw_qp(&mut self, e: &CmdEntry, n: u32) -> CmdResult {
        let ctx: Qpc = self.read_layout(e)?;
        reserved(&ctx.reserved_at_0x5d)?;
        reserved(&ctx.reserved_at_0x88)?;
        let qp_type = QpType::from_code(ctx.qp_type).map_err(|_| CmdStatus::BadParam)?;
        let flags = QpcFlags::from_bits(ctx.flags).ok_or(CmdStatus::BadParam)?;
        if ctx.state != QpState::Reset.code() {
            return Err(CmdStatus::BadParam);
        }
        let num_ports = self.num_ports();
        // A special QP's port fixes its slot; a general QP's may wait for
        // RESET->INIT (0: none yet), where Table 91 requires it.
        let unset_allowed = !qp_type.is_special() && ctx.port == 0;
        if !unset_allowed && (ctx.port == 0 || ctx.port > num_ports) {
            return Err(CmdStatus::BadPort);
        }
        // Special QPs live at their fixed slots; general QPs above them.
        let special_slots = 2 * u32::from(num_ports);
        match special_index(ctx.port, qp_type) {
            Some(slot) if slot != n => return Err(CmdStatus::BadIndex),
            None if n < special_slots => return Err(CmdStatus::BadIndex),
            _ => {}
        }
        let caps = (
            self.cap.log_max_wqes,
            max_recv_log_stride(self.cap.max_recv_sges),
            u32::from(self.cap.num_uars.get()),
        );
        let hca = self.hca_mut()?;
        let i = hca.index(Table::Qpc, n)?;
        if hca.qps[i].is_some() {
            return Err(CmdStatus::BadResState);
        }
        let mtts = hca.mtt_count();
        ctx.sq
            .validate(Some(SQ_LOG_STRIDE), SQ_LOG_STRIDE, caps.0, mtts)
            .map_err(ring_status)?;
        let has_srq = flags.contains(QpcFlags::HAS_SRQ);
        if !has_srq {
            ctx.rq
                .validate(None, caps.1, caps.0, mtts)
                .map_err(ring_status)?;
            let dbr = ctx.rq_dbr.get();
            if dbr == 0 || !dbr.is_multiple_of(4) {
                return Err(CmdStatus::BadParam);
            }
        }
        if ctx.uar_index.get() >= caps.2 || ctx.pd.get() >> 24 != 0 {
            return Err(CmdStatus::BadParam);
        }
        let live_cq = |c: u32| {
            hca.index(Table::Cqc, c)
                .is_ok_and(|j| hca.cqs[j].as_ref().is_some_and(|cq| !cq.error))
        };
        if !live_cq(ctx.send_cqn.get()) || !live_cq(ctx.recv_cqn.get()) {
            return Err(CmdStatus::BadParam);
        }
        let srqn = if has_srq {
            let s = ctx.srqn.get();
            let srq_pd = hca
                .index(Table::Srqc, s)
                .ok()
                .and_then(|j| hca.srqs[j].as_ref())
                .map(|srq| srq.pd)
                .ok_or(CmdStatus::BadParam)?;
            if srq_pd != ctx.pd.get() || qp_type == QpType::Smi {
                return Err(CmdStatus::BadParam);
            }
            Some(s)
        } else {
            None
        };
        // References that make the CQs and the SRQ busy (PRM 6.2, 6.4).
        for cqn in [ctx.send_cqn.get(), ctx.recv_cqn.get()] {
            if let Some(cq) = hca.cqs[cqn as usize].as_mut() {
                cq.users += 1;
            }
        }
        if let Some(s) = srqn
            && let Some(srq) = hca.srqs[s as usize].as_mut()
        {
            srq.users += 1;
        }
        let qp = Qp {
            index: n,
            qp_type,
            state: QpState::Reset,
            port: ctx.port,
            flags,
            pd: ctx.pd.get(),
            send_cqn: ctx.send_cqn.get(),
            recv_cqn: ctx.recv_cqn.get(),
            srqn,
            uar: ctx.uar_index.get(),
            sq: ctx.sq,
            rq: ctx.rq,
            rq_dbr: ctx.rq_dbr.get(),
            attrs: QpAttrs::default(),
            sq_producer: 0,
            rq_consumer: 0,
            req: Requester::default(),
            resp: Responder::default(),
        };
        let bytes = qp.context();
        hca.qps[i] = Some(Box::new(qp));
        self.write_context(Table::Qpc, n, bytes.as_bytes())?;
        Ok(0)
    }

    /// `MODIFY_QP` (PRM 6.1.3).
    pub(super) fn modify_qp(&mut self, e: &CmdEntry, n: u32) -> CmdResult {
        let input: ModifyQp = self.read_layout(e)?;
        reserved(&input.reserved_at_0x6)?;
        let mask = QpAttrMask::from_bits(input.attr_mask.get()).ok_or(CmdStatus::BadParam)?;
        let next = if mask.contains(QpAttrMask::STATE) {
            Some(QpState::from_code(input.next_state).map_err(|_| CmdStatus::BadParam)?)
        } else {
            None
        };
        let cur = if mask.contains(QpAttrMask::CUR_STATE) {
            Some(QpState::from_code(input.cur_state).map_err(|_| CmdStatus::BadParam)?)
        } else {
            None
        };
        if mask.contains(QpAttrMask::CAP) || mask.contains(QpAttrMask::ALT_PATH) {
            // Resizing work queues and path migration are not in the model
            // (PRM 12).
            return Err(CmdStatus::BadParam);
        }
        let num_ports = self.num_ports();
        let pkey_len = self.cfg.limits.pkey_table_len;
        let max_rd_atomic = self.cap.max_rd_atomic;
        let now = self.now_ns;
        let hca = self.hca_mut()?;
        let i = hca.index(Table::Qpc, n)?;
        let qp = hca.qps[i].as_mut().ok_or(CmdStatus::BadResState)?;
        let to =
            check_mask(qp.qp_type, qp.state, mask, next, cur).map_err(|_| CmdStatus::BadQpState)?;
        let c = &input.qpc;
        // Validate every attribute before applying any.
        let mut attrs = qp.attrs;
        let mut port = qp.port;
        let mut sqd_event = qp.flags.contains(QpcFlags::SQD_EVENT);
        if mask.contains(QpAttrMask::PORT) {
            if c.port == 0 || c.port > num_ports || qp.qp_type.is_special() {
                return Err(CmdStatus::BadPort);
            }
            port = c.port;
        }
        if mask.contains(QpAttrMask::PKEY_INDEX) {
            if c.pkey_index.get() >= pkey_len {
                return Err(CmdStatus::BadPkey);
            }
            attrs.pkey_index = c.pkey_index.get();
        }
        if mask.contains(QpAttrMask::QKEY) {
            attrs.qkey = c.qkey.get();
        }
        if mask.contains(QpAttrMask::ACCESS_FLAGS) {
            let access = AccessFlags::from_bits(c.access.get()).ok_or(CmdStatus::BadParam)?;
            if !AccessFlags::REMOTE.contains(access) {
                return Err(CmdStatus::BadParam);
            }
            attrs.access = access;
        }
        if mask.contains(QpAttrMask::AV) {
            c.av.check().map_err(|_| CmdStatus::BadParam)?;
            if c.av.dest_ipv4().is_none() {
                return Err(CmdStatus::BadParam);
            }
            attrs.av = c.av;
        }
        if mask.contains(QpAttrMask::PATH_MTU) {
            attrs.path_mtu = Mtu::from_code(c.path_mtu).map_err(|_| CmdStatus::BadParam)?;
        }
        let timer = |v: u8, max: u8| {
            if v <= max {
                Ok(v)
            } else {
                Err(CmdStatus::BadParam)
            }
        };
        if mask.contains(QpAttrMask::TIMEOUT) {
            attrs.timeout = timer(c.timeout, 31)?;
        }
        if mask.contains(QpAttrMask::RETRY_CNT) {
            attrs.retry_cnt = timer(c.retry_cnt, 7)?;
        }
        if mask.contains(QpAttrMask::RNR_RETRY) {
            attrs.rnr_retry = timer(c.rnr_retry, 7)?;
        }
        if mask.contains(QpAttrMask::MIN_RNR_TIMER) {
            attrs.min_rnr_timer = timer(c.min_rnr_timer, 31)?;
        }
        if mask.contains(QpAttrMask::MAX_QP_RD_ATOMIC) {
            attrs.max_rd_atomic = timer(c.max_rd_atomic, max_rd_atomic)?;
        }
        if mask.contains(QpAttrMask::MAX_DEST_RD_ATOMIC) {
            attrs.max_dest_rd_atomic = timer(c.max_dest_rd_atomic, max_rd_atomic)?;
        }
        let psn = |raw: Le32| Psn::new(raw.get()).map_err(|_| CmdStatus::BadParam);
        if mask.contains(QpAttrMask::SQ_PSN) {
            attrs.sq_psn = psn(c.sq_psn)?;
        }
        if mask.contains(QpAttrMask::RQ_PSN) {
            attrs.rq_psn = psn(c.rq_psn)?;
        }
        if mask.contains(QpAttrMask::DEST_QPN) {
            attrs.dest_qpn = Qpn::new(c.dest_qpn.get()).map_err(|_| CmdStatus::BadParam)?;
        }
        if mask.contains(QpAttrMask::EN_SQD_ASYNC_NOTIFY) {
            sqd_event = QpcFlags::from_bits_retain(c.flags).contains(QpcFlags::SQD_EVENT);
        }
        // Apply.
        let from = qp.state;
        qp.attrs = attrs;
        qp.port = port;
        qp.flags.set(QpcFlags::SQD_EVENT, sqd_event);
        qp.state = to;
        if mask.contains(QpAttrMask::SQ_PSN) {
            qp.req.psn = attrs.sq_psn;
        }
        if mask.contains(QpAttrMask::RQ_PSN) {
            qp.resp.expected_psn = attrs.rq_psn;
        }
        self.qp_transition(n, from, to, now);
        let ctx = self
            .qp_ref(n)
            .map(Qp::context)
            .ok_or(CmdStatus::BadResState)?;
        self.write_context(Table::Qpc, n, ctx.as_bytes())?;
        Ok(0)
    }

    /// `QUERY_QP`.
    pub(super) fn query_qp(&mut self, e: &CmdEntry, n: u32) -> CmdResult {
        let hca = self.hca_mut()?;
        let i = hca.index(Table::Qpc, n)?;
        let ctx = hca.qps[i].as_ref().ok_or(CmdStatus::BadResState)?.context();
        self.write_mailbox(e, ctx.as_bytes())?;
        Ok(0)
    }

    /// `HW2SW_QP` (PRM 6.1.4).
    pub(super) fn hw2sw_qp(&mut self, n: u32) -> CmdResult {
        let now = self.now_ns;
        {
            let hca = self.hca_mut()?;
            let i = hca.index(Table::Qpc, n)?;
            if hca.qps[i].is_none() {
                return Err(CmdStatus::BadResState);
            }
        }
        let from = self.qp_ref(n).map(|q| q.state).unwrap_or(QpState::Reset);
        if let Some(qp) = self.qp_mut(n) {
            qp.state = QpState::Reset;
        }
        self.qp_transition(n, from, QpState::Reset, now);
        let hca = self.hca_mut()?;
        let qp = hca.qps[n as usize].take().ok_or(CmdStatus::BadResState)?;
        hca.timers.file(n, None);
        for cqn in [qp.send_cqn, qp.recv_cqn] {
            if let Some(cq) = hca.cqs[cqn as usize].as_mut() {
                cq.users = cq.users.saturating_sub(1);
            }
        }
        if let Some(s) = qp.srqn
            && let Some(srq) = hca.srqs[s as usize].as_mut()
        {
            srq.users = srq.users.saturating_sub(1);
        }
        for members in hca.mcgs.values_mut() {
            members.retain(|&q| q != n);
        }
        hca.mcgs.retain(|_, members| !members.is_empty());
        self.write_context(Table::Qpc, n, Qpc::new_zeroed().as_bytes())?;
        Ok(0)
    }

    pub(crate) fn qp_ref(&self, n: u32) -> Option<&Qp> {
        self.hca.as_ref()?.qps.get(n as usize)?.as_deref()
    }

    pub(crate) fn qp_mut(&mut self, n: u32) -> Option<&mut Qp> {
        self.hca.as_mut()?.qps.get_mut(n as usize)?.as_deref_mut()
    }

    /// `SQ_DOORBELL` (and `CQ_DOORBELL`) writes to UAR page `uar`.
    pub(super) fn uar_doorbell(&mut self, uar: u32, in_page: u64, value: u64) {
        use hca_prm::doorbell::{CQ_DOORBELL, CqDoorbell, SQ_DOORBELL, SqDoorbell};
        match in_page {
            SQ_DOORBELL => match SqDoorbell::decode(value) {
                Ok(db) => self.sq_doorbell(uar, db.qpn.get(), db.producer),
                Err(_) => self.counters.dropped_doorbells += 1,
            },
            CQ_DOORBELL => match CqDoorbell::decode(value) {
                Ok(db) => self.cq_doorbell(uar, db),
                Err(_) => self.counters.dropped_doorbells += 1,
            },
            _ => self.counters.dropped_doorbells += 1,
        }
    }

    fn sq_doorbell(&mut self, uar: u32, qpn: u32, producer: u32) {
        // A QP in RESET has no send queue to run: its counters are 0 until
        // software posts again after RESET->INIT (PRM 6.1.3), so a
        // doorbell rung meanwhile (a post racing with the reset) is dropped.
        let authorised = self
            .qp_ref(qpn)
            .is_some_and(|qp| qp.uar == uar && qp.state != QpState::Reset);
        if !authorised {
            self.counters.dropped_doorbells += 1;
            return;
        }
        if let Some(qp) = self.qp_mut(qpn) {
            // Never more than a ring's worth ahead of what was fetched.
            let ahead = producer.wrapping_sub(qp.req.fetch);
            if ahead > qp.sq_entries() {
                self.counters.dropped_doorbells += 1;
                return;
            }
            qp.sq_producer = producer;
        }
        self.run_send_queue(qpn);
    }
}
