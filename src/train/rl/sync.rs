//! Weights for the sampler after each update: the policy's current weights (LoRA merged)
//! become an inference [`LlamaModel`] (f32, or re-quantized to Q8_0 for fast CPU sampling),
//! wrapped in an [`Engine`] whose fingerprint names the update, and a [`LocalBackend`] that
//! the rollout swaps in for the previous one. The engine owns its weights (copied or
//! re-quantized), so the optimizer can update the trainable variables while the engine of
//! the previous version still serves (tested).
//!
//! Cost on SmolLM2-135M (CPU, after the first call): f32 ~0.12 s (a copy of the weights);
//! Q8_0 0.24-0.27 s a step in `rl_train` on two threads (0.47 s before the layers were
//! quantized straight into the int8 layout in parallel and the run's `ChatCodec` was cloned
//! instead of read again from the model files).

use std::sync::Arc;

use candle_core::{DType, Result};

use crate::engine::llama::{LlamaModel, WeightFormat};
use crate::engine::{ChatCodec, Engine};
use crate::llm::local::LocalBackend;
use crate::train::model::TrainLlama;

/// The inference model of the policy's current weights. `factors`: GGUF `rope_freqs` of
/// the source model, if it had any (the trainable model does not keep them). Its int8
/// weights stay on 4 KiB pages, unlike a model loaded to serve: moving them costs 0.07–0.6 s
/// each update, more than the whole sync, and the rollouts decode many rows at once, where
/// huge pages gain little (BENCHMARKS.md, "Weights on 2 MiB pages").
pub fn policy_model(
    policy: &TrainLlama,
    factors: Option<Vec<f32>>,
    format: WeightFormat,
) -> Result<LlamaModel> {
    // `hf_tensors` may share storage with the trainable variables (detached views), which
    // the optimizer may update in place: an f32 engine takes its own copy so that it never
    // changes under the sampler.
    let tensors = policy
        .hf_tensors()?
        .into_iter()
        .map(|(k, v)| {
            let v = v.to_dtype(DType::F32)?;
            let v = if format == WeightFormat::F32 {
                v.copy()?
            } else {
                v
            };
            Ok((k, v))
        })
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
