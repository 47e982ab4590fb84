//! Kernel stacks: a driver routine that uses more stack than a kernel
//! stack holds is a violation.
//!
//! Windows: ISRs, DPCs, work items and PnP callbacks run on kernel stacks
//! of `KERNEL_STACK_SIZE`, 24 KiB on x64 (12 KiB on x86); the DPC and ISR
//! stacks are per processor and as small. A driver that needs more must
//! switch stacks itself (`KeExpandKernelStackAndCallout`); otherwise it
//! overruns the guard page and the machine bugchecks
//! (`UNEXPECTED_KERNEL_MODE_TRAP` with `EXCEPTION_DOUBLE_FAULT`, see
//! "Kernel stack overflows" on learn.microsoft.com).
//!
//! Model: the host runs every driver routine it calls (ISR, DPC, timer
//! routine, work item, PnP, power and request callbacks) through
//! [`measured`], which paints the stack below the caller with a pattern,
//! runs the routine, finds the deepest byte it changed, and records
//! [`ViolationKind::KernelStackOverflow`] if the routine used more than
//! [`budget`]. Host threads have megabytes of stack, so nothing crashes:
//! the overuse is recorded against the driver and the run goes on.
//!
//! The budget depends on the build, since an unoptimised build uses
//! several times the stack of an optimised one:
//! [`OPTIMISED_BUDGET`] (24 KiB, the Windows figure) when debug assertions
//! are off — the swarm and main job's `--release` builds — and
//! [`DEBUG_BUDGET`] in the default test profile (`docs/host-model.md`,
//! "Kernel stacks", gives the numbers measured).
//!
//! A routine's use counts from the host's call into it down to the deepest
//! point of its code and of the host services it calls. A driver routine
//! the host runs from inside another (the deterministic scheduler running a
//! DPC while a PnP callback waits, a driver calling the driver below it) is
//! measured on its own; the outer routine is charged down to where the
//! inner one began. [`high_water`] tells the most each kind of routine used
//! so far in this process.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::context;
use crate::verifier::ViolationKind;

/// `KERNEL_STACK_SIZE` on x64: the budget in optimised builds.
pub const OPTIMISED_BUDGET: usize = 24 * 1024;

/// The budget in unoptimised builds, a backstop: debug code takes 2.5 to
/// 3.8 times the stack of release code on the miniport's paths, so this is
/// four times the Windows figure, above the deepest debug routine of the
/// default suites (66 KiB) and below what a routine with 128 KiB of locals
/// needs (`docs/host-model.md`, "Kernel stacks").
pub const DEBUG_BUDGET: usize = 4 * OPTIMISED_BUDGET;

/// The budget that applies to this build.
pub const fn budget() -> usize {
    if cfg!(debug_assertions) {
        DEBUG_BUDGET
    } else {
        OPTIMISED_BUDGET
    }
}

/// How far below the budget is painted: enough to see an overuse, and to
/// measure one up to this much beyond the budget (a deeper use reads as
/// `budget() + MEASURED_BEYOND_BUDGET`).
pub const MEASURED_BEYOND_BUDGET: usize = 32 * 1024;

/// Left unpainted just below the painting function's own frame, for the
/// frames of the `memset` it calls.
const PAINTER_FRAME: usize = 4 * 1024;

/// Never painted: the bottom of the thread's stack, above its guard page.
const STACK_FLOOR_MARGIN: usize = 64 * 1024;

/// The paint. A routine that writes exactly this word everywhere it goes
/// is under-measured; none does.
const PATTERN: u64 = 0x5354_4B50_5354_4B50; // "PKTSPKTS"

/// Painting and scanning go a chunk at a time (a `memcpy` or `memcmp`
/// each, fast in debug builds too).
const CHUNK_WORDS: usize = 512;
/// One chunk of paint.
static PAINTED: [u64; CHUNK_WORDS] = [PATTERN; CHUNK_WORDS];

/// The kinds of routine the host measures, for [`high_water`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoutineKind {
    /// An ISR (DIRQL).
    Isr,
    /// A DPC or timer routine (DISPATCH_LEVEL).
    Dpc,
    /// A work item (PASSIVE_LEVEL).
    WorkItem,
    /// A PnP, power or request callback.
    Callback,
}

impl RoutineKind {
    const ALL: [RoutineKind; 4] = [Self::Isr, Self::Dpc, Self::WorkItem, Self::Callback];

    fn index(self) -> usize {
        self as usize
    }
}

/// The most stack each kind of routine used so far in this process.
static HIGH_WATER: [AtomicUsize; 4] = [const { AtomicUsize::new(0) }; 4];

/// The most stack (bytes) each kind of routine has used so far in this
/// process, as measured (a use below the painted depth is "at least").
pub fn high_water() -> Vec<(RoutineKind, usize)> {
    RoutineKind::ALL
        .iter()
        .map(|&kind| (kind, HIGH_WATER[kind.index()].load(Ordering::Relaxed)))
        .collect()
}

/// The measurement in progress on this thread.
#[derive(Debug, Clone, Copy)]
struct Frame {
    /// Lowest painted address.
    low: usize,
    /// Top of the painted range (exclusive).
    top: usize,
    /// The deepest address known used so far (from nested routines'
    /// entries and scans made before they repainted).
    deepest: usize,
}

thread_local! {
    /// The routine being measured on this thread, if any.
    static FRAME: Cell<Option<Frame>> = const { Cell::new(None) };
    /// The lowest address this thread's stack may be painted at; 0 until
    /// known, `usize::MAX` if it cannot be known (then nothing is measured).
    static FLOOR: Cell<usize> = const { Cell::new(0) };
}

/// An address inside the calling function's frame.
#[inline(always)]
fn stack_pointer() -> usize {
    let marker = 0u8;
    std::hint::black_box(&marker) as *const u8 as usize
}

/// The lowest address of the calling thread's stack that may be painted.
fn floor() -> usize {
    let known = FLOOR.get();
    if known != 0 {
        return known;
    }
    let floor = thread_stack_low().map_or(usize::MAX, |low| low + STACK_FLOOR_MARGIN);
    FLOOR.set(floor);
    floor
}

/// The low end of the calling thread's stack.
#[cfg(target_os = "linux")]
fn thread_stack_low() -> Option<usize> {
    let mut attr = std::mem::MaybeUninit::<libc::pthread_attr_t>::uninit();
    // SAFETY: `pthread_self` has no preconditions.
    let this_thread = unsafe { libc::pthread_self() };
    // SAFETY: `this_thread` is the live calling thread; `pthread_getattr_np`
    // initialises `attr` when it returns 0.
    if unsafe { libc::pthread_getattr_np(this_thread, attr.as_mut_ptr()) } != 0 {
        return None;
    }
    let mut addr = std::ptr::null_mut();
    let mut size = 0usize;
    // SAFETY: `attr` was initialised by `pthread_getattr_np` above.
    let status = unsafe { libc::pthread_attr_getstack(attr.as_ptr(), &mut addr, &mut size) };
    // SAFETY: initialised above and destroyed once.
    unsafe { libc::pthread_attr_destroy(attr.as_mut_ptr()) };
    (status == 0 && size != 0).then_some(addr as usize)
}

/// Elsewhere the stack's bounds are not known: nothing is measured.
#[cfg(not(target_os = "linux"))]
fn thread_stack_low() -> Option<usize> {
    None
}

/// Paints `[low, top)` of this thread's stack, where `top` is lowered to
/// stay clear of this function's own frame; returns the range painted.
#[inline(never)]
fn paint(low: usize, top: usize) -> Option<(usize, usize)> {
    let top = top.min(stack_pointer().saturating_sub(PAINTER_FRAME)) & !7;
    let low = (low + 7) & !7;
    if low >= top {
        return None;
    }
    let words = (top - low) / 8;
    // SAFETY: `[low, top)` lies inside the calling thread's stack (above
    // `floor()`, so above its guard page), 8-byte aligned, and below the
    // stack pointer of this function less `PAINTER_FRAME`, so it holds no
    // live frame: it is the unused part of the stack, which only this
    // thread touches, and the `memcpy`s below need far less than
    // `PAINTER_FRAME` of stack. The slice lives only in this function.
    let range = unsafe { std::slice::from_raw_parts_mut(low as *mut u64, words) };
    // Chunk by chunk: a `memcpy` each, fast in debug builds too.
    for chunk in range.chunks_mut(CHUNK_WORDS) {
        chunk.copy_from_slice(&PAINTED[..chunk.len()]);
    }
    Some((low, top))
}

/// The lowest address in `[low, top)` that no longer holds the paint, or
/// the top of what was read if none. Like [`paint`], it reads nothing
/// within `PAINTER_FRAME` of its own frame.
#[inline(never)]
fn lowest_used(low: usize, top: usize) -> usize {
    let top = top.min(stack_pointer().saturating_sub(PAINTER_FRAME)) & !7;
    if low >= top {
        return top;
    }
    let words = (top - low) / 8;
    // SAFETY: `[low, top)` lies inside this thread's stack (above
    // `floor()`, as `paint` chose it), 8-byte aligned, and below this
    // function's frame less `PAINTER_FRAME`, so no live frame is in it and
    // nothing writes it while the slice, local to this function, exists
    // (the routine measured has returned; a nested one runs only after).
    let range = unsafe { std::slice::from_raw_parts(low as *const u64, words) };
    let mut at = 0;
    while at < words {
        let end = (at + CHUNK_WORDS).min(words);
        if range[at..end] != PAINTED[..end - at] {
            let offset = range[at..end]
                .iter()
                .position(|&w| w != PATTERN)
                .unwrap_or(0);
            return low + (at + offset) * 8;
        }
        at = end;
    }
    top
}

/// Restores this thread's measurement frame when a measured routine ends,
/// also by unwinding.
struct Restore(Option<Frame>);

impl Drop for Restore {
    fn drop(&mut self) {
        FRAME.set(self.0);
    }
}

/// Runs the driver routine `f` (named `routine` in a report, of kind
/// `kind`), measuring its stack use; records
/// [`ViolationKind::KernelStackOverflow`] in the current context if it
/// used more than [`budget`]. Called by the host inside the routine's
/// driver context.
#[inline(never)]
pub fn measured<R>(kind: RoutineKind, routine: &'static str, f: impl FnOnce() -> R) -> R {
    let entry = stack_pointer();
    let floor = floor();
    if floor == usize::MAX || entry <= floor {
        return f();
    }
    let outer = FRAME.get();
    // What the enclosing routine used below here is its own: take it
    // before this routine's paint covers it.
    let outer = outer.map(|mut o| {
        let top = o.top.min(entry);
        if o.low < top {
            o.deepest = o.deepest.min(lowest_used(o.low, top)).min(entry);
        }
        o
    });
    let low = floor.max(entry.saturating_sub(budget() + MEASURED_BEYOND_BUDGET));
    let Some((low, top)) = paint(low, entry) else {
        return f();
    };
    let restore = Restore(outer);
    FRAME.set(Some(Frame {
        low,
        top,
        deepest: usize::MAX,
    }));
    let result = f();
    let mine = FRAME.get().map_or(usize::MAX, |m| m.deepest);
    let deepest = mine.min(lowest_used(low, top));
    let used = entry.saturating_sub(deepest.min(entry));
    HIGH_WATER[kind.index()].fetch_max(used, Ordering::Relaxed);
    if let Some(o) = outer {
        // Hide this routine's use from the enclosing one's later scan.
        let _ = paint(o.low, o.top.min(entry));
    }
    drop(restore);
    if used > budget() {
        let _host = crate::alloc_hook::HostCode::enter();
        context::report(ViolationKind::KernelStackOverflow {
            routine,
            used,
            budget: budget(),
        });
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::Context;
    use crate::verifier::Verifier;

    /// Uses a bit more than `budget() + 8 KiB` of stack.
    #[inline(never)]
    fn deep() {
        let mut scratch = [0u8; budget() + 8 * 1024];
        std::hint::black_box(&mut scratch);
    }

    fn overflows(verifier: &Verifier) -> Vec<&'static str> {
        verifier
            .take()
            .into_iter()
            .filter_map(|v| match v.kind {
                ViolationKind::KernelStackOverflow { routine, .. } => Some(routine),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_nested_routine_is_charged_its_own_use_not_its_caller() {
        let verifier = Verifier::new();
        let _driver = crate::context::enter(Context::driver(verifier.clone(), "drv"));
        measured(RoutineKind::Callback, "outer", || {
            measured(RoutineKind::Dpc, "inner", deep);
        });
        assert_eq!(overflows(&verifier), ["inner"]);
        // The same use in the outer routine itself is the outer's.
        measured(RoutineKind::Callback, "outer", || {
            measured(RoutineKind::Dpc, "inner", || {});
            deep();
        });
        assert_eq!(overflows(&verifier), ["outer"]);
    }

    #[test]
    fn a_small_routine_is_within_budget() {
        let verifier = Verifier::new();
        let _driver = crate::context::enter(Context::driver(verifier.clone(), "drv"));
        let sum = measured(RoutineKind::Isr, "isr", || std::hint::black_box(2) + 2);
        assert_eq!(sum, 4);
        verifier.assert_clean();
        let isr = high_water()[0];
        assert_eq!(isr.0, RoutineKind::Isr);
        assert!(isr.1 > 0 && isr.1 < budget(), "{isr:?}");
    }
}
