//! Helpers shared by the integration test suites: each suite declares `mod common;` and uses
//! what it needs (the rest is dead code in that binary, hence the allow).
#![allow(dead_code)]

pub mod collab_script;
pub mod fake_hub;
pub mod fault_server;
pub mod model_util;
pub mod plot_fixtures;
pub mod serve_util;
pub mod weights_digest;
