//! `generate_conv` on the embedded default model in every role (fetched by
//! scripts/fetch_default_model.sh): a 2-task, 1-turn, N=2, S=1 run completes and either
//! writes pairs or says in its summary why no turn passed the gap.

mod common;
use common::model_util;

use std::path::Path;

#[test]
fn two_tasks_one_turn_on_the_default_model() {
    model_util::default_model_path();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("run");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_generate_conv"))
        .current_dir(root)
        .args([
            "--config",
            "configs/quickstart.toml",
            "--output",
            out_dir.to_str().unwrap(),
            "--max-tasks",
            "2",
            "--max-messages",
            "2",
            "--candidates",
            "2",
            "--samples",
            "1",
            "--window",
            "2",
            "--threads",
            "1",
        ])
        .env("RUST_LOG", "warn")
        .output()
        .expect("running generate_conv");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("tasks          2 total"), "{stdout}");
    let text = std::fs::read_to_string(out_dir.join("conversations.jsonl")).unwrap();
    assert_eq!(text.lines().count(), 2);
    let rec: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert_eq!(rec["turns"].as_array().unwrap().len(), 1);
    // The local judge answers through log-probabilities: a real score on every call.
    let scores = &rec["turns"][0]["candidates"][0]["sessions"][0]["scores"];
    assert_eq!(scores["interactivity"]["method"], "llm-logprob", "{scores}");
    let v = scores["interactivity"]["value"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&v));
    let pairs_line = stdout.lines().find(|l| l.starts_with("pairs ")).unwrap();
    let has_pairs = !pairs_line.contains("0 train + 0 test");
    assert!(has_pairs || stdout.contains("no pair"), "{stdout}");
    assert!(out_dir.join("pairs/train.parquet").is_file());
}
