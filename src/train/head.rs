//! The output head fused with per-token losses, for f32 on the CPU: log-probs and
//! entropies of the target tokens, and the gradient of a loss that is a sum of per-token
//! terms, a few hundred tokens at a time.
//!
//! The composed path materializes the (tokens, vocab) logits — 200 MB for 1,024 response
//! tokens at a 49k vocabulary — then their log-softmax, and as much again in the backward
//! pass, each a fresh allocation the kernel zero-fills page by page. Here one chunk of
//! logits lives in one buffer, reused. The forward pass reduces a chunk to (log-prob,
//! entropy) per token. When the loss adds up per-token terms (PPO's does, see
//! [`super::rl::loss`]), a chunk's share of the loss and its gradient with respect to the
//! chunk's log-probs and entropies are known as soon as the chunk is, so the same buffer
//! becomes the logits' gradient, which is multiplied into the hidden states' gradient and
//! accumulated into the weight's — the logits are never computed twice (Liger-Kernel's
//! fused linear cross-entropy makes the same trade on GPUs).
//!
//! Other devices and dtypes use the composed ops ([`applies`] says which path runs); tests
//! compare the two.

use std::ops::Range;

use candle_core::{Result, Tensor, Var};

use super::ops::{cpu_f32, fused, par_rows};

/// Logit bytes per chunk: about 256 tokens at a 49k vocabulary, within the caches' reach of
/// nothing but large enough that the weight gradient's rank-`chunk` updates stay few.
const CHUNK_BYTES: usize = 48 << 20;

fn chunk_rows(vocab: usize) -> usize {
    (CHUNK_BYTES / (4 * vocab.max(1))).clamp(8, 1024)
}

/// Whether the fused head runs for these operands (f32 on the CPU, not forced off).
pub fn applies(hidden: &Tensor, weight: &Tensor) -> bool {
    fused(&[hidden, weight])
}

/// Gradients of a loss with respect to the head's inputs.
#[derive(Debug)]
pub struct HeadGrads {
    /// (K, H): with respect to the hidden states that fed the head.
    pub hidden: Tensor,
    /// (V, H): with respect to the head weight, when asked for.
    pub weight: Option<Tensor>,
}

/// The operands as slices, checked once.
struct Head<'a> {
    x: &'a [f32],
    w: &'a [f32],
    labels: &'a [u32],
    tokens: usize,
    hidden: usize,
    vocab: usize,
}

fn with_head<R>(
    hidden: &Tensor,
    weight: &Tensor,
    labels: &[u32],
    f: impl FnOnce(&Head) -> Result<R>,
) -> Result<R> {
    let (hidden, weight) = (hidden.contiguous()?, weight.contiguous()?);
    let (k, h) = hidden.dims2()?;
    let (v, h2) = weight.dims2()?;
    if h != h2 {
        candle_core::bail!("output head: hidden states have {h} features, the weight {h2}");
    }
    if labels.len() != k {
        candle_core::bail!("output head: {k} hidden states but {} labels", labels.len());
    }
    if let Some(l) = labels.iter().find(|&&l| l as usize >= v) {
        candle_core::bail!("label {l} is outside the vocabulary of {v} tokens");
    }
    let (xs, xl) = hidden.storage_and_layout();
    let (ws, wl) = weight.storage_and_layout();
    f(&Head {
        x: cpu_f32(&xs, xl, "output head input")?,
        w: cpu_f32(&ws, wl, "output head weight")?,
        labels,
        tokens: k,
        hidden: h,
        vocab: v,
    })
}

/// Per-token log-probs of `labels` and entropies of the predicted distributions under
/// `hidden (K, H) · weightᵀ`, without gradient.
pub fn token_logps_entropies(
    hidden: &Tensor,
    weight: &Tensor,
    labels: &[u32],
) -> Result<(Vec<f32>, Vec<f32>)> {
    with_head(hidden, weight, labels, |head| {
        let mut logp = Vec::with_capacity(head.tokens);
        let mut entropy = Vec::with_capacity(head.tokens);
        head.for_each_chunk(chunk_rows(head.vocab), |_, _, stats| {
            logp.extend(stats.iter().map(|s| s.logp));
            entropy.extend(stats.iter().map(|s| s.entropy));
            Ok(())
        })?;
        Ok((logp, entropy))
    })
}

/// Gradients of `Σ_chunks loss(chunk)` through the head. `chunk_loss(tokens, logp,
/// entropy)` gets a chunk's token range and its (n,) log-probs and entropies as variables
/// and returns that chunk's scalar loss (any differentiable function of them and of
/// constants) plus whatever it wants back; the loss of the whole batch must be the sum of
/// the chunks' losses. The weight's gradient is computed only with `weight_grad`.
pub fn token_loss_grads<T>(
    hidden: &Tensor,
    weight: &Tensor,
    labels: &[u32],
    weight_grad: bool,
    chunk_loss: impl FnMut(Range<usize>, &Tensor, &Tensor) -> Result<(Tensor, T)>,
) -> Result<(HeadGrads, Vec<T>)> {
    token_loss_grads_in(
        hidden,
        weight,
        labels,
        weight_grad,
        chunk_rows(weight.dim(0)?),
        chunk_loss,
    )
}

fn token_loss_grads_in<T>(
    hidden: &Tensor,
    weight: &Tensor,
    labels: &[u32],
    weight_grad: bool,
    rows: usize,
    mut chunk_loss: impl FnMut(Range<usize>, &Tensor, &Tensor) -> Result<(Tensor, T)>,
) -> Result<(HeadGrads, Vec<T>)> {
    let device = hidden.device().clone();
    let (k, h) = hidden.dims2()?;
    let v = weight.dim(0)?;
    let mut dx = vec![0f32; k * h];
    let mut dw = weight_grad.then(|| vec![0f32; v * h]);
    let mut extras = Vec::new();
    with_head(hidden, weight, labels, |head| {
        head.for_each_chunk(rows, |range, logits, stats| {
            let n = range.len();
            let logp = Var::from_vec(stats.iter().map(|s| s.logp).collect(), n, &device)?;
            let entropy = Var::from_vec(stats.iter().map(|s| s.entropy).collect(), n, &device)?;
            let (loss, extra) = chunk_loss(range.clone(), logp.as_tensor(), entropy.as_tensor())?;
            extras.push(extra);
            let grads = loss.backward()?;
            let grad_of = |var: &Var| -> Result<Vec<f32>> {
                match grads.get(var.as_tensor()) {
                    Some(g) => g.to_vec1::<f32>(),
                    None => Ok(vec![0.0; n]),
                }
            };
            let (g_logp, g_entropy) = (grad_of(&logp)?, grad_of(&entropy)?);
            logits_to_grads(
                logits,
                stats,
                &head.labels[range.clone()],
                &g_logp,
                &g_entropy,
            );
            let x = &head.x[range.start * h..range.end * h];
            // dX = dZ · W; dW += dZᵀ · X.
            matmul(
                &mut dx[range.start * h..range.end * h],
                (n, h, v),
                false,
                Mat::rows(logits, v),
                Mat::rows(head.w, h),
            );
            if let Some(dw) = dw.as_mut() {
                matmul(
                    dw,
                    (v, h, n),
                    range.start > 0,
                    Mat::cols(logits, v),
                    Mat::rows(x, h),
                );
            }
            Ok(())
        })
    })?;
    let grads = HeadGrads {
        hidden: Tensor::from_vec(dx, (k, h), &device)?,
        weight: dw
            .map(|g| Tensor::from_vec(g, (v, h), &device))
            .transpose()?,
    };
    Ok((grads, extras))
}

/// A row's softmax statistics.
#[derive(Clone, Copy, Debug, Default)]
struct RowStats {
    /// log Σ exp(logits).
    lse: f32,
    /// Log-prob of the label.
    logp: f32,
    /// −Σ p·log p.
    entropy: f32,
}

impl Head<'_> {
    /// Runs `f(tokens, logits, stats)` for each chunk of at most `rows` tokens, with the
    /// chunk's (n, V) logits in a buffer reused across chunks.
    fn for_each_chunk(
        &self,
        rows: usize,
        mut f: impl FnMut(Range<usize>, &mut [f32], &[RowStats]) -> Result<()>,
    ) -> Result<()> {
        let (h, v) = (self.hidden, self.vocab);
        let rows = rows.clamp(1, self.tokens.max(1));
        let mut buf = vec![0f32; rows * v];
        let mut start = 0;
        while start < self.tokens {
            let end = (start + rows).min(self.tokens);
            let n = end - start;
            let logits = &mut buf[..n * v];
            // Z = X · Wᵀ.
            matmul(
                logits,
                (n, v, h),
                false,
                Mat::rows(&self.x[start * h..end * h], h),
                Mat::cols(self.w, h),
            );
            let stats = row_stats(logits, &self.labels[start..end], v);
            f(start..end, logits, &stats)?;
            start = end;
        }
        Ok(())
    }
}

fn row_stats(logits: &[f32], labels: &[u32], v: usize) -> Vec<RowStats> {
    let mut out = vec![0f32; labels.len() * 3];
    par_rows(&mut out, 3, |r, o| {
        let row = &logits[r * v..(r + 1) * v];
        let (max, sum, weighted) = kernels::softmax_sums(row);
        let lse = max + sum.ln();
        // H = log Z − Σ p·z = ln s − Σ p·(z − max), with the maximum shifted out so that
        // two numbers the size of the logits never cancel.
        o.copy_from_slice(&[
            lse,
            row[labels[r] as usize] - lse,
            sum.ln() - weighted / sum,
        ]);
    });
    out.chunks_exact(3)
        .map(|s| RowStats {
            lse: s[0],
            logp: s[1],
            entropy: s[2],
        })
        .collect()
}

/// Overwrites each row of logits z with dL/dz for dL/dlogp = g and dL/dH = e:
/// dz_j = g·(δ_j,label − p_j) − e·p_j·(log p_j + H) = −p_j·(c + e·d_j) + g·δ_j,label
/// with d_j = z_j − lse = log p_j and c = g + e·H.
fn logits_to_grads(logits: &mut [f32], stats: &[RowStats], labels: &[u32], g: &[f32], e: &[f32]) {
    let v = logits.len() / stats.len().max(1);
    par_rows(logits, v, |r, row| {
        let s = stats[r];
        let c = g[r] + e[r] * s.entropy;
        kernels::softmax_grad(row, s.lse, c, e[r]);
        row[labels[r] as usize] += g[r];
    });
}

/// A row-major view of a matrix: `stride` elements between consecutive rows (`rows`) or
/// between consecutive columns (`cols`, the transpose of a row-major matrix).
#[derive(Clone, Copy)]
struct Mat<'a> {
    data: &'a [f32],
    row_stride: usize,
    col_stride: usize,
}

impl<'a> Mat<'a> {
    /// Row-major with rows of `width`.
    fn rows(data: &'a [f32], width: usize) -> Self {
        Self {
            data,
            row_stride: width,
            col_stride: 1,
        }
    }

    /// The transpose of a row-major matrix with rows of `width`.
    fn cols(data: &'a [f32], width: usize) -> Self {
        Self {
            data,
            row_stride: 1,
            col_stride: width,
        }
    }

    fn fits(&self, rows: usize, cols: usize) -> bool {
        rows == 0
            || cols == 0
            || (rows - 1) * self.row_stride + (cols - 1) * self.col_stride < self.data.len()
    }
}

/// `dst (m, n) [+]= lhs (m, k) · rhs (k, n)` on gemm (the library candle's own f32 matmul
/// calls), with `dst` row-major; `accumulate` adds to `dst` instead of overwriting it.
fn matmul(dst: &mut [f32], (m, n, k): (usize, usize, usize), accumulate: bool, lhs: Mat, rhs: Mat) {
    assert!(
        dst.len() >= m * n && lhs.fits(m, k) && rhs.fits(k, n),
        "matmul operands out of bounds"
    );
    let threads = candle_core::utils::get_num_threads();
    let parallelism = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the assertion above keeps every element gemm reads or writes (row r, column c
    // at r·row_stride + c·col_stride) inside its slice, and `dst` is borrowed mutably, so
    // it aliases neither operand.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            lhs.data.as_ptr(),
            lhs.col_stride as isize,
            lhs.row_stride as isize,
            rhs.data.as_ptr(),
            rhs.col_stride as isize,
            rhs.row_stride as isize,
            if accumulate { 1.0 } else { 0.0 },
            1.0,
            false,
            false,
            false,
            parallelism,
        )
    }
}

/// Row kernels over the vocabulary ([`crate::engine::simd`]): the exponential is the cost of
/// the softmax, and the standard library's (a call per element) would take longer than the
/// head's matmul.
mod kernels {
    use crate::engine::simd::{dispatch, exp};

    const LANES: usize = 16;

    /// (max z, Σ e^(z − max), Σ e^(z − max)·(z − max)) of a row.
    #[inline(always)]
    fn softmax_sums_any(row: &[f32]) -> (f32, f32, f32) {
        let chunks = row.chunks_exact(LANES);
        let tail = chunks.remainder();
        let mut lanes = [f32::NEG_INFINITY; LANES];
        for c in chunks.clone() {
            for (m, &z) in lanes.iter_mut().zip(c) {
                *m = m.max(z);
            }
        }
        let max = lanes
            .iter()
            .chain(tail)
            .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let (mut sum, mut weighted) = ([0f32; LANES], [0f32; LANES]);
        for c in chunks {
            for ((s, w), &z) in sum.iter_mut().zip(weighted.iter_mut()).zip(c) {
                let d = z - max;
                let e = exp(d);
                *s += e;
                *w += e * d;
            }
        }
        let (mut s, mut w) = (sum.iter().sum::<f32>(), weighted.iter().sum::<f32>());
        for &z in tail {
            let d = z - max;
            let e = exp(d);
            s += e;
            w += e * d;
        }
        (max, s, w)
    }

    /// z_j ← −e^d·(c + e·d) with d = z_j − lse.
    #[inline(always)]
    fn softmax_grad_any(row: &mut [f32], lse: f32, c: f32, e: f32) {
        for z in row.iter_mut() {
            let d = *z - lse;
            *z = -exp(d) * (c + e * d);
        }
    }

    dispatch!(pub(super) softmax_sums, softmax_sums_any, (row: &[f32]) -> (f32, f32, f32));
    dispatch!(pub(super) softmax_grad, softmax_grad_any, (row: &mut [f32], lse: f32, c: f32, e: f32) -> ());
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, D};

    #[test]
    fn row_kernels_give_the_same_bits_on_every_isa() {
        use crate::engine::simd::{assert_same_bits_on_every_isa, test_values};
        for n in [1usize, 9, 16, 1000] {
            let row = test_values(n, 14);
            assert_same_bits_on_every_isa("softmax_sums", |isa| {
                let (a, b, c) = kernels::softmax_sums::on(isa, &row);
                vec![a, b, c]
            });
            let (lse, _, _) = kernels::softmax_sums(&row);
            assert_same_bits_on_every_isa("softmax_grad", |isa| {
                let mut r = row.clone();
                kernels::softmax_grad::on(isa, &mut r, lse, 0.5, 0.25);
                r
            });
        }
    }

    fn rand(shape: (usize, usize), seed: u64, scale: f32) -> Tensor {
        let n = shape.0 * shape.1;
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let v: Vec<f32> = (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn labels(k: usize, v: usize) -> Vec<u32> {
        (0..k).map(|i| ((i * 7919 + 3) % v) as u32).collect()
    }

    fn max_rel_diff(a: &Tensor, b: &Tensor) -> f32 {
        let (a, b) = (a.flatten_all().unwrap(), b.flatten_all().unwrap());
        let scale = b.abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
        let d = (a - b).unwrap().abs().unwrap().max(0).unwrap();
        d.to_scalar::<f32>().unwrap() / scale.max(1e-12)
    }

    /// The composed ops' log-probs and entropies of (K, V) logits.
    fn composed(x: &Tensor, w: &Tensor, labels: &[u32]) -> (Tensor, Tensor) {
        let logits = x.matmul(&w.t().unwrap()).unwrap();
        let logp = candle_nn::ops::log_softmax(&logits, D::Minus1).unwrap();
        let entropy = crate::train::rl::loss::entropy_of_logits(&logits).unwrap();
        let idx = Tensor::new(labels, &Device::Cpu)
            .unwrap()
            .unsqueeze(1)
            .unwrap();
        let picked = logp.gather(&idx, 1).unwrap().squeeze(1).unwrap();
        (picked, entropy)
    }

    #[test]
    fn log_probs_and_entropies_match_the_composed_ops() {
        let (k, h, v) = (37, 24, 301);
        let (x, w) = (rand((k, h), 1, 2.0), rand((v, h), 2, 1.0));
        let labels = labels(k, v);
        let (logp, entropy) = token_logps_entropies(&x, &w, &labels).unwrap();
        let (want_logp, want_entropy) = composed(&x, &w, &labels);
        let t = |v: Vec<f32>| Tensor::new(v, &Device::Cpu).unwrap();
        assert!(max_rel_diff(&t(logp), &want_logp) < 1e-5);
        assert!(max_rel_diff(&t(entropy), &want_entropy) < 1e-5);
    }

    /// A nonlinear per-token loss of log-probs and entropies with per-token constants,
    /// through several chunks (one ragged), against autograd through the composed ops.
    #[test]
    fn gradients_match_autograd_through_the_composed_ops() {
        let (k, h, v) = (29, 16, 203);
        let (x, w) = (rand((k, h), 3, 2.0), rand((v, h), 4, 1.0));
        let labels = labels(k, v);
        let adv = rand((k, 1), 5, 1.0).squeeze(1).unwrap();
        let loss_of = |logp: &Tensor, entropy: &Tensor, adv: &Tensor| -> Tensor {
            let pg = (logp.exp().unwrap() * adv).unwrap().sum_all().unwrap();
            let ent = (entropy.sqr().unwrap() * 0.3).unwrap().sum_all().unwrap();
            (pg - ent).unwrap()
        };
        let (xv, wv) = (Var::from_tensor(&x).unwrap(), Var::from_tensor(&w).unwrap());
        let (logp, entropy) = composed(xv.as_tensor(), wv.as_tensor(), &labels);
        let want_loss = loss_of(&logp, &entropy, &adv);
        let want = want_loss.backward().unwrap();
        let (grads, losses) = token_loss_grads_in(&x, &w, &labels, true, 8, |r, lp, ent| {
            let loss = loss_of(lp, ent, &adv.narrow(0, r.start, r.len()).unwrap());
            let value = loss.to_scalar::<f32>().unwrap();
            Ok((loss, value))
        })
        .unwrap();
        assert_eq!(losses.len(), 4);
        let total: f32 = losses.iter().sum();
        let want_total = want_loss.to_scalar::<f32>().unwrap();
        assert!((total - want_total).abs() < 1e-4 * want_total.abs().max(1.0));
        let dx = want.get(xv.as_tensor()).unwrap();
        let dw = want.get(wv.as_tensor()).unwrap();
        assert!(max_rel_diff(&grads.hidden, dx) < 1e-4, "hidden");
        assert!(
            max_rel_diff(grads.weight.as_ref().unwrap(), dw) < 1e-4,
            "weight"
        );

        let (frozen, _) = token_loss_grads_in(&x, &w, &labels, false, 8, |r, lp, ent| {
            Ok((loss_of(lp, ent, &adv.narrow(0, r.start, r.len())?), ()))
        })
        .unwrap();
        assert!(frozen.weight.is_none());
        assert!(max_rel_diff(&frozen.hidden, dx) < 1e-4);
    }

    /// Large, sharply peaked logits: the entropy is computed with the maximum shifted out,
    /// so it stays non-negative and close to the f64 value instead of losing ~1e-5 to the
    /// cancellation of two numbers the size of the logits.
    #[test]
    fn entropies_of_peaked_rows_keep_their_precision() {
        let (k, h, v) = (4, 8, 500);
        let x = (rand((k, h), 7, 1.0) * 40.0).unwrap();
        let w = rand((v, h), 8, 1.0);
        let labels = labels(k, v);
        let (_, entropy) = token_logps_entropies(&x, &w, &labels).unwrap();
        let logits = x.matmul(&w.t().unwrap()).unwrap().to_vec2::<f32>().unwrap();
        for (row, &got) in logits.iter().zip(&entropy) {
            let max = row.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
            let z: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
            let want: f64 = row
                .iter()
                .map(|&x| {
                    let lp = x as f64 - max - z.ln();
                    -lp.exp() * lp
                })
                .sum();
            assert!(got >= 0.0, "{got}");
            assert!(
                (got as f64 - want).abs() < 1e-6 + 1e-5 * want,
                "{got} vs {want}"
            );
        }
    }

    #[test]
    fn a_label_outside_the_vocabulary_is_an_error() {
        let (x, w) = (rand((2, 4), 1, 1.0), rand((5, 4), 2, 1.0));
        let err = token_logps_entropies(&x, &w, &[1, 5]).unwrap_err();
        assert!(err.to_string().contains("label 5"), "{err}");
    }
}
