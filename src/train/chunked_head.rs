//! The output head and per-token log-probs a chunk of tokens at a time, on any device and
//! float type (what CUDA and bf16 run; the CPU in f32 has the fused kernels of
//! [`super::head`]).
//!
//! Composed ops hold the (tokens, vocab) logits, their f32 copy and log-softmax for the
//! backward pass: at a 128k vocabulary, 4,096 loss tokens keep 8 GiB alive through the
//! whole backward pass. Here the forward pass keeps only each token's log-prob; the backward
//! pass recomputes one chunk's logits at a time and turns them into the gradients of the
//! hidden states and the head weight (`(onehot − softmax) · g`), so the vocabulary costs one
//! chunk's logits, for one extra head product (Liger-Kernel's fused linear cross-entropy makes
//! the same trade).

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, D};

/// f32 logit bytes of one chunk.
const CHUNK_BYTES: usize = 256 << 20;

/// Rows of a chunk for a vocabulary of `vocab`.
pub fn chunk_rows(vocab: usize) -> usize {
    (CHUNK_BYTES / (4 * vocab.max(1))).clamp(16, 8192)
}

/// Per-token log-probs (K,) in f32 (f64 for f64 weights) of `labels` (K,) under `hidden (K, H) · weightᵀ` for a
/// head `weight (V, H)`; differentiable with respect to `hidden` and, when it is trainable,
/// `weight`.
pub fn token_logps(hidden: &Tensor, weight: &Tensor, labels: &Tensor) -> Result<Tensor> {
    token_logps_in(hidden, weight, labels, chunk_rows(weight.dim(0)?))
}

/// [`token_logps`] with `rows` tokens a chunk.
pub fn token_logps_in(
    hidden: &Tensor,
    weight: &Tensor,
    labels: &Tensor,
    rows: usize,
) -> Result<Tensor> {
    Ok(with_gradient(hidden, weight, labels, rows, false)?.0)
}

/// [`token_logps`] and TRL's per-token diagnostics of the same logits (mean logit, entropy,
/// whether the label is the most likely token), computed on the device chunk by chunk.
pub fn token_logps_stats(
    hidden: &Tensor,
    weight: &Tensor,
    labels: &Tensor,
) -> Result<(Tensor, Vec<[f64; 3]>)> {
    with_gradient(hidden, weight, labels, chunk_rows(weight.dim(0)?), true)
}

/// The forward pass, then the op that carries its result and owns its backward pass.
fn with_gradient(
    hidden: &Tensor,
    weight: &Tensor,
    labels: &Tensor,
    rows: usize,
    stats: bool,
) -> Result<(Tensor, Vec<[f64; 3]>)> {
    let (logp, diag) = forward(hidden, weight, labels, rows, stats)?;
    let op = ChunkedHead {
        logp,
        labels: labels.to_dtype(DType::U32)?.contiguous()?,
        rows,
    };
    Ok((hidden.apply_op2(weight, op)?, diag))
}

/// The type log-probs are computed in: f32, or f64 for f64 weights.
fn loss_dtype(t: &Tensor) -> DType {
    match t.dtype() {
        DType::F64 => DType::F64,
        _ => DType::F32,
    }
}

/// The logits of tokens `start..start + n`, in [`loss_dtype`].
fn chunk_logits(x: &Tensor, w: &Tensor, start: usize, n: usize) -> Result<Tensor> {
    x.narrow(0, start, n)?
        .matmul(&w.t()?)?
        .to_dtype(loss_dtype(w))
}

/// The log-probs (detached, contiguous, their own storage) and, with `stats`, the
/// diagnostics.
fn forward(
    hidden: &Tensor,
    weight: &Tensor,
    labels: &Tensor,
    rows: usize,
    stats: bool,
) -> Result<(Tensor, Vec<[f64; 3]>)> {
    let (x, w) = (hidden.detach(), weight.detach());
    let (k, _) = x.dims2()?;
    let labels = labels.to_dtype(DType::U32)?.contiguous()?;
    if labels.dims1()? != k {
        candle_core::bail!(
            "output head: {k} hidden states but {} labels",
            labels.dims1()?
        );
    }
    let vocab = w.dim(0)? as u32;
    if labels.max(0)?.to_scalar::<u32>()? >= vocab {
        candle_core::bail!("a label is outside the vocabulary of {vocab} tokens");
    }
    let mut parts = Vec::with_capacity(k.div_ceil(rows.max(1)));
    let mut diag = Vec::new();
    for start in (0..k).step_by(rows.max(1)) {
        let n = rows.min(k - start);
        let z = chunk_logits(&x, &w, start, n)?;
        let max = z.max_keepdim(D::Minus1)?;
        let shifted = z.broadcast_sub(&max)?;
        let sum = shifted.exp()?.sum_keepdim(D::Minus1)?;
        let lse = (sum.log()? + &max)?;
        let label = labels.narrow(0, start, n)?.unsqueeze(1)?;
        parts.push((z.gather(&label, 1)? - &lse)?.squeeze(1)?);
        if stats {
            // H = log Z − Σ p·z.
            let p = z.broadcast_sub(&lse)?.exp()?;
            let entropy = (lse.squeeze(1)? - (p * &z)?.sum(D::Minus1)?)?;
            let mean = z.mean(D::Minus1)?;
            let correct = z
                .argmax(D::Minus1)?
                .eq(&label.squeeze(1)?)?
                .to_dtype(z.dtype())?;
            let cols = Tensor::stack(&[mean, entropy, correct], 1)?
                .to_dtype(DType::F64)?
                .to_vec2::<f64>()?;
            diag.extend(cols.into_iter().map(|c| [c[0], c[1], c[2]]));
        }
    }
    // `cat` makes storage of its own, which the op's forward hands out as its result.
    let logp = Tensor::cat(&parts, 0)?.contiguous()?;
    Ok((logp, diag))
}

/// The op: its forward returns the log-probs computed beforehand; its backward recomputes
/// the logits chunk by chunk.
struct ChunkedHead {
    logp: Tensor,
    labels: Tensor,
    rows: usize,
}

impl CustomOp2 for ChunkedHead {
    fn name(&self) -> &'static str {
        "train-chunked-head"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        super::ops::precomputed_cpu(&self.logp)
    }

    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::ops::precomputed_cuda(&self.logp)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _logp: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (xd, wd) = (x.detach(), w.detach());
        let g = g.detach().to_dtype(loss_dtype(&wd))?;
        let k = xd.dim(0)?;
        let (mut gx, mut gw) = (Vec::new(), None::<Tensor>);
        for start in (0..k).step_by(self.rows.max(1)) {
            let n = self.rows.min(k - start);
            let z = chunk_logits(&xd, &wd, start, n)?;
            let p = candle_nn::ops::softmax_last_dim(&z)?;
            let gc = g.narrow(0, start, n)?.unsqueeze(1)?;
            // d logp / d z = onehot(label) − p, times the upstream gradient.
            let dz = p
                .broadcast_mul(&gc.neg()?)?
                .scatter_add(&self.labels.narrow(0, start, n)?.unsqueeze(1)?, &gc, 1)?
                .to_dtype(wd.dtype())?;
            if x.track_op() {
                gx.push(dz.matmul(&wd)?);
            }
            if w.track_op() {
                let part = dz.t()?.matmul(&xd.narrow(0, start, n)?)?;
                gw = Some(match gw {
                    None => part,
                    Some(acc) => (acc + part)?,
                });
            }
        }
        let gx = if x.track_op() {
            Some(Tensor::cat(&gx, 0)?)
        } else {
            None
        };
        Ok((gx, gw))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::test_util::max_diff;
    use candle_core::{Device, Var};

    /// Values and gradients against the composed ops (full logits, log-softmax, gather),
    /// in chunks of 3 tokens so that chunk edges are crossed, the weight trainable or not.
    #[test]
    fn chunks_give_the_composed_values_and_gradients() {
        let dev = Device::Cpu;
        let (k, h, v) = (8, 6, 11);
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (k, h), &dev).unwrap()).unwrap();
        let w = Var::from_tensor(&Tensor::randn(0f32, 1.0, (v, h), &dev).unwrap()).unwrap();
        let labels = Tensor::new(&[0u32, 10, 3, 3, 7, 1, 9, 5], &dev).unwrap();
        let up = Tensor::randn(0f32, 1.0, k, &dev).unwrap();
        let composed = {
            let logp = super::super::ops::log_softmax_last_dim(
                &x.as_tensor().matmul(&w.as_tensor().t().unwrap()).unwrap(),
            )
            .unwrap();
            logp.gather(&labels.unsqueeze(1).unwrap(), 1)
                .unwrap()
                .squeeze(1)
                .unwrap()
        };
        let chunked = token_logps_in(x.as_tensor(), w.as_tensor(), &labels, 3).unwrap();
        assert!(max_diff(&composed, &chunked) < 1e-5);
        let ga = (&composed * &up)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let gb = (&chunked * &up)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        for var in [&x, &w] {
            let (a, b) = (
                ga.get(var.as_tensor()).unwrap(),
                gb.get(var.as_tensor()).unwrap(),
            );
            assert!(max_diff(a, b) < 1e-5, "{a} {b}");
        }
        // A frozen head: the hidden states' gradient only.
        let frozen = w.as_tensor().detach();
        let out = token_logps_in(x.as_tensor(), &frozen, &labels, 3).unwrap();
        let g = (&out * &up).unwrap().sum_all().unwrap().backward().unwrap();
        assert!(
            max_diff(
                g.get(x.as_tensor()).unwrap(),
                ga.get(x.as_tensor()).unwrap()
            ) < 1e-5
        );
        assert!(g.get(&frozen).is_none());
    }

    #[test]
    fn diagnostics_and_bad_labels() {
        let dev = Device::Cpu;
        let x = Tensor::new(&[[1f32, 0.0], [0.0, 1.0], [1.0, 1.0]], &dev).unwrap();
        let w = Tensor::new(&[[2f32, 0.0], [0.0, 1.0], [0.0, 0.0]], &dev).unwrap();
        let labels = Tensor::new(&[0u32, 0, 2], &dev).unwrap();
        let (logp, stats) = token_logps_stats(&x, &w, &labels).unwrap();
        let lp = logp.to_vec1::<f32>().unwrap();
        // Row 0: logits (2, 0, 0).
        let z0 = (2f64.exp() + 2.0).ln();
        assert!((lp[0] as f64 - (2.0 - z0)).abs() < 1e-5);
        assert!((stats[0][0] - 2.0 / 3.0).abs() < 1e-6);
        let p: Vec<f64> = [2f64, 0.0, 0.0].iter().map(|z| (z - z0).exp()).collect();
        let h: f64 = -p.iter().map(|p| p * p.ln()).sum::<f64>();
        assert!((stats[0][1] - h).abs() < 1e-5);
        assert_eq!([stats[0][2], stats[1][2], stats[2][2]], [1.0, 0.0, 0.0]);
        let bad = Tensor::new(&[0u32, 3, 1], &dev).unwrap();
        assert!(token_logps(&x, &w, &bad).is_err());
    }
}
