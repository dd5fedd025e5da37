//! `generate_conv` end to end: the library on the tiny model with scripted roles, and the
//! binary against a local OpenAI-compatible server (kill and resume, injected faults,
//! re-scoring without model calls, bad input).

mod common;
use collabllm::rollout::config::RolloutConfig;
use common::model_util;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use arrow::array::{Array, Float64Array, Int64Array, ListArray, StringArray, StructArray};
use arrow::datatypes::{DataType, Field, Fields};
use collabllm::engine::tiny::TinySpec;
use collabllm::generate::{generate_with_roles, GenerateConfig, Roles};
use collabllm::llm::roles::Role;
use collabllm::llm::scripted::ScriptedBackend;
use common::collab_script;
use common::fault_server::{Fault, FaultServer};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use serde_json::Value;

fn data(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("data")
        .join(name)
        .display()
        .to_string()
}

fn scripted(name: &str) -> std::sync::Arc<ScriptedBackend> {
    ScriptedBackend::new(name, |req, i| {
        let prompt = &req
            .messages
            .last()
            .map(|m| m.content.clone())
            .unwrap_or_default();
        Ok(collab_script::reply(prompt, req.seed.unwrap_or(0), i))
    })
}

/// Runs `cfg` on its tasks with these policy and assistant roles and the scripted user and
/// judge.
async fn generate_scripted(
    cfg: &GenerateConfig,
    policy: Role,
    assistant: Role,
) -> collabllm::generate::RunSummary {
    let roles = Roles {
        policy,
        assistant,
        user: Role::from_backend("user", "scripted", scripted("user"), None, None),
        judge: Role::from_backend("judge", "scripted", scripted("judge"), None, None),
    };
    let tasks = cfg.task_source().load().unwrap();
    generate_with_roles(cfg.clone(), tasks, roles)
        .await
        .unwrap()
}

fn message_list_type() -> DataType {
    let fields = Fields::from(vec![
        Field::new("role", DataType::Utf8, true),
        Field::new("content", DataType::Utf8, true),
    ]);
    DataType::List(std::sync::Arc::new(Field::new(
        "item",
        DataType::Struct(fields),
        true,
    )))
}

/// Reads a pairs parquet with the plain arrow reader; returns (conv_id, score_chosen,
/// score_rejected) per row after checking the schema.
fn read_pairs(path: &Path) -> Vec<(String, f64, f64)> {
    let file = std::fs::File::open(path).unwrap();
    let builder = ParquetRecordBatchReaderBuilder::try_new(file).unwrap();
    let schema = builder.schema().clone();
    let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
    assert_eq!(
        names,
        [
            "prompt",
            "chosen",
            "rejected",
            "score_chosen",
            "score_rejected",
            "conv_id",
            "turn_id"
        ]
    );
    for col in ["prompt", "chosen", "rejected"] {
        let dt = schema.field_with_name(col).unwrap().data_type();
        match (dt, message_list_type()) {
            (DataType::List(a), DataType::List(b)) => {
                assert_eq!(a.data_type(), b.data_type(), "{col}");
            }
            _ => panic!("{col} is {dt:?}"),
        }
    }
    assert_eq!(
        schema.field_with_name("score_chosen").unwrap().data_type(),
        &DataType::Float64
    );
    assert_eq!(
        schema.field_with_name("conv_id").unwrap().data_type(),
        &DataType::Utf8
    );
    assert_eq!(
        schema.field_with_name("turn_id").unwrap().data_type(),
        &DataType::Int64
    );
    let mut out = Vec::new();
    for batch in builder.build().unwrap() {
        let batch = batch.unwrap();
        let conv = batch
            .column_by_name("conv_id")
            .unwrap()
            .as_any()
            .downcast_ref::<StringArray>()
            .unwrap();
        let sc = batch
            .column_by_name("score_chosen")
            .unwrap()
            .as_any()
            .downcast_ref::<Float64Array>()
            .unwrap();
        let sr = batch
            .column_by_name("score_rejected")
            .unwrap()
            .as_any()
            .downcast_ref::<Float64Array>()
            .unwrap();
        let _turn = batch
            .column_by_name("turn_id")
            .unwrap()
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap();
        let chosen = batch
            .column_by_name("chosen")
            .unwrap()
            .as_any()
            .downcast_ref::<ListArray>()
            .unwrap();
        for i in 0..batch.num_rows() {
            let msgs = chosen.value(i);
            let msgs = msgs.as_any().downcast_ref::<StructArray>().unwrap();
            assert_eq!(msgs.len(), 1, "chosen is one assistant message");
            let role = msgs
                .column_by_name("role")
                .unwrap()
                .as_any()
                .downcast_ref::<StringArray>()
                .unwrap();
            assert_eq!(role.value(0), "assistant");
            out.push((conv.value(i).to_string(), sc.value(i), sr.value(i)));
        }
    }
    out
}

#[tokio::test]
async fn tiny_policy_and_scripted_roles_write_trl_pairs() {
    let (_g, policy) = model_util::load_tiny(&TinySpec::default()).await;
    let out = tempfile::tempdir().unwrap();
    let cfg = GenerateConfig {
        tasks: data("math.jsonl"),
        output: out.path().join("run"),
        candidates: 3,
        samples: 2,
        window: 2,
        max_messages: 6,
        max_tasks: Some(6),
        min_gap: 0.05,
        test_fraction: 0.34,
        policy_sampling: collabllm::rollout::user::Sampling {
            temperature: 1.0,
            top_p: 1.0,
            max_tokens: 16,
        },
        assistant_sampling: collabllm::rollout::user::Sampling {
            temperature: 1.0,
            top_p: 1.0,
            max_tokens: 16,
        },
        rollout: RolloutConfig {
            concurrency: 3,
            ..RolloutConfig::default()
        },
        ..GenerateConfig::default()
    };
    let engine = policy.engine().clone();
    let policy_role = Role::from_backend("policy", "tiny", policy, None, Some(engine));
    let summary = generate_scripted(&cfg, policy_role.clone(), policy_role).await;
    assert_eq!(summary.tasks_done_now, 6, "{summary}");
    assert!(summary.tasks_failed.is_empty(), "{summary}");

    let train = read_pairs(&cfg.output.join("pairs/train.parquet"));
    let test = read_pairs(&cfg.output.join("pairs/test.parquet"));
    assert!(!train.is_empty() && !test.is_empty(), "{summary}");
    for (_, c, r) in train.iter().chain(&test) {
        assert!(
            c >= &(r + cfg.min_gap - 1e-12),
            "chosen {c} vs rejected {r}"
        );
    }
    let train_convs: HashSet<&String> = train.iter().map(|p| &p.0).collect();
    let test_convs: HashSet<&String> = test.iter().map(|p| &p.0).collect();
    assert!(
        train_convs.is_disjoint(&test_convs),
        "split by conversation"
    );
    assert_eq!(
        summary.stats.pairs_train + summary.stats.pairs_test,
        train.len() + test.len()
    );

    // Every candidate, session and score is kept; the proactive/plain split is recorded.
    let text = std::fs::read_to_string(cfg.output.join("conversations.jsonl")).unwrap();
    let recs: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(recs.len(), 6);
    let turn = &recs[0]["turns"][0];
    assert_eq!(turn["candidates"].as_array().unwrap().len(), 3);
    let variants: Vec<&str> = turn["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["variant"].as_str().unwrap())
        .collect();
    assert_eq!(
        variants.iter().filter(|v| **v == "proactive").count(),
        1,
        "int(3 × 0.5), as upstream"
    );
    // Candidates cut at the 16-token cap are recorded and counted.
    let cut = recs
        .iter()
        .flat_map(|r| r["turns"].as_array().unwrap())
        .flat_map(|t| t["candidates"].as_array().unwrap())
        .filter(|c| c["finish_reason"] == "length")
        .count();
    assert!(cut > 0, "a 16-token cap cuts some tiny-model replies");
    assert_eq!(summary.stats.candidates_truncated, cut);
    assert!(summary
        .to_string()
        .contains(&format!("truncated      {cut} candidate(s)")));
    let session = &turn["candidates"][0]["sessions"][0];
    for m in ["accuracy", "interactivity", "token_amount"] {
        assert!(session["scores"][m]["value"].is_number(), "{m}: {session}");
    }
    assert!(session["scores"]["token_amount"]["method"]
        .as_str()
        .unwrap()
        .contains("tiny-llama tokenizer"));
    assert!(
        recs[0]["messages"][0]["content"].as_str().unwrap().len() > 3,
        "first user message is not empty"
    );
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(cfg.output.join("manifest.json")).unwrap())
            .unwrap();
    assert_eq!(manifest["status"], "complete");
    assert!(manifest["usage"]["judge"]["calls"].as_u64().unwrap() > 0);

    // flat.parquet in upstream's nested shape: per-session MR (averaging to the row's score),
    // per-session metric scores and the simulated futures.
    let flat = collabllm::dataset::read_flat_parquet(&cfg.output.join("flat.parquet")).unwrap();
    assert_eq!(flat.len(), summary.stats.candidates);
    for row in flat.iter().filter(|r| r.score.is_finite()) {
        let mr: Vec<f64> = row.rewards["MR"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(mr.len(), cfg.samples);
        let mean = mr.iter().sum::<f64>() / mr.len() as f64;
        assert!((mean - row.score).abs() < 1e-9, "{mean} vs {}", row.score);
        assert_eq!(
            row.rewards["accuracy"].as_array().unwrap().len(),
            cfg.samples
        );
        let sessions = row.sessions.as_array().unwrap();
        assert_eq!(sessions.len(), cfg.samples);
        assert_eq!(
            sessions[0][0]["role"], "user",
            "a future starts with the user"
        );
    }

    // Each conversation's own calls, attributed while three ran at once on shared roles, add
    // up to the run's calls per role.
    for role in ["policy", "user", "judge"] {
        for field in ["calls", "prompt_tokens", "completion_tokens"] {
            let per_conversation: u64 = recs
                .iter()
                .map(|r| r["usage"][role][field].as_u64().unwrap())
                .sum();
            assert_eq!(
                per_conversation,
                manifest["usage"][role][field].as_u64().unwrap(),
                "{role}.{field}"
            );
        }
        assert!(
            recs[0]["usage"][role]["calls"].as_u64().unwrap() > 0,
            "{role}"
        );
    }
    assert_eq!(
        manifest["usage_total"], manifest["usage"],
        "a single invocation"
    );
    assert!(manifest["finished_at"].as_f64().unwrap() >= manifest["started_at"].as_f64().unwrap());
    // The local policy costs nothing; scripted roles have no price, so neither has the run.
    assert_eq!(manifest["cost_usd"]["by_role"]["policy"], 0.0);
    assert!(manifest["cost_usd"]["by_role"]["judge"].is_null());
    assert!(manifest["cost_usd"]["total"].is_null());
}

// ---- the binary against a local OpenAI-compatible server ----

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_generate_conv")
}

async fn collab_server() -> FaultServer {
    let server = FaultServer::start().await;
    server.set_responder(collab_script::reply_to_body);
    server
}

fn endpoint_args(server: &FaultServer, out: &Path, tasks: &str) -> Vec<String> {
    let spec = format!("openai:scripted@{}", server.base_url);
    [
        "--tasks",
        tasks,
        "--output",
        out.to_str().unwrap(),
        "--policy",
        &spec,
        "--user",
        &spec,
        "--judge",
        &spec,
        "--candidates",
        "3",
        "--samples",
        "2",
        "--window",
        "2",
        "--max-messages",
        "4",
        "--concurrency",
        "2",
        "--max-retries",
        "6",
        "--timeout",
        "5",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

async fn run_bin(args: &[String]) -> std::process::Output {
    tokio::process::Command::new(bin())
        .args(args)
        .env("OPENAI_API_KEY", "test-key")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .await
        .expect("running generate_conv")
}

fn task_ids(out: &Path) -> Vec<String> {
    std::fs::read_to_string(out.join("conversations.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["task_id"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect()
}

/// Starts generate_conv with `args` and kills it (-9) once `dir` holds two finished
/// conversations (or after a minute); returns how many it holds then.
async fn kill_after_two_conversations(args: &[String], dir: &Path) -> usize {
    let mut child = tokio::process::Command::new(bin())
        .args(args)
        .env("OPENAI_API_KEY", "test-key")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while task_ids(dir).len() < 2 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    child.start_kill().unwrap();
    let _ = child.wait().await;
    task_ids(dir).len()
}

/// Each conversation's turns (candidates, futures, scores, choices) by task id.
/// `--merge` of the shard directories `shards` under `root` into `root/out`.
fn merge_args(root: &Path, shards: &[&str], out: &str) -> Vec<String> {
    let mut a: Vec<String> = vec!["--merge".into()];
    a.extend(shards.iter().map(|s| root.join(s).display().to_string()));
    a.extend(["--output".into(), root.join(out).display().to_string()]);
    a
}

fn turns_by_task(out: &Path) -> std::collections::BTreeMap<String, Value> {
    std::fs::read_to_string(out.join("conversations.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let r: Value = serde_json::from_str(l).unwrap();
            (
                r["task_id"].as_str().unwrap().to_string(),
                r["turns"].clone(),
            )
        })
        .collect()
}

/// Adaptive futures: every candidate has between the minimum and the maximum futures, the
/// counts differ where the ranking was in doubt, the MR is the mean over the futures it had,
/// and a run killed and resumed writes the same conversations as one left alone.
#[tokio::test]
async fn adaptive_futures_resume_to_the_same_conversations() {
    let server = collab_server().await;
    server.set_fault_rate(1.0, 1, vec![Fault::Delay(Duration::from_millis(5))]);
    let tmp = tempfile::tempdir().unwrap();
    let tasks = data("math.jsonl");
    let adaptive_args = |dir: &Path| {
        let mut args = endpoint_args(&server, dir, &tasks);
        let s = args.iter().position(|a| a == "--samples").unwrap();
        args[s + 1] = "adaptive".into();
        args.extend(
            [
                "--adaptive-min",
                "2",
                "--adaptive-max",
                "5",
                "--adaptive-z",
                "0.2",
                "--max-tasks",
                "6",
            ]
            .map(String::from),
        );
        args
    };
    let full = tmp.path().join("full");
    let out = run_bin(&adaptive_args(&full)).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let full_turns = turns_by_task(&full);
    assert_eq!(full_turns.len(), 6);
    let mut counts = Vec::new();
    let text = std::fs::read_to_string(full.join("conversations.jsonl")).unwrap();
    let records: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for rec in &records {
        let weights = rec["weights"].as_object().unwrap();
        for c in rec["turns"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|t| t["candidates"].as_array().unwrap())
        {
            let sessions = c["sessions"].as_array().unwrap();
            counts.push(sessions.len());
            let values: Vec<f64> = sessions
                .iter()
                .map(|s| {
                    weights
                        .iter()
                        .map(|(m, w)| {
                            w.as_f64().unwrap() * s["scores"][m]["value"].as_f64().unwrap()
                        })
                        .sum()
                })
                .collect();
            let mean = values.iter().sum::<f64>() / values.len() as f64;
            assert!((c["mr"].as_f64().unwrap() - mean).abs() < 1e-9, "{c}");
        }
    }
    assert!(counts.iter().all(|n| (2..=5).contains(n)), "{counts:?}");
    assert!(
        counts.contains(&2) && counts.iter().any(|&n| n > 2),
        "{counts:?}"
    );
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(full.join("manifest.json")).unwrap())
            .unwrap();
    assert_eq!(
        manifest["config"]["adaptive"]["max_futures"], 5,
        "{manifest}"
    );

    let killed = tmp.path().join("killed");
    let after_kill = kill_after_two_conversations(&adaptive_args(&killed), &killed).await;
    assert!(
        (2..6).contains(&after_kill),
        "killed after {after_kill} tasks"
    );
    let out = run_bin(&adaptive_args(&killed)).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(turns_by_task(&killed), full_turns);
}

/// An adaptive run's shards merge to the unsharded run (a shard with another rule refuses),
/// and re-scoring keeps each candidate's futures: its MR is the mean over the futures it had,
/// under the new weights, with no model call.
#[tokio::test]
async fn adaptive_runs_merge_and_rescore_without_calls() {
    let server = collab_server().await;
    let tmp = tempfile::tempdir().unwrap();
    let tasks = data("math.jsonl");
    let args = |dir: &str, extra: &[&str]| {
        let mut a = endpoint_args(&server, &tmp.path().join(dir), &tasks);
        let s = a.iter().position(|x| x == "--samples").unwrap();
        a[s + 1] = "adaptive".into();
        if !extra.contains(&"--adaptive-min") {
            a.extend(["--adaptive-min", "2"].map(String::from));
        }
        a.extend(
            [
                "--adaptive-max",
                "4",
                "--adaptive-z",
                "0.2",
                "--max-tasks",
                "4",
                "--min-gap",
                "0",
            ]
            .map(String::from),
        );
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    for (dir, extra) in [
        ("all", vec![]),
        ("s0", vec!["--shard", "0/2"]),
        ("s1", vec!["--shard", "1/2"]),
        ("s1-wide", vec!["--shard", "1/2", "--adaptive-min", "3"]),
    ] {
        let out = run_bin(&args(dir, &extra)).await;
        assert!(
            out.status.success(),
            "{dir}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let calls = server.requests();
    let merge = |shards: &[&str], out: &str| merge_args(tmp.path(), shards, out);
    let out = run_bin(&merge(&["s0", "s1-wide"], "mixed")).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "shards with two rules merged");
    assert!(stderr.contains("different settings"), "{stderr}");
    let out = run_bin(&merge(&["s0", "s1"], "merged")).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (all, merged) = (tmp.path().join("all"), tmp.path().join("merged"));
    assert_eq!(turns_by_task(&merged), turns_by_task(&all));

    let futures_per_candidate = |dir: &Path| -> Vec<usize> {
        turns_by_task(dir)
            .values()
            .flat_map(|turns| turns.as_array().unwrap().clone())
            .flat_map(|t| t["candidates"].as_array().unwrap().clone())
            .map(|c| c["sessions"].as_array().unwrap().len())
            .collect()
    };
    let before = futures_per_candidate(&merged);
    assert!(before.iter().any(|&n| n > 2), "{before:?}");
    let out = run_bin(
        &[
            "--output",
            merged.to_str().unwrap(),
            "--rescore",
            "--metric",
            "interactivity=1",
            "--min-gap",
            "0",
        ]
        .map(String::from),
    )
    .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        server.requests(),
        calls,
        "merging and re-scoring made calls"
    );
    assert_eq!(futures_per_candidate(&merged), before);
    // The new MR of every candidate: the mean interactivity of the futures it had.
    let means: Vec<f64> = turns_by_task(&merged)
        .values()
        .flat_map(|turns| turns.as_array().unwrap().clone())
        .flat_map(|t| t["candidates"].as_array().unwrap().clone())
        .map(|c| {
            let sessions = c["sessions"].as_array().unwrap();
            sessions
                .iter()
                .map(|s| s["scores"]["interactivity"]["value"].as_f64().unwrap())
                .sum::<f64>()
                / sessions.len() as f64
        })
        .collect();
    let pairs: Vec<_> = ["train", "test"]
        .iter()
        .flat_map(|split| read_pairs(&merged.join(format!("pairs/{split}.parquet"))))
        .collect();
    assert!(!pairs.is_empty());
    let is_a_mean = |v: f64| means.iter().any(|m| (m - v).abs() < 1e-9);
    for (_, chosen, rejected) in &pairs {
        assert!(chosen > rejected, "{chosen} {rejected}");
        assert!(
            is_a_mean(*chosen) && is_a_mean(*rejected),
            "{chosen} {rejected} {means:?}"
        );
    }
}

#[tokio::test]
async fn killed_run_resumes_to_the_same_tasks() {
    let server = collab_server().await;
    // Slow answers so that the kill lands mid-run.
    server.set_fault_rate(1.0, 1, vec![Fault::Delay(Duration::from_millis(15))]);
    let tmp = tempfile::tempdir().unwrap();
    let tasks = data("math.jsonl");
    let full = tmp.path().join("full");
    let mut args = endpoint_args(&server, &full, &tasks);
    args.extend(["--max-tasks".into(), "8".into()]);
    let out = run_bin(&args).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut expected = task_ids(&full);
    expected.sort();
    assert_eq!(expected.len(), 8);
    let full_calls = server.requests();

    let killed = tmp.path().join("killed");
    let mut args = endpoint_args(&server, &killed, &tasks);
    args.extend(["--max-tasks".into(), "8".into()]);
    let after_kill = kill_after_two_conversations(&args, &killed).await;
    assert!(
        (2..8).contains(&after_kill),
        "killed after {after_kill} tasks"
    );
    // The manifest of the killed run already accounts for the conversations it finished.
    let calls = |m: &serde_json::Value, field: &str| -> u64 {
        ["policy", "user", "judge"]
            .iter()
            .map(|r| m[field][r]["calls"].as_u64().unwrap_or(0))
            .sum()
    };
    let read_manifest = || -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(killed.join("manifest.json")).unwrap())
            .unwrap()
    };
    let killed_manifest = read_manifest();
    assert_eq!(killed_manifest["status"], "running");
    let finished: Vec<u64> = std::fs::read_to_string(killed.join("conversations.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let r: serde_json::Value = serde_json::from_str(l).unwrap();
            calls(&r, "usage")
        })
        .collect();
    assert!(finished.iter().all(|&c| c > 0), "{finished:?}");
    // The kill may land between the last append and its manifest update.
    let finished_calls: u64 = finished[..finished.len() - 1].iter().sum();
    assert!(
        calls(&killed_manifest, "usage_total") >= finished_calls,
        "{killed_manifest}"
    );

    let calls_before = server.requests();
    let out = run_bin(&args).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut ids = task_ids(&killed);
    ids.sort();
    assert_eq!(ids, expected, "same tasks, each exactly once");
    // Finished tasks were not redone, and half-finished ones replayed from the cache: the
    // resumed run made clearly fewer calls than a full run.
    let resumed_calls = server.requests() - calls_before;
    assert!(
        (resumed_calls as f64) < 0.9 * full_calls as f64,
        "resume made {resumed_calls} calls, a full run {full_calls}"
    );
    // Usage: this invocation's calls are exactly the requests it sent; the total counts every
    // call sent into this directory, the killed invocation's calls in flight included (a call
    // is recorded before it is sent: never fewer than the server received).
    let resumed_manifest = read_manifest();
    assert_eq!(calls(&resumed_manifest, "usage"), resumed_calls as u64);
    let total = calls(&resumed_manifest, "usage_total");
    assert!(total >= calls(&killed_manifest, "usage_total") + resumed_calls as u64);
    assert!(total >= (server.requests() - full_calls) as u64);
}

#[tokio::test]
async fn ten_percent_faults_are_absorbed_and_counted() {
    let server = collab_server().await;
    server.set_fault_rate(
        0.1,
        7,
        vec![
            Fault::Status(500),
            Fault::RateLimit(Some("0".into())),
            Fault::Malformed,
        ],
    );
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("run");
    let mut args = endpoint_args(&server, &out_dir, &data("math.jsonl"));
    args.extend(["--max-tasks".into(), "4".into()]);
    args.extend(["--price".into(), "openai:scripted=1.5,4".into()]);
    let out = run_bin(&args).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(server.faults_served() > 0);
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("manifest.json")).unwrap())
            .unwrap();
    let retries: u64 = ["policy", "user", "judge"]
        .iter()
        .map(|r| manifest["usage"][r]["retries"].as_u64().unwrap())
        .sum();
    assert!(
        retries >= server.faults_served() as u64,
        "retries {retries}"
    );
    assert!(stdout.contains("retries"), "{stdout}");
    assert_eq!(task_ids(&out_dir).len(), 4);
    // The price given for the model (without its URL) prices every role's answered tokens.
    let mut total = 0.0;
    for r in ["policy", "user", "judge"] {
        let u = &manifest["usage_total"][r];
        let expected = (u["prompt_tokens"].as_f64().unwrap() * 1.5
            + u["completion_tokens"].as_f64().unwrap() * 4.0)
            / 1e6;
        let cost = manifest["cost_usd"]["by_role"][r].as_f64().unwrap();
        assert!(
            cost > 0.0 && (cost - expected).abs() < 1e-12,
            "{r}: {cost} vs {expected}"
        );
        total += cost;
    }
    let reported = manifest["cost_usd"]["total"].as_f64().unwrap();
    assert!((reported - total).abs() < 1e-12);
}

#[tokio::test]
async fn rescore_makes_no_model_call_and_changes_pairs() {
    let server = collab_server().await;
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("run");
    let mut args = endpoint_args(&server, &out_dir, &data("math.jsonl"));
    args.extend([
        "--max-tasks".into(),
        "4".into(),
        "--min-gap".into(),
        "0.0".into(),
    ]);
    let out = run_bin(&args).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let before = read_pairs(&out_dir.join("pairs/train.parquet")).len()
        + read_pairs(&out_dir.join("pairs/test.parquet")).len();
    assert!(before > 0);
    let calls = server.requests();

    // Only token_amount counts now: MRs change sign and a huge gap leaves no pair.
    let rescore = |extra: &[&str]| {
        let mut a = vec![
            "--output".to_string(),
            out_dir.display().to_string(),
            "--rescore".into(),
        ];
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let out = run_bin(&rescore(&[
        "--metric",
        "token_amount=-1",
        "--min-gap",
        "1000",
    ]))
    .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(server.requests(), calls, "re-scoring made model calls");
    let after = read_pairs(&out_dir.join("pairs/train.parquet")).len()
        + read_pairs(&out_dir.join("pairs/test.parquet")).len();
    assert_eq!(after, 0);

    let out = run_bin(&rescore(&["--metric", "interactivity=1", "--min-gap", "0"])).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let pairs: Vec<_> = read_pairs(&out_dir.join("pairs/train.parquet"))
        .into_iter()
        .chain(read_pairs(&out_dir.join("pairs/test.parquet")))
        .collect();
    assert!(!pairs.is_empty());
    for (_, c, r) in &pairs {
        assert!(
            c > r && *c <= 1.0 && *r >= 0.0,
            "interactivity-only MR in [0,1]: {c} {r}"
        );
    }
    // A metric that was never computed cannot be weighted by re-scoring.
    let out = run_bin(&rescore(&["--metric", "bleu=1"])).await;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("bleu"));
    assert_eq!(server.requests(), calls);
}

#[tokio::test]
async fn bad_input_is_named_and_finished_outputs_survive() {
    let server = collab_server().await;
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("run");
    let mut args = endpoint_args(&server, &out_dir, &data("math.jsonl"));
    args.extend(["--max-tasks".into(), "2".into()]);
    assert!(run_bin(&args).await.status.success());
    let snapshot = |p: &Path| -> HashMap<PathBuf, Vec<u8>> {
        [
            "conversations.jsonl",
            "pairs/train.parquet",
            "pairs/test.parquet",
            "flat.parquet",
        ]
        .iter()
        .map(|f| (p.join(f), std::fs::read(p.join(f)).unwrap()))
        .collect()
    };
    let before = snapshot(&out_dir);

    // A task row without a prompt.
    let bad_tasks = tmp.path().join("bad.jsonl");
    std::fs::write(
        &bad_tasks,
        "{\"id\": \"a\", \"task_type\": \"math\", \"prompt\": \"1+1?\", \"reference\": \"2\"}\n{\"id\": \"b\", \"task_type\": \"math\", \"reference\": \"3\"}\n",
    )
    .unwrap();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            endpoint_args(&server, &out_dir, bad_tasks.to_str().unwrap()),
            "prompt",
        ),
        (
            {
                let mut a = endpoint_args(&server, &out_dir, &data("math.jsonl"));
                a.extend(["--metric".into(), "helpfulness=1".into()]);
                a
            },
            "helpfulness",
        ),
        (
            {
                let mut a = endpoint_args(&server, &out_dir, &data("math.jsonl"));
                a.extend(["--metric".into(), "accuracy=high".into()]);
                a
            },
            "accuracy=high",
        ),
    ];
    let calls = server.requests();
    for (args, needle) in cases {
        let out = run_bin(&args).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "should fail: {needle}");
        assert!(
            stderr.contains(needle),
            "error should name {needle}: {stderr}"
        );
        assert!(
            !stderr.contains("panicked") && !stderr.contains("RUST_BACKTRACE"),
            "{stderr}"
        );
    }
    assert_eq!(server.requests(), calls, "bad input made model calls");
    assert_eq!(snapshot(&out_dir), before, "finished outputs changed");
}

/// Out-of-range numbers, from flags or the config file, stop the run at start-up with an
/// error naming the setting, the value and the valid range (never a panic).
#[tokio::test]
async fn out_of_range_numbers_are_refused_at_start_up() {
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("run");
    let config = tmp.path().join("config.toml");
    let base = |extra: &[&str]| -> Vec<String> {
        ["--output", out_dir.to_str().unwrap()]
            .iter()
            .chain(extra)
            .map(|s| s.to_string())
            .collect()
    };
    let config_arg = ["--config", config.to_str().unwrap()];
    let cases: Vec<(Option<&str>, Vec<String>, &str)> = vec![
        (
            Some("sandbox_timeout_s = inf"),
            base(&config_arg),
            "`sandbox_timeout_s`: inf: must be a finite number in (0, 3600]",
        ),
        (
            Some("sandbox_timeout_s = 1e300"),
            base(&config_arg),
            "`sandbox_timeout_s`: 1e300: must be a finite number in (0, 3600]",
        ),
        (
            Some("[endpoint]\ntimeout_s = 1e30"),
            base(&config_arg),
            "timeout_s 1e30: must be a finite number in (0, 86400]",
        ),
        (
            Some("[user_sampling]\ntemperature = nan\ntop_p = 1.0\nmax_tokens = 9"),
            base(&config_arg),
            "`user_sampling.temperature`: NaN: must be a finite number >= 0",
        ),
        (
            None,
            base(&["--timeout", "1e30"]),
            "'1e30' for '--timeout <SECS>': must be a finite number in (0, 86400]",
        ),
        (
            None,
            base(&["--proact-ratio", "NaN"]),
            "'NaN' for '--proact-ratio <R>': must be a finite number in [0, 1]",
        ),
        (
            None,
            base(&["--min-gap", "-1"]),
            "'-1' for '--min-gap <G>': must be a finite number >= 0",
        ),
        (None, base(&["--metric", "accuracy=inf"]), "accuracy=inf"),
        (
            None,
            base(&["--samples", "adaptive", "--adaptive-z", "NaN"]),
            "'NaN' for '--adaptive-z <Z>': must be a finite number in (0, 10]",
        ),
        (
            Some("[adaptive]\nmax_futures = 65"),
            base(&config_arg),
            "max_futures 65: must be at most 64",
        ),
        (
            None,
            base(&["--samples", "many"]),
            "expected a number of futures (0 or more) or `adaptive`",
        ),
        (None, base(&["--metric", "accuracy=1e300"]), "at most"),
        (
            Some("candidates = 99999999999"),
            base(&config_arg),
            "candidates 99999999999: must be at most 1024",
        ),
        (
            Some("samples = 100000"),
            base(&config_arg),
            "samples 100000: must be at most 64",
        ),
    ];
    for (toml, args, needle) in cases {
        if let Some(t) = toml {
            std::fs::write(&config, t).unwrap();
        }
        let out = run_bin(&args).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(if toml.is_some() { 1 } else { 2 }),
            "{args:?}: {stderr}"
        );
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    // A setting of adaptive sampling without it is refused, not ignored.
    let out = run_bin(&base(&["--adaptive-max", "4"])).await;
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("--adaptive-min, --adaptive-max and --adaptive-z need --samples adaptive"));
    assert!(!out_dir.exists(), "a refused run created its output");
}

/// Upstream's defaults against an endpoint: per-role token caps in every request, the
/// proactive share asked with the JSON instruction (its `response` is the candidate), and the
/// interactivity judge on the chosen scale.
#[tokio::test]
async fn endpoint_run_uses_upstream_caps_proactive_json_and_the_chosen_scale() {
    let server = collab_server().await;
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let mut args = endpoint_args(&server, &out, &data("math.jsonl"));
    args.extend(
        [
            "--max-tasks",
            "1",
            "--max-tokens",
            "user=300",
            "--max-tokens",
            "judge=77",
            "--interactivity-scale",
            "v1",
        ]
        .map(String::from),
    );
    let run = run_bin(&args).await;
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let bodies: Vec<serde_json::Value> = server.received().into_iter().map(|r| r.body).collect();
    let prompt = |b: &serde_json::Value| {
        b["messages"].as_array().unwrap().last().unwrap()["content"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let cap = |b: &serde_json::Value| {
        b["max_completion_tokens"]
            .as_u64()
            .or_else(|| b["max_tokens"].as_u64())
            .unwrap()
    };
    let mut seen = HashSet::new();
    for b in &bodies {
        let p = prompt(b);
        let (role, want) = if p.contains("role-playing a USER") {
            ("user", 300)
        } else if p.contains("rating how well") || p.contains("grading whether") {
            ("judge", 77)
        } else {
            ("policy", 2048)
        };
        assert_eq!(cap(b), want, "{role}: {p}");
        seen.insert(role);
        if p.contains("rating how well") {
            assert!(p.contains("<1, 2 or 3>"), "v1 rubric: {p}");
        }
    }
    assert_eq!(seen.len(), 3, "{seen:?}");
    let json_instructions = bodies
        .iter()
        .filter(|b| prompt(b).contains("\"current_problem\""))
        .count();
    assert!(
        json_instructions > 0,
        "proactive candidates use the JSON instruction"
    );

    let rec: serde_json::Value = serde_json::from_str(
        std::fs::read_to_string(out.join("conversations.jsonl"))
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    let cands = rec["turns"][0]["candidates"].as_array().unwrap();
    let proactive: Vec<&serde_json::Value> = cands
        .iter()
        .filter(|c| c["variant"] == "proactive")
        .collect();
    assert_eq!(proactive.len(), 1, "int(3 × 0.5)");
    let text = proactive[0]["text"].as_str().unwrap();
    assert!(
        text.starts_with("Let me think") && !text.contains("current_problem"),
        "{text}"
    );
    for c in cands {
        for s in c["sessions"].as_array().unwrap() {
            let v = s["scores"]["interactivity"]["value"].as_f64().unwrap();
            assert!(
                [-3.0, -1.0, 1.0].contains(&v),
                "v1 scores are (x − 2.5)·2: {v}"
            );
        }
    }
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["config"]["interactivity_scale"], "v1");
    assert_eq!(manifest["config"]["user_sampling"]["max_tokens"], 300);
}

#[tokio::test]
async fn dry_run_prints_the_plan_without_calls() {
    let server = collab_server().await;
    let tmp = tempfile::tempdir().unwrap();
    let mut args = endpoint_args(&server, &tmp.path().join("run"), &data("math.jsonl"));
    args.push("--dry-run".into());
    let out = run_bin(&args).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(stdout.contains("model calls: at most"), "{stdout}");
    assert_eq!(server.requests(), 0);
}

/// Hostile "generated" code (infinite loop, fork bomb, huge allocation, a write outside the
/// sandbox) flows through pass_rate: every such session scores 0 and the run carries on.
#[tokio::test]
async fn hostile_code_scores_zero_and_the_run_continues() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let guarded = tmp.path().join("guarded");
    std::fs::create_dir(&guarded).unwrap();
    std::fs::set_permissions(&guarded, std::fs::Permissions::from_mode(0o755)).unwrap();
    let target = guarded.join("pwned.txt");
    let snippets = [
        "while True:\n    pass\n".to_string(),
        "import os\nwhile True:\n    os.fork()\n".to_string(),
        "x = bytearray(10**10)\n".to_string(),
        format!("open({:?}, 'w').write('x')\n", target.display().to_string()),
    ];
    let policy = ScriptedBackend::new("policy", move |req, i| {
        let k = (req.seed.unwrap_or(0) as usize + i) % snippets.len();
        Ok(format!("Here you go:\n```python\n{}```", snippets[k]))
    });
    let judge = ScriptedBackend::new("judge", |req, _| {
        // The extractor returns the last code block of the conversation verbatim.
        let prompt = &req
            .messages
            .last()
            .map(|m| m.content.clone())
            .unwrap_or_default();
        let start = prompt.rfind("```python").unwrap_or(0);
        let end = prompt[start + 3..]
            .find("```")
            .map_or(prompt.len(), |e| start + 3 + e + 3);
        Ok(prompt[start..end].to_string())
    });
    let cfg = GenerateConfig {
        tasks: data("code.jsonl"),
        output: tmp.path().join("run"),
        candidates: 2,
        samples: 2,
        window: 1,
        max_messages: 2,
        max_tasks: Some(2),
        rollout: RolloutConfig {
            sandbox_timeout_s: 3.0,
            ..RolloutConfig::default()
        },
        ..GenerateConfig::default()
    };
    let roles = Roles {
        policy: Role::from_backend("policy", "scripted", policy.clone(), None, None),
        assistant: Role::from_backend("assistant", "scripted", policy, None, None),
        user: Role::from_backend("user", "scripted", scripted("user"), None, None),
        judge: Role::from_backend("judge", "scripted", judge, None, None),
    };
    let tasks = cfg.task_source().load().unwrap();
    let started = std::time::Instant::now();
    let summary = generate_with_roles(cfg.clone(), tasks, roles)
        .await
        .unwrap();
    assert_eq!(summary.tasks_done_now, 2, "{summary}");
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "sandbox runs must be bounded"
    );
    let text = std::fs::read_to_string(cfg.output.join("conversations.jsonl")).unwrap();
    let (mut scored, mut timed_out) = (0, 0);
    for line in text.lines() {
        let rec: serde_json::Value = serde_json::from_str(line).unwrap();
        for turn in rec["turns"].as_array().unwrap() {
            for cand in turn["candidates"].as_array().unwrap() {
                for s in cand["sessions"].as_array().unwrap() {
                    assert_eq!(s["scores"]["pass_rate"]["value"], 0.0, "{s}");
                    scored += 1;
                    let outcome = &s["scores"]["pass_rate"]["detail"]["outcome"];
                    timed_out += usize::from(outcome["timed_out"] == true);
                }
            }
        }
    }
    assert_eq!(scored, 2 * 2 * 2);
    assert!(
        timed_out >= 1,
        "the infinite loop was killed at the wall timeout"
    );
    assert!(
        !target.exists(),
        "sandboxed code wrote outside its directory"
    );
}

fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(files_under(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// Credentials inside an endpoint URL reach the server, never a file, a log line or a card;
/// the card names models without local paths or endpoint URLs.
#[tokio::test]
async fn endpoint_credentials_and_local_paths_stay_private() {
    let server = collab_server().await;
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("run");
    let plain = format!("openai:scripted@{}", server.base_url);
    let secret = plain.replace("http://", "http://alice:PASS-s3cret@");
    let mut args: Vec<String> = endpoint_args(&server, &out_dir, &data("math.jsonl"))
        .into_iter()
        .map(|a| if a == plain { secret.clone() } else { a })
        .collect();
    args.extend(["--max-tasks".into(), "2".into()]);
    let out = tokio::process::Command::new(bin())
        .args(&args)
        .env("OPENAI_API_KEY", "test-key")
        .env("RUST_LOG", "debug")
        .stdin(Stdio::null())
        .output()
        .await
        .unwrap();
    let logs = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{logs}");
    assert!(server.requests() > 0);
    assert!(
        !logs.contains("PASS-s3cret") && !logs.contains("alice:"),
        "{logs}"
    );
    for f in files_under(&out_dir) {
        let text = String::from_utf8_lossy(&std::fs::read(&f).unwrap()).into_owned();
        assert!(
            !text.contains("PASS-s3cret") && !text.contains("alice:"),
            "{} holds the endpoint credentials",
            f.display()
        );
    }
    let manifest = std::fs::read_to_string(out_dir.join("manifest.json")).unwrap();
    assert!(manifest.contains("http://***@127.0.0.1"), "{manifest}");

    let layout = tmp.path().join("layout");
    let push = std::process::Command::new(env!("CARGO_BIN_EXE_push_hf"))
        .args(["dataset", out_dir.to_str().unwrap(), "--repo", "alice/d"])
        .arg("--dry-run")
        .arg(&layout)
        .output()
        .unwrap();
    assert!(
        push.status.success(),
        "{}",
        String::from_utf8_lossy(&push.stderr)
    );
    let card = std::fs::read_to_string(layout.join("README.md")).unwrap();
    for private in [
        "PASS-s3cret",
        "alice:",
        "127.0.0.1",
        "://***",
        env!("CARGO_MANIFEST_DIR"),
        tmp.path().to_str().unwrap(),
    ] {
        assert!(!card.contains(private), "card shows `{private}`:\n{card}");
    }
    assert!(
        card.contains("OpenAI-compatible endpoint, model scripted"),
        "{card}"
    );
    assert!(card.contains("| tasks | math.jsonl |"), "{card}");
}

/// A model that cannot be loaded leaves no empty output directory behind, and never removes a
/// directory that was there before.
#[tokio::test]
async fn failed_model_setup_leaves_no_empty_output_dir() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("no-such-model.gguf");
    for existing in [false, true] {
        let out_dir = tmp.path().join(format!("run-{existing}"));
        if existing {
            std::fs::create_dir_all(&out_dir).unwrap();
        }
        let args: Vec<String> = [
            "--tasks",
            &data("math.jsonl"),
            "--output",
            out_dir.to_str().unwrap(),
            "--policy",
            missing.to_str().unwrap(),
            "--max-tasks",
            "1",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let out = run_bin(&args).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(stderr.contains("no-such-model.gguf"), "{stderr}");
        assert_eq!(out_dir.exists(), existing, "existing = {existing}");
    }
}

/// `--shard i/n` runs merged with `--merge` equal one unsharded run: the same tasks, the
/// same conversations and the same pairs on the same side of the split; overlapping shards
/// and shards made with other settings are refused by name.
#[tokio::test]
async fn two_shards_merged_equal_one_unsharded_run() {
    let server = collab_server().await;
    let tmp = tempfile::tempdir().unwrap();
    let run = |dir: &str, extra: &[&str]| {
        let mut a = endpoint_args(&server, &tmp.path().join(dir), &data("math.jsonl"));
        for (flag, default) in [("--max-tasks", "8"), ("--min-gap", "0.0")] {
            if !extra.contains(&flag) {
                a.extend([flag, default].map(String::from));
            }
        }
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    for (dir, extra) in [
        ("all", vec![]),
        ("s0", vec!["--shard", "0/2"]),
        ("s1", vec!["--shard", "1/2"]),
        ("s1-seed", vec!["--shard", "1/2", "--seed", "9"]),
        ("s1-tasks", vec!["--shard", "1/2", "--max-tasks", "6"]),
        ("s1-gap", vec!["--shard", "1/2", "--min-gap", "0.2"]),
        ("s0-of-3", vec!["--shard", "0/3"]),
        ("s1-of-3", vec!["--shard", "1/3"]),
    ] {
        let out = run_bin(&run(dir, &extra)).await;
        assert!(
            out.status.success(),
            "{dir}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let (s0, s1) = (
        task_ids(&tmp.path().join("s0")),
        task_ids(&tmp.path().join("s1")),
    );
    assert!(!s0.is_empty() && !s1.is_empty(), "{s0:?} {s1:?}");
    assert!(s0.iter().all(|t| !s1.contains(t)), "disjoint shards");

    let merge = |shards: &[&str], out: &str| merge_args(tmp.path(), shards, out);
    let calls = server.requests();
    let out = run_bin(&merge(&["s0", "s1"], "merged")).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(server.requests(), calls, "a merge calls no model");

    let (all, merged) = (tmp.path().join("all"), tmp.path().join("merged"));
    let mut want = task_ids(&all);
    let mut got = task_ids(&merged);
    want.sort();
    got.sort();
    assert_eq!(got, want, "the same task set");
    let turns = |dir: &Path| -> std::collections::BTreeMap<String, serde_json::Value> {
        std::fs::read_to_string(dir.join("conversations.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                (
                    v["task_id"].as_str().unwrap().to_string(),
                    v["turns"].clone(),
                )
            })
            .collect()
    };
    assert_eq!(turns(&merged), turns(&all), "the same conversations");
    for split in ["train", "test"] {
        let sorted = |dir: &Path| {
            let mut p = read_pairs(&dir.join(format!("pairs/{split}.parquet")));
            p.sort_by(|a, b| a.partial_cmp(b).unwrap());
            p
        };
        assert_eq!(sorted(&merged), sorted(&all), "{split} pairs");
    }
    assert!(merged.join("sft.parquet").is_file());
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(merged.join("manifest.json")).unwrap())
            .unwrap();
    assert_eq!(m["merged_from"].as_array().unwrap().len(), 2);
    assert!(m["config"]["shard"].is_null());

    // A task in two shards; shards made with another seed.
    let out = run_bin(&merge(&["s0", "all"], "overlap")).await;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("shards must not overlap"));
    let out = run_bin(&merge(&["s0", "s1-seed"], "other-seed")).await;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("different settings (seed)"), "{err}");
    // Data settings outside the generation identity, and splits that are not whole.
    for (shards, needle) in [
        (["s0", "s1-tasks"], "different settings (max_tasks)"),
        (["s0", "s1-gap"], "different settings (min_gap)"),
        (["s0", "s1-of-3"], "shard 1/3"),
        (["s0-of-3", "s1-of-3"], "shard(s) 2/3 missing"),
    ] {
        let out = run_bin(&merge(&shards, "refused")).await;
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{shards:?} merged");
        assert!(err.contains(needle), "{shards:?}: {err}");
        assert!(!tmp.path().join("refused/manifest.json").exists());
    }
}

/// Every role on an endpoint pool whose first member is dead: the run completes.
#[tokio::test]
async fn a_run_on_pools_with_a_dead_endpoint_completes() {
    let server = collab_server().await;
    let tmp = tempfile::tempdir().unwrap();
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}/v1", l.local_addr().unwrap())
    };
    let pool = format!("openai:scripted@{dead},{}", server.base_url);
    let out = tmp.path().join("pool");
    let mut args = endpoint_args(&server, &out, &data("math.jsonl"));
    for flag in ["--policy", "--user", "--judge"] {
        let i = args.iter().position(|a| a == flag).unwrap();
        args[i + 1] = pool.clone();
    }
    args.extend(["--max-tasks", "2", "--token-counter", "words"].map(String::from));
    let o = run_bin(&args).await;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(task_ids(&out).len(), 2);
    // The manifest counts calls per endpoint: the dead one only failed, the live one served.
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(
        m["token_amount_tokenizer"], "words",
        "--token-counter words"
    );
    assert_eq!(m["generation_identity"]["token_counter"], "words");
    let roles = m["endpoint_calls"].as_object().unwrap();
    assert!(!roles.is_empty(), "{m}");
    for (role, stats) in roles {
        let (d, l) = (&stats[0], &stats[1]);
        assert_eq!(d["calls"], d["failures"], "{role}: {stats}");
        assert!(l["calls"].as_u64().unwrap() > 0, "{role}: {stats}");
        assert!(l["endpoint"]
            .as_str()
            .unwrap()
            .starts_with("http://127.0.0.1"));
    }
}

// ---- 20 Questions: the oracle is the user, the futures are scored exactly ----

/// The bundled test-split object the 20 Questions runs below play, and two questions the
/// table parses (attributes 0 and 1).
fn twenty_questions_target() -> (String, String, String) {
    use collabllm::task::twenty_questions::chat::{default_world, object_tasks, ObjectSplit};
    let world = default_world().unwrap();
    let name = object_tasks(world, ObjectSplit::Test)[0].reference.clone();
    let q = |a: usize| world.attribute_question(a).unwrap().to_string();
    assert!(
        world.parse("Zzz qqq?").is_none(),
        "the unparsed line of the server"
    );
    (name, q(0), q(1))
}

/// A questioner server: a candidate request (n = 3) gets sample 0 = the winning guess, 1 = an
/// attribute question, 2 = a line the table cannot parse; a future's assistant turn (n = 1) an
/// attribute question. An oracle prompt (hybrid / llm) is answered "Yes.".
async fn questioner_server(name: String, q0: String, q1: String) -> FaultServer {
    let server = FaultServer::start().await;
    server.set_responder(move |body, sample| {
        let last = body["messages"]
            .as_array()
            .and_then(|m| m.last())
            .and_then(|m| m["content"].as_str())
            .unwrap_or("");
        if last.contains("The hidden object is") {
            return "Yes.".into();
        }
        match (body["n"].as_u64().unwrap_or(1), sample) {
            (1, _) => q1.clone(),
            (_, 0) => format!("Is it a {name}?"),
            (_, 1) => format!("Great! {q0}"),
            _ => "Zzz qqq".into(),
        }
    });
    server
}

/// The first record of a run's `conversations.jsonl` and its metric weights.
fn first_conversation(out: &Path) -> (Value, std::collections::BTreeMap<String, f64>) {
    let text = std::fs::read_to_string(out.join("conversations.jsonl")).unwrap();
    let rec: Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    let weights = serde_json::from_value(rec["weights"].clone()).unwrap();
    (rec, weights)
}

/// Metric weights from (name, weight) pairs.
fn weights_of(pairs: &[(&str, f64)]) -> std::collections::BTreeMap<String, f64> {
    pairs.iter().map(|(m, w)| (m.to_string(), *w)).collect()
}

fn twenty_questions_args(server: &FaultServer, out: &Path) -> Vec<String> {
    let spec = format!("openai:scripted@{}", server.base_url);
    [
        "--task-type",
        "twenty_questions",
        "--tasks",
        "20q:test",
        "--max-tasks",
        "1",
        "--output",
        out.to_str().unwrap(),
        "--policy",
        &spec,
        "--user",
        &spec,
        "--judge",
        &spec,
        "--candidates",
        "3",
        "--proact-ratio",
        "0",
        "--samples",
        "2",
        "--window",
        "3",
        "--max-questions",
        "5",
        "--timeout",
        "5",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

#[tokio::test]
async fn twenty_questions_pairs_rank_questions_by_exact_rewards() {
    let (name, q0, q1) = twenty_questions_target();
    let server = questioner_server(name.clone(), q0.clone(), q1.clone()).await;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let output = run_bin(&twenty_questions_args(&server, &out)).await;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    // Table oracle and the exact preset: every request is the questioner's.
    let bodies: Vec<Value> = server.received().into_iter().map(|r| r.body).collect();
    assert!(!bodies.is_empty());
    assert!(bodies.iter().all(|b| {
        let first = b["messages"][0]["content"].as_str().unwrap_or("");
        first.starts_with("You are playing 20 Questions")
    }));
    assert!(
        bodies
            .iter()
            .all(|b| b["max_tokens"] == 64 || b["max_completion_tokens"] == 64),
        "a question is capped at 64 tokens by default"
    );

    let (rec, weights) = first_conversation(&out);
    assert_eq!(rec["task_type"], "twenty_questions");
    assert_eq!(rec["reference"], name.as_str());
    assert_eq!(
        weights,
        weights_of(&[("info_gain", 1.0), ("reply_tokens", -0.5), ("success", 1.0)])
    );
    // The first question wins: the game ends on the oracle's "Yes.".
    let messages = rec["messages"].as_array().unwrap();
    assert!(messages[0]["content"]
        .as_str()
        .unwrap()
        .starts_with("You are playing 20 Questions"));
    assert_eq!(messages.len(), 3, "{messages:?}");
    assert_eq!(messages[1]["content"], format!("Is it a {name}?"));
    assert_eq!(messages[2]["content"], "Yes.");
    assert_eq!(rec["ended_by"], "user_terminated");

    let turn = &rec["turns"][0];
    let cands = turn["candidates"].as_array().unwrap();
    let score = |c: &Value, m: &str| -> Vec<f64> {
        c["sessions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["scores"][m]["value"].as_f64().unwrap())
            .collect()
    };
    // The winning guess: every future is the win itself (1 question, all the uncertainty);
    // as a question it is worth H(1/158) bits before any answer.
    assert_eq!(score(&cands[0], "success"), [1.0, 1.0]);
    let h = |p: f64| -(p * p.log2() + (1.0 - p) * (1.0 - p).log2());
    for g in score(&cands[0], "info_gain") {
        assert!((g - h(1.0 / 158.0)).abs() < 1e-12, "{g}");
    }
    for s in cands[0]["sessions"].as_array().unwrap() {
        assert_eq!(
            s["messages"].as_array().unwrap().len(),
            1,
            "ends at the win"
        );
        assert_eq!(s["scores"]["success"]["method"], "20q-table");
    }
    // The attribute question and the unparsed line: no win within the window; the attribute
    // question's expected gain is its split of the 158 objects, the unread line's is 0.
    for c in &cands[1..] {
        assert_eq!(score(c, "success"), [0.0, 0.0]);
    }
    let (g1, g2) = (
        score(&cands[1], "info_gain")[0],
        score(&cands[2], "info_gain")[0],
    );
    assert!(
        g1 > 0.1 && g2 == 0.0,
        "attribute {g1} vs unparsed {g2}: {turn:#}"
    );
    assert_eq!(
        cands[2]["sessions"][0]["scores"]["info_gain"]["detail"]["unparsed"],
        1
    );
    assert_eq!(turn["chosen"], 0);
    let pairs = read_pairs(&out.join("pairs/train.parquet"))
        .into_iter()
        .chain(read_pairs(&out.join("pairs/test.parquet")))
        .collect::<Vec<_>>();
    assert_eq!(pairs.len(), 1);
    // Chosen: the win (1 + H(1/158)); rejected: the unread line (nothing, less its tokens).
    assert!(pairs[0].1 > 1.0 && pairs[0].2 <= 0.0, "{pairs:?}");
}

#[tokio::test]
async fn twenty_questions_hybrid_oracle_asks_the_model_only_what_the_table_cannot_read() {
    let (name, q0, q1) = twenty_questions_target();
    let server = questioner_server(name, q0, q1).await;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut args = twenty_questions_args(&server, &out);
    args.extend(["--oracle".into(), "hybrid".into()]);
    let output = run_bin(&args).await;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let oracle_questions: Vec<String> = server
        .received()
        .into_iter()
        .filter_map(|r| {
            let c = r.body["messages"][0]["content"].as_str()?.to_string();
            c.contains("The hidden object is").then(|| {
                c.lines()
                    .find_map(|l| l.strip_prefix("Question: "))
                    .unwrap_or("")
                    .to_string()
            })
        })
        .collect();
    // Only the unparsed line goes to the model (asked once: the answer is deterministic).
    assert_eq!(oracle_questions, ["Zzz qqq"], "{oracle_questions:?}");
    let text = std::fs::read_to_string(out.join("conversations.jsonl")).unwrap();
    let rec: Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    // The model said "Yes." to the unparsed line: recorded as the oracle's answer.
    let s = &rec["turns"][0]["candidates"][2]["sessions"][0];
    assert_eq!(s["messages"][0]["content"], "Yes.");
    let raw: Value = serde_json::from_str(s["user_raw"][0].as_str().unwrap()).unwrap();
    assert_eq!(raw["oracle"], "llm");
    assert_eq!(raw["parsed"], Value::Null);
}

#[tokio::test]
async fn twenty_questions_bad_sources_and_metrics_are_refused_before_any_call() {
    let server = FaultServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut args = twenty_questions_args(&server, &out);
    let i = args.iter().position(|a| a == "20q:test").unwrap();
    args[i] = "20q:holdout".into();
    let output = run_bin(&args).await;
    assert!(!output.status.success());
    let err = String::from_utf8_lossy(&output.stderr);
    assert!(
        err.contains("20q:holdout") && err.contains("train, test or all"),
        "{err}"
    );
    // An exact 20 Questions metric on math tasks names the task and what it lacks.
    let mut args = endpoint_args(&server, &out, &data("math.jsonl"));
    args.extend(["--metric".into(), "info_gain=1".into()]);
    let output = run_bin(&args).await;
    assert!(!output.status.success());
    let err = String::from_utf8_lossy(&output.stderr);
    assert!(
        err.contains("info_gain") && err.contains("20 Questions object"),
        "{err}"
    );
    let output = run_bin(&["--metric-preset".to_string(), "20q-everything".to_string()]).await;
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("20q-infogain"));
    assert_eq!(server.requests(), 0);
}

#[tokio::test]
async fn a_policy_system_prompt_opens_every_conversation_and_pair_prompt() {
    let server = collab_server().await;
    let dir = tempfile::tempdir().unwrap();
    let system = dir.path().join("system.txt");
    std::fs::write(&system, "You are a patient math tutor.\n").unwrap();
    let out = dir.path().join("run");
    let mut args = endpoint_args(&server, &out, &data("math.jsonl"));
    args.extend([
        "--max-tasks".into(),
        "2".into(),
        "--policy-system-prompt".into(),
        system.display().to_string(),
    ]);
    let output = run_bin(&args).await;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let sys = collabllm::llm::ChatMessage::system("You are a patient math tutor.");
    let mut pairs =
        collabllm::dataset::pairs::read_pairs_parquet(&out.join("pairs/train.parquet")).unwrap();
    pairs.extend(
        collabllm::dataset::pairs::read_pairs_parquet(&out.join("pairs/test.parquet")).unwrap(),
    );
    assert!(!pairs.is_empty());
    for p in &pairs {
        assert_eq!(
            p.prompt[0], sys,
            "the pair's prompt keeps the system prompt"
        );
        assert_eq!(p.prompt[1].role, "user");
        assert_eq!(p.prompt.iter().filter(|m| m.role == "system").count(), 1);
    }
    // Policy requests open with it (proactive system-style ones with it first, the
    // collaborative prompt after it); simulator and judge prompts never show it.
    for r in server.received() {
        let msgs = r.body["messages"].as_array().unwrap();
        let text = r.body["messages"].to_string();
        if msgs[0]["role"] == "system" {
            assert!(msgs[0]["content"]
                .as_str()
                .unwrap()
                .starts_with("You are a patient math tutor."));
        } else {
            assert!(!text.contains("patient math tutor"), "{text}");
        }
    }
    // An empty file is refused before any call.
    let before = server.requests();
    std::fs::write(&system, " \n").unwrap();
    let i = args.iter().position(|a| a == "--output").unwrap();
    args[i + 1] = dir.path().join("run2").display().to_string();
    let output = run_bin(&args).await;
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("empty"));
    assert_eq!(server.requests(), before);
}

#[tokio::test]
async fn compat_upstream_v2_sets_its_values_records_them_and_a_flag_still_wins() {
    let server = collab_server().await;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut args = endpoint_args(&server, &out, &data("math.jsonl"));
    // endpoint_args gives --candidates 3: the flag wins over the preset's 2.
    args.extend([
        "--max-tasks".into(),
        "2".into(),
        "--compat".into(),
        "upstream-v2".into(),
    ]);
    let output = run_bin(&args).await;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap();
    let c = &manifest["config"];
    assert_eq!(c["compat"]["preset"], "upstream-v2");
    assert_eq!(c["compat"]["set"]["policy_sampling.temperature"], 0.8);
    assert_eq!(c["compat"]["set"]["token_counter"], "cl100k");
    let t = c["policy_sampling"]["temperature"].as_f64().unwrap();
    assert!((t - 0.8).abs() < 1e-6, "{t}");
    assert_eq!(c["min_gap"], 0.0);
    assert_eq!(
        c["candidates"], 3,
        "--candidates 3 given after the preset wins"
    );
    assert!(out.join("sft.parquet").is_file());
    // The policy's requests were sampled at upstream's temperature.
    let temps: Vec<f64> = server
        .received()
        .iter()
        .filter(|r| {
            !r.body["messages"]
                .to_string()
                .contains("role-playing a USER")
                && r.body["temperature"].as_f64() != Some(0.0)
        })
        .filter_map(|r| r.body["temperature"].as_f64())
        .collect();
    assert!(temps.iter().any(|t| (t - 0.8).abs() < 1e-6), "{temps:?}");
}

/// `--midgame N`: each game starts after the demonstrator's first questions (0..=N, drawn per
/// task), the table answering; the pairs' prompts hold that prefix, and `--max-messages`
/// counts from the end of it.
#[tokio::test]
async fn twenty_questions_midgame_prefixes_start_games_after_demonstrator_questions() {
    let (name, q0, q1) = twenty_questions_target();
    let server = questioner_server(name, q0, q1).await;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut args = twenty_questions_args(&server, &out);
    for (flag, value) in [("--max-tasks", "6"), ("--max-questions", "20")] {
        let i = args.iter().position(|a| a == flag).unwrap();
        args[i + 1] = value.into();
    }
    args.extend([
        "--midgame".into(),
        "12".into(),
        "--max-messages".into(),
        "3".into(),
    ]);
    let output = run_bin(&args).await;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let world = collabllm::task::twenty_questions::chat::default_world().unwrap();
    let text = std::fs::read_to_string(out.join("conversations.jsonl")).unwrap();
    let mut prefixes = Vec::new();
    for line in text.lines() {
        let rec: Value = serde_json::from_str(line).unwrap();
        let history = rec["turns"][0]["history"].as_array().unwrap().clone();
        assert!(history[0]["content"]
            .as_str()
            .unwrap()
            .starts_with("You are playing 20 Questions"));
        for (k, m) in history.iter().enumerate().skip(1) {
            let c = m["content"].as_str().unwrap();
            if k % 2 == 1 {
                assert!(world.parse(c).is_some(), "a demonstrator question: {c}");
            } else {
                assert!(c == "Yes." || c == "No.");
            }
        }
        // One real turn after the prefix (max-messages 3: opening, question, answer).
        assert!(rec["turns"].as_array().unwrap().len() <= 2, "{rec}");
        prefixes.push(history.len());
    }
    assert_eq!(prefixes.len(), 6);
    assert!(prefixes.iter().any(|&n| n > 1), "{prefixes:?}");
    let pairs = read_pairs(&out.join("pairs/train.parquet")).len()
        + read_pairs(&out.join("pairs/test.parquet")).len();
    assert!(pairs > 0);
}

/// `--metric-preset 20q-game`: futures play the game out with the demonstrator asking (no
/// model call inside a future), and the reward is the game's: a non-winning opening question
/// with a budget of 5 leaves 4 demonstrator questions, none of which can find one of 158
/// objects, so every such future is the whole budget, lost: success 0, 5 questions,
/// lmrl_return −5; the winning guess's future is its own "Yes." (lmrl_return −1 + 1 = 0).
#[tokio::test]
async fn twenty_questions_game_preset_plays_futures_out_with_the_demonstrator() {
    let (name, q0, q1) = twenty_questions_target();
    let server = questioner_server(name, q0, q1).await;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut args = twenty_questions_args(&server, &out);
    let i = args.iter().position(|a| a == "--window").unwrap();
    args.drain(i..i + 2);
    args.extend(["--metric-preset".into(), "20q-game".into()]);
    let output = run_bin(&args).await;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    // Only the candidates' requests (n = 3) reach the model; the futures ask no model.
    let bodies: Vec<Value> = server.received().into_iter().map(|r| r.body).collect();
    assert!(
        !bodies.is_empty() && bodies.iter().all(|b| b["n"] == 3),
        "{bodies:?}"
    );
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap();
    let text = manifest.to_string();
    assert!(
        text.contains("\"future_questioner\":\"demonstrator\""),
        "{text}"
    );

    let world = collabllm::task::twenty_questions::chat::default_world().unwrap();
    let (rec, weights) = first_conversation(&out);
    assert_eq!(
        weights,
        weights_of(&[
            ("lmrl_return", 0.04),
            ("reply_tokens", -0.5),
            ("success", 1.0)
        ])
    );
    let cands = rec["turns"][0]["candidates"].as_array().unwrap().clone();
    let value = |s: &Value, m: &str| s["scores"][m]["value"].as_f64().unwrap();
    for s in cands[0]["sessions"].as_array().unwrap() {
        assert_eq!(s["messages"].as_array().unwrap().len(), 1);
        assert_eq!((value(s, "success"), value(s, "lmrl_return")), (1.0, 0.0));
    }
    for c in &cands[1..] {
        for s in c["sessions"].as_array().unwrap() {
            let m = s["messages"].as_array().unwrap();
            // The answer, then 4 × (demonstrator question, answer): the whole budget.
            assert_eq!(m.len(), 9, "{m:?}");
            assert_eq!(s["terminated"], true);
            for q in m.iter().skip(1).step_by(2) {
                assert_eq!(q["role"], "assistant");
                let q = q["content"].as_str().unwrap();
                assert!(world.parse(q).is_some(), "a demonstrator question: {q}");
            }
            assert_eq!(value(s, "success"), 0.0);
            assert_eq!(value(s, "lmrl_return"), -5.0);
        }
    }
    assert_eq!(rec["turns"][0]["chosen"], 0);
}

/// The name a clarify birthday request or the user's answer gives (`… friend Maya.`, `My
/// friend's name is Maya.`), if any.
fn stated_name(text: &str) -> Option<String> {
    let last = text.trim_end_matches('.').rsplit(' ').next()?;
    last.starts_with(char::is_uppercase)
        .then(|| last.to_string())
}

/// The ablation's mechanism on clarify-or-answer pairs: with one future (MR) a question on a
/// vague request is chosen over a generic answer (0.7 against 0) and loses to a direct
/// answer when the request states the detail (0.7 against 1); scored alone (`--samples 0`,
/// the single-turn reward) the question costs 0.3 and never wins. The conversation goes on
/// from the chosen reply either way.
#[tokio::test]
async fn clarify_pairs_rank_questions_by_their_future_or_alone() {
    // Candidate 0 asks; candidate 1 answers, with the name when it was given.
    let policy = ScriptedBackend::new("policy", |req, i| {
        let last = req
            .messages
            .last()
            .map(|m| m.content.as_str())
            .unwrap_or("");
        Ok(match (stated_name(last), i) {
            (Some(name), _) if last.starts_with("My friend") => format!("Happy birthday, {name}!"),
            (_, 0) => "What is your friend's name?".to_string(),
            (Some(name), _) => format!("Happy birthday, {name}!"),
            (None, _) => "Happy birthday!".to_string(),
        })
    });
    let out = tempfile::tempdir().unwrap();
    for samples in [1, 0] {
        let cfg = GenerateConfig {
            tasks: "clarify:train".into(),
            output: out.path().join(format!("s{samples}")),
            candidates: 2,
            samples,
            window: 2,
            max_messages: 5,
            max_tasks: Some(4),
            proact_ratio: 0.0,
            test_fraction: 0.0,
            ..GenerateConfig::default()
        };
        cfg.validate().unwrap();
        let role = |name: &str| Role::from_backend(name, "scripted", policy.clone(), None, None);
        let summary = generate_scripted(&cfg, role("policy"), role("assistant")).await;
        assert_eq!(summary.tasks_done_now, 4, "{summary}");
        let text = std::fs::read_to_string(cfg.output.join("conversations.jsonl")).unwrap();
        let mut first_turns = 0;
        for line in text.lines() {
            let rec: Value = serde_json::from_str(line).unwrap();
            let vague = rec["task_id"].as_str().unwrap().ends_with("-vague");
            let turn = &rec["turns"][0];
            let mr: Vec<f64> = turn["candidates"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c["mr"].as_f64().unwrap())
                .collect();
            let want: [f64; 2] = match (samples, vague) {
                (1, true) => [0.7, 0.0],
                (1, false) => [0.7, 1.0],
                (_, true) => [-0.3, 0.0],
                (_, false) => [-0.3, 1.0],
            };
            for (got, want) in mr.iter().zip(want) {
                assert!(
                    (got - want).abs() < 1e-9,
                    "samples {samples} vague {vague}: {mr:?}"
                );
            }
            let sessions = turn["candidates"][0]["sessions"].as_array().unwrap();
            assert_eq!(sessions.len(), 1);
            assert_eq!(
                sessions[0]["messages"].as_array().unwrap().is_empty(),
                samples == 0
            );
            // The question wins only when it leads somewhere the request did not.
            let asked_and_chose_it = samples == 1 && vague;
            assert_eq!(turn["chosen"] == 0, asked_and_chose_it, "{turn}");
            // After a chosen question the real conversation continues: the user answers.
            assert_eq!(
                rec["turns"].as_array().unwrap().len(),
                1 + usize::from(asked_and_chose_it)
            );
            first_turns += 1;
        }
        assert_eq!(first_turns, 4);
        let pairs = read_pairs(&cfg.output.join("pairs/train.parquet"));
        assert_eq!(
            pairs.len(),
            4,
            "one pair per request's first turn: {pairs:?}"
        );
    }
}

/// Action-contrast pairs at every assistant turn, on a scripted clarify conversation. Three
/// candidates a turn: a question, an answer that uses the detail where it is known, and a
/// generic answer; the futures' assistant answers with the detail once given. On a vague
/// request the question wins the first turn (0.7) and the contrast pairs it against an
/// answer; at the second turn, after the user gave the name, "use it now" (1.0) beats "ask
/// again" (0.7) — a pair best-vs-worst would never make (it pairs the two answers, 1.0 vs
/// 0). Balanced 1:1 by `stated`, the surplus of vague pairs is left out and counted.
#[tokio::test]
async fn action_contrast_pairs_at_every_turn_balanced_by_stratum() {
    let answer = |last: &str| match stated_name(last) {
        Some(name) => format!("Happy birthday, {name}!"),
        None => "Happy birthday!".to_string(),
    };
    let policy = ScriptedBackend::new("policy", move |req, i| {
        let last = req
            .messages
            .last()
            .map(|m| m.content.as_str())
            .unwrap_or("");
        Ok(match (req.n, i) {
            // The futures' assistant (one sample): answers.
            (1, _) => answer(last),
            (_, 0) => "What is your friend's name?".to_string(),
            (_, 1) => answer(last),
            _ => "Happy birthday!".to_string(),
        })
    });
    let out = tempfile::tempdir().unwrap();
    let cfg = GenerateConfig {
        tasks: "clarify:train".into(),
        output: out.path().join("run"),
        candidates: 3,
        samples: 1,
        window: 2,
        max_messages: 5,
        max_tasks: Some(8),
        proact_ratio: 0.0,
        test_fraction: 0.0,
        pairs: collabllm::reward::pairs::PairMode::Contrast,
        ..GenerateConfig::default()
    };
    cfg.validate().unwrap();
    let role = |name: &str| Role::from_backend(name, "scripted", policy.clone(), None, None);
    let summary = generate_scripted(&cfg, role("policy"), role("assistant")).await;
    assert_eq!(summary.tasks_done_now, 8, "{summary}");
    let read = |cfg: &GenerateConfig| {
        collabllm::dataset::read_pairs_parquet(&cfg.output.join("pairs/train.parquet")).unwrap()
    };
    let counts = |cfg: &GenerateConfig| -> Value {
        let m: Value = serde_json::from_str(
            &std::fs::read_to_string(cfg.output.join("manifest.json")).unwrap(),
        )
        .unwrap();
        m["counts"].clone()
    };
    let pairs = read(&cfg);
    // 4 vague requests × 2 turns + 4 stated × 1.
    assert_eq!(pairs.len(), 12);
    let c = counts(&cfg);
    assert_eq!(c["pairs_per_turn"], serde_json::json!({"0": 8, "1": 4}));
    assert_eq!(
        c["pairs_by_stratum_action"],
        serde_json::json!({"answer>ask": 8, "ask>answer": 4})
    );
    for p in pairs.iter().filter(|p| p.turn_id == 1) {
        // After the user's answer: the name used now, over the same question again.
        let name = stated_name(&p.prompt.last().unwrap().content).unwrap();
        assert_eq!(p.chosen[0].content, format!("Happy birthday, {name}!"));
        assert_eq!(p.rejected[0].content, "What is your friend's name?");
        assert!((p.score_chosen - 1.0).abs() < 1e-9 && (p.score_rejected - 0.7).abs() < 1e-9);
    }
    // Best vs worst pairs the two answers at the second turn instead.
    let best = GenerateConfig {
        pairs: collabllm::reward::pairs::PairMode::Best,
        ..cfg.clone()
    };
    collabllm::generate::rescore(&best).unwrap();
    for p in read(&best).iter().filter(|p| p.turn_id == 1) {
        assert_eq!(p.rejected[0].content, "Happy birthday!");
    }
    // Balanced by stated within the template: 4 and 4, the 4 extra vague pairs left out.
    let balanced = GenerateConfig {
        balance_by: vec!["stated".into()],
        balance_within: Some("template".into()),
        ..cfg.clone()
    };
    collabllm::generate::rescore(&balanced).unwrap();
    let pairs = read(&balanced);
    assert_eq!(pairs.len(), 8);
    let c = counts(&balanced);
    assert_eq!(c["pairs_selected"], 12);
    assert_eq!(c["pairs_left_out_by_balance"], 4);
    let by: std::collections::BTreeMap<String, u64> =
        serde_json::from_value(c["pairs_by_stratum_action"].clone()).unwrap();
    assert_eq!(by["stated=true answer>ask"], 4);
    let vague: u64 = by
        .iter()
        .filter(|(k, _)| k.starts_with("stated=false"))
        .map(|(_, n)| n)
        .sum();
    assert_eq!(vague, 4, "{by:?}");
    // A field no task has is refused by name.
    let bad = GenerateConfig {
        balance_by: vec!["stratum".into()],
        ..cfg.clone()
    };
    let err = collabllm::generate::rescore(&bad).unwrap_err().to_string();
    assert!(err.contains("no metadata field `stratum`"), "{err}");
}
