//! Shared by the test suites that load a model: thread settings, the tiny model, the default
//! model. Suites reach it as `common::model_util` (`mod common;`).
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;

use collabllm::engine::tiny::{write_tiny_llama, TinySpec};
use collabllm::llm::local::{LoadOptions, LocalBackend};
use collabllm::llm::ModelSpec;

/// One compute thread per model test (candle's kernels spin-wait, and CI runs
/// other tests beside this one). Must run before the first model loads.
pub fn one_thread() {
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        // SAFETY: tests call this first, before any model thread starts.
        unsafe { std::env::set_var("CANDLE_NUM_THREADS", "1") };
    }
}

/// Writes the tiny random llama into a fresh temp dir; keep the guard alive while it is used.
pub fn tiny_model_dir(spec: &TinySpec) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("tiny-llama");
    write_tiny_llama(&path, spec).expect("writing the tiny model");
    (dir, path)
}

pub async fn load_tiny(spec: &TinySpec) -> (tempfile::TempDir, Arc<LocalBackend>) {
    one_thread();
    let (guard, path) = tiny_model_dir(spec);
    let backend = LocalBackend::load(&ModelSpec::HfDir(path), &LoadOptions::default())
        .await
        .expect("loading the tiny model");
    (guard, backend)
}

/// The tiny random llama loaded with f32 weights (the exact reference path, whose numbers
/// the trainer's match), and its directory.
pub async fn load_tiny_f32(spec: &TinySpec) -> (tempfile::TempDir, PathBuf, Arc<LocalBackend>) {
    one_thread();
    let (guard, path) = tiny_model_dir(spec);
    let opts = LoadOptions {
        weights: collabllm::engine::llama::WeightFormat::F32,
        ..LoadOptions::default()
    };
    let backend = LocalBackend::load(&ModelSpec::HfDir(path.clone()), &opts)
        .await
        .expect("loading the tiny model");
    (guard, path, backend)
}

/// The default model's path; fails (never skips) with the command that fetches it.
pub fn default_model_path() -> PathBuf {
    collabllm::llm::spec::default_model_path().unwrap_or_else(|e| {
        panic!("{e}\n(CI fetches it in .ci/run; locally run `bash scripts/fetch_default_model.sh`)")
    })
}

/// Continuous batching keeps every request's tokens: three requests with different prompt
/// lengths (so different positions), sample counts and sampling settings join one decode
/// batch at steps 0, 3 and 7 (the first still decoding: it ignores end-of-turn), and each
/// gives exactly what it gives alone.
pub fn assert_joining_mid_decode_equals_alone(engine: &collabllm::engine::Engine) {
    use collabllm::engine::{GenParams, GenState};
    use collabllm::llm::ChatMessage;
    let prompt = |text: &str| {
        engine
            .encode(&engine.render(&[ChatMessage::user(text)]).unwrap())
            .unwrap()
    };
    let params = |n, temperature, seed, ignore_eos: bool| GenParams {
        temperature,
        top_p: 0.9,
        max_new_tokens: 24,
        stop: Vec::new(),
        seed: Some(seed),
        n,
        eos: if ignore_eos {
            collabllm::engine::EosRule::Ignore
        } else {
            collabllm::engine::EosRule::AfterText
        },
        logprobs: None,
    };
    let cases = [
        (0, prompt("Tell me about the sea."), params(1, 0.0, 1, true)),
        (3, prompt("Hi"), params(3, 1.0, 7, false)),
        (
            7,
            prompt("Write a long story about three ships, a lighthouse and a storm at night."),
            params(2, 0.0, 3, false),
        ),
    ];
    let alone: Vec<_> = cases
        .iter()
        .map(|(_, p, g)| engine.generate(p, g).unwrap().samples)
        .collect();
    // Cold prompts below, so the last request's prompt really is prefilled in pieces.
    engine.clear_prefix_cache();
    let mut states: Vec<Option<GenState>> = cases.iter().map(|_| None).collect();
    // The last request is prefilled a few positions per round between decode steps of the
    // others, as the scheduler does with long prompts.
    let mut prefilling = None;
    let mut prefill_rounds = 0;
    let mut step = 0;
    loop {
        for (i, (at, p, g)) in cases.iter().enumerate() {
            if *at == step {
                if i > 0 {
                    let first = states[0].as_ref().unwrap();
                    assert!(
                        !first.is_finished(),
                        "the first request ended before {i} joined"
                    );
                }
                if i == cases.len() - 1 {
                    prefilling = Some(engine.begin_prefill(p).unwrap());
                } else {
                    states[i] = Some(engine.start(p, g).unwrap());
                }
            }
        }
        if let Some(prefill) = prefilling.as_mut() {
            prefill_rounds += 1;
            if engine.prefill_chunk(prefill, 5).unwrap() {
                let (_, _, g) = &cases[cases.len() - 1];
                let state = engine.start_prefilled(prefilling.take().unwrap(), g);
                states[cases.len() - 1] = Some(state.unwrap());
            }
        }
        let mut live: Vec<&mut GenState> = states
            .iter_mut()
            .flatten()
            .filter(|s| !s.is_finished())
            .collect();
        if live.is_empty() && step > cases[2].0 && prefilling.is_none() {
            break;
        }
        engine.step(&mut live).unwrap();
        step += 1;
    }
    assert!(
        prefill_rounds > 3,
        "the last prompt took {prefill_rounds} prefill rounds"
    );
    for (i, (state, alone)) in states.into_iter().zip(alone).enumerate() {
        let batched = engine.finish(state.unwrap()).unwrap().samples;
        assert_eq!(batched, alone, "request {i}");
    }
}

/// The trainable model's log-softmax at every position of `seq` (one row per position), in
/// f64: row t scores the token at t + 1.
pub fn trainer_log_probs(
    model: &collabllm::train::model::TrainLlama,
    seq: &[u32],
) -> Vec<Vec<f64>> {
    use candle_core::{DType, Device, Tensor};
    let input = Tensor::new(seq, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let logits = model.forward(&input, None).unwrap().squeeze(0).unwrap();
    collabllm::train::model::log_softmax_last_dim(&logits)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec2::<f64>()
        .unwrap()
}

/// The largest |a − b| over two logit vectors of the same length.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "vectors of different lengths");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}
