//! The `serve` HTTP front over a scripted backend, driven by the real `async-openai` client
//! and by raw HTTP for the error paths.

mod common;
use common::serve_util;

use std::collections::BTreeMap;

use async_openai::error::OpenAIError;
use async_openai::types::chat::{
    ChatCompletionRequestSystemMessage, ChatCompletionRequestUserMessage,
    ChatCompletionStreamOptions, CreateChatCompletionRequestArgs, FinishReason, StopConfiguration,
};
use collabllm::llm::scripted::ScriptedBackend;
use collabllm::llm::{LlmError, SharedBackend};
use futures::StreamExt;
use serde_json::{json, Value};
use serve_util::{api_error, get_raw, openai_client, post_raw, spawn_server, sse_data};

const MODEL: &str = "test-model";

async fn echo_server() -> std::net::SocketAddr {
    spawn_server(ScriptedBackend::echo("echo"), MODEL).await
}

fn messages() -> Vec<async_openai::types::chat::ChatCompletionRequestMessage> {
    vec![
        ChatCompletionRequestSystemMessage::from("be brief").into(),
        ChatCompletionRequestUserMessage::from("hello there world").into(),
    ]
}

#[tokio::test]
async fn n_choices_and_usage() {
    let addr = echo_server().await;
    let req = CreateChatCompletionRequestArgs::default()
        .model(MODEL)
        .messages(messages())
        .n(3u8)
        .build()
        .unwrap();
    let resp = openai_client(addr).chat().create(req).await.unwrap();
    assert!(resp.id.starts_with("chatcmpl-"), "{}", resp.id);
    assert_eq!(resp.object, "chat.completion");
    assert_eq!(resp.model, MODEL);
    assert_eq!(resp.choices.len(), 3);
    for (i, c) in resp.choices.iter().enumerate() {
        assert_eq!(c.index as usize, i);
        assert_eq!(
            c.message.content.as_deref(),
            Some(format!("echo #{i}: hello there world").as_str())
        );
        assert_eq!(c.finish_reason, Some(FinishReason::Stop));
    }
    // The scripted backend counts words: prompt 2 + 3, each reply 5.
    let usage = resp.usage.expect("usage");
    assert_eq!(usage.prompt_tokens, 5);
    assert_eq!(usage.completion_tokens, 15);
    assert_eq!(usage.total_tokens, 20);
}

#[tokio::test]
async fn stop_strings_and_max_tokens() {
    let backend = ScriptedBackend::cycle("c", vec!["The answer is 42. END trailing words".into()]);
    let addr = spawn_server(backend, MODEL).await;
    let client = openai_client(addr);

    let req = CreateChatCompletionRequestArgs::default()
        .model(MODEL)
        .messages(messages())
        .stop(StopConfiguration::StringArray(vec![
            "END".into(),
            "zzz".into(),
        ]))
        .build()
        .unwrap();
    let resp = client.chat().create(req).await.unwrap();
    let content = resp.choices[0].message.content.clone().unwrap();
    assert_eq!(content, "The answer is 42. ");
    assert_eq!(resp.choices[0].finish_reason, Some(FinishReason::Stop));

    // A single stop string, and the deprecated `max_tokens` name, over raw HTTP.
    let (status, body) = post_raw(
        addr,
        json!({"model": MODEL, "messages": [{"role": "user", "content": "q"}],
               "stop": "42", "max_tokens": 2})
        .to_string(),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "The answer");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["choices"][0]["logprobs"], Value::Null);
    assert_eq!(v["usage"]["completion_tokens"], 2);

    let req = CreateChatCompletionRequestArgs::default()
        .model(MODEL)
        .messages(messages())
        .max_completion_tokens(3u32)
        .build()
        .unwrap();
    let resp = client.chat().create(req).await.unwrap();
    assert_eq!(
        resp.choices[0].message.content.as_deref(),
        Some("The answer is")
    );
    assert_eq!(resp.choices[0].finish_reason, Some(FinishReason::Length));
}

#[tokio::test]
async fn content_parts_roles_and_unknown_fields() {
    let addr = echo_server().await;
    let (status, body) = post_raw(
        addr,
        json!({
            "messages": [
                {"role": "developer", "content": "sys"},
                {"role": "assistant", "content": null},
                {"role": "user", "content": [{"type": "text", "text": "part one "},
                                             {"type": "text", "text": "part two"}]}
            ],
            "response_format": {"type": "text"},
            "seed": 7, "temperature": 0, "presence_penalty": 0, "user": "someone",
            "some_future_field": {"a": 1}
        })
        .to_string(),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(
        v["choices"][0]["message"]["content"],
        "echo #0: part one part two"
    );
}

#[tokio::test]
async fn models_and_health() {
    let addr = echo_server().await;
    let (status, body) = get_raw(addr, "/v1/models").await;
    assert_eq!(status, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], MODEL);
    assert_eq!(v["data"][0]["object"], "model");
    assert_eq!(v["data"][0]["owned_by"], "collabllm");
    assert!(v["data"][0]["created"].is_u64());

    let (status, body) = get_raw(addr, "/health").await;
    assert_eq!(status, 200);
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap(),
        json!({"status": "ok"})
    );
}

/// A page in a browser can POST plain text or a form to a local server without a CORS
/// preflight: only bodies declared as JSON are served.
#[tokio::test]
async fn bodies_not_declared_as_json_are_refused() {
    let addr = echo_server().await;
    let body = json!({"messages": [{"role": "user", "content": "hi"}]}).to_string();
    let client = reqwest::Client::new();
    let url = format!("http://{addr}/v1/chat/completions");
    for ctype in [
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
        Some("multipart/form-data; boundary=x"),
        None,
    ] {
        let mut req = client.post(&url).body(body.clone());
        if let Some(c) = ctype {
            req = req.header("content-type", c);
        }
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        assert_eq!(status, 415, "{ctype:?}: {text}");
        assert!(api_error(&text)["message"]
            .as_str()
            .unwrap()
            .contains("application/json"));
    }
    let resp = client
        .post(&url)
        .header("content-type", "Application/JSON; charset=utf-8")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
}

/// With a key, every route but /health wants `Authorization: Bearer <key>`; an OpenAI client
/// configured with the key is served.
#[tokio::test]
async fn an_api_key_is_required_when_set() {
    for bad in ["ключ", "two words", "tab\there", ""] {
        let err = collabllm::serve::require_api_key(
            collabllm::serve::router(ScriptedBackend::echo("echo"), MODEL),
            bad.into(),
        )
        .expect_err(bad)
        .to_string();
        assert!(
            err.contains("ASCII") && (bad.is_empty() || !err.contains(bad)),
            "{err}"
        );
    }
    let router = collabllm::serve::require_api_key(
        collabllm::serve::router(ScriptedBackend::echo("echo"), MODEL),
        "s3cret".into(),
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    let body = json!({"messages": [{"role": "user", "content": "hi"}]}).to_string();
    let client = reqwest::Client::new();
    for auth in [
        None,
        Some("Bearer wrong"),
        Some("Bearer s3cre"),
        Some("s3cret"),
        Some("Basic s3cret"),
        Some("Bearers3cret"),
    ] {
        let mut req = client
            .post(format!("http://{addr}/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(body.clone());
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status().as_u16(), 401, "{auth:?}");
        let text = resp.text().await.unwrap();
        assert!(!text.contains("s3cret"), "the key leaked: {text}");
        assert_eq!(api_error(&text)["code"], "invalid_api_key");
    }
    let models = client
        .get(format!("http://{addr}/v1/models"))
        .send()
        .await
        .unwrap();
    assert_eq!(models.status().as_u16(), 401);
    assert_eq!(get_raw(addr, "/health").await.0, 200, "health stays open");
    let ok = async_openai::Client::with_config(
        async_openai::config::OpenAIConfig::new()
            .with_api_base(format!("http://{addr}/v1"))
            .with_api_key("s3cret"),
    )
    .chat()
    .create(
        CreateChatCompletionRequestArgs::default()
            .model(MODEL)
            .messages(messages())
            .build()
            .unwrap(),
    )
    .await;
    assert!(ok.is_ok(), "{ok:?}");
    // The scheme is case-insensitive (RFC 7235).
    for auth in ["bearer s3cret", "BEARER s3cret", "Bearer  s3cret"] {
        let resp = client
            .post(format!("http://{addr}/v1/chat/completions"))
            .header("content-type", "application/json")
            .header("authorization", auth)
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 200, "{auth}");
    }
}

#[tokio::test]
async fn bad_requests_are_openai_errors() {
    let addr = echo_server().await;
    let user = json!([{"role": "user", "content": "hi"}]);
    let cases = [
        ("{\"messages\": [", None),
        ("not json at all", None),
        ("", None),
        ("{\"model\": \"m\"}", Some("messages")),
        (&*json!({"messages": []}).to_string(), Some("messages")),
        (&*json!({"messages": user, "n": 0}).to_string(), Some("n")),
        (
            &*json!({"messages": user, "n": 1000}).to_string(),
            Some("n"),
        ),
        (&*json!({"messages": user, "n": "3"}).to_string(), Some("n")),
        (
            &*json!({"messages": user, "temperature": -0.5}).to_string(),
            Some("temperature"),
        ),
        (
            &*json!({"messages": user, "top_p": 0}).to_string(),
            Some("top_p"),
        ),
        (
            &*json!({"messages": user, "top_p": 2}).to_string(),
            Some("top_p"),
        ),
        (
            &*json!({"messages": user, "max_tokens": 0}).to_string(),
            Some("max_tokens"),
        ),
        (
            &*json!({"messages": user, "stop": 5}).to_string(),
            Some("stop"),
        ),
        (
            &*json!({"messages": user, "stop": ["end", "x".repeat(513)]}).to_string(),
            Some("stop"),
        ),
        (
            &*json!({"messages": [{"role": "wizard", "content": "x"}]}).to_string(),
            Some("messages[0].role"),
        ),
        (
            &*json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
                .to_string(),
            Some("messages[0].content[0]"),
        ),
        (
            &*json!({"messages": user, "temperature": 3}).to_string(),
            Some("temperature"),
        ),
        (
            &*json!({"messages": user, "max_completion_tokens": -1}).to_string(),
            Some("max_completion_tokens"),
        ),
        (
            &*json!({"messages": user, "seed": "7"}).to_string(),
            Some("seed"),
        ),
        (
            &*json!({"messages": user, "presence_penalty": 1}).to_string(),
            Some("presence_penalty"),
        ),
        (
            &*json!({"messages": user, "frequency_penalty": 2.5}).to_string(),
            Some("frequency_penalty"),
        ),
        (
            &*json!({"messages": user, "logit_bias": {"5": 100}}).to_string(),
            Some("logit_bias"),
        ),
        (
            &*json!({"messages": user, "top_logprobs": 5}).to_string(),
            Some("top_logprobs"),
        ),
        (
            &*json!({"messages": user, "response_format": {"type": "json_schema"}}).to_string(),
            Some("response_format.json_schema"),
        ),
    ];
    for (body, param) in cases {
        let (status, text) = post_raw(addr, body).await;
        assert_eq!(status, 400, "{body} -> {text}");
        let err = api_error(&text);
        assert_eq!(err["type"], "invalid_request_error", "{body} -> {text}");
        assert_eq!(err["param"].as_str(), param, "{body} -> {text}");
    }

    // The real client sees a typed API error.
    let req = CreateChatCompletionRequestArgs::default()
        .model(MODEL)
        .messages(messages())
        .top_p(0.0)
        .build()
        .unwrap();
    match openai_client(addr).chat().create(req).await {
        Err(OpenAIError::ApiError(e)) => {
            assert_eq!(e.status_code.as_u16(), 400);
            assert_eq!(e.api_error.r#type.as_deref(), Some("invalid_request_error"));
            assert!(
                e.api_error.message.contains("top_p"),
                "{}",
                e.api_error.message
            );
        }
        other => panic!("expected an API error, got {other:?}"),
    }
}

#[tokio::test]
async fn model_names_and_aliases() {
    let names = collabllm::serve::ModelNames::new(MODEL).with_aliases(["alias-a", "alias-b"]);
    let addr = spawn_server(ScriptedBackend::echo("echo"), names).await;
    let ask = |model: Option<&str>| {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}]});
        if let Some(m) = model {
            body["model"] = json!(m);
        }
        post_raw(addr, body.to_string())
    };
    for model in [Some(MODEL), Some("alias-b"), None] {
        let (status, text) = ask(model).await;
        assert_eq!(status, 200, "{model:?}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["model"], MODEL, "responses report the served id");
    }
    for model in ["gpt-4o", "TEST-MODEL", ""] {
        let (status, text) = ask(Some(model)).await;
        assert_eq!(status, 404, "{model}: {text}");
        let err = api_error(&text);
        assert_eq!(err["code"], "model_not_found");
        assert_eq!(err["type"], "invalid_request_error");
        assert_eq!(err["param"], "model");
        assert!(err["message"].as_str().unwrap().contains(model));
    }
    // The real client sees the 404 too, streaming or not.
    let req = CreateChatCompletionRequestArgs::default()
        .model("some-other-model")
        .messages(messages())
        .stream(true)
        .build()
        .unwrap();
    match openai_client(addr).chat().create_stream(req).await {
        Err(OpenAIError::ApiError(e)) => {
            assert_eq!(e.status_code.as_u16(), 404);
            assert_eq!(e.api_error.code.as_deref(), Some("model_not_found"));
        }
        Ok(mut s) => match s.next().await {
            Some(Err(e)) => assert!(e.to_string().contains("404"), "{e}"),
            other => panic!("expected a 404, got {other:?}"),
        },
        Err(e) => assert!(e.to_string().contains("404"), "{e}"),
    }
    // Every accepted name is listed, the reported id first.
    let (_, body) = get_raw(addr, "/v1/models").await;
    let v: Value = serde_json::from_str(&body).unwrap();
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [MODEL, "alias-a", "alias-b"]);
}

/// A schema whose anyOf refers to itself twice: two such requests in flight answer (an error
/// naming the step budget) and /health answers within a second meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recursive_schema_neither_hangs_nor_starves_health() {
    let backend = ScriptedBackend::cycle("c", vec!["\"a string\"".to_string()]);
    let addr = spawn_server(backend, MODEL).await;
    let body = json!({
        "messages": [{"role": "user", "content": "json please"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
            "$ref": "#/$defs/n",
            "$defs": {"n": {"anyOf": [{"$ref": "#/$defs/n"}, {"$ref": "#/$defs/n"}, {"type": "integer"}]}}
        }}}
    })
    .to_string();
    let started = std::time::Instant::now();
    let a = tokio::spawn(post_raw(addr, body.clone()));
    let b = tokio::spawn(post_raw(addr, body));
    let (status, _) =
        tokio::time::timeout(std::time::Duration::from_secs(1), get_raw(addr, "/health"))
            .await
            .expect("/health answered within a second");
    assert_eq!(status, 200);
    for r in [a, b] {
        let (status, text) = tokio::time::timeout(std::time::Duration::from_secs(10), r)
            .await
            .expect("the request answered")
            .unwrap();
        assert_eq!(status, 500, "{text}");
        assert!(
            api_error(&text)["message"]
                .as_str()
                .unwrap()
                .contains("steps"),
            "{text}"
        );
    }
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
}

/// A self-referring anyOf whose leaf is a large enum: every failed check used to copy and
/// format the whole list (2,000 values: 2.6 s per request, /health frozen meanwhile, the enum
/// echoed back). Now the work is bounded, /health answers, the message is short, and an enum
/// over the limit is refused up front.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_with_a_large_enum_is_bounded_in_work_and_words() {
    let backend = ScriptedBackend::cycle("c", vec!["\"not listed\"".to_string()]);
    let addr = spawn_server(backend, MODEL).await;
    let body = |n: usize| {
        let values: Vec<String> = (0..n).map(|i| format!("value number {i}")).collect();
        json!({
            "messages": [{"role": "user", "content": "json please"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
                "$ref": "#/$defs/n",
                "$defs": {"n": {"anyOf": [{"$ref": "#/$defs/n"}, {"$ref": "#/$defs/n"},
                                          {"enum": values}]}}
            }}}
        })
        .to_string()
    };
    let started = std::time::Instant::now();
    let a = tokio::spawn(post_raw(addr, body(1_000)));
    let b = tokio::spawn(post_raw(addr, body(1_000)));
    let (status, _) = tokio::time::timeout(
        std::time::Duration::from_millis(300),
        get_raw(addr, "/health"),
    )
    .await
    .expect("/health answered within 0.3 s");
    assert_eq!(status, 200);
    for r in [a, b] {
        let (status, text) = r.await.unwrap();
        assert_eq!(status, 500, "{}", &text[..text.len().min(500)]);
        assert!(text.len() < 2_000, "{} bytes: {}", text.len(), &text[..500]);
        let message = api_error(&text)["message"].as_str().unwrap().to_string();
        assert!(message.contains("steps"), "{message}");
    }
    assert!(
        started.elapsed() < std::time::Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    // A failed enum names a few values, never the list.
    let (status, text) = post_raw(
        addr,
        json!({
            "messages": [{"role": "user", "content": "json please"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "e", "schema": {
                "enum": (0..1_000).map(|i| format!("value number {i}")).collect::<Vec<_>>()
            }}}
        })
        .to_string(),
    )
    .await;
    assert_eq!(status, 500);
    let message = api_error(&text)["message"].as_str().unwrap().to_string();
    assert!(
        message.contains("and 995 more") && message.len() < 600,
        "{message}"
    );
    let (status, text) = post_raw(addr, body(2_000)).await;
    assert_eq!(status, 400, "{text}");
    let err = api_error(&text);
    assert_eq!(err["code"], "unsupported_parameter", "{text}");
    assert!(
        err["message"].as_str().unwrap().contains("2000 values"),
        "{text}"
    );
}

#[tokio::test]
async fn response_format_is_checked_not_ignored() {
    let replies = vec![
        "```json\n{\"name\": \"Ada\", \"age\": 36}\n```".to_string(),
        "{\"name\": \"Ada\", \"age\": \"old\"}".to_string(),
        "Sure! Here it is: name=Ada".to_string(),
    ];
    let backend = ScriptedBackend::cycle("c", replies);
    let addr = spawn_server(backend, MODEL).await;
    let schema = json!({
        "type": "json_schema",
        "json_schema": {"name": "person", "strict": true, "schema": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"], "additionalProperties": false}}
    });
    let ask = |format: Value, stream: bool| {
        post_raw(
            addr,
            json!({"messages": [{"role": "user", "content": "who?"}],
                   "response_format": format, "stream": stream})
            .to_string(),
        )
    };
    // 1st reply: fenced JSON that satisfies the schema comes back as bare JSON.
    let (status, text) = ask(schema.clone(), false).await;
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(
        serde_json::from_str::<Value>(content).unwrap(),
        json!({"name": "Ada", "age": 36})
    );
    // 2nd: valid JSON with a wrong type; the error names the field.
    let (status, text) = ask(schema.clone(), true).await;
    assert_eq!(status, 500, "{text}");
    let err = api_error(&text);
    assert_eq!(err["code"], "response_format_not_met");
    assert_eq!(err["type"], "server_error");
    let msg = err["message"].as_str().unwrap();
    assert!(
        msg.contains("person") && msg.contains("$.age: expected integer"),
        "{msg}"
    );
    // 3rd: not JSON at all, under json_object.
    let (status, text) = ask(json!({"type": "json_object"}), false).await;
    assert_eq!(status, 500, "{text}");
    assert!(api_error(&text)["message"]
        .as_str()
        .unwrap()
        .contains("not valid JSON"));
    // A schema with a keyword the server does not check is refused up front.
    let mut unchecked = schema.clone();
    unchecked["json_schema"]["schema"]["properties"]["name"]["pattern"] = json!("^A");
    let (status, text) = ask(unchecked, false).await;
    assert_eq!(status, 400, "{text}");
    let err = api_error(&text);
    assert_eq!(err["code"], "unsupported_parameter");
    assert_eq!(
        err["param"],
        "response_format.json_schema.schema.properties.name.pattern"
    );
}

#[tokio::test]
async fn unknown_routes_and_methods_are_json() {
    let addr = echo_server().await;
    let (status, text) = get_raw(addr, "/v1/nope").await;
    assert_eq!(status, 404);
    assert_eq!(api_error(&text)["code"], "not_found");

    let (status, text) = get_raw(addr, "/v1/chat/completions").await;
    assert_eq!(status, 405);
    api_error(&text);

    let huge = format!(
        "{{\"messages\": [{{\"role\": \"user\", \"content\": \"{}\"}}]}}",
        "a".repeat(collabllm::serve::MAX_BODY_BYTES + 1)
    );
    let (status, text) = post_raw(addr, huge).await;
    assert_eq!(status, 413);
    api_error(&text);
}

#[tokio::test]
async fn backend_errors_map_to_status() {
    let cases: Vec<(LlmError, u16, &str)> = vec![
        (
            LlmError::Local {
                model: "m".into(),
                message: "out of memory".into(),
            },
            500,
            "server_error",
        ),
        (
            LlmError::Timeout {
                endpoint: "e".into(),
                timeout_s: 1.0,
                attempts: 1,
            },
            503,
            "server_error",
        ),
        (
            LlmError::InvalidRequest("`messages` is too long for the context window".into()),
            400,
            "invalid_request_error",
        ),
    ];
    for (error, status, kind) in cases {
        let message = error.to_string();
        let slot = std::sync::Mutex::new(Some(error));
        let backend: SharedBackend = ScriptedBackend::new("failing", move |_, _| {
            Err(slot.lock().unwrap().take().expect("called once"))
        });
        let addr = spawn_server(backend, MODEL).await;
        let (got, text) = post_raw(
            addr,
            json!({"messages": [{"role": "user", "content": "hi"}]}).to_string(),
        )
        .await;
        assert_eq!(got, status, "{text}");
        let err = api_error(&text);
        assert_eq!(err["type"], kind);
        assert_eq!(err["message"], message);
    }
}

#[tokio::test]
async fn streaming_with_the_openai_client() {
    let addr = echo_server().await;
    let req = CreateChatCompletionRequestArgs::default()
        .model(MODEL)
        .messages(messages())
        .n(2u8)
        .stream_options(ChatCompletionStreamOptions {
            include_usage: Some(true),
            include_obfuscation: None,
        })
        .build()
        .unwrap();
    let mut stream = openai_client(addr).chat().create_stream(req).await.unwrap();
    let mut text: BTreeMap<u32, String> = BTreeMap::new();
    let mut finish = BTreeMap::new();
    let mut usage = None;
    let mut ids = std::collections::HashSet::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.unwrap();
        assert_eq!(chunk.object, "chat.completion.chunk");
        assert_eq!(chunk.model, MODEL);
        ids.insert(chunk.id.clone());
        for c in chunk.choices {
            if let Some(t) = c.delta.content {
                text.entry(c.index).or_default().push_str(&t);
            }
            if let Some(f) = c.finish_reason {
                finish.insert(c.index, f);
            }
        }
        if chunk.usage.is_some() {
            usage = chunk.usage;
        }
    }
    assert_eq!(ids.len(), 1, "every chunk carries the same id");
    assert_eq!(text.len(), 2);
    assert_eq!(text[&0], "echo #0: hello there world");
    assert_eq!(text[&1], "echo #1: hello there world");
    assert_eq!(finish[&0], FinishReason::Stop);
    assert_eq!(finish[&1], FinishReason::Stop);
    let usage = usage.expect("usage chunk");
    assert_eq!(
        (
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.total_tokens
        ),
        (5, 10, 15)
    );
}

#[tokio::test]
async fn streaming_raw_sse() {
    let addr = echo_server().await;
    let resp = reqwest::Client::new()
        .post(format!("http://{addr}/v1/chat/completions"))
        .json(&json!({"messages": [{"role": "user", "content": "hi"}], "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let ctype = resp.headers()["content-type"].to_str().unwrap().to_string();
    assert!(ctype.starts_with("text/event-stream"), "{ctype}");
    let body = resp.text().await.unwrap();
    let data = sse_data(&body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{body}");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks.len(), 2, "{body}");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks[0]["choices"][0]["delta"]["content"], "echo #0: hi");
    assert_eq!(chunks[1]["choices"][0]["finish_reason"], "stop");
    assert!(chunks.iter().all(|c| c.get("usage").is_none()));

    // Errors are reported before the stream starts, as plain JSON.
    let (status, text) = post_raw(
        addr,
        json!({"messages": [{"role": "user", "content": "hi"}], "stream": true, "n": 0})
            .to_string(),
    )
    .await;
    assert_eq!(status, 400);
    api_error(&text);
}

/// Shutdown while a request is being answered: the server stops taking connections but
/// finishes the request in flight, then returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_finishes_the_request_in_flight() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let started = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = started.clone();
    let slow = ScriptedBackend::new("slow", move |_, _| {
        flag.store(true, std::sync::atomic::Ordering::SeqCst);
        std::thread::sleep(std::time::Duration::from_millis(500));
        Ok("finished after shutdown".into())
    });
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(collabllm::serve::serve_with_shutdown(
        listener,
        slow,
        MODEL,
        async {
            let _ = rx.await;
        },
    ));
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]});
    let request = tokio::spawn(post_raw(addr, body.to_string()));
    while !started.load(std::sync::atomic::Ordering::SeqCst) {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    tx.send(()).unwrap();
    let (status, text) = request.await.unwrap();
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        v["choices"][0]["message"]["content"],
        "finished after shutdown"
    );
    tokio::time::timeout(std::time::Duration::from_secs(10), server)
        .await
        .expect("server stops")
        .unwrap()
        .unwrap();
}

#[test]
fn binary_help_and_spec_checks() {
    let bin = env!("CARGO_BIN_EXE_serve");
    let out = std::process::Command::new(bin)
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--model",
        "--host",
        "--port",
        "--threads",
        "--model-id",
        "--alias",
        "--weights",
        "--kv-cache-mb",
        "native",
        "f32",
        "q8",
        "token for token",
        "model_not_found",
        "127.0.0.1",
        "8000",
    ] {
        assert!(help.contains(flag), "--help lacks {flag}:\n{help}");
    }

    let out = std::process::Command::new(bin)
        .args(["--model", "openai:gpt-4o-mini"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("local models only"), "{err}");

    for bad in [
        &["--model", "default", "--weights", "q4"][..],
        &["--model", "default", "--alias", " "][..],
        &["--model", "default", "--kv-cache-mb", "0"][..],
    ] {
        let out = std::process::Command::new(bin).args(bad).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{bad:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(bad[2]), "{bad:?}: {err}");
    }
}

/// A client's string is never echoed whole: a 1 MB `model`, `role`, schema property name,
/// `$ref` or type name comes back in an error of under 2 KB (and the log line is as short).
#[tokio::test]
async fn megabyte_client_strings_come_back_cut() {
    let addr = echo_server().await;
    let big = "k".repeat(1 << 20);
    let user = json!([{"role": "user", "content": "hi"}]);
    let schema = |schema: Value| {
        json!({"messages": user, "response_format": {"type": "json_schema",
            "json_schema": {"name": "x", "schema": schema}}})
    };
    for body in [
        json!({"model": big, "messages": user}),
        json!({"messages": [{"role": big, "content": "x"}]}),
        schema(json!({"type": "object", "properties": {big.as_str(): {"type": "nonsense"}}})),
        schema(json!({"$ref": big})),
        schema(json!({"type": big})),
    ] {
        let (status, text) = post_raw(addr, body.to_string()).await;
        assert!(
            (400..500).contains(&status),
            "{status}: {}",
            &text[..200.min(text.len())]
        );
        assert!(text.len() < 2048, "an error of {} bytes", text.len());
        assert!(api_error(&text)["message"].is_string(), "{text}");
    }
}
