//! Clarify-or-answer: the smallest task on which the multiturn-aware reward and the
//! single-turn reward disagree, so a small model can show the CollabLLM paper's claim.
//!
//! A user asks for a short piece of writing that needs one detail: a name, a day, a time or a
//! city. Half the requests state it ("… for my friend Maya."), half leave it out ("… for my
//! friend."). The reply is right only if it uses the detail. A scripted user answers a
//! clarifying question with the detail ("My friend's name is Maya.") and ends the
//! conversation after an answer. The reward is `detail_used` (1 when the final answer uses
//! the detail) minus a cost per clarifying question (`clarifying_questions`, weight −0.3):
//!
//! - scored alone (the single-turn reward), a question is worth −0.3 and a guess 0 when the
//!   detail is missing: never ask;
//! - scored by its future (the multiturn-aware reward), a question is worth about 1 − 0.3
//!   when the detail is missing and less than a direct answer when it is given: ask exactly
//!   when the request leaves the detail out.
//!
//! Requests come from *templates* (one kind of request, worded once with the detail and once
//! without it) and the detail's values. The built-in set (`clarify:train`, `clarify:test`,
//! `clarify:all`, from `data/clarify_templates.jsonl`) holds out whole templates: the test
//! split's requests are of kinds and wordings that no training request uses (so a held-out
//! vague request is new text, not a training prompt again), with values no training request
//! names. Anyone can bring their own templates as a JSONL file: `clarify:PATH.jsonl` (every
//! template) or `clarify:PATH.jsonl#train` / `#test` (one split); see [`TemplateRow`].

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use regex::Regex;
use serde::{Deserialize, Serialize};

use super::{Task, TaskType};
use crate::llm::ChatMessage;

/// The tasks source prefix: `clarify:train`, `clarify:test`, `clarify:all`, `clarify:PATH`.
pub const SOURCE: &str = "clarify:";

/// The default weights: the detail used, less 0.3 per clarifying question.
pub const DEFAULT_WEIGHTS: &[(&str, f64)] = &[("detail_used", 1.0), ("clarifying_questions", -0.3)];

/// The cost of one clarifying question in the task reward (the default weight's magnitude).
pub const QUESTION_COST: f64 = 0.3;

/// The placeholder of the detail in a template's texts.
pub const PLACEHOLDER: &str = "{d}";

/// The built-in templates (the file form of [`TemplateRow`], one per line).
const BUILTIN: &str = include_str!("../../data/clarify_templates.jsonl");

/// Which requests. A template belongs to `train`, `test` (near transfer: held-out wordings
/// of the training templates' detail kinds) or `far` (far transfer: a detail kind no
/// training template has); `heldout` selects `test` and `far`, `all` every template.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Split {
    #[default]
    Train,
    Test,
    Far,
    Heldout,
    All,
}

impl Split {
    fn as_str(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Test => "test",
            Split::Far => "far",
            Split::Heldout => "heldout",
            Split::All => "all",
        }
    }

    fn holds(self, template_split: Split) -> bool {
        match self {
            Split::All => true,
            Split::Heldout => matches!(template_split, Split::Test | Split::Far),
            _ => self == template_split,
        }
    }
}

impl FromStr for Split {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "train" => Ok(Split::Train),
            "test" => Ok(Split::Test),
            "far" => Ok(Split::Far),
            "heldout" => Ok(Split::Heldout),
            "all" => Ok(Split::All),
            other => Err(format!(
                "`{other}`: expected train, test, far, heldout or all"
            )),
        }
    }
}

/// Where clarify-or-answer requests come from: the built-in templates or a file, and a split.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClarifySource {
    /// `None`: the built-in templates.
    pub file: Option<PathBuf>,
    pub split: Split,
}

/// The source named by a `clarify:...` tasks source; `None` for any other source.
///
/// `clarify:train|test|far|heldout|all` are the built-in templates; `clarify:PATH` every
/// template of a JSONL file and `clarify:PATH#SPLIT` one split of it.
pub fn source_split(tasks: &str) -> Option<Result<ClarifySource, String>> {
    let rest = tasks.strip_prefix(SOURCE)?;
    Some(parse_source(rest).map_err(|e| format!("--tasks {tasks}: {e}")))
}

fn parse_source(rest: &str) -> Result<ClarifySource, String> {
    if let Ok(split) = rest.parse::<Split>() {
        return Ok(ClarifySource { file: None, split });
    }
    let (path, split) = match rest.rsplit_once('#') {
        Some((p, s)) => (p, s.parse::<Split>()?),
        None => (rest, Split::All),
    };
    if !path.ends_with(".jsonl") {
        return Err(format!(
            "`{rest}`: expected train, test, far, heldout, all, or a .jsonl file of templates (PATH or PATH#split)"
        ));
    }
    Ok(ClarifySource {
        file: Some(PathBuf::from(path)),
        split,
    })
}

/// A template file that cannot be used; names the file and the line (1-based).
#[derive(Debug, thiserror::Error)]
pub enum ClarifyTemplateError {
    #[error("{}: cannot read: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: line {line}: {message}", path.display())]
    Line {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("{}: {message}", path.display())]
    File { path: PathBuf, message: String },
}

/// One line of a template file.
///
/// ```json
/// {"id": "birthday", "split": "train", "kind": "name",
///  "stated": "Write a birthday greeting for my friend {d}.",
///  "vague": "Write a birthday greeting for my friend.",
///  "user_answer": "My friend's name is {d}.", "values": ["Maya", "Liam"]}
/// ```
///
/// `stated` and `user_answer` hold the placeholder `{d}`, `vague` does not and names no
/// value; `values` is non-empty and has no repeats; `split` is `train` (the default), `test`
/// (held out: near transfer) or `far` (held out: far transfer, a detail `kind` no training
/// template has); `kind` is optional, lowercase letters and `_`. The mixed demonstrator ([`Demonstrator`]) also needs `answer` (a reply that uses
/// `{d}`), `generic` (the same reply without the detail) and optionally `question` (a short
/// clarifying question): only on the templates it demonstrates.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TemplateRow {
    pub id: String,
    #[serde(default)]
    pub split: Option<String>,
    /// The kind of detail (`name`, `day`, `time`, `city`, `date`, `code`, …): what far
    /// transfer holds out, and a stratum in reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub stated: String,
    pub vague: String,
    pub user_answer: String,
    pub values: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub question: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generic: Option<String>,
}

/// A checked template.
#[derive(Clone, Debug, PartialEq)]
pub struct Template {
    pub row: TemplateRow,
    pub split: Split,
}

impl TemplateRow {
    /// Every refusal names what is wrong; the caller adds the file and line.
    fn check(self) -> Result<Template, String> {
        let id_ok = !self.id.trim().is_empty()
            && self
                .id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-'));
        if !id_ok {
            return Err(format!(
                "`id` `{}`: use letters, digits, `_` or `-` (it names the template in task ids)",
                self.id
            ));
        }
        if let Some(kind) = &self.kind {
            if kind.is_empty() || !kind.chars().all(|c| c.is_ascii_lowercase() || c == '_') {
                return Err(format!("`kind` `{kind}`: use lowercase letters and `_`"));
            }
        }
        let split = match self.split.as_deref().unwrap_or("train") {
            "train" => Split::Train,
            "test" => Split::Test,
            "far" => Split::Far,
            other => return Err(format!("`split` `{other}`: expected train, test or far")),
        };
        for (field, text) in [("stated", &self.stated), ("user_answer", &self.user_answer)] {
            if !text.contains(PLACEHOLDER) {
                return Err(format!("`{field}` has no detail placeholder {PLACEHOLDER}"));
            }
        }
        if self.vague.trim().is_empty() {
            return Err("`vague` is empty".into());
        }
        if self.vague.contains(PLACEHOLDER) {
            return Err(format!(
                "`vague` holds the placeholder {PLACEHOLDER}: the vague request leaves the detail out"
            ));
        }
        if self.values.is_empty() {
            return Err("`values` is empty: give the detail's values".into());
        }
        let mut seen = BTreeSet::new();
        let mut ids: std::collections::BTreeMap<String, &str> = Default::default();
        for v in &self.values {
            if v.trim().is_empty() {
                return Err("`values` holds an empty value".into());
            }
            if !seen.insert(v.to_lowercase()) {
                return Err(format!("`values` repeats `{v}`"));
            }
            // A value names its requests' task ids: two that differ only in punctuation or
            // case would share one id (and count as one conversation).
            if let Some(first) = ids.insert(slug(v), v) {
                return Err(format!(
                    "`values` `{first}` and `{v}` make the same task id ({}): change one",
                    slug(v)
                ));
            }
            if uses_detail(&self.vague, v) {
                return Err(format!("`vague` names the value `{v}`"));
            }
        }
        if let Some(q) = &self.question {
            if !is_question(q) {
                return Err(
                    "`question` has no `?`: the scripted user would not see a question".into(),
                );
            }
        }
        if let Some(a) = &self.answer {
            if !a.contains(PLACEHOLDER) {
                return Err(format!("`answer` has no detail placeholder {PLACEHOLDER}"));
            }
        }
        for (field, text) in [("answer", &self.answer), ("generic", &self.generic)] {
            if text.as_deref().is_some_and(is_question) {
                return Err(format!("`{field}` has a `?`: it would count as a question"));
            }
        }
        if self
            .generic
            .as_deref()
            .is_some_and(|g| g.contains(PLACEHOLDER))
        {
            return Err(format!("`generic` holds the placeholder {PLACEHOLDER}"));
        }
        Ok(Template { row: self, split })
    }
}

/// Parses a template file's text; `path` only names it in errors.
pub fn parse_templates(path: &Path, text: &str) -> Result<Vec<Template>, ClarifyTemplateError> {
    let at = |line: usize, message: String| ClarifyTemplateError::Line {
        path: path.to_path_buf(),
        line,
        message,
    };
    let mut out: Vec<Template> = Vec::new();
    let mut ids: std::collections::HashMap<String, usize> = Default::default();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        if raw.trim().is_empty() {
            continue;
        }
        let row: TemplateRow =
            serde_json::from_str(raw).map_err(|e| at(line, format!("malformed: {e}")))?;
        let t = row.check().map_err(|m| at(line, m))?;
        if let Some(first) = ids.insert(t.row.id.clone(), line) {
            return Err(at(
                line,
                format!("`id` `{}` repeats line {first}", t.row.id),
            ));
        }
        out.push(t);
    }
    if out.is_empty() {
        return Err(ClarifyTemplateError::File {
            path: path.to_path_buf(),
            message: "no templates".into(),
        });
    }
    Ok(out)
}

/// The built-in templates.
pub fn builtin_templates() -> Vec<Template> {
    // Checked by this module's tests: the bundled file always parses.
    parse_templates(Path::new("data/clarify_templates.jsonl"), BUILTIN).unwrap_or_default()
}

/// The templates of a source (every split).
pub fn source_templates(src: &ClarifySource) -> Result<Vec<Template>, ClarifyTemplateError> {
    match &src.file {
        None => Ok(builtin_templates()),
        Some(path) => {
            let bytes = std::fs::read(path).map_err(|source| ClarifyTemplateError::Read {
                path: path.clone(),
                source,
            })?;
            let text = String::from_utf8(bytes).map_err(|e| {
                let valid = &e.as_bytes()[..e.utf8_error().valid_up_to()];
                ClarifyTemplateError::Line {
                    path: path.clone(),
                    line: 1 + valid.iter().filter(|b| **b == b'\n').count(),
                    message: "not UTF-8 text".into(),
                }
            })?;
            parse_templates(path, &text)
        }
    }
}

/// The requests of a source's split, in a fixed order: per template, per value, the stated
/// request then the vague one.
pub fn load(src: &ClarifySource) -> Result<Vec<Task>, ClarifyTemplateError> {
    let templates = source_templates(src)?;
    let tasks = tasks_of(&templates, src.split);
    if tasks.is_empty() {
        return Err(ClarifyTemplateError::File {
            path: src
                .file
                .clone()
                .unwrap_or_else(|| PathBuf::from("data/clarify_templates.jsonl")),
            message: format!("no template in split `{}`", src.split.as_str()),
        });
    }
    Ok(tasks)
}

/// The built-in requests of a split.
pub fn tasks(split: Split) -> Vec<Task> {
    tasks_of(&builtin_templates(), split)
}

fn fill(text: &str, detail: &str) -> String {
    text.replace(PLACEHOLDER, detail)
}

fn slug(value: &str) -> String {
    value
        .to_ascii_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect()
}

/// The requests of `templates` in `split`.
pub fn tasks_of(templates: &[Template], split: Split) -> Vec<Task> {
    let mut out = Vec::new();
    for t in templates.iter().filter(|t| split.holds(t.split)) {
        let r = &t.row;
        for value in &r.values {
            for stated in [true, false] {
                let mut metadata = serde_json::json!({
                    "template": r.id,
                    "request": if stated { fill(&r.stated, value) } else { r.vague.clone() },
                    "stated": stated,
                    "user_answer": fill(&r.user_answer, value),
                    "split": t.split.as_str(),
                });
                if let Some(kind) = &r.kind {
                    metadata["kind"] = serde_json::json!(kind);
                }
                // What the mixed demonstrator says, where the template gives it.
                for (key, text) in [
                    ("question", r.question.clone()),
                    ("answer", r.answer.as_ref().map(|a| fill(a, value))),
                    ("generic", r.generic.clone()),
                ] {
                    if let Some(text) = text {
                        metadata[key] = serde_json::json!(text);
                    }
                }
                out.push(Task {
                    id: format!(
                        "clarify-{}-{}-{}",
                        r.id,
                        slug(value),
                        if stated { "stated" } else { "vague" }
                    ),
                    task_type: TaskType::Clarify,
                    prompt: fill(&r.stated, value),
                    reference: value.clone(),
                    metadata,
                });
            }
        }
    }
    out
}

/// Whether a clarify task's request states the detail.
pub fn is_stated(task: &Task) -> bool {
    task.metadata["stated"].as_bool().unwrap_or(false)
}

/// A clarify task's template id (the unit that repeats across values: what intervals
/// resample).
pub fn template_of(task: &Task) -> Option<&str> {
    task.metadata["template"].as_str()
}

/// The task reward of one conversation: the detail used, less [`QUESTION_COST`] per
/// clarifying question.
pub fn task_reward(detail_used: f64, questions: f64) -> f64 {
    detail_used - QUESTION_COST * questions
}

/// The mixed demonstrator: a scripted assistant whose conversations are SFT data for a warm
/// start that explores. On a vague request it asks its short clarifying question with
/// probability `ask_rate` (then answers with the detail the user gives), otherwise answers
/// generically; on a stated request it answers with the detail, after a needless question
/// with probability `needless_ask_rate`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Demonstrator {
    pub ask_rate: f64,
    pub needless_ask_rate: f64,
}

/// The range of the demonstrator's rates: probabilities.
pub const RATE: crate::check::Range = crate::check::Range::closed(0.0, 1.0);

/// The demonstrator's question where a template gives none.
pub const DEFAULT_QUESTION: &str = "Happy to help! What detail should I include?";

impl Demonstrator {
    pub const DEFAULT: Demonstrator = Demonstrator {
        ask_rate: 0.5,
        needless_ask_rate: 0.15,
    };

    /// Both rates in [0, 1].
    pub fn validate(&self) -> Result<(), String> {
        RATE.check("--ask-rate", self.ask_rate)?;
        RATE.check("--needless-ask-rate", self.needless_ask_rate)?;
        Ok(())
    }

    /// The demonstrator's reply after `history` (which ends with a user message). Whether it
    /// asks is drawn once per conversation from `seed`, so a conversation's turns agree.
    pub fn reply(&self, task: &Task, history: &[ChatMessage], seed: u64) -> Result<String, String> {
        let asked_before = history
            .iter()
            .any(|m| m.role == "assistant" && is_question(&m.content));
        if asked_before {
            return field(task, "answer").map(str::to_string);
        }
        let rate = if is_stated(task) {
            self.needless_ask_rate
        } else {
            self.ask_rate
        };
        // Checked by `validate`; a rate that skipped it is an error here, never a panic.
        if !RATE.contains(rate) {
            return Err(format!("demonstrator rate {rate}: must be in [0, 1]"));
        }
        let ask = StdRng::seed_from_u64(seed).random_bool(rate);
        match (ask, is_stated(task)) {
            (true, _) => Ok(task.metadata["question"]
                .as_str()
                .unwrap_or(DEFAULT_QUESTION)
                .to_string()),
            (false, true) => field(task, "answer").map(str::to_string),
            (false, false) => field(task, "generic").map(str::to_string),
        }
    }
}

/// A reply that asks something: it has a question mark.
pub fn is_question(reply: &str) -> bool {
    reply.contains('?')
}

/// Whether `text` uses `detail`: its words, case ignored, as whole words, any spacing between
/// them ("2 pm" is used by "2pm" and "2 PM", not by "12 pm").
pub fn uses_detail(text: &str, detail: &str) -> bool {
    let words: Vec<String> = detail.split_whitespace().map(regex::escape).collect();
    if words.is_empty() {
        return false;
    }
    Regex::new(&format!(r"(?i)\b{}\b", words.join(r"\s*")))
        .map(|re| re.is_match(text))
        .unwrap_or(false)
}

/// The request's metadata field, or an error naming the task.
fn field<'a>(task: &'a Task, name: &str) -> Result<&'a str, String> {
    task.metadata
        .get(name)
        .and_then(|v| v.as_str())
        .ok_or_else(|| format!("clarify task {}: metadata.{name} is missing", task.id))
}

/// What the scripted user says after `history`: the request to open; the detail after a
/// clarifying question; `None` (the conversation is over) after an answer.
pub fn user_turn(task: &Task, history: &[ChatMessage]) -> Result<Option<String>, String> {
    match history.iter().rev().find(|m| m.role != "system") {
        None => field(task, "request").map(|r| Some(r.to_string())),
        Some(m) if m.role == "assistant" && is_question(&m.content) => {
            field(task, "user_answer").map(|a| Some(a.to_string()))
        }
        Some(m) if m.role == "assistant" => Ok(None),
        // A user message last: nothing new to say (never asked of a well-formed history).
        Some(_) => Ok(None),
    }
}

/// `detail_used`: 1 when the last assistant message that is not a question uses the detail;
/// 0 when it does not, or when every assistant message asks.
pub fn detail_used(task: &Task, session: &[ChatMessage]) -> f64 {
    session
        .iter()
        .rev()
        .find(|m| m.role == "assistant" && !is_question(&m.content))
        .map_or(0.0, |m| {
            if uses_detail(&m.content, &task.reference) {
                1.0
            } else {
                0.0
            }
        })
}

/// `clarifying_questions`: assistant messages of `messages` that ask.
pub fn clarifying_questions(messages: &[ChatMessage]) -> f64 {
    messages
        .iter()
        .filter(|m| m.role == "assistant" && is_question(&m.content))
        .count() as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{"id": "birthday", "stated": "Greet my friend {d}.", "vague": "Greet my friend.", "user_answer": "My friend is {d}.", "values": ["Maya", "Liam"]}"#;

    fn parse(text: &str) -> Result<Vec<Template>, ClarifyTemplateError> {
        parse_templates(Path::new("t.jsonl"), text)
    }

    #[test]
    fn the_builtin_file_parses_and_holds_out_whole_templates() {
        let all = parse_templates(Path::new("builtin"), BUILTIN).unwrap();
        assert_eq!(builtin_templates(), all);
        let (train, test): (Vec<_>, Vec<_>) = all.iter().partition(|t| t.split == Split::Train);
        let near = test.iter().filter(|t| t.split == Split::Test).count();
        let far: Vec<&&Template> = test.iter().filter(|t| t.split == Split::Far).collect();
        assert!(
            near >= 8 && far.len() >= 10,
            "{near} near, {} far",
            far.len()
        );
        // Every template names its detail's kind; far transfer holds out whole kinds: no far
        // template's kind is a training template's, and near ones use training kinds only.
        let kind = |t: &Template| t.row.kind.clone().unwrap();
        let train_kinds: BTreeSet<String> = train.iter().map(|t| kind(t)).collect();
        for t in &test {
            let k = kind(t);
            assert_eq!(
                train_kinds.contains(&k),
                t.split == Split::Test,
                "{}: kind {k}",
                t.row.id
            );
        }
        let far_kinds: BTreeSet<String> = far.iter().map(|t| kind(t)).collect();
        assert!(far_kinds.len() >= 5, "{far_kinds:?}");
        // The far templates' user answers are worded unlike any training or near one.
        let frame = |t: &Template| t.row.user_answer.replace(PLACEHOLDER, "");
        let familiar: BTreeSet<String> = all
            .iter()
            .filter(|t| t.split != Split::Far)
            .map(frame)
            .collect();
        for t in &far {
            assert!(!familiar.contains(&frame(t)), "{}", t.row.id);
        }
        // No held-out request repeats a training request's text, stated or vague.
        let train_tasks = tasks(Split::Train);
        let test_tasks = tasks(Split::Heldout);
        assert_eq!(
            test_tasks.len(),
            tasks(Split::Test).len() + tasks(Split::Far).len()
        );
        let texts = |ts: &[Task]| -> BTreeSet<String> {
            ts.iter()
                .map(|t| t.metadata["request"].as_str().unwrap().to_string())
                .collect()
        };
        assert!(texts(&train_tasks).is_disjoint(&texts(&test_tasks)));
        let vague: BTreeSet<&str> = train.iter().map(|t| t.row.vague.as_str()).collect();
        for t in &test {
            assert!(!vague.contains(t.row.vague.as_str()), "{}", t.row.id);
        }
        // Held-out values too: no held-out request names a value a training request names.
        let values = |ts: &[Task]| -> BTreeSet<String> {
            ts.iter().map(|t| t.reference.to_lowercase()).collect()
        };
        assert!(values(&train_tasks).is_disjoint(&values(&test_tasks)));
        assert_eq!(
            train_tasks.len() + test_tasks.len(),
            tasks(Split::All).len()
        );
        for ts in [&train_tasks, &test_tasks] {
            let stated = ts.iter().filter(|t| is_stated(t)).count();
            assert_eq!(2 * stated, ts.len());
            for t in ts.iter() {
                let request = t.metadata["request"].as_str().unwrap();
                assert_eq!(uses_detail(request, &t.reference), is_stated(t), "{t:?}");
            }
        }
        let ids: BTreeSet<_> = tasks(Split::All).into_iter().map(|t| t.id).collect();
        assert_eq!(
            ids.len(),
            train_tasks.len() + test_tasks.len(),
            "ids are unique"
        );
        // Every training template can be demonstrated.
        for t in &train {
            assert!(
                t.row.answer.is_some() && t.row.generic.is_some(),
                "{}",
                t.row.id
            );
        }
    }

    #[test]
    fn a_template_file_is_a_source_and_its_split_selects() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mine.jsonl");
        let held = GOOD
            .replace("birthday", "held")
            .replace(r#""values""#, r#""split": "test", "values""#);
        std::fs::write(&path, format!("{GOOD}\n\n{held}\n")).unwrap();
        let src = |s: &str| {
            source_split(&format!("clarify:{}{s}", path.display()))
                .unwrap()
                .unwrap()
        };
        assert_eq!(load(&src("")).unwrap().len(), 8);
        let train = load(&src("#train")).unwrap();
        assert_eq!(train.len(), 4);
        assert_eq!(train[0].id, "clarify-birthday-maya-stated");
        assert_eq!(train[1].metadata["request"], "Greet my friend.");
        assert_eq!(train[1].metadata["user_answer"], "My friend is Maya.");
        assert_eq!(template_of(&train[1]), Some("birthday"));
        assert!(load(&src("#test"))
            .unwrap()
            .iter()
            .all(|t| template_of(t) == Some("held")));
        assert_eq!(
            source_split("clarify:test").unwrap().unwrap(),
            ClarifySource {
                file: None,
                split: Split::Test
            }
        );
        assert!(source_split("clarify:mine.csv").unwrap().is_err());
        assert!(source_split("clarify:mine.jsonl#dev").unwrap().is_err());
        assert!(source_split("data/math.jsonl").is_none());
        let missing = load(&source_split("clarify:/no/such.jsonl").unwrap().unwrap());
        assert!(missing.unwrap_err().to_string().contains("/no/such.jsonl"));
        std::fs::write(&path, format!("{GOOD}\n")).unwrap();
        let err = load(&src("#test")).unwrap_err().to_string();
        assert!(err.contains("no template in split `test`"), "{err}");
        let mut latin1 = format!("{GOOD}\n").into_bytes();
        latin1.extend_from_slice(b"{\"id\": \"caf\xe9\"}\n");
        std::fs::write(&path, latin1).unwrap();
        let err = load(&src("")).unwrap_err().to_string();
        assert!(err.ends_with("line 2: not UTF-8 text"), "{err}");
    }

    #[test]
    fn bad_templates_are_refused_naming_the_line() {
        let cases = [
            (
                GOOD.replace("friend {d}.", "friend."),
                "`stated` has no detail placeholder",
            ),
            (
                GOOD.replace("is {d}.", "is here."),
                "`user_answer` has no detail placeholder",
            ),
            (
                GOOD.replace("\"Greet my friend.\"", "\"Greet my friend {d}.\""),
                "`vague` holds the placeholder",
            ),
            (
                GOOD.replace("[\"Maya\", \"Liam\"]", "[]"),
                "`values` is empty",
            ),
            (
                GOOD.replace("\"Liam\"", "\"maya\""),
                "`values` repeats `maya`",
            ),
            (
                GOOD.replace("\"Liam\"", "\"friend\""),
                "`vague` names the value `friend`",
            ),
            (
                GOOD.replace("[\"Maya\", \"Liam\"]", "[\"Mary Ann\", \"Mary_Ann\"]"),
                "`values` `Mary Ann` and `Mary_Ann` make the same task id (mary-ann)",
            ),
            (GOOD.replace("\"birthday\"", "\"a b\""), "`id` `a b`"),
            (
                GOOD.replace("\"values\"", "\"split\": \"dev\", \"values\""),
                "`split` `dev`",
            ),
            (
                GOOD.replace("\"values\"", "\"valuse\": [], \"values\""),
                "unknown field `valuse`",
            ),
            (
                GOOD.replace("\"values\"", "\"question\": \"Who.\", \"values\""),
                "`question` has no `?`",
            ),
            (
                GOOD.replace("\"values\"", "\"generic\": \"Hi {d}.\", \"values\""),
                "`generic` holds the placeholder",
            ),
            (
                GOOD.replace("\"values\"", "\"answer\": \"Hi, {d}?\", \"values\""),
                "`answer` has a `?`",
            ),
        ];
        for (line, want) in cases {
            let err = parse(&format!("{GOOD}\n{line}\n")).unwrap_err().to_string();
            assert!(err.starts_with("t.jsonl: line 2: "), "{err}");
            assert!(err.contains(want), "{err} (wanted {want})");
        }
        let err = parse(&format!("{GOOD}\n{GOOD}\n")).unwrap_err().to_string();
        assert_eq!(err, "t.jsonl: line 2: `id` `birthday` repeats line 1");
        assert!(parse("\n\n")
            .unwrap_err()
            .to_string()
            .contains("no templates"));
        assert!(parse("{")
            .unwrap_err()
            .to_string()
            .contains("line 1: malformed"));
    }

    #[test]
    fn the_mixed_demonstrator_asks_at_its_rates() {
        let d = Demonstrator {
            ask_rate: 0.6,
            needless_ask_rate: 0.2,
        };
        let train = tasks(Split::Train);
        let (mut asked, mut n) = ([0usize; 2], [0usize; 2]);
        for (i, t) in train.iter().enumerate() {
            for rep in 0..20u64 {
                let h = vec![ChatMessage::user(t.metadata["request"].as_str().unwrap())];
                let first = d.reply(t, &h, (i as u64) << 8 | rep).unwrap();
                let k = usize::from(is_stated(t));
                n[k] += 1;
                if is_question(&first) {
                    asked[k] += 1;
                    // After the user's answer it answers with the detail.
                    let mut h = h.clone();
                    h.push(ChatMessage::assistant(first));
                    h.push(ChatMessage::user(user_turn(t, &h).unwrap().unwrap()));
                    let second = d.reply(t, &h, 7).unwrap();
                    assert!(
                        !is_question(&second) && uses_detail(&second, &t.reference),
                        "{second}"
                    );
                } else {
                    assert_eq!(uses_detail(&first, &t.reference), is_stated(t), "{first}");
                }
            }
        }
        let rate = |k: usize| asked[k] as f64 / n[k] as f64;
        // 1540 draws each: 4 standard errors is about ±0.05.
        assert!((rate(0) - 0.6).abs() < 0.05, "vague {}", rate(0));
        assert!((rate(1) - 0.2).abs() < 0.05, "stated {}", rate(1));
        // The same seed gives the same choice; the rates are checked.
        let t = &train[1];
        let h = [ChatMessage::user("x")];
        assert_eq!(d.reply(t, &h, 5), d.reply(t, &h, 5));
        assert!(Demonstrator {
            ask_rate: 1.5,
            needless_ask_rate: 0.0
        }
        .validate()
        .is_err());
        assert!(Demonstrator {
            ask_rate: f64::NAN,
            needless_ask_rate: 0.0
        }
        .validate()
        .is_err());
        // An unchecked rate is an error at the reply, not a panic.
        let vague = train.iter().find(|t| !is_stated(t)).unwrap();
        let bad = Demonstrator {
            ask_rate: f64::NAN,
            needless_ask_rate: 0.0,
        };
        assert!(bad
            .reply(vague, &h, 1)
            .unwrap_err()
            .contains("must be in [0, 1]"));
        // A held-out template has nothing to demonstrate with: an error, not a panic.
        let held = tasks(Split::Test).into_iter().find(is_stated).unwrap();
        let never = Demonstrator {
            ask_rate: 0.0,
            needless_ask_rate: 0.0,
        };
        assert!(never
            .reply(&held, &h, 1)
            .unwrap_err()
            .contains("metadata.answer"));
    }

    #[test]
    fn the_task_reward_charges_each_question() {
        assert_eq!(task_reward(1.0, 0.0), 1.0);
        assert!((task_reward(1.0, 1.0) - 0.7).abs() < 1e-12);
        assert!((task_reward(0.0, 2.0) + 0.6).abs() < 1e-12);
    }

    #[test]
    fn details_match_as_whole_words_with_any_spacing() {
        assert!(uses_detail("Lands at 2pm, see you", "2 pm"));
        assert!(uses_detail("Lands at 2 PM.", "2 pm"));
        assert!(!uses_detail("Lands at 12 pm.", "2 pm"));
        assert!(uses_detail("Happy birthday, maya!", "Maya"));
        assert!(!uses_detail("Happy birthday, Mayall!", "Maya"));
    }

    #[test]
    fn the_scripted_user_answers_questions_and_ends_after_an_answer() {
        let t = tasks(Split::Train)
            .into_iter()
            .find(|t| !is_stated(t))
            .unwrap();
        let opening = user_turn(&t, &[]).unwrap().unwrap();
        assert_eq!(opening, t.metadata["request"].as_str().unwrap());
        let mut h = vec![ChatMessage::user(opening)];
        h.push(ChatMessage::assistant("Sure! What's the name?"));
        let answer = user_turn(&t, &h).unwrap().unwrap();
        assert!(uses_detail(&answer, &t.reference));
        h.push(ChatMessage::user(answer));
        h.push(ChatMessage::assistant(format!(
            "Happy birthday, {}!",
            t.reference
        )));
        assert_eq!(user_turn(&t, &h).unwrap(), None);
        assert_eq!(detail_used(&t, &h), 1.0);
        assert_eq!(clarifying_questions(&h), 1.0);
        // The question alone is no answer; an answer without the detail scores 0.
        assert_eq!(detail_used(&t, &h[..2]), 0.0);
        let guess = [
            h[0].clone(),
            ChatMessage::assistant("Happy birthday, friend!"),
        ];
        assert_eq!(detail_used(&t, &guess), 0.0);
    }
}
