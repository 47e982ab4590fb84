//! The command interface (PRM 4, 5): the command queue, mailboxes, and the
//! device-level commands. Object commands are in `resource`.

use hca_prm::cmd::{
    CMD_DONE_OFFSET, CMD_ENTRY_SIZE, CMD_OUTPUT_OFFSET, CmdEntry, CmdFlags, CmdStatus, DevCap,
    InitHca, MAD_BYTES, MAX_MAILBOX_BYTES, Opcode, SetPort, SetPortFlags, Table,
    split_port_table_in_mod,
};
use hca_prm::owner::phase_for;
use hca_prm::regs::{CmdqConfig, FatalSyndrome, Status};
use ib_types::scalars::Gid;
use zerocopy::{FromBytes, IntoBytes};

use super::Device;
use super::resource::Hca;

/// The outcome of one command: its status and immediate output.
pub(super) type CmdResult = Result<u64, CmdStatus>;

/// Reads a fixed-size mailbox layout; the length must match exactly.
pub(super) fn layout<T: FromBytes + zerocopy::KnownLayout + zerocopy::Immutable>(
    bytes: &[u8],
) -> Result<T, CmdStatus> {
    T::read_from_bytes(bytes).map_err(|_| CmdStatus::BadMailbox)
}

/// Fails with `BAD_PARAM` unless every byte is zero.
pub(super) fn reserved(bytes: &[u8]) -> Result<(), CmdStatus> {
    if bytes.iter().all(|&b| b == 0) {
        Ok(())
    } else {
        Err(CmdStatus::BadParam)
    }
}

impl Device {
    pub(super) fn set_cmdq_base(&mut self, base: u64) {
        if !self.cmdq.config.enable {
            self.cmdq.base = base;
        }
    }

    pub(super) fn set_cmdq_config(&mut self, value: u32) {
        let Some(config) = CmdqConfig::from_bits(value) else {
            return;
        };
        if config.enable {
            let usable = self.cmdq.base != 0
                && self.cmdq.base.is_multiple_of(4096)
                && config.log_size <= self.cap.log_max_cmds;
            if !usable {
                return;
            }
            self.cmdq.producer = 0;
            self.cmdq.consumer = 0;
            self.status |= Status::CMDQ_ENABLED;
        } else {
            self.status.remove(Status::CMDQ_ENABLED);
        }
        self.cmdq.config = config;
    }

    /// `CMDQ_DOORBELL`: runs every newly submitted command, in order.
    pub(super) fn cmdq_doorbell(&mut self, producer: u32) {
        if !self.cmdq.config.enable {
            self.counters.dropped_doorbells += 1;
            return;
        }
        let size = 1u32 << self.cmdq.config.log_size;
        // Never run more than a ring's worth: entries beyond that would be
        // slots software has not finished writing.
        let pending = producer.wrapping_sub(self.cmdq.consumer).min(size);
        self.cmdq.producer = producer;
        for _ in 0..pending {
            if self.is_fatal() {
                return;
            }
            let counter = self.cmdq.consumer;
            let slot_addr =
                self.cmdq.base + u64::from(counter & (size - 1)) * CMD_ENTRY_SIZE as u64;
            let mut raw = [0u8; CMD_ENTRY_SIZE];
            if self.mem.read(slot_addr, &mut raw).is_err() {
                self.note_fault();
                self.declare_fatal(FatalSyndrome::DmaFault);
                return;
            }
            self.cmdq.consumer = counter.wrapping_add(1);
            let entry = CmdEntry::read_from_bytes(&raw).expect("64-byte entry");
            let outcome = self.execute(&entry);
            let (status, out_imm) = match outcome {
                Ok(imm) => (CmdStatus::Ok, imm),
                Err(s) => (s, 0),
            };
            self.count_command(status);
            if CmdFlags::from_bits_retain(entry.flags).contains(CmdFlags::EVENT) {
                self.post_cmd_completion(entry.token.get(), status, out_imm);
            } else {
                self.complete_polled(slot_addr, counter, status, out_imm);
            }
        }
    }

    /// Writes `out_imm`, `status`, then the phase bit (PRM 4.2).
    fn complete_polled(&mut self, slot_addr: u64, counter: u32, status: CmdStatus, out_imm: u64) {
        let mut tail = [0u8; CMD_DONE_OFFSET - CMD_OUTPUT_OFFSET];
        tail[..8].copy_from_slice(&out_imm.to_le_bytes());
        tail[8] = status.code();
        let phase = phase_for(counter, self.cmdq.config.log_size);
        let ok = self
            .mem
            .write(slot_addr + CMD_OUTPUT_OFFSET as u64, &tail)
            .is_ok()
            && self
                .mem
                .write(slot_addr + CMD_DONE_OFFSET as u64, &[phase])
                .is_ok();
        if !ok {
            self.note_fault();
            self.declare_fatal(FatalSyndrome::DmaFault);
        }
    }

    /// Reads the input mailbox of `e` (exactly `in_len` bytes).
    pub(super) fn read_mailbox(&mut self, e: &CmdEntry) -> Result<Vec<u8>, CmdStatus> {
        let len = e.in_len.get() as usize;
        if len == 0 || len > MAX_MAILBOX_BYTES || !e.in_param.get().is_multiple_of(8) {
            return Err(CmdStatus::BadMailbox);
        }
        let mut buf = vec![0u8; len];
        if self.mem.read(e.in_param.get(), &mut buf).is_err() {
            self.note_fault();
            return Err(CmdStatus::BadMailbox);
        }
        Ok(buf)
    }

    /// Writes `data` to the output mailbox of `e`, which must be large enough.
    pub(super) fn write_mailbox(&mut self, e: &CmdEntry, data: &[u8]) -> Result<(), CmdStatus> {
        let cap = e.out_len.get() as usize;
        if cap < data.len() || cap > MAX_MAILBOX_BYTES || !e.out_param.get().is_multiple_of(8) {
            return Err(CmdStatus::BadMailbox);
        }
        if self.mem.write(e.out_param.get(), data).is_err() {
            self.note_fault();
            return Err(CmdStatus::BadMailbox);
        }
        Ok(())
    }

    /// Reads an input mailbox holding exactly one `T`.
    pub(super) fn read_layout<T>(&mut self, e: &CmdEntry) -> Result<T, CmdStatus>
    where
        T: FromBytes + zerocopy::KnownLayout + zerocopy::Immutable,
    {
        let bytes = self.read_mailbox(e)?;
        layout(&bytes)
    }

    fn execute(&mut self, e: &CmdEntry) -> CmdResult {
        reserved(&[e.reserved_at_0x7])?;
        reserved(&e.reserved_at_0xc)?;
        if CmdFlags::from_bits(e.flags).is_none() {
            return Err(CmdStatus::BadParam);
        }
        let op = Opcode::from_code(e.opcode.get()).map_err(|_| CmdStatus::BadOpcode)?;
        if e.op_mod.get() != 0 && op != Opcode::ModifyQp {
            return Err(CmdStatus::BadOpcode);
        }
        match op {
            Opcode::QueryDevCap => {
                let cap: DevCap = self.cap;
                self.write_mailbox(e, cap.as_bytes())?;
                Ok(0)
            }
            Opcode::InitHca => self.init_hca(e),
            Opcode::CloseHca => {
                self.hca_mut()?;
                self.hca = None;
                self.status.remove(Status::INITIALIZED);
                for port in &mut self.ports {
                    port.initialized = false;
                }
                Ok(0)
            }
            Opcode::Nop => Ok(0),
            Opcode::InitPort | Opcode::ClosePort => {
                self.hca_mut()?;
                let up = op == Opcode::InitPort;
                let port = u8::try_from(e.in_mod.get()).map_err(|_| CmdStatus::BadPort)?;
                self.set_port_initialized(port, up)?;
                Ok(0)
            }
            Opcode::QueryPort => {
                self.hca_mut()?;
                let port = u8::try_from(e.in_mod.get()).map_err(|_| CmdStatus::BadPort)?;
                let mut answer = Vec::new();
                self.port(port)
                    .ok_or(CmdStatus::BadPort)?
                    .query(&mut answer);
                self.write_mailbox(e, &answer)?;
                Ok(0)
            }
            Opcode::SetPort => self.set_port(e),
            Opcode::SetGid => self.set_gid(e),
            Opcode::SetPkey => self.set_pkey(e),
            Opcode::MadIfc => self.mad_ifc(e),
            _ => self.execute_object_command(op, e),
        }
    }

    /// The HCA state, or `BAD_SYS_STATE` before `INIT_HCA`.
    pub(super) fn hca_mut(&mut self) -> Result<&mut Hca, CmdStatus> {
        self.hca.as_mut().ok_or(CmdStatus::BadSysState)
    }

    fn init_hca(&mut self, e: &CmdEntry) -> CmdResult {
        if self.hca.is_some() {
            return Err(CmdStatus::BadSysState);
        }
        let init: InitHca = self.read_layout(e)?;
        reserved(&init.reserved_at_0x63)?;
        if init.log_page_size != 12 || init.num_uars.get() > self.cap.num_uars.get() {
            return Err(CmdStatus::BadParam);
        }
        let limits = [
            (Table::Qpc, self.cap.log_max_qps),
            (Table::Cqc, self.cap.log_max_cqs),
            (Table::Eqc, self.cap.log_max_eqs),
            (Table::Srqc, self.cap.log_max_srqs),
            (Table::Mpt, self.cap.log_max_mpts),
            (Table::Mtt, self.cap.log_max_mtts),
        ];
        for (table, max) in limits {
            let d = init.table(table);
            reserved(&d.reserved_at_0x9)?;
            if d.log_count > max || !d.base.get().is_multiple_of(4096) || d.base.get() == 0 {
                return Err(CmdStatus::BadParam);
            }
        }
        // Special QPs occupy the first 2 * ports QP numbers.
        if (1u32 << init.table(Table::Qpc).log_count) < 2 * u32::from(self.num_ports()) {
            return Err(CmdStatus::BadParam);
        }
        let hca = Hca::new(&init);
        // The device owns the tables now: clear them, which also proves they
        // are mapped.
        if !hca.zero_tables(self.mem.as_ref()) {
            self.note_fault();
            return Err(CmdStatus::BadMailbox);
        }
        self.hca = Some(hca);
        self.status |= Status::INITIALIZED;
        Ok(0)
    }

    fn set_port(&mut self, e: &CmdEntry) -> CmdResult {
        self.hca_mut()?;
        let port_no = u8::try_from(e.in_mod.get()).map_err(|_| CmdStatus::BadPort)?;
        let input: SetPort = self.read_layout(e)?;
        reserved(&input.reserved_at_0xc)?;
        let flags = SetPortFlags::from_bits(input.flags.get()).ok_or(CmdStatus::BadParam)?;
        if input.set_caps.get() & input.clear_caps.get() != 0 {
            return Err(CmdStatus::BadParam);
        }
        let port = self.port_mut(port_no).ok_or(CmdStatus::BadPort)?;
        port.caps = (port.caps | input.set_caps.get()) & !input.clear_caps.get();
        if flags.contains(SetPortFlags::RESET_QKEY_COUNTER) {
            port.qkey_violations = 0;
        }
        if flags.contains(SetPortFlags::RESET_PKEY_COUNTER) {
            port.pkey_violations = 0;
        }
        Ok(0)
    }

    fn set_gid(&mut self, e: &CmdEntry) -> CmdResult {
        self.hca_mut()?;
        let (port_no, index) =
            split_port_table_in_mod(e.in_mod.get()).ok_or(CmdStatus::BadParam)?;
        let gid: Gid = self.read_layout(e)?;
        let port = self.port_mut(port_no).ok_or(CmdStatus::BadPort)?;
        // GID 0 is the port's configured address and cannot be replaced.
        if index == 0 || usize::from(index) >= port.gids.len() {
            return Err(CmdStatus::BadIndex);
        }
        port.gids[usize::from(index)] = gid;
        Ok(0)
    }

    fn set_pkey(&mut self, e: &CmdEntry) -> CmdResult {
        self.hca_mut()?;
        let (port_no, index) =
            split_port_table_in_mod(e.in_mod.get()).ok_or(CmdStatus::BadParam)?;
        let raw = e.in_param.get();
        let pkey = u16::try_from(raw).map_err(|_| CmdStatus::BadParam)?;
        let port = self.port_mut(port_no).ok_or(CmdStatus::BadPort)?;
        let slot = port
            .pkeys
            .get_mut(usize::from(index))
            .ok_or(CmdStatus::BadPkey)?;
        *slot = pkey;
        Ok(0)
    }

    /// `MAD_IFC`: the local agents answer with the MAD echoed back as a
    /// response carrying "unsupported method/attribute" unless it is a Get
    /// the device understands. Subnet management is out of the model's
    /// scope (PRM 12); this keeps the verb's plumbing honest.
    fn mad_ifc(&mut self, e: &CmdEntry) -> CmdResult {
        self.hca_mut()?;
        let port_no = u8::try_from(e.in_mod.get()).map_err(|_| CmdStatus::BadPort)?;
        self.port(port_no).ok_or(CmdStatus::BadPort)?;
        let mad = self.read_mailbox(e)?;
        if mad.len() != MAD_BYTES {
            return Err(CmdStatus::BadMailbox);
        }
        let response = super::port::answer_mad(self, port_no, &mad);
        self.write_mailbox(e, &response)?;
        Ok(0)
    }

    fn set_port_initialized(&mut self, port_no: u8, up: bool) -> Result<(), CmdStatus> {
        let now_active;
        let was_active;
        {
            let port = self.port_mut(port_no).ok_or(CmdStatus::BadPort)?;
            was_active = port.is_active();
            port.initialized = up;
            now_active = port.is_active();
        }
        if was_active != now_active {
            self.post_port_change(port_no, now_active);
        }
        Ok(())
    }

    /// The fabric link of a port went up or down.
    pub fn set_link(&mut self, port_no: u8, up: bool) {
        let Some(port) = self.port_mut(port_no) else {
            return;
        };
        let was_active = port.is_active();
        port.link_up = up;
        let now_active = port.is_active();
        if was_active != now_active && !self.is_fatal() {
            self.post_port_change(port_no, now_active);
        }
    }
}
