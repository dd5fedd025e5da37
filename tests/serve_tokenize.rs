//! vLLM's tokenizer endpoints on a real `serve` (127.0.0.1): `/tokenizer_info`, `/tokenize`
//! and `/detokenize` answer in vLLM's field names with the model's own tokens (the tiny random
//! llama); a text prompt that writes out its BOS gets one BOS (the tiny Gemma 3 GGUF, whose
//! SentencePiece tokenizer adds one); a raw completion whose greedy next token is
//! end-of-sequence stops there (the default model).

mod common;
use common::model_util;
use common::serve_util::{self, api_error, spawn_server};

use std::net::SocketAddr;
use std::path::PathBuf;

use collabllm::engine::llama::WeightFormat;
use collabllm::engine::tiny::TinySpec;
use collabllm::llm::local::{LoadOptions, LocalBackend};
use collabllm::llm::{ChatMessage, ModelSpec};
use serde_json::{json, Value};

async fn post(addr: SocketAddr, path: &str, body: Value) -> (u16, Value) {
    let (status, text) = serve_util::post_to(addr, path, body.to_string()).await;
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"));
    (status, v)
}

async fn post_ok(addr: SocketAddr, path: &str, body: Value) -> Value {
    let (status, v) = post(addr, path, body).await;
    assert_eq!(status, 200, "{path}: {v}");
    v
}

async fn info(addr: SocketAddr) -> Value {
    let (status, text) = serve_util::get_raw(addr, "/tokenizer_info").await;
    assert_eq!(status, 200, "{text}");
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v["tokens"]
        .as_array()
        .unwrap_or_else(|| panic!("no `tokens` in {v}"))
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

#[tokio::test]
async fn tokenizer_endpoints_answer_in_vllms_fields() {
    let (_g, _dir, backend) = model_util::load_tiny_f32(&TinySpec::default()).await;
    let engine = backend.engine().clone();
    let addr = spawn_server(backend, "tiny").await;

    // What lm-evaluation-harness's remote tokenizer reads: the special tokens (whose ids it
    // asks /tokenize for), the chat template, the context.
    let v = info(addr).await;
    assert_eq!(v["tokenizer_class"], "PreTrainedTokenizerFast");
    assert_eq!(v["bos_token"], "<|im_start|>");
    assert_eq!(v["eos_token"], "<|im_end|>");
    assert_eq!(v["pad_token"], "<|im_end|>");
    assert!(v["unk_token"].is_null(), "{v}");
    assert_eq!(v["model_max_length"], engine.context_length());
    assert_eq!(v["add_bos_token"], false);
    assert_eq!(
        v["chat_template"].as_str().unwrap(),
        engine.template().source()
    );

    // Text: the ids /v1/completions reads, with vLLM's response fields.
    let text = "Tell me about the sea.";
    let v = post_ok(addr, "/tokenize", json!({"prompt": text})).await;
    let want = engine.encode_raw(text).unwrap();
    assert_eq!(ids(&v), want);
    assert_eq!(v["count"], want.len());
    assert_eq!(v["max_model_len"], engine.context_length());
    assert!(v["token_strs"].is_null(), "only when asked: {v}");
    let v = post_ok(
        addr,
        "/tokenize",
        json!({"model": "tiny", "prompt": text, "add_special_tokens": false,
               "return_token_strs": true}),
    )
    .await;
    let strs: Vec<&str> = v["token_strs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    assert_eq!(strs.len(), want.len());
    // Byte-level BPE writes a space as `Ġ`.
    assert_eq!(strs.concat().replace('Ġ', " "), text);
    // lm-evaluation-harness finds the EOS id by tokenizing the EOS text.
    let v = post_ok(
        addr,
        "/tokenize",
        json!({"prompt": "<|im_end|>", "add_special_tokens": false}),
    )
    .await;
    let eos = engine.tokenizer().token_to_id("<|im_end|>").unwrap();
    assert_eq!(ids(&v), vec![eos]);
    assert!(engine.eos_ids().contains(&eos));

    // Messages: the chat template's rendering, with or without the assistant's opening.
    let messages = json!([{"role": "user", "content": "hi there"}]);
    let v = post_ok(addr, "/tokenize", json!({"messages": messages})).await;
    let chat = [ChatMessage::user("hi there")];
    assert_eq!(ids(&v), engine.encode_chat(&chat).unwrap());
    let v = post_ok(
        addr,
        "/tokenize",
        json!({"messages": messages, "add_generation_prompt": false}),
    )
    .await;
    let rendered = engine.render_conversation(&chat, false).unwrap();
    assert_eq!(ids(&v), engine.encode(&rendered).unwrap());
    assert!(ids(&v).len() < engine.encode_chat(&chat).unwrap().len());

    // Detokenize writes special tokens out, so the text encodes back to the same ids.
    let chat_ids = engine.encode_chat(&chat).unwrap();
    let v = post_ok(addr, "/detokenize", json!({"tokens": chat_ids})).await;
    let prompt = v["prompt"].as_str().unwrap();
    assert!(
        prompt.contains("<|im_start|>user\nhi there<|im_end|>"),
        "{prompt}"
    );
    let v = post_ok(
        addr,
        "/tokenize",
        json!({"prompt": prompt, "add_special_tokens": false}),
    )
    .await;
    assert_eq!(ids(&v), chat_ids);

    // Errors name the field; another model's name is a 404, as on the completion routes.
    let vocab = engine.model().config().vocab_size;
    for (path, body, status, param) in [
        ("/tokenize", json!({}), 400, Some("prompt")),
        (
            "/tokenize",
            json!({"prompt": "a", "messages": messages}),
            400,
            Some("messages"),
        ),
        ("/tokenize", json!({"prompt": 5}), 400, Some("prompt")),
        (
            "/tokenize",
            json!({"messages": messages, "continue_final_message": true}),
            400,
            Some("continue_final_message"),
        ),
        (
            "/tokenize",
            json!({"prompt": "a", "model": "other"}),
            404,
            None,
        ),
        ("/detokenize", json!({}), 400, Some("tokens")),
        (
            "/detokenize",
            json!({"tokens": [1, "x"]}),
            400,
            Some("tokens"),
        ),
        (
            "/detokenize",
            json!({"tokens": [vocab + 1]}),
            400,
            Some("tokens"),
        ),
        (
            "/detokenize",
            json!({"tokens": [1], "model": "other"}),
            404,
            None,
        ),
    ] {
        let (got, v) = post(addr, path, body.clone()).await;
        assert_eq!(got, status, "{path} {body}: {v}");
        let err = api_error(&v.to_string());
        if let Some(param) = param {
            assert_eq!(err["param"], param, "{path} {body}: {v}");
        }
    }
}

/// The tiny Gemma 3 GGUF (tests/fixtures/families): its SentencePiece tokenizer puts a BOS
/// before every text.
fn gemma_gguf() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/families/gemma3_text.gguf")
}

#[tokio::test]
async fn a_text_prompt_that_writes_its_bos_gets_one() {
    model_util::one_thread();
    let opts = LoadOptions {
        weights: WeightFormat::F32,
        ..LoadOptions::default()
    };
    let backend = LocalBackend::load(&ModelSpec::Gguf(gemma_gguf()), &opts)
        .await
        .unwrap();
    let addr = spawn_server(backend, "gemma").await;
    let v = info(addr).await;
    assert_eq!(v["add_bos_token"], true, "{v}");
    let bos_text = v["bos_token"].as_str().unwrap().to_string();
    let bos = ids(&post_ok(
        addr,
        "/tokenize",
        json!({"prompt": bos_text, "add_special_tokens": false}),
    )
    .await)[0];

    let text = "Question: what is the sea?";
    let plain = ids(&post_ok(addr, "/tokenize", json!({"prompt": text})).await);
    assert_eq!(plain[0], bos, "the tokenizer adds its BOS");
    assert_ne!(plain[1], bos);
    let written = format!("{bos_text}{text}");
    let v = post_ok(addr, "/tokenize", json!({"prompt": written})).await;
    assert_eq!(ids(&v), plain, "one BOS, not two");
    // Without special tokens the written one is all there is.
    let v = post_ok(
        addr,
        "/tokenize",
        json!({"prompt": written, "add_special_tokens": false}),
    )
    .await;
    assert_eq!(ids(&v), plain);
    // Two written out are the client's to give: one is added to none of them.
    let twice = format!("{bos_text}{bos_text}{text}");
    let v = post_ok(addr, "/tokenize", json!({"prompt": twice})).await;
    assert_eq!(&ids(&v)[..3], &[bos, bos, plain[1]]);

    // /v1/completions reads the same ids: the text and its tokens score alike.
    let score =
        |prompt: Value| json!({"prompt": prompt, "max_tokens": 0, "echo": true, "logprobs": 0});
    let by_text = post_ok(addr, "/v1/completions", score(json!(written))).await;
    let by_ids = post_ok(addr, "/v1/completions", score(json!(plain))).await;
    assert_eq!(by_text["usage"]["prompt_tokens"], plain.len());
    assert_eq!(
        by_text["choices"][0]["logprobs"]["token_logprobs"],
        by_ids["choices"][0]["logprobs"]["token_logprobs"]
    );
    // A token prompt decoded back to text (what a harness does with `add_bos_token` and
    // text requests) is read as the same tokens.
    let v = post_ok(addr, "/detokenize", json!({"tokens": plain})).await;
    assert_eq!(v["prompt"], written.as_str());
}

/// The default model's greedy next token after a finished assistant turn is end-of-turn:
/// a raw completion stops there, as transformers' `generate` does, and its log-probs end
/// with that token (what a harness reads after the prompt).
#[tokio::test]
async fn a_raw_completion_whose_greedy_token_is_eos_stops() {
    model_util::one_thread();
    let path = model_util::default_model_path();
    let opts = LoadOptions {
        weights: WeightFormat::F32,
        ..LoadOptions::default()
    };
    let backend = LocalBackend::load(&ModelSpec::Gguf(path), &opts)
        .await
        .unwrap();
    let engine = backend.engine().clone();
    let prompt = "<|im_start|>user\nSay OK.<|im_end|>\n<|im_start|>assistant\nOK.";
    let prompt_ids = engine.encode_raw(prompt).unwrap();
    let logits = engine.next_token_logits(&prompt_ids).unwrap();
    let best = (0..logits.len())
        .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
        .unwrap() as u32;
    assert!(
        engine.eos_ids().contains(&best),
        "this prompt's greedy next token must be end-of-sequence, got {best}"
    );
    let addr = spawn_server(backend, "default").await;

    for prompt in [json!(prompt), json!(prompt_ids)] {
        let v = post_ok(
            addr,
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1}),
        )
        .await;
        let choice = &v["choices"][0];
        assert_eq!(choice["finish_reason"], "stop", "{v}");
        assert_eq!(choice["text"], "", "{v}");
        let lp = &choice["logprobs"];
        assert_eq!(lp["tokens"], json!(["<|im_end|>"]), "{v}");
        let max = logits.iter().copied().fold(f32::MIN, f32::max);
        let lse = logits
            .iter()
            .map(|&x| f64::from(x - max).exp())
            .sum::<f64>()
            .ln()
            + f64::from(max);
        let want = f64::from(logits[best as usize]) - lse;
        let got = lp["token_logprobs"][0].as_f64().unwrap();
        assert!((got - want).abs() < 1e-4, "{got} vs {want}");
        assert_eq!(v["usage"]["completion_tokens"], 1);
    }

    // lm-evaluation-harness's scoring request: the prompt echoed, then the one greedy token,
    // which it drops (`token_logprobs[ctxlen:-1]`): here the end-of-sequence token.
    let v = post_ok(
        addr,
        "/v1/completions",
        json!({"prompt": [prompt_ids], "max_tokens": 1, "temperature": 0, "logprobs": 1,
               "echo": true}),
    )
    .await;
    let lp = &v["choices"][0]["logprobs"];
    let n = lp["tokens"].as_array().unwrap().len();
    assert_eq!(n, prompt_ids.len() + 1, "{v}");
    assert_eq!(lp["tokens"][n - 1], "<|im_end|>");

    // Chat keeps its rule: an empty reply is never an answer.
    let v = post_ok(
        addr,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 4,
               "temperature": 0}),
    )
    .await;
    assert!(!v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .trim()
        .is_empty());
}

/// Text prompts are tokenized off the async threads: while four requests of prompts of 1.2 MB
/// each are tokenized (each under the byte bound, so counted exactly, then refused for the
/// context), `GET /health` answers within 1 s on a server of two async threads. The prompts
/// per request are as many as take the tokenizer over 2 s (measured first), so tokenizing on
/// the async threads would hold both of them far longer than the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_answers_while_huge_text_prompts_are_tokenized() {
    use std::time::{Duration, Instant};
    model_util::one_thread();
    let path = model_util::default_model_path();
    let backend = LocalBackend::load(&ModelSpec::Gguf(path), &LoadOptions::default())
        .await
        .unwrap();
    // Distinct words, so the tokenizer's word cache does not make it cheap.
    let mut prompt = String::new();
    let mut i = 0u64;
    while prompt.len() < 1_200_000 {
        prompt.push_str(&format!("w{} ", i.wrapping_mul(2_654_435_761) % 1_000_003));
        i += 1;
    }
    let started = Instant::now();
    backend.engine().tokenize_text(&prompt, true).unwrap();
    let each = started.elapsed();
    // A body holds at most 13 such prompts (16 MiB).
    let n = ((2.0 / each.as_secs_f64()).ceil() as usize).clamp(1, 13);
    assert!(
        each * n as u32 >= Duration::from_secs(2),
        "a 1.2 MB prompt tokenizes in {each:?}: too fast to hold the async threads"
    );
    let addr = spawn_server(backend, "default").await;
    let body = json!({"prompt": vec![prompt; n], "max_tokens": 1}).to_string();
    let busy: Vec<_> = (0..4)
        .map(|_| {
            let body = body.clone();
            tokio::spawn(async move { serve_util::post_to(addr, "/v1/completions", body).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut worst = Duration::ZERO;
    for _ in 0..5 {
        let t = Instant::now();
        let (status, _) = serve_util::get_raw(addr, "/health").await;
        assert_eq!(status, 200);
        worst = worst.max(t.elapsed());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for b in busy {
        let (status, text) = b.await.unwrap();
        assert_eq!(status, 400, "{text}");
        // Refused by the engine after tokenizing, not by the byte pre-check.
        assert!(text.contains("tokens does not fit the context"), "{text}");
    }
    assert!(worst < Duration::from_secs(1), "/health took {worst:?}");
}
