//! Scenario: the seed's old situation, side by side with the port
//! children (docs/ibal-bus.md "The root-enumerated client (the old way)").
//! A root-enumerated kernel client (`sim_shells::legacy_client`, service
//! `iblegacyclient` of `inf/ib-legacy-client.inf`) finds both HCAs of the
//! machine through `GUID_IB_AL_DEVICE_INTERFACE`, opens a remote I/O
//! target on each, gets the AL interface over the HCA's stack, opens the
//! AL and connects its two links with RC over the fabric. Nothing orders
//! its power IRPs against the HCAs': the tests pick the order
//! (`sim_host::power::PowerOrder`) and show what its shutdown exchange in
//! its own D0 exit can and cannot do, that the stack never crashes it, and
//! how it follows an HCA's removal through target-device-change
//! notifications. Every test ends with the host shut down and the
//! verifier report empty.
#![cfg(not(windows))]

mod support;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use driver_platform::{DevicePowerState, SystemPowerState};
use hca_miniport_core::init::HcaConfig;
use ib_types::event::AsyncEventCode;
use ib_types::interface::{GUID_IB_AL_DEVICE_INTERFACE, GUID_IB_AL_INTERFACE};
use ib_types::ioctl::{QueryCa, decode_response};
use ib_types::status::IbStatus;
use ib_types::wc::WcStatus;
use sim_host::host::{Host, HostConfig};
use sim_host::io_target::IoTargetState;
use sim_host::pnp::DevNodeId;
use sim_host::power::PowerOrder;
use sim_host::verifier::ViolationKind;
use sim_shells::hca_miniport::MiniportDriver;
use sim_shells::ibal_bus::IbalBusDriver;
use sim_shells::legacy_client::{
    Goodbye, HcaLink, LegacyClient, LegacyClientDriver, PORT_CLIENT_SERVICE, SERVICE, connect,
};

use support::{hca_configs_of, register_stack, settle};

const HCAS: [u64; 2] = [0x0002_C900_0000_3000, 0x0002_C900_0000_4000];

struct World {
    host: Host,
    driver: Arc<LegacyClientDriver>,
    /// The root-enumerated client devices.
    clients: Vec<DevNodeId>,
}

/// Two HCAs with two ports each; `clients` legacy client devices, added
/// after boot (the HCAs' interfaces exist when they start) or, with
/// `before_boot`, before it (they learn of the HCAs by interface
/// arrival).
fn world(seed: u64, clients: u32, before_boot: bool) -> World {
    let configs = hca_configs_of(&HCAS, 0);
    let host = Host::new(HostConfig::deterministic(seed, configs)).unwrap();
    register_stack(&host);
    let driver = LegacyClientDriver::register(&host);
    let mut nodes = Vec::new();
    if before_boot {
        nodes = (0..clients)
            .map(|i| LegacyClientDriver::install(&host, i))
            .collect();
    }
    host.boot();
    settle(&host);
    // The PnP manager's notification thread.
    driver.interface_events(&host.pnp().take_interface_events());
    if !before_boot {
        nodes = (0..clients)
            .map(|i| LegacyClientDriver::install(&host, i))
            .collect();
        settle(&host);
    }
    World {
        host,
        driver,
        clients: nodes,
    }
}

impl World {
    fn client(&self, i: usize) -> Arc<LegacyClient> {
        self.driver
            .devices()
            .into_iter()
            .find(|c| c.node() == self.clients[i])
            .expect("the client device")
    }

    /// Client `i`'s two links (HCA 0's, HCA 1's), connected.
    fn connected(&self, i: usize) -> (Arc<LegacyClient>, Arc<HcaLink>, Arc<HcaLink>) {
        let client = self.client(i);
        let hcas = self.host.hcas();
        let a = client.link(hcas[0]).expect("a link to HCA 0");
        let b = client.link(hcas[1]).expect("a link to HCA 1");
        connect(&a, &b).unwrap();
        (client, a, b)
    }

    fn references(&self) -> usize {
        self.host
            .pnp()
            .driver_references(SERVICE)
            .unwrap()
            .load(Ordering::Acquire)
    }

    /// Removes the client devices, then the machine; the verifier must be
    /// clean and no reference left.
    fn finish(self) {
        // Each link up holds one AL interface reference against its HCA
        // (besides the filter's own CI reference): all given back.
        let hcas = self.host.hcas();
        let held: Vec<(usize, usize)> = hcas
            .iter()
            .map(|&hca| {
                let links = self
                    .driver
                    .devices()
                    .iter()
                    .filter(|c| c.link(hca).is_some_and(|l| l.is_up()))
                    .count();
                (self.host.pnp().interface_references(hca), links)
            })
            .collect();
        for &node in &self.clients {
            if self.host.pnp().state(node) == Some(sim_host::pnp::PnpState::Started) {
                self.host.pnp().query_and_remove(node).unwrap();
            }
        }
        settle(&self.host);
        assert_eq!(self.references(), 0, "the AL let go of every client");
        for (&hca, (before, links)) in hcas.iter().zip(held) {
            if self.host.pnp().state(hca) == Some(sim_host::pnp::PnpState::Started) {
                assert_eq!(self.host.pnp().interface_references(hca), before - links);
            }
        }
        self.host.shut_down();
        self.host.verifier().assert_clean();
    }
}

#[test]
fn a_root_enumerated_client_finds_each_hca_by_its_interface_and_runs_traffic() {
    let w = world(31, 1, true);
    let hcas = w.host.hcas();
    // Both HCAs' interfaces are enabled, and the client linked to each
    // from the arrival notifications.
    assert_eq!(
        w.host
            .pnp()
            .devices_with_interface(GUID_IB_AL_DEVICE_INTERFACE),
        hcas
    );
    let (_client, a, b) = w.connected(0);
    for (link, hca) in [(&a, 0), (&b, 1)] {
        assert_eq!(link.target_state(), Some(IoTargetState::Opened));
        let port = link.port().expect("the AL interface's data");
        assert_eq!(port.ca_guid.get(), HCAS[hca]);
        assert_eq!(
            port.port.get(),
            1,
            "the HCA stack answers for its first port"
        );
    }
    assert_eq!(w.references(), 2, "one open AL client per link");

    // Traffic both ways, bytes checked.
    for (from, to, text) in [(&a, &b, &b"over the fabric"[..]), (&b, &a, b"and back")] {
        assert_eq!(from.send_bytes(text), Goodbye::Acknowledged);
        settle(&w.host);
        let (got, errors) = to.received();
        assert_eq!(got, vec![text.to_vec()]);
        assert!(errors.is_empty());
    }
    w.finish();
}

#[test]
fn the_hca_stack_answers_the_al_interface_only_from_al_interface_version_on() {
    let w = world(32, 0, false);
    let hca = w.host.hcas()[0];
    let too_old = w
        .host
        .pnp()
        .query_interface(hca, &GUID_IB_AL_INTERFACE, 0x0001);
    assert!(too_old.is_none(), "below 1.0 nobody answers");
    let answered = w
        .host
        .pnp()
        .query_interface(hca, &GUID_IB_AL_INTERFACE, 0x0105)
        .expect("the filter answers");
    assert_eq!(answered.version(), 0x0100, "the closest not above 1.5");
    answered.dereference();
    w.finish();
}

/// The seed's problem: the HCAs leave D0 before the client (a valid
/// order: nothing relates them). The goodbye cannot reach the fabric; the
/// drain request is held; the client's bounded waits let the sleep
/// complete; after resume the held request completes, with an error (the
/// connection did not survive), and a request issued during the sleep
/// completes too.
#[test]
fn with_the_hcas_powered_down_first_the_shutdown_exchange_cannot_reach_the_fabric() {
    let w = world(33, 1, false);
    w.host.pnp().set_power_order(PowerOrder::EarliestRootFirst);
    let (client, a, b) = w.connected(0);
    let hcas = w.host.hcas();

    w.host
        .pnp()
        .set_system_power(SystemPowerState::S3)
        .expect("the sleep completes");
    for node in hcas.iter().copied().chain([client.node()]) {
        assert_eq!(w.host.pnp().power(node), Some(DevicePowerState::D3));
    }
    // Each side tried: both HCAs were already below D0.
    let reports = client.shutdown_reports();
    assert_eq!(reports.len(), 2);
    for (report, hca) in reports.iter().zip(&hcas) {
        assert_eq!(report.hca, *hca);
        assert_eq!(
            report.goodbye,
            Goodbye::Refused(IbStatus::InvalidState),
            "the HCA below D0 refuses the post"
        );
        assert!(
            !report.drained_in_time,
            "the drain is held, the wait bounded"
        );
        assert!(report.drain_result().is_none());
        assert_eq!(
            report.receive_errors,
            [WcStatus::WrFlushErr],
            "the HCA flushed the connection's receive as it left D0"
        );
    }

    // A client that keeps issuing during the sleep: held, never crashed.
    let during_sleep = client.issue_query_ca(&a).unwrap();
    settle(&w.host);
    assert!(during_sleep.completion().is_none(), "held below D0");

    w.host.pnp().set_system_power(SystemPowerState::S0).unwrap();
    settle(&w.host);
    // The held drain ran after D0 entry: the connected QP came back in
    // ERR (its peer is gone as far as the QP knows), so SQD is refused.
    for report in &reports {
        let drained = report.drain_result().expect("completed after resume");
        assert!(drained.is_err(), "{drained:?}");
    }
    let query = during_sleep.completion().expect("completed after resume");
    assert!(query.status.is_success());
    let len = query.information as usize;
    assert_eq!(
        decode_response::<QueryCa>(&query.output[..len])
            .unwrap()
            .status,
        IbStatus::Success
    );
    // The goodbye never reached the peer, then or later.
    let (got, errors) = b.received();
    assert!(got.is_empty() && errors.is_empty(), "{got:?} {errors:?}");
    assert!(
        a.async_events()
            .iter()
            .any(|e| e.code == AsyncEventCode::QpFatal),
        "the client is told its QP broke"
    );
    w.finish();
}

/// The lucky order (the client, enumerated after the HCAs, leaves D0
/// first: what the enumeration order does). The same exchange
/// reaches the peer: what the port children get by construction.
#[test]
fn with_the_client_powered_down_first_the_same_exchange_succeeds() {
    let w = world(34, 1, false);
    w.host.pnp().set_power_order(PowerOrder::Enumeration);
    let (client, _a, _b) = w.connected(0);
    w.host.pnp().set_system_power(SystemPowerState::S3).unwrap();
    let reports = client.shutdown_reports();
    assert_eq!(reports.len(), 2);
    assert_eq!(reports[0].goodbye, Goodbye::Acknowledged);
    assert!(reports[0].drained_in_time);
    assert_eq!(reports[0].drain_result(), Some(Ok(())));
    assert_eq!(
        reports[1].goodbye,
        Goodbye::AlreadyClosed,
        "the peer side got the goodbye"
    );
    w.host.pnp().set_system_power(SystemPowerState::S0).unwrap();
    settle(&w.host);
    w.finish();
}

/// Under the seeded order the client's fate is the draw's: some seeds
/// power the HCA down first and the goodbye is refused, others not. The
/// sleep completes and the verifier stays clean either way.
#[test]
fn under_seeded_orders_the_goodbye_depends_on_the_draw() {
    let mut outcomes = std::collections::BTreeSet::new();
    for seed in 0..6 {
        let w = world(40 + seed, 1, false);
        w.host.pnp().set_power_order(PowerOrder::Seeded(seed));
        let (client, _a, _b) = w.connected(0);
        w.host.pnp().set_system_power(SystemPowerState::S4).unwrap();
        w.host.pnp().set_system_power(SystemPowerState::S0).unwrap();
        settle(&w.host);
        let report = client.shutdown_reports().swap_remove(0);
        assert!(report.drain_result().is_some(), "the drain completed");
        outcomes.insert(report.goodbye == Goodbye::Acknowledged);
        w.finish();
    }
    assert_eq!(outcomes.len(), 2, "both fates occur: {outcomes:?}");
}

/// Query-remove of an HCA: a client that cannot let go vetoes; one that
/// agreed comes back when the removal is cancelled. Once nobody refuses,
/// the HCA goes and the links to it with it; the other HCA's link keeps
/// working.
#[test]
fn hca_query_remove_lets_go_and_a_cancelled_removal_comes_back() {
    let w = world(35, 2, false);
    let hcas = w.host.hcas();
    let (first, second) = (w.client(0), w.client(1));
    second.refuse_removal(true);
    let veto = w.host.pnp().query_and_remove(hcas[0]).unwrap_err();
    assert!(veto.service.contains(SERVICE), "{veto}");
    let link = first.link(hcas[0]).unwrap();
    assert_eq!(link.let_go_count(), 1, "it let go at the query");
    assert_eq!(link.came_back_count(), 1, "and came back at the cancel");
    assert!(link.is_up());
    assert_eq!(link.target_state(), Some(IoTargetState::Opened));
    assert!(second.link(hcas[0]).unwrap().is_up(), "the refuser held on");

    second.refuse_removal(false);
    w.host.pnp().query_and_remove(hcas[0]).unwrap();
    settle(&w.host);
    for client in [&first, &second] {
        assert!(client.link(hcas[0]).is_none(), "the link to HCA 0 is gone");
        assert!(client.link(hcas[1]).unwrap().is_up());
    }
    assert_eq!(w.references(), 2, "only the HCA 1 links hold the AL");
    let query = first.issue_query_ca(&first.link(hcas[1]).unwrap()).unwrap();
    settle(&w.host);
    assert!(query.completion().unwrap().status.is_success());
    w.finish();
}

/// Surprise removal of an HCA: the remove-complete notification makes the
/// client let go and close its target, which lets the removal finish. What
/// it cannot do: it hears of the removal only after the HCA's stack
/// released its hardware, so the common buffer it took from the HCA's DMA
/// adapter is still allocated when the adapter is put back, a DMA leak (a
/// port child is removed before its HCA and frees in time).
#[test]
fn a_surprise_removed_hca_is_let_go_through_remove_complete_too_late_for_its_dma_buffer() {
    let w = world(36, 1, false);
    let hcas = w.host.hcas();
    let client = w.client(0);
    let bus = client
        .link(hcas[1])
        .and_then(|l| l.buffer_bus_address())
        .unwrap();
    w.host.pnp().surprise_remove(hcas[1]);
    settle(&w.host);
    assert!(client.link(hcas[1]).is_none(), "the link is let go");
    assert!(client.link(hcas[0]).unwrap().is_up());
    assert_eq!(w.references(), 1, "only the HCA 0 link holds the AL");
    let violations = w.host.verifier().take();
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert!(
        matches!(&violations[0].kind, ViolationKind::DmaLeak { what }
            if what.contains(&format!("{bus:#x}"))),
        "the client's buffer, still allocated when the adapter went: {violations:?}"
    );
    w.finish();
}

/// The same client bound the new way, as the port children's function
/// driver: its devices link to their parents through their own stacks.
/// Children leave D0 before their HCA, so whichever side of the
/// connection goes first says goodbye over the fabric and the other finds
/// it closed: under the order that defeats the root-enumerated client and
/// under seeded ones alike.
#[test]
fn the_same_client_as_a_port_child_says_goodbye_whatever_the_order() {
    let orders = [
        PowerOrder::EarliestRootFirst,
        PowerOrder::Seeded(1),
        PowerOrder::Seeded(2),
        PowerOrder::Enumeration,
    ];
    for (seed, order) in (50..).zip(orders) {
        let configs = hca_configs_of(&HCAS, 0);
        let host = Host::new(HostConfig::deterministic(seed, configs)).unwrap();
        let _log = sim_host::samples::register_stand_ins(&host);
        MiniportDriver::register(&host, HcaConfig::default());
        IbalBusDriver::register(&host);
        let driver = LegacyClientDriver::register_as_port_client(&host);
        host.boot();
        settle(&host);
        host.pnp().set_power_order(order);
        let on_port = |hca: usize| -> (Arc<LegacyClient>, Arc<HcaLink>) {
            driver
                .devices()
                .into_iter()
                .find_map(|c| {
                    let link = c.links().pop()?;
                    let port = link.port()?;
                    (port.ca_guid.get() == HCAS[hca] && port.port.get() == 1).then_some((c, link))
                })
                .expect("a client on port 1")
        };
        assert_eq!(driver.devices().len(), 4, "one per port of each HCA");
        let ((x, a), (y, b)) = (on_port(0), on_port(1));
        connect(&a, &b).unwrap();
        assert_eq!(a.send_bytes(b"hello"), Goodbye::Acknowledged);

        host.pnp().set_system_power(SystemPowerState::S3).unwrap();
        let mut goodbyes: Vec<Goodbye> = [&x, &y]
            .iter()
            .flat_map(|c| c.shutdown_reports())
            .map(|r| r.goodbye)
            .collect();
        goodbyes.sort_by_key(|g| *g == Goodbye::AlreadyClosed);
        assert_eq!(
            goodbyes,
            [Goodbye::Acknowledged, Goodbye::AlreadyClosed],
            "{order:?}"
        );
        host.pnp().set_system_power(SystemPowerState::S0).unwrap();
        settle(&host);
        host.shut_down();
        host.verifier().assert_clean();
        let references = host.pnp().driver_references(PORT_CLIENT_SERVICE).unwrap();
        assert_eq!(references.load(Ordering::Acquire), 0, "every AL closed");
    }
}
