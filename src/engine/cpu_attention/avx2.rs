//! The attention kernels on AVX2 + FMA (+ F16C for f16 caches): the reference bits every other instruction set reproduces.

use std::arch::x86_64::*;

/// [`super::widen`] with F16C.
///
/// # Safety
/// AVX and F16C.
#[target_feature(enable = "avx,f16c")]
pub(super) unsafe fn widen_f16c(src: &[half::f16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    let n = src.len() - src.len() % 8;
    for i in (0..n).step_by(8) {
        let h = _mm_loadu_si128(src.as_ptr().add(i).cast());
        _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
    }
    for (d, s) in dst[n..].iter_mut().zip(&src[n..]) {
        *d = s.to_f32();
    }
}

/// [`super::narrow`] with F16C (rounded to nearest, ties to even, as `f16::from_f32`).
///
/// # Safety
/// AVX and F16C.
#[target_feature(enable = "avx,f16c")]
pub(super) unsafe fn narrow_f16c(src: &[f32], dst: &mut [half::f16]) {
    assert_eq!(src.len(), dst.len());
    let n = src.len() - src.len() % 8;
    for i in (0..n).step_by(8) {
        let x = _mm256_loadu_ps(src.as_ptr().add(i));
        let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x);
        _mm_storeu_si128(dst.as_mut_ptr().add(i).cast(), h);
    }
    for (d, s) in dst[n..].iter_mut().zip(&src[n..]) {
        *d = half::f16::from_f32(*s);
    }
}

/// # Safety
/// AVX2 and FMA; `a.len() == b.len()`, a multiple of 8.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for i in (0..a.len()).step_by(8) {
        acc = _mm256_fmadd_ps(
            _mm256_loadu_ps(a.as_ptr().add(i)),
            _mm256_loadu_ps(b.as_ptr().add(i)),
            acc,
        );
    }
    let s4 = _mm_add_ps(_mm256_extractf128_ps(acc, 1), _mm256_castps256_ps128(acc));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)))
}

/// `out[j] = (a · bs[j]) · scale`, each dot product exactly [`dot`]'s: the same
/// multiply-adds per lane, then its pairwise sum of the lanes ((0+4)+(2+6))+((1+5)+(3+7)),
/// here done for the eight keys at once by transposing shuffles.
///
/// # Safety
/// AVX2 and FMA; every `bs[j].len() == a.len()`, a multiple of 8; `out.len() == 8`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn dot8(a: &[f32], bs: &[&[f32]; 8], scale: f32, out: &mut [f32]) {
    debug_assert!(out.len() == 8 && bs.iter().all(|b| b.len() == a.len()));
    let mut acc = [_mm256_setzero_ps(); 8];
    for i in (0..a.len()).step_by(8) {
        let x = _mm256_loadu_ps(a.as_ptr().add(i));
        for (acc, b) in acc.iter_mut().zip(bs) {
            *acc = _mm256_fmadd_ps(x, _mm256_loadu_ps(b.as_ptr().add(i)), *acc);
        }
    }
    let dots = _mm256_mul_ps(lane_sums(&acc), _mm256_set1_ps(scale));
    _mm256_storeu_ps(out.as_mut_ptr(), dots);
}

/// `out0[j] = (a0 · bs[j]) · scale`, `out1[j] = (a1 · bs[j]) · scale`, each dot product
/// exactly [`dot`]'s (as in [`dot8`]); a load of a key serves both queries.
///
/// # Safety
/// AVX2 and FMA; `a1` and every `bs[j]` as long as `a0`, a multiple of 8; the outputs
/// hold 4 values each.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn dot2x4(
    a0: &[f32],
    a1: &[f32],
    bs: &[&[f32]; 4],
    scale: f32,
    out0: &mut [f32],
    out1: &mut [f32],
) {
    debug_assert!(a1.len() == a0.len() && bs.iter().all(|b| b.len() == a0.len()));
    debug_assert!(out0.len() == 4 && out1.len() == 4);
    let mut acc = [_mm256_setzero_ps(); 8];
    for i in (0..a0.len()).step_by(8) {
        let x0 = _mm256_loadu_ps(a0.as_ptr().add(i));
        let x1 = _mm256_loadu_ps(a1.as_ptr().add(i));
        for (j, b) in bs.iter().enumerate() {
            let y = _mm256_loadu_ps(b.as_ptr().add(i));
            acc[j] = _mm256_fmadd_ps(x0, y, acc[j]);
            acc[4 + j] = _mm256_fmadd_ps(x1, y, acc[4 + j]);
        }
    }
    let dots = _mm256_mul_ps(lane_sums(&acc), _mm256_set1_ps(scale));
    _mm_storeu_ps(out0.as_mut_ptr(), _mm256_castps256_ps128(dots));
    _mm_storeu_ps(out1.as_mut_ptr(), _mm256_extractf128_ps::<1>(dots));
}

/// `outs[i][j] = (a[i] · bs[j]) · scale` for `Q` (at most 3) queries and four f16 keys,
/// each key converted once as it is loaded; each dot product exactly [`dot`]'s (as in
/// [`dot8`]).
///
/// # Safety
/// AVX2, FMA and F16C; every `a[i]` and `bs[j]` of one length, a multiple of 8; each
/// `outs[i]` writable for 4 values.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dots_f16<const Q: usize>(
    a: [&[f32]; Q],
    bs: &[&[half::f16]; 4],
    scale: f32,
    outs: [*mut f32; Q],
) {
    let d = a[0].len();
    debug_assert!(a.iter().all(|x| x.len() == d) && bs.iter().all(|b| b.len() == d));
    let mut acc = [[_mm256_setzero_ps(); 4]; Q];
    for i in (0..d).step_by(8) {
        let x: [__m256; Q] = std::array::from_fn(|q| _mm256_loadu_ps(a[q].as_ptr().add(i)));
        for (j, b) in bs.iter().enumerate() {
            let y = _mm256_cvtph_ps(_mm_loadu_si128(b.as_ptr().add(i).cast()));
            for (acc, x) in acc.iter_mut().zip(&x) {
                acc[j] = _mm256_fmadd_ps(*x, y, acc[j]);
            }
        }
    }
    let scale = _mm256_set1_ps(scale);
    for pair in (0..Q).step_by(2) {
        let (lo, hi) = (
            acc[pair],
            acc.get(pair + 1)
                .copied()
                .unwrap_or([_mm256_setzero_ps(); 4]),
        );
        let all = [lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]];
        let dots = _mm256_mul_ps(lane_sums(&all), scale);
        _mm_storeu_ps(outs[pair], _mm256_castps256_ps128(dots));
        if pair + 1 < Q {
            _mm_storeu_ps(outs[pair + 1], _mm256_extractf128_ps::<1>(dots));
        }
    }
}

/// `outs[i] += Σ_p ws[i][p] · v_p` for `Q` (at most 3) queries over f16 values (`d` of
/// them a row, rows `stride` apart), converted as they are loaded; [`weighted_sum`]'s
/// arithmetic per query.
///
/// # Safety
/// AVX2, FMA and F16C; `d` a multiple of 8; every `ws[i]` of one length `n`; `v` holds
/// `(n - 1) · stride + d` values; each `outs[i]` holds `d` values.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn weighted_sums_f16<const Q: usize>(
    ws: [&[f32]; Q],
    v: &[half::f16],
    stride: usize,
    d: usize,
    outs: [*mut f32; Q],
) {
    debug_assert!(ws.iter().all(|w| w.len() == ws[0].len()));
    let mut c = 0;
    while c + 32 <= d {
        columns_f16::<Q, 4>(ws, v.as_ptr().add(c), stride, outs.map(|o| o.add(c)));
        c += 32;
    }
    while c < d {
        columns_f16::<Q, 1>(ws, v.as_ptr().add(c), stride, outs.map(|o| o.add(c)));
        c += 8;
    }
}

/// `8·N` columns of `Q` queries' sums over f16 values, kept in registers across all
/// positions.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn columns_f16<const Q: usize, const N: usize>(
    ws: [&[f32]; Q],
    v: *const half::f16,
    stride: usize,
    outs: [*mut f32; Q],
) {
    let mut acc: [[__m256; N]; Q] =
        std::array::from_fn(|i| std::array::from_fn(|j| _mm256_loadu_ps(outs[i].add(8 * j))));
    for p in 0..ws[0].len() {
        let w: [__m256; Q] = std::array::from_fn(|i| _mm256_set1_ps(*ws[i].get_unchecked(p)));
        let row = v.add(p * stride);
        for j in 0..N {
            let x = _mm256_cvtph_ps(_mm_loadu_si128(row.add(8 * j).cast()));
            for (acc, w) in acc.iter_mut().zip(&w) {
                acc[j] = _mm256_fmadd_ps(*w, x, acc[j]);
            }
        }
    }
    for (acc, out) in acc.iter().zip(outs) {
        for (j, acc) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.add(8 * j), *acc);
        }
    }
}

/// The lane sums of eight accumulators, `[Σ acc_0, …, Σ acc_7]`, each in [`dot`]'s
/// order ((0+4)+(2+6))+((1+5)+(3+7)), by transposing shuffles.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn lane_sums(acc: &[__m256; 8]) -> __m256 {
    // Halves: [t_j | t_{j+4}] with t_j = lo(acc_j) + hi(acc_j).
    let halves = |j: usize| {
        let lo = _mm256_permute2f128_ps::<0x20>(acc[j], acc[j + 4]);
        let hi = _mm256_permute2f128_ps::<0x31>(acc[j], acc[j + 4]);
        _mm256_add_ps(lo, hi)
    };
    let t = [halves(0), halves(1), halves(2), halves(3)];
    // Pairs: u_j = (t_j0 + t_j2, t_j1 + t_j3), as [u_j, u_{j+1} | u_{j+4}, u_{j+5}].
    let pairs = |a: __m256, b: __m256| {
        let (a, b) = (_mm256_castps_pd(a), _mm256_castps_pd(b));
        let lo = _mm256_castpd_ps(_mm256_unpacklo_pd(a, b));
        let hi = _mm256_castpd_ps(_mm256_unpackhi_pd(a, b));
        _mm256_add_ps(lo, hi)
    };
    let (u01, u23) = (pairs(t[0], t[1]), pairs(t[2], t[3]));
    let first = _mm256_shuffle_ps::<0b10_00_10_00>(u01, u23);
    let second = _mm256_shuffle_ps::<0b11_01_11_01>(u01, u23);
    _mm256_add_ps(first, second)
}

/// # Safety
/// AVX2 and FMA; `out.len()` a multiple of 8; `v` holds `(w.len() - 1) · stride +
/// out.len()` values.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn weighted_sum(
    w: &[f32],
    v: &[f32],
    stride: usize,
    out: &mut [f32],
    accumulate: bool,
) {
    let d = out.len();
    let mut c = 0;
    while c + 64 <= d {
        let o = out.as_mut_ptr().add(c);
        columns::<8>(w, v.as_ptr().add(c), stride, o, accumulate);
        c += 64;
    }
    while c < d {
        let o = out.as_mut_ptr().add(c);
        columns::<1>(w, v.as_ptr().add(c), stride, o, accumulate);
        c += 8;
    }
}

/// [`weighted_sum`] for two queries' weights over the same values, accumulating into
/// `out0` and `out1`: each load of a value serves both.
///
/// # Safety
/// AVX2 and FMA; `w1.len() == w0.len()`; `out1.len() == out0.len()`, a multiple of 8;
/// `v` holds `(w0.len() - 1) · stride + out0.len()` values.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn weighted_sum2(
    w0: &[f32],
    w1: &[f32],
    v: &[f32],
    stride: usize,
    out0: &mut [f32],
    out1: &mut [f32],
) {
    let d = out0.len();
    let mut c = 0;
    while c + 32 <= d {
        let outs = (out0.as_mut_ptr().add(c), out1.as_mut_ptr().add(c));
        columns2::<4>(w0, w1, v.as_ptr().add(c), stride, outs);
        c += 32;
    }
    while c < d {
        let outs = (out0.as_mut_ptr().add(c), out1.as_mut_ptr().add(c));
        columns2::<1>(w0, w1, v.as_ptr().add(c), stride, outs);
        c += 8;
    }
}

/// `8·N` columns of two queries' sums, kept in registers across all positions.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn columns2<const N: usize>(
    w0: &[f32],
    w1: &[f32],
    v: *const f32,
    stride: usize,
    (out0, out1): (*mut f32, *mut f32),
) {
    let mut acc0: [__m256; N] = std::array::from_fn(|j| _mm256_loadu_ps(out0.add(8 * j)));
    let mut acc1: [__m256; N] = std::array::from_fn(|j| _mm256_loadu_ps(out1.add(8 * j)));
    for (p, (&a, &b)) in w0.iter().zip(w1).enumerate() {
        let (wa, wb) = (_mm256_set1_ps(a), _mm256_set1_ps(b));
        let row = v.add(p * stride);
        for j in 0..N {
            let x = _mm256_loadu_ps(row.add(8 * j));
            acc0[j] = _mm256_fmadd_ps(wa, x, acc0[j]);
            acc1[j] = _mm256_fmadd_ps(wb, x, acc1[j]);
        }
    }
    for j in 0..N {
        _mm256_storeu_ps(out0.add(8 * j), acc0[j]);
        _mm256_storeu_ps(out1.add(8 * j), acc1[j]);
    }
}

/// `8·N` output columns, kept in registers across all positions.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn columns<const N: usize>(
    w: &[f32],
    v: *const f32,
    stride: usize,
    out: *mut f32,
    accumulate: bool,
) {
    let mut acc = [_mm256_setzero_ps(); N];
    if accumulate {
        for (j, acc) in acc.iter_mut().enumerate() {
            *acc = _mm256_loadu_ps(out.add(8 * j));
        }
    }
    for (p, &wp) in w.iter().enumerate() {
        let wv = _mm256_set1_ps(wp);
        let row = v.add(p * stride);
        for (j, acc) in acc.iter_mut().enumerate() {
            *acc = _mm256_fmadd_ps(wv, _mm256_loadu_ps(row.add(8 * j)), *acc);
        }
    }
    for (j, acc) in acc.iter().enumerate() {
        _mm256_storeu_ps(out.add(8 * j), *acc);
    }
}
