//! Multi-turn evaluation (`eval_multiturn`).
//!
//! - The deterministic core of LMRL-Gym's 20 Questions (objects, win rule, table oracle,
//!   exact information gain, game loop, metrics, reference questioners) is
//!   `task::twenty_questions`, so that generation and RL can use it too.
//! - `players`: model-backed 20 Questions questioner and LLM oracle (prompted templates).
//! - `config`: the resolved settings, the evaluated models and their labels.
//! - `dialogue` (math/doc_edit/code) and `games` (20 Questions): one conversation or game →
//!   one record, metrics through `reward::metrics` (one implementation, shared with
//!   generation).
//! - `records`: append-only per-model JSONL logs (resume); `summary`: mean, s.e., n per
//!   model × metric, JSON/CSV/table; `overlap`: refusal to evaluate on training tasks;
//!   `run`: the whole run (concurrency, cache, resume, manifest).
//! - `transcripts`: LMRL-Gym offline 20 Questions games re-scored under our rules;
//!   `compare`: paired comparison of 20 Questions runs (Wilson intervals, McNemar's exact test);
//!   `study`: a trained-arms study over seeds (per-seed McNemar, pooled differences with a
//!   bootstrap that resamples objects or requests).

pub(crate) mod comparable;
pub mod compare;
pub(crate) mod config;
pub(crate) mod dialogue;
pub(crate) mod games;
pub mod matched;
pub(crate) mod overlap;
pub(crate) mod players;
pub(crate) mod records;
pub mod run;
pub mod study;
pub(crate) mod summary;
pub mod transcripts;

pub use config::{EvalConfig, EvalModel, ObjectSelection, OracleChoice};
pub use games::{dagger_seed, game_seed};
pub use run::{evaluate, evaluate_until, evaluate_with_roles, EvalReport, EvalRoles};
