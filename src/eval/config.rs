//! The resolved settings of an `eval_multiturn` run, the models it compares and their labels.

use crate::llm::tokens::TokenCounterKind;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::engine::llama::WeightFormat;
use crate::llm::spec::redact_credentials;
use crate::llm::ModelSpec;
use crate::reward::metrics::task_metric;
use crate::rollout::config::{check_sampling, check_task_source, RolloutConfig, UnknownKeys};
use crate::rollout::user::{Sampling, TokenRole};
use crate::task::prompts::SystemPromptSource;
use crate::task::source::TaskSource;
use crate::task::twenty_questions::chat::ObjectSplit;
use crate::task::TaskType;

#[derive(Debug, thiserror::Error)]
pub enum EvalConfigError {
    #[error("invalid setting `{field}`: {message}")]
    Invalid { field: String, message: String },
    #[error("--model {spec}: {message}")]
    Model { spec: String, message: String },
    #[error(transparent)]
    Rollout(#[from] crate::rollout::config::ConfigError),
}

fn invalid(field: &str, message: impl Into<String>) -> EvalConfigError {
    EvalConfigError::Invalid {
        field: field.into(),
        message: message.into(),
    }
}

/// One evaluated model: any model spec, or a built-in 20 Questions questioner.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum EvalModel {
    /// Greedy maximum expected information gain over the table (20 Questions only).
    Reference,
    /// Random distinct guesses (20 Questions only).
    Random,
    /// The noisy halving demonstrator whose games are SFT data (20 Questions only).
    Demonstrator,
    /// An assistant model.
    Spec(ModelSpec),
    /// `proactive:SPEC`: the model prompted with the collaborative system prompt
    /// (`prompts/assistant_proactive.j2`): the paper's prompted baseline, as its own row.
    Proactive(ModelSpec),
}

impl FromStr for EvalModel {
    type Err = EvalConfigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "reference" => Ok(EvalModel::Reference),
            "random" => Ok(EvalModel::Random),
            "demonstrator" => Ok(EvalModel::Demonstrator),
            other if other.starts_with(PROACTIVE_PREFIX) => other[PROACTIVE_PREFIX.len()..]
                .parse::<ModelSpec>()
                .map(EvalModel::Proactive)
                .map_err(|e| EvalConfigError::Model {
                    spec: redact_credentials(s),
                    message: e.to_string(),
                }),
            other => other
                .parse::<ModelSpec>()
                .map(EvalModel::Spec)
                .map_err(|e| EvalConfigError::Model {
                    spec: redact_credentials(s),
                    message: e.to_string(),
                }),
        }
    }
}

impl std::fmt::Display for EvalModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EvalModel::Reference => f.write_str("reference"),
            EvalModel::Random => f.write_str("random"),
            EvalModel::Demonstrator => f.write_str("demonstrator"),
            EvalModel::Spec(s) => write!(f, "{s}"),
            EvalModel::Proactive(s) => write!(f, "{PROACTIVE_PREFIX}{s}"),
        }
    }
}

impl From<EvalModel> for String {
    fn from(m: EvalModel) -> String {
        m.to_string()
    }
}

impl TryFrom<String> for EvalModel {
    type Error = EvalConfigError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl EvalModel {
    pub fn is_builtin(&self) -> bool {
        matches!(
            self,
            EvalModel::Reference | EvalModel::Random | EvalModel::Demonstrator
        )
    }

    /// The model spec of a model row (`None` for the built-in questioners).
    pub fn spec(&self) -> Option<&ModelSpec> {
        match self {
            EvalModel::Spec(s) | EvalModel::Proactive(s) => Some(s),
            _ => None,
        }
    }

    /// The legend label before de-duplication: `default`, `reference`, `random`, a checkpoint
    /// directory's last two path components joined by `-`, a GGUF file's stem, an HF id or
    /// endpoint model with `/` replaced; `<label>-proactive` for a prompted baseline. Always a
    /// safe file name.
    pub fn base_label(&self) -> String {
        let raw = match self {
            EvalModel::Reference => "reference".to_string(),
            EvalModel::Random => "random".to_string(),
            EvalModel::Demonstrator => "demonstrator".to_string(),
            EvalModel::Spec(spec) => spec_label(spec),
            EvalModel::Proactive(spec) => format!("{}-proactive", spec_label(spec)),
        };
        sanitize_label(&raw)
    }
}

fn spec_label(spec: &ModelSpec) -> String {
    match spec {
        ModelSpec::Default => "default".to_string(),
        ModelSpec::Gguf(p) => p
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| p.display().to_string()),
        ModelSpec::HfDir(p) => last_two_components(p),
        ModelSpec::HfId { repo, revision } => match revision {
            Some(r) => format!("{repo}@{r}"),
            None => repo.clone(),
        },
        ModelSpec::OpenAi { model, .. } => model.clone(),
    }
}

fn last_two_components(p: &Path) -> String {
    let parts: Vec<String> = p
        .components()
        .filter_map(|c| match c {
            std::path::Component::Normal(s) => Some(s.to_string_lossy().into_owned()),
            _ => None,
        })
        .collect();
    let k = parts.len().saturating_sub(2);
    if parts.is_empty() {
        p.display().to_string()
    } else {
        parts[k..].join("-")
    }
}

/// Keeps letters, digits, `.`, `_`, `-`, `@`; everything else becomes `-` (file-name safe).
pub fn sanitize_label(s: &str) -> String {
    let out: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '@') {
                c
            } else {
                '-'
            }
        })
        .collect();
    let out = out.trim_matches(['-', '.']).to_string();
    if out.is_empty() {
        "model".into()
    } else {
        out
    }
}

/// Unique labels for the models, in order: repeats get `-2`, `-3`, ….
pub fn model_labels(models: &[EvalModel]) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(models.len());
    for m in models {
        let base = m.base_label();
        let mut label = base.clone();
        let mut k = 2;
        while out.contains(&label) {
            label = format!("{base}-{k}");
            k += 1;
        }
        out.push(label);
    }
    out
}

/// `--model proactive:SPEC`: the model with the collaborative system prompt.
pub const PROACTIVE_PREFIX: &str = "proactive:";

/// Which oracle answers 20 Questions.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum OracleChoice {
    /// The deterministic attribute-table oracle; a question it cannot parse is answered "No."
    /// (LMRL-Gym's normalisation) and counted as unparsed.
    Table,
    /// An LLM prompted with the object and the question (`llm[:SPEC]`, or a bare spec).
    Model(ModelSpec),
    /// The table when the question parses, the LLM otherwise (`hybrid[:SPEC]`).
    Hybrid(ModelSpec),
}

impl OracleChoice {
    /// The oracle when `--oracle` is not given: hybrid with the default model when a model
    /// questioner plays (a model is loaded anyway), the table for built-in questioners only
    /// (their questions always parse).
    pub fn default_for(models: &[EvalModel]) -> OracleChoice {
        if models.iter().any(|m| !m.is_builtin()) {
            OracleChoice::Hybrid(ModelSpec::Default)
        } else {
            OracleChoice::Table
        }
    }

    /// The oracle's model, if it has one.
    pub fn model(&self) -> Option<&ModelSpec> {
        match self {
            OracleChoice::Table => None,
            OracleChoice::Model(s) | OracleChoice::Hybrid(s) => Some(s),
        }
    }
}

impl FromStr for OracleChoice {
    type Err = EvalConfigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let spec = |text: &str| {
            if text.is_empty() {
                return Ok(ModelSpec::Default);
            }
            text.parse::<ModelSpec>().map_err(|e| {
                let s = redact_credentials(s);
                invalid(
                    "oracle",
                    format!("`{s}`: {e} (or `table`, `llm[:SPEC]`, `hybrid[:SPEC]`)"),
                )
            })
        };
        match s {
            "table" => Ok(OracleChoice::Table),
            "llm" | "hybrid" => Ok(if s == "llm" {
                OracleChoice::Model(ModelSpec::Default)
            } else {
                OracleChoice::Hybrid(ModelSpec::Default)
            }),
            _ => {
                if let Some(rest) = s.strip_prefix("hybrid:") {
                    spec(rest).map(OracleChoice::Hybrid)
                } else {
                    spec(s.strip_prefix("llm:").unwrap_or(s)).map(OracleChoice::Model)
                }
            }
        }
    }
}

impl std::fmt::Display for OracleChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OracleChoice::Table => f.write_str("table"),
            OracleChoice::Model(s) => write!(f, "{s}"),
            OracleChoice::Hybrid(s) => write!(f, "hybrid:{s}"),
        }
    }
}

impl From<OracleChoice> for String {
    fn from(o: OracleChoice) -> String {
        o.to_string()
    }
}

impl TryFrom<String> for OracleChoice {
    type Error = EvalConfigError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

/// Which 20 Questions objects are played: all 158 in task order, or the first N.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum ObjectSelection {
    All,
    First(usize),
}

impl FromStr for ObjectSelection {
    type Err = EvalConfigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "all" => Ok(ObjectSelection::All),
            n => match n.parse::<usize>() {
                Ok(k) if k > 0 => Ok(ObjectSelection::First(k)),
                _ => Err(invalid(
                    "objects",
                    format!("`{s}`: expected `all` or a positive number"),
                )),
            },
        }
    }
}

impl std::fmt::Display for ObjectSelection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ObjectSelection::All => f.write_str("all"),
            ObjectSelection::First(n) => write!(f, "{n}"),
        }
    }
}

impl From<ObjectSelection> for String {
    fn from(o: ObjectSelection) -> String {
        o.to_string()
    }
}

impl TryFrom<String> for ObjectSelection {
    type Error = EvalConfigError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl ObjectSelection {
    /// How many of `total` objects are played; asking for more than exist is refused rather
    /// than silently playing fewer.
    pub fn count(self, total: usize) -> Result<usize, EvalConfigError> {
        match self {
            ObjectSelection::All => Ok(total),
            ObjectSelection::First(n) if n <= total => Ok(n),
            ObjectSelection::First(n) => Err(invalid(
                "objects",
                format!("{n}: there are only {total} objects (use `all` or 1 to {total})"),
            )),
        }
    }
}

/// Everything an evaluation run needs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct EvalConfig {
    pub task: TaskType,
    /// Models compared (same seeds, simulator, judge and oracle for all).
    pub models: Vec<EvalModel>,
    pub output: PathBuf,
    /// Tasks file for math/doc_edit/code [default: the bundled data/<task>.jsonl].
    pub tasks: Option<String>,
    /// Use only the first K tasks.
    pub max_tasks: Option<usize>,
    pub seed: u64,
    /// Each task (or object) is played this many times, repeat r with seed `seed + r`.
    pub repeats: usize,
    /// Assistant replies per conversation at most (math/doc_edit/code).
    pub max_turns: usize,
    pub oracle: OracleChoice,
    /// 20 Questions: which objects, by generate_conv's fixed object split (`test`: the held-out
    /// objects no `20q:train` run generated data for).
    pub split: ObjectSplit,
    /// 20 Questions: all objects of the split, or the first N of them.
    pub objects: ObjectSelection,
    /// generate_conv run directories whose tasks must not be evaluated.
    pub exclude_runs: Vec<PathBuf>,
    /// Overlap with `exclude_runs` is a warning instead of an error.
    pub allow_overlap: bool,
    /// What token counts count: cl100k_base for every model by default, so numbers compare
    /// across models; `policy` (each model's own tokenizer) or `words`.
    pub token_counter: TokenCounterKind,
    pub assistant_sampling: Sampling,
    /// Token cap of one 20 Questions question (model questioners).
    pub question_max_tokens: usize,
    /// How local models hold their weights (`serve --weights`): `q8` puts a GGUF base and a
    /// merged safetensors checkpoint on the same footing.
    pub weights: WeightFormat,
    /// A system prompt every model row is evaluated with (`proactive` rows always get the
    /// proactive one).
    pub system_prompt: Option<SystemPromptSource>,
    /// Also write each model's conversations as SFT data (`sft/<model>.parquet`, TRL's
    /// `messages` form) for `dpo_train --loss sft`: for 20 Questions the won games (the rules,
    /// then each question and answer, ending at the winning question); for dialogue tasks
    /// every conversation as played (the clarify demonstrator's warm-start data).
    pub sft: bool,
    /// 20 Questions: label every state of each questioner's games with the demonstrator's
    /// question and merge the rows into this pairs file (DAgger; a questioner's earlier
    /// rows there are replaced, other questioners' kept).
    pub dagger: Option<PathBuf>,
    /// Clarify-or-answer `demonstrator`: the chance it asks on a vague request.
    pub ask_rate: f64,
    /// Clarify-or-answer `demonstrator`: the chance it asks a needless question on a stated
    /// request.
    pub needless_ask_rate: f64,
    /// The settings every rollout shares (top-level keys, as all the others).
    #[serde(flatten)]
    pub rollout: RolloutConfig,
    /// Keys of the config file that no setting has: an error at load.
    #[serde(flatten, skip_serializing)]
    pub unknown_keys: UnknownKeys,
}

impl Default for EvalConfig {
    fn default() -> Self {
        Self {
            task: TaskType::default(),
            models: vec![EvalModel::Spec(ModelSpec::Default)],
            output: PathBuf::from("outputs/eval"),
            tasks: None,
            max_tasks: None,
            seed: 0,
            repeats: 1,
            max_turns: 7,
            oracle: OracleChoice::Table,
            split: ObjectSplit::All,
            objects: ObjectSelection::All,
            exclude_runs: Vec::new(),
            allow_overlap: false,
            token_counter: TokenCounterKind::Cl100k,
            // Evaluation is greedy: a model is measured at its best guess, not at a draw.
            assistant_sampling: Sampling {
                temperature: 0.0,
                top_p: 1.0,
                ..Sampling::default()
            },
            question_max_tokens: 64,
            weights: WeightFormat::Auto,
            system_prompt: None,
            sft: false,
            dagger: None,
            ask_rate: crate::task::clarify::Demonstrator::DEFAULT.ask_rate,
            needless_ask_rate: crate::task::clarify::Demonstrator::DEFAULT.needless_ask_rate,
            rollout: RolloutConfig::default(),
            unknown_keys: UnknownKeys::default(),
        }
    }
}

impl EvalConfig {
    /// The clarify-or-answer mixed demonstrator of this run.
    pub fn clarify_demonstrator(&self) -> crate::task::clarify::Demonstrator {
        crate::task::clarify::Demonstrator {
            ask_rate: self.ask_rate,
            needless_ask_rate: self.needless_ask_rate,
        }
    }

    pub fn validate(&self) -> Result<(), EvalConfigError> {
        if self.models.is_empty() {
            return Err(invalid("models", "give at least one --model"));
        }
        if !self.task.is_game() {
            // A dialogue type may have a demonstrator of its own; the rest are 20 Questions'.
            let allowed =
                |m: &EvalModel| self.task.facts().has_demonstrator && *m == EvalModel::Demonstrator;
            if let Some(m) = self.models.iter().find(|m| m.is_builtin() && !allowed(m)) {
                return Err(invalid(
                    "models",
                    format!(
                        "`{m}` is a built-in 20 Questions questioner; it cannot play --task {}",
                        self.task
                    ),
                ));
            }
        }
        self.clarify_demonstrator()
            .validate()
            .map_err(|e| invalid("ask_rate", e))?;
        if self.repeats == 0 {
            return Err(invalid("repeats", "must be at least 1"));
        }
        if self.max_turns == 0 {
            return Err(invalid("max_turns", "must be at least 1"));
        }
        if self.max_tasks == Some(0) {
            return Err(invalid("max_tasks", "must be at least 1"));
        }
        self.refuse_settings_of_the_other_kind()?;
        if self.dagger.is_some() && !self.task.is_game() {
            return Err(invalid(
                "dagger",
                "labels 20 Questions states with the demonstrator's questions; use --task twenty_questions",
            ));
        }
        if self.question_max_tokens == 0 {
            return Err(invalid("question_max_tokens", "must be at least 1"));
        }
        self.unknown_keys.check()?;
        if !self.task.is_game() {
            check_task_source(&self.task_source())?;
        }
        self.rollout.validate()?;
        check_sampling("assistant_sampling", &self.assistant_sampling)?;
        Ok(())
    }

    /// A setting that only the other kind of task reads (20 Questions' games vs dialogue
    /// tasks) is refused by name rather than ignored: `--max-tasks 3` with 20 Questions
    /// would otherwise play every game and record `max_tasks: 3`.
    fn refuse_settings_of_the_other_kind(&self) -> Result<(), EvalConfigError> {
        let ignored = |field: &str, flag: &str, instead: &str| {
            invalid(
                field,
                format!("{flag} is not used by --task {}; {instead}", self.task),
            )
        };
        let demonstrator = crate::task::clarify::Demonstrator::DEFAULT;
        if self.task != TaskType::Clarify {
            let instead = "it sets the clarify demonstrator (--task clarify --model demonstrator)";
            if self.ask_rate != demonstrator.ask_rate {
                return Err(ignored("ask_rate", "--ask-rate", instead));
            }
            if self.needless_ask_rate != demonstrator.needless_ask_rate {
                return Err(ignored("needless_ask_rate", "--needless-ask-rate", instead));
            }
        }
        if self.task.is_game() {
            if self.max_tasks.is_some() {
                return Err(ignored(
                    "max_tasks",
                    "--max-tasks",
                    "20 Questions plays the games --objects, --split and --repeats choose",
                ));
            }
            if self.tasks.is_some() {
                return Err(ignored(
                    "tasks",
                    "--tasks",
                    "20 Questions plays its bundled objects (--objects, --split)",
                ));
            }
            return Ok(());
        }
        let dialogue = "it is a 20 Questions setting";
        if self.rollout.max_questions != crate::task::twenty_questions::MAX_QUESTIONS {
            return Err(ignored("max_questions", "--max-questions", dialogue));
        }
        if self.objects != ObjectSelection::All {
            return Err(ignored("objects", "--objects", dialogue));
        }
        if self.split != ObjectSplit::All {
            return Err(ignored("split", "--split", dialogue));
        }
        if self.oracle != OracleChoice::Table {
            return Err(ignored("oracle", "--oracle", dialogue));
        }
        Ok(())
    }

    /// Applies `--max-tokens ROLE=N`: `policy` (and `assistant`) cap the evaluated models.
    pub fn set_max_tokens(&mut self, caps: &[(TokenRole, usize)]) {
        for &(role, n) in caps {
            match role {
                TokenRole::Policy | TokenRole::Assistant => self.assistant_sampling.max_tokens = n,
                TokenRole::User => self.rollout.user_sampling.max_tokens = n,
                TokenRole::Judge => self.rollout.judge_max_tokens = n,
                TokenRole::Extractor => self.rollout.extractor_max_tokens = n,
            }
        }
    }

    /// Where the tasks of a dialogue evaluation (math, doc_edit, code, clarify) come from:
    /// the sources generate_conv and rl_train read (task files, upstream flat parquet, `hf:`,
    /// `clarify:`); every task must be of `task`'s type and carry what its metric needs.
    pub fn task_source(&self) -> TaskSource {
        let metrics = task_metric(self.task)
            .map(|m| (m.to_string(), 1.0))
            .into_iter()
            .collect();
        TaskSource {
            expected_type: Some(self.task),
            ..TaskSource::new(
                &self.tasks_path().to_string_lossy(),
                None,
                self.max_tasks,
                &metrics,
            )
        }
    }

    /// The tasks file: `--tasks`, else `data/<task>.jsonl` (relative to the working directory
    /// when it exists there, else the bundled copy).
    pub fn tasks_path(&self) -> PathBuf {
        if let Some(t) = &self.tasks {
            return PathBuf::from(t);
        }
        if let Some(builtin) = self.task.facts().builtin_eval_tasks {
            return PathBuf::from(builtin);
        }
        let rel = PathBuf::from(format!("data/{}.jsonl", self.task));
        if rel.is_file() {
            rel
        } else {
            Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
        }
    }

    /// Settings that decide what the model calls and metrics are; an output directory can only
    /// be reused with the same ones (models, task count, objects and repeats may change).
    pub fn identity(&self) -> serde_json::Value {
        let twenty = self.task.is_game();
        let mut id = serde_json::json!({
            "task": self.task,
            "tasks": (!twenty).then(|| self.tasks_path().display().to_string()),
            "user": (!twenty).then(|| self.rollout.user.to_string()),
            "judge": (!twenty).then(|| self.rollout.judge.to_string()),
            "seed": self.seed,
            "max_turns": (!twenty).then_some(self.max_turns),
            "oracle": twenty.then(|| self.oracle.to_string()),
            "max_questions": twenty.then_some(self.rollout.max_questions),
            "termination": self.rollout.termination,
            "judge_mode": self.rollout.judge_mode,
            "assistant_sampling": self.assistant_sampling,
            "user_sampling": self.rollout.user_sampling,
            "question_max_tokens": self.question_max_tokens,
            "prompts": self.rollout.prompts,
            "judge_max_tokens": self.rollout.judge_max_tokens,
            "extractor_max_tokens": self.rollout.extractor_max_tokens,
            "interactivity_scale": self.rollout.interactivity_scale,
        });
        // Only when not the default, so runs made before the setting existed still resume.
        if self.token_counter != TokenCounterKind::Cl100k {
            id["token_counter"] = serde_json::json!(self.token_counter);
        }
        if let Some(sp) = &self.system_prompt {
            id["system_prompt"] = serde_json::json!(sp);
        }
        if self.weights != WeightFormat::Auto {
            id["weights"] = serde_json::json!(self.weights);
        }
        if twenty && self.split != ObjectSplit::All {
            id["split"] = serde_json::json!(self.split);
        }
        id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A flattened part takes its own Default, never the outer one's: they must agree.
    #[test]
    fn the_shared_settings_default_as_every_run_does() {
        assert_eq!(EvalConfig::default().rollout, RolloutConfig::default());
    }

    #[test]
    fn labels_are_unique_and_file_safe() {
        let models: Vec<EvalModel> = [
            "reference",
            "random",
            "default",
            "openai:gpt-4o-mini@http://127.0.0.1:8000/v1",
            "openai:Qwen/Qwen2.5-7B",
            "hf:org/name",
            "x/y/model.Q4_1.gguf",
            "default",
        ]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
        assert_eq!(
            model_labels(&models),
            [
                "reference",
                "random",
                "default",
                "gpt-4o-mini",
                "Qwen-Qwen2.5-7B",
                "org-name",
                "model.Q4_1",
                "default-2"
            ]
        );
        let dir = tempfile::tempdir().unwrap();
        let ckpt = dir.path().join("dpo-math").join("final");
        std::fs::create_dir_all(&ckpt).unwrap();
        let m: EvalModel = ckpt.display().to_string().parse().unwrap();
        assert_eq!(m.base_label(), "dpo-math-final");
    }

    #[test]
    fn selections_and_oracles_parse() {
        assert_eq!(
            "all".parse::<ObjectSelection>().unwrap(),
            ObjectSelection::All
        );
        assert_eq!(
            "5".parse::<ObjectSelection>().unwrap(),
            ObjectSelection::First(5)
        );
        assert_eq!(ObjectSelection::First(158).count(158).unwrap(), 158);
        let e = ObjectSelection::First(500).count(158).unwrap_err();
        assert!(e.to_string().contains("only 158 objects"), "{e}");
        assert!("0".parse::<ObjectSelection>().is_err());
        assert!("some".parse::<ObjectSelection>().is_err());
        assert_eq!(
            "table".parse::<OracleChoice>().unwrap(),
            OracleChoice::Table
        );
        assert!(matches!(
            "openai:m".parse::<OracleChoice>().unwrap(),
            OracleChoice::Model(_)
        ));
        for (text, shown) in [
            ("llm", "default"),
            ("llm:openai:m", "openai:m"),
            ("hybrid", "hybrid:default"),
            (
                "hybrid:openai:m@http://127.0.0.1:9/v1",
                "hybrid:openai:m@http://127.0.0.1:9/v1",
            ),
        ] {
            let o: OracleChoice = text.parse().unwrap();
            assert_eq!(o.to_string(), shown, "{text}");
            assert_eq!(o.to_string().parse::<OracleChoice>().unwrap(), o, "{text}");
        }
        assert!(matches!(
            "hybrid".parse::<OracleChoice>().unwrap(),
            OracleChoice::Hybrid(ModelSpec::Default)
        ));
        let e = "hybrid:openai:".parse::<OracleChoice>().unwrap_err();
        assert!(e.to_string().contains("hybrid[:SPEC]"), "{e}");
        assert_eq!(
            OracleChoice::default_for(&[EvalModel::Reference, EvalModel::Random]),
            OracleChoice::Table
        );
        assert_eq!(
            OracleChoice::default_for(&[EvalModel::Reference, EvalModel::Spec(ModelSpec::Default)]),
            OracleChoice::Hybrid(ModelSpec::Default)
        );
    }

    #[test]
    fn builtin_questioners_only_play_twenty_questions() {
        let cfg = EvalConfig {
            models: vec![EvalModel::Reference],
            ..Default::default()
        };
        let e = cfg.validate().unwrap_err().to_string();
        assert!(e.contains("reference") && e.contains("math"), "{e}");
        let cfg = EvalConfig {
            task: TaskType::TwentyQuestions,
            models: vec![EvalModel::Reference, EvalModel::Random],
            ..Default::default()
        };
        cfg.validate().unwrap();
        let back: EvalConfig = serde_json::from_value(serde_json::to_value(&cfg).unwrap()).unwrap();
        assert_eq!(back, cfg);
    }
}
