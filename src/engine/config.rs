//! The one reader of a model's hyper-parameters, for inference and training alike, and the
//! one place that says which model families are supported ([`Family`]: llama, qwen2, qwen3,
//! mistral, gemma3_text): an HF `config.json` (transformers ≤ 4 writes the rope base as a top-level
//! `rope_theta` and its scaling as `rope_scaling`; transformers ≥ 5 writes both under
//! `rope_parameters`) or the `<arch>.*` metadata of a GGUF file (`llama`, `qwen2`, `qwen3`,
//! `gemma3`).
//!
//! Nothing that changes the model's math is guessed: a family, rope type or rope key we do
//! not implement, a field whose value we do not implement (`attention_bias: true` outside
//! Qwen2, `hidden_act` other than `silu`, a sliding window in use, sliding-attention
//! `layer_types`, partial rotary embeddings, …) or a missing required field is a [`ModelConfigError`] naming the file and the field. The defaults
//! left are transformers' own for `LlamaConfig` (`rope_theta` 10000 when the file names
//! none, `num_key_value_heads` = heads, `head_dim` = hidden / heads, untied head).
//!
//! [`rope_inv_freqs`] is the one computation of the rotary frequencies (default, `linear`,
//! `llama3`), used by the inference model and the trainable one.

use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file;
use serde_json::{Map, Value};

use super::gguf_tokenizer::{meta_str, meta_u32};
use crate::check::Range;

/// transformers' `rope_theta` when a config names none (and llama.cpp's when a GGUF has no
/// `llama.rope.freq_base`).
pub const DEFAULT_ROPE_THETA: f64 = 10_000.0;

/// The rope types we implement, as `rope_type` names them.
pub const ROPE_TYPES: [&str; 3] = ["default", "linear", "llama3"];

/// A supported model family: the llama maths with what each family adds. Everything else
/// (`gemma2`, `phi3`, mixtures of experts, …) is refused by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// Llama 2/3, SmolLM2, TinyLlama.
    Llama,
    /// Qwen2 and Qwen2.5: bias on the q/k/v projections.
    Qwen2,
    /// Qwen3 (dense): RMSNorm of each query and key head before the rotary embedding
    /// (`q_norm`, `k_norm`), `head_dim` given explicitly.
    Qwen3,
    /// Mistral: llama maths with a sliding window, which is used only up to its length (the
    /// context is capped at the window: within it attention is full).
    Mistral,
    /// Gemma 3 (text, dense): (1 + w) RMS norms, a norm after attention and after the MLP
    /// besides the two before them, per-head query/key norms, embeddings scaled by
    /// √hidden, GELU (tanh) in the MLP, tied head; sliding-window layers (each query reads
    /// the `sliding_window` keys up to its own, [`LlamaConfig::attention_window`]) with
    /// their own rope base between global ones.
    Gemma3,
}

impl Family {
    /// All supported families, as `model_type` names them.
    pub const ALL: [Family; 5] = [
        Family::Llama,
        Family::Qwen2,
        Family::Qwen3,
        Family::Mistral,
        Family::Gemma3,
    ];

    /// transformers' `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Mistral => "mistral",
            Family::Gemma3 => "gemma3_text",
        }
    }

    /// transformers' class, as `architectures` names it.
    pub fn architecture(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
            Family::Mistral => "MistralForCausalLM",
            Family::Gemma3 => "Gemma3ForCausalLM",
        }
    }

    fn from_model_type(s: &str) -> Option<Family> {
        Family::ALL.into_iter().find(|f| f.model_type() == s)
    }

    /// Whether the q, k and v projections carry a bias (Qwen2's, always).
    pub fn qkv_bias(self) -> bool {
        self == Family::Qwen2
    }

    /// Whether each query and key head is RMS-normed before the rotary embedding.
    pub fn qk_norm(self) -> bool {
        matches!(self, Family::Qwen3 | Family::Gemma3)
    }

    /// Gemma's layout: RMS norms scale by (1 + w), a norm after attention and after the
    /// MLP, embeddings scaled by √hidden, GELU (tanh) instead of SiLU in the gated MLP.
    pub fn gemma(self) -> bool {
        self == Family::Gemma3
    }
}

/// Why a model's configuration was refused: the file, and the field when one is to blame.
#[derive(Debug, thiserror::Error)]
pub enum ModelConfigError {
    #[error("{}: {message}", path.display())]
    File { path: PathBuf, message: String },
    #[error("{}: `{field}`: {message}", path.display())]
    Field {
        path: PathBuf,
        field: String,
        message: String,
    },
}

impl ModelConfigError {
    /// The offending field (`rope_parameters.rope_type`, `llama.rope.scaling.type`, …).
    pub fn field(&self) -> Option<&str> {
        match self {
            ModelConfigError::File { .. } => None,
            ModelConfigError::Field { field, .. } => Some(field),
        }
    }
}

/// Rotary frequency scaling (`rope_type` other than `default`).
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Every frequency divided by `factor` (position interpolation).
    Linear { factor: f64 },
    /// Llama 3.1's scaling: low frequencies divided by `factor`, high ones kept, a smooth
    /// blend between (Llama-3.2-1B-Instruct: factor 32, low 1, high 4, original 8192).
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
}

impl RopeScaling {
    pub fn rope_type(&self) -> &'static str {
        match self {
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Llama3 { .. } => "llama3",
        }
    }

    /// The HF rope dict's fields for this scaling (`rope_type` and its parameters).
    pub fn to_json(&self) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("rope_type".into(), self.rope_type().into());
        match *self {
            RopeScaling::Linear { factor } => {
                m.insert("factor".into(), factor.into());
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                m.insert("factor".into(), factor.into());
                m.insert("low_freq_factor".into(), low_freq_factor.into());
                m.insert("high_freq_factor".into(), high_freq_factor.into());
                m.insert(
                    "original_max_position_embeddings".into(),
                    original_max_position_embeddings.into(),
                );
            }
        }
        m
    }

    /// The `llama3` scaling whose frequencies equal the base ones divided by GGUF
    /// `rope_freqs` `factors` (what llama.cpp's converter writes instead of the HF dict), if
    /// one of the settings Llama 3.x models use reproduces every factor (1e-4 relative: the
    /// converter computes in f32). `None` when none does.
    pub fn llama3_from_factors(theta: f64, head_dim: usize, factors: &[f32]) -> Option<Self> {
        if factors.len() != head_dim / 2 {
            return None;
        }
        let max = factors.iter().copied().fold(f32::NAN, f32::max);
        // The factor as written (32, not 32.000001).
        let factor = format!("{max}").parse::<f64>().ok()?;
        let base = rope_inv_freqs(theta, head_dim, None);
        let candidates = [1.0, 2.0].into_iter().flat_map(|low| {
            [2.0, 4.0, 8.0].into_iter().flat_map(move |high| {
                [4096, 8192, 16384, 32768]
                    .into_iter()
                    .map(move |orig| RopeScaling::Llama3 {
                        factor,
                        low_freq_factor: low,
                        high_freq_factor: high,
                        original_max_position_embeddings: orig,
                    })
            })
        });
        candidates.into_iter().find(|s| {
            let scaled = rope_inv_freqs(theta, head_dim, Some(s));
            base.iter().zip(&scaled).zip(factors).all(|((b, x), &f)| {
                let want = b / x;
                (want - f64::from(f)).abs() <= 1e-4 * want
            })
        })
    }
}

/// Inverse frequencies of the rotary embedding, `head_dim / 2` of them, as transformers'
/// `ROPE_INIT_FUNCTIONS` compute them (in f64; transformers uses f32, ~1e-7 apart).
pub fn rope_inv_freqs(theta: f64, head_dim: usize, scaling: Option<&RopeScaling>) -> Vec<f64> {
    let d = head_dim as f64;
    let base = (0..head_dim / 2).map(|i| 1.0 / theta.powf(2.0 * i as f64 / d));
    match *scaling.unwrap_or(&RopeScaling::Linear { factor: 1.0 }) {
        RopeScaling::Linear { factor } => base.map(|f| f / factor).collect(),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor: low,
            high_freq_factor: high,
            original_max_position_embeddings: orig,
        } => {
            let orig = orig as f64;
            let (low_wavelen, high_wavelen) = (orig / low, orig / high);
            base.map(|f| {
                let wavelen = 2.0 * std::f64::consts::PI / f;
                if wavelen < high_wavelen {
                    f
                } else if wavelen > low_wavelen {
                    f / factor
                } else {
                    let smooth = (orig / wavelen - low) / (high - low);
                    (1.0 - smooth) * f / factor + smooth * f
                }
            })
            .collect()
        }
    }
}

/// Hyper-parameters of a llama-family model, as an HF `config.json` names them. Built only
/// by [`LlamaConfig::from_hf_json`] / [`LlamaConfig::from_hf_value`] /
/// [`LlamaConfig::from_gguf`], which refuse what we do not implement.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub family: Family,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub rope_scaling: Option<RopeScaling>,
    pub bos_token_id: Option<Value>,
    pub eos_token_id: Option<Value>,
    /// Mistral's `sliding_window`, when the file gives one, and Gemma 3's when a layer slides
    /// (see [`LlamaConfig::context_length`]).
    pub sliding_window: Option<usize>,
    /// Gemma 3: per layer, whether it is a sliding-window layer (rotated with
    /// `local_rope_theta`, unscaled); empty for the other families.
    pub sliding_layers: Vec<bool>,
    /// Gemma 3: the rope base of the sliding-window layers.
    pub local_rope_theta: Option<f64>,
}

/// transformers' `Gemma3TextConfig` defaults: the global and local rope bases, the layer
/// pattern (every sixth layer global; llama.cpp's too), the window, the head dimension and
/// `query_pre_attn_scalar`.
const GEMMA3_GLOBAL_THETA: f64 = 1_000_000.0;
const GEMMA3_LOCAL_THETA: f64 = 10_000.0;
const GEMMA3_PATTERN: usize = 6;
const GEMMA3_WINDOW: usize = 4096;
const GEMMA3_HEAD_DIM: usize = 256;

/// Gemma 3's layer pattern: layer `i` slides unless `(i + 1)` is a multiple of `pattern`.
fn gemma3_pattern(layers: usize, pattern: usize) -> Vec<bool> {
    (0..layers).map(|i| (i + 1) % pattern.max(1) != 0).collect()
}

/// Top-level fields that change the math, with the one value we implement (absent and
/// `null` are that value too, as in transformers' `LlamaConfig`).
const NEUTRAL_FIELDS: &[(&str, Neutral)] = &[
    ("hidden_act", Neutral::Str("silu")),
    ("mlp_bias", Neutral::False),
    // Dropout is active in transformers' training mode; our trainer has none.
    ("attention_dropout", Neutral::Number(0.0)),
    ("partial_rotary_factor", Neutral::Number(1.0)),
    ("use_sliding_window", Neutral::False),
    ("quantization_config", Neutral::Null),
    ("attn_logit_softcapping", Neutral::Null),
    ("final_logit_softcapping", Neutral::Null),
    ("embedding_multiplier", Neutral::Number(1.0)),
    ("residual_multiplier", Neutral::Number(1.0)),
    ("logits_scaling", Neutral::Number(1.0)),
    ("attention_multiplier", Neutral::Null),
];

#[derive(Clone, Copy, Debug)]
enum Neutral {
    Str(&'static str),
    False,
    Number(f64),
    Null,
}

impl Neutral {
    fn accepts(self, v: &Value) -> bool {
        match self {
            Neutral::Str(s) => v.as_str() == Some(s),
            Neutral::False => v.as_bool() == Some(false),
            Neutral::Number(x) => v.as_f64() == Some(x),
            Neutral::Null => false,
        }
    }
    fn describe(self) -> String {
        match self {
            Neutral::Str(s) => format!("only `{s}` is implemented"),
            Neutral::False => "only `false` is implemented".into(),
            Neutral::Number(x) => format!("only {x:?} is implemented"),
            Neutral::Null => "not implemented (only absent or null)".into(),
        }
    }
}

/// Typed access to one JSON object's fields; errors name `prefix` + key.
struct Fields<'a> {
    path: &'a Path,
    obj: &'a Map<String, Value>,
    prefix: &'a str,
}

type Res<T> = Result<T, ModelConfigError>;

impl Fields<'_> {
    fn err(&self, key: &str, message: impl Into<String>) -> ModelConfigError {
        ModelConfigError::Field {
            path: self.path.to_path_buf(),
            field: format!("{}{key}", self.prefix),
            message: message.into(),
        }
    }
    /// The value, `None` when absent or `null` (transformers reads both as unset).
    fn get(&self, key: &str) -> Option<&Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }
    fn required<T>(&self, key: &str, v: Option<T>) -> Res<T> {
        v.ok_or_else(|| self.err(key, "required field missing"))
    }
    fn usize_opt(&self, key: &str) -> Res<Option<usize>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        match v.as_u64().and_then(|n| usize::try_from(n).ok()) {
            Some(n) if n >= 1 => Ok(Some(n)),
            _ => Err(self.err(key, format!("{v}: must be an integer >= 1"))),
        }
    }
    fn usize_req(&self, key: &str) -> Res<usize> {
        let v = self.usize_opt(key)?;
        self.required(key, v)
    }
    fn f64_opt(&self, key: &str, range: Range) -> Res<Option<f64>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        match v.as_f64() {
            Some(x) if range.contains(x) => Ok(Some(x)),
            _ => Err(self.err(key, format!("{v}: {}", range.requirement()))),
        }
    }
    fn f64_req(&self, key: &str, range: Range) -> Res<f64> {
        let v = self.f64_opt(key, range)?;
        self.required(key, v)
    }
    fn bool_opt(&self, key: &str) -> Res<Option<bool>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        v.as_bool()
            .map(Some)
            .ok_or_else(|| self.err(key, format!("{v}: must be true or false")))
    }
    fn str_opt(&self, key: &str) -> Res<Option<&str>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        v.as_str()
            .map(Some)
            .ok_or_else(|| self.err(key, format!("{v}: must be a string")))
    }
}

/// What one rope dict (`rope_parameters` or `rope_scaling`) says.
#[derive(Debug, PartialEq)]
struct RopeDict {
    theta: Option<f64>,
    scaling: Option<RopeScaling>,
}

/// The keys a rope dict of each type may hold (besides `rope_type`/`type`).
fn rope_keys(rope_type: &str) -> &'static [&'static str] {
    match rope_type {
        "default" => &["rope_theta", "partial_rotary_factor"],
        "linear" => &["rope_theta", "partial_rotary_factor", "factor"],
        _ => &[
            "rope_theta",
            "partial_rotary_factor",
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ],
    }
}

fn parse_rope_dict(f: &Fields) -> Res<RopeDict> {
    // transformers reads `type` (≤ 4.4x) as `rope_type`, which wins when both are given.
    let named = f.str_opt("rope_type")?;
    let legacy = f.str_opt("type")?;
    if let (Some(a), Some(b)) = (named, legacy) {
        if a != b {
            return Err(f.err("type", format!("`{b}` disagrees with `rope_type` `{a}`")));
        }
    }
    let rope_type = named.or(legacy).unwrap_or("default");
    let type_key = if named.is_some() { "rope_type" } else { "type" };
    if !ROPE_TYPES.contains(&rope_type) {
        return Err(f.err(
            type_key,
            format!(
                "rope type `{rope_type}` is not supported (supported: {})",
                ROPE_TYPES.join(", ")
            ),
        ));
    }
    let allowed = rope_keys(rope_type);
    for key in f.obj.keys() {
        if key != "rope_type" && key != "type" && !allowed.contains(&key.as_str()) {
            return Err(f.err(
                key,
                format!(
                    "unknown key for rope type `{rope_type}` (accepted: rope_type, {})",
                    allowed.join(", ")
                ),
            ));
        }
    }
    if let Some(p) = f.f64_opt("partial_rotary_factor", Range::finite())? {
        if p != 1.0 {
            return Err(f.err(
                "partial_rotary_factor",
                format!("{p}: partial rotary embeddings are not implemented (only 1.0)"),
            ));
        }
    }
    let theta = f.f64_opt("rope_theta", Range::above(0.0))?;
    let factor = || f.f64_req("factor", Range::above(0.0));
    let scaling = match rope_type {
        "default" => None,
        "linear" => Some(RopeScaling::Linear { factor: factor()? }),
        _ => {
            let low = f.f64_req("low_freq_factor", Range::above(0.0))?;
            let high = f.f64_req("high_freq_factor", Range::above(low))?;
            Some(RopeScaling::Llama3 {
                factor: factor()?,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: f
                    .usize_req("original_max_position_embeddings")?,
            })
        }
    };
    Ok(RopeDict { theta, scaling })
}

/// The rope base and scaling from either form. Both forms at once must agree: transformers 4
/// reads one, transformers 5 the other, so a disagreement has no single meaning.
fn parse_rope(f: &Fields) -> Res<(f64, Option<RopeScaling>)> {
    let top_theta = f.f64_opt("rope_theta", Range::above(0.0))?;
    let mut dicts = Vec::new();
    for key in ["rope_parameters", "rope_scaling"] {
        let Some(v) = f.get(key) else { continue };
        let obj = v
            .as_object()
            .ok_or_else(|| f.err(key, format!("{v}: must be an object")))?;
        let prefix = format!("{key}.");
        let sub = Fields {
            path: f.path,
            obj,
            prefix: &prefix,
        };
        dicts.push((key, parse_rope_dict(&sub)?));
    }
    if let [(_, a), (_, b)] = dicts.as_slice() {
        let differ = a.scaling != b.scaling || a.theta.zip(b.theta).is_some_and(|(x, y)| x != y);
        if differ {
            return Err(f.err(
                "rope_scaling",
                "disagrees with `rope_parameters` (transformers 4 reads one, 5 the other)",
            ));
        }
    }
    let dict_theta = dicts.iter().find_map(|(_, d)| d.theta);
    let (dict_key, scaling) = dicts
        .into_iter()
        .next()
        .map_or(("rope_parameters", None), |(k, d)| (k, d.scaling));
    let theta = match (top_theta, dict_theta) {
        (Some(a), Some(b)) if a != b => {
            return Err(f.err(
                "rope_theta",
                format!("{a} disagrees with `{dict_key}.rope_theta` {b}"),
            ))
        }
        (a, b) => b.or(a).unwrap_or(DEFAULT_ROPE_THETA),
    };
    // transformers gives a top-level `original_max_position_embeddings` priority for llama3.
    if let Some(top) = f.usize_opt("original_max_position_embeddings")? {
        if let Some(RopeScaling::Llama3 {
            original_max_position_embeddings: inner,
            ..
        }) = &scaling
        {
            if top != *inner {
                return Err(f.err(
                    "original_max_position_embeddings",
                    format!("{top} disagrees with `{dict_key}.original_max_position_embeddings` {inner}"),
                ));
            }
        }
    }
    Ok((theta, scaling))
}

/// The fields whose neutral value depends on the family: `attention_bias` (Qwen2 has its q/k/v
/// bias whatever the field says; the others implement none), `sliding_window` (Mistral's is
/// read; Qwen's is unused while `use_sliding_window` is false; llama has none).
fn family_neutral_fields(family: Family) -> &'static [(&'static str, Neutral)] {
    match family {
        Family::Llama => &[
            ("attention_bias", Neutral::False),
            ("sliding_window", Neutral::Null),
        ],
        Family::Qwen2 => &[],
        Family::Qwen3 | Family::Mistral => &[("attention_bias", Neutral::False)],
        Family::Gemma3 => &[
            ("attention_bias", Neutral::False),
            ("hidden_activation", Neutral::Str("gelu_pytorch_tanh")),
            ("hidden_act", Neutral::Str("gelu_pytorch_tanh")),
            ("use_bidirectional_attention", Neutral::False),
        ],
    }
}

/// A config value as an error quotes it: at most 80 bytes of its JSON.
fn clip_json(v: &Value) -> String {
    crate::check::clip(&v.to_string(), 80)
}

fn check_neutral_fields(f: &Fields, family: Family) -> Res<()> {
    // Gemma 3's activation and layer types are its own (checked by the family's entries and
    // `gemma3_layout`).
    let general = NEUTRAL_FIELDS
        .iter()
        .filter(|(key, _)| !(family.gemma() && *key == "hidden_act"));
    for (key, neutral) in general.chain(family_neutral_fields(family)) {
        if let Some(v) = f.get(key) {
            if !neutral.accepts(v) {
                return Err(f.err(key, format!("{v}: {}", neutral.describe())));
            }
        }
    }
    if family.gemma() {
        return Ok(());
    }
    if let Some(v) = f.get("layer_types") {
        let all_full = v
            .as_array()
            .is_some_and(|a| a.iter().all(|t| t.as_str() == Some("full_attention")));
        if !all_full {
            return Err(f.err(
                "layer_types",
                format!(
                    "{}: only `full_attention` layers are implemented",
                    clip_json(v)
                ),
            ));
        }
        let listed = v.as_array().map_or(0, Vec::len);
        if let Some(layers) = f.usize_opt("num_hidden_layers")? {
            if listed != layers {
                return Err(f.err(
                    "layer_types",
                    format!("lists {listed} layer types for {layers} layers (num_hidden_layers)"),
                ));
            }
        }
    }
    Ok(())
}

/// What a Gemma 3 config says about its layers and rotary embeddings.
struct Gemma3Layout {
    sliding_layers: Vec<bool>,
    window: Option<usize>,
    global_theta: f64,
    global_scaling: Option<RopeScaling>,
    local_theta: f64,
}

/// Reads Gemma 3's `layer_types` (or `sliding_window_pattern`), `sliding_window`, rope bases
/// (transformers 5: `rope_parameters.{full,sliding}_attention`; 4: `rope_theta`,
/// `rope_local_base_freq`, `rope_scaling` for the global layers) and checks
/// `query_pre_attn_scalar`.
fn gemma3_layout(f: &Fields, layers: usize, head_dim: usize) -> Res<Gemma3Layout> {
    let sliding_layers = match f.get("layer_types") {
        Some(v) => {
            let kinds = v
                .as_array()
                .filter(|a| a.len() == layers)
                .ok_or_else(|| f.err("layer_types", format!("must list {layers} layer types")))?;
            kinds
                .iter()
                .map(|k| match k.as_str() {
                    Some("sliding_attention") => Ok(true),
                    Some("full_attention") => Ok(false),
                    _ => Err(f.err(
                        "layer_types",
                        format!("{k}: only `sliding_attention` and `full_attention` layers exist"),
                    )),
                })
                .collect::<Res<Vec<bool>>>()?
        }
        None => {
            let pattern = f
                .usize_opt("sliding_window_pattern")?
                .unwrap_or(GEMMA3_PATTERN);
            gemma3_pattern(layers, pattern)
        }
    };
    let window = if sliding_layers.contains(&true) {
        Some(f.usize_opt("sliding_window")?.unwrap_or(GEMMA3_WINDOW))
    } else {
        None
    };
    if window == Some(0) {
        return Err(f.err("sliding_window", "0: must be at least 1"));
    }
    let scalar = f
        .f64_opt("query_pre_attn_scalar", Range::above(0.0))?
        .unwrap_or(GEMMA3_HEAD_DIM as f64);
    if scalar != head_dim as f64 {
        return Err(f.err(
            "query_pre_attn_scalar",
            format!(
                "{scalar}: queries scaled by other than 1/√head_dim ({head_dim}) are not                  implemented"
            ),
        ));
    }
    let nested = f
        .get("rope_parameters")
        .and_then(Value::as_object)
        .filter(|o| o.contains_key("full_attention") || o.contains_key("sliding_attention"));
    let (global, local) = match nested {
        Some(obj) => {
            let part = |kind: &str| -> Res<Option<RopeDict>> {
                let Some(v) = obj.get(kind) else {
                    return Ok(None);
                };
                let key = format!("rope_parameters.{kind}");
                let sub_obj = v
                    .as_object()
                    .ok_or_else(|| f.err(&key, format!("{v}: must be an object")))?;
                let prefix = format!("{key}.");
                parse_rope_dict(&Fields {
                    path: f.path,
                    obj: sub_obj,
                    prefix: &prefix,
                })
                .map(Some)
            };
            let (g, l) = (part("full_attention")?, part("sliding_attention")?);
            if let Some(k) = obj
                .keys()
                .find(|k| *k != "full_attention" && *k != "sliding_attention")
            {
                return Err(f.err(
                    &format!("rope_parameters.{k}"),
                    "unknown layer type (accepted: full_attention, sliding_attention)",
                ));
            }
            let global = g.unwrap_or(RopeDict {
                theta: None,
                scaling: None,
            });
            let local = l.unwrap_or(RopeDict {
                theta: None,
                scaling: None,
            });
            (global, local)
        }
        None => {
            let global = match f.get("rope_scaling").or_else(|| f.get("rope_parameters")) {
                None => RopeDict {
                    theta: None,
                    scaling: None,
                },
                Some(v) => {
                    let key = if f.get("rope_scaling").is_some() {
                        "rope_scaling"
                    } else {
                        "rope_parameters"
                    };
                    let obj = v
                        .as_object()
                        .ok_or_else(|| f.err(key, format!("{v}: must be an object")))?;
                    let prefix = format!("{key}.");
                    parse_rope_dict(&Fields {
                        path: f.path,
                        obj,
                        prefix: &prefix,
                    })?
                }
            };
            let top = f.f64_opt("rope_theta", Range::above(0.0))?;
            let local = RopeDict {
                theta: f.f64_opt("rope_local_base_freq", Range::above(0.0))?,
                scaling: None,
            };
            (
                RopeDict {
                    theta: global.theta.or(top),
                    scaling: global.scaling,
                },
                local,
            )
        }
    };
    if local.scaling.is_some() {
        return Err(f.err(
            "rope_parameters.sliding_attention",
            "a scaled rope on the sliding-window layers is not implemented",
        ));
    }
    Ok(Gemma3Layout {
        sliding_layers,
        window,
        global_theta: global.theta.unwrap_or(GEMMA3_GLOBAL_THETA),
        global_scaling: global.scaling,
        local_theta: local.theta.unwrap_or(GEMMA3_LOCAL_THETA),
    })
}

impl LlamaConfig {
    pub fn num_kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or_else(|| {
            self.hidden_size
                .checked_div(self.num_attention_heads)
                .unwrap_or(0)
        })
    }

    /// Positions a sequence may hold: `max_position_embeddings`, or a shorter sliding window
    /// (Mistral): up to the window's length attention is full, so the model is exact there,
    /// and longer sequences are refused rather than attended differently. Gemma 3's
    /// sliding layers attend within their window ([`LlamaConfig::attention_window`]), so
    /// its window caps nothing.
    pub fn context_length(&self) -> usize {
        match self.sliding_window {
            Some(w) if !self.family.gemma() => w.min(self.max_position_embeddings),
            _ => self.max_position_embeddings,
        }
    }

    /// Gemma 3: layer `i`'s window when it is a sliding-window layer: a query at position
    /// `p` reads the keys at `p − window < j ≤ p` (transformers' sliding mask). `None`: the
    /// layer reads every key up to its own position.
    pub fn attention_window(&self, i: usize) -> Option<usize> {
        if self.family.gemma() && self.layer_slides(i) {
            self.sliding_window
        } else {
            None
        }
    }

    /// Inverse frequencies of the rotary embedding, `head_dim / 2` of them.
    pub fn inv_freqs(&self) -> Vec<f64> {
        rope_inv_freqs(self.rope_theta, self.head_dim(), self.rope_scaling.as_ref())
    }

    /// Gemma 3: the inverse frequencies of the sliding-window layers (their own base,
    /// unscaled); `None` when no layer slides.
    pub fn local_inv_freqs(&self) -> Option<Vec<f64>> {
        if !self.sliding_layers.contains(&true) {
            return None;
        }
        let theta = self.local_rope_theta.unwrap_or(GEMMA3_LOCAL_THETA);
        Some(rope_inv_freqs(theta, self.head_dim(), None))
    }

    /// Whether layer `i` is a sliding-window layer (its rotary table is the local one).
    pub fn layer_slides(&self, i: usize) -> bool {
        self.sliding_layers.get(i).copied().unwrap_or(false)
    }

    /// Reads an HF `config.json`.
    pub fn from_hf_json(path: &Path) -> Result<Self, ModelConfigError> {
        let file_err = |message: String| ModelConfigError::File {
            path: path.to_path_buf(),
            message,
        };
        let text = std::fs::read_to_string(path).map_err(|e| file_err(e.to_string()))?;
        let value: Value =
            serde_json::from_str(&text).map_err(|e| file_err(format!("invalid JSON: {e}")))?;
        Self::from_hf_value(&value, path)
    }

    /// Reads an HF config already parsed; `path` names it in errors.
    pub fn from_hf_value(value: &Value, path: &Path) -> Result<Self, ModelConfigError> {
        let obj = value.as_object().ok_or_else(|| ModelConfigError::File {
            path: path.to_path_buf(),
            message: "not a JSON object".into(),
        })?;
        let f = Fields {
            path,
            obj,
            prefix: "",
        };
        let family = match f.str_opt("model_type")? {
            Some(t) => Family::from_model_type(t).ok_or_else(|| {
                let known: Vec<&str> = Family::ALL.iter().map(|f| f.model_type()).collect();
                f.err(
                    "model_type",
                    format!("`{t}` is not supported (supported: {})", known.join(", ")),
                )
            })?,
            None => return Err(f.err("model_type", "required field missing")),
        };
        check_neutral_fields(&f, family)?;
        let sliding_window = match family {
            Family::Mistral => f.usize_opt("sliding_window")?,
            _ => None,
        };

        let hidden_size = f.usize_req("hidden_size")?;
        let heads = f.usize_req("num_attention_heads")?;
        let layers = f.usize_req("num_hidden_layers")?;
        let head_dim = match (f.usize_opt("head_dim")?, family.gemma()) {
            // transformers' `Gemma3TextConfig` default, not hidden / heads.
            (None, true) => Some(GEMMA3_HEAD_DIM),
            (d, _) => d,
        };
        let gemma = family
            .gemma()
            .then(|| gemma3_layout(&f, layers, head_dim.unwrap_or(GEMMA3_HEAD_DIM)))
            .transpose()?;
        let cfg = Self {
            family,
            sliding_window: gemma.as_ref().map_or(sliding_window, |g| g.window),
            sliding_layers: gemma
                .as_ref()
                .map(|g| g.sliding_layers.clone())
                .unwrap_or_default(),
            local_rope_theta: gemma.as_ref().map(|g| g.local_theta),
            vocab_size: f.usize_req("vocab_size")?,
            hidden_size,
            intermediate_size: f.usize_req("intermediate_size")?,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: f.usize_opt("num_key_value_heads")?,
            head_dim,
            rms_norm_eps: f.f64_req("rms_norm_eps", Range::above(0.0))?,
            max_position_embeddings: f.usize_req("max_position_embeddings")?,
            // Gemma ties its head to the embedding unless the file says otherwise.
            tie_word_embeddings: f.bool_opt("tie_word_embeddings")?.unwrap_or(family.gemma()),
            rope_theta: 0.0,
            rope_scaling: None,
            bos_token_id: f.get("bos_token_id").cloned(),
            eos_token_id: f.get("eos_token_id").cloned(),
        };
        if cfg.head_dim.is_none() && heads != 0 && hidden_size % heads != 0 {
            return Err(f.err(
                "hidden_size",
                format!("{hidden_size} is not a multiple of num_attention_heads {heads}"),
            ));
        }
        let (rope_theta, rope_scaling) = match &gemma {
            Some(g) => (g.global_theta, g.global_scaling.clone()),
            None => parse_rope(&f)?,
        };
        let cfg = Self {
            rope_theta,
            rope_scaling,
            ..cfg
        };
        cfg.check_shape().map_err(|(field, m)| f.err(field, m))?;
        Ok(cfg)
    }

    /// Every size is at least 1 and at most what any real model has, so that nothing is
    /// allocated from a damaged or hostile number (a `max_position_embeddings` of 1e12 would
    /// size the rotary tables at 16 TB and abort the process). Fields by their config.json
    /// names.
    fn check_sizes(&self) -> Result<(), (&'static str, String)> {
        let sizes = [
            ("vocab_size", self.vocab_size, MAX_VOCAB),
            ("hidden_size", self.hidden_size, MAX_WIDTH),
            ("intermediate_size", self.intermediate_size, MAX_WIDTH),
            ("num_hidden_layers", self.num_hidden_layers, MAX_LAYERS),
            ("num_attention_heads", self.num_attention_heads, MAX_HEADS),
            ("num_key_value_heads", self.num_kv_heads(), MAX_HEADS),
            ("head_dim", self.head_dim(), MAX_HEAD_DIM),
            (
                "max_position_embeddings",
                self.max_position_embeddings,
                MAX_POSITIONS,
            ),
        ];
        for (field, value, max) in sizes {
            if value == 0 {
                return Err((field, "0: must be at least 1".into()));
            }
            if value > max {
                return Err((
                    field,
                    format!(
                        "{value} is larger than any model this engine loads (at most {max}); \
                         is the file damaged?"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Head counts and the rotary dimension fit together (both sources).
    fn check_shape(&self) -> Result<(), (&'static str, String)> {
        self.check_sizes()?;
        let (heads, kv) = (self.num_attention_heads, self.num_kv_heads());
        if heads % kv != 0 {
            return Err((
                "num_key_value_heads",
                format!("{kv} does not divide num_attention_heads {heads}"),
            ));
        }
        let hd = self.head_dim();
        if hd == 0 || !hd.is_multiple_of(2) {
            return Err((
                "head_dim",
                format!("{hd}: the rotary embedding needs an even head dimension"),
            ));
        }
        Ok(())
    }

    /// Reads the `<arch>.*` keys of a GGUF file (llama.cpp's names; errors name the key).
    /// llama.cpp writes llama and Mistral models as `llama`, Qwen2/2.5 as `qwen2` and Qwen3
    /// as `qwen3`.
    pub fn from_gguf(content: &gguf_file::Content) -> Result<Self, String> {
        let arch = meta_str(content, "general.architecture").unwrap_or("");
        let family = match arch {
            "llama" => Family::Llama,
            "qwen2" => Family::Qwen2,
            "qwen3" => Family::Qwen3,
            "gemma3" => Family::Gemma3,
            other => {
                return Err(format!(
                    "`general.architecture`: `{other}` is not supported (supported: llama, \
                     qwen2, qwen3, gemma3)"
                ))
            }
        };
        let key = |k: &str| format!("{arch}.{k}");
        let opt_u = |k: &str| meta_u32(content, &key(k)).map(|v| v as usize);
        let req_u = |k: &str| opt_u(k).ok_or_else(|| format!("`{}`: required key missing", key(k)));
        // f32 metadata as the decimal it was written from (1e-5, not 9.99999974e-6), so a
        // converted checkpoint's config.json reads as the original.
        let opt_f = |k: &str| -> Result<Option<f64>, String> {
            let Some(v) = content.metadata.get(k) else {
                return Ok(None);
            };
            let x = v
                .to_f32()
                .map_err(|e| format!("`{k}`: not a 32-bit float: {e}"))?;
            Ok(format!("{x}").parse::<f64>().ok())
        };
        let positive = |k: &str, v: Option<f64>| match v {
            Some(x) if !(x.is_finite() && x > 0.0) => {
                Err(format!("`{k}`: {x}: must be a finite number > 0"))
            }
            v => Ok(v),
        };
        if opt_u("expert_count").unwrap_or(0) > 0 {
            return Err(format!(
                "`{}`: mixture-of-experts models are not supported",
                key("expert_count")
            ));
        }
        let heads = req_u("attention.head_count")?;
        let hidden = req_u("embedding_length")?;
        let vocab = match opt_u("vocab_size") {
            Some(v) => v,
            None => content
                .metadata
                .get("tokenizer.ggml.tokens")
                .and_then(|v| v.to_vec().ok())
                .map(|v| v.len())
                .ok_or_else(|| {
                    format!(
                        "`{}`: missing, and no `tokenizer.ggml.tokens`",
                        key("vocab_size")
                    )
                })?,
        };
        if heads == 0 {
            return Err(format!("`{}`: must be >= 1", key("attention.head_count")));
        }
        let head_dim = opt_u("attention.key_length").unwrap_or(hidden / heads);
        for k in ["attention.value_length", "rope.dimension_count"] {
            if let Some(v) = opt_u(k) {
                if v != head_dim {
                    return Err(format!(
                        "`{}`: {v} differs from the head dimension {head_dim} \
                         (partial rotary embeddings are not implemented)",
                        key(k)
                    ));
                }
            }
        }
        let rms_key = key("attention.layer_norm_rms_epsilon");
        let rms = positive(&rms_key, opt_f(&rms_key)?)?
            .ok_or_else(|| format!("`{rms_key}`: required key missing"))?;
        let theta_key = key("rope.freq_base");
        let layers = req_u("block_count")?;
        let gemma = if family.gemma() {
            Some(gguf_gemma3_layout(
                content, arch, layers, hidden, heads, head_dim, &opt_f,
            )?)
        } else {
            None
        };
        let cfg = Self {
            family,
            sliding_window: gemma.as_ref().and_then(|g| g.window),
            sliding_layers: gemma
                .as_ref()
                .map(|g| g.sliding_layers.clone())
                .unwrap_or_default(),
            local_rope_theta: gemma.as_ref().map(|g| g.local_theta),
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: req_u("feed_forward_length")?,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: Some(opt_u("attention.head_count_kv").unwrap_or(heads)),
            head_dim: Some(head_dim),
            rms_norm_eps: rms,
            rope_theta: positive(&theta_key, opt_f(&theta_key)?)?.unwrap_or(if family.gemma() {
                GEMMA3_GLOBAL_THETA
            } else {
                DEFAULT_ROPE_THETA
            }),
            max_position_embeddings: req_u("context_length")?,
            tie_word_embeddings: !content.tensor_infos.contains_key("output.weight"),
            rope_scaling: gguf_rope_scaling(content, arch, &opt_f)?,
            bos_token_id: None,
            eos_token_id: None,
        };
        if cfg.num_kv_heads() == 0 {
            return Err(format!(
                "`{}`: must be >= 1",
                key("attention.head_count_kv")
            ));
        }
        cfg.check_shape().map_err(|(field, m)| {
            let k = match field {
                "vocab_size" => key("vocab_size"),
                "hidden_size" => key("embedding_length"),
                "intermediate_size" => key("feed_forward_length"),
                "num_hidden_layers" => key("block_count"),
                "num_attention_heads" => key("attention.head_count"),
                "max_position_embeddings" => key("context_length"),
                "head_dim" => key("attention.key_length"),
                _ => key("attention.head_count_kv"),
            };
            format!("`{k}` ({field}): {m}")
        })?;
        Ok(cfg)
    }

    /// [`LlamaConfig::from_gguf`], then [`LlamaConfig::check_gguf_tensors`]: what loading a
    /// GGUF file reads.
    pub fn from_gguf_checked(content: &gguf_file::Content) -> Result<Self, String> {
        let cfg = Self::from_gguf(content)?;
        cfg.check_gguf_tensors(content)?;
        Ok(cfg)
    }

    /// The GGUF file's tensors have the shapes its metadata states, layer by layer, and it
    /// has no layers beyond `block_count` (as safetensors are checked against config.json):
    /// a wrong head count or key length is refused at load, naming the tensor, instead of
    /// failing every request.
    pub fn check_gguf_tensors(&self, content: &gguf_file::Content) -> Result<(), String> {
        let (h, hd) = (self.hidden_size, self.head_dim());
        let (q, kv, im) = (
            self.num_attention_heads * hd,
            self.num_kv_heads() * hd,
            self.intermediate_size,
        );
        let want = |name: &str, dims: &[usize]| -> Result<(), String> {
            let info = content
                .tensor_infos
                .get(name)
                .ok_or_else(|| format!("tensor `{name}` is missing"))?;
            if info.shape.dims() != dims {
                return Err(format!(
                    "tensor `{name}` has shape {:?}, but the metadata implies {dims:?} (check \
                     the head counts, key length and sizes)",
                    info.shape.dims()
                ));
            }
            Ok(())
        };
        want("token_embd.weight", &[self.vocab_size, h])?;
        if content.tensor_infos.contains_key("output.weight") {
            want("output.weight", &[self.vocab_size, h])?;
        }
        want("output_norm.weight", &[h])?;
        for i in 0..self.num_hidden_layers {
            let t = |n: &str| format!("blk.{i}.{n}.weight");
            want(&t("attn_norm"), &[h])?;
            want(&t("ffn_norm"), &[h])?;
            want(&t("attn_q"), &[q, h])?;
            want(&t("attn_k"), &[kv, h])?;
            want(&t("attn_v"), &[kv, h])?;
            want(&t("attn_output"), &[h, q])?;
            want(&t("ffn_gate"), &[im, h])?;
            want(&t("ffn_up"), &[im, h])?;
            want(&t("ffn_down"), &[h, im])?;
            if self.family.qk_norm() {
                want(&t("attn_q_norm"), &[hd])?;
                want(&t("attn_k_norm"), &[hd])?;
            }
            if self.family.gemma() {
                want(&t("post_attention_norm"), &[h])?;
                want(&t("post_ffw_norm"), &[h])?;
            }
        }
        let beyond = format!("blk.{}.", self.num_hidden_layers);
        if let Some(name) = content.tensor_infos.keys().find(|n| n.starts_with(&beyond)) {
            return Err(format!(
                "tensor `{name}` lies beyond the {} layers `block_count` states",
                self.num_hidden_layers
            ));
        }
        Ok(())
    }
}

/// Largest sizes a config may state (well above any released model's).
const MAX_VOCAB: usize = 1 << 22;
const MAX_WIDTH: usize = 1 << 18;
const MAX_LAYERS: usize = 1_024;
const MAX_HEADS: usize = 1_024;
const MAX_HEAD_DIM: usize = 1_024;
/// Qwen2.5-1M declares 1,010,000 positions.
const MAX_POSITIONS: usize = 1 << 21;

/// Gemma 3's layers as llama.cpp reads them: every sixth layer global (an explicit
/// `<arch>.attention.sliding_window_pattern` array wins), the window from
/// `<arch>.attention.sliding_window`, the local rope base from `<arch>.rope.freq_base_swa`
/// (llama.cpp's 10000 when absent). llama.cpp scales the 27B model's queries by
/// hidden / heads rather than the head dimension, which is not implemented.
fn gguf_gemma3_layout(
    content: &gguf_file::Content,
    arch: &str,
    layers: usize,
    hidden: usize,
    heads: usize,
    head_dim: usize,
    opt_f: &dyn Fn(&str) -> Result<Option<f64>, String>,
) -> Result<Gemma3Layout, String> {
    if layers == 62 && hidden / heads != head_dim {
        return Err(format!(
            "`{arch}.block_count`: Gemma 3 27B scales its queries by 1/√(hidden / heads) = \
             1/√{}, not 1/√head_dim; not implemented",
            hidden / heads
        ));
    }
    let pattern_key = format!("{arch}.attention.sliding_window_pattern");
    let sliding_layers = match content.metadata.get(&pattern_key) {
        Some(v) => match v.to_vec() {
            Ok(flags) => {
                let flags: Vec<bool> = flags.iter().filter_map(|f| f.to_bool().ok()).collect();
                if flags.len() != layers {
                    return Err(format!("`{pattern_key}`: must hold {layers} booleans"));
                }
                flags
            }
            Err(_) => gemma3_pattern(
                layers,
                meta_u32(content, &pattern_key).unwrap_or(0) as usize,
            ),
        },
        None => gemma3_pattern(layers, GEMMA3_PATTERN),
    };
    let window_key = format!("{arch}.attention.sliding_window");
    let window = match meta_u32(content, &window_key) {
        Some(0) => return Err(format!("`{window_key}`: 0: must be at least 1")),
        Some(w) => Some(w as usize),
        None if sliding_layers.contains(&true) => {
            return Err(format!("`{window_key}`: required key missing"))
        }
        None => None,
    };
    let local_key = format!("{arch}.rope.freq_base_swa");
    let local_theta = match opt_f(&local_key)? {
        Some(x) if !(x.is_finite() && x > 0.0) => {
            return Err(format!("`{local_key}`: {x}: must be a finite number > 0"))
        }
        Some(x) => x,
        None => GEMMA3_LOCAL_THETA,
    };
    Ok(Gemma3Layout {
        window: window.filter(|_| sliding_layers.contains(&true)),
        sliding_layers,
        global_theta: GEMMA3_GLOBAL_THETA,
        global_scaling: None,
        local_theta,
    })
}

/// `<arch>.rope.scaling.type` (`none` | `linear`; llama.cpp's older `<arch>.rope.scale_linear`
/// too). Llama 3 GGUFs carry their scaling as the `rope_freqs` tensor instead.
fn gguf_rope_scaling(
    content: &gguf_file::Content,
    arch: &str,
    opt_f: &dyn Fn(&str) -> Result<Option<f64>, String>,
) -> Result<Option<RopeScaling>, String> {
    let linear = |key: &str, factor: Option<f64>| match factor {
        Some(f) if f.is_finite() && f > 0.0 => Ok(Some(RopeScaling::Linear { factor: f })),
        Some(f) => Err(format!("`{key}`: {f}: must be a finite number > 0")),
        None => Err(format!("`{key}`: required by a linear rope scaling")),
    };
    let (type_key, old_key) = (
        format!("{arch}.rope.scaling.type"),
        format!("{arch}.rope.scale_linear"),
    );
    match meta_str(content, &type_key) {
        None if content.metadata.contains_key(&old_key) => linear(&old_key, opt_f(&old_key)?),
        None | Some("none") => Ok(None),
        Some("linear") => {
            let key = format!("{arch}.rope.scaling.factor");
            linear(&key, opt_f(&key)?)
        }
        Some(other) => Err(format!(
            "`{type_key}`: `{other}` is not supported (supported: none, linear)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> Value {
        serde_json::json!({
            "model_type": "llama", "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1, "rms_norm_eps": 1e-5, "max_position_embeddings": 64,
        })
    }

    fn read(v: Value) -> Result<LlamaConfig, ModelConfigError> {
        LlamaConfig::from_hf_value(&v, Path::new("m/config.json"))
    }

    #[test]
    fn both_forms_give_the_same_rope() {
        let mut classic = base();
        classic["rope_theta"] = 100000.0.into();
        classic["rope_scaling"] = serde_json::json!({"type": "linear", "factor": 2.0});
        let mut v5 = base();
        v5["rope_parameters"] =
            serde_json::json!({"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0});
        let (a, b) = (read(classic).unwrap(), read(v5).unwrap());
        assert_eq!(a, b);
        assert_eq!(a.rope_theta, 100000.0);
        assert_eq!(a.rope_scaling, Some(RopeScaling::Linear { factor: 2.0 }));
    }

    #[test]
    fn disagreements_are_refused() {
        let mut v = base();
        v["rope_theta"] = 10000.0.into();
        v["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 1e5});
        assert_eq!(read(v).unwrap_err().field(), Some("rope_theta"));
        let mut v = base();
        v["rope_scaling"] = serde_json::json!({"rope_type": "linear", "factor": 2.0});
        v["rope_parameters"] = serde_json::json!({"rope_type": "default"});
        assert_eq!(read(v).unwrap_err().field(), Some("rope_scaling"));
    }

    #[test]
    fn math_fields_and_shapes_are_refused() {
        for (key, val, field) in [
            ("hidden_act", serde_json::json!("gelu"), "hidden_act"),
            ("mlp_bias", true.into(), "mlp_bias"),
            ("sliding_window", 4096.into(), "sliding_window"),
            ("head_dim", 3.into(), "head_dim"),
            ("num_key_value_heads", 3.into(), "num_key_value_heads"),
            ("rms_norm_eps", (-1.0).into(), "rms_norm_eps"),
            ("model_type", "gemma2".into(), "model_type"),
        ] {
            let mut v = base();
            v[key] = val;
            let err = read(v).unwrap_err();
            assert_eq!(err.field(), Some(field), "{err}");
            assert!(err.to_string().starts_with("m/config.json: "), "{err}");
        }
        let mut v = base();
        v["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0});
        assert_eq!(
            read(v).unwrap_err().field(),
            Some("rope_scaling.low_freq_factor")
        );
    }

    /// Sizes no model has are refused by field before anything is allocated from them.
    #[test]
    fn absurd_sizes_are_refused_by_name() {
        for (key, val) in [
            ("max_position_embeddings", 1_000_000_000_000u64),
            ("num_hidden_layers", 4_000_000_000),
            ("vocab_size", 1 << 40),
            ("num_attention_heads", 0),
            ("max_position_embeddings", 0),
            ("num_hidden_layers", 0),
        ] {
            let mut v = base();
            v[key] = val.into();
            let err = read(v).unwrap_err();
            assert_eq!(err.field(), Some(key), "{err}");
        }
        use gguf_file::Value as V;
        for (key, val) in [
            ("llama.context_length", u32::MAX),
            ("llama.block_count", 4_000_000_000),
            ("llama.context_length", 0),
            ("llama.block_count", 0),
        ] {
            let err = LlamaConfig::from_gguf(&gguf(&[(key, V::U32(val))])).unwrap_err();
            assert!(err.starts_with(&format!("`{key}`")), "{err}");
        }
    }

    /// A GGUF whose tensors do not match its metadata is refused at load, naming the tensor.
    #[test]
    fn gguf_tensor_shapes_are_checked_against_the_metadata() {
        use candle_core::quantized::GgmlDType;
        use gguf_file::Value as V;
        let with_tensors = |content: &mut gguf_file::Content, layers: usize, q_rows: usize| {
            let mut put = |name: String, dims: Vec<usize>| {
                content.tensor_infos.insert(
                    name,
                    gguf_file::TensorInfo {
                        ggml_dtype: GgmlDType::F32,
                        shape: dims.into(),
                        offset: 0,
                    },
                );
            };
            put("token_embd.weight".into(), vec![10, 8]);
            put("output_norm.weight".into(), vec![8]);
            for i in 0..layers {
                for (n, dims) in [
                    ("attn_norm", vec![8]),
                    ("ffn_norm", vec![8]),
                    ("attn_q", vec![q_rows, 8]),
                    ("attn_k", vec![4, 8]),
                    ("attn_v", vec![4, 8]),
                    ("attn_output", vec![8, 8]),
                    ("ffn_gate", vec![16, 8]),
                    ("ffn_up", vec![16, 8]),
                    ("ffn_down", vec![8, 16]),
                ] {
                    put(format!("blk.{i}.{n}.weight"), dims);
                }
            }
        };
        let mut good = gguf(&[]);
        with_tensors(&mut good, 1, 8);
        let cfg = LlamaConfig::from_gguf(&good).unwrap();
        cfg.check_gguf_tensors(&good).unwrap();
        // A head count or key length the tensors do not have.
        for (meta, tensor) in [
            (
                ("llama.attention.head_count", V::U32(4)),
                "blk.0.attn_k.weight",
            ),
            (
                ("llama.attention.key_length", V::U32(2)),
                "blk.0.attn_q.weight",
            ),
        ] {
            let mut wrong = gguf(&[meta]);
            with_tensors(&mut wrong, 1, 8);
            let cfg = LlamaConfig::from_gguf(&wrong).unwrap();
            let err = cfg.check_gguf_tensors(&wrong).unwrap_err();
            assert!(err.contains(tensor), "{err}");
        }
        // More layers in the file than block_count says.
        let mut extra = gguf(&[]);
        with_tensors(&mut extra, 2, 8);
        let cfg = LlamaConfig::from_gguf(&extra).unwrap();
        let err = cfg.check_gguf_tensors(&extra).unwrap_err();
        assert!(
            err.contains("blk.1.") && err.contains("block_count"),
            "{err}"
        );
        // Fewer.
        let mut fewer = gguf(&[("llama.block_count", V::U32(2))]);
        with_tensors(&mut fewer, 1, 8);
        let cfg = LlamaConfig::from_gguf(&fewer).unwrap();
        let err = cfg.check_gguf_tensors(&fewer).unwrap_err();
        assert!(
            err.contains("blk.1.attn_norm.weight") && err.contains("missing"),
            "{err}"
        );
    }

    fn gguf(extra: &[(&str, gguf_file::Value)]) -> gguf_file::Content {
        use gguf_file::Value as V;
        let mut metadata: std::collections::HashMap<String, V> = [
            ("general.architecture", V::String("llama".into())),
            ("llama.attention.head_count", V::U32(2)),
            ("llama.attention.head_count_kv", V::U32(1)),
            ("llama.embedding_length", V::U32(8)),
            ("llama.feed_forward_length", V::U32(16)),
            ("llama.block_count", V::U32(1)),
            ("llama.context_length", V::U32(64)),
            ("llama.vocab_size", V::U32(10)),
            ("llama.rope.freq_base", V::F32(100000.0)),
            ("llama.attention.layer_norm_rms_epsilon", V::F32(1e-5)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        for (k, v) in extra {
            metadata.insert(k.to_string(), v.clone());
        }
        gguf_file::Content {
            magic: gguf_file::VersionedMagic::GgufV3,
            metadata,
            tensor_infos: Default::default(),
            tensor_data_offset: 0,
        }
    }

    #[test]
    fn gguf_rope_keys_are_read_or_refused() {
        use gguf_file::Value as V;
        let c = LlamaConfig::from_gguf(&gguf(&[])).unwrap();
        assert_eq!(
            (c.rope_theta, c.rms_norm_eps, c.rope_scaling),
            (1e5, 1e-5, None)
        );
        let c = LlamaConfig::from_gguf(&gguf(&[
            ("llama.rope.scaling.type", V::String("linear".into())),
            ("llama.rope.scaling.factor", V::F32(4.0)),
        ]))
        .unwrap();
        assert_eq!(c.rope_scaling, Some(RopeScaling::Linear { factor: 4.0 }));
        for (extra, key) in [
            (
                ("llama.rope.scaling.type", V::String("yarn".into())),
                "llama.rope.scaling.type",
            ),
            (
                ("llama.rope.dimension_count", V::U32(2)),
                "llama.rope.dimension_count",
            ),
            (
                ("llama.rope.scaling.type", V::String("linear".into())),
                "llama.rope.scaling.factor",
            ),
        ] {
            let err = LlamaConfig::from_gguf(&gguf(&[extra])).unwrap_err();
            assert!(err.contains(&format!("`{key}`")), "{err}");
        }
        let mut no_eps = gguf(&[]);
        no_eps
            .metadata
            .remove("llama.attention.layer_norm_rms_epsilon");
        let err = LlamaConfig::from_gguf(&no_eps).unwrap_err();
        assert!(err.contains("layer_norm_rms_epsilon"), "{err}");
    }

    #[test]
    fn gguf_rope_freqs_are_recognised_as_their_llama3_scaling() {
        let s = RopeScaling::Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        // llama.cpp's converter: base / scaled frequency, in f32.
        let base = rope_inv_freqs(500000.0, 64, None);
        let scaled = rope_inv_freqs(500000.0, 64, Some(&s));
        let factors: Vec<f32> = base
            .iter()
            .zip(&scaled)
            .map(|(b, x)| (b / x) as f32)
            .collect();
        assert_eq!(
            RopeScaling::llama3_from_factors(500000.0, 64, &factors),
            Some(s)
        );
        let odd: Vec<f32> = (0..32).map(|i| 1.0 + i as f32 * 0.37).collect();
        assert_eq!(RopeScaling::llama3_from_factors(500000.0, 64, &odd), None);
    }

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let s = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let plain = rope_inv_freqs(500000.0, 64, None);
        let scaled = rope_inv_freqs(500000.0, 64, Some(&s));
        assert_eq!(scaled[0], plain[0]);
        assert!((scaled[31] - plain[31] / 8.0).abs() < 1e-18);
    }
}
