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
