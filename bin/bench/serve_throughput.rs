//! The continuous-batching benchmark: `c` clients each send `rounds` greedy chat requests,
//! one after another, for each concurrency `c`; reports aggregate generated tokens/s and
//! mean request latency. The clients talk to the local backend in this process (the
//! scheduler `serve` uses; peak RSS reported) or, with `--endpoint`, to any OpenAI-compatible
//! server (an older `serve` binary, llama.cpp's server) over HTTP.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use collabllm::engine::ChatCodec;
use collabllm::llm::local::{LoadOptions, LocalBackend};
use collabllm::llm::spec::resolve_local;
use collabllm::llm::{ChatBackend, ChatMessage, ChatRequest};

use crate::at_least_one;

#[derive(clap::Args, Debug)]
pub struct Params {
    #[command(flatten)]
    pub local: crate::LocalModelArgs,
    /// Send the requests to this OpenAI-compatible base URL (e.g. http://127.0.0.1:8000/v1,
    /// an older `serve` or llama.cpp's server) instead of a backend in this process;
    /// `--model` then only supplies the tokenizer that sizes the prompts.
    #[arg(long, value_name = "URL")]
    pub endpoint: Option<String>,
    /// Concurrent clients, one run each (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,4,8,16", value_parser = at_least_one)]
    pub concurrency: Vec<usize>,
    /// Rows of the decode batch (1: one request at a time).
    #[arg(long, default_value_t = collabllm::llm::local::DEFAULT_MAX_BATCH, value_parser = at_least_one)]
    pub max_batch: usize,
    /// Prompt positions prefilled per round while others decode (0: each prompt whole).
    #[arg(long, default_value_t = collabllm::llm::local::PREFILL_CHUNK)]
    pub prefill_chunk: usize,
    /// Approximate prompt length in tokens.
    #[arg(long, default_value_t = 200, value_parser = at_least_one)]
    pub prompt_tokens: usize,
    /// `max_tokens` of every request.
    #[arg(long, default_value_t = 128, value_parser = at_least_one)]
    pub new_tokens: usize,
    /// Requests each client sends, one after another (later rounds repeat the client's
    /// prompt: exact prefix-cache hits unless `--prefix-cache-mb 0`).
    #[arg(long, default_value_t = 2, value_parser = at_least_one)]
    pub rounds: usize,
    /// How the clients' prompts relate: `distinct` (each opens with its own line, so
    /// only the chat template's start is shared) or `shared` (a common text first and
    /// each client's own line last, as a turn's candidates, futures and judges share the
    /// conversation so far).
    #[arg(long = "prompts", value_name = "PROMPTS", value_enum, default_value_t = Layout::Distinct)]
    pub layout: Layout,
    /// Times the concurrency list is run, one pass after another (1,16,1,16,… with
    /// `--concurrency 1,16 --cycles 2`); with more than one, a summary gives each
    /// concurrency's median tokens/s and its median ratio to the first concurrency of the
    /// same pass, which machine speed drifting between passes moves far less than single
    /// runs.
    #[arg(long, default_value_t = 1, value_parser = at_least_one)]
    pub cycles: usize,
    /// The local backend's prompt-cache memory (MiB; 0 turns prefix reuse off).
    #[arg(long, value_name = "MIB", default_value_t = 256)]
    pub prefix_cache_mb: usize,
    /// The local backend's key/value budget for requests in flight (MiB; default: the
    /// backend's, 16 rows at the model's full context within half the available memory).
    #[arg(long, value_name = "MIB", value_parser = at_least_one)]
    pub kv_cache_mb: Option<usize>,
}

/// How the clients' prompts relate (see `bench serve-throughput --help`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Layout {
    Distinct,
    Shared,
}

/// Where the requests go.
#[derive(Clone)]
enum Target {
    Local(Arc<LocalBackend>),
    /// `POST {base}/chat/completions`.
    Http(reqwest::Client, String),
}

impl Target {
    /// Completion tokens of one greedy request.
    async fn ask(&self, message: &str, max_tokens: usize) -> anyhow::Result<u64> {
        match self {
            Target::Local(b) => {
                let req = ChatRequest::new(vec![ChatMessage::user(message)])
                    .temperature(0.0)
                    .max_tokens(max_tokens);
                Ok(b.chat(&req).await?.usage.completion_tokens)
            }
            Target::Http(client, base) => {
                let body = serde_json::json!({"messages": [{"role": "user", "content": message}],
                                              "temperature": 0, "max_tokens": max_tokens});
                let url = format!("{base}/chat/completions");
                let resp: serde_json::Value = client
                    .post(&url)
                    .json(&body)
                    .send()
                    .await
                    .with_context(|| format!("POST {url}"))?
                    .error_for_status()
                    .with_context(|| format!("POST {url}"))?
                    .json()
                    .await
                    .with_context(|| format!("reading the answer of {url}"))?;
                resp["usage"]["completion_tokens"]
                    .as_u64()
                    .with_context(|| format!("{url}: no usage.completion_tokens in {resp}"))
            }
        }
    }
}

/// The user message of client `i`: filler up to about `target` prompt tokens with the
/// client's own line first (`Distinct`) or last (`Shared`), then a request for a long answer
/// (so replies rarely end before `max_tokens`).
pub fn message(
    codec: &ChatCodec,
    i: usize,
    target: usize,
    layout: Layout,
) -> anyhow::Result<String> {
    let sentence = "The committee reviewed the quarterly report on river water quality, \
                    noting that nitrate levels fell while turbidity rose after the spring floods. ";
    let ask = "Write a long, detailed essay about what the report means for the town.";
    let own = format!("Report number {i}. ");
    let mut text = String::new();
    loop {
        let full = match layout {
            Layout::Distinct => format!("{own}{text}{ask}"),
            Layout::Shared => format!("{text}{own}{ask}"),
        };
        let ids = codec
            .encode(&codec.render(&[ChatMessage::user(full.clone())], true)?)
            .map_err(anyhow::Error::msg)?;
        if ids.len() >= target {
            return Ok(full);
        }
        text.push_str(sentence);
    }
}

pub async fn run(p: Params) -> anyhow::Result<()> {
    let codec = ChatCodec::load(&resolve_local(&p.local.model).await?)?;
    let mut kv_budget_mb = None;
    let (target, name) = match &p.endpoint {
        None => {
            let opts = LoadOptions {
                prefix_cache_mb: Some(p.prefix_cache_mb),
                ..LoadOptions::default()
            };
            let backend = LocalBackend::load(&p.local.model, &opts).await?;
            backend.set_max_batch(p.max_batch);
            backend.set_prefill_chunk(p.prefill_chunk);
            if let Some(mib) = p.kv_cache_mb {
                backend.set_kv_budget_bytes(mib << 20);
            }
            kv_budget_mb = Some(backend.kv_budget_bytes() >> 20);
            let name = backend.model_name();
            (Target::Local(backend), name)
        }
        Some(url) => {
            let base = url.trim_end_matches('/').to_string();
            (Target::Http(reqwest::Client::new(), base), url.clone())
        }
    };
    // Every client of every run has its own prompt (index 0 is the warm-up's): no run starts
    // from the prompts the one before it left in the prefix cache.
    let total: usize = p.concurrency.iter().sum::<usize>() * p.cycles;
    let messages = (0..=total)
        .map(|i| message(&codec, i, p.prompt_tokens, p.layout))
        .collect::<anyhow::Result<Vec<_>>>()?;
    target.ask(&messages[0], p.new_tokens).await?; // warm-up
    println!(
        "{name} · threads {} · max batch {} · prefill chunk {} · ~{} prompt tokens ({:?}) · \
         prefix cache {} MiB · key/value budget {} · max_tokens {} · {} rounds",
        std::env::var("CANDLE_NUM_THREADS").unwrap_or_default(),
        if p.endpoint.is_some() {
            "(server's)".to_string()
        } else {
            p.max_batch.to_string()
        },
        if p.endpoint.is_some() {
            "(server's)".to_string()
        } else {
            p.prefill_chunk.to_string()
        },
        p.prompt_tokens,
        p.layout,
        p.prefix_cache_mb,
        kv_budget_mb.map_or("(server's)".to_string(), |mb| format!("{mb} MiB")),
        p.new_tokens,
        p.rounds
    );
    let mut first = 1;
    // Per concurrency (in list order): each pass's tokens/s and its ratio to the pass's first.
    let mut passes: Vec<Vec<(f64, f64)>> = vec![Vec::new(); p.concurrency.len()];
    for _ in 0..p.cycles {
        let mut base = None;
        for (at, &c) in p.concurrency.iter().enumerate() {
            let (tokens, wall, latency) =
                clients(&target, &messages[first..first + c], p.rounds, p.new_tokens).await?;
            first += c;
            let tps = tokens as f64 / wall;
            let speedup = tps / *base.get_or_insert(tps);
            println!(
                "concurrency {c:>3}: {tokens:>6} tokens in {wall:>6.1} s = {tps:>7.1} tokens/s \
             ({speedup:.2}x the first), mean latency {latency:.2} s"
            );
            println!(
                "{}",
                serde_json::json!({"bench": "serve-throughput", "concurrency": c,
                "max_batch": p.max_batch, "prefill_chunk": p.prefill_chunk, "endpoint": p.endpoint, "tokens": tokens,
                "prompts": format!("{:?}", p.layout), "prefix_cache_mb": p.prefix_cache_mb,
                "kv_cache_mb": kv_budget_mb,
                "wall_s": wall, "tps": tps, "speedup": speedup, "mean_latency_s": latency})
            );
            passes[at].push((tps, speedup));
        }
    }
    if p.cycles > 1 {
        summarize(&p.concurrency, &passes);
    }
    if p.endpoint.is_none() {
        let rss = collabllm::cli::peak_rss_bytes().unwrap_or(0) as f64 / 1e6;
        println!("peak RSS {rss:.0} MB");
    }
    Ok(())
}

/// One client per message, each sending `rounds` requests one after another, all at once:
/// (completion tokens, wall seconds, mean request latency in seconds).
async fn clients(
    target: &Target,
    messages: &[String],
    rounds: usize,
    new_tokens: usize,
) -> anyhow::Result<(u64, f64, f64)> {
    let started = Instant::now();
    let runs = messages.iter().map(|m| async move {
        let (mut tokens, mut latency) = (0u64, 0.0);
        for _ in 0..rounds {
            let t = Instant::now();
            tokens += target.ask(m, new_tokens).await?;
            latency += t.elapsed().as_secs_f64();
        }
        anyhow::Ok((tokens, latency))
    });
    let done = futures::future::try_join_all(runs).await?;
    let wall = started.elapsed().as_secs_f64();
    let tokens = done.iter().map(|d| d.0).sum();
    let latency = done.iter().map(|d| d.1).sum::<f64>() / (messages.len() * rounds) as f64;
    Ok((tokens, wall, latency))
}

/// Each concurrency's median tokens/s and median ratio over the passes (a concurrency listed
/// twice is summarized once per listing).
fn summarize(concurrency: &[usize], passes: &[Vec<(f64, f64)>]) {
    println!(
        "medians over {} passes:",
        passes.first().map_or(0, Vec::len)
    );
    for (&c, runs) in concurrency.iter().zip(passes) {
        let tps = crate::median(runs.iter().map(|r| r.0).collect());
        let ratio = crate::median(runs.iter().map(|r| r.1).collect());
        let ratios: Vec<String> = runs.iter().map(|r| format!("{:.2}", r.1)).collect();
        println!(
            "concurrency {c:>3}: median {tps:>7.1} tokens/s, median {ratio:.2}x the pass's first ({})",
            ratios.join(", ")
        );
        println!(
            "{}",
            serde_json::json!({"bench": "serve-throughput-summary", "concurrency": c,
                "passes": runs.len(), "median_tps": tps, "median_speedup": ratio,
                "speedups": runs.iter().map(|r| r.1).collect::<Vec<_>>()})
        );
    }
}
