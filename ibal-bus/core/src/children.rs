//! The per-port children (docs/ibal-bus.md "Children per port"): the
//! registry list under the filter's Parameters key, parsed as untrusted
//! input, and the children it gives each port of a CA.
//!
//! The list (`inf/hca-miniport.inf`, `IbalBus_Parameters_AddReg`):
//! `StaticChild` (`REG_MULTI_SZ`) names the entries; each entry `<name>` is
//! a subkey holding `DeviceId` (`REG_SZ`, required), `HardwareId`
//! (`REG_MULTI_SZ` or `REG_SZ`, required), `CompatibleId` (optional),
//! `Description` (`REG_SZ`, optional: the name), `PartitionKey`
//! (`REG_DWORD`, optional: `0xFFFF`). Without `StaticChild` the list is
//! the single IPoIB entry ([`ChildEntry::ipoib`]).
//!
//! An entry that breaks a rule is refused with the reason
//! ([`EntryError`]) and the others are kept: a bad entry costs only its own
//! children. The rules keep every string a valid Windows device ID or
//! device text and every instance ID unique and stable:
//! [`PortChild::instance_id`] is `<port GUID>_<P_Key>_<name>`, the same
//! across reboots and re-plugs of the HCA, and across restarts of its
//! stack, for as long as the entry keeps its name and P_Key.

use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec::Vec;
use core::fmt;

use driver_platform::{ChildDescription, RegValue, Registry, RegistryKey};
use ib_types::scalars::{NodeGuid, PKey, PortGuid, PortNum};

use crate::ci::PortIdentity;

/// The value naming the list's entries.
pub const LIST_VALUE: &str = "StaticChild";
/// At most this many entries are read; the rest are refused.
pub const MAX_ENTRIES: usize = 32;
/// An entry name's length limit (it is part of the instance ID).
pub const MAX_NAME_LEN: usize = 32;
/// `MAX_DEVICE_ID_LEN`: the longest device, hardware or compatible ID.
pub const MAX_ID_LEN: usize = 200;
/// At most this many hardware IDs, and as many compatible IDs, per entry.
pub const MAX_IDS: usize = 8;
/// A description's length limit.
pub const MAX_DESCRIPTION_LEN: usize = 128;

/// Why an entry of the list was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EntryError {
    /// `StaticChild` is present but not a `REG_MULTI_SZ`: no entry is read.
    ListNotMultiString,
    /// More than [`MAX_ENTRIES`] entries: this one is past the limit.
    TooManyEntries,
    /// The name is empty, longer than [`MAX_NAME_LEN`], or has a character
    /// other than ASCII letters, digits, `-`, `_` and `.`.
    BadName,
    /// The name repeats an earlier entry's (names are case-insensitive, as
    /// registry key names).
    DuplicateName,
    /// A required value is absent.
    Missing(&'static str),
    /// A value has the wrong registry type.
    WrongType(&'static str),
    /// An ID is empty, longer than [`MAX_ID_LEN`], or has a character
    /// outside `!`..=`~` or a comma.
    BadId(&'static str),
    /// More than [`MAX_IDS`] IDs in a list, or none where one is required.
    IdCount(&'static str),
    /// The description is longer than [`MAX_DESCRIPTION_LEN`] or has a
    /// control character.
    BadDescription,
    /// The P_Key does not fit 16 bits or has partition number 0.
    BadPartitionKey(u32),
}

impl fmt::Display for EntryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ListNotMultiString => write!(f, "{LIST_VALUE} is not a REG_MULTI_SZ"),
            Self::TooManyEntries => write!(f, "more than {MAX_ENTRIES} entries"),
            Self::BadName => write!(
                f,
                "the name is not 1 to {MAX_NAME_LEN} ASCII letters, digits, '-', '_' or '.'"
            ),
            Self::DuplicateName => write!(f, "the name repeats an earlier entry's"),
            Self::Missing(value) => write!(f, "{value} is missing"),
            Self::WrongType(value) => write!(f, "{value} has the wrong registry type"),
            Self::BadId(value) => write!(
                f,
                "{value} holds an ID that is empty, longer than {MAX_ID_LEN}, or has a \
                 character outside '!'..='~' or a comma"
            ),
            Self::IdCount(value) => write!(f, "{value} holds no ID or more than {MAX_IDS}"),
            Self::BadDescription => write!(
                f,
                "Description is longer than {MAX_DESCRIPTION_LEN} or has a control character"
            ),
            Self::BadPartitionKey(v) => {
                write!(f, "PartitionKey {v:#x} is not a valid 16-bit P_Key")
            }
        }
    }
}

/// A refused entry: its name as listed (cut to [`MAX_NAME_LEN`]
/// characters for reporting) and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The entry's name.
    pub name: String,
    /// Why it was refused.
    pub reason: EntryError,
}

/// One entry of the list: what each port gets one child of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChildEntry {
    /// The entry's name (its subkey; part of the instance ID).
    pub name: String,
    /// The child's device ID (`BusQueryDeviceID`).
    pub device_id: String,
    /// Its hardware IDs, most specific first.
    pub hardware_ids: Vec<String>,
    /// Its compatible IDs, most specific first.
    pub compatible_ids: Vec<String>,
    /// Its device text.
    pub description: String,
    /// The partition the child's client works in.
    pub pkey: PKey,
}

impl ChildEntry {
    /// The default entry, used when the list is absent: IPoIB on the
    /// default partition (the same values `inf/hca-miniport.inf` installs).
    pub fn ipoib() -> Self {
        Self {
            name: "IPoIB".to_string(),
            device_id: "IBA\\IPOIB".to_string(),
            hardware_ids: alloc::vec!["IBA\\IPOIB".to_string()],
            compatible_ids: alloc::vec!["IBA\\PORT_CLIENT".to_string()],
            description: "InfiniBand port client".to_string(),
            pkey: PKey::DEFAULT,
        }
    }
}

/// The list as read: the entries kept, in list order, and the refused.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ChildList {
    /// Entries that passed every rule.
    pub entries: Vec<ChildEntry>,
    /// Entries refused, with the reason.
    pub refused: Vec<Refusal>,
}

/// Checks one entry against every rule the list read applies to an entry
/// on its own (name, IDs, description, P_Key): what an entry written
/// through the proxy's administrator IOCTL must pass before it reaches the
/// registry.
pub fn check_entry(entry: &ChildEntry) -> Result<(), EntryError> {
    if !valid_name(&entry.name) {
        return Err(EntryError::BadName);
    }
    if !valid_id(&entry.device_id) {
        return Err(EntryError::BadId("DeviceId"));
    }
    for (value, list, required) in [
        ("HardwareId", &entry.hardware_ids, true),
        ("CompatibleId", &entry.compatible_ids, false),
    ] {
        if list.len() > MAX_IDS || (required && list.is_empty()) {
            return Err(EntryError::IdCount(value));
        }
        if !list.iter().all(|id| valid_id(id)) {
            return Err(EntryError::BadId(value));
        }
    }
    if entry.description.chars().count() > MAX_DESCRIPTION_LEN
        || entry.description.chars().any(char::is_control)
    {
        return Err(EntryError::BadDescription);
    }
    if !entry.pkey.is_valid() {
        return Err(EntryError::BadPartitionKey(entry.pkey.get().into()));
    }
    Ok(())
}

fn valid_name(name: &str) -> bool {
    (1..=MAX_NAME_LEN).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

fn valid_id(id: &str) -> bool {
    (1..=MAX_ID_LEN).contains(&id.len())
        && id.bytes().all(|b| (b'!'..=b'~').contains(&b) && b != b',')
}

fn reported_name(name: &str) -> String {
    name.chars().take(MAX_NAME_LEN).collect()
}

fn ids(
    registry: &dyn Registry,
    entry: &str,
    value: &'static str,
    required: bool,
) -> Result<Vec<String>, EntryError> {
    let list = match registry.read(RegistryKey::ServiceParameters, &format!("{entry}\\{value}")) {
        None if required => return Err(EntryError::Missing(value)),
        None => Vec::new(),
        Some(RegValue::MultiString(list)) => list,
        Some(RegValue::String(one)) => alloc::vec![one],
        Some(_) => return Err(EntryError::WrongType(value)),
    };
    if list.len() > MAX_IDS || (required && list.is_empty()) {
        return Err(EntryError::IdCount(value));
    }
    if !list.iter().all(|id| valid_id(id)) {
        return Err(EntryError::BadId(value));
    }
    Ok(list)
}

fn read_entry(registry: &dyn Registry, name: &str) -> Result<ChildEntry, EntryError> {
    let value = |v: &str| registry.read(RegistryKey::ServiceParameters, &format!("{name}\\{v}"));
    let device_id = match value("DeviceId") {
        None => return Err(EntryError::Missing("DeviceId")),
        Some(RegValue::String(id)) if valid_id(&id) => id,
        Some(RegValue::String(_)) => return Err(EntryError::BadId("DeviceId")),
        Some(_) => return Err(EntryError::WrongType("DeviceId")),
    };
    let hardware_ids = ids(registry, name, "HardwareId", true)?;
    let compatible_ids = ids(registry, name, "CompatibleId", false)?;
    let description = match value("Description") {
        None => name.to_string(),
        Some(RegValue::String(text))
            if text.chars().count() <= MAX_DESCRIPTION_LEN
                && !text.chars().any(char::is_control) =>
        {
            text
        }
        Some(RegValue::String(_)) => return Err(EntryError::BadDescription),
        Some(_) => return Err(EntryError::WrongType("Description")),
    };
    let pkey = match value("PartitionKey") {
        None => PKey::DEFAULT,
        Some(RegValue::Dword(raw)) => match u16::try_from(raw).map(PKey::new) {
            Ok(pkey) if pkey.is_valid() => pkey,
            _ => return Err(EntryError::BadPartitionKey(raw)),
        },
        Some(_) => return Err(EntryError::WrongType("PartitionKey")),
    };
    Ok(ChildEntry {
        name: name.to_string(),
        device_id,
        hardware_ids,
        compatible_ids,
        description,
        pkey,
    })
}

/// Reads the child list from the filter's Parameters key (see the module
/// doc). Never fails as a whole: an entry that breaks a rule is refused on
/// its own; a `StaticChild` of the wrong type refuses the whole list (no
/// entries, one refusal). PASSIVE_LEVEL (registry reads).
pub fn read_child_list(registry: &dyn Registry) -> ChildList {
    let names = match registry.read(RegistryKey::ServiceParameters, LIST_VALUE) {
        None => {
            return ChildList {
                entries: alloc::vec![ChildEntry::ipoib()],
                refused: Vec::new(),
            };
        }
        Some(RegValue::MultiString(names)) => names,
        Some(_) => {
            return ChildList {
                entries: Vec::new(),
                refused: alloc::vec![Refusal {
                    name: LIST_VALUE.to_string(),
                    reason: EntryError::ListNotMultiString,
                }],
            };
        }
    };
    let mut list = ChildList::default();
    let mut seen: Vec<String> = Vec::new();
    for (index, name) in names.iter().enumerate() {
        let verdict = if index >= MAX_ENTRIES {
            Err(EntryError::TooManyEntries)
        } else if !valid_name(name) {
            Err(EntryError::BadName)
        } else if seen.iter().any(|s| s.eq_ignore_ascii_case(name)) {
            Err(EntryError::DuplicateName)
        } else {
            seen.push(name.clone());
            read_entry(registry, name)
        };
        match verdict {
            Ok(entry) => list.entries.push(entry),
            Err(reason) => list.refused.push(Refusal {
                name: reported_name(name),
                reason,
            }),
        }
    }
    list
}

/// One child of one port: where it sits and what the PnP manager is told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortChild {
    /// The CA the port belongs to.
    pub ca_guid: NodeGuid,
    /// The port.
    pub port_num: PortNum,
    /// The port's GUID.
    pub port_guid: PortGuid,
    /// The entry's P_Key.
    pub pkey: PKey,
    /// The entry's name.
    pub entry: String,
    /// The child as reported (`instance_id` is [`instance_id`]'s).
    pub description: ChildDescription,
}

impl PortChild {
    /// The child's instance ID.
    pub fn instance_id(&self) -> &str {
        &self.description.instance_id
    }
}

/// The instance ID of the child of `entry` on the port `port_guid`: the
/// port GUID and P_Key in fixed-width hex and the entry's name, so it is
/// stable across reboots and re-plugs and unique on the bus (port GUIDs
/// are unique; names are unique within the list).
pub fn instance_id(port_guid: PortGuid, pkey: PKey, entry: &str) -> String {
    format!("{:016X}_{:04X}_{entry}", port_guid.get(), pkey.get())
}

/// The children of the CA `ca_guid` with `ports`: one per port per entry,
/// port by port in list order.
pub fn port_children(
    ca_guid: NodeGuid,
    ports: &[PortIdentity],
    list: &ChildList,
) -> Vec<PortChild> {
    let mut children = Vec::with_capacity(ports.len() * list.entries.len());
    for port in ports {
        for entry in &list.entries {
            children.push(PortChild {
                ca_guid,
                port_num: port.port_num,
                port_guid: port.port_guid,
                pkey: entry.pkey,
                entry: entry.name.clone(),
                description: ChildDescription {
                    instance_id: instance_id(port.port_guid, entry.pkey, &entry.name),
                    hardware_ids: entry.hardware_ids.clone(),
                    compatible_ids: entry.compatible_ids.clone(),
                    description: entry.description.clone(),
                },
            });
        }
    }
    children
}

/// What changed between two child sets.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ChildChanges {
    /// Children to report present.
    pub appeared: Vec<PortChild>,
    /// Children to report missing.
    pub disappeared: Vec<PortChild>,
}

/// The children one filter has reported, keyed by instance ID.
#[derive(Debug, Clone, Default)]
pub struct ChildSet {
    present: alloc::collections::BTreeMap<String, PortChild>,
}

impl ChildSet {
    /// Makes `desired` the set and says what changed. A child is known by
    /// its instance ID: one whose ID stays keeps its devnode (a changed
    /// description or ID list of a kept entry applies when the child is
    /// next created, as with a KMDF static child list).
    pub fn reconcile(&mut self, desired: Vec<PortChild>) -> ChildChanges {
        let mut next = alloc::collections::BTreeMap::new();
        let mut changes = ChildChanges::default();
        for child in desired {
            let id = child.instance_id().to_string();
            if next.contains_key(&id) {
                continue;
            }
            match self.present.remove(&id) {
                Some(kept) => {
                    next.insert(id, kept);
                }
                None => {
                    changes.appeared.push(child.clone());
                    next.insert(id, child);
                }
            }
        }
        changes.disappeared = core::mem::take(&mut self.present).into_values().collect();
        self.present = next;
        changes
    }

    /// Empties the set, returning every child that was present.
    pub fn clear(&mut self) -> Vec<PortChild> {
        core::mem::take(&mut self.present).into_values().collect()
    }

    /// The children present, by instance ID.
    pub fn iter(&self) -> impl Iterator<Item = &PortChild> {
        self.present.values()
    }

    /// How many children are present.
    pub fn len(&self) -> usize {
        self.present.len()
    }

    /// True when no child is present.
    pub fn is_empty(&self) -> bool {
        self.present.is_empty()
    }
}
