//! Checkpoints of an RL run: the trainable weights (full model or PEFT adapter, with the
//! existing save functions), AdamW's moments and step count, the update count and seed, and
//! an opaque value the rollout side keeps there (its data cursor, its sampler seed). The
//! shuffle of each update is derived from (seed, update, epoch), so there is no RNG stream to
//! save: a resumed run replays exactly the step it would have taken.
//!
//! A checkpoint is written into `<dir>.tmp` and renamed into place: a kill never leaves a
//! half-written checkpoint under the real name.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::step::{RlError, RlTrainer};
use crate::engine::peft::ADAPTER_WEIGHTS;
use crate::engine::ChatCodec;

pub const RL_STATE: &str = "rl_state.json";
pub const OPTIMIZER: &str = "optimizer.safetensors";

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RlState {
    /// Updates (rollout batches) done.
    pub updates: u64,
    pub optimizer_steps: u64,
    pub seed: u64,
    /// Whatever the rollout side needs to continue (its own RNG state, position in the data).
    #[serde(default)]
    pub rollout: serde_json::Value,
}

fn state_err(path: &Path, e: impl std::fmt::Display) -> RlError {
    RlError::State {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

/// Saves `trainer` (and the tokenizer files when `codec` is given, so a full checkpoint
/// chats on its own) into `dir`, replacing it atomically.
pub fn save(
    trainer: &RlTrainer,
    codec: Option<&ChatCodec>,
    dir: &Path,
    rollout: serde_json::Value,
) -> Result<(), RlError> {
    let tmp = dir.with_extension("tmp");
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| state_err(&tmp, e))?;
    let policy = trainer.policy();
    if let Some(name) =
        crate::train::model::non_finite_weight(policy).map_err(|e| state_err(dir, e))?
    {
        return Err(state_err(
            dir,
            format!("not saved: weight `{name}` is non-finite"),
        ));
    }
    if policy.lora_config().is_some() {
        policy.save_adapter(&tmp).map_err(|e| state_err(&tmp, e))?;
    } else {
        policy.save_hf(&tmp, None).map_err(|e| state_err(&tmp, e))?;
    }
    if let Some(c) = codec {
        c.save_hf(&tmp).map_err(|e| state_err(&tmp, e))?;
    }
    let opt_path = tmp.join(OPTIMIZER);
    trainer
        .optimizer()
        .save(&opt_path)
        .map_err(|e| state_err(&opt_path, e))?;
    let state = RlState {
        updates: trainer.updates(),
        optimizer_steps: trainer.optimizer().step_count(),
        seed: trainer.config().optim.seed,
        rollout,
    };
    let state_path = tmp.join(RL_STATE);
    let text = serde_json::to_string_pretty(&state).map_err(|e| state_err(&state_path, e))?;
    std::fs::write(&state_path, text).map_err(|e| state_err(&state_path, e))?;
    crate::run::write_checksums(&tmp).map_err(|e| state_err(&tmp, e))?;
    let _ = std::fs::remove_dir_all(dir);
    std::fs::rename(&tmp, dir).map_err(|e| state_err(dir, e))?;
    Ok(())
}

/// Restores a checkpoint written by [`save`] into a trainer built from the run's initial
/// weights (so that its reference is the initial model) with the same configuration.
pub fn load(trainer: &mut RlTrainer, dir: &Path) -> Result<RlState, RlError> {
    crate::run::verify_checksums(dir).map_err(|m| state_err(dir, m))?;
    let state_path = dir.join(RL_STATE);
    let text = std::fs::read_to_string(&state_path).map_err(|e| state_err(&state_path, e))?;
    let state: RlState = serde_json::from_str(&text).map_err(|e| state_err(&state_path, e))?;
    if state.seed != trainer.config().optim.seed {
        return Err(state_err(
            &state_path,
            format!(
                "saved with --seed {} but this run has --seed {}",
                state.seed,
                trainer.config().optim.seed
            ),
        ));
    }
    let weights: PathBuf = if trainer.policy().lora_config().is_some() {
        dir.join(ADAPTER_WEIGHTS)
    } else {
        dir.join("model.safetensors")
    };
    let device = trainer.policy().device().clone();
    let tensors =
        candle_core::safetensors::load(&weights, &device).map_err(|e| state_err(&weights, e))?;
    trainer.policy().load_trainable(&tensors).map_err(|e| {
        state_err(
            &weights,
            format!("does not match this model / LoRA setting: {e}"),
        )
    })?;
    let opt_path = dir.join(OPTIMIZER);
    trainer
        .restore(state.updates, &opt_path, state.optimizer_steps)
        .map_err(|e| state_err(&opt_path, e))?;
    Ok(state)
}
