//! PLACEHOLDER until the dataset branch lands (same public API).
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskType {
    Math,
    DocEdit,
    Code,
    TwentyQuestions,
}

impl TaskType {
    pub fn as_str(&self) -> &'static str {
        match self {
            TaskType::Math => "math",
            TaskType::DocEdit => "doc_edit",
            TaskType::Code => "code",
            TaskType::TwentyQuestions => "twenty_questions",
        }
    }
}

impl std::fmt::Display for TaskType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Task {
    pub id: String,
    pub task_type: TaskType,
    pub prompt: String,
    pub reference: String,
    #[serde(default)]
    pub metadata: serde_json::Value,
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TaskError(pub String);

pub fn load_tasks(path: &std::path::Path) -> Result<Vec<Task>, TaskError> {
    let text = std::fs::read_to_string(path).map_err(|e| TaskError(format!("{}: {e}", path.display())))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l)
                .map_err(|e| TaskError(format!("{}:{}: {e}", path.display(), i + 1)))
        })
        .collect()
}
