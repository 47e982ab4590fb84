//! Interrupt request levels (IRQL), the Windows rule of what code may do
//! where: PASSIVE_LEVEL may wait and touch pageable memory and the registry;
//! DISPATCH_LEVEL (DPCs, spin locks held) may not; device IRQL (ISRs) may
//! only acknowledge hardware and queue a DPC.

use core::fmt;

/// An interrupt request level.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Irql(u8);

impl Irql {
    /// Threads, work items: may block, page, read the registry.
    pub const PASSIVE: Self = Self(0);
    /// APC_LEVEL.
    pub const APC: Self = Self(1);
    /// DPCs, and code holding a spin lock: must not block.
    pub const DISPATCH: Self = Self(2);
    /// The lowest device IRQL.
    pub const DEVICE_MIN: Self = Self(3);
    /// The highest IRQL this model uses.
    pub const HIGH: Self = Self(31);

    /// A device IRQL (`3..=31`), clamped into that range.
    pub const fn device(level: u8) -> Self {
        if level < 3 {
            Self::DEVICE_MIN
        } else if level > 31 {
            Self::HIGH
        } else {
            Self(level)
        }
    }

    /// The raw level.
    pub const fn level(self) -> u8 {
        self.0
    }

    /// True at DISPATCH_LEVEL or above: no blocking, no paging.
    pub const fn is_elevated(self) -> bool {
        self.0 >= Self::DISPATCH.0
    }
}

impl fmt::Debug for Irql {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            0 => f.write_str("PASSIVE_LEVEL"),
            1 => f.write_str("APC_LEVEL"),
            2 => f.write_str("DISPATCH_LEVEL"),
            n => write!(f, "DIRQL({n})"),
        }
    }
}

/// Asks the platform the IRQL of the calling thread (`KeGetCurrentIrql`).
pub trait IrqlQuery: Send + Sync {
    /// The current IRQL. Callable at any IRQL.
    fn current_irql(&self) -> Irql;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordering_and_names() {
        assert!(Irql::PASSIVE < Irql::DISPATCH && Irql::DISPATCH < Irql::device(5));
        assert!(!Irql::APC.is_elevated() && Irql::DISPATCH.is_elevated());
        assert_eq!(Irql::device(1), Irql::DEVICE_MIN);
        assert_eq!(Irql::device(99), Irql::HIGH);
        assert_eq!(format!("{:?}", Irql::DISPATCH), "DISPATCH_LEVEL");
        assert_eq!(format!("{:?}", Irql::device(7)), "DIRQL(7)");
    }
}
