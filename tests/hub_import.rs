//! Importing the public CollabLLM flat schema: a parquet fixture shaped like the published
//! `collabllm/collabllm-multiturn-*` files (integer conv_id, nested metadata) → tasks and pairs
//! with the expected counts, through the library, `generate_conv --import` (local file and
//! `hf:` from the HF cache, offline) and `--tasks`; missing and unknown columns → named errors.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::{
    ArrayRef, Float64Array, Int64Array, ListArray, RecordBatch, StringArray, StructArray,
};
use arrow::buffer::OffsetBuffer;
use arrow::datatypes::{DataType, Field, Fields};
use collabllm::dataset::read_pairs_parquet;
use collabllm::generate::import::{self, ImportOptions};
use collabllm::task::source::{read_flat_checked, SourceError as ImportError};
use collabllm::task::{load_tasks, TaskType};
use parquet::arrow::ArrowWriter;

/// (conv_id, turn_id, score, goal) of every row. Expected with min gap 0.02 and best-vs-worst:
/// conv 0 turn 0 → pair, conv 0 turn 1 → pair, conv 0 turn 2 → tie (none), conv 1 turn 0 →
/// pair, conv 2 turn 0 → gap 0.01 (none). Goals: g0 (conv 0 and 2), g1 → 2 tasks.
const ROWS: [(i64, i64, f64, &str); 12] = [
    (0, 0, 0.9, "What is 2+3?"),
    (0, 0, 0.1, "What is 2+3?"),
    (0, 0, 0.5, "What is 2+3?"),
    (0, 1, 0.3, "What is 2+3?"),
    (0, 1, 0.7, "What is 2+3?"),
    (0, 2, 0.4, "What is 2+3?"),
    (0, 2, 0.4, "What is 2+3?"),
    (1, 0, 0.2, "Solve x^2 = 4."),
    (1, 0, 0.8, "Solve x^2 = 4."),
    (1, 0, 0.5, "Solve x^2 = 4."),
    (2, 0, 0.50, "What is 2+3?"),
    (2, 0, 0.51, "What is 2+3?"),
];

fn messages(n: usize) -> ArrayRef {
    let fields = Fields::from(vec![
        Field::new("content", DataType::Utf8, true),
        Field::new("role", DataType::Utf8, true),
    ]);
    let content: Vec<String> = (0..n).map(|i| format!("user turn {i}")).collect();
    let items = StructArray::new(
        fields.clone(),
        vec![
            Arc::new(StringArray::from(content)) as ArrayRef,
            Arc::new(StringArray::from(vec!["user"; n])),
        ],
        None,
    );
    Arc::new(ListArray::new(
        Arc::new(Field::new("element", DataType::Struct(fields), true)),
        OffsetBuffer::from_lengths(vec![1; n]),
        Arc::new(items),
        None,
    ))
}

/// Writes the fixture with the upstream column set, leaving out `drop` and adding `extra`.
fn write_fixture(path: &Path, drop: Option<&str>, extra: Option<&str>) {
    let n = ROWS.len();
    let meta = StructArray::new(
        Fields::from(vec![
            Field::new("level", DataType::Utf8, true),
            Field::new("type", DataType::Utf8, true),
        ]),
        vec![
            Arc::new(StringArray::from(vec!["Level 5"; n])) as ArrayRef,
            Arc::new(StringArray::from(vec!["Algebra"; n])),
        ],
        None,
    );
    let mut cols: Vec<(&str, ArrayRef)> = vec![
        ("prompt", messages(n)),
        (
            "completion",
            Arc::new(StringArray::from_iter_values(
                ROWS.iter().map(|r| format!("reply scored {}", r.2)),
            )),
        ),
        (
            "conv_id",
            Arc::new(Int64Array::from_iter_values(ROWS.iter().map(|r| r.0))),
        ),
        (
            "score",
            Arc::new(Float64Array::from_iter_values(ROWS.iter().map(|r| r.2))),
        ),
        (
            "single_turn_prompt",
            Arc::new(StringArray::from_iter_values(ROWS.iter().map(|r| r.3))),
        ),
        (
            "single_turn_completion",
            Arc::new(StringArray::from_iter_values(ROWS.iter().map(|r| {
                if r.0 == 1 {
                    "\\boxed{2}"
                } else {
                    "\\boxed{5}"
                }
            }))),
        ),
        ("single_turn_metadata", Arc::new(meta)),
        (
            "turn_id",
            Arc::new(Int64Array::from_iter_values(ROWS.iter().map(|r| r.1))),
        ),
        ("sessions", Arc::new(StringArray::from(vec!["[]"; n]))),
        (
            "rewards",
            Arc::new(StringArray::from(vec!["{\"accuracy\": [1.0]}"; n])),
        ),
    ];
    cols.retain(|(name, _)| Some(*name) != drop);
    if let Some(e) = extra {
        cols.push((e, Arc::new(StringArray::from(vec!["x"; n]))));
    }
    let batch = RecordBatch::try_from_iter(cols).unwrap();
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let mut w =
        ArrowWriter::try_new(std::fs::File::create(path).unwrap(), batch.schema(), None).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
}

fn generate_conv(args: &[&str], env: &[(&str, &Path)]) -> (bool, String, String) {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_generate_conv"));
    cmd.args(args).env_remove("HF_TOKEN");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn check_output(dir: &Path) {
    let tasks = load_tasks(&dir.join("tasks.jsonl")).unwrap();
    assert_eq!(tasks.len(), 2);
    assert!(tasks.iter().all(|t| t.task_type == TaskType::Math));
    assert_eq!(tasks[0].prompt, "What is 2+3?");
    assert_eq!(tasks[0].reference, "\\boxed{5}");
    assert_eq!(tasks[1].reference, "\\boxed{2}");
    assert_eq!(tasks[0].metadata["level"], "Level 5");
    let train = read_pairs_parquet(&dir.join("pairs/train.parquet")).unwrap();
    let test = read_pairs_parquet(&dir.join("pairs/test.parquet")).unwrap();
    assert_eq!(train.len() + test.len(), 3);
    assert!(!train.is_empty() && !test.is_empty());
    // Split by conversation: no conversation on both sides.
    for p in &test {
        assert!(train.iter().all(|q| q.conv_id != p.conv_id));
    }
    for p in train.iter().chain(&test) {
        assert!(p.score_chosen > p.score_rejected);
        assert_eq!(p.chosen[0].role, "assistant");
        assert_eq!(
            p.chosen[0].content,
            format!("reply scored {}", p.score_chosen)
        );
        assert_eq!(p.prompt[0].role, "user");
    }
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(m["counts"]["turns"], 5);
    assert_eq!(m["counts"]["turns_without_pair"], 2);
}

#[tokio::test]
async fn library_import_counts() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("flat.parquet");
    write_fixture(&file, None, None);
    let out = tmp.path().join("out");
    let opts = ImportOptions {
        task_type: Some(TaskType::Math),
        test_fraction: 0.5,
        ..ImportOptions::default()
    };
    let s = import::import(file.to_str().unwrap(), &out, &opts)
        .await
        .unwrap();
    assert_eq!(
        (
            s.rows,
            s.tasks,
            s.conversations,
            s.turns,
            s.turns_without_pair
        ),
        (12, 2, 3, 5, 2)
    );
    assert_eq!(s.pairs_train + s.pairs_test, 3);
    check_output(&out);

    // A larger gap keeps only the clearest pairs (0.9 vs 0.1 and 0.8 vs 0.2).
    let strict = ImportOptions {
        min_gap: 0.5,
        ..opts.clone()
    };
    let s = import::import(file.to_str().unwrap(), &tmp.path().join("strict"), &strict)
        .await
        .unwrap();
    assert_eq!(s.pairs_train + s.pairs_test, 2);

    // Without a flag, the task type comes from the name, else it is an error.
    let e = import::import(
        file.to_str().unwrap(),
        &tmp.path().join("x"),
        &ImportOptions::default(),
    )
    .await
    .unwrap_err();
    assert!(matches!(e, ImportError::TaskType { .. }), "{e}");
    assert!(e.to_string().contains("--task-type"), "{e}");
}

#[tokio::test]
async fn missing_and_unknown_columns_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    for col in ["score", "single_turn_prompt", "conv_id"] {
        let file = tmp.path().join(format!("no-{col}.parquet"));
        write_fixture(&file, Some(col), None);
        let e = import::import(
            file.to_str().unwrap(),
            &tmp.path().join("o"),
            &ImportOptions {
                task_type: Some(TaskType::Math),
                ..ImportOptions::default()
            },
        )
        .await
        .unwrap_err();
        match &e {
            ImportError::MissingColumn { column, path } => {
                assert_eq!(column, col);
                assert_eq!(path, &file);
            }
            other => panic!("expected MissingColumn({col}), got {other}"),
        }
        assert!(
            e.to_string().contains(&format!("missing column `{col}`")),
            "{e}"
        );
    }
    let file = tmp.path().join("extra.parquet");
    write_fixture(&file, None, Some("chosen_model"));
    let e = read_flat_checked(&file).unwrap_err();
    assert!(
        matches!(&e, ImportError::UnknownColumn { column, .. } if column == "chosen_model"),
        "{e}"
    );
    // Optional columns may be absent.
    let file = tmp.path().join("no-sessions.parquet");
    write_fixture(&file, Some("sessions"), None);
    assert_eq!(read_flat_checked(&file).unwrap().len(), 12);

    // The binary prints the named error.
    let file = tmp.path().join("no-score.parquet");
    let out = tmp.path().join("cli");
    let (ok, _, stderr) = generate_conv(
        &[
            "--import",
            file.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
            "--task-type",
            "math",
        ],
        &[],
    );
    assert!(!ok);
    assert!(stderr.contains("missing column `score`"), "{stderr}");
    assert!(stderr.contains("no-score.parquet"), "{stderr}");
}

/// `generate_conv --import hf:…` from the HF cache with HF_HUB_OFFLINE=1 (no network), the task
/// type guessed from the dataset's name; `--tasks hf:…` plans a run over the imported goals;
/// an uncached dataset offline is a clear error.
#[test]
fn binary_import_from_hf_cache_and_local_file() {
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path().join("hf-home");
    let snapshot: PathBuf =
        home.join("hub/datasets--collabllm--collabllm-multiturn-math-hard/snapshots/0123abcd/data");
    write_fixture(&snapshot.join("train-00000-of-00001.parquet"), None, None);
    let out = tmp.path().join("imported");
    let env: [(&str, &Path); 2] = [("HF_HOME", &home), ("HF_HUB_OFFLINE", Path::new("1"))];
    let (ok, stdout, stderr) = generate_conv(
        &[
            "--import",
            "hf:collabllm/collabllm-multiturn-math-hard",
            "--output",
            out.to_str().unwrap(),
            "--test-fraction",
            "0.5",
        ],
        &env,
    );
    assert!(ok, "{stdout}\n{stderr}");
    assert!(stdout.contains("tasks          2"), "{stdout}");
    check_output(&out);

    let (ok, stdout, stderr) = generate_conv(
        &[
            "--tasks",
            "hf:collabllm/collabllm-multiturn-math-hard",
            "--output",
            tmp.path().join("run").to_str().unwrap(),
            "--dry-run",
        ],
        &env,
    );
    assert!(ok, "{stdout}\n{stderr}");
    assert!(stdout.contains("tasks 2 from hf:collabllm"), "{stdout}");

    // A local flat file as --tasks (type from the flag).
    let local = tmp.path().join("upstream.parquet");
    write_fixture(&local, None, None);
    let (ok, stdout, stderr) = generate_conv(
        &[
            "--tasks",
            local.to_str().unwrap(),
            "--task-type",
            "math",
            "--dry-run",
        ],
        &[],
    );
    assert!(ok, "{stdout}\n{stderr}");
    assert!(stdout.contains("tasks 2 from"), "{stdout}");

    let (ok, _, stderr) = generate_conv(
        &[
            "--import",
            "hf:collabllm/not-cached",
            "--output",
            tmp.path().join("none").to_str().unwrap(),
        ],
        &env,
    );
    assert!(!ok);
    assert!(
        stderr.contains("hf:collabllm/not-cached") && stderr.contains("HF_HUB_OFFLINE"),
        "{stderr}"
    );
}

/// `--export verl` of an imported dataset (and later of the same run directory): verl's
/// CollabLLM-recipe files, read back; a directory without flat.parquet is refused.
#[test]
fn binary_exports_verl_recipe_files() {
    let tmp = tempfile::tempdir().unwrap();
    let local = tmp.path().join("upstream.parquet");
    write_fixture(&local, None, None);
    let out = tmp.path().join("imported");
    let (ok, stdout, stderr) = generate_conv(
        &[
            "--import",
            local.to_str().unwrap(),
            "--task-type",
            "math",
            "--output",
            out.to_str().unwrap(),
            "--export",
            "verl",
            "--task-desc",
            "solving hard math problems",
        ],
        &[],
    );
    assert!(ok, "{stdout}\n{stderr}");
    assert!(stdout.contains("rl "), "{stdout}");
    for f in ["rl_train", "rl_validation", "sft_train", "sft_validation"] {
        assert!(
            out.join("verl").join(format!("{f}.parquet")).is_file(),
            "{f}"
        );
    }
    let file = std::fs::File::open(out.join("verl/rl_train.parquet")).unwrap();
    let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
        .unwrap()
        .build()
        .unwrap();
    let rows: usize = reader.map(|b| b.unwrap().num_rows()).sum();
    assert!(rows > 0);

    // Again from the run directory alone, into another directory, with our system prompt
    // replaced.
    let prompt = tmp.path().join("system.txt");
    std::fs::write(&prompt, "Be a careful collaborator.\n").unwrap();
    let elsewhere = tmp.path().join("verl2");
    let (ok, stdout, stderr) = generate_conv(
        &[
            "--output",
            out.to_str().unwrap(),
            "--export",
            "verl",
            "--export-dir",
            elsewhere.to_str().unwrap(),
            "--system-prompt",
            prompt.to_str().unwrap(),
        ],
        &[],
    );
    assert!(ok, "{stdout}\n{stderr}");
    assert!(elsewhere.join("sft_train.parquet").is_file());

    let (ok, _, stderr) = generate_conv(
        &[
            "--output",
            tmp.path().join("empty").to_str().unwrap(),
            "--export",
            "verl",
        ],
        &[],
    );
    assert!(!ok);
    assert!(stderr.contains("flat.parquet not found"), "{stderr}");
}

/// Rows of `collabllm-multiturn-bigcodebench` become code tasks that keep BigCodeBench's
/// `test`, `entry_point` and `libs`, so `pass_rate` can run them.
#[test]
fn bigcodebench_rows_keep_their_tests_and_entry_point() {
    use collabllm::dataset::flat::FlatRow;
    let test = "import unittest\nclass TestCases(unittest.TestCase):\n    def test_a(self):\n        self.assertEqual(task_func(), 1)\n";
    let row = FlatRow {
        prompt: vec![collabllm::llm::ChatMessage::user("Write task_func")],
        completion: "def task_func(): return 1".into(),
        conv_id: "0".into(),
        turn_id: 0,
        score: 1.0,
        single_turn_prompt: "Write task_func returning 1.".into(),
        single_turn_completion: "def task_func():\n    return 1".into(),
        single_turn_metadata: serde_json::json!({
            "test": test, "entry_point": "task_func", "libs": "['random']"
        }),
        sessions: serde_json::json!([]),
        rewards: serde_json::json!({}),
    };
    let name = "collabllm-multiturn-bigcodebench";
    // Typed by the dataset's name.
    let tasks = collabllm::task::source::tasks_from_flat(&[row], None, None, name).unwrap();
    assert_eq!(tasks[0].task_type, collabllm::task::TaskType::Code);
    assert_eq!(tasks[0].metadata["test"], test);
    assert_eq!(tasks[0].metadata["entry_point"], "task_func");
    collabllm::reward::metrics::check_tasks_for_metrics(&tasks, &["pass_rate".to_string()])
        .unwrap();
    assert!(collabllm::reward::metrics::runnable_tests(&tasks[0], test)
        .starts_with("from solution import *"));
}
