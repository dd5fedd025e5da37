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

/// Waits (at most two minutes) until the run's `logs.jsonl` has a line: a step finished.
pub fn wait_for_first_log_line(logs: &std::path::Path) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while std::fs::read_to_string(logs).map_or(0, |t| t.lines().count()) == 0 {
        assert!(std::time::Instant::now() < deadline, "no step finished");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}
