//! `serve` over the real local engine (the tiny random llama), driven by the real
//! `async-openai` client on 127.0.0.1.

#[path = "common/model_util.rs"]
mod model_util;
#[path = "common/serve_util.rs"]
mod serve_util;

use async_openai::types::chat::{
    ChatCompletionRequestUserMessage, CreateChatCompletionRequestArgs, StopConfiguration,
};
use collabllm::llm::tiny::TinySpec;
use serve_util::{api_error, openai_client, post_raw, spawn_server};

#[tokio::test]
async fn openai_client_against_the_tiny_model() {
    let (_g, backend) = model_util::load_tiny(&TinySpec::default()).await;
    let addr = spawn_server(backend, "tiny").await;
    let client = openai_client(addr);
    let user = || vec![ChatCompletionRequestUserMessage::from("Tell me about the sea.").into()];

    // n = 3 samples, usage counted.
    let req = CreateChatCompletionRequestArgs::default()
        .model("tiny")
        .messages(user())
        .n(3u8)
        .max_tokens(12u32)
        .seed(5i64)
        .temperature(1.0)
        .build()
        .unwrap();
    let resp = client.chat().create(req).await.unwrap();
    assert_eq!(resp.model, "tiny");
    assert_eq!(resp.choices.len(), 3);
    let idx: Vec<u32> = resp.choices.iter().map(|c| c.index).collect();
    assert_eq!(idx, vec![0, 1, 2]);
    let usage = resp.usage.expect("usage");
    assert!(usage.prompt_tokens > 20);
    assert!(usage.completion_tokens >= 3 && usage.completion_tokens <= 36);
    assert_eq!(
        usage.total_tokens,
        usage.prompt_tokens + usage.completion_tokens
    );
    for c in &resp.choices {
        assert!(!c.message.content.as_deref().unwrap_or("").trim().is_empty());
    }

    // A stop string taken from the seeded reply cuts it there.
    let seeded = |stop: Option<String>| {
        let mut b = CreateChatCompletionRequestArgs::default();
        b.model("tiny")
            .messages(user())
            .max_tokens(32u32)
            .temperature(1.0);
        if let Some(s) = stop {
            b.stop(StopConfiguration::String(s));
        }
        b
    };
    let mut chosen = None;
    for seed in 0..50i64 {
        let r = client
            .chat()
            .create(seeded(None).seed(seed).build().unwrap())
            .await
            .unwrap();
        let text = r.choices[0].message.content.clone().unwrap_or_default();
        let chars: Vec<char> = text.chars().collect();
        if chars.len() >= 8
            && !chars[..6].contains(&char::REPLACEMENT_CHARACTER)
            && !chars[..4].iter().collect::<String>().trim().is_empty()
        {
            chosen = Some((seed, text));
            break;
        }
    }
    let (seed, full) = chosen.expect("a seed with a long enough reply");
    let stop: String = full.chars().skip(4).take(2).collect();
    let cut = client
        .chat()
        .create(seeded(Some(stop.clone())).seed(seed).build().unwrap())
        .await
        .unwrap();
    let expected = &full[..full.find(&stop).unwrap()];
    assert_eq!(cut.choices[0].message.content.as_deref(), Some(expected));

    // A malformed request is a 400 with an OpenAI-shaped JSON error.
    let (status, body) = post_raw(addr, "{\"messages\": [").await;
    assert_eq!(status, 400);
    assert_eq!(api_error(&body)["type"], "invalid_request_error");
}
