//! `bench train-step`: optimizer steps of DPO (full or LoRA) or a GRPO update, timed, on
//! the CPU or a CUDA device: seconds per step, tokens/s, peak memory against the estimate,
//! and model-FLOPs utilisation against the card's dense bf16 peak. A real model, or a model
//! of a named shape with random weights (`--shape llama-3.1-8b --random-init`): speed and
//! memory do not depend on the values, and nothing large has to travel to a GPU machine.

use std::time::Instant;

use anyhow::{bail, Context};
use candle_core::{DType, Device};
use clap::ValueEnum;
use collabllm::engine::peft::{AdapterConfig, LORA_TARGETS};
use collabllm::llm::spec::{resolve_local, LocalModelFiles, ModelSpec};
use collabllm::train::adamw::{AdamW, AdamWParams};
use collabllm::train::capacity::{
    card_bf16_peak, device_info, estimate_memory, step_flops, MemoryEstimate, MemoryProbe,
    StepShape, Trainable,
};
use collabllm::train::dpo::loss::{dpo_loss, DpoConfig};
use collabllm::train::logps::{completion_logps, pair_logps_full, PairBatch, TokenizedPair};
use collabllm::train::model::TrainLlama;
use collabllm::train::optim::clip_grad_norm;
use collabllm::train::rl::batch::RlSample;
use collabllm::train::rl::step::{RlConfig, RlTrainer};
use collabllm::train::settings::parse_device;
use collabllm::train::shapes::{random_model, shape_config};

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algo {
    /// A DPO step on packed pairs (prompt, chosen, rejected in one row), reference
    /// log-probs precomputed as dpo_train caches them.
    Dpo,
    /// A GRPO update (rl_train's): responses packed after their group's prompt, the KL
    /// term's reference pass (verl's default coefficient), one optimizer step.
    Grpo,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    F32,
    Bf16,
}

/// Times optimizer steps of a local model or of a model shape with random weights.
#[derive(clap::Args, Debug)]
pub struct Params {
    /// Model spec (`default` is dequantized from its GGUF); ignored with `--shape`.
    #[arg(long, default_value = "default")]
    pub model: ModelSpec,
    /// A model shape instead of a model: a preset (qwen2.5-0.5b, llama-3.2-1b, qwen2.5-7b,
    /// llama-3.1-8b, tiny) or an HF config.json (file or folder). Needs `--random-init`.
    #[arg(long, value_name = "NAME|FILE", requires = "random_init")]
    pub shape: Option<String>,
    /// Random weights of the shape (`--shape`) or of `--model`'s configuration, drawn
    /// where the model runs (the same values on every device for one `--seed`).
    #[arg(long)]
    pub random_init: bool,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Float type of weights and activations (AdamW's moments stay f32).
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: Precision,
    /// What one step trains on.
    #[arg(long, value_enum, default_value = "dpo")]
    pub algo: Algo,
    /// Pairs (DPO) or responses (GRPO) per optimizer step, in one forward/backward pass.
    #[arg(long, default_value_t = 1, value_parser = super::at_least_one)]
    pub batch: usize,
    /// GRPO: responses per prompt (the batch holds batch / group-size prompts).
    #[arg(long, default_value_t = 8, value_parser = super::at_least_one)]
    pub group_size: usize,
    /// Compute threads (CPU).
    #[arg(long, default_value_t = 2, value_parser = super::at_least_one)]
    pub threads: usize,
    /// Prompt tokens.
    #[arg(long, default_value_t = 128, value_parser = super::at_least_one)]
    pub prompt_tokens: usize,
    /// Tokens in each completion (chosen and rejected, or each GRPO response).
    #[arg(long, default_value_t = 128, value_parser = super::at_least_one)]
    pub completion_tokens: usize,
    /// Timed steps after one warm-up step; the median is reported.
    #[arg(long, default_value_t = 3, value_parser = super::at_least_one)]
    pub steps: usize,
    /// Train LoRA adapters on all seven projections instead of all weights.
    #[arg(long)]
    pub lora: bool,
    /// LoRA rank (α = rank / 2).
    #[arg(long, default_value_t = 32, value_parser = super::at_least_one)]
    pub lora_r: usize,
    /// Recompute activations layer by layer in the backward pass (less memory).
    #[arg(long)]
    pub gradient_checkpointing: bool,
    /// The card's dense bf16 peak in TFLOP/s, for model-FLOPs utilisation (default: from a
    /// table of data-centre cards by the device's name; none on the CPU).
    #[arg(long, value_parser = positive_finite)]
    pub peak_tflops: Option<f64>,
    /// Print the memory estimate and whether it fits the device, and run nothing.
    #[arg(long)]
    pub estimate_only: bool,
    /// Run even when the estimate says the step does not fit the device.
    #[arg(long)]
    pub force: bool,
}

fn positive_finite(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        Ok(_) => Err("must be a finite number above 0".into()),
        Err(e) => Err(e.to_string()),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// Deterministic ids spread over the vocabulary (the content does not change the cost).
fn ids(n: usize, salt: u32, vocab: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(salt) >> 7) % vocab)
        .collect()
}

impl Params {
    fn dtype(&self) -> DType {
        match self.dtype {
            Precision::F32 => DType::F32,
            Precision::Bf16 => DType::BF16,
        }
    }

    fn trainable(&self) -> Trainable {
        if self.lora {
            Trainable::Lora {
                r: self.lora_r,
                targets: LORA_TARGETS.iter().map(|t| t.to_string()).collect(),
            }
        } else {
            Trainable::Full
        }
    }

    /// Rows, row length and loss tokens of one step, as the trainers pack them.
    fn step_shape(&self) -> anyhow::Result<StepShape> {
        let (p, c) = (self.prompt_tokens, self.completion_tokens);
        let (rows, row_tokens, extra) = match self.algo {
            Algo::Dpo => (self.batch, p + 2 * c, 0),
            Algo::Grpo => {
                if !self.batch.is_multiple_of(self.group_size) {
                    bail!(
                        "--batch {} must be a multiple of --group-size {}",
                        self.batch,
                        self.group_size
                    );
                }
                (self.batch / self.group_size, p + self.group_size * c, 1)
            }
        };
        let loss_tokens = match self.algo {
            Algo::Dpo => 2 * self.batch * c,
            Algo::Grpo => self.batch * c,
        };
        Ok(StepShape {
            rows,
            row_tokens,
            attention_keys: p + c,
            loss_tokens,
            extra_forwards: extra,
            trainable: self.trainable(),
            checkpointing: self.gradient_checkpointing,
        })
    }

    fn mode(&self) -> String {
        let mut mode = match self.algo {
            Algo::Dpo => "dpo".to_string(),
            Algo::Grpo => "grpo".to_string(),
        };
        mode.push_str(if self.lora { " lora" } else { " full" });
        if self.lora {
            mode.push_str(&format!(" r={}", self.lora_r));
        }
        if self.gradient_checkpointing {
            mode.push_str(", checkpointing");
        }
        mode
    }
}

/// The model to train: loaded, or of its shape with random weights.
fn load_model(p: &Params, dtype: DType, device: &Device) -> anyhow::Result<(TrainLlama, String)> {
    if let Some(shape) = &p.shape {
        let cfg = shape_config(shape)?;
        return Ok((random_model(&cfg, dtype, device, p.seed)?, shape.clone()));
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let files = rt.block_on(resolve_local(&p.model))?;
    let name = files.path().display().to_string();
    let model = match &files {
        LocalModelFiles::Adapter { .. } => bail!("benchmark a full model, not an adapter"),
        _ if p.random_init => {
            let model = match &files {
                LocalModelFiles::Gguf(path) => TrainLlama::from_gguf(path, dtype, &Device::Cpu)?,
                _ => TrainLlama::from_hf_dir(files.path(), dtype, &Device::Cpu)?,
            };
            random_model(model.config(), dtype, device, p.seed)?
        }
        LocalModelFiles::Gguf(path) => TrainLlama::from_gguf(path, dtype, device)?,
        LocalModelFiles::HfDir(dir) => TrainLlama::from_hf_dir(dir, dtype, device)?,
    };
    Ok((model, name))
}

/// One timed step's parts, seconds.
struct StepTimes {
    total: f64,
    forward_backward: f64,
    loss: f64,
    grad_norm: f64,
}

pub fn run(p: Params) -> anyhow::Result<()> {
    let device = parse_device(&p.device)?;
    let dtype = p.dtype();
    let step = p.step_shape()?;
    let cfg = match &p.shape {
        Some(s) => Some(shape_config(s)?),
        None => None,
    };
    let info = device_info(&device);
    if let Some(cfg) = &cfg {
        let est = estimate_memory(cfg, dtype, &step);
        print_estimate(&est, info.as_ref());
        let fits = info.as_ref().is_none_or(|(_, total)| est.total() <= *total);
        if p.estimate_only {
            println!(
                "{}",
                serde_json::json!({"bench": "train-step-estimate", "shape": p.shape,
                    "mode": p.mode(), "estimate_bytes": est.total(), "fits": fits,
                    "device_bytes": info.as_ref().map(|i| i.1)})
            );
            return Ok(());
        }
        if !fits && !p.force {
            bail!(
                "the step is estimated at {:.1} GiB, more than the device's {:.1} GiB: use \
                 --gradient-checkpointing, --lora, fewer tokens, or --force to try anyway",
                gib(est.total()),
                gib(info.as_ref().map_or(0, |i| i.1))
            );
        }
    } else if p.estimate_only {
        bail!("--estimate-only needs --shape (the estimate is made from a shape alone)");
    }

    let t0 = Instant::now();
    let probe = MemoryProbe::start(&device);
    let (mut model, name) = load_model(&p, dtype, &device).context("loading the model")?;
    if p.lora {
        let alpha = p.lora_r as f64 / 2.0;
        let cfg = AdapterConfig::lora(p.lora_r, alpha, 0.0, &LORA_TARGETS, "bench");
        model.enable_lora(cfg, 0)?;
    }
    device.synchronize()?;
    let load_s = t0.elapsed().as_secs_f64();
    let trainable = model.num_params();
    let flops = step_flops(model.config(), &step);
    let estimate = estimate_memory(model.config(), dtype, &step);
    let times = match p.algo {
        Algo::Dpo => dpo_steps(&p, model, &device)?,
        Algo::Grpo => grpo_steps(&p, model, &device)?,
    };
    let step_s = median(times.iter().map(|t| t.total).collect());
    let fb_s = median(times.iter().map(|t| t.forward_backward).collect());
    let tokens = step.tokens();
    let peak_bytes = match &probe {
        Some(probe) => probe.peak(),
        None => collabllm::cli::peak_rss_bytes().unwrap_or(0),
    };
    let card = info.as_ref().map(|i| i.0.clone());
    let peak = p.peak_tflops.map(|t| (t, "--peak-tflops")).or_else(|| {
        card.as_deref()
            .and_then(card_bf16_peak)
            .map(|(t, _)| (t, "datasheet"))
    });
    let tflops = flops / step_s / 1e12;
    let mfu = peak.map(|(t, _)| tflops / t);
    let last = times.last().expect("at least one timed step");

    println!("model            {name} ({}, {dtype:?})", p.mode());
    match &card {
        Some(c) => println!(
            "device           {c} ({:.0} GiB)",
            gib(info.as_ref().map_or(0, |i| i.1))
        ),
        None => println!(
            "device           cpu, {} threads",
            std::env::var("CANDLE_NUM_THREADS").unwrap_or_default()
        ),
    }
    println!("trainable        {trainable} parameters");
    println!(
        "step             {} rows × {} tokens ({} loss tokens)",
        step.rows, step.row_tokens, step.loss_tokens
    );
    println!("load             {load_s:.2} s");
    println!(
        "time             {step_s:.3} s a step (forward+backward {fb_s:.3} s); {:.0} tokens/s",
        tokens as f64 / step_s
    );
    println!(
        "model FLOPs      {:.1} TFLOP/s ({:.2e} a step)",
        tflops, flops
    );
    if let (Some(m), Some((t, from))) = (mfu, peak) {
        println!(
            "MFU              {:.1} % of {t:.0} TFLOP/s ({from})",
            100.0 * m
        );
    }
    println!(
        "peak memory      {:.2} GiB {} (estimate {:.2} GiB)",
        gib(peak_bytes),
        if probe.is_some() {
            "on the device"
        } else {
            "resident"
        },
        gib(estimate.total())
    );
    println!(
        "loss, grad norm  {:.6}, {:.6} (last step)",
        last.loss, last.grad_norm
    );
    println!(
        "{}",
        serde_json::json!({"bench": "train-step", "model": name, "mode": p.mode(),
            "algo": format!("{:?}", p.algo).to_lowercase(), "lora": p.lora,
            "checkpointing": p.gradient_checkpointing,
            "dtype": format!("{dtype:?}").to_lowercase(), "device": card.clone().unwrap_or("cpu".into()),
            "rows": step.rows, "row_tokens": step.row_tokens, "tokens": tokens,
            "trainable": trainable, "step_s": step_s, "forward_backward_s": fb_s,
            "tokens_per_s": tokens as f64 / step_s, "tflops": tflops, "mfu": mfu,
            "peak_tflops": peak.map(|p| p.0), "peak_bytes": peak_bytes,
            "estimate_bytes": estimate.total(), "estimate": estimate,
            "loss": last.loss, "grad_norm": last.grad_norm, "load_s": load_s,
            "peak_rss_mb": collabllm::cli::peak_rss_bytes().unwrap_or(0) as f64 / 1e6})
    );
    Ok(())
}

fn print_estimate(e: &MemoryEstimate, device: Option<&(String, u64)>) {
    println!(
        "estimate         {:.2} GiB: weights {:.2}, reference {:.2}, grads {:.2}, \
         optimizer {:.2}, activations {:.2}, logits {:.2}{}",
        gib(e.total()),
        gib(e.weights),
        gib(e.reference),
        gib(e.grads),
        gib(e.optimizer),
        gib(e.activations),
        gib(e.logits),
        match device {
            Some((name, total)) => format!(
                " — {} {name}'s {:.0} GiB",
                if e.total() <= *total {
                    "fits"
                } else {
                    "does NOT fit"
                },
                gib(*total)
            ),
            None => String::new(),
        }
    );
}

/// Warm-up plus `--steps` timed DPO steps on the trainer's path (layer-by-layer backward,
/// the fused head where it applies).
fn dpo_steps(p: &Params, model: TrainLlama, device: &Device) -> anyhow::Result<Vec<StepTimes>> {
    let vocab = model.config().vocab_size as u32;
    let pairs: Vec<TokenizedPair> = (0..p.batch as u32)
        .map(|i| TokenizedPair {
            prompt: ids(p.prompt_tokens, 1 + 3 * i, vocab),
            chosen: ids(p.completion_tokens, 2 + 3 * i, vocab),
            rejected: ids(p.completion_tokens, 3 + 3 * i, vocab),
        })
        .collect();
    let batch = PairBatch::new(&pairs, 0, device)?;
    let cfg = DpoConfig::default();
    model.set_adapters_enabled(false);
    let reference = pair_logps_full(&model, &batch)?;
    model.set_adapters_enabled(true);
    let (rc, rr) = (reference.chosen.detach(), reference.rejected.detach());
    drop(reference);
    let mut opt = AdamW::new(model.named_vars(), AdamWParams::default())?;
    let vars = model.vars();
    let b = p.batch;
    let mut times = Vec::new();
    for step in 0..=p.steps {
        let t = Instant::now();
        let (mut grads, loss) = model.grads(
            &batch.input_ids,
            &batch.layout,
            p.gradient_checkpointing,
            |hidden| {
                let (sums, _) = completion_logps(&model, hidden, &batch.targets)?;
                let out = dpo_loss(
                    &sums.narrow(0, 0, b)?,
                    &sums.narrow(0, b, b)?,
                    &rc,
                    &rr,
                    &cfg,
                )?;
                let v = out.loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                Ok((out.loss, v))
            },
        )?;
        device.synchronize()?;
        let fb = t.elapsed().as_secs_f64();
        let norm = clip_grad_norm(&mut grads, &vars, 1.0)?;
        opt.step(&grads, 5e-6)?;
        drop(grads);
        device.synchronize()?;
        if !loss.is_finite() || !norm.is_finite() {
            bail!("step {step}: non-finite loss {loss} or gradient norm {norm}");
        }
        if step > 0 {
            // Step 0 warms the allocator, the kernels' first launches and the thread pool.
            times.push(StepTimes {
                total: t.elapsed().as_secs_f64(),
                forward_backward: fb,
                loss,
                grad_norm: norm,
            });
        }
    }
    Ok(times)
}

/// Warm-up plus `--steps` timed GRPO updates of rl_train's trainer on fixed responses
/// (advantages ±1 within each group).
fn grpo_steps(p: &Params, model: TrainLlama, device: &Device) -> anyhow::Result<Vec<StepTimes>> {
    let vocab = model.config().vocab_size as u32;
    let samples: Vec<RlSample> = (0..p.batch)
        .map(|i| {
            let group = i / p.group_size;
            RlSample {
                group,
                response: i % p.group_size,
                prompt: ids(p.prompt_tokens, 1 + group as u32, vocab),
                response_ids: ids(p.completion_tokens, 1000 + i as u32, vocab),
                advantage: if i % 2 == 0 { 1.0 } else { -1.0 },
            }
        })
        .collect();
    let mut cfg = RlConfig {
        micro_batch: 0,
        max_length: p.prompt_tokens + p.completion_tokens + 1,
        ..RlConfig::default()
    };
    cfg.optim.gradient_checkpointing = p.gradient_checkpointing;
    cfg.optim.lr = 1e-6;
    let mut trainer = RlTrainer::new(model, cfg, 0)?;
    let mut times = Vec::new();
    for step in 0..=p.steps {
        let t = Instant::now();
        let report = trainer.update_samples(&samples)?;
        device.synchronize()?;
        let total = t.elapsed().as_secs_f64();
        let (loss, norm) = (report.losses[0], report.grad_norms[0]);
        if step > 0 {
            times.push(StepTimes {
                total,
                // The update does not expose its parts; the whole update is the pass.
                forward_backward: total,
                loss,
                grad_norm: norm,
            });
        }
    }
    Ok(times)
}
