//! `POST /v1/completions`, OpenAI's raw-text endpoint as vLLM and llama.cpp's server offer
//! it: a prompt (text, token ids, or a batch of either) continued with no chat template, so
//! base models serve; `echo` with `logprobs` returns every prompt token's log-probability, how
//! harnesses (lm-evaluation-harness's `local-completions`) score log-likelihoods.
//!
//! Choices are numbered prompt by prompt: prompt `i`'s sample `j` is choice `i · n + j`.
//! `logprobs` is the legacy object (`tokens`, `token_logprobs`, `top_logprobs` as
//! token → log-prob maps, `text_offset` in characters of the choice's text); with `echo` the
//! first prompt token's log-prob is `null`, nothing precedes it.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::{SelectAll, Stream, StreamExt};
use futures::FutureExt;
use serde::Deserialize;
use serde_json::{json, Map, Number, Value};

use super::request::{
    count, json_object, out_of_range, param_and_shape, parse_stop, refuse_unhonoured, samples,
    temperature, top_p, type_error, unsupported, Count, Object, Seed, Stop, StreamOptions,
};
use super::{response_id, unix_now, ApiError, AppState, ChatStats, ResponseKind};
use crate::llm::{
    Choice, CompletionPrompt, CompletionRequest, CompletionResponse, ContextLimits, Delta,
    DeltaSink, LlmError, TokenLogprob, TokenUsage, MAX_TOP_LOGPROBS,
};

/// Most prompts one request may batch.
pub const MAX_PROMPTS: usize = 64;
/// `max_tokens` when the request gives none (OpenAI's default for this endpoint).
pub const DEFAULT_COMPLETION_TOKENS: usize = 16;

/// A parsed completion request: one backend request per prompt, and the transport options.
#[derive(Clone, Debug, PartialEq)]
pub struct ParsedCompletion {
    pub requests: Vec<CompletionRequest>,
    pub model: Option<String>,
    pub stream: bool,
    pub include_usage: bool,
}

impl ParsedCompletion {
    fn n(&self) -> usize {
        self.requests.first().map_or(1, |r| r.n)
    }
    fn echo(&self) -> bool {
        self.requests.first().is_some_and(|r| r.echo)
    }
    fn logprobs(&self) -> Option<usize> {
        self.requests.first().and_then(|r| r.logprobs)
    }
}

/// The body as sent; `null` counts as absent and unknown fields are ignored, as OpenAI does,
/// but for chat's parameters (`response_format`, `tools`, …), which are refused by name.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct CompletionBody {
    model: Option<String>,
    prompt: Option<PromptBody>,
    max_tokens: Option<Count>,
    temperature: Option<Number>,
    top_p: Option<Number>,
    n: Option<Count>,
    best_of: Option<Count>,
    stop: Option<Stop>,
    seed: Option<Seed>,
    logprobs: Option<Count>,
    echo: Option<bool>,
    stream: Option<bool>,
    stream_options: Option<Object<StreamOptions>>,
    suffix: Option<String>,
    presence_penalty: Option<Number>,
    frequency_penalty: Option<Number>,
    logit_bias: Option<Map<String, Value>>,
    // Chat parameters this route cannot honour: refused by name, never ignored.
    response_format: Option<Value>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
    functions: Option<Value>,
    function_call: Option<Value>,
}

/// The four shapes of `prompt`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum PromptBody {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

const PROMPT_SHAPES: &str =
    "a string, an array of strings, an array of token ids or an array of arrays of token ids";

/// Parses an OpenAI completion request body, every field checked by name before any work.
pub fn parse_completion(body: &[u8]) -> Result<ParsedCompletion, ApiError> {
    let value = json_object(body)?;
    let body: CompletionBody = serde_path_to_error::deserialize(value).map_err(|e| {
        let (param, shape) = param_and_shape(e.path());
        let expected = match shape.as_str() {
            "model" | "suffix" => "a string",
            "prompt" | "prompt[]" | "prompt[][]" => {
                return type_error("prompt", PROMPT_SHAPES);
            }
            "temperature" | "top_p" | "presence_penalty" | "frequency_penalty" => "a number",
            "max_tokens" | "n" | "best_of" | "logprobs" => "a non-negative integer",
            "stop" | "stop[]" => return type_error("stop", "a string or an array of strings"),
            "seed" => "an integer of at most 64 bits",
            "echo" | "stream" | "stream_options.include_usage" => "a boolean",
            "stream_options" | "logit_bias" => "an object",
            _ => "of the type the OpenAI API documents",
        };
        type_error(&param, expected)
    })?;
    body.validate()
}

impl CompletionBody {
    fn validate(self) -> Result<ParsedCompletion, ApiError> {
        let prompts = match self.prompt {
            None => {
                return Err(ApiError::invalid(
                    "missing required parameter: `prompt`",
                    Some("prompt"),
                ))
            }
            Some(PromptBody::Text(t)) => vec![CompletionPrompt::Text(t)],
            Some(PromptBody::Texts(ts)) => ts.into_iter().map(CompletionPrompt::Text).collect(),
            Some(PromptBody::Tokens(ids)) => vec![CompletionPrompt::Tokens(ids)],
            Some(PromptBody::TokenLists(l)) => {
                l.into_iter().map(CompletionPrompt::Tokens).collect()
            }
        };
        if prompts.is_empty() || prompts.len() > MAX_PROMPTS {
            return Err(out_of_range(
                "prompt",
                &format!("a batch of 1 to {MAX_PROMPTS} prompts"),
                prompts.len(),
            ));
        }
        let mut base = CompletionRequest::new(CompletionPrompt::Text(String::new()));
        base.echo = self.echo.unwrap_or(false);
        if let Some(v) = &self.temperature {
            base.temperature = temperature(v)?;
        }
        if let Some(v) = &self.top_p {
            base.top_p = top_p(v)?;
        }
        base.max_tokens = DEFAULT_COMPLETION_TOKENS;
        if let Some(v) = self.max_tokens {
            base.max_tokens = count(v, "max_tokens")?;
            if base.max_tokens == 0 && !base.echo {
                return Err(out_of_range(
                    "max_tokens",
                    "at least 1 (0 only with `echo`)",
                    0,
                ));
            }
            base.strict_max_tokens = true;
        }
        if let Some(v) = self.n {
            base.n = samples(v)?;
        }
        if let Some(v) = self.best_of {
            let best_of = count(v, "best_of")?;
            if best_of != base.n {
                return Err(unsupported(
                    "best_of",
                    "`best_of` is not supported by this server (only equal to `n`)",
                ));
            }
        }
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(unsupported(
                "suffix",
                "`suffix` is not supported by this server",
            ));
        }
        for (name, given) in [
            ("response_format", self.response_format.is_some()),
            ("tools", self.tools.is_some()),
            ("tool_choice", self.tool_choice.is_some()),
            ("functions", self.functions.is_some()),
            ("function_call", self.function_call.is_some()),
        ] {
            if given {
                return Err(unsupported(
                    name,
                    &format!(
                        "`{name}` is not supported by /v1/completions (raw text); use \
                         /v1/chat/completions"
                    ),
                ));
            }
        }
        if let Some(stop) = self.stop {
            base.stop = parse_stop(stop)?;
        }
        base.seed = self.seed.as_ref().map(Seed::bits);
        if let Some(v) = self.logprobs {
            let k = count(v, "logprobs")?;
            if k > MAX_TOP_LOGPROBS {
                return Err(out_of_range(
                    "logprobs",
                    &format!("between 0 and {MAX_TOP_LOGPROBS}"),
                    k,
                ));
            }
            base.logprobs = Some(k);
        }
        refuse_unhonoured(
            [
                ("presence_penalty", &self.presence_penalty),
                ("frequency_penalty", &self.frequency_penalty),
            ],
            self.logit_bias.as_ref(),
            None,
        )?;
        let include_usage = self
            .stream_options
            .and_then(|Object(o)| o.include_usage)
            .unwrap_or(false);
        Ok(ParsedCompletion {
            requests: prompts
                .into_iter()
                .map(|prompt| CompletionRequest {
                    prompt,
                    ..base.clone()
                })
                .collect(),
            model: self.model,
            stream: self.stream.unwrap_or(false),
            include_usage,
        })
    }
}

/// Refuses, without tokenizing, a text prompt longer than any tokenization of the context
/// could cover, or a `max_tokens` that leaves no room for a prompt.
pub(super) fn check_completion_context(
    parsed: &ParsedCompletion,
    limits: ContextLimits,
) -> Result<(), ApiError> {
    let max_bytes = limits.max_prompt_bytes();
    for (i, req) in parsed.requests.iter().enumerate() {
        let too_long = match &req.prompt {
            CompletionPrompt::Text(t) => t.len() > max_bytes,
            CompletionPrompt::Tokens(ids) => ids.len() >= limits.context_tokens,
        };
        if too_long {
            return Err(ApiError::context_exceeded(
                format!(
                    "prompt {i} cannot fit this model's context of {} tokens",
                    limits.context_tokens
                ),
                "prompt",
            ));
        }
        if req.strict_max_tokens && req.max_tokens >= limits.context_tokens {
            return Err(ApiError::context_exceeded(
                format!(
                    "`max_tokens` = {} leaves no room for the prompt in this model's context \
                     of {} tokens",
                    req.max_tokens, limits.context_tokens
                ),
                "max_tokens",
            ));
        }
    }
    Ok(())
}

/// The usage of a batch of prompts, OpenAI-shaped.
fn usage_json(responses: &[CompletionResponse]) -> Value {
    let mut u = TokenUsage::default();
    for r in responses {
        u.prompt_tokens += r.usage.prompt_tokens;
        u.completion_tokens += r.usage.completion_tokens;
        u.cached_prompt_tokens += r.usage.cached_prompt_tokens;
    }
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
    })
}

/// The legacy `logprobs` object of `entries` (token text, its log-prob — `None` for the
/// prompt's first token — and the alternatives), offsets counted from `start` characters.
fn legacy_logprobs<'a>(
    entries: impl Iterator<Item = (&'a str, Option<&'a TokenLogprob>)>,
    start: usize,
) -> Value {
    let (mut tokens, mut lps, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
    let mut at = start;
    for (token, lp) in entries {
        tokens.push(json!(token));
        offsets.push(json!(at));
        at += token.chars().count();
        match lp {
            None => {
                lps.push(Value::Null);
                tops.push(Value::Null);
            }
            Some(t) => {
                lps.push(json!(t.logprob));
                let mut top = Map::new();
                for alt in &t.top {
                    top.entry(alt.token.clone()).or_insert(json!(alt.logprob));
                }
                tops.push(Value::Object(top));
            }
        }
    }
    json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}

/// What `echo` adds before a choice: the prompt text, and its tokens' log-probs.
fn echoed(resp: &CompletionResponse) -> Vec<(&str, Option<&TokenLogprob>)> {
    match &resp.prompt_logprobs {
        Some(p) => std::iter::once((p.first_token.as_str(), None))
            .chain(p.rest.iter().map(|t| (t.token.as_str(), Some(t))))
            .collect(),
        None => Vec::new(),
    }
}

/// Choice `index` of the response: its text (after the prompt with `echo`), logprobs and
/// finish reason.
fn choice_json(
    index: usize,
    resp: &CompletionResponse,
    c: &Choice,
    echo: bool,
    logprobs: bool,
) -> Value {
    let text = if echo {
        format!("{}{}", resp.prompt_text, c.content)
    } else {
        c.content.clone()
    };
    let logprobs = if logprobs {
        let prompt = if echo { echoed(resp) } else { Vec::new() };
        let start = if echo {
            0
        } else {
            resp.prompt_text.chars().count()
        };
        let generated = c.logprobs.as_deref().unwrap_or(&[]);
        legacy_logprobs(
            prompt
                .into_iter()
                .chain(generated.iter().map(|t| (t.token.as_str(), Some(t)))),
            start,
        )
    } else {
        Value::Null
    };
    json!({"index": index, "text": text, "logprobs": logprobs,
           "finish_reason": c.finish_reason.as_str()})
}

fn all_choices(parsed: &ParsedCompletion, responses: &[CompletionResponse]) -> Vec<Value> {
    let n = parsed.n();
    responses
        .iter()
        .enumerate()
        .flat_map(|(i, r)| {
            r.choices.iter().enumerate().map(move |(j, c)| {
                choice_json(i * n + j, r, c, parsed.echo(), parsed.logprobs().is_some())
            })
        })
        .collect()
}

/// The route: every prompt of the batch runs at once (the scheduler batches them together).
pub(super) async fn answer(
    state: &AppState,
    parsed: ParsedCompletion,
) -> Result<Response, ApiError> {
    if parsed.stream && !parsed.echo() {
        return live_stream(state, parsed).await;
    }
    let backend = &state.backend;
    let responses =
        futures::future::try_join_all(parsed.requests.iter().map(|r| backend.complete(r, None)))
            .await
            .map_err(|e| ApiError::from_completion_llm(&e))?;
    let stats = ChatStats {
        n: parsed.n() * parsed.requests.len(),
        stream: parsed.stream,
        prompt_tokens: responses.iter().map(|r| r.usage.prompt_tokens).sum(),
        completion_tokens: responses.iter().map(|r| r.usage.completion_tokens).sum(),
    };
    let (id, created, model) = (
        response_id(ResponseKind::Completion),
        unix_now(),
        state.names.id().to_string(),
    );
    let mut response = if parsed.stream {
        // With `echo` the prompt goes first, so the stream is written from the finished
        // answer: per choice its whole text, then its finish.
        let w = Writer { id, created, model };
        let mut events: Vec<Event> = all_choices(&parsed, &responses)
            .into_iter()
            .flat_map(|mut c| {
                let finish = c["finish_reason"].take();
                let index = c["index"].clone();
                [w.event(vec![c], None), w.finish(&index, &finish)]
            })
            .collect();
        if parsed.include_usage {
            events.push(w.event(Vec::new(), Some(usage_json(&responses))));
        }
        events.push(Event::default().data("[DONE]"));
        let stream =
            futures::stream::iter(events.into_iter().map(Ok::<_, std::convert::Infallible>));
        Sse::new(stream).into_response()
    } else {
        Json(json!({
            "id": id, "object": "text_completion", "created": created, "model": model,
            "choices": all_choices(&parsed, &responses),
            "usage": usage_json(&responses),
            "system_fingerprint": null,
        }))
        .into_response()
    };
    response.extensions_mut().insert(stats);
    Ok(response)
}

/// Writes the chunks of one streamed completion.
struct Writer {
    id: String,
    created: u64,
    model: String,
}

impl Writer {
    fn event(&self, choices: Vec<Value>, usage: Option<Value>) -> Event {
        let mut chunk = json!({"id": self.id, "object": "text_completion",
            "created": self.created, "model": self.model, "choices": choices,
            "system_fingerprint": null});
        if let Some(u) = usage {
            chunk["usage"] = u;
        }
        Event::default().data(chunk.to_string())
    }

    fn finish(&self, index: &Value, reason: &Value) -> Event {
        self.event(
            vec![json!({"index": index, "text": "", "logprobs": null, "finish_reason": reason})],
            None,
        )
    }
}

type Responses = Pin<Box<dyn Future<Output = Result<Vec<CompletionResponse>, LlmError>> + Send>>;
type Pieces = Pin<Box<dyn Stream<Item = (usize, String, Vec<TokenLogprob>)> + Send>>;

/// A streamed batch in flight: the generations' future (polled by the response body, so a
/// client that leaves stops them), the pieces of text they send, and the chunks not yet
/// written.
struct Live {
    gen: Option<Responses>,
    pieces: SelectAll<Pieces>,
    writer: Writer,
    n: usize,
    logprobs: bool,
    include_usage: bool,
    /// Text sent so far, per choice.
    sent: Vec<String>,
    queue: VecDeque<Event>,
}

impl Live {
    fn push_piece(&mut self, (index, text, lps): (usize, String, Vec<TokenLogprob>)) {
        let Some(sent) = self.sent.get_mut(index) else {
            return;
        };
        let start = sent.chars().count();
        sent.push_str(&text);
        let logprobs = if self.logprobs {
            legacy_logprobs(lps.iter().map(|t| (t.token.as_str(), Some(t))), start)
        } else {
            Value::Null
        };
        let choice = json!({"index": index, "text": text, "logprobs": logprobs,
                            "finish_reason": null});
        self.queue.push_back(self.writer.event(vec![choice], None));
    }

    fn push_end(&mut self, result: Result<Vec<CompletionResponse>, LlmError>) {
        while let Some(Some(piece)) = self.pieces.next().now_or_never() {
            self.push_piece(piece);
        }
        match result {
            Ok(responses) => {
                for (i, r) in responses.iter().enumerate() {
                    for (j, c) in r.choices.iter().enumerate() {
                        let index = i * self.n + j;
                        // What the pieces did not carry: the rest of the final text.
                        let sent = self.sent.get(index).map_or("", String::as_str);
                        let rest = c.content.strip_prefix(sent).unwrap_or("").to_string();
                        if !rest.is_empty() {
                            self.push_piece((index, rest, Vec::new()));
                        }
                        let reason = json!(c.finish_reason.as_str());
                        self.queue
                            .push_back(self.writer.finish(&json!(index), &reason));
                    }
                }
                if self.include_usage {
                    let usage = usage_json(&responses);
                    self.queue
                        .push_back(self.writer.event(Vec::new(), Some(usage)));
                }
                self.queue.push_back(Event::default().data("[DONE]"));
            }
            Err(e) => self.queue.push_back(super::stream::error_event(&e)),
        }
    }

    async fn next(&mut self) -> Option<Event> {
        loop {
            if let Some(ev) = self.queue.pop_front() {
                return Some(ev);
            }
            let gen = self.gen.as_mut()?;
            tokio::select! {
                biased;
                Some(piece) = self.pieces.next() => self.push_piece(piece),
                result = gen => {
                    self.gen = None;
                    self.push_end(result);
                }
            }
        }
    }
}

/// Token-by-token streaming of a batch: each prompt's pieces go out as its choices' chunks.
/// An error before the first piece is an ordinary JSON error with its status.
async fn live_stream(state: &AppState, parsed: ParsedCompletion) -> Result<Response, ApiError> {
    let n = parsed.n();
    let mut pieces = SelectAll::new();
    let mut gens = Vec::with_capacity(parsed.requests.len());
    for (i, req) in parsed.requests.iter().cloned().enumerate() {
        let (sink, mut rx) = DeltaSink::channel();
        let offset: Pieces = Box::pin(
            futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
                .map(move |(j, text, lps): Delta| (i * n + j, text, lps)),
        );
        pieces.push(offset);
        let backend = state.backend.clone();
        gens.push(async move { backend.complete(&req, Some(&sink)).await });
    }
    let gen: Responses = Box::pin(futures::future::try_join_all(gens));
    let mut live = Live {
        gen: Some(gen),
        pieces,
        writer: Writer {
            id: response_id(ResponseKind::Completion),
            created: unix_now(),
            model: state.names.id().to_string(),
        },
        n,
        logprobs: parsed.logprobs().is_some(),
        include_usage: parsed.include_usage,
        sent: vec![String::new(); n * parsed.requests.len()],
        queue: VecDeque::new(),
    };
    if let Some(gen) = live.gen.as_mut() {
        tokio::select! {
            biased;
            Some(piece) = live.pieces.next() => live.push_piece(piece),
            result = gen => {
                live.gen = None;
                match result {
                    Err(e) => return Err(ApiError::from_completion_llm(&e)),
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
        n: n * parsed.requests.len(),
        stream: true,
        prompt_tokens: 0,
        completion_tokens: 0,
    });
    Ok(response)
}
