//! The compute kernels of a decode step alone, on synthetic data shaped like the default model
//! (SmolLM2-135M: 30 layers, hidden 576, MLP 1536, 9 query and 3 KV heads of 64): the int8
//! linear layers (Q4_1 blocks, and the Q8_0 output head) and the CPU attention, for each row
//! count. Best of `--repeats` passes (this VM's neighbours move single passes by ±15 %).
//! With `--model`, also whole decode steps of that model (`Engine::step`: every layer, the
//! head, sampling) for requests whose prompts share their start, as `serve-throughput
//! --prompts shared` sends them.

use std::time::Instant;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use collabllm::engine::cpu_attention::{attend_decode, to_f16, QueryGroup};
use collabllm::engine::q8::Q8Linear;
use collabllm::engine::team::on_pool;
use collabllm::engine::{Engine, GenParams, GenState, LoadOptions};
use collabllm::llm::{ChatMessage, ModelSpec};

use crate::serve_throughput::{message, Layout};

const LAYERS: usize = 30;
const HIDDEN: usize = 576;
const MLP: usize = 1536;
const VOCAB: usize = 49152;
const HEADS: usize = 9;
const KV_HEADS: usize = 3;
const HEAD_DIM: usize = 64;

#[derive(clap::Args, Debug)]
pub struct Params {
    /// Compute threads.
    #[arg(long, default_value_t = 2, value_parser = crate::at_least_one)]
    pub threads: usize,
    /// Rows of the step (decoding sequences), one measurement each (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,8,16", value_parser = crate::at_least_one)]
    pub rows: Vec<usize>,
    /// Prompt positions every row shares (a fork's prompt, or a conversation's prefix).
    #[arg(long, default_value_t = 200)]
    pub shared: usize,
    /// Positions of each row's own (decoded or tail) keys.
    #[arg(long, default_value_t = 60, value_parser = crate::at_least_one)]
    pub own: usize,
    /// Timed passes; the fastest is reported.
    #[arg(long, default_value_t = 40, value_parser = crate::at_least_one)]
    pub repeats: usize,
    /// Cached keys and values in f32 instead of f16 (what the engine's CPU caches hold for
    /// quantized weights): the attention figure as it was before they held f16.
    #[arg(long)]
    pub kv_f32: bool,
    /// Also time whole decode steps of this model (`default`, a .gguf file, an HF directory):
    /// per row count, that many requests whose ~`--shared`-token prompts differ only in a
    /// line near their end, each prefilled first; best and median of `--repeats`
    /// consecutive steps (each row's own positions grow by one a step).
    #[arg(long, value_name = "MODEL")]
    pub model: Option<ModelSpec>,
}

/// A random cache tensor, in the type the engine's CPU caches hold (f16) unless `f32`.
fn cache_tensor(shape: &[usize], f32: bool) -> candle_core::Result<Tensor> {
    let t = randn(shape)?;
    if f32 {
        Ok(t)
    } else {
        to_f16(&t)
    }
}

fn randn(shape: &[usize]) -> candle_core::Result<Tensor> {
    Tensor::randn(0f32, 1.0, shape, &Device::Cpu)
}

fn quantized(n: usize, k: usize, format: GgmlDType) -> anyhow::Result<Q8Linear> {
    let q = QTensor::quantize(&randn(&[n, k])?, format)?;
    Ok(Q8Linear::from_qtensor(&q)?)
}

/// Seconds of the fastest of `repeats` runs of `f`.
fn best(repeats: usize, mut f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    let mut best = f64::INFINITY;
    for _ in 0..repeats {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

pub async fn run(p: Params) -> anyhow::Result<()> {
    // A model that is not there fails before the synthetic measurements, not after them.
    let model = match &p.model {
        Some(spec) => Some(collabllm::llm::spec::resolve_local(spec).await?),
        None => None,
    };
    // One layer's linears, as the engine fuses them: q|k|v, o, gate|up, down.
    let shapes = [
        (HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN),
        (HIDDEN, HIDDEN),
        (2 * MLP, HIDDEN),
        (HIDDEN, MLP),
    ];
    let mut layers = Vec::new();
    for _ in 0..LAYERS {
        for &(n, k) in &shapes {
            layers.push(quantized(n, k, GgmlDType::Q4_1)?);
        }
    }
    let head = quantized(VOCAB, HIDDEN, GgmlDType::Q8_0)?;
    let layer_macs: usize = shapes.iter().map(|(n, k)| n * k).sum::<usize>() * LAYERS;
    let (shared, own) = (p.shared, p.own);
    let prefix: Vec<(Tensor, Tensor)> = (0..LAYERS)
        .map(|_| {
            Ok((
                cache_tensor(&[1, KV_HEADS, shared, HEAD_DIM], p.kv_f32)?,
                cache_tensor(&[1, KV_HEADS, shared, HEAD_DIM], p.kv_f32)?,
            ))
        })
        .collect::<candle_core::Result<_>>()?;
    let pos = shared + own - 1;
    println!(
        "threads {} · {LAYERS} layers · best of {} · attention over {shared} shared + {own} own positions ({} keys and values)",
        p.threads, p.repeats, if p.kv_f32 { "f32" } else { "f16" }
    );
    for &rows in &p.rows {
        let (x, x_mlp) = (randn(&[rows, HIDDEN])?, randn(&[rows, MLP])?);
        let linear = best(p.repeats, || {
            on_pool(|| {
                for (i, l) in layers.iter().enumerate() {
                    l.forward(if i % 4 == 3 { &x_mlp } else { &x })?;
                }
                Ok(())
            })
        })?;
        let lm_head = best(p.repeats, || Ok(on_pool(|| head.forward(&x)).map(|_| ())?))?;
        // `rows` samples of one request: one call, the prompt shared.
        let q = randn(&[rows, HEADS, 1, HEAD_DIM])?;
        let mine: Vec<(Tensor, Tensor)> = (0..LAYERS)
            .map(|_| {
                Ok((
                    cache_tensor(&[rows, KV_HEADS, own, HEAD_DIM], p.kv_f32)?,
                    cache_tensor(&[rows, KV_HEADS, own, HEAD_DIM], p.kv_f32)?,
                ))
            })
            .collect::<candle_core::Result<_>>()?;
        let samples = best(p.repeats, || {
            on_pool(|| {
                for ((pk, pv), (k, v)) in prefix.iter().zip(&mine) {
                    attend_decode(&[QueryGroup {
                        q: &q,
                        prefix: Some((pk, pv)),
                        k,
                        v,
                        pos,
                    }])?;
                }
                Ok(())
            })
        })?;
        // `rows` requests with one conversation: a call each, spread over the threads.
        let qs: Vec<Tensor> = (0..rows)
            .map(|r| q.narrow(0, r, 1)?.contiguous())
            .collect::<candle_core::Result<_>>()?;
        let theirs: Vec<Vec<(Tensor, Tensor)>> = mine
            .iter()
            .map(|(k, v)| {
                (0..rows)
                    .map(|r| {
                        Ok((
                            k.narrow(0, r, 1)?.contiguous()?,
                            v.narrow(0, r, 1)?.contiguous()?,
                        ))
                    })
                    .collect::<candle_core::Result<_>>()
            })
            .collect::<candle_core::Result<_>>()?;
        let requests = best(p.repeats, || {
            on_pool(|| {
                for ((pk, pv), own) in prefix.iter().zip(&theirs) {
                    let groups: Vec<QueryGroup> = qs
                        .iter()
                        .zip(own)
                        .map(|(q, (k, v))| QueryGroup {
                            q,
                            prefix: Some((pk, pv)),
                            k,
                            v,
                            pos,
                        })
                        .collect();
                    attend_decode(&groups)?;
                }
                Ok(())
            })
        })?;
        let gmacs = |macs: usize, s: f64| (macs * rows) as f64 / s / 1e9;
        println!(
            "rows {rows:>3}: Q4_1 layers {:.2} ms ({:.0} G MAC/s) · Q8_0 head {:.2} ms ({:.0} G MAC/s) · \
             attention {:.2} ms as one request's samples, {:.2} ms as separate requests",
            linear * 1e3,
            gmacs(layer_macs, linear),
            lm_head * 1e3,
            gmacs(VOCAB * HIDDEN, lm_head),
            samples * 1e3,
            requests * 1e3
        );
    }
    if let Some(files) = &model {
        let engine = Engine::load(files, &LoadOptions::default())?;
        for &rows in &p.rows {
            let (best, median) = engine_steps(&engine, rows, p.shared, p.repeats)?;
            println!(
                "rows {rows:>3}: decode step of {} {:.2} ms best, {:.2} ms median ({:.0} tokens/s at the median)",
                engine.name(),
                best * 1e3,
                median * 1e3,
                rows as f64 / median
            );
        }
    }
    Ok(())
}

/// Seconds of the fastest and the median of `repeats` decode steps of `rows` requests
/// (greedy), after their prompts are prefilled: the first prompt (the one no row uses) is
/// generated from once, so that the others find their shared start in the prompt cache.
fn engine_steps(
    engine: &Engine,
    rows: usize,
    shared: usize,
    repeats: usize,
) -> anyhow::Result<(f64, f64)> {
    let prompts = (0..=rows)
        .map(|i| {
            let text = message(engine.codec(), i, shared, Layout::Shared)?;
            Ok(engine.encode_chat(&[ChatMessage::user(text)])?)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let params = GenParams {
        temperature: 0.0,
        top_p: 1.0,
        max_new_tokens: repeats + 1,
        stop: Vec::new(),
        seed: Some(0),
        n: 1,
        eos: collabllm::engine::EosRule::Ignore,
        logprobs: None,
    };
    engine.generate(
        &prompts[0],
        &GenParams {
            max_new_tokens: 1,
            ..params.clone()
        },
    )?;
    let mut states = prompts[1..]
        .iter()
        .map(|p| engine.start(p, &params))
        .collect::<Result<Vec<GenState>, _>>()?;
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let mut batch: Vec<&mut GenState> = states.iter_mut().collect();
        let t = Instant::now();
        engine.step(&mut batch)?;
        times.push(t.elapsed().as_secs_f64());
    }
    let fastest = times.iter().copied().fold(f64::INFINITY, f64::min);
    Ok((fastest, crate::median(times)))
}
