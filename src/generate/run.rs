//! A whole `generate_conv` run: tasks in, conversations out (append-only, resumable), then
//! pairs, flat rows, manifest and summary. `--rescore` rebuilds the outputs from
//! `conversations.jsonl` without a model call.
//!
//! One process writes a run directory at a time ([`RunLock`]). On SIGINT/SIGTERM (with
//! [`generate_until`]) the run stops taking tasks, writes the outputs of the finished ones,
//! records status `interrupted` and returns [`Interrupted`]. The manifest's `usage_total`
//! comes from the usage records of the request cache log, so calls of invocations killed
//! with -9 are counted too.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::Serialize;

use super::config::GenerateConfig;
use super::conversation::Pipeline;
use super::outputs::{self, DatasetStats, Scoring};
use crate::llm::cache::RequestCache;
use crate::llm::local::LoadOptions;
use crate::llm::roles::{roles_cost_usd, Role};
use crate::llm::tokens::TokenCounter;
use crate::llm::usage::recorded_usage;
use crate::llm::{add_usage, with_usage_scope, Price, UsageSnapshot};
use crate::reward::metrics::{default_weights, Scorer};
use crate::reward::pairs::select_pairs;
use crate::reward::sandbox::SandboxLimits;
use crate::rollout::futures::future_questioner_role;
use crate::rollout::records::{now_secs, read_records, ConversationLog, ConversationRecord};
use crate::rollout::simulated::{simulated_roles, Simulated};
use crate::run::{
    changed_settings, drive_jobs, Interrupted, ManifestHeader, RunLock, RunStatus, Shutdown,
};
use crate::task::prompts::Prompts;
use crate::task::Task;

pub const MANIFEST_FILE: &str = "manifest.json";

/// The four roles of a run.
#[derive(Clone, Debug)]
pub struct Roles {
    pub policy: Role,
    pub user: Role,
    pub judge: Role,
    pub assistant: Role,
}

impl Roles {
    /// Builds every role from its spec; roles with the same local spec share one model.
    pub async fn from_config(
        cfg: &GenerateConfig,
        cache: Option<Arc<RequestCache>>,
    ) -> anyhow::Result<Roles> {
        let load = LoadOptions::default();
        let build = |name: &'static str, spec| {
            let cache = cache.clone();
            async move { Role::build(name, spec, &cfg.rollout.endpoint, &load, cache).await }
        };
        let policy = build("policy", &cfg.policy).await?;
        let (user, judge) = simulated_roles(&cfg.rollout, &load, cache.clone()).await?;
        let assistant = match future_questioner_role(cfg.rollout.future_questioner)
            .map_err(anyhow::Error::msg)?
        {
            Some(demonstrator) => demonstrator,
            None if cfg.assistant.is_some() => build("assistant", cfg.assistant_spec()).await?,
            None => policy.clone(),
        };
        Ok(Roles {
            policy,
            user,
            judge,
            assistant,
        })
    }

    /// The distinct roles (the assistant is the policy unless it has a model of its own).
    fn distinct(&self) -> Vec<&Role> {
        let mut out = vec![&self.policy, &self.user, &self.judge];
        if !Arc::ptr_eq(&self.assistant.meter, &self.policy.meter) {
            out.push(&self.assistant);
        }
        out
    }

    /// Calls and failures per endpoint of the roles served by endpoint pools.
    fn endpoint_calls(&self) -> BTreeMap<String, Vec<crate::llm::pool::EndpointStats>> {
        self.distinct()
            .into_iter()
            .filter_map(|r| r.pool.as_ref().map(|p| (r.name.clone(), p.stats())))
            .collect()
    }

    fn usage(&self) -> BTreeMap<String, UsageSnapshot> {
        self.distinct()
            .into_iter()
            .map(|r| (r.name.clone(), r.meter.snapshot()))
            .collect()
    }

    /// Cost per role of `usage` (see [`roles_cost_usd`]).
    fn cost(
        &self,
        usage: &BTreeMap<String, UsageSnapshot>,
        prices: &BTreeMap<String, Price>,
    ) -> serde_json::Value {
        let named = self.distinct().into_iter().map(|r| (r.name.clone(), r));
        roles_cost_usd(named, usage, prices)
    }
}

/// What a run did, for the printed summary and the manifest.
#[derive(Clone, Debug, Serialize)]
pub struct RunSummary {
    pub output: String,
    pub tasks_total: usize,
    pub tasks_done_before: usize,
    pub tasks_done_now: usize,
    pub tasks_failed: Vec<(String, String)>,
    pub stats: DatasetStats,
    pub usage: BTreeMap<String, UsageSnapshot>,
    pub wall_s: f64,
    pub rescored: bool,
}

impl std::fmt::Display for RunSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &self.stats;
        let fmt_opt = |v: Option<f64>| v.map_or("-".to_string(), |x| format!("{x:.3}"));
        writeln!(f, "run            {}", self.output)?;
        writeln!(
            f,
            "tasks          {} total: {} finished before, {} now, {} failed",
            self.tasks_total,
            self.tasks_done_before,
            self.tasks_done_now,
            self.tasks_failed.len()
        )?;
        writeln!(
            f,
            "turns          {} ({} candidates, {} sessions)",
            s.turns, s.candidates, s.sessions
        )?;
        writeln!(
            f,
            "pairs          {} train + {} test",
            s.pairs_train, s.pairs_test
        )?;
        writeln!(
            f,
            "mean MR        chosen {} vs rejected {}",
            fmt_opt(s.mean_mr_chosen),
            fmt_opt(s.mean_mr_rejected)
        )?;
        if !s.turns_without_pair.is_empty() {
            let why: Vec<String> = s
                .turns_without_pair
                .iter()
                .map(|(k, v)| format!("{v} {k}"))
                .collect();
            writeln!(f, "no pair        {}", why.join(", "))?;
        }
        writeln!(
            f,
            "truncated      {} candidate(s) cut at their token cap",
            s.candidates_truncated
        )?;
        if let Some(rate) = s.accuracy_disagreement_rate {
            writeln!(
                f,
                "accuracy       judge vs explicit answer disagree in {}/{} sessions ({:.1}%)",
                s.accuracy_disagreements,
                s.accuracy_checks,
                100.0 * rate
            )?;
        }
        let missing: usize = s.missing_scores.values().sum();
        writeln!(
            f,
            "judge failures {missing} missing scores {:?}",
            s.missing_scores
        )?;
        write!(f, "{}", usage_table(&self.usage, 10))?;
        for (task, err) in &self.tasks_failed {
            writeln!(f, "failed         {task}: {err}")?;
        }
        write!(f, "wall time      {:.1} s", self.wall_s)
    }
}

/// The tasks of a config, loaded and checked ([`crate::rollout::config::load_tasks`]).
pub async fn fetch_config_tasks(cfg: &GenerateConfig) -> anyhow::Result<Vec<Task>> {
    crate::rollout::config::load_tasks(&cfg.task_source()).await
}

fn load_prompts(cfg: &GenerateConfig) -> anyhow::Result<Prompts> {
    Ok(match &cfg.rollout.prompts {
        Some(dir) => Prompts::from_dir(dir)?,
        None => Prompts::builtin()?,
    })
}

/// The usage table of a summary, one row per role. `retries` adds endpoint retries and
/// re-asks of unusable answers (a re-ask is also one of the `calls`).
fn usage_table(usage: &BTreeMap<String, UsageSnapshot>, width: usize) -> String {
    let mut out = format!(
        "{:<width$} {:>7} {:>7} {:>9} {:>11} {:>8} {:>8}\n",
        "role", "calls", "cached", "prompt", "completion", "retries", "failed"
    );
    for (role, u) in usage {
        out.push_str(&format!(
            "{:<width$} {:>7} {:>7} {:>9} {:>11} {:>8} {:>8}\n",
            role,
            u.calls,
            u.cache_hits,
            u.prompt_tokens,
            u.completion_tokens,
            u.retries + u.reasks,
            u.failures
        ));
    }
    out
}

/// An upper bound on one role's model calls in a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallBound {
    /// Every call, first asks and re-asks (endpoint retries of a call are not calls).
    pub calls: u64,
    /// Of `calls`, the re-asks after unusable answers (judge replies without a score,
    /// simulator replies without a message).
    pub reasks: u64,
}

impl std::ops::AddAssign for CallBound {
    fn add_assign(&mut self, o: Self) {
        self.calls += o.calls;
        self.reasks += o.reasks;
    }
}

impl CallBound {
    /// `first` first asks, each re-asked at most `retries` times.
    fn asks(first: u64, retries: u32) -> Self {
        let reasks = first * u64::from(retries);
        Self {
            calls: first + reasks,
            reasks,
        }
    }
}

/// Upper bounds per role on the model calls of a run over `tasks` (cached calls included:
/// the bound is what an empty cache could cost).
pub fn call_bounds(cfg: &GenerateConfig, tasks: &[Task]) -> BTreeMap<String, CallBound> {
    let n = cfg.candidates as u64;
    let s = cfg.future_cap() as u64;
    let w = cfg.window as u64;
    // A future holds W messages: its opener, then assistant and user messages in turn.
    let (future_assistant, future_user) = (w / 2, w.saturating_sub(1) / 2);
    let turns = (cfg.max_messages as u64)
        .saturating_sub(1)
        .div_ceil(2)
        .max(1);
    let candidate_calls =
        u64::from(cfg.proactive_count() > 0) + u64::from(cfg.candidates > cfg.proactive_count());
    let assistant = if cfg.assistant.is_some() {
        "assistant"
    } else {
        "policy"
    };
    let mut out: BTreeMap<String, CallBound> = BTreeMap::new();
    for t in tasks {
        let weights = if cfg.metrics.is_empty() {
            default_weights(t.task_type)
        } else {
            cfg.metrics.clone()
        };
        let llm_metrics = weights.keys().filter(|m| *m != "token_amount").count() as u64;
        // The opening message; per turn, one call for each candidate's S+1 openers (every
        // sample redrawn alone when unusable) — adaptive: one call per future and one for the
        // next user message — and the futures' later user messages.
        let opener_calls = if cfg.adaptive.is_some() {
            turns * (n * s + 1)
        } else {
            turns * n
        };
        let opener_reasks = turns * n * (s + 1) * u64::from(cfg.rollout.user_retries);
        let mut user = CallBound::asks(1, cfg.rollout.user_retries);
        user += CallBound {
            calls: opener_calls + opener_reasks,
            reasks: opener_reasks,
        };
        user += CallBound::asks(turns * n * s * future_user, cfg.rollout.user_retries);
        *out.entry("user".into()).or_default() += user;
        *out.entry("policy".into()).or_default() += CallBound {
            calls: turns * candidate_calls,
            reasks: 0,
        };
        *out.entry(assistant.into()).or_default() += CallBound {
            calls: turns * n * s * future_assistant,
            reasks: 0,
        };
        *out.entry("judge".into()).or_default() +=
            CallBound::asks(turns * n * s * llm_metrics, cfg.rollout.judge_retries);
    }
    out
}

/// The plan of a run and an upper bound on its model calls, re-asks of unusable answers
/// included (endpoint retries are not; cached calls are free).
pub fn plan(cfg: &GenerateConfig, tasks: &[Task]) -> String {
    let n = cfg.candidates as u64;
    let s = cfg.future_cap() as u64;
    let w = cfg.window as u64;
    let turns = (cfg.max_messages as u64)
        .saturating_sub(1)
        .div_ceil(2)
        .max(1);
    let candidate_calls =
        u64::from(cfg.proactive_count() > 0) + u64::from(cfg.candidates > cfg.proactive_count());
    let bounds = call_bounds(cfg, tasks);
    let total = bounds.values().fold(CallBound::default(), |mut a, b| {
        a += *b;
        a
    });
    let mut table = format!("{:<10} {:>9} {:>9}\n", "role", "calls", "retries");
    for (role, b) in &bounds {
        table.push_str(&format!("{role:<10} {:>9} {:>9}\n", b.calls, b.reasks));
    }
    format!(
        "tasks {} from {}\nroles: policy {}, user {}, judge {}, assistant {}\n\
         N={} candidates ({} proactive), S={} futures{}, window {}, max {} messages (up to {} turns)\n\
         metrics {}\n\
         per turn: {candidate_calls} candidate call(s), {n} simulator call(s) opening {s} future(s) each, \
         {} future message call(s), one judge/extraction call per future and model-scored metric\n\
         re-asks of unusable answers: at most {} per simulator sample, {} per judge call\n\
         upper bounds (retries: re-asks of unusable answers; endpoint retries come on top)\n{table}\
         model calls: at most {} ({} of them re-asks; cached calls cost nothing)",
        tasks.len(),
        cfg.tasks,
        cfg.policy,
        cfg.rollout.user,
        cfg.rollout.judge,
        cfg.assistant_spec(),
        cfg.candidates,
        cfg.proactive_count(),
        cfg.future_cap(),
        match &cfg.adaptive {
            Some(r) => format!(
                " at most (adaptive: {} each, more while best or worst is in doubt at z {})",
                r.min_futures, r.z
            ),
            None => String::new(),
        },
        cfg.window,
        cfg.max_messages,
        turns,
        if cfg.metrics.is_empty() {
            "task-type defaults".to_string()
        } else {
            format!("{:?}", cfg.metrics)
        },
        n * s * w.saturating_sub(1),
        cfg.rollout.user_retries,
        cfg.rollout.judge_retries,
        total.calls,
        total.reasks,
    )
}

/// Refuses to resume a run directory made with different generation settings.
fn check_resume(cfg: &GenerateConfig) -> anyhow::Result<()> {
    let path = cfg.output.join(MANIFEST_FILE);
    let changed = changed_settings(&path, "generation_identity", &cfg.generation_identity())?;
    if !changed.is_empty() {
        bail!(
            "{} was made with different settings ({}); resume with the same settings, \
             or choose a new --output (weights, --min-gap, --pairs, --balance-by and \
             --mr-formula may change: they only re-score)",
            cfg.output.display(),
            changed.join(", ")
        );
    }
    Ok(())
}

fn scoring(cfg: &GenerateConfig) -> Scoring {
    Scoring {
        weights: (!cfg.metrics.is_empty()).then(|| cfg.metrics.clone()),
        formula: cfg.mr_formula,
        min_gap: cfg.min_gap,
        pairs: cfg.pairs,
        balance: cfg.balance(),
        test_fraction: cfg.test_fraction,
        seed: cfg.seed,
    }
}

/// Usage recorded by earlier invocations in a run directory's manifest (see
/// [`recorded_usage`]); empty for a new run.
pub fn earlier_usage(manifest: &Path) -> BTreeMap<String, UsageSnapshot> {
    recorded_usage(manifest)
}

/// What the manifest says beyond the config: written when a run starts, after every finished
/// conversation (so a killed run still accounts for its calls), and at the end.
struct ManifestWriter<'a> {
    cfg: &'a GenerateConfig,
    roles: &'a Roles,
    started_at: f64,
    token_counter: String,
    prompts_source: String,
    /// The request cache whose usage records give `usage_total`, if the run has one.
    ledger: Option<Arc<RequestCache>>,
    /// Usage no usage record holds: the manifest's total from before the cache log had
    /// usage records, or (without a cache) from earlier invocations.
    earlier: BTreeMap<String, UsageSnapshot>,
}

impl ManifestWriter<'_> {
    fn new<'a>(
        cfg: &'a GenerateConfig,
        roles: &'a Roles,
        ledger: Option<Arc<RequestCache>>,
        token_counter: String,
        prompts_source: String,
    ) -> ManifestWriter<'a> {
        let earlier = match &ledger {
            Some(c) if c.had_usage_records() => BTreeMap::new(),
            _ => recorded_usage(&cfg.output.join(MANIFEST_FILE)),
        };
        ManifestWriter {
            cfg,
            roles,
            started_at: now_secs(),
            token_counter,
            prompts_source,
            ledger,
            earlier,
        }
    }

    /// Every invocation's usage: what the cache log records was sent, or (without one)
    /// this invocation's meters.
    fn total(&self, now: &BTreeMap<String, UsageSnapshot>) -> BTreeMap<String, UsageSnapshot> {
        match &self.ledger {
            Some(c) => add_usage(&self.earlier, &c.usage_totals()),
            None => add_usage(&self.earlier, now),
        }
    }

    fn write(
        &self,
        status: RunStatus,
        stats: Option<&DatasetStats>,
        failed: &[(String, String)],
    ) -> anyhow::Result<()> {
        self.write_with(status, stats, failed, None)
    }

    fn write_with(
        &self,
        status: RunStatus,
        stats: Option<&DatasetStats>,
        failed: &[(String, String)],
        signal: Option<crate::run::Signal>,
    ) -> anyhow::Result<()> {
        let usage = self.roles.usage();
        let total = self.total(&usage);
        let header = ManifestHeader::now(
            "collabllm-rs generate_conv",
            self.started_at,
            status,
            signal,
        );
        let m = header.with_fields(serde_json::json!({
            "config": self.cfg,
            "generation_identity": self.cfg.generation_identity(),
            "seed": self.cfg.seed,
            "prompts": self.prompts_source,
            "token_amount_tokenizer": self.token_counter,
            "counts": stats,
            "failed_tasks": failed,
            // This invocation, and every invocation on this directory.
            "usage": usage,
            "usage_total": total,
            // This invocation's calls per endpoint, for roles on an endpoint pool.
            "endpoint_calls": self.roles.endpoint_calls(),
            "cost_usd": self.roles.cost(&total, &self.cfg.rollout.prices),
        }));
        outputs::write_json_atomic(&self.cfg.output.join(MANIFEST_FILE), &m)?;
        Ok(())
    }
}

/// Runs (or resumes) generation with roles built from the config's specs.
pub async fn generate(cfg: GenerateConfig) -> anyhow::Result<RunSummary> {
    generate_until(cfg, &Shutdown::never()).await
}

/// [`generate`] that stops on `shutdown`'s signal: before the run starts, at once; after,
/// once the finished conversations' outputs and an `interrupted` manifest are written. Either
/// way it returns [`Interrupted`].
pub async fn generate_until(
    cfg: GenerateConfig,
    shutdown: &Shutdown,
) -> anyhow::Result<RunSummary> {
    let tasks = shutdown.guard(fetch_config_tasks(&cfg)).await??;
    let (lock, prompts) = prepare(&cfg)?;
    let cache = RequestCache::open(cfg.output.join("cache"))?;
    let roles = shutdown
        .guard(Roles::from_config(&cfg, Some(cache.clone())))
        .await??;
    let run = Prepared {
        _lock: lock,
        prompts,
        ledger: Some(cache),
    };
    run_prepared(cfg, tasks, roles, run, shutdown).await
}

/// Runs (or resumes) generation with the given roles (tests inject scripted backends).
pub async fn generate_with_roles(
    cfg: GenerateConfig,
    tasks: Vec<Task>,
    roles: Roles,
) -> anyhow::Result<RunSummary> {
    let (lock, prompts) = prepare(&cfg)?;
    let run = Prepared {
        _lock: lock,
        prompts,
        ledger: None,
    };
    run_prepared(cfg, tasks, roles, run, &Shutdown::never()).await
}

/// What a run holds from set-up to the end.
struct Prepared {
    /// This process is the run directory's only writer while this lives.
    _lock: RunLock,
    prompts: Arc<Prompts>,
    /// The request cache whose usage records are the run's durable spend.
    ledger: Option<Arc<RequestCache>>,
}

/// Everything checked before any model is loaded or called: settings, prompts, that no other
/// process writes the run directory, and that it may be (re)used with these settings.
fn prepare(cfg: &GenerateConfig) -> anyhow::Result<(RunLock, Arc<Prompts>)> {
    cfg.validate()?;
    let prompts = Arc::new(load_prompts(cfg)?);
    // A missing or empty system prompt file fails here, before any model loads.
    if let Some(source) = &cfg.system_prompt {
        source.text(&prompts, cfg.task_type.unwrap_or_default())?;
    }
    std::fs::create_dir_all(&cfg.output)
        .with_context(|| format!("creating {}", cfg.output.display()))?;
    let lock = RunLock::acquire(&cfg.output)?;
    check_resume(cfg)?;
    Ok((lock, prompts))
}

async fn run_prepared(
    cfg: GenerateConfig,
    tasks: Vec<Task>,
    roles: Roles,
    run: Prepared,
    shutdown: &Shutdown,
) -> anyhow::Result<RunSummary> {
    let started = Instant::now();
    let prompts = run.prompts.clone();
    let (mut log, done_records) = ConversationLog::open(&cfg.output)?;
    let done: HashSet<String> = done_records.iter().map(|r| r.task_id.clone()).collect();
    let pending: Vec<Task> = tasks
        .iter()
        .filter(|t| !done.contains(&t.id))
        .cloned()
        .collect();

    let tokens = TokenCounter::of_kind(cfg.token_counter, roles.policy.engine.as_ref())
        .map_err(anyhow::Error::msg)?;
    let token_name = tokens.name();
    let Simulated { user, judge } = Simulated::new(
        roles.user.clone(),
        roles.judge.clone(),
        &cfg.rollout,
        prompts.clone(),
        cfg.oracle,
    );
    let pipeline = Arc::new(Pipeline {
        prompts: prompts.clone(),
        policy: roles.policy.clone(),
        assistant: roles.assistant.clone(),
        user,
        system_prompt: cfg.system_prompt.clone(),
        scorer: Scorer {
            judge,
            tokens,
            sandbox: SandboxLimits {
                wall_timeout: Duration::from_secs_f64(cfg.rollout.sandbox_timeout_s),
                ..SandboxLimits::default()
            },
        },
        cfg: cfg.clone(),
    });
    let manifest = ManifestWriter::new(
        &cfg,
        &roles,
        run.ledger.clone(),
        token_name,
        prompts.source.clone(),
    );
    manifest.write(RunStatus::Running, None, &[])?;

    let progress = Progress::new(pending.len(), done.len(), tasks.len());
    let ticker = progress.spawn_ticker(roles.clone());
    let mut failed = Vec::new();
    let mut finished_now = 0;
    let jobs = pending.into_iter().map(|task| {
        let p = pipeline.clone();
        async move {
            let (r, usage) = with_usage_scope(p.run(&task)).await;
            let r = r.map(|mut record| {
                record.usage = usage;
                record
            });
            (task, r)
        }
    });
    let interrupted = drive_jobs(jobs, cfg.rollout.concurrency, shutdown, |(task, result)| {
        match result {
            Ok(record) => {
                log.append(&record)?;
                finished_now += 1;
                progress.finished(&record, &pipeline);
                manifest.write(RunStatus::Running, None, &failed)?;
            }
            Err(e) => {
                tracing::warn!(task = %task.id, error = %e, "conversation failed; a rerun retries it");
                progress.failed();
                failed.push((task.id.clone(), e.to_string()));
            }
        }
        anyhow::Ok(())
    })
    .await?;
    ticker.abort();
    progress.finish();

    let records = read_records(&cfg.output)?;
    let built = outputs::build(&records, &scoring(&cfg))?;
    outputs::write(&cfg.output, &built)?;
    let stats = built.stats;
    let usage = roles.usage();
    let status = RunStatus::at_end(interrupted, failed.len());
    manifest.write_with(status, Some(&stats), &failed, interrupted)?;
    if let Some(signal) = interrupted {
        return Err(Interrupted::new(signal).into());
    }
    Ok(RunSummary {
        output: cfg.output.display().to_string(),
        tasks_total: tasks.len(),
        tasks_done_before: done.len(),
        tasks_done_now: finished_now,
        tasks_failed: failed,
        stats,
        usage,
        wall_s: started.elapsed().as_secs_f64(),
        rescored: false,
    })
}

/// Rebuilds MR, pairs, flat rows and the manifest's counts from `conversations.jsonl` with the
/// config's weights, formula, gap and pair mode. Makes no model call.
pub fn rescore(cfg: &GenerateConfig) -> anyhow::Result<RunSummary> {
    let started = Instant::now();
    // (A missing directory is reported by the read below.)
    let _lock = match cfg.output.is_dir() {
        true => Some(RunLock::acquire(&cfg.output)?),
        false => None,
    };
    let records: Vec<ConversationRecord> = read_records(&cfg.output)?;
    if records.is_empty() {
        bail!(
            "{}: no finished conversations to re-score",
            cfg.output.display()
        );
    }
    let built = outputs::build(&records, &scoring(cfg))?;
    outputs::write(&cfg.output, &built)?;
    let stats = built.stats;
    let path = cfg.output.join(MANIFEST_FILE);
    let mut m: serde_json::Value = std::fs::read_to_string(&path)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_else(|| serde_json::json!({}));
    m["counts"] = serde_json::to_value(&stats)?;
    m["rescored"] = serde_json::json!({
        "at": now_secs(),
        "metrics": cfg.metrics, "mr_formula": cfg.mr_formula,
        "min_gap": cfg.min_gap, "pairs": cfg.pairs,
        "balance_by": cfg.balance_by, "balance_within": cfg.balance_within,
    });
    outputs::write_json_atomic(&path, &m)?;
    Ok(RunSummary {
        output: cfg.output.display().to_string(),
        tasks_total: records.len(),
        tasks_done_before: records.len(),
        tasks_done_now: 0,
        tasks_failed: Vec::new(),
        stats,
        usage: BTreeMap::new(),
        wall_s: started.elapsed().as_secs_f64(),
        rescored: true,
    })
}

/// Progress bars: tasks, and a live line of calls, tokens, pairs and call rate.
struct Progress {
    multi: indicatif::MultiProgress,
    tasks: indicatif::ProgressBar,
    status: indicatif::ProgressBar,
    pairs: Arc<AtomicUsize>,
    failed: Arc<AtomicUsize>,
}

impl Progress {
    fn new(pending: usize, done: usize, total: usize) -> Self {
        let multi = indicatif::MultiProgress::new();
        let tasks = multi.add(indicatif::ProgressBar::new(total as u64));
        tasks.set_style(
            indicatif::ProgressStyle::with_template(
                "tasks {bar:30} {pos}/{len} [{elapsed_precise} < {eta_precise}] {msg}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        tasks.set_position(done as u64);
        tasks.set_message(format!("{pending} to do"));
        let status = multi.add(indicatif::ProgressBar::new_spinner());
        Self {
            multi,
            tasks,
            status,
            pairs: Arc::new(AtomicUsize::new(0)),
            failed: Arc::new(AtomicUsize::new(0)),
        }
    }

    fn spawn_ticker(&self, roles: Roles) -> tokio::task::JoinHandle<()> {
        let status = self.status.clone();
        let pairs = self.pairs.clone();
        let failed = self.failed.clone();
        let start = Instant::now();
        tokio::spawn(async move {
            loop {
                let u = roles
                    .usage()
                    .values()
                    .fold(UsageSnapshot::default(), |a, b| a + *b);
                let rate = u.calls as f64 / start.elapsed().as_secs_f64().max(1e-3);
                status.set_message(format!(
                    "calls {} ({rate:.1}/s, {} cached, {} retries) · tokens {} in / {} out · pairs {} · failed tasks {}",
                    u.calls,
                    u.cache_hits,
                    u.retries,
                    u.prompt_tokens,
                    u.completion_tokens,
                    pairs.load(Ordering::Relaxed),
                    failed.load(Ordering::Relaxed)
                ));
                status.tick();
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        })
    }

    fn finished(&self, rec: &ConversationRecord, p: &Pipeline) {
        let mut n = 0;
        for turn in &rec.turns {
            // The MR each candidate was chosen by, under the run's own weights.
            let mrs: Vec<Option<f64>> = turn.candidates.iter().map(|c| c.mr).collect();
            let actions: Vec<_> = turn
                .candidates
                .iter()
                .map(|c| rec.task_type.action_of(&c.text))
                .collect();
            n += select_pairs(&mrs, &actions, p.cfg.min_gap, p.cfg.pairs).len();
        }
        self.pairs.fetch_add(n, Ordering::Relaxed);
        self.tasks.inc(1);
    }

    fn failed(&self) {
        self.failed.fetch_add(1, Ordering::Relaxed);
        self.tasks.inc(1);
    }

    fn finish(&self) {
        self.tasks.finish_and_clear();
        self.status.finish_and_clear();
        let _ = self.multi.clear();
    }
}
