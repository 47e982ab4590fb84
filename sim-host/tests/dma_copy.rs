//! The device's bulk paths through the IOMMU (`DeviceDma`): a probe checks
//! pieces as their accesses would, touching nothing, and a copy between two
//! views (direct placement's `HostMemory::copy_to`) goes frame to frame yet
//! leaves exactly what a read of the source then a write of the destination
//! leaves — the same bytes, the same faults and verifier records, nothing
//! touched when any page of either side is not live — including faults in
//! the middle of a multi-page copy, offsets that differ within a word, and
//! one allocation behind both sides. A copy racing the CPU keeps the CPU's
//! bytes beside the copied range and never tears a word.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use driver_platform::dma::{CommonBuffer, DmaAdapter, DmaMapping, MemoryLocker};
use driver_platform::request::RequestorMode;
use sim_hca::host::{CopyFault, DmaDirection, DmaFault, HostMemory};
use sim_host::dma::{
    DeviceDma, HostCommonBuffer, HostDmaAdapter, HostDmaMapping, HostLockedPages, HostLocker, Iommu,
};
use sim_host::memory::{PAGE_SIZE, Pool, Process};
use sim_host::verifier::{Verifier, ViolationKind};

const PAGE: u64 = PAGE_SIZE as u64;

/// Pages of the user buffer mapped (scattered in bus space) on adapter B.
const USER_PAGES: usize = 16;

/// Two adapters and what a copy between their views may touch.
struct World {
    verifier: Verifier,
    a: HostDmaAdapter,
    b: HostDmaAdapter,
    /// Three pages on A holding a pattern.
    src: HostCommonBuffer,
    /// Three pages on B, and three on A.
    dst_b: HostCommonBuffer,
    dst_a: HostCommonBuffer,
    process: Process,
    /// A user buffer of [`USER_PAGES`] locked for writing and mapped on B.
    user_va: u64,
    user_map: HostDmaMapping,
    /// A user page locked read-only and mapped on B.
    read_only_bus: u64,
    /// One user page mapped on both A and B (one frame, two bus addresses).
    alias_va: u64,
    alias_a: u64,
    alias_b: u64,
    _locked: Vec<HostLockedPages>,
    _mappings: Vec<HostDmaMapping>,
}

fn pattern(len: usize, salt: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + i / 251 + salt) as u8).collect()
}

fn world(seed: u64) -> World {
    let verifier = Verifier::new();
    let iommu = Iommu::new(verifier.clone(), seed);
    let pool = Pool::new(verifier.clone());
    let a = iommu.create_adapter("hcaA").unwrap();
    let b = iommu.create_adapter("hcaB").unwrap();
    let src = a.alloc_common(3 * PAGE_SIZE).unwrap();
    assert!(src.write(0, &pattern(3 * PAGE_SIZE, 0)));
    let dst_b = b.alloc_common(3 * PAGE_SIZE).unwrap();
    let dst_a = a.alloc_common(3 * PAGE_SIZE).unwrap();
    let process = Process::new(10);
    let locker = HostLocker::new(pool.kernel_space(), Some(&process));
    let user_va = process.alloc(USER_PAGES * PAGE_SIZE).unwrap();
    process
        .write(user_va, &pattern(USER_PAGES * PAGE_SIZE, 3))
        .unwrap();
    let user = locker
        .lock(
            RequestorMode::User,
            user_va,
            (USER_PAGES * PAGE_SIZE) as u64,
            true,
        )
        .unwrap();
    let user_map = b.map(&user).unwrap();
    let read_only_va = process.alloc(PAGE_SIZE).unwrap();
    let read_only = locker
        .lock(RequestorMode::User, read_only_va, PAGE, false)
        .unwrap();
    let alias_va = process.alloc(PAGE_SIZE).unwrap();
    process.write(alias_va, &pattern(PAGE_SIZE, 5)).unwrap();
    let alias = locker
        .lock(RequestorMode::User, alias_va, PAGE, true)
        .unwrap();
    let read_only_map = b.map(&read_only).unwrap();
    let (alias_map_a, alias_map_b) = (a.map(&alias).unwrap(), b.map(&alias).unwrap());
    World {
        verifier,
        read_only_bus: read_only_map.page_bus_address(0).unwrap(),
        alias_a: alias_map_a.page_bus_address(0).unwrap(),
        alias_b: alias_map_b.page_bus_address(0).unwrap(),
        _locked: vec![user, read_only, alias],
        _mappings: vec![read_only_map, alias_map_a, alias_map_b],
        a,
        b,
        src,
        dst_b,
        dst_a,
        process,
        user_va,
        user_map,
        alias_va,
    }
}

/// The first page `i` of the user mapping whose next page is not next to
/// it in bus space (the seed decides; most seeds have several).
fn hole_after(w: &World) -> Option<usize> {
    (0..USER_PAGES - 1).find(|&i| {
        w.user_map.page_bus_address(i).unwrap() + PAGE
            != w.user_map.page_bus_address(i + 1).unwrap()
    })
}

/// The first run of three user pages contiguous in bus space, if any.
fn contiguous_run(w: &World) -> Option<usize> {
    (0..USER_PAGES - 2).find(|&i| {
        let bus = |k| w.user_map.page_bus_address(k).unwrap();
        bus(i) + PAGE == bus(i + 1) && bus(i + 1) + PAGE == bus(i + 2)
    })
}

/// A seed whose user mapping has both a hole and a contiguous run of three.
fn scattered_seed() -> u64 {
    (1..100)
        .find(|&seed| {
            let w = world(seed);
            hole_after(&w).is_some() && contiguous_run(&w).is_some()
        })
        .expect("some seed scatters the mapping")
}

/// What a copy left: its result, the faults recorded (driver, address,
/// length), each adapter's fault count, and every byte it could have
/// touched.
type Outcome = (
    Result<(), CopyFault>,
    Vec<(Option<String>, u64, usize)>,
    (u64, u64),
    Vec<u8>,
);

/// A read of the source then a write of the destination: what a copy
/// must be equivalent to.
fn read_then_write(
    src: &DeviceDma,
    from: u64,
    dst: &DeviceDma,
    to: u64,
    len: usize,
) -> Result<(), CopyFault> {
    let mut bounce = vec![0; len];
    src.read(from, &mut bounce).map_err(CopyFault::Source)?;
    dst.write(to, &bounce).map_err(CopyFault::Destination)
}

const CASES: usize = 14;

/// Copy case `case` in a fresh world of `seed`, made by `copy`.
fn run_case(
    seed: u64,
    case: usize,
    copy: impl Fn(&DeviceDma, u64, &DeviceDma, u64, usize) -> Result<(), CopyFault>,
) -> Outcome {
    let w = world(seed);
    let (va, vb) = (w.a.device_view(), w.b.device_view());
    let (src, dst_b, dst_a) = (
        w.src.bus_address(),
        w.dst_b.bus_address(),
        w.dst_a.bus_address(),
    );
    let user = |page: usize| w.user_map.page_bus_address(page).unwrap();
    let hole = hole_after(&w).unwrap();
    let run = contiguous_run(&w).unwrap();
    let result = match case {
        // Across adapters, over page boundaries on both sides at different
        // offsets in the page (the same offset within a word).
        0 => copy(&va, src + 96, &vb, dst_b + 4000, 2 * PAGE_SIZE - 300),
        // Within one adapter, the offsets differing within a word.
        1 => copy(&va, src + 3, &va, dst_a + 4002, PAGE_SIZE + 9),
        // Into three user pages contiguous in bus space, whole.
        2 => copy(&va, src, &vb, user(run), 3 * PAGE_SIZE),
        // Into the user mapping across its bus hole: the middle page is
        // not mapped, so nothing lands, not even the first page's part.
        3 => copy(&va, src, &vb, user(hole) + 8, PAGE_SIZE + 16),
        // The source runs into its guard page after two good pages.
        4 => copy(&va, src + 8, &vb, dst_b, 3 * PAGE_SIZE),
        // The source is another adapter's buffer.
        5 => copy(&va, dst_b, &vb, dst_b + PAGE, 16),
        // The destination is read-only for the device.
        6 => copy(&va, src, &vb, w.read_only_bus, 10),
        // The destination runs into its guard page.
        7 => copy(&va, src, &vb, dst_b + 3 * PAGE - 4, 8),
        // Both sides bad: the source is blamed, the destination untouched.
        8 => copy(&va, src + 3 * PAGE, &vb, w.read_only_bus, 8),
        // One frame behind both bus addresses, overlapping by 8 bytes.
        9 => copy(&va, w.alias_a, &vb, w.alias_b + 8, 3000),
        // One buffer, overlapping ranges, forward and backward.
        10 => copy(&va, src, &va, src + 8, 2 * PAGE_SIZE),
        11 => copy(&va, src + 4100, &va, src + 5, PAGE_SIZE + 7),
        // Nothing to copy: nothing checked.
        12 => copy(&va, src + 3 * PAGE, &vb, w.read_only_bus, 0),
        // One byte, mid-word on both sides.
        13 => copy(&va, src + 4095, &vb, dst_b + 1, 1),
        _ => unreachable!("no copy case {case}"),
    };
    let faults = w
        .verifier
        .take()
        .into_iter()
        .filter_map(|v| match v.kind {
            ViolationKind::DmaFault { addr, len } => Some((v.driver, addr, len)),
            _ => None,
        })
        .collect();
    let mut memory = vec![0u8; 9 * PAGE_SIZE];
    for (buffer, part) in [&w.src, &w.dst_b, &w.dst_a]
        .into_iter()
        .zip(memory.chunks_exact_mut(3 * PAGE_SIZE))
    {
        assert!(buffer.read(0, part));
    }
    let mut user_bytes = vec![0u8; (USER_PAGES + 1) * PAGE_SIZE];
    let (user_part, alias_part) = user_bytes.split_at_mut(USER_PAGES * PAGE_SIZE);
    w.process.read(w.user_va, user_part).unwrap();
    w.process.read(w.alias_va, alias_part).unwrap();
    memory.extend_from_slice(&user_bytes);
    (result, faults, (w.a.faults(), w.b.faults()), memory)
}

/// Every case leaves through `copy_to` exactly what a read then a write
/// leaves, and the cases fault (or not) as their comments say.
#[test]
fn a_copy_between_views_is_a_read_then_a_write() {
    let seed = scattered_seed();
    let through_copy =
        |src: &DeviceDma, from, dst: &DeviceDma, to, len| src.copy_to(from, dst, to, len);
    // Which side faults: None for a good copy, Some(true) the source.
    let expected = [
        None,
        None,
        None,
        Some(false),
        Some(true),
        Some(true),
        Some(false),
        Some(false),
        Some(true),
        None,
        None,
        None,
        None,
        None,
    ];
    assert_eq!(expected.len(), CASES);
    for (case, expected) in expected.into_iter().enumerate() {
        let copied = run_case(seed, case, through_copy);
        let reference = run_case(seed, case, read_then_write);
        assert_eq!(copied, reference, "case {case} (seed {seed})");
        match (expected, copied.0) {
            (None, Ok(())) => assert!(copied.1.is_empty(), "case {case}"),
            (Some(true), Err(CopyFault::Source(f))) => {
                assert_eq!(f.direction, DmaDirection::Read);
                assert_eq!(copied.1.len(), 1, "case {case}");
                assert_eq!(copied.1[0].0.as_deref(), Some("hcaA"));
            }
            (Some(false), Err(CopyFault::Destination(f))) => {
                assert_eq!(f.direction, DmaDirection::Write);
                assert_eq!(copied.1.len(), 1, "case {case}");
                assert_eq!(copied.1[0].0.as_deref(), Some("hcaB"));
            }
            (expected, got) => panic!("case {case}: {got:?}, expected fault {expected:?}"),
        }
    }
    // The bytes really moved (not only equally on both paths).
    let source = pattern(3 * PAGE_SIZE, 0);
    let (_, _, _, memory) = run_case(seed, 0, through_copy);
    let dst_b = &memory[3 * PAGE_SIZE..6 * PAGE_SIZE];
    assert_eq!(
        dst_b[4000..4000 + 2 * PAGE_SIZE - 300],
        source[96..2 * PAGE_SIZE - 204]
    );
    let (_, _, _, memory) = run_case(seed, 10, through_copy);
    assert_eq!(
        memory[8..8 + 2 * PAGE_SIZE],
        source[..2 * PAGE_SIZE],
        "a memmove"
    );
    let (_, _, _, memory) = run_case(seed, 3, through_copy);
    assert_eq!(
        memory[9 * PAGE_SIZE..9 * PAGE_SIZE + USER_PAGES * PAGE_SIZE],
        pattern(USER_PAGES * PAGE_SIZE, 3),
        "a copy faulting in its middle page touched nothing"
    );
}

/// A view probes without touching: live pieces pass (reads through a
/// read-only mapping too), the first refused piece is named, counted and
/// recorded as its access would be, and the pieces after it are not looked
/// at.
#[test]
fn a_view_probes_like_its_accesses() {
    let seed = scattered_seed();
    let w = world(seed);
    let (va, vb) = (w.a.device_view(), w.b.device_view());
    let src = w.src.bus_address();
    let hole = hole_after(&w).unwrap();
    let user_hole_end = w.user_map.page_bus_address(hole).unwrap() + PAGE - 4;
    assert_eq!(
        va.probe(
            &[(src, 3 * PAGE_SIZE), (w.alias_a, 1), (0x1000, 0)],
            DmaDirection::Write
        ),
        Some(Ok(()))
    );
    assert_eq!(
        vb.probe(&[(w.read_only_bus, 8)], DmaDirection::Read),
        Some(Ok(()))
    );
    assert_eq!(vb.probe(&[], DmaDirection::Write), Some(Ok(())));
    w.verifier.assert_clean();
    assert_eq!(
        va.probe(
            &[(src, 8), (src + 3 * PAGE - 4, 8), (0x1000, 1)],
            DmaDirection::Read
        ),
        Some(Err((
            1,
            DmaFault {
                addr: src + 3 * PAGE - 4,
                len: 8,
                direction: DmaDirection::Read
            }
        )))
    );
    assert!(matches!(
        vb.probe(&[(w.read_only_bus, 8)], DmaDirection::Write),
        Some(Err((0, f))) if f.direction == DmaDirection::Write
    ));
    assert!(matches!(
        vb.probe(&[(user_hole_end, 8)], DmaDirection::Read),
        Some(Err((0, f))) if f.addr == user_hole_end
    ));
    let records: Vec<_> = w
        .verifier
        .take()
        .into_iter()
        .map(|v| match v.kind {
            ViolationKind::DmaFault { addr, len } => (v.driver, addr, len),
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(
        records,
        vec![
            (Some("hcaA".into()), src + 3 * PAGE - 4, 8),
            (Some("hcaB".into()), w.read_only_bus, 8),
            (Some("hcaB".into()), user_hole_end, 8),
        ]
    );
    assert_eq!((w.a.faults(), w.b.faults()), (1, 2));
}

/// A device copy racing CPU accesses of the same words: the copy's partial
/// first and last words are read-modify-writes, so the CPU's bytes beside
/// the copied range are never lost, and each copied word arrives whole
/// (every word of the source is written whole by the CPU, eight equal
/// bytes, so a torn word would show two values).
#[test]
fn a_copy_racing_the_cpu_keeps_its_bytes_and_tears_no_word() {
    let w = world(1);
    let src = Arc::new(w.src);
    let dst = Arc::new(w.dst_b);
    let (from, to) = (src.bus_address() + 3, dst.bus_address() + 3);
    // From byte 3 of a word to byte 2 of the word 2 pages on: partial
    // words at both ends.
    let len = 2 * PAGE_SIZE - 1;
    // Whole words from the start, before the race.
    assert!(src.write(0, &[1; 3 * PAGE_SIZE]));
    w.a.device_view()
        .copy_to(from, &w.b.device_view(), to, len)
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let device = {
        let (va, vb, stop) = (w.a.device_view(), w.b.device_view(), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut copies = 0u32;
            while !stop.load(Ordering::Relaxed) || copies < 100 {
                va.copy_to(from, &vb, to, len).unwrap();
                copies += 1;
            }
            copies
        })
    };
    let writer = {
        let (src, stop) = (Arc::clone(&src), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut generation = 1u8;
            while !stop.load(Ordering::Relaxed) {
                assert!(src.write(0, &[generation; 3 * PAGE_SIZE]));
                generation = generation.wrapping_add(1).max(1);
            }
        })
    };
    let last = 2 * PAGE_SIZE + 2;
    for round in 0..20_000u32 {
        let mine = [(round % 251) as u8 + 1; 3];
        // Bytes 0..3 of the first word and the 5 bytes after the copy's
        // last byte share words with the copy.
        assert!(dst.write(0, &mine));
        assert!(dst.write(last, &mine));
        let mut back = [0u8; 3];
        assert!(dst.read(0, &mut back));
        assert_eq!(
            back, mine,
            "round {round}: the device's head merge kept the CPU's bytes"
        );
        assert!(dst.read(last, &mut back));
        assert_eq!(
            back, mine,
            "round {round}: the device's tail merge kept the CPU's bytes"
        );
        let mut word = [0u8; 8];
        assert!(dst.read(8 * (1 + round as usize % 1000), &mut word));
        assert!(word.iter().all(|&b| b == word[0]), "torn word {word:?}");
    }
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    assert!(device.join().unwrap() >= 100);
    w.verifier.assert_clean();
}

/// A fault found by a copy is reported once, against the adapter whose
/// side faulted, even when the other side is fine: the same as for the
/// failed access, and the adapter's count moves by one.
#[test]
fn a_faulting_copy_counts_once_on_the_side_that_faulted() {
    let w = world(2);
    let (va, vb) = (w.a.device_view(), w.b.device_view());
    let hole_free_end = w.dst_b.bus_address() + 3 * PAGE;
    let result = va.copy_to(w.src.bus_address(), &vb, hole_free_end - 8, 16);
    assert_eq!(
        result,
        Err(CopyFault::Destination(DmaFault {
            addr: hole_free_end - 8,
            len: 16,
            direction: DmaDirection::Write
        }))
    );
    assert_eq!((w.a.faults(), w.b.faults()), (0, 1));
    let mut tail = [0u8; 8];
    assert!(w.dst_b.read(3 * PAGE_SIZE - 8, &mut tail));
    assert_eq!(tail, [0; 8], "nothing written before the fault was found");
}
