//! What every run that plays conversations shares — where its tasks come from, its
//! simulated user, judges and futures — and the one check of those settings. generate_conv
//! and rl_train build a [`RolloutConfig`] from their own settings and validate it once;
//! [`TaskSource`] names the tasks (loaded by `hub::tasks`). Also the `--compat` presets'
//! names and records, and the error every run configuration reports.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::user::Sampling;
use crate::check::Range;
use crate::llm::{check_prices, EndpointOptions, Price};
use crate::reward::metrics::check_metric_name;
use crate::task::twenty_questions::chat::ObjectSplit;
use crate::task::TaskType;

/// The defaults generate_conv and rl_train share, defined here once.
pub const DEFAULT_TASKS: &str = "data/math.jsonl";
/// What the simulated user says to end the conversation (upstream's signal).
pub const DEFAULT_TERMINATION: &str = "[[TERMINATE CHAT]]";
/// Conversations (or replies) in flight at once.
pub const DEFAULT_CONCURRENCY: usize = 8;
/// Extra judge / simulated-user attempts when an answer is unusable.
pub const DEFAULT_RETRIES: u32 = 3;
/// Seconds of wall time per sandboxed test run.
pub const DEFAULT_SANDBOX_TIMEOUT_S: f64 = 10.0;

/// The simulated user's sampling: upstream's temperature 1, no nucleus cut, its token cap.
pub fn default_user_sampling() -> Sampling {
    Sampling {
        temperature: 1.0,
        top_p: 1.0,
        max_tokens: super::user::USER_MAX_TOKENS,
    }
}

/// Metric weights (negative weights penalise, e.g. token_amount).
pub const METRIC_WEIGHT: Range = Range::finite();
pub use crate::reward::sandbox::SANDBOX_TIMEOUT_S;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config {path}: {message}")]
    File { path: PathBuf, message: String },
    #[error("invalid setting `{field}`: {message}")]
    Invalid { field: String, message: String },
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

/// The tasks source of the bundled 20 Questions objects: `20q:train`, `20q:test`, `20q:all`.
pub const TWENTY_QUESTIONS_SOURCE: &str = "20q:";

/// The split named by a `20q:<split>` tasks source; `None` for any other source.
pub fn twenty_questions_split(tasks: &str) -> Option<Result<ObjectSplit, String>> {
    tasks.strip_prefix(TWENTY_QUESTIONS_SOURCE).map(|s| {
        s.parse::<ObjectSplit>()
            .map_err(|e| format!("--tasks {tasks}: {e}"))
    })
}

/// One of `count` disjoint shards of a task list: a task belongs to shard
/// `hash(task id) mod count`, so its shard never changes when tasks are added.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shard {
    pub index: usize,
    pub count: usize,
}

impl Shard {
    /// Whether the task with this id is in the shard.
    pub fn contains(&self, task_id: &str) -> bool {
        use sha2::Digest as _;
        let h = sha2::Sha256::digest(task_id.as_bytes());
        let v = u64::from_le_bytes(h[..8].try_into().expect("8 bytes"));
        (v % self.count as u64) as usize == self.index
    }
}

impl std::str::FromStr for Shard {
    type Err = String;
    /// `i/n` with `0 <= i < n`.
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("`{s}`: expected i/n with 0 <= i < n, e.g. 0/4");
        let (i, n) = s.split_once('/').ok_or_else(bad)?;
        let (index, count) = (
            i.trim().parse().map_err(|_| bad())?,
            n.trim().parse().map_err(|_| bad())?,
        );
        if count == 0 || index >= count {
            return Err(bad());
        }
        Ok(Self { index, count })
    }
}

impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
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

/// Where a run's tasks come from and which of them it takes.
#[derive(Clone, Debug, PartialEq)]
pub struct TaskSource {
    /// A JSONL or parquet file, an upstream flat parquet file, `hf:<org>/<name>`, `20q:<split>`
    /// or `clarify:<split>`.
    pub tasks: String,
    /// Task type of flat-schema tasks whose metadata has none.
    pub task_type: Option<TaskType>,
    /// Only the first K tasks.
    pub max_tasks: Option<usize>,
    /// Only this shard of them.
    pub shard: Option<Shard>,
    /// The weighted metrics (empty: each task type's defaults): every task must carry what
    /// they need.
    pub metrics: BTreeMap<String, f64>,
}

impl TaskSource {
    /// All of `tasks`' tasks (no shard), checked against `metrics`.
    pub fn new(
        tasks: &str,
        task_type: Option<TaskType>,
        max_tasks: Option<usize>,
        metrics: &BTreeMap<String, f64>,
    ) -> Self {
        Self {
            tasks: tasks.to_string(),
            task_type,
            max_tasks,
            shard: None,
            metrics: metrics.clone(),
        }
    }

    /// Checks the source's name and shard (reading happens in `hub::tasks`).
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.tasks.trim().is_empty() {
            return Err(invalid("tasks", "a tasks file is required"));
        }
        if let Some(s) = self.shard {
            if s.count == 0 || s.index >= s.count {
                return Err(invalid("shard", format!("{s}: expected 0 <= i < n")));
            }
        }
        if let Some(Err(e)) = twenty_questions_split(&self.tasks) {
            return Err(invalid("tasks", e));
        }
        if let Some(Err(e)) = crate::task::clarify::source_split(&self.tasks) {
            return Err(invalid("tasks", e));
        }
        for (name, w) in &self.metrics {
            check_metric_name(name).map_err(|e| invalid("metrics", e.to_string()))?;
            in_range(&format!("metrics.{name}"), *w, METRIC_WEIGHT)?;
        }
        Ok(())
    }
}

/// The rollout settings of a run, as generate_conv and rl_train both have them.
#[derive(Clone, Debug, PartialEq)]
pub struct RolloutConfig {
    pub tasks: TaskSource,
    /// Futures per reply (S), at least 1.
    pub samples: usize,
    /// Messages per future.
    pub window: usize,
    /// 20 Questions: questions per game.
    pub max_questions: usize,
    /// What the simulated user says to end the conversation.
    pub termination: String,
    /// Conversations (or replies) in flight at once.
    pub concurrency: usize,
    pub threads: Option<usize>,
    pub sandbox_timeout_s: f64,
    pub endpoint: EndpointOptions,
    pub prices: BTreeMap<String, Price>,
    pub judge_max_tokens: usize,
    pub extractor_max_tokens: usize,
    /// Every role's sampling, by the setting's name (`policy_sampling`, `user_sampling`, …).
    pub sampling: Vec<(&'static str, Sampling)>,
    pub prompts: Option<PathBuf>,
}

impl RolloutConfig {
    /// Checks every setting once; the error names the setting and the value.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.tasks.validate()?;
        if self.samples == 0 {
            return Err(invalid("samples", "must be at least 1"));
        }
        if self.window == 0 {
            return Err(invalid("window", "must be at least 1"));
        }
        if self.max_questions == 0 {
            return Err(invalid("max_questions", "must be at least 1"));
        }
        // Upper bounds: far beyond any real run, far below what overflows an allocation.
        for (field, v, max) in [
            ("samples", self.samples, 64),
            ("window", self.window, 1024),
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
        for (field, s) in &self.sampling {
            in_range(
                &format!("{field}.temperature"),
                s.temperature as f64,
                Sampling::TEMPERATURE,
            )?;
            in_range(&format!("{field}.top_p"), s.top_p as f64, Sampling::TOP_P)?;
            if s.max_tokens == 0 {
                return Err(invalid(field, "max_tokens 0: must be at least 1"));
            }
        }
        Ok(())
    }
}
