//! Preference pairs from the candidates of one turn ("Pairs"), and the balance of a pair set
//! across request strata.

use std::collections::BTreeMap;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

use crate::task::Action;

/// Minimum MR gap between the chosen and the rejected reply of a pair: 0 or more.
pub const MIN_GAP: crate::check::Range = crate::check::Range::at_least(0.0);

/// Which pairs a turn yields.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PairMode {
    /// Highest MR against lowest MR.
    #[default]
    Best,
    /// Every ordered pair whose MR gap clears the threshold.
    All,
    /// Action contrast (ACT, Chen et al. 2025): the highest MR against the lowest MR among
    /// the candidates that take the *other* action (ask vs answer); a turn whose candidates
    /// all take one action yields no pair.
    Contrast,
    /// [`PairMode::Contrast`] where the turn has both actions, else best against worst.
    ContrastOrBest,
}

impl PairMode {
    pub fn as_str(self) -> &'static str {
        match self {
            PairMode::Best => "best",
            PairMode::All => "all",
            PairMode::Contrast => "contrast",
            PairMode::ContrastOrBest => "contrast_or_best",
        }
    }

    /// Whether the mode reads the candidates' actions.
    pub fn needs_actions(self) -> bool {
        matches!(self, PairMode::Contrast | PairMode::ContrastOrBest)
    }
}

impl std::str::FromStr for PairMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "best" => Ok(PairMode::Best),
            "all" => Ok(PairMode::All),
            "contrast" => Ok(PairMode::Contrast),
            "contrast_or_best" | "contrast-or-best" => Ok(PairMode::ContrastOrBest),
            _ => Err(format!(
                "unknown pair mode `{s}` (best, all, contrast or contrast_or_best)"
            )),
        }
    }
}

/// (chosen, rejected) candidate indices. Candidates without an MR take no part; a pair needs
/// `MR(chosen) − MR(rejected) ≥ min_gap` and a strictly positive gap, so ties are dropped and
/// never resolved by a coin. `actions` (one per candidate) is read only by the contrast
/// modes; without it they see one action and pair nothing (`Contrast`) or best vs worst.
pub fn select_pairs(
    mrs: &[Option<f64>],
    actions: &[Action],
    min_gap: f64,
    mode: PairMode,
) -> Vec<(usize, usize)> {
    let scored: Vec<(usize, f64)> = mrs
        .iter()
        .enumerate()
        .filter_map(|(i, m)| m.filter(|v| v.is_finite()).map(|v| (i, v)))
        .collect();
    if scored.len() < 2 {
        return Vec::new();
    }
    let clears = |hi: f64, lo: f64| hi - lo > 0.0 && hi - lo >= min_gap;
    // First index wins among equals, so the choice is deterministic.
    let best = scored
        .iter()
        .fold(scored[0], |b, &c| if c.1 > b.1 { c } else { b });
    let lowest = |among: &mut dyn Iterator<Item = &(usize, f64)>| {
        among.fold(None, |w: Option<(usize, f64)>, &c| match w {
            Some(w) if c.1 >= w.1 => Some(w),
            _ => Some(c),
        })
    };
    let best_worst = || {
        let worst = lowest(&mut scored.iter()).unwrap_or(best);
        if clears(best.1, worst.1) {
            vec![(best.0, worst.0)]
        } else {
            Vec::new()
        }
    };
    match mode {
        PairMode::Best => best_worst(),
        PairMode::All => {
            let mut out = Vec::new();
            for &(i, a) in &scored {
                for &(j, b) in &scored {
                    if i != j && clears(a, b) {
                        out.push((i, j));
                    }
                }
            }
            out
        }
        PairMode::Contrast | PairMode::ContrastOrBest => {
            let action = |i: usize| actions.get(i).copied();
            let other = lowest(&mut scored.iter().filter(|c| action(c.0) != action(best.0)));
            match other {
                Some(w) if action(best.0).is_some() => {
                    if clears(best.1, w.1) {
                        vec![(best.0, w.0)]
                    } else {
                        Vec::new()
                    }
                }
                _ if mode == PairMode::ContrastOrBest => best_worst(),
                _ => Vec::new(),
            }
        }
    }
}

/// How a pair set is balanced across request strata: within each group of pairs that agree
/// on `within` (e.g. the template), every stratum (the values of the `by` fields, e.g.
/// vague vs stated) keeps as many pairs as the group's smallest stratum, drawn with a seed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Balance {
    /// Fields whose values name a stratum: task metadata keys, or `turn` (the pair's turn
    /// index) and `action` (the chosen reply's action). Empty: no balancing.
    #[serde(default)]
    pub by: Vec<String>,
    /// A field whose value names a group balanced on its own (e.g. `template`); `None`: the
    /// whole set is one group.
    #[serde(default)]
    pub within: Option<String>,
}

impl Balance {
    pub fn is_off(&self) -> bool {
        self.by.is_empty()
    }

    /// Every field name is non-empty.
    pub fn validate(&self) -> Result<(), String> {
        let names = self.by.iter().chain(self.within.iter());
        if let Some(bad) = names.into_iter().find(|f| f.trim().is_empty()) {
            return Err(format!("balance field `{bad}`: empty name"));
        }
        if self.within.is_some() && self.by.is_empty() {
            return Err("balance `within` needs `by` (the strata to balance)".into());
        }
        Ok(())
    }
}

/// The indices of `keys` (one `(group, stratum)` per pair) that a balanced set keeps, in
/// their original order: each group's strata cut to the group's smallest stratum. A group
/// with one stratum only keeps nothing (there is nothing to balance it against).
pub fn balanced(keys: &[(String, String)], seed: u64) -> Vec<usize> {
    let mut groups: BTreeMap<&str, BTreeMap<&str, Vec<usize>>> = BTreeMap::new();
    for (i, (group, stratum)) in keys.iter().enumerate() {
        groups
            .entry(group)
            .or_default()
            .entry(stratum)
            .or_default()
            .push(i);
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut keep = Vec::new();
    for strata in groups.values() {
        let n = strata.values().map(Vec::len).min().unwrap_or(0);
        if strata.len() < 2 {
            continue;
        }
        for members in strata.values() {
            let mut members = members.clone();
            members.shuffle(&mut rng);
            keep.extend_from_slice(&members[..n]);
        }
    }
    keep.sort_unstable();
    keep
}

#[cfg(test)]
mod tests {
    use super::*;
    use Action::{Answer, Ask};

    #[test]
    fn best_worst_gap_and_ties() {
        let m = [Some(0.5), Some(0.9), Some(0.1)];
        assert_eq!(select_pairs(&m, &[], 0.02, PairMode::Best), vec![(1, 2)]);
        assert!(select_pairs(&m, &[], 0.9, PairMode::Best).is_empty());
        assert!(select_pairs(&[Some(0.3), Some(0.3)], &[], 0.0, PairMode::Best).is_empty());
        assert!(select_pairs(&[Some(0.3), None], &[], 0.0, PairMode::Best).is_empty());
        assert_eq!(
            select_pairs(&[None, Some(0.2), Some(0.0)], &[], 0.1, PairMode::Best),
            vec![(1, 2)]
        );
    }

    #[test]
    fn all_pairs_above_gap() {
        let m = [Some(0.0), Some(0.5), Some(0.51)];
        let mut p = select_pairs(&m, &[], 0.1, PairMode::All);
        p.sort();
        assert_eq!(p, vec![(1, 0), (2, 0)]);
    }

    /// A hand-built clarify turn: on a vague request two questions (0.7, 0.4: the second's
    /// future asked again), an answer that guessed (0.0) and one that rambled (−0.1 with a
    /// token cost); on a stated request answers (1.0, 0.0) and a needless question (0.7).
    #[test]
    fn contrast_pairs_the_best_against_the_worst_of_the_other_action() {
        let vague = [Some(0.7), Some(0.4), Some(0.0), Some(-0.1)];
        let acts = [Ask, Ask, Answer, Answer];
        // best vs worst is the same here; contrast picks the other action's worst.
        assert_eq!(
            select_pairs(&vague, &acts, 0.02, PairMode::Contrast),
            vec![(0, 3)]
        );
        let stated = [Some(1.0), Some(0.0), Some(0.7)];
        let acts = [Answer, Answer, Ask];
        // Best vs worst would pair two answers (the detail used or not); contrast pairs the
        // answer against the needless question.
        assert_eq!(
            select_pairs(&stated, &acts, 0.02, PairMode::Best),
            vec![(0, 1)]
        );
        assert_eq!(
            select_pairs(&stated, &acts, 0.02, PairMode::Contrast),
            vec![(0, 2)]
        );
        assert!(select_pairs(&stated, &acts, 0.5, PairMode::Contrast).is_empty());
        // One action only: no contrast; the fallback mode pairs best vs worst.
        let same = [Some(1.0), Some(0.0)];
        assert!(select_pairs(&same, &[Answer, Answer], 0.02, PairMode::Contrast).is_empty());
        assert_eq!(
            select_pairs(&same, &[Answer, Answer], 0.02, PairMode::ContrastOrBest),
            vec![(0, 1)]
        );
        // A candidate without a score takes no part, whatever its action.
        assert!(select_pairs(
            &[Some(1.0), None, Some(0.5)],
            &[Answer, Ask, Answer],
            0.02,
            PairMode::Contrast
        )
        .is_empty());
        // The other action scoring higher than the best is impossible; equal is a tie.
        assert!(select_pairs(
            &[Some(0.7), Some(0.7)],
            &[Ask, Answer],
            0.0,
            PairMode::Contrast
        )
        .is_empty());
    }

    #[test]
    fn balance_cuts_each_group_to_its_smallest_stratum() {
        let k = |g: &str, s: &str| (g.to_string(), s.to_string());
        // Template a: 3 vague, 1 stated → 1 + 1; template b: 2 and 2 → all; c: one stratum.
        let keys = vec![
            k("a", "vague"),
            k("a", "vague"),
            k("a", "stated"),
            k("a", "vague"),
            k("b", "vague"),
            k("b", "stated"),
            k("b", "stated"),
            k("b", "vague"),
            k("c", "vague"),
        ];
        let kept = balanced(&keys, 7);
        assert_eq!(kept.len(), 6);
        assert!(kept.contains(&2), "a's only stated pair is kept");
        assert_eq!(kept.iter().filter(|&&i| i < 4).count(), 2);
        assert!([4, 5, 6, 7].iter().all(|i| kept.contains(i)));
        assert!(!kept.contains(&8));
        assert!(kept.windows(2).all(|w| w[0] < w[1]), "original order");
        assert_eq!(kept, balanced(&keys, 7), "seeded");
        let other: Vec<Vec<usize>> = (0..20).map(|s| balanced(&keys, s)).collect();
        assert!(other.iter().any(|o| o != &kept), "the seed draws which");
    }
}
