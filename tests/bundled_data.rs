//! The bundled task files in `data/` load, have the promised counts and shapes, and every code
//! task's reference solution passes its own unit tests under `python3`.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use collabllm::task::{load_tasks, Task, TaskType};

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("data")
        .join(name)
}

fn load(name: &str) -> Vec<Task> {
    load_tasks(&data(name)).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn bundled_files_load_with_expected_shapes() {
    let files = [
        ("math.jsonl", TaskType::Math, "math-", 20),
        ("doc_edit.jsonl", TaskType::DocEdit, "doc-", 5),
        ("code.jsonl", TaskType::Code, "code-", 10),
    ];
    let mut ids = HashSet::new();
    for (file, task_type, prefix, count) in files {
        let tasks = load(file);
        assert_eq!(tasks.len(), count, "{file}");
        for (i, t) in tasks.iter().enumerate() {
            assert_eq!(
                t.id,
                format!("{prefix}{:03}", i + 1),
                "{file}: ids in order"
            );
            assert!(ids.insert(t.id.clone()), "duplicate id {}", t.id);
            assert_eq!(t.task_type, task_type, "{}", t.id);
            assert!(!t.prompt.trim().is_empty(), "{}: empty prompt", t.id);
            assert!(!t.reference.trim().is_empty(), "{}: empty reference", t.id);
            match task_type {
                TaskType::Math => {
                    let v: f64 = t.reference.parse().unwrap_or_else(|_| {
                        panic!("{}: reference `{}` is not a number", t.id, t.reference)
                    });
                    assert!(v.is_finite());
                }
                TaskType::DocEdit => {
                    let words = t.reference.split_whitespace().count();
                    assert!((80..=200).contains(&words), "{}: {words} words", t.id);
                }
                TaskType::Code => {
                    let tests = t.metadata["tests"].as_str().expect("metadata.tests");
                    assert!(tests.contains("from solution import *"), "{}", t.id);
                    assert!(tests.contains("unittest.TestCase"), "{}", t.id);
                    let entry = t.metadata["entry_point"].as_str().expect("entry_point");
                    assert!(t.prompt.contains(entry), "{}: prompt names {entry}", t.id);
                    assert!(
                        t.reference.contains(&format!("def {entry}(")),
                        "{}: reference defines {entry}",
                        t.id
                    );
                }
                TaskType::TwentyQuestions | TaskType::Clarify => unreachable!(),
            }
        }
    }
}

#[test]
fn code_references_pass_their_tests() {
    for t in load("code.jsonl") {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("solution.py"), &t.reference).unwrap();
        std::fs::write(
            dir.path().join("test_solution.py"),
            t.metadata["tests"].as_str().unwrap(),
        )
        .unwrap();
        let out = Command::new("python3")
            .args(["-B", "-m", "unittest", "-v", "test_solution"])
            .current_dir(dir.path())
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .output()
            .expect("python3 must be installed to check the bundled code tasks");
        let log = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{}: tests failed:\n{log}", t.id);
        let ran: usize = log
            .lines()
            .find_map(|l| {
                l.strip_prefix("Ran ")?
                    .split_whitespace()
                    .next()?
                    .parse()
                    .ok()
            })
            .unwrap_or(0);
        assert!(ran >= 3, "{}: only {ran} tests ran:\n{log}", t.id);
    }
}
