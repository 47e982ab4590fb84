//! A device's memory-mapped register space (a BAR).

/// Register access to one BAR. Offsets are bytes from the BAR's start;
/// accesses are naturally aligned. On Windows this is
/// `READ_REGISTER_ULONG`/`WRITE_REGISTER_ULONG64` on the mapping made in
/// prepare-hardware; out-of-range offsets are refused by the implementation
/// (reads return all ones, writes are dropped), never undefined behaviour.
///
/// Callable at any IRQL: register access never blocks.
pub trait Mmio: Send + Sync {
    /// Bytes of the BAR.
    fn len(&self) -> u64;
    /// True for an empty BAR.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// A 32-bit read.
    fn read32(&self, offset: u64) -> u32;
    /// A 32-bit write.
    fn write32(&self, offset: u64, value: u32);
    /// A 64-bit read.
    fn read64(&self, offset: u64) -> u64;
    /// A single 64-bit write (doorbells rely on its atomicity).
    fn write64(&self, offset: u64, value: u64);
}
