//! Adaptive future sampling: a preference pair needs only the best and the worst candidate,
//! so futures go where that ranking is still uncertain. Every candidate starts with
//! `min_futures`; after that a candidate gets another future only while its reward interval
//! (mean ± z · sd / √n) overlaps the current best's or the current worst's, up to
//! `max_futures` (a racing rule of best-arm identification). The reward of a candidate stays
//! the mean over the futures it actually had.
//!
//! [`replay`] runs the rule over futures already scored (a run made with a fixed large S), in
//! a random order, so its savings and its agreement with the fixed-S pair can be measured
//! without one new model call.

use rand::seq::SliceRandom;
use rand::Rng;
use serde::{Deserialize, Serialize};

use crate::check::Range;

use super::pairs::{select_pairs, PairMode};

/// When to stop giving futures to the candidates of one turn (the `[adaptive]` table of a
/// generate_conv config; `--samples adaptive`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdaptiveRule {
    /// Futures every candidate gets before any is compared (at least 2: one future has no
    /// spread).
    pub min_futures: usize,
    /// Futures a candidate gets at most (the fixed-S run's S).
    pub max_futures: usize,
    /// Width of the intervals in standard errors (1.96 ≈ 95 % each).
    pub z: f64,
}

/// The most futures a candidate may get (the same cap as a fixed S).
pub const MAX_FUTURES: usize = 64;
/// Interval widths accepted, in standard errors.
pub const Z: Range = Range::open_closed(0.0, 10.0);

impl Default for AdaptiveRule {
    fn default() -> Self {
        Self {
            min_futures: 2,
            max_futures: 8,
            // The smallest width that kept the pair equal to fixed S = 8's in ≥ 95 % of
            // replays on math, 20 Questions and clarify (docs/generate_conv.md).
            z: 1.0,
        }
    }
}

impl AdaptiveRule {
    /// Refuses settings the rule cannot run with, naming the setting.
    pub fn validate(&self) -> Result<(), String> {
        if self.min_futures < 2 {
            return Err(format!(
                "min_futures {}: must be at least 2 (one future has no spread)",
                self.min_futures
            ));
        }
        if self.max_futures < self.min_futures {
            return Err(format!(
                "max_futures {} is below min_futures {}",
                self.max_futures, self.min_futures
            ));
        }
        if self.max_futures > MAX_FUTURES {
            return Err(format!(
                "max_futures {}: must be at most {MAX_FUTURES}",
                self.max_futures
            ));
        }
        Z.check("z", self.z)?;
        Ok(())
    }

    /// The candidates that get one more future now, given the rewards of the futures each has
    /// had (one list per candidate); empty when the best and the worst are separated from
    /// every other candidate, or every candidate still in doubt has `max_futures`.
    pub fn wanted(&self, rewards: &[Vec<f64>]) -> Vec<usize> {
        let below_min: Vec<usize> = (0..rewards.len())
            .filter(|&i| rewards[i].len() < self.min_futures)
            .collect();
        if !below_min.is_empty() {
            return below_min;
        }
        if rewards.len() < 2 {
            return Vec::new();
        }
        let intervals = self.intervals(rewards);
        let mean = |i: usize| intervals[i].0;
        let best = (0..rewards.len()).fold(0, |b, i| if mean(i) > mean(b) { i } else { b });
        let worst = (0..rewards.len()).fold(0, |w, i| if mean(i) < mean(w) { i } else { w });
        let mut doubt = vec![false; rewards.len()];
        for c in 0..rewards.len() {
            for end in [best, worst] {
                if c != end && overlap(intervals[end], intervals[c]) {
                    doubt[c] = true;
                    doubt[end] = true;
                }
            }
        }
        (0..rewards.len())
            .filter(|&i| doubt[i] && rewards[i].len() < self.max_futures)
            .collect()
    }

    /// (mean, half-width) per candidate. A candidate's spread is at least the pooled spread
    /// of all candidates' futures, so two equal draws do not look certain.
    fn intervals(&self, rewards: &[Vec<f64>]) -> Vec<(f64, f64)> {
        let means: Vec<f64> = rewards.iter().map(|r| mean_of(r)).collect();
        let (mut ss, mut dof) = (0.0, 0usize);
        for (r, m) in rewards.iter().zip(&means) {
            ss += r.iter().map(|x| (x - m).powi(2)).sum::<f64>();
            dof += r.len().saturating_sub(1);
        }
        let pooled = if dof > 0 {
            (ss / dof as f64).sqrt()
        } else {
            0.0
        };
        rewards
            .iter()
            .zip(&means)
            .map(|(r, &m)| {
                let n = r.len().max(1) as f64;
                let own = if r.len() > 1 {
                    (r.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0)).sqrt()
                } else {
                    0.0
                };
                (m, self.z * own.max(pooled) / n.sqrt())
            })
            .collect()
    }
}

/// Two intervals overlap, and at least one has a width (equal means of futures that never
/// vary are a tie further futures cannot break).
fn overlap(a: (f64, f64), b: (f64, f64)) -> bool {
    let (hi, lo) = if a.0 >= b.0 { (a, b) } else { (b, a) };
    hi.1 + lo.1 > 0.0 && hi.0 - hi.1 <= lo.0 + lo.1
}

fn mean_of(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.iter().sum::<f64>() / v.len() as f64
}

/// What the rule did on one turn.
#[derive(Clone, Debug, PartialEq)]
pub struct Replayed {
    /// Futures played in all.
    pub futures: usize,
    /// Futures each candidate had.
    pub per_candidate: Vec<usize>,
    /// The (chosen, rejected) pair from the candidates' means, as `generate_conv` selects it.
    pub pair: Option<(usize, usize)>,
}

/// Runs the rule over the futures a fixed-S run scored (`all[i]`: candidate i's future
/// rewards), each candidate's futures taken in a random order; a candidate never gets more
/// futures than were stored.
pub fn replay(all: &[Vec<f64>], rule: &AdaptiveRule, min_gap: f64, rng: &mut impl Rng) -> Replayed {
    let orders: Vec<Vec<f64>> = all
        .iter()
        .map(|r| {
            let mut r = r.clone();
            r.shuffle(rng);
            r
        })
        .collect();
    let mut had: Vec<Vec<f64>> = vec![Vec::new(); all.len()];
    loop {
        let next: Vec<usize> = rule
            .wanted(&had)
            .into_iter()
            .filter(|&i| had[i].len() < orders[i].len())
            .collect();
        if next.is_empty() {
            break;
        }
        for i in next {
            let next_future = orders[i][had[i].len()];
            had[i].push(next_future);
        }
    }
    Replayed {
        futures: had.iter().map(Vec::len).sum(),
        per_candidate: had.iter().map(Vec::len).collect(),
        pair: pair_of(&had, min_gap),
    }
}

/// The best-vs-worst pair of these futures' means.
pub fn pair_of(futures: &[Vec<f64>], min_gap: f64) -> Option<(usize, usize)> {
    let means: Vec<Option<f64>> = futures
        .iter()
        .map(|r| (!r.is_empty()).then(|| mean_of(r)))
        .collect();
    select_pairs(&means, &[], min_gap, PairMode::Best)
        .first()
        .copied()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn rule(min: usize, max: usize, z: f64) -> AdaptiveRule {
        AdaptiveRule {
            min_futures: min,
            max_futures: max,
            z,
        }
    }

    /// A candidate far below the others stops after the minimum; close ones race on.
    #[test]
    fn futures_go_where_the_ranking_is_in_doubt() {
        let r = rule(2, 8, 1.96);
        assert_eq!(
            r.wanted(&[vec![], vec![0.5]]),
            vec![0, 1],
            "fill to the minimum"
        );
        // 0 and 1 close at the top, 2 far below: the top two race, 2 is settled as worst.
        let rewards = vec![vec![1.0, 0.8], vec![0.9, 1.0], vec![-3.0, -3.2]];
        assert_eq!(r.wanted(&rewards), vec![0, 1]);
        // Separated everywhere: done.
        let settled = vec![vec![1.0, 1.1], vec![0.0, 0.1], vec![-1.0, -1.1]];
        assert!(r.wanted(&settled).is_empty());
        // In doubt but at the maximum: done.
        let full = vec![vec![1.0, 0.0], vec![0.0, 1.0]];
        assert!(rule(2, 2, 1.96).wanted(&full).is_empty());
        // Futures that never vary: equal means are a tie no future breaks.
        assert!(r.wanted(&[vec![0.5, 0.5], vec![0.5, 0.5]]).is_empty());
    }

    /// A candidate's two equal draws borrow the others' spread instead of looking certain.
    #[test]
    fn the_pooled_spread_bounds_a_lucky_candidate() {
        let r = rule(2, 8, 1.96);
        let rewards = vec![vec![0.5, 0.5], vec![0.0, 1.0], vec![-5.0, -5.2]];
        let iv = r.intervals(&rewards);
        assert!(iv[0].1 > 0.4, "{iv:?}");
        assert!(r.wanted(&rewards).contains(&0));
    }

    /// Replayed over stored futures: far fewer futures than fixed S where one candidate is
    /// clearly worst, the same pair, and never more futures than stored.
    #[test]
    fn replay_saves_futures_and_keeps_the_pair() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let all = vec![
            vec![1.0, 1.2, 0.9, 1.1, 1.0, 1.3, 0.8, 1.1],
            vec![0.2, 0.1, 0.3, 0.2, 0.0, 0.1, 0.2, 0.3],
            vec![-2.0, -2.1, -1.9, -2.2, -2.0, -1.8, -2.0, -2.1],
        ];
        let fixed = pair_of(&all, 0.0);
        assert_eq!(fixed, Some((0, 2)));
        for _ in 0..50 {
            let out = replay(&all, &AdaptiveRule::default(), 0.0, &mut rng);
            assert_eq!(out.pair, fixed);
            assert!(out.futures <= 12, "{out:?}");
            assert!(out.per_candidate.iter().all(|&n| (2..=8).contains(&n)));
        }
        let stored_three = vec![vec![1.0, 0.0, 1.0], vec![0.0, 1.0, 0.0]];
        let out = replay(&stored_three, &rule(2, 8, 1.96), 0.0, &mut rng);
        assert_eq!(out.per_candidate, vec![3, 3], "capped at what was stored");
    }

    #[test]
    fn settings_are_checked() {
        assert!(rule(1, 8, 1.96)
            .validate()
            .unwrap_err()
            .contains("min_futures"));
        assert!(rule(4, 3, 1.96)
            .validate()
            .unwrap_err()
            .contains("max_futures"));
        assert!(rule(2, 8, f64::NAN).validate().unwrap_err().contains("z"));
        AdaptiveRule::default().validate().unwrap();
    }
}
