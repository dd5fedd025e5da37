//! Multi-turn rollouts: the simulated user, the futures it plays out, and the append-only
//! conversation records (`conversations.jsonl`) that generation writes and evaluation and
//! plots read.

pub mod config;
pub(crate) mod futures;
pub mod records;
pub mod simulated;
pub mod user;
