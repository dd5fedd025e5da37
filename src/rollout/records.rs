//! `conversations.jsonl`: one line per finished task with everything needed to re-score it
//! without a model call. Append-only; a line torn by a crash is cut off before appending.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::llm::{ChatMessage, FinishReason, UsageSnapshot};
pub use crate::rollout::futures::SessionRecord;
use crate::rollout::user::UserTurn;
use crate::run::{read_log, AppendLog, LogError};
use crate::task::TaskType;

#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}:{line}: not a conversation record: {message}")]
    Malformed {
        path: PathBuf,
        line: usize,
        message: String,
    },
}

impl From<LogError> for RecordError {
    fn from(e: LogError) -> Self {
        match e {
            LogError::Io { path, source } => RecordError::Io { path, source },
            LogError::Malformed {
                path,
                line,
                message,
            } => RecordError::Malformed {
                path,
                line,
                message,
            },
        }
    }
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
pub struct ConversationLog(AppendLog<ConversationRecord>);

pub const CONVERSATIONS_FILE: &str = "conversations.jsonl";

impl ConversationLog {
    /// Opens (creating) `<dir>/conversations.jsonl`, cutting off a torn last line so the next
    /// append starts on a fresh line. Returns the log and the records already in it (first
    /// record of a task id wins).
    pub fn open(dir: &Path) -> Result<(Self, Vec<ConversationRecord>), RecordError> {
        let (log, records) = AppendLog::open(&dir.join(CONVERSATIONS_FILE))?;
        Ok((Self(log), first_per_task(records)))
    }

    /// Appends one record as one line and syncs it to disk.
    pub fn append(&mut self, rec: &ConversationRecord) -> Result<(), RecordError> {
        Ok(self.0.append(rec)?)
    }

    pub fn path(&self) -> &Path {
        self.0.path()
    }
}

/// Reads `conversations.jsonl` without opening it for writing (re-scoring); a torn last line
/// is an interrupted write, not data.
pub fn read_records(dir: &Path) -> Result<Vec<ConversationRecord>, RecordError> {
    Ok(first_per_task(read_log(&dir.join(CONVERSATIONS_FILE))?))
}

fn first_per_task(records: Vec<ConversationRecord>) -> Vec<ConversationRecord> {
    let mut seen = HashSet::new();
    records
        .into_iter()
        .filter(|r| seen.insert(r.task_id.clone()))
        .collect()
}

pub use crate::run::now_secs;
