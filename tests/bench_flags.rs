//! `bench` refuses counts that would time nothing (0 samples, 0 repeats, ...) before any model
//! loads, naming the flag and the value.

fn bench(args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_bench"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn zero_counts_are_refused_with_the_flag_named() {
    for (args, flag) in [
        (vec!["decode", "--n", "0"], "--n"),
        (vec!["decode", "--repeats", "0"], "--repeats"),
        (vec!["decode", "--new-tokens", "0"], "--new-tokens"),
        (vec!["decode", "--threads", "0"], "--threads"),
        (vec!["orchestration", "--latency-ms", "0"], "--latency-ms"),
        (vec!["orchestration", "--cap", "0"], "--cap"),
        (vec!["train-step", "--steps", "0"], "--steps"),
        (vec!["serve-throughput", "--max-batch", "0"], "--max-batch"),
        (
            vec!["serve-throughput", "--concurrency", "4,0"],
            "--concurrency",
        ),
        (vec!["serve-throughput", "--rounds", "0"], "--rounds"),
        (vec!["serve-throughput", "--cycles", "0"], "--cycles"),
    ] {
        let (ok, stderr) = bench(&args);
        assert!(!ok, "{args:?} was accepted");
        assert!(
            stderr.contains(flag) && stderr.contains("'0'") && stderr.contains("at least 1"),
            "{args:?}: {stderr}"
        );
    }
}

/// `bench adaptive-replay` over a hand-written run of one turn: a candidate far below the
/// others stops after two futures, the two close ones race, and the pair is the fixed-S
/// pair in every order.
#[test]
fn adaptive_replay_reads_a_run_and_saves_futures() {
    let dir = tempfile::tempdir().unwrap();
    let session = |v: f64| serde_json::json!({"scores": {"accuracy": {"value": v}}});
    let candidate = |vs: &[f64]| serde_json::json!({"sessions": vs.iter().map(|&v| session(v)).collect::<Vec<_>>()});
    let record = serde_json::json!({
        "weights": {"accuracy": 1.0},
        "turns": [{"candidates": [
            candidate(&[1.0, 0.9, 1.1, 1.0, 0.8, 1.2, 1.0, 0.9]),
            candidate(&[0.7, 0.8, 0.6, 0.9, 0.7, 0.8, 0.6, 0.7]),
            candidate(&[-3.0, -3.1, -2.9, -3.0, -3.2, -2.8, -3.0, -3.1]),
        ]}]
    });
    std::fs::write(
        dir.path().join("conversations.jsonl"),
        format!("{record}\n"),
    )
    .unwrap();
    let run = std::process::Command::new(env!("CARGO_BIN_EXE_bench"))
        .args([
            "adaptive-replay",
            dir.path().to_str().unwrap(),
            "--z",
            "1.96",
            "--orders",
            "20",
        ])
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let out = String::from_utf8_lossy(&run.stdout).into_owned();
    assert!(out.contains("1 turns, 24 stored futures"), "{out}");
    let row = out.lines().find(|l| l.starts_with("| 1.96 |")).expect(&out);
    let cells: Vec<f64> = row
        .split('|')
        .filter_map(|c| c.trim().parse().ok())
        .collect();
    assert!(cells[1] < 0.8, "{row}");
    assert_eq!(cells[2], 1.0, "{row}");
    let (ok, out) = bench(&[
        "adaptive-replay",
        dir.path().to_str().unwrap(),
        "--min-futures",
        "1",
    ]);
    assert!(!ok && out.contains("min_futures"), "{out}");
}
