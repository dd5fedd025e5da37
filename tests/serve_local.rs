//! `serve` over the real local engine (the tiny random llama), driven by the real
//! `async-openai` client and raw connections on 127.0.0.1: answers, cancellation when a
//! client leaves, and the context limits.

mod common;
use common::model_util;
use common::serve_util;

use async_openai::types::chat::{
    ChatCompletionRequestUserMessage, CreateChatCompletionRequestArgs, StopConfiguration,
};
use std::time::{Duration, Instant};

use collabllm::engine::tiny::TinySpec;
use serde_json::json;
use serve_util::{api_error, openai_client, post_raw, spawn_server};

#[tokio::test]
async fn openai_client_against_the_tiny_model() {
    let (_g, backend) = model_util::load_tiny(&TinySpec::default()).await;
    let addr = spawn_server(backend, "tiny").await;
    let client = openai_client(addr);
    let user = || vec![ChatCompletionRequestUserMessage::from("Tell me about the sea.").into()];

    // n = 3 samples, usage counted.
    let req = CreateChatCompletionRequestArgs::default()
        .model("tiny")
        .messages(user())
        .n(3u8)
        .max_tokens(12u32)
        .seed(5i64)
        .temperature(1.0)
        .build()
        .unwrap();
    let resp = client.chat().create(req).await.unwrap();
    assert_eq!(resp.model, "tiny");
    assert_eq!(resp.choices.len(), 3);
    let idx: Vec<u32> = resp.choices.iter().map(|c| c.index).collect();
    assert_eq!(idx, vec![0, 1, 2]);
    let usage = resp.usage.expect("usage");
    assert!(usage.prompt_tokens > 20);
    assert!(usage.completion_tokens >= 3 && usage.completion_tokens <= 36);
    assert_eq!(
        usage.total_tokens,
        usage.prompt_tokens + usage.completion_tokens
    );
    // The same prompt again: its keys and values come from the prompt cache, and the
    // usage says so in OpenAI's field.
    let again = CreateChatCompletionRequestArgs::default()
        .model("tiny")
        .messages(user())
        .max_tokens(4u32)
        .build()
        .unwrap();
    let repeat = client.chat().create(again).await.unwrap().usage.unwrap();
    assert_eq!(repeat.prompt_tokens, usage.prompt_tokens);
    assert_eq!(
        repeat.prompt_tokens_details.and_then(|d| d.cached_tokens),
        Some(usage.prompt_tokens)
    );
    for c in &resp.choices {
        assert!(!c.message.content.as_deref().unwrap_or("").trim().is_empty());
    }

    // A stop string taken from the seeded reply cuts it there.
    let seeded = |stop: Option<String>| {
        let mut b = CreateChatCompletionRequestArgs::default();
        b.model("tiny")
            .messages(user())
            .max_tokens(32u32)
            .temperature(1.0);
        if let Some(s) = stop {
            b.stop(StopConfiguration::String(s));
        }
        b
    };
    let mut chosen = None;
    for seed in 0..50i64 {
        let r = client
            .chat()
            .create(seeded(None).seed(seed).build().unwrap())
            .await
            .unwrap();
        let text = r.choices[0].message.content.clone().unwrap_or_default();
        let chars: Vec<char> = text.chars().collect();
        if chars.len() >= 8
            && !chars[..6].contains(&char::REPLACEMENT_CHARACTER)
            && !chars[..4].iter().collect::<String>().trim().is_empty()
        {
            chosen = Some((seed, text));
            break;
        }
    }
    let (seed, full) = chosen.expect("a seed with a long enough reply");
    let stop: String = full.chars().skip(4).take(2).collect();
    let cut = client
        .chat()
        .create(seeded(Some(stop.clone())).seed(seed).build().unwrap())
        .await
        .unwrap();
    let expected = &full[..full.find(&stop).unwrap()];
    assert_eq!(cut.choices[0].message.content.as_deref(), Some(expected));

    // A malformed request is a 400 with an OpenAI-shaped JSON error.
    let (status, body) = post_raw(addr, "{\"messages\": [").await;
    assert_eq!(status, 400);
    assert_eq!(api_error(&body)["type"], "invalid_request_error");
}

/// A request over a raw TCP connection that the test can abandon by dropping the stream: the
/// server sees the client leave exactly as when a real client process dies.
async fn open_request(
    addr: std::net::SocketAddr,
    body: &serde_json::Value,
) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let body = body.to_string();
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.expect("write head");
    stream.write_all(body.as_bytes()).await.expect("write body");
    stream
}

/// The tests that time long generations run one at a time: they share the process's model
/// thread, and each measures what a token costs.
static TIMED: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn greedy(content: &str, max_tokens: usize, stream: bool) -> serde_json::Value {
    json!({"messages": [{"role": "user", "content": content}], "temperature": 0,
           "max_tokens": max_tokens, "stream": stream})
}

/// The tiny model with the embedding rows of its end-of-turn tokens zeroed: with a tied
/// output head their logit is 0, below the best of the other random logits, so a greedy reply
/// runs to `max_tokens` and a long request really is long.
async fn never_ending_tiny(
    spec: &TinySpec,
) -> (
    tempfile::TempDir,
    std::sync::Arc<collabllm::llm::local::LocalBackend>,
) {
    use collabllm::engine::tiny::TINY_SPECIAL_TOKENS;
    model_util::one_thread();
    assert!(spec.tie_word_embeddings);
    let (guard, dir) = model_util::tiny_model_dir(spec);
    let file = dir.join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&file, &candle_core::Device::Cpu).unwrap();
    let embed = tensors["model.embed_tokens.weight"].clone();
    let mut rows: Vec<Vec<f32>> = embed.to_vec2().unwrap();
    for t in ["<|endoftext|>", "<|im_end|>"] {
        let id = 256 + TINY_SPECIAL_TOKENS.iter().position(|s| *s == t).unwrap();
        rows[id].iter_mut().for_each(|x| *x = 0.0);
    }
    let flat: Vec<f32> = rows.concat();
    tensors.insert(
        "model.embed_tokens.weight".into(),
        candle_core::Tensor::from_vec(flat, embed.dims(), &candle_core::Device::Cpu).unwrap(),
    );
    collabllm::engine::weights::save_safetensors(&tensors, &file).unwrap();
    let backend = collabllm::llm::local::LocalBackend::load(
        &collabllm::llm::ModelSpec::HfDir(dir),
        &collabllm::llm::local::LoadOptions::default(),
    )
    .await
    .unwrap();
    (guard, backend)
}

/// The tiny model made big enough that a token takes a few milliseconds (a long request takes
/// seconds), with a context of `positions`.
fn slow_tiny(positions: usize) -> TinySpec {
    TinySpec {
        hidden_size: 512,
        intermediate_size: 2048,
        num_hidden_layers: 6,
        num_attention_heads: 8,
        num_key_value_heads: 4,
        max_position_embeddings: positions,
        ..TinySpec::default()
    }
}

/// Abandoned requests stop: the running one at its next token, the queued ones before they
/// start, so the next client does not wait for work nobody will read.
#[tokio::test]
async fn a_client_that_leaves_cancels_its_generation() {
    let spec = slow_tiny(4096);
    let _timed = TIMED.lock().await;
    let (_g, backend) = never_ending_tiny(&spec).await;
    // One request at a time, so that two requests queue behind the long one.
    backend.set_max_batch(1);
    let addr = spawn_server(backend.clone(), "tiny").await;

    // What a token costs here, from a finished request of 200 tokens.
    let started = Instant::now();
    let (status, body) = post_raw(
        addr,
        greedy("Tell me about the sea.", 200, false).to_string(),
    )
    .await;
    let per_200 = started.elapsed();
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v["usage"]["completion_tokens"], 200,
        "the greedy reply must not end early for this test to mean anything: {body}"
    );
    let long_tokens = 3500;
    let full_long = per_200.mul_f64(long_tokens as f64 / 200.0);

    // A long request starts; two more (one streaming) queue behind it.
    let before = backend.stats();
    let running = open_request(addr, &greedy("Tell me about the sea.", long_tokens, false)).await;
    wait_for("the long request to start", || {
        backend.stats().started > before.started
    })
    .await;
    let queued_a = open_request(addr, &greedy("And the sky?", long_tokens, true)).await;
    let queued_b = open_request(addr, &greedy("And the hills?", long_tokens, false)).await;
    wait_for("both requests to queue", || {
        backend.stats().queued == before.queued + 3
    })
    .await;
    // Let the long one decode for a while, so it is stopped mid-way, not before its first token.
    tokio::time::sleep(per_200.max(Duration::from_millis(500))).await;

    // Every client leaves; the next short request is served at once.
    drop(queued_a);
    drop(queued_b);
    drop(running);
    let left = Instant::now();
    let (status, body) = post_raw(addr, greedy("Hi!", 4, false).to_string()).await;
    let waited = left.elapsed();
    assert_eq!(status, 200, "{body}");
    let after = backend.stats();
    assert_eq!(after.cancelled - before.cancelled, 1, "{after:?}");
    assert_eq!(after.skipped - before.skipped, 2, "{after:?}");
    assert_eq!(
        after.started - before.started,
        2,
        "only the long request and the short one ran: {after:?}"
    );
    let stopped_at = after.cancelled_tokens - before.cancelled_tokens;
    assert!(
        stopped_at > 0 && stopped_at < long_tokens as u64 / 2,
        "the abandoned generation ran on to {stopped_at} of {long_tokens} tokens"
    );
    assert!(
        waited < full_long / 4,
        "the short request waited {waited:?}; the abandoned long one alone would take {full_long:?}"
    );
    eprintln!(
        "abandoned after {stopped_at} tokens; next request served in {waited:?} \
         (a full long request takes ~{full_long:?})"
    );
}

/// A prompt that cannot fit is refused without tokenizing it (bytes alone prove it), one
/// that might fit is counted exactly, and an explicit `max_tokens` must fit beside it.
#[tokio::test]
async fn oversized_requests_are_refused_before_any_work() {
    let (_g, backend) = model_util::load_tiny(&TinySpec::default()).await;
    let limits = collabllm::llm::ChatBackend::context_limits(&*backend).expect("local limits");
    assert_eq!(limits.context_tokens, 1024);
    let addr = spawn_server(backend.clone(), "tiny").await;
    let user = |content: String, extra: serde_json::Value| {
        let mut body = json!({"messages": [{"role": "user", "content": content}]});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body.to_string()
    };

    // 15 MB, under the body limit: refused at once, nothing queued.
    let huge = "lorem ipsum ".repeat(15 * 1024 * 1024 / 12);
    let started = Instant::now();
    let (status, body) = post_raw(addr, user(huge, json!({}))).await;
    let took = started.elapsed();
    assert_eq!(status, 400, "{body}");
    let err = api_error(&body);
    assert_eq!(err["code"], "context_length_exceeded");
    assert_eq!(err["param"], "messages");
    assert_eq!(
        backend.stats().queued,
        0,
        "nothing reached the model worker"
    );
    assert!(took < Duration::from_secs(5), "refusing took {took:?}");

    // Under the byte bound but over the context in tokens: the exact count refuses it.
    let long = "a b ".repeat(600);
    assert!(long.len() < limits.max_prompt_bytes());
    let (status, body) = post_raw(addr, user(long, json!({}))).await;
    assert_eq!(status, 400, "{body}");
    let err = api_error(&body);
    assert_eq!(err["code"], "context_length_exceeded");
    assert_eq!(err["param"], "messages");
    assert!(
        err["message"].as_str().unwrap().contains("tokens"),
        "{body}"
    );

    // An explicit max_tokens beyond the context, alone or with the prompt.
    for max_tokens in [1024, 5000, 1000] {
        let (status, body) = post_raw(
            addr,
            user("hello".into(), json!({"max_tokens": max_tokens})),
        )
        .await;
        assert_eq!(status, 400, "{max_tokens}: {body}");
        let err = api_error(&body);
        assert_eq!(err["code"], "context_length_exceeded", "{body}");
        assert_eq!(err["param"], "max_tokens", "{body}");
    }
    // Without max_tokens, a long prompt gets the room that is left (the default is a cap).
    let (status, body) = post_raw(addr, user("a b ".repeat(240), json!({"temperature": 0}))).await;
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let used = v["usage"]["prompt_tokens"].as_u64().unwrap()
        + v["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(used <= 1024, "{body}");
}

/// Continuous batching: two long requests decode together, a third waits for a row; when a
/// client leaves, its row is free at the next token and the waiting request starts while the
/// other long one goes on.
#[tokio::test]
async fn a_client_that_leaves_frees_its_batch_row() {
    let spec = slow_tiny(4096);
    let _timed = TIMED.lock().await;
    let (_g, backend) = never_ending_tiny(&spec).await;
    backend.set_max_batch(2);
    let addr = spawn_server(backend.clone(), "tiny").await;
    let long_tokens = 3500;
    let before = backend.stats();
    let a = open_request(addr, &greedy("Tell me about the sea.", long_tokens, true)).await;
    let b = open_request(addr, &greedy("And the sky?", long_tokens, false)).await;
    wait_for("both long requests to start", || {
        backend.stats().started == before.started + 2
    })
    .await;
    let c = open_request(addr, &greedy("And the hills?", long_tokens, true)).await;
    wait_for("the third request to queue", || {
        backend.stats().queued == before.queued + 3
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        backend.stats().started,
        before.started + 2,
        "the batch holds two rows"
    );

    drop(a);
    wait_for("the waiting request to take the free row", || {
        backend.stats().started == before.started + 3
    })
    .await;
    let mid = backend.stats();
    assert_eq!(mid.cancelled - before.cancelled, 1, "{mid:?}");
    assert!(
        mid.cancelled_tokens - before.cancelled_tokens < long_tokens as u64 / 2,
        "{mid:?}"
    );

    drop(b);
    drop(c);
    wait_for("both remaining requests to stop", || {
        backend.stats().cancelled == before.cancelled + 3
    })
    .await;
    let after = backend.stats();
    assert_eq!(after.skipped, before.skipped, "{after:?}");
}

/// `stream: true` sends the reply token by token in OpenAI's chunk format: the role first,
/// many content pieces that add up to the non-streamed reply, the finish reason, the usage
/// chunk when asked, then `[DONE]`. Concurrent streams are decoded in one batch and each
/// still equals its own non-streamed reply.
#[tokio::test]
async fn streaming_sends_tokens_as_they_are_generated() {
    let (_g, backend) = never_ending_tiny(&TinySpec::default()).await;
    let addr = spawn_server(backend.clone(), "tiny").await;
    let prompts = ["Tell me about the sea.", "Hi", "And the hills?", "Why?"];
    let mut expected = Vec::new();
    for p in prompts {
        let (status, body) = post_raw(addr, greedy(p, 40, false).to_string()).await;
        assert_eq!(status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        expected.push((
            v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string(),
            v["usage"].clone(),
        ));
    }
    let stream_one = |p: &'static str| async move {
        let mut body = greedy(p, 40, true);
        body["stream_options"] = json!({"include_usage": true});
        let resp = reqwest::Client::new()
            .post(format!("http://{addr}/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 200);
        serve_util::sse_data(&resp.text().await.unwrap())
    };
    let streams = futures::future::join_all(prompts.iter().map(|p| stream_one(p))).await;
    for (data, (text, usage)) in streams.into_iter().zip(expected) {
        assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
        let chunks: Vec<serde_json::Value> = data[..data.len() - 1]
            .iter()
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        let ids: std::collections::HashSet<_> =
            chunks.iter().map(|c| c["id"].to_string()).collect();
        assert_eq!(ids.len(), 1, "one id for every chunk");
        assert!(chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk"));
        let (last, pieces) = chunks.split_last().unwrap();
        assert_eq!(last["choices"], json!([]));
        // The stream repeats a prompt already answered: it comes whole from the prompt
        // cache; every other count equals the non-streamed reply's.
        let mut streamed_usage = last["usage"].clone();
        let mut usage = usage;
        assert_eq!(
            streamed_usage["prompt_tokens_details"]["cached_tokens"],
            usage["prompt_tokens"]
        );
        streamed_usage["prompt_tokens_details"] = json!(null);
        usage["prompt_tokens_details"] = json!(null);
        assert_eq!(streamed_usage, usage);
        let (finish, pieces) = pieces.split_last().unwrap();
        assert_eq!(finish["choices"][0]["finish_reason"], "length");
        assert_eq!(pieces[0]["choices"][0]["delta"]["role"], "assistant");
        let streamed: String = pieces
            .iter()
            .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap())
            .collect();
        assert_eq!(streamed, text);
        assert!(
            pieces.len() >= 10,
            "{} pieces: the reply was not streamed token by token",
            pieces.len()
        );
    }
}

/// `--kv-cache-mb` through the HTTP API: a request whose key/value reservation (its prompt
/// and max_tokens positions) cannot fit the budget even alone is a 400
/// `context_length_exceeded` on `max_tokens` that names the budget; one that fits is
/// answered, and the one refused never reached a decode step.
#[tokio::test]
async fn requests_over_the_kv_budget_are_refused() {
    let (_g, backend) = model_util::load_tiny(&TinySpec::default()).await;
    let per_position = backend.engine().kv_bytes_per_position();
    // Room for ~300 positions: a short prompt with 64 new tokens fits, 900 do not.
    backend.set_kv_budget_bytes(300 * per_position);
    let addr = spawn_server(backend.clone(), "tiny").await;
    let body = |max_tokens: u32| {
        json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens,
               "temperature": 0})
        .to_string()
    };
    let steps = backend.stats().decode_steps;
    let (status, reply) = post_raw(addr, body(900)).await;
    assert_eq!(status, 400, "{reply}");
    let err = api_error(&reply);
    assert_eq!(err["code"], "context_length_exceeded", "{reply}");
    assert_eq!(err["param"], "max_tokens", "{reply}");
    assert!(
        err["message"].as_str().unwrap().contains("key/value"),
        "{reply}"
    );
    assert_eq!(backend.stats().decode_steps, steps);
    let (status, reply) = post_raw(addr, body(64)).await;
    assert_eq!(status, 200, "{reply}");
}

/// `logprobs` / `top_logprobs`: each sampled token's log-probability is the model's own
/// log-softmax (the trainer's, on the same token ids), the alternatives are the most likely
/// tokens best first, and a streamed reply carries the same numbers.
#[tokio::test]
async fn logprobs_are_the_models_log_softmax_streamed_too() {
    use candle_core::{DType, Device};
    use collabllm::llm::{ChatBackend, ChatMessage, ChatRequest};

    let (_g, dir, backend) = model_util::load_tiny_f32(&TinySpec::default()).await;
    let messages = vec![ChatMessage::user("Tell me about the sea.".to_string())];
    let req = ChatRequest::new(messages.clone())
        .temperature(1.0)
        .seed(11)
        .max_tokens(8)
        .logprobs(3);
    let resp = backend.chat(&req).await.unwrap();
    let choice = &resp.choices[0];
    let ids = choice.token_ids.clone().unwrap();
    let lps = choice.logprobs.clone().unwrap();
    assert_eq!(lps.len(), 8.min(ids.len()), "one per content token");

    // The trainer's log-softmax over prompt + sampled ids.
    let codec = collabllm::engine::ChatCodec::load(&collabllm::llm::spec::LocalModelFiles::HfDir(
        dir.clone(),
    ))
    .unwrap();
    let prompt = codec
        .encode(&codec.render(&messages, true).unwrap())
        .unwrap();
    let seq: Vec<u32> = prompt.iter().chain(&ids).copied().collect();
    let model =
        collabllm::train::model::TrainLlama::from_hf_dir(&dir, DType::F32, &Device::Cpu).unwrap();
    let logp = model_util::trainer_log_probs(&model, &seq);
    for (k, t) in lps.iter().enumerate() {
        let row = &logp[prompt.len() + k - 1];
        assert_eq!(t.id, ids[k]);
        let want = row[t.id as usize];
        assert!(
            (f64::from(t.logprob) - want).abs() < 1e-4,
            "token {k}: {} vs {want}",
            t.logprob
        );
        assert_eq!(t.top.len(), 3);
        let best = row
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap();
        assert_eq!(
            t.top[0].id as usize, best.0,
            "token {k}: the most likely first"
        );
        assert!(t.top.windows(2).all(|w| w[0].logprob >= w[1].logprob));
        for a in &t.top {
            assert!((f64::from(a.logprob) - row[a.id as usize]).abs() < 1e-4);
        }
    }

    // Over HTTP, plain and streamed: the same values.
    let addr = spawn_server(backend, "tiny").await;
    let body = |stream: bool| {
        json!({"messages": [{"role": "user", "content": "Tell me about the sea."}],
            "temperature": 1.0, "seed": 11, "max_tokens": 8, "logprobs": true,
            "top_logprobs": 3, "stream": stream})
        .to_string()
    };
    let (status, text) = post_raw(addr, body(false)).await;
    assert_eq!(status, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let content = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(content.len(), lps.len());
    // `bytes` joined rebuild the content (a token holding part of a character has its part,
    // not U+FFFD's bytes).
    let joined: Vec<u8> = content
        .iter()
        .flat_map(|c| c["bytes"].as_array().unwrap().clone())
        .map(|b| b.as_u64().unwrap() as u8)
        .collect();
    assert_eq!(
        String::from_utf8_lossy(&joined),
        v["choices"][0]["message"]["content"].as_str().unwrap()
    );
    for (c, t) in content.iter().zip(&lps) {
        assert_eq!(c["bytes"], json!(t.bytes));
        assert_eq!(c["logprob"].as_f64().unwrap() as f32, t.logprob);
        assert_eq!(c["token"], t.token.as_str());
        assert_eq!(c["top_logprobs"].as_array().unwrap().len(), 3);
        assert_eq!(c["top_logprobs"][0]["token"], t.top[0].token.as_str());
    }
    let (status, text) = post_raw(addr, body(true)).await;
    assert_eq!(status, 200, "{text}");
    let streamed: Vec<serde_json::Value> = serve_util::sse_data(&text)
        .iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    // Each chunk carries the log-probs of the tokens its text completes; together, all of
    // them, in order.
    let mut joined = Vec::new();
    let mut text = String::new();
    for c in &streamed {
        let choice = &c["choices"][0];
        if let Some(list) = choice["logprobs"]["content"].as_array() {
            joined.extend(list.iter().cloned());
        }
        text.push_str(choice["delta"]["content"].as_str().unwrap_or(""));
    }
    assert_eq!(joined, content);
    assert_eq!(
        text,
        v["choices"][0]["message"]["content"].as_str().unwrap()
    );
    let with_logprobs = streamed
        .iter()
        .filter(|c| {
            c["choices"][0]["logprobs"]["content"]
                .as_array()
                .is_some_and(|l| !l.is_empty())
        })
        .count();
    assert!(with_logprobs > 1, "sent as generated, not in one piece");
    // Without the flag: null, as OpenAI sends it.
    let (_, text) = post_raw(
        addr,
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).to_string(),
    )
    .await;
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(v["choices"][0]["logprobs"].is_null());
}

/// The binary with `--api-key-env`: a key no header can carry is refused before the model
/// loads; a refused request reaches the log (without the key), and the `Bearer` scheme is
/// matched in any case.
#[tokio::test]
async fn the_binary_refuses_unsendable_keys_and_logs_refusals() {
    use std::io::Read;
    use std::process::{Command, Stdio};
    let (_g, dir) = model_util::tiny_model_dir(&TinySpec::default());
    let serve = |key: &str| {
        Command::new(env!("CARGO_BIN_EXE_serve"))
            .arg("--model")
            .arg(&dir)
            .args([
                "--port",
                "0",
                "--threads",
                "1",
                "--api-key-env",
                "TEST_SERVE_KEY",
            ])
            .env("TEST_SERVE_KEY", key)
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let out = serve("ключ").wait_with_output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("TEST_SERVE_KEY") && err.contains("ASCII") && !err.contains("ключ"),
        "{err}"
    );

    let mut child = serve("s3cret");
    let base = serve_util::listening_url(child.stdout.take().unwrap());
    let client = reqwest::Client::new();
    let ask = |auth: &'static str| {
        client
            .post(format!("{base}/chat/completions"))
            .header("content-type", "application/json")
            .header("authorization", auth)
            .body(
                json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
                    .to_string(),
            )
            .send()
    };
    assert_eq!(ask("Bearer guess1").await.unwrap().status().as_u16(), 401);
    assert_eq!(ask("bearer s3cret").await.unwrap().status().as_u16(), 200);
    child.kill().unwrap();
    let mut log = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    child.wait().unwrap();
    let refused: Vec<&str> = log.lines().filter(|l| l.contains("401")).collect();
    assert_eq!(refused.len(), 1, "{log}");
    assert!(refused[0].contains("/v1/chat/completions"), "{log}");
    assert!(!log.contains("s3cret") && !log.contains("guess1"), "{log}");
}

/// A client that leaves while its long prompt is prefilled, nothing else running, stops the
/// prefill between rounds of `IDLE_PREFILL_CHUNKS` chunks: the rest of the prompt is never
/// run (it used to be prefilled whole in one pass, however long, after its client had gone).
#[tokio::test]
async fn an_abandoned_long_prompt_stops_prefilling() {
    use collabllm::engine::scheduler::IDLE_PREFILL_CHUNKS;
    let spec = slow_tiny(8192);
    let _timed = TIMED.lock().await;
    let (_g, backend) = never_ending_tiny(&spec).await;
    let addr = spawn_server(backend.clone(), "tiny").await;
    let before = backend.stats();
    // The tiny tokenizer has one token per byte.
    let prompt = "The sea is wide and deep. ".repeat(240);
    let request = open_request(addr, &greedy(&prompt, 4, false)).await;
    wait_for("the prefill to start", || {
        backend.stats().prefill_passes > before.prefill_passes
    })
    .await;
    drop(request);
    wait_for("the request to stop", || {
        backend.stats().cancelled > before.cancelled
    })
    .await;
    let after = backend.stats();
    let ran = after.prefill_positions - before.prefill_positions;
    let round = (collabllm::llm::local::PREFILL_CHUNK * IDLE_PREFILL_CHUNKS) as u64;
    // The round under way when the client left counts, and one more may start before the
    // server notices; the prompt is six rounds long.
    assert!(
        ran <= 3 * round && ran < prompt.len() as u64,
        "{ran} of {} prompt positions prefilled after the client left",
        prompt.len()
    );
    assert_eq!(after.decode_steps, before.decode_steps, "{after:?}");
}
