//! The metrics — one implementation, shared by generation and evaluation — and
//! their weights.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::judge::Judge;
use super::sandbox::{run_python_tests, SandboxLimits};
use crate::llm::parse::extract_code;
use crate::llm::tokens::TokenCounter;
use crate::llm::ChatMessage;
use crate::task::prompts::transcript;
use crate::task::prompts::Prompt;
use crate::task::twenty_questions::{self, chat};
use crate::task::{Task, TaskType};

/// Metric names and their native ranges.
pub const METRICS: &[(&str, &str)] = &[
    ("accuracy", "{0,1}: LLM judge of the final answer (as upstream); for math an explicit final answer (boxed or stated) is checked programmatically as a second opinion, recorded in `detail` and used only when the judge gives no verdict"),
    ("interactivity", "LLM judge on --interactivity-scale: v2 {0,0.5,1}, verl [0,1] (mean of three sub-scores), v1 {-3,-1,1} ((x-2.5)*2 of 1-3), likert5 [0,1] ((x-1)/4 of 1-5)"),
    ("token_amount", ">=0: thousands of assistant tokens in the candidate and its future (words: every message's words, verl)"),
    ("reply_tokens", ">=0: thousands of tokens of the candidate reply alone (the future's own turns not counted)"),
    ("bleu", "[0,1]: token-level BLEU-4 (13a, exp smoothing) of the LLM-extracted final document against the reference"),
    ("bleu_char", "[0,1]: character-level BLEU-4 (NLTK sentence_bleu on raw strings, no smoothing: upstream CollabLLM's number) of the same extracted document"),
    ("pass_rate", "{0,1}: the LLM-extracted final code passes the task's unittest tests in the sandbox"),
    ("info_gain", "[0,1] (20 Questions): expected information gain of the candidate question under the attribute table, in bits: the binary entropy of its yes-fraction among the objects still consistent (0 for an unread, repeated or already answered question)"),
    ("info_gain_realised", "[0,1] (20 Questions): bits the candidate question and its future gather under the attribute table, log2(|consistent before|/|consistent after|), divided by log2(|consistent before|): the share of the remaining uncertainty removed (depends on the hidden object)"),
    ("success", "{0,1} (20 Questions): the game is won (LMRL-Gym's win rule) by the candidate or within its future"),
    ("questions", ">=1 (20 Questions): questions asked by the candidate and its future, the winning one included"),
    ("lmrl_return", "<=0 (20 Questions): LMRL-Gym's return over the candidate and its future: -1 per question, 0 for the winning one"),
    ("detail_used", "{0,1} (clarify): the conversation's final answer (its last assistant message without a question mark) uses the detail the request needs"),
    ("clarifying_questions", ">=0 (clarify): assistant messages of the candidate and its future that ask a question"),
];

/// The metrics computed exactly from a 20 Questions game under the attribute table.
pub const TWENTY_QUESTIONS_METRICS: &[&str] = &[
    "info_gain",
    "info_gain_realised",
    "success",
    "questions",
    "lmrl_return",
];

#[derive(Debug, thiserror::Error)]
pub enum MetricError {
    #[error("unknown metric `{name}` (known: {known})")]
    Unknown { name: String, known: String },
    #[error("malformed metric weight `{arg}`: expected name=weight, e.g. accuracy=1 or token_amount=-0.1")]
    Malformed { arg: String },
    #[error("metric weight `{arg}` is out of range: |weight| must be at most {MAX_METRIC_WEIGHT} (larger weights overflow the reward's spread, and every advantage becomes 0)")]
    WeightOutOfRange { arg: String },
    #[error("metric `{metric}` needs {what}, which task {task} does not have")]
    TaskLacks {
        metric: String,
        task: String,
        what: String,
    },
}

pub fn check_metric_name(name: &str) -> Result<(), MetricError> {
    if METRICS.iter().any(|(m, _)| *m == name) {
        Ok(())
    } else {
        Err(MetricError::Unknown {
            name: name.to_string(),
            known: METRICS
                .iter()
                .map(|(m, _)| *m)
                .collect::<Vec<_>>()
                .join(", "),
        })
    }
}

/// The largest `--metric` weight by magnitude: rewards are weighted sums of scores of order 1,
/// and their variance must stay finite.
pub const MAX_METRIC_WEIGHT: f64 = 1e6;

/// Parses `name=weight` (the `--metric` flag).
pub fn parse_metric_weight(arg: &str) -> Result<(String, f64), MetricError> {
    let malformed = || MetricError::Malformed {
        arg: arg.to_string(),
    };
    let (name, w) = arg.split_once('=').ok_or_else(malformed)?;
    let name = name.trim();
    check_metric_name(name)?;
    let w: f64 = w.trim().parse().map_err(|_| malformed())?;
    if !w.is_finite() {
        return Err(malformed());
    }
    if w.abs() > MAX_METRIC_WEIGHT {
        return Err(MetricError::WeightOutOfRange {
            arg: arg.to_string(),
        });
    }
    Ok((name.to_string(), w))
}

/// Checks a `--metric-preset` name (the 20 Questions study's reward variants).
pub fn parse_metric_preset(name: &str) -> Result<String, String> {
    match twenty_questions::metric_preset(name) {
        Some(_) => Ok(name.to_string()),
        None => Err(format!(
            "unknown preset `{name}` (known: {})",
            twenty_questions::METRIC_PRESETS
                .iter()
                .map(|(n, _)| *n)
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}

/// The weights `--metric-preset` and `--metric` flags give: the preset's, with the flags
/// added or overriding; the flags alone without a preset; `None` when neither was given (the
/// configured weights stay).
pub fn weights_from_flags(
    preset: Option<&str>,
    flags: &[(String, f64)],
) -> Option<BTreeMap<String, f64>> {
    let mut w: BTreeMap<String, f64> = preset
        .and_then(twenty_questions::metric_preset)
        .map(|p| p.iter().map(|(m, v)| (m.to_string(), *v)).collect())
        .unwrap_or_default();
    if preset.is_none() && flags.is_empty() {
        return None;
    }
    w.extend(flags.iter().cloned());
    Some(w)
}

/// The default weights of a task type (its row of [`TaskType::facts`]): math accuracy=1,
/// interactivity=1, token_amount=−0.1; document editing bleu=1, token_amount=−0.1; code
/// pass_rate=1, token_amount=−0.5; 20 Questions the exact `20q-infogain` preset (success=1,
/// info_gain=1, reply_tokens=−0.5: no judge needed); clarify detail_used=1,
/// clarifying_questions=−0.3.
pub fn default_weights(task_type: TaskType) -> BTreeMap<String, f64> {
    let w = task_type.facts().default_weights;
    w.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

/// The task-success metric of a task type (what evaluation reports first): `accuracy`,
/// `bleu`, `pass_rate` or `detail_used`; 20 Questions has its own game metrics.
pub fn task_metric(task_type: TaskType) -> Option<&'static str> {
    task_type.facts().task_metric
}

/// Checks up front that every task has what the chosen metrics need.
pub fn check_tasks_for_metrics(tasks: &[Task], metrics: &[String]) -> Result<(), MetricError> {
    for t in tasks {
        for m in metrics {
            let lacks = |what: &str| MetricError::TaskLacks {
                metric: m.clone(),
                task: t.id.clone(),
                what: what.into(),
            };
            match m.as_str() {
                "accuracy" | "bleu" | "bleu_char" | "detail_used"
                    if t.reference.trim().is_empty() =>
                {
                    return Err(lacks("a `reference`"))
                }
                "pass_rate" if tests_of(t).is_none() => {
                    return Err(lacks(
                        "unittest code in `metadata.tests` (or BigCodeBench's `metadata.test`)",
                    ))
                }
                m if TWENTY_QUESTIONS_METRICS.contains(&m)
                    && chat::default_world()
                        .ok()
                        .and_then(|w| chat::object_of_task(w, t))
                        .is_none() =>
                {
                    return Err(lacks(
                        "a 20 Questions object (task_type twenty_questions and a reference naming one of the bundled objects)",
                    ))
                }
                _ => {}
            }
        }
    }
    Ok(())
}

/// The task's unittest code: `metadata.tests`, or BigCodeBench's `metadata.test` (imported
/// flat rows of `collabllm-multiturn-bigcodebench` keep it with `entry_point`).
fn tests_of(task: &Task) -> Option<&str> {
    ["tests", "test"]
        .iter()
        .find_map(|k| task.metadata.get(*k).and_then(|v| v.as_str()))
        .filter(|s| !s.trim().is_empty())
}

/// The tests as the sandbox runs them. BigCodeBench's TestCase strings call the function
/// (`entry_point`, e.g. `task_func`) as if written in the same file: the solution's names
/// are bound first, as `from solution import *` (a test that imports the solution itself is
/// left alone).
pub fn runnable_tests(task: &Task, tests: &str) -> String {
    let entry_point = task.metadata.get("entry_point").and_then(|v| v.as_str());
    if entry_point.is_some()
        && !tests.contains("import solution")
        && !tests.contains("from solution")
    {
        format!("from solution import *\n{tests}")
    } else {
        tests.to_string()
    }
}

/// "Environment missing": the run failed on a module the *task* needs (its tests import it,
/// or BigCodeBench's `metadata.libs` lists it) and the sandbox's Python does not have — the
/// answer was never judged, so it is no failure. A module only the answer imports is the
/// answer's fault. Returns the module's name.
pub fn environment_missing(task: &Task, tests: &str, stderr: &str) -> Option<String> {
    let module = stderr
        .lines()
        .filter_map(|l| l.split("No module named ").nth(1))
        .map(|m| m.trim().trim_matches(['\'', '"']).to_string())
        .next_back()?;
    let top = module.split('.').next().unwrap_or(&module).to_string();
    let libs = task
        .metadata
        .get("libs")
        .map(|v| match v {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        })
        .unwrap_or_default();
    let imported_by_tests = tests.lines().any(|l| {
        let l = l.trim();
        l.starts_with(&format!("import {top}"))
            || l.starts_with(&format!("from {top}"))
            || (l.starts_with("import ") && l.split([',', ' ']).any(|w| w == top))
    });
    let listed = libs
        .split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .any(|w| w == top);
    (imported_by_tests || listed).then_some(top)
}

/// One metric's score of one session, with what produced it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MetricScore {
    /// Native range; `None` = missing (the judge gave no usable answer).
    pub value: Option<f64>,
    /// How it was computed: `llm-json`, `llm-logprob`, `programmatic`, `tokens:<tokenizer>`,
    /// `sandbox`, ….
    pub method: String,
    /// Raw judge or extractor output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub raw: Option<String>,
    /// Metric-specific details (the extracted answer, the sandbox outcome, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<serde_json::Value>,
}

/// Computes metrics of sessions.
pub struct Scorer {
    pub judge: Arc<Judge>,
    pub tokens: TokenCounter,
    pub sandbox: SandboxLimits,
}

impl Scorer {
    /// Scores the session `history + candidate + future` on `metric`.
    pub async fn score(
        &self,
        metric: &str,
        task: &Task,
        history: &[ChatMessage],
        candidate_and_future: &[ChatMessage],
        seed: u64,
    ) -> MetricScore {
        let session: Vec<ChatMessage> = [history, candidate_and_future].concat();
        match metric {
            "accuracy" => self.accuracy(task, &session, seed).await,
            "interactivity" => {
                let v = self.judge.interactivity(&transcript(&session), seed).await;
                MetricScore {
                    value: v.value,
                    method: v.method,
                    raw: Some(v.raw),
                    detail: None,
                }
            }
            "token_amount" => {
                // verl's recipe counts the words of every message after the prompt, the
                // simulated user's included; a token count covers what the assistant wrote.
                let n = match self.tokens {
                    TokenCounter::Words => candidate_and_future
                        .iter()
                        .map(|m| self.tokens.count(&m.content))
                        .sum(),
                    _ => count_tokens(&self.tokens, candidate_and_future, "assistant"),
                };
                MetricScore {
                    value: Some(n as f64 / 1000.0),
                    method: format!("tokens:{}", self.tokens.name()),
                    raw: None,
                    detail: Some(serde_json::json!({"tokens": n})),
                }
            }
            "reply_tokens" => {
                let n = candidate_and_future
                    .first()
                    .filter(|m| m.role == "assistant")
                    .map_or(0, |m| self.tokens.count(&m.content));
                MetricScore {
                    value: Some(n as f64 / 1000.0),
                    method: format!("tokens:{}", self.tokens.name()),
                    raw: None,
                    detail: Some(serde_json::json!({"tokens": n})),
                }
            }
            "bleu" => self.bleu(task, &session, seed, false).await,
            "bleu_char" => self.bleu(task, &session, seed, true).await,
            "pass_rate" => self.pass_rate(task, &session, seed).await,
            m if TWENTY_QUESTIONS_METRICS.contains(&m) => {
                twenty_questions_score(m, task, history, candidate_and_future)
            }
            "detail_used" => MetricScore {
                value: Some(crate::task::clarify::detail_used(task, &session)),
                method: "programmatic".into(),
                raw: None,
                detail: None,
            },
            "clarifying_questions" => MetricScore {
                value: Some(crate::task::clarify::clarifying_questions(
                    candidate_and_future,
                )),
                method: "programmatic".into(),
                raw: None,
                detail: None,
            },
            other => MetricScore {
                value: None,
                method: format!("unknown metric {other}"),
                raw: None,
                detail: None,
            },
        }
    }

    /// The judge's verdict, as upstream. For math, an explicit final answer anywhere in the
    /// session's assistant messages is checked as a second opinion: both are recorded in
    /// `detail` (`judge`, `programmatic`, `agree`), and the check stands in only for a missing
    /// verdict.
    async fn accuracy(&self, task: &Task, session: &[ChatMessage], seed: u64) -> MetricScore {
        let verdict = self
            .judge
            .accuracy(&task.prompt, &task.reference, &transcript(session), seed)
            .await;
        let programmatic = if task.task_type == TaskType::Math {
            let assistant = session
                .iter()
                .filter(|m| m.role == "assistant")
                .map(|m| m.content.as_str());
            super::math::check_explicit_answer(assistant, &task.reference)
        } else {
            None
        };
        let check = programmatic.as_ref().map(|(_, ok)| *ok);
        let detail = serde_json::json!({
            "judge": verdict.value,
            "judge_method": verdict.method,
            "programmatic": check,
            "programmatic_answer": programmatic.as_ref().map(|(a, _)| a),
            "agree": verdict.value.zip(check).map(|(j, p)| (j >= 0.5) == p),
        });
        let (value, method) = match (verdict.value, check) {
            (None, Some(ok)) => (Some(if ok { 1.0 } else { 0.0 }), "programmatic".into()),
            (v, _) => (v, verdict.method),
        };
        MetricScore {
            value,
            method,
            raw: Some(verdict.raw),
            detail: Some(detail),
        }
    }

    /// BLEU of the extracted final document: token-level (`bleu`) or character-level
    /// (`bleu_char`); the detail keeps both.
    async fn bleu(
        &self,
        task: &Task,
        session: &[ChatMessage],
        seed: u64,
        chars: bool,
    ) -> MetricScore {
        let extracted = self
            .judge
            .extract(
                Prompt::ExtractDocument,
                &task.prompt,
                &transcript(session),
                seed,
            )
            .await;
        let (doc, raw, source) = match extracted {
            Some((doc, raw)) if !doc.trim().is_empty() => (doc, Some(raw), "llm-extract"),
            other => (
                last_assistant(session).unwrap_or("").to_string(),
                other.map(|(_, raw)| raw),
                "last-message",
            ),
        };
        let token = super::bleu::sentence_bleu(&doc, &task.reference);
        let character = super::bleu::char_bleu(&doc, &task.reference);
        let (value, kind) = if chars {
            (character, "bleu-char")
        } else {
            (token, "bleu13a")
        };
        MetricScore {
            value: Some(value),
            method: format!("{source}+{kind}"),
            raw,
            detail: Some(
                serde_json::json!({"document": doc, "bleu": token, "bleu_char": character}),
            ),
        }
    }

    async fn pass_rate(&self, task: &Task, session: &[ChatMessage], seed: u64) -> MetricScore {
        let Some(tests) = tests_of(task) else {
            return MetricScore {
                value: None,
                method: "sandbox".into(),
                raw: None,
                detail: Some(
                    serde_json::json!({"error": "task has no metadata.tests (or BigCodeBench metadata.test)"}),
                ),
            };
        };
        let extracted = self
            .judge
            .extract(
                Prompt::ExtractCode,
                &task.prompt,
                &transcript(session),
                seed,
            )
            .await;
        let raw = extracted.as_ref().map(|(_, r)| r.clone());
        let code = extracted
            .and_then(|(_, r)| extract_code(&r))
            .filter(|c| !c.trim().is_empty())
            .or_else(|| last_assistant(session).and_then(extract_code));
        let Some(code) = code else {
            return MetricScore {
                value: Some(0.0),
                method: "sandbox".into(),
                raw,
                detail: Some(serde_json::json!({"error": "no code in the conversation"})),
            };
        };
        let tests = runnable_tests(task, tests);
        match run_python_tests(&code, &tests, &self.sandbox).await {
            Ok(outcome) if !outcome.passed => {
                match environment_missing(task, &tests, &outcome.stderr_tail) {
                    Some(module) => MetricScore {
                        value: None,
                        method: "sandbox".into(),
                        raw,
                        detail: Some(serde_json::json!({
                            "code": code,
                            "environment_missing": module,
                            "outcome": outcome,
                        })),
                    },
                    None => MetricScore {
                        value: Some(0.0),
                        method: "sandbox".into(),
                        raw,
                        detail: Some(serde_json::json!({"code": code, "outcome": outcome})),
                    },
                }
            }
            Ok(outcome) => MetricScore {
                value: Some(if outcome.passed { 1.0 } else { 0.0 }),
                method: "sandbox".into(),
                raw,
                detail: Some(serde_json::json!({"code": code, "outcome": outcome})),
            },
            Err(e) => MetricScore {
                value: None,
                method: "sandbox".into(),
                raw,
                detail: Some(serde_json::json!({"code": code, "error": e.to_string()})),
            },
        }
    }
}

/// A 20 Questions metric of `history + candidate_and_future`, exact under the table: the
/// questions and answers of the history set the objects still consistent, those of the
/// candidate and its future are scored. A candidate with no answer yet (a reply scored
/// alone) gets the table's answer.
fn twenty_questions_score(
    metric: &str,
    task: &Task,
    history: &[ChatMessage],
    candidate_and_future: &[ChatMessage],
) -> MetricScore {
    let missing = |why: String| MetricScore {
        value: None,
        method: "20q-table".into(),
        raw: None,
        detail: Some(serde_json::json!({"error": why})),
    };
    let (world, object) = match chat::world_and_object(task) {
        Ok(x) => x,
        Err(e) => return missing(e),
    };
    let before = chat::answered_questions(history);
    let mut future = chat::answered_questions(candidate_and_future);
    if let Some(q) = chat::unanswered_question(candidate_and_future) {
        let yes = chat::table_answer(world, object, &q).0;
        future.push((q, yes));
    }
    let unparsed = future
        .iter()
        .filter(|(q, _)| world.parse(q).is_none())
        .count();
    let r = twenty_questions::future_rewards(world, object, &before, &future);
    let value = match metric {
        "info_gain" => r.expected_gain,
        "info_gain_realised" => r.info_gain,
        "success" => r.success,
        "questions" => r.questions,
        _ => r.lmrl_return,
    };
    MetricScore {
        value: Some(value),
        method: "20q-table".into(),
        raw: None,
        detail: Some(serde_json::json!({"rewards": r, "unparsed": unparsed})),
    }
}

/// Tokens of the messages of one role (`assistant`: what the user reads; `user`: what the user
/// types), counted with `counter`. `token_amount` is this for the assistant, in thousands.
pub fn count_tokens(counter: &TokenCounter, messages: &[ChatMessage], role: &str) -> usize {
    messages
        .iter()
        .filter(|m| m.role == role)
        .map(|m| counter.count(&m.content))
        .sum()
}

fn last_assistant(session: &[ChatMessage]) -> Option<&str> {
    session
        .iter()
        .rev()
        .find(|m| m.role == "assistant")
        .map(|m| m.content.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_parse_and_name_errors() {
        assert_eq!(
            parse_metric_weight("token_amount=-0.1").unwrap(),
            ("token_amount".to_string(), -0.1)
        );
        let e = parse_metric_weight("acuracy=1").unwrap_err().to_string();
        assert!(e.contains("acuracy") && e.contains("accuracy"), "{e}");
        let e = parse_metric_weight("accuracy=lots")
            .unwrap_err()
            .to_string();
        assert!(e.contains("accuracy=lots"), "{e}");
        assert!(parse_metric_weight("accuracy").is_err());
        assert!(parse_metric_weight("accuracy=inf").is_err());
        let e = parse_metric_weight("info_gain=1e300")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("info_gain=1e300") && e.contains("at most"),
            "{e}"
        );
        assert!(parse_metric_weight("info_gain=-1e7").is_err());
        assert!(parse_metric_weight("info_gain=1e6").is_ok());
    }
}

#[cfg(test)]
mod accuracy_tests {
    use super::*;
    use crate::reward::judge::InteractivityScale;

    fn scorer(judge_reply: &'static str) -> Scorer {
        scorer_counting(judge_reply, TokenCounter::cl100k().unwrap())
    }

    /// A scorer whose judge always answers `judge_reply`, counting tokens with `tokens`.
    pub(super) fn scorer_counting(judge_reply: &'static str, tokens: TokenCounter) -> Scorer {
        Scorer {
            judge: Arc::new(crate::reward::judge::tests::judge(
                InteractivityScale::V2,
                judge_reply,
            )),
            tokens,
            sandbox: SandboxLimits::default(),
        }
    }

    fn task() -> Task {
        serde_json::from_value(serde_json::json!({"id": "t", "task_type": "math",
            "prompt": "What is 2 + 3?", "reference": "5"}))
        .unwrap()
    }

    /// A future that ends on a follow-up whose last number is not the answer: the judge
    /// decides, the explicit answer earlier in the session is the second opinion.
    #[tokio::test]
    async fn the_judge_decides_and_the_explicit_answer_is_a_second_opinion() {
        let session = [
            ChatMessage::user("what's 2+3"),
            ChatMessage::assistant("2 + 3 = \\boxed{5}."),
            ChatMessage::user("thanks"),
            ChatMessage::assistant("Want 2 more examples?"),
        ];
        let s = scorer(r#"{"thought": "wrong", "accuracy": 0}"#)
            .score("accuracy", &task(), &session[..1], &session[1..], 7)
            .await;
        assert_eq!(s.value, Some(0.0), "the judge's verdict stands: {s:?}");
        assert_eq!(s.method, "llm-json");
        let d = s.detail.unwrap();
        assert_eq!(d["programmatic"], true);
        assert_eq!(d["programmatic_answer"], "5");
        assert_eq!(d["agree"], false);

        // No usable verdict: the explicit answer stands in, and says so.
        let s = scorer("no idea")
            .score("accuracy", &task(), &session[..1], &session[1..], 7)
            .await;
        assert_eq!((s.value, s.method.as_str()), (Some(1.0), "programmatic"));

        // Without an explicit answer there is no check (the last number "2" is not one).
        let s = scorer(r#"{"thought": "ok", "accuracy": 1}"#)
            .score("accuracy", &task(), &session[..1], &session[3..], 7)
            .await;
        assert_eq!(s.value, Some(1.0));
        assert_eq!(s.detail.unwrap()["agree"], serde_json::Value::Null);
    }

    #[tokio::test]
    async fn bleu_char_scores_the_extracted_document_by_characters() {
        let mut t = task();
        t.task_type = TaskType::DocEdit;
        t.reference = "abcdf".into();
        let session = [
            ChatMessage::user("write it"),
            ChatMessage::assistant("draft"),
        ];
        let s = scorer("```\nabcde\n```")
            .score("bleu_char", &t, &[], &session, 1)
            .await;
        assert!(
            (s.value.unwrap() - 0.2f64.powf(0.25)).abs() < 1e-12,
            "{s:?}"
        );
        assert_eq!(s.method, "llm-extract+bleu-char");
        let d = s.detail.unwrap();
        assert_eq!(d["bleu"], 0.0);
        check_metric_name("bleu_char").unwrap();
    }

    fn bigcodebench_task(test: &str, libs: &str) -> Task {
        serde_json::from_value(
            serde_json::json!({"id": "BigCodeBench/1", "task_type": "code",
            "prompt": "Write task_func.", "metadata": {"test": test, "entry_point": "task_func",
            "libs": libs}}),
        )
        .unwrap()
    }

    const BCB_TEST: &str = "import unittest\nclass TestCases(unittest.TestCase):\n    def test_sum(self):\n        self.assertEqual(task_func(2, 3), 5)\n";

    #[test]
    fn only_a_module_the_task_needs_is_an_environment_gap() {
        let t = bigcodebench_task(
            "import unittest\nimport pandas as pd\n",
            "['pandas', 'numpy']",
        );
        let err = "Traceback...\nModuleNotFoundError: No module named 'pandas'\n";
        assert_eq!(
            environment_missing(&t, "import unittest\nimport pandas as pd\n", err).as_deref(),
            Some("pandas")
        );
        // Listed in libs only (the solution imports it): still the task's environment.
        let err = "ModuleNotFoundError: No module named 'numpy.linalg'";
        assert_eq!(environment_missing(&t, "", err).as_deref(), Some("numpy"));
        // A module only the answer imports (hallucinated or not the task's): a failed answer.
        let err = "ModuleNotFoundError: No module named 'magic_solver'";
        assert_eq!(environment_missing(&t, "import unittest\n", err), None);
        assert_eq!(environment_missing(&t, "", "AssertionError: 4 != 5"), None);
    }

    #[test]
    fn bigcodebench_tests_see_the_solutions_names() {
        let t = bigcodebench_task(BCB_TEST, "[]");
        assert_eq!(tests_of(&t), Some(BCB_TEST));
        assert!(runnable_tests(&t, BCB_TEST).starts_with("from solution import *\n"));
        let own = "from solution import task_func\n";
        assert_eq!(runnable_tests(&t, own), own);
        check_tasks_for_metrics(std::slice::from_ref(&t), &["pass_rate".into()]).unwrap();
    }

    /// Real sandbox runs: a right answer passes, a wrong one fails, and an answer to a task
    /// whose tests need a module the sandbox lacks is missing, not failed.
    #[tokio::test]
    async fn bigcodebench_answers_run_in_the_sandbox() {
        let scorer = scorer("no code here");
        let answer = |t: Task, body: &'static str| {
            let scorer = &scorer;
            async move {
                let code = format!("```python\ndef task_func(a, b):\n    return {body}\n```");
                let session = [
                    ChatMessage::user("Write task_func."),
                    ChatMessage::assistant(code),
                ];
                scorer.score("pass_rate", &t, &[], &session, 1).await
            }
        };
        let right = answer(bigcodebench_task(BCB_TEST, "[]"), "a + b").await;
        assert_eq!(right.value, Some(1.0), "{right:?}");
        let wrong = answer(bigcodebench_task(BCB_TEST, "[]"), "a - b").await;
        assert_eq!(wrong.value, Some(0.0), "{wrong:?}");
        let needs = format!("import no_such_lib_for_tests\n{BCB_TEST}");
        let gap = answer(
            bigcodebench_task(&needs, "['no_such_lib_for_tests']"),
            "a + b",
        )
        .await;
        assert_eq!(gap.value, None, "{gap:?}");
        assert_eq!(
            gap.detail.as_ref().unwrap()["environment_missing"],
            "no_such_lib_for_tests"
        );
    }
}

#[cfg(test)]
mod token_amount_tests {
    use super::accuracy_tests::scorer_counting;
    use super::*;

    fn scorer(tokens: TokenCounter) -> Scorer {
        scorer_counting("{}", tokens)
    }

    /// verl's token_amount counts the words of every message after the prompt (the
    /// simulated user's too); a tokenizer count covers the assistant's turns only. The
    /// history before the candidate never counts.
    #[tokio::test]
    async fn words_count_every_post_prompt_message_tokens_only_the_assistant() {
        let task: Task = serde_json::from_value(serde_json::json!({"id": "t",
            "task_type": "math", "prompt": "p", "reference": "5"}))
        .unwrap();
        let history = [ChatMessage::user("one two three four five".to_string())];
        let future = [
            ChatMessage::assistant("six seven".to_string()),
            ChatMessage::user("eight nine ten".to_string()),
            ChatMessage::assistant("eleven".to_string()),
        ];
        let words = scorer(TokenCounter::Words)
            .score("token_amount", &task, &history, &future, 0)
            .await;
        assert_eq!(words.detail.unwrap()["tokens"], 6);
        assert!((words.value.unwrap() - 0.006).abs() < 1e-12);
        let counter = TokenCounter::cl100k().unwrap();
        let assistant = counter.count("six seven") + counter.count("eleven");
        let cl100k = scorer(counter)
            .score("token_amount", &task, &history, &future, 0)
            .await;
        assert_eq!(cl100k.detail.unwrap()["tokens"], assistant);
    }
}
