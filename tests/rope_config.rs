//! Rotary-embedding settings and every math-changing config field, through the one config
//! reader, on the tiny model saved with different `config.json` forms: the transformers-5
//! form (`rope_parameters`) gives the classic form's logits in inference and training
//! log-probs; `linear` / `llama3` scaling change the logits and match transformers'
//! frequencies (fixture by `scripts/rope_inv_freq_reference.py`); a `dpo_train` checkpoint
//! keeps the rope base; what we do not implement is refused, naming the field.

mod common;
use common::model_util::{self, max_abs_diff};

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use collabllm::dataset::{write_pairs_parquet, PairRow};
use collabllm::engine::config::LlamaConfig;
use collabllm::engine::llama::WeightFormat;
use collabllm::engine::tiny::TinySpec;
use collabllm::engine::{Engine, LoadOptions};
use collabllm::llm::spec::LocalModelFiles;
use collabllm::llm::ChatMessage;
use collabllm::train::dpo::{train, TrainConfig};
use collabllm::train::model::{log_softmax_last_dim, TrainLlama};
use model_util::*;
use serde_json::{json, Value};

/// Token ids of the tiny model's vocabulary (bytes), long enough for rope to matter.
const IDS: [u32; 12] = [257, 115, 121, 115, 116, 101, 109, 10, 72, 105, 33, 258];

fn read_config(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
}

/// A copy of the tiny model in `root/name` whose `config.json` is `edit`ed.
fn variant(src: &Path, root: &Path, name: &str, edit: impl FnOnce(&mut Value)) -> PathBuf {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dir.join(p.file_name().unwrap())).unwrap();
    }
    let mut cfg = read_config(src);
    edit(&mut cfg);
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&cfg).unwrap(),
    )
    .unwrap();
    dir
}

fn classic(theta: f64) -> impl FnOnce(&mut Value) {
    move |c| c["rope_theta"] = theta.into()
}

/// transformers ≥ 5's form: no top-level `rope_theta`.
fn v5(params: Value) -> impl FnOnce(&mut Value) {
    move |c| {
        c.as_object_mut().unwrap().remove("rope_theta");
        c["rope_parameters"] = params;
    }
}

fn engine(dir: &Path) -> Result<Engine, String> {
    let opts = LoadOptions {
        weights: WeightFormat::F32,
        ..LoadOptions::default()
    };
    Engine::load(&LocalModelFiles::HfDir(dir.to_path_buf()), &opts).map_err(|e| e.to_string())
}

/// Inference logits of every position of [`IDS`].
fn inference_logits(dir: &Path) -> Vec<f32> {
    let e = engine(dir).unwrap();
    let model = e.model();
    let mut cache = model.new_cache(IDS.len());
    let t = Tensor::new(&IDS[..], &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let logits = model.forward_all(&t, &mut cache).unwrap();
    logits.flatten_all().unwrap().to_vec1().unwrap()
}

/// Training logits and per-token log-probs of [`IDS`].
fn training_logits_logps(dir: &Path) -> (Vec<f32>, Vec<f32>) {
    let model = TrainLlama::from_hf_dir(dir, DType::F32, &Device::Cpu).unwrap();
    let t = Tensor::new(&IDS[..], &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let logits = model.forward(&t, None).unwrap();
    // Each position's log-prob of the next token, as DPO's completion log-probs sum them.
    let n = IDS.len() - 1;
    let logp = log_softmax_last_dim(&logits.narrow(1, 0, n).unwrap()).unwrap();
    let next = t.narrow(1, 1, n).unwrap().unsqueeze(2).unwrap();
    let per_token = logp.gather(&next.contiguous().unwrap(), 2).unwrap();
    (
        logits.flatten_all().unwrap().to_vec1().unwrap(),
        per_token.flatten_all().unwrap().to_vec1().unwrap(),
    )
}

#[test]
fn transformers_5_config_gives_the_classic_logits_in_inference_and_training() {
    one_thread();
    let (guard, tiny) = tiny_model_dir(&TinySpec::default());
    let root = guard.path();
    let old = variant(&tiny, root, "classic", classic(100000.0));
    let new = variant(
        &tiny,
        root,
        "v5",
        v5(json!({"rope_type": "default", "rope_theta": 100000.0})),
    );
    // What the old reader made of the v5 form: the base silently back at 10000.
    let wrong = variant(&tiny, root, "theta-1e4", classic(10000.0));

    let (i_old, i_new, i_wrong) = (
        inference_logits(&old),
        inference_logits(&new),
        inference_logits(&wrong),
    );
    assert_eq!(max_abs_diff(&i_old, &i_new), 0.0);
    assert!(
        max_abs_diff(&i_old, &i_wrong) > 1e-2,
        "rope base has no effect"
    );

    let ((t_old, lp_old), (t_new, lp_new), (_, lp_wrong)) = (
        training_logits_logps(&old),
        training_logits_logps(&new),
        training_logits_logps(&wrong),
    );
    assert_eq!(max_abs_diff(&lp_old, &lp_new), 0.0);
    assert_eq!(max_abs_diff(&t_old, &t_new), 0.0);
    assert!(max_abs_diff(&lp_old, &lp_wrong) > 1e-2);
    // Inference and training read the same settings into the same tables.
    assert!(
        max_abs_diff(&i_old, &t_old) < 1e-4,
        "{}",
        max_abs_diff(&i_old, &t_old)
    );

    for dir in [&old, &new] {
        let cfg = LlamaConfig::from_hf_json(&dir.join("config.json")).unwrap();
        assert_eq!((cfg.rope_theta, cfg.rope_scaling), (100000.0, None));
    }
}

#[derive(serde::Deserialize)]
struct Case {
    name: String,
    head_dim: usize,
    max_position_embeddings: usize,
    rope_parameters: Value,
    inv_freq: Vec<f64>,
}

fn fixture_cases() -> Vec<Case> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/rope_inv_freq.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    serde_json::from_value(v["cases"].clone()).unwrap()
}

/// A config of `case`'s shape: the transformers-5 form, or the classic one (top-level
/// `rope_theta`, `rope_scaling` with the legacy `type` key).
fn case_config(case: &Case, v5_form: bool) -> Value {
    let mut c = json!({
        "model_type": "llama", "vocab_size": 16, "hidden_size": case.head_dim * 4,
        "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4,
        "rms_norm_eps": 1e-5, "max_position_embeddings": case.max_position_embeddings,
    });
    if v5_form {
        c["rope_parameters"] = case.rope_parameters.clone();
    } else {
        let mut scaling = case.rope_parameters.as_object().unwrap().clone();
        c["rope_theta"] = scaling.remove("rope_theta").unwrap();
        let t = scaling.remove("rope_type").unwrap();
        if t != "default" {
            scaling.insert("type".into(), t);
            c["rope_scaling"] = scaling.into();
        }
    }
    c
}

#[test]
fn inverse_frequencies_match_transformers_in_both_config_forms() {
    let cases = fixture_cases();
    let types: Vec<&str> = cases
        .iter()
        .map(|c| c.rope_parameters["rope_type"].as_str().unwrap())
        .collect();
    for t in ["default", "linear", "llama3"] {
        assert!(types.contains(&t), "fixture lacks {t}");
    }
    for case in &cases {
        let path = PathBuf::from(format!("{}/config.json", case.name));
        let a = LlamaConfig::from_hf_value(&case_config(case, true), &path).unwrap();
        let b = LlamaConfig::from_hf_value(&case_config(case, false), &path).unwrap();
        assert_eq!(a, b, "{}", case.name);
        let ours = a.inv_freqs();
        assert_eq!(ours.len(), case.inv_freq.len(), "{}", case.name);
        for (i, (x, want)) in ours.iter().zip(&case.inv_freq).enumerate() {
            let rel = (x - want).abs() / want.abs();
            assert!(
                rel < 1e-6,
                "{} [{i}]: ours {x}, transformers {want}",
                case.name
            );
        }
    }
}

#[test]
fn linear_and_llama3_scaling_change_the_logits_alike_in_inference_and_training() {
    one_thread();
    let (guard, tiny) = tiny_model_dir(&TinySpec::default());
    let root = guard.path();
    let plain = variant(&tiny, root, "default", classic(10000.0));
    let base = inference_logits(&plain);
    let linear = variant(
        &tiny,
        root,
        "linear",
        v5(json!({"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})),
    );
    // A short original context so that the tiny model's few positions feel the scaling.
    let llama3 = variant(&tiny, root, "llama3", |c| {
        c["rope_scaling"] = json!({
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        })
    });
    let mut seen = Vec::new();
    for dir in [&linear, &llama3] {
        let inf = inference_logits(dir);
        let (tr, _) = training_logits_logps(dir);
        assert!(max_abs_diff(&inf, &base) > 1e-2, "{}", dir.display());
        assert!(max_abs_diff(&inf, &tr) < 1e-4, "{}", dir.display());
        seen.push(inf);
    }
    assert!(max_abs_diff(&seen[0], &seen[1]) > 1e-3);
}

fn assert_refused(dir: &Path, field: &str) {
    let err = engine(dir).err().expect("the engine refuses the config");
    let path = dir.join("config.json").display().to_string();
    assert!(
        err.contains(&path) && err.contains(&format!("`{field}`")),
        "engine: {err}"
    );
    let err = TrainLlama::from_hf_dir(dir, DType::F32, &Device::Cpu)
        .err()
        .expect("training refuses the config")
        .to_string();
    assert!(
        err.contains(&path) && err.contains(&format!("`{field}`")),
        "training: {err}"
    );
}

#[test]
fn unimplemented_settings_are_refused_naming_the_field() {
    let (guard, tiny) = tiny_model_dir(&TinySpec::default());
    let root = guard.path();
    type Edit = Box<dyn FnOnce(&mut Value)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "dynamic",
            Box::new(v5(json!({"rope_type": "dynamic", "factor": 2.0}))),
            "rope_parameters.rope_type",
        ),
        (
            "yarn-legacy",
            Box::new(|c: &mut Value| c["rope_scaling"] = json!({"type": "yarn", "factor": 2.0})),
            "rope_scaling.type",
        ),
        (
            "unknown-key",
            Box::new(|c: &mut Value| {
                c["rope_scaling"] = json!({"rope_type": "linear", "factor": 2.0, "beta_fast": 32})
            }),
            "rope_scaling.beta_fast",
        ),
        (
            "attention-bias",
            Box::new(|c: &mut Value| c["attention_bias"] = true.into()),
            "attention_bias",
        ),
        (
            "no-eps",
            Box::new(|c: &mut Value| {
                c.as_object_mut().unwrap().remove("rms_norm_eps");
            }),
            "rms_norm_eps",
        ),
        (
            "gelu",
            Box::new(|c: &mut Value| c["hidden_act"] = "gelu".into()),
            "hidden_act",
        ),
    ];
    for (name, edit, field) in cases {
        assert_refused(&variant(&tiny, root, name, edit), field);
    }
    // Untied head in the config, none in the weights: transformers would start one at random.
    let untied = variant(&tiny, root, "untied", |c| {
        c["tie_word_embeddings"] = false.into()
    });
    let err = engine(&untied).err().unwrap();
    assert!(err.contains("tie_word_embeddings"), "{err}");
    let err = TrainLlama::from_hf_dir(&untied, DType::F32, &Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("tie_word_embeddings"), "{err}");
}

#[test]
fn checkpoints_keep_the_rope_settings_they_were_loaded_with() {
    one_thread();
    let (guard, tiny) = tiny_model_dir(&TinySpec::default());
    let root = guard.path();
    let params = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 100000.0});
    let src = variant(&tiny, root, "v5", v5(params.clone()));
    let want = LlamaConfig::from_hf_json(&src.join("config.json")).unwrap();

    // save_hf from a transformers-5 directory keeps its form.
    let model = TrainLlama::from_hf_dir(&src, DType::F32, &Device::Cpu).unwrap();
    let saved = root.join("saved");
    model.save_hf(&saved, Some(&src)).unwrap();
    let cfg = read_config(&saved);
    assert_eq!(cfg["rope_parameters"], params, "{cfg}");
    assert!(cfg.get("rope_theta").is_none() && cfg.get("rope_scaling").is_none());
    let rope = |dir: &Path| {
        let c = LlamaConfig::from_hf_json(&dir.join("config.json")).unwrap();
        (c.rope_theta, c.rope_scaling)
    };
    assert_eq!(rope(&saved), (want.rope_theta, want.rope_scaling.clone()));

    // A dpo_train run (a step too small to move an f32 weight) writes a checkpoint with the
    // classic form, read by transformers 4 and 5, that serves the same logits as its source.
    let data = root.join("pairs");
    std::fs::create_dir_all(&data).unwrap();
    let rows: Vec<PairRow> = (0..2)
        .map(|i| PairRow {
            prompt: vec![ChatMessage::user("Is it?")],
            chosen: vec![ChatMessage::assistant("yes")],
            rejected: vec![ChatMessage::assistant("no!")],
            score_chosen: 1.0,
            score_rejected: 0.0,
            conv_id: format!("c{i}"),
            turn_id: 0,
        })
        .collect();
    write_pairs_parquet(&data.join("train.parquet"), &rows).unwrap();
    let mut tc = TrainConfig::new(data, &src.display().to_string(), root.join("run"));
    tc.batch_size = 2;
    tc.max_length = 128;
    tc.optim.warmup_ratio = 0.0;
    tc.optim.lr = 1e-12;
    tc.max_steps = Some(1);
    train(&tc, false).unwrap();
    let out = root.join("run/final");
    let cfg = read_config(&out);
    assert_eq!(cfg["rope_theta"], json!(100000.0), "{cfg}");
    assert_eq!(cfg["rope_scaling"]["rope_type"], "llama3", "{cfg}");
    assert_eq!(rope(&out), (want.rope_theta, want.rope_scaling));
    let d = max_abs_diff(&inference_logits(&out), &inference_logits(&src));
    assert!(d < 1e-5, "checkpoint logits differ by {d}");
}
