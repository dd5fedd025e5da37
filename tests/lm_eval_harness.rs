//! The real lm-evaluation-harness 0.4.13 client (`local-completions`, API extra only: no
//! torch) against `serve --model default --weights f32` on 127.0.0.1, given nothing but the
//! URL (no `tokenizer=`: it finds vLLM's tokenizer endpoints and tokenizes through the
//! server). On the two tiny local tasks of tests/fixtures/lm_eval (multiple choice and
//! generate_until, data in JSON files beside them, no network) every per-choice
//! log-likelihood equals transformers' on the same GGUF within 1e-4, and every generation
//! equals transformers' greedy one exactly (`transformers_reference.json`, made by
//! scripts/make_lm_eval_fixture.py with the harness's own `hf` model).
//!
//! The harness must be installed: `.ci/run` puts it in `.venv-lm-eval/`; elsewhere set
//! `LM_EVAL_PYTHON` to a Python that has it. Without it the test fails, saying how to install.

mod common;
use common::model_util::{default_model_path, one_thread};
use common::serve_util::listening_url;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use serde_json::Value;

const LM_EVAL_VERSION: &str = "0.4.13";
const TASKS: [&str; 2] = ["collab_mc", "collab_gen"];

/// Kills the server when the test ends, however it ends.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The Python that has lm-evaluation-harness 0.4.13: `LM_EVAL_PYTHON`, else the virtual
/// environment `.ci/run` makes, else `python3`. Fails (never skips) when it is missing.
fn lm_eval_python() -> PathBuf {
    let venv = root().join(".venv-lm-eval/bin/python");
    let python = match std::env::var_os("LM_EVAL_PYTHON") {
        Some(p) => PathBuf::from(p),
        None if venv.is_file() => venv,
        None => PathBuf::from("python3"),
    };
    let found = Command::new(&python)
        .args([
            "-c",
            "import importlib.metadata as m; import lm_eval; print(m.version('lm_eval'))",
        ])
        .output();
    let version = match &found {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout).trim().to_string(),
        _ => String::new(),
    };
    assert_eq!(
        version,
        LM_EVAL_VERSION,
        "lm-evaluation-harness {LM_EVAL_VERSION} is not installed for {} ({}). Install it as \
         CI does: `python3 -m venv .venv-lm-eval && .venv-lm-eval/bin/pip install \
         \"lm-eval[api]=={LM_EVAL_VERSION}\"` (or set LM_EVAL_PYTHON to a Python that has it)",
        python.display(),
        match &found {
            Ok(out) => String::from_utf8_lossy(&out.stderr).trim().to_string(),
            Err(e) => e.to_string(),
        }
    );
    python
}

/// Starts `serve --model default --weights f32` on a free port; its base URL.
fn start_server(log: &Path) -> (Server, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_serve"))
        .args(["--model", "default", "--weights", "f32", "--port", "0"])
        .args(["--threads", "1"])
        .env("COLLABLLM_DEFAULT_MODEL", default_model_path())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let server = Server(child);
    (server, listening_url(stdout))
}

/// The harness's per-sample records of `task` under `out` (one `samples_<task>_*.jsonl`).
fn samples(out: &Path, task: &str) -> Vec<Value> {
    let mut found = Vec::new();
    let mut dirs = vec![out.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            if path.is_dir() {
                dirs.push(path);
            } else if name.starts_with(&format!("samples_{task}_")) && name.ends_with(".jsonl") {
                found.push(path);
            }
        }
    }
    assert_eq!(
        found.len(),
        1,
        "samples of {task} under {}: {found:?}",
        out.display()
    );
    std::fs::read_to_string(&found[0])
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A number the harness logged, as a string or a number.
fn number(v: &Value) -> f64 {
    match v {
        Value::String(s) => s.parse().unwrap_or_else(|e| panic!("{s}: {e}")),
        v => v.as_f64().unwrap_or_else(|| panic!("not a number: {v}")),
    }
}

fn truth(v: &Value) -> bool {
    match v {
        Value::String(s) => s == "True",
        v => v.as_bool().unwrap_or_else(|| panic!("not a boolean: {v}")),
    }
}

#[test]
fn lm_eval_harness_scores_and_generates_as_transformers() {
    one_thread();
    let python = lm_eval_python();
    let tasks_dir = root().join("tests/fixtures/lm_eval");
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(tasks_dir.join("transformers_reference.json")).unwrap(),
    )
    .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let (server, base) = start_server(&tmp.path().join("serve.log"));

    let out_dir = tmp.path().join("out");
    let model_args = format!(
        "model=default,base_url={base}/completions,num_concurrent=1,max_retries=1,timeout=600"
    );
    let started = std::time::Instant::now();
    let run = Command::new(&python)
        .args(["-m", "lm_eval", "--model", "local-completions"])
        .args(["--model_args", &model_args, "--tasks", &TASKS.join(",")])
        .arg("--include_path")
        .arg(&tasks_dir)
        // Batches of four prompts a request: their answers must not depend on the batch.
        .args(["--batch_size", "4", "--log_samples", "--output_path"])
        .arg(&out_dir)
        .current_dir(&tasks_dir)
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_DATASETS_OFFLINE", "1")
        .env("HF_HOME", tmp.path().join("hf"))
        .env("HF_DATASETS_CACHE", tmp.path().join("datasets"))
        .env("OPENAI_API_KEY", "unused")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    let server_log = std::fs::read_to_string(tmp.path().join("serve.log")).unwrap_or_default();
    assert!(
        run.status.success(),
        "lm_eval failed ({}):\n{stderr}\n--- serve's log:\n{server_log}",
        run.status
    );
    eprintln!("lm_eval ran in {:.1} s", started.elapsed().as_secs_f64());
    // It found the tokenizer endpoints (no `tokenizer=` was given, and the Hub is off).
    assert!(
        stderr.contains("Using remote tokenizer"),
        "the harness did not use the server's tokenizer:\n{stderr}"
    );
    assert!(
        !server_log.contains("status=404"),
        "a request the server did not know:\n{server_log}"
    );
    drop(server);

    let mut compared = BTreeMap::new();
    let mut max_diff = 0f64;
    for task in TASKS {
        let want = &reference["tasks"][task];
        let rows = samples(&out_dir, task);
        assert_eq!(
            rows.len(),
            want.as_object().unwrap().len(),
            "{task}: documents"
        );
        for row in &rows {
            let doc = row["doc_id"].to_string();
            let want = &want[doc.as_str()];
            assert_eq!(
                row["arguments"], want["arguments"],
                "{task} doc {doc}: the same requests"
            );
            let resps: Vec<&Value> = row["resps"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| &r[0])
                .collect();
            if let Some(lls) = want["loglikelihoods"].as_array() {
                assert_eq!(resps.len(), lls.len(), "{task} doc {doc}: choices");
                for (i, (got, ll)) in resps.iter().zip(lls).enumerate() {
                    let (got_ll, want_ll) = (number(&got[0]), ll.as_f64().unwrap());
                    max_diff = max_diff.max((got_ll - want_ll).abs());
                    assert!(
                        (got_ll - want_ll).abs() < 1e-4,
                        "{task} doc {doc} choice {i}: log-likelihood {got_ll} vs \
                         transformers' {want_ll}"
                    );
                    assert_eq!(
                        truth(&got[1]),
                        want["is_greedy"][i].as_bool().unwrap(),
                        "{task} doc {doc} choice {i}: is_greedy"
                    );
                }
            } else {
                let gens = want["generations"].as_array().unwrap();
                assert_eq!(resps.len(), gens.len());
                for (got, gen) in resps.iter().zip(gens) {
                    assert_eq!(*got, gen, "{task} doc {doc}: the greedy generation");
                }
            }
            *compared.entry(task).or_insert(0) += resps.len();
        }
    }
    eprintln!(
        "compared with transformers: {compared:?}; largest log-likelihood difference {max_diff:e}"
    );
}
