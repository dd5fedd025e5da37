//! The local engine on the tiny random llama, loaded through the normal HF-directory path.

mod common;
use common::model_util;

use candle_core::Tensor;
use collabllm::engine::llama::WeightFormat;
use collabllm::engine::tiny::TinySpec;
use collabllm::engine::{Engine, GenParams, LoadOptions};
use collabllm::llm::local::LocalBackend;
use collabllm::llm::spec::LocalModelFiles;
use collabllm::llm::{ChatBackend, ChatMessage, ChatRequest, FinishReason, ModelSpec};
use model_util::*;

/// The tiny model in `dir` loaded with `weights` through the HF-directory path.
fn load(dir: &std::path::Path, weights: WeightFormat) -> Engine {
    let opts = LoadOptions {
        weights,
        ..LoadOptions::default()
    };
    Engine::load(&LocalModelFiles::HfDir(dir.to_path_buf()), &opts).unwrap()
}

fn question() -> Vec<ChatMessage> {
    vec![ChatMessage::user("Tell me about the sea.")]
}

#[tokio::test]
async fn greedy_generation_is_deterministic_and_counts_tokens() {
    let (_g, backend) = load_tiny(&TinySpec::default()).await;
    let req = ChatRequest::new(question()).temperature(0.0).max_tokens(24);
    let a = backend.chat(&req).await.unwrap();
    let b = backend.chat(&req).await.unwrap();
    assert_eq!(a.choices.len(), 1);
    assert!(!a.choices[0].content.trim().is_empty());
    assert_eq!(a.choices[0].content, b.choices[0].content);
    assert!(a.usage.prompt_tokens > 20, "{:?}", a.usage);
    assert!(a.usage.completion_tokens >= 1 && a.usage.completion_tokens <= 24);
    if a.choices[0].finish_reason == FinishReason::Length {
        assert_eq!(a.usage.completion_tokens, 24);
    }
}

/// The batch of `n` samples decodes exactly as `n` separate single-sample calls would: sample
/// `i` of a seeded request equals a one-sample request with seed `seed + i`.
#[tokio::test]
async fn batched_samples_equal_single_stream_samples() {
    let (_g, backend) = load_tiny(&TinySpec::default()).await;
    let base = ChatRequest::new(question()).temperature(1.0).max_tokens(16);
    let batch = backend.chat(&base.clone().n(4).seed(11)).await.unwrap();
    assert_eq!(batch.choices.len(), 4);
    let mut distinct = std::collections::HashSet::new();
    for (i, choice) in batch.choices.iter().enumerate() {
        assert_eq!(choice.index, i);
        let single = backend
            .chat(&base.clone().seed(11 + i as u64))
            .await
            .unwrap();
        assert_eq!(single.choices[0].content, choice.content, "sample {i}");
        assert_eq!(
            single.choices[0].finish_reason, choice.finish_reason,
            "sample {i}"
        );
        distinct.insert(choice.content.clone());
    }
    assert!(
        distinct.len() > 1,
        "temperature 1 should give different samples"
    );
    let total: u64 = (0..4).map(|i| batch.choices[i].content.len() as u64).sum();
    assert!(total > 0 && batch.usage.completion_tokens >= 4);
}

/// A long prompt that arrives while another request decodes is prefilled a chunk per round
/// between its decode steps; both replies equal the ones each request gets alone, cold.
#[tokio::test]
async fn a_long_prompt_prefilled_in_chunks_beside_a_decode_gives_its_alone_reply() {
    let (_g, backend) = load_tiny(&TinySpec::default()).await;
    let long = "the sea and the hills ".repeat(25);
    let short = ChatRequest::new(question()).temperature(0.0).max_tokens(64);
    let long = ChatRequest::new(vec![ChatMessage::user(long)])
        .temperature(0.0)
        .max_tokens(8);
    let mut alone = Vec::new();
    for req in [&short, &long] {
        backend.engine().clear_prefix_cache();
        alone.push(backend.chat(req).await.unwrap());
    }
    assert!(
        alone[1].usage.prompt_tokens > 20 * 16,
        "{:?}",
        alone[1].usage
    );
    backend.engine().clear_prefix_cache();
    // Small chunks: the long prompt takes dozens of rounds beside the decode.
    backend.set_prefill_chunk(16);
    let started = backend.stats();
    let (a, b) = tokio::join!(backend.chat(&short), async {
        // Joins once the short request is decoding.
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        backend.chat(&long).await
    });
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.choices[0].content, alone[0].choices[0].content);
    assert_eq!(b.choices[0].content, alone[1].choices[0].content);
    // Only the chat template's start is shared with the short prompt: the rest of the long
    // prompt was prefilled here, over several chunks.
    let cold = b.usage.prompt_tokens - b.usage.cached_prompt_tokens;
    assert!(cold > 20 * 16, "{:?}", b.usage);
    assert_eq!(backend.stats().started - started.started, 2);
}

/// The same with Q8_0 weights, which run in our int8 kernel: a row's logits never depend on
/// which other rows share the batch.
#[test]
fn q8_batched_samples_equal_single_stream_samples() {
    one_thread();
    let (_g, dir) = tiny_model_dir(&TinySpec::default());
    let engine = load(&dir, WeightFormat::Q8_0);
    let prompt = engine.encode(&engine.render(&question()).unwrap()).unwrap();
    let params = |n, seed| GenParams {
        temperature: 1.0,
        top_p: 1.0,
        max_new_tokens: 16,
        stop: Vec::new(),
        seed: Some(seed),
        n,
        eos: collabllm::engine::EosRule::AfterText,
        logprobs: None,
    };
    let batch = engine.generate(&prompt, &params(4, 11)).unwrap();
    let mut distinct = std::collections::HashSet::new();
    for (i, sample) in batch.samples.iter().enumerate() {
        let single = engine.generate(&prompt, &params(1, 11 + i as u64)).unwrap();
        assert_eq!(&single.samples[0], sample, "sample {i}");
        distinct.insert(sample.text.clone());
    }
    assert!(
        distinct.len() > 1,
        "temperature 1 should give different samples"
    );
}

#[tokio::test]
async fn stop_strings_cut_the_reply() {
    let (_g, backend) = load_tiny(&TinySpec::default()).await;
    // A seeded sample long enough to cut (the random model often ends early).
    let (req, full) = {
        let mut found = None;
        for seed in 0..50 {
            let req = ChatRequest::new(question())
                .temperature(1.0)
                .max_tokens(32)
                .seed(seed);
            let text = backend.chat(&req).await.unwrap().choices[0].content.clone();
            let chars: Vec<char> = text.chars().collect();
            let usable = chars.len() >= 8
                && !chars[..6].contains(&char::REPLACEMENT_CHARACTER)
                && !chars[..4].iter().collect::<String>().trim().is_empty();
            if usable {
                found = Some((req, text));
                break;
            }
        }
        found.expect("some seed gives a reply of 8+ characters")
    };
    let stop: String = full.chars().skip(4).take(2).collect();
    let expected = full[..full.find(&stop).unwrap()].to_string();
    let cut = backend
        .chat(&req.clone().stop(vec![stop.clone()]))
        .await
        .unwrap();
    assert_eq!(
        cut.choices[0].content, expected,
        "stop {stop:?} in {full:?}"
    );
    assert_eq!(cut.choices[0].finish_reason, FinishReason::Stop);
}

/// Decoding token by token through the KV cache gives the logits of one full forward pass.
#[test]
fn kv_cache_decoding_matches_full_forward() {
    one_thread();
    let (_g, dir) = tiny_model_dir(&TinySpec::default());
    let engine = load(&dir, WeightFormat::F32);
    let model = engine.model();
    let ids: Vec<u32> = engine
        .encode("<|im_start|>user\nhello there<|im_end|>\n")
        .unwrap();
    let dev = model.device();
    let mut c1 = model.new_cache(ids.len());
    let full = model
        .forward_all(
            &Tensor::new(ids.as_slice(), dev)
                .unwrap()
                .unsqueeze(0)
                .unwrap(),
            &mut c1,
        )
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let split = 5;
    let mut c2 = model.new_cache(4);
    let _ = model
        .forward_last(
            &Tensor::new(&ids[..split], dev)
                .unwrap()
                .unsqueeze(0)
                .unwrap(),
            &mut c2,
        )
        .unwrap();
    for (pos, &id) in ids.iter().enumerate().skip(split) {
        let step = model
            .forward_last(
                &Tensor::new(&[id], dev).unwrap().unsqueeze(0).unwrap(),
                &mut c2,
            )
            .unwrap()
            .squeeze(0)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let max_diff = step
            .iter()
            .zip(&full[pos])
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(max_diff < 1e-4, "position {pos}: max diff {max_diff}");
    }
}

#[tokio::test]
async fn option_probs_form_a_distribution() {
    let (_g, backend) = load_tiny(&TinySpec::default()).await;
    let opts: Vec<String> = ["1", "2", "3"].iter().map(|s| s.to_string()).collect();
    let p = backend
        .option_probs(&question(), "Score: ", &opts)
        .await
        .unwrap()
        .probs;
    assert_eq!(p.len(), 3);
    assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-9, "{p:?}");
    assert!(p.iter().all(|x| *x > 0.0));
}

#[tokio::test]
async fn untied_head_and_q8_weights_load() {
    one_thread();
    let spec = TinySpec {
        tie_word_embeddings: false,
        ..TinySpec::default()
    };
    let (_g, dir) = tiny_model_dir(&spec);
    let f32_engine = load(&dir, WeightFormat::F32);
    let q8_engine = load(&dir, WeightFormat::Q8_0);
    let ids = f32_engine
        .encode("<|im_start|>user\nhi<|im_end|>\n")
        .unwrap();
    let a = f32_engine.next_token_logits(&ids).unwrap();
    let b = q8_engine.next_token_logits(&ids).unwrap();
    let top = |v: &[f32]| {
        let mut idx: Vec<usize> = (0..v.len()).collect();
        idx.sort_by(|&i, &j| v[j].total_cmp(&v[i]));
        idx.truncate(10);
        idx
    };
    let overlap = top(&a).iter().filter(|i| top(&b).contains(i)).count();
    assert!(overlap >= 7, "Q8_0 top-10 overlaps f32 top-10 in {overlap}");
}

#[tokio::test]
async fn bad_model_inputs_name_the_file() {
    one_thread();
    let tmp = tempfile::tempdir().unwrap();
    let load = |spec: ModelSpec| async move {
        match LocalBackend::load(&spec, &LoadOptions::default()).await {
            Ok(_) => panic!("loading {spec} should fail"),
            Err(e) => e.to_string(),
        }
    };
    // A missing GGUF path.
    let missing = tmp.path().join("nope.gguf");
    let msg = load(ModelSpec::Gguf(missing.clone())).await;
    assert!(
        msg.contains("nope.gguf") && msg.contains("does not exist"),
        "{msg}"
    );
    // A corrupt GGUF.
    let corrupt = tmp.path().join("corrupt.gguf");
    std::fs::write(&corrupt, b"GGUF\x03\x00\x00\x00garbage").unwrap();
    let msg = load(ModelSpec::Gguf(corrupt)).await;
    assert!(
        msg.contains("corrupt.gguf") && msg.contains("GGUF"),
        "{msg}"
    );
    // A tokenizer_config.json whose chat template is not a template (one without any loads:
    // a base model, tests/serve_completions.rs).
    let (_g, dir) = tiny_model_dir(&TinySpec::default());
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"eos_token": "<|im_end|>", "chat_template": 5}"#,
    )
    .unwrap();
    let msg = load(ModelSpec::HfDir(dir.clone())).await;
    assert!(
        msg.contains("tokenizer_config.json") && msg.contains("chat template"),
        "{msg}"
    );
    // A directory without weights.
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let msg = load(ModelSpec::HfDir(dir)).await;
    assert!(msg.contains("safetensors"), "{msg}");
}

/// Log-probability answers go through the request cache and the usage meter too, so a rerun
/// of local judging costs nothing and the summary counts the calls.
#[tokio::test]
async fn option_probs_are_cached_and_metered() {
    use collabllm::llm::roles::Role;
    use collabllm::llm::RequestCache;
    let (_g, backend) = load_tiny(&TinySpec::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let cache = RequestCache::open(dir.path()).unwrap();
    let role = Role::from_backend("judge", "tiny", backend, Some(cache), None);
    let opts: Vec<String> = ["0", "1"].iter().map(|s| s.to_string()).collect();
    let a = role
        .backend
        .option_probs(&question(), "Score: ", &opts)
        .await
        .unwrap();
    let b = role
        .backend
        .option_probs(&question(), "Score: ", &opts)
        .await
        .unwrap();
    assert!(!a.cached && b.cached);
    assert_eq!(a.probs, b.probs);
    assert!(a.prompt_tokens > 10);
    let u = role.meter.snapshot();
    assert_eq!((u.calls, u.cache_hits), (1, 1));
    assert_eq!(u.prompt_tokens, a.prompt_tokens);
}

/// An HF model id that is not in the cache, offline: a clear error naming the id and saying
/// how to make it available (no hang, no download attempt).
#[tokio::test]
async fn offline_hf_id_names_the_model_and_the_fix() {
    let home = tempfile::tempdir().unwrap();
    // SAFETY: this test runs in its own process under nextest; set before any thread reads it.
    unsafe {
        std::env::set_var("HF_HUB_OFFLINE", "1");
        std::env::set_var("HF_HOME", home.path());
    }
    let spec: ModelSpec = "hf:HuggingFaceTB/SmolLM2-135M-Instruct".parse().unwrap();
    let err = match LocalBackend::load(&spec, &Default::default()).await {
        Ok(_) => panic!("should fail offline"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("HuggingFaceTB/SmolLM2-135M-Instruct"), "{err}");
    assert!(err.contains("offline") || err.contains("download"), "{err}");
}

/// Requests that join a running decode batch mid-way give the tokens they give alone, with
/// f32 weights (candle's matmul) and Q8_0 weights (our int8 kernel).
#[test]
fn requests_joining_mid_decode_equal_alone() {
    one_thread();
    for weights in [WeightFormat::Auto, WeightFormat::Q8_0] {
        let (_g, dir) = tiny_model_dir(&TinySpec::default());
        let engine = load(&dir, weights);
        assert_joining_mid_decode_equals_alone(&engine);
    }
}

/// `fork` keeps the prompt once, shared by the rows: decoding the forked rows (one dropped on
/// the way) gives the bits of decoding private copies of the prompt's cache one at a time, and
/// a prefix taken from a forked cache is the prompt's.
#[test]
fn forked_rows_share_the_prompt_and_equal_private_copies() {
    one_thread();
    let (_g, dir) = tiny_model_dir(&TinySpec::default());
    let engine = load(&dir, WeightFormat::Q8_0);
    let model = engine.model();
    let ids: Vec<u32> = engine
        .encode("<|im_start|>user\nhello there, how are you<|im_end|>\n")
        .unwrap();
    let dev = model.device();
    let mut prompt = model.new_cache(ids.len());
    let input = Tensor::new(ids.as_slice(), dev)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let last = model.forward_last(&input, &mut prompt).unwrap();
    let len = ids.len();

    // A prefix hit reads the stored prompt's positions in place; prefilling the rest after it
    // gives the whole prompt's logits, and a fork of it shares that prefix on.
    let mut hit = prompt.prefix(len - 3, len).unwrap();
    let rest = Tensor::new(&ids[len - 3..], dev)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let after_hit = model.forward_last(&rest, &mut hit).unwrap();
    assert_eq!(
        after_hit.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        last.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    );
    let mut hit_rows = hit.fork(2, 1).unwrap();
    let mut copy_rows = prompt.fork(2, 1).unwrap();
    let step = |c: &mut collabllm::engine::llama::KvCache| {
        let l = model.forward_decode(&[&[11u32, 12]], &mut [c]).unwrap();
        l[0].to_vec2::<f32>().unwrap()
    };
    assert_eq!(step(&mut hit_rows), step(&mut copy_rows));

    let mut forked = prompt.fork(3, 2).unwrap();
    assert_eq!((forked.batch(), forked.len()), (3, len));
    let mut alone: Vec<_> = (0..3)
        .map(|_| prompt.prefix(len, len + 2).unwrap())
        .collect();
    let mut rows: Vec<usize> = vec![0, 1, 2];
    for step in 0..4u32 {
        if step == 2 {
            // Row 1 finishes: the batch keeps rows 0 and 2 (and the shared prefix).
            forked.retain_rows(&[0, 2]).unwrap();
            rows = vec![0, 2];
        }
        let tokens: Vec<u32> = rows.iter().map(|&r| 5 + 7 * r as u32 + step).collect();
        let batched = model
            .forward_decode(&[&tokens], &mut [&mut forked])
            .unwrap();
        let batched = batched[0].to_vec2::<f32>().unwrap();
        for (i, &r) in rows.iter().enumerate() {
            let one = model
                .forward_decode(&[&tokens[i..i + 1]], &mut [&mut alone[r]])
                .unwrap();
            let one = one[0].to_vec2::<f32>().unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&batched[i]), bits(&one[0]), "step {step}, row {r}");
        }
    }
    // A prefix of the forked cache is the prompt's (shared) positions, then row 0's own.
    let from_fork = forked.prefix(len, len).unwrap();
    let from_prompt = prompt.prefix(len, len).unwrap();
    let next = |mut c: collabllm::engine::llama::KvCache| {
        let l = model.forward_decode(&[&[9u32]], &mut [&mut c]).unwrap();
        l[0].to_vec2::<f32>().unwrap()
    };
    assert_eq!(next(from_fork), next(from_prompt));
    // Past the prompt: row 0's own positions follow the shared ones.
    let from_fork = forked.prefix(len + 3, len + 3).unwrap();
    let from_alone = alone[0].prefix(len + 3, len + 3).unwrap();
    assert_eq!(next(from_fork), next(from_alone));
}

/// Several requests' prompt pieces prefilled in one forward pass (a cold prompt, the rest of
/// a prompt after a prefix hit, one token) give each the logits and cache of prefilling it
/// alone, bit for bit.
#[test]
fn prompts_prefilled_together_equal_each_alone() {
    let (_g, dir) = tiny_model_dir(&TinySpec::default());
    let engine = load(&dir, WeightFormat::Q8_0);
    let model = engine.model();
    let dev = model.device();
    let ids = engine
        .encode("<|im_start|>user\nhello there, how are you today<|im_end|>\n")
        .unwrap();
    let len = ids.len();
    let mut stored = model.new_cache(len);
    let whole = Tensor::new(ids.as_slice(), dev)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    model.forward_last(&whole, &mut stored).unwrap();
    let pieces: Vec<(Vec<u32>, usize)> = vec![
        (ids[..len - 2].to_vec(), 0),       // cold
        (ids[len - 5..].to_vec(), len - 5), // after a prefix hit
        (vec![7], len),                     // one token after the whole prompt
    ];
    let cache_for = |start: usize| match start {
        0 => model.new_cache(len),
        n => stored.prefix(n, len + 1).unwrap(),
    };
    let mut alone_caches: Vec<_> = pieces.iter().map(|p| cache_for(p.1)).collect();
    let alone: Vec<Vec<f32>> = pieces
        .iter()
        .zip(alone_caches.iter_mut())
        .map(|((t, _), c)| {
            let t = Tensor::new(t.as_slice(), dev)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            let l = model.forward_last(&t, c).unwrap();
            l.flatten_all().unwrap().to_vec1().unwrap()
        })
        .collect();
    let mut caches: Vec<_> = pieces.iter().map(|p| cache_for(p.1)).collect();
    let tokens: Vec<&[u32]> = pieces.iter().map(|p| p.0.as_slice()).collect();
    let mut refs: Vec<&mut _> = caches.iter_mut().collect();
    let together = model.forward_prefill(&tokens, &mut refs).unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (i, l) in together.iter().enumerate() {
        let l: Vec<f32> = l.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(bits(&l), bits(&alone[i]), "piece {i}");
        assert_eq!(caches[i].len(), alone_caches[i].len());
    }
    // The caches continue alike: one decode step of each.
    for (i, (a, b)) in caches.iter_mut().zip(alone_caches.iter_mut()).enumerate() {
        let step = |c: &mut _| {
            let l = model.forward_decode(&[&[9u32]], &mut [c]).unwrap();
            bits(&l[0].flatten_all().unwrap().to_vec1::<f32>().unwrap())
        };
        assert_eq!(step(a), step(b), "piece {i} after its prefill");
    }
}
