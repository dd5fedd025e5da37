//! One evaluation conversation (math, doc_edit, code): the simulated user opens, the
//! evaluated model replies, the user continues, until the user's termination signal or the
//! turn cap; then the task metric and interactivity through the shared
//! [`Scorer`](crate::reward::metrics::Scorer), and the token counts of both sides.
//!
//! Every seed is derived from (run seed + repeat, task id, purpose, turn) and never from the
//! model, so all models meet the same first user message and the same sampling seeds.

use std::collections::BTreeMap;

use futures::future::join_all;

use crate::llm::roles::Role;
use crate::llm::ChatMessage;
use crate::reward::metrics::{count_tokens, MetricScore, Scorer};
use crate::rollout::user::{derive_seed, Sampling, SimError, UserSimulator};
use crate::task::{clarify, Task, TaskType};

/// Clarify-or-answer: success and asking on stated and on vague requests, each `null` on
/// the other kind (so its mean is over that kind only).
fn clarify_views(
    task: &Task,
    scores: &BTreeMap<String, MetricScore>,
    metrics: &mut serde_json::Map<String, serde_json::Value>,
) {
    let stated = task.metadata["stated"].as_bool().unwrap_or(false);
    let used = scores.get("detail_used").and_then(|s| s.value);
    let asked = scores
        .get("clarifying_questions")
        .and_then(|s| s.value)
        .map(|q| if q > 0.0 { 1.0 } else { 0.0 });
    let (mine, other) = if stated {
        ("stated", "vague")
    } else {
        ("vague", "stated")
    };
    let questions = scores.get("clarifying_questions").and_then(|s| s.value);
    metrics.insert(
        "task_reward".into(),
        serde_json::json!(used.zip(questions).map(|(u, q)| clarify::task_reward(u, q))),
    );
    // A question asked again after the user answered the first (the scripted user answers
    // every question): the over-asking the task reward charges twice.
    metrics.insert(
        "repeated_question".into(),
        serde_json::json!(questions.map(|q| if q >= 2.0 { 1.0 } else { 0.0 })),
    );
    metrics.insert(format!("detail_used_{mine}"), serde_json::json!(used));
    metrics.insert(format!("asked_{mine}"), serde_json::json!(asked));
    metrics.insert(format!("detail_used_{other}"), serde_json::Value::Null);
    metrics.insert(format!("asked_{other}"), serde_json::Value::Null);
}

/// Who writes the evaluated side of the conversation.
pub enum Speaker {
    /// An assistant model.
    Model(Role),
    /// The clarify-or-answer mixed demonstrator (scripted; its conversations are SFT data).
    Demonstrator(clarify::Demonstrator),
}

/// One evaluated model with its own token counter (its tokenizer, or cl100k for endpoints).
pub struct DialogueModel {
    pub label: String,
    pub speaker: Speaker,
    pub scorer: Scorer,
}

/// What every conversation of a run shares.
pub struct DialogueRunner {
    pub user: UserSimulator,
    /// The task metric (`accuracy`, `bleu`, `pass_rate`).
    pub task_metric: &'static str,
    pub max_turns: usize,
    pub sampling: Sampling,
    pub seed: u64,
}

#[derive(Default)]
struct AssistantUsage {
    calls: u64,
    cached: u64,
    prompt_tokens: u64,
    completion_tokens: u64,
}

impl DialogueRunner {
    /// Plays and scores one conversation; the JSON record of `conversations/<model>.jsonl`.
    pub async fn run(
        &self,
        model: &DialogueModel,
        task: &Task,
        repeat: usize,
    ) -> Result<serde_json::Value, SimError> {
        let run_seed = self.seed.wrapping_add(repeat as u64);
        let seed = |parts: &[&str]| {
            let mut all = vec![task.id.as_str()];
            all.extend_from_slice(parts);
            derive_seed(run_seed, &all)
        };
        let first = self
            .user
            .next_messages(task, &[], 1, seed(&["first-user"]))
            .await?
            .remove(0);
        let mut user_raw = vec![first.raw.clone()];
        let mut history = vec![ChatMessage::user(first.text.clone())];
        let mut usage = AssistantUsage::default();
        let mut turns = 0usize;
        let mut ended_by = "user_terminated";
        if !first.terminated {
            loop {
                let t = turns.to_string();
                let reply = match &model.speaker {
                    Speaker::Model(role) => {
                        let req = self
                            .sampling
                            .request(history.clone())
                            .seed(seed(&["assistant", &t]));
                        let resp = role.backend.chat(&req).await.map_err(|e| SimError::Model {
                            role: format!("model {}", model.label),
                            source: e,
                        })?;
                        usage.calls += 1;
                        usage.cached += u64::from(resp.cached);
                        usage.prompt_tokens += resp.usage.prompt_tokens;
                        usage.completion_tokens += resp.usage.completion_tokens;
                        resp.choices[0].content.clone()
                    }
                    // One draw per conversation: whether it asks is decided by its seed.
                    Speaker::Demonstrator(d) => d
                        .reply(task, &history, seed(&["demonstrator"]))
                        .map_err(SimError::Clarify)?,
                };
                history.push(ChatMessage::assistant(reply));
                turns += 1;
                if turns >= self.max_turns {
                    ended_by = "max_turns";
                    break;
                }
                let next = self
                    .user
                    .next_messages(task, &history, 1, seed(&["user", &t]))
                    .await?
                    .remove(0);
                user_raw.push(next.raw.clone());
                if next.terminated {
                    break;
                }
                history.push(ChatMessage::user(next.text));
            }
        }
        let judged = [self.task_metric, task.task_type.facts().interaction_metric];
        let scores: BTreeMap<String, MetricScore> = join_all(judged.iter().map(|m| {
            let history = &history;
            async move {
                let s = model
                    .scorer
                    .score(m, task, &[], history, seed(&["judge", m]))
                    .await;
                (m.to_string(), s)
            }
        }))
        .await
        .into_iter()
        .collect();
        let read = count_tokens(&model.scorer.tokens, &history, "assistant");
        let typed = count_tokens(&model.scorer.tokens, &history, "user");
        let failures = scores.values().filter(|s| s.value.is_none()).count();
        let mut metrics = serde_json::Map::new();
        for m in judged {
            metrics.insert(m.into(), serde_json::json!(scores[m].value));
        }
        // Upstream's character-level BLEU of the same extracted document, for the paper's
        // numbers (`bleu` stays token-level).
        if let Some(c) = scores
            .get("bleu")
            .and_then(|s| s.detail.as_ref())
            .and_then(|d| d.get("bleu_char"))
        {
            metrics.insert("bleu_char".into(), c.clone());
        }
        // 1 where the judge and the programmatic check of an explicit final answer disagree,
        // 0 where they agree, null where either is missing: its mean is the disagreement rate.
        if let Some(acc) = scores.get("accuracy") {
            let agree = acc.detail.as_ref().and_then(|d| d["agree"].as_bool());
            metrics.insert(
                "accuracy_disagree".into(),
                serde_json::json!(agree.map(|a| if a { 0.0 } else { 1.0 })),
            );
        }
        metrics.insert(
            "tokens_read_k".into(),
            serde_json::json!(read as f64 / 1000.0),
        );
        metrics.insert(
            "tokens_typed_k".into(),
            serde_json::json!(typed as f64 / 1000.0),
        );
        metrics.insert("turns".into(), serde_json::json!(turns));
        if task.task_type == TaskType::Clarify {
            clarify_views(task, &scores, &mut metrics);
        }
        metrics.insert("judge_failures".into(), serde_json::json!(failures));
        let mut record = serde_json::json!({
            "model": model.label,
            "task_id": task.id,
            "repeat": repeat,
            "seed": run_seed,
            "turns": history,
            "metrics": metrics,
            "usage": {
                "assistant_calls": usage.calls,
                "assistant_cached_calls": usage.cached,
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens,
                "tokens_read": read,
                "tokens_typed": typed,
                "tokenizer": model.scorer.tokens.name(),
            },
            "ended_by": ended_by,
            "scores": scores,
            "user_raw": user_raw,
        });
        // The unit that repeats across tasks (a clarify template), for clustered intervals.
        if let Some(t) = clarify::template_of(task) {
            record["template"] = serde_json::json!(t);
            // Which held-out set (near `test`, far `far`) and kind of detail, for studies
            // that report them apart.
            for key in ["split", "kind"] {
                if let Some(v) = task.metadata.get(key).filter(|v| v.is_string()) {
                    record[key] = v.clone();
                }
            }
        }
        Ok(record)
    }
}
