//! Event queues, interrupts and completion queues at run time (PRM 6.2, 6.3,
//! 8, 9.3): writing EQEs and CQEs with their owner bits, arming, and the
//! EQ and CQ doorbells.

use hca_prm::cmd::CmdStatus;
use hca_prm::cqe::{Cqe, CqeFlags};
use hca_prm::doorbell::{CqArm, CqDoorbell, EqDoorbell};
use hca_prm::eqe::{Eqe, Event, EventClass};
use hca_prm::regs::FatalSyndrome;
use ib_types::scalars::{PortNum, Qpn};
use ib_types::wc::WcStatus;
use zerocopy::IntoBytes;

use super::Device;
use super::dma::MttRange;
use super::resource::Arm;

/// A CQE could not be written: the CQ overflowed or is in error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CqFull;

impl Device {
    /// Writes an EQE to EQ `eqn` and raises its vector if armed.
    fn post_eqe(&mut self, eqn: u32, event: Event) {
        let mem = self.mem.clone();
        let Some(hca) = self.hca.as_mut() else {
            return;
        };
        let Some(eq) = hca.eqs.get_mut(eqn as usize).and_then(Option::as_mut) else {
            return;
        };
        let entries = 1u32 << eq.ring.log_entries;
        if eq.producer.wrapping_sub(eq.consumer) >= entries {
            self.declare_fatal(FatalSyndrome::EqOverflow);
            return;
        }
        let eqe = Eqe::new(event).with_owner(eq.producer, eq.ring.log_entries);
        let at = u64::from(eq.producer & (entries - 1)) * 32;
        let range = MttRange::of_ring(&eq.ring);
        let written = hca
            .mtt
            .write(mem.as_ref(), range, at, eqe.as_bytes())
            .is_ok();
        if !written {
            self.note_fault();
            self.declare_fatal(FatalSyndrome::DmaFault);
            return;
        }
        let Some(eq) = self
            .hca
            .as_mut()
            .and_then(|h| h.eqs.get_mut(eqn as usize))
            .and_then(Option::as_mut)
        else {
            return;
        };
        eq.producer = eq.producer.wrapping_add(1);
        if eq.armed {
            eq.armed = false;
            let vector = eq.vector;
            self.counters.interrupts += 1;
            self.irq.raise(vector);
        }
    }

    /// Posts an event of a mapped class (PRM 8.2); unmapped classes are
    /// counted and dropped.
    pub(crate) fn post_event(&mut self, event: Event) {
        let Some(class) = event.event_type().class() else {
            return;
        };
        let eqn = self.hca.as_ref().and_then(|h| {
            let bit = class.bits().trailing_zeros() as usize;
            h.event_map.get(bit).copied().flatten()
        });
        match eqn {
            Some(eqn) => self.post_eqe(eqn, event),
            None => self.counters.unmapped_events += 1,
        }
    }

    /// Completes a command by event (PRM 4.3).
    pub(super) fn post_cmd_completion(&mut self, token: u16, status: CmdStatus, out_imm: u64) {
        if let Some(held) = self.held_completions.as_mut() {
            held.push((token, status.code(), out_imm));
            return;
        }
        self.post_event(Event::CmdCompletion {
            token,
            status: status.code(),
            out_imm,
        });
    }

    /// Reports a catastrophic error on the device-error EQ.
    pub(super) fn post_catastrophic(&mut self) {
        // Post directly: `post_eqe` refuses nothing for a fatal device, but
        // must not recurse into `declare_fatal` — the EQE write is best
        // effort here.
        let eqn = self.hca.as_ref().and_then(|h| {
            let bit = EventClass::DEVICE.bits().trailing_zeros() as usize;
            h.event_map.get(bit).copied().flatten()
        });
        if let Some(eqn) = eqn {
            self.post_eqe(eqn, Event::Catastrophic);
        }
    }

    /// Reports a port's transition to or from ACTIVE.
    pub(super) fn post_port_change(&mut self, port: u8, active: bool) {
        if let Ok(port) = PortNum::new(port) {
            self.post_event(Event::PortChange { port, active });
        }
    }

    /// Posts a QP-affiliated event for QP table index `qpn`.
    pub(crate) fn post_qp_event(&mut self, event: impl FnOnce(Qpn) -> Event, qpn: u32) {
        self.post_event(event(Qpn::from_low_bits(qpn)));
    }

    /// `EQ_DOORBELL[n]` (PRM 8.3).
    pub(super) fn eq_doorbell(&mut self, eqn: u32, value: u32) {
        let Ok(db) = EqDoorbell::decode(value) else {
            self.counters.dropped_doorbells += 1;
            return;
        };
        let Some(eq) = self
            .hca
            .as_mut()
            .and_then(|h| h.eqs.get_mut(eqn as usize))
            .and_then(Option::as_mut)
        else {
            self.counters.dropped_doorbells += 1;
            return;
        };
        eq.consumer = db.consumer_after(eq.consumer);
        if db.arm {
            if eq.producer != eq.consumer {
                // EQEs arrived after the consumer the driver wrote: no lost
                // wake-up.
                eq.armed = false;
                let vector = eq.vector;
                self.counters.interrupts += 1;
                self.irq.raise(vector);
            } else {
                eq.armed = true;
            }
        }
    }

    /// Writes a CQE to CQ `cqn` (PRM 6.2, 9.3). Overflow puts the CQ in
    /// error and posts `CQ_ERROR`; the caller moves its QP to ERR.
    pub(crate) fn post_cqe(&mut self, cqn: u32, cqe: Cqe) -> Result<(), CqFull> {
        let (ci_dbr, producer, log_entries, ring, error) = {
            let Some(cq) = self
                .hca
                .as_ref()
                .and_then(|h| h.cqs.get(cqn as usize))
                .and_then(Option::as_ref)
            else {
                return Err(CqFull);
            };
            (
                cq.ci_dbr,
                cq.producer,
                cq.ring.log_entries,
                cq.ring,
                cq.error,
            )
        };
        if error {
            return Err(CqFull);
        }
        let consumer = self.read_dbr(ci_dbr).unwrap_or(producer);
        let entries = 1u32 << log_entries;
        if producer.wrapping_sub(consumer) >= entries {
            if let Some(cq) = self.cq_mut(cqn) {
                cq.error = true;
                cq.arm = Arm::None;
            }
            self.post_event(Event::CqError { cqn });
            return Err(CqFull);
        }
        let cqe = cqe.with_owner(producer, log_entries);
        let at = u64::from(producer & (entries - 1)) * 32;
        let written = self.hca.as_ref().is_some_and(|h| {
            h.mtt
                .write(
                    self.mem.as_ref(),
                    MttRange::of_ring(&ring),
                    at,
                    cqe.as_bytes(),
                )
                .is_ok()
        });
        if !written {
            self.note_fault();
            self.declare_fatal(FatalSyndrome::DmaFault);
            return Err(CqFull);
        }
        let solicited =
            cqe.flags().contains(CqeFlags::SOLICITED) || cqe.status != WcStatus::Success.code();
        let fire = {
            let Some(cq) = self.cq_mut(cqn) else {
                return Ok(());
            };
            cq.producer = producer.wrapping_add(1);
            let fire = match cq.arm {
                Arm::Next => true,
                Arm::Solicited => solicited,
                Arm::None => false,
            };
            if fire {
                cq.arm = Arm::None;
            }
            fire.then_some(cq.eqn)
        };
        if let Some(eqn) = fire {
            self.post_eqe(eqn, Event::Completion { cqn });
        }
        Ok(())
    }

    fn cq_mut(&mut self, cqn: u32) -> Option<&mut super::resource::Cq> {
        self.hca.as_mut()?.cqs.get_mut(cqn as usize)?.as_mut()
    }

    /// `CQ_DOORBELL` (PRM 9.3): arms the CQ, or fires at once if CQEs were
    /// written past the consumer counter the doorbell carries.
    pub(super) fn cq_doorbell(&mut self, uar: u32, db: CqDoorbell) {
        let cqn = db.cqn();
        let Some(cq) = self.cq_mut(cqn) else {
            self.counters.dropped_doorbells += 1;
            return;
        };
        if cq.uar != uar || cq.error {
            self.counters.dropped_doorbells += 1;
            return;
        }
        if cq.producer != db.consumer() {
            cq.arm = Arm::None;
            let eqn = cq.eqn;
            self.post_eqe(eqn, Event::Completion { cqn });
            return;
        }
        cq.arm = match db.cmd() {
            CqArm::Solicited => Arm::Solicited,
            CqArm::Next => Arm::Next,
        };
    }
}
