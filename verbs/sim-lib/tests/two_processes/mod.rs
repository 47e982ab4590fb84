//! What the tests that run Debian's tools as processes on our libraries
//! share (`debian_tools.rs`, `pingpong.rs`, `perftest.rs`,
//! `killed_peer.rs`): this test process's own loopback addresses, our
//! libraries under their sonames in a directory of the test's, a free TCP
//! port, the sockets a process holds, a tool's process guard (killed when
//! dropped, waited for with a deadline: a hung one is killed, its output
//! in the panic), starting a server and its client, and the exit report.

#![allow(dead_code, reason = "each test binary uses part of the support")]

use std::io::Read;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use verbs_side_support::testing::{built_cdylib, tool_path};

/// Our five libraries (the side libraries, which perftest links, are
/// dev-dependencies: cargo built their cdylibs too): the file cargo builds
/// and its soname.
pub(crate) const LIBRARIES: [(&str, &str); 5] = [
    ("libibverbs.so", "libibverbs.so.1"),
    ("libmlx5.so", "libmlx5.so.1"),
    ("libefa.so", "libefa.so.1"),
    ("librdmacm.so", "librdmacm.so.1"),
    ("libibumad.so", "libibumad.so.3"),
];

/// This test process's own loopback address number `slot`:
/// 127.x.y.slot with x.y from the process id, x in 64..128 (never
/// 127.0.0.x, which the tools take with no configuration, nor the
/// 128..256 of sim-shells' UDP tests), so concurrent runs of these tests
/// (other worktrees on one machine) never contend for one.
pub(crate) fn own_address(slot: u8) -> Ipv4Addr {
    let pid = std::process::id();
    Ipv4Addr::new(127, 0x40 | (pid >> 8) as u8 & 0x3F, pid as u8, slot)
}

/// The cdylibs cargo built (`libibverbs.so`, ...) under their sonames in
/// `<tmp>/<group>/<test>`: linked under a name of this process's, then
/// renamed over the soname (atomic), since concurrent runs of a test
/// binary share the directory; a debug build is large, so nothing is
/// copied.
pub(crate) fn library_dir(group: &str, test: &str, libraries: &[(&str, &str)]) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(group)
        .join(test);
    std::fs::create_dir_all(&dir).unwrap();
    for (file, soname) in libraries {
        let fresh = dir.join(format!("{soname}.{}", std::process::id()));
        let _ = std::fs::remove_file(&fresh);
        std::os::unix::fs::symlink(built_cdylib(file), &fresh).unwrap();
        std::fs::rename(&fresh, dir.join(soname)).unwrap();
    }
    dir
}

/// Debian's `tool args` with the libraries of `dir` first on the path,
/// its port pinned at `address`, the exit report on, its output piped.
pub(crate) fn on_our_libraries(
    tool: &str,
    dir: &Path,
    address: Ipv4Addr,
    args: &[&str],
) -> Command {
    let mut command = Command::new(tool_path(tool));
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
pub(crate) fn free_tcp_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The socket inodes among process `pid`'s descriptors (`/proc/<pid>/fd`),
/// to match with the `inode` column of `/proc/net/{tcp,udp}`.
pub(crate) fn socket_inodes(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|fds| {
            fds.filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
                .filter_map(|target| {
                    let target = target.to_str()?;
                    Some(
                        target
                            .strip_prefix("socket:[")?
                            .strip_suffix(']')?
                            .to_owned(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Whether process `pid` listens on TCP `port` (`/proc/net/tcp` and
/// `tcp6`, state 0A, the socket's inode among the process's descriptors):
/// another process that took the port (a concurrent test's server) does
/// not count.
fn listening(pid: u32, port: u16) -> bool {
    let inodes = socket_inodes(pid);
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|table| {
        let table = std::fs::read_to_string(table).unwrap_or_default();
        table.lines().skip(1).any(|line| {
            let columns: Vec<&str> = line.split_whitespace().collect();
            let local_port = columns
                .get(1)
                .and_then(|local| local.rsplit_once(':'))
                .and_then(|(_, port)| u16::from_str_radix(port, 16).ok());
            local_port == Some(port)
                && columns.get(3) == Some(&"0A")
                && columns
                    .get(9)
                    .is_some_and(|inode| inodes.iter().any(|i| i == inode))
        })
    })
}

/// A tool's process, killed (and reaped) when dropped: a failed assertion
/// leaves no process behind.
pub(crate) struct Process {
    child: Option<Child>,
    who: &'static str,
}

impl Process {
    /// Spawns `command`; `who` names it in the panics (`server`, ...).
    pub(crate) fn spawn(command: &mut Command, who: &'static str) -> Self {
        Self {
            child: Some(command.spawn().unwrap()),
            who,
        }
    }

    pub(crate) fn who(&self) -> &'static str {
        self.who
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// The tool's standard output, when it was spawned piped.
    pub(crate) fn take_stdout(&mut self) -> Option<std::process::ChildStdout> {
        self.child.as_mut().unwrap().stdout.take()
    }

    /// Whether the process has exited (without reaping its output).
    pub(crate) fn has_exited(&mut self) -> bool {
        self.child.as_mut().unwrap().try_wait().unwrap().is_some()
    }

    /// Panics with the tool's output if it already exited.
    pub(crate) fn assert_running(&mut self, doing: &str) {
        if self.child.as_mut().unwrap().try_wait().unwrap().is_some() {
            let output = self.child.take().unwrap().wait_with_output().unwrap();
            panic!(
                "the {} exited {doing} ({}):\n{}{}",
                self.who,
                output.status,
                text(&output.stdout),
                text(&output.stderr)
            );
        }
    }

    /// Waits (20 s at most) until the process listens on TCP `port`; one
    /// that exits first fails the test at once with its output.
    pub(crate) fn wait_until_listening(&mut self, port: u16) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !listening(self.pid(), port) {
            self.assert_running("before listening");
            assert!(
                Instant::now() < deadline,
                "the {} did not listen within 20 s",
                self.who
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits up to `limit` for the process to exit: its output, or (a
    /// hang) the process killed and a panic saying who hung.
    pub(crate) fn wait(self, limit: Duration) -> Output {
        self.wait_timed(limit).0
    }

    /// [`Process::wait`], also saying when it exited (within a few
    /// milliseconds).
    pub(crate) fn wait_timed(mut self, limit: Duration) -> (Output, Instant) {
        let deadline = Instant::now() + limit;
        let mut child = self.child.take().unwrap();
        loop {
            if child.try_wait().unwrap().is_some() {
                let exited = Instant::now();
                return (child.wait_with_output().unwrap(), exited);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let mut stderr = String::new();
                if let Some(mut pipe) = child.stderr.take() {
                    let _ = pipe.read_to_string(&mut stderr);
                }
                let _ = child.wait();
                panic!(
                    "the {} hung: still running {limit:?} later:\n{stderr}",
                    self.who
                );
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Starts Debian's `tool -p <port> args` as a server at `addresses.0` and,
/// once it listens on that (free) port, `tool -p <port> args 127.0.0.1`
/// as its client at `addresses.1`, on the libraries of `dir`.
pub(crate) fn start_pair(
    tool: &str,
    dir: &Path,
    addresses: (Ipv4Addr, Ipv4Addr),
    args: &[&str],
) -> (Process, Process) {
    let port = free_tcp_port();
    let port_text = port.to_string();
    let mut args_with_port = vec!["-p", &port_text];
    args_with_port.extend_from_slice(args);
    let mut server = Process::spawn(
        &mut on_our_libraries(tool, dir, addresses.0, &args_with_port),
        "server",
    );
    server.wait_until_listening(port);
    args_with_port.push("127.0.0.1");
    let client = Process::spawn(
        &mut on_our_libraries(tool, dir, addresses.1, &args_with_port),
        "client",
    );
    (server, client)
}

pub(crate) fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Whether `line` is the library's exit report (`SIM_LIBIBVERBS_EXIT_REPORT`)
/// saying its machine shut down cleanly with `left_open` CAs the program
/// had left open.
pub(crate) fn is_clean_exit_report(line: &str, left_open: usize) -> bool {
    line.starts_with("libibverbs: at exit: the machine shut down cleanly in ")
        && line.ends_with(&format!(" ({left_open} CAs left open)"))
}

/// Whether a tool's standard error is exactly the library's clean exit
/// report, with `left_open` CAs the program had left open.
pub(crate) fn ended_cleanly(stderr: &str, left_open: usize) -> bool {
    let lines: Vec<&str> = stderr.lines().collect();
    lines.len() == 1 && is_clean_exit_report(lines[0], left_open)
}
