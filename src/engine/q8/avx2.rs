//! The int8 tile kernels on AVX2 + FMA + F16C (`maddubs` products, f32 accumulation).

use super::{Acts, Tile, Tile4, MR, NC, QK, TILE_BLOCK, TILE_BLOCK4};
use std::arch::x86_64::*;

/// `super::quantize_rows`: with `sums` non-empty, each block's `d · Σq` (the sum of the
/// stored bytes); with `offset`, the bytes stored as `q ^ 0x80`.
///
/// # Safety
/// The CPU must support AVX2; slices as in `quantize_scalar`, `sums` empty or one per
/// block.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn quantize(
    xs: &[f32],
    xq: &mut [i8],
    xd: &mut [f32],
    sums: &mut [f32],
    offset: bool,
) {
    let sign = _mm256_set1_ps(-0.0);
    let perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let flip = _mm256_set1_epi8(if offset { i8::MIN } else { 0 });
    for (blk, ((x, q), d)) in xs
        .chunks_exact(QK)
        .zip(xq.chunks_exact_mut(QK))
        .zip(xd.iter_mut())
        .enumerate()
    {
        let p = x.as_ptr();
        let v = [
            _mm256_loadu_ps(p),
            _mm256_loadu_ps(p.add(8)),
            _mm256_loadu_ps(p.add(16)),
            _mm256_loadu_ps(p.add(24)),
        ];
        let mx = _mm256_max_ps(
            _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
            _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])),
        );
        let m4 = _mm_max_ps(_mm256_extractf128_ps(mx, 1), _mm256_castps256_ps128(mx));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let m1 = _mm_max_ss(m2, _mm_movehdup_ps(m2));
        let amax = _mm_cvtss_f32(m1);
        *d = amax / 127.0;
        let id = _mm256_set1_ps(super::activation_inverse_scale(*d));
        let r = |v: __m256| {
            _mm256_cvtps_epi32(_mm256_round_ps(
                _mm256_mul_ps(v, id),
                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
            ))
        };
        let a = _mm256_packs_epi32(r(v[0]), r(v[1]));
        let b = _mm256_packs_epi32(r(v[2]), r(v[3]));
        let packed = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(a, b), perm);
        if let Some(s) = sums.get_mut(blk) {
            // 1 · q in pairs, then the pairs in fours: exact 32-bit sums of the bytes.
            let pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), packed);
            let quads = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
            let h = _mm_add_epi32(
                _mm256_castsi256_si128(quads),
                _mm256_extracti128_si256::<1>(quads),
            );
            let h = _mm_add_epi32(h, _mm_unpackhi_epi64(h, h));
            let h = _mm_add_epi32(h, _mm_shuffle_epi32::<0b01>(h));
            *s = _mm_cvtsi128_si32(h) as f32 * *d;
        }
        _mm256_storeu_si256(q.as_mut_ptr().cast(), _mm256_xor_si256(packed, flip));
    }
}

/// # Safety
/// The CPU must support AVX2/FMA/F16C; `out` as in `tile_scalar`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn tile(
    tile: &Tile,
    xq: &[i8],
    xd: &[f32],
    m: usize,
    k: usize,
    out: *mut f32,
    ld: usize,
) {
    debug_assert!(xq.len() >= m * k && xd.len() >= m * (k / QK));
    let (xq, xd) = (xq.as_ptr(), xd.as_ptr());
    let nb = k / QK;
    for_row_blocks!(avx2, m, rows, |r| (
        tile,
        xq.add(r * k),
        xd.add(r * nb),
        k,
        out.add(r * ld),
        ld
    ));
}

/// `R` activation rows against one tile; each row's arithmetic is independent of `R`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn rows<const R: usize>(
    tile: &Tile,
    xq: *const i8,
    xd: *const f32,
    k: usize,
    out: *mut f32,
    ld: usize,
) {
    let nb = tile.nb;
    let wq = tile.wq.as_ptr();
    let ws = tile.ws.as_ptr();
    let ones = _mm256_set1_epi16(1);
    let mut accf = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        let wb = wq.add(b * TILE_BLOCK);
        let yb = xq.add(b * QK);
        let mut acci = [_mm256_setzero_si256(); R];
        for g in 0..QK / 4 {
            let w = _mm256_load_si256(wb.add(g * 32).cast());
            let aw = _mm256_sign_epi8(w, w);
            for (r, acc) in acci.iter_mut().enumerate() {
                let y = _mm256_set1_epi32(yb.add(r * k + g * 4).cast::<i32>().read_unaligned());
                let p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(y, w));
                *acc = _mm256_add_epi32(*acc, _mm256_madd_epi16(p, ones));
            }
        }
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(ws.add(b * NC).cast()));
        for (r, acc) in accf.iter_mut().enumerate() {
            let d = _mm256_mul_ps(dw, _mm256_set1_ps(*xd.add(r * nb + b)));
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acci[r]), d, *acc);
        }
    }
    store_rows(&accf, tile.ncols, out, ld);
}

/// As `tile` for a Q4_1 tile.
///
/// # Safety
/// The CPU must support AVX2/FMA/F16C; `out` as in `tile_scalar`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn tile4(
    tile: &Tile4,
    acts: &Acts,
    m: usize,
    k: usize,
    out: *mut f32,
    ld: usize,
) {
    let nb = k / QK;
    debug_assert!(acts.q.len() >= m * k && acts.d.len() >= m * nb && acts.sum.len() >= m * nb);
    for_row_blocks!(avx2, m, rows4, |r| (tile, acts, r, k, out.add(r * ld), ld));
}

/// Rows `r0..r0 + R` against one Q4_1 tile. The nibbles are unsigned, the activations
/// signed: `maddubs` takes them as they are (|Σ| ≤ 2·15·128 per pair, no saturation even
/// after adding the high nibbles' pair).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn rows4<const R: usize>(
    tile: &Tile4,
    acts: &Acts,
    r0: usize,
    k: usize,
    out: *mut f32,
    ld: usize,
) {
    let nb = tile.nb;
    let wq = tile.wq.as_ptr();
    let dm = tile.dm.as_ptr();
    let xq = acts.q.as_ptr().add(r0 * k);
    let (xd, xs) = (acts.d.as_ptr().add(r0 * nb), acts.sum.as_ptr().add(r0 * nb));
    let ones = _mm256_set1_epi16(1);
    let low = _mm256_set1_epi8(0xf);
    let mut accf = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        let wb = wq.add(b * TILE_BLOCK4);
        let yb = xq.add(b * QK);
        let mut acci = [_mm256_setzero_si256(); R];
        for g in 0..QK / 8 {
            let w = _mm256_load_si256(wb.add(g * 32).cast());
            let lo = _mm256_and_si256(w, low);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(w), low);
            for (r, acc) in acci.iter_mut().enumerate() {
                let y = yb.add(r * k + g * 4);
                let ylo = _mm256_set1_epi32(y.cast::<i32>().read_unaligned());
                let yhi = _mm256_set1_epi32(y.add(QK / 2).cast::<i32>().read_unaligned());
                let p =
                    _mm256_add_epi16(_mm256_maddubs_epi16(lo, ylo), _mm256_maddubs_epi16(hi, yhi));
                *acc = _mm256_add_epi32(*acc, _mm256_madd_epi16(p, ones));
            }
        }
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(dm.add(b * 2 * NC).cast()));
        let mw = _mm256_cvtph_ps(_mm_loadu_si128(dm.add(b * 2 * NC + NC).cast()));
        for (r, acc) in accf.iter_mut().enumerate() {
            let d = _mm256_mul_ps(dw, _mm256_set1_ps(*xd.add(r * nb + b)));
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acci[r]), d, *acc);
            *acc = _mm256_fmadd_ps(mw, _mm256_set1_ps(*xs.add(r * nb + b)), *acc);
        }
    }
    store_rows(&accf, tile.ncols, out, ld);
}

/// Writes each row's 8 sums to its `ncols` real columns.
///
/// # Safety
/// The CPU must support AVX; `out` must hold `accf.len()` rows of `ld` floats with the
/// tile's columns writable.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn store_rows(accf: &[__m256], ncols: usize, out: *mut f32, ld: usize) {
    for (r, acc) in accf.iter().enumerate() {
        let o = out.add(r * ld);
        if ncols == NC {
            _mm256_storeu_ps(o, *acc);
        } else {
            let mut tmp = [0f32; NC];
            _mm256_storeu_ps(tmp.as_mut_ptr(), *acc);
            std::ptr::copy_nonoverlapping(tmp.as_ptr(), o, ncols);
        }
    }
}
