//! The attention kernels on AVX-512: the AVX2 kernels' bits on 512-bit registers.

use super::avx2;
use std::arch::x86_64::*;

/// `out0[j] = (a0 · bs[j]) · scale`, `out1[j] = (a1 · bs[j]) · scale`: two
/// [`avx2::dot2x4`] calls' dot products, bit for bit. A register holds one key's
/// multiply-adds with `a0` in its low half and with `a1` in its high half, each lane's as
/// the 256-bit kernel's; the lanes are summed as [`avx2::lane_sums`] sums them, in both
/// halves at once.
///
/// # Safety
/// AVX-512F, AVX2 and FMA; `a1` and every `bs[j]` as long as `a0`, a multiple of 8; the
/// outputs hold 8 values each.
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) unsafe fn dot2x8(
    a0: &[f32],
    a1: &[f32],
    bs: &[&[f32]; 8],
    scale: f32,
    out0: &mut [f32],
    out1: &mut [f32],
) {
    debug_assert!(a1.len() == a0.len() && bs.iter().all(|b| b.len() == a0.len()));
    debug_assert!(out0.len() == 8 && out1.len() == 8);
    let mut acc = [_mm512_setzero_ps(); 8];
    for i in (0..a0.len()).step_by(8) {
        let x = _mm512_castpd_ps(_mm512_insertf64x4::<1>(
            _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(a0.as_ptr().add(i)))),
            _mm256_castps_pd(_mm256_loadu_ps(a1.as_ptr().add(i))),
        ));
        for (acc, b) in acc.iter_mut().zip(bs) {
            let key = _mm256_castps_pd(_mm256_loadu_ps(b.as_ptr().add(i)));
            let y = _mm512_castpd_ps(_mm512_broadcast_f64x4(key));
            *acc = _mm512_fmadd_ps(x, y, *acc);
        }
    }
    let dots = _mm512_mul_ps(lane_sums(&acc), _mm512_set1_ps(scale));
    _mm256_storeu_ps(out0.as_mut_ptr(), _mm512_castps512_ps256(dots));
    let high = _mm512_extractf64x4_pd::<1>(_mm512_castps_pd(dots));
    _mm256_storeu_ps(out1.as_mut_ptr(), _mm256_castpd_ps(high));
}

/// [`avx2::lane_sums`] in each 256-bit half: `[Σ lo(acc_0), …, Σ lo(acc_7) | Σ hi(acc_0),
/// …, Σ hi(acc_7)]`, the same additions in the same order.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn lane_sums(acc: &[__m512; 8]) -> __m512 {
    // Per half, [t_j | t_{j+4}] with t_j = lo128(acc_j) + hi128(acc_j) of that half:
    // 128-bit pieces (a0, b0, a2, b2) and (a1, b1, a3, b3) of a = acc_j, b = acc_{j+4}.
    let pick = |p: [i32; 4]| {
        let idx = |c: i32| [4 * c, 4 * c + 1, 4 * c + 2, 4 * c + 3];
        let [a, b, c, d] = p.map(idx);
        _mm512_setr_epi32(
            a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3], c[0], c[1], c[2], c[3], d[0], d[1],
            d[2], d[3],
        )
    };
    // Pieces 0-3 are the first operand's, 4-7 the second's.
    let (first, second) = (pick([0, 4, 2, 6]), pick([1, 5, 3, 7]));
    let halves = |j: usize| {
        let lo = _mm512_permutex2var_ps(acc[j], first, acc[j + 4]);
        let hi = _mm512_permutex2var_ps(acc[j], second, acc[j + 4]);
        _mm512_add_ps(lo, hi)
    };
    let t = [halves(0), halves(1), halves(2), halves(3)];
    let pairs = |a: __m512, b: __m512| {
        let (a, b) = (_mm512_castps_pd(a), _mm512_castps_pd(b));
        let lo = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        let hi = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        _mm512_add_ps(lo, hi)
    };
    let (u01, u23) = (pairs(t[0], t[1]), pairs(t[2], t[3]));
    let first = _mm512_shuffle_ps::<0b10_00_10_00>(u01, u23);
    let second = _mm512_shuffle_ps::<0b11_01_11_01>(u01, u23);
    _mm512_add_ps(first, second)
}

/// [`avx2::weighted_sum`].
///
/// # Safety
/// As [`avx2::weighted_sum`], plus AVX-512F.
#[target_feature(enable = "avx512f,avx2,fma")]
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
        columns::<4>(
            w,
            v.as_ptr().add(c),
            stride,
            out.as_mut_ptr().add(c),
            accumulate,
        );
        c += 64;
    }
    while c + 16 <= d {
        columns::<1>(
            w,
            v.as_ptr().add(c),
            stride,
            out.as_mut_ptr().add(c),
            accumulate,
        );
        c += 16;
    }
    if c < d {
        avx2::weighted_sum(w, &v[c..], stride, &mut out[c..], accumulate);
    }
}

/// [`avx2::weighted_sum2`].
///
/// # Safety
/// As [`avx2::weighted_sum2`], plus AVX-512F.
#[target_feature(enable = "avx512f,avx2,fma")]
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
    while c + 64 <= d {
        let outs = (out0.as_mut_ptr().add(c), out1.as_mut_ptr().add(c));
        columns2::<4>(w0, w1, v.as_ptr().add(c), stride, outs);
        c += 64;
    }
    while c + 16 <= d {
        let outs = (out0.as_mut_ptr().add(c), out1.as_mut_ptr().add(c));
        columns2::<1>(w0, w1, v.as_ptr().add(c), stride, outs);
        c += 16;
    }
    if c < d {
        avx2::weighted_sum2(w0, w1, &v[c..], stride, &mut out0[c..], &mut out1[c..]);
    }
}

/// [`avx2::weighted_sums_f16`].
///
/// # Safety
/// As [`avx2::weighted_sums_f16`], plus AVX-512F.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(super) unsafe fn weighted_sums_f16<const Q: usize>(
    ws: [&[f32]; Q],
    v: &[half::f16],
    stride: usize,
    d: usize,
    outs: [*mut f32; Q],
) {
    debug_assert!(ws.iter().all(|w| w.len() == ws[0].len()));
    let mut c = 0;
    while c + 64 <= d {
        columns_f16::<Q, 4>(ws, v.as_ptr().add(c), stride, outs.map(|o| o.add(c)));
        c += 64;
    }
    while c + 16 <= d {
        columns_f16::<Q, 1>(ws, v.as_ptr().add(c), stride, outs.map(|o| o.add(c)));
        c += 16;
    }
    if c < d {
        avx2::weighted_sums_f16(ws, &v[c..], stride, d - c, outs.map(|o| o.add(c)));
    }
}

#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
unsafe fn columns_f16<const Q: usize, const N: usize>(
    ws: [&[f32]; Q],
    v: *const half::f16,
    stride: usize,
    outs: [*mut f32; Q],
) {
    let mut acc: [[__m512; N]; Q] =
        std::array::from_fn(|i| std::array::from_fn(|j| _mm512_loadu_ps(outs[i].add(16 * j))));
    for p in 0..ws[0].len() {
        let w: [__m512; Q] = std::array::from_fn(|i| _mm512_set1_ps(*ws[i].get_unchecked(p)));
        let row = v.add(p * stride);
        for j in 0..N {
            let x = _mm512_cvtph_ps(_mm256_loadu_si256(row.add(16 * j).cast()));
            for (acc, w) in acc.iter_mut().zip(&w) {
                acc[j] = _mm512_fmadd_ps(*w, x, acc[j]);
            }
        }
    }
    for (acc, out) in acc.iter().zip(outs) {
        for (j, acc) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.add(16 * j), *acc);
        }
    }
}

#[target_feature(enable = "avx512f,avx2,fma")]
#[inline]
unsafe fn columns2<const N: usize>(
    w0: &[f32],
    w1: &[f32],
    v: *const f32,
    stride: usize,
    (out0, out1): (*mut f32, *mut f32),
) {
    let mut acc0: [__m512; N] = std::array::from_fn(|j| _mm512_loadu_ps(out0.add(16 * j)));
    let mut acc1: [__m512; N] = std::array::from_fn(|j| _mm512_loadu_ps(out1.add(16 * j)));
    for (p, (&a, &b)) in w0.iter().zip(w1).enumerate() {
        let (wa, wb) = (_mm512_set1_ps(a), _mm512_set1_ps(b));
        let row = v.add(p * stride);
        for j in 0..N {
            let x = _mm512_loadu_ps(row.add(16 * j));
            acc0[j] = _mm512_fmadd_ps(wa, x, acc0[j]);
            acc1[j] = _mm512_fmadd_ps(wb, x, acc1[j]);
        }
    }
    for j in 0..N {
        _mm512_storeu_ps(out0.add(16 * j), acc0[j]);
        _mm512_storeu_ps(out1.add(16 * j), acc1[j]);
    }
}

#[target_feature(enable = "avx512f,avx2,fma")]
#[inline]
unsafe fn columns<const N: usize>(
    w: &[f32],
    v: *const f32,
    stride: usize,
    out: *mut f32,
    accumulate: bool,
) {
    let mut acc = [_mm512_setzero_ps(); N];
    if accumulate {
        for (j, acc) in acc.iter_mut().enumerate() {
            *acc = _mm512_loadu_ps(out.add(16 * j));
        }
    }
    for (p, &wp) in w.iter().enumerate() {
        let wv = _mm512_set1_ps(wp);
        let row = v.add(p * stride);
        for (j, acc) in acc.iter_mut().enumerate() {
            *acc = _mm512_fmadd_ps(wv, _mm512_loadu_ps(row.add(16 * j)), *acc);
        }
    }
    for (j, acc) in acc.iter().enumerate() {
        _mm512_storeu_ps(out.add(16 * j), *acc);
    }
}
