//! Where a run's tasks come from ([`TaskSource`]): task files (JSONL or parquet), upstream
//! flat parquet files (the CollabLLM flat schema: one row per scored candidate, whose unique
//! single-turn goals are the tasks), published flat datasets on the Hub (`hf:<org>/<name>`,
//! downloaded by `hub::download`), the bundled 20 Questions objects (`20q:<split>`) and
//! clarify-or-answer requests (`clarify:<split>`); then which of them a run takes (type, the
//! first K, a shard). Flat rows also give the conversation prefixes rl_train trains on and
//! the preference pairs `generate_conv --import` writes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::Digest as _;

use super::twenty_questions::chat::{self, ObjectSplit};
use super::{load_tasks, Task, TaskError, TaskType};
use crate::dataset::{read_flat_parquet, DatasetError, FlatRow};
use crate::hub::download::{fetch_source, is_hub_source};
use crate::hub::HubError;
use crate::llm::ChatMessage;

/// The tasks source of the bundled 20 Questions objects: `20q:train`, `20q:test`, `20q:all`.
pub const TWENTY_QUESTIONS_SOURCE: &str = "20q:";

/// The split named by a `20q:<split>` tasks source; `None` for any other source.
pub fn twenty_questions_split(tasks: &str) -> Option<Result<ObjectSplit, String>> {
    tasks.strip_prefix(TWENTY_QUESTIONS_SOURCE).map(|s| {
        s.parse::<ObjectSplit>()
            .map_err(|e| format!("--tasks {tasks}: {e}"))
    })
}

/// One of `count` disjoint shards of a task list: a task belongs to shard
/// `hash(task id) mod count`, so its shard never changes when tasks are added.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shard {
    pub index: usize,
    pub count: usize,
}

impl Shard {
    /// Whether the task with this id is in the shard.
    pub fn contains(&self, task_id: &str) -> bool {
        use sha2::Digest as _;
        let h = sha2::Sha256::digest(task_id.as_bytes());
        let v = u64::from_le_bytes(h[..8].try_into().expect("8 bytes"));
        (v % self.count as u64) as usize == self.index
    }
}

impl std::str::FromStr for Shard {
    type Err = String;
    /// `i/n` with `0 <= i < n`.
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("`{s}`: expected i/n with 0 <= i < n, e.g. 0/4");
        let (i, n) = s.split_once('/').ok_or_else(bad)?;
        let (index, count) = (
            i.trim().parse().map_err(|_| bad())?,
            n.trim().parse().map_err(|_| bad())?,
        );
        if count == 0 || index >= count {
            return Err(bad());
        }
        Ok(Self { index, count })
    }
}

impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

/// Where a run's tasks come from and which of them it takes.
#[derive(Clone, Debug, PartialEq)]
pub struct TaskSource {
    /// A JSONL or parquet file, an upstream flat parquet file, `hf:<org>/<name>`, `20q:<split>`
    /// or `clarify:<split>`.
    pub tasks: String,
    /// Task type of flat-schema tasks whose metadata has none.
    pub task_type: Option<TaskType>,
    /// Every task must be of this type (eval_multiturn's `--task`); also the type of
    /// flat-schema tasks that neither their metadata, `task_type` nor the dataset's name
    /// types.
    pub expected_type: Option<TaskType>,
    /// Only the first K tasks.
    pub max_tasks: Option<usize>,
    /// Only this shard of them.
    pub shard: Option<Shard>,
    /// The weighted metrics (empty: each task type's defaults): every task must carry what
    /// they need.
    pub metrics: BTreeMap<String, f64>,
}

impl TaskSource {
    /// Whether these are 20 Questions games: the bundled objects, or tasks typed as a game.
    pub fn plays_twenty_questions(&self) -> bool {
        twenty_questions_split(&self.tasks).is_some()
            || self.task_type.is_some_and(TaskType::is_game)
            || self.expected_type.is_some_and(TaskType::is_game)
    }

    /// All of `tasks`' tasks (no shard), checked against `metrics`.
    pub fn new(
        tasks: &str,
        task_type: Option<TaskType>,
        max_tasks: Option<usize>,
        metrics: &BTreeMap<String, f64>,
    ) -> Self {
        Self {
            tasks: tasks.to_string(),
            task_type,
            expected_type: None,
            max_tasks,
            shard: None,
            metrics: metrics.clone(),
        }
    }

    /// Checks the source's name and shard before anything is read: the setting at fault
    /// (`tasks` or `shard`) and the message. (The metric weights are the rollout's to check.)
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if self.tasks.trim().is_empty() {
            return Err(("tasks", "a tasks file is required".into()));
        }
        if let Some(s) = self.shard {
            if s.count == 0 || s.index >= s.count {
                return Err(("shard", format!("{s}: expected 0 <= i < n")));
            }
        }
        if let Some(Err(e)) = twenty_questions_split(&self.tasks) {
            return Err(("tasks", e));
        }
        if let Some(Err(e)) = super::clarify::source_split(&self.tasks) {
            return Err(("tasks", e));
        }
        Ok(())
    }

    /// The source's tasks, read from a local source (task files, flat parquet, `20q:`,
    /// `clarify:`); a `hf:` source needs [`Self::fetch`]. Then only the expected type, the
    /// first `max_tasks` and the shard.
    pub fn load(&self) -> Result<Vec<Task>, SourceError> {
        if is_hub_source(&self.tasks) {
            return Err(SourceError::NeedsDownload {
                source_name: self.tasks.clone(),
            });
        }
        let split_error = |message: String| SourceError::Split { message };
        if let Some(split) = twenty_questions_split(&self.tasks) {
            let world = chat::default_world().map_err(split_error)?;
            return self.select(chat::object_tasks(world, split.map_err(split_error)?));
        }
        if let Some(source) = super::clarify::source_split(&self.tasks) {
            let tasks = super::clarify::load(&source.map_err(split_error)?)
                .map_err(|e| split_error(e.to_string()))?;
            return self.select(tasks);
        }
        let path = Path::new(&self.tasks);
        let tasks = if is_flat_parquet(path) {
            let rows = read_flat_checked(path)?;
            let name = path
                .file_stem()
                .map_or(String::new(), |s| s.to_string_lossy().into_owned());
            tasks_from_flat(&rows, self.task_type, self.expected_type, &name)?
        } else {
            load_tasks(path)?
        };
        self.select(tasks)
    }

    /// [`Self::load`], and `hf:<org>/<name>`: the unique goals of a published flat dataset,
    /// downloaded into the HF cache.
    pub async fn fetch(&self) -> Result<Vec<Task>, SourceError> {
        if is_hub_source(&self.tasks) {
            let tasks =
                load_flat_tasks(&self.tasks, self.task_type, self.expected_type, None).await?;
            self.select(tasks)
        } else {
            self.load()
        }
    }

    fn select(&self, mut tasks: Vec<Task>) -> Result<Vec<Task>, SourceError> {
        let source_name = || self.tasks.clone();
        if let Some(want) = self.expected_type {
            if let Some(t) = tasks.iter().find(|t| t.task_type != want) {
                return Err(SourceError::WrongType {
                    source_name: source_name(),
                    task: t.id.clone(),
                    found: t.task_type,
                    want,
                });
            }
        }
        if let Some(k) = self.max_tasks {
            tasks.truncate(k);
        }
        if tasks.is_empty() {
            return Err(SourceError::NoTasks {
                source_name: source_name(),
            });
        }
        if let Some(shard) = self.shard {
            let all = tasks.len();
            tasks.retain(|t| shard.contains(&t.id));
            tracing::info!("--shard {shard}: {} of {all} tasks", tasks.len());
            if tasks.is_empty() {
                return Err(SourceError::EmptyShard { shard, all });
            }
        }
        Ok(tasks)
    }
}

/// The upstream flat schema's columns; the first eight are required for an import.
pub const FLAT_COLUMNS: [&str; 10] = [
    "prompt",
    "completion",
    "conv_id",
    "turn_id",
    "score",
    "single_turn_prompt",
    "single_turn_completion",
    "single_turn_metadata",
    "sessions",
    "rewards",
];
const REQUIRED: usize = 8;

/// Everything that can go wrong reading a task source; each variant names the source, file or
/// row.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("{}: missing column `{column}` (the CollabLLM flat schema has: {})", path.display(), FLAT_COLUMNS.join(", "))]
    MissingColumn { path: PathBuf, column: String },
    #[error("{}: unknown column `{column}` (the CollabLLM flat schema has: {})", path.display(), FLAT_COLUMNS.join(", "))]
    UnknownColumn { path: PathBuf, column: String },
    #[error("{}: row {row}: `single_turn_prompt` is empty", path.display())]
    EmptyGoal { path: PathBuf, row: usize },
    #[error("{source_name}: cannot tell the task type (no `task_type` in single_turn_metadata and none in the dataset's name); pass --task-type")]
    TaskType { source_name: String },
    #[error("{source_name}: no rows")]
    Empty { source_name: String },
    #[error("--tasks {source_name}: task {task} is {found}, not {want} (--task)")]
    WrongType {
        source_name: String,
        task: String,
        found: TaskType,
        want: TaskType,
    },
    #[error("--tasks {source_name}: no tasks")]
    NoTasks { source_name: String },
    #[error("--shard {shard}: none of the {all} tasks falls in this shard")]
    EmptyShard { shard: Shard, all: usize },
    #[error("{message}")]
    Split { message: String },
    #[error("--tasks {source_name}: a Hub dataset is fetched asynchronously")]
    NeedsDownload { source_name: String },
    #[error(transparent)]
    Dataset(#[from] DatasetError),
    #[error(transparent)]
    Task(#[from] TaskError),
    #[error(transparent)]
    Hub(#[from] HubError),
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Whether a tasks argument names a flat-schema source: a Hub dataset or a local flat
/// parquet file.
pub fn is_flat_source(source: &str) -> bool {
    is_hub_source(source) || is_flat_parquet(Path::new(source))
}

/// Whether `path` is a parquet file in the flat schema (has `single_turn_prompt`).
pub fn is_flat_parquet(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("parquet"))
        && crate::dataset::open(path).is_ok_and(|r| {
            arrow::array::RecordBatchReader::schema(&r)
                .index_of("single_turn_prompt")
                .is_ok()
        })
}

/// Reads one file of the flat schema, checking its columns first: every required column must be
/// there and no column may be unknown (pandas' `__index_level_*__` columns are tolerated).
pub fn read_flat_checked(path: &Path) -> Result<Vec<FlatRow>, SourceError> {
    let reader = crate::dataset::open(path)?;
    let schema = arrow::array::RecordBatchReader::schema(&reader);
    for f in schema.fields() {
        let n = f.name();
        if !FLAT_COLUMNS.contains(&n.as_str()) && !n.starts_with("__") {
            return Err(SourceError::UnknownColumn {
                path: path.to_path_buf(),
                column: n.clone(),
            });
        }
    }
    for c in &FLAT_COLUMNS[..REQUIRED] {
        if schema.index_of(c).is_err() {
            return Err(SourceError::MissingColumn {
                path: path.to_path_buf(),
                column: (*c).to_string(),
            });
        }
    }
    drop(reader);
    let rows = read_flat_parquet(path)?;
    if let Some(row) = rows
        .iter()
        .position(|r| r.single_turn_prompt.trim().is_empty())
    {
        return Err(SourceError::EmptyGoal {
            path: path.to_path_buf(),
            row,
        });
    }
    Ok(rows)
}

/// Task id: a stable hash of the goal, so re-imports and other sources agree.
fn task_id(goal: &str) -> String {
    let h = sha2::Sha256::digest(goal.as_bytes());
    format!("flat-{}", &hex::encode(h)[..16])
}

/// The unique single-turn goals as tasks, in first-seen order. Task type: the row metadata's
/// own `task_type`, else `flag`, else the one the dataset's name (`source_name`) says, else
/// `otherwise`.
pub fn tasks_from_flat(
    rows: &[FlatRow],
    flag: Option<TaskType>,
    otherwise: Option<TaskType>,
    source_name: &str,
) -> Result<Vec<Task>, SourceError> {
    let fallback = flag
        .or_else(|| TaskType::from_dataset_name(source_name))
        .or(otherwise);
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    for r in rows {
        if !seen.insert(r.single_turn_prompt.as_str()) {
            continue;
        }
        let from_meta = r.single_turn_metadata["task_type"]
            .as_str()
            .and_then(|s| s.parse::<TaskType>().ok());
        let task_type = from_meta
            .or(fallback)
            .ok_or_else(|| SourceError::TaskType {
                source_name: source_name.to_string(),
            })?;
        out.push(Task {
            id: task_id(&r.single_turn_prompt),
            task_type,
            prompt: r.single_turn_prompt.clone(),
            reference: r.single_turn_completion.clone(),
            metadata: r.single_turn_metadata.clone(),
        });
    }
    Ok(out)
}

/// One conversation prefix of a flat dataset: the `prompt` of one (conversation, turn),
/// ending with a user message, and the task it belongs to.
#[derive(Clone, Debug, PartialEq)]
pub struct FlatPrefix {
    pub task_id: String,
    pub messages: Vec<ChatMessage>,
}

/// The prompt of every (conv_id, turn_id), in first-seen order: the multi-turn prefixes
/// upstream's verl recipe trains on. Returns them and the number of prompts skipped because
/// they do not end with a user message (nothing for the policy to answer).
pub fn prefixes_from_flat(rows: &[FlatRow]) -> (Vec<FlatPrefix>, usize) {
    let mut seen = std::collections::HashSet::new();
    let (mut out, mut skipped) = (Vec::new(), 0);
    for r in rows {
        if !seen.insert((r.conv_id.as_str(), r.turn_id)) {
            continue;
        }
        if r.prompt.last().is_none_or(|m| m.role != "user") {
            skipped += 1;
            continue;
        }
        out.push(FlatPrefix {
            task_id: task_id(&r.single_turn_prompt),
            messages: r.prompt.clone(),
        });
    }
    (out, skipped)
}

/// The conversation prefixes of a flat source (a local parquet file or `hf:` dataset).
pub async fn load_flat_prefixes(
    source: &str,
    endpoint: Option<&str>,
) -> Result<(Vec<FlatPrefix>, usize), SourceError> {
    let (_, rows) = read_source(source, endpoint).await?;
    Ok(prefixes_from_flat(&rows))
}

/// The name a source goes by in messages and in the task-type guess.
pub(crate) fn source_name(source: &str) -> String {
    source.strip_prefix("hf:").map_or_else(
        || {
            Path::new(source)
                .file_stem()
                .map_or(source.to_string(), |s| s.to_string_lossy().into_owned())
        },
        str::to_string,
    )
}

/// Reads every file of a source. With several files (a Hub dataset's splits), conversation ids
/// are prefixed with the file's split name so that equal ids in two splits stay apart.
pub async fn read_source(
    source: &str,
    endpoint: Option<&str>,
) -> Result<(Vec<PathBuf>, Vec<FlatRow>), SourceError> {
    let files = fetch_source(source, endpoint).await?;
    let mut rows = Vec::new();
    for f in &files {
        let mut r = read_flat_checked(f)?;
        if files.len() > 1 {
            let split = f
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let split = split.split(['-', '.']).next().unwrap_or("part").to_string();
            for row in &mut r {
                row.conv_id = format!("{split}/{}", row.conv_id);
            }
        }
        rows.extend(r);
    }
    if rows.is_empty() {
        return Err(SourceError::Empty {
            source_name: source.to_string(),
        });
    }
    Ok((files, rows))
}

/// Tasks of a flat-schema source (for `generate_conv --tasks hf:…`), typed as
/// [`tasks_from_flat`] types them.
pub async fn load_flat_tasks(
    source: &str,
    task_type: Option<TaskType>,
    otherwise: Option<TaskType>,
    endpoint: Option<&str>,
) -> Result<Vec<Task>, SourceError> {
    let (_, rows) = read_source(source, endpoint).await?;
    tasks_from_flat(&rows, task_type, otherwise, &source_name(source))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::{json, Value};

    /// A flat row of conversation `conv`, turn `turn`, scored `score`, for goal `goal`.
    pub(crate) fn row(conv: &str, turn: u32, score: f64, goal: &str) -> FlatRow {
        FlatRow {
            prompt: vec![ChatMessage::user("hi")],
            completion: format!("c{score}"),
            conv_id: conv.into(),
            turn_id: turn,
            score,
            single_turn_prompt: goal.into(),
            single_turn_completion: "ref".into(),
            single_turn_metadata: json!({"level": 1}),
            sessions: Value::Null,
            rewards: Value::Null,
        }
    }

    #[test]
    fn prefixes_are_one_per_turn_and_end_with_the_user() {
        let mut second = row("a", 1, 0.5, "g1");
        second.prompt = vec![
            ChatMessage::user("hi"),
            ChatMessage::assistant("what do you need?"),
            ChatMessage::user("a sum"),
        ];
        let mut ends_with_assistant = row("b", 0, 0.1, "g2");
        ends_with_assistant.prompt.push(ChatMessage::assistant("x"));
        let rows = vec![
            row("a", 0, 0.1, "g1"),
            row("a", 0, 0.9, "g1"),
            second.clone(),
            second,
            ends_with_assistant,
        ];
        let (prefixes, skipped) = prefixes_from_flat(&rows);
        assert_eq!(skipped, 1);
        assert_eq!(prefixes.len(), 2);
        assert_eq!(prefixes[1].messages.len(), 3);
        let tasks = tasks_from_flat(&rows, Some(TaskType::Math), None, "x").unwrap();
        assert!(prefixes.iter().all(|p| p.task_id == tasks[0].id));
    }

    #[test]
    fn flat_rows_become_one_task_per_goal_typed_by_row_flag_or_name() {
        let rows = vec![
            row("a", 0, 0.1, "g1"),
            row("a", 0, 0.9, "g1"),
            row("a", 1, 0.5, "g1"),
            row("b", 0, 0.0, "g2"),
        ];
        let tasks = tasks_from_flat(&rows, Some(TaskType::Math), None, "x").unwrap();
        assert_eq!(tasks.len(), 2);
        assert!(matches!(
            tasks_from_flat(&rows, None, None, "x"),
            Err(SourceError::TaskType { .. })
        ));
        // A row's own task type wins over the flag or the dataset's name.
        let mut typed = row("c", 0, 0.5, "g3");
        typed.single_turn_metadata = serde_json::json!({"task_type": "code"});
        let tasks = tasks_from_flat(&[typed], Some(TaskType::Math), None, "x").unwrap();
        assert_eq!(tasks[0].task_type, TaskType::Code);
        let named = tasks_from_flat(&rows, None, None, "collabllm-multiturn-medium").unwrap();
        assert_eq!(named[0].task_type, TaskType::DocEdit);
    }

    #[test]
    fn a_source_selects_type_count_and_shard() {
        let src = TaskSource {
            expected_type: Some(TaskType::Math),
            ..TaskSource::new("20q:test", None, Some(3), &BTreeMap::new())
        };
        let err = src.load().unwrap_err().to_string();
        assert!(err.contains("is twenty_questions, not math"), "{err}");
        let src = TaskSource::new("20q:test", None, Some(3), &BTreeMap::new());
        assert_eq!(src.load().unwrap().len(), 3);
        assert!(matches!(
            TaskSource::new("hf:org/data", None, None, &BTreeMap::new()).load(),
            Err(SourceError::NeedsDownload { .. })
        ));
        let bad = TaskSource::new("20q:nope", None, None, &BTreeMap::new());
        assert_eq!(bad.validate().unwrap_err().0, "tasks");
    }
}
