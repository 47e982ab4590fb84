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
//!
//! **Order between devnodes the tree does not order.** Windows guarantees
//! only the tree's order: a devnode leaves D0 after every devnode below it
//! and enters D0 after its parent ("Handling IRP_MN_SET_POWER for System
//! Power States"); devnodes in unrelated branches (an HCA under the PCI
//! bus and a root-enumerated driver that uses it) get their IRPs in no
//! promised order, and since Windows Vista concurrently. [`PowerOrder`]
//! says which of the valid orders the host takes: the enumeration order
//! (the `PnpManager` default, reproducible: the devnode enumerated last
//! leaves D0 first), the earliest root's subtree first, or a seeded pick
//! among all of them ([`PowerOrder::Seeded`], what a `Host` uses, from its
//! seed), under which a driver that relies on an accidental order between
//! unrelated devnodes is caught.

use std::collections::BTreeMap;

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

/// Which of the valid orders a system transition sends its device power
/// IRPs in. Every order keeps the tree's rule (children leave D0 before
/// their parent, parents enter it before their children); they differ in
/// the order of devnodes the tree does not relate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PowerOrder {
    /// Enumeration order: sleep in reverse pre-order (the devnode
    /// enumerated last, e.g. a root-enumerated device added after boot,
    /// leaves D0 first), resume in pre-order.
    #[default]
    Enumeration,
    /// The first-enumerated root's subtree first: sleep takes the root
    /// devnodes' subtrees in enumeration order (each children first), so
    /// the PCI bus and its HCAs, enumerated at boot, leave D0 before a
    /// root-enumerated device added later; resume takes them in the
    /// reverse order (each parents first).
    EarliestRootFirst,
    /// A pick among every valid order, drawn afresh for each transition
    /// from this seed and the number of transitions so far: reproducible
    /// for a seed, different between seeds and between sleeps.
    Seeded(u64),
}

/// The power manager's order and how many transitions it has ordered.
#[derive(Debug, Default)]
pub(crate) struct PowerOrderState {
    order: PowerOrder,
    transitions: u64,
}

/// SplitMix64: a small, well-mixed generator for the seeded order (the
/// host's other seeded choices keep their own streams).
fn split_mix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl PnpManager {
    /// Chooses the order of later system transitions ([`PowerOrder`]).
    pub fn set_power_order(&self, order: PowerOrder) {
        let mut state = self.power_order_state();
        state.order = order;
        state.transitions = 0;
    }

    /// The order system transitions follow.
    pub fn power_order(&self) -> PowerOrder {
        self.power_order_state().order
    }

    fn power_order_state(&self) -> std::sync::MutexGuard<'_, PowerOrderState> {
        self.inner
            .power_order
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// `started` (in pre-order) ordered for a transition: children before
    /// parents when `down`, parents before children otherwise; devnodes
    /// the tree does not relate as [`PowerOrder`] says.
    fn transition_order(&self, started: &[DevNodeId], down: bool) -> Vec<DevNodeId> {
        let mut rng = {
            let mut state = self.power_order_state();
            match state.order {
                PowerOrder::Enumeration => None,
                PowerOrder::EarliestRootFirst => {
                    drop(state);
                    return self.earliest_root_first(started, down);
                }
                PowerOrder::Seeded(seed) => {
                    state.transitions += 1;
                    Some(seed ^ state.transitions.wrapping_mul(0xA24B_AED4_963E_E407))
                }
            }
        };
        let Some(rng) = rng.as_mut() else {
            return if down {
                started.iter().rev().copied().collect()
            } else {
                started.to_vec()
            };
        };
        // A random linear extension of the tree's order among the started
        // devnodes: repeatedly pick one whose prerequisites are done (its
        // started children going down; its started parent coming up).
        let index: BTreeMap<DevNodeId, usize> =
            started.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        let mut waiting_on = vec![0usize; started.len()];
        let mut unblocks: Vec<Vec<usize>> = vec![Vec::new(); started.len()];
        for (parent, &n) in started.iter().enumerate() {
            for child in self.children(n) {
                if let Some(&child) = index.get(&child) {
                    let (first, then) = if down {
                        (child, parent)
                    } else {
                        (parent, child)
                    };
                    waiting_on[then] += 1;
                    unblocks[first].push(then);
                }
            }
        }
        let mut ready: Vec<usize> = (0..started.len()).filter(|&i| waiting_on[i] == 0).collect();
        let mut order = Vec::with_capacity(started.len());
        while !ready.is_empty() {
            let pick = (split_mix(rng) % ready.len() as u64) as usize;
            let next = ready.swap_remove(pick);
            order.push(started[next]);
            for &then in &unblocks[next] {
                waiting_on[then] -= 1;
                if waiting_on[then] == 0 {
                    ready.push(then);
                }
            }
        }
        order
    }

    /// [`PowerOrder::EarliestRootFirst`]: `started` (pre-order) cut into
    /// its roots' subtrees.
    fn earliest_root_first(&self, started: &[DevNodeId], down: bool) -> Vec<DevNodeId> {
        let children: std::collections::BTreeSet<DevNodeId> =
            started.iter().flat_map(|&n| self.children(n)).collect();
        let mut subtrees: Vec<Vec<DevNodeId>> = Vec::new();
        for &n in started {
            match subtrees.last_mut() {
                Some(subtree) if children.contains(&n) => subtree.push(n),
                _ => subtrees.push(vec![n]),
            }
        }
        if down {
            subtrees
                .into_iter()
                .flat_map(|subtree| subtree.into_iter().rev())
                .collect()
        } else {
            subtrees.into_iter().rev().flatten().collect()
        }
    }

    /// Moves the system to `target` (S3, S4 or S5 from S0; S0 to resume).
    /// Returns the veto if a driver refused the query.
    pub fn set_system_power(&self, target: SystemPowerState) -> Result<(), Veto> {
        let started = self.started_preorder();
        if target == SystemPowerState::S0 {
            self.resume(started);
            return Ok(());
        }
        let started = self.transition_order(&started, true);
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
        let started = self.transition_order(&started, true);
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
        for n in self.transition_order(&started, false) {
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

    /// Sends the query to every layer of `down_order` (a transition's
    /// order: children first), each stack top-down. Stops at the first veto unless `every_stack`
    /// (a critical sleep asks everyone; the answers change nothing).
    fn query_power(
        &self,
        down_order: &[DevNodeId],
        target: SystemPowerState,
        every_stack: bool,
    ) -> Vec<Veto> {
        let mut vetoes = Vec::new();
        for &n in down_order {
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

    fn power_down(&self, down_order: &[DevNodeId], target: SystemPowerState) {
        for &n in down_order {
            self.leave_d0(n, target.device_state(), StopAction::Suspend);
        }
    }
}
