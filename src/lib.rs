//! collabllm-rs: the CollabLLM method (multiturn-aware rewards → DPO pairs → training →
//! multi-turn evaluation) in Rust. See ARCHITECTURE.md for the code map.
//!
//! Modules follow the data, and a module may use only the ones before it:
//! `llm` (backends, local engine, cache) → `task`, `prompts` → `simulate` (user simulator,
//! futures) → `reward` (metrics, judges, MR) → `pairs` → `dataset` (parquet) → `hub` (Hugging Face Hub: push, import) → `generate`
//! (the generate_conv pipeline) → `train` (trainable llama, DPO log-probs and losses; uses only
//! `llm`) → `eval` (multi-turn evaluation and 20 Questions; uses the pipeline before it) →
//! `plot` (figures from the files the stages above wrote). `serve` is an HTTP front over
//! `llm`; `parse`, `check` (range checks of user-given numbers), `run` (run directories: lock, atomic
//! writes, signals) and `cli` are leaf utilities.

pub(crate) mod check;
pub mod cli;
pub mod dataset;
pub mod eval;
pub mod generate;
pub mod hub;
pub mod llm;
pub mod plot;
pub mod reward;
pub mod rollout;
pub mod run;
pub mod serve;
pub(crate) mod simd;
pub mod task;
pub mod train;
