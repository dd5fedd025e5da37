//! PPO clipped surrogate with verl's conventions (`compute_policy_loss`, `kl_penalty`,
//! `agg_loss`): ratio exp(logp − old_logp) (log-ratio clamped to ±20), clip range
//! [1 − low, 1 + high], dual clip at `c` for negative advantages, the k3 (`low_var_kl`)
//! estimator of KL(π‖π_ref) clamped to ±10 as a loss term, an optional entropy bonus, and
//! aggregation as verl's `loss_agg_mode`s: token-mean (default), sequence-mean of token sums
//! or token means, or token sums over a constant length (Dr. GRPO).
//!
//! Everything here is per token: tensors (K,) over the response tokens of a micro-batch.
//! Aggregation is a weighted sum with per-token weights ([`LossAgg::token_weights`]) built
//! from the whole mini-batch, so micro-batches of one mini-batch add up to the mini-batch
//! loss (gradient accumulation is exact).

use std::fmt;
use std::str::FromStr;

use candle_core::{DType, Result, Tensor};

/// How per-token losses become one number (verl's `loss_agg_mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum LossAgg {
    /// Mean over every response token of the mini-batch.
    #[default]
    TokenMean,
    /// Mean over responses of each response's token sum (Dr. GRPO's "constant normalizer"
    /// up to a factor).
    SeqMeanTokenSum,
    /// Mean over responses of each response's token mean (the original GRPO).
    SeqMeanTokenMean,
    /// Every token's loss summed and divided by a constant length, the response cap
    /// (`--max-new-tokens`): Dr. GRPO's normaliser, verl's `seq-mean-token-sum-norm`.
    SeqMeanTokenSumNorm,
}

impl LossAgg {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::TokenMean => "token-mean",
            Self::SeqMeanTokenSum => "seq-mean-token-sum",
            Self::SeqMeanTokenMean => "seq-mean-token-mean",
            Self::SeqMeanTokenSumNorm => "seq-mean-token-sum-norm",
        }
    }

    /// Per-token weights, given for each token the length of its response; `tokens` and
    /// `seqs` are the totals of the mini-batch the weights aggregate over, `norm_len` the
    /// constant length of [`LossAgg::SeqMeanTokenSumNorm`].
    pub fn token_weights(
        self,
        response_len: &[usize],
        tokens: usize,
        seqs: usize,
        norm_len: usize,
    ) -> Vec<f32> {
        response_len
            .iter()
            .map(|&len| match self {
                Self::TokenMean => 1.0 / tokens.max(1) as f64,
                Self::SeqMeanTokenSum => 1.0 / seqs.max(1) as f64,
                Self::SeqMeanTokenMean => 1.0 / (len.max(1) * seqs.max(1)) as f64,
                Self::SeqMeanTokenSumNorm => 1.0 / norm_len.max(1) as f64,
            } as f32)
            .collect()
    }
}

impl fmt::Display for LossAgg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for LossAgg {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "token-mean" => Ok(Self::TokenMean),
            "seq-mean-token-sum" => Ok(Self::SeqMeanTokenSum),
            "seq-mean-token-mean" => Ok(Self::SeqMeanTokenMean),
            "seq-mean-token-sum-norm" => Ok(Self::SeqMeanTokenSumNorm),
            other => Err(format!(
                "unknown loss aggregation {other:?} (expected token-mean, seq-mean-token-sum, \
                 seq-mean-token-mean or seq-mean-token-sum-norm)"
            )),
        }
    }
}

/// Loss hyper-parameters (verl defaults).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PpoConfig {
    pub clip_low: f64,
    pub clip_high: f64,
    /// Dual-clip bound `c` (> 1) for negative advantages; `None` disables it.
    pub clip_ratio_c: Option<f64>,
    /// Coefficient of the k3 KL loss; 0 skips the reference model entirely.
    pub kl_coef: f64,
    pub entropy_coef: f64,
    pub agg: LossAgg,
    /// The constant length of [`LossAgg::SeqMeanTokenSumNorm`] (the response cap).
    pub norm_len: usize,
}

impl Default for PpoConfig {
    fn default() -> Self {
        Self {
            clip_low: 0.2,
            clip_high: 0.2,
            clip_ratio_c: Some(3.0),
            kl_coef: 0.001,
            entropy_coef: 0.0,
            agg: LossAgg::TokenMean,
            norm_len: 1024,
        }
    }
}

impl PpoConfig {
    /// Checks every value once; the error names the flag and the value.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let in_range = |flag: &str, v: f64, lo: f64, hi: f64| {
            if v.is_finite() && v >= lo && v <= hi {
                Ok(())
            } else {
                Err(format!("--{flag} must be in [{lo}, {hi}], got {v}"))
            }
        };
        in_range("clip-low", self.clip_low, 0.0, 1.0)?;
        in_range("clip-high", self.clip_high, 0.0, 10.0)?;
        if let Some(c) = self.clip_ratio_c {
            if !(c.is_finite() && c > 1.0) {
                return Err(format!("--clip-ratio-c must be > 1, got {c}"));
            }
        }
        in_range("kl-coef", self.kl_coef, 0.0, 1e3)?;
        in_range("entropy-coef", self.entropy_coef, 0.0, 1e3)?;
        Ok(())
    }
}

/// Per-token inputs of one micro-batch, all (K,) f32 on one device.
pub struct TokenTerms<'a> {
    /// Current policy log-probs (carry the gradient).
    pub logp: &'a Tensor,
    /// Log-probs of the policy that sampled (constant).
    pub old_logp: &'a Tensor,
    /// Reference log-probs (constant); required when `kl_coef > 0`.
    pub ref_logp: Option<&'a Tensor>,
    pub advantages: &'a Tensor,
    /// Aggregation weights ([`LossAgg::token_weights`]).
    pub weights: &'a Tensor,
    /// Per-token entropy of the current policy; required when `entropy_coef > 0`.
    pub entropy: Option<&'a Tensor>,
}

/// Sums over the tokens of a micro-batch, to be combined over micro-batches and reported
/// as token means (verl's `masked_mean` of each quantity) with [`PpoMetrics::named`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PpoMetrics {
    pub tokens: usize,
    /// The aggregated losses (already weighted: they add over micro-batches).
    pub pg_loss: f64,
    pub kl_loss: f64,
    pub entropy_loss: f64,
    /// Token sums.
    pub clipped: f64,
    pub clipped_lower: f64,
    /// TRL's clip cases: the ratio below 1 − ε with a negative advantage, above 1 + ε with a
    /// positive one.
    pub clipped_low: f64,
    pub clipped_high: f64,
    pub ppo_kl: f64,
    pub ratio: f64,
    pub ratio_min: f64,
    pub ratio_max: f64,
    pub entropy: f64,
}

impl PpoMetrics {
    pub fn merge(&mut self, o: &PpoMetrics) {
        if self.tokens == 0 {
            *self = *o;
            return;
        }
        self.tokens += o.tokens;
        self.pg_loss += o.pg_loss;
        self.kl_loss += o.kl_loss;
        self.entropy_loss += o.entropy_loss;
        self.clipped += o.clipped;
        self.clipped_lower += o.clipped_lower;
        self.clipped_low += o.clipped_low;
        self.clipped_high += o.clipped_high;
        self.ppo_kl += o.ppo_kl;
        self.ratio += o.ratio;
        self.entropy += o.entropy;
        self.ratio_min = self.ratio_min.min(o.ratio_min);
        self.ratio_max = self.ratio_max.max(o.ratio_max);
    }

    pub fn named(&self) -> Vec<(&'static str, f64)> {
        let n = self.tokens.max(1) as f64;
        vec![
            ("pg_loss", self.pg_loss),
            ("kl_loss", self.kl_loss),
            ("entropy_loss", self.entropy_loss),
            ("pg_clipfrac", self.clipped / n),
            ("pg_clipfrac_lower", self.clipped_lower / n),
            ("clip_low_frac", self.clipped_low / n),
            ("clip_high_frac", self.clipped_high / n),
            ("ppo_kl", self.ppo_kl / n),
            ("ratio_mean", self.ratio / n),
            ("ratio_min", self.ratio_min),
            ("ratio_max", self.ratio_max),
            ("entropy", self.entropy / n),
            ("tokens", self.tokens as f64),
        ]
    }
}

pub struct PpoOutput {
    /// Scalar to back-propagate.
    pub loss: Tensor,
    pub metrics: PpoMetrics,
}

/// The k3 estimator exp(ref − logp) − (ref − logp) − 1, log-ratio clamped to ±20 and the
/// result to ±10 (verl `low_var_kl`). Non-negative; gradient w.r.t. logp: 1 − exp(ref − logp).
pub fn low_var_kl(logp: &Tensor, ref_logp: &Tensor) -> Result<Tensor> {
    let kl = (ref_logp - logp)?.clamp(-20f32, 20f32)?;
    let k3 = ((kl.exp()? - &kl)? - 1.0)?;
    k3.clamp(-10f32, 10f32)
}

/// Per-token PPO surrogate losses (to be minimized) and the masks behind the clip metrics.
fn surrogate(
    logp: &Tensor,
    old_logp: &Tensor,
    adv: &Tensor,
    cfg: &PpoConfig,
) -> Result<(Tensor, Tensor)> {
    let ratio = (logp - old_logp)?.clamp(-20f32, 20f32)?.exp()?;
    let neg_adv = adv.neg()?;
    let l1 = (&neg_adv * &ratio)?;
    let clipped = ratio.clamp((1.0 - cfg.clip_low) as f32, (1.0 + cfg.clip_high) as f32)?;
    let l2 = (&neg_adv * clipped)?;
    let clip1 = l1.maximum(&l2)?;
    let Some(c) = cfg.clip_ratio_c else {
        return Ok((clip1, ratio));
    };
    // Dual clip: for A < 0 the loss −A·ratio is unbounded as the ratio grows; cap it at −A·c.
    let l3 = (&neg_adv * c)?;
    let clip2 = clip1.minimum(&l3)?;
    let negative = adv.lt(0f32)?;
    Ok((negative.where_cond(&clip2, &clip1)?, ratio))
}

/// The micro-batch loss: Σ_k w_k·pg_k + kl_coef·Σ_k w_k·k3_k − entropy_coef·Σ_k w_k·H_k.
pub fn ppo_loss(t: &TokenTerms, cfg: &PpoConfig) -> Result<PpoOutput> {
    let w = t.weights;
    let (pg, ratio) = surrogate(t.logp, t.old_logp, t.advantages, cfg)?;
    let pg_loss = (&pg * w)?.sum_all()?;
    let mut loss = pg_loss.clone();
    let mut kl_value = 0.0;
    if cfg.kl_coef > 0.0 {
        let r = t.ref_logp.ok_or_else(|| {
            candle_core::Error::Msg("kl_coef > 0 needs reference log-probs".into())
        })?;
        let kl = (low_var_kl(t.logp, r)? * w)?.sum_all()?;
        kl_value = kl.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        loss = (loss + (kl * cfg.kl_coef)?)?;
    }
    let mut ent_value = 0.0;
    let mut ent_sum = 0.0;
    if let Some(h) = t.entropy {
        let e = (h * w)?.sum_all()?;
        ent_value = e.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        ent_sum = h.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
        if cfg.entropy_coef > 0.0 {
            loss = (loss - (e * cfg.entropy_coef)?)?;
        }
    } else if cfg.entropy_coef > 0.0 {
        candle_core::bail!("entropy_coef > 0 needs per-token entropies");
    }
    let mut metrics = clip_metrics(t, &ratio, cfg)?;
    metrics.pg_loss = pg_loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    metrics.kl_loss = kl_value;
    metrics.entropy_loss = ent_value;
    metrics.entropy = ent_sum;
    Ok(PpoOutput { loss, metrics })
}

/// Token counts of the clip cases and ratio statistics, read on the host.
fn clip_metrics(t: &TokenTerms, ratio: &Tensor, cfg: &PpoConfig) -> Result<PpoMetrics> {
    let host = |x: &Tensor| x.detach().to_dtype(DType::F64)?.to_vec1::<f64>();
    let (ratio, adv) = (host(ratio)?, host(t.advantages)?);
    let log_ratio = host(&(t.logp - t.old_logp)?)?;
    let (lo, hi) = (1.0 - cfg.clip_low, 1.0 + cfg.clip_high);
    let mut m = PpoMetrics {
        tokens: ratio.len(),
        ratio_min: f64::INFINITY,
        ratio_max: f64::NEG_INFINITY,
        ..Default::default()
    };
    for ((&r, &a), &lr) in ratio.iter().zip(&adv).zip(&log_ratio) {
        let l1 = -a * r;
        let l2 = -a * r.clamp(lo, hi);
        m.clipped += f64::from(u8::from(l2 > l1));
        m.clipped_low += f64::from(u8::from(r < lo && a < 0.0));
        m.clipped_high += f64::from(u8::from(r > hi && a > 0.0));
        if let Some(c) = cfg.clip_ratio_c {
            m.clipped_lower += f64::from(u8::from(a < 0.0 && l1.max(l2) > -a * c));
        }
        m.ppo_kl += -lr;
        m.ratio += r;
        m.ratio_min = m.ratio_min.min(r);
        m.ratio_max = m.ratio_max.max(r);
    }
    Ok(m)
}

/// Per-token entropy −Σ p·log p of logits (K, V), differentiable (plain candle ops: the
/// (K, V) intermediates live through the backward pass, so it is computed only when the
/// entropy bonus is on).
pub fn entropy_of_logits(logits: &Tensor) -> Result<Tensor> {
    let logp = candle_nn::ops::log_softmax(logits, candle_core::D::Minus1)?;
    (logp.exp()? * &logp)?.sum(candle_core::D::Minus1)?.neg()
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;

    fn t(v: &[f32]) -> Tensor {
        Tensor::new(v, &Device::Cpu).unwrap()
    }

    fn vec(x: &Tensor) -> Vec<f32> {
        x.to_vec1::<f32>().unwrap()
    }

    fn close(a: &[f32], b: &[f64], tol: f64) {
        assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
        for (x, y) in a.iter().zip(b) {
            assert!((*x as f64 - y).abs() < tol, "{a:?} vs {b:?}");
        }
    }

    /// Five tokens covering every branch: unclipped, clipped above (A > 0), clipped below
    /// (A < 0), dual-clipped (A < 0, ratio > c), and ratio below 1 − ε with A > 0 (not
    /// clipped: min keeps the unclipped, lower value of the objective).
    fn cases() -> (Vec<f64>, Vec<f64>) {
        let ratios = [1.1, 1.5, 0.5, 4.0, 0.5];
        let adv = [1.0, 2.0, -1.0, -0.5, 1.0];
        (ratios.to_vec(), adv.to_vec())
    }

    #[test]
    fn surrogate_values_and_gradient_match_hand_derivation() {
        let (ratios, adv) = cases();
        let logp = Var::new(
            ratios.iter().map(|r| r.ln() as f32).collect::<Vec<_>>(),
            &Device::Cpu,
        )
        .unwrap();
        let old = t(&[0.0; 5]);
        let a = t(&adv.iter().map(|x| *x as f32).collect::<Vec<_>>());
        let w = t(&[0.2; 5]);
        let cfg = PpoConfig {
            kl_coef: 0.0,
            ..Default::default()
        };
        let out = ppo_loss(
            &TokenTerms {
                logp: logp.as_tensor(),
                old_logp: &old,
                ref_logp: None,
                advantages: &a,
                weights: &w,
                entropy: None,
            },
            &cfg,
        )
        .unwrap();
        // Per-token losses by hand:
        //  1: −1·1.1 = −1.1 (inside the range)
        //  2: max(−2·1.5, −2·1.2) = −2.4 (clipped, constant in θ)
        //  3: max(1·0.5, 1·0.8) = 0.8 (clipped, constant)
        //  4: max(0.5·4, 0.5·1.2) = 2.0, dual clip min(2.0, 0.5·3) = 1.5 (constant)
        //  5: max(−0.5, −0.8) = −0.5 (unclipped)
        let per_token = [-1.1, -2.4, 0.8, 1.5, -0.5];
        let want: f64 = per_token.iter().sum::<f64>() * 0.2;
        let got = out.loss.to_scalar::<f32>().unwrap() as f64;
        assert!((got - want).abs() < 1e-5, "{got} vs {want}");
        // d/dlogp of −A·r = −A·r where unclipped, 0 where clipped; times the weight.
        let grads = out.loss.backward().unwrap();
        let g = grads.get(logp.as_tensor()).unwrap();
        close(&vec(g), &[-1.1 * 0.2, 0.0, 0.0, 0.0, -0.5 * 0.2], 1e-6);
        let m = out.metrics.named();
        let get = |k: &str| m.iter().find(|(n, _)| *n == k).unwrap().1;
        // Clipped (l2 > l1, verl's pg_clipfrac): tokens 2 and 3; token 4's clipped loss is the
        // smaller one, its bound comes from the dual clip (pg_clipfrac_lower).
        assert!((get("pg_clipfrac") - 2.0 / 5.0).abs() < 1e-9);
        assert!((get("pg_clipfrac_lower") - 1.0 / 5.0).abs() < 1e-9);
        assert!((get("ratio_max") - 4.0).abs() < 1e-5);
        assert!((get("ratio_min") - 0.5).abs() < 1e-6);
        let want_ppo_kl = -ratios.iter().map(|r| r.ln()).sum::<f64>() / 5.0;
        assert!((get("ppo_kl") - want_ppo_kl).abs() < 1e-6);
    }

    #[test]
    fn k3_value_and_gradient() {
        let lp = [-1.0f32, -2.0, -0.5, -30.0];
        let rf = [-1.0f32, -1.5, -1.5, -1.0];
        let logp = Var::new(&lp, &Device::Cpu).unwrap();
        let k3 = low_var_kl(logp.as_tensor(), &t(&rf)).unwrap();
        let want: Vec<f64> = lp
            .iter()
            .zip(&rf)
            .map(|(l, r)| {
                let d = ((r - l) as f64).clamp(-20.0, 20.0);
                (d.exp() - d - 1.0).clamp(-10.0, 10.0)
            })
            .collect();
        close(&vec(&k3), &want, 1e-4);
        assert_eq!(vec(&k3)[0], 0.0);
        assert_eq!(vec(&k3)[3], 10.0, "clamped at 10");
        let g = k3.sum_all().unwrap().backward().unwrap();
        // d/dlogp = 1 − exp(ref − logp) inside the clamp, 0 where clamped.
        let want_g = [0.0, 1.0 - 0.5f64.exp(), 1.0 - (-1.0f64).exp(), 0.0];
        close(&vec(g.get(logp.as_tensor()).unwrap()), &want_g, 1e-5);
    }

    #[test]
    fn kl_and_entropy_terms_enter_the_loss() {
        let logp = t(&[-1.0, -2.0]);
        let rf = t(&[-1.5, -1.0]);
        let h = t(&[2.0, 1.0]);
        let w = t(&[0.5, 0.5]);
        let a = t(&[0.0, 0.0]);
        let cfg = PpoConfig {
            kl_coef: 0.1,
            entropy_coef: 0.01,
            ..Default::default()
        };
        let out = ppo_loss(
            &TokenTerms {
                logp: &logp,
                old_logp: &logp,
                ref_logp: Some(&rf),
                advantages: &a,
                weights: &w,
                entropy: Some(&h),
            },
            &cfg,
        )
        .unwrap();
        let k3 = |d: f64| d.exp() - d - 1.0;
        let kl = 0.5 * (k3(-0.5) + k3(1.0));
        let want = 0.1 * kl - 0.01 * 1.5;
        let got = out.loss.to_scalar::<f32>().unwrap() as f64;
        assert!((got - want).abs() < 1e-6, "{got} vs {want}");
        assert!((out.metrics.kl_loss - kl).abs() < 1e-6);
    }

    #[test]
    fn aggregation_weights() {
        // Two responses of 1 and 3 tokens.
        let lens = [1, 3, 3, 3];
        assert_eq!(
            LossAgg::TokenMean.token_weights(&lens, 4, 2, 8),
            vec![0.25; 4]
        );
        assert_eq!(
            LossAgg::SeqMeanTokenSum.token_weights(&lens, 4, 2, 8),
            vec![0.5; 4]
        );
        let w = LossAgg::SeqMeanTokenMean.token_weights(&lens, 4, 2, 8);
        close(&w, &[0.5, 1.0 / 6.0, 1.0 / 6.0, 1.0 / 6.0], 1e-7);
        assert_eq!(
            LossAgg::SeqMeanTokenSumNorm.token_weights(&lens, 4, 2, 8),
            vec![0.125; 4]
        );
    }

    /// The four modes on per-token losses [2] and [1, 3, 5], against verl's `agg_loss` by
    /// hand: token-mean 11/4; seq-mean-token-sum (2 + 9)/2; seq-mean-token-mean (2 + 3)/2;
    /// seq-mean-token-sum-norm (2 + 9)/8 with a response cap of 8.
    #[test]
    fn aggregated_losses_match_verl_by_hand() {
        let lens = [1, 3, 3, 3];
        let loss = [2.0f32, 1.0, 3.0, 5.0];
        for (agg, want) in [
            (LossAgg::TokenMean, 11.0 / 4.0),
            (LossAgg::SeqMeanTokenSum, 11.0 / 2.0),
            (LossAgg::SeqMeanTokenMean, 5.0 / 2.0),
            (LossAgg::SeqMeanTokenSumNorm, 11.0 / 8.0),
        ] {
            let w = agg.token_weights(&lens, 4, 2, 8);
            let got: f32 = w.iter().zip(&loss).map(|(w, l)| w * l).sum();
            assert!((got as f64 - want).abs() < 1e-6, "{agg}: {got} vs {want}");
            assert_eq!(agg.as_str().parse::<LossAgg>(), Ok(agg));
        }
    }

    #[test]
    fn entropy_of_uniform_logits_is_log_v() {
        let logits = Tensor::zeros((2, 8), DType::F32, &Device::Cpu).unwrap();
        close(
            &vec(&entropy_of_logits(&logits).unwrap()),
            &[8f64.ln(); 2],
            1e-6,
        );
    }

    #[test]
    fn config_validation_names_the_flag() {
        let bad = PpoConfig {
            clip_low: 1.5,
            ..Default::default()
        };
        assert!(bad.validate().unwrap_err().contains("--clip-low"));
        let bad = PpoConfig {
            clip_ratio_c: Some(0.5),
            ..Default::default()
        };
        assert!(bad.validate().unwrap_err().contains("--clip-ratio-c"));
        assert!(PpoConfig::default().validate().is_ok());
    }
}
