//! A trainable llama-family model (SmolLM2, Llama 2/3, TinyLlama, Qwen2/2.5, Qwen3, Mistral,
//! Gemma 3;
//! [`crate::engine::config::Family`] says what each adds) built from differentiable ops only
//! (never candle-nn's fast kernels, which have no backward and silently cut the
//! gradient): the ops of [`super::ops`], each with an explicit backward, and `rope_slow`.
//!
//! Every weight is a [`Var`] in a [`VarMap`] under its HF name (`model.embed_tokens.weight`,
//! `model.layers.N.self_attn.q_proj.weight`, …, `lm_head.weight` only when the head is not
//! tied to the embedding). The model works in the HF layout (half-split rotary embedding);
//! GGUF checkpoints are dequantized and their Q/K rows un-permuted at load, so an export is a
//! plain HF checkpoint.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Result, Tensor, Var};
use candle_nn::VarMap;

use std::sync::atomic::{AtomicBool, Ordering};

use super::error::TrainError;
use crate::engine::llama::{local_rope_tables, rope_tables, LlamaConfig, RopeScaling};
use crate::engine::peft::{peft_tensor_name, AdapterConfig};

/// Additive bias for masked attention scores. Finite, so that a row whose keys are all masked
/// (a left-padded query) gives a uniform distribution instead of NaN; `exp` of it is 0 in f32.
const MASKED: f64 = -1e9;

struct TrainLayer {
    input_norm: Tensor,
    /// The norm before the MLP (`post_attention_layernorm`; Gemma's
    /// `pre_feedforward_layernorm`).
    post_norm: Tensor,
    /// Gemma: the norms of the attention's and the MLP's outputs
    /// (`post_attention_layernorm`, `post_feedforward_layernorm`).
    attn_out_norm: Option<Tensor>,
    mlp_out_norm: Option<Tensor>,
    /// Gemma 3: a sliding-window layer (rotated with the local rope tables).
    sliding: bool,
    /// Per-head RMS-norm weights of the queries and keys (Qwen3, Gemma 3).
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    q: Proj,
    k: Proj,
    v: Proj,
    o: Proj,
    gate: Proj,
    up: Proj,
    down: Proj,
}

impl TrainLayer {
    fn proj_mut(&mut self, target: &str) -> &mut Proj {
        match target {
            "q_proj" => &mut self.q,
            "k_proj" => &mut self.k,
            "v_proj" => &mut self.v,
            "o_proj" => &mut self.o,
            "gate_proj" => &mut self.gate,
            "up_proj" => &mut self.up,
            _ => &mut self.down,
        }
    }
}

/// How the tokens of a batch see each other.
#[derive(Clone, Debug)]
pub struct BatchLayout {
    /// Additive attention bias (batch, 1, seq, seq): 0 where a query may read a key, a large
    /// negative number elsewhere.
    pub bias: Tensor,
    /// Each token's rotary position (batch, seq) u32; `None`: 0, 1, … in every row.
    pub positions: Option<Tensor>,
    /// Rows packed as a shared prompt and segments that each read only the prompt and
    /// themselves: attention then runs per segment (see [`RowBlocks`]) instead of over the
    /// whole row with most of it masked.
    pub blocks: Option<Vec<RowBlocks>>,
}

/// One packed row: the prompt `0..prompt`, then segments `(start, len)` back to back, then
/// padding. A segment's queries read the prompt and the segment's own earlier tokens.
///
/// Why: n responses packed after their prompt make a row of P + n·R tokens whose dense
/// attention scores (kept for the backward pass) grow with (P + n·R)², though each
/// response reads only P + R keys; per segment they grow with n·R·(P + R). For 8 responses
/// of 64 tokens after a 40-token prompt that is 5.5× less attention memory and arithmetic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowBlocks {
    pub prompt: usize,
    pub segments: Vec<(usize, usize)>,
}

impl RowBlocks {
    /// The blocks of a row of segment ids, when it has the packed shape: segment 0 first,
    /// each later segment contiguous and seen once, padding (`None`) only at the end.
    fn of(segs: &[Option<u8>]) -> Option<RowBlocks> {
        let prompt = segs.iter().take_while(|s| **s == Some(0)).count();
        if prompt == 0 {
            return None;
        }
        let mut segments: Vec<(usize, usize)> = Vec::new();
        let mut seen = Vec::new();
        let mut i = prompt;
        while i < segs.len() {
            let Some(id) = segs[i] else { break };
            if id == 0 || seen.contains(&id) {
                return None;
            }
            seen.push(id);
            let len = segs[i..].iter().take_while(|s| **s == Some(id)).count();
            segments.push((i, len));
            i += len;
        }
        if segs[i..].iter().any(Option::is_some) {
            return None;
        }
        Some(RowBlocks { prompt, segments })
    }
}

impl BatchLayout {
    /// Independent right-padded rows: causal attention, padded keys masked out (`mask`
    /// (batch, seq), 1 for real tokens, 0 for padding, any dtype), positions from 0.
    pub fn padded(b: usize, seq: usize, mask: Option<&Tensor>, device: &Device) -> Result<Self> {
        let causal: Vec<f32> = (0..seq)
            .flat_map(|i| (0..seq).map(move |j| if j <= i { 0.0 } else { MASKED as f32 }))
            .collect();
        let causal = Tensor::from_vec(causal, (1, 1, seq, seq), device)?;
        let bias = match mask {
            None => causal.broadcast_as((b, 1, seq, seq))?.contiguous()?,
            Some(m) => {
                let keys = m
                    .to_dtype(DType::F32)?
                    .affine(-MASKED, MASKED)? // 1 → 0, 0 → MASKED
                    .reshape((b, 1, 1, seq))?;
                causal.broadcast_add(&keys)?
            }
        };
        Ok(Self {
            bias,
            positions: None,
            blocks: None,
        })
    }

    /// Rows whose tokens belong to segments: a query reads the keys at or before it that are
    /// in its own segment or in the shared segment `0` (a prompt read by every completion
    /// packed after it); `segments` (batch, seq) with `None` for padding, `positions` each
    /// token's rotary position.
    pub fn segmented(
        segments: &[Vec<Option<u8>>],
        positions: Vec<u32>,
        device: &Device,
    ) -> Result<Self> {
        let b = segments.len();
        let seq = segments.first().map_or(0, Vec::len);
        let mut bias = vec![MASKED as f32; b * seq * seq];
        for (r, segs) in segments.iter().enumerate() {
            for (i, qi) in segs.iter().enumerate() {
                let row = &mut bias[(r * seq + i) * seq..(r * seq + i + 1) * seq];
                for (j, kj) in segs.iter().enumerate().take(i + 1) {
                    if matches!(kj, Some(0)) || (kj.is_some() && kj == qi) {
                        row[j] = 0.0;
                    }
                }
            }
        }
        let blocks = segments
            .iter()
            .map(|s| RowBlocks::of(s))
            .collect::<Option<Vec<_>>>();
        Ok(Self {
            bias: Tensor::from_vec(bias, (b, 1, seq, seq), device)?,
            positions: Some(Tensor::from_vec(positions, (b, seq), device)?),
            blocks,
        })
    }
}

/// Per-forward tensors every layer reads.
struct LayerContext {
    bias: Tensor,
    cos: Tensor,
    sin: Tensor,
    /// Gemma 3: the sliding-window layers' rope tables.
    local: Option<(Tensor, Tensor)>,
    /// Gemma 3: `bias` with the keys outside the sliding window masked too, when the rows
    /// reach past it.
    local_bias: Option<Tensor>,
    /// Per row, per block: (first query, queries, the block's keys as ranges of the row,
    /// its bias (1, 1, queries, keys)); `None`: dense attention over `bias`.
    blocks: Option<Vec<Vec<Block>>>,
}

/// One attention block of a packed row.
struct Block {
    start: usize,
    len: usize,
    keys: Vec<(usize, usize)>,
    bias: Tensor,
    /// Gemma 3's sliding layers: `bias` within the window, when the block reaches past it.
    local_bias: Option<Tensor>,
}

impl Block {
    /// Queries `start..start + len` reading the keys in `shared` (all visible) and their own
    /// range (causally); with a `window`, the sliding layers' bias too (query `i` sits at
    /// position `p + i`, key column `c` at position `c`).
    fn new(
        start: usize,
        len: usize,
        shared: Option<usize>,
        window: Option<usize>,
        dtype: DType,
        dev: &Device,
    ) -> Result<Self> {
        let p = shared.unwrap_or(0);
        let width = p + len;
        let mut bias = vec![MASKED as f32; len * width];
        for i in 0..len {
            let row = &mut bias[i * width..(i + 1) * width];
            row[..p + i + 1].fill(0.0);
        }
        let local_bias = match window {
            Some(w) if width > w => {
                let mut local = bias.clone();
                for i in 0..len {
                    let first = (p + i + 1).saturating_sub(w);
                    local[i * width..i * width + first].fill(MASKED as f32);
                }
                Some(Tensor::from_vec(local, (1, 1, len, width), dev)?.to_dtype(dtype)?)
            }
            _ => None,
        };
        let mut keys = Vec::with_capacity(2);
        if p > 0 {
            keys.push((0, p));
        }
        keys.push((start, len));
        Ok(Block {
            start,
            len,
            keys,
            bias: Tensor::from_vec(bias, (1, 1, len, width), dev)?.to_dtype(dtype)?,
            local_bias,
        })
    }
}

/// `layout`'s bias with the keys a sliding window of `window` positions leaves out masked
/// too: a query at rotary position `p` reads keys at positions `p − window < q ≤ p`
/// (positions 0, 1, … when the layout gives none).
fn window_bias(layout: &BatchLayout, window: usize) -> Result<Tensor> {
    let (b, _, seq, _) = layout.bias.dims4()?;
    let positions: Vec<u32> = match &layout.positions {
        Some(p) => p.flatten_all()?.to_vec1()?,
        None => (0..b).flat_map(|_| 0..seq as u32).collect(),
    };
    let mut extra = vec![0f32; b * seq * seq];
    for r in 0..b {
        let pos = &positions[r * seq..(r + 1) * seq];
        for (i, &pi) in pos.iter().enumerate() {
            let row = &mut extra[(r * seq + i) * seq..(r * seq + i + 1) * seq];
            for (j, &pj) in pos.iter().enumerate() {
                if pj as usize + window <= pi as usize {
                    row[j] = MASKED as f32;
                }
            }
        }
    }
    let extra = Tensor::from_vec(extra, (b, 1, seq, seq), layout.bias.device())?;
    layout.bias.to_dtype(DType::F32)? + extra
}

/// A projection weight (out, in), its bias (Qwen2's q/k/v) and, once LoRA is enabled on it,
/// its adapter.
struct Proj {
    w: Tensor,
    bias: Option<Tensor>,
    lora: Option<LoraPair>,
}

/// LoRA matrices of one projection: A (r, in), B (out, r).
struct LoraPair {
    a: Var,
    b: Var,
}

impl Proj {
    fn new(w: Tensor) -> Self {
        Self {
            w,
            bias: None,
            lora: None,
        }
    }
    fn with_bias(w: Tensor, bias: Option<Tensor>) -> Self {
        Self {
            w,
            bias,
            lora: None,
        }
    }
}

/// LoRA state of a model: its PEFT config and whether the adapters take part in forward
/// passes (off = the base model, DPO's reference) and dropout is active (training only).
struct LoraState {
    config: AdapterConfig,
    /// PEFT names and variables, in a fixed order.
    vars: Vec<(String, Var)>,
    enabled: AtomicBool,
    dropout_active: AtomicBool,
}

/// A llama whose weights are trainable variables. Forward passes return the logits of every
/// position.
pub struct TrainLlama {
    cfg: LlamaConfig,
    varmap: VarMap,
    /// Variable names in a fixed order (embedding, layers, final norm, head).
    names: Vec<String>,
    embed: Tensor,
    layers: Vec<TrainLayer>,
    norm: Tensor,
    lm_head: Option<Tensor>,
    cos: Tensor,
    sin: Tensor,
    /// Gemma 3: the sliding-window layers' rope tables.
    local_rope: Option<(Tensor, Tensor)>,
    /// GGUF `rope_freqs` factors the tables were built with (Llama 3 GGUFs), if any.
    rope_factors: Option<Vec<f32>>,
    dtype: DType,
    device: Device,
    lora: Option<LoraState>,
    /// The float type checkpoints are written in: the source checkpoint's (f32 for GGUF)
    /// unless [`TrainLlama::set_save_dtype`] says otherwise.
    save_dtype: DType,
}

use crate::engine::checkpoint::expected_shape;
pub use crate::engine::checkpoint::hf_tensor_names;

pub use crate::engine::llama::{permute_hf_qk, unpermute_gguf_qk};

use super::ops::linear;
pub use super::ops::{log_softmax_last_dim, softmax_last_dim};

impl TrainLlama {
    /// Builds the model from HF-named tensors (converted to `dtype`).
    pub fn from_tensors(
        cfg: LlamaConfig,
        mut tensors: HashMap<String, Tensor>,
        factors: Option<Vec<f32>>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        if !cfg.num_attention_heads.is_multiple_of(cfg.num_kv_heads()) {
            candle_core::bail!("attention heads must be a multiple of the key/value heads");
        }
        if !cfg.tie_word_embeddings && !tensors.contains_key("lm_head.weight") {
            // transformers would start such a head from random values: never guess.
            candle_core::bail!("{}", crate::engine::llama::UNTIED_WITHOUT_HEAD);
        }
        let names = hf_tensor_names(&cfg);
        let varmap = VarMap::new();
        let mut get = |name: &str| -> Result<Tensor> {
            let t = tensors
                .remove(name)
                .ok_or_else(|| candle_core::Error::Msg(format!("missing tensor `{name}`")))?;
            let want = expected_shape(&cfg, name);
            if t.dims() != want.as_slice() {
                candle_core::bail!(
                    "tensor `{name}` has shape {:?}, expected {want:?}",
                    t.dims()
                );
            }
            let var = Var::from_tensor(&t.to_dtype(dtype)?.to_device(device)?.contiguous()?)?;
            let out = var.as_tensor().clone();
            varmap
                .data()
                .lock()
                .expect("var map lock")
                .insert(name.to_string(), var);
            Ok(out)
        };
        let embed = get("model.embed_tokens.weight")?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let (bias, norm) = (cfg.family.qkv_bias(), cfg.family.qk_norm());
            let mut opt = |n: &str, on: bool| -> Result<Option<Tensor>> {
                on.then(|| get(&format!("{p}.{n}"))).transpose()
            };
            let (q_bias, k_bias, v_bias) = (
                opt("self_attn.q_proj.bias", bias)?,
                opt("self_attn.k_proj.bias", bias)?,
                opt("self_attn.v_proj.bias", bias)?,
            );
            let (q_norm, k_norm) = (
                opt("self_attn.q_norm.weight", norm)?,
                opt("self_attn.k_norm.weight", norm)?,
            );
            let mut g = |n: &str| get(&format!("{p}.{n}.weight"));
            let (post_norm, attn_out_norm, mlp_out_norm) = if cfg.family.gemma() {
                (
                    g("pre_feedforward_layernorm")?,
                    Some(g("post_attention_layernorm")?),
                    Some(g("post_feedforward_layernorm")?),
                )
            } else {
                (g("post_attention_layernorm")?, None, None)
            };
            layers.push(TrainLayer {
                input_norm: g("input_layernorm")?,
                post_norm,
                attn_out_norm,
                mlp_out_norm,
                sliding: cfg.layer_slides(i),
                q_norm,
                k_norm,
                q: Proj::with_bias(g("self_attn.q_proj")?, q_bias),
                k: Proj::with_bias(g("self_attn.k_proj")?, k_bias),
                v: Proj::with_bias(g("self_attn.v_proj")?, v_bias),
                o: Proj::new(g("self_attn.o_proj")?),
                gate: Proj::new(g("mlp.gate_proj")?),
                up: Proj::new(g("mlp.up_proj")?),
                down: Proj::new(g("mlp.down_proj")?),
            });
        }
        let norm = get("model.norm.weight")?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(get("lm_head.weight")?)
        };
        let (cos, sin) = rope_tables(&cfg, factors.clone(), device)?;
        let local_rope = match local_rope_tables(&cfg, device)? {
            Some((c, s)) => Some((c.to_dtype(dtype)?, s.to_dtype(dtype)?)),
            None => None,
        };
        Ok(Self {
            local_rope,
            cfg,
            rope_factors: factors,
            varmap,
            names,
            embed,
            layers,
            norm,
            lm_head,
            cos: cos.to_dtype(dtype)?,
            sin: sin.to_dtype(dtype)?,
            dtype,
            device: device.clone(),
            lora: None,
            save_dtype: DType::F32,
        })
    }

    /// Loads an HF checkpoint directory: `config.json` and `model.safetensors` (or every
    /// `*.safetensors` shard in it).
    pub fn from_hf_dir(
        dir: &Path,
        dtype: DType,
        device: &Device,
    ) -> std::result::Result<Self, TrainError> {
        // A checkpoint this toolkit saved lists its files' SHA-256: train from it only whole.
        crate::run::verify_checksums(dir).map_err(|m| TrainError::input(dir, m))?;
        let cfg = LlamaConfig::from_hf_json(&dir.join("config.json"))?;
        let files = safetensors_files(dir)?;
        let mut tensors = HashMap::new();
        for f in &files {
            tensors.extend(
                candle_core::safetensors::load(f, device)
                    .map_err(|e| TrainError::input(f, e.to_string()))?,
            );
        }
        // Checkpoints keep the float type the weights came in (a bf16 base stays bf16).
        let source = tensors
            .get("model.embed_tokens.weight")
            .map(Tensor::dtype)
            .filter(|d| matches!(d, DType::F32 | DType::BF16 | DType::F16))
            .unwrap_or(DType::F32);
        let mut model = Self::from_tensors(cfg, tensors, None, dtype, device)?;
        model.save_dtype = source;
        Ok(model)
    }

    /// Loads a llama GGUF file, dequantizing every tensor and converting the Q/K rows to the
    /// HF layout.
    pub fn from_gguf(
        path: &Path,
        dtype: DType,
        device: &Device,
    ) -> std::result::Result<Self, TrainError> {
        let (cfg, tensors, factors) = crate::engine::llama::hf_tensors_from_gguf(path, device)
            .map_err(|e| TrainError::input(path, e))?;
        Ok(Self::from_tensors(cfg, tensors, factors, dtype, device)?)
    }

    /// An independent copy of the current weights (new variables, no shared storage): the
    /// frozen reference model of DPO when its log-probs are not precomputed.
    pub fn detached_copy(&self) -> Result<Self> {
        Self::from_tensors(
            self.cfg.clone(),
            // Detached tensors share storage; `Var::from_tensor` copies it.
            self.hf_tensors()?,
            self.rope_factors.clone(),
            self.dtype,
            &self.device,
        )
    }

    /// The float type [`TrainLlama::save_hf`] writes weights in.
    pub fn save_dtype(&self) -> DType {
        self.save_dtype
    }

    /// Writes checkpoints in `dtype` (f32, bf16 or f16) instead of the source's float type.
    pub fn set_save_dtype(&mut self, dtype: DType) {
        self.save_dtype = dtype;
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }
    /// GGUF `rope_freqs` factors the model was loaded with, if any.
    pub fn rope_factors(&self) -> Option<&[f32]> {
        self.rope_factors.as_deref()
    }
    pub fn device(&self) -> &Device {
        &self.device
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn varmap(&self) -> &VarMap {
        &self.varmap
    }
    /// HF names of the trainable tensors, in a fixed order.
    pub fn var_names(&self) -> &[String] {
        &self.names
    }
    /// The trainable variables (the LoRA matrices once LoRA is enabled), in a fixed order
    /// (for an optimizer).
    pub fn vars(&self) -> Vec<Var> {
        self.named_vars().into_iter().map(|(_, v)| v).collect()
    }
    /// `(name, variable)` pairs of the trainable tensors: HF names, or PEFT names with LoRA.
    pub fn named_vars(&self) -> Vec<(String, Var)> {
        if let Some(l) = &self.lora {
            return l.vars.clone();
        }
        self.base_named_vars()
    }
    /// The base weights under their HF names, in [`Self::var_names`] order.
    fn base_named_vars(&self) -> Vec<(String, Var)> {
        let data = self.varmap.data().lock().expect("var map lock");
        self.names
            .iter()
            .map(|n| (n.clone(), data[n].clone()))
            .collect()
    }

    /// Adds LoRA adapters (PEFT initialisation: A ~ U(±1/√in) from `seed`, B = 0, so the
    /// model is unchanged) on `config.target_modules` of every layer and freezes the base
    /// weights: from now on only the adapters are trainable.
    pub fn enable_lora(&mut self, config: AdapterConfig, seed: u64) -> Result<()> {
        use rand::{Rng, SeedableRng};
        if self.lora.is_some() {
            candle_core::bail!("LoRA is already enabled");
        }
        for t in &config.target_modules {
            if !crate::engine::peft::LORA_TARGETS.contains(&t.as_str()) {
                candle_core::bail!(
                    "unknown LoRA target `{t}` (known: {})",
                    crate::engine::peft::LORA_TARGETS.join(", ")
                );
            }
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let r = config.r;
        let mut vars = Vec::new();
        let (dtype, device) = (self.dtype, self.device.clone());
        for (i, layer) in self.layers.iter_mut().enumerate() {
            for target in crate::engine::peft::LORA_TARGETS {
                if !config.target_modules.iter().any(|t| t == target) {
                    continue;
                }
                let p = layer.proj_mut(target);
                let (out_dim, in_dim) = p.w.dims2()?;
                let bound = 1.0 / (in_dim as f32).sqrt();
                let a: Vec<f32> = (0..r * in_dim)
                    .map(|_| rng.random_range(-bound..bound))
                    .collect();
                let a =
                    Var::from_tensor(&Tensor::from_vec(a, (r, in_dim), &device)?.to_dtype(dtype)?)?;
                let b = Var::zeros((out_dim, r), dtype, &device)?;
                vars.push((peft_tensor_name(i, target, "A"), a.clone()));
                vars.push((peft_tensor_name(i, target, "B"), b.clone()));
                p.lora = Some(LoraPair { a, b });
            }
        }
        self.freeze_base();
        self.lora = Some(LoraState {
            config,
            vars,
            enabled: AtomicBool::new(true),
            dropout_active: AtomicBool::new(false),
        });
        Ok(())
    }

    /// Base weights become plain tensors (same storage): no gradient is computed for them.
    fn freeze_base(&mut self) {
        self.embed = self.embed.detach();
        self.norm = self.norm.detach();
        self.lm_head = self.lm_head.as_ref().map(|t| t.detach());
        for l in &mut self.layers {
            l.input_norm = l.input_norm.detach();
            l.post_norm = l.post_norm.detach();
            l.q_norm = l.q_norm.as_ref().map(Tensor::detach);
            l.k_norm = l.k_norm.as_ref().map(Tensor::detach);
            for t in crate::engine::peft::LORA_TARGETS {
                let p = l.proj_mut(t);
                p.w = p.w.detach();
                p.bias = p.bias.as_ref().map(Tensor::detach);
            }
        }
    }

    /// The LoRA config, when LoRA is enabled.
    pub fn lora_config(&self) -> Option<&AdapterConfig> {
        self.lora.as_ref().map(|l| &l.config)
    }

    /// Switches the adapters on or off (off = the frozen base model). No-op without LoRA.
    pub fn set_adapters_enabled(&self, on: bool) {
        if let Some(l) = &self.lora {
            l.enabled.store(on, Ordering::Relaxed);
        }
    }

    /// Training mode turns LoRA dropout on (the base model has no dropout).
    pub fn set_training(&self, on: bool) {
        if let Some(l) = &self.lora {
            l.dropout_active.store(on, Ordering::Relaxed);
        }
    }

    /// Sets trainable tensors by name (a checkpoint being resumed, or a saved adapter): every
    /// trainable tensor must be present with its shape.
    pub fn load_trainable(&self, tensors: &HashMap<String, Tensor>) -> Result<()> {
        for (name, var) in self.named_vars() {
            let t = tensors
                .get(&name)
                .ok_or_else(|| candle_core::Error::Msg(format!("missing tensor `{name}`")))?;
            if t.dims() != var.dims() {
                candle_core::bail!(
                    "tensor `{name}` has shape {:?}, expected {:?}",
                    t.dims(),
                    var.dims()
                );
            }
            var.set(&t.to_dtype(self.dtype)?.to_device(&self.device)?)?;
        }
        Ok(())
    }

    /// The adapters under their PEFT names (empty without LoRA).
    pub fn adapter_tensors(&self) -> Result<HashMap<String, Tensor>> {
        let mut out = HashMap::new();
        if let Some(l) = &self.lora {
            for (name, var) in &l.vars {
                out.insert(name.clone(), var.as_tensor().detach().contiguous()?);
            }
        }
        Ok(out)
    }

    /// Writes the adapters in the PEFT layout (`adapter_model.safetensors` +
    /// `adapter_config.json`) into `dir`.
    pub fn save_adapter(&self, dir: &Path) -> std::result::Result<(), TrainError> {
        let Some(l) = &self.lora else {
            return Err(TrainError::Setting(
                "LoRA is not enabled: there is no adapter to save".into(),
            ));
        };
        std::fs::create_dir_all(dir).map_err(TrainError::io("creating", dir))?;
        let tensors: HashMap<String, Tensor> = self
            .adapter_tensors()?
            .into_iter()
            .map(|(k, v)| Ok((k, v.to_dtype(DType::F32)?)))
            .collect::<Result<_>>()?;
        crate::engine::weights::save_safetensors(
            &tensors,
            &dir.join(crate::engine::peft::ADAPTER_WEIGHTS),
        )?;
        l.config
            .write(dir)
            .map_err(TrainError::io("writing the adapter config in", dir))?;
        Ok(())
    }
    /// Number of trainable scalars.
    pub fn num_params(&self) -> usize {
        self.vars().iter().map(|v| v.elem_count()).sum()
    }

    /// Logits of every position, (batch, seq, vocab), for `tokens` (batch, seq) of `u32`.
    /// `attention_mask` (batch, seq), 1 for real tokens and 0 for padding (any dtype), masks
    /// padded keys out of attention; the logits at padded positions are meaningless.
    pub fn forward(&self, tokens: &Tensor, attention_mask: Option<&Tensor>) -> Result<Tensor> {
        self.logits_of(&self.hidden_states(tokens, attention_mask)?)
    }

    /// Final-normed hidden states, (batch, seq, hidden).
    pub fn hidden_states(
        &self,
        tokens: &Tensor,
        attention_mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (b, seq) = tokens.dims2()?;
        let layout = BatchLayout::padded(b, seq, attention_mask, &self.device)?;
        self.hidden_states_in(tokens, &layout)
    }

    /// Final-normed hidden states, (batch, seq, hidden), of rows laid out by `layout`.
    pub fn hidden_states_in(&self, tokens: &Tensor, layout: &BatchLayout) -> Result<Tensor> {
        let ctx = self.context(tokens, layout)?;
        let mut x = self.embed_tokens(tokens)?;
        for layer in &self.layers {
            x = self.layer_forward(layer, &x, &ctx)?;
        }
        self.final_norm(&x)
    }

    /// What every layer of one forward pass shares: attention bias and rotary tables
    /// ((seq, d/2), or (batch, 1, seq, d/2) for explicit positions).
    fn context(&self, tokens: &Tensor, layout: &BatchLayout) -> Result<LayerContext> {
        let (b, seq) = tokens.dims2()?;
        if layout.bias.dims() != [b, 1, seq, seq] {
            candle_core::bail!(
                "attention bias {:?} for a batch of {b} rows of {seq} tokens",
                layout.bias.dims()
            );
        }
        let max_pos = match &layout.positions {
            None => seq,
            Some(p) => p.flatten_all()?.max(0)?.to_scalar::<u32>()? as usize + 1,
        };
        if max_pos > self.cfg.context_length() {
            candle_core::bail!(
                "sequence of {max_pos} tokens exceeds the context length {}",
                self.cfg.context_length()
            );
        }
        let tables_at = |cos: &Tensor, sin: &Tensor| -> Result<(Tensor, Tensor)> {
            match &layout.positions {
                None => Ok((cos.narrow(0, 0, seq)?, sin.narrow(0, 0, seq)?)),
                Some(p) => {
                    let idx = p.flatten_all()?;
                    let half = cos.dim(1)?;
                    let table = |t: &Tensor| t.index_select(&idx, 0)?.reshape((b, 1, seq, half));
                    Ok((table(cos)?, table(sin)?))
                }
            }
        };
        let (cos, sin) = tables_at(&self.cos, &self.sin)?;
        let local = match &self.local_rope {
            Some((c, s)) => Some(tables_at(c, s)?),
            None => None,
        };
        let window = self.window();
        let blocks = match &layout.blocks {
            Some(rows) if rows.len() == b => Some(
                rows.iter()
                    .map(|r| {
                        let (dev, dt) = (tokens.device(), self.dtype);
                        let mut blocks = vec![Block::new(0, r.prompt, None, window, dt, dev)?];
                        for &(start, len) in &r.segments {
                            let shared = Some(r.prompt);
                            blocks.push(Block::new(start, len, shared, window, dt, dev)?);
                        }
                        Ok(blocks)
                    })
                    .collect::<Result<Vec<_>>>()?,
            ),
            _ => None,
        };
        let local_bias = match window {
            Some(w) if max_pos > w => Some(window_bias(layout, w)?.to_dtype(self.dtype)?),
            _ => None,
        };
        Ok(LayerContext {
            bias: layout.bias.to_dtype(self.dtype)?,
            cos,
            sin,
            local,
            local_bias,
            blocks,
        })
    }

    /// Gemma 3: the sliding layers' window (every sliding layer has the same).
    fn window(&self) -> Option<usize> {
        (0..self.layers.len()).find_map(|i| self.cfg.attention_window(i))
    }

    fn embed_tokens(&self, tokens: &Tensor) -> Result<Tensor> {
        let (b, seq) = tokens.dims2()?;
        let x = self
            .embed
            .index_select(&tokens.flatten_all()?, 0)?
            .reshape((b, seq, self.cfg.hidden_size))?;
        if !self.cfg.family.gemma() {
            return Ok(x);
        }
        // Gemma scales its embeddings by √hidden (in the model's float type).
        x * f64::from((self.cfg.hidden_size as f32).sqrt())
    }

    /// RMS norm of `x` by the weight `w` as the family applies it: Gemma's scale by (1 + w).
    fn apply_norm(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        let eps = self.cfg.rms_norm_eps as f32;
        if self.cfg.family.gemma() {
            super::ops::rms_norm(x, &(w + 1.0)?, eps)
        } else {
            super::ops::rms_norm(x, w, eps)
        }
    }

    /// `x` normed by `w` where the layer has such a norm (Gemma's output norms).
    fn maybe_norm(&self, x: Tensor, w: &Option<Tensor>) -> Result<Tensor> {
        match w {
            Some(w) => self.apply_norm(&x, w),
            None => Ok(x),
        }
    }

    fn layer_forward(&self, layer: &TrainLayer, x: &Tensor, ctx: &LayerContext) -> Result<Tensor> {
        let hs = self.apply_norm(x, &layer.input_norm)?;
        let attn = self.maybe_norm(self.attention(layer, &hs, ctx)?, &layer.attn_out_norm)?;
        let x = (x + attn)?;
        let hs = self.apply_norm(&x, &layer.post_norm)?;
        let (gate, up) = (self.proj(&hs, &layer.gate)?, self.proj(&hs, &layer.up)?);
        let act = if self.cfg.family.gemma() {
            // GELU with the tanh approximation (`gelu_pytorch_tanh`).
            (gate.gelu()? * up)?
        } else {
            super::ops::swiglu(&gate, &up)?
        };
        let down = self.maybe_norm(self.proj(&act, &layer.down)?, &layer.mlp_out_norm)?;
        x + down
    }

    fn final_norm(&self, x: &Tensor) -> Result<Tensor> {
        self.apply_norm(x, &self.norm)
    }

    /// Logits of final-normed hidden states (…, hidden) → (…, vocab).
    pub fn logits_of(&self, hidden: &Tensor) -> Result<Tensor> {
        linear(hidden, self.head_weight())
    }

    /// The output head's (vocab, hidden) weight: `lm_head`, or the embedding when tied. A
    /// variable (`is_variable`) exactly when it is trained.
    pub fn head_weight(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Gradients of `loss_fn(hidden)` (`hidden`: the final-normed hidden states, see
    /// [`Self::logits_of`]), back-propagated one layer at a time (see
    /// [`Self::layered_grads`]); with `checkpoint`, HF's gradient checkpointing: each
    /// layer's activations are recomputed in the backward pass instead of kept. Returns the
    /// gradients of the trainable variables and whatever `loss_fn` returns besides the loss.
    pub fn grads<T>(
        &self,
        tokens: &Tensor,
        layout: &BatchLayout,
        checkpoint: bool,
        loss_fn: impl FnOnce(&Tensor) -> Result<(Tensor, T)>,
    ) -> Result<(candle_core::backprop::GradStore, T)> {
        self.layered_grads(tokens, layout, checkpoint, loss_fn)
    }

    /// [`Self::grads`] with activation recomputation: the forward pass keeps only each
    /// layer's input, so activation memory is one layer's instead of all of them, for about
    /// one extra forward pass of compute.
    pub fn checkpointed_grads<T>(
        &self,
        tokens: &Tensor,
        layout: &BatchLayout,
        loss_fn: impl FnOnce(&Tensor) -> Result<(Tensor, T)>,
    ) -> Result<(candle_core::backprop::GradStore, T)> {
        self.layered_grads(tokens, layout, true, loss_fn)
    }

    /// Back-propagation one layer at a time. Each layer's input is a variable of its own,
    /// so each layer's graph ends there; the backward pass goes from the top down with the
    /// gradient of a layer's output (the surrogate `sum(output · grad)`) and drops the layer
    /// once its gradients are taken. candle's `backward` keeps the whole forward graph alive
    /// until it returns, so one backward over the model held every layer's activations
    /// together with every weight gradient; here the activations of the layers done are
    /// freed while the gradients of the next ones are made. With `recompute` the forward
    /// pass keeps only the layer inputs and re-runs each layer before its backward.
    fn layered_grads<T>(
        &self,
        tokens: &Tensor,
        layout: &BatchLayout,
        recompute: bool,
        loss_fn: impl FnOnce(&Tensor) -> Result<(Tensor, T)>,
    ) -> Result<(candle_core::backprop::GradStore, T)> {
        let ctx = self.context(tokens, layout)?;
        // Per layer: its input, and (without `recompute`) its input variable and output,
        // which holds the layer's graph.
        let mut inputs = Vec::with_capacity(self.layers.len() + 1);
        let mut kept = Vec::with_capacity(if recompute { 0 } else { self.layers.len() });
        inputs.push(self.embed_tokens(tokens)?.detach());
        for layer in &self.layers {
            let last = inputs.last().expect("at least the embedding");
            let out = if recompute {
                self.layer_forward(layer, last, &ctx)?
            } else {
                let input = Var::from_tensor(last)?;
                let out = self.layer_forward(layer, input.as_tensor(), &ctx)?;
                kept.push((input, out.clone()));
                out
            };
            inputs.push(out.detach());
        }
        let top = Var::from_tensor(inputs.last().expect("layer outputs"))?;
        let hidden = self.final_norm(top.as_tensor())?;
        let (loss, extra) = loss_fn(&hidden)?;
        drop(hidden);
        let mut grads = loss.backward()?;
        drop(loss);
        let mut upstream = grads
            .remove(top.as_tensor())
            .ok_or_else(|| candle_core::Error::Msg("no gradient reached the last layer".into()))?;
        let vars = self.vars();
        for (i, layer) in self.layers.iter().enumerate().rev() {
            let (input, out) = match kept.pop() {
                Some(saved) => saved,
                None => {
                    let input = Var::from_tensor(&inputs[i])?;
                    let out = self.layer_forward(layer, input.as_tensor(), &ctx)?;
                    (input, out)
                }
            };
            let surrogate = (out * &upstream)?.sum_all()?;
            let mut layer_grads = surrogate.backward()?;
            drop(surrogate);
            upstream = layer_grads.remove(input.as_tensor()).ok_or_else(|| {
                candle_core::Error::Msg(format!("no gradient reached layer {i}'s input"))
            })?;
            inputs.truncate(i + 1);
            super::optim::accumulate_grads(&mut grads, layer_grads, &vars)?;
        }
        if !self.embed.is_variable() {
            return Ok((grads, extra));
        }
        let surrogate = (self.embed_tokens(tokens)? * &upstream)?.sum_all()?;
        super::optim::accumulate_grads(&mut grads, surrogate.backward()?, &vars)?;
        Ok((grads, extra))
    }

    fn attention(&self, layer: &TrainLayer, x: &Tensor, ctx: &LayerContext) -> Result<Tensor> {
        let (cos, sin) = match (&ctx.local, layer.sliding) {
            (Some((c, s)), true) => (c, s),
            _ => (&ctx.cos, &ctx.sin),
        };
        let bias = match (&ctx.local_bias, layer.sliding) {
            (Some(b), true) => b,
            _ => &ctx.bias,
        };
        let (b, seq, _) = x.dims3()?;
        let (nh, kvh, hd) = (
            self.cfg.num_attention_heads,
            self.cfg.num_kv_heads(),
            self.cfg.head_dim(),
        );
        let groups = nh / kvh;
        let heads = |t: Tensor, n: usize| -> Result<Tensor> {
            t.reshape((b, seq, n, hd))?.transpose(1, 2)?.contiguous()
        };
        // Qwen3, Gemma 3: each query and key head RMS-normed before the rotary embedding.
        let head_norm = |t: Tensor, n: usize, w: &Option<Tensor>| -> Result<Tensor> {
            match w {
                None => Ok(t),
                Some(w) => {
                    self.apply_norm(&t.reshape((b, seq, n, hd))?, w)?
                        .reshape((b, seq, n * hd))
                }
            }
        };
        let q = heads(head_norm(self.proj(x, &layer.q)?, nh, &layer.q_norm)?, nh)?;
        let k = heads(head_norm(self.proj(x, &layer.k)?, kvh, &layer.k_norm)?, kvh)?;
        let v = heads(self.proj(x, &layer.v)?, kvh)?;
        let q = super::ops::rope(&q, cos, sin)?;
        let k = super::ops::rope(&k, cos, sin)?;
        if let Some(blocks) = &ctx.blocks {
            let y = self.blocked_attention(&q, &k, &v, blocks, layer.sliding)?;
            return self.proj(&y, &layer.o);
        }
        let scale = 1.0 / (hd as f64).sqrt();
        let y = if super::ops::fused(&[&q, &k]) {
            // Query head `j` reads key/value head `j / groups` (HF `repeat_kv`): the `groups`
            // query heads of a key/value head are stacked along the query axis, so K and V
            // are never copied `groups` times.
            let q = q.reshape((b, kvh, groups * seq, hd))?;
            let scores = q
                .matmul(&k.t()?.contiguous()?)?
                .reshape((b, nh, seq, seq))?;
            let att = super::ops::masked_softmax(&scores, bias, scale)?;
            att.reshape((b, kvh, groups * seq, seq))?.matmul(&v)? // (b, kvh, g·seq, hd)
        } else {
            super::chunked_attention::attention(&q, &k, &v, bias, scale)?
        };
        let y = y
            .reshape((b, nh, seq, hd))?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((b, seq, nh * hd))?;
        self.proj(&y, &layer.o)
    }

    /// Attention of packed rows block by block (see [`RowBlocks`]): `q` (b, heads, seq, hd)
    /// and `k`, `v` (b, kv_heads, seq, hd) rotated; returns (b, seq, heads·hd), zeros at
    /// padding.
    fn blocked_attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        blocks: &[Vec<Block>],
        sliding: bool,
    ) -> Result<Tensor> {
        let (_, nh, seq, hd) = q.dims4()?;
        let kvh = k.dim(1)?;
        let groups = nh / kvh;
        let scale = 1.0 / (hd as f64).sqrt();
        let mut rows = Vec::with_capacity(blocks.len());
        for (r, row) in blocks.iter().enumerate() {
            let (qr, kr, vr) = (q.narrow(0, r, 1)?, k.narrow(0, r, 1)?, v.narrow(0, r, 1)?);
            let mut parts = Vec::with_capacity(row.len() + 1);
            let mut used = 0;
            for b in row {
                let gather = |t: &Tensor| -> Result<Tensor> {
                    let pieces = b
                        .keys
                        .iter()
                        .map(|&(s, n)| t.narrow(2, s, n))
                        .collect::<Result<Vec<_>>>()?;
                    Tensor::cat(&pieces, 2)?.contiguous()
                };
                let (kb, vb) = (gather(&kr)?, gather(&vr)?);
                let width = kb.dim(2)?;
                let qb = qr.narrow(2, b.start, b.len)?.contiguous()?;
                let bias = match (&b.local_bias, sliding) {
                    (Some(local), true) => local,
                    _ => &b.bias,
                };
                let y = if super::ops::fused(&[&qb, &kb]) {
                    let qb = qb.reshape((1, kvh, groups * b.len, hd))?;
                    let scores = qb
                        .matmul(&kb.t()?.contiguous()?)?
                        .reshape((1, nh, b.len, width))?;
                    let att = super::ops::masked_softmax(&scores, bias, scale)?;
                    att.reshape((1, kvh, groups * b.len, width))?.matmul(&vb)?
                } else {
                    super::chunked_attention::attention(&qb, &kb, &vb, bias, scale)?
                };
                parts.push(
                    y.reshape((1, nh, b.len, hd))?
                        .transpose(1, 2)?
                        .contiguous()?
                        .reshape((1, b.len, nh * hd))?,
                );
                used = used.max(b.start + b.len);
            }
            if used < seq {
                parts.push(Tensor::zeros(
                    (1, seq - used, nh * hd),
                    q.dtype(),
                    q.device(),
                )?);
            }
            rows.push(Tensor::cat(&parts, 1)?);
        }
        Tensor::cat(&rows, 0)
    }

    /// `x · Wᵀ`, plus `scale · dropout(x) · Aᵀ · Bᵀ` when the projection has an enabled
    /// adapter.
    fn proj(&self, x: &Tensor, p: &Proj) -> Result<Tensor> {
        let base = |x: &Tensor| super::ops::linear_with_bias(x, &p.w, p.bias.as_ref());
        let (Some(pair), Some(state)) = (&p.lora, &self.lora) else {
            return base(x);
        };
        if !state.enabled.load(Ordering::Relaxed) {
            return base(x);
        }
        // The scale goes on B (out × r), not on the (tokens × out) update.
        let b = (pair.b.as_tensor() * state.config.scale())?;
        let drop = state.config.lora_dropout as f32;
        if drop > 0.0 && state.dropout_active.load(Ordering::Relaxed) {
            // Dropout feeds the adapter another input than the base: the composed form.
            let dropped = candle_nn::ops::dropout(x, drop)?;
            return base(x)? + linear(&linear(&dropped, pair.a.as_tensor())?, &b)?;
        }
        super::ops::lora_linear(x, &p.w, p.bias.as_ref(), pair.a.as_tensor(), &b)
    }

    /// The weights under their HF names, LoRA adapters merged in (f32 unless the model runs
    /// in another float type).
    pub fn hf_tensors(&self) -> Result<HashMap<String, Tensor>> {
        let mut out = HashMap::new();
        for (name, var) in self.base_named_vars() {
            out.insert(name, var.as_tensor().detach().contiguous()?);
        }
        if let Some(l) = &self.lora {
            let tensors = self
                .adapter_tensors()?
                .into_iter()
                .map(|(k, v)| Ok((k, v.to_dtype(DType::F32)?)))
                .collect::<Result<_>>()?;
            let adapter = crate::engine::peft::Adapter {
                config: l.config.clone(),
                tensors,
            };
            adapter
                .merge_into(&mut out)
                .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
            for v in out.values_mut() {
                *v = v.to_dtype(self.dtype)?;
            }
        }
        Ok(out)
    }

    /// The HF `config.json` object: `source`'s fields (when given) with this model's values
    /// written over them, its rope settings in `source`'s form (`rope_parameters` when it has
    /// them, else top-level `rope_theta` + `rope_scaling`, which transformers 4 and 5 read).
    /// A model loaded with GGUF `rope_freqs` factors writes them as the `llama3` scaling they
    /// came from, and is refused when they match none.
    pub fn hf_config_json(
        &self,
        source: Option<&serde_json::Value>,
    ) -> std::result::Result<serde_json::Value, TrainError> {
        let c = &self.exported_config()?;
        let mut obj = source
            .and_then(|v| v.as_object().cloned())
            .unwrap_or_default();
        let dtype = match self.save_dtype {
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F64 => "float64",
            _ => "float32",
        };
        let mut set = |k: &str, v: serde_json::Value| {
            obj.insert(k.to_string(), v);
        };
        set(
            "architectures",
            serde_json::json!([c.family.architecture()]),
        );
        set("model_type", c.family.model_type().into());
        if c.family.gemma() {
            set("hidden_activation", "gelu_pytorch_tanh".into());
            let kinds: Vec<&str> = (0..c.num_hidden_layers)
                .map(|i| {
                    if c.layer_slides(i) {
                        "sliding_attention"
                    } else {
                        "full_attention"
                    }
                })
                .collect();
            set("layer_types", kinds.into());
            set("query_pre_attn_scalar", c.head_dim().into());
            if let Some(w) = c.sliding_window {
                set("sliding_window", w.into());
            }
        } else {
            set("hidden_act", "silu".into());
        }
        set("vocab_size", c.vocab_size.into());
        set("hidden_size", c.hidden_size.into());
        set("intermediate_size", c.intermediate_size.into());
        set("num_hidden_layers", c.num_hidden_layers.into());
        set("num_attention_heads", c.num_attention_heads.into());
        set("num_key_value_heads", c.num_kv_heads().into());
        set("head_dim", c.head_dim().into());
        set("rms_norm_eps", c.rms_norm_eps.into());
        set("max_position_embeddings", c.max_position_embeddings.into());
        set("tie_word_embeddings", c.tie_word_embeddings.into());
        set("torch_dtype", dtype.into());
        // transformers ≥ 5 names it `dtype`; keep the two in agreement.
        set("dtype", dtype.into());
        if let Some(v) = &c.bos_token_id {
            set("bos_token_id", v.clone());
        }
        if let Some(v) = &c.eos_token_id {
            set("eos_token_id", v.clone());
        }
        write_rope(&mut obj, c);
        Ok(serde_json::Value::Object(obj))
    }

    /// The config a checkpoint of this model states: GGUF `rope_freqs` factors, which an HF
    /// config cannot hold, become the `llama3` scaling that produces them.
    fn exported_config(&self) -> std::result::Result<LlamaConfig, TrainError> {
        let Some(factors) = &self.rope_factors else {
            return Ok(self.cfg.clone());
        };
        let c = &self.cfg;
        let scaling = match &c.rope_scaling {
            None => RopeScaling::llama3_from_factors(c.rope_theta, c.head_dim(), factors),
            Some(_) => None,
        };
        let Some(scaling) = scaling else {
            return Err(TrainError::Setting(
                "the model's GGUF `rope_freqs` factors match no llama3 rope scaling, so an HF \
                 config.json cannot state them; not saving a checkpoint that would load as a \
                 different model"
                    .into(),
            ));
        };
        Ok(LlamaConfig {
            rope_scaling: Some(scaling),
            ..c.clone()
        })
    }

    /// Refuses weights that became infinite in the save dtype (a weight of 1e6 is finite in
    /// f32 but `inf` in f16, whose range ends at 65504): the finiteness check of training
    /// runs on the f32 weights, so this one runs on what is written.
    fn ensure_representable(
        &self,
        converted: &HashMap<String, Tensor>,
        dir: &Path,
    ) -> std::result::Result<(), TrainError> {
        if self.save_dtype == DType::F32 || self.save_dtype == DType::F64 {
            return Ok(());
        }
        let mut names: Vec<&String> = converted.keys().collect();
        names.sort();
        for name in names {
            let largest = converted[name]
                .to_dtype(DType::F32)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            if !largest.is_finite() {
                return Err(TrainError::Setting(format!(
                    "not saving {}: weight `{name}` holds values beyond the range of {:?} \
                     (f16 ends at 65504); save in bf16 or f32 instead (`save_dtype`, \
                     --save-dtype)",
                    dir.display(),
                    self.save_dtype
                )));
            }
        }
        Ok(())
    }

    /// Writes an HF checkpoint into `dir` (created if needed): `model.safetensors` and
    /// `config.json`; when `source_dir` is an HF directory, its `config.json` fields are kept
    /// and its tokenizer files (`tokenizer.json`, `tokenizer_config.json`,
    /// `chat_template.jinja`, `special_tokens_map.json`, `generation_config.json`) are copied.
    pub fn save_hf(
        &self,
        dir: &Path,
        source_dir: Option<&Path>,
    ) -> std::result::Result<(), TrainError> {
        std::fs::create_dir_all(dir).map_err(TrainError::io("creating", dir))?;
        let tensors = self
            .hf_tensors()?
            .into_iter()
            .map(|(k, v)| Ok((k, v.to_dtype(self.save_dtype)?)))
            .collect::<Result<HashMap<_, _>>>()?;
        self.ensure_representable(&tensors, dir)?;
        crate::engine::weights::save_safetensors(&tensors, &dir.join("model.safetensors"))?;
        let source_cfg = source_dir
            .map(|s| s.join("config.json"))
            .filter(|p| p.is_file())
            .map(|p| crate::train::error::read_json::<serde_json::Value>(&p))
            .transpose()?;
        let cfg = self.hf_config_json(source_cfg.as_ref())?;
        let text = serde_json::to_string_pretty(&cfg).map_err(TrainError::json(dir))?;
        crate::run::write_atomic(&dir.join("config.json"), text.as_bytes())?;
        if let Some(src) = source_dir {
            for f in [
                "tokenizer.json",
                "tokenizer_config.json",
                "chat_template.jinja",
                "special_tokens_map.json",
                "generation_config.json",
            ] {
                let from = src.join(f);
                if from.is_file() && src != dir {
                    std::fs::copy(&from, dir.join(f)).map_err(TrainError::io("copying", &from))?;
                }
            }
        }
        Ok(())
    }
}

/// Writes `c`'s rope base and scaling into a config object, in the form it already uses.
fn write_rope(obj: &mut serde_json::Map<String, serde_json::Value>, c: &LlamaConfig) {
    let scaling = c.rope_scaling.as_ref().map(RopeScaling::to_json);
    if c.family.gemma() {
        write_gemma3_rope(obj, c, scaling);
        return;
    }
    if obj.get("rope_parameters").is_some_and(|v| !v.is_null()) {
        // transformers ≥ 5's form: one dict, and no top-level copy that could disagree.
        let mut rope = scaling.unwrap_or_default();
        rope.entry("rope_type").or_insert("default".into());
        rope.insert("rope_theta".into(), c.rope_theta.into());
        obj.insert("rope_parameters".into(), rope.into());
        obj.remove("rope_theta");
        obj.remove("rope_scaling");
    } else {
        obj.insert("rope_theta".into(), c.rope_theta.into());
        match scaling {
            Some(s) => obj.insert("rope_scaling".into(), s.into()),
            None => obj.remove("rope_scaling"),
        };
    }
}

/// Gemma 3's two rope settings: transformers 5's `rope_parameters` per layer type unless the
/// source config uses transformers 4's `rope_theta` / `rope_local_base_freq` / `rope_scaling`.
fn write_gemma3_rope(
    obj: &mut serde_json::Map<String, serde_json::Value>,
    c: &LlamaConfig,
    scaling: Option<serde_json::Map<String, serde_json::Value>>,
) {
    let local = c.local_rope_theta;
    let legacy = obj.get("rope_theta").is_some_and(|v| !v.is_null())
        && obj.get("rope_parameters").is_none_or(|v| v.is_null());
    if legacy {
        obj.insert("rope_theta".into(), c.rope_theta.into());
        if let Some(l) = local {
            obj.insert("rope_local_base_freq".into(), l.into());
        }
        match scaling {
            Some(s) => obj.insert("rope_scaling".into(), s.into()),
            None => obj.remove("rope_scaling"),
        };
        return;
    }
    let mut full = scaling.unwrap_or_default();
    full.entry("rope_type").or_insert("default".into());
    full.insert("rope_theta".into(), c.rope_theta.into());
    let mut rope = serde_json::Map::new();
    rope.insert("full_attention".into(), full.into());
    if let Some(l) = local {
        rope.insert(
            "sliding_attention".into(),
            serde_json::json!({"rope_type": "default", "rope_theta": l}),
        );
    }
    obj.insert("rope_parameters".into(), rope.into());
    for k in ["rope_theta", "rope_scaling", "rope_local_base_freq"] {
        obj.remove(k);
    }
}

/// `model.safetensors`, else every `*.safetensors` in `dir`, sorted.
fn safetensors_files(dir: &Path) -> std::result::Result<Vec<PathBuf>, TrainError> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(TrainError::io("listing", dir))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(TrainError::input(dir, "no *.safetensors file"));
    }
    Ok(files)
}

/// The name an adapter records as its base: the Hub id the spec names, else the resolved
/// local path of the weights.
pub(crate) fn adapter_base_name(spec: &str, files: &crate::llm::spec::LocalModelFiles) -> String {
    use crate::llm::spec::ModelSpec;
    if let Some(id) = spec
        .parse::<ModelSpec>()
        .ok()
        .as_ref()
        .and_then(ModelSpec::hub_id)
    {
        return id.to_string();
    }
    std::fs::canonicalize(files.path())
        .unwrap_or_else(|_| files.path().to_path_buf())
        .display()
        .to_string()
}

/// The first trainable weight holding a NaN or an infinity, by name.
pub(crate) fn non_finite_weight(model: &TrainLlama) -> Result<Option<String>> {
    for (name, var) in model.named_vars() {
        if !super::optim::squared_norm(var.as_tensor())?.is_finite() {
            return Ok(Some(name));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_blocks_only_for_a_prompt_then_contiguous_segments() {
        let row =
            |ids: &[i8]| -> Vec<Option<u8>> { ids.iter().map(|&i| u8::try_from(i).ok()).collect() };
        assert_eq!(
            RowBlocks::of(&row(&[0, 0, 1, 1, 1, 2, 2, -1])),
            Some(RowBlocks {
                prompt: 2,
                segments: vec![(2, 3), (5, 2)]
            })
        );
        assert_eq!(RowBlocks::of(&row(&[1, 1])), None, "no prompt");
        assert_eq!(
            RowBlocks::of(&row(&[0, 1, 2, 1])),
            None,
            "a segment in two pieces"
        );
        assert_eq!(RowBlocks::of(&row(&[0, 1, -1, 2])), None, "padding inside");
        assert_eq!(RowBlocks::of(&row(&[0, 1, 0])), None, "the prompt again");
    }
}
