//! Sequence log-probabilities of preference pairs, as TRL computes them: the
//! log-prob of a completion is the sum over its tokens of `log p(token | prefix)`; the
//! chosen and rejected sides of B pairs go through ONE forward pass.
//!
//! Unlike TRL, which runs `prompt + chosen` and `prompt + rejected` as 2B separate rows,
//! each pair is packed into one row `prompt | chosen | rejected`: the rejected tokens attend
//! to the prompt and to themselves (never to the chosen tokens) and take the positions they
//! would have had after the prompt, so every log-prob is the one of the separate rows (tested
//! against them) while the prompt, usually the longest part of a multi-turn conversation, is
//! encoded once instead of twice.

use candle_core::{DType, Device, Result, Tensor};

pub use super::data::TokenizedPair;
use super::model::{BatchLayout, TrainLlama};

/// The tokens whose log-probs a loss sums, each with the flat index (row · T + t) of the
/// position whose hidden state predicts it and the output row it counts for.
#[derive(Clone, Debug)]
pub struct Targets {
    /// (K,) u32 flat indices of the predicting positions.
    pub positions: Tensor,
    /// (K,) u32 tokens.
    pub labels: Tensor,
    /// (rows, K) 0/1: which output row each token counts for.
    pub membership: Tensor,
    /// The output row of each token (the membership matrix as indices).
    pub rows: Vec<usize>,
    /// Number of output rows.
    pub num_rows: usize,
}

impl Targets {
    /// From (predicting flat position, token, output row) triples.
    pub fn new(triples: &[(u32, u32, usize)], rows: usize, device: &Device) -> Result<Self> {
        if triples.is_empty() {
            candle_core::bail!("no loss token in the batch");
        }
        let k = triples.len();
        let mut membership = vec![0f32; rows * k];
        for (j, &(_, _, r)) in triples.iter().enumerate() {
            membership[r * k + j] = 1.0;
        }
        Ok(Self {
            positions: Tensor::new(triples.iter().map(|t| t.0).collect::<Vec<_>>(), device)?,
            labels: Tensor::new(triples.iter().map(|t| t.1).collect::<Vec<_>>(), device)?,
            membership: Tensor::from_vec(membership, (rows, k), device)?,
            rows: triples.iter().map(|t| t.2).collect(),
            num_rows: rows,
        })
    }

    /// The shift rule of independent rows: token t of row r counts for row r when
    /// `loss_mask[r][t]` is set, predicted by position t − 1.
    pub fn shifted(ids: &[Vec<u32>], loss_mask: &[Vec<bool>], device: &Device) -> Result<Self> {
        let t = ids.iter().map(Vec::len).max().unwrap_or(0);
        let mut triples = Vec::new();
        for (r, (row, mask)) in ids.iter().zip(loss_mask).enumerate() {
            for p in 1..row.len() {
                if mask[p] {
                    triples.push(((r * t + p - 1) as u32, row[p], r));
                }
            }
        }
        Self::new(&triples, ids.len(), device)
    }
}

/// B packed pairs: row i is `prompt | chosen | rejected` of pair i, right-padded.
#[derive(Clone, Debug)]
pub struct PairBatch {
    /// (B, T) u32.
    pub input_ids: Tensor,
    /// Attention (a completion reads the prompt and itself) and positions (the rejected
    /// tokens continue from the end of the prompt).
    pub layout: BatchLayout,
    /// Chosen tokens count for output rows 0..B, rejected tokens for B..2B.
    pub targets: Targets,
    /// Number of pairs B.
    pub pairs: usize,
}

/// Segment ids of a packed pair row.
const PROMPT: u8 = 0;
const CHOSEN: u8 = 1;
const REJECTED: u8 = 2;

impl PairBatch {
    /// Builds the batch; `pad_id` fills the padding (any id: padded positions are masked).
    pub fn new(pairs: &[TokenizedPair], pad_id: u32, device: &Device) -> Result<Self> {
        if pairs.is_empty() {
            candle_core::bail!("empty batch of pairs");
        }
        if pairs
            .iter()
            .any(|p| p.prompt.is_empty() || p.chosen.is_empty() || p.rejected.is_empty())
        {
            candle_core::bail!("a pair has an empty prompt or completion");
        }
        let t = pairs
            .iter()
            .map(|p| p.prompt.len() + p.chosen.len() + p.rejected.len())
            .max()
            .unwrap_or(0);
        let b = pairs.len();
        let mut ids = vec![pad_id; b * t];
        let mut positions = vec![0u32; b * t];
        let mut segments = vec![vec![None; t]; b];
        let mut triples = Vec::new();
        for (r, p) in pairs.iter().enumerate() {
            let np = p.prompt.len();
            let mut at = r * t;
            for (i, &tok) in p.prompt.iter().enumerate() {
                (ids[at], positions[at], segments[r][i]) = (tok, i as u32, Some(PROMPT));
                at += 1;
            }
            for (seg, completion, out_row) in
                [(CHOSEN, &p.chosen, r), (REJECTED, &p.rejected, b + r)]
            {
                for (k, &tok) in completion.iter().enumerate() {
                    (ids[at], positions[at], segments[r][at - r * t]) =
                        (tok, (np + k) as u32, Some(seg));
                    // The first completion token is predicted by the last prompt token.
                    let predictor = if k == 0 { r * t + np - 1 } else { at - 1 };
                    triples.push((predictor as u32, tok, out_row));
                    at += 1;
                }
            }
        }
        Ok(Self {
            input_ids: Tensor::from_vec(ids, (b, t), device)?,
            layout: BatchLayout::segmented(&segments, positions, device)?,
            targets: Targets::new(&triples, 2 * b, device)?,
            pairs: b,
        })
    }
}

/// Per-row log-probs of the masked tokens: `logits` (N, T, V), `input_ids` (N, T),
/// `loss_mask` (N, T). Position t's logits predict token t+1 (the shift), so token t counts
/// when `loss_mask[t]` is 1. Returns (sums (N,), token counts (N,)) in the logits' dtype.
pub fn sequence_logps(
    logits: &Tensor,
    input_ids: &Tensor,
    loss_mask: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let (n, t, _v) = logits.dims3()?;
    if t < 2 {
        candle_core::bail!("sequences need at least two tokens");
    }
    // In f32 for half-precision logits, as `ops::token_logps`.
    let dtype = match logits.dtype() {
        DType::F64 => DType::F64,
        _ => DType::F32,
    };
    let logp = super::model::log_softmax_last_dim(&logits.narrow(1, 0, t - 1)?.to_dtype(dtype)?)?;
    let labels = input_ids
        .narrow(1, 1, t - 1)?
        .to_dtype(DType::U32)?
        .contiguous()?
        .unsqueeze(2)?;
    let per_token = logp.gather(&labels, 2)?.squeeze(2)?; // (N, T-1)
    let mask = loss_mask.narrow(1, 1, t - 1)?.to_dtype(dtype)?;
    let sums = (per_token * &mask)?.sum(1)?;
    let counts = mask.sum(1)?;
    debug_assert_eq!(sums.dims(), &[n]);
    Ok((sums, counts))
}

/// Per-row summed log-probs and token counts of `targets` from final-normed hidden states
/// (N, T, H): the output head and log-softmax run only at the positions that predict a
/// target token, not at prompt or padding positions whose log-probs would be discarded.
pub fn completion_logps(
    model: &TrainLlama,
    hidden: &Tensor,
    targets: &Targets,
) -> Result<(Tensor, Tensor)> {
    let (n, t, h) = hidden.dims3()?;
    let selected = hidden
        .reshape((n * t, h))?
        .index_select(&targets.positions, 0)?;
    let per_token = if super::head::applies(&selected, model.head_weight()) {
        super::ops::token_logps(&model.logits_of(&selected)?, &targets.labels)?
    } else {
        super::chunked_head::token_logps(&selected, model.head_weight(), &targets.labels)?
    };
    // Row sums as one (rows, K) · (K, 1) product with the 0/1 membership matrix.
    // f32 like the log-probs: row sums of a few hundred tokens lose whole nats in bf16.
    let member = targets.membership.to_dtype(per_token.dtype())?;
    let sums = member.matmul(&per_token.unsqueeze(1)?)?.squeeze(1)?;
    Ok((sums, member.sum(1)?))
}

/// [`completion_logps`] plus TRL's logit diagnostics of the same target tokens
/// ([`TokenStats`]), from the one output-head pass.
pub fn completion_logps_stats(
    model: &TrainLlama,
    hidden: &Tensor,
    targets: &Targets,
) -> Result<(Tensor, Tensor, TokenStats)> {
    let (n, t, h) = hidden.dims3()?;
    let selected = hidden
        .reshape((n * t, h))?
        .index_select(&targets.positions, 0)?;
    let (per_token, stats) = if super::head::applies(&selected, model.head_weight()) {
        let logits = model.logits_of(&selected)?;
        let stats = TokenStats::of(&logits, targets)?;
        (super::ops::token_logps(&logits, &targets.labels)?, stats)
    } else {
        // Never the whole (tokens, vocab) logits, nor their copy to the host.
        let (logp, per_token) = super::chunked_head::token_logps_stats(
            &selected,
            model.head_weight(),
            &targets.labels,
        )?;
        (logp, TokenStats::from_per_token(&per_token, targets))
    };
    // f32 like the log-probs: row sums of a few hundred tokens lose whole nats in bf16.
    let member = targets.membership.to_dtype(per_token.dtype())?;
    let sums = member.matmul(&per_token.unsqueeze(1)?)?.squeeze(1)?;
    Ok((sums, member.sum(1)?, stats))
}

/// TRL's logit diagnostics of the target tokens, summed per output row (no gradient): the
/// mean logit over the vocabulary (`logits/chosen`, `logits/rejected`), the entropy of the
/// predicted distribution (`entropy`) and whether its arg-max is the target
/// (`mean_token_accuracy`); divide by `tokens` for the means.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TokenStats {
    pub logit_mean: Vec<f64>,
    pub entropy: Vec<f64>,
    pub correct: Vec<f64>,
    pub tokens: Vec<f64>,
}

impl TokenStats {
    /// From the (K, V) logits that predict `targets`' K tokens.
    pub fn of(logits: &Tensor, targets: &Targets) -> Result<Self> {
        let labels = targets.labels.to_vec1::<u32>()?;
        Ok(Self::from_per_token(
            &token_stats(logits, &labels)?,
            targets,
        ))
    }

    /// Row sums of per-token (mean logit, entropy, correct), in `targets`' order.
    pub fn from_per_token(per_token: &[[f64; 3]], targets: &Targets) -> Self {
        let rows = targets.num_rows;
        let mut out = TokenStats {
            logit_mean: vec![0.0; rows],
            entropy: vec![0.0; rows],
            correct: vec![0.0; rows],
            tokens: vec![0.0; rows],
        };
        for (&[mean, entropy, correct], &r) in per_token.iter().zip(&targets.rows) {
            out.logit_mean[r] += mean;
            out.entropy[r] += entropy;
            out.correct[r] += correct;
            out.tokens[r] += 1.0;
        }
        out
    }

    /// `Σ field / Σ tokens` over `rows` (0 without tokens, as TRL).
    pub fn mean(&self, field: &[f64], rows: std::ops::Range<usize>) -> f64 {
        let tokens: f64 = self.tokens[rows.clone()].iter().sum();
        if tokens > 0.0 {
            field[rows].iter().sum::<f64>() / tokens
        } else {
            0.0
        }
    }
}

/// Per token of (K, V) `logits`: [mean logit, entropy, 1 if the arg-max (first on ties, as
/// torch) is the label]. One pass over a host f32 copy (a no-op for CPU f32 logits).
fn token_stats(logits: &Tensor, labels: &[u32]) -> Result<Vec<[f64; 3]>> {
    use rayon::prelude::*;
    let logits = logits
        .detach()
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .contiguous()?;
    let (k, v) = logits.dims2()?;
    if labels.len() != k {
        candle_core::bail!("token_stats: {k} logit rows for {} labels", labels.len());
    }
    let (storage, layout) = logits.storage_and_layout();
    let data = super::ops::cpu_f32(&storage, layout, "logits")?;
    Ok(data
        .par_chunks(v)
        .zip(labels.par_iter())
        .map(|(row, &label)| {
            let (mut max, mut arg, mut sum) = (f32::NEG_INFINITY, 0usize, 0f64);
            for (i, &z) in row.iter().enumerate() {
                if z > max {
                    (max, arg) = (z, i);
                }
                sum += z as f64;
            }
            // H = log Σ e^z − Σ p·z, with the maximum shifted out of the exponentials.
            let (mut se, mut sze) = (0f64, 0f64);
            for &z in row {
                let e = (z - max).exp() as f64;
                se += e;
                sze += (z - max) as f64 * e;
            }
            let entropy = se.ln() - sze / se;
            let correct = if arg == label as usize { 1.0 } else { 0.0 };
            [sum / v as f64, entropy, correct]
        })
        .collect())
}

/// The final hidden states (K, H) at the positions that predict `targets`.
pub fn target_states(hidden: &Tensor, targets: &Targets) -> Result<Tensor> {
    let (n, t, h) = hidden.dims3()?;
    hidden
        .reshape((n * t, h))?
        .index_select(&targets.positions, 0)
}

/// Logits (K, V) at the positions that predict `targets` (the output head runs only there).
pub fn target_logits(model: &TrainLlama, hidden: &Tensor, targets: &Targets) -> Result<Tensor> {
    model.logits_of(&target_states(hidden, targets)?)
}

/// Per-token log-probs of `targets` as f32 on the host, without gradient (the RL trainer's
/// old and reference log-probs): through the fused head ([`super::head`]) where it applies,
/// which never holds the (K, V) logits.
pub fn target_token_logps_host(
    model: &TrainLlama,
    hidden: &Tensor,
    targets: &Targets,
) -> Result<Vec<f32>> {
    let states = target_states(&hidden.detach(), targets)?;
    let weight = model.head_weight();
    if super::head::applies(&states, weight) {
        let labels = targets.labels.to_vec1::<u32>()?;
        return Ok(super::head::token_logps_entropies(&states, weight, &labels)?.0);
    }
    super::ops::token_logps(&model.logits_of(&states)?, &targets.labels)?
        .to_dtype(DType::F32)?
        .to_vec1::<f32>()
}

/// Per-token log-probs (K,) of `targets`, in their order (what on-policy RL needs: ratios
/// and KL are per token, not per sequence).
pub fn target_token_logps(
    model: &TrainLlama,
    hidden: &Tensor,
    targets: &Targets,
) -> Result<Tensor> {
    super::ops::token_logps(&target_logits(model, hidden, targets)?, &targets.labels)
}

/// Chosen and rejected log-probs, each (B,), from one forward pass of `model` over `batch`.
/// With `average`, each sum is divided by its completion length (TRL does so for `ipo`).
pub fn pair_logps(
    model: &TrainLlama,
    batch: &PairBatch,
    average: bool,
) -> Result<(Tensor, Tensor)> {
    let hidden = model.hidden_states_in(&batch.input_ids, &batch.layout)?;
    let (sums, counts) = completion_logps(model, &hidden, &batch.targets)?;
    let logps = if average { (sums / counts)? } else { sums };
    let b = batch.pairs;
    Ok((logps.narrow(0, 0, b)?, logps.narrow(0, b, b)?))
}

/// Chosen and rejected summed log-probs and completion token counts, each (B,), from one
/// forward pass.
pub struct PairLogps {
    pub chosen: Tensor,
    pub rejected: Tensor,
    pub chosen_tokens: Tensor,
    pub rejected_tokens: Tensor,
}

impl PairLogps {
    /// `(chosen, rejected)`, divided by the completion lengths when `average` (TRL's `ipo`).
    pub fn for_loss(&self, average: bool) -> Result<(Tensor, Tensor)> {
        if average {
            Ok((
                (&self.chosen / &self.chosen_tokens)?,
                (&self.rejected / &self.rejected_tokens)?,
            ))
        } else {
            Ok((self.chosen.clone(), self.rejected.clone()))
        }
    }
}

/// Summed log-probs and token counts of both sides of `batch` in one forward pass.
pub fn pair_logps_full(model: &TrainLlama, batch: &PairBatch) -> Result<PairLogps> {
    let hidden = model.hidden_states_in(&batch.input_ids, &batch.layout)?;
    let (sums, counts) = completion_logps(model, &hidden, &batch.targets)?;
    let b = batch.pairs;
    Ok(PairLogps {
        chosen: sums.narrow(0, 0, b)?,
        rejected: sums.narrow(0, b, b)?,
        chosen_tokens: counts.narrow(0, 0, b)?,
        rejected_tokens: counts.narrow(0, b, b)?,
    })
}

/// A right-padded batch of sequences with their own loss masks (SFT).
#[derive(Clone, Debug)]
pub struct SeqBatch {
    /// (N, T) u32.
    pub input_ids: Tensor,
    pub layout: BatchLayout,
    /// The loss tokens of row r count for output row r.
    pub targets: Targets,
}

impl SeqBatch {
    pub fn new(rows: &[super::data::TokenizedSeq], pad_id: u32, device: &Device) -> Result<Self> {
        if rows.is_empty() {
            candle_core::bail!("empty batch");
        }
        let t = rows.iter().map(|r| r.ids.len()).max().unwrap_or(0);
        let n = rows.len();
        let mut ids = vec![pad_id; n * t];
        let mut attn = vec![0f32; n * t];
        for (r, row) in rows.iter().enumerate() {
            ids[r * t..r * t + row.ids.len()].copy_from_slice(&row.ids);
            attn[r * t..r * t + row.ids.len()].fill(1.0);
        }
        let seqs: Vec<Vec<u32>> = rows.iter().map(|r| r.ids.clone()).collect();
        let masks: Vec<Vec<bool>> = rows.iter().map(|r| r.loss_mask.clone()).collect();
        let mask = Tensor::from_vec(attn, (n, t), device)?;
        Ok(Self {
            input_ids: Tensor::from_vec(ids, (n, t), device)?,
            layout: BatchLayout::padded(n, t, Some(&mask), device)?,
            targets: Targets::shifted(&seqs, &masks, device)?,
        })
    }
}

/// SFT loss as HF computes it: the mean negative log-likelihood over every loss token of the
/// batch, from per-row sums and token counts of [`sequence_logps`].
pub fn token_mean_nll(sums: &Tensor, counts: &Tensor) -> Result<Tensor> {
    let tokens = counts.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    sums.sum_all()?.neg()? / tokens.max(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// bf16 weights give the f32 log-probs of their own logits: a pair's summed log-probs
    /// over a few hundred tokens stay within a few hundredths of a nat of the f32 model's
    /// (summed in bf16 they were off by whole nats, more than a DPO margin).
    #[test]
    fn bf16_models_sum_log_probs_in_f32() {
        let cfg = crate::train::shapes::shape_config("tiny").unwrap();
        let dev = Device::Cpu;
        let pair = TokenizedPair {
            prompt: (0..40).map(|i| (i * 7) % 500).collect(),
            chosen: (0..300).map(|i| (i * 13 + 5) % 500).collect(),
            rejected: (0..280).map(|i| (i * 11 + 3) % 500).collect(),
        };
        let sums = |dtype| {
            let model = crate::train::shapes::random_model(&cfg, dtype, &dev, 1).unwrap();
            let batch = PairBatch::new(std::slice::from_ref(&pair), 0, &dev).unwrap();
            let lp = pair_logps_full(&model, &batch).unwrap();
            assert_eq!(lp.chosen.dtype(), DType::F32);
            [lp.chosen, lp.rejected].map(|t| t.to_vec1::<f32>().unwrap()[0])
        };
        let (f, b) = (sums(DType::F32), sums(DType::BF16));
        assert!(f[0] < -1500.0, "{f:?}");
        for (x, y) in f.iter().zip(&b) {
            assert!((x - y).abs() < 0.1, "f32 {f:?} bf16 {b:?}");
        }
    }

    /// The diagnostics against their definitions, computed naively per token.
    #[test]
    fn token_stats_follow_trl_definitions() {
        let logits = [
            [1.0f32, 3.0, 2.0, 3.0],
            [0.0, 0.0, 0.0, 0.0],
            [-5.0, 10.0, 0.5, 2.0],
        ];
        let labels = [1u32, 2, 1];
        let rows_of = [0usize, 0, 1];
        let flat: Vec<f32> = logits.iter().flatten().copied().collect();
        let t = Tensor::from_vec(flat, (3, 4), &Device::Cpu).unwrap();
        let triples: Vec<(u32, u32, usize)> = labels
            .iter()
            .zip(rows_of)
            .enumerate()
            .map(|(i, (&l, r))| (i as u32, l, r))
            .collect();
        let targets = Targets::new(&triples, 2, &Device::Cpu).unwrap();
        let s = TokenStats::of(&t, &targets).unwrap();

        let naive = |z: &[f32; 4]| {
            let lse = z.iter().map(|&x| (x as f64).exp()).sum::<f64>().ln();
            let h: f64 = z
                .iter()
                .map(|&x| {
                    let lp = x as f64 - lse;
                    -lp.exp() * lp
                })
                .sum();
            (z.iter().map(|&x| x as f64).sum::<f64>() / 4.0, h)
        };
        let (m0, h0) = naive(&logits[0]);
        let (m1, h1) = naive(&logits[1]);
        let (m2, h2) = naive(&logits[2]);
        let close = |a: f64, b: f64| assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        close(s.logit_mean[0], m0 + m1);
        close(s.logit_mean[1], m2);
        close(s.entropy[0], h0 + h1);
        close(s.entropy[1], h2);
        close(h1, 4f64.ln());
        // Ties go to the first maximum (index 1 in row 0, 0 in row 1), as torch's argmax.
        assert_eq!(s.correct, vec![1.0, 1.0]);
        assert_eq!(s.tokens, vec![2.0, 1.0]);
        close(s.mean(&s.entropy, 0..2), (h0 + h1 + h2) / 3.0);
        close(s.mean(&s.correct, 0..1), 0.5);
    }
}
