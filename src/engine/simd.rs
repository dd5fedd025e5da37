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

/// What this CPU runs, detected once per process: every kernel choice (the element-wise
/// kernels here, the attention's and the int8 matmul's) reads this one record, so a process
/// never mixes arithmetic from two detections. `COLLABLLM_NO_WIDE` and `COLLABLLM_NO_VNNI`
/// (read once here) keep the 256-bit kernels for side-by-side figures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuFeatures {
    /// AVX2 with FMA.
    pub avx2_fma: bool,
    /// AVX with F16C (half-precision conversion).
    pub f16c: bool,
    /// AVX-512F.
    pub avx512f: bool,
    /// AVX-512BW.
    pub avx512bw: bool,
    /// AVX-512 VNNI with VL.
    pub avx512_vnni: bool,
    /// `COLLABLLM_NO_WIDE` is unset: 512-bit registers may be used.
    pub wide_allowed: bool,
    /// `COLLABLLM_NO_VNNI` is unset: VNNI may be used.
    pub vnni_allowed: bool,
}

impl CpuFeatures {
    /// This CPU's features (detected on the first call).
    pub fn get() -> CpuFeatures {
        static FEATURES: std::sync::OnceLock<CpuFeatures> = std::sync::OnceLock::new();
        *FEATURES.get_or_init(CpuFeatures::detect)
    }

    fn detect() -> CpuFeatures {
        #[cfg(target_arch = "x86_64")]
        {
            CpuFeatures {
                avx2_fma: is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
                f16c: is_x86_feature_detected!("avx") && is_x86_feature_detected!("f16c"),
                avx512f: is_x86_feature_detected!("avx512f"),
                avx512bw: is_x86_feature_detected!("avx512bw"),
                avx512_vnni: is_x86_feature_detected!("avx512vnni")
                    && is_x86_feature_detected!("avx512vl"),
                wide_allowed: std::env::var_os("COLLABLLM_NO_WIDE").is_none(),
                vnni_allowed: std::env::var_os("COLLABLLM_NO_VNNI").is_none(),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        CpuFeatures::default()
    }
}

/// The instruction set the element-wise kernels are compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    Avx512,
    Avx2,
    Baseline,
}

pub(crate) fn isa() -> Isa {
    let cpu = CpuFeatures::get();
    if cpu.avx512f {
        Isa::Avx512
    } else if cpu.avx2_fma {
        Isa::Avx2
    } else {
        Isa::Baseline
    }
}

/// Whether the hand-written kernels (int8 matmul, attention) may use 512-bit registers:
/// AVX-512F, unless `COLLABLLM_NO_WIDE` is set.
pub(crate) fn wide_registers() -> bool {
    let cpu = CpuFeatures::get();
    cpu.avx512f && cpu.wide_allowed
}

/// Defines `$name` dispatching to `$any` compiled for each instruction set. In tests a module
/// of the same name holds `on(isa, ..)`, the kernel compiled for one given instruction set,
/// so each compilation can be compared with the baseline one ([`available_isas`]).
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
                match $crate::engine::simd::isa() {
                    $crate::engine::simd::Isa::Avx512 => {
                        // SAFETY: `isa` detected the instruction set at run time.
                        return unsafe { avx512($($arg),*) };
                    }
                    $crate::engine::simd::Isa::Avx2 => {
                        // SAFETY: `isa` detected the instruction set at run time.
                        return unsafe { avx2($($arg),*) };
                    }
                    $crate::engine::simd::Isa::Baseline => {}
                }
            }
            $any($($arg),*)
        }

        #[cfg(test)]
        #[allow(dead_code)]
        $vis mod $name {
            #[allow(unused_imports)]
            use super::*;

            /// The kernel compiled for `isa`, which must be one this CPU runs.
            pub(crate) fn on(isa: $crate::engine::simd::Isa, $($arg: $ty),*) -> $ret {
                assert!(
                    $crate::engine::simd::available_isas().contains(&isa),
                    "{isa:?} does not run here"
                );
                #[cfg(target_arch = "x86_64")]
                {
                    #[target_feature(enable = "avx512f")]
                    unsafe fn avx512($($arg: $ty),*) -> $ret {
                        super::$any($($arg),*)
                    }
                    #[target_feature(enable = "avx2,fma")]
                    unsafe fn avx2($($arg: $ty),*) -> $ret {
                        super::$any($($arg),*)
                    }
                    match isa {
                        $crate::engine::simd::Isa::Avx512 => {
                            // SAFETY: checked above against the detected instruction sets.
                            return unsafe { avx512($($arg),*) };
                        }
                        $crate::engine::simd::Isa::Avx2 => {
                            // SAFETY: checked above against the detected instruction sets.
                            return unsafe { avx2($($arg),*) };
                        }
                        $crate::engine::simd::Isa::Baseline => {}
                    }
                }
                super::$any($($arg),*)
            }
        }
    };
}

/// The instruction sets this CPU runs, baseline first; says on stderr which are absent (their
/// compilations are then not compared by the tests that use this).
#[cfg(test)]
pub(crate) fn available_isas() -> Vec<Isa> {
    let cpu = CpuFeatures::get();
    let mut out = vec![Isa::Baseline];
    if cpu.avx2_fma {
        out.push(Isa::Avx2);
    } else {
        eprintln!("no AVX2/FMA here: those kernels are not compared");
    }
    if cpu.avx512f {
        out.push(Isa::Avx512);
    } else {
        eprintln!("no AVX-512F here: those kernels are not compared");
    }
    out
}

/// Seeded values in about [-4, 4) with some exact zeros and large magnitudes, for comparing
/// kernel compilations.
#[cfg(test)]
pub(crate) fn test_values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|i| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = (state >> 40) as f32 / (1u64 << 24) as f32;
            match i % 17 {
                0 => 0.0,
                5 => (u - 0.5) * 80.0,
                _ => (u - 0.5) * 8.0,
            }
        })
        .collect()
}

/// Asserts that `run(isa)` gives the baseline's bits on every instruction set this CPU runs.
#[cfg(test)]
pub(crate) fn assert_same_bits_on_every_isa(what: &str, run: impl Fn(Isa) -> Vec<f32>) {
    let isas = available_isas();
    let want: Vec<u32> = run(Isa::Baseline).iter().map(|v| v.to_bits()).collect();
    for isa in &isas[1..] {
        let got: Vec<u32> = run(*isa).iter().map(|v| v.to_bits()).collect();
        assert_eq!(
            got, want,
            "{what}: the {isa:?} build differs from the baseline"
        );
    }
}

pub(crate) use dispatch;

#[inline(always)]
fn swiglu_any(out: &mut [MaybeUninit<f32>], gate: &[f32], up: &[f32]) {
    for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
        o.write(g * sigmoid(*g) * u);
    }
}

// `out = silu(gate) ⊙ up`: the feed-forward gate of training (`train::ops`) and inference
// (`engine::llama`), one arithmetic; `out` may be uninitialized (inference writes fresh outputs).
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
    fn swiglu_gives_the_same_bits_on_every_isa() {
        for n in [1usize, 7, 16, 33, 1000] {
            let (g, u) = (test_values(n, 1), test_values(n, 2));
            assert_same_bits_on_every_isa("swiglu", |isa| {
                let mut out = vec![MaybeUninit::uninit(); n];
                swiglu::on(isa, &mut out, &g, &u);
                // SAFETY: the kernel wrote every value.
                out.iter().map(|v| unsafe { v.assume_init() }).collect()
            });
        }
    }

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
