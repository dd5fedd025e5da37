//! What every run that plays conversations shares — its simulated user, judges, endpoints
//! ([`RolloutConfig`], embedded by generate_conv's, eval_multiturn's and rl_train's configs)
//! — with the one check of those settings, and of a run's task source with its metric
//! weights ([`check_task_source`], [`load_tasks`]). Also the `--compat` presets' names and records, and the error
//! every run configuration reports.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::user::Sampling;
use crate::check::Range;
use crate::llm::{check_prices, EndpointOptions, ModelSpec, Price};
use crate::reward::judge::{InteractivityScale, JudgeMode};
use crate::reward::metrics::check_metric_name;
use crate::task::source::TaskSource;
use crate::task::twenty_questions::future::FutureQuestioner;
use crate::task::Task;

/// The tasks file of a run that names none.
pub const DEFAULT_TASKS: &str = "data/math.jsonl";
/// What the simulated user says to end the conversation (upstream's signal).
pub const DEFAULT_TERMINATION: &str = "[[TERMINATE CHAT]]";

/// Metric weights (negative weights penalise, e.g. token_amount).
pub const METRIC_WEIGHT: Range = Range::finite();
pub use crate::reward::sandbox::SANDBOX_TIMEOUT_S;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config {path}: {message}")]
    File { path: PathBuf, message: String },
    #[error("invalid setting `{field}`: {message}")]
    Invalid { field: String, message: String },
    #[error("unknown setting{} {keys} (misspelt?)", if keys.contains(", ") { "s" } else { "" })]
    Unknown { keys: String },
}

/// `field` must lie in `range`: `invalid setting `field`: value: must be a finite number ...`.
pub(crate) fn in_range(field: &str, v: f64, range: Range) -> Result<(), ConfigError> {
    if range.contains(v) {
        Ok(())
    } else {
        Err(invalid(field, format!("{v:?}: {}", range.requirement())))
    }
}

pub(crate) fn invalid(field: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        message: message.into(),
    }
}

/// Which defaults to follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Compat {
    /// Upstream CollabLLM v2 (`examples/build_dataset.py` and the library's defaults).
    UpstreamV2,
    /// The verl CollabLLM recipe (`recipe/collabllm/`).
    Verl,
}

impl std::str::FromStr for Compat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "upstream-v2" => Ok(Compat::UpstreamV2),
            "verl" => Ok(Compat::Verl),
            other => Err(format!("`{other}`: expected upstream-v2 or verl")),
        }
    }
}

impl std::fmt::Display for Compat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Compat::UpstreamV2 => "upstream-v2",
            Compat::Verl => "verl",
        })
    }
}

/// What a preset did: its name and every setting it set, with the value.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CompatRecord {
    pub preset: Compat,
    pub set: BTreeMap<String, serde_json::Value>,
}

/// Checks a run's task source (its name and shard) and its metric weights, before anything
/// is read.
pub fn check_task_source(src: &TaskSource) -> Result<(), ConfigError> {
    src.validate()
        .map_err(|(field, message)| invalid(field, message))?;
    for (name, w) in &src.metrics {
        check_metric_name(name).map_err(|e| invalid("metrics", e.to_string()))?;
        in_range(&format!("metrics.{name}"), *w, METRIC_WEIGHT)?;
    }
    Ok(())
}

/// A run's tasks: read from their source ([`TaskSource::fetch`]), then checked to carry what
/// the weighted metrics need (each task type's defaults when none are given).
pub async fn load_tasks(src: &TaskSource) -> anyhow::Result<Vec<Task>> {
    let tasks = src.fetch().await?;
    check_tasks_carry_metrics(src, &tasks)?;
    Ok(tasks)
}

fn check_tasks_carry_metrics(src: &TaskSource, tasks: &[Task]) -> anyhow::Result<()> {
    use crate::reward::metrics::{check_tasks_for_metrics, default_weights};
    for t in tasks {
        let metrics: Vec<String> = if src.metrics.is_empty() {
            default_weights(t.task_type).into_keys().collect()
        } else {
            src.metrics.keys().cloned().collect()
        };
        check_tasks_for_metrics(std::slice::from_ref(t), &metrics)?;
    }
    Ok(())
}

/// What every run that plays conversations with a simulated user shares: the user and judge
/// models, their sampling, retries and token caps, how a conversation ends, how many run at
/// once, the endpoints and their prices, the sandbox and the 20 Questions game length.
///
/// generate_conv, eval_multiturn and rl_train embed it flattened, so its settings are
/// top-level keys of their TOML files and records, and each is defined and defaulted here
/// once. A config that embeds it collects the keys no setting has in [`UnknownKeys`]
/// (flattening rules out serde's `deny_unknown_fields`) and rejects them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RolloutConfig {
    /// Simulated user model.
    pub user: ModelSpec,
    /// Judge and extractor model.
    pub judge: ModelSpec,
    /// The simulated user's sampling (upstream's: temperature 1, no nucleus cut, its token
    /// cap).
    pub user_sampling: Sampling,
    /// How judges answer: log-probabilities for local judges, JSON for endpoints.
    pub judge_mode: JudgeMode,
    /// Extra judge attempts when an answer is unusable.
    pub judge_retries: u32,
    /// Extra user-simulator attempts when an output is unusable.
    pub user_retries: u32,
    /// Token cap of one judge answer.
    pub judge_max_tokens: usize,
    /// Token cap of one extraction (final document or code).
    pub extractor_max_tokens: usize,
    /// Rubric and rescaling of the interactivity judge.
    pub interactivity_scale: InteractivityScale,
    /// What the simulated user says to end the conversation.
    pub termination: String,
    /// Conversations (or replies) in flight at once.
    pub concurrency: usize,
    /// Compute threads for local models (none: CANDLE_NUM_THREADS, else all cores).
    pub threads: Option<usize>,
    /// OpenAI-compatible endpoints: key variable, concurrency, timeout, retries, backoff.
    pub endpoint: EndpointOptions,
    /// Folder replacing the built-in prompt templates.
    pub prompts: Option<PathBuf>,
    /// Seconds of wall time per sandboxed test run (pass_rate).
    pub sandbox_timeout_s: f64,
    /// Endpoint prices by model spec (USD per million tokens), for `cost_usd`.
    /// TOML: `[prices."openai:gpt-4o-mini"]` with `input = 0.15` and `output = 0.6`.
    pub prices: BTreeMap<String, Price>,
    /// 20 Questions: questions per game.
    pub max_questions: usize,
    /// 20 Questions: who asks the questions after the candidate inside a future, the
    /// futures' assistant (`policy`) or the built-in `demonstrator`.
    pub future_questioner: FutureQuestioner,
}

impl Default for RolloutConfig {
    fn default() -> Self {
        Self {
            user: ModelSpec::Default,
            judge: ModelSpec::Default,
            user_sampling: Sampling {
                temperature: 1.0,
                top_p: 1.0,
                max_tokens: super::user::USER_MAX_TOKENS,
            },
            judge_mode: JudgeMode::Auto,
            judge_retries: 3,
            user_retries: 3,
            judge_max_tokens: super::user::JUDGE_MAX_TOKENS,
            extractor_max_tokens: super::user::EXTRACTOR_MAX_TOKENS,
            interactivity_scale: InteractivityScale::default(),
            termination: DEFAULT_TERMINATION.into(),
            concurrency: 8,
            threads: None,
            endpoint: EndpointOptions::default(),
            prompts: None,
            sandbox_timeout_s: 10.0,
            prices: BTreeMap::new(),
            max_questions: crate::task::twenty_questions::MAX_QUESTIONS,
            future_questioner: FutureQuestioner::default(),
        }
    }
}

impl RolloutConfig {
    /// Checks every setting once; the error names the setting and the value.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.max_questions == 0 {
            return Err(invalid("max_questions", "must be at least 1"));
        }
        // Upper bounds: far beyond any real run, far below what overflows an allocation.
        for (field, v, max) in [
            ("max_questions", self.max_questions, 1000),
            ("concurrency", self.concurrency, 4096),
        ] {
            crate::check::in_range(field, v, 0, max).map_err(|m| invalid(field, m))?;
        }
        if self.concurrency == 0 {
            return Err(invalid("concurrency", "must be at least 1"));
        }
        if self.threads == Some(0) {
            return Err(invalid("threads", "0: must be at least 1"));
        }
        if self.termination.trim().is_empty() {
            return Err(invalid("termination", "must not be empty"));
        }
        if self.judge_mode == JudgeMode::Logprob && !self.judge.is_local() {
            return Err(invalid(
                "judge_mode",
                format!(
                    "logprob needs a local judge model; {} is an endpoint",
                    self.judge
                ),
            ));
        }
        in_range(
            "sandbox_timeout_s",
            self.sandbox_timeout_s,
            SANDBOX_TIMEOUT_S,
        )?;
        self.endpoint
            .validate()
            .map_err(|e| invalid("endpoint", e))?;
        check_prices(&self.prices).map_err(|e| invalid("prices", e))?;
        for (field, n) in [
            ("judge_max_tokens", self.judge_max_tokens),
            ("extractor_max_tokens", self.extractor_max_tokens),
        ] {
            if n == 0 {
                return Err(invalid(field, "0: must be at least 1"));
            }
        }
        check_sampling("user_sampling", &self.user_sampling)
    }
}

/// The demonstrator asks questions only in 20 Questions futures, and only where no assistant
/// model was named for them.
pub fn check_future_questioner(
    questioner: FutureQuestioner,
    plays_twenty_questions: bool,
    assistant_given: bool,
) -> Result<(), ConfigError> {
    if questioner == FutureQuestioner::Demonstrator {
        if !plays_twenty_questions {
            return Err(invalid(
                "future_questioner",
                "`demonstrator` asks 20 Questions questions; these tasks are not 20 Questions games",
            ));
        }
        if assistant_given {
            return Err(invalid(
                "future_questioner",
                "`demonstrator` plays the futures' assistant turns; leave `assistant` unset",
            ));
        }
    }
    Ok(())
}

/// Futures per reply (S) and messages per future (W): at least 1, at most far beyond any
/// real run.
pub fn check_futures(samples: usize, window: usize) -> Result<(), ConfigError> {
    for (field, v, max) in [("samples", samples, 64), ("window", window, 1024)] {
        if v == 0 {
            return Err(invalid(field, "must be at least 1"));
        }
        crate::check::in_range(field, v, 0, max).map_err(|m| invalid(field, m))?;
    }
    Ok(())
}

/// A role's sampling (`field`: the setting's name, e.g. `policy_sampling`): temperature and
/// top_p in range, a token cap of at least 1.
pub fn check_sampling(field: &str, s: &Sampling) -> Result<(), ConfigError> {
    in_range(
        &format!("{field}.temperature"),
        s.temperature as f64,
        Sampling::TEMPERATURE,
    )?;
    in_range(&format!("{field}.top_p"), s.top_p as f64, Sampling::TOP_P)?;
    if s.max_tokens == 0 {
        return Err(invalid(field, "max_tokens 0: must be at least 1"));
    }
    Ok(())
}

/// The keys of a config file that no setting has. Flattened last into a config that embeds
/// [`RolloutConfig`], it receives exactly those (serde hands each flattened part only the
/// keys still unclaimed); it is never written back.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(transparent)]
pub struct UnknownKeys(BTreeMap<String, serde::de::IgnoredAny>);

impl UnknownKeys {
    /// The error misspelt keys deserve: ``unknown setting `candidatez` (misspelt?)``, every
    /// such key named.
    pub fn check(&self) -> Result<(), ConfigError> {
        if self.0.is_empty() {
            return Ok(());
        }
        let keys: Vec<String> = self.0.keys().map(|k| format!("`{k}`")).collect();
        Err(ConfigError::Unknown {
            keys: keys.join(", "),
        })
    }
}

/// Reads a config embedding [`RolloutConfig`] from a TOML file, rejecting unknown keys.
pub fn from_toml_file<T: serde::de::DeserializeOwned>(
    path: &std::path::Path,
    unknown_keys: impl Fn(&T) -> &UnknownKeys,
) -> Result<T, ConfigError> {
    let file_error = |message: String| ConfigError::File {
        path: path.to_path_buf(),
        message,
    };
    let text = std::fs::read_to_string(path).map_err(|e| file_error(e.to_string()))?;
    let config: T = toml::from_str(&text).map_err(|e| {
        // A shared setting is read through serde's flatten buffer, whose errors name neither
        // the key nor the line; read on its own, the shared part's error names both.
        match toml::from_str::<RolloutConfig>(&text) {
            Err(shared) => file_error(shared.to_string()),
            Ok(_) => file_error(e.to_string()),
        }
    })?;
    unknown_keys(&config)
        .check()
        .map_err(|e| file_error(e.to_string()))?;
    Ok(config)
}
