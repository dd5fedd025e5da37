//! What a task type is: its name, and every fact the pipeline needs about it — who plays the
//! user, which template that user reads, the default reward weights, the metric that says
//! whether the task was done and what evaluation reports beside it — in one table,
//! [`TaskType::facts`]. Adding a task type is a row here, its prompt file, its metric, and
//! (for a new way of playing the user) its player.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The kind of task, which decides the metrics and the user-simulator prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskType {
    Math,
    DocEdit,
    Code,
    TwentyQuestions,
    /// Clarify-or-answer ([`super::clarify`]): a request that may leave out the one detail
    /// the reply needs.
    Clarify,
}

/// The task type of a run that names none: math, as the bundled default tasks
/// (`data/math.jsonl`) and upstream's examples.
impl Default for TaskType {
    fn default() -> Self {
        TaskType::Math
    }
}

/// Who answers the assistant in a conversation of this type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UserKind {
    /// An LLM simulated user, prompted with the hidden goal (CollabLLM's user simulator).
    Simulated,
    /// A game oracle that answers yes/no questions about a hidden object (20 Questions): the
    /// conversation is a game with a question budget.
    Oracle,
    /// A scripted user that answers with the one detail a request left out
    /// ([`super::clarify`]).
    Scripted,
}

/// What a reply does to the conversation: asks the user something, or answers. Action-contrast
/// preference pairs (`--pairs contrast`) pair replies that differ in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    Ask,
    Answer,
}

impl Action {
    /// A dialogue reply's action: one that asks something has a question mark.
    pub fn of_reply(reply: &str) -> Action {
        if super::clarify::is_question(reply) {
            Action::Ask
        } else {
            Action::Answer
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Action::Ask => "ask",
            Action::Answer => "answer",
        }
    }
}

/// The facts of one task type.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TaskFacts {
    /// The snake_case name used in files and on the command line.
    pub name: &'static str,
    /// Words that mark a dataset's name as holding this type (flat imports without a
    /// `task_type` in their metadata).
    pub dataset_name_hints: &'static [&'static str],
    pub user: UserKind,
    /// The user-simulator template under `prompts/`.
    pub user_template: &'static str,
    /// The simulated user sees the reference (doc_edit: the target document).
    pub user_sees_reference: bool,
    /// Default metric weights of the multiturn-aware reward.
    pub default_weights: &'static [(&'static str, f64)],
    /// The metric that says whether the task was done (reported first); `None`: the game's
    /// own success measures.
    pub task_metric: Option<&'static str>,
    /// Second views of the task metric, reported right after it.
    pub task_metric_companions: &'static [&'static str],
    /// The per-conversation measure of how the assistant engaged the user, beside the task
    /// metric in evaluation.
    pub interaction_metric: &'static str,
    /// The built-in task source evaluation uses when none is given (else
    /// `data/<name>.jsonl`).
    pub builtin_eval_tasks: Option<&'static str>,
    /// A built-in competent player exists (`eval_multiturn --model demonstrator`).
    pub has_demonstrator: bool,
}

const MATH: TaskFacts = TaskFacts {
    name: "math",
    dataset_name_hints: &["math"],
    user: UserKind::Simulated,
    user_template: "user_math.j2",
    user_sees_reference: false,
    default_weights: &[
        ("accuracy", 1.0),
        ("interactivity", 1.0),
        ("token_amount", -0.1),
    ],
    task_metric: Some("accuracy"),
    task_metric_companions: &["accuracy_disagree"],
    interaction_metric: "interactivity",
    builtin_eval_tasks: None,
    has_demonstrator: false,
};

const DOC_EDIT: TaskFacts = TaskFacts {
    name: "doc_edit",
    dataset_name_hints: &["medium", "doc"],
    user: UserKind::Simulated,
    user_template: "user_doc_edit.j2",
    user_sees_reference: true,
    default_weights: &[("bleu", 1.0), ("token_amount", -0.1)],
    task_metric: Some("bleu"),
    task_metric_companions: &["bleu_char"],
    interaction_metric: "interactivity",
    builtin_eval_tasks: None,
    has_demonstrator: false,
};

const CODE: TaskFacts = TaskFacts {
    name: "code",
    dataset_name_hints: &["code"],
    user: UserKind::Simulated,
    user_template: "user_code.j2",
    user_sees_reference: false,
    default_weights: &[("pass_rate", 1.0), ("token_amount", -0.5)],
    task_metric: Some("pass_rate"),
    task_metric_companions: &[],
    interaction_metric: "interactivity",
    builtin_eval_tasks: None,
    has_demonstrator: false,
};

const TWENTY_QUESTIONS: TaskFacts = TaskFacts {
    name: "twenty_questions",
    dataset_name_hints: &["20q", "twenty"],
    user: UserKind::Oracle,
    user_template: "user_base.j2",
    user_sees_reference: false,
    default_weights: super::twenty_questions::DEFAULT_WEIGHTS,
    task_metric: None,
    task_metric_companions: &[],
    interaction_metric: "interactivity",
    builtin_eval_tasks: None,
    has_demonstrator: true,
};

const CLARIFY: TaskFacts = TaskFacts {
    name: "clarify",
    dataset_name_hints: &["clarify"],
    user: UserKind::Scripted,
    user_template: "user_base.j2",
    user_sees_reference: false,
    default_weights: super::clarify::DEFAULT_WEIGHTS,
    task_metric: Some("detail_used"),
    task_metric_companions: &[
        "task_reward",
        "detail_used_stated",
        "detail_used_vague",
        "clarifying_questions",
        "asked_stated",
        "asked_vague",
        "repeated_question",
    ],
    // Scored by rule: the questions asked, not a judge's interactivity.
    interaction_metric: "clarifying_questions",
    // The held-out requests: no training source ever names their details.
    builtin_eval_tasks: Some("clarify:test"),
    has_demonstrator: true,
};

impl TaskType {
    pub const ALL: [TaskType; 5] = [
        TaskType::Math,
        TaskType::DocEdit,
        TaskType::Code,
        TaskType::TwentyQuestions,
        TaskType::Clarify,
    ];

    /// Everything the pipeline needs to know about this type.
    pub fn facts(self) -> &'static TaskFacts {
        match self {
            TaskType::Math => &MATH,
            TaskType::DocEdit => &DOC_EDIT,
            TaskType::Code => &CODE,
            TaskType::TwentyQuestions => &TWENTY_QUESTIONS,
            TaskType::Clarify => &CLARIFY,
        }
    }

    /// The snake_case name used in files and on the command line.
    pub fn as_str(self) -> &'static str {
        self.facts().name
    }

    /// Conversations of this type are games against an oracle (20 Questions), not dialogues
    /// with a simulated user.
    pub fn is_game(self) -> bool {
        self.facts().user == UserKind::Oracle
    }

    /// What `reply` does, by this type's question detector: in a dialogue a reply that asks
    /// something has a question mark (clarify's scripted user answers exactly those); every
    /// 20 Questions move is a question.
    pub fn action_of(self, reply: &str) -> Action {
        if self.is_game() {
            Action::Ask
        } else {
            Action::of_reply(reply)
        }
    }

    /// `"math, doc_edit, code, twenty_questions, clarify"`.
    pub fn valid_names() -> String {
        Self::ALL.map(Self::as_str).join(", ")
    }

    /// The type a dataset's name suggests (`…-math-…`, `…-medium…`/`doc`, `…code…`), if any.
    pub fn from_dataset_name(name: &str) -> Option<TaskType> {
        let n = name.to_ascii_lowercase();
        Self::ALL.into_iter().find(|t| {
            t.facts()
                .dataset_name_hints
                .iter()
                .any(|hint| n.contains(hint))
        })
    }
}

impl fmt::Display for TaskType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The error of [`TaskType::from_str`]: the rejected text.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown task type `{0}` (valid: {names})", names = TaskType::valid_names())]
pub struct UnknownTaskType(pub String);

impl FromStr for TaskType {
    type Err = UnknownTaskType;
    /// Exact snake_case names, ignoring surrounding whitespace and ASCII case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim().to_ascii_lowercase();
        Self::ALL
            .into_iter()
            .find(|k| k.as_str() == t)
            .ok_or_else(|| UnknownTaskType(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_has_its_own_name_and_a_weighted_reward() {
        let mut names: Vec<&str> = TaskType::ALL.map(TaskType::as_str).to_vec();
        names.dedup();
        assert_eq!(names.len(), TaskType::ALL.len());
        for t in TaskType::ALL {
            assert!(!t.facts().default_weights.is_empty(), "{t}");
            assert_eq!(t.as_str().parse::<TaskType>().unwrap(), t);
        }
    }

    #[test]
    fn dataset_names_suggest_types_as_before() {
        for (name, want) in [
            ("collabllm-multiturn-math-hard", Some(TaskType::Math)),
            ("collabllm-multiturn-medium", Some(TaskType::DocEdit)),
            ("bigcodebench", Some(TaskType::Code)),
            ("lmrl-20q", Some(TaskType::TwentyQuestions)),
            ("something-else", None),
        ] {
            assert_eq!(TaskType::from_dataset_name(name), want, "{name}");
        }
    }
}
