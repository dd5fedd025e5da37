//! Train/test hygiene: evaluation tasks must not be tasks that a `generate_conv` run turned
//! into training data. A run's tasks are the finished conversations in its
//! `conversations.jsonl` (task id, task type, goal and reference are stored there).

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use crate::rollout::records::{read_records, CONVERSATIONS_FILE};
use crate::task::twenty_questions::World;
use crate::task::{Task, TaskType};

#[derive(Debug, thiserror::Error)]
pub enum OverlapError {
    #[error("--exclude-run {}: not a generate_conv run directory (no {CONVERSATIONS_FILE}: {message})", dir.display())]
    NotARun { dir: PathBuf, message: String },
    #[error("evaluation overlaps the training data of {}: {} shared ({}); evaluate on other tasks, or pass --allow-overlap to go on anyway", dir.display(), shared.len(), shared.join(", "))]
    Shared { dir: PathBuf, shared: Vec<String> },
}

/// One task a training run used.
#[derive(Clone, Debug)]
pub struct RunTask {
    pub id: String,
    pub task_type: TaskType,
    pub goal: String,
    pub reference: String,
}

/// The tasks of a generate_conv run directory.
pub fn run_tasks(dir: &Path) -> Result<Vec<RunTask>, OverlapError> {
    if !dir.join(CONVERSATIONS_FILE).is_file() {
        return Err(OverlapError::NotARun {
            dir: dir.to_path_buf(),
            message: "file not found".into(),
        });
    }
    let records = read_records(dir).map_err(|e| OverlapError::NotARun {
        dir: dir.to_path_buf(),
        message: e.to_string(),
    })?;
    Ok(records
        .into_iter()
        .map(|r| RunTask {
            id: r.task_id,
            task_type: r.task_type,
            goal: r.goal,
            reference: r.reference,
        })
        .collect())
}

fn norm(s: &str) -> String {
    s.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .to_lowercase()
}

/// Evaluation tasks that a run also used: the same id, or the same goal text under another id.
pub fn shared_tasks(eval: &[Task], run: &[RunTask]) -> Vec<String> {
    let ids: HashSet<&str> = run.iter().map(|t| t.id.as_str()).collect();
    let goals: HashSet<String> = run.iter().map(|t| norm(&t.goal)).collect();
    eval.iter()
        .filter_map(|t| {
            if ids.contains(t.id.as_str()) {
                Some(t.id.clone())
            } else if goals.contains(&norm(&t.prompt)) {
                Some(format!("{} (same goal as a training task)", t.id))
            } else {
                None
            }
        })
        .collect()
}

/// 20 Questions objects that a run's twenty_questions tasks used (the object is found by
/// name in the task's reference, goal or id).
pub fn shared_objects(world: &World, objects: &[usize], run: &[RunTask]) -> Vec<String> {
    let used: HashSet<usize> = run
        .iter()
        .filter(|t| t.task_type.is_game())
        .filter_map(|t| {
            [&t.reference, &t.goal, &t.id]
                .iter()
                .find_map(|s| world.find(s))
                .map(|o| o.index)
        })
        .collect();
    objects
        .iter()
        .filter(|o| used.contains(o))
        .map(|&o| world.objects[o].name.clone())
        .collect()
}

/// Checks every excluded run; an overlap is an error, or a warning with `allow`.
pub fn check(
    runs: &[PathBuf],
    allow: bool,
    shared_with: impl Fn(&[RunTask]) -> Vec<String>,
) -> Result<Vec<String>, OverlapError> {
    let mut warnings = Vec::new();
    for dir in runs {
        let tasks = run_tasks(dir)?;
        let shared = shared_with(&tasks);
        if shared.is_empty() {
            continue;
        }
        let err = OverlapError::Shared {
            dir: dir.clone(),
            shared,
        };
        if !allow {
            return Err(err);
        }
        tracing::warn!("{err} (--allow-overlap: evaluating anyway)");
        warnings.push(err.to_string());
    }
    Ok(warnings)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(id: &str, prompt: &str) -> Task {
        Task {
            id: id.into(),
            task_type: TaskType::Math,
            prompt: prompt.into(),
            reference: "1".into(),
            metadata: serde_json::Value::Null,
        }
    }

    #[test]
    fn ids_and_goals_are_compared() {
        let run = vec![RunTask {
            id: "a".into(),
            task_type: TaskType::Math,
            goal: "What is  1+1?".into(),
            reference: "2".into(),
        }];
        let eval = [task("a", "x"), task("b", "what is 1+1?"), task("c", "y")];
        assert_eq!(
            shared_tasks(&eval, &run),
            ["a", "b (same goal as a training task)"]
        );
    }

    #[test]
    fn objects_are_found_by_name() {
        let w = World::load_default().unwrap();
        let run = vec![RunTask {
            id: "20q-7".into(),
            task_type: TaskType::TwentyQuestions,
            goal: "Guess the object".into(),
            reference: "plane".into(),
        }];
        let airplane = w.find("Airplane").unwrap().index;
        assert_eq!(shared_objects(&w, &[0, airplane], &run), ["Airplane"]);
        assert!(shared_objects(&w, &[0, 1], &run).is_empty());
    }

    #[test]
    fn a_directory_without_conversations_is_named() {
        let d = tempfile::tempdir().unwrap();
        let e = check(&[d.path().to_path_buf()], false, |_| Vec::new())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("not a generate_conv run") && e.contains(&d.path().display().to_string()),
            "{e}"
        );
    }
}
