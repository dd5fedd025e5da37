//! Vectorized element-wise kernels shared by the training ops and the CPU attention: each row
//! kernel is written once as plain loops over lanes and compiled for AVX-512 and AVX2 + FMA
//! besides the baseline ([`dispatch`]), the instruction set chosen at run time (the crate
//! targets baseline x86-64, where loops do not vectorize past SSE2). Plain multiplies and adds
//! are never contracted into FMAs, so every compilation gives the same bits. The exponential
//! is a branch-free polynomial ([`exp`]): the standard library's is a call per element, which
//! was the cost of softmaxes and SwiGLU.

use std::mem::MaybeUninit;

/// e^x: Cephes' `expf` range reduction and polynomial (relative error ~1e-7), branch-free so
/// that loops over it vectorize. 0 below −87.3 (so a masked −∞ stays an exact 0), ~1.6e38
/// above 88 instead of infinity; NaN stays NaN.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // 1.5·2²³: adding it rounds to an integer held in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let x0 = x;
    let x = x.clamp(-87.3, 88.0);
    let t = x * LOG2E + ROUND;
    let n = t - ROUND;
    let n_int = t.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
    let r = x - n * 0.693_359_4 + n * 2.121_944_4e-4;
    let p = 1.987_569_2e-4;
    let p = p * r + 1.398_2e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    let e = y * f32::from_bits(((n_int + 127) as u32) << 23);
    if x0 > -87.3 || x0.is_nan() {
        e
    } else {
        0.0
    }
}

/// The logistic function 1 / (1 + e^−x), through [`exp`].
#[inline(always)]
pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isa {
    Avx512,
    Avx2,
    Baseline,
}

pub(crate) fn isa() -> Isa {
    static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                return Isa::Avx2;
            }
        }
        Isa::Baseline
    })
}

/// Whether the hand-written kernels (int8 matmul, attention) may use 512-bit registers:
/// AVX-512F, unless `COLLABLLM_NO_WIDE` is set (for side-by-side figures). Decided once.
pub(crate) fn wide_registers() -> bool {
    static WIDE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WIDE.get_or_init(|| isa() == Isa::Avx512 && std::env::var_os("COLLABLLM_NO_WIDE").is_none())
}

/// Defines `$name` dispatching to `$any` compiled for each instruction set.
macro_rules! dispatch {
    ($vis:vis $name:ident, $any:ident, ($($arg:ident: $ty:ty),*) -> $ret:ty) => {
        $vis fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn avx512($($arg: $ty),*) -> $ret {
                    $any($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) -> $ret {
                    $any($($arg),*)
                }
                match $crate::simd::isa() {
                    // SAFETY: `isa` detected the instruction set at run time.
                    $crate::simd::Isa::Avx512 => return unsafe { avx512($($arg),*) },
                    $crate::simd::Isa::Avx2 => return unsafe { avx2($($arg),*) },
                    $crate::simd::Isa::Baseline => {}
                }
            }
            $any($($arg),*)
        }
    };
}

pub(crate) use dispatch;

#[inline(always)]
fn swiglu_any(out: &mut [MaybeUninit<f32>], gate: &[f32], up: &[f32]) {
    for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
        o.write(g * sigmoid(*g) * u);
    }
}

// `out = silu(gate) ⊙ up`: the feed-forward gate of training (`train::ops`) and inference
// (`llm::llama`), one arithmetic; `out` may be uninitialized (inference writes fresh outputs).
dispatch!(pub(crate) swiglu, swiglu_any,
    (out: &mut [MaybeUninit<f32>], gate: &[f32], up: &[f32]) -> ());

/// Initialized values as a slice to overwrite (for kernels that also write fresh outputs).
///
/// # Safety
/// Only initialized values may be written through the result (`MaybeUninit::uninit()`
/// written there would leave `values` uninitialized).
pub(crate) unsafe fn as_uninit(values: &mut [f32]) -> &mut [MaybeUninit<f32>] {
    // SAFETY: the same layout; the caller writes only initialized values.
    unsafe { &mut *(values as *mut [f32] as *mut [MaybeUninit<f32>]) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_close_to_the_standard_librarys() {
        let mut worst = 0f64;
        for i in 0..=200_000 {
            let x = -90.0 + 91.0 * i as f32 / 200_000.0;
            let (got, want) = (exp(x) as f64, (x as f64).exp());
            if want > 1e-37 {
                worst = worst.max((got - want).abs() / want);
            }
        }
        assert!(worst < 3e-7, "relative error {worst}");
    }

    #[test]
    fn sigmoid_is_close_to_the_standard_librarys() {
        for i in 0..=20_000 {
            let x = -100.0 + 200.0 * i as f32 / 20_000.0;
            let want = 1.0 / (1.0 + (-(x as f64)).exp());
            assert!(
                (sigmoid(x) as f64 - want).abs() < 2e-7 * want.max(1e-30) + 1e-38,
                "{x}"
            );
        }
    }
}
