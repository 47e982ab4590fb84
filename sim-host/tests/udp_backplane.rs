//! The backplane's UDP engine (`Backplane::udp`, `HostConfig::threaded_udp`):
//! each function's ports are bound to real UDP endpoints, the functions'
//! configurations report the bound addresses, the devices' ports take them
//! as their GID 0 and MAC, and the stepped-only controls answer `None`.
//! The machine-level scenario (two hosts, the real stack, user processes)
//! is `sim-shells/tests/udp_hosts.rs`.

use std::net::Ipv4Addr;

use sim_hca::device::DeviceConfig;
use sim_hca::udp::PortAddress;
use sim_host::host::{Host, HostConfig, HostError};
use sim_host::pci::Backplane;
use sim_host::verifier::Verifier;

/// The `n`th address of this process's own range `range` (0..=7):
/// 127.x.y.(32 * range + 1 + n) with x.y from the process id (never
/// 127.0.0.x), so concurrent runs of these tests never contend.
fn own(range: u8, n: u8) -> Ipv4Addr {
    let pid = std::process::id();
    Ipv4Addr::new(
        127,
        0x80 | (pid >> 8) as u8 & 0x7F,
        pid as u8,
        32 * range + 1 + n,
    )
}

#[test]
fn each_port_is_bound_and_its_function_reports_the_address() {
    let configs = vec![
        DeviceConfig::with_ports(0x10, &[[10, 0, 0, 1], [10, 0, 0, 2]]),
        DeviceConfig::with_ports(0x20, &[[10, 0, 1, 1]]),
    ];
    let fixed = own(2, 8);
    let automatic = PortAddress::FirstFree {
        first: own(1, 0),
        count: 16,
    };
    let backplane = Backplane::udp(
        Verifier::new(),
        configs,
        &[automatic, PortAddress::Fixed(fixed)],
    )
    .expect("bind three loopback addresses");
    assert!(format!("{backplane:?}").contains("udp"));
    let bound = [(0, 1), (0, 2), (1, 1)].map(|(f, p)| backplane.udp_address(f, p).unwrap());
    assert_eq!(bound[0], own(1, 0));
    assert_eq!(bound[1], fixed);
    assert_ne!(
        bound[2], bound[0],
        "ports beyond the list choose for themselves"
    );
    for (i, (f, p)) in [(0usize, 1u8), (0, 2), (1, 1)].into_iter().enumerate() {
        let cfg = backplane.config(f).unwrap();
        assert_eq!(cfg.ports[usize::from(p) - 1].ipv4, bound[i].octets());
        let mac = backplane.with_device(f, |d| d.port_mac(p).unwrap());
        let [a, b, c, d] = bound[i].octets();
        assert_eq!(mac, [0x02, 0x00, a, b, c, d]);
        assert_eq!(backplane.udp_stats(f, p).unwrap().tx_datagrams, 0);
    }
    assert!(
        backplane.with_cluster(|_| ()).is_none(),
        "no cluster to step"
    );
}

#[test]
fn a_threaded_udp_host_builds_and_shuts_down_clean() {
    let config = HostConfig::threaded_udp(
        1,
        vec![DeviceConfig::with_ports(0x30, &[[10, 0, 0, 1]])],
        vec![PortAddress::FirstFree {
            first: own(3, 0),
            count: 16,
        }],
    );
    let host = Host::new(config).unwrap();
    let addr = host.backplane().udp_address(0, 1).unwrap();
    assert_eq!(addr, own(3, 0));
    // The threaded host on FastFabric has no UDP endpoints.
    let plain = Host::new(HostConfig::threaded(
        1,
        vec![DeviceConfig::with_ports(0x40, &[[10, 0, 0, 1]])],
    ))
    .unwrap();
    assert!(plain.backplane().udp_address(0, 1).is_none());
    for h in [&host, &plain] {
        h.shut_down();
        h.verifier().assert_clean();
    }
}

#[test]
fn an_address_another_socket_holds_is_the_hosts_udp_error() {
    let held = own(4, 0);
    let _holder = PortAddress::Fixed(held)
        .bind()
        .expect("bind the address first");
    let config = HostConfig::threaded_udp(
        1,
        vec![DeviceConfig::with_ports(0x50, &[[10, 0, 0, 1]])],
        vec![PortAddress::Fixed(held)],
    );
    match Host::new(config) {
        Err(HostError::Udp(io)) => assert_eq!(io.kind(), std::io::ErrorKind::AddrInUse),
        Err(other) => panic!("a bind failure reported as {other:?}"),
        Ok(_) => panic!("the host bound an address another socket holds"),
    }
}
