//! A fault-injecting OpenAI-compatible chat server on 127.0.0.1 (port 0), for tests.
//!
//! Normal requests get a valid `chat.completion` with `n` choices and usage. Faults come, in
//! this order of precedence, from a queue (one per request: `push_faults`), a fault applied to
//! every request (`set_always`), or a seeded random draw (`set_fault_rate`). Every request is
//! counted and logged (arrival time, `Authorization` header, JSON body, fault applied).
//!
//! ```ignore
//! let server = FaultServer::start().await;
//! server.push_faults([Fault::RateLimit(Some("1".into()))]);
//! let backend = OpenAiBackend::new("m", Some(&server.base_url), &opts)?;
//! ```

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

/// What the server does to one request.
#[derive(Clone, Debug, PartialEq)]
pub enum Fault {
    /// HTTP 429, with this `Retry-After` header value when given.
    RateLimit(Option<String>),
    /// This HTTP status with an OpenAI-style JSON error body.
    Status(u16),
    /// This status, with an error message that echoes the request's `Authorization` header
    /// (a careless server), to check that the key never leaks into errors.
    EchoAuth(u16),
    /// Sleeps this long, then answers normally (use a duration past the client's timeout).
    Hang(Duration),
    /// Sleeps this long, then answers normally (for concurrency checks).
    Delay(Duration),
    /// HTTP 200 with a body that is not JSON.
    Malformed,
    /// HTTP 200, valid JSON, every choice with content "".
    EmptyContent,
    /// HTTP 200, one choice fewer than `n`.
    FewerChoices,
    /// HTTP 200 with `finish_reason: "eos_token"` (unknown to the OpenAI schema).
    OddFinishReason,
}

/// One received request.
#[derive(Clone, Debug)]
pub struct Received {
    /// Time since the server started.
    pub at: Duration,
    pub authorization: Option<String>,
    pub body: Value,
    pub fault: Option<Fault>,
}

/// Builds the content of choice `i` for a request body (replaces the default echo).
pub type Responder = Arc<dyn Fn(&Value, usize) -> String + Send + Sync>;

struct RandomFaults {
    rate: f64,
    rng: StdRng,
    kinds: Vec<Fault>,
}

struct Shared {
    started: Instant,
    requests: AtomicUsize,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    queue: Mutex<VecDeque<Fault>>,
    always: Mutex<Option<Fault>>,
    random: Mutex<Option<RandomFaults>>,
    log: Mutex<Vec<Received>>,
    responder: Mutex<Option<Responder>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

pub struct FaultServer {
    /// `http://127.0.0.1:<port>/v1`
    pub base_url: String,
    pub addr: std::net::SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FaultServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FaultServer {
    pub async fn start() -> FaultServer {
        let shared = Arc::new(Shared {
            started: Instant::now(),
            requests: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
            queue: Mutex::new(VecDeque::new()),
            always: Mutex::new(None),
            random: Mutex::new(None),
            log: Mutex::new(Vec::new()),
            responder: Mutex::new(None),
        });
        let app = Router::new()
            .route("/v1/chat/completions", post(handle))
            .route("/chat/completions", post(handle))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("local addr");
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        FaultServer {
            base_url: format!("http://{addr}/v1"),
            addr,
            shared,
            task,
        }
    }

    /// Faults for the next requests, one each, in order; later requests are normal.
    pub fn push_faults(&self, faults: impl IntoIterator<Item = Fault>) {
        lock(&self.shared.queue).extend(faults);
    }

    /// A fault for every request (after the queue is drained); `None` to stop.
    pub fn set_always(&self, fault: Option<Fault>) {
        *lock(&self.shared.always) = fault;
    }

    /// Each request (not served by the queue or `always`) gets, with probability `rate`, a
    /// fault drawn uniformly from `kinds`, from an RNG seeded with `seed`.
    pub fn set_fault_rate(&self, rate: f64, seed: u64, kinds: Vec<Fault>) {
        assert!(!kinds.is_empty(), "at least one kind of fault");
        *lock(&self.shared.random) = Some(RandomFaults {
            rate,
            rng: StdRng::seed_from_u64(seed),
            kinds,
        });
    }

    /// Removes every configured fault.
    pub fn clear_faults(&self) {
        lock(&self.shared.queue).clear();
        *lock(&self.shared.always) = None;
        *lock(&self.shared.random) = None;
    }

    /// Replaces the default reply text (`"reply <request#>.<i> seed=<seed>: <last message>"`).
    pub fn set_responder(&self, f: impl Fn(&Value, usize) -> String + Send + Sync + 'static) {
        *lock(&self.shared.responder) = Some(Arc::new(f));
    }

    /// Requests received so far (faulty ones included).
    pub fn requests(&self) -> usize {
        self.shared.requests.load(Ordering::SeqCst)
    }

    /// Most requests being handled at the same time so far.
    pub fn max_in_flight(&self) -> usize {
        self.shared.max_in_flight.load(Ordering::SeqCst)
    }

    pub fn received(&self) -> Vec<Received> {
        lock(&self.shared.log).clone()
    }

    pub fn last(&self) -> Option<Received> {
        lock(&self.shared.log).last().cloned()
    }

    /// Requests that were answered with a fault.
    pub fn faults_served(&self) -> usize {
        lock(&self.shared.log)
            .iter()
            .filter(|r| r.fault.is_some())
            .count()
    }
}

fn next_fault(s: &Shared) -> Option<Fault> {
    if let Some(f) = lock(&s.queue).pop_front() {
        return Some(f);
    }
    if let Some(f) = lock(&s.always).clone() {
        return Some(f);
    }
    let mut random = lock(&s.random);
    let r = random.as_mut()?;
    if r.rng.random::<f64>() < r.rate {
        let k = r.rng.random_range(0..r.kinds.len());
        return Some(r.kinds[k].clone());
    }
    None
}

struct InFlight<'a>(&'a Shared);

impl<'a> InFlight<'a> {
    fn enter(s: &'a Shared) -> Self {
        let now = s.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        s.max_in_flight.fetch_max(now, Ordering::SeqCst);
        InFlight(s)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

fn error_body(status: u16, message: &str) -> Response {
    let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body =
        json!({"error": {"message": message, "type": "test_fault", "param": null, "code": null}});
    (
        code,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

async fn handle(State(s): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    let _guard = InFlight::enter(&s);
    let number = s.requests.fetch_add(1, Ordering::SeqCst) + 1;
    let authorization = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let fault = next_fault(&s);
    lock(&s.log).push(Received {
        at: s.started.elapsed(),
        authorization: authorization.clone(),
        body: body.clone(),
        fault: fault.clone(),
    });
    if !body.is_object() {
        return error_body(400, "request body is not a JSON object");
    }
    match &fault {
        Some(Fault::RateLimit(retry_after)) => {
            let mut resp = error_body(429, "rate limited (injected)");
            if let Some(v) = retry_after {
                if let Ok(v) = v.parse() {
                    resp.headers_mut().insert(header::RETRY_AFTER, v);
                }
            }
            return resp;
        }
        Some(Fault::Status(code)) => return error_body(*code, "injected failure"),
        Some(Fault::EchoAuth(code)) => {
            let msg = format!("invalid credentials: {}", authorization.unwrap_or_default());
            return error_body(*code, &msg);
        }
        Some(Fault::Hang(d)) | Some(Fault::Delay(d)) => tokio::time::sleep(*d).await,
        Some(Fault::Malformed) => {
            return (
                StatusCode::OK,
                [(header::CONTENT_TYPE, "application/json")],
                "<html>this is not json",
            )
                .into_response()
        }
        _ => {}
    }
    let responder = lock(&s.responder).clone();
    let n = body["n"].as_u64().unwrap_or(1).max(1) as usize;
    let shown = if fault == Some(Fault::FewerChoices) {
        n - 1
    } else {
        n
    };
    let last = body["messages"]
        .as_array()
        .and_then(|m| m.last())
        .and_then(|m| m["content"].as_str())
        .unwrap_or("")
        .to_string();
    let json_mode = body["response_format"]["type"] == "json_object";
    let finish = match (&fault, body["max_tokens"].as_u64()) {
        (Some(Fault::OddFinishReason), _) => "eos_token",
        (_, Some(m)) if m <= 2 => "length",
        _ => "stop",
    };
    let choices: Vec<Value> = (0..shown)
        .map(|i| {
            let content = if fault == Some(Fault::EmptyContent) {
                String::new()
            } else if let Some(f) = &responder {
                f(&body, i)
            } else if json_mode {
                json!({"thought": "fine", "score": 1, "request": number, "sample": i}).to_string()
            } else {
                format!("reply {number}.{i} seed={}: {last}", body["seed"])
            };
            json!({
                "index": i,
                "message": {"role": "assistant", "content": content},
                "finish_reason": finish,
                "logprobs": null
            })
        })
        .collect();
    let prompt_tokens: usize = body["messages"]
        .as_array()
        .map(|ms| {
            ms.iter()
                .map(|m| {
                    m["content"]
                        .as_str()
                        .unwrap_or("")
                        .split_whitespace()
                        .count()
                })
                .sum()
        })
        .unwrap_or(0);
    let completion_tokens = 7 * shown;
    let reply = json!({
        "id": format!("chatcmpl-{number}"),
        "object": "chat.completion",
        "created": 1_700_000_000u32,
        "model": body["model"],
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens
        }
    });
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        reply.to_string(),
    )
        .into_response()
}
