//! `bench train-step`: one DPO optimizer step of a local model in f32 (the
//! comparison point: batch 1 pair, prompt 128 + completion 128 tokens), full fine-tuning or
//! LoRA; seconds per step split into forward / backward / optimizer, tokens/s, peak RSS.

use std::time::Instant;

use candle_core::{DType, Device};
use collabllm::engine::peft::{AdapterConfig, LORA_TARGETS};
use collabllm::llm::spec::{resolve_local, LocalModelFiles, ModelSpec};
use collabllm::train::adamw::{AdamW, AdamWParams};
use collabllm::train::dpo::loss::{dpo_loss, DpoConfig};
use collabllm::train::logps::{completion_logps, pair_logps_full, PairBatch, TokenizedPair};
use collabllm::train::model::TrainLlama;
use collabllm::train::optim::clip_grad_norm;

pub struct Params {
    pub model: ModelSpec,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub steps: usize,
    pub lora: bool,
    pub checkpointing: bool,
}

/// Current resident set size in MB (Linux `VmRSS`).
fn rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1e3)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn run(p: Params) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let files = rt.block_on(resolve_local(&p.model))?;
    let dev = Device::Cpu;
    let t0 = Instant::now();
    let mut model = match &files {
        LocalModelFiles::Gguf(path) => TrainLlama::from_gguf(path, DType::F32, &dev)?,
        LocalModelFiles::HfDir(dir) => TrainLlama::from_hf_dir(dir, DType::F32, &dev)?,
        LocalModelFiles::Adapter { .. } => anyhow::bail!("benchmark a full model, not an adapter"),
    };
    if p.lora {
        let cfg = AdapterConfig::lora(32, 16.0, 0.0, &LORA_TARGETS, "bench");
        model.enable_lora(cfg, 0)?;
    }
    let load_s = t0.elapsed().as_secs_f64();
    let vocab = model.config().vocab_size as u32;
    // Deterministic ids spread over the vocabulary (the content does not change the cost).
    let ids = |n: usize, salt: u32| -> Vec<u32> {
        (0..n as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(salt) >> 7) % vocab)
            .collect()
    };
    let pair = TokenizedPair {
        prompt: ids(p.prompt_tokens, 1),
        chosen: ids(p.completion_tokens, 2),
        rejected: ids(p.completion_tokens, 3),
    };
    let batch = PairBatch::new(std::slice::from_ref(&pair), 0, &dev)?;
    let cfg = DpoConfig::default();
    let t_ref = Instant::now();
    model.set_adapters_enabled(false);
    let reference = pair_logps_full(&model, &batch)?;
    model.set_adapters_enabled(true);
    let ref_s = t_ref.elapsed().as_secs_f64();
    let (rc, rr) = (reference.chosen.detach(), reference.rejected.detach());
    drop(reference);
    let rss_load = rss_mb();
    let mut opt = AdamW::new(model.named_vars(), AdamWParams::default())?;
    let vars = model.vars();
    let (mut fwd, mut bwd, mut upd, mut total) = (vec![], vec![], vec![], vec![]);
    for step in 0..p.steps.max(1) + 1 {
        let t = Instant::now();
        let (mut grads, t_f, rss_f) = if p.checkpointing {
            // Forward and backward interleave; the split is not measurable.
            let (g, ()) = model.checkpointed_grads(&batch.input_ids, &batch.layout, |hidden| {
                let (sums, _) = completion_logps(&model, hidden, &batch.targets)?;
                let out = dpo_loss(
                    &sums.narrow(0, 0, 1)?,
                    &sums.narrow(0, 1, 1)?,
                    &rc,
                    &rr,
                    &cfg,
                )?;
                Ok((out.loss, ()))
            })?;
            (g, 0.0, 0.0)
        } else {
            let lp = pair_logps_full(&model, &batch)?;
            let out = dpo_loss(&lp.chosen, &lp.rejected, &rc, &rr, &cfg)?;
            let t_f = t.elapsed().as_secs_f64();
            let rss_f = rss_mb();
            (out.loss.backward()?, t_f, rss_f)
        };
        let t_b = t.elapsed().as_secs_f64();
        if step == 1 {
            println!(
                "RSS              after load+reference {rss_load:.0} MB, after forward {rss_f:.0} MB, after backward {:.0} MB",
                rss_mb()
            );
        }
        clip_grad_norm(&mut grads, &vars, 1.0)?;
        opt.step(&grads, 5e-6)?;
        drop(grads);
        let t_all = t.elapsed().as_secs_f64();
        if step > 0 {
            // Step 0 warms allocator and thread pool.
            fwd.push(t_f);
            bwd.push(t_b - t_f);
            upd.push(t_all - t_b);
            total.push(t_all);
        }
    }
    let step_s = median(total);
    let tokens = 2 * (p.prompt_tokens + p.completion_tokens);
    let rss = collabllm::cli::peak_rss_bytes().unwrap_or(0) as f64 / 1e6;
    let mode = match (p.lora, p.checkpointing) {
        (true, false) => "lora r=32",
        (true, true) => "lora r=32, gradient checkpointing",
        (false, false) => "full",
        (false, true) => "full, gradient checkpointing",
    };
    println!("model            {} ({mode}, f32)", files.path().display());
    println!(
        "threads          {}",
        std::env::var("CANDLE_NUM_THREADS").unwrap_or_default()
    );
    println!("trainable        {} parameters", model.num_params());
    println!("load             {load_s:.2} s");
    println!("reference pass   {ref_s:.2} s (once per pair, cached)");
    println!(
        "step             {step_s:.2} s (forward {:.2}, backward {:.2}, optimizer {:.2}); {:.0} tokens/s",
        median(fwd),
        median(bwd),
        median(upd),
        tokens as f64 / step_s
    );
    println!("peak RSS         {rss:.0} MB");
    println!(
        "{}",
        serde_json::json!({"bench": "train-step", "mode": mode, "step_s": step_s,
            "tokens_per_s": tokens as f64 / step_s, "reference_s": ref_s,
            "peak_rss_mb": rss, "load_s": load_s})
    );
    Ok(())
}
