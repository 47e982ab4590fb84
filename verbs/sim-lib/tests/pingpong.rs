//! Debian's unmodified `ibv_rc_pingpong` on our `libibverbs.so.1` across
//! two processes (issue 14): the server (`ibv_rc_pingpong -g 0`) and the
//! client (`ibv_rc_pingpong -g 0 127.0.0.1`), each its own simulated
//! machine, their RoCEv2 ports real UDP endpoints at two of this test
//! process's own loopback addresses, run their default 1000 iterations
//! (busy polling, and with completion events, `-e`), both exit 0 and
//! print the tool's own throughput lines, each names the other's QP and
//! GID, and both machines end cleanly.

use std::io::Read;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use verbs_side_support::testing::{built_cdylib, tool_path};

/// This test process's own loopback address number `slot`, as
/// `debian_tools.rs` picks them: 127.x.y.slot with x.y from the process
/// id (x in 64..128), so concurrent runs never contend for one.
fn own_address(slot: u8) -> Ipv4Addr {
    let pid = std::process::id();
    Ipv4Addr::new(127, 0x40 | (pid >> 8) as u8 & 0x3F, pid as u8, slot)
}

/// Our library under its soname in a directory of the test's own.
fn library_dir(test: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("sim-libibverbs-pingpong")
        .join(test);
    std::fs::create_dir_all(&dir).unwrap();
    let fresh = dir.join(format!("libibverbs.so.1.{}", std::process::id()));
    let _ = std::fs::remove_file(&fresh);
    std::os::unix::fs::symlink(built_cdylib("libibverbs.so"), &fresh).unwrap();
    std::fs::rename(&fresh, dir.join("libibverbs.so.1")).unwrap();
    dir
}

/// `ibv_rc_pingpong args` on our library, its port at `address`.
fn pingpong(dir: &PathBuf, address: Ipv4Addr, args: &[&str]) -> Command {
    let mut command = Command::new(tool_path("ibv_rc_pingpong"));
    command
        .args(args)
        .env("LD_LIBRARY_PATH", dir)
        .env("SIM_LIBIBVERBS_EXIT_REPORT", "1")
        .env("SIM_LIBIBVERBS_ADDR", address.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// A TCP port nothing listens on (the server's exchange port).
fn free_tcp_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Whether some socket listens on TCP `port` (`/proc/net/tcp`, state 0A).
fn tcp_listening(port: u16) -> bool {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    table.lines().skip(1).any(|line| {
        let columns: Vec<&str> = line.split_whitespace().collect();
        let local_port = columns
            .get(1)
            .and_then(|local| local.split_once(':'))
            .and_then(|(_, port)| u16::from_str_radix(port, 16).ok());
        local_port == Some(port) && columns.get(3) == Some(&"0A")
    })
}

/// The server, killed when dropped (a failed assertion leaves no process).
struct Server(Option<Child>);

impl Server {
    fn wait(mut self) -> Output {
        self.0.take().unwrap().wait_with_output().unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(child) = &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

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

/// Runs the server and the client with `extra` options; returns their
/// outputs after checking both exit 0 with the tool's own lines.
fn run_pair(test: &str, slots: (u8, u8), extra: &[&str]) -> (Output, Output) {
    let dir = library_dir(test);
    let (server_at, client_at) = (own_address(slots.0), own_address(slots.1));
    let port = free_tcp_port().to_string();
    let mut server_args = vec!["-g", "0", "-p", &port];
    server_args.extend_from_slice(extra);
    let mut server = Server(Some(
        pingpong(&dir, server_at, &server_args).spawn().unwrap(),
    ));
    let deadline = Instant::now() + Duration::from_secs(20);
    while !tcp_listening(port.parse().unwrap()) {
        let running = server.0.as_mut().unwrap();
        if running.try_wait().unwrap().is_some() {
            let early = server.wait();
            panic!(
                "the server exited before listening ({}):\n{}{}",
                early.status,
                text(&early.stdout),
                text(&early.stderr)
            );
        }
        assert!(
            Instant::now() < deadline,
            "the server did not listen within 20 s"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut client_args = server_args.clone();
    client_args.push("127.0.0.1");
    let mut client = pingpong(&dir, client_at, &client_args).spawn().unwrap();
    // Neither may hang: the client is given 60 s (a debug build on a
    // loaded machine), then killed.
    let deadline = Instant::now() + Duration::from_secs(60);
    while client.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = client.kill();
            let mut stderr = String::new();
            let _ = client.stderr.take().unwrap().read_to_string(&mut stderr);
            panic!("the client did not finish within 60 s:\n{stderr}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let client = client.wait_with_output().unwrap();
    let server = server.wait();
    for (output, who, at, peer) in [
        (&server, "server", server_at, client_at),
        (&client, "client", client_at, server_at),
    ] {
        let stdout = text(&output.stdout);
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(0), "{who}:\n{stdout}\n{stderr}");
        assert!(
            stdout.contains("8192000 bytes in ") && stdout.contains("1000 iters in "),
            "{who}: the tool's throughput lines (1000 iterations of 4096 bytes each way):\n{stdout}"
        );
        assert_eq!(
            address_line(&stdout, "local address:").1,
            format!("::ffff:{at}")
        );
        assert_eq!(
            address_line(&stdout, "remote address:").1,
            format!("::ffff:{peer}")
        );
        let lines: Vec<&str> = stderr.lines().collect();
        assert!(
            lines.len() == 1
                && lines[0].starts_with("libibverbs: at exit: the machine shut down cleanly in ")
                && lines[0].ends_with(" (0 CAs left open)"),
            "{who}: the embedded machine did not end cleanly:\n{stderr}"
        );
        println!("{who} ({}):\n{stdout}", extra.join(" "));
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

#[test]
fn rc_pingpong_server_and_client_run_their_1000_iterations() {
    run_pair("rc", (1, 2), &[]);
}

#[test]
fn rc_pingpong_with_completion_events_runs_its_1000_iterations() {
    run_pair("rc-events", (3, 4), &["-e"]);
}
