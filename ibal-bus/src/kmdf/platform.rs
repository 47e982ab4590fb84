//! What `ibal-bus-core` needs from the platform, on WDF and WDM, that
//! only the bus filter needs:
//!
//! | core | here | Windows |
//! |---|---|---|
//! | `driver_platform::Registry` (`children::read_child_list`) | [`ParametersKey`] | `WdfDriverOpenParametersRegistryKey`; an entry's subkey with `WdfRegistryOpenKey`; `REG_SZ`/`REG_EXPAND_SZ`, `REG_MULTI_SZ`, `REG_DWORD`, `REG_BINARY` by `WdfRegistryQueryValue` |
//! | (the proxy's administrator IOCTL) | [`ParametersKey::write`], [`ParametersKey::delete_subkey`] | `WdfRegistryCreateKey` + `WdfRegistryAssignValue`; `WdfRegistryRemoveValue` + `WdfRegistryRemoveKey` |
//!
//! The rest comes from `kmdf-platform`, which the miniport's shell shares:
//! the spin lock (`lock_api::RawMutex` of the AL and of this shell), the
//! IRQL query, the event (`AccessLayer::close`), the `WDFREQUEST`
//! (`AccessLayer::submit`) and the UTF-16 strings.

use alloc::string::String;
use alloc::vec::Vec;
use core::ptr;

use driver_platform::{NtStatus, RegValue, Registry, RegistryKey};
use kmdf_platform::string::WideString;
use wdk_sys::{
    DELETE, KEY_READ, KEY_SET_VALUE, KEY_WRITE, REG_BINARY, REG_DWORD, REG_EXPAND_SZ, REG_MULTI_SZ,
    REG_OPTION_NON_VOLATILE, REG_SZ, ULONG, WDF_NO_OBJECT_ATTRIBUTES, WDFDRIVER, WDFKEY,
    call_unsafe_wdf_function_binding,
};

/// The strings of UTF-16 `units` split at NULs (a `REG_MULTI_SZ`: the
/// empty string ends the list), invalid units replaced.
fn multi_string(units: &[u16]) -> Vec<String> {
    units
        .split(|unit| *unit == 0)
        .take_while(|s| !s.is_empty())
        .map(|s| {
            char::decode_utf16(s.iter().copied())
                .map(|c| c.unwrap_or(char::REPLACEMENT_CHARACTER))
                .collect()
        })
        .collect()
}

// ---------------------------------------------------------------------------
// Registry

/// The largest registry value read (the child list's values are short; a
/// larger one is refused rather than allocated).
const MAX_VALUE_BYTES: usize = 16 * 1024;

/// The driver's `Parameters` key (`Services\ibalbus\Parameters`), opened
/// with `WdfDriverOpenParametersRegistryKey` and closed on drop. A name
/// `entry\value` reads `value` of the subkey `entry` (the child list's
/// layout, `ibal_bus_core::children`). PASSIVE_LEVEL.
#[derive(Debug)]
pub struct ParametersKey {
    key: WDFKEY,
}

// SAFETY: a WDFKEY may be used from any thread (reads are PASSIVE_LEVEL);
// it is closed once, by its owner, on drop.
unsafe impl Send for ParametersKey {}
// SAFETY: reads through a shared reference do not mutate the handle.
unsafe impl Sync for ParametersKey {}

impl ParametersKey {
    /// Opens the Parameters key of `driver` for reading.
    ///
    /// # Safety
    /// `driver` is the live driver object; PASSIVE_LEVEL.
    pub unsafe fn open(driver: WDFDRIVER) -> Result<Self, NtStatus> {
        // SAFETY: forwarded from the caller.
        unsafe { Self::open_with(driver, KEY_READ) }
    }

    /// Opens the Parameters key of `driver` for reading and writing (the
    /// proxy's administrator IOCTL).
    ///
    /// # Safety
    /// `driver` is the live driver object; PASSIVE_LEVEL.
    pub unsafe fn open_writable(driver: WDFDRIVER) -> Result<Self, NtStatus> {
        // SAFETY: forwarded from the caller.
        unsafe { Self::open_with(driver, KEY_READ | KEY_WRITE) }
    }

    /// # Safety
    /// As [`Self::open`].
    unsafe fn open_with(driver: WDFDRIVER, access: u32) -> Result<Self, NtStatus> {
        let mut key: WDFKEY = ptr::null_mut();
        // SAFETY: the live driver object; out pointer valid; PASSIVE_LEVEL
        // (the caller's contract).
        let status = unsafe {
            call_unsafe_wdf_function_binding!(
                WdfDriverOpenParametersRegistryKey,
                driver,
                access,
                WDF_NO_OBJECT_ATTRIBUTES,
                &mut key
            )
        };
        if status < 0 {
            return Err(NtStatus::from_raw(status as u32));
        }
        Ok(Self { key })
    }

    /// The value `name` of the open key `key`, decoded by its type.
    fn query(key: WDFKEY, name: &str) -> Option<RegValue> {
        let mut name = WideString::new(name)?;
        let unicode = name.unicode();
        let mut needed: ULONG = 0;
        let mut kind: ULONG = 0;
        // Sizing call: no buffer, the framework answers the length.
        // SAFETY: an open key; `unicode` describes `name`, alive for the
        // call; out pointers valid.
        let _ = unsafe {
            call_unsafe_wdf_function_binding!(
                WdfRegistryQueryValue,
                key,
                &unicode,
                0,
                ptr::null_mut(),
                &mut needed,
                &mut kind
            )
        };
        let len = needed as usize;
        if len == 0 || len > MAX_VALUE_BYTES {
            return None;
        }
        let mut data: Vec<u8> = Vec::new();
        data.try_reserve_exact(len).ok()?;
        data.resize(len, 0);
        // SAFETY: as above; `data` holds `needed` writable bytes.
        let status = unsafe {
            call_unsafe_wdf_function_binding!(
                WdfRegistryQueryValue,
                key,
                &unicode,
                needed,
                data.as_mut_ptr().cast(),
                &mut needed,
                &mut kind
            )
        };
        if status < 0 {
            return None;
        }
        data.truncate(needed as usize);
        let units: Vec<u16> = data
            .chunks_exact(2)
            .map(|pair| u16::from_le_bytes([pair[0], pair[1]]))
            .collect();
        match kind {
            REG_SZ | REG_EXPAND_SZ => Some(RegValue::String(
                multi_string(&units).into_iter().next().unwrap_or_default(),
            )),
            REG_MULTI_SZ => Some(RegValue::MultiString(multi_string(&units))),
            REG_DWORD => {
                let bytes: [u8; 4] = data.get(..4)?.try_into().ok()?;
                Some(RegValue::Dword(u32::from_le_bytes(bytes)))
            }
            REG_BINARY => Some(RegValue::Binary(data)),
            _ => None,
        }
    }
}

impl ParametersKey {
    /// Writes `value` as `name` (`entry\value` writes `value` of the
    /// subkey `entry`, created if missing), as the reader reads it back.
    /// The key must have been opened with [`Self::open_writable`].
    /// PASSIVE_LEVEL.
    pub fn write(&self, name: &str, value: &RegValue) -> Result<(), NtStatus> {
        let Some((subkey, value_name)) = name.rsplit_once('\\') else {
            return Self::assign(self.key, name, value);
        };
        let mut path = WideString::new(subkey).ok_or(NtStatus::INVALID_PARAMETER)?;
        let unicode = path.unicode();
        let mut child: WDFKEY = ptr::null_mut();
        // SAFETY: an open parent key; `unicode` describes `path`, alive for
        // the call; no disposition wanted; out pointer valid; PASSIVE_LEVEL
        // (this method's contract).
        let status = unsafe {
            call_unsafe_wdf_function_binding!(
                WdfRegistryCreateKey,
                self.key,
                &unicode,
                KEY_READ | KEY_WRITE,
                REG_OPTION_NON_VOLATILE,
                ptr::null_mut(),
                WDF_NO_OBJECT_ATTRIBUTES,
                &mut child
            )
        };
        if status < 0 {
            return Err(NtStatus::from_raw(status as u32));
        }
        let written = Self::assign(child, value_name, value);
        // SAFETY: created or opened just above, closed once.
        unsafe { call_unsafe_wdf_function_binding!(WdfRegistryClose, child) };
        written
    }

    /// Deletes the subkey `name` with the `values` it holds (an entry of
    /// the child list has no subkeys of its own). PASSIVE_LEVEL.
    pub fn delete_subkey(&self, name: &str, values: &[&str]) -> Result<(), NtStatus> {
        let child = Self::open_subkey(self.key, name, DELETE | KEY_SET_VALUE)?;
        // WdfRegistryRemoveKey wants the key emptied first; a value already
        // missing is not an error.
        for value in values {
            if let Some(mut value) = WideString::new(value) {
                let unicode = value.unicode();
                // SAFETY: the key opened above with KEY_SET_VALUE; the name
                // lives for the call.
                let _ = unsafe {
                    call_unsafe_wdf_function_binding!(WdfRegistryRemoveValue, child, &unicode)
                };
            }
        }
        // SAFETY: the key opened above with DELETE access; the framework
        // deletes the key object too, so it is not closed afterwards.
        let status = unsafe { call_unsafe_wdf_function_binding!(WdfRegistryRemoveKey, child) };
        if status < 0 {
            return Err(NtStatus::from_raw(status as u32));
        }
        Ok(())
    }

    /// Opens the existing subkey `name` of the open key `parent` with
    /// `access` (`WdfRegistryOpenKey`); the caller closes or removes it.
    /// PASSIVE_LEVEL.
    fn open_subkey(parent: WDFKEY, name: &str, access: u32) -> Result<WDFKEY, NtStatus> {
        let mut path = WideString::new(name).ok_or(NtStatus::INVALID_PARAMETER)?;
        let unicode = path.unicode();
        let mut child: WDFKEY = ptr::null_mut();
        // SAFETY: an open parent key; `unicode` describes `path`, alive for
        // the call; out pointer valid; PASSIVE_LEVEL (the caller's).
        let status = unsafe {
            call_unsafe_wdf_function_binding!(
                WdfRegistryOpenKey,
                parent,
                &unicode,
                access,
                WDF_NO_OBJECT_ATTRIBUTES,
                &mut child
            )
        };
        if status < 0 {
            return Err(NtStatus::from_raw(status as u32));
        }
        Ok(child)
    }

    /// `WdfRegistryAssignValue` of `value` as `name` under the open `key`.
    fn assign(key: WDFKEY, name: &str, value: &RegValue) -> Result<(), NtStatus> {
        let (kind, mut data) = registry_data(value);
        let length = ULONG::try_from(data.len()).map_err(|_| NtStatus::INVALID_PARAMETER)?;
        let mut name = WideString::new(name).ok_or(NtStatus::INVALID_PARAMETER)?;
        let unicode = name.unicode();
        // SAFETY: an open key; `unicode` and `data` live for the call, which
        // copies `length` bytes of `data`; PASSIVE_LEVEL.
        let status = unsafe {
            call_unsafe_wdf_function_binding!(
                WdfRegistryAssignValue,
                key,
                &unicode,
                kind,
                length,
                data.as_mut_ptr().cast()
            )
        };
        if status < 0 {
            return Err(NtStatus::from_raw(status as u32));
        }
        Ok(())
    }
}

/// A value's registry type and bytes: strings in UTF-16LE, each with its
/// terminator, a `REG_MULTI_SZ` ended by an empty string.
fn registry_data(value: &RegValue) -> (ULONG, Vec<u8>) {
    fn push_string(bytes: &mut Vec<u8>, text: &str) {
        for unit in text.encode_utf16().chain(core::iter::once(0)) {
            bytes.extend_from_slice(&unit.to_le_bytes());
        }
    }
    let mut bytes = Vec::new();
    match value {
        RegValue::String(text) => {
            push_string(&mut bytes, text);
            (REG_SZ, bytes)
        }
        RegValue::MultiString(texts) => {
            for text in texts {
                push_string(&mut bytes, text);
            }
            bytes.extend_from_slice(&[0, 0]);
            (REG_MULTI_SZ, bytes)
        }
        RegValue::Dword(v) => (REG_DWORD, v.to_le_bytes().to_vec()),
        RegValue::Binary(data) => (REG_BINARY, data.clone()),
    }
}

impl Registry for ParametersKey {
    fn read(&self, key: RegistryKey, name: &str) -> Option<RegValue> {
        if !matches!(key, RegistryKey::ServiceParameters) {
            return None;
        }
        let Some((subkey, value)) = name.rsplit_once('\\') else {
            return Self::query(self.key, name);
        };
        // PASSIVE_LEVEL: the trait's contract.
        let child = Self::open_subkey(self.key, subkey, KEY_READ).ok()?;
        let found = Self::query(child, value);
        // SAFETY: opened just above, closed once.
        unsafe { call_unsafe_wdf_function_binding!(WdfRegistryClose, child) };
        found
    }
}

impl Drop for ParametersKey {
    fn drop(&mut self) {
        // SAFETY: the key opened in `open`, closed once (drop).
        unsafe { call_unsafe_wdf_function_binding!(WdfRegistryClose, self.key) };
    }
}
