//! The numbers of games: per game ([`GameMetrics`]) and over games ([`AggregateMetrics`], each
//! a [`Stat`] of mean and standard error).

use std::fmt;

use serde::{Deserialize, Serialize};

use super::GameRecord;

/// Per-game numbers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GameMetrics {
    pub success: bool,
    /// −T + 1[win] (serialized as `return`).
    #[serde(rename = "return")]
    pub return_: f64,
    /// Questions asked on a win; `max_questions` on a failure.
    pub turns: usize,
    pub turns_on_win: Option<usize>,
    /// 1 − 0.02·max(T−5, 0) on a win, else 0.
    pub eda_score: f64,
    pub yes_answers: usize,
    /// Sum of realised gains (bits).
    pub info_gain: f64,
    /// Mean realised gain per question asked.
    pub info_gain_per_question: f64,
    /// Mean expected gain per question asked.
    pub expected_gain_per_question: f64,
    pub questions_asked: usize,
    pub unparsed: usize,
    pub repeated: usize,
    pub inconsistent_guesses: usize,
}

impl GameMetrics {
    pub fn of(record: &GameRecord) -> GameMetrics {
        let asked = record.turns.len();
        let t = if record.won {
            asked
        } else {
            record.max_questions
        };
        let info: f64 = record.turns.iter().map(|x| x.realised_gain).sum();
        let exp: f64 = record.turns.iter().map(|x| x.expected_gain).sum();
        let per = |v: f64| if asked == 0 { 0.0 } else { v / asked as f64 };
        GameMetrics {
            success: record.won,
            return_: -(t as f64) + if record.won { 1.0 } else { 0.0 },
            turns: t,
            turns_on_win: record.won.then_some(t),
            eda_score: if record.won {
                1.0 - 0.02 * (t.saturating_sub(5) as f64)
            } else {
                0.0
            },
            yes_answers: record.turns.iter().filter(|x| x.yes).count(),
            info_gain: info,
            info_gain_per_question: per(info),
            expected_gain_per_question: per(exp),
            questions_asked: asked,
            unparsed: record.turns.iter().filter(|x| x.unparsed).count(),
            repeated: record.turns.iter().filter(|x| x.repeated).count(),
            inconsistent_guesses: record.turns.iter().filter(|x| x.inconsistent_guess).count(),
        }
    }
}

/// Mean, standard error (sample sd / √n) and count.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Stat {
    pub mean: f64,
    pub stderr: f64,
    pub n: usize,
}

impl Stat {
    pub fn of(values: &[f64]) -> Stat {
        let n = values.len();
        if n == 0 {
            return Stat {
                mean: 0.0,
                stderr: 0.0,
                n,
            };
        }
        let mean = values.iter().sum::<f64>() / n as f64;
        let stderr = if n < 2 {
            0.0
        } else {
            let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
            (var / n as f64).sqrt()
        };
        Stat { mean, stderr, n }
    }
}

impl fmt::Display for Stat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.4} ± {:.4} (n={})", self.mean, self.stderr, self.n)
    }
}

/// Aggregated metrics over games.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AggregateMetrics {
    pub games: usize,
    pub success_rate: Stat,
    pub mean_return: Stat,
    pub mean_turns: Stat,
    /// Over won games only.
    pub turns_on_win: Stat,
    pub eda_score: Stat,
    pub yes_answers: Stat,
    pub info_gain_per_game: Stat,
    pub info_gain_per_question: Stat,
    pub expected_gain_per_question: Stat,
    pub unparsed: Stat,
    /// Per game: unparsed questions / questions asked (0 for a game with no question).
    pub unparsed_rate: Stat,
    pub repeated: Stat,
    pub inconsistent_guesses: Stat,
}

impl AggregateMetrics {
    pub fn of(games: &[GameMetrics]) -> AggregateMetrics {
        let s =
            |f: &dyn Fn(&GameMetrics) -> f64| Stat::of(&games.iter().map(f).collect::<Vec<_>>());
        let wins: Vec<f64> = games
            .iter()
            .filter_map(|g| g.turns_on_win.map(|t| t as f64))
            .collect();
        AggregateMetrics {
            games: games.len(),
            success_rate: s(&|g| if g.success { 1.0 } else { 0.0 }),
            mean_return: s(&|g| g.return_),
            mean_turns: s(&|g| g.turns as f64),
            turns_on_win: Stat::of(&wins),
            eda_score: s(&|g| g.eda_score),
            yes_answers: s(&|g| g.yes_answers as f64),
            info_gain_per_game: s(&|g| g.info_gain),
            info_gain_per_question: s(&|g| g.info_gain_per_question),
            expected_gain_per_question: s(&|g| g.expected_gain_per_question),
            unparsed: s(&|g| g.unparsed as f64),
            unparsed_rate: s(&|g| {
                if g.questions_asked == 0 {
                    0.0
                } else {
                    g.unparsed as f64 / g.questions_asked as f64
                }
            }),
            repeated: s(&|g| g.repeated as f64),
            inconsistent_guesses: s(&|g| g.inconsistent_guesses as f64),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::task::twenty_questions::Turn;

    fn turn(yes: bool, gain: f64, win: bool) -> Turn {
        Turn {
            question: "Is it?".into(),
            answer: if yes { "Yes." } else { "No." }.into(),
            yes,
            parsed: None,
            expected_gain: 1.0,
            realised_gain: gain,
            consistent_before: 2,
            consistent_after: 1,
            unparsed: !win,
            repeated: false,
            inconsistent_guess: false,
            contradicts_table: false,
            win,
        }
    }

    fn game(won: bool, turns: Vec<Turn>) -> GameRecord {
        GameRecord {
            object_index: 0,
            object: "Basketball".into(),
            max_questions: 20,
            won,
            turns,
        }
    }

    #[test]
    fn two_hand_made_games_aggregate() {
        let won = GameMetrics::of(&game(
            true,
            vec![turn(false, 1.0, false), turn(true, 2.0, true)],
        ));
        assert_eq!((won.turns, won.return_, won.eda_score), (2, -1.0, 1.0));
        assert_eq!(
            (won.yes_answers, won.info_gain, won.info_gain_per_question),
            (1, 3.0, 1.5)
        );
        let lost = GameMetrics::of(&game(false, vec![turn(false, 0.0, false)]));
        assert_eq!((lost.turns, lost.return_, lost.eda_score), (20, -20.0, 0.0));
        assert_eq!(lost.turns_on_win, None);
        let agg = AggregateMetrics::of(&[won, lost]);
        assert_eq!(agg.games, 2);
        assert_eq!((agg.success_rate.mean, agg.success_rate.stderr), (0.5, 0.5));
        assert_eq!(agg.mean_turns.mean, 11.0);
        assert_eq!((agg.turns_on_win.mean, agg.turns_on_win.n), (2.0, 1));
        assert_eq!(agg.unparsed.mean, 1.0);
        // Per game: 1 of 2 questions, 1 of 1.
        assert_eq!(agg.unparsed_rate.mean, 0.75);
    }

    #[test]
    fn a_stat_of_nothing_is_zero_and_prints_mean_and_error() {
        assert_eq!(
            Stat::of(&[]),
            Stat {
                mean: 0.0,
                stderr: 0.0,
                n: 0
            }
        );
        assert_eq!(Stat::of(&[3.0]).stderr, 0.0);
        assert_eq!(Stat::of(&[1.0, 3.0]).to_string(), "2.0000 ± 1.0000 (n=2)");
    }
}
