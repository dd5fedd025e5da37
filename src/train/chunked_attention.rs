//! Attention a chunk of queries at a time, with its own backward pass, on any device and
//! float type (what CUDA and bf16 run; the CPU in f32 keeps its fused softmax kernel).
//!
//! Composed ops keep, for every layer, the scores, their scaled and masked copies and the
//! probabilities — four tensors of heads × queries × keys — until the backward pass reaches
//! the layer: at 32 heads and 1,024-token rows that is 256 MiB a row and layer in bf16, more
//! than the rest of the layer's activations. Here the forward pass keeps only the output and
//! one log-sum-exp per query and head; the backward pass recomputes each chunk's
//! probabilities from them (FlashAttention's algorithm, written with the backend's matrix
//! products): one extra `q·kᵀ` a layer, and the heads × queries × keys tensors of one chunk
//! alive at a time. Softmax statistics are computed in f32 (f64 for f64 inputs).

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, D};

/// f32 score bytes of one chunk (all rows and heads of a chunk of queries).
const CHUNK_BYTES: usize = 256 << 20;

/// `softmax(scale · q·kᵀ + bias) · v` for `q` (b, heads, s, d), `k` and `v` (b, kv_heads, n,
/// d) and a constant `bias` (b or 1, 1, s, n); query head `j` reads key/value head
/// `j / (heads / kv_heads)` (HF's `repeat_kv`). Returns (b, heads, s, d).
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, bias: &Tensor, scale: f64) -> Result<Tensor> {
    let (b, h, s, _) = q.dims4()?;
    let n = k.dim(2)?;
    let rows = (CHUNK_BYTES / (4 * b * h * n).max(1)).clamp(16, s.max(16));
    attention_in(q, k, v, bias, scale, rows)
}

/// [`attention`] with `rows` queries a chunk.
pub fn attention_in(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    bias: &Tensor,
    scale: f64,
    rows: usize,
) -> Result<Tensor> {
    let shape = Dims::of(q, k, v, bias)?;
    let bias = bias.detach().to_dtype(stats_dtype(q))?;
    let (q5, kd, vd) = (shape.grouped(&q.detach())?, k.detach(), v.detach());
    let mut outs = Vec::new();
    let mut lses = Vec::new();
    for (start, c) in chunks(shape.s, rows) {
        let p_lse = probabilities(&shape, &q5, &kd, &bias, scale, start, c, None)?;
        let (p, lse) = p_lse;
        outs.push(shape.times_values(&p, &vd, c)?);
        lses.push(lse);
    }
    // (b, kvh, g, s, d) → (b, heads, s, d); `cat` gives the result storage of its own.
    let out = Tensor::cat(&outs, 3)?
        .reshape((shape.b, shape.h, shape.s, shape.d))?
        .contiguous()?;
    let lse = Tensor::cat(&lses, 3)?;
    q.apply_op3(
        k,
        v,
        ChunkedAttention {
            out,
            lse,
            bias,
            scale,
            rows,
        },
    )
}

/// The sizes of one call.
#[derive(Clone, Copy)]
struct Dims {
    b: usize,
    h: usize,
    kvh: usize,
    s: usize,
    n: usize,
    d: usize,
}

impl Dims {
    fn of(q: &Tensor, k: &Tensor, v: &Tensor, bias: &Tensor) -> Result<Self> {
        let (b, h, s, d) = q.dims4()?;
        let (bk, kvh, n, dk) = k.dims4()?;
        if bk != b || dk != d || v.dims() != k.dims() || kvh == 0 || h % kvh != 0 {
            candle_core::bail!(
                "attention: queries {:?}, keys {:?}, values {:?}",
                q.dims(),
                k.dims(),
                v.dims()
            );
        }
        let (bb, one, bs, bn) = bias.dims4()?;
        if (bb != b && bb != 1) || one != 1 || bs != s || bn != n {
            candle_core::bail!(
                "attention bias {:?} for {b} rows of {s} queries and {n} keys",
                bias.dims()
            );
        }
        Ok(Self { b, h, kvh, s, n, d })
    }

    fn g(&self) -> usize {
        self.h / self.kvh
    }

    /// (b, heads, s, d) → (b, kv_heads, groups, s, d).
    fn grouped(&self, t: &Tensor) -> Result<Tensor> {
        t.reshape((self.b, self.kvh, self.g(), self.s, self.d))
    }

    /// Queries `start..start + c` of grouped `t`, as (b, kv_heads, groups·c, d).
    fn chunk(&self, t: &Tensor, start: usize, c: usize) -> Result<Tensor> {
        t.narrow(3, start, c)?
            .contiguous()?
            .reshape((self.b, self.kvh, self.g() * c, self.d))
    }

    /// Probabilities (b, kv_heads, groups·c, n) in `v`'s type times `v` → (b, kv_heads,
    /// groups, c, d).
    fn times_values(&self, p: &Tensor, v: &Tensor, c: usize) -> Result<Tensor> {
        p.to_dtype(v.dtype())?
            .matmul(v)?
            .reshape((self.b, self.kvh, self.g(), c, self.d))
    }
}

/// The type of the softmax statistics: f32, or f64 for f64 inputs.
fn stats_dtype(t: &Tensor) -> DType {
    match t.dtype() {
        DType::F64 => DType::F64,
        _ => DType::F32,
    }
}

/// `(start, len)` of the chunks of `s` queries.
fn chunks(s: usize, rows: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..s)
        .step_by(rows.max(1))
        .map(move |start| (start, rows.max(1).min(s - start)))
}

/// A chunk's probabilities in the bias's type (b, kv_heads, groups·c, n), and its log-sum-exp
/// (b, kv_heads, groups, c, 1) — or, given the log-sum-exp, the probabilities from it.
#[allow(clippy::too_many_arguments)]
fn probabilities(
    shape: &Dims,
    q5: &Tensor,
    k: &Tensor,
    bias: &Tensor,
    scale: f64,
    start: usize,
    c: usize,
    lse: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let qc = shape.chunk(q5, start, c)?;
    let scores = qc.matmul(&k.t()?)?.to_dtype(bias.dtype())?.reshape((
        shape.b,
        shape.kvh,
        shape.g(),
        c,
        shape.n,
    ))?;
    let bias = bias.narrow(2, start, c)?.unsqueeze(1)?; // (b|1, 1, 1, c, n)
    let z = (scores * scale)?.broadcast_add(&bias)?;
    let lse = match lse {
        Some(l) => l.narrow(3, start, c)?,
        None => {
            let max = z.max_keepdim(D::Minus1)?;
            (z.broadcast_sub(&max)?
                .exp()?
                .sum_keepdim(D::Minus1)?
                .log()?
                + max)?
        }
    };
    let p = z
        .broadcast_sub(&lse)?
        .exp()?
        .reshape((shape.b, shape.kvh, shape.g() * c, shape.n))?;
    Ok((p, lse))
}

/// The op: its forward returns the output computed beforehand; its backward recomputes the
/// probabilities chunk by chunk from the saved log-sum-exp.
struct ChunkedAttention {
    out: Tensor,
    /// (b, kv_heads, groups, s, 1), in the statistics' type.
    lse: Tensor,
    bias: Tensor,
    scale: f64,
    rows: usize,
}

impl CustomOp3 for ChunkedAttention {
    fn name(&self) -> &'static str {
        "train-chunked-attention"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        super::ops::precomputed_cpu(&self.out)
    }

    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::ops::precomputed_cuda(&self.out)
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _out: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let shape = Dims::of(q, k, v, &self.bias)?;
        let (q5, kd, vd) = (shape.grouped(&q.detach())?, k.detach(), v.detach());
        let g5 = shape.grouped(&g.detach())?;
        let o5 = shape.grouped(&self.out)?;
        let (mut dq, mut dk, mut dv) = (Vec::new(), None::<Tensor>, None::<Tensor>);
        let add = |acc: Option<Tensor>, t: Tensor| -> Result<Option<Tensor>> {
            Ok(Some(match acc {
                None => t,
                Some(a) => (a + t)?,
            }))
        };
        for (start, c) in chunks(shape.s, self.rows) {
            let (p, _) = probabilities(
                &shape,
                &q5,
                &kd,
                &self.bias,
                self.scale,
                start,
                c,
                Some(&self.lse),
            )?;
            let gc = shape.chunk(&g5, start, c)?; // (b, kvh, g·c, d)
            let oc = shape.chunk(&o5, start, c)?;
            if v.track_op() {
                let part = p.to_dtype(vd.dtype())?.t()?.matmul(&gc)?;
                dv = add(dv, part)?;
            }
            // dS = P ∘ (dP − rowsum(dO ∘ O)), dP = dO·vᵀ; in the statistics' type.
            let f = p.dtype();
            let dp = gc.matmul(&vd.t()?)?.to_dtype(f)?;
            let delta = (gc.to_dtype(f)? * oc.to_dtype(f)?)?.sum_keepdim(D::Minus1)?;
            let ds = ((dp.broadcast_sub(&delta)? * p)? * self.scale)?.to_dtype(kd.dtype())?;
            if q.track_op() {
                dq.push(
                    ds.matmul(&kd)?
                        .reshape((shape.b, shape.kvh, shape.g(), c, shape.d))?,
                );
            }
            if k.track_op() {
                dk = add(dk, ds.t()?.matmul(&shape.chunk(&q5, start, c)?)?)?;
            }
        }
        let dq = if q.track_op() {
            Some(Tensor::cat(&dq, 3)?.reshape((shape.b, shape.h, shape.s, shape.d))?)
        } else {
            None
        };
        Ok((dq, dk, dv))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::test_util::max_diff;
    use candle_core::{Device, Var};

    /// Against the composed ops (scores, masked softmax, values), grouped heads (4 query
    /// heads on 2 key/value heads), a causal mask with a padded key, chunks of 3 queries.
    #[test]
    fn chunks_give_the_composed_output_and_gradients() {
        let dev = Device::Cpu;
        let (b, h, kvh, s, d) = (2, 4, 2, 7, 5);
        let var = |shape: (usize, usize, usize, usize)| {
            Var::from_tensor(&Tensor::randn(0f32, 1.0, shape, &dev).unwrap()).unwrap()
        };
        let (q, k, v) = (var((b, h, s, d)), var((b, kvh, s, d)), var((b, kvh, s, d)));
        let mut mask = vec![0f32; b * s * s];
        for r in 0..b {
            for i in 0..s {
                for j in 0..s {
                    // Causal; row 1's last key is padding.
                    if j > i || (r == 1 && j == s - 1) {
                        mask[(r * s + i) * s + j] = -1e9;
                    }
                }
            }
        }
        let bias = Tensor::from_vec(mask, (b, 1, s, s), &dev).unwrap();
        let scale = 1.0 / (d as f64).sqrt();
        let composed = {
            let g = h / kvh;
            let rep = |t: &Tensor| {
                let t = t.unsqueeze(2).unwrap();
                Tensor::cat(&vec![t; g], 2)
                    .unwrap()
                    .reshape((b, h, s, d))
                    .unwrap()
            };
            let (kr, vr) = (rep(k.as_tensor()), rep(v.as_tensor()));
            let scores = (q.as_tensor().matmul(&kr.t().unwrap()).unwrap() * scale)
                .unwrap()
                .broadcast_add(&bias)
                .unwrap();
            crate::train::ops::softmax_last_dim(&scores)
                .unwrap()
                .matmul(&vr)
                .unwrap()
        };
        let chunked =
            attention_in(q.as_tensor(), k.as_tensor(), v.as_tensor(), &bias, scale, 3).unwrap();
        assert!(max_diff(&composed, &chunked) < 1e-5);
        let up = Tensor::randn(0f32, 1.0, (b, h, s, d), &dev).unwrap();
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
        for x in [&q, &k, &v] {
            let a = ga.get(x.as_tensor()).expect("composed gradient");
            let c = gb.get(x.as_tensor()).expect("chunked gradient");
            assert!(max_diff(a, c) < 1e-4, "{a} {c}");
        }
    }

    #[test]
    fn mismatched_shapes_are_refused() {
        let dev = Device::Cpu;
        let t = |s: (usize, usize, usize, usize)| Tensor::zeros(s, DType::F32, &dev).unwrap();
        let bias = t((1, 1, 4, 4));
        assert!(attention(
            &t((1, 3, 4, 8)),
            &t((1, 2, 4, 8)),
            &t((1, 2, 4, 8)),
            &bias,
            1.0
        )
        .is_err());
        assert!(attention(
            &t((1, 4, 4, 8)),
            &t((1, 2, 4, 8)),
            &t((1, 2, 4, 8)),
            &t((1, 1, 4, 5)),
            1.0
        )
        .is_err());
        assert!(attention(
            &t((1, 4, 4, 8)),
            &t((1, 2, 4, 8)),
            &t((1, 2, 4, 8)),
            &bias,
            1.0
        )
        .is_ok());
    }
}
