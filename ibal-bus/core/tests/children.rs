//! The child list and the children it gives each port: the IPoIB default,
//! a custom list, refusals with their reasons, stable instance IDs, and
//! entries added and removed at runtime.

#[path = "fuzz_props/child_list.rs"]
#[allow(
    dead_code,
    reason = "the property's check and seeds are for the fuzz twin"
)]
mod property;

use driver_platform::RegValue;
use ib_types::scalars::{NodeGuid, PKey, PortGuid, PortNum};
use ibal_bus_core::children::{
    ChildEntry, ChildSet, EntryError, LIST_VALUE, MAX_ENTRIES, instance_id, port_children,
    read_child_list,
};
use ibal_bus_core::ci::PortIdentity;
use property::MapRegistry;

fn multi(items: &[&str]) -> RegValue {
    RegValue::MultiString(items.iter().map(|s| s.to_string()).collect())
}

fn add_entry(reg: &mut MapRegistry, name: &str, device: &str, pkey: u32) {
    reg.set(
        &format!("{name}\\DeviceId"),
        RegValue::String(device.into()),
    );
    reg.set(&format!("{name}\\HardwareId"), multi(&[device]));
    reg.set(
        &format!("{name}\\CompatibleId"),
        multi(&["IBA\\PORT_CLIENT"]),
    );
    reg.set(&format!("{name}\\PartitionKey"), RegValue::Dword(pkey));
}

fn ports(base: u64, count: u8) -> Vec<PortIdentity> {
    (1..=count)
        .map(|n| PortIdentity {
            port_num: PortNum::new(n).unwrap(),
            port_guid: PortGuid::new(base + u64::from(n)),
            pkeys: vec![PKey::DEFAULT],
            gids: Vec::new(),
        })
        .collect()
}

#[test]
fn an_absent_list_is_the_ipoib_default() {
    let list = read_child_list(&MapRegistry::default());
    assert_eq!(list.entries, [ChildEntry::ipoib()]);
    let children = port_children(NodeGuid::new(0x10), &ports(0x10, 2), &list);
    let ids: Vec<&str> = children.iter().map(|c| c.instance_id()).collect();
    assert_eq!(
        ids,
        ["0000000000000011_FFFF_IPoIB", "0000000000000012_FFFF_IPoIB"]
    );
    assert_eq!(children[1].port_num.get(), 2);
    assert_eq!(children[0].description.hardware_ids, ["IBA\\IPOIB"]);
}

#[test]
fn a_custom_list_keeps_good_entries_and_refuses_bad_ones_with_a_reason() {
    let mut reg = MapRegistry::default();
    reg.set(
        LIST_VALUE,
        multi(&[
            "IPoIB", "Srp", "ipoib", "bad name", "NoDevice", "Comma", "PKeyZero",
        ]),
    );
    add_entry(&mut reg, "IPoIB", "IBA\\IPOIB", 0xFFFF);
    add_entry(&mut reg, "Srp", "IBA\\SRP", 0x8001);
    reg.set("Srp\\Description", RegValue::String("SCSI RDMA".into()));
    add_entry(&mut reg, "Comma", "IBA\\A,B", 0xFFFF);
    add_entry(&mut reg, "PKeyZero", "IBA\\Z", 0x8000);
    reg.set("NoDevice\\HardwareId", multi(&["IBA\\X"]));
    let list = read_child_list(&reg);
    let kept: Vec<(&str, u16)> = list
        .entries
        .iter()
        .map(|e| (&*e.name, e.pkey.get()))
        .collect();
    assert_eq!(kept, [("IPoIB", 0xFFFF), ("Srp", 0x8001)]);
    assert_eq!(list.entries[1].description, "SCSI RDMA");
    assert_eq!(list.entries[0].description, "IPoIB", "the name by default");
    let refused: Vec<(&str, EntryError)> = list
        .refused
        .iter()
        .map(|r| (&*r.name, r.reason.clone()))
        .collect();
    assert_eq!(
        refused,
        [
            ("ipoib", EntryError::DuplicateName),
            ("bad name", EntryError::BadName),
            ("NoDevice", EntryError::Missing("DeviceId")),
            ("Comma", EntryError::BadId("DeviceId")),
            ("PKeyZero", EntryError::BadPartitionKey(0x8000)),
        ]
    );
    assert_eq!(
        list.refused[2].reason.to_string(),
        "DeviceId is missing",
        "a clear reason"
    );
    let children = port_children(NodeGuid::new(0x20), &ports(0x20, 2), &list);
    assert_eq!(children.len(), 4);
    assert_eq!(children[1].instance_id(), "0000000000000021_8001_Srp");

    // The wrong type of list refuses the list, not the filter.
    let mut reg = MapRegistry::default();
    reg.set(LIST_VALUE, RegValue::String("IPoIB".into()));
    let list = read_child_list(&reg);
    assert!(list.entries.is_empty());
    assert_eq!(list.refused[0].reason, EntryError::ListNotMultiString);

    // Past the limit, entries are refused.
    let names: Vec<String> = (0..MAX_ENTRIES + 2).map(|i| format!("E{i}")).collect();
    let mut reg = MapRegistry::default();
    reg.set(LIST_VALUE, RegValue::MultiString(names.clone()));
    for name in &names {
        add_entry(&mut reg, name, "IBA\\E", 0xFFFF);
    }
    let list = read_child_list(&reg);
    assert_eq!(list.entries.len(), MAX_ENTRIES);
    assert!(
        list.refused
            .iter()
            .all(|r| r.reason == EntryError::TooManyEntries)
    );
}

#[test]
fn instance_ids_depend_only_on_port_guid_pkey_and_name() {
    let id = instance_id(
        PortGuid::new(0x0002_C903_00AB_CDEF),
        PKey::new(0x8001),
        "Srp",
    );
    assert_eq!(id, "0002C90300ABCDEF_8001_Srp");
    // The same port reported again (another boot, a re-plug) and the
    // entry read again: the same IDs.
    let mut reg = MapRegistry::default();
    reg.set(LIST_VALUE, multi(&["Srp"]));
    add_entry(&mut reg, "Srp", "IBA\\SRP", 0x8001);
    let first = port_children(NodeGuid::new(1), &ports(0x30, 2), &read_child_list(&reg));
    let again = port_children(NodeGuid::new(1), &ports(0x30, 2), &read_child_list(&reg));
    assert_eq!(first, again);
}

#[test]
fn entries_added_and_removed_at_runtime_change_only_their_children() {
    let ports = ports(0x40, 2);
    let mut reg = MapRegistry::default();
    reg.set(LIST_VALUE, multi(&["IPoIB"]));
    add_entry(&mut reg, "IPoIB", "IBA\\IPOIB", 0xFFFF);
    let mut set = ChildSet::default();
    let changes = set.reconcile(port_children(
        NodeGuid::new(4),
        &ports,
        &read_child_list(&reg),
    ));
    assert_eq!(changes.appeared.len(), 2);

    reg.set(LIST_VALUE, multi(&["IPoIB", "Srp"]));
    add_entry(&mut reg, "Srp", "IBA\\SRP", 0x8001);
    let changes = set.reconcile(port_children(
        NodeGuid::new(4),
        &ports,
        &read_child_list(&reg),
    ));
    let appeared: Vec<&str> = changes.appeared.iter().map(|c| c.instance_id()).collect();
    assert_eq!(
        appeared,
        ["0000000000000041_8001_Srp", "0000000000000042_8001_Srp"]
    );
    assert!(changes.disappeared.is_empty());
    assert_eq!(set.len(), 4);

    reg.set(LIST_VALUE, multi(&["Srp"]));
    let changes = set.reconcile(port_children(
        NodeGuid::new(4),
        &ports,
        &read_child_list(&reg),
    ));
    assert!(changes.appeared.is_empty());
    let gone: Vec<&str> = changes
        .disappeared
        .iter()
        .map(|c| c.instance_id())
        .collect();
    assert_eq!(
        gone,
        ["0000000000000041_FFFF_IPoIB", "0000000000000042_FFFF_IPoIB"]
    );
    assert_eq!(set.clear().len(), 2);
    assert!(set.is_empty());
}
