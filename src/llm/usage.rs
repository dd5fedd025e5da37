//! Usage accounting per role: calls, tokens, retries, failures, cache hits.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use super::{
    BackendId, ChatBackend, ChatMessage, ChatRequest, ChatResponse, LlmError, OptionProbs,
};

/// Lock-free counters shared by everything that calls one role's backend.
#[derive(Debug, Default)]
pub struct UsageMeter {
    calls: AtomicU64,
    cache_hits: AtomicU64,
    prompt_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    retries: AtomicU64,
    failures: AtomicU64,
}

/// A point-in-time copy of a [`UsageMeter`], as written to manifests and summaries.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageSnapshot {
    /// Calls that reached the model (cache hits excluded).
    pub calls: u64,
    pub cache_hits: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub retries: u64,
    /// Calls that ended in an error after every retry.
    pub failures: u64,
}

impl UsageMeter {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    pub fn record(&self, resp: &ChatResponse) {
        if resp.cached {
            self.cache_hits.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.prompt_tokens
            .fetch_add(resp.usage.prompt_tokens, Ordering::Relaxed);
        self.completion_tokens
            .fetch_add(resp.usage.completion_tokens, Ordering::Relaxed);
        self.retries
            .fetch_add(u64::from(resp.retries), Ordering::Relaxed);
    }

    /// Counts a log-probability scoring call (a prompt pass, no completion).
    pub fn record_probe(&self, p: &OptionProbs) {
        if p.cached {
            self.cache_hits.fetch_add(1, Ordering::Relaxed);
        } else {
            self.calls.fetch_add(1, Ordering::Relaxed);
            self.prompt_tokens
                .fetch_add(p.prompt_tokens, Ordering::Relaxed);
        }
    }

    pub fn record_failure(&self, err: &LlmError) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.failures.fetch_add(1, Ordering::Relaxed);
        self.retries.fetch_add(
            u64::from(attempts(err).saturating_sub(1)),
            Ordering::Relaxed,
        );
    }

    pub fn snapshot(&self) -> UsageSnapshot {
        UsageSnapshot {
            calls: self.calls.load(Ordering::Relaxed),
            cache_hits: self.cache_hits.load(Ordering::Relaxed),
            prompt_tokens: self.prompt_tokens.load(Ordering::Relaxed),
            completion_tokens: self.completion_tokens.load(Ordering::Relaxed),
            retries: self.retries.load(Ordering::Relaxed),
            failures: self.failures.load(Ordering::Relaxed),
        }
    }
}

fn attempts(err: &LlmError) -> u32 {
    match err {
        LlmError::RateLimited { attempts, .. }
        | LlmError::Server { attempts, .. }
        | LlmError::Timeout { attempts, .. }
        | LlmError::MalformedResponse { attempts, .. }
        | LlmError::Connection { attempts, .. }
        | LlmError::EmptyReply { attempts, .. } => *attempts,
        _ => 1,
    }
}

impl std::ops::Add for UsageSnapshot {
    type Output = UsageSnapshot;
    fn add(self, o: UsageSnapshot) -> UsageSnapshot {
        UsageSnapshot {
            calls: self.calls + o.calls,
            cache_hits: self.cache_hits + o.cache_hits,
            prompt_tokens: self.prompt_tokens + o.prompt_tokens,
            completion_tokens: self.completion_tokens + o.completion_tokens,
            retries: self.retries + o.retries,
            failures: self.failures + o.failures,
        }
    }
}

/// A backend whose every call is counted in a [`UsageMeter`]. Put it outermost (above the
/// cache) so that cache hits are counted as such.
pub struct MeteredBackend<B: ?Sized> {
    inner: Arc<B>,
    meter: Arc<UsageMeter>,
}

impl<B: ChatBackend + ?Sized> MeteredBackend<B> {
    pub fn new(inner: Arc<B>, meter: Arc<UsageMeter>) -> Self {
        Self { inner, meter }
    }
    pub fn meter(&self) -> &Arc<UsageMeter> {
        &self.meter
    }
}

#[async_trait]
impl<B: ChatBackend + ?Sized> ChatBackend for MeteredBackend<B> {
    fn id(&self) -> &BackendId {
        self.inner.id()
    }

    async fn chat(&self, req: &ChatRequest) -> Result<ChatResponse, LlmError> {
        match self.inner.chat(req).await {
            Ok(resp) => {
                self.meter.record(&resp);
                Ok(resp)
            }
            Err(e) => {
                self.meter.record_failure(&e);
                Err(e)
            }
        }
    }

    async fn option_probs(
        &self,
        messages: &[ChatMessage],
        prefix: &str,
        options: &[String],
    ) -> Result<OptionProbs, LlmError> {
        match self.inner.option_probs(messages, prefix, options).await {
            Ok(p) => {
                self.meter.record_probe(&p);
                Ok(p)
            }
            Err(e) => {
                self.meter.record_failure(&e);
                Err(e)
            }
        }
    }
}
