//! The K-quant formats users download (Q4_K, Q5_K, Q6_K, and Q4_K_M's mix of Q4_K with Q6_K
//! for `ffn_down`, the embedding and the head) load in every GGUF architecture (llama, which
//! Mistral is written as, qwen2, qwen3, gemma3): the engine at the file's own types (`auto`,
//! `native`: candle's K-quant kernels) gives the logits of the same weights dequantized
//! (`f32`) within the error of quantizing the activations, and the trainer, which dequantizes
//! at load, gives the f32 engine's logits. The files are written here with random weights of
//! widths K-quants can hold (rows of 256).

mod common;
use common::model_util::{max_abs_diff, one_thread};

use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use collabllm::engine::llama::{LlamaConfig, LlamaModel, WeightFormat};
use collabllm::train::model::TrainLlama;

const HIDDEN: usize = 256;
const FFN: usize = 512;
const HEADS: usize = 2;
const KV_HEADS: usize = 1;
const HEAD_DIM: usize = 128;
const LAYERS: usize = 2;
const VOCAB: usize = 300;
const CONTEXT: usize = 128;

/// Deterministic values in [-scale, scale) (a 64-bit LCG).
fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// How a file's tensors are quantized: the type of the attention and MLP matrices, and of
/// `ffn_down` and the embedding (Q4_K_M keeps those at Q6_K).
#[derive(Clone, Copy, Debug)]
struct Mix {
    name: &'static str,
    matrices: GgmlDType,
    down_and_embedding: GgmlDType,
}

const MIXES: [Mix; 4] = [
    Mix {
        name: "Q4_K",
        matrices: GgmlDType::Q4K,
        down_and_embedding: GgmlDType::Q4K,
    },
    Mix {
        name: "Q5_K",
        matrices: GgmlDType::Q5K,
        down_and_embedding: GgmlDType::Q5K,
    },
    Mix {
        name: "Q6_K",
        matrices: GgmlDType::Q6K,
        down_and_embedding: GgmlDType::Q6K,
    },
    Mix {
        name: "Q4_K_M",
        matrices: GgmlDType::Q4K,
        down_and_embedding: GgmlDType::Q6K,
    },
];

/// Writes a random model of `arch` as llama.cpp names and keys it, quantized as `mix` says.
fn write_gguf(path: &Path, arch: &str, mix: Mix, seed: u64) {
    let dev = Device::Cpu;
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut n = seed;
    let mut add = |name: String, shape: (usize, usize), dtype: GgmlDType, scale: f32| {
        n += 1;
        let t = Tensor::from_vec(values(shape.0 * shape.1, n, scale), shape, &dev).unwrap();
        tensors.push((name, QTensor::quantize(&t, dtype).unwrap()));
    };
    let (q, kv) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
    add(
        "token_embd.weight".into(),
        (VOCAB, HIDDEN),
        mix.down_and_embedding,
        1.0,
    );
    let mut norms: Vec<(String, usize)> = vec![("output_norm.weight".into(), HIDDEN)];
    for i in 0..LAYERS {
        let p = format!("blk.{i}");
        add(
            format!("{p}.attn_q.weight"),
            (q, HIDDEN),
            mix.matrices,
            0.08,
        );
        add(
            format!("{p}.attn_k.weight"),
            (kv, HIDDEN),
            mix.matrices,
            0.08,
        );
        add(
            format!("{p}.attn_v.weight"),
            (kv, HIDDEN),
            mix.matrices,
            0.08,
        );
        add(
            format!("{p}.attn_output.weight"),
            (HIDDEN, q),
            mix.matrices,
            0.08,
        );
        add(
            format!("{p}.ffn_gate.weight"),
            (FFN, HIDDEN),
            mix.matrices,
            0.08,
        );
        add(
            format!("{p}.ffn_up.weight"),
            (FFN, HIDDEN),
            mix.matrices,
            0.08,
        );
        add(
            format!("{p}.ffn_down.weight"),
            (HIDDEN, FFN),
            mix.down_and_embedding,
            0.08,
        );
        norms.push((format!("{p}.attn_norm.weight"), HIDDEN));
        norms.push((format!("{p}.ffn_norm.weight"), HIDDEN));
        if arch == "qwen3" || arch == "gemma3" {
            norms.push((format!("{p}.attn_q_norm.weight"), HEAD_DIM));
            norms.push((format!("{p}.attn_k_norm.weight"), HEAD_DIM));
        }
        if arch == "gemma3" {
            norms.push((format!("{p}.post_attention_norm.weight"), HIDDEN));
            norms.push((format!("{p}.post_ffw_norm.weight"), HIDDEN));
        }
    }
    let mut vectors: Vec<(String, QTensor)> = Vec::new();
    for (i, (name, len)) in norms.into_iter().enumerate() {
        let v: Vec<f32> = values(len, seed + 1000 + i as u64, 0.2)
            .into_iter()
            .map(|x| 1.0 + x)
            .collect();
        let t = Tensor::from_vec(v, len, &dev).unwrap();
        vectors.push((name, QTensor::quantize(&t, GgmlDType::F32).unwrap()));
    }
    if arch == "qwen2" {
        for i in 0..LAYERS {
            for (proj, len) in [("attn_q", q), ("attn_k", kv), ("attn_v", kv)] {
                let t =
                    Tensor::from_vec(values(len, seed + 2000 + i as u64, 0.3), len, &dev).unwrap();
                let name = format!("blk.{i}.{proj}.bias");
                vectors.push((name, QTensor::quantize(&t, GgmlDType::F32).unwrap()));
            }
        }
    }
    let key = |k: &str| format!("{arch}.{k}");
    let u = |x: usize| Value::U32(x as u32);
    let mut meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (key("context_length"), u(CONTEXT)),
        (key("embedding_length"), u(HIDDEN)),
        (key("block_count"), u(LAYERS)),
        (key("feed_forward_length"), u(FFN)),
        (key("attention.head_count"), u(HEADS)),
        (key("attention.head_count_kv"), u(KV_HEADS)),
        (key("attention.key_length"), u(HEAD_DIM)),
        (key("attention.value_length"), u(HEAD_DIM)),
        (key("attention.layer_norm_rms_epsilon"), Value::F32(1e-6)),
        (key("rope.freq_base"), Value::F32(10_000.0)),
        (key("vocab_size"), u(VOCAB)),
    ];
    if arch == "gemma3" {
        meta.push((key("attention.sliding_window"), u(64)));
    }
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let all: Vec<(&str, &QTensor)> = tensors
        .iter()
        .chain(vectors.iter())
        .map(|(k, t)| (k.as_str(), t))
        .collect();
    let mut file = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut file, &meta_refs, &all).unwrap();
}

fn engine_logits(path: &Path, format: WeightFormat, ids: &[u32]) -> Vec<f32> {
    let mut file = std::fs::File::open(path).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let cfg = LlamaConfig::from_gguf_checked(&content).unwrap();
    let model = LlamaModel::from_gguf(&content, &mut file, cfg, format, &Device::Cpu).unwrap();
    model.last_logits(ids).unwrap()
}

#[test]
fn k_quant_ggufs_load_in_every_architecture() {
    one_thread();
    let tmp = tempfile::tempdir().unwrap();
    // A prompt longer than one position, with gemma3's sliding layers inside their window.
    let ids: Vec<u32> = (0..40).map(|i| (i * 37 % VOCAB) as u32).collect();
    for (a, arch) in ["llama", "qwen2", "qwen3", "gemma3"]
        .into_iter()
        .enumerate()
    {
        for (m, mix) in MIXES.into_iter().enumerate() {
            let what = format!("{arch} {}", mix.name);
            let path = tmp.path().join(format!("{arch}-{}.gguf", mix.name));
            write_gguf(&path, arch, mix, (a * 10 + m) as u64);
            let exact = engine_logits(&path, WeightFormat::F32, &ids);
            let scale = exact.iter().fold(0f32, |m, x| m.max(x.abs()));
            assert!(scale > 0.1, "{what}: logits of a dead model ({scale})");
            for format in [WeightFormat::Auto, WeightFormat::Native] {
                let got = engine_logits(&path, format, &ids);
                let d = max_abs_diff(&got, &exact);
                // candle's K-quant kernels quantize the activations to 8 bits.
                assert!(
                    d <= 0.01 * scale,
                    "{what} {format}: max |Δlogit| {d} against the dequantized weights \
                     (largest logit {scale})"
                );
            }
            let model = TrainLlama::from_gguf(&path, DType::F32, &Device::Cpu).unwrap();
            let input = Tensor::new(ids.as_slice(), &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            let logits = model.forward(&input, None).unwrap().squeeze(0).unwrap();
            let last: Vec<f32> = logits.get(ids.len() - 1).unwrap().to_vec1().unwrap();
            let d = max_abs_diff(&last, &exact);
            assert!(
                d < 1e-4 * scale.max(1.0),
                "{what}: trainer vs engine on the dequantized weights: {d}"
            );
        }
    }
}
