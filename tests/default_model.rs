//! The embedded default model (SmolLM2-135M-Instruct Q4_1 GGUF, fetched by
//! `scripts/fetch_default_model.sh`) against llama.cpp's reference token ids and logits in
//! `../shared/reference/smollm2_llamacpp_reference.json`.

mod common;
use common::model_util;

use collabllm::engine::{Engine, LoadOptions};
use collabllm::llm::local::LocalBackend;
use collabllm::llm::spec::LocalModelFiles;
use collabllm::llm::{ChatBackend, ChatMessage, ChatRequest, FinishReason, ModelSpec};
use model_util::*;
use serde_json::Value;

fn reference() -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../shared/reference/smollm2_llamacpp_reference.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (the shared/ folder must sit beside the repo)",
            path.display()
        )
    });
    serde_json::from_str(&text).expect("reference JSON")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn engine() -> Engine {
    one_thread();
    Engine::load(
        &LocalModelFiles::Gguf(default_model_path()),
        &LoadOptions::default(),
    )
    .expect("loading the default model")
}

#[test]
fn token_ids_equal_llama_cpp() {
    let e = engine();
    let r = reference();
    for case in r["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        assert_eq!(e.encode(text).unwrap(), ids(&case["ids"]), "text {text:?}");
    }
    // And the chat template renders the reference prompt exactly.
    let nt = &r["next_token_reference"];
    let rendered = e
        .render(&[ChatMessage::user("What is the capital of France?")])
        .unwrap();
    assert_eq!(rendered, nt["prompt"].as_str().unwrap());
    assert_eq!(e.encode(&rendered).unwrap(), ids(&nt["prompt_ids"]));
}

#[test]
fn next_token_top10_overlaps_llama_cpp() {
    let e = engine();
    let nt = &reference()["next_token_reference"];
    let logits = e.next_token_logits(&ids(&nt["prompt_ids"])).unwrap();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    let ours: Vec<u32> = order[..10].iter().map(|&i| i as u32).collect();
    let theirs = ids(&nt["top10_ids"]);
    let overlap = ours.iter().filter(|i| theirs.contains(i)).count();
    assert!(
        overlap >= 8,
        "top-10 overlap {overlap}: ours {ours:?}, llama.cpp {theirs:?}"
    );
}

#[tokio::test]
async fn greedy_reply_stops_at_end_of_turn() {
    one_thread();
    let backend = LocalBackend::load(&ModelSpec::Default, &Default::default())
        .await
        .expect("loading the default model");
    let req = ChatRequest::new(vec![ChatMessage::user("Say hello in one short sentence.")])
        .temperature(0.0)
        .max_tokens(64);
    let resp = backend.chat(&req).await.unwrap();
    let reply = &resp.choices[0];
    assert!(!reply.content.trim().is_empty());
    assert_eq!(
        reply.finish_reason,
        FinishReason::Stop,
        "reply: {:?}",
        reply.content
    );
    assert!(!reply.content.contains("<|im_end|>"), "{:?}", reply.content);
    assert!(resp.usage.completion_tokens < 64);
}

/// A checkpoint trained from the GGUF carries the GGUF's tokenizer and template as
/// `tokenizer.json` / `tokenizer_config.json`; read back, they give llama.cpp's ids and the
/// same chat prompt and end-of-turn ids.
#[test]
fn gguf_tokenizer_exported_for_checkpoints_round_trips() {
    use collabllm::engine::ChatCodec;
    let gguf = LocalModelFiles::Gguf(default_model_path());
    let codec = ChatCodec::load(&gguf).unwrap();
    let dir = tempfile::tempdir().unwrap();
    codec.save_hf(dir.path()).unwrap();
    let back = ChatCodec::load(&LocalModelFiles::HfDir(dir.path().to_path_buf())).unwrap();
    let r = reference();
    for case in r["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        assert_eq!(
            back.encode(text).unwrap(),
            ids(&case["ids"]),
            "text {text:?}"
        );
    }
    let msgs = [ChatMessage::user("What is the capital of France?")];
    assert_eq!(
        back.render(&msgs, true).unwrap(),
        codec.render(&msgs, true).unwrap()
    );
    assert_eq!(back.eos_ids, codec.eos_ids);
    // GGUF's padding / unknown token ids survive as names (TRL needs a pad token).
    assert_eq!(codec.special_tokens["pad_token"], "<|im_end|>");
    assert_eq!(codec.special_tokens["unk_token"], "<|endoftext|>");
    assert_eq!(back.special_tokens, codec.special_tokens);
}

/// Continuous batching on the default model: requests joining mid-decode give the tokens
/// they give alone.
#[test]
fn requests_joining_mid_decode_equal_alone() {
    assert_joining_mid_decode_equals_alone(&engine());
}

/// Prompt KV reuse: prompts that start like an earlier one (the next turn of a conversation,
/// the same system prompt, an exact repeat) prefill only the rest, and every token is what
/// a cold run gives.
#[test]
fn prefix_reuse_gives_the_tokens_of_a_cold_run() {
    use collabllm::engine::GenParams;
    one_thread();
    let load = |mb| {
        Engine::load(
            &LocalModelFiles::Gguf(default_model_path()),
            &LoadOptions {
                prefix_cache_mb: Some(mb),
                ..LoadOptions::default()
            },
        )
        .expect("loading the default model")
    };
    let (cold, warm) = (load(0), load(64));
    let system = ChatMessage::system(
        "You are a patient tutor. Ask one clarifying question when a request is ambiguous, \
         then answer briefly and check that the student followed.",
    );
    let first = vec![system.clone(), ChatMessage::user("How do I add fractions?")];
    let mut second = first.clone();
    second.push(ChatMessage::assistant("Do they have the same denominator?"));
    second.push(ChatMessage::user("No, one is 1/3 and the other 1/4."));
    let other = vec![system, ChatMessage::user("What is a prime number?")];
    let prompts = [&first, &second, &second, &other];
    let params = |temperature| GenParams {
        temperature,
        top_p: 0.95,
        max_new_tokens: 24,
        stop: Vec::new(),
        seed: Some(11),
        n: 2,
        eos: collabllm::engine::EosRule::AfterText,
        logprobs: None,
    };
    let mut cached = Vec::new();
    for (i, messages) in prompts.iter().enumerate() {
        let ids = cold.encode_chat(messages).unwrap();
        for temperature in [0.0, 1.0] {
            let a = cold.generate(&ids, &params(temperature)).unwrap();
            let b = warm.generate(&ids, &params(temperature)).unwrap();
            assert_eq!(a.cached_tokens, 0, "reuse off");
            assert_eq!(
                a.samples, b.samples,
                "prompt {i} at temperature {temperature}"
            );
            cached.push((ids.len(), b.cached_tokens));
        }
    }
    let first_len = cold.encode_chat(&first).unwrap().len();
    // Cold, then the exact repeat at the second temperature.
    assert_eq!(cached[0], (first_len, 0));
    assert_eq!(cached[1], (first_len, first_len));
    // The next turn starts from the whole first prompt; its repeats are exact.
    let second_len = cached[2].0;
    assert!(cached[2].1 >= first_len - 1, "{cached:?}");
    assert_eq!(cached[4], (second_len, second_len));
    // Another question under the same system prompt reuses the system turn.
    assert!(
        cached[6].1 > 20 && cached[6].1 < cached[6].0 - 3,
        "{cached:?}"
    );
    assert!(warm.prefix_cache_bytes() > 0);
    assert_eq!(cold.prefix_cache_bytes(), 0);
}
