//! The baselines: what the hardware does with no stack in the way, measured
//! in the same process and with the same threads as the measurement beside
//! it.

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use crate::spin::{self, Backoff};

/// Single-thread `memcpy` of `len` bytes, `times` times: bytes per second.
pub fn memcpy_rate(len: usize, times: usize) -> f64 {
    let src: Vec<u8> = (0..len).map(|i| i as u8).collect();
    let mut dst = vec![0u8; len];
    // Fault the pages in and warm the caches before timing.
    dst.copy_from_slice(&src);
    let started = Instant::now();
    for _ in 0..times {
        dst.copy_from_slice(black_box(&src));
        black_box(&mut dst);
    }
    (len * times) as f64 / started.elapsed().as_secs_f64()
}

/// One cache line, alone in its line.
#[repr(align(64))]
struct Line(AtomicU64);

/// Two threads bounce one cache line `rounds` times (each writes the next
/// value when it sees the other's): nanoseconds per half round trip.
pub fn cache_line_ping_pong(rounds: u64) -> f64 {
    let line = Line(AtomicU64::new(0));
    let ready = AtomicUsize::new(0);
    let mut elapsed = 0.0;
    std::thread::scope(|s| {
        s.spawn(|| {
            ready.fetch_add(1, Ordering::AcqRel);
            for i in 0..rounds {
                spin::until(|| line.0.load(Ordering::Acquire) == 2 * i + 1);
                line.0.store(2 * i + 2, Ordering::Release);
            }
        });
        ready.fetch_add(1, Ordering::AcqRel);
        spin::until(|| ready.load(Ordering::Acquire) == 2);
        let started = Instant::now();
        for i in 0..rounds {
            line.0.store(2 * i + 1, Ordering::Release);
            spin::until(|| line.0.load(Ordering::Acquire) == 2 * i + 2);
        }
        elapsed = started.elapsed().as_secs_f64();
    });
    elapsed * 1e9 / (2 * rounds) as f64
}

/// Words of one 64-byte message.
const WORDS: usize = 8;
/// Slots of the ring.
const SLOTS: usize = 1024;

/// A bare single-producer/single-consumer ring of 64-byte messages: the
/// producer fills slots and publishes its tail once per batch (the
/// doorbell's counterpart), the consumer reads and publishes its head once
/// per drain.
struct Ring {
    slots: Vec<[AtomicU64; WORDS]>,
    head: Line,
    tail: Line,
}

/// The producer hands `messages` 64-byte messages to the consumer through
/// a `Ring`, `batch` per publication: messages per second. The consumer
/// checks every message's first word.
pub fn spsc_ring_rate(messages: u64, batch: u64) -> f64 {
    let ring = Ring {
        slots: (0..SLOTS).map(|_| Default::default()).collect(),
        head: Line(AtomicU64::new(0)),
        tail: Line(AtomicU64::new(0)),
    };
    let consumer_ok = AtomicBool::new(true);
    let started = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut head = 0;
            let mut backoff = Backoff::new();
            while head < messages {
                let tail = ring.tail.0.load(Ordering::Acquire);
                while head < tail {
                    let slot = &ring.slots[head as usize % SLOTS];
                    let mut sum = 0u64;
                    for word in slot {
                        sum = sum.wrapping_add(word.load(Ordering::Relaxed));
                    }
                    if slot[0].load(Ordering::Relaxed) != head {
                        consumer_ok.store(false, Ordering::Relaxed);
                    }
                    black_box(sum);
                    head += 1;
                }
                ring.head.0.store(head, Ordering::Release);
                backoff.snooze();
            }
        });
        let mut tail = 0;
        while tail < messages {
            let n = batch.min(messages - tail);
            spin::until(|| tail + n - ring.head.0.load(Ordering::Acquire) <= SLOTS as u64);
            for m in tail..tail + n {
                for (w, word) in ring.slots[m as usize % SLOTS].iter().enumerate() {
                    word.store(m ^ w as u64, Ordering::Relaxed);
                }
            }
            tail += n;
            ring.tail.0.store(tail, Ordering::Release);
        }
    });
    let rate = messages as f64 / started.elapsed().as_secs_f64();
    assert!(
        consumer_ok.load(Ordering::Relaxed),
        "the ring delivered a wrong message"
    );
    rate
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn baselines_produce_positive_finite_numbers() {
        for v in [
            memcpy_rate(4096, 4),
            cache_line_ping_pong(100),
            spsc_ring_rate(5_000, 32),
        ] {
            assert!(v.is_finite() && v > 0.0, "{v}");
        }
    }
}
