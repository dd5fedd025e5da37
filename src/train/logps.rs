//! Sequence log-probabilities of preference pairs, as TRL computes them (DESIGN §5): the
//! chosen and rejected sides of B pairs form one right-padded batch of 2B rows (chosen rows
//! first, then rejected rows) run in ONE forward pass; the log-prob of a row is the sum over
//! its completion tokens of `log p(token | prefix)`, prompt and padding masked after the
//! one-token shift.

use candle_core::{DType, Device, Result, Tensor, D};

use super::model::TrainLlama;

/// One preference pair as token ids. `prompt` ends where the completions start (with the
/// generation prompt); `chosen` / `rejected` are the completion tokens only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenizedPair {
    pub prompt: Vec<u32>,
    pub chosen: Vec<u32>,
    pub rejected: Vec<u32>,
}

/// A right-padded batch of 2B rows: `prompt + chosen` for each pair, then `prompt + rejected`.
#[derive(Clone, Debug)]
pub struct PairBatch {
    /// (2B, T) u32.
    pub input_ids: Tensor,
    /// (2B, T) f32, 1 for real tokens, 0 for padding.
    pub attention_mask: Tensor,
    /// (2B, T) f32, 1 for completion tokens (the positions whose log-prob counts).
    pub loss_mask: Tensor,
    /// Number of pairs B.
    pub pairs: usize,
}

impl PairBatch {
    /// Builds the batch; `pad_id` fills the padding (any id: padded positions are masked).
    pub fn new(pairs: &[TokenizedPair], pad_id: u32, device: &Device) -> Result<Self> {
        if pairs.is_empty() {
            candle_core::bail!("empty batch of pairs");
        }
        let rows: Vec<(&[u32], &[u32])> = pairs
            .iter()
            .map(|p| (p.prompt.as_slice(), p.chosen.as_slice()))
            .chain(
                pairs
                    .iter()
                    .map(|p| (p.prompt.as_slice(), p.rejected.as_slice())),
            )
            .collect();
        for (prompt, completion) in &rows {
            if prompt.is_empty() || completion.is_empty() {
                candle_core::bail!("a pair has an empty prompt or completion");
            }
        }
        let t = rows
            .iter()
            .map(|(p, c)| p.len() + c.len())
            .max()
            .unwrap_or(0);
        let n = rows.len();
        let mut ids = vec![pad_id; n * t];
        let mut attn = vec![0f32; n * t];
        let mut loss = vec![0f32; n * t];
        for (r, (prompt, completion)) in rows.iter().enumerate() {
            let base = r * t;
            for (i, &tok) in prompt.iter().chain(completion.iter()).enumerate() {
                ids[base + i] = tok;
                attn[base + i] = 1.0;
                if i >= prompt.len() {
                    loss[base + i] = 1.0;
                }
            }
        }
        Ok(Self {
            input_ids: Tensor::from_vec(ids, (n, t), device)?,
            attention_mask: Tensor::from_vec(attn, (n, t), device)?,
            loss_mask: Tensor::from_vec(loss, (n, t), device)?,
            pairs: pairs.len(),
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
    let dtype = logits.dtype();
    let logp = candle_nn::ops::log_softmax(&logits.narrow(1, 0, t - 1)?, D::Minus1)?;
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

/// Chosen and rejected log-probs, each (B,), from one forward pass of `model` over `batch`.
/// With `average`, each sum is divided by its completion length (TRL does so for `ipo`).
pub fn pair_logps(
    model: &TrainLlama,
    batch: &PairBatch,
    average: bool,
) -> Result<(Tensor, Tensor)> {
    let logits = model.forward(&batch.input_ids, Some(&batch.attention_mask))?;
    let (sums, counts) = sequence_logps(&logits, &batch.input_ids, &batch.loss_mask)?;
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
    let logits = model.forward(&batch.input_ids, Some(&batch.attention_mask))?;
    let (sums, counts) = sequence_logps(&logits, &batch.input_ids, &batch.loss_mask)?;
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
    pub input_ids: Tensor,
    pub attention_mask: Tensor,
    pub loss_mask: Tensor,
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
        let mut loss = vec![0f32; n * t];
        for (r, row) in rows.iter().enumerate() {
            for (i, (&tok, &m)) in row.ids.iter().zip(&row.loss_mask).enumerate() {
                ids[r * t + i] = tok;
                attn[r * t + i] = 1.0;
                loss[r * t + i] = if m { 1.0 } else { 0.0 };
            }
        }
        Ok(Self {
            input_ids: Tensor::from_vec(ids, (n, t), device)?,
            attention_mask: Tensor::from_vec(attn, (n, t), device)?,
            loss_mask: Tensor::from_vec(loss, (n, t), device)?,
        })
    }
}

/// SFT loss as HF computes it: the mean negative log-likelihood over every loss token of the
/// batch, from per-row sums and token counts of [`sequence_logps`].
pub fn token_mean_nll(sums: &Tensor, counts: &Tensor) -> Result<Tensor> {
    let tokens = counts.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    sums.sum_all()?.neg()? / tokens.max(1.0)
}
