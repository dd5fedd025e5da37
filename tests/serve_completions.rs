//! `POST /v1/completions` over the real local engine (the tiny random llama, f32 weights) on
//! 127.0.0.1: echoed prompt log-probs equal to the trainer's log-softmax (plain and streamed),
//! greedy continuations equal to the engine's, batches of prompts, live streaming, and the
//! errors a client gets for what the endpoint cannot do.

mod common;
use common::model_util;
use common::serve_util;

use std::net::SocketAddr;

use candle_core::{DType, Device};
use collabllm::engine::tiny::TinySpec;
use collabllm::engine::GenParams;
use collabllm::llm::local::{LoadOptions, LocalBackend};
use collabllm::llm::ModelSpec;
use serde_json::{json, Value};
use serve_util::{api_error, spawn_server};

const PROMPT: &str = "Tell me about the sea.";

async fn post(addr: SocketAddr, body: Value) -> (u16, String) {
    serve_util::post_to(addr, "/v1/completions", body.to_string()).await
}

async fn post_ok(addr: SocketAddr, body: Value) -> Value {
    let (status, text) = post(addr, body).await;
    assert_eq!(status, 200, "{text}");
    serde_json::from_str(&text).unwrap()
}

/// The streamed chunks of a request (without `[DONE]`, which must come last).
async fn chunks(addr: SocketAddr, body: Value) -> Vec<Value> {
    let (status, text) = post(addr, body).await;
    assert_eq!(status, 200, "{text}");
    let data = serve_util::sse_data(&text);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{text}");
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

/// Each choice's streamed text and log-probs objects, by index.
fn joined(chunks: &[Value], choices: usize) -> (Vec<String>, Vec<Vec<Value>>, Vec<String>) {
    let (mut texts, mut lps, mut finish) = (
        vec![String::new(); choices],
        vec![Vec::new(); choices],
        vec![String::new(); choices],
    );
    for c in chunks {
        assert_eq!(c["object"], "text_completion");
        for choice in c["choices"].as_array().unwrap() {
            let i = choice["index"].as_u64().unwrap() as usize;
            texts[i].push_str(choice["text"].as_str().unwrap());
            if !choice["logprobs"].is_null() {
                lps[i].push(choice["logprobs"].clone());
            }
            if let Some(r) = choice["finish_reason"].as_str() {
                finish[i] = r.to_string();
            }
        }
    }
    (texts, lps, finish)
}

#[tokio::test]
async fn echoed_prompt_logprobs_are_the_trainers_log_softmax() {
    let (_g, dir, backend) = model_util::load_tiny_f32(&TinySpec::default()).await;
    let ids = backend.engine().encode_raw(PROMPT).unwrap();
    let model =
        collabllm::train::model::TrainLlama::from_hf_dir(&dir, DType::F32, &Device::Cpu).unwrap();
    let addr = spawn_server(backend.clone(), "tiny").await;

    // lm-evaluation-harness's scoring request: one greedy token, the prompt echoed.
    let body = json!({"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "temperature": 0,
                      "echo": true, "logprobs": 2});
    let v = post_ok(addr, body.clone()).await;
    assert_eq!(v["object"], "text_completion");
    let choice = &v["choices"][0];
    let text = choice["text"].as_str().unwrap();
    assert!(text.starts_with(PROMPT), "{text}");
    let lp = &choice["logprobs"];
    let tokens = lp["tokens"].as_array().unwrap();
    assert_eq!(
        tokens.len(),
        ids.len() + 1,
        "the prompt's tokens and the new one"
    );
    assert!(lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null());
    assert_eq!(lp["text_offset"][0], 0);

    let mut seq = ids.clone();
    // The greedy token: the argmax of the trainer's last row.
    let logp = model_util::trainer_log_probs(&model, &seq);
    let last = logp.last().unwrap();
    let best = (0..last.len())
        .max_by(|&a, &b| last[a].total_cmp(&last[b]))
        .unwrap() as u32;
    seq.push(best);
    let logp = model_util::trainer_log_probs(&model, &seq);
    for k in 1..seq.len() {
        let got = lp["token_logprobs"][k].as_f64().unwrap();
        let want = logp[k - 1][seq[k] as usize];
        assert!((got - want).abs() < 1e-4, "token {k}: {got} vs {want}");
        let top = lp["top_logprobs"][k].as_object().unwrap();
        assert!(!top.is_empty() && top.len() <= 2, "{top:?}");
        let best_lp = logp[k - 1].iter().cloned().fold(f64::MIN, f64::max);
        let top_best = top
            .values()
            .map(|x| x.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert!((top_best - best_lp).abs() < 1e-4, "token {k}");
    }

    // Streamed (echo answers from the finished completion): the same text and log-probs.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let c = chunks(addr, streamed).await;
    let (texts, lps, finish) = joined(&c, 1);
    assert_eq!(texts[0], text);
    assert_eq!(lps[0], vec![lp.clone()]);
    assert_eq!(finish[0], choice["finish_reason"].as_str().unwrap());

    // `max_tokens: 0` scores the prompt alone: no new token.
    let v = post_ok(
        addr,
        json!({"prompt": PROMPT, "max_tokens": 0, "echo": true, "logprobs": 0}),
    )
    .await;
    let choice = &v["choices"][0];
    assert_eq!(choice["text"], PROMPT);
    assert_eq!(
        choice["logprobs"]["tokens"].as_array().unwrap().len(),
        ids.len()
    );
    assert_eq!(v["usage"]["completion_tokens"], 0);
    assert_eq!(v["usage"]["prompt_tokens"], ids.len());
    for k in 1..ids.len() {
        let got = choice["logprobs"]["token_logprobs"][k].as_f64().unwrap();
        assert!((got - logp[k - 1][ids[k] as usize]).abs() < 1e-4);
    }
}

#[tokio::test]
async fn greedy_continuations_batches_and_live_streams() {
    let (_g, _dir, backend) = model_util::load_tiny_f32(&TinySpec::default()).await;
    let ids = backend.engine().encode_raw(PROMPT).unwrap();
    let greedy = backend
        .engine()
        .generate(
            &ids,
            &GenParams {
                temperature: 0.0,
                top_p: 1.0,
                max_new_tokens: 8,
                stop: Vec::new(),
                seed: None,
                n: 1,
                eos: collabllm::engine::EosRule::AfterText,
                logprobs: None,
            },
        )
        .unwrap()
        .samples[0]
        .text
        .clone();
    let addr = spawn_server(backend.clone(), "tiny").await;

    // Text or the same token ids: the engine's greedy continuation.
    for prompt in [json!(PROMPT), json!(ids)] {
        let v = post_ok(
            addr,
            json!({"prompt": prompt, "max_tokens": 8, "temperature": 0}),
        )
        .await;
        assert_eq!(v["choices"][0]["text"], greedy.as_str(), "{prompt}");
        assert_eq!(v["usage"]["prompt_tokens"], ids.len());
    }

    // A batch of two prompts, n = 2 each: choices numbered prompt by prompt.
    let batch = json!({"prompt": [PROMPT, "Once upon a time"], "n": 2, "max_tokens": 6,
                       "temperature": 0, "logprobs": 1});
    let v = post_ok(addr, batch.clone()).await;
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        let lp = &c["logprobs"];
        assert_eq!(
            lp["tokens"].as_array().unwrap().len(),
            lp["token_logprobs"].as_array().unwrap().len()
        );
    }
    // (Six of the eight greedy tokens.)
    assert!(greedy.starts_with(choices[0]["text"].as_str().unwrap()));
    assert_eq!(choices[0]["text"], choices[1]["text"]);
    assert_eq!(choices[2]["text"], choices[3]["text"]);
    // Offsets count from the end of the prompt when it is not echoed.
    assert_eq!(
        choices[0]["logprobs"]["text_offset"][0],
        PROMPT.chars().count()
    );

    // Streamed live: the same texts, piece by piece, each choice finished once.
    let mut streamed = batch.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let c = chunks(addr, streamed).await;
    let (texts, _, finish) = joined(&c, 4);
    for (i, choice) in choices.iter().enumerate() {
        assert_eq!(texts[i], choice["text"].as_str().unwrap(), "choice {i}");
        assert_eq!(finish[i], choice["finish_reason"].as_str().unwrap());
    }
    let usage = &c.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], v["usage"]["completion_tokens"]);
    assert!(c.len() > 4 + 4 + 1, "sent as generated: {} chunks", c.len());

    // A stop string ends the text before it.
    let cut = greedy
        .char_indices()
        .skip(1)
        .find(|(_, c)| c.is_ascii_alphanumeric())
        .map(|(i, c)| (i, c.to_string()))
        .expect("a letter or digit after the first character");
    let v = post_ok(
        addr,
        json!({"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stop": cut.1}),
    )
    .await;
    assert_eq!(v["choices"][0]["text"], &greedy[..cut.0]);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn what_the_endpoint_cannot_do_is_a_named_400() {
    let (_g, _dir, backend) = model_util::load_tiny_f32(&TinySpec::default()).await;
    let config = backend.engine().model().config();
    let vocab = config.vocab_size;
    // A text under the byte bound (so tokenized) with more tokens than the context: the
    // engine refuses it, and the error names `prompt`, not chat's `messages`.
    let engine = backend.engine().clone();
    let context = config.max_position_embeddings;
    let max_bytes = context * engine.max_token_bytes();
    let long_text = (1..)
        .map(|k| "a ".repeat(100 * k))
        .take_while(|t| t.len() <= max_bytes)
        .find(|t| {
            engine
                .tokenize_text(t, true)
                .is_ok_and(|ids| ids.len() >= context)
        })
        .expect("a text under the byte bound with too many tokens");
    let addr = spawn_server(backend, "tiny").await;
    for (body, param, needle) in [
        (json!({}), "prompt", "missing required parameter"),
        (
            json!({"prompt": 3}),
            "prompt",
            "a string, an array of strings",
        ),
        (json!({"prompt": []}), "prompt", "a batch of 1 to"),
        (
            json!({"prompt": "x", "max_tokens": 0}),
            "max_tokens",
            "0 only with `echo`",
        ),
        (
            json!({"prompt": "x", "logprobs": 21}),
            "logprobs",
            "between 0 and 20",
        ),
        (
            json!({"prompt": "x", "best_of": 3}),
            "best_of",
            "not supported",
        ),
        (
            json!({"prompt": "x", "suffix": "y"}),
            "suffix",
            "not supported",
        ),
        (
            json!({"prompt": "x", "temperature": 3}),
            "temperature",
            "between 0 and 2",
        ),
        (json!({"prompt": "x", "echo": "yes"}), "echo", "a boolean"),
        (
            json!({"prompt": [vocab + 5]}),
            "prompt",
            "outside the vocabulary",
        ),
        (json!({"prompt": "x", "model": "other"}), "model", "other"),
        (
            json!({"prompt": long_text}),
            "prompt",
            "does not fit the context length",
        ),
        (
            json!({"prompt": "x", "response_format": {"type": "json_object"}}),
            "response_format",
            "not supported by /v1/completions",
        ),
        (
            json!({"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}),
            "tools",
            "not supported by /v1/completions",
        ),
    ] {
        let (status, text) = post(addr, body.clone()).await;
        let err = api_error(&text);
        let want_status = if param == "model" { 404 } else { 400 };
        assert_eq!(status, want_status, "{body}: {text}");
        if param != "model" {
            assert_eq!(err["param"], param, "{body}: {text}");
        }
        assert!(
            err["message"].as_str().unwrap().contains(needle),
            "{body}: {text}"
        );
    }
}

/// A base model (no chat template in its files) loads and answers raw completions; chat is
/// a 400 that says what to do, until `--chat-template FILE` gives it one.
#[tokio::test]
async fn a_model_without_a_chat_template_chats_only_when_given_one() {
    model_util::one_thread();
    let (_g, dir) = model_util::tiny_model_dir(&TinySpec::default());
    let config = dir.join("tokenizer_config.json");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    cfg.as_object_mut().unwrap().remove("chat_template");
    std::fs::write(&config, cfg.to_string()).unwrap();
    let _ = std::fs::remove_file(dir.join("chat_template.jinja"));
    let spec = ModelSpec::HfDir(dir.clone());
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3});

    let base = LocalBackend::load(&spec, &LoadOptions::default())
        .await
        .unwrap();
    let addr = spawn_server(base, "base").await;
    let v = post_ok(addr, json!({"prompt": PROMPT, "max_tokens": 3})).await;
    assert_eq!(v["choices"].as_array().unwrap().len(), 1);
    let (status, text) = serve_util::post_raw(addr, chat.to_string()).await;
    assert_eq!(status, 400, "{text}");
    let err = api_error(&text);
    assert_eq!(err["code"], "unsupported", "{text}");
    let message = err["message"].as_str().unwrap();
    assert!(
        message.contains("no chat template") && message.contains("--chat-template"),
        "{message}"
    );

    let template = dir.join("plain.jinja");
    std::fs::write(
        &template,
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}\
         {% if add_generation_prompt %}assistant:{% endif %}",
    )
    .unwrap();
    let given = LocalBackend::load_with_chat_template(&spec, &LoadOptions::default(), &template)
        .await
        .unwrap();
    assert_eq!(
        given
            .engine()
            .render(&[collabllm::llm::ChatMessage::user("hi")])
            .unwrap(),
        "user: hi\nassistant:"
    );
    let addr = spawn_server(given, "base").await;
    let (status, text) = serve_util::post_raw(addr, chat.to_string()).await;
    assert_eq!(status, 200, "{text}");
}
