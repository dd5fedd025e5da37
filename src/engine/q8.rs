//! Int8 linear layers with our own CPU kernel, replacing candle's quantized matmul
//! for the llama linears when the weights are Q8_0 or Q4_1.
//!
//! Q4_1 blocks (`w = d·q + m`, 4-bit unsigned `q`) are read as they are, which is what bounds
//! decoding one row: 0.6× the bytes of Q8_0. The nibbles are the unsigned operand of
//! `maddubs`/`vpdpbusd` against the signed int8 activations, and a block's dot product is
//! `(d_w·d_x)·Σq_w·q_x + m_w·(d_x·Σq_x)` (ggml's q4_1·q8_1). The Q8_0 layout follows.
//!
//! Weights: blocks of 32 int8 values with an f16 scale (exactly the values of ggml's Q8_0),
//! stored in tiles of 8 output columns: for each tile and block, 256 bytes in which every 32-byte
//! register holds 4 consecutive k-values of each of the 8 columns, followed (in a separate
//! array) by the 8 columns' scales. Activations are quantized once per call, one f32 scale per
//! row and block. The AVX2 kernel broadcasts 4 activation bytes against such a register
//! (`maddubs` with the sign trick, then `madd`), which yields the 8 columns' partial dot products
//! in the 8 lanes: no horizontal sums, one weight load shared by up to 4 activation rows.
//!
//! Every output element is computed by the same instructions in the same order whatever the
//! number of rows in the call and whichever thread computes it, so a row's result never depends
//! on the other rows of the batch (batched sampling equals single-stream sampling).
//!
//! Where the CPU has AVX-512 VNNI, one `vpdpbusd` replaces the sign/`maddubs`/`madd`/add chain:
//! it multiplies unsigned by signed bytes, so the activations are offset by 128 and each block's
//! `128 · Σw` (kept per column at load) is subtracted. Integer sums are exact either way, so both
//! kernels give the same bits.

use std::cell::Cell;
use std::ops::Range;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Result, Storage, Tensor};

/// Values per block (as in ggml's Q8_0).
const QK: usize = 32;
/// Output columns per tile.
const NC: usize = 8;
/// Bytes of weights per (tile, block).
const TILE_BLOCK: usize = QK * NC;
/// Activation rows that share one pass over a weight tile.
const MR: usize = 4;
/// Bytes of one ggml `block_q8_0`: an f16 scale then 32 int8 values.
const Q8_0_BLOCK_BYTES: usize = 2 + QK;
/// Bytes of one ggml `block_q4_1`: f16 scale, f16 minimum, then 32 nibbles.
const Q4_1_BLOCK_BYTES: usize = 4 + QK / 2;
/// Bytes of Q4_1 nibbles per (tile, block).
const TILE_BLOCK4: usize = QK / 2 * NC;
/// Rows from which the VNNI kernel is used.
#[cfg(target_arch = "x86_64")]
const VNNI_MIN_ROWS: usize = 4;
/// Rows from which the VNNI kernel is used on Q4_1 weights.
#[cfg(target_arch = "x86_64")]
const VNNI_Q4_MIN_ROWS: usize = 1;
/// Rows from which the VNNI kernel runs two tiles at once on 512-bit registers (one row,
/// bound by reading the weights, measured 5 % slower that way).
#[cfg(target_arch = "x86_64")]
const WIDE_MIN_ROWS: usize = 2;
/// Multiply-adds below which a call stays on one thread.
const PAR_MIN_MACS: usize = 1 << 17;

#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([i8; 64]);

/// A linear layer `y = x · Wᵀ` with int8 weights, possibly several layers that read the same
/// input fused into one (see [`Q8Linear::concat`]).
pub struct Q8Linear {
    k: usize,
    /// Output sizes of the fused parts (one entry for a plain layer).
    parts: Vec<usize>,
    /// First tile of each part, plus the total number of tiles at the end.
    part_tiles: Vec<usize>,
    blocks: Blocks,
}

/// The tiles' weights in one of two block formats (all parts of a layer share one).
#[derive(Clone)]
enum Blocks {
    /// ggml's Q8_0 values: `tiles · (k/32) · 256` bytes; `scales` f16 bits, 8 per (tile,
    /// block); `sums` the sum of each column's 32 weights in each block, laid out as `scales`:
    /// the VNNI kernel's correction for its offset activations.
    Q8_0 {
        qs: Vec<Line>,
        scales: Vec<u16>,
        sums: Vec<i16>,
    },
    /// ggml's Q4_1 values (`w = d·q + m`, `q` in 0..16), read as they are: no re-quantization
    /// and 0.6× the bytes of Q8_0, what bounds decoding a row. `qs`: `tiles · (k/32) · 128`
    /// bytes, in which every 32-byte register holds 4 consecutive k-values of each of the 8
    /// columns in its low nibbles and the 4 values 16 further on in its high nibbles (ggml's
    /// own pairing); `dm`: per (tile, block) the 8 columns' f16 scales `d`, then their 8 f16
    /// minimums `m`.
    Q4_1 { qs: Vec<Line>, dm: Vec<u16> },
}

impl Blocks {
    fn format(&self) -> GgmlDType {
        match self {
            Blocks::Q8_0 { .. } => GgmlDType::Q8_0,
            Blocks::Q4_1 { .. } => GgmlDType::Q4_1,
        }
    }
}

impl std::fmt::Debug for Q8Linear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Q8Linear")
            .field("k", &self.k)
            .field("parts", &self.parts)
            .field("format", &self.blocks.format())
            .finish()
    }
}

impl Q8Linear {
    /// From an (n_out, k) quantized tensor: Q8_0 and Q4_1 blocks are taken as they are, other
    /// types are dequantized and re-quantized to Q8_0 (see [`Q8Linear::q8_0_from_qtensor`]).
    pub fn from_qtensor(t: &QTensor) -> Result<Self> {
        if t.dtype() == GgmlDType::Q4_1 {
            let (n, k) = t.shape().dims2()?;
            check_k(k)?;
            return Self::from_q4_1_bytes(n, k, &t.data()?);
        }
        Self::q8_0_from_qtensor(t)
    }

    /// From an (n_out, k) quantized tensor, always in Q8_0: its blocks as they are, other types
    /// dequantized and re-quantized by candle's arithmetic (the same values candle's own Q8_0
    /// matmul would use).
    pub fn q8_0_from_qtensor(t: &QTensor) -> Result<Self> {
        let (n, k) = t.shape().dims2()?;
        check_k(k)?;
        if t.dtype() == GgmlDType::Q8_0 {
            return Self::from_q8_0_bytes(n, k, &t.data()?);
        }
        Self::from_tensor(&t.dequantize(&Device::Cpu)?)
    }

    /// The weights' block format: `Q8_0` or `Q4_1`.
    pub fn format(&self) -> GgmlDType {
        self.blocks.format()
    }

    /// From an (n_out, k) float tensor, quantized to Q8_0 with candle's arithmetic (the same
    /// blocks `QTensor::quantize` makes, tested), straight into our layout and in parallel:
    /// rl_train re-quantizes the policy after every update.
    pub fn from_tensor(w: &Tensor) -> Result<Self> {
        let (n, k) = w.dims2()?;
        check_k(k)?;
        let w = w
            .to_dtype(DType::F32)?
            .to_device(&Device::Cpu)?
            .contiguous()?;
        let (storage, layout) = w.storage_and_layout();
        let Storage::Cpu(cpu) = &*storage else {
            candle_core::bail!("Q8Linear quantizes on the CPU only");
        };
        let xs = &cpu.as_slice::<f32>()?[layout.start_offset()..][..n * k];
        Ok(Self::quantized(n, k, xs))
    }

    fn quantized(n: usize, k: usize, xs: &[f32]) -> Self {
        use rayon::prelude::*;
        let nb = k / QK;
        let tiles = n.div_ceil(NC);
        let mut qs = vec![Line([0; 64]); tiles * nb * TILE_BLOCK / 64];
        let mut scales = vec![0u16; tiles * nb * NC];
        let mut sums = vec![0i16; tiles * nb * NC];
        let quantize_tile = |t: usize, q: &mut [i8], scales: &mut [u16], sums: &mut [i16]| {
            for cc in 0..NC.min(n - t * NC) {
                let row = &xs[(t * NC + cc) * k..][..k];
                for (b, x) in row.chunks_exact(QK).enumerate() {
                    // As ggml's and candle's reference Q8_0: d = max|x| / 127, round half away.
                    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
                    let d = amax / 127.0;
                    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                    scales[b * NC + cc] = half::f16::from_f32(d).to_bits();
                    let dst = &mut q[b * TILE_BLOCK..][..TILE_BLOCK];
                    let mut sum = 0i16;
                    for (i, v) in x.iter().enumerate() {
                        let v = (v * id).round() as i8;
                        dst[(i / 4) * 32 + cc * 4 + i % 4] = v;
                        sum += i16::from(v);
                    }
                    sums[b * NC + cc] = sum;
                }
            }
        };
        super::team::compute_threads();
        line_bytes_mut(&mut qs)
            .par_chunks_mut(nb * TILE_BLOCK)
            .zip(scales.par_chunks_mut(nb * NC))
            .zip(sums.par_chunks_mut(nb * NC))
            .enumerate()
            .for_each(|(t, ((q, sc), su))| quantize_tile(t, q, sc, su));
        Self {
            k,
            parts: vec![n],
            part_tiles: vec![0, tiles],
            blocks: Blocks::Q8_0 { qs, scales, sums },
        }
    }

    fn from_q8_0_bytes(n: usize, k: usize, data: &[u8]) -> Result<Self> {
        let nb = k / QK;
        if data.len() != n * nb * Q8_0_BLOCK_BYTES {
            candle_core::bail!(
                "Q8_0 data of {} bytes does not hold a ({n}, {k}) matrix",
                data.len()
            );
        }
        let tiles = n.div_ceil(NC);
        let mut qs = vec![Line([0; 64]); tiles * nb * TILE_BLOCK / 64];
        let mut scales = vec![0u16; tiles * nb * NC];
        let mut sums = vec![0i16; tiles * nb * NC];
        {
            let q = line_bytes_mut(&mut qs);
            for c in 0..n {
                let (t, cc) = (c / NC, c % NC);
                for b in 0..nb {
                    let blk = &data[(c * nb + b) * Q8_0_BLOCK_BYTES..][..Q8_0_BLOCK_BYTES];
                    let tb = t * nb + b;
                    scales[tb * NC + cc] = u16::from_le_bytes([blk[0], blk[1]]);
                    sums[tb * NC + cc] = blk[2..].iter().map(|&v| i16::from(v as i8)).sum();
                    let dst = &mut q[tb * TILE_BLOCK..][..TILE_BLOCK];
                    for g in 0..QK / 4 {
                        for j in 0..4 {
                            dst[g * 32 + cc * 4 + j] = blk[2 + g * 4 + j] as i8;
                        }
                    }
                }
            }
        }
        Ok(Self {
            k,
            parts: vec![n],
            part_tiles: vec![0, tiles],
            blocks: Blocks::Q8_0 { qs, scales, sums },
        })
    }

    fn from_q4_1_bytes(n: usize, k: usize, data: &[u8]) -> Result<Self> {
        let nb = k / QK;
        if data.len() != n * nb * Q4_1_BLOCK_BYTES {
            candle_core::bail!(
                "Q4_1 data of {} bytes does not hold a ({n}, {k}) matrix",
                data.len()
            );
        }
        let tiles = n.div_ceil(NC);
        let mut qs = vec![Line([0; 64]); tiles * nb * TILE_BLOCK4 / 64];
        let mut dm = vec![0u16; tiles * nb * 2 * NC];
        {
            let q = line_bytes_mut(&mut qs);
            for c in 0..n {
                let (t, cc) = (c / NC, c % NC);
                for b in 0..nb {
                    let blk = &data[(c * nb + b) * Q4_1_BLOCK_BYTES..][..Q4_1_BLOCK_BYTES];
                    let tb = t * nb + b;
                    dm[tb * 2 * NC + cc] = u16::from_le_bytes([blk[0], blk[1]]);
                    dm[tb * 2 * NC + NC + cc] = u16::from_le_bytes([blk[2], blk[3]]);
                    // ggml's byte i holds value i (low nibble) and value i + 16 (high).
                    let dst = &mut q[tb * TILE_BLOCK4..][..TILE_BLOCK4];
                    for g in 0..QK / 8 {
                        for j in 0..4 {
                            dst[g * 32 + cc * 4 + j] = blk[4 + g * 4 + j] as i8;
                        }
                    }
                }
            }
        }
        Ok(Self {
            k,
            parts: vec![n],
            part_tiles: vec![0, tiles],
            blocks: Blocks::Q4_1 { qs, dm },
        })
    }

    /// Fuses layers that read the same input into one: [`Q8Linear::forward_parts`] then returns
    /// their outputs, each exactly what the layer alone would give. The layers must share the
    /// input size and the block format.
    pub fn concat(layers: Vec<Q8Linear>) -> Result<Self> {
        let mut layers = layers.into_iter();
        let Some(mut out) = layers.next() else {
            candle_core::bail!("no layers to concatenate");
        };
        for l in layers {
            if l.k != out.k {
                candle_core::bail!("concatenated layers must share the input size");
            }
            let base = out.tiles();
            match (&mut out.blocks, l.blocks) {
                (
                    Blocks::Q8_0 { qs, scales, sums },
                    Blocks::Q8_0 {
                        qs: q,
                        scales: s,
                        sums: u,
                    },
                ) => {
                    qs.extend_from_slice(&q);
                    scales.extend_from_slice(&s);
                    sums.extend_from_slice(&u);
                }
                (Blocks::Q4_1 { qs, dm }, Blocks::Q4_1 { qs: q, dm: d }) => {
                    qs.extend_from_slice(&q);
                    dm.extend_from_slice(&d);
                }
                _ => candle_core::bail!("concatenated layers must share the block format"),
            }
            out.parts.extend_from_slice(&l.parts);
            out.part_tiles
                .extend(l.part_tiles[1..].iter().map(|t| base + t));
        }
        Ok(out)
    }

    /// (first byte, length) of each of the layer's weight buffers.
    pub(crate) fn weight_memory(&self) -> Vec<(usize, usize)> {
        fn span<T>(v: &[T]) -> (usize, usize) {
            (v.as_ptr() as usize, std::mem::size_of_val(v))
        }
        match &self.blocks {
            Blocks::Q8_0 { qs, scales, sums } => vec![span(qs), span(scales), span(sums)],
            Blocks::Q4_1 { qs, dm } => vec![span(qs), span(dm)],
        }
    }

    /// Input size.
    pub fn in_dim(&self) -> usize {
        self.k
    }

    /// Total output size (all parts).
    pub fn out_dim(&self) -> usize {
        self.parts.iter().sum()
    }

    /// Output sizes of the fused parts.
    pub fn parts(&self) -> &[usize] {
        &self.parts
    }

    fn tiles(&self) -> usize {
        *self.part_tiles.last().expect("part_tiles is never empty")
    }

    /// The weights as f32, (out_dim, k), every part stacked (the values ggml's dequantization
    /// gives).
    pub fn dequantize(&self) -> Result<Tensor> {
        let nb = self.k / QK;
        let mut w = Vec::with_capacity(self.out_dim() * self.k);
        for (p, &n) in self.parts.iter().enumerate() {
            for c in 0..n {
                let (t, cc) = (self.part_tiles[p] + c / NC, c % NC);
                for b in 0..nb {
                    let tb = t * nb + b;
                    match &self.blocks {
                        Blocks::Q8_0 { qs, scales, .. } => {
                            let q = &line_bytes(qs)[tb * TILE_BLOCK..][..TILE_BLOCK];
                            let d = f16_to_f32(scales[tb * NC + cc]);
                            for i in 0..QK {
                                w.push(f32::from(q[(i / 4) * 32 + cc * 4 + i % 4]) * d);
                            }
                        }
                        Blocks::Q4_1 { qs, dm } => {
                            let q = &line_bytes(qs)[tb * TILE_BLOCK4..][..TILE_BLOCK4];
                            let d = f16_to_f32(dm[tb * 2 * NC + cc]);
                            let m = f16_to_f32(dm[tb * 2 * NC + NC + cc]);
                            for i in 0..QK {
                                let j = i % (QK / 2);
                                let byte = q[(j / 4) * 32 + cc * 4 + j % 4] as u8;
                                let v = if i < QK / 2 { byte & 0xf } else { byte >> 4 };
                                w.push(f32::from(v) * d + m);
                            }
                        }
                    }
                }
            }
        }
        Tensor::from_vec(w, (self.out_dim(), self.k), &Device::Cpu)
    }

    /// `x` (…, k) → (…, out_dim).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (mut outs, lead) = self.compute(x, kernel())?;
        let out = if outs.len() == 1 {
            outs.swap_remove(0)
        } else {
            let m = lead.iter().product::<usize>();
            let mut out = Vec::with_capacity(m * self.out_dim());
            for r in 0..m {
                for (o, &n) in outs.iter().zip(&self.parts) {
                    out.extend_from_slice(&o[r * n..(r + 1) * n]);
                }
            }
            out
        };
        let mut shape = lead;
        shape.push(self.out_dim());
        Tensor::from_vec(out, shape, x.device())
    }

    /// `x` (…, k) → one (…, n_p) tensor per fused part.
    pub fn forward_parts(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        let (outs, lead) = self.compute(x, kernel())?;
        outs.into_iter()
            .zip(&self.parts)
            .map(|(o, &n)| {
                let mut shape = lead.clone();
                shape.push(n);
                Tensor::from_vec(o, shape, x.device())
            })
            .collect()
    }

    /// One output buffer per part, and the leading dimensions of `x`.
    fn compute(&self, x: &Tensor, kern: Kernel) -> Result<(Vec<Vec<f32>>, Vec<usize>)> {
        let dims = x.dims();
        let Some((&k, lead)) = dims.split_last() else {
            candle_core::bail!("Q8Linear input is a scalar");
        };
        if k != self.k {
            candle_core::bail!(
                "Q8Linear input {:?} does not end in the layer's input size {}",
                dims,
                self.k
            );
        }
        let lead = lead.to_vec();
        let m: usize = lead.iter().product();
        let x = x.to_dtype(DType::F32)?.contiguous()?;
        let (storage, layout) = x.storage_and_layout();
        let Storage::Cpu(cpu) = &*storage else {
            candle_core::bail!("Q8Linear runs on the CPU only");
        };
        let xs = &cpu.as_slice::<f32>()?[layout.start_offset()..][..m * k];
        let outs = self.matmul(kern, xs, m);
        Ok((outs, lead))
    }

    fn matmul(&self, kern: Kernel, xs: &[f32], m: usize) -> Vec<Vec<f32>> {
        let kern = kern.for_rows(&self.blocks, m);
        let form = match &self.blocks {
            Blocks::Q4_1 { .. } => ActForm::WithSums,
            // x + 128 as unsigned bytes, which `vpdpbusd` multiplies.
            #[cfg(target_arch = "x86_64")]
            Blocks::Q8_0 { .. } if kern.is_vnni() => ActForm::Offset,
            Blocks::Q8_0 { .. } => ActForm::Plain,
        };
        // Taken, not borrowed: a loop that falls back to rayon may run another layer's call
        // on this thread meanwhile, which then quantizes into buffers of its own.
        let mut bufs = ACT_BUFS.with(Cell::take);
        let acts = bufs.quantize(kern, xs, self.k, form);
        // Not zero-filled first (the output head's 3 MB a 16-request step, on one thread):
        // the tiles write every element.
        let mut outs: Vec<Vec<f32>> = self
            .parts
            .iter()
            .map(|&n| Vec::with_capacity(m * n))
            .collect();
        let ptrs: Vec<OutPtr> = outs.iter_mut().map(|o| OutPtr(o.as_mut_ptr())).collect();
        let parallel = m * self.out_dim() * self.k >= PAR_MIN_MACS;
        par_ranges(self.tiles(), parallel, |tiles| {
            // SAFETY: the tile ranges handed out are disjoint, and a tile writes only its own
            // columns of each row; `acts` holds `m` rows of `k` values / `k/32` scales (and,
            // for Q4_1, `k/32` block sums).
            unsafe { self.run_tiles(kern, &acts, m, tiles, &ptrs) }
        });
        for (o, &n) in outs.iter_mut().zip(&self.parts) {
            // SAFETY: the tiles cover every column of every part, and each wrote its columns
            // of all `m` rows (`store_rows`, the scalar kernels), so all `m · n` are set.
            unsafe { o.set_len(m * n) };
        }
        ACT_BUFS.with(|b| b.set(bufs));
        outs
    }

    /// Computes the output columns of `tiles` for all `m` rows.
    ///
    /// # Safety
    /// `outs[p]` must point to `m · parts[p]` writable floats that no one else writes in the
    /// columns of these tiles.
    unsafe fn run_tiles(
        &self,
        kern: Kernel,
        acts: &Acts,
        m: usize,
        tiles: Range<usize>,
        outs: &[OutPtr],
    ) {
        let (nb, k) = (self.k / QK, self.k);
        let (xq, xd) = (acts.q, acts.d);
        let mut p = 0;
        let mut t = tiles.start;
        while t < tiles.end {
            while t >= self.part_tiles[p + 1] {
                p += 1;
            }
            let n = self.parts[p];
            let out = outs[p].0.add((t - self.part_tiles[p]) * NC);
            // Tile `t`'s real columns: the part's from the tile's first on.
            let ncols = |t: usize| NC.min(n - (t - self.part_tiles[p]) * NC);
            // Two tiles of one part at once; a part's odd last tile, or a range's, alone.
            #[cfg(target_arch = "x86_64")]
            if kern == Kernel::VnniWide && t + 1 < tiles.end.min(self.part_tiles[p + 1]) {
                match &self.blocks {
                    Blocks::Q8_0 { qs, scales, sums } => {
                        let pair = [
                            Tile::at(qs, scales, sums, t, nb, ncols(t)),
                            Tile::at(qs, scales, sums, t + 1, nb, ncols(t + 1)),
                        ];
                        vnni::tile_pair([&pair[0], &pair[1]], xq, xd, m, k, out, n);
                    }
                    Blocks::Q4_1 { qs, dm } => {
                        let pair = [
                            Tile4::at(qs, dm, t, nb, ncols(t)),
                            Tile4::at(qs, dm, t + 1, nb, ncols(t + 1)),
                        ];
                        vnni::tile4_pair([&pair[0], &pair[1]], acts, m, k, out, n);
                    }
                }
                t += 2;
                continue;
            }
            match &self.blocks {
                Blocks::Q8_0 { qs, scales, sums } => {
                    let tile = Tile::at(qs, scales, sums, t, nb, ncols(t));
                    match kern {
                        Kernel::Scalar => tile_scalar(&tile, xq, xd, m, k, out, n),
                        #[cfg(target_arch = "x86_64")]
                        Kernel::Avx2 => avx2::tile(&tile, xq, xd, m, k, out, n),
                        #[cfg(target_arch = "x86_64")]
                        Kernel::Vnni | Kernel::VnniWide => vnni::tile(&tile, xq, xd, m, k, out, n),
                    }
                }
                Blocks::Q4_1 { qs, dm } => {
                    let tile = Tile4::at(qs, dm, t, nb, ncols(t));
                    match kern {
                        Kernel::Scalar => tile4_scalar(&tile, acts, m, k, out, n),
                        #[cfg(target_arch = "x86_64")]
                        Kernel::Avx2 => avx2::tile4(&tile, acts, m, k, out, n),
                        #[cfg(target_arch = "x86_64")]
                        Kernel::Vnni | Kernel::VnniWide => vnni::tile4(&tile, acts, m, k, out, n),
                    }
                }
            }
            t += 1;
        }
    }
}

/// Quantized activations: `m` rows of `k` int8 values, one scale per row and block, and for
/// Q4_1 weights each block's `d · Σq` (the minimums' factor).
struct Acts<'a> {
    q: &'a [i8],
    d: &'a [f32],
    sum: &'a [f32],
}

/// What a call's kernels read besides the quantized values and their scales.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum ActForm {
    Plain,
    /// Each block's `d · Σq` (Q4_1 weights: the minimums' factor).
    WithSums,
    /// The values offset by 128 (`x ^ 0x80`), as the unsigned operand of `vpdpbusd`.
    #[cfg(target_arch = "x86_64")]
    Offset,
}

/// Quantized activations of a call, kept per thread between calls: a decode step makes 120
/// of them, whose allocations and zero-fills had been a visible part of the step's serial
/// (one-thread) time.
#[derive(Default)]
struct ActBufs {
    q: Vec<i8>,
    d: Vec<f32>,
    sum: Vec<f32>,
}

thread_local! {
    static ACT_BUFS: Cell<ActBufs> = Cell::new(ActBufs::default());
}

/// Values from which a call's activations are quantized on the compute threads: from a
/// 16-request decode step's (16 rows of 576 or 1536: 2.4 or 7.2 µs on one thread, with the
/// other waiting; the step's int8 layers 7.3–7.6 → 7.0–7.1 ms in `bench kernels`).
const PAR_MIN_QUANT: usize = 1 << 12;

impl ActBufs {
    /// Quantizes the rows of `xs` (`k` values each) as `form` asks.
    fn quantize(&mut self, kern: Kernel, xs: &[f32], k: usize, form: ActForm) -> Acts<'_> {
        let (m, nb) = (xs.len() / k, k / QK);
        let with_sums = form == ActForm::WithSums;
        // The buffers only grow (a step's layers alternate between input sizes), so that
        // no call zero-fills what the last one gave back.
        let q = grown(&mut self.q, m * k);
        let d = grown(&mut self.d, m * nb);
        let sum = grown(&mut self.sum, if with_sums { m * nb } else { 0 });
        let threads = super::team::compute_threads();
        if xs.len() < PAR_MIN_QUANT || threads <= 1 {
            quantize_rows(kern, xs, q, d, sum, form);
        } else {
            let rows = m.div_ceil(4 * threads);
            let sums: Box<dyn Iterator<Item = &mut [f32]>> = if with_sums {
                Box::new(sum.chunks_mut(rows * nb))
            } else {
                Box::new(std::iter::repeat_with(Default::default))
            };
            let mut pieces: Vec<_> = q
                .chunks_mut(rows * k)
                .zip(d.chunks_mut(rows * nb))
                .zip(sums)
                .collect();
            super::team::map_mut(&mut pieces, |i, ((q, d), sum)| {
                let x = &xs[i * rows * k..][..q.len()];
                quantize_rows(kern, x, q, d, sum, form);
            });
        }
        Acts {
            q: &self.q[..m * k],
            d: &self.d[..m * nb],
            sum: &self.sum[..if with_sums { m * nb } else { 0 }],
        }
    }
}

/// The first `n` values of `v`, grown to hold them if it is shorter.
fn grown<T: Copy + Default>(v: &mut Vec<T>, n: usize) -> &mut [T] {
    if v.len() < n {
        v.resize(n, T::default());
    }
    &mut v[..n]
}

fn check_k(k: usize) -> Result<()> {
    if k == 0 || !k.is_multiple_of(QK) {
        candle_core::bail!("Q8Linear needs an input size that is a multiple of {QK}, not {k}");
    }
    Ok(())
}

fn line_bytes(v: &[Line]) -> &[i8] {
    // SAFETY: `Line` is 64 plain bytes without padding.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<i8>(), v.len() * 64) }
}

fn line_bytes_mut(v: &mut [Line]) -> &mut [i8] {
    // SAFETY: as in `line_bytes`.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<i8>(), v.len() * 64) }
}

/// One tile: 8 output columns over the whole input.
struct Tile<'a> {
    wq: &'a [i8],
    ws: &'a [u16],
    sums: &'a [i16],
    nb: usize,
    /// Real (unpadded) columns of the tile.
    ncols: usize,
}

impl<'a> Tile<'a> {
    /// Tile `t` of Q8_0 blocks (`nb` per column).
    fn at(
        qs: &'a [Line],
        scales: &'a [u16],
        sums: &'a [i16],
        t: usize,
        nb: usize,
        ncols: usize,
    ) -> Self {
        Tile {
            wq: &line_bytes(qs)[t * nb * TILE_BLOCK..][..nb * TILE_BLOCK],
            ws: &scales[t * nb * NC..][..nb * NC],
            sums: &sums[t * nb * NC..][..nb * NC],
            nb,
            ncols,
        }
    }
}

/// One Q4_1 tile: 8 output columns over the whole input.
struct Tile4<'a> {
    wq: &'a [i8],
    /// Per block: 8 f16 scales, then 8 f16 minimums.
    dm: &'a [u16],
    nb: usize,
    /// Real (unpadded) columns of the tile.
    ncols: usize,
}

impl<'a> Tile4<'a> {
    /// Tile `t` of Q4_1 blocks (`nb` per column).
    fn at(qs: &'a [Line], dm: &'a [u16], t: usize, nb: usize, ncols: usize) -> Self {
        Tile4 {
            wq: &line_bytes(qs)[t * nb * TILE_BLOCK4..][..nb * TILE_BLOCK4],
            dm: &dm[t * nb * 2 * NC..][..nb * 2 * NC],
            nb,
            ncols,
        }
    }
}

#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: only used for disjoint writes from the parallel tile ranges.
unsafe impl Send for OutPtr {}
// SAFETY: as for Send: the threads sharing it write disjoint tiles.
unsafe impl Sync for OutPtr {}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX2 plus AVX-512 VNNI on 256-bit registers; activations offset to unsigned bytes.
    #[cfg(target_arch = "x86_64")]
    Vnni,
    /// `Vnni` computing two adjacent tiles at once on 512-bit registers (AVX-512F/BW too):
    /// the same operations lane for lane, so the same bits.
    #[cfg(target_arch = "x86_64")]
    VnniWide,
}

impl Kernel {
    #[cfg(target_arch = "x86_64")]
    fn is_vnni(self) -> bool {
        matches!(self, Kernel::Vnni | Kernel::VnniWide)
    }

    /// The kernel that runs a call of `m` rows on `blocks`: the same bits whichever it is,
    /// picked by what measured fastest at that many rows.
    fn for_rows(self, blocks: &Blocks, m: usize) -> Kernel {
        #[cfg(target_arch = "x86_64")]
        {
            let kern = match self {
                Kernel::VnniWide if m < WIDE_MIN_ROWS => Kernel::Vnni,
                k => k,
            };
            // Up to three rows are bound by reading the weights: there the AVX2 kernel
            // measured as fast (three rows) or faster (one: 1.13x).
            match (kern, blocks) {
                (k, Blocks::Q8_0 { .. }) if k.is_vnni() && m < VNNI_MIN_ROWS => Kernel::Avx2,
                (k, Blocks::Q4_1 { .. }) if k.is_vnni() && m < VNNI_Q4_MIN_ROWS => Kernel::Avx2,
                (k, _) => k,
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (blocks, m);
            self
        }
    }
}

/// The fastest kernel this CPU runs.
fn kernel() -> Kernel {
    #[cfg(target_arch = "x86_64")]
    {
        let cpu = crate::engine::simd::CpuFeatures::get();
        let avx2 = cpu.avx2_fma && cpu.f16c;
        let vnni = cpu.avx512_vnni && cpu.vnni_allowed;
        let wide = crate::engine::simd::wide_registers() && cpu.avx512bw;
        match (avx2, vnni, wide) {
            (true, true, true) => Kernel::VnniWide,
            (true, true, false) => Kernel::Vnni,
            (true, false, _) => Kernel::Avx2,
            _ => Kernel::Scalar,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    Kernel::Scalar
}

/// IEEE half → single (exact).
fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h & 0x8000) << 16;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x3ff);
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, _) => {
            // Subnormal: man · 2⁻²⁴, exact in f32.
            let v = man as f32 * (1.0 / 16_777_216.0);
            return if sign != 0 { -v } else { v };
        }
        (31, _) => sign | 0x7f80_0000 | (man << 13),
        _ => sign | ((exp + 112) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

/// Quantizes each block of 32 values: `d = max|x| / 127`, `q = round(x / d)` (ties to even);
/// `sums` (empty unless `form` asks) gets each block's `d · Σq` (integer sum, one rounding).
fn quantize_rows(
    kern: Kernel,
    xs: &[f32],
    xq: &mut [i8],
    xd: &mut [f32],
    sums: &mut [f32],
    form: ActForm,
) {
    match kern {
        Kernel::Scalar => {
            quantize_scalar(xs, xq, xd);
            for ((s, q), &d) in sums.iter_mut().zip(xq.chunks_exact(QK)).zip(xd.iter()) {
                *s = q.iter().map(|&v| i32::from(v)).sum::<i32>() as f32 * d;
            }
            #[cfg(target_arch = "x86_64")]
            if form == ActForm::Offset {
                xq.iter_mut().for_each(|v| *v ^= i8::MIN);
            }
        }
        // SAFETY: `kernel()` checked the CPU features.
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 | Kernel::Vnni | Kernel::VnniWide => unsafe {
            avx2::quantize(xs, xq, xd, sums, form == ActForm::Offset)
        },
    }
    let _ = form;
}

/// `1 / d`, or 0 where that is not finite (an all-zero block, or one so small that `1 / d`
/// overflows): every kernel then quantizes the block to zeros (a float-to-int conversion of
/// infinity differs between the scalar and SIMD paths).
fn activation_inverse_scale(d: f32) -> f32 {
    let id = 1.0 / d;
    if id.is_finite() {
        id
    } else {
        0.0
    }
}

fn quantize_scalar(xs: &[f32], xq: &mut [i8], xd: &mut [f32]) {
    for ((x, q), d) in xs
        .chunks_exact(QK)
        .zip(xq.chunks_exact_mut(QK))
        .zip(xd.iter_mut())
    {
        let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
        *d = amax / 127.0;
        let id = activation_inverse_scale(*d);
        for (q, v) in q.iter_mut().zip(x) {
            *q = (v * id).round_ties_even() as i8;
        }
    }
}

/// Portable reference kernel: the same sums in the same order as the SIMD one.
///
/// # Safety
/// `out` must point to `m` rows of `ld` floats, with the tile's columns writable.
unsafe fn tile_scalar(
    tile: &Tile,
    xq: &[i8],
    xd: &[f32],
    m: usize,
    k: usize,
    out: *mut f32,
    ld: usize,
) {
    let nb = tile.nb;
    for r in 0..m {
        let y = &xq[r * k..(r + 1) * k];
        for c in 0..tile.ncols {
            let mut acc = 0f32;
            for b in 0..nb {
                let w = &tile.wq[b * TILE_BLOCK..][..TILE_BLOCK];
                let mut s = 0i32;
                for g in 0..QK / 4 {
                    for j in 0..4 {
                        s += i32::from(w[g * 32 + c * 4 + j]) * i32::from(y[b * QK + g * 4 + j]);
                    }
                }
                let d = f16_to_f32(tile.ws[b * NC + c]) * xd[r * nb + b];
                acc = (s as f32).mul_add(d, acc);
            }
            *out.add(r * ld + c) = acc;
        }
    }
}

/// Portable reference kernel for Q4_1 tiles: per block `(Σq_w·q_x)·(d_w·d_x) + m_w·(d_x·Σq_x)`,
/// two fused multiply-adds in this order, as the SIMD kernels do.
///
/// # Safety
/// `out` must point to `m` rows of `ld` floats, with the tile's columns writable.
unsafe fn tile4_scalar(tile: &Tile4, acts: &Acts, m: usize, k: usize, out: *mut f32, ld: usize) {
    let nb = tile.nb;
    for r in 0..m {
        let y = &acts.q[r * k..(r + 1) * k];
        for c in 0..tile.ncols {
            let mut acc = 0f32;
            for b in 0..nb {
                let w = &tile.wq[b * TILE_BLOCK4..][..TILE_BLOCK4];
                let mut s = 0i32;
                for g in 0..QK / 8 {
                    for j in 0..4 {
                        let byte = w[g * 32 + c * 4 + j] as u8;
                        let lo = i32::from(y[b * QK + g * 4 + j]);
                        let hi = i32::from(y[b * QK + QK / 2 + g * 4 + j]);
                        s += i32::from(byte & 0xf) * lo + i32::from(byte >> 4) * hi;
                    }
                }
                let dm = &tile.dm[b * 2 * NC..][..2 * NC];
                let d = f16_to_f32(dm[c]) * acts.d[r * nb + b];
                acc = (s as f32).mul_add(d, acc);
                acc = f16_to_f32(dm[NC + c]).mul_add(acts.sum[r * nb + b], acc);
            }
            *out.add(r * ld + c) = acc;
        }
    }
}

/// Runs a row kernel over all `m` rows in blocks of the largest row count it is compiled for,
/// then the leftover rows in one call (`MR`: the calling module's block; `wide`: 8). `$f` is
/// generic over the rows per call (`avx2`: `R`; `vnni` and `wide`: `R` and the integer
/// accumulators per row `C`, more chains for few rows so that `vpdpbusd`'s latency does not
/// serialize a block); `|r| (args)` gives its arguments for the block starting at row `r`. A
/// row's result depends on neither `R` nor `C` (the integer sums are exact in any order).
/// `wide` keeps two chains a row up to 8 rows (24 registers of sums): with one, the 512-bit
/// pair kernels ran 16-request decode steps 3-6 % longer on a Cascade Lake VM; with four
/// (spilled), 38 % longer.
#[cfg(target_arch = "x86_64")]
macro_rules! for_row_blocks {
    (avx2, $m:expr, $f:ident, |$r:ident| ($($arg:expr),* $(,)?)) => {{
        let mut $r = 0;
        while $r + MR <= $m {
            $f::<MR>($($arg),*);
            $r += MR;
        }
        match $m - $r {
            3 => $f::<3>($($arg),*),
            2 => $f::<2>($($arg),*),
            1 => $f::<1>($($arg),*),
            _ => {}
        }
    }};
    (wide, $m:expr, $f:ident, |$r:ident| ($($arg:expr),* $(,)?)) => {{
        let mut $r = 0;
        while $r + 8 <= $m {
            $f::<8, 2>($($arg),*);
            $r += 8;
        }
        match $m - $r {
            7 => $f::<7, 2>($($arg),*),
            6 => $f::<6, 2>($($arg),*),
            5 => $f::<5, 2>($($arg),*),
            4 => $f::<4, 2>($($arg),*),
            3 => $f::<3, 4>($($arg),*),
            2 => $f::<2, 4>($($arg),*),
            1 => $f::<1, 8>($($arg),*),
            _ => {}
        }
    }};
    (vnni, $m:expr, $f:ident, |$r:ident| ($($arg:expr),* $(,)?)) => {{
        let mut $r = 0;
        while $r + MR <= $m {
            $f::<MR, 2>($($arg),*);
            $r += MR;
        }
        match $m - $r {
            7 => $f::<7, 1>($($arg),*),
            6 => $f::<6, 1>($($arg),*),
            5 => $f::<5, 1>($($arg),*),
            4 => $f::<4, 2>($($arg),*),
            3 => $f::<3, 2>($($arg),*),
            2 => $f::<2, 4>($($arg),*),
            1 => $f::<1, 4>($($arg),*),
            _ => {}
        }
    }};
}

#[cfg(target_arch = "x86_64")]
mod avx2;

#[cfg(target_arch = "x86_64")]
mod vnni;

/// Calls `f` on disjoint ranges covering `0..n`, on up to [`compute_threads`] threads. Ranges
/// are claimed from a shared counter, so a thread that starts late takes fewer.
fn par_ranges(n: usize, parallel: bool, f: impl Fn(Range<usize>) + Sync) {
    let threads = super::team::compute_threads();
    if !parallel || threads <= 1 || n < 2 {
        f(0..n);
        return;
    }
    let bounds = guided_bounds(n, threads);
    super::team::for_each_index(bounds.len() - 1, |i| f(bounds[i]..bounds[i + 1]));
}

/// Boundaries of the pieces of `0..n` for `threads` threads, largest first: each piece is
/// half a thread's share of what is left (at least a small floor). Claimed in order, the big
/// pieces keep every thread busy and the small last ones even out the finish: with equal
/// pieces, a thread that starts a loop a little late left the other waiting for up to a
/// whole piece (an eighth of the loop) at the end.
fn guided_bounds(n: usize, threads: usize) -> Vec<usize> {
    let floor = (n / (16 * threads)).max(1);
    let mut bounds = vec![0];
    let mut at = 0;
    while at < n {
        let piece = (n - at).div_ceil(2 * threads).max(floor).min(n - at);
        at += piece;
        bounds.push(at);
    }
    bounds
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn randn(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                // Sum of uniforms: roughly normal, with occasional larger values.
                let u: f32 = (0..4).map(|_| rng.random::<f32>() - 0.5).sum();
                u * scale
            })
            .collect()
    }

    /// Every kernel this CPU runs, the scalar reference first.
    fn kernels() -> Vec<Kernel> {
        let mut k = vec![Kernel::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if kernel() != Kernel::Scalar {
                k.push(Kernel::Avx2);
            }
            if kernel().is_vnni() {
                k.push(Kernel::Vnni);
            }
            if kernel() == Kernel::VnniWide {
                k.push(Kernel::VnniWide);
            }
        }
        k
    }

    /// Quantized activations dequantized back to f32.
    fn dequantized_rows(xs: &[f32], k: usize) -> Vec<f32> {
        let mut q = vec![0i8; xs.len()];
        let mut d = vec![0f32; xs.len() / QK];
        quantize_scalar(xs, &mut q, &mut d);
        let _ = k;
        q.iter()
            .enumerate()
            .map(|(i, &v)| f32::from(v) * d[i / QK])
            .collect()
    }

    fn run(l: &Q8Linear, kern: Kernel, xs: &[f32], m: usize) -> Vec<f32> {
        let x = Tensor::from_vec(xs.to_vec(), (m, l.k), &Device::Cpu).unwrap();
        let (outs, _) = l.compute(&x, kern).unwrap();
        assert_eq!(outs.len(), 1);
        outs.into_iter().next().unwrap()
    }

    #[test]
    fn guided_pieces_cover_the_range_largest_first() {
        for threads in [2usize, 3, 16] {
            for n in [2usize, 7, 72, 384, 6144] {
                let b = guided_bounds(n, threads);
                assert_eq!(
                    (b[0], *b.last().unwrap()),
                    (0, n),
                    "n={n} threads={threads}"
                );
                let pieces: Vec<usize> = b.windows(2).map(|w| w[1] - w[0]).collect();
                assert!(pieces.iter().all(|&p| p > 0));
                assert!(pieces.windows(2).all(|w| w[0] >= w[1]), "{pieces:?}");
                // The first pieces give each thread work; the last is small.
                assert!(pieces[0] <= n.div_ceil(2 * threads).max(n / (16 * threads)).max(1));
                assert!(*pieces.last().unwrap() <= (n / (16 * threads)).max(1));
            }
        }
    }

    #[test]
    fn simd_scalar_and_f32_matmul_agree() {
        let mut rng = StdRng::seed_from_u64(7);
        for &k in &[576usize, 1536, 64] {
            for &n in &[1usize, 13, 100, 192] {
                let w = randn(&mut rng, n * k, 0.1);
                let wt = Tensor::from_vec(w, (n, k), &Device::Cpu).unwrap();
                for l in both_formats(&wt) {
                    let wd = l.dequantize().unwrap();
                    let wdv = wd.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    for &m in &[1usize, 3, 5, 7, 12, 14, 17] {
                        let xs = randn(&mut rng, m * k, 1.0);
                        let x = Tensor::from_vec(xs.clone(), (m, k), &Device::Cpu).unwrap();
                        // candle's f32 matmul on the dequantized weights.
                        let reference = x
                            .matmul(&wd.t().unwrap())
                            .unwrap()
                            .flatten_all()
                            .unwrap()
                            .to_vec1::<f32>()
                            .unwrap();
                        let xdq = dequantized_rows(&xs, k);
                        let results: Vec<Vec<f32>> = kernels()
                            .iter()
                            .map(|&kern| run(&l, kern, &xs, m))
                            .collect();
                        for r in 0..m {
                            for c in 0..n {
                                let (wr, xr) = (&wdv[c * k..(c + 1) * k], &xs[r * k..(r + 1) * k]);
                                let mag: f64 = wr
                                    .iter()
                                    .zip(xr)
                                    .map(|(a, b)| f64::from(*a * *b).abs())
                                    .sum();
                                // Exact dot product of the quantized operands.
                                let exact: f64 = wr
                                    .iter()
                                    .zip(&xdq[r * k..(r + 1) * k])
                                    .map(|(a, b)| f64::from(*a) * f64::from(*b))
                                    .sum();
                                let i = r * n + c;
                                for (res, kern) in results.iter().zip(kernels()) {
                                    let got = f64::from(res[i]);
                                    assert!(
                                    (got - exact).abs() <= 1e-5 * mag + 1e-6,
                                    "{kern:?} k={k} n={n} m={m} ({r},{c}): {got} vs exact {exact}"
                                );
                                    assert!(
                                        (got - f64::from(reference[i])).abs() <= 5e-3 * mag + 1e-5,
                                        "{kern:?} k={k} n={n} m={m} ({r},{c}): {got} vs f32 {}",
                                        reference[i]
                                    );
                                }
                                for (res, kern) in results.iter().zip(kernels()) {
                                    assert_eq!(
                                        results[0][i].to_bits(),
                                        res[i].to_bits(),
                                        "{kern:?} and scalar differ at k={k} n={n} m={m} ({r},{c})"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// The layer in both block formats: Q8_0 quantized directly, Q4_1 as ggml's blocks.
    fn both_formats(w: &Tensor) -> [Q8Linear; 2] {
        let q4 = QTensor::quantize(w, GgmlDType::Q4_1).unwrap();
        let l4 = Q8Linear::from_qtensor(&q4).unwrap();
        assert_eq!(l4.format(), GgmlDType::Q4_1);
        [Q8Linear::from_tensor(w).unwrap(), l4]
    }

    #[test]
    fn rows_do_not_depend_on_the_batch() {
        let mut rng = StdRng::seed_from_u64(11);
        let (n, k) = (37, 576);
        let wt = Tensor::from_vec(randn(&mut rng, n * k, 0.1), (n, k), &Device::Cpu).unwrap();
        // Enough rows that the batch's activations are quantized on the compute threads
        // (a single row's on the caller's).
        let m = PAR_MIN_QUANT.div_ceil(k) + 3;
        let xs = randn(&mut rng, m * k, 1.0);
        for (l, kern) in both_formats(&wt)
            .iter()
            .flat_map(|l| kernels().into_iter().map(move |kn| (l, kn)))
        {
            let all = run(l, kern, &xs, m);
            for r in 0..m {
                let one = run(l, kern, &xs[r * k..(r + 1) * k], 1);
                assert_eq!(one, all[r * n..(r + 1) * n], "{kern:?} row {r}");
            }
            let five = run(l, kern, &xs[..5 * k], 5);
            assert_eq!(five, all[..5 * n], "{kern:?}");
        }
    }

    #[test]
    fn fused_parts_equal_separate_layers() {
        let mut rng = StdRng::seed_from_u64(3);
        let k = 96;
        let sizes = [20usize, 8, 5];
        for q4 in [false, true] {
            let layers: Vec<Q8Linear> = sizes
                .iter()
                .map(|&n| {
                    let w = Tensor::from_vec(randn(&mut rng, n * k, 0.1), (n, k), &Device::Cpu);
                    let [q8, q4_1] = both_formats(&w.unwrap());
                    if q4 {
                        q4_1
                    } else {
                        q8
                    }
                })
                .collect();
            let x =
                Tensor::from_vec(randn(&mut rng, 2 * 3 * k, 1.0), (2, 3, k), &Device::Cpu).unwrap();
            let separate: Vec<Vec<f32>> = layers
                .iter()
                .map(|l| {
                    let y = l.forward(&x).unwrap();
                    assert_eq!(y.dims(), &[2, 3, l.out_dim()]);
                    y.flatten_all().unwrap().to_vec1().unwrap()
                })
                .collect();
            let fused = Q8Linear::concat(layers).unwrap();
            assert_eq!(fused.parts(), &sizes);
            let parts = fused.forward_parts(&x).unwrap();
            for (p, s) in parts.iter().zip(&separate) {
                assert_eq!(&p.flatten_all().unwrap().to_vec1::<f32>().unwrap(), s);
            }
            let whole = fused.forward(&x).unwrap();
            assert_eq!(whole.dims(), &[2, 3, 33]);
            let cat = Tensor::cat(&parts, 2).unwrap();
            assert_eq!(
                whole.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                cat.flatten_all().unwrap().to_vec1::<f32>().unwrap()
            );
        }
        let w = Tensor::from_vec(randn(&mut rng, 8 * k, 0.1), (8, k), &Device::Cpu).unwrap();
        let err = Q8Linear::concat(both_formats(&w).into()).unwrap_err();
        assert!(err.to_string().contains("block format"), "{err}");
    }

    #[test]
    fn q4_1_blocks_are_taken_as_they_are() {
        let mut rng = StdRng::seed_from_u64(17);
        let (n, k) = (19, 96);
        let mut w = randn(&mut rng, n * k, 0.1);
        w[..QK].fill(0.0); // an all-zero block
        w[2 * k..2 * k + QK].fill(0.25); // a constant block: d = 0, all weight in m
        w[5 * k + 7] = 3.0; // an outlier
        let wt = Tensor::from_vec(w, (n, k), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&wt, GgmlDType::Q4_1).unwrap();
        let l = Q8Linear::from_qtensor(&q).unwrap();
        assert_eq!(l.format(), GgmlDType::Q4_1);
        let ours = l.dequantize().unwrap().flatten_all().unwrap();
        let theirs = q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap();
        assert_eq!(
            ours.to_vec1::<f32>().unwrap(),
            theirs.to_vec1::<f32>().unwrap()
        );
        // Asked for Q8_0, the same blocks are re-quantized.
        let q8 = Q8Linear::q8_0_from_qtensor(&q).unwrap();
        assert_eq!(q8.format(), GgmlDType::Q8_0);
        assert!(Q8Linear::from_q4_1_bytes(n, k, &q.data().unwrap()[1..]).is_err());
    }

    #[test]
    fn extreme_nibbles_give_the_same_bits_in_every_kernel() {
        // Every nibble value with the largest activations of both signs.
        let (n, k) = (11, 96);
        let mut data = Vec::new();
        for c in 0..n {
            for b in 0..k / QK {
                data.extend_from_slice(&(0x2c00u16 + (c * 7 + b) as u16).to_le_bytes());
                data.extend_from_slice(&(0xac00u16 + (c * 3 + b) as u16).to_le_bytes());
                data.extend((0..QK / 2).map(|j| [0x0fu8, 0xf0, 0xff, 0x00, 0x7e][(c + b + j) % 5]));
            }
        }
        let l = Q8Linear::from_q4_1_bytes(n, k, &data).unwrap();
        let m = 9;
        let xs: Vec<f32> = (0..m * k)
            .map(|i| [1.0f32, -1.0, 0.5, -3.0e4, 3.0e4, 0.0][i % 6])
            .collect();
        let results: Vec<Vec<f32>> = kernels().iter().map(|&kn| run(&l, kn, &xs, m)).collect();
        for (res, kern) in results.iter().zip(kernels()) {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(res), bits(&results[0]), "{kern:?}");
        }
    }

    #[test]
    fn q8_0_blocks_are_taken_as_they_are() {
        let mut rng = StdRng::seed_from_u64(5);
        let (n, k) = (19, 64);
        let w = Tensor::from_vec(randn(&mut rng, n * k, 0.1), (n, k), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q8_0).unwrap();
        let l = Q8Linear::from_qtensor(&q).unwrap();
        let ours = l.dequantize().unwrap().flatten_all().unwrap();
        let theirs = q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap();
        assert_eq!(
            ours.to_vec1::<f32>().unwrap(),
            theirs.to_vec1::<f32>().unwrap()
        );
        // A non-Q8_0 source goes through the same re-quantization as `from_tensor`.
        let q4 = QTensor::quantize(&w, GgmlDType::Q4_1).unwrap();
        let a = Q8Linear::q8_0_from_qtensor(&q4)
            .unwrap()
            .dequantize()
            .unwrap();
        let b = Q8Linear::from_tensor(&q4.dequantize(&Device::Cpu).unwrap())
            .unwrap()
            .dequantize()
            .unwrap();
        assert_eq!(
            a.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            b.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );
        assert!(
            Q8Linear::from_tensor(&Tensor::zeros((4, 48), DType::F32, &Device::Cpu).unwrap())
                .is_err()
        );
    }

    #[test]
    fn direct_quantization_makes_candles_q8_0_blocks() {
        let mut rng = StdRng::seed_from_u64(13);
        let (n, k) = (21, 96);
        let mut w = randn(&mut rng, n * k, 0.1);
        w[..QK].fill(0.0); // an all-zero block
        w[5 * k + 7] = 3.0; // a block with one outlier
        w[6 * k..6 * k + QK].fill(1e-44); // subnormal: 1 / d overflows to infinity
        w[7 * k + 3] = f32::NAN;
        let wt = Tensor::from_vec(w, (n, k), &Device::Cpu).unwrap();
        let ours = Q8Linear::from_tensor(&wt).unwrap();
        let q = QTensor::quantize(&wt, GgmlDType::Q8_0).unwrap();
        let candles = Q8Linear::from_q8_0_bytes(n, k, &q.data().unwrap()).unwrap();
        let (
            Blocks::Q8_0 { qs, scales, sums },
            Blocks::Q8_0 {
                qs: cq,
                scales: cs,
                sums: cu,
            },
        ) = (&ours.blocks, &candles.blocks)
        else {
            panic!("both are Q8_0");
        };
        assert_eq!(line_bytes(qs), line_bytes(cq));
        assert_eq!(scales, cs);
        assert_eq!(sums, cu);
    }

    #[test]
    fn extreme_bytes_give_the_same_bits_in_every_kernel() {
        // Q8_0 data may hold −128 (ggml never writes it, other tools may); activations reach ±127.
        let (n, k) = (11, 96);
        let mut data = Vec::new();
        for c in 0..n {
            for b in 0..k / QK {
                data.extend_from_slice(&(0x2c00u16 + (c * 7 + b) as u16).to_le_bytes());
                data.extend((0..QK).map(|j| [-128i8, 127, -127, 0, 1][(c + b + j) % 5] as u8));
            }
        }
        let l = Q8Linear::from_q8_0_bytes(n, k, &data).unwrap();
        let m = 9;
        let xs: Vec<f32> = (0..m * k)
            .map(|i| [1.0f32, -1.0, 0.5, -3.0e4, 3.0e4, 0.0][i % 6])
            .collect();
        let results: Vec<Vec<f32>> = kernels().iter().map(|&kn| run(&l, kn, &xs, m)).collect();
        for (res, kern) in results.iter().zip(kernels()) {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(res), bits(&results[0]), "{kern:?}");
        }
    }

    #[test]
    fn f16_conversion_is_exact() {
        for (bits, v) in [
            (0x0000u16, 0.0f32),
            (0x3c00, 1.0),
            (0xc000, -2.0),
            (0x3555, 0.333_251_95),
            (0x0001, 5.960_464_5e-8),
            (0x7bff, 65504.0),
        ] {
            assert_eq!(f16_to_f32(bits), v, "{bits:#x}");
        }
        assert_eq!(f16_to_f32(0x7c00), f32::INFINITY);
        assert!(f16_to_f32(0x7e00).is_nan());
    }

    #[test]
    fn tiny_activation_blocks_quantize_to_zeros_in_every_kernel() {
        // max|x| / 127 is subnormal, so 1 / d overflows: the block must be zeros everywhere.
        let mut rng = StdRng::seed_from_u64(23);
        let (n, k, m) = (9, 64, 5);
        let w = Tensor::from_vec(randn(&mut rng, n * k, 0.1), (n, k), &Device::Cpu).unwrap();
        let mut xs = randn(&mut rng, m * k, 1.0);
        for (i, x) in xs[..2 * QK].iter_mut().enumerate() {
            *x = if i % 3 == 0 { 1e-38 } else { -2e-39 };
        }
        for l in both_formats(&w) {
            let results: Vec<Vec<f32>> = kernels().iter().map(|&kn| run(&l, kn, &xs, m)).collect();
            for (res, kern) in results.iter().zip(kernels()) {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(res), bits(&results[0]), "{kern:?} {:?}", l.format());
            }
        }
    }
}
