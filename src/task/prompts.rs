//! Prompt templates as files (`prompts/*.j2`, minijinja). The repository's copies are built
//! into the binary; `--prompts DIR` replaces them with a folder of the same file names. Every
//! template is checked at start-up: a variable a template uses but the pipeline does not
//! provide is an error before any model call, never a blank in the middle of a run.

use std::collections::BTreeSet;
use std::path::Path;

use minijinja::Environment;
use serde::{Deserialize, Serialize};

use super::TaskType;
use crate::llm::ChatMessage;

/// (file name, built-in text, variables the pipeline provides to it).
const PROMPTS: &[(&str, &str, &[&str])] = &[
    (
        "user_base.j2",
        include_str!("../../prompts/user_base.j2"),
        USER_VARS,
    ),
    (
        "user_math.j2",
        include_str!("../../prompts/user_math.j2"),
        USER_VARS,
    ),
    (
        "user_doc_edit.j2",
        include_str!("../../prompts/user_doc_edit.j2"),
        USER_VARS,
    ),
    (
        "user_code.j2",
        include_str!("../../prompts/user_code.j2"),
        USER_VARS,
    ),
    (
        "assistant_proactive.j2",
        include_str!("../../prompts/assistant_proactive.j2"),
        &["task_type"],
    ),
    (
        "assistant_proactive_json.j2",
        include_str!("../../prompts/assistant_proactive_json.j2"),
        &["conversation", "task_type", "max_tokens"],
    ),
    (
        "judge_accuracy.j2",
        include_str!("../../prompts/judge_accuracy.j2"),
        &["goal", "reference", "conversation", "json"],
    ),
    (
        "judge_interactivity.j2",
        include_str!("../../prompts/judge_interactivity.j2"),
        &["conversation", "json", "scale", "aspect"],
    ),
    (
        "extract_document.j2",
        include_str!("../../prompts/extract_document.j2"),
        &["goal", "conversation"],
    ),
    (
        "extract_code.j2",
        include_str!("../../prompts/extract_code.j2"),
        &["goal", "conversation"],
    ),
    (
        "twenty_questions_questioner.j2",
        include_str!("../../prompts/twenty_questions_questioner.j2"),
        &["history", "questions_left", "max_questions"],
    ),
    (
        "twenty_questions_oracle.j2",
        include_str!("../../prompts/twenty_questions_oracle.j2"),
        &["object", "names", "question"],
    ),
];

const USER_VARS: &[&str] = &[
    "goal",
    "reference",
    "show_reference",
    "task_type",
    "conversation",
    "termination",
    "json",
];

#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    #[error("prompt {file}: {message}")]
    Invalid { file: String, message: String },
    #[error("prompt {file} uses unknown variable(s) {unknown:?}; available: {available:?}")]
    UnknownVariables {
        file: String,
        unknown: Vec<String>,
        available: Vec<String>,
    },
    #[error("prompt {file} failed to render: {message}")]
    Render { file: String, message: String },
}

/// Which prompt to render.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prompt {
    User(TaskType),
    /// The proactive system prompt (local policies).
    Proactive,
    /// Upstream's proactive instruction: one user message holding the conversation, asking for
    /// `{current_problem, thought, response}` JSON (endpoint policies).
    ProactiveJson,
    JudgeAccuracy,
    JudgeInteractivity,
    ExtractDocument,
    ExtractCode,
    /// 20 Questions: the model questioner's next question.
    TwentyQuestionsQuestioner,
    /// 20 Questions: the LLM oracle's yes/no answer.
    TwentyQuestionsOracle,
}

impl Prompt {
    pub fn file(self) -> &'static str {
        match self {
            Prompt::User(task_type) => task_type.facts().user_template,
            Prompt::Proactive => "assistant_proactive.j2",
            Prompt::ProactiveJson => "assistant_proactive_json.j2",
            Prompt::JudgeAccuracy => "judge_accuracy.j2",
            Prompt::JudgeInteractivity => "judge_interactivity.j2",
            Prompt::ExtractDocument => "extract_document.j2",
            Prompt::ExtractCode => "extract_code.j2",
            Prompt::TwentyQuestionsQuestioner => "twenty_questions_questioner.j2",
            Prompt::TwentyQuestionsOracle => "twenty_questions_oracle.j2",
        }
    }
}

/// The compiled, validated prompt set.
pub struct Prompts {
    env: Environment<'static>,
    /// Where the templates came from (`built-in` or a directory), for manifests.
    pub source: String,
}

impl std::fmt::Debug for Prompts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prompts")
            .field("source", &self.source)
            .finish()
    }
}

impl Prompts {
    /// The templates built into the binary.
    pub fn builtin() -> Result<Self, PromptError> {
        Self::build(
            PROMPTS
                .iter()
                .map(|(f, text, _)| (f.to_string(), text.to_string()))
                .collect(),
            "built-in".into(),
        )
    }

    /// The templates of `dir` (every file of the built-in set must be there).
    pub fn from_dir(dir: &Path) -> Result<Self, PromptError> {
        let mut files = Vec::new();
        for (name, _, _) in PROMPTS {
            let path = dir.join(name);
            let text = std::fs::read_to_string(&path).map_err(|e| PromptError::Invalid {
                file: path.display().to_string(),
                message: e.to_string(),
            })?;
            files.push((name.to_string(), text));
        }
        Self::build(files, dir.display().to_string())
    }

    fn build(files: Vec<(String, String)>, source: String) -> Result<Self, PromptError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_undefined_behavior(minijinja::UndefinedBehavior::Strict);
        for (name, text) in files {
            env.add_template_owned(name.clone(), text)
                .map_err(|e| PromptError::Invalid {
                    file: name.clone(),
                    message: e.to_string(),
                })?;
        }
        for (name, _, allowed) in PROMPTS {
            let tmpl = env.get_template(name).map_err(|e| PromptError::Invalid {
                file: name.to_string(),
                message: e.to_string(),
            })?;
            let used: BTreeSet<String> = tmpl.undeclared_variables(false).into_iter().collect();
            let unknown: Vec<String> = used
                .iter()
                .filter(|v| !allowed.contains(&v.as_str()))
                .cloned()
                .collect();
            if !unknown.is_empty() {
                return Err(PromptError::UnknownVariables {
                    file: format!("{source}/{name}"),
                    unknown,
                    available: allowed.iter().map(|s| s.to_string()).collect(),
                });
            }
        }
        Ok(Self { env, source })
    }

    pub fn render(&self, prompt: Prompt, ctx: impl Serialize) -> Result<String, PromptError> {
        let file = prompt.file();
        let tmpl = self
            .env
            .get_template(file)
            .map_err(|e| PromptError::Render {
                file: file.into(),
                message: e.to_string(),
            })?;
        tmpl.render(ctx)
            .map(|s| s.trim().to_string())
            .map_err(|e| PromptError::Render {
                file: file.into(),
                message: e.to_string(),
            })
    }
}

/// Plain-text transcript of a conversation for judges and the simulator ("User: …").
/// A system prompt given on the command line: `proactive` (the collaborative prompt of
/// `prompts/assistant_proactive.j2` for the task type) or a text file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "String", from = "String")]
pub enum SystemPromptSource {
    Proactive,
    File(std::path::PathBuf),
}

impl From<String> for SystemPromptSource {
    fn from(s: String) -> Self {
        if s.trim() == "proactive" {
            SystemPromptSource::Proactive
        } else {
            SystemPromptSource::File(s.into())
        }
    }
}

impl From<SystemPromptSource> for String {
    fn from(s: SystemPromptSource) -> String {
        match s {
            SystemPromptSource::Proactive => "proactive".into(),
            SystemPromptSource::File(p) => p.display().to_string(),
        }
    }
}

impl std::str::FromStr for SystemPromptSource {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(s.to_string().into())
    }
}

impl SystemPromptSource {
    /// The text: the proactive template rendered for `task_type`, or the file's contents
    /// (which must not be empty).
    pub fn text(&self, prompts: &Prompts, task_type: TaskType) -> Result<String, PromptError> {
        match self {
            SystemPromptSource::Proactive => prompts.render(
                Prompt::Proactive,
                serde_json::json!({"task_type": task_type.to_string()}),
            ),
            SystemPromptSource::File(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| PromptError::Invalid {
                    file: path.display().to_string(),
                    message: format!("cannot read the system prompt: {e}"),
                })?;
                if text.trim().is_empty() {
                    return Err(PromptError::Invalid {
                        file: path.display().to_string(),
                        message: "the system prompt file is empty".into(),
                    });
                }
                Ok(text.trim_end().to_string())
            }
        }
    }
}

pub fn transcript(messages: &[ChatMessage]) -> String {
    messages
        .iter()
        .filter(|m| m.role != "system")
        .map(|m| {
            let who = if m.role == "assistant" {
                "Assistant"
            } else {
                "User"
            };
            format!("{who}: {}", m.content.trim())
        })
        .collect::<Vec<_>>()
        .join("\n\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_prompts_validate_and_render() {
        let p = Prompts::builtin().unwrap();
        let out = p
            .render(
                Prompt::User(TaskType::Math),
                serde_json::json!({"goal": "G", "reference": "R", "show_reference": false,
                    "task_type": "math", "conversation": "", "termination": "[[T]]", "json": false}),
            )
            .unwrap();
        assert!(
            out.contains("<goal>\nG\n</goal>") && out.contains("[[T]]"),
            "{out}"
        );
        assert!(
            out.contains("final numeric answer"),
            "task hints come from user_math.j2"
        );
        assert!(!out.contains("target_document"));
    }

    #[test]
    fn unknown_variable_is_a_startup_error() {
        let dir = tempfile::tempdir().unwrap();
        for (name, text, _) in PROMPTS {
            std::fs::write(dir.path().join(name), text).unwrap();
        }
        std::fs::write(
            dir.path().join("judge_interactivity.j2"),
            "Rate {{ conversation }} for {{ user_name }}",
        )
        .unwrap();
        let err = Prompts::from_dir(dir.path()).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("judge_interactivity.j2") && msg.contains("user_name"),
            "{msg}"
        );
    }
}
