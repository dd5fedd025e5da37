//! Token batches for RL updates. A response trains on the token ids its sampler drew (kept
//! from the engine through the rollout records), after the prompt rendered with the
//! generation prompt: decoding and re-encoding text need not give the sampled ids back, and
//! the log-probabilities that matter are those of what was sampled.
//!
//! Responses with no sampled ids (rollout files written before they were kept) are tokenized
//! with the model's chat template exactly as DPO completions are ([`crate::train::data`]):
//! the prompt rendered with the generation prompt must be a prefix of prompt + response
//! rendered as a conversation, and the response tokens are what follows it, cut after the
//! end-of-turn token (the template text after it was never sampled). A truncated response
//! (it hit `max_new_tokens`) never sampled an end-of-turn either, so it trains on its text
//! tokens only.
//!
//! Only the prompt and the sampled reply are in the sequence: the simulated future turns that
//! scored the reply are never part of what the policy trains on.
//!
//! Responses of one group share their prompt; in a batch they are packed into one row,
//! `prompt | response₁ | response₂ | …`, each response attending to the prompt and to itself
//! and positioned right after the prompt (the layout of DPO's packed pairs), so the prompt is
//! encoded once per group rather than once per response.

use candle_core::{Device, Result, Tensor};

use crate::engine::ChatCodec;
use crate::llm::ChatMessage;
use crate::train::data::{render_ids, suffix_after};
use crate::train::logps::Targets;
use crate::train::model::BatchLayout;

/// One response ready to train: token ids and its advantage.
#[derive(Clone, Debug, PartialEq)]
pub struct RlSample {
    /// Index of its group in the update (samples of a group have identical prompts).
    pub group: usize,
    /// Index of the response in its group.
    pub response: usize,
    pub prompt: Vec<u32>,
    /// The tokens that carry the loss.
    pub response_ids: Vec<u32>,
    pub advantage: f32,
}

/// Prompt ids (with the generation prompt) and the loss-carrying response ids: the sampled
/// ids when there are some, else the re-tokenized text ([`tokenize_response`]).
pub fn response_tokens(
    codec: &ChatCodec,
    prompt: &[ChatMessage],
    response: &crate::train::rl::ScoredResponse,
) -> std::result::Result<(Vec<u32>, Vec<u32>), String> {
    let Some(ids) = &response.token_ids else {
        return tokenize_response(codec, prompt, &response.text, response.truncated);
    };
    if ids.is_empty() {
        return Err("the response has no token to train on".into());
    }
    Ok((prompt_ids(codec, prompt)?, ids.clone()))
}

/// The prompt's ids with the generation prompt; it must end with the user's turn.
fn prompt_ids(codec: &ChatCodec, prompt: &[ChatMessage]) -> std::result::Result<Vec<u32>, String> {
    if prompt.last().is_none_or(|m| m.role != "user") {
        return Err("the prompt must end with a user message".into());
    }
    render_ids(codec, prompt, true)
}

/// Prompt ids (with the generation prompt) and the loss-carrying response ids of `text`.
pub fn tokenize_response(
    codec: &ChatCodec,
    prompt: &[ChatMessage],
    text: &str,
    truncated: bool,
) -> std::result::Result<(Vec<u32>, Vec<u32>), String> {
    let prompt_ids = prompt_ids(codec, prompt)?;
    let mut all = prompt.to_vec();
    all.push(ChatMessage {
        role: "assistant".into(),
        content: text.to_string(),
    });
    let mut response = suffix_after(&prompt_ids, &render_ids(codec, &all, false)?, "response")?;
    if let Some(end) = response.iter().rposition(|t| codec.eos_ids.contains(t)) {
        // Keep the end-of-turn token a finished reply sampled; a truncated one never did.
        response.truncate(if truncated { end } else { end + 1 });
    }
    if response.is_empty() {
        return Err("the response has no token to train on".into());
    }
    Ok((prompt_ids, response))
}

/// A packed micro-batch: per-token tensors are in the order of `targets`.
#[derive(Clone, Debug)]
pub struct RlBatch {
    /// (rows, T) u32.
    pub input_ids: Tensor,
    pub layout: BatchLayout,
    /// Every response token, its predicting position and its sample (output row).
    pub targets: Targets,
    /// (K,) f32 advantage of each token's response.
    pub advantages: Tensor,
    /// Response length of each token's sample (for the aggregation weights).
    pub token_response_len: Vec<usize>,
    /// Sample (index into the slice given to [`RlBatch::new`]) of each token.
    pub token_sample: Vec<usize>,
    /// Response tokens (K).
    pub tokens: usize,
}

impl RlBatch {
    /// Packs `samples`; responses of the same group share one row. `pad_id` fills the
    /// padding (masked, any id).
    pub fn new(samples: &[&RlSample], pad_id: u32, device: &Device) -> Result<Self> {
        if samples.is_empty() {
            candle_core::bail!("empty RL batch");
        }
        // Rows: sample indices sharing a group, in first-seen order.
        let mut rows: Vec<Vec<usize>> = Vec::new();
        for (i, s) in samples.iter().enumerate() {
            match rows.iter_mut().find(|r| samples[r[0]].group == s.group) {
                Some(r) if samples[r[0]].prompt == s.prompt => r.push(i),
                Some(_) => candle_core::bail!("samples of group {} differ in prompt", s.group),
                None => rows.push(vec![i]),
            }
        }
        let width = rows
            .iter()
            .map(|r| {
                samples[r[0]].prompt.len()
                    + r.iter()
                        .map(|&i| samples[i].response_ids.len())
                        .sum::<usize>()
            })
            .max()
            .unwrap_or(0);
        if rows.len() * width == 0 || samples.iter().any(|s| s.prompt.is_empty()) {
            candle_core::bail!("a sample has an empty prompt");
        }
        if samples.iter().any(|s| s.response_ids.is_empty()) {
            candle_core::bail!("a sample has no response token");
        }
        let mut ids = vec![pad_id; rows.len() * width];
        let mut positions = vec![0u32; rows.len() * width];
        let mut segments = vec![vec![None; width]; rows.len()];
        let (mut triples, mut adv, mut lens, mut owner) = (vec![], vec![], vec![], vec![]);
        for (r, members) in rows.iter().enumerate() {
            let base = r * width;
            let prompt = &samples[members[0]].prompt;
            let np = prompt.len();
            for (i, &tok) in prompt.iter().enumerate() {
                (ids[base + i], positions[base + i], segments[r][i]) = (tok, i as u32, Some(0));
            }
            let mut at = np;
            for (seg, &si) in members.iter().enumerate() {
                let s = samples[si];
                let seg = u8::try_from(seg + 1).map_err(|_| {
                    candle_core::Error::Msg("more than 255 responses in a row".into())
                })?;
                for (k, &tok) in s.response_ids.iter().enumerate() {
                    (ids[base + at], positions[base + at], segments[r][at]) =
                        (tok, (np + k) as u32, Some(seg));
                    let predictor = if k == 0 { base + np - 1 } else { base + at - 1 };
                    triples.push((predictor as u32, tok, si));
                    adv.push(s.advantage);
                    lens.push(s.response_ids.len());
                    owner.push(si);
                    at += 1;
                }
            }
        }
        Ok(Self {
            input_ids: Tensor::from_vec(ids, (rows.len(), width), device)?,
            layout: BatchLayout::segmented(&segments, positions, device)?,
            targets: Targets::new(&triples, samples.len(), device)?,
            tokens: adv.len(),
            advantages: Tensor::new(adv, device)?,
            token_response_len: lens,
            token_sample: owner,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::tiny::{write_tiny_llama, TinySpec};
    use crate::llm::spec::LocalModelFiles;

    fn codec() -> (tempfile::TempDir, ChatCodec) {
        let dir = tempfile::tempdir().unwrap();
        write_tiny_llama(dir.path(), &TinySpec::default()).unwrap();
        let c = ChatCodec::load(&LocalModelFiles::HfDir(dir.path().to_path_buf())).unwrap();
        (dir, c)
    }

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }

    #[test]
    fn response_tokens_are_the_reply_and_its_end_of_turn() {
        let (_d, c) = codec();
        let prompt = vec![msg("user", "hi")];
        let (p, r) = tokenize_response(&c, &prompt, "hello there", false).unwrap();
        assert_eq!(p, c.encode(&c.render(&prompt, true).unwrap()).unwrap());
        let mut want = c.encode("hello there").unwrap();
        let eot = c.encode("<|im_end|>").unwrap();
        want.extend(&eot);
        assert_eq!(r, want, "the newline after <|im_end|> is not trained");
        let (_, r) = tokenize_response(&c, &prompt, "hello there", true).unwrap();
        assert_eq!(
            r,
            c.encode("hello there").unwrap(),
            "truncated: no end-of-turn"
        );
        assert!(tokenize_response(&c, &[msg("assistant", "x")], "y", false).is_err());
    }

    /// The sampled ids train even where decoding and re-encoding the text gives other ids
    /// (here the reply spelled a byte at a time, and one invalid UTF-8 byte).
    #[test]
    fn sampled_ids_train_not_the_re_encoded_text() {
        let (_d, c) = codec();
        let prompt = vec![msg("user", "hi")];
        let eot = c.encode("<|im_end|>").unwrap();
        let mut sampled: Vec<u32> = c.encode("ab").unwrap();
        // The first byte of "é" alone: it decodes to U+FFFD, which re-encodes to 3 bytes.
        sampled.push(c.encode("é").unwrap()[0]);
        sampled.extend(&eot);
        let text = "ab\u{FFFD}".to_string();
        let resp = crate::train::rl::ScoredResponse {
            text: text.clone(),
            reward: Some(1.0),
            metrics: Default::default(),
            truncated: false,
            token_ids: Some(sampled.clone()),
        };
        let (p, r) = response_tokens(&c, &prompt, &resp).unwrap();
        assert_eq!(p, c.encode(&c.render(&prompt, true).unwrap()).unwrap());
        assert_eq!(r, sampled);
        let (_, re_encoded) = tokenize_response(&c, &prompt, &text, false).unwrap();
        assert_ne!(re_encoded, sampled, "the text does not round-trip");
        let old = crate::train::rl::ScoredResponse {
            token_ids: None,
            ..resp
        };
        assert_eq!(response_tokens(&c, &prompt, &old).unwrap().1, re_encoded);
    }

    fn sample(group: usize, prompt: &[u32], resp: &[u32], adv: f32) -> RlSample {
        RlSample {
            group,
            response: 0,
            prompt: prompt.to_vec(),
            response_ids: resp.to_vec(),
            advantage: adv,
        }
    }

    #[test]
    fn packs_group_responses_after_one_prompt() {
        let s = [
            sample(0, &[1, 2, 3], &[10, 11], 0.5),
            sample(1, &[4, 5], &[12], -1.0),
            sample(0, &[1, 2, 3], &[13, 14, 15], -0.5),
        ];
        let refs: Vec<&RlSample> = s.iter().collect();
        let b = RlBatch::new(&refs, 0, &Device::Cpu).unwrap();
        // Row 0: 1 2 3 | 10 11 | 13 14 15; row 1: 4 5 | 12, padded to 8.
        assert_eq!(
            b.input_ids.to_vec2::<u32>().unwrap(),
            vec![
                vec![1, 2, 3, 10, 11, 13, 14, 15],
                vec![4, 5, 12, 0, 0, 0, 0, 0]
            ]
        );
        let pos = b
            .layout
            .positions
            .as_ref()
            .unwrap()
            .to_vec2::<u32>()
            .unwrap();
        assert_eq!(pos[0], vec![0, 1, 2, 3, 4, 3, 4, 5]);
        // Predictors: the first token of each response is predicted by the last prompt token.
        assert_eq!(
            b.targets.positions.to_vec1::<u32>().unwrap(),
            vec![2, 3, 2, 5, 6, 9]
        );
        assert_eq!(
            b.targets.labels.to_vec1::<u32>().unwrap(),
            vec![10, 11, 13, 14, 15, 12]
        );
        assert_eq!(b.token_sample, vec![0, 0, 2, 2, 2, 1]);
        assert_eq!(b.token_response_len, vec![2, 2, 3, 3, 3, 1]);
        assert_eq!(
            b.advantages.to_vec1::<f32>().unwrap(),
            vec![0.5, 0.5, -0.5, -0.5, -0.5, -1.0]
        );
        // The second response does not see the first: query 5 (token 13) reads 0..=2 and 5.
        let row0 = b
            .layout
            .bias
            .get(0)
            .unwrap()
            .get(0)
            .unwrap()
            .get(5)
            .unwrap();
        let seen: Vec<bool> = row0
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|v| *v == 0.0)
            .collect();
        assert_eq!(
            seen,
            vec![true, true, true, false, false, true, false, false]
        );
    }
}
