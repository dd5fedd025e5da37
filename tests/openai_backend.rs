//! `OpenAiBackend` against a local fault-injecting OpenAI-compatible server (real HTTP through
//! async-openai on 127.0.0.1).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use collabllm::llm::{
    ChatBackend, ChatMessage, ChatRequest, EndpointOptions, FinishReason, LlmError, OpenAiBackend,
};
use common::fault_server::{Fault, FaultServer};

/// Options with tiny delays; `api_key_env` names a variable no test sets.
fn opts(max_retries: u32, timeout_s: f64) -> EndpointOptions {
    EndpointOptions {
        api_key_env: "COLLABLLM_TEST_KEY_NEVER_SET".into(),
        max_concurrency: 8,
        timeout_s,
        max_retries,
        backoff_base_s: 0.01,
        backoff_max_s: 0.05,
    }
}

fn req(text: &str) -> ChatRequest {
    ChatRequest::new(vec![
        ChatMessage::system("You are terse."),
        ChatMessage::user(text),
    ])
    .max_tokens(64)
}

fn backend(server: &FaultServer, o: &EndpointOptions) -> Arc<OpenAiBackend> {
    OpenAiBackend::new("test-model", Some(&server.base_url), o).expect("backend")
}

/// Upper bound on a failing call: every wait at the cap, every attempt at the timeout.
fn cap(o: &EndpointOptions) -> Duration {
    let attempts = f64::from(o.max_retries + 1);
    Duration::from_secs_f64(
        f64::from(o.max_retries) * o.backoff_max_s + attempts * o.timeout_s + 1.0,
    )
}

#[tokio::test]
async fn success_n3_maps_request_and_response() {
    let server = FaultServer::start().await;
    std::env::set_var("COLLABLLM_TEST_KEY_SUCCESS", "sk-test-visible-4242");
    let o = EndpointOptions {
        api_key_env: "COLLABLLM_TEST_KEY_SUCCESS".into(),
        ..opts(0, 5.0)
    };
    let b = backend(&server, &o);
    let r = req("two plus two")
        .n(3)
        .temperature(0.7)
        .top_p(0.9)
        .seed(11)
        .stop(vec!["\n\n".into()]);
    let resp = b.chat(&r).await.expect("chat");
    assert_eq!(resp.choices.len(), 3);
    for (i, c) in resp.choices.iter().enumerate() {
        assert_eq!(c.index, i);
        assert!(c.content.ends_with("two plus two"), "{}", c.content);
        assert_eq!(c.finish_reason, FinishReason::Stop);
    }
    assert_eq!(resp.usage.prompt_tokens, 6);
    assert_eq!(resp.usage.completion_tokens, 21);
    assert_eq!(resp.retries, 0);
    assert!(!resp.cached);
    assert_eq!(resp.model, "test-model");
    assert_eq!(b.id().kind, "openai");
    assert_eq!(b.id().endpoint, server.base_url);

    assert_eq!(server.requests(), 1);
    let got = server.last().expect("a request");
    assert_eq!(
        got.authorization.as_deref(),
        Some("Bearer sk-test-visible-4242")
    );
    let body = got.body;
    assert_eq!(body["model"], "test-model");
    assert_eq!(body["n"], 3);
    assert_eq!(body["max_tokens"], 64);
    assert!(body.get("max_completion_tokens").is_none());
    assert_eq!(body["seed"], 11);
    assert_eq!(body["stop"], serde_json::json!(["\n\n"]));
    assert!((body["temperature"].as_f64().unwrap() - 0.7).abs() < 1e-6);
    assert!((body["top_p"].as_f64().unwrap() - 0.9).abs() < 1e-6);
    assert_eq!(body["messages"][0]["role"], "system");
    assert_eq!(body["messages"][1]["role"], "user");
    assert_eq!(body["messages"][1]["content"], "two plus two");
    assert!(body.get("response_format").is_none());
    assert!(body.get("stream").is_none() || body["stream"] == false);
}

#[tokio::test]
async fn json_mode_sets_response_format_and_no_key_sends_no_authorization() {
    let server = FaultServer::start().await;
    let b = backend(&server, &opts(0, 5.0));
    let resp = b
        .chat(&req("score it").json_mode(true))
        .await
        .expect("chat");
    let v: serde_json::Value = serde_json::from_str(&resp.choices[0].content).expect("json");
    assert_eq!(v["score"], 1);
    let got = server.last().expect("a request");
    assert_eq!(got.body["response_format"]["type"], "json_object");
    assert_eq!(got.authorization, None);
}

#[tokio::test]
async fn finish_reasons_length_and_unknown() {
    let server = FaultServer::start().await;
    let b = backend(&server, &opts(0, 5.0));
    let resp = b.chat(&req("x").max_tokens(2)).await.expect("chat");
    assert_eq!(resp.choices[0].finish_reason, FinishReason::Length);
    server.push_faults([Fault::OddFinishReason]);
    let resp = b
        .chat(&req("x"))
        .await
        .expect("unknown finish_reason is tolerated");
    assert_eq!(resp.choices[0].finish_reason, FinishReason::Stop);
    assert_eq!(resp.retries, 0);
}

#[tokio::test]
async fn retry_after_is_honoured() {
    let server = FaultServer::start().await;
    server.push_faults([Fault::RateLimit(Some("1".into()))]);
    let o = EndpointOptions {
        backoff_max_s: 5.0,
        ..opts(3, 5.0)
    };
    let b = backend(&server, &o);
    let resp = b
        .chat(&req("hello"))
        .await
        .expect("succeeds after one retry");
    assert_eq!(resp.retries, 1);
    assert_eq!(server.requests(), 2);
    let log = server.received();
    let gap = log[1].at - log[0].at;
    assert!(gap >= Duration::from_secs(1), "waited only {gap:?}");
    assert!(gap < Duration::from_secs(3), "waited {gap:?}");
}

#[tokio::test]
async fn retry_after_is_capped_by_backoff_max() {
    let server = FaultServer::start().await;
    server.push_faults([Fault::RateLimit(Some("30".into()))]);
    let b = backend(&server, &opts(3, 5.0));
    let t = Instant::now();
    let resp = b.chat(&req("hello")).await.expect("succeeds");
    assert_eq!(resp.retries, 1);
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
}

#[tokio::test]
async fn always_500_is_server_error_after_max_retries_plus_one() {
    let server = FaultServer::start().await;
    server.set_always(Some(Fault::Status(500)));
    let o = opts(3, 2.0);
    let b = backend(&server, &o);
    let t = Instant::now();
    let err = b.chat(&req("hello")).await.expect_err("fails");
    match &err {
        LlmError::Server {
            endpoint,
            status,
            attempts,
            ..
        } => {
            assert_eq!(*status, 500);
            assert_eq!(*attempts, 4);
            assert_eq!(endpoint, &server.base_url);
        }
        other => panic!("expected Server, got {other:?}"),
    }
    assert!(err.is_transient());
    assert_eq!(server.requests(), 4);
    assert!(t.elapsed() <= cap(&o), "{:?}", t.elapsed());
}

#[tokio::test]
async fn always_429_is_rate_limited() {
    let server = FaultServer::start().await;
    server.set_always(Some(Fault::RateLimit(None)));
    let b = backend(&server, &opts(2, 2.0));
    let err = b.chat(&req("hello")).await.expect_err("fails");
    assert!(
        matches!(err, LlmError::RateLimited { attempts: 3, .. }),
        "{err:?}"
    );
    assert_eq!(server.requests(), 3);
}

#[tokio::test]
async fn hang_is_timeout() {
    let server = FaultServer::start().await;
    server.set_always(Some(Fault::Hang(Duration::from_secs(10))));
    let o = opts(2, 0.2);
    let b = backend(&server, &o);
    let t = Instant::now();
    let err = b.chat(&req("hello")).await.expect_err("times out");
    assert!(
        matches!(err, LlmError::Timeout { attempts: 3, .. }),
        "{err:?}"
    );
    let elapsed = t.elapsed();
    assert!(elapsed >= Duration::from_millis(600), "{elapsed:?}");
    assert!(elapsed <= cap(&o), "{elapsed:?}");
    assert_eq!(server.requests(), 3);
}

#[tokio::test]
async fn malformed_body_is_malformed_response() {
    let server = FaultServer::start().await;
    server.set_always(Some(Fault::Malformed));
    let b = backend(&server, &opts(1, 2.0));
    let err = b.chat(&req("hello")).await.expect_err("fails");
    assert!(
        matches!(err, LlmError::MalformedResponse { attempts: 2, .. }),
        "{err:?}"
    );
    assert_eq!(server.requests(), 2);
}

#[tokio::test]
async fn empty_content_is_empty_reply() {
    let server = FaultServer::start().await;
    server.set_always(Some(Fault::EmptyContent));
    let b = backend(&server, &opts(1, 2.0));
    let err = b.chat(&req("hello")).await.expect_err("fails");
    assert!(
        matches!(err, LlmError::EmptyReply { attempts: 2, .. }),
        "{err:?}"
    );
    assert_eq!(server.requests(), 2);
}

#[tokio::test]
async fn transient_faults_then_success_counts_retries() {
    let server = FaultServer::start().await;
    server.push_faults([
        Fault::Malformed,
        Fault::EmptyContent,
        Fault::FewerChoices,
        Fault::Status(503),
    ]);
    let b = backend(&server, &opts(4, 2.0));
    let resp = b.chat(&req("hello").n(2)).await.expect("succeeds");
    assert_eq!(resp.retries, 4);
    assert_eq!(resp.choices.len(), 2);
    assert_eq!(server.requests(), 5);
}

#[tokio::test]
async fn bad_request_is_rejected_without_retry() {
    let server = FaultServer::start().await;
    server.set_always(Some(Fault::Status(400)));
    let b = backend(&server, &opts(3, 2.0));
    let err = b.chat(&req("hello")).await.expect_err("fails");
    assert!(
        matches!(err, LlmError::Rejected { status: 400, .. }),
        "{err:?}"
    );
    assert!(!err.is_transient());
    assert_eq!(server.requests(), 1);
}

#[tokio::test]
async fn api_key_never_appears_in_errors() {
    let server = FaultServer::start().await;
    let key = "sk-test-secret-ZX81-do-not-leak";
    std::env::set_var("COLLABLLM_TEST_KEY_LEAK", key);
    let o = EndpointOptions {
        api_key_env: "COLLABLLM_TEST_KEY_LEAK".into(),
        ..opts(1, 2.0)
    };
    // Capture every log line (async-openai's included) emitted on this thread.
    let logs = Arc::new(std::sync::Mutex::new(Vec::<u8>::new()));
    let sink = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(false)
        .with_writer(move || LogSink(sink.clone()))
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let b = backend(&server, &o);
    assert!(!format!("{b:?}").contains(key));
    for fault in [Fault::EchoAuth(401), Fault::EchoAuth(500)] {
        server.set_always(Some(fault));
        let err = b.chat(&req("hello")).await.expect_err("fails");
        let shown = format!("{err} {err:?}");
        assert!(!shown.contains(key), "key leaked: {shown}");
        assert!(shown.contains("invalid credentials"), "{shown}");
    }
    let got = server.last().expect("a request");
    assert_eq!(got.authorization, Some(format!("Bearer {key}")));
    let logs = String::from_utf8_lossy(&logs.lock().unwrap()).into_owned();
    assert!(
        logs.contains("invalid credentials"),
        "logs were captured: {logs}"
    );
    assert!(!logs.contains(key), "key leaked into logs: {logs}");
}

struct LogSink(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for LogSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn connection_refused_is_connection_error() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let base = format!("http://{addr}/v1");
    let b = OpenAiBackend::new("m", Some(&base), &opts(1, 2.0)).unwrap();
    let t = Instant::now();
    let err = b.chat(&req("hello")).await.expect_err("fails");
    assert!(
        matches!(err, LlmError::Connection { attempts: 2, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains(&base), "{err}");
    assert!(t.elapsed() < Duration::from_secs(3));
}

#[tokio::test]
async fn invalid_requests_fail_before_any_http() {
    let server = FaultServer::start().await;
    let b = backend(&server, &opts(3, 2.0));
    let bad = ChatRequest::new(vec![ChatMessage::new("wizard", "hi")]);
    assert!(matches!(
        b.chat(&bad).await,
        Err(LlmError::InvalidRequest(_))
    ));
    assert!(matches!(
        b.chat(&req("x").n(0)).await,
        Err(LlmError::InvalidRequest(_))
    ));
    let long_stop = req("x").stop(vec!["y".repeat(collabllm::llm::MAX_STOP_BYTES + 1)]);
    match b.chat(&long_stop).await {
        Err(LlmError::InvalidRequest(msg)) => assert!(msg.contains("`stop`"), "{msg}"),
        other => panic!("a stop string over the limit was not refused: {other:?}"),
    }
    assert!(b
        .chat(&req("x").stop(vec!["y".repeat(collabllm::llm::MAX_STOP_BYTES)]))
        .await
        .is_ok());
    assert_eq!(
        server.requests(),
        1,
        "only the request within the limit was sent"
    );
    let o = EndpointOptions {
        timeout_s: -1.0,
        ..opts(0, 1.0)
    };
    assert!(OpenAiBackend::new("m", Some(&server.base_url), &o).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_limit_is_shared_per_endpoint() {
    let server = FaultServer::start().await;
    server.set_always(Some(Fault::Delay(Duration::from_millis(80))));
    let o = EndpointOptions {
        max_concurrency: 1,
        ..opts(0, 5.0)
    };
    // No `/v1`: a base URL no other test in this process registers a limit for.
    let base = format!("http://{}", server.addr);
    let a = OpenAiBackend::new("test-model", Some(&base), &o).unwrap();
    // A second role on the same endpoint asks for more; the first registration wins.
    let more = EndpointOptions {
        max_concurrency: 8,
        ..o.clone()
    };
    let b = OpenAiBackend::new("other-model", Some(&base), &more).unwrap();
    let mut tasks = Vec::new();
    for i in 0..6 {
        let be = if i % 2 == 0 { a.clone() } else { b.clone() };
        tasks.push(tokio::spawn(async move {
            be.chat(&req(&format!("q{i}"))).await
        }));
    }
    for t in tasks {
        t.await.unwrap().expect("chat");
    }
    assert_eq!(server.requests(), 6);
    assert_eq!(server.max_in_flight(), 1);
}

#[tokio::test]
async fn random_fault_rate_is_absorbed_by_retries() {
    let server = FaultServer::start().await;
    server.set_fault_rate(
        0.3,
        7,
        vec![
            Fault::Status(500),
            Fault::Malformed,
            Fault::RateLimit(Some("0".into())),
            Fault::EmptyContent,
            Fault::Hang(Duration::from_secs(5)),
        ],
    );
    let b = backend(&server, &opts(8, 0.3));
    let mut retries = 0;
    for i in 0..30 {
        let resp = b.chat(&req(&format!("q{i}"))).await.expect("absorbed");
        retries += resp.retries as usize;
    }
    assert!(server.faults_served() > 0);
    assert_eq!(retries, server.faults_served());
    assert_eq!(server.requests(), 30 + retries);
}

/// An endpoint pool with one dead member (nothing listens on its port): every call completes
/// on the live server, the dead endpoint is backed off after its first failure, and calls
/// are counted per endpoint; a request the only member up rejects fails at once (no wait
/// for the backed-off one).
#[tokio::test]
async fn a_pool_with_a_dead_endpoint_completes_every_call() {
    use collabllm::llm::pool::{EndpointStats, PoolBackend};
    let live = FaultServer::start().await;
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}/v1", l.local_addr().unwrap())
    };
    let urls = [dead.as_str(), live.base_url.as_str()];
    let o = EndpointOptions {
        backoff_base_s: 30.0,
        backoff_max_s: 60.0,
        ..opts(3, 5.0)
    };
    let pool = PoolBackend::new("scripted", &urls, &o).unwrap();
    assert!(pool.id().endpoint.contains(','), "{}", pool.id());
    let started = Instant::now();
    for i in 0..12 {
        let resp = pool.chat(&req(&format!("question {i}"))).await.unwrap();
        assert_eq!(resp.choices.len(), 1);
    }
    let stats = pool.stats();
    let (d, l) = (&stats[0], &stats[1]);
    assert_eq!((d.calls, d.failures), (1, 1), "{stats:?}");
    assert_eq!((l.calls, l.failures), (12, 0), "{stats:?}");
    assert!(started.elapsed() < Duration::from_secs(10));

    live.set_always(Some(Fault::Status(400)));
    let calls = |s: &[EndpointStats]| s.iter().map(|x| x.calls).sum::<u64>();
    let before = calls(&pool.stats());
    let e = pool.chat(&req("bad")).await.unwrap_err();
    assert!(matches!(e, LlmError::Rejected { .. }), "{e}");
    assert_eq!(calls(&pool.stats()) - before, 1);
}

/// A member that refuses (a wrong key: 401; a 400 only it gives) does not fail the call: it
/// goes to another member, and a 401 member is backed off. A request every member refuses
/// fails after one call to each.
#[tokio::test]
async fn a_pool_member_that_refuses_moves_the_call_to_another() {
    use collabllm::llm::pool::PoolBackend;
    let (bad, good) = (FaultServer::start().await, FaultServer::start().await);
    let urls = [bad.base_url.as_str(), good.base_url.as_str()];
    let o = EndpointOptions {
        backoff_base_s: 30.0,
        backoff_max_s: 60.0,
        ..opts(3, 5.0)
    };
    let pool = PoolBackend::new("scripted", &urls, &o).unwrap();
    bad.set_always(Some(Fault::Status(401)));
    for i in 0..6 {
        pool.chat(&req(&format!("q {i}"))).await.unwrap();
    }
    let stats = pool.stats();
    assert_eq!(
        (stats[0].calls, stats[0].failures),
        (1, 1),
        "backed off: {stats:?}"
    );
    assert_eq!((stats[1].calls, stats[1].failures), (6, 0), "{stats:?}");

    let pool = PoolBackend::new("scripted", &urls, &o).unwrap();
    bad.set_always(Some(Fault::Status(400)));
    for i in 0..4 {
        pool.chat(&req(&format!("r {i}"))).await.unwrap();
    }
    let stats = pool.stats();
    assert_eq!(stats[1].failures, 0, "{stats:?}");
    assert_eq!(
        stats[0].calls + stats[1].calls - stats[0].failures,
        4,
        "{stats:?}"
    );

    good.set_always(Some(Fault::Status(400)));
    let before: u64 = pool.stats().iter().map(|s| s.calls).sum();
    let e = pool.chat(&req("bad everywhere")).await.unwrap_err();
    assert!(matches!(e, LlmError::Rejected { status: 400, .. }), "{e}");
    let after: u64 = pool.stats().iter().map(|s| s.calls).sum();
    assert_eq!(after - before, 2, "one call to each member");
}
