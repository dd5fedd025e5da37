//! The int8 tile kernels on AVX-512 VNNI (`vpdpbusd` dot products), sharing the AVX2 kernels' row stores.

use super::avx2::store_rows;
use super::{Acts, Tile, Tile4, NC, QK, TILE_BLOCK, TILE_BLOCK4};
use std::arch::x86_64::*;

/// Activation rows that share one pass over a weight tile (AVX-512 has 32 vector registers).
const MR: usize = 8;
/// Q8_0 blocks the kernel asks for ahead of the one it computes: 3 KiB, ~170 ns of a
/// 16-row pass, past a tile's end into the next. `bench kernels --rows 16`, output head:
/// four blocks 1.92–1.97 ms, twelve 1.71–1.76 (eight to sixteen alike).
const PREFETCH_BLOCKS: usize = 12;
/// Q4_1 blocks asked for ahead: the same 3 KiB. Layers at 16 rows: eight blocks 7.3–7.4
/// ms, 24 6.6–6.7 (16 to 32 alike); at 4 rows 3.1–3.9 → 2.7.
const PREFETCH_BLOCKS4: usize = 24;

/// As `avx2::tile`, with `xu` the activations offset by 128 (`x ^ 0x80`).
///
/// # Safety
/// The CPU must support AVX2/FMA/F16C and AVX-512 VNNI/VL; `out` as in `tile_scalar`.
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
pub(super) unsafe fn tile(
    tile: &Tile,
    xu: &[i8],
    xd: &[f32],
    m: usize,
    k: usize,
    out: *mut f32,
    ld: usize,
) {
    debug_assert!(xu.len() >= m * k && xd.len() >= m * (k / QK));
    let (xu, xd) = (xu.as_ptr(), xd.as_ptr());
    let nb = k / QK;
    for_row_blocks!(vnni, m, rows, |r| (
        tile,
        xu.add(r * k),
        xd.add(r * nb),
        k,
        out.add(r * ld),
        ld
    ));
}

/// `R` activation rows against one tile, `C` integer accumulators per row (a divisor of
/// 8). Integer sums are exact, so a row's result depends on neither `R` nor `C`.
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
#[inline]
unsafe fn rows<const R: usize, const C: usize>(
    tile: &Tile,
    xu: *const i8,
    xd: *const f32,
    k: usize,
    out: *mut f32,
    ld: usize,
) {
    let nb = tile.nb;
    let wq = tile.wq.as_ptr();
    let ws = tile.ws.as_ptr();
    let sums = tile.sums.as_ptr();
    let mut accf = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        let wb = wq.add(b * TILE_BLOCK);
        // The hardware prefetcher alone left the first row block of each tile waiting on
        // its weights (measured: 16 rows 1.1-1.2x faster with this); one row is bound by
        // bandwidth whatever it does, so it is left alone. See `PREFETCH_BLOCKS`.
        if R > 1 {
            let ahead = wb.wrapping_add(PREFETCH_BLOCKS * TILE_BLOCK);
            for line in 0..TILE_BLOCK / 64 {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * line).cast());
            }
        }
        let yb = xu.add(b * QK);
        // Σ (x + 128)·w = Σ x·w + 128·Σw: start every row's sum at −128·Σw.
        let sum = _mm256_cvtepi16_epi32(_mm_loadu_si128(sums.add(b * NC).cast()));
        let start = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32::<7>(sum));
        let mut acci = [[_mm256_setzero_si256(); R]; C];
        acci[0] = [start; R];
        for g0 in (0..QK / 4).step_by(C) {
            for (c, chain) in acci.iter_mut().enumerate() {
                let g = g0 + c;
                let w = _mm256_load_si256(wb.add(g * 32).cast());
                for (r, acc) in chain.iter_mut().enumerate() {
                    let y = yb.add(r * k + g * 4).cast::<i32>().read_unaligned();
                    *acc = _mm256_dpbusd_epi32(*acc, _mm256_set1_epi32(y), w);
                }
            }
        }
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(ws.add(b * NC).cast()));
        for (r, acc) in accf.iter_mut().enumerate() {
            let mut s = acci[0][r];
            for chain in &acci[1..] {
                s = _mm256_add_epi32(s, chain[r]);
            }
            let d = _mm256_mul_ps(dw, _mm256_set1_ps(*xd.add(r * nb + b)));
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), d, *acc);
        }
    }
    store_rows(&accf, tile.ncols, out, ld);
}

/// As `avx2::tile4`, with `vpdpbusd` (unsigned nibbles times signed activations).
///
/// # Safety
/// The CPU must support AVX2/FMA/F16C and AVX-512 VNNI/VL; `out` as in `tile_scalar`.
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
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
    for_row_blocks!(vnni, m, rows4, |r| (tile, acts, r, k, out.add(r * ld), ld));
}

/// Rows `r0..r0 + R` against one Q4_1 tile, `C` integer accumulators per row (a divisor
/// of 8: the block's 4 registers × low and high nibbles).
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
#[inline]
unsafe fn rows4<const R: usize, const C: usize>(
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
    let low = _mm256_set1_epi8(0xf);
    let mut accf = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        let wb = wq.add(b * TILE_BLOCK4);
        // As in `rows`, `PREFETCH_BLOCKS4` ahead, past the tile's end into the next.
        if R > 1 {
            let ahead = wb.wrapping_add(PREFETCH_BLOCKS4 * TILE_BLOCK4);
            _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64).cast());
        }
        let yb = xq.add(b * QK);
        let mut acci = [[_mm256_setzero_si256(); R]; C];
        for g in 0..QK / 8 {
            let w = _mm256_load_si256(wb.add(g * 32).cast());
            let halves = [
                _mm256_and_si256(w, low),
                _mm256_and_si256(_mm256_srli_epi16::<4>(w), low),
            ];
            for (h, nibbles) in halves.into_iter().enumerate() {
                let chain = &mut acci[(2 * g + h) % C];
                for (r, acc) in chain.iter_mut().enumerate() {
                    let y = yb.add(r * k + h * (QK / 2) + g * 4);
                    let y = _mm256_set1_epi32(y.cast::<i32>().read_unaligned());
                    *acc = _mm256_dpbusd_epi32(*acc, nibbles, y);
                }
            }
        }
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(dm.add(b * 2 * NC).cast()));
        let mw = _mm256_cvtph_ps(_mm_loadu_si128(dm.add(b * 2 * NC + NC).cast()));
        for (r, acc) in accf.iter_mut().enumerate() {
            let mut s = acci[0][r];
            for chain in &acci[1..] {
                s = _mm256_add_epi32(s, chain[r]);
            }
            let d = _mm256_mul_ps(dw, _mm256_set1_ps(*xd.add(r * nb + b)));
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), d, *acc);
            *acc = _mm256_fmadd_ps(mw, _mm256_set1_ps(*xs.add(r * nb + b)), *acc);
        }
    }
    store_rows(&accf, tile.ncols, out, ld);
}

/// Two adjacent Q4_1 tiles of one part (columns `0..16` of `out`) on 512-bit registers:
/// where the float multiply-adds have a second 512-bit pipe, they no longer take turns
/// with `vpdpbusd`. Each lane does what `rows4`'s does, in the same order: the same bits.
///
/// # Safety
/// As `tile4`, plus AVX-512F/BW; `out` must hold `m` rows of `ld` floats with both tiles'
/// columns writable.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
pub(super) unsafe fn tile4_pair(
    tiles: [&Tile4; 2],
    acts: &Acts,
    m: usize,
    k: usize,
    out: *mut f32,
    ld: usize,
) {
    let nb = k / QK;
    debug_assert!(acts.q.len() >= m * k && acts.d.len() >= m * nb && acts.sum.len() >= m * nb);
    for_row_blocks!(wide, m, rows4_pair, |r| (
        tiles,
        acts,
        r,
        k,
        out.add(r * ld),
        ld
    ));
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
#[inline]
unsafe fn rows4_pair<const R: usize, const C: usize>(
    tiles: [&Tile4; 2],
    acts: &Acts,
    r0: usize,
    k: usize,
    out: *mut f32,
    ld: usize,
) {
    let nb = tiles[0].nb;
    let (wq0, wq1) = (tiles[0].wq.as_ptr(), tiles[1].wq.as_ptr());
    let (dm0, dm1) = (tiles[0].dm.as_ptr(), tiles[1].dm.as_ptr());
    let xq = acts.q.as_ptr().add(r0 * k);
    let (xd, xs) = (acts.d.as_ptr().add(r0 * nb), acts.sum.as_ptr().add(r0 * nb));
    let low = _mm512_set1_epi8(0xf);
    let mut accf = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        let (wb0, wb1) = (wq0.add(b * TILE_BLOCK4), wq1.add(b * TILE_BLOCK4));
        if R > 1 {
            for wb in [wb0, wb1] {
                let ahead = wb.wrapping_add(PREFETCH_BLOCKS4 * TILE_BLOCK4);
                _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64).cast());
            }
        }
        let yb = xq.add(b * QK);
        let mut acci = [[_mm512_setzero_si512(); R]; C];
        for g in 0..QK / 8 {
            let w = _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_load_si256(wb0.add(g * 32).cast())),
                _mm256_load_si256(wb1.add(g * 32).cast()),
            );
            let halves = [
                _mm512_and_si512(w, low),
                _mm512_and_si512(_mm512_srli_epi16::<4>(w), low),
            ];
            for (h, nibbles) in halves.into_iter().enumerate() {
                let chain = &mut acci[(2 * g + h) % C];
                for (r, acc) in chain.iter_mut().enumerate() {
                    let y = yb.add(r * k + h * (QK / 2) + g * 4);
                    let y = _mm512_set1_epi32(y.cast::<i32>().read_unaligned());
                    *acc = _mm512_dpbusd_epi32(*acc, nibbles, y);
                }
            }
        }
        let half = |p: *const u16| _mm_loadu_si128(p.cast());
        let both = |a, b| _mm512_cvtph_ps(_mm256_set_m128i(b, a));
        let dw = both(half(dm0.add(b * 2 * NC)), half(dm1.add(b * 2 * NC)));
        let mw = both(
            half(dm0.add(b * 2 * NC + NC)),
            half(dm1.add(b * 2 * NC + NC)),
        );
        for (r, acc) in accf.iter_mut().enumerate() {
            let mut s = acci[0][r];
            for chain in &acci[1..] {
                s = _mm512_add_epi32(s, chain[r]);
            }
            let d = _mm512_mul_ps(dw, _mm512_set1_ps(*xd.add(r * nb + b)));
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), d, *acc);
            *acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(*xs.add(r * nb + b)), *acc);
        }
    }
    store_pair(&accf, [tiles[0].ncols, tiles[1].ncols], out, ld);
}

/// Two adjacent Q8_0 tiles of one part on 512-bit registers, as [`tile4_pair`]: each
/// lane does what `rows`' does, in the same order.
///
/// # Safety
/// As `tile`, plus AVX-512F/BW; `out` must hold `m` rows of `ld` floats with both tiles'
/// columns writable.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
pub(super) unsafe fn tile_pair(
    tiles: [&Tile; 2],
    xu: &[i8],
    xd: &[f32],
    m: usize,
    k: usize,
    out: *mut f32,
    ld: usize,
) {
    debug_assert!(xu.len() >= m * k && xd.len() >= m * (k / QK));
    let (xu, xd) = (xu.as_ptr(), xd.as_ptr());
    let nb = k / QK;
    for_row_blocks!(wide, m, rows_pair, |r| (
        tiles,
        xu.add(r * k),
        xd.add(r * nb),
        k,
        out.add(r * ld),
        ld
    ));
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
#[inline]
unsafe fn rows_pair<const R: usize, const C: usize>(
    tiles: [&Tile; 2],
    xu: *const i8,
    xd: *const f32,
    k: usize,
    out: *mut f32,
    ld: usize,
) {
    let nb = tiles[0].nb;
    let (wq0, wq1) = (tiles[0].wq.as_ptr(), tiles[1].wq.as_ptr());
    let (ws0, ws1) = (tiles[0].ws.as_ptr(), tiles[1].ws.as_ptr());
    let (sums0, sums1) = (tiles[0].sums.as_ptr(), tiles[1].sums.as_ptr());
    let half = |p: *const u16| _mm_loadu_si128(p.cast());
    let mut accf = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        let (wb0, wb1) = (wq0.add(b * TILE_BLOCK), wq1.add(b * TILE_BLOCK));
        if R > 1 {
            for wb in [wb0, wb1] {
                let ahead = wb.wrapping_add(PREFETCH_BLOCKS * TILE_BLOCK);
                for line in 0..TILE_BLOCK / 64 {
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * line).cast());
                }
            }
        }
        let yb = xu.add(b * QK);
        let sum = _mm512_cvtepi16_epi32(_mm256_set_m128i(
            half(sums1.add(b * NC).cast()),
            half(sums0.add(b * NC).cast()),
        ));
        let start = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32::<7>(sum));
        let mut acci = [[_mm512_setzero_si512(); R]; C];
        acci[0] = [start; R];
        for g0 in (0..QK / 4).step_by(C) {
            for (c, chain) in acci.iter_mut().enumerate() {
                let g = g0 + c;
                let w = _mm512_inserti64x4::<1>(
                    _mm512_castsi256_si512(_mm256_load_si256(wb0.add(g * 32).cast())),
                    _mm256_load_si256(wb1.add(g * 32).cast()),
                );
                for (r, acc) in chain.iter_mut().enumerate() {
                    let y = yb.add(r * k + g * 4).cast::<i32>().read_unaligned();
                    *acc = _mm512_dpbusd_epi32(*acc, _mm512_set1_epi32(y), w);
                }
            }
        }
        let dw = _mm512_cvtph_ps(_mm256_set_m128i(
            half(ws1.add(b * NC)),
            half(ws0.add(b * NC)),
        ));
        for (r, acc) in accf.iter_mut().enumerate() {
            let mut s = acci[0][r];
            for chain in &acci[1..] {
                s = _mm512_add_epi32(s, chain[r]);
            }
            let d = _mm512_mul_ps(dw, _mm512_set1_ps(*xd.add(r * nb + b)));
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), d, *acc);
        }
    }
    store_pair(&accf, [tiles[0].ncols, tiles[1].ncols], out, ld);
}

/// Stores 16-column rows: the low halves as one tile's columns, the high as the next's.
#[target_feature(enable = "avx2,avx512f")]
#[inline]
unsafe fn store_pair<const R: usize>(
    accf: &[__m512; R],
    ncols: [usize; 2],
    out: *mut f32,
    ld: usize,
) {
    let lo: [__m256; R] = std::array::from_fn(|r| _mm512_castps512_ps256(accf[r]));
    let hi: [__m256; R] = std::array::from_fn(|r| {
        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(accf[r])))
    });
    store_rows(&lo, ncols[0], out, ld);
    store_rows(&hi, ncols[1], out.add(NC), ld);
}
