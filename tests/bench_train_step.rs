//! `bench train-step` on a tiny random shape on the CPU: the harness the GPU table is made
//! with (scripts/gpu_check.sh) runs DPO (full and LoRA) and GRPO steps, reports counts that
//! follow from the shape, and refuses what it cannot measure.

use collabllm::train::capacity::{lora_params, matmul_params, step_flops, StepShape, Trainable};
use collabllm::train::shapes::shape_config;

fn bench(args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_bench"))
        .arg("train-step")
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The JSON line a run ends with.
fn result(args: &[&str]) -> serde_json::Value {
    let (ok, stdout, stderr) = bench(args);
    assert!(ok, "{args:?}: {stderr}");
    let line = stdout.lines().rfind(|l| l.starts_with('{')).expect(&stdout);
    serde_json::from_str(line).unwrap()
}

const TINY: [&str; 9] = [
    "--shape",
    "tiny",
    "--random-init",
    "--steps",
    "1",
    "--prompt-tokens",
    "24",
    "--completion-tokens",
    "16",
];

#[test]
fn dpo_and_grpo_steps_report_what_the_shape_implies() {
    let cfg = shape_config("tiny").unwrap();
    let lora_targets: Vec<String> = collabllm::engine::peft::LORA_TARGETS
        .iter()
        .map(|s| s.to_string())
        .collect();
    let full = result(&[&TINY[..], &["--batch", "2", "--peak-tflops", "1"]].concat());
    // Two packed pairs: prompt, chosen and rejected in one row each.
    assert_eq!(
        (full["rows"].as_u64(), full["row_tokens"].as_u64()),
        (Some(2), Some(56))
    );
    assert_eq!(full["tokens"], 112);
    assert_eq!(
        full["trainable"].as_u64().unwrap() as usize,
        collabllm::train::capacity::param_count(&cfg)
    );
    // −log σ(0) before the first update (the policy is its own reference); the timed step
    // comes after the warm-up's update, which lowered it a little.
    let loss = full["loss"].as_f64().unwrap();
    assert!(loss < std::f64::consts::LN_2 && loss > 0.69, "{loss}");
    assert!(full["grad_norm"].as_f64().unwrap() > 0.0);
    let flops = 6.0 * matmul_params(&cfg) as f64 * 112.0;
    let tflops = full["tflops"].as_f64().unwrap();
    assert!((tflops * full["step_s"].as_f64().unwrap() * 1e12 / flops - 1.0).abs() < 1e-9);
    // MFU against the peak given: TFLOP/s over 1 TFLOP/s.
    assert!((full["mfu"].as_f64().unwrap() - tflops).abs() < 1e-12);
    assert!(
        full["estimate_bytes"].as_u64().unwrap() > 0 && full["peak_bytes"].as_u64().unwrap() > 0
    );

    let lora = result(&[&TINY[..], &["--batch", "2", "--lora", "--lora-r", "4"]].concat());
    assert_eq!(
        lora["trainable"].as_u64().unwrap() as usize,
        lora_params(&cfg, 4, &lora_targets)
    );
    assert!(lora["grad_norm"].as_f64().unwrap() > 0.0);
    assert!(
        lora["mfu"].is_null(),
        "no peak on the CPU without --peak-tflops"
    );

    let grpo = result(
        &[
            &TINY[..],
            &["--algo", "grpo", "--batch", "8", "--group-size", "4"],
        ]
        .concat(),
    );
    // Two groups: a prompt and its 4 responses a row.
    assert_eq!(
        (grpo["rows"].as_u64(), grpo["row_tokens"].as_u64()),
        (Some(2), Some(88))
    );
    let step = StepShape {
        rows: 2,
        row_tokens: 88,
        attention_keys: 40,
        loss_tokens: 128,
        extra_forwards: 1,
        trainable: Trainable::Full,
        checkpointing: false,
    };
    let tflops = grpo["tflops"].as_f64().unwrap() * grpo["step_s"].as_f64().unwrap() * 1e12;
    assert!((tflops / step_flops(&cfg, &step) - 1.0).abs() < 1e-9);
    assert!(grpo["grad_norm"].as_f64().unwrap() > 0.0);
}

#[test]
fn the_same_seed_gives_the_same_step_and_checkpointing_the_same_gradients() {
    let a = result(&[&TINY[..], &["--seed", "5"]].concat());
    let b = result(&[&TINY[..], &["--seed", "5", "--gradient-checkpointing"]].concat());
    let c = result(&[&TINY[..], &["--seed", "6"]].concat());
    let rel = |x: &serde_json::Value, y: &serde_json::Value, k: &str| {
        let (x, y) = (x[k].as_f64().unwrap(), y[k].as_f64().unwrap());
        (x - y).abs() / x.abs().max(1e-6)
    };
    assert!(rel(&a, &b, "grad_norm") < 1e-5, "{a} {b}");
    assert!(
        rel(&a, &c, "grad_norm") > 1e-4,
        "other weights, same gradient: {a} {c}"
    );
}

#[test]
fn estimates_need_a_shape_and_bad_settings_are_refused_by_name() {
    let (ok, stdout, _) = bench(&[
        "--shape",
        "llama-3.1-8b",
        "--random-init",
        "--lora",
        "--gradient-checkpointing",
        "--dtype",
        "bf16",
        "--estimate-only",
    ]);
    assert!(ok);
    let line = stdout.lines().rfind(|l| l.starts_with('{')).unwrap();
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    assert!(v["estimate_bytes"].as_u64().unwrap() < 80 << 30, "{v}");
    assert!(
        stdout.contains("weights 14.96") || stdout.contains("weights 15."),
        "{stdout}"
    );
    for (args, says) in [
        (vec!["--shape", "tiny"], "--random-init"),
        (vec!["--estimate-only"], "--shape"),
        (
            vec![
                "--shape",
                "tiny",
                "--random-init",
                "--algo",
                "grpo",
                "--batch",
                "6",
            ],
            "multiple of --group-size",
        ),
        (vec!["--shape", "nope", "--random-init"], "llama-3.2-1b"),
        (
            vec!["--shape", "tiny", "--random-init", "--peak-tflops", "nan"],
            "--peak-tflops",
        ),
        (
            vec!["--shape", "tiny", "--random-init", "--device", "tpu"],
            "tpu",
        ),
    ] {
        let (ok, _, stderr) = bench(&args);
        assert!(!ok, "{args:?} was accepted");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
}
