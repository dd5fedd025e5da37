//! Helpers for the engine's unit tests.

use candle_core::Tensor;

/// The largest absolute difference between two f32 tensors of one shape.
pub(crate) fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// The tiny random llama written to a temporary directory and loaded as an engine (keep the
/// directory while the engine is used).
pub(crate) fn tiny_engine() -> (tempfile::TempDir, std::sync::Arc<super::Engine>) {
    use super::tiny::{write_tiny_llama, TinySpec};
    use super::{Engine, LoadOptions, LocalModelFiles};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny-llama");
    write_tiny_llama(&path, &TinySpec::default()).unwrap();
    let engine = Engine::load(&LocalModelFiles::HfDir(path), &LoadOptions::default()).unwrap();
    (dir, std::sync::Arc::new(engine))
}
