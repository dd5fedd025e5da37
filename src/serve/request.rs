//! Parsing an OpenAI chat-completion request: every known field checked once, by name (type,
//! range, what this server cannot honour), and the cheap context check that refuses a prompt
//! no tokenization could fit, before any work is queued.

use serde_json::{Map, Value};

use super::{ApiError, ResponseFormat, MAX_N, MAX_PENALTY, MAX_STOP, MAX_TEMPERATURE};
use crate::llm::{ChatMessage, ChatRequest, ContextLimits, MAX_STOP_BYTES, MAX_TOP_LOGPROBS};

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
pub(super) fn parse_logprobs<'a>(
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

/// Known fields whose silent omission would mislead the client: validated, and refused unless
/// they ask for nothing (0, false, empty).
pub(super) fn refuse_unhonoured<'a>(
    field: &impl Fn(&str) -> Option<&'a Value>,
) -> Result<(), ApiError> {
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

pub(super) fn type_error(param: &str, expected: &str) -> ApiError {
    let mut e = ApiError::invalid(format!("`{param}` must be {expected}"), Some(param));
    e.code = Some("invalid_type");
    e
}

pub(super) fn out_of_range(param: &str, range: &str, got: &Value) -> ApiError {
    let mut e = ApiError::invalid(format!("`{param}` must be {range}, got {got}"), Some(param));
    e.code = Some("invalid_value");
    e
}

pub(super) fn unsupported(param: &str, message: &str) -> ApiError {
    let mut e = ApiError::invalid(message, Some(param));
    e.code = Some("unsupported_parameter");
    e
}

/// A JSON number in `[lo, hi]` (JSON has no NaN or infinity, and serde_json refuses numbers
/// beyond f64, so a finite range check is all that is left).
pub(super) fn number_in(v: &Value, param: &str, lo: f64, hi: f64) -> Result<f64, ApiError> {
    let x = v.as_f64().ok_or_else(|| type_error(param, "a number"))?;
    if !(x.is_finite() && (lo..=hi).contains(&x)) {
        return Err(out_of_range(param, &format!("between {lo} and {hi}"), v));
    }
    Ok(x)
}

pub(super) fn uint(v: &Value, param: &str) -> Result<usize, ApiError> {
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

pub(super) fn parse_stop(v: &Value) -> Result<Vec<String>, ApiError> {
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
pub(super) fn check_context(parsed: &ParsedRequest, limits: ContextLimits) -> Result<(), ApiError> {
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

pub(super) fn parse_messages(v: &Value) -> Result<Vec<ChatMessage>, ApiError> {
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

pub(super) fn parse_message(i: usize, v: &Value) -> Result<ChatMessage, ApiError> {
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
