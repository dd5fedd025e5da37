//! Model shapes without their weights: the configurations of the models users train (named
//! presets, or any HF `config.json`), and a trainable model of such a shape filled with
//! random values, for measuring speed and memory where the weights cannot travel (a GPU
//! machine with no network). Speed and memory do not depend on the values.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};

use super::error::TrainError;
use super::model::TrainLlama;
use crate::engine::checkpoint::{expected_shape, hf_tensor_names};
use crate::engine::config::LlamaConfig;

/// The presets: name and the `config.json` fields that shape the model (as published by
/// their authors; token ids and the like left out).
pub const SHAPES: [(&str, &str); 5] = [
    (
        "qwen2.5-0.5b",
        r#"{"model_type":"qwen2","hidden_size":896,"intermediate_size":4864,
            "num_hidden_layers":24,"num_attention_heads":14,"num_key_value_heads":2,
            "vocab_size":151936,"rms_norm_eps":1e-6,"rope_theta":1000000.0,
            "max_position_embeddings":32768,"tie_word_embeddings":true}"#,
    ),
    (
        "llama-3.2-1b",
        r#"{"model_type":"llama","hidden_size":2048,"intermediate_size":8192,
            "num_hidden_layers":16,"num_attention_heads":32,"num_key_value_heads":8,
            "head_dim":64,"vocab_size":128256,"rms_norm_eps":1e-5,"rope_theta":500000.0,
            "rope_scaling":{"rope_type":"llama3","factor":32.0,"low_freq_factor":1.0,
                            "high_freq_factor":4.0,"original_max_position_embeddings":8192},
            "max_position_embeddings":131072,"tie_word_embeddings":true}"#,
    ),
    (
        "qwen2.5-7b",
        r#"{"model_type":"qwen2","hidden_size":3584,"intermediate_size":18944,
            "num_hidden_layers":28,"num_attention_heads":28,"num_key_value_heads":4,
            "vocab_size":152064,"rms_norm_eps":1e-6,"rope_theta":1000000.0,
            "max_position_embeddings":32768,"tie_word_embeddings":false}"#,
    ),
    (
        "llama-3.1-8b",
        r#"{"model_type":"llama","hidden_size":4096,"intermediate_size":14336,
            "num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,
            "head_dim":128,"vocab_size":128256,"rms_norm_eps":1e-5,"rope_theta":500000.0,
            "rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,
                            "high_freq_factor":4.0,"original_max_position_embeddings":8192},
            "max_position_embeddings":131072,"tie_word_embeddings":false}"#,
    ),
    (
        // A few-MB llama for tests and for the CPU-against-GPU check.
        "tiny",
        r#"{"model_type":"llama","hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
            "vocab_size":512,"rms_norm_eps":1e-5,"rope_theta":10000.0,
            "max_position_embeddings":2048,"tie_word_embeddings":false}"#,
    ),
];

/// The names of the presets, for `--help` and errors.
pub fn shape_names() -> Vec<&'static str> {
    SHAPES.iter().map(|(n, _)| *n).collect()
}

/// A preset by name, or an HF `config.json` (a file, or a folder holding one).
pub fn shape_config(name_or_path: &str) -> Result<LlamaConfig, TrainError> {
    if let Some((name, json)) = SHAPES.iter().find(|(n, _)| *n == name_or_path) {
        let value: serde_json::Value = serde_json::from_str(json)
            .map_err(|e| TrainError::Setting(format!("shape `{name}`: {e}")))?;
        return Ok(LlamaConfig::from_hf_value(&value, Path::new(name))?);
    }
    let path = Path::new(name_or_path);
    let file = if path.is_dir() {
        path.join("config.json")
    } else {
        path.to_path_buf()
    };
    if !file.is_file() {
        return Err(TrainError::Setting(format!(
            "unknown shape `{name_or_path}`: neither a preset ({}) nor a config.json",
            shape_names().join(", ")
        )));
    }
    Ok(LlamaConfig::from_hf_json(&file)?)
}

/// Values in each random tensor before they repeat: a prime, so that the rows of a matrix
/// wider than it are shifted copies, never the same row.
const BLOCK: usize = 65_521;

/// A trainable model of `cfg`'s shape with random weights: matrices and biases uniform with
/// standard deviation 0.02 (the HF initialiser's scale), norms 1. Each tensor repeats one block of [`BLOCK`] values
/// drawn on the CPU from `seed` and its name, and is expanded on `device`: the same model on
/// every device, in seconds at 8B. Tensors smaller than the block are fully random.
pub fn random_model(
    cfg: &LlamaConfig,
    dtype: DType,
    device: &Device,
    seed: u64,
) -> Result<TrainLlama, TrainError> {
    let mut tensors = HashMap::new();
    for (i, name) in hf_tensor_names(cfg).into_iter().enumerate() {
        let shape = expected_shape(cfg, &name);
        let t = if name.ends_with("norm.weight") {
            Tensor::ones(shape.as_slice(), dtype, device)?
        } else {
            random_tensor(&shape, seed.wrapping_add(i as u64), dtype, device)?
        };
        tensors.insert(name, t);
    }
    Ok(TrainLlama::from_tensors(
        cfg.clone(),
        tensors,
        None,
        dtype,
        device,
    )?)
}

fn random_tensor(
    shape: &[usize],
    seed: u64,
    dtype: DType,
    device: &Device,
) -> candle_core::Result<Tensor> {
    let n: usize = shape.iter().product();
    // Uniform on ±0.02·√3: standard deviation 0.02.
    let bound = 0.02 * 3f32.sqrt();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let len = n.min(BLOCK);
    let block: Vec<f32> = (0..len).map(|_| rng.random_range(-bound..bound)).collect();
    let block = Tensor::from_vec(block, (1, len), device)?.to_dtype(dtype)?;
    let copies = n.div_ceil(len);
    block
        .broadcast_as((copies, len))?
        .contiguous()?
        .flatten_all()?
        .narrow(0, 0, n)?
        .reshape(shape)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_shapes_name_the_presets() {
        let err = shape_config("gpt-5").unwrap_err().to_string();
        assert!(
            err.contains("qwen2.5-0.5b") && err.contains("llama-3.1-8b"),
            "{err}"
        );
    }

    #[test]
    fn random_models_are_the_same_for_a_seed_and_fill_every_tensor() {
        let cfg = shape_config("tiny").unwrap();
        let a = random_model(&cfg, DType::F32, &Device::Cpu, 3).unwrap();
        let b = random_model(&cfg, DType::F32, &Device::Cpu, 3).unwrap();
        let c = random_model(&cfg, DType::F32, &Device::Cpu, 4).unwrap();
        let (ta, tb, tc) = (
            a.hf_tensors().unwrap(),
            b.hf_tensors().unwrap(),
            c.hf_tensors().unwrap(),
        );
        let name = "model.layers.1.mlp.down_proj.weight";
        let v = |t: &HashMap<String, Tensor>| t[name].flatten_all().unwrap().to_vec1::<f32>();
        assert_eq!(v(&ta).unwrap(), v(&tb).unwrap());
        assert_ne!(v(&ta).unwrap(), v(&tc).unwrap());
        let std = {
            let x = v(&ta).unwrap();
            (x.iter().map(|x| x * x).sum::<f32>() / x.len() as f32).sqrt()
        };
        assert!((0.015..0.025).contains(&std), "{std}");
    }
}
