//! LLM judges and extractors. API judges answer one user message at temperature 0 in JSON
//! (parsed leniently, retried a bounded number of times); a local judge reads the probability
//! of each score token after a fixed prefix, so even a tiny model always yields a score. A
//! judge that gives no usable answer yields a *missing* score, never a silent 0.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::llm::parse::{extract_fenced_or_all, parse_json_object, score_field};
use crate::llm::prompts::{Prompt, Prompts};
use crate::llm::roles::Role;
use crate::llm::usage::reask;
use crate::llm::{ChatMessage, ChatRequest};

/// How the judge is asked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JudgeMode {
    /// Log-probabilities for local models, JSON for endpoints.
    #[default]
    Auto,
    Json,
    Logprob,
}

impl std::str::FromStr for JudgeMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(JudgeMode::Auto),
            "json" => Ok(JudgeMode::Json),
            "logprob" => Ok(JudgeMode::Logprob),
            _ => Err(format!("unknown judge mode `{s}` (auto, json, logprob)")),
        }
    }
}

/// The verdict of one judge call (or of its retries).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    /// In the metric's native range; `None` = missing.
    pub value: Option<f64>,
    /// `llm-json` or `llm-logprob`.
    pub method: String,
    /// Raw judge output of the last attempt (JSON text, or the option probabilities).
    pub raw: String,
    pub attempts: u32,
}

/// Prefix that opens the judge's reply in log-probability mode.
const LOGPROB_PREFIX: &str = "Score: ";

pub struct Judge {
    pub role: Role,
    pub prompts: Arc<Prompts>,
    pub mode: JudgeMode,
    /// Extra attempts after the first when the answer is unusable or the call fails.
    pub retries: u32,
    pub max_tokens: usize,
}

impl Judge {
    fn effective_mode(&self) -> JudgeMode {
        match self.mode {
            JudgeMode::Auto if self.role.engine.is_some() => JudgeMode::Logprob,
            JudgeMode::Auto => JudgeMode::Json,
            m => m,
        }
    }

    /// Accuracy in {0,1} (the expectation P(correct) in log-probability mode).
    pub async fn accuracy(
        &self,
        goal: &str,
        reference: &str,
        conversation: &str,
        seed: u64,
    ) -> Verdict {
        let ctx = |json: bool| {
            serde_json::json!({"goal": goal, "reference": reference,
                "conversation": conversation, "json": json})
        };
        self.rate(
            Prompt::JudgeAccuracy,
            ctx,
            "accuracy",
            &["0", "1"],
            (0.0, 1.0),
            seed,
        )
        .await
    }

    /// Interactivity in [0,1]: the 1–5 rating mapped linearly.
    pub async fn interactivity(&self, conversation: &str, seed: u64) -> Verdict {
        let ctx = |json: bool| serde_json::json!({"conversation": conversation, "json": json});
        let mut v = self
            .rate(
                Prompt::JudgeInteractivity,
                ctx,
                "interactivity",
                &["1", "2", "3", "4", "5"],
                (1.0, 5.0),
                seed,
            )
            .await;
        v.value = v.value.map(|r| (r - 1.0) / 4.0);
        v
    }

    /// A 1-option-per-score rating: expectation over `options` (valued 0,1,… or 1,2,… per
    /// `range.0`) in log-probability mode, the JSON field `key` otherwise.
    async fn rate(
        &self,
        prompt: Prompt,
        ctx: impl Fn(bool) -> serde_json::Value,
        key: &str,
        options: &[&str],
        range: (f64, f64),
        seed: u64,
    ) -> Verdict {
        match self.effective_mode() {
            JudgeMode::Logprob => {
                let text = match self.prompts.render(prompt, ctx(false)) {
                    Ok(t) => t,
                    Err(e) => return missing("llm-logprob", e.to_string(), 0),
                };
                let opts: Vec<String> = options.iter().map(|s| s.to_string()).collect();
                let mut last = String::new();
                for attempt in 1..=self.retries + 1 {
                    let messages = [ChatMessage::user(text.clone())];
                    let call = self
                        .role
                        .backend
                        .option_probs(&messages, LOGPROB_PREFIX, &opts);
                    match reask(attempt > 1, call).await {
                        Ok(answer) => {
                            let p = answer.probs;
                            let expect: f64 = p
                                .iter()
                                .enumerate()
                                .map(|(i, pi)| pi * (range.0 + i as f64))
                                .sum();
                            let raw =
                                serde_json::to_string(&opts.iter().zip(&p).collect::<Vec<_>>())
                                    .unwrap_or_default();
                            return Verdict {
                                value: Some(expect),
                                method: "llm-logprob".into(),
                                raw,
                                attempts: attempt,
                            };
                        }
                        Err(e) => last = e.to_string(),
                    }
                }
                missing("llm-logprob", last, self.retries + 1)
            }
            _ => {
                let text = match self.prompts.render(prompt, ctx(true)) {
                    Ok(t) => t,
                    Err(e) => return missing("llm-json", e.to_string(), 0),
                };
                let mut last = String::new();
                for attempt in 0..=self.retries {
                    let req = self.request(&text, seed, attempt).json_mode(true);
                    match reask(attempt > 0, self.role.backend.chat(&req)).await {
                        Ok(resp) => {
                            last = resp.choices[0].content.clone();
                            if let Some(v) =
                                parse_json_object(&last).and_then(|o| score_field(&o, key, range))
                            {
                                return Verdict {
                                    value: Some(v),
                                    method: "llm-json".into(),
                                    raw: last,
                                    attempts: attempt + 1,
                                };
                            }
                        }
                        Err(e) => last = format!("error: {e}"),
                    }
                }
                missing("llm-json", last, self.retries + 1)
            }
        }
    }

    /// Temperature 0 first; retries sample (temperature 0.7, other seeds) so that a
    /// deterministic bad answer is not repeated verbatim.
    fn request(&self, text: &str, seed: u64, attempt: u32) -> ChatRequest {
        let req = ChatRequest::new(vec![ChatMessage::user(text.to_string())])
            .max_tokens(self.max_tokens)
            .seed(seed.wrapping_add(u64::from(attempt)));
        if attempt == 0 {
            req.temperature(0.0)
        } else {
            req.temperature(0.7)
        }
    }

    /// The final artefact (document or code) of a conversation as the judge model extracts
    /// it; `None` when every attempt failed.
    pub async fn extract(
        &self,
        prompt: Prompt,
        goal: &str,
        conversation: &str,
        seed: u64,
    ) -> Option<(String, String)> {
        let text = self
            .prompts
            .render(
                prompt,
                serde_json::json!({"goal": goal, "conversation": conversation}),
            )
            .ok()?;
        for attempt in 0..=self.retries {
            let req = self
                .request(&text, seed, attempt)
                .max_tokens(self.max_tokens.max(1024));
            if let Ok(resp) = reask(attempt > 0, self.role.backend.chat(&req)).await {
                let raw = resp.choices[0].content.clone();
                return Some((extract_fenced_or_all(&raw), raw));
            }
        }
        None
    }
}

fn missing(method: &str, raw: String, attempts: u32) -> Verdict {
    Verdict {
        value: None,
        method: method.into(),
        raw,
        attempts,
    }
}
