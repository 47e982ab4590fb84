//! The client's device settings, read from its hardware key
//! (`Enum\<instance>\Device Parameters`, `inf/ib-port-client.inf`'s
//! `PortClient_HW_AddReg`). The registry is written by setup and by
//! administrators: a value of the wrong type or out of range is refused
//! with its reason, and the client runs with the default instead.

use driver_platform::{RegValue, Registry, RegistryKey};

/// Receives the client keeps posted on each of its QPs (UD and RC).
pub const RECEIVE_DEPTH: &str = "ReceiveDepth";
/// The INF's value, and the default when the value is absent or refused.
pub const DEFAULT_RECEIVE_DEPTH: u32 = 256;
/// The most the client accepts (its buffer holds this many slots).
pub const MAX_RECEIVE_DEPTH: u32 = 256;

/// Why a setting was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigRefusal {
    /// `ReceiveDepth` is not a `REG_DWORD`.
    ReceiveDepthNotDword,
    /// `ReceiveDepth` is 0 or above [`MAX_RECEIVE_DEPTH`].
    ReceiveDepthOutOfRange(u32),
}

/// The settings the client runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// Receives per QP.
    pub receive_depth: u32,
    /// A value that was refused (the default is used instead).
    pub refused: Option<ConfigRefusal>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            receive_depth: DEFAULT_RECEIVE_DEPTH,
            refused: None,
        }
    }
}

/// Reads the settings (PASSIVE_LEVEL: registry reads). Never fails.
pub fn read_config(registry: &impl Registry) -> Config {
    let refused = match registry.read(RegistryKey::Device, RECEIVE_DEPTH) {
        None => None,
        Some(RegValue::Dword(depth)) if (1..=MAX_RECEIVE_DEPTH).contains(&depth) => {
            return Config {
                receive_depth: depth,
                refused: None,
            };
        }
        Some(RegValue::Dword(depth)) => Some(ConfigRefusal::ReceiveDepthOutOfRange(depth)),
        Some(_) => Some(ConfigRefusal::ReceiveDepthNotDword),
    };
    Config {
        refused,
        ..Config::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::string::String;

    struct One(Option<RegValue>);

    impl Registry for One {
        fn read(&self, key: RegistryKey, name: &str) -> Option<RegValue> {
            (key == RegistryKey::Device && name == RECEIVE_DEPTH)
                .then(|| self.0.clone())
                .flatten()
        }
    }

    #[test]
    fn each_value_is_taken_or_refused_with_its_reason() {
        let depth = |v| read_config(&One(v));
        assert_eq!(depth(None), Config::default());
        assert_eq!(depth(Some(RegValue::Dword(16))).receive_depth, 16);
        assert_eq!(depth(Some(RegValue::Dword(256))).refused, None);
        for bad in [0, 257, u32::MAX] {
            assert_eq!(
                depth(Some(RegValue::Dword(bad))),
                Config {
                    receive_depth: DEFAULT_RECEIVE_DEPTH,
                    refused: Some(ConfigRefusal::ReceiveDepthOutOfRange(bad)),
                }
            );
        }
        assert_eq!(
            depth(Some(RegValue::String(String::from("16")))).refused,
            Some(ConfigRefusal::ReceiveDepthNotDword)
        );
        assert_eq!(
            depth(Some(RegValue::Binary(alloc::vec![16, 0, 0, 0]))).receive_depth,
            DEFAULT_RECEIVE_DEPTH
        );
    }
}
