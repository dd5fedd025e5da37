//! The decode stall a long prompt causes: one client streams a long greedy reply; once it is
//! decoding, `arrivals` requests with long prompts arrive at once. Reports the gaps between
//! the streamed pieces (median, 95th percentile, largest) — what `--prefill-chunk` bounds.

use std::time::{Duration, Instant};

use collabllm::engine::ChatCodec;
use collabllm::llm::local::{LoadOptions, LocalBackend};
use collabllm::llm::spec::resolve_local;
use collabllm::llm::{ChatBackend, ChatMessage, ChatRequest, DeltaSink};

use crate::at_least_one;
use crate::serve_throughput::{message, Layout};

#[derive(clap::Args, Debug)]
pub struct Params {
    #[command(flatten)]
    pub local: crate::LocalModelArgs,
    /// Prompt positions prefilled per round while others decode (0: each prompt whole).
    #[arg(long, default_value_t = collabllm::llm::local::PREFILL_CHUNK)]
    pub prefill_chunk: usize,
    /// Requests with long prompts that arrive while the stream decodes.
    #[arg(long, default_value_t = 2, value_parser = at_least_one)]
    pub arrivals: usize,
    /// Approximate prompt length of each arriving request, in tokens.
    #[arg(long, default_value_t = 1500, value_parser = at_least_one)]
    pub prompt_tokens: usize,
    /// Tokens the streamed reply generates.
    #[arg(long, default_value_t = 160, value_parser = at_least_one)]
    pub new_tokens: usize,
}

pub async fn run(p: Params) -> anyhow::Result<()> {
    let codec = ChatCodec::load(&resolve_local(&p.local.model).await?)?;
    // No prompt reuse: every long prompt is prefilled in full.
    let opts = LoadOptions {
        prefix_cache_mb: Some(0),
        ..LoadOptions::default()
    };
    let backend = LocalBackend::load(&p.local.model, &opts).await?;
    backend.set_prefill_chunk(p.prefill_chunk);
    let streamed = ChatRequest::new(vec![ChatMessage::user(
        "Write a long, detailed essay about rivers.",
    )])
    .temperature(0.0)
    .max_tokens(p.new_tokens);
    backend.chat(&streamed.clone().max_tokens(4)).await?; // warm-up
    let long: Vec<ChatRequest> = (0..p.arrivals)
        .map(|i| {
            Ok(ChatRequest::new(vec![ChatMessage::user(message(
                &codec,
                i + 1,
                p.prompt_tokens,
                Layout::Distinct,
            )?)])
            .temperature(0.0)
            .max_tokens(1))
        })
        .collect::<anyhow::Result<_>>()?;

    let (sink, mut rx) = DeltaSink::channel();
    let times = tokio::spawn(async move {
        let mut t = Vec::new();
        while rx.recv().await.is_some() {
            t.push(Instant::now());
        }
        t
    });
    let stream = {
        let backend = backend.clone();
        tokio::spawn(async move { backend.chat_stream(&streamed, &sink).await })
    };
    // Let the stream get going, then the long prompts arrive together.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let arrived = Instant::now();
    let answers = futures::future::join_all(long.iter().map(|r| backend.chat(r))).await;
    for a in answers {
        a?;
    }
    let prefills = arrived.elapsed().as_secs_f64();
    stream.await??;
    let t = times.await?;
    let mut gaps: Vec<f64> = t
        .windows(2)
        .map(|w| (w[1] - w[0]).as_secs_f64() * 1e3)
        .collect();
    anyhow::ensure!(gaps.len() >= 2, "the stream sent {} pieces", t.len());
    gaps.sort_by(f64::total_cmp);
    let pick = |q: f64| gaps[((gaps.len() - 1) as f64 * q).round() as usize];
    println!(
        "prefill chunk {} · {} arrivals of ~{} prompt tokens (all answered {prefills:.2} s after \
         arriving) · streamed {} pieces: gap median {:.0} ms, p95 {:.0} ms, max {:.0} ms",
        p.prefill_chunk,
        p.arrivals,
        p.prompt_tokens,
        t.len(),
        pick(0.5),
        pick(0.95),
        pick(1.0),
    );
    println!(
        "{}",
        serde_json::json!({"bench": "prefill-stall", "prefill_chunk": p.prefill_chunk,
            "arrivals": p.arrivals, "prompt_tokens": p.prompt_tokens, "pieces": t.len(),
            "gap_median_ms": pick(0.5), "gap_p95_ms": pick(0.95), "gap_max_ms": pick(1.0),
            "arrivals_answered_s": prefills})
    );
    Ok(())
}
