//! Weights for the sampler after each update: the policy's current weights (LoRA merged)
//! become an inference [`LlamaModel`] (f32, or re-quantized to Q8_0 for fast CPU sampling),
//! wrapped in an [`Engine`] whose fingerprint names the update, and a [`LocalBackend`] that
//! the rollout swaps in for the previous one. Sampling never reads the trainable variables,
//! so the optimizer can update them while the engine of the previous version still serves.

use std::sync::Arc;

use candle_core::{DType, Result};

use crate::llm::engine::{ChatCodec, Engine};
use crate::llm::llama::{LlamaModel, WeightFormat};
use crate::llm::local::LocalBackend;
use crate::train::model::TrainLlama;

/// The inference model of the policy's current weights. `factors`: GGUF `rope_freqs` of
/// the source model, if it had any (the trainable model does not keep them).
pub fn policy_model(
    policy: &TrainLlama,
    factors: Option<Vec<f32>>,
    format: WeightFormat,
) -> Result<LlamaModel> {
    let tensors = policy
        .hf_tensors()?
        .into_iter()
        .map(|(k, v)| Ok((k, v.to_dtype(DType::F32)?)))
        .collect::<Result<_>>()?;
    LlamaModel::from_hf_tensors(
        tensors,
        policy.config().clone(),
        factors,
        format,
        policy.device(),
    )
}

/// An engine serving the policy's current weights, named `name`, fingerprinted by the
/// update count (`name@update-N`) so caches never mix versions.
pub fn policy_engine(
    policy: &TrainLlama,
    codec: ChatCodec,
    name: &str,
    update: u64,
    factors: Option<Vec<f32>>,
    format: WeightFormat,
) -> Result<Engine> {
    let model = policy_model(policy, factors, format)?;
    Ok(Engine::from_parts(
        name.to_string(),
        format!("update-{update}"),
        model,
        codec,
    ))
}

/// [`policy_engine`] as a chat backend.
pub fn policy_backend(
    policy: &TrainLlama,
    codec: ChatCodec,
    name: &str,
    update: u64,
    factors: Option<Vec<f32>>,
    format: WeightFormat,
) -> Result<Arc<LocalBackend>> {
    let engine = policy_engine(policy, codec, name, update, factors, format)?;
    Ok(LocalBackend::from_engine(Arc::new(engine)))
}
