//! `cargo xtask inf-lint`: checks `inf/*.inf` against the InfVerif rules
//! that can be checked without Windows (`sim_host::inf_lint`, rules and
//! references in `docs/inf-lint.md`). Prints one line per finding,
//! `inf/<file>:<line>: <rule>: <message>`, then the documentation each
//! broken rule follows, and fails if there is any finding.

use std::collections::BTreeSet;
use std::process::ExitCode;

use sim_host::inf::workspace_inf_dir;
use sim_host::inf_lint::{self, Rule};

/// Lints the workspace's INFs; success when every rule passes.
pub(crate) fn run() -> ExitCode {
    let dir = workspace_inf_dir();
    let findings = match inf_lint::lint_dir(&dir) {
        Ok(findings) => findings,
        Err(e) => {
            eprintln!("inf-lint: {e}");
            return ExitCode::FAILURE;
        }
    };
    let files = std::fs::read_dir(&dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter(|e| {
                    e.path()
                        .extension()
                        .is_some_and(|x| x.eq_ignore_ascii_case("inf"))
                })
                .count()
        })
        .unwrap_or(0);
    if findings.is_empty() {
        println!(
            "inf-lint: {files} INF(s) in inf/ pass all {} rules",
            Rule::ALL.len()
        );
        return ExitCode::SUCCESS;
    }
    for finding in &findings {
        eprintln!("inf/{finding}");
    }
    let broken: BTreeSet<Rule> = findings.iter().map(|f| f.rule).collect();
    eprintln!("\nrules broken (learn.microsoft.com/windows-hardware/drivers/...):");
    for rule in broken {
        eprintln!("  {}: {}", rule.name(), rule.reference());
    }
    eprintln!(
        "\ninf-lint: {} finding(s) in {files} INF(s)",
        findings.len()
    );
    ExitCode::FAILURE
}
