//! An OpenAI chat-completion request: the body as typed serde structs (each known field in the
//! shapes the wire allows), then one validation pass that checks every field by name (range,
//! what this server cannot honour) and the cheap context check that refuses a prompt no
//! tokenization could fit, before any work is queued.
//!
//! Deserialization settles types; a type error is reported by the path of the field that failed
//! (`messages[2].content`), looked up in one table of what each field must be. Values are
//! checked after, so a range error can print the number as the client wrote it.

use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::{Map, Number, Value};

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

/// The body of `POST /v1/chat/completions` as sent. A `null` field counts as absent, as
/// OpenAI treats it; fields this server does not know are ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ChatCompletionBody {
    model: Option<String>,
    messages: Option<Vec<Object<MessageBody>>>,
    temperature: Option<Number>,
    top_p: Option<Number>,
    /// The current name of the completion limit; `max_tokens` is the deprecated one.
    max_completion_tokens: Option<Count>,
    max_tokens: Option<Count>,
    n: Option<Count>,
    stop: Option<Stop>,
    seed: Option<Seed>,
    /// Checked by [`ResponseFormat::parse`], which names the nested field at fault.
    response_format: Option<Value>,
    stream: Option<bool>,
    stream_options: Option<Object<StreamOptions>>,
    logprobs: Option<bool>,
    top_logprobs: Option<Count>,
    presence_penalty: Option<Number>,
    frequency_penalty: Option<Number>,
    logit_bias: Option<Map<String, Value>>,
    /// Refused when non-empty; its items are not read.
    tools: Option<Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct StreamOptions {
    pub(super) include_usage: Option<bool>,
}

/// `messages` as sent (chat completions, and a conversation to tokenize).
pub(super) type Messages = Vec<Object<MessageBody>>;

/// One message. `role` and `content` keep apart a missing field and a `null` one: an
/// assistant turn may carry `content: null`, a user turn may not.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct MessageBody {
    role: Presence<String>,
    content: Presence<Content>,
}

#[derive(Debug)]
enum Content {
    Text(String),
    Parts(Vec<Object<ContentPart>>),
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ContentPart {
    #[serde(rename = "type")]
    kind: Option<String>,
    text: Option<String>,
}

/// `stop`: one string or a list of them.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum Stop {
    One(String),
    Many(Vec<String>),
}

/// OpenAI takes any 64-bit integer as a seed; a negative one keeps its bits.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum Seed {
    Unsigned(u64),
    Signed(i64),
}

impl Seed {
    pub(super) fn bits(&self) -> u64 {
        match *self {
            Seed::Unsigned(s) => s,
            Seed::Signed(s) => s as u64,
        }
    }
}

/// A count as given: a negative integer is kept so that its error can say so and print it.
#[derive(Debug, Clone, Copy)]
pub(super) enum Count {
    Given(u64),
    Negative(i64),
}

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct CountVisitor;
        impl Visitor<'_> for CountVisitor {
            type Value = Count;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a non-negative integer")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Count, E> {
                Ok(Count::Given(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Count, E> {
                Ok(u64::try_from(v).map_or(Count::Negative(v), Count::Given))
            }
        }
        d.deserialize_any(CountVisitor)
    }
}

/// A field that may be missing, `null`, or given.
#[derive(Debug, Default)]
enum Presence<T> {
    #[default]
    Missing,
    Null,
    Given(T),
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Presence<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Option::<T>::deserialize(d)?.map_or(Presence::Null, Presence::Given))
    }
}

/// A struct read only from a JSON object. A derived struct also accepts an array, filling its
/// fields by position; a message written as `["user", "hi"]` must be refused, not guessed.
#[derive(Debug)]
pub(super) struct Object<T>(pub(super) T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Object<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ObjectVisitor<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for ObjectVisitor<T> {
            type Value = T;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(de::value::MapAccessDeserializer::new(map))
            }
        }
        d.deserialize_map(ObjectVisitor(PhantomData)).map(Object)
    }
}

impl<'de> Deserialize<'de> for Content {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ContentVisitor;
        impl<'de> Visitor<'de> for ContentVisitor {
            type Value = Content;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or an array of content parts")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Content, E> {
                Ok(Content::Text(v.to_string()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Content, E> {
                Ok(Content::Text(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Content, A::Error> {
                let mut parts = Vec::new();
                while let Some(part) = seq.next_element()? {
                    parts.push(part);
                }
                Ok(Content::Parts(parts))
            }
        }
        d.deserialize_any(ContentVisitor)
    }
}

/// Parses an OpenAI chat-completion request body. Fields this server does not know are
/// ignored, as OpenAI does; known fields of the wrong type or with invalid values are a 400
/// naming the field, and known fields the server cannot honour (penalties, logit bias,
/// tools) are refused rather than silently ignored.
pub fn parse_request(body: &[u8]) -> Result<ParsedRequest, ApiError> {
    let value = json_object(body)?;
    let body: ChatCompletionBody =
        serde_path_to_error::deserialize(value).map_err(|e| type_error_at(e.path()))?;
    body.validate()
}

/// The body as a JSON object, or the 400 that says why it is not one.
pub(super) fn json_object(body: &[u8]) -> Result<Value, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("the request body is not valid JSON: {e}"), None))?;
    if !value.is_object() {
        return Err(ApiError::invalid(
            "the request body must be a JSON object",
            None,
        ));
    }
    Ok(value)
}

/// A failed field as the client wrote it (`messages[2].content`) and as a shape without
/// indices (`messages[].content`), to look up what the field must be.
pub(super) fn param_and_shape(path: &serde_path_to_error::Path) -> (String, String) {
    use serde_path_to_error::Segment;
    let (mut param, mut shape) = (String::new(), String::new());
    for segment in path.iter() {
        match segment {
            Segment::Seq { index } => {
                param.push_str(&format!("[{index}]"));
                shape.push_str("[]");
            }
            Segment::Map { key } => {
                let dot = if param.is_empty() { "" } else { "." };
                param.push_str(&format!("{dot}{key}"));
                shape.push_str(&format!("{dot}{key}"));
            }
            Segment::Enum { .. } | Segment::Unknown => {}
        }
    }
    (param, shape)
}

/// The 400 for a field of the wrong type, found by the path serde failed at.
pub(super) fn type_error_at(path: &serde_path_to_error::Path) -> ApiError {
    // `param` names the field as the client wrote it (`messages[2].content`); `shape` drops the
    // indices (`messages[].content`) to look up what the field must be.
    let (mut param, shape) = param_and_shape(path);
    let expected = match shape.as_str() {
        "model" | "messages[].role" | "messages[].content[].text" => "a string",
        "messages" => "an array of messages",
        "messages[]" | "stream_options" | "logit_bias" => "an object",
        "messages[].content" => "a string or an array of content parts",
        "messages[].content[]" => "an object with a string `type`",
        "messages[].content[].type" => {
            param.truncate(param.len() - ".type".len());
            "an object with a string `type`"
        }
        "temperature" | "top_p" | "presence_penalty" | "frequency_penalty" => "a number",
        "max_completion_tokens" | "max_tokens" | "n" | "top_logprobs" => "a non-negative integer",
        "stop" | "stop[]" => {
            param = "stop".into();
            "a string or an array of strings"
        }
        "seed" => "an integer of at most 64 bits",
        "stream" | "logprobs" | "stream_options.include_usage" => "a boolean",
        // Every field of the body is in the table above; a path outside it is a field added
        // to the structs and not here, still reported by name.
        _ => "of the type the OpenAI API documents",
    };
    type_error(&param, expected)
}

impl ChatCompletionBody {
    /// Checks every field's value, in a fixed order so one request always gets one error.
    fn validate(self) -> Result<ParsedRequest, ApiError> {
        let messages = self.messages.ok_or_else(|| {
            ApiError::invalid("missing required parameter: `messages`", Some("messages"))
        })?;
        let mut req = ChatRequest::new(parse_messages(messages)?);
        if let Some(v) = &self.temperature {
            req.temperature = temperature(v)?;
        }
        if let Some(v) = &self.top_p {
            req.top_p = top_p(v)?;
        }
        // A limit the client gives must fit beside the prompt; the default is only a cap.
        let max_tokens = match (self.max_completion_tokens, self.max_tokens) {
            (Some(v), _) => Some(("max_completion_tokens", v)),
            (None, Some(v)) => Some(("max_tokens", v)),
            (None, None) => None,
        };
        if let Some((name, v)) = max_tokens {
            req.max_tokens = count(v, name)?;
            if req.max_tokens == 0 {
                return Err(out_of_range(name, "at least 1", 0));
            }
            req.strict_max_tokens = true;
        }
        if let Some(v) = self.n {
            req.n = samples(v)?;
        }
        if let Some(stop) = self.stop {
            req.stop = parse_stop(stop)?;
        }
        req.seed = self.seed.as_ref().map(Seed::bits);
        let response_format = match &self.response_format {
            Some(v) => ResponseFormat::parse(v).map_err(ApiError::from_format)?,
            None => ResponseFormat::Text,
        };
        req.json_mode = response_format.wants_json();
        let include_usage = self
            .stream_options
            .and_then(|Object(o)| o.include_usage)
            .unwrap_or(false);
        req.logprobs = parse_logprobs(self.logprobs, self.top_logprobs)?;
        refuse_unhonoured(
            [
                ("presence_penalty", &self.presence_penalty),
                ("frequency_penalty", &self.frequency_penalty),
            ],
            self.logit_bias.as_ref(),
            self.tools.as_ref(),
        )?;
        req.validate().map_err(|e| ApiError::from_llm(&e))?;
        Ok(ParsedRequest {
            request: req,
            model: self.model,
            stream: self.stream.unwrap_or(false),
            include_usage,
            response_format,
        })
    }
}

/// `temperature`, in [0, 2].
pub(super) fn temperature(v: &Number) -> Result<f32, ApiError> {
    Ok(number_in(v, "temperature", 0.0, MAX_TEMPERATURE)? as f32)
}

/// `top_p`, in (0, 1].
pub(super) fn top_p(v: &Number) -> Result<f32, ApiError> {
    let p = number_in(v, "top_p", 0.0, 1.0)?;
    if p == 0.0 {
        return Err(out_of_range("top_p", "in (0, 1]", v));
    }
    Ok(p as f32)
}

/// `n`, between 1 and [`MAX_N`].
pub(super) fn samples(v: Count) -> Result<usize, ApiError> {
    let n = count(v, "n")?;
    if !(1..=MAX_N).contains(&n) {
        return Err(out_of_range("n", &format!("between 1 and {MAX_N}"), n));
    }
    Ok(n)
}

/// `logprobs` and `top_logprobs` (0 to 20; above 0 only with `logprobs: true`, as OpenAI
/// requires): the number of alternatives per token, `None` when not asked.
fn parse_logprobs(on: Option<bool>, top: Option<Count>) -> Result<Option<usize>, ApiError> {
    let on = on.unwrap_or(false);
    let top = match top {
        Some(v) => {
            let k = count(v, "top_logprobs")?;
            if k > MAX_TOP_LOGPROBS {
                return Err(out_of_range(
                    "top_logprobs",
                    &format!("between 0 and {MAX_TOP_LOGPROBS}"),
                    k,
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
pub(super) fn refuse_unhonoured(
    penalties: [(&str, &Option<Number>); 2],
    logit_bias: Option<&Map<String, Value>>,
    tools: Option<&Value>,
) -> Result<(), ApiError> {
    for (name, value) in penalties {
        if let Some(v) = value {
            if number_in(v, name, -MAX_PENALTY, MAX_PENALTY)? != 0.0 {
                return Err(unsupported(
                    name,
                    &format!("`{name}` is not supported by this server (only 0)"),
                ));
            }
        }
    }
    if logit_bias.is_some_and(|b| !b.is_empty()) {
        return Err(unsupported(
            "logit_bias",
            "`logit_bias` is not supported by this server",
        ));
    }
    if tools
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

pub(super) fn out_of_range(param: &str, range: &str, got: impl fmt::Display) -> ApiError {
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
/// beyond f64, so a finite range check is all that is left), printed as written when refused.
pub(super) fn number_in(v: &Number, param: &str, lo: f64, hi: f64) -> Result<f64, ApiError> {
    let x = v.as_f64().ok_or_else(|| type_error(param, "a number"))?;
    if !(x.is_finite() && (lo..=hi).contains(&x)) {
        return Err(out_of_range(param, &format!("between {lo} and {hi}"), v));
    }
    Ok(x)
}

pub(super) fn count(v: Count, param: &str) -> Result<usize, ApiError> {
    match v {
        Count::Given(x) => Ok(usize::try_from(x).unwrap_or(usize::MAX)),
        Count::Negative(x) => Err(ApiError::invalid(
            format!("`{param}` must not be negative, got {x}"),
            Some(param),
        )),
    }
}

pub(super) fn parse_stop(stop: Stop) -> Result<Vec<String>, ApiError> {
    let stops = match stop {
        Stop::One(s) => vec![s],
        Stop::Many(items) => items,
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

pub(super) fn parse_messages(items: Messages) -> Result<Vec<ChatMessage>, ApiError> {
    if items.is_empty() {
        return Err(ApiError::invalid(
            "`messages` must not be empty",
            Some("messages"),
        ));
    }
    items
        .into_iter()
        .enumerate()
        .map(|(i, Object(m))| parse_message(i, m))
        .collect()
}

fn parse_message(i: usize, m: MessageBody) -> Result<ChatMessage, ApiError> {
    let param = |name: &str| format!("messages[{i}].{name}");
    let missing = |name: &str| {
        ApiError::invalid(
            format!("missing required parameter: `{}`", param(name)),
            Some(&param(name)),
        )
    };
    let role = match m.role {
        Presence::Given(role) => role,
        Presence::Null => return Err(type_error(&param("role"), "a string")),
        Presence::Missing => return Err(missing("role")),
    };
    let role = match role.as_str() {
        "system" | "user" | "assistant" => role,
        // OpenAI's newer name for system instructions.
        "developer" => "system".to_string(),
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
    let content = match m.content {
        Presence::Given(Content::Text(text)) => text,
        Presence::Given(Content::Parts(parts)) => content_parts(i, parts)?,
        // An assistant turn may carry no content (OpenAI allows it alongside tool calls).
        Presence::Null | Presence::Missing if role == "assistant" => String::new(),
        Presence::Missing => return Err(missing("content")),
        Presence::Null => {
            return Err(type_error(
                &param("content"),
                "a string or an array of content parts",
            ))
        }
    };
    Ok(ChatMessage::new(&role, content))
}

/// The text of a message given as content parts; only text parts are accepted.
fn content_parts(i: usize, parts: Vec<Object<ContentPart>>) -> Result<String, ApiError> {
    let mut text = String::new();
    for (j, Object(part)) in parts.into_iter().enumerate() {
        let p = format!("messages[{i}].content[{j}]");
        match part.kind.as_deref() {
            Some("text") => match part.text {
                Some(t) => text.push_str(&t),
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
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every bad body of the fixture gets the status, `param`, `code` and message it names:
    /// the texts clients and their tests match on.
    #[test]
    fn bad_requests_get_the_documented_errors() {
        let rows = include_str!("../../tests/fixtures/serve_request_errors.jsonl");
        let mut n = 0;
        for line in rows.lines() {
            let row: Value = serde_json::from_str(line).unwrap();
            let body = row["body"].as_str().unwrap();
            let e = parse_request(body.as_bytes()).expect_err(body);
            assert_eq!(u64::from(e.status.as_u16()), row["status"], "{body}");
            assert_eq!(e.param.as_deref(), row["param"].as_str(), "{body}");
            assert_eq!(e.code, row["code"].as_str(), "{body}");
            assert_eq!(e.message, row["message"].as_str().unwrap(), "{body}");
            n += 1;
        }
        assert!(n >= 60, "{n} cases");
    }
}
