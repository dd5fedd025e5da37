//! Run directories, tried with the real binaries against a local OpenAI-compatible server:
//! one writer per run (`generate_conv`, `eval_multiturn`, `dpo_train`), status `interrupted`
//! after SIGTERM/SIGINT, `usage_total` equal to the requests the server saw after a kill -9,
//! and a `--dry-run` bound that holds when the judge needs re-asks.

mod common;

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use collabllm::run::RunLock;
use common::collab_script;
use common::fault_server::{Fault, FaultServer};

fn data(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("data")
        .join(name)
        .display()
        .to_string()
}

async fn collab_server() -> FaultServer {
    let server = FaultServer::start().await;
    server.set_responder(collab_script::reply_to_body);
    server
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

fn generate_args(server: &FaultServer, out: &Path, max_tasks: usize) -> Vec<String> {
    let spec = format!("openai:scripted@{}", server.base_url);
    let tasks = data("math.jsonl");
    let max_tasks = max_tasks.to_string();
    strings(&[
        "--tasks",
        &tasks,
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
        // Enough permits that no call waits for one (a waiting call is counted, not sent).
        "--max-concurrency",
        "64",
        "--max-retries",
        "2",
        "--timeout",
        "30",
        "--max-tasks",
        &max_tasks,
    ])
}

fn eval_args(server: &FaultServer, out: &Path, max_tasks: usize) -> Vec<String> {
    let spec = format!("openai:scripted@{}", server.base_url);
    let tasks = data("math.jsonl");
    let max_tasks = max_tasks.to_string();
    strings(&[
        "--task",
        "math",
        "--tasks",
        &tasks,
        "--model",
        &spec,
        "--user",
        &spec,
        "--judge",
        &spec,
        "--output",
        out.to_str().unwrap(),
        "--max-turns",
        "2",
        "--concurrency",
        "2",
        "--max-concurrency",
        "64",
        "--timeout",
        "30",
        "--max-tasks",
        &max_tasks,
    ])
}

fn command(bin: &str, args: &[String]) -> tokio::process::Command {
    let mut c = tokio::process::Command::new(bin);
    c.args(args)
        .env("OPENAI_API_KEY", "test-key")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null());
    c
}

async fn run(bin: &str, args: &[String]) -> std::process::Output {
    command(bin, args)
        .output()
        .await
        .expect("running the binary")
}

fn spawn(bin: &str, args: &[String]) -> tokio::process::Child {
    command(bin, args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("starting the binary")
}

fn lines(path: &Path) -> usize {
    std::fs::read_to_string(path)
        .map(|t| t.lines().count())
        .unwrap_or(0)
}

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Polls `cond` every 20 ms for at most a minute.
async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn send(child: &tokio::process::Child, signal: i32) {
    let pid = child.id().expect("running") as i32;
    // SAFETY: kill(2) on the pid of a child this test started and has not reaped.
    assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
}

fn calls(usage: &serde_json::Value) -> u64 {
    usage
        .as_object()
        .map(|roles| roles.values().map(|u| u["calls"].as_u64().unwrap()).sum())
        .unwrap_or(0)
}

fn task_ids(out: &Path) -> Vec<String> {
    let mut ids: Vec<String> = std::fs::read_to_string(out.join("conversations.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["task_id"].as_str().unwrap().to_string()
        })
        .collect();
    ids.sort();
    ids
}

/// Every binary that writes a run directory refuses one another process holds, names that
/// process, and writes nothing into it.
#[tokio::test]
async fn a_locked_run_directory_is_refused_by_every_writer() {
    let server = collab_server().await;
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    std::fs::create_dir_all(&out).unwrap();
    let _held = RunLock::acquire(&out).unwrap();
    let pid = format!("pid {}", std::process::id());
    let dpo_args = strings(&[
        "--data",
        tmp.path().join("pairs.parquet").to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ]);
    for (bin, args) in [
        (
            env!("CARGO_BIN_EXE_generate_conv"),
            generate_args(&server, &out, 2),
        ),
        (
            env!("CARGO_BIN_EXE_eval_multiturn"),
            eval_args(&server, &out, 2),
        ),
        (env!("CARGO_BIN_EXE_dpo_train"), dpo_args),
    ] {
        let res = run(bin, &args).await;
        let stderr = String::from_utf8_lossy(&res.stderr);
        assert_eq!(res.status.code(), Some(1), "{bin}: {stderr}");
        assert!(
            stderr.contains(&pid) && stderr.contains("another process"),
            "{bin}: {stderr}"
        );
        let names: Vec<_> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from(".lock")], "{bin}");
    }
    assert_eq!(server.requests(), 0);
}

/// Two generate_conv runs on one --output: the second refuses while the first runs (naming
/// its pid); the first finishes every task exactly once.
#[tokio::test]
async fn a_second_generate_conv_on_a_running_output_refuses() {
    let server = collab_server().await;
    server.set_fault_rate(1.0, 1, vec![Fault::Delay(Duration::from_millis(20))]);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let args = generate_args(&server, &out, 4);
    let bin = env!("CARGO_BIN_EXE_generate_conv");
    let first = spawn(bin, &args);
    let first_pid = first.id().unwrap();
    wait_until("the first run's manifest", || {
        out.join("manifest.json").exists()
    })
    .await;
    let second = run(bin, &args).await;
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert_eq!(second.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(&format!("pid {first_pid}")), "{stderr}");
    let done = first.wait_with_output().await.unwrap();
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    let ids = task_ids(&out);
    let mut unique = ids.clone();
    unique.dedup();
    assert_eq!(ids.len(), 4, "{ids:?}");
    assert_eq!(unique, ids, "every task exactly once");
    assert_eq!(read_json(&out.join("manifest.json"))["status"], "complete");
}

/// SIGTERM mid-run: generate_conv writes the outputs of the finished conversations, records
/// status `interrupted` and exits 143; a rerun finishes the rest.
#[tokio::test]
async fn sigterm_records_an_interrupted_generate_conv_run() {
    let server = collab_server().await;
    server.set_fault_rate(1.0, 1, vec![Fault::Delay(Duration::from_millis(20))]);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let args = generate_args(&server, &out, 8);
    let bin = env!("CARGO_BIN_EXE_generate_conv");
    let child = spawn(bin, &args);
    wait_until("a finished conversation", || {
        lines(&out.join("conversations.jsonl")) >= 1
    })
    .await;
    send(&child, libc::SIGTERM);
    let done = child.wait_with_output().await.unwrap();
    let stderr = String::from_utf8_lossy(&done.stderr);
    assert_eq!(done.status.code(), Some(143), "{stderr}");
    assert!(stderr.contains("interrupted by SIGTERM"), "{stderr}");
    let m = read_json(&out.join("manifest.json"));
    assert_eq!(m["status"], "interrupted", "{m}");
    assert_eq!(m["signal"], "SIGTERM");
    assert!(m["finished_at"].is_f64());
    let finished = task_ids(&out).len();
    assert!((1..8).contains(&finished), "{finished} finished");
    // The outputs of what finished are written and counted.
    assert!(out.join("pairs/train.parquet").exists());
    assert!(out.join("flat.parquet").exists());
    assert!(m["counts"]["turns"].as_u64().unwrap() > 0, "{m}");

    let res = run(bin, &args).await;
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    assert_eq!(task_ids(&out).len(), 8);
    assert_eq!(read_json(&out.join("manifest.json"))["status"], "complete");
}

/// SIGINT mid-run: eval_multiturn records status `interrupted`, writes the summary of what
/// finished and exits 130.
#[tokio::test]
async fn sigint_records_an_interrupted_evaluation() {
    let server = collab_server().await;
    server.set_fault_rate(1.0, 2, vec![Fault::Delay(Duration::from_millis(40))]);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("eval");
    let args = eval_args(&server, &out, 10);
    let bin = env!("CARGO_BIN_EXE_eval_multiturn");
    let child = spawn(bin, &args);
    let log = out.join("conversations");
    wait_until("a finished conversation", || {
        std::fs::read_dir(&log)
            .map(|d| d.flatten().any(|e| lines(&e.path()) >= 1))
            .unwrap_or(false)
    })
    .await;
    send(&child, libc::SIGINT);
    let done = child.wait_with_output().await.unwrap();
    let stderr = String::from_utf8_lossy(&done.stderr);
    assert_eq!(done.status.code(), Some(130), "{stderr}");
    let m = read_json(&out.join("manifest.json"));
    assert_eq!(m["status"], "interrupted", "{m}");
    assert_eq!(m["signal"], "SIGINT");
    let done_now = m["counts"]["done_now"].as_u64().unwrap();
    assert!((1..10).contains(&done_now), "{m}");
    assert!(out.join("summary.json").exists());
}

/// kill -9 mid-run, with calls in flight: the resumed run's `usage_total` counts exactly the
/// requests the server received over both invocations.
#[tokio::test]
async fn usage_total_counts_every_request_across_a_kill_9() {
    let server = collab_server().await;
    server.set_fault_rate(1.0, 3, vec![Fault::Delay(Duration::from_millis(10))]);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let args = generate_args(&server, &out, 6);
    let bin = env!("CARGO_BIN_EXE_generate_conv");
    let mut child = spawn(bin, &args);
    wait_until("a finished conversation", || !task_ids(&out).is_empty()).await;
    // From now on every request hangs: the kill lands with calls in flight, and once the
    // request count stops moving every call the run started has reached the server.
    server.set_always(Some(Fault::Hang(Duration::from_secs(120))));
    let mut seen = server.requests();
    loop {
        tokio::time::sleep(Duration::from_millis(400)).await;
        let now = server.requests();
        if now == seen {
            break;
        }
        seen = now;
    }
    child.start_kill().unwrap();
    let _ = child.wait().await;
    let killed = read_json(&out.join("manifest.json"));
    assert_eq!(killed["status"], "running");
    assert!(
        calls(&killed["usage_total"]) < server.requests() as u64,
        "the killed run's own manifest cannot know its calls in flight"
    );

    server.clear_faults();
    let res = run(bin, &args).await;
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let m = read_json(&out.join("manifest.json"));
    assert_eq!(m["status"], "complete");
    assert_eq!(
        calls(&m["usage_total"]),
        server.requests() as u64,
        "usage_total vs requests received: {}",
        m["usage_total"]
    );
    // This invocation's own usage is what it sent.
    assert!(calls(&m["usage"]) < server.requests() as u64);
}

/// A judge that never gives a score is re-asked to the limit: the dry run's bound counts
/// those re-asks, the real run stays under it, and the summary's retries column shows them.
#[tokio::test]
async fn dry_run_bound_holds_when_the_judge_is_re_asked() {
    let server = FaultServer::start().await;
    server.set_responder(|body, i| {
        let prompt = body["messages"]
            .as_array()
            .and_then(|m| m.iter().rev().find(|x| x["role"] == "user"))
            .and_then(|m| m["content"].as_str())
            .unwrap_or("");
        if prompt.contains("grading whether") || prompt.contains("rating how well") {
            "I would rather not give a number.".to_string()
        } else {
            collab_script::reply_to_body(body, i)
        }
    });
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let mut args = generate_args(&server, &out, 3);
    let bin = env!("CARGO_BIN_EXE_generate_conv");
    args.push("--dry-run".into());
    let dry = run(bin, &args).await;
    let plan = String::from_utf8_lossy(&dry.stdout).to_string();
    assert!(dry.status.success(), "{plan}");
    assert_eq!(server.requests(), 0);
    let bound_of = |role: &str| -> (u64, u64) {
        let line = plan
            .lines()
            .find(|l| l.split_whitespace().next() == Some(role))
            .unwrap_or_else(|| panic!("no {role} row in:\n{plan}"));
        let cols: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .map(|c| c.parse().unwrap())
            .collect();
        (cols[0], cols[1])
    };
    let total: u64 = plan
        .lines()
        .find_map(|l| l.strip_prefix("model calls: at most "))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no bound in:\n{plan}"));

    args.pop();
    let res = run(bin, &args).await;
    let stdout = String::from_utf8_lossy(&res.stdout).to_string();
    assert!(
        res.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let sent = server.requests() as u64;
    assert!(sent <= total, "{sent} requests, bound {total}\n{plan}");
    let m = read_json(&out.join("manifest.json"));
    let judge = &m["usage"]["judge"];
    let (judge_calls, judge_reasks) = (
        judge["calls"].as_u64().unwrap(),
        judge["reasks"].as_u64().unwrap(),
    );
    // Every judge question was asked 1 + judge_retries (3) times.
    assert!(judge_calls > 0);
    assert_eq!(judge_reasks * 4, judge_calls * 3, "{judge}");
    let (judge_bound, judge_reask_bound) = bound_of("judge");
    assert!(judge_calls <= judge_bound && judge_reasks <= judge_reask_bound);
    // Without the re-asks the bound would have been exceeded.
    assert!(
        judge_calls > judge_bound - judge_reask_bound,
        "{plan}\n{judge}"
    );
    for role in ["policy", "user"] {
        let used = m["usage"][role]["calls"].as_u64().unwrap();
        assert!(used <= bound_of(role).0, "{role}: {used}\n{plan}");
    }
    // The printed summary's retries column holds the re-asks.
    let row: Vec<&str> = stdout
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|cols| {
            cols.len() == 7
                && cols[0] == "judge"
                && cols[1..].iter().all(|c| c.parse::<u64>().is_ok())
        })
        .unwrap_or_else(|| panic!("{stdout}"));
    assert_eq!(row[5].parse::<u64>().unwrap(), judge_reasks, "{stdout}");
}

fn mkfifo(path: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path; mkfifo touches no memory of ours.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
}

fn is_fifo(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::symlink_metadata(path)
        .map(|m| m.file_type().is_fifo())
        .unwrap_or(false)
}

/// Every output flag of every binary is checked before any work: a FIFO where a run folder or
/// a file is meant, a directory where a file is meant and a missing parent folder of a file
/// are refused naming the flag and the path, no request is sent, and the FIFO stays a FIFO.
#[tokio::test]
async fn every_binary_refuses_an_output_of_the_wrong_kind_before_any_work() {
    let server = collab_server().await;
    let tmp = tempfile::tempdir().unwrap();
    let fifo = tmp.path().join("pipe");
    mkfifo(&fifo);
    let fifo_s = fifo.to_str().unwrap().to_string();
    let dir = tmp.path().join("a-folder");
    std::fs::create_dir(&dir).unwrap();
    let dir_s = dir.to_str().unwrap().to_string();
    let missing = tmp.path().join("no/such/dagger.parquet");
    let missing_s = missing.to_str().unwrap().to_string();
    let run_dir = tmp.path().join("run");
    let pairs = tmp.path().join("pairs.parquet");
    let pairs_s = pairs.to_str().unwrap().to_string();
    let eval_20q = |extra: &[&str]| {
        let mut a = strings(&["--task", "twenty_questions", "--model", "reference"]);
        a.extend(strings(&["--objects", "1", "--oracle", "table"]));
        a.extend(strings(extra));
        a
    };
    let cases: Vec<(&str, Vec<String>, &str, &str, &str)> = vec![
        (
            env!("CARGO_BIN_EXE_generate_conv"),
            generate_args(&server, &fifo, 2),
            "--output",
            fifo_s.as_str(),
            "a FIFO",
        ),
        (
            env!("CARGO_BIN_EXE_generate_conv"),
            {
                let mut a = generate_args(&server, &run_dir, 2);
                a.extend(strings(&["--export", "verl", "--export-dir", &fifo_s]));
                a
            },
            "--export-dir",
            fifo_s.as_str(),
            "a FIFO",
        ),
        (
            env!("CARGO_BIN_EXE_eval_multiturn"),
            eval_args(&server, &fifo, 2),
            "--output",
            fifo_s.as_str(),
            "a FIFO",
        ),
        (
            env!("CARGO_BIN_EXE_eval_multiturn"),
            eval_20q(&["--output", run_dir.to_str().unwrap(), "--dagger", &fifo_s]),
            "--dagger",
            fifo_s.as_str(),
            "a FIFO",
        ),
        (
            env!("CARGO_BIN_EXE_eval_multiturn"),
            eval_20q(&["--output", run_dir.to_str().unwrap(), "--dagger", &dir_s]),
            "--dagger",
            dir_s.as_str(),
            "a directory",
        ),
        (
            env!("CARGO_BIN_EXE_eval_multiturn"),
            eval_20q(&[
                "--output",
                run_dir.to_str().unwrap(),
                "--dagger",
                missing_s.as_str(),
            ]),
            "--dagger",
            missing_s.as_str(),
            "does not exist",
        ),
        (
            env!("CARGO_BIN_EXE_dpo_train"),
            strings(&["--data", &pairs_s, "--output", &fifo_s]),
            "--output",
            fifo_s.as_str(),
            "a FIFO",
        ),
        (
            env!("CARGO_BIN_EXE_rl_train"),
            {
                let tasks = data("math.jsonl");
                strings(&["--tasks", &tasks, "--output", &fifo_s])
            },
            "--output",
            fifo_s.as_str(),
            "a FIFO",
        ),
        (
            env!("CARGO_BIN_EXE_plot"),
            strings(&["train", &dir_s, "--output", &fifo_s]),
            "--output",
            fifo_s.as_str(),
            "a FIFO",
        ),
        (
            env!("CARGO_BIN_EXE_push_hf"),
            strings(&["model", &dir_s, "--repo", "o/n", "--dry-run", &fifo_s]),
            "--dry-run",
            fifo_s.as_str(),
            "a FIFO",
        ),
        (
            env!("CARGO_BIN_EXE_bench"),
            strings(&["adaptive-replay", &dir_s, "--json", &fifo_s]),
            "--json",
            fifo_s.as_str(),
            "a FIFO",
        ),
        (
            env!("CARGO_BIN_EXE_bench"),
            strings(&["adaptive-replay", &dir_s, "--json", &dir_s]),
            "--json",
            dir_s.as_str(),
            "a directory",
        ),
    ];
    for (bin, args, flag, path, what) in cases {
        let res = run(bin, &args).await;
        let stderr = String::from_utf8_lossy(&res.stderr);
        assert_ne!(res.status.code(), Some(0), "{bin} {args:?}: {stderr}");
        assert!(
            stderr.contains(&format!("{flag} {path}")) && stderr.contains(what),
            "{bin} {flag}: {stderr}"
        );
        assert!(is_fifo(&fifo), "{bin} {flag} replaced the FIFO");
        assert!(dir.is_dir() && !run_dir.exists(), "{bin} {flag}");
        assert!(!missing.parent().unwrap().exists(), "{bin} {flag}");
    }
    assert_eq!(server.requests(), 0);
}
