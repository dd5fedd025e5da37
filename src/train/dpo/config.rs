//! `dpo_train`'s settings: [`TrainConfig`] (flags and `--config` files map onto it one to one,
//! and it is what `training_args.json` records), the loss it names ([`Objective`]), and the
//! settings `--resume` may not change.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use serde::{Deserialize, Serialize};

use super::loss::{DpoConfig, LossType};
use crate::train::error::{Result, TrainError};
use crate::train::settings::{DpoDefaults, Invalid, LoraOptions, Spelling, TrainerSettings};

/// What to optimise.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Objective {
    Dpo(DpoConfig),
    /// Supervised fine-tuning on prompt + chosen (loss on assistant tokens only).
    Sft,
}

/// `dpo_train`'s default output directory.
pub const DEFAULT_OUTPUT: &str = "outputs/dpo";

/// Everything a run needs; `dpo_train`'s flags map onto it one to one.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    pub data: PathBuf,
    /// Evaluation pairs; default: `test.parquet` beside the training file, if any.
    pub eval_data: Option<PathBuf>,
    pub model: String,
    pub output: PathBuf,
    /// `sigmoid`, `ipo`, `hinge`, `robust` or `sft`.
    pub loss: String,
    pub beta: f64,
    pub label_smoothing: f64,
    /// Weight of an SFT (NLL) term on the chosen completion, TRL's `rpo_alpha`.
    pub sft_weight: f64,
    /// `--loss sft` on conversations (`sft.parquet`): keep only those whose closing reply
    /// scored at least this (its MR); `None` keeps all.
    #[serde(default)]
    pub sft_min_score: Option<f64>,
    pub lora: Option<LoraOptions>,
    pub epochs: usize,
    pub max_steps: Option<usize>,
    /// Train on at most this many training examples (pairs, or SFT conversations): a seeded
    /// sample of the file, in file order, so arms with different pair counts can be matched.
    #[serde(default)]
    pub max_pairs: Option<usize>,
    pub batch_size: usize,
    /// Fill each micro-batch with examples until its tokens come nearest this many, instead
    /// of a fixed `batch_size` count: arms whose examples differ in length then train on the
    /// same tokens in the same steps.
    #[serde(default)]
    pub batch_tokens: Option<usize>,
    pub grad_accum: usize,
    pub max_length: usize,
    pub logging_steps: usize,
    pub eval_steps: Option<usize>,
    /// `f32`, `bf16` or `auto` (bf16 on CUDA, f32 on the CPU).
    pub dtype: String,
    /// The float type of saved checkpoints: `auto` (the source checkpoint's: a bf16 base
    /// stays bf16; f32 for GGUF), `f32`, `bf16` or `f16`.
    #[serde(default = "default_save_dtype")]
    pub save_dtype: String,
    pub resume: bool,
    pub merge: bool,
    /// Use (and write) the reference log-prob cache beside the data.
    pub ref_cache: bool,
    /// With LoRA: write the base model as loaded (an HF folder, `<output>/base/`) and record
    /// that folder as the adapters' base, so an adapter loads alone, offline (the base of
    /// `default` or a GGUF is otherwise named by its Hub id).
    #[serde(default)]
    pub save_base: bool,
    /// Optimizer, schedule, clipping, device, seed and checkpoint settings (flattened: their
    /// keys sit beside the others in files and `training_args.json`).
    #[serde(flatten)]
    pub optim: TrainerSettings<DpoDefaults>,
    /// Stop right after the checkpoint of this step, as if the process were killed there
    /// (tests of `--resume`; `testing` feature).
    #[cfg(any(test, feature = "testing"))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_after: Option<usize>,
    /// Settings (names of [`RESUME_SETTINGS`]) that `--resume` may change from the run's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub resume_override: Vec<String>,
    /// Every setting a resume changed, oldest first (kept across resumes).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub resume_overrides: Vec<ResumeOverride>,
    /// SHA-256 of the training data file, set by [`train`](super::train): `--resume` refuses data whose
    /// content changed under the same path (`--resume-override data-sha256` accepts it).
    #[serde(default)]
    pub data_sha256: Option<String>,
    /// Fingerprint of the model's weight files (the engine's: SHA-256 of their bytes, 16 hex
    /// digits; an adapter's with its base's), set by [`train`](super::train): `--resume`
    /// refuses weights replaced under the same path (`--resume-override model-sha256`
    /// accepts them).
    #[serde(default)]
    pub model_sha256: Option<String>,
}

/// The settings that change a run's math, by flag name: `--resume` refuses to change any of
/// them unless named in `--resume-override`. (Output, device, logging, evaluation, saving and
/// memory settings may change freely.)
pub const RESUME_SETTINGS: &[&str] = &[
    "data",
    "model",
    "loss",
    "beta",
    "label-smoothing",
    "sft-weight",
    "sft-min-score",
    "lora",
    "lr",
    "epochs",
    "max-steps",
    "max-pairs",
    "batch-size",
    "batch-tokens",
    "grad-accum",
    "max-length",
    "warmup-ratio",
    "schedule",
    "max-grad-norm",
    "weight-decay",
    "seed",
    "dtype",
    "data-sha256",
    "model-sha256",
];

/// One setting a `--resume --resume-override` changed, as recorded in `training_args.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ResumeOverride {
    /// The checkpoint step the run resumed from.
    pub step: usize,
    pub setting: String,
    pub previous: serde_json::Value,
    pub now: serde_json::Value,
}

impl TrainConfig {
    /// The project's defaults for `data`, `model` and `output`.
    pub fn new(data: PathBuf, model: &str, output: PathBuf) -> Self {
        Self {
            data,
            eval_data: None,
            model: model.to_string(),
            output,
            loss: "sigmoid".into(),
            beta: 0.1,
            label_smoothing: 0.0,
            sft_weight: 0.0,
            sft_min_score: None,
            lora: None,
            epochs: 1,
            max_steps: None,
            max_pairs: None,
            batch_tokens: None,
            batch_size: 1,
            grad_accum: 1,
            max_length: 1024,
            logging_steps: 1,
            eval_steps: None,
            dtype: "auto".into(),
            save_dtype: default_save_dtype(),
            resume: false,
            merge: false,
            ref_cache: true,
            save_base: false,
            #[cfg(any(test, feature = "testing"))]
            stop_after: None,
            resume_override: Vec::new(),
            resume_overrides: Vec::new(),
            data_sha256: None,
            model_sha256: None,
            optim: TrainerSettings::default(),
        }
    }

    /// Settings a `--config` file may not give: the run's history and the per-invocation
    /// actions (flags only).
    pub const NOT_IN_FILES: &'static [&'static str] = &[
        "resume",
        "resume_override",
        "resume_overrides",
        "data_sha256",
        "model_sha256",
        "stop_after",
    ];

    /// `self` with the settings of a TOML file (keys as in `training_args.json`) laid over it,
    /// except those in `from_flags` (set on the command line: a flag wins over the file). An
    /// unknown key, a key of [`Self::NOT_IN_FILES`] or a value of the wrong type is an error
    /// naming the file and the key. With no `lr` anywhere, the learning rate follows the
    /// final LoRA choice (`lora_lr` with LoRA, `full_lr` without).
    pub fn with_file(
        &self,
        path: &Path,
        from_flags: &std::collections::BTreeSet<String>,
        (full_lr, lora_lr): (f64, f64),
    ) -> Result<TrainConfig> {
        let text = std::fs::read_to_string(path).map_err(TrainError::io("reading", path))?;
        let file: toml::Table = toml::from_str(&text)
            .map_err(|e| TrainError::input(path, format!("not valid TOML: {e}")))?;
        let mut merged = serde_json::to_value(self)?;
        for (key, value) in &file {
            if Self::NOT_IN_FILES.contains(&key.as_str()) {
                return Err(TrainError::input(
                    path,
                    format!("`{key}` is given on the command line only, not in a config file"),
                ));
            }
            // Every setting serializes (None as null), so the config's own keys are the
            // file's.
            if merged.get(key.as_str()).is_none() {
                return Err(TrainError::input(
                    path,
                    format!("unknown setting `{key}` (the keys are those of training_args.json)"),
                ));
            }
            if from_flags.contains(key) {
                continue;
            }
            // JSON has no NaN or infinity: serde_json would turn them into null.
            if has_non_finite(value) {
                return Err(TrainError::input(
                    path,
                    format!(
                        "`{key}` = {}: not a finite number (nan and inf are refused)",
                        shown(value)
                    ),
                ));
            }
            merged[key.as_str()] = serde_json::to_value(value)?;
        }
        let mut cfg: TrainConfig = match serde_json::from_value(merged.clone()) {
            Ok(cfg) => cfg,
            Err(e) => return Err(self.wrong_type(path, &file, &merged, e)),
        };
        if !from_flags.contains("lr") && !file.contains_key("lr") {
            cfg.optim.lr = if cfg.lora.is_some() { lora_lr } else { full_lr };
        }
        Ok(cfg)
    }

    /// The error of a file whose settings do not deserialize, naming the first key that fails
    /// alone on top of `self` (serde's own message names the type, never the key).
    fn wrong_type(
        &self,
        path: &Path,
        file: &toml::Table,
        merged: &serde_json::Value,
        e: serde_json::Error,
    ) -> TrainError {
        let Ok(base) = serde_json::to_value(self) else {
            return TrainError::input(path, format!("a setting has the wrong type: {e}"));
        };
        for (key, value) in file {
            let mut one = base.clone();
            one[key.as_str()] = merged[key.as_str()].clone();
            if let Err(e) = serde_json::from_value::<TrainConfig>(one) {
                return TrainError::input(path, format!("`{key}` = {}: {e}", shown(value)));
            }
        }
        TrainError::input(path, format!("a setting has the wrong type: {e}"))
    }

    pub fn objective(&self) -> Result<Objective> {
        if self.loss == "sft" {
            return Ok(Objective::Sft);
        }
        let loss_type: LossType = self.loss.parse().map_err(|e: String| {
            TrainError::Setting(format!("{e}; or `sft` for supervised fine-tuning"))
        })?;
        let cfg = DpoConfig {
            loss_type,
            beta: self.beta,
            label_smoothing: self.label_smoothing,
        };
        cfg.validate().map_err(TrainError::Setting)?;
        Ok(Objective::Dpo(cfg))
    }

    /// Checks every number once, before any work; errors name the flag and the value.
    pub(crate) fn validate(&self) -> Result<()> {
        use crate::check::{at_least, Range};
        let floats = [
            ("--beta", self.beta, Range::above(0.0)),
            (
                "--label-smoothing",
                self.label_smoothing,
                Range::closed_open(0.0, 0.5),
            ),
            ("--sft-weight", self.sft_weight, Range::at_least(0.0)),
            (
                "--sft-min-score",
                self.sft_min_score.unwrap_or(0.0),
                Range::finite(),
            ),
        ];
        for (flag, v, range) in floats {
            range.check(flag, v).map_err(TrainError::Setting)?;
        }
        let counts = [
            ("--batch-size", Some(self.batch_size)),
            ("--grad-accum", Some(self.grad_accum)),
            ("--max-length", Some(self.max_length)),
            ("--logging-steps", Some(self.logging_steps)),
            ("--epochs", Some(self.epochs)),
            ("--max-steps", self.max_steps),
            ("--max-pairs", self.max_pairs),
            ("--batch-tokens", self.batch_tokens),
            ("--eval-steps", self.eval_steps),
        ];
        for (flag, v) in counts {
            if let Some(v) = v {
                at_least(flag, v, 1).map_err(TrainError::Setting)?;
            }
        }
        if self.batch_tokens.is_some() && self.batch_size != 1 {
            return Err(TrainError::Setting(format!(
                "--batch-tokens and --batch-size {} both size the batch: give one",
                self.batch_size
            )));
        }
        let invalid = |e: Invalid| TrainError::Setting(e.message);
        self.optim.validate(Spelling::Flag).map_err(invalid)?;
        if let Some(l) = &self.lora {
            l.validate(|k| format!("--lora-{k}")).map_err(invalid)?;
        }
        self.objective()?;
        for name in &self.resume_override {
            if !RESUME_SETTINGS.contains(&name.as_str()) {
                return Err(TrainError::Setting(format!(
                    "--resume-override {name}: not a setting of the run's math (one of {})",
                    RESUME_SETTINGS.join(", ")
                )));
            }
        }
        Ok(())
    }
}

fn default_save_dtype() -> String {
    "auto".into()
}

/// `--save-dtype`: `None` keeps the source checkpoint's float type.
pub(crate) fn parse_save_dtype(s: &str) -> Result<Option<DType>> {
    match s {
        "auto" => Ok(None),
        "f32" => Ok(Some(DType::F32)),
        "bf16" => Ok(Some(DType::BF16)),
        "f16" => Ok(Some(DType::F16)),
        _ => Err(TrainError::Setting(format!(
            "unknown save dtype `{s}` (auto, f32, bf16 or f16)"
        ))),
    }
}

pub(crate) fn parse_dtype(s: &str, device: &Device) -> Result<DType> {
    match s {
        "f32" => Ok(DType::F32),
        "bf16" => Ok(DType::BF16),
        "auto" if device.is_cuda() => Ok(DType::BF16),
        "auto" => Ok(DType::F32),
        _ => Err(TrainError::Setting(format!(
            "unknown dtype `{s}` (f32, bf16 or auto)"
        ))),
    }
}

/// Whether a TOML value holds a NaN or infinite float anywhere.
fn has_non_finite(v: &toml::Value) -> bool {
    match v {
        toml::Value::Float(f) => !f.is_finite(),
        toml::Value::Array(a) => a.iter().any(has_non_finite),
        toml::Value::Table(t) => t.values().any(has_non_finite),
        _ => false,
    }
}

/// A file's value as an error shows it: at most 80 bytes (a long value is cut, marked `…`).
fn shown(v: &toml::Value) -> String {
    crate::check::clip(&v.to_string(), 80)
}
