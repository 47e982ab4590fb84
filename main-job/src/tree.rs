//! The device tree as the main job prints it, and the order of the
//! drivers' D0 callbacks it records and checks.

use std::fmt::Write as _;
use std::sync::{Arc, Mutex, PoisonError};

use sim_host::host::Host;
use sim_host::pnp::{DevNodeId, PowerStep};

/// The devnode tree under `node`, one line per devnode: its instance
/// path, its stack bottom-up (service and role) and its PnP state.
pub fn render(host: &Host, node: DevNodeId) -> String {
    let mut out = String::new();
    render_into(host, node, 0, &mut out);
    out
}

fn render_into(host: &Host, node: DevNodeId, depth: usize, out: &mut String) {
    let pnp = host.pnp();
    let stack: Vec<String> = pnp
        .stack_services(node)
        .into_iter()
        .map(|(service, role)| format!("{service} ({role:?})"))
        .collect();
    let state = pnp
        .state(node)
        .map_or_else(|| "gone".to_owned(), |s| format!("{s:?}"));
    let _ = writeln!(
        out,
        "{:indent$}{}  [{}]  {state}",
        "",
        pnp.instance_path(node).unwrap_or_default(),
        stack.join(" < "),
        indent = 2 + depth * 2
    );
    for child in pnp.children(node) {
        render_into(host, child, depth + 1, out);
    }
}

/// Every layer's D0 entry and exit, in the order the drivers saw them.
#[derive(Debug, Clone, Default)]
pub struct PowerTrace {
    steps: Arc<Mutex<Vec<PowerStep>>>,
}

impl PowerTrace {
    /// Records `host`'s power steps from now on.
    pub fn attach(host: &Host) -> Self {
        let trace = Self::default();
        let steps = Arc::clone(&trace.steps);
        host.pnp().on_power_step(move |step| {
            steps
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(step.clone());
        });
        trace
    }

    /// The steps recorded since the last take.
    pub fn take(&self) -> Vec<PowerStep> {
        std::mem::take(&mut *self.steps.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// The short name of a devnode: its instance path's last two parts.
pub fn short_name(host: &Host, node: DevNodeId) -> String {
    let path = host.pnp().instance_path(node).unwrap_or_default();
    let parts: Vec<&str> = path.rsplitn(3, '\\').collect();
    match parts.as_slice() {
        [last, before, _] => format!("{before}\\{last}"),
        _ => path,
    }
}

/// The steps as lines: consecutive steps of one devnode on one line, its
/// layers in the order they ran.
pub fn render_steps(host: &Host, steps: &[PowerStep]) -> Vec<String> {
    let mut lines: Vec<(DevNodeId, bool, Vec<String>)> = Vec::new();
    for step in steps {
        match lines.last_mut() {
            Some((node, entry, services)) if *node == step.node && *entry == step.entry => {
                services.push(step.service.clone());
            }
            _ => lines.push((step.node, step.entry, vec![step.service.clone()])),
        }
    }
    lines
        .into_iter()
        .map(|(node, entry, services)| {
            format!(
                "{} {} ({})",
                if entry { "D0 entry" } else { "D0 exit " },
                short_name(host, node),
                services.join(", ")
            )
        })
        .collect()
}

/// Checks the rule of a sleep (`down`) or a wake: every child of each of
/// `parents` left D0 before any layer of its parent did, and entered it
/// after every layer of its parent had. Each parent and each child must
/// have taken part. Returns what broke the rule.
pub fn check_order(
    host: &Host,
    steps: &[PowerStep],
    parents: &[(DevNodeId, Vec<DevNodeId>)],
    down: bool,
) -> Result<(), String> {
    let want_entry = !down;
    let positions = |node: DevNodeId| -> Vec<usize> {
        steps
            .iter()
            .enumerate()
            .filter(|(_, s)| s.node == node && s.entry == want_entry)
            .map(|(i, _)| i)
            .collect()
    };
    let what = if down { "D0 exit" } else { "D0 entry" };
    for (parent, children) in parents {
        let of_parent = positions(*parent);
        let (Some(&parent_first), Some(&parent_last)) = (of_parent.first(), of_parent.last())
        else {
            return Err(format!("{}: no {what}", short_name(host, *parent)));
        };
        if children.is_empty() {
            return Err(format!("{}: no children", short_name(host, *parent)));
        }
        for child in children {
            let of_child = positions(*child);
            let (Some(&child_first), Some(&child_last)) = (of_child.first(), of_child.last())
            else {
                return Err(format!("{}: no {what}", short_name(host, *child)));
            };
            let ordered = if down {
                child_last < parent_first
            } else {
                parent_last < child_first
            };
            if !ordered {
                return Err(format!(
                    "{what}: {} {} its parent {}",
                    short_name(host, *child),
                    if down {
                        "did not leave D0 before"
                    } else {
                        "did not enter D0 after"
                    },
                    short_name(host, *parent)
                ));
            }
        }
    }
    Ok(())
}
