//! The simulator's deterministic pseudo-random number generator.
//!
//! Contract: every random decision in the simulation (fault injection in the
//! fabric, timing jitter in the device, choices in the host) draws from an
//! [`Rng`] derived from one seed, so a run is reproduced exactly by its seed
//! and its inputs. Nothing here reads the OS, a clock or global state.
//!
//! The generator is xoshiro256** (Blackman and Vigna, "Scrambled linear
//! pseudorandom number generators", 2018), seeded by expanding a `u64`
//! through SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom
//! number generators", 2014). It is fast and statistically strong, and not
//! cryptographic: it is for simulation only.
//!
//! Subsystems that must not perturb each other's draws take their own stream
//! with [`Rng::fork`]: the fabric draining more or fewer values then leaves
//! the device's sequence untouched.

/// SplitMix64's increment: 2^64 divided by the golden ratio, made odd.
const SPLITMIX_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// One step of SplitMix64: advances `state` and returns the next output.
///
/// Consecutive outputs are a bijection of distinct counter values, so four of
/// them are never all zero, which is the one state xoshiro256** forbids.
fn splitmix64_next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(SPLITMIX_GAMMA);
    splitmix64_mix(*state)
}

/// SplitMix64's output function: a bijective 64-bit mixer.
fn splitmix64_mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A seeded xoshiro256** generator.
///
/// Cloning snapshots the generator: the clone replays the same sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rng {
    /// xoshiro256** state; never all zero.
    state: [u64; 4],
}

impl Rng {
    /// A generator whose whole sequence is determined by `seed`.
    ///
    /// Every `u64` is a valid seed, zero included.
    pub fn from_seed(seed: u64) -> Self {
        let mut splitmix = seed;
        Self {
            state: [
                splitmix64_next(&mut splitmix),
                splitmix64_next(&mut splitmix),
                splitmix64_next(&mut splitmix),
                splitmix64_next(&mut splitmix),
            ],
        }
    }

    /// The next uniformly distributed 64-bit value (one draw).
    pub fn next_u64(&mut self) -> u64 {
        let [s0, s1, s2, s3] = &mut self.state;
        let result = s1.wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let shifted = *s1 << 17;
        *s2 ^= *s0;
        *s3 ^= *s1;
        *s1 ^= *s2;
        *s0 ^= *s3;
        *s2 ^= shifted;
        *s3 = s3.rotate_left(45);
        result
    }

    /// A uniformly distributed value in `0..bound`, without modulo bias.
    ///
    /// Uses Lemire's multiply-and-reject method: usually one draw, rarely more.
    /// `below(0)` names an empty range; it returns 0 and draws nothing.
    pub fn below(&mut self, bound: u64) -> u64 {
        if bound == 0 {
            return 0;
        }
        let mut product = u128::from(self.next_u64()) * u128::from(bound);
        // The low half is the position inside one of the `bound` buckets.
        // Results whose low half falls below 2^64 mod bound would make the
        // first buckets one value larger than the others; redraw those.
        if (product as u64) < bound {
            let rejection_threshold = bound.wrapping_neg() % bound;
            while (product as u64) < rejection_threshold {
                product = u128::from(self.next_u64()) * u128::from(bound);
            }
        }
        (product >> 64) as u64
    }

    /// True with probability `parts_per_million` / 1 000 000 (one draw).
    ///
    /// Exactly one value is drawn whatever the argument, so the number of
    /// draws never depends on the probability. 0 is never true; 1 000 000 or
    /// more is always true. The bias from mapping 2^64 values onto a million
    /// outcomes is below 10^-13.
    pub fn chance_ppm(&mut self, parts_per_million: u32) -> bool {
        let scaled = (u128::from(self.next_u64()) * 1_000_000) >> 64;
        scaled < u128::from(parts_per_million)
    }

    /// A new generator for an independent stream (one draw from `self`).
    ///
    /// The child is seeded from this generator's next value mixed with
    /// `stream`, so children forked from the same state with different
    /// `stream` values differ, and the child's draws never advance `self`.
    /// Fork each subsystem once, in a fixed order, from the root generator.
    pub fn fork(&mut self, stream: u64) -> Rng {
        let base = self.next_u64();
        let mut stream_state = stream;
        Rng::from_seed(base ^ splitmix64_next(&mut stream_state))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Known answers computed with an independent Python implementation
    // (Python 3.11, arbitrary-precision ints masked to 64 bits):
    //
    //     M = (1 << 64) - 1
    //     def splitmix(state):
    //         state = (state + 0x9E3779B97F4A7C15) & M
    //         z = state
    //         z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
    //         z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
    //         return state, z ^ (z >> 31)
    //     def rotl(x, k): return ((x << k) | (x >> (64 - k))) & M
    //     class X:
    //         def __init__(self, seed):
    //             st = seed; self.s = []
    //             for _ in range(4):
    //                 st, v = splitmix(st); self.s.append(v)
    //         def next(self):
    //             s = self.s
    //             r = (rotl((s[1] * 5) & M, 7) * 9) & M
    //             t = (s[1] << 17) & M
    //             s[2] ^= s[0]; s[3] ^= s[1]; s[1] ^= s[2]; s[0] ^= s[3]
    //             s[2] ^= t; s[3] = rotl(s[3], 45)
    //             return r
    //         def below(self, n):
    //             x = self.next(); m = x * n; lo = m & M
    //             if lo < n:
    //                 t = ((1 << 64) - n) % n
    //                 while lo < t:
    //                     x = self.next(); m = x * n; lo = m & M
    //             return m >> 64
    //         def chance_ppm(self, ppm):
    //             return (self.next() * 1000000) >> 64 < ppm
    //     def fork(parent, stream):
    //         return X(parent.next() ^ splitmix(stream)[1])

    #[test]
    fn splitmix64_matches_published_sequence() {
        // Seed 1234567 is the example in the SplitMix64 literature; the first
        // two values also match java.util.SplittableRandom's reference output.
        let mut state = 1_234_567;
        assert_eq!(splitmix64_next(&mut state), 6_457_827_717_110_365_317);
        assert_eq!(splitmix64_next(&mut state), 3_203_168_211_198_807_973);
        assert_eq!(splitmix64_next(&mut state), 9_817_491_932_198_370_423);
    }

    #[test]
    fn seeding_expands_through_splitmix64() {
        let rng = Rng::from_seed(0);
        assert_eq!(
            rng.state,
            [
                0xe220_a839_7b1d_cdaf,
                0x6e78_9e6a_a1b9_65f4,
                0x06c4_5d18_8009_454f,
                0xf88b_b8a8_724c_81ec
            ]
        );
    }

    #[test]
    fn xoshiro256starstar_known_answers() {
        let cases: [(u64, [u64; 4]); 2] = [
            (
                0,
                [
                    11_091_344_671_253_066_420,
                    13_793_997_310_169_335_082,
                    1_900_383_378_846_508_768,
                    7_684_712_102_626_143_532,
                ],
            ),
            (
                42,
                [
                    1_546_998_764_402_558_742,
                    6_990_951_692_964_543_102,
                    12_544_586_762_248_559_009,
                    17_057_574_109_182_124_193,
                ],
            ),
        ];
        for (seed, expected) in cases {
            let mut rng = Rng::from_seed(seed);
            let got = [
                rng.next_u64(),
                rng.next_u64(),
                rng.next_u64(),
                rng.next_u64(),
            ];
            assert_eq!(got, expected, "seed {seed}");
        }
    }

    #[test]
    fn below_known_answers() {
        let mut rng = Rng::from_seed(7);
        let tens: Vec<u64> = (0..8).map(|_| rng.below(10)).collect();
        assert_eq!(tens, [7, 2, 8, 9, 9, 8, 0, 1]);
        let threes: Vec<u64> = (0..4).map(|_| rng.below(3)).collect();
        assert_eq!(threes, [1, 0, 1, 2]);
    }

    #[test]
    fn below_rejects_biased_draws() {
        // With bound 2^63 + 1 almost half of all draws fall in the rejected
        // zone; from seed 5 the fourth result needs four redraws (the Python
        // model shows raw draws 4..=7 rejected), so this exercises the loop.
        let bound = (1 << 63) + 1;
        let mut rng = Rng::from_seed(5);
        let got: Vec<u64> = (0..4).map(|_| rng.below(bound)).collect();
        assert_eq!(
            got,
            [
                2_660_124_057_020_295_092,
                5_553_229_355_294_069_358,
                5_991_011_151_194_742_231,
                7_458_586_743_318_756_548,
            ]
        );
    }

    #[test]
    fn below_edge_bounds() {
        let mut rng = Rng::from_seed(1);
        let untouched = rng.clone();
        assert_eq!(rng.below(0), 0);
        assert_eq!(rng, untouched, "below(0) draws nothing");
        for _ in 0..1000 {
            assert_eq!(rng.below(1), 0);
            assert!(rng.below(u64::MAX) < u64::MAX);
        }
    }

    #[test]
    fn chance_ppm_known_answers_and_extremes() {
        let mut rng = Rng::from_seed(99);
        let got: Vec<bool> = (0..8).map(|_| rng.chance_ppm(500_000)).collect();
        assert_eq!(got, [true, false, true, false, false, true, true, true]);
        for _ in 0..10_000 {
            assert!(!rng.chance_ppm(0));
            assert!(rng.chance_ppm(1_000_000));
            assert!(rng.chance_ppm(u32::MAX));
        }
    }

    #[test]
    fn chance_ppm_always_draws_once() {
        let mut a = Rng::from_seed(3);
        let mut b = Rng::from_seed(3);
        a.chance_ppm(0);
        b.chance_ppm(1_000_000);
        assert_eq!(a, b);
    }

    #[test]
    fn fork_known_answers() {
        let mut parent = Rng::from_seed(2024);
        let mut first = parent.fork(1);
        let mut second = parent.fork(2);
        assert_eq!(
            [first.next_u64(), first.next_u64()],
            [12_850_615_182_447_478_706, 390_050_685_046_048_216]
        );
        assert_eq!(
            [second.next_u64(), second.next_u64()],
            [7_858_232_154_285_850_465, 17_476_555_590_109_465_235]
        );
        assert_eq!(parent.next_u64(), 1_329_179_038_587_965_441);
    }

    #[test]
    fn forks_from_the_same_state_differ_by_stream() {
        let root = Rng::from_seed(11);
        let mut a = root.clone().fork(1);
        let mut b = root.clone().fork(2);
        let a_values: Vec<u64> = (0..16).map(|_| a.next_u64()).collect();
        let b_values: Vec<u64> = (0..16).map(|_| b.next_u64()).collect();
        assert_ne!(a_values, b_values);
    }

    #[test]
    fn child_draws_do_not_advance_the_parent() {
        let mut quiet = Rng::from_seed(8);
        let mut busy = Rng::from_seed(8);
        let _unused = quiet.fork(4);
        let mut child = busy.fork(4);
        for _ in 0..100 {
            child.next_u64();
        }
        assert_eq!(quiet, busy);
    }

    #[test]
    fn same_seed_same_sequence_different_seed_differs() {
        let draw = |seed| {
            let mut rng = Rng::from_seed(seed);
            (0..64)
                .map(|i| match i % 3 {
                    0 => rng.next_u64(),
                    1 => rng.below(1_000),
                    _ => u64::from(rng.chance_ppm(250_000)),
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(123), draw(123));
        assert_ne!(draw(123), draw(124));
    }

    #[test]
    fn below_is_roughly_uniform() {
        // Deterministic given the seed; the band is wide (about 6 sigma).
        let mut rng = Rng::from_seed(17);
        let mut buckets = [0u32; 10];
        for _ in 0..100_000 {
            buckets[rng.below(10) as usize] += 1;
        }
        for (value, count) in buckets.iter().enumerate() {
            assert!((9_430..=10_570).contains(count), "value {value}: {count}");
        }
    }
}
