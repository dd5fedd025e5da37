//! collabllm-rs: the CollabLLM method (multiturn-aware rewards → DPO pairs → training →
//! multi-turn evaluation) in Rust. See ARCHITECTURE.md for the code map.
//!
//! Modules follow the data, and a module may use only the ones before it (checked by
//! `tests/layering.rs`, file by file):
//! `engine` (the local inference engine: kernels, the llama-family forward pass, tokenizers,
//! chat templates, the batching scheduler) → `llm` (the chat-backend interface every role
//! talks through: the local engine, OpenAI-compatible endpoints, pools, the request cache,
//! usage) → `dataset` (parquet in and out, verl export) → `hub` (the Hugging Face Hub client:
//! uploads, cards, dataset downloads) → `task` (task types and their facts, task files and
//! sources, prompts) → `reward` (metrics, judges, the multiturn-aware reward, pair
//! selection) → `rollout` (the simulated user, futures, a run's tasks checked against its
//! metrics) → `generate` (the generate_conv pipeline and `--import`) → `train` (DPO/SFT/LoRA and online RL with
//! candle) → `eval` (multi-turn evaluation, 20 Questions, studies) → `plot` (figures).
//! `serve` is an HTTP front over `llm` and `engine`; `check` (range checks of user-given
//! numbers), `run` (run directories: locks, atomic writes, checksums, signals) and `cli`
//! (what the binaries share) are leaf utilities.

#![deny(clippy::undocumented_unsafe_blocks)]

pub(crate) mod check;
pub mod cli;
pub mod dataset;
pub mod engine;
pub mod eval;
pub mod generate;
pub mod hub;
pub mod llm;
pub mod plot;
pub mod reward;
pub mod rollout;
pub mod run;
pub mod serve;
pub mod task;
pub mod train;
