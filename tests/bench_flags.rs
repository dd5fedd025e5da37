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
