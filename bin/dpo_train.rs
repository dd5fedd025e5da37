//! `dpo_train`: DPO (or SFT) training of a local chat model on preference pairs.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches, Parser};
use collabllm::hub;
use collabllm::run::{check_output_dir, Parents};
use collabllm::train::dpo::{train_until, TrainConfig, DEFAULT_OUTPUT};
use collabllm::train::settings::{DpoDefaults, LoraOptions, Schedule, TrainerDefaults, LORA_LR};

/// Train a chat model on preference pairs with DPO (TRL's losses and metrics), or SFT.
///
/// Data: the pairs `generate_conv` writes (a run directory, its `pairs/` folder, or one
/// parquet file) or any TRL preference parquet (conversational prompt/chosen/rejected, or the
/// plain-string form). Each pair is tokenized with the model's own chat template; long
/// histories lose their oldest whole turns; pairs that still do not fit are dropped and
/// counted. Reference log-probs are computed once and cached beside the data.
///
/// Output: `<output>/logs.jsonl` (one line per logging step, TRL metric names),
/// `<output>/checkpoint-<step>/` and `<output>/final/` (HF layout, or PEFT layout with
/// --lora; each also holds the tokenizer and optimizer state), `train_summary.json`.
/// Any checkpoint directory works as a model spec for `serve` and the other binaries.
#[derive(Parser, Debug)]
// Negative numbers parse as values, so `--max-grad-norm -1` gets the range check's message.
#[command(
    name = "dpo_train",
    version,
    about,
    long_about,
    allow_negative_numbers = true
)]
struct Args {
    /// TOML file with any of the settings (keys as in training_args.json, e.g. `beta = 0.2`,
    /// `[lora]` with r, alpha, dropout, targets); a flag given on the command line wins over
    /// the file (the LoRA flags over its whole `[lora]` table).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,

    /// Training pairs: a parquet file, a directory with train.parquet (test.parquet there is
    /// the evaluation split), or a generate_conv run directory (uses its pairs/). Required,
    /// here or as `data` in --config.
    #[arg(long, value_name = "PATH")]
    data: Option<PathBuf>,

    /// Evaluation pairs [default: test.parquet beside the training file, if present].
    #[arg(long, value_name = "PARQUET")]
    eval_data: Option<PathBuf>,

    /// Model to train: `default` (SmolLM2-135M-Instruct, dequantized to f32), a `.gguf` file,
    /// an HF directory (e.g. a previous `final/`), or an HF model id.
    #[arg(long, value_name = "SPEC", default_value = "default")]
    model: String,

    /// Output directory (logs, checkpoints, final model), created with any missing parent
    /// folders; an existing path that is not a directory is refused. Refuses to overwrite a
    /// finished or interrupted run unless --resume.
    #[arg(long, value_name = "DIR", default_value = DEFAULT_OUTPUT)]
    output: PathBuf,

    /// Loss: sigmoid (DPO), ipo, hinge, robust (label-smoothed DPO), or sft (supervised
    /// fine-tuning on prompt + chosen, loss on assistant tokens only).
    #[arg(long, value_name = "TYPE", default_value = "sigmoid",
          value_parser = ["sigmoid", "ipo", "hinge", "robust", "sft"])]
    loss: String,

    /// DPO temperature β.
    #[arg(long, value_name = "B", default_value_t = 0.1)]
    beta: f64,

    /// Label smoothing ε for `sigmoid` / `robust` (conservative DPO), in [0, 0.5).
    #[arg(long, value_name = "EPS", default_value_t = 0.0)]
    label_smoothing: f64,

    /// Weight of an added SFT (negative log-likelihood) term on the chosen completion
    /// (TRL's `rpo_alpha`); 0 turns it off.
    #[arg(long, value_name = "W", default_value_t = 0.0)]
    sft_weight: f64,

    /// With `--loss sft` on conversations (a run's `sft.parquet`, chosen automatically when
    /// --data is a run directory that has one): keep only conversations whose closing reply
    /// scored (MR) at least this, upstream's filter of the SFT warm-up data.
    #[arg(long, value_name = "X", allow_negative_numbers = true)]
    sft_min_score: Option<f64>,

    /// Train LoRA adapters on q,k,v,o,gate,up,down instead of all weights; the reference is
    /// the base model with adapters off. Saved in the PEFT layout.
    #[arg(long)]
    lora: bool,

    /// LoRA rank r.
    #[arg(long, value_name = "R", default_value_t = 32, requires = "lora")]
    lora_r: usize,

    /// LoRA α (the update is scaled by α / r).
    #[arg(long, value_name = "A", default_value_t = 16.0, requires = "lora")]
    lora_alpha: f64,

    /// LoRA dropout on the adapter input during training.
    #[arg(long, value_name = "P", default_value_t = 0.0, requires = "lora")]
    lora_dropout: f64,

    /// Comma-separated LoRA target modules.
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        requires = "lora"
    )]
    lora_targets: Vec<String>,

    /// With --lora: also write the base model with the adapters merged to <output>/merged/.
    #[arg(long, requires = "lora")]
    merge: bool,

    /// With --lora: write the base model as loaded to <output>/base/ (an HF folder) and
    /// record it as the adapters' base, so `AutoPeftModelForCausalLM` and `serve` load an
    /// adapter from its folder alone, offline. Without it the base of `default` or a GGUF is
    /// recorded by its Hub id, whose weights are not the dequantized ones trained on.
    #[arg(long, requires = "lora")]
    save_base: bool,

    /// Peak learning rate [default: 5e-6, or 2e-5 with --lora].
    #[arg(long, value_name = "X")]
    lr: Option<f64>,

    /// Passes over the training pairs (ignored when --max-steps is given).
    #[arg(long, value_name = "E", default_value_t = 1)]
    epochs: usize,

    /// Optimizer steps to run (overrides --epochs).
    #[arg(long, value_name = "N")]
    max_steps: Option<usize>,

    /// Train on at most N training pairs (SFT: conversations), a sample drawn with --seed and
    /// kept in file order: matches arms whose data differ in size [default: all].
    #[arg(long, value_name = "N")]
    max_pairs: Option<usize>,

    /// Pairs per micro-batch (chosen and rejected run as one batch of 2B rows).
    #[arg(long, value_name = "B", default_value_t = 1)]
    batch_size: usize,

    /// Instead of --batch-size: fill each micro-batch (from the epoch's seeded order) while the
    /// next example brings its tokens nearer T (a pair counts its prompt twice and both
    /// replies, as `num_tokens` in the logs; at least one example a batch). Arms whose
    /// examples differ in length then read the same tokens in the same steps [default: off].
    #[arg(long, value_name = "T", conflicts_with = "batch_size")]
    batch_tokens: Option<usize>,

    /// Micro-batches per optimizer step (gradient accumulation).
    #[arg(long, value_name = "K", default_value_t = 1)]
    grad_accum: usize,

    /// Longest prompt + completion in tokens.
    #[arg(long, value_name = "L", default_value_t = 1024)]
    max_length: usize,

    /// Learning-rate schedule after warmup.
    #[arg(long, value_enum, default_value_t = DpoDefaults::SCHEDULE)]
    schedule: Schedule,

    /// Fraction of the steps spent warming the learning rate up linearly.
    #[arg(long, value_name = "R", default_value_t = DpoDefaults::WARMUP_RATIO)]
    warmup_ratio: f64,

    /// Clip the global gradient norm to this (the pre-clip norm is logged as grad_norm);
    /// 0 turns clipping off.
    #[arg(long, value_name = "N", default_value_t = DpoDefaults::MAX_GRAD_NORM)]
    max_grad_norm: f64,

    /// AdamW decoupled weight decay.
    #[arg(long, value_name = "W", default_value_t = DpoDefaults::WEIGHT_DECAY)]
    weight_decay: f64,

    /// Seed for data order and LoRA initialisation.
    #[arg(long, value_name = "S", default_value_t = DpoDefaults::SEED)]
    seed: u64,

    /// Write a log line every K optimizer steps (metrics averaged over them).
    #[arg(long, value_name = "K", default_value_t = 1)]
    logging_steps: usize,

    /// Evaluate on the evaluation split every K steps, K >= 1 (always at the end when there
    /// is one).
    #[arg(long, value_name = "K")]
    eval_steps: Option<usize>,

    /// Save a checkpoint every K steps, K >= 1 (always at the end, as final/).
    #[arg(long, value_name = "K")]
    save_steps: Option<usize>,

    /// Continue from the last checkpoint in --output (weights, optimizer state, data
    /// position, logs).
    #[arg(long)]
    resume: bool,

    /// With --resume: settings that may differ from the interrupted run's, comma-separated
    /// (e.g. lr,beta). Without it a resume that changes the run's math (data, model, loss,
    /// beta, label-smoothing, sft-weight, lora, lr, epochs, max-steps, batch-size,
    /// grad-accum, max-length, warmup-ratio, schedule, max-grad-norm, weight-decay, seed,
    /// dtype) is refused. Each change is recorded in training_args.json.
    #[arg(long, value_name = "LIST", value_delimiter = ',', requires = "resume")]
    resume_override: Vec<String>,

    /// Compute device: cpu, or cuda / cuda:N (needs a build with `--features cuda`).
    #[arg(long, value_name = "DEV", default_value = "cpu")]
    device: String,

    /// Weight precision: auto (bf16 on CUDA, f32 on the CPU), f32 or bf16.
    #[arg(long, value_name = "T", default_value = "auto", value_parser = ["auto", "f32", "bf16"])]
    dtype: String,

    /// Float type of the saved checkpoints: auto (the source checkpoint's — a bf16 base is
    /// saved in bf16; f32 for a GGUF), f32, bf16 or f16.
    #[arg(long, value_name = "T", default_value = "auto", value_parser = ["auto", "f32", "bf16", "f16"])]
    save_dtype: String,

    /// Recompute each layer's activations during the backward pass instead of keeping them
    /// (HF's gradient checkpointing): activation memory of one layer instead of all, for about
    /// one extra forward pass of compute.
    #[arg(long)]
    gradient_checkpointing: bool,

    /// Do not read or write the reference log-prob cache (recompute every run).
    #[arg(long)]
    no_ref_cache: bool,

    /// After a successful run, publish final/ (the full model, or the PEFT adapter with
    /// --lora) as a private model repository <org>/<name> on the Hub, with a model card.
    /// Token: HF_TOKEN or the HF token file; endpoint: HF_ENDPOINT. Never runs mid-run.
    #[arg(long, value_name = "REPO")]
    push_to_hub: Option<String>,

    /// With --push-to-hub: create the repository public instead of private.
    #[arg(long, requires = "push_to_hub")]
    hub_public: bool,

    /// Threads for the compute kernels [default: CANDLE_NUM_THREADS, else all cores].
    #[arg(long, value_name = "N",
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1024))]
    threads: Option<usize>,
}

impl Args {
    fn into_config(self) -> TrainConfig {
        let mut cfg = TrainConfig::new(self.data.unwrap_or_default(), &self.model, self.output);
        let lora = self.lora.then(|| LoraOptions {
            r: self.lora_r,
            alpha: self.lora_alpha,
            dropout: self.lora_dropout,
            targets: self.lora_targets.clone(),
        });
        cfg.optim.lr = self
            .lr
            .unwrap_or(if lora.is_some() { LORA_LR } else { FULL_LR });
        cfg.eval_data = self.eval_data;
        cfg.loss = self.loss;
        cfg.beta = self.beta;
        cfg.label_smoothing = self.label_smoothing;
        cfg.sft_weight = self.sft_weight;
        cfg.sft_min_score = self.sft_min_score;
        cfg.lora = lora;
        cfg.merge = self.merge;
        cfg.save_base = self.save_base;
        cfg.epochs = self.epochs;
        cfg.max_steps = self.max_steps;
        cfg.max_pairs = self.max_pairs;
        cfg.batch_size = self.batch_size;
        cfg.batch_tokens = self.batch_tokens;
        cfg.grad_accum = self.grad_accum;
        cfg.max_length = self.max_length;
        cfg.optim.schedule = self.schedule;
        cfg.optim.warmup_ratio = self.warmup_ratio;
        cfg.optim.max_grad_norm = self.max_grad_norm;
        cfg.optim.weight_decay = self.weight_decay;
        cfg.optim.seed = self.seed;
        cfg.logging_steps = self.logging_steps;
        cfg.eval_steps = self.eval_steps;
        cfg.optim.save_steps = self.save_steps;
        cfg.resume = self.resume;
        cfg.resume_override = self.resume_override;
        cfg.optim.device = self.device;
        cfg.dtype = self.dtype;
        cfg.save_dtype = self.save_dtype;
        cfg.ref_cache = !self.no_ref_cache;
        cfg.optim.gradient_checkpointing = self.gradient_checkpointing;
        cfg
    }
}

/// Default peak learning rate of full fine-tuning (LoRA's is [`LORA_LR`]).
const FULL_LR: f64 = DpoDefaults::LR;

/// The config keys the command line set explicitly (a flag wins over --config).
fn keys_from_flags(matches: &clap::ArgMatches) -> BTreeSet<String> {
    matches
        .ids()
        .filter(|id| matches.value_source(id.as_str()) == Some(ValueSource::CommandLine))
        .map(|id| match id.as_str() {
            "lora" | "lora_r" | "lora_alpha" | "lora_dropout" | "lora_targets" => "lora".into(),
            "no_ref_cache" => "ref_cache".into(),
            other => other.to_string(),
        })
        .collect()
}

/// Defaults ← --config ← the flags given.
fn resolve(matches: &clap::ArgMatches) -> anyhow::Result<TrainConfig> {
    let args = Args::from_arg_matches(matches)?;
    let config = args.config.clone();
    let mut cfg = args.into_config();
    if let Some(path) = config {
        cfg = cfg.with_file(&path, &keys_from_flags(matches), (FULL_LR, LORA_LR))?;
    }
    if cfg.data.as_os_str().is_empty() {
        anyhow::bail!("--data is required (or `data` in --config)");
    }
    Ok(cfg)
}

/// Checks the repository name and token before training, so a typo fails in seconds.
fn check_hub(repo: Option<&str>) -> anyhow::Result<()> {
    let Some(repo) = repo else {
        return Ok(());
    };
    hub::split_repo(repo)?;
    if hub::Token::from_env().is_none() {
        return Err(hub::HubError::NoToken {
            path: hub::token_path(),
        })
        .context("--push-to-hub");
    }
    Ok(())
}

fn push(dir: &std::path::Path, repo: &str, public: bool) -> anyhow::Result<()> {
    let opts = hub::PushOptions {
        private: !public,
        ..hub::PushOptions::from_env()
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let report = rt
        .block_on(hub::push_model_dir(dir, repo, &opts))
        .with_context(|| format!("--push-to-hub {repo}"))?;
    println!("{report}");
    Ok(())
}

fn main() -> ExitCode {
    let matches = Args::command().get_matches();
    let args = match Args::from_arg_matches(&matches) {
        Ok(a) => a,
        Err(e) => e.exit(),
    };
    collabllm::cli::init_logging();
    collabllm::cli::set_compute_threads(args.threads);
    collabllm::cli::keep_freed_memory();
    let (repo, public) = (args.push_to_hub.clone(), args.hub_public);
    let cfg = match resolve(&matches) {
        Ok(cfg) => cfg,
        Err(e) => return collabllm::cli::exit_on_error(Err(e)),
    };
    let existed = cfg.output.exists();
    let result = (|| {
        check_output_dir("--output", &cfg.output, Parents::Create)?;
        check_hub(repo.as_deref())?;
        // SIGINT/SIGTERM stop after the step in progress, which is saved; the listener runs
        // on a runtime of its own beside the (synchronous) training loop.
        let signals = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        let shutdown = signals.block_on(async { collabllm::run::Shutdown::on_signals() })?;
        let s = train_until(&cfg, true, &shutdown)?;
        let get = |k: &str| s.last_log.get(k).and_then(|v| v.as_f64());
        println!(
            "trained {} steps on {} pairs in {:.1} s ({:.0} tokens/s); final loss {:.4}{}",
            s.steps,
            s.train_pairs,
            s.seconds,
            s.tokens_per_second,
            get("loss").unwrap_or(f64::NAN),
            get("rewards/accuracies")
                .map(|a| format!(", rewards/accuracies {a:.2}"))
                .unwrap_or_default()
        );
        println!("model: {}", s.final_dir.display());
        if let Some(m) = &s.merged_dir {
            println!("merged model: {}", m.display());
        }
        if let Some(repo) = &repo {
            push(&s.final_dir, repo, public)?;
        }
        Ok(())
    })();
    if result.is_err() {
        collabllm::cli::remove_unused_output(&cfg.output, existed);
    }
    collabllm::cli::exit_on_error(result)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `[default: …]` in `--help` is the library's real default (TrainConfig's, and
    /// LoraOptions' for the LoRA flags), but for those stated in words.
    #[test]
    fn help_defaults_are_the_configs() {
        let cfg = TrainConfig::new(PathBuf::new(), "default", DEFAULT_OUTPUT.into());
        let mut defaults = serde_json::to_value(&cfg).unwrap();
        let lora = LoraOptions::default();
        defaults["lora_r"] = lora.r.into();
        defaults["lora_alpha"] = lora.alpha.into();
        defaults["lora_dropout"] = lora.dropout.into();
        assert_eq!(cfg.optim.lr, FULL_LR);
        collabllm::cli::assert_help_defaults(
            &Args::command(),
            &defaults,
            &[
                "eval_data",
                "lr",
                "threads",
                "lora_targets",
                "max_pairs",
                "batch_tokens",
            ],
        );
        assert_eq!(
            Args::command()
                .get_arguments()
                .find(|a| a.get_id() == "lora_targets")
                .unwrap()
                .get_default_values()
                .iter()
                .map(|v| v.to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join(","),
            lora.targets.join(",")
        );
    }
}
