//! The device's view of the host: memory reached only through bus addresses
//! (the platform's DMA remapping), and interrupt vectors.
//!
//! [`HostMemory`] is the single door from the device into host memory. The
//! simulated Windows host implements it with its IOMMU model; [`SimMemory`]
//! here is a small, self-contained implementation for the device's own tests
//! and tools: host buffers, mapped to bus addresses that never equal their
//! buffer offsets, with every access outside a live mapping reported as a
//! [`DmaFault`] and counted — never a crash.

use std::collections::BTreeMap;
use std::sync::Mutex;

/// Which way a faulting access went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DmaDirection {
    /// Device read from host memory.
    Read,
    /// Device write to host memory.
    Write,
}

/// An access outside a live DMA mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
#[error("DMA fault: {direction:?} of {len} bytes at bus address {addr:#x}")]
pub struct DmaFault {
    /// Bus address of the access.
    pub addr: u64,
    /// Bytes accessed.
    pub len: usize,
    /// Read or write.
    pub direction: DmaDirection,
}

/// Which side of a copy between two memories faulted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum CopyFault {
    /// Reading the source.
    #[error("source: {0}")]
    Source(DmaFault),
    /// Writing the destination.
    #[error("destination: {0}")]
    Destination(DmaFault),
}

/// A copy from `src` to `dest` through a bounce buffer: a read, then a
/// write — what [`HostMemory::copy_to`] does by default, and what an
/// implementation that overrides it does for a memory of another kind.
pub fn bounce_copy<S: HostMemory + ?Sized>(
    src: &S,
    from: u64,
    dest: &dyn HostMemory,
    to: u64,
    len: usize,
) -> Result<(), CopyFault> {
    let mut bounce = vec![0; len];
    src.read(from, &mut bounce).map_err(CopyFault::Source)?;
    dest.write(to, &bounce).map_err(CopyFault::Destination)
}

/// Host memory as the device sees it.
///
/// Implementations take `&self` because the CPU side uses the same memory
/// concurrently; an access either completes entirely or faults without
/// touching memory.
pub trait HostMemory: Send + Sync {
    /// Copies `buf.len()` bytes from bus address `addr`.
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), DmaFault>;
    /// Copies `data` to bus address `addr`.
    fn write(&self, addr: u64, data: &[u8]) -> Result<(), DmaFault>;

    /// Checks, touching no byte, that the device may access each
    /// `(bus address, length)` piece in `direction`: `Some(Err((i, fault)))`
    /// for the first piece `i` refused (a fault, counted as the access
    /// would be), `None` when this memory cannot tell without accessing.
    /// Direct placement (the fast mode) probes a message's payload before
    /// the receiver acts on it, and a destination before it defers a copy
    /// there ([`copy_to`](Self::copy_to)); without a probe it reads each
    /// payload into a packet buffer first. A memory that probes also
    /// accepts one `copy_to` for pieces contiguous on both sides, so every
    /// mapping must be separately probed (adjacent mappings of another
    /// buffer in bus space would merge: `SimMemory` leaves a hole).
    fn probe(
        &self,
        pieces: &[(u64, usize)],
        direction: DmaDirection,
    ) -> Option<Result<(), (usize, DmaFault)>> {
        let _ = (pieces, direction);
        None
    }

    /// Copies `len` bytes from bus address `from` of this memory to bus
    /// address `to` of `dest` (possibly this memory), as a DMA engine
    /// moving data between two devices' views does. All or nothing: a
    /// fault on either side touches no byte. The default goes through a
    /// bounce buffer; an implementation that can reach both memories copies
    /// once.
    fn copy_to(
        &self,
        from: u64,
        dest: &dyn HostMemory,
        to: u64,
        len: usize,
    ) -> Result<(), CopyFault> {
        bounce_copy(self, from, dest, to, len)
    }

    /// This memory as [`Any`](std::any::Any), for a `copy_to` that
    /// recognises a destination of its own type; `None` by default.
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }
}

/// Where the device's interrupts go.
pub trait InterruptSink: Send + Sync {
    /// Raises MSI-X vector `vector`.
    fn raise(&self, vector: u16);
}

/// A host buffer allocated in a [`SimMemory`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufferId(u32);

/// Bytes of a mapping granule: mappings start and end on these boundaries.
pub const SIM_PAGE: u64 = 4096;

#[derive(Debug)]
struct Mapping {
    len: u64,
    buffer: BufferId,
    offset: u64,
}

#[derive(Debug, Default)]
struct Inner {
    buffers: BTreeMap<BufferId, Vec<u8>>,
    /// Keyed by bus start address.
    mappings: BTreeMap<u64, Mapping>,
    next_buffer: u32,
    next_bus: u64,
    faults: u64,
}

impl Inner {
    /// The mapping containing `addr..addr+len` entirely, if any.
    fn resolve(&self, addr: u64, len: usize) -> Option<(BufferId, u64)> {
        let (&start, m) = self.mappings.range(..=addr).next_back()?;
        let end = addr.checked_add(len as u64)?;
        if end <= start + m.len {
            Some((m.buffer, m.offset + (addr - start)))
        } else {
            None
        }
    }
}

/// A self-contained host memory with an IOMMU-style mapping table.
///
/// Bus addresses are handed out from `bus_base` upward, page by page, and
/// never reused while a mapping is live, so they differ from buffer offsets
/// and from the bus addresses of another `SimMemory` with another base.
#[derive(Debug)]
pub struct SimMemory {
    inner: Mutex<Inner>,
}

impl SimMemory {
    /// An empty memory whose mappings start at `bus_base` (page aligned).
    pub fn new(bus_base: u64) -> Self {
        Self {
            inner: Mutex::new(Inner {
                next_bus: bus_base & !(SIM_PAGE - 1),
                ..Inner::default()
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A poisoned lock means a test already panicked; keep going so the
        // original panic is the one reported.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Allocates a zero-filled host buffer of `len` bytes.
    pub fn alloc(&self, len: usize) -> BufferId {
        let mut inner = self.lock();
        let id = BufferId(inner.next_buffer);
        inner.next_buffer += 1;
        inner.buffers.insert(id, vec![0; len]);
        id
    }

    /// Frees a buffer; mappings of it are removed too (a device access to
    /// them faults from then on, like a use-after-free under an IOMMU).
    pub fn free(&self, id: BufferId) {
        let mut inner = self.lock();
        inner.buffers.remove(&id);
        inner.mappings.retain(|_, m| m.buffer != id);
    }

    /// Maps `len` bytes of `id` from `offset` (both multiples of
    /// [`SIM_PAGE`]) and returns the bus address. `None` when the range is
    /// not inside the buffer or not page aligned.
    pub fn map(&self, id: BufferId, offset: u64, len: u64) -> Option<u64> {
        let mut inner = self.lock();
        let buf_len = inner.buffers.get(&id)?.len() as u64;
        if !offset.is_multiple_of(SIM_PAGE) || len == 0 || offset.checked_add(len)? > buf_len {
            return None;
        }
        let bus = inner.next_bus;
        let pages = len.div_ceil(SIM_PAGE);
        // Leave a one-page hole after every mapping so an overrun faults.
        inner.next_bus = bus + (pages + 1) * SIM_PAGE;
        inner.mappings.insert(
            bus,
            Mapping {
                len,
                buffer: id,
                offset,
            },
        );
        Some(bus)
    }

    /// Removes the mapping starting at `bus`; false if there was none.
    pub fn unmap(&self, bus: u64) -> bool {
        self.lock().mappings.remove(&bus).is_some()
    }

    /// Live mappings.
    pub fn mapping_count(&self) -> usize {
        self.lock().mappings.len()
    }

    /// DMA faults seen so far.
    pub fn faults(&self) -> u64 {
        self.lock().faults
    }

    /// CPU read from a buffer. Panics if the range is outside the buffer:
    /// this is the test driver's own memory, and a bad range is a test bug.
    pub fn cpu_read(&self, id: BufferId, offset: usize, out: &mut [u8]) {
        let inner = self.lock();
        let buf = inner.buffers.get(&id).expect("live buffer");
        out.copy_from_slice(&buf[offset..offset + out.len()]);
    }

    /// CPU write to a buffer (see [`cpu_read`](Self::cpu_read)).
    pub fn cpu_write(&self, id: BufferId, offset: usize, data: &[u8]) {
        let mut inner = self.lock();
        let buf = inner.buffers.get_mut(&id).expect("live buffer");
        buf[offset..offset + data.len()].copy_from_slice(data);
    }
}

impl SimMemory {
    /// Resolves a device access of `len` bytes at `addr`, counting a fault
    /// when it is refused.
    fn resolve_or_fault(
        inner: &mut Inner,
        addr: u64,
        len: usize,
        direction: DmaDirection,
    ) -> Result<(BufferId, usize), DmaFault> {
        match inner.resolve(addr, len) {
            Some((id, at)) => Ok((id, at as usize)),
            None => {
                inner.faults += 1;
                Err(DmaFault {
                    addr,
                    len,
                    direction,
                })
            }
        }
    }
}

/// Copies `len` bytes from `from` in `src` to `to` in `dst`, two memories
/// locked by the caller; the source is resolved first.
fn copy_between(
    src: &mut Inner,
    from: u64,
    dst: &mut Inner,
    to: u64,
    len: usize,
) -> Result<(), CopyFault> {
    let (src_id, src_at) = SimMemory::resolve_or_fault(src, from, len, DmaDirection::Read)
        .map_err(CopyFault::Source)?;
    let (dst_id, dst_at) = SimMemory::resolve_or_fault(dst, to, len, DmaDirection::Write)
        .map_err(CopyFault::Destination)?;
    let out = dst.buffers.get_mut(&dst_id).expect("mapped buffer is live");
    out[dst_at..dst_at + len].copy_from_slice(&src.buffers[&src_id][src_at..src_at + len]);
    Ok(())
}

impl HostMemory for SimMemory {
    fn probe(
        &self,
        pieces: &[(u64, usize)],
        direction: DmaDirection,
    ) -> Option<Result<(), (usize, DmaFault)>> {
        let mut inner = self.lock();
        Some(pieces.iter().enumerate().try_for_each(|(i, &(addr, len))| {
            Self::resolve_or_fault(&mut inner, addr, len, direction)
                .map(|_| ())
                .map_err(|fault| (i, fault))
        }))
    }

    fn copy_to(
        &self,
        from: u64,
        dest: &dyn HostMemory,
        to: u64,
        len: usize,
    ) -> Result<(), CopyFault> {
        let Some(dest_sim) = dest.as_any().and_then(|d| d.downcast_ref::<SimMemory>()) else {
            // Another kind of memory: through a bounce buffer.
            return bounce_copy(self, from, dest, to, len);
        };
        if std::ptr::eq(self, dest_sim) {
            let mut inner = self.lock();
            let (src_id, src_at) =
                Self::resolve_or_fault(&mut inner, from, len, DmaDirection::Read)
                    .map_err(CopyFault::Source)?;
            let (dst_id, dst_at) = Self::resolve_or_fault(&mut inner, to, len, DmaDirection::Write)
                .map_err(CopyFault::Destination)?;
            if src_id == dst_id {
                let buf = inner
                    .buffers
                    .get_mut(&src_id)
                    .expect("mapped buffer is live");
                buf.copy_within(src_at..src_at + len, dst_at);
            } else {
                // Two buffers of one map: lend the destination out of the
                // map for the copy (moves a `Vec` header, not its bytes).
                let mut out = std::mem::take(
                    inner
                        .buffers
                        .get_mut(&dst_id)
                        .expect("mapped buffer is live"),
                );
                out[dst_at..dst_at + len]
                    .copy_from_slice(&inner.buffers[&src_id][src_at..src_at + len]);
                *inner
                    .buffers
                    .get_mut(&dst_id)
                    .expect("mapped buffer is live") = out;
            }
            return Ok(());
        }
        // Two memories: both locks, always taken in address order, so two
        // copies in opposite directions cannot deadlock (no other path
        // holds one `SimMemory` lock while taking another).
        if (self as *const Self) < (dest_sim as *const Self) {
            let mut src = self.lock();
            let mut dst = dest_sim.lock();
            copy_between(&mut src, from, &mut dst, to, len)
        } else {
            let mut dst = dest_sim.lock();
            let mut src = self.lock();
            copy_between(&mut src, from, &mut dst, to, len)
        }
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn read(&self, addr: u64, out: &mut [u8]) -> Result<(), DmaFault> {
        let mut inner = self.lock();
        match inner.resolve(addr, out.len()) {
            Some((id, at)) => {
                let at = at as usize;
                let buf = &inner.buffers[&id];
                out.copy_from_slice(&buf[at..at + out.len()]);
                Ok(())
            }
            None => {
                inner.faults += 1;
                Err(DmaFault {
                    addr,
                    len: out.len(),
                    direction: DmaDirection::Read,
                })
            }
        }
    }

    fn write(&self, addr: u64, data: &[u8]) -> Result<(), DmaFault> {
        let mut inner = self.lock();
        match inner.resolve(addr, data.len()) {
            Some((id, at)) => {
                let at = at as usize;
                let buf = inner.buffers.get_mut(&id).expect("mapped buffer is live");
                buf[at..at + data.len()].copy_from_slice(data);
                Ok(())
            }
            None => {
                inner.faults += 1;
                Err(DmaFault {
                    addr,
                    len: data.len(),
                    direction: DmaDirection::Write,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accesses_inside_mappings_only() {
        let mem = SimMemory::new(0x10_0000_0000);
        let buf = mem.alloc(3 * 4096);
        let bus = mem.map(buf, 4096, 8192).unwrap();
        assert_ne!(bus, 4096, "bus addresses are not buffer offsets");
        mem.write(bus + 10, &[1, 2, 3]).unwrap();
        let mut out = [0u8; 3];
        mem.cpu_read(buf, 4096 + 10, &mut out);
        assert_eq!(out, [1, 2, 3]);
        // Past the end of the mapping, before it, and across its end.
        assert!(mem.read(bus + 8192, &mut out).is_err());
        assert!(mem.read(bus - 1, &mut out).is_err());
        assert!(mem.write(bus + 8190, &[0; 4]).is_err());
        assert_eq!(mem.faults(), 3);
        assert!(mem.unmap(bus));
        assert!(mem.read(bus, &mut out).is_err(), "stale mapping");
        assert_eq!(mem.mapping_count(), 0);
    }

    #[test]
    fn freeing_a_buffer_kills_its_mappings() {
        let mem = SimMemory::new(0x2000_0000);
        let buf = mem.alloc(4096);
        let bus = mem.map(buf, 0, 4096).unwrap();
        mem.free(buf);
        assert!(mem.write(bus, &[1]).is_err());
        assert!(mem.map(buf, 0, 4096).is_none());
    }

    #[test]
    fn copy_to_moves_bytes_between_and_within_memories() {
        let a = SimMemory::new(0x10_0000_0000);
        let b = SimMemory::new(0x20_0000_0000);
        let (a1, a2, b1) = (a.alloc(8192), a.alloc(4096), b.alloc(4096));
        let (bus_a1, bus_a2) = (a.map(a1, 0, 8192).unwrap(), a.map(a2, 0, 4096).unwrap());
        let bus_b1 = b.map(b1, 0, 4096).unwrap();
        let data: Vec<u8> = (0..=255).collect();
        a.cpu_write(a1, 100, &data);
        let mut out = [0u8; 256];
        // Across memories, both ways (the locks are taken in one order).
        a.copy_to(bus_a1 + 100, &b, bus_b1 + 7, 256).unwrap();
        b.cpu_read(b1, 7, &mut out);
        assert_eq!(out[..], data[..]);
        b.copy_to(bus_b1 + 7, &a, bus_a2 + 1000, 256).unwrap();
        a.cpu_read(a2, 1000, &mut out);
        assert_eq!(out[..], data[..]);
        // Within one memory: another buffer, and the same one overlapping.
        a.copy_to(bus_a2 + 1000, &a, bus_a1 + 5000, 256).unwrap();
        a.cpu_read(a1, 5000, &mut out);
        assert_eq!(out[..], data[..]);
        a.copy_to(bus_a1 + 5000, &a, bus_a1 + 5010, 256).unwrap();
        a.cpu_read(a1, 5010, &mut out);
        assert_eq!(out[..], data[..]);
        assert_eq!(a.faults() + b.faults(), 0);
    }

    #[test]
    fn a_faulting_copy_blames_its_side_and_touches_nothing() {
        let a = SimMemory::new(0x10_0000_0000);
        let b = SimMemory::new(0x20_0000_0000);
        let (a1, b1) = (a.alloc(4096), b.alloc(4096));
        let (bus_a, bus_b) = (a.map(a1, 0, 4096).unwrap(), b.map(b1, 0, 4096).unwrap());
        a.cpu_write(a1, 0, &[9; 4096]);
        // Runs past the end of the source, then of the destination.
        let err = a.copy_to(bus_a + 4000, &b, bus_b, 200).unwrap_err();
        assert!(matches!(err, CopyFault::Source(f) if f.direction == DmaDirection::Read));
        let err = a.copy_to(bus_a, &b, bus_b + 4000, 200).unwrap_err();
        assert!(matches!(err, CopyFault::Destination(f) if f.direction == DmaDirection::Write));
        assert_eq!(
            (a.faults(), b.faults()),
            (1, 1),
            "each fault counted where it was"
        );
        let mut out = [0u8; 4096];
        b.cpu_read(b1, 0, &mut out);
        assert!(out.iter().all(|&x| x == 0), "nothing written");
        // A probe refuses what an access would, and counts it.
        assert_eq!(a.probe(&[(bus_a, 4096)], DmaDirection::Read), Some(Ok(())));
        assert!(matches!(
            a.probe(&[(bus_a, 10), (bus_a + 4090, 10)], DmaDirection::Read),
            Some(Err((1, f))) if f.addr == bus_a + 4090
        ));
        assert!(matches!(
            b.probe(&[(bus_b + 4096, 1)], DmaDirection::Write),
            Some(Err((0, f))) if f.direction == DmaDirection::Write
        ));
        assert_eq!((a.faults(), b.faults()), (2, 2));
    }

    #[test]
    fn map_rejects_bad_ranges() {
        let mem = SimMemory::new(0x2000_0000);
        let buf = mem.alloc(8192);
        assert!(mem.map(buf, 100, 4096).is_none(), "unaligned");
        assert!(mem.map(buf, 4096, 8192).is_none(), "past the end");
        assert!(mem.map(buf, 0, 0).is_none(), "empty");
        let a = mem.map(buf, 0, 4096).unwrap();
        let b = mem.map(buf, 0, 4096).unwrap();
        assert!(b >= a + 2 * SIM_PAGE, "a guard page between mappings");
    }
}
