//! Training: a trainable llama ([`model::TrainLlama`]) built from ops with explicit backward
//! passes ([`ops`]), sequence log-probs packed one pair per row ([`logps`]), AdamW with open
//! state ([`adamw`]), HF/TRL schedule and clipping ([`optim`]), TRL-format data and chat
//! rendering ([`data`]) and the settings both trainers share ([`settings`]); on top of them
//! DPO/SFT with TRL's losses, checkpoints and resume ([`dpo`]) and online RL (GRPO/PPO updates
//! from scored groups, [`rl`]).
//!
//! A step, in outline:
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! use candle_core::{DType, Device};
//! use candle_nn::{AdamW, Optimizer, ParamsAdamW};
//! use collabllm::train::{dpo::loss::*, logps::*, model::TrainLlama};
//! let dev = Device::Cpu;
//! let policy = TrainLlama::from_hf_dir("model".as_ref(), DType::F32, &dev)?;
//! let pairs = vec![TokenizedPair { prompt: vec![1, 2], chosen: vec![3], rejected: vec![4] }];
//! let batch = PairBatch::new(&pairs, 0, &dev)?;
//! let cfg = DpoConfig::default();
//! // Reference log-probs: the policy before training (or a cache of them), no gradient.
//! let (ref_c, ref_r) = pair_logps(&policy, &batch, cfg.loss_type.average_logps())?;
//! let (ref_c, ref_r) = (ref_c.detach(), ref_r.detach());
//! let mut opt = AdamW::new(policy.vars(), ParamsAdamW { lr: 5e-6, ..Default::default() })?;
//! let (pc, pr) = pair_logps(&policy, &batch, cfg.loss_type.average_logps())?;
//! let out = dpo_loss(&pc, &pr, &ref_c, &ref_r, &cfg)?;
//! opt.backward_step(&out.loss)?;
//! println!("{:?}", out.metrics.named());
//! # Ok(()) }
//! ```

pub mod adamw;
pub mod capacity;
pub mod chunked_attention;
pub mod chunked_head;
pub mod data;
pub mod dpo;
pub(crate) mod error;
pub mod head;
pub mod logps;
pub mod model;
pub mod ops;
pub mod optim;
pub mod rl;
pub mod settings;
pub mod shapes;

pub use error::TrainError;

/// The progress bar of a training run's optimizer steps (hidden when `enabled` is false),
/// starting at `start` with its estimate counted from there.
pub(crate) fn steps_bar(enabled: bool, total: usize, start: u64) -> indicatif::ProgressBar {
    if !enabled {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(total as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30} {pos}/{len} steps [{elapsed_precise} < {eta_precise}] {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_position(start);
    bar.reset_eta();
    bar
}
