//! The trainable llama loaded from the default GGUF model (SmolLM2-135M-Instruct Q4_1,
//! dequantized, Q/K rows converted to the HF layout) against the inference model's exact f32
//! path on the same file, and every one of its tensors receiving a DPO gradient.

#[path = "common/model_util.rs"]
mod model_util;

use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Tensor};
use collabllm::llm::llama::{LlamaConfig, LlamaModel, WeightFormat};
use collabllm::train::logps::{pair_logps, PairBatch, TokenizedPair};
use collabllm::train::loss::{dpo_loss, DpoConfig};
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

    // One DPO backward on the real model: all 272 tensors get a gradient (DESIGN §8).
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
