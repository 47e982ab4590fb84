//! The power manager: system transitions mapped to device power IRPs.
//!
//! S0 -> Sx (sleep, hibernate, shutdown):
//! 1. **Query.** Every started devnode's stack is asked (children first,
//!    each stack top-down). A veto stops the transition before any device
//!    changes state.
//! 2. **Set.** Devnodes leave D0 children first (a child is powered down
//!    while its parent still works, so it can still talk to its hardware
//!    through the parent); within a stack top-down. From then on their
//!    power-managed queues hold new requests.
//!
//! Shutdown (S5) skips the query: a driver cannot refuse it.
//!
//! Sx -> S0: devnodes enter D0 parents first; within a stack bottom-up; each
//! then releases the requests its queues held.

use driver_platform::SystemPowerState;

use crate::pnp::{PnpManager, PnpState, Veto};

impl PnpManager {
    /// Moves the system to `target` (S3, S4 or S5 from S0; S0 to resume).
    /// Returns the veto if a driver refused the query.
    pub fn set_system_power(&self, target: SystemPowerState) -> Result<(), Veto> {
        let started: Vec<_> = self
            .preorder()
            .into_iter()
            .filter(|&n| self.state(n) == Some(PnpState::Started))
            .collect();
        if target == SystemPowerState::S0 {
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
            return Ok(());
        }
        // Query every stack, children first, before anything moves.
        // Shutdown is not optional: it is not queried and cannot be vetoed.
        let queried = if target == SystemPowerState::S5 {
            &[][..]
        } else {
            &started[..]
        };
        for &n in queried.iter().rev() {
            for (service, cb) in self.layers(n).into_iter().rev() {
                let status = cb.query_power(target);
                if status != crate::driver::SUCCESS {
                    return Err(Veto {
                        what: "query-power",
                        instance_path: self.instance_path(n).unwrap_or_default(),
                        service: service.to_string(),
                        status,
                    });
                }
            }
        }
        for &n in started.iter().rev() {
            self.leave_d0(n, target.device_state());
        }
        Ok(())
    }
}
