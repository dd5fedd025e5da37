//! Shared by the test suites that load a model: thread settings, the tiny model, the default
//! model. Include with `#[path = "common/model_util.rs"] mod model_util;`.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;

use collabllm::llm::local::{LoadOptions, LocalBackend};
use collabllm::llm::tiny::{write_tiny_llama, TinySpec};
use collabllm::llm::ModelSpec;

/// One compute thread per model test (DESIGN §8: candle's kernels spin-wait, and CI runs
/// other tests beside this one). Must run before the first model loads.
pub fn one_thread() {
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        // SAFETY: tests call this first, before any model thread starts.
        unsafe { std::env::set_var("CANDLE_NUM_THREADS", "1") };
    }
}

/// Writes the tiny random llama into a fresh temp dir; keep the guard alive while it is used.
pub fn tiny_model_dir(spec: &TinySpec) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("tiny-llama");
    write_tiny_llama(&path, spec).expect("writing the tiny model");
    (dir, path)
}

pub async fn load_tiny(spec: &TinySpec) -> (tempfile::TempDir, Arc<LocalBackend>) {
    one_thread();
    let (guard, path) = tiny_model_dir(spec);
    let backend = LocalBackend::load(&ModelSpec::HfDir(path), &LoadOptions::default())
        .await
        .expect("loading the tiny model");
    (guard, backend)
}

/// The default model's path; fails (never skips) with the command that fetches it.
pub fn default_model_path() -> PathBuf {
    collabllm::llm::spec::default_model_path().unwrap_or_else(|e| {
        panic!("{e}\n(CI fetches it in .ci/run; locally run `bash scripts/fetch_default_model.sh`)")
    })
}
