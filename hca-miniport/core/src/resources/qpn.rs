//! QP numbering: the special QPs reserved per port, and a quarantine (the
//! guide's TIME WAIT) before a destroyed QP's number is reused, also across
//! a restart of the device (see [`QpnAllocator::retire_all`] and
//! [`rotation_start`]).

use alloc::vec::Vec;

use super::free_list::FreeList;
use super::table::ObjectTable;
use super::{Handle, MAX_OBJECTS, ResourceError, kind};

/// The two special QPs every port has (PRM 5, guide 6.7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecialQp {
    /// QP0, the subnet management interface.
    Smi,
    /// QP1, the general services interface.
    Gsi,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum QpnState {
    /// A special QP's number: never allocated or released here.
    Special,
    /// In the free list.
    Free,
    /// Handed out by `alloc`.
    InUse,
    /// Released, waiting out the quiet period.
    Quarantined,
}

/// Allocates general QP numbers `2·num_ports..capacity`.
///
/// Numbers `0..2·num_ports` are the special QPs (PRM 5: QP `2·(port−1)` is
/// the port's SMI QP, `2·(port−1)+1` its GSI QP) and are never handed out.
/// A released number is quarantined and becomes reusable only once
/// `quiet_period_ns` has passed since its release, so a late packet or
/// event for the old connection cannot reach a new QP (guide 6.5.2, 6.5.5
/// item 11). Reuse is FIFO: the number released longest ago (or never used)
/// comes first. Time is whatever monotonic nanosecond count the caller
/// passes; if it goes backwards, quarantined numbers just wait longer.
///
/// # Invariants
/// `free` holds exactly the numbers in state `Free`; `quarantine` exactly
/// those in state `Quarantined`, in order of release.
#[derive(Debug, Clone)]
pub struct QpnAllocator {
    states: Vec<QpnState>,
    free: FreeList,
    quarantine: FreeList,
    released_at_ns: Vec<u64>,
    quiet_period_ns: u64,
    num_ports: u8,
}

impl QpnAllocator {
    /// An allocator for `capacity` QP numbers (`1 << log_max_qps`) on a
    /// device with `num_ports` ports. The only allocation it makes.
    ///
    /// Fails with [`ResourceError::InvalidCapacity`] when `capacity`
    /// exceeds [`MAX_OBJECTS`] or cannot hold the special QPs.
    pub fn new(capacity: u32, num_ports: u8, quiet_period_ns: u64) -> Result<Self, ResourceError> {
        Self::starting_at(capacity, num_ports, quiet_period_ns, 0)
    }

    /// As [`new`](Self::new), but the first number handed out is the
    /// general number `start` designates (taken modulo the general
    /// numbers, so any value is valid), the rest following in order and
    /// wrapping round: a fresh device's numbering rotated away from where
    /// a previous life of the same device may have left QPs that peers
    /// still address ([`rotation_start`]).
    pub fn starting_at(
        capacity: u32,
        num_ports: u8,
        quiet_period_ns: u64,
        start: u32,
    ) -> Result<Self, ResourceError> {
        let special = 2 * u32::from(num_ports);
        if capacity > MAX_OBJECTS || special > capacity {
            return Err(ResourceError::InvalidCapacity);
        }
        let mut states = alloc::vec![QpnState::Free; capacity as usize];
        states[..special as usize].fill(QpnState::Special);
        let mut free = FreeList::new(capacity);
        let general = capacity - special;
        if general > 0 {
            let first = special + start % general;
            for number in (first..capacity).chain(special..first) {
                free.push_back(number);
            }
        }
        Ok(Self {
            states,
            free,
            quarantine: FreeList::new(capacity),
            released_at_ns: alloc::vec![0; capacity as usize],
            quiet_period_ns,
            num_ports,
        })
    }

    /// The number of a port's special QP (ports count from 1).
    ///
    /// Fails with [`ResourceError::InvalidPort`] outside `1..=num_ports`.
    pub fn special_qpn(&self, port: u8, which: SpecialQp) -> Result<u32, ResourceError> {
        if port == 0 || port > self.num_ports {
            return Err(ResourceError::InvalidPort { port });
        }
        let smi = 2 * u32::from(port - 1);
        Ok(match which {
            SpecialQp::Smi => smi,
            SpecialQp::Gsi => smi + 1,
        })
    }

    /// True for the special QPs' numbers.
    pub fn is_special(&self, qpn: u32) -> bool {
        qpn < 2 * u32::from(self.num_ports)
    }

    /// How many QP numbers there are (special ones included).
    pub fn capacity(&self) -> u32 {
        self.states.len() as u32
    }

    /// How many ports' special QPs are reserved.
    pub fn num_ports(&self) -> u8 {
        self.num_ports
    }

    /// Ends a life of the device: every number still in use is quarantined
    /// from `now_ns`, as if its QP had been destroyed then (its peers may
    /// still send to it), after the numbers already quarantined. The
    /// allocator is then what the next life starts from, so that within
    /// one device object no number is reused before its quiet period
    /// ended, restarts included.
    pub fn retire_all(&mut self, now_ns: u64) {
        for qpn in 0..self.capacity() {
            if self.states[qpn as usize] == QpnState::InUse {
                self.states[qpn as usize] = QpnState::Quarantined;
                self.released_at_ns[qpn as usize] = now_ns;
                self.quarantine.push_back(qpn);
            }
        }
    }

    /// The quiet period a released number waits before reuse.
    pub fn quiet_period_ns(&self) -> u64 {
        self.quiet_period_ns
    }

    /// Takes a general QP number: the oldest free one, after moving every
    /// number whose quiet period has ended out of quarantine.
    ///
    /// Fails with [`ResourceError::AllQuarantined`] when the only unused
    /// numbers are still quarantined (never reusing one early), and
    /// [`ResourceError::Exhausted`] when every number is in use.
    pub fn alloc(&mut self, now_ns: u64) -> Result<u32, ResourceError> {
        self.end_expired_quarantines(now_ns);
        match self.free.pop_front() {
            Some(qpn) => {
                self.states[qpn as usize] = QpnState::InUse;
                Ok(qpn)
            }
            None => Err(match self.next_reusable_at_ns() {
                Some(reusable_at_ns) => ResourceError::AllQuarantined { reusable_at_ns },
                None => ResourceError::Exhausted,
            }),
        }
    }

    /// Returns a number handed out by [`alloc`](Self::alloc); it is
    /// quarantined from `now_ns`.
    ///
    /// Fails with [`ResourceError::Reserved`] for a special QP's number and
    /// [`ResourceError::InvalidNumber`] for a number not in use (out of
    /// range, never allocated, or released already).
    pub fn release(&mut self, qpn: u32, now_ns: u64) -> Result<(), ResourceError> {
        match self.states.get(qpn as usize) {
            Some(QpnState::InUse) => {}
            Some(QpnState::Special) => return Err(ResourceError::Reserved { number: qpn }),
            _ => return Err(ResourceError::InvalidNumber { number: qpn }),
        }
        self.states[qpn as usize] = QpnState::Quarantined;
        self.released_at_ns[qpn as usize] = now_ns;
        self.quarantine.push_back(qpn);
        Ok(())
    }

    /// When the oldest quarantined number becomes reusable, if any is
    /// quarantined: the time to call [`alloc`](Self::alloc) again after
    /// [`ResourceError::AllQuarantined`].
    pub fn next_reusable_at_ns(&self) -> Option<u64> {
        let oldest = self.quarantine.front()?;
        Some(self.released_at_ns[oldest as usize].saturating_add(self.quiet_period_ns))
    }

    /// General numbers free for allocation now (not counting quarantine).
    pub fn free_count(&self) -> u32 {
        self.free.len()
    }

    /// Numbers waiting out their quiet period.
    pub fn quarantined_count(&self) -> u32 {
        self.quarantine.len()
    }

    /// True when `qpn` was handed out and not released.
    pub fn is_in_use(&self, qpn: u32) -> bool {
        self.states.get(qpn as usize) == Some(&QpnState::InUse)
    }

    fn end_expired_quarantines(&mut self, now_ns: u64) {
        // Release times are in FIFO order, so the first one still quiet ends
        // the scan: amortised O(1) per released number.
        while let Some(oldest) = self.quarantine.front() {
            let reusable_at =
                self.released_at_ns[oldest as usize].saturating_add(self.quiet_period_ns);
            if now_ns < reusable_at {
                break;
            }
            self.quarantine.remove(oldest);
            self.states[oldest as usize] = QpnState::Free;
            self.free.push_back(oldest);
        }
    }
}

/// Where a device object with no record of its predecessors starts its
/// numbering ([`QpnAllocator::starting_at`]): a point drawn from the
/// platform's time `now_ns` (SplitMix64's finaliser, so that starts a few
/// nanoseconds apart land far apart on the ring of general numbers).
///
/// This is no guarantee, only a spread: a new device object (after a
/// `WdfDeviceSetFailed` restart, a surprise removal and re-plug) does not
/// know which numbers its predecessor used, so its first numbers avoid
/// them only with high probability (for `n` numbers the predecessor used
/// within its last quiet period among `g` general ones, the first new
/// number is one of them with probability about `n / g`). Deterministic
/// under a simulated clock.
pub fn rotation_start(now_ns: u64) -> u32 {
    let mut z = now_ns.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    // The high half: the well-mixed bits.
    (z >> 32) as u32
}

/// QPs by number: an [`ObjectTable`] numbered by a [`QpnAllocator`], so
/// general QPs get quarantined numbers and special QPs their fixed ones.
#[derive(Debug)]
pub struct QpTable<T> {
    objects: ObjectTable<kind::Qp, T>,
    numbers: QpnAllocator,
}

impl<T> QpTable<T> {
    /// A table for `capacity` QPs (`1 << log_max_qps`) on `num_ports`
    /// ports, reusing numbers after `quiet_period_ns`.
    ///
    /// Fails as [`QpnAllocator::new`] does.
    pub fn new(capacity: u32, num_ports: u8, quiet_period_ns: u64) -> Result<Self, ResourceError> {
        let numbers = QpnAllocator::new(capacity, num_ports, quiet_period_ns)?;
        Self::with_numbers(numbers)
    }

    /// An empty table numbered by `numbers`: a fresh allocator, or the
    /// previous life's after [`QpnAllocator::retire_all`] (whose numbers
    /// must then be all free or quarantined: none in use).
    ///
    /// Fails with [`ResourceError::InvalidCapacity`] if a number is still
    /// in use, and as [`ObjectTable::new`] does.
    pub fn with_numbers(numbers: QpnAllocator) -> Result<Self, ResourceError> {
        Self::with_numbers_from_generation(numbers, 1)
    }

    /// Like [`with_numbers`](Self::with_numbers), with handles starting at
    /// `generation` ([`ObjectTable::from_generation`]).
    pub fn with_numbers_from_generation(
        numbers: QpnAllocator,
        generation: u32,
    ) -> Result<Self, ResourceError> {
        if numbers.states.contains(&QpnState::InUse) {
            return Err(ResourceError::InvalidCapacity);
        }
        let capacity = numbers.capacity();
        // Every number is "reserved" in the table: the allocator numbers it.
        let objects = ObjectTable::from_generation(capacity, 0..capacity, generation)?;
        Ok(Self { objects, numbers })
    }

    /// Ends this life of the table: its QPs are dropped and its allocator,
    /// every number in use quarantined from `now_ns`, is returned for the
    /// next life ([`QpnAllocator::retire_all`], [`Self::with_numbers`]).
    pub fn retire(self, now_ns: u64) -> QpnAllocator {
        let mut numbers = self.numbers;
        numbers.retire_all(now_ns);
        numbers
    }

    /// Creates a general QP `make(handle)` on a fresh number.
    ///
    /// Fails as [`QpnAllocator::alloc`] does.
    pub fn create_with(
        &mut self,
        now_ns: u64,
        make: impl FnOnce(Handle<kind::Qp>) -> T,
    ) -> Result<Handle<kind::Qp>, ResourceError> {
        let qpn = self.numbers.alloc(now_ns)?;
        match self.objects.insert_at_with(qpn, make) {
            Ok(handle) => Ok(handle),
            Err(error) => {
                // Unreachable while the invariants hold (an allocated number
                // is unoccupied); give the number back rather than leak it.
                let _ = self.numbers.release(qpn, now_ns);
                Err(error)
            }
        }
    }

    /// Creates a port's special QP at its fixed number.
    ///
    /// Fails with [`ResourceError::InvalidPort`] for a port that does not
    /// exist and [`ResourceError::NumberInUse`] if that special QP exists.
    pub fn create_special_with(
        &mut self,
        port: u8,
        which: SpecialQp,
        make: impl FnOnce(Handle<kind::Qp>) -> T,
    ) -> Result<Handle<kind::Qp>, ResourceError> {
        let qpn = self.numbers.special_qpn(port, which)?;
        self.objects.insert_at_with(qpn, make)
    }

    /// Destroys the QP and returns it; a general QP's number goes into
    /// quarantine from `now_ns`.
    ///
    /// Fails as [`ObjectTable::remove`] does (stale handle, busy).
    pub fn destroy(&mut self, handle: Handle<kind::Qp>, now_ns: u64) -> Result<T, ResourceError> {
        let object = self.objects.remove(handle)?;
        if !self.numbers.is_special(handle.number()) {
            // Cannot fail: the table held the number, so the allocator had
            // handed it out.
            let _ = self.numbers.release(handle.number(), now_ns);
        }
        Ok(object)
    }

    /// The QPs, for lookups by handle or number.
    pub fn objects(&self) -> &ObjectTable<kind::Qp, T> {
        &self.objects
    }

    /// The QP, mutably, if the handle is current.
    pub fn get_mut(&mut self, handle: Handle<kind::Qp>) -> Option<&mut T> {
        self.objects.get_mut(handle)
    }

    /// The current occupant of a bare QPN, mutably (for events).
    pub fn get_by_number_mut(&mut self, qpn: u32) -> Option<(Handle<kind::Qp>, &mut T)> {
        self.objects.get_by_number_mut(qpn)
    }

    /// Records a use of the QP; see [`ObjectTable::acquire`].
    pub fn acquire(&mut self, handle: Handle<kind::Qp>) -> Result<u32, ResourceError> {
        self.objects.acquire(handle)
    }

    /// Ends a use of the QP; see [`ObjectTable::release`].
    pub fn release(&mut self, handle: Handle<kind::Qp>) -> Result<u32, ResourceError> {
        self.objects.release(handle)
    }

    /// The number allocator (quarantine state, special QP numbers).
    pub fn numbers(&self) -> &QpnAllocator {
        &self.numbers
    }
}

#[cfg(test)]
mod tests {
    use alloc::collections::{BTreeMap, BTreeSet, VecDeque};

    use proptest::prelude::*;

    use super::*;

    const QUIET: u64 = 1_000;

    #[test]
    fn special_qps_follow_the_prm_numbering() {
        let numbers = QpnAllocator::new(16, 2, QUIET).unwrap();
        assert_eq!(numbers.special_qpn(1, SpecialQp::Smi), Ok(0));
        assert_eq!(numbers.special_qpn(1, SpecialQp::Gsi), Ok(1));
        assert_eq!(numbers.special_qpn(2, SpecialQp::Smi), Ok(2));
        assert_eq!(numbers.special_qpn(2, SpecialQp::Gsi), Ok(3));
        assert_eq!(
            numbers.special_qpn(0, SpecialQp::Smi),
            Err(ResourceError::InvalidPort { port: 0 })
        );
        assert_eq!(
            numbers.special_qpn(3, SpecialQp::Gsi),
            Err(ResourceError::InvalidPort { port: 3 })
        );
        assert!(numbers.is_special(3) && !numbers.is_special(4));
    }

    #[test]
    fn alloc_never_hands_out_special_numbers() {
        let mut numbers = QpnAllocator::new(8, 2, QUIET).unwrap();
        let handed: Vec<u32> = (0..4).map(|_| numbers.alloc(0).unwrap()).collect();
        assert_eq!(handed, [4, 5, 6, 7]);
        assert_eq!(numbers.alloc(0), Err(ResourceError::Exhausted));
        assert_eq!(
            numbers.release(1, 0),
            Err(ResourceError::Reserved { number: 1 })
        );
        assert!(
            QpnAllocator::new(3, 2, QUIET).is_err(),
            "too few for the special QPs"
        );
        assert!(QpnAllocator::new(MAX_OBJECTS + 1, 1, QUIET).is_err());
    }

    #[test]
    fn released_number_waits_out_the_quiet_period() {
        let mut numbers = QpnAllocator::new(3, 1, QUIET).unwrap();
        let qpn = numbers.alloc(0).unwrap();
        assert_eq!(qpn, 2);
        numbers.release(qpn, 500).unwrap();
        assert_eq!(
            numbers.alloc(1_499),
            Err(ResourceError::AllQuarantined {
                reusable_at_ns: 1_500
            })
        );
        assert_eq!(numbers.next_reusable_at_ns(), Some(1_500));
        assert_eq!(numbers.alloc(1_500), Ok(2));
        assert_eq!(numbers.next_reusable_at_ns(), None);
    }

    #[test]
    fn quarantine_is_fifo_oldest_release_first() {
        let mut numbers = QpnAllocator::new(6, 1, QUIET).unwrap();
        let all: Vec<u32> = (0..4).map(|_| numbers.alloc(0).unwrap()).collect();
        assert_eq!(all, [2, 3, 4, 5]);
        numbers.release(4, 10).unwrap();
        numbers.release(2, 20).unwrap();
        numbers.release(5, 30).unwrap();
        assert_eq!(numbers.quarantined_count(), 3);
        // Only the first two have expired at 1_025.
        assert_eq!(numbers.alloc(1_025), Ok(4));
        assert_eq!(numbers.alloc(1_025), Ok(2));
        assert_eq!(
            numbers.alloc(1_025),
            Err(ResourceError::AllQuarantined {
                reusable_at_ns: 1_030
            })
        );
        assert_eq!(numbers.alloc(5_000), Ok(5));
    }

    #[test]
    fn never_used_numbers_come_before_recently_freed_ones() {
        let mut numbers = QpnAllocator::new(5, 1, 0).unwrap();
        let first = numbers.alloc(0).unwrap();
        numbers.release(first, 0).unwrap();
        assert_eq!(numbers.alloc(0), Ok(3));
        assert_eq!(numbers.alloc(0), Ok(4));
        assert_eq!(numbers.alloc(0), Ok(first), "then the expired one");
    }

    #[test]
    fn double_release_and_unknown_numbers_are_refused() {
        let mut numbers = QpnAllocator::new(4, 1, QUIET).unwrap();
        let qpn = numbers.alloc(0).unwrap();
        numbers.release(qpn, 0).unwrap();
        assert_eq!(
            numbers.release(qpn, 0),
            Err(ResourceError::InvalidNumber { number: qpn })
        );
        assert_eq!(
            numbers.release(3, 0),
            Err(ResourceError::InvalidNumber { number: 3 })
        );
        assert_eq!(
            numbers.release(99, 0),
            Err(ResourceError::InvalidNumber { number: 99 })
        );
        assert_eq!(numbers.quarantined_count(), 1);
        assert_eq!(numbers.free_count(), 1);
    }

    #[test]
    fn time_going_backwards_delays_reuse_without_panicking() {
        let mut numbers = QpnAllocator::new(3, 1, 10).unwrap();
        let qpn = numbers.alloc(u64::MAX - 5).unwrap();
        numbers.release(qpn, u64::MAX - 5).unwrap();
        assert_eq!(numbers.next_reusable_at_ns(), Some(u64::MAX));
        assert!(numbers.alloc(0).is_err());
        assert!(numbers.alloc(u64::MAX - 1).is_err());
        assert_eq!(numbers.alloc(u64::MAX), Ok(qpn));
    }

    #[test]
    fn qp_table_quarantines_general_numbers_but_not_special_ones() {
        let mut qps = QpTable::new(4, 1, QUIET).unwrap();
        let smi = qps
            .create_special_with(1, SpecialQp::Smi, |_| "smi")
            .unwrap();
        assert_eq!(smi.number(), 0);
        assert_eq!(
            qps.create_special_with(1, SpecialQp::Smi, |_| "again"),
            Err(ResourceError::NumberInUse { number: 0 })
        );
        let a = qps.create_with(0, |_| "a").unwrap();
        let b = qps.create_with(0, |_| "b").unwrap();
        assert_eq!((a.number(), b.number()), (2, 3));
        assert_eq!(qps.destroy(a, 100), Ok("a"));
        assert_eq!(
            qps.create_with(200, |_| "c"),
            Err(ResourceError::AllQuarantined {
                reusable_at_ns: 1_100
            })
        );
        let c = qps.create_with(1_100, |_| "c").unwrap();
        assert_eq!(c.number(), a.number());
        assert_eq!(qps.objects().get(a), None, "stale handle");
        assert_eq!(qps.objects().get_by_number(2), Some((c, &"c")));

        // A special QP's number is reusable at once, with a new generation.
        assert_eq!(qps.destroy(smi, 0), Ok("smi"));
        assert_eq!(qps.numbers().quarantined_count(), 0);
        let smi_again = qps
            .create_special_with(1, SpecialQp::Smi, |_| "smi2")
            .unwrap();
        assert_eq!(smi_again.number(), 0);
        assert_ne!(smi_again, smi);

        // Busy QPs are not destroyed and their numbers stay in use.
        qps.acquire(b).unwrap();
        assert_eq!(qps.destroy(b, 0), Err(ResourceError::Busy { uses: 1 }));
        assert!(qps.numbers().is_in_use(3));
        qps.release(b).unwrap();
        assert_eq!(qps.destroy(b, 0), Ok("b"));
        assert_eq!(
            qps.destroy(b, 0),
            Err(ResourceError::InvalidHandle {
                kind: super::super::Kind::Qp
            })
        );
    }

    #[test]
    fn a_rotated_start_wraps_round_the_general_numbers() {
        let mut numbers = QpnAllocator::starting_at(8, 1, QUIET, 7).unwrap();
        let handed: Vec<u32> = (0..6).map(|_| numbers.alloc(0).unwrap()).collect();
        // 6 general numbers (2..8): 7 % 6 = 1, so 3 comes first.
        assert_eq!(handed, [3, 4, 5, 6, 7, 2]);
        assert_eq!(numbers.alloc(0), Err(ResourceError::Exhausted));
        assert_ne!(rotation_start(0), rotation_start(1), "times spread");
    }

    #[test]
    fn a_new_life_reuses_no_number_of_the_previous_before_its_quiet_period() {
        let mut qps = QpTable::new(6, 1, QUIET).unwrap();
        let live = qps.create_with(0, |_| "live").unwrap();
        let destroyed = qps.create_with(0, |_| "destroyed").unwrap();
        qps.destroy(destroyed, 100).unwrap();
        // The device restarts at 500 with `live` still there: its number
        // is quarantined from then, after the one released at 100.
        let mut next = QpTable::<&str>::with_numbers(qps.retire(500)).unwrap();
        let fresh: Vec<u32> = (0..2)
            .map(|_| next.create_with(600, |_| "new").unwrap().number())
            .collect();
        assert_eq!(fresh, [4, 5], "never used ones first");
        assert_eq!(
            next.create_with(1_099, |_| "early"),
            Err(ResourceError::AllQuarantined {
                reusable_at_ns: 1_100
            })
        );
        assert_eq!(
            next.create_with(1_100, |_| "late").unwrap().number(),
            destroyed.number()
        );
        assert_eq!(
            next.create_with(1_499, |_| "early"),
            Err(ResourceError::AllQuarantined {
                reusable_at_ns: 1_500
            })
        );
        assert_eq!(
            next.create_with(1_500, |_| "late").unwrap().number(),
            live.number()
        );
        // An allocator with numbers in use cannot start a table.
        let mut busy = QpnAllocator::new(4, 1, QUIET).unwrap();
        busy.alloc(0).unwrap();
        assert!(QpTable::<()>::with_numbers(busy).is_err());
    }

    #[derive(Debug, Clone)]
    enum TableOp {
        Create,
        CreateSpecial(u8, bool),
        Destroy(usize),
        Advance(u64),
    }

    proptest! {
        /// A QP handle is valid exactly while its QP lives; live QPs never
        /// share a number; general QPs never get a special number.
        #[test]
        fn qp_table_handles_live_exactly_as_long_as_their_qps(ops in proptest::collection::vec(
            prop_oneof![
                Just(TableOp::Create),
                (0..4u8, any::<bool>()).prop_map(|(port, smi)| TableOp::CreateSpecial(port, smi)),
                any::<usize>().prop_map(TableOp::Destroy),
                (0..100u64).prop_map(TableOp::Advance),
            ],
            1..200,
        )) {
            let mut qps = QpTable::new(12, 2, 150).unwrap();
            let mut now = 0u64;
            let mut live: BTreeMap<u32, (Handle<kind::Qp>, u32)> = BTreeMap::new();
            let mut dead: Vec<Handle<kind::Qp>> = Vec::new();
            let mut serial = 0u32;
            for op in ops {
                serial += 1;
                match op {
                    TableOp::Advance(dt) => now += dt,
                    TableOp::Create => if let Ok(handle) = qps.create_with(now, |_| serial) {
                        prop_assert!(handle.number() >= 4);
                        prop_assert!(live.insert(handle.number(), (handle, serial)).is_none());
                    },
                    TableOp::CreateSpecial(port, smi) => {
                        let which = if smi { SpecialQp::Smi } else { SpecialQp::Gsi };
                        match qps.create_special_with(port, which, |_| serial) {
                            Ok(handle) => {
                                prop_assert!(handle.number() < 4);
                                prop_assert!(live.insert(handle.number(), (handle, serial)).is_none());
                            }
                            Err(ResourceError::InvalidPort { .. }) => prop_assert!(port == 0 || port > 2),
                            Err(error) => prop_assert_eq!(error, ResourceError::NumberInUse {
                                number: qps.numbers().special_qpn(port, which).unwrap(),
                            }),
                        }
                    }
                    TableOp::Destroy(i) => if !live.is_empty() {
                        let number = *live.keys().nth(i % live.len()).unwrap();
                        let (handle, value) = live.remove(&number).unwrap();
                        prop_assert_eq!(qps.destroy(handle, now), Ok(value));
                        dead.push(handle);
                    },
                }
                for (handle, value) in live.values() {
                    prop_assert_eq!(qps.objects().get(*handle), Some(value));
                }
                for handle in &dead {
                    prop_assert!(!qps.objects().contains(*handle));
                }
                prop_assert_eq!(qps.objects().len() as usize, live.len());
            }
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc,
        Release(usize),
        Advance(u64),
    }

    proptest! {
        /// Against a model: numbers are unique among live QPs, never
        /// special, never reused before the quiet period, and reused in
        /// release order.
        #[test]
        fn qpn_allocator_agrees_with_a_model(ops in proptest::collection::vec(
            prop_oneof![
                Just(Op::Alloc),
                any::<usize>().prop_map(Op::Release),
                (0..400u64).prop_map(Op::Advance),
            ],
            1..300,
        )) {
            const CAPACITY: u32 = 10;
            const PORTS: u8 = 2;
            const PERIOD: u64 = 300;
            let mut numbers = QpnAllocator::new(CAPACITY, PORTS, PERIOD).unwrap();
            let mut now = 0u64;
            let mut live: BTreeSet<u32> = BTreeSet::new();
            // Model free order: never-used numbers first, then releases in order.
            let mut ready: VecDeque<u32> = (4..CAPACITY).collect();
            let mut waiting: VecDeque<(u32, u64)> = VecDeque::new();
            let mut last_release: BTreeMap<u32, u64> = BTreeMap::new();
            for op in ops {
                match op {
                    Op::Advance(dt) => now += dt,
                    Op::Alloc => {
                        while let Some(&(qpn, at)) = waiting.front() {
                            if now - at < PERIOD { break; }
                            waiting.pop_front();
                            ready.push_back(qpn);
                        }
                        match numbers.alloc(now) {
                            Ok(qpn) => {
                                prop_assert_eq!(Some(qpn), ready.pop_front());
                                prop_assert!(qpn >= 2 * u32::from(PORTS));
                                prop_assert!(live.insert(qpn), "number handed out twice");
                                if let Some(at) = last_release.get(&qpn) {
                                    prop_assert!(now - at >= PERIOD, "reused early");
                                }
                            }
                            Err(ResourceError::AllQuarantined { reusable_at_ns }) => {
                                prop_assert!(ready.is_empty());
                                prop_assert_eq!(Some(reusable_at_ns), waiting.front().map(|w| w.1 + PERIOD));
                            }
                            Err(error) => {
                                prop_assert_eq!(error, ResourceError::Exhausted);
                                prop_assert!(ready.is_empty() && waiting.is_empty());
                            }
                        }
                    }
                    Op::Release(i) => {
                        if live.is_empty() {
                            prop_assert!(numbers.release(4, now).is_err());
                            continue;
                        }
                        let qpn = *live.iter().nth(i % live.len()).unwrap();
                        prop_assert_eq!(numbers.release(qpn, now), Ok(()));
                        prop_assert!(numbers.release(qpn, now).is_err(), "double release");
                        live.remove(&qpn);
                        waiting.push_back((qpn, now));
                        last_release.insert(qpn, now);
                    }
                }
                for qpn in 0..CAPACITY {
                    prop_assert_eq!(numbers.is_in_use(qpn), live.contains(&qpn));
                }
            }
        }
    }
}
