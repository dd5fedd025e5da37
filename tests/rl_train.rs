//! `rl_train` end to end: the binary trains the tiny random llama with a local
//! OpenAI-compatible server on 127.0.0.1 as simulated user and judge. Logs, rollouts and the
//! final model are checked for shape and content; a response whose judge never answers
//! leaves its group; a run resumed after a checkpoint takes the same next steps as an
//! uninterrupted one; bad input is refused before any model call.

mod common;
use common::model_util;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use collabllm::engine::tiny::TinySpec;
use collabllm::llm::local::{LoadOptions, LocalBackend};
use collabllm::llm::{ChatBackend, ChatMessage, ChatRequest, ModelSpec};
use common::fault_server::FaultServer;
use serde_json::Value;

fn data(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("data")
        .join(name)
        .display()
        .to_string()
}

fn hash(s: &str) -> u64 {
    s.bytes().fold(1469598103934665603u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(1099511628211)
    })
}

/// The simulated user answers in JSON; the interactivity judge scores by a hash of the
/// transcript, and for half the transcripts answers nothing usable (every retry sees the
/// same transcript, so that score is missing).
fn reply(body: &Value, sample: usize) -> String {
    let prompt = body["messages"]
        .as_array()
        .and_then(|m| m.iter().rev().find(|x| x["role"] == "user"))
        .and_then(|m| m["content"].as_str())
        .unwrap_or("");
    let seed = body["seed"]
        .as_u64()
        .unwrap_or(0)
        .wrapping_add(sample as u64);
    if prompt.contains("role-playing a USER") {
        let response = format!("Please help with part {} of my problem.", seed % 5);
        return serde_json::json!({"current_answer": "", "thought": "t", "response": response})
            .to_string();
    }
    if prompt.contains("rating how well") {
        let h = hash(prompt);
        if h.is_multiple_of(2) {
            return "I would rather not say.".into();
        }
        // On the default (upstream v2) scale: 0, 0.5 or 1.
        let rating = ["0", "0.5", "1"][(h / 2 % 3) as usize];
        return format!("{{\"thought\": \"ok\", \"interactivity\": {rating}}}");
    }
    "ok".into()
}

async fn server() -> FaultServer {
    let s = FaultServer::start().await;
    s.set_responder(reply);
    s
}

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_rl_train")
}

/// The test run's flags; `extra` flags replace the defaults of the same name (`--metric`
/// adds to them), flags without a value (`--resume`) are appended.
fn args(server: &FaultServer, model: &Path, out: &Path, extra: &[&str]) -> Vec<String> {
    let spec = format!("openai:scripted@{}", server.base_url);
    let tasks = data("math.jsonl");
    let mut flags: Vec<(String, Option<String>)> = [
        ("--tasks", tasks.as_str()),
        ("--max-tasks", "3"),
        ("--output", out.to_str().unwrap()),
        ("--model", model.to_str().unwrap()),
        ("--user", &spec),
        ("--judge", &spec),
        ("--metric", "interactivity=1"),
        ("--metric", "token_amount=-1"),
        ("--batch-prompts", "2"),
        ("--group-size", "3"),
        ("--samples", "2"),
        ("--window", "2"),
        ("--max-new-tokens", "8"),
        ("--max-steps", "3"),
        ("--lr", "1e-3"),
        ("--kl-coef", "0.01"),
        ("--ppo-epochs", "2"),
        ("--sampler-weights", "f32"),
        ("--threads", "1"),
        ("--concurrency", "4"),
        ("--max-retries", "0"),
        ("--timeout", "5"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), Some(v.to_string())))
    .collect();
    let mut i = 0;
    while i < extra.len() {
        let flag = extra[i].to_string();
        let value = extra
            .get(i + 1)
            .filter(|v| !v.starts_with("--"))
            .map(|v| v.to_string());
        i += 1 + usize::from(value.is_some());
        match flags.iter_mut().find(|(k, _)| *k == flag) {
            Some(slot) if flag != "--metric" => slot.1 = value,
            _ => flags.push((flag, value)),
        }
    }
    flags
        .into_iter()
        .flat_map(|(k, v)| std::iter::once(k).chain(v))
        .collect()
}

/// rl_train with the test run's environment.
fn command(args: &[String]) -> tokio::process::Command {
    let mut c = tokio::process::Command::new(bin());
    c.args(args)
        .env("OPENAI_API_KEY", "test-key")
        .env("RUST_LOG", "warn")
        .env("CANDLE_NUM_THREADS", "1")
        .stdin(Stdio::null());
    c
}

async fn run_bin(args: &[String]) -> std::process::Output {
    command(args).output().await.expect("running rl_train")
}

fn ok(out: &std::process::Output) -> String {
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    text
}

fn jsonl(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn tiny() -> (tempfile::TempDir, PathBuf) {
    model_util::tiny_model_dir(&TinySpec::default())
}

#[tokio::test(flavor = "multi_thread")]
async fn trains_end_to_end_and_a_missing_score_leaves_its_group() {
    let server = server().await;
    let (_g, model) = tiny();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    ok(&run_bin(&args(&server, &model, &out, &["--save-steps", "2"])).await);

    let logs = jsonl(&out.join("logs.jsonl"));
    assert_eq!(logs.len(), 3);
    for (i, l) in logs.iter().enumerate() {
        assert_eq!(l["step"], (i + 1) as f64);
        for k in [
            "reward",
            "reward_std",
            "rewards/interactivity/mean",
            "rewards/token_amount/mean",
            "rewards/mr_mean/mean",
            "rewards/mr_verl_clamp/mean",
            "kl",
            "clip_ratio",
            "entropy",
            "completion_length",
            "loss",
            "grad_norm",
            "learning_rate",
            "advantages/advantage_abs_mean",
            "time/rollout",
            "time/futures",
            "time/update",
            "time/sync",
            // TRL 1.16's names, and verl's where they have a counterpart.
            "completions/mean_terminated_length",
            "clip_ratio/low_mean",
            "clip_ratio/low_min",
            "clip_ratio/high_mean",
            "clip_ratio/high_max",
            "clip_ratio/region_mean",
            "step_time",
            "response_length/mean",
            "critic/score/mean",
            "timing_s/step",
            "timing_s/gen",
            "timing_s/update_actor",
        ] {
            assert!(l[k].as_f64().is_some_and(f64::is_finite), "{k}: {l}");
        }
        let region = l["clip_ratio/region_mean"].as_f64().unwrap();
        let sides = l["clip_ratio/low_mean"].as_f64().unwrap()
            + l["clip_ratio/high_mean"].as_f64().unwrap();
        assert!((region - sides).abs() < 1e-12, "{l}");
        assert_eq!(l["step_time"], l["time/step"]);
        assert_eq!(l["learning_rate"], 1e-3);
        assert!(l["api/judge/calls"].as_u64().unwrap() > 0, "{l}");
        assert!(l["api/user/calls"].as_u64().unwrap() > 0, "{l}");
        // 2 prompts × 3 responses, each with 2 futures.
        assert_eq!(l["actor/optimizer_steps"], 2.0, "two PPO epochs");
    }
    assert!(logs.iter().all(|l| l["kl"].as_f64().unwrap() >= 0.0));
    // TRL's num_tokens: prompt + response tokens of every sampled response, cumulative.
    let rollouts = jsonl(&out.join("rollouts.jsonl"));
    let mut seen = 0;
    for (i, l) in logs.iter().enumerate() {
        for g in rollouts.iter().filter(|g| g["step"] == i as u64 + 1) {
            let prompt = g["prompt_tokens"].as_u64().unwrap();
            assert!(prompt > 0);
            for r in g["responses"].as_array().unwrap() {
                seen += prompt + r["tokens"].as_u64().unwrap();
            }
        }
        assert_eq!(l["num_tokens"], seen, "step {}", i + 1);
    }
    assert!(logs[2]["kl"].as_f64().unwrap() > 0.0, "the policy moved");

    let rollouts = jsonl(&out.join("rollouts.jsonl"));
    assert_eq!(rollouts.len(), 6, "2 prompts × 3 steps");
    let mut missing = 0;
    for r in &rollouts {
        assert_eq!(r["split"], "train");
        assert_eq!(r["prompt"][0]["role"], "user");
        let responses = r["responses"].as_array().unwrap();
        assert_eq!(responses.len(), 3);
        for resp in responses {
            let sessions = resp["sessions"].as_array().unwrap();
            assert_eq!(sessions.len(), 2, "S futures");
            assert_eq!(sessions[0]["messages"][0]["role"], "user");
            assert!(sessions[0]["scores"]["token_amount"]["value"].is_number());
            // MR needs every weighted metric in a future: a future without its judge score
            // takes no part, and a response with no complete future has no reward.
            let any_complete = sessions
                .iter()
                .any(|s| s["scores"]["interactivity"]["value"].is_number());
            assert_eq!(resp["reward"].is_null(), !any_complete, "{resp}");
            if resp["reward"].is_null() {
                missing += 1;
                assert!(resp["mr_mean"].is_null());
            } else {
                assert_eq!(resp["reward"], resp["mr_mean"], "--mr-formula mean");
                assert!(resp["mr_verl_clamp"].is_number());
            }
        }
    }
    let logged: f64 = logs
        .iter()
        .map(|l| l["responses/no_reward"].as_f64().unwrap())
        .sum();
    let dropped: f64 = logs
        .iter()
        .map(|l| l["advantages/invalid_rewards"].as_f64().unwrap())
        .sum();
    assert!(
        missing > 0,
        "the judge's gaps left some response without a reward"
    );
    assert_eq!(logged, missing as f64);
    assert_eq!(
        dropped, missing as f64,
        "every response without MR left its group"
    );
    let trained: f64 = logs
        .iter()
        .map(|l| l["actor/samples"].as_f64().unwrap())
        .sum();
    assert!(trained <= (18 - missing) as f64);

    // Checkpoint at step 2, final after step 3: a model serve loads and chats with.
    let ckpt = out.join("checkpoint-2");
    assert!(ckpt.join("rl_state.json").is_file());
    let fin = out.join("final");
    for f in [
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "optimizer.safetensors",
    ] {
        assert!(fin.join(f).is_file(), "final/{f}");
    }
    let st: Value =
        serde_json::from_str(&std::fs::read_to_string(fin.join("rl_state.json")).unwrap()).unwrap();
    assert_eq!(st["updates"], 3);
    let backend = LocalBackend::load(&ModelSpec::HfDir(fin.clone()), &LoadOptions::default())
        .await
        .unwrap();
    let resp = backend
        .chat(&ChatRequest::new(vec![ChatMessage::user("hi".to_string())]).max_tokens(4))
        .await
        .unwrap();
    assert_eq!(resp.choices.len(), 1);
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("rl_summary.json")).unwrap())
            .unwrap();
    assert_eq!(summary["steps"], 3);

    // A finished run resumed: nothing to do, no model call, nothing rewritten.
    let calls = server.requests();
    let text = ok(&run_bin(&args(&server, &model, &out, &["--resume"])).await);
    assert!(text.contains("nothing to do"), "{text}");
    assert_eq!(server.requests(), calls);
    assert_eq!(jsonl(&out.join("logs.jsonl")).len(), 3);

    // The same directory without --resume is refused.
    let o = run_bin(&args(&server, &model, &out, &[])).await;
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--resume"));
}

#[tokio::test(flavor = "multi_thread")]
async fn resume_after_a_checkpoint_takes_the_same_next_steps() {
    let server = server().await;
    let (_g, model) = tiny();
    let tmp = tempfile::tempdir().unwrap();
    let full = tmp.path().join("full");
    ok(&run_bin(&args(&server, &model, &full, &["--save-steps", "1"])).await);

    // The same run, "killed" after checkpoint-1 (later state and the request cache gone,
    // so the resumed steps sample again from the restored weights).
    let killed = tmp.path().join("killed");
    ok(&run_bin(&args(&server, &model, &killed, &["--save-steps", "1"])).await);
    for d in ["final", "checkpoint-2"] {
        std::fs::remove_dir_all(killed.join(d)).unwrap();
    }
    std::fs::remove_file(killed.join("cache")).unwrap();
    // A changed math setting is refused by name.
    let o = run_bin(&args(
        &server,
        &model,
        &killed,
        &["--save-steps", "1", "--resume", "--lr", "2e-3"],
    ))
    .await;
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("lr"), "{err}");
    ok(&run_bin(&args(
        &server,
        &model,
        &killed,
        &["--save-steps", "1", "--resume"],
    ))
    .await);

    let (a, b) = (
        jsonl(&full.join("logs.jsonl")),
        jsonl(&killed.join("logs.jsonl")),
    );
    assert_eq!(b.len(), 3, "steps after the checkpoint were redone once");
    for step in 0..3 {
        assert_eq!(
            a[step]["num_tokens"], b[step]["num_tokens"],
            "counted on from the checkpoint"
        );
    }
    for step in 1..3 {
        for k in ["loss", "grad_norm", "kl", "reward", "actor/ratio_mean"] {
            let (x, y) = (a[step][k].as_f64().unwrap(), b[step][k].as_f64().unwrap());
            assert!(
                (x - y).abs() <= 1e-6 * x.abs().max(1e-3),
                "step {} {k}: {x} vs {y}",
                step + 1
            );
        }
    }
    let (ra, rb) = (
        jsonl(&full.join("rollouts.jsonl")),
        jsonl(&killed.join("rollouts.jsonl")),
    );
    assert_eq!(ra, rb, "the same prompts, responses, futures and scores");
}

/// A run "killed" before any checkpoint (its final/ and summary gone) resumes from step 0:
/// the steps it logged and the rollouts it recorded are played again, so their lines go
/// first; each step has one line in logs.jsonl.
#[tokio::test(flavor = "multi_thread")]
async fn resume_without_a_checkpoint_logs_each_step_once() {
    let server = server().await;
    let (_g, model) = tiny();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    ok(&run_bin(&args(&server, &model, &out, &[])).await);
    std::fs::remove_dir_all(out.join("final")).unwrap();
    std::fs::remove_file(out.join("rl_summary.json")).unwrap();
    let rollouts = jsonl(&out.join("rollouts.jsonl")).len();
    ok(&run_bin(&args(&server, &model, &out, &["--resume"])).await);
    let steps: Vec<u64> = jsonl(&out.join("logs.jsonl"))
        .iter()
        .map(|l| l["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, vec![1, 2, 3]);
    assert_eq!(jsonl(&out.join("rollouts.jsonl")).len(), rollouts);
}

/// `--resume` on a policy whose weights were replaced under the same path is refused by name
/// (`rl_config.json` records the weights' fingerprint as `model_sha256`).
#[tokio::test(flavor = "multi_thread")]
async fn resume_refuses_a_model_whose_weights_changed_under_the_same_path() {
    let server = server().await;
    let (_g, model) = tiny();
    let (_g2, other) = model_util::tiny_model_dir(&TinySpec {
        seed: 99,
        ..TinySpec::default()
    });
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    ok(&run_bin(&args(&server, &model, &out, &["--max-steps", "1"])).await);
    let recorded: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("rl_config.json")).unwrap())
            .unwrap();
    assert_eq!(recorded["model_sha256"].as_str().map(str::len), Some(16));
    std::fs::copy(
        other.join("model.safetensors"),
        model.join("model.safetensors"),
    )
    .unwrap();
    let o = run_bin(&args(
        &server,
        &model,
        &out,
        &["--max-steps", "2", "--resume"],
    ))
    .await;
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("model-sha256"), "{err}");
    assert_eq!(jsonl(&out.join("logs.jsonl")).len(), 1);
}

/// `--resume` on a task file whose content changed at the same path is refused by name.
#[tokio::test(flavor = "multi_thread")]
async fn resume_refuses_tasks_that_changed_under_the_same_path() {
    let server = server().await;
    let (_g, model) = tiny();
    let tmp = tempfile::tempdir().unwrap();
    let tasks = tmp.path().join("tasks.jsonl");
    std::fs::copy(data("math.jsonl"), &tasks).unwrap();
    let out = tmp.path().join("run");
    let t = tasks.to_str().unwrap();
    ok(&run_bin(&args(
        &server,
        &model,
        &out,
        &["--tasks", t, "--max-steps", "1"],
    ))
    .await);
    let text = std::fs::read_to_string(&tasks).unwrap();
    std::fs::write(
        &tasks,
        text.replacen("\"prompt\": \"", "\"prompt\": \"Now: ", 1),
    )
    .unwrap();
    let o = run_bin(&args(
        &server,
        &model,
        &out,
        &["--tasks", t, "--max-steps", "2", "--resume"],
    ))
    .await;
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("tasks-sha256"), "{err}");
    assert_eq!(jsonl(&out.join("logs.jsonl")).len(), 1);
}

/// `--opening task --samples 0`: the task's prompt verbatim, each response scored alone (the
/// single-turn reward TRL optimises): the simulated user is never asked, and a single on-policy
/// optimizer step takes its old log-probs from its own pass (ratio exactly 1).
#[tokio::test(flavor = "multi_thread")]
async fn single_turn_from_task_prompts_never_calls_the_user() {
    let server = server().await;
    let (_g, model) = tiny();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("single");
    let extra = [
        "--opening",
        "task",
        "--samples",
        "0",
        "--ppo-epochs",
        "1",
        "--max-steps",
        "2",
        "--max-tokens",
        "judge=64",
        "--schedule",
        "linear",
    ];
    ok(&run_bin(&args(&server, &model, &out, &extra)).await);
    let received = server.received();
    assert!(!received.is_empty(), "the judge was asked");
    for r in &received {
        let text = r.body["messages"].to_string();
        assert!(!text.contains("role-playing a USER"), "a user call: {text}");
        assert_eq!(r.body["max_tokens"], 64, "--max-tokens judge=64");
    }
    let tasks: Vec<Value> = std::fs::read_to_string(data("math.jsonl"))
        .unwrap()
        .lines()
        .take(3)
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for r in jsonl(&out.join("rollouts.jsonl")) {
        let task = tasks.iter().find(|t| t["id"] == r["task_id"]).unwrap();
        assert_eq!(r["prompt"].as_array().unwrap().len(), 1);
        assert_eq!(r["prompt"][0]["content"], task["prompt"], "verbatim prompt");
        for resp in r["responses"].as_array().unwrap() {
            let sessions = resp["sessions"].as_array().unwrap();
            assert_eq!(sessions.len(), 1, "the response alone");
            assert!(sessions[0]["messages"].as_array().unwrap().is_empty());
            assert!(sessions[0]["scores"]["token_amount"]["value"].is_number());
        }
    }
    let logs = jsonl(&out.join("logs.jsonl"));
    assert_eq!(logs.len(), 2);
    assert_eq!(logs[0]["api/user/calls"].as_u64(), Some(0), "{}", logs[0]);
    for l in &logs {
        if l["actor/samples"].as_f64() > Some(0.0) {
            assert_eq!(l["actor/ratio_min"], 1.0, "{l}");
            assert_eq!(l["actor/ratio_max"], 1.0, "{l}");
        }
    }
    // Linear decay over the run's 2 optimizer steps: 1e-3, then 5e-4.
    assert_eq!(logs[0]["learning_rate"], 1e-3);
    assert!((logs[1]["learning_rate"].as_f64().unwrap() - 5e-4).abs() < 1e-12);
}

/// `--opening dataset`: the prompts are the conversation prefixes of an upstream flat parquet
/// file (multi-turn histories ending with the user), each scored against its task.
#[tokio::test(flavor = "multi_thread")]
async fn dataset_opening_trains_on_the_flat_files_multi_turn_prefixes() {
    use collabllm::dataset::{write_flat_parquet, FlatRow};
    let server = server().await;
    let (_g, model) = tiny();
    let tmp = tempfile::tempdir().unwrap();
    let row = |conv: &str, turn: u32, prompt: Vec<ChatMessage>, goal: &str| FlatRow {
        prompt,
        completion: "c".into(),
        conv_id: conv.into(),
        turn_id: turn,
        score: 0.5,
        single_turn_prompt: goal.into(),
        single_turn_completion: "4".into(),
        single_turn_metadata: serde_json::json!({"task_type": "math"}),
        sessions: Value::Null,
        rewards: Value::Null,
    };
    let second_turn = vec![
        ChatMessage::user("I need a sum.".to_string()),
        ChatMessage::assistant("Which numbers?".to_string()),
        ChatMessage::user("Two and two.".to_string()),
    ];
    let rows = vec![
        row(
            "a",
            0,
            vec![ChatMessage::user("I need a sum.".to_string())],
            "What is 2+2?",
        ),
        row("a", 1, second_turn.clone(), "What is 2+2?"),
        row("a", 1, second_turn.clone(), "What is 2+2?"),
    ];
    let flat = tmp.path().join("flat.parquet");
    write_flat_parquet(&flat, &rows).unwrap();
    let out = tmp.path().join("prefixes");
    let extra = [
        "--tasks",
        flat.to_str().unwrap(),
        "--opening",
        "dataset",
        "--max-steps",
        "2",
        "--ppo-epochs",
        "1",
    ];
    ok(&run_bin(&args(&server, &model, &out, &extra)).await);
    let rollouts = jsonl(&out.join("rollouts.jsonl"));
    assert_eq!(rollouts.len(), 4, "2 prompts × 2 steps");
    let lens: std::collections::BTreeSet<usize> = rollouts
        .iter()
        .map(|r| r["prompt"].as_array().unwrap().len())
        .collect();
    assert_eq!(lens, [1, 3].into(), "both prefixes, verbatim");
    let three = rollouts
        .iter()
        .find(|r| r["prompt"].as_array().unwrap().len() == 3)
        .unwrap();
    assert_eq!(three["prompt"][2]["content"], "Two and two.");
    for r in &rollouts {
        assert!(r["task_id"].as_str().unwrap().starts_with("flat-"));
    }

    // A JSONL task file has no prefixes: refused before any model call.
    let before = server.requests();
    let o = run_bin(&args(
        &server,
        &model,
        &tmp.path().join("refused"),
        &["--opening", "dataset"],
    ))
    .await;
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("--opening dataset"), "{err}");
    assert_eq!(server.requests(), before);
}

#[tokio::test(flavor = "multi_thread")]
async fn online_dpo_with_lora_writes_a_peft_adapter() {
    let server = server().await;
    let (_g, model) = tiny();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("dpo");
    ok(&run_bin(&args(
        &server,
        &model,
        &out,
        &[
            "--algo",
            "online_dpo",
            "--lora-r",
            "4",
            "--max-steps",
            "2",
            "--min-gap",
            "0",
            "--ppo-epochs",
            "1",
        ],
    ))
    .await);
    let logs = jsonl(&out.join("logs.jsonl"));
    assert_eq!(logs.len(), 2);
    for l in &logs {
        let pairs = l["actor/dpo/pairs"].as_f64().unwrap();
        assert!(
            (0.0..=2.0).contains(&pairs),
            "one pair per group at most: {l}"
        );
    }
    let pairs: f64 = logs
        .iter()
        .map(|l| l["actor/dpo/pairs"].as_f64().unwrap())
        .sum();
    assert!(pairs > 0.0, "{logs:?}");
    let first = logs
        .iter()
        .find(|l| l["actor/dpo/pairs"].as_f64() > Some(0.0))
        .unwrap();
    // The first DPO step starts at the reference: loss ln 2.
    if first["step"] == 1.0 {
        assert!(
            (first["actor/dpo/loss"].as_f64().unwrap() - 2f64.ln()).abs() < 1e-4,
            "{first}"
        );
    }
    let fin = out.join("final");
    assert!(fin.join("adapter_model.safetensors").is_file());
    assert!(fin.join("adapter_config.json").is_file());
    assert!(!fin.join("model.safetensors").exists());
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_input_is_refused_before_any_model_call() {
    let server = server().await;
    let (_g, model) = tiny();
    let tmp = tempfile::tempdir().unwrap();
    let no_reference = tmp.path().join("tasks.jsonl");
    std::fs::write(
        &no_reference,
        "{\"id\": \"a\", \"task_type\": \"math\", \"prompt\": \"2+2?\"}\n",
    )
    .unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--group-size", "1"], "group_size"),
        (vec!["--clip-ratio", "0"], "--clip-ratio"),
        (vec!["--clip-ratio", "-0.2"], "--clip-ratio"),
        (vec!["--lr", "NaN"], "--lr"),
        (vec!["--kl-coef", "inf"], "--kl-coef"),
        (vec!["--temperature", "0"], "--temperature"),
        (vec!["--group-size", "99999999999"], "group_size"),
        (vec!["--samples", "99999999999"], "samples"),
        (vec!["--lora-r", "100000"], "lora_r"),
        (vec!["--max-new-tokens", "99999999999"], "max_new_tokens"),
        (vec!["--batch-prompts", "99999999999"], "batch_prompts"),
        (vec!["--model", "openai:gpt-4o"], "model"),
        (
            vec![
                "--tasks",
                no_reference.to_str().unwrap(),
                "--metric",
                "accuracy=1",
            ],
            "reference",
        ),
    ];
    for (extra, needle) in cases {
        let out = tmp.path().join("never");
        let o = run_bin(&args(&server, &model, &out, &extra)).await;
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{extra:?} was accepted");
        assert!(err.contains(needle), "{extra:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
        assert!(!out.exists(), "{extra:?} left {}", out.display());
    }
    assert_eq!(server.requests(), 0, "bad input made model calls");
}

/// A finite rate can still overflow the weights: the run stops at that update and saves
/// nothing from it (no checkpoint of NaN weights to resume from or publish).
#[tokio::test(flavor = "multi_thread")]
async fn a_rate_that_overflows_the_weights_stops_before_saving() {
    let server = server().await;
    let (_g, model) = tiny();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let o = run_bin(&args(
        &server,
        &model,
        &out,
        &["--lr", "1e300", "--save-steps", "1", "--ppo-epochs", "1"],
    ))
    .await;
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("made weight"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let saved: Vec<_> = std::fs::read_dir(&out)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("checkpoint") || n == "final")
        .collect();
    assert!(
        saved.is_empty(),
        "saved {saved:?} after the weights overflowed"
    );
}

/// SIGINT stops the run after the step in progress: that step is saved as a checkpoint,
/// rl_summary.json says `interrupted`, the exit code is 130, and --resume continues there.
#[tokio::test(flavor = "multi_thread")]
async fn sigint_saves_the_finished_step_and_resume_continues_from_it() {
    let server = server().await;
    let (_g, model) = tiny();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let flags = args(&server, &model, &out, &["--max-steps", "500"]);
    let child = command(&flags)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let logs = out.join("logs.jsonl");
    let waited = logs.clone();
    tokio::task::spawn_blocking(move || common::wait_for_first_log_line(&waited))
        .await
        .unwrap();
    let pid = child.id().unwrap() as i32;
    // SAFETY: kill(2) on the pid of a child this test started and has not reaped.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGINT) }, 0);
    let done = child.wait_with_output().await.unwrap();
    let stderr = String::from_utf8_lossy(&done.stderr);
    assert_eq!(done.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("interrupted by SIGINT"), "{stderr}");
    let steps = jsonl(&logs).len();
    assert!((1..500).contains(&steps), "{steps}");
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("rl_summary.json")).unwrap())
            .unwrap();
    assert_eq!(summary["status"], "interrupted", "{summary}");
    assert_eq!(summary["signal"], "SIGINT");
    assert_eq!(summary["steps"], steps);
    assert!(out.join(format!("checkpoint-{steps}")).is_dir());
    assert!(!out.join("final").exists());

    let more = (steps + 1).to_string();
    ok(&run_bin(&args(
        &server,
        &model,
        &out,
        &["--max-steps", &more, "--resume"],
    ))
    .await);
    assert_eq!(jsonl(&logs).len(), steps + 1);
    assert!(out.join("final").is_dir());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_writer_on_one_output_is_refused_naming_the_holder() {
    let server = server().await;
    let (_m, model) = tiny();
    let out = tempfile::tempdir().unwrap();
    let _held = collabllm::run::RunLock::acquire(out.path()).unwrap();
    let res = run_bin(&args(&server, &model, out.path(), &[])).await;
    let text = String::from_utf8_lossy(&res.stderr).to_string();
    assert!(!res.status.success(), "{text}");
    assert!(
        text.contains(&format!("pid {}", std::process::id())),
        "the error names the holder: {text}"
    );
    assert!(!out.path().join("logs.jsonl").exists(), "nothing written");
    assert_eq!(server.requests(), 0, "no model call");
}

/// 20 Questions online: the oracle (the table) is the user, rewards are exact; no model call
/// goes to the user endpoint.
#[tokio::test(flavor = "multi_thread")]
async fn twenty_questions_trains_against_the_table_oracle_with_exact_rewards() {
    let server = server().await;
    let (_g, model) = tiny();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("20q");
    let extra = [
        "--tasks",
        "20q:train",
        "--max-tasks",
        "2",
        "--metric-preset",
        "20q-infogain",
        "--samples",
        "1",
        "--max-steps",
        "1",
        "--ppo-epochs",
        "1",
        "--batch-prompts",
        "4",
        "--midgame",
        "8",
    ];
    ok(&run_bin(&args(&server, &model, &out, &extra)).await);
    for r in server.received() {
        let text = r.body["messages"].to_string();
        assert!(!text.contains("role-playing a USER"), "a user call: {text}");
    }
    let rollouts = jsonl(&out.join("rollouts.jsonl"));
    assert!(!rollouts.is_empty());
    // --midgame: prompts are games after 0..=8 of the demonstrator's questions (the table's
    // answers), ending with an answer; at least one of the four is past the opening.
    let world = collabllm::task::twenty_questions::chat::default_world().unwrap();
    let lengths: Vec<usize> = rollouts
        .iter()
        .map(|r| r["prompt"].as_array().unwrap().len())
        .collect();
    assert!(lengths.iter().any(|&n| n > 1), "{lengths:?}");
    for r in &rollouts {
        let prompt = r["prompt"].as_array().unwrap();
        assert!(
            prompt.len() % 2 == 1 && prompt.len() <= 17,
            "{}",
            prompt.len()
        );
        for (k, m) in prompt.iter().enumerate().skip(1) {
            let text = m["content"].as_str().unwrap();
            if k % 2 == 1 {
                assert_eq!(m["role"], "assistant");
                assert!(world.parse(text).is_some(), "{text}");
            } else {
                assert!(text == "Yes." || text == "No.", "{text}");
            }
        }
    }
    for r in &rollouts {
        assert!(r["task_id"].as_str().unwrap().starts_with("20q-"));
        let opening = r["prompt"][0]["content"].as_str().unwrap();
        assert!(
            opening.starts_with("You are playing 20 Questions"),
            "{opening}"
        );
        for resp in r["responses"].as_array().unwrap() {
            let s = &resp["sessions"][0];
            let answer = s["messages"][0]["content"].as_str().unwrap();
            assert!(answer == "Yes." || answer == "No.", "{answer}");
            for m in ["info_gain", "success"] {
                assert_eq!(s["scores"][m]["method"], "20q-table", "{s}");
                let v = s["scores"][m]["value"].as_f64().unwrap();
                assert!((0.0..=1.0).contains(&v), "{m} {v}");
            }
        }
    }
    let logs = jsonl(&out.join("logs.jsonl"));
    assert_eq!(logs[0]["api/user/calls"].as_u64(), Some(0), "{}", logs[0]);
    assert!(logs[0]["rewards/info_gain/mean"].is_number(), "{}", logs[0]);
}

/// Clarify-or-answer: the scripted user opens with the request, answers a question with the
/// detail and ends after an answer — no call to the user endpoint; the multiturn-aware
/// reward scores a future, the single-turn reward (`--samples 0`) the reply alone.
#[tokio::test(flavor = "multi_thread")]
async fn clarify_trains_with_the_scripted_user_and_both_rewards() {
    let server = server().await;
    let (_g, model) = tiny();
    let tmp = tempfile::tempdir().unwrap();
    for samples in ["1", "0"] {
        let out = tmp.path().join(format!("clarify-{samples}"));
        let extra = [
            "--tasks",
            "clarify:train",
            "--max-tasks",
            "4",
            "--samples",
            samples,
            "--max-steps",
            "1",
            "--ppo-epochs",
            "1",
            "--metric",
            "detail_used=1",
            "--metric",
            "clarifying_questions=-0.3",
        ];
        // `--metric` adds to the defaults' interactivity/token_amount: drop those.
        let mut a = args(&server, &model, &out, &extra);
        for dropped in ["interactivity=1", "token_amount=-1"] {
            let i = a.iter().position(|x| x == dropped).unwrap();
            a.drain(i - 1..=i);
        }
        ok(&run_bin(&a).await);
        // The ask rates of the step's sampled responses, vague and stated apart.
        let mut asked: HashMap<bool, (usize, usize)> = HashMap::new();
        for r in jsonl(&out.join("rollouts.jsonl")) {
            let vague = r["task_id"].as_str().unwrap().ends_with("-vague");
            let e = asked.entry(vague).or_default();
            for resp in r["responses"].as_array().unwrap() {
                e.0 += usize::from(resp["text"].as_str().unwrap().contains('?'));
                e.1 += 1;
            }
        }
        let logs = jsonl(&out.join("logs.jsonl"));
        for (vague, (k, n)) in &asked {
            let key = if *vague {
                "clarify/asked_vague"
            } else {
                "clarify/asked_stated"
            };
            assert_eq!(
                logs[0][key].as_f64(),
                Some(*k as f64 / *n as f64),
                "{}",
                logs[0]
            );
        }
        for r in jsonl(&out.join("rollouts.jsonl")) {
            let request = r["prompt"][0]["content"].as_str().unwrap();
            assert!(request.starts_with("Write a "), "{request}");
            for resp in r["responses"].as_array().unwrap() {
                let s = &resp["sessions"][0];
                let future = s["messages"].as_array().unwrap();
                if samples == "0" {
                    assert!(future.is_empty());
                } else {
                    let said = future[0]["content"].as_str().unwrap();
                    let asked = resp["text"].as_str().unwrap().contains('?');
                    assert_eq!(said == "[[TERMINATE CHAT]]", !asked, "{resp}");
                }
                for m in ["detail_used", "clarifying_questions"] {
                    assert_eq!(s["scores"][m]["method"], "programmatic", "{s}");
                }
            }
        }
        let logs = jsonl(&out.join("logs.jsonl"));
        assert_eq!(logs[0]["api/user/calls"].as_u64(), Some(0), "{}", logs[0]);
    }
    for r in server.received() {
        let text = r.body["messages"].to_string();
        assert!(!text.contains("role-playing a USER"), "a user call: {text}");
    }
}

/// `rl_train --model DIR` runs a step on each model family besides llama (tiny checkpoints
/// transformers wrote), and its checkpoint states the family.
#[tokio::test(flavor = "multi_thread")]
async fn every_model_family_runs_a_step() {
    let server = server().await;
    let tmp = tempfile::tempdir().unwrap();
    // Short prompts: the fixtures' byte-level tokenizer and 256-position context.
    let tasks = tmp.path().join("tasks.jsonl");
    let rows: Vec<String> = [
        ("t1", "2+2?", "4"),
        ("t2", "3*3?", "9"),
        ("t3", "5-1?", "4"),
    ]
    .iter()
    .map(|(id, q, a)| {
        serde_json::json!({"id": id, "task_type": "math", "prompt": q, "reference": a,
                "metadata": {}})
        .to_string()
    })
    .collect();
    std::fs::write(&tasks, rows.join("\n")).unwrap();
    for family in ["qwen2", "qwen3", "mistral", "gemma3_text"] {
        let model = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/families")
            .join(family);
        let out = tmp.path().join(family);
        let extra = [
            "--tasks",
            tasks.to_str().unwrap(),
            "--opening",
            "task",
            "--samples",
            "0",
            "--ppo-epochs",
            "1",
            "--max-steps",
            "1",
        ];
        ok(&run_bin(&args(&server, &model, &out, &extra)).await);
        let logs = jsonl(&out.join("logs.jsonl"));
        assert_eq!(logs.len(), 1, "{family}: one step");
        let config: Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("final/config.json")).unwrap())
                .unwrap();
        assert_eq!(config["model_type"], family);
    }
}

/// `--compat verl`: the recipe's values are recorded (a flag still wins), a response cut at
/// the token cap scores 0 and plays no future (no simulated-user call for it), and the
/// update trains on the token ids the sampler drew, which here do not all survive decoding
/// and re-encoding.
#[tokio::test(flavor = "multi_thread")]
async fn compat_verl_zeroes_truncated_responses_and_trains_the_sampled_ids() {
    let server = server().await;
    let (_g, model) = tiny();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("verl");
    let extra = [
        "--compat",
        "verl",
        // Flags win over the preset: a small CPU run, the test server's judge scale.
        "--interactivity-scale",
        "v2",
        "--ppo-mini-batch",
        "1",
        "--ppo-epochs",
        "1",
        "--max-length",
        "1024",
        "--max-new-tokens",
        "40",
        "--group-size",
        "6",
        "--max-steps",
        "1",
    ];
    ok(&run_bin(&args(&server, &model, &out, &extra)).await);

    let read = |f: &str| -> Value {
        serde_json::from_str(&std::fs::read_to_string(out.join(f)).unwrap()).unwrap()
    };
    let summary = read("rl_summary.json");
    assert_eq!(summary["compat"]["preset"], "verl", "{summary}");
    for (k, v) in [
        ("lr", serde_json::json!(1e-6)),
        ("kl_coef", serde_json::json!(0.001)),
        ("truncated", serde_json::json!("zero")),
        ("token_counter", serde_json::json!("words")),
        ("mr_formula", serde_json::json!("verl_clamp")),
        ("ppo_mini_batch", serde_json::json!(8)),
    ] {
        assert_eq!(summary["compat"]["set"][k], v, "{k}");
    }
    let config = read("rl_config.json");
    assert_eq!(config["compat"], summary["compat"]);
    assert_eq!(config["interactivity_scale"], "v2", "the flag won");
    assert_eq!(config["ppo_mini_batch"], 1);
    assert_eq!(config["lr"], 1e-3, "the test's --lr won");
    assert_eq!(config["mr_formula"], "verl_clamp");

    let codec = collabllm::engine::ChatCodec::load(&collabllm::llm::spec::LocalModelFiles::HfDir(
        model.clone(),
    ))
    .unwrap();
    let (mut truncated, mut scored, mut sampled_tokens, mut re_encoded_tokens) = (0, 0, 0, 0);
    let mut differs = false;
    for g in jsonl(&out.join("rollouts.jsonl")) {
        let prompt: Vec<ChatMessage> = serde_json::from_value(g["prompt"].clone()).unwrap();
        let responses = g["responses"].as_array().unwrap();
        let valid = responses.iter().filter(|r| r["reward"].is_number()).count();
        for r in responses {
            let ids: Vec<u32> = serde_json::from_value(r["token_ids"].clone()).unwrap();
            assert_eq!(r["tokens"], ids.len(), "{r}");
            let cut = r["finish_reason"] == "length";
            if cut {
                truncated += 1;
                assert_eq!(r["reward"], 0.0, "{r}");
                assert!(r["sessions"].as_array().unwrap().is_empty(), "no futures");
            } else {
                scored += 1;
                assert_eq!(r["sessions"].as_array().unwrap().len(), 2, "{r}");
                // verl's word count: every message after the prompt.
                let s = &r["sessions"][0];
                let mut words = r["text"].as_str().unwrap().split_whitespace().count();
                for m in s["messages"].as_array().unwrap() {
                    words += m["content"].as_str().unwrap().split_whitespace().count();
                }
                assert_eq!(s["scores"]["token_amount"]["detail"]["tokens"], words);
            }
            if r["reward"].is_number() && valid >= 2 {
                let text = r["text"].as_str().unwrap();
                let (_, again) =
                    collabllm::train::rl::batch::tokenize_response(&codec, &prompt, text, cut)
                        .unwrap();
                differs |= again != ids;
                sampled_tokens += ids.len();
                re_encoded_tokens += again.len();
            }
        }
    }
    assert!(truncated > 0, "some response hit the 40-token cap");
    assert!(scored > 0, "some response ended on its own");
    let logs = jsonl(&out.join("logs.jsonl"));
    let l = &logs[0];
    assert_eq!(l["responses/truncated_zero"], truncated as f64, "{l}");
    // The user opens 2 prompts, then plays the first turn of both futures of every response
    // that finished in one call (n = 2); the truncated ones cost nothing.
    assert_eq!(l["api/user/calls"], (2 + scored) as u64, "{l}");
    assert!(
        differs,
        "some sampled reply does not round-trip through its text"
    );
    assert_ne!(sampled_tokens, re_encoded_tokens);
    assert_eq!(
        l["actor/response_tokens"], sampled_tokens as f64,
        "the update trained the sampled ids: {l}"
    );
    assert_eq!(
        l["actor/optimizer_steps"], 2.0,
        "two mini-batches of one prompt"
    );
}

/// The clip acts: on the default model, a step in two mini-batches (`--ppo-mini-batch 1` of
/// 2 prompts) moves the weights between them, so the second mini-batch's importance ratio
/// leaves 1, and where it leaves [0.8, 1.2] the clip fraction is above 0. verl's and TRL's
/// names for both are logged.
#[tokio::test(flavor = "multi_thread")]
async fn two_mini_batches_move_the_ratio_and_the_clip_acts_on_the_default_model() {
    let server = server().await;
    let spec = format!("openai:scripted@{}", server.base_url);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("clip");
    let (tasks, out_s) = (data("math.jsonl"), out.display().to_string());
    let flags = [
        "--compat",
        "verl",
        "--tasks",
        &tasks,
        "--max-tasks",
        "2",
        "--output",
        &out_s,
        "--model",
        "default",
        "--user",
        &spec,
        "--judge",
        &spec,
        // A single-turn word-count reward needs no model call, and its differences are all
        // this test needs to move the weights.
        "--opening",
        "task",
        "--samples",
        "0",
        "--metric",
        "token_amount=-1",
        "--keep-length-only-groups",
        "--truncated",
        "futures",
        "--batch-prompts",
        "2",
        "--ppo-mini-batch",
        "1",
        "--group-size",
        "4",
        "--max-new-tokens",
        "24",
        "--max-length",
        "1024",
        "--lr",
        "1e-4",
        "--max-steps",
        "1",
        "--threads",
        "2",
    ]
    .map(String::from);
    let mut c = command(&flags);
    c.env_remove("CANDLE_NUM_THREADS");
    ok(&c.output().await.unwrap());
    let l = &jsonl(&out.join("logs.jsonl"))[0];
    assert_eq!(l["actor/optimizer_steps"], 2.0, "{l}");
    let (lo, hi) = (
        l["actor/ratio_min"].as_f64().unwrap(),
        l["actor/ratio_max"].as_f64().unwrap(),
    );
    assert!(lo < 1.0 && hi > 1.0, "the ratio moved: {lo} .. {hi}");
    assert!(
        lo < 0.8 || hi > 1.2,
        "some ratio left the band: {lo} .. {hi}"
    );
    assert!(l["actor/pg_clipfrac"].as_f64().unwrap() > 0.0, "{l}");
    assert!(l["clip_ratio/region_mean"].as_f64().unwrap() > 0.0, "{l}");
    assert_eq!(server.requests(), 0, "no model call besides the policy");
}
