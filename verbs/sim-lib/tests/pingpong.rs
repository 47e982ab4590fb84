//! Debian's unmodified `ibv_rc_pingpong`, `ibv_uc_pingpong`,
//! `ibv_ud_pingpong` and `ibv_srq_pingpong` on our `libibverbs.so.1`
//! across two processes (issue 14): the server (`ibv_rc_pingpong -g 0`) and the client
//! (`ibv_rc_pingpong -g 0 127.0.0.1`), each its own simulated machine,
//! their RoCEv2 ports real UDP endpoints at two of this test process's own
//! loopback addresses, run their iterations (RC its default 1000, also
//! with completion events, `-e`; UC and UD 200, `-n 200`; SRQ its default
//! 1000 over its 16 QPs receiving from one SRQ, busy polling and with
//! `-e`, validating every received buffer, `-c`), both exit 0 and print
//! the tool's own throughput lines, each names the other's QPs and GID,
//! and both machines end cleanly.

use std::process::Output;
use std::time::Duration;

mod two_processes;
use two_processes::{ended_cleanly, library_dir, own_address, start_pair, text};

/// The QPN and GID of a `local address:` or `remote address:` line.
fn address_line(stdout: &str, which: &str) -> (String, String) {
    let line = stdout
        .lines()
        .find(|line| line.trim_start().starts_with(which))
        .unwrap_or_else(|| panic!("no `{which}` line:\n{stdout}"));
    let field = |name: &str| {
        let (_, rest) = line.split_once(name).unwrap();
        rest.trim().split([',', ' ']).next().unwrap().to_string()
    };
    (field("QPN"), field("GID"))
}

/// The QPN and GID of every `local address:` or `remote address:` line,
/// in order (`ibv_srq_pingpong` prints one per QP).
fn address_lines(stdout: &str, which: &str) -> Vec<(String, String)> {
    stdout
        .lines()
        .filter(|line| line.trim_start().starts_with(which))
        .map(|line| address_line(line, which))
        .collect()
}

/// Runs `tool`'s server and client with `extra` options; returns their
/// outputs after checking both exit 0 with the tool's own lines (`bytes`
/// moved in `iterations`).
fn run_pair(
    tool: &str,
    (iterations, bytes): (u32, u64),
    test: &str,
    slots: (u8, u8),
    extra: &[&str],
) -> (Output, Output) {
    let dir = library_dir(
        "sim-libibverbs-pingpong",
        test,
        &[("libibverbs.so", "libibverbs.so.1")],
    );
    let (server_at, client_at) = (own_address(slots.0), own_address(slots.1));
    let mut args = vec!["-g", "0"];
    args.extend_from_slice(extra);
    let (server, client) = start_pair(tool, &dir, (server_at, client_at), &args);
    // Neither may hang: the client is given 60 s (a debug build on a
    // loaded machine), the server 10 s more, then each is killed.
    let client = client.wait(Duration::from_secs(60));
    let server = server.wait(Duration::from_secs(10));
    for (output, who, at, peer) in [
        (&server, "server", server_at, client_at),
        (&client, "client", client_at, server_at),
    ] {
        let stdout = text(&output.stdout);
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(0), "{who}:\n{stdout}\n{stderr}");
        assert!(
            stdout.contains(&format!("{bytes} bytes in "))
                && stdout.contains(&format!("{iterations} iters in ")),
            "{who}: the tool's throughput lines ({bytes} bytes in {iterations} iterations):\n{stdout}"
        );
        assert_eq!(
            address_line(&stdout, "local address:").1,
            format!("::ffff:{at}")
        );
        assert_eq!(
            address_line(&stdout, "remote address:").1,
            format!("::ffff:{peer}")
        );
        assert!(
            ended_cleanly(&stderr, 0),
            "{who}: the embedded machine did not end cleanly:\n{stderr}"
        );
        println!("{tool} {who} ({}):\n{stdout}", extra.join(" "));
    }
    let (server_out, client_out) = (text(&server.stdout), text(&client.stdout));
    assert_eq!(
        address_line(&server_out, "local address:"),
        address_line(&client_out, "remote address:"),
        "the client reached the server's QP"
    );
    assert_eq!(
        address_line(&client_out, "local address:"),
        address_line(&server_out, "remote address:"),
        "the server reached the client's QP"
    );
    (server, client)
}

/// The default: 1000 round trips of 4096 bytes each way.
const RC_DEFAULT: (u32, u64) = (1000, 2 * 1000 * 4096);
/// `-n 200`: 200 round trips of 4096 bytes (UC's default size), fewer than
/// the default to keep the suite quick (RC runs the default).
const UC_200: (u32, u64) = (200, 2 * 200 * 4096);
/// `-n 200`: 200 round trips of 1024 bytes (UD's default size is the
/// port's active MTU, 1024 here).
const UD_200: (u32, u64) = (200, 2 * 200 * 1024);

#[test]
fn rc_pingpong_server_and_client_run_their_1000_iterations() {
    run_pair("ibv_rc_pingpong", RC_DEFAULT, "rc", (1, 2), &[]);
}

#[test]
fn rc_pingpong_with_completion_events_runs_its_1000_iterations() {
    run_pair("ibv_rc_pingpong", RC_DEFAULT, "rc-events", (3, 4), &["-e"]);
}

#[test]
fn uc_pingpong_server_and_client_run_200_iterations() {
    run_pair("ibv_uc_pingpong", UC_200, "uc", (5, 6), &["-n", "200"]);
}

#[test]
fn ud_pingpong_server_and_client_run_200_iterations() {
    run_pair("ibv_ud_pingpong", UD_200, "ud", (7, 8), &["-n", "200"]);
}

/// The SRQ pingpong's default: 1000 round trips of 4096 bytes, spread over
/// its 16 QPs.
const SRQ_DEFAULT: (u32, u64) = (1000, 2 * 1000 * 4096);
/// `ibv_srq_pingpong`'s default number of QPs (`-q`).
const SRQ_QPS: usize = 16;

/// `ibv_srq_pingpong` with `extra`, validating the data (`-c`: a received
/// buffer that differs from what was sent prints an error, which the
/// clean-stderr check catches): every one of the 16 QPs of each side is
/// named by the other, in order.
fn run_srq_pair(test: &str, slots: (u8, u8), extra: &[&str]) {
    let mut args = vec!["-c"];
    args.extend_from_slice(extra);
    let (server, client) = run_pair("ibv_srq_pingpong", SRQ_DEFAULT, test, slots, &args);
    let (server, client) = (text(&server.stdout), text(&client.stdout));
    let server_qps = address_lines(&server, "local address:");
    let client_qps = address_lines(&client, "local address:");
    assert_eq!(server_qps.len(), SRQ_QPS, "{server}");
    assert_eq!(client_qps.len(), SRQ_QPS, "{client}");
    assert_eq!(server_qps, address_lines(&client, "remote address:"));
    assert_eq!(client_qps, address_lines(&server, "remote address:"));
}

#[test]
fn srq_pingpong_server_and_client_run_their_1000_iterations_validating_data() {
    run_srq_pair("srq", (9, 10), &[]);
}

#[test]
fn srq_pingpong_with_completion_events_runs_its_1000_iterations() {
    run_srq_pair("srq-events", (11, 12), &["-e"]);
}
