//! A small test-side driver that programs a [`Device`] through the PRM alone:
//! registers, the command queue, context mailboxes, rings, doorbells and
//! doorbell records in a [`SimMemory`]. The device's own tests and the
//! capture tool use it; the real driver is `hca-miniport`.
//!
//! It is deliberately plain — polled commands, one EQ, one UAR page, memory
//! handed out by bump allocation — and panics on its own misuse (a test bug),
//! never on what the device answers: commands return their status, CQEs are
//! returned as read.

use std::collections::VecDeque;
use std::sync::Arc;

use hca_prm::av::Av;
use hca_prm::cmd::{
    CMD_ENTRY_SIZE, CmdEntry, CmdFlags, CmdStatus, DevCap, InitHca, Opcode, Table, TableDesc,
};
use hca_prm::cqe::Cqe;
use hca_prm::ctx::{BufDesc, Cqc, Eqc, ModifyQp, Qpc, QpcFlags, Srqc};
use hca_prm::doorbell::{
    CQ_DOORBELL, CqArm, CqDoorbell, EqDoorbell, SQ_DOORBELL, SqDoorbell, uar_offset,
};
use hca_prm::eqe::{Eqe, Event, EventClass};
use hca_prm::mpt::{MptEntry, MptKind};
use hca_prm::regs::{self, CmdqConfig, Control, Status};
use hca_prm::wqe::{build_recv_wqe, build_send_wqe};
use hca_prm::{Le16, Le32, Le64};
use ib_types::access::AccessFlags;
use ib_types::av::AvAttr;
use ib_types::qp::{QpModify, QpState, QpType};
use ib_types::scalars::{Mtu, Psn, QKey, Qpn};
use ib_types::wr::{LKey, RKey, SendWr, Sge};
use zerocopy::{FromBytes, FromZeros, IntoBytes};

use crate::device::{Device, DeviceConfig};
use crate::fast::FastFabric;
use crate::host::{BufferId, HostMemory, InterruptSink, SIM_PAGE, SimMemory};

/// An interrupt sink that drops every interrupt: for tests that poll.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoIrq;

impl InterruptSink for NoIrq {
    fn raise(&self, _vector: u16) {}
}

/// The ports' IPv4 addresses of [`fast_pair`]'s two devices.
pub const PAIR_IPS: [[u8; 4]; 2] = [[10, 1, 0, 1], [10, 1, 0, 2]];

/// Two devices (one port each, at [`PAIR_IPS`]) on a [`FastFabric`],
/// each over a [`SimMemory`] of its own that it sees through `view`;
/// `direct` chooses direct placement ([`FastFabric::new`]) or the wire
/// path ([`FastFabric::new_wire_path`]). Returns the fabric and the two
/// memories.
pub fn fast_pair(
    direct: bool,
    view: impl Fn(Arc<SimMemory>) -> Arc<dyn HostMemory>,
) -> (FastFabric, Vec<Arc<SimMemory>>) {
    let mems: Vec<Arc<SimMemory>> = (0..2u64)
        .map(|i| Arc::new(SimMemory::new(0x40_0000_0000 * (i + 1))))
        .collect();
    let devices: Vec<Device> = mems
        .iter()
        .zip(PAIR_IPS)
        .zip(0x100u64..)
        .map(|((mem, ip), guid)| {
            Device::new(
                DeviceConfig::with_ports(guid, &[ip]),
                view(mem.clone()),
                Arc::new(NoIrq),
            )
        })
        .collect();
    let fabric = if direct {
        FastFabric::new(devices)
    } else {
        FastFabric::new_wire_path(devices)
    };
    (fabric, mems)
}

/// A DMA-mapped host buffer.
#[derive(Debug, Clone, Copy)]
pub struct DmaBuf {
    /// The host buffer.
    pub id: BufferId,
    /// Its bus address (mapped whole).
    pub bus: u64,
    /// Its length in bytes (a multiple of the page size).
    pub len: u64,
}

/// A completion queue as the driver tracks it.
#[derive(Debug)]
pub struct Cq {
    /// CQ number.
    pub cqn: u32,
    ring: DmaBuf,
    dbr: DmaBuf,
    log_entries: u8,
    /// CQEs consumed.
    pub consumer: u32,
}

impl Cq {
    /// The ring's host buffer (for DMA-fault tests that unmap it).
    pub fn ring_buf(&self) -> DmaBuf {
        self.ring
    }

    /// Entries in the ring (log2).
    pub fn log_entries(&self) -> u8 {
        self.log_entries
    }
}

/// A QP as the driver tracks it.
#[derive(Debug)]
pub struct Qp {
    /// QP number (table index).
    pub qpn: u32,
    /// Transport.
    pub qp_type: QpType,
    sq: DmaBuf,
    sq_log: u8,
    rq: DmaBuf,
    rq_log: u8,
    rq_stride: usize,
    rq_dbr: DmaBuf,
    /// Send basic blocks posted.
    pub sq_producer: u32,
    /// Receive WQEs posted.
    pub rq_producer: u32,
    /// `wr_id` by send `wqe_index` (the device never stores it).
    pub send_ids: WrIds,
    /// `wr_id` by receive `wqe_index`.
    pub recv_ids: WrIds,
}

impl Qp {
    /// The send ring's host buffer (for DMA-fault tests that unmap it).
    pub fn sq_buf(&self) -> DmaBuf {
        self.sq
    }
}

/// A shared receive queue.
#[derive(Debug)]
pub struct Srq {
    /// SRQ number.
    pub srqn: u32,
    ring: DmaBuf,
    log: u8,
    stride: usize,
    dbr: DmaBuf,
    /// WQEs posted.
    pub producer: u32,
    /// `wr_id` by `wqe_index`.
    pub ids: WrIds,
}

/// The `wr_id`s of a work queue's WQEs, kept by the driver (the device
/// never stores them) in a shadow ring indexed by `wqe_index`.
#[derive(Debug, Clone, Default)]
pub struct WrIds(Vec<u64>);

impl WrIds {
    /// A shadow ring for 2^`log` slots (send queues: basic blocks).
    pub fn new(log: u8) -> Self {
        Self(vec![0; 1 << log])
    }

    fn mask(&self) -> usize {
        self.0.len() - 1
    }

    /// Records the `wr_id` of the WQE at `wqe_index`.
    pub fn set(&mut self, wqe_index: u16, wr_id: u64) {
        let m = self.mask();
        self.0[usize::from(wqe_index) & m] = wr_id;
    }

    /// The `wr_id` of the WQE at `wqe_index`.
    pub fn get(&self, wqe_index: u16) -> u64 {
        self.0[usize::from(wqe_index) & self.mask()]
    }
}

/// A memory region: the buffer it covers and its keys.
#[derive(Debug, Clone, Copy)]
pub struct Mr {
    /// The MPT index.
    pub index: u32,
    /// Local key.
    pub lkey: LKey,
    /// Remote key (equal to the local key on this device).
    pub rkey: RKey,
    /// The region's first virtual address.
    pub va: u64,
    /// Its length.
    pub len: u64,
    /// The host buffer behind it.
    pub buf: DmaBuf,
}

/// The test driver of one device.
#[derive(Debug)]
pub struct Driver {
    /// The device's memory.
    pub mem: Arc<SimMemory>,
    /// What `QUERY_DEV_CAP` said.
    pub cap: DevCap,
    cmdq: DmaBuf,
    cmdq_log: u8,
    cmd_producer: u32,
    mailbox_in: DmaBuf,
    mailbox_out: DmaBuf,
    mtt_next: u32,
    mpt_next: u32,
    cqn_next: u32,
    qpn_next: u32,
    srqn_next: u32,
    eq_ring: DmaBuf,
    eq_log: u8,
    eq_consumer: u32,
    /// Events read from the EQ and not yet taken.
    pub events: VecDeque<Event>,
    va_next: u64,
}

/// The largest receive WQE stride the driver uses (16 SGEs).
const MAX_RECV_STRIDE: usize = 512;

/// Log2 sizes of the context tables the driver asks for.
const TABLE_LOGS: [(Table, u8); 6] = [
    (Table::Qpc, 8),
    (Table::Cqc, 8),
    (Table::Eqc, 2),
    (Table::Srqc, 4),
    (Table::Mpt, 10),
    (Table::Mtt, 14),
];

impl Driver {
    /// Resets the device and brings it up: command queue, capabilities,
    /// context tables, one EQ (number 0, vector 0) taking every event class,
    /// and every port initialised.
    pub fn bring_up(dev: &mut Device, mem: Arc<SimMemory>) -> Self {
        assert_eq!(dev.mmio_read32(regs::offset::MAGIC), regs::MAGIC_VALUE);
        dev.mmio_write32(regs::offset::CONTROL, Control::RESET.bits());
        assert!(
            Status::from_bits_retain(dev.mmio_read32(regs::offset::STATUS)).contains(Status::READY)
        );
        let mut me = Self {
            cmdq: DmaBuf {
                id: mem.alloc(4096),
                bus: 0,
                len: 4096,
            },
            mailbox_in: DmaBuf {
                id: mem.alloc(4096),
                bus: 0,
                len: 4096,
            },
            mailbox_out: DmaBuf {
                id: mem.alloc(4096),
                bus: 0,
                len: 4096,
            },
            eq_ring: DmaBuf {
                id: mem.alloc(8192),
                bus: 0,
                len: 8192,
            },
            mem,
            cap: DevCap::new_zeroed(),
            cmdq_log: 4,
            cmd_producer: 0,
            mtt_next: 0,
            mpt_next: 1,
            cqn_next: 0,
            qpn_next: 0,
            srqn_next: 0,
            eq_log: 8,
            eq_consumer: 0,
            events: VecDeque::new(),
            va_next: 0x7f00_0000_0000,
        };
        for buf in [
            &mut me.cmdq,
            &mut me.mailbox_in,
            &mut me.mailbox_out,
            &mut me.eq_ring,
        ] {
            buf.bus = me.mem.map(buf.id, 0, buf.len).expect("map");
        }
        dev.mmio_write64(regs::offset::CMDQ_BASE, me.cmdq.bus);
        dev.mmio_write32(
            regs::offset::CMDQ_CONFIG,
            CmdqConfig {
                log_size: me.cmdq_log,
                enable: true,
            }
            .to_bits(),
        );
        let (status, out) = me.cmd(dev, Opcode::QueryDevCap, 0, 0, &[], 256);
        assert_eq!(status, CmdStatus::Ok);
        me.cap = DevCap::read_from_bytes(&out).expect("256 bytes");
        me.qpn_next = 2 * u32::from(me.cap.num_ports);
        // Context tables.
        let mut init = InitHca::new_zeroed();
        let sizes = [256u64, 64, 64, 64, 64, 8];
        for (table, log) in TABLE_LOGS {
            let len = (sizes[usize::from(table.code())] << log).next_multiple_of(SIM_PAGE);
            let buf = me.dma(len as usize);
            init.tables[usize::from(table.code())] = TableDesc {
                base: Le64::new(buf.bus),
                log_count: log,
                ..TableDesc::default()
            };
        }
        init.num_uars = Le16::new(16);
        init.log_page_size = 12;
        assert_eq!(
            me.cmd(dev, Opcode::InitHca, 0, 0, init.as_bytes(), 0).0,
            CmdStatus::Ok
        );
        // EQ 0 over one MTT range.
        let mtt = me.write_mtt(dev, me.eq_ring);
        let eqc = Eqc {
            ring: BufDesc {
                mtt_index: Le32::new(mtt),
                log_page_size: 12,
                log_entries: me.eq_log,
                log_stride: 5,
                ..BufDesc::default()
            },
            ..Eqc::default()
        };
        assert_eq!(
            me.cmd(dev, Opcode::Sw2HwEq, 0, 0, eqc.as_bytes(), 0).0,
            CmdStatus::Ok
        );
        let classes = EventClass::all().bits();
        assert_eq!(
            me.cmd_param(dev, Opcode::MapEq, 0, classes).0,
            CmdStatus::Ok
        );
        me.arm_eq(dev);
        for port in 1..=me.cap.num_ports {
            assert_eq!(
                me.cmd_param(dev, Opcode::InitPort, u32::from(port), 0).0,
                CmdStatus::Ok
            );
        }
        me
    }

    /// Allocates and maps a zeroed DMA buffer of at least `len` bytes.
    pub fn dma(&self, len: usize) -> DmaBuf {
        let len = (len as u64).max(1).next_multiple_of(SIM_PAGE);
        let id = self.mem.alloc(len as usize);
        let bus = self.mem.map(id, 0, len).expect("map");
        DmaBuf { id, bus, len }
    }

    /// Runs a command in polled mode with `input` in the input mailbox and
    /// `out_len` bytes of output mailbox; returns the status and output.
    pub fn cmd(
        &mut self,
        dev: &mut Device,
        op: Opcode,
        op_mod: u16,
        in_mod: u32,
        input: &[u8],
        out_len: usize,
    ) -> (CmdStatus, Vec<u8>) {
        let mut e = CmdEntry {
            opcode: Le16::new(op.code()),
            op_mod: Le16::new(op_mod),
            token: Le16::new(self.cmd_producer as u16),
            in_mod: Le32::new(in_mod),
            ..CmdEntry::default()
        };
        if !input.is_empty() {
            self.mem.cpu_write(self.mailbox_in.id, 0, input);
            e.in_param = Le64::new(self.mailbox_in.bus);
            e.in_len = Le32::new(input.len() as u32);
        }
        if out_len > 0 {
            e.out_param = Le64::new(self.mailbox_out.bus);
            e.out_len = Le32::new(out_len as u32);
        }
        let (status, _) = self.submit(dev, e);
        let mut out = vec![0u8; out_len];
        self.mem.cpu_read(self.mailbox_out.id, 0, &mut out);
        (status, out)
    }

    /// Runs a command whose input is the immediate `in_param`.
    pub fn cmd_param(
        &mut self,
        dev: &mut Device,
        op: Opcode,
        in_mod: u32,
        in_param: u64,
    ) -> (CmdStatus, u64) {
        let e = CmdEntry {
            opcode: Le16::new(op.code()),
            in_mod: Le32::new(in_mod),
            in_param: Le64::new(in_param),
            ..CmdEntry::default()
        };
        self.submit(dev, e)
    }

    /// Submits a command entry exactly as given (raw opcode, reserved
    /// bytes, mailbox addresses) in polled mode; returns its status and
    /// immediate output. For tests of malformed commands.
    pub fn cmd_raw(&mut self, dev: &mut Device, e: CmdEntry) -> (CmdStatus, u64) {
        self.submit(dev, e)
    }

    /// The bus address of the driver's input mailbox (4 KiB).
    pub fn mailbox_in_bus(&self) -> u64 {
        self.mailbox_in.bus
    }

    /// Writes an entry, rings `CMDQ_DOORBELL`, and reads the completion.
    fn submit(&mut self, dev: &mut Device, e: CmdEntry) -> (CmdStatus, u64) {
        let size = 1u32 << self.cmdq_log;
        let counter = self.cmd_producer;
        let slot = (counter & (size - 1)) as usize * CMD_ENTRY_SIZE;
        self.mem.cpu_write(self.cmdq.id, slot, e.as_bytes());
        self.cmd_producer = counter.wrapping_add(1);
        dev.mmio_write32(regs::offset::CMDQ_DOORBELL, self.cmd_producer);
        let mut raw = [0u8; CMD_ENTRY_SIZE];
        self.mem.cpu_read(self.cmdq.id, slot, &mut raw);
        let done = CmdEntry::read_from_bytes(&raw).expect("64 bytes");
        assert_eq!(
            done.done,
            hca_prm::owner::phase_for(counter, self.cmdq_log),
            "command did not complete"
        );
        (
            CmdStatus::from_code(done.status).unwrap_or(CmdStatus::Internal),
            done.out_imm.get(),
        )
    }

    /// Runs a command with completion by event and returns the event's
    /// status.
    pub fn cmd_by_event(
        &mut self,
        dev: &mut Device,
        op: Opcode,
        in_mod: u32,
        in_param: u64,
    ) -> Option<(u16, u8)> {
        let token = 0x4000 | (self.cmd_producer as u16 & 0x3FFF);
        let size = 1u32 << self.cmdq_log;
        let counter = self.cmd_producer;
        let e = CmdEntry {
            opcode: Le16::new(op.code()),
            token: Le16::new(token),
            flags: CmdFlags::EVENT.bits(),
            in_mod: Le32::new(in_mod),
            in_param: Le64::new(in_param),
            ..CmdEntry::default()
        };
        let slot = (counter & (size - 1)) as usize * CMD_ENTRY_SIZE;
        self.mem.cpu_write(self.cmdq.id, slot, e.as_bytes());
        self.cmd_producer = counter.wrapping_add(1);
        dev.mmio_write32(regs::offset::CMDQ_DOORBELL, self.cmd_producer);
        self.poll_eq(dev);
        let at = self
            .events
            .iter()
            .position(|ev| matches!(ev, Event::CmdCompletion { token: t, .. } if *t == token))?;
        match self.events.remove(at)? {
            Event::CmdCompletion { token, status, .. } => Some((token, status)),
            _ => None,
        }
    }

    /// Reads every new EQE into `events`, frees the ring space and re-arms.
    pub fn poll_eq(&mut self, dev: &mut Device) {
        loop {
            let slot = (self.eq_consumer & ((1 << self.eq_log) - 1)) as usize * 32;
            let mut raw = [0u8; 32];
            self.mem.cpu_read(self.eq_ring.id, slot, &mut raw);
            let eqe = Eqe::read_from_bytes(&raw).expect("32 bytes");
            if !eqe.is_valid(self.eq_consumer, self.eq_log) {
                break;
            }
            if let Ok(ev) = eqe.decode() {
                self.events.push_back(ev);
            }
            self.eq_consumer = self.eq_consumer.wrapping_add(1);
        }
        self.arm_eq(dev);
    }

    fn arm_eq(&mut self, dev: &mut Device) {
        let db = EqDoorbell {
            consumer: self.eq_consumer,
            arm: true,
        };
        dev.mmio_write32(regs::eq_doorbell_offset(0).expect("EQ 0"), db.encode());
    }

    /// Writes MTT entries for every page of `buf` (as many `WRITE_MTT`
    /// commands as one mailbox per 511 entries needs); returns the first
    /// index.
    pub fn write_mtt(&mut self, dev: &mut Device, buf: DmaBuf) -> u32 {
        let first = self.mtt_next;
        let pages = buf.len / SIM_PAGE;
        let per_command = hca_prm::cmd::MAX_MTT_PER_WRITE as u64;
        let mut page = 0;
        while page < pages {
            let count = (pages - page).min(per_command);
            let mut input = Vec::with_capacity(8 + 8 * count as usize);
            input.extend_from_slice(&(u64::from(first) + page).to_le_bytes());
            for p in page..page + count {
                input.extend_from_slice(&(buf.bus + p * SIM_PAGE).to_le_bytes());
            }
            assert_eq!(
                self.cmd(dev, Opcode::WriteMtt, 0, 0, &input, 0).0,
                CmdStatus::Ok
            );
            page += count;
        }
        self.mtt_next += pages as u32;
        first
    }

    fn ring_desc(
        &mut self,
        dev: &mut Device,
        buf: DmaBuf,
        log_entries: u8,
        log_stride: u8,
    ) -> BufDesc {
        let mtt = self.write_mtt(dev, buf);
        BufDesc {
            mtt_index: Le32::new(mtt),
            log_page_size: 12,
            log_entries,
            log_stride,
            ..BufDesc::default()
        }
    }

    /// Creates a CQ of `2^log_entries` entries on EQ 0, UAR 0.
    pub fn create_cq(&mut self, dev: &mut Device, log_entries: u8) -> Result<Cq, CmdStatus> {
        let ring = self.dma(32 << log_entries);
        let dbr = self.dma(4);
        let desc = self.ring_desc(dev, ring, log_entries, 5);
        let cqc = Cqc {
            ring: desc,
            ci_dbr: Le64::new(dbr.bus),
            ..Cqc::default()
        };
        let cqn = self.cqn_next;
        let (status, _) = self.cmd(dev, Opcode::Sw2HwCq, 0, cqn, cqc.as_bytes(), 0);
        if status != CmdStatus::Ok {
            return Err(status);
        }
        self.cqn_next += 1;
        Ok(Cq {
            cqn,
            ring,
            dbr,
            log_entries,
            consumer: 0,
        })
    }

    /// `RESIZE_CQ` to `2^log_entries` entries (PRM 6.2). On success the
    /// driver switches to the new ring with its consumer counter at 0 (the
    /// device copied the unpolled CQEs to its first slots); on failure the
    /// old ring stays in use.
    pub fn resize_cq(&mut self, dev: &mut Device, cq: &mut Cq, log_entries: u8) -> CmdStatus {
        let ring = self.dma(32 << log_entries);
        let desc = self.ring_desc(dev, ring, log_entries, 5);
        let input = hca_prm::ctx::ResizeCq {
            ring: desc,
            reserved_at_0x10: [0; 16],
        };
        let (status, _) = self.cmd(dev, Opcode::ResizeCq, 0, cq.cqn, input.as_bytes(), 0);
        if status == CmdStatus::Ok {
            cq.ring = ring;
            cq.log_entries = log_entries;
            cq.consumer = 0;
            self.mem.cpu_write(cq.dbr.id, 0, &0u32.to_le_bytes());
        }
        status
    }

    /// Polls one CQE; publishes the consumer counter.
    pub fn poll_cq(&mut self, cq: &mut Cq) -> Option<Cqe> {
        let slot = (cq.consumer & ((1 << cq.log_entries) - 1)) as usize * 32;
        let mut raw = [0u8; 32];
        self.mem.cpu_read(cq.ring.id, slot, &mut raw);
        let cqe = Cqe::read_from_bytes(&raw).expect("32 bytes");
        if !cqe.is_valid(cq.consumer, cq.log_entries) {
            return None;
        }
        cq.consumer = cq.consumer.wrapping_add(1);
        self.mem.cpu_write(cq.dbr.id, 0, &cq.consumer.to_le_bytes());
        Some(cqe)
    }

    /// Polls every available CQE.
    pub fn drain_cq(&mut self, cq: &mut Cq) -> Vec<Cqe> {
        std::iter::from_fn(|| self.poll_cq(cq)).collect()
    }

    /// Arms a CQ through UAR 0.
    pub fn arm_cq(&mut self, dev: &mut Device, cq: &Cq, cmd: CqArm) {
        let db = CqDoorbell::new(cq.cqn, cmd, cq.consumer).expect("24-bit CQN");
        dev.mmio_write64(uar_offset(0) + CQ_DOORBELL, db.encode());
    }

    /// Allocates a host buffer of `len` bytes and registers it in `pd` with
    /// `access`, at a fresh virtual address.
    pub fn reg_mr(
        &mut self,
        dev: &mut Device,
        len: usize,
        pd: u32,
        access: AccessFlags,
    ) -> Result<Mr, CmdStatus> {
        let buf = self.dma(len);
        let mtt = self.write_mtt(dev, buf);
        let index = self.mpt_next;
        let tag = (index as u8).wrapping_mul(37) | 1;
        let va = self.va_next;
        self.va_next += buf.len + SIM_PAGE;
        let entry = MptEntry {
            kind: MptKind::Region.code(),
            state: 1,
            tag,
            access: Le32::new(access.bits()),
            pd: Le32::new(pd),
            mtt_index: Le32::new(mtt),
            start: Le64::new(va),
            length: Le64::new(len as u64),
            log_page_size: 12,
            ..MptEntry::default()
        };
        let (status, _) = self.cmd(dev, Opcode::Sw2HwMpt, 0, index, entry.as_bytes(), 0);
        if status != CmdStatus::Ok {
            return Err(status);
        }
        self.mpt_next += 1;
        let key = index << 8 | u32::from(tag);
        Ok(Mr {
            index,
            lkey: LKey::new(key),
            rkey: RKey::new(key),
            va,
            len: len as u64,
            buf,
        })
    }

    /// Allocates an (unbound) memory window entry of `kind` in `pd`; returns
    /// its MPT index.
    pub fn alloc_mw(&mut self, dev: &mut Device, pd: u32, kind: MptKind) -> Result<u32, CmdStatus> {
        let index = self.mpt_next;
        let entry = MptEntry {
            kind: kind.code(),
            pd: Le32::new(pd),
            tag: 1,
            ..MptEntry::default()
        };
        let (status, _) = self.cmd(dev, Opcode::Sw2HwMpt, 0, index, entry.as_bytes(), 0);
        if status != CmdStatus::Ok {
            return Err(status);
        }
        self.mpt_next += 1;
        Ok(index)
    }

    /// Creates a QP with `2^sq_log` send basic blocks and `2^rq_log`
    /// receive WQEs of 4 SGEs, on UAR 0; special QPs take their port's slot.
    #[allow(
        clippy::too_many_arguments,
        reason = "a QP has this many creation attributes"
    )]
    pub fn create_qp(
        &mut self,
        dev: &mut Device,
        qp_type: QpType,
        port: u8,
        pd: u32,
        send_cq: &Cq,
        recv_cq: &Cq,
        srq: Option<&Srq>,
        logs: (u8, u8),
    ) -> Result<Qp, CmdStatus> {
        self.create_qp_with_flags(
            dev,
            qp_type,
            port,
            pd,
            (send_cq, recv_cq),
            srq,
            logs,
            QpcFlags::empty(),
        )
    }

    /// [`Driver::create_qp`] with extra QPC flags (`SQ_SIG_ALL`, `SQD_EVENT`;
    /// `HAS_SRQ` follows `srq`). `cqs` is (send CQ, receive CQ).
    #[allow(
        clippy::too_many_arguments,
        reason = "a QP has this many creation attributes"
    )]
    pub fn create_qp_with_flags(
        &mut self,
        dev: &mut Device,
        qp_type: QpType,
        port: u8,
        pd: u32,
        cqs: (&Cq, &Cq),
        srq: Option<&Srq>,
        logs: (u8, u8),
        flags: QpcFlags,
    ) -> Result<Qp, CmdStatus> {
        let (send_cq, recv_cq) = cqs;
        let (sq_log, rq_log) = logs;
        let rq_stride: usize = 16 + 16 * 4;
        let rq_stride = rq_stride.next_power_of_two();
        let sq = self.dma(64 << sq_log);
        let rq = self.dma(rq_stride << rq_log);
        let rq_dbr = self.dma(4);
        let mut qpc = Qpc::new_zeroed();
        qpc.qp_type = qp_type.code();
        qpc.port = port;
        qpc.pd = Le32::new(pd);
        qpc.send_cqn = Le32::new(send_cq.cqn);
        qpc.recv_cqn = Le32::new(recv_cq.cqn);
        qpc.sq = self.ring_desc(dev, sq, sq_log, 6);
        qpc.flags = (flags - QpcFlags::HAS_SRQ).bits();
        if let Some(srq) = srq {
            qpc.flags |= QpcFlags::HAS_SRQ.bits();
            qpc.srqn = Le32::new(srq.srqn);
        } else {
            qpc.rq = self.ring_desc(dev, rq, rq_log, rq_stride.trailing_zeros() as u8);
            qpc.rq_dbr = Le64::new(rq_dbr.bus);
        }
        let qpn = match qp_type {
            // Port 0 (refused by the device) maps to port 1's slots.
            QpType::Smi => 2 * u32::from(port.saturating_sub(1)),
            QpType::Gsi => 2 * u32::from(port.saturating_sub(1)) + 1,
            _ => self.qpn_next,
        };
        let (status, _) = self.cmd(dev, Opcode::Sw2HwQp, 0, qpn, qpc.as_bytes(), 0);
        if status != CmdStatus::Ok {
            return Err(status);
        }
        if !qp_type.is_special() {
            self.qpn_next += 1;
        }
        Ok(Qp {
            qpn,
            qp_type,
            sq,
            sq_log,
            rq,
            rq_log,
            rq_stride,
            rq_dbr,
            sq_producer: 0,
            rq_producer: 0,
            send_ids: WrIds::new(sq_log),
            recv_ids: WrIds::new(rq_log),
        })
    }

    /// Creates an SRQ of `2^log` WQEs of 4 SGEs in `pd`.
    pub fn create_srq(
        &mut self,
        dev: &mut Device,
        pd: u32,
        log: u8,
        limit: u32,
    ) -> Result<Srq, CmdStatus> {
        let stride = (16usize + 16 * 4).next_power_of_two();
        let ring = self.dma(stride << log);
        let dbr = self.dma(4);
        let srqc = Srqc {
            pd: Le32::new(pd),
            limit: Le32::new(limit),
            ring: self.ring_desc(dev, ring, log, stride.trailing_zeros() as u8),
            dbr: Le64::new(dbr.bus),
            ..Srqc::default()
        };
        let srqn = self.srqn_next;
        let (status, _) = self.cmd(dev, Opcode::Sw2HwSrq, 0, srqn, srqc.as_bytes(), 0);
        if status != CmdStatus::Ok {
            return Err(status);
        }
        self.srqn_next += 1;
        Ok(Srq {
            srqn,
            ring,
            log,
            stride,
            dbr,
            producer: 0,
            ids: WrIds::new(log),
        })
    }

    /// `MODIFY_QP` with the attributes of `m` (the AV converted to the PRM
    /// layout). Returns the command status.
    pub fn modify_qp(&mut self, dev: &mut Device, qp: &Qp, m: &QpModify) -> CmdStatus {
        let mut input = ModifyQp::new_zeroed();
        input.attr_mask = Le32::new(m.mask().bits());
        input.next_state = m.state.map_or(0, QpState::code);
        input.cur_state = m.cur_state.map_or(0, QpState::code);
        let c = &mut input.qpc;
        if let Some(p) = m.port {
            c.port = p.get();
        }
        if let Some(k) = m.qkey {
            c.qkey = Le32::new(k.get());
        }
        if let Some(a) = m.access {
            c.access = Le32::new(a.bits());
        }
        if let Some(i) = m.pkey_index {
            c.pkey_index = Le16::new(i);
        }
        if let Some(av) = m.av {
            c.av = Av::try_from(&av).expect("RoCE AV");
        }
        if let Some(mtu) = m.path_mtu {
            c.path_mtu = mtu.code();
        }
        c.timeout = m.timeout.unwrap_or(0);
        c.retry_cnt = m.retry_cnt.unwrap_or(0);
        c.rnr_retry = m.rnr_retry.unwrap_or(0);
        c.min_rnr_timer = m.min_rnr_timer.unwrap_or(0);
        c.max_rd_atomic = m.max_rd_atomic.unwrap_or(0);
        c.max_dest_rd_atomic = m.max_dest_rd_atomic.unwrap_or(0);
        if let Some(p) = m.sq_psn {
            c.sq_psn = Le32::new(p.get());
        }
        if let Some(p) = m.rq_psn {
            c.rq_psn = Le32::new(p.get());
        }
        if let Some(q) = m.dest_qpn {
            c.dest_qpn = Le32::new(q.get());
        }
        if m.en_sqd_async_notify == Some(true) {
            c.flags = QpcFlags::SQD_EVENT.bits();
        }
        self.cmd(dev, Opcode::ModifyQp, 0, qp.qpn, input.as_bytes(), 0)
            .0
    }

    /// `QUERY_QP`.
    pub fn query_qp(&mut self, dev: &mut Device, qpn: u32) -> Result<Qpc, CmdStatus> {
        let (status, out) = self.cmd(dev, Opcode::QueryQp, 0, qpn, &[], 256);
        if status != CmdStatus::Ok {
            return Err(status);
        }
        Ok(Qpc::read_from_bytes(&out).expect("256 bytes"))
    }

    /// Posts a send WR (UD sends pass their address vector); rings the
    /// doorbell unless `ring` is false.
    pub fn post_send(
        &mut self,
        dev: &mut Device,
        qp: &mut Qp,
        wr: &SendWr<'_>,
        av: Option<&Av>,
        inline: Option<&[u8]>,
        ring: bool,
    ) -> Result<(), hca_prm::wqe::WqeError> {
        let mut scratch = [0u8; 512];
        let index = qp.sq_producer as u16;
        let len = build_send_wqe(wr, av, index, inline, &mut scratch)?;
        let bbs = len.div_ceil(64) as u32;
        let mask = (1u32 << qp.sq_log) - 1;
        for i in 0..bbs {
            let slot = (qp.sq_producer.wrapping_add(i) & mask) as usize * 64;
            self.mem.cpu_write(
                qp.sq.id,
                slot,
                &scratch[i as usize * 64..(i as usize + 1) * 64],
            );
        }
        qp.send_ids.set(index, wr.wr_id);
        qp.sq_producer = qp.sq_producer.wrapping_add(bbs);
        if ring {
            self.ring_sq(dev, qp);
        }
        Ok(())
    }

    /// Posts an already built send WQE (for WQEs verbs cannot express, such
    /// as a type 1 window bind); its `wqe_index` is replaced by the slot's.
    /// Rings the doorbell unless `ring` is false.
    pub fn post_wqe(
        &mut self,
        dev: &mut Device,
        qp: &mut Qp,
        wqe: &hca_prm::wqe::SendWqe<'_>,
        wr_id: u64,
        ring: bool,
    ) -> Result<(), hca_prm::wqe::WqeError> {
        let mut scratch = [0u8; 512];
        let index = qp.sq_producer as u16;
        let wqe = hca_prm::wqe::SendWqe {
            wqe_index: index,
            ..*wqe
        };
        let len = wqe.emit(&mut scratch)?;
        let bbs = len.div_ceil(64) as u32;
        let mask = (1u32 << qp.sq_log) - 1;
        for i in 0..bbs {
            let slot = (qp.sq_producer.wrapping_add(i) & mask) as usize * 64;
            self.mem.cpu_write(
                qp.sq.id,
                slot,
                &scratch[i as usize * 64..(i as usize + 1) * 64],
            );
        }
        qp.send_ids.set(index, wr_id);
        qp.sq_producer = qp.sq_producer.wrapping_add(bbs);
        if ring {
            self.ring_sq(dev, qp);
        }
        Ok(())
    }

    /// Rings the send doorbell with the current producer counter.
    pub fn ring_sq(&self, dev: &mut Device, qp: &Qp) {
        let db = SqDoorbell {
            qpn: Qpn::from_low_bits(qp.qpn),
            producer: qp.sq_producer,
        };
        dev.mmio_write64(uar_offset(0) + SQ_DOORBELL, db.encode());
    }

    /// Writes raw bytes into the send ring at basic block `bb` (for
    /// garbage-WQE tests).
    pub fn write_sq_raw(&self, qp: &Qp, bb: u32, bytes: &[u8; 64]) {
        let slot = (bb & ((1u32 << qp.sq_log) - 1)) as usize * 64;
        self.mem.cpu_write(qp.sq.id, slot, bytes);
    }

    /// Writes raw bytes over receive WQE slot `index` of the QP's own RQ
    /// (for garbage-WQE tests); the doorbell record is not touched.
    pub fn write_rq_raw(&self, qp: &Qp, index: u32, bytes: &[u8]) {
        assert!(bytes.len() <= qp.rq_stride, "one WQE stride at most");
        let slot = (index & ((1u32 << qp.rq_log) - 1)) as usize * qp.rq_stride;
        self.mem.cpu_write(qp.rq.id, slot, bytes);
    }

    /// Posts a receive WR to the QP's own RQ (no MMIO: doorbell record).
    pub fn post_recv(&mut self, qp: &mut Qp, wr_id: u64, sges: &[Sge]) {
        let index = qp.rq_producer as u16;
        let mut buf = [0u8; MAX_RECV_STRIDE];
        let wqe = &mut buf[..qp.rq_stride];
        build_recv_wqe(sges, index, qp.rq_stride, wqe).expect("fits the stride");
        let slot = (qp.rq_producer & ((1u32 << qp.rq_log) - 1)) as usize * qp.rq_stride;
        self.mem.cpu_write(qp.rq.id, slot, wqe);
        qp.recv_ids.set(index, wr_id);
        qp.rq_producer = qp.rq_producer.wrapping_add(1);
        self.mem
            .cpu_write(qp.rq_dbr.id, 0, &qp.rq_producer.to_le_bytes());
    }

    /// Posts a receive WR to an SRQ.
    pub fn post_srq_recv(&mut self, srq: &mut Srq, wr_id: u64, sges: &[Sge]) {
        let index = srq.producer as u16;
        let mut buf = [0u8; MAX_RECV_STRIDE];
        let wqe = &mut buf[..srq.stride];
        build_recv_wqe(sges, index, srq.stride, wqe).expect("fits the stride");
        let slot = (srq.producer & ((1u32 << srq.log) - 1)) as usize * srq.stride;
        self.mem.cpu_write(srq.ring.id, slot, wqe);
        srq.ids.set(index, wr_id);
        srq.producer = srq.producer.wrapping_add(1);
        self.mem
            .cpu_write(srq.dbr.id, 0, &srq.producer.to_le_bytes());
    }

    /// Writes `data` into a region at offset `at`.
    pub fn write_mr(&self, mr: &Mr, at: usize, data: &[u8]) {
        self.mem.cpu_write(mr.buf.id, at, data);
    }

    /// Reads `len` bytes of a region at offset `at`.
    pub fn read_mr(&self, mr: &Mr, at: usize, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        self.mem.cpu_read(mr.buf.id, at, &mut out);
        out
    }

    /// An SGE over `len` bytes of a region at offset `at`.
    pub fn sge(mr: &Mr, at: u64, len: u32) -> Sge {
        Sge::new(mr.va + at, len, mr.lkey)
    }
}

/// Modify-QP attribute sets for the usual bring-up of a connected or
/// datagram QP to RTS, on port 1 with P_Key index 0.
pub mod bring_up {
    use super::*;
    use ib_types::scalars::{Gid, PortNum};

    /// RESET -> INIT for RC/UC (with remote rights) or UD (with a Q_Key).
    pub fn to_init(qp_type: QpType, access: AccessFlags, qkey: u32) -> QpModify {
        let mut m = QpModify {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: (!qp_type.is_special()).then_some(PortNum::FIRST),
            ..QpModify::default()
        };
        if qp_type.is_connected() {
            m.access = Some(access);
        } else {
            m.qkey = Some(QKey::new(qkey));
        }
        m
    }

    /// INIT -> RTR towards `dest_ip`/`dest_qpn` (connected) or plain (UD).
    pub fn to_rtr(
        qp_type: QpType,
        dest_ip: [u8; 4],
        dest_qpn: u32,
        rq_psn: u32,
        mtu: Mtu,
    ) -> QpModify {
        let mut m = QpModify::to_state(QpState::Rtr);
        if qp_type.is_connected() {
            m.av = Some(AvAttr::roce(PortNum::FIRST, Gid::from_ipv4(dest_ip), 0));
            m.path_mtu = Some(mtu);
            m.dest_qpn = Some(Qpn::new(dest_qpn).expect("24-bit"));
            m.rq_psn = Some(Psn::new(rq_psn).expect("24-bit"));
            if qp_type == QpType::Rc {
                m.max_dest_rd_atomic = Some(4);
                m.min_rnr_timer = Some(1);
            }
        }
        m
    }

    /// RTR -> RTS with `sq_psn`; RC gets a 4.096 µs·2^`timeout` ACK timeout
    /// and the given retry counts.
    pub fn to_rts(qp_type: QpType, sq_psn: u32, timeout: u8, retry: u8, rnr_retry: u8) -> QpModify {
        let mut m = QpModify {
            state: Some(QpState::Rts),
            sq_psn: Some(Psn::new(sq_psn).expect("24-bit")),
            ..QpModify::default()
        };
        if qp_type == QpType::Rc {
            m.timeout = Some(timeout);
            m.retry_cnt = Some(retry);
            m.rnr_retry = Some(rnr_retry);
            m.max_rd_atomic = Some(4);
        }
        m
    }
}

impl Driver {
    /// Brings `qp` from RESET to RTS towards `peer_ip`/`peer_qpn` (RC and UC:
    /// remote read, write and atomic rights; PSNs start at 0; a 4 ms ACK
    /// timeout, 7 retries, infinite RNR retries).
    pub fn connect(
        &mut self,
        dev: &mut Device,
        qp: &Qp,
        peer_ip: [u8; 4],
        peer_qpn: u32,
        mtu: Mtu,
    ) -> Result<(), CmdStatus> {
        let access =
            AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC;
        let steps = [
            bring_up::to_init(qp.qp_type, access, 0),
            bring_up::to_rtr(qp.qp_type, peer_ip, peer_qpn, 0, mtu),
            bring_up::to_rts(qp.qp_type, 0, 10, 7, 7),
        ];
        for m in &steps {
            let status = self.modify_qp(dev, qp, m);
            if status != CmdStatus::Ok {
                return Err(status);
            }
        }
        Ok(())
    }
}
