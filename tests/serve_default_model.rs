//! `serve --weights` on the default model (SmolLM2-135M-Instruct, Q4_1 GGUF): `f32` gives the
//! logits of the f32 training model on the same file, re-quantized `q8` and the file's own
//! Q4_1 blocks (`native`: candle's kernels, `auto`: ours) do not; the binary serves the f32
//! weights and answers to the names it was given.

mod common;
use common::model_util::{self, max_abs_diff};

use common::serve_util;
use std::process::{Child, Command, Stdio};

use candle_core::{DType, Device, Tensor};
use collabllm::engine::llama::WeightFormat;
use collabllm::engine::{Engine, LoadOptions};
use collabllm::llm::local::LocalBackend;
use collabllm::llm::spec::LocalModelFiles;
use collabllm::llm::{ChatBackend, ChatMessage, ChatRequest, ModelSpec};
use collabllm::train::model::TrainLlama;
use model_util::*;
use serde_json::{json, Value};

fn messages() -> Vec<ChatMessage> {
    vec![ChatMessage::user("What is the capital of France?")]
}

#[test]
fn f32_weights_give_the_training_models_logits() {
    one_thread();
    let path = default_model_path();
    let files = LocalModelFiles::Gguf(path.clone());
    let load = |weights| {
        Engine::load(
            &files,
            &LoadOptions {
                weights,
                ..LoadOptions::default()
            },
        )
        .unwrap()
    };
    let f32_engine = load(WeightFormat::F32);
    let ids = f32_engine.encode_chat(&messages()).unwrap();

    let train = TrainLlama::from_gguf(&path, DType::F32, &Device::Cpu).unwrap();
    let input = Tensor::new(ids.as_slice(), &Device::Cpu)
        .and_then(|t| t.unsqueeze(0))
        .unwrap();
    let all: Vec<Vec<f32>> = train
        .forward(&input, None)
        .and_then(|l| l.squeeze(0))
        .and_then(|l| l.to_vec2())
        .unwrap();
    let reference = all.last().unwrap();

    let f32_diff = max_abs_diff(&f32_engine.next_token_logits(&ids).unwrap(), reference);
    drop(f32_engine);
    let q8_diff = max_abs_diff(
        &load(WeightFormat::Q8_0).next_token_logits(&ids).unwrap(),
        reference,
    );
    let native = load(WeightFormat::Native).next_token_logits(&ids).unwrap();
    let native_diff = max_abs_diff(&native, reference);
    let auto = load(WeightFormat::Auto).next_token_logits(&ids).unwrap();
    let auto_diff = max_abs_diff(&auto, reference);
    let auto_vs_native = max_abs_diff(&auto, &native);
    eprintln!(
        "max |Δlogit| vs the f32 training model: f32 {f32_diff:e}, q8 {q8_diff:e}, \
         native (Q4_1) {native_diff:e}, auto {auto_diff:e}; auto vs native {auto_vs_native:e}"
    );
    assert!(f32_diff < 1e-3, "f32 differs by {f32_diff}");
    assert!(q8_diff > 10.0 * f32_diff, "q8 {q8_diff} vs f32 {f32_diff}");
    assert!(
        native_diff > 10.0 * f32_diff,
        "native {native_diff} vs f32 {f32_diff}"
    );
    // `auto` reads the file's Q4_1 blocks in our kernel: candle's Q4_1 arithmetic (int8
    // activations, ggml's q4_1·q8_1 dot) up to the order of float sums, not Q8_0 copies.
    assert!(
        auto_vs_native < 0.1 * q8_diff,
        "auto vs native {auto_vs_native}, q8 {q8_diff}"
    );
}

const POEM: &str = "Write a short poem about the sea.";
const MAX_TOKENS: usize = 48;

/// Kills the server when the test ends, however it ends.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn the_binary_serves_f32_weights_under_its_names() {
    one_thread();
    let model = default_model_path();
    let mut child = Command::new(env!("CARGO_BIN_EXE_serve"))
        .args([
            "--model",
            "default",
            "--weights",
            "f32",
            "--port",
            "0",
            "--threads",
            "1",
        ])
        .args(["--model-id", "smol", "--alias", "my-assistant"])
        .env("COLLABLLM_DEFAULT_MODEL", &model)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let server = Server(child);
    let base = tokio::task::spawn_blocking(move || serve_util::listening_url(stdout))
        .await
        .unwrap();

    let ask = |model: &str| {
        let body = json!({"model": model, "temperature": 0, "max_tokens": MAX_TOKENS,
                          "messages": [{"role": "user", "content": POEM}]});
        let url = format!("{base}/chat/completions");
        async move {
            let resp = reqwest::Client::new()
                .post(url)
                .json(&body)
                .send()
                .await
                .unwrap();
            (resp.status().as_u16(), resp.json::<Value>().await.unwrap())
        }
    };
    let mut replies = Vec::new();
    for name in ["smol", "default", "my-assistant"] {
        let (status, v) = ask(name).await;
        assert_eq!(status, 200, "{name}: {v}");
        assert_eq!(v["model"], "smol");
        replies.push(
            v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string(),
        );
    }
    let (status, v) = ask("SmolLM2-135M-Instruct.Q4_1").await;
    assert_eq!(status, 404, "{v}");
    assert_eq!(v["error"]["code"], "model_not_found");

    // The same greedy reply as the f32 engine in this process, which q8 does not give.
    let greedy = |weights| {
        let model = model.clone();
        async move {
            let local = LocalBackend::load(
                &ModelSpec::Gguf(model),
                &LoadOptions {
                    weights,
                    ..LoadOptions::default()
                },
            )
            .await
            .unwrap();
            let req = ChatRequest::new(vec![ChatMessage::user(POEM)])
                .temperature(0.0)
                .max_tokens(MAX_TOKENS);
            local.chat(&req).await.unwrap().choices[0].content.clone()
        }
    };
    let f32_reply = greedy(WeightFormat::F32).await;
    let q8_reply = greedy(WeightFormat::Q8_0).await;
    assert_ne!(
        f32_reply, q8_reply,
        "this prompt must tell the formats apart"
    );
    for r in &replies {
        assert_eq!(r, &f32_reply);
    }
    drop(server);
}
