//! The exact rewards of a 20 Questions future under the table ([`future_rewards`]) and the
//! metric presets that weigh them.

use serde::{Deserialize, Serialize};

use super::{expected_gain, is_win, realised_gain, Object, World};

/// The exact rewards of a 20 Questions future: the questions asked after a history (the
/// candidate question first), with the oracle's answers, up to a win or the future's end.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct FutureRewards {
    /// Expected information gain (bits, in [0, 1]) of the first question (the candidate's)
    /// under the objects still consistent after the history: the binary entropy of its
    /// yes-fraction. It depends on the question, not on the hidden object; an unread,
    /// repeated or already answered question, and a guess of a ruled-out object, gain 0.
    pub expected_gain: f64,
    /// Bits gathered: log2(|consistent before the future| / |consistent after it|), the sum of
    /// the realised gains of its questions (unparsed questions and answers that contradict
    /// every consistent object gather none).
    pub info_gain_bits: f64,
    /// `info_gain_bits / log2(|consistent before the future|)`: the share of the uncertainty
    /// left at the candidate that the future removes, in [0, 1] (0 when one object was left).
    pub info_gain: f64,
    /// 1 when the game is won within the future, else 0.
    pub success: f64,
    /// Questions asked in the future, the winning one included.
    pub questions: f64,
    /// LMRL-Gym's return over the future: −1 per question, 0 for the winning one.
    pub lmrl_return: f64,
}

/// Objects consistent with a history of (question, answer-was-yes) under the table; an
/// unparsed question, or an answer no consistent object agrees with, changes nothing (as in
/// [`play`](super::play)).
pub fn consistent_after(world: &World, history: &[(String, bool)]) -> Vec<usize> {
    let mut consistent: Vec<usize> = (0..world.objects.len()).collect();
    for (q, yes) in history {
        if let Some(query) = world.parse(q) {
            let next: Vec<usize> = consistent
                .iter()
                .copied()
                .filter(|&o| world.eval(&query, o) == *yes)
                .collect();
            if !next.is_empty() {
                consistent = next;
            }
        }
    }
    consistent
}

/// Rewards of `future` for the hidden `object` after `history`. The future stops at its first
/// win (a "yes" to a question that [`is_win`]); later turns are not counted.
pub fn future_rewards(
    world: &World,
    object: &Object,
    history: &[(String, bool)],
    future: &[(String, bool)],
) -> FutureRewards {
    let before = consistent_after(world, history);
    let mut played: Vec<(String, bool)> = history.to_vec();
    let (mut questions, mut won) = (0usize, false);
    for (q, yes) in future {
        questions += 1;
        played.push((q.clone(), *yes));
        if *yes && is_win(q, object, &world.objects) {
            won = true;
            break;
        }
    }
    let after = consistent_after(world, &played);
    let bits = realised_gain(before.len(), after.len());
    let max_bits = (before.len() as f64).log2();
    let expected_gain = future
        .first()
        .and_then(|(q, _)| world.parse(q))
        .map_or(0.0, |q| expected_gain(world, &q, &before));
    FutureRewards {
        expected_gain,
        info_gain_bits: bits,
        info_gain: if max_bits > 0.0 {
            (bits / max_bits).clamp(0.0, 1.0)
        } else {
            0.0
        },
        success: if won { 1.0 } else { 0.0 },
        questions: questions as f64,
        lmrl_return: -(questions as f64) + if won { 1.0 } else { 0.0 },
    }
}

/// The 20 Questions study's two reward variants as metric weights (`--metric-preset`): its
/// generation used task weight 1, LLM-reward weight 1 and a cost of 5e-4 per token (= −0.5
/// per thousand tokens); the task metric is `success`, the LLM reward the judged
/// `interactivity` or the exact `info_gain` (the study judged it by LLM; ours is the
/// question's expected gain under the table). The token cost counts the candidate question
/// only (`reply_tokens`): counting the future's questions too made best-vs-worst pairs
/// mostly "shorter vs longer future".
pub const METRIC_PRESETS: &[(&str, &[(&str, f64)])] = &[
    (
        "20q-interactive",
        &[
            ("success", 1.0),
            ("interactivity", 1.0),
            ("reply_tokens", -0.5),
        ],
    ),
    ("20q-infogain", DEFAULT_WEIGHTS),
    (GAME_PRESET, GAME_WEIGHTS),
];

/// The preset whose futures play the game out: besides its weights it makes the window the
/// whole game and the demonstrator the future questioner, unless those are given.
pub const GAME_PRESET: &str = "20q-game";

/// `20q-game`: the game the candidate leads to. `success` (won within the budget) dominates;
/// `lmrl_return` (−1 per question, +1 for a win) at 0.04 ranks wins by questions used and
/// can never outweigh a win (20 questions × 0.04 < 1); the candidate's own tokens cost as in
/// the other presets.
pub const GAME_WEIGHTS: &[(&str, f64)] = &[
    ("success", 1.0),
    ("lmrl_return", 0.04),
    ("reply_tokens", -0.5),
];

/// The default weights of 20 Questions tasks: the `20q-infogain` preset (no judge needed).
pub const DEFAULT_WEIGHTS: &[(&str, f64)] =
    &[("success", 1.0), ("info_gain", 1.0), ("reply_tokens", -0.5)];

/// The weights of a preset by name.
pub fn metric_preset(name: &str) -> Option<&'static [(&'static str, f64)]> {
    METRIC_PRESETS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, w)| *w)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::task::twenty_questions::{binary_entropy, chat::default_world};

    fn h(q: &str, yes: bool) -> (String, bool) {
        (q.to_string(), yes)
    }

    #[test]
    fn a_winning_future_after_a_tiny_history() {
        let w = default_world().expect("bundled world");
        let cat = w.find("Cat").expect("Cat");
        let history = [h("Is it an animal?", true)];
        let animals = consistent_after(w, &history).len();
        assert!(animals > 1 && animals < w.objects.len());
        // An unread question changes nothing.
        assert_eq!(
            consistent_after(w, &[h("Is it an animal?", true), h("Blorp zzyzx?", false)]).len(),
            animals
        );
        // The future stops at its first win: the question after it is not counted.
        let r = future_rewards(
            w,
            cat,
            &history,
            &[h("Is it a cat?", true), h("Is it a dog?", false)],
        );
        assert_eq!((r.success, r.questions, r.lmrl_return), (1.0, 1.0, 0.0));
        assert!((r.info_gain_bits - (animals as f64).log2()).abs() < 1e-12);
        assert!((r.info_gain - 1.0).abs() < 1e-12);
        assert_eq!(r.expected_gain, binary_entropy(1.0 / animals as f64));
        let miss = future_rewards(w, cat, &history, &[h("Is it a dog?", false)]);
        assert_eq!(
            (miss.success, miss.questions, miss.lmrl_return),
            (0.0, 1.0, -1.0)
        );
        assert!(miss.info_gain < 1.0);
    }

    #[test]
    fn presets_are_found_by_name() {
        assert_eq!(metric_preset(GAME_PRESET), Some(GAME_WEIGHTS));
        assert_eq!(metric_preset("20q-infogain"), Some(DEFAULT_WEIGHTS));
        assert!(metric_preset("20q-interactive").is_some());
        assert_eq!(metric_preset("nope"), None);
    }
}
