//! Fixture run directories for `plot`, in the formats of docs/formats.md. Shared by
//! tests/plot.rs and examples/plot_fixtures.rs (the README gallery).
#![allow(dead_code)]

use std::path::Path;

use collabllm::dataset::{write_pairs_parquet, PairRow};
use collabllm::llm::ChatMessage;
use collabllm::task::twenty_questions::{
    play, AggregateMetrics, GameMetrics, GameRecord, Questioner, RandomGuessQuestioner,
    ReferenceQuestioner, TableOracle, World,
};
use serde_json::{json, Value};

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

/// A dpo_train `logs.jsonl` with `steps` training lines (a smooth, noisy-looking descent)
/// and an eval line every `eval_every` steps.
pub fn write_train_run(dir: &Path, steps: usize, eval_every: usize, offset: f64) {
    let mut lines = Vec::new();
    for s in 1..=steps {
        let t = s as f64;
        // Deterministic wiggle so smoothing has something to smooth.
        let noise = ((t * 1.7 + offset).sin()) * 0.05;
        let margin = 0.8 * (1.0 - (-t / 15.0).exp()) + noise + offset * 0.1;
        let chosen = 0.5 * margin;
        lines.push(json!({
            "step": s, "epoch": t / steps as f64,
            "loss": 0.693 * (-t / 20.0).exp() + 0.2 + noise,
            "rewards/chosen": chosen, "rewards/rejected": chosen - margin,
            "rewards/margins": margin,
            "rewards/accuracies": (0.5 + 0.4 * (1.0 - (-t / 10.0).exp()) + noise).min(1.0),
            "logps/chosen": -120.0 + t, "logps/rejected": -125.0 - t,
            "learning_rate": 5e-6 * (1.0 - (s - 1) as f64 / steps as f64),
            "grad_norm": 1.0 + noise, "tokens_per_second": 900.0,
        }));
        if eval_every > 0 && s % eval_every == 0 {
            lines.push(json!({
                "step": s, "epoch": t / steps as f64,
                "eval_loss": 0.693 * (-t / 22.0).exp() + 0.25,
                "eval_rewards/chosen": chosen * 0.9, "eval_rewards/rejected": (chosen - margin) * 0.9,
                "eval_rewards/margins": margin * 0.9, "eval_rewards/accuracies": 0.6,
                "eval_logps/chosen": -121.0, "eval_logps/rejected": -126.0,
            }));
        }
    }
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    write(&dir.join("logs.jsonl"), &text);
}

fn msg(role: &str, content: &str) -> ChatMessage {
    serde_json::from_value(json!({"role": role, "content": content})).unwrap()
}

/// A generate_conv run directory: manifest.json (config.min_gap), pairs/{train,test}.parquet
/// and conversations.jsonl with session scores for accuracy, interactivity, token_amount.
pub fn write_data_run(dir: &Path, conversations: usize, min_gap: f64) {
    let mut train = Vec::new();
    let mut test = Vec::new();
    let mut records = Vec::new();
    for c in 0..conversations {
        let mut turns = Vec::new();
        for t in 0..2u32 {
            let k = (c * 2 + t as usize) as f64;
            let chosen = 0.6 + 0.3 * ((k * 0.9).sin() * 0.5 + 0.5);
            let rejected = chosen - 0.05 - 0.2 * ((k * 1.3).cos() * 0.5 + 0.5);
            let row = PairRow {
                prompt: vec![msg("user", "q")],
                chosen: vec![msg("assistant", "good")],
                rejected: vec![msg("assistant", "bad")],
                score_chosen: chosen,
                score_rejected: rejected,
                conv_id: format!("task-{c}"),
                turn_id: t,
            };
            if c % 5 == 4 {
                test.push(row);
            } else {
                train.push(row);
            }
            let session = |acc: f64, inter: f64, tok: f64| {
                json!({"messages": [{"role": "user", "content": "u"}], "terminated": false,
                       "user_raw": ["u"],
                       "scores": {"accuracy": {"value": acc, "method": "programmatic"},
                                  "interactivity": {"value": inter, "method": "llm-json"},
                                  "token_amount": {"value": tok, "method": "tokens:test"}}})
            };
            let cand = |i: usize, acc: f64| {
                json!({"index": i, "variant": if i == 0 {"proactive"} else {"plain"},
                       "text": "a", "finish_reason": "stop", "mr": chosen,
                       "sessions": [session(acc, 0.3 + 0.1 * ((k + i as f64) % 5.0), 0.05 + 0.01 * k)]})
            };
            turns.push(
                json!({"turn_id": t, "history": [{"role": "user", "content": "q"}],
                              "candidates": [cand(0, 1.0), cand(1, k % 2.0)],
                              "chosen": 0, "next_user": null}),
            );
        }
        records.push(json!({
            "task_id": format!("task-{c}"), "task_type": "math", "goal": "g", "reference": "1",
            "metadata": {}, "first_user": {"text": "q", "terminated": false, "raw": "q"},
            "turns": turns, "messages": [{"role": "user", "content": "q"}],
            "ended_by": "max_messages",
            "weights": {"accuracy": 1.0, "interactivity": 1.0, "token_amount": -0.1},
            "started_at": 0.0, "finished_at": 1.0,
        }));
    }
    std::fs::create_dir_all(dir.join("pairs")).unwrap();
    write_pairs_parquet(&dir.join("pairs/train.parquet"), &train).unwrap();
    write_pairs_parquet(&dir.join("pairs/test.parquet"), &test).unwrap();
    let text: String = records.iter().map(|l| format!("{l}\n")).collect();
    write(&dir.join("conversations.jsonl"), &text);
    let manifest = json!({"config": {"min_gap": min_gap, "seed": 0}, "counts": {}});
    write(&dir.join("manifest.json"), &manifest.to_string());
}

/// summary.json metrics from `(mean, se, n)` triples.
fn metrics(items: &[(&str, f64, f64, usize)]) -> Value {
    let mut m = serde_json::Map::new();
    for (k, mean, se, n) in items {
        m.insert(k.to_string(), json!({"mean": mean, "se": se, "n": n}));
    }
    Value::Object(m)
}

/// An eval_multiturn summary of a math evaluation with two models.
pub fn write_math_eval(dir: &Path) {
    let summary = json!({
        "task": "math", "seed": 0, "tool_version": "0.1.0",
        "models": [
            {"name": "default", "spec": "default", "metrics": metrics(&[
                ("accuracy", 0.35, 0.08, 40), ("interactivity", 0.55, 0.04, 40),
                ("tokens_read_k", 1.2, 0.1, 40), ("tokens_typed_k", 0.3, 0.02, 40),
                ("turns", 3.1, 0.2, 40), ("judge_failures", 0.0, 0.0, 40),
                ("accuracy_disagree", 0.0, 0.0, 40)])},
            {"name": "collabllm", "spec": "outputs/dpo/final", "metrics": metrics(&[
                ("accuracy", 0.45, 0.08, 40), ("interactivity", 0.72, 0.03, 40),
                ("tokens_read_k", 1.0, 0.1, 40), ("tokens_typed_k", 0.25, 0.02, 40),
                ("turns", 2.7, 0.2, 40), ("judge_failures", 1.0, 0.5, 40),
                ("accuracy_disagree", 0.0, 0.0, 40)])},
        ]
    });
    write(
        &dir.join("summary.json"),
        &serde_json::to_string_pretty(&summary).unwrap(),
    );
}

/// `AggregateMetrics` in the summary's `{mean, se, n}` shape.
fn summary_metrics(agg: &AggregateMetrics) -> Value {
    let v = serde_json::to_value(agg).unwrap();
    let mut out = serde_json::Map::new();
    for (k, s) in v.as_object().unwrap() {
        if let Some(o) = s.as_object() {
            out.insert(
                k.clone(),
                json!({"mean": o["mean"], "se": o["stderr"], "n": o["n"]}),
            );
        }
    }
    Value::Object(out)
}

/// A 20 Questions eval directory: the reference (max expected gain) and random-guess
/// questioners against the table oracle over the first `objects` objects (all when `None`).
pub fn write_twenty_questions_eval(dir: &Path, objects: Option<usize>, max_questions: usize) {
    let world = World::load_default().unwrap();
    let n = objects
        .unwrap_or(world.objects.len())
        .min(world.objects.len());
    let mut models = Vec::new();
    for name in ["reference", "random"] {
        let mut lines = String::new();
        let mut all = Vec::new();
        for (k, object) in world.objects.iter().take(n).enumerate() {
            let seed = k as u64;
            let mut oracle = TableOracle::new(&world);
            let mut q: Box<dyn Questioner> = if name == "reference" {
                Box::new(ReferenceQuestioner::new(&world))
            } else {
                Box::new(RandomGuessQuestioner::new(&world, seed))
            };
            let game: GameRecord = play(&world, object, q.as_mut(), &mut oracle, max_questions);
            let m = GameMetrics::of(&game);
            lines.push_str(&format!(
                "{}\n",
                json!({"model": name, "repeat": 0, "seed": seed, "game": game, "metrics": m})
            ));
            all.push(m);
        }
        write(&dir.join(format!("conversations/{name}.jsonl")), &lines);
        models.push(json!({"name": name, "spec": name,
                           "metrics": summary_metrics(&AggregateMetrics::of(&all))}));
    }
    let summary = json!({"task": "twenty_questions", "seed": 0, "tool_version": "0.1.0",
                         "models": models});
    write(
        &dir.join("summary.json"),
        &serde_json::to_string_pretty(&summary).unwrap(),
    );
}
