//! A peer killed mid-run (issue 14): Debian's unmodified `ibv_rc_pingpong`,
//! `ib_write_bw` and `ib_write_lat`, server and client each a process with
//! its own simulated machine over real UDP (as in `pingpong.rs`), run a
//! long test (`-n 1000000`); one of them is killed with SIGKILL while
//! traffic flows, and the survivor must exit non-zero within a bound,
//! printing the tool's own error, its machine shutting down cleanly.
//!
//! When the survivor learns of the death is RC's business (IBA 9.7.6.1.3):
//! only a requester with a request outstanding runs the local ACK timer,
//! and after `retry_cnt` + 1 timeouts without progress its oldest request
//! completes with `RETRY_EXC_ERR`. A QP with only receives posted has no
//! timer at all, on any RC hardware: a ping-pong survivor whose peer died
//! holding the turn (its message acknowledged, the reply not yet sent, or
//! sent in part) waits for ever. So each test kills the peer at a moment
//! the survivor has a request in flight to it: the victim is first frozen
//! (SIGSTOP) and killed only if the survivor's packets pile up in the
//! victim's RoCEv2 socket (`/proc/net/udp` `rx_queue`); otherwise it
//! resumes and is frozen again a little later.
//!
//! Each tool's attributes give the bound: `ibv_rc_pingpong` and perftest
//! set `timeout` 14 (4.096 µs · 2^14 ≈ 67 ms) and `retry_cnt` 7, so the
//! survivor's request fails about 8 × 67 ms ≈ 0.54 s after its last
//! progress (plus the time to resend what is outstanding eight times).
//! The tests check the survivor fails no sooner than 5 timeouts after the
//! freeze (the retries really ran) and within a few seconds of the kill,
//! and print the measured times (`--nocapture`).
//!
//! The tests run one at a time (a lock): the busy-polling tools of
//! parallel tests would compete for the cores and blur the timings.

use std::net::Ipv4Addr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

mod two_processes;
use two_processes::{LIBRARIES, Process, is_clean_exit_report, library_dir, own_address, text};

/// The local ACK timeout both tools set: 4.096 µs · 2^14.
const ACK_TIMEOUT: Duration = Duration::from_nanos(4096 << 14);
/// The transport retries both tools allow (`retry_cnt`).
const RETRY_CNT: u32 = 7;

/// One test at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The bytes waiting in the receive queue of the RoCEv2 socket bound at
/// (`address`, 4791) (`/proc/net/udp`'s `rx_queue`), if there is one.
fn roce_bytes_queued_at(address: Ipv4Addr) -> Option<u32> {
    // The kernel prints the big-endian address as a host integer.
    let local = format!(
        "{:08X}:12B7",
        u32::from_ne_bytes(address.octets()) // 4791 = 0x12B7
    );
    let table = std::fs::read_to_string("/proc/net/udp").unwrap();
    table.lines().skip(1).find_map(|line| {
        let columns: Vec<&str> = line.split_whitespace().collect();
        if columns.get(1) != Some(&local.as_str()) {
            return None;
        }
        let (_, rx_queue) = columns.get(4)?.split_once(':')?;
        u32::from_str_radix(rx_queue, 16).ok()
    })
}

/// A tool's process and the address of its RoCEv2 port.
struct Peer {
    process: Process,
    address: Ipv4Addr,
}

impl Peer {
    fn signal(&self, signal: libc::c_int) {
        // SAFETY: kill(2) with the pid of our own child, not yet reaped
        // (its `Process` holds its `Child`), so the pid names no other
        // process.
        let sent = unsafe { libc::kill(self.process.pid() as libc::pid_t, signal) };
        assert_eq!(sent, 0, "signal {signal} to the {}", self.process.who());
    }
}

/// Starts `tool args` as a server and `tool args 127.0.0.1` as its client
/// (once the server listens on `-p <port>`), their ports at this process's
/// addresses `slots`.
fn start_pair(tool: &str, test: &str, slots: (u8, u8), args: &[&str]) -> (Peer, Peer) {
    let dir = library_dir("sim-libibverbs-killed-peer", test, &LIBRARIES);
    let addresses = (own_address(slots.0), own_address(slots.1));
    let (server, client) = two_processes::start_pair(tool, &dir, addresses, args);
    (
        Peer {
            process: server,
            address: addresses.0,
        },
        Peer {
            process: client,
            address: addresses.1,
        },
    )
}

/// Freezes `victim` (SIGSTOP) at a moment `survivor` has traffic in flight
/// to it: frozen, its machine reads nothing, so what the survivor sends
/// piles up in the victim's RoCEv2 socket. If nothing arrives within a few
/// milliseconds (the turn was the victim's, or traffic has not started),
/// the victim resumes and is frozen again after a varying pause, so the
/// freeze lands at other points of the exchange. Returns when it froze.
fn freeze_while_the_survivor_sends(victim: &mut Peer, survivor: &mut Peer) -> Instant {
    let deadline = Instant::now() + Duration::from_secs(30);
    let pauses = [3, 7, 13, 23, 41].map(Duration::from_millis);
    let mut pause = pauses.iter().cycle();
    loop {
        victim.process.assert_running("before it was killed");
        survivor
            .process
            .assert_running("before its peer was killed");
        victim.signal(libc::SIGSTOP);
        let frozen = Instant::now();
        // Far less than the survivor's eight ACK timeouts: still retrying
        // when the victim dies.
        std::thread::sleep(Duration::from_millis(15));
        if roce_bytes_queued_at(victim.address).is_some_and(|bytes| bytes > 0) {
            return frozen;
        }
        victim.signal(libc::SIGCONT);
        assert!(
            Instant::now() < deadline,
            "no traffic from the {} to the {} within 30 s",
            survivor.process.who(),
            victim.process.who()
        );
        std::thread::sleep(*pause.next().unwrap());
    }
}

/// What the survivor did after its peer was killed.
struct Survivor {
    /// Its exit status code.
    code: Option<i32>,
    /// Its standard output and error, together.
    output: String,
    /// Its standard error's lines.
    stderr: Vec<String>,
    /// From the victim's freeze, and from its kill, to the survivor's exit.
    since_freeze: Duration,
    since_kill: Duration,
}

/// Kills `victim` (SIGKILL) at a moment `survivor` has traffic in flight
/// to it, once the pair has run for `run_in` (past the first exchanges),
/// then waits (bounded) for the survivor to exit.
fn kill_mid_run(mut victim: Peer, mut survivor: Peer, run_in: Duration) -> Survivor {
    std::thread::sleep(run_in);
    let frozen = freeze_while_the_survivor_sends(&mut victim, &mut survivor);
    let killed = Instant::now();
    drop(victim);
    // Bounded: a hang kills the survivor and fails the test.
    let (output, exited) = survivor.process.wait_timed(Duration::from_secs(30));
    let stderr = text(&output.stderr);
    Survivor {
        code: output.status.code(),
        output: format!("{}{stderr}", text(&output.stdout)),
        stderr: stderr.lines().map(str::to_owned).collect(),
        since_freeze: exited - frozen,
        since_kill: exited - killed,
    }
}

impl Survivor {
    /// Asserts it exited with `code`, printed each of `errors`, and its machine
    /// shut down cleanly: the exit report is standard error's last line
    /// (nothing panicked, no thread kept the process alive), with the
    /// device the tool left open.
    fn assert_clean_failure(&self, code: i32, errors: &[&str]) {
        assert_eq!(self.code, Some(code), "{}", self.output);
        for error in errors {
            assert!(
                self.output.contains(error),
                "the tool's own error `{error}`:\n{}",
                self.output
            );
        }
        let report = self.stderr.last().map(String::as_str).unwrap_or_default();
        assert!(
            is_clean_exit_report(report, 1),
            "the survivor's machine did not end cleanly:\n{}",
            self.output
        );
        let before_report = &self.stderr[..self.stderr.len() - 1];
        assert!(
            !before_report
                .iter()
                .any(|line| line.contains("panicked") || line.starts_with("libibverbs: ")),
            "the survivor's library reported a problem:\n{}",
            self.output
        );
    }

    /// Asserts it failed through the transport retries: no sooner than
    /// 5 ACK timeouts after the freeze (8 run from its last progress,
    /// just before the freeze), within `bound` of the kill.
    fn assert_failed_by_retries(&self, bound: Duration) {
        assert!(
            self.since_freeze >= ACK_TIMEOUT * 5,
            "failed {:?} after the freeze, before the retries could run:\n{}",
            self.since_freeze,
            self.output
        );
        assert!(
            self.since_kill <= bound,
            "failed {:?} after the kill, past {bound:?}:\n{}",
            self.since_kill,
            self.output
        );
    }

    fn report(&self, what: &str) {
        println!(
            "{what}: the survivor exited {:?} after the kill ({:?} after the freeze):\n{}",
            self.since_kill,
            self.since_freeze,
            self.stderr.join("\n")
        );
    }
}

/// `ibv_rc_pingpong`'s run-in: each machine boots in about 0.1 s, then
/// the round trips start.
const PINGPONG_RUN_IN: Duration = Duration::from_millis(500);
/// perftest's: it exchanges and checks its parameters and prints its
/// header before the first write (in 0.5 s it had sent one window).
const PERFTEST_RUN_IN: Duration = Duration::from_millis(1500);

/// The bound of a survivor with a small window outstanding: the retries
/// (8 × 67 ms), plus the exit and the machine's shutdown in a debug build
/// on a loaded machine.
fn retries_bound() -> Duration {
    ACK_TIMEOUT * (RETRY_CNT + 1) + Duration::from_secs(3)
}

#[test]
fn rc_pingpong_client_fails_with_retry_exceeded_when_its_server_is_killed() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (server, client) = start_pair(
        "ibv_rc_pingpong",
        "rc-server-killed",
        (1, 2),
        &["-g", "0", "-n", "1000000"],
    );
    let survivor = kill_mid_run(server, client, PINGPONG_RUN_IN);
    survivor.report("ibv_rc_pingpong, server killed, client busy polling");
    survivor.assert_clean_failure(
        1,
        &["Failed status transport retry counter exceeded (12) for wr_id 2"],
    );
    survivor.assert_failed_by_retries(retries_bound());
}

/// The reverse, the survivor waiting in `ibv_get_cq_event` (`-e`): the
/// failed completion wakes it through the completion channel.
#[test]
fn rc_pingpong_server_with_events_fails_with_retry_exceeded_when_its_client_is_killed() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (server, client) = start_pair(
        "ibv_rc_pingpong",
        "rc-client-killed",
        (3, 4),
        &["-g", "0", "-n", "1000000", "-e"],
    );
    let survivor = kill_mid_run(client, server, PINGPONG_RUN_IN);
    survivor.report("ibv_rc_pingpong -e, client killed, server waiting for events");
    survivor.assert_clean_failure(
        1,
        &["Failed status transport retry counter exceeded (12) for wr_id 2"],
    );
    survivor.assert_failed_by_retries(retries_bound());
}

/// perftest's client keeps 128 writes outstanding and each retry sends
/// the window again: 4 KiB writes (`-s 4096`) keep that quick in a debug
/// build (of the default 64 KiB ones, it takes seconds), so the bound is
/// the pingpong's.
#[test]
fn write_bw_client_fails_with_retry_exceeded_when_its_server_is_killed() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (server, client) = start_pair(
        "ib_write_bw",
        "write-bw-server-killed",
        (5, 6),
        &["-n", "1000000", "-s", "4096"],
    );
    let survivor = kill_mid_run(server, client, PERFTEST_RUN_IN);
    survivor.report("ib_write_bw, server killed, client writing");
    // perftest prints the status number: 12 is RETRY_EXC_ERR.
    survivor.assert_clean_failure(
        1,
        &["Completion with error at client", "Failed status 12: "],
    );
    survivor.assert_failed_by_retries(retries_bound());
}

/// perftest's server waits on its TCP connection for the client's final
/// handshake: the client's death closes it.
#[test]
fn write_bw_server_fails_on_its_connection_when_its_client_is_killed() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (server, client) = start_pair(
        "ib_write_bw",
        "write-bw-client-killed",
        (7, 8),
        &["-n", "1000000"],
    );
    let survivor = kill_mid_run(client, server, PERFTEST_RUN_IN);
    survivor.report("ib_write_bw, client killed, server waiting");
    survivor.assert_clean_failure(1, &["Failed to exchange data between server and clients"]);
    assert!(
        survivor.since_kill <= Duration::from_secs(3),
        "{:?}:\n{}",
        survivor.since_kill,
        survivor.output
    );
}

/// perftest's write latency test is a ping-pong of one write each way (a
/// side waits for the other's write by watching its buffer, after its own
/// write completed): killed while the survivor's write is in flight, the
/// peer leaves it a failed completion.
#[test]
fn write_lat_server_fails_with_retry_exceeded_when_its_client_is_killed() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (server, client) = start_pair(
        "ib_write_lat",
        "write-lat-client-killed",
        (9, 10),
        &["-n", "1000000"],
    );
    let survivor = kill_mid_run(client, server, PERFTEST_RUN_IN);
    survivor.report("ib_write_lat, client killed, server writing");
    survivor.assert_clean_failure(1, &["Failed status 12: "]);
    survivor.assert_failed_by_retries(retries_bound());
}

/// perftest's send bandwidth client keeps 128 sends outstanding (its
/// server only receives: with its client killed it would wait for ever,
/// as on any RC hardware). The send tools exit 17 on a failed completion.
#[test]
fn send_bw_client_fails_with_retry_exceeded_when_its_server_is_killed() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (server, client) = start_pair(
        "ib_send_bw",
        "send-bw-server-killed",
        (11, 12),
        &["-n", "1000000", "-s", "4096"],
    );
    let survivor = kill_mid_run(server, client, PERFTEST_RUN_IN);
    survivor.report("ib_send_bw, server killed, client sending");
    survivor.assert_clean_failure(17, &["Failed status 12: "]);
    survivor.assert_failed_by_retries(retries_bound());
}

/// perftest's send latency test is a ping-pong of one send each way.
#[test]
fn send_lat_server_fails_with_retry_exceeded_when_its_client_is_killed() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (server, client) = start_pair(
        "ib_send_lat",
        "send-lat-client-killed",
        (13, 14),
        &["-n", "1000000"],
    );
    let survivor = kill_mid_run(client, server, PERFTEST_RUN_IN);
    survivor.report("ib_send_lat, client killed, server sending");
    survivor.assert_clean_failure(17, &["Failed status 12: "]);
    survivor.assert_failed_by_retries(retries_bound());
}
