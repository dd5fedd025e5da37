//! The multiturn-aware reward of a candidate from its sessions' per-metric scores.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// How per-session scores become one reward (step 4).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MrFormula {
    /// `MR = mean_k Σ_m w_m · s[k][m]` (CollabLLM v2).
    #[default]
    Mean,
    /// `MR = Σ_m clamp(w_m · mean_k s[k][m], −1, 1)` (the verl recipe).
    VerlClamp,
}

impl std::str::FromStr for MrFormula {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "mean" => Ok(MrFormula::Mean),
            "verl_clamp" | "verl" => Ok(MrFormula::VerlClamp),
            _ => Err(format!(
                "unknown MR formula `{s}` (expected mean or verl_clamp)"
            )),
        }
    }
}

/// Per-session scores: metric name → value, `None` when the metric failed (a judge gave no
/// usable answer).
pub type SessionScores = BTreeMap<String, Option<f64>>;

/// The candidate's reward, or `None` when a weighted metric has no value in any session.
///
/// A metric missing in some sessions is averaged over the sessions that have it; with every
/// score present, `Σ_m w_m · mean_k s[k][m]` equals `mean_k Σ_m w_m · s[k][m]`.
pub fn multiturn_reward(
    sessions: &[SessionScores],
    weights: &BTreeMap<String, f64>,
    formula: MrFormula,
) -> Option<f64> {
    if sessions.is_empty() {
        return None;
    }
    let mut total = 0.0;
    for (metric, &w) in weights {
        let vals: Vec<f64> = sessions
            .iter()
            .filter_map(|s| s.get(metric).copied().flatten())
            .collect();
        if vals.is_empty() {
            return None;
        }
        let mean = vals.iter().sum::<f64>() / vals.len() as f64;
        total += match formula {
            MrFormula::Mean => w * mean,
            MrFormula::VerlClamp => (w * mean).clamp(-1.0, 1.0),
        };
    }
    Some(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(pairs: &[(&str, Option<f64>)]) -> SessionScores {
        pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    }

    #[test]
    fn both_formulas_by_hand() {
        let weights: BTreeMap<String, f64> = [
            ("accuracy".to_string(), 1.0),
            ("interactivity".to_string(), 2.0),
            ("token_amount".to_string(), -0.5),
        ]
        .into();
        let sessions = vec![
            s(&[
                ("accuracy", Some(1.0)),
                ("interactivity", Some(0.5)),
                ("token_amount", Some(0.4)),
            ]),
            s(&[
                ("accuracy", Some(0.0)),
                ("interactivity", Some(0.75)),
                ("token_amount", Some(0.2)),
            ]),
            s(&[
                ("accuracy", Some(1.0)),
                ("interactivity", Some(1.0)),
                ("token_amount", Some(0.6)),
            ]),
        ];
        // Per session: 1 + 1 − 0.2 = 1.8; 0 + 1.5 − 0.1 = 1.4; 1 + 2 − 0.3 = 2.7 → mean 1.9667.
        let mean = multiturn_reward(&sessions, &weights, MrFormula::Mean).unwrap();
        assert!((mean - 5.9 / 3.0).abs() < 1e-12, "{mean}");
        // verl: clamp(1·2/3) + clamp(2·0.75 = 1.5 → 1) + clamp(−0.5·0.4 = −0.2) = 1.4667.
        let verl = multiturn_reward(&sessions, &weights, MrFormula::VerlClamp).unwrap();
        assert!((verl - (2.0 / 3.0 + 1.0 - 0.2)).abs() < 1e-12, "{verl}");
    }

    #[test]
    fn missing_scores_average_over_the_rest_or_fail() {
        let weights: BTreeMap<String, f64> = [("accuracy".to_string(), 1.0)].into();
        let partial = vec![s(&[("accuracy", Some(1.0))]), s(&[("accuracy", None)])];
        assert_eq!(
            multiturn_reward(&partial, &weights, MrFormula::Mean),
            Some(1.0)
        );
        let none = vec![s(&[("accuracy", None)])];
        assert_eq!(multiturn_reward(&none, &weights, MrFormula::Mean), None);
        assert_eq!(multiturn_reward(&[], &weights, MrFormula::Mean), None);
    }
}
