//! The resolved configuration of an `rl_train` run: defaults ← `--config` TOML ← flags,
//! validated once at start-up, before any model loads or any rollout starts.
//!
//! The rollout side is generate_conv's: the same embedded [`RolloutConfig`] (user, judges,
//! endpoints, sandbox) with its one check, and tasks read from the same [`TaskSource`] kinds,
//! so both binaries read tasks and judge replies the same way.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::advantage::Estimator;
use super::loss::{LossAgg, PpoConfig};
use super::step::RlConfig;
use crate::check::Range;
use crate::engine::llama::WeightFormat;
use crate::engine::peft::LORA_TARGETS;
use crate::llm::tokens::TokenCounterKind;
use crate::llm::ModelSpec;
use crate::reward::judge::InteractivityScale;
use crate::reward::mr::MrFormula;
use crate::reward::pairs::PairMode;
use crate::rollout::config::{
    check_future_questioner, check_futures, check_sampling, check_task_source, Compat,
    CompatRecord, ConfigError, RolloutConfig, UnknownKeys, DEFAULT_TASKS,
};
use crate::rollout::user::{Sampling, TokenRole};
use crate::task::source::TaskSource;
use crate::task::twenty_questions::chat::OracleMode;
use crate::task::twenty_questions::future::FutureQuestioner;
use crate::task::TaskType;
use crate::train::dpo::loss::DpoConfig;
use crate::train::settings::{
    Invalid, LoraOptions, RlDefaults, Schedule, Spelling, TrainerSettings,
};

/// KL coefficient (0 turns the reference model off).
pub const KL_COEF: Range = Range::closed(0.0, 1e3);
/// PPO clip range ε (ratio clipped to [1 − ε, 1 + ε]).
pub const CLIP_RATIO: Range = Range::open_closed(0.0, 1.0);
/// Dual-clip bound c for negative advantages.
pub const CLIP_RATIO_C: Range = Range::above(1.0);
pub const ENTROPY_COEF: Range = Range::closed(0.0, 1e3);
/// Sampling temperature of the policy: positive (greedy responses of a group are identical
/// and carry no signal).
pub const TEMPERATURE: Range = Range::open_closed(0.0, 10.0);
pub const TOP_P: Range = Sampling::TOP_P;
/// Temperature of the policy inside futures: 0 (greedy) or more.
pub const FUTURE_TEMPERATURE: Range = Range::closed(0.0, 10.0);
/// Online DPO: β and the minimum MR gap of a pair.
pub const BETA: Range = Range::above(0.0);
pub use crate::reward::pairs::MIN_GAP;
/// Share of a step's prompts that start one exchange later: a probability.
pub const CONTINUE_RATE: Range = Range::closed(0.0, 1.0);

/// What the update does with a group of scored responses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Algo {
    /// Clipped surrogate with (R − mean)/(std + 1e-6) advantages (the verl recipe).
    #[default]
    Grpo,
    /// Clipped surrogate with R − mean advantages (no std division).
    Drgrpo,
    /// Clipped surrogate with leave-one-out baselines.
    Rloo,
    /// Best vs worst MR of each group (above the gap) as one DPO pair, trained the same step.
    OnlineDpo,
}

impl Algo {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Grpo => "grpo",
            Self::Drgrpo => "drgrpo",
            Self::Rloo => "rloo",
            Self::OnlineDpo => "online_dpo",
        }
    }

    /// The advantage estimator of the policy-gradient algorithms.
    pub fn estimator(self) -> Option<Estimator> {
        match self {
            Self::Grpo => Some(Estimator::Grpo),
            Self::Drgrpo => Some(Estimator::DrGrpo),
            Self::Rloo => Some(Estimator::Rloo),
            Self::OnlineDpo => None,
        }
    }
}

/// What a response cut at `--max-new-tokens` is worth.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum TruncatedReward {
    /// Its futures are played and scored like any other response's.
    #[default]
    Futures,
    /// No futures are played and its reward is 0 (the verl recipe: an unfinished reply
    /// never earns by running long).
    Zero,
}

impl TruncatedReward {
    /// Whether a response that ended this way scores 0 without futures.
    pub fn zeroes(self, finish: crate::llm::FinishReason) -> bool {
        self == Self::Zero && finish == crate::llm::FinishReason::Length
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Futures => "futures",
            Self::Zero => "zero",
        }
    }
}

/// Where a step's prompts come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Opening {
    /// The simulated user opens each conversation from the task's hidden goal.
    #[default]
    User,
    /// The task's prompt is the user's first message, verbatim (a fixed prompt set, as TRL's
    /// GRPOTrainer reads one; no simulator call).
    Task,
    /// The conversation prefixes of an upstream flat dataset (its `prompt` column: every
    /// turn of every conversation), as the verl recipe trains on them.
    Dataset,
}

impl FromStr for Opening {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "user" => Ok(Self::User),
            "task" => Ok(Self::Task),
            "dataset" => Ok(Self::Dataset),
            other => Err(format!(
                "unknown --opening {other:?} (expected user, task or dataset)"
            )),
        }
    }
}

impl fmt::Display for Algo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Algo {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "grpo" => Ok(Self::Grpo),
            "drgrpo" | "dr_grpo" | "dr-grpo" => Ok(Self::Drgrpo),
            "rloo" => Ok(Self::Rloo),
            "online_dpo" | "online-dpo" => Ok(Self::OnlineDpo),
            other => Err(format!(
                "unknown --algo {other:?} (expected grpo, drgrpo, rloo or online_dpo)"
            )),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RlRunConfig {
    /// Tasks (as generate_conv reads them: JSONL, parquet, upstream flat parquet, `hf:`).
    pub tasks: String,
    pub task_type: Option<TaskType>,
    /// Use only the first K tasks.
    pub max_tasks: Option<usize>,
    /// Held-out tasks scored every `eval_every` steps (one response each).
    pub eval_tasks: Option<String>,
    pub eval_every: Option<usize>,
    /// Use only the first K held-out tasks.
    pub eval_max_tasks: Option<usize>,
    /// Run directory: logs.jsonl, rollouts.jsonl, checkpoints, final/, request cache.
    pub output: PathBuf,
    /// The model trained (local weights: `default`, a .gguf file, an HF directory or id).
    pub model: String,
    /// Prompts per step (B).
    pub batch_prompts: usize,
    /// Responses sampled per prompt (n).
    pub group_size: usize,
    /// Who writes the prompt: the simulated user, or the task's prompt verbatim.
    pub opening: Opening,
    /// Futures per response (S); 0 scores each response alone (single-turn reward).
    pub samples: usize,
    /// Messages per future, the user's first one included.
    pub window: usize,
    /// Longest sampled response (and assistant turn inside a future), in tokens.
    pub max_new_tokens: usize,
    pub temperature: f64,
    pub top_p: f64,
    /// Temperature of the policy's replies inside futures; `None`: `temperature`. A lower one
    /// makes a response's one-future reward less of a coin toss (GRPO's normalised
    /// advantages weigh a lone failed future as much as a lone success).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub future_temperature: Option<f64>,
    pub max_steps: usize,
    /// Metric weights; empty = the task type's defaults.
    pub metrics: BTreeMap<String, f64>,
    pub mr_formula: MrFormula,
    pub algo: Algo,
    pub kl_coef: f64,
    pub clip_ratio: f64,
    pub clip_ratio_c: f64,
    pub entropy_coef: f64,
    pub loss_agg: String,
    pub ppo_epochs: usize,
    /// Responses per optimizer step; 0: the whole step's responses.
    pub mini_batch: usize,
    /// Prompts per optimizer step, as verl's `ppo_mini_batch_size` counts them (each brings
    /// its group); when set it replaces `mini_batch`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ppo_mini_batch: Option<usize>,
    /// Responses per forward/backward pass; 0: the whole mini-batch.
    pub micro_batch: usize,
    /// Longest prompt + response that trains, in tokens.
    pub max_length: usize,
    /// Online DPO: β and the minimum MR gap between best and worst.
    pub beta: f64,
    pub min_gap: f64,
    /// Online DPO: which pair a group yields (best vs worst, or action contrast).
    #[serde(default)]
    pub pairs: PairMode,
    /// Each step's prompts drawn evenly from the values of this task metadata field (e.g.
    /// `stated`: as many stated as vague clarify requests), each value's tasks in their own
    /// seeded epochs; `None`: one shuffled order over all tasks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub balance_by: Option<String>,
    /// Share of a step's prompts that start one exchange later: the current policy replies
    /// to the opening once and, where the simulated user answers rather than ends, the group
    /// answers that (so later turns, e.g. "answer now that the detail is given", train on
    /// the states the policy itself reaches); 0: every prompt is an opening.
    #[serde(default)]
    pub continue_rate: f64,
    /// LoRA rank; none = full fine-tuning.
    pub lora_r: Option<usize>,
    pub lora_alpha: f64,
    pub lora_targets: Vec<String>,
    /// How the sampler holds the synced weights: auto (q8 on the CPU, f32 elsewhere), f32, q8.
    pub sampler_weights: String,
    /// 20 Questions tasks: who answers the questions (table, llm = the user model, hybrid).
    pub oracle: OracleMode,
    /// 20 Questions tasks: each prompt is a game after a demonstrator prefix of 0..=N
    /// questions (drawn per prompt and step); 0 = the opening only.
    #[serde(default)]
    pub midgame: usize,
    /// Train on groups whose rewards differ only in token counts (skipped by default).
    #[serde(default)]
    pub keep_length_only_groups: bool,
    /// How `token_amount` counts: the policy's tokens of the assistant turns, cl100k, or
    /// verl's words of every message after the prompt.
    #[serde(default)]
    pub token_counter: TokenCounterKind,
    /// What a response cut at `max_new_tokens` is worth: its futures' score, or 0 with no
    /// futures (verl).
    #[serde(default)]
    pub truncated: TruncatedReward,
    /// The `--compat` preset applied, and every value it set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compat: Option<CompatRecord>,
    /// SHA-256 of the loaded training (and evaluation) tasks, set by rl_train: `--resume`
    /// refuses a run whose task file changed under the same path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tasks_sha256: Option<String>,
    /// Fingerprint of the policy's weight files (the engine's: SHA-256 of their bytes, 16 hex
    /// digits), set by rl_train: `--resume` refuses weights replaced under the same path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_sha256: Option<String>,
    /// Optimizer, schedule, clipping, device, seed and checkpoint settings, shared with
    /// dpo_train (top-level keys, as all the others).
    #[serde(flatten)]
    pub optim: TrainerSettings<RlDefaults>,
    /// The settings every rollout shares (top-level keys, as all the others).
    #[serde(flatten)]
    pub rollout: RolloutConfig,
    /// Keys of the config file that no setting has: an error at load.
    #[serde(flatten, skip_serializing)]
    pub unknown_keys: UnknownKeys,
}

impl Default for RlRunConfig {
    fn default() -> Self {
        Self {
            tasks: DEFAULT_TASKS.into(),
            task_type: None,
            max_tasks: None,
            eval_tasks: None,
            eval_every: None,
            eval_max_tasks: None,
            output: PathBuf::from("outputs/rl"),
            model: "default".into(),
            batch_prompts: 2,
            group_size: 8,
            opening: Opening::User,
            samples: 3,
            window: 4,
            max_new_tokens: 256,
            temperature: 0.7,
            top_p: 0.9,
            future_temperature: None,
            max_steps: 50,
            metrics: BTreeMap::new(),
            mr_formula: MrFormula::Mean,
            algo: Algo::Grpo,
            kl_coef: 0.001,
            clip_ratio: 0.2,
            clip_ratio_c: 3.0,
            entropy_coef: 0.0,
            loss_agg: LossAgg::TokenMean.as_str().into(),
            ppo_epochs: 1,
            mini_batch: 0,
            micro_batch: 4,
            max_length: 2048,
            beta: 0.1,
            min_gap: 0.02,
            pairs: PairMode::Best,
            balance_by: None,
            continue_rate: 0.0,
            lora_r: None,
            lora_alpha: 16.0,
            lora_targets: LORA_TARGETS.map(String::from).to_vec(),
            sampler_weights: "auto".into(),
            oracle: OracleMode::default(),
            midgame: 0,
            keep_length_only_groups: false,
            token_counter: TokenCounterKind::default(),
            truncated: TruncatedReward::default(),
            compat: None,
            ppo_mini_batch: None,
            tasks_sha256: None,
            model_sha256: None,
            optim: TrainerSettings::default(),
            rollout: RolloutConfig::default(),
            unknown_keys: UnknownKeys::default(),
        }
    }
}

fn invalid(field: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        message: message.into(),
    }
}

fn check(field: &str, v: f64, range: Range) -> Result<(), ConfigError> {
    range
        .check(field, v)
        .map(|_| ())
        .map_err(|m| invalid(field, m))
}

fn at_least(field: &str, v: usize, min: usize) -> Result<(), ConfigError> {
    crate::check::at_least(field, v, min)
        .map(|_| ())
        .map_err(|m| invalid(field, m))
}

fn in_range(field: &str, v: usize, min: usize, max: usize) -> Result<(), ConfigError> {
    crate::check::in_range(field, v, min, max)
        .map(|_| ())
        .map_err(|m| invalid(field, m))
}

/// Upper bounds of the size settings: generous for any real run, far below what overflows
/// an allocation (`--group-size 99999999999` asked for 2.4 TB after the model loaded).
const MAX_GROUP: usize = 1024;
const MAX_BATCH_PROMPTS: usize = 65_536;
const MAX_SAMPLES: usize = 64;
const MAX_LENGTH: usize = 1 << 20;
const MAX_EPOCHS: usize = 1000;

/// Settings that may change when a run resumes: they decide how long it runs, where it
/// writes and how it talks to endpoints, never what a step computes.
pub const RESUMABLE_CHANGES: &[&str] = &[
    "output",
    "max_steps",
    "save_steps",
    "threads",
    "concurrency",
    "endpoint",
    "prices",
    "eval_every",
];

impl RlRunConfig {
    pub fn from_toml_file(path: &Path) -> Result<Self, ConfigError> {
        crate::rollout::config::from_toml_file(path, |c: &Self| &c.unknown_keys).map_err(|e| {
            // The trainer settings are read through serde's flatten buffer too: read on their
            // own, their error names the key and the line.
            let text = std::fs::read_to_string(path).unwrap_or_default();
            match toml::from_str::<TrainerSettings<RlDefaults>>(&text) {
                Err(own) => ConfigError::File {
                    path: path.to_path_buf(),
                    message: own.to_string(),
                },
                Ok(_) => e,
            }
        })
    }

    /// Per-role token caps (`--max-tokens ROLE=N`). The policy and the assistant inside
    /// futures are the same model being trained, so both set `max_new_tokens`.
    pub fn set_max_tokens(&mut self, caps: &[(TokenRole, usize)]) {
        for &(role, n) in caps {
            match role {
                TokenRole::Policy | TokenRole::Assistant => self.max_new_tokens = n,
                TokenRole::User => self.rollout.user_sampling.max_tokens = n,
                TokenRole::Judge => self.rollout.judge_max_tokens = n,
                TokenRole::Extractor => self.rollout.extractor_max_tokens = n,
            }
        }
    }

    /// The policy's sampling (also the assistant's inside futures: the same current policy).
    pub fn policy_sampling(&self) -> Sampling {
        Sampling {
            temperature: self.temperature as f32,
            top_p: self.top_p as f32,
            max_tokens: self.max_new_tokens,
        }
    }

    /// The policy's sampling inside futures: `future_temperature` when set.
    pub fn future_sampling(&self) -> Sampling {
        Sampling {
            temperature: self.future_temperature.unwrap_or(self.temperature) as f32,
            ..self.policy_sampling()
        }
    }

    /// Where the training tasks come from.
    pub fn task_source(&self) -> TaskSource {
        TaskSource::new(&self.tasks, self.task_type, self.max_tasks, &self.metrics)
    }

    /// Where the held-out tasks come from (same metrics, other tasks), if any.
    pub fn eval_task_source(&self) -> Option<TaskSource> {
        Some(TaskSource {
            tasks: self.eval_tasks.clone()?,
            max_tasks: self.eval_max_tasks,
            ..self.task_source()
        })
    }

    /// Sets the values of the `--compat` preset (applied after the config file and before
    /// the other flags, so a flag still wins) and records every value it set.
    pub fn apply_compat(&mut self, preset: Compat) -> Result<(), ConfigError> {
        if preset != Compat::Verl {
            return Err(invalid(
                "compat",
                format!(
                    "{preset}: upstream CollabLLM trains offline (DPO); rl_train follows \
                     only the verl recipe (--compat verl)"
                ),
            ));
        }
        let mut set = BTreeMap::new();
        // A setting is recorded by its name in the config file: the last part of its path.
        macro_rules! put {
            ($($($path:ident).+ = $v:expr),* $(,)?) => {$(
                self.$($path).+ = $v;
                let path = stringify!($($path).+);
                set.insert(
                    path.rsplit('.').next().unwrap_or(path).trim().to_string(),
                    serde_json::to_value(&self.$($path).+).unwrap_or_default(),
                );
            )*};
        }
        // recipe/collabllm/train_rl_collabllm.sh and verl's actor defaults: GRPO with a
        // low-variance KL loss, 16 prompts × 8 responses a step in mini-batches of 8
        // prompts, sampling at temperature 1, 2048-token responses after prompts of up to
        // 8196; the reward clamps each weighted metric to ±1, judges interactivity on the
        // recipe's rubric and counts the words of everything after the prompt; a truncated
        // response plays no futures and scores 0.
        put!(
            algo = Algo::Grpo,
            optim.lr = 1e-6,
            kl_coef = 0.001,
            entropy_coef = 0.0,
            clip_ratio = 0.2,
            clip_ratio_c = 3.0,
            loss_agg = LossAgg::TokenMean.as_str().to_string(),
            optim.weight_decay = 0.01,
            optim.max_grad_norm = 1.0,
            optim.schedule = Schedule::Constant,
            optim.warmup_ratio = 0.0,
            ppo_epochs = 1,
            batch_prompts = 16,
            group_size = 8,
            ppo_mini_batch = Some(8),
            mini_batch = 0,
            temperature = 1.0,
            top_p = 1.0,
            max_new_tokens = 2048,
            max_length = 8196 + 2048,
            samples = 3,
            window = 4,
            rollout.judge_max_tokens = 2048,
            mr_formula = MrFormula::VerlClamp,
            rollout.interactivity_scale = InteractivityScale::Verl,
            token_counter = TokenCounterKind::Words,
            truncated = TruncatedReward::Zero,
        );
        self.compat = Some(CompatRecord { preset, set });
        Ok(())
    }

    /// The LoRA adapters trained (`lora_r` set), in the shared form.
    pub fn lora(&self) -> Option<LoraOptions> {
        self.lora_r.map(|r| LoraOptions {
            r,
            alpha: self.lora_alpha,
            dropout: 0.0,
            targets: self.lora_targets.clone(),
        })
    }

    /// Responses per optimizer step (0: the whole step): `ppo_mini_batch` prompts' groups
    /// when set, else `mini_batch`.
    pub fn mini_batch_responses(&self) -> usize {
        self.ppo_mini_batch
            .map_or(self.mini_batch, |p| p * self.group_size)
    }

    pub fn loss_agg(&self) -> Result<LossAgg, ConfigError> {
        self.loss_agg.parse().map_err(|e| invalid("loss_agg", e))
    }

    pub fn weight_format(&self) -> Result<WeightFormat, ConfigError> {
        match self.sampler_weights.as_str() {
            "auto" if self.optim.device == "cpu" => Ok(WeightFormat::Q8_0),
            "auto" | "f32" => Ok(WeightFormat::F32),
            "q8" => Ok(WeightFormat::Q8_0),
            other => Err(invalid(
                "sampler_weights",
                format!("{other:?}: expected auto, f32 or q8"),
            )),
        }
    }

    /// The update's hyper-parameters.
    pub fn rl_config(&self) -> Result<RlConfig, ConfigError> {
        Ok(RlConfig {
            ppo: PpoConfig {
                clip_low: self.clip_ratio,
                clip_high: self.clip_ratio,
                clip_ratio_c: Some(self.clip_ratio_c),
                kl_coef: self.kl_coef,
                entropy_coef: self.entropy_coef,
                agg: self.loss_agg()?,
                norm_len: self.max_new_tokens,
            },
            estimator: self.algo.estimator().unwrap_or_default(),
            ppo_epochs: self.ppo_epochs,
            mini_batch: self.mini_batch_responses(),
            micro_batch: self.micro_batch,
            optim: self.optim.clone(),
            total_steps: self.optimizer_steps(),
            max_length: self.max_length,
            skip_length_only: !self.keep_length_only_groups,
            dpo: (self.algo == Algo::OnlineDpo).then_some(DpoConfig {
                beta: self.beta,
                ..DpoConfig::default()
            }),
        })
    }

    /// Optimizer steps of the whole run, for the schedule: every rollout batch of B·n
    /// responses makes `ppo_epochs` passes of ⌈B·n / mini_batch⌉ steps (responses dropped as
    /// too long can make a step's count smaller; the schedule then ends a little early).
    pub fn optimizer_steps(&self) -> usize {
        let responses = self.batch_prompts * self.group_size;
        let per_pass = match self.mini_batch_responses() {
            0 => 1,
            m => responses.div_ceil(m),
        };
        self.max_steps * self.ppo_epochs * per_pass
    }

    /// Checks every setting once; the error names the setting and the value.
    pub fn validate(&self) -> Result<(), ConfigError> {
        at_least("batch_prompts", self.batch_prompts, 1)?;
        if self.group_size < 2 {
            return Err(invalid(
                "group_size",
                format!(
                    "{}: {} needs at least 2 responses per prompt (a group of one has no \
                     baseline to compare with)",
                    self.group_size, self.algo
                ),
            ));
        }
        in_range("group_size", self.group_size, 2, MAX_GROUP)?;
        in_range("batch_prompts", self.batch_prompts, 1, MAX_BATCH_PROMPTS)?;
        in_range("samples", self.samples, 0, MAX_SAMPLES)?;
        at_least("max_steps", self.max_steps, 1)?;
        at_least("ppo_epochs", self.ppo_epochs, 1)?;
        in_range("ppo_epochs", self.ppo_epochs, 1, MAX_EPOCHS)?;
        in_range("max_length", self.max_length, 2, MAX_LENGTH)?;
        // A response is dropped when prompt + response exceed max_length: a longer cap only
        // wastes generation.
        in_range("max_new_tokens", self.max_new_tokens, 1, self.max_length)?;
        if self.eval_every == Some(0) {
            return Err(invalid("eval_every", "0: must be at least 1"));
        }
        if self.eval_every.is_some() && self.eval_tasks.is_none() {
            return Err(invalid("eval_every", "needs held-out tasks (--eval-tasks)"));
        }
        let settings = |e: Invalid| invalid(&e.setting, e.message);
        self.optim.validate(Spelling::Key).map_err(settings)?;
        if let Some(lora) = self.lora() {
            lora.validate(|k| format!("lora_{k}")).map_err(settings)?;
        }
        if let Some(m) = self.ppo_mini_batch {
            if self.mini_batch != 0 {
                return Err(invalid(
                    "ppo_mini_batch",
                    format!(
                        "{m} prompts and mini_batch {} responses both set: give one",
                        self.mini_batch
                    ),
                ));
            }
            if m == 0 || m > self.batch_prompts {
                return Err(invalid(
                    "ppo_mini_batch",
                    format!(
                        "{m}: must be between 1 and --batch-prompts ({}); verl likewise \
                         needs ppo_mini_batch_size <= train_batch_size",
                        self.batch_prompts
                    ),
                ));
            }
        }
        check("kl_coef", self.kl_coef, KL_COEF)?;
        check("clip_ratio", self.clip_ratio, CLIP_RATIO)?;
        check("clip_ratio_c", self.clip_ratio_c, CLIP_RATIO_C)?;
        check("entropy_coef", self.entropy_coef, ENTROPY_COEF)?;
        check("temperature", self.temperature, TEMPERATURE)?;
        if let Some(t) = self.future_temperature {
            check("future_temperature", t, FUTURE_TEMPERATURE)?;
        }
        check("top_p", self.top_p, TOP_P)?;
        check("beta", self.beta, BETA)?;
        check("min_gap", self.min_gap, MIN_GAP)?;
        check("continue_rate", self.continue_rate, CONTINUE_RATE)?;
        if self
            .balance_by
            .as_deref()
            .is_some_and(|f| f.trim().is_empty())
        {
            return Err(invalid("balance_by", "an empty field name"));
        }
        if self.pairs != PairMode::Best && self.algo != Algo::OnlineDpo {
            return Err(invalid(
                "pairs",
                format!("{}: only online_dpo makes pairs", self.pairs.as_str()),
            ));
        }
        let spec: ModelSpec = self
            .model
            .parse()
            .map_err(|e: crate::llm::spec::SpecError| invalid("model", e.to_string()))?;
        if !spec.is_local() {
            return Err(invalid(
                "model",
                format!("{spec}: training needs local weights, not an API endpoint"),
            ));
        }
        self.weight_format()?;
        self.rl_config()?
            .validate()
            .map_err(|e| invalid("rl", e.to_string()))?;
        // The trained model plays the policy and the assistant inside futures. `samples = 0`
        // (no futures, the single-turn reward) is rl_train's own, so the shared check sees
        // at least 1.
        self.unknown_keys.check()?;
        check_task_source(&self.task_source())?;
        check_futures(self.samples.max(1), self.window)?;
        // The trained policy plays the futures' assistant unless the demonstrator asks.
        check_future_questioner(
            self.rollout.future_questioner,
            self.task_source().plays_twenty_questions(),
            false,
        )?;
        self.rollout.validate()?;
        check_sampling("policy_sampling", &self.policy_sampling())?;
        if let Some(eval) = self.eval_task_source() {
            check_task_source(&eval)?;
        }
        Ok(())
    }

    /// The settings a resumed run must share with the run it continues.
    pub fn identity(&self) -> serde_json::Value {
        let mut v = serde_json::to_value(self).unwrap_or_default();
        if let Some(o) = v.as_object_mut() {
            for k in RESUMABLE_CHANGES {
                o.remove(*k);
            }
            // Only when not the default, so runs made before the settings existed resume.
            if self.oracle == OracleMode::default() {
                o.remove("oracle");
            }
            if self.rollout.max_questions == crate::task::twenty_questions::MAX_QUESTIONS {
                o.remove("max_questions");
            }
            if self.midgame == 0 {
                o.remove("midgame");
            }
            if self.rollout.future_questioner == FutureQuestioner::default() {
                o.remove("future_questioner");
            }
            if self.rollout.interactivity_scale == InteractivityScale::default() {
                o.remove("interactivity_scale");
            }
            if self.token_counter == TokenCounterKind::default() {
                o.remove("token_counter");
            }
            if self.truncated == TruncatedReward::default() {
                o.remove("truncated");
            }
            if self.pairs == PairMode::default() {
                o.remove("pairs");
            }
            if self.continue_rate == 0.0 {
                o.remove("continue_rate");
            }
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_round_trip_and_unknown_keys_rejected() {
        let cfg = RlRunConfig {
            group_size: 4,
            algo: Algo::OnlineDpo,
            metrics: [("token_amount".to_string(), -1.0)].into(),
            ..Default::default()
        };
        let text = toml::to_string(&cfg).unwrap();
        let back: RlRunConfig = toml::from_str(&text).unwrap();
        assert_eq!(back, cfg);
        for (text, key) in [
            ("group_sise = 3", "group_sise"),
            ("judge_max_tokenz = 3", "judge_max_tokenz"),
        ] {
            let parsed: RlRunConfig = toml::from_str(text).unwrap();
            let err = parsed.validate().unwrap_err().to_string();
            assert!(err.contains(key), "{err}");
        }
        // Records of earlier runs (flat keys, the shared ones among them) still read.
        let record = serde_json::to_value(&cfg).unwrap();
        assert_eq!(
            record["concurrency"], 8,
            "the shared settings stay top-level keys"
        );
        assert!(record.get("rollout").is_none() && record.get("unknown_keys").is_none());
        let back: RlRunConfig = serde_json::from_value(record).unwrap();
        assert_eq!(back, cfg);
        // A flattened part takes its own Default, never the outer one's: they must agree.
        assert_eq!(RlRunConfig::default().rollout, RolloutConfig::default());
        assert_eq!(RlRunConfig::default().optim, TrainerSettings::default());
        let record = serde_json::to_value(&cfg).unwrap();
        assert!(record.get("optim").is_none() && record["lr"] == 1e-6);
    }

    #[test]
    fn trainer_settings_in_a_file_are_top_level_keys_with_rl_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rl.toml");
        std::fs::write(&path, "seed = 3\nweight_decay = 0.1").unwrap();
        let cfg = RlRunConfig::from_toml_file(&path).unwrap();
        assert_eq!((cfg.optim.seed, cfg.optim.weight_decay), (3, 0.1));
        assert_eq!(cfg.optim.lr, 1e-6, "a missing key takes rl_train's default");
        std::fs::write(&path, "group_size = 4\nlr = \"fast\"").unwrap();
        let err = RlRunConfig::from_toml_file(&path).unwrap_err().to_string();
        assert!(err.contains("lr = ") && err.contains("rl.toml"), "{err}");
    }

    #[test]
    fn role_caps_reach_the_roles_settings() {
        let mut cfg = RlRunConfig::default();
        cfg.set_max_tokens(&[
            (TokenRole::User, 48),
            (TokenRole::Judge, 200),
            (TokenRole::Extractor, 300),
            (TokenRole::Assistant, 96),
        ]);
        assert_eq!(cfg.rollout.judge_max_tokens, 200);
        assert_eq!(cfg.rollout.extractor_max_tokens, 300);
        assert_eq!(
            (
                cfg.policy_sampling().max_tokens,
                cfg.rollout.user_sampling.max_tokens
            ),
            (96, 48)
        );
        let mut zero = cfg.clone();
        zero.rollout.user_sampling.max_tokens = 0;
        assert!(zero.validate().unwrap_err().to_string().contains("user"));
    }

    #[test]
    fn bad_settings_are_named() {
        let bad = |cfg: RlRunConfig, field: &str| {
            let err = cfg.validate().unwrap_err().to_string();
            assert!(err.contains(field), "{field}: {err}");
        };
        bad(
            RlRunConfig {
                group_size: 1,
                ..Default::default()
            },
            "group_size",
        );
        bad(
            RlRunConfig {
                clip_ratio: 0.0,
                ..Default::default()
            },
            "clip_ratio",
        );
        bad(
            RlRunConfig {
                optim: TrainerSettings {
                    lr: f64::NAN,
                    ..Default::default()
                },
                ..Default::default()
            },
            "lr",
        );
        bad(
            RlRunConfig {
                model: "openai:gpt-4o".into(),
                ..Default::default()
            },
            "model",
        );
        bad(
            RlRunConfig {
                eval_every: Some(2),
                ..Default::default()
            },
            "eval_every",
        );
        bad(
            RlRunConfig {
                future_temperature: Some(f64::NAN),
                ..Default::default()
            },
            "future_temperature",
        );
    }

    #[test]
    fn futures_sample_at_their_own_temperature() {
        let cfg = RlRunConfig {
            temperature: 1.0,
            top_p: 0.9,
            ..Default::default()
        };
        assert_eq!(
            cfg.future_sampling().temperature,
            1.0,
            "unset: the policy's"
        );
        let greedy = RlRunConfig {
            future_temperature: Some(0.0),
            ..cfg
        };
        let (policy, futures) = (greedy.policy_sampling(), greedy.future_sampling());
        assert_eq!((policy.temperature, futures.temperature), (1.0, 0.0));
        assert_eq!(futures.top_p, policy.top_p, "only the temperature differs");
    }

    #[test]
    fn identity_ignores_how_long_and_where() {
        let a = RlRunConfig::default();
        let b = RlRunConfig {
            max_steps: 99,
            rollout: RolloutConfig {
                concurrency: 1,
                ..RolloutConfig::default()
            },
            ..Default::default()
        };
        assert_eq!(a.identity(), b.identity());
        let c = RlRunConfig {
            optim: TrainerSettings {
                lr: 2e-6,
                ..Default::default()
            },
            ..Default::default()
        };
        assert_ne!(a.identity(), c.identity());
    }

    #[test]
    fn compat_verl_sets_the_recipe_and_records_every_value() {
        let mut cfg = RlRunConfig::default();
        cfg.apply_compat(Compat::Verl).unwrap();
        cfg.validate().unwrap();
        let rec = cfg.compat.clone().unwrap();
        assert_eq!(rec.preset, Compat::Verl);
        for (k, v) in [
            ("lr", serde_json::json!(1e-6)),
            ("kl_coef", serde_json::json!(0.001)),
            ("entropy_coef", serde_json::json!(0.0)),
            ("ppo_mini_batch", serde_json::json!(8)),
            ("batch_prompts", serde_json::json!(16)),
            ("mr_formula", serde_json::json!("verl_clamp")),
            ("interactivity_scale", serde_json::json!("verl")),
            ("token_counter", serde_json::json!("words")),
            ("truncated", serde_json::json!("zero")),
            ("loss_agg", serde_json::json!("token-mean")),
        ] {
            assert_eq!(rec.set[k], v, "{k}");
        }
        // Every recorded value is the config's own.
        let whole = serde_json::to_value(&cfg).unwrap();
        for (k, v) in &rec.set {
            assert_eq!(&whole[k], v, "{k}");
        }
        // 16 prompts × 8 responses in mini-batches of 8 prompts: two optimizer steps a batch.
        assert_eq!(cfg.mini_batch_responses(), 64);
        assert_eq!(cfg.rl_config().unwrap().mini_batch, 64);
        assert_eq!(cfg.optimizer_steps(), cfg.max_steps * 2);
        assert_eq!(cfg.token_counter, TokenCounterKind::Words);
        assert_eq!(cfg.rollout.interactivity_scale, InteractivityScale::Verl);
        assert!(RlRunConfig::default()
            .apply_compat(Compat::UpstreamV2)
            .unwrap_err()
            .to_string()
            .contains("verl"));
    }

    #[test]
    fn ppo_mini_batch_is_checked_against_the_batch() {
        let cfg = RlRunConfig {
            ppo_mini_batch: Some(3),
            ..Default::default()
        };
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("ppo_mini_batch") && err.contains("3"), "{err}");
        let both = RlRunConfig {
            ppo_mini_batch: Some(1),
            mini_batch: 4,
            ..Default::default()
        };
        assert!(both.validate().is_err());
        let ok = RlRunConfig {
            ppo_mini_batch: Some(1),
            ..Default::default()
        };
        ok.validate().unwrap();
        assert_eq!(ok.mini_batch_responses(), ok.group_size);
        // Old runs (no new keys) keep their identity.
        assert!(RlRunConfig::default().identity().get("truncated").is_none());
    }
}
