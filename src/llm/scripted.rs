//! Deterministic canned replies, for testing the layers above the backends without a model.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_trait::async_trait;

use super::{
    BackendId, ChatBackend, ChatRequest, ChatResponse, Choice, FinishReason, LlmError, TokenUsage,
};

type ReplyFn = dyn Fn(&ChatRequest, usize) -> Result<String, LlmError> + Send + Sync;

/// A backend whose replies come from a function of (request, sample index). Counts its calls.
pub struct ScriptedBackend {
    id: BackendId,
    reply: Box<ReplyFn>,
    calls: AtomicU64,
}

impl ScriptedBackend {
    pub fn new(
        name: &str,
        reply: impl Fn(&ChatRequest, usize) -> Result<String, LlmError> + Send + Sync + 'static,
    ) -> Arc<Self> {
        Arc::new(Self {
            id: BackendId {
                kind: "scripted".into(),
                model: name.into(),
                endpoint: String::new(),
            },
            reply: Box::new(reply),
            calls: AtomicU64::new(0),
        })
    }

    /// Replies with the given texts in turn (sample `i` of call `c` gets entry `(c·n + i) mod len`).
    pub fn cycle(name: &str, replies: Vec<String>) -> Arc<Self> {
        assert!(
            !replies.is_empty(),
            "a scripted backend needs at least one reply"
        );
        let counter = AtomicU64::new(0);
        Self::new(name, move |_, _| {
            let k = counter.fetch_add(1, Ordering::Relaxed) as usize;
            Ok(replies[k % replies.len()].clone())
        })
    }

    /// Replies `"<name> #<sample>: <last message>"`: deterministic and request-dependent.
    pub fn echo(name: &str) -> Arc<Self> {
        let tag = name.to_string();
        Self::new(name, move |req, i| {
            let last = req.messages.last().map_or("", |m| m.content.as_str());
            Ok(format!("{tag} #{i}: {last}"))
        })
    }

    /// Number of `chat` calls answered so far.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }
}

fn count_words(s: &str) -> u64 {
    s.split_whitespace().count() as u64
}

#[async_trait]
impl ChatBackend for ScriptedBackend {
    fn id(&self) -> &BackendId {
        &self.id
    }

    async fn chat(&self, req: &ChatRequest) -> Result<ChatResponse, LlmError> {
        req.validate()?;
        self.calls.fetch_add(1, Ordering::Relaxed);
        let mut choices = Vec::with_capacity(req.n);
        let mut completion_tokens = 0;
        for i in 0..req.n {
            let mut text = (self.reply)(req, i)?;
            let mut finish = FinishReason::Stop;
            if let Some(cut) = req.stop.iter().filter_map(|s| text.find(s.as_str())).min() {
                text.truncate(cut);
            }
            let words: Vec<&str> = text.split_whitespace().collect();
            if words.len() > req.max_tokens {
                text = words[..req.max_tokens].join(" ");
                finish = FinishReason::Length;
            }
            if text.trim().is_empty() {
                return Err(LlmError::EmptyReply {
                    backend: self.id.to_string(),
                    attempts: 1,
                });
            }
            completion_tokens += count_words(&text);
            choices.push(Choice {
                index: i,
                content: text,
                finish_reason: finish,
                token_ids: None,
                logprobs: None,
            });
        }
        Ok(ChatResponse {
            choices,
            usage: TokenUsage {
                prompt_tokens: req.messages.iter().map(|m| count_words(&m.content)).sum(),
                completion_tokens,
                cached_prompt_tokens: 0,
            },
            model: self.id.model.clone(),
            retries: 0,
            cached: false,
        })
    }
}
