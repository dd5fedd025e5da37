//! collabllm-rs: the CollabLLM method (multiturn-aware rewards → DPO pairs → training →
//! multi-turn evaluation) in Rust. See ARCHITECTURE.md for the code map.
//!
//! Modules follow the data, and a module may use only the ones listed before it:
//! `llm` (backends, local engine, cache) → `serve` (HTTP front over `llm`); `reward` (BLEU, math
//! answer checks, the Python sandbox, lenient judge-output parsing) depends on no other module.

pub mod cli;
pub mod llm;
pub mod reward;
pub mod serve;
