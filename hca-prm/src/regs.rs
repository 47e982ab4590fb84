//! BAR0 control registers (PRM sections 1 and 2) and the device's PCI identity.

use bitflags::bitflags;

/// PCI vendor ID (PRM 1): not assigned to any vendor in the PCI ID database.
pub const PCI_VENDOR_ID: u16 = 0xF1B0;
/// PCI device ID of the physical function.
pub const PCI_DEVICE_ID: u16 = 0x0001;
/// PCI revision ID.
pub const PCI_REVISION: u8 = 0x01;
/// PCI subsystem vendor ID.
pub const PCI_SUBSYSTEM_VENDOR_ID: u16 = 0xF1B0;
/// PCI subsystem ID.
pub const PCI_SUBSYSTEM_ID: u16 = 0x0001;
/// PCI class code: network controller (0x02), InfiniBand (0x07), interface 0.
pub const PCI_CLASS_CODE: [u8; 3] = [0x02, 0x07, 0x00];
/// IEEE vendor ID reported in the CA attributes: locally administered.
pub const IEEE_VENDOR_ID: u32 = 0x02_0000;

/// Bytes of one BAR0 page (the register page and each UAR page).
pub const PAGE_SIZE: u64 = 4096;

/// `MAGIC` value: the bytes `"HCA1"`.
pub const MAGIC_VALUE: u32 = u32::from_le_bytes(*b"HCA1");
/// PRM major version this crate describes.
pub const PRM_VERSION_MAJOR: u16 = 1;
/// PRM minor version this crate describes.
pub const PRM_VERSION_MINOR: u16 = 0;

/// BAR0 size for a device with `num_uars` UAR pages.
pub const fn bar0_size(num_uars: u16) -> u64 {
    PAGE_SIZE * (1 + num_uars as u64)
}

/// Register offsets in BAR0 page 0 (PRM 2).
pub mod offset {
    /// RO 32: [`super::MAGIC_VALUE`].
    pub const MAGIC: u64 = 0x000;
    /// RO 32: `major << 16 | minor`.
    pub const PRM_VERSION: u64 = 0x004;
    /// RO 64: firmware version.
    pub const FW_VERSION: u64 = 0x008;
    /// WO 32: [`super::Control`].
    pub const CONTROL: u64 = 0x010;
    /// RO 32: [`super::Status`].
    pub const STATUS: u64 = 0x014;
    /// RW 64: command queue bus address.
    pub const CMDQ_BASE: u64 = 0x018;
    /// RW 32: [`super::CmdqConfig`].
    pub const CMDQ_CONFIG: u64 = 0x020;
    /// WO 32: command producer counter.
    pub const CMDQ_DOORBELL: u64 = 0x024;
    /// RO 32: command consumer counter.
    pub const CMDQ_CONSUMER: u64 = 0x028;
    /// RO 32: DMA faults counted.
    pub const DMA_FAULTS: u64 = 0x040;
    /// RO 32: doorbells ignored.
    pub const DROPPED_DOORBELLS: u64 = 0x044;
    /// RO 32: commands completed with a non-zero status.
    pub const BAD_COMMANDS: u64 = 0x048;
    /// WO 32 each, 8 bytes apart: event queue doorbells.
    pub const EQ_DOORBELL_BASE: u64 = 0x800;
}

/// Offset of `EQ_DOORBELL[eqn]`, if `eqn` has a register (at most 256 EQs).
pub const fn eq_doorbell_offset(eqn: u32) -> Option<u64> {
    if eqn < 256 {
        Some(offset::EQ_DOORBELL_BASE + 8 * eqn as u64)
    } else {
        None
    }
}

/// The EQ number whose doorbell lives at `offset`, if any.
pub const fn eqn_of_doorbell(offset: u64) -> Option<u32> {
    if offset >= offset::EQ_DOORBELL_BASE
        && offset < offset::EQ_DOORBELL_BASE + 8 * 256
        && offset.is_multiple_of(8)
    {
        Some(((offset - offset::EQ_DOORBELL_BASE) / 8) as u32)
    } else {
        None
    }
}

bitflags! {
    /// `CONTROL` register bits.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct Control: u32 {
        /// Reset the device.
        const RESET = 1 << 0;
    }
}

bitflags! {
    /// `STATUS` register bits (the fatal syndrome is read with
    /// [`Status::fatal_syndrome`]).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct Status: u32 {
        /// Reset finished; the device accepts register writes.
        const READY = 1 << 0;
        /// `INIT_HCA` succeeded.
        const INITIALIZED = 1 << 1;
        /// The command queue is enabled.
        const CMDQ_ENABLED = 1 << 2;
        /// Catastrophic error: only a reset recovers.
        const FATAL = 1 << 31;
        /// The syndrome field, bits 16-23.
        const SYNDROME_MASK = 0xFF << 16;
    }
}

impl Status {
    /// The register value with `syndrome` in bits 16-23.
    pub const fn with_syndrome(self, syndrome: FatalSyndrome) -> Self {
        Self::from_bits_retain(self.bits() & !Self::SYNDROME_MASK.bits() | (syndrome as u32) << 16)
    }

    /// The fatal syndrome byte.
    pub const fn fatal_syndrome(self) -> u8 {
        (self.bits() >> 16) as u8
    }
}

/// Why the device declared a catastrophic error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FatalSyndrome {
    /// An event queue overflowed.
    EqOverflow = 0x01,
    /// A DMA fault while writing a completion or event that cannot be dropped.
    DmaFault = 0x02,
    /// An internal error (including one injected by a test).
    Internal = 0x03,
}

/// `CMDQ_CONFIG`: the ring size and the enable bit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct CmdqConfig {
    /// Entries = 2^log_size.
    pub log_size: u8,
    /// The queue is enabled.
    pub enable: bool,
}

impl CmdqConfig {
    const ENABLE: u32 = 1 << 31;
    const LOG_SIZE_MASK: u32 = 0xF;

    /// The register value.
    pub const fn to_bits(self) -> u32 {
        (self.log_size as u32 & Self::LOG_SIZE_MASK) | if self.enable { Self::ENABLE } else { 0 }
    }

    /// Reads a register value; other bits must be zero.
    pub const fn from_bits(bits: u32) -> Option<Self> {
        if bits & !(Self::ENABLE | Self::LOG_SIZE_MASK) != 0 {
            return None;
        }
        Some(Self {
            log_size: (bits & Self::LOG_SIZE_MASK) as u8,
            enable: bits & Self::ENABLE != 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_and_offsets() {
        assert_eq!(MAGIC_VALUE, 0x3141_4348);
        assert_eq!(bar0_size(1023), 4 << 20);
        assert_eq!(eq_doorbell_offset(0), Some(0x800));
        assert_eq!(eq_doorbell_offset(255), Some(0x800 + 8 * 255));
        assert_eq!(eq_doorbell_offset(256), None);
        assert_eq!(eqn_of_doorbell(0x818), Some(3));
        assert_eq!(eqn_of_doorbell(0x81C), None);
        assert_eq!(eqn_of_doorbell(0x7F8), None);
    }

    #[test]
    fn status_syndrome() {
        let s = (Status::READY | Status::FATAL).with_syndrome(FatalSyndrome::DmaFault);
        assert_eq!(s.bits(), 0x8002_0001);
        assert_eq!(s.fatal_syndrome(), 2);
    }

    #[test]
    fn cmdq_config_bits() {
        let c = CmdqConfig {
            log_size: 4,
            enable: true,
        };
        assert_eq!(c.to_bits(), 0x8000_0004);
        assert_eq!(CmdqConfig::from_bits(0x8000_0004), Some(c));
        assert_eq!(CmdqConfig::from_bits(0x10), None);
    }
}
