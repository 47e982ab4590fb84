//! The built `libibverbs.so.1` against Debian's unmodified `ibv_devices`
//! and `ibv_devinfo` (issue 14's first milestone): its exports and soname
//! (`objdump`), the tools loading it from `LD_LIBRARY_PATH`, and what they
//! print, checked against what the access library (`ibal-user`) reports on
//! a machine booted the same way in this test; the tools' own errors for a
//! bad device name and a bad port; and the embedded machine's clean
//! shutdown when each tool returns from `main`.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use ib_types::ca::CaAttr;
use ib_types::scalars::{LinkLayer, PortNum, PortState};
use ibal_user::{CaSelector, Context, PluginSource, PortInfo};
use sim_shells::embedded::{EmbeddedMachine, Fabric};
use verbs_side_support::testing::{
    VersionedSymbol, assert_exports_the_tools_imports_in_their_nodes, built_cdylib, tool_path,
};

mod two_processes;
use two_processes::{
    LIBRARIES, Process, ended_cleanly, free_tcp_port, library_dir, own_address, socket_inodes, text,
};

const SONAME: &str = "libibverbs.so.1";

/// The address variable (`sim_libibverbs::ADDRESS_VARIABLE`).
const ADDRESS_VARIABLE: &str = "SIM_LIBIBVERBS_ADDR";

/// Debian's tools on our libraries, their port pinned at one of this
/// process's own addresses.
struct Tools {
    dir: PathBuf,
    address: Ipv4Addr,
}

impl Tools {
    /// The libraries under their sonames in a directory of their own (the
    /// tests run in parallel: each gets its own links, and its own
    /// address `slot`; a debug build of the library is large, so it is
    /// linked, not copied).
    fn new(test: &str, slot: u8) -> Self {
        let dir = library_dir("sim-libibverbs", test, &LIBRARIES);
        Self {
            dir,
            address: own_address(slot),
        }
    }

    /// Debian's `tool args` with our library first on the path and the
    /// exit report on; the port's address not configured.
    fn command(&self, tool: &str, args: &[&str]) -> Command {
        let mut command = Command::new(tool_path(tool));
        command
            .args(args)
            .env("LD_LIBRARY_PATH", &self.dir)
            .env("SIM_LIBIBVERBS_EXIT_REPORT", "1")
            .env_remove(ADDRESS_VARIABLE);
        command
    }

    /// Runs `tool args` with the port at this test's address.
    fn run(&self, tool: &str, args: &[&str]) -> Output {
        self.command(tool, args)
            .env(ADDRESS_VARIABLE, self.address.to_string())
            .output()
            .unwrap()
    }
}

/// Standard error of a run that should be clean: only the exit report,
/// saying the machine shut down cleanly with `left_open` CAs still open
/// when the program exited.
fn assert_clean_exit(output: &Output, what: &str, left_open: usize) {
    let stderr = text(&output.stderr);
    assert!(
        ended_cleanly(&stderr, left_open),
        "{what}: the embedded machine did not end cleanly:\n{stderr}"
    );
}

/// What the access library reports on a machine booted as the library
/// boots its own, its port at `address` (on the in-process fabric: the
/// tool holds the address): the CA's attributes and port 1's.
fn expected(address: Ipv4Addr) -> (CaAttr, PortInfo) {
    let fabric = Fabric::InProcess {
        port_address: address.octets(),
    };
    let machine = EmbeddedMachine::boot(fabric, 1).expect("the machine boots");
    let io = machine.io();
    let (attr, port) = {
        let ca = Context::open(&io, CaSelector::Index(0), &PluginSource::Linked).unwrap();
        (ca.query().unwrap(), ca.query_port(PortNum::FIRST).unwrap())
    };
    let report = machine.shut_down(Duration::from_secs(10));
    assert_eq!(report.problems, Vec::<String>::new());
    assert_eq!(report.left_open, 0, "the CA closed before the exit");
    (attr, port)
}

/// `key: value` lines of `ibv_devinfo`'s output (keys trimmed, unique
/// with one port).
fn fields(stdout: &str) -> BTreeMap<String, String> {
    stdout
        .lines()
        .filter_map(|line| {
            let (key, value) = line.trim().split_once(':')?;
            Some((key.trim().to_string(), value.trim().to_string()))
        })
        .collect()
}

#[test]
fn it_exports_every_libibverbs_symbol_debians_tools_import_with_its_version() {
    let others = assert_exports_the_tools_imports_in_their_nodes(
        &built_cdylib("libibverbs.so"),
        SONAME,
        &["IBVERBS_"],
        // The SRQ and AH verbs no surveyed tool imports, offered to
        // complete the sets, and the asynchronous event verbs (Debian's
        // `ibv_asyncwatch` imports them) (docs/libibverbs.md, "Exports").
        &[
            "ibv_modify_srq@IBVERBS_1.1",
            "ibv_query_srq@IBVERBS_1.1",
            "ibv_init_ah_from_wc@IBVERBS_1.1",
            "ibv_get_async_event@IBVERBS_1.1",
            "ibv_ack_async_event@IBVERBS_1.1",
        ],
    );
    // The linked plugin's DLL entry points (`#[no_mangle]` in uvp-plugin,
    // which rustc exports from any cdylib linking it) are the only others.
    let names: Vec<&str> = others.iter().map(|s: &VersionedSymbol| &*s.name).collect();
    assert_eq!(names, ["uvp_get_interface", "uvp_set_platform"]);
}

#[test]
fn ibv_devices_lists_our_hca_with_the_node_guid_the_access_library_reports() {
    let tools = Tools::new("ibv_devices", 1);
    let (attr, _) = expected(tools.address);
    let output = tools.run("ibv_devices", &[]);
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
    let stdout = text(&output.stdout);
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .skip(2)
        .map(|line| line.split_whitespace().collect())
        .collect();
    assert_eq!(
        rows,
        [vec!["simhca0", &*format!("{:016x}", attr.node_guid.get())]],
        "{stdout}"
    );
    assert_clean_exit(&output, "ibv_devices", 0);
}

#[test]
fn ibv_devinfo_prints_what_the_access_library_reports() {
    let tools = Tools::new("ibv_devinfo", 2);
    let (attr, port) = expected(tools.address);
    let output = tools.run("ibv_devinfo", &[]);
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
    let stdout = text(&output.stdout);
    let got = fields(&stdout);
    let guid = attr.node_guid.get();
    let guid_text = format!(
        "{:04x}:{:04x}:{:04x}:{:04x}",
        guid >> 48,
        (guid >> 32) & 0xffff,
        (guid >> 16) & 0xffff,
        guid & 0xffff
    );
    let fw = attr.fw_version;
    let mtu = |m: ib_types::scalars::Mtu| format!("{} ({})", m.bytes(), m.code());
    assert_eq!(port.attr.state, PortState::Active);
    assert_eq!(port.attr.link_layer, LinkLayer::Ethernet);
    let gid0 = Ipv6Addr::from(port.gids[0].octets());
    for (key, value) in [
        ("hca_id", "simhca0".to_string()),
        ("transport", "InfiniBand (0)".to_string()),
        (
            "fw_ver",
            format!(
                "{}.{}.{}",
                fw >> 32 & 0xffff,
                fw >> 16 & 0xffff,
                fw & 0xffff
            ),
        ),
        ("node_guid", guid_text.clone()),
        ("vendor_id", format!("0x{:04x}", attr.vendor_id)),
        ("vendor_part_id", attr.device_id.to_string()),
        ("hw_ver", format!("0x{:X}", attr.revision)),
        ("phys_port_cnt", attr.layout.num_ports.to_string()),
        ("port", "1".to_string()),
        ("state", "PORT_ACTIVE (4)".to_string()),
        ("max_mtu", mtu(port.attr.max_mtu)),
        ("active_mtu", mtu(port.attr.active_mtu)),
        ("port_lid", port.attr.lid.get().to_string()),
        ("link_layer", "Ethernet".to_string()),
    ] {
        assert_eq!(got.get(key), Some(&value), "{key} in:\n{stdout}");
    }
    assert!(
        !got.contains_key("GID[  0]"),
        "GIDs only with -v:\n{stdout}"
    );
    assert_clean_exit(&output, "ibv_devinfo", 0);

    // -v: the limits, the port's tables, and GID 0 with its RoCE v2 type.
    let output = tools.run("ibv_devinfo", &["-v"]);
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
    let stdout = text(&output.stdout);
    let got = fields(&stdout);
    let limits = &attr.limits;
    for (key, value) in [
        ("node_guid", guid_text),
        ("max_mr_size", format!("{:#x}", limits.max_mr_size)),
        ("max_qp", limits.max_qps.to_string()),
        ("max_qp_wr", limits.max_wrs_per_qp.to_string()),
        ("max_cq", limits.max_cqs.to_string()),
        ("max_cqe", limits.max_cqes.to_string()),
        ("max_pd", limits.max_pds.to_string()),
        ("max_srq", limits.max_srqs.to_string()),
        ("max_qp_rd_atom", limits.max_qp_rd_atomic.to_string()),
        ("local_ca_ack_delay", attr.local_ack_delay.to_string()),
        ("max_msg_sz", format!("{:#x}", port.attr.max_msg_size)),
        ("pkey_tbl_len", port.pkeys.len().to_string()),
        ("gid_tbl_len", port.gids.len().to_string()),
        ("GID[  0]", format!("{gid0}, RoCE v2")),
    ] {
        assert_eq!(got.get(key), Some(&value), "{key} in:\n{stdout}");
    }
    // The extended attributes come from our `query_device_ex`: the
    // extended capability flags are the base ones (not the zero of the
    // inline's fallback), the rest absent.
    let flags = got
        .get("device_cap_flags")
        .and_then(|hex| u32::from_str_radix(hex.trim_start_matches("0x"), 16).ok())
        .unwrap_or_else(|| panic!("device_cap_flags in:\n{stdout}"));
    assert_ne!(flags, 0);
    assert_eq!(
        got.get("device_cap_flags_ex"),
        Some(&format!("0x{flags:X}")),
        "device_cap_flags_ex in:\n{stdout}"
    );
    for absent in [
        "completion_timestamp_mask not supported",
        "core clock not supported",
        "tag matching not supported",
    ] {
        assert!(stdout.contains(absent), "{absent:?} in:\n{stdout}");
    }
    // The port's address is the one the variable pinned.
    assert_eq!(gid0, tools.address.to_ipv6_mapped());
    assert_clean_exit(&output, "ibv_devinfo -v", 0);
}

#[test]
fn a_bad_device_name_or_port_gets_the_tools_own_error() {
    let tools = Tools::new("errors", 3);
    let output = tools.run("ibv_devinfo", &["-d", "mlx5_0"]);
    assert_eq!(output.status.code(), Some(255));
    let stderr = text(&output.stderr);
    assert!(
        stderr.starts_with("IB device 'mlx5_0' wasn't found\n"),
        "{stderr}"
    );
    assert!(output.stdout.is_empty());

    let output = tools.run("ibv_devinfo", &["-i", "2"]);
    assert_eq!(
        output.status.code(),
        Some(4),
        "print_hca_cap's invalid port"
    );
    let stderr = text(&output.stderr);
    assert!(
        stderr.starts_with("Invalid port requested for device\n"),
        "{stderr}"
    );
    // The machine still ends cleanly after the refusals.
    let mut clean = output.clone();
    clean.stderr = stderr
        .strip_prefix("Invalid port requested for device\n")
        .unwrap()
        .as_bytes()
        .to_vec();
    assert_clean_exit(&clean, "ibv_devinfo -i 2", 0);

    let output = tools.run("ibv_devinfo", &["-l"]);
    assert_eq!(output.status.code(), Some(0));
    assert_eq!(text(&output.stdout), "1 HCA found:\n\tsimhca0\n\n");
}

/// Debian's `ibv_asyncwatch` loads our library, prints the context's
/// `async_fd` (a real eventfd) and blocks waiting for an event.
#[test]
fn ibv_asyncwatch_waits_on_our_async_fd_a_real_eventfd() {
    use std::io::{BufRead, BufReader};
    let tools = Tools::new("ibv_asyncwatch", 9);
    let mut command = tools.command("ibv_asyncwatch", &[]);
    command
        .env(ADDRESS_VARIABLE, tools.address.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut watch = Background(Process::spawn(&mut command, "ibv_asyncwatch"));
    let stdout = watch.0.take_stdout().unwrap();
    let (sender, first_line) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = sender.send(line);
    });
    let line = first_line
        .recv_timeout(Duration::from_secs(20))
        .expect("ibv_asyncwatch prints its descriptor within 20 s");
    // rdma-core's asyncwatch prints the context's `async_fd`, then blocks
    // in `ibv_get_async_event`: nothing outside its process raises an
    // event on its machine.
    let fd: u32 = line
        .trim()
        .strip_prefix("simhca0: async event FD ")
        .and_then(|fd| fd.parse().ok())
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"));
    let target = std::fs::read_link(format!("/proc/{}/fd/{fd}", watch.0.pid())).unwrap();
    assert_eq!(target.to_str(), Some("anon_inode:[eventfd]"));
    std::thread::sleep(Duration::from_millis(300));
    assert!(!watch.0.has_exited(), "it waits for an event");
}

/// perftest loads all five of our libraries, opens our device, and stops
/// at its TCP connection to a server that is not there, with its own
/// error; it exits without closing the device, and the process's exit
/// closes it: the machine still ends cleanly.
#[test]
fn perftest_runs_on_our_libraries_until_its_connection_and_its_exit_closes_the_device() {
    let tools = Tools::new("ib_write_bw", 4);
    // A port nothing listens on.
    let port = free_tcp_port().to_string();
    let output = tools.run("ib_write_bw", &["-p", &port, "127.0.0.1"]);
    assert_eq!(output.status.code(), Some(1));
    assert!(output.stdout.is_empty());
    let stderr = text(&output.stderr);
    let refusal = format!(
        "Couldn't connect to 127.0.0.1:{port}\nUnable to open file descriptor for socket connection Unable to init the socket connection\n"
    );
    let rest = stderr
        .strip_prefix(&refusal)
        .unwrap_or_else(|| panic!("perftest's own error expected:\n{stderr}"));
    let mut clean = output.clone();
    clean.stderr = rest.as_bytes().to_vec();
    assert_clean_exit(&clean, "ib_write_bw 127.0.0.1", 1);
}

/// The addresses process `pid` holds RoCEv2 sockets at (UDP port 4791):
/// its socket descriptors (`/proc/<pid>/fd`) matched by inode with the
/// bound UDP sockets of `/proc/net/udp`.
fn rocev2_addresses_of(pid: u32) -> Vec<Ipv4Addr> {
    let inodes = socket_inodes(pid);
    let table = std::fs::read_to_string("/proc/net/udp").unwrap();
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let columns: Vec<&str> = line.split_whitespace().collect();
            let (address, port) = columns.get(1)?.split_once(':')?;
            let inode = columns.get(9)?;
            (u16::from_str_radix(port, 16).ok()? == 4791 && inodes.iter().any(|i| i == inode))
                .then_some(())?;
            // The kernel prints the big-endian address as a host integer.
            let address = u32::from_str_radix(address, 16).ok()?;
            Some(Ipv4Addr::from(address.to_ne_bytes()))
        })
        .collect()
}

/// A tool kept running in the background (perftest's server, waiting for
/// its client), killed when dropped, so a failed assertion leaves no
/// process behind.
struct Background(Process);

impl Background {
    /// Starts `command` and waits (up to 20 s) until its machine is up:
    /// the process holds its RoCEv2 socket. Returns that address.
    fn start(mut command: Command) -> (Self, Ipv4Addr) {
        command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let mut background = Self(Process::spawn(&mut command, "background tool"));
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let [address] = rocev2_addresses_of(background.0.pid())[..] {
                return (background, address);
            }
            background.0.assert_running("early");
            assert!(
                Instant::now() < deadline,
                "the background tool's machine did not bind its port within 20 s"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The addresses it still holds.
    fn addresses(&self) -> Vec<Ipv4Addr> {
        rocev2_addresses_of(self.0.pid())
    }
}

/// `GID[  0]` and `node_guid` of an `ibv_devinfo -v` run that succeeded.
fn gid0_and_guid(output: &Output) -> (Ipv6Addr, String) {
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
    let stdout = text(&output.stdout);
    let got = fields(&stdout);
    let gid = got
        .get("GID[  0]")
        .and_then(|g| g.strip_suffix(", RoCE v2"))
        .and_then(|g| g.parse().ok())
        .unwrap_or_else(|| panic!("no RoCE v2 GID[0] in:\n{stdout}"));
    (gid, got["node_guid"].clone())
}

/// `ibv_devinfo`'s `node_guid` text for a port at `address`.
fn guid_text(address: Ipv4Addr) -> String {
    let guid = EmbeddedMachine::node_guid(address.octets());
    format!(
        "{:04x}:{:04x}:{:04x}:{:04x}",
        guid >> 48,
        (guid >> 32) & 0xffff,
        (guid >> 16) & 0xffff,
        guid & 0xffff
    )
}

/// With no configuration, processes running at the same time each take
/// their own loopback address: two perftest servers wait for their
/// clients, each holding the first address free when it started, and
/// `ibv_devinfo` run meanwhile reports a third as its GID 0 (and the node
/// GUID that follows from it). Other runs on this machine may hold some
/// 127.0.0.x: the addresses are the first free ones, not fixed ones.
#[test]
fn processes_at_the_same_time_get_distinct_addresses_with_no_configuration() {
    let tools = Tools::new("no_configuration", 5);
    let first_port = free_tcp_port().to_string();
    let (first, first_address) =
        Background::start(tools.command("ib_write_bw", &["-p", &first_port]));
    let second_port = free_tcp_port().to_string();
    let (second, second_address) =
        Background::start(tools.command("ib_write_bw", &["-p", &second_port]));
    let output = tools.command("ibv_devinfo", &["-v"]).output().unwrap();
    let (gid, guid) = gid0_and_guid(&output);
    assert_clean_exit(&output, "ibv_devinfo -v", 0);
    // Both servers held their addresses all along.
    assert_eq!(first.addresses(), [first_address]);
    assert_eq!(second.addresses(), [second_address]);

    let Some(devinfo_address) = gid.to_ipv4_mapped() else {
        panic!("GID 0 {gid} is not IPv4-mapped");
    };
    let addresses = [first_address, second_address, devinfo_address];
    for address in addresses {
        assert_eq!(
            address.octets()[..3],
            [127, 0, 0],
            "{address}: not one of 127.0.0.x"
        );
    }
    assert!(
        first_address != second_address
            && devinfo_address != first_address
            && devinfo_address != second_address,
        "three processes at once, addresses {addresses:?}"
    );
    assert_eq!(guid, guid_text(devinfo_address));
}

/// The variable pins the port's address: a server pinned at this test's
/// address holds exactly it, and `ibv_devinfo` pinned at another reports
/// that one; pinned at the held one, `ibv_devinfo` gets the library's
/// clean error (printed once) and no devices, not a panic.
#[test]
fn the_address_variable_pins_the_port_and_a_held_address_is_a_clean_error() {
    let tools = Tools::new("pinned", 6);
    let port = free_tcp_port().to_string();
    let mut server = tools.command("ib_write_bw", &["-p", &port]);
    server.env(ADDRESS_VARIABLE, tools.address.to_string());
    let (server, held) = Background::start(server);
    assert_eq!(held, tools.address);

    let other = own_address(7);
    let output = tools
        .command("ibv_devinfo", &["-v"])
        .env(ADDRESS_VARIABLE, other.to_string())
        .output()
        .unwrap();
    let (gid, guid) = gid0_and_guid(&output);
    assert_eq!(gid, other.to_ipv6_mapped());
    assert_eq!(guid, guid_text(other));
    assert_clean_exit(&output, "ibv_devinfo -v", 0);

    let output = tools.run("ibv_devinfo", &[]);
    assert_eq!(output.status.code(), Some(255), "ibv_devinfo's own exit");
    assert!(output.stdout.is_empty());
    assert_eq!(
        text(&output.stderr),
        format!(
            "libibverbs: the machine did not boot: cannot bind the port's RoCEv2 endpoint {held}:4791 (UDP): Address already in use (os error 98)\n\
             Failed to get IB devices list: No such device\n"
        )
    );
    assert_eq!(server.addresses(), [held]);
}

/// A value of the variable that is not a unicast IPv4 address, or one
/// this machine has not, is one clear line on standard error: the device
/// list is NULL with `ENODEV` (the tool says so and exits), no machine is
/// booted (so there is no exit report), nothing panics.
#[test]
fn a_bad_address_variable_is_one_clear_error_and_no_devices() {
    let tools = Tools::new("bad_address", 8);
    let not_an_address = "not an IPv4 address (a.b.c.d, e.g. 127.0.0.5)";
    let not_unicast = "not a unicast address a port can bind";
    for (value, why) in [
        ("banana", not_an_address),
        ("127.0.0.256", not_an_address),
        ("127.0.0.5:4791", not_an_address),
        ("0.0.0.0", not_unicast),
        ("224.0.0.1", not_unicast),
        ("255.255.255.255", not_unicast),
    ] {
        let output = tools
            .command("ibv_devinfo", &[])
            .env(ADDRESS_VARIABLE, value)
            .output()
            .unwrap();
        assert_eq!(output.status.code(), Some(255), "{value}");
        assert!(output.stdout.is_empty(), "{value}");
        assert_eq!(
            text(&output.stderr),
            format!(
                "libibverbs: the machine did not boot: {ADDRESS_VARIABLE}={value}: {why}\n\
                 Failed to get IB devices list: No such device\n"
            ),
            "{value}"
        );
    }
    // An address no interface of this machine has (TEST-NET-1).
    let output = tools
        .command("ibv_devinfo", &[])
        .env(ADDRESS_VARIABLE, "192.0.2.1")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(255));
    assert_eq!(
        text(&output.stderr),
        "libibverbs: the machine did not boot: cannot bind the port's RoCEv2 endpoint 192.0.2.1:4791 (UDP): Cannot assign requested address (os error 99)\n\
         Failed to get IB devices list: No such device\n"
    );
}
