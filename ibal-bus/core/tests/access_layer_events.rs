//! Notifications of the access layer beyond the CA's own events: P_Key and
//! GID table changes the shell learns by re-querying a port
//! (`AccessLayer::port_changed`), delivered as port events to every open
//! client, and nothing when nothing changed.

use ib_types::event::{AsyncEventCode, AsyncEventRecord};
use ib_types::scalars::{Gid, PKey, PortGuid, PortNum};
use ibal_bus_core::ci::PortIdentity;

mod al_support;
use al_support::*;

fn port(pkeys: &[u16], prefix: u64) -> PortIdentity {
    let guid = 0x0002_C903_0000_0101;
    PortIdentity {
        port_num: PortNum::new(2).unwrap(),
        port_guid: PortGuid::new(guid),
        pkeys: pkeys.iter().map(|raw| PKey::new(*raw)).collect(),
        gids: vec![Gid::from_parts(prefix, guid), Gid::ZERO],
    }
}

fn port_event(code: AsyncEventCode) -> AsyncEventRecord {
    AsyncEventRecord::new(code, 0, Some(PortNum::new(2).unwrap()), 0).unwrap()
}

#[test]
fn table_changes_reach_every_open_client_as_port_events() {
    let f = Fixture::new();
    let a = f.open();
    let b = f.open();
    let before = port(&[0xFFFF], Gid::LINK_LOCAL_PREFIX);

    // Nothing changed: nothing told.
    f.al.port_changed(&before, &before.clone());
    assert!(a.events.events.lock().unwrap().is_empty());

    // The SM added a partition.
    let pkey_added = port(&[0xFFFF, 0x8001], Gid::LINK_LOCAL_PREFIX);
    f.al.port_changed(&before, &pkey_added);
    // The SM assigned a subnet prefix: GID 0 changed.
    let prefix_set = port(&[0xFFFF, 0x8001], 0xFEC0_0000_0000_0001);
    f.al.port_changed(&pkey_added, &prefix_set);
    // Both at once.
    f.al.port_changed(&prefix_set, &before);

    let expected = vec![
        port_event(AsyncEventCode::PkeyChange),
        port_event(AsyncEventCode::GidChange),
        port_event(AsyncEventCode::PkeyChange),
        port_event(AsyncEventCode::GidChange),
    ];
    assert_eq!(*a.events.events.lock().unwrap(), expected);
    assert_eq!(*b.events.events.lock().unwrap(), expected);
}
