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
use std::process::{Command, Output};
use std::time::Duration;

use ib_types::ca::CaAttr;
use ib_types::scalars::{LinkLayer, PortNum, PortState};
use ibal_user::{CaSelector, Context, PluginSource, PortInfo};
use sim_shells::embedded::{EmbeddedMachine, Fabric};
use verbs_side_support::testing::{
    VersionedSymbol, assert_exports_the_tools_imports_in_their_nodes, built_cdylib, tool_path,
};

const SONAME: &str = "libibverbs.so.1";

/// Our five libraries (the side libraries are dev-dependencies, so cargo
/// built their cdylibs too): the file cargo builds and its soname.
const LIBRARIES: [(&str, &str); 5] = [
    ("libibverbs.so", SONAME),
    ("libmlx5.so", "libmlx5.so.1"),
    ("libefa.so", "libefa.so.1"),
    ("librdmacm.so", "librdmacm.so.1"),
    ("libibumad.so", "libibumad.so.3"),
];

/// The address variable (`sim_libibverbs::ADDRESS_VARIABLE`).
const ADDRESS_VARIABLE: &str = "SIM_LIBIBVERBS_ADDR";

/// This test process's own loopback address number `slot`:
/// 127.x.y.slot with x.y from the process id, x in 64..128 (never
/// 127.0.0.x, which the tools take with no configuration, nor the
/// 128..256 of sim-shells' UDP tests), so concurrent runs of these tests
/// (other worktrees on one machine) never contend for one.
fn own_address(slot: u8) -> Ipv4Addr {
    let pid = std::process::id();
    Ipv4Addr::new(127, 0x40 | (pid >> 8) as u8 & 0x3F, pid as u8, slot)
}

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
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join("sim-libibverbs")
            .join(test);
        std::fs::create_dir_all(&dir).unwrap();
        for (file, soname) in LIBRARIES {
            let link = dir.join(soname);
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(built_cdylib(file), &link).unwrap();
        }
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

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Standard error of a run that should be clean: only the exit report,
/// saying the machine shut down cleanly with `left_open` CAs still open
/// when the program exited.
fn assert_clean_exit(output: &Output, what: &str, left_open: usize) {
    let stderr = text(&output.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert!(
        lines.len() == 1
            && lines[0].starts_with("libibverbs: at exit: the machine shut down cleanly in ")
            && lines[0].ends_with(&format!(" ({left_open} CAs left open)")),
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

/// perftest loads all five of our libraries, opens our device, and stops
/// at its TCP connection to a server that is not there, with its own
/// error; it exits without closing the device, and the process's exit
/// closes it: the machine still ends cleanly.
#[test]
fn perftest_runs_on_our_libraries_until_its_connection_and_its_exit_closes_the_device() {
    let tools = Tools::new("ib_write_bw", 4);
    // A port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
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
