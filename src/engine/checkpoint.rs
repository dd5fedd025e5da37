//! Checks of a saved checkpoint before it leaves the machine (`push_hf model`): every
//! safetensors file whole (its header's offsets reach exactly its end, each tensor's bytes
//! match its dtype and shape), and a full llama checkpoint holding every tensor its
//! `config.json` implies, in the shape it implies. Headers only: no tensor data is read.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use super::config::LlamaConfig;

/// A checkpoint that is not whole; names the file and what is wrong.
#[derive(Debug, thiserror::Error)]
#[error("{}: {message}", path.display())]
pub struct CheckpointError {
    pub path: PathBuf,
    pub message: String,
}

fn err(path: &Path, message: impl Into<String>) -> CheckpointError {
    CheckpointError {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// One tensor of a safetensors header.
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize)]
pub struct TensorInfo {
    pub dtype: String,
    pub shape: Vec<usize>,
    pub data_offsets: (usize, usize),
}

/// Largest header accepted: the format's own limit is 100 MB.
const MAX_HEADER: u64 = 100 << 20;

fn dtype_bytes(dtype: &str) -> Option<usize> {
    Some(match dtype {
        "BOOL" | "U8" | "I8" | "F8_E4M3" | "F8_E5M2" => 1,
        "U16" | "I16" | "F16" | "BF16" => 2,
        "U32" | "I32" | "F32" => 4,
        "U64" | "I64" | "F64" => 8,
        _ => return None,
    })
}

/// The tensors of a safetensors file, after checking that the file is whole: the header
/// parses, every tensor's byte range fits its dtype and shape, the ranges tile the data
/// section without gaps, and the data section ends exactly at the end of the file.
pub fn read_safetensors_header(
    path: &Path,
) -> Result<BTreeMap<String, TensorInfo>, CheckpointError> {
    let mut f = std::fs::File::open(path).map_err(|e| err(path, e.to_string()))?;
    let file_len = f.metadata().map_err(|e| err(path, e.to_string()))?.len();
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .map_err(|_| err(path, "truncated: shorter than a safetensors header"))?;
    let n = u64::from_le_bytes(len);
    if n > MAX_HEADER || 8 + n > file_len {
        return Err(err(
            path,
            format!("truncated or not safetensors (header of {n} bytes)"),
        ));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header)
        .map_err(|e| err(path, format!("reading the header: {e}")))?;
    let mut raw: BTreeMap<String, serde_json::Value> = serde_json::from_slice(&header)
        .map_err(|e| err(path, format!("the header is not valid JSON: {e}")))?;
    raw.remove("__metadata__");
    let mut tensors = BTreeMap::new();
    for (name, v) in raw {
        let info: TensorInfo =
            serde_json::from_value(v).map_err(|e| err(path, format!("tensor `{name}`: {e}")))?;
        tensors.insert(name, info);
    }
    let mut ranges: Vec<(usize, usize, &str)> = Vec::new();
    for (name, t) in &tensors {
        let size = dtype_bytes(&t.dtype)
            .ok_or_else(|| err(path, format!("tensor `{name}`: unknown dtype {}", t.dtype)))?;
        let want = t
            .shape
            .iter()
            .try_fold(size, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| {
                err(
                    path,
                    format!("tensor `{name}`: shape {:?} overflows", t.shape),
                )
            })?;
        let (start, end) = t.data_offsets;
        if end < start || end - start != want {
            return Err(err(
                path,
                format!(
                    "tensor `{name}`: {} bytes for {} {:?} ({want} expected)",
                    end.saturating_sub(start),
                    t.dtype,
                    t.shape
                ),
            ));
        }
        ranges.push((start, end, name));
    }
    ranges.sort();
    let mut at = 0usize;
    for (start, end, name) in &ranges {
        if *start != at {
            return Err(err(
                path,
                format!("tensor `{name}` starts at byte {start}, not {at}"),
            ));
        }
        at = *end;
    }
    let data_len = file_len - 8 - n;
    if at as u64 != data_len {
        return Err(err(
            path,
            format!(
                "truncated or padded: the tensors need {at} bytes of data, the file holds \
                 {data_len}"
            ),
        ));
    }
    Ok(tensors)
}

/// The HF tensor names of a llama with this configuration, in a fixed order.
pub fn hf_tensor_names(cfg: &LlamaConfig) -> Vec<String> {
    let mut names = vec!["model.embed_tokens.weight".to_string()];
    for i in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{i}");
        for n in [
            "input_layernorm",
            "post_attention_layernorm",
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ] {
            names.push(format!("{p}.{n}.weight"));
        }
        if cfg.family.qkv_bias() {
            for n in ["q_proj", "k_proj", "v_proj"] {
                names.push(format!("{p}.self_attn.{n}.bias"));
            }
        }
        if cfg.family.qk_norm() {
            for n in ["q_norm", "k_norm"] {
                names.push(format!("{p}.self_attn.{n}.weight"));
            }
        }
        if cfg.family.gemma() {
            for n in ["pre_feedforward_layernorm", "post_feedforward_layernorm"] {
                names.push(format!("{p}.{n}.weight"));
            }
        }
    }
    names.push("model.norm.weight".to_string());
    if !cfg.tie_word_embeddings {
        names.push("lm_head.weight".to_string());
    }
    names
}

/// The shape of HF tensor `name` in a model with this configuration.
pub fn expected_shape(cfg: &LlamaConfig, name: &str) -> Vec<usize> {
    let h = cfg.hidden_size;
    let q_out = cfg.num_attention_heads * cfg.head_dim();
    let kv_out = cfg.num_kv_heads() * cfg.head_dim();
    let im = cfg.intermediate_size;
    let suffix = name.rsplit_once("layers.").map_or(name, |(_, s)| s);
    if name == "model.embed_tokens.weight" || name == "lm_head.weight" {
        vec![cfg.vocab_size, h]
    } else if suffix.ends_with("q_norm.weight") || suffix.ends_with("k_norm.weight") {
        vec![cfg.head_dim()]
    } else if suffix.ends_with("q_proj.bias") {
        vec![q_out]
    } else if suffix.ends_with("k_proj.bias") || suffix.ends_with("v_proj.bias") {
        vec![kv_out]
    } else if name.ends_with("norm.weight") {
        vec![h]
    } else if suffix.ends_with("q_proj.weight") {
        vec![q_out, h]
    } else if suffix.ends_with("k_proj.weight") || suffix.ends_with("v_proj.weight") {
        vec![kv_out, h]
    } else if suffix.ends_with("o_proj.weight") {
        vec![h, q_out]
    } else if suffix.ends_with("gate_proj.weight") || suffix.ends_with("up_proj.weight") {
        vec![im, h]
    } else {
        vec![h, im]
    }
}

/// Checks a checkpoint directory: each `*.safetensors` file whole; for a full model
/// (`config.json` + `model*.safetensors`) every tensor of the configuration present, in its
/// shape. A PEFT adapter is checked for whole files only.
pub fn check_checkpoint_dir(dir: &Path) -> Result<(), CheckpointError> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| err(dir, e.to_string()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    let mut model_tensors: BTreeMap<String, (TensorInfo, PathBuf)> = BTreeMap::new();
    for f in &files {
        let tensors = read_safetensors_header(f)?;
        let is_model = f
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("model"));
        if is_model {
            for (name, t) in tensors {
                model_tensors.insert(name, (t, f.clone()));
            }
        }
    }
    let config = dir.join("config.json");
    if model_tensors.is_empty() || !config.is_file() {
        return Ok(());
    }
    let cfg = LlamaConfig::from_hf_json(&config).map_err(|e| err(&config, e.to_string()))?;
    for name in hf_tensor_names(&cfg) {
        let Some((t, file)) = model_tensors.get(&name) else {
            return Err(err(
                dir,
                format!("missing tensor `{name}` (config.json implies it)"),
            ));
        };
        let want = expected_shape(&cfg, &name);
        if t.shape != want {
            return Err(err(
                file,
                format!(
                    "tensor `{name}` has shape {:?}; config.json implies {want:?}",
                    t.shape
                ),
            ));
        }
    }
    Ok(())
}
