//! The resolved configuration of a `generate_conv` run: defaults ← `--config` TOML ← flags,
//! validated once at start-up.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::proactive::ProactiveStyle;
use crate::check::Range;
use crate::llm::tokens::TokenCounterKind;
use crate::llm::ModelSpec;
use crate::reward::adaptive::AdaptiveRule;
use crate::reward::mr::MrFormula;
use crate::reward::pairs::PairMode;
use crate::rollout::user::{Sampling, TokenRole};
use crate::task::prompts::SystemPromptSource;
use crate::task::twenty_questions::chat::OracleMode;
use crate::task::twenty_questions::future::FutureQuestioner;
use crate::task::TaskType;

use crate::rollout::config::{
    check_future_questioner, check_futures, check_sampling, check_task_source, in_range, invalid,
    RolloutConfig, UnknownKeys, DEFAULT_TASKS,
};
pub use crate::rollout::config::{
    Compat, CompatRecord, ConfigError, METRIC_WEIGHT, SANDBOX_TIMEOUT_S,
};
pub use crate::task::source::{twenty_questions_split, Shard, TaskSource, TWENTY_QUESTIONS_SOURCE};
/// Share of candidates drawn with the proactive prompt.
pub const PROACT_RATIO: Range = Range::closed(0.0, 1.0);
/// Share of conversations in the test split.
pub const TEST_FRACTION: Range = Range::closed_open(0.0, 1.0);
pub use crate::reward::pairs::MIN_GAP;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct GenerateConfig {
    /// Tasks: a JSONL or parquet file, a parquet file in the upstream flat schema, or
    /// `hf:<org>/<name>` (a published CollabLLM flat dataset, imported through the Hub).
    pub tasks: String,
    /// Task type of imported flat-schema tasks whose metadata has none (else guessed from the
    /// dataset's name).
    pub task_type: Option<TaskType>,
    /// Run directory (conversations, pairs, manifest, request cache).
    pub output: PathBuf,
    pub policy: ModelSpec,
    /// Model for the assistant turns inside futures (default: the policy).
    pub assistant: Option<ModelSpec>,
    /// Candidate replies per turn (N).
    pub candidates: usize,
    /// Simulated futures per candidate (S); 0 scores each reply alone (single-turn reward).
    /// Not used with `adaptive`, whose `max_futures` is the cap.
    pub samples: usize,
    /// Adaptive futures (`--samples adaptive`): futures go to the candidates whose place as
    /// best or worst is still in doubt; `None` plays `samples` futures for every candidate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adaptive: Option<AdaptiveRule>,
    /// Messages per future (user, assistant, user, …).
    pub window: usize,
    /// Cap on the real conversation's length, in messages.
    pub max_messages: usize,
    /// Use only the first K tasks.
    pub max_tasks: Option<usize>,
    /// Fraction of candidates drawn with the proactive prompt (`int(N · ratio)` of them).
    pub proact_ratio: f64,
    /// How proactive candidates are prompted: upstream's JSON instruction or a system prompt.
    pub proactive_style: ProactiveStyle,
    /// Redraws of a proactive candidate whose JSON answer is unusable (then the system prompt).
    pub proactive_retries: u32,
    /// Metric weights; empty = the task type's defaults.
    pub metrics: BTreeMap<String, f64>,
    pub mr_formula: MrFormula,
    /// Minimum MR gap between chosen and rejected.
    pub min_gap: f64,
    pub pairs: PairMode,
    /// Balance the pair set across request strata: the fields whose values name a stratum
    /// (task metadata keys, or `turn` and `action`), e.g. `["stated"]`; empty: no balancing.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub balance_by: Vec<String>,
    /// With `balance_by`: the field whose value names a group balanced on its own (e.g.
    /// `template`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub balance_within: Option<String>,
    pub seed: u64,
    /// Share of conversations in pairs/test.parquet.
    pub test_fraction: f64,
    pub policy_sampling: Sampling,
    pub assistant_sampling: Sampling,
    /// What `token_amount` counts: the policy's tokenizer (cl100k for endpoints), cl100k for
    /// all, or words (verl).
    #[serde(default)]
    pub token_counter: TokenCounterKind,
    /// Run only this shard of the tasks (`--shard i/n`); shard runs merge with `--merge`.
    #[serde(default)]
    pub shard: Option<Shard>,
    /// 20 Questions: who answers the questions (`table`, the user model `llm`, or `hybrid`).
    #[serde(default)]
    pub oracle: OracleMode,
    /// 20 Questions: start each game after a demonstrator prefix of 0..=N questions (drawn
    /// per game), so pairs come from mid-game positions, not only the opening; 0 = off.
    #[serde(default)]
    pub midgame: usize,
    /// The policy's system prompt (`proactive` or a text file): the first message of every
    /// conversation, kept in every pair's prompt.
    #[serde(default)]
    pub system_prompt: Option<SystemPromptSource>,
    /// The `--compat` preset applied, and every value it set (recorded in the manifest).
    #[serde(default)]
    pub compat: Option<CompatRecord>,
    /// The settings every rollout shares (top-level keys, as all the others).
    #[serde(flatten)]
    pub rollout: RolloutConfig,
    /// Keys of the config file that no setting has: an error at load.
    #[serde(flatten, skip_serializing)]
    pub unknown_keys: UnknownKeys,
}

impl Default for GenerateConfig {
    fn default() -> Self {
        Self {
            tasks: DEFAULT_TASKS.into(),
            task_type: None,
            output: PathBuf::from("outputs/run"),
            policy: ModelSpec::Default,
            assistant: None,
            candidates: 3,
            samples: 3,
            adaptive: None,
            window: 4,
            max_messages: 14,
            max_tasks: None,
            proact_ratio: 0.5,
            proactive_style: ProactiveStyle::default(),
            proactive_retries: 3,
            metrics: BTreeMap::new(),
            mr_formula: MrFormula::Mean,
            min_gap: 0.02,
            pairs: PairMode::Best,
            balance_by: Vec::new(),
            balance_within: None,
            seed: 0,
            test_fraction: 0.1,
            policy_sampling: Sampling::default(),
            assistant_sampling: Sampling::default(),
            shard: None,
            token_counter: TokenCounterKind::Policy,
            oracle: OracleMode::Table,
            midgame: 0,
            system_prompt: None,
            compat: None,
            rollout: RolloutConfig::default(),
            unknown_keys: UnknownKeys::default(),
        }
    }
}

impl GenerateConfig {
    pub fn from_toml_file(path: &Path) -> Result<Self, ConfigError> {
        crate::rollout::config::from_toml_file(path, |c: &Self| &c.unknown_keys)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.candidates == 0 {
            return Err(invalid(
                "candidates",
                "must be at least 1 (2 or more to form pairs)",
            ));
        }
        self.unknown_keys.check()?;
        check_task_source(&self.task_source())?;
        // 0 futures is the single-turn reward: each reply scored alone.
        if let Some(rule) = &self.adaptive {
            rule.validate().map_err(|m| invalid("adaptive", m))?;
        }
        check_futures(self.future_cap().max(1), self.window)?;
        self.rollout.validate()?;
        check_sampling("policy_sampling", &self.policy_sampling)?;
        check_sampling("assistant_sampling", &self.assistant_sampling)?;
        if self.max_messages < 2 {
            return Err(invalid("max_messages", "must be at least 2"));
        }
        for (field, v, max) in [
            ("candidates", self.candidates, 1024),
            ("max_messages", self.max_messages, 4096),
        ] {
            crate::check::in_range(field, v, 0, max).map_err(|m| invalid(field, m))?;
        }
        in_range("proact_ratio", self.proact_ratio, PROACT_RATIO)?;
        in_range("test_fraction", self.test_fraction, TEST_FRACTION)?;
        in_range("min_gap", self.min_gap, MIN_GAP)?;
        self.balance()
            .validate()
            .map_err(|m| ConfigError::Invalid {
                field: "balance_by".into(),
                message: m,
            })?;
        check_future_questioner(
            self.rollout.future_questioner,
            self.plays_twenty_questions(),
            self.assistant.is_some(),
        )
    }

    /// Where the tasks come from.
    pub fn task_source(&self) -> TaskSource {
        TaskSource {
            shard: self.shard,
            ..TaskSource::new(&self.tasks, self.task_type, self.max_tasks, &self.metrics)
        }
    }

    /// Whether the tasks are 20 Questions games (the bundled objects or a task type given
    /// as twenty_questions).
    pub fn plays_twenty_questions(&self) -> bool {
        twenty_questions_split(&self.tasks).is_some()
            || self.task_type.is_some_and(TaskType::is_game)
    }

    /// The most futures one candidate gets: S, or the adaptive rule's maximum.
    pub fn future_cap(&self) -> usize {
        self.adaptive.map_or(self.samples, |r| r.max_futures)
    }

    pub fn assistant_spec(&self) -> &ModelSpec {
        self.assistant.as_ref().unwrap_or(&self.policy)
    }

    /// Candidates per turn drawn with the proactive prompt: `int(N · ratio)` as upstream
    /// (rounded down, so N = 3 at 0.5 gives 1). None for 20 Questions: the collaborator
    /// prompt ("ask a clarifying question before doing the work") does not fit a game whose
    /// every turn is a question, and only confuses a small questioner.
    pub fn proactive_count(&self) -> usize {
        if self.plays_twenty_questions() {
            return 0;
        }
        // The same float product and truncation as Python's `int(n * ratio)`, so the count
        // agrees with upstream even where the product is inexact (100 × 0.57 → 56).
        ((self.candidates as f64) * self.proact_ratio) as usize
    }

    /// Applies one `--max-tokens ROLE=N`: `policy` also caps the future assistant turns (the
    /// same model by default, as upstream shares one setting), unless `assistant` is given.
    pub fn set_max_tokens(&mut self, caps: &[(TokenRole, usize)]) {
        for &(role, n) in caps {
            match role {
                TokenRole::Policy => {
                    self.policy_sampling.max_tokens = n;
                    if !caps.iter().any(|(r, _)| *r == TokenRole::Assistant) {
                        self.assistant_sampling.max_tokens = n;
                    }
                }
                TokenRole::Assistant => self.assistant_sampling.max_tokens = n,
                TokenRole::User => self.rollout.user_sampling.max_tokens = n,
                TokenRole::Judge => self.rollout.judge_max_tokens = n,
                TokenRole::Extractor => self.rollout.extractor_max_tokens = n,
            }
        }
    }

    /// How the pair set is balanced across strata.
    pub fn balance(&self) -> crate::reward::pairs::Balance {
        crate::reward::pairs::Balance {
            by: self.balance_by.clone(),
            within: self.balance_within.clone(),
        }
    }

    /// The settings that decide what the model calls are; a run directory can only be resumed
    /// with the same ones (weights, gap, formula and pair mode may change: they are re-scored).
    pub fn generation_identity(&self) -> serde_json::Value {
        let mut id = serde_json::json!({
            "tasks": self.tasks,
            "policy": self.policy, "user": self.rollout.user, "judge": self.rollout.judge,
            "assistant": self.assistant_spec(),
            "candidates": self.candidates, "samples": self.samples, "window": self.window,
            "max_messages": self.max_messages, "proact_ratio": self.proact_ratio,
            "seed": self.seed, "termination": self.rollout.termination,
            "policy_sampling": self.policy_sampling, "user_sampling": self.rollout.user_sampling,
            "assistant_sampling": self.assistant_sampling, "judge_mode": self.rollout.judge_mode,
            "prompts": self.rollout.prompts,
            "proactive_style": self.proactive_style,
            "judge_max_tokens": self.rollout.judge_max_tokens,
            "extractor_max_tokens": self.rollout.extractor_max_tokens,
            "interactivity_scale": self.rollout.interactivity_scale,
            "shard": self.shard,
        });
        // Only when not the default, so runs made before the setting existed still resume.
        if self.token_counter != TokenCounterKind::Policy {
            id["token_counter"] = serde_json::json!(self.token_counter);
        }
        if let Some(sp) = &self.system_prompt {
            id["system_prompt"] = serde_json::json!(sp);
        }
        if let Some(rule) = &self.adaptive {
            // Which futures are played depends on the rule; S is not used.
            id["samples"] = serde_json::json!("adaptive");
            id["adaptive"] = serde_json::json!(rule);
        }
        if self.plays_twenty_questions() {
            id["oracle"] = serde_json::json!(self.oracle);
            id["max_questions"] = serde_json::json!(self.rollout.max_questions);
            if self.midgame > 0 {
                id["midgame"] = serde_json::json!(self.midgame);
            }
            if self.rollout.future_questioner != FutureQuestioner::default() {
                id["future_questioner"] = serde_json::json!(self.rollout.future_questioner);
            }
        }
        id
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reward::judge::InteractivityScale;
    use crate::rollout::user::JUDGE_MAX_TOKENS;

    #[test]
    fn toml_round_trip_and_unknown_keys_rejected() {
        let cfg = GenerateConfig {
            candidates: 2,
            metrics: [("accuracy".to_string(), 1.0)].into(),
            ..Default::default()
        };
        let text = toml::to_string(&cfg).unwrap();
        let back: GenerateConfig = toml::from_str(&text).unwrap();
        assert_eq!(back, cfg);
        // A shared setting is a top-level key like any other, and lands in `rollout`.
        let cfg: GenerateConfig =
            toml::from_str("candidates = 4\nconcurrency = 2\nuser_sampling.top_p = 0.5").unwrap();
        assert_eq!((cfg.candidates, cfg.rollout.concurrency), (4, 2));
        assert_eq!(cfg.rollout.user_sampling.top_p, 0.5);
        assert_eq!(cfg.rollout.judge_max_tokens, JUDGE_MAX_TOKENS);
        cfg.validate().unwrap();
        // A misspelt key, top-level or in the shared part, is an error naming it and the file;
        // one inside a table is still refused by that table.
        let dir = tempfile::tempdir().unwrap();
        for (text, key) in [
            ("candidatez = 3", "candidatez"),
            ("concurency = 3", "concurency"),
            ("[user_sampling]\ntop_k = 3", "top_k"),
            // A shared setting of the wrong type: the error names the key.
            ("candidates = 2\nconcurrency = \"8\"", "concurrency"),
            ("judge_mode = \"jsn\"", "jsn"),
        ] {
            let path = dir.path().join("run.toml");
            std::fs::write(&path, text).unwrap();
            let err = GenerateConfig::from_toml_file(&path)
                .unwrap_err()
                .to_string();
            assert!(err.contains(key) && err.contains("run.toml"), "{err}");
        }
        let parsed: GenerateConfig = toml::from_str("candidatez = 3\nwindoww = 2").unwrap();
        let err = parsed.validate().unwrap_err().to_string();
        assert!(err.contains("`candidatez`, `windoww`"), "{err}");
        // A flattened part takes its own Default, never the outer one's: they must agree.
        assert_eq!(GenerateConfig::default().rollout, RolloutConfig::default());
    }

    #[test]
    fn upstream_token_caps_by_default_and_per_role_flags() {
        let cfg = GenerateConfig::default();
        assert_eq!(cfg.policy_sampling.max_tokens, 2048);
        assert_eq!(cfg.assistant_sampling.max_tokens, 2048);
        assert_eq!(cfg.rollout.user_sampling.max_tokens, 1024);
        assert_eq!(cfg.rollout.user_sampling.temperature, 1.0);
        assert_eq!(
            (
                cfg.rollout.judge_max_tokens,
                cfg.rollout.extractor_max_tokens
            ),
            (512, 2048)
        );
        assert_eq!(cfg.rollout.interactivity_scale, InteractivityScale::V2);

        let parse = crate::rollout::user::parse_role_max_tokens;
        let mut cfg = GenerateConfig::default();
        cfg.set_max_tokens(&[parse("policy=300").unwrap(), parse("user=40").unwrap()]);
        assert_eq!(cfg.policy_sampling.max_tokens, 300);
        assert_eq!(
            cfg.assistant_sampling.max_tokens, 300,
            "policy caps future turns too"
        );
        assert_eq!(cfg.rollout.user_sampling.max_tokens, 40);
        cfg.set_max_tokens(&[
            parse("assistant=100").unwrap(),
            parse("policy=500").unwrap(),
            parse("judge=64").unwrap(),
            parse("extractor=4096").unwrap(),
        ]);
        assert_eq!(cfg.policy_sampling.max_tokens, 500);
        assert_eq!(
            cfg.assistant_sampling.max_tokens, 100,
            "an explicit assistant cap wins"
        );
        assert_eq!(
            (
                cfg.rollout.judge_max_tokens,
                cfg.rollout.extractor_max_tokens
            ),
            (64, 4096)
        );
        for bad in ["policy", "critic=5", "user=0", "user=-3", "judge=lots"] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        assert!(parse("critic=5").unwrap_err().contains("critic"));
        assert!(parse("user=0").unwrap_err().contains("--max-tokens user 0"));
        let cfg = GenerateConfig {
            rollout: RolloutConfig {
                extractor_max_tokens: 0,
                ..RolloutConfig::default()
            },
            ..Default::default()
        };
        assert!(cfg
            .validate()
            .unwrap_err()
            .to_string()
            .contains("extractor_max_tokens"));
    }

    #[test]
    fn proactive_count_is_int_of_n_times_ratio() {
        let count = |candidates, proact_ratio| {
            GenerateConfig {
                candidates,
                proact_ratio,
                ..Default::default()
            }
            .proactive_count()
        };
        assert_eq!(count(3, 0.5), 1, "int(1.5), not round");
        assert_eq!(count(5, 0.5), 2);
        assert_eq!(count(10, 0.3), 3);
        assert_eq!(count(100, 0.57), 56, "Python: int(100 * 0.57) == 56");
        assert_eq!(count(4, 1.0), 4);
        assert_eq!(count(4, 0.0), 0);
    }

    #[test]
    fn validation_names_the_field() {
        let cfg = GenerateConfig {
            proact_ratio: 1.5,
            ..Default::default()
        };
        assert!(cfg
            .validate()
            .unwrap_err()
            .to_string()
            .contains("proact_ratio"));
        let cfg = GenerateConfig {
            metrics: [("vibes".to_string(), 1.0)].into(),
            ..Default::default()
        };
        assert!(cfg.validate().unwrap_err().to_string().contains("vibes"));
    }

    /// `[adaptive]` in a config: its maximum caps the futures and joins the run's identity
    /// (S does not); a bad setting or a misspelt key is named.
    #[test]
    fn adaptive_table_sets_the_cap_and_the_identity() {
        let cfg: GenerateConfig = toml::from_str(
            "samples = 3
[adaptive]
max_futures = 6
z = 1.5",
        )
        .unwrap();
        cfg.validate().unwrap();
        assert_eq!(cfg.future_cap(), 6);
        let id = cfg.generation_identity();
        assert_eq!(id["samples"], "adaptive");
        assert_eq!(id["adaptive"]["max_futures"], 6);
        assert_eq!(
            id["adaptive"]["min_futures"], 2,
            "unset keys keep their defaults"
        );
        let fixed = GenerateConfig::default().generation_identity();
        assert!(
            fixed.get("adaptive").is_none(),
            "runs without it still resume"
        );
        let bad: GenerateConfig = toml::from_str(
            "[adaptive]
min_futures = 1",
        )
        .unwrap();
        let err = bad.validate().unwrap_err().to_string();
        assert!(
            err.contains("adaptive") && err.contains("min_futures"),
            "{err}"
        );
        assert!(toml::from_str::<GenerateConfig>(
            "[adaptive]
zz = 1"
        )
        .is_err());
    }
}
