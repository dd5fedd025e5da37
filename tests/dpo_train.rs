//! `dpo_train` end to end on the tiny model: real parquet pairs in, logs / checkpoints /
//! adapters out; learning, LoRA save/reload/merge, resume, serve a checkpoint, tokenization
//! rules and bad input.

mod common;
use common::model_util;
use common::serve_util;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use collabllm::dataset::{write_pairs_parquet, PairRow};
use collabllm::engine::peft::{peft_tensor_name, AdapterConfig};
use collabllm::engine::tiny::TinySpec;
use collabllm::engine::ChatCodec;
use collabllm::llm::local::{LoadOptions, LocalBackend};
use collabllm::llm::spec::{resolve_local, LocalModelFiles};
use collabllm::llm::{ChatMessage, ModelSpec};
use collabllm::train::data::{
    drop_oldest_turn, tokenize_conversation, tokenize_pairs, tokenize_sft,
    tokenize_sft_conversations, TokenizeStats,
};
use collabllm::train::dpo::{train, TrainConfig};
use collabllm::train::model::TrainLlama;
use collabllm::train::settings::LoraOptions;
use model_util::*;

fn row(i: usize, prompt: Vec<ChatMessage>, chosen: &str, rejected: &str) -> PairRow {
    PairRow {
        prompt,
        chosen: vec![ChatMessage::assistant(chosen)],
        rejected: vec![ChatMessage::assistant(rejected)],
        score_chosen: 1.0,
        score_rejected: 0.0,
        conv_id: format!("c{i}"),
        turn_id: 0,
    }
}

/// A toy preference: always answer "yes" rather than "no!".
fn toy_rows() -> Vec<PairRow> {
    ["Is it?", "Can we go?", "Ok", "Sea is blue, right?"]
        .iter()
        .enumerate()
        .map(|(i, q)| row(i, vec![ChatMessage::user(*q)], "yes", "no!"))
        .collect()
}

struct Fixture {
    _guard: tempfile::TempDir,
    model: PathBuf,
    data: PathBuf,
    root: PathBuf,
}

fn fixture() -> Fixture {
    one_thread();
    let (guard, model) = tiny_model_dir(&TinySpec::default());
    let root = guard.path().to_path_buf();
    let data = root.join("pairs");
    std::fs::create_dir_all(&data).unwrap();
    write_pairs_parquet(&data.join("train.parquet"), &toy_rows()).unwrap();
    write_pairs_parquet(&data.join("test.parquet"), &toy_rows()[..2]).unwrap();
    Fixture {
        _guard: guard,
        model,
        data,
        root,
    }
}

fn config(f: &Fixture, out: &str) -> TrainConfig {
    let mut cfg = TrainConfig::new(
        f.data.clone(),
        &f.model.display().to_string(),
        f.root.join(out),
    );
    cfg.batch_size = 2;
    cfg.max_length = 128;
    cfg.optim.warmup_ratio = 0.0;
    cfg
}

/// LoRA of rank 4 (α 8) on every target: small enough for the tiny model's tests.
fn small_lora() -> Option<LoraOptions> {
    Some(LoraOptions {
        r: 4,
        alpha: 8.0,
        ..Default::default()
    })
}

fn logs(dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("logs.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn train_lines(dir: &Path) -> Vec<serde_json::Value> {
    logs(dir)
        .into_iter()
        .filter(|l| l.get("loss").is_some())
        .collect()
}

fn codec(model: &Path) -> ChatCodec {
    ChatCodec::load(&LocalModelFiles::HfDir(model.to_path_buf())).unwrap()
}

fn tokens_of(model: &TrainLlama, ids: &[u32]) -> Vec<Vec<f32>> {
    let t = Tensor::new(ids, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    model
        .forward(&t, None)
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec2()
        .unwrap()
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn dpo_learns_the_toy_preference_with_trl_metrics() {
    let f = fixture();
    let mut cfg = config(&f, "full");
    cfg.optim.lr = 1e-3;
    cfg.max_steps = Some(30);
    let summary = train(&cfg, false).unwrap();
    let lines = train_lines(&cfg.output);
    assert_eq!(lines.len(), 30);
    // Step 0 (measured before the first update): policy = reference.
    let first = &lines[0];
    assert!((first["loss"].as_f64().unwrap() - std::f64::consts::LN_2).abs() < 1e-4);
    assert_eq!(first["rewards/accuracies"].as_f64().unwrap(), 0.0);
    for key in [
        "loss",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "rewards/accuracies",
        "logps/chosen",
        "logps/rejected",
        "learning_rate",
        "grad_norm",
        "epoch",
        "step",
        "logits/chosen",
        "logits/rejected",
        "entropy",
        "mean_token_accuracy",
        "num_tokens",
    ] {
        assert!(first.get(key).is_some(), "log line lacks `{key}`: {first}");
    }
    // TRL's diagnostics: entropy within [0, ln V], token accuracy a fraction, num_tokens the
    // running count of the 2B rows' tokens (every pair of the toy set has the same length).
    let vocab = collabllm::engine::tiny::tiny_vocab_size() as f64;
    let per_step = first["num_tokens"].as_u64().unwrap();
    assert!(per_step > 0);
    for (i, l) in lines.iter().enumerate() {
        let h = l["entropy"].as_f64().unwrap();
        assert!(h > 0.0 && h <= vocab.ln() + 1e-9, "{l}");
        let acc = l["mean_token_accuracy"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&acc), "{l}");
        assert!(l["logits/chosen"].as_f64().unwrap().is_finite(), "{l}");
        assert!(l["logits/rejected"].as_f64().unwrap().is_finite(), "{l}");
        assert!(
            l["num_tokens"].as_u64().unwrap() > (i as u64) * per_step / 2,
            "{l}"
        );
    }
    assert!(lines[29]["num_tokens"].as_u64() > lines[28]["num_tokens"].as_u64());
    let last = lines.last().unwrap();
    // Learning "yes": the chosen completion becomes the arg-max; the rejected side's logits
    // move apart from the chosen side's.
    assert!(
        last["mean_token_accuracy"].as_f64().unwrap()
            > first["mean_token_accuracy"].as_f64().unwrap(),
        "{first}\n{last}"
    );
    assert!(last["rewards/accuracies"].as_f64().unwrap() > 0.9, "{last}");
    assert!(last["loss"].as_f64().unwrap() < 0.3, "{last}");
    // The evaluation split (test.parquet beside train.parquet) is evaluated at the end.
    let eval = summary.last_eval.expect("an eval line");
    assert!(eval["eval_rewards/accuracies"].as_f64().unwrap() > 0.9);
    // The final checkpoint is a complete HF model that chats.
    let out = cfg.output.join("final");
    for f in [
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(out.join(f).is_file(), "final/ lacks {f}");
    }
    // The reference cache lives in the run's own folder: a run never writes into its --data.
    let cache = summary.ref_cache.expect("a reference cache file");
    assert!(cache.starts_with(&cfg.output), "{}", cache.display());
    assert!(!f.data.join("ref_logps").exists());
}

#[test]
fn lora_learns_saves_reloads_and_merges() {
    let f = fixture();
    let mut cfg = config(&f, "lora");
    cfg.optim.lr = 1e-2;
    cfg.max_steps = Some(30);
    cfg.lora = Some(LoraOptions {
        r: 8,
        alpha: 16.0,
        ..Default::default()
    });
    cfg.merge = true;
    let summary = train(&cfg, false).unwrap();
    let lines = train_lines(&cfg.output);
    assert!((lines[0]["loss"].as_f64().unwrap() - std::f64::consts::LN_2).abs() < 1e-4);
    let last = lines.last().unwrap();
    assert!(last["rewards/accuracies"].as_f64().unwrap() > 0.9, "{last}");
    assert!(last["loss"].as_f64().unwrap() < lines[0]["loss"].as_f64().unwrap());
    // Only the adapters train: 2 layers × 7 modules × (A + B).
    // r·(in + out) per module: q 1024, k 768, v 768, o 1024, gate/up/down 1536 each.
    assert_eq!(
        summary.trainable_params,
        2 * 8192,
        "adapter parameter count"
    );

    let adapter_dir = cfg.output.join("final");
    let acfg = AdapterConfig::read(&adapter_dir).unwrap();
    assert_eq!((acfg.r, acfg.lora_alpha), (8, 16.0));
    assert_eq!(acfg.target_modules.len(), 7);
    let adapter =
        candle_core::safetensors::load(adapter_dir.join("adapter_model.safetensors"), &Device::Cpu)
            .unwrap();
    let a_name = peft_tensor_name(0, "q_proj", "A");
    assert_eq!(adapter[&a_name].dims(), &[8, 64]);

    // Reload: base + adapter loaded into a fresh LoRA model gives the trained logits, which
    // the merged export reproduces.
    let ids: Vec<u32> = "<|im_start|>user\nIs it?".bytes().map(u32::from).collect();
    let mut reloaded = TrainLlama::from_hf_dir(&f.model, DType::F32, &Device::Cpu).unwrap();
    reloaded.enable_lora(acfg.clone(), 7).unwrap();
    reloaded.load_trainable(&adapter).unwrap();
    let merged_dir = summary.merged_dir.expect("merged dir");
    let merged = TrainLlama::from_hf_dir(&merged_dir, DType::F32, &Device::Cpu).unwrap();
    let base = TrainLlama::from_hf_dir(&f.model, DType::F32, &Device::Cpu).unwrap();
    let (l_reload, l_merged, l_base) = (
        tokens_of(&reloaded, &ids),
        tokens_of(&merged, &ids),
        tokens_of(&base, &ids),
    );
    assert!(max_diff(&l_reload, &l_merged) < 1e-4);
    assert!(
        max_diff(&l_reload, &l_base) > 1e-2,
        "the adapter changed nothing"
    );
    // merged W = W + (α/r)·B·A, checked on one weight.
    let w = "model.layers.0.self_attn.q_proj.weight";
    let base_w = &base.hf_tensors().unwrap()[w];
    let merged_w = &merged.hf_tensors().unwrap()[w];
    let delta = adapter[&peft_tensor_name(0, "q_proj", "B")]
        .matmul(&adapter[&a_name])
        .unwrap();
    let expect = (base_w + (delta * 2.0).unwrap()).unwrap();
    let diff = (merged_w - expect)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(diff < 1e-6, "merged weight differs by {diff}");

    // The inference engine loads the adapter directory as a model spec (merged at load).
    let rt = tokio::runtime::Runtime::new().unwrap();
    let files = rt
        .block_on(resolve_local(&ModelSpec::HfDir(adapter_dir.clone())))
        .unwrap();
    assert!(matches!(files, LocalModelFiles::Adapter { .. }));
    let opts = LoadOptions {
        weights: collabllm::engine::llama::WeightFormat::F32,
        ..Default::default()
    };
    let engine = collabllm::engine::Engine::load(&files, &opts).unwrap();
    let next = engine.next_token_logits(&ids).unwrap();
    let want = l_merged.last().unwrap();
    let d = next
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(
        d < 1e-3,
        "engine logits differ from the merged model by {d}"
    );
}

/// A run killed before its first checkpoint resumes from step 0: the steps it logged are
/// played again, so their lines go first (one line per step, never two).
#[test]
fn resume_without_a_checkpoint_logs_each_step_once() {
    let f = fixture();
    let mut cfg = config(&f, "no-checkpoint");
    cfg.max_steps = Some(4);
    cfg.stop_after = Some(2);
    let err = train(&cfg, false).unwrap_err();
    assert!(err.to_string().contains("stopped after step 2"), "{err}");
    assert_eq!(train_lines(&cfg.output).len(), 2);
    assert!(!cfg.output.join("checkpoint-2").exists());
    cfg.stop_after = None;
    cfg.resume = true;
    let summary = train(&cfg, false).unwrap();
    assert_eq!(summary.resumed_from, None);
    let steps: Vec<u64> = train_lines(&cfg.output)
        .iter()
        .map(|l| l["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, vec![1, 2, 3, 4]);
}

/// The base model's identity (its weight files' fingerprint) is recorded in
/// training_args.json; `--resume` on weights replaced under the same path is refused by name
/// (the reference log-probs would otherwise be recomputed from the new weights), unless
/// `--resume-override model-sha256` accepts them.
#[test]
fn resume_refuses_a_base_whose_weights_changed_under_the_same_path() {
    let f = fixture();
    let model = f.root.join("base-model");
    std::fs::create_dir_all(&model).unwrap();
    for entry in std::fs::read_dir(&f.model).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, model.join(p.file_name().unwrap())).unwrap();
    }
    let mut cfg = config(&f, "changed-base");
    cfg.model = model.display().to_string();
    cfg.max_steps = Some(3);
    cfg.optim.save_steps = Some(1);
    cfg.stop_after = Some(1);
    train(&cfg, false).unwrap_err();
    let recorded = read_args(&cfg.output)["model_sha256"].clone();
    assert_eq!(recorded.as_str().map(str::len), Some(16), "{recorded}");
    let (_g, other) = tiny_model_dir(&TinySpec {
        seed: 99,
        ..TinySpec::default()
    });
    std::fs::copy(
        other.join("model.safetensors"),
        model.join("model.safetensors"),
    )
    .unwrap();
    cfg.stop_after = None;
    cfg.resume = true;
    let err = train(&cfg, false).unwrap_err().to_string();
    assert!(err.contains("--model-sha256 was"), "{err}");
    assert!(!cfg.output.join("final").exists());
    cfg.resume_override = vec!["model-sha256".into()];
    let summary = train(&cfg, false).unwrap();
    assert_eq!(summary.resumed_from, Some(1));
    assert_ne!(read_args(&cfg.output)["model_sha256"], recorded);
}

#[test]
fn resume_continues_with_the_same_state() {
    let f = fixture();
    let mut straight = config(&f, "straight");
    straight.optim.lr = 1e-3;
    straight.max_steps = Some(6);
    straight.optim.save_steps = Some(3);
    straight.batch_size = 1;
    straight.grad_accum = 2;
    train(&straight, false).unwrap();

    let mut crashed = straight.clone();
    crashed.output = f.root.join("crashed");
    crashed.stop_after = Some(3);
    let err = train(&crashed, false).unwrap_err();
    assert!(err.to_string().contains("stopped after step 3"), "{err}");
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(crashed.output.join("checkpoint-3/trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(state["global_step"], 3);
    // A fresh run refuses to overwrite it.
    crashed.stop_after = None;
    let refused = train(&crashed, false).unwrap_err().to_string();
    assert!(refused.contains("--resume"), "{refused}");
    crashed.resume = true;
    let summary = train(&crashed, false).unwrap();
    assert_eq!(summary.resumed_from, Some(3));

    // Same steps, same metrics, same weights and optimizer moments as the uninterrupted run.
    let (a, b) = (train_lines(&straight.output), train_lines(&crashed.output));
    assert_eq!(a.len(), 6);
    assert_eq!(b.len(), 6, "resumed logs: {b:?}");
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x["step"], y["step"]);
        for k in [
            "loss",
            "grad_norm",
            "learning_rate",
            "rewards/margins",
            "entropy",
            "num_tokens",
        ] {
            let (p, q) = (x[k].as_f64().unwrap(), y[k].as_f64().unwrap());
            assert!((p - q).abs() <= 1e-6 * p.abs().max(1.0), "{k}: {p} vs {q}");
        }
    }
    for file in ["model.safetensors", "optimizer.safetensors"] {
        let load = |dir: &Path| -> HashMap<String, Tensor> {
            candle_core::safetensors::load(dir.join("final").join(file), &Device::Cpu).unwrap()
        };
        let (ta, tb) = (load(&straight.output), load(&crashed.output));
        assert_eq!(ta.len(), tb.len());
        for (k, v) in &ta {
            let d = (v - &tb[k])
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(d < 1e-6, "{file} `{k}` differs by {d}");
        }
    }
}

/// A diverging run stops at the first non-finite loss or gradient norm, before applying
/// that update, with a message that says so; the checkpoints saved before stay intact and
/// no `final/` is written.
#[test]
fn divergence_stops_before_the_bad_update_and_keeps_the_last_checkpoint() {
    let f = fixture();
    let mut cfg = config(&f, "diverge");
    cfg.optim.lr = 1e30; // the first update throws every weight to about ±1e30
    cfg.max_steps = Some(6);
    cfg.optim.save_steps = Some(1);
    cfg.batch_size = 1;
    let err = train(&cfg, false).unwrap_err().to_string();
    assert!(err.contains("non-finite"), "{err}");
    assert!(err.contains("last good checkpoint"), "{err}");
    let step: usize = err
        .strip_prefix("step ")
        .and_then(|r| r.split(':').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no step in {err}"));
    assert!(step >= 2, "the first update is finite: {err}");
    // Every step before the bad one was logged and checkpointed; the bad one was not.
    assert_eq!(train_lines(&cfg.output).len(), step - 1);
    for done in 1..step {
        assert!(cfg
            .output
            .join(format!("checkpoint-{done}/trainer_state.json"))
            .is_file());
    }
    assert!(!cfg.output.join(format!("checkpoint-{step}")).exists());
    assert!(!cfg.output.join("final").exists());
}

#[test]
fn a_checkpoint_serves_chat_replies() {
    let f = fixture();
    let mut cfg = config(&f, "serve");
    cfg.max_steps = Some(1);
    train(&cfg, false).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let spec: ModelSpec = cfg
            .output
            .join("final")
            .display()
            .to_string()
            .parse()
            .unwrap();
        let backend = LocalBackend::load(&spec, &LoadOptions::default())
            .await
            .unwrap();
        let addr = serve_util::spawn_server(backend, "ckpt").await;
        let body = serde_json::json!({
            "model": "ckpt",
            "messages": [{"role": "user", "content": "Is it?"}],
            "max_tokens": 4,
            "temperature": 0.0
        });
        let (status, text) = serve_util::post_raw(addr, body.to_string()).await;
        assert_eq!(status, 200, "{text}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert!(v["choices"][0]["message"]["content"].is_string(), "{v}");
    });
}

#[test]
fn sft_mode_trains_on_assistant_tokens_only() {
    let f = fixture();
    let mut cfg = config(&f, "sft");
    cfg.loss = "sft".into();
    cfg.optim.lr = 1e-3;
    cfg.max_steps = Some(20);
    train(&cfg, false).unwrap();
    let lines = train_lines(&cfg.output);
    let (first, last) = (
        lines[0]["loss"].as_f64().unwrap(),
        lines.last().unwrap()["loss"].as_f64().unwrap(),
    );
    assert!(last < 0.5 * first, "SFT loss {first} → {last}");
    assert!(lines[0].get("rewards/accuracies").is_none());

    // The loss mask covers exactly the assistant message and its end-of-turn token.
    let c = codec(&f.model);
    let conv = vec![
        ChatMessage::user("Hi"),
        ChatMessage::assistant("Hello!"),
        ChatMessage::user("Bye"),
        ChatMessage::assistant("Ciao"),
    ];
    let seq = tokenize_conversation(&c, &conv).unwrap();
    let masked: Vec<u32> = seq
        .ids
        .iter()
        .zip(&seq.loss_mask)
        .filter(|(_, &m)| m)
        .map(|(&t, _)| t)
        .collect();
    let text = c.tokenizer.decode(&masked, false).unwrap();
    assert_eq!(text, "Hello!<|im_end|>\nCiao<|im_end|>\n");

    // From a pair row (prompt + chosen) only the chosen reply trains: the prompt's assistant
    // turn is context (a DAgger state holds the model's own earlier questions).
    let pair = row(0, conv[..3].to_vec(), "Ciao", "no");
    let (seqs, _) = tokenize_sft(&c, &[pair], 128, Path::new("pairs.parquet")).unwrap();
    let masked: Vec<u32> = seqs[0]
        .ids
        .iter()
        .zip(&seqs[0].loss_mask)
        .filter(|(_, &m)| m)
        .map(|(&t, _)| t)
        .collect();
    assert_eq!(
        c.tokenizer.decode(&masked, false).unwrap(),
        "Ciao<|im_end|>\n"
    );
}

/// `--loss sft --data RUN`: the run's `sft.parquet` (whole conversations), not its pairs;
/// `--sft-min-score` keeps the conversations whose closing reply scored at least that.
#[test]
fn sft_from_a_run_directory_trains_on_its_conversations_above_the_bound() {
    use collabllm::dataset::sft::{write_sft_parquet, SftRow};
    let f = fixture();
    let run = f.root.join("run");
    std::fs::create_dir_all(run.join("pairs")).unwrap();
    write_pairs_parquet(&run.join("pairs/train.parquet"), &toy_rows()).unwrap();
    let conv = |i: usize, score: f64| SftRow {
        messages: vec![
            ChatMessage::user(format!("Question {i}?")),
            ChatMessage::assistant("Which part?"),
            ChatMessage::user("The first."),
            ChatMessage::assistant(format!("Answer {i}.")),
        ],
        conv_id: format!("c{i}"),
        score,
    };
    write_sft_parquet(
        &run.join("sft.parquet"),
        &[conv(0, 0.9), conv(1, 0.1), conv(2, f64::NAN)],
    )
    .unwrap();
    let steps = |out: &str, min: Option<f64>| {
        let mut cfg = config(&f, out);
        cfg.data = run.clone();
        cfg.loss = "sft".into();
        cfg.batch_size = 1;
        cfg.sft_min_score = min;
        train(&cfg, false).unwrap();
        train_lines(&cfg.output).len()
    };
    // One optimizer step per conversation (batch 1, one epoch): 3 conversations, not the
    // 4 pairs; with the bound only the one that scored 0.9.
    assert_eq!(steps("sft-all", None), 3);
    assert_eq!(steps("sft-min", Some(0.5)), 1);
}

/// A reply far longer than --max-length is dropped as too long from its byte count, before
/// it is rendered and tokenized (a 1 GB reply cost 16 GiB and an abort).
#[test]
fn huge_replies_are_dropped_before_tokenizing() {
    one_thread();
    let (_g, model) = tiny_model_dir(&TinySpec::default());
    let c = codec(&model);
    let path = Path::new("pairs.parquet");
    let huge = "many words ".repeat(6 << 20);
    let prompt = vec![ChatMessage::user("Hi.")];
    let rows = vec![
        row(0, prompt.clone(), &huge, "no"),
        row(1, prompt.clone(), "yes", &huge),
        row(2, prompt.clone(), "yes", "no"),
    ];
    let started = std::time::Instant::now();
    let (pairs, stats) = tokenize_pairs(&c, &rows, 128, path).unwrap();
    assert_eq!((pairs.len(), stats.dropped_too_long), (1, 2));
    let (seqs, stats) = tokenize_sft(&c, &rows, 128, path).unwrap();
    assert_eq!((seqs.len(), stats.dropped_too_long), (2, 1));
    let convs = vec![
        vec![
            ChatMessage::user(huge.clone()),
            ChatMessage::assistant("ok"),
        ],
        vec![ChatMessage::user("Hi."), ChatMessage::assistant("ok")],
    ];
    let (seqs, stats) = tokenize_sft_conversations(&c, &convs, 128, path).unwrap();
    assert_eq!((seqs.len(), stats.dropped_too_long), (1, 1));
    assert!(
        started.elapsed().as_secs_f64() < 3.0,
        "{:?}: the huge rows were tokenized",
        started.elapsed()
    );
}

#[test]
fn tokenization_checks_prefix_eos_and_truncates_whole_turns() {
    one_thread();
    let (_g, model) = tiny_model_dir(&TinySpec::default());
    let c = codec(&model);
    let path = Path::new("pairs.parquet");
    let im_end = c.tokenizer.token_to_id("<|im_end|>").unwrap();

    // No duplicate EOS: the completion holds the template's one end-of-turn token.
    let (pairs, _) = tokenize_pairs(&c, &toy_rows(), 128, path).unwrap();
    for p in &pairs {
        assert_eq!(p.chosen.iter().filter(|&&t| t == im_end).count(), 1);
        assert_eq!(p.rejected.iter().filter(|&&t| t == im_end).count(), 1);
        assert_eq!(
            c.tokenizer.decode(&p.chosen, false).unwrap(),
            "yes<|im_end|>\n"
        );
    }

    // Long histories lose their oldest whole turns after the opening: the system message and
    // the first user message (a game's rules) stay, and so does the last user message.
    let history = vec![
        ChatMessage::system("Sys."),
        ChatMessage::user("Rules."),
        ChatMessage::assistant("b".repeat(40)),
        ChatMessage::user("c".repeat(40)),
        ChatMessage::assistant("Second reply."),
        ChatMessage::user("Last question?"),
    ];
    let kept = |ix: &[usize]| ix.iter().map(|&i| history[i].clone()).collect::<Vec<_>>();
    assert_eq!(drop_oldest_turn(&history).unwrap(), kept(&[0, 1, 4, 5]));
    assert_eq!(drop_oldest_turn(&kept(&[0, 1, 4, 5])), None);
    assert_eq!(drop_oldest_turn(&history[1..]).unwrap(), kept(&[1, 4, 5]));
    // A conversation ending with the assistant (SFT) keeps its last reply.
    assert_eq!(drop_oldest_turn(&history[..5]).unwrap(), kept(&[0, 1, 4]));
    assert!(drop_oldest_turn(&history[..2]).is_none());
    let long = row(0, history.clone(), "yes", "no!");
    let short_prompt = c
        .encode(&c.render(&kept(&[0, 1, 4, 5]), true).unwrap())
        .unwrap();
    let (pairs, stats) = tokenize_pairs(
        &c,
        std::slice::from_ref(&long),
        short_prompt.len() + 8,
        path,
    )
    .unwrap();
    assert_eq!(pairs[0].prompt, short_prompt);
    assert_eq!(
        stats,
        TokenizeStats {
            rows: 1,
            kept: 1,
            truncated: 1,
            dropped_too_long: 0,
            tokens: pairs[0].prompt.len() + pairs[0].chosen.len() + pairs[0].rejected.len(),
        }
    );
    // Still too long with only the last turn: dropped and counted, never cut.
    let (pairs, stats) = tokenize_pairs(&c, &[long], 10, path).unwrap();
    assert!(pairs.is_empty());
    assert_eq!(stats.dropped_too_long, 1);

    // A template whose generation prompt is not a prefix of the rendered reply → hard error.
    let bad = ChatCodec {
        tokenizer: c.tokenizer.clone(),
        template: collabllm::engine::chat_template::ChatTemplate::new(
            "{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}<|im_start|>{% endif %}",
            "bad-template",
            "",
            "",
        )
        .unwrap(),
        eos_ids: vec![im_end],
        special_tokens: Default::default(),
    };
    let err = tokenize_pairs(&bad, &toy_rows(), 128, path)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("not a prefix") && err.contains("row 0"),
        "{err}"
    );
}

#[test]
fn bad_input_gives_clear_errors() {
    let f = fixture();
    // A parquet without `chosen`.
    let no_chosen = f.root.join("no_chosen.parquet");
    {
        use arrow::array::{ArrayRef, StringArray};
        use arrow::record_batch::RecordBatch;
        let col: ArrayRef = std::sync::Arc::new(StringArray::from(vec!["q"]));
        let batch =
            RecordBatch::try_from_iter([("prompt", col.clone()), ("rejected", col)]).unwrap();
        let file = std::fs::File::create(&no_chosen).unwrap();
        let mut w = parquet::arrow::ArrowWriter::try_new(file, batch.schema(), None).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
    }
    let mut cfg = config(&f, "bad1");
    cfg.data = no_chosen.clone();
    let err = format!("{:#}", train(&cfg, false).unwrap_err());
    assert!(
        err.contains("chosen") && err.contains("no_chosen.parquet"),
        "{err}"
    );

    // An empty dataset.
    let empty = f.root.join("empty.parquet");
    write_pairs_parquet(&empty, &[]).unwrap();
    let mut cfg = config(&f, "bad2");
    cfg.data = empty;
    let err = format!("{:#}", train(&cfg, false).unwrap_err());
    assert!(err.contains("empty"), "{err}");

    // A model path that does not exist.
    let mut cfg = config(&f, "bad3");
    cfg.model = f.root.join("nope").join("model.gguf").display().to_string();
    let err = format!("{:#}", train(&cfg, false).unwrap_err());
    assert!(
        err.contains("nope") && err.contains("does not exist"),
        "{err}"
    );

    // Nonsense settings are refused before any work.
    let mut cfg = config(&f, "bad4");
    cfg.loss = "kto".into();
    let err = format!("{:#}", train(&cfg, false).unwrap_err());
    assert!(err.contains("kto"), "{err}");
}

fn dpo_train_bin(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_dpo_train"))
        .args(args)
        .env("RUST_LOG", "warn")
        .env("CANDLE_NUM_THREADS", "1")
        .output()
        .expect("running dpo_train")
}

/// Every number is checked at start-up: the error names the flag and the value and says
/// what is valid; no value reaches a panic (exit 101) or a silently damaged run.
#[test]
fn out_of_range_flags_are_refused_naming_flag_and_value() {
    let f = fixture();
    let data = f.data.to_str().unwrap().to_string();
    let model = f.model.to_str().unwrap().to_string();
    let out = f.root.join("flags");
    let out_s = out.to_str().unwrap().to_string();
    for (flag, value, needle) in [
        (
            "--weight-decay",
            "NaN",
            "--weight-decay NaN: must be a finite number >= 0",
        ),
        (
            "--max-grad-norm",
            "-1",
            "--max-grad-norm -1.0: must be a finite number >= 0",
        ),
        (
            "--max-grad-norm",
            "NaN",
            "--max-grad-norm NaN: must be a finite number >= 0",
        ),
        ("--lr", "inf", "--lr inf: must be a finite number > 0"),
        ("--beta", "0", "--beta 0.0: must be a finite number > 0"),
        (
            "--label-smoothing",
            "0.5",
            "--label-smoothing 0.5: must be a finite number in [0, 0.5)",
        ),
        (
            "--sft-weight",
            "-0.1",
            "--sft-weight -0.1: must be a finite number >= 0",
        ),
        (
            "--warmup-ratio",
            "NaN",
            "--warmup-ratio NaN: must be a finite number in [0, 1)",
        ),
        ("--save-steps", "0", "--save-steps 0: must be at least 1"),
        ("--eval-steps", "0", "--eval-steps 0: must be at least 1"),
        (
            "--logging-steps",
            "0",
            "--logging-steps 0: must be at least 1",
        ),
        (
            "--batch-tokens",
            "0",
            "--batch-tokens 0: must be at least 1",
        ),
    ] {
        let o = dpo_train_bin(&[
            "--data",
            &data,
            "--model",
            &model,
            "--output",
            &out_s,
            "--max-length",
            "128",
            "--max-steps",
            "2",
            flag,
            value,
        ]);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{flag} {value}: {stderr}");
        assert!(stderr.contains(needle), "{flag} {value}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(!out.join("final").exists(), "{flag} {value} trained");
    }
    for (flag, value, needle) in [
        (
            "--lora-alpha",
            "inf",
            "--lora-alpha inf: must be a finite number > 0",
        ),
        (
            "--lora-dropout",
            "1",
            "--lora-dropout 1.0: must be a finite number in [0, 1)",
        ),
    ] {
        let o = dpo_train_bin(&[
            "--data", &data, "--model", &model, "--output", &out_s, "--lora", flag, value,
        ]);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{flag} {value}: {stderr}");
        assert!(stderr.contains(needle), "{flag} {value}: {stderr}");
    }
    let o = dpo_train_bin(&["--data", &data, "--output", &out_s, "--threads", "0"]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("'0' for '--threads <N>'"), "{stderr}");
}

/// `--batch-tokens` matches arms whose pairs differ in length: the same steps read about the
/// same tokens, where a fixed `--batch-size` reads three times as many from the long pairs.
#[test]
fn batch_tokens_match_arms_whose_pairs_differ_in_length() {
    let f = fixture();
    let words = |w: &str, n: usize| vec![w; n].join(" ");
    let rows = |reply_words: usize| -> Vec<PairRow> {
        (0..24)
            .map(|i| {
                let q = format!("Question {i}?");
                let (c, r) = (words("yes", reply_words), words("no", reply_words));
                row(i, vec![ChatMessage::user(q)], &c, &r)
            })
            .collect()
    };
    let run = |name: &str, reply_words: usize, batch_tokens: Option<usize>| -> Vec<f64> {
        let data = f.root.join(format!("{name}-pairs"));
        std::fs::create_dir_all(&data).unwrap();
        write_pairs_parquet(&data.join("train.parquet"), &rows(reply_words)).unwrap();
        let mut cfg = config(&f, name);
        cfg.data = data;
        cfg.eval_data = None;
        cfg.max_steps = Some(3);
        cfg.max_length = 1024;
        cfg.logging_steps = 1;
        cfg.batch_size = if batch_tokens.is_some() { 1 } else { 2 };
        cfg.batch_tokens = batch_tokens;
        train(&cfg, false).unwrap();
        let seen: Vec<f64> = train_lines(&cfg.output)
            .iter()
            .map(|l| l["num_tokens"].as_f64().unwrap())
            .collect();
        // `num_tokens` counts from the start of the run: each step's own is the difference.
        std::iter::once(seen[0])
            .chain(seen.windows(2).map(|w| w[1] - w[0]))
            .collect()
    };
    let total = |steps: &[f64]| steps.iter().sum::<f64>();
    let (short, long) = (run("short", 1, None), run("long", 30, None));
    assert!(total(&long) > 2.0 * total(&short), "{short:?} vs {long:?}");

    // Two long pairs a step, or many short ones.
    let target = (total(&long) / 3.0).round() as usize;
    let (short, long) = (
        run("short-t", 1, Some(target)),
        run("long-t", 30, Some(target)),
    );
    for step in short.iter().chain(&long) {
        assert!(
            (step - target as f64).abs() < 0.5 * target as f64,
            "{step} per step"
        );
    }
    let ratio = total(&long) / total(&short);
    assert!((0.8..1.25).contains(&ratio), "{short:?} vs {long:?}");
    // The recorded setting is what `--resume` compares.
    assert_eq!(read_args(&f.root.join("long-t"))["batch_tokens"], target);
}

/// `--max-grad-norm 0` is documented as "off": the update is the unclipped one (before, a
/// zero clip threshold scaled every gradient to 0 and training silently did nothing).
#[test]
fn max_grad_norm_zero_turns_clipping_off() {
    let f = fixture();
    let run = |name: &str, max_norm: f64| {
        let mut cfg = config(&f, name);
        cfg.optim.lr = 1e-3;
        cfg.max_steps = Some(2);
        cfg.optim.max_grad_norm = max_norm;
        train(&cfg, false).unwrap();
        train_lines(&cfg.output)
    };
    let off = run("clip_off", 0.0);
    let huge = run("clip_huge", 1e12);
    for (a, b) in off.iter().zip(&huge) {
        for k in ["loss", "grad_norm"] {
            let (p, q) = (a[k].as_f64().unwrap(), b[k].as_f64().unwrap());
            assert!((p - q).abs() <= 1e-6 * p.abs().max(1.0), "{k}: {p} vs {q}");
        }
    }
    // The second step saw updated weights.
    assert_ne!(off[0]["loss"], off[1]["loss"]);
}

/// An update that overflows the weights (finite loss and gradient, infinite step) stops the
/// run at that step, before any checkpoint holds the damaged weights.
#[test]
fn a_non_finite_weight_stops_the_run_before_any_save() {
    let f = fixture();
    let mut cfg = config(&f, "overflow");
    // lr / (1 - β1) overflows f32: the first update makes every touched weight ±inf or NaN
    // while the loss and gradient norm of step 1 are finite.
    cfg.optim.lr = 1e39;
    cfg.max_steps = Some(3);
    cfg.optim.save_steps = Some(1);
    cfg.batch_size = 1;
    let err = train(&cfg, false).unwrap_err().to_string();
    assert!(err.starts_with("step 1:"), "{err}");
    assert!(err.contains("non-finite"), "{err}");
    assert!(
        !cfg.output.join("checkpoint-1").exists(),
        "a damaged checkpoint was saved"
    );
    assert!(!cfg.output.join("final").exists());
}

fn read_args(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("training_args.json")).unwrap()).unwrap()
}

/// A run of 4 steps (a checkpoint each) stopped after step 2, as if killed; returned set to
/// `--resume` it.
fn stopped_after_two_steps(f: &Fixture, out: &str) -> TrainConfig {
    let mut cfg = config(f, out);
    cfg.max_steps = Some(4);
    cfg.optim.save_steps = Some(1);
    cfg.batch_size = 1;
    cfg.stop_after = Some(2);
    train(&cfg, false).unwrap_err();
    cfg.stop_after = None;
    cfg.resume = true;
    cfg
}

/// A checkpoint whose file changed after it was saved (a flipped byte) is refused on
/// `--resume`, naming the file, instead of training on from corrupt weights.
#[test]
fn resume_refuses_a_checkpoint_with_a_flipped_byte() {
    let f = fixture();
    let cfg = stopped_after_two_steps(&f, "flipped");
    let weights = cfg.output.join("checkpoint-2/model.safetensors");
    assert!(cfg.output.join("checkpoint-2/checksums.json").is_file());
    let mut bytes = std::fs::read(&weights).unwrap();
    let last = bytes.len() - 3;
    bytes[last] ^= 0x10;
    std::fs::write(&weights, bytes).unwrap();
    let err = format!("{:#}", train(&cfg, false).unwrap_err());
    assert!(
        err.contains("checkpoint-2/model.safetensors") && err.contains("SHA-256"),
        "{err}"
    );
    // Nor is a new run trained from it.
    let mut from = config(&f, "from-flipped");
    from.model = cfg.output.join("checkpoint-2").display().to_string();
    from.max_steps = Some(1);
    let err = format!("{:#}", train(&from, false).unwrap_err());
    assert!(err.contains("SHA-256"), "{err}");
}

/// `--resume` on a data file whose content changed under the same path is refused by name
/// (its SHA-256 is recorded); `--resume-override data-sha256` accepts it.
#[test]
fn resume_refuses_data_that_changed_under_the_same_path() {
    let f = fixture();
    let mut cfg = stopped_after_two_steps(&f, "hashed");
    let mut rows = toy_rows();
    rows.reverse();
    write_pairs_parquet(&f.data.join("train.parquet"), &rows).unwrap();
    let err = format!("{:#}", train(&cfg, false).unwrap_err());
    assert!(err.contains("--data-sha256 was"), "{err}");
    cfg.resume_override = vec!["data-sha256".into()];
    assert_eq!(train(&cfg, false).unwrap().resumed_from, Some(2));
}

/// `--resume` with settings that change the run's math is refused, naming each one with both
/// values, and leaves the run untouched; `--resume-override` allows the named ones and
/// records them.
#[test]
fn resume_refuses_changed_settings_unless_overridden() {
    let f = fixture();
    let mut cfg = config(&f, "changed");
    cfg.optim.lr = 1e-3;
    cfg.max_steps = Some(4);
    cfg.optim.save_steps = Some(1);
    cfg.batch_size = 1;
    cfg.stop_after = Some(2);
    train(&cfg, false).unwrap_err();
    cfg.stop_after = None;
    cfg.resume = true;
    let args_before = std::fs::read(cfg.output.join("training_args.json")).unwrap();
    let logs_before = std::fs::read(cfg.output.join("logs.jsonl")).unwrap();

    let mut changed = cfg.clone();
    changed.optim.lr = 2e-3;
    changed.beta = 0.2;
    changed.data = f.data.join("train.parquet");
    let err = format!("{:#}", train(&changed, false).unwrap_err());
    for needle in [
        "--lr was 0.001, now 0.002",
        "--beta was 0.1, now 0.2",
        "--data was",
        "train.parquet",
        "--resume-override data,beta,lr",
    ] {
        assert!(err.contains(needle), "lacks {needle:?}: {err}");
    }
    assert_eq!(
        std::fs::read(cfg.output.join("training_args.json")).unwrap(),
        args_before
    );
    assert_eq!(
        std::fs::read(cfg.output.join("logs.jsonl")).unwrap(),
        logs_before
    );

    // Overriding only some of them still refuses the others.
    changed.resume_override = vec!["lr".into()];
    let err = format!("{:#}", train(&changed, false).unwrap_err());
    assert!(err.contains("--beta") && !err.contains("--lr was"), "{err}");

    // Settings outside the run's math (logging, saving, device) may change freely.
    let mut harmless = cfg.clone();
    harmless.logging_steps = 2;
    harmless.eval_steps = Some(3);
    harmless.stop_after = Some(3);
    let err = train(&harmless, false).unwrap_err().to_string();
    assert!(err.contains("stopped after step 3"), "{err}");

    changed.resume_override = vec!["lr".into(), "beta".into(), "data".into()];
    let summary = train(&changed, false).unwrap();
    assert_eq!(summary.resumed_from, Some(3));
    let recorded = read_args(&cfg.output);
    assert_eq!(recorded["lr"], 2e-3);
    let history = recorded["resume_overrides"].as_array().unwrap();
    let settings: Vec<&str> = history
        .iter()
        .map(|h| h["setting"].as_str().unwrap())
        .collect();
    assert_eq!(settings, ["data", "beta", "lr"]);
    let lr = &history[2];
    assert_eq!(
        (
            lr["step"].clone(),
            lr["previous"].clone(),
            lr["now"].clone()
        ),
        (3.into(), 1e-3.into(), 2e-3.into())
    );
    // The final checkpoint records the same history.
    assert_eq!(
        read_args(&cfg.output.join("final"))["resume_overrides"],
        recorded["resume_overrides"]
    );

    // An unknown name is refused before any work.
    let mut typo = cfg.clone();
    typo.output = f.root.join("typo");
    typo.resume_override = vec!["learning_rate".into()];
    let err = train(&typo, false).unwrap_err().to_string();
    assert!(err.contains("--resume-override learning_rate"), "{err}");
}

/// Each model family besides llama (tiny checkpoints transformers wrote) trains two steps,
/// full and with LoRA: the checkpoint states the family and loads in the trainer and the
/// engine with the same logits; the adapter loads in the engine (merged at load) as the
/// trainer's base + adapter.
#[test]
fn every_model_family_trains_full_and_lora() {
    let f = fixture();
    let dev = Device::Cpu;
    for family in ["qwen2", "qwen3", "mistral", "gemma3_text"] {
        let model = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/families")
            .join(family);
        let ids: Vec<u32> = "<|im_start|>user\nIs it?".bytes().map(u32::from).collect();
        let engine_logits = |files: LocalModelFiles| -> Vec<f32> {
            let opts = LoadOptions {
                weights: collabllm::engine::llama::WeightFormat::F32,
                ..Default::default()
            };
            let engine = collabllm::engine::Engine::load(&files, &opts).unwrap();
            engine.next_token_logits(&ids).unwrap()
        };
        let base = TrainLlama::from_hf_dir(&model, DType::F32, &dev).unwrap();

        let mut cfg = config(&f, &format!("{family}-full"));
        cfg.model = model.display().to_string();
        cfg.max_steps = Some(2);
        cfg.optim.lr = 1e-2;
        if family == "gemma3_text" {
            // A --max-length past the model's positions is refused before any data is read.
            cfg.max_length = 1024;
            let err = train(&cfg, false).unwrap_err().to_string();
            assert!(
                err.contains("--max-length 1024") && err.contains("context of 256 positions"),
                "{err}"
            );
            cfg.max_length = 128;
        }
        train(&cfg, false).unwrap();
        let full = cfg.output.join("final");
        let written: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(full.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(written["model_type"], family, "{family}: config.json");
        let trained = TrainLlama::from_hf_dir(&full, DType::F32, &dev).unwrap();
        let t = tokens_of(&trained, &ids);
        assert!(
            max_diff(&t, &tokens_of(&base, &ids)) > 1e-3,
            "{family}: nothing trained"
        );
        let e = engine_logits(LocalModelFiles::HfDir(full.clone()));
        let d = max_diff(&[e], &t[t.len() - 1..]);
        assert!(
            d < 1e-4,
            "{family}: engine vs trainer on the checkpoint: {d}"
        );

        let mut cfg = config(&f, &format!("{family}-lora"));
        cfg.model = model.display().to_string();
        cfg.max_steps = Some(2);
        cfg.optim.lr = 1e-2;
        cfg.lora = small_lora();
        train(&cfg, false).unwrap();
        let adapter_dir = cfg.output.join("final");
        let acfg = AdapterConfig::read(&adapter_dir).unwrap();
        let adapter =
            candle_core::safetensors::load(adapter_dir.join("adapter_model.safetensors"), &dev)
                .unwrap();
        let mut reloaded = TrainLlama::from_hf_dir(&model, DType::F32, &dev).unwrap();
        reloaded.enable_lora(acfg, 7).unwrap();
        reloaded.load_trainable(&adapter).unwrap();
        let r = tokens_of(&reloaded, &ids);
        assert!(
            max_diff(&r, &tokens_of(&base, &ids)) > 1e-3,
            "{family}: adapter is a no-op"
        );
        let files = tokio::runtime::Runtime::new()
            .unwrap()
            .block_on(resolve_local(&ModelSpec::HfDir(adapter_dir)))
            .unwrap();
        let e = engine_logits(files);
        let d = max_diff(&[e], &r[r.len() - 1..]);
        assert!(d < 1e-4, "{family}: engine on the adapter vs trainer: {d}");
    }
}

/// Checkpoints keep the float type the base came in (a bf16 base is saved in bf16, stated in
/// config.json) unless `save_dtype` says otherwise.
#[test]
fn checkpoints_keep_the_base_dtype_unless_told() {
    let f = fixture();
    let bf16 = f.root.join("tiny-bf16");
    std::fs::create_dir_all(&bf16).unwrap();
    for entry in std::fs::read_dir(&f.model).unwrap() {
        let p = entry.unwrap().path();
        if p.extension().is_some_and(|e| e != "safetensors") {
            std::fs::copy(&p, bf16.join(p.file_name().unwrap())).unwrap();
        }
    }
    let tensors: HashMap<String, Tensor> =
        candle_core::safetensors::load(f.model.join("model.safetensors"), &Device::Cpu)
            .unwrap()
            .into_iter()
            .map(|(k, v)| (k, v.to_dtype(DType::BF16).unwrap()))
            .collect();
    collabllm::engine::weights::save_safetensors(&tensors, &bf16.join("model.safetensors"))
        .unwrap();
    for (save, want, name) in [
        ("auto", DType::BF16, "bfloat16"),
        ("f32", DType::F32, "float32"),
    ] {
        let mut cfg = config(&f, &format!("save-{save}"));
        cfg.model = bf16.display().to_string();
        cfg.max_steps = Some(1);
        cfg.save_dtype = save.into();
        train(&cfg, false).unwrap();
        let fin = cfg.output.join("final");
        let saved =
            candle_core::safetensors::load(fin.join("model.safetensors"), &Device::Cpu).unwrap();
        let dtypes: std::collections::BTreeSet<String> =
            saved.values().map(|t| format!("{:?}", t.dtype())).collect();
        assert!(
            saved.values().all(|t| t.dtype() == want),
            "--save-dtype {save}: {dtypes:?}"
        );
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fin.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(config["torch_dtype"], name);
        assert_eq!(config["dtype"], name);
    }
}

/// A weight beyond f16's range (1e6 in a row of the embedding no pair uses): saving in f16 is
/// refused naming the limit, and neither the full run's `final.tmp/` nor a LoRA merge's
/// `merged.tmp/` is left behind.
#[test]
fn an_f16_refusal_leaves_no_temporary_folder() {
    let f = fixture();
    let big = f.root.join("tiny-big");
    std::fs::create_dir_all(&big).unwrap();
    for entry in std::fs::read_dir(&f.model).unwrap() {
        let p = entry.unwrap().path();
        if p.extension().is_some_and(|e| e != "safetensors") {
            std::fs::copy(&p, big.join(p.file_name().unwrap())).unwrap();
        }
    }
    let mut tensors: HashMap<String, Tensor> =
        candle_core::safetensors::load(f.model.join("model.safetensors"), &Device::Cpu).unwrap();
    let name = "model.embed_tokens.weight";
    let mut rows: Vec<Vec<f32>> = tensors[name].to_vec2().unwrap();
    let last = rows.len() - 1;
    rows[last][0] = 1e6;
    tensors.insert(name.into(), Tensor::new(rows, &Device::Cpu).unwrap());
    collabllm::engine::weights::save_safetensors(&tensors, &big.join("model.safetensors")).unwrap();
    for (out, lora, tmp) in [
        ("f16-full", false, "final.tmp"),
        ("f16-merge", true, "merged.tmp"),
    ] {
        let mut cfg = config(&f, out);
        cfg.model = big.display().to_string();
        cfg.max_steps = Some(1);
        cfg.optim.lr = 1e-6;
        cfg.save_dtype = "f16".into();
        if lora {
            cfg.lora = small_lora();
            cfg.merge = true;
        }
        let err = train(&cfg, false).unwrap_err().to_string();
        assert!(err.contains("65504"), "{out}: {err}");
        assert!(!cfg.output.join(tmp).exists(), "{out}: {tmp} left behind");
        if lora {
            // The adapter (saved in f32) is in place; only the merge was refused.
            assert!(cfg.output.join("final/adapter_model.safetensors").is_file());
        }
    }
}

/// `save_base` with LoRA on the embedded default (a GGUF): the base as trained on is written to
/// `<output>/base/` and recorded as the adapter's base, so the adapter folder loads alone —
/// resolved offline to that base, with the trainer's base + adapter logits.
#[test]
fn an_adapter_on_the_default_model_loads_alone_with_its_saved_base() {
    let f = fixture();
    let mut cfg = config(&f, "lora-default");
    cfg.model = "default".into();
    cfg.max_steps = Some(1);
    cfg.optim.lr = 1e-2;
    cfg.lora = small_lora();
    cfg.save_base = true;
    train(&cfg, false).unwrap();
    let base = std::fs::canonicalize(cfg.output.join("base")).unwrap();
    assert!(base.join("model.safetensors").is_file() && base.join("tokenizer.json").is_file());
    let adapter_dir = cfg.output.join("final");
    let acfg = AdapterConfig::read(&adapter_dir).unwrap();
    assert_eq!(
        acfg.base_model_name_or_path.as_deref(),
        Some(base.display().to_string().as_str())
    );

    let files = tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(resolve_local(&ModelSpec::HfDir(adapter_dir.clone())))
        .unwrap();
    let LocalModelFiles::Adapter { base: resolved, .. } = &files else {
        panic!("not resolved as an adapter: {files:?}");
    };
    assert_eq!(**resolved, LocalModelFiles::HfDir(base.clone()));
    let ids = codec(&base).encode("<|im_start|>user\nIs it?").unwrap();
    let opts = LoadOptions {
        weights: collabllm::engine::llama::WeightFormat::F32,
        ..Default::default()
    };
    let engine = collabllm::engine::Engine::load(&files, &opts).unwrap();
    let got = engine.next_token_logits(&ids).unwrap();
    let adapter =
        candle_core::safetensors::load(adapter_dir.join("adapter_model.safetensors"), &Device::Cpu)
            .unwrap();
    let mut trained = TrainLlama::from_hf_dir(&base, DType::F32, &Device::Cpu).unwrap();
    trained.enable_lora(acfg, 0).unwrap();
    trained.load_trainable(&adapter).unwrap();
    let want = tokens_of(&trained, &ids);
    let d = max_diff(&[got], &want[want.len() - 1..]);
    assert!(d < 1e-3, "engine on the adapter vs trainer: {d}");
}

/// A leftover of another run in `--output` is never adopted: a fresh run refuses any of it
/// (naming what it found), and a `base/` without recorded settings is refused on `--resume`
/// too. A run stopped after its base was written records its settings first, so resuming it
/// with another model is refused as a changed setting.
#[test]
fn a_leftover_base_is_never_adopted_by_another_run() {
    let f = fixture();
    let lora = |cfg: &mut TrainConfig| {
        cfg.lora = small_lora();
        cfg.save_base = true;
    };
    // Model A, stopped after its base/ exists.
    let mut cfg = config(&f, "leftover");
    lora(&mut cfg);
    cfg.max_steps = Some(3);
    cfg.stop_after = Some(1);
    train(&cfg, false).unwrap_err();
    assert!(cfg.output.join("base/config.json").is_file());
    // Model B on the same output: a fresh run is refused, naming base.
    let (_g2, other) = tiny_model_dir(&TinySpec {
        seed: 99,
        ..TinySpec::default()
    });
    let mut b = cfg.clone();
    b.model = other.display().to_string();
    b.stop_after = None;
    let err = train(&b, false).unwrap_err().to_string();
    assert!(err.contains("base") && err.contains("--resume"), "{err}");
    // ... and resuming with it is another model.
    b.resume = true;
    let err = train(&b, false).unwrap_err().to_string();
    assert!(err.contains("--model was"), "{err}");
    // A base/ whose run recorded nothing (an older version, a copied folder).
    std::fs::remove_file(cfg.output.join("training_args.json")).unwrap();
    let err = train(&b, false).unwrap_err().to_string();
    assert!(err.contains("base/") && err.contains("unknown"), "{err}");
    // Only base/ left over: still refused for a fresh run.
    let only_base = f.root.join("only_base");
    std::fs::create_dir_all(&only_base).unwrap();
    std::fs::rename(cfg.output.join("base"), only_base.join("base")).unwrap();
    let mut fresh = config(&f, "only_base");
    lora(&mut fresh);
    let err = train(&fresh, false).unwrap_err().to_string();
    assert!(err.contains("(base)"), "{err}");
}

/// kill -9 after `final/` was saved and before `merged/`: `--resume` finishes the merge and
/// the summary (no step is trained again), and the half-written `merged.tmp` is gone.
#[test]
fn resume_finishes_an_interrupted_merge() {
    let f = fixture();
    let mut cfg = config(&f, "merge");
    cfg.max_steps = Some(3);
    cfg.lora = small_lora();
    cfg.merge = true;
    train(&cfg, false).unwrap();
    let merged_weights = std::fs::read(cfg.output.join("merged/model.safetensors")).unwrap();
    // merged/ has its checksums as every checkpoint folder does: a flipped byte is named.
    collabllm::run::verify_checksums(&cfg.output.join("merged")).unwrap();
    let listed = collabllm::run::recorded_checksums(&cfg.output.join("merged"))
        .unwrap()
        .expect("merged/checksums.json");
    assert!(listed.contains_key("model.safetensors"), "{listed:?}");
    let mut flipped = merged_weights.clone();
    let last = flipped.len() - 1;
    flipped[last] ^= 1;
    std::fs::write(cfg.output.join("merged/model.safetensors"), &flipped).unwrap();
    let e = collabllm::run::verify_checksums(&cfg.output.join("merged")).unwrap_err();
    assert!(e.contains("model.safetensors"), "{e}");
    let steps = train_lines(&cfg.output).len();
    // What the kill leaves: final/, no summary, a partial merge.
    std::fs::remove_dir_all(cfg.output.join("merged")).unwrap();
    std::fs::remove_file(cfg.output.join("train_summary.json")).unwrap();
    std::fs::create_dir_all(cfg.output.join("merged.tmp")).unwrap();
    std::fs::write(cfg.output.join("merged.tmp/model.safetensors"), b"half").unwrap();
    cfg.resume = true;
    let summary = train(&cfg, false).unwrap();
    assert_eq!(summary.merged_dir, Some(cfg.output.join("merged")));
    assert_eq!(
        std::fs::read(cfg.output.join("merged/model.safetensors")).unwrap(),
        merged_weights
    );
    assert!(!cfg.output.join("merged.tmp").exists());
    assert_eq!(
        train_lines(&cfg.output).len(),
        steps,
        "no step trained again"
    );
    assert!(
        summary.last_log.contains_key("loss"),
        "{:?}",
        summary.last_log
    );
    // Now it is finished.
    let err = train(&cfg, false).unwrap_err().to_string();
    assert!(err.contains("already finished"), "{err}");
}

/// SIGINT (or SIGTERM) stops dpo_train after the step in progress: it is saved as a
/// checkpoint, train_summary.json says `interrupted`, the exit code is 128 + the signal, and
/// `--resume` finishes the run from there.
#[test]
fn a_signal_saves_the_finished_step_and_resume_continues() {
    let f = fixture();
    let data = f.data.display().to_string();
    let model = f.model.display().to_string();
    for (signal, code) in [(libc::SIGINT, 130), (libc::SIGTERM, 143)] {
        let out = f.root.join(format!("signal-{signal}"));
        let out_s = out.display().to_string();
        let args = |extra: &[&str]| -> Vec<String> {
            [
                "--data",
                &data,
                "--model",
                &model,
                "--output",
                &out_s,
                "--batch-size",
                "1",
                "--max-length",
                "128",
                "--logging-steps",
                "1",
            ]
            .iter()
            .chain(extra)
            .map(|s| s.to_string())
            .collect()
        };
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_dpo_train"))
            .args(args(&["--max-steps", "100000"]))
            .env("RUST_LOG", "warn")
            .env("CANDLE_NUM_THREADS", "1")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        common::wait_for_first_log_line(&out.join("logs.jsonl"));
        // SAFETY: kill(2) on the pid of a child this test started and has not reaped.
        assert_eq!(unsafe { libc::kill(child.id() as i32, signal) }, 0);
        let done = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&done.stderr);
        assert_eq!(done.status.code(), Some(code), "{stderr}");
        assert!(
            stderr.contains("interrupted by SIG") && stderr.contains("--resume"),
            "{stderr}"
        );
        let summary: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("train_summary.json")).unwrap())
                .unwrap();
        assert_eq!(summary["status"], "interrupted", "{summary}");
        let step = summary["steps"].as_u64().unwrap() as usize;
        assert!((1..100000).contains(&step), "{summary}");
        assert!(out.join(format!("checkpoint-{step}")).is_dir(), "{summary}");
        assert!(!out.join("final").exists());

        let more = (step + 2).to_string();
        let resumed = dpo_train_bin(
            &args(&[
                "--max-steps",
                &more,
                "--resume",
                "--resume-override",
                "max-steps",
            ])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
        );
        assert!(
            resumed.status.success(),
            "{}",
            String::from_utf8_lossy(&resumed.stderr)
        );
        assert!(out.join("final").is_dir());
        assert_eq!(train_lines(&out).len(), step + 2);
    }
}

/// `dpo_train --config FILE`: the file's settings (keys of training_args.json), a flag given
/// on the command line winning over the file, the LoRA learning rate when the file turns
/// LoRA on and names no lr; unknown keys and command-line-only keys refused by name.
#[test]
fn a_config_file_sets_what_the_flags_do_not() {
    let f = fixture();
    let out = f.root.join("from-config");
    let config = f.root.join("train.toml");
    std::fs::write(
        &config,
        format!(
            "data = \"{}\"\nmodel = \"{}\"\noutput = \"{}\"\nbeta = 0.3\nmax_steps = 2\n\
             batch_size = 1\nmax_length = 128\nlogging_steps = 1\n\
             [lora]\nr = 4\nalpha = 8.0\ndropout = 0.0\ntargets = [\"q_proj\", \"v_proj\"]\n",
            f.data.display(),
            f.model.display(),
            out.display()
        ),
    )
    .unwrap();
    let res = dpo_train_bin(&["--config", config.to_str().unwrap(), "--beta", "0.2"]);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let args = read_args(&out);
    assert_eq!(args["beta"], 0.2, "the flag wins");
    assert_eq!(args["max_steps"], 2, "the file's");
    assert_eq!(args["lora"]["r"], 4);
    assert_eq!(
        args["lora"]["targets"],
        serde_json::json!(["q_proj", "v_proj"])
    );
    assert_eq!(args["lr"], 2e-5, "LoRA's default learning rate");
    assert_eq!(train_lines(&out).len(), 2);

    for (text, key) in [
        ("betta = 0.3\n", "betta"),
        ("resume = true\n", "resume"),
        ("beta = \"high\"\n", "`beta` = \"high\": invalid type"),
        ("epochs = -1\n", "`epochs` = -1: invalid value"),
        ("lr = nan\n", "`lr` = nan: not a finite number"),
        ("[lora]\nr = \"four\"\n", "`lora` = "),
    ] {
        let bad = f.root.join("bad.toml");
        std::fs::write(&bad, format!("data = \"{}\"\n{text}", f.data.display())).unwrap();
        let res = dpo_train_bin(&[
            "--config",
            bad.to_str().unwrap(),
            "--output",
            f.root.join("bad-out").to_str().unwrap(),
        ]);
        let err = String::from_utf8_lossy(&res.stderr);
        assert!(!res.status.success(), "{text}");
        assert!(
            err.contains("bad.toml") && err.contains(key),
            "{text}: {err}"
        );
    }
    let res = dpo_train_bin(&["--model", "default"]);
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(
        !res.status.success() && err.contains("--data is required"),
        "{err}"
    );
}

/// A base model (the Gemma 3 fixture without its chat template) trains on TRL's standard
/// form, plain strings, as TRL tokenizes it: the prompt as the tokenizer encodes raw text
/// (with its BOS), each completion's text alone, then the end-of-text id. A conversation
/// without a template is refused with the reason.
#[test]
fn a_base_model_trains_on_plain_text_pairs() {
    use arrow::array::{ArrayRef, StringArray};
    use arrow::record_batch::RecordBatch;
    one_thread();
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("gemma-base");
    std::fs::create_dir_all(&base).unwrap();
    let fixture =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/families/gemma3_text");
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "generation_config.json",
    ] {
        std::fs::copy(fixture.join(f), base.join(f)).unwrap();
    }
    let mut tok_cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture.join("tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    tok_cfg.as_object_mut().unwrap().remove("chat_template");
    std::fs::write(base.join("tokenizer_config.json"), tok_cfg.to_string()).unwrap();

    let col = |v: &[&str]| -> ArrayRef { std::sync::Arc::new(StringArray::from(v.to_vec())) };
    let batch = RecordBatch::try_from_iter([
        (
            "prompt",
            col(&["the answer is", "say hi", "is the sky blue", "name a dog"]),
        ),
        ("chosen", col(&[" yes", " hi there", " yes it is", " rex"])),
        ("rejected", col(&[" no", " bye", " no", " a cat"])),
    ])
    .unwrap();
    let data = tmp.path().join("plain.parquet");
    let file = std::fs::File::create(&data).unwrap();
    let mut w = parquet::arrow::ArrowWriter::try_new(file, batch.schema(), None).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();

    let codec = ChatCodec::load(&LocalModelFiles::HfDir(base.clone())).unwrap();
    assert!(!codec.template.is_present());
    let rows = collabllm::dataset::read_pairs_parquet(&data).unwrap();
    let (pairs, _) = tokenize_pairs(&codec, &rows, 64, &data).unwrap();
    let raw = |text: &str, specials: bool| -> Vec<u32> {
        codec
            .tokenizer
            .encode(text, specials)
            .unwrap()
            .get_ids()
            .to_vec()
    };
    let eos = codec.eos_ids[0];
    assert_eq!(pairs[0].prompt, raw("the answer is", true));
    assert_eq!(pairs[0].prompt[0], 2, "the BOS the tokenizer adds");
    assert_eq!(pairs[0].chosen, [raw(" yes", false), vec![eos]].concat());
    assert_eq!(pairs[0].rejected, [raw(" no", false), vec![eos]].concat());

    let mut cfg = TrainConfig::new(
        data.clone(),
        &base.display().to_string(),
        tmp.path().join("out"),
    );
    cfg.batch_size = 2;
    cfg.max_length = 64;
    cfg.max_steps = Some(2);
    cfg.optim.warmup_ratio = 0.0;
    cfg.lora = small_lora();
    let summary = train(&cfg, false).unwrap();
    assert_eq!(summary.steps, 2);

    // A conversation has no text without a template.
    let mut conv = rows[0].clone();
    conv.prompt
        .insert(0, ChatMessage::new("system", "Be brief."));
    let err = tokenize_pairs(&codec, &[conv], 64, &data)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no chat template") && err.contains("plain-text pairs"),
        "{err}"
    );
}
