//! The orchestration benchmark: a fake OpenAI-compatible endpoint with fixed latency and a
//! service cap, and a real generate_conv run against it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use collabllm::generate::{self, GenerateConfig};
use collabllm::llm::ModelSpec;
use collabllm::rollout::config::RolloutConfig;
use serde_json::{json, Value};

pub struct Params {
    pub latency: Duration,
    pub cap: usize,
    pub tasks: usize,
    pub turns: usize,
    pub candidates: usize,
    pub samples: usize,
    pub window: usize,
    pub concurrency: usize,
    /// Fake endpoints, each with its own service cap, used as one pool when more than one.
    pub endpoints: usize,
}

struct Server {
    latency: Duration,
    service: tokio::sync::Semaphore,
    requests: AtomicUsize,
}

/// Answers every role: the simulated user never ends the chat (so every conversation runs
/// exactly T turns), judges return scores that vary with the text.
fn content(body: &Value, i: usize) -> String {
    let prompt = body["messages"]
        .as_array()
        .and_then(|m| m.last())
        .and_then(|m| m["content"].as_str())
        .unwrap_or("");
    let h = prompt.len() + i + body["seed"].as_u64().unwrap_or(0) as usize;
    if prompt.contains("role-playing a USER") {
        json!({"current_answer": "", "thought": "", "response": format!("Tell me more about step {}.", h % 7)}).to_string()
    } else if prompt.contains("grading whether") {
        json!({"thought": "", "accuracy": h % 2}).to_string()
    } else if prompt.contains("rating how well") {
        json!({"thought": "", "interactivity": 1 + h % 5}).to_string()
    } else {
        format!("Here is a step ({h}). Do you want the final answer as a number?")
    }
}

async fn handle(State(s): State<Arc<Server>>, Json(body): Json<Value>) -> Json<Value> {
    s.requests.fetch_add(1, Ordering::Relaxed);
    let _permit = s.service.acquire().await;
    tokio::time::sleep(s.latency).await;
    let n = body["n"].as_u64().unwrap_or(1) as usize;
    let choices: Vec<Value> = (0..n)
        .map(|i| {
            json!({"index": i, "finish_reason": "stop",
            "message": {"role": "assistant", "content": content(&body, i)}})
        })
        .collect();
    Json(
        json!({"id": "bench", "object": "chat.completion", "created": 0, "model": "bench",
        "choices": choices, "usage": {"prompt_tokens": 100, "completion_tokens": 20 * n, "total_tokens": 100 + 20 * n}}),
    )
}

/// Starts one fake endpoint; returns its server state and base URL.
async fn start_endpoint(p: &Params) -> anyhow::Result<(Arc<Server>, String)> {
    let server = Arc::new(Server {
        latency: p.latency,
        service: tokio::sync::Semaphore::new(p.cap),
        requests: AtomicUsize::new(0),
    });
    let app = Router::new()
        .route("/v1/chat/completions", post(handle))
        .with_state(server.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok((server, format!("http://{addr}/v1")))
}

pub async fn run(p: Params) -> anyhow::Result<()> {
    let mut servers = Vec::new();
    let mut urls = Vec::new();
    for _ in 0..p.endpoints {
        let (s, u) = start_endpoint(&p).await?;
        servers.push(s);
        urls.push(u);
    }

    let tmp = std::env::temp_dir().join(format!("collabllm-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let spec: ModelSpec = format!("openai:bench@{}", urls.join(",")).parse()?;
    let mut cfg = GenerateConfig {
        tasks: concat!(env!("CARGO_MANIFEST_DIR"), "/data/math.jsonl").into(),
        output: tmp.join("run"),
        policy: spec.clone(),
        candidates: p.candidates,
        samples: p.samples,
        window: p.window,
        max_messages: 1 + 2 * p.turns,
        max_tasks: Some(p.tasks),
        rollout: RolloutConfig {
            user: spec.clone(),
            judge: spec,
            concurrency: p.concurrency,
            ..RolloutConfig::default()
        },
        ..GenerateConfig::default()
    };
    cfg.rollout.endpoint.max_concurrency = p.cap;
    cfg.rollout.endpoint.api_key_env = "COLLABLLM_BENCH_NO_KEY".into();
    let started = Instant::now();
    let summary = generate::generate(cfg.clone()).await?;
    let wall = started.elapsed().as_secs_f64();
    let per_endpoint: Vec<usize> = servers
        .iter()
        .map(|s| s.requests.load(Ordering::Relaxed))
        .collect();
    let calls: usize = per_endpoint.iter().sum();
    let ideal_rate = (p.endpoints * p.cap) as f64 / p.latency.as_secs_f64();
    let rate = calls as f64 / wall;
    let path = 1 + p.turns * (p.window + 2);
    let original_path = 1 + p.turns * (1 + p.candidates * (p.window + 1));
    let text = std::fs::read_to_string(cfg.output.join("conversations.jsonl"))?;
    let durations: Vec<f64> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .map(|r| r["finished_at"].as_f64().unwrap_or(0.0) - r["started_at"].as_f64().unwrap_or(0.0))
        .collect();
    let mean_conv = durations.iter().sum::<f64>() / durations.len().max(1) as f64;
    let ideal_conv = path as f64 * p.latency.as_secs_f64();
    let rss = collabllm::cli::peak_rss_bytes().unwrap_or(0) as f64 / 1e6;
    println!(
        "workload         {} tasks x {} turns, N={}, S={}, W={}, latency {} ms, cap {} x {} endpoint(s)",
        p.tasks,
        p.turns,
        p.candidates,
        p.samples,
        p.window,
        p.latency.as_millis(),
        p.cap,
        p.endpoints
    );
    println!("calls/endpoint   {per_endpoint:?}");
    println!(
        "wall             {wall:.2} s, {calls} calls, {} pairs",
        summary.stats.pairs_train + summary.stats.pairs_test
    );
    println!(
        "throughput       {rate:.1} calls/s = {:.2} of the ideal cap/latency {ideal_rate:.1}",
        rate / ideal_rate
    );
    println!(
        "conversation     {mean_conv:.2} s mean = {:.2} x critical path ({path} round trips = {ideal_conv:.2} s; \
         the original's sequential path is {original_path})",
        mean_conv / ideal_conv
    );
    println!("peak RSS         {rss:.0} MB");
    println!(
        "{}",
        json!({"bench": "orchestration", "calls": calls, "wall_s": wall, "calls_per_s": rate,
            "ideal_calls_per_s": ideal_rate, "endpoints": p.endpoints, "calls_per_endpoint": per_endpoint, "mean_conversation_s": mean_conv,
            "critical_path_s": ideal_conv, "peak_rss_mb": rss})
    );
    let _ = std::fs::remove_dir_all(&tmp);
    Ok(())
}
