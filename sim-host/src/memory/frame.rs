//! Page frames: real, page-aligned host memory that the CPU and devices
//! share without a lock, as physical memory is shared.
//!
//! Contract:
//! - A [`Frame`] is one 4 KiB allocation aligned to 4 KiB (`#[repr(align)]`
//!   on a boxed array), zero-filled when made. It is owned through
//!   [`super::Page`], shared (`Arc`) by whatever can reach it (an address
//!   space, an MDL, IOMMU entries), so it is never freed while anything can
//!   still address it: a use after free is an error in the tables that lead
//!   here (address space, IOMMU), never a dangling access.
//! - Every byte lives in an [`AtomicU64`] word (little-endian byte order,
//!   as the device formats are), so a CPU access racing a device access is
//!   a race of atomics, never undefined behaviour, and no access ever takes
//!   a lock. All accesses are 64-bit atomics (never mixed sizes): a whole
//!   aligned word is one load or store; a part of a word is one
//!   read-modify-write that leaves the word's other bytes as they are (a
//!   byte write of hardware never tears its neighbours either).
//! - Copies are not atomic as a whole: a multi-word access is a sequence of
//!   word accesses in ascending address order, so a reader racing a writer
//!   can see part of an old entry and part of a new one, as on hardware.
//!   Drivers order their accesses with the named barriers
//!   (`driver_platform::dma::dma_wmb` / `dma_rmb`) and the owner-bit rule
//!   (PRM 4.2, 8.1, 10.4). A device copy between two frames
//!   ([`Frame::copy_to`]) is the same: word to word, ascending, each an
//!   acquire load and a release store, with no buffer in between.
//! - Orderings follow the two sides of the bus. The CPU's accesses
//!   ([`Side::Cpu`]) are relaxed: they are ordered only by the driver's own
//!   barriers, so a missing barrier is a real race in the Rust memory model
//!   (visible on weakly ordered hosts and to model checkers, not on x86,
//!   which is TSO). The device's ([`Side::Device`]) are what PCIe gives: its
//!   writes become visible in order (each word a release store, so an owner
//!   byte written last publishes the entry before it), and its reads
//!   observe what was published before the doorbell or record they
//!   followed (each word an acquire load).
//!
//! This module has no `unsafe`: the words are atomics, and alignment comes
//! from the type. A run may also stand for pages of the application's own
//! memory (`super::adopted`, where the one `unsafe` of this memory model
//! lives and argues why such a page may be viewed as a `Frame`).

use std::sync::atomic::{AtomicU64, Ordering};

use zerocopy::{FromZeros, KnownLayout};

use super::PAGE_SIZE;

/// Bytes of a word.
const WORD_BYTES: usize = 8;

/// Words of a frame.
const WORDS: usize = PAGE_SIZE / WORD_BYTES;

/// Who makes an access: it decides the access's memory ordering (see the
/// module contract).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    /// A CPU access (a driver, a process): relaxed; ordered by barriers.
    Cpu,
    /// A device access through the IOMMU: release stores, acquire loads.
    Device,
}

impl Side {
    fn load_order(self) -> Ordering {
        match self {
            Self::Cpu => Ordering::Relaxed,
            Self::Device => Ordering::Acquire,
        }
    }

    fn store_order(self) -> Ordering {
        match self {
            Self::Cpu => Ordering::Relaxed,
            Self::Device => Ordering::Release,
        }
    }
}

/// One page of memory: 4 KiB, 4 KiB-aligned, 64-bit atomic words.
#[derive(FromZeros, KnownLayout)]
#[repr(C, align(4096))]
pub(crate) struct Frame {
    words: [AtomicU64; WORDS],
}

/// Frames allocated together (the pages of one allocation): one aligned,
/// zeroed allocation instead of one per page, freed when no page of it is
/// reachable any more; or pages of the application's own memory adopted
/// into a user space (`super::adopted`), which the run never frees.
pub(crate) struct FrameRun(Frames);

enum Frames {
    /// The simulator's own frames.
    Owned(Box<[Frame]>),
    /// The application's pages.
    Adopted(super::adopted::AdoptedFrames),
}

impl std::fmt::Debug for FrameRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not the address: debug output stays the same from run to run.
        let kind = match self.0 {
            Frames::Owned(_) => "",
            Frames::Adopted(_) => "adopted, ",
        };
        write!(f, "FrameRun({kind}{} frames)", self.len())
    }
}

impl FrameRun {
    /// `count` zero-filled frames in one allocation.
    pub(crate) fn zeroed(count: usize) -> Self {
        let frames = <[Frame]>::new_box_zeroed_with_elems(count).unwrap_or_else(|_| {
            std::alloc::handle_alloc_error(
                std::alloc::Layout::array::<Frame>(count)
                    .unwrap_or(std::alloc::Layout::new::<Frame>()),
            )
        });
        Self(Frames::Owned(frames))
    }

    /// A run over adopted application pages (see `super::adopted`).
    pub(crate) fn adopted(frames: super::adopted::AdoptedFrames) -> Self {
        Self(Frames::Adopted(frames))
    }

    /// Frame `index`, if the run has it.
    pub(crate) fn get(&self, index: usize) -> Option<&Frame> {
        match &self.0 {
            Frames::Owned(frames) => frames.get(index),
            Frames::Adopted(frames) => frames.get(index),
        }
    }

    /// Frames in the run.
    pub(crate) fn len(&self) -> usize {
        match &self.0 {
            Frames::Owned(frames) => frames.len(),
            Frames::Adopted(frames) => frames.len(),
        }
    }

    /// Host address of the first frame and the run's bytes: the addresses
    /// the run occupies (its guard frame included, if it has one).
    pub(crate) fn host_range(&self) -> std::ops::Range<usize> {
        let start = self.get(0).map_or(0, Frame::address);
        start..start + self.len() * PAGE_SIZE
    }
}

const _: () = assert!(size_of::<Frame>() == PAGE_SIZE);
const _: () = assert!(align_of::<Frame>() == PAGE_SIZE);

impl Frame {
    /// A zero-filled frame on the heap (of its own).
    #[cfg(test)]
    fn zeroed() -> Box<Self> {
        Box::new(Self {
            words: [const { AtomicU64::new(0) }; WORDS],
        })
    }

    /// Address of byte 0 (page aligned): a user space hands it out as the
    /// virtual address of the frame (`Placement::Host`).
    pub(crate) fn address(&self) -> usize {
        self.words.as_ptr() as usize
    }

    /// Copies `out.len()` bytes from `offset`, word by word in ascending
    /// order; false (nothing copied) if the range leaves the frame.
    pub(crate) fn read(&self, side: Side, offset: usize, out: &mut [u8]) -> bool {
        if !super::range_within(offset, out.len(), PAGE_SIZE) {
            return false;
        }
        let order = side.load_order();
        let (head, whole, tail) = split_words(offset, out.len());
        let (head_out, rest) = out.split_at_mut(head);
        let (whole_out, tail_out) = rest.split_at_mut(whole * WORD_BYTES);
        if head > 0 {
            let word = self.words[offset / WORD_BYTES].load(order).to_le_bytes();
            let in_word = offset % WORD_BYTES;
            head_out.copy_from_slice(&word[in_word..in_word + head]);
        }
        let first = (offset + head) / WORD_BYTES;
        // The bulk: one load per whole word, in a loop the compiler keeps
        // tight (no per-byte bookkeeping).
        let (whole_chunks, _) = whole_out.as_chunks_mut::<WORD_BYTES>();
        for (word, chunk) in self.words[first..first + whole].iter().zip(whole_chunks) {
            *chunk = word.load(order).to_le_bytes();
        }
        if tail > 0 {
            let word = self.words[first + whole].load(order).to_le_bytes();
            tail_out.copy_from_slice(&word[..tail]);
        }
        true
    }

    /// Copies `data` to `offset`, word by word in ascending order (a part
    /// of a word by one read-modify-write); false (nothing copied) if the
    /// range leaves the frame.
    pub(crate) fn write(&self, side: Side, offset: usize, data: &[u8]) -> bool {
        if !super::range_within(offset, data.len(), PAGE_SIZE) {
            return false;
        }
        let order = side.store_order();
        let (head, whole, tail) = split_words(offset, data.len());
        let (head_data, rest) = data.split_at(head);
        let (whole_data, tail_data) = rest.split_at(whole * WORD_BYTES);
        if head > 0 {
            self.merge(offset / WORD_BYTES, offset % WORD_BYTES, head_data, order);
        }
        let first = (offset + head) / WORD_BYTES;
        let (whole_chunks, _) = whole_data.as_chunks::<WORD_BYTES>();
        for (word, chunk) in self.words[first..first + whole].iter().zip(whole_chunks) {
            word.store(u64::from_le_bytes(*chunk), order);
        }
        if tail > 0 {
            self.merge(first + whole, 0, tail_data, order);
        }
        true
    }

    /// Copies `len` bytes from `from` in this frame to `to` in `dst`, as
    /// the device copies (each word an acquire load and a release store,
    /// in ascending order): no buffer in between, so each byte is read
    /// once and written once. False (nothing copied) if either range
    /// leaves its frame. `dst` may be this frame only with the two ranges
    /// apart: overlapping ranges are the caller's to copy through a
    /// buffer (a read then a write).
    pub(crate) fn copy_to(&self, from: usize, dst: &Frame, to: usize, len: usize) -> bool {
        if !super::range_within(from, len, PAGE_SIZE) || !super::range_within(to, len, PAGE_SIZE) {
            return false;
        }
        if from % WORD_BYTES != to % WORD_BYTES {
            // The words do not line up: through a small stack buffer (a
            // payload placed at another offset within a word; rare).
            let mut chunk = [0u8; 256];
            let mut done = 0;
            while done < len {
                let n = chunk.len().min(len - done);
                self.read(Side::Device, from + done, &mut chunk[..n]);
                dst.write(Side::Device, to + done, &chunk[..n]);
                done += n;
            }
            return true;
        }
        let (load, store) = (Side::Device.load_order(), Side::Device.store_order());
        let (head, whole, tail) = split_words(from, len);
        if head > 0 {
            let in_word = from % WORD_BYTES;
            let word = self.words[from / WORD_BYTES].load(load).to_le_bytes();
            dst.merge(
                to / WORD_BYTES,
                in_word,
                &word[in_word..in_word + head],
                store,
            );
        }
        let (first_src, first_dst) = ((from + head) / WORD_BYTES, (to + head) / WORD_BYTES);
        copy_words(
            &self.words[first_src..first_src + whole],
            &dst.words[first_dst..first_dst + whole],
            load,
            store,
        );
        if tail > 0 {
            let word = self.words[first_src + whole].load(load).to_le_bytes();
            dst.merge(first_dst + whole, 0, &word[..tail], store);
        }
        true
    }

    /// Writes `bytes` into word `index` from byte `in_word` on, keeping the
    /// word's other bytes: one read-modify-write.
    fn merge(&self, index: usize, in_word: usize, bytes: &[u8], order: Ordering) {
        // Never fails: the closure always returns `Some`.
        let _ = self.words[index].fetch_update(order, Ordering::Relaxed, |old| {
            let mut word = old.to_le_bytes();
            word[in_word..in_word + bytes.len()].copy_from_slice(bytes);
            Some(u64::from_le_bytes(word))
        });
    }
}

/// Copies word `i` of `src` to word `i` of `dst` (equal lengths), in
/// ascending order, a cache line (eight words) per step: the loop the bulk
/// copies spend their time in. Atomics are never vectorised, so the step
/// is unrolled by hand; on x86 an acquire load and a release store are
/// plain moves.
fn copy_words(src: &[AtomicU64], dst: &[AtomicU64], load: Ordering, store: Ordering) {
    let (src_lines, src_rest) = src.as_chunks::<8>();
    let (dst_lines, dst_rest) = dst.as_chunks::<8>();
    for (s, d) in src_lines.iter().zip(dst_lines) {
        let words = [
            s[0].load(load),
            s[1].load(load),
            s[2].load(load),
            s[3].load(load),
            s[4].load(load),
            s[5].load(load),
            s[6].load(load),
            s[7].load(load),
        ];
        for (word, value) in d.iter().zip(words) {
            word.store(value, store);
        }
    }
    for (s, d) in src_rest.iter().zip(dst_rest) {
        d.store(s.load(load), store);
    }
}

/// How an access of `len` bytes at `offset` splits over words: bytes in a
/// partial first word, whole words, bytes in a partial last word. An access
/// within one word is all "head".
fn split_words(offset: usize, len: usize) -> (usize, usize, usize) {
    let in_word = offset % WORD_BYTES;
    let head = if in_word == 0 {
        0
    } else {
        (WORD_BYTES - in_word).min(len)
    };
    let rest = len - head;
    (head, rest / WORD_BYTES, rest % WORD_BYTES)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;

    #[test]
    fn frames_are_real_page_aligned_memory() {
        let run = FrameRun::zeroed(8);
        assert_eq!(run.len(), 8);
        assert!(run.get(8).is_none());
        let single = Frame::zeroed();
        for frame in (0..8).filter_map(|i| run.get(i)).chain([&*single]) {
            assert_eq!(frame.address() % PAGE_SIZE, 0);
            let mut out = [0xAAu8; PAGE_SIZE];
            assert!(frame.read(Side::Cpu, 0, &mut out));
            assert!(out.iter().all(|&b| b == 0), "zero-filled");
        }
    }

    #[test]
    fn copies_at_every_alignment_keep_neighbouring_bytes() {
        let frame = Frame::zeroed();
        let fill: Vec<u8> = (0..64u8).map(|b| b | 0x80).collect();
        for offset in 0..16 {
            for len in 0..24 {
                assert!(frame.write(Side::Cpu, 0, &fill));
                let data: Vec<u8> = (0..len as u8).collect();
                let side = if len % 2 == 0 {
                    Side::Cpu
                } else {
                    Side::Device
                };
                assert!(frame.write(side, offset, &data));
                let mut back = [0u8; 64];
                assert!(frame.read(side, 0, &mut back));
                let mut expected = fill.clone();
                expected[offset..offset + len].copy_from_slice(&data);
                assert_eq!(&back[..], &expected[..], "offset {offset} len {len}");
            }
        }
        // Little-endian words: byte 0 is the low byte.
        assert!(frame.write(Side::Cpu, 8, &0x1122_3344_5566_7788u64.to_le_bytes()));
        assert_eq!(
            frame.words[1].load(Ordering::Relaxed),
            0x1122_3344_5566_7788
        );
    }

    /// A frame-to-frame copy at every offset within a word on both sides
    /// (equal ones take the word loop, others a buffer), short and long,
    /// up to the frame's end, moves exactly its bytes and keeps the bytes
    /// beside them; a range leaving either frame copies nothing.
    #[test]
    fn frame_to_frame_copies_at_every_alignment_keep_neighbouring_bytes() {
        let source: Vec<u8> = (0..PAGE_SIZE)
            .map(|i| (i * 13 + i / 256 + 1) as u8)
            .collect();
        let src = Frame::zeroed();
        assert!(src.write(Side::Cpu, 0, &source));
        let dst = Frame::zeroed();
        let background = vec![0xEEu8; PAGE_SIZE];
        for len in [0, 1, 5, 8, 13, 24, 63, 64, 65, 300, 1000] {
            for from in (0..16).chain([PAGE_SIZE - len - 3, PAGE_SIZE - len]) {
                for to in (0..16).chain([PAGE_SIZE - len - 1, PAGE_SIZE - len]) {
                    assert!(dst.write(Side::Cpu, 0, &background));
                    assert!(src.copy_to(from, &dst, to, len));
                    let mut back = vec![0u8; PAGE_SIZE];
                    assert!(dst.read(Side::Cpu, 0, &mut back));
                    let mut expected = background.clone();
                    expected[to..to + len].copy_from_slice(&source[from..from + len]);
                    assert!(back == expected, "from {from} to {to} len {len}");
                }
            }
        }
        assert!(dst.write(Side::Cpu, 0, &background));
        assert!(!src.copy_to(PAGE_SIZE - 7, &dst, 0, 8), "source leaves");
        assert!(
            !src.copy_to(0, &dst, PAGE_SIZE - 7, 8),
            "destination leaves"
        );
        assert!(!src.copy_to(usize::MAX, &dst, 0, 2), "overflow");
        let mut back = vec![0u8; PAGE_SIZE];
        assert!(dst.read(Side::Cpu, 0, &mut back));
        assert!(back == background, "a refused copy touches nothing");
    }

    #[test]
    fn out_of_frame_ranges_are_refused_and_touch_nothing() {
        let frame = Frame::zeroed();
        assert!(frame.write(Side::Device, PAGE_SIZE - 6, &[1; 6]));
        assert!(!frame.write(Side::Device, PAGE_SIZE - 5, &[2; 6]));
        assert!(!frame.write(Side::Cpu, usize::MAX, &[2; 2]), "overflow");
        let mut out = [0u8; 6];
        assert!(!frame.read(Side::Cpu, PAGE_SIZE - 5, &mut out));
        assert_eq!(out, [0; 6]);
        assert!(frame.read(Side::Cpu, PAGE_SIZE - 6, &mut out));
        assert_eq!(out, [1; 6]);
    }

    /// Concurrent sub-word writes of different bytes of one word never lose
    /// each other's bytes (each is one read-modify-write), and a reader
    /// following the owner rule — the owner word first, then an acquire
    /// fence (`dma_rmb`), then the body — never sees a body older than the
    /// owner it read, because the device publishes each entry's words in
    /// ascending order with the owner word last.
    #[test]
    fn racing_cpu_and_device_accesses_stay_coherent() {
        let frame: Arc<Frame> = Arc::from(Frame::zeroed());
        let stop = Arc::new(AtomicBool::new(false));
        let device = {
            let (frame, stop) = (Arc::clone(&frame), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut generation = 1u64;
                while !stop.load(Ordering::Relaxed) {
                    // A 32-byte entry at 64: four words of `generation`, the
                    // last one playing the owner, in one write.
                    let entry: Vec<u8> = (0..4).flat_map(|_| generation.to_le_bytes()).collect();
                    assert!(frame.write(Side::Device, 64, &entry));
                    // A byte of word 0, which the CPU writes too.
                    assert!(frame.write(Side::Device, 7, &[generation as u8]));
                    generation += 1;
                }
            })
        };
        for round in 0..20_000u32 {
            assert!(frame.write(Side::Cpu, 0, &[round as u8]));
            let mut byte0 = [0u8];
            assert!(frame.read(Side::Cpu, 0, &mut byte0));
            assert_eq!(
                byte0[0], round as u8,
                "the device's byte-7 writes keep byte 0"
            );
            let mut owner = [0u8; 8];
            assert!(frame.read(Side::Cpu, 64 + 24, &mut owner));
            std::sync::atomic::fence(Ordering::Acquire);
            let owner = u64::from_le_bytes(owner);
            let mut body = [0u8; 24];
            assert!(frame.read(Side::Cpu, 64, &mut body));
            for word in body.chunks_exact(8) {
                let word = u64::from_le_bytes(word.try_into().unwrap());
                assert!(word >= owner, "body word {word} older than owner {owner}");
            }
        }
        stop.store(true, Ordering::Relaxed);
        device.join().unwrap();
    }
}
