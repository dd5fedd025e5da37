//! Training core for DPO and SFT: a trainable llama ([`model::TrainLlama`]) built
//! from ops with explicit backward passes ([`ops`]), sequence log-probs of preference pairs
//! packed one pair per row ([`logps`]), TRL's DPO losses and metrics ([`loss`]), AdamW with
//! open state ([`adamw`]), HF/TRL schedule and clipping ([`optim`]), TRL-format data
//! ([`data`]) and the training loop with checkpoints and resume ([`trainer`]); the training
//! half of online RL (GRPO/PPO updates from scored groups) is in [`rl`].
//!
//! A step, in outline:
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! use candle_core::{DType, Device};
//! use candle_nn::{AdamW, Optimizer, ParamsAdamW};
//! use collabllm::train::{logps::*, loss::*, model::TrainLlama};
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
pub mod data;
pub(crate) mod error;
pub mod head;
pub mod logps;
pub mod loss;
pub mod model;
pub mod ops;
pub mod optim;
pub mod rl;
pub mod trainer;

pub use error::TrainError;
