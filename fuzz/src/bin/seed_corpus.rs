//! Writes each fuzz target's seed corpus: valid inputs made by the owning
//! crates' encoders (the same seeds the bounded property tests mutate),
//! one file per seed, under `<dir>/<target>/seed-<n>`.
//!
//! Usage: `seed_corpus <corpus dir> [target]` (run by `cargo xtask fuzz`).

#![allow(dead_code, reason = "only the property modules' seeds are used here")]

#[path = "../../../sim-hca/tests/common/mod.rs"]
mod common;

#[path = "../../../ib-types/tests/fuzz_props/proxy.rs"]
mod proxy;

#[path = "../../../hca-prm/tests/fuzz_props/uvp_private.rs"]
mod uvp_private;

#[path = "../../../hca-prm/tests/fuzz_props/device_entries.rs"]
mod device_entries;

#[path = "../../../hca-prm/tests/fuzz_props/wqe.rs"]
mod wqe;

#[path = "../../../sim-hca/tests/fuzz_props/packet.rs"]
mod packet;

#[path = "../../../sim-hca/tests/fuzz_props/udp_datagram.rs"]
mod udp_datagram;

#[path = "../../../sim-hca/tests/fuzz_props/mad.rs"]
mod mad;

#[path = "../../../sim-host/tests/fuzz_props/inf.rs"]
mod inf;

#[path = "../../../ibal-bus/core/tests/fuzz_props/child_list.rs"]
mod child_list;

#[path = "../../../ibal-bus/core/tests/fuzz_props/proxy_open.rs"]
mod proxy_open;
#[path = "../../../port-client/core/tests/fuzz_props/port_message.rs"]
mod port_message;

use std::path::Path;
use std::process::ExitCode;

/// Makes a target's seeds.
type SeedMaker = fn() -> Vec<Vec<u8>>;

/// Every target with its seed maker.
const TARGETS: [(&str, SeedMaker); 11] = [
    ("proxy", proxy::seeds),
    ("uvp_private", uvp_private::seeds),
    ("device_entries", device_entries::seeds),
    ("wqe", wqe::seeds),
    ("packet", packet::seeds),
    ("udp_datagram", udp_datagram::seeds),
    ("mad", mad::seeds),
    ("inf", inf::seeds),
    ("child_list", child_list::seeds),
    ("proxy_open", proxy_open::seeds),
    ("port_message", port_message::seeds),
];

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    let Some(dir) = args.next() else {
        eprintln!("usage: seed_corpus <corpus dir> [target]");
        return ExitCode::FAILURE;
    };
    let only = args.next().map(|t| t.to_string_lossy().into_owned());
    if let Some(only) = &only
        && !TARGETS.iter().any(|(name, _)| name == only)
    {
        eprintln!("unknown target {only}");
        return ExitCode::FAILURE;
    }
    for (target, seeds) in TARGETS {
        if only.as_deref().is_some_and(|only| only != target) {
            continue;
        }
        let seeds = seeds();
        let target_dir = Path::new(&dir).join(target);
        if let Err(e) = std::fs::create_dir_all(&target_dir) {
            eprintln!("cannot create {}: {e}", target_dir.display());
            return ExitCode::FAILURE;
        }
        for (n, seed) in seeds.iter().enumerate() {
            let path = target_dir.join(format!("seed-{n}"));
            if let Err(e) = std::fs::write(&path, seed) {
                eprintln!("cannot write {}: {e}", path.display());
                return ExitCode::FAILURE;
            }
        }
        println!(
            "{target}: {} seeds in {}",
            seeds.len(),
            target_dir.display()
        );
    }
    ExitCode::SUCCESS
}
