//! Bus drivers report child devices (PDOs) to the PnP manager.

use alloc::string::String;
use alloc::vec::Vec;

use ib_types::status::NtStatus;

/// What the PnP manager needs to know about a child device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChildDescription {
    /// Stable instance ID, unique among the bus's children (it survives
    /// re-enumeration, so the child keeps its devnode).
    pub instance_id: String,
    /// Hardware IDs, most specific first.
    pub hardware_ids: Vec<String>,
    /// Compatible IDs, most specific first.
    pub compatible_ids: Vec<String>,
    /// Human-readable description.
    pub description: String,
}

/// Child reporting (a KMDF child list). PASSIVE or DISPATCH_LEVEL: the PnP
/// manager re-enumerates asynchronously.
pub trait ChildBus: Send + Sync {
    /// Reports `child` present (added, or unchanged if already present).
    fn report_present(&self, child: ChildDescription) -> Result<(), NtStatus>;
    /// Reports the child with `instance_id` missing; the PnP manager
    /// removes it.
    fn report_missing(&self, instance_id: &str);
}
