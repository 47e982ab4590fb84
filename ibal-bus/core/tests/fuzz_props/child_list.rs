//! The property of the bus filter's child-list parser
//! (`ibal_bus_core::children::read_child_list`) under a hostile registry.
//! Shared by the bounded property test (`tests/fuzz_child_list.rs`) and
//! the `child_list` cargo-fuzz target, which includes this file by path.
//!
//! The bytes are a script that fills the filter's Parameters key
//! ([`registry_from`]): the `StaticChild` value of any type, any names
//! (bad characters, overlong, duplicates in another case, more than the
//! limit), and for each name every value of the entry with any type and
//! content (controls, commas, non-ASCII, overlong IDs, any DWORD).
//!
//! - The parse is total and deterministic, and loses nothing: every
//!   listed name is either an entry or a refusal with a reason; an absent
//!   list is the IPoIB default; a list of the wrong type is one refusal.
//! - Every entry kept obeys every rule: a valid unique name, valid device,
//!   hardware (1 to 8) and compatible (0 to 8) IDs, a description without
//!   control characters, a valid P_Key.
//! - The children of two ports have unique instance IDs that are valid
//!   device-instance IDs (printable ASCII, no backslash, short), and
//!   reconciling the same set twice changes nothing.

use std::collections::BTreeMap;

use driver_platform::{RegValue, Registry, RegistryKey};
use ib_types::scalars::{NodeGuid, PKey, PortGuid, PortNum};
use ibal_bus_core::children::{
    ChildEntry, ChildSet, EntryError, LIST_VALUE, MAX_DESCRIPTION_LEN, MAX_ENTRIES, MAX_ID_LEN,
    MAX_IDS, MAX_NAME_LEN, port_children, read_child_list,
};
use ibal_bus_core::ci::PortIdentity;

/// The values of one entry, in script order.
pub(crate) const VALUES: [&str; 5] = [
    "DeviceId",
    "HardwareId",
    "CompatibleId",
    "Description",
    "PartitionKey",
];

/// A Parameters key: value names compared without case, as the registry.
#[derive(Debug, Default)]
pub(crate) struct MapRegistry(BTreeMap<String, RegValue>);

impl MapRegistry {
    /// Sets `name` to `value`.
    pub(crate) fn set(&mut self, name: &str, value: RegValue) {
        self.0.insert(name.to_ascii_lowercase(), value);
    }
}

impl Registry for MapRegistry {
    fn read(&self, key: RegistryKey, name: &str) -> Option<RegValue> {
        match key {
            RegistryKey::ServiceParameters => self.0.get(&name.to_ascii_lowercase()).cloned(),
            RegistryKey::Device => None,
        }
    }
}

struct Script<'a>(&'a [u8]);

impl Script<'_> {
    fn byte(&mut self) -> u8 {
        match self.0.split_first() {
            Some((b, rest)) => {
                self.0 = rest;
                *b
            }
            None => 0,
        }
    }
    fn string(&mut self) -> String {
        let len = self.byte();
        (0..len)
            .map(|_| match self.byte() {
                b @ 0..=0x7F => char::from(b),
                0x80..=0xBF => 'é',
                _ => '\u{202E}',
            })
            .collect()
    }
    fn value(&mut self) -> Option<RegValue> {
        match self.byte() % 5 {
            0 => None,
            1 => Some(RegValue::String(self.string())),
            2 => {
                let n = self.byte() % 11;
                Some(RegValue::MultiString(
                    (0..n).map(|_| self.string()).collect(),
                ))
            }
            3 => Some(RegValue::Dword(u32::from_le_bytes([
                self.byte(),
                self.byte(),
                self.byte(),
                self.byte(),
            ]))),
            _ => Some(RegValue::Binary(self.string().into_bytes())),
        }
    }
}

/// The registry the script `data` describes (see the module doc).
pub(crate) fn registry_from(data: &[u8]) -> MapRegistry {
    let mut script = Script(data);
    let mut registry = MapRegistry::default();
    let kind = script.byte();
    let count = script.byte() % (MAX_ENTRIES as u8 + 8);
    let names: Vec<String> = (0..count).map(|_| script.string()).collect();
    match kind % 4 {
        0 => {}
        1 => registry.set(LIST_VALUE, RegValue::String(names.join(""))),
        2 => registry.set(LIST_VALUE, RegValue::Dword(u32::from(count))),
        _ => registry.set(LIST_VALUE, RegValue::MultiString(names.clone())),
    }
    for name in &names {
        for value in VALUES {
            if let Some(v) = script.value() {
                registry.set(&format!("{name}\\{value}"), v);
            }
        }
    }
    registry
}

/// Appends `s` as the script's string form.
pub(crate) fn push_string(out: &mut Vec<u8>, s: &str) {
    out.push(s.len() as u8);
    out.extend_from_slice(s.as_bytes());
}

/// Valid scripts: the INF's IPoIB entry, two entries on two partitions,
/// and an absent list.
pub(crate) fn seeds() -> Vec<Vec<u8>> {
    let entry = |out: &mut Vec<u8>, device: &str, pkey: u32| {
        out.push(1);
        push_string(out, device);
        out.extend([2, 1]);
        push_string(out, device);
        out.extend([2, 1]);
        push_string(out, "IBA\\PORT_CLIENT");
        out.push(1);
        push_string(out, "InfiniBand port client");
        out.push(3);
        out.extend(pkey.to_le_bytes());
    };
    let mut one = vec![3, 1];
    push_string(&mut one, "IPoIB");
    entry(&mut one, "IBA\\IPOIB", 0xFFFF);
    let mut two = vec![3, 2];
    push_string(&mut two, "IPoIB");
    push_string(&mut two, "Storage-1");
    entry(&mut two, "IBA\\IPOIB", 0xFFFF);
    entry(&mut two, "IBA\\SRP", 0x8001);
    vec![one, two, vec![0]]
}

fn valid_id(id: &str) -> bool {
    (1..=MAX_ID_LEN).contains(&id.len())
        && id.bytes().all(|b| (b'!'..=b'~').contains(&b) && b != b',')
}

/// Checks the property for `data`; returns whether the list was read
/// without any refusal (for the seeds).
pub(crate) fn check(data: &[u8]) -> bool {
    let registry = registry_from(data);
    let list = read_child_list(&registry);
    assert_eq!(
        list,
        read_child_list(&registry),
        "the parse is deterministic"
    );

    match registry.read(RegistryKey::ServiceParameters, LIST_VALUE) {
        None => {
            assert_eq!(list.entries, [ChildEntry::ipoib()]);
            assert!(list.refused.is_empty());
        }
        Some(RegValue::MultiString(names)) => {
            assert_eq!(
                list.entries.len() + list.refused.len(),
                names.len(),
                "nothing lost"
            );
        }
        Some(_) => {
            assert!(list.entries.is_empty());
            assert_eq!(list.refused.len(), 1);
            assert_eq!(list.refused[0].reason, EntryError::ListNotMultiString);
        }
    }
    for refusal in &list.refused {
        assert!(!refusal.reason.to_string().is_empty());
        assert!(refusal.name.chars().count() <= MAX_NAME_LEN);
    }

    for (i, entry) in list.entries.iter().enumerate() {
        assert!((1..=MAX_NAME_LEN).contains(&entry.name.len()));
        assert!(
            entry
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        );
        assert!(
            !list.entries[..i]
                .iter()
                .any(|e| e.name.eq_ignore_ascii_case(&entry.name)),
            "names unique"
        );
        assert!(valid_id(&entry.device_id));
        assert!((1..=MAX_IDS).contains(&entry.hardware_ids.len()));
        assert!(entry.compatible_ids.len() <= MAX_IDS);
        assert!(
            entry
                .hardware_ids
                .iter()
                .chain(&entry.compatible_ids)
                .all(|id| valid_id(id))
        );
        assert!(entry.description.chars().count() <= MAX_DESCRIPTION_LEN);
        assert!(!entry.description.chars().any(char::is_control));
        assert!(entry.pkey.is_valid());
    }

    let ports: Vec<PortIdentity> = (1..=2u8)
        .map(|n| PortIdentity {
            port_num: PortNum::new(n).unwrap(),
            port_guid: PortGuid::new(0x0002_C903_0000_0000 | u64::from(n)),
            pkeys: vec![PKey::DEFAULT],
            gids: Vec::new(),
        })
        .collect();
    let children = port_children(NodeGuid::new(0x0002_C903_0000_0000), &ports, &list);
    assert_eq!(children.len(), 2 * list.entries.len());
    let mut ids: Vec<&str> = children.iter().map(|c| c.instance_id()).collect();
    for id in &ids {
        assert!(id.len() <= MAX_ID_LEN && !id.contains('\\'));
        assert!(id.bytes().all(|b| (b'!'..=b'~').contains(&b) && b != b','));
    }
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), children.len(), "instance IDs unique");

    let mut set = ChildSet::default();
    let first = set.reconcile(children.clone());
    assert_eq!(first.appeared, children);
    assert!(first.disappeared.is_empty());
    let again = set.reconcile(children);
    assert!(again.appeared.is_empty() && again.disappeared.is_empty());

    list.refused.is_empty()
}
