//! 20 Questions (LMRL-Gym rules), the deterministic part.
//!
//! - [`World`]: the 158 objects (task order), the yes/no attribute table and the
//!   question→attribute lexicon, loaded from `data/twenty_questions_*.tsv`.
//! - [`is_win`]: the LMRL win rule, nouns told by a word list instead of NLTK's tagger.
//! - [`Oracle`] / [`TableOracle`]: answers "Yes."/"No." from the table.
//! - [`play`]: one game (≤ 20 questions) with exact information gain under the table;
//!   [`GameMetrics`] / [`AggregateMetrics`] for the numbers; [`lmrl_transcript`] for LMRL's
//!   offline schema.
//! - [`ReferenceQuestioner`] (greedy max expected information gain) and
//!   [`RandomGuessQuestioner`] (random distinct guesses) as sanity anchors;
//!   [`DemonstratorQuestioner`] (noisy halving) whose games are SFT data.
//! - [`parse`]: the grammar that reads a question as a query the table answers.
//!
//! Each piece is a file of its own, re-exported here: `data` (the data files), `win` (names
//! and the win rule), `world`, `gain` (information gain), `oracle`, `game` (the game loop),
//! `metrics`, `rewards` (a future's rewards and the metric presets) and `players` (the
//! scripted questioners).

pub mod chat;
mod data;
pub mod future;
mod gain;
mod game;
mod metrics;
mod oracle;
pub mod parse;
mod players;
mod rewards;
mod win;
mod world;

pub use data::{
    load_lexicon, load_objects, load_table, AttributeTable, Lexicon, LexiconEntry, Object,
    WorldDataError, ATTRIBUTES_FILE, DEFAULT_DATA_DIR, LEXICON_FILE, MAX_QUESTIONS, NUM_OBJECTS,
    OBJECTS_FILE,
};
pub use gain::{
    binary_entropy, consistent_objects, expected_gain, optimal_expected_questions, realised_gain,
};
pub use game::{lmrl_transcript, play, GameRecord, Questioner, Turn};
pub use metrics::{AggregateMetrics, GameMetrics, Stat};
pub use oracle::{Oracle, OracleAnswer, TableOracle};
pub use players::{
    DemonstratorQuestioner, RandomGuessQuestioner, ReferenceQuestioner, DEMONSTRATOR_GUESS_AT,
    DEMONSTRATOR_TOP_K,
};
pub use rewards::{
    consistent_after, future_rewards, metric_preset, FutureRewards, DEFAULT_WEIGHTS, GAME_PRESET,
    GAME_WEIGHTS, METRIC_PRESETS,
};
pub use win::{is_win, tokenize, win_tokens};
pub use world::{Query, World};
