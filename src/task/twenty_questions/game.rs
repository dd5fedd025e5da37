//! The game loop: a [`Questioner`] against an [`Oracle`] for at most a budget of questions
//! ([`play`]), each [`Turn`] with its information gain, and LMRL-Gym's offline transcript.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use super::{expected_gain, is_win, realised_gain, tokenize, Object, Oracle, Query, World};

/// Asks the next question given the (question, answer-was-yes) history.
pub trait Questioner {
    fn next_question(&mut self, history: &[(String, bool)]) -> String;
}

/// One question of a game.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Turn {
    pub question: String,
    /// "Yes." / "No.".
    pub answer: String,
    pub yes: bool,
    /// What the oracle understood (`attr`, `!attr`, `guess:<Name>`).
    pub parsed: Option<String>,
    /// Binary entropy of the yes-fraction among the consistent objects before the question.
    pub expected_gain: f64,
    /// log2(consistent_before / consistent_after).
    pub realised_gain: f64,
    pub consistent_before: usize,
    pub consistent_after: usize,
    pub unparsed: bool,
    /// Same (normalised) question, or same parsed query, as an earlier turn.
    pub repeated: bool,
    /// A guess naming an object already ruled out by earlier answers.
    pub inconsistent_guess: bool,
    /// The answer contradicts every still-consistent object (possible only with a non-table
    /// oracle); the consistent set is then left unchanged.
    pub contradicts_table: bool,
    pub win: bool,
}

/// A finished game.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GameRecord {
    pub object_index: usize,
    pub object: String,
    pub max_questions: usize,
    pub won: bool,
    pub turns: Vec<Turn>,
}

/// Plays one game: at most `max_questions` questions; a win is a "yes" to a question that
/// satisfies [`is_win`]. Information gain is computed under the world's table from the
/// oracle's `parsed` key.
pub fn play(
    world: &World,
    object: &Object,
    questioner: &mut dyn Questioner,
    oracle: &mut dyn Oracle,
    max_questions: usize,
) -> GameRecord {
    let mut consistent: Vec<usize> = (0..world.objects.len()).collect();
    let mut history: Vec<(String, bool)> = Vec::new();
    let mut seen_text: HashSet<String> = HashSet::new();
    let mut seen_key: HashSet<String> = HashSet::new();
    let mut turns = Vec::new();
    let mut won = false;
    for _ in 0..max_questions {
        let question = questioner.next_question(&history);
        let norm = tokenize(&question).join(" ");
        let ans = oracle.answer(object, &question);
        let query = ans.parsed.as_deref().and_then(|k| world.query_from_key(k));
        let repeated = !seen_text.insert(norm)
            | ans
                .parsed
                .as_ref()
                .is_some_and(|k| !seen_key.insert(k.clone()));
        let before = consistent.len();
        let (mut expected, mut after, mut inconsistent_guess, mut contradicts) =
            (0.0, before, false, false);
        if let Some(q) = &query {
            expected = expected_gain(world, q, &consistent);
            if let Query::Guess(objs) = q {
                inconsistent_guess = objs.iter().any(|o| !consistent.contains(o));
            }
            let next: Vec<usize> = consistent
                .iter()
                .copied()
                .filter(|&o| world.eval(q, o) == ans.yes)
                .collect();
            if next.is_empty() {
                contradicts = true;
            } else {
                consistent = next;
                after = consistent.len();
            }
        }
        let win = ans.yes && is_win(&question, object, &world.objects);
        turns.push(Turn {
            answer: ans.text().to_string(),
            yes: ans.yes,
            unparsed: ans.parsed.is_none(),
            parsed: ans.parsed,
            expected_gain: expected,
            realised_gain: realised_gain(before, after),
            consistent_before: before,
            consistent_after: after,
            repeated,
            inconsistent_guess,
            contradicts_table: contradicts,
            win,
            question: question.clone(),
        });
        history.push((question, ans.yes));
        if win {
            won = true;
            break;
        }
    }
    GameRecord {
        object_index: object.index,
        object: object.name.clone(),
        max_questions,
        won,
        turns,
    }
}

/// LMRL-Gym's offline transcript: `{"lines": ["<question> <answer>", ...], "correct": bool,
/// "word": [accepted names]}`.
pub fn lmrl_transcript(record: &GameRecord, object: &Object) -> serde_json::Value {
    serde_json::json!({
        "lines": record
            .turns
            .iter()
            .map(|t| format!("{} {}", t.question.trim(), t.answer))
            .collect::<Vec<_>>(),
        "correct": record.won,
        "word": object.variants,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::task::twenty_questions::chat::default_world;
    use crate::task::twenty_questions::{ReferenceQuestioner, TableOracle, MAX_QUESTIONS};

    /// Asks the same question every turn.
    struct Repeat(&'static str);

    impl Questioner for Repeat {
        fn next_question(&mut self, _history: &[(String, bool)]) -> String {
            self.0.to_string()
        }
    }

    #[test]
    fn the_reference_questioner_wins_a_game_on_the_bundled_data() {
        let w = default_world().expect("bundled world");
        let cat = w.find("Cat").expect("Cat");
        let mut q = ReferenceQuestioner::new(w);
        let mut oracle = TableOracle::new(w);
        let r = play(w, cat, &mut q, &mut oracle, MAX_QUESTIONS);
        assert!(r.won, "{r:?}");
        assert_eq!((r.object_index, r.object.as_str()), (cat.index, "Cat"));
        let last = r.turns.last().unwrap();
        assert!(last.win && last.yes && last.consistent_after == 1);
        assert!(r.turns[..r.turns.len() - 1].iter().all(|t| !t.win));
        assert_eq!(r.turns[0].consistent_before, w.objects.len());
        for t in &r.turns {
            assert!(!t.unparsed && !t.repeated && !t.contradicts_table);
            assert!(t.consistent_after <= t.consistent_before);
        }
    }

    #[test]
    fn repeats_are_flagged_and_the_transcript_has_lmrl_shape() {
        let w = default_world().expect("bundled world");
        let cat = w.find("Cat").expect("Cat");
        let mut oracle = TableOracle::new(w);
        let r = play(w, cat, &mut Repeat("Is it an animal?"), &mut oracle, 3);
        assert!(!r.won);
        assert_eq!(r.turns.len(), 3);
        let repeated: Vec<bool> = r.turns.iter().map(|t| t.repeated).collect();
        assert_eq!(repeated, [false, true, true]);
        // The second ask of the same question gains nothing.
        assert!(r.turns[0].realised_gain > 0.0);
        assert_eq!(r.turns[1].realised_gain, 0.0);
        let t = lmrl_transcript(&r, cat);
        assert_eq!(t["lines"][0], "Is it an animal? Yes.");
        assert_eq!(t["correct"], false);
        assert_eq!(t["word"], serde_json::json!(cat.variants));
    }
}
