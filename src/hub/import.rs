//! Import the public CollabLLM flat datasets (`collabllm/collabllm-multiturn-*`) from
//! the Hub (`hf:<org>/<name>`) or a local parquet file, as tasks (the unique single-turn goals with
//! their references and metadata) and as ready preference pairs (per conversation turn, the
//! best- against the worst-scored candidate above the minimum gap).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use futures::TryStreamExt as _;
use serde_json::{json, Value};
use sha2::Digest as _;

use super::HubError;
use crate::dataset::{
    read_flat_parquet, split_by_conversation, write_flat_parquet, write_pairs_parquet,
    DatasetError, FlatRow, PairRow,
};
use crate::llm::ChatMessage;
use crate::reward::pairs::{select_pairs, PairMode};
use crate::run::{now_secs, ManifestHeader, RunStatus};
use crate::task::{write_tasks_jsonl, Task, TaskError, TaskType};

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

#[derive(Debug, thiserror::Error)]
pub enum ImportError {
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
    #[error("hf:{repo}: {message}")]
    Download { repo: String, message: String },
    #[error(transparent)]
    Dataset(#[from] DatasetError),
    #[error(transparent)]
    Task(#[from] TaskError),
    #[error(transparent)]
    Hub(#[from] HubError),
}

/// Settings of an import.
#[derive(Clone, Debug)]
pub struct ImportOptions {
    /// Task type of every task (else `task_type` in the metadata, else the dataset's name).
    pub task_type: Option<TaskType>,
    pub min_gap: f64,
    pub pairs: PairMode,
    pub test_fraction: f64,
    pub seed: u64,
    /// Hub endpoint for `hf:` sources (else `HF_ENDPOINT`).
    pub endpoint: Option<String>,
}

impl Default for ImportOptions {
    fn default() -> Self {
        Self {
            task_type: None,
            min_gap: 0.02,
            pairs: PairMode::Best,
            test_fraction: 0.1,
            seed: 0,
            endpoint: None,
        }
    }
}

/// What an import produced.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ImportSummary {
    pub source: String,
    pub files: Vec<String>,
    pub rows: usize,
    pub tasks: usize,
    pub conversations: usize,
    pub turns: usize,
    pub turns_without_pair: usize,
    pub pairs_train: usize,
    pub pairs_test: usize,
}

impl std::fmt::Display for ImportSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "source         {} ({} file(s))",
            self.source,
            self.files.len()
        )?;
        writeln!(f, "rows           {}", self.rows)?;
        writeln!(f, "tasks          {}", self.tasks)?;
        writeln!(
            f,
            "turns          {} in {} conversations ({} without a pair)",
            self.turns, self.conversations, self.turns_without_pair
        )?;
        write!(
            f,
            "pairs          {} train + {} test",
            self.pairs_train, self.pairs_test
        )
    }
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

/// Whether a tasks argument names a Hub dataset (`hf:<org>/<name>`).
pub fn is_hub_source(source: &str) -> bool {
    source.starts_with("hf:")
}

/// The parquet files of a source: a local file, or every parquet file of a Hub dataset
/// (downloaded into the standard HF cache; with `HF_HUB_OFFLINE=1` only the cache is used).
pub async fn fetch_source(
    source: &str,
    endpoint: Option<&str>,
) -> Result<Vec<PathBuf>, ImportError> {
    match source.strip_prefix("hf:") {
        Some(repo) => fetch_hf_parquet(repo, endpoint).await,
        None => Ok(vec![PathBuf::from(source)]),
    }
}

fn hf_offline() -> bool {
    std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| !v.is_empty() && v != "0")
}

/// `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`.
fn hub_cache() -> PathBuf {
    if let Ok(p) = std::env::var("HF_HUB_CACHE") {
        return PathBuf::from(p);
    }
    super::token_path()
        .parent()
        .map(|p| p.join("hub"))
        .unwrap_or_else(|| PathBuf::from("hub"))
}

/// Parquet files of a cached snapshot of the dataset (newest snapshot first found).
fn cached_parquet(repo: &str) -> Vec<PathBuf> {
    let dir = hub_cache()
        .join(format!("datasets--{}", repo.replace('/', "--")))
        .join("snapshots");
    let Ok(snaps) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    for snap in snaps.flatten() {
        let mut files = Vec::new();
        walk_parquet(&snap.path(), &mut files);
        if !files.is_empty() {
            files.sort();
            return files;
        }
    }
    Vec::new()
}

fn walk_parquet(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            walk_parquet(&p, out);
        } else if p.extension().is_some_and(|x| x == "parquet") {
            out.push(p);
        }
    }
}

async fn fetch_hf_parquet(repo: &str, endpoint: Option<&str>) -> Result<Vec<PathBuf>, ImportError> {
    let (owner, name) = super::split_repo(repo)?;
    let err = |message: String| ImportError::Download {
        repo: repo.to_string(),
        message,
    };
    if hf_offline() {
        let files = cached_parquet(repo);
        if files.is_empty() {
            return Err(err(format!(
                "HF_HUB_OFFLINE is set and the dataset is not in the cache ({}); go online once \
                 or pass a downloaded parquet file",
                hub_cache().display()
            )));
        }
        return Ok(files);
    }
    let mut builder = hf_hub::HFClient::builder();
    if let Some(e) = endpoint {
        builder = builder.endpoint(e);
    }
    let client = builder.build().map_err(|e| err(e.to_string()))?;
    let handle = client.dataset(owner, name);
    let listed: Result<Vec<hf_hub::repository::RepoTreeEntry>, _> =
        match handle.list_tree().recursive(true).send() {
            Ok(stream) => stream.try_collect().await,
            Err(e) => Err(e),
        };
    let entries = match listed {
        Ok(e) => e,
        Err(e) => {
            // Offline without the variable: fall back to the cache, else say what failed.
            let files = cached_parquet(repo);
            if files.is_empty() {
                return Err(err(format!(
                    "cannot list the dataset's files ({e}); check the name and the network, or \
                     set HF_HUB_OFFLINE=1 to use the cache"
                )));
            }
            tracing::warn!(repo, error = %e, "listing failed; using the cached snapshot");
            return Ok(files);
        }
    };
    let mut paths: Vec<String> = entries
        .into_iter()
        .filter_map(|e| match e {
            hf_hub::repository::RepoTreeEntry::File { path, .. } if path.ends_with(".parquet") => {
                Some(path)
            }
            _ => None,
        })
        .collect();
    paths.sort();
    if paths.is_empty() {
        return Err(err("the dataset has no parquet files".into()));
    }
    let mut out = Vec::new();
    for p in paths {
        let file = handle
            .download_file()
            .filename(p.clone())
            .send()
            .await
            .map_err(|e| err(format!("{p}: {e}")))?;
        out.push(file);
    }
    Ok(out)
}

/// Reads one file of the flat schema, checking its columns first: every required column must be
/// there and no column may be unknown (pandas' `__index_level_*__` columns are tolerated).
pub fn read_flat_checked(path: &Path) -> Result<Vec<FlatRow>, ImportError> {
    let reader = crate::dataset::open(path)?;
    let schema = arrow::array::RecordBatchReader::schema(&reader);
    for f in schema.fields() {
        let n = f.name();
        if !FLAT_COLUMNS.contains(&n.as_str()) && !n.starts_with("__") {
            return Err(ImportError::UnknownColumn {
                path: path.to_path_buf(),
                column: n.clone(),
            });
        }
    }
    for c in &FLAT_COLUMNS[..REQUIRED] {
        if schema.index_of(c).is_err() {
            return Err(ImportError::MissingColumn {
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
        return Err(ImportError::EmptyGoal {
            path: path.to_path_buf(),
            row,
        });
    }
    Ok(rows)
}

/// The task type a dataset's name suggests (`…-math-…`, `…-medium…`/`doc`, `…code…`).
pub fn task_type_from_name(name: &str) -> Option<TaskType> {
    let n = name.to_ascii_lowercase();
    if n.contains("math") {
        Some(TaskType::Math)
    } else if n.contains("medium") || n.contains("doc") {
        Some(TaskType::DocEdit)
    } else if n.contains("code") {
        Some(TaskType::Code)
    } else if n.contains("20q") || n.contains("twenty") {
        Some(TaskType::TwentyQuestions)
    } else {
        None
    }
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
) -> Result<Vec<Task>, ImportError> {
    let fallback = flag
        .or_else(|| task_type_from_name(source_name))
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
            .ok_or_else(|| ImportError::TaskType {
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
) -> Result<(Vec<FlatPrefix>, usize), ImportError> {
    let (_, rows) = read_source(source, endpoint).await?;
    Ok(prefixes_from_flat(&rows))
}

/// Preference pairs: rows grouped by (conv_id, turn_id) in first-seen order, each group's scores
/// ranked by [`select_pairs`]. Returns the pairs and the number of groups (turns) and of turns
/// without a pair.
pub fn pairs_from_flat(
    rows: &[FlatRow],
    min_gap: f64,
    mode: PairMode,
) -> (Vec<PairRow>, usize, usize) {
    let mut index: HashMap<(&str, u32), usize> = HashMap::new();
    let mut groups: Vec<Vec<&FlatRow>> = Vec::new();
    for r in rows {
        let i = *index
            .entry((r.conv_id.as_str(), r.turn_id))
            .or_insert_with(|| {
                groups.push(Vec::new());
                groups.len() - 1
            });
        groups[i].push(r);
    }
    let mut pairs = Vec::new();
    let mut without = 0;
    for g in &groups {
        let scores: Vec<Option<f64>> = g.iter().map(|r| Some(r.score)).collect();
        let chosen = select_pairs(&scores, min_gap, mode);
        if chosen.is_empty() {
            without += 1;
        }
        for (c, rj) in chosen {
            pairs.push(PairRow {
                prompt: g[c].prompt.clone(),
                chosen: vec![ChatMessage::assistant(g[c].completion.clone())],
                rejected: vec![ChatMessage::assistant(g[rj].completion.clone())],
                score_chosen: g[c].score,
                score_rejected: g[rj].score,
                conv_id: g[c].conv_id.clone(),
                turn_id: g[c].turn_id,
            });
        }
    }
    (pairs, groups.len(), without)
}

/// The name a source goes by in messages and in the task-type guess.
fn source_name(source: &str) -> String {
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
) -> Result<(Vec<PathBuf>, Vec<FlatRow>), ImportError> {
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
        return Err(ImportError::Empty {
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
) -> Result<Vec<Task>, ImportError> {
    let (_, rows) = read_source(source, endpoint).await?;
    tasks_from_flat(&rows, task_type, otherwise, &source_name(source))
}

/// Imports a source into `output`: `tasks.jsonl`, `pairs/{train,test}.parquet` (split by
/// conversation), `flat.parquet` (the rows as read) and `manifest.json`, so that `push_hf
/// dataset` and `dpo_train` take the directory like a `generate_conv` run.
pub async fn import(
    source: &str,
    output: &Path,
    opts: &ImportOptions,
) -> Result<ImportSummary, ImportError> {
    let started_at = now_secs();
    let (files, rows) = read_source(source, opts.endpoint.as_deref()).await?;
    let name = source_name(source);
    let tasks = tasks_from_flat(&rows, opts.task_type, None, &name)?;
    let (pairs, turns, without) = pairs_from_flat(&rows, opts.min_gap, opts.pairs);
    let conversations = rows
        .iter()
        .map(|r| r.conv_id.as_str())
        .collect::<std::collections::HashSet<_>>()
        .len();
    let (train, test) = split_by_conversation(pairs, opts.test_fraction, opts.seed);
    let io = |p: &Path, e: std::io::Error| ImportError::Hub(super::io_err(p, e));
    let pairs_dir = output.join("pairs");
    std::fs::create_dir_all(&pairs_dir).map_err(|e| io(&pairs_dir, e))?;
    write_tasks_jsonl(&output.join("tasks.jsonl"), &tasks)?;
    write_pairs_parquet(&pairs_dir.join("train.parquet"), &train)?;
    write_pairs_parquet(&pairs_dir.join("test.parquet"), &test)?;
    write_flat_parquet(&output.join("flat.parquet"), &rows)?;
    crate::dataset::sft::write_sft_parquet(
        &output.join("sft.parquet"),
        &crate::dataset::sft::sft_from_flat(&rows),
    )?;
    let summary = ImportSummary {
        source: source.to_string(),
        files: files.iter().map(|f| f.display().to_string()).collect(),
        rows: rows.len(),
        tasks: tasks.len(),
        conversations,
        turns,
        turns_without_pair: without,
        pairs_train: train.len(),
        pairs_test: test.len(),
    };
    let header = ManifestHeader::now(
        "collabllm-rs generate_conv --import",
        started_at,
        RunStatus::Complete,
        None,
    );
    let manifest = header.with_fields(json!({
        "import": {"source": source, "files": summary.files, "rows": rows.len()},
        "seed": opts.seed,
        "config": {
            "tasks": source, "min_gap": opts.min_gap, "pairs": opts.pairs,
            "test_fraction": opts.test_fraction, "seed": opts.seed,
        },
        "counts": {
            "conversations": conversations, "turns": turns, "tasks": tasks.len(),
            "pairs_train": summary.pairs_train, "pairs_test": summary.pairs_test,
            "turns_without_pair": without,
        },
    }));
    write_json(&output.join("manifest.json"), &manifest)?;
    Ok(summary)
}

fn write_json(path: &Path, v: &Value) -> Result<(), ImportError> {
    crate::run::write_json_atomic(path, v)
        .map_err(|e| ImportError::Hub(super::io_err(path, e.source)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(conv: &str, turn: u32, score: f64, goal: &str) -> FlatRow {
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
    fn groups_and_gaps() {
        let rows = vec![
            row("a", 0, 0.1, "g1"),
            row("a", 0, 0.9, "g1"),
            row("a", 0, 0.5, "g1"),
            row("a", 1, 0.5, "g1"),
            row("a", 1, 0.51, "g1"),
            row("b", 0, 0.0, "g2"),
        ];
        let (pairs, turns, without) = pairs_from_flat(&rows, 0.02, PairMode::Best);
        assert_eq!((pairs.len(), turns, without), (1, 3, 2));
        assert_eq!(pairs[0].score_chosen, 0.9);
        assert_eq!(pairs[0].rejected[0].content, "c0.1");
        let tasks = tasks_from_flat(&rows, Some(TaskType::Math), None, "x").unwrap();
        assert_eq!(tasks.len(), 2);
        assert!(matches!(
            tasks_from_flat(&rows, None, None, "x"),
            Err(ImportError::TaskType { .. })
        ));
        // A row's own task type wins over the flag or the dataset's name.
        let mut typed = row("c", 0, 0.5, "g3");
        typed.single_turn_metadata = serde_json::json!({"task_type": "code"});
        let tasks = tasks_from_flat(&[typed], Some(TaskType::Math), None, "x").unwrap();
        assert_eq!(tasks[0].task_type, TaskType::Code);
        assert_eq!(
            task_type_from_name("collabllm/collabllm-multiturn-math-hard"),
            Some(TaskType::Math)
        );
        assert_eq!(
            task_type_from_name("collabllm/collabllm-multiturn-medium"),
            Some(TaskType::DocEdit)
        );
    }
}
