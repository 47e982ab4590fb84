//! Medians of interleaved repetitions and the report lines: each
//! measurement beside its baseline, the ratio and the goal.

use std::fmt;

/// Which way a ratio must go to meet its goal.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Goal {
    /// measurement / baseline at most this (a cost: time).
    AtMost(f64),
    /// measurement / baseline at least this (a rate).
    AtLeast(f64),
    /// Reported only.
    None,
}

impl Goal {
    /// Whether `ratio` meets the goal (`None` when there is no goal).
    pub fn met(self, ratio: f64) -> Option<bool> {
        match self {
            Self::AtMost(g) => Some(ratio <= g),
            Self::AtLeast(g) => Some(ratio >= g),
            Self::None => None,
        }
    }
}

/// One printed line.
#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    /// The measurement's number and name, e.g. "1 latency 8 B RC send".
    pub name: String,
    /// The measured value.
    pub value: f64,
    /// The baseline, measured in the same run (none for a quantity
    /// reported alone, such as memory per QP).
    pub baseline: Option<f64>,
    /// Unit of both.
    pub unit: &'static str,
    /// What the baseline is.
    pub baseline_name: &'static str,
    /// The goal on `value / baseline`.
    pub goal: Goal,
}

impl Line {
    /// `value / baseline`, when there is a baseline.
    pub fn ratio(&self) -> Option<f64> {
        self.baseline.map(|b| self.value / b)
    }

    /// Whether the goal is met (`None` without a goal or a baseline).
    pub fn met(&self) -> Option<bool> {
        self.ratio().and_then(|r| self.goal.met(r))
    }
}

/// A number with three significant digits' worth of precision.
fn num(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else if v >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

impl fmt::Display for Line {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let goal = match self.goal {
            Goal::AtMost(g) => format!("<= {g}x"),
            Goal::AtLeast(g) => format!(">= {g}x"),
            Goal::None => "(reported)".into(),
        };
        let verdict = match self.met() {
            Some(true) => "met",
            Some(false) => "MISSED",
            None => "",
        };
        let (baseline, ratio) = match (self.baseline, self.ratio()) {
            (Some(b), Some(r)) => (num(b), format!("{}x", num(r))),
            _ => ("-".into(), "-".into()),
        };
        write!(
            f,
            "{:<46} {:>9} {:<7} baseline {:>9} {:<7} ({:<24}) ratio {:>8}  goal {} {}",
            self.name,
            num(self.value),
            self.unit,
            baseline,
            self.unit,
            self.baseline_name,
            ratio,
            goal,
            verdict
        )
    }
}

/// The median of `samples` (the mean of the middle two when even).
pub fn median(samples: &mut [f64]) -> f64 {
    assert!(!samples.is_empty(), "a median of no samples");
    samples.sort_by(f64::total_cmp);
    let n = samples.len();
    if n % 2 == 1 {
        samples[n / 2]
    } else {
        (samples[n / 2 - 1] + samples[n / 2]) / 2.0
    }
}

/// Runs `measure` and `baseline` alternately `reps` times each (so a
/// disturbance of the shared machine hits both alike) and returns their
/// medians.
pub fn interleaved(
    reps: usize,
    mut measure: impl FnMut() -> f64,
    mut baseline: impl FnMut() -> f64,
) -> (f64, f64) {
    let mut m = Vec::with_capacity(reps);
    let mut b = Vec::with_capacity(reps);
    for _ in 0..reps {
        b.push(baseline());
        m.push(measure());
    }
    (median(&mut m), median(&mut b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
    }

    #[test]
    fn goals_compare_the_ratio_the_right_way() {
        assert_eq!(Goal::AtMost(2.0).met(1.5), Some(true));
        assert_eq!(Goal::AtMost(2.0).met(2.5), Some(false));
        assert_eq!(Goal::AtLeast(0.5).met(0.4), Some(false));
        assert_eq!(Goal::None.met(1.0), None);
    }
}
