//! The `dpo_train` loop: data → tokenization → reference log-probs (cached
//! beside the data) → AdamW steps with accumulation, clipping and a warmup schedule → logs,
//! evaluation, checkpoints (HF or PEFT layout, optimizer state included) and `--resume`.
//!
//! The reference model is never held during training: its log-probs are computed once, before
//! the first step, by the policy itself (identical to the reference at that point; with LoRA
//! the adapters are switched off), and cached under a key of data, model and template hashes.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::train::error::{read_json, Result, TrainError};
use candle_core::{DType, Device, Tensor};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::dataset::sft::{is_sft_parquet, read_sft_parquet};
use crate::engine::peft::ADAPTER_WEIGHTS;
use crate::engine::{fingerprint, ChatCodec};
use crate::llm::spec::{redact_credentials, resolve_local, LocalModelFiles, ModelSpec};
use crate::llm::ChatMessage;
use crate::run::{write_atomic, write_json_atomic};

use super::batches::{BatchBy, BatchPlan};
use super::config::{parse_dtype, parse_save_dtype};
use super::config::{Objective, ResumeOverride, TrainConfig, RESUME_SETTINGS};
use super::loss::{dpo_loss, DpoMetrics};
use crate::train::adamw::{AdamW, AdamWParams};
use crate::train::data::{
    locate_data, locate_sft_data, read_pairs, tokenize_pairs, tokenize_sft,
    tokenize_sft_conversations, DataFiles, TokenizeStats, TokenizedSeq,
};
use crate::train::logps::{pair_logps_full, PairBatch, SeqBatch, Targets, TokenizedPair};
use crate::train::model::{adapter_base_name, non_finite_weight, BatchLayout, TrainLlama};
use crate::train::optim::{clip_grad_norm, warmup_steps};
use crate::train::settings::parse_device;

/// Bumped whenever tokenization changes what ids a row gets (invalidates reference caches).
const TOKENIZATION_VERSION: &str = "1";

/// The final state of a run (also written as `train_summary.json`).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct TrainSummary {
    pub steps: usize,
    pub total_steps: usize,
    pub resumed_from: Option<usize>,
    pub train_pairs: usize,
    pub eval_pairs: usize,
    pub train_tokenization: Option<TokenizeStats>,
    pub trainable_params: usize,
    pub seconds: f64,
    pub tokens_per_second: f64,
    pub last_log: serde_json::Map<String, serde_json::Value>,
    pub last_eval: Option<serde_json::Map<String, serde_json::Value>>,
    pub final_dir: PathBuf,
    pub merged_dir: Option<PathBuf>,
    pub ref_cache: Option<PathBuf>,
    pub peak_rss_bytes: Option<u64>,
}

/// `trainer_state.json` of a checkpoint.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct TrainerState {
    global_step: usize,
    total_steps: usize,
    epoch: f64,
    optimizer_steps: u64,
}

/// The training examples of one split, in the objective's form.
enum Examples {
    Pairs {
        pairs: Vec<TokenizedPair>,
        /// Reference (chosen, rejected) summed log-probs per pair.
        reference: Vec<(f64, f64)>,
    },
    Seqs(Vec<TokenizedSeq>),
}

impl Examples {
    /// Keeps `k` examples drawn without replacement (seeded), in their original order.
    fn keep_sample(&mut self, k: usize, seed: u64) {
        let n = self.len();
        if k >= n {
            return;
        }
        let mut order: Vec<usize> = (0..n).collect();
        order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
        let mut keep = vec![false; n];
        for &i in &order[..k] {
            keep[i] = true;
        }
        fn retain_marked<T>(items: &mut Vec<T>, keep: &[bool]) {
            let mut at = 0;
            items.retain(|_| {
                at += 1;
                keep[at - 1]
            });
        }
        match self {
            Examples::Pairs { pairs, reference } => {
                retain_marked(pairs, &keep);
                reference.clear();
            }
            Examples::Seqs(s) => retain_marked(s, &keep),
        }
    }

    fn len(&self) -> usize {
        match self {
            Examples::Pairs { pairs, .. } => pairs.len(),
            Examples::Seqs(s) => s.len(),
        }
    }

    /// Each example's tokens as the step logs' `num_tokens` counts them.
    fn token_counts(&self) -> Vec<usize> {
        match self {
            Examples::Pairs { pairs, .. } => pairs.iter().map(pair_tokens).collect(),
            Examples::Seqs(s) => s.iter().map(|r| r.ids.len()).collect(),
        }
    }
}

/// A pair's tokens counted as TRL's 2B rows hold them (the packed rows hold the prompt once),
/// so that tokens/s compare.
fn pair_tokens(p: &TokenizedPair) -> usize {
    2 * p.prompt.len() + p.chosen.len() + p.rejected.len()
}

/// Metrics of one optimizer step or one evaluation, under TRL's names.
type Metrics = Vec<(String, f64)>;

fn mean_metrics(all: &[Metrics]) -> Metrics {
    let Some(first) = all.first() else {
        return Vec::new();
    };
    first
        .iter()
        .enumerate()
        .map(|(i, (k, _))| {
            let sum: f64 = all.iter().map(|m| m[i].1).sum();
            (k.clone(), sum / all.len() as f64)
        })
        .collect()
}

fn dpo_named(m: &DpoMetrics) -> Metrics {
    m.named()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
}

/// Runs a whole training job. `progress` draws a progress bar on stderr.
pub fn train(cfg: &TrainConfig, progress: bool) -> Result<TrainSummary> {
    train_until(cfg, progress, &crate::run::Shutdown::never())
}

/// [`train`] that stops on `shutdown`'s signal after the step in progress: the steps done
/// are saved as `checkpoint-<step>`, `train_summary.json` records status `interrupted`, and
/// the error is [`TrainError::Interrupted`]; `--resume` continues from there.
pub fn train_until(
    cfg: &TrainConfig,
    progress: bool,
    shutdown: &crate::run::Shutdown,
) -> Result<TrainSummary> {
    cfg.validate()?;
    let objective = cfg.objective()?;
    let started = Instant::now();
    // One writer per output directory until training returns.
    let _lock = prepare_output(cfg)?;
    let mut hashed = cfg.clone();
    let data_paths = data_files(cfg, &objective)?;
    let sha = crate::run::sha256_file(&data_paths.train)
        .map_err(TrainError::io("reading", &data_paths.train))?;
    hashed.data_sha256 = Some(sha);
    let files = local_model_files(&hashed)?;
    hashed.model_sha256 = Some(crate::engine::model_fingerprint(&files)?);
    let recorded = resume_args(&hashed)?;
    let cfg = &recorded;

    check_max_length(cfg, &files.config()?)?;
    let codec = ChatCodec::load(&files)?;
    let device = parse_device(&cfg.optim.device)?;
    let dtype = parse_dtype(&cfg.dtype, &device)?;
    let mut data = load_data(cfg, &data_paths, &codec, &objective)?;
    let model = load_model(cfg, &files, &codec, dtype, &device)?;
    let pad_id = codec.eos_ids.first().copied().unwrap_or(0);

    stop_if_signalled(cfg, shutdown, started, None)?;
    // Reference log-probs, before any weight changes (also before resuming weights).
    let ref_cache = match objective {
        Objective::Dpo(_) => {
            attach_reference(cfg, &files, &codec, &model, &mut data, pad_id, progress)?
        }
        Objective::Sft => None,
    };
    stop_if_signalled(cfg, shutdown, started, None)?;

    let plan = BatchPlan::new(
        data.train.token_counts(),
        match cfg.batch_tokens {
            Some(t) => BatchBy::Tokens(t),
            None => BatchBy::Count(cfg.batch_size),
        },
        cfg.optim.seed,
    );
    let per_epoch = plan.per_epoch().div_ceil(cfg.grad_accum);
    let total_steps = cfg.max_steps.unwrap_or(per_epoch * cfg.epochs);
    let mut opt = AdamW::new(
        model.named_vars(),
        AdamWParams {
            weight_decay: cfg.optim.weight_decay,
            ..AdamWParams::default()
        },
    )?;
    let resumed = restore_latest(cfg, &model, &mut opt, total_steps)?;
    write_json_atomic(&cfg.output.join("training_args.json"), cfg)?;

    let mut run = Run {
        cfg,
        objective,
        model: &model,
        codec: &codec,
        pad_id,
        total_steps,
        per_epoch,
        plan,
        examples: &data.train,
        eval: data.eval.as_ref(),
        log: open_log(&cfg.output.join("logs.jsonl"))?,
        tokens: 0,
        tokens_before: resumed.tokens_before,
        last_log: Default::default(),
        last_eval: None,
    };
    let loop_started = Instant::now();
    train_steps(
        &mut run,
        &mut opt,
        resumed.step,
        progress,
        shutdown,
        started,
    )?;
    if run.eval.is_some() && total_steps > resumed.step {
        run.evaluate(total_steps)?;
    }
    let final_dir = cfg.output.join("final");
    // A run resumed from its final checkpoint (stopped during the merge or the summary)
    // only finishes those steps.
    if resumed.step < total_steps || !final_dir.join("trainer_state.json").is_file() {
        save_checkpoint(&run, &opt, &final_dir, total_steps)?;
    }
    if run.last_log.is_empty() {
        run.last_log = last_logged(&cfg.output.join("logs.jsonl"));
    }
    let merged_dir = if cfg.merge && cfg.lora.is_some() {
        let dir = cfg.output.join("merged");
        save_full_model(&run, &dir)?;
        Some(dir)
    } else {
        None
    };
    let loop_secs = loop_started.elapsed().as_secs_f64();
    let summary = TrainSummary {
        steps: total_steps,
        total_steps,
        resumed_from: resumed.from,
        train_pairs: data.train.len(),
        eval_pairs: data.eval.as_ref().map_or(0, Examples::len),
        train_tokenization: Some(data.train_stats),
        trainable_params: model.num_params(),
        seconds: started.elapsed().as_secs_f64(),
        tokens_per_second: run.tokens as f64 / loop_secs.max(1e-9),
        last_log: run.last_log.clone(),
        last_eval: run.last_eval.clone(),
        final_dir,
        merged_dir,
        ref_cache,
        peak_rss_bytes: crate::run::peak_rss_bytes(),
    };
    crate::run::write_finished_summary(
        &cfg.output.join("train_summary.json"),
        "collabllm-rs dpo_train",
        summary.seconds,
        &summary,
    )?;
    Ok(summary)
}

/// The local weights `--model` names (an endpoint or a bare LoRA adapter is refused).
fn local_model_files(cfg: &TrainConfig) -> Result<LocalModelFiles> {
    let spec: ModelSpec = cfg.model.parse().map_err(|e| TrainError::Model {
        spec: redact_credentials(&cfg.model),
        message: format!("{e}"),
    })?;
    if !spec.is_local() {
        return Err(TrainError::Model {
            spec: spec.to_string(),
            message: "training needs local weights, not an API endpoint".into(),
        });
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| TrainError::Setting(format!("starting the runtime: {e}")))?;
    let files = rt.block_on(resolve_local(&spec))?;
    if matches!(files, LocalModelFiles::Adapter { .. }) {
        return Err(TrainError::Model {
            spec: spec.to_string(),
            message: "a LoRA adapter; train from its merged model (dpo_train --merge writes \
                      one) or from its base model"
                .into(),
        });
    }
    Ok(files)
}

/// The tokenized training and evaluation examples of a run.
struct TrainData {
    train_path: PathBuf,
    eval_path: Option<PathBuf>,
    train: Examples,
    train_stats: TokenizeStats,
    eval: Option<Examples>,
}

/// The files the run trains (and evaluates) on, for its objective.
fn data_files(cfg: &TrainConfig, objective: &Objective) -> Result<DataFiles> {
    Ok(match objective {
        Objective::Sft => locate_sft_data(&cfg.data)?,
        Objective::Dpo(_) => locate_data(&cfg.data)?,
    })
}

fn load_data(
    cfg: &TrainConfig,
    files: &DataFiles,
    codec: &ChatCodec,
    objective: &Objective,
) -> Result<TrainData> {
    let eval_path = cfg.eval_data.clone().or(files.eval.clone());
    let (mut train, train_stats) = load_examples(codec, &files.train, cfg, objective)?;
    if let Some(k) = cfg.max_pairs {
        let all = train.len();
        train.keep_sample(k, cfg.optim.seed);
        tracing::info!(
            "--max-pairs {k}: training on {} of {all} examples",
            train.len()
        );
    }
    if train.len() == 0 {
        return Err(TrainError::input(
            &files.train,
            format!(
                "no example fits --max-length {} ({} rows, all too long)",
                cfg.max_length, train_stats.rows
            ),
        ));
    }
    let eval = match &eval_path {
        Some(p) => Some(load_examples(codec, p, cfg, objective)?.0),
        None => None,
    };
    tracing::info!(
        "{} training examples ({} lost old turns to fit --max-length, keeping the system and \
         first user message; {} dropped as too long){}",
        train_stats.kept,
        train_stats.truncated,
        train_stats.dropped_too_long,
        eval.as_ref()
            .map(|e| format!(", {} evaluation examples", e.len()))
            .unwrap_or_default()
    );
    Ok(TrainData {
        train_path: files.train.clone(),
        eval_path,
        train,
        train_stats,
        eval,
    })
}

/// Refuses a `--max-length` the model cannot hold (its positions, or Mistral's window) before
/// any data is read: every longer row would fail mid-run.
fn check_max_length(cfg: &TrainConfig, model: &crate::engine::llama::LlamaConfig) -> Result<()> {
    let context = model.context_length();
    if cfg.max_length <= context {
        return Ok(());
    }
    let why = if model.sliding_window == Some(context) {
        " (its sliding window caps it)"
    } else {
        ""
    };
    Err(TrainError::Setting(format!(
        "--max-length {} is longer than the model's context of {context} positions{why}; \
         pass --max-length {context} or less",
        cfg.max_length
    )))
}

/// The policy to train: the weights of `files`, with LoRA adapters when configured.
fn load_model(
    cfg: &TrainConfig,
    files: &LocalModelFiles,
    codec: &ChatCodec,
    dtype: DType,
    device: &Device,
) -> Result<TrainLlama> {
    let mut model = match files {
        LocalModelFiles::Gguf(p) => TrainLlama::from_gguf(p, dtype, device)?,
        LocalModelFiles::HfDir(d) => TrainLlama::from_hf_dir(d, dtype, device)?,
        LocalModelFiles::Adapter { dir, .. } => {
            return Err(TrainError::input(
                dir,
                "a LoRA adapter is not a model to train",
            ))
        }
    };
    if let Some(d) = parse_save_dtype(&cfg.save_dtype)? {
        model.set_save_dtype(d);
    }
    if let Some(l) = &cfg.lora {
        let base = if cfg.save_base {
            // The run's identity first: a run stopped while its base is written is then a
            // run (`--resume` compares its model), never a leftover a new run adopts.
            write_json_atomic(&cfg.output.join("training_args.json"), cfg)?;
            save_base(cfg, files, codec, &model)?
        } else {
            adapter_base_name(&cfg.model, files)
        };
        model.enable_lora(l.adapter_config(&base), cfg.optim.seed)?;
    }
    Ok(model)
}

/// Sets the DPO reference log-probs of every example (from the cache when its key
/// matches); returns the cache file.
fn attach_reference(
    cfg: &TrainConfig,
    files: &LocalModelFiles,
    codec: &ChatCodec,
    model: &TrainLlama,
    data: &mut TrainData,
    pad_id: u32,
    progress: bool,
) -> Result<Option<PathBuf>> {
    let key = ref_cache_key(
        cfg,
        files,
        codec,
        &data.train_path,
        data.eval_path.as_deref(),
    )?;
    let (train_ref, eval_ref, path) = reference_logps(
        model,
        cfg,
        &key,
        &data.train_path,
        &data.train,
        data.eval.as_ref(),
        pad_id,
        progress,
    )?;
    set_reference(&mut data.train, train_ref);
    if let (Some(e), Some(r)) = (data.eval.as_mut(), eval_ref) {
        set_reference(e, r);
    }
    Ok(path)
}

/// Where a run starts: step 0, or (with `--resume`) its latest checkpoint's step, weights
/// and optimizer state restored.
struct Resumed {
    step: usize,
    from: Option<usize>,
    tokens_before: usize,
}

fn restore_latest(
    cfg: &TrainConfig,
    model: &TrainLlama,
    opt: &mut AdamW,
    total_steps: usize,
) -> Result<Resumed> {
    let fresh = Resumed {
        step: 0,
        from: None,
        tokens_before: 0,
    };
    if !cfg.resume {
        return Ok(fresh);
    }
    let Some((dir, state)) = latest_checkpoint(&cfg.output)? else {
        tracing::info!(
            "--resume: no checkpoint in {}; starting fresh",
            cfg.output.display()
        );
        // Steps logged before the kill are played again: their lines go, as after a
        // checkpoint's step.
        truncate_logs(&cfg.output.join("logs.jsonl"), 0)?;
        return Ok(fresh);
    };
    restore_checkpoint(model, opt, &dir, &state)?;
    if state.total_steps != total_steps {
        tracing::warn!(
            "the checkpoint planned {} steps; this run plans {total_steps}",
            state.total_steps
        );
    }
    let step = state.global_step;
    let tokens_before = truncate_logs(&cfg.output.join("logs.jsonl"), step)?;
    tracing::info!("resuming from {} (step {step})", dir.display());
    Ok(Resumed {
        step,
        from: Some(step),
        tokens_before,
    })
}

/// The optimizer steps from `start_step` to the end: log, evaluate and checkpoint on their
/// schedules; a non-finite loss, gradient or weight stops before anything is saved from it.
fn train_steps(
    run: &mut Run,
    opt: &mut AdamW,
    start_step: usize,
    progress: bool,
    shutdown: &crate::run::Shutdown,
    started: Instant,
) -> Result<()> {
    let cfg = run.cfg;
    let total_steps = run.total_steps;
    let warmup = warmup_steps(total_steps, cfg.optim.warmup_ratio);
    let bar = crate::train::steps_bar(progress, total_steps, start_step as u64);
    let loop_started = Instant::now();
    let mut window: Vec<Metrics> = Vec::new();
    for step in start_step..total_steps {
        let lr = cfg.optim.lr * cfg.optim.schedule.factor(step, total_steps, warmup);
        let (mut grads, metrics) = run.accumulate(step)?;
        let vars = run.model.vars();
        let norm = clip_grad_norm(&mut grads, &vars, cfg.optim.max_grad_norm)?;
        let loss = metrics.first().map(|m| m.1).unwrap_or(f64::NAN);
        if !loss.is_finite() || !norm.is_finite() {
            bar.abandon();
            return Err(TrainError::Diverged(format!(
                "step {}: non-finite {} ({}); stopped without applying it; the last good \
                 checkpoint in {} is intact (lower --lr or check the data)",
                step + 1,
                if loss.is_finite() {
                    "gradient norm"
                } else {
                    "loss"
                },
                if loss.is_finite() { norm } else { loss },
                cfg.output.display()
            )));
        }
        opt.step(&grads, lr)?;
        drop(grads);
        let done = step + 1;
        if let Some(name) = non_finite_weight(run.model)? {
            bar.abandon();
            return Err(TrainError::Diverged(format!(
                "step {done}: the update made weight `{name}` non-finite; stopped before saving \
                 anything from it; the last good checkpoint in {} is intact (lower --lr or \
                 check the data)",
                cfg.output.display()
            )));
        }
        let mut m = metrics;
        m.push(("learning_rate".into(), lr));
        m.push(("grad_norm".into(), norm));
        window.push(m);
        let elapsed = loop_started.elapsed().as_secs_f64().max(1e-9);
        let tps = run.tokens as f64 / elapsed;
        if done % cfg.logging_steps == 0 || done == total_steps {
            let mean = mean_metrics(&window);
            window.clear();
            run.write_log(done, &mean, Some(tps))?;
            bar.set_message(bar_message(&mean, tps));
        }
        if cfg.eval_steps.is_some_and(|k| done % k == 0) && done != total_steps {
            run.evaluate(done)?;
        }
        let signalled = shutdown.received().is_some() && done != total_steps;
        let scheduled = cfg.optim.save_steps.is_some_and(|k| done % k == 0) && done != total_steps;
        if scheduled || signalled {
            save_checkpoint(
                run,
                opt,
                &cfg.output.join(format!("checkpoint-{done}")),
                done,
            )?;
        }
        if signalled {
            bar.abandon();
            stop_if_signalled(cfg, shutdown, started, Some(done))?;
        }
        #[cfg(any(test, feature = "testing"))]
        if cfg.stop_after == Some(done) {
            bar.abandon();
            return Err(TrainError::Stopped(done));
        }
        bar.set_position(done as u64);
    }
    bar.finish();
    Ok(())
}

/// After a signal: records the run as interrupted in `train_summary.json` (after `step`, whose
/// checkpoint is saved; `None` before the first step) and returns the error that ends it.
fn stop_if_signalled(
    cfg: &TrainConfig,
    shutdown: &crate::run::Shutdown,
    started: Instant,
    step: Option<usize>,
) -> Result<()> {
    use crate::run::Interrupted;
    let Some(signal) = shutdown.received() else {
        return Ok(());
    };
    let seconds = started.elapsed().as_secs_f64();
    let fields = serde_json::json!({
        "output": cfg.output,
        "steps": step.unwrap_or(0),
        "checkpoint": step.map(|s| cfg.output.join(format!("checkpoint-{s}"))),
        "seconds": seconds,
    });
    crate::run::write_interrupted_summary(
        &cfg.output.join("train_summary.json"),
        "collabllm-rs dpo_train",
        seconds,
        signal,
        fields,
    )?;
    Err(TrainError::Interrupted(Interrupted::resume_with(
        signal,
        "add --resume to the same command to continue",
    )))
}

/// The last line of a run's `logs.jsonl` with a training loss (a run resumed after its last
/// step reports the metrics it ended with).
fn last_logged(path: &Path) -> serde_json::Map<String, serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .rev()
        .filter_map(|l| serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(l).ok())
        .find(|m| m.contains_key("loss"))
        .unwrap_or_default()
}

/// `base_model_name_or_path` for the adapter, so that PEFT's auto classes load it from its
/// directory alone: the Hub id (`default` is [`crate::llm::spec::DEFAULT_MODEL_HF_ID`]), local files as
/// absolute paths (so the adapter loads from any working directory).
/// Writes the base model as loaded into `<output>/base/` (once: a resumed run keeps it) and
/// returns that folder's absolute path, the adapters' recorded base.
fn save_base(
    cfg: &TrainConfig,
    files: &LocalModelFiles,
    codec: &ChatCodec,
    model: &TrainLlama,
) -> Result<String> {
    let dir = cfg.output.join("base");
    if !dir.join("config.json").is_file() {
        let tmp = cfg.output.join("base.partial");
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(TrainError::io("removing", &tmp))?;
        }
        let source = match files {
            LocalModelFiles::HfDir(d) => Some(d.as_path()),
            _ => None,
        };
        model.save_hf(&tmp, source)?;
        codec.save_hf(&tmp)?;
        crate::run::write_checksums(&tmp)?;
        std::fs::rename(&tmp, &dir).map_err(TrainError::io("renaming into place", &dir))?;
    }
    let abs = std::fs::canonicalize(&dir).map_err(TrainError::io("resolving", &dir))?;
    Ok(abs.display().to_string())
}

/// The settings to record in `training_args.json`: `cfg` itself for a fresh run; for
/// `--resume`, `cfg` after checking its math settings against the ones the run recorded
/// (refused unless named in `--resume-override`), with the allowed changes added to the
/// run's history of overrides.
fn resume_args(cfg: &TrainConfig) -> Result<TrainConfig> {
    if !cfg.resume {
        return Ok(cfg.clone());
    }
    let checkpoint = latest_checkpoint(&cfg.output)?;
    let candidates = [
        Some(cfg.output.join("training_args.json")),
        checkpoint
            .as_ref()
            .map(|(dir, _)| dir.join("training_args.json")),
    ];
    let Some(path) = candidates.into_iter().flatten().find(|p| p.is_file()) else {
        return Ok(cfg.clone());
    };
    let previous: serde_json::Value = read_json(&path)?;
    let step = checkpoint.map_or(0, |(_, state)| state.global_step);
    compare_resume_settings(cfg, &previous, step)
        .map_err(|message| TrainError::run(&cfg.output, format!("--resume: {message}")))
}

/// See [`resume_args`]; `previous` is the recorded `training_args.json`.
fn compare_resume_settings(
    cfg: &TrainConfig,
    previous: &serde_json::Value,
    step: usize,
) -> Result<TrainConfig, String> {
    let now = serde_json::to_value(cfg).map_err(|e| e.to_string())?;
    let mut history: Vec<ResumeOverride> = match previous.get("resume_overrides") {
        Some(v) => serde_json::from_value(v.clone())
            .map_err(|e| format!("training_args.json: resume_overrides: {e}"))?,
        None => Vec::new(),
    };
    let (mut refused, mut names) = (Vec::new(), Vec::new());
    for name in RESUME_SETTINGS {
        let key = name.replace('-', "_");
        // A setting an older version did not record cannot be compared.
        let (Some(was), Some(is)) = (previous.get(&key), now.get(&key)) else {
            continue;
        };
        if was == is {
            continue;
        }
        if cfg.resume_override.iter().any(|o| o == name) {
            tracing::warn!("--resume-override {name}: {was} before, {is} from step {step}");
            history.push(ResumeOverride {
                step,
                setting: name.to_string(),
                previous: was.clone(),
                now: is.clone(),
            });
        } else {
            refused.push(format!("--{name} was {was}, now {is}"));
            names.push(*name);
        }
    }
    if !refused.is_empty() {
        return Err(format!(
            "the run was trained with other settings ({}); resume with the same ones, pass \
             --resume-override {} to change them (recorded in training_args.json), or start \
             a new --output",
            refused.join("; "),
            names.join(",")
        ));
    }
    let mut out = cfg.clone();
    out.resume_overrides = history;
    Ok(out)
}

/// What a run writes into its output directory: a fresh run starts only where none of it is
/// (a leftover `base/` adopted by another run's adapter would point it at the wrong weights).
const RUN_ENTRIES: &[&str] = &[
    "logs.jsonl",
    "training_args.json",
    "train_summary.json",
    "final",
    "final.tmp",
    "base",
    "base.partial",
    "merged",
    "merged.tmp",
];

/// The entries of a run (see [`RUN_ENTRIES`], and `checkpoint-*`) in `output`.
fn run_entries(output: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(output) else {
        return Vec::new();
    };
    let mut found: Vec<String> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| RUN_ENTRIES.contains(&n.as_str()) || n.starts_with("checkpoint-"))
        .collect();
    found.sort();
    found
}

/// Locks the output directory for this process, and refuses to write a fresh run over any
/// part of another (finished, interrupted or stopped before its first step), and `--resume`
/// of a run that finished every step after training too.
fn prepare_output(cfg: &TrainConfig) -> Result<crate::run::RunLock> {
    std::fs::create_dir_all(&cfg.output)
        .map_err(TrainError::io("creating --output", &cfg.output))?;
    let lock = crate::run::RunLock::acquire(&cfg.output)?;
    let found = run_entries(&cfg.output);
    if !found.is_empty() && !cfg.resume {
        return Err(TrainError::run(
            &cfg.output,
            format!(
                "already holds a training run ({}); pass --resume to continue it or choose \
                 another --output",
                found.join(", ")
            ),
        ));
    }
    let has = |entry: &str| found.iter().any(|f| f == entry);
    if cfg.resume && has("base") && !has("training_args.json") {
        return Err(TrainError::run(
            &cfg.output,
            "base/ was left by a run that recorded no settings, so whose weights it holds is \
             unknown; remove it or choose another --output",
        ));
    }
    if cfg.resume && run_finished(&cfg.output) {
        return Err(TrainError::run(
            &cfg.output,
            "this run already finished (train_summary.json says complete); nothing to resume",
        ));
    }
    Ok(lock)
}

/// Whether the run in `output` finished every step, training and after (its summary says
/// `complete`).
fn run_finished(output: &Path) -> bool {
    matches!(
        crate::run::Manifest::read(&output.join("train_summary.json")),
        Ok(Some(m)) if m.header.status == crate::run::RunStatus::Complete
    )
}

fn load_examples(
    codec: &ChatCodec,
    path: &Path,
    cfg: &TrainConfig,
    objective: &Objective,
) -> Result<(Examples, TokenizeStats)> {
    if matches!(objective, Objective::Sft) && is_sft_parquet(path) {
        let mut rows = read_sft_parquet(path)?;
        let all = rows.len();
        if let Some(min) = cfg.sft_min_score {
            rows.retain(|r| r.score >= min);
            tracing::info!(
                "{}: {} of {all} conversations score at least --sft-min-score {min}",
                path.display(),
                rows.len()
            );
        }
        let convs: Vec<Vec<ChatMessage>> = rows.into_iter().map(|r| r.messages).collect();
        let (seqs, stats) = tokenize_sft_conversations(codec, &convs, cfg.max_length, path)?;
        return Ok((Examples::Seqs(seqs), stats));
    }
    let rows = read_pairs(path)?;
    Ok(match objective {
        Objective::Sft => {
            let (seqs, stats) = tokenize_sft(codec, &rows, cfg.max_length, path)?;
            (Examples::Seqs(seqs), stats)
        }
        Objective::Dpo(_) => {
            let (pairs, stats) = tokenize_pairs(codec, &rows, cfg.max_length, path)?;
            (
                Examples::Pairs {
                    pairs,
                    reference: Vec::new(),
                },
                stats,
            )
        }
    })
}

fn set_reference(ex: &mut Examples, values: Vec<(f64, f64)>) {
    if let Examples::Pairs { reference, .. } = ex {
        *reference = values;
    }
}

fn file_digest(path: &Path) -> Result<String> {
    Ok(fingerprint(&[path.to_path_buf()])?)
}

/// Key of the reference cache: data, model weights, template and tokenization settings.
fn ref_cache_key(
    cfg: &TrainConfig,
    files: &LocalModelFiles,
    codec: &ChatCodec,
    train: &Path,
    eval: Option<&Path>,
) -> Result<String> {
    let mut h = Sha256::new();
    h.update(TOKENIZATION_VERSION);
    h.update(file_digest(train)?);
    if let Some(e) = eval {
        h.update(file_digest(e)?);
    }
    let model_files = match files {
        LocalModelFiles::Gguf(p) => vec![p.clone()],
        LocalModelFiles::HfDir(d) => {
            let mut v: Vec<PathBuf> = std::fs::read_dir(d)
                .map_err(TrainError::io("listing", d))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            v.sort();
            v
        }
        LocalModelFiles::Adapter { dir, .. } => vec![dir.join(ADAPTER_WEIGHTS)],
    };
    h.update(fingerprint(&model_files)?);
    h.update(codec.template.source());
    h.update(format!("{}|{}", cfg.max_length, cfg.dtype));
    // A sample of the pairs has reference values of its own.
    if let Some(k) = cfg.max_pairs {
        h.update(format!("|max_pairs={k}|seed={}", cfg.optim.seed));
    }
    Ok(hex::encode(h.finalize())[..16].to_string())
}

#[derive(Serialize, Deserialize)]
struct RefCacheFile {
    key: String,
    model: String,
    train: Vec<(f64, f64)>,
    eval: Option<Vec<(f64, f64)>>,
}

type RefValues = (Vec<(f64, f64)>, Option<Vec<(f64, f64)>>, Option<PathBuf>);

/// Reference log-probs of every pair: from the cache when its key matches (the run's own
/// `ref_logps/`, or one an older version wrote beside the data), else computed with the
/// adapters off and written into the run's `ref_logps/`: a run never writes into its inputs.
/// Keys are SHA-256 of the data, the model's weights and the template, so a stale file is
/// never used.
#[allow(clippy::too_many_arguments)]
fn reference_logps(
    model: &TrainLlama,
    cfg: &TrainConfig,
    key: &str,
    train_path: &Path,
    train: &Examples,
    eval: Option<&Examples>,
    pad_id: u32,
    progress: bool,
) -> Result<RefValues> {
    let name = format!("ref_logps-{key}.json");
    let beside = train_path
        .parent()
        .unwrap_or(Path::new("."))
        .join("ref_logps")
        .join(&name);
    let in_output = cfg.output.join("ref_logps").join(&name);
    if cfg.ref_cache {
        for p in [&in_output, &beside] {
            if let Ok(text) = std::fs::read_to_string(p) {
                if let Ok(c) = serde_json::from_str::<RefCacheFile>(&text) {
                    let sizes_ok = c.key == key
                        && c.train.len() == train.len()
                        && c.eval.as_ref().map(Vec::len) == eval.map(Examples::len);
                    if sizes_ok {
                        tracing::info!("reference log-probs from {}", p.display());
                        return Ok((c.train, c.eval, Some(p.clone())));
                    }
                }
            }
        }
    }
    model.set_adapters_enabled(false);
    let bar = progress_bar_named(
        progress,
        train.len() + eval.map_or(0, Examples::len),
        "reference log-probs",
    );
    let compute = |ex: &Examples| -> Result<Vec<(f64, f64)>> {
        let Examples::Pairs { pairs, .. } = ex else {
            return Ok(Vec::new());
        };
        let mut out = Vec::with_capacity(pairs.len());
        for chunk in pairs.chunks(cfg.batch_size) {
            let batch = PairBatch::new(chunk, pad_id, model.device())?;
            let lp = pair_logps_full(model, &batch)?;
            let c = lp.chosen.to_dtype(DType::F64)?.to_vec1::<f64>()?;
            let r = lp.rejected.to_dtype(DType::F64)?.to_vec1::<f64>()?;
            out.extend(c.into_iter().zip(r));
            bar.inc(chunk.len() as u64);
        }
        Ok(out)
    };
    let train_ref = compute(train)?;
    let eval_ref = eval.map(compute).transpose()?;
    bar.finish_and_clear();
    model.set_adapters_enabled(true);
    let mut written = None;
    if cfg.ref_cache {
        let file = RefCacheFile {
            key: key.to_string(),
            model: cfg.model.clone(),
            train: train_ref.clone(),
            eval: eval_ref.clone(),
        };
        let dir = cfg.output.join("ref_logps");
        match std::fs::create_dir_all(&dir)
            .map_err(|e| e.to_string())
            .and_then(|()| write_json_atomic(&in_output, &file).map_err(|e| e.to_string()))
        {
            Ok(()) => written = Some(in_output.clone()),
            Err(e) => tracing::warn!("reference log-probs not cached: {e}"),
        }
    }
    Ok((train_ref, eval_ref, written))
}

/// A batch ready for a forward pass.
struct Prepared {
    input_ids: Tensor,
    layout: BatchLayout,
    targets: Targets,
    /// Reference (chosen, rejected) log-probs, (B,) each, for DPO.
    reference: Option<(Tensor, Tensor)>,
    pairs: usize,
    /// Real (non-padding) tokens.
    tokens: usize,
}

/// One run's moving parts during the loop.
struct Run<'a> {
    cfg: &'a TrainConfig,
    objective: Objective,
    model: &'a TrainLlama,
    codec: &'a ChatCodec,
    pad_id: u32,
    total_steps: usize,
    per_epoch: usize,
    plan: BatchPlan,
    examples: &'a Examples,
    eval: Option<&'a Examples>,
    log: std::fs::File,
    /// Non-padding tokens processed by training steps of this process.
    tokens: usize,
    /// Training tokens of the run before this process (from the logs of a resumed run):
    /// `num_tokens` counts from the start of the run, as TRL's.
    tokens_before: usize,
    last_log: serde_json::Map<String, serde_json::Value>,
    last_eval: Option<serde_json::Map<String, serde_json::Value>>,
}

impl Run<'_> {
    fn epoch_at(&self, step: usize) -> f64 {
        step as f64 / self.per_epoch.max(1) as f64
    }

    /// Forward + backward over `grad_accum` micro-batches; gradients summed (each loss scaled
    /// by 1/k), metrics averaged.
    fn accumulate(&mut self, step: usize) -> Result<(candle_core::backprop::GradStore, Metrics)> {
        let k = self.cfg.grad_accum;
        let vars = self.model.vars();
        let mut acc: Option<candle_core::backprop::GradStore> = None;
        let mut all = Vec::with_capacity(k);
        self.model.set_training(true);
        for j in 0..k {
            let idx = self.plan.micro_batch(step * k + j);
            let prepared = self.prepare(&idx, true)?;
            self.tokens += prepared.tokens;
            let scale = 1.0 / k as f64;
            let (grads, metrics) = self.model.grads(
                &prepared.input_ids,
                &prepared.layout,
                self.cfg.optim.gradient_checkpointing,
                |hidden| {
                    let (loss, metrics) = self.loss_from_hidden(&prepared, hidden)?;
                    Ok(((loss * scale)?, metrics))
                },
            )?;
            match acc.as_mut() {
                None => acc = Some(grads),
                Some(a) => crate::train::optim::accumulate_grads(a, grads, &vars)?,
            }
            all.push(metrics);
        }
        self.model.set_training(false);
        let grads = acc.ok_or_else(|| TrainError::Setting("no micro-batch".into()))?;
        Ok((grads, mean_metrics(&all)))
    }

    /// The padded batch of examples `idx` of the training set (or of the evaluation set when
    /// `train` is false).
    fn prepare(&self, idx: &[usize], train: bool) -> Result<Prepared> {
        let examples = if train {
            self.examples
        } else {
            self.eval
                .ok_or_else(|| TrainError::Setting("no evaluation set".into()))?
        };
        let device = self.model.device();
        match examples {
            Examples::Seqs(seqs) => {
                let rows: Vec<TokenizedSeq> = idx.iter().map(|&i| seqs[i].clone()).collect();
                let batch = SeqBatch::new(&rows, self.pad_id, device)?;
                Ok(Prepared {
                    tokens: rows.iter().map(|r| r.ids.len()).sum(),
                    input_ids: batch.input_ids,
                    layout: batch.layout,
                    targets: batch.targets,
                    reference: None,
                    pairs: 0,
                })
            }
            Examples::Pairs { pairs, reference } => {
                let rows: Vec<TokenizedPair> = idx.iter().map(|&i| pairs[i].clone()).collect();
                let batch = PairBatch::new(&rows, self.pad_id, device)?;
                let average =
                    matches!(self.objective, Objective::Dpo(d) if d.loss_type.average_logps());
                Ok(Prepared {
                    tokens: rows.iter().map(pair_tokens).sum(),
                    reference: Some(self.reference_tensors(&rows, idx, reference, average)?),
                    pairs: rows.len(),
                    input_ids: batch.input_ids,
                    layout: batch.layout,
                    targets: batch.targets,
                })
            }
        }
    }

    /// The objective's loss and metrics from the final hidden states of a prepared batch.
    fn loss_from_hidden(
        &self,
        p: &Prepared,
        hidden: &Tensor,
    ) -> candle_core::Result<(Tensor, Metrics)> {
        let (sums, counts, stats) =
            crate::train::logps::completion_logps_stats(self.model, hidden, &p.targets)?;
        let all = 0..p.targets.num_rows;
        match (self.objective, &p.reference) {
            (Objective::Sft, _) => {
                let loss = crate::train::logps::token_mean_nll(&sums, &counts)?;
                let v = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                Ok((
                    loss,
                    vec![
                        ("loss".into(), v),
                        ("entropy".into(), stats.mean(&stats.entropy, all.clone())),
                        (
                            "mean_token_accuracy".into(),
                            stats.mean(&stats.correct, all),
                        ),
                    ],
                ))
            }
            (Objective::Dpo(dpo), Some((rc, rr))) => {
                let b = p.pairs;
                let lp = crate::train::logps::PairLogps {
                    chosen: sums.narrow(0, 0, b)?,
                    rejected: sums.narrow(0, b, b)?,
                    chosen_tokens: counts.narrow(0, 0, b)?,
                    rejected_tokens: counts.narrow(0, b, b)?,
                };
                let (pc, pr) = lp.for_loss(dpo.loss_type.average_logps())?;
                let out = dpo_loss(&pc, &pr, rc, rr, &dpo)?;
                let mut metrics = dpo_named(&out.metrics);
                let mut loss = out.loss;
                if self.cfg.sft_weight > 0.0 {
                    let nll = (&lp.chosen / &lp.chosen_tokens)?.neg()?.mean_all()?;
                    let nll_v = nll.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                    loss = (loss + (nll * self.cfg.sft_weight)?)?;
                    metrics[0].1 = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                    metrics.push(("nll_loss".into(), nll_v));
                }
                // TRL's definitions: logits over each side's completion tokens, entropy
                // over both sides', token accuracy over the chosen side's.
                let (chosen, rejected) = (0..b, b..2 * b);
                metrics.extend([
                    (
                        "logits/chosen".to_string(),
                        stats.mean(&stats.logit_mean, chosen.clone()),
                    ),
                    (
                        "logits/rejected".to_string(),
                        stats.mean(&stats.logit_mean, rejected),
                    ),
                    ("entropy".to_string(), stats.mean(&stats.entropy, all)),
                    (
                        "mean_token_accuracy".to_string(),
                        stats.mean(&stats.correct, chosen),
                    ),
                ]);
                Ok((loss, metrics))
            }
            (Objective::Dpo(_), None) => candle_core::bail!("internal: no reference log-probs"),
        }
    }

    /// Loss and metrics of examples `idx` (no backward).
    fn loss_of(&self, idx: &[usize], train: bool) -> Result<(Tensor, Metrics, usize)> {
        let p = self.prepare(idx, train)?;
        let hidden = self.model.hidden_states_in(&p.input_ids, &p.layout)?;
        let (loss, metrics) = self.loss_from_hidden(&p, &hidden)?;
        Ok((loss.detach(), metrics, p.tokens))
    }

    fn reference_tensors(
        &self,
        rows: &[TokenizedPair],
        idx: &[usize],
        reference: &[(f64, f64)],
        average: bool,
    ) -> Result<(Tensor, Tensor)> {
        let dtype = self.model.dtype();
        let mut c = Vec::with_capacity(idx.len());
        let mut r = Vec::with_capacity(idx.len());
        for (row, &i) in rows.iter().zip(idx) {
            let (rc, rr) = reference[i];
            if average {
                c.push(rc / row.chosen.len() as f64);
                r.push(rr / row.rejected.len() as f64);
            } else {
                c.push(rc);
                r.push(rr);
            }
        }
        let t = |v: Vec<f64>| -> Result<Tensor> {
            Ok(Tensor::new(v, self.model.device())?.to_dtype(dtype)?)
        };
        Ok((t(c)?, t(r)?))
    }

    /// Mean metrics over the evaluation set, logged with TRL's `eval_` prefix.
    fn evaluate(&mut self, step: usize) -> Result<()> {
        let Some(eval) = self.eval else {
            return Ok(());
        };
        let mut all = Vec::new();
        let n = eval.len();
        for start in (0..n).step_by(self.cfg.batch_size) {
            let idx: Vec<usize> = (start..(start + self.cfg.batch_size).min(n)).collect();
            let (_, metrics, _) = self.loss_of(&idx, false)?;
            all.push(metrics);
        }
        let mut mean = mean_metrics(&all);
        mean.push(("num_tokens".into(), self.num_tokens() as f64));
        let mean: Metrics = mean
            .into_iter()
            .map(|(k, v)| (format!("eval_{k}"), v))
            .collect();
        let line = self.log_line(step, &mean, None);
        self.append_log(&line)?;
        self.last_eval = Some(line);
        Ok(())
    }

    fn log_line(
        &self,
        step: usize,
        metrics: &Metrics,
        tps: Option<f64>,
    ) -> serde_json::Map<String, serde_json::Value> {
        let mut obj = serde_json::Map::new();
        obj.insert("step".into(), step.into());
        obj.insert("epoch".into(), self.epoch_at(step).into());
        for (k, v) in metrics {
            obj.insert(k.clone(), (*v).into());
        }
        if let Some(t) = tps {
            obj.insert("tokens_per_second".into(), t.into());
        }
        obj
    }

    /// Training tokens (non-padding, as TRL's 2B rows hold them) since the run began.
    fn num_tokens(&self) -> usize {
        self.tokens_before + self.tokens
    }

    fn write_log(&mut self, step: usize, metrics: &Metrics, tps: Option<f64>) -> Result<()> {
        let mut line = self.log_line(step, metrics, tps);
        line.insert("num_tokens".into(), self.num_tokens().into());
        self.append_log(&line)?;
        self.last_log = line;
        Ok(())
    }

    fn append_log(&mut self, line: &serde_json::Map<String, serde_json::Value>) -> Result<()> {
        let mut text = serde_json::to_string(line)?;
        text.push('\n');
        let path = self.cfg.output.join("logs.jsonl");
        self.log
            .write_all(text.as_bytes())
            .and_then(|()| self.log.flush())
            .map_err(TrainError::io("appending to", &path))
    }
}

fn open_log(path: &Path) -> Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(TrainError::io("opening", path))
}

/// Keeps the log lines of steps ≤ `step` (a resumed run rewrites what came after its
/// checkpoint); a torn last line is dropped. Returns the run's `num_tokens` at `step`.
fn truncate_logs(path: &Path, step: usize) -> Result<usize> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(0);
    };
    let mut tokens = 0;
    let mut kept = String::new();
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if v["step"].as_u64().is_some_and(|s| s as usize <= step) {
            kept.push_str(line);
            kept.push('\n');
            if let Some(n) = v["num_tokens"].as_u64() {
                tokens = tokens.max(n as usize);
            }
        }
    }
    write_atomic(path, kept.as_bytes())?;
    Ok(tokens)
}

/// The model files of a checkpoint: PEFT adapter (LoRA) or full HF model, plus the tokenizer
/// and chat template so that the directory works as a model spec on its own.
fn save_model_files(run: &Run, dir: &Path) -> Result<()> {
    if run.model.lora_config().is_some() {
        run.model.save_adapter(dir)?;
    } else {
        run.model.save_hf(dir, None)?;
    }
    run.codec.save_hf(dir)?;
    Ok(())
}

fn save_full_model(run: &Run, dir: &Path) -> Result<()> {
    ensure_finite(run.model, dir)?;
    let tmp = dir.with_extension("tmp");
    let _ = std::fs::remove_dir_all(&tmp);
    removed_on_error(&tmp, || {
        run.model.save_hf(&tmp, None)?;
        run.codec.save_hf(&tmp)?;
        crate::run::write_checksums(&tmp)?;
        Ok(())
    })?;
    let _ = std::fs::remove_dir_all(dir);
    std::fs::rename(&tmp, dir).map_err(TrainError::io("saving", dir))?;
    Ok(())
}

/// Runs `write` (which fills the temporary folder `tmp`); on its error `tmp` is removed, so a
/// refused save (an f16 overflow, a full disk) leaves no half-written `*.tmp/` behind.
fn removed_on_error(tmp: &Path, write: impl FnOnce() -> Result<()>) -> Result<()> {
    let result = write();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(tmp);
    }
    result
}

/// Refuses to save a model with a non-finite weight (whatever produced it).
fn ensure_finite(model: &TrainLlama, dir: &Path) -> Result<()> {
    match non_finite_weight(model)? {
        Some(name) => Err(TrainError::Diverged(format!(
            "not saving {}: weight `{name}` is non-finite",
            dir.display()
        ))),
        None => Ok(()),
    }
}

/// Writes a checkpoint into a temporary directory and renames it into place, so a crash
/// never leaves a half-written checkpoint under the real name.
fn save_checkpoint(run: &Run, opt: &AdamW, dir: &Path, step: usize) -> Result<()> {
    ensure_finite(run.model, dir)?;
    let tmp = dir.with_extension("tmp");
    let _ = std::fs::remove_dir_all(&tmp);
    removed_on_error(&tmp, || {
        std::fs::create_dir_all(&tmp).map_err(TrainError::io("creating", &tmp))?;
        save_model_files(run, &tmp)?;
        opt.save(&tmp.join("optimizer.safetensors"))?;
        let state = TrainerState {
            global_step: step,
            total_steps: run.total_steps,
            epoch: run.epoch_at(step),
            optimizer_steps: opt.step_count(),
        };
        write_json_atomic(&tmp.join("trainer_state.json"), &state)?;
        write_json_atomic(&tmp.join("training_args.json"), run.cfg)?;
        crate::run::write_checksums(&tmp)?;
        Ok(())
    })?;
    let _ = std::fs::remove_dir_all(dir);
    std::fs::rename(&tmp, dir).map_err(TrainError::io("saving", dir))?;
    Ok(())
}

/// The `checkpoint-N` with the highest N that has a trainer state.
fn latest_checkpoint(output: &Path) -> Result<Option<(PathBuf, TrainerState)>> {
    let mut best: Option<(usize, PathBuf)> = None;
    let Ok(entries) = std::fs::read_dir(output) else {
        return Ok(None);
    };
    for e in entries.filter_map(|e| e.ok()) {
        let name = e.file_name().to_string_lossy().into_owned();
        // final/ of a run stopped after training (during the merge or the summary) is its
        // latest checkpoint.
        let n = if name == "final" {
            Some(usize::MAX)
        } else {
            name.strip_prefix("checkpoint-")
                .and_then(|n| n.parse::<usize>().ok())
        };
        let Some(n) = n else {
            continue;
        };
        if e.path().join("trainer_state.json").is_file() && best.as_ref().is_none_or(|b| n > b.0) {
            best = Some((n, e.path()));
        }
    }
    let Some((_, dir)) = best else {
        return Ok(None);
    };
    let p = dir.join("trainer_state.json");
    let state: TrainerState = read_json(&p)?;
    Ok(Some((dir, state)))
}

fn restore_checkpoint(
    model: &TrainLlama,
    opt: &mut AdamW,
    dir: &Path,
    state: &TrainerState,
) -> Result<()> {
    crate::run::verify_checksums(dir).map_err(|m| TrainError::run(dir, m))?;
    let weights = if model.lora_config().is_some() {
        dir.join(ADAPTER_WEIGHTS)
    } else {
        dir.join("model.safetensors")
    };
    let tensors: HashMap<String, Tensor> = candle_core::safetensors::load(&weights, model.device())
        .map_err(|e| TrainError::input(&weights, e.to_string()))?;
    model.load_trainable(&tensors).map_err(|e| {
        TrainError::input(
            &weights,
            format!("does not match this model / LoRA setting: {e}"),
        )
    })?;
    opt.load(&dir.join("optimizer.safetensors"), state.optimizer_steps)?;
    Ok(())
}

fn progress_bar_named(enabled: bool, total: usize, what: &str) -> indicatif::ProgressBar {
    let bar = crate::train::steps_bar(enabled, total, 0);
    bar.set_message(what.to_string());
    bar
}

fn bar_message(metrics: &Metrics, tps: f64) -> String {
    let get = |k: &str| metrics.iter().find(|m| m.0 == k).map(|m| m.1);
    let mut s = format!("loss {:.4}", get("loss").unwrap_or(f64::NAN));
    if let Some(a) = get("rewards/accuracies") {
        s.push_str(&format!(" acc {a:.2}"));
    }
    s.push_str(&format!(" {tps:.0} tok/s"));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// PEFT's auto classes load an adapter from its directory alone only when
    /// `base_model_name_or_path` is something `from_pretrained` finds: a Hub id or a path.
    #[test]
    fn adapter_base_is_a_loadable_id_or_path() {
        let files = LocalModelFiles::Gguf(PathBuf::from("/no/such/model.gguf"));
        assert_eq!(
            adapter_base_name("default", &files),
            "HuggingFaceTB/SmolLM2-135M-Instruct"
        );
        assert_eq!(adapter_base_name("hf:org/base@v2", &files), "org/base");
        assert_eq!(adapter_base_name("org/base", &files), "org/base");
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("hf");
        std::fs::create_dir_all(&dir).unwrap();
        let files = LocalModelFiles::HfDir(dir.clone());
        assert_eq!(
            adapter_base_name(&dir.display().to_string(), &files),
            std::fs::canonicalize(&dir).unwrap().display().to_string()
        );
    }

    #[test]
    fn resume_settings_are_fields_of_the_config() {
        let v = serde_json::to_value(TrainConfig::new(
            PathBuf::from("d"),
            "default",
            PathBuf::from("o"),
        ))
        .unwrap();
        for name in RESUME_SETTINGS {
            assert!(v.get(name.replace('-', "_")).is_some(), "{name}");
        }
    }
}
