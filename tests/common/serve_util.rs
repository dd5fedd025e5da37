//! Helpers for tests of the `serve` HTTP front: start a server on a free local port over any
//! backend, and talk to it with the real `async-openai` client or raw `reqwest`.

#![allow(dead_code)]

use std::net::SocketAddr;

use async_openai::config::OpenAIConfig;
use async_openai::Client;
use collabllm::llm::SharedBackend;

/// Starts `serve` over `backend` on 127.0.0.1 (a free port), answering to `names`, and returns
/// its address. The server runs until the test's runtime ends; no signal handler is installed.
pub async fn spawn_server(
    backend: SharedBackend,
    names: impl Into<collabllm::serve::ModelNames>,
) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind 127.0.0.1:0");
    let addr = listener.local_addr().expect("local addr");
    let names = names.into();
    tokio::spawn(async move {
        collabllm::serve::serve_with_shutdown(
            listener,
            backend,
            names,
            std::future::pending::<()>(),
        )
        .await
        .expect("server failed");
    });
    addr
}

/// An OpenAI client pointed at the server (any key works).
pub fn openai_client(addr: SocketAddr) -> Client<OpenAIConfig> {
    Client::with_config(
        OpenAIConfig::new()
            .with_api_base(format!("http://{addr}/v1"))
            .with_api_key("x"),
    )
}

/// `POST /v1/chat/completions` with a raw body: (status, body text).
pub async fn post_raw(addr: SocketAddr, body: impl Into<String>) -> (u16, String) {
    post_to(addr, "/v1/chat/completions", body).await
}

/// `POST` a JSON body to `path`: (status, body text).
pub async fn post_to(addr: SocketAddr, path: &str, body: impl Into<String>) -> (u16, String) {
    let resp = reqwest::Client::new()
        .post(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(body.into())
        .send()
        .await
        .expect("request sent");
    let status = resp.status().as_u16();
    (status, resp.text().await.expect("body read"))
}

/// `GET` a path: (status, body text).
pub async fn get_raw(addr: SocketAddr, path: &str) -> (u16, String) {
    let resp = reqwest::get(format!("http://{addr}{path}"))
        .await
        .expect("request sent");
    let status = resp.status().as_u16();
    (status, resp.text().await.expect("body read"))
}

/// Parses a body that must be an OpenAI error object, returning it (`message`, `type`, …).
pub fn api_error(body: &str) -> serde_json::Value {
    let v: serde_json::Value =
        serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"));
    let err = v["error"].clone();
    assert!(
        err["message"].as_str().is_some_and(|m| !m.is_empty()),
        "no error.message in {body}"
    );
    assert!(err["type"].is_string(), "no error.type in {body}");
    assert!(
        err.get("param").is_some() && err.get("code").is_some(),
        "{body}"
    );
    err
}

/// The `data:` payloads of an SSE body, in order.
pub fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.trim().to_string())
        .collect()
}

/// The base URL (`http://…/v1`) a `serve` binary prints on its first stdout line.
pub fn listening_url(stdout: impl std::io::Read) -> String {
    use std::io::BufRead;
    let mut line = String::new();
    std::io::BufReader::new(stdout)
        .read_line(&mut line)
        .expect("reading serve's first line");
    line.split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_string()
}
