//! Causal attention on the CPU over plain slices, the same arithmetic for every query
//! whatever else is in its forward pass. With candle's matmuls the sums of a query depend on
//! the shape of the whole product (how many queries and keys came with it), and the int8
//! activations of the next layer turn those last-bit differences into different tokens: a
//! prompt prefilled in two pieces (a reused prefix, then the rest) would not give the tokens
//! of one cold prefill. Here query `i` at position `p` sums over keys `0..=p` in position
//! order, so prefill in any chunks, decode, and prefix reuse agree bit for bit. It is also
//! cheaper than the dozen small candle ops (reshapes, copies, rotary, two matmuls, softmax)
//! a decode step of one request took per layer.

use candle_core::{DType, Device, Result, Tensor};
use half::{f16, slice::HalfFloatSliceExt};

/// The head size and rotary layout of one layer's attention.
#[derive(Clone, Copy, Debug)]
pub struct Heads {
    pub head_dim: usize,
    /// Rotary pairs are adjacent (GPT-J style) rather than half a head apart (NeoX style).
    pub interleaved_rope: bool,
}

/// Rotary embedding of `x` (one head, `head_dim` values) with the tables of its position
/// (`head_dim / 2` each), written to `out`: the arithmetic of candle's `rope` / `rope_i`.
fn rotate(x: &[f32], cos: &[f32], sin: &[f32], interleaved: bool, out: &mut [f32]) {
    let half = x.len() / 2;
    for i in 0..half {
        let (a, b) = if interleaved {
            (2 * i, 2 * i + 1)
        } else {
            (i, i + half)
        };
        out[a] = x[a] * cos[i] - x[b] * sin[i];
        out[b] = x[a] * sin[i] + x[b] * cos[i];
    }
}

/// Projections `x` (rows, seq, n·head_dim, see [`Projected`]) as a (rows, n, seq, head_dim)
/// tensor on `device` (the CPU), contiguous; rotated when `rope` gives the tables of the
/// `seq` positions (`seq · head_dim / 2` values each).
pub(crate) fn to_heads_from(
    x: Projected,
    n: usize,
    hd: &Heads,
    rope: Option<(&[f32], &[f32])>,
    device: &Device,
) -> Result<Tensor> {
    let (rows, seq, width) = x.dims;
    let d = hd.head_dim;
    if width != n * d {
        candle_core::bail!("attention input {:?} is not {n} heads of {d}", x.dims);
    }
    let out = Tensor::zeros((rows, n, seq, d), DType::F32, device)?;
    write_heads_from(x, hd, rope, &out, 0)?;
    Ok(out)
}

/// A layer's projections (queries, keys or values) of some rows as the CPU attention reads
/// them: `dims` (rows, seq, width) from the first value, `stride` between rows and between
/// positions, unit stride within a position. One read of a projection's storage serves
/// every request of a batch ([`with_projected`], then [`Projected::rows`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Projected<'a> {
    pub data: &'a [f32],
    pub dims: (usize, usize, usize),
    pub stride: [usize; 2],
}

impl<'a> Projected<'a> {
    /// Rows `start..start + rows` of a projection of single positions (seq 1, contiguous
    /// rows), as `seq`-position rows: the rows of one request.
    pub fn rows(self, start: usize, rows: usize, seq: usize) -> Result<Projected<'a>> {
        let (total, one, width) = self.dims;
        let n = rows * seq;
        let data = self.data.get(start * width..(start + n) * width);
        match data {
            Some(data) if one == 1 && self.stride[0] == width && start + n <= total => {
                Ok(Projected {
                    data,
                    dims: (rows, seq, width),
                    stride: [seq * width, width],
                })
            }
            _ => candle_core::bail!(
                "rows {start}..{} as {rows} rows of {seq} of projections {:?}",
                start + n,
                self.dims
            ),
        }
    }
}

/// Runs `f` on a CPU f32 tensor of (rows, seq, width) projections, read-locked once.
pub(crate) fn with_projected<R>(x: &Tensor, f: impl FnOnce(Projected) -> R) -> Result<R> {
    let dims = x.dims3()?;
    with_f32(x, |data, stride| {
        let stride = [stride[0], stride[1]];
        f(Projected { data, dims, stride })
    })
}

/// [`with_projected`] for a layer's three projections at once.
pub(crate) fn with_projections<R>(
    [q, k, v]: [&Tensor; 3],
    f: impl FnOnce([Projected; 3]) -> R,
) -> Result<R> {
    with_projected(q, |q| {
        with_projected(k, |k| with_projected(v, |v| f([q, k, v])))
    })??
}

/// Writes `x` (rows, seq, n·head_dim projections, see [`Projected`]) into `dst`
/// (rows, n, capacity, head_dim, f32 or f16, a CPU tensor) at positions `at..at + seq`:
/// rotated ([`rotate`]) when `rope` gives the tables of the `seq` positions, and stored as
/// f16 rounded to nearest (ties to even) as [`to_f16`] does. [`to_heads_from`] is this into a
/// fresh f32 tensor; into a cache it is `to_heads_from`, a conversion and a slice assignment
/// without their tensors. `x` must not be `dst`'s storage (it is read while `dst` is written):
/// crate-private, its callers write projections into caches.
pub(crate) fn write_heads_from(
    x: Projected,
    hd: &Heads,
    rope: Option<(&[f32], &[f32])>,
    dst: &Tensor,
    at: usize,
) -> Result<()> {
    let (rows, seq, width) = x.dims;
    let d = hd.head_dim;
    let (drows, n, cap, dd) = dst.dims4()?;
    if d == 0 || width % d != 0 || (drows, n * d, dd) != (rows, width, d) || at + seq > cap {
        candle_core::bail!(
            "{:?} as heads of {d} into {:?} at position {at}",
            x.dims,
            dst.dims()
        );
    }
    if rope.is_some_and(|(cos, sin)| cos.len() < seq * d / 2 || sin.len() < seq * d / 2) {
        candle_core::bail!("rope tables shorter than {seq} positions");
    }
    let last = (rows.max(1) - 1) * x.stride[0] + (seq.max(1) - 1) * x.stride[1] + width;
    if rows * seq > 0 && x.data.len() < last {
        candle_core::bail!("projections {:?} past their values", x.dims);
    }
    let write = WriteHeads {
        src: x.data,
        stride: x.stride,
        rows,
        seq,
        n,
        d,
        rope,
        interleaved: hd.interleaved_rope,
        at,
    };
    dst.inplace_op1(&write)
}

/// [`write_heads_from`]' arguments, checked.
struct WriteHeads<'a> {
    src: &'a [f32],
    stride: [usize; 2],
    rows: usize,
    seq: usize,
    n: usize,
    d: usize,
    rope: Option<(&'a [f32], &'a [f32])>,
    interleaved: bool,
    at: usize,
}

impl WriteHeads<'_> {
    /// Each head of each row and position, rotated where asked, to `put(offset in dst, values)`.
    fn each(&self, dst_stride: &[usize], mut put: impl FnMut(usize, &[f32])) {
        let (d, half) = (self.d, self.d / 2);
        let mut rotated = vec![0f32; d];
        for r in 0..self.rows {
            for t in 0..self.seq {
                let src = &self.src[r * self.stride[0] + t * self.stride[1]..][..self.n * d];
                for (h, head) in src.chunks_exact(d).enumerate() {
                    let at = r * dst_stride[0] + h * dst_stride[1] + (self.at + t) * dst_stride[2];
                    match self.rope {
                        Some((cos, sin)) => {
                            let tables = t * half..(t + 1) * half;
                            let (cos, sin) = (&cos[tables.clone()], &sin[tables]);
                            rotate(head, cos, sin, self.interleaved, &mut rotated);
                            put(at, &rotated);
                        }
                        None => put(at, head),
                    }
                }
            }
        }
    }
}

impl candle_core::InplaceOp1 for WriteHeads<'_> {
    fn name(&self) -> &'static str {
        "write-heads"
    }

    fn cpu_fwd(
        &self,
        storage: &mut candle_core::CpuStorage,
        layout: &candle_core::Layout,
    ) -> Result<()> {
        let stride = layout.stride();
        if stride.len() != 4 || stride[3] != 1 {
            candle_core::bail!("write-heads: a cache tensor whose head_dim is not contiguous");
        }
        let off = layout.start_offset();
        let d = self.d;
        match storage {
            candle_core::CpuStorage::F32(data) => {
                let data = &mut data[off..];
                self.each(stride, |at, x| data[at..at + d].copy_from_slice(x));
            }
            candle_core::CpuStorage::F16(data) => {
                let data = &mut data[off..];
                self.each(stride, |at, x| narrow(x, &mut data[at..at + d]));
            }
            _ => candle_core::bail!("write-heads into a cache of neither f32 nor f16"),
        }
        Ok(())
    }
}

/// softmax(q·kᵀ / √head_dim)·v, causal: `q` (rows, heads, seq, hd) holds positions
/// `pos..pos + seq`, `k`, `v` (rows, kv_heads, pos + seq, hd) every position up to the last
/// query's. Query head `h` reads KV head `h / (heads / kv_heads)`. Returns (rows, seq,
/// heads·hd). (The reference [`attend_causal_after`] is tested against.)
#[cfg(test)]
pub fn attend_causal(q: &Tensor, k: &Tensor, v: &Tensor, pos: usize) -> Result<Tensor> {
    attend_causal_after(q, None, k, v, pos)
}

/// As [`attend_causal`], with the first `P` positions in a `prefix` (k, v) that every row
/// shares, each (1, kv_heads, P, hd); `k`, `v` (rows, kv_heads, pos + seq − P, hd) then hold
/// positions `P..pos + seq`. The bits are those of [`attend_causal`] over the whole
/// positions (each key's dot product and the value sum in position order are the same
/// arithmetic), and a prefix read by many rows is read from the caches, not from memory.
///
/// Several positions past the prefix run as [`attend_prefill`]'s blocks. Otherwise a few
/// queries' heads are spread over the threads one by one, or each task keeps a KV head's
/// whole group of heads (the bits are the same either way).
pub fn attend_causal_after(
    q: &Tensor,
    prefix: Option<(&Tensor, &Tensor)>,
    k: &Tensor,
    v: &Tensor,
    pos: usize,
) -> Result<Tensor> {
    let (rows, heads, seq, d) = q.dims4()?;
    let (_, kv_heads, own, _) = k.dims4()?;
    let shared = shared_len(prefix, k, d)?;
    let len = shared + own;
    if len != pos + seq || kv_heads == 0 || heads % kv_heads != 0 {
        candle_core::bail!(
            "attention of {heads} heads at positions {pos}..{} over {kv_heads} KV heads of {len}",
            pos + seq
        );
    }
    let group = QueryGroup {
        q,
        prefix,
        k,
        v,
        pos,
    };
    if sees_whole_prefix(&group)? {
        return Ok(attend_prefill(&[group])?.remove(0));
    }
    let groups = heads / kv_heads;
    let scale = 1.0 / (d as f32).sqrt();
    let mut out = vec![0f32; rows * seq * heads * d];
    let simd = simd();
    // Without a prefix, two empty ones (distinct tensors: each is read-locked below).
    let empty = || Tensor::zeros((1, kv_heads, 0, d), DType::F32, q.device());
    let empties;
    let (pk, pv) = match prefix {
        Some(p) => p,
        None => {
            empties = (empty()?, empty()?);
            (&empties.0, &empties.1)
        }
    };
    // A task is some of the query heads of one KV head at one (row, position): they read
    // the same keys and values, which then come from L1 for all but the first. A decode
    // step of one request alone has too few KV heads to keep the threads busy, so its tasks
    // are single heads (the same arithmetic per query either way).
    let threads = crate::engine::team::compute_threads();
    let per = if rows * seq * kv_heads >= 4 * threads {
        groups
    } else {
        1
    };
    with_f32(q, |qd, qs| {
        with_kv(k, |kd, ks| {
            with_kv(v, |vd, vs| {
                with_kv(pk, |pkd, pks| {
                    with_kv(pv, |pvd, pvs| {
                        let task = |i: usize, o: &mut [f32], scratch: &mut Scratch| {
                            let h0 = (i * per) % heads;
                            let t = (i * per / heads) % seq;
                            let r = i * per / (heads * seq);
                            let kv = h0 / groups;
                            let keys = pos + t + 1;
                            let from_prefix = keys.min(shared);
                            let segments = [
                                Segment::of((pkd, pks), (pvd, pvs), 0, kv, from_prefix),
                                Segment::of((kd, ks), (vd, vs), r, kv, keys - from_prefix),
                            ];
                            scratch.queries.clear();
                            for h in h0..h0 + per {
                                let qh = &qd[r * qs[0] + h * qs[1] + t * qs[2]..][..d];
                                scratch.queries.extend_from_slice(qh);
                            }
                            attend_group(simd, &segments, d, scale, scratch, o);
                        };
                        // A decode step's few queries run inline when they are little work (its
                        // caller spreads requests over the threads); otherwise they are spread
                        // over the threads, a single request's heads included.
                        let tasks = rows * seq * heads / per;
                        let init = || Scratch::new(per, len, d);
                        if tasks * per * len * d < 1 << 16 {
                            let mut scratch = init();
                            for (i, o) in out.chunks_mut(per * d).enumerate() {
                                task(i, o, &mut scratch);
                            }
                        } else {
                            let per_task = (tasks / threads).clamp(1, 16);
                            crate::engine::team::for_each_chunk_mut(
                                &mut out,
                                per_task * per * d,
                                |c, piece| {
                                    let mut scratch = init();
                                    for (j, o) in piece.chunks_mut(per * d).enumerate() {
                                        task(c * per_task + j, o, &mut scratch);
                                    }
                                },
                            );
                        }
                    })
                })
            })
        })
    })?????;
    Tensor::from_vec(out, (rows, seq, heads * d), q.device())
}

/// Whether [`attend_prefill`] takes a group: several query positions, all past its prefix.
fn sees_whole_prefix(g: &QueryGroup) -> Result<bool> {
    let shared = g.prefix.map_or(Ok(0), |(k, _)| k.dim(2))?;
    Ok(g.q.dim(2)? > 1 && g.pos >= shared)
}

/// [`attend_causal_after`] for the prompt pieces of one forward pass: those that see all of
/// their prefix in one parallel loop ([`attend_prefill`]), any other by itself. Returns
/// each group's (rows, seq, heads·hd).
pub fn attend_groups(groups: &[QueryGroup]) -> Result<Vec<Tensor>> {
    let whole: Vec<bool> = groups
        .iter()
        .map(sees_whole_prefix)
        .collect::<Result<_>>()?;
    let together: Vec<QueryGroup> = groups
        .iter()
        .zip(&whole)
        .filter(|(_, &w)| w)
        .map(|(g, _)| *g)
        .collect();
    let mut prefilled = attend_prefill(&together)?.into_iter();
    groups
        .iter()
        .zip(whole)
        .map(|(g, w)| match w {
            true => Ok(prefilled.next().expect("one output per group taken")),
            false => attend_causal_after(g.q, g.prefix, g.k, g.v, g.pos),
        })
        .collect()
}

/// Query positions of one task of [`attend_prefill`]: with the KV head's query heads, 24
/// queries at head size 64 read each block of keys and values from L1 (a task per position
/// read every key from L2 for its three queries).
const POSITIONS_PER_TASK: usize = 8;

/// A group's tensors as slices, and its shape.
struct PrefillData<'a> {
    views: GroupData<'a>,
    rows: usize,
    seq: usize,
    shared: usize,
    pos: usize,
}

/// [`attend_causal_after`] for several groups of query positions whose every query sees
/// its whole prefix (`pos ≥ P`: a prompt prefilled after a reused or shared start, or with
/// none), in one parallel loop: a task is one row's KV head over a block of positions, all
/// its query heads together. Each query's arithmetic is unchanged (its scores are
/// [`dot`]'s, its softmax over its own keys, its weighted sum in position order); a block's
/// earlier queries also score the few keys past their own position, which nothing reads.
/// Returns each group's (rows, seq, heads·hd).
pub fn attend_prefill(groups: &[QueryGroup]) -> Result<Vec<Tensor>> {
    let Some(first) = groups.first() else {
        return Ok(Vec::new());
    };
    let (_, heads, _, d) = first.q.dims4()?;
    let kv_heads = first.k.dim(1)?;
    if kv_heads == 0 || heads % kv_heads != 0 {
        candle_core::bail!("attention of {heads} heads over {kv_heads} KV heads");
    }
    let per = heads / kv_heads;
    let held: Vec<Held> = groups.iter().map(Held::of).collect();
    let mut data = Vec::with_capacity(groups.len());
    for (g, h) in groups.iter().zip(&held) {
        let (rows, gheads, seq, gd) = g.q.dims4()?;
        let (krows, gkv, own, kd) = g.k.dims4()?;
        let shared = shared_len(g.prefix, g.k, d)?;
        if (gheads, gd, gkv, kd, krows) != (heads, d, kv_heads, d, rows)
            || g.v.dims() != g.k.dims()
            || shared + own != g.pos + seq
            || g.pos < shared
        {
            candle_core::bail!(
                "prefill attention of queries {:?} at position {} over keys {:?} after {shared} shared",
                g.q.dims(),
                g.pos,
                g.k.dims()
            );
        }
        data.push(PrefillData {
            views: h.data(g)?,
            rows,
            seq,
            shared,
            pos: g.pos,
        });
    }
    // f16 keys and values widened once for the pass: every task of a group reads its prefix
    // and its rows' earlier positions (a widened copy per task was 5 % of a 16-request
    // run's samples); groups that share a prefix share its copy.
    let own: Vec<[Option<Widened>; 2]> = data
        .iter()
        .map(|g| {
            let shape = (g.rows, kv_heads, g.pos + g.seq - g.shared, d);
            [g.views.k, g.views.v].map(|x| Widened::of(x, shape))
        })
        .collect();
    // A prefix is the same when it starts at the same keys and values and is as long.
    let key = |g: &PrefillData| {
        g.views
            .prefix
            .map(|(pk, pv)| (pk.0.addr(), pv.0.addr(), g.shared))
    };
    let mut prefixes: Vec<(_, [Option<Widened>; 2])> = Vec::new();
    for g in &data {
        if let Some((pk, pv)) = g.views.prefix {
            if !prefixes.iter().any(|(at, _)| *at == key(g)) {
                let shape = (1, kv_heads, g.shared, d);
                prefixes.push((key(g), [pk, pv].map(|x| Widened::of(x, shape))));
            }
        }
    }
    let data: Vec<PrefillData> = data
        .into_iter()
        .zip(&own)
        .map(|(mut g, [wk, wv])| {
            let at = key(&g);
            g.views.k = Widened::or(wk, g.views.k);
            g.views.v = Widened::or(wv, g.views.v);
            g.views.prefix = g.views.prefix.map(|(pk, pv)| {
                let (_, [wk, wv]) = prefixes
                    .iter()
                    .find(|(k, _)| *k == at)
                    .expect("every prefix was widened or kept");
                (Widened::or(wk, pk), Widened::or(wv, pv))
            });
            g
        })
        .collect();
    // Tasks: group, row, KV head, block (a row's positions stay together in the outputs).
    let mut tasks = Vec::new();
    for (g, gd) in data.iter().enumerate() {
        let blocks = gd.seq.div_ceil(POSITIONS_PER_TASK);
        for r in 0..gd.rows {
            for kv in 0..kv_heads {
                tasks.extend((0..blocks).map(|b| (g, r, kv, b)));
            }
        }
    }
    let scale = 1.0 / (d as f32).sqrt();
    let simd = simd();
    let run = |i: usize| {
        let (g, r, kv, b) = tasks[i];
        let gd = &data[g];
        let ts = b * POSITIONS_PER_TASK..((b + 1) * POSITIONS_PER_TASK).min(gd.seq);
        let (shared, pos) = (gd.shared, gd.pos);
        let nq = ts.len() * per;
        let len = pos + ts.end;
        let mut scratch = Scratch::new(nq, len, d);
        let (qd, qs) = gd.views.q;
        for t in ts.clone() {
            for h in kv * per..(kv + 1) * per {
                let at = r * qs[0] + h * qs[1] + t * qs[2];
                scratch.queries.extend_from_slice(&qd[at..][..d]);
            }
        }
        let own = |n: usize| Segment::of(gd.views.k, gd.views.v, r, kv, n);
        let prefix = gd
            .views
            .prefix
            .map(|(pk, pv)| Segment::of(pk, pv, 0, kv, shared));
        let queries = &scratch.queries;
        let buf = &mut scratch.kv;
        if let Some(seg) = &prefix {
            group_scores(
                simd,
                queries,
                d,
                seg,
                scale,
                &mut scratch.scores,
                len,
                0,
                buf,
            );
        }
        let mine = own(len - shared);
        let scores = &mut scratch.scores;
        group_scores(simd, queries, d, &mine, scale, scores, len, shared, buf);
        for (j, row) in scratch.scores.chunks_mut(len).enumerate() {
            let t = ts.start + j / per;
            kernels::softmax(&mut row[..pos + t + 1]);
        }
        let mut out = vec![0f32; nq * d];
        if let Some(seg) = &prefix {
            group_values(simd, seg, &scratch.scores, len, 0, 0..nq, &mut out, d, buf);
        }
        for (j, t) in ts.enumerate() {
            let seg = own(pos + t + 1 - shared);
            let queries = j * per..(j + 1) * per;
            let scores = &scratch.scores;
            group_values(simd, &seg, scores, len, shared, queries, &mut out, d, buf);
        }
        out
    };
    let work: usize = data
        .iter()
        .map(|g| g.rows * heads * g.seq * (g.pos + g.seq) * d)
        .sum();
    let outs: Vec<Vec<f32>> = if work < 1 << 16 {
        (0..tasks.len()).map(run).collect()
    } else {
        crate::engine::team::map(tasks.len(), run)
    };
    // Scatter: (rows, seq, heads·hd) per group, a task's outputs position after position.
    let mut ys: Vec<Vec<f32>> = data
        .iter()
        .map(|g| vec![0f32; g.rows * g.seq * heads * d])
        .collect();
    for (&(g, r, kv, b), o) in tasks.iter().zip(&outs) {
        let seq = data[g].seq;
        for (j, heads_out) in o.chunks(per * d).enumerate() {
            let t = b * POSITIONS_PER_TASK + j;
            let at = ((r * seq + t) * heads + kv * per) * d;
            ys[g][at..at + per * d].copy_from_slice(heads_out);
        }
    }
    ys.into_iter()
        .zip(&data)
        .map(|(y, g)| Tensor::from_vec(y, (g.rows, g.seq, heads * d), first.q.device()))
        .collect()
}

/// Positions of a shared `prefix` (k, v), each (1, kv_heads, P, d) beside keys `k` (rows,
/// kv_heads, …, d); 0 without one.
fn shared_len(prefix: Option<(&Tensor, &Tensor)>, k: &Tensor, d: usize) -> Result<usize> {
    let Some((pk, pv)) = prefix else {
        return Ok(0);
    };
    let (one, pkh, plen, pd) = pk.dims4()?;
    if one != 1 || pkh != k.dim(1)? || pd != d || pv.dims() != pk.dims() {
        candle_core::bail!(
            "a shared prefix {:?} / {:?} for keys {:?}",
            pk.dims(),
            pv.dims(),
            k.dims()
        );
    }
    Ok(plen)
}

/// Rows that share a cache (a request's samples) and sit at the same position: queries `q`
/// (rows, heads, seq, hd) at positions `pos..pos + seq` (one in a decode step, for
/// [`attend_decode`]; a prompt piece after all of its prefix, `P ≤ pos`, for
/// [`attend_prefill`]); `prefix` (k, v), each (1, kv_heads, P, hd), the positions every row
/// shares; `k`, `v` (rows, kv_heads, pos + seq − P, hd) the rows' own positions after it.
#[derive(Clone, Copy)]
pub struct QueryGroup<'a> {
    pub q: &'a Tensor,
    pub prefix: Option<(&'a Tensor, &'a Tensor)>,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub pos: usize,
}

/// Attention of a group under a sliding window (Gemma 3's local layers), once the window
/// leaves early keys out: the query at position `p` reads the keys at `p − window < j ≤ p`.
/// Candle's ops over the window's keys, in f32 (the kernels above read every key from the
/// first); the arithmetic of transformers' eager attention with its sliding mask. Returns
/// (rows, seq, heads·hd).
pub fn attend_window(g: &QueryGroup, window: usize) -> Result<Tensor> {
    let (rows, heads, seq, d) = g.q.dims4()?;
    let (krows, kv_heads, own, _) = g.k.dims4()?;
    let shared = shared_len(g.prefix, g.k, d)?;
    let total = shared + own;
    if total != g.pos + seq || krows != rows || kv_heads == 0 || heads % kv_heads != 0 {
        candle_core::bail!(
            "windowed attention of {rows}×{heads} heads at positions {}..{} over {krows}×\
             {kv_heads} KV heads of {total}",
            g.pos,
            g.pos + seq
        );
    }
    // The first key any query of the group reads.
    let first = (g.pos + 1).saturating_sub(window);
    let span = |prefix: Option<&Tensor>, own_part: &Tensor| -> Result<Tensor> {
        let mut parts = Vec::with_capacity(2);
        if let (Some(p), true) = (prefix, first < shared) {
            let p = p.narrow(2, first, shared - first)?.to_dtype(DType::F32)?;
            parts.push(
                p.broadcast_as((rows, kv_heads, shared - first, d))?
                    .contiguous()?,
            );
        }
        let from = first.saturating_sub(shared);
        parts.push(own_part.narrow(2, from, own - from)?.to_dtype(DType::F32)?);
        Tensor::cat(&parts, 2)?.contiguous()
    };
    let k = span(g.prefix.map(|p| p.0), g.k)?;
    let v = span(g.prefix.map(|p| p.1), g.v)?;
    let len = total - first;
    let groups = heads / kv_heads;
    // Query head `h` reads KV head `h / groups`: a KV head's query heads stacked along the
    // query axis.
    let q =
        g.q.to_dtype(DType::F32)?
            .contiguous()?
            .reshape((rows, kv_heads, groups * seq, d))?;
    let scores = (q.matmul(&k.t()?.contiguous()?)? * (1.0 / (d as f64).sqrt()))?;
    let mut mask = Vec::with_capacity(groups * seq * len);
    for _ in 0..groups {
        for i in 0..seq {
            let p = g.pos + i;
            mask.extend((first..total).map(|j| {
                if j <= p && j + window > p {
                    0f32
                } else {
                    f32::NEG_INFINITY
                }
            }));
        }
    }
    let mask = Tensor::from_vec(mask, (groups * seq, len), q.device())?;
    let att = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask)?)?;
    att.matmul(&v)?
        .reshape((rows, heads, seq, d))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((rows, seq, heads * d))
}

/// A group's dimensions, checked.
#[derive(Clone, Copy)]
struct GroupDims {
    rows: usize,
    heads: usize,
    kv_heads: usize,
    d: usize,
    shared: usize,
    own: usize,
}

impl GroupDims {
    fn of(g: &QueryGroup) -> Result<Self> {
        let (rows, heads, seq, d) = g.q.dims4()?;
        let (krows, kv_heads, own, kd) = g.k.dims4()?;
        let shared = shared_len(g.prefix, g.k, d)?;
        if seq != 1
            || krows != rows
            || kd != d
            || g.v.dims() != g.k.dims()
            || kv_heads == 0
            || heads % kv_heads != 0
            || shared + own != g.pos + 1
        {
            candle_core::bail!(
                "decode attention of queries {:?} at position {} over keys {:?} after {shared} shared",
                g.q.dims(),
                g.pos,
                g.k.dims()
            );
        }
        Ok(GroupDims {
            rows,
            heads,
            kv_heads,
            d,
            shared,
            own,
        })
    }
}

/// A tensor's values from its first element, and its strides.
type View<'a> = (&'a [f32], &'a [usize]);

/// Cached keys or values from their first element: f32, or f16 (what the engine's caches
/// hold on the CPU: half the memory each decode step reads). Every kernel reads them as f32
/// (f16 → f32 is exact), so both give the same bits for the same values.
#[derive(Clone, Copy)]
enum Kv<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
}

impl<'a> Kv<'a> {
    /// The values from element `i` on.
    fn from(self, i: usize) -> Self {
        match self {
            Kv::F32(x) => Kv::F32(&x[i..]),
            Kv::F16(x) => Kv::F16(&x[i..]),
        }
    }

    fn addr(self) -> usize {
        match self {
            Kv::F32(x) => x.as_ptr() as usize,
            Kv::F16(x) => x.as_ptr() as usize,
        }
    }

    fn value_bytes(self) -> usize {
        match self {
            Kv::F32(_) => 4,
            Kv::F16(_) => 2,
        }
    }

    /// `n` rows of `d` values, `stride` apart from row `p` on, as f32: in place (with their
    /// stride), or converted into `buf` (stride `d`).
    fn rows<'b>(
        self,
        p: usize,
        n: usize,
        stride: usize,
        d: usize,
        buf: &'b mut Vec<f32>,
    ) -> (&'b [f32], usize)
    where
        'a: 'b,
    {
        match self {
            Kv::F32(x) => (&x[p * stride..], stride),
            Kv::F16(x) => {
                if buf.len() < n * d {
                    buf.resize(n * d, 0.0);
                }
                let out = &mut buf[..n * d];
                widen_rows(&x[p * stride..], stride, d, out);
                (out, d)
            }
        }
    }
}

/// Writes the f16 rows of `x` (of `d` values, `stride` apart) that fill `out` as f32.
fn widen_rows(x: &[f16], stride: usize, d: usize, out: &mut [f32]) {
    if stride == d {
        // A cache's rows of one head follow each other: one conversion.
        let n = out.len();
        widen(&x[..n], out);
        return;
    }
    for (i, out) in out.chunks_exact_mut(d).enumerate() {
        widen(&x[i * stride..][..d], out);
    }
}

/// An f32 copy of f16 keys or values, (a, kv_heads, n, d) contiguous.
struct Widened {
    values: Vec<f32>,
    strides: [usize; 4],
}

impl Widened {
    /// The first `n` positions of every (a, kv_heads) row of `x` as f32; `None` when they
    /// are f32 already.
    fn of((x, s): KvView, (a, heads, n, d): (usize, usize, usize, usize)) -> Option<Self> {
        let Kv::F16(x) = x else {
            return None;
        };
        let mut values = vec![0f32; a * heads * n * d];
        for (i, out) in values.chunks_exact_mut(n * d).enumerate() {
            let (row, head) = (i / heads, i % heads);
            widen_rows(&x[row * s[0] + head * s[1]..], s[2], d, out);
        }
        Some(Widened {
            values,
            strides: [heads * n * d, n * d, d, 1],
        })
    }

    /// The widened copy's view where there is one, else `x`.
    fn or<'a>(w: &'a Option<Widened>, x: KvView<'a>) -> KvView<'a> {
        w.as_ref()
            .map_or(x, |w| (Kv::F32(&w.values), &w.strides[..]))
    }
}

/// Keys or values and their strides.
type KvView<'a> = (Kv<'a>, &'a [usize]);

/// A group's tensors as slices.
#[derive(Clone, Copy)]
struct GroupData<'a> {
    q: View<'a>,
    k: KvView<'a>,
    v: KvView<'a>,
    prefix: Option<(KvView<'a>, KvView<'a>)>,
}

/// A tensor's storage, read-locked, and its layout.
type Lock<'t> = (candle_core::StorageRef<'t>, &'t candle_core::Layout);

/// A group's tensors read-locked while their values are read as slices.
struct Held<'t> {
    q: Lock<'t>,
    k: Lock<'t>,
    v: Lock<'t>,
    prefix: Option<(Lock<'t>, Lock<'t>)>,
}

impl<'t> Held<'t> {
    fn of(g: &QueryGroup<'t>) -> Self {
        Held {
            q: g.q.storage_and_layout(),
            k: g.k.storage_and_layout(),
            v: g.v.storage_and_layout(),
            prefix: g
                .prefix
                .map(|(pk, pv)| (pk.storage_and_layout(), pv.storage_and_layout())),
        }
    }

    /// The values of `g` (whose tensors these are) as slices.
    fn data(&self, g: &QueryGroup) -> Result<GroupData<'_>> {
        let prefix = match (&self.prefix, g.prefix) {
            (Some((hk, hv)), Some((pk, pv))) => Some((kv_view(pk, hk)?, kv_view(pv, hv)?)),
            _ => None,
        };
        Ok(GroupData {
            q: f32_view(g.q, &self.q)?,
            k: kv_view(g.k, &self.k)?,
            v: kv_view(g.v, &self.v)?,
            prefix,
        })
    }
}

/// Query heads `heads` (within each KV head's group) of KV head `kv` for `members` (group,
/// row) of one cluster (rows reading the same prefix).
struct DecodeTask {
    cluster: usize,
    kv: usize,
    members: std::ops::Range<usize>,
    heads: std::ops::Range<usize>,
}

/// Rows of a task at most: its scores stay small, and the threads get tasks to share.
const ROWS_PER_TASK: usize = 16;

/// One decode step's attention for several groups at once (continuous batching), each query
/// with exactly the arithmetic of [`attend_causal_after`] on its group alone. Rows whose
/// groups read the same shared prefix (samples of one prompt, requests forked from one stored
/// conversation) attend to it together: a task takes one KV head for many such rows, so each
/// block of the prefix's keys and values is read from memory once and from L1 for every
/// other query, instead of once per request. Returns (rows of all groups in order, 1,
/// heads·hd).
pub fn attend_decode(groups: &[QueryGroup]) -> Result<Tensor> {
    let dims: Vec<GroupDims> = groups.iter().map(GroupDims::of).collect::<Result<_>>()?;
    let Some(first) = dims.first().copied() else {
        candle_core::bail!("decode attention of no groups");
    };
    if dims
        .iter()
        .any(|g| (g.heads, g.kv_heads, g.d) != (first.heads, first.kv_heads, first.d))
    {
        candle_core::bail!("decode attention of groups with different head shapes");
    }
    let (heads, kv_heads, d) = (first.heads, first.kv_heads, first.d);
    let per = heads / kv_heads;
    let held: Vec<Held> = groups.iter().map(Held::of).collect();
    let data: Vec<GroupData> = groups
        .iter()
        .zip(&held)
        .map(|(g, h)| h.data(g))
        .collect::<Result<_>>()?;
    // Clusters: groups whose prefix is the same memory (the same positions of one cache).
    let prefix_key = |i: usize| {
        data[i].prefix.map(|((k, ks), (v, vs))| {
            (
                k.addr(),
                v.addr(),
                dims[i].shared,
                ks[1],
                ks[2],
                vs[1],
                vs[2],
            )
        })
    };
    let mut keys: Vec<_> = Vec::new();
    let mut clusters: Vec<Vec<(usize, usize)>> = Vec::new();
    for (i, g) in dims.iter().enumerate() {
        let key = prefix_key(i);
        let c = match keys.iter().position(|k| key.is_some() && *k == key) {
            Some(c) => c,
            None => {
                keys.push(key);
                clusters.push(Vec::new());
                keys.len() - 1
            }
        };
        clusters[c].extend((0..g.rows).map(|r| (i, r)));
    }
    let tasks = decode_tasks(&clusters, kv_heads, per);
    let scale = 1.0 / (d as f32).sqrt();
    let simd = simd();
    let run = |t: &DecodeTask, scratch: &mut Scratch, out: &mut Vec<f32>| {
        let members = &clusters[t.cluster][t.members.clone()];
        decode_task(simd, t, members, &dims, &data, d, scale, scratch, out)
    };
    let work: usize = dims
        .iter()
        .map(|g| g.rows * heads * (g.shared + g.own) * d)
        .sum();
    // Each task claimed by whichever thread is free (all inline when little work): a task's
    // own keys come from memory, so equal tasks take unequal times, and a fixed half of
    // them per thread left one thread waiting for the other (16 requests' steps alternating
    // with the fixed split in one process: medians 0.1–3 % faster in five runs of seven).
    let task_output = |i: usize| {
        DECODE_SCRATCH.with(|cell| {
            let mut scratch = cell.take().unwrap_or_else(|| Scratch::new(0, 0, d));
            let mut out = Vec::new();
            run(&tasks[i], &mut scratch, &mut out);
            cell.set(Some(scratch));
            out
        })
    };
    let outs: Vec<Vec<f32>> = if work < 1 << 16 {
        (0..tasks.len()).map(task_output).collect()
    } else {
        crate::engine::team::map(tasks.len(), task_output)
    };
    // Scatter: a task's outputs are its members' heads, member after member.
    let offsets: Vec<usize> = dims
        .iter()
        .scan(0, |rows, g| {
            let at = *rows;
            *rows += g.rows;
            Some(at)
        })
        .collect();
    let total: usize = dims.iter().map(|g| g.rows).sum();
    let mut out = vec![0f32; total * heads * d];
    let mut src = outs.iter().flat_map(|o| o.chunks(d));
    for t in &tasks {
        let members = &clusters[t.cluster][t.members.clone()];
        for &(g, r) in members {
            for h in t.heads.clone() {
                let head = t.kv * per + h;
                let at = ((offsets[g] + r) * heads + head) * d;
                out[at..at + d].copy_from_slice(src.next().expect("one output per query"));
            }
        }
    }
    Tensor::from_vec(out, (total, 1, heads * d), groups[0].q.device())
}

thread_local! {
    /// A compute thread's buffers for [`decode_task`], kept between tasks and steps.
    static DECODE_SCRATCH: std::cell::Cell<Option<Scratch>> = const { std::cell::Cell::new(None) };
}

/// The tasks of a decode step: per cluster and KV head, its rows in chunks (enough of them
/// to give every thread work, at most [`ROWS_PER_TASK`] rows each), and single query heads
/// when that is still too few tasks (one request alone).
fn decode_tasks(clusters: &[Vec<(usize, usize)>], kv_heads: usize, per: usize) -> Vec<DecodeTask> {
    let target = 2 * crate::engine::team::compute_threads();
    let wanted = target.div_ceil(kv_heads * clusters.len());
    let mut tasks = Vec::new();
    let chunks: Vec<usize> = clusters
        .iter()
        .map(|rows| {
            wanted
                .max(rows.len().div_ceil(ROWS_PER_TASK))
                .min(rows.len())
        })
        .collect();
    let split_heads = chunks.iter().sum::<usize>() * kv_heads < target;
    for (c, rows) in clusters.iter().enumerate() {
        let n = rows.len();
        for kv in 0..kv_heads {
            for i in 0..chunks[c] {
                let members = i * n / chunks[c]..(i + 1) * n / chunks[c];
                if split_heads {
                    for h in 0..per {
                        tasks.push(DecodeTask {
                            cluster: c,
                            kv,
                            members: members.clone(),
                            heads: h..h + 1,
                        });
                    }
                } else {
                    tasks.push(DecodeTask {
                        cluster: c,
                        kv,
                        members,
                        heads: 0..per,
                    });
                }
            }
        }
    }
    tasks
}

/// A task's queries: scores over the shared prefix for all of them at once (each block of
/// keys then serves every query from L1), each member's own keys, the softmax, and the
/// weighted values in position order; appends (members · heads) outputs of `d` values, in
/// order, to `outputs`.
#[allow(clippy::too_many_arguments)]
fn decode_task(
    simd: bool,
    t: &DecodeTask,
    members: &[(usize, usize)],
    dims: &[GroupDims],
    data: &[GroupData],
    d: usize,
    scale: f32,
    scratch: &mut Scratch,
    outputs: &mut Vec<f32>,
) {
    let per = t.heads.len();
    let nq = members.len() * per;
    let len = members
        .iter()
        .map(|&(g, _)| dims[g].shared + dims[g].own)
        .max()
        .unwrap_or(0);
    scratch.len = len;
    scratch.scores.clear();
    scratch.scores.resize(nq * len, 0.0);
    scratch.queries.clear();
    let groups = dims[members[0].0].heads / dims[members[0].0].kv_heads;
    for &(g, r) in members {
        let (qd, qs) = data[g].q;
        for h in t.heads.clone() {
            let head = t.kv * groups + h;
            scratch
                .queries
                .extend_from_slice(&qd[r * qs[0] + head * qs[1]..][..d]);
        }
    }
    // Every member of a cluster reads the same prefix (see `attend_decode`).
    let (g0, _) = members[0];
    let prefix = data[g0]
        .prefix
        .map(|(pk, pv)| Segment::of(pk, pv, 0, t.kv, dims[g0].shared));
    let own = |g: usize, r: usize| Segment::of(data[g].k, data[g].v, r, t.kv, dims[g].own);
    // A row's own keys and values are read once per step, from memory (they do not stay in
    // cache between steps). With a prefix of eight positions or more, all members' are asked
    // for a few lines at a time while the prefix is worked on (see `Prefetches`); without
    // one, the next member's while this one's are scored.
    // A prefix that only this task's few queries read (a request decoding alone) is read
    // as a row's own keys and values are, in one pass: widening it for them cost a single
    // stream more than the reads it saves.
    let prefix_alone = nq <= 3;
    let spread = !prefix_alone && prefix.as_ref().is_some_and(|seg| seg.n >= 8);
    // A member's own keys, then its values, as spans to ask for.
    let spans = |&(g, r): &(usize, usize)| {
        let seg = own(g, r);
        [
            (seg.keys, seg.kstride, seg.n),
            (seg.values, seg.vstride, seg.n),
        ]
    };
    let pf = &mut scratch.kv.pf;
    if let (true, Some(seg)) = (spread, &prefix) {
        let keys = members.iter().map(|m| spans(m)[0]);
        pf.plan(keys, d, seg.n / 8 * nq.div_ceil(2));
    } else if let Some(first) = members.first() {
        pf.plan(spans(first), d, 1);
        pf.ask(usize::MAX);
    }
    if let Some(seg) = &prefix {
        let score = if prefix_alone {
            own_scores
        } else {
            group_scores
        };
        score(
            simd,
            &scratch.queries,
            d,
            seg,
            scale,
            &mut scratch.scores,
            len,
            0,
            &mut scratch.kv,
        );
        scratch.kv.pf.ask(usize::MAX);
    }
    for (m, &(g, r)) in members.iter().enumerate() {
        if let (false, Some(next)) = (spread, members.get(m + 1)) {
            scratch.kv.pf.plan(spans(next), d, 1);
            scratch.kv.pf.ask(usize::MAX);
        }
        let queries = &scratch.queries[m * per * d..(m + 1) * per * d];
        let scores = &mut scratch.scores[m * per * len..(m + 1) * per * len];
        let from = dims[g].shared;
        own_scores(
            simd,
            queries,
            d,
            &own(g, r),
            scale,
            scores,
            len,
            from,
            &mut scratch.kv,
        );
    }
    for (j, row) in scratch.scores.chunks_mut(len).enumerate() {
        let (g, _) = members[j / per];
        kernels::softmax(&mut row[..dims[g].shared + dims[g].own]);
    }
    let at = outputs.len();
    outputs.resize(at + nq * d, 0.0);
    let out = &mut outputs[at..];
    let work = &mut scratch.kv;
    if let Some(seg) = &prefix {
        if spread {
            let values = members.iter().map(|m| spans(m)[1]);
            let points = seg.n.div_ceil(VALUE_BLOCK) * nq.div_ceil(2);
            work.pf.plan(values, d, points);
        }
        let sum = if prefix_alone {
            own_values
        } else {
            group_values
        };
        sum(simd, seg, &scratch.scores, len, 0, 0..nq, out, d, work);
        work.pf.ask(usize::MAX);
    }
    for (m, &(g, r)) in members.iter().enumerate() {
        let (seg, from) = (own(g, r), dims[g].shared);
        let queries = m * per..(m + 1) * per;
        let scores = &scratch.scores;
        own_values(simd, &seg, scores, len, from, queries, out, d, work);
    }
}

/// Keys and values of consecutive positions (rows `stride` values apart), `n` of them.
#[derive(Clone, Copy)]
struct Segment<'a> {
    keys: Kv<'a>,
    values: Kv<'a>,
    kstride: usize,
    vstride: usize,
    n: usize,
}

impl<'a> Segment<'a> {
    /// The first `n` positions of KV head `kv` of row `row` in (rows, kv_heads, positions,
    /// hd) keys and values (values from the first element, strides).
    fn of((k, ks): KvView<'a>, (v, vs): KvView<'a>, row: usize, kv: usize, n: usize) -> Self {
        Segment {
            keys: k.from(row * ks[0] + kv * ks[1]),
            values: v.from(row * vs[0] + kv * vs[1]),
            kstride: ks[2],
            vstride: vs[2],
            n,
        }
    }

    /// Keys `p..p + n` as f32 rows of `d` values and their stride (see [`Kv::rows`]).
    fn keys<'b>(&self, p: usize, n: usize, d: usize, buf: &'b mut Vec<f32>) -> (&'b [f32], usize)
    where
        'a: 'b,
    {
        self.keys.rows(p, n, self.kstride, d, buf)
    }

    /// Values `p..p + n`, as [`Segment::keys`].
    fn values<'b>(&self, p: usize, n: usize, d: usize, buf: &'b mut Vec<f32>) -> (&'b [f32], usize)
    where
        'a: 'b,
    {
        self.values.rows(p, n, self.vstride, d, buf)
    }
}

/// Keys and values asked into L2 a few cache lines at a time, spread over a task's arithmetic
/// on the shared prefix: the members' own keys while the prefix's keys are scored, their
/// values while the prefix's values are summed. Asked for a member at a time (up to ~40 KiB
/// at once), the prefetch instructions left the thread waiting for free miss slots: 88 % of
/// `decode_task`'s own samples, ~6 % of a 16-request step. Spread, 16 requests' steps took
/// 0.92–0.985 of the time (paired medians, eight runs), 4 requests' 0.96–0.99, one
/// request's 1.00–1.01. Into L2, not L1: a row's 15 KiB (60 positions) asked into L1
/// measured slower than no prefetch at all (16 requests' decode attention 4.2–5.3 against
/// 4.0–4.9 ms), into L2 3.3–4.0 ms.
#[derive(Default)]
struct Prefetches {
    /// (first byte, bytes between rows, rows, bytes of a row).
    spans: Vec<(usize, usize, usize, usize)>,
    /// Lines asked for per [`Prefetches::some`].
    rate: usize,
    span: usize,
    row: usize,
    byte: usize,
}

impl Prefetches {
    /// Forgets what is left and takes `spans` (values, stride, rows of `d` values), to be
    /// asked for over `points` calls of [`Prefetches::some`].
    fn plan<'a>(
        &mut self,
        spans: impl IntoIterator<Item = (Kv<'a>, usize, usize)>,
        d: usize,
        points: usize,
    ) {
        self.spans.clear();
        (self.span, self.row, self.byte) = (0, 0, 0);
        for (data, stride, n) in spans {
            self.push(data, stride, n, d);
        }
        self.rate = self.lines().div_ceil(points.max(1));
    }

    /// Adds keys or values: `n` rows of `d` values, `stride` apart.
    fn push(&mut self, data: Kv, stride: usize, n: usize, d: usize) {
        let bytes = data.value_bytes();
        let (row_bytes, stride_bytes) = (d * bytes, stride * bytes);
        if n == 0 || row_bytes == 0 {
            return;
        }
        if stride_bytes == row_bytes {
            self.spans.push((data.addr(), 0, 1, n * row_bytes));
        } else {
            self.spans.push((data.addr(), stride_bytes, n, row_bytes));
        }
    }

    /// Cache lines of the spans not yet asked for in full (all of them before the first ask).
    fn lines(&self) -> usize {
        self.spans[self.span..]
            .iter()
            .map(|&(_, _, rows, row_bytes)| rows * row_bytes.div_ceil(64))
            .sum()
    }

    /// Asks for the next `rate` lines.
    #[inline]
    fn some(&mut self) {
        self.ask(self.rate);
    }

    /// Asks for up to `lines` more lines; returns how many it asked for.
    fn ask(&mut self, lines: usize) -> usize {
        let mut asked = 0;
        while asked < lines && self.span < self.spans.len() {
            let (start, stride, rows, row_bytes) = self.spans[self.span];
            let at = start + self.row * stride + self.byte;
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a prefetch never faults; the address is within the span.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                    at as *const i8,
                )
            };
            #[cfg(not(target_arch = "x86_64"))]
            let _ = at;
            asked += 1;
            self.byte += 64;
            if self.byte >= row_bytes {
                self.byte = 0;
                self.row += 1;
                if self.row == rows {
                    self.row = 0;
                    self.span += 1;
                }
            }
        }
        asked
    }
}

/// A task's buffers: its queries one after another, their scores (a row of `len` each), and
/// a block of f16 keys or values converted to f32 (with the lines to ask for meanwhile).
struct Scratch {
    queries: Vec<f32>,
    scores: Vec<f32>,
    len: usize,
    kv: KvWork,
}

/// A block of keys or values as f32, and memory to ask for while blocks are worked on.
#[derive(Default)]
struct KvWork {
    buf: Vec<f32>,
    pf: Prefetches,
}

impl Scratch {
    fn new(queries: usize, len: usize, d: usize) -> Self {
        Scratch {
            queries: Vec::with_capacity(queries * d),
            scores: vec![0.0; queries * len],
            len,
            kv: KvWork::default(),
        }
    }
}

/// Positions whose values one pass of a group's weighted sums reads (16 KiB at head size 64:
/// they stay in L1 for every query of the group).
const VALUE_BLOCK: usize = 64;

/// softmax(q·kᵀ·scale)·v for the queries in `scratch` (one KV head's, same position) over
/// the keys of `segments` in order, into `out` (a head after another, zeroed). Each query's
/// arithmetic is that of one query alone: [`dot`]'s per key, the softmax, then
/// [`weighted_sum`] in position order.
fn attend_group(
    simd: bool,
    segments: &[Segment],
    d: usize,
    scale: f32,
    scratch: &mut Scratch,
    out: &mut [f32],
) {
    let g = out.len() / d;
    let total: usize = segments.iter().map(|s| s.n).sum();
    let len = scratch.len;
    let mut from = 0;
    for seg in segments {
        group_scores(
            simd,
            &scratch.queries,
            d,
            seg,
            scale,
            &mut scratch.scores,
            len,
            from,
            &mut scratch.kv,
        );
        from += seg.n;
    }
    for row in scratch.scores.chunks_mut(len).take(g) {
        kernels::softmax(&mut row[..total]);
    }
    let mut from = 0;
    for seg in segments {
        group_values(
            simd,
            seg,
            &scratch.scores,
            len,
            from,
            0..g,
            out,
            d,
            &mut scratch.kv,
        );
        from += seg.n;
    }
}

/// `out_j += Σ_p scores[j·len + from + p] · value_p` over the segment's positions in order
/// ([`weighted_sum`]'s arithmetic) for the queries `js` (`d` outputs each in `out`), a block
/// of [`VALUE_BLOCK`] positions at a time (it stays in L1 for every query; f16 values are
/// converted into `work`'s buffer once per block), two queries per pass where the CPU allows;
/// asks for some of `work`'s prefetches before each pass.
#[allow(clippy::too_many_arguments)]
fn group_values(
    simd: bool,
    seg: &Segment,
    scores: &[f32],
    len: usize,
    from: usize,
    js: std::ops::Range<usize>,
    out: &mut [f32],
    d: usize,
    work: &mut KvWork,
) {
    for start in (0..seg.n).step_by(VALUE_BLOCK) {
        let n = VALUE_BLOCK.min(seg.n - start);
        let (values, vstride) = seg.values(start, n, d, &mut work.buf);
        let w = |j: usize| &scores[j * len + from + start..][..n];
        let mut j = js.start;
        while j < js.end {
            work.pf.some();
            #[cfg(target_arch = "x86_64")]
            if simd && d.is_multiple_of(8) && j + 1 < js.end {
                assert!(values.len() >= (n - 1) * vstride + d);
                let (o0, o1) = out[j * d..(j + 2) * d].split_at_mut(d);
                // SAFETY: `simd()` checked the CPU features; `values` holds every row read
                // (asserted); the weights and outputs have equal lengths.
                unsafe {
                    if wide() {
                        avx512::weighted_sum2(w(j), w(j + 1), values, vstride, o0, o1);
                    } else {
                        avx2::weighted_sum2(w(j), w(j + 1), values, vstride, o0, o1);
                    }
                }
                j += 2;
                continue;
            }
            weighted_sum(simd, w(j), values, vstride, &mut out[j * d..][..d], true);
            j += 1;
        }
    }
}

/// `scores[j·len + from + p] = q_j · key_p · scale` for every query `j` of `queries` (`d`
/// values each) and the segment's keys, a block of [`VALUE_BLOCK`] keys at a time (f16 keys
/// converted into `work`'s buffer once per block), eight keys at a time within it (all
/// queries read them from L1); asks for some of `work`'s prefetches before each pair of
/// queries' pass over eight keys.
#[allow(clippy::too_many_arguments)]
fn group_scores(
    simd: bool,
    queries: &[f32],
    d: usize,
    seg: &Segment,
    scale: f32,
    scores: &mut [f32],
    len: usize,
    from: usize,
    work: &mut KvWork,
) {
    for start in (0..seg.n).step_by(VALUE_BLOCK) {
        let n = VALUE_BLOCK.min(seg.n - start);
        let (keys, kstride) = seg.keys(start, n, d, &mut work.buf);
        let at = from + start;
        let (keys, pf) = ((keys, kstride, n), &mut work.pf);
        block_scores(simd, queries, d, keys, scale, scores, len, at, pf);
    }
}

/// [`group_scores`] for a row's own keys, which only that row's few queries (its query heads
/// of one KV head) read: f16 keys are converted as they are loaded, four keys at a time for
/// up to three queries at once, instead of being widened into `work`'s buffer and read back
/// in a pass per pair of queries. The same bits: f16 → f32 is exact, and each score is
/// [`dot`]'s.
#[allow(clippy::too_many_arguments)]
fn own_scores(
    simd: bool,
    queries: &[f32],
    d: usize,
    seg: &Segment,
    scale: f32,
    scores: &mut [f32],
    len: usize,
    from: usize,
    work: &mut KvWork,
) {
    #[cfg(target_arch = "x86_64")]
    if let (true, Kv::F16(keys)) = (simd && f16c() && d.is_multiple_of(8), seg.keys) {
        let (n, stride, nq) = (seg.n, seg.kstride, queries.len() / d);
        if n == 0 || nq == 0 {
            return;
        }
        assert!(keys.len() >= (n - 1) * stride + d && scores.len() >= (nq - 1) * len + from + n);
        let key = |p: usize| &keys[p * stride..][..d];
        let q = |j: usize| &queries[j * d..][..d];
        let out = scores.as_mut_ptr();
        let mut p = 0;
        while p + 4 <= n {
            let block: [&[f16]; 4] = std::array::from_fn(|i| key(p + i));
            let mut j = 0;
            while j < nq {
                let at = |i: usize| out.wrapping_add((j + i) * len + from + p);
                // SAFETY: `simd()` and `f16c()` checked the CPU features; every slice has
                // `d` values; each output's 4 scores lie in `scores` (asserted above).
                unsafe {
                    match nq - j {
                        1 => avx2::dots_f16([q(j)], &block, scale, [at(0)]),
                        2 => avx2::dots_f16([q(j), q(j + 1)], &block, scale, [at(0), at(1)]),
                        _ => avx2::dots_f16(
                            [q(j), q(j + 1), q(j + 2)],
                            &block,
                            scale,
                            [at(0), at(1), at(2)],
                        ),
                    }
                }
                j += (nq - j).min(3);
            }
            p += 4;
        }
        // The last keys (fewer than four) one at a time, widened.
        if work.buf.len() < d {
            work.buf.resize(d, 0.0);
        }
        for p in p..n {
            let k = &mut work.buf[..d];
            widen(key(p), k);
            for j in 0..nq {
                scores[j * len + from + p] = dot(simd, q(j), k) * scale;
            }
        }
        return;
    }
    group_scores(simd, queries, d, seg, scale, scores, len, from, work);
}

/// [`group_values`] for a row's own values and its queries `js`: f16 values are converted as
/// they are loaded, summed for up to three queries at once (the bits of [`weighted_sum`]:
/// one multiply-add per position, in position order, onto what `out` holds).
#[allow(clippy::too_many_arguments)]
fn own_values(
    simd: bool,
    seg: &Segment,
    scores: &[f32],
    len: usize,
    from: usize,
    js: std::ops::Range<usize>,
    out: &mut [f32],
    d: usize,
    work: &mut KvWork,
) {
    #[cfg(target_arch = "x86_64")]
    if let (true, Kv::F16(values)) = (simd && f16c() && d.is_multiple_of(8), seg.values) {
        let (n, stride) = (seg.n, seg.vstride);
        if n == 0 || js.is_empty() {
            return;
        }
        assert!(values.len() >= (n - 1) * stride + d && out.len() >= js.end * d);
        let w = |j: usize| &scores[j * len + from..][..n];
        let outs = out.as_mut_ptr();
        let mut j = js.start;
        while j < js.end {
            let o = |i: usize| outs.wrapping_add((j + i) * d);
            // SAFETY: `simd()` and `f16c()` checked the CPU features; `values` holds every
            // row read and each output its `d` values (asserted above); the weights have `n`
            // values each.
            unsafe {
                match js.end - j {
                    1 => sums_f16([w(j)], values, stride, d, [o(0)]),
                    2 => sums_f16([w(j), w(j + 1)], values, stride, d, [o(0), o(1)]),
                    _ => sums_f16(
                        [w(j), w(j + 1), w(j + 2)],
                        values,
                        stride,
                        d,
                        [o(0), o(1), o(2)],
                    ),
                }
            }
            j += (js.end - j).min(3);
        }
        return;
    }
    group_values(simd, seg, scores, len, from, js, out, d, work);
}

/// [`avx2::weighted_sums_f16`], on 512-bit registers where [`wide`].
///
/// # Safety
/// As [`avx2::weighted_sums_f16`].
#[cfg(target_arch = "x86_64")]
unsafe fn sums_f16<const Q: usize>(
    ws: [&[f32]; Q],
    v: &[f16],
    stride: usize,
    d: usize,
    outs: [*mut f32; Q],
) {
    if wide() {
        avx512::weighted_sums_f16(ws, v, stride, d, outs);
    } else {
        avx2::weighted_sums_f16(ws, v, stride, d, outs);
    }
}

/// [`group_scores`] for `n` keys (f32 rows `stride` apart), written from column `from`.
#[allow(clippy::too_many_arguments)]
fn block_scores(
    simd: bool,
    queries: &[f32],
    d: usize,
    (keys, stride, n): (&[f32], usize, usize),
    scale: f32,
    scores: &mut [f32],
    len: usize,
    from: usize,
    pf: &mut Prefetches,
) {
    let key = |p: usize| &keys[p * stride..][..d];
    let mut p = 0;
    #[cfg(target_arch = "x86_64")]
    if simd && d.is_multiple_of(8) {
        let nq = queries.len() / d;
        let q = |j: usize| &queries[j * d..][..d];
        while p + 8 <= n {
            let block: [&[f32]; 8] = std::array::from_fn(|j| key(p + j));
            // Two queries at a time: each load of a key serves both.
            for j in (0..nq - nq % 2).step_by(2) {
                pf.some();
                if wide() {
                    let at = from + p;
                    let (first, second) = scores[j * len..].split_at_mut(len);
                    // SAFETY: `wide()` checked the CPU features; every slice has `d` values.
                    unsafe {
                        avx512::dot2x8(
                            q(j),
                            q(j + 1),
                            &block,
                            scale,
                            &mut first[at..at + 8],
                            &mut second[at..at + 8],
                        )
                    };
                    continue;
                }
                for half in [0, 4] {
                    let keys: &[&[f32]; 4] = block[half..half + 4].try_into().expect("4 keys");
                    let at = from + p + half;
                    let (first, second) = scores[j * len..].split_at_mut(len);
                    // SAFETY: `simd()` checked the CPU features; every slice has `d` values.
                    unsafe {
                        avx2::dot2x4(
                            q(j),
                            q(j + 1),
                            keys,
                            scale,
                            &mut first[at..at + 4],
                            &mut second[at..at + 4],
                        )
                    };
                }
            }
            if nq % 2 == 1 {
                pf.some();
                let j = nq - 1;
                let out = &mut scores[j * len + from + p..][..8];
                // SAFETY: as above.
                unsafe { avx2::dot8(q(j), &block, scale, out) };
            }
            p += 8;
        }
    }
    for p in p..n {
        let k = key(p);
        for (j, q) in queries.chunks(d).enumerate() {
            scores[j * len + from + p] = dot(simd, q, k) * scale;
        }
    }
}

/// Whether the AVX2/FMA versions of [`dot`] (and `dot8`) and [`weighted_sum`] run here
/// (decided once, so every query of a process takes the same arithmetic).
fn simd() -> bool {
    crate::engine::simd::CpuFeatures::get().avx2_fma
}

/// `dst = src` as f32 (exact): F16C where the CPU has it (half's slice conversion calls a
/// function per 8 values, which cost a 16-request decode step more than the halved memory
/// traffic saved).
fn widen(src: &[f16], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if f16c() {
        // SAFETY: the CPU features were checked; `widen_f16c` checks the lengths.
        unsafe { avx2::widen_f16c(src, dst) };
        return;
    }
    src.convert_to_f32_slice(dst);
}

/// `dst = src` as f16, rounded to nearest (ties to even): what a cache stores. F16C where the
/// CPU has it (the same bits as half's conversion, without its call and feature check per 8
/// values: a 16-request decode step converts 3 000 heads).
fn narrow(src: &[f32], dst: &mut [f16]) {
    #[cfg(target_arch = "x86_64")]
    if f16c() {
        // SAFETY: the CPU features were checked; `narrow_f16c` checks the lengths.
        unsafe { avx2::narrow_f16c(src, dst) };
        return;
    }
    dst.convert_from_f32_slice(src);
}

/// Whether the value sums and the paired queries' scores run on 512-bit registers (AVX-512F
/// besides AVX2/FMA/F16C; decided once). Each lane does the multiply-adds its 256-bit
/// kernel's lane does, in the same order, and the lanes are summed in the same order: the
/// same bits, in half the instructions (16-request decode steps 3-4 % shorter on a Cascade
/// Lake VM, whose two 512-bit FMA pipes run twice the multiply-adds a cycle).
/// `COLLABLLM_NO_WIDE=1` keeps the 256-bit kernels (and the int8 layers' 256-bit VNNI).
#[cfg(target_arch = "x86_64")]
fn wide() -> bool {
    simd() && f16c() && crate::engine::simd::wide_registers()
}

/// Whether the CPU converts f16 with F16C (decided once).
#[cfg(target_arch = "x86_64")]
fn f16c() -> bool {
    crate::engine::simd::CpuFeatures::get().f16c
}

fn dot(simd: bool, a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if simd && a.len().is_multiple_of(8) {
        // SAFETY: `simd()` checked the CPU features; the slices have equal lengths.
        return unsafe { avx2::dot(a, b) };
    }
    let _ = simd;
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The softmax of a query's scores, vectorized ([`crate::engine::simd`]).
mod kernels {
    use crate::engine::simd::{dispatch, exp};

    const LANES: usize = 16;

    /// `s ← e^(s − max) / Σ e^(s − max)`, in place.
    #[inline(always)]
    fn softmax_any(scores: &mut [f32]) {
        let mut lanes = [f32::NEG_INFINITY; LANES];
        let mut chunks = scores.chunks_exact(LANES);
        for c in &mut chunks {
            for (m, &s) in lanes.iter_mut().zip(c) {
                *m = m.max(s);
            }
        }
        let max = lanes
            .iter()
            .chain(chunks.remainder())
            .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let mut sums = [0f32; LANES];
        let mut chunks = scores.chunks_exact_mut(LANES);
        for c in &mut chunks {
            for (sum, s) in sums.iter_mut().zip(c) {
                *s = exp(*s - max);
                *sum += *s;
            }
        }
        let mut sum = sums.iter().sum::<f32>();
        // The last partial chunk's powers in one padded chunk (vectorized like the others:
        // done one by one, they took a quarter of the softmax of 255 scores), then added in
        // order as before.
        let rest = chunks.into_remainder();
        let mut pad = [0f32; LANES];
        pad[..rest.len()].copy_from_slice(rest);
        for p in &mut pad {
            *p = exp(*p - max);
        }
        for (s, &p) in rest.iter_mut().zip(&pad) {
            *s = p;
            sum += p;
        }
        for s in scores.iter_mut() {
            *s /= sum;
        }
    }

    dispatch!(pub(super) softmax, softmax_any, (scores: &mut [f32]) -> ());
}

/// `out = Σ_p w[p] · v[p·stride..][..out.len()]`, summed in position order from zero, or
/// from `out` as it is when `accumulate` (one multiply-add per term with AVX2/FMA, a multiply
/// then an add otherwise): a sum in two pieces is the sum in one.
fn weighted_sum(
    simd: bool,
    w: &[f32],
    v: &[f32],
    stride: usize,
    out: &mut [f32],
    accumulate: bool,
) {
    let d = out.len();
    assert!(w.is_empty() || v.len() >= (w.len() - 1) * stride + d);
    #[cfg(target_arch = "x86_64")]
    if simd && d.is_multiple_of(8) {
        // SAFETY: `simd()` checked the CPU features; `v` holds every row read (asserted).
        unsafe {
            if wide() {
                avx512::weighted_sum(w, v, stride, out, accumulate);
            } else {
                avx2::weighted_sum(w, v, stride, out, accumulate);
            }
        }
        return;
    }
    let _ = simd;
    if !accumulate {
        out.fill(0.0);
    }
    for (p, &wp) in w.iter().enumerate() {
        for (o, x) in out.iter_mut().zip(&v[p * stride..][..d]) {
            *o += wp * x;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2;

/// Kernels of [`avx2`] on 512-bit registers, the same bits: the value sums 16 columns a
/// register, each lane's multiply-adds those of the 256-bit kernel's lane for that column,
/// in the same order (a last 8 columns go to the 256-bit kernel); two queries' scores a
/// register, one query a half.
#[cfg(target_arch = "x86_64")]
mod avx512;

/// Runs `f` on the f32 values of a CPU tensor (from its first element) and its strides; the
/// last stride must be 1.
fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32], &[usize]) -> R) -> Result<R> {
    let held = t.storage_and_layout();
    let (data, stride) = f32_view(t, &held)?;
    Ok(f(data, stride))
}

/// The f32 values (from the first element) and strides of `t`, whose storage `held` is
/// read-locked; the last stride must be 1.
fn f32_view<'a>(
    t: &Tensor,
    held: &'a (candle_core::StorageRef<'_>, &candle_core::Layout),
) -> Result<View<'a>> {
    if t.dtype() != DType::F32 {
        candle_core::bail!("CPU attention: f32 expected, got {:?}", t.dtype());
    }
    cpu_values(held)
}

/// Runs `f` on the keys or values of a CPU f32 or f16 tensor (from its first element) and
/// its strides; the last stride must be 1.
fn with_kv<R>(t: &Tensor, f: impl FnOnce(Kv, &[usize]) -> R) -> Result<R> {
    let held = t.storage_and_layout();
    let (data, stride) = kv_view(t, &held)?;
    Ok(f(data, stride))
}

/// As [`f32_view`], for keys or values in f32 or f16.
fn kv_view<'a>(
    t: &Tensor,
    held: &'a (candle_core::StorageRef<'_>, &candle_core::Layout),
) -> Result<KvView<'a>> {
    match t.dtype() {
        DType::F32 => cpu_values(held).map(|(x, s)| (Kv::F32(x), s)),
        DType::F16 => cpu_values(held).map(|(x, s)| (Kv::F16(x), s)),
        other => candle_core::bail!("CPU attention: f32 or f16 keys expected, got {other:?}"),
    }
}

/// The values (from the first element) and strides of a read-locked CPU storage of `T`;
/// the last stride must be 1.
fn cpu_values<'a, T: candle_core::WithDType>(
    (storage, layout): &'a (candle_core::StorageRef<'_>, &candle_core::Layout),
) -> Result<(&'a [T], &'a [usize])> {
    let candle_core::Storage::Cpu(cpu) = &**storage else {
        candle_core::bail!("CPU attention runs on the CPU");
    };
    let stride = layout.stride();
    if stride.last() != Some(&1) {
        candle_core::bail!("CPU attention: the last dimension must be contiguous");
    }
    let data = cpu.as_slice::<T>()?;
    Ok((&data[layout.start_offset()..], stride))
}

/// A CPU f32 tensor as f16 (rounded to nearest, ties to even), converted with the CPU's
/// vector instructions where it has them.
pub fn to_f16(t: &Tensor) -> Result<Tensor> {
    let t = t.contiguous()?;
    let n = t.elem_count();
    let mut out = vec![f16::ZERO; n];
    with_f32(&t, |data, _| narrow(&data[..n], &mut out))?;
    Tensor::from_vec(out, t.shape(), t.device())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::test_util::max_diff;

    #[test]
    fn softmax_gives_the_same_bits_on_every_isa() {
        use crate::engine::simd::{assert_same_bits_on_every_isa, test_values};
        for n in [1usize, 7, 8, 255, 1024] {
            let scores = test_values(n, 5);
            assert_same_bits_on_every_isa("softmax", |isa| {
                let mut s = scores.clone();
                kernels::softmax::on(isa, &mut s);
                s
            });
        }
    }

    /// The hand-written AVX2 dot product and weighted sum against plain f64 sums (they
    /// reorder the sums into lanes and use FMA, so not the same bits: within 1e-5 relative
    /// to the sum of magnitudes). The AVX-512 forms are compared bit for bit with these.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_kernels_match_a_scalar_reference() {
        use crate::engine::simd::test_values;
        if !simd() {
            eprintln!("no AVX2/FMA here: the AVX2 attention kernels are not run");
            return;
        }
        for d in [8usize, 16, 64, 128] {
            let (a, b) = (test_values(d, 6), test_values(d, 7));
            // SAFETY: the features were checked; the slices have equal lengths.
            let got = unsafe { avx2::dot(&a, &b) } as f64;
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            let scale: f64 = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (*x as f64 * *y as f64).abs())
                .sum();
            assert!(
                (got - want).abs() <= 1e-5 * scale,
                "dot d={d}: {got} vs {want}"
            );

            let n = 29;
            let stride = d + 3;
            let w = test_values(n, 8);
            let v = test_values((n - 1) * stride + d, 9);
            let start = test_values(d, 10);
            for accumulate in [false, true] {
                let mut out = start.clone();
                // SAFETY: the features were checked; `v` holds every row read.
                unsafe { avx2::weighted_sum(&w, &v, stride, &mut out, accumulate) };
                for (c, got) in out.iter().enumerate() {
                    let terms = (0..n).map(|p| w[p] as f64 * v[p * stride + c] as f64);
                    let base = if accumulate { start[c] as f64 } else { 0.0 };
                    let want = base + terms.clone().sum::<f64>();
                    let scale = base.abs() + terms.map(f64::abs).sum::<f64>();
                    assert!(
                        (*got as f64 - want).abs() <= 1e-5 * scale,
                        "weighted_sum d={d} col {c}: {got} vs {want}"
                    );
                }
            }
        }
    }

    /// [`to_heads_from`] of a tensor's projections.
    fn to_heads(
        x: &Tensor,
        n: usize,
        hd: &Heads,
        rope: Option<(&[f32], &[f32])>,
    ) -> Result<Tensor> {
        with_projected(x, |x| to_heads_from(x, n, hd, rope, &Device::Cpu))?
    }

    /// [`write_heads_from`] of a tensor's projections.
    fn write_heads(
        x: &Tensor,
        hd: &Heads,
        rope: Option<(&[f32], &[f32])>,
        dst: &Tensor,
        at: usize,
    ) -> Result<()> {
        with_projected(x, |x| write_heads_from(x, hd, rope, dst, at))?
    }

    const HEADS: usize = 6;
    const KV: usize = 2;

    fn randn(shape: &[usize]) -> Tensor {
        Tensor::randn(0f32, 1.0, shape, &Device::Cpu).unwrap()
    }

    /// The candle ops this replaces: (rows, seq, n·hd) inputs at positions 0..seq.
    fn reference(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        s: &Heads,
    ) -> Tensor {
        let (rows, seq, _) = q.dims3().unwrap();
        let d = s.head_dim;
        let heads = |t: &Tensor, n: usize| {
            t.reshape((rows, seq, n, d))
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .contiguous()
                .unwrap()
        };
        let rope = |t: &Tensor| {
            if s.interleaved_rope {
                candle_nn::rotary_emb::rope_i(t, cos, sin).unwrap()
            } else {
                candle_nn::rotary_emb::rope(t, cos, sin).unwrap()
            }
        };
        let (q, k, v) = (rope(&heads(q, HEADS)), rope(&heads(k, KV)), heads(v, KV));
        let k = k.repeat_interleave_heads();
        let v = v.repeat_interleave_heads();
        let mask: Vec<f32> = (0..seq)
            .flat_map(|i| (0..seq).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY }))
            .collect();
        let mask = Tensor::from_vec(mask, (seq, seq), &Device::Cpu).unwrap();
        let att = (q.matmul(&k.t().unwrap()).unwrap() / (d as f64).sqrt()).unwrap();
        let att = att.broadcast_add(&mask).unwrap();
        let att = candle_nn::ops::softmax_last_dim(&att).unwrap();
        att.matmul(&v)
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .reshape((rows, seq, HEADS * d))
            .unwrap()
    }

    trait RepeatHeads {
        fn repeat_interleave_heads(&self) -> Tensor;
    }
    impl RepeatHeads for Tensor {
        /// (rows, KV, seq, d) -> (rows, HEADS, seq, d), each KV head for its group of heads.
        fn repeat_interleave_heads(&self) -> Tensor {
            let (rows, kv, seq, d) = self.dims4().unwrap();
            self.unsqueeze(2)
                .unwrap()
                .broadcast_as((rows, kv, HEADS / KV, seq, d))
                .unwrap()
                .reshape((rows, HEADS, seq, d))
                .unwrap()
        }
    }

    /// Rotates and attends `seq` positions in chunks, keeping K/V as a cache would.
    fn chunked(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cos: &[f32],
        sin: &[f32],
        s: &Heads,
        cuts: &[usize],
    ) -> Tensor {
        let seq = q.dim(1).unwrap();
        let half = s.head_dim / 2;
        let mut bounds = vec![0];
        bounds.extend_from_slice(cuts);
        bounds.push(seq);
        let (mut k_all, mut v_all, mut outs): (Option<Tensor>, Option<Tensor>, Vec<Tensor>) =
            (None, None, vec![]);
        for w in bounds.windows(2) {
            let (a, n) = (w[0], w[1] - w[0]);
            let tables = (
                &cos[a * half..(a + n) * half],
                &sin[a * half..(a + n) * half],
            );
            let qh = to_heads(&q.narrow(1, a, n).unwrap(), HEADS, s, Some(tables)).unwrap();
            let kh = to_heads(&k.narrow(1, a, n).unwrap(), KV, s, Some(tables)).unwrap();
            let vh = to_heads(&v.narrow(1, a, n).unwrap(), KV, s, None).unwrap();
            let grow = |all: Option<Tensor>, new: Tensor| match all {
                None => new,
                Some(t) => Tensor::cat(&[&t, &new], 2).unwrap(),
            };
            k_all = Some(grow(k_all, kh));
            v_all = Some(grow(v_all, vh));
            // As in a KV cache: the filled positions of a larger allocation.
            let pad = randn(&[q.dim(0).unwrap(), KV, 3, s.head_dim]);
            let filled = |t: &Tensor| {
                Tensor::cat(&[t, &pad], 2)
                    .unwrap()
                    .narrow(2, 0, a + n)
                    .unwrap()
            };
            let (ka, va) = (
                filled(k_all.as_ref().unwrap()),
                filled(v_all.as_ref().unwrap()),
            );
            outs.push(attend_causal(&qh, &ka, &va, a).unwrap());
        }
        Tensor::cat(&outs, 1).unwrap()
    }

    #[test]
    fn equals_candle_ops_and_chunks_agree_bit_for_bit() {
        for interleaved_rope in [false, true] {
            let s = Heads {
                head_dim: 16,
                interleaved_rope,
            };
            let (rows, seq) = (2, 11);
            let q = randn(&[rows, seq, HEADS * s.head_dim]);
            let k = randn(&[rows, seq, KV * s.head_dim]);
            let v = randn(&[rows, seq, KV * s.head_dim]);
            let (cos, sin) = (randn(&[seq, s.head_dim / 2]), randn(&[seq, s.head_dim / 2]));
            let want = reference(&q, &k, &v, &cos, &sin, &s);
            let (c, sn) = (
                cos.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                sin.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            let whole = chunked(&q, &k, &v, &c, &sn, &s, &[]);
            assert!(
                max_diff(&whole, &want) < 1e-5,
                "interleaved {interleaved_rope}"
            );
            // A prefix then the rest, and one position at a time (decode): the same bits.
            for cuts in [vec![4], (1..seq).collect::<Vec<_>>()] {
                let pieces = chunked(&q, &k, &v, &c, &sn, &s, &cuts);
                assert_eq!(max_diff(&pieces, &whole), 0.0, "cuts {cuts:?}");
            }
        }
    }

    #[test]
    fn heads_written_into_a_cache_are_to_heads_then_a_slice_assignment() {
        let bits = |t: &Tensor| {
            let v = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
            let v = v.to_vec1::<f32>().unwrap();
            v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        };
        for interleaved_rope in [false, true] {
            let s = Heads {
                head_dim: 16,
                interleaved_rope,
            };
            let (rows, seq, cap, at) = (3, 5, 12, 4);
            // A narrowed projection, as each request's part of a batch is.
            let x = randn(&[rows + 2, seq, KV * s.head_dim])
                .narrow(0, 1, rows)
                .unwrap();
            let tables = randn(&[2, seq * s.head_dim / 2]).to_vec2::<f32>().unwrap();
            let rope = Some((&tables[0][..], &tables[1][..]));
            for dtype in [DType::F32, DType::F16] {
                for rope in [rope, None] {
                    let filler = randn(&[rows, KV, cap, s.head_dim]).to_dtype(dtype).unwrap();
                    let want = filler.copy().unwrap();
                    let heads = to_heads(&x, KV, &s, rope).unwrap();
                    let heads = match dtype {
                        DType::F16 => to_f16(&heads).unwrap(),
                        _ => heads,
                    };
                    want.slice_set(&heads, 2, at).unwrap();
                    let got = filler;
                    write_heads(&x, &s, rope, &got, at).unwrap();
                    let what = format!(
                        "interleaved {interleaved_rope} {dtype:?} rope {}",
                        rope.is_some()
                    );
                    assert_eq!(bits(&got), bits(&want), "{what}");
                }
            }
            // Past the cache's room, or heads of another size: an error, nothing written.
            let cache =
                Tensor::zeros((rows, KV, cap, s.head_dim), DType::F16, &Device::Cpu).unwrap();
            assert!(write_heads(&x, &s, None, &cache, cap - seq + 1).is_err());
            let other = Heads { head_dim: 8, ..s };
            assert!(write_heads(&x, &other, None, &cache, 0).is_err());
            assert_eq!(
                cache
                    .abs()
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap(),
                0.0
            );
        }
    }

    #[test]
    fn a_requests_projections_are_its_rows_and_nothing_past_them() {
        let x = Tensor::arange(0f32, 24.0, &Device::Cpu)
            .unwrap()
            .reshape((6, 1, 4))
            .unwrap();
        with_projected(&x, |all| {
            let two = all.rows(2, 2, 1).unwrap();
            assert_eq!(two.data, &(8..16).map(|v| v as f32).collect::<Vec<_>>()[..]);
            assert_eq!((two.dims, two.stride), ((2, 1, 4), [4, 4]));
            // A prompt piece of 2 positions: one row of 2.
            let piece = all.rows(4, 1, 2).unwrap();
            assert_eq!((piece.dims, piece.stride), ((1, 2, 4), [8, 4]));
            assert_eq!(piece.data[0], 16.0);
            assert!(all.rows(5, 2, 1).is_err());
            assert!(all.rows(0, 1, 7).is_err());
        })
        .unwrap();
    }

    #[test]
    fn prefetches_ask_for_every_line_of_their_spans_once() {
        let values = vec![f16::ZERO; 4096];
        let mut pf = Prefetches::default();
        // Contiguous rows (one span of 5 · 128 bytes: 10 lines), rows 3 strides apart (4
        // rows of 2 lines), and rows of 40 bytes (one line each, 3 rows).
        pf.push(Kv::F16(&values), 64, 5, 64);
        pf.push(Kv::F16(&values[320..]), 192, 4, 64);
        pf.push(Kv::F16(&values[1200..]), 64, 3, 20);
        pf.push(Kv::F16(&values), 64, 0, 64);
        assert_eq!(pf.lines(), 10 + 8 + 3);
        pf.rate = 4;
        let mut asked = Vec::new();
        loop {
            let n = pf.ask(pf.rate);
            if n == 0 {
                break;
            }
            asked.push(n);
        }
        assert_eq!(asked, [4, 4, 4, 4, 4, 1]);
        assert_eq!((pf.lines(), pf.ask(usize::MAX)), (0, 0));
        // A new plan forgets the old spans: 2 rows of 128 bytes over 2 calls, 2 lines each.
        pf.plan([(Kv::F16(&values), 64, 2)], 64, 2);
        assert_eq!((pf.lines(), pf.rate), (4, 2));
        assert_eq!(
            (pf.ask(pf.rate), pf.ask(pf.rate), pf.ask(pf.rate)),
            (2, 2, 0)
        );
    }

    #[test]
    fn softmax_matches_f64_at_every_partial_chunk_length() {
        for n in 1..=50 {
            let mut row: Vec<f32> = (0..n).map(|i| ((i * 37 % 11) as f32 - 5.0) * 1.7).collect();
            if n > 3 {
                row[2] = f32::NEG_INFINITY; // a masked score
            }
            let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
            let e: Vec<f64> = row.iter().map(|&x| (x as f64 - max).exp()).collect();
            let sum: f64 = e.iter().sum();
            kernels::softmax(&mut row);
            for (i, (&got, want)) in row.iter().zip(&e).enumerate() {
                assert!((got as f64 - want / sum).abs() < 1e-6, "n={n} i={i}: {got}");
            }
        }
    }

    #[test]
    fn f16_rounding_is_halfs_for_every_kind_of_value() {
        let mut xs: Vec<f32> = vec![
            0.0,
            -0.0,
            1.0,
            -1.5,
            65504.0,
            65519.99,
            65520.0,
            1e9,
            -1e9,
            6.0e-8,
            2.9e-8,
            3.0e-8,
            1.0e-40,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MIN_POSITIVE,
        ];
        // Ties between two f16 values (an even and an odd mantissa), and random values.
        xs.extend((0..64).map(|i| 1.0 + (2 * i + 1) as f32 * 2f32.powi(-11)));
        xs.extend(randn(&[333]).to_vec1::<f32>().unwrap());
        let mut ours = vec![f16::ZERO; xs.len()];
        narrow(&xs, &mut ours);
        let want: Vec<u16> = xs.iter().map(|&x| f16::from_f32(x).to_bits()).collect();
        assert_eq!(ours.iter().map(|h| h.to_bits()).collect::<Vec<_>>(), want);
        let mut nan = [f16::ZERO; 8];
        narrow(&[f32::NAN; 8], &mut nan);
        assert!(nan.iter().all(|h| h.is_nan()));
    }

    /// The 512-bit kernels against the 256-bit ones they stand for, bit for bit, at head
    /// sizes with and without a last 8 or 16 columns (on CPUs without AVX-512F only the
    /// 256-bit kernels run, and this compares nothing: it says so).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn wide_kernels_give_the_256_bit_kernels_bits() {
        if !(simd() && f16c() && crate::engine::simd::CpuFeatures::get().avx512f) {
            eprintln!("no AVX-512F here: the 512-bit attention kernels are not run");
            return;
        }
        let vec = |n: usize| randn(&[n]).to_vec1::<f32>().unwrap();
        for d in [64usize, 128, 40, 24, 16, 8] {
            let n = 37;
            let stride = d + 1;
            let (w0, w1, w2, v) = (vec(n), vec(n), vec(n), vec(n * stride));
            let v = &v[..(n - 1) * stride + d];
            let start = vec(d);
            // One query, from zero and onto what `out` holds.
            for accumulate in [false, true] {
                let (mut a, mut b) = (start.clone(), start.clone());
                // SAFETY: the features were checked; `v` holds every row read.
                unsafe {
                    avx2::weighted_sum(&w0, v, stride, &mut a, accumulate);
                    avx512::weighted_sum(&w0, v, stride, &mut b, accumulate);
                }
                assert_eq!(bits(&a), bits(&b), "weighted_sum d={d} {accumulate}");
            }
            // Two queries over f32 values.
            let (mut a0, mut a1, mut b0, mut b1) = (start.clone(), vec(d), start.clone(), vec(d));
            b1.copy_from_slice(&a1);
            // SAFETY: as above.
            unsafe {
                avx2::weighted_sum2(&w0, &w1, v, stride, &mut a0, &mut a1);
                avx512::weighted_sum2(&w0, &w1, v, stride, &mut b0, &mut b1);
            }
            assert_eq!(
                (bits(&a0), bits(&a1)),
                (bits(&b0), bits(&b1)),
                "weighted_sum2 d={d}"
            );
            // Up to three queries over f16 values.
            let halves: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
            let mut a = [start.clone(), vec(d), vec(d)];
            let mut b = a.clone();
            let [a0, a1, a2] = &mut a;
            let [b0, b1, b2] = &mut b;
            let (pa, pb) = (
                [a0.as_mut_ptr(), a1.as_mut_ptr(), a2.as_mut_ptr()],
                [b0.as_mut_ptr(), b1.as_mut_ptr(), b2.as_mut_ptr()],
            );
            let ws = [&w0[..], &w1[..], &w2[..]];
            // SAFETY: as above; each output holds `d` values.
            unsafe {
                avx2::weighted_sums_f16(ws, &halves, stride, d, pa);
                avx512::weighted_sums_f16(ws, &halves, stride, d, pb);
                avx2::weighted_sums_f16([ws[0]], &halves, stride, d, [pa[1]]);
                avx512::weighted_sums_f16([ws[0]], &halves, stride, d, [pb[1]]);
            }
            assert_eq!(
                a.iter().map(|x| bits(x)).collect::<Vec<_>>(),
                b.iter().map(|x| bits(x)).collect::<Vec<_>>(),
                "weighted_sums_f16 d={d}"
            );
            // Two queries' scores of eight keys.
            let (q0, q1) = (vec(d), vec(d));
            let keys: Vec<Vec<f32>> = (0..8).map(|_| vec(d)).collect();
            let block: [&[f32]; 8] = std::array::from_fn(|j| &keys[j][..]);
            let (mut s0, mut s1) = (vec![0f32; 8], vec![0f32; 8]);
            let (mut t0, mut t1) = (vec![0f32; 8], vec![0f32; 8]);
            // SAFETY: as above; every slice has `d` values, the outputs 4 or 8.
            unsafe {
                for half in [0, 4] {
                    let four: &[&[f32]; 4] = block[half..half + 4].try_into().unwrap();
                    let (o0, o1) = (&mut s0[half..half + 4], &mut s1[half..half + 4]);
                    avx2::dot2x4(&q0, &q1, four, 0.125, o0, o1);
                }
                avx512::dot2x8(&q0, &q1, &block, 0.125, &mut t0, &mut t1);
            }
            assert_eq!(
                (bits(&s0), bits(&s1)),
                (bits(&t0), bits(&t1)),
                "dot2x8 d={d}"
            );
        }
    }

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }

    #[test]
    fn blocked_kernels_give_the_per_position_bits() {
        let simd = simd();
        let buf = &mut KvWork::default();
        for d in [64usize, 128, 40, 12] {
            // Two blocks of keys, eight at once (with SIMD) and the remainder: each score is
            // `dot`'s.
            let (q, keys) = (randn(&[d]), randn(&[VALUE_BLOCK + 11, d]));
            let q = q.to_vec1::<f32>().unwrap();
            let keys = keys.to_vec2::<f32>().unwrap();
            let flat = keys.concat();
            let seg = Segment {
                keys: Kv::F32(&flat),
                values: Kv::F32(&[]),
                kstride: d,
                vstride: d,
                n: keys.len(),
            };
            let (len, from) = (keys.len() + 3, 2);
            // Three queries: a pair (one pass over the keys for both) and one alone.
            let mut scores = vec![f32::NAN; 3 * len];
            let twice: Vec<f32> = q.iter().map(|x| 2.0 * x).collect();
            let queries = [q.clone(), q.iter().map(|x| -x).collect(), twice].concat();
            group_scores(simd, &queries, d, &seg, 0.5, &mut scores, len, from, buf);
            for (j, key) in keys.iter().enumerate() {
                for (g, q) in queries.chunks(d).enumerate() {
                    assert_eq!(
                        scores[g * len + from + j].to_bits(),
                        (dot(simd, q, key) * 0.5).to_bits(),
                        "d={d} query {g} key {j}"
                    );
                }
            }
            // f16 keys score as the f32 values they hold.
            let halves: Vec<f16> = flat.iter().map(|&x| f16::from_f32(x)).collect();
            let widened: Vec<f32> = halves.iter().map(|x| x.to_f32()).collect();
            let scored = |keys: Kv| {
                let mut scores = vec![f32::NAN; 3 * len];
                let seg = Segment { keys, ..seg };
                group_scores(
                    simd,
                    &queries,
                    d,
                    &seg,
                    0.5,
                    &mut scores,
                    len,
                    from,
                    &mut KvWork::default(),
                );
                scores.iter().map(|s| s.to_bits()).collect::<Vec<_>>()
            };
            assert_eq!(scored(Kv::F16(&halves)), scored(Kv::F32(&widened)), "d={d}");
            // Rows 5 apart in one buffer, as cache rows with a stride.
            let stride = d + 5;
            let v: Vec<f32> = (0..6 * stride)
                .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
                .collect();
            let w = [0.1f32, 0.25, 0.05, 0.3, 0.2, 0.1];
            let mut out = vec![f32::NAN; d];
            weighted_sum(simd, &w, &v, stride, &mut out, false);
            // In two pieces, the second accumulating: the same bits.
            let mut halves = vec![f32::NAN; d];
            weighted_sum(simd, &w[..2], &v, stride, &mut halves, false);
            weighted_sum(simd, &w[2..], &v[2 * stride..], stride, &mut halves, true);
            assert_eq!(halves, out, "d={d} in two pieces");
            // Position order from zero, one multiply-add (or multiply, add) per term.
            let mut expect = vec![0f32; d];
            for (p, &wp) in w.iter().enumerate() {
                for (e, x) in expect.iter_mut().zip(&v[p * stride..][..d]) {
                    *e = if simd && d % 8 == 0 {
                        wp.mul_add(*x, *e)
                    } else {
                        *e + wp * x
                    };
                }
            }
            assert_eq!(out, expect, "d={d}");
            // Three queries' weights over one segment (a pair, then one), from two offsets.
            let seg = Segment {
                keys: Kv::F32(&[]),
                values: Kv::F32(&v),
                kstride: stride,
                vstride: stride,
                n: w.len(),
            };
            let len = w.len() + 1;
            let weights: Vec<f32> = (0..3 * len).map(|i| ((i * 13) % 7) as f32 / 7.0).collect();
            let mut together = vec![0.5f32; 3 * d];
            group_values(simd, &seg, &weights, len, 1, 0..3, &mut together, d, buf);
            for j in 0..3 {
                let mut one = vec![0.5f32; d];
                let wj = &weights[j * len + 1..][..w.len()];
                weighted_sum(simd, wj, &v, stride, &mut one, true);
                assert_eq!(&together[j * d..][..d], &one[..], "d={d} query {j}");
            }
            // f16 values weigh in as the f32 values they hold.
            let halves: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
            let widened: Vec<f32> = halves.iter().map(|x| x.to_f32()).collect();
            let summed = |values: Kv| {
                let mut out = vec![0.5f32; 3 * d];
                let seg = Segment { values, ..seg };
                group_values(
                    simd,
                    &seg,
                    &weights,
                    len,
                    1,
                    0..3,
                    &mut out,
                    d,
                    &mut KvWork::default(),
                );
                out
            };
            assert_eq!(summed(Kv::F16(&halves)), summed(Kv::F32(&widened)), "d={d}");
        }
    }

    #[test]
    fn a_shared_prefix_gives_the_bits_of_copied_rows() {
        let (rows, d) = (3, 64);
        for (shared, before, seq) in [(7usize, 2usize, 1usize), (5, 0, 3), (0, 4, 2), (9, 3, 1)] {
            let pos = shared + before;
            let q = randn(&[rows, HEADS, seq, d]);
            let (pk, pv) = (randn(&[1, KV, shared, d]), randn(&[1, KV, shared, d]));
            let own = before + seq;
            let (k, v) = (randn(&[rows, KV, own, d]), randn(&[rows, KV, own, d]));
            let whole = |p: &Tensor, t: &Tensor| {
                Tensor::cat(&[&p.repeat((rows, 1, 1, 1)).unwrap(), t], 2).unwrap()
            };
            let copied = attend_causal(&q, &whole(&pk, &k), &whole(&pv, &v), pos).unwrap();
            let after = attend_causal_after(&q, Some((&pk, &pv)), &k, &v, pos).unwrap();
            assert_eq!(max_diff(&after, &copied), 0.0, "shared {shared}, seq {seq}");
        }
        let (pk, k) = (randn(&[2, KV, 3, 64]), randn(&[1, KV, 2, 64]));
        let q = randn(&[1, HEADS, 1, 64]);
        assert!(attend_causal_after(&q, Some((&pk, &pk)), &k, &k, 4).is_err());
    }

    /// (q, k, v, prefix, pos) each.
    type GroupInputs<'a> = (
        Tensor,
        Tensor,
        Tensor,
        Option<(&'a Tensor, &'a Tensor)>,
        usize,
    );

    fn query_groups<'a>(inputs: &'a [GroupInputs<'a>]) -> Vec<QueryGroup<'a>> {
        inputs
            .iter()
            .map(|(q, k, v, prefix, pos)| QueryGroup {
                q,
                prefix: *prefix,
                k,
                v,
                pos: *pos,
            })
            .collect()
    }

    #[test]
    fn decode_groups_attended_together_give_each_groups_bits_alone() {
        let d = 64;
        let (pk, pv) = (randn(&[1, KV, 9, d]), randn(&[1, KV, 9, d]));
        let (pk2, pv2) = (randn(&[1, KV, 5, d]), randn(&[1, KV, 5, d]));
        // (rows, shared prefix, own positions): three groups read one prefix (17 rows: more
        // than a task takes), one another, one none.
        let specs = [
            (3, Some((&pk, &pv)), 4),
            (1, Some((&pk, &pv)), 1),
            (2, None, 6),
            (1, Some((&pk2, &pv2)), 3),
            (17, Some((&pk, &pv)), 2),
        ];
        let inputs: Vec<_> = specs
            .iter()
            .map(|&(rows, prefix, own)| {
                let shared = prefix.map_or(0, |(k, _): (&Tensor, &Tensor)| k.dim(2).unwrap());
                let kv = || randn(&[rows, KV, own, d]);
                (
                    randn(&[rows, HEADS, 1, d]),
                    kv(),
                    kv(),
                    prefix,
                    shared + own - 1,
                )
            })
            .collect();
        let groups = query_groups(&inputs);
        let together = attend_decode(&groups).unwrap();
        let mut r0 = 0;
        for (i, g) in groups.iter().enumerate() {
            let rows = g.q.dim(0).unwrap();
            let alone = attend_causal_after(g.q, g.prefix, g.k, g.v, g.pos).unwrap();
            let mine = together.narrow(0, r0, rows).unwrap();
            assert_eq!(max_diff(&mine, &alone), 0.0, "group {i} among the others");
            // By itself (one row alone: single heads spread over the threads).
            let by_itself = attend_decode(&groups[i..i + 1]).unwrap();
            assert_eq!(max_diff(&by_itself, &alone), 0.0, "group {i} by itself");
            r0 += rows;
        }
        assert_eq!(r0, together.dim(0).unwrap());
        // A query position past the keys it is given is refused.
        let wrong = QueryGroup {
            pos: groups[0].pos + 1,
            ..groups[0]
        };
        assert!(attend_decode(&[wrong]).is_err());
        assert!(attend_decode(&[]).is_err());
    }

    #[test]
    fn prefill_groups_attended_together_give_each_positions_decode_bits() {
        let d = 64;
        let (pk, pv) = (randn(&[1, KV, 9, d]), randn(&[1, KV, 9, d]));
        // (rows, shared prefix, positions before the queries after it, query positions):
        // blocks of positions cut inside a group, several rows, none and two prefixes.
        let specs = [
            (1, Some((&pk, &pv)), 0, 23),
            (2, Some((&pk, &pv)), 5, 9),
            (1, None, 0, 17),
            (3, None, 4, 2),
            (1, Some((&pk, &pv)), 2, 1 + 8),
        ];
        let inputs: Vec<_> = specs
            .iter()
            .map(|&(rows, prefix, before, seq)| {
                let shared = prefix.map_or(0, |(k, _): (&Tensor, &Tensor)| k.dim(2).unwrap());
                let kv = || randn(&[rows, KV, before + seq, d]);
                (
                    randn(&[rows, HEADS, seq, d]),
                    kv(),
                    kv(),
                    prefix,
                    shared + before,
                )
            })
            .collect();
        let groups = query_groups(&inputs);
        let together = attend_prefill(&groups).unwrap();
        for (i, (g, y)) in groups.iter().zip(&together).enumerate() {
            let (seq, shared) = (
                g.q.dim(2).unwrap(),
                g.pos + g.q.dim(2).unwrap() - g.k.dim(2).unwrap(),
            );
            // Each position alone, as a decode step reads it.
            let steps: Vec<Tensor> = (0..seq)
                .map(|t| {
                    let q = g.q.narrow(2, t, 1).unwrap();
                    let n = g.pos + t + 1 - shared;
                    let (k, v) = (g.k.narrow(2, 0, n).unwrap(), g.v.narrow(2, 0, n).unwrap());
                    attend_causal_after(&q, g.prefix, &k, &v, g.pos + t).unwrap()
                })
                .collect();
            let stepwise = Tensor::cat(&steps, 1).unwrap();
            assert_eq!(max_diff(y, &stepwise), 0.0, "group {i}");
            let alone = attend_causal_after(g.q, g.prefix, g.k, g.v, g.pos).unwrap();
            assert_eq!(max_diff(y, &alone), 0.0, "group {i} alone");
        }
        // Queries before the end of their prefix are refused here.
        let early = QueryGroup {
            pos: 3,
            k: &inputs[0].1.narrow(2, 0, 3 + 23 - 9).unwrap(),
            ..groups[0]
        };
        assert!(attend_prefill(&[early]).is_err());
    }

    #[test]
    fn own_f16_keys_and_values_read_as_they_are_give_the_widened_bits() {
        // A row's own f16 keys and values go straight into the kernels (up to three queries
        // at once, four keys at a time): every head ratio (1, 2, 3 queries a pass and what
        // is left over), head sizes with and without a whole 32-column pass, every count of
        // leftover keys, with and without a shared prefix, one row (single heads a task)
        // and several.
        let bits = |t: &Tensor| {
            let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        };
        for (heads, kv) in [(1, 1), (2, 1), (3, 1), (4, 2), (5, 1), (7, 1), (6, 2)] {
            for d in [64, 40] {
                for own in [1, 2, 3, 4, 5, 6, 7, 8, 13] {
                    for (rows, shared) in [(1, 0), (3, 0), (1, 6), (3, 9)] {
                        let f16s = |shape: &[usize]| to_f16(&randn(shape)).unwrap();
                        let (k16, v16) = (f16s(&[rows, kv, own, d]), f16s(&[rows, kv, own, d]));
                        let (pk16, pv16) = (f16s(&[1, kv, shared, d]), f16s(&[1, kv, shared, d]));
                        let f32s = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
                        let (k32, v32, pk32, pv32) =
                            (f32s(&k16), f32s(&v16), f32s(&pk16), f32s(&pv16));
                        let q = randn(&[rows, heads, 1, d]);
                        let group = |k, v, pk, pv| QueryGroup {
                            q: &q,
                            prefix: (shared > 0).then_some((pk, pv)),
                            k,
                            v,
                            pos: shared + own - 1,
                        };
                        let g16 = group(&k16, &v16, &pk16, &pv16);
                        let g32 = group(&k32, &v32, &pk32, &pv32);
                        let case = format!("{heads} heads over {kv}, d {d}, {own} own, {rows} rows, {shared} shared");
                        let decoded = bits(&attend_decode(&[g16]).unwrap());
                        assert_eq!(decoded, bits(&attend_decode(&[g32]).unwrap()), "{case}");
                        let alone = attend_causal_after(g16.q, g16.prefix, g16.k, g16.v, g16.pos);
                        assert_eq!(decoded, bits(&alone.unwrap()), "{case}: alone");
                    }
                }
            }
        }
    }

    #[test]
    fn f16_keys_and_values_give_the_bits_of_f32_ones_holding_their_values() {
        let d = 64;
        // As a cache stores them: f16, and the same values widened to f32.
        let both = |shape: &[usize]| {
            let h = to_f16(&randn(shape)).unwrap();
            let f = h.to_dtype(DType::F32).unwrap();
            (h, f)
        };
        // Prefix and own positions past a block of values (`VALUE_BLOCK`).
        let (shared, rows) = (VALUE_BLOCK + 9, 3);
        let ((pk16, pk32), (pv16, pv32)) = (both(&[1, KV, shared, d]), both(&[1, KV, shared, d]));
        let own = VALUE_BLOCK + 5;
        let ((k16, k32), (v16, v32)) = (both(&[rows, KV, own, d]), both(&[rows, KV, own, d]));
        let bits = |t: &Tensor| {
            let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        };
        // A decode step (the last position), alone and as a group.
        let pos = shared + own - 1;
        let q = randn(&[rows, HEADS, 1, d]);
        let step = |k, v, pk, pv| QueryGroup {
            q: &q,
            prefix: Some((pk, pv)),
            k,
            v,
            pos,
        };
        let (g16, g32) = (
            step(&k16, &v16, &pk16, &pv16),
            step(&k32, &v32, &pk32, &pv32),
        );
        let alone = |g: QueryGroup| attend_causal_after(g.q, g.prefix, g.k, g.v, g.pos).unwrap();
        assert_eq!(bits(&alone(g16)), bits(&alone(g32)), "decode alone");
        let grouped = |g| attend_decode(&[g]).unwrap();
        assert_eq!(bits(&grouped(g16)), bits(&grouped(g32)), "decode grouped");
        // A prompt piece after its prefix.
        let seq = 11;
        let q = randn(&[rows, HEADS, seq, d]);
        let piece = |k: &Tensor, v: &Tensor, pk, pv| {
            let (k, v) = (k.narrow(2, 0, seq).unwrap(), v.narrow(2, 0, seq).unwrap());
            let g = QueryGroup {
                q: &q,
                prefix: Some((pk, pv)),
                k: &k,
                v: &v,
                pos: shared,
            };
            bits(&attend_prefill(&[g]).unwrap()[0])
        };
        assert_eq!(
            piece(&k16, &v16, &pk16, &pv16),
            piece(&k32, &v32, &pk32, &pv32),
            "prefill"
        );
        // Two pieces in one pass whose prefixes start at the same keys, one shorter: each
        // reads its own length.
        let short = shared - 7;
        let pair = |k: &Tensor, v: &Tensor, pk: &Tensor, pv: &Tensor| {
            let (k, v) = (k.narrow(2, 0, seq).unwrap(), v.narrow(2, 0, seq).unwrap());
            let (sk, sv) = (
                pk.narrow(2, 0, short).unwrap(),
                pv.narrow(2, 0, short).unwrap(),
            );
            let long = QueryGroup {
                q: &q,
                prefix: Some((pk, pv)),
                k: &k,
                v: &v,
                pos: shared,
            };
            let brief = QueryGroup {
                prefix: Some((&sk, &sv)),
                pos: short,
                ..long
            };
            // Either first (the first one's copy is the one a widened pass keeps).
            let ys = attend_prefill(&[long, brief]).unwrap();
            let sy = attend_prefill(&[brief, long]).unwrap();
            [&ys[0], &ys[1], &sy[0], &sy[1]].map(bits)
        };
        assert_eq!(
            pair(&k16, &v16, &pk16, &pv16),
            pair(&k32, &v32, &pk32, &pv32),
            "prefixes of two lengths"
        );
    }
}
