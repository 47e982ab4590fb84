//! The registry store: the host's model of
//! `HKLM\SYSTEM\CurrentControlSet`, filled from INF registry sections
//! ([`crate::inf::Binding::apply`]) and by tests, and read by drivers
//! through [`RegistryView`], the host's implementation of
//! [`driver_platform::Registry`].
//!
//! # Contract
//!
//! - A key is named by a path of components separated by `\`, relative to
//!   `CurrentControlSet` (`Services\ibalbus\Parameters`). Components are
//!   non-empty, at most [`MAX_KEY_NAME`] characters, and compared without
//!   regard to case, as Windows does; the case a key was created with is
//!   kept for enumeration.
//! - A key holds typed values ([`RegValue`]: `REG_DWORD`, `REG_SZ`,
//!   `REG_MULTI_SZ`, `REG_BINARY`) and subkeys. Value names are compared
//!   without regard to case; the empty name is the key's default value.
//!   Values enumerate in the order they were first set, subkeys in sorted
//!   order (Windows enumerates both in an order callers must not rely on;
//!   ours is deterministic).
//! - Setting a value creates its key and every missing parent, as
//!   `RegCreateKeyEx` + `RegSetValueEx` do. Reading never creates.
//!   Deleting a key that has subkeys fails ([`RegistryError::HasSubkeys`],
//!   like `RegDeleteKey`); [`RegistryStore::delete_tree`] removes a whole
//!   subtree.
//! - Every read through a [`RegistryView`] is recorded once per (service,
//!   key, name) ([`RegistryStore::driver_reads`]), so tests can hold the
//!   INF lint's table of what drivers read (`inf_lint::DRIVER_READS`) to
//!   what they really read.
//! - The store is shared: clones see the same keys. It is safe to use from
//!   several threads. The IRQL rule (registry access only at
//!   PASSIVE_LEVEL) is enforced by the host where drivers call in, not
//!   here.
//!
//! # Layout
//!
//! | path | Windows key | holds |
//! |---|---|---|
//! | `Services\<service>` | the service key | `Type`, `Start`, `ErrorControl`, `ImagePath`, `DisplayName` from the INF's service install section, and that section's `AddReg` (`HKR`) |
//! | `Services\<service>\Parameters` | [`RegistryKey::ServiceParameters`] | the driver's parameters (for `ibalbus`: `StaticChild` and one subkey per child) |
//! | `Enum\<device instance path>` | the device instance key | `Service`, `UpperFilters`, `LowerFilters`, `ClassGUID`, `DeviceDesc` |
//! | `Enum\<device instance path>\Device Parameters` | [`RegistryKey::Device`], the hardware key (`HKR` of `DDInstall.HW`) | device settings |
//!
//! A device instance path (`PCI\VEN_F1B0&DEV_0001&SUBSYS_0001F1B0&REV_01\3&0&0&10`)
//! contains `\`, so it spans several key levels, exactly as under
//! `CurrentControlSet\Enum` on Windows.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use driver_platform::{RegValue, Registry, RegistryKey};

/// Longest key name component Windows accepts (characters).
pub const MAX_KEY_NAME: usize = 255;

/// Longest value name Windows accepts (characters).
pub const MAX_VALUE_NAME: usize = 16_383;

/// Why a registry operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// The key path is not a valid path.
    #[error("invalid registry path {path:?}: {reason}")]
    InvalidPath {
        /// The path as given.
        path: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The value name is too long.
    #[error("value name of {len} characters exceeds {MAX_VALUE_NAME}")]
    InvalidValueName {
        /// Its length in characters.
        len: usize,
    },
    /// The key does not exist.
    #[error("registry key {path:?} does not exist")]
    KeyNotFound {
        /// The key.
        path: String,
    },
    /// The key exists but has no value by that name.
    #[error("registry key {path:?} has no value {name:?}")]
    ValueNotFound {
        /// The key.
        path: String,
        /// The value name.
        name: String,
    },
    /// The key cannot be deleted because it has subkeys.
    #[error("registry key {path:?} has subkeys")]
    HasSubkeys {
        /// The key.
        path: String,
    },
}

/// `Services\<service>`: the service key.
pub fn service_key(service: &str) -> String {
    format!("Services\\{service}")
}

/// `Services\<service>\Parameters`: what a driver reads as
/// [`RegistryKey::ServiceParameters`].
pub fn service_parameters_key(service: &str) -> String {
    format!("Services\\{service}\\Parameters")
}

/// `Enum\<instance>`: the device instance key.
pub fn device_instance_key(instance_path: &str) -> String {
    format!("Enum\\{instance_path}")
}

/// `Enum\<instance>\Device Parameters`: the device's hardware key, what a
/// driver reads as [`RegistryKey::Device`].
pub fn device_parameters_key(instance_path: &str) -> String {
    format!("Enum\\{instance_path}\\Device Parameters")
}

#[derive(Debug, Default)]
struct Key {
    /// The name the key was created with.
    name: String,
    /// In the order first set; names unique without regard to case.
    values: Vec<(String, RegValue)>,
    /// Keyed by the lower-cased name.
    subkeys: BTreeMap<String, Key>,
}

impl Key {
    fn named(name: &str) -> Self {
        Self {
            name: name.to_owned(),
            ..Self::default()
        }
    }

    fn value_index(&self, name: &str) -> Option<usize> {
        self.values.iter().position(|(n, _)| eq_nocase(n, name))
    }
}

fn eq_nocase(a: &str, b: &str) -> bool {
    a.chars()
        .flat_map(char::to_lowercase)
        .eq(b.chars().flat_map(char::to_lowercase))
}

fn fold(name: &str) -> String {
    name.to_lowercase()
}

/// Splits and checks a key path. The empty path names the root.
fn components(path: &str) -> Result<Vec<&str>, RegistryError> {
    if path.is_empty() {
        return Ok(Vec::new());
    }
    let invalid = |reason| RegistryError::InvalidPath {
        path: path.to_owned(),
        reason,
    };
    path.split('\\')
        .map(|c| {
            if c.is_empty() {
                Err(invalid(
                    "empty component (leading, trailing or doubled `\\`)",
                ))
            } else if c.chars().count() > MAX_KEY_NAME {
                Err(invalid("component longer than 255 characters"))
            } else {
                Ok(c)
            }
        })
        .collect()
}

/// Checks a key path without touching the store.
pub(crate) fn check_path(path: &str) -> Result<(), RegistryError> {
    components(path).map(|_| ())
}

/// Checks a value name's length.
pub(crate) fn check_value_name(name: &str) -> Result<(), RegistryError> {
    let len = name.chars().count();
    if len > MAX_VALUE_NAME {
        return Err(RegistryError::InvalidValueName { len });
    }
    Ok(())
}

/// The registry: a tree of keys with typed values. Cheap to clone; clones
/// share the tree.
#[derive(Clone, Default)]
pub struct RegistryStore {
    root: Arc<RwLock<Key>>,
    /// (service, key, value name as asked) of every driver read.
    reads: Arc<Mutex<HashSet<(String, RegistryKey, String)>>>,
}

impl fmt::Debug for RegistryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegistryStore").finish_non_exhaustive()
    }
}

impl RegistryStore {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    fn read_root(&self) -> RwLockReadGuard<'_, Key> {
        self.root.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write_root(&self) -> RwLockWriteGuard<'_, Key> {
        self.root.write().unwrap_or_else(|e| e.into_inner())
    }

    fn find<'k>(root: &'k Key, parts: &[&str]) -> Option<&'k Key> {
        parts
            .iter()
            .try_fold(root, |key, part| key.subkeys.get(&fold(part)))
    }

    fn find_mut<'k>(root: &'k mut Key, parts: &[&str]) -> Option<&'k mut Key> {
        parts
            .iter()
            .try_fold(root, |key, part| key.subkeys.get_mut(&fold(part)))
    }

    fn create<'k>(root: &'k mut Key, parts: &[&str]) -> &'k mut Key {
        parts.iter().fold(root, |key, part| {
            key.subkeys
                .entry(fold(part))
                .or_insert_with(|| Key::named(part))
        })
    }

    /// Creates `path` and every missing parent; an existing key is left as
    /// it is.
    pub fn create_key(&self, path: &str) -> Result<(), RegistryError> {
        let parts = components(path)?;
        Self::create(&mut self.write_root(), &parts);
        Ok(())
    }

    /// Whether `path` exists.
    pub fn key_exists(&self, path: &str) -> bool {
        components(path).is_ok_and(|parts| Self::find(&self.read_root(), &parts).is_some())
    }

    /// Sets value `name` of key `path` (creating the key), replacing any
    /// value of that name whatever its type.
    pub fn set_value(&self, path: &str, name: &str, value: RegValue) -> Result<(), RegistryError> {
        let parts = components(path)?;
        check_value_name(name)?;
        let mut root = self.write_root();
        let key = Self::create(&mut root, &parts);
        match key.value_index(name) {
            Some(i) => key.values[i].1 = value,
            None => key.values.push((name.to_owned(), value)),
        }
        Ok(())
    }

    /// Value `name` of key `path`, if both exist.
    pub fn get_value(&self, path: &str, name: &str) -> Option<RegValue> {
        let parts = components(path).ok()?;
        let root = self.read_root();
        let key = Self::find(&root, &parts)?;
        key.value_index(name).map(|i| key.values[i].1.clone())
    }

    /// Deletes value `name` of key `path`.
    pub fn delete_value(&self, path: &str, name: &str) -> Result<(), RegistryError> {
        let parts = components(path)?;
        let mut root = self.write_root();
        let key = Self::find_mut(&mut root, &parts).ok_or_else(|| RegistryError::KeyNotFound {
            path: path.to_owned(),
        })?;
        let i = key
            .value_index(name)
            .ok_or_else(|| RegistryError::ValueNotFound {
                path: path.to_owned(),
                name: name.to_owned(),
            })?;
        key.values.remove(i);
        Ok(())
    }

    /// Deletes key `path`, which must have no subkeys (its values go with
    /// it). The root cannot be deleted.
    pub fn delete_key(&self, path: &str) -> Result<(), RegistryError> {
        self.remove(path, false)
    }

    /// Deletes key `path` with all its subkeys and values.
    pub fn delete_tree(&self, path: &str) -> Result<(), RegistryError> {
        self.remove(path, true)
    }

    fn remove(&self, path: &str, tree: bool) -> Result<(), RegistryError> {
        let parts = components(path)?;
        let Some((last, parents)) = parts.split_last() else {
            return Err(RegistryError::InvalidPath {
                path: path.to_owned(),
                reason: "the root cannot be deleted",
            });
        };
        let not_found = || RegistryError::KeyNotFound {
            path: path.to_owned(),
        };
        let mut root = self.write_root();
        let parent = Self::find_mut(&mut root, parents).ok_or_else(not_found)?;
        let folded = fold(last);
        let key = parent.subkeys.get(&folded).ok_or_else(not_found)?;
        if !tree && !key.subkeys.is_empty() {
            return Err(RegistryError::HasSubkeys {
                path: path.to_owned(),
            });
        }
        parent.subkeys.remove(&folded);
        Ok(())
    }

    /// The names of `path`'s subkeys (as created), sorted without regard to
    /// case.
    pub fn subkeys(&self, path: &str) -> Result<Vec<String>, RegistryError> {
        let parts = components(path)?;
        let root = self.read_root();
        let key = Self::find(&root, &parts).ok_or_else(|| RegistryError::KeyNotFound {
            path: path.to_owned(),
        })?;
        Ok(key.subkeys.values().map(|k| k.name.clone()).collect())
    }

    /// `path`'s values, in the order they were first set.
    pub fn values(&self, path: &str) -> Result<Vec<(String, RegValue)>, RegistryError> {
        let parts = components(path)?;
        let root = self.read_root();
        let key = Self::find(&root, &parts).ok_or_else(|| RegistryError::KeyNotFound {
            path: path.to_owned(),
        })?;
        Ok(key.values.clone())
    }

    /// Every distinct (service, key, value name) drivers have read through
    /// a [`RegistryView`] of this store, sorted by service and name.
    pub fn driver_reads(&self) -> Vec<(String, RegistryKey, String)> {
        let reads = self.reads.lock().unwrap_or_else(|e| e.into_inner());
        let mut reads: Vec<_> = reads.iter().cloned().collect();
        reads.sort_by(|a, b| (&a.0, &a.2).cmp(&(&b.0, &b.2)));
        reads
    }

    /// The view a driver of `service` gets on the device
    /// `device_instance_path`: its [`driver_platform::Registry`].
    pub fn view(&self, service: &str, device_instance_path: &str) -> RegistryView {
        RegistryView {
            store: self.clone(),
            service: service.to_owned(),
            device_instance_path: device_instance_path.to_owned(),
        }
    }
}

/// What one driver (a service) sees of the registry on one device: its
/// service's `Parameters` key and the device's hardware key.
///
/// A value name containing `\` names a value in a subkey: everything before
/// the last `\` is the subkey path, the rest the value name. So the bus
/// filter reads child `IPoIB`'s hardware IDs as
/// `read(ServiceParameters, "IPoIB\\HardwareId")`, from
/// `Services\ibalbus\Parameters\IPoIB`.
#[derive(Debug, Clone)]
pub struct RegistryView {
    store: RegistryStore,
    service: String,
    device_instance_path: String,
}

impl RegistryView {
    /// The service this view belongs to.
    pub fn service(&self) -> &str {
        &self.service
    }

    /// The device this view belongs to.
    pub fn device_instance_path(&self) -> &str {
        &self.device_instance_path
    }

    /// The key path `key` maps to for this view.
    pub fn key_path(&self, key: RegistryKey) -> String {
        match key {
            RegistryKey::ServiceParameters => service_parameters_key(&self.service),
            RegistryKey::Device => device_parameters_key(&self.device_instance_path),
        }
    }
}

impl RegistryView {
    /// `ZwSetValueKey` under `key` (PASSIVE_LEVEL): a `name` containing
    /// `\` names a value in a subkey, created if absent, as
    /// [`Registry::read`] reads it.
    pub fn write(
        &self,
        key: RegistryKey,
        name: &str,
        value: RegValue,
    ) -> Result<(), RegistryError> {
        crate::irql::check_max("ZwSetValueKey", driver_platform::Irql::PASSIVE);
        let base = self.key_path(key);
        let (path, value_name) = match name.rsplit_once('\\') {
            Some((sub, value_name)) => (format!("{base}\\{sub}"), value_name),
            None => (base, name),
        };
        self.store.create_key(&path)?;
        self.store.set_value(&path, value_name, value)
    }

    /// `ZwDeleteKey` of the subkey `subkey` of `key` and everything under
    /// it (PASSIVE_LEVEL); an absent subkey is not an error.
    pub fn delete_subkey(&self, key: RegistryKey, subkey: &str) -> Result<(), RegistryError> {
        crate::irql::check_max("ZwDeleteKey", driver_platform::Irql::PASSIVE);
        let path = format!("{}\\{subkey}", self.key_path(key));
        if !self.store.key_exists(&path) {
            return Ok(());
        }
        self.store.delete_tree(&path)
    }
}

impl Registry for RegistryView {
    fn read(&self, key: RegistryKey, name: &str) -> Option<RegValue> {
        crate::irql::check_max("ZwQueryValueKey", driver_platform::Irql::PASSIVE);
        self.store
            .reads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert((self.service.clone(), key, name.to_owned()));
        let base = self.key_path(key);
        match name.rsplit_once('\\') {
            Some((sub, value)) => self.store.get_value(&format!("{base}\\{sub}"), value),
            None => self.store.get_value(&base, name),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_get_is_case_insensitive_and_keeps_case() {
        let r = RegistryStore::new();
        r.set_value(
            "Services\\IbalBus\\Parameters",
            "StaticChild",
            RegValue::MultiString(vec!["IPoIB".into()]),
        )
        .unwrap();
        assert_eq!(
            r.get_value("services\\IBALBUS\\parameters", "staticchild"),
            Some(RegValue::MultiString(vec!["IPoIB".into()]))
        );
        assert_eq!(r.subkeys("SERVICES").unwrap(), vec!["IbalBus".to_owned()]);
        assert!(r.key_exists("Services\\ibalbus"));
        assert!(!r.key_exists("Services\\other"));
        // Replacing keeps the first-set name and position.
        r.set_value("Services\\ibalbus\\Parameters", "Other", RegValue::Dword(1))
            .unwrap();
        r.set_value(
            "Services\\ibalbus\\Parameters",
            "STATICCHILD",
            RegValue::Dword(2),
        )
        .unwrap();
        let vals = r.values("Services\\ibalbus\\Parameters").unwrap();
        assert_eq!(
            vals,
            vec![
                ("StaticChild".to_owned(), RegValue::Dword(2)),
                ("Other".to_owned(), RegValue::Dword(1)),
            ]
        );
    }

    #[test]
    fn typed_values_round_trip() {
        let r = RegistryStore::new();
        let cases = [
            ("d", RegValue::Dword(0xFFFF)),
            ("s", RegValue::String("x".into())),
            ("m", RegValue::MultiString(vec!["a".into(), "b".into()])),
            ("b", RegValue::Binary(vec![1, 2, 3])),
            ("", RegValue::String("default".into())),
        ];
        for (n, v) in &cases {
            r.set_value("K", n, v.clone()).unwrap();
        }
        for (n, v) in &cases {
            assert_eq!(r.get_value("K", n).as_ref(), Some(v));
        }
    }

    #[test]
    fn delete_and_enumerate() {
        let r = RegistryStore::new();
        r.set_value("A\\B\\C", "v", RegValue::Dword(1)).unwrap();
        r.create_key("A\\a2").unwrap();
        assert_eq!(
            r.subkeys("A").unwrap(),
            vec!["a2".to_owned(), "B".to_owned()]
        );
        assert_eq!(
            r.delete_key("A\\B"),
            Err(RegistryError::HasSubkeys {
                path: "A\\B".into()
            })
        );
        assert_eq!(
            r.delete_value("A\\B\\C", "w"),
            Err(RegistryError::ValueNotFound {
                path: "A\\B\\C".into(),
                name: "w".into()
            })
        );
        r.delete_value("A\\B\\C", "V").unwrap();
        assert_eq!(r.get_value("A\\B\\C", "v"), None);
        r.delete_key("A\\B\\C").unwrap();
        r.delete_key("A\\B").unwrap();
        assert!(!r.key_exists("A\\B"));
        r.set_value("A\\x\\y", "v", RegValue::Dword(1)).unwrap();
        r.delete_tree("a\\X").unwrap();
        assert!(!r.key_exists("A\\x\\y"));
        assert_eq!(
            r.delete_key("A\\nope"),
            Err(RegistryError::KeyNotFound {
                path: "A\\nope".into()
            })
        );
        assert!(matches!(
            r.delete_tree(""),
            Err(RegistryError::InvalidPath { .. })
        ));
        assert!(matches!(
            r.subkeys("nope"),
            Err(RegistryError::KeyNotFound { .. })
        ));
        assert!(matches!(
            r.values("nope"),
            Err(RegistryError::KeyNotFound { .. })
        ));
    }

    #[test]
    fn invalid_paths_are_refused() {
        let r = RegistryStore::new();
        for bad in ["\\A", "A\\", "A\\\\B"] {
            assert!(
                matches!(
                    r.set_value(bad, "v", RegValue::Dword(0)),
                    Err(RegistryError::InvalidPath { .. })
                ),
                "{bad:?}"
            );
            assert_eq!(r.get_value(bad, "v"), None);
            assert!(!r.key_exists(bad));
        }
        let long = "k".repeat(MAX_KEY_NAME + 1);
        assert!(matches!(
            r.create_key(&long),
            Err(RegistryError::InvalidPath { .. })
        ));
        let long_name = "v".repeat(MAX_VALUE_NAME + 1);
        assert_eq!(
            r.set_value("K", &long_name, RegValue::Dword(0)),
            Err(RegistryError::InvalidValueName {
                len: MAX_VALUE_NAME + 1
            })
        );
    }

    #[test]
    fn view_maps_keys_and_subkey_names() {
        let r = RegistryStore::new();
        let inst = "PCI\\VEN_F1B0&DEV_0001\\3&0&0&10";
        r.set_value(
            &service_parameters_key("ibalbus"),
            "StaticChild",
            RegValue::MultiString(vec!["IPoIB".into()]),
        )
        .unwrap();
        r.set_value(
            &format!("{}\\IPoIB", service_parameters_key("ibalbus")),
            "PartitionKey",
            RegValue::Dword(0xFFFF),
        )
        .unwrap();
        r.set_value(
            &device_parameters_key(inst),
            "MSISupported",
            RegValue::Dword(1),
        )
        .unwrap();
        let v = r.view("ibalbus", inst);
        assert_eq!(v.service(), "ibalbus");
        assert_eq!(v.device_instance_path(), inst);
        assert_eq!(
            v.read_multi_string(RegistryKey::ServiceParameters, "StaticChild"),
            Some(vec!["IPoIB".to_owned()])
        );
        assert_eq!(
            v.read_dword(RegistryKey::ServiceParameters, "IPoIB\\PartitionKey"),
            Some(0xFFFF)
        );
        assert_eq!(v.read_dword(RegistryKey::Device, "MSISupported"), Some(1));
        assert_eq!(v.read_dword(RegistryKey::Device, "StaticChild"), None);
        // Another service on the same device sees its own parameters.
        let other = r.view("hcaminiport", inst);
        assert_eq!(
            other.read(RegistryKey::ServiceParameters, "StaticChild"),
            None
        );
        assert_eq!(
            other.read_dword(RegistryKey::Device, "MSISupported"),
            Some(1)
        );
        // Wrong type reads as absent through the typed helpers.
        assert_eq!(
            v.read_dword(RegistryKey::ServiceParameters, "StaticChild"),
            None
        );
        // Bad names never panic.
        assert_eq!(v.read(RegistryKey::Device, "\\"), None);
        assert_eq!(v.read(RegistryKey::Device, "a\\\\b"), None);
    }

    #[test]
    fn clones_share_and_threads_can_use_it() {
        let r = RegistryStore::new();
        let handles: Vec<_> = (0..4u32)
            .map(|i| {
                let r = r.clone();
                std::thread::spawn(move || {
                    r.set_value(&format!("T\\{i}"), "v", RegValue::Dword(i))
                        .unwrap();
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(r.subkeys("T").unwrap().len(), 4);
    }
}
