//! Preference pairs from the candidates of one turn ("Pairs").

use serde::{Deserialize, Serialize};

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
}

impl std::str::FromStr for PairMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "best" => Ok(PairMode::Best),
            "all" => Ok(PairMode::All),
            _ => Err(format!("unknown pair mode `{s}` (best or all)")),
        }
    }
}

/// (chosen, rejected) candidate indices. Candidates without an MR take no part; a pair needs
/// `MR(chosen) − MR(rejected) ≥ min_gap` and a strictly positive gap, so ties are dropped and
/// never resolved by a coin.
pub fn select_pairs(mrs: &[Option<f64>], min_gap: f64, mode: PairMode) -> Vec<(usize, usize)> {
    let scored: Vec<(usize, f64)> = mrs
        .iter()
        .enumerate()
        .filter_map(|(i, m)| m.filter(|v| v.is_finite()).map(|v| (i, v)))
        .collect();
    if scored.len() < 2 {
        return Vec::new();
    }
    let clears = |hi: f64, lo: f64| hi - lo > 0.0 && hi - lo >= min_gap;
    match mode {
        PairMode::Best => {
            // First index wins among equals, so the choice is deterministic.
            let best = scored
                .iter()
                .fold(scored[0], |b, &c| if c.1 > b.1 { c } else { b });
            let worst = scored
                .iter()
                .fold(scored[0], |w, &c| if c.1 < w.1 { c } else { w });
            if clears(best.1, worst.1) {
                vec![(best.0, worst.0)]
            } else {
                Vec::new()
            }
        }
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
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_worst_gap_and_ties() {
        let m = [Some(0.5), Some(0.9), Some(0.1)];
        assert_eq!(select_pairs(&m, 0.02, PairMode::Best), vec![(1, 2)]);
        assert!(select_pairs(&m, 0.9, PairMode::Best).is_empty());
        assert!(select_pairs(&[Some(0.3), Some(0.3)], 0.0, PairMode::Best).is_empty());
        assert!(select_pairs(&[Some(0.3), None], 0.0, PairMode::Best).is_empty());
        assert_eq!(
            select_pairs(&[None, Some(0.2), Some(0.0)], 0.1, PairMode::Best),
            vec![(1, 2)]
        );
    }

    #[test]
    fn all_pairs_above_gap() {
        let m = [Some(0.0), Some(0.5), Some(0.51)];
        let mut p = select_pairs(&m, 0.1, PairMode::All);
        p.sort();
        assert_eq!(p, vec![(1, 0), (2, 0)]);
    }
}
