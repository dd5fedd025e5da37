//! collabllm-rs: the CollabLLM method (multiturn-aware rewards → DPO pairs → training →
//! multi-turn evaluation) in Rust. See ARCHITECTURE.md for the code map.
//!
//! Modules follow the data, and a module may use only the ones listed before it:
//! `llm` (backends, local engine, cache) → `serve` (HTTP front over `llm`) → `task` (task
//! files in) → `dataset` (pairs and flat rows out, parquet). `columnar` is a crate-internal
//! helper for the parquet code of `task` and `dataset`.

pub mod cli;
pub mod llm;
pub mod serve;

mod columnar;
pub mod dataset;
pub mod task;
