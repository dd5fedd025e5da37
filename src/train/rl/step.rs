//! One RL update of a [`TrainLlama`] from a batch of scored [`Group`]s (verl's actor update):
//!
//! 1. group advantages ([`super::advantage`]); responses tokenized and packed ([`super::batch`]);
//! 2. old log-probs recomputed in f32 on the current weights (the ones that sampled, before
//!    any change) and, when the KL term is on, reference log-probs from the initial weights
//!    (a frozen copy for full fine-tuning; the base model with adapters switched off for LoRA,
//!    as the DPO trainer does);
//! 3. `ppo_epochs` passes over the responses in a seeded shuffled order, `mini_batch`
//!    responses per optimizer step, `micro_batch` responses per forward/backward (gradients
//!    accumulate; the loss weights come from the whole mini-batch so the sum is exact);
//!    each step clips the global gradient norm and applies AdamW at the scheduled rate.
//!
//! LoRA dropout stays off in every pass: with it the ratio of the first mini-batch would not
//! be 1 and the clip would act on noise rather than on policy change.
//! A non-finite loss or gradient norm stops the update with an error before the optimizer
//! touches the weights.

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};
use rand::seq::SliceRandom;
use rand::SeedableRng;

use super::advantage::{self, AdvantageStats, Estimator};
use super::batch::{response_tokens, RlBatch, RlSample};
use super::loss::{entropy_of_logits, ppo_loss, PpoConfig, PpoMetrics, TokenTerms};
use super::Group;
use crate::engine::ChatCodec;
use crate::train::adamw::{AdamW, AdamWParams};
use crate::train::dpo::loss::{dpo_loss, DpoConfig, DpoMetrics};
use crate::train::head;
use crate::train::logps::{
    completion_logps, target_states, target_token_logps_host, PairBatch, Targets, TokenizedPair,
};
use crate::train::model::TrainLlama;
use crate::train::ops::token_logps;
use crate::train::optim::{accumulate_grads, clip_grad_norm};
use crate::train::settings::{RlDefaults, Spelling, TrainerSettings};

#[derive(Debug, thiserror::Error)]
pub enum RlError {
    #[error("group {group} (task {task_id:?}), response {response}: {message}")]
    Response {
        group: usize,
        task_id: String,
        response: usize,
        message: String,
    },
    #[error("update {update}, optimizer step {step}: non-finite {what} ({value}); the weights were not changed by this step")]
    NonFinite {
        update: u64,
        step: u64,
        what: &'static str,
        value: f64,
    },
    #[error("update {update}, optimizer step {step}: the update made weight `{name}` non-finite; stopped before saving anything from it (the last checkpoint is intact; lower --lr)")]
    NonFiniteWeight {
        update: u64,
        step: u64,
        name: String,
    },
    #[error("invalid RL setting: {0}")]
    Config(String),
    #[error("{path}: {message}")]
    State {
        path: std::path::PathBuf,
        message: String,
    },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// Hyper-parameters of the update (verl's GRPO defaults where it has them).
#[derive(Clone, Debug, PartialEq)]
pub struct RlConfig {
    pub ppo: PpoConfig,
    pub estimator: Estimator,
    /// Passes over each rollout batch (`--ppo-epochs`).
    pub ppo_epochs: usize,
    /// Responses per optimizer step (`--mini-batch`); 0: the whole rollout batch.
    pub mini_batch: usize,
    /// Responses per forward/backward pass; 0: the whole mini-batch.
    pub micro_batch: usize,
    /// Rate, decay, clipping, schedule, seed and activation checkpointing.
    pub optim: TrainerSettings<RlDefaults>,
    /// Optimizer steps of the whole run, for the schedule (0: constant rate).
    pub total_steps: usize,
    /// Longest prompt + response in tokens; longer responses are dropped (counted).
    pub max_length: usize,
    /// Online DPO (`--algo online_dpo`): the loss of its pairs. Keeps a frozen reference
    /// (the initial weights) whatever the KL coefficient.
    pub dpo: Option<DpoConfig>,
    /// Zero the advantages of groups whose rewards differ only in token counts.
    pub skip_length_only: bool,
}

impl Default for RlConfig {
    fn default() -> Self {
        Self {
            ppo: PpoConfig::default(),
            estimator: Estimator::Grpo,
            ppo_epochs: 1,
            mini_batch: 0,
            micro_batch: 4,
            optim: TrainerSettings::default(),
            total_steps: 0,
            max_length: 2048,
            dpo: None,
            skip_length_only: true,
        }
    }
}

impl RlConfig {
    /// Checks every value once; the error names the flag and the value.
    pub fn validate(&self) -> Result<(), RlError> {
        self.ppo.validate().map_err(RlError::Config)?;
        let bad = |m: String| Err(RlError::Config(m));
        self.optim
            .validate(Spelling::Flag)
            .map_err(|e| RlError::Config(e.message))?;
        if self.ppo_epochs == 0 {
            return bad("--ppo-epochs must be at least 1, got 0".into());
        }
        if let Some(d) = &self.dpo {
            d.validate().map_err(RlError::Config)?;
        }
        if self.max_length < 2 {
            return bad(format!(
                "--max-length must be at least 2, got {}",
                self.max_length
            ));
        }
        Ok(())
    }

    fn lr_at(&self, step: u64) -> f64 {
        if self.total_steps == 0 {
            return self.optim.lr;
        }
        self.optim.lr_at(step as usize, self.total_steps)
    }
}

/// What one update did.
#[derive(Clone, Debug, Default)]
pub struct UpdateReport {
    pub advantage: AdvantageStats,
    /// Responses trained on.
    pub samples: usize,
    pub response_tokens: usize,
    pub dropped_too_long: usize,
    pub optimizer_steps: usize,
    /// Loss and metrics of each optimizer step, in order.
    pub steps: Vec<PpoMetrics>,
    pub losses: Vec<f64>,
    pub grad_norms: Vec<f64>,
    pub lr: f64,
    /// Online DPO: pairs formed and TRL's DPO metrics (means over optimizer steps).
    pub dpo: Vec<(String, f64)>,
}

impl UpdateReport {
    /// Flat metrics: advantage counts, then means over the optimizer steps (ratio min / max
    /// over all of them).
    pub fn named(&self) -> Vec<(String, f64)> {
        let mut out: Vec<(String, f64)> = self
            .advantage
            .named()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        out.push(("samples".into(), self.samples as f64));
        out.push(("response_tokens".into(), self.response_tokens as f64));
        out.push(("dropped_too_long".into(), self.dropped_too_long as f64));
        out.push(("optimizer_steps".into(), self.optimizer_steps as f64));
        out.push(("lr".into(), self.lr));
        // Means over optimizer steps (online DPO has losses but no PPO metrics).
        let n = self.losses.len().max(1) as f64;
        out.push(("loss".into(), self.losses.iter().sum::<f64>() / n));
        out.push(("grad_norm".into(), self.grad_norms.iter().sum::<f64>() / n));
        out.extend(self.dpo.iter().cloned());
        if let Some(first) = self.steps.first() {
            for (i, (k, _)) in first.named().into_iter().enumerate() {
                let vals = self.steps.iter().map(|s| s.named()[i].1);
                let v = match k {
                    "ratio_min" => vals.fold(f64::INFINITY, f64::min),
                    "ratio_max" => vals.fold(f64::NEG_INFINITY, f64::max),
                    _ => vals.sum::<f64>() / n,
                };
                out.push((k.to_string(), v));
            }
        }
        out
    }
}

/// The policy, its frozen reference and optimizer, across updates.
pub struct RlTrainer {
    policy: TrainLlama,
    /// Full fine-tuning with a KL term: the initial weights. LoRA uses the base model.
    reference: Option<TrainLlama>,
    opt: AdamW,
    cfg: RlConfig,
    pad_id: u32,
    /// Updates (rollout batches) done.
    updates: u64,
}

/// Per-sample log-probs of one pass.
type SampleLogps = Vec<Vec<f32>>;

impl RlTrainer {
    /// Starts from `policy` as it is now (its weights are the reference). For LoRA, enable
    /// the adapters on `policy` before calling.
    pub fn new(policy: TrainLlama, cfg: RlConfig, pad_id: u32) -> Result<Self, RlError> {
        cfg.validate()?;
        let needs_reference = cfg.ppo.kl_coef > 0.0 || cfg.dpo.is_some();
        let reference = if needs_reference && policy.lora_config().is_none() {
            Some(policy.detached_copy()?)
        } else {
            None
        };
        policy.set_training(false);
        let opt = AdamW::new(
            policy.named_vars(),
            AdamWParams {
                weight_decay: cfg.optim.weight_decay,
                ..Default::default()
            },
        )?;
        Ok(Self {
            policy,
            reference,
            opt,
            cfg,
            pad_id,
            updates: 0,
        })
    }

    pub fn policy(&self) -> &TrainLlama {
        &self.policy
    }
    pub fn config(&self) -> &RlConfig {
        &self.cfg
    }
    pub fn updates(&self) -> u64 {
        self.updates
    }
    pub fn optimizer(&self) -> &AdamW {
        &self.opt
    }
    pub(crate) fn restore(
        &mut self,
        updates: u64,
        opt_path: &std::path::Path,
        steps: u64,
    ) -> candle_core::Result<()> {
        self.updates = updates;
        self.opt.load(opt_path, steps)
    }

    /// Tokenized responses that train, with their advantages.
    pub fn samples(
        &self,
        codec: &ChatCodec,
        groups: &[Group],
    ) -> Result<(Vec<RlSample>, AdvantageStats, usize), RlError> {
        let (adv, stats) =
            advantage::compute(groups, self.cfg.estimator, self.cfg.skip_length_only);
        let mut out = Vec::with_capacity(adv.len());
        let mut too_long = 0;
        for a in adv {
            let g = &groups[a.group];
            let r = &g.responses[a.response];
            let (prompt, response_ids) =
                response_tokens(codec, &g.prompt, r).map_err(|message| RlError::Response {
                    group: a.group,
                    task_id: g.task_id.clone(),
                    response: a.response,
                    message,
                })?;
            if prompt.len() + response_ids.len() > self.cfg.max_length {
                too_long += 1;
                continue;
            }
            out.push(RlSample {
                group: a.group,
                response: a.response,
                prompt,
                response_ids,
                advantage: a.advantage as f32,
            });
        }
        Ok((out, stats, too_long))
    }

    /// One update from a rollout batch sampled with the current weights.
    pub fn update(&mut self, codec: &ChatCodec, groups: &[Group]) -> Result<UpdateReport, RlError> {
        let (samples, advantage, dropped_too_long) = self.samples(codec, groups)?;
        let report = self.update_samples(&samples)?;
        Ok(UpdateReport {
            advantage,
            dropped_too_long,
            ..report
        })
    }

    /// One update from already tokenized samples.
    pub fn update_samples(&mut self, samples: &[RlSample]) -> Result<UpdateReport, RlError> {
        let mut report = UpdateReport {
            samples: samples.len(),
            response_tokens: samples.iter().map(|s| s.response_ids.len()).sum(),
            lr: self.cfg.lr_at(self.opt.step_count()),
            ..Default::default()
        };
        if samples.is_empty() {
            self.updates += 1;
            return Ok(report);
        }
        let mini = match self.cfg.mini_batch {
            0 => samples.len(),
            m => m.min(samples.len()),
        };
        // One optimizer step per rollout batch: the weights that score the loss are the ones
        // that sampled, so the old log-probs are the loss pass's own, detached (ratio 1, as
        // TRL does); a separate pass would only add rounding noise and a forward's cost.
        let on_policy = self.cfg.ppo_epochs == 1 && mini == samples.len();
        let old = if on_policy {
            None
        } else {
            Some(self.sample_logps(samples, false)?)
        };
        let reference = if self.cfg.ppo.kl_coef > 0.0 {
            Some(self.sample_logps(samples, true)?)
        } else {
            None
        };
        for epoch in 0..self.cfg.ppo_epochs {
            let order = self.shuffled(samples.len(), epoch);
            for chunk in order.chunks(mini) {
                let (loss, metrics, norm) =
                    self.optimizer_step(samples, chunk, old.as_ref(), reference.as_ref())?;
                report.losses.push(loss);
                report.steps.push(metrics);
                report.grad_norms.push(norm);
                report.optimizer_steps += 1;
            }
        }
        self.updates += 1;
        Ok(report)
    }

    /// A permutation seeded by (seed, update, epoch): resuming replays the same order.
    fn shuffled(&self, n: usize, epoch: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..n).collect();
        let seed = self
            .cfg
            .optim
            .seed
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(self.updates.wrapping_mul(1_000_003))
            .wrapping_add(epoch as u64);
        order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
        order
    }

    fn micro_chunks<'a>(&self, idx: &'a [usize]) -> std::slice::Chunks<'a, usize> {
        let micro = match self.cfg.micro_batch {
            0 => idx.len(),
            m => m,
        };
        idx.chunks(micro.max(1))
    }

    /// Per-token log-probs (f32, no gradient) of every sample under the current policy or
    /// the reference.
    fn sample_logps(&self, samples: &[RlSample], reference: bool) -> Result<SampleLogps, RlError> {
        let all: Vec<usize> = (0..samples.len()).collect();
        let mut out = vec![Vec::new(); samples.len()];
        let model = match (&self.reference, reference) {
            (Some(r), true) => r,
            _ => &self.policy,
        };
        let adapters_off = reference && self.reference.is_none();
        if adapters_off {
            self.policy.set_adapters_enabled(false);
        }
        let result = (|| -> candle_core::Result<()> {
            for chunk in self.micro_chunks(&all) {
                let refs: Vec<&RlSample> = chunk.iter().map(|&i| &samples[i]).collect();
                let batch = RlBatch::new(&refs, self.pad_id, model.device())?;
                let hidden = model.hidden_states_in(&batch.input_ids, &batch.layout)?;
                let lp = target_token_logps_host(model, &hidden, &batch.targets)?;
                for (v, &local) in lp.into_iter().zip(&batch.token_sample) {
                    out[chunk[local]].push(v);
                }
            }
            Ok(())
        })();
        if adapters_off {
            self.policy.set_adapters_enabled(true);
        }
        result?;
        Ok(out)
    }

    /// Accumulates the gradients of one mini-batch, checks them, clips and steps.
    fn optimizer_step(
        &mut self,
        samples: &[RlSample],
        idx: &[usize],
        old: Option<&SampleLogps>,
        reference: Option<&SampleLogps>,
    ) -> Result<(f64, PpoMetrics, f64), RlError> {
        let tokens: usize = idx.iter().map(|&i| samples[i].response_ids.len()).sum();
        let vars = self.policy.vars();
        let mut grads: Option<GradStore> = None;
        let mut metrics = PpoMetrics::default();
        let mut loss_sum = 0.0;
        for chunk in self.micro_chunks(idx) {
            let (g, (m, l)) =
                self.micro_grads(samples, chunk, old, reference, tokens, idx.len())?;
            metrics.merge(&m);
            loss_sum += l;
            match grads.as_mut() {
                None => grads = Some(g),
                Some(acc) => accumulate_grads(acc, g, &vars)?,
            }
        }
        let norm = self.apply_grads(grads, loss_sum, "empty mini-batch")?;
        Ok((loss_sum, metrics, norm))
    }

    /// The one optimizer step of PPO and DPO updates: refuses a non-finite loss or gradient
    /// norm before any weight changes, clips, steps. Returns the pre-clip gradient norm.
    fn apply_grads(
        &mut self,
        grads: Option<GradStore>,
        loss_sum: f64,
        empty: &str,
    ) -> Result<f64, RlError> {
        let vars = self.policy.vars();
        let mut grads = grads.ok_or_else(|| RlError::Config(empty.into()))?;
        let step = self.opt.step_count();
        let non_finite = |what, value| RlError::NonFinite {
            update: self.updates,
            step,
            what,
            value,
        };
        if !loss_sum.is_finite() {
            return Err(non_finite("loss", loss_sum));
        }
        let norm = clip_grad_norm(&mut grads, &vars, self.cfg.optim.max_grad_norm)?;
        if !norm.is_finite() {
            return Err(non_finite("gradient norm", norm));
        }
        self.opt.step(&grads, self.cfg.lr_at(step))?;
        // A finite gradient times a huge rate can still overflow a weight (`--lr 1e300`).
        if let Some(name) = crate::train::model::non_finite_weight(&self.policy)? {
            return Err(RlError::NonFiniteWeight {
                update: self.updates,
                step: step + 1,
                name,
            });
        }
        Ok(norm)
    }

    /// Gradients of one micro-batch's share of the mini-batch loss.
    fn micro_grads(
        &self,
        samples: &[RlSample],
        chunk: &[usize],
        old: Option<&SampleLogps>,
        reference: Option<&SampleLogps>,
        mini_tokens: usize,
        mini_seqs: usize,
    ) -> Result<(GradStore, (PpoMetrics, f64)), RlError> {
        let refs: Vec<&RlSample> = chunk.iter().map(|&i| &samples[i]).collect();
        let dev = self.policy.device().clone();
        let batch = RlBatch::new(&refs, self.pad_id, &dev)?;
        // Per-token constants in the batch's token order.
        let mut cursor = vec![0usize; chunk.len()];
        let (mut old_t, mut ref_t) = (Vec::with_capacity(batch.tokens), Vec::new());
        for &local in &batch.token_sample {
            let (si, k) = (chunk[local], cursor[local]);
            cursor[local] += 1;
            if let Some(o) = old {
                old_t.push(o[si][k]);
            }
            if let Some(r) = reference {
                ref_t.push(r[si][k]);
            }
        }
        let weights = self.cfg.ppo.agg.token_weights(
            &batch.token_response_len,
            mini_tokens,
            mini_seqs,
            self.cfg.ppo.norm_len,
        );
        let old_t = old.map(|_| Tensor::new(old_t, &dev)).transpose()?;
        let ref_t = reference.map(|_| Tensor::new(ref_t, &dev)).transpose()?;
        let weights = Tensor::new(weights, &dev)?;
        let cfg = self.cfg.ppo;
        let policy = &self.policy;
        let weight = policy.head_weight();
        let checkpoint = self.cfg.optim.gradient_checkpointing;
        let terms = PerToken {
            old: old_t.as_ref(),
            reference: ref_t.as_ref(),
            advantages: &batch.advantages,
            weights: &weights,
        };
        let (mut grads, (metrics, value, weight_grad)) =
            policy.grads(&batch.input_ids, &batch.layout, checkpoint, |hidden| {
                let states = target_states(hidden, &batch.targets)?;
                if head::applies(&states, weight) {
                    fused_head_loss(&states, weight, &batch.targets, &terms, &cfg)
                } else {
                    let (loss, metrics, value) =
                        composed_head_loss(policy, &states, &batch.targets, &terms, &cfg)?;
                    Ok((loss, (metrics, value, None)))
                }
            })?;
        if let Some(g) = weight_grad {
            let sum = match grads.remove(weight) {
                Some(acc) => (acc + g)?,
                None => g,
            };
            grads.insert(weight, sum);
        }
        Ok((grads, (metrics, value)))
    }
}

/// The per-token constants of a micro-batch's PPO loss, (K,) each.
struct PerToken<'a> {
    old: Option<&'a Tensor>,
    reference: Option<&'a Tensor>,
    advantages: &'a Tensor,
    weights: &'a Tensor,
}

impl PerToken<'_> {
    /// The PPO loss of the tokens in `range` (the loss is a weighted sum over tokens, so
    /// the losses of a partition add up to the whole); without old log-probs the ratio is
    /// taken against the current ones, detached (one PPO epoch: ratio 1, gradient A).
    fn ppo(
        &self,
        range: std::ops::Range<usize>,
        logp: &Tensor,
        entropy: &Tensor,
        cfg: &PpoConfig,
    ) -> candle_core::Result<(Tensor, PpoMetrics, f64)> {
        let part = |t: &Tensor| t.narrow(0, range.start, range.len());
        let old_logp = match self.old {
            Some(t) => part(t)?,
            None => logp.detach(),
        };
        let reference = self.reference.map(part).transpose()?;
        let out = ppo_loss(
            &TokenTerms {
                logp,
                old_logp: &old_logp,
                ref_logp: reference.as_ref(),
                advantages: &part(self.advantages)?,
                weights: &part(self.weights)?,
                entropy: Some(entropy),
            },
            cfg,
        )?;
        let value = out.loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        Ok((out.loss, out.metrics, value))
    }
}

type HeadLoss = (Tensor, (PpoMetrics, f64, Option<Tensor>));

/// The PPO loss through the fused head: a surrogate whose gradient with respect to the
/// hidden states is the loss's, plus the head weight's gradient (when it is trained), which
/// the caller adds to the model's.
fn fused_head_loss(
    states: &Tensor,
    weight: &Tensor,
    targets: &Targets,
    terms: &PerToken,
    cfg: &PpoConfig,
) -> candle_core::Result<HeadLoss> {
    let labels = targets.labels.to_vec1::<u32>()?;
    let (grads, parts) = head::token_loss_grads(
        &states.detach(),
        weight,
        &labels,
        weight.is_variable(),
        |range, logp, entropy| {
            let (loss, metrics, value) = terms.ppo(range, logp, entropy, cfg)?;
            Ok((loss, (metrics, value)))
        },
    )?;
    let mut metrics = PpoMetrics::default();
    let mut value = 0.0;
    for (m, v) in &parts {
        metrics.merge(m);
        value += v;
    }
    let surrogate = (states * grads.hidden)?.sum_all()?;
    Ok((surrogate, (metrics, value, grads.weight)))
}

/// The PPO loss through candle's composed ops (other devices and dtypes): the entropy is
/// logged on every step (TRL and verl do). Without the entropy bonus the head runs a chunk of
/// tokens at a time ([`crate::train::chunked_head`]) and the entropy comes detached from the
/// same chunks; with it, the entropy needs its own gradient and the whole logits are kept.
fn composed_head_loss(
    policy: &TrainLlama,
    states: &Tensor,
    targets: &Targets,
    terms: &PerToken,
    cfg: &PpoConfig,
) -> candle_core::Result<(Tensor, PpoMetrics, f64)> {
    let tokens = targets.labels.dim(0)?;
    if cfg.entropy_coef == 0.0 {
        let (logp, stats) = crate::train::chunked_head::token_logps_stats(
            states,
            policy.head_weight(),
            &targets.labels,
        )?;
        let entropy: Vec<f32> = stats.iter().map(|s| s[1] as f32).collect();
        let entropy = Tensor::from_vec(entropy, tokens, states.device())?;
        return terms.ppo(0..tokens, &logp, &entropy, cfg);
    }
    let logits = policy.logits_of(states)?;
    let logp = token_logps(&logits, &targets.labels)?.to_dtype(DType::F32)?;
    let entropy = entropy_of_logits(&logits.to_dtype(DType::F32)?)?;
    terms.ppo(0..tokens, &logp, &entropy, cfg)
}

/// One preference pair of an online DPO step.
#[derive(Clone, Debug)]
struct OnlinePair {
    tokens: TokenizedPair,
}

impl RlTrainer {
    /// Online DPO (upstream CollabLLM v1): the best and worst reward of each group, when
    /// they differ by at least `min_gap` (ties never pair), form one pair, trained with the
    /// DPO loss against the frozen initial weights (LoRA: the base model). One optimizer
    /// step per PPO epoch over all the step's pairs, `micro_batch` pairs per pass.
    pub fn dpo_update(
        &mut self,
        codec: &ChatCodec,
        groups: &[Group],
        min_gap: f64,
        mode: crate::reward::pairs::PairMode,
    ) -> Result<UpdateReport, RlError> {
        let dcfg = self
            .cfg
            .dpo
            .ok_or_else(|| RlError::Config("dpo_update needs RlConfig::dpo".into()))?;
        let (_, advantage) =
            advantage::compute(groups, self.cfg.estimator, self.cfg.skip_length_only);
        let mut pairs = Vec::new();
        let mut too_long = 0;
        for (gi, g) in groups.iter().enumerate() {
            let rewards: Vec<Option<f64>> = g.responses.iter().map(|r| r.reward).collect();
            let actions: Vec<crate::task::Action> = g
                .responses
                .iter()
                .map(|r| crate::task::Action::of_reply(&r.text))
                .collect();
            let picked = crate::reward::pairs::select_pairs(&rewards, &actions, min_gap, mode);
            for (c, r) in picked {
                let tok = |i: usize| {
                    response_tokens(codec, &g.prompt, &g.responses[i]).map_err(|message| {
                        RlError::Response {
                            group: gi,
                            task_id: g.task_id.clone(),
                            response: i,
                            message,
                        }
                    })
                };
                let (prompt, chosen) = tok(c)?;
                let (_, rejected) = tok(r)?;
                if prompt.len() + chosen.len().max(rejected.len()) > self.cfg.max_length {
                    too_long += 1;
                    continue;
                }
                pairs.push(OnlinePair {
                    tokens: TokenizedPair {
                        prompt,
                        chosen,
                        rejected,
                    },
                });
            }
        }
        let mut report = UpdateReport {
            advantage,
            samples: 2 * pairs.len(),
            response_tokens: pairs
                .iter()
                .map(|p| p.tokens.chosen.len() + p.tokens.rejected.len())
                .sum(),
            dropped_too_long: too_long,
            lr: self.cfg.lr_at(self.opt.step_count()),
            ..Default::default()
        };
        report.dpo.push(("dpo/pairs".into(), pairs.len() as f64));
        if pairs.is_empty() {
            self.updates += 1;
            return Ok(report);
        }
        let reference = self.pair_reference_logps(&pairs)?;
        let mut all_metrics = Vec::new();
        for _ in 0..self.cfg.ppo_epochs {
            let (loss, metrics, norm) = self.dpo_step(&pairs, &reference, &dcfg)?;
            report.losses.push(loss);
            report.grad_norms.push(norm);
            report.optimizer_steps += 1;
            all_metrics.push(metrics);
        }
        let mean = DpoMetrics::mean(&all_metrics);
        report.dpo.extend(
            mean.named()
                .into_iter()
                .map(|(k, v)| (format!("dpo/{k}"), v)),
        );
        self.updates += 1;
        Ok(report)
    }

    fn pair_chunks<'a>(&self, pairs: &'a [OnlinePair]) -> std::slice::Chunks<'a, OnlinePair> {
        let micro = match self.cfg.micro_batch {
            0 => pairs.len(),
            m => m,
        };
        pairs.chunks(micro.max(1))
    }

    /// (chosen, rejected) summed log-probs of every pair under the reference, in order.
    fn pair_reference_logps(&self, pairs: &[OnlinePair]) -> Result<Vec<(f32, f32)>, RlError> {
        let model = self.reference.as_ref().unwrap_or(&self.policy);
        let adapters_off = self.reference.is_none();
        if adapters_off {
            self.policy.set_adapters_enabled(false);
        }
        let result = (|| -> candle_core::Result<Vec<(f32, f32)>> {
            let mut out = Vec::with_capacity(pairs.len());
            for chunk in self.pair_chunks(pairs) {
                let rows: Vec<TokenizedPair> = chunk.iter().map(|p| p.tokens.clone()).collect();
                let batch = PairBatch::new(&rows, self.pad_id, model.device())?;
                let hidden = model.hidden_states_in(&batch.input_ids, &batch.layout)?;
                let (sums, _) = completion_logps(model, &hidden, &batch.targets)?;
                let v = sums.detach().to_dtype(DType::F32)?.to_vec1::<f32>()?;
                let b = rows.len();
                out.extend((0..b).map(|i| (v[i], v[b + i])));
            }
            Ok(out)
        })();
        if adapters_off {
            self.policy.set_adapters_enabled(true);
        }
        Ok(result?)
    }

    /// One optimizer step of the batch-mean DPO loss over all pairs (micro-batches scaled
    /// by their share, so the accumulated gradient is the whole batch's).
    fn dpo_step(
        &mut self,
        pairs: &[OnlinePair],
        reference: &[(f32, f32)],
        dcfg: &DpoConfig,
    ) -> Result<(f64, DpoMetrics, f64), RlError> {
        let vars = self.policy.vars();
        let dev = self.policy.device().clone();
        let mut grads: Option<GradStore> = None;
        let (mut loss_sum, mut metrics, mut start) = (0.0, Vec::new(), 0);
        for chunk in self.pair_chunks(pairs) {
            let rows: Vec<TokenizedPair> = chunk.iter().map(|p| p.tokens.clone()).collect();
            let b = rows.len();
            let refs = &reference[start..start + b];
            start += b;
            let batch = PairBatch::new(&rows, self.pad_id, &dev)?;
            let ref_c = Tensor::new(refs.iter().map(|r| r.0).collect::<Vec<_>>(), &dev)?;
            let ref_r = Tensor::new(refs.iter().map(|r| r.1).collect::<Vec<_>>(), &dev)?;
            let share = b as f64 / pairs.len() as f64;
            let policy = &self.policy;
            let checkpoint = self.cfg.optim.gradient_checkpointing;
            let (g, (m, l)) =
                policy.grads(&batch.input_ids, &batch.layout, checkpoint, |hidden| {
                    let (sums, _) = completion_logps(policy, hidden, &batch.targets)?;
                    let sums = sums.to_dtype(DType::F32)?;
                    let (c, r) = (sums.narrow(0, 0, b)?, sums.narrow(0, b, b)?);
                    let out = dpo_loss(&c, &r, &ref_c, &ref_r, dcfg)?;
                    let value = out.metrics.loss * share;
                    Ok(((out.loss * share)?, (out.metrics, value)))
                })?;
            loss_sum += l;
            metrics.push(m);
            match grads.as_mut() {
                None => grads = Some(g),
                Some(acc) => accumulate_grads(acc, g, &vars)?,
            }
        }
        let norm = self.apply_grads(grads, loss_sum, "no DPO pair")?;
        Ok((loss_sum, DpoMetrics::mean(&metrics), norm))
    }
}
