//! OpenAI-compatible HTTP front over any [`ChatBackend`]: `POST /v1/chat/completions`
//! (plain and SSE streaming), `GET /v1/models`, `GET /health`. Single-model server: a request's
//! `model` must be the served id or one of its aliases (else 404 `model_not_found`), and
//! responses report the served id. Errors are OpenAI-shaped JSON
//! (`{"error": {message, type, param, code}}`), for malformed input as well as backend
//! failures; bad input never panics.
//!
//! Limits, all checked before any work is queued: the body size ([`MAX_BODY_BYTES`], 413), a
//! prompt whose bytes alone cannot fit the context (no tokenizing of megabytes), an explicit
//! `max_tokens` that leaves no room for a prompt; the exact token check follows on the model
//! worker. A client that disconnects drops the request's future, and the local backend stops
//! its generation at the next token (or never starts it).

mod response_format;

use std::future::Future;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::HeaderMap;
use axum::http::{Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Serialize;
use serde_json::{json, Map, Value};

pub use response_format::ResponseFormat;

use crate::llm::{
    ChatMessage, ChatRequest, ChatResponse, Choice, ContextLimits, Delta, LlmError, SharedBackend,
    TokenLogprob, MAX_STOP_BYTES, MAX_TOP_LOGPROBS,
};

/// Largest `n` one request may ask for.
pub const MAX_N: usize = 16;
/// Largest number of stop strings one request may give.
pub const MAX_STOP: usize = 16;
/// `max_tokens` when the request gives none.
pub const DEFAULT_MAX_TOKENS: usize = 256;
/// Largest request body accepted (long multi-turn prompts fit easily).
pub const MAX_BODY_BYTES: usize = 16 * 1024 * 1024;
/// OpenAI's range for `temperature`.
pub const MAX_TEMPERATURE: f64 = 2.0;
/// OpenAI's range for `presence_penalty` and `frequency_penalty`: [-2, 2].
pub const MAX_PENALTY: f64 = 2.0;

/// The names a request's `model` may give: the id the server reports first, then aliases.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelNames {
    names: Vec<String>,
}

impl ModelNames {
    pub fn new(id: impl Into<String>) -> Self {
        Self {
            names: vec![id.into()],
        }
    }

    /// Adds names that are accepted as well (duplicates and empty names are dropped).
    pub fn with_aliases(mut self, aliases: impl IntoIterator<Item = impl Into<String>>) -> Self {
        for a in aliases {
            let a = a.into();
            if !a.is_empty() && !self.names.contains(&a) {
                self.names.push(a);
            }
        }
        self
    }

    /// The id responses report.
    pub fn id(&self) -> &str {
        &self.names[0]
    }

    pub fn all(&self) -> &[String] {
        &self.names
    }

    pub fn accepts(&self, name: &str) -> bool {
        self.names.iter().any(|n| n == name)
    }
}

impl From<String> for ModelNames {
    fn from(id: String) -> Self {
        Self::new(id)
    }
}

impl From<&str> for ModelNames {
    fn from(id: &str) -> Self {
        Self::new(id)
    }
}

#[derive(Clone)]
struct AppState {
    backend: SharedBackend,
    names: Arc<ModelNames>,
}

/// The HTTP routes over `backend`, reporting the first of `names` as the model name. Paths are
/// served both under `/v1` and at the root (some clients are configured without the `/v1`
/// prefix).
pub fn router(backend: SharedBackend, names: impl Into<ModelNames>) -> Router {
    let state = AppState {
        backend,
        names: Arc::new(names.into()),
    };
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/chat/completions", post(chat_completions))
        .route("/v1/models", get(list_models))
        .route("/models", get(list_models))
        .route("/health", get(health))
        .route("/v1/health", get(health))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn(access_log))
        .with_state(state)
}

/// An API key no client could send: HTTP header values carry printable ASCII only, so a key
/// with other characters would start a server that refuses every request. The key itself is
/// never part of the message.
#[derive(Debug, thiserror::Error)]
#[error(
    "the API key holds {0}; clients send it in an HTTP header, which carries printable ASCII \
     without spaces only: choose a key of letters, digits and punctuation"
)]
pub struct InvalidApiKey(&'static str);

/// Refuses a key that no `Authorization` header can carry (see [`InvalidApiKey`]).
pub fn check_api_key(key: &str) -> Result<(), InvalidApiKey> {
    if key.is_empty() {
        return Err(InvalidApiKey("nothing"));
    }
    if !key.is_ascii() {
        return Err(InvalidApiKey("non-ASCII characters"));
    }
    if !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(InvalidApiKey("spaces or control characters"));
    }
    Ok(())
}

/// `router` answering only requests that carry `Authorization: Bearer <key>` (OpenAI
/// clients send their API key so; the scheme's case does not matter, RFC 7235); `/health`
/// stays open for load balancers and probes. A refused request is logged (method, path,
/// status; never the header), so guessing shows in the log.
pub fn require_api_key(router: Router, key: String) -> Result<Router, InvalidApiKey> {
    check_api_key(&key)?;
    let key: Arc<str> = key.into();
    Ok(
        router.layer(middleware::from_fn(move |req: Request, next: Next| {
            let key = key.clone();
            async move {
                let path = req.uri().path();
                if path == "/health" || path == "/v1/health" || bearer_matches(&req, &key) {
                    return next.run(req).await;
                }
                tracing::warn!(
                    method = %req.method(),
                    path,
                    status = 401,
                    "request rejected: missing or wrong API key"
                );
                ApiError {
                    status: StatusCode::UNAUTHORIZED,
                    message: "missing or wrong API key: send `Authorization: Bearer <key>`".into(),
                    kind: "invalid_request_error",
                    param: None,
                    code: Some("invalid_api_key"),
                }
                .into_response()
            }
        })),
    )
}

/// Whether the request's bearer token is `key`, compared in time independent of where the
/// two first differ.
fn bearer_matches(req: &Request, key: &str) -> bool {
    let Some(token) = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim_start_matches(' '))
    else {
        return false;
    };
    token.len() == key.len()
        && token
            .bytes()
            .zip(key.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

/// Serves `router` (from [`router`], perhaps behind [`require_api_key`]) until ctrl-c or
/// SIGTERM, then finishes the requests in flight.
pub async fn serve_router(
    listener: tokio::net::TcpListener,
    router: Router,
) -> std::io::Result<()> {
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown_signal())
        .await
}

/// Serves until ctrl-c (or SIGTERM on unix), then finishes the requests in flight.
pub async fn serve(
    listener: tokio::net::TcpListener,
    backend: SharedBackend,
    names: impl Into<ModelNames>,
) -> std::io::Result<()> {
    serve_with_shutdown(listener, backend, names, shutdown_signal()).await
}

/// Serves until `shutdown` resolves, then finishes the requests in flight. Tests use this with
/// a channel (or a never-ending future) so that no process-wide signal handler is installed.
pub async fn serve_with_shutdown(
    listener: tokio::net::TcpListener,
    backend: SharedBackend,
    names: impl Into<ModelNames>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(backend, names))
        .with_graceful_shutdown(shutdown)
        .await
}

async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            // No signal handling available: serve until killed.
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
    tracing::info!("shutting down: finishing requests in flight");
}

// ---------------------------------------------------------------------------------------------
// Errors

/// An OpenAI-shaped error response.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    param: Option<String>,
    code: Option<&'static str>,
}

impl ApiError {
    fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: None,
        }
    }

    fn from_llm(e: &LlmError) -> Self {
        let message = e.to_string();
        let (status, kind, code) = match e {
            LlmError::InvalidRequest(msg) => {
                let mut err = Self::invalid(message, backticked(msg).as_deref());
                err.code = Some("invalid_value");
                return err;
            }
            LlmError::ContextExceeded { param, .. } => {
                return Self::context_exceeded(message, param);
            }
            LlmError::Unsupported { .. } => (
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                Some("unsupported"),
            ),
            LlmError::RateLimited { .. } => (
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                Some("rate_limit_exceeded"),
            ),
            LlmError::Timeout { .. } | LlmError::Connection { .. } | LlmError::Server { .. } => (
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                Some("service_unavailable"),
            ),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", None),
        };
        Self {
            status,
            message,
            kind,
            param: None,
            code,
        }
    }

    fn context_exceeded(message: String, param: &str) -> Self {
        let mut err = Self::invalid(message, Some(param));
        err.code = Some("context_length_exceeded");
        err
    }

    fn from_format(e: response_format::FormatError) -> Self {
        let mut err = Self::invalid(e.message, Some(&e.param));
        err.code = Some(if e.unsupported {
            "unsupported_parameter"
        } else {
            "invalid_value"
        });
        err
    }

    /// A reply that does not satisfy `response_format`: the model's failure, not the client's.
    fn format_not_met(index: usize, format: &ResponseFormat, why: &str) -> Self {
        let wanted = match format {
            ResponseFormat::JsonSchema { name, .. } => format!("json_schema `{name}`"),
            _ => "json_object".into(),
        };
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: format!(
                "choice {index} does not satisfy response_format {wanted}: {why} (this server \
                 checks the finished reply; it does not constrain decoding)"
            ),
            kind: "server_error",
            param: Some("response_format".into()),
            code: Some("response_format_not_met"),
        }
    }

    fn model_not_found(name: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{name}` does not exist or you do not have access to it."),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }

    pub fn status(&self) -> StatusCode {
        self.status
    }
}

/// The first `name` quoted in backticks in a validation message (our messages name the
/// offending parameter that way).
fn backticked(msg: &str) -> Option<String> {
    let start = msg.find('`')? + 1;
    let len = msg[start..].find('`')?;
    Some(msg[start..start + len].to_string())
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        });
        let mut resp = (self.status, Json(body)).into_response();
        resp.extensions_mut().insert(ErrorNote(self.message));
        resp
    }
}

async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!("no route for {method} {}", uri.path()),
        kind: "invalid_request_error",
        param: None,
        code: Some("not_found"),
    }
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        message: format!("method {method} is not allowed on {}", uri.path()),
        kind: "invalid_request_error",
        param: None,
        code: Some("method_not_allowed"),
    }
}

// ---------------------------------------------------------------------------------------------
// Simple routes

async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

/// Every accepted name, the reported id first (clients that take the first entry get it).
async fn list_models(State(state): State<AppState>) -> Json<Value> {
    let created = unix_now();
    let data: Vec<Value> = state
        .names
        .all()
        .iter()
        .map(|name| {
            json!({
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "collabllm",
            })
        })
        .collect();
    Json(json!({"object": "list", "data": data}))
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn completion_id() -> String {
    format!(
        "chatcmpl-{:016x}{:08x}",
        rand::random::<u64>(),
        rand::random::<u32>()
    )
}

// ---------------------------------------------------------------------------------------------
// Request parsing

/// A parsed chat-completion request: what the backend needs plus the transport options.
#[derive(Clone, Debug, PartialEq)]
pub struct ParsedRequest {
    pub request: ChatRequest,
    /// The `model` the client named, if any.
    pub model: Option<String>,
    pub stream: bool,
    /// `stream_options.include_usage`: a last chunk with empty choices carries the usage.
    pub include_usage: bool,
    /// What the reply must be; checked on the finished output.
    pub response_format: ResponseFormat,
}

/// Parses an OpenAI chat-completion request body. Fields this server does not know are
/// ignored, as OpenAI does; known fields of the wrong type or with invalid values are a 400
/// naming the field, and known fields the server cannot honour (penalties, logit bias,
/// tools) are refused rather than silently ignored.
pub fn parse_request(body: &[u8]) -> Result<ParsedRequest, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("the request body is not valid JSON: {e}"), None))?;
    let Value::Object(obj) = value else {
        return Err(ApiError::invalid(
            "the request body must be a JSON object",
            None,
        ));
    };
    let field = |name: &str| obj.get(name).filter(|v| !v.is_null());

    let model = match field("model") {
        Some(Value::String(m)) => Some(m.clone()),
        Some(_) => return Err(type_error("model", "a string")),
        None => None,
    };
    let messages = parse_messages(field("messages").ok_or_else(|| {
        ApiError::invalid("missing required parameter: `messages`", Some("messages"))
    })?)?;
    let mut req = ChatRequest::new(messages);
    if let Some(v) = field("temperature") {
        req.temperature = number_in(v, "temperature", 0.0, MAX_TEMPERATURE)? as f32;
    }
    if let Some(v) = field("top_p") {
        let p = number_in(v, "top_p", 0.0, 1.0)?;
        if p == 0.0 {
            return Err(out_of_range("top_p", "in (0, 1]", v));
        }
        req.top_p = p as f32;
    }
    // `max_completion_tokens` is the current name; `max_tokens` the deprecated one. A limit
    // the client gives must fit beside the prompt; the default is only a cap.
    let max_tokens = match (field("max_completion_tokens"), field("max_tokens")) {
        (Some(v), _) => Some(("max_completion_tokens", v)),
        (None, Some(v)) => Some(("max_tokens", v)),
        (None, None) => None,
    };
    if let Some((name, v)) = max_tokens {
        req.max_tokens = uint(v, name)?;
        if req.max_tokens == 0 {
            return Err(out_of_range(name, "at least 1", v));
        }
        req.strict_max_tokens = true;
    }
    if let Some(v) = field("n") {
        req.n = uint(v, "n")?;
        if !(1..=MAX_N).contains(&req.n) {
            return Err(out_of_range("n", &format!("between 1 and {MAX_N}"), v));
        }
    }
    if let Some(v) = field("stop") {
        req.stop = parse_stop(v)?;
    }
    if let Some(v) = field("seed") {
        // OpenAI takes any 64-bit integer; a negative seed keeps its bits.
        req.seed = Some(
            v.as_u64()
                .or_else(|| v.as_i64().map(|s| s as u64))
                .ok_or_else(|| type_error("seed", "an integer of at most 64 bits"))?,
        );
    }
    let response_format = match field("response_format") {
        Some(v) => ResponseFormat::parse(v).map_err(ApiError::from_format)?,
        None => ResponseFormat::Text,
    };
    req.json_mode = response_format.wants_json();
    let stream = match field("stream") {
        Some(v) => v
            .as_bool()
            .ok_or_else(|| type_error("stream", "a boolean"))?,
        None => false,
    };
    let include_usage = match field("stream_options") {
        Some(Value::Object(o)) => match o.get("include_usage").filter(|v| !v.is_null()) {
            Some(v) => v
                .as_bool()
                .ok_or_else(|| type_error("stream_options.include_usage", "a boolean"))?,
            None => false,
        },
        Some(_) => return Err(type_error("stream_options", "an object")),
        None => false,
    };
    req.logprobs = parse_logprobs(&field)?;
    refuse_unhonoured(&field)?;
    req.validate().map_err(|e| ApiError::from_llm(&e))?;
    Ok(ParsedRequest {
        request: req,
        model,
        stream,
        include_usage,
        response_format,
    })
}

/// `logprobs` (a boolean) and `top_logprobs` (0 to 20; above 0 only with `logprobs: true`,
/// as OpenAI requires): the number of alternatives per token, `None` when not asked.
fn parse_logprobs<'a>(
    field: &impl Fn(&str) -> Option<&'a Value>,
) -> Result<Option<usize>, ApiError> {
    let on = match field("logprobs") {
        Some(v) => v
            .as_bool()
            .ok_or_else(|| type_error("logprobs", "a boolean"))?,
        None => false,
    };
    let top = match field("top_logprobs") {
        Some(v) => {
            let k = uint(v, "top_logprobs")?;
            if k > MAX_TOP_LOGPROBS {
                return Err(out_of_range(
                    "top_logprobs",
                    &format!("between 0 and {MAX_TOP_LOGPROBS}"),
                    v,
                ));
            }
            if k > 0 && !on {
                return Err(ApiError::invalid(
                    "`top_logprobs` needs `logprobs: true`",
                    Some("top_logprobs"),
                ));
            }
            k
        }
        None => 0,
    };
    Ok(on.then_some(top))
}

/// The OpenAI `logprobs` object of a choice: `null` unless asked for.
fn logprobs_json(asked: bool, choice: &Choice) -> Value {
    match (asked, &choice.logprobs) {
        (true, Some(list)) => logprobs_object(list),
        _ => Value::Null,
    }
}

/// `{"content": [...], "refusal": null}` of these tokens.
fn logprobs_object(list: &[TokenLogprob]) -> Value {
    let entry = |token: &str, bytes: &[u8], logprob: f32| json!({"token": token, "logprob": logprob, "bytes": bytes});
    json!({
        "content": list
            .iter()
            .map(|t| {
                let mut e = entry(&t.token, &t.bytes, t.logprob);
                e["top_logprobs"] = Value::Array(
                    t.top
                        .iter()
                        .map(|a| entry(&a.token, &a.bytes, a.logprob))
                        .collect(),
                );
                e
            })
            .collect::<Vec<_>>(),
        "refusal": null,
    })
}

/// Known fields whose silent omission would mislead the client: validated, and refused unless
/// they ask for nothing (0, false, empty).
fn refuse_unhonoured<'a>(field: &impl Fn(&str) -> Option<&'a Value>) -> Result<(), ApiError> {
    for name in ["presence_penalty", "frequency_penalty"] {
        if let Some(v) = field(name) {
            if number_in(v, name, -MAX_PENALTY, MAX_PENALTY)? != 0.0 {
                return Err(unsupported(
                    name,
                    &format!("`{name}` is not supported by this server (only 0)"),
                ));
            }
        }
    }
    if let Some(v) = field("logit_bias") {
        let biases = v
            .as_object()
            .ok_or_else(|| type_error("logit_bias", "an object"))?;
        if !biases.is_empty() {
            return Err(unsupported(
                "logit_bias",
                "`logit_bias` is not supported by this server",
            ));
        }
    }
    if field("tools")
        .and_then(Value::as_array)
        .is_some_and(|t| !t.is_empty())
    {
        return Err(unsupported(
            "tools",
            "tool calling is not supported by this server",
        ));
    }
    Ok(())
}

fn type_error(param: &str, expected: &str) -> ApiError {
    let mut e = ApiError::invalid(format!("`{param}` must be {expected}"), Some(param));
    e.code = Some("invalid_type");
    e
}

fn out_of_range(param: &str, range: &str, got: &Value) -> ApiError {
    let mut e = ApiError::invalid(format!("`{param}` must be {range}, got {got}"), Some(param));
    e.code = Some("invalid_value");
    e
}

fn unsupported(param: &str, message: &str) -> ApiError {
    let mut e = ApiError::invalid(message, Some(param));
    e.code = Some("unsupported_parameter");
    e
}

/// A JSON number in `[lo, hi]` (JSON has no NaN or infinity, and serde_json refuses numbers
/// beyond f64, so a finite range check is all that is left).
fn number_in(v: &Value, param: &str, lo: f64, hi: f64) -> Result<f64, ApiError> {
    let x = v.as_f64().ok_or_else(|| type_error(param, "a number"))?;
    if !(x.is_finite() && (lo..=hi).contains(&x)) {
        return Err(out_of_range(param, &format!("between {lo} and {hi}"), v));
    }
    Ok(x)
}

fn uint(v: &Value, param: &str) -> Result<usize, ApiError> {
    if let Some(x) = v.as_u64() {
        return Ok(usize::try_from(x).unwrap_or(usize::MAX));
    }
    if v.as_i64().is_some() {
        return Err(ApiError::invalid(
            format!("`{param}` must not be negative, got {v}"),
            Some(param),
        ));
    }
    Err(type_error(param, "a non-negative integer"))
}

fn parse_stop(v: &Value) -> Result<Vec<String>, ApiError> {
    let stops: Vec<String> = match v {
        Value::String(s) => vec![s.clone()],
        Value::Array(items) => items
            .iter()
            .map(|s| s.as_str().map(str::to_string))
            .collect::<Option<_>>()
            .ok_or_else(|| type_error("stop", "a string or an array of strings"))?,
        _ => return Err(type_error("stop", "a string or an array of strings")),
    };
    if stops.len() > MAX_STOP {
        return Err(ApiError::invalid(
            format!(
                "`stop` may hold at most {MAX_STOP} strings, got {}",
                stops.len()
            ),
            Some("stop"),
        ));
    }
    if let Some(long) = stops.iter().find(|s| s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::invalid(
            format!(
                "a `stop` string may be at most {MAX_STOP_BYTES} bytes, got one of {}",
                long.len()
            ),
            Some("stop"),
        ));
    }
    // An empty stop string would cut every reply to nothing.
    Ok(stops.into_iter().filter(|s| !s.is_empty()).collect())
}

/// Refuses, without tokenizing, a request that cannot fit the backend's context: message text
/// longer than any tokenization of the context could cover, or an explicit `max_tokens` that
/// leaves no token for the prompt. The exact check (prompt tokens + `max_tokens`) follows on
/// the model worker.
fn check_context(parsed: &ParsedRequest, limits: ContextLimits) -> Result<(), ApiError> {
    let req = &parsed.request;
    let bytes: usize = req.messages.iter().map(|m| m.content.len()).sum();
    let max_bytes = limits.max_prompt_bytes();
    if bytes > max_bytes {
        return Err(ApiError::context_exceeded(
            format!(
                "`messages` hold {bytes} bytes of text; this model's context of {} tokens \
                 cannot hold more than {max_bytes} bytes (no token covers more than {} bytes)",
                limits.context_tokens, limits.max_token_bytes
            ),
            "messages",
        ));
    }
    if req.strict_max_tokens && req.max_tokens >= limits.context_tokens {
        return Err(ApiError::context_exceeded(
            format!(
                "`max_tokens` = {} leaves no room for the prompt in this model's context of {} \
                 tokens",
                req.max_tokens, limits.context_tokens
            ),
            "max_tokens",
        ));
    }
    Ok(())
}

fn parse_messages(v: &Value) -> Result<Vec<ChatMessage>, ApiError> {
    let items = v
        .as_array()
        .ok_or_else(|| type_error("messages", "an array of messages"))?;
    if items.is_empty() {
        return Err(ApiError::invalid(
            "`messages` must not be empty",
            Some("messages"),
        ));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, m)| parse_message(i, m))
        .collect()
}

fn parse_message(i: usize, v: &Value) -> Result<ChatMessage, ApiError> {
    let param = |name: &str| format!("messages[{i}].{name}");
    let obj: &Map<String, Value> = v
        .as_object()
        .ok_or_else(|| type_error(&format!("messages[{i}]"), "an object"))?;
    let role = obj
        .get("role")
        .ok_or_else(|| {
            ApiError::invalid(
                format!("missing required parameter: `{}`", param("role")),
                Some(&param("role")),
            )
        })?
        .as_str()
        .ok_or_else(|| type_error(&param("role"), "a string"))?;
    let role = match role {
        "system" | "user" | "assistant" => role,
        // OpenAI's newer name for system instructions.
        "developer" => "system",
        "tool" | "function" => {
            return Err(unsupported(
                &param("role"),
                &format!("role `{role}` is not supported by this server (no tool calling)"),
            ))
        }
        other => {
            return Err(ApiError::invalid(
                format!(
                "`{}` has unknown role `{other}` (expected system, developer, user or assistant)",
                param("role")
            ),
                Some(&param("role")),
            ))
        }
    };
    let content = match obj.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                let p = format!("messages[{i}].content[{j}]");
                match part.get("type").and_then(Value::as_str) {
                    Some("text") => match part.get("text").and_then(Value::as_str) {
                        Some(t) => text.push_str(t),
                        None => return Err(type_error(&format!("{p}.text"), "a string")),
                    },
                    Some(other) => {
                        return Err(unsupported(
                            &p,
                            &format!("content part type `{other}` is not supported (text only)"),
                        ))
                    }
                    None => return Err(type_error(&p, "an object with a string `type`")),
                }
            }
            text
        }
        // An assistant turn may carry no content (OpenAI allows it alongside tool calls).
        Some(Value::Null) | None if role == "assistant" => String::new(),
        None => {
            return Err(ApiError::invalid(
                format!("missing required parameter: `{}`", param("content")),
                Some(&param("content")),
            ))
        }
        Some(_) => {
            return Err(type_error(
                &param("content"),
                "a string or an array of content parts",
            ))
        }
    };
    Ok(ChatMessage::new(role, content))
}

// ---------------------------------------------------------------------------------------------
// Responses

#[derive(Serialize)]
struct Usage {
    prompt_tokens: u64,
    completion_tokens: u64,
    total_tokens: u64,
    prompt_tokens_details: PromptTokensDetails,
}

/// OpenAI's breakdown of the prompt: how much of it came from the prompt cache.
#[derive(Serialize)]
struct PromptTokensDetails {
    cached_tokens: u64,
}

impl Usage {
    fn of(resp: &ChatResponse) -> Self {
        Self {
            prompt_tokens: resp.usage.prompt_tokens,
            completion_tokens: resp.usage.completion_tokens,
            total_tokens: resp.usage.prompt_tokens + resp.usage.completion_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: resp.usage.cached_prompt_tokens,
            },
        }
    }
}

#[derive(Serialize)]
struct Completion<'a> {
    id: String,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<Value>,
    usage: Usage,
    system_fingerprint: Option<String>,
}

#[derive(Serialize)]
struct Chunk<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
    system_fingerprint: Option<String>,
}

/// Refuses a request body not declared as JSON: a browser page may POST `text/plain` or a
/// form to any local address without a CORS preflight, but never `application/json`.
fn require_json(headers: &HeaderMap) -> Result<(), ApiError> {
    let declared = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let media = declared.split(';').next().unwrap_or("").trim();
    if media.eq_ignore_ascii_case("application/json") {
        return Ok(());
    }
    Err(ApiError {
        status: StatusCode::UNSUPPORTED_MEDIA_TYPE,
        message: format!(
            "the request body must be declared `Content-Type: application/json` (got {})",
            if declared.is_empty() {
                "none".to_string()
            } else {
                format!("`{declared}`")
            }
        ),
        kind: "invalid_request_error",
        param: None,
        code: None,
    })
}

async fn chat_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    require_json(&headers)?;
    let body = body.map_err(|rejection| ApiError {
        status: rejection.status(),
        message: rejection.body_text(),
        kind: "invalid_request_error",
        param: None,
        code: None,
    })?;
    let parsed = parse_request(&body)?;
    if let Some(name) = parsed.model.as_deref() {
        if !state.names.accepts(name) {
            return Err(ApiError::model_not_found(name));
        }
    }
    if let Some(limits) = state.backend.context_limits() {
        check_context(&parsed, limits)?;
    }
    if parsed.stream && !parsed.response_format.wants_json() {
        return live_stream(&state, &parsed).await;
    }
    // Dropping this future (the client disconnected) cancels the generation.
    let mut resp = state
        .backend
        .chat(&parsed.request)
        .await
        .map_err(|e| ApiError::from_llm(&e))?;
    if parsed.response_format.wants_json() {
        check_format(&parsed.response_format, &mut resp.choices).await?;
    }
    let stats = ChatStats {
        n: parsed.request.n,
        stream: parsed.stream,
        prompt_tokens: resp.usage.prompt_tokens,
        completion_tokens: resp.usage.completion_tokens,
    };
    let id = completion_id();
    let created = unix_now();
    let mut response = if parsed.stream {
        stream_response(
            &id,
            created,
            state.names.id(),
            &resp,
            parsed.include_usage,
            parsed.request.logprobs.is_some(),
        )
    } else {
        let choices = resp
            .choices
            .iter()
            .enumerate()
            .map(|(i, c)| {
                json!({
                    "index": i,
                    "message": {"role": "assistant", "content": c.content, "refusal": null},
                    "finish_reason": c.finish_reason.as_str(),
                    "logprobs": logprobs_json(parsed.request.logprobs.is_some(), c),
                })
            })
            .collect();
        Json(Completion {
            id,
            object: "chat.completion",
            created,
            model: state.names.id(),
            choices,
            usage: Usage::of(&resp),
            system_fingerprint: None,
        })
        .into_response()
    };
    response.extensions_mut().insert(stats);
    Ok(response)
}

/// Checks every choice against `response_format` off the async workers (a check may take up
/// to its time budget; `/health` and other requests keep answering meanwhile), replacing each
/// content with the checked JSON.
async fn check_format(format: &ResponseFormat, choices: &mut [Choice]) -> Result<(), ApiError> {
    let contents: Vec<String> = choices.iter().map(|c| c.content.clone()).collect();
    let checker = format.clone();
    let checked = tokio::task::spawn_blocking(move || {
        contents
            .iter()
            .map(|c| checker.check(c))
            .collect::<Vec<_>>()
    })
    .await
    .map_err(|e| ApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        message: format!("the response_format check did not finish: {e}"),
        kind: "server_error",
        param: Some("response_format".into()),
        code: None,
    })?;
    for (i, (choice, result)) in choices.iter_mut().zip(checked).enumerate() {
        choice.content = result.map_err(|why| ApiError::format_not_met(i, format, &why))?;
    }
    Ok(())
}

/// Writes the chunks of one streamed completion.
#[derive(Clone)]
struct ChunkWriter {
    id: String,
    created: u64,
    model: String,
}

impl ChunkWriter {
    fn event(&self, choices: Vec<Value>, usage: Option<Usage>) -> Event {
        let c = Chunk {
            id: &self.id,
            object: "chat.completion.chunk",
            created: self.created,
            model: &self.model,
            choices,
            usage,
            system_fingerprint: None,
        };
        Event::default().data(serde_json::to_string(&c).expect("chunk serializes"))
    }

    /// The choice object of a piece of choice `index`'s text; the choice's first piece also
    /// carries the role.
    fn delta_choice(&self, index: usize, text: &str, first: bool) -> Value {
        let delta = if first {
            json!({"role": "assistant", "content": text})
        } else {
            json!({"content": text})
        };
        json!({"index": index, "delta": delta, "finish_reason": null, "logprobs": null})
    }

    fn finish(&self, index: usize, reason: &str) -> Event {
        self.event(
            vec![json!({"index": index, "delta": {}, "finish_reason": reason, "logprobs": null})],
            None,
        )
    }
}

/// The finished answer as an SSE stream (JSON response formats, whose reply is checked
/// before anything is sent): per choice one chunk with the role and the whole content and
/// one with its finish reason, then (if asked) a usage chunk, then `[DONE]`.
fn stream_response(
    id: &str,
    created: u64,
    model: &str,
    resp: &ChatResponse,
    include_usage: bool,
    logprobs: bool,
) -> Response {
    let w = ChunkWriter {
        id: id.to_string(),
        created,
        model: model.to_string(),
    };
    let mut events = Vec::with_capacity(2 * resp.choices.len() + 2);
    for (i, c) in resp.choices.iter().enumerate() {
        let mut delta = w.delta_choice(i, &c.content, true);
        delta["logprobs"] = logprobs_json(logprobs, c);
        events.push(w.event(vec![delta], None));
        events.push(w.finish(i, c.finish_reason.as_str()));
    }
    if include_usage {
        events.push(w.event(Vec::new(), Some(Usage::of(resp))));
    }
    events.push(Event::default().data("[DONE]"));
    let stream = futures::stream::iter(events.into_iter().map(Ok::<_, std::convert::Infallible>));
    Sse::new(stream).into_response()
}

type ChatFuture = std::pin::Pin<Box<dyn Future<Output = Result<ChatResponse, LlmError>> + Send>>;

/// A streamed completion in flight: the generation's future (polled by the response body,
/// so a client that disconnects drops it and the generation stops at the next token), the
/// text it sends, and the chunks not yet written.
struct LiveStream {
    gen: Option<ChatFuture>,
    rx: tokio::sync::mpsc::UnboundedReceiver<Delta>,
    writer: ChunkWriter,
    include_usage: bool,
    /// The client asked for log-probabilities.
    logprobs: bool,
    /// Text sent so far, per choice.
    sent: Vec<String>,
    /// Log-probabilities sent so far, per choice.
    logprobs_sent: Vec<usize>,
    queue: std::collections::VecDeque<Event>,
}

impl LiveStream {
    fn push_delta(&mut self, index: usize, text: &str, lps: &[TokenLogprob]) {
        let Some(sent) = self.sent.get_mut(index) else {
            return;
        };
        let first = sent.is_empty();
        sent.push_str(text);
        let mut choice = self.writer.delta_choice(index, text, first);
        if self.logprobs {
            choice["logprobs"] = logprobs_object(lps);
            if let Some(n) = self.logprobs_sent.get_mut(index) {
                *n += lps.len();
            }
        }
        self.queue.push_back(self.writer.event(vec![choice], None));
    }

    fn push_end(&mut self, result: Result<ChatResponse, LlmError>) {
        while let Ok((i, text, lps)) = self.rx.try_recv() {
            self.push_delta(i, &text, &lps);
        }
        match result {
            Ok(resp) => {
                for (i, c) in resp.choices.iter().enumerate() {
                    // What the pieces did not carry (a backend that sends nothing while it
                    // works): the rest of the final content.
                    let sent = self.sent.get(i).map_or("", String::as_str);
                    let rest = c.content.strip_prefix(sent).unwrap_or("").to_string();
                    let nothing_sent = sent.is_empty();
                    // Log-probabilities the pieces did not carry, likewise.
                    let lps_sent = self.logprobs_sent.get(i).copied().unwrap_or(0);
                    let lps_rest = c
                        .logprobs
                        .as_deref()
                        .map_or(&[][..], |l| &l[lps_sent.min(l.len())..]);
                    if !rest.is_empty() || nothing_sent || (self.logprobs && !lps_rest.is_empty()) {
                        self.push_delta(i, &rest, lps_rest);
                    }
                    self.queue
                        .push_back(self.writer.finish(i, c.finish_reason.as_str()));
                }
                if self.include_usage {
                    self.queue
                        .push_back(self.writer.event(Vec::new(), Some(Usage::of(&resp))));
                }
                self.queue.push_back(Event::default().data("[DONE]"));
                tracing::info!(
                    prompt_tokens = resp.usage.prompt_tokens,
                    completion_tokens = resp.usage.completion_tokens,
                    "stream finished"
                );
            }
            // The status line is long gone: the error goes in the stream, OpenAI-shaped.
            Err(e) => {
                let err = ApiError::from_llm(&e);
                tracing::warn!(error = %err.message, "stream failed");
                let body = json!({"error": {"message": err.message, "type": err.kind,
                                            "param": err.param, "code": err.code}});
                self.queue
                    .push_back(Event::default().data(body.to_string()));
            }
        }
    }

    /// The next event: queued chunks first, then whatever the generation does next.
    async fn next(&mut self) -> Option<Event> {
        loop {
            if let Some(ev) = self.queue.pop_front() {
                return Some(ev);
            }
            let gen = self.gen.as_mut()?;
            tokio::select! {
                biased;
                Some((i, text, lps)) = self.rx.recv() => self.push_delta(i, &text, &lps),
                result = gen => {
                    self.gen = None;
                    self.push_end(result);
                }
            }
        }
    }
}

/// Token-by-token streaming: each piece of text goes out as one chunk as soon as the backend
/// produces it. An error before the first piece is an ordinary JSON error with its status.
async fn live_stream(state: &AppState, parsed: &ParsedRequest) -> Result<Response, ApiError> {
    let (sink, rx) = crate::llm::DeltaSink::channel();
    let backend = state.backend.clone();
    let request = parsed.request.clone();
    let gen: ChatFuture = Box::pin(async move { backend.chat_stream(&request, &sink).await });
    let mut live = LiveStream {
        gen: Some(gen),
        rx,
        writer: ChunkWriter {
            id: completion_id(),
            created: unix_now(),
            model: state.names.id().to_string(),
        },
        include_usage: parsed.include_usage,
        logprobs: parsed.request.logprobs.is_some(),
        sent: vec![String::new(); parsed.request.n],
        logprobs_sent: vec![0; parsed.request.n],
        queue: Default::default(),
    };
    // Wait for the first piece of text (or the end) before answering with a status.
    if let Some(gen) = live.gen.as_mut() {
        tokio::select! {
            biased;
            Some((i, text, lps)) = live.rx.recv() => live.push_delta(i, &text, &lps),
            result = gen => {
                live.gen = None;
                match result {
                    Err(e) => return Err(ApiError::from_llm(&e)),
                    ok => live.push_end(ok),
                }
            }
        }
    }
    let stream = futures::stream::unfold(live, |mut live| async move {
        let ev = live.next().await?;
        Some((Ok::<_, std::convert::Infallible>(ev), live))
    });
    let mut response = Sse::new(stream).into_response();
    response.extensions_mut().insert(ChatStats {
        n: parsed.request.n,
        stream: true,
        prompt_tokens: 0,
        completion_tokens: 0,
    });
    Ok(response)
}

/// What the chat handler tells the access log about a completed request.
#[derive(Clone, Copy, Debug)]
struct ChatStats {
    n: usize,
    stream: bool,
    prompt_tokens: u64,
    completion_tokens: u64,
}

/// The error message of a failed request, for the access log.
#[derive(Clone, Debug)]
struct ErrorNote(String);

/// One log line per request: method, path, status, latency, and for completions n and tokens.
async fn access_log(req: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let resp = next.run(req).await;
    let status = resp.status().as_u16();
    let latency_ms = started.elapsed().as_millis() as u64;
    if let Some(s) = resp.extensions().get::<ChatStats>() {
        tracing::info!(
            %method, path, status, n = s.n, stream = s.stream,
            prompt_tokens = s.prompt_tokens, completion_tokens = s.completion_tokens,
            latency_ms, "request"
        );
    } else if let Some(ErrorNote(msg)) = resp.extensions().get::<ErrorNote>() {
        if resp.status().is_server_error() {
            tracing::error!(%method, path, status, latency_ms, error = %msg, "request failed");
        } else {
            tracing::warn!(%method, path, status, latency_ms, error = %msg, "request rejected");
        }
    } else {
        tracing::info!(%method, path, status, latency_ms, "request");
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: Value) -> Result<ParsedRequest, ApiError> {
        parse_request(v.to_string().as_bytes())
    }

    #[test]
    fn parses_defaults_and_variants() {
        let p =
            parse(json!({"model": "x", "messages": [{"role": "user", "content": "hi"}]})).unwrap();
        assert_eq!(p.request, ChatRequest::new(vec![ChatMessage::user("hi")]));
        assert!(!p.stream);

        let p = parse(json!({
            "messages": [
                {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": null},
                {"role": "user", "content": "q", "name": "bob"}
            ],
            "temperature": 0, "top_p": 0.5, "max_tokens": 9, "max_completion_tokens": 7,
            "n": 2, "stop": "END", "seed": -1, "response_format": {"type": "json_object"},
            "stream": true, "stream_options": {"include_usage": true}, "frequency_penalty": 0,
            "presence_penalty": 0.0, "logit_bias": {}, "logprobs": false, "top_logprobs": 0,
            "model": "x", "some_future_field": [1]
        }))
        .unwrap();
        let r = &p.request;
        assert_eq!(r.messages[0], ChatMessage::system("ab"));
        assert_eq!(r.messages[1], ChatMessage::assistant(""));
        assert_eq!(
            (r.temperature, r.top_p, r.max_tokens, r.n),
            (0.0, 0.5, 7, 2)
        );
        assert_eq!(r.stop, vec!["END".to_string()]);
        assert_eq!(r.seed, Some(u64::MAX));
        assert!(r.json_mode && p.stream && p.include_usage);
        assert_eq!(p.response_format, ResponseFormat::JsonObject);
        assert_eq!(p.model.as_deref(), Some("x"));
        // A limit the client gives must fit; the default one is only a cap.
        assert!(r.strict_max_tokens);
        let p = parse(json!({"messages": [{"role": "user", "content": "hi"}]})).unwrap();
        assert!(!p.request.strict_max_tokens && p.model.is_none());
    }

    #[test]
    fn model_names_and_context_bounds() {
        let names = ModelNames::new("m").with_aliases(["a", "m", "", "b"]);
        assert_eq!(names.all(), ["m", "a", "b"]);
        assert!(names.accepts("b") && !names.accepts("c") && !names.accepts(""));
        let e = ApiError::model_not_found("c");
        assert_eq!(
            (e.status, e.code),
            (StatusCode::NOT_FOUND, Some("model_not_found"))
        );

        let limits = ContextLimits {
            context_tokens: 100,
            max_token_bytes: 4,
        };
        let req = |content: &str, extra: Value| {
            let mut body = json!({"messages": [{"role": "user", "content": content}]});
            body.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            parse(body).unwrap()
        };
        assert!(check_context(&req(&"x".repeat(400), json!({})), limits).is_ok());
        let e = check_context(&req(&"x".repeat(401), json!({})), limits).unwrap_err();
        assert_eq!(
            (e.param.as_deref(), e.code),
            (Some("messages"), Some("context_length_exceeded"))
        );
        assert!(check_context(&req("hi", json!({"max_tokens": 99})), limits).is_ok());
        let e = check_context(&req("hi", json!({"max_tokens": 100})), limits).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
    }

    #[test]
    fn rejects_bad_input_with_param() {
        let user = json!([{"role": "user", "content": "hi"}]);
        let cases = [
            (json!({}), Some("messages")),
            (json!({"messages": []}), Some("messages")),
            (json!({"messages": "hi"}), Some("messages")),
            (
                json!({"messages": [{"role": "robot", "content": "x"}]}),
                Some("messages[0].role"),
            ),
            (
                json!({"messages": [{"role": "user"}]}),
                Some("messages[0].content"),
            ),
            (
                json!({"messages": [{"role": "user", "content": 3}]}),
                Some("messages[0].content"),
            ),
            (json!({"messages": user, "n": 0}), Some("n")),
            (json!({"messages": user, "n": 99}), Some("n")),
            (json!({"messages": user, "n": "2"}), Some("n")),
            (
                json!({"messages": user, "temperature": -1}),
                Some("temperature"),
            ),
            (json!({"messages": user, "top_p": 0}), Some("top_p")),
            (json!({"messages": user, "top_p": 1.5}), Some("top_p")),
            (
                json!({"messages": user, "max_tokens": -3}),
                Some("max_tokens"),
            ),
            (
                json!({"messages": user, "max_tokens": 0}),
                Some("max_tokens"),
            ),
            (json!({"messages": user, "stop": [1]}), Some("stop")),
            (
                json!({"messages": user, "response_format": {"type": "yaml"}}),
                Some("response_format"),
            ),
            (json!({"messages": user, "stream": "yes"}), Some("stream")),
            (json!({"messages": user, "model": 5}), Some("model")),
            (
                json!({"messages": user, "temperature": 2.5}),
                Some("temperature"),
            ),
            (
                json!({"messages": user, "temperature": "hot"}),
                Some("temperature"),
            ),
            (
                json!({"messages": user, "max_completion_tokens": 0}),
                Some("max_completion_tokens"),
            ),
            (json!({"messages": user, "n": 1.5}), Some("n")),
            (json!({"messages": user, "seed": 1.5}), Some("seed")),
            (json!({"messages": user, "seed": 1e20}), Some("seed")),
            (
                json!({"messages": user, "presence_penalty": 0.5}),
                Some("presence_penalty"),
            ),
            (
                json!({"messages": user, "frequency_penalty": -3}),
                Some("frequency_penalty"),
            ),
            (
                json!({"messages": user, "logit_bias": {"12": 5}}),
                Some("logit_bias"),
            ),
            (
                json!({"messages": user, "logprobs": "yes"}),
                Some("logprobs"),
            ),
            (
                json!({"messages": user, "top_logprobs": 2}),
                Some("top_logprobs"),
            ),
            (
                json!({"messages": user, "logprobs": true, "top_logprobs": 21}),
                Some("top_logprobs"),
            ),
            (
                json!({"messages": user, "response_format": {"type": "json_schema",
                    "json_schema": {"name": "a", "schema": {"type": "string", "pattern": "x"}}}}),
                Some("response_format.json_schema.schema.pattern"),
            ),
            (json!([1, 2]), None),
        ];
        for (body, param) in cases {
            let e = parse(body.clone()).expect_err(&body.to_string());
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(e.param.as_deref(), param, "{body}: {}", e.message);
        }
        let user = json!([{"role": "user", "content": "hi"}]);
        let lp = |body: Value| parse(body).unwrap().request.logprobs;
        assert_eq!(lp(json!({"messages": user})), None);
        assert_eq!(lp(json!({"messages": user, "logprobs": false})), None);
        assert_eq!(lp(json!({"messages": user, "logprobs": true})), Some(0));
        assert_eq!(
            lp(json!({"messages": user, "logprobs": true, "top_logprobs": 20})),
            Some(20)
        );
        let e = parse_request(b"{not json").unwrap_err();
        assert_eq!(e.kind, "invalid_request_error");
        assert!(e.message.contains("not valid JSON"));
    }
}
