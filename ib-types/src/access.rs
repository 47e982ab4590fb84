//! Memory access rights (IBA 10.6.3, 11.2.8) and their consistency rules.

use bitflags::bitflags;

use crate::abi::AbiError;

bitflags! {
    /// Access rights of a memory region, memory window or QP.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct AccessFlags: u32 {
        /// The local HCA may write (receives, RDMA read responses).
        const LOCAL_WRITE = 1 << 0;
        /// Remote peers may RDMA-write.
        const REMOTE_WRITE = 1 << 1;
        /// Remote peers may RDMA-read.
        const REMOTE_READ = 1 << 2;
        /// Remote peers may issue atomics.
        const REMOTE_ATOMIC = 1 << 3;
        /// Memory windows may be bound to the region.
        const MW_BIND = 1 << 4;
    }
}

impl AccessFlags {
    /// Rights that expose memory to remote peers.
    pub const REMOTE: Self = Self::REMOTE_WRITE
        .union(Self::REMOTE_READ)
        .union(Self::REMOTE_ATOMIC);

    /// Reads raw flags; unknown bits are an error.
    pub const fn from_raw(raw: u32) -> Result<Self, AbiError> {
        match Self::from_bits(raw) {
            Some(flags) => Ok(flags),
            None => Err(AbiError::ReservedNotZero {
                field: "AccessFlags",
            }),
        }
    }

    /// The registration rule of IBA 11.2.8.1 (C11-13): remote write or remote
    /// atomic access requires local write access.
    pub const fn is_valid_for_region(self) -> bool {
        !self.intersects(Self::REMOTE_WRITE.union(Self::REMOTE_ATOMIC))
            || self.contains(Self::LOCAL_WRITE)
    }

    /// True when the rights grant any remote access, which is when a region
    /// or window gets a non-zero R_Key.
    pub const fn has_remote(self) -> bool {
        self.intersects(Self::REMOTE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_write_needs_local_write() {
        assert!(AccessFlags::empty().is_valid_for_region());
        assert!(AccessFlags::REMOTE_READ.is_valid_for_region());
        assert!(!AccessFlags::REMOTE_WRITE.is_valid_for_region());
        assert!(!AccessFlags::REMOTE_ATOMIC.is_valid_for_region());
        assert!((AccessFlags::REMOTE_ATOMIC | AccessFlags::LOCAL_WRITE).is_valid_for_region());
    }

    #[test]
    fn unknown_bits_rejected() {
        assert_eq!(AccessFlags::from_raw(0x1F), Ok(AccessFlags::all()));
        assert!(AccessFlags::from_raw(0x20).is_err());
        assert!(!AccessFlags::MW_BIND.has_remote());
        assert!(AccessFlags::REMOTE_READ.has_remote());
    }
}
