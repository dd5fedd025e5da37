//! Rewards: the metrics that score simulated futures (judges, programmatic checks, BLEU,
//! sandboxed tests, token counts) and the multiturn-aware reward that combines them.

pub mod adaptive;
pub(crate) mod bleu;
pub mod judge;
pub mod math;
pub mod metrics;
pub mod mr;
pub mod pairs;
pub mod sandbox;
