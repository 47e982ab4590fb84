//! Power: what the verbs keep across a D0 exit and how D0 entry gives every
//! object back to the device (docs/miniport.md, "Power"). [`Hca::d0_exit`]
//! and [`Hca::d0_entry`] (in `init.rs`) call the steps here.
//!
//! Contract:
//! - **Handles.** Nothing a client holds becomes invalid: the object
//!   tables, numbers, generations, rings, doorbell records and the memory
//!   translation stay in host memory while the device is below D0; D0
//!   entry brings the device up into the same context-table layout (a
//!   different layout fails D0 entry and declares the device failed) and
//!   re-creates every object at its old number.
//! - **Memory.** Common buffers stay allocated and locked pages stay
//!   mapped across the transition: the host model's DMA adapter (and
//!   Windows' for a device that stays enumerated) keeps bus addresses
//!   valid while the function is in D3, so nothing is re-mapped; only the
//!   device's copies (MTT, MPT, contexts) are written again. The context
//!   tables, the EQ ring and the command queue are freed at D0 exit and
//!   allocated afresh at D0 entry, like at start.
//! - **While down** verbs are refused with [`IbStatus::InvalidState`]
//!   (`submit_request`, posts, arming): the KMDF shell's power-managed
//!   queue holds requests so this is reached only by direct calls. Polling
//!   works and returns what was saved.
//! - **D0 exit** (after in-flight commands failed, see `init.rs`): every
//!   CQE the device wrote and the client has not polled is moved, in
//!   order and with its `wr_id` resolved, into the CQ's software backlog,
//!   which [`Hca::poll_cq`] returns before the ring. The PRM has no way to
//!   give a re-created CQ, SRQ or QP its old counters (they start at 0,
//!   PRM 6.1.2, 6.2, 6.4), so rings restart at counter 0: the backlog
//!   keeps the CQ's entries, and posted WQEs are moved to the front of
//!   their rings. An SRQ's armed limit is read back (`QUERY_SRQ`).
//!   Connected QPs (RC and UC in RTR, RTS, SQD or SQE), UD-type QPs in
//!   SQE (which no modify can re-enter) and QPs already in ERR get their
//!   outstanding WRs completed with `WR_FLUSH_ERR` into their CQs'
//!   backlogs (`wr_id`s kept, posting order) and their cached state set
//!   to ERR; the client gets [`AsyncEventCode::QpFatal`] for each that
//!   was not already in ERR, from the DPC after D0 entry. Each memory
//!   window's tag is read back (`QUERY_MPT`).
//! - **D0 entry** (polled commands, before events are enabled again):
//!   memory regions (`WRITE_MTT` of each translation, `SW2HW_MPT` with the
//!   same index and tag, so the same L_Key and R_Key), CQs (ring
//!   zero-filled, consumer 0, `SW2HW_CQ`, re-armed as the client left it;
//!   a CQ armed with completions in its backlog gets its completion event
//!   from software instead), SRQs (posted WQEs compacted to the front,
//!   `SW2HW_SRQ` with the saved limit), QPs (`SW2HW_QP`, then the modify
//!   chain from RESET to the cached state with the cached attributes the
//!   IBA Table 91 rule of each step takes; RESET to ERR for the ones
//!   above; posted send WQEs are rung again), multicast memberships
//!   (`ATTACH_MCG` again). PDs and AVs are software objects and need
//!   nothing. Memory windows come back free (PRM 7.1 creates a window only
//!   unbound) with the tag read back at D0 exit, so their R_Key is
//!   unchanged but a binding is lost: the client binds again.
//! - Destroyed QPs kept for their completions' `wr_id`s are not
//!   re-created (the device had already forgotten them).
//! - **User-mode CQs, QPs and SRQs** (`super::user`) are not re-created:
//!   their rings and counters live in the process's provider, which cannot
//!   be told that the device restarted every counter at 0. They are marked
//!   lost (their destroy frees them whatever the device answers), user QPs
//!   read ERR, and each object's context hears of it through
//!   `GetAsyncEvent` (`CqError`, `QpFatal`, `SrqCatastrophic`). User
//!   contexts, PDs and memory regions survive like the kernel's.

use alloc::sync::Arc;
use alloc::vec::Vec;
use core::sync::atomic::Ordering;

use driver_platform::{CommonBuffer, Deferred, Mmio, Platform};
use hca_prm::cmd::Opcode;
use hca_prm::ctx::{Cqc, ModifyQp as ModifyQpInput, Qpc, QpcFlags, Srqc};
use hca_prm::doorbell::{CQ_DOORBELL, CqArm, CqDoorbell, DoorbellRecord, uar_offset};
use hca_prm::wqe::BB_SIZE;
use hca_prm::{Le32, Le64};
use ib_types::event::{AsyncEventCode, AsyncEventRecord};
use ib_types::ioctl::VerbId;
use ib_types::qp::{QpModify, QpState, QpType};
use ib_types::scalars::Qpn;
use ib_types::status::IbStatus;
use ib_types::wc::{WcOpcode, WcStatus, WorkCompletion};
use zerocopy::{FromBytes, FromZeros, IntoBytes};

use super::cq::{self, CqNotify, PAGE};
use super::qp::{self, Qp};
use super::srq;
use crate::cmd::{Command, CommandError};
use crate::hca::Hca;
use crate::resources::{Handle, KERNEL_UAR, kind};

/// An event software produced for the client, delivered by the DPC.
#[derive(Debug, Clone, Copy)]
pub(crate) enum SoftEvent {
    /// A completion event on the CQ with this (raw) handle.
    Completion(u64),
    /// An asynchronous event.
    Async(AsyncEventRecord),
}

/// Why D0 entry could not give the objects back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RestoreError {
    /// A restore command failed.
    Command(CommandError),
}

impl<P: Platform> Hca<P> {
    /// Fails with [`IbStatus::InvalidState`] while the device is below D0
    /// or failed: the data-path verbs (post, arm) need the device. Two
    /// atomic loads, no lock. The posting paths call it under their ring
    /// lock: D0 exit and the failure path set their flag before they flush
    /// under the same lock, so a WR is either refused or flushed, never
    /// lost.
    pub(crate) fn check_running(&self) -> Result<(), IbStatus> {
        if self.powered_down.load(Ordering::Acquire) || self.failure_reported() {
            Err(IbStatus::InvalidState)
        } else {
            Ok(())
        }
    }

    /// Whether `submit_request` may run `verb` now: nothing while below D0;
    /// after a device failure only the verbs that free something
    /// ([`super::fatal`]).
    pub(crate) fn admit(&self, verb: VerbId) -> Result<(), IbStatus> {
        if self.powered_down.load(Ordering::Acquire) {
            return Err(IbStatus::InvalidState);
        }
        if self.is_failed() && !super::fatal::frees(verb) {
            return Err(IbStatus::InvalidState);
        }
        Ok(())
    }

    /// Queues `event` for the client and the DPC that delivers it.
    pub(crate) fn queue_soft_event(&self, event: SoftEvent) {
        self.verbs.soft_events.lock().push(event);
        self.deferred.queue_dpc();
    }

    /// Queues a software completion event for the CQ `cq` (raw handle).
    pub(crate) fn queue_soft_completion(&self, cq: u64) {
        self.queue_soft_event(SoftEvent::Completion(cq));
    }

    /// Delivers the queued software events (from the DPC); held while the
    /// device is below D0. An event whose CQ, QP or SRQ was destroyed
    /// since it was queued is dropped: handles carry a generation, so it
    /// never reaches a new owner of the number.
    pub(crate) fn deliver_soft_events(&self) {
        if self.powered_down.load(Ordering::Acquire) {
            return;
        }
        let events = core::mem::take(&mut *self.verbs.soft_events.lock());
        for event in events {
            let live = self
                .with_objects(|o| match event {
                    SoftEvent::Completion(cq) => {
                        o.cqs.get(Handle::<kind::Cq>::from_raw(cq)).is_some()
                    }
                    SoftEvent::Async(record) => match record.code {
                        AsyncEventCode::QpFatal => o
                            .qps
                            .objects()
                            .get(Handle::<kind::Qp>::from_raw(record.handle))
                            .is_some(),
                        AsyncEventCode::SrqCatastrophic => o
                            .srqs
                            .get(Handle::<kind::Srq>::from_raw(record.handle))
                            .is_some(),
                        _ => true,
                    },
                })
                .unwrap_or(false);
            if !live {
                continue;
            }
            // A user object's events go to its context ([`super::user`]),
            // a kernel object's to the client.
            match event {
                SoftEvent::Completion(cq) => {
                    if !self.user_cq_event(cq) {
                        let cq = ib_types::handle::CqHandle::from_raw(cq);
                        self.deliver(|client| client.completion(cq));
                    }
                }
                SoftEvent::Async(record) => {
                    if !self.user_async_event(&record) {
                        self.deliver(|client| client.async_event(&record));
                    }
                }
            }
        }
    }

    /// The device's completion event for CQ `cqn` ends the arming.
    pub(crate) fn note_cq_event(&self, cqn: u32) {
        let cq = self
            .with_objects(|o| o.cqs.get_by_number(cqn).map(|(_, cq)| cq.clone()))
            .ok()
            .flatten();
        if let Some(cq) = cq {
            cq.ring.lock().armed = None;
        }
    }

    // ----- D0 exit ----------------------------------------------------

    /// Before the device is taken down (polled commands): reads back each
    /// SRQ's armed limit and each memory window's tag (the last bind's).
    pub(crate) fn save_before_reset(
        &self,
        polled: &dyn Fn(Command) -> Result<Vec<u8>, CommandError>,
    ) {
        let windows = self
            .with_objects(|o| o.mws.iter().map(|(h, _)| h).collect::<Vec<_>>())
            .unwrap_or_default();
        for handle in windows {
            let query = Command::new(Opcode::QueryMpt, handle.number())
                .with_output(size_of::<hca_prm::mpt::MptEntry>());
            let tag = polled(query).ok().and_then(|mailbox| {
                hca_prm::mpt::MptEntry::read_from_prefix(&mailbox)
                    .ok()
                    .map(|(entry, _)| entry.tag)
            });
            if let Some(tag) = tag {
                let _ = self.with_objects_mut(|o| {
                    if let Some(window) = o.mws.get_mut(handle) {
                        window.saved_tag = tag;
                    }
                });
            }
        }
        let srqs = self
            .with_objects(|o| o.srqs.iter().map(|(_, s)| s.clone()).collect::<Vec<_>>())
            .unwrap_or_default();
        for srq in srqs {
            let query = Command::new(Opcode::QuerySrq, srq.srqn).with_output(size_of::<Srqc>());
            let limit = polled(query)
                .ok()
                .and_then(|mailbox| Srqc::read_from_prefix(&mailbox).ok().map(|(srqc, _)| srqc))
                .map_or(0, |srqc| srqc.limit.get());
            srq.ring.lock().saved_limit = limit;
        }
    }

    /// After the device is reset (it writes nothing any more): moves the
    /// CQEs not yet polled into the backlogs, and flushes the QPs that
    /// cannot come back as they were (see the module doc).
    pub(crate) fn save_after_reset(&self) {
        self.drain_rings_to_backlogs();
        let qps = self.live_qps();
        for (handle, qp) in qps {
            if qp.sq.lock().ring.is_none() {
                // A user QP: given up at D0 entry (`give_up_user_objects`).
                continue;
            }
            let state = qp.state();
            let connected = matches!(qp.qp_type, QpType::Rc | QpType::Uc)
                && matches!(
                    state,
                    QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
                );
            let lost = connected || state == QpState::Sqe || state == QpState::Err;
            if !lost {
                continue;
            }
            // A ring whose accounting cannot be true flushed nothing: its
            // WRs are lost, so the client hears QpFatal even for a QP it
            // had already moved to ERR.
            let lost_wrs = self.flush_in_software(&qp).is_err();
            {
                let mut c = qp.control.lock();
                qp.set_state(&mut c, QpState::Err);
            }
            if (state != QpState::Err || lost_wrs)
                && let Ok(record) = AsyncEventRecord::new(AsyncEventCode::QpFatal, handle, None, 0)
            {
                self.queue_soft_event(SoftEvent::Async(record));
            }
        }
    }

    /// Every CQ's unpolled CQEs into its backlog, in order, `wr_id`s
    /// resolved (the poll path does the resolving).
    pub(crate) fn drain_rings_to_backlogs(&self) {
        let cqs = self
            .with_objects(|o| {
                o.cqs
                    .iter()
                    .map(|(h, cq)| (h.raw(), cq.clone()))
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default();
        for (handle, cq) in cqs {
            let mut drained = Vec::new();
            let mut batch = [WorkCompletion::EMPTY; 32];
            while let Ok(n @ 1..) = self.poll_cq(handle, &mut batch) {
                drained.extend_from_slice(&batch[..n]);
            }
            cq.ring.lock().backlog.extend(drained);
        }
    }

    /// The live QPs (not being created or destroyed) with their handles.
    pub(crate) fn live_qps(&self) -> Vec<(u64, Arc<Qp<P>>)> {
        self.with_objects(|o| {
            o.qps
                .objects()
                .iter()
                .map(|(h, qp)| (h.raw(), qp.clone()))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default()
        .into_iter()
        .filter(|(_, qp)| matches!(qp.control.lock().life, qp::Life::Live | qp::Life::Modifying))
        .collect()
    }

    /// Completes every WR outstanding on `qp` with `WR_FLUSH_ERR` into its
    /// CQs' backlogs (sends, then receives, each in posting order, as the
    /// device's flush would) and empties its rings; queues a completion
    /// event for each CQ that got any. A CQ already destroyed gets nothing.
    ///
    /// Each walk is bounded by its ring ([`walk_outstanding`]): a queue
    /// whose completion tail is not within one ring behind its producer
    /// (accounting that cannot be true) flushes nothing — its slots cannot
    /// be trusted to name outstanding WRs — is emptied all the same, and
    /// is reported in the error; the other queue is flushed normally.
    pub(crate) fn flush_in_software(&self, qp: &Qp<P>) -> Result<(), RingInconsistent> {
        let flushed = |wr_id, opcode| WorkCompletion {
            wr_id,
            qp_num: Qpn::from_low_bits(qp.qpn),
            status: WcStatus::WrFlushErr,
            opcode,
            ..WorkCompletion::EMPTY
        };
        let mut sends = Vec::new();
        let send_walk = {
            let sq = qp.sq.lock();
            let done = &qp.done;
            let log = qp.geometry.sq_log_bbs;
            let mask = (1u32 << log) - 1;
            let walk = walk_outstanding(done.send_tail.counter(), sq.producer, log, |counter| {
                let (wr_id, bbs) = send_slot(done, (counter & mask) as usize);
                sends.push(flushed(wr_id, WcOpcode::Send));
                bbs
            });
            if walk.is_err() {
                sends.clear();
            }
            done.send_tail.restart(sq.producer);
            walk
        };
        let mut recvs = Vec::new();
        let recv_walk = {
            let rq = qp.rq.lock();
            let done = &qp.done;
            let log = qp.geometry.rq_log_entries;
            let mask = (1u32 << log) - 1;
            let walk = walk_outstanding(done.recv_tail.counter(), rq.producer, log, |counter| {
                recvs.push(flushed(
                    recv_slot(done, (counter & mask) as usize),
                    WcOpcode::Recv,
                ));
                1
            });
            if walk.is_err() {
                recvs.clear();
            }
            done.recv_tail.restart(rq.producer);
            walk
        };
        for (cq, wcs) in [(qp.send_cq, sends), (qp.recv_cq, recvs)] {
            if wcs.is_empty() {
                continue;
            }
            let found = self
                .with_objects(|o| o.cqs.get(Handle::<kind::Cq>::from_raw(cq)).cloned())
                .ok()
                .flatten();
            if let Some(found) = found {
                found.ring.lock().backlog.extend(wcs);
                self.queue_soft_completion(cq);
            }
        }
        let queue = |walk: Result<(), OutOfRing>, recv| {
            walk.map_err(|out| RingInconsistent {
                qpn: qp.qpn,
                recv,
                tail: out.tail,
                producer: out.producer,
                capacity: out.capacity,
            })
        };
        queue(send_walk, false).and(queue(recv_walk, true))
    }

    // ----- D0 entry ---------------------------------------------------

    /// Gives every object back to the freshly brought-up device with
    /// polled commands (see the module doc). Stops at the first failure.
    pub(crate) fn restore_verbs(
        &self,
        polled: &dyn Fn(Command) -> Result<Vec<u8>, CommandError>,
    ) -> Result<(), RestoreError> {
        let run = |commands: Vec<Command>| -> Result<(), RestoreError> {
            for command in commands {
                polled(command).map_err(RestoreError::Command)?;
            }
            Ok(())
        };
        let Ok((mtt, eqn, cqs, srqs, windows, memberships)) = self.with_objects(|o| {
            (
                o.mtt.clone(),
                o.eqn,
                o.cqs
                    .iter()
                    .map(|(h, c)| (h.raw(), c.clone()))
                    .collect::<Vec<_>>(),
                o.srqs
                    .iter()
                    .map(|(h, s)| (h.raw(), s.clone()))
                    .collect::<Vec<_>>(),
                o.mws
                    .iter()
                    .map(|(h, w)| (h.number(), w.clone()))
                    .collect::<Vec<_>>(),
                o.mcasts
                    .iter()
                    .map(|(_, m)| (m.qp.qpn(), m.gid))
                    .collect::<Vec<_>>(),
            )
        }) else {
            // No object was ever made: nothing to restore.
            return Ok(());
        };
        run(mtt.restore_commands())?;
        self.give_up_user_objects(&cqs, &srqs, true);
        // Windows come back free (PRM 7.1 creates them unbound) with the
        // tag they had, so their R_Key is unchanged; a binding is lost.
        for (index, window) in &windows {
            let entry = hca_prm::mpt::MptEntry {
                kind: super::mw::mpt_kind(window.mw_type).code(),
                state: 0,
                tag: window.saved_tag,
                pd: Le32::new(Handle::<kind::Pd>::from_raw(window.pd).number()),
                ..hca_prm::mpt::MptEntry::default()
            };
            run(alloc::vec![
                Command::new(Opcode::Sw2HwMpt, *index).with_mailbox(entry.as_bytes().to_vec())
            ])?;
        }
        for (_, cq) in &cqs {
            run(self.restore_cq(cq, eqn))?;
        }
        for (_, srq) in &srqs {
            run(restore_srq(srq))?;
        }
        for (_, qp) in self.live_qps() {
            let (commands, ring_sq) = self.restore_qp(&qp);
            run(commands)?;
            if let Some(producer) = ring_sq {
                self.ring_send_doorbell(qp.qpn, producer);
            }
        }
        // Multicast memberships (UD QPs only, attached whatever their
        // state).
        for (qpn, gid) in &memberships {
            run(alloc::vec![
                Command::new(Opcode::AttachMcg, *qpn).with_mailbox(gid.as_bytes().to_vec())
            ])?;
        }
        for (handle, cq) in &cqs {
            let mut ring = cq.ring.lock();
            let Some(notify) = ring.armed else { continue };
            if ring.backlog.is_empty() {
                let arm = match notify {
                    CqNotify::Solicited => CqArm::Solicited,
                    CqNotify::NextCompletion => CqArm::Next,
                };
                if let Ok(doorbell) = CqDoorbell::new(cq.cqn, arm, ring.consumer) {
                    self.bar0
                        .write64(uar_offset(KERNEL_UAR) + CQ_DOORBELL, doorbell.encode());
                }
            } else {
                ring.armed = None;
                drop(ring);
                self.queue_soft_completion(*handle);
            }
        }
        Ok(())
    }

    /// User CQs, QPs and SRQs (rings in a process's memory, counters in
    /// its provider) cannot be given back: the device restarts every
    /// counter at 0 and the provider cannot be told to. They are left off
    /// the device, marked lost (their destroy frees them, `forgive_destroy`),
    /// their QPs' cached state set to ERR, and each one's context told:
    /// `CqError`, `QpFatal`, `SrqCatastrophic` (from the DPC, through the
    /// context's `GetAsyncEvent`).
    /// With `mark_lost` false (a device failure, [`super::fatal`]) only the
    /// QPs' state and the events.
    pub(crate) fn give_up_user_objects(
        &self,
        cqs: &[(u64, Arc<cq::Cq<P>>)],
        srqs: &[(u64, Arc<srq::Srq<P>>)],
        mark_lost: bool,
    ) {
        let mut lost = Vec::new();
        // A user object has no kernel ring; a kernel one being created has
        // none yet either, so only live objects count.
        for (handle, cq) in cqs {
            let ring = cq.ring.lock();
            if ring.ring.is_none() && ring.life == cq::Life::Live {
                lost.push((*handle, AsyncEventCode::CqError));
            }
        }
        for (handle, srq) in srqs {
            let ring = srq.ring.lock();
            if ring.ring.is_none() && ring.life == srq::Life::Live {
                lost.push((*handle, AsyncEventCode::SrqCatastrophic));
            }
        }
        for (handle, qp) in self.live_qps() {
            if qp.sq.lock().ring.is_none() {
                let mut c = qp.control.lock();
                qp.set_state(&mut c, QpState::Err);
                drop(c);
                lost.push((handle, AsyncEventCode::QpFatal));
            }
        }
        for (handle, code) in lost {
            if mark_lost {
                self.verbs.lost.lock().insert(handle);
            }
            if let Ok(record) = AsyncEventRecord::new(code, handle, None, 0) {
                self.queue_soft_event(SoftEvent::Async(record));
            }
        }
    }

    /// A CQ's ring restarted empty (its entries are in the backlog) and
    /// its `WRITE_MTT` and `SW2HW_CQ`.
    fn restore_cq(&self, cq: &cq::Cq<P>, eqn: u32) -> Vec<Command> {
        let mut ring = cq.ring.lock();
        let (Some(buffer), Some(dbr), Some(mtt)) =
            (ring.ring.as_ref(), ring.dbr.as_ref(), ring.mtt)
        else {
            return Vec::new();
        };
        // PRM 10.4: a zero-filled ring has no valid CQE for pass 0.
        zero_fill(buffer);
        dbr.write(0, DoorbellRecord::new(0).as_bytes());
        let pages = cq::ring_pages(ring.log_entries);
        let cqc = Cqc {
            eqn: Le32::new(eqn),
            uar_index: Le32::new(KERNEL_UAR),
            ring: cq::buf_desc(mtt, ring.log_entries),
            ci_dbr: Le64::new(dbr.bus_address()),
            ..Cqc::default()
        };
        let mut commands = cq::write_mtt(mtt.start(), buffer.bus_address(), pages);
        commands.push(Command::new(Opcode::Sw2HwCq, cq.cqn).with_mailbox(cqc.as_bytes().to_vec()));
        ring.consumer = 0;
        commands
    }

    /// A QP's rings compacted (or emptied), its `WRITE_MTT`s, `SW2HW_QP`
    /// and the modify chain to its cached state; and the send producer to
    /// ring afterwards if WQEs are waiting in a state that sends.
    fn restore_qp(&self, qp: &Qp<P>) -> (Vec<Command>, Option<u32>) {
        let c = qp.control.lock();
        let Some(mtt) = c.mtt else {
            return (Vec::new(), None);
        };
        let (state, attr) = (c.state, c.attr);
        drop(c);
        let g = qp.geometry;
        let sq_pages = g.sq_pages();
        let rq_mtt = mtt.start() + sq_pages as u32;
        let mut qpc = Qpc::new_zeroed();
        qpc.state = QpState::Reset.code();
        qpc.qp_type = qp.qp_type.code();
        qpc.port = qp.create_port;
        let mut flags = QpcFlags::empty();
        if qp.sq_sig_all {
            flags |= QpcFlags::SQ_SIG_ALL;
        }
        if let Some(srq) = qp.srq {
            flags |= QpcFlags::HAS_SRQ;
            qpc.srqn = Le32::new(Handle::<kind::Srq>::from_raw(srq).number());
        }
        qpc.flags = flags.bits();
        qpc.pd = Le32::new(Handle::<kind::Pd>::from_raw(qp.pd).number());
        qpc.send_cqn = Le32::new(Handle::<kind::Cq>::from_raw(qp.send_cq).number());
        qpc.recv_cqn = Le32::new(Handle::<kind::Cq>::from_raw(qp.recv_cq).number());
        qpc.uar_index = Le32::new(KERNEL_UAR);
        qpc.sq = qp::desc(mtt.start(), g.sq_log_bbs, qp::SQ_LOG_STRIDE);
        let mut commands = Vec::new();
        let send_producer = {
            let mut sq = qp.sq.lock();
            let Some(ring) = sq.ring.as_ref() else {
                return (Vec::new(), None);
            };
            commands.extend(cq::write_mtt(mtt.start(), ring.bus_address(), sq_pages));
            compact_send_ring(&mut sq, &qp.done, g.sq_log_bbs);
            sq.producer
        };
        {
            let mut rq = qp.rq.lock();
            if g.has_rq {
                compact_recv_ring(&mut rq, &qp.done, g.rq_log_entries, g.rq_log_stride);
                if let (Some(ring), Some(dbr)) = (rq.ring.as_ref(), rq.dbr.as_ref()) {
                    qpc.rq = qp::desc(rq_mtt, g.rq_log_entries, g.rq_log_stride);
                    qpc.rq_dbr = Le64::new(dbr.bus_address());
                    dbr.write(0, DoorbellRecord::new(rq.producer).as_bytes());
                    commands.extend(cq::write_mtt(rq_mtt, ring.bus_address(), g.rq_pages()));
                }
            }
        }
        commands.push(Command::new(Opcode::Sw2HwQp, qp.qpn).with_mailbox(qpc.as_bytes().to_vec()));
        for (from, to) in modify_chain(state) {
            let modify = step(qp.qp_type, from, to, &attr);
            match qp::modify_input(&modify) {
                Ok(input) => commands.push(
                    Command::new(Opcode::ModifyQp, qp.qpn).with_mailbox(input.as_bytes().to_vec()),
                ),
                Err(_) => {
                    // Cannot happen for attributes a modify already
                    // accepted; go to ERR rather than half-way.
                    let mut input = ModifyQpInput::new_zeroed();
                    input.attr_mask = Le32::new(ib_types::qp::QpAttrMask::STATE.bits());
                    input.next_state = QpState::Err.code();
                    commands.push(
                        Command::new(Opcode::ModifyQp, qp.qpn)
                            .with_mailbox(input.as_bytes().to_vec()),
                    );
                    break;
                }
            }
        }
        let sends = state.accepts_send() && state != QpState::Err && send_producer != 0;
        (commands, sends.then_some(send_producer))
    }

    /// The SQ doorbell of QP `qpn` (PRM 9.1), after the WQEs.
    fn ring_send_doorbell(&self, qpn: u32, producer: u32) {
        driver_platform::dma::dma_wmb();
        let doorbell = hca_prm::doorbell::SqDoorbell {
            qpn: Qpn::from_low_bits(qpn),
            producer,
        };
        self.bar0.write64(
            uar_offset(KERNEL_UAR) + hca_prm::doorbell::SQ_DOORBELL,
            doorbell.encode(),
        );
    }
}

/// An SRQ's posted WQEs compacted to counters `0..n` (the device's
/// consumer restarts at 0) and its `WRITE_MTT` and `SW2HW_SRQ`.
fn restore_srq<P: Platform>(srq: &srq::Srq<P>) -> Vec<Command> {
    let mut state = srq.ring.lock();
    let (Some(mtt), true, true) = (state.mtt, state.ring.is_some(), state.dbr.is_some()) else {
        return Vec::new();
    };
    let entries = srq.entries();
    let stride = srq.stride();
    let mask = entries - 1;
    // Oldest first: the slots from the producer on (one lap back).
    let mut waiting = Vec::new();
    for i in 0..entries {
        let counter = state.producer.wrapping_add(i);
        let slot = (counter & mask) as usize;
        if let Some(wr_id) = srq.wr_ids.take(slot) {
            let mut wqe = alloc::vec![0u8; stride];
            if let Some(ring) = state.ring.as_ref() {
                ring.read(slot * stride, &mut wqe);
            }
            waiting.push((wr_id, wqe));
        }
    }
    let count = waiting.len() as u32;
    for (counter, (wr_id, mut wqe)) in waiting.into_iter().enumerate() {
        set_wqe_index(&mut wqe, 2, counter as u16);
        if let Some(ring) = state.ring.as_ref() {
            ring.write(counter * stride, &wqe);
        }
        srq.wr_ids.put(counter, wr_id);
    }
    state.producer = count;
    let (Some(ring), Some(dbr)) = (state.ring.as_ref(), state.dbr.as_ref()) else {
        return Vec::new();
    };
    dbr.write(0, DoorbellRecord::new(count).as_bytes());
    let pages = (stride << srq.log_entries).div_ceil(PAGE);
    let srqc = Srqc {
        pd: Le32::new(Handle::<kind::Pd>::from_raw(srq.pd).number()),
        limit: Le32::new(state.saved_limit),
        ring: hca_prm::ctx::BufDesc {
            mtt_index: Le32::new(mtt.start()),
            page_offset: Le32::new(0),
            log_page_size: cq::LOG_PAGE,
            log_entries: srq.log_entries,
            log_stride: srq.log_stride,
            ..hca_prm::ctx::BufDesc::default()
        },
        dbr: Le64::new(dbr.bus_address()),
        ..Srqc::default()
    };
    let mut commands = cq::write_mtt(mtt.start(), ring.bus_address(), pages);
    commands.push(Command::new(Opcode::Sw2HwSrq, srq.srqn).with_mailbox(srqc.as_bytes().to_vec()));
    commands
}

/// Writes zeros over the whole buffer.
fn zero_fill<B: CommonBuffer>(buffer: &B) {
    let zeros = [0u8; PAGE];
    let mut at = 0;
    while at < buffer.len() {
        let n = PAGE.min(buffer.len() - at);
        buffer.write(at, &zeros[..n]);
        at += n;
    }
}

/// Overwrites the little-endian `wqe_index` at `offset` of a WQE.
fn set_wqe_index(wqe: &mut [u8], offset: usize, index: u16) {
    if let Some(field) = wqe.get_mut(offset..offset + 2) {
        field.copy_from_slice(&index.to_le_bytes());
    }
}

/// The `wr_id` and basic blocks recorded for the send WQE at `slot`
/// (0, 0 past the records: a user QP keeps none).
fn send_slot<P: Platform>(done: &qp::Completions<P>, slot: usize) -> (u64, u32) {
    let wr_id = done
        .send_wr_ids
        .get(slot)
        .map_or(0, |id| id.load(Ordering::Acquire));
    let bbs = done
        .send_bbs
        .get(slot)
        .map_or(0, |bbs| bbs.load(Ordering::Acquire));
    (wr_id, bbs)
}

/// The `wr_id` recorded for the receive WQE at `slot` (0 past the records).
fn recv_slot<P: Platform>(done: &qp::Completions<P>, slot: usize) -> u64 {
    done.recv_wr_ids
        .get(slot)
        .map_or(0, |id| id.load(Ordering::Acquire))
}

/// Moves the send WQEs between tail and producer to counters `0..` (the
/// device's send counter restarts at 0), patching each control segment's
/// `wqe_index` (PRM 10.2) and the `wr_id` records.
fn compact_send_ring<P: Platform, B: CommonBuffer>(
    sq: &mut qp::SendRing<B>,
    done: &qp::Completions<P>,
    log_bbs: u8,
) {
    let bbs = 1u32 << log_bbs;
    let mask = bbs - 1;
    let ring_bytes = BB_SIZE << log_bbs;
    let mut waiting = Vec::new();
    let mut counter = done.send_tail.counter();
    while counter != sq.producer {
        let (wr_id, size) = send_slot(done, (counter & mask) as usize);
        if size == 0 || size > bbs {
            break;
        }
        let mut wqe = alloc::vec![0u8; size as usize * BB_SIZE];
        if let Some(ring) = sq.ring.as_ref() {
            let at = (counter & mask) as usize * BB_SIZE;
            let first = wqe.len().min(ring_bytes - at);
            ring.read(at, &mut wqe[..first]);
            if first < wqe.len() {
                ring.read(0, &mut wqe[first..]);
            }
        }
        waiting.push((wr_id, size, wqe));
        counter = counter.wrapping_add(size);
    }
    let mut at = 0u32;
    for (wr_id, size, mut wqe) in waiting {
        set_wqe_index(&mut wqe, 4, at as u16);
        if let Some(ring) = sq.ring.as_ref() {
            // Compacted from 0, so no WQE wraps the ring end.
            ring.write(at as usize * BB_SIZE, &wqe);
        }
        if let (Some(id), Some(blocks)) = (
            done.send_wr_ids.get(at as usize),
            done.send_bbs.get(at as usize),
        ) {
            id.store(wr_id, Ordering::Release);
            blocks.store(size, Ordering::Release);
        }
        at += size;
    }
    sq.producer = at;
    done.send_tail.restart(0);
}

/// Moves the receive WQEs between tail and producer to counters `0..`,
/// patching each header's `wqe_index` (PRM 10.3) and the `wr_id` records.
fn compact_recv_ring<P: Platform, B: CommonBuffer>(
    rq: &mut qp::RecvRing<B>,
    done: &qp::Completions<P>,
    log_entries: u8,
    log_stride: u8,
) {
    let mask = (1u32 << log_entries) - 1;
    let stride = 1usize << log_stride;
    let mut waiting = Vec::new();
    let mut counter = done.recv_tail.counter();
    while counter != rq.producer {
        let slot = (counter & mask) as usize;
        let mut wqe = alloc::vec![0u8; stride];
        if let Some(ring) = rq.ring.as_ref() {
            ring.read(slot * stride, &mut wqe);
        }
        waiting.push((recv_slot(done, slot), wqe));
        counter = counter.wrapping_add(1);
    }
    let count = waiting.len() as u32;
    for (index, (wr_id, mut wqe)) in waiting.into_iter().enumerate() {
        set_wqe_index(&mut wqe, 2, index as u16);
        if let Some(ring) = rq.ring.as_ref() {
            ring.write(index * stride, &wqe);
        }
        if let Some(id) = done.recv_wr_ids.get(index) {
            id.store(wr_id, Ordering::Release);
        }
    }
    rq.producer = count;
    done.recv_tail.restart(0);
}

/// The transitions from RESET to `state` (IBA Table 91's forward path).
fn modify_chain(state: QpState) -> Vec<(QpState, QpState)> {
    use QpState::*;
    match state {
        Reset => Vec::new(),
        Init => alloc::vec![(Reset, Init)],
        Rtr => alloc::vec![(Reset, Init), (Init, Rtr)],
        Rts => alloc::vec![(Reset, Init), (Init, Rtr), (Rtr, Rts)],
        Sqd => alloc::vec![(Reset, Init), (Init, Rtr), (Rtr, Rts), (Rts, Sqd)],
        Sqe | Err => alloc::vec![(Reset, Err)],
    }
}

/// The modify of one restore step: the target state and those cached
/// attributes the step's Table 91 rule takes (required or optional).
fn step(qp_type: QpType, from: QpState, to: QpState, cache: &QpModify) -> QpModify {
    let allowed = ib_types::qp_state::attr_rule(qp_type, from, to)
        .map(|rule| rule.required | rule.optional)
        .unwrap_or(ib_types::qp::QpAttrMask::empty());
    let mut out = QpModify::to_state(to);
    macro_rules! keep {
        ($($field:ident),*) => {$(
            if cache.$field.is_some() {
                let mut one = QpModify::default();
                one.$field = cache.$field;
                if allowed.contains(one.mask()) {
                    out.$field = cache.$field;
                }
            }
        )*};
    }
    keep!(
        en_sqd_async_notify,
        access,
        pkey_index,
        port,
        qkey,
        av,
        path_mtu,
        timeout,
        retry_cnt,
        rnr_retry,
        rq_psn,
        max_rd_atomic,
        min_rnr_timer,
        sq_psn,
        max_dest_rd_atomic,
        dest_qpn
    );
    out
}

/// A QP whose ring accounting cannot be true: a work queue's completion
/// tail is not within one ring behind its producer (the WRs outstanding
/// would be more than the ring holds), so [`Hca::flush_in_software`]
/// could not tell which slots hold outstanding WRs and flushed none of
/// that queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RingInconsistent {
    pub(crate) qpn: u32,
    /// The receive queue (else the send queue).
    pub(crate) recv: bool,
    pub(crate) tail: u32,
    pub(crate) producer: u32,
    /// Counter units (WQEs, or send basic blocks) the ring holds.
    pub(crate) capacity: u32,
}

/// A walk from a tail that does not reach its producer within one ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OutOfRing {
    tail: u32,
    producer: u32,
    capacity: u32,
}

/// Calls `visit` with the counter of each WQE outstanding between `tail`
/// and `producer` in a ring of `2^log_capacity` counter units; `visit`
/// answers the WQE's size in units (0: stop there, the rest is unknown).
/// Never more than one ring's worth of calls: a distance past the ring,
/// or WQE sizes that step over the producer, is [`OutOfRing`] (after the
/// calls made so far), never a walk round the 32-bit counter space.
pub(crate) fn walk_outstanding(
    tail: u32,
    producer: u32,
    log_capacity: u8,
    mut visit: impl FnMut(u32) -> u32,
) -> Result<(), OutOfRing> {
    let capacity = 1u32 << log_capacity;
    let out = OutOfRing {
        tail,
        producer,
        capacity,
    };
    let distance = producer.wrapping_sub(tail);
    if distance > capacity {
        return Err(out);
    }
    let mut walked = 0u32;
    while walked < distance {
        let units = visit(tail.wrapping_add(walked));
        if units == 0 {
            return Ok(());
        }
        walked = walked.saturating_add(units);
    }
    if walked == distance { Ok(()) } else { Err(out) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Walks like `flush_in_software`: the counters visited, each WQE
    /// `units` long.
    fn walk(tail: u32, producer: u32, log: u8, units: u32) -> (Vec<u32>, Result<(), OutOfRing>) {
        let mut seen = Vec::new();
        let result = walk_outstanding(tail, producer, log, |counter| {
            seen.push(counter);
            units
        });
        (seen, result)
    }

    #[test]
    fn flush_walks_are_bounded_by_the_ring() {
        // Consistent: every outstanding WQE, across the counter wrap.
        assert_eq!(walk(5, 9, 3, 1), (alloc::vec![5, 6, 7, 8], Ok(())));
        assert_eq!(
            walk(u32::MAX - 1, 2, 3, 2),
            (alloc::vec![u32::MAX - 1, 0], Ok(()))
        );
        assert_eq!(walk(7, 7, 3, 1), (alloc::vec![], Ok(())));
        assert_eq!(walk(0, 8, 3, 1).0.len(), 8, "a full ring");
        // A tail past its producer (2^32 - 1 "outstanding") or more than a
        // ring behind it: nothing visited, reported.
        let out = |tail, producer| OutOfRing {
            tail,
            producer,
            capacity: 8,
        };
        assert_eq!(walk(10, 9, 3, 1), (alloc::vec![], Err(out(10, 9))));
        assert_eq!(walk(0, 9, 3, 1), (alloc::vec![], Err(out(0, 9))));
        // WQE sizes that step over the producer stop within the ring.
        let (seen, result) = walk(0, 5, 3, 2);
        assert_eq!(seen, alloc::vec![0, 2, 4]);
        assert_eq!(result, Err(out(0, 5)));
        // A slot of size 0 ends the walk (nothing known beyond it).
        assert_eq!(walk(0, 4, 3, 0), (alloc::vec![0], Ok(())));
    }

    #[test]
    fn the_chain_climbs_from_reset_and_lost_states_go_to_error() {
        assert!(modify_chain(QpState::Reset).is_empty());
        assert_eq!(
            modify_chain(QpState::Rts),
            alloc::vec![
                (QpState::Reset, QpState::Init),
                (QpState::Init, QpState::Rtr),
                (QpState::Rtr, QpState::Rts)
            ]
        );
        assert_eq!(
            modify_chain(QpState::Err),
            alloc::vec![(QpState::Reset, QpState::Err)]
        );
    }

    #[test]
    fn each_step_takes_only_what_its_rule_allows_and_passes_the_validator() {
        use ib_types::scalars::{PortNum, Psn, QKey};
        let cache = QpModify {
            pkey_index: Some(0),
            port: PortNum::new(1).ok(),
            qkey: Some(QKey::new(0x1111)),
            sq_psn: Psn::new(5).ok(),
            ..QpModify::default()
        };
        let mut state = QpState::Reset;
        for (from, to) in modify_chain(QpState::Rts) {
            assert_eq!(from, state);
            let m = step(QpType::Ud, from, to, &cache);
            assert_eq!(
                ib_types::qp_state::check_modify(QpType::Ud, state, &m),
                Ok(to),
                "{from:?} -> {to:?}: {m:?}"
            );
            state = to;
        }
        // RESET -> INIT of a UD QP never takes a PSN.
        let m = step(QpType::Ud, QpState::Reset, QpState::Init, &cache);
        assert_eq!(m.sq_psn, None);
        assert_eq!(m.qkey, cache.qkey);
    }
}
