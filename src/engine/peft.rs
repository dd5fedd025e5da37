//! LoRA adapters in the PEFT layout: `adapter_config.json` plus
//! `adapter_model.safetensors` whose tensors are named
//! `base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`, A of shape
//! (r, in) and B of shape (out, r); the update of a weight W (out, in) is `(α / r) · B · A`.
//! Inference loads an adapter directory by merging it into its base model.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

pub const ADAPTER_CONFIG: &str = "adapter_config.json";
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";

/// The projections LoRA may adapt, as PEFT names them (`target_modules`).
pub const LORA_TARGETS: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

#[derive(Debug, thiserror::Error)]
pub enum PeftError {
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    #[error("adapter tensor `{name}`: {message}")]
    Tensor { name: String, message: String },
}

fn file_err(path: &Path, e: impl std::fmt::Display) -> PeftError {
    PeftError::File {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

/// `adapter_config.json` (the fields PEFT writes for a LoRA on a causal LM).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdapterConfig {
    pub peft_type: String,
    #[serde(default)]
    pub task_type: Option<String>,
    pub r: usize,
    pub lora_alpha: f64,
    #[serde(default)]
    pub lora_dropout: f64,
    pub target_modules: Vec<String>,
    #[serde(default)]
    pub base_model_name_or_path: Option<String>,
    #[serde(default = "none_bias")]
    pub bias: String,
    #[serde(default)]
    pub fan_in_fan_out: bool,
    #[serde(default)]
    pub use_rslora: bool,
    #[serde(default)]
    pub use_dora: bool,
    #[serde(default = "yes")]
    pub inference_mode: bool,
}

fn none_bias() -> String {
    "none".into()
}
fn yes() -> bool {
    true
}

impl AdapterConfig {
    pub fn lora(r: usize, alpha: f64, dropout: f64, targets: &[&str], base: &str) -> Self {
        Self {
            peft_type: "LORA".into(),
            task_type: Some("CAUSAL_LM".into()),
            r,
            lora_alpha: alpha,
            lora_dropout: dropout,
            target_modules: targets.iter().map(|t| t.to_string()).collect(),
            base_model_name_or_path: Some(base.to_string()),
            bias: "none".into(),
            fan_in_fan_out: false,
            use_rslora: false,
            use_dora: false,
            inference_mode: true,
        }
    }

    /// α / r (α / √r with rsLoRA), as PEFT scales the update.
    pub fn scale(&self) -> f64 {
        if self.use_rslora {
            self.lora_alpha / (self.r as f64).sqrt()
        } else {
            self.lora_alpha / self.r as f64
        }
    }

    pub fn read(dir: &Path) -> Result<Self, PeftError> {
        let path = dir.join(ADAPTER_CONFIG);
        let text = std::fs::read_to_string(&path).map_err(|e| file_err(&path, e))?;
        let cfg: Self = serde_json::from_str(&text).map_err(|e| file_err(&path, e))?;
        if cfg.peft_type != "LORA" {
            return Err(file_err(
                &path,
                format!("peft_type `{}` is not supported (only LORA)", cfg.peft_type),
            ));
        }
        if cfg.use_dora || cfg.fan_in_fan_out || cfg.bias != "none" {
            return Err(file_err(
                &path,
                "only plain LoRA is supported (no DoRA, fan_in_fan_out or bias)",
            ));
        }
        if cfg.r == 0 {
            return Err(file_err(&path, "r must be positive"));
        }
        Ok(cfg)
    }

    pub fn write(&self, dir: &Path) -> std::io::Result<()> {
        let text = serde_json::to_string_pretty(self).map_err(std::io::Error::other)?;
        std::fs::write(dir.join(ADAPTER_CONFIG), text)
    }
}

/// Where a projection sits in a llama layer (`self_attn` or `mlp`).
pub fn module_path(target: &str) -> &'static str {
    match target {
        "gate_proj" | "up_proj" | "down_proj" => "mlp",
        _ => "self_attn",
    }
}

/// PEFT tensor name of LoRA matrix `ab` ("A" or "B") on `target` of layer `layer`.
pub fn peft_tensor_name(layer: usize, target: &str, ab: &str) -> String {
    format!(
        "base_model.model.model.layers.{layer}.{}.{target}.lora_{ab}.weight",
        module_path(target)
    )
}

/// HF name of the weight that `peft_tensor_name(layer, target, _)` adapts.
pub fn hf_weight_name(layer: usize, target: &str) -> String {
    format!(
        "model.layers.{layer}.{}.{target}.weight",
        module_path(target)
    )
}

/// Parses a PEFT LoRA tensor name into (layer, target, "A"|"B").
pub fn parse_peft_name(name: &str) -> Option<(usize, String, String)> {
    let rest = name.strip_prefix("base_model.model.model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let rest = rest
        .strip_prefix("self_attn.")
        .or_else(|| rest.strip_prefix("mlp."))?;
    let (target, rest) = rest.split_once('.')?;
    let ab = rest.strip_prefix("lora_")?.strip_suffix(".weight")?;
    if !(ab == "A" || ab == "B") || !LORA_TARGETS.contains(&target) {
        return None;
    }
    Some((layer, target.to_string(), ab.to_string()))
}

/// A loaded adapter: its config and its tensors (f32).
pub struct Adapter {
    pub config: AdapterConfig,
    pub tensors: HashMap<String, Tensor>,
}

impl Adapter {
    pub fn load(dir: &Path, device: &Device) -> Result<Self, PeftError> {
        let config = AdapterConfig::read(dir)?;
        let path = dir.join(ADAPTER_WEIGHTS);
        let tensors = candle_core::safetensors::load(&path, device)
            .map_err(|e| file_err(&path, e))?
            .into_iter()
            .map(|(k, v)| Ok((k, v.to_dtype(DType::F32)?)))
            .collect::<candle_core::Result<HashMap<_, _>>>()
            .map_err(|e| file_err(&path, e))?;
        for name in tensors.keys() {
            if parse_peft_name(name).is_none() {
                return Err(file_err(
                    &path,
                    format!("unexpected tensor `{name}` (expected PEFT LoRA names)"),
                ));
            }
        }
        Ok(Self { config, tensors })
    }

    /// Adds `scale · B · A` to each adapted weight of `base` (HF names, HF layout).
    pub fn merge_into(&self, base: &mut HashMap<String, Tensor>) -> Result<(), PeftError> {
        let scale = self.config.scale();
        for (name, a) in &self.tensors {
            let Some((layer, target, ab)) = parse_peft_name(name) else {
                continue;
            };
            if ab != "A" {
                continue;
            }
            let b_name = peft_tensor_name(layer, &target, "B");
            let terr = |message: String| PeftError::Tensor {
                name: name.clone(),
                message,
            };
            let b = self
                .tensors
                .get(&b_name)
                .ok_or_else(|| terr(format!("no matching `{b_name}`")))?;
            let w_name = hf_weight_name(layer, &target);
            let w = base
                .get(&w_name)
                .ok_or_else(|| terr(format!("the base model has no `{w_name}`")))?;
            let delta = b
                .matmul(a)
                .and_then(|d| d * scale)
                .map_err(|e| terr(e.to_string()))?;
            if delta.dims() != w.dims() {
                return Err(terr(format!(
                    "B·A has shape {:?} but `{w_name}` has {:?}",
                    delta.dims(),
                    w.dims()
                )));
            }
            let merged = w
                .to_dtype(DType::F32)
                .and_then(|w| w + delta)
                .map_err(|e| terr(e.to_string()))?;
            base.insert(w_name, merged);
        }
        Ok(())
    }
}

/// Whether `dir` holds a PEFT adapter.
pub fn is_adapter_dir(dir: &Path) -> bool {
    dir.join(ADAPTER_CONFIG).is_file()
}
