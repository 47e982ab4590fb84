//! Scenario: `ibportclient`, the sample kernel client (a ping-pong ULP,
//! `sim_shells::port_client` over `ib-port-client-core`), on the IBAL bus
//! filter's port children of two HCAs with two ports each, over the real
//! miniport. The client on port p of one HCA pairs with the client on
//! port p of the other: they exchange their RC parameters over UD, connect
//! and run checked round trips; in their D0 exit they say goodbye over the
//! fabric while their HCA is still in D0. Every test ends with the host
//! shut down (children removed first: their goodbyes and teardown) and the
//! verifier report empty.
#![cfg(not(windows))]

use std::sync::Arc;

use driver_platform::{RegValue, SystemPowerState};
use hca_miniport_core::init::HcaConfig;
use ib_port_client_core::config::{Config, ConfigRefusal, RECEIVE_DEPTH};
use ib_port_client_core::session::{Counters, Phase};
use sim_hca::device::DeviceConfig;
use sim_hca::fabric::FaultConfig;
use sim_host::host::{Host, HostConfig};
use sim_host::registry::device_parameters_key;
use sim_shells::hca_miniport::MiniportDriver;
use sim_shells::ibal_bus::IbalBusDriver;
use sim_shells::port_client::{PortClientDevice, PortClientDriver};

/// Two HCAs, two ports each; port p of HCA i has the IPv4 address 10.0.i.p.
const HCAS: [u64; 2] = [0x0002_C900_0000_1000, 0x0002_C900_0000_2000];

/// Round trips per connection.
const ROUNDS: u32 = 16;

struct World {
    host: Host,
    clients: Arc<PortClientDriver>,
}

/// The two HCAs' device configurations (addresses as [`HCAS`] says).
fn hca_configs() -> Vec<DeviceConfig> {
    HCAS.iter()
        .enumerate()
        .map(|(i, guid)| {
            let i = i as u8;
            DeviceConfig::with_ports(*guid, &[[10, 0, i, 1], [10, 0, i, 2]])
        })
        .collect()
}

/// The drivers registered on a host built from `config`, booted (not yet
/// settled: a threaded host quiesces instead).
fn booted_world(config: HostConfig) -> World {
    let host = Host::new(config).unwrap();
    let _log = sim_host::samples::register_stand_ins(&host);
    MiniportDriver::register(&host, HcaConfig::default());
    let _filter = IbalBusDriver::register(&host);
    let clients = PortClientDriver::register(&host, ROUNDS);
    host.boot();
    World { host, clients }
}

fn world(seed: u64) -> World {
    world_on(HostConfig::deterministic(seed, hca_configs()))
}

/// A deterministic host built from `config`, booted and settled.
fn world_on(config: HostConfig) -> World {
    let w = booted_world(config);
    settle(&w.host);
    w
}

fn settle(host: &Host) {
    host.scheduler().run_until_idle(1_000_000).unwrap();
    host.pnp().process_bus_relations();
    host.scheduler().run_until_idle(1_000_000).unwrap();
}

impl World {
    /// The client on port `port` of HCA `hca`.
    fn client(&self, hca: usize, port: u8) -> Arc<PortClientDevice> {
        self.clients
            .devices()
            .into_iter()
            .find(|c| {
                c.port_data()
                    .is_some_and(|d| d.ca_guid.get() == HCAS[hca] && d.port.get() == port)
            })
            .expect("a client on that port")
    }

    /// The two clients of port `port`'s pair: (initiator, responder) of
    /// their current connection (the roles may change at a reconnect).
    fn pair(&self, port: u8) -> (Arc<PortClientDevice>, Arc<PortClientDevice>) {
        let (x, y) = (self.client(0, port), self.client(1, port));
        assert!(
            x.is_initiator() ^ y.is_initiator(),
            "port {port}: one initiator; the clients:\n{}",
            describe(self)
        );
        if x.is_initiator() { (x, y) } else { (y, x) }
    }

    fn references(&self) -> usize {
        self.host
            .pnp()
            .driver_references(sim_shells::port_client::SERVICE)
            .unwrap()
            .load(std::sync::atomic::Ordering::Acquire)
    }
}

fn sum(a: Counters, b: Counters) -> Counters {
    Counters {
        rounds: a.rounds + b.rounds,
        pongs_sent: a.pongs_sent + b.pongs_sent,
        bad_payloads: a.bad_payloads + b.bad_payloads,
        bad_datagrams: a.bad_datagrams + b.bad_datagrams,
        connections: a.connections + b.connections,
        goodbyes_acknowledged: a.goodbyes_acknowledged + b.goodbyes_acknowledged,
        goodbyes_answered: a.goodbyes_answered + b.goodbyes_answered,
        goodbye_timeouts: a.goodbye_timeouts + b.goodbye_timeouts,
        connections_lost: a.connections_lost + b.connections_lost,
        hellos_resent: a.hellos_resent + b.hellos_resent,
        duplicates: a.duplicates + b.duplicates,
    }
}

/// Shuts the host down (every client says goodbye and closes) and checks
/// nothing leaked: every AL closed, every reference given back, the
/// verifier empty.
fn finish(w: World) {
    let World { host, clients } = w;
    host.shut_down();
    host.verifier().assert_clean();
    for client in clients.devices() {
        assert_eq!(client.closed(), Some(Ok(())), "{client:?} closed its AL");
        assert_eq!(client.driver_references(), 0);
    }
}

#[test]
fn clients_on_two_hcas_find_their_peers_over_ud_and_run_checked_round_trips() {
    let w = world(41);
    assert_eq!(w.clients.devices().len(), 4, "one client per port child");
    assert_eq!(w.references(), 4, "each open AL holds the driver object");
    for port in [1, 2] {
        let (initiator, responder) = w.pair(port);
        let (i, r) = (initiator.counters(), responder.counters());
        assert_eq!(i.rounds, u64::from(ROUNDS), "port {port}: every round trip");
        assert_eq!(r.pongs_sent, u64::from(ROUNDS));
        assert_eq!(i.bad_payloads + r.bad_payloads, 0, "every byte as sent");
        assert_eq!((i.connections, r.connections), (1, 1));
        assert_eq!(initiator.phase(), Phase::Running);
        assert_eq!(responder.phase(), Phase::Running);
        // Each pair's traffic stayed on its port: the RC messages posted
        // are the pings and pongs.
        let sent =
            |c: &PortClientDevice| c.stats().rc_sent.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(sent(&initiator), u64::from(ROUNDS));
        assert_eq!(sent(&responder), u64::from(ROUNDS));
    }
    // More rounds on a live connection.
    let (initiator, _) = w.pair(1);
    initiator.run_more(5);
    settle(&w.host);
    assert_eq!(initiator.counters().rounds, u64::from(ROUNDS) + 5);
    finish(w);
}

/// Sleeps with rounds in flight; returns the pair counters after resume.
fn sleep_with_traffic_in_flight(w: &World, state: SystemPowerState) {
    let before: Vec<Counters> = [1, 2]
        .map(|port| {
            let (i, r) = w.pair(port);
            sum(i.counters(), r.counters())
        })
        .to_vec();
    // Pings posted and not answered when the sleep starts.
    for port in [1, 2] {
        w.pair(port).0.run_more(1000);
    }
    w.host.pnp().set_system_power(state).unwrap();
    for (k, port) in [1u8, 2].into_iter().enumerate() {
        let (x, y) = (w.client(0, port), w.client(1, port));
        let pair = sum(x.counters(), y.counters());
        // One goodbye per pair, sent by whichever went down first and
        // acknowledged over the fabric by the other, still in D0; the
        // second found the connection closed and had nothing to exchange.
        assert_eq!(
            pair.goodbyes_acknowledged - before[k].goodbyes_acknowledged,
            1,
            "port {port}: the goodbye was answered over the fabric"
        );
        assert_eq!(pair.goodbyes_answered - before[k].goodbyes_answered, 1);
        assert_eq!(pair.goodbye_timeouts, 0, "no wait ran out");
        assert!(
            pair.rounds > before[k].rounds,
            "port {port}: traffic was running"
        );
        // The round in flight drained before the goodbye: every ping was
        // answered and every pong came back.
        assert_eq!(pair.rounds, pair.pongs_sent, "port {port}: nothing lost");
        assert_eq!(pair.bad_payloads, 0);
        assert_eq!((x.phase(), y.phase()), (Phase::Down, Phase::Down));
    }
    w.host.pnp().set_system_power(SystemPowerState::S0).unwrap();
    settle(&w.host);
    for (k, port) in [1u8, 2].into_iter().enumerate() {
        let (x, y) = (w.client(0, port), w.client(1, port));
        let pair = sum(x.counters(), y.counters());
        assert_eq!(
            pair.connections - before[k].connections,
            2,
            "port {port}: reconnected"
        );
        assert_eq!((x.phase(), y.phase()), (Phase::Running, Phase::Running));
        let (initiator, _) = w.pair(port);
        assert!(initiator.counters().rounds >= u64::from(ROUNDS));
        assert_eq!(pair.bad_payloads, 0);
    }
}

#[test]
fn s3_and_s4_with_traffic_in_flight_say_goodbye_over_the_fabric_and_resume() {
    let w = world(42);
    let rounds_at_boot: Vec<u64> = [1, 2].map(|p| w.pair(p).0.counters().rounds).to_vec();
    sleep_with_traffic_in_flight(&w, SystemPowerState::S3);
    // After wake the new connection runs its own rounds.
    for (k, port) in [1u8, 2].into_iter().enumerate() {
        let (x, y) = (w.client(0, port), w.client(1, port));
        assert!(sum(x.counters(), y.counters()).rounds >= rounds_at_boot[k] + u64::from(ROUNDS));
    }
    sleep_with_traffic_in_flight(&w, SystemPowerState::S4);
    finish(w);
}

#[test]
fn query_remove_of_one_hca_closes_its_clients_with_a_goodbye_while_the_other_stays() {
    let w = world(43);
    let hca = w.host.hcas()[0];
    w.host.pnp().query_and_remove(hca).unwrap();
    settle(&w.host);
    for port in [1, 2] {
        let (gone, stays) = (w.client(0, port), w.client(1, port));
        // The removed HCA's children went first: their clients said
        // goodbye (answered) and closed their AL before the HCA left.
        assert_eq!(gone.counters().goodbyes_acknowledged, 1);
        assert_eq!(gone.closed(), Some(Ok(())));
        // The other side tore its connection down and waits for a peer,
        // its AL open and its objects alive.
        assert_eq!(stays.counters().goodbyes_answered, 1);
        assert_eq!(stays.phase(), Phase::PeerClosed);
        assert_eq!(stays.closed(), None);
    }
    assert_eq!(w.references(), 2);
    // The remaining HCA's clients still serve the fabric: a rendezvous
    // entry each, and their UD QPs still receive (none lost).
    assert_eq!(w.clients.rendezvous().endpoints().len(), 2);
    finish(w);
}

#[test]
fn surprise_removal_of_one_hca_under_traffic_leaves_the_other_working() {
    let w = world(44);
    // Remove the HCA of the responders: the initiators, on the other HCA,
    // have a ping in flight to a peer that vanishes without a goodbye.
    let (initiator, responder) = w.pair(1);
    let gone_hca = HCAS
        .iter()
        .position(|g| responder.port_data().unwrap().ca_guid.get() == *g)
        .unwrap();
    for port in [1, 2] {
        let (initiator, responder) = w.pair(port);
        assert_eq!(responder.port_data().unwrap().ca_guid.get(), HCAS[gone_hca]);
        initiator.run_more(1000);
    }
    drop((initiator, responder));
    w.host.pnp().surprise_remove(w.host.hcas()[gone_hca]);
    settle(&w.host);
    for port in [1u8, 2] {
        let (gone, stays) = (w.client(gone_hca, port), w.client(1 - gone_hca, port));
        // The removed HCA's client had no fabric to say goodbye on: it
        // tried nothing, waited for nothing, and still closed its AL
        // (a destroy the vanished device failed was sent again).
        let g = gone.counters();
        assert_eq!((g.goodbyes_acknowledged, g.goodbye_timeouts), (0, 0));
        assert_eq!(gone.closed(), Some(Ok(())));
        // The survivor's ping ran out of retries: the connection is lost,
        // torn down (a new RC QP), and it waits for a peer, AL open.
        let k = stays.counters();
        assert_eq!(k.connections_lost, 1, "port {port}");
        assert_eq!(stays.phase(), Phase::PeerClosed);
        assert_eq!(stays.closed(), None);
        assert_eq!(
            stays
                .stats()
                .refused
                .load(std::sync::atomic::Ordering::Relaxed),
            0
        );
    }
    assert_eq!(w.references(), 2);
    assert_eq!(w.clients.rendezvous().endpoints().len(), 2);
    finish(w);
}

#[test]
fn the_receive_depth_comes_from_the_hardware_key_and_a_malformed_one_is_refused() {
    let w = world(45);
    // The INF's value, written to each child's hardware key at install
    // (also the default; the administrator's value below tells them apart).
    for client in w.clients.devices() {
        let path = w.host.pnp().instance_path(client.node()).unwrap();
        assert_eq!(
            w.host
                .registry()
                .get_value(&device_parameters_key(&path), RECEIVE_DEPTH),
            Some(RegValue::Dword(256))
        );
        assert_eq!(
            client.config(),
            Config {
                receive_depth: 256,
                refused: None
            }
        );
    }
    // An administrator sets 16 on one client of the port-1 pair and a
    // string on the other; each stack is stopped and restarted (rebalance).
    let (a, b) = (w.client(0, 1), w.client(1, 1));
    for (client, value) in [
        (&a, RegValue::Dword(16)),
        (&b, RegValue::String("lots".into())),
    ] {
        let path = w.host.pnp().instance_path(client.node()).unwrap();
        w.host
            .registry()
            .set_value(&device_parameters_key(&path), RECEIVE_DEPTH, value)
            .unwrap();
        w.host.pnp().stop(client.node()).unwrap();
        settle(&w.host);
        w.host.pnp().restart(client.node());
        settle(&w.host);
    }
    assert_eq!(
        a.config(),
        Config {
            receive_depth: 16,
            refused: None
        }
    );
    assert_eq!(
        b.config(),
        Config {
            receive_depth: 256,
            refused: Some(ConfigRefusal::ReceiveDepthNotDword)
        }
    );
    // Each stop said goodbye, each restart said hello: the pair is
    // connected again and runs its rounds.
    let (initiator, _) = w.pair(1);
    assert_eq!(initiator.phase(), Phase::Running);
    let before = initiator.counters().rounds;
    initiator.run_more(3);
    settle(&w.host);
    assert_eq!(initiator.counters().rounds, before + 3);
    assert_eq!(w.references(), 4);
    finish(w);
}

/// Quiesces the threaded host until `done` holds (the fabric and the
/// device run on their own threads, so one quiescent moment may come
/// between two packets of a round), at most about ten seconds.
fn quiesce_until(w: &World, what: &str, done: impl Fn() -> bool) {
    for _ in 0..2000 {
        w.host.scheduler().quiesce().unwrap();
        w.host.pnp().process_bus_relations();
        if done() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    panic!("{what}: not reached; the clients:\n{}", describe(w));
}

/// Each client's port, phase, role and counts.
fn describe(w: &World) -> String {
    w.clients
        .devices()
        .iter()
        .map(|c| {
            format!(
                "{:?} {:?} init={} {:?} {:?}\n",
                c.port_data().map(|p| (p.ca_guid, p.port)),
                c.phase(),
                c.is_initiator(),
                c.counters(),
                c.stats()
            )
        })
        .collect()
}

/// On the threaded host (DPCs, completions and the fabric on worker
/// threads, racing the starts and the D0 exits): the pairs connect, run
/// their rounds, and S3 with rounds in flight still gives one acknowledged
/// goodbye per pair and loses no round.
#[test]
fn pairs_run_and_sleep_on_the_threaded_host_too() {
    for _ in 0..3 {
        let w = booted_world(HostConfig::threaded(2, hca_configs()));
        let rounds_done = |port: u8| {
            let (x, y) = (w.client(0, port), w.client(1, port));
            let pair = sum(x.counters(), y.counters());
            (x.is_initiator() ^ y.is_initiator())
                && pair.rounds == u64::from(ROUNDS)
                && pair.pongs_sent == u64::from(ROUNDS)
        };
        quiesce_until(&w, "every round at boot", || {
            w.clients.devices().len() == 4 && rounds_done(1) && rounds_done(2)
        });
        for port in [1, 2] {
            w.pair(port).0.run_more(1000);
        }
        w.host.pnp().set_system_power(SystemPowerState::S3).unwrap();
        for port in [1u8, 2] {
            let pair = sum(w.client(0, port).counters(), w.client(1, port).counters());
            assert_eq!(pair.goodbyes_acknowledged, 1, "port {port}");
            assert_eq!(pair.goodbyes_answered, 1);
            assert_eq!(pair.goodbye_timeouts, 0);
            assert_eq!(pair.rounds, pair.pongs_sent, "no round lost");
        }
        w.host.pnp().set_system_power(SystemPowerState::S0).unwrap();
        quiesce_until(&w, "reconnected after wake", || {
            [1u8, 2].into_iter().all(|port| {
                let (x, y) = (w.client(0, port), w.client(1, port));
                let pair = sum(x.counters(), y.counters());
                pair.connections == 4 && x.is_initiator() ^ y.is_initiator()
            })
        });
        finish(w);
    }
}

/// A lossy fabric (a tenth of the frames dropped, some duplicated): lost
/// hellos and answers are sent again, duplicates answered without a
/// reconnect, RC recovers by itself; a goodbye or its answer may be lost
/// (the wait runs out, bounded) and the peer that missed it reconnects to
/// the sleeper's new QP when it says hello after wake.
#[test]
fn pairs_connect_sleep_and_reconnect_over_a_lossy_fabric() {
    let mut seen = Counters::default();
    for seed in [51, 52, 53, 54] {
        let mut config = HostConfig::deterministic(seed, hca_configs());
        config.fabric.faults = FaultConfig {
            drop_ppm: 100_000,
            duplicate_ppm: 50_000,
            ..FaultConfig::default()
        };
        let w = world_on(config);
        for port in [1u8, 2] {
            let (initiator, responder) = w.pair(port);
            assert_eq!(
                initiator.counters().rounds,
                u64::from(ROUNDS),
                "seed {seed}"
            );
            assert_eq!(responder.phase(), Phase::Running);
        }
        for state in [SystemPowerState::S3, SystemPowerState::S0] {
            w.host.pnp().set_system_power(state).unwrap();
            settle(&w.host);
        }
        for port in [1u8, 2] {
            let (initiator, responder) = w.pair(port);
            let pair = sum(initiator.counters(), responder.counters());
            assert_eq!(pair.bad_payloads, 0);
            assert!(
                initiator.counters().rounds >= u64::from(ROUNDS),
                "seed {seed} port {port}: rounds after wake; the clients:\n{}",
                describe(&w)
            );
            assert_eq!(responder.phase(), Phase::Running);
        }
        for client in w.clients.devices() {
            seen = sum(seen, client.counters());
        }
        finish(w);
    }
    // The losses were real: hellos sent again, duplicates answered, a
    // goodbye wait that ran out (these seeds have each).
    assert!(seen.hellos_resent > 0 && seen.duplicates > 0 && seen.goodbye_timeouts > 0);
}

/// One client's stack is stopped and restarted (rebalance) on a fabric that
/// loses its goodbye: its peer, still up, finds the connection lost (its
/// pong runs out of retries) and replaces its RC QP, and the restarted
/// client's hello may arrive while that replacement is under way. The
/// connect waits for the new QP: nothing is refused, the pair reconnects
/// and runs its rounds.
#[test]
fn a_peer_restarted_without_a_goodbye_is_reconnected_on_a_new_qp() {
    // Seed and loss rate chosen so that the goodbye is lost.
    let mut config = HostConfig::deterministic(2, hca_configs());
    config.fabric.faults = FaultConfig {
        drop_ppm: 300_000,
        ..FaultConfig::default()
    };
    let w = world_on(config);
    let (a, b) = (w.client(0, 1), w.client(1, 1));
    w.host.pnp().stop(a.node()).unwrap();
    settle(&w.host);
    assert_eq!(a.counters().goodbye_timeouts, 1, "the goodbye was lost");
    assert_eq!(b.counters().goodbyes_answered, 0);
    w.host.pnp().restart(a.node());
    settle(&w.host);
    let refused =
        |c: &PortClientDevice| c.stats().refused.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(
        (refused(&a), refused(&b)),
        (0, 0),
        "nothing refused:\n{}",
        describe(&w)
    );
    assert_eq!(b.counters().connections, 2);
    let (initiator, _) = w.pair(1);
    assert_eq!(initiator.phase(), Phase::Running);
    let before = initiator.counters().rounds;
    initiator.run_more(3);
    settle(&w.host);
    assert_eq!(initiator.counters().rounds, before + 3);
    finish(w);
}

/// `n` HCAs of two ports; port p of HCA i has the address 10.0.i.p.
fn n_hca_configs(n: usize) -> Vec<DeviceConfig> {
    (0..n)
        .map(|i| {
            let guid = 0x0002_C900_0000_1000 + 0x1000 * i as u64;
            let i = i as u8;
            DeviceConfig::with_ports(guid, &[[10, 0, i, 1], [10, 0, i, 2]])
        })
        .collect()
}

/// The client on `port` of the CA `guid`.
fn client_of(w: &World, guid: u64, port: u8) -> Arc<PortClientDevice> {
    w.clients
        .devices()
        .into_iter()
        .find(|c| {
            c.port_data()
                .is_some_and(|d| d.ca_guid.get() == guid && d.port.get() == port)
        })
        .expect("a client on that port")
}

#[test]
fn three_hcas_pair_deterministically_and_every_pair_says_goodbye_over_the_fabric() {
    let configs = n_hca_configs(3);
    let guids: Vec<u64> = configs.iter().map(|c| c.node_guid).collect();
    let host = Host::new(HostConfig::deterministic(45, configs)).unwrap();
    let _log = sim_host::samples::register_stand_ins(&host);
    MiniportDriver::register(&host, HcaConfig::default());
    let _filter = IbalBusDriver::register(&host);
    let clients = PortClientDriver::register(&host, ROUNDS);
    clients.pair_cas(&guids);
    host.boot();
    let w = World { host, clients };
    settle(&w.host);
    // HCA 0 with HCA 1 port by port; the odd last HCA's two ports with
    // each other.
    let pairs = [
        ((guids[0], 1), (guids[1], 1)),
        ((guids[0], 2), (guids[1], 2)),
        ((guids[2], 1), (guids[2], 2)),
    ];
    let pair_sum = |w: &World| -> Vec<Counters> {
        pairs
            .iter()
            .map(|&(a, b)| {
                sum(
                    client_of(w, a.0, a.1).counters(),
                    client_of(w, b.0, b.1).counters(),
                )
            })
            .collect()
    };
    for (k, &(a, b)) in pairs.iter().enumerate() {
        let (x, y) = (client_of(&w, a.0, a.1), client_of(&w, b.0, b.1));
        assert!(
            x.is_initiator() ^ y.is_initiator(),
            "pair {k}: one initiator\n{}",
            describe(&w)
        );
        assert_eq!(
            (x.phase(), y.phase()),
            (Phase::Running, Phase::Running),
            "pair {k}"
        );
        let c = sum(x.counters(), y.counters());
        assert_eq!(
            (c.rounds, c.pongs_sent),
            (u64::from(ROUNDS), u64::from(ROUNDS)),
            "pair {k}"
        );
        assert_eq!(
            (c.connections, c.connections_lost),
            (2, 0),
            "pair {k}: one connection each"
        );
        if x.is_initiator() {
            x.run_more(1000);
        } else {
            y.run_more(1000);
        }
    }
    let before = pair_sum(&w);
    w.host.pnp().set_system_power(SystemPowerState::S3).unwrap();
    for (k, (now, before)) in pair_sum(&w).iter().zip(&before).enumerate() {
        // Each pair's goodbye reached its own peer and was answered.
        assert_eq!(
            now.goodbyes_acknowledged - before.goodbyes_acknowledged,
            1,
            "pair {k}"
        );
        assert_eq!(
            now.goodbyes_answered - before.goodbyes_answered,
            1,
            "pair {k}"
        );
        assert_eq!(now.goodbye_timeouts, 0, "pair {k}: no wait ran out");
        assert_eq!(now.rounds, now.pongs_sent, "pair {k}: no round lost");
    }
    w.host.pnp().set_system_power(SystemPowerState::S0).unwrap();
    settle(&w.host);
    for (k, (now, before)) in pair_sum(&w).iter().zip(&before).enumerate() {
        assert_eq!(
            now.connections - before.connections,
            2,
            "pair {k}: reconnected"
        );
        assert_eq!(now.bad_payloads, 0);
    }
    finish(w);
}
