//! `ibal_user::Context::close` on the embedded machine (a threaded host,
//! where a wait blocks as on Windows): a thread blocked in
//! `Context::async_event` (`GetAsyncEvent`) while another closes the
//! context ends with `Canceled`, as the kernel ends a context's waits at
//! `CloseCa`; a second close does nothing, later calls fail, and dropping
//! the context closes nothing more: the machine ends with no CA left open
//! and an empty verifier report. This is how our libibverbs ends its
//! per-context event thread (`verbs/compat/src/async_events.rs`).
#![cfg(not(windows))]

use std::sync::Arc;
use std::time::Duration;

use ib_types::status::IbStatus;
use ibal_user::{CaSelector, Context, PluginSource};
use sim_shells::embedded::{EmbeddedMachine, Fabric};

#[test]
fn closing_a_context_ends_the_async_event_wait_another_thread_blocks_in() {
    let machine = EmbeddedMachine::boot(Fabric::DEFAULT, 7).expect("the machine boots");
    let io = machine.io();
    let ca = Arc::new(Context::open(&io, CaSelector::Index(0), &PluginSource::Linked).unwrap());
    let waiting = {
        let ca = Arc::clone(&ca);
        std::thread::spawn(move || ca.async_event())
    };
    std::thread::sleep(Duration::from_millis(200));
    assert!(!waiting.is_finished(), "no event: the wait blocks");
    ca.close().unwrap();
    let ended = waiting.join().unwrap();
    assert_eq!(ended.unwrap_err().status(), IbStatus::Canceled);
    assert_eq!(machine.user_contexts(), 0, "the CA is closed");
    ca.close().unwrap();
    assert!(ca.query().is_err(), "a closed context answers nothing");
    drop(ca);
    let report = machine.shut_down(Duration::from_secs(10));
    assert_eq!(report.problems, Vec::<String>::new());
    assert_eq!(report.left_open, 0);
}
