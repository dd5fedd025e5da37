//! A whole `eval_multiturn` run: models × (tasks or objects) × repeats, concurrent, cached
//! (`<output>/cache`) and resumable (`conversations/<model>.jsonl`, append-only; finished
//! conversations are skipped on restart), then `summary.json`, `summary.csv`, `lmrl/` (20
//! Questions) and `manifest.json`.
//!
//! One process writes an output directory at a time ([`RunLock`]); a signal (with
//! [`evaluate_until`]) stops the run between conversations with status `interrupted`; the
//! manifest's `usage_total` comes from the request cache log's usage records (kills included).

use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use super::config::{model_labels, EvalConfig, EvalModel, OracleChoice};
use super::dialogue::{DialogueModel, DialogueRunner, Speaker};
use super::games::{
    dagger_conv_prefix, games_as_dagger_rows, play_game, won_games_as_sft, GameSettings, Player,
};
use super::overlap;
use super::records::{read_records, RecordLog};
use super::summary::{summarize_dialogues, summarize_games, write_atomic, Summary};
use crate::llm::cache::RequestCache;
use crate::llm::local::LoadOptions;
use crate::llm::roles::{roles_cost_usd, Role};
use crate::llm::tokens::TokenCounter;
use crate::llm::usage::recorded_usage;
use crate::llm::{add_usage, Price, UsageSnapshot};
use crate::reward::metrics::{task_metric, Scorer};
use crate::reward::sandbox::SandboxLimits;
use crate::rollout::simulated::{simulated_roles, Simulated};
use crate::rollout::user::Sampling;
use crate::run::{
    changed_settings, drive_jobs, now_secs, write_json_atomic, Interrupted, ManifestHeader,
    RunLock, RunStatus, Shutdown,
};
use crate::task::prompts::{Prompts, SystemPromptSource};
use crate::task::twenty_questions::chat::split_objects;
use crate::task::twenty_questions::{lmrl_transcript, GameRecord, World};
use crate::task::{Task, TaskType};

pub const MANIFEST_FILE: &str = "manifest.json";
pub const CONVERSATIONS_DIR: &str = "conversations";
pub const LMRL_DIR: &str = "lmrl";
pub const SFT_DIR: &str = "sft";

/// The roles of a run. `models` has one entry per configured model (`None` for the built-in
/// questioners); `user` and `judge` serve math/doc_edit/code, `oracle` an LLM oracle.
#[derive(Clone, Debug)]
pub struct EvalRoles {
    pub models: Vec<Option<Role>>,
    pub user: Option<Role>,
    pub judge: Option<Role>,
    pub oracle: Option<Role>,
}

impl EvalRoles {
    /// Builds the roles the task needs from the config's specs (local models load once).
    pub async fn from_config(
        cfg: &EvalConfig,
        cache: Option<Arc<RequestCache>>,
    ) -> anyhow::Result<EvalRoles> {
        let load = LoadOptions {
            weights: cfg.weights,
            ..LoadOptions::default()
        };
        let build = |name: String, spec| {
            let cache = cache.clone();
            async move { Role::build(&name, spec, &cfg.rollout.endpoint, &load, cache).await }
        };
        let mut models = Vec::new();
        // Named as the manifest's usage names them, so the cache log's usage records are too.
        for (m, label) in cfg.models.iter().zip(model_labels(&cfg.models)) {
            models.push(match m.spec() {
                Some(s) => Some(build(format!("model:{label}"), s).await?),
                None => None,
            });
        }
        let dialogue = !cfg.task.is_game();
        let (user, judge) = if dialogue {
            let (user, judge) = simulated_roles(&cfg.rollout, &load, cache.clone()).await?;
            (Some(user), Some(judge))
        } else {
            (None, None)
        };
        let oracle = match (cfg.oracle.model(), dialogue) {
            (Some(s), false) => Some(build("oracle".into(), s).await?),
            _ => None,
        };
        Ok(EvalRoles {
            models,
            user,
            judge,
            oracle,
        })
    }
}

/// What a run did.
#[derive(Clone, Debug)]
pub struct EvalReport {
    pub output: PathBuf,
    pub summary: Summary,
    /// Conversations (or games) in the selection, over all models.
    pub planned: usize,
    pub done_before: usize,
    pub done_now: usize,
    /// (model, task id or object#repeat, error).
    pub failed: Vec<(String, String, String)>,
    pub usage: BTreeMap<String, UsageSnapshot>,
    pub warnings: Vec<String>,
    pub wall_s: f64,
}

impl std::fmt::Display for EvalReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "output   {}", self.output.display())?;
        writeln!(
            f,
            "work     {} conversation(s): {} finished before, {} now, {} failed ({:.1} s)",
            self.planned,
            self.done_before,
            self.done_now,
            self.failed.len(),
            self.wall_s
        )?;
        writeln!(f)?;
        write!(f, "{}", self.summary.table())?;
        if !self.usage.is_empty() {
            writeln!(f)?;
            writeln!(
                f,
                "{:<24} {:>7} {:>7} {:>9} {:>11} {:>8} {:>8}",
                "role", "calls", "cached", "prompt", "completion", "retries", "failed"
            )?;
            for (role, u) in &self.usage {
                writeln!(
                    f,
                    "{:<24} {:>7} {:>7} {:>9} {:>11} {:>8} {:>8}",
                    role,
                    u.calls,
                    u.cache_hits,
                    u.prompt_tokens,
                    u.completion_tokens,
                    // Endpoint retries and re-asks of unusable answers.
                    u.retries + u.reasks,
                    u.failures
                )?;
            }
        }
        for w in &self.warnings {
            writeln!(f, "warning  {w}")?;
        }
        for (m, item, e) in &self.failed {
            writeln!(f, "failed   {m} {item}: {e}")?;
        }
        Ok(())
    }
}

/// The conversations to play, before the models are known.
enum Work {
    Dialogue(Arc<Vec<Task>>),
    Games {
        world: Arc<World>,
        objects: Vec<usize>,
    },
}

/// One unit of work: (index into the task/object list, repeat) and its resume key.
#[derive(Clone, Debug)]
struct Item {
    index: usize,
    repeat: usize,
    key: String,
}

struct Prepared {
    /// This process is the output directory's only writer while this lives.
    _lock: RunLock,
    prompts: Arc<Prompts>,
    work: Work,
    items: Vec<Item>,
    warnings: Vec<String>,
}

fn dialogue_key(task_id: &str, repeat: usize) -> String {
    format!("{task_id}#{repeat}")
}

fn game_key(object: usize, repeat: usize) -> String {
    format!("object {object}#{repeat}")
}

/// The resume key of a stored record.
fn record_key(task: TaskType, rec: &serde_json::Value) -> Option<String> {
    let repeat = rec["repeat"].as_u64().unwrap_or(0) as usize;
    if task.is_game() {
        rec["game"]["object_index"]
            .as_u64()
            .map(|o| game_key(o as usize, repeat))
    } else {
        rec["task_id"].as_str().map(|t| dialogue_key(t, repeat))
    }
}

/// Loads and checks the tasks (or objects), the prompts and the exclusion runs; prepares the
/// output directory. Nothing here loads or calls a model.
async fn prepare(cfg: &EvalConfig) -> anyhow::Result<Prepared> {
    cfg.validate()?;
    let prompts = Arc::new(match &cfg.rollout.prompts {
        Some(dir) => Prompts::from_dir(dir)?,
        None => Prompts::builtin()?,
    });
    // A missing or empty system prompt file fails here, before any model loads.
    if let Some(source) = &cfg.system_prompt {
        source.text(&prompts, cfg.task)?;
    }
    let (work, warnings) = if cfg.task.is_game() {
        let world = World::load_default()?;
        let mut objects = split_objects(&world, cfg.split);
        objects.truncate(cfg.objects.count(objects.len())?);
        let warnings = overlap::check(&cfg.exclude_runs, cfg.allow_overlap, |run| {
            overlap::shared_objects(&world, &objects, run)
        })?;
        (
            Work::Games {
                world: Arc::new(world),
                objects,
            },
            warnings,
        )
    } else {
        let tasks = crate::rollout::config::load_tasks(&cfg.task_source()).await?;
        let warnings = overlap::check(&cfg.exclude_runs, cfg.allow_overlap, |run| {
            overlap::shared_tasks(&tasks, run)
        })?;
        (Work::Dialogue(Arc::new(tasks)), warnings)
    };
    let mut items = Vec::new();
    for repeat in 0..cfg.repeats {
        match &work {
            Work::Dialogue(tasks) => {
                items.extend(tasks.iter().enumerate().map(|(index, t)| Item {
                    index,
                    repeat,
                    key: dialogue_key(&t.id, repeat),
                }))
            }
            Work::Games { objects, .. } => items.extend(objects.iter().map(|&o| Item {
                index: o,
                repeat,
                key: game_key(o, repeat),
            })),
        }
    }
    std::fs::create_dir_all(&cfg.output)
        .with_context(|| format!("creating {}", cfg.output.display()))?;
    let lock = RunLock::acquire(&cfg.output)?;
    check_resume(cfg)?;
    Ok(Prepared {
        _lock: lock,
        prompts,
        work,
        items,
        warnings,
    })
}

/// Refuses to reuse an output directory made with different settings.
fn check_resume(cfg: &EvalConfig) -> anyhow::Result<()> {
    let path = cfg.output.join(MANIFEST_FILE);
    let changed = changed_settings(&path, "identity", &cfg.identity())?;
    if !changed.is_empty() {
        bail!(
            "{} holds an evaluation made with different settings ({}); use the same settings \
             to resume or add models, or choose a new --output",
            cfg.output.display(),
            changed.join(", ")
        );
    }
    Ok(())
}

/// Runs (or resumes) an evaluation with roles built from the config's specs.
pub async fn evaluate(cfg: EvalConfig) -> anyhow::Result<EvalReport> {
    evaluate_until(cfg, &Shutdown::never()).await
}

/// [`evaluate`] that stops on `shutdown`'s signal: during set-up at once; after, once the
/// summaries of the finished conversations and an `interrupted` manifest are written. Either
/// way it returns [`Interrupted`].
pub async fn evaluate_until(cfg: EvalConfig, shutdown: &Shutdown) -> anyhow::Result<EvalReport> {
    // Reading the tasks may download them from the Hub: a signal stops that too.
    let prepared = shutdown.guard(prepare(&cfg)).await??;
    let cache = RequestCache::open(cfg.output.join("cache"))?;
    let roles = shutdown
        .guard(EvalRoles::from_config(&cfg, Some(cache.clone())))
        .await??;
    run_prepared(cfg, prepared, roles, Some(cache), shutdown).await
}

/// Runs (or resumes) an evaluation with the given roles (tests inject scripted backends).
pub async fn evaluate_with_roles(cfg: EvalConfig, roles: EvalRoles) -> anyhow::Result<EvalReport> {
    let prepared = prepare(&cfg).await?;
    run_prepared(cfg, prepared, roles, None, &Shutdown::never()).await
}

/// Puts the system prompt on each model row that has one: `proactive:` rows the proactive
/// prompt, the others `--system-prompt` when given. Here, so hand-built roles get them too.
fn with_system_prompts(
    cfg: &EvalConfig,
    mut roles: EvalRoles,
    prompts: &Prompts,
) -> anyhow::Result<EvalRoles> {
    for (m, role) in cfg.models.iter().zip(roles.models.iter_mut()) {
        let source = match m {
            EvalModel::Proactive(_) => Some(SystemPromptSource::Proactive),
            EvalModel::Spec(_) => cfg.system_prompt.clone(),
            _ => None,
        };
        if let (Some(source), Some(r)) = (source, role.as_mut()) {
            let text = source.text(prompts, cfg.task)?;
            *r = r.with_system_prompt(&text);
        }
    }
    Ok(roles)
}

fn conversations_path(dir: &Path, label: &str) -> PathBuf {
    dir.join(CONVERSATIONS_DIR).join(format!("{label}.jsonl"))
}

type Job = Pin<Box<dyn Future<Output = (usize, String, Result<serde_json::Value, String>)> + Send>>;

/// The roles that call a model, under the names the manifest's usage uses.
fn named_roles<'a>(roles: &'a EvalRoles, labels: &[String]) -> Vec<(String, &'a Role)> {
    let models = labels
        .iter()
        .zip(&roles.models)
        .filter_map(|(label, r)| Some((format!("model:{label}"), r.as_ref()?)));
    let others = [
        ("user", &roles.user),
        ("judge", &roles.judge),
        ("oracle", &roles.oracle),
    ]
    .into_iter()
    .filter_map(|(name, r)| Some((name.to_string(), r.as_ref()?)));
    models.chain(others).collect()
}

fn usage(roles: &EvalRoles, labels: &[String]) -> BTreeMap<String, UsageSnapshot> {
    named_roles(roles, labels)
        .into_iter()
        .map(|(name, r)| (name, r.meter.snapshot()))
        .collect()
}

fn cost(
    roles: &EvalRoles,
    labels: &[String],
    usage: &BTreeMap<String, UsageSnapshot>,
    prices: &BTreeMap<String, Price>,
) -> serde_json::Value {
    roles_cost_usd(named_roles(roles, labels), usage, prices)
}

async fn run_prepared(
    cfg: EvalConfig,
    prepared: Prepared,
    roles: EvalRoles,
    ledger: Option<Arc<RequestCache>>,
    shutdown: &Shutdown,
) -> anyhow::Result<EvalReport> {
    let started = Instant::now();
    let started_at = now_secs();
    if roles.models.len() != cfg.models.len() {
        bail!(
            "{} model role(s) for {} configured model(s)",
            roles.models.len(),
            cfg.models.len()
        );
    }
    let labels = model_labels(&cfg.models);
    let roles = with_system_prompts(&cfg, roles, &prepared.prompts)?;
    let Prepared {
        _lock,
        prompts,
        work,
        items,
        warnings,
    } = prepared;
    // Usage no usage record of the cache log holds: a manifest's total from before the log
    // had them, or (without a cache) earlier invocations'.
    let earlier = match &ledger {
        Some(c) if c.had_usage_records() => BTreeMap::new(),
        _ => recorded_usage(&cfg.output.join(MANIFEST_FILE)),
    };
    let write_manifest = |status: RunStatus,
                          counts: serde_json::Value,
                          failed: &[(String, String, String)],
                          signal: Option<crate::run::Signal>| {
        let now = usage(&roles, &labels);
        let total = match &ledger {
            Some(c) => add_usage(&earlier, &c.usage_totals()),
            None => add_usage(&earlier, &now),
        };
        let header = ManifestHeader::now("collabllm-rs eval_multiturn", started_at, status, signal);
        let manifest = header.with_fields(serde_json::json!({
                "config": cfg,
                "identity": cfg.identity(),
                "seed": cfg.seed,
                "prompts": prompts.source,
                "models": labels.iter().zip(&cfg.models)
                    .map(|(l, m)| serde_json::json!({"name": l, "spec": m.to_string()}))
                    .collect::<Vec<_>>(),
                "counts": counts,
                "failed": failed,
                "warnings": warnings,
                // This invocation, and every invocation on this directory.
                "usage": now,
                "cost_usd": cost(&roles, &labels, &total, &cfg.rollout.prices),
                "usage_total": total,
        }));
        write_json_atomic(&cfg.output.join(MANIFEST_FILE), &manifest)?;
        anyhow::Ok(())
    };
    write_manifest(RunStatus::Running, serde_json::Value::Null, &[], None)?;
    let mut written_usage = usage(&roles, &labels);

    // Open every model's log; what is already there is skipped.
    let mut logs = Vec::new();
    let mut pending: Vec<(usize, Item)> = Vec::new();
    let mut done_before = 0;
    for (mi, label) in labels.iter().enumerate() {
        let (log, recs) = RecordLog::open(&conversations_path(&cfg.output, label))?;
        let done: HashSet<String> = recs
            .iter()
            .filter_map(|r| record_key(cfg.task, r))
            .collect();
        for it in &items {
            if done.contains(&it.key) {
                done_before += 1;
            } else {
                pending.push((mi, it.clone()));
            }
        }
        logs.push(log);
    }

    let jobs: Vec<Job> = match &work {
        Work::Dialogue(tasks) => dialogue_jobs(&cfg, &roles, &labels, &prompts, tasks, pending)?,
        Work::Games { world, .. } => game_jobs(&cfg, &roles, &labels, &prompts, world, pending),
    };
    let progress = indicatif::ProgressBar::new(jobs.len() as u64);
    progress.set_style(
        indicatif::ProgressStyle::with_template(
            "{prefix} {bar:30} {pos}/{len} [{elapsed_precise} < {eta_precise}] {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    progress.set_prefix(if matches!(work, Work::Games { .. }) {
        "games"
    } else {
        "conversations"
    });
    let mut failed = Vec::new();
    let mut done_now = 0;
    let signal = drive_jobs(jobs, cfg.rollout.concurrency, shutdown, |(mi, key, result)| {
        match result {
            Ok(rec) => {
                logs[mi].append(&rec)?;
                done_now += 1;
                // A killed run still accounts for the calls of what it finished (games
                // without a model make none: no rewrite for them).
                let now = usage(&roles, &labels);
                if now != written_usage {
                    write_manifest(RunStatus::Running, serde_json::Value::Null, &failed, None)?;
                    written_usage = now;
                }
            }
            Err(e) => {
                tracing::warn!(model = %labels[mi], item = %key, error = %e, "failed; a rerun retries it");
                failed.push((labels[mi].clone(), key, e));
            }
        }
        progress.inc(1);
        progress.set_message(format!("{} failed", failed.len()));
        anyhow::Ok(())
    })
    .await?;
    progress.finish_and_clear();

    let summary = summarize(&cfg, &labels, &items, &work)?;
    summary.write(&cfg.output)?;
    if cfg.sft {
        write_sft(&cfg, &labels, &items, &prompts)?;
    }
    if let Some(path) = &cfg.dagger {
        write_dagger(&cfg, path, &labels, &items, &prompts)?;
    }
    let counts = serde_json::json!({
        "planned": items.len() * labels.len(),
        "done_before": done_before,
        "done_now": done_now,
        "failed": failed.len(),
    });
    write_manifest(
        RunStatus::at_end(signal, failed.len()),
        counts,
        &failed,
        signal,
    )?;
    if let Some(signal) = signal {
        return Err(Interrupted::new(signal).into());
    }
    let mut warnings = warnings;
    warnings.extend(super::games::unparsed_warnings(&cfg.oracle, &summary));
    Ok(EvalReport {
        output: cfg.output.clone(),
        summary,
        planned: items.len() * labels.len(),
        done_before,
        done_now,
        failed,
        usage: usage(&roles, &labels),
        warnings,
        wall_s: started.elapsed().as_secs_f64(),
    })
}

fn dialogue_jobs(
    cfg: &EvalConfig,
    roles: &EvalRoles,
    labels: &[String],
    prompts: &Arc<Prompts>,
    tasks: &Arc<Vec<Task>>,
    pending: Vec<(usize, Item)>,
) -> anyhow::Result<Vec<Job>> {
    let (Some(user), Some(judge)) = (&roles.user, &roles.judge) else {
        bail!("math/doc_edit/code evaluation needs a user simulator and a judge role");
    };
    // Dialogue tasks only: 20 Questions evaluation plays its games through `games`.
    let Simulated { user, judge } = Simulated::new(
        user.clone(),
        judge.clone(),
        &cfg.rollout,
        prompts.clone(),
        Default::default(),
    );
    let metric = task_metric(cfg.task).unwrap_or("accuracy");
    let runner = Arc::new(DialogueRunner {
        user,
        task_metric: metric,
        max_turns: cfg.max_turns,
        sampling: cfg.assistant_sampling.clone(),
        seed: cfg.seed,
    });
    let mut models = Vec::new();
    for ((label, role), model) in labels.iter().zip(&roles.models).zip(&cfg.models) {
        let (speaker, engine) = match (model, role) {
            (EvalModel::Demonstrator, _) => {
                (Speaker::Demonstrator(cfg.clarify_demonstrator()), None)
            }
            (_, Some(role)) => (Speaker::Model(role.clone()), role.engine.as_ref()),
            (_, None) => bail!("model {label} has no backend"),
        };
        let tokens =
            TokenCounter::of_kind(cfg.token_counter, engine).map_err(anyhow::Error::msg)?;
        models.push(DialogueModel {
            label: label.clone(),
            speaker,
            scorer: Scorer {
                judge: judge.clone(),
                tokens,
                sandbox: SandboxLimits {
                    wall_timeout: Duration::from_secs_f64(cfg.rollout.sandbox_timeout_s),
                    ..SandboxLimits::default()
                },
            },
        });
    }
    let models = Arc::new(models);
    Ok(pending
        .into_iter()
        .map(|(mi, it)| {
            let (runner, models, tasks) = (runner.clone(), models.clone(), tasks.clone());
            Box::pin(async move {
                let r = runner
                    .run(&models[mi], &tasks[it.index], it.repeat)
                    .await
                    .map_err(|e| e.to_string());
                (mi, it.key, r)
            }) as Job
        })
        .collect())
}

fn game_jobs(
    cfg: &EvalConfig,
    roles: &EvalRoles,
    labels: &[String],
    prompts: &Arc<Prompts>,
    world: &Arc<World>,
    pending: Vec<(usize, Item)>,
) -> Vec<Job> {
    let settings = GameSettings {
        prompts: prompts.clone(),
        oracle: roles.oracle.clone(),
        hybrid: matches!(cfg.oracle, OracleChoice::Hybrid(_)),
        sampling: Sampling {
            max_tokens: cfg.question_max_tokens,
            ..cfg.assistant_sampling.clone()
        },
        max_questions: cfg.rollout.max_questions,
        seed: cfg.seed,
    };
    // `None`: a model spec without a backend (only possible with hand-built roles).
    let players: Vec<Option<Player>> = cfg
        .models
        .iter()
        .zip(&roles.models)
        .map(|(m, r)| match (m, r) {
            (EvalModel::Reference, _) => Some(Player::Reference),
            (EvalModel::Random, _) => Some(Player::Random),
            (EvalModel::Demonstrator, _) => Some(Player::Demonstrator),
            (_, r) => r.clone().map(Player::Model),
        })
        .collect();
    // A configured LLM oracle without a backend (hand-built roles) fails every game rather
    // than silently falling back to the table.
    let oracle_missing = cfg.oracle.model().is_some() && roles.oracle.is_none();
    pending
        .into_iter()
        .map(|(mi, it)| {
            let world = world.clone();
            let player = players[mi].clone();
            let label = labels[mi].clone();
            let settings = settings.clone();
            Box::pin(async move {
                let Some(player) = player else {
                    return (mi, it.key, Err(format!("model {label} has no backend")));
                };
                if oracle_missing {
                    return (mi, it.key, Err("the oracle has no backend".to_string()));
                }
                let handle = tokio::runtime::Handle::current();
                let r = tokio::task::spawn_blocking(move || {
                    play_game(
                        &world, &player, &label, &settings, &handle, it.index, it.repeat,
                    )
                })
                .await
                .unwrap_or_else(|e| Err(format!("game thread failed: {e}")));
                (mi, it.key, r)
            }) as Job
        })
        .collect()
}

/// Summaries from the records on disk (only the current selection; first record per key).
fn summarize(
    cfg: &EvalConfig,
    labels: &[String],
    items: &[Item],
    work: &Work,
) -> anyhow::Result<Summary> {
    let order: BTreeMap<&str, usize> = items
        .iter()
        .enumerate()
        .map(|(i, it)| (it.key.as_str(), i))
        .collect();
    let mut models = Vec::new();
    for (label, spec) in labels.iter().zip(&cfg.models) {
        let mut recs: Vec<(usize, serde_json::Value)> = Vec::new();
        let mut seen = HashSet::new();
        for r in read_records(&conversations_path(&cfg.output, label))? {
            let Some(key) = record_key(cfg.task, &r) else {
                continue;
            };
            if let Some(&pos) = order.get(key.as_str()) {
                if seen.insert(key) {
                    recs.push((pos, r));
                }
            }
        }
        recs.sort_by_key(|(pos, _)| *pos);
        let recs: Vec<serde_json::Value> = recs.into_iter().map(|(_, r)| r).collect();
        let spec_text = spec.to_string();
        let m = match work {
            Work::Dialogue(_) => summarize_dialogues(label, &spec_text, cfg.task, &recs)?,
            Work::Games { world, .. } => {
                write_lmrl(&cfg.output, label, world, &recs)?;
                summarize_games(label, &spec_text, &recs)?
            }
        };
        models.push(m);
    }
    Ok(Summary {
        task: cfg.task,
        seed: cfg.seed,
        tool_version: env!("CARGO_PKG_VERSION").to_string(),
        models,
    })
}

/// The records of `label`'s conversations that belong to the current selection (`keys`),
/// once each.
fn selected_records(
    cfg: &EvalConfig,
    label: &str,
    keys: &HashSet<&str>,
) -> anyhow::Result<Vec<serde_json::Value>> {
    let mut seen = HashSet::new();
    Ok(read_records(&conversations_path(&cfg.output, label))?
        .into_iter()
        .filter(|r| {
            record_key(cfg.task, r).is_some_and(|k| keys.contains(k.as_str()) && seen.insert(k))
        })
        .collect())
}

/// `sft/<model>.parquet`: each questioner's won games of the current selection as SFT
/// conversations (see [`won_games_as_sft`]); for dialogue tasks (the clarify demonstrator)
/// every conversation as it was played.
fn write_sft(
    cfg: &EvalConfig,
    labels: &[String],
    items: &[Item],
    prompts: &Prompts,
) -> anyhow::Result<()> {
    let games = cfg.task.is_game();
    let intro = if games {
        crate::task::twenty_questions::chat::intro_message(prompts, cfg.rollout.max_questions)?
    } else {
        String::new()
    };
    let keys: HashSet<&str> = items.iter().map(|it| it.key.as_str()).collect();
    let out = cfg.output.join(SFT_DIR);
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    for label in labels {
        let recs = selected_records(cfg, label, &keys)?;
        let rows = if games {
            won_games_as_sft(label, &intro, &recs).map_err(anyhow::Error::msg)?
        } else {
            conversations_as_sft(label, &recs)?
        };
        let path = out.join(format!("{label}.parquet"));
        if rows.is_empty() {
            // An empty file would train on nothing without a word; a stale one from an
            // earlier selection must not stand in for this one either.
            let _ = std::fs::remove_file(&path);
            tracing::warn!(
                "--sft: {label} {} no SFT data; {} not written",
                if games {
                    "won no game, so it has"
                } else {
                    "has"
                },
                path.display()
            );
            continue;
        }
        crate::dataset::sft::write_sft_parquet(&path, &rows)
            .with_context(|| format!("writing {}", path.display()))?;
        tracing::info!("{}: {} SFT conversations", path.display(), rows.len());
    }
    Ok(())
}

/// `--dagger FILE`: every state of each questioner's games of the current selection labelled
/// with the demonstrator's question ([`games_as_dagger_rows`]), merged into FILE: a
/// questioner's rows replace its earlier ones there (a rerun adds nothing twice), the other
/// questioners' rows stay, so rounds of DAgger grow one file. Written atomically.
fn write_dagger(
    cfg: &EvalConfig,
    path: &Path,
    labels: &[String],
    items: &[Item],
    prompts: &Prompts,
) -> anyhow::Result<()> {
    use crate::dataset::pairs::{read_pairs_parquet, write_pairs_parquet};
    let world = crate::task::twenty_questions::chat::default_world().map_err(anyhow::Error::msg)?;
    let intro =
        crate::task::twenty_questions::chat::intro_message(prompts, cfg.rollout.max_questions)?;
    let keys: HashSet<&str> = items.iter().map(|it| it.key.as_str()).collect();
    let mut rows = if path.is_file() {
        read_pairs_parquet(path).with_context(|| format!("reading {}", path.display()))?
    } else {
        Vec::new()
    };
    for label in labels {
        let recs = selected_records(cfg, label, &keys)?;
        let prefix = dagger_conv_prefix(label);
        rows.retain(|r| !r.conv_id.starts_with(&prefix));
        let new = games_as_dagger_rows(world, label, &intro, &recs).map_err(anyhow::Error::msg)?;
        tracing::info!("--dagger: {label}: {} labelled states", new.len());
        rows.extend(new);
    }
    write_pairs_parquet(path, &rows).with_context(|| format!("writing {}", path.display()))?;
    tracing::info!("{}: {} DAgger rows in all", path.display(), rows.len());
    Ok(())
}

/// Dialogue records as SFT conversations: every message as played, scored by the task
/// metric's value when the record has one.
fn conversations_as_sft(
    label: &str,
    recs: &[serde_json::Value],
) -> anyhow::Result<Vec<crate::dataset::sft::SftRow>> {
    recs.iter()
        .enumerate()
        .map(|(i, r)| {
            let messages: Vec<crate::llm::ChatMessage> = serde_json::from_value(r["turns"].clone())
                .with_context(|| format!("{label}: record {}: `turns`", i + 1))?;
            let score = r["metrics"]["task_reward"].as_f64().unwrap_or(f64::NAN);
            Ok(crate::dataset::sft::SftRow {
                messages,
                conv_id: format!(
                    "{label}-{}-{}",
                    r["task_id"].as_str().unwrap_or(""),
                    r["repeat"].as_u64().unwrap_or(0)
                ),
                score,
            })
        })
        .collect()
}

/// `lmrl/<model>.jsonl`: the games in LMRL-Gym's offline schema, in selection order.
fn write_lmrl(
    dir: &Path,
    label: &str,
    world: &World,
    recs: &[serde_json::Value],
) -> anyhow::Result<()> {
    let mut text = String::new();
    for (i, r) in recs.iter().enumerate() {
        let game: GameRecord = serde_json::from_value(r["game"].clone())
            .with_context(|| format!("{label}: record {i}: `game` is not a game record"))?;
        let object = world
            .objects
            .get(game.object_index)
            .with_context(|| format!("{label}: record {i}: no object {}", game.object_index))?;
        text.push_str(&serde_json::to_string(&lmrl_transcript(&game, object))?);
        text.push('\n');
    }
    let out = dir.join(LMRL_DIR);
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    write_atomic(&out.join(format!("{label}.jsonl")), text.as_bytes())?;
    Ok(())
}
