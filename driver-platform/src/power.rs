//! Power states.

/// Device power states. D0 is working; D3 is off (D1/D2 are not used by
/// this stack but exist in the model).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DevicePowerState {
    /// Working.
    D0,
    /// Light sleep.
    D1,
    /// Deeper sleep.
    D2,
    /// Off (context lost).
    D3,
}

/// System power states.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SystemPowerState {
    /// Working.
    S0,
    /// Sleep (standby).
    S3,
    /// Hibernate.
    S4,
    /// Shutdown.
    S5,
}

impl SystemPowerState {
    /// The device state a device enters for this system state (the default
    /// mapping of a device without wake: D0 in S0, D3 otherwise).
    pub const fn device_state(self) -> DevicePowerState {
        match self {
            Self::S0 => DevicePowerState::D0,
            _ => DevicePowerState::D3,
        }
    }
}
