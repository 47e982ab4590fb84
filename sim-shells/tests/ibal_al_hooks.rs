//! The bus filter's last access-layer hooks (`sim_shells::ibal_bus`,
//! docs/ibal-bus.md): after a port event the filter re-queries the CA's
//! ports and tells every open client what changed in a port's tables
//! (`AccessLayer::port_changed`: a P_Key table change as `PkeyChange`).
//! Over the real miniport on one simulated HCA with two ports; every test
//! ends with the host shut down and the verifier report empty.
//!
//! The other hook, `AccessLayer::destroy_orphans` at release-hardware, has
//! no test here: an orphan needs the CA to refuse a destroy the AL sends
//! at a client's close, and neither the miniport nor the simulated HCA
//! refuses one the AL's own dependency order allows (each refusal they
//! have, a PD or CQ still in use, the AL prevents first). The core's
//! `access_layer_close` tests cover what `destroy_orphans` does.
#![cfg(not(windows))]

mod support;

use std::sync::{Arc, Mutex};

use hca_miniport_core::cmd::Command;
use hca_prm::cmd::{Opcode, port_table_in_mod};
use ib_types::event::{AsyncEventCode, AsyncEventRecord};
use ib_types::scalars::PortNum;
use sim_host::host::HostConfig;
use support::{HCAS, World, hca_configs_of, lock, settle, world_on};

/// One HCA (the first of [`HCAS`]) with two ports, a port client on each.
fn world(seed: u64) -> World {
    world_on(HostConfig::deterministic(
        seed,
        hca_configs_of(&HCAS[..1], 0),
    ))
}

/// What the tests do to the one HCA (through the miniport the world keeps).
impl World {
    /// Runs `f` on the simulated HCA (link control), then lets the
    /// events it raised run.
    fn with_hca(&self, f: impl FnOnce(&mut sim_hca::device::Device)) {
        let device = self.miniport.devices()[0].clone();
        device
            .function()
            .expect("the HCA's function")
            .with_device(f);
        settle(&self.host);
    }

    /// The port's link goes down and comes back: PortDown, PortActive.
    fn bounce_link(&self, port: u8) {
        self.with_hca(|d| d.set_link(port, false));
        self.with_hca(|d| d.set_link(port, true));
    }

    /// Entry `index` of port `port`'s P_Key table becomes `pkey`, by the
    /// miniport's own firmware command (`SET_PKEY`, PRM; what a subnet
    /// manager agent's update does): the CA raises no event for it.
    fn set_pkey(&self, port: u8, index: u16, pkey: u16) {
        let hca = self.miniport.devices()[0].hca().expect("started");
        let done = Arc::new(Mutex::new(None));
        let out = done.clone();
        hca.submit(
            Command::new(Opcode::SetPkey, port_table_in_mod(port, index))
                .with_immediate(u64::from(pkey)),
            Box::new(move |r| *lock(&out) = Some(r.is_ok())),
        );
        settle(&self.host);
        assert_eq!(lock(&done).take(), Some(true), "SET_PKEY done");
    }
}

fn port_event(code: AsyncEventCode, port: u8) -> AsyncEventRecord {
    AsyncEventRecord::new(code, 0, Some(PortNum::new(port).unwrap()), 0).unwrap()
}

/// Shuts the host down: every client closed its AL cleanly, and the
/// verifier saw nothing wrong.
fn finish(w: World) {
    w.host.shut_down();
    for client in lock(&w.clients.devices).iter() {
        assert_eq!(*lock(&client.closed), Some(Ok(())));
    }
    w.host.verifier().assert_clean();
}

/// A P_Key table change the CA raised no event for reaches every client
/// as `PkeyChange` once the port's next event has the filter re-query it;
/// a port event with the tables unchanged tells nothing more.
#[test]
fn a_pkey_table_change_reaches_every_client_after_the_ports_next_event() {
    let w = world(41);
    let (one, two) = (w.client(0, 1), w.client(0, 2));
    assert!(lock(&one.recorder.events).is_empty());

    // Unchanged tables: the CA's own events only.
    w.bounce_link(2);
    let bounced = [
        port_event(AsyncEventCode::PortDown, 2),
        port_event(AsyncEventCode::PortActive, 2),
    ];
    for client in [&one, &two] {
        assert_eq!(*lock(&client.recorder.events), bounced);
    }

    // Port 1's P_Key table changes silently; its next PortActive has the
    // filter find it.
    w.set_pkey(1, 1, 0x8001);
    for client in [&one, &two] {
        assert_eq!(*lock(&client.recorder.events), bounced, "nothing yet");
    }
    w.bounce_link(1);
    let mut expected = bounced.to_vec();
    expected.extend([
        port_event(AsyncEventCode::PortDown, 1),
        port_event(AsyncEventCode::PortActive, 1),
        port_event(AsyncEventCode::PkeyChange, 1),
    ]);
    for client in [&one, &two] {
        assert_eq!(*lock(&client.recorder.events), expected);
    }

    // Known now: another bounce tells no change again.
    w.bounce_link(1);
    expected.extend([
        port_event(AsyncEventCode::PortDown, 1),
        port_event(AsyncEventCode::PortActive, 1),
    ]);
    assert_eq!(*lock(&one.recorder.events), expected);
    finish(w);
}
