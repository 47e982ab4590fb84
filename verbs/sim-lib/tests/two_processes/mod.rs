//! What the tests that run a Debian tool's server and client as two
//! processes share (`pingpong.rs`, `perftest.rs`): this test process's own
//! loopback addresses, our libraries under their sonames in a directory of
//! the test's, a free TCP port, waiting for the server to listen, and
//! waiting for each process with a deadline (a hung one is killed, its
//! output in the panic).

use std::io::Read;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use verbs_side_support::testing::{built_cdylib, tool_path};

/// This test process's own loopback address number `slot`, as
/// `debian_tools.rs` picks them: 127.x.y.slot with x.y from the process
/// id (x in 64..128), so concurrent runs never contend for one.
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

/// Whether process `pid` listens on TCP `port` (`/proc/net/tcp` and
/// `tcp6`, state 0A, the socket's inode among the process's descriptors):
/// another process that took the port (a concurrent test's server) does
/// not count.
fn listening(pid: u32, port: u16) -> bool {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
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
        .unwrap_or_default();
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

/// Waits up to `limit` for `child` to exit, then kills it: its output, or
/// a panic saying who hung.
pub(crate) fn finish(mut child: Child, who: &str, limit: Duration) -> Output {
    let deadline = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let mut stderr = String::new();
            let _ = child.stderr.take().unwrap().read_to_string(&mut stderr);
            panic!("the {who} did not finish within {limit:?}:\n{stderr}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// The server, killed when dropped (a failed assertion leaves no process).
pub(crate) struct Server(Option<Child>);

impl Server {
    /// Takes the spawned server and waits (20 s at most) until it listens
    /// on TCP `port`; a server that exits first fails the test at once
    /// with its output.
    pub(crate) fn listening_on(child: Child, port: u16) -> Self {
        let mut server = Server(Some(child));
        let deadline = Instant::now() + Duration::from_secs(20);
        let pid = server.0.as_ref().unwrap().id();
        while !listening(pid, port) {
            let running = server.0.as_mut().unwrap();
            if running.try_wait().unwrap().is_some() {
                let early = server.wait(Duration::ZERO);
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
        server
    }

    pub(crate) fn wait(mut self, limit: Duration) -> Output {
        finish(self.0.take().unwrap(), "server", limit)
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

pub(crate) fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Whether a tool's standard error is exactly the library's exit report
/// (`SIM_LIBIBVERBS_EXIT_REPORT`) saying its machine shut down cleanly
/// with `left_open` CAs the program had left open.
pub(crate) fn ended_cleanly(stderr: &str, left_open: usize) -> bool {
    let lines: Vec<&str> = stderr.lines().collect();
    lines.len() == 1
        && lines[0].starts_with("libibverbs: at exit: the machine shut down cleanly in ")
        && lines[0].ends_with(&format!(" ({left_open} CAs left open)"))
}
