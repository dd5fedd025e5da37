//! `eval_multiturn` end to end: the tiny model as assistant (math with a scripted user and
//! judge; 20 Questions with the table oracle) against summaries recomputed from the
//! transcripts, resume without model calls, overlap refusal, and the binary.

mod common;
use collabllm::rollout::config::RolloutConfig;
use common::model_util;

use std::path::Path;
use std::sync::Arc;

use collabllm::engine::tiny::TinySpec;
use collabllm::eval::run::{evaluate_with_roles, EvalRoles};
use collabllm::eval::{EvalConfig, EvalModel, ObjectSelection, OracleChoice};
use collabllm::generate::{generate_with_roles, GenerateConfig, Roles};
use collabllm::llm::cache::RequestCache;
use collabllm::llm::local::LoadOptions;
use collabllm::llm::roles::Role;
use collabllm::llm::scripted::ScriptedBackend;
use collabllm::llm::tokens::TokenCounter;
use collabllm::llm::{EndpointOptions, ModelSpec};
use collabllm::rollout::user::Sampling;
use collabllm::task::twenty_questions::{AggregateMetrics, GameMetrics, GameRecord, Stat};
use collabllm::task::TaskType;
use common::collab_script;

fn scripted(name: &str) -> Arc<ScriptedBackend> {
    ScriptedBackend::new(name, |req, i| {
        let prompt = req
            .messages
            .last()
            .map(|m| m.content.clone())
            .unwrap_or_default();
        Ok(collab_script::reply(&prompt, req.seed.unwrap_or(0), i))
    })
}

fn scripted_role(name: &str, cache: Option<Arc<RequestCache>>) -> Role {
    Role::from_backend(name, "scripted", scripted(name), cache, None)
}

async fn tiny_role(dir: &Path, cache: Option<Arc<RequestCache>>) -> Role {
    Role::build(
        "model",
        &ModelSpec::HfDir(dir.to_path_buf()),
        &EndpointOptions::default(),
        &LoadOptions::default(),
        cache,
    )
    .await
    .expect("tiny model role")
}

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(
        &std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
    .unwrap()
}

fn read_lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn assert_stat(summary_metric: &serde_json::Value, expect: Stat, what: &str) {
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * (1.0 + b.abs());
    assert!(
        close(summary_metric["mean"].as_f64().unwrap(), expect.mean)
            && close(summary_metric["se"].as_f64().unwrap(), expect.stderr)
            && summary_metric["n"].as_u64().unwrap() as usize == expect.n,
        "{what}: summary {summary_metric} vs recomputed {expect:?}"
    );
}

fn total_calls(report: &collabllm::eval::EvalReport) -> (u64, u64) {
    report
        .usage
        .values()
        .fold((0, 0), |(c, h), u| (c + u.calls, h + u.cache_hits))
}

// ---------------------------------------------------------------------------------------------
// Math: tiny assistant, scripted user and judge.

fn math_cfg(out: &Path, tiny: &Path) -> EvalConfig {
    EvalConfig {
        task: TaskType::Math,
        models: vec![EvalModel::Spec(ModelSpec::HfDir(tiny.to_path_buf()))],
        output: out.to_path_buf(),
        max_tasks: Some(3),
        max_turns: 3,
        assistant_sampling: Sampling {
            temperature: 1.0,
            top_p: 1.0,
            max_tokens: 16,
        },
        rollout: RolloutConfig {
            concurrency: 3,
            ..RolloutConfig::default()
        },
        ..EvalConfig::default()
    }
}

async fn math_roles(out: &Path, tiny: &Path) -> EvalRoles {
    let cache = RequestCache::open(out.join("cache")).unwrap();
    EvalRoles {
        models: vec![Some(tiny_role(tiny, Some(cache.clone())).await)],
        user: Some(scripted_role("user", Some(cache.clone()))),
        judge: Some(scripted_role("judge", Some(cache))),
        oracle: None,
    }
}

/// Tasks come from the sources generate_conv and rl_train read: here an upstream flat
/// parquet file, whose unique single-turn goals are the tasks.
#[tokio::test]
async fn math_tasks_from_an_upstream_flat_file() {
    use collabllm::dataset::{write_flat_parquet, FlatRow};
    use collabllm::llm::ChatMessage;
    model_util::one_thread();
    let (_g, tiny) = model_util::tiny_model_dir(&TinySpec::default());
    let tmp = tempfile::tempdir().unwrap();
    let row = |conv: &str, turn: u32, goal: &str, answer: &str| FlatRow {
        prompt: vec![ChatMessage::user("I need help with a sum.")],
        completion: "Which numbers?".into(),
        conv_id: conv.into(),
        turn_id: turn,
        score: 0.5,
        single_turn_prompt: goal.into(),
        single_turn_completion: answer.into(),
        single_turn_metadata: serde_json::json!({"level": "Level 1"}),
        sessions: serde_json::json!([[{"role": "user", "content": "2 and 3"}]]),
        rewards: serde_json::json!({"MR": [0.5]}),
    };
    let flat = tmp.path().join("math-hard.parquet");
    write_flat_parquet(
        &flat,
        &[
            row("c1", 0, "What is 2+3?", "\\boxed{5}"),
            row("c1", 1, "What is 2+3?", "\\boxed{5}"),
            row("c2", 0, "What is 4+4?", "\\boxed{8}"),
        ],
    )
    .unwrap();
    let out = tmp.path().join("eval-flat");
    let cfg = EvalConfig {
        tasks: Some(flat.display().to_string()),
        max_tasks: None,
        max_turns: 1,
        ..math_cfg(&out, &tiny)
    };
    let report = evaluate_with_roles(cfg.clone(), math_roles(&out, &tiny).await)
        .await
        .unwrap();
    assert_eq!(
        (report.planned, report.done_now, report.failed.len()),
        (2, 2, 0),
        "{report}"
    );
    let label = report.summary.models[0].name.clone();
    let recs = read_lines(&out.join(format!("conversations/{label}.jsonl")));
    let ids: std::collections::BTreeSet<&str> = recs
        .iter()
        .map(|r| r["task_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids.len(), 2, "one conversation per unique goal");

    // The file's name types its rows as math: evaluated as code, it is refused before any
    // model call, with the mismatch named (not a missing-test error).
    let as_code = EvalConfig {
        task: TaskType::Code,
        output: tmp.path().join("eval-code"),
        ..cfg
    };
    let err = evaluate_with_roles(as_code, math_roles(&out, &tiny).await)
        .await
        .unwrap_err();
    assert!(
        format!("{err:#}").contains("is math, not code (--task)"),
        "{err:#}"
    );
}

#[tokio::test]
async fn math_with_the_tiny_model_summary_matches_transcripts_and_resumes_free() {
    model_util::one_thread();
    let (_g, tiny) = model_util::tiny_model_dir(&TinySpec::default());
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("eval-math");
    let cfg = math_cfg(&out, &tiny);

    let roles = math_roles(&out, &tiny).await;
    let report = evaluate_with_roles(cfg.clone(), roles).await.unwrap();
    assert_eq!(
        (report.planned, report.done_now, report.failed.len()),
        (3, 3, 0),
        "{report}"
    );
    // The label of an HF directory: its last two path components.
    let label = report.summary.models[0].name.clone();
    assert!(label.ends_with("-tiny-llama"), "{label}");

    // Every number of the summary, recomputed from the transcripts.
    let recs = read_lines(&out.join(format!("conversations/{label}.jsonl")));
    assert_eq!(recs.len(), 3);
    // Evaluation counts cl100k_base tokens by default, whatever the model's tokenizer.
    let tokens = TokenCounter::cl100k().unwrap();
    for r in &recs {
        let turns = r["turns"].as_array().unwrap();
        assert_eq!(turns[0]["role"], "user");
        assert!(!turns[0]["content"].as_str().unwrap().trim().is_empty());
        let count = |role: &str| -> usize {
            turns
                .iter()
                .filter(|m| m["role"] == role)
                .map(|m| tokens.count(m["content"].as_str().unwrap()))
                .sum()
        };
        let m = &r["metrics"];
        let assistant_turns = turns.iter().filter(|m| m["role"] == "assistant").count();
        assert_eq!(m["turns"].as_u64().unwrap() as usize, assistant_turns);
        assert!((1..=3).contains(&assistant_turns));
        assert_eq!(
            m["tokens_read_k"].as_f64().unwrap(),
            count("assistant") as f64 / 1000.0
        );
        assert_eq!(
            m["tokens_typed_k"].as_f64().unwrap(),
            count("user") as f64 / 1000.0
        );
        let acc = m["accuracy"].as_f64().unwrap();
        assert!(acc == 0.0 || acc == 1.0, "{acc}");
        let inter = m["interactivity"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&inter));
        assert_eq!(m["judge_failures"], 0);
        assert_eq!(r["seed"], 0);
        assert_eq!(r["usage"]["tokenizer"], "cl100k_base");
    }
    let summary = read_json(&out.join("summary.json"));
    assert_eq!(summary["task"], "math");
    assert_eq!(summary["tool_version"], env!("CARGO_PKG_VERSION"));
    let model = &summary["models"][0];
    assert_eq!(model["name"], label.as_str());
    for metric in [
        "accuracy",
        "interactivity",
        "tokens_read_k",
        "tokens_typed_k",
        "turns",
        "judge_failures",
    ] {
        let values: Vec<f64> = recs
            .iter()
            .map(|r| r["metrics"][metric].as_f64().unwrap())
            .collect();
        assert_stat(&model["metrics"][metric], Stat::of(&values), metric);
    }
    let csv = std::fs::read_to_string(out.join("summary.csv")).unwrap();
    assert!(csv.starts_with("model,metric,mean,se,n\n"));
    // The six dialogue metrics plus math's `accuracy_disagree` (judge vs explicit answer).
    assert_eq!(csv.lines().count(), 1 + 7);
    assert!(csv.contains(",accuracy_disagree,"), "{csv}");
    let manifest = read_json(&out.join("manifest.json"));
    assert_eq!(manifest["status"], "complete");
    assert!(manifest["finished_at"].is_number());
    assert!(manifest["usage"]["judge"]["calls"].as_u64().unwrap() > 0);
    assert!(
        manifest["usage"][format!("model:{label}")]["calls"]
            .as_u64()
            .unwrap()
            > 0
    );
    // The evaluated model is local (cost 0); the scripted judge has no price.
    assert_eq!(
        manifest["cost_usd"]["by_role"][format!("model:{label}")],
        0.0
    );
    assert!(manifest["cost_usd"]["by_role"]["judge"].is_null());
    let summary_text = std::fs::read_to_string(out.join("summary.json")).unwrap();

    // A second run does no model call at all and writes the same summary.
    let report = evaluate_with_roles(cfg.clone(), math_roles(&out, &tiny).await)
        .await
        .unwrap();
    assert_eq!((report.done_before, report.done_now), (3, 0));
    assert_eq!(total_calls(&report), (0, 0), "{report}");
    let manifest = read_json(&out.join("manifest.json"));
    let role = format!("model:{label}");
    assert_eq!(manifest["usage"][&role]["calls"], 0);
    assert!(
        manifest["usage_total"][&role]["calls"].as_u64().unwrap() > 0,
        "totals keep the first invocation's calls"
    );
    assert_eq!(
        std::fs::read_to_string(out.join("summary.json")).unwrap(),
        summary_text
    );

    // Killed mid-write: the last record torn. The rerun cuts it, replays that conversation
    // from the request cache (no model call), and gives the same summary.
    let path = out.join(format!("conversations/{label}.jsonl"));
    let text = std::fs::read_to_string(&path).unwrap();
    let cut = text.trim_end().rfind('\n').unwrap() + 1;
    let torn = format!("{}{}", &text[..cut], &text[cut..cut + 40]);
    std::fs::write(&path, torn).unwrap();
    let report = evaluate_with_roles(cfg, math_roles(&out, &tiny).await)
        .await
        .unwrap();
    assert_eq!((report.done_before, report.done_now), (2, 1), "{report}");
    let (calls, hits) = total_calls(&report);
    assert_eq!(calls, 0, "{report}");
    assert!(hits > 0);
    assert_eq!(
        std::fs::read_to_string(out.join("summary.json")).unwrap(),
        summary_text
    );
    assert_eq!(read_lines(&path).len(), 3);
}

// ---------------------------------------------------------------------------------------------
// 20 Questions: tiny questioner, reference and random, table oracle.

async fn twenty_roles(out: &Path, tiny: &Path) -> EvalRoles {
    let cache = RequestCache::open(out.join("cache")).unwrap();
    EvalRoles {
        models: vec![Some(tiny_role(tiny, Some(cache)).await), None, None],
        user: None,
        judge: None,
        oracle: None,
    }
}

#[tokio::test]
async fn twenty_questions_five_games_summary_matches_games_and_resumes_free() {
    model_util::one_thread();
    // The tiny tokenizer spends about a token per byte: a 20-question game needs a longer
    // context than the default 1024.
    let (_g, tiny) = model_util::tiny_model_dir(&TinySpec {
        max_position_embeddings: 4096,
        ..TinySpec::default()
    });
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("eval-20q");
    let cfg = EvalConfig {
        task: TaskType::TwentyQuestions,
        models: vec![
            EvalModel::Spec(ModelSpec::HfDir(tiny.clone())),
            EvalModel::Reference,
            EvalModel::Random,
        ],
        output: out.clone(),
        objects: ObjectSelection::First(5),
        question_max_tokens: 8,
        rollout: RolloutConfig {
            concurrency: 4,
            ..RolloutConfig::default()
        },
        ..EvalConfig::default()
    };
    let report = evaluate_with_roles(cfg.clone(), twenty_roles(&out, &tiny).await)
        .await
        .unwrap();
    assert_eq!((report.planned, report.done_now), (15, 15), "{report}");
    let summary = read_json(&out.join("summary.json"));
    assert_eq!(summary["task"], "twenty_questions");
    let names: Vec<&str> = summary["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert_eq!(names[1..], ["reference", "random"]);
    for (mi, name) in names.iter().enumerate() {
        let recs = read_lines(&out.join(format!("conversations/{name}.jsonl")));
        assert_eq!(recs.len(), 5, "{name}");
        let mut games = Vec::new();
        for r in &recs {
            let game: GameRecord = serde_json::from_value(r["game"].clone()).unwrap();
            assert!(game.object_index < 5);
            assert_eq!(game.max_questions, 20);
            assert!(game.turns.len() <= 20 && (game.won || game.turns.len() == 20));
            // Per-game metrics are those of the transcript.
            let m = GameMetrics::of(&game);
            assert_eq!(serde_json::to_value(&m).unwrap(), r["metrics"], "{name}");
            for t in &game.turns {
                assert!(t.answer == "Yes." || t.answer == "No.");
            }
            games.push(m);
        }
        let agg = serde_json::to_value(AggregateMetrics::of(&games)).unwrap();
        let metrics = &summary["models"][mi]["metrics"];
        assert_eq!(metrics.as_object().unwrap().len(), 13);
        for (k, v) in metrics.as_object().unwrap() {
            let s: Stat = serde_json::from_value(agg[k].clone()).unwrap();
            assert_stat(v, s, &format!("{name} {k}"));
        }
        let lmrl = read_lines(&out.join(format!("lmrl/{name}.jsonl")));
        assert_eq!(lmrl.len(), 5);
        // Games of one model may finish in any order (local requests are batched), so
        // each record is matched to its LMRL line by content, not by position.
        for r in &recs {
            let lines: Vec<String> = r["game"]["turns"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| {
                    let q = t["question"].as_str().unwrap().trim();
                    format!("{q} {}", t["answer"].as_str().unwrap())
                })
                .collect();
            assert!(
                lmrl.iter().any(|l| l["correct"] == r["game"]["won"]
                    && l["lines"] == serde_json::json!(lines)
                    && l["word"].is_array()),
                "{name}: no LMRL line for {}",
                r["game"]
            );
        }
    }
    // The reference questioner wins every game; the model's raw replies are kept.
    assert_eq!(summary["models"][1]["metrics"]["success_rate"]["mean"], 1.0);
    let tiny_recs = read_lines(&out.join(format!("conversations/{}.jsonl", names[0])));
    for r in &tiny_recs {
        assert_eq!(
            r["questioner_raw"].as_array().unwrap().len(),
            r["game"]["turns"].as_array().unwrap().len(),
            "one raw reply per question"
        );
    }

    let before = std::fs::read_to_string(out.join("summary.json")).unwrap();
    let report = evaluate_with_roles(cfg, twenty_roles(&out, &tiny).await)
        .await
        .unwrap();
    assert_eq!((report.done_before, report.done_now), (15, 0));
    assert_eq!(total_calls(&report), (0, 0));
    assert_eq!(
        std::fs::read_to_string(out.join("summary.json")).unwrap(),
        before
    );
}

#[tokio::test]
async fn llm_oracle_answers_are_normalised_and_gains_come_from_the_table() {
    // Questioner: "animal" first, then always "basketball". Oracle: "Yes." to the basketball
    // question whatever the object (a wrong LLM), an unusable reply to anything else.
    // The chat form: the rules, then each question and its answer as turns.
    let questioner = ScriptedBackend::new("questioner", |req, _| {
        Ok(if req.messages.len() > 1 {
            "Is it a basketball?".to_string()
        } else {
            "Sure! Is it an animal?\nThen I will guess.".to_string()
        })
    });
    let oracle = ScriptedBackend::new("oracle", |req, _| {
        let prompt = &req.messages[0].content;
        Ok(if prompt.contains("Question: Is it a basketball?") {
            "Yes.".to_string()
        } else {
            "Hmm, hard to say".to_string()
        })
    });
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("eval-oracle");
    let cfg = EvalConfig {
        task: TaskType::TwentyQuestions,
        models: vec![EvalModel::Spec(ModelSpec::Default)],
        oracle: "openai:judge@http://127.0.0.1:9/v1".parse().unwrap(),
        output: out.clone(),
        objects: ObjectSelection::First(2),
        ..EvalConfig::default()
    };
    let roles = EvalRoles {
        models: vec![Some(Role::from_backend(
            "model",
            "scripted",
            questioner.clone(),
            None,
            None,
        ))],
        user: None,
        judge: None,
        oracle: Some(Role::from_backend(
            "oracle",
            "scripted",
            oracle.clone(),
            None,
            None,
        )),
    };
    let report = evaluate_with_roles(cfg, roles).await.unwrap();
    assert_eq!((report.done_now, report.failed.len()), (2, 0), "{report}");
    let recs = read_lines(&out.join("conversations/default.jsonl"));
    let by_object = |i: u64| {
        recs.iter()
            .find(|r| r["game"]["object_index"] == i)
            .unwrap()
            .clone()
    };
    // Basketball: "animal" → unusable reply → "No." (counted), then the winning guess.
    let b = by_object(0);
    let game: GameRecord = serde_json::from_value(b["game"].clone()).unwrap();
    assert!(game.won);
    assert_eq!(game.turns.len(), 2);
    assert_eq!(game.turns[0].question, "Is it an animal?");
    assert_eq!(game.turns[0].answer, "No.");
    assert_eq!(game.turns[0].parsed.as_deref(), Some("is_animal"));
    assert!(game.turns[0].expected_gain > 0.0 && game.turns[0].realised_gain > 0.0);
    assert_eq!(b["oracle_invalid"], 1);
    assert_eq!(b["oracle_raw"].as_array().unwrap().len(), 2);
    // Football: the oracle wrongly says yes to "basketball": no win (the rule needs the
    // object's own name), the table follows the answer, later repeats are flagged.
    let f = by_object(1);
    let game: GameRecord = serde_json::from_value(f["game"].clone()).unwrap();
    assert!(!game.won);
    assert_eq!(game.turns.len(), 20);
    assert!(game.turns[1].yes && !game.turns[1].win);
    assert_eq!(game.turns[1].consistent_after, 1);
    assert_eq!(GameMetrics::of(&game).repeated, 18);
    assert_eq!(questioner.calls(), 22);
    assert_eq!(oracle.calls(), 22);
}

#[tokio::test]
async fn hybrid_oracle_asks_the_model_only_what_the_table_cannot_parse() {
    // Questioner: an attribute question, then one the table cannot read, then the guess.
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen_by_questioner = seen.clone();
    let questioner = ScriptedBackend::new("questioner", move |req, _| {
        seen_by_questioner
            .lock()
            .unwrap()
            .push(req.messages.clone());
        Ok(if req.messages.len() >= 5 {
            "Is it a basketball?".to_string()
        } else if req.messages.len() == 3 {
            "Hmm, could you describe how it feels?".to_string()
        } else {
            "Is it an animal?".to_string()
        })
    });
    // A model that says yes to everything: only the unparsed question may reach it.
    let oracle = ScriptedBackend::new("oracle", |_, _| Ok("Yes.".to_string()));
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("eval-hybrid");
    let cfg = EvalConfig {
        task: TaskType::TwentyQuestions,
        models: vec![EvalModel::Spec(ModelSpec::Default)],
        oracle: "hybrid:openai:judge@http://127.0.0.1:9/v1".parse().unwrap(),
        output: out.clone(),
        objects: ObjectSelection::First(1),
        ..EvalConfig::default()
    };
    let roles = EvalRoles {
        models: vec![Some(Role::from_backend(
            "model",
            "scripted",
            questioner.clone(),
            None,
            None,
        ))],
        user: None,
        judge: None,
        oracle: Some(Role::from_backend(
            "oracle",
            "scripted",
            oracle.clone(),
            None,
            None,
        )),
    };
    let report = evaluate_with_roles(cfg.clone(), roles).await.unwrap();
    assert_eq!((report.done_now, report.failed.len()), (1, 0), "{report}");
    let rec = &read_lines(&out.join("conversations/default.jsonl"))[0];
    assert_eq!(rec["oracle"], "hybrid");
    let game: GameRecord = serde_json::from_value(rec["game"].clone()).unwrap();
    // Basketball: the table says "No." to "animal" (the yes-saying model would have lied),
    // the model answers the unparsed question, the table confirms the guess.
    let answers: Vec<&str> = game.turns.iter().map(|t| t.answer.as_str()).collect();
    assert_eq!(answers, ["No.", "Yes.", "Yes."]);
    // The questioner is asked in the chat form generate_conv trains on: the rules, then its
    // own questions as assistant turns and the answers as user turns.
    let last = seen.lock().unwrap().last().cloned().unwrap();
    let turns: Vec<(&str, &str)> = last
        .iter()
        .map(|m| (m.role.as_str(), m.content.as_str()))
        .collect();
    assert!(turns[0].1.starts_with("You are playing 20 Questions"));
    assert_eq!(
        &turns[1..],
        [
            ("assistant", "Is it an animal?"),
            ("user", "No."),
            ("assistant", "Hmm, could you describe how it feels?"),
            ("user", "Yes.")
        ]
    );
    assert!(game.won && game.turns[1].unparsed && !game.turns[0].unparsed);
    assert_eq!(oracle.calls(), 1);
    assert_eq!(rec["oracle_table_answers"], 2);
    assert_eq!(rec["oracle_raw"].as_array().unwrap().len(), 1);
    assert_eq!(rec["metrics"]["unparsed"], 1);
    let s = read_json(&out.join("summary.json"));
    let rate = s["models"][0]["metrics"]["unparsed_rate"]["mean"]
        .as_f64()
        .unwrap();
    assert!((rate - 1.0 / 3.0).abs() < 1e-12, "{rate}");
    // Not the table oracle: no honesty warning.
    assert!(report.warnings.is_empty(), "{report}");

    // A configured model oracle without a backend fails the games instead of silently
    // using the table.
    let out2 = tmp.path().join("eval-missing");
    let report = evaluate_with_roles(
        EvalConfig {
            output: out2,
            ..cfg
        },
        EvalRoles {
            models: vec![Some(Role::from_backend(
                "model",
                "scripted",
                questioner.clone(),
                None,
                None,
            ))],
            user: None,
            judge: None,
            oracle: None,
        },
    )
    .await
    .unwrap();
    assert_eq!(report.failed.len(), 1);
    assert!(report.failed[0].2.contains("oracle has no backend"));
}

#[tokio::test]
async fn table_oracle_reports_unparsed_questions() {
    let questioner = ScriptedBackend::new("questioner", |_, _| {
        Ok("Hmm, could you describe how it feels?".to_string())
    });
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("eval-table");
    let cfg = EvalConfig {
        task: TaskType::TwentyQuestions,
        models: vec![EvalModel::Spec(ModelSpec::Default)],
        oracle: OracleChoice::Table,
        output: out.clone(),
        objects: ObjectSelection::First(1),
        rollout: RolloutConfig {
            max_questions: 4,
            ..RolloutConfig::default()
        },
        ..EvalConfig::default()
    };
    let roles = EvalRoles {
        models: vec![Some(Role::from_backend(
            "model", "scripted", questioner, None, None,
        ))],
        user: None,
        judge: None,
        oracle: None,
    };
    let report = evaluate_with_roles(cfg, roles).await.unwrap();
    let rec = &read_lines(&out.join("conversations/default.jsonl"))[0];
    assert_eq!(rec["oracle"], "table");
    assert_eq!(rec["metrics"]["unparsed"], 4);
    assert!(rec["game"]["turns"]
        .as_array()
        .unwrap()
        .iter()
        .all(|t| t["answer"] == "No." && t["unparsed"] == true));
    assert_eq!(report.warnings.len(), 1, "{report}");
    let w = &report.warnings[0];
    assert!(
        w.contains("default") && w.contains("100.0%") && w.contains("No."),
        "{w}"
    );
}

// ---------------------------------------------------------------------------------------------
// Hygiene: a generate_conv run's tasks are refused.

async fn scripted_generate_run(dir: &Path) {
    let cfg = GenerateConfig {
        tasks: Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("data/math.jsonl")
            .display()
            .to_string(),
        output: dir.to_path_buf(),
        candidates: 2,
        samples: 1,
        window: 2,
        max_messages: 4,
        max_tasks: Some(2),
        ..GenerateConfig::default()
    };
    let policy = scripted_role("policy", None);
    let roles = Roles {
        assistant: policy.clone(),
        policy,
        user: scripted_role("user", None),
        judge: scripted_role("judge", None),
    };
    let tasks = cfg.task_source().load().unwrap();
    let s = generate_with_roles(cfg, tasks, roles).await.unwrap();
    assert_eq!(s.tasks_done_now, 2);
}

fn scripted_eval_roles() -> EvalRoles {
    EvalRoles {
        models: vec![Some(scripted_role("model", None))],
        user: Some(scripted_role("user", None)),
        judge: Some(scripted_role("judge", None)),
        oracle: None,
    }
}

#[tokio::test]
async fn overlap_with_a_generate_run_is_refused_unless_allowed() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("gen");
    scripted_generate_run(&run).await;
    let cfg = EvalConfig {
        models: vec![EvalModel::Spec(ModelSpec::Default)],
        output: tmp.path().join("eval"),
        max_tasks: Some(3),
        max_turns: 2,
        exclude_runs: vec![run.clone()],
        ..EvalConfig::default()
    };
    let err = evaluate_with_roles(cfg.clone(), scripted_eval_roles())
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("math-001") && err.contains("math-002") && !err.contains("math-003"),
        "{err}"
    );
    assert!(err.contains(&run.display().to_string()) && err.contains("--allow-overlap"));
    assert!(
        !tmp.path().join("eval/conversations").exists(),
        "nothing evaluated"
    );

    let report = evaluate_with_roles(
        EvalConfig {
            allow_overlap: true,
            ..cfg.clone()
        },
        scripted_eval_roles(),
    )
    .await
    .unwrap();
    assert_eq!(report.done_now, 3);
    assert!(report.warnings[0].contains("math-001"), "{report}");

    // Tasks 3.. do not overlap.
    let tasks = tmp.path().join("later.jsonl");
    let text =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("data/math.jsonl"))
            .unwrap();
    std::fs::write(
        &tasks,
        text.lines().skip(2).take(2).collect::<Vec<_>>().join("\n"),
    )
    .unwrap();
    let report = evaluate_with_roles(
        EvalConfig {
            tasks: Some(tasks.display().to_string()),
            output: tmp.path().join("eval-later"),
            ..cfg
        },
        scripted_eval_roles(),
    )
    .await
    .unwrap();
    assert_eq!(report.done_now, 2);
    assert!(report.warnings.is_empty());
}

// ---------------------------------------------------------------------------------------------
// The binary.

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_eval_multiturn")
}

fn run_bin(args: &[&str]) -> std::process::Output {
    std::process::Command::new(bin())
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("running eval_multiturn")
}

/// Golden numbers of the reference questioner over all 158 objects (table oracle), frozen:
/// 1305 questions in all (8.2595 per game; the optimum is 7.785), every game won.
const REFERENCE_MEAN_TURNS: f64 = 1305.0 / 158.0;
/// EDA scores sum to 147.7 over the 158 wins.
const REFERENCE_EDA: f64 = 147.7 / 158.0;
/// Bits gathered per game (log2 158 = 7.304 when a game ends on a guess of the last object).
const REFERENCE_INFO_GAIN_PER_GAME: f64 = 7.291_122_520_329_011;

/// A loss counts the whole budget, so games of 20 and of 5 questions are not paired.
#[test]
fn compare_refuses_runs_of_different_question_budgets() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |name: &str, extra: &[&str]| {
        let out = tmp.path().join(name);
        let o = out.to_str().unwrap();
        let base = [
            "--task",
            "twenty_questions",
            "--model",
            "random",
            "--objects",
            "4",
        ];
        assert_ok(&run_bin(&[&base[..], extra, &["--output", o]].concat()));
        out
    };
    let twenty = run("q20", &["--max-questions", "20"]);
    let five = run("q5", &["--max-questions", "5"]);
    let again = run("q20b", &["--max-questions", "20"]);
    let compare =
        |a: &Path, b: &Path| run_bin(&["--compare", a.to_str().unwrap(), b.to_str().unwrap()]);
    let res = compare(&twenty, &five);
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(!res.status.success(), "{err}");
    assert!(
        err.contains("`max_questions`") && err.contains("q5 has 5"),
        "{err}"
    );
    assert_ok(&compare(&twenty, &again));
    // Other settings that change what a game measures are refused by name too: here the
    // weights format (a table-oracle run against an LLM-oracle one, the training split
    // against the held-out one, alike).
    let f32_run = run("q20-f32", &["--max-questions", "20", "--weights", "f32"]);
    let res = compare(&twenty, &f32_run);
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(!res.status.success(), "{err}");
    assert!(
        err.contains("`weights`") && err.contains("\"f32\""),
        "{err}"
    );
}

/// Fails with the run's stderr unless it succeeded.
fn assert_ok(res: &std::process::Output) {
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
}

#[test]
fn binary_plays_all_objects_with_builtin_questioners_and_refuses_overlap() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("eval-20q");
    let o = out.to_str().unwrap();
    let res = run_bin(&[
        "--task",
        "twenty_questions",
        "--model",
        "reference",
        "--model",
        "random",
        "--objects",
        "all",
        "--output",
        o,
    ]);
    let stdout = String::from_utf8_lossy(&res.stdout);
    assert!(
        res.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&res.stderr)
    );
    assert!(
        stdout.contains("success_rate") && stdout.contains("reference") && stdout.contains("±"),
        "{stdout}"
    );
    let s = read_json(&out.join("summary.json"));
    let r = &s["models"][0]["metrics"];
    assert_eq!(r["success_rate"]["mean"], 1.0);
    assert_eq!(r["success_rate"]["n"], 158);
    assert!((r["mean_turns"]["mean"].as_f64().unwrap() - REFERENCE_MEAN_TURNS).abs() < 1e-12);
    assert!(
        (r["mean_return"]["mean"].as_f64().unwrap() - (1.0 - REFERENCE_MEAN_TURNS)).abs() < 1e-12
    );
    assert_eq!(r["unparsed"]["mean"], 0.0);
    let gold_eda = r["eda_score"]["mean"].as_f64().unwrap();
    assert!((gold_eda - REFERENCE_EDA).abs() < 1e-12, "eda {gold_eda}");
    let ig = r["info_gain_per_game"]["mean"].as_f64().unwrap();
    assert!((ig - REFERENCE_INFO_GAIN_PER_GAME).abs() < 1e-9, "ig {ig}");
    let random = &s["models"][1]["metrics"];
    assert_eq!(random["success_rate"]["n"], 158);
    assert_eq!(random["repeated"]["mean"], 0.0);
    let csv = std::fs::read_to_string(out.join("summary.csv")).unwrap();
    assert_eq!(csv.lines().count(), 1 + 2 * 13);
    assert_eq!(read_lines(&out.join("lmrl/reference.jsonl")).len(), 158);

    // A generate_conv run directory written by hand in record.rs's format: one finished
    // twenty_questions task about the plane, and one math task.
    let run = tmp.path().join("gen");
    std::fs::create_dir_all(&run).unwrap();
    let rec = |id: &str, tt: &str, goal: &str, reference: &str| {
        serde_json::json!({
            "task_id": id, "task_type": tt, "goal": goal, "reference": reference,
            "metadata": null,
            "first_user": {"text": "hi", "terminated": false, "raw": "hi"},
            "turns": [], "messages": [{"role": "user", "content": "hi"}],
            "ended_by": "max_messages", "weights": {}, "started_at": 0.0, "finished_at": 0.0,
        })
        .to_string()
    };
    std::fs::write(
        run.join("conversations.jsonl"),
        format!(
            "{}\n{}\n",
            rec("q-1", "twenty_questions", "Guess my object", "Plane"),
            rec("math-004", "math", "x", "1")
        ),
    )
    .unwrap();
    let out2 = tmp.path().join("eval-overlap");
    let res = run_bin(&[
        "--task",
        "twenty_questions",
        "--model",
        "reference",
        "--output",
        out2.to_str().unwrap(),
        "--exclude-run",
        run.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&res.stderr);
    assert!(!res.status.success());
    assert!(
        stderr.contains("Airplane") && stderr.contains("--allow-overlap"),
        "{stderr}"
    );
    // The first 30 objects do not include the airplane (object 34).
    let res = run_bin(&[
        "--task",
        "twenty_questions",
        "--model",
        "reference",
        "--objects",
        "30",
        "--output",
        out2.to_str().unwrap(),
        "--exclude-run",
        run.to_str().unwrap(),
    ]);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    // Math: the overlap is found before any model is loaded.
    let res = run_bin(&[
        "--task",
        "math",
        "--model",
        "default",
        "--output",
        tmp.path().join("m").to_str().unwrap(),
        "--exclude-run",
        run.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&res.stderr);
    assert!(!res.status.success());
    assert!(
        stderr.contains("math-004") && !stderr.contains("math-001"),
        "{stderr}"
    );
}

#[test]
fn binary_rejects_bad_flags_with_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let o = tmp.path().join("x");
    let o = o.to_str().unwrap();
    for (args, needle) in [
        (
            vec!["--task", "math", "--model", "reference", "--output", o],
            "built-in 20 Questions questioner",
        ),
        (
            vec![
                "--task",
                "twenty_questions",
                "--model",
                "reference",
                "--objects",
                "zero",
                "--output",
                o,
            ],
            "all",
        ),
        (
            vec![
                "--task",
                "twenty_questions",
                "--model",
                "reference",
                "--objects",
                "999",
                "--output",
                o,
            ],
            "only 158 objects",
        ),
        (
            vec!["--task", "chess", "--model", "reference", "--output", o],
            "chess",
        ),
        (
            vec![
                "--task",
                "math",
                "--model",
                "default",
                "--tasks",
                "/no/such.jsonl",
                "--output",
                o,
            ],
            "/no/such.jsonl",
        ),
        // Numbers are checked at start-up, naming the flag, the value and the valid range.
        (
            vec!["--task", "math", "--temperature", "NaN", "--output", o],
            "'NaN' for '--temperature <T>': must be a finite number >= 0",
        ),
        (
            vec!["--task", "math", "--timeout", "1e30", "--output", o],
            "'1e30' for '--timeout <SECS>': must be a finite number in (0, 86400]",
        ),
    ] {
        let res = run_bin(&args);
        let stderr = String::from_utf8_lossy(&res.stderr);
        assert!(!res.status.success(), "{args:?}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[test]
fn split_test_plays_only_objects_no_training_run_saw() {
    use collabllm::task::twenty_questions::chat::{default_world, split_objects, ObjectSplit};
    let held_out = split_objects(default_world().unwrap(), ObjectSplit::Test);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("eval-split");
    let res = run_bin(&[
        "--task",
        "twenty_questions",
        "--model",
        "reference",
        "--split",
        "test",
        "--output",
        out.to_str().unwrap(),
    ]);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let played: Vec<usize> = read_lines(&out.join("conversations/reference.jsonl"))
        .iter()
        .map(|r| r["game"]["object_index"].as_u64().unwrap() as usize)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    assert_eq!(played, held_out);
    // The split is part of what a resumed evaluation must share.
    let res = run_bin(&[
        "--task",
        "twenty_questions",
        "--model",
        "reference",
        "--split",
        "train",
        "--output",
        out.to_str().unwrap(),
    ]);
    assert!(!res.status.success());
    assert!(String::from_utf8_lossy(&res.stderr).contains("split"));
    let res = run_bin(&["--task", "twenty_questions", "--split", "holdout"]);
    assert!(!res.status.success());
    assert!(String::from_utf8_lossy(&res.stderr).contains("train, test or all"));
}

/// A scripted assistant that records the messages of every request it gets.
fn recording_model(name: &str) -> (Role, Arc<std::sync::Mutex<Vec<Vec<String>>>>) {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    let backend = ScriptedBackend::new(name, move |req, _| {
        log.lock().unwrap().push(
            req.messages
                .iter()
                .map(|m| format!("{}: {}", m.role, m.content))
                .collect(),
        );
        Ok("Could you tell me more about what you need?".to_string())
    });
    (
        Role::from_backend(name, "scripted", backend, None, None),
        seen,
    )
}

#[tokio::test]
async fn a_proactive_row_and_a_system_prompt_reach_only_their_models() {
    let tmp = tempfile::tempdir().unwrap();
    let system_file = tmp.path().join("system.txt");
    std::fs::write(&system_file, "You are a careful tutor.\n").unwrap();
    let out = tmp.path().join("eval-system");
    let cfg = EvalConfig {
        task: TaskType::Math,
        models: vec![
            EvalModel::Spec(ModelSpec::Default),
            "proactive:default".parse().unwrap(),
        ],
        output: out.clone(),
        max_tasks: Some(2),
        max_turns: 2,
        system_prompt: Some(collabllm::task::prompts::SystemPromptSource::File(
            system_file.clone(),
        )),
        ..EvalConfig::default()
    };
    let (plain, plain_seen) = recording_model("plain");
    let (proactive, proactive_seen) = recording_model("proactive");
    let roles = EvalRoles {
        models: vec![Some(plain), Some(proactive)],
        user: Some(scripted_role("user", None)),
        judge: Some(scripted_role("judge", None)),
        oracle: None,
    };
    let report = evaluate_with_roles(cfg.clone(), roles).await.unwrap();
    assert_eq!(report.failed.len(), 0, "{report}");
    let names: Vec<&str> = report
        .summary
        .models
        .iter()
        .map(|m| m.name.as_str())
        .collect();
    assert_eq!(names, ["default", "default-proactive"]);
    assert!(out.join("conversations/default-proactive.jsonl").is_file());
    let plain_seen = plain_seen.lock().unwrap().clone();
    assert!(!plain_seen.is_empty());
    for msgs in plain_seen.iter() {
        assert_eq!(msgs[0], "system: You are a careful tutor.");
        assert!(msgs[1].starts_with("user: "), "{msgs:?}");
    }
    let proactive_seen = proactive_seen.lock().unwrap().clone();
    assert!(!proactive_seen.is_empty());
    for msgs in proactive_seen.iter() {
        assert!(
            msgs[0].starts_with("system: You are a collaborative AI assistant"),
            "{msgs:?}"
        );
        assert_eq!(msgs.iter().filter(|m| m.starts_with("system: ")).count(), 1);
    }
    // The system prompt is part of what a resumed evaluation must share; an empty file is
    // refused before any model call.
    std::fs::write(&system_file, "  \n").unwrap();
    let err = evaluate_with_roles(
        cfg,
        EvalRoles {
            models: vec![None, None],
            user: None,
            judge: None,
            oracle: None,
        },
    )
    .await
    .unwrap_err();
    assert!(format!("{err:#}").contains("empty"), "{err:#}");
}

/// The demonstrator's games become SFT conversations: the rules, then question / answer
/// turns, ending at the winning question; every question is one the table reads.
#[test]
fn demonstrator_games_are_written_as_sft_conversations() {
    use collabllm::dataset::sft::read_sft_parquet;
    use collabllm::task::twenty_questions::chat::default_world;
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("demo");
    let res = run_bin(&[
        "--task",
        "twenty_questions",
        "--model",
        "demonstrator",
        "--split",
        "train",
        "--objects",
        "12",
        "--repeats",
        "2",
        "--sft",
        "--output",
        out.to_str().unwrap(),
    ]);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let rows = read_sft_parquet(&out.join("sft/demonstrator.parquet")).unwrap();
    let games = read_lines(&out.join("conversations/demonstrator.jsonl"));
    let won = games.iter().filter(|g| g["game"]["won"] == true).count();
    assert_eq!(games.len(), 24);
    assert!(
        won >= 22,
        "the demonstrator wins nearly always: {won} of 24"
    );
    assert_eq!(rows.len(), won, "one conversation per won game");
    let world = default_world().unwrap();
    for r in &rows {
        let m = &r.messages;
        assert!(m[0].role == "user" && m[0].content.starts_with("You are playing 20 Questions"));
        assert_eq!(
            m.last().unwrap().role,
            "assistant",
            "ends at the winning question"
        );
        for (k, msg) in m.iter().enumerate().skip(1) {
            let want = if k % 2 == 1 { "assistant" } else { "user" };
            assert_eq!(msg.role, want);
            if want == "assistant" {
                assert!(world.parse(&msg.content).is_some(), "{}", msg.content);
            } else {
                assert!(msg.content == "Yes." || msg.content == "No.");
            }
        }
    }
    // The two repeats of one object are different games (the draw among the best questions).
    let questions = |repeat: u64| -> Vec<String> {
        games
            .iter()
            .filter(|g| {
                g["repeat"] == repeat
                    && g["game"]["object_index"] == games[0]["game"]["object_index"]
            })
            .flat_map(|g| g["game"]["turns"].as_array().unwrap().iter())
            .map(|t| t["question"].as_str().unwrap().to_string())
            .collect()
    };
    let different = (0..12).any(|_| questions(0) != questions(1));
    assert!(different, "{:?} vs {:?}", questions(0), questions(1));
}

/// `--study`: arms of finished evaluations, per-seed McNemar tests and pooled differences with
/// a cluster bootstrap, written to study.json / study.md; a bad spec names the file.
#[test]
fn study_compares_arms_of_finished_evaluations() {
    let tmp = tempfile::tempdir().unwrap();
    let eval = |name: &str, model: &str, seed: &str| {
        let out = tmp.path().join(name);
        let res = run_bin(&[
            "--task",
            "twenty_questions",
            "--model",
            model,
            "--split",
            "test",
            "--seed",
            seed,
            "--output",
            out.to_str().unwrap(),
        ]);
        assert!(
            res.status.success(),
            "{}",
            String::from_utf8_lossy(&res.stderr)
        );
        out.display().to_string()
    };
    let reference = eval("reference", "reference", "0");
    let random: Vec<String> = (1..=3)
        .map(|s| eval(&format!("random-{s}"), "random", &s.to_string()))
        .collect();
    // A seed played with another question budget is not a seed of the same arm.
    let short = tmp.path().join("random-short");
    let res = run_bin(&[
        "--task",
        "twenty_questions",
        "--model",
        "random",
        "--split",
        "test",
        "--max-questions",
        "10",
        "--output",
        short.to_str().unwrap(),
    ]);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let mixed = format!(
        "title = \"t\"\nprimary = \"success\"\ncomparisons = []\n[[arms]]\n\
         name = \"random\"\nruns = [\"{}\", \"{}\"]\n",
        random[0],
        short.display()
    );
    let mixed_path = tmp.path().join("mixed.toml");
    std::fs::write(&mixed_path, mixed).unwrap();
    let res = run_bin(&[
        "--study",
        mixed_path.to_str().unwrap(),
        "--output",
        tmp.path().join("mixed").to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(!res.status.success(), "{err}");
    assert!(
        err.contains("`max_questions`") && err.contains("10"),
        "{err}"
    );
    let spec = format!(
        "title = \"t\"\nprimary = \"success\"\nsecondary = [\"identified\"]\n\
         comparisons = [{{ arm = \"random\", against = \"reference\" }}]\n\
         [[arms]]\nname = \"reference\"\nruns = [\"{reference}\"]\n\
         [[arms]]\nname = \"random\"\nruns = [\"{}\", \"{}\", \"{}\"]\n\
         [meta]\nrevision = \"abc\"\n",
        random[0], random[1], random[2]
    );
    let spec_path = tmp.path().join("study.toml");
    std::fs::write(&spec_path, spec).unwrap();
    let out = tmp.path().join("study");
    let res = run_bin(&[
        "--study",
        spec_path.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ]);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let s = read_json(&out.join("study.json"));
    assert_eq!(s["meta"]["revision"], "abc");
    let c = &s["comparisons"][0];
    assert_eq!(c["per_seed"].as_array().unwrap().len(), 3);
    let d = c["pooled_difference"].as_f64().unwrap();
    let (lo, hi) = (
        c["ci95"][0].as_f64().unwrap(),
        c["ci95"][1].as_f64().unwrap(),
    );
    assert!(d < -0.6 && lo <= d && d <= hi && hi < 0.0, "{c}");
    assert_eq!(s["arms"][0]["pooled_rate"], 1.0);
    assert_eq!(s["arms"][0]["secondary"]["identified"], 1.0);
    assert_eq!(
        s["arms"][0]["seeds"][0]["outcomes"]
            .as_object()
            .unwrap()
            .len(),
        31
    );
    assert!(std::fs::read_to_string(out.join("study.md"))
        .unwrap()
        .contains("random vs reference"));
    // A spec naming an arm that is not there is refused, naming it.
    std::fs::write(&spec_path, "title = \"t\"\nprimary = \"success\"\narms = []\ncomparisons = [{ arm = \"a\", against = \"b\" }]\n").unwrap();
    let res = run_bin(&[
        "--study",
        spec_path.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ]);
    assert!(!res.status.success());
    assert!(String::from_utf8_lossy(&res.stderr).contains("unknown arm `a`"));
}

/// The clarify mixed demonstrator plays at its rates (asked_vague ≈ --ask-rate, asked_stated ≈
/// --needless-ask-rate), always uses the detail after asking, and with --sft its
/// conversations become SFT rows as played; the records carry the task reward and template.
#[tokio::test]
async fn clarify_demonstrator_plays_at_its_rates_and_writes_sft() {
    use collabllm::dataset::sft::read_sft_parquet;
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("demo");
    let cfg = EvalConfig {
        task: TaskType::Clarify,
        models: vec![EvalModel::Demonstrator],
        tasks: Some("clarify:train".into()),
        output: out.clone(),
        repeats: 4,
        sft: true,
        ask_rate: 0.6,
        needless_ask_rate: 0.2,
        ..EvalConfig::default()
    };
    cfg.validate().unwrap();
    let roles = EvalRoles {
        models: vec![None],
        user: Some(scripted_role("user", None)),
        judge: Some(scripted_role("judge", None)),
        oracle: None,
    };
    let report = evaluate_with_roles(cfg.clone(), roles).await.unwrap();
    assert!(report.failed.is_empty(), "{report}");
    let recs = read_lines(&out.join("conversations/demonstrator.jsonl"));
    let n = recs.len();
    assert_eq!(
        n,
        4 * collabllm::task::clarify::tasks(collabllm::task::clarify::Split::Train).len()
    );
    let rate = |key: &str| {
        let v: Vec<f64> = recs
            .iter()
            .filter_map(|r| r["metrics"][key].as_f64())
            .collect();
        v.iter().sum::<f64>() / v.len() as f64
    };
    // 616 draws of each kind: 4 standard errors are about ±0.08 and ±0.065.
    assert!(
        (rate("asked_vague") - 0.6).abs() < 0.08,
        "{}",
        rate("asked_vague")
    );
    assert!(
        (rate("asked_stated") - 0.2).abs() < 0.065,
        "{}",
        rate("asked_stated")
    );
    assert_eq!(rate("detail_used_stated"), 1.0);
    for r in &recs {
        let m = &r["metrics"];
        let want =
            m["detail_used"].as_f64().unwrap() - 0.3 * m["clarifying_questions"].as_f64().unwrap();
        assert!(
            (m["task_reward"].as_f64().unwrap() - want).abs() < 1e-12,
            "{r}"
        );
        assert!(r["template"].is_string(), "{r}");
        // Asking always leads to the detail.
        if m["clarifying_questions"] == 1.0 {
            assert_eq!(m["detail_used"], 1.0, "{r}");
        }
    }
    let rows = read_sft_parquet(&out.join("sft/demonstrator.parquet")).unwrap();
    assert_eq!(rows.len(), n);
    let turns: Vec<usize> = recs
        .iter()
        .map(|r| r["turns"].as_array().unwrap().len())
        .collect();
    assert_eq!(
        rows.iter().map(|r| r.messages.len()).collect::<Vec<_>>(),
        turns
    );
    assert!(rows
        .iter()
        .all(|r| r.messages.last().unwrap().role == "assistant"));
    // The demonstrator makes no model call, and its rates are checked at start-up.
    assert_eq!(total_calls(&report), (0, 0));
    let bad = EvalConfig {
        ask_rate: 1.5,
        ..cfg.clone()
    };
    assert!(bad.validate().unwrap_err().to_string().contains("ask-rate"));
    let other = EvalConfig {
        task: TaskType::Math,
        ..cfg
    };
    assert!(other
        .validate()
        .unwrap_err()
        .to_string()
        .contains("cannot play --task math"));
}

/// A flag the chosen task does not read is refused by name, never ignored (`--max-tasks 3`
/// with 20 Questions played every game and recorded `max_tasks: 3`); `--sft` with nothing
/// to write writes no empty file and says why.
#[test]
fn flags_the_task_does_not_read_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let out = out.to_str().unwrap();
    for (args, flag) in [
        (
            &[
                "--task",
                "twenty_questions",
                "--model",
                "random",
                "--max-tasks",
                "3",
            ][..],
            "--max-tasks",
        ),
        (
            &[
                "--task",
                "twenty_questions",
                "--model",
                "random",
                "--tasks",
                "clarify:test",
            ][..],
            "--tasks",
        ),
        (
            &[
                "--task",
                "clarify",
                "--model",
                "demonstrator",
                "--objects",
                "4",
            ][..],
            "--objects",
        ),
        (
            &[
                "--task",
                "clarify",
                "--model",
                "demonstrator",
                "--split",
                "test",
            ][..],
            "--split",
        ),
        (
            &[
                "--task",
                "math",
                "--model",
                "default",
                "--max-questions",
                "5",
            ][..],
            "--max-questions",
        ),
        (
            &["--task", "math", "--model", "default", "--ask-rate", "0.3"][..],
            "--ask-rate",
        ),
        (
            &[
                "--task",
                "twenty_questions",
                "--model",
                "random",
                "--needless-ask-rate",
                "0.5",
            ][..],
            "--needless-ask-rate",
        ),
    ] {
        let res = run_bin(&[args, &["--output", out]].concat());
        let err = String::from_utf8_lossy(&res.stderr);
        assert!(!res.status.success(), "{args:?}: {err}");
        assert!(
            err.contains(flag) && err.contains("not used"),
            "{args:?}: {err}"
        );
        assert!(!Path::new(out).join("manifest.json").exists(), "{args:?}");
    }
    // A questioner that wins nothing: no empty SFT file.
    let res = run_bin(&[
        "--task",
        "twenty_questions",
        "--model",
        "random",
        "--objects",
        "2",
        "--max-questions",
        "1",
        "--sft",
        "--output",
        out,
    ]);
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(res.status.success(), "{err}");
    let summary = read_json(&Path::new(out).join("summary.json"));
    assert_eq!(
        summary["models"][0]["metrics"]["success_rate"]["mean"], 0.0,
        "{summary}"
    );
    assert!(!Path::new(out).join("sft/random.parquet").exists());
    assert!(err.contains("won no game"), "{err}");
}

/// `--compare` reads finished runs: a run flag beside it (`--max-tasks`, `--temperature`, …)
/// is refused by name rather than ignored, and a run named twice (in any spelling) too.
#[test]
fn compare_refuses_run_flags_and_a_run_compared_with_itself() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("a");
    let b = tmp.path().join("b");
    std::fs::create_dir_all(&a).unwrap();
    std::fs::create_dir_all(&b).unwrap();
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    for (extra, flag) in [
        (&["--max-tasks", "3"][..], "--max-tasks"),
        (&["--temperature", "1.5"][..], "--temperature"),
        (&["--seed", "3"][..], "--seed"),
        (&["--task", "twenty_questions"][..], "--task"),
    ] {
        let res = run_bin(&[&["--compare", a, b][..], extra].concat());
        let err = String::from_utf8_lossy(&res.stderr);
        assert!(!res.status.success(), "{extra:?}: {err}");
        assert!(
            err.contains(flag) && err.contains("--compare"),
            "{extra:?}: {err}"
        );
    }
    let same = format!("{}/../a", b);
    let res = run_bin(&["--compare", a, &same]);
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(!res.status.success(), "{err}");
    assert!(err.contains("twice") && err.contains(a), "{err}");
}

/// `--dagger FILE`: every state a questioner asked at, labelled with the demonstrator's
/// question on that same state (its seed from the game's), beside what the questioner asked;
/// the prompt is the state as the questioner saw it (its raw questions). Labelling again
/// replaces a questioner's rows and keeps the others'.
#[tokio::test]
async fn dagger_labels_every_state_with_the_demonstrators_question() {
    use collabllm::dataset::pairs::read_pairs_parquet;
    use collabllm::eval::{dagger_seed, game_seed};
    use collabllm::task::twenty_questions::chat::{answered_questions, default_world};
    use collabllm::task::twenty_questions::{DemonstratorQuestioner, Questioner};
    let world = default_world().unwrap();
    // A chatty questioner: the n-th question of a game is attribute n, with a preamble the
    // game cleans away.
    let chatty = ScriptedBackend::new("chatty", move |req, _| {
        let asked = req
            .messages
            .iter()
            .filter(|m| m.role == "assistant")
            .count();
        Ok(format!(
            "Good. {}",
            default_world().unwrap().attribute_question(asked).unwrap()
        ))
    });
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("eval");
    let file = tmp.path().join("dagger.parquet");
    let cfg = EvalConfig {
        task: TaskType::TwentyQuestions,
        models: vec![
            EvalModel::Spec("openai:chatty".parse().unwrap()),
            EvalModel::Random,
        ],
        output: out.clone(),
        objects: ObjectSelection::First(3),
        dagger: Some(file.clone()),
        seed: 5,
        ..EvalConfig::default()
    };
    let roles = || EvalRoles {
        models: vec![
            Some(Role::from_backend(
                "model",
                "chatty",
                chatty.clone(),
                None,
                None,
            )),
            None,
        ],
        user: None,
        judge: None,
        oracle: None,
    };
    evaluate_with_roles(cfg.clone(), roles()).await.unwrap();
    let rows = read_pairs_parquet(&file).unwrap();
    let games_questions: usize = std::fs::read_dir(out.join("conversations"))
        .unwrap()
        .map(|e| {
            read_lines(&e.unwrap().path())
                .iter()
                .map(|r| r["game"]["turns"].as_array().unwrap().len())
                .sum::<usize>()
        })
        .sum();
    assert_eq!(rows.len(), games_questions);
    let mut chatty_rows = 0;
    for row in &rows {
        let (prefix, game) = row.conv_id.rsplit_once(':').unwrap();
        let object: usize = game.split('-').next().unwrap().parse().unwrap();
        let k = row.turn_id as usize;
        let state = answered_questions(&row.prompt);
        assert_eq!(state.len(), k, "{row:?}");
        let label = DemonstratorQuestioner::new(world, dagger_seed(game_seed(5, 0, object), k))
            .next_question(&state);
        assert_eq!(row.chosen[0].content, label);
        if prefix.contains("chatty") {
            chatty_rows += 1;
            let asked = world.attribute_question(k).unwrap();
            assert_eq!(row.rejected[0].content, format!("Good. {asked}"));
            // The state as the questioner saw it: its own raw questions.
            assert!(row
                .prompt
                .iter()
                .filter(|m| m.role == "assistant")
                .all(|m| m.content.starts_with("Good. ")));
        }
    }
    assert!(chatty_rows >= 3, "{chatty_rows}");
    // Labelling the chatty questioner again (the games resume) replaces its rows.
    let again = EvalConfig {
        models: vec![EvalModel::Spec("openai:chatty".parse().unwrap())],
        ..cfg
    };
    let one = EvalRoles {
        models: vec![Some(Role::from_backend(
            "model",
            "chatty",
            chatty.clone(),
            None,
            None,
        ))],
        user: None,
        judge: None,
        oracle: None,
    };
    evaluate_with_roles(again, one).await.unwrap();
    assert_eq!(read_pairs_parquet(&file).unwrap().len(), rows.len());
}
