//! The one way every timed loop waits, measurement and baseline alike:
//! spin briefly, then yield the core. On an idle machine a wait ends
//! within the spins; on a shared one (more runnable threads than cores) a
//! spinning waiter would otherwise burn its whole time slice while the
//! thread it waits for cannot run.

/// Spins before each yield.
const SPINS: u32 = 200;

/// A waiter's state: how many times it spun since it last yielded.
#[derive(Debug, Default)]
pub struct Backoff(u32);

impl Backoff {
    /// A fresh waiter.
    pub fn new() -> Self {
        Self(0)
    }

    /// One idle turn of a wait loop.
    pub fn snooze(&mut self) {
        if self.0 < SPINS {
            self.0 += 1;
            std::hint::spin_loop();
        } else {
            self.0 = 0;
            std::thread::yield_now();
        }
    }
}

/// Waits until `done()` holds.
pub fn until(mut done: impl FnMut() -> bool) {
    let mut backoff = Backoff::new();
    while !done() {
        backoff.snooze();
    }
}
