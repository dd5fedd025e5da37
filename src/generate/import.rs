//! `generate_conv --import`: a public CollabLLM flat dataset (`hf:<org>/<name>` or a local
//! parquet file, read by `task::source`) as a run directory — its tasks (the unique
//! single-turn goals) and ready preference pairs (per conversation turn, the best- against
//! the worst-scored candidate above the minimum gap), so that `push_hf dataset` and
//! `dpo_train` take it like a generated run.

use std::collections::HashMap;
use std::path::Path;

use serde_json::{json, Value};

use crate::dataset::{
    split_by_conversation, write_flat_parquet, write_pairs_parquet, FlatRow, PairRow,
};
use crate::llm::ChatMessage;
use crate::reward::pairs::{select_pairs, PairMode};
use crate::run::{now_secs, ManifestHeader, RunStatus};
use crate::task::source::{read_source, source_name, tasks_from_flat, SourceError};
use crate::task::{write_tasks_jsonl, Action, TaskType};

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
        let actions: Vec<Action> = g.iter().map(|r| Action::of_reply(&r.completion)).collect();
        let chosen = select_pairs(&scores, &actions, min_gap, mode);
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

/// Imports a source into `output`: `tasks.jsonl`, `pairs/{train,test}.parquet` (split by
/// conversation), `flat.parquet` (the rows as read) and `manifest.json`, so that `push_hf
/// dataset` and `dpo_train` take the directory like a `generate_conv` run.
pub async fn import(
    source: &str,
    output: &Path,
    opts: &ImportOptions,
) -> Result<ImportSummary, SourceError> {
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
    let io = |p: &Path, e: std::io::Error| SourceError::Io {
        path: p.to_path_buf(),
        source: e,
    };
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

fn write_json(path: &Path, v: &Value) -> Result<(), SourceError> {
    crate::run::write_json_atomic(path, v).map_err(|e| SourceError::Io {
        path: path.to_path_buf(),
        source: e.source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(conv: &str, turn: u32, score: f64) -> FlatRow {
        crate::task::source::tests::row(conv, turn, score, "goal")
    }

    #[test]
    fn groups_and_gaps() {
        let rows = vec![
            row("a", 0, 0.1),
            row("a", 0, 0.9),
            row("a", 0, 0.5),
            row("a", 1, 0.5),
            row("a", 1, 0.51),
            row("b", 0, 0.0),
        ];
        let (pairs, turns, without) = pairs_from_flat(&rows, 0.02, PairMode::Best);
        assert_eq!((pairs.len(), turns, without), (1, 3, 2));
        assert_eq!(pairs[0].score_chosen, 0.9);
        assert_eq!(pairs[0].rejected[0].content, "c0.1");
    }
}
