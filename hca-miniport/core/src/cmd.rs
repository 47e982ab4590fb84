//! The command interface (PRM 4, guide 5.2): how the core asks the device
//! to do something.
//!
//! Contract:
//! - **Bounded concurrency.** The command queue is a ring of `2^log_size`
//!   64-byte entries in one DMA common buffer (PRM 4.1). At most
//!   `slots = 2^log_size` commands are outstanding (the PRM's rule: never
//!   more submitted-and-not-completed commands than ring entries; `log_size`
//!   is chosen at most `log_max_cmds`). Each slot owns its own input and
//!   output mailbox page (common buffers), so concurrent commands never
//!   share a mailbox.
//! - **Never blocks.** [`CommandInterface::submit`] returns at once at any
//!   IRQL up to DISPATCH_LEVEL. A command that finds no free slot waits in a
//!   FIFO and is issued, in submission order, as slots free up.
//! - **Completion by event** (PRM 4.3). In event mode every entry carries
//!   `EVENT` and a token naming its slot; the device answers with a
//!   `CMD_COMPLETION` EQE, which the EQ's DPC hands to
//!   [`CommandInterface::complete`]. The caller's [`Continuation`] then runs
//!   from that DPC, at DISPATCH_LEVEL, with no lock of this module held (so
//!   it may submit again).
//! - **Polled mode** (PRM 4.2), for bring-up and teardown before and after
//!   the EQ exists: [`CommandInterface::execute_polled`] writes one entry and
//!   spin-reads its `done` byte, bounded both by a poll count and by the
//!   command timeout in platform time. A device that never answers is an
//!   error ([`CommandError::Timeout`]), never a hang.
//! - **Timeout.** A command issued longer ago than the configured timeout
//!   (default [`DEFAULT_COMMAND_TIMEOUT_NS`]) is detected by
//!   [`CommandInterface::check_timeouts`] (called from the timer routine and
//!   the DPC, with time from `Deferred::now_ns`). The device is then
//!   declared failed: every outstanding and queued command completes with an
//!   error, and every later submission fails at once (its continuation runs
//!   inline, in the submitter's context).
//! - A completion whose token names no outstanding command (a device bug or
//!   a late answer after a timeout) is counted and ignored.
//!
//! Locking: one [`SpinLock`] guards the ring, the slots and the FIFO.
//! Common-buffer copies and register writes are made under it (both are
//! legal at DISPATCH_LEVEL); continuations are always called after it is
//! released.

use alloc::boxed::Box;
use alloc::collections::VecDeque;
use alloc::vec;
use alloc::vec::Vec;

use driver_platform::dma::dma_wmb;
use driver_platform::{CommonBuffer, DmaAdapter, Mmio, Platform, SpinLock};
use hca_prm::cmd::{
    CMD_DONE_OFFSET, CMD_ENTRY_SIZE, CmdEntry, CmdFlags, CmdStatus, MAX_MAILBOX_BYTES, Opcode,
};
use hca_prm::owner;
use hca_prm::regs::offset;
use hca_prm::{Le16, Le32, Le64};
use ib_types::status::IbStatus;
use zerocopy::{FromBytes, IntoBytes};

use crate::ring::read_owned_entry;

/// Default command timeout: 2 s of platform time. The PRM allows the
/// device up to 1 s for a reset; no command should take longer than that
/// twice over.
pub const DEFAULT_COMMAND_TIMEOUT_NS: u64 = 2_000_000_000;

/// Default bound on the `done`-byte reads of one polled command, on top of
/// the time bound (virtual clocks may not move while the core spins).
pub const DEFAULT_MAX_POLLS: u32 = 100_000;

/// The largest ring the `CMDQ_CONFIG.LOG_SIZE` field (4 bits) can express,
/// and so the most command slots: tokens carry the slot in their low bits.
const MAX_LOG_SLOTS: u8 = 4;

/// What goes to the device as the command's input.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum CommandInput {
    /// No input.
    #[default]
    None,
    /// An immediate 64-bit input (`in_param`), e.g. `MAP_EQ`'s class mask.
    Immediate(u64),
    /// An input mailbox: at most [`MAX_MAILBOX_BYTES`] bytes.
    Mailbox(Vec<u8>),
}

/// One command to run: opcode, modifiers, input and the output mailbox size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Command {
    /// The opcode (PRM 5.1).
    pub opcode: Opcode,
    /// Opcode modifier (0 except for `MODIFY_QP`).
    pub op_mod: u16,
    /// Input modifier (usually an object number).
    pub in_mod: u32,
    /// The input.
    pub input: CommandInput,
    /// Bytes of output mailbox the command writes (0: none).
    pub output_len: usize,
}

impl Command {
    /// A command with no input and no output mailbox.
    pub fn new(opcode: Opcode, in_mod: u32) -> Self {
        Self {
            opcode,
            op_mod: 0,
            in_mod,
            input: CommandInput::None,
            output_len: 0,
        }
    }

    /// The same command with an input mailbox.
    pub fn with_mailbox(mut self, input: Vec<u8>) -> Self {
        self.input = CommandInput::Mailbox(input);
        self
    }

    /// The same command with an immediate input.
    pub fn with_immediate(mut self, value: u64) -> Self {
        self.input = CommandInput::Immediate(value);
        self
    }

    /// The same command expecting `len` bytes of output mailbox.
    pub fn with_output(mut self, len: usize) -> Self {
        self.output_len = len;
        self
    }
}

/// What a successful command returned.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CommandOutput {
    /// The immediate output (`out_imm`).
    pub immediate: u64,
    /// The output mailbox, `output_len` bytes (empty if none was asked).
    pub mailbox: Vec<u8>,
}

/// Why a command did not succeed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CommandError {
    /// The device ran the command and returned a non-`OK` status (PRM 4.4).
    #[error("{opcode:?} failed with status {status:?}")]
    Status {
        /// The command.
        opcode: Opcode,
        /// The device's status.
        status: CmdStatus,
    },
    /// The device returned a status code the PRM does not define.
    #[error("{opcode:?} returned unknown status {raw:#04x}")]
    UnknownStatus {
        /// The command.
        opcode: Opcode,
        /// The raw status byte.
        raw: u8,
    },
    /// The command was outstanding longer than the timeout; the device was
    /// declared failed.
    #[error("{opcode:?} timed out; the device is declared failed")]
    Timeout {
        /// The command that timed out.
        opcode: Opcode,
    },
    /// The device is failed (a timeout, a catastrophic error, or a stop):
    /// the command was not run, or its result will never arrive.
    #[error("the device is failed or stopped; {opcode:?} was not completed")]
    DeviceFailed {
        /// The command.
        opcode: Opcode,
    },
    /// The input or output is larger than a mailbox.
    #[error("{opcode:?}: mailbox of {len} bytes exceeds {MAX_MAILBOX_BYTES}")]
    MailboxTooLarge {
        /// The command.
        opcode: Opcode,
        /// The bytes asked for.
        len: usize,
    },
    /// The command interface has no queue yet (before bring-up) or was
    /// asked for a mode it is not in.
    #[error("the command queue is not running")]
    NotRunning,
}

impl CommandError {
    /// The PRM status, when the device returned one.
    pub fn prm_status(&self) -> Option<CmdStatus> {
        match self {
            Self::Status { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// The IB status a verb reports for this failure (at the API edge).
    pub fn ib_status(&self) -> IbStatus {
        match self {
            Self::Status { status, .. } => ib_status_of(*status),
            Self::UnknownStatus { .. } | Self::NotRunning => IbStatus::GenericError,
            Self::Timeout { .. } => IbStatus::Timeout,
            Self::DeviceFailed { .. } => IbStatus::InvalidState,
            Self::MailboxTooLarge { .. } => IbStatus::InvalidParameter,
        }
    }
}

/// The IB status for a PRM command status (PRM 4.4).
pub fn ib_status_of(status: CmdStatus) -> IbStatus {
    match status {
        CmdStatus::Ok => IbStatus::Success,
        CmdStatus::Internal => IbStatus::GenericError,
        CmdStatus::BadOpcode => IbStatus::Unsupported,
        CmdStatus::BadParam | CmdStatus::BadMailbox => IbStatus::InvalidParameter,
        CmdStatus::BadSysState | CmdStatus::BadResState => IbStatus::InvalidState,
        CmdStatus::BadIndex => IbStatus::InvalidIndex,
        CmdStatus::ResourceBusy => IbStatus::ResourceBusy,
        CmdStatus::BadQpState => IbStatus::InvalidQpState,
        CmdStatus::ExceedLimit => IbStatus::InsufficientResources,
        CmdStatus::BadPkey => IbStatus::InvalidPkey,
        CmdStatus::BadPort => IbStatus::InvalidPort,
    }
}

/// What runs when a command finishes: called exactly once, at
/// DISPATCH_LEVEL from the DPC (or the timer routine on a timeout), or
/// inline in the submitter if the device is already failed.
pub type Continuation = Box<dyn FnOnce(Result<CommandOutput, CommandError>) + Send>;

/// How commands complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommandMode {
    /// No queue yet (before bring-up) or after teardown.
    Offline,
    /// The core spins on each entry's `done` byte (PRM 4.2).
    Polled,
    /// Completion by `CMD_COMPLETION` event (PRM 4.3).
    Event,
    /// A timeout or a catastrophic error: nothing more is issued.
    Failed,
}

/// Counters of the command interface, for diagnostics and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CommandCounters {
    /// Commands written to the ring.
    pub issued: u64,
    /// Commands completed by the device (any status).
    pub completed: u64,
    /// Commands that had to wait in the FIFO for a slot.
    pub queued_for_slot: u64,
    /// Completion events whose token matched no outstanding command.
    pub stray_completions: u64,
}

/// The DMA memory of the command queue: the ring and one mailbox pair per
/// slot. Handed over by bring-up, returned at teardown.
#[derive(Debug)]
pub struct CommandMemory<B> {
    /// The ring of 64-byte entries, `2^log_size` of them.
    pub ring: B,
    /// `log2` of the ring's entries (= slots).
    pub log_size: u8,
    /// Per slot: (input mailbox, output mailbox), each one page.
    pub mailboxes: Vec<(B, B)>,
}

struct InFlight {
    token: u16,
    opcode: Opcode,
    output_len: usize,
    issued_at_ns: u64,
    continuation: Continuation,
}

struct Waiting {
    command: Command,
    continuation: Continuation,
}

struct State<B> {
    mode: CommandMode,
    memory: Option<CommandMemory<B>>,
    /// The producer counter: entries written to the ring so far.
    producer: u32,
    /// Per slot, the command it carries.
    slots: Vec<Option<InFlight>>,
    /// Commands waiting for a slot, oldest first.
    waiting: VecDeque<Waiting>,
    /// Increments per issued command; the high bits of a token.
    sequence: u16,
    timeout_ns: u64,
    counters: CommandCounters,
}

/// The command interface of one device.
pub struct CommandInterface<P: Platform> {
    state: SpinLock<P, State<<P::Dma as DmaAdapter>::Buffer>>,
    /// Bound on the `done`-byte reads of one polled command.
    max_polls: u64,
}

impl<P: Platform> core::fmt::Debug for CommandInterface<P> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        // `try_lock`: formatting from code that holds the lock must not
        // deadlock.
        let Some(state) = self.state.try_lock() else {
            return f.write_str("CommandInterface { <locked> }");
        };
        f.debug_struct("CommandInterface")
            .field("mode", &state.mode)
            .field("producer", &state.producer)
            .field("waiting", &state.waiting.len())
            .field("counters", &state.counters)
            .finish_non_exhaustive()
    }
}

/// Continuations taken out under the lock, to be called after it is
/// released.
type Finished = Vec<(Continuation, Result<CommandOutput, CommandError>)>;

fn run_all(finished: Finished) {
    for (continuation, result) in finished {
        continuation(result);
    }
}

impl<P: Platform> Default for CommandInterface<P> {
    fn default() -> Self {
        Self::new(DEFAULT_COMMAND_TIMEOUT_NS, DEFAULT_MAX_POLLS)
    }
}

impl<P: Platform> CommandInterface<P> {
    /// An offline interface with the given timeout and polled-mode poll
    /// bound; it needs [`attach`](Self::attach) before it can run commands.
    pub fn new(timeout_ns: u64, max_polls: u32) -> Self {
        Self {
            state: SpinLock::<P, _>::new(State {
                mode: CommandMode::Offline,
                memory: None,
                producer: 0,
                slots: Vec::new(),
                waiting: VecDeque::new(),
                sequence: 0,
                timeout_ns,
                counters: CommandCounters::default(),
            }),
            max_polls: u64::from(max_polls.max(1)),
        }
    }

    /// The ring size to use for a device with `log_max_cmds`: the device's
    /// maximum, limited by what `CMDQ_CONFIG.LOG_SIZE` and the token layout
    /// can carry (16 slots).
    pub fn log_size_for(log_max_cmds: u8) -> u8 {
        log_max_cmds.min(MAX_LOG_SLOTS)
    }

    /// Takes the queue's memory (already programmed into `CMDQ_BASE` and
    /// enabled) and starts polled mode. The producer counter restarts at 0,
    /// as the device's does when the queue is enabled. Any memory attached
    /// before is handed back.
    pub fn attach(
        &self,
        memory: CommandMemory<<P::Dma as DmaAdapter>::Buffer>,
    ) -> Option<CommandMemory<<P::Dma as DmaAdapter>::Buffer>> {
        let mut state = self.state.lock();
        let slots = memory.mailboxes.len();
        let previous = state.memory.replace(memory);
        state.mode = CommandMode::Polled;
        state.producer = 0;
        state.slots = (0..slots).map(|_| None).collect();
        previous
    }

    /// Fails whatever is outstanding or queued (as [`fail`](Self::fail)),
    /// and hands the queue's memory back for freeing. The interface is
    /// offline afterwards.
    pub fn detach(&self) -> Option<CommandMemory<<P::Dma as DmaAdapter>::Buffer>> {
        let finished = {
            let mut state = self.state.lock();
            let finished = Self::fail_locked(&mut state, None);
            state.mode = CommandMode::Offline;
            state.slots.clear();
            (finished, state.memory.take())
        };
        run_all(finished.0);
        finished.1
    }

    /// The current mode.
    pub fn mode(&self) -> CommandMode {
        self.state.lock().mode
    }

    /// Command slots (the bound on outstanding commands); 0 while offline.
    pub fn slot_count(&self) -> usize {
        self.state.lock().slots.len()
    }

    /// The counters.
    pub fn counters(&self) -> CommandCounters {
        self.state.lock().counters
    }

    /// The command timeout in nanoseconds.
    pub fn timeout_ns(&self) -> u64 {
        self.state.lock().timeout_ns
    }

    /// Changes the command timeout (applies to commands already issued).
    pub fn set_timeout_ns(&self, timeout_ns: u64) {
        self.state.lock().timeout_ns = timeout_ns;
    }

    /// Switches from polled to event mode: from now on every command asks
    /// for completion by event, and commands queued meanwhile are issued.
    /// Call only once the EQ mapped for command completions is armed.
    pub fn enable_events(&self, bar0: &P::Mmio, now_ns: u64) -> Result<(), CommandError> {
        let finished = {
            let mut state = self.state.lock();
            if state.mode != CommandMode::Polled {
                return Err(CommandError::NotRunning);
            }
            state.mode = CommandMode::Event;
            Self::issue_waiting(&mut state, bar0, now_ns)
        };
        run_all(finished);
        Ok(())
    }

    /// Back to polled mode for teardown: outstanding and queued commands
    /// complete with [`CommandError::DeviceFailed`] (their answers would
    /// need the EQ that teardown is about to destroy).
    pub fn disable_events(&self) {
        let finished = {
            let mut state = self.state.lock();
            if state.mode != CommandMode::Event {
                return;
            }
            let finished = Self::fail_locked(&mut state, None);
            state.mode = CommandMode::Polled;
            finished
        };
        run_all(finished);
    }

    /// Runs one command in polled mode and returns its result. Callable at
    /// PASSIVE_LEVEL or DISPATCH_LEVEL; spins for at most the poll bound and
    /// the timeout. A command that does not complete in time declares the
    /// device failed.
    ///
    /// The command lock is held while spinning: polled mode is for
    /// bring-up and teardown, when nothing else issues commands, and the
    /// spin is bounded.
    pub fn execute_polled(
        &self,
        bar0: &P::Mmio,
        now: &dyn Fn() -> u64,
        command: Command,
    ) -> Result<CommandOutput, CommandError> {
        let opcode = command.opcode;
        let max_polls = self.max_polls;
        let mut state = self.state.lock();
        match state.mode {
            CommandMode::Polled => {}
            CommandMode::Failed => return Err(CommandError::DeviceFailed { opcode }),
            CommandMode::Offline | CommandMode::Event => return Err(CommandError::NotRunning),
        }
        let Some(memory) = state.memory.as_ref() else {
            return Err(CommandError::NotRunning);
        };
        let log_size = memory.log_size;
        let counter = state.producer;
        let Some(entry) = Self::write_entry(memory, 0, counter, 0, &command, false)? else {
            return Err(CommandError::NotRunning);
        };
        state.producer = counter.wrapping_add(1);
        state.counters.issued += 1;
        dma_wmb();
        bar0.write32(offset::CMDQ_DOORBELL, state.producer);
        let started = now();
        let timeout = state.timeout_ns;
        let ring_offset = entry * CMD_ENTRY_SIZE;
        let mut polls = 0u64;
        loop {
            let mut raw = [0u8; CMD_ENTRY_SIZE];
            if let Some(memory) = state.memory.as_ref()
                && read_owned_entry(&memory.ring, ring_offset, CMD_DONE_OFFSET, &mut raw, |b| {
                    owner::is_valid(b, counter, log_size)
                })
                && let Ok(done) = CmdEntry::read_from_bytes(&raw)
                && owner::is_valid(done.done, counter, log_size)
            {
                let result = Self::result_of(
                    memory,
                    0,
                    opcode,
                    command.output_len,
                    done.status,
                    done.out_imm.get(),
                );
                state.counters.completed += 1;
                return result;
            }
            polls += 1;
            if polls >= max_polls || now().saturating_sub(started) >= timeout {
                let finished = Self::fail_locked(&mut state, None);
                drop(state);
                run_all(finished);
                return Err(CommandError::Timeout { opcode });
            }
            core::hint::spin_loop();
        }
    }

    /// Submits a command; never blocks. In event mode the command is issued
    /// now if a slot is free, else it waits in the FIFO; `continuation`
    /// runs when it completes. During polled bring-up it waits in the FIFO
    /// until [`enable_events`](Self::enable_events). Offline (before
    /// bring-up or after teardown) `continuation` runs at once with
    /// [`CommandError::NotRunning`], and on a failed device with
    /// [`CommandError::DeviceFailed`]. Callable at DISPATCH_LEVEL or below.
    pub fn submit(
        &self,
        bar0: &P::Mmio,
        now_ns: u64,
        command: Command,
        continuation: Continuation,
    ) {
        let mut state = self.state.lock();
        if state.mode == CommandMode::Failed {
            drop(state);
            let opcode = command.opcode;
            continuation(Err(CommandError::DeviceFailed { opcode }));
            return;
        }
        if state.mode == CommandMode::Offline {
            // Before bring-up or after teardown: holding the command would
            // replay it, with stale indices, into the next bring-up.
            drop(state);
            continuation(Err(CommandError::NotRunning));
            return;
        }
        if state.mode != CommandMode::Event || state.slots.iter().all(Option::is_some) {
            state.counters.queued_for_slot += 1;
        }
        state.waiting.push_back(Waiting {
            command,
            continuation,
        });
        if state.mode == CommandMode::Event {
            let finished = Self::issue_waiting(&mut state, bar0, now_ns);
            drop(state);
            run_all(finished);
        }
    }

    /// Completes the command whose token is `token` with the device's
    /// `status` and `out_imm` (a `CMD_COMPLETION` event), issues waiting
    /// commands into the freed slot, and runs the continuation. Called from
    /// the DPC. Returns false (and counts it) if no command has that token.
    pub fn complete(
        &self,
        bar0: &P::Mmio,
        now_ns: u64,
        token: u16,
        status: u8,
        out_imm: u64,
    ) -> bool {
        let mut state = self.state.lock();
        let slot = usize::from(token) & ((1 << MAX_LOG_SLOTS) - 1);
        let matches = state
            .slots
            .get(slot)
            .and_then(Option::as_ref)
            .is_some_and(|f| f.token == token);
        if !matches || state.mode != CommandMode::Event {
            state.counters.stray_completions += 1;
            return false;
        }
        let Some(in_flight) = state.slots.get_mut(slot).and_then(Option::take) else {
            return false;
        };
        state.counters.completed += 1;
        let result = match state.memory.as_ref() {
            Some(memory) => Self::result_of(
                memory,
                slot,
                in_flight.opcode,
                in_flight.output_len,
                status,
                out_imm,
            ),
            None => Err(CommandError::NotRunning),
        };
        let mut finished = Self::issue_waiting(&mut state, bar0, now_ns);
        drop(state);
        finished.insert(0, (in_flight.continuation, result));
        run_all(finished);
        true
    }

    /// Declares the device failed if a command has been outstanding longer
    /// than the timeout at `now_ns`; then every outstanding and queued
    /// command completes with an error. Returns the opcode that timed out,
    /// if one did. Callable at DISPATCH_LEVEL (the timer routine, the DPC).
    pub fn check_timeouts(&self, now_ns: u64) -> Option<Opcode> {
        let (finished, opcode) = {
            let mut state = self.state.lock();
            if state.mode != CommandMode::Event {
                return None;
            }
            let timeout = state.timeout_ns;
            let overdue = state
                .slots
                .iter()
                .flatten()
                .filter(|f| now_ns.saturating_sub(f.issued_at_ns) >= timeout)
                .min_by_key(|f| f.issued_at_ns)
                .map(|f| f.opcode)?;
            (Self::fail_locked(&mut state, Some(now_ns)), overdue)
        };
        run_all(finished);
        Some(opcode)
    }

    /// When the watchdog should next look: the earliest deadline of an
    /// outstanding command, or `None` when nothing is outstanding.
    pub fn next_deadline_ns(&self) -> Option<u64> {
        let state = self.state.lock();
        if state.mode != CommandMode::Event {
            return None;
        }
        state
            .slots
            .iter()
            .flatten()
            .map(|f| f.issued_at_ns.saturating_add(state.timeout_ns))
            .min()
    }

    /// Declares the device failed (a catastrophic error, a stop): every
    /// outstanding and queued command completes with
    /// [`CommandError::DeviceFailed`], and later submissions fail at once.
    pub fn fail(&self) {
        let finished = {
            let mut state = self.state.lock();
            let finished = Self::fail_locked(&mut state, None);
            if state.mode != CommandMode::Offline {
                state.mode = CommandMode::Failed;
            }
            finished
        };
        run_all(finished);
    }

    /// Takes every outstanding and queued command out with an error and
    /// moves to failed mode. With `timed_out_at`, commands overdue at that
    /// time report [`CommandError::Timeout`], the rest `DeviceFailed`.
    fn fail_locked(
        state: &mut State<<P::Dma as DmaAdapter>::Buffer>,
        timed_out_at: Option<u64>,
    ) -> Finished {
        let timeout = state.timeout_ns;
        let mut finished = Finished::new();
        let mut in_flight: Vec<InFlight> =
            state.slots.iter_mut().filter_map(Option::take).collect();
        // Report in issue order, like completions would have been.
        in_flight.sort_by_key(|f| f.issued_at_ns);
        for f in in_flight {
            let overdue =
                timed_out_at.is_some_and(|now| now.saturating_sub(f.issued_at_ns) >= timeout);
            let error = if overdue {
                CommandError::Timeout { opcode: f.opcode }
            } else {
                CommandError::DeviceFailed { opcode: f.opcode }
            };
            finished.push((f.continuation, Err(error)));
        }
        for w in state.waiting.drain(..) {
            let opcode = w.command.opcode;
            finished.push((w.continuation, Err(CommandError::DeviceFailed { opcode })));
        }
        if state.mode != CommandMode::Offline {
            state.mode = CommandMode::Failed;
        }
        finished
    }

    /// Issues waiting commands into free slots (event mode), in FIFO order,
    /// with one doorbell for the batch. Commands that cannot be encoded
    /// (oversized mailboxes) are returned with their error.
    fn issue_waiting(
        state: &mut State<<P::Dma as DmaAdapter>::Buffer>,
        bar0: &P::Mmio,
        now_ns: u64,
    ) -> Finished {
        let mut finished = Finished::new();
        let mut wrote = false;
        while let Some(slot) = state.slots.iter().position(Option::is_none) {
            let Some(waiting) = state.waiting.pop_front() else {
                break;
            };
            let Some(memory) = state.memory.as_ref() else {
                let opcode = waiting.command.opcode;
                finished.push((
                    waiting.continuation,
                    Err(CommandError::DeviceFailed { opcode }),
                ));
                continue;
            };
            state.sequence = state.sequence.wrapping_add(1);
            // The slot in the low bits finds the command in O(1); the
            // sequence in the high bits tells a late answer for an earlier
            // occupant of the slot from the current one.
            let token = state.sequence << MAX_LOG_SLOTS | slot as u16;
            match Self::write_entry(memory, slot, state.producer, token, &waiting.command, true) {
                Ok(Some(_)) => {
                    state.producer = state.producer.wrapping_add(1);
                    state.counters.issued += 1;
                    wrote = true;
                    state.slots[slot] = Some(InFlight {
                        token,
                        opcode: waiting.command.opcode,
                        output_len: waiting.command.output_len,
                        issued_at_ns: now_ns,
                        continuation: waiting.continuation,
                    });
                }
                Ok(None) => finished.push((waiting.continuation, Err(CommandError::NotRunning))),
                Err(error) => finished.push((waiting.continuation, Err(error))),
            }
        }
        if wrote {
            // The entries and mailboxes before the doorbell (PRM 4.2).
            dma_wmb();
            bar0.write32(offset::CMDQ_DOORBELL, state.producer);
        }
        finished
    }

    /// Writes the mailbox of `slot` and the ring entry for producer counter
    /// `counter`; returns the ring entry index, `Ok(None)` if the DMA copy
    /// was refused.
    fn write_entry(
        memory: &CommandMemory<<P::Dma as DmaAdapter>::Buffer>,
        slot: usize,
        counter: u32,
        token: u16,
        command: &Command,
        event: bool,
    ) -> Result<Option<usize>, CommandError> {
        let opcode = command.opcode;
        if command.output_len > MAX_MAILBOX_BYTES {
            return Err(CommandError::MailboxTooLarge {
                opcode,
                len: command.output_len,
            });
        }
        let Some((mailbox_in, mailbox_out)) = memory.mailboxes.get(slot) else {
            return Ok(None);
        };
        let mut entry = CmdEntry {
            opcode: Le16::new(opcode.code()),
            op_mod: Le16::new(command.op_mod),
            token: Le16::new(token),
            flags: if event { CmdFlags::EVENT.bits() } else { 0 },
            in_mod: Le32::new(command.in_mod),
            // PRM 4.2 has software zero-fill the ring once so the phase
            // tells fresh from stale. Entries completed by event never get
            // their `done` written, so after mixing modes a slot can hold
            // any phase: write the stale phase ourselves every time.
            done: 1 ^ owner::phase_for(counter, memory.log_size),
            ..CmdEntry::default()
        };
        match &command.input {
            CommandInput::None => {}
            CommandInput::Immediate(value) => entry.in_param = Le64::new(*value),
            CommandInput::Mailbox(bytes) => {
                if bytes.len() > MAX_MAILBOX_BYTES || bytes.len() > mailbox_in.len() {
                    return Err(CommandError::MailboxTooLarge {
                        opcode,
                        len: bytes.len(),
                    });
                }
                if !mailbox_in.write(0, bytes) {
                    return Ok(None);
                }
                entry.in_param = Le64::new(mailbox_in.bus_address());
                entry.in_len = Le32::new(bytes.len() as u32);
            }
        }
        if command.output_len > 0 {
            entry.out_param = Le64::new(mailbox_out.bus_address());
            entry.out_len = Le32::new(command.output_len as u32);
        }
        let index = owner::slot(counter, memory.log_size) as usize;
        if !memory.ring.write(index * CMD_ENTRY_SIZE, entry.as_bytes()) {
            return Ok(None);
        }
        Ok(Some(index))
    }

    /// The result of a completed command: its status, and the output
    /// mailbox of `slot` copied out on success.
    fn result_of(
        memory: &CommandMemory<<P::Dma as DmaAdapter>::Buffer>,
        slot: usize,
        opcode: Opcode,
        output_len: usize,
        status: u8,
        out_imm: u64,
    ) -> Result<CommandOutput, CommandError> {
        match CmdStatus::from_code(status) {
            Ok(CmdStatus::Ok) => {}
            Ok(status) => return Err(CommandError::Status { opcode, status }),
            Err(_) => {
                return Err(CommandError::UnknownStatus {
                    opcode,
                    raw: status,
                });
            }
        }
        let mut mailbox = vec![0u8; output_len];
        if output_len > 0 {
            let copied = memory
                .mailboxes
                .get(slot)
                .is_some_and(|(_, out)| out.read(0, &mut mailbox));
            if !copied {
                return Err(CommandError::MailboxTooLarge {
                    opcode,
                    len: output_len,
                });
            }
        }
        Ok(CommandOutput {
            immediate: out_imm,
            mailbox,
        })
    }
}
