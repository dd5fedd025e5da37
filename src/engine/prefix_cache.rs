//! Prompt KV reuse across requests. The prompts a run sends share long prefixes: a turn's
//! candidates, their futures and its judges all open with the same system prompt and the
//! conversation so far, and the next turn's prompt extends this one. The engine keeps the
//! KV cache of recent prompts (one row each, never written again) under a memory budget;
//! a new prompt starts from the longest stored prefix and prefills only the rest.
//!
//! A reused position holds exactly what a cold prefill computes there (keys and values of
//! a position depend only on the tokens up to it), so a hit changes no token; see the
//! engine's tests.

use super::llama::KvCache;
use super::TokenLogprob;

/// Fewer shared tokens than this are prefilled again: the copy and bookkeeping are not
/// worth it.
const MIN_REUSE: usize = 16;

/// Default budget of the stored caches, in bytes.
pub const DEFAULT_BUDGET_BYTES: usize = 256 << 20;

/// Most prompt tokens whose scores are kept (a few hundred bytes each).
const SCORED_BUDGET_TOKENS: usize = 1 << 16;

/// A prompt scored token by token (`echo` with `logprobs`).
struct Scored {
    tokens: Vec<u32>,
    /// Alternatives recorded per token.
    top: usize,
    /// `scores[i]`: token `i + 1`'s log-probability record.
    scores: Vec<TokenLogprob>,
    last_used: u64,
}

struct Entry {
    tokens: Vec<u32>,
    /// One row, `tokens.len()` positions.
    cache: KvCache,
    /// Next-token logits after the whole of `tokens`: an exact repeat prefills nothing.
    logits: Vec<f32>,
    last_used: u64,
}

/// What a prompt can start from.
pub enum Hit {
    /// The same prompt was prefilled before: its cache (fork it, never append to it) and
    /// its last position's logits.
    Exact { cache: KvCache, logits: Vec<f32> },
    /// The first `len` tokens were: a fresh one-row cache holding them, with room for the
    /// whole prompt.
    Prefix { cache: KvCache, len: usize },
}

/// The stored prompt caches of one engine, least recently used evicted first.
pub struct PrefixCache {
    entries: Vec<Entry>,
    /// Scored prompts, beside their caches: a prompt that starts like one scores only the
    /// rest (lm-evaluation-harness scores every choice after the same question).
    scored: Vec<Scored>,
    scored_tokens: usize,
    budget_bytes: usize,
    bytes_per_token: usize,
    used_tokens: usize,
    clock: u64,
}

impl PrefixCache {
    /// `bytes_per_token`: the KV size of one position over all layers; a budget of 0 turns
    /// reuse off.
    pub fn new(budget_bytes: usize, bytes_per_token: usize) -> Self {
        PrefixCache {
            entries: Vec::new(),
            scored: Vec::new(),
            scored_tokens: 0,
            budget_bytes,
            bytes_per_token: bytes_per_token.max(1),
            used_tokens: 0,
            clock: 0,
        }
    }

    fn budget_tokens(&self) -> usize {
        self.budget_bytes / self.bytes_per_token
    }

    /// Forgets every stored prompt.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.used_tokens = 0;
        self.scored.clear();
        self.scored_tokens = 0;
    }

    /// The longest start of `tokens` shared with a prompt scored with `top` alternatives, at
    /// least [`MIN_REUSE`] tokens: its length and the scores of its tokens from the second
    /// on (`scores[i]` is token `i + 1`'s, which depends on tokens `0..=i + 1` only).
    pub fn scored_start(
        &mut self,
        tokens: &[u32],
        top: usize,
    ) -> Option<(usize, Vec<TokenLogprob>)> {
        self.clock += 1;
        let (i, shared) = self
            .scored
            .iter()
            .enumerate()
            .filter(|(_, s)| s.top == top)
            .map(|(i, s)| (i, common_prefix(&s.tokens, tokens)))
            .max_by_key(|&(_, shared)| shared)?;
        if shared < MIN_REUSE {
            return None;
        }
        let s = &mut self.scored[i];
        s.last_used = self.clock;
        Some((shared, s.scores[..shared - 1].to_vec()))
    }

    /// Keeps a scored prompt's scores (`scores[i]` for token `i + 1`), the least recently
    /// used leaving past the budget; nothing is kept when reuse is off.
    pub fn insert_scored(&mut self, tokens: &[u32], top: usize, scores: Vec<TokenLogprob>) {
        if self.budget_bytes == 0 || tokens.len() > SCORED_BUDGET_TOKENS {
            return;
        }
        self.clock += 1;
        if let Some(s) = self
            .scored
            .iter_mut()
            .find(|s| s.top == top && s.tokens == tokens)
        {
            s.last_used = self.clock;
            return;
        }
        while self.scored_tokens + tokens.len() > SCORED_BUDGET_TOKENS {
            let Some(oldest) = (0..self.scored.len()).min_by_key(|&i| self.scored[i].last_used)
            else {
                break;
            };
            self.scored_tokens -= self.scored.swap_remove(oldest).tokens.len();
        }
        self.scored_tokens += tokens.len();
        self.scored.push(Scored {
            tokens: tokens.to_vec(),
            top,
            scores,
            last_used: self.clock,
        });
    }

    /// Bytes held by the stored caches.
    pub fn used_bytes(&self) -> usize {
        self.used_tokens * self.bytes_per_token
    }

    /// The longest stored start of `prompt`. At least one position is left to prefill
    /// unless the prompt is an exact repeat (its logits are stored; a longer entry's are not).
    pub fn lookup(&mut self, prompt: &[u32]) -> candle_core::Result<Option<Hit>> {
        self.clock += 1;
        let mut best: Option<(usize, usize)> = None;
        for (i, e) in self.entries.iter().enumerate() {
            let shared = common_prefix(&e.tokens, prompt);
            let reuse = if shared == prompt.len() && e.tokens.len() == prompt.len() {
                shared
            } else {
                shared.min(prompt.len() - 1)
            };
            if reuse >= MIN_REUSE && best.is_none_or(|(_, b)| reuse > b) {
                best = Some((i, reuse));
            }
        }
        let Some((i, reuse)) = best else {
            return Ok(None);
        };
        let e = &mut self.entries[i];
        e.last_used = self.clock;
        if reuse == prompt.len() {
            return Ok(Some(Hit::Exact {
                cache: e.cache.clone(),
                logits: e.logits.clone(),
            }));
        }
        Ok(Some(Hit::Prefix {
            cache: e.cache.prefix(reuse, prompt.len())?,
            len: reuse,
        }))
    }

    /// Stores a prompt's one-row cache (exactly `tokens.len()` positions, never appended to
    /// again). Entries that are strict starts of `tokens` leave: this one serves their
    /// prompts too, with one position to prefill.
    pub fn insert(&mut self, tokens: &[u32], cache: KvCache, logits: Vec<f32>) {
        if tokens.len() > self.budget_tokens() || cache.len() != tokens.len() {
            return;
        }
        self.clock += 1;
        if let Some(e) = self.entries.iter_mut().find(|e| e.tokens == tokens) {
            e.last_used = self.clock;
            return;
        }
        let covered: Vec<usize> = (0..self.entries.len())
            .filter(|&i| {
                let t = &self.entries[i].tokens;
                t.len() < tokens.len() && tokens.starts_with(t)
            })
            .collect();
        for i in covered.into_iter().rev() {
            self.remove(i);
        }
        while self.used_tokens + tokens.len() > self.budget_tokens() {
            let Some(oldest) = (0..self.entries.len()).min_by_key(|&i| self.entries[i].last_used)
            else {
                break;
            };
            self.remove(oldest);
        }
        self.used_tokens += tokens.len();
        self.entries.push(Entry {
            tokens: tokens.to_vec(),
            cache,
            logits,
            last_used: self.clock,
        });
    }

    fn remove(&mut self, i: usize) {
        let e = self.entries.swap_remove(i);
        self.used_tokens -= e.tokens.len();
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(cache: &mut PrefixCache, tokens: &[u32]) {
        cache.insert(
            tokens,
            KvCache::placeholder(tokens.len()),
            vec![tokens.len() as f32],
        );
    }

    fn reuse(cache: &mut PrefixCache, prompt: &[u32]) -> Option<(bool, usize)> {
        cache.lookup(prompt).unwrap().map(|hit| match hit {
            Hit::Exact { cache, .. } => (true, cache.len()),
            Hit::Prefix { len, .. } => (false, len),
        })
    }

    fn seq(n: u32) -> Vec<u32> {
        (0..n).collect()
    }

    #[test]
    fn longest_stored_start_wins_and_one_position_is_left_to_prefill() {
        let mut c = PrefixCache::new(1 << 20, 1);
        store(&mut c, &seq(40));
        let mut other = seq(20);
        other.extend([900, 901, 902]);
        store(&mut c, &other);
        // An exact repeat prefills nothing.
        assert_eq!(reuse(&mut c, &seq(40)), Some((true, 40)));
        // A longer prompt reuses the whole stored one.
        assert_eq!(reuse(&mut c, &seq(60)), Some((false, 40)));
        // A shorter prompt inside a stored one keeps its last position to prefill (its logits
        // are not stored).
        assert_eq!(reuse(&mut c, &seq(30)), Some((false, 29)));
        // The branch that shares more wins.
        let mut branch = other.clone();
        branch.push(7);
        assert_eq!(reuse(&mut c, &branch), Some((false, 23)));
        // Too little in common: a cold prefill.
        assert_eq!(reuse(&mut c, &[0, 1, 2, 3, 99]), None);
    }

    #[test]
    fn a_longer_prompt_replaces_its_starts_and_the_budget_evicts_the_least_recent() {
        let mut c = PrefixCache::new(100, 1);
        store(&mut c, &seq(30));
        store(&mut c, &seq(50));
        assert_eq!(c.used_bytes(), 50, "seq(30) is covered by seq(50)");
        let mut b: Vec<u32> = (1000..1040).collect();
        store(&mut c, &b);
        assert_eq!(c.used_bytes(), 90);
        // Touch seq(50): the other one is now the least recent and leaves for the next.
        assert!(reuse(&mut c, &seq(50)).is_some());
        b = (2000..2030).collect();
        store(&mut c, &b);
        assert_eq!(c.used_bytes(), 80);
        assert_eq!(reuse(&mut c, &(1000..1040).collect::<Vec<_>>()), None);
        assert_eq!(reuse(&mut c, &seq(50)), Some((true, 50)));
        // A prompt larger than the whole budget is not stored; a zero budget stores nothing.
        store(&mut c, &seq(101));
        assert_eq!(reuse(&mut c, &seq(101)), Some((false, 50)));
        let mut off = PrefixCache::new(0, 1);
        store(&mut off, &seq(20));
        assert_eq!(reuse(&mut off, &seq(20)), None);
        // Cleared, it holds nothing and has its whole budget again.
        c.clear();
        assert_eq!((c.used_bytes(), reuse(&mut c, &seq(50))), (0, None));
        store(&mut c, &seq(60));
        store(&mut c, &b);
        assert_eq!(c.used_bytes(), 90, "both fit after a clear");
    }
}
