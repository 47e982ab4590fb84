//! Bring-up and teardown (PRM 3; guide 5.1–5.4).
//!
//! [`Hca::start`] runs the PRM 3 sequence at PASSIVE_LEVEL:
//!
//! 1. `MAGIC` and `PRM_VERSION`: a wrong device or an unsupported PRM major
//!    is a clear error ([`InitError::WrongDevice`],
//!    [`InitError::UnsupportedPrm`]).
//! 2. `CONTROL.RESET`, then `STATUS.READY` polled with a bound on reads and
//!    on platform time ([`HcaConfig::reset_timeout_ns`]; the PRM allows
//!    1 s): a device that never becomes ready is
//!    [`InitError::ResetTimeout`], never a hang.
//! 3. The command queue in a common buffer, polled mode, first with one
//!    slot (the slot count comes from the capabilities), then re-enabled
//!    with `min(2^log_max_cmds, 16)` slots, each with its own mailboxes.
//! 4. `QUERY_DEV_CAP`; the record is kept in the [`BringUpReport`].
//! 5. Context tables, one common buffer each, sized by
//!    [`choose_table_sizes`]: the device maximum, capped per table by the
//!    [`HcaConfig`] and then by its total memory budget; `INIT_HCA`.
//! 6. One EQ sized by the guide's 5.4.1 formula over the *enabled* QP and
//!    CQ counts (those bound the objects that can exist; see
//!    [`crate::eq::size_event_queue`]), its ring described page by page by
//!    MTT entries `0..n` (`WRITE_MTT`; these MTT entries are reserved for
//!    the core, [`BringUpReport::reserved_mtt_entries`]), `SW2HW_EQ` on
//!    vector 0, `MAP_EQ` with every class, armed.
//! 7. `INIT_PORT` for each port, still polled so that `start` returns a
//!    definite result; then commands switch to event mode.
//!
//! On any failure `start` resets the device (so it owns no host memory),
//! frees every common buffer it allocated and returns the error.
//!
//! [`Hca::stop`] is the reverse (PRM 3, "Teardown"): outstanding commands
//! fail, commands go back to polled mode, `CLOSE_PORT` each port,
//! `HW2SW_EQ`, `CLOSE_HCA`, the command queue disabled; if the device is
//! failed or any step fails, a reset instead. Only then is every common
//! buffer freed, so the verifier sees no DMA leak and the device no freed
//! memory.
//!
//! Power (`EvtDeviceD0Exit` / `EvtDeviceD0Entry`, PASSIVE_LEVEL):
//! [`Hca::d0_exit`] refuses new verbs from then on
//! ([`IbStatus::InvalidState`](ib_types::status::IbStatus::InvalidState);
//! the shell's power-managed queue holds requests, so this is reached only
//! by direct calls), runs the passive jobs already queued, fails what is
//! still outstanding on the command interface (those verbs complete with
//! an error and undo themselves, as at a stop), reads back each SRQ's
//! limit, tears the device down as [`Hca::stop`] does, resets it, and
//! saves what the device held that software must keep
//! ([`crate::verbs::restore`]); it frees the context tables, the EQ and the
//! command queue but keeps every verb object and its memory.
//! [`Hca::d0_entry`] runs bring-up again (same configuration, so the same
//! context-table layout and EQ; anything else is refused and the device
//! declared failed), re-creates every object with polled commands, then
//! switches to event mode and lets verbs in again; software events
//! (restored QPs' errors, completion events of re-armed CQs with saved
//! completions) go out from the next DPC. A failed device stays failed
//! across D0 exit and entry (its objects can be destroyed); [`Hca::stop`]
//! after a D0 exit without entry frees the verb objects' memory.

use alloc::vec;
use alloc::vec::Vec;

use driver_platform::{CommonBuffer, Deferred, DmaAdapter, Mmio, NtStatus, Platform};
use hca_prm::cmd::{CMD_ENTRY_SIZE, DevCap, InitHca, MAX_MTT_PER_WRITE, Opcode, Table, TableDesc};
use hca_prm::eqe::EventClass;
use hca_prm::regs::{CmdqConfig, Control, MAGIC_VALUE, PRM_VERSION_MAJOR, Status, offset};
use hca_prm::{Le16, Le64};
use zerocopy::{FromBytes, FromZeros, IntoBytes};

use crate::cmd::{
    Command, CommandError, CommandInterface, CommandMemory, CommandMode,
    DEFAULT_COMMAND_TIMEOUT_NS, DEFAULT_MAX_POLLS,
};
use crate::eq::{EqRing, EqSizing, size_event_queue};
use crate::hca::Hca;

/// The host page size the core programs (`INIT_HCA.log_page_size`, PRM 5.3).
const LOG_PAGE_SIZE: u8 = 12;
/// Bytes of a host page.
const PAGE_BYTES: usize = 1 << LOG_PAGE_SIZE;
/// The EQ the core creates, and the vector it raises.
const EQN: u32 = 0;
const EQ_VECTOR: u16 = 0;

/// Choices bring-up makes within the device's limits.
///
/// The context tables use the device's maximum for each table, capped by
/// the `max_log_*` fields (so a huge device does not take all of memory)
/// and then by [`max_context_bytes`](Self::max_context_bytes): while the
/// total is over budget, the largest table is halved (never below what the
/// special QPs need). The EQ is sized from the tables actually enabled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HcaConfig {
    /// Cap on `log2` of the QP table.
    pub max_log_qps: u8,
    /// Cap on `log2` of the CQ table.
    pub max_log_cqs: u8,
    /// Cap on `log2` of the EQ table (the core uses one EQ today).
    pub max_log_eqs: u8,
    /// Cap on `log2` of the SRQ table.
    pub max_log_srqs: u8,
    /// Cap on `log2` of the MPT table.
    pub max_log_mpts: u8,
    /// Cap on `log2` of the MTT table.
    pub max_log_mtts: u8,
    /// Budget for all context tables together, bytes.
    pub max_context_bytes: u64,
    /// Command timeout, nanoseconds of platform time.
    pub command_timeout_ns: u64,
    /// Bound on `done` reads per polled command.
    pub max_command_polls: u32,
    /// How long a reset may take before bring-up gives up (PRM 3: up to
    /// 1 s on hardware).
    pub reset_timeout_ns: u64,
    /// Bound on `STATUS` reads while waiting for `READY`.
    pub max_reset_polls: u32,
}

impl Default for HcaConfig {
    fn default() -> Self {
        Self {
            max_log_qps: 16,
            max_log_cqs: 16,
            max_log_eqs: 3,
            max_log_srqs: 16,
            max_log_mpts: 18,
            max_log_mtts: 20,
            max_context_bytes: 64 << 20,
            command_timeout_ns: DEFAULT_COMMAND_TIMEOUT_NS,
            max_command_polls: DEFAULT_MAX_POLLS,
            reset_timeout_ns: 2_000_000_000,
            max_reset_polls: 1_000_000,
        }
    }
}

/// Why bring-up failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InitError {
    /// `MAGIC` is not `"HCA1"`: this is not our device (or BAR0 is wrong).
    #[error("MAGIC reads {magic:#010x}, not the HCA's {MAGIC_VALUE:#010x}")]
    WrongDevice {
        /// What `MAGIC` read.
        magic: u32,
    },
    /// The device speaks a PRM major version this core does not.
    #[error("PRM version {major}.{minor} is not supported (major {PRM_VERSION_MAJOR} is)")]
    UnsupportedPrm {
        /// Major version read.
        major: u16,
        /// Minor version read.
        minor: u16,
    },
    /// `STATUS.READY` did not come up after a reset.
    #[error("the device did not become ready after reset (STATUS {status:#010x})")]
    ResetTimeout {
        /// The last `STATUS` read.
        status: u32,
    },
    /// `CMDQ_CONFIG.ENABLE` did not take (`STATUS.CMDQ_ENABLED` clear).
    #[error("the command queue did not enable (STATUS {status:#010x})")]
    CommandQueueNotEnabled {
        /// The `STATUS` read.
        status: u32,
    },
    /// A bring-up command failed.
    #[error("{step}: {error}")]
    Command {
        /// What bring-up was doing.
        step: &'static str,
        /// The command's failure.
        error: CommandError,
    },
    /// A common buffer could not be allocated.
    #[error("allocating {what} ({bytes} bytes) failed: {status:?}")]
    Allocation {
        /// What it was for.
        what: &'static str,
        /// Bytes asked for.
        bytes: usize,
        /// The platform's status.
        status: NtStatus,
    },
    /// A common buffer is not 4 KiB aligned in bus space.
    #[error("{what} is not 4 KiB aligned (bus {bus:#x})")]
    Misaligned {
        /// What it was for.
        what: &'static str,
        /// Its bus address.
        bus: u64,
    },
    /// The capabilities are unusable (a zero entry size, no vectors, no
    /// ports, an EQ larger than the MTT table).
    #[error("unusable capabilities: {0}")]
    Capabilities(&'static str),
    /// No context-table layout fits the memory budget.
    #[error("the context tables need {needed} bytes, over the budget of {budget}")]
    ContextBudget {
        /// The smallest layout's size.
        needed: u64,
        /// The budget.
        budget: u64,
    },
    /// The platform granted no interrupt vector.
    #[error("no MSI-X vector granted")]
    NoVectors,
    /// `start` was called on a started device.
    #[error("the device is already started")]
    AlreadyStarted,
}

/// One context table as bring-up laid it out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableLayout {
    /// Which table.
    pub table: Table,
    /// `log2` of its entries.
    pub log_count: u8,
    /// `log2` of the device's maximum.
    pub device_max_log: u8,
    /// Bytes of one entry.
    pub entry_size: u16,
}

impl TableLayout {
    /// Bytes of the table.
    pub fn bytes(&self) -> u64 {
        u64::from(self.entry_size) << self.log_count
    }
}

/// What bring-up found and decided; kept while the device runs.
#[derive(Debug, Clone, Copy)]
pub struct BringUpReport {
    /// `PRM_VERSION` (major, minor).
    pub prm_version: (u16, u16),
    /// `FW_VERSION`.
    pub fw_version: u64,
    /// The `QUERY_DEV_CAP` record.
    pub capabilities: DevCap,
    /// The context tables, in `INIT_HCA` order.
    pub tables: [TableLayout; 6],
    /// Command slots (concurrent commands).
    pub command_slots: usize,
    /// The EQ's sizing, including whether it was capped by the device.
    pub eq_sizing: EqSizing,
    /// The EQ's number.
    pub eqn: u32,
    /// The EQ's MSI-X vector.
    pub eq_vector: u16,
    /// MTT entries `0..n` describe the EQ ring; the MTT allocator must not
    /// hand them out.
    pub reserved_mtt_entries: u32,
}

impl BringUpReport {
    /// The layout of `table`.
    pub fn table(&self, table: Table) -> &TableLayout {
        &self.tables[usize::from(table.code())]
    }
}

/// Chooses the context table sizes (see [`HcaConfig`]): per table the
/// device maximum capped by the configuration, then halving the largest
/// table until the total fits the budget. The QP table never shrinks below
/// the `2 * ports` special QPs (PRM 5.1).
pub fn choose_table_sizes(cap: &DevCap, config: &HcaConfig) -> Result<[TableLayout; 6], InitError> {
    let entry = |size: Le16| size.get();
    let specs = [
        (
            Table::Qpc,
            cap.log_max_qps,
            config.max_log_qps,
            entry(cap.qpc_entry_size),
        ),
        (
            Table::Cqc,
            cap.log_max_cqs,
            config.max_log_cqs,
            entry(cap.cqc_entry_size),
        ),
        (
            Table::Eqc,
            cap.log_max_eqs,
            config.max_log_eqs,
            entry(cap.eqc_entry_size),
        ),
        (
            Table::Srqc,
            cap.log_max_srqs,
            config.max_log_srqs,
            entry(cap.srqc_entry_size),
        ),
        (
            Table::Mpt,
            cap.log_max_mpts,
            config.max_log_mpts,
            entry(cap.mpt_entry_size),
        ),
        (
            Table::Mtt,
            cap.log_max_mtts,
            config.max_log_mtts,
            entry(cap.mtt_entry_size),
        ),
    ];
    let special_qps = 2 * u64::from(cap.num_ports);
    let min_log_qps = if special_qps <= 1 {
        0
    } else {
        (u64::BITS - (special_qps - 1).leading_zeros()) as u8
    };
    if min_log_qps > cap.log_max_qps {
        return Err(InitError::Capabilities(
            "QP table too small for the special QPs",
        ));
    }
    let mut layout = specs.map(|(table, device_max_log, cap_log, entry_size)| TableLayout {
        table,
        // Bound the shift: a garbage capability must not overflow.
        log_count: device_max_log.min(cap_log).min(40),
        device_max_log,
        entry_size,
    });
    if layout.iter().any(|t| t.entry_size == 0) {
        return Err(InitError::Capabilities("a context entry size is zero"));
    }
    layout[0].log_count = layout[0].log_count.max(min_log_qps);
    let min_log = |t: &TableLayout| {
        if t.table == Table::Qpc {
            min_log_qps
        } else {
            0
        }
    };
    loop {
        let total: u64 = layout.iter().map(TableLayout::bytes).sum();
        if total <= config.max_context_bytes {
            return Ok(layout);
        }
        let largest = layout
            .iter_mut()
            .filter(|t| t.log_count > min_log(t))
            .max_by_key(|t| t.bytes());
        match largest {
            Some(t) => t.log_count -= 1,
            None => {
                return Err(InitError::ContextBudget {
                    needed: total,
                    budget: config.max_context_bytes,
                });
            }
        }
    }
}

type Buffer<P> = <<P as Platform>::Dma as DmaAdapter>::Buffer;

/// Common buffers bring-up holds until the device owns them.
struct Held<P: Platform> {
    buffers: Vec<Buffer<P>>,
}

impl<P: Platform> Hca<P> {
    /// Brings the device up (PRM 3; see the module doc). PASSIVE_LEVEL.
    /// Connect the ISR before calling it.
    pub fn start(&self) -> Result<BringUpReport, InitError> {
        if self.cmd.mode() != CommandMode::Offline {
            return Err(InitError::AlreadyStarted);
        }
        self.reset_failure();
        let mut held = Held::<P> {
            buffers: Vec::new(),
        };
        match self.bring_up(&mut held) {
            Ok(report) => {
                *self.tables.lock() = held.buffers;
                *self.report.lock() = Some(report);
                Ok(report)
            }
            Err(error) => {
                self.abandon(held.buffers);
                Err(error)
            }
        }
    }

    /// Tears the device down and frees every common buffer (see the module
    /// doc). PASSIVE_LEVEL. Does nothing on a stopped device.
    pub fn stop(&self) {
        // Requests the core holds (user waits) are completed as cancelled
        // before their objects go, as at any removal.
        self.end_all_user_waits();
        let mode = self.cmd.mode();
        if mode == CommandMode::Offline {
            // Released below D0, or after a failed D0 entry: the device was
            // reset then; only the verb objects' memory is left.
            self.powered_down
                .store(false, core::sync::atomic::Ordering::Release);
            *self.saved_layout.lock() = None;
            for buffer in self.verbs.take_buffers(self) {
                (self.free_common)(&self.dma, buffer);
            }
            return;
        }
        self.cmd.disable_events();
        self.deferred.set_timer(None);
        let ports = self.report.lock().map_or(0, |r| r.capabilities.num_ports);
        let fatal =
            Status::from_bits_retain(self.bar0.read32(offset::STATUS)).contains(Status::FATAL);
        let mut clean = !fatal && self.cmd.mode() == CommandMode::Polled;
        if clean {
            for port in 1..=ports {
                clean &= self
                    .polled(Command::new(Opcode::ClosePort, u32::from(port)))
                    .is_ok();
            }
            clean &= self.polled(Command::new(Opcode::Hw2SwEq, EQN)).is_ok();
            clean &= self.polled(Command::new(Opcode::CloseHca, 0)).is_ok();
            self.bar0
                .write32(offset::CMDQ_CONFIG, CmdqConfig::default().to_bits());
        }
        let tables = core::mem::take(&mut *self.tables.lock());
        *self.report.lock() = None;
        if clean {
            self.release(tables);
        } else {
            self.abandon(tables);
        }
    }

    /// Takes the device below D0 keeping every verb object (see the
    /// module doc and [`crate::verbs::restore`]). PASSIVE_LEVEL. Does
    /// nothing on a stopped device.
    pub fn d0_exit(self: &alloc::sync::Arc<Self>) {
        if self.cmd.mode() == CommandMode::Offline {
            return;
        }
        self.powered_down
            .store(true, core::sync::atomic::Ordering::Release);
        // Jobs already queued issue their commands now; they fail below and
        // undo themselves, so none runs against the device while it is down.
        self.work_item();
        self.cmd.disable_events();
        self.deferred.set_timer(None);
        let polled_mailbox = |command: Command| self.polled(command).map(|o| o.mailbox);
        if self.cmd.mode() == CommandMode::Polled {
            self.save_before_reset(&polled_mailbox);
        }
        let saved = *self.report.lock();
        self.take_device_down(saved.map_or(0, |r| r.capabilities.num_ports));
        *self.saved_layout.lock() = saved;
        self.save_after_reset();
    }

    /// Brings the device back to D0 and gives every verb object back (see
    /// the module doc). PASSIVE_LEVEL. On failure the device is declared
    /// failed (the verbs fail over as for a catastrophic error) and the
    /// error returned; the shell still reports success to the power
    /// manager so the objects can be destroyed.
    pub fn d0_entry(self: &alloc::sync::Arc<Self>) -> Result<(), InitError> {
        if !self
            .powered_down
            .load(core::sync::atomic::Ordering::Acquire)
        {
            return Ok(());
        }
        let saved = self.saved_layout.lock().take();
        if self.is_failed() {
            // A failed device stays failed until PnP restarts it (the shell
            // calls WdfDeviceSetFailed): its objects can only be destroyed,
            // which needs no device.
            self.powered_down
                .store(false, core::sync::atomic::Ordering::Release);
            self.deferred.queue_dpc();
            return Ok(());
        }
        let result = self.start().and_then(|report| {
            let same = saved.is_none_or(|old| {
                old.tables == report.tables
                    && old.reserved_mtt_entries == report.reserved_mtt_entries
                    && old.eqn == report.eqn
            });
            if !same {
                return Err(InitError::Capabilities(
                    "the device came back with another context-table layout",
                ));
            }
            // Polled again for the restore, so that D0 entry returns with
            // every object back and nothing can overtake it.
            self.cmd.disable_events();
            let polled_mailbox = |command: Command| self.polled(command).map(|o| o.mailbox);
            self.restore_verbs(&polled_mailbox).map_err(
                |crate::verbs::restore::RestoreError::Command(error)| InitError::Command {
                    step: "restoring the verb objects",
                    error,
                },
            )?;
            self.cmd
                .enable_events(&self.bar0, self.deferred.now_ns())
                .map_err(|error| InitError::Command {
                    step: "event mode",
                    error,
                })
        });
        self.powered_down
            .store(false, core::sync::atomic::Ordering::Release);
        if let Err(error) = result {
            // The objects stay for their owners to destroy, which needs no
            // device (verbs/fatal.rs).
            self.declare_failed(crate::eq::DeviceFailure::ResumeFailed);
            return Err(error);
        }
        self.deferred.queue_dpc();
        Ok(())
    }

    /// The polled half of teardown (ports closed, EQ destroyed,
    /// `CLOSE_HCA`, queue disabled when the device still answers), then a
    /// reset in any case, then the context tables, EQ and command queue
    /// freed. The verb objects and their memory stay.
    fn take_device_down(&self, ports: u8) {
        let fatal =
            Status::from_bits_retain(self.bar0.read32(offset::STATUS)).contains(Status::FATAL);
        if !fatal && self.cmd.mode() == CommandMode::Polled {
            for port in 1..=ports {
                let _ = self.polled(Command::new(Opcode::ClosePort, u32::from(port)));
            }
            let _ = self.polled(Command::new(Opcode::Hw2SwEq, EQN));
            let _ = self.polled(Command::new(Opcode::CloseHca, 0));
            self.bar0
                .write32(offset::CMDQ_CONFIG, CmdqConfig::default().to_bits());
        }
        self.bar0.write32(offset::CONTROL, Control::RESET.bits());
        let mut buffers = core::mem::take(&mut *self.tables.lock());
        *self.report.lock() = None;
        if let Some(ring) = self.eq.detach() {
            buffers.push(ring.buffer);
        }
        if let Some(memory) = self.cmd.detach() {
            buffers.push(memory.ring);
            for (input, output) in memory.mailboxes {
                buffers.push(input);
                buffers.push(output);
            }
        }
        for buffer in buffers {
            (self.free_common)(&self.dma, buffer);
        }
    }

    /// Resets the device so it owns no host memory, then frees `buffers`
    /// and the EQ and command queue memory.
    fn abandon(&self, buffers: Vec<Buffer<P>>) {
        self.bar0.write32(offset::CONTROL, Control::RESET.bits());
        self.release(buffers);
    }

    /// Frees `buffers` and the EQ and command queue memory; the device must
    /// no longer use any of it.
    fn release(&self, mut buffers: Vec<Buffer<P>>) {
        self.deferred.set_timer(None);
        // User memory pinned for user objects' rings, unmapped before the
        // objects go.
        self.release_user_pins();
        buffers.extend(self.verbs.take_buffers(self));
        if let Some(ring) = self.eq.detach() {
            buffers.push(ring.buffer);
        }
        if let Some(memory) = self.cmd.detach() {
            buffers.push(memory.ring);
            for (input, output) in memory.mailboxes {
                buffers.push(input);
                buffers.push(output);
            }
        }
        for buffer in buffers {
            (self.free_common)(&self.dma, buffer);
        }
    }

    /// One polled command with the platform clock.
    pub(crate) fn polled(
        &self,
        command: Command,
    ) -> Result<crate::cmd::CommandOutput, CommandError> {
        let now = || self.deferred.now_ns();
        self.cmd.execute_polled(&self.bar0, &now, command)
    }

    fn polled_step(
        &self,
        step: &'static str,
        command: Command,
    ) -> Result<crate::cmd::CommandOutput, InitError> {
        self.polled(command)
            .map_err(|error| InitError::Command { step, error })
    }

    /// Allocates a page-aligned, page-rounded common buffer and pushes it
    /// onto `held` (so every error path frees it).
    fn alloc(
        &self,
        held: &mut Held<P>,
        what: &'static str,
        bytes: usize,
    ) -> Result<usize, InitError> {
        let rounded = bytes.div_ceil(PAGE_BYTES).max(1) * PAGE_BYTES;
        let buffer = self
            .dma
            .alloc_common(rounded)
            .map_err(|status| InitError::Allocation {
                what,
                bytes: rounded,
                status,
            })?;
        let bus = buffer.bus_address();
        held.buffers.push(buffer);
        if bus % PAGE_BYTES as u64 != 0 {
            return Err(InitError::Misaligned { what, bus });
        }
        Ok(held.buffers.len() - 1)
    }

    fn bring_up(&self, held: &mut Held<P>) -> Result<BringUpReport, InitError> {
        if self.msix_vectors == 0 {
            return Err(InitError::NoVectors);
        }
        // 1. Identity.
        let magic = self.bar0.read32(offset::MAGIC);
        if magic != MAGIC_VALUE {
            return Err(InitError::WrongDevice { magic });
        }
        let version = self.bar0.read32(offset::PRM_VERSION);
        let (major, minor) = ((version >> 16) as u16, version as u16);
        if major != PRM_VERSION_MAJOR {
            return Err(InitError::UnsupportedPrm { major, minor });
        }
        let fw_version = self.bar0.read64(offset::FW_VERSION);

        // 2. Reset and wait for READY, bounded in reads and in time.
        self.bar0.write32(offset::CONTROL, Control::RESET.bits());
        let started = self.deferred.now_ns();
        let mut polls = 0u32;
        loop {
            let status = self.bar0.read32(offset::STATUS);
            if Status::from_bits_retain(status).contains(Status::READY) {
                break;
            }
            polls += 1;
            if polls >= self.config.max_reset_polls
                || self.deferred.now_ns().saturating_sub(started) >= self.config.reset_timeout_ns
            {
                return Err(InitError::ResetTimeout { status });
            }
            core::hint::spin_loop();
        }

        // 3. A one-slot command queue, enough for QUERY_DEV_CAP.
        self.alloc(held, "command queue", PAGE_BYTES)?;
        self.alloc(held, "command mailbox", PAGE_BYTES)?;
        self.alloc(held, "command mailbox", PAGE_BYTES)?;
        // The three were pushed last, in this order; the command interface
        // owns them from here (and hands them back at teardown).
        let mailbox_out = held.buffers.pop();
        let mailbox_in = held.buffers.pop();
        let ring = held.buffers.pop();
        let (Some(ring), Some(mailbox_in), Some(mailbox_out)) = (ring, mailbox_in, mailbox_out)
        else {
            return Err(InitError::Capabilities("internal: command queue buffers"));
        };
        let ring_bus = ring.bus_address();
        // Attach before enabling: from here the command interface owns the
        // memory, and every error path gets it back from there.
        self.cmd.attach(CommandMemory {
            ring,
            log_size: 0,
            mailboxes: vec![(mailbox_in, mailbox_out)],
        });
        self.enable_command_queue(ring_bus, 0)?;

        // 4. Capabilities.
        let answer = self.polled_step(
            "QUERY_DEV_CAP",
            Command::new(Opcode::QueryDevCap, 0).with_output(size_of::<DevCap>()),
        )?;
        let cap = DevCap::read_from_bytes(&answer.mailbox)
            .map_err(|_| InitError::Capabilities("QUERY_DEV_CAP answer"))?;
        if cap.num_ports == 0 {
            return Err(InitError::Capabilities("no ports"));
        }
        if cap.num_vectors.get() == 0 {
            return Err(InitError::Capabilities("no interrupt vectors"));
        }

        // 3 again: the full command queue, one mailbox pair per slot.
        let log_slots = CommandInterface::<P>::log_size_for(cap.log_max_cmds);
        let slots = 1usize << log_slots;
        let Some(mut memory) = self.cmd.detach() else {
            return Err(InitError::Capabilities("internal: command queue lost"));
        };
        let mut pairs = Vec::with_capacity(slots - 1);
        let mut failed = None;
        for _ in 1..slots {
            let pair = self.dma.alloc_common(PAGE_BYTES).and_then(|a| {
                match self.dma.alloc_common(PAGE_BYTES) {
                    Ok(b) => Ok((a, b)),
                    Err(status) => {
                        (self.free_common)(&self.dma, a);
                        Err(status)
                    }
                }
            });
            match pair {
                Ok(pair) => pairs.push(pair),
                Err(status) => {
                    failed = Some(status);
                    break;
                }
            }
        }
        memory.mailboxes.extend(pairs);
        memory.log_size = log_slots;
        let ring_bus = memory.ring.bus_address();
        if CMD_ENTRY_SIZE << log_slots > memory.ring.len() {
            self.cmd.attach(memory);
            return Err(InitError::Capabilities("internal: command ring too small"));
        }
        if let Some(status) = failed {
            self.cmd.attach(memory);
            return Err(InitError::Allocation {
                what: "command mailboxes",
                bytes: PAGE_BYTES,
                status,
            });
        }
        self.bar0
            .write32(offset::CMDQ_CONFIG, CmdqConfig::default().to_bits());
        let enabled = self.enable_command_queue(ring_bus, log_slots);
        self.cmd.attach(memory);
        enabled?;

        // 5. Context tables and INIT_HCA.
        let tables = choose_table_sizes(&cap, &self.config)?;
        let mut init = InitHca::new_zeroed();
        for layout in &tables {
            let bytes = usize::try_from(layout.bytes())
                .map_err(|_| InitError::Capabilities("context table size"))?;
            let index = self.alloc(held, "context table", bytes)?;
            init.tables[usize::from(layout.table.code())] = TableDesc {
                base: Le64::new(held.buffers[index].bus_address()),
                log_count: layout.log_count,
                ..TableDesc::default()
            };
        }
        init.num_uars = cap.num_uars;
        init.log_page_size = LOG_PAGE_SIZE;
        self.polled_step(
            "INIT_HCA",
            Command::new(Opcode::InitHca, 0).with_mailbox(init.as_bytes().to_vec()),
        )?;

        // 6. The EQ.
        let qps = 1u64 << tables[usize::from(Table::Qpc.code())].log_count;
        let cqs = 1u64 << tables[usize::from(Table::Cqc.code())].log_count;
        let eq_sizing = size_event_queue(
            qps,
            cqs,
            u64::from(cap.num_ports),
            slots as u64,
            cap.log_max_eqes,
        );
        let eq_bytes = usize::try_from(eq_sizing.entries())
            .ok()
            .and_then(|entries| entries.checked_mul(crate::eq::EQE_BYTES))
            .ok_or(InitError::Capabilities("EQ ring size"))?;
        self.alloc(held, "event queue", eq_bytes)?;
        let Some(eq_buffer) = held.buffers.pop() else {
            return Err(InitError::Capabilities("internal: EQ buffer"));
        };
        let ring = EqRing {
            buffer: eq_buffer,
            eqn: EQN,
            vector: EQ_VECTOR,
            log_entries: eq_sizing.log_entries,
            consumer: 0,
        };
        let pages = ring.page_addresses(PAGE_BYTES);
        let mtt_entries = 1u64 << tables[usize::from(Table::Mtt.code())].log_count;
        let eqc = ring.context(0, LOG_PAGE_SIZE);
        // Hand the ring to the EQ now, so that every error path below
        // finds it there and frees it.
        self.eq.attach(ring);
        if pages.len() as u64 > mtt_entries {
            return Err(InitError::Capabilities(
                "the EQ ring needs more MTT entries than exist",
            ));
        }
        for (chunk_index, chunk) in pages.chunks(MAX_MTT_PER_WRITE).enumerate() {
            let first = (chunk_index * MAX_MTT_PER_WRITE) as u64;
            let mut mailbox = Vec::with_capacity(8 + 8 * chunk.len());
            mailbox.extend_from_slice(&first.to_le_bytes());
            for page in chunk {
                mailbox.extend_from_slice(&page.to_le_bytes());
            }
            self.polled_step(
                "WRITE_MTT (EQ ring)",
                Command::new(Opcode::WriteMtt, 0).with_mailbox(mailbox),
            )?;
        }
        self.polled_step(
            "SW2HW_EQ",
            Command::new(Opcode::Sw2HwEq, EQN).with_mailbox(eqc.as_bytes().to_vec()),
        )?;
        self.polled_step(
            "MAP_EQ",
            Command::new(Opcode::MapEq, EQN).with_immediate(EventClass::all().bits()),
        )?;
        self.eq.arm(&self.bar0);

        // 7. Ports, then event mode.
        for port in 1..=cap.num_ports {
            self.polled_step("INIT_PORT", Command::new(Opcode::InitPort, u32::from(port)))?;
        }
        self.cmd
            .enable_events(&self.bar0, self.deferred.now_ns())
            .map_err(|error| InitError::Command {
                step: "event mode",
                error,
            })?;
        Ok(BringUpReport {
            prm_version: (major, minor),
            fw_version,
            capabilities: cap,
            tables,
            command_slots: slots,
            eq_sizing,
            eqn: EQN,
            eq_vector: EQ_VECTOR,
            reserved_mtt_entries: pages.len() as u32,
        })
    }

    /// Programs `CMDQ_BASE` and enables the queue with `2^log_size`
    /// entries; checks `STATUS.CMDQ_ENABLED`.
    fn enable_command_queue(&self, ring_bus: u64, log_size: u8) -> Result<(), InitError> {
        self.bar0.write64(offset::CMDQ_BASE, ring_bus);
        self.bar0.write32(
            offset::CMDQ_CONFIG,
            CmdqConfig {
                log_size,
                enable: true,
            }
            .to_bits(),
        );
        let status = self.bar0.read32(offset::STATUS);
        if !Status::from_bits_retain(status).contains(Status::CMDQ_ENABLED) {
            return Err(InitError::CommandQueueNotEnabled { status });
        }
        Ok(())
    }
}
