//! Helpers for the crate's unit tests.

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

/// The tiny random llama written to a temporary directory and loaded as a local backend
/// (keep the directory while the backend is used).
pub(crate) async fn tiny_backend() -> (
    tempfile::TempDir,
    std::sync::Arc<super::local::LocalBackend>,
) {
    use super::local::{LoadOptions, LocalBackend};
    use super::spec::ModelSpec;
    use super::tiny::{write_tiny_llama, TinySpec};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny-llama");
    write_tiny_llama(&path, &TinySpec::default()).unwrap();
    let backend = LocalBackend::load(&ModelSpec::HfDir(path), &LoadOptions::default())
        .await
        .unwrap();
    (dir, backend)
}
