//! The trainable llama loaded from the default GGUF model (SmolLM2-135M-Instruct Q4_1,
//! dequantized, Q/K rows converted to the HF layout) against the inference model's exact f32
//! path on the same file, and every one of its tensors receiving a DPO gradient.

mod common;
use common::model_util;
use common::weights_digest;

use candle_core::backprop::GradStore;
use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Tensor};
use collabllm::engine::llama::{LlamaConfig, LlamaModel, WeightFormat};
use collabllm::train::dpo::loss::{dpo_loss, DpoConfig};
use collabllm::train::logps::{pair_logps, PairBatch, TokenizedPair};
use collabllm::train::model::TrainLlama;
use model_util::*;

fn top_k(v: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]));
    idx.truncate(k);
    idx
}

#[test]
fn gguf_train_model_matches_inference_and_gets_all_gradients() {
    one_thread();
    let path = default_model_path();
    let dev = Device::Cpu;
    let train = TrainLlama::from_gguf(&path, DType::F32, &dev).unwrap();
    let infer = {
        let mut f = std::fs::File::open(&path).unwrap();
        let content = gguf_file::Content::read(&mut f).unwrap();
        let cfg = LlamaConfig::from_gguf(&content).unwrap();
        LlamaModel::from_gguf(&content, &mut f, cfg, WeightFormat::F32, &dev).unwrap()
    };
    assert!(train.config().tie_word_embeddings);
    // "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    // in SmolLM2 ids (any ids would do; real text gives meaningful top-k).
    let ids: Vec<u32> = vec![
        1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198,
    ];
    let t = Tensor::new(ids.as_slice(), &dev)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let got: Vec<Vec<f32>> = train
        .forward(&t, None)
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec2()
        .unwrap();
    let mut cache = infer.new_cache(ids.len());
    let want: Vec<Vec<f32>> = infer
        .forward_all(&t, &mut cache)
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec2()
        .unwrap();
    let mut max_diff = 0f32;
    for (g, w) in got.iter().zip(&want) {
        for (a, b) in g.iter().zip(w) {
            max_diff = max_diff.max((a - b).abs());
        }
    }
    let first: f32 = got[0]
        .iter()
        .zip(&want[0])
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(first < 1e-2, "first position differs by {first}");
    assert!(max_diff < 1e-2, "logits differ by {max_diff}");
    for (g, w) in got.iter().zip(&want) {
        let (a, b) = (top_k(g, 10), top_k(w, 10));
        let overlap = a.iter().filter(|x| b.contains(x)).count();
        assert!(overlap >= 9, "top-10 overlap {overlap}: {a:?} vs {b:?}");
    }
    eprintln!("GGUF train vs inference f32: max |Δlogit| = {max_diff:e}, first = {first:e}");

    // One DPO backward on the real model: all 272 tensors get a gradient.
    let pair = TokenizedPair {
        prompt: ids.clone(),
        chosen: vec![504, 3575, 282, 4649, 314, 7042, 30, 2],
        rejected: vec![57, 1341, 5248, 30, 2],
    };
    let batch = PairBatch::new(&[pair], 2, &dev).unwrap();
    let (rc, rr) = pair_logps(&train, &batch, false).unwrap();
    let (pc, pr) = pair_logps(&train, &batch, false).unwrap();
    let out = dpo_loss(&pc, &pr, &rc, &rr, &DpoConfig::default()).unwrap();
    assert!((out.metrics.loss - std::f64::consts::LN_2).abs() < 1e-4);
    let grads = out.loss.backward().unwrap();
    let named = train.named_vars();
    assert_eq!(named.len(), 272);
    let missing: Vec<&str> = named
        .iter()
        .filter(|(_, v)| {
            grads.get(v.as_tensor()).is_none_or(|g| {
                g.abs()
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap()
                    == 0.0
            })
        })
        .map(|(n, _)| n.as_str())
        .collect();
    assert!(missing.is_empty(), "no gradient: {missing:?}");
}

/// One DPO step's gradients on the default model against PyTorch's (float64, transformers'
/// llama on our own export of the same dequantized weights; made by
/// `scripts/make_grad_fixture.py`), with fixed reference log-probs and with the reference
/// equal to the policy (a run's first step): the loss, the global gradient norm that
/// training logs and clips, and per tensor the L2 norm, the sum and 16 entries. In f64
/// (composed ops) to 1e-4 relative; in f32 (the fused kernels training runs on the CPU, whose
/// rounding over 30 layers is about 2e-4) to 1e-3, still far below any scaling error; both
/// with the plain backward pass and with gradient checkpointing.
#[test]
fn dpo_gradients_match_pytorch() {
    one_thread();
    let fixture: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/default_model_dpo_grads.json"),
        )
        .unwrap(),
    )
    .unwrap();
    for (dtype, tol) in [(DType::F64, 1e-4), (DType::F32, 1e-3)] {
        let model = TrainLlama::from_gguf(&default_model_path(), dtype, &Device::Cpu).unwrap();
        assert_eq!(
            weights_digest::weights_digest(&model.hf_tensors().unwrap()),
            fixture["weights_sha256"].as_str().unwrap(),
            "the dequantized default model is not the one the fixture was made from: \
             run scripts/make_grad_fixture.py again"
        );
        for (name, case) in fixture["cases"].as_object().unwrap() {
            let what = format!("{dtype:?} {name}");
            check_case(&model, &fixture, case, tol, &what);
        }
    }
}

fn check_case(
    model: &TrainLlama,
    fixture: &serde_json::Value,
    case: &serde_json::Value,
    tol: f64,
    what: &str,
) {
    let dev = Device::Cpu;
    let ids = |k: &str| -> Vec<u32> {
        fixture[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect()
    };
    let pair = TokenizedPair {
        prompt: ids("prompt"),
        chosen: ids("chosen"),
        rejected: ids("rejected"),
    };
    let batch = PairBatch::new(&[pair], 2, &dev).unwrap();
    let cfg = DpoConfig {
        beta: fixture["beta"].as_f64().unwrap(),
        ..DpoConfig::default()
    };
    let dtype = model.dtype();
    let (pc, pr) = pair_logps(model, &batch, false).unwrap();
    for (got, key) in [(&pc, "policy_chosen_logp"), (&pr, "policy_rejected_logp")] {
        let got = got.to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap()[0];
        let want = fixture[key].as_f64().unwrap();
        assert!(
            (got - want).abs() <= tol * want.abs().max(1.0),
            "{what} {key}: {got} vs PyTorch {want}"
        );
    }
    // The reference: given numbers, or the policy's own log-probs (h = 0 exactly).
    let (rc, rr) = match case["reference"].as_str().unwrap() {
        "policy" => (pc.detach(), pr.detach()),
        _ => {
            let num = |k: &str| {
                Tensor::new(&[case[k].as_f64().unwrap()], &dev)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap()
            };
            (num("ref_chosen_logp"), num("ref_rejected_logp"))
        }
    };
    let out = dpo_loss(&pc, &pr, &rc, &rr, &cfg).unwrap();
    let want_loss = case["loss"].as_f64().unwrap();
    assert!(
        (out.metrics.loss - want_loss).abs() <= tol * want_loss,
        "{what}: loss {} vs PyTorch {want_loss}",
        out.metrics.loss
    );
    let plain = out.loss.backward().unwrap();
    check_gradients(model, plain, case, tol, &format!("{what} plain"));

    let (ckpt, _) = model
        .checkpointed_grads(&batch.input_ids, &batch.layout, |hidden| {
            let (sums, _) =
                collabllm::train::logps::completion_logps(model, hidden, &batch.targets)?;
            let (pc, pr) = (sums.narrow(0, 0, 1)?, sums.narrow(0, 1, 1)?);
            Ok((dpo_loss(&pc, &pr, &rc, &rr, &cfg)?.loss, ()))
        })
        .unwrap();
    check_gradients(model, ckpt, case, tol, &format!("{what} checkpointed"));
}

fn check_gradients(
    model: &TrainLlama,
    mut grads: GradStore,
    case: &serde_json::Value,
    tol: f64,
    what: &str,
) {
    let close = |got: f64, want: f64, scale: f64| (got - want).abs() <= tol * scale;
    let named = model.named_vars();
    for (name, want) in case["tensors"].as_object().unwrap() {
        let var = &named.iter().find(|(n, _)| n == name).unwrap().1;
        let g: Vec<f64> = grads
            .get(var.as_tensor())
            .unwrap_or_else(|| panic!("{what} {name}: no gradient"))
            .to_dtype(DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let field = |k: &str| want[k].as_f64().unwrap();
        assert_eq!(g.len() as u64, want["numel"].as_u64().unwrap(), "{name}");
        let norm = g.iter().map(|x| x * x).sum::<f64>().sqrt();
        let sum: f64 = g.iter().sum();
        assert!(
            close(norm, field("l2_norm"), field("l2_norm")),
            "{what} {name}: gradient L2 norm {norm} vs PyTorch {} (ratio {})",
            field("l2_norm"),
            norm / field("l2_norm")
        );
        // A sum cancels; its error is relative to the sum of magnitudes.
        assert!(
            close(sum, field("sum"), field("abs_sum")),
            "{what} {name}: gradient sum {sum} vs PyTorch {}",
            field("sum")
        );
        // Entries relative to their own size, or to the tensor's RMS entry for tiny ones.
        let rms = field("l2_norm") / (g.len() as f64).sqrt();
        let idx = want["indices"].as_array().unwrap();
        let values = want["values"].as_array().unwrap();
        for (i, v) in idx.iter().zip(values) {
            let (i, v) = (i.as_u64().unwrap() as usize, v.as_f64().unwrap());
            assert!(
                close(g[i], v, v.abs().max(rms)),
                "{what} {name}[{i}]: {} vs PyTorch {v}",
                g[i]
            );
        }
    }
    // The norm training logs as `grad_norm` and clips with.
    let total =
        collabllm::train::optim::clip_grad_norm(&mut grads, &model.vars(), f64::MAX).unwrap();
    let want = case["total_grad_norm"].as_f64().unwrap();
    eprintln!("{what}: global gradient norm {total:.6} vs PyTorch {want:.6}");
    assert!(
        close(total, want, want),
        "{what}: global gradient norm {total} vs PyTorch {want} (ratio {})",
        total / want
    );
}
