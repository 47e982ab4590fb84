//! Context tables and the object commands (PRM 5.1, 6, 7): event queues,
//! completion queues, shared receive queues, memory protection and
//! translation entries, multicast groups. QPs are in `qp`.

use std::collections::BTreeMap;

use hca_prm::cmd::{CmdEntry, CmdStatus, InitHca, Opcode, Table, WriteMttHeader};
use hca_prm::ctx::{
    BufDesc, BufDescError, CQE_LOG_STRIDE, CqState, Cqc, EQE_LOG_STRIDE, EqState, Eqc, ResizeCq,
    SrqState, Srqc,
};
use hca_prm::mpt::{MTT_ENTRY_SIZE, MptEntry, MptKind, PAGE_SHIFT_RANGE, mtt_pages};
use hca_prm::{Le32, Le64};
use ib_types::access::AccessFlags;
use ib_types::scalars::Gid;
use zerocopy::{FromBytes, IntoBytes};

use super::Device;
use super::command::{CmdResult, reserved};
use super::dma::{Mtt, MttRange};
use super::qp::Qp;
use super::timers::QpTimers;
use crate::host::HostMemory;

/// Where a context table lives and how big it is.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct TableInfo {
    pub base: u64,
    pub count: u32,
    pub entry_size: u32,
}

/// An event queue.
#[derive(Debug, Clone)]
pub(crate) struct Eq {
    pub ring: BufDesc,
    pub vector: u16,
    pub consumer: u32,
    pub producer: u32,
    pub armed: bool,
}

/// What a CQ is armed for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Arm {
    None,
    Solicited,
    Next,
}

/// A completion queue.
#[derive(Debug, Clone)]
pub(crate) struct Cq {
    pub ring: BufDesc,
    pub eqn: u32,
    pub uar: u32,
    pub ci_dbr: u64,
    pub producer: u32,
    pub arm: Arm,
    pub error: bool,
    /// QPs that complete into this CQ.
    pub users: u32,
}

/// A shared receive queue.
#[derive(Debug, Clone)]
pub(crate) struct Srq {
    pub ring: BufDesc,
    pub pd: u32,
    pub dbr: u64,
    pub consumer: u32,
    pub limit: u32,
    pub error: bool,
    /// QPs that receive from this SRQ.
    pub users: u32,
}

/// Everything `INIT_HCA` creates.
#[derive(Debug)]
pub(crate) struct Hca {
    pub tables: [TableInfo; 6],
    pub eqs: Vec<Option<Eq>>,
    pub cqs: Vec<Option<Cq>>,
    pub srqs: Vec<Option<Srq>>,
    pub qps: Vec<Option<Box<Qp>>>,
    pub mpts: Vec<MptEntry>,
    pub mtt: Mtt,
    /// Event class bit -> EQ number.
    pub event_map: [Option<u32>; 6],
    /// Multicast GID -> attached QP numbers.
    pub mcgs: BTreeMap<Gid, Vec<u32>>,
    /// The QPs' armed timers, by deadline.
    pub timers: QpTimers,
}

fn slots<T>(count: u32) -> Vec<Option<T>> {
    (0..count).map(|_| None).collect()
}

impl Hca {
    pub(crate) fn new(init: &InitHca) -> Self {
        let sizes = [
            hca_prm::ctx::entry_size::QPC,
            hca_prm::ctx::entry_size::CQC,
            hca_prm::ctx::entry_size::EQC,
            hca_prm::ctx::entry_size::SRQC,
            hca_prm::ctx::entry_size::MPT,
            hca_prm::ctx::entry_size::MTT,
        ];
        let tables: [TableInfo; 6] = core::array::from_fn(|i| TableInfo {
            base: init.tables[i].base.get(),
            count: 1 << init.tables[i].log_count,
            entry_size: u32::from(sizes[i]),
        });
        let count = |t: Table| tables[usize::from(t.code())].count;
        Self {
            eqs: slots(count(Table::Eqc)),
            cqs: slots(count(Table::Cqc)),
            srqs: slots(count(Table::Srqc)),
            qps: slots(count(Table::Qpc)),
            timers: QpTimers::new(count(Table::Qpc) as usize),
            mpts: vec![MptEntry::default(); count(Table::Mpt) as usize],
            mtt: Mtt {
                entries: vec![0; count(Table::Mtt) as usize],
            },
            event_map: [None; 6],
            mcgs: BTreeMap::new(),
            tables,
        }
    }

    pub(crate) fn table(&self, t: Table) -> TableInfo {
        self.tables[usize::from(t.code())]
    }

    /// Zero-fills every table in host memory; false on a DMA fault.
    pub(crate) fn zero_tables(&self, mem: &dyn HostMemory) -> bool {
        let zeros = [0u8; 4096];
        self.tables.iter().all(|t| {
            let len = u64::from(t.count) * u64::from(t.entry_size);
            (0..len.div_ceil(4096)).all(|chunk| {
                let at = chunk * 4096;
                let n = (len - at).min(4096) as usize;
                mem.write(t.base + at, &zeros[..n]).is_ok()
            })
        })
    }

    /// Index `n` of table `t`, or `BAD_INDEX`.
    pub(crate) fn index(&self, t: Table, n: u32) -> Result<usize, CmdStatus> {
        if n < self.table(t).count {
            Ok(n as usize)
        } else {
            Err(CmdStatus::BadIndex)
        }
    }

    pub(crate) fn mtt_count(&self) -> u64 {
        u64::from(self.table(Table::Mtt).count)
    }
}

impl Device {
    /// Writes a context back to its slot in host memory (PRM 3 step 5).
    pub(crate) fn write_context(
        &mut self,
        t: Table,
        n: u32,
        bytes: &[u8],
    ) -> Result<(), CmdStatus> {
        let info = self.hca_mut()?.table(t);
        let addr = info.base + u64::from(n) * u64::from(info.entry_size);
        if self.mem.write(addr, bytes).is_err() {
            self.note_fault();
            return Err(CmdStatus::Internal);
        }
        Ok(())
    }

    pub(super) fn execute_object_command(&mut self, op: Opcode, e: &CmdEntry) -> CmdResult {
        self.hca_mut()?;
        let n = e.in_mod.get();
        match op {
            Opcode::Sw2HwEq => self.sw2hw_eq(e, n),
            Opcode::Hw2SwEq => self.hw2sw_eq(n),
            Opcode::QueryEq => {
                let ctx = self.eq_context(n)?;
                self.write_mailbox(e, ctx.as_bytes())?;
                Ok(0)
            }
            Opcode::MapEq => self.map_eq(n, e.in_param.get()),
            Opcode::Sw2HwCq => self.sw2hw_cq(e, n),
            Opcode::Hw2SwCq => self.hw2sw_cq(n),
            Opcode::QueryCq => {
                let ctx = self.cq_context(n)?;
                self.write_mailbox(e, ctx.as_bytes())?;
                Ok(0)
            }
            Opcode::ResizeCq => self.resize_cq(e, n),
            Opcode::Sw2HwSrq => self.sw2hw_srq(e, n),
            Opcode::Hw2SwSrq => self.hw2sw_srq(n),
            Opcode::QuerySrq => {
                let ctx = self.srq_context(n)?;
                self.write_mailbox(e, ctx.as_bytes())?;
                Ok(0)
            }
            Opcode::ArmSrq => self.arm_srq(n, e.in_param.get()),
            Opcode::Sw2HwMpt => self.sw2hw_mpt(e, n),
            Opcode::Hw2SwMpt => self.hw2sw_mpt(n),
            Opcode::QueryMpt => {
                let hca = self.hca_mut()?;
                let i = hca.index(Table::Mpt, n)?;
                let entry = hca.mpts[i];
                if entry.kind == MptKind::Free.code() {
                    return Err(CmdStatus::BadResState);
                }
                self.write_mailbox(e, entry.as_bytes())?;
                Ok(0)
            }
            Opcode::WriteMtt => self.write_mtt(e),
            Opcode::Sw2HwQp => self.sw2hw_qp(e, n),
            Opcode::ModifyQp => self.modify_qp(e, n),
            Opcode::QueryQp => self.query_qp(e, n),
            Opcode::Hw2SwQp => self.hw2sw_qp(n),
            Opcode::AttachMcg | Opcode::DetachMcg => {
                let gid: Gid = self.read_layout(e)?;
                self.multicast(op == Opcode::AttachMcg, n, gid)
            }
            // Device-level opcodes are handled by the caller.
            _ => Err(CmdStatus::BadOpcode),
        }
    }

    // ----- event queues -------------------------------------------------

    fn sw2hw_eq(&mut self, e: &CmdEntry, n: u32) -> CmdResult {
        let ctx: Eqc = self.read_layout(e)?;
        reserved(&[ctx.reserved_at_0x1])?;
        reserved(&ctx.reserved_at_0xc)?;
        reserved(&ctx.reserved_at_0x20)?;
        let (max_eqes, vectors) = (self.cap.log_max_eqes, self.cap.num_vectors.get());
        let hca = self.hca_mut()?;
        let i = hca.index(Table::Eqc, n)?;
        if hca.eqs[i].is_some() {
            return Err(CmdStatus::BadResState);
        }
        ctx.ring
            .validate(
                Some(EQE_LOG_STRIDE),
                EQE_LOG_STRIDE,
                max_eqes,
                hca.mtt_count(),
            )
            .map_err(ring_status)?;
        if ctx.vector.get() >= vectors {
            return Err(CmdStatus::BadParam);
        }
        hca.eqs[i] = Some(Eq {
            ring: ctx.ring,
            vector: ctx.vector.get(),
            consumer: 0,
            producer: 0,
            armed: false,
        });
        let ctx = self.eq_context(n)?;
        self.write_context(Table::Eqc, n, ctx.as_bytes())?;
        Ok(0)
    }

    fn eq_context(&mut self, n: u32) -> Result<Eqc, CmdStatus> {
        let hca = self.hca_mut()?;
        let i = hca.index(Table::Eqc, n)?;
        let eq = hca.eqs[i].as_ref().ok_or(CmdStatus::BadResState)?;
        let mut ctx = Eqc {
            ring: eq.ring,
            vector: eq.vector.into(),
            consumer: Le32::new(eq.consumer),
            producer: Le32::new(eq.producer),
            ..Eqc::default()
        };
        ctx.state = if eq.armed {
            EqState::Armed
        } else {
            EqState::Fired
        }
        .code();
        Ok(ctx)
    }

    fn hw2sw_eq(&mut self, n: u32) -> CmdResult {
        let hca = self.hca_mut()?;
        let i = hca.index(Table::Eqc, n)?;
        if hca.eqs[i].is_none() {
            return Err(CmdStatus::BadResState);
        }
        if hca.cqs.iter().flatten().any(|cq| cq.eqn == n) {
            return Err(CmdStatus::ResourceBusy);
        }
        hca.eqs[i] = None;
        for slot in &mut hca.event_map {
            if *slot == Some(n) {
                *slot = None;
            }
        }
        self.write_context(Table::Eqc, n, Eqc::default().as_bytes())?;
        Ok(0)
    }

    fn map_eq(&mut self, n: u32, mask: u64) -> CmdResult {
        let hca = self.hca_mut()?;
        let i = hca.index(Table::Eqc, n)?;
        if hca.eqs[i].is_none() {
            return Err(CmdStatus::BadResState);
        }
        if mask >> hca.event_map.len() != 0 {
            return Err(CmdStatus::BadParam);
        }
        for (class, slot) in hca.event_map.iter_mut().enumerate() {
            if mask & (1 << class) != 0 {
                *slot = Some(n);
            }
        }
        Ok(0)
    }

    // ----- completion queues --------------------------------------------

    fn sw2hw_cq(&mut self, e: &CmdEntry, n: u32) -> CmdResult {
        let ctx: Cqc = self.read_layout(e)?;
        reserved(&ctx.reserved_at_0x1)?;
        reserved(&ctx.reserved_at_0xc)?;
        reserved(&ctx.reserved_at_0x2c)?;
        let max_cqes = self.cap.log_max_cqes;
        let uars = u32::from(self.cap.num_uars.get());
        let hca = self.hca_mut()?;
        let i = hca.index(Table::Cqc, n)?;
        if hca.cqs[i].is_some() {
            return Err(CmdStatus::BadResState);
        }
        ctx.ring
            .validate(
                Some(CQE_LOG_STRIDE),
                CQE_LOG_STRIDE,
                max_cqes,
                hca.mtt_count(),
            )
            .map_err(ring_status)?;
        let eqn = ctx.eqn.get();
        let eq_live = hca
            .index(Table::Eqc, eqn)
            .is_ok_and(|j| hca.eqs[j].is_some());
        let dbr = ctx.ci_dbr.get();
        if !eq_live || ctx.uar_index.get() >= uars || dbr == 0 || !dbr.is_multiple_of(4) {
            return Err(CmdStatus::BadParam);
        }
        hca.cqs[i] = Some(Cq {
            ring: ctx.ring,
            eqn,
            uar: ctx.uar_index.get(),
            ci_dbr: dbr,
            producer: 0,
            arm: Arm::None,
            error: false,
            users: 0,
        });
        let ctx = self.cq_context(n)?;
        self.write_context(Table::Cqc, n, ctx.as_bytes())?;
        Ok(0)
    }

    fn cq_context(&mut self, n: u32) -> Result<Cqc, CmdStatus> {
        let hca = self.hca_mut()?;
        let i = hca.index(Table::Cqc, n)?;
        let cq = hca.cqs[i].as_ref().ok_or(CmdStatus::BadResState)?;
        let state = match (cq.error, cq.arm) {
            (true, _) => CqState::Error,
            (false, Arm::None) => CqState::Unarmed,
            (false, Arm::Solicited) => CqState::ArmedSolicited,
            (false, Arm::Next) => CqState::ArmedNext,
        };
        Ok(Cqc {
            state: state.code(),
            eqn: Le32::new(cq.eqn),
            uar_index: Le32::new(cq.uar),
            ring: cq.ring,
            ci_dbr: Le64::new(cq.ci_dbr),
            producer: Le32::new(cq.producer),
            ..Cqc::default()
        })
    }

    fn hw2sw_cq(&mut self, n: u32) -> CmdResult {
        let hca = self.hca_mut()?;
        let i = hca.index(Table::Cqc, n)?;
        let cq = hca.cqs[i].as_ref().ok_or(CmdStatus::BadResState)?;
        if cq.users != 0 {
            return Err(CmdStatus::ResourceBusy);
        }
        hca.cqs[i] = None;
        self.write_context(Table::Cqc, n, Cqc::default().as_bytes())?;
        Ok(0)
    }

    /// `RESIZE_CQ` (PRM 6.2): copies outstanding CQEs to the new ring, or
    /// fails leaving the old ring untouched.
    fn resize_cq(&mut self, e: &CmdEntry, n: u32) -> CmdResult {
        let input: ResizeCq = self.read_layout(e)?;
        reserved(&input.reserved_at_0x10)?;
        let max_cqes = self.cap.log_max_cqes;
        let (old, consumer) = {
            let hca = self.hca_mut()?;
            let i = hca.index(Table::Cqc, n)?;
            let cq = hca.cqs[i].clone().ok_or(CmdStatus::BadResState)?;
            input
                .ring
                .validate(
                    Some(CQE_LOG_STRIDE),
                    CQE_LOG_STRIDE,
                    max_cqes,
                    hca.mtt_count(),
                )
                .map_err(ring_status)?;
            let consumer = self.read_dbr(cq.ci_dbr).ok_or(CmdStatus::Internal)?;
            (cq, consumer)
        };
        let outstanding = old.producer.wrapping_sub(consumer);
        let old_size = 1u32 << old.ring.log_entries;
        let new_size = 1u32 << input.ring.log_entries;
        if outstanding > old_size || outstanding > new_size {
            return Err(CmdStatus::ExceedLimit);
        }
        let old_range = MttRange::of_ring(&old.ring);
        let new_range = MttRange::of_ring(&input.ring);
        let mut cqe = [0u8; 32];
        for k in 0..outstanding {
            let from = consumer.wrapping_add(k);
            let hca = self.hca.as_ref().ok_or(CmdStatus::BadSysState)?;
            let at = u64::from(from & (old_size - 1)) * 32;
            if hca
                .mtt
                .read(self.mem.as_ref(), old_range, at, &mut cqe)
                .is_err()
            {
                self.note_fault();
                return Err(CmdStatus::Internal);
            }
            cqe[31] = hca_prm::owner::phase_for(k, input.ring.log_entries);
            if hca
                .mtt
                .write(self.mem.as_ref(), new_range, u64::from(k) * 32, &cqe)
                .is_err()
            {
                self.note_fault();
                return Err(CmdStatus::Internal);
            }
        }
        // Software restarts its consumer counter at 0 for the new ring.
        if self.mem.write(old.ci_dbr, &0u32.to_le_bytes()).is_err() {
            self.note_fault();
            return Err(CmdStatus::Internal);
        }
        let hca = self.hca_mut()?;
        let cq = hca.cqs[n as usize].as_mut().ok_or(CmdStatus::BadResState)?;
        cq.ring = input.ring;
        cq.producer = outstanding;
        let ctx = self.cq_context(n)?;
        self.write_context(Table::Cqc, n, ctx.as_bytes())?;
        Ok(0)
    }

    /// Reads a 4-byte doorbell record.
    pub(crate) fn read_dbr(&mut self, addr: u64) -> Option<u32> {
        let mut raw = [0u8; 4];
        match self.mem.read(addr, &mut raw) {
            Ok(()) => Some(u32::from_le_bytes(raw)),
            Err(_) => {
                self.note_fault();
                None
            }
        }
    }

    // ----- shared receive queues ----------------------------------------

    fn sw2hw_srq(&mut self, e: &CmdEntry, n: u32) -> CmdResult {
        let ctx: Srqc = self.read_layout(e)?;
        reserved(&ctx.reserved_at_0x1)?;
        reserved(&ctx.reserved_at_0x2c)?;
        let max = self.cap.log_max_srq_wqes;
        let max_stride = max_recv_log_stride(self.cap.max_recv_sges);
        let hca = self.hca_mut()?;
        let i = hca.index(Table::Srqc, n)?;
        if hca.srqs[i].is_some() {
            return Err(CmdStatus::BadResState);
        }
        ctx.ring
            .validate(None, max_stride, max, hca.mtt_count())
            .map_err(ring_status)?;
        let dbr = ctx.dbr.get();
        let limit = ctx.limit.get();
        if dbr == 0
            || !dbr.is_multiple_of(4)
            || ctx.cqn.get() != 0
            || limit > 1 << ctx.ring.log_entries
        {
            return Err(CmdStatus::BadParam);
        }
        hca.srqs[i] = Some(Srq {
            ring: ctx.ring,
            pd: ctx.pd.get() & 0xFF_FFFF,
            dbr,
            consumer: 0,
            limit,
            error: false,
            users: 0,
        });
        let ctx = self.srq_context(n)?;
        self.write_context(Table::Srqc, n, ctx.as_bytes())?;
        Ok(0)
    }

    fn srq_context(&mut self, n: u32) -> Result<Srqc, CmdStatus> {
        let hca = self.hca_mut()?;
        let i = hca.index(Table::Srqc, n)?;
        let srq = hca.srqs[i].as_ref().ok_or(CmdStatus::BadResState)?;
        Ok(Srqc {
            state: if srq.error {
                SrqState::Error
            } else {
                SrqState::Ready
            }
            .code(),
            pd: Le32::new(srq.pd),
            limit: Le32::new(srq.limit),
            ring: srq.ring,
            dbr: Le64::new(srq.dbr),
            consumer: Le32::new(srq.consumer),
            ..Srqc::default()
        })
    }

    fn hw2sw_srq(&mut self, n: u32) -> CmdResult {
        let hca = self.hca_mut()?;
        let i = hca.index(Table::Srqc, n)?;
        let srq = hca.srqs[i].as_ref().ok_or(CmdStatus::BadResState)?;
        if srq.users != 0 {
            return Err(CmdStatus::ResourceBusy);
        }
        hca.srqs[i] = None;
        self.write_context(Table::Srqc, n, Srqc::default().as_bytes())?;
        Ok(0)
    }

    fn arm_srq(&mut self, n: u32, limit: u64) -> CmdResult {
        let hca = self.hca_mut()?;
        let i = hca.index(Table::Srqc, n)?;
        let srq = hca.srqs[i].as_mut().ok_or(CmdStatus::BadResState)?;
        let limit = u32::try_from(limit).map_err(|_| CmdStatus::BadParam)?;
        if limit > 1 << srq.ring.log_entries {
            return Err(CmdStatus::BadParam);
        }
        srq.limit = limit;
        let ctx = self.srq_context(n)?;
        self.write_context(Table::Srqc, n, ctx.as_bytes())?;
        Ok(0)
    }

    // ----- memory protection and translation ----------------------------

    fn sw2hw_mpt(&mut self, e: &CmdEntry, n: u32) -> CmdResult {
        let entry: MptEntry = self.read_layout(e)?;
        reserved(&[entry.reserved_at_0x3])?;
        reserved(&entry.reserved_at_0x21)?;
        reserved(&entry.reserved_at_0x34)?;
        let kind = MptKind::from_code(entry.kind).map_err(|_| CmdStatus::BadParam)?;
        let access = AccessFlags::from_bits(entry.access.get()).ok_or(CmdStatus::BadParam)?;
        let hca = self.hca_mut()?;
        let i = hca.index(Table::Mpt, n)?;
        if hca.mpts[i].kind != MptKind::Free.code() {
            return Err(CmdStatus::BadResState);
        }
        if entry.pd.get() >> 24 != 0 || entry.window_count.get() != 0 {
            return Err(CmdStatus::BadParam);
        }
        match kind {
            MptKind::Free => return Err(CmdStatus::BadParam),
            MptKind::Region => {
                let page_ok = PAGE_SHIFT_RANGE.contains(&entry.log_page_size)
                    && u64::from(entry.page_offset.get()) < 1 << entry.log_page_size;
                let pages = mtt_pages(
                    entry.page_offset.get(),
                    entry.log_page_size,
                    entry.length.get(),
                );
                let in_table = pages.is_some_and(|p| {
                    u64::from(entry.mtt_index.get()).saturating_add(p) <= hca.mtt_count()
                });
                let range_ok = entry.start.get().checked_add(entry.length.get()).is_some();
                if entry.state != 1
                    || !page_ok
                    || !in_table
                    || !range_ok
                    || !access.is_valid_for_region()
                    || entry.bound_mr.get() != 0
                    || entry.bound_qpn.get() != 0
                {
                    return Err(CmdStatus::BadParam);
                }
            }
            MptKind::WindowType1 | MptKind::WindowType2 => {
                // Windows start unbound, with no translation of their own.
                let unbound = entry.state == 0
                    && entry.mtt_index.get() == 0
                    && entry.start.get() == 0
                    && entry.length.get() == 0
                    && entry.log_page_size == 0
                    && entry.page_offset.get() == 0
                    && entry.bound_mr.get() == 0
                    && entry.bound_qpn.get() == 0;
                if !unbound {
                    return Err(CmdStatus::BadParam);
                }
            }
        }
        hca.mpts[i] = entry;
        self.write_context(Table::Mpt, n, entry.as_bytes())?;
        Ok(0)
    }

    fn hw2sw_mpt(&mut self, n: u32) -> CmdResult {
        let hca = self.hca_mut()?;
        let i = hca.index(Table::Mpt, n)?;
        let entry = hca.mpts[i];
        let kind = MptKind::from_code(entry.kind).map_err(|_| CmdStatus::BadResState)?;
        match kind {
            MptKind::Free => return Err(CmdStatus::BadResState),
            MptKind::Region if entry.window_count.get() != 0 => {
                return Err(CmdStatus::ResourceBusy);
            }
            MptKind::WindowType1 | MptKind::WindowType2 if entry.state == 1 => {
                unbind_from_region(&mut hca.mpts, entry.bound_mr.get());
            }
            _ => {}
        }
        hca.mpts[i] = MptEntry::default();
        self.write_context(Table::Mpt, n, MptEntry::default().as_bytes())?;
        Ok(0)
    }

    fn write_mtt(&mut self, e: &CmdEntry) -> CmdResult {
        let bytes = self.read_mailbox(e)?;
        let (header, rest) =
            WriteMttHeader::read_from_prefix(&bytes).map_err(|_| CmdStatus::BadMailbox)?;
        if rest.is_empty() || rest.len() % MTT_ENTRY_SIZE != 0 {
            return Err(CmdStatus::BadMailbox);
        }
        let entries = <[Le64]>::ref_from_bytes(rest).map_err(|_| CmdStatus::BadMailbox)?;
        let first = header.first_index.get();
        let hca = self.hca_mut()?;
        let end = first
            .checked_add(entries.len() as u64)
            .filter(|&end| end <= hca.mtt_count())
            .ok_or(CmdStatus::BadIndex)?;
        if entries.iter().any(|a| a.get() % 4096 != 0) {
            return Err(CmdStatus::BadParam);
        }
        for (slot, addr) in hca.mtt.entries[first as usize..end as usize]
            .iter_mut()
            .zip(entries)
        {
            *slot = addr.get();
        }
        let base = hca.table(Table::Mtt).base;
        if self
            .mem
            .write(base + first * MTT_ENTRY_SIZE as u64, rest)
            .is_err()
        {
            self.note_fault();
            return Err(CmdStatus::Internal);
        }
        Ok(0)
    }

    // ----- multicast ----------------------------------------------------

    fn multicast(&mut self, attach: bool, qpn: u32, gid: Gid) -> CmdResult {
        let (max_groups, max_qps) = (
            self.cap.max_mcast_groups.get() as usize,
            self.cap.max_qps_per_mcast_group.get() as usize,
        );
        if !ib_types::mcast::McastGroup::is_multicast_gid(gid) {
            return Err(CmdStatus::BadParam);
        }
        let hca = self.hca_mut()?;
        let i = hca.index(Table::Qpc, qpn)?;
        let qp = hca.qps[i].as_ref().ok_or(CmdStatus::BadResState)?;
        if qp.qp_type != ib_types::qp::QpType::Ud {
            return Err(CmdStatus::BadParam);
        }
        if attach {
            if !hca.mcgs.contains_key(&gid) && hca.mcgs.len() >= max_groups {
                return Err(CmdStatus::ExceedLimit);
            }
            let members = hca.mcgs.entry(gid).or_default();
            if members.contains(&qpn) {
                return Err(CmdStatus::BadResState);
            }
            if members.len() >= max_qps {
                return Err(CmdStatus::ExceedLimit);
            }
            members.push(qpn);
        } else {
            let members = hca.mcgs.get_mut(&gid).ok_or(CmdStatus::BadResState)?;
            let at = members
                .iter()
                .position(|&q| q == qpn)
                .ok_or(CmdStatus::BadResState)?;
            members.remove(at);
            if members.is_empty() {
                hca.mcgs.remove(&gid);
            }
        }
        Ok(0)
    }
}

/// The status of a ring descriptor `validate` refused: a ring larger than
/// the device's limit is "a size beyond the device's limits"
/// (`EXCEED_LIMIT`, PRM 4.4); any other defect is `BAD_PARAM`.
pub(super) fn ring_status(e: BufDescError) -> CmdStatus {
    match e {
        BufDescError::TooLarge { .. } => CmdStatus::ExceedLimit,
        _ => CmdStatus::BadParam,
    }
}

/// Drops one bound window from region `mr`'s count.
pub(super) fn unbind_from_region(mpts: &mut [MptEntry], mr: u32) {
    if let Some(region) = mpts.get_mut(mr as usize) {
        let count = region.window_count.get();
        region.window_count = Le32::new(count.saturating_sub(1));
    }
}

/// Largest receive WQE stride (log2): a 16-byte header plus the SGEs.
pub(super) fn max_recv_log_stride(max_sges: u8) -> u8 {
    let bytes = 16 + 16 * u32::from(max_sges);
    bytes.next_power_of_two().trailing_zeros() as u8
}
