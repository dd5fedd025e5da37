//! `generate_conv`: multiturn-aware rewards → preference pairs.

pub mod compat;
pub mod config;
pub(crate) mod conversation;
pub mod import;
pub mod merge;
pub(crate) mod outputs;
pub mod proactive;
pub mod run;

pub use config::GenerateConfig;
pub use run::{
    call_bounds, generate, generate_until, generate_with_roles, plan, rescore, CallBound, Roles,
    RunSummary,
};
