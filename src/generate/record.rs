//! `conversations.jsonl`: one line per finished task with everything needed to re-score it
//! without a model call. Append-only; a line torn by a crash is cut off before appending.

use std::collections::{BTreeMap, HashSet};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::llm::{ChatMessage, FinishReason, UsageSnapshot};
pub use crate::rollout::futures::SessionRecord;
use crate::rollout::user::UserTurn;
use crate::task::TaskType;

#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("{path}: {message}")]
    Io { path: PathBuf, message: String },
    #[error("{path}:{line}: not a conversation record: {message}")]
    Malformed {
        path: PathBuf,
        line: usize,
        message: String,
    },
}

/// How a candidate was prompted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Variant {
    /// With the proactive-collaborator system prompt.
    Proactive,
    /// The plain chat.
    Plain,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CandidateRecord {
    pub index: usize,
    pub variant: Variant,
    pub text: String,
    pub finish_reason: FinishReason,
    /// MR under the weights the run used when it chose the continuation.
    pub mr: Option<f64>,
    pub sessions: Vec<SessionRecord>,
}

impl CandidateRecord {
    /// Per-session metric values, as the MR formulas take them.
    pub fn session_scores(&self) -> Vec<crate::reward::mr::SessionScores> {
        self.sessions.iter().map(SessionRecord::values).collect()
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TurnRecord {
    pub turn_id: u32,
    /// The real conversation before the candidates (ends with a user message).
    pub history: Vec<ChatMessage>,
    pub candidates: Vec<CandidateRecord>,
    /// Index of the candidate appended to the real conversation.
    pub chosen: usize,
    /// The real next user message (an independent simulator sample on history + chosen).
    pub next_user: Option<UserTurn>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ConversationRecord {
    pub task_id: String,
    pub task_type: TaskType,
    pub goal: String,
    pub reference: String,
    #[serde(default)]
    pub metadata: serde_json::Value,
    pub first_user: UserTurn,
    pub turns: Vec<TurnRecord>,
    /// The final real conversation.
    pub messages: Vec<ChatMessage>,
    /// `user_terminated` or `max_messages`.
    pub ended_by: String,
    /// Weights used while generating (to pick the continuation).
    pub weights: BTreeMap<String, f64>,
    pub started_at: f64,
    pub finished_at: f64,
    /// Model calls made for this conversation, per role (retries and cache hits included).
    /// Absent in records written before it existed.
    #[serde(default)]
    pub usage: BTreeMap<String, UsageSnapshot>,
}

/// The append-only conversations file of a run directory.
pub struct ConversationLog {
    path: PathBuf,
    file: std::fs::File,
}

pub const CONVERSATIONS_FILE: &str = "conversations.jsonl";

impl ConversationLog {
    /// Opens (creating) `<dir>/conversations.jsonl`, cutting off a torn last line so the next
    /// append starts on a fresh line. Returns the log and the records already in it (first
    /// record of a task id wins).
    pub fn open(dir: &Path) -> Result<(Self, Vec<ConversationRecord>), RecordError> {
        let path = dir.join(CONVERSATIONS_FILE);
        let io = |e: std::io::Error| RecordError::Io {
            path: path.clone(),
            message: e.to_string(),
        };
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(&path)
            .map_err(io)?;
        let mut text = String::new();
        file.read_to_string(&mut text).map_err(io)?;
        if !text.is_empty() && !text.ends_with('\n') {
            let keep = text.rfind('\n').map_or(0, |i| i + 1);
            tracing::warn!(
                file = %path.display(),
                bytes = text.len() - keep,
                "cutting off a torn last record (the previous run was interrupted mid-write)"
            );
            file.set_len(keep as u64).map_err(io)?;
            text.truncate(keep);
        }
        file.seek(SeekFrom::End(0)).map_err(io)?;
        let records = parse_records(&path, &text)?;
        Ok((Self { path, file }, records))
    }

    /// Appends one record as one line and syncs it to disk.
    pub fn append(&mut self, rec: &ConversationRecord) -> Result<(), RecordError> {
        let io = |e: std::io::Error| RecordError::Io {
            path: self.path.clone(),
            message: e.to_string(),
        };
        let mut line = serde_json::to_string(rec).map_err(|e| RecordError::Io {
            path: self.path.clone(),
            message: e.to_string(),
        })?;
        line.push('\n');
        self.file.write_all(line.as_bytes()).map_err(io)?;
        self.file.sync_data().map_err(io)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Reads `conversations.jsonl` without opening it for writing (re-scoring).
pub fn read_records(dir: &Path) -> Result<Vec<ConversationRecord>, RecordError> {
    let path = dir.join(CONVERSATIONS_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| RecordError::Io {
        path: path.clone(),
        message: e.to_string(),
    })?;
    // A torn last line is an interrupted write, not data.
    let complete = match text.rfind('\n') {
        Some(i) => &text[..=i],
        None => "",
    };
    parse_records(&path, complete)
}

fn parse_records(path: &Path, text: &str) -> Result<Vec<ConversationRecord>, RecordError> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let rec: ConversationRecord =
            serde_json::from_str(line).map_err(|e| RecordError::Malformed {
                path: path.to_path_buf(),
                line: i + 1,
                message: e.to_string(),
            })?;
        if seen.insert(rec.task_id.clone()) {
            out.push(rec);
        }
    }
    Ok(out)
}

pub fn now_secs() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}
