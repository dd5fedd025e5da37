//! The model families besides llama (qwen2, qwen3, mistral, gemma3_text) against transformers: tiny random
//! checkpoints that transformers wrote, with its logits, log-probs, greedy tokens, rendered
//! chat template and one DPO gradient norm (`scripts/make_family_fixtures.py`, run by hand;
//! the fixtures are committed, so no Python is needed here). The inference engine, `serve`,
//! the trainable model and `dpo_train` each load them as they are.

mod common;
use common::model_util::one_thread;
use common::serve_util;

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use collabllm::engine::config::Family;
use collabllm::engine::llama::{LlamaConfig, WeightFormat};
use collabllm::engine::{ChatCodec, Engine, LoadOptions, LocalModelFiles};
use collabllm::llm::local::LocalBackend;
use collabllm::llm::{ChatMessage, ModelSpec};
use collabllm::train::dpo::loss::{dpo_loss, DpoConfig};
use collabllm::train::logps::{pair_logps, PairBatch, TokenizedPair};
use collabllm::train::model::TrainLlama;

const FAMILIES: [&str; 4] = ["qwen2", "qwen3", "mistral", "gemma3_text"];

fn dir(family: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/families")
        .join(family)
}

fn reference(family: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(dir(family).join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn floats(v: &serde_json::Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

fn chat(r: &serde_json::Value) -> Vec<ChatMessage> {
    r["chat"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
        .collect()
}

/// The largest |Δ| between the engine's next-token logits and transformers'.
fn max_logit_diff(got: &[f32], r: &serde_json::Value) -> f64 {
    let want = floats(&r["next_logits"]);
    assert_eq!(got.len(), want.len(), "vocabulary");
    got.iter()
        .zip(&want)
        .map(|(a, b)| (*a as f64 - b).abs())
        .fold(0.0, f64::max)
}

/// The trainable model's per-token log-probs of the reference sequence against
/// transformers', each within `tol` relative (absolute below 1).
fn check_token_logps(model: &TrainLlama, r: &serde_json::Value, tol: f64, what: &str) {
    let seq = ids(&r["ids"]);
    let logp = common::model_util::trainer_log_probs(model, &seq);
    for (t, want) in floats(&r["token_logps"]).iter().enumerate() {
        let got = logp[t][seq[t + 1] as usize];
        assert!(
            (got - want).abs() <= tol * want.abs().max(1.0),
            "{what}: token {} log-prob {got} vs {want}",
            t + 1
        );
    }
}

fn f32_engine(family: &str) -> Engine {
    let opts = LoadOptions {
        weights: WeightFormat::F32,
        ..LoadOptions::default()
    };
    Engine::load(&LocalModelFiles::HfDir(dir(family)), &opts).unwrap()
}

#[test]
fn configs_name_their_family() {
    for (name, family) in FAMILIES.iter().zip([
        Family::Qwen2,
        Family::Qwen3,
        Family::Mistral,
        Family::Gemma3,
    ]) {
        let cfg = LlamaConfig::from_hf_json(&dir(name).join("config.json")).unwrap();
        assert_eq!(cfg.family, family);
        assert_eq!(cfg.family.model_type(), *name);
    }
    let qwen3 = LlamaConfig::from_hf_json(&dir("qwen3").join("config.json")).unwrap();
    assert_eq!(
        qwen3.head_dim(),
        16,
        "Qwen3's head_dim is given, not hidden / heads"
    );
    // Gemma 3: five sliding-window layers, then a global one; each kind its own rope base;
    // the sliding layers attend within their window, which caps nothing.
    let gemma = LlamaConfig::from_hf_json(&dir("gemma3_text").join("config.json")).unwrap();
    let five_then_global: Vec<bool> = (0..6).map(|i| i < 5).collect();
    assert_eq!(gemma.sliding_layers, five_then_global);
    assert_eq!((gemma.rope_theta, gemma.local_rope_theta), (1e6, Some(1e4)));
    assert!(gemma.tie_word_embeddings);
    assert_eq!(
        (gemma.max_position_embeddings, gemma.context_length()),
        (256, 256)
    );
    let windows: Vec<Option<usize>> = (0..6).map(|i| gemma.attention_window(i)).collect();
    assert_eq!(
        windows,
        [Some(64), Some(64), Some(64), Some(64), Some(64), None]
    );
}

#[test]
fn engine_logits_match_transformers() {
    one_thread();
    for family in FAMILIES {
        let r = reference(family);
        let engine = f32_engine(family);
        let got = engine.next_token_logits(&ids(&r["ids"])).unwrap();
        let diff = max_logit_diff(&got, &r);
        assert!(
            diff < 1e-4,
            "{family}: max |Δlogit| {diff:e} vs transformers"
        );
    }
}

#[test]
fn chat_templates_render_as_transformers_does() {
    for family in FAMILIES {
        let r = reference(family);
        let codec = ChatCodec::load(&LocalModelFiles::HfDir(dir(family))).unwrap();
        assert_eq!(
            codec
                .encode(&codec.render(&chat(&r), true).unwrap())
                .unwrap(),
            ids(&r["chat_ids"]),
            "{family}: apply_chat_template(add_generation_prompt=True)"
        );
    }
}

/// Greedy decoding: the engine's argmax at each step gives transformers' tokens, and `serve`
/// (over HTTP, `--weights f32`) answers with their text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_gives_transformers_greedy_tokens() {
    one_thread();
    for family in FAMILIES {
        let r = reference(family);
        let want = ids(&r["greedy"]);
        let engine = f32_engine(family);
        let mut seq = ids(&r["chat_ids"]);
        for (step, &token) in want.iter().enumerate() {
            let logits = engine.next_token_logits(&seq).unwrap();
            let best = (0..logits.len())
                .max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a)))
                .unwrap() as u32;
            assert_eq!(best, token, "{family}: greedy step {step}");
            seq.push(best);
        }
        let text = engine.decode(&want).unwrap();
        drop(engine);

        let opts = LoadOptions {
            weights: WeightFormat::F32,
            ..LoadOptions::default()
        };
        let backend = LocalBackend::load(&ModelSpec::HfDir(dir(family)), &opts)
            .await
            .unwrap();
        let addr = serve_util::spawn_server(backend, family).await;
        let body = serde_json::json!({
            "model": family,
            "messages": r["chat"],
            "temperature": 0.0,
            "max_tokens": want.len(),
        });
        let (status, reply) = serve_util::post_raw(addr, body.to_string()).await;
        assert_eq!(status, 200, "{family}: {reply}");
        let reply: serde_json::Value = serde_json::from_str(&reply).unwrap();
        assert_eq!(
            reply["choices"][0]["message"]["content"].as_str().unwrap(),
            text,
            "{family}: serve's greedy reply"
        );
    }
}

/// The trainable model: per-token log-probs of a sequence and one DPO step's loss and global
/// gradient norm equal transformers' (float64 to 1e-4 relative; float32 to 1e-3).
#[test]
fn training_logps_and_dpo_gradients_match_transformers() {
    one_thread();
    let dev = Device::Cpu;
    for family in FAMILIES {
        let r = reference(family);
        for (dtype, tol) in [(DType::F64, 1e-4), (DType::F32, 1e-3)] {
            let what = format!("{family} {dtype:?}");
            let model = TrainLlama::from_hf_dir(&dir(family), dtype, &dev).unwrap();
            check_token_logps(&model, &r, tol, &what);

            let d = &r["dpo"];
            let pair = TokenizedPair {
                prompt: ids(&d["prompt"]),
                chosen: ids(&d["chosen"]),
                rejected: ids(&d["rejected"]),
            };
            let batch = PairBatch::new(&[pair], 0, &dev).unwrap();
            let (pc, pr) = pair_logps(&model, &batch, false).unwrap();
            let scalar = |t: &Tensor| t.to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap()[0];
            for (got, key) in [(&pc, "policy_chosen_logp"), (&pr, "policy_rejected_logp")] {
                let (got, want) = (scalar(got), d[key].as_f64().unwrap());
                assert!(
                    (got - want).abs() <= tol * want.abs().max(1.0),
                    "{what}: {key} {got} vs {want}"
                );
            }
            let num = |k: &str| {
                Tensor::new(&[d[k].as_f64().unwrap()], &dev)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap()
            };
            let cfg = DpoConfig {
                beta: d["beta"].as_f64().unwrap(),
                ..DpoConfig::default()
            };
            let out = dpo_loss(
                &pc,
                &pr,
                &num("ref_chosen_logp"),
                &num("ref_rejected_logp"),
                &cfg,
            )
            .unwrap();
            let want_loss = d["loss"].as_f64().unwrap();
            assert!(
                (out.metrics.loss - want_loss).abs() <= tol * want_loss,
                "{what}: loss {} vs {want_loss}",
                out.metrics.loss
            );
            let grads = out.loss.backward().unwrap();
            let mut total = 0f64;
            for (name, var) in model.named_vars() {
                let g = grads
                    .get(var.as_tensor())
                    .unwrap_or_else(|| panic!("{what}: no gradient for {name}"));
                let g = g.to_dtype(DType::F64).unwrap();
                total += g
                    .sqr()
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f64>()
                    .unwrap();
            }
            let (norm, want) = (total.sqrt(), d["total_grad_norm"].as_f64().unwrap());
            assert!(
                (norm - want).abs() <= tol * want,
                "{what}: gradient norm {norm} vs {want}"
            );
        }
    }
}

/// The families llama.cpp writes under their own GGUF architecture (qwen2, qwen3, gemma3;
/// Mistral is written as `llama`): the GGUF of the same weights gives transformers' logits in
/// the engine and its log-probs in the trainer, and its tokenizer and template (rebuilt from
/// the GGUF metadata: `tokenizer.ggml.pre` `qwen2`; Gemma's SentencePiece vocabulary, its
/// norms stored as 1 + w) transformers' chat ids.
#[test]
fn gguf_files_of_qwen_and_gemma_families_match_transformers() {
    one_thread();
    let dev = Device::Cpu;
    for family in ["qwen2", "qwen3", "gemma3_text"] {
        let r = reference(family);
        let path = dir(family).with_extension("gguf");
        let opts = LoadOptions {
            weights: WeightFormat::F32,
            ..LoadOptions::default()
        };
        let engine = Engine::load(&LocalModelFiles::Gguf(path.clone()), &opts).unwrap();
        assert_eq!(
            engine.encode_chat(&chat(&r)).unwrap(),
            ids(&r["chat_ids"]),
            "{family}: GGUF tokenizer and template"
        );
        let got = engine.next_token_logits(&ids(&r["ids"])).unwrap();
        let diff = max_logit_diff(&got, &r);
        assert!(diff < 1e-4, "{family} GGUF: max |Δlogit| {diff:e}");

        let model = TrainLlama::from_gguf(&path, DType::F64, &dev).unwrap();
        assert_eq!(model.config().family.model_type(), family);
        check_token_logps(&model, &r, 1e-6, &format!("{family} GGUF"));
    }
}

/// Gemma 3 past its sliding window (64 positions; 150 tokens): each sliding layer's query
/// reads only the 64 keys up to its own. The engine gives transformers' logits whether the
/// sequence arrives at once, as a prompt then one token at a time (the cache's decode path),
/// through the continuous-batching steps (a prefill then decode steps), or as two samples
/// forked from one prompt (the window starting inside their shared keys), from the HF folder
/// and from the GGUF; the trainer gives its log-probs over the sequence, and over a DPO pair
/// packed as one row (prompt of 100 tokens, completions past the window).
#[test]
fn gemma_sliding_window_layers_match_transformers_past_the_window() {
    one_thread();
    let r = reference("gemma3_text");
    let long = &r["past_window"];
    let seq = ids(&long["ids"]);
    let want = floats(&long["next_logits"]);
    let close = |got: &[f32], what: &str| {
        let d = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (*a as f64 - b).abs())
            .fold(0.0, f64::max);
        assert!(d < 1e-4, "{what}: max |Δlogit| {d:e} vs transformers");
    };
    let opts = LoadOptions {
        weights: WeightFormat::F32,
        ..LoadOptions::default()
    };
    let gguf = dir("gemma3_text").with_extension("gguf");
    for files in [
        LocalModelFiles::HfDir(dir("gemma3_text")),
        LocalModelFiles::Gguf(gguf),
    ] {
        let what = files.path().display().to_string();
        let engine = Engine::load(&files, &opts).unwrap();
        close(&engine.next_token_logits(&seq).unwrap(), &what);
        let m = engine.model();
        let dev = m.device().clone();
        // A prompt inside the window, then one token at a time past it.
        let mut cache = m.new_cache(seq.len());
        let row = |t: &[u32]| Tensor::new(t, &dev).unwrap().unsqueeze(0).unwrap();
        let mut last = m.forward_last(&row(&seq[..40]), &mut cache).unwrap();
        for i in 40..seq.len() {
            last = m.forward_last(&row(&seq[i..=i]), &mut cache).unwrap();
        }
        let got: Vec<f32> = last.squeeze(0).unwrap().to_vec1().unwrap();
        close(&got, &format!("{what}, decoded one token at a time"));
        // The scheduler's path: a prefill past the window, then decode steps.
        let mut cache = m.new_cache(seq.len());
        let mut out = m
            .forward_prefill(&[&seq[..100]], &mut [&mut cache])
            .unwrap();
        for i in 100..seq.len() {
            out = m.forward_decode(&[&seq[i..=i]], &mut [&mut cache]).unwrap();
        }
        let got: Vec<f32> = out[0].squeeze(0).unwrap().to_vec1().unwrap();
        close(&got, &format!("{what}, prefill and decode steps"));
        // Two samples forked from one prompt share its keys; the window starts inside them.
        let mut cache = m.new_cache(100);
        m.forward_prefill(&[&seq[..100]], &mut [&mut cache])
            .unwrap();
        let mut forked = cache.fork(2, seq.len() - 100).unwrap();
        for &token in &seq[100..] {
            out = m
                .forward_decode(&[&[token, token]], &mut [&mut forked])
                .unwrap();
        }
        for r in 0..2 {
            let got: Vec<f32> = out[0].get(r).unwrap().to_vec1().unwrap();
            close(&got, &format!("{what}, sample {r} of a forked prompt"));
        }
    }

    let dev = Device::Cpu;
    let model = TrainLlama::from_hf_dir(&dir("gemma3_text"), DType::F64, &dev).unwrap();
    let logp = common::model_util::trainer_log_probs(&model, &seq);
    for (t, want) in floats(&long["token_logps"]).iter().enumerate() {
        let got = logp[t][seq[t + 1] as usize];
        assert!(
            (got - want).abs() <= 1e-6 * want.abs().max(1.0),
            "trainer: token {} log-prob {got} vs {want}",
            t + 1
        );
    }
    let pair = TokenizedPair {
        prompt: ids(&long["prompt"]),
        chosen: ids(&long["chosen"]),
        rejected: ids(&long["rejected"]),
    };
    let batch = PairBatch::new(&[pair], 0, &dev).unwrap();
    let (pc, pr) = pair_logps(&model, &batch, false).unwrap();
    let scalar = |t: &Tensor| t.to_vec1::<f64>().unwrap()[0];
    for (got, key) in [(&pc, "policy_chosen_logp"), (&pr, "policy_rejected_logp")] {
        let (got, want) = (scalar(got), long[key].as_f64().unwrap());
        assert!(
            (got - want).abs() <= 1e-6 * want.abs(),
            "trainer, packed pair: {key} {got} vs {want}"
        );
    }
}

/// Gemma's SentencePiece tokenizer, from the HF folder's tokenizer.json and rebuilt from the
/// GGUF's vocabulary (merges from token order, byte fallback, spaces as `▁`, BOS added), encodes
/// raw text as transformers does: leading, doubled and trailing spaces, bytes of characters
/// outside the vocabulary, newlines, special tokens written out; and decodes back to the text.
#[test]
fn gemma_tokenizers_encode_raw_text_as_transformers_does() {
    let r = reference("gemma3_text");
    let opts = LoadOptions {
        weights: WeightFormat::F32,
        ..LoadOptions::default()
    };
    let hf = Engine::load(&LocalModelFiles::HfDir(dir("gemma3_text")), &opts).unwrap();
    let gguf_path = dir("gemma3_text").with_extension("gguf");
    let gguf = Engine::load(&LocalModelFiles::Gguf(gguf_path), &opts).unwrap();
    let cases = r["text_ids"].as_array().unwrap();
    assert!(cases.len() >= 6);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want = ids(&case["ids"]);
        for (what, engine) in [("tokenizer.json", &hf), ("GGUF", &gguf)] {
            assert_eq!(engine.encode_raw(text).unwrap(), want, "{what}: {text:?}");
            if !text.contains("<start_of_turn>") {
                assert_eq!(
                    engine.decode(&want[1..]).unwrap(),
                    text,
                    "{what}: decode {text:?}"
                );
            }
        }
    }
}

/// What the config reader refuses names the file and the field.
#[test]
fn unsupported_families_and_settings_are_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let base: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir("qwen2").join("config.json")).unwrap())
            .unwrap();
    let refused = |edit: &dyn Fn(&mut serde_json::Value)| -> String {
        let mut cfg = base.clone();
        edit(&mut cfg);
        let path = tmp.path().join("config.json");
        std::fs::write(&path, cfg.to_string()).unwrap();
        LlamaConfig::from_hf_json(&path).unwrap_err().to_string()
    };
    let e = refused(&|c| c["model_type"] = "gemma2".into());
    assert!(e.contains("model_type") && e.contains("gemma2"), "{e}");
    assert!(
        e.contains("qwen2, qwen3, mistral"),
        "names what is supported: {e}"
    );
    let e = refused(&|c| c["use_sliding_window"] = true.into());
    assert!(e.contains("use_sliding_window"), "{e}");
    let e =
        refused(&|c| c["layer_types"] = serde_json::json!(["full_attention", "sliding_attention"]));
    assert!(e.contains("layer_types"), "{e}");
    // Too short a list of (supported) layer types: every layer must be listed.
    let e = refused(&|c| c["layer_types"] = serde_json::json!(["full_attention"]));
    assert!(
        e.contains("layer_types") && e.contains("1 layer types for 2 layers"),
        "{e}"
    );
    let e = refused(&|c| {
        c["model_type"] = "qwen3".into();
        c["attention_bias"] = true.into();
    });
    assert!(e.contains("attention_bias"), "{e}");
    // Mistral's window caps the context: within it attention is full.
    let mut cfg = base.clone();
    cfg["model_type"] = "mistral".into();
    cfg["sliding_window"] = 100.into();
    let path = tmp.path().join("config.json");
    std::fs::write(&path, cfg.to_string()).unwrap();
    let c = LlamaConfig::from_hf_json(&path).unwrap();
    assert_eq!((c.max_position_embeddings, c.context_length()), (256, 100));
}

/// The Qwen2.5, Qwen3 and Gemma 3 chat templates, as the models ship them, render in the
/// crate's template engine exactly as transformers renders them
/// (`scripts/make_template_fixtures.py`): a system message or none (Gemma folds it into the
/// first user turn), multi-turn, Qwen3's reasoning trace dropped from earlier turns, with and
/// without the generation prompt.
#[test]
fn qwen_and_gemma_chat_templates_render_as_transformers_does() {
    use collabllm::engine::chat_template::ChatTemplate;
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/templates");
    let cases: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(root.join("cases.json")).unwrap()).unwrap();
    assert_eq!(cases.len(), 18);
    for case in cases {
        let name = case["template"].as_str().unwrap();
        let source = std::fs::read_to_string(root.join(name)).unwrap();
        let (bos, eos) = (
            case["bos_token"].as_str().unwrap(),
            case["eos_token"].as_str().unwrap(),
        );
        let template = ChatTemplate::new(&source, name, bos, eos).unwrap();
        let messages: Vec<ChatMessage> = case["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
            .collect();
        let gen = case["add_generation_prompt"].as_bool().unwrap();
        assert_eq!(
            template.render(&messages, gen).unwrap(),
            case["rendered"].as_str().unwrap(),
            "{name} {} (generation prompt: {gen})",
            case["conversation"]
        );
    }
}

/// A GGUF file whose special token ids lie outside its vocabulary (`eos_token_id` = 4e9) is
/// refused at load, naming the key, rather than loaded with an end-of-sequence that never
/// comes.
#[test]
fn a_gguf_special_token_outside_the_vocabulary_is_refused() {
    use candle_core::quantized::gguf_file::{self, Value};
    let src = dir("qwen2").with_extension("gguf");
    let mut reader = std::fs::File::open(&src).unwrap();
    let content = gguf_file::Content::read(&mut reader).unwrap();
    let tensors: Vec<(String, candle_core::quantized::QTensor)> = content
        .tensor_infos
        .keys()
        .map(|name| {
            let t = content.tensor(&mut reader, name, &Device::Cpu).unwrap();
            (name.clone(), t)
        })
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    let write = |key: &str, id: u32| -> PathBuf {
        let path = tmp.path().join(format!("{}.gguf", key.replace('.', "_")));
        let mut metadata: Vec<(&str, Value)> = content
            .metadata
            .iter()
            .filter(|(k, _)| k.as_str() != key)
            .map(|(k, v)| (k.as_str(), v.clone()))
            .collect();
        metadata.push((key, Value::U32(id)));
        let meta: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
        let ts: Vec<(&str, &candle_core::quantized::QTensor)> =
            tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
        let mut f = std::fs::File::create(&path).unwrap();
        gguf_file::write(&mut f, &meta, &ts).unwrap();
        path
    };
    // The file rewritten as it is loads (the rewrite itself changes nothing).
    let eos = content.metadata["tokenizer.ggml.eos_token_id"]
        .to_u32()
        .unwrap();
    ChatCodec::load(&LocalModelFiles::Gguf(write(
        "tokenizer.ggml.eos_token_id",
        eos,
    )))
    .unwrap();
    for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id"] {
        let bad = write(key, 4_000_000_000);
        let Err(err) = ChatCodec::load(&LocalModelFiles::Gguf(bad.clone())) else {
            panic!("{key} = 4e9 loaded");
        };
        let err = err.to_string();
        assert!(
            err.contains(key) && err.contains("not a token id") && err.contains("4000000000"),
            "{err}"
        );
        assert!(err.contains(&bad.display().to_string()), "{err}");
    }
}
