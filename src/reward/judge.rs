//! LLM judges and extractors. API judges answer one user message at temperature 0 in JSON
//! (parsed leniently, retried a bounded number of times); a local judge reads the probability
//! of each score token after a fixed prefix, so even a tiny model always yields a score. A
//! judge that gives no usable answer yields a *missing* score, never a silent 0.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::llm::parse::{extract_fenced_or_all, parse_json_object, score_field};
use crate::llm::roles::Role;
use crate::llm::usage::reask;
use crate::llm::{ChatMessage, ChatRequest};
use crate::task::prompts::{Prompt, Prompts};

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

/// How the interactivity judge rates, and how its rating becomes the `interactivity` score.
/// Each scale has its own rubric in `judge_interactivity.j2` (variable `scale`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InteractivityScale {
    /// Upstream CollabLLM v2: the judge gives 0 (low), 0.5 (moderate) or 1 (high); used as is.
    #[default]
    V2,
    /// The verl recipe: understanding, clarification and suggestion each in [0, 1]
    /// (levels 0, 0.3, 0.7, 1); the score is their mean.
    Verl,
    /// The paper-era v1 scripts: 1–3, rescaled `(x − 2.5) · 2` (so 1 → −3, 2 → −1, 3 → 1).
    V1,
    /// A 1–5 rating mapped linearly onto [0, 1]: `(x − 1) / 4`.
    Likert5,
}

impl InteractivityScale {
    pub const ALL: [InteractivityScale; 4] = [Self::V2, Self::Verl, Self::V1, Self::Likert5];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::V2 => "v2",
            Self::Verl => "verl",
            Self::V1 => "v1",
            Self::Likert5 => "likert5",
        }
    }

    /// The judge's native rating → the `interactivity` score.
    pub fn rescale(self, rating: f64) -> f64 {
        match self {
            Self::V2 | Self::Verl => rating,
            Self::V1 => (rating - 2.5) * 2.0,
            Self::Likert5 => (rating - 1.0) / 4.0,
        }
    }

    /// Range of the judge's native rating (what a JSON answer must lie in).
    pub fn rating_range(self) -> (f64, f64) {
        match self {
            Self::V2 | Self::Verl => (0.0, 1.0),
            Self::V1 => (1.0, 3.0),
            Self::Likert5 => (1.0, 5.0),
        }
    }

    /// Range of the rescaled `interactivity` score.
    pub fn score_range(self) -> (f64, f64) {
        let (lo, hi) = self.rating_range();
        (self.rescale(lo), self.rescale(hi))
    }

    /// Log-probability mode: the digit the judge answers and the rating each digit stands for.
    fn options(self) -> &'static [(&'static str, f64)] {
        match self {
            Self::V2 => &[("0", 0.0), ("1", 0.5), ("2", 1.0)],
            Self::Verl => &[("0", 0.0), ("1", 0.3), ("2", 0.7), ("3", 1.0)],
            Self::V1 => &[("1", 1.0), ("2", 2.0), ("3", 3.0)],
            Self::Likert5 => &[("1", 1.0), ("2", 2.0), ("3", 3.0), ("4", 4.0), ("5", 5.0)],
        }
    }
}

/// The verl recipe's three sub-scores (JSON keys of its rubric).
pub const VERL_ASPECTS: [&str; 3] = ["understanding", "clarification", "suggestion"];

impl std::fmt::Display for InteractivityScale {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for InteractivityScale {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|x| x.as_str() == s)
            .ok_or_else(|| format!("unknown interactivity scale `{s}` (v2, verl, v1, likert5)"))
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
    /// Token cap of one extraction (the final document or code can be long).
    pub extract_max_tokens: usize,
    pub interactivity_scale: InteractivityScale,
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
            &["accuracy"],
            &[("0", 0.0), ("1", 1.0)],
            (0.0, 1.0),
            seed,
        )
        .await
    }

    /// Interactivity on the configured [`InteractivityScale`], rescaled to its score.
    pub async fn interactivity(&self, conversation: &str, seed: u64) -> Verdict {
        let scale = self.interactivity_scale;
        let ctx = |aspect: Option<&'static str>| {
            move |json: bool| {
                serde_json::json!({"conversation": conversation, "json": json,
                    "scale": scale.as_str(), "aspect": aspect})
            }
        };
        let range = scale.rating_range();
        let mut v =
            if scale == InteractivityScale::Verl && self.effective_mode() == JudgeMode::Logprob {
                // One next-token distribution answers one question: ask each aspect on its own.
                let mut parts = Vec::new();
                for aspect in VERL_ASPECTS {
                    let p = Prompt::JudgeInteractivity;
                    parts.push(
                        self.rate(
                            p,
                            ctx(Some(aspect)),
                            &[aspect],
                            scale.options(),
                            range,
                            seed,
                        )
                        .await,
                    );
                }
                mean_verdict(parts)
            } else {
                let keys: &[&str] = if scale == InteractivityScale::Verl {
                    &VERL_ASPECTS
                } else {
                    &["interactivity"]
                };
                let p = Prompt::JudgeInteractivity;
                self.rate(p, ctx(None), keys, scale.options(), range, seed)
                    .await
            };
        v.value = v.value.map(|r| scale.rescale(r));
        v
    }

    /// A rating: in log-probability mode the expectation over `options` (answer digit, rating);
    /// otherwise the mean of the JSON fields `keys`, each inside `range` (one bad field makes the
    /// answer unusable and retried).
    async fn rate(
        &self,
        prompt: Prompt,
        ctx: impl Fn(bool) -> serde_json::Value,
        keys: &[&str],
        options: &[(&str, f64)],
        range: (f64, f64),
        seed: u64,
    ) -> Verdict {
        match self.effective_mode() {
            JudgeMode::Logprob => {
                let text = match self.prompts.render(prompt, ctx(false)) {
                    Ok(t) => t,
                    Err(e) => return missing("llm-logprob", e.to_string(), 0),
                };
                let opts: Vec<String> = options.iter().map(|(o, _)| o.to_string()).collect();
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
                            let expect: f64 =
                                p.iter().zip(options).map(|(pi, (_, v))| pi * v).sum();
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
                            if let Some(v) = parse_json_object(&last)
                                .and_then(|o| mean_of_fields(&o, keys, range))
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
                .max_tokens(self.extract_max_tokens);
            if let Ok(resp) = reask(attempt > 0, self.role.backend.chat(&req)).await {
                let raw = resp.choices[0].content.clone();
                return Some((extract_fenced_or_all(&raw), raw));
            }
        }
        None
    }
}

/// The mean of the fields `keys` of a judge's JSON answer, each a score inside `range`.
fn mean_of_fields(
    obj: &serde_json::Map<String, serde_json::Value>,
    keys: &[&str],
    range: (f64, f64),
) -> Option<f64> {
    let mut sum = 0.0;
    for k in keys {
        sum += score_field(obj, k, range)?;
    }
    Some(sum / keys.len() as f64)
}

/// Several ratings of one conversation (the verl aspects) as one verdict: their mean, missing
/// when any is; raw outputs kept in order.
fn mean_verdict(parts: Vec<Verdict>) -> Verdict {
    let n = parts.len() as f64;
    let value = parts
        .iter()
        .map(|v| v.value)
        .sum::<Option<f64>>()
        .map(|s| s / n);
    Verdict {
        value,
        method: parts.first().map_or(String::new(), |v| v.method.clone()),
        raw: serde_json::to_string(&parts.iter().map(|v| &v.raw).collect::<Vec<_>>())
            .unwrap_or_default(),
        attempts: parts.iter().map(|v| v.attempts).sum(),
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::llm::scripted::ScriptedBackend;

    /// A JSON-mode judge whose every answer is `reply`.
    pub(crate) fn judge(scale: InteractivityScale, reply: &'static str) -> Judge {
        let backend = ScriptedBackend::new("judge", move |_, _| Ok(reply.to_string()));
        Judge {
            role: Role::from_backend("judge", "scripted", backend, None, None),
            prompts: Arc::new(Prompts::builtin().unwrap()),
            mode: JudgeMode::Json,
            retries: 0,
            max_tokens: 512,
            extract_max_tokens: 2048,
            interactivity_scale: scale,
        }
    }

    #[test]
    fn scales_rescale_to_hand_computed_values() {
        use InteractivityScale::*;
        assert_eq!(V2.rescale(0.5), 0.5);
        assert_eq!([1.0, 2.0, 3.0].map(|x| V1.rescale(x)), [-3.0, -1.0, 1.0]);
        assert_eq!([1.0, 3.0, 5.0].map(|x| Likert5.rescale(x)), [0.0, 0.5, 1.0]);
        assert_eq!(V1.score_range(), (-3.0, 1.0));
        assert_eq!(InteractivityScale::default(), V2);
        assert_eq!("verl".parse::<InteractivityScale>(), Ok(Verl));
        assert!("1-5".parse::<InteractivityScale>().is_err());
    }

    #[tokio::test]
    async fn each_scale_asks_its_rubric_and_scores_on_it() {
        use InteractivityScale::*;
        let cases: [(InteractivityScale, &str, Option<f64>); 7] = [
            (V2, r#"{"thought": "t", "interactivity": 0.5}"#, Some(0.5)),
            (V2, r#"{"thought": "t", "interactivity": 3}"#, None),
            (V1, r#"{"thought": "t", "interactivity": 2}"#, Some(-1.0)),
            (V1, r#"{"thought": "t", "interactivity": 3}"#, Some(1.0)),
            (
                Likert5,
                r#"{"thought": "t", "interactivity": 4}"#,
                Some(0.75),
            ),
            (
                Verl,
                r#"{"thought": "t", "understanding": 1, "clarification": 0.3, "suggestion": 0.7}"#,
                Some(2.0 / 3.0),
            ),
            // One sub-score missing: unusable, so missing (never a silent partial mean).
            (
                Verl,
                r#"{"thought": "t", "understanding": 1, "clarification": 0.3}"#,
                None,
            ),
        ];
        for (scale, reply, want) in cases {
            let v = judge(scale, reply)
                .interactivity("User: hi\n\nAssistant: hello", 1)
                .await;
            match (v.value, want) {
                (Some(a), Some(b)) => assert!((a - b).abs() < 1e-12, "{scale}: {a} vs {b}"),
                (a, b) => assert_eq!(a, b, "{scale} {reply}"),
            }
        }
        let p = Prompts::builtin().unwrap();
        let render = |scale: &str, json: bool| {
            p.render(
                Prompt::JudgeInteractivity,
                serde_json::json!({"conversation": "c", "json": json, "scale": scale, "aspect": null}),
            )
            .unwrap()
        };
        assert!(render("v2", true).contains("<0, 0.5 or 1>"));
        assert!(render("v1", true).contains("<1, 2 or 3>"));
        assert!(render("likert5", true).contains("from 1 to 5"));
        let verl = render("verl", true);
        assert!(
            VERL_ASPECTS
                .iter()
                .all(|a| verl.contains(&format!("\"{a}\""))),
            "{verl}"
        );
        assert!(render("v2", false).contains("single digit"));
    }
}
