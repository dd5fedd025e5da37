//! Any OpenAI-compatible chat endpoint (OpenAI, vLLM, Ollama, llama.cpp server, ...) through
//! `async-openai`, with exactly one retry loop: ours.
//!
//! `async-openai`'s default executor retries silently; here it is replaced (via
//! `Client::with_http_service`) by [`RecordingService`], a thin tower service over
//! `ReqwestService` that never retries but records the HTTP status and `Retry-After` of the
//! response, sets (or strips) the `Authorization` header itself, and tolerates the small
//! deviations of compatible servers (unknown `finish_reason`, missing `id`/`created`/`role`).
//! [`OpenAiBackend::chat`] then retries 429, 5xx, timeouts, connection errors, malformed bodies
//! and empty replies with capped, jittered exponential backoff that honours `Retry-After`.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_openai::config::OpenAIConfig;
use async_openai::error::OpenAIError;
use async_openai::middleware::{HttpRequestFactory, ReqwestService};
use async_openai::types::chat::{
    ChatCompletionRequestAssistantMessage, ChatCompletionRequestDeveloperMessage,
    ChatCompletionRequestMessage, ChatCompletionRequestSystemMessage,
    ChatCompletionRequestUserMessage, CreateChatCompletionRequest, CreateChatCompletionResponse,
    FinishReason as OaFinishReason, ResponseFormat, StopConfiguration,
};
use async_openai::Client;
use async_trait::async_trait;
use rand::Rng;
use reqwest::header::{HeaderValue, AUTHORIZATION, RETRY_AFTER};
use serde_json::Value;
use tokio::sync::Semaphore;

use super::spec::redact_credentials;
use super::{
    BackendId, ChatBackend, ChatRequest, ChatResponse, Choice, EndpointOptions, FinishReason,
    LlmError, TokenUsage,
};

/// Base URL used when neither the spec nor `OPENAI_BASE_URL` gives one.
pub const DEFAULT_BASE_URL: &str = "https://api.openai.com/v1";
/// Environment variable consulted for the base URL when the spec has none.
pub const BASE_URL_ENV: &str = "OPENAI_BASE_URL";

/// Longest server message kept in an error.
const MAX_MESSAGE_CHARS: usize = 300;

/// The API key, never printed.
#[derive(Clone)]
struct ApiKey(String);

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey([redacted])")
    }
}

/// A chat backend for one model on one OpenAI-compatible endpoint.
pub struct OpenAiBackend {
    id: BackendId,
    opts: EndpointOptions,
    timeout: Duration,
    key: Option<ApiKey>,
    auth: Option<HeaderValue>,
    /// Carries no key: authorization is set by [`RecordingService`].
    client: Client<OpenAIConfig>,
    http: ReqwestService,
    limit: Arc<Semaphore>,
}

impl std::fmt::Debug for OpenAiBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenAiBackend")
            .field("id", &self.id)
            .field("opts", &self.opts)
            .field("api_key", &self.key.as_ref().map(|_| "[redacted]"))
            .finish_non_exhaustive()
    }
}

/// The base URL a spec resolves to: the given one, else `OPENAI_BASE_URL`, else the OpenAI API
/// (trailing slashes removed).
pub fn resolve_base_url(base_url: Option<&str>) -> String {
    let raw = match base_url {
        Some(b) if !b.trim().is_empty() => b.trim().to_string(),
        _ => std::env::var(BASE_URL_ENV)
            .ok()
            .filter(|s| !s.trim().is_empty())
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|| DEFAULT_BASE_URL.to_string()),
    };
    raw.trim_end_matches('/').to_string()
}

/// One semaphore per base URL for the whole process; the first registration sets its size.
fn endpoint_limit(base_url: &str, max_concurrency: usize) -> Arc<Semaphore> {
    static REGISTRY: OnceLock<Mutex<HashMap<String, Arc<Semaphore>>>> = OnceLock::new();
    let mut map = REGISTRY
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    map.entry(base_url.to_string())
        .or_insert_with(|| Arc::new(Semaphore::new(max_concurrency.min(Semaphore::MAX_PERMITS))))
        .clone()
}

fn seconds(name: &str, v: f64, range: crate::check::Range) -> Result<Duration, LlmError> {
    let checked = range
        .check(&format!("endpoint option `{name}`"), v)
        .map_err(LlmError::InvalidRequest)?;
    Duration::try_from_secs_f64(checked)
        .map_err(|e| LlmError::InvalidRequest(format!("endpoint option `{name}` {v:?}: {e}")))
}

/// A header value from the environment, if set and valid as a header (async-openai panics on
/// invalid ones).
fn env_header(name: &str) -> String {
    std::env::var(name)
        .ok()
        .filter(|v| !v.is_empty() && HeaderValue::from_str(v).is_ok())
        .unwrap_or_default()
}

impl OpenAiBackend {
    /// A backend for `model` at `base_url` (see [`resolve_base_url`]). The API key is read now
    /// from the environment variable named by `opts.api_key_env`; unset or empty sends none.
    pub fn new(
        model: &str,
        base_url: Option<&str>,
        opts: &EndpointOptions,
    ) -> Result<Arc<Self>, LlmError> {
        if model.trim().is_empty() {
            return Err(LlmError::InvalidRequest("empty model name".into()));
        }
        let base = resolve_base_url(base_url);
        // Identity, logs and errors carry the URL without its credentials; only the HTTP
        // client gets them.
        let shown = redact_credentials(&base);
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(LlmError::InvalidRequest(format!(
                "base URL `{shown}` must start with http:// or https://"
            )));
        }
        if opts.max_concurrency == 0 {
            return Err(LlmError::InvalidRequest(
                "endpoint option `max_concurrency` must be at least 1".into(),
            ));
        }
        let timeout = seconds("timeout_s", opts.timeout_s, EndpointOptions::TIMEOUT_S)?;
        seconds(
            "backoff_base_s",
            opts.backoff_base_s,
            EndpointOptions::BACKOFF_S,
        )?;
        seconds(
            "backoff_max_s",
            opts.backoff_max_s,
            EndpointOptions::BACKOFF_S,
        )?;

        let key = if opts.api_key_env.is_empty() {
            None
        } else {
            std::env::var(&opts.api_key_env)
                .ok()
                .filter(|k| !k.trim().is_empty())
                .map(|k| ApiKey(k.trim().to_string()))
        };
        let auth = match &key {
            Some(k) => {
                let mut v = HeaderValue::from_str(&format!("Bearer {}", k.0)).map_err(|_| {
                    LlmError::InvalidRequest(format!(
                        "the API key in ${} contains characters not allowed in an HTTP header",
                        opts.api_key_env
                    ))
                })?;
                v.set_sensitive(true);
                Some(v)
            }
            None => None,
        };

        let http_client = reqwest::Client::builder()
            .connect_timeout(timeout)
            .build()
            .map_err(|e| LlmError::Connection {
                endpoint: shown.clone(),
                attempts: 0,
                message: redact_credentials(&format!("cannot build the HTTP client: {e}")),
            })?;
        let config = OpenAIConfig::new()
            .with_api_base(base.clone())
            .with_api_key("")
            .with_org_id(env_header("OPENAI_ORG_ID"))
            .with_project_id(env_header("OPENAI_PROJECT_ID"));
        let client = Client::build(http_client.clone(), config);

        Ok(Arc::new(Self {
            id: BackendId {
                kind: "openai".into(),
                model: model.to_string(),
                endpoint: shown,
            },
            opts: opts.clone(),
            timeout,
            key,
            auth,
            client,
            http: ReqwestService::new(http_client),
            limit: endpoint_limit(&base, opts.max_concurrency),
        }))
    }

    pub fn base_url(&self) -> &str {
        &self.id.endpoint
    }

    pub fn options(&self) -> &EndpointOptions {
        &self.opts
    }

    fn build_request(&self, req: &ChatRequest) -> Result<CreateChatCompletionRequest, LlmError> {
        let invalid = LlmError::InvalidRequest;
        let mut messages = Vec::with_capacity(req.messages.len());
        for m in &req.messages {
            let content = m.content.clone();
            let msg: ChatCompletionRequestMessage = match m.role.as_str() {
                "system" => ChatCompletionRequestSystemMessage::from(content).into(),
                "user" => ChatCompletionRequestUserMessage::from(content).into(),
                "assistant" => ChatCompletionRequestAssistantMessage::from(content).into(),
                "developer" => ChatCompletionRequestDeveloperMessage::from(content).into(),
                other => return Err(invalid(format!("unsupported message role `{other}`"))),
            };
            messages.push(msg);
        }
        let n = u8::try_from(req.n)
            .ok()
            .filter(|n| *n <= 128)
            .ok_or_else(|| invalid(format!("`n` = {} exceeds 128", req.n)))?;
        let max_tokens = u32::try_from(req.max_tokens)
            .map_err(|_| invalid(format!("`max_tokens` = {} is too large", req.max_tokens)))?;
        let seed = match req.seed {
            Some(s) => Some(
                i64::try_from(s)
                    .map_err(|_| invalid(format!("`seed` = {s} does not fit in an i64")))?,
            ),
            None => None,
        };
        #[allow(deprecated)]
        let out = CreateChatCompletionRequest {
            messages,
            model: self.id.model.clone(),
            temperature: Some(req.temperature),
            top_p: Some(req.top_p),
            // `max_tokens` rather than `max_completion_tokens`: every compatible server
            // (vLLM, Ollama, llama.cpp, TGI) understands it, and OpenAI still accepts it for
            // non-reasoning models.
            max_tokens: Some(max_tokens),
            n: Some(n),
            stop: (!req.stop.is_empty()).then(|| StopConfiguration::StringArray(req.stop.clone())),
            seed,
            response_format: req.json_mode.then_some(ResponseFormat::JsonObject),
            ..Default::default()
        };
        Ok(out)
    }

    /// Removes the key and URL credentials from a server- or client-provided message and bounds
    /// its length.
    fn scrub(&self, s: &str) -> String {
        let mut s = redact_credentials(s.trim());
        if let Some(k) = &self.key {
            s = s.replace(&k.0, "[redacted]");
        }
        if s.chars().count() > MAX_MESSAGE_CHARS {
            s = s.chars().take(MAX_MESSAGE_CHARS).collect::<String>() + "...";
        }
        s
    }

    fn classify(&self, err: OpenAIError, meta: &AttemptMeta) -> Failure {
        let message = match &err {
            OpenAIError::ApiError(api) => self.scrub(&api.api_error.message),
            OpenAIError::JSONDeserialize(e, content) => {
                self.scrub(&format!("{e}; body: {content}"))
            }
            other => self.scrub(&other.to_string()),
        };
        let status = match &err {
            OpenAIError::ApiError(api) => Some(api.status_code.as_u16()),
            _ => meta.status,
        };
        if let Some(status) = status.filter(|s| !(200..300).contains(s)) {
            return match status {
                429 => Failure::RateLimited(message),
                500..=599 => Failure::Server(status, message),
                _ => Failure::Rejected(status, message),
            };
        }
        match err {
            OpenAIError::Reqwest(e) if e.is_timeout() => Failure::Timeout,
            OpenAIError::Reqwest(e) if e.is_decode() => Failure::Malformed(message),
            OpenAIError::JSONDeserialize(..) => Failure::Malformed(message),
            OpenAIError::InvalidArgument(m) => Failure::Invalid(self.scrub(&m)),
            _ => Failure::Connection(message),
        }
    }

    fn convert(
        &self,
        resp: CreateChatCompletionResponse,
        n: usize,
    ) -> Result<ChatResponse, Failure> {
        let mut raw = resp.choices;
        if raw.len() < n {
            return Err(Failure::Malformed(format!(
                "asked for {n} choices, the server returned {}",
                raw.len()
            )));
        }
        raw.sort_by_key(|c| c.index);
        let mut choices = Vec::with_capacity(n);
        for (index, c) in raw.into_iter().take(n).enumerate() {
            let content = c.message.content.unwrap_or_default();
            if content.trim().is_empty() {
                return Err(Failure::Empty);
            }
            let finish_reason = match c.finish_reason {
                Some(OaFinishReason::Length) => FinishReason::Length,
                _ => FinishReason::Stop,
            };
            choices.push(Choice {
                index,
                content,
                finish_reason,
                token_ids: None,
                logprobs: None,
            });
        }
        let usage = resp
            .usage
            .map(|u| TokenUsage {
                prompt_tokens: u64::from(u.prompt_tokens),
                completion_tokens: u64::from(u.completion_tokens),
                cached_prompt_tokens: u
                    .prompt_tokens_details
                    .and_then(|d| d.cached_tokens)
                    .map_or(0, u64::from),
            })
            .unwrap_or_default();
        let model = if resp.model.is_empty() {
            self.id.model.clone()
        } else {
            resp.model
        };
        Ok(ChatResponse {
            choices,
            usage,
            model,
            retries: 0,
            cached: false,
        })
    }

    /// Wait before retry number `retry` (0-based): `base·2^retry·U(0.5, 1)`, at least
    /// `Retry-After`, at most `backoff_max_s`.
    fn backoff(&self, retry: u32, retry_after: Option<Duration>) -> Duration {
        let jitter: f64 = rand::rng().random_range(0.5..1.0);
        let exp = self.opts.backoff_base_s * 2f64.powi(retry.min(40) as i32) * jitter;
        let wanted = retry_after.map_or(exp, |ra| exp.max(ra.as_secs_f64()));
        let secs = wanted.min(self.opts.backoff_max_s).max(0.0);
        Duration::try_from_secs_f64(secs).unwrap_or(Duration::ZERO)
    }

    fn final_error(&self, failure: Failure, attempts: u32) -> LlmError {
        let endpoint = self.id.endpoint.clone();
        match failure {
            Failure::RateLimited(message) => LlmError::RateLimited {
                endpoint,
                attempts,
                message,
            },
            Failure::Server(status, message) => LlmError::Server {
                endpoint,
                status,
                attempts,
                message,
            },
            Failure::Rejected(status, message) => LlmError::Rejected {
                endpoint,
                status,
                message,
            },
            Failure::Timeout => LlmError::Timeout {
                endpoint,
                timeout_s: self.opts.timeout_s,
                attempts,
            },
            Failure::Malformed(message) => LlmError::MalformedResponse {
                endpoint,
                attempts,
                message,
            },
            Failure::Connection(message) => LlmError::Connection {
                endpoint,
                attempts,
                message,
            },
            Failure::Empty => LlmError::EmptyReply {
                backend: self.id.to_string(),
                attempts,
            },
            Failure::Invalid(m) => LlmError::InvalidRequest(m),
        }
    }
}

/// Why one attempt failed.
#[derive(Debug)]
enum Failure {
    RateLimited(String),
    Server(u16, String),
    Rejected(u16, String),
    Timeout,
    Malformed(String),
    Connection(String),
    Empty,
    Invalid(String),
}

impl Failure {
    fn retryable(&self) -> bool {
        !matches!(self, Failure::Rejected(..) | Failure::Invalid(_))
    }
    fn label(&self) -> String {
        match self {
            Failure::RateLimited(_) => "HTTP 429".into(),
            Failure::Server(s, _) => format!("HTTP {s}"),
            Failure::Rejected(s, _) => format!("HTTP {s}"),
            Failure::Timeout => "timeout".into(),
            Failure::Malformed(_) => "malformed response".into(),
            Failure::Connection(_) => "connection error".into(),
            Failure::Empty => "empty reply".into(),
            Failure::Invalid(_) => "invalid request".into(),
        }
    }
}

#[async_trait]
impl ChatBackend for OpenAiBackend {
    fn id(&self) -> &BackendId {
        &self.id
    }

    async fn chat(&self, req: &ChatRequest) -> Result<ChatResponse, LlmError> {
        req.validate()?;
        let request = self.build_request(req)?;
        let max_retries = self.opts.max_retries;
        let mut retry = 0u32;
        loop {
            let slot = Arc::new(Mutex::new(AttemptMeta::default()));
            let client = self.client.clone().with_http_service(RecordingService {
                inner: self.http.clone(),
                auth: self.auth.clone(),
                key: self.key.clone(),
                slot: slot.clone(),
            });
            let outcome = {
                // The semaphore is never closed; a closed one would only mean "no limit".
                let _permit = self.limit.acquire().await.ok();
                tokio::time::timeout(self.timeout, client.chat().create(request.clone())).await
            };
            let meta = slot.lock().unwrap_or_else(PoisonError::into_inner).clone();
            let failure = match outcome {
                Err(_elapsed) => Failure::Timeout,
                Ok(Ok(resp)) => match self.convert(resp, req.n) {
                    Ok(mut out) => {
                        out.retries = retry;
                        return Ok(out);
                    }
                    Err(f) => f,
                },
                Ok(Err(e)) => self.classify(e, &meta),
            };
            if !failure.retryable() || retry >= max_retries {
                return Err(self.final_error(failure, retry + 1));
            }
            let wait = self.backoff(retry, meta.retry_after);
            tracing::warn!(
                endpoint = %self.id.endpoint,
                model = %self.id.model,
                attempt = retry + 1,
                wait_s = wait.as_secs_f64(),
                "{}; retrying",
                failure.label()
            );
            tokio::time::sleep(wait).await;
            retry += 1;
        }
    }
}

/// What the transport saw of the last response of one attempt.
#[derive(Clone, Debug, Default)]
struct AttemptMeta {
    status: Option<u16>,
    retry_after: Option<Duration>,
}

/// The tower service installed into `async-openai`: one HTTP exchange, no retry. Sets the
/// `Authorization` header (or removes the empty one async-openai adds), records status and
/// `Retry-After`, and passes the body through [`rebuild_response`].
#[derive(Clone)]
struct RecordingService {
    inner: ReqwestService,
    auth: Option<HeaderValue>,
    /// Only to strip it from bodies that echo it (async-openai logs error bodies).
    key: Option<ApiKey>,
    slot: Arc<Mutex<AttemptMeta>>,
}

type HttpFuture = Pin<Box<dyn Future<Output = Result<reqwest::Response, OpenAIError>> + Send>>;

impl tower::Service<HttpRequestFactory> for RecordingService {
    type Response = reqwest::Response;
    type Error = OpenAIError;
    type Future = HttpFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), OpenAIError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, factory: HttpRequestFactory) -> HttpFuture {
        let auth = self.auth.clone();
        let factory = HttpRequestFactory::new(move || {
            let factory = factory.clone();
            let auth = auth.clone();
            async move {
                let mut request = factory.build().await?;
                let headers = request.headers_mut();
                headers.remove(AUTHORIZATION);
                if let Some(a) = auth {
                    headers.insert(AUTHORIZATION, a);
                }
                Ok(request)
            }
        });
        let fut = self.inner.call(factory);
        let slot = self.slot.clone();
        let key = self.key.clone();
        Box::pin(async move {
            let resp = fut.await?;
            let status = resp.status();
            let retry_after = resp
                .headers()
                .get(RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(|s| parse_retry_after(s, SystemTime::now()));
            {
                let mut m = slot.lock().unwrap_or_else(PoisonError::into_inner);
                m.status = Some(status.as_u16());
                m.retry_after = retry_after;
            }
            rebuild_response(resp, key.as_ref()).await
        })
    }
}

/// Reads the body and hands async-openai an equivalent response whose body never contains the
/// API key (a server may echo it, and async-openai logs error bodies) and, for a successful
/// chat completion, has been through [`normalize_completion`]. A body that is not a JSON object
/// with `choices` is left as is (async-openai then reports it as malformed).
async fn rebuild_response(
    resp: reqwest::Response,
    key: Option<&ApiKey>,
) -> Result<reqwest::Response, OpenAIError> {
    let status = resp.status();
    let version = resp.version();
    let headers = resp.headers().clone();
    let mut body = resp.bytes().await.map_err(OpenAIError::Reqwest)?.to_vec();
    if let Some(k) = key {
        let text = String::from_utf8_lossy(&body);
        if text.contains(&k.0) {
            body = text.replace(&k.0, "[redacted]").into_bytes();
        }
    }
    if status.is_success() {
        if let Ok(mut v) = serde_json::from_slice::<Value>(&body) {
            if normalize_completion(&mut v) {
                if let Ok(b) = serde_json::to_vec(&v) {
                    body = b;
                }
            }
        }
    }
    let mut out = axum::http::Response::new(body);
    *out.status_mut() = status;
    *out.version_mut() = version;
    *out.headers_mut() = headers;
    out.headers_mut().remove(reqwest::header::CONTENT_LENGTH);
    out.headers_mut().remove(reqwest::header::CONTENT_ENCODING);
    Ok(reqwest::Response::from(out))
}

/// Fills what strict deserialisation needs but compatible servers sometimes omit, and maps
/// unknown `finish_reason` values to `stop`. Returns false when `v` is not a completion.
fn normalize_completion(v: &mut Value) -> bool {
    let Some(obj) = v.as_object_mut() else {
        return false;
    };
    if !obj.get("choices").is_some_and(Value::is_array) {
        return false;
    }
    let fill =
        |obj: &mut serde_json::Map<String, Value>, key: &str, ok: fn(&Value) -> bool, d: Value| {
            if !obj.get(key).is_some_and(ok) {
                obj.insert(key.to_string(), d);
            }
        };
    fill(obj, "id", Value::is_string, Value::from(""));
    fill(
        obj,
        "object",
        Value::is_string,
        Value::from("chat.completion"),
    );
    fill(obj, "model", Value::is_string, Value::from(""));
    fill(
        obj,
        "created",
        |c| c.as_u64().is_some_and(|c| c <= u64::from(u32::MAX)),
        Value::from(0),
    );
    if let Some(usage) = obj.get_mut("usage") {
        match usage.as_object_mut() {
            Some(u) => {
                let num = |u: &serde_json::Map<String, Value>, k: &str| {
                    u.get(k)
                        .and_then(Value::as_u64)
                        .map_or(0, |x| x.min(u64::from(u32::MAX)))
                };
                let (p, c) = (num(u, "prompt_tokens"), num(u, "completion_tokens"));
                let t = num(u, "total_tokens");
                u.clear();
                u.insert("prompt_tokens".into(), p.into());
                u.insert("completion_tokens".into(), c.into());
                u.insert(
                    "total_tokens".into(),
                    t.max(p + c).min(u64::from(u32::MAX)).into(),
                );
            }
            None => *usage = Value::Null,
        }
    }
    if let Some(choices) = obj.get_mut("choices").and_then(Value::as_array_mut) {
        for (i, choice) in choices.iter_mut().enumerate() {
            let Some(c) = choice.as_object_mut() else {
                continue;
            };
            fill(c, "index", Value::is_u64, Value::from(i));
            let known = [
                "stop",
                "length",
                "tool_calls",
                "content_filter",
                "function_call",
            ];
            match c.get("finish_reason") {
                None | Some(Value::Null) => {}
                Some(Value::String(s)) if known.contains(&s.as_str()) => {}
                Some(_) => {
                    c.insert("finish_reason".into(), Value::from("stop"));
                }
            }
            c.remove("logprobs");
            if let Some(m) = c.get_mut("message").and_then(Value::as_object_mut) {
                let roles = [
                    "developer",
                    "system",
                    "user",
                    "assistant",
                    "tool",
                    "function",
                ];
                if !m
                    .get("role")
                    .and_then(Value::as_str)
                    .is_some_and(|r| roles.contains(&r))
                {
                    m.insert("role".into(), Value::from("assistant"));
                }
            }
        }
    }
    true
}

/// `Retry-After` as delta-seconds (fractions tolerated) or an HTTP-date (IMF-fixdate).
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let v = value.trim();
    if let Ok(secs) = v.parse::<f64>() {
        return (secs.is_finite() && secs >= 0.0)
            .then(|| Duration::try_from_secs_f64(secs).ok())
            .flatten();
    }
    let at = parse_http_date(v)?;
    let now = now.duration_since(UNIX_EPOCH).ok()?.as_secs();
    Some(Duration::from_secs(at.saturating_sub(now)))
}

/// Seconds since the epoch of an IMF-fixdate such as `Sun, 06 Nov 1994 08:49:37 GMT`.
fn parse_http_date(s: &str) -> Option<u64> {
    let rest = s.split_once(',').map_or(s, |(_, r)| r).trim();
    let mut parts = rest.split_whitespace();
    let day: u64 = parts.next()?.parse().ok()?;
    let month = match parts.next()?.to_ascii_lowercase().as_str() {
        "jan" => 1,
        "feb" => 2,
        "mar" => 3,
        "apr" => 4,
        "may" => 5,
        "jun" => 6,
        "jul" => 7,
        "aug" => 8,
        "sep" => 9,
        "oct" => 10,
        "nov" => 11,
        "dec" => 12,
        _ => return None,
    };
    let year: i64 = parts.next()?.parse().ok()?;
    let mut hms = parts.next()?.split(':');
    let (h, m, sec): (u64, u64, u64) = (
        hms.next()?.parse().ok()?,
        hms.next()?.parse().ok()?,
        hms.next()?.parse().ok()?,
    );
    if !(1..=31).contains(&day) || h > 23 || m > 59 || sec > 60 {
        return None;
    }
    // Days from civil (Howard Hinnant's algorithm).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + (h * 3600 + m * 60 + sec) as i64;
    u64::try_from(secs).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_forms() {
        let now = UNIX_EPOCH + Duration::from_secs(784_111_777); // Sun, 06 Nov 1994 08:49:37 GMT
        assert_eq!(parse_retry_after("3", now), Some(Duration::from_secs(3)));
        assert_eq!(
            parse_retry_after(" 0.25 ", now),
            Some(Duration::from_millis(250))
        );
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:49:47 GMT", now),
            Some(Duration::from_secs(10))
        );
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:00:00 GMT", now),
            Some(Duration::ZERO)
        );
        assert_eq!(parse_retry_after("-1", now), None);
        assert_eq!(parse_retry_after("soon", now), None);
    }

    #[test]
    fn normalizes_lenient_servers() {
        let mut v = serde_json::json!({
            "choices": [{"message": {"content": "hi"}, "finish_reason": "eos_token"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2}
        });
        assert!(normalize_completion(&mut v));
        let r: CreateChatCompletionResponse = serde_json::from_value(v).unwrap();
        assert_eq!(r.choices[0].finish_reason, Some(OaFinishReason::Stop));
        assert_eq!(r.usage.map(|u| u.total_tokens), Some(5));
        let mut not = serde_json::json!({"error": "x"});
        assert!(!normalize_completion(&mut not));
    }

    #[test]
    fn key_is_never_in_debug() {
        std::env::set_var("COLLABLLM_UNIT_KEY_DEBUG", "sk-unit-secret-123");
        let opts = EndpointOptions {
            api_key_env: "COLLABLLM_UNIT_KEY_DEBUG".into(),
            ..Default::default()
        };
        let b = OpenAiBackend::new("m", Some("http://127.0.0.1:9/v1/"), &opts).unwrap();
        assert_eq!(b.base_url(), "http://127.0.0.1:9/v1");
        assert!(!format!("{b:?}").contains("sk-unit-secret-123"));
        assert_eq!(b.scrub("echo sk-unit-secret-123"), "echo [redacted]");
    }

    #[tokio::test]
    async fn url_credentials_stay_out_of_identity_and_errors() {
        let opts = EndpointOptions {
            max_retries: 0,
            ..Default::default()
        };
        let b = OpenAiBackend::new("m", Some("http://user:PASS@127.0.0.1:9/v1"), &opts).unwrap();
        assert_eq!(b.id().to_string(), "openai:m@http://***@127.0.0.1:9/v1");
        assert!(!format!("{b:?}").contains("PASS"));
        // Port 9 (discard) refuses the connection: the error names the endpoint, not its password.
        let req = ChatRequest::new(vec![super::super::ChatMessage::user("hi")]);
        let err = b.chat(&req).await.unwrap_err();
        assert!(!err.to_string().contains("PASS"), "{err}");
        assert!(!format!("{err:?}").contains("PASS"), "{err:?}");
    }
}
