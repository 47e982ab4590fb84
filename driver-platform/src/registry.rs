//! Registry reads: the driver's service key and the device's hardware key,
//! filled from the INF (and by administrators).

use alloc::string::String;
use alloc::vec::Vec;

/// Which key a value lives under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RegistryKey {
    /// `HKLM\System\CurrentControlSet\Services\<service>\Parameters`.
    ServiceParameters,
    /// The device's hardware key (`HKR` of the INF's `DDInstall.HW`).
    Device,
}

/// A registry value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegValue {
    /// `REG_DWORD`.
    Dword(u32),
    /// `REG_SZ`.
    String(String),
    /// `REG_MULTI_SZ`.
    MultiString(Vec<String>),
    /// `REG_BINARY`.
    Binary(Vec<u8>),
}

/// Read access to the registry. PASSIVE_LEVEL only (registry access pages).
pub trait Registry: Send + Sync {
    /// The value `name` under `key`, if present.
    fn read(&self, key: RegistryKey, name: &str) -> Option<RegValue>;

    /// A `REG_DWORD`, if present with that type.
    fn read_dword(&self, key: RegistryKey, name: &str) -> Option<u32> {
        match self.read(key, name)? {
            RegValue::Dword(v) => Some(v),
            _ => None,
        }
    }

    /// A `REG_MULTI_SZ`, if present with that type.
    fn read_multi_string(&self, key: RegistryKey, name: &str) -> Option<Vec<String>> {
        match self.read(key, name)? {
            RegValue::MultiString(v) => Some(v),
            _ => None,
        }
    }
}
