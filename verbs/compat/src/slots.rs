//! Where the data path's objects live: a table of slots whose memory the
//! library never frees, so that the pointer a program holds (the rdma-core
//! struct at the front of a slot) leads to the object by arithmetic — no
//! registry lookup, no lock, no allocation — and a pointer that is not
//! ours, or whose object is destroyed, is refused without reading memory
//! that is not a slot.
//!
//! **Ours or not.** Slots are allocated in segments (the first of
//! [`FIRST_SEGMENT`] slots, each next twice the last), published once and
//! never freed. A pointer is ours if it is the start of a slot of a
//! published segment: a range and a stride check per segment (one segment
//! for up to 64 live objects), made before the pointer is dereferenced.
//!
//! **Live or not.** A slot's `state` word holds a live bit and the count
//! of calls inside it. A call ([`Table::with`]) that finds the bit set
//! adds one to the count and uses the object only if the bit was still
//! set at that moment; it subtracts one when done (a call that finds the
//! bit clear touches nothing, so calls on a destroyed pointer cannot hold
//! a destroy up). [`Table::take`] clears the bit, then waits until the
//! count is zero before taking the object out: every call that saw the
//! bit set has finished with the object, and every later one sees it
//! clear and leaves the object alone. So a destroy returns only once no
//! call is inside the object, and a call after it is refused.
//!
//! **Reuse.** A slot goes back to the table when its object is dropped
//! (its [`Lease`] with it: no Rust reference to it remains), and is handed
//! out again only once more than [`QUARANTINE`] slots are free, oldest
//! first: a destroyed object's pointer stays refused until that many more
//! objects of its kind were destroyed after it (rdma-core frees the memory
//! at once, and a stale pointer reaches whatever `malloc` put there).
//!
//! **Model-checked.** The live bit and call count are a lock-free protocol:
//! its code is a slot's own (`Slot::with`, `take`, `publish`), whose
//! `state` and `object` come from [`sync`] — loom's under `--cfg loom` —
//! and the `loom_` models below (`cargo xtask loom`) explore every
//! interleaving of a call against a destroy, two calls against a destroy,
//! two destroys, and a slot reused under a stale call. (The free list is
//! behind a lock; a segment is published once.)

use std::collections::VecDeque;
use std::mem::MaybeUninit;
use std::ptr::null_mut;
use std::sync::atomic::AtomicPtr;
use std::sync::{Arc, Mutex, PoisonError};

use sync::{AtomicUsize, Ordering, UnsafeCell};

/// The protocol's atomic, cell and yield: `std`'s normally, loom's under
/// `--cfg loom` (`cargo xtask loom`), so the model checker runs the code
/// that ships. The cell has loom's API (each access a closure, so loom
/// sees how long it lasts).
mod sync {
    #[cfg(loom)]
    pub(super) use loom::cell::UnsafeCell;
    #[cfg(loom)]
    pub(super) use loom::sync::atomic::{AtomicUsize, Ordering};
    #[cfg(loom)]
    pub(super) use loom::thread::yield_now;

    #[cfg(not(loom))]
    pub(super) use std::sync::atomic::{AtomicUsize, Ordering};
    #[cfg(not(loom))]
    pub(super) use std::thread::yield_now;

    /// `std`'s cell with loom's closure API.
    #[cfg(not(loom))]
    #[derive(Debug)]
    pub(super) struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

    #[cfg(not(loom))]
    impl<T> UnsafeCell<T> {
        pub(super) fn new(value: T) -> Self {
            Self(std::cell::UnsafeCell::new(value))
        }

        /// Reads through the pointer `read` is given.
        pub(super) fn with<U>(&self, read: impl FnOnce(*const T) -> U) -> U {
            read(self.0.get())
        }

        /// Writes through the pointer `write` is given.
        pub(super) fn with_mut<U>(&self, write: impl FnOnce(*mut T) -> U) -> U {
            write(self.0.get())
        }
    }
}

/// Slots in the first segment; segment `i` holds `FIRST_SEGMENT << i`.
const FIRST_SEGMENT: usize = 64;
/// Segments at most: room for `64 * (2^26 - 1)` objects of a kind.
const SEGMENTS: usize = 26;
/// Free slots kept unused before the oldest is handed out again.
pub(crate) const QUARANTINE: usize = 32;

/// The `state` bit of a slot whose object calls may use.
const LIVE: usize = 1 << (usize::BITS - 1);

/// One slot: the rdma-core struct the program points to, first; then the
/// live bit and count of calls inside, and the object.
#[repr(C)]
pub(crate) struct Slot<R, T> {
    /// Written only while the slot is reserved and not yet published.
    raw: std::cell::UnsafeCell<MaybeUninit<R>>,
    state: AtomicUsize,
    /// `Some` exactly while `state` is live; written only with `LIVE`
    /// clear and no call inside.
    object: UnsafeCell<Option<Arc<T>>>,
}

/// The free slots, and how many slots were ever handed out.
struct Growth {
    free: VecDeque<usize>,
    used: usize,
}

/// A table of slots of one kind of object.
pub(crate) struct Table<R, T> {
    segments: [AtomicPtr<Slot<R, T>>; SEGMENTS],
    growth: Mutex<Growth>,
}

// SAFETY: a slot's `raw` is written only through a `Lease` before the
// slot is published (no call reads it then; the program's own reads of
// its struct are rdma-core's contract, as with any provider); `object` is
// read only by calls counted in `state` while `LIVE` is set, and written
// only with `LIVE` clear and the count zero (`take`, `publish`), so the
// table shares `Arc<T>` clones across threads: `T: Send + Sync`.
unsafe impl<R, T: Send + Sync> Sync for Table<R, T> {}
// SAFETY: as for `Sync`.
unsafe impl<R, T: Send + Sync> Send for Table<R, T> {}
// SAFETY: as for the table: `raw` is written before the slot is shared,
// `object` only as the protocol allows (`with`, `take`, `publish`).
unsafe impl<R, T: Send + Sync> Sync for Slot<R, T> {}
// SAFETY: as for `Sync`.
unsafe impl<R, T: Send + Sync> Send for Slot<R, T> {}

/// A call counted inside a live slot; ends it when dropped (even on a
/// panic, which the entry points catch).
struct Visit<'a>(&'a AtomicUsize);

impl Drop for Visit<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Release);
    }
}

impl<R, T> Slot<R, T> {
    /// An empty slot: not live, no call inside.
    fn new() -> Self {
        Self {
            raw: std::cell::UnsafeCell::new(MaybeUninit::uninit()),
            state: AtomicUsize::new(0),
            object: UnsafeCell::new(None),
        }
    }

    /// Counts a call inside the slot if it is live: the call may use the
    /// object until the visit is dropped. A slot seen not live is left
    /// untouched, so calls on a destroyed object's pointer never hold up
    /// a `take` (only the few racing the live bit's clearing are counted
    /// a moment, then leave).
    fn enter(&self) -> Option<Visit<'_>> {
        if self.state.load(Ordering::Relaxed) & LIVE == 0 {
            return None;
        }
        let state = self.state.fetch_add(1, Ordering::Acquire);
        let visit = Visit(&self.state);
        (state & LIVE != 0).then_some(visit)
    }

    /// Runs `call` on the slot's object if it is live (`Table::with`).
    fn with<U>(&self, call: impl FnOnce(&T) -> U) -> Option<U> {
        let _visit = self.enter()?;
        self.object.with(|object| {
            // SAFETY: `LIVE` was set when this call was counted, so `object`
            // is `Some` and stays untouched until the count is back to zero
            // (`take` waits for it); the acquire pairs with `publish`'s
            // release.
            let object = unsafe { (*object).as_deref() }?;
            Some(call(object))
        })
    }

    /// The slot's object, shared, if it is live (`Table::get`).
    fn get(&self) -> Option<Arc<T>> {
        let _visit = self.enter()?;
        // SAFETY: as in `with`.
        self.object.with(|object| unsafe { (*object).clone() })
    }

    /// Takes the live object out (`Table::take`): `None` if it is not
    /// live. Waits until no call is inside it.
    fn take(&self) -> Option<Arc<T>> {
        if self.state.fetch_and(!LIVE, Ordering::AcqRel) & LIVE == 0 {
            return None;
        }
        while self.state.load(Ordering::Acquire) & !LIVE != 0 {
            sync::yield_now();
        }
        // SAFETY: `LIVE` is clear (this call cleared it) and no call is
        // inside: nothing else reads or writes `object` now.
        self.object.with_mut(|object| unsafe { (*object).take() })
    }

    /// Makes `object` live in the slot, which is not live (`Table::publish`).
    fn publish(&self, object: Arc<T>) {
        debug_assert_eq!(self.state.load(Ordering::Acquire) & LIVE, 0);
        // SAFETY: the slot is not live: no call reads `object` (calls that
        // count themselves meanwhile see `LIVE` clear and leave it).
        self.object.with_mut(|slot| unsafe { *slot = Some(object) });
        self.state.fetch_or(LIVE, Ordering::Release);
    }
}

impl<R: 'static, T: 'static> Table<R, T> {
    pub(crate) const fn new() -> Self {
        Self {
            segments: [const { AtomicPtr::new(null_mut()) }; SEGMENTS],
            growth: Mutex::new(Growth {
                free: VecDeque::new(),
                used: 0,
            }),
        }
    }

    /// The slot `ptr` is the start of, if it is one of ours (it is not
    /// dereferenced to find out).
    fn slot(&self, ptr: *const R) -> Option<&Slot<R, T>> {
        let address = ptr as usize;
        let stride = size_of::<Slot<R, T>>();
        for (index, segment) in self.segments.iter().enumerate() {
            let base = segment.load(Ordering::Acquire);
            if base.is_null() {
                return None;
            }
            let offset = address.wrapping_sub(base as usize);
            if offset < (FIRST_SEGMENT << index) * stride && offset.is_multiple_of(stride) {
                let slot = base.wrapping_add(offset / stride);
                // SAFETY: `base` is a published segment of that many slots,
                // never freed; `offset / stride` is in it.
                return Some(unsafe { &*slot });
            }
        }
        None
    }

    /// Runs `call` on the live object `ptr` names: `None` (and `call` not
    /// run) if `ptr` is not ours or its object is destroyed. No lock, no
    /// allocation.
    pub(crate) fn with<U>(&self, ptr: *const R, call: impl FnOnce(&T) -> U) -> Option<U> {
        self.slot(ptr)?.with(call)
    }

    /// The live object `ptr` names, shared (the control path's use).
    pub(crate) fn get(&self, ptr: *const R) -> Option<Arc<T>> {
        self.slot(ptr)?.get()
    }

    /// Takes the live object `ptr` names out of the table: `None` if it is
    /// not ours or already taken. Waits until no call is inside it.
    pub(crate) fn take(&self, ptr: *const R) -> Option<Arc<T>> {
        self.slot(ptr)?.take()
    }

    /// Makes `object` live in its slot, whose `Lease` it holds (a reserved
    /// slot, or one `take` emptied).
    pub(crate) fn publish(&self, lease: &Lease<R, T>, object: Arc<T>) {
        lease.slot().publish(object);
    }

    /// Reserves a slot for a new object, its rdma-core struct `raw`; the
    /// object holds the lease, and the slot returns to the table when the
    /// object is dropped. `None` when every segment is in use.
    pub(crate) fn reserve(&'static self, raw: R) -> Option<Lease<R, T>> {
        let address = {
            let mut growth = self.growth.lock().unwrap_or_else(PoisonError::into_inner);
            if growth.free.len() > QUARANTINE {
                growth.free.pop_front()?
            } else {
                let at = growth.used;
                let slot = self.fresh_slot(at)?;
                growth.used += 1;
                slot
            }
        };
        let lease = Lease {
            table: self,
            slot: address,
        };
        // SAFETY: a slot reserved only here and not live: no call reads its
        // `raw`.
        unsafe { (*lease.slot().raw.get()).write(raw) };
        Some(lease)
    }

    /// The address of slot number `at` (counting across segments),
    /// allocating its segment when it is the first there. Under `growth`'s
    /// lock.
    fn fresh_slot(&self, at: usize) -> Option<usize> {
        let mut first = 0;
        for (index, segment) in self.segments.iter().enumerate() {
            let len = FIRST_SEGMENT << index;
            if at < first + len {
                let mut base = segment.load(Ordering::Acquire);
                if base.is_null() {
                    let slots: Box<[Slot<R, T>]> = (0..len).map(|_| Slot::new()).collect();
                    // Never freed: a pointer into it stays checkable.
                    base = Box::leak(slots).as_mut_ptr();
                    segment.store(base, Ordering::Release);
                }
                // SAFETY: `at - first` is within the segment's `len` slots.
                return Some(unsafe { base.add(at - first) } as usize);
            }
            first += len;
        }
        None
    }
}

/// A reserved slot, held by its object: the rdma-core struct's address.
pub(crate) struct Lease<R: 'static, T: 'static> {
    table: &'static Table<R, T>,
    slot: usize,
}

impl<R: 'static, T: 'static> Lease<R, T> {
    fn slot(&self) -> &Slot<R, T> {
        // SAFETY: a slot of a published segment, never freed.
        unsafe { &*(self.slot as *const Slot<R, T>) }
    }

    /// The rdma-core struct the program holds (written when the slot was
    /// reserved).
    pub(crate) fn get(&self) -> *mut R {
        self.slot().raw.get().cast()
    }
}

impl<R: 'static, T: 'static> Drop for Lease<R, T> {
    fn drop(&mut self) {
        // The object holding the lease is being dropped, so the slot holds
        // it no more (or never did): free for a later reserve.
        self.table
            .growth
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .free
            .push_back(self.slot);
    }
}

impl<R: 'static, T: 'static> std::fmt::Debug for Lease<R, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Lease").field(&self.get()).finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    /// An object of a test table: its slot's `u64` is its number.
    struct Object {
        raw: Lease<u64, Object>,
        /// Set once `take` has returned it.
        taken: AtomicBool,
    }

    fn make(table: &'static Table<u64, Object>, number: u64) -> (*mut u64, Arc<Object>) {
        let object = Arc::new(Object {
            raw: table.reserve(number).expect("a slot"),
            taken: AtomicBool::new(false),
        });
        table.publish(&object.raw, Arc::clone(&object));
        (object.raw.get(), object)
    }

    /// Readers call into the objects a writer keeps making and taking: a
    /// call never runs on an object once `take` has returned it (a call
    /// stays inside across a thread switch, so a take that did not wait
    /// for it would be seen), and a taken pointer is refused.
    #[test]
    fn a_call_never_runs_on_a_taken_object() {
        static TABLE: Table<u64, Object> = Table::new();
        let current = Arc::new(AtomicUsize::new(0));
        let done = Arc::new(AtomicBool::new(false));
        let readers: Vec<_> = (0..3)
            .map(|_| {
                let (current, done) = (Arc::clone(&current), Arc::clone(&done));
                std::thread::spawn(move || {
                    let (mut ran, mut refused) = (0u64, 0u64);
                    while !done.load(Ordering::Acquire) {
                        let ptr = current.load(Ordering::Acquire) as *const u64;
                        let seen = TABLE.with(ptr, |object| {
                            let taken = || object.taken.load(Ordering::Acquire);
                            assert!(!taken(), "a call on a taken object");
                            // Inside the object across a switch: a take
                            // meanwhile must wait for this call.
                            std::thread::yield_now();
                            assert!(!taken(), "a call on a taken object");
                            // SAFETY: the slot's `u64`, written at reserve.
                            unsafe { *object.raw.get() }
                        });
                        match seen {
                            Some(_) => ran += 1,
                            None => refused += 1,
                        }
                        std::thread::yield_now();
                    }
                    (ran, refused)
                })
            })
            .collect();
        for number in 1..=300u64 {
            let (ptr, object) = make(&TABLE, number);
            current.store(ptr as usize, Ordering::Release);
            for _ in 0..4 {
                std::thread::yield_now();
            }
            let taken = TABLE.take(ptr).expect("live");
            taken.taken.store(true, Ordering::Release);
            assert!(TABLE.take(ptr).is_none(), "taken once");
            assert!(TABLE.get(ptr).is_none() && TABLE.with(ptr, |_| ()).is_none());
            drop((taken, object));
        }
        done.store(true, Ordering::Release);
        let (ran, refused) = readers
            .into_iter()
            .map(|r| r.join().expect("a reader ended cleanly"))
            .fold((0, 0), |(a, b), (c, d)| (a + c, b + d));
        assert!(ran > 0, "calls ran on live objects ({refused} refused)");
    }

    /// Only a slot's start is ours: other addresses are refused without
    /// being read.
    #[test]
    fn only_a_slots_start_is_ours() {
        static TABLE: Table<u64, Object> = Table::new();
        let (ptr, _object) = make(&TABLE, 7);
        assert_eq!(
            TABLE.with(ptr, |o| o.taken.load(Ordering::Relaxed)),
            Some(false)
        );
        let inside = ptr.cast::<u8>().wrapping_add(4).cast::<u64>();
        let local = 7u64;
        for other in [
            inside,
            std::ptr::null_mut(),
            std::ptr::from_ref(&local).cast_mut(),
        ] {
            assert!(TABLE.with(other, |_| ()).is_none());
            assert!(TABLE.get(other).is_none() && TABLE.take(other).is_none());
        }
    }

    /// A freed slot is handed out again only once more than `QUARANTINE`
    /// are free, oldest first.
    #[test]
    fn a_slot_is_reused_after_the_quarantine() {
        static TABLE: Table<u64, Object> = Table::new();
        let mut freed = Vec::new();
        for number in 0..=QUARANTINE as u64 {
            let (ptr, object) = make(&TABLE, number);
            drop(TABLE.take(ptr));
            drop(object);
            assert!(!freed.contains(&ptr), "a fresh slot while few are free");
            freed.push(ptr);
        }
        let (reused, _object) = make(&TABLE, 99);
        assert_eq!(reused, freed[0], "the oldest free slot");
        assert_eq!(TABLE.with(freed[1], |_| ()), None);
    }

    /// Past the first segment the table grows, and every slot stays
    /// reachable.
    #[test]
    fn the_table_grows_by_segments() {
        static TABLE: Table<u64, Object> = Table::new();
        let made: Vec<_> = (0..(FIRST_SEGMENT * 3) as u64)
            .map(|n| make(&TABLE, n))
            .collect();
        for (number, (ptr, _)) in made.iter().enumerate() {
            // SAFETY: the slot's `u64`, written at reserve.
            let seen = TABLE.with(*ptr, |o| unsafe { *o.raw.get() });
            assert_eq!(seen, Some(number as u64));
        }
    }
}

/// The live bit and call count under loom: every interleaving (and every
/// value the memory model lets a load see) of the slot's own code. An
/// object is a cell of a number that its destroy overwrites once `take`
/// has returned it (rdma-core's provider frees it then): loom reports a
/// call still reading it, or a call reading the slot's `object` while a
/// `take` or `publish` writes it, as a data race.
#[cfg(all(test, loom))]
mod loom_slots {
    use super::*;
    use loom::sync::Arc as ModelArc;

    /// A model object: its number, overwritten when it is destroyed.
    struct Object(UnsafeCell<u64>);

    // SAFETY: every access to the cell goes through loom, which checks that
    // no two race (the point of the models).
    unsafe impl Sync for Object {}

    impl Object {
        fn new(number: u64) -> Arc<Self> {
            Arc::new(Self(UnsafeCell::new(number)))
        }

        fn number(&self) -> u64 {
            // SAFETY: loom checks the access (see `Sync`).
            self.0.with(|number| unsafe { *number })
        }

        /// The destroy's end: the provider frees the object.
        fn destroy(&self) {
            // SAFETY: loom checks the access (see `Sync`).
            self.0.with_mut(|number| unsafe { *number = 0 });
        }
    }

    fn live_slot(number: u64) -> ModelArc<Slot<u64, Object>> {
        let slot = ModelArc::new(Slot::new());
        slot.publish(Object::new(number));
        slot
    }

    /// A call: refused, or run on the live object (seen whole).
    fn call(slot: &Slot<u64, Object>) -> Option<u64> {
        slot.with(Object::number)
    }

    /// A call on another thread.
    fn spawn_call(slot: &ModelArc<Slot<u64, Object>>) -> loom::thread::JoinHandle<Option<u64>> {
        let slot = slot.clone();
        loom::thread::spawn(move || call(&slot))
    }

    /// A destroy of the live object: taken, then overwritten.
    fn destroy(slot: &Slot<u64, Object>) -> Arc<Object> {
        let taken = slot.take().expect("live until this destroy");
        taken.destroy();
        taken
    }

    /// A call against a destroy: the call runs on the object or is
    /// refused, never on it after `take` returned it; after the destroy
    /// every call and a second destroy are refused.
    #[test]
    fn loom_a_call_against_a_destroy() {
        loom::model(|| {
            let slot = live_slot(7);
            let caller = spawn_call(&slot);
            let _taken = destroy(&slot);
            let seen = caller.join().unwrap();
            assert!(matches!(seen, None | Some(7)), "{seen:?}");
            assert_eq!(call(&slot), None);
            assert!(slot.take().is_none() && slot.get().is_none());
        });
    }

    /// Two calls (one `with`, one `get`, as the data and control paths
    /// do) against a destroy: the destroy waits for both, and neither
    /// reads the slot's cell while `take` empties it.
    #[test]
    fn loom_two_calls_against_a_destroy() {
        loom::model(|| {
            let slot = live_slot(7);
            let with = spawn_call(&slot);
            let get = {
                let slot = slot.clone();
                // The control path's clone (which keeps the object, not
                // the slot: the object is not read here).
                loom::thread::spawn(move || slot.get().is_some())
            };
            let _taken = destroy(&slot);
            assert!(matches!(with.join().unwrap(), None | Some(7)));
            get.join().unwrap();
        });
    }

    /// Two destroys of one object: exactly one takes it.
    #[test]
    fn loom_two_destroys_take_once() {
        loom::model(|| {
            let slot = live_slot(7);
            let other = {
                let slot = slot.clone();
                loom::thread::spawn(move || slot.take().is_some())
            };
            let mine = slot.take().is_some();
            assert!(mine ^ other.join().unwrap(), "taken exactly once");
        });
    }

    /// A slot reused (its object destroyed, a new one published) under a
    /// stale call: the call sees the old object whole, nothing, or the new
    /// one whole; never the old one once taken, never the slot's cell
    /// while `take` or `publish` writes it.
    #[test]
    fn loom_a_reused_slot_under_a_stale_call() {
        loom::model(|| {
            let slot = live_slot(7);
            let caller = spawn_call(&slot);
            drop(destroy(&slot));
            slot.publish(Object::new(8));
            let seen = caller.join().unwrap();
            assert!(matches!(seen, None | Some(7) | Some(8)), "{seen:?}");
            assert_eq!(call(&slot), Some(8));
        });
    }
}
