//! DPO losses and metrics exactly as TRL's `DPOTrainer` defines them, with
//! `h = (π_c − π_r) − (ref_c − ref_r)` (policy and reference sequence log-probs of the chosen
//! and rejected completions), β the temperature and ε the label smoothing:
//!
//! - `sigmoid`: −(1−ε)·logσ(βh) − ε·logσ(−βh)
//! - `robust`:  (−(1−ε)·logσ(βh) + ε·logσ(−βh)) / (1−2ε)
//! - `hinge`:   relu(1 − βh)
//! - `ipo`:     (h − 1/(2β))², on length-averaged log-probs (see [`LossType::average_logps`])
//!
//! The loss is the mean over the batch. Metrics carry TRL's names.

use std::fmt;
use std::str::FromStr;

use candle_core::{DType, Result, Tensor};

/// Which DPO loss.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LossType {
    #[default]
    Sigmoid,
    Robust,
    Hinge,
    Ipo,
}

impl LossType {
    pub const ALL: [LossType; 4] = [
        LossType::Sigmoid,
        LossType::Robust,
        LossType::Hinge,
        LossType::Ipo,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            LossType::Sigmoid => "sigmoid",
            LossType::Robust => "robust",
            LossType::Hinge => "hinge",
            LossType::Ipo => "ipo",
        }
    }

    /// TRL divides the sequence log-probs by the completion length for `ipo`.
    pub fn average_logps(self) -> bool {
        self == LossType::Ipo
    }
}

impl fmt::Display for LossType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for LossType {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        LossType::ALL
            .into_iter()
            .find(|t| t.as_str() == s)
            .ok_or_else(|| format!("unknown DPO loss `{s}` (sigmoid, robust, hinge, ipo)"))
    }
}

/// Loss settings (TRL defaults: sigmoid, β = 0.1, no label smoothing).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DpoConfig {
    pub loss_type: LossType,
    pub beta: f64,
    pub label_smoothing: f64,
}

impl Default for DpoConfig {
    fn default() -> Self {
        Self {
            loss_type: LossType::Sigmoid,
            beta: 0.1,
            label_smoothing: 0.0,
        }
    }
}

impl DpoConfig {
    pub fn validate(&self) -> std::result::Result<(), String> {
        if !(self.beta > 0.0 && self.beta.is_finite()) {
            return Err(format!("beta must be positive, got {}", self.beta));
        }
        if !(0.0..0.5).contains(&self.label_smoothing) {
            return Err(format!(
                "label_smoothing must be in [0, 0.5), got {}",
                self.label_smoothing
            ));
        }
        Ok(())
    }
}

/// Batch-mean metrics under TRL's names.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DpoMetrics {
    pub loss: f64,
    pub rewards_chosen: f64,
    pub rewards_rejected: f64,
    pub rewards_margins: f64,
    pub rewards_accuracies: f64,
    pub logps_chosen: f64,
    pub logps_rejected: f64,
}

impl DpoMetrics {
    /// `(TRL name, value)` pairs: `loss`, `rewards/chosen`, `rewards/rejected`,
    /// `rewards/accuracies`, `rewards/margins`, `logps/chosen`, `logps/rejected`.
    pub fn named(&self) -> Vec<(&'static str, f64)> {
        vec![
            ("loss", self.loss),
            ("rewards/chosen", self.rewards_chosen),
            ("rewards/rejected", self.rewards_rejected),
            ("rewards/accuracies", self.rewards_accuracies),
            ("rewards/margins", self.rewards_margins),
            ("logps/chosen", self.logps_chosen),
            ("logps/rejected", self.logps_rejected),
        ]
    }

    /// Element-wise mean of several batches' metrics (for gradient accumulation / logging).
    pub fn mean(all: &[DpoMetrics]) -> DpoMetrics {
        let n = all.len().max(1) as f64;
        let s = |f: fn(&DpoMetrics) -> f64| all.iter().map(f).sum::<f64>() / n;
        DpoMetrics {
            loss: s(|m| m.loss),
            rewards_chosen: s(|m| m.rewards_chosen),
            rewards_rejected: s(|m| m.rewards_rejected),
            rewards_margins: s(|m| m.rewards_margins),
            rewards_accuracies: s(|m| m.rewards_accuracies),
            logps_chosen: s(|m| m.logps_chosen),
            logps_rejected: s(|m| m.logps_rejected),
        }
    }
}

/// The scalar loss to back-propagate, and its metrics.
pub struct DpoOutput {
    pub loss: Tensor,
    pub metrics: DpoMetrics,
}

/// logσ(x) = −softplus(−x) = min(x, 0) − log(1 + e^{−|x|}), stable for any x.
///
/// `min(x, 0)` and `|x|` are written as `x` times a constant sign mask, so the gradient is
/// σ(−x) everywhere, x = 0 included. Through candle's `relu` and `abs` it would be 1.5
/// instead of 0.5 at 0 (both take the slope of the right side there), and x = 0 is exactly
/// where every DPO run starts (reference = policy): the first step's gradients were 3× too
/// large.
pub fn log_sigmoid(x: &Tensor) -> Result<Tensor> {
    let right = x.ge(0.0)?.to_dtype(x.dtype())?; // 1 where x ≥ 0, else 0; no gradient
    let min0 = (x * right.affine(-1.0, 1.0)?)?;
    let abs = (x * right.affine(2.0, -1.0)?)?;
    let tail = (abs.neg()?.exp()? + 1.0)?.log()?;
    min0 - tail
}

/// `max(x, 0)` with PyTorch's gradient at 0 (0; candle's `relu` gives 1 there).
fn relu_torch(x: &Tensor) -> Result<Tensor> {
    x * x.gt(0.0)?.to_dtype(x.dtype())?
}

fn mean_f64(t: &Tensor) -> Result<f64> {
    t.to_dtype(DType::F64)?.mean_all()?.to_scalar::<f64>()
}

/// Per-pair losses (B,) from the four (B,) log-prob tensors.
pub fn dpo_losses(
    policy_chosen: &Tensor,
    policy_rejected: &Tensor,
    ref_chosen: &Tensor,
    ref_rejected: &Tensor,
    cfg: &DpoConfig,
) -> Result<Tensor> {
    let h = ((policy_chosen - policy_rejected)? - (ref_chosen - ref_rejected)?)?;
    let (beta, eps) = (cfg.beta, cfg.label_smoothing);
    let bh = (&h * beta)?;
    match cfg.loss_type {
        LossType::Sigmoid => {
            let a = (log_sigmoid(&bh)? * -(1.0 - eps))?;
            if eps == 0.0 {
                Ok(a)
            } else {
                a - (log_sigmoid(&bh.neg()?)? * eps)?
            }
        }
        LossType::Robust => {
            let a = (log_sigmoid(&bh)? * -(1.0 - eps))?;
            let b = (log_sigmoid(&bh.neg()?)? * eps)?;
            (a + b)? / (1.0 - 2.0 * eps)
        }
        LossType::Hinge => relu_torch(&bh.affine(-1.0, 1.0)?),
        LossType::Ipo => (h - 1.0 / (2.0 * beta))?.sqr(),
    }
}

/// The batch-mean DPO loss and TRL's metrics. The reference log-probs should carry no
/// gradient (detach them, or compute them from a frozen copy / a cache).
pub fn dpo_loss(
    policy_chosen: &Tensor,
    policy_rejected: &Tensor,
    ref_chosen: &Tensor,
    ref_rejected: &Tensor,
    cfg: &DpoConfig,
) -> Result<DpoOutput> {
    let (ref_chosen, ref_rejected) = (ref_chosen.detach(), ref_rejected.detach());
    let losses = dpo_losses(
        policy_chosen,
        policy_rejected,
        &ref_chosen,
        &ref_rejected,
        cfg,
    )?;
    let loss = losses.mean_all()?;
    let rc = ((policy_chosen.detach() - &ref_chosen)? * cfg.beta)?;
    let rr = ((policy_rejected.detach() - &ref_rejected)? * cfg.beta)?;
    let acc = rc.gt(&rr)?.to_dtype(DType::F64)?;
    let metrics = DpoMetrics {
        loss: loss.to_dtype(DType::F64)?.to_scalar::<f64>()?,
        rewards_chosen: mean_f64(&rc)?,
        rewards_rejected: mean_f64(&rr)?,
        rewards_margins: mean_f64(&(&rc - &rr)?)?,
        rewards_accuracies: mean_f64(&acc)?,
        logps_chosen: mean_f64(policy_chosen)?,
        logps_rejected: mean_f64(policy_rejected)?,
    };
    Ok(DpoOutput { loss, metrics })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn grad_of(f: impl Fn(&Tensor) -> Result<Tensor>, xs: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let x = Var::new(xs, &Device::Cpu).unwrap();
        let y = f(x.as_tensor()).unwrap();
        let g = y.sum_all().unwrap().backward().unwrap();
        (
            y.to_vec1().unwrap(),
            g.get(x.as_tensor()).unwrap().to_vec1().unwrap(),
        )
    }

    /// logσ and its gradient σ(−x) everywhere, at 0 (DPO's first step) and far out.
    #[test]
    fn log_sigmoid_has_the_exact_gradient_at_zero_and_far_out() {
        let xs = [0.0, 1e-3, -1e-3, 2.5, -2.5, 40.0, -40.0, 800.0, -800.0];
        let (y, g) = grad_of(log_sigmoid, &xs);
        for ((x, y), g) in xs.iter().zip(y).zip(g) {
            let sig_neg = 1.0 / (1.0 + x.exp()); // σ(−x)
            let want = if *x > -700.0 {
                -(1.0 + (-x).exp()).ln()
            } else {
                *x
            };
            assert!((y - want).abs() < 1e-12, "logσ({x}) = {y}, want {want}");
            assert!(
                (g - sig_neg).abs() < 1e-12,
                "logσ'({x}) = {g}, want {sig_neg}"
            );
        }
    }

    /// At the start of training (reference = policy, h = 0) the sigmoid loss's slope is
    /// −β/2, and the hinge loss's kink at βh = 1 has PyTorch's zero slope.
    #[test]
    fn dpo_loss_slopes_at_the_start_and_at_the_hinge_kink() {
        let cfg = DpoConfig::default();
        let zero = Tensor::new(&[0.0f64], &Device::Cpu).unwrap();
        let (_, g) = grad_of(|pc| dpo_losses(pc, &zero, &zero, &zero, &cfg), &[0.0]);
        assert!((g[0] + cfg.beta / 2.0).abs() < 1e-12, "slope {}", g[0]);
        let hinge = DpoConfig {
            loss_type: LossType::Hinge,
            ..cfg
        };
        let (_, g) = grad_of(
            |pc| dpo_losses(pc, &zero, &zero, &zero, &hinge),
            &[1.0 / hinge.beta],
        );
        assert_eq!(g[0], 0.0);
    }
}
