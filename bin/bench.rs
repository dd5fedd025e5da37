//! `bench`: reproducible performance measurements recorded in BENCHMARKS.md.

use std::process::ExitCode;

use anyhow::Context;
use clap::builder::TypedValueParser;
use clap::{Parser, Subcommand};
use collabllm::engine::llama::WeightFormat;
use collabllm::engine::{Engine, EngineError, GenParams, LoadOptions};
use collabllm::llm::spec::resolve_local;
use collabllm::llm::{ChatMessage, ModelSpec};

/// Performance measurements (see BENCHMARKS.md for the recorded figures).
#[derive(Parser, Debug)]
#[command(name = "bench", version, about)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Adaptive future sampling replayed over finished generate_conv runs (fixed S): the
    /// futures the racing rule would play, as a share of the run's, and how often its pair is
    /// the fixed-S pair, per interval width. No model is called.
    AdaptiveReplay(adaptive_replay::Params),
    /// Local decoding speed: prompt tokens/s, generated tokens/s for one stream, aggregate
    /// generated tokens/s for `--n` samples of one prompt, and peak RSS.
    Decode {
        /// Model spec (`default`, a .gguf file, an HF directory or id).
        #[arg(long, default_value = "default")]
        model: ModelSpec,
        /// Compute threads.
        #[arg(long, default_value_t = 2, value_parser = at_least_one)]
        threads: usize,
        /// Approximate prompt length in tokens (the chat template's own tokens included; raw
        /// text for a base model without a chat template).
        #[arg(long, default_value_t = 200, value_parser = at_least_one)]
        prompt_tokens: usize,
        /// Tokens generated per sample (end-of-turn is ignored so every run is this long).
        #[arg(long, default_value_t = 128, value_parser = at_least_one)]
        new_tokens: usize,
        /// Samples decoded together in the batched run.
        #[arg(long, default_value_t = 4, value_parser = at_least_one)]
        n: usize,
        /// Timed repetitions; the median is reported.
        #[arg(long, default_value_t = 3, value_parser = at_least_one)]
        repeats: usize,
        /// How the linear layers are held (as `serve --weights`): `auto`, `q8`, `native` or
        /// `f32`.
        #[arg(long, value_name = "FORMAT", default_value = "auto",
              value_parser = clap::builder::PossibleValuesParser::new(WeightFormat::NAMES)
                  .try_map(|s| s.parse::<WeightFormat>()))]
        weights: WeightFormat,
    },
    /// generate_conv's orchestration against a local OpenAI-compatible endpoint that answers
    /// after a fixed latency with at most `--cap` requests in service: achieved calls/s against
    /// the ideal cap/latency, conversation wall time against its critical path, peak RSS.
    Orchestration {
        /// Endpoint latency per request, milliseconds.
        #[arg(long, default_value_t = 200, value_parser = at_least_one_u64)]
        latency_ms: u64,
        /// Requests the endpoint serves at once (others queue); also the client's limit.
        #[arg(long, default_value_t = 4, value_parser = at_least_one)]
        cap: usize,
        /// Tasks (conversations).
        #[arg(long, default_value_t = 8, value_parser = at_least_one)]
        tasks: usize,
        /// Turns per conversation (T).
        #[arg(long, default_value_t = 3, value_parser = at_least_one)]
        turns: usize,
        /// Candidates per turn (N).
        #[arg(long, default_value_t = 3, value_parser = at_least_one)]
        candidates: usize,
        /// Futures per candidate (S).
        #[arg(long, default_value_t = 3, value_parser = at_least_one)]
        samples: usize,
        /// Messages per future (W).
        #[arg(long, default_value_t = 4, value_parser = at_least_one)]
        window: usize,
        /// Conversations in flight.
        #[arg(long, default_value_t = 8, value_parser = at_least_one)]
        concurrency: usize,
        /// Endpoints, each with its own --cap; more than one are used as one endpoint pool
        /// (`openai:<model>@<url1>,<url2>,…`): the ideal rate is endpoints × cap / latency.
        #[arg(long, default_value_t = 1, value_parser = at_least_one)]
        endpoints: usize,
    },
    /// The kernels of a decode step alone, on synthetic data shaped like the default model:
    /// the int8 linear layers, the output head and the CPU attention, per row count (best of
    /// `--repeats`).
    Kernels(kernels::Params),
    /// The decode stall long prompts cause: one client streams a long greedy reply while
    /// `--arrivals` requests with ~`--prompt-tokens`-token prompts arrive at once; prints
    /// the median, 95th-percentile and largest gap between streamed pieces (what
    /// `--prefill-chunk` bounds). The prompt cache is off.
    PrefillStall(prefill_stall::Params),
    /// Continuous batching: `c` concurrent clients of the local backend (greedy chat
    /// requests, one after another per client) for each `c` of `--concurrency`: aggregate
    /// generated tokens/s, mean latency, peak RSS. `--max-batch 1` is the one-request-at-a-time
    /// baseline.
    ServeThroughput(serve_throughput::Params),
    /// Optimizer steps timed: DPO (full or LoRA) or a GRPO update, on the CPU or a CUDA
    /// device, of a model or of a named shape with random weights (`--shape llama-3.1-8b
    /// --random-init`): seconds a step, tokens/s, peak memory against the estimate, and
    /// model-FLOPs utilisation against the card's bf16 peak. Run each mode in its own
    /// process: peak memory is per process.
    TrainStep(train_step::Params),
}

/// Every bench count is at least 1: a zero would time nothing and print 0 (or infinite)
/// rates. Clap names the flag and the value in the error.
fn at_least_one_u64(s: &str) -> Result<u64, String> {
    match s.trim().parse::<u64>() {
        Ok(n) if n >= 1 => Ok(n),
        Ok(_) => Err("must be at least 1".into()),
        Err(e) => Err(e.to_string()),
    }
}

fn at_least_one(s: &str) -> Result<usize, String> {
    usize::try_from(at_least_one_u64(s)?).map_err(|e| e.to_string())
}

#[path = "bench/adaptive_replay.rs"]
mod adaptive_replay;
#[path = "bench/kernels.rs"]
mod kernels;
#[path = "bench/orchestration.rs"]
mod orchestration;
#[path = "bench/prefill_stall.rs"]
mod prefill_stall;
#[path = "bench/serve_throughput.rs"]
mod serve_throughput;
#[path = "bench/train_step.rs"]
mod train_step;

/// Sets the compute threads (before the model loads), then runs `body` on a multi-threaded
/// runtime.
fn on_runtime(
    threads: usize,
    body: impl std::future::Future<Output = anyhow::Result<()>>,
) -> anyhow::Result<()> {
    collabllm::cli::set_compute_threads(Some(threads));
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(body)
}

/// The local model and compute threads of the benches that load one.
#[derive(clap::Args, Debug)]
pub struct LocalModelArgs {
    /// Model spec (`default`, a .gguf file, an HF directory or id).
    #[arg(long, default_value = "default")]
    pub model: ModelSpec,
    /// Compute threads.
    #[arg(long, default_value_t = 2, value_parser = at_least_one)]
    pub threads: usize,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A user message whose rendered prompt is about `target` tokens long (raw text, as
/// `/v1/completions` sends it, for a base model without a chat template).
fn prompt_of(engine: &Engine, target: usize) -> anyhow::Result<Vec<u32>> {
    let sentence = "The committee reviewed the quarterly report on river water quality, \
                    noting that nitrate levels fell while turbidity rose after the spring floods. ";
    let mut text = String::new();
    loop {
        let ids = match engine.render(&[ChatMessage::user(text.clone())]) {
            Ok(rendered) => engine.encode(&rendered)?,
            Err(EngineError::NoChatTemplate(_)) => engine.encode_raw(&text)?,
            Err(e) => return Err(e.into()),
        };
        if ids.len() >= target {
            return Ok(ids);
        }
        text.push_str(sentence);
    }
}

fn decode(
    model: ModelSpec,
    prompt_tokens: usize,
    new_tokens: usize,
    n: usize,
    repeats: usize,
    weights: WeightFormat,
) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let files = rt.block_on(resolve_local(&model))?;
    let t0 = std::time::Instant::now();
    // Every repeat prefills the whole prompt: prefix reuse would skip it.
    let opts = LoadOptions {
        prefix_cache_mb: Some(0),
        weights,
        ..LoadOptions::default()
    };
    let engine = Engine::load(&files, &opts)?;
    let load_secs = t0.elapsed().as_secs_f64();
    let prompt = prompt_of(&engine, prompt_tokens)?;
    let params = |n| GenParams {
        temperature: 0.0,
        top_p: 1.0,
        max_new_tokens: new_tokens,
        stop: Vec::new(),
        seed: Some(0),
        n,
        eos: collabllm::engine::EosRule::Ignore,
        logprobs: None,
    };
    engine.generate(&prompt, &params(1)).context("warm-up")?;
    let (mut pf, mut single, mut batched) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..repeats.max(1) {
        let out = engine.generate(&prompt, &params(1))?;
        pf.push(out.prompt_tokens as f64 / out.prefill_secs);
        single.push(out.samples[0].tokens as f64 / out.decode_secs);
        let out = engine.generate(&prompt, &params(n))?;
        let total: usize = out.samples.iter().map(|s| s.tokens).sum();
        batched.push(total as f64 / out.decode_secs);
    }
    let (pf, single, batched) = (median(pf), median(single), median(batched));
    let rss = collabllm::cli::peak_rss_bytes().unwrap_or(0) as f64 / 1e6;
    println!(
        "model            {} ({})",
        engine.name(),
        files.path().display()
    );
    println!(
        "threads          {}",
        std::env::var("CANDLE_NUM_THREADS").unwrap_or_default()
    );
    println!("weights          {weights}");
    println!("load             {load_secs:.2} s");
    println!("prompt           {} tokens: {pf:.1} tokens/s", prompt.len());
    println!("generate n=1     {new_tokens} tokens: {single:.1} tokens/s");
    println!(
        "generate n={n}     {new_tokens} tokens each: {batched:.1} tokens/s aggregate ({:.2}x single)",
        batched / single
    );
    println!("peak RSS         {rss:.0} MB");
    println!(
        "{}",
        serde_json::json!({"bench": "decode", "prompt_tokens": prompt.len(), "prompt_tps": pf,
            "gen_tps_n1": single, "n": n, "gen_tps_batched": batched, "peak_rss_mb": rss,
            "load_s": load_secs})
    );
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    collabllm::cli::init_logging();
    let result = match args.command {
        Command::Decode {
            model,
            threads,
            prompt_tokens,
            new_tokens,
            n,
            repeats,
            weights,
        } => {
            collabllm::cli::set_compute_threads(Some(threads));
            decode(model, prompt_tokens, new_tokens, n, repeats, weights)
        }
        Command::TrainStep(p) => {
            collabllm::cli::set_compute_threads(Some(p.threads));
            collabllm::cli::keep_freed_memory();
            train_step::run(p)
        }
        Command::AdaptiveReplay(p) => adaptive_replay::run(p),
        Command::Kernels(p) => on_runtime(p.threads, kernels::run(p)),
        Command::PrefillStall(p) => on_runtime(p.local.threads, prefill_stall::run(p)),
        Command::ServeThroughput(p) => on_runtime(p.local.threads, serve_throughput::run(p)),
        Command::Orchestration {
            latency_ms,
            cap,
            tasks,
            turns,
            candidates,
            samples,
            window,
            concurrency,
            endpoints,
        } => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(anyhow::Error::from)
            .and_then(|rt| {
                rt.block_on(orchestration::run(orchestration::Params {
                    latency: std::time::Duration::from_millis(latency_ms),
                    cap,
                    tasks,
                    turns,
                    candidates,
                    samples,
                    window,
                    concurrency,
                    endpoints,
                }))
            }),
    };
    collabllm::cli::exit_on_error(result)
}
