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
//! Tasks are built in (`clarify:train`, `clarify:test`, `clarify:all`): every template with
//! every value of its detail's pool, stated and left out. Train and test use disjoint values,
//! so held-out requests name people, days, times and cities no training request named.

use std::str::FromStr;

use regex::Regex;
use serde::{Deserialize, Serialize};

use super::{Task, TaskType};
use crate::llm::ChatMessage;

/// The tasks source of the built-in requests: `clarify:train`, `clarify:test`, `clarify:all`.
pub const SOURCE: &str = "clarify:";

/// The default weights: the detail used, less 0.3 per clarifying question.
pub const DEFAULT_WEIGHTS: &[(&str, f64)] = &[("detail_used", 1.0), ("clarifying_questions", -0.3)];

/// Which requests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Split {
    #[default]
    Train,
    Test,
    All,
}

impl FromStr for Split {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "train" => Ok(Split::Train),
            "test" => Ok(Split::Test),
            "all" => Ok(Split::All),
            other => Err(format!("`{other}`: expected train, test or all")),
        }
    }
}

/// The split named by a `clarify:<split>` tasks source; `None` for any other source.
pub fn source_split(tasks: &str) -> Option<Result<Split, String>> {
    tasks
        .strip_prefix(SOURCE)
        .map(|s| s.parse().map_err(|e| format!("--tasks {tasks}: {e}")))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pool {
    Name,
    Day,
    Time,
    City,
}

impl Pool {
    /// (training values, held-out values): disjoint.
    fn values(self) -> (&'static [&'static str], &'static [&'static str]) {
        match self {
            Pool::Name => (
                &[
                    "Maya", "Liam", "Sofia", "Noah", "Emma", "Lucas", "Aria", "Omar", "Chloe",
                    "Ethan", "Zara", "Hugo", "Nina", "Felix", "Iris", "Leo",
                ],
                &[
                    "Priya", "Mateo", "Hana", "Tobias", "Elena", "Kwame", "Ingrid", "Rafael",
                ],
            ),
            Pool::Day => (
                &["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"],
                &["Saturday", "Sunday"],
            ),
            Pool::Time => (
                &["9 am", "10 am", "2 pm", "3 pm", "5 pm"],
                &["11 am", "4 pm"],
            ),
            Pool::City => (
                &["Lisbon", "Denver", "Osaka", "Nairobi", "Oslo", "Lima"],
                &["Dublin", "Hanoi", "Quito"],
            ),
        }
    }
}

/// One kind of request. `{d}` stands for the detail.
struct Template {
    id: &'static str,
    pool: Pool,
    /// The request with the detail, and without it.
    stated: &'static str,
    vague: &'static str,
    /// The user's answer to any clarifying question.
    user_answer: &'static str,
}

const TEMPLATES: &[Template] = &[
    Template {
        id: "birthday",
        pool: Pool::Name,
        stated: "Write a one-line birthday greeting for my friend {d}.",
        vague: "Write a one-line birthday greeting for my friend.",
        user_answer: "My friend's name is {d}.",
    },
    Template {
        id: "thanks",
        pool: Pool::Name,
        stated: "Write a one-line thank-you note to my colleague {d}.",
        vague: "Write a one-line thank-you note to my colleague.",
        user_answer: "My colleague's name is {d}.",
    },
    Template {
        id: "neighbor",
        pool: Pool::Name,
        stated: "Write a one-line welcome message for our new neighbor {d}.",
        vague: "Write a one-line welcome message for our new neighbor.",
        user_answer: "Our neighbor's name is {d}.",
    },
    Template {
        id: "dog_caption",
        pool: Pool::Name,
        stated: "Write a short caption for a photo of my dog {d}.",
        vague: "Write a short caption for a photo of my dog.",
        user_answer: "My dog's name is {d}.",
    },
    Template {
        id: "good_luck",
        pool: Pool::Name,
        stated: "Write a one-line good-luck message for my cousin {d} before the exam.",
        vague: "Write a one-line good-luck message for my cousin before the exam.",
        user_answer: "My cousin's name is {d}.",
    },
    Template {
        id: "meeting",
        pool: Pool::Day,
        stated: "Write a one-line reminder that the team meeting is on {d}.",
        vague: "Write a one-line reminder about the team meeting.",
        user_answer: "The meeting is on {d}.",
    },
    Template {
        id: "party",
        pool: Pool::Day,
        stated: "Write a one-line invitation to my party on {d}.",
        vague: "Write a one-line invitation to my party.",
        user_answer: "The party is on {d}.",
    },
    Template {
        id: "bake_sale",
        pool: Pool::Day,
        stated: "Write a one-line announcement that the bake sale is on {d}.",
        vague: "Write a one-line announcement for the bake sale.",
        user_answer: "The bake sale is on {d}.",
    },
    Template {
        id: "flight",
        pool: Pool::Time,
        stated: "Write a one-line text telling my mom my flight lands at {d}.",
        vague: "Write a one-line text telling my mom when my flight lands.",
        user_answer: "It lands at {d}.",
    },
    Template {
        id: "dentist",
        pool: Pool::Time,
        stated: "Write a one-line reminder about my dentist appointment at {d}.",
        vague: "Write a one-line reminder about my dentist appointment.",
        user_answer: "The appointment is at {d}.",
    },
    Template {
        id: "postcard",
        pool: Pool::City,
        stated: "Write a one-line postcard greeting from my trip to {d}.",
        vague: "Write a one-line postcard greeting from my trip.",
        user_answer: "I am in {d}.",
    },
    Template {
        id: "moving",
        pool: Pool::City,
        stated: "Write a one-line message telling my sister I am moving to {d}.",
        vague: "Write a one-line message telling my sister I am moving.",
        user_answer: "I am moving to {d}.",
    },
];

fn fill(text: &str, detail: &str) -> String {
    text.replace("{d}", detail)
}

/// The built-in requests of a split, in a fixed order: per template, per value, the stated
/// request then the vague one.
pub fn tasks(split: Split) -> Vec<Task> {
    let mut out = Vec::new();
    for t in TEMPLATES {
        let (train, test) = t.pool.values();
        let values: Vec<(&str, &str)> = match split {
            Split::Train => train.iter().map(|v| (*v, "train")).collect(),
            Split::Test => test.iter().map(|v| (*v, "test")).collect(),
            Split::All => train
                .iter()
                .map(|v| (*v, "train"))
                .chain(test.iter().map(|v| (*v, "test")))
                .collect(),
        };
        for (value, in_split) in values {
            for stated in [true, false] {
                let slug: String = value
                    .to_ascii_lowercase()
                    .chars()
                    .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
                    .collect();
                out.push(Task {
                    id: format!(
                        "clarify-{}-{slug}-{}",
                        t.id,
                        if stated { "stated" } else { "vague" }
                    ),
                    task_type: TaskType::Clarify,
                    prompt: fill(t.stated, value),
                    reference: value.to_string(),
                    metadata: serde_json::json!({
                        "template": t.id,
                        "request": if stated { fill(t.stated, value) } else { t.vague.to_string() },
                        "stated": stated,
                        "user_answer": fill(t.user_answer, value),
                        "split": in_split,
                    }),
                });
            }
        }
    }
    out
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

    #[test]
    fn splits_are_disjoint_and_half_the_requests_state_the_detail() {
        let train = tasks(Split::Train);
        let test = tasks(Split::Test);
        assert_eq!(train.len() + test.len(), tasks(Split::All).len());
        let values = |ts: &[Task]| {
            ts.iter()
                .map(|t| t.reference.clone())
                .collect::<std::collections::BTreeSet<_>>()
        };
        assert!(values(&train).is_disjoint(&values(&test)));
        for ts in [&train, &test] {
            let stated = ts.iter().filter(|t| t.metadata["stated"] == true).count();
            assert_eq!(2 * stated, ts.len());
        }
        let ids: std::collections::BTreeSet<_> =
            tasks(Split::All).into_iter().map(|t| t.id).collect();
        assert_eq!(ids.len(), train.len() + test.len(), "ids are unique");
        for t in &train {
            let request = t.metadata["request"].as_str().unwrap();
            assert_eq!(
                uses_detail(request, &t.reference),
                t.metadata["stated"] == true,
                "{t:?}"
            );
        }
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
            .find(|t| t.metadata["stated"] == false)
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
