//! Reading a run's tasks from its [`TaskSource`]: task files (JSONL or parquet), upstream
//! flat parquet files, published flat datasets on the Hub (`hf:`), the bundled 20 Questions
//! objects (`20q:`) and clarify-or-answer tasks (`clarify:`); then the first `max_tasks`, the
//! shard, and a check that every task carries what the weighted metrics need.

use std::path::Path;

use anyhow::bail;

use crate::reward::metrics::{check_tasks_for_metrics, default_weights};
use crate::rollout::config::{twenty_questions_split, TaskSource};
use crate::task::twenty_questions::chat;
use crate::task::{load_tasks, Task};

/// Loads and checks the tasks of a config (first `max_tasks`) from a local file: task JSONL or
/// parquet, or a parquet file in the upstream flat schema. `hf:` sources need
/// [`fetch`].
pub fn load(src: &TaskSource) -> anyhow::Result<Vec<Task>> {
    if super::import::is_hub_source(&src.tasks) {
        bail!(
            "--tasks {}: a Hub dataset is fetched asynchronously ",
            src.tasks
        );
    }
    if let Some(split) = twenty_questions_split(&src.tasks) {
        let split = split.map_err(anyhow::Error::msg)?;
        let world = chat::default_world().map_err(anyhow::Error::msg)?;
        return check(src, chat::object_tasks(world, split));
    }
    if let Some(source) = crate::task::clarify::source_split(&src.tasks) {
        let source = source.map_err(anyhow::Error::msg)?;
        return check(src, crate::task::clarify::load(&source)?);
    }
    let path = Path::new(&src.tasks);
    let tasks = if super::import::is_flat_parquet(path) {
        let rows = super::import::read_flat_checked(path)?;
        let name = path
            .file_stem()
            .map_or(String::new(), |s| s.to_string_lossy().into_owned());
        super::import::tasks_from_flat(&rows, src.task_type, src.expected_type, &name)?
    } else {
        load_tasks(path)?
    };
    check(src, tasks)
}

/// [`load`], and `hf:<org>/<name>` (the unique goals of a published flat dataset,
/// downloaded into the HF cache).
pub async fn fetch(src: &TaskSource) -> anyhow::Result<Vec<Task>> {
    if super::import::is_hub_source(&src.tasks) {
        let tasks =
            super::import::load_flat_tasks(&src.tasks, src.task_type, src.expected_type, None)
                .await?;
        check(src, tasks)
    } else {
        load(src)
    }
}

fn check(src: &TaskSource, mut tasks: Vec<Task>) -> anyhow::Result<Vec<Task>> {
    if let Some(want) = src.expected_type {
        if let Some(t) = tasks.iter().find(|t| t.task_type != want) {
            bail!(
                "--tasks {}: task {} is {}, not {} (--task)",
                src.tasks,
                t.id,
                t.task_type,
                want
            );
        }
    }
    if let Some(k) = src.max_tasks {
        tasks.truncate(k);
    }
    if tasks.is_empty() {
        bail!("--tasks {}: no tasks", src.tasks);
    }
    if let Some(shard) = src.shard {
        let all = tasks.len();
        tasks.retain(|t| shard.contains(&t.id));
        tracing::info!("--shard {shard}: {} of {all} tasks", tasks.len());
        if tasks.is_empty() {
            bail!("--shard {shard}: none of the {all} tasks falls in this shard");
        }
    }
    for t in &tasks {
        let metrics: Vec<String> = if src.metrics.is_empty() {
            default_weights(t.task_type).into_keys().collect()
        } else {
            src.metrics.keys().cloned().collect()
        };
        check_tasks_for_metrics(std::slice::from_ref(t), &metrics)?;
    }
    Ok(tasks)
}
