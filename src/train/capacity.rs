//! What a training step costs before it runs, and what it used after: parameter and FLOP
//! counts, a memory estimate that says whether a shape fits a device, the dense bf16 peak of
//! the cards users train on (for model-FLOPs utilisation), and a probe of the device memory
//! a step really held.
//!
//! FLOPs are counted as model FLOPs (PaLM's MFU): 2·N per token for a forward pass, 4·N more
//! for the backward pass of a full step, 2·N more (the input gradients only) when the base is
//! frozen (LoRA, whose adapters add 6·N_lora); N is the weights of every matrix product, the
//! output head included and the embedding lookup not; attention's own products and
//! recomputed activations are not counted.

use candle_core::{DType, Device};

use crate::engine::config::LlamaConfig;
use crate::engine::peft::LORA_TARGETS;

/// Every parameter (a tied head counted once), as a model card totals them.
pub fn param_count(cfg: &LlamaConfig) -> usize {
    let (h, v) = (cfg.hidden_size, cfg.vocab_size);
    let head = if cfg.tie_word_embeddings { 0 } else { v * h };
    v * h + cfg.num_hidden_layers * layer_params(cfg) + h + head
}

/// One layer's parameters: projections, their biases and norms.
fn layer_params(cfg: &LlamaConfig) -> usize {
    let h = cfg.hidden_size;
    let (q, kv) = (
        cfg.num_attention_heads * cfg.head_dim(),
        cfg.num_kv_heads() * cfg.head_dim(),
    );
    let proj = layer_matmul_params(cfg);
    let bias = if cfg.family.qkv_bias() { q + 2 * kv } else { 0 };
    let qk_norm = if cfg.family.qk_norm() {
        2 * cfg.head_dim()
    } else {
        0
    };
    proj + bias + qk_norm + 2 * h
}

/// (out, in) of a projection of a layer.
fn proj_dims(cfg: &LlamaConfig, target: &str) -> (usize, usize) {
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let (q, kv) = (
        cfg.num_attention_heads * cfg.head_dim(),
        cfg.num_kv_heads() * cfg.head_dim(),
    );
    match target {
        "q_proj" => (q, h),
        "k_proj" | "v_proj" => (kv, h),
        "o_proj" => (h, q),
        "gate_proj" | "up_proj" => (i, h),
        _ => (h, i),
    }
}

/// The weights that take part in matrix products per token: every projection and the head.
pub fn matmul_params(cfg: &LlamaConfig) -> usize {
    cfg.num_hidden_layers * layer_matmul_params(cfg) + cfg.vocab_size * cfg.hidden_size
}

/// One layer's projection weights.
fn layer_matmul_params(cfg: &LlamaConfig) -> usize {
    LORA_TARGETS
        .iter()
        .map(|t| {
            let (o, i) = proj_dims(cfg, t);
            o * i
        })
        .sum()
}

/// LoRA's trainable parameters for rank `r` on `targets` of every layer.
pub fn lora_params(cfg: &LlamaConfig, r: usize, targets: &[String]) -> usize {
    let per_layer: usize = targets
        .iter()
        .map(|t| {
            let (o, i) = proj_dims(cfg, t);
            r * (o + i)
        })
        .sum();
    cfg.num_hidden_layers * per_layer
}

/// What a step trains.
#[derive(Clone, Debug, PartialEq)]
pub enum Trainable {
    Full,
    Lora { r: usize, targets: Vec<String> },
}

/// The work of one optimizer step.
#[derive(Clone, Debug, PartialEq)]
pub struct StepShape {
    /// Rows of one forward pass (a DPO pair is two).
    pub rows: usize,
    /// Tokens in each row (the longest; rows are padded to it).
    pub row_tokens: usize,
    /// Keys a query reads at most: the row, or a prompt and one completion when completions
    /// are packed after their prompt (DPO's pairs, GRPO's groups) and attend block by block.
    pub attention_keys: usize,
    /// Tokens whose log-prob enters the loss (the completions'), over all rows.
    pub loss_tokens: usize,
    /// Forward passes without gradient over the same rows in the step (GRPO's reference
    /// log-probs), counted in FLOPs and, for a full step, a second copy of the weights.
    pub extra_forwards: usize,
    pub trainable: Trainable,
    pub checkpointing: bool,
}

impl StepShape {
    pub fn tokens(&self) -> usize {
        self.rows * self.row_tokens
    }
}

/// Model FLOPs of one step (see the module's note on what counts).
pub fn step_flops(cfg: &LlamaConfig, step: &StepShape) -> f64 {
    let n = matmul_params(cfg) as f64;
    let t = step.tokens() as f64;
    let forwards = 2.0 * n * t * (1 + step.extra_forwards) as f64;
    match &step.trainable {
        Trainable::Full => forwards + 4.0 * n * t,
        Trainable::Lora { r, targets } => {
            forwards + 2.0 * n * t + 6.0 * lora_params(cfg, *r, targets) as f64 * t
        }
    }
}

/// Bytes of device memory a step needs, by what holds them.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct MemoryEstimate {
    /// The model's weights (and LoRA's adapters).
    pub weights: u64,
    /// A frozen copy of the weights for reference log-probs (full GRPO with its KL term).
    pub reference: u64,
    /// Gradients of the trainable weights.
    pub grads: u64,
    /// AdamW's two moments, f32.
    pub optimizer: u64,
    /// What the forward pass keeps for the backward pass.
    pub activations: u64,
    /// One chunk of the loss tokens' logits over the vocabulary, with its log-softmax and
    /// gradient (the head runs a chunk at a time).
    pub logits: u64,
}

impl MemoryEstimate {
    pub fn total(&self) -> u64 {
        self.weights + self.reference + self.grads + self.optimizer + self.activations + self.logits
    }
}

/// Element bytes of a float type.
fn bytes_of(dtype: DType) -> u64 {
    dtype.size_in_bytes() as u64
}

/// Estimated peak memory of a step on a GPU (candle's composed ops: the path every device
/// but the CPU in f32 takes). Activations per token and layer are counted from the tensors
/// the layer's graph keeps — the normed inputs, the projections and their head-major
/// copies, the attention output and its log-sum-exp, the gate, up and product of the MLP —
/// with constants fitted to the resident peak of the default model's shape on the CPU with
/// the composed ops forced (3.9 GiB measured, 768 tokens, f32), plus one chunk of attention
/// scores. With checkpointing only each layer's input is kept, plus one layer's graph.
pub fn estimate_memory(cfg: &LlamaConfig, dtype: DType, step: &StepShape) -> MemoryEstimate {
    let b = bytes_of(dtype);
    let params = param_count(cfg) as u64;
    let (h, i) = (cfg.hidden_size as u64, cfg.intermediate_size as u64);
    let (q, kv) = (
        (cfg.num_attention_heads * cfg.head_dim()) as u64,
        (cfg.num_kv_heads() * cfg.head_dim()) as u64,
    );
    let heads = cfg.num_attention_heads as u64;
    let layers = cfg.num_hidden_layers as u64;
    let tokens = step.tokens() as u64;
    let keys = step.attention_keys.min(step.row_tokens) as u64;
    let (trained, adapter) = match &step.trainable {
        Trainable::Full => (params, 0),
        Trainable::Lora { r, targets } => {
            let n = lora_params(cfg, *r, targets) as u64;
            (n, n)
        }
    };
    // Attention keeps its output and one f32 log-sum-exp a head (`chunked_attention`); one
    // chunk of heads × queries × keys scores and its softmax steps live during a layer's pass.
    let per_token_layer = b * (6 * h + 2 * q + 2 * kv + 4 * i) + 4 * heads;
    let attention_chunk = (4 * 4 * heads * keys * tokens).min(4 * (256 << 20));
    let layer_graph = tokens * per_token_layer;
    let activations = attention_chunk
        + if step.checkpointing {
            tokens * h * b * (layers + 1) + layer_graph
        } else {
            layers * layer_graph + tokens * h * b
        };
    let vocab = cfg.vocab_size as u64;
    // One chunk of the head at a time (`chunked_head`): its logits, their f32 copy, shifted
    // values, exponentials, softmax and gradient, and the gradient in the head's type.
    let chunk = step
        .loss_tokens
        .min(super::chunked_head::chunk_rows(cfg.vocab_size)) as u64;
    let logits = chunk * vocab * (2 * b + 5 * 4);
    let reference = match (&step.trainable, step.extra_forwards) {
        (Trainable::Full, n) if n > 0 => params * b,
        _ => 0,
    };
    MemoryEstimate {
        weights: params * b + adapter * b,
        reference,
        grads: trained * b,
        // Two f32 moments, and the f32 copies of the largest tensor the update makes.
        optimizer: trained * 8
            + match step.trainable {
                Trainable::Full => 16 * vocab * h,
                Trainable::Lora { .. } => 0,
            },
        activations,
        logits,
    }
}

/// Dense bf16 tensor-core peak of a card, TFLOP/s (the vendors' datasheets, no sparsity),
/// and the name it was matched by; `None` for a card not in the table.
pub fn card_bf16_peak(name: &str) -> Option<(f64, &'static str)> {
    // Longest names first: "H100 PCIe" before "H100", "L40S" before "L4".
    const CARDS: [(&str, f64); 10] = [
        ("H100 PCIe", 756.0),
        ("H100 NVL", 835.0),
        ("GH200", 989.0),
        ("H200", 989.0),
        ("H100", 989.0),
        ("H800", 989.0),
        ("A100", 312.0),
        ("L40S", 362.0),
        ("A10G", 70.0),
        ("L4", 121.0),
    ];
    CARDS
        .iter()
        .find(|(n, _)| name.contains(n))
        .map(|&(n, tf)| (tf, n))
}

/// The device's name and total memory in bytes (`None` on the CPU).
pub fn device_info(device: &Device) -> Option<(String, u64)> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        let stream = d.cuda_stream();
        let ctx = stream.context();
        let name = ctx.name().unwrap_or_else(|_| "CUDA device".into());
        let total = ctx.total_mem().map_or(0, |t| t as u64);
        return Some((name, total));
    }
    let _ = device;
    None
}

/// The most device memory in use while it runs, sampled every millisecond on a thread of
/// its own, beyond what was in use when it started (the context, other processes). CUDA
/// only: on the CPU the process's peak resident set says as much.
pub struct MemoryProbe {
    #[cfg(feature = "cuda")]
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    #[cfg(feature = "cuda")]
    peak: std::sync::Arc<std::sync::atomic::AtomicU64>,
    #[cfg(feature = "cuda")]
    base: u64,
    #[cfg(feature = "cuda")]
    thread: Option<std::thread::JoinHandle<()>>,
}

impl MemoryProbe {
    /// Starts sampling a CUDA device; `None` for any other device.
    pub fn start(device: &Device) -> Option<Self> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(d) = device {
            use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
            use std::sync::Arc;
            let ctx = d.cuda_stream().context().clone();
            let used = move || {
                ctx.mem_get_info()
                    .map_or(0, |(free, total)| total.saturating_sub(free) as u64)
            };
            let base = used();
            let stop = Arc::new(AtomicBool::new(false));
            let peak = Arc::new(AtomicU64::new(base));
            let (s, p) = (stop.clone(), peak.clone());
            let thread = std::thread::spawn(move || {
                while !s.load(Ordering::Relaxed) {
                    p.fetch_max(used(), Ordering::Relaxed);
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            });
            return Some(Self {
                stop,
                peak,
                base,
                thread: Some(thread),
            });
        }
        let _ = device;
        None
    }

    /// Peak bytes in use since the start, above the starting level.
    pub fn peak(&self) -> u64 {
        #[cfg(feature = "cuda")]
        return self
            .peak
            .load(std::sync::atomic::Ordering::Relaxed)
            .saturating_sub(self.base);
        #[cfg(not(feature = "cuda"))]
        0
    }
}

#[cfg(feature = "cuda")]
impl Drop for MemoryProbe {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::shapes::shape_config;

    fn step(rows: usize, len: usize, trainable: Trainable, ckpt: bool) -> StepShape {
        StepShape {
            rows,
            row_tokens: len,
            attention_keys: len,
            loss_tokens: rows * len / 2,
            extra_forwards: 0,
            trainable,
            checkpointing: ckpt,
        }
    }

    fn lora() -> Trainable {
        Trainable::Lora {
            r: 16,
            targets: LORA_TARGETS.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn every_preset_counts_its_published_size() {
        let params = |name: &str| param_count(&shape_config(name).unwrap()) as f64 / 1e9;
        // The model cards' totals.
        assert!((params("qwen2.5-0.5b") - 0.494).abs() < 0.005);
        assert!((params("llama-3.2-1b") - 1.236).abs() < 0.005);
        assert!((params("qwen2.5-7b") - 7.616).abs() < 0.01);
        assert!((params("llama-3.1-8b") - 8.030).abs() < 0.01);
        // And the count of a built model's variables.
        let cfg = shape_config("tiny").unwrap();
        let model = crate::train::shapes::random_model(&cfg, DType::F32, &Device::Cpu, 0).unwrap();
        assert_eq!(model.num_params(), param_count(&cfg));
    }

    #[test]
    fn flops_are_six_n_per_token_for_a_full_step_and_less_for_lora() {
        let cfg = shape_config("llama-3.2-1b").unwrap();
        let n = matmul_params(&cfg) as f64;
        let full = step_flops(&cfg, &step(4, 512, Trainable::Full, false));
        assert_eq!(full, 6.0 * n * 2048.0);
        let l = step_flops(&cfg, &step(4, 512, lora(), false));
        assert!(l > 4.0 * n * 2048.0 && l < 4.1 * n * 2048.0, "{l}");
        // A reference forward adds 2·N per token.
        let mut grpo = step(4, 512, Trainable::Full, false);
        grpo.extra_forwards = 1;
        assert_eq!(step_flops(&cfg, &grpo), 8.0 * n * 2048.0);
    }

    #[test]
    fn lora_counts_match_peft() {
        // PEFT's count for Llama 3.1 8B, r = 16 on all seven projections: 41,943,040.
        let cfg = shape_config("llama-3.1-8b").unwrap();
        let targets: Vec<String> = LORA_TARGETS.iter().map(|s| s.to_string()).collect();
        assert_eq!(lora_params(&cfg, 16, &targets), 41_943_040);
    }

    #[test]
    fn the_estimate_says_lora_8b_fits_80_gb_and_full_8b_does_not() {
        let cfg = shape_config("llama-3.1-8b").unwrap();
        let gb = 80u64 << 30;
        let l = estimate_memory(&cfg, DType::BF16, &step(2, 1024, lora(), true));
        assert!(l.total() < gb, "{l:?}");
        assert_eq!(
            l.grads,
            lora_params(&cfg, 16, &LORA_TARGETS.map(String::from)) as u64 * 2
        );
        let f = estimate_memory(&cfg, DType::BF16, &step(2, 1024, Trainable::Full, true));
        assert!(f.total() > gb, "{f:?}");
        // Checkpointing trades activations for recomputation.
        let kept = estimate_memory(&cfg, DType::BF16, &step(2, 1024, lora(), false));
        assert!(kept.activations > 4 * l.activations);
    }

    #[test]
    fn cards_are_matched_longest_name_first() {
        assert_eq!(card_bf16_peak("NVIDIA H100 PCIe").unwrap().0, 756.0);
        assert_eq!(card_bf16_peak("NVIDIA H200").unwrap().0, 989.0);
        assert_eq!(card_bf16_peak("NVIDIA L40S").unwrap().0, 362.0);
        assert_eq!(card_bf16_peak("NVIDIA L4").unwrap().0, 121.0);
        assert!(card_bf16_peak("Radeon").is_none());
    }
}
