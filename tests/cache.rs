//! `CachedBackend<OpenAiBackend>` against the local fault server: hits make no HTTP call.

mod common;

use std::io::Write;
use std::sync::Arc;

use collabllm::llm::cache::CACHE_FILE_NAME;
use collabllm::llm::{
    CachedBackend, ChatBackend, ChatMessage, ChatRequest, EndpointOptions, OpenAiBackend,
    RequestCache,
};
use common::fault_server::{Fault, FaultServer};

fn opts() -> EndpointOptions {
    EndpointOptions {
        api_key_env: "COLLABLLM_TEST_KEY_NEVER_SET".into(),
        max_concurrency: 4,
        timeout_s: 5.0,
        max_retries: 0,
        backoff_base_s: 0.01,
        backoff_max_s: 0.05,
    }
}

fn cached(server: &FaultServer, cache: &Arc<RequestCache>) -> CachedBackend<OpenAiBackend> {
    let inner = OpenAiBackend::new("test-model", Some(&server.base_url), &opts()).unwrap();
    CachedBackend::new(inner, cache.clone())
}

fn requests() -> Vec<ChatRequest> {
    (0..3)
        .map(|i| {
            ChatRequest::new(vec![
                ChatMessage::system("sys"),
                ChatMessage::user(format!("question {i}")),
            ])
            .n(2)
            .temperature(0.8)
            .max_tokens(32)
        })
        .collect()
}

#[tokio::test]
async fn second_identical_run_makes_zero_http_calls() {
    let server = FaultServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let cache = RequestCache::open(dir.path()).unwrap();
    let b = cached(&server, &cache);
    let mut first = Vec::new();
    for r in requests() {
        let resp = b.chat(&r).await.unwrap();
        assert!(!resp.cached);
        assert!(resp.usage.completion_tokens > 0);
        first.push(resp.choices);
    }
    assert_eq!(server.requests(), 3);
    assert_eq!(cache.len(), 6);

    for (r, want) in requests().iter().zip(&first) {
        let resp = b.chat(r).await.unwrap();
        assert!(resp.cached);
        assert_eq!(resp.usage.prompt_tokens + resp.usage.completion_tokens, 0);
        assert_eq!(&resp.choices, want);
    }
    assert_eq!(server.requests(), 3, "second run must not reach the server");

    // A new process: the same file, reopened.
    drop(b);
    drop(cache);
    let cache = RequestCache::open(dir.path()).unwrap();
    assert_eq!(cache.len(), 6);
    let b = cached(&server, &cache);
    for (r, want) in requests().iter().zip(&first) {
        assert_eq!(&b.chat(r).await.unwrap().choices, want);
    }
    assert_eq!(server.requests(), 3);
}

#[tokio::test]
async fn different_sampling_params_miss() {
    let server = FaultServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let cache = RequestCache::open(dir.path().join("c.log")).unwrap();
    let b = cached(&server, &cache);
    let base = requests().remove(0);
    b.chat(&base).await.unwrap();
    let variants = [
        base.clone().temperature(0.0),
        base.clone().top_p(0.5),
        base.clone().max_tokens(33),
        base.clone().seed(1),
        base.clone().stop(vec!["END".into()]),
        base.clone().json_mode(true),
        ChatRequest {
            messages: vec![ChatMessage::user("question 0")],
            ..base.clone()
        },
    ];
    for (k, v) in variants.iter().enumerate() {
        let resp = b.chat(v).await.unwrap();
        assert!(!resp.cached);
        assert_eq!(server.requests(), k + 2);
    }
    // Another model on the same endpoint misses too.
    let other = OpenAiBackend::new("other-model", Some(&server.base_url), &opts()).unwrap();
    CachedBackend::new(other, cache.clone())
        .chat(&base)
        .await
        .unwrap();
    assert_eq!(server.requests(), variants.len() + 2);
    assert!(b.chat(&base).await.unwrap().cached);
}

#[tokio::test]
async fn survives_a_torn_record() {
    let server = FaultServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let cache = RequestCache::open(dir.path()).unwrap();
    let b = cached(&server, &cache);
    let [r0, r1, r2]: [ChatRequest; 3] = requests().try_into().unwrap();
    let want0 = b.chat(&r0).await.unwrap().choices;
    drop(b);
    drop(cache);

    // A crash in the middle of appending a record.
    let path = dir.path().join(CACHE_FILE_NAME);
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap();
    f.write_all(b"1a2b3c4d\t{\"key\":\"0123abcd\",\"value\":{\"index\":0,\"cont")
        .unwrap();
    drop(f);

    let cache = RequestCache::open(dir.path()).unwrap();
    assert_eq!(cache.len(), 2);
    assert_eq!(cache.skipped_records(), 1);
    let b = cached(&server, &cache);
    let resp = b.chat(&r0).await.unwrap();
    assert!(resp.cached);
    assert_eq!(resp.choices, want0);
    assert_eq!(server.requests(), 1);
    let want1 = b.chat(&r1).await.unwrap().choices;
    assert_eq!(server.requests(), 2);
    drop(b);
    drop(cache);

    let cache = RequestCache::open(dir.path()).unwrap();
    assert_eq!(cache.len(), 4, "records written after the torn one load");
    let b = cached(&server, &cache);
    assert_eq!(b.chat(&r1).await.unwrap().choices, want1);
    b.chat(&r2).await.unwrap();
    assert_eq!(server.requests(), 3);
}

#[tokio::test]
async fn n3_then_n5_asks_only_for_the_missing_tail() {
    let server = FaultServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let cache = RequestCache::open(dir.path()).unwrap();
    let b = cached(&server, &cache);
    let r = requests().remove(0).seed(5);

    let three = b.chat(&r.clone().n(3)).await.unwrap();
    let sent = server.last().unwrap().body;
    assert_eq!(
        (sent["n"].as_u64(), sent["seed"].as_u64()),
        (Some(3), Some(5))
    );

    let five = b.chat(&r.clone().n(5)).await.unwrap();
    assert!(!five.cached);
    assert_eq!(server.requests(), 2);
    let sent = server.last().unwrap().body;
    assert_eq!(
        (sent["n"].as_u64(), sent["seed"].as_u64()),
        (Some(2), Some(8)),
        "only samples 3 and 4, drawn with seeds 8 and 9"
    );
    assert_eq!(five.choices[..3], three.choices[..]);
    assert_eq!(
        five.choices.iter().map(|c| c.index).collect::<Vec<_>>(),
        vec![0, 1, 2, 3, 4]
    );
    assert_eq!(cache.len(), 5);

    let again = b.chat(&r.clone().n(5)).await.unwrap();
    assert!(again.cached);
    assert_eq!(again.choices, five.choices);
    let fewer = b.chat(&r.clone().n(2)).await.unwrap();
    assert!(fewer.cached);
    assert_eq!(fewer.choices[..], five.choices[..2]);
    assert_eq!(server.requests(), 2);
}

#[tokio::test]
async fn failures_are_not_cached() {
    let server = FaultServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let cache = RequestCache::open(dir.path()).unwrap();
    let b = cached(&server, &cache);
    let r = requests().remove(0);
    server.set_always(Some(Fault::Status(500)));
    assert!(b.chat(&r).await.is_err());
    assert_eq!(cache.len(), 0);
    server.clear_faults();
    assert!(!b.chat(&r).await.unwrap().cached);
    assert!(b.chat(&r).await.unwrap().cached);
    assert_eq!(server.requests(), 2);
}
