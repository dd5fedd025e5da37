//! The settings every trainer shares — optimizer, schedule, clipping, LoRA, device, seed and
//! checkpointing — defined, ranged and checked here once. `dpo_train`'s
//! [`TrainConfig`](super::dpo::TrainConfig) and `rl_train`'s
//! [`RlRunConfig`](super::rl::config::RlRunConfig) embed [`TrainerSettings`] flattened, so
//! their files keep one flat list of keys (`lr`, `weight_decay`, …); each trainer only picks
//! its defaults ([`DpoDefaults`], [`RlDefaults`]).

use std::fmt::Debug;
use std::marker::PhantomData;

use candle_core::Device;
use serde::{Deserialize, Serialize};

use crate::check::Range;
use crate::engine::peft::{AdapterConfig, LORA_TARGETS};

use super::error::{Result, TrainError};

/// Learning rate.
pub const LR: Range = Range::above(0.0);
/// AdamW's decoupled weight decay (PyTorch and TRL put no upper bound on it).
pub const WEIGHT_DECAY: Range = Range::at_least(0.0);
/// Gradient-norm clipping; 0 turns clipping off (HF `Trainer` clips only when > 0).
pub const MAX_GRAD_NORM: Range = Range::at_least(0.0);
/// Share of the optimizer steps spent warming the rate up linearly from 0.
pub const WARMUP_RATIO: Range = Range::closed_open(0.0, 1.0);
pub const LORA_ALPHA: Range = Range::above(0.0);
pub const LORA_DROPOUT: Range = Range::closed_open(0.0, 1.0);
/// LoRA rank: far above any useful rank, far below what overflows an allocation.
pub const MAX_LORA_R: usize = 4096;
/// The learning rate of a LoRA run that names none: adapters need a larger rate than full
/// fine-tuning.
pub const LORA_LR: f64 = 2e-5;

/// Learning-rate schedule over a run's optimizer steps, after a linear warmup.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Schedule {
    Cosine,
    Linear,
    Constant,
}

impl Schedule {
    /// Learning-rate multiplier for the update after `step` completed updates (HF schedules
    /// with linear warmup).
    pub fn factor(self, step: usize, total: usize, warmup: usize) -> f64 {
        if step < warmup {
            return step as f64 / warmup.max(1) as f64;
        }
        let progress = (step - warmup) as f64 / total.saturating_sub(warmup).max(1) as f64;
        match self {
            Schedule::Cosine => super::optim::cosine_with_warmup(step, total, warmup),
            Schedule::Linear => (1.0 - progress).max(0.0),
            Schedule::Constant => 1.0,
        }
    }
}

/// LoRA adapters: rank, scale, dropout and the projections they wrap.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LoraOptions {
    pub r: usize,
    pub alpha: f64,
    pub dropout: f64,
    pub targets: Vec<String>,
}

impl Default for LoraOptions {
    fn default() -> Self {
        Self {
            r: 32,
            alpha: 16.0,
            dropout: 0.0,
            targets: LORA_TARGETS.iter().map(|t| t.to_string()).collect(),
        }
    }
}

impl LoraOptions {
    /// Checks rank, alpha and dropout; `name("r")` spells a setting as the caller's users
    /// know it (`--lora-r`, `lora_r`).
    pub fn validate(&self, name: impl Fn(&str) -> String) -> std::result::Result<(), Invalid> {
        in_range_count(&name("r"), self.r, 1, MAX_LORA_R)?;
        check_float(&name("alpha"), self.alpha, LORA_ALPHA)?;
        check_float(&name("dropout"), self.dropout, LORA_DROPOUT)
    }

    /// The PEFT adapter config of these options over the base model named `base`.
    pub fn adapter_config(&self, base: &str) -> AdapterConfig {
        let targets: Vec<&str> = self.targets.iter().map(String::as_str).collect();
        AdapterConfig::lora(self.r, self.alpha, self.dropout, &targets, base)
    }
}

/// A setting out of its range: the setting as the user spells it, and the message (which
/// names it and the value).
#[derive(Debug, Clone, PartialEq)]
pub struct Invalid {
    pub setting: String,
    pub message: String,
}

fn check_float(setting: &str, v: f64, range: Range) -> std::result::Result<(), Invalid> {
    range
        .check(setting, v)
        .map(|_| ())
        .map_err(|message| Invalid {
            setting: setting.to_string(),
            message,
        })
}

fn in_range_count(
    setting: &str,
    v: usize,
    min: usize,
    max: usize,
) -> std::result::Result<(), Invalid> {
    crate::check::in_range(setting, v, min, max)
        .map(|_| ())
        .map_err(|message| Invalid {
            setting: setting.to_string(),
            message,
        })
}

/// How a trainer's users spell its settings in errors: `dpo_train` by flag
/// (`--max-grad-norm`), `rl_train` by config key (`max_grad_norm`, as its files and
/// `training_args.json` do).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spelling {
    Flag,
    Key,
}

impl Spelling {
    pub fn name(self, key: &str) -> String {
        match self {
            Spelling::Flag => format!("--{}", key.replace('_', "-")),
            Spelling::Key => key.to_string(),
        }
    }
}

/// A trainer's defaults for the shared settings.
pub trait TrainerDefaults: Clone + Debug + PartialEq + Default + Send + Sync + 'static {
    const LR: f64;
    const WEIGHT_DECAY: f64;
    const MAX_GRAD_NORM: f64;
    const WARMUP_RATIO: f64;
    const SCHEDULE: Schedule;
    const SEED: u64;
}

/// `dpo_train`'s defaults (TRL's DPO trainer, with a warmed-up cosine schedule).
#[derive(Clone, Debug, PartialEq, Default)]
pub struct DpoDefaults;

impl TrainerDefaults for DpoDefaults {
    const LR: f64 = 5e-6;
    const WEIGHT_DECAY: f64 = 0.0;
    const MAX_GRAD_NORM: f64 = 1.0;
    const WARMUP_RATIO: f64 = 0.1;
    const SCHEDULE: Schedule = Schedule::Cosine;
    const SEED: u64 = 42;
}

/// `rl_train`'s defaults (verl's actor: constant rate, weight decay 0.01).
#[derive(Clone, Debug, PartialEq, Default)]
pub struct RlDefaults;

impl TrainerDefaults for RlDefaults {
    const LR: f64 = 1e-6;
    const WEIGHT_DECAY: f64 = 0.01;
    const MAX_GRAD_NORM: f64 = 1.0;
    const WARMUP_RATIO: f64 = 0.0;
    const SCHEDULE: Schedule = Schedule::Constant;
    const SEED: u64 = 0;
}

/// The optimizer, schedule, clipping, memory, device, seed and checkpoint settings of a
/// training run. Keys missing from a file take the trainer's defaults `D`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TrainerSettings<D: TrainerDefaults> {
    /// Peak learning rate (AdamW).
    pub lr: f64,
    pub weight_decay: f64,
    /// Clip the gradient's global norm to this; 0: no clipping.
    pub max_grad_norm: f64,
    pub warmup_ratio: f64,
    pub schedule: Schedule,
    /// Recompute each layer's activations in the backward pass (less memory, about one more
    /// forward pass of compute).
    pub gradient_checkpointing: bool,
    pub seed: u64,
    /// Compute device: `cpu`, `cuda` or `cuda:N`.
    pub device: String,
    /// Save a checkpoint every N optimizer steps (none: only the final model).
    pub save_steps: Option<usize>,
    /// Which trainer's defaults fill missing keys (a marker; public so that
    /// `TrainerSettings { lr, ..Default::default() }` works outside the crate).
    #[serde(skip)]
    pub defaults: PhantomData<D>,
}

impl<D: TrainerDefaults> Default for TrainerSettings<D> {
    fn default() -> Self {
        Self {
            lr: D::LR,
            weight_decay: D::WEIGHT_DECAY,
            max_grad_norm: D::MAX_GRAD_NORM,
            warmup_ratio: D::WARMUP_RATIO,
            schedule: D::SCHEDULE,
            gradient_checkpointing: false,
            seed: D::SEED,
            device: "cpu".into(),
            save_steps: None,
            defaults: PhantomData,
        }
    }
}

impl<D: TrainerDefaults> TrainerSettings<D> {
    /// Checks every number once, before any work; the error names the setting as `spelling`
    /// writes it, and the value.
    pub fn validate(&self, spelling: Spelling) -> std::result::Result<(), Invalid> {
        let name = |key: &str| spelling.name(key);
        check_float(&name("lr"), self.lr, LR)?;
        check_float(&name("weight_decay"), self.weight_decay, WEIGHT_DECAY)?;
        check_float(&name("max_grad_norm"), self.max_grad_norm, MAX_GRAD_NORM)?;
        check_float(&name("warmup_ratio"), self.warmup_ratio, WARMUP_RATIO)?;
        if let Some(n) = self.save_steps {
            in_range_count(&name("save_steps"), n, 1, usize::MAX)?;
        }
        parse_device(&self.device).map_err(|e| Invalid {
            setting: name("device"),
            message: e.to_string(),
        })?;
        Ok(())
    }

    /// The learning rate after `step` completed optimizer steps of `total`.
    pub fn lr_at(&self, step: usize, total: usize) -> f64 {
        let warmup = super::optim::warmup_steps(total, self.warmup_ratio);
        self.lr * self.schedule.factor(step, total, warmup)
    }
}

/// `cpu`, `cuda` or `cuda:N`.
pub fn parse_device(s: &str) -> Result<Device> {
    match s {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Device::new_cuda(0).map_err(|source| TrainError::Device {
            device: s.to_string(),
            source,
        }),
        _ => {
            let n = s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse::<usize>().ok())
                .ok_or_else(|| {
                    TrainError::Setting(format!("unknown device `{s}` (cpu, cuda or cuda:N)"))
                })?;
            Device::new_cuda(n).map_err(|source| TrainError::Device {
                device: s.to_string(),
                source,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_keys_take_the_trainers_own_defaults() {
        let dpo: TrainerSettings<DpoDefaults> = toml::from_str("seed = 7").unwrap();
        let rl: TrainerSettings<RlDefaults> = toml::from_str("seed = 7").unwrap();
        assert_eq!(
            (dpo.lr, dpo.schedule, dpo.seed),
            (5e-6, Schedule::Cosine, 7)
        );
        assert_eq!((rl.lr, rl.weight_decay, rl.seed), (1e-6, 0.01, 7));
    }

    #[test]
    fn errors_spell_the_setting_as_the_trainer_does() {
        let bad = TrainerSettings::<DpoDefaults> {
            max_grad_norm: -1.0,
            ..Default::default()
        };
        let flag = bad.validate(Spelling::Flag).unwrap_err();
        assert_eq!(
            flag.message,
            "--max-grad-norm -1.0: must be a finite number >= 0"
        );
        let key = bad.validate(Spelling::Key).unwrap_err();
        assert_eq!(key.setting, "max_grad_norm");
        let zero_lr = TrainerSettings::<RlDefaults> {
            lr: 0.0,
            ..Default::default()
        };
        assert!(zero_lr.validate(Spelling::Key).is_err());
        let lora = LoraOptions {
            r: MAX_LORA_R + 1,
            ..Default::default()
        };
        let err = lora.validate(|k| format!("lora_{k}")).unwrap_err();
        assert_eq!(err.setting, "lora_r");
    }
}
