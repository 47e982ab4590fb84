//! Debian's unmodified perftest (4.5-0.17) on our five libraries across
//! two processes (issue 14): for each of `ib_write_bw`, `ib_read_bw`,
//! `ib_send_bw`, `ib_atomic_bw`, `ib_send_lat`, `ib_write_lat` (and
//! `ib_read_lat`, `ib_atomic_lat`) the server (`<tool> -p <port>`) and the
//! client (`<tool> -p <port> 127.0.0.1`), each its own simulated machine,
//! their RoCEv2 ports real UDP endpoints at two of this test process's own
//! loopback addresses. Both exit 0, both machines end cleanly, and the
//! tool's own result table (the row under `#bytes #iterations ...`) says
//! the size and iteration count asked for and a bandwidth, message rate or
//! latency above zero; each side names the other's QP. `-R` (rdma_cm, not
//! supported) is the tool's own clean error.
//!
//! In the default (debug) suite the runs are short (`-n 50`) with the
//! tools' default sizes and a few common flags; 12-26 s on the shared
//! 2-core machine. perftest's own defaults (iterations and sizes) run
//! against an optimised build, `cargo test --release -p sim-libibverbs
//! --test perftest -- --ignored`, which `cargo xtask test` runs (about
//! 16-21 s there; docs/libibverbs.md, "Tests").

use std::process::Output;
use std::time::Duration;

mod two_processes;
use two_processes::{
    LIBRARIES, ended_cleanly, free_tcp_port, library_dir, on_our_libraries, own_address,
    start_pair, text,
};

/// What perftest prints on standard error for a device it does not
/// recognise when the test would send inline by default (perftest then
/// sends nothing inline, docs/libibverbs.md "How perftest chooses its
/// paths").
const INLINE_NOTE: &str = "Device not recognized to implement inline feature. Disabling it\n";

/// What a run's result row must say.
#[derive(Clone, Copy)]
struct Expected {
    /// The message size (`-s`, or the tool's default).
    bytes: u64,
    /// The iterations the table counts (`-n` times the QPs for the
    /// bandwidth tools).
    iterations: u64,
    /// Whether the server prints the table too (not the passive side of
    /// `ib_read_lat` and `ib_atomic_lat`).
    server_reports: bool,
    /// The CAs the (server, client) leave open at exit, closed cleanly by
    /// the process's exit: perftest's own leaks, 0 but for the
    /// `ib_send_bw` client without `-e` (it never destroys its receive CQ,
    /// which keeps the device open past `ibv_close_device`) and the
    /// `ib_atomic_lat` server (it returns before destroying anything).
    left_open: (usize, usize),
}

/// perftest's result table in `stdout`: its header (the line starting
/// `#bytes`) and the numbers of the row under it.
fn result_row(stdout: &str) -> Option<(String, Vec<f64>)> {
    let mut lines = stdout.lines();
    let header = lines.find(|line| line.trim_start().starts_with("#bytes"))?;
    let row = lines
        .next()?
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<Vec<f64>, _>>()
        .ok()?;
    Some((header.trim().to_string(), row))
}

/// Checks one side's table: the size, the iterations, and the measures
/// the header names: a message rate above zero and the average bandwidth
/// the tool printed agreeing with it (a small message's bandwidth may
/// print as 0.00 on a slow run); a minimum latency above zero, the average
/// and maximum not below it.
fn assert_result(stdout: &str, who: &str, expected: Expected) {
    let (header, row) =
        result_row(stdout).unwrap_or_else(|| panic!("{who}: no result table:\n{stdout}"));
    assert!(row.len() >= 5, "{who}: a short result row:\n{stdout}");
    assert_eq!(
        (row[0], row[1]),
        (expected.bytes as f64, expected.iterations as f64),
        "{who}: the size and iterations asked for:\n{stdout}"
    );
    if header.contains("BW average") {
        let (average, rate_mpps) = (row[3], row[4]);
        assert!(rate_mpps > 0.0, "{who}: a message rate:\n{stdout}");
        // MB/sec is MiB/s; Gb/sec (`--report_gbits`) is 10^9 bit/s.
        let implied = if header.contains("Gb/sec") {
            row[0] * rate_mpps * 8.0 / 1e3
        } else {
            row[0] * rate_mpps * 1e6 / f64::from(1 << 20)
        };
        // Rounding: the rate has 6 decimals, the bandwidth 2.
        let slack = 0.01 + row[0] * 5e-7 * 8.0 + implied * 0.01;
        assert!(
            (average - implied).abs() <= slack,
            "{who}: the average bandwidth {average} disagrees with the message rate ({implied}):\n{stdout}"
        );
    } else if header.contains("t_avg") {
        let (minimum, maximum, average) = (row[2], row[3], row[5]);
        assert!(
            minimum > 0.0 && average >= minimum && maximum >= average,
            "{who}: a minimum latency, the average and maximum not below it:\n{stdout}"
        );
    } else {
        panic!("{who}: a table of neither kind:\n{stdout}");
    }
}

/// The QPN of a `local address:` or `remote address:` line.
fn qpn(stdout: &str, which: &str) -> String {
    let line = stdout
        .lines()
        .find(|line| line.trim_start().starts_with(which))
        .unwrap_or_else(|| panic!("no `{which}` line:\n{stdout}"));
    let (_, rest) = line.split_once("QPN").unwrap();
    rest.split_whitespace().next().unwrap().to_string()
}

/// Runs `tool`'s server and client with `args` (both sides), each port at
/// one of this process's addresses (`slots`); checks both exit 0 and end
/// cleanly, the result tables, and that each reached the other's QP.
fn run_pair(
    tool: &str,
    test: &str,
    slots: (u8, u8),
    args: &[&str],
    expected: Expected,
) -> (Output, Output) {
    let dir = library_dir("sim-libibverbs-perftest", test, &LIBRARIES);
    let addresses = (own_address(slots.0), own_address(slots.1));
    let (server, client) = start_pair(tool, &dir, addresses, args);
    // Neither may hang: the client is given 120 s (a debug build on a
    // loaded machine), the server 10 s more, then each is killed.
    let client = client.wait(Duration::from_secs(120));
    let server = server.wait(Duration::from_secs(10));
    for (output, who) in [(&server, "server"), (&client, "client")] {
        let stdout = text(&output.stdout);
        let stderr = text(&output.stderr);
        assert_eq!(
            output.status.code(),
            Some(0),
            "{tool} {who}:\n{stdout}\n{stderr}"
        );
        // perftest's own note for a device it does not know (ours: the
        // tools that would send inline by default), then the exit report.
        let report = stderr.strip_prefix(INLINE_NOTE).unwrap_or(&stderr);
        let left_open = if who == "server" {
            expected.left_open.0
        } else {
            expected.left_open.1
        };
        assert!(
            ended_cleanly(report, left_open),
            "{tool} {who}: the embedded machine did not end cleanly ({left_open} CAs left open expected):\n{stderr}"
        );
        if who == "client" || expected.server_reports {
            assert_result(&stdout, &format!("{tool} {who}"), expected);
        }
        println!("{tool} {who} ({}):\n{stdout}", args.join(" "));
    }
    let (server_out, client_out) = (text(&server.stdout), text(&client.stdout));
    assert_eq!(
        qpn(&server_out, "local address:"),
        qpn(&client_out, "remote address:"),
        "the client reached the server's QP"
    );
    assert_eq!(
        qpn(&client_out, "local address:"),
        qpn(&server_out, "remote address:"),
        "the server reached the client's QP"
    );
    (server, client)
}

/// The bandwidth tools' default size.
const BW_SIZE: u64 = 65536;
/// The latency tools' default size (`ib_send_lat`, `ib_write_lat`,
/// `ib_read_lat`).
const LAT_SIZE: u64 = 2;
/// The atomic tools' size (one 8-byte operand).
const ATOMIC_SIZE: u64 = 8;

fn both_report(bytes: u64, iterations: u64) -> Expected {
    Expected {
        bytes,
        iterations,
        server_reports: true,
        left_open: (0, 0),
    }
}

/// `ib_send_bw` without `-e`: its client leaves its receive CQ, and with it
/// the device, open.
fn send_bw(bytes: u64, iterations: u64) -> Expected {
    Expected {
        left_open: (0, 1),
        ..both_report(bytes, iterations)
    }
}

#[test]
fn ib_write_bw_server_and_client_run() {
    run_pair(
        "ib_write_bw",
        "write_bw",
        (1, 2),
        &["-n", "50"],
        both_report(BW_SIZE, 50),
    );
}

/// A device named, its port, a size, two QPs (the table counts both QPs'
/// iterations), Gb/s, no CPU-frequency warning.
#[test]
fn ib_write_bw_with_common_flags_runs() {
    run_pair(
        "ib_write_bw",
        "write_bw_flags",
        (3, 4),
        &[
            "-d",
            "simhca0",
            "-i",
            "1",
            "-s",
            "4096",
            "-n",
            "50",
            "-q",
            "2",
            "--report_gbits",
            "-F",
        ],
        both_report(4096, 100),
    );
}

#[test]
fn ib_read_bw_server_and_client_run() {
    run_pair(
        "ib_read_bw",
        "read_bw",
        (5, 6),
        &["-n", "50"],
        both_report(BW_SIZE, 50),
    );
}

#[test]
fn ib_send_bw_server_and_client_run() {
    run_pair(
        "ib_send_bw",
        "send_bw",
        (7, 8),
        &["-n", "50"],
        send_bw(BW_SIZE, 50),
    );
}

/// Completion events (`-e`) and a smaller size.
#[test]
fn ib_send_bw_with_completion_events_runs() {
    run_pair(
        "ib_send_bw",
        "send_bw_events",
        (9, 10),
        &["-e", "-s", "4096", "-n", "50"],
        both_report(4096, 50),
    );
}

/// Receives from a shared receive queue (`--use-srq`).
#[test]
fn ib_send_bw_with_a_shared_receive_queue_runs() {
    run_pair(
        "ib_send_bw",
        "send_bw_srq",
        (41, 42),
        &["--use-srq", "-s", "4096", "-n", "50"],
        send_bw(4096, 50),
    );
}

/// UD: the size is the port's MTU (4096) at most.
#[test]
fn ib_send_bw_over_ud_runs() {
    run_pair(
        "ib_send_bw",
        "send_bw_ud",
        (11, 12),
        &["-c", "UD", "-s", "1024", "-n", "50"],
        send_bw(1024, 50),
    );
}

#[test]
fn ib_atomic_bw_server_and_client_run() {
    run_pair(
        "ib_atomic_bw",
        "atomic_bw",
        (13, 14),
        &["-n", "50"],
        both_report(ATOMIC_SIZE, 50),
    );
}

#[test]
fn ib_atomic_bw_compare_and_swap_runs() {
    run_pair(
        "ib_atomic_bw",
        "atomic_bw_cas",
        (15, 16),
        &["-A", "CMP_AND_SWAP", "-n", "50"],
        both_report(ATOMIC_SIZE, 50),
    );
}

#[test]
fn ib_send_lat_server_and_client_run() {
    run_pair(
        "ib_send_lat",
        "send_lat",
        (17, 18),
        &["-n", "50"],
        both_report(LAT_SIZE, 50),
    );
}

#[test]
fn ib_send_lat_with_a_size_runs() {
    run_pair(
        "ib_send_lat",
        "send_lat_size",
        (19, 20),
        &["-s", "1024", "-n", "50", "-F"],
        both_report(1024, 50),
    );
}

#[test]
fn ib_write_lat_server_and_client_run() {
    run_pair(
        "ib_write_lat",
        "write_lat",
        (21, 22),
        &["-n", "50"],
        both_report(LAT_SIZE, 50),
    );
}

#[test]
fn ib_write_lat_with_a_size_runs() {
    run_pair(
        "ib_write_lat",
        "write_lat_size",
        (23, 24),
        &["-s", "4096", "-n", "50", "-d", "simhca0", "-i", "1"],
        both_report(4096, 50),
    );
}

/// The passive server of `ib_read_lat` prints no table.
#[test]
fn ib_read_lat_server_and_client_run() {
    run_pair(
        "ib_read_lat",
        "read_lat",
        (25, 26),
        &["-n", "50"],
        Expected {
            server_reports: false,
            ..both_report(LAT_SIZE, 50)
        },
    );
}

/// The passive server of `ib_atomic_lat` prints no table.
#[test]
fn ib_atomic_lat_server_and_client_run() {
    run_pair(
        "ib_atomic_lat",
        "atomic_lat",
        (27, 28),
        &["-n", "50"],
        Expected {
            server_reports: false,
            left_open: (1, 0),
            ..both_report(ATOMIC_SIZE, 50)
        },
    );
}

/// `-R` (connect with rdma_cm) is not supported: our librdmacm's
/// `rdma_create_event_channel` answers `ENOSYS`, and the tool stops with
/// its own error, exit 1; its device (opened before) is closed by the
/// process's exit, cleanly.
#[test]
fn rdma_cm_is_the_tools_own_clean_error() {
    let dir = library_dir("sim-libibverbs-perftest", "rdma_cm", &LIBRARIES);
    let port = free_tcp_port().to_string();
    for (who, args) in [
        ("server", vec!["-R", "-p", &port]),
        ("client", vec!["-R", "-p", &port, "127.0.0.1"]),
    ] {
        let output = on_our_libraries("ib_write_bw", &dir, own_address(29), &args)
            .output()
            .unwrap();
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{who}:\n{stderr}");
        let report = stderr
            .strip_prefix(
                " rdma_create_event_channel failed\n Unable to create the resources needed by comm struct\n Unable to create RDMA_CM resources\n",
            )
            .unwrap_or_else(|| panic!("{who}: perftest's own error expected:\n{stderr}"));
        assert!(
            ended_cleanly(report, 1),
            "{who}: the machine did not end cleanly:\n{stderr}"
        );
    }
}

/// perftest's defaults: its own iteration counts (5000 for `ib_write_bw`,
/// 1000 for the others) and sizes, each of the six tools, one after the
/// other (a debug build would take minutes: run it optimised, as `cargo
/// xtask test` does).
#[test]
#[ignore = "perftest's defaults: run optimised (cargo xtask test)"]
fn perftest_defaults_run_optimised() {
    let runs: [(&str, &[&str], Expected); 6] = [
        ("ib_write_bw", &[], both_report(BW_SIZE, 5000)),
        ("ib_read_bw", &[], both_report(BW_SIZE, 1000)),
        ("ib_send_bw", &[], send_bw(BW_SIZE, 1000)),
        ("ib_atomic_bw", &[], both_report(ATOMIC_SIZE, 1000)),
        ("ib_send_lat", &[], both_report(LAT_SIZE, 1000)),
        ("ib_write_lat", &[], both_report(LAT_SIZE, 1000)),
    ];
    for (slot, (tool, args, expected)) in (31..).step_by(2).zip(runs) {
        let started = std::time::Instant::now();
        run_pair(tool, "defaults", (slot, slot + 1), args, expected);
        println!("{tool} defaults: {:?}", started.elapsed());
    }
}
