//! Llama-family model for inference (SmolLM2, Llama 2/3, TinyLlama…), from a GGUF file or HF
//! safetensors, with a KV cache the caller owns so that one prefilled prompt can be copied
//! into a batch of samples and finished samples can be dropped from the batch.
//!
//! Weight layouts: GGUF stores Q and K rows permuted for *interleaved* rotary embeddings
//! (`rope_i`); HF safetensors store them for the half-split variant (`rope`). The model keeps
//! whichever layout it was loaded in and applies the matching rotary function.

use std::path::Path;

use candle_core::quantized::{gguf_file, GgmlDType, QMatMul, QTensor};
use std::sync::Arc;

use candle_core::{DType, Device, Module, Tensor};
use rayon::prelude::*;

use super::cpu_attention;
use super::gguf_tokenizer::meta_u32;
use super::q8::Q8Linear;
use super::team;

type Result<T> = candle_core::Result<T>;

pub use super::config::{LlamaConfig, RopeScaling};

/// How the linear layers are stored in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum WeightFormat {
    /// Keep what the file has (Q8_0 and, on the CPU, Q4_1 in our int8 kernel), except
    /// quantized formats without a fast CPU kernel (Q5_x, and on the CPU the K-quants; Q4_1
    /// on other devices), which are re-quantized to Q8_0.
    #[default]
    Auto,
    /// Re-quantize every linear layer to Q8_0 (~4× less memory traffic than f32).
    Q8_0,
    /// Dequantize everything to f32 (exact reference path; slow and large).
    F32,
    /// Keep every GGUF tensor in the file's own type, even without a fast CPU kernel
    /// (safetensors weights load as f32, as with `Auto`).
    Native,
}

impl WeightFormat {
    /// The names `--weights` takes, as the flag's help lists them.
    pub const NAMES: [&'static str; 4] = ["auto", "f32", "q8", "native"];
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WeightFormat::Auto => "auto",
            WeightFormat::F32 => "f32",
            WeightFormat::Q8_0 => "q8",
            WeightFormat::Native => "native",
        })
    }
}

impl From<WeightFormat> for String {
    fn from(w: WeightFormat) -> String {
        w.to_string()
    }
}

impl TryFrom<String> for WeightFormat {
    type Error = String;
    fn try_from(s: String) -> std::result::Result<Self, String> {
        s.parse()
    }
}

impl std::str::FromStr for WeightFormat {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(WeightFormat::Auto),
            "f32" => Ok(WeightFormat::F32),
            "q8" | "q8_0" => Ok(WeightFormat::Q8_0),
            "native" => Ok(WeightFormat::Native),
            _ => Err(format!(
                "unknown weight format `{s}` (expected one of: {})",
                Self::NAMES.join(", ")
            )),
        }
    }
}

/// A linear layer: our int8 kernel ([`Q8Linear`]) for Q8_0 and Q4_1 weights on the CPU,
/// candle's `QMatMul` otherwise (f32, other quantized types, other devices).
enum Linear {
    Q8(Q8Linear),
    Candle(QMatMul),
}

impl Linear {
    /// Whether the weights are quantized (our int8 kernel, or a candle quantized tensor).
    fn quantized(&self) -> bool {
        matches!(self, Linear::Q8(_) | Linear::Candle(QMatMul::QTensor(_)))
    }

    fn q8(&self) -> Option<&Q8Linear> {
        match self {
            Linear::Q8(q) => Some(q),
            Linear::Candle(_) => None,
        }
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Linear::Q8(l) => l.forward(x),
            Linear::Candle(m) => m.forward(x),
        }
    }
}

/// Linear layers that read the same input (q/k/v, gate/up): one kernel call for all of them
/// when they are all Q8, which quantizes the input once and splits one job across threads.
enum Group {
    Fused(Q8Linear),
    Each(Vec<Linear>),
}

impl Group {
    fn new(layers: Vec<Linear>) -> Result<Self> {
        let format = |l: &Linear| l.q8().map(Q8Linear::format);
        let first = layers.first().and_then(format);
        if first.is_some() && layers.iter().all(|l| format(l) == first) {
            let q8 = layers
                .into_iter()
                .filter_map(|l| match l {
                    Linear::Q8(q) => Some(q),
                    Linear::Candle(_) => None,
                })
                .collect();
            return Ok(Group::Fused(Q8Linear::concat(q8)?));
        }
        Ok(Group::Each(layers))
    }

    fn forward(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        match self {
            Group::Fused(l) => l.forward_parts(x),
            Group::Each(ls) => ls.iter().map(|l| l.forward(x)).collect(),
        }
    }
}

struct Layer {
    attn_norm: Tensor,
    /// q, k and v projections.
    qkv: Group,
    /// Biases of the q, k and v projections (Qwen2).
    qkv_bias: Option<[Tensor; 3]>,
    /// RMS-norm weights of each query and key head, applied before the rotary embedding
    /// (Qwen3, Gemma 3).
    qk_norm: Option<[Tensor; 2]>,
    wo: Linear,
    /// Gemma: the norm of the attention's output before the residual add.
    post_attn_norm: Option<Tensor>,
    /// The norm before the MLP (`post_attention_layernorm` in llama, Gemma's
    /// `pre_feedforward_layernorm`).
    ffn_norm: Tensor,
    /// Gemma: the norm of the MLP's output before the residual add.
    post_ffn_norm: Option<Tensor>,
    /// gate and up projections.
    gate_up: Group,
    w_down: Linear,
}

/// Per-layer key/value cache for a batch of rows that all sit at the same position. A clone
/// shares the tensors: only fork or copy a clone (see [`KvCache::fork`]), never append to it.
///
/// A fork of `n` samples from one prefill keeps the prompt's positions once, in a prefix
/// every row shares (the CPU caches `cpu_attention` reads): `n` copies would cost `n`
/// times the memory and, as every row's attention reads its keys at each step, `n` times
/// the memory traffic.
#[derive(Clone)]
pub struct KvCache {
    /// (k, v) per layer, each (batch, kv_heads, capacity − shared, head_dim): the rows' own
    /// positions from `shared.len` on.
    layers: Vec<Option<(Tensor, Tensor)>>,
    /// Positions `0..shared.len`, the same for every row.
    shared: Option<Arc<SharedPrefix>>,
    len: usize,
    capacity: usize,
    /// New layers store CPU f32 keys and values as f16 (see `KvCache::stored`).
    f16: bool,
}

/// `rows` copies of a one-row (1, kv_heads, positions, head_dim) cache tensor, in a fresh
/// tensor with room for `room` positions.
fn rows_of(t: &Tensor, rows: usize, room: usize) -> Result<Tensor> {
    let (_, h, _, d) = t.dims4()?;
    let full = Tensor::zeros((rows, h, room, d), t.dtype(), t.device())?;
    let copies = if rows == 1 {
        t.clone()
    } else {
        t.repeat((rows, 1, 1, 1))?.contiguous()?
    };
    full.slice_set(&copies, 2, 0)?;
    Ok(full)
}

/// (k, v) per layer, each (1, kv_heads, len, head_dim) (views into another cache's tensors:
/// the last dimension contiguous).
struct SharedPrefix {
    layers: Vec<Option<(Tensor, Tensor)>>,
    len: usize,
}

impl KvCache {
    /// Number of cached positions.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn batch(&self) -> usize {
        self.layers
            .first()
            .and_then(|l| l.as_ref())
            .map_or(0, |(k, _)| k.dims()[0])
    }

    /// Positions held in the prefix all rows share: read from memory held elsewhere
    /// (another cache's tensors, a stored prompt), not from this cache's own tensors.
    pub fn shared_len(&self) -> usize {
        self.shared.as_ref().map_or(0, |s| s.len)
    }

    /// Bytes of the rows' own key and value tensors, room not yet written included (the
    /// shared prefix is another cache's memory).
    #[cfg(test)]
    pub(crate) fn own_bytes(&self) -> usize {
        let tensors = self.layers.iter().flatten().flat_map(|(k, v)| [k, v]);
        tensors
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
    }

    /// `n` rows of row 0 with room for `extra` more positions: one prefill, `n` samples. On
    /// the CPU (f16 or f32) the positions so far become a prefix the rows share, read from this
    /// cache's tensors (never written again: appends go past `len`) or, where the cache
    /// already starts with a shared prefix, that prefix, with only row 0's own positions
    /// copied into each row; other caches are copied into each row.
    pub fn fork(&self, n: usize, extra: usize) -> Result<KvCache> {
        if !self.shareable() || n == 0 {
            return self.copy_row0(self.len, n, self.len + extra);
        }
        let base = self.shared_len();
        let mut prefix = Vec::with_capacity(self.layers.len());
        let mut own = Vec::with_capacity(self.layers.len());
        for i in 0..self.layers.len() {
            if self.shared.is_some() {
                // Row 0's own positions into `n` rows, after the prefix they keep sharing.
                let Some((k, v)) = self.row0_positions(i, base, self.len)? else {
                    own.push(None);
                    continue;
                };
                let room = k.dim(2)? + extra.max(1);
                own.push(Some((rows_of(&k, n, room)?, rows_of(&v, n, room)?)));
                continue;
            }
            let Some((k, v)) = &self.layers[i] else {
                prefix.push(None);
                own.push(None);
                continue;
            };
            let (_, h, _, d) = k.dims4()?;
            let room = Tensor::zeros((n, h, extra.max(1), d), k.dtype(), k.device())?;
            own.push(Some((room.clone(), room.zeros_like()?)));
            // Row 0's positions are read where they are, not copied: requests forked from one
            // stored prompt (a prefix-cache hit) then all read the same memory.
            let view = |t: &Tensor| t.narrow(0, 0, 1)?.narrow(2, 0, self.len);
            prefix.push(Some((view(k)?, view(v)?)));
        }
        let shared = match &self.shared {
            Some(s) => Arc::clone(s),
            None => Arc::new(SharedPrefix {
                layers: prefix,
                len: self.len,
            }),
        };
        Ok(KvCache {
            layers: own,
            shared: Some(shared),
            len: self.len,
            capacity: self.len + extra,
            f16: self.f16,
        })
    }

    /// Whether the cache is read by `cpu_attention` (CPU, f16 or f32), which takes a shared
    /// prefix.
    fn shareable(&self) -> bool {
        let own = self.layers.iter().flatten();
        let shared = self.shared.iter().flat_map(|s| s.layers.iter().flatten());
        own.chain(shared).next().is_some_and(|(k, _)| {
            k.device().is_cpu() && matches!(k.dtype(), DType::F32 | DType::F16)
        })
    }

    /// A one-row cache of row 0's first `len` positions with room for `capacity` positions:
    /// the start of a longer prompt (see `engine::prefix_cache`). In a cache the CPU attention
    /// reads, the positions are read where they are, as the new cache's shared prefix (they
    /// are never written again: appends go past `len`): this cache's shared prefix or its
    /// start, that prefix followed by a copy of the own positions up to `len`, or, in a cache
    /// without one, its positions when they are at least half of them (a view keeps all of
    /// them alive: the prefix cache's budget then still bounds the memory); otherwise they
    /// are copied. Requests that start from one stored conversation then read one copy of it,
    /// which their decode steps attend to together (`cpu_attention::attend_decode`).
    pub fn prefix(&self, len: usize, capacity: usize) -> Result<KvCache> {
        if len > self.len || capacity < len {
            candle_core::bail!(
                "a prefix of {len} positions (room for {capacity}) from a cache of {}",
                self.len
            );
        }
        let base = self.shared_len();
        let no_own = || (0..self.layers.len()).map(|_| None).collect();
        if !self.shareable() {
            return self.copy_row0(len, 1, capacity);
        }
        if len == base && base > 0 {
            return Ok(KvCache {
                layers: no_own(),
                shared: self.shared.clone(),
                len,
                capacity,
                f16: self.f16,
            });
        }
        if base > 0 && len > base {
            // The prefix kept, row 0's own positions up to `len` copied after it.
            let mut layers = Vec::with_capacity(self.layers.len());
            for i in 0..self.layers.len() {
                let Some((k, v)) = self.row0_positions(i, base, len)? else {
                    layers.push(None);
                    continue;
                };
                let room = capacity - base;
                layers.push(Some((rows_of(&k, 1, room)?, rows_of(&v, 1, room)?)));
            }
            return Ok(KvCache {
                layers,
                shared: self.shared.clone(),
                len,
                capacity,
                f16: self.f16,
            });
        }
        if base == 0 && 2 * len < self.len {
            return self.copy_row0(len, 1, capacity);
        }
        let view = |t: &Tensor| t.narrow(0, 0, 1)?.narrow(2, 0, len);
        let source: &[Option<(Tensor, Tensor)>] = match &self.shared {
            // A start of the shared prefix.
            Some(s) => &s.layers,
            None => &self.layers,
        };
        let layers = source
            .iter()
            .map(|l| {
                l.as_ref()
                    .map(|(k, v)| -> Result<_> { Ok((view(k)?, view(v)?)) })
                    .transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(KvCache {
            layers: no_own(),
            shared: Some(Arc::new(SharedPrefix { layers, len })),
            len,
            capacity,
            f16: self.f16,
        })
    }

    /// Row 0's positions `from..to` of layer `layer`, the shared prefix's and its own, as
    /// contiguous (1, kv_heads, to − from, head_dim) tensors.
    fn row0_positions(
        &self,
        layer: usize,
        from: usize,
        to: usize,
    ) -> Result<Option<(Tensor, Tensor)>> {
        let base = self.shared_len();
        let shared = self.shared.as_ref().and_then(|s| s.layers[layer].as_ref());
        let own = self.layers[layer].as_ref();
        if shared.is_none() && own.is_none() {
            return Ok(None);
        }
        let part = |prefix: Option<&Tensor>, own: Option<&Tensor>| -> Result<Tensor> {
            let mut pieces = Vec::with_capacity(2);
            if let Some(p) = prefix.filter(|_| from < base) {
                pieces.push(p.narrow(2, from, to.min(base) - from)?);
            }
            if to > base {
                let Some(own) = own else {
                    candle_core::bail!("internal: KV positions {base}..{to} were never written");
                };
                let start = from.max(base) - base;
                pieces.push(own.narrow(0, 0, 1)?.narrow(2, start, to - base - start)?);
            }
            if pieces.is_empty() {
                // No positions: an empty (1, kv_heads, 0, head_dim) piece of either tensor.
                let any = prefix.or(own).expect("one of them exists");
                pieces.push(any.narrow(0, 0, 1)?.narrow(2, 0, 0)?);
            }
            Tensor::cat(&pieces, 2)?.contiguous()
        };
        Ok(Some((
            part(shared.map(|s| &s.0), own.map(|o| &o.0))?,
            part(shared.map(|s| &s.1), own.map(|o| &o.1))?,
        )))
    }

    /// Row 0's first `len` positions copied into `rows` fresh rows of `capacity` positions.
    fn copy_row0(&self, len: usize, rows: usize, capacity: usize) -> Result<KvCache> {
        let mut layers = Vec::with_capacity(self.layers.len());
        for i in 0..self.layers.len() {
            let Some((k, v)) = self.row0_positions(i, 0, len)? else {
                layers.push(None);
                continue;
            };
            layers.push(Some((
                rows_of(&k, rows, capacity)?,
                rows_of(&v, rows, capacity)?,
            )));
        }
        Ok(KvCache {
            layers,
            shared: None,
            len,
            capacity,
            f16: self.f16,
        })
    }

    /// A cache of `len` positions and no layers: bookkeeping tests.
    #[cfg(test)]
    pub(crate) fn placeholder(len: usize) -> KvCache {
        KvCache {
            layers: Vec::new(),
            shared: None,
            len,
            capacity: len,
            f16: false,
        }
    }

    /// Keeps only the given batch rows, in that order.
    pub fn retain_rows(&mut self, rows: &[usize]) -> Result<()> {
        let Some(Some((k0, _))) = self.layers.first() else {
            return Ok(());
        };
        let idx = Tensor::from_vec(
            rows.iter().map(|&r| r as u32).collect::<Vec<_>>(),
            rows.len(),
            k0.device(),
        )?;
        for l in self.layers.iter_mut().flatten() {
            l.0 = l.0.index_select(&idx, 0)?;
            l.1 = l.1.index_select(&idx, 0)?;
        }
        Ok(())
    }

    /// The type layer `layer` stores for new values of type `dtype` on `device`: that of its
    /// tensors so far, or for new ones f16 where the cache is told to (see
    /// `LlamaModel::kv_f16`) and the values are CPU f32 (what `cpu_attention` reads), else
    /// `dtype`.
    fn stored_dtype(&self, layer: usize, dtype: DType, device: &Device) -> DType {
        let held = self.layers[layer].as_ref().or_else(|| {
            let shared = self.shared.as_ref()?;
            shared.layers[layer].as_ref()
        });
        match held {
            Some((k, _)) => k.dtype(),
            None if self.f16 && device.is_cpu() && dtype == DType::F32 => DType::F16,
            None => dtype,
        }
    }

    /// `x` in the type layer `layer` stores (see [`KvCache::stored_dtype`]).
    fn stored(&self, layer: usize, x: &Tensor) -> Result<Tensor> {
        match (x.dtype(), self.stored_dtype(layer, x.dtype(), x.device())) {
            (a, b) if a == b => Ok(x.clone()),
            (DType::F32, DType::F16) if x.device().is_cpu() => cpu_attention::to_f16(x),
            (_, dtype) => x.to_dtype(dtype),
        }
    }

    /// Layer `layer`'s (k, v) tensors, made or grown to hold `seq` more positions of
    /// `(rows, kv_heads, _, head_dim)` values of `dtype`, and where the new positions go
    /// (from the shared prefix's end).
    fn room(
        &mut self,
        layer: usize,
        (rows, heads, seq, d): (usize, usize, usize, usize),
        dtype: DType,
        device: &Device,
    ) -> Result<(&(Tensor, Tensor), usize)> {
        let base = self.shared_len();
        let (at, need) = (self.len - base, self.len + seq - base);
        let capacity = self.capacity - base;
        let slot = &mut self.layers[layer];
        match slot {
            None => {
                let shape = (rows, heads, need.max(capacity), d);
                *slot = Some((
                    Tensor::zeros(shape, dtype, device)?,
                    Tensor::zeros(shape, dtype, device)?,
                ));
            }
            Some((kk, vv)) if need > kk.dim(2)? => {
                let (b, h, cap, d) = kk.dims4()?;
                let more = (need - cap).max(256);
                let pad = Tensor::zeros((b, h, more, d), kk.dtype(), kk.device())?;
                *kk = Tensor::cat(&[&*kk, &pad], 2)?;
                *vv = Tensor::cat(&[&*vv, &pad], 2)?;
            }
            Some(_) => {}
        }
        let kv = slot.as_ref().expect("slot was just filled");
        let (b, h, _, hd) = kv.0.dims4()?;
        if (b, h, hd) != (rows, heads, d) {
            candle_core::bail!(
                "{rows} rows of {heads} heads of {d} for a cache layer of {:?}",
                kv.0.dims()
            );
        }
        Ok((kv, at))
    }

    /// The rows' own positions of layer `layer` up to the cache's position plus `seq` (from
    /// the shared prefix's end), and the shared prefix.
    #[allow(clippy::type_complexity)]
    fn held_positions(
        &self,
        layer: usize,
        seq: usize,
    ) -> Result<((Tensor, Tensor), Option<(Tensor, Tensor)>)> {
        let need = self.len + seq - self.shared_len();
        let Some((kk, vv)) = &self.layers[layer] else {
            candle_core::bail!("internal: layer {layer} of the cache was never written");
        };
        let shared = self.shared.as_ref().and_then(|s| s.layers[layer].clone());
        Ok(((kk.narrow(2, 0, need)?, vv.narrow(2, 0, need)?), shared))
    }

    /// Appends `k`, `v` (batch, kv_heads, seq, head_dim) at the cache's position; returns the
    /// rows' own positions so far (from the shared prefix's end) and the shared prefix.
    #[allow(clippy::type_complexity)]
    fn append(
        &mut self,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<((Tensor, Tensor), Option<(Tensor, Tensor)>)> {
        let (k, v) = &(self.stored(layer, k)?, self.stored(layer, v)?);
        let dims = k.dims4()?;
        let ((kk, vv), at) = self.room(layer, dims, k.dtype(), k.device())?;
        kk.slice_set(k, 2, at)?;
        vv.slice_set(v, 2, at)?;
        self.held_positions(layer, dims.2)
    }

    /// [`KvCache::append`] straight from the projections `k`, `v` (batch, seq,
    /// kv_heads·head_dim, CPU f32), the keys rotated with `rope` (the tables of the `seq`
    /// positions): the values and bits of `to_heads_from` then `append`, written into the cache
    /// without the four intermediate tensors (a 16-request decode step made 1 900 of them).
    #[allow(clippy::type_complexity)]
    fn append_projected(
        &mut self,
        layer: usize,
        (k, v): (cpu_attention::Projected, cpu_attention::Projected),
        shape: &cpu_attention::Heads,
        rope: (&[f32], &[f32]),
    ) -> Result<((Tensor, Tensor), Option<(Tensor, Tensor)>)> {
        let (rows, seq, width) = k.dims;
        // Checked before `room` makes or grows the layer: a bad shape then changes nothing.
        if v.dims != (rows, seq, width) || !width.is_multiple_of(shape.head_dim.max(1)) {
            candle_core::bail!(
                "keys {:?} and values {:?} are no heads of {}",
                k.dims,
                v.dims,
                shape.head_dim
            );
        }
        let heads = width / shape.head_dim.max(1);
        let device = Device::Cpu;
        let dtype = self.stored_dtype(layer, DType::F32, &device);
        let dims = (rows, heads, seq, shape.head_dim);
        let ((kk, vv), at) = self.room(layer, dims, dtype, &device)?;
        cpu_attention::write_heads_from(k, shape, Some(rope), kk, at)?;
        cpu_attention::write_heads_from(v, shape, None, vv, at)?;
        self.held_positions(layer, seq)
    }
}

/// A layer's queries, and the keys and values they attend to, as [`cpu_attention`] reads
/// them: (b, heads, seq, hd) queries at positions `pos..`, the cache's shared prefix and the
/// rows' own positions after it.
struct CpuAttention {
    q: Tensor,
    prefix: Option<(Tensor, Tensor)>,
    k: Tensor,
    v: Tensor,
    pos: usize,
}

/// A decode step's keys and values past a sliding window, cut to the window: the one query
/// reads them all, so the plain kernels serve it (the cache's keys are rotated already, and
/// the kernels place the query after its keys).
struct WindowView {
    prefix: Option<(Tensor, Tensor)>,
    k: Tensor,
    v: Tensor,
    pos: usize,
}

impl WindowView {
    fn of(p: &CpuAttention, window: usize) -> Result<Self> {
        let shared = p.prefix.as_ref().map_or(Ok(0), |(k, _)| k.dim(2))?;
        let own = p.k.dim(2)?;
        let first = (shared + own).saturating_sub(window);
        let (prefix, k, v) = if first >= shared {
            let (from, n) = (first - shared, own - (first - shared));
            (None, p.k.narrow(2, from, n)?, p.v.narrow(2, from, n)?)
        } else {
            let cut = |t: &Tensor| t.narrow(2, first, shared - first);
            let prefix = match &p.prefix {
                Some((pk, pv)) => Some((cut(pk)?, cut(pv)?)),
                None => None,
            };
            (prefix, p.k.clone(), p.v.clone())
        };
        let pos = shared + own - first - 1;
        Ok(Self { prefix, k, v, pos })
    }

    fn group<'a>(&'a self, q: &'a Tensor) -> cpu_attention::QueryGroup<'a> {
        cpu_attention::QueryGroup {
            q,
            prefix: self.prefix.as_ref().map(|(k, v)| (k, v)),
            k: &self.k,
            v: &self.v,
            pos: self.pos,
        }
    }
}

impl CpuAttention {
    fn group(&self) -> cpu_attention::QueryGroup<'_> {
        cpu_attention::QueryGroup {
            q: &self.q,
            prefix: self.prefix.as_ref().map(|(k, v)| (k, v)),
            k: &self.k,
            v: &self.v,
            pos: self.pos,
        }
    }
}

pub struct LlamaModel {
    cfg: LlamaConfig,
    embed: QMatMul,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Linear,
    interleaved_rope: bool,
    /// The rotary tables: the model's, then (Gemma 3) the sliding-window layers' own.
    ropes: Vec<Rope>,
    device: Device,
}

/// One rotary table (positions × head_dim/2).
struct Rope {
    cos: Tensor,
    sin: Tensor,
    /// `cos` and `sin` as host values on the CPU (empty elsewhere): `cpu_attention` rotates
    /// with slices of them (a conversion per layer and request otherwise).
    host: (Vec<f32>, Vec<f32>),
}

impl Rope {
    /// The model's tables, then the local ones when some layers slide (Gemma 3).
    fn all(cfg: &LlamaConfig, factors: Option<Vec<f32>>, device: &Device) -> Result<Vec<Rope>> {
        let (cos, sin) = rope_tables(cfg, factors, device)?;
        let mut ropes = vec![Rope::new(cos, sin)?];
        if let Some((cos, sin)) = local_rope_tables(cfg, device)? {
            ropes.push(Rope::new(cos, sin)?);
        }
        Ok(ropes)
    }

    fn new(cos: Tensor, sin: Tensor) -> Result<Rope> {
        let host = host_tables(&cos, &sin)?;
        Ok(Rope { cos, sin, host })
    }

    /// The tables of positions `pos..pos + seq`.
    fn narrow(&self, pos: usize, seq: usize) -> Result<(Tensor, Tensor)> {
        Ok((self.cos.narrow(0, pos, seq)?, self.sin.narrow(0, pos, seq)?))
    }
}

/// A layer's element-wise ops (residual adds, silu(gate)·up) for CPU f32 tensors, on the
/// compute threads: candle's hand prefill-sized tensors to its own thread pool, whose worker
/// then spins on the core the next matmul needs (10 % of a prefill's samples). Other
/// tensors take candle's ops.
mod elementwise {
    use std::mem::MaybeUninit;

    use candle_core::{DType, Result, Tensor};

    use crate::engine::simd::{dispatch, swiglu as swiglu_rows};

    /// Elements below which an op stays on the calling thread; chunk size above it (a
    /// 16-request decode step's norms, adds and 25 k-element silu·up go to the threads: the
    /// other thread would only wait meanwhile).
    const PAR_MIN: usize = 1 << 13;
    const CHUNK: usize = 1 << 12;

    #[inline(always)]
    fn add_any(out: &mut [MaybeUninit<f32>], a: &[f32], b: &[f32]) {
        for ((o, a), b) in out.iter_mut().zip(a).zip(b) {
            o.write(a + b);
        }
    }

    dispatch!(add_rows, add_any, (out: &mut [MaybeUninit<f32>], a: &[f32], b: &[f32]) -> ());

    /// An output of `n` values, each written by `fill` (no zero-fill first: a prefill chunk's
    /// outputs are megabytes, zeroed on one thread while the others waited).
    ///
    /// # Safety
    /// `fill` must write every one of the `n` values it is given.
    unsafe fn written(n: usize, fill: impl FnOnce(&mut [MaybeUninit<f32>])) -> Vec<f32> {
        let mut out = Vec::with_capacity(n);
        fill(&mut out.spare_capacity_mut()[..n]);
        // SAFETY: the caller's `fill` initialized all `n`.
        unsafe { out.set_len(n) };
        out
    }

    /// `f` on the values of CPU f32 contiguous tensors, or `None` for other tensors.
    fn with_slices<const N: usize, R>(
        ts: [&Tensor; N],
        f: impl FnOnce([&[f32]; N]) -> R,
    ) -> Result<Option<R>> {
        let cpu_f32 =
            |t: &Tensor| t.device().is_cpu() && t.dtype() == DType::F32 && t.is_contiguous();
        if !ts.iter().all(|t| cpu_f32(t)) {
            return Ok(None);
        }
        let held = ts.map(|t| t.storage_and_layout());
        let mut slices: [&[f32]; N] = [&[]; N];
        for ((slice, (storage, layout)), t) in slices.iter_mut().zip(&held).zip(ts) {
            let candle_core::Storage::Cpu(cpu) = &**storage else {
                return Ok(None);
            };
            *slice = &cpu.as_slice::<f32>()?[layout.start_offset()..][..t.elem_count()];
        }
        Ok(Some(f(slices)))
    }

    /// `f(out, a, b)` over two CPU f32 contiguous tensors of one shape, or `None`.
    /// `f` writes one value of `out` per value of its inputs (all three the same length).
    fn binary(
        a: &Tensor,
        b: &Tensor,
        f: fn(&mut [MaybeUninit<f32>], &[f32], &[f32]),
    ) -> Result<Option<Tensor>> {
        if a.shape() != b.shape() {
            return Ok(None);
        }
        let out = with_slices([a, b], |[xa, xb]| {
            let fill = |out: &mut [MaybeUninit<f32>]| {
                if xa.len() < PAR_MIN {
                    f(out, xa, xb);
                } else {
                    crate::engine::team::for_each_chunk_mut(out, CHUNK, |i, o| {
                        f(o, &xa[i * CHUNK..][..o.len()], &xb[i * CHUNK..][..o.len()])
                    });
                }
            };
            // SAFETY: `f` writes each output value (the inputs have the same shape, so
            // every chunk gets inputs as long as it is).
            unsafe { written(xa.len(), fill) }
        })?;
        out.map(|out| Tensor::from_vec(out, a.shape(), a.device()))
            .transpose()
    }

    /// `a + b`.
    fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
        match binary(a, b, add_rows)? {
            Some(t) => Ok(t),
            None => a + b,
        }
    }

    const LANES: usize = 16;

    /// `out = x / √(mean(x²) + eps) · alpha` for one row; the squares summed in 16 lanes
    /// (then the lanes in order), so every instruction set gives the same bits.
    #[inline(always)]
    fn rms_row_any(out: &mut [MaybeUninit<f32>], x: &[f32], alpha: &[f32], eps: f32) {
        let mut lanes = [0f32; LANES];
        let mut chunks = x.chunks_exact(LANES);
        for c in &mut chunks {
            for (l, v) in lanes.iter_mut().zip(c) {
                *l += v * v;
            }
        }
        let mut sum = lanes.iter().sum::<f32>();
        for v in chunks.remainder() {
            sum += v * v;
        }
        let m = (sum / x.len() as f32 + eps).sqrt();
        for ((o, v), a) in out.iter_mut().zip(x).zip(alpha) {
            o.write(v / m * a);
        }
    }

    dispatch!(rms_row, rms_row_any,
        (out: &mut [MaybeUninit<f32>], x: &[f32], alpha: &[f32], eps: f32) -> ());

    /// RMS norm over the last dimension (candle's `rms_norm` for other tensors): a row at a
    /// time on the compute threads, without candle's per-op overhead (60 norms a step).
    pub(super) fn rms_norm(x: &Tensor, alpha: &Tensor, eps: f32) -> Result<Tensor> {
        let n = x.dim(candle_core::D::Minus1)?;
        let out = (alpha.dims() == [n] && n > 0)
            .then(|| {
                with_slices([x, alpha], |[xs, a]| {
                    let fill = |out: &mut [MaybeUninit<f32>]| {
                        if xs.len() < PAR_MIN {
                            for (o, r) in out.chunks_mut(n).zip(xs.chunks(n)) {
                                rms_row(o, r, a, eps);
                            }
                        } else {
                            let rows = (CHUNK / n).max(1) * n;
                            crate::engine::team::for_each_chunk_mut(out, rows, |i, o| {
                                let x = &xs[i * rows..][..o.len()];
                                for (o, r) in o.chunks_mut(n).zip(x.chunks(n)) {
                                    rms_row(o, r, a, eps);
                                }
                            });
                        }
                    };
                    // SAFETY: `rms_row` writes its whole row, and the rows cover the output
                    // (`x` and the output are whole rows of `n`, `alpha` holds `n`).
                    unsafe { written(xs.len(), fill) }
                })
            })
            .transpose()?
            .flatten();
        match out {
            Some(out) => Tensor::from_vec(out, x.shape(), x.device()),
            None => candle_nn::ops::rms_norm(x, alpha, eps),
        }
    }

    /// `(a + b, rms_norm(a + b))`: a residual add and the norm after it, row by row in one
    /// pass (one parallel loop for the two, 60 fewer a decode step), with the bits of
    /// [`add`] then [`rms_norm`].
    pub(super) fn add_rms_norm(
        a: &Tensor,
        b: &Tensor,
        alpha: &Tensor,
        eps: f32,
    ) -> Result<(Tensor, Tensor)> {
        let n = a.dim(candle_core::D::Minus1)?;
        let fused = (a.shape() == b.shape() && alpha.dims() == [n] && n > 0)
            .then(|| with_slices([a, b, alpha], |[xa, xb, w]| sum_and_norm(xa, xb, w, n, eps)))
            .transpose()?
            .flatten();
        match fused {
            Some((sum, norm)) => Ok((
                Tensor::from_vec(sum, a.shape(), a.device())?,
                Tensor::from_vec(norm, a.shape(), a.device())?,
            )),
            None => {
                let x = add(a, b)?;
                let h = rms_norm(&x, alpha, eps)?;
                Ok((x, h))
            }
        }
    }

    /// [`add_rms_norm`] on slices: rows of `n` values.
    fn sum_and_norm(
        xa: &[f32],
        xb: &[f32],
        alpha: &[f32],
        n: usize,
        eps: f32,
    ) -> (Vec<f32>, Vec<f32>) {
        let len = xa.len();
        let rows_of = |s: &mut [MaybeUninit<f32>], h: &mut [MaybeUninit<f32>], at: usize| {
            for (r, (s, h)) in s.chunks_mut(n).zip(h.chunks_mut(n)).enumerate() {
                let x = at + r * n;
                add_rows(s, &xa[x..x + n], &xb[x..x + n]);
                // SAFETY: `add_rows` wrote every value of the row.
                let s = unsafe { &*(s as *const [MaybeUninit<f32>] as *const [f32]) };
                rms_row(h, s, alpha, eps);
            }
        };
        let (mut sum, mut norm) = (Vec::with_capacity(len), Vec::with_capacity(len));
        let (s, h) = (
            &mut sum.spare_capacity_mut()[..len],
            &mut norm.spare_capacity_mut()[..len],
        );
        if len < PAR_MIN {
            rows_of(s, h, 0);
        } else {
            let rows = (CHUNK / n).max(1) * n;
            let mut pieces: Vec<_> = s.chunks_mut(rows).zip(h.chunks_mut(rows)).collect();
            crate::engine::team::map_mut(&mut pieces, |i, (s, h)| rows_of(s, h, i * rows));
        }
        // SAFETY: every row of both was written (`add_rows` and `rms_row` write whole rows,
        // and the rows cover `len`, a multiple of `n`).
        unsafe {
            sum.set_len(len);
            norm.set_len(len);
        }
        (sum, norm)
    }

    /// `silu(gate) · up`.
    pub(super) fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        match binary(gate, up, swiglu_rows)? {
            Some(t) => Ok(t),
            None => gate.silu()? * up,
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use candle_core::Device;

        #[test]
        fn row_kernels_give_the_same_bits_on_every_isa() {
            use crate::engine::simd::{assert_same_bits_on_every_isa, test_values};
            let init = |out: Vec<MaybeUninit<f32>>| -> Vec<f32> {
                // SAFETY: the kernels write every value.
                out.into_iter()
                    .map(|v| unsafe { v.assume_init() })
                    .collect()
            };
            for n in [1usize, 15, 16, 64, 577] {
                let (a, b) = (test_values(n, 3), test_values(n, 4));
                assert_same_bits_on_every_isa("add_rows", |isa| {
                    let mut out = vec![MaybeUninit::uninit(); n];
                    add_rows::on(isa, &mut out, &a, &b);
                    init(out)
                });
                assert_same_bits_on_every_isa("rms_row", |isa| {
                    let mut out = vec![MaybeUninit::uninit(); n];
                    rms_row::on(isa, &mut out, &a, &b, 1e-5);
                    init(out)
                });
            }
        }

        #[test]
        fn match_candles_ops_inline_parallel_and_strided() {
            for n in [7usize, 3 * PAR_MIN + 5] {
                let a = Tensor::randn(0f32, 3.0, (n,), &Device::Cpu).unwrap();
                let b = Tensor::randn(0f32, 1.0, (n,), &Device::Cpu).unwrap();
                let v = |t: Tensor| t.to_vec1::<f32>().unwrap();
                assert_eq!(v(add(&a, &b).unwrap()), v((&a + &b).unwrap()), "n={n}");
                let ours = v(swiglu(&a, &b).unwrap());
                let theirs = v((a.silu().unwrap() * &b).unwrap());
                for (o, t) in ours.iter().zip(&theirs) {
                    assert!((o - t).abs() <= 1e-6 * (1.0 + t.abs()), "{o} vs {t}");
                }
            }
            // RMS norm: candle's within rounding, inline and over the threads alike.
            for rows in [3usize, 2 * PAR_MIN / 40 + 1] {
                let x = Tensor::randn(0f32, 2.0, (rows, 40), &Device::Cpu).unwrap();
                let alpha = Tensor::randn(0f32, 1.0, 40, &Device::Cpu).unwrap();
                let ours = rms_norm(&x, &alpha, 1e-5).unwrap();
                let theirs = candle_nn::ops::rms_norm(&x, &alpha, 1e-5).unwrap();
                let (o, t) = (
                    ours.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    theirs.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                );
                for (o, t) in o.iter().zip(&t) {
                    assert!((o - t).abs() <= 1e-5 * (1.0 + t.abs()), "{o} vs {t}");
                }
                // A row's bits do not depend on the rows beside it.
                let first = rms_norm(&x.narrow(0, 0, 1).unwrap(), &alpha, 1e-5).unwrap();
                assert_eq!(
                    first.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    o[..40].to_vec()
                );
            }
            // The fused add and norm: the bits of the two ops, inline and over the threads,
            // and of the two ops' fallbacks for a transposed input.
            let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let alpha = Tensor::randn(0f32, 1.0, 40, &Device::Cpu).unwrap();
            for rows in [3usize, 2 * PAR_MIN / 40 + 1, 5 * CHUNK / 40 + 3] {
                let a = Tensor::randn(0f32, 2.0, (rows, 40), &Device::Cpu).unwrap();
                let b = Tensor::randn(0f32, 1.0, (rows, 40), &Device::Cpu).unwrap();
                let (sum, norm) = add_rms_norm(&a, &b, &alpha, 1e-5).unwrap();
                let want = add(&a, &b).unwrap();
                assert_eq!(flat(&sum), flat(&want), "rows={rows}");
                let want = rms_norm(&want, &alpha, 1e-5).unwrap();
                assert_eq!(flat(&norm), flat(&want), "rows={rows}");
            }
            let a = Tensor::randn(0f32, 1.0, (40, 6), &Device::Cpu)
                .unwrap()
                .t()
                .unwrap();
            let b = a.contiguous().unwrap();
            let (sum, norm) = add_rms_norm(&a, &b, &alpha, 1e-5).unwrap();
            let want = (&b + &b).unwrap();
            assert_eq!(flat(&sum), flat(&want));
            assert_eq!(flat(&norm), flat(&rms_norm(&want, &alpha, 1e-5).unwrap()));
            // A transposed (non-contiguous) input takes candle's op.
            let m = Tensor::randn(0f32, 1.0, (4, 6), &Device::Cpu).unwrap();
            let t = m.t().unwrap();
            let c = t.contiguous().unwrap();
            assert_eq!(
                add(&t, &c).unwrap().to_vec2::<f32>().unwrap(),
                (&c + &c).unwrap().to_vec2::<f32>().unwrap()
            );
        }
    }
}

/// Values per block of the int8 kernel's formats (Q8_0 and Q4_1).
const QK_INT8: usize = 32;

fn to_linear(t: QTensor, format: WeightFormat) -> Result<Linear> {
    to_linear_shared(Arc::new(t), format)
}

/// Like [`to_linear`], but shares the data when candle keeps it as it is (a tied output head
/// and the embedding then use one copy).
fn to_linear_shared(t: Arc<QTensor>, format: WeightFormat) -> Result<Linear> {
    let cols = t.shape().dims().last().copied().unwrap_or(0);
    let ours = t.device().is_cpu() && cols % QK_INT8 == 0;
    let target = match (format, t.dtype()) {
        (WeightFormat::F32, _) => None,
        (_, GgmlDType::Q8_0) => Some(GgmlDType::Q8_0),
        (WeightFormat::Q8_0, _) => Some(GgmlDType::Q8_0),
        // Our kernel reads Q4_1 blocks as they are, on the CPU.
        (WeightFormat::Auto | WeightFormat::Native, GgmlDType::Q4_1) if ours => {
            return Ok(Linear::Q8(Q8Linear::from_qtensor(&t)?));
        }
        (WeightFormat::Auto, GgmlDType::Q4_1 | GgmlDType::Q5_0 | GgmlDType::Q5_1) => {
            Some(GgmlDType::Q8_0)
        }
        // candle's K-quant kernels decode on the CPU at a fraction of our int8 kernel's speed
        // (Gemma 3 270M Q4_K_M: 43.7 against 60 tokens/s with its Q4_K and Q6_K layers in
        // Q8_0, BENCHMARKS.md).
        (
            WeightFormat::Auto,
            GgmlDType::Q2K | GgmlDType::Q3K | GgmlDType::Q4K | GgmlDType::Q5K | GgmlDType::Q6K,
        ) if ours => Some(GgmlDType::Q8_0),
        (WeightFormat::Auto | WeightFormat::Native, d) => Some(d),
    };
    let candle = |m: Result<QMatMul>| m.map(Linear::Candle);
    match target {
        None => candle(Ok(QMatMul::Tensor(t.dequantize(&t.device())?))),
        // Q8_0 blocks (as they are, or re-quantized exactly as candle would) in our kernel.
        Some(GgmlDType::Q8_0) if ours => Ok(Linear::Q8(Q8Linear::q8_0_from_qtensor(&t)?)),
        Some(d) if d == t.dtype() => candle(QMatMul::from_arc(t)),
        Some(d) if cols % d.block_size() == 0 => {
            let f = t.dequantize(&t.device())?;
            candle(QMatMul::from_qtensor(QTensor::quantize(&f, d)?))
        }
        // The row length does not fit the block size: stay exact.
        Some(_) => candle(Ok(QMatMul::Tensor(t.dequantize(&t.device())?))),
    }
}

fn tensor_to_linear(t: Tensor, format: WeightFormat) -> Result<Linear> {
    let cols = t.dims().last().copied().unwrap_or(0);
    if format == WeightFormat::Q8_0 && cols % GgmlDType::Q8_0.block_size() == 0 {
        if t.device().is_cpu() {
            return Ok(Linear::Q8(Q8Linear::from_tensor(&t)?));
        }
        return Ok(Linear::Candle(QMatMul::from_qtensor(QTensor::quantize(
            &t,
            GgmlDType::Q8_0,
        )?)?));
    }
    Ok(Linear::Candle(QMatMul::Tensor(t)))
}

/// A norm weight under its HF name as the model multiplies by it: Gemma's HF checkpoints
/// store w of (1 + w) (computed in f32, as transformers does); llama.cpp's GGUFs store 1 + w.
fn hf_norm(cfg: &LlamaConfig, w: Tensor) -> Result<Tensor> {
    if cfg.family.gemma() {
        w.to_dtype(DType::F32)? + 1.0
    } else {
        Ok(w)
    }
}

/// `x` RMS-normed by `w` where the layer has such a norm (Gemma's after attention and MLP).
fn post_norm(x: Tensor, w: &Option<Tensor>, eps: f32) -> Result<Tensor> {
    match w {
        Some(w) => elementwise::rms_norm(&x, w, eps),
        None => Ok(x),
    }
}

/// The error of a config that unties the output head from the embedding while the weights
/// have no head of their own.
pub(crate) const UNTIED_WITHOUT_HEAD: &str =
    "config `tie_word_embeddings` is false but the weights have no `lm_head.weight`";

/// cos/sin tables (positions × head_dim/2) of the frequencies of [`LlamaConfig::inv_freqs`]
/// divided by GGUF `rope_freqs` factors, if any: the one table both rope layouts, inference
/// and training use.
pub(crate) fn rope_tables(
    cfg: &LlamaConfig,
    factors: Option<Vec<f32>>,
    dev: &Device,
) -> Result<(Tensor, Tensor)> {
    let mut inv = cfg.inv_freqs();
    if let Some(f) = factors {
        for (x, k) in inv.iter_mut().zip(f) {
            *x /= f64::from(k);
        }
    }
    tables_of(&inv, cfg.context_length(), dev)
}

/// Gemma 3's tables for its sliding-window layers (their own base), if any layer slides.
pub(crate) fn local_rope_tables(
    cfg: &LlamaConfig,
    dev: &Device,
) -> Result<Option<(Tensor, Tensor)>> {
    cfg.local_inv_freqs()
        .map(|inv| tables_of(&inv, cfg.context_length(), dev))
        .transpose()
}

/// cos/sin tables of `n` positions for the inverse frequencies `inv`.
fn tables_of(inv: &[f64], n: usize, dev: &Device) -> Result<(Tensor, Tensor)> {
    let half = inv.len();
    let mut cos = Vec::with_capacity(n * half);
    let mut sin = Vec::with_capacity(n * half);
    for p in 0..n {
        for f in inv {
            let a = p as f64 * f;
            cos.push(a.cos() as f32);
            sin.push(a.sin() as f32);
        }
    }
    Ok((
        Tensor::from_vec(cos, (n, half), dev)?,
        Tensor::from_vec(sin, (n, half), dev)?,
    ))
}

/// The rope tables' values on the CPU (none on other devices).
fn host_tables(cos: &Tensor, sin: &Tensor) -> Result<(Vec<f32>, Vec<f32>)> {
    if !cos.device().is_cpu() {
        return Ok((Vec::new(), Vec::new()));
    }
    Ok((cos.flatten_all()?.to_vec1()?, sin.flatten_all()?.to_vec1()?))
}

impl LlamaModel {
    /// Loads from a GGUF file whose header has already been read.
    pub fn from_gguf<R: std::io::Read + std::io::Seek>(
        content: &gguf_file::Content,
        reader: &mut R,
        cfg: LlamaConfig,
        format: WeightFormat,
        device: &Device,
    ) -> Result<Self> {
        let mut get = |name: &str| content.tensor(reader, name, device);
        let embed_q = Arc::new(get("token_embd.weight")?);
        let norm = get("output_norm.weight")?.dequantize(device)?;
        let lm_head = if content.tensor_infos.contains_key("output.weight") {
            to_linear(get("output.weight")?, format)?
        } else {
            to_linear_shared(embed_q.clone(), format)?
        };
        let factors = if content.tensor_infos.contains_key("rope_freqs.weight") {
            Some(
                get("rope_freqs.weight")?
                    .dequantize(device)?
                    .to_vec1::<f32>()?,
            )
        } else {
            None
        };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("blk.{i}");
            let mut lin = |n: &str| to_linear(get(&format!("{p}.{n}.weight"))?, format);
            let qkv = Group::new(vec![lin("attn_q")?, lin("attn_k")?, lin("attn_v")?])?;
            let wo = lin("attn_output")?;
            let gate_up = Group::new(vec![lin("ffn_gate")?, lin("ffn_up")?])?;
            let w_down = lin("ffn_down")?;
            let mut vector = |n: &str| get(&format!("{p}.{n}"))?.dequantize(device);
            let qkv_bias = if cfg.family.qkv_bias() {
                Some([
                    vector("attn_q.bias")?,
                    vector("attn_k.bias")?,
                    vector("attn_v.bias")?,
                ])
            } else {
                None
            };
            let qk_norm = if cfg.family.qk_norm() {
                Some([vector("attn_q_norm.weight")?, vector("attn_k_norm.weight")?])
            } else {
                None
            };
            // llama.cpp's converter stores Gemma's norms as (1 + w) already.
            let (post_attn_norm, post_ffn_norm) = if cfg.family.gemma() {
                (
                    Some(vector("post_attention_norm.weight")?),
                    Some(vector("post_ffw_norm.weight")?),
                )
            } else {
                (None, None)
            };
            layers.push(Layer {
                qkv_bias,
                qk_norm,
                post_attn_norm,
                post_ffn_norm,
                attn_norm: get(&format!("{p}.attn_norm.weight"))?.dequantize(device)?,
                ffn_norm: get(&format!("{p}.ffn_norm.weight"))?.dequantize(device)?,
                qkv,
                wo,
                gate_up,
                w_down,
            });
        }
        // The embedding table stays quantized: rows are dequantized on lookup.
        let embed = QMatMul::from_arc(embed_q)?;
        let ropes = Rope::all(&cfg, factors, device)?;
        // llama.cpp permutes Q/K rows for the interleaved rotary embedding in llama GGUFs
        // only; Qwen's keep the HF (half-split, "NEOX") layout.
        let interleaved_rope = gguf_qk_permuted(&cfg);
        let model = Self {
            cfg,
            embed,
            layers,
            norm,
            lm_head,
            interleaved_rope,
            ropes,
            device: device.clone(),
        };
        model.weights_on_huge_pages();
        Ok(model)
    }

    /// Moves the int8 layers' weights onto huge pages where the kernel allows
    /// (`engine::huge_pages`): a decode step streams all of them. Worth it for a model loaded
    /// to serve (one request's decode step ~1.13× faster); it costs 0.07–0.6 s (the kernel
    /// copies each stretch, compacting memory first where it must), so a model rebuilt
    /// every update for a batched sampler (`train::rl::sync`) skips it.
    pub(crate) fn weights_on_huge_pages(&self) {
        let linears = self.layers.iter().flat_map(|l| {
            let groups = [&l.qkv, &l.gate_up].into_iter().flat_map(|g| match g {
                Group::Fused(q) => vec![q],
                Group::Each(ls) => ls.iter().filter_map(Linear::q8).collect(),
            });
            groups.chain([&l.wo, &l.w_down].into_iter().filter_map(Linear::q8))
        });
        let ranges: Vec<(usize, usize)> = linears
            .chain(self.lm_head.q8())
            .flat_map(Q8Linear::weight_memory)
            .collect();
        let total: usize = ranges.iter().map(|r| r.1).sum();
        let started = std::time::Instant::now();
        let moved = crate::engine::huge_pages::collapse(&ranges);
        tracing::debug!(
            "int8 weights of {} MB: the {} MB of 2 MiB pages holding them on huge pages \
             ({:.0} ms)",
            total >> 20,
            moved >> 20,
            started.elapsed().as_secs_f64() * 1e3
        );
    }

    /// Loads HF llama safetensors (`model.layers.N.self_attn.q_proj.weight`, …).
    pub fn from_safetensors(
        files: &[impl AsRef<Path>],
        cfg: LlamaConfig,
        format: WeightFormat,
        device: &Device,
    ) -> Result<Self> {
        // SAFETY: the files are memory-mapped read-only; they must not be modified while
        // loading, which is the usual contract of every safetensors loader.
        let vb =
            unsafe { candle_nn::VarBuilder::from_mmaped_safetensors(files, DType::F32, device)? };
        let model = Self::from_var_builder(&vb, cfg, None, format, device)?;
        model.weights_on_huge_pages();
        Ok(model)
    }

    /// Builds the model from HF-named tensors in the HF (half-split rotary) layout, e.g. a
    /// base model with a LoRA adapter merged in. `factors` are GGUF `rope_freqs`, if any.
    pub fn from_hf_tensors(
        tensors: std::collections::HashMap<String, Tensor>,
        cfg: LlamaConfig,
        factors: Option<Vec<f32>>,
        format: WeightFormat,
        device: &Device,
    ) -> Result<Self> {
        let vb = candle_nn::VarBuilder::from_tensors(tensors, DType::F32, device);
        Self::from_var_builder(&vb, cfg, factors, format, device)
    }

    fn from_var_builder(
        vb: &candle_nn::VarBuilder,
        cfg: LlamaConfig,
        factors: Option<Vec<f32>>,
        format: WeightFormat,
        device: &Device,
    ) -> Result<Self> {
        let h = cfg.hidden_size;
        let (q_out, kv_out) = (
            cfg.num_attention_heads * cfg.head_dim(),
            cfg.num_kv_heads() * cfg.head_dim(),
        );
        let embed_w = vb.get((cfg.vocab_size, h), "model.embed_tokens.weight")?;
        if !cfg.tie_word_embeddings && !vb.contains_tensor("lm_head.weight") {
            // transformers would start such a head from random values: never guess.
            candle_core::bail!("{UNTIED_WITHOUT_HEAD}")
        }
        let head = || -> Result<Linear> {
            if cfg.tie_word_embeddings {
                tensor_to_linear(embed_w.clone(), format)
            } else {
                tensor_to_linear(vb.get((cfg.vocab_size, h), "lm_head.weight")?, format)
            }
        };
        let layer = |i: usize| -> Result<Layer> {
            let p = format!("model.layers.{i}");
            let lin = |n: &str, shape: (usize, usize)| {
                tensor_to_linear(vb.get(shape, &format!("{p}.{n}.weight"))?, format)
            };
            let im = cfg.intermediate_size;
            let qkv_bias = if cfg.family.qkv_bias() {
                let bias = |n: &str, len: usize| vb.get(len, &format!("{p}.self_attn.{n}.bias"));
                Some([
                    bias("q_proj", q_out)?,
                    bias("k_proj", kv_out)?,
                    bias("v_proj", kv_out)?,
                ])
            } else {
                None
            };
            let qk_norm = if cfg.family.qk_norm() {
                let norm = |n: &str| {
                    hf_norm(
                        &cfg,
                        vb.get(cfg.head_dim(), &format!("{p}.self_attn.{n}.weight"))?,
                    )
                };
                Some([norm("q_norm")?, norm("k_norm")?])
            } else {
                None
            };
            let norm = |n: &str| hf_norm(&cfg, vb.get(h, &format!("{p}.{n}.weight"))?);
            let (ffn_norm, post_attn_norm, post_ffn_norm) = if cfg.family.gemma() {
                (
                    norm("pre_feedforward_layernorm")?,
                    Some(norm("post_attention_layernorm")?),
                    Some(norm("post_feedforward_layernorm")?),
                )
            } else {
                (norm("post_attention_layernorm")?, None, None)
            };
            Ok(Layer {
                qkv_bias,
                qk_norm,
                post_attn_norm,
                post_ffn_norm,
                attn_norm: norm("input_layernorm")?,
                ffn_norm,
                qkv: Group::new(vec![
                    lin("self_attn.q_proj", (q_out, h))?,
                    lin("self_attn.k_proj", (kv_out, h))?,
                    lin("self_attn.v_proj", (kv_out, h))?,
                ])?,
                wo: lin("self_attn.o_proj", (h, q_out))?,
                gate_up: Group::new(vec![
                    lin("mlp.gate_proj", (im, h))?,
                    lin("mlp.up_proj", (im, h))?,
                ])?,
                w_down: lin("mlp.down_proj", (h, im))?,
            })
        };
        // Re-quantizing every linear layer is most of the load (and of an RL run's weight
        // sync after each update): layers and the head convert in parallel.
        let (lm_head, layers) = team::on_pool(|| {
            rayon::join(head, || {
                (0..cfg.num_hidden_layers)
                    .into_par_iter()
                    .map(layer)
                    .collect::<Result<Vec<_>>>()
            })
        });
        let (lm_head, layers) = (lm_head?, layers?);
        let norm = hf_norm(&cfg, vb.get(h, "model.norm.weight")?)?;
        let ropes = Rope::all(&cfg, factors, device)?;
        Ok(Self {
            cfg,
            embed: QMatMul::Tensor(embed_w),
            layers,
            norm,
            lm_head,
            interleaved_rope: false,
            ropes,
            device: device.clone(),
        })
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Bytes one position takes in a [`KvCache`] over all layers, keys and values.
    pub fn kv_bytes_per_position(&self) -> usize {
        let value = if self.kv_f16() {
            2
        } else {
            self.ropes[0].cos.dtype().size_in_bytes()
        };
        let cfg = &self.cfg;
        cfg.num_hidden_layers * 2 * cfg.num_kv_heads() * cfg.head_dim() * value
    }

    /// An empty cache; `capacity` positions are allocated on first use.
    pub fn new_cache(&self, capacity: usize) -> KvCache {
        KvCache {
            layers: (0..self.layers.len()).map(|_| None).collect(),
            shared: None,
            len: 0,
            capacity,
            f16: self.kv_f16(),
        }
    }

    /// Whether caches store keys and values as f16: on the CPU with quantized weights, as
    /// llama.cpp does (a 16-request decode step reads every row's own positions from
    /// memory; half the bytes is what that part waits on). With f32 weights the model is the
    /// exact reference path (the training model's logits), and its caches stay f32.
    fn kv_f16(&self) -> bool {
        self.device.is_cpu() && self.layers.first().is_some_and(|l| l.w_down.quantized())
    }

    /// Runs `tokens` (batch, seq) at the cache's position and returns the logits of the last
    /// position, (batch, vocab).
    pub fn forward_last(&self, tokens: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        team::on_pool(|| {
            let hidden = self.hidden_states(tokens, cache)?;
            let seq = hidden.dim(1)?;
            let last = hidden.narrow(1, seq - 1, 1)?;
            self.lm_head.forward(&last)?.squeeze(1)
        })
    }

    /// Runs `tokens` and returns the logits of every position, (batch, seq, vocab).
    pub fn forward_all(&self, tokens: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        team::on_pool(|| {
            let hidden = self.hidden_states(tokens, cache)?;
            self.lm_head.forward(&hidden)
        })
    }

    fn hidden_states(&self, tokens: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        let (_b, seq) = tokens.dims2()?;
        let pos = cache.len;
        if pos + seq > self.cfg.context_length() {
            candle_core::bail!(
                "sequence of {} tokens exceeds the context length {}",
                pos + seq,
                self.cfg.context_length()
            );
        }
        let x = self.embed_tokens(tokens)?;
        let trig = self
            .ropes
            .iter()
            .map(|r| r.narrow(pos, seq))
            .collect::<Result<Vec<_>>>()?;
        // The CPU attention is causal by construction (see `attend`).
        let mask = if seq > 1 && !self.device.is_cpu() {
            Some(self.causal_mask(seq, pos)?)
        } else {
            None
        };
        let normed = self.blocks(x, |i, q, k, v| {
            let (cos, sin) = &trig[self.rope_index(i)];
            self.attend(i, q, k, v, cos, sin, mask.as_ref(), cache)
        })?;
        cache.len = pos + seq;
        Ok(normed)
    }

    /// One transformer block on the residual stream `x`, normed as `h` by the block's
    /// attention norm: `attention` maps the projected q, k and v to the heads' outputs before
    /// the output projection. Returns the stream after the block, and it normed by
    /// `next_norm`.
    fn block(
        &self,
        layer: &Layer,
        (x, h): (&Tensor, &Tensor),
        next_norm: &Tensor,
        attention: impl FnOnce(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        let eps = self.cfg.rms_norm_eps as f32;
        let [q, k, v] = &layer.qkv.forward(h)?[..] else {
            candle_core::bail!("the q/k/v projections gave no three outputs");
        };
        let y = match (&layer.qkv_bias, &layer.qk_norm) {
            (None, None) => attention(q, k, v)?,
            _ => {
                let (q, k, v) = self.adjust_qkv(layer, [q, k, v])?;
                attention(&q, &k, &v)?
            }
        };
        let out = post_norm(layer.wo.forward(&y)?, &layer.post_attn_norm, eps)?;
        let (x, h) = elementwise::add_rms_norm(x, &out, &layer.ffn_norm, eps)?;
        let [gate, up] = &layer.gate_up.forward(&h)?[..] else {
            candle_core::bail!("the gate/up projections gave no two outputs");
        };
        let act = if self.cfg.family.gemma() {
            // GELU with the tanh approximation (`gelu_pytorch_tanh`).
            (gate.gelu()? * up)?
        } else {
            elementwise::swiglu(gate, up)?
        };
        let down = post_norm(layer.w_down.forward(&act)?, &layer.post_ffn_norm, eps)?;
        elementwise::add_rms_norm(&x, &down, next_norm, eps)
    }

    /// Token embeddings as f32, scaled by √hidden for Gemma.
    fn embed_tokens(&self, tokens: &Tensor) -> Result<Tensor> {
        let x = self.embed.embedding(tokens)?.to_dtype(DType::F32)?;
        if !self.cfg.family.gemma() {
            return Ok(x);
        }
        x * f64::from((self.cfg.hidden_size as f32).sqrt())
    }

    /// Which of `ropes` layer `i` rotates with.
    fn rope_index(&self, i: usize) -> usize {
        usize::from(self.cfg.layer_slides(i) && self.ropes.len() > 1)
    }

    /// What a family does to the projections before attention: Qwen2's q/k/v biases, Qwen3's
    /// RMS norm of each query and key head (over `head_dim`, before the rotary embedding).
    fn adjust_qkv(
        &self,
        layer: &Layer,
        [q, k, v]: [&Tensor; 3],
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (mut q, mut k, mut v) = (q.clone(), k.clone(), v.clone());
        if let Some([bq, bk, bv]) = &layer.qkv_bias {
            q = q.broadcast_add(bq)?;
            k = k.broadcast_add(bk)?;
            v = v.broadcast_add(bv)?;
        }
        if let Some([nq, nk]) = &layer.qk_norm {
            let eps = self.cfg.rms_norm_eps as f32;
            let hd = self.cfg.head_dim();
            let per_head = |t: &Tensor, w: &Tensor| -> Result<Tensor> {
                let dims = t.dims().to_vec();
                let last = dims[dims.len() - 1];
                let mut heads = dims.clone();
                heads.pop();
                heads.extend([last / hd, hd]);
                elementwise::rms_norm(&t.contiguous()?.reshape(heads)?, w, eps)?.reshape(dims)
            };
            q = per_head(&q, nq)?;
            k = per_head(&k, nk)?;
        }
        Ok((q, k, v))
    }

    /// The residual stream `x` through every block: the stream after the last one, normed by
    /// the final norm (each block's closing add is fused with the norm after it: the next
    /// block's, or the final one). `attention(i, q, k, v)` is block `i`'s.
    fn blocks(
        &self,
        x: Tensor,
        mut attention: impl FnMut(usize, &Tensor, &Tensor, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let eps = self.cfg.rms_norm_eps as f32;
        let first = self.layers.first().map_or(&self.norm, |l| &l.attn_norm);
        let mut h = elementwise::rms_norm(&x, first, eps)?;
        let mut x = x;
        for (i, layer) in self.layers.iter().enumerate() {
            let next = self.layers.get(i + 1).map_or(&self.norm, |l| &l.attn_norm);
            (x, h) = self.block(layer, (&x, &h), next, |q, k, v| attention(i, q, k, v))?;
        }
        Ok(h)
    }

    /// (groups·seq, pos+seq) additive mask: query row `j·seq + i` sees keys `0..=pos+i`.
    fn causal_mask(&self, seq: usize, pos: usize) -> Result<Tensor> {
        self.attention_mask(seq, pos, None)
    }

    /// [`Self::causal_mask`], and within `window` keys of each query when one is given.
    fn attention_mask(&self, seq: usize, pos: usize, window: Option<usize>) -> Result<Tensor> {
        let groups = self.cfg.num_attention_heads / self.cfg.num_kv_heads();
        let total = pos + seq;
        let mut m = Vec::with_capacity(groups * seq * total);
        for _ in 0..groups {
            for i in 0..seq {
                let p = pos + i;
                let seen = |j: usize| j <= p && window.is_none_or(|w| j + w > p);
                m.extend((0..total).map(|j| if seen(j) { 0f32 } else { f32::NEG_INFINITY }));
            }
        }
        Tensor::from_vec(m, (groups * seq, total), &self.device)
    }

    /// Layer `i`'s sliding window when positions up to `end` reach past it (so some query
    /// must leave early keys out); `None` while attention is plain causal.
    fn window_in_use(&self, i: usize, end: usize) -> Option<usize> {
        self.cfg.attention_window(i).filter(|&w| end > w)
    }

    /// Whether attention over `q` runs in [`cpu_attention`] (row- and chunk-independent
    /// arithmetic) rather than candle's ops.
    fn cpu_attention(&self, q: &Tensor) -> bool {
        self.device.is_cpu() && q.dtype() == DType::F32
    }

    /// For [`cpu_attention`]: `q`, `k`, `v` (b, seq, heads·hd) as heads, rotated for the
    /// positions from `cache`'s on, and the keys and values appended to `cache`.
    fn prepare_cpu_attention(
        &self,
        layer_idx: usize,
        [q, k, v]: [cpu_attention::Projected; 3],
        cache: &mut KvCache,
    ) -> Result<CpuAttention> {
        let (nh, kvh) = (self.cfg.num_attention_heads, self.cfg.num_kv_heads());
        let shape = cpu_attention::Heads {
            head_dim: self.cfg.head_dim(),
            interleaved_rope: self.interleaved_rope,
        };
        let (seq, half) = (q.dims.1, self.cfg.head_dim() / 2);
        let positions = cache.len * half..(cache.len + seq) * half;
        let (cos, sin) = &self.ropes[self.rope_index(layer_idx)].host;
        let (Some(cos), Some(sin)) = (cos.get(positions.clone()), sin.get(positions)) else {
            candle_core::bail!(
                "positions {}..{} past the rope tables",
                cache.len,
                cache.len + seq
            );
        };
        let q = cpu_attention::to_heads_from(q, nh, &shape, Some((cos, sin)), &self.device)?;
        if k.dims.2 != kvh * shape.head_dim {
            candle_core::bail!(
                "keys {:?} are not {kvh} heads of {}",
                k.dims,
                shape.head_dim
            );
        }
        let pos = cache.len;
        let ((k, v), prefix) = cache.append_projected(layer_idx, (k, v), &shape, (cos, sin))?;
        Ok(CpuAttention {
            q,
            prefix,
            k,
            v,
            pos,
        })
    }

    /// Attention of projected `q`, `k`, `v` (b, seq, heads·hd) for rows that share `cache`'s
    /// position: rotary embedding, cache append, softmax(q·kᵀ)·v; (b, seq, heads·hd) before
    /// the output projection.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        layer_idx: usize,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: Option<&Tensor>,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let (b, seq, _) = q.dims3()?;
        let (nh, kvh, hd) = (
            self.cfg.num_attention_heads,
            self.cfg.num_kv_heads(),
            self.cfg.head_dim(),
        );
        let groups = nh / kvh;
        if self.cpu_attention(q) {
            let p = cpu_attention::with_projections([q, k, v], |qkv| {
                self.prepare_cpu_attention(layer_idx, qkv, cache)
            })??;
            let g = p.group();
            return match self.window_in_use(layer_idx, g.pos + seq) {
                Some(w) if seq == 1 => {
                    let view = WindowView::of(&p, w)?;
                    let g = view.group(&p.q);
                    cpu_attention::attend_causal_after(g.q, g.prefix, g.k, g.v, g.pos)
                }
                Some(w) => cpu_attention::attend_window(&g, w),
                None => cpu_attention::attend_causal_after(g.q, g.prefix, g.k, g.v, g.pos),
            };
        }
        // A sliding-window layer past its window masks the keys before it, also in decode.
        let pos = cache.len;
        let window_mask = match self.window_in_use(layer_idx, pos + seq) {
            Some(w) => Some(self.attention_mask(seq, pos, Some(w))?),
            None => None,
        };
        let mask = window_mask.as_ref().or(mask);
        // (b, seq, heads·hd) -> (b, heads, seq, hd)
        let heads = |t: Tensor, n: usize| -> Result<Tensor> {
            t.reshape((b, seq, n, hd))?.transpose(1, 2)?.contiguous()
        };
        let q = heads(q.clone(), nh)?;
        let k = heads(k.clone(), kvh)?;
        let v = heads(v.clone(), kvh)?;
        let (q, k) = if self.interleaved_rope {
            (
                candle_nn::rotary_emb::rope_i(&q, cos, sin)?,
                candle_nn::rotary_emb::rope_i(&k, cos, sin)?,
            )
        } else {
            (
                candle_nn::rotary_emb::rope(&q, cos, sin)?,
                candle_nn::rotary_emb::rope(&k, cos, sin)?,
            )
        };
        let ((k_all, v_all), shared) = cache.append(layer_idx, &k, &v)?;
        if shared.is_some() {
            // `fork` shares a prefix only in CPU f32 caches, which take the branch above.
            candle_core::bail!("internal: a shared KV prefix outside the CPU attention");
        }
        // Grouped-query attention without copying K/V per head: the `groups` query heads that
        // share a KV head are stacked along the sequence axis, (b, kvh, groups·seq, hd).
        let q = q.reshape((b, kvh, groups * seq, hd))?;
        let scale = 1.0 / (hd as f64).sqrt();
        let attend = |q: &Tensor, k: &Tensor, v: &Tensor| -> Result<Tensor> {
            let mut att = (q.matmul(&k.t()?)? * scale)?;
            if let Some(m) = mask {
                att = att.broadcast_add(m)?;
            }
            let att = candle_nn::ops::softmax_last_dim(&att)?;
            att.matmul(v) // (rows, kvh, groups·seq, hd)
        };
        // The rows of a batch attend independently, through small per-head matmuls that each
        // run on one thread: split the rows across the compute threads (each row's arithmetic
        // is the same either way).
        let parts = team::compute_threads().min(b);
        let y = if parts > 1 && self.device.is_cpu() {
            let ys = (0..parts)
                .into_par_iter()
                .map(|i| {
                    let (r0, rows) = (i * b / parts, (i + 1) * b / parts - i * b / parts);
                    attend(
                        &q.narrow(0, r0, rows)?,
                        &k_all.narrow(0, r0, rows)?,
                        &v_all.narrow(0, r0, rows)?,
                    )
                })
                .collect::<Result<Vec<_>>>()?;
            Tensor::cat(&ys, 0)?
        } else {
            attend(&q, &k_all, &v_all)?
        };
        y.reshape((b, nh, seq, hd))?
            .transpose(1, 2)?
            .reshape((b, seq, nh * hd))
    }

    /// One decode step for several independent groups of rows (continuous batching): group
    /// `g` feeds one token per row, `tokens[g]`, at the position of its own cache `caches[g]`
    /// (groups may sit at different positions). The norms and linear layers run over all rows
    /// at once; attention runs per group against its own cache. Returns each group's logits,
    /// (rows, vocab). A group's result is exactly what [`LlamaModel::forward_last`] gives for
    /// it alone: every op here is row-independent.
    pub fn forward_decode(
        &self,
        tokens: &[&[u32]],
        caches: &mut [&mut KvCache],
    ) -> Result<Vec<Tensor>> {
        let seqs = vec![1; tokens.len()];
        team::on_pool(|| self.forward_groups(tokens, &seqs, caches))
    }

    /// Prompt pieces of several one-row caches in one forward pass: `tokens[g]` continues
    /// `caches[g]` from its position. Returns each cache's next-token logits, (1, vocab),
    /// the bits [`LlamaModel::forward_last`] gives for each alone (several requests' prompts
    /// prefilled together read the weights once, as a larger batch).
    pub fn forward_prefill(
        &self,
        tokens: &[&[u32]],
        caches: &mut [&mut KvCache],
    ) -> Result<Vec<Tensor>> {
        let seqs: Vec<usize> = tokens.iter().map(|t| t.len()).collect();
        team::on_pool(|| self.forward_groups(tokens, &seqs, caches))
    }

    /// Groups of rows, each at its own cache's position: group `g` holds `tokens[g].len() /
    /// seqs[g]` rows of `seqs[g]` tokens (row after row). Returns the logits of each row's
    /// last position, (rows, vocab) per group.
    fn forward_groups(
        &self,
        tokens: &[&[u32]],
        seqs: &[usize],
        caches: &mut [&mut KvCache],
    ) -> Result<Vec<Tensor>> {
        if tokens.len() != caches.len() || seqs.len() != caches.len() {
            candle_core::bail!("{} token groups for {} caches", tokens.len(), caches.len());
        }
        let cpu = self.device.is_cpu();
        let mut shapes = Vec::with_capacity(caches.len());
        let mut trig = Vec::with_capacity(caches.len());
        for ((c, t), &seq) in caches.iter().zip(tokens).zip(seqs) {
            if seq == 0 || t.is_empty() || !t.len().is_multiple_of(seq) {
                candle_core::bail!("{} tokens are no rows of {seq}", t.len());
            }
            let rows = t.len() / seq;
            if c.len + seq > self.cfg.context_length() {
                candle_core::bail!(
                    "sequence of {} tokens exceeds the context length {}",
                    c.len + seq,
                    self.cfg.context_length()
                );
            }
            if c.batch() != rows && c.batch() != 0 {
                candle_core::bail!("{rows} rows of tokens for a cache of {} rows", c.batch());
            }
            let mask = if seq > 1 && !cpu {
                Some(self.causal_mask(seq, c.len)?)
            } else {
                None
            };
            let tables = self
                .ropes
                .iter()
                .map(|r| r.narrow(c.len, seq))
                .collect::<Result<Vec<_>>>()?;
            shapes.push((rows, seq));
            trig.push((tables, mask));
        }
        let total: usize = tokens.iter().map(|t| t.len()).sum();
        let ids = Tensor::from_vec(tokens.concat(), (total, 1), &self.device)?;
        let x = self.embed_tokens(&ids)?;
        let mut x = self.blocks(x, |i, q, k, v| {
            if self.cpu_attention(q) {
                return self.groups_cpu_attention(i, [q, k, v], &shapes, caches);
            }
            let mut parts = Vec::with_capacity(shapes.len());
            let mut r0 = 0;
            for &(rows, seq) in &shapes {
                let part = |t: &Tensor| t.narrow(0, r0, rows * seq)?.reshape((rows, seq, ()));
                parts.push((part(q)?, part(k)?, part(v)?));
                r0 += rows * seq;
            }
            // Groups attend independently: spread them over the compute threads.
            let ys = caches
                .par_iter_mut()
                .zip(parts.par_iter())
                .zip(trig.par_iter())
                .map(|((cache, (q, k, v)), (tables, mask))| {
                    let (cos, sin) = &tables[self.rope_index(i)];
                    let y = self.attend(i, q, k, v, cos, sin, mask.as_ref(), cache)?;
                    y.reshape(((), 1, y.dim(2)?))
                })
                .collect::<Result<Vec<_>>>()?;
            Tensor::cat(&ys, 0)
        })?;
        for (c, &(_, seq)) in caches.iter_mut().zip(&shapes) {
            c.len += seq;
        }
        // Only each row's last position goes through the head (the final norm is a row's
        // own: the rows it gave the others are the same bits).
        if shapes.iter().any(|&(_, seq)| seq > 1) {
            let mut last = Vec::new();
            let mut r0 = 0;
            for &(rows, seq) in &shapes {
                last.extend((0..rows).map(|r| (r0 + r * seq + seq - 1) as u32));
                r0 += rows * seq;
            }
            let n = last.len();
            x = x.index_select(&Tensor::from_vec(last, n, &self.device)?, 0)?;
        }
        let logits = self.lm_head.forward(&x)?.squeeze(1)?;
        let mut out = Vec::with_capacity(shapes.len());
        let mut r0 = 0;
        for &(rows, _) in &shapes {
            out.push(logits.narrow(0, r0, rows)?);
            r0 += rows;
        }
        Ok(out)
    }

    /// [`cpu_attention`] for the groups of [`LlamaModel::forward_groups`] (`shapes`: each
    /// one's rows and positions, in order along the first dimension of the projections
    /// `qkv`): each group's keys and values into its cache, then the groups that decode (one
    /// position a row) attend together (rows reading one shared prefix read it together), the
    /// others each by itself. Returns (rows·seq of every group in order, 1, heads·hd).
    fn groups_cpu_attention(
        &self,
        layer: usize,
        qkv: [&Tensor; 3],
        shapes: &[(usize, usize)],
        caches: &mut [&mut KvCache],
    ) -> Result<Tensor> {
        let starts: Vec<usize> = shapes
            .iter()
            .scan(0, |r0, &(rows, seq)| {
                let at = *r0;
                *r0 += rows * seq;
                Some(at)
            })
            .collect();
        // The projections are read once for all groups (a read lock per group and projection,
        // taken by both compute threads at once, made its lock a contended line: 16-request
        // decode steps 2-4 % longer); each group's rows are cut as slices on the thread that
        // prepares it.
        let prepared = cpu_attention::with_projections(qkv, |all| {
            team::map_mut(caches, |g, cache| {
                let (rows, seq, at) = (shapes[g].0, shapes[g].1, starts[g]);
                let [q, k, v] = all.map(|x| x.rows(at, rows, seq));
                self.prepare_cpu_attention(layer, [q?, k?, v?], cache)
            })
        })?
        .into_iter()
        .collect::<Result<Vec<_>>>()?;
        // Past a sliding layer's window a decode step reads the window's keys with the others;
        // a prompt piece (each query its own window) attends alone.
        let seq_of = |p: &CpuAttention| p.q.dim(2).unwrap_or(0);
        let slid = |p: &CpuAttention| self.window_in_use(layer, p.pos + seq_of(p));
        let alone = |p: &CpuAttention| slid(p).is_some() && seq_of(p) > 1;
        let views = prepared
            .iter()
            .map(|p| match slid(p) {
                Some(w) if seq_of(p) == 1 => WindowView::of(p, w).map(Some),
                _ => Ok(None),
            })
            .collect::<Result<Vec<_>>>()?;
        let (decoding, pieces): (Vec<cpu_attention::QueryGroup>, Vec<_>) = prepared
            .iter()
            .zip(&views)
            .filter(|(p, _)| !alone(p))
            .map(|(p, view)| match view {
                Some(view) => view.group(&p.q),
                None => p.group(),
            })
            .partition(|g| g.q.dim(2).is_ok_and(|seq| seq == 1));
        let decoded = if decoding.is_empty() {
            None
        } else {
            Some(cpu_attention::attend_decode(&decoding)?)
        };
        if decoding.len() == prepared.len() {
            return Ok(decoded.expect("some groups decode"));
        }
        let mut prefilled = if pieces.is_empty() {
            Vec::new().into_iter()
        } else {
            cpu_attention::attend_groups(&pieces)?.into_iter()
        };
        let mut ys = Vec::with_capacity(prepared.len());
        let mut row = 0;
        for p in &prepared {
            let (rows, _, seq, _) = p.q.dims4()?;
            if let (Some(w), true) = (slid(p), alone(p)) {
                let y = cpu_attention::attend_window(&p.group(), w)?;
                ys.push(y.reshape((rows * seq, 1, ()))?);
            } else if seq == 1 {
                let d = decoded.as_ref().expect("this group decodes");
                ys.push(d.narrow(0, row, rows)?);
                row += rows;
            } else {
                let y = prefilled.next().expect("one output per prompt piece");
                ys.push(y.reshape((rows * seq, 1, ()))?);
            }
        }
        Tensor::cat(&ys, 0)
    }

    /// Vocabulary-sized logits of the last position for a plain token sequence (batch 1).
    pub fn last_logits(&self, ids: &[u32]) -> Result<Vec<f32>> {
        let mut cache = self.new_cache(ids.len());
        let t = Tensor::new(ids, &self.device)?.unsqueeze(0)?;
        self.forward_last(&t, &mut cache)?
            .squeeze(0)?
            .to_dtype(DType::F32)?
            .to_vec1()
    }
}

/// Index of the largest value.
pub fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &x)| {
            if x > bv {
                (i, x)
            } else {
                (bi, bv)
            }
        })
        .0
}

/// Whether a GGUF of this configuration holds its Q/K rows permuted for the interleaved
/// rotary embedding (llama.cpp does so for the llama architecture only).
fn gguf_qk_permuted(cfg: &LlamaConfig) -> bool {
    cfg.family == super::config::Family::Llama
}

/// A GGUF model as HF parts: config, HF-named tensors, `rope_freqs` factors.
pub type HfParts = (
    LlamaConfig,
    std::collections::HashMap<String, Tensor>,
    Option<Vec<f32>>,
);

/// A GGUF file as HF-named f32 tensors in the HF (half-split rotary) layout: every tensor
/// dequantized, Q/K rows un-permuted where llama.cpp permuted them, Qwen's biases and q/k norms
/// under their HF names. Returns the config (with the GGUF's
/// BOS/EOS ids), the tensors and the `rope_freqs` factors if the file has them.
pub fn hf_tensors_from_gguf(path: &Path, device: &Device) -> std::result::Result<HfParts, String> {
    let err = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    let mut file = std::fs::File::open(path).map_err(|e| err(&e))?;
    let content = gguf_file::Content::read(&mut file).map_err(|e| err(&e))?;
    let mut cfg = LlamaConfig::from_gguf_checked(&content).map_err(|e| err(&e))?;
    let meta_id = |k: &str| meta_u32(&content, k).map(|v| serde_json::Value::from(v as u64));
    cfg.bos_token_id = meta_id("tokenizer.ggml.bos_token_id");
    cfg.eos_token_id = meta_id("tokenizer.ggml.eos_token_id");
    let mut get = |name: &str| -> std::result::Result<Tensor, String> {
        content
            .tensor(&mut file, name, device)
            .and_then(|t| t.dequantize(device))
            .map_err(|e| err(&format!("tensor `{name}`: {e}")))
    };
    let mut tensors = std::collections::HashMap::new();
    tensors.insert(
        "model.embed_tokens.weight".to_string(),
        get("token_embd.weight")?,
    );
    // Gemma's GGUF norms are 1 + w; HF names hold w.
    let gemma = cfg.family.gemma();
    let unshift = |name: &str, w: Tensor| -> std::result::Result<Tensor, String> {
        if gemma {
            (w - 1.0).map_err(|e| err(&format!("tensor `{name}`: {e}")))
        } else {
            Ok(w)
        }
    };
    let name = "output_norm.weight";
    tensors.insert("model.norm.weight".to_string(), unshift(name, get(name)?)?);
    let norms: &[(&str, &str)] = if gemma {
        &[
            ("attn_norm", "input_layernorm"),
            ("post_attention_norm", "post_attention_layernorm"),
            ("ffn_norm", "pre_feedforward_layernorm"),
            ("post_ffw_norm", "post_feedforward_layernorm"),
            ("attn_q_norm", "self_attn.q_norm"),
            ("attn_k_norm", "self_attn.k_norm"),
        ]
    } else if cfg.family.qk_norm() {
        &[
            ("attn_norm", "input_layernorm"),
            ("ffn_norm", "post_attention_layernorm"),
            ("attn_q_norm", "self_attn.q_norm"),
            ("attn_k_norm", "self_attn.k_norm"),
        ]
    } else {
        &[
            ("attn_norm", "input_layernorm"),
            ("ffn_norm", "post_attention_layernorm"),
        ]
    };
    if content.tensor_infos.contains_key("output.weight") {
        tensors.insert("lm_head.weight".to_string(), get("output.weight")?);
    }
    let factors = if content.tensor_infos.contains_key("rope_freqs.weight") {
        Some(
            get("rope_freqs.weight")?
                .to_vec1::<f32>()
                .map_err(|e| err(&e))?,
        )
    } else {
        None
    };
    for i in 0..cfg.num_hidden_layers {
        let g = format!("blk.{i}");
        let h = format!("model.layers.{i}");
        for (gg, hf) in norms {
            let name = format!("{g}.{gg}.weight");
            tensors.insert(format!("{h}.{hf}.weight"), unshift(&name, get(&name)?)?);
        }
        for (gg, hf) in [
            ("attn_v", "self_attn.v_proj"),
            ("attn_output", "self_attn.o_proj"),
            ("ffn_gate", "mlp.gate_proj"),
            ("ffn_up", "mlp.up_proj"),
            ("ffn_down", "mlp.down_proj"),
        ] {
            tensors.insert(
                format!("{h}.{hf}.weight"),
                get(&format!("{g}.{gg}.weight"))?,
            );
        }
        let mut q = get(&format!("{g}.attn_q.weight"))?;
        let mut k = get(&format!("{g}.attn_k.weight"))?;
        if gguf_qk_permuted(&cfg) {
            q = unpermute_gguf_qk(&q, cfg.num_attention_heads).map_err(|e| err(&e))?;
            k = unpermute_gguf_qk(&k, cfg.num_kv_heads()).map_err(|e| err(&e))?;
        }
        tensors.insert(format!("{h}.self_attn.q_proj.weight"), q);
        tensors.insert(format!("{h}.self_attn.k_proj.weight"), k);
        if cfg.family.qkv_bias() {
            for (gg, hf) in [
                ("attn_q", "q_proj"),
                ("attn_k", "k_proj"),
                ("attn_v", "v_proj"),
            ] {
                tensors.insert(
                    format!("{h}.self_attn.{hf}.bias"),
                    get(&format!("{g}.{gg}.bias"))?,
                );
            }
        }
    }
    Ok((cfg, tensors, factors))
}

/// GGUF stores Q/K rows permuted for the interleaved rotary embedding; this returns them in
/// the HF (half-split) order: rows reshaped to (heads, head_dim/2, 2), the last two axes
/// swapped (the inverse of llama.cpp's `permute`).
pub fn unpermute_gguf_qk(w: &Tensor, heads: usize) -> Result<Tensor> {
    let (rows, cols) = w.dims2()?;
    let hd = rows / heads;
    w.reshape((heads, hd / 2, 2, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((rows, cols))
}

/// The HF → GGUF direction of [`unpermute_gguf_qk`].
pub fn permute_hf_qk(w: &Tensor, heads: usize) -> Result<Tensor> {
    let (rows, cols) = w.dims2()?;
    let hd = rows / heads;
    w.reshape((heads, 2, hd / 2, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((rows, cols))
}

#[cfg(test)]
mod cache_tests {
    use super::*;

    const LAYERS: usize = 2;

    fn randn(positions: usize) -> Tensor {
        Tensor::randn(0f32, 1.0, (1, 2, positions, 4), &Device::Cpu).unwrap()
    }

    /// Whether two tensors' values live in one allocation.
    fn same_memory(a: &Tensor, b: &Tensor) -> bool {
        std::ptr::eq(&*a.storage_and_layout().0, &*b.storage_and_layout().0)
    }

    fn values(c: &KvCache, layer: usize, len: usize) -> Vec<f32> {
        let (k, v) = c.row0_positions(layer, 0, len).unwrap().unwrap();
        let all = Tensor::cat(&[&k, &v], 2).unwrap();
        all.flatten_all().unwrap().to_vec1().unwrap()
    }

    #[test]
    fn an_f16_cache_stores_the_rounded_values_and_its_forks_keep_f16() {
        let mut cache = KvCache {
            layers: (0..LAYERS).map(|_| None).collect(),
            shared: None,
            len: 0,
            capacity: 8,
            f16: true,
        };
        let written: Vec<(Tensor, Tensor)> = (0..LAYERS).map(|_| (randn(5), randn(5))).collect();
        for (layer, (k, v)) in written.iter().enumerate() {
            let ((kk, vv), _) = cache.append(layer, k, v).unwrap();
            assert_eq!((kk.dtype(), vv.dtype()), (DType::F16, DType::F16));
        }
        cache.len = 5;
        let rounded = |t: &Tensor| -> Vec<f32> {
            let h = t
                .to_dtype(DType::F16)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            h.flatten_all().unwrap().to_vec1().unwrap()
        };
        let widened = |c: &KvCache, layer: usize, len: usize| -> Vec<f32> {
            let (k, v) = c.row0_positions(layer, 0, len).unwrap().unwrap();
            let all = Tensor::cat(&[&k, &v], 2)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            all.flatten_all().unwrap().to_vec1().unwrap()
        };
        for (layer, (k, v)) in written.iter().enumerate() {
            let want = rounded(&Tensor::cat(&[k, v], 2).unwrap());
            assert_eq!(widened(&cache, layer, 5), want, "layer {layer}");
        }
        // Samples forked from it, and a prefix of it, append f16 after the shared positions.
        let mut fork = cache.fork(2, 3).unwrap();
        let ((k, _), shared) = fork
            .append(
                0,
                &randn(1).repeat((2, 1, 1, 1)).unwrap(),
                &randn(1).repeat((2, 1, 1, 1)).unwrap(),
            )
            .unwrap();
        assert_eq!(k.dtype(), DType::F16);
        assert_eq!(shared.unwrap().0.dtype(), DType::F16);
        let mut start = cache.prefix(3, 6).unwrap();
        let ((k, _), _) = start.append(1, &randn(2), &randn(2)).unwrap();
        assert_eq!(k.dtype(), DType::F16);
        // A cache not told to keeps f32.
        let mut plain = KvCache {
            f16: false,
            ..KvCache::placeholder(0)
        };
        plain.layers = vec![None];
        plain.capacity = 4;
        let ((k, _), _) = plain.append(0, &randn(2), &randn(2)).unwrap();
        assert_eq!(k.dtype(), DType::F32);
    }

    #[test]
    fn prefixes_of_a_shared_prompt_keep_reading_it_in_place() {
        let prompt = KvCache {
            layers: (0..LAYERS).map(|_| Some((randn(10), randn(10)))).collect(),
            shared: None,
            len: 10,
            capacity: 10,
            f16: false,
        };
        // A request forked from the prompt, with three positions of its own after it.
        let mut request = prompt.fork(1, 4).unwrap();
        for layer in 0..LAYERS {
            request.append(layer, &randn(3), &randn(3)).unwrap();
        }
        request.len += 3;
        let prompt_k =
            |c: &KvCache, l: usize| c.shared.as_ref().unwrap().layers[l].clone().unwrap().0;
        for (len, capacity) in [(12, 16), (10, 10), (7, 9)] {
            let hit = request.prefix(len, capacity).unwrap();
            assert_eq!(hit.len(), len);
            for layer in 0..LAYERS {
                assert_eq!(
                    values(&hit, layer, len),
                    values(&request, layer, len),
                    "{len}"
                );
                // The prompt's positions are read where they are (only positions past them
                // are copied), so requests that start from one stored conversation read one
                // copy of it.
                let original = prompt.layers[layer].as_ref().unwrap();
                assert!(same_memory(&prompt_k(&hit, layer), &original.0), "{len}");
            }
        }
        // Appending after a hit leaves the stored cache as it was.
        let before = values(&request, 0, 13);
        let mut hit = request.prefix(11, 14).unwrap();
        for layer in 0..LAYERS {
            hit.append(layer, &randn(2), &randn(2)).unwrap();
        }
        assert_eq!(values(&request, 0, 13), before);
    }
}
