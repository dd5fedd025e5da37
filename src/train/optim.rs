//! Optimizer conventions of HF `Trainer` / TRL: AdamW without weight decay by
//! default, linear warmup then cosine decay, global gradient-norm clipping.

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, DType, InplaceOp1, Layout, Result, Tensor, Var};
use candle_nn::ParamsAdamW;

/// `TrainingArguments` defaults: β₁ 0.9, β₂ 0.999, ε 1e-8, weight decay 0 (candle's own
/// default decay is 0.01).
pub fn trl_adamw_params(lr: f64) -> ParamsAdamW {
    ParamsAdamW {
        lr,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
    }
}

/// Warmup steps for a warmup ratio, as `TrainingArguments.get_warmup_steps`: ⌈total·ratio⌉.
pub fn warmup_steps(total_steps: usize, warmup_ratio: f64) -> usize {
    (total_steps as f64 * warmup_ratio).ceil() as usize
}

/// Learning-rate multiplier of `get_cosine_schedule_with_warmup` (half a cosine) for the
/// update after `step` completed optimizer steps: the first update (step 0) uses
/// `0 / warmup` when there is a warmup, as in HF.
pub fn cosine_with_warmup(step: usize, total_steps: usize, warmup: usize) -> f64 {
    if step < warmup {
        return step as f64 / warmup.max(1) as f64;
    }
    let progress = (step - warmup) as f64 / (total_steps.saturating_sub(warmup)).max(1) as f64;
    (0.5 * (1.0 + (std::f64::consts::PI * progress).cos())).max(0.0)
}

/// Scales the gradients of `vars` in place so that their global L2 norm is at most
/// `max_norm` (`torch.nn.utils.clip_grad_norm_`: factor `max_norm / (norm + 1e-6)`, capped at
/// 1). `max_norm` 0 only measures (HF `Trainer` clips only when `max_grad_norm > 0`).
/// Returns the norm before clipping (what HF logs as `grad_norm`).
pub fn clip_grad_norm(grads: &mut GradStore, vars: &[Var], max_norm: f64) -> Result<f64> {
    let mut sq = 0f64;
    for v in vars {
        if let Some(g) = grads.get(v.as_tensor()) {
            sq += squared_norm(g)?;
        }
    }
    let norm = sq.sqrt();
    let coef = max_norm / (norm + 1e-6);
    if max_norm > 0.0 && coef < 1.0 {
        for v in vars {
            if let Some(g) = grads.remove(v.as_tensor()) {
                grads.insert(v.as_tensor(), scale(g, coef)?);
            }
        }
    }
    Ok(norm)
}

/// Σ g² in f64 (read in place for CPU f32 tensors; no f64 copy of a large tensor). Finite
/// for every finite f32 tensor, so also the cheap test for a NaN or an infinity.
pub(crate) fn squared_norm(g: &Tensor) -> Result<f64> {
    if g.device().is_cpu() && g.dtype() == DType::F32 && g.is_contiguous() {
        let (storage, layout) = g.storage_and_layout();
        let data = super::ops::cpu_f32(&storage, layout, "gradient")?;
        return Ok(data
            .chunks(4096)
            .map(|c| c.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>())
            .sum());
    }
    g.to_dtype(DType::F64)?.sqr()?.sum_all()?.to_scalar::<f64>()
}

/// `g · coef`, in place for CPU f32 gradients.
fn scale(g: Tensor, coef: f64) -> Result<Tensor> {
    struct Scale(f32);
    impl InplaceOp1 for Scale {
        fn name(&self) -> &'static str {
            "scale"
        }
        fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
            let data = super::ops::cpu_f32_mut(s, l, "gradient")?;
            data.iter_mut().for_each(|x| *x *= self.0);
            Ok(())
        }
    }
    if g.device().is_cpu() && g.dtype() == DType::F32 && g.is_contiguous() {
        g.inplace_op1(&Scale(coef as f32))?;
        return Ok(g);
    }
    g * coef
}

/// Adds the gradients of `vars` in `more` to `acc` (gradient accumulation over micro-batches;
/// scale each micro-batch loss by 1/k to get the mean).
pub fn accumulate_grads(acc: &mut GradStore, mut more: GradStore, vars: &[Var]) -> Result<()> {
    for v in vars {
        let Some(g) = more.remove(v.as_tensor()) else {
            continue;
        };
        let sum = match acc.remove(v.as_tensor()) {
            Some(a) => (a + g)?,
            None => g,
        };
        acc.insert(v.as_tensor(), sum);
    }
    Ok(())
}
