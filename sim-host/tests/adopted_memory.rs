//! A simulated process adopts the application's own memory
//! (`Process::adopt`, the ground `ibv_reg_mr` of a buffer the program
//! allocated stands on): the whole pages around the range join the space
//! at their own addresses, and an MDL lock, a DMA mapping and the
//! device's reads and writes work on them as on an allocation, so the
//! Rust owner sees the device's bytes in its own buffer. A sub-page range
//! rounds to pages; release is refused while a lock or a mapping holds a
//! page and allowed after; the pages fault after release; exit drops
//! adoptions; overlapping adoptions share pages, and the simulator's own
//! memory is refused.
//!
//! Every test declares the application's buffer first, so it is dropped
//! (freed) last, after every lock, mapping and adoption of it is gone, as
//! `Process::adopt`'s safety contract asks.

use driver_platform::dma::{DmaAdapter, DmaMapping, MemoryLocker};
use driver_platform::request::RequestorMode;
use sim_hca::host::HostMemory;
use sim_host::dma::{HostDmaAdapter, HostLocker, Iommu};
use sim_host::memory::{MemoryError, PAGE_SIZE, Pool, Process};
use sim_host::verifier::{Verifier, ViolationKind};

const PAGE: u64 = PAGE_SIZE as u64;

/// One page of the application's memory, page aligned.
#[derive(Clone, Copy)]
#[repr(C, align(4096))]
struct PageBytes([u8; PAGE_SIZE]);

/// `pages` zeroed, page-aligned pages the application owns.
fn aligned_buffer(pages: usize) -> Vec<PageBytes> {
    vec![PageBytes([0; PAGE_SIZE]); pages]
}

/// The buffer's bytes, as its owner reads them.
fn bytes_of(buffer: &[PageBytes]) -> Vec<u8> {
    buffer.iter().flat_map(|page| page.0).collect()
}

fn pattern(len: usize, salt: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + i / 251 + salt) as u8).collect()
}

/// A process, its locker and a device adapter.
struct World {
    verifier: Verifier,
    process: Process,
    locker: HostLocker,
    adapter: HostDmaAdapter,
}

fn world() -> World {
    let verifier = Verifier::new();
    let pool = Pool::new(verifier.clone());
    let process = Process::new(40);
    let locker = HostLocker::new(pool.kernel_space(), Some(&process));
    let adapter = Iommu::new(verifier.clone(), 7)
        .create_adapter("hca")
        .unwrap();
    World {
        verifier,
        process,
        locker,
        adapter,
    }
}

/// Adopts `len` bytes at `addr` in `process`.
///
/// Callers keep the memory alive (declared before everything that can
/// reach it) and touch it only while no device access is in flight.
fn adopt(process: &Process, addr: *mut u8, len: usize) -> Result<u64, MemoryError> {
    // SAFETY: every caller passes memory of a buffer it declared before
    // the process, locks and mappings (dropped last), touches it only
    // between device accesses, and never simulator memory unless the
    // test expects a refusal (made before any access).
    unsafe { process.adopt(addr, len) }
}

/// The device writes into the application's buffer through an MDL lock
/// and a DMA mapping, and reads what the application stored there with
/// plain stores; the owner sees the device's bytes in its own buffer, at
/// the address the process uses (VA == real address).
#[test]
fn the_device_reads_and_writes_the_applications_own_buffer() {
    let mut buffer = aligned_buffer(3);
    let stored = pattern(3 * PAGE_SIZE, 1);
    for (page, chunk) in buffer.iter_mut().zip(stored.chunks(PAGE_SIZE)) {
        page.0.copy_from_slice(chunk);
    }
    let addr = buffer.as_mut_ptr().cast::<u8>();
    let w = world();
    let va = adopt(&w.process, addr, 3 * PAGE_SIZE).unwrap();
    assert_eq!(va, addr as u64, "the address is the pointer");
    assert_eq!(w.process.space().adopted_page_count(), 3);
    assert_eq!(w.process.space().allocation_count(), 0);
    // The CPU path of the space sees the owner's stores.
    let mut seen = vec![0; 3 * PAGE_SIZE];
    w.process.read(va, &mut seen).unwrap();
    assert!(seen == stored);

    let locked = w
        .locker
        .lock(RequestorMode::User, va, 3 * PAGE, true)
        .unwrap();
    let mapping = w.adapter.map(&locked).unwrap();
    let device = w.adapter.device_view();
    // The device reads the owner's bytes, page by page.
    for page in 0..3 {
        let bus = mapping.page_bus_address(page).unwrap();
        let mut read = vec![0; PAGE_SIZE];
        device.read(bus, &mut read).unwrap();
        assert!(
            read[..] == stored[page * PAGE_SIZE..][..PAGE_SIZE],
            "page {page}"
        );
    }
    // The device writes: a whole page, and a piece at an odd offset.
    let written = pattern(PAGE_SIZE, 9);
    device
        .write(mapping.page_bus_address(1).unwrap(), &written)
        .unwrap();
    device
        .write(mapping.page_bus_address(2).unwrap() + 4093, &[0xA5; 3])
        .unwrap();
    w.adapter.unmap(mapping);
    drop(locked);
    w.process.release_adoption(va, 3 * PAGE_SIZE).unwrap();
    assert_eq!(w.process.space().adopted_page_count(), 0);

    let mut expected = stored.clone();
    expected[PAGE_SIZE..2 * PAGE_SIZE].copy_from_slice(&written);
    expected[3 * PAGE_SIZE - 3..].copy_from_slice(&[0xA5; 3]);
    assert!(
        bytes_of(&buffer) == expected,
        "the owner reads the device's bytes"
    );
    w.verifier.assert_clean();
}

/// A range inside a page adopts that whole page (here two: the range
/// straddles a boundary), so a CPU access to bytes beside the range but
/// in its pages works, and a device write through a lock of just the
/// range lands at the right bytes of a plain `Vec<u8>`.
#[test]
fn a_sub_page_range_adopts_its_whole_pages() {
    let mut vec = vec![0u8; 3 * PAGE_SIZE];
    let base = vec.as_mut_ptr() as u64;
    // 20 bytes straddling the first page boundary inside the vector.
    let offset = usize::try_from(base.next_multiple_of(PAGE) - base).unwrap() + PAGE_SIZE - 10;
    let addr = vec[offset..].as_mut_ptr();
    let w = world();
    let first_page = adopt(&w.process, addr, 20).unwrap();
    assert_eq!(first_page, addr as u64 & !(PAGE - 1));
    assert_eq!(w.process.space().adopted_page_count(), 2);
    // Bytes of the vector before the range, in its first page: adopted.
    let va = addr as u64;
    w.process.write(va - 100, &[7; 100]).unwrap();

    let locked = w.locker.lock(RequestorMode::User, va, 20, true).unwrap();
    let mapping = w.adapter.map(&locked).unwrap();
    assert_eq!(mapping.page_count(), 2);
    let bus = mapping.page_bus_address(0).unwrap() + (va % PAGE);
    w.adapter
        .device_view()
        .write(bus, &(1..=10).collect::<Vec<u8>>())
        .unwrap();
    // The second page is elsewhere in bus space; its bytes at its start.
    w.adapter
        .device_view()
        .write(
            mapping.page_bus_address(1).unwrap(),
            &(11..=20).collect::<Vec<u8>>(),
        )
        .unwrap();
    w.adapter.unmap(mapping);
    drop(locked);
    w.process.release_adoption(va, 20).unwrap();

    assert_eq!(vec[offset - 100..offset], [7; 100]);
    assert_eq!(
        vec[offset..offset + 20],
        (1..=20).collect::<Vec<u8>>()[..],
        "the owner reads the device's bytes"
    );
    assert!(vec[offset + 20..].iter().all(|&b| b == 0), "nothing beyond");
    w.verifier.assert_clean();
}

/// A registered buffer's pages belong to the registration: release is
/// refused (changing nothing) while an MDL lock or a DMA mapping still
/// holds a page, allowed once both are gone; then CPU accesses and locks
/// fault, and a device access through the stale bus address is a
/// `DmaFault`.
#[test]
fn release_is_refused_while_locked_or_mapped_and_faults_after() {
    let mut buffer = aligned_buffer(2);
    let addr = buffer.as_mut_ptr().cast::<u8>();
    let w = world();
    let va = adopt(&w.process, addr, 2 * PAGE_SIZE).unwrap();
    let in_use = Err(MemoryError::AdoptedPagesInUse {
        va,
        len: 2 * PAGE_SIZE,
    });

    let locked = w
        .locker
        .lock(RequestorMode::User, va + PAGE, 8, true)
        .unwrap();
    assert_eq!(w.process.release_adoption(va, 2 * PAGE_SIZE), in_use);
    assert_eq!(
        w.process.space().adopted_page_count(),
        2,
        "nothing released"
    );
    let mapping = w.adapter.map(&locked).unwrap();
    drop(locked);
    assert_eq!(
        w.process.release_adoption(va, 2 * PAGE_SIZE),
        in_use,
        "the mapping still holds the page"
    );
    w.process.write(va + PAGE, &[3; 8]).unwrap();
    let bus = mapping.page_bus_address(0).unwrap();
    w.adapter.unmap(mapping);
    w.process.release_adoption(va, 2 * PAGE_SIZE).unwrap();

    assert_eq!(
        w.process.read(va + PAGE, &mut [0u8; 8]),
        Err(MemoryError::Unmapped {
            va: va + PAGE,
            len: 8
        })
    );
    assert!(w.locker.lock(RequestorMode::User, va, 8, false).is_err());
    assert!(w.adapter.device_view().write(bus, &[9; 8]).is_err());
    let faults = w.verifier.take();
    assert!(
        matches!(&faults[..], [v] if matches!(v.kind, ViolationKind::DmaFault { addr, len: 8 } if addr == bus)),
        "{faults:?}"
    );
    assert_eq!(
        w.process.release_adoption(va, PAGE_SIZE),
        Err(MemoryError::NotAdopted { va, len: PAGE_SIZE })
    );
    assert_eq!(
        buffer[1].0[..8],
        [3; 8],
        "the refused write touched nothing"
    );
}

/// Exit drops the process's adoptions (the owner's memory is its own
/// again), but pages still locked stay reachable by the kernel and the
/// device until the lock and mapping are gone, as allocations do.
#[test]
fn process_exit_drops_adoptions() {
    let mut buffer = aligned_buffer(2);
    let addr = buffer.as_mut_ptr().cast::<u8>();
    let w = world();
    let va = adopt(&w.process, addr, 2 * PAGE_SIZE).unwrap();
    let locked = w.locker.lock(RequestorMode::User, va, PAGE, true).unwrap();
    let mapping = w.adapter.map(&locked).unwrap();
    assert_eq!(w.process.exit(), 1, "one page still locked");
    assert_eq!(w.process.space().adopted_page_count(), 0);
    assert_eq!(
        w.process.read(va, &mut [0u8; 1]),
        Err(MemoryError::ProcessExited)
    );
    assert_eq!(
        adopt(&w.process, addr, PAGE_SIZE),
        Err(MemoryError::ProcessExited)
    );
    assert_eq!(
        w.process.release_adoption(va, PAGE_SIZE),
        Err(MemoryError::ProcessExited)
    );
    w.adapter
        .device_view()
        .write(mapping.page_bus_address(0).unwrap(), &[4; 16])
        .unwrap();
    let mut through_lock = [0u8; 16];
    assert!(locked.read(0, &mut through_lock));
    assert_eq!(through_lock, [4; 16]);
    w.adapter.unmap(mapping);
    drop(locked);
    assert_eq!(buffer[0].0[..16], [4; 16]);
    w.verifier.assert_clean();
}

/// Adoptions overlapping in a page share it (counted: it leaves the space
/// with its last adoption, and only that release is refused while the
/// page is locked); a release naming a page not adopted changes nothing;
/// a range touching the simulator's own memory (an allocation, its guard
/// page, a freed allocation's address) is refused and adopts nothing;
/// `free` does not take adopted pages.
#[test]
fn overlapping_adoptions_share_pages_and_simulator_memory_is_refused() {
    let mut buffer = aligned_buffer(3);
    let addr = buffer.as_mut_ptr().cast::<u8>();
    let w = world();
    let space = w.process.space();
    let va = addr as u64;
    // A: pages 0-1 (the range ends inside page 1); B: pages 1-2.
    adopt(&w.process, addr, PAGE_SIZE + 1).unwrap();
    // 100 bytes into page 1 of the buffer.
    let second = addr.wrapping_add(PAGE_SIZE + 100);
    adopt(&w.process, second, 2 * PAGE_SIZE - 200).unwrap();
    assert_eq!(space.adopted_page_count(), 3);
    assert_eq!(
        w.process.free(va + PAGE),
        Err(MemoryError::NotAnAllocation { va: va + PAGE })
    );

    let locked = w
        .locker
        .lock(RequestorMode::User, va + PAGE, 8, true)
        .unwrap();
    // A's release drops page 0; page 1 stays, B still adopts it.
    w.process.release_adoption(va, PAGE_SIZE + 1).unwrap();
    assert_eq!(space.adopted_page_count(), 2);
    assert!(w.process.read(va, &mut [0u8; 1]).is_err());
    w.process.write(va + PAGE, &[5; 8]).unwrap();
    // B's release would drop the locked page: refused.
    let b_len = 2 * PAGE_SIZE - 200;
    assert_eq!(
        w.process.release_adoption(va + PAGE + 100, b_len),
        Err(MemoryError::AdoptedPagesInUse {
            va: va + PAGE + 100,
            len: b_len
        })
    );
    drop(locked);
    // A release naming page 0 (no longer adopted) changes nothing.
    assert_eq!(
        w.process.release_adoption(va, 3 * PAGE_SIZE),
        Err(MemoryError::NotAdopted {
            va,
            len: 3 * PAGE_SIZE
        })
    );
    assert_eq!(space.adopted_page_count(), 2);
    w.process.release_adoption(va + PAGE + 100, b_len).unwrap();
    assert_eq!(space.adopted_page_count(), 0);
    assert_eq!(buffer[1].0[..8], [5; 8]);

    // The simulator's own memory: an allocation, its guard page, a freed
    // allocation's address; each refused whole, adopting nothing.
    let allocation = w.process.alloc(PAGE_SIZE).unwrap();
    let freed = w.process.alloc(PAGE_SIZE).unwrap();
    w.process.free(freed).unwrap();
    for (at, len) in [
        (allocation + 8, 8),
        (allocation + PAGE, 8),
        (freed, PAGE_SIZE),
    ] {
        assert_eq!(
            adopt(&w.process, at as *mut u8, len),
            Err(MemoryError::OverlapsSimulatorMemory { va: at, len })
        );
    }
    assert_eq!(space.adopted_page_count(), 0);
    assert_eq!(adopt(&w.process, addr, 0), Err(MemoryError::ZeroLength));
    assert_eq!(
        adopt(&w.process, std::ptr::null_mut(), 8),
        Err(MemoryError::Unmapped { va: 0, len: 8 })
    );
    w.verifier.assert_clean();
}
