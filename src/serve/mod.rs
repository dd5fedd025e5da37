//! OpenAI-compatible HTTP front over any [`ChatBackend`](crate::llm::ChatBackend): `POST /v1/chat/completions`
//! (plain and SSE streaming), `POST /v1/completions`, `GET /v1/models`, `GET /health`, and
//! vLLM's `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`. Single-model server: a request's
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

mod auth;
mod completions;
mod error;
mod request;
mod response_format;
mod stream;
mod tokenize;

use std::future::Future;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::HeaderMap;
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Serialize;
use serde_json::{json, Value};

pub use auth::{check_api_key, require_api_key, InvalidApiKey};
pub use completions::{parse_completion, ParsedCompletion, DEFAULT_COMPLETION_TOKENS, MAX_PROMPTS};
pub use error::ApiError;
use error::{method_not_allowed, not_found};
use request::check_context;
pub use request::{parse_request, ParsedRequest};
pub use response_format::ResponseFormat;
use stream::{live_stream, stream_response};
pub use tokenize::{parse_detokenize, parse_tokenize, ParsedTokenize};

use crate::llm::{ChatResponse, Choice, SharedBackend, TokenLogprob};

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
        .route("/v1/completions", post(text_completions))
        .route("/completions", post(text_completions))
        .route("/v1/models", get(list_models))
        .route("/models", get(list_models))
        // vLLM's tokenizer endpoints, at the root as vLLM serves them.
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/tokenizer_info", get(tokenize::tokenizer_info))
        .route("/health", get(health))
        .route("/v1/health", get(health))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn(access_log))
        .with_state(state)
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

/// The kind of response an id names: OpenAI's `chatcmpl-…` and `cmpl-…`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ResponseKind {
    Chat,
    Completion,
}

/// A response's id (every chunk of a stream carries its response's): the kind's prefix and
/// 96 random bits in hex, as OpenAI's are shaped.
pub(crate) fn response_id(kind: ResponseKind) -> String {
    let prefix = match kind {
        ResponseKind::Chat => "chatcmpl",
        ResponseKind::Completion => "cmpl",
    };
    format!(
        "{prefix}-{:016x}{:08x}",
        rand::random::<u64>(),
        rand::random::<u32>()
    )
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

/// The body of a JSON request, or the error that says why there is none.
fn json_body(headers: &HeaderMap, body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    require_json(headers)?;
    body.map_err(|rejection| ApiError {
        status: rejection.status(),
        message: rejection.body_text(),
        kind: "invalid_request_error",
        param: None,
        code: None,
    })
}

/// `POST /v1/completions`: raw text continued with no chat template.
async fn text_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = json_body(&headers, body)?;
    let parsed = parse_completion(&body)?;
    if let Some(name) = parsed.model.as_deref() {
        if !state.names.accepts(name) {
            return Err(ApiError::model_not_found(name));
        }
    }
    if let Some(limits) = state.backend.context_limits() {
        completions::check_completion_context(&parsed, limits)?;
    }
    completions::answer(&state, parsed).await
}

async fn chat_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = json_body(&headers, body)?;
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
    let id = response_id(ResponseKind::Chat);
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
    // A client's path is logged cut, as error messages are.
    let path = crate::check::clip(req.uri().path(), 200);
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
    use crate::llm::{ChatMessage, ChatRequest, ContextLimits};

    fn parse(v: Value) -> Result<ParsedRequest, ApiError> {
        parse_request(v.to_string().as_bytes())
    }

    /// One id maker for both routes: OpenAI's prefixes, 24 hex digits, a new id each time.
    #[test]
    fn response_ids_are_shaped_like_openais() {
        for (kind, prefix) in [
            (ResponseKind::Chat, "chatcmpl-"),
            (ResponseKind::Completion, "cmpl-"),
        ] {
            let id = response_id(kind);
            let hex = id.strip_prefix(prefix).unwrap();
            assert!(
                hex.len() == 24 && hex.chars().all(|c| c.is_ascii_hexdigit()),
                "{id}"
            );
            assert_ne!(id, response_id(kind));
        }
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
