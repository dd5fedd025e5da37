//! Training ops with an explicit backward pass, for [`super::model::TrainLlama`].
//!
//! candle's autograd has two costs that dominate a CPU training step (BENCHMARKS.md):
//! a matmul's backward always computes the gradient of *both* operands, frozen weights
//! included (LoRA paid for every base weight's gradient), and it builds those gradients with
//! tracked tensors, so every weight gradient kept the whole forward graph alive until the
//! optimizer had run. Composed element-wise ops (`rms_norm_slow`, a generic softmax, a
//! log-softmax over the vocabulary) also store several full-size intermediates each.
//!
//! Each op here is a candle custom op whose backward computes only the gradients that are
//! needed, from detached tensors, and stores only what the backward reads. `linear` runs on
//! every device (its forward is the backend's own matmul); the others have fused f32 CPU
//! kernels and fall back to the composed differentiable ops on other devices or dtypes (the
//! path this crate prescribes: never the fast kernels without a backward). Unit tests below
//! check every op's values and gradients against the composed ops.

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, D,
};

// ---------------------------------------------------------------------------------------------
// CPU helpers

/// The f32 data of a contiguous CPU operand.
fn f32s<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    let (start, end) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{what}: operand must be contiguous")))?;
    Ok(&s.as_slice::<f32>()?[start..end])
}

/// The f32 data of a contiguous CPU tensor's storage (a weight or a gradient).
pub fn cpu_f32<'a>(s: &'a candle_core::Storage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    match s {
        candle_core::Storage::Cpu(c) => f32s(c, l, what),
        _ => candle_core::bail!("{what}: expected a CPU tensor"),
    }
}

/// The f32 data of a contiguous CPU storage, for writing in place.
pub fn cpu_f32_mut<'a>(s: &'a mut CpuStorage, l: &Layout, what: &str) -> Result<&'a mut [f32]> {
    let (start, end) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{what}: must be contiguous")))?;
    match s {
        CpuStorage::F32(v) => Ok(&mut v[start..end]),
        _ => candle_core::bail!("{what}: expected f32"),
    }
}

/// Runs `f(row, out_row)` for every row of `out` (rows of `width`) on candle's CPU worker
/// pool, the one its own element-wise kernels use (a second pool would compete for cores).
pub(crate) fn par_rows(out: &mut [f32], width: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    struct Rows(*mut f32);
    // SAFETY: the pointer is only used to hand out disjoint rows, see below.
    unsafe impl Sync for Rows {}
    let rows = out.len() / width.max(1);
    let base = Rows(out.as_mut_ptr());
    let base = &base;
    candle_core::utils::barrier_pool().execute_chunked(rows, |range| {
        for r in range {
            // SAFETY: `execute_chunked` hands every row index to exactly one call, rows do
            // not overlap, and `out` outlives the pool call.
            let row = unsafe { std::slice::from_raw_parts_mut(base.0.add(r * width), width) };
            f(r, row);
        }
    });
}

static FORCE_COMPOSED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The environment variable that makes every op take the composed path on the CPU too: what a
/// GPU runs, checkable without one.
pub const COMPOSED_OPS_ENV: &str = "COLLABLLM_COMPOSED_OPS";

/// Makes every op of this process take candle's composed differentiable ops (what runs on
/// CUDA) instead of the fused f32 CPU kernels (`true`), or go back to them (`false`).
pub fn force_composed_ops(on: bool) {
    FORCE_COMPOSED.store(on, std::sync::atomic::Ordering::Relaxed);
}

fn composed_forced() -> bool {
    static FROM_ENV: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    FORCE_COMPOSED.load(std::sync::atomic::Ordering::Relaxed)
        || *FROM_ENV.get_or_init(|| {
            std::env::var(COMPOSED_OPS_ENV).is_ok_and(|v| !v.is_empty() && v != "0")
        })
}

/// Whether the fused CPU kernels apply to these tensors.
pub(crate) fn fused(ts: &[&Tensor]) -> bool {
    !composed_forced()
        && ts
            .iter()
            .all(|t| t.device().is_cpu() && t.dtype() == DType::F32)
}

fn cpu_out(data: Vec<f32>, shape: &Shape) -> (CpuStorage, Shape) {
    (CpuStorage::F32(data), shape.clone())
}

/// The storage of `t`, computed beforehand with ordinary tensor ops, as a custom op's forward
/// result: for ops whose forward needs no kernel of its own but whose backward is their own
/// (`chunked_head`, `chunked_attention`). `t` must own its storage (fresh from `cat`).
pub(crate) fn precomputed_cpu(t: &Tensor) -> Result<(CpuStorage, Shape)> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cpu(s) => Ok((s.try_clone(layout)?, t.shape().clone())),
        _ => candle_core::bail!("precomputed result: expected a CPU tensor"),
    }
}

/// [`precomputed_cpu`] for CUDA.
pub(crate) fn precomputed_cuda(t: &Tensor) -> Result<(candle_core::CudaStorage, Shape)> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cuda(s) => Ok((s.try_clone(layout)?, t.shape().clone())),
        _ => candle_core::bail!("precomputed result: expected a CUDA tensor"),
    }
}

// ---------------------------------------------------------------------------------------------
// linear

/// `x (m, k) · wᵀ` for `w (n, k)`, through the backend's matmul (the layout of `wᵀ` is a
/// transposed view, exactly what `x.matmul(&w.t())` passes).
fn matmul_t<S: BackendStorage>(x: &S, lx: &Layout, w: &S, lw: &Layout) -> Result<(S, Shape)> {
    let (m, k) = lx.shape().dims2()?;
    let (n, k2) = lw.shape().dims2()?;
    if k != k2 {
        candle_core::bail!("linear: input has {k} features, the weight expects {k2}");
    }
    let out = x.matmul(w, (1, m, n, k), lx, &lw.transpose(0, 1)?)?;
    Ok((out, Shape::from((m, n))))
}

struct Linear;

impl CustomOp2 for Linear {
    fn name(&self) -> &'static str {
        "train-linear"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        matmul_t(s1, l1, s2, l2)
    }

    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        matmul_t(s1, l1, s2, l2)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = g.detach().contiguous()?;
        // (m, n)·(n, k) for the input; (n, m)·(m, k) for the weight, only when it is
        // trainable: a frozen weight gets no gradient computed, none stored.
        let gx = x.track_op().then(|| g.matmul(&w.detach())).transpose()?;
        let gw = w
            .track_op()
            .then(|| g.t()?.matmul(&x.detach()))
            .transpose()?;
        Ok((gx, gw))
    }
}

/// `x (…, in) · wᵀ` for `w (out, in)`; the weight's gradient is computed only when `w` is
/// trainable.
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    on_rows(x, w.dim(0)?, |rows| rows.apply_op2(w, Linear))
}

/// [`linear`], plus `bias (out,)` when there is one.
pub fn linear_with_bias(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let y = linear(x, w)?;
    match bias {
        Some(bias) => y.broadcast_add(bias),
        None => Ok(y),
    }
}

/// `f` of `x (…, in)` seen as a (rows, in) matrix, its (rows, out) result given `x`'s leading
/// dimensions back.
fn on_rows(x: &Tensor, out: usize, f: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let mut dims = x.dims().to_vec();
    let inner = dims[dims.len() - 1];
    let rows = x.elem_count() / inner;
    let y = f(&x.reshape((rows, inner))?)?;
    let last = dims.len() - 1;
    dims[last] = out;
    y.reshape(dims)
}

// ---------------------------------------------------------------------------------------------
// LoRA projection

/// `x · Wᵀ (+ bias) + (x · Aᵀ) · Bᵀ` over a frozen `W` as one op. The graph keeps the op's
/// inputs (x, A, B: the first shared with the layer's other projections) and its output;
/// the composed form also keeps the base output and the update, two more (tokens × out)
/// tensors per projection — on a 4,864-wide MLP most of a LoRA step's activation memory,
/// which PyTorch frees after the forward pass.
struct LoraLinear {
    w: Tensor,
    bias: Option<Tensor>,
}

fn f32_vec(s: CpuStorage, what: &str) -> Result<Vec<f32>> {
    match s {
        CpuStorage::F32(v) => Ok(v),
        _ => candle_core::bail!("{what}: expected f32"),
    }
}

impl CustomOp3 for LoraLinear {
    fn name(&self) -> &'static str {
        "train-lora-linear"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sa: &CpuStorage,
        la: &Layout,
        sb: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (w_storage, lw) = self.w.storage_and_layout();
        let candle_core::Storage::Cpu(sw) = &*w_storage else {
            candle_core::bail!("lora linear: expected a CPU weight");
        };
        let (base, shape) = matmul_t(sx, lx, sw, lw)?;
        let (xa, xa_shape) = matmul_t(sx, lx, sa, la)?;
        let (update, _) = matmul_t(&xa, &Layout::contiguous(xa_shape), sb, lb)?;
        let mut out = f32_vec(base, "lora linear")?;
        let update = f32_vec(update, "lora update")?;
        let bias = match &self.bias {
            Some(b) => {
                let (bs, bl) = b.storage_and_layout();
                cpu_f32(&bs, bl, "lora linear bias")?.to_vec()
            }
            None => Vec::new(),
        };
        let width = shape.dims2()?.1;
        par_rows(&mut out, width, |r, row| {
            let upd = &update[r * width..(r + 1) * width];
            for (o, u) in row.iter_mut().zip(upd) {
                *o += u;
            }
            for (o, b) in row.iter_mut().zip(&bias) {
                *o += b;
            }
        });
        Ok((CpuStorage::F32(out), shape))
    }

    fn bwd(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let g = g.detach().contiguous()?;
        let (x, a, b) = (x.detach(), a.detach(), b.detach());
        let gb = g.matmul(&b)?; // (m, r)
        let gx = (g.matmul(&self.w)? + gb.matmul(&a)?)?;
        let ga = gb.t()?.matmul(&x)?;
        // x · Aᵀ again: (m, r), cheaper to recompute than to keep.
        let xa = x.matmul(&a.t()?)?;
        let gb_weight = g.t()?.matmul(&xa)?;
        Ok((Some(gx), Some(ga), Some(gb_weight)))
    }
}

/// `x (…, in) · Wᵀ (+ bias) + (x · Aᵀ) · Bᵀ` for `W (out, in)`, `A (r, in)`, `B (out, r)` (the
/// LoRA scale already in `B`): one fused op where `W` and the bias are frozen f32 CPU
/// tensors, else the composed ops.
pub fn lora_linear(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    a: &Tensor,
    b: &Tensor,
) -> Result<Tensor> {
    let frozen = !w.track_op() && bias.is_none_or(|t| !t.track_op());
    let operands: Vec<&Tensor> = [x, w, a, b].into_iter().chain(bias).collect();
    if !frozen || !fused(&operands) {
        return linear_with_bias(x, w, bias)? + linear(&linear(x, a)?, b)?;
    }
    let op = LoraLinear {
        w: w.contiguous()?,
        bias: bias.map(Tensor::contiguous).transpose()?,
    };
    on_rows(x, w.dim(0)?, |rows| rows.apply_op3(a, b, op))
}

// ---------------------------------------------------------------------------------------------
// RMS norm

struct RmsNorm {
    eps: f32,
}

/// `1 / sqrt(mean(x²) + eps)` of one row.
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    1.0 / (ss / x.len() as f32 + eps).sqrt()
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "train-rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, w) = (f32s(s1, l1, "rms_norm")?, f32s(s2, l2, "rms_norm")?);
        let h = w.len();
        let mut out = vec![0f32; x.len()];
        par_rows(&mut out, h, |r, y| {
            let xr = &x[r * h..(r + 1) * h];
            let inv = inv_rms(xr, self.eps);
            for ((y, x), w) in y.iter_mut().zip(xr).zip(w) {
                *y = x * inv * w;
            }
        });
        Ok(cpu_out(out, l1.shape()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (x_grad, w_grad) = (x.track_op(), w.track_op());
        let (x, w, g) = (x.detach(), w.detach(), g.detach().contiguous()?);
        let input_grad = RmsNormGradInput { eps: self.eps };
        let gx = x_grad
            .then(|| x.apply_op3_no_bwd(&w, &g, &input_grad))
            .transpose()?;
        // dL/dw = Σ_rows g ⊙ x / rms(x).
        let gw = w_grad
            .then(|| {
                let normed = x.apply_op2_no_bwd(&w.ones_like()?, self)?;
                (&g * normed)?.reshape(((), w.dim(0)?))?.sum(0)
            })
            .transpose()?;
        Ok((gx, gw))
    }
}

/// Gradient of RMS norm with respect to its input, from `x`, `w` and the upstream gradient.
struct RmsNormGradInput {
    eps: f32,
}

impl CustomOp3 for RmsNormGradInput {
    fn name(&self) -> &'static str {
        "train-rms-norm-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = f32s(s1, l1, "rms_norm grad")?;
        let w = f32s(s2, l2, "rms_norm grad")?;
        let g = f32s(s3, l3, "rms_norm grad")?;
        let h = w.len();
        let mut out = vec![0f32; x.len()];
        par_rows(&mut out, h, |r, gx| {
            let (xr, gr) = (&x[r * h..(r + 1) * h], &g[r * h..(r + 1) * h]);
            let inv = inv_rms(xr, self.eps);
            // y = x·inv·w; dL/dx = inv·(g⊙w) − x·inv³/h · Σ(g⊙w⊙x)
            let dot: f32 = gr.iter().zip(w).zip(xr).map(|((g, w), x)| g * w * x).sum();
            let c = inv * inv * inv * dot / h as f32;
            for (((o, g), w), x) in gx.iter_mut().zip(gr).zip(w).zip(xr) {
                *o = inv * g * w - c * x;
            }
        });
        Ok(cpu_out(out, l1.shape()))
    }
}

/// RMS norm over the last dimension with weight `w` (`rms_norm_slow`'s values).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    if !fused(&[x, w]) {
        return candle_nn::ops::rms_norm_slow(x, w, eps);
    }
    x.contiguous()?.apply_op2(&w.contiguous()?, RmsNorm { eps })
}

// ---------------------------------------------------------------------------------------------
// attention softmax

/// `softmax(scale · scores + bias)` over the last dimension; `scores` (b, h, q, k), `bias`
/// (b, 1, q, k) shared by the heads (causal and padding mask).
struct MaskedSoftmax {
    scale: f32,
}

impl CustomOp2 for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "train-masked-softmax"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (s, bias) = (f32s(s1, l1, "softmax")?, f32s(s2, l2, "softmax")?);
        let (_b, h, q, k) = l1.shape().dims4()?;
        let mut out = vec![0f32; s.len()];
        par_rows(&mut out, k, |r, p| {
            // Row r is (batch, head, query) = (r / (h·q), ·, r % q).
            let bias_row = (r / (h * q)) * q + r % q;
            let (sr, br) = (
                &s[r * k..(r + 1) * k],
                &bias[bias_row * k..(bias_row + 1) * k],
            );
            rows::masked_softmax(p, sr, br, self.scale);
        });
        Ok(cpu_out(out, l1.shape()))
    }

    fn bwd(
        &self,
        _scores: &Tensor,
        _bias: &Tensor,
        p: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let gs = p.detach().apply_op2_no_bwd(
            &g.detach().contiguous()?,
            &SoftmaxGrad { scale: self.scale },
        )?;
        Ok((Some(gs), None)) // the mask is a constant
    }
}

/// `scale · p ⊙ (g − Σ g⊙p)` per row: the gradient of a softmax's (scaled) input.
struct SoftmaxGrad {
    scale: f32,
}

impl CustomOp2 for SoftmaxGrad {
    fn name(&self) -> &'static str {
        "train-softmax-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (p, g) = (f32s(s1, l1, "softmax grad")?, f32s(s2, l2, "softmax grad")?);
        let k = l1.dims()[l1.dims().len() - 1];
        let mut out = vec![0f32; p.len()];
        par_rows(&mut out, k, |r, o| {
            let (pr, gr) = (&p[r * k..(r + 1) * k], &g[r * k..(r + 1) * k]);
            let dot: f32 = pr.iter().zip(gr).map(|(p, g)| p * g).sum();
            for ((o, p), g) in o.iter_mut().zip(pr).zip(gr) {
                *o = self.scale * p * (g - dot);
            }
        });
        Ok(cpu_out(out, l1.shape()))
    }
}

/// Differentiable softmax over the last dimension. The row maximum is subtracted for
/// stability only and is detached: softmax does not depend on it, so its (costly) backward
/// through `max` would contribute exactly zero.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let num = x.broadcast_sub(&max)?.exp()?;
    let den = num.sum_keepdim(D::Minus1)?;
    num.broadcast_div(&den)
}

/// Attention probabilities `softmax(scale · scores + bias)`: `scores` (b, h, q, k), `bias`
/// (b, 1, q, k), a constant.
pub fn masked_softmax(scores: &Tensor, bias: &Tensor, scale: f64) -> Result<Tensor> {
    if !fused(&[scores, bias]) {
        return softmax_last_dim(&(scores * scale)?.broadcast_add(bias)?);
    }
    let (b, _h, q, k) = scores.dims4()?;
    if bias.dims() != [b, 1, q, k] {
        candle_core::bail!(
            "attention bias {:?} for scores {:?}",
            bias.dims(),
            scores.dims()
        );
    }
    scores.contiguous()?.apply_op2(
        &bias.detach().contiguous()?,
        MaskedSoftmax {
            scale: scale as f32,
        },
    )
}

// ---------------------------------------------------------------------------------------------
// rotary embedding

/// Half-split rotary embedding (HF llama layout) of `x (b, h, t, d)` with tables `cos`,
/// `sin` of (t, d/2), or (b, 1, t, d/2) when every row has its own positions; `inverse`
/// rotates the other way (the transpose, i.e. the backward pass).
struct Rope {
    cos: Tensor,
    sin: Tensor,
    inverse: bool,
}

impl CustomOp1 for Rope {
    fn name(&self) -> &'static str {
        "train-rope"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32s(s, l, "rope")?;
        let (_b, h, t, d) = l.shape().dims4()?;
        let half = d / 2;
        let per_row = self.cos.rank() == 4;
        let (cos_s, cos_l) = self.cos.storage_and_layout();
        let (sin_s, sin_l) = self.sin.storage_and_layout();
        let cos = cpu_f32(&cos_s, cos_l, "rope cos")?;
        let sin = cpu_f32(&sin_s, sin_l, "rope sin")?;
        let sign = if self.inverse { -1.0 } else { 1.0 };
        let mut out = vec![0f32; x.len()];
        par_rows(&mut out, d, |r, y| {
            // Row r is (batch, head, position) = (r / (h·t), ·, r % t).
            let table_row = if per_row {
                (r / (h * t)) * t + r % t
            } else {
                r % t
            };
            let p = table_row * half;
            let xr = &x[r * d..(r + 1) * d];
            for i in 0..half {
                let (c, s) = (cos[p + i], sign * sin[p + i]);
                let (x1, x2) = (xr[i], xr[i + half]);
                y[i] = x1 * c - x2 * s;
                y[i + half] = x2 * c + x1 * s;
            }
        });
        Ok(cpu_out(out, l.shape()))
    }

    fn bwd(&self, _x: &Tensor, _y: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        let inverse = Rope {
            cos: self.cos.clone(),
            sin: self.sin.clone(),
            inverse: !self.inverse,
        };
        Ok(Some(g.detach().contiguous()?.apply_op1_no_bwd(&inverse)?))
    }
}

/// [`rope`] from differentiable element-wise ops (`rope_slow`, generalised to per-row
/// tables).
fn rope_composed(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let cos = Tensor::cat(&[cos, cos], D::Minus1)?;
    let sin = Tensor::cat(&[sin, sin], D::Minus1)?;
    let (x1, x2) = (
        x.narrow(D::Minus1, 0, half)?,
        x.narrow(D::Minus1, half, half)?,
    );
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?
}

/// Half-split rotary embedding of `x (b, h, t, d)` with `cos`, `sin` of (t, d/2) or, for
/// per-row positions, (b, 1, t, d/2) (`rope_slow`'s values).
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (b, _h, t, d) = x.dims4()?;
    let table_ok = |c: &Tensor| c.dims() == [t, d / 2] || c.dims() == [b, 1, t, d / 2];
    if !table_ok(cos) || !table_ok(sin) {
        candle_core::bail!("rope tables {:?} for input {:?}", cos.dims(), x.dims());
    }
    if !fused(&[x, cos, sin]) {
        return rope_composed(x, cos, sin);
    }
    x.contiguous()?.apply_op1(Rope {
        cos: cos.detach().contiguous()?,
        sin: sin.detach().contiguous()?,
        inverse: false,
    })
}

// ---------------------------------------------------------------------------------------------
// SwiGLU

/// `silu(gate) ⊙ up`.
struct SwiGlu;

/// Row kernels of the fused ops, vectorized ([`crate::engine::simd`]).
mod rows {
    use crate::engine::simd::{dispatch, exp, sigmoid};

    const LANES: usize = 16;

    /// silu(x), silu'(x).
    #[inline(always)]
    fn silu_parts(x: f32) -> (f32, f32) {
        let s = sigmoid(x);
        (x * s, s * (1.0 + x * (1.0 - s)))
    }

    /// `g ⊙ up ⊙ silu'(gate)` (the gate's gradient), or `g ⊙ silu(gate)` with `wrt_up`.
    #[inline(always)]
    fn swiglu_grad_any(out: &mut [f32], gate: &[f32], up: &[f32], g: &[f32], wrt_up: bool) {
        let rows = out.iter_mut().zip(gate).zip(up).zip(g);
        if wrt_up {
            for (((o, x), _), g) in rows {
                *o = g * silu_parts(*x).0;
            }
        } else {
            for (((o, x), u), g) in rows {
                *o = g * u * silu_parts(*x).1;
            }
        }
    }

    /// `p = softmax(scale · s + bias)` of one row.
    #[inline(always)]
    fn masked_softmax_any(p: &mut [f32], s: &[f32], bias: &[f32], scale: f32) {
        for ((p, s), b) in p.iter_mut().zip(s).zip(bias) {
            *p = scale * s + b;
        }
        let mut lanes = [f32::NEG_INFINITY; LANES];
        let chunks = p.chunks_exact(LANES);
        let tail = chunks.remainder();
        for c in chunks {
            for (m, &z) in lanes.iter_mut().zip(c) {
                *m = m.max(z);
            }
        }
        let max = lanes
            .iter()
            .chain(tail)
            .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let mut sums = [0f32; LANES];
        let mut chunks = p.chunks_exact_mut(LANES);
        for c in &mut chunks {
            for (s, z) in sums.iter_mut().zip(c) {
                *z = exp(*z - max);
                *s += *z;
            }
        }
        let mut sum: f32 = sums.iter().sum();
        for z in chunks.into_remainder() {
            *z = exp(*z - max);
            sum += *z;
        }
        let inv = 1.0 / sum;
        p.iter_mut().for_each(|p| *p *= inv);
    }

    pub(super) use crate::engine::simd::swiglu;
    dispatch!(pub(super) swiglu_grad, swiglu_grad_any,
        (out: &mut [f32], gate: &[f32], up: &[f32], g: &[f32], wrt_up: bool) -> ());
    dispatch!(pub(super) masked_softmax, masked_softmax_any,
        (p: &mut [f32], s: &[f32], bias: &[f32], scale: f32) -> ());
}

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "train-swiglu"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (gate, up) = (f32s(s1, l1, "swiglu")?, f32s(s2, l2, "swiglu")?);
        let w = l1.dims()[l1.dims().len() - 1];
        let mut out = vec![0f32; gate.len()];
        par_rows(&mut out, w, |r, o| {
            let span = r * w..(r + 1) * w;
            // SAFETY: `swiglu` writes only computed (initialized) values.
            let o = unsafe { crate::engine::simd::as_uninit(o) };
            rows::swiglu(o, &gate[span.clone()], &up[span]);
        });
        Ok(cpu_out(out, l1.shape()))
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = g.detach().contiguous()?;
        let grad = |wrt_up: bool, needed: bool| -> Result<Option<Tensor>> {
            if !needed {
                return Ok(None);
            }
            let op = SwiGluGrad { wrt_up };
            Ok(Some(gate.detach().apply_op3_no_bwd(
                &up.detach(),
                &g,
                &op,
            )?))
        };
        Ok((grad(false, gate.track_op())?, grad(true, up.track_op())?))
    }
}

/// From `gate`, `up` and the upstream gradient `g`: `g ⊙ up ⊙ silu'(gate)` (the gate's
/// gradient), or `g ⊙ silu(gate)` (up's) with `wrt_up`.
struct SwiGluGrad {
    wrt_up: bool,
}

impl CustomOp3 for SwiGluGrad {
    fn name(&self) -> &'static str {
        "train-swiglu-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let gate = f32s(s1, l1, "swiglu grad")?;
        let up = f32s(s2, l2, "swiglu grad")?;
        let g = f32s(s3, l3, "swiglu grad")?;
        let w = l1.dims()[l1.dims().len() - 1];
        let mut out = vec![0f32; gate.len()];
        par_rows(&mut out, w, |r, o| {
            let span = r * w..(r + 1) * w;
            rows::swiglu_grad(
                o,
                &gate[span.clone()],
                &up[span.clone()],
                &g[span],
                self.wrt_up,
            );
        });
        Ok(cpu_out(out, l1.shape()))
    }
}

/// `silu(gate) ⊙ up` (the llama MLP's activation).
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if !fused(&[gate, up]) || gate.dims() != up.dims() {
        return gate.silu()? * up;
    }
    gate.contiguous()?.apply_op2(&up.contiguous()?, SwiGlu)
}

// ---------------------------------------------------------------------------------------------
// token log-probabilities

/// `log_softmax(logits)[label]` per row: logits (K, V) f32, labels (K,) u32.
struct TokenLogp;

/// `log Σ exp` of a row.
fn log_sum_exp(row: &[f32]) -> f32 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = row.iter().map(|v| (v - max).exp()).sum();
    max + sum.ln()
}

fn labels_of<'a>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [u32]> {
    let (start, end) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("labels must be contiguous".into()))?;
    Ok(&s.as_slice::<u32>()?[start..end])
}

impl CustomOp2 for TokenLogp {
    fn name(&self) -> &'static str {
        "train-token-logp"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let logits = f32s(s1, l1, "token log-probs")?;
        let labels = labels_of(s2, l2)?;
        let (k, v) = l1.shape().dims2()?;
        let mut out = vec![0f32; k];
        par_rows(&mut out, 1, |r, o| {
            let row = &logits[r * v..(r + 1) * v];
            o[0] = row[labels[r] as usize] - log_sum_exp(row);
        });
        Ok(cpu_out(out, &Shape::from(k)))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        labels: &Tensor,
        logp: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // d logp_r / d logits_r = onehot(label_r) − softmax(logits_r); the softmax comes from
        // the saved log-prob: log Z_r = logits_r[label_r] − logp_r.
        let saved = Tensor::stack(&[&logp.detach(), &g.detach()], 1)?; // (K, 2)
        let gl = logits
            .detach()
            .apply_op3_no_bwd(labels, &saved, &TokenLogpGrad)?;
        Ok((Some(gl), None))
    }
}

/// Logits (K, V), labels (K,) and rows of `[logp, g]` → the gradient of the logits.
struct TokenLogpGrad;

impl CustomOp3 for TokenLogpGrad {
    fn name(&self) -> &'static str {
        "train-token-logp-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let logits = f32s(s1, l1, "token log-probs grad")?;
        let labels = labels_of(s2, l2)?;
        let saved = f32s(s3, l3, "token log-probs grad")?;
        let (_k, v) = l1.shape().dims2()?;
        let mut out = vec![0f32; logits.len()];
        par_rows(&mut out, v, |r, o| {
            let row = &logits[r * v..(r + 1) * v];
            let (label, logp, g) = (labels[r] as usize, saved[2 * r], saved[2 * r + 1]);
            let log_z = row[label] - logp;
            for (o, x) in o.iter_mut().zip(row) {
                *o = -g * (x - log_z).exp();
            }
            o[label] += g;
        });
        Ok(cpu_out(out, l1.shape()))
    }
}

/// Differentiable log-softmax over the last dimension (detached maximum, as in
/// [`softmax_last_dim`]).
pub fn log_softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let diff = x.broadcast_sub(&max)?;
    let lse = diff.exp()?.sum_keepdim(D::Minus1)?.log()?;
    diff.broadcast_sub(&lse)
}

/// `log p(label_r | logits_r)` for logits (K, V) and labels (K,) u32 → (K,), in f32 (f64
/// for f64 logits).
/// Stores only the logits for the backward pass (not K×V soft-max intermediates).
///
/// Logits of another float type are raised to f32 first, as TRL and verl do: in bf16 a
/// log-softmax is off by up to ~0.03 nats a token, and the sum of a few hundred tokens'
/// log-probs (around −1,500) by several nats, which is larger than the DPO margins and PPO
/// ratios the loss reads.
pub fn token_logps(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    let labels = labels.to_dtype(DType::U32)?.contiguous()?;
    if !fused(&[logits]) {
        let logits = match logits.dtype() {
            DType::BF16 | DType::F16 => logits.to_dtype(DType::F32)?,
            _ => logits.clone(),
        };
        let logp = log_softmax_last_dim(&logits)?;
        return logp.gather(&labels.unsqueeze(1)?, 1)?.squeeze(1);
    }
    let (_k, v) = logits.dims2()?;
    if labels.to_vec1::<u32>()?.iter().any(|&l| l as usize >= v) {
        candle_core::bail!("a label is outside the vocabulary of {v} tokens");
    }
    logits.contiguous()?.apply_op2(&labels, TokenLogp)
}

/// Per-row entropy −Σ p·log p of logits (K, V), detached (a logged metric, no gradient):
/// one pass per row instead of the (K, V) log-softmax, exp and product tensors of the
/// composed ops, which at a 49k vocabulary and a few hundred response tokens are hundreds
/// of MB each, alive at the same time as the forward pass's activations.
pub fn token_entropy(logits: &Tensor) -> Result<Tensor> {
    let logits = logits.detach();
    if !fused(&[&logits]) {
        let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
        return (logp.exp()? * &logp)?.sum(D::Minus1)?.neg();
    }
    let (k, v) = logits.dims2()?;
    let logits = logits.contiguous()?;
    let (storage, layout) = logits.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        candle_core::bail!("token entropy: CPU storage expected");
    };
    let data = f32s(cpu, layout, "token entropy")?;
    let mut out = vec![0f32; k];
    par_rows(&mut out, 1, |r, o| {
        let row = &data[r * v..(r + 1) * v];
        // H = log Z − Σ p·x with p = exp(x − log Z).
        let log_z = log_sum_exp(row);
        let mean: f32 = row.iter().map(|x| (x - log_z).exp() * x).sum();
        o[0] = log_z - mean;
    });
    Tensor::from_vec(out, k, logits.device())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::test_util::max_diff;
    use candle_core::{Device, Var};

    #[test]
    fn row_kernels_give_the_same_bits_on_every_isa() {
        use crate::engine::simd::{assert_same_bits_on_every_isa, test_values};
        for n in [1usize, 9, 16, 300] {
            let (a, b, g) = (test_values(n, 11), test_values(n, 12), test_values(n, 13));
            for wrt_up in [false, true] {
                assert_same_bits_on_every_isa("swiglu_grad", |isa| {
                    let mut out = vec![0f32; n];
                    rows::swiglu_grad::on(isa, &mut out, &a, &b, &g, wrt_up);
                    out
                });
            }
            let bias: Vec<f32> = (0..n)
                .map(|i| if i % 3 == 2 { f32::NEG_INFINITY } else { 0.0 })
                .collect();
            assert_same_bits_on_every_isa("masked_softmax", |isa| {
                let mut p = vec![0f32; n];
                rows::masked_softmax::on(isa, &mut p, &a, &bias, 0.125);
                p
            });
        }
    }

    fn rand(shape: &[usize], seed: u64) -> Tensor {
        let n: usize = shape.iter().product();
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let v: Vec<f32> = (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    /// Values and gradients of `fast` and `slow` (same inputs, same random upstream
    /// gradient through a weighted sum) agree to `tol`.
    fn check(
        inputs: &[Tensor],
        fast: impl Fn(&[Tensor]) -> Result<Tensor>,
        slow: impl Fn(&[Tensor]) -> Result<Tensor>,
        tol: f32,
    ) {
        let vars: Vec<Var> = inputs
            .iter()
            .map(|t| Var::from_tensor(t).unwrap())
            .collect();
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let (yf, ys) = (fast(&ts).unwrap(), slow(&ts).unwrap());
        assert!(
            max_diff(&yf, &ys) < tol,
            "values differ by {}",
            max_diff(&yf, &ys)
        );
        let weights = rand(yf.dims(), 99);
        let gf = (&yf * &weights)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let gs = (&ys * &weights)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        for (i, t) in ts.iter().enumerate() {
            let (a, b) = (gf.get(t), gs.get(t));
            match (a, b) {
                (Some(a), Some(b)) => {
                    assert!(
                        max_diff(a, b) < tol,
                        "input {i}: gradients differ by {}",
                        max_diff(a, b)
                    )
                }
                (None, None) => {}
                _ => panic!("input {i}: one path has a gradient and the other none"),
            }
        }
    }

    #[test]
    fn linear_matches_matmul_and_skips_frozen_weights() {
        let (x, w) = (rand(&[2, 5, 8], 1), rand(&[6, 8], 2));
        check(
            &[x.clone(), w.clone()],
            |t| linear(&t[0], &t[1]),
            |t| t[0].broadcast_matmul(&t[1].t()?),
            1e-5,
        );
        // A frozen (plain) weight gets no gradient; the input still does.
        let xv = Var::from_tensor(&x).unwrap();
        let g = linear(xv.as_tensor(), &w)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        assert!(g.get(&w).is_none());
        assert!(g.get(xv.as_tensor()).is_some());
    }

    #[test]
    fn rms_norm_matches_the_composed_op() {
        check(
            &[rand(&[3, 4, 16], 3), rand(&[16], 4)],
            |t| rms_norm(&t[0], &t[1], 1e-5),
            |t| candle_nn::ops::rms_norm_slow(&t[0], &t[1], 1e-5),
            1e-5,
        );
    }

    #[test]
    fn masked_softmax_matches_the_composed_op() {
        let (b, h, q) = (2, 3, 5);
        // Causal mask plus one padded key in batch row 1.
        let mut bias = vec![0f32; b * q * q];
        for r in 0..b {
            for i in 0..q {
                for j in 0..q {
                    if j > i || (r == 1 && j == 0) {
                        bias[(r * q + i) * q + j] = -1e9;
                    }
                }
            }
        }
        let bias = Tensor::from_vec(bias, (b, 1, q, q), &Device::Cpu).unwrap();
        check(
            &[rand(&[b, h, q, q], 5)],
            |t| masked_softmax(&t[0], &bias, 0.125),
            |t| candle_nn::ops::softmax(&(&t[0] * 0.125)?.broadcast_add(&bias)?, D::Minus1),
            1e-5,
        );
    }

    #[test]
    fn rope_matches_rope_slow() {
        let (t, d) = (5, 8);
        let (cos, sin) = (rand(&[t, d / 2], 10), rand(&[t, d / 2], 11));
        let x = rand(&[2, 3, t, d], 9);
        check(
            std::slice::from_ref(&x),
            |x| rope(&x[0], &cos, &sin),
            |x| candle_nn::rotary_emb::rope_slow(&x[0], &cos, &sin),
            1e-5,
        );
        // Per-row tables (packed rows with their own positions): the fused kernel against
        // the composed fallback, whose shared-table case equals `rope_slow`.
        let slow = candle_nn::rotary_emb::rope_slow(&x, &cos, &sin).unwrap();
        assert!(max_diff(&rope_composed(&x, &cos, &sin).unwrap(), &slow) < 1e-6);
        let (cos, sin) = (rand(&[2, 1, t, d / 2], 12), rand(&[2, 1, t, d / 2], 13));
        check(
            &[x],
            |x| rope(&x[0], &cos, &sin),
            |x| rope_composed(&x[0], &cos, &sin),
            1e-5,
        );
    }

    #[test]
    fn lora_linear_matches_the_composed_ops() {
        let (w, bias) = (rand(&[6, 8], 20), rand(&[6], 21));
        for bias in [None, Some(&bias)] {
            check(
                &[rand(&[2, 5, 8], 22), rand(&[4, 8], 23), rand(&[6, 4], 24)],
                |t| lora_linear(&t[0], &w, bias, &t[1], &t[2]),
                |t| {
                    let base = t[0].broadcast_matmul(&w.t()?)?;
                    let base = match bias {
                        Some(b) => base.broadcast_add(b)?,
                        None => base,
                    };
                    base + t[0]
                        .broadcast_matmul(&t[1].t()?)?
                        .broadcast_matmul(&t[2].t()?)?
                },
                1e-5,
            );
        }
    }

    #[test]
    fn swiglu_matches_the_composed_op() {
        check(
            &[rand(&[2, 3, 7], 6), rand(&[2, 3, 7], 7)],
            |t| swiglu(&t[0], &t[1]),
            |t| candle_nn::ops::silu(&t[0])? * &t[1],
            1e-5,
        );
    }

    #[test]
    fn token_logps_match_log_softmax_gather() {
        let labels = Tensor::new(&[3u32, 0, 9, 4], &Device::Cpu).unwrap();
        check(
            &[(rand(&[4, 10], 8) * 4.0).unwrap()],
            |t| token_logps(&t[0], &labels),
            |t| {
                candle_nn::ops::log_softmax(&t[0], D::Minus1)?
                    .gather(&labels.unsqueeze(1)?, 1)?
                    .squeeze(1)
            },
            1e-5,
        );
        let bad = Tensor::new(&[3u32, 0, 10, 4], &Device::Cpu).unwrap();
        assert!(token_logps(&rand(&[4, 10], 8), &bad).is_err());
    }

    #[test]
    fn token_entropy_matches_the_composed_ops() {
        let logits = (rand(&[5, 300], 9) * 6.0).unwrap();
        let logp = candle_nn::ops::log_softmax(&logits, D::Minus1).unwrap();
        let want = (logp.exp().unwrap() * &logp)
            .unwrap()
            .sum(D::Minus1)
            .unwrap()
            .neg()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let got = token_entropy(&logits).unwrap().to_vec1::<f32>().unwrap();
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() < 1e-4, "{got:?} vs {want:?}");
        }
    }
}
