//! collabllm-rs: the CollabLLM method (multiturn-aware rewards → DPO pairs → training →
//! multi-turn evaluation) in Rust. See ARCHITECTURE.md for the code map.
//!
//! Modules follow the data, and a module may use only the ones listed before it:
//! `llm` (backends, local engine, cache) → `serve` (HTTP front over `llm`).

pub mod cli;
pub mod dataset;
pub mod generate;
pub mod llm;
pub mod pairs;
pub mod parse;
pub mod prompts;
pub mod reward;
pub mod serve;
pub mod simulate;
pub mod task;
