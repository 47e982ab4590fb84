//! The power manager: system transitions mapped to device power IRPs.
//!
//! S0 -> Sx (sleep, hibernate, shutdown):
//! 1. **Query.** Every started devnode's stack is asked (children first,
//!    each stack top-down). In an ordinary transition a veto stops it
//!    before any device changes state.
//! 2. **Set.** Devnodes leave D0 children first (a child is powered down
//!    while its parent still works, so it can still talk to its hardware
//!    through the parent); within a stack top-down. From then on their
//!    power-managed queues hold new requests.
//!
//! Shutdown (S5) skips the query: a driver cannot refuse it.
//!
//! A **critical** transition ([`PnpManager::set_system_power_critical`])
//! sleeps whatever the drivers answer, as Windows does ("Handling
//! IRP_MN_QUERY_POWER for System Power States"): with
//! [`CriticalSleep::Unqueried`] (a failing battery, imminent loss of
//! power) no query is sent at all; with [`CriticalSleep::AfterVeto`]
//! (every sleep since Windows Vista) the query is sent and a veto is
//! recorded and overridden. A driver must survive both: it may not have
//! prepared in a query, and it may have vetoed the sleep it now enters.
//!
//! Sx -> S0: never queried; devnodes enter D0 parents first; within a stack
//! bottom-up; each then releases the requests its queues held.

use driver_platform::SystemPowerState;

use crate::pnp::{DevNodeId, PnpManager, PnpState, Veto};
use crate::request::StopAction;

/// How a critical sleep treats the query (`IRP_MN_QUERY_POWER`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CriticalSleep {
    /// No query: the set-power comes unannounced (a failing battery,
    /// imminent loss of power).
    Unqueried,
    /// The query is sent to every stack; a veto does not stop the sleep
    /// (the set-power follows it).
    AfterVeto,
}

impl PnpManager {
    /// Moves the system to `target` (S3, S4 or S5 from S0; S0 to resume).
    /// Returns the veto if a driver refused the query.
    pub fn set_system_power(&self, target: SystemPowerState) -> Result<(), Veto> {
        let started = self.started_preorder();
        if target == SystemPowerState::S0 {
            self.resume(started);
            return Ok(());
        }
        // Query every stack, children first, before anything moves.
        // Shutdown is not optional: it is not queried and cannot be vetoed.
        if target != SystemPowerState::S5 {
            let vetoes = self.query_power(&started, target, false);
            if let Some(veto) = vetoes.into_iter().next() {
                return Err(veto);
            }
        }
        self.power_down(&started, target);
        Ok(())
    }

    /// A critical transition to the sleep state `target` (S3, S4 or S5):
    /// the system sleeps whatever the drivers answer. Returns the vetoes
    /// the power manager overrode (none with [`CriticalSleep::Unqueried`]).
    /// `target == S0` resumes, as [`PnpManager::set_system_power`] does.
    pub fn set_system_power_critical(
        &self,
        target: SystemPowerState,
        query: CriticalSleep,
    ) -> Vec<Veto> {
        let started = self.started_preorder();
        if target == SystemPowerState::S0 {
            self.resume(started);
            return Vec::new();
        }
        let overridden = match query {
            CriticalSleep::Unqueried => Vec::new(),
            CriticalSleep::AfterVeto => self.query_power(&started, target, true),
        };
        self.power_down(&started, target);
        overridden
    }

    fn started_preorder(&self) -> Vec<DevNodeId> {
        self.preorder()
            .into_iter()
            .filter(|&n| self.state(n) == Some(PnpState::Started))
            .collect()
    }

    fn resume(&self, started: Vec<DevNodeId>) {
        for n in started {
            if let Err(reason) = self.enter_d0(n) {
                self.inner.verifier.report(
                    None,
                    crate::verifier::ViolationKind::Protocol {
                        detail: format!("resume: {reason}"),
                    },
                );
            }
        }
        self.process_bus_relations();
    }

    /// Sends the query to every layer of `started` (children first, each
    /// stack top-down). Stops at the first veto unless `every_stack`
    /// (a critical sleep asks everyone; the answers change nothing).
    fn query_power(
        &self,
        started: &[DevNodeId],
        target: SystemPowerState,
        every_stack: bool,
    ) -> Vec<Veto> {
        let mut vetoes = Vec::new();
        for &n in started.iter().rev() {
            for (service, cb) in self.layers(n).into_iter().rev() {
                let status = cb.query_power(target);
                if status != crate::driver::SUCCESS {
                    vetoes.push(Veto {
                        what: "query-power",
                        instance_path: self.instance_path(n).unwrap_or_default(),
                        service: service.to_string(),
                        status,
                    });
                    if !every_stack {
                        return vetoes;
                    }
                }
            }
        }
        vetoes
    }

    fn power_down(&self, started: &[DevNodeId], target: SystemPowerState) {
        for &n in started.iter().rev() {
            self.leave_d0(n, target.device_state(), StopAction::Suspend);
        }
    }
}
