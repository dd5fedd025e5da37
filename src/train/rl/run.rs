//! A whole `rl_train` run: the step loop over B prompts.
//!
//! Each step: the current policy's sampler (the trainer's weights synced into an inference
//! engine) answers B prompts n times; every response is scored by its futures
//! ([`super::rollout`]); [`RlTrainer::update`] trains on the scored groups (or one DPO pair
//! per group with `online_dpo`); the sampler is rebuilt from the updated weights, so step
//! k + 1 samples from the weights after step k.
//!
//! Outputs in the run directory: `rl_config.json` (the resolved settings), `rollouts.jsonl`
//! (one line per prompt and step: every response, future and per-metric score),
//! `logs.jsonl` (one line per step, TRL GRPOTrainer / verl metric names), `checkpoint-<k>/`
//! every `save_steps` and `final/` (HF layout, or PEFT with LoRA, plus tokenizer, optimizer
//! and RL state), `rl_summary.json`, and `cache` (every model answer).
//!
//! Resume: the latest checkpoint's weights, optimizer and step; the data order and every
//! sampling seed derive from (seed, step), so the resumed run replays the steps it lost,
//! with the answers of the request cache. Lines of `logs.jsonl` and `rollouts.jsonl` after
//! the checkpoint are dropped first (they are recomputed).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use candle_core::DType;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::Serialize;
use serde_json::{json, Map, Value};

use super::config::{Algo, Opening, RlRunConfig};
use super::rollout::{GroupRecord, RlPrompt, Rollout, StepRollout};
use super::state::{self, RlState, RL_STATE};
use super::step::{RlTrainer, UpdateReport};
use super::sync;
use crate::engine::llama::WeightFormat;
use crate::engine::ChatCodec;

use crate::llm::cache::{CachedBackend, RequestCache};
use crate::llm::local::{LoadOptions, LocalBackend};
use crate::llm::roles::{roles_cost_usd, Role};
use crate::llm::spec::{resolve_local, LocalModelFiles, ModelSpec};
use crate::llm::tokens::{TokenCounter, TokenCounterKind};
use crate::llm::usage::{MeteredBackend, UsageMeter};
use crate::llm::{SharedBackend, UsageSnapshot};
use crate::reward::judge::Judge;
use crate::reward::metrics::Scorer;
use crate::reward::sandbox::SandboxLimits;
use crate::rollout::futures::future_questioner_role;
use crate::rollout::simulated::{simulated_roles, Simulated};
use crate::rollout::user::{derive_seed, UserSimulator};
use crate::task::prompts::Prompts;
use crate::task::Task;
use crate::train::model::adapter_base_name;
use crate::train::model::TrainLlama;
use crate::train::settings::parse_device;
use crate::train::TrainError;

pub const CONFIG_FILE: &str = "rl_config.json";
pub const LOGS_FILE: &str = "logs.jsonl";
pub const ROLLOUTS_FILE: &str = "rollouts.jsonl";
pub const SUMMARY_FILE: &str = "rl_summary.json";

/// What a run did.
#[derive(Clone, Debug, Serialize)]
pub struct RlSummary {
    pub output: PathBuf,
    /// Steps done in all (this invocation and earlier ones).
    pub steps: usize,
    pub max_steps: usize,
    /// The step this invocation started after (a checkpoint's), if it resumed.
    pub resumed_from: Option<u64>,
    /// The run had finished before this invocation; nothing was done.
    pub already_finished: bool,
    pub final_dir: PathBuf,
    /// The last step's log line.
    pub last_log: Map<String, Value>,
    pub usage: BTreeMap<String, UsageSnapshot>,
    pub cost_usd: Value,
    pub wall_s: f64,
    pub peak_rss_bytes: Option<u64>,
    /// The `--compat` preset the run followed, and every value it set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compat: Option<crate::rollout::config::CompatRecord>,
}

impl RlSummary {
    /// `--resume` of a run whose `final/` holds all `updates`: nothing to do.
    fn already_finished(
        cfg: &RlRunConfig,
        final_dir: &Path,
        updates: u64,
        started: Instant,
    ) -> Self {
        RlSummary {
            output: cfg.output.clone(),
            steps: updates as usize,
            max_steps: cfg.max_steps,
            resumed_from: Some(updates),
            already_finished: true,
            final_dir: final_dir.to_path_buf(),
            last_log: Map::new(),
            usage: BTreeMap::new(),
            cost_usd: Value::Null,
            wall_s: started.elapsed().as_secs_f64(),
            peak_rss_bytes: crate::run::peak_rss_bytes(),
            compat: cfg.compat.clone(),
        }
    }
}

impl std::fmt::Display for RlSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.already_finished {
            return write!(
                f,
                "{}: finished before ({} of {} steps); nothing to do (final model: {})",
                self.output.display(),
                self.steps,
                self.max_steps,
                self.final_dir.display()
            );
        }
        let get = |k: &str| self.last_log.get(k).and_then(Value::as_f64);
        writeln!(f, "run            {}", self.output.display())?;
        writeln!(
            f,
            "steps          {} of {}{}",
            self.steps,
            self.max_steps,
            self.resumed_from
                .map(|s| format!(" (resumed after step {s})"))
                .unwrap_or_default()
        )?;
        writeln!(
            f,
            "last step      reward {:.4} ± {:.4}, kl {:.2e}, loss {:.4}",
            get("reward").unwrap_or(f64::NAN),
            get("reward_std").unwrap_or(f64::NAN),
            get("kl").unwrap_or(f64::NAN),
            get("loss").unwrap_or(f64::NAN)
        )?;
        for (role, u) in &self.usage {
            writeln!(
                f,
                "{role:<10} {} calls ({} cached), {} + {} tokens, {} failed",
                u.calls, u.cache_hits, u.prompt_tokens, u.completion_tokens, u.failures
            )?;
        }
        if let Some(c) = &self.compat {
            writeln!(f, "compat         {} ({} settings)", c.preset, c.set.len())?;
        }
        writeln!(f, "final model    {}", self.final_dir.display())?;
        write!(f, "wall time      {:.1} s", self.wall_s)
    }
}

/// The roles besides the policy, and what scoring needs.
struct Roles {
    user: Role,
    judge: Role,
    policy_meter: Arc<UsageMeter>,
    cache: Arc<RequestCache>,
}

impl Roles {
    fn usage(&self) -> BTreeMap<String, UsageSnapshot> {
        let mut out = BTreeMap::new();
        out.insert("policy".to_string(), self.policy_meter.snapshot());
        // User and judge share one meter when they are the same role object.
        out.insert(self.user.name.clone(), self.user.meter.snapshot());
        out.insert(self.judge.name.clone(), self.judge.meter.snapshot());
        out
    }
}

/// The sampler's role for one version of the weights: cached (keys carry the version) and
/// metered on the run's one policy meter.
fn policy_role(backend: Arc<LocalBackend>, roles: &Roles, spec: &str) -> Role {
    let engine = backend.engine().clone();
    let inner: SharedBackend = backend;
    let cached: SharedBackend = Arc::new(CachedBackend::new(inner, roles.cache.clone()));
    let metered: SharedBackend = Arc::new(MeteredBackend::new(
        cached,
        roles.policy_meter.clone(),
        "policy",
    ));
    Role {
        name: "policy".into(),
        spec: spec.to_string(),
        backend: metered,
        meter: roles.policy_meter.clone(),
        engine: Some(engine),
        pool: None,
    }
}

/// The prompts of a split: one per task, or with `--opening dataset` one per conversation
/// prefix of the flat source whose task is among `tasks` (so `--max-tasks` bounds both).
async fn rl_prompts(
    cfg: &RlRunConfig,
    source: &str,
    tasks: Vec<Task>,
) -> anyhow::Result<Vec<RlPrompt>> {
    if cfg.opening != Opening::Dataset {
        return Ok(tasks.into_iter().map(RlPrompt::of_task).collect());
    }
    if !crate::task::source::is_flat_source(source) {
        bail!(
            "--opening dataset needs an upstream CollabLLM flat dataset (a parquet file with \
             `single_turn_prompt`, or hf:<org>/<name>); {source} is not one"
        );
    }
    let (prefixes, skipped) = crate::task::source::load_flat_prefixes(source, None).await?;
    if skipped > 0 {
        tracing::warn!(
            "{source}: {skipped} conversation prefix(es) do not end with a user message and \
             are left out"
        );
    }
    let by_id: std::collections::HashMap<&str, &Task> =
        tasks.iter().map(|t| (t.id.as_str(), t)).collect();
    let prompts: Vec<RlPrompt> = prefixes
        .into_iter()
        .filter_map(|p| {
            by_id.get(p.task_id.as_str()).map(|t| RlPrompt {
                task: (*t).clone(),
                prefix: Some(p.messages),
            })
        })
        .collect();
    if prompts.is_empty() {
        bail!("{source}: no conversation prefix ending with a user message");
    }
    tracing::info!(
        "{source}: {} conversation prefixes of {} tasks",
        prompts.len(),
        tasks.len()
    );
    Ok(prompts)
}

/// The B tasks of `step` (1-based): each epoch over the tasks in its own seeded order, so
/// the order depends on (seed, step) only and a resumed run continues it exactly.
pub fn step_tasks<T: Clone>(tasks: &[T], seed: u64, step: u64, batch: usize) -> Vec<T> {
    let n = tasks.len();
    let mut cached: Option<(usize, Vec<usize>)> = None;
    (0..batch)
        .map(|i| {
            let g = (step.saturating_sub(1) as usize) * batch + i;
            let epoch = g / n;
            if cached.as_ref().is_none_or(|c| c.0 != epoch) {
                let mut order: Vec<usize> = (0..n).collect();
                let s = derive_seed(seed, &["rl-data-order", &epoch.to_string()]);
                order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(s));
                cached = Some((epoch, order));
            }
            let order = &cached.as_ref().map(|c| c.1.clone()).unwrap_or_default();
            tasks[order[g % n]].clone()
        })
        .collect()
}

/// The prompts of a run, grouped into the strata a step draws evenly from (`--balance-by`):
/// one stratum per value of the field, in the values' sorted order; one stratum of every
/// prompt without the setting.
pub struct PromptStrata {
    strata: Vec<Vec<RlPrompt>>,
}

impl PromptStrata {
    /// Groups `prompts` by `field` of their task's metadata; a task without the field is an
    /// error naming it.
    pub fn new(prompts: Vec<RlPrompt>, field: Option<&str>) -> anyhow::Result<Self> {
        let Some(field) = field else {
            return Ok(Self {
                strata: vec![prompts],
            });
        };
        let mut by: BTreeMap<String, Vec<RlPrompt>> = BTreeMap::new();
        for p in prompts {
            let Some(v) = p.task.metadata.get(field).filter(|v| !v.is_null()) else {
                bail!(
                    "--balance-by {field}: task {} has no metadata field `{field}`",
                    p.task.id
                );
            };
            let key = v.as_str().map_or_else(|| v.to_string(), str::to_string);
            by.entry(key).or_default().push(p);
        }
        Ok(Self {
            strata: by.into_values().collect(),
        })
    }

    pub fn len(&self) -> usize {
        self.strata.iter().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every prompt, stratum after stratum.
    pub fn all(&self) -> Vec<RlPrompt> {
        self.strata.concat()
    }

    /// The `batch` prompts of `step`: prompt i of a step from stratum i mod k (k strata),
    /// each stratum in its own seeded epochs ([`step_tasks`]), so the order depends on (seed,
    /// step) only and a resumed run continues it exactly.
    pub fn step(&self, seed: u64, step: u64, batch: usize) -> Vec<RlPrompt> {
        let k = self.strata.len().max(1);
        if k == 1 {
            return step_tasks(&self.strata[0], seed, step, batch);
        }
        let mut drawn: Vec<std::vec::IntoIter<RlPrompt>> = self
            .strata
            .iter()
            .enumerate()
            .map(|(s, tasks)| {
                let per_step = (0..batch).filter(|i| i % k == s).count();
                let stratum_seed = derive_seed(seed, &["rl-stratum", &s.to_string()]);
                step_tasks(tasks, stratum_seed, step, per_step).into_iter()
            })
            .collect();
        (0..batch).filter_map(|i| drawn[i % k].next()).collect()
    }
}

/// Keeps the lines of a JSONL file whose `step` is at most `step` (and that parse: a torn
/// last line is dropped), rewriting it atomically. Missing file: nothing to do.
pub fn truncate_jsonl(path: &Path, step: u64) -> Result<usize, TrainError> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(0);
    };
    let kept: Vec<&str> = text
        .lines()
        .filter(|l| {
            serde_json::from_str::<Value>(l)
                .ok()
                .and_then(|v| v["step"].as_f64())
                .is_some_and(|s| s <= step as f64)
        })
        .collect();
    let mut body = kept.join("\n");
    if !body.is_empty() {
        body.push('\n');
    }
    crate::run::write_atomic(path, body.as_bytes())?;
    Ok(kept.len())
}

fn append_lines(path: &Path, lines: &[String]) -> Result<(), TrainError> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(TrainError::io("opening", path))?;
    let mut buf = String::new();
    for l in lines {
        buf.push_str(l);
        buf.push('\n');
    }
    // One write per step: a kill leaves at most a torn last line, cut on resume.
    f.write_all(buf.as_bytes())
        .and_then(|_| f.flush())
        .map_err(TrainError::io("appending to", path))
}

/// The saved state with the most updates among `checkpoint-*/` and `final/`.
pub fn latest_state(output: &Path) -> Result<Option<(PathBuf, RlState)>, TrainError> {
    let Ok(entries) = std::fs::read_dir(output) else {
        return Ok(None);
    };
    let mut best: Option<(PathBuf, RlState)> = None;
    for e in entries.filter_map(Result::ok) {
        let name = e.file_name().to_string_lossy().into_owned();
        if !(name == "final"
            || name
                .strip_prefix("checkpoint-")
                .is_some_and(|n| n.parse::<u64>().is_ok()))
        {
            continue;
        }
        let path = e.path().join(RL_STATE);
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        let st: RlState = serde_json::from_str(&text)
            .map_err(|e| TrainError::input(&path, format!("not an RL state: {e}")))?;
        if best.as_ref().is_none_or(|b| st.updates > b.1.updates) {
            best = Some((e.path(), st));
        }
    }
    Ok(best)
}

/// Refuses to reuse a run directory without `--resume`, or to resume with other math.
fn check_output(cfg: &RlRunConfig, resume: bool) -> Result<(), TrainError> {
    let path = cfg.output.join(CONFIG_FILE);
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(());
    };
    if !resume {
        return Err(TrainError::run(
            &cfg.output,
            format!(
                "already holds an rl_train run ({CONFIG_FILE}); pass --resume to continue \
                 it, or choose another --output"
            ),
        ));
    }
    let old: RlRunConfig = serde_json::from_str(&text)
        .map_err(|e| TrainError::input(&path, format!("not an rl_train configuration: {e}")))?;
    let mut now = cfg.identity();
    // A run recorded before task or model hashes were: nothing to compare.
    if let Some(o) = now.as_object_mut() {
        if old.tasks_sha256.is_none() {
            o.remove("tasks_sha256");
        }
        if old.model_sha256.is_none() {
            o.remove("model_sha256");
        }
    }
    let changed: Vec<String> = crate::run::changed_keys(&old.identity(), &now)
        .iter()
        .map(|k| k.replace('_', "-"))
        .collect();
    if !changed.is_empty() {
        return Err(TrainError::run(
            &cfg.output,
            format!(
                "--resume: trained with other settings (changed: {}); resume with the same \
                 ones (only --max-steps, --save-steps, --eval-every, --threads, \
                 --concurrency and endpoint settings may change), or choose another --output",
                changed.join(", ")
            ),
        ));
    }
    Ok(())
}

/// The trained model and its files (for the tokenizer and the sampler's codec).
fn load_policy(cfg: &RlRunConfig, files: &LocalModelFiles) -> Result<TrainLlama, TrainError> {
    let device = parse_device(&cfg.optim.device)?;
    // f32 on every device: old and reference log-probs must be f32.
    let mut model = match files {
        LocalModelFiles::Gguf(p) => TrainLlama::from_gguf(p, DType::F32, &device)?,
        LocalModelFiles::HfDir(d) => TrainLlama::from_hf_dir(d, DType::F32, &device)?,
        LocalModelFiles::Adapter { .. } => {
            return Err(TrainError::Model {
                spec: cfg.model.clone(),
                message: "a LoRA adapter; train from its merged model or its base model".into(),
            })
        }
    };
    if let Some(lora) = cfg.lora() {
        let base = adapter_base_name(&cfg.model, files);
        model.enable_lora(lora.adapter_config(&base), cfg.optim.seed)?;
    }
    Ok(model)
}

/// Everything of a run that does not change from step to step.
struct Run<'a> {
    cfg: &'a RlRunConfig,
    codec: ChatCodec,
    roles: Roles,
    judge: Arc<Judge>,
    user: UserSimulator,
    /// Who asks the later questions of 20 Questions futures when not the policy.
    future_questioner: Option<Role>,
    format: WeightFormat,
    /// The token counter when it is not the policy's own tokenizer (cl100k, words).
    fixed_counter: Option<TokenCounter>,
    /// Prompt and response tokens of every sampled response so far (TRL's `num_tokens`).
    tokens_seen: std::sync::atomic::AtomicU64,
}

impl<'a> Run<'a> {
    /// The run's roles (user and judge share one request cache in the run directory), its
    /// judge and its simulated user.
    async fn build(
        cfg: &'a RlRunConfig,
        codec: ChatCodec,
        prompts: Arc<Prompts>,
    ) -> anyhow::Result<Run<'a>> {
        let cache = RequestCache::open(cfg.output.join("cache"))?;
        let (user, judge) =
            simulated_roles(&cfg.rollout, &LoadOptions::default(), Some(cache.clone())).await?;
        let simulated = Simulated::new(
            user.clone(),
            judge.clone(),
            &cfg.rollout,
            prompts,
            cfg.oracle,
        );
        let roles = Roles {
            user: user.clone(),
            judge: judge.clone(),
            policy_meter: UsageMeter::new(),
            cache,
        };
        let fixed_counter = match cfg.token_counter {
            TokenCounterKind::Policy => None,
            kind => Some(TokenCounter::of_kind(kind, None).map_err(anyhow::Error::msg)?),
        };
        Ok(Run {
            cfg,
            future_questioner: future_questioner_role(cfg.rollout.future_questioner)
                .map_err(anyhow::Error::msg)?,
            fixed_counter,
            tokens_seen: Default::default(),
            format: cfg.weight_format()?,
            codec,
            judge: simulated.judge,
            user: simulated.user,
            roles,
        })
    }

    /// Step `step`: rollouts of its prompts by `policy`, the update, a sampler of the new
    /// weights (returned), validation when due; its rollouts and log line are appended.
    async fn train_step(
        &self,
        trainer: &mut RlTrainer,
        policy: Role,
        tasks: &PromptStrata,
        eval_tasks: Option<&[RlPrompt]>,
        step: u64,
    ) -> anyhow::Result<(Role, Map<String, Value>)> {
        let cfg = self.cfg;
        let step_started = Instant::now();
        let usage_before = self.roles.usage();
        let batch = tasks.step(cfg.optim.seed, step, cfg.batch_prompts);
        let scorer = self.scorer(&policy);
        let rollout = self
            .rollout()
            .step(&policy, &scorer, "train", step, &batch, cfg.group_size)
            .await?;
        if rollout.groups.is_empty() {
            bail!(
                "step {step}: the simulated user could not open any prompt ({}); nothing \
                 to train on",
                rollout
                    .failed_prompts
                    .iter()
                    .map(|(t, e)| format!("{t}: {e}"))
                    .collect::<Vec<_>>()
                    .join("; ")
            );
        }
        self.append_rollouts(&rollout)?;

        let groups: Vec<super::Group> = rollout.groups.iter().map(GroupRecord::to_group).collect();
        let update_started = Instant::now();
        let report = match cfg.algo {
            Algo::OnlineDpo => trainer.dpo_update(&self.codec, &groups, cfg.min_gap, cfg.pairs)?,
            _ => trainer.update(&self.codec, &groups)?,
        };
        let update_s = update_started.elapsed().as_secs_f64();
        drop(scorer);
        // The previous sampler's weights are freed before the new copy is made.
        drop(policy);
        let (policy, sync_s) = self.sampler(trainer, step)?;

        let mut log = step_log(step, cfg, tasks.len(), &rollout, &report);
        clarify_ask_log(&mut log, "", &batch, &rollout);
        let step_tokens = rollout_tokens(&rollout);
        let seen = self.tokens_seen.fetch_add(step_tokens, Ordering::Relaxed) + step_tokens;
        log.insert("num_tokens".into(), json!(seen));
        let rollout_s = rollout.time_rollout + rollout.time_futures;
        log.insert("time/rollout".into(), json!(rollout.time_rollout));
        log.insert("time/futures".into(), json!(rollout.time_futures));
        log.insert("time/update".into(), json!(update_s));
        log.insert("time/sync".into(), json!(sync_s));
        if let (Some(k), Some(eval)) = (cfg.eval_every, eval_tasks) {
            if step.is_multiple_of(k as u64) || step == cfg.max_steps as u64 {
                let scorer = self.scorer(&policy);
                let r = self
                    .rollout()
                    .step(&policy, &scorer, "eval", step, eval, 1)
                    .await?;
                self.append_rollouts(&r)?;
                eval_log(&mut log, &r);
                clarify_ask_log(&mut log, "eval/", eval, &r);
            }
        }
        usage_log(&mut log, &usage_before, &self.roles.usage());
        let step_s = step_started.elapsed().as_secs_f64();
        log.insert("time/step".into(), json!(step_s));
        // TRL 1.16's and verl's names for the same times.
        log.insert("step_time".into(), json!(step_s));
        log.insert("timing_s/step".into(), json!(step_s));
        log.insert("timing_s/gen".into(), json!(rollout_s));
        log.insert("timing_s/update_actor".into(), json!(update_s));
        append_lines(&cfg.output.join(LOGS_FILE), &[serde_json::to_string(&log)?])?;
        Ok((policy, log))
    }

    /// Every group of a step, one `rollouts.jsonl` line each.
    fn append_rollouts(&self, rollout: &StepRollout) -> anyhow::Result<()> {
        let lines = rollout
            .groups
            .iter()
            .map(serde_json::to_string)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(append_lines(&self.cfg.output.join(ROLLOUTS_FILE), &lines)?)
    }

    /// The sampler of the trainer's current weights (update `update`).
    fn sampler(&self, trainer: &RlTrainer, update: u64) -> anyhow::Result<(Role, f64)> {
        let started = Instant::now();
        // The codec is cloned, not read again from the model files (0.2 s a step).
        let codec = self.codec.clone();
        let backend =
            sync::policy_backend(trainer.policy(), codec, "policy", update, None, self.format)?;
        let role = policy_role(backend, &self.roles, &self.cfg.model);
        Ok((role, started.elapsed().as_secs_f64()))
    }

    fn scorer(&self, policy: &Role) -> Scorer {
        let tokens = match (&self.fixed_counter, &policy.engine) {
            (Some(c), _) => c.clone(),
            (None, Some(e)) => TokenCounter::Local(e.clone()),
            (None, None) => unreachable!("the policy is always local"),
        };
        Scorer {
            judge: self.judge.clone(),
            tokens,
            sandbox: SandboxLimits {
                wall_timeout: Duration::from_secs_f64(self.cfg.rollout.sandbox_timeout_s),
                ..SandboxLimits::default()
            },
        }
    }

    fn rollout(&self) -> Rollout<'_> {
        Rollout {
            cfg: self.cfg,
            user: &self.user,
            future_questioner: self.future_questioner.as_ref(),
        }
    }
}

/// SHA-256 of the tasks' JSON: what `--resume` compares, whatever file or built-in they came
/// from.
fn tasks_sha256(train: &[Task], eval: Option<&Vec<Task>>) -> String {
    use sha2::Digest as _;
    let mut h = sha2::Sha256::new();
    for t in train.iter().chain(eval.into_iter().flatten()) {
        h.update(serde_json::to_vec(t).unwrap_or_default());
        h.update(b"\n");
    }
    h.update(format!("{}+{}", train.len(), eval.map_or(0, Vec::len)).as_bytes());
    format!("{:x}", h.finalize())
}

/// Runs (or, with `resume`, continues) an RL run. `progress` draws a progress bar.
pub async fn rl_train(cfg: RlRunConfig, resume: bool, progress: bool) -> anyhow::Result<RlSummary> {
    rl_train_until(cfg, resume, progress, &crate::run::Shutdown::never()).await
}

/// [`rl_train`] that stops on `shutdown`'s signal after the step in progress: the weights,
/// optimizer and sampler state of that step are saved as `checkpoint-N` (what `--resume`
/// continues from), `rl_summary.json` records status `interrupted`, and the error is
/// [`Interrupted`](crate::run::Interrupted).
pub async fn rl_train_until(
    cfg: RlRunConfig,
    resume: bool,
    progress: bool,
    shutdown: &crate::run::Shutdown,
) -> anyhow::Result<RlSummary> {
    let started = Instant::now();
    let mut cfg = cfg;
    cfg.validate()?;
    let tasks = crate::rollout::config::load_tasks(&cfg.task_source()).await?;
    let eval_raw = match cfg.eval_task_source() {
        Some(v) => Some((
            v.tasks.clone(),
            crate::rollout::config::load_tasks(&v).await?,
        )),
        None => None,
    };
    cfg.tasks_sha256 = Some(tasks_sha256(&tasks, eval_raw.as_ref().map(|e| &e.1)));
    let tasks = PromptStrata::new(
        rl_prompts(&cfg, &cfg.tasks, tasks).await?,
        cfg.balance_by.as_deref(),
    )?;
    let eval_tasks = match eval_raw {
        Some((source, raw)) => Some(rl_prompts(&cfg, &source, raw).await?),
        None => None,
    };
    let prompts = Arc::new(match &cfg.rollout.prompts {
        Some(dir) => Prompts::from_dir(dir)?,
        None => Prompts::builtin()?,
    });
    // The policy's identity, so that weights replaced under the same path refuse a resume.
    let spec: ModelSpec = cfg.model.parse()?;
    let files = resolve_local(&spec)
        .await
        .with_context(|| format!("--model {}", cfg.model))?;
    cfg.model_sha256 = Some(crate::engine::model_fingerprint(&files)?);
    std::fs::create_dir_all(&cfg.output)
        .with_context(|| format!("creating {}", cfg.output.display()))?;
    // One writer per run directory: a second rl_train on the same --output stops here.
    let _lock = crate::run::RunLock::acquire(&cfg.output)?;
    check_output(&cfg, resume)?;
    let saved = if resume {
        latest_state(&cfg.output)?
    } else {
        None
    };
    if let Some((dir, st)) = &saved {
        if dir.ends_with("final") && st.updates as usize >= cfg.max_steps {
            return Ok(RlSummary::already_finished(&cfg, dir, st.updates, started));
        }
    }

    let codec = ChatCodec::load(&files)?;
    let pad_id = codec.eos_ids.first().copied().unwrap_or(0);
    let model = load_policy(&cfg, &files)?;
    let mut trainer = RlTrainer::new(model, cfg.rl_config()?, pad_id)?;
    let mut start = 0u64;
    if let Some((dir, _)) = &saved {
        let st = state::load(&mut trainer, dir)?;
        start = st.updates;
        tracing::info!("resuming after step {start} from {}", dir.display());
    } else if resume {
        tracing::info!(
            "--resume: no checkpoint in {}; starting at step 1",
            cfg.output.display()
        );
    }
    truncate_jsonl(&cfg.output.join(LOGS_FILE), start)?;
    truncate_jsonl(&cfg.output.join(ROLLOUTS_FILE), start)?;
    crate::run::write_json_atomic(&cfg.output.join(CONFIG_FILE), &cfg)?;

    let run = Run::build(&cfg, codec, prompts).await?;
    run.tokens_seen.store(
        last_num_tokens(&cfg.output.join(LOGS_FILE)),
        Ordering::Relaxed,
    );
    let (mut policy, sync_s) = run.sampler(&trainer, start)?;
    tracing::info!(
        "sampler ready ({} weights, {sync_s:.2} s)",
        cfg.sampler_weights
    );

    let bar = crate::train::steps_bar(progress, cfg.max_steps, start);
    let mut last_log = Map::new();
    for step in start + 1..=cfg.max_steps as u64 {
        let log;
        (policy, log) = run
            .train_step(&mut trainer, policy, &tasks, eval_tasks.as_deref(), step)
            .await?;
        bar.set_message(bar_message(&log));
        bar.set_position(step);
        last_log = log;
        let rollout_state = json!({"step": step, "tasks_seen": step as usize * cfg.batch_prompts});
        let scheduled = cfg.optim.save_steps.is_some_and(|k| step % k as u64 == 0);
        let signal = shutdown.received();
        if (scheduled || signal.is_some()) && step != cfg.max_steps as u64 {
            let dir = cfg.output.join(format!("checkpoint-{step}"));
            state::save(&trainer, Some(&run.codec), &dir, rollout_state)?;
        }
        if let Some(signal) = signal.filter(|_| step != cfg.max_steps as u64) {
            bar.abandon();
            write_interrupted_summary(&cfg, step, started, signal)?;
            return Err(crate::run::Interrupted::new(signal).into());
        }
    }
    bar.finish();
    let final_dir = cfg.output.join("final");
    let done = cfg.max_steps as u64;
    state::save(
        &trainer,
        Some(&run.codec),
        &final_dir,
        json!({"step": done, "tasks_seen": done as usize * cfg.batch_prompts}),
    )?;
    let usage = run.roles.usage();
    let named: Vec<(String, &Role)> = vec![
        ("policy".to_string(), &policy),
        (run.roles.user.name.clone(), &run.roles.user),
        (run.roles.judge.name.clone(), &run.roles.judge),
    ];
    let cost_usd = roles_cost_usd(named, &usage, &cfg.rollout.prices);
    let summary = RlSummary {
        output: cfg.output.clone(),
        steps: cfg.max_steps,
        max_steps: cfg.max_steps,
        resumed_from: saved.map(|s| s.1.updates),
        already_finished: false,
        final_dir,
        last_log,
        usage,
        cost_usd,
        wall_s: started.elapsed().as_secs_f64(),
        peak_rss_bytes: crate::run::peak_rss_bytes(),
        compat: cfg.compat.clone(),
    };
    crate::run::write_finished_summary(
        &cfg.output.join(SUMMARY_FILE),
        "collabllm-rs rl_train",
        summary.wall_s,
        &summary,
    )?;
    Ok(summary)
}

/// `rl_summary.json` of a run stopped by a signal after `step`.
fn write_interrupted_summary(
    cfg: &RlRunConfig,
    step: u64,
    started: Instant,
    signal: crate::run::Signal,
) -> anyhow::Result<()> {
    let wall_s = started.elapsed().as_secs_f64();
    let fields = json!({
        "output": cfg.output,
        "steps": step,
        "max_steps": cfg.max_steps,
        "checkpoint": cfg.output.join(format!("checkpoint-{step}")),
        "wall_s": wall_s,
    });
    crate::run::write_interrupted_summary(
        &cfg.output.join(SUMMARY_FILE),
        "collabllm-rs rl_train",
        wall_s,
        signal,
        fields,
    )?;
    Ok(())
}

fn mean(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

/// The unbiased standard deviation (torch's default, as TRL and verl use).
fn std(v: &[f64]) -> Option<f64> {
    let m = mean(v)?;
    (v.len() >= 2)
        .then(|| (v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (v.len() - 1) as f64).sqrt())
}

/// Prompt plus response tokens of every response of a step, the prompt counted once per
/// response (TRL's `num_tokens` adds the attention mask of every sampled sequence).
fn rollout_tokens(rollout: &StepRollout) -> u64 {
    rollout
        .groups
        .iter()
        .flat_map(|g| {
            let prompt = g.prompt_tokens.unwrap_or(0);
            g.responses.iter().map(move |r| (prompt + r.tokens) as u64)
        })
        .sum()
}

/// `num_tokens` of the last step kept in `logs.jsonl` (0 for a new run): a resumed run goes
/// on counting from the checkpoint.
fn last_num_tokens(logs: &Path) -> u64 {
    std::fs::read_to_string(logs)
        .ok()
        .and_then(|text| {
            let last = text.lines().rev().find(|l| !l.trim().is_empty())?;
            serde_json::from_str::<Value>(last).ok()?["num_tokens"].as_u64()
        })
        .unwrap_or(0)
}

/// One `logs.jsonl` line: TRL GRPOTrainer names at the top level, verl's `actor/*` for the
/// update's own metrics.
fn step_log(
    step: u64,
    cfg: &RlRunConfig,
    n_tasks: usize,
    rollout: &StepRollout,
    report: &UpdateReport,
) -> Map<String, Value> {
    let mut log = Map::new();
    log.insert("step".into(), json!(step));
    let mut put = |k: &str, v: Option<f64>| {
        log.insert(k.to_string(), v.map_or(Value::Null, |x| json!(x)));
    };
    put(
        "epoch",
        Some((step as usize * cfg.batch_prompts) as f64 / n_tasks as f64),
    );
    let responses: Vec<_> = rollout.groups.iter().flat_map(|g| &g.responses).collect();
    let rewards: Vec<f64> = responses.iter().filter_map(|r| r.reward).collect();
    put("reward", mean(&rewards));
    // TRL: the mean over groups of each group's reward std.
    let group_stds: Vec<f64> = rollout
        .groups
        .iter()
        .filter_map(|g| {
            std(&g
                .responses
                .iter()
                .filter_map(|r| r.reward)
                .collect::<Vec<_>>())
        })
        .collect();
    put("reward_std", mean(&group_stds));
    put(
        "frac_reward_zero_std",
        mean(
            &group_stds
                .iter()
                .map(|s| f64::from(u8::from(*s == 0.0)))
                .collect::<Vec<_>>(),
        ),
    );
    let metrics: std::collections::BTreeSet<&String> = rollout
        .groups
        .iter()
        .flat_map(|g| g.weights.keys())
        .collect();
    for m in metrics {
        let vals: Vec<f64> = responses
            .iter()
            .filter_map(|r| r.metrics.get(m).copied())
            .collect();
        put(&format!("rewards/{m}/mean"), mean(&vals));
        put(&format!("rewards/{m}/std"), std(&vals));
    }
    let mr = |f: fn(&super::rollout::ResponseRecord) -> Option<f64>| {
        mean(&responses.iter().filter_map(|r| f(r)).collect::<Vec<_>>())
    };
    put("rewards/mr_mean/mean", mr(|r| r.mr_mean));
    put("rewards/mr_verl_clamp/mean", mr(|r| r.mr_verl_clamp));
    let lens: Vec<f64> = responses.iter().map(|r| r.tokens as f64).collect();
    put("completion_length", mean(&lens));
    // TRL 1.16: lengths of the responses that ended on their own (not at the token cap);
    // 0 when every response hit the cap, as TRL logs it.
    let mut terminated: Vec<f64> = responses
        .iter()
        .filter(|r| r.finish_reason != crate::llm::FinishReason::Length)
        .map(|r| r.tokens as f64)
        .collect();
    if terminated.is_empty() {
        terminated.push(0.0);
    }
    // Mean, min and max under TRL's names, and verl's names for the same quantities.
    for ([m, lo, hi], v) in [
        (
            [
                "completions/mean_length",
                "completions/min_length",
                "completions/max_length",
            ],
            &lens,
        ),
        (
            [
                "completions/mean_terminated_length",
                "completions/min_terminated_length",
                "completions/max_terminated_length",
            ],
            &terminated,
        ),
        (
            [
                "response_length/mean",
                "response_length/min",
                "response_length/max",
            ],
            &lens,
        ),
        (
            ["critic/score/mean", "critic/score/min", "critic/score/max"],
            &rewards,
        ),
    ] {
        put(m, mean(v));
        put(lo, v.iter().copied().reduce(f64::min));
        put(hi, v.iter().copied().reduce(f64::max));
    }
    put(
        "completions/clipped_ratio",
        mean(
            &responses
                .iter()
                .map(|r| {
                    f64::from(u8::from(
                        r.finish_reason == crate::llm::FinishReason::Length,
                    ))
                })
                .collect::<Vec<_>>(),
        ),
    );
    // Responses cut at the cap that scored 0 without futures (`truncated = zero`, verl).
    put(
        "responses/truncated_zero",
        Some(
            responses
                .iter()
                .filter(|r| cfg.truncated.zeroes(r.finish_reason))
                .count() as f64,
        ),
    );
    put(
        "responses/no_reward",
        Some(responses.iter().filter(|r| r.reward.is_none()).count() as f64),
    );
    put(
        "responses/futures_failed",
        Some(responses.iter().filter(|r| r.error.is_some()).count() as f64),
    );
    put("prompts/failed", Some(rollout.failed_prompts.len() as f64));
    let named: BTreeMap<String, f64> = report.named().into_iter().collect();
    let get = |k: &str| named.get(k).copied();
    put("loss", get("loss"));
    put("grad_norm", get("grad_norm"));
    put("learning_rate", get("lr"));
    put("kl", get("kl_loss"));
    // `clip_ratio`: the older TRL name (verl's pg_clipfrac), kept one release beside
    // TRL 1.16's split by side (one process: the min/max over processes are the means).
    put("clip_ratio", get("pg_clipfrac"));
    let (low, high) = (get("clip_low_frac"), get("clip_high_frac"));
    put("clip_ratio/low_mean", low);
    put("clip_ratio/low_min", low);
    put("clip_ratio/high_mean", high);
    put("clip_ratio/high_max", high);
    put("clip_ratio/region_mean", low.zip(high).map(|(l, h)| l + h));
    put("entropy", get("entropy"));
    for (k, v) in report.advantage.named() {
        put(&format!("advantages/{k}"), Some(v));
    }
    for (k, v) in &named {
        put(&format!("actor/{k}"), Some(*v));
    }
    log
}

/// Clarify-or-answer: the share of sampled responses that ask a question, on vague and on
/// stated requests (`clarify/asked_vague`, `clarify/asked_stated`), and after the user has
/// answered a question (`clarify/asked_again`, prompts that start one exchange later); each
/// absent when the step held no such prompt: the mechanism the two rewards differ on,
/// visible at every step.
fn clarify_ask_log(
    log: &mut Map<String, Value>,
    prefix: &str,
    prompts: &[RlPrompt],
    rollout: &StepRollout,
) {
    use crate::task::clarify;
    let stated: std::collections::HashMap<&str, bool> = prompts
        .iter()
        .filter(|p| p.task.task_type == crate::task::TaskType::Clarify)
        .map(|p| (p.task.id.as_str(), clarify::is_stated(&p.task)))
        .collect();
    let mut counts = [(0usize, 0usize); 3];
    for g in &rollout.groups {
        let Some(&s) = stated.get(g.task_id.as_str()) else {
            continue;
        };
        let later = g.prompt.iter().any(|m| m.role == "assistant");
        let c = &mut counts[if later { 2 } else { usize::from(s) }];
        c.0 += g
            .responses
            .iter()
            .filter(|r| clarify::is_question(&r.text))
            .count();
        c.1 += g.responses.len();
    }
    for (kind, (asked, n)) in ["vague", "stated", "again"].iter().zip(counts) {
        if n > 0 {
            log.insert(
                format!("{prefix}clarify/asked_{kind}"),
                json!(asked as f64 / n as f64),
            );
        }
    }
}

fn eval_log(log: &mut Map<String, Value>, r: &StepRollout) {
    let responses: Vec<_> = r.groups.iter().flat_map(|g| &g.responses).collect();
    let rewards: Vec<f64> = responses.iter().filter_map(|x| x.reward).collect();
    log.insert("eval/reward".into(), json!(mean(&rewards)));
    log.insert("eval/reward_std".into(), json!(std(&rewards)));
    log.insert("eval/responses".into(), json!(responses.len()));
    log.insert(
        "eval/no_reward".into(),
        json!(responses.len() - rewards.len()),
    );
    let lens: Vec<f64> = responses.iter().map(|x| x.tokens as f64).collect();
    log.insert("eval/completions/mean_length".into(), json!(mean(&lens)));
}

/// This step's calls and tokens per role (`api/<role>/<field>`) and in all.
fn usage_log(
    log: &mut Map<String, Value>,
    before: &BTreeMap<String, UsageSnapshot>,
    after: &BTreeMap<String, UsageSnapshot>,
) {
    let (mut calls, mut tokens) = (0, 0);
    for (role, a) in after {
        let b = before.get(role).copied().unwrap_or_default();
        let d = |x: u64, y: u64| x.saturating_sub(y);
        let fields = [
            ("calls", d(a.calls, b.calls)),
            ("cache_hits", d(a.cache_hits, b.cache_hits)),
            ("prompt_tokens", d(a.prompt_tokens, b.prompt_tokens)),
            (
                "completion_tokens",
                d(a.completion_tokens, b.completion_tokens),
            ),
            ("retries", d(a.retries, b.retries)),
            ("failures", d(a.failures, b.failures)),
        ];
        for (k, v) in fields {
            log.insert(format!("api/{role}/{k}"), json!(v));
        }
        calls += fields[0].1;
        tokens += fields[2].1 + fields[3].1;
    }
    log.insert("api/calls".into(), json!(calls));
    log.insert("api/tokens".into(), json!(tokens));
}

fn bar_message(log: &Map<String, Value>) -> String {
    let get = |k: &str| log.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN);
    format!(
        "reward {:.3} kl {:.1e} len {:.0} · {:.0} s/step",
        get("reward"),
        get("kl"),
        get("completions/mean_length"),
        get("time/step")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::task::TaskType;

    fn tasks(n: usize) -> Vec<Task> {
        (0..n)
            .map(|i| Task {
                id: format!("t{i}"),
                task_type: TaskType::Math,
                prompt: format!("q{i}"),
                reference: String::new(),
                metadata: Value::Null,
            })
            .collect()
    }

    #[test]
    fn data_order_covers_each_epoch_and_depends_on_seed_and_step_only() {
        let t = tasks(5);
        let ids = |seed, step| -> Vec<String> {
            step_tasks(&t, seed, step, 2)
                .into_iter()
                .map(|t| t.id)
                .collect()
        };
        // Steps 1-2 and the first prompt of step 3 are epoch 0: five distinct tasks.
        let mut epoch0: Vec<String> = [ids(7, 1), ids(7, 2), ids(7, 3)[..1].to_vec()].concat();
        epoch0.sort();
        epoch0.dedup();
        assert_eq!(epoch0.len(), 5);
        assert_eq!(
            ids(7, 4),
            ids(7, 4),
            "a resumed step takes the same prompts"
        );
        let all_seeds: Vec<Vec<String>> = (0..6).map(|s| ids(s, 1)).collect();
        assert!(all_seeds.iter().any(|x| *x != all_seeds[0]), "seeded");
    }

    /// Clarify-like prompts, 6 vague and 2 stated: a balanced step of 4 holds 2 of each, every
    /// stated prompt comes back once an epoch of its stratum, and a task without the field is
    /// refused by name.
    #[test]
    fn balanced_steps_draw_evenly_from_each_stratum() {
        let prompts: Vec<RlPrompt> = tasks(8)
            .into_iter()
            .enumerate()
            .map(|(i, mut t)| {
                t.metadata = json!({"stated": i >= 6});
                RlPrompt::of_task(t)
            })
            .collect();
        let strata = PromptStrata::new(prompts.clone(), Some("stated")).unwrap();
        assert_eq!(strata.len(), 8);
        let stated = |p: &RlPrompt| p.task.metadata["stated"] == json!(true);
        let mut stated_seen = Vec::new();
        for step in 1..=5 {
            let batch = strata.step(3, step, 4);
            assert_eq!(batch.len(), 4);
            assert_eq!(batch.iter().filter(|p| stated(p)).count(), 2, "step {step}");
            stated_seen.extend(
                batch
                    .iter()
                    .filter(|p| stated(p))
                    .map(|p| p.task.id.clone()),
            );
            assert_eq!(
                batch.iter().map(|p| &p.task.id).collect::<Vec<_>>(),
                strata
                    .step(3, step, 4)
                    .iter()
                    .map(|p| &p.task.id)
                    .collect::<Vec<_>>(),
                "a resumed step takes the same prompts"
            );
        }
        // The stated stratum's epoch is 2 prompts: each comes once per step.
        for pair in stated_seen.chunks(2) {
            assert_ne!(pair[0], pair[1]);
        }
        // An odd batch gives the extra prompt to the first stratum (stated=false sorts first).
        assert_eq!(strata.step(3, 1, 3).iter().filter(|p| stated(p)).count(), 1);
        // Without the setting: one stratum, the plain order.
        let plain = PromptStrata::new(prompts.clone(), None).unwrap();
        assert_eq!(
            plain
                .step(3, 2, 4)
                .iter()
                .map(|p| &p.task.id)
                .collect::<Vec<_>>(),
            step_tasks(&prompts, 3, 2, 4)
                .iter()
                .map(|p| &p.task.id)
                .collect::<Vec<_>>()
        );
        let err = PromptStrata::new(prompts, Some("template"))
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("task t0 has no metadata field `template`"),
            "{err}"
        );
    }

    #[test]
    fn truncation_keeps_the_steps_up_to_the_checkpoint_and_drops_a_torn_line() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("logs.jsonl");
        std::fs::write(&p, "{\"step\":1}\n{\"step\":2}\n{\"step\":3}\n{\"st").unwrap();
        assert_eq!(truncate_jsonl(&p, 2).unwrap(), 2);
        assert_eq!(
            std::fs::read_to_string(&p).unwrap(),
            "{\"step\":1}\n{\"step\":2}\n"
        );
    }
}
