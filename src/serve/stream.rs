//! Server-sent events of a streamed completion: the chunks of a finished reply, or live ones
//! as the local backend decodes, with the usage chunk when asked and `[DONE]` last.

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use std::future::Future;

use super::{
    logprobs_json, logprobs_object, response_id, unix_now, ApiError, AppState, ChatStats, Chunk,
    ParsedRequest, ResponseKind, Usage,
};
use crate::llm::{ChatResponse, Delta, LlmError, TokenLogprob};

/// Writes the chunks of one streamed completion.
#[derive(Clone)]
pub(super) struct ChunkWriter {
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
pub(super) fn stream_response(
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

/// A stream's failure after its status line is long gone: the error goes in the stream,
/// OpenAI-shaped.
pub(super) fn error_event(e: &LlmError) -> Event {
    let err = ApiError::from_llm(e).capped();
    tracing::warn!(error = %err.message, "stream failed");
    let body = json!({"error": {"message": err.message, "type": err.kind,
                                "param": err.param, "code": err.code}});
    Event::default().data(body.to_string())
}

type ChatFuture = std::pin::Pin<Box<dyn Future<Output = Result<ChatResponse, LlmError>> + Send>>;

/// A streamed completion in flight: the generation's future (polled by the response body,
/// so a client that disconnects drops it and the generation stops at the next token), the
/// text it sends, and the chunks not yet written.
pub(super) struct LiveStream {
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
            Err(e) => self.queue.push_back(error_event(&e)),
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
pub(super) async fn live_stream(
    state: &AppState,
    parsed: &ParsedRequest,
) -> Result<Response, ApiError> {
    let (sink, rx) = crate::llm::DeltaSink::channel();
    let backend = state.backend.clone();
    let request = parsed.request.clone();
    let gen: ChatFuture = Box::pin(async move { backend.chat_stream(&request, &sink).await });
    let mut live = LiveStream {
        gen: Some(gen),
        rx,
        writer: ChunkWriter {
            id: response_id(ResponseKind::Chat),
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
