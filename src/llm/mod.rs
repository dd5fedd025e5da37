//! Language-model backends: the one interface every role (policy, simulated user, judge) talks
//! through, and its implementations — a local candle engine, any OpenAI-compatible endpoint, and
//! scripted replies for tests — plus the on-disk request cache and per-role usage accounting.

pub mod cache;
pub mod completion;
pub mod local;
pub(crate) mod openai;
pub(crate) mod parse;
pub mod pool;
pub mod roles;
/// A chat backend answering from a closure, for tests (`testing` feature).
#[cfg(any(test, feature = "testing"))]
pub mod scripted;
pub mod spec;
pub mod tokens;
pub mod usage;

use std::sync::Arc;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

pub use crate::engine::{ChatMessage, FinishReason, OptionProbs, TokenLogprob, TopLogprob};
pub use cache::{CachedBackend, RequestCache};
pub use completion::{
    CompletionPrompt, CompletionRequest, CompletionResponse, PromptLogprobs, TokenizeInput,
    Tokenized, TokenizerInfo,
};
pub use openai::OpenAiBackend;
pub use spec::{EndpointOptions, ModelSpec};
pub use usage::{
    add_usage, check_prices, cost_usd, parse_price, with_usage_scope, Price, PricedRole,
    UsageMeter, UsageSnapshot,
};

/// A chat-completion request, independent of the backend that answers it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    pub temperature: f32,
    pub top_p: f32,
    pub max_tokens: usize,
    /// Number of independent samples wanted.
    pub n: usize,
    /// Generation stops before the first occurrence of any of these strings.
    pub stop: Vec<String>,
    /// Sample `i` of a request is drawn with seed `seed + i`, so a sample is reproducible on
    /// its own, whatever `n` it was asked with.
    pub seed: Option<u64>,
    /// Ask the backend for a JSON object (OpenAI `response_format: json_object`).
    pub json_mode: bool,
    /// Refuse, rather than shorten, a request whose prompt leaves fewer than `max_tokens`
    /// tokens of context: a limit the client gave is a promise, a default one only a cap.
    #[serde(default)]
    pub strict_max_tokens: bool,
    /// Return each sampled token's log-probability and this many most likely alternatives
    /// (OpenAI's `logprobs: true` with `top_logprobs`, at most [`MAX_TOP_LOGPROBS`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<usize>,
}

/// The most alternatives per token a request may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Longest stop string a request may give, in bytes: the local engine looks for every stop
/// string in each row's text after every token, so a megabyte-long one would slow the whole
/// batch (real stop strings are a line or a marker).
pub const MAX_STOP_BYTES: usize = 512;

impl ChatRequest {
    pub fn new(messages: Vec<ChatMessage>) -> Self {
        Self {
            messages,
            temperature: 1.0,
            top_p: 1.0,
            max_tokens: 256,
            n: 1,
            stop: Vec::new(),
            seed: None,
            json_mode: false,
            strict_max_tokens: false,
            logprobs: None,
        }
    }
    pub fn temperature(mut self, t: f32) -> Self {
        self.temperature = t;
        self
    }
    pub fn top_p(mut self, p: f32) -> Self {
        self.top_p = p;
        self
    }
    pub fn max_tokens(mut self, m: usize) -> Self {
        self.max_tokens = m;
        self
    }
    pub fn n(mut self, n: usize) -> Self {
        self.n = n;
        self
    }
    pub fn seed(mut self, s: u64) -> Self {
        self.seed = Some(s);
        self
    }
    pub fn stop(mut self, stop: Vec<String>) -> Self {
        self.stop = stop;
        self
    }
    pub fn json_mode(mut self, on: bool) -> Self {
        self.json_mode = on;
        self
    }
    /// Each sampled token's log-probability and `top` alternatives (local engines).
    pub fn logprobs(mut self, top: usize) -> Self {
        self.logprobs = Some(top);
        self
    }

    /// Checks the parameters every backend relies on; called before any work is queued.
    pub fn validate(&self) -> Result<(), LlmError> {
        let bad = |msg: String| Err(LlmError::InvalidRequest(msg));
        if self.messages.is_empty() {
            return bad("`messages` must not be empty".into());
        }
        if self.max_tokens == 0 {
            return bad("`max_tokens` must be at least 1".into());
        }
        self.sampling().validate("top_logprobs")
    }

    /// The settings the reply is sampled with.
    pub fn sampling(&self) -> RequestSampling<'_> {
        RequestSampling {
            temperature: self.temperature,
            top_p: self.top_p,
            max_tokens: self.max_tokens,
            n: self.n,
            stop: &self.stop,
            seed: self.seed,
            logprobs: self.logprobs,
        }
    }
}

/// The settings a generation samples with, shared by chat and raw completions.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RequestSampling<'a> {
    pub temperature: f32,
    pub top_p: f32,
    pub max_tokens: usize,
    pub n: usize,
    pub stop: &'a [String],
    pub seed: Option<u64>,
    pub logprobs: Option<usize>,
}

impl RequestSampling<'_> {
    /// Checks the values (`max_tokens` is the request's own to check); `logprobs_field`
    /// names the field that counts alternatives (`top_logprobs` in chat, `logprobs` in raw
    /// completions).
    pub fn validate(&self, logprobs_field: &str) -> Result<(), LlmError> {
        let bad = |msg: String| Err(LlmError::InvalidRequest(msg));
        if self.n == 0 {
            return bad("`n` must be at least 1".into());
        }
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad(format!(
                "`temperature` must be >= 0, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("`top_p` must be in (0, 1], got {}", self.top_p));
        }
        if let Some(k) = self.logprobs.filter(|&k| k > MAX_TOP_LOGPROBS) {
            return bad(format!(
                "`{logprobs_field}` must be between 0 and {MAX_TOP_LOGPROBS}, got {k}"
            ));
        }
        if let Some(long) = self.stop.iter().find(|s| s.len() > MAX_STOP_BYTES) {
            return bad(format!(
                "a `stop` string may be at most {MAX_STOP_BYTES} bytes, got one of {}",
                long.len()
            ));
        }
        Ok(())
    }

    /// The local engine's parameters for these settings.
    pub fn gen_params(&self) -> crate::engine::GenParams {
        crate::engine::GenParams {
            temperature: self.temperature,
            top_p: self.top_p,
            max_new_tokens: self.max_tokens,
            stop: self.stop.to_vec(),
            seed: self.seed,
            n: self.n,
            eos: crate::engine::EosRule::AfterText,
            logprobs: self.logprobs,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Choice {
    pub index: usize,
    pub content: String,
    pub finish_reason: FinishReason,
    /// The sampled token ids (a local engine's; endpoints give none), the end-of-turn token
    /// included when one was sampled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
    /// With `ChatRequest::logprobs`: each content token's log-probability (local engines).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<Vec<TokenLogprob>>,
}

/// Token counts of one call (summed over its `n` samples for completion tokens, as OpenAI does).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenUsage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Of the prompt tokens, those the backend did not compute again (a local engine's
    /// prefix reuse, an endpoint's `prompt_tokens_details.cached_tokens`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cached_prompt_tokens: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatResponse {
    /// Exactly `n` choices, ordered by sample index.
    pub choices: Vec<Choice>,
    pub usage: TokenUsage,
    /// Model name as reported by the backend.
    pub model: String,
    /// Retries spent on this call (0 when the first attempt succeeded).
    #[serde(default)]
    pub retries: u32,
    /// True when every choice came from the request cache.
    #[serde(default)]
    pub cached: bool,
}

/// What can go wrong when asking a model. Every variant names the backend (endpoint or model
/// file) it came from; none carries an API key.
#[derive(Debug, thiserror::Error)]
pub enum LlmError {
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("{endpoint}: rate limited (HTTP 429) after {attempts} attempts: {message}")]
    RateLimited {
        endpoint: String,
        attempts: u32,
        message: String,
    },
    #[error("{endpoint}: server error (HTTP {status}) after {attempts} attempts: {message}")]
    Server {
        endpoint: String,
        status: u16,
        attempts: u32,
        message: String,
    },
    #[error("{endpoint}: request rejected (HTTP {status}): {message}")]
    Rejected {
        endpoint: String,
        status: u16,
        message: String,
    },
    #[error("{endpoint}: no answer within {timeout_s:.1}s after {attempts} attempts")]
    Timeout {
        endpoint: String,
        timeout_s: f64,
        attempts: u32,
    },
    #[error("{endpoint}: malformed response after {attempts} attempts: {message}")]
    MalformedResponse {
        endpoint: String,
        attempts: u32,
        message: String,
    },
    #[error("{endpoint}: connection failed after {attempts} attempts: {message}")]
    Connection {
        endpoint: String,
        attempts: u32,
        message: String,
    },
    #[error("{backend}: the model returned an empty reply after {attempts} attempts")]
    EmptyReply { backend: String, attempts: u32 },
    #[error("local model {model}: {message}")]
    Local { model: String, message: String },
    /// The prompt, or the prompt plus `max_tokens`, does not fit the model's context; `param`
    /// names the request field to change (`messages` or `max_tokens`).
    /// `message` names the model.
    #[error("{message}")]
    ContextExceeded {
        model: String,
        param: &'static str,
        message: String,
    },
    #[error("scripted backend: {0}")]
    Scripted(String),
    #[error("request cache {path}: {message}")]
    Cache { path: String, message: String },
    #[error("{backend} does not support {what}")]
    Unsupported { backend: String, what: String },
}

impl LlmError {
    /// True for errors that a later identical call might not hit (used by layers above that
    /// decide whether a failed task is worth retrying later).
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            LlmError::RateLimited { .. }
                | LlmError::Server { .. }
                | LlmError::Timeout { .. }
                | LlmError::MalformedResponse { .. }
                | LlmError::Connection { .. }
                | LlmError::EmptyReply { .. }
        )
    }
}

/// Identifies a backend and model for cache keys and logs (never contains secrets).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BackendId {
    /// `local`, `openai`, `scripted`.
    pub kind: String,
    /// Model name or file identity (for local models the file's content hash prefix, so a
    /// retrained checkpoint at the same path never hits stale cache entries).
    pub model: String,
    /// Endpoint base URL for remote backends, empty otherwise; credentials in the URL are
    /// replaced by `***` ([`spec::redact_credentials`]), so cache keys never depend on them:
    /// a changed password keeps the cache, and the cache file never holds the password.
    pub endpoint: String,
}

impl std::fmt::Display for BackendId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.endpoint.is_empty() {
            write!(f, "{}:{}", self.kind, self.model)
        } else {
            write!(f, "{}:{}@{}", self.kind, self.model, self.endpoint)
        }
    }
}

/// How much one request to a backend can hold, for checks made before any work is queued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContextLimits {
    /// Prompt plus completion tokens.
    pub context_tokens: usize,
    /// No token stands for more bytes of text than this, so a prompt of more than
    /// `context_tokens × max_token_bytes` bytes cannot fit, without tokenizing it.
    pub max_token_bytes: usize,
}

impl ContextLimits {
    /// Bytes of prompt text beyond which no tokenization fits the context.
    pub fn max_prompt_bytes(&self) -> usize {
        self.context_tokens.saturating_mul(self.max_token_bytes)
    }
}

/// The interface every role uses to talk to a model.
#[async_trait]
pub trait ChatBackend: Send + Sync {
    fn id(&self) -> &BackendId;

    /// Answers with exactly `req.n` non-empty choices, or a typed error. A caller that stops
    /// waiting (drops the future) cancels the work where the backend can (local models stop
    /// at the next token, or never start).
    async fn chat(&self, req: &ChatRequest) -> Result<ChatResponse, LlmError>;

    /// The context this backend's model has, when it is known locally (remote endpoints
    /// enforce their own).
    fn context_limits(&self) -> Option<ContextLimits> {
        None
    }

    /// [`ChatBackend::chat`] that also sends each choice's text to `sink` as it is
    /// generated. The default sends each whole choice once the answer is complete; local
    /// models send it token by token.
    async fn chat_stream(
        &self,
        req: &ChatRequest,
        sink: &DeltaSink,
    ) -> Result<ChatResponse, LlmError> {
        let resp = self.chat(req).await?;
        for c in &resp.choices {
            sink.send(c.index, &c.content);
        }
        Ok(resp)
    }

    /// Probability distribution over `options` for the token that follows `prefix` appended
    /// to the assistant turn of `messages` (log-probability judging). Only local models can
    /// answer; the default says so.
    async fn option_probs(
        &self,
        _messages: &[ChatMessage],
        _prefix: &str,
        _options: &[String],
    ) -> Result<OptionProbs, LlmError> {
        Err(LlmError::Unsupported {
            backend: self.id().to_string(),
            what: "log-probability scoring".into(),
        })
    }

    /// Continues raw text or token ids with no chat template (`/v1/completions`), sending
    /// each choice's text to `sink` as it is generated when one is given. Only local models
    /// can answer; the default says so.
    async fn complete(
        &self,
        _req: &CompletionRequest,
        _sink: Option<&DeltaSink>,
    ) -> Result<CompletionResponse, LlmError> {
        Err(LlmError::Unsupported {
            backend: self.id().to_string(),
            what: "raw-text completions".into(),
        })
    }

    /// The tokens of `input` as this backend's model reads them (vLLM's `/tokenize`). Only
    /// local models can answer; the default says so.
    async fn tokenize(&self, _input: &TokenizeInput) -> Result<Tokenized, LlmError> {
        Err(LlmError::Unsupported {
            backend: self.id().to_string(),
            what: "tokenizing".into(),
        })
    }

    /// The text of token ids, special tokens written out (vLLM's `/detokenize`). Only local
    /// models can answer; the default says so.
    async fn detokenize(&self, _ids: &[u32]) -> Result<String, LlmError> {
        Err(LlmError::Unsupported {
            backend: self.id().to_string(),
            what: "detokenizing".into(),
        })
    }

    /// The model's tokenizer settings (vLLM's `/tokenizer_info`), when it is local.
    fn tokenizer_info(&self) -> Option<TokenizerInfo> {
        None
    }
}

pub type SharedBackend = Arc<dyn ChatBackend>;

/// Where [`ChatBackend::chat_stream`] sends text as it is generated: (choice index, new
/// text); the pieces of a choice concatenate to its final content.
#[derive(Clone, Debug)]
pub struct DeltaSink(tokio::sync::mpsc::UnboundedSender<Delta>);

/// A piece of one choice's reply: its index, new text, and the log-probabilities of the
/// tokens that text completes (empty unless asked for).
pub type Delta = (usize, String, Vec<TokenLogprob>);

impl DeltaSink {
    pub fn channel() -> (Self, tokio::sync::mpsc::UnboundedReceiver<Delta>) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        (Self(tx), rx)
    }

    /// Sends a piece of choice `index`'s text (nothing for an empty piece, or once the
    /// receiver is gone).
    pub fn send(&self, index: usize, text: &str) {
        self.send_with_logprobs(index, text, &[]);
    }

    /// Sends a piece of text with its tokens' log-probabilities (nothing when both are
    /// empty, or once the receiver is gone).
    pub fn send_with_logprobs(&self, index: usize, text: &str, logprobs: &[TokenLogprob]) {
        if !text.is_empty() || !logprobs.is_empty() {
            let _ = self.0.send((index, text.to_string(), logprobs.to_vec()));
        }
    }
}
