//! The proactive share of a turn's candidates. Upstream CollabLLM prompts an API policy with
//! one user message that holds the whole conversation and asks for a short reasoning step in
//! JSON (`current_problem`, `thought`, `response`), keeping only `response`; its local-model
//! paths instead give a share of the candidates a collaborative system prompt. `auto` follows
//! the same split: the JSON instruction for endpoint policies, the system prompt for local
//! ones (a small local model rarely writes usable JSON).

use serde::{Deserialize, Serialize};

use crate::llm::parse::parse_json_object;
use crate::llm::roles::Role;
use crate::llm::{ChatMessage, ChatRequest, ChatResponse, FinishReason};
use crate::rollout::user::SimError;
use crate::task::prompts::transcript;
use crate::task::prompts::{Prompt, Prompts};
use crate::task::Task;

/// How proactive candidates are prompted (`--proactive-style`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProactiveStyle {
    /// `json` for endpoint policies, `system` for local ones.
    #[default]
    Auto,
    /// Upstream's instruction: the conversation in one user message, a JSON answer.
    Json,
    /// The collaborator system prompt before the conversation.
    System,
}

impl std::str::FromStr for ProactiveStyle {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "json" => Ok(Self::Json),
            "system" => Ok(Self::System),
            _ => Err(format!(
                "unknown proactive style `{s}` (auto, json, system)"
            )),
        }
    }
}

impl ProactiveStyle {
    /// Whether a policy (an endpoint or not) is asked with the JSON instruction.
    pub fn uses_json(self, endpoint: bool) -> bool {
        match self {
            Self::Auto => endpoint,
            Self::Json => true,
            Self::System => false,
        }
    }
}

/// One drawn candidate: the reply text and why it stopped.
pub struct Drawn {
    pub text: String,
    pub finish: FinishReason,
}

/// The user-facing reply of a JSON-style answer: its non-empty `response` string.
pub fn json_response(raw: &str) -> Option<String> {
    let obj = parse_json_object(raw)?;
    let text = obj.get("response")?.as_str()?.trim();
    (!text.is_empty()).then(|| text.to_string())
}

/// Everything one proactive draw needs.
pub struct ProactiveDraw<'a> {
    pub policy: &'a Role,
    pub prompts: &'a Prompts,
    pub style: ProactiveStyle,
    /// Redraws of one sample whose JSON answer is unusable, before it falls back to the
    /// system prompt (a cached rerun would only repeat the same bad answer).
    pub retries: u32,
}

impl ProactiveDraw<'_> {
    /// `n` proactive candidates for `history`; `make` builds the request (sampling, `n`, seed)
    /// around the messages.
    pub async fn draw(
        &self,
        task: &Task,
        history: &[ChatMessage],
        make: impl Fn(Vec<ChatMessage>) -> ChatRequest,
    ) -> Result<Vec<Drawn>, SimError> {
        let system = self.prompts.render(
            Prompt::Proactive,
            serde_json::json!({"task_type": task.task_type.to_string()}),
        )?;
        // A run's own system prompt (`--system-prompt`) stays first; the proactive one
        // follows it in the same system message.
        let (system, rest) = match history.split_first() {
            Some((first, rest)) if first.role == "system" => {
                (format!("{}\n\n{system}", first.content), rest)
            }
            _ => (system, history),
        };
        let system_req = make(
            std::iter::once(ChatMessage::system(system))
                .chain(rest.iter().cloned())
                .collect(),
        );
        if !self.style.uses_json(self.policy.engine.is_none()) {
            let resp = self.call(&system_req).await?;
            return Ok(resp
                .choices
                .into_iter()
                .map(|c| Drawn {
                    text: c.content,
                    finish: c.finish_reason,
                })
                .collect());
        }
        let probe = make(Vec::new());
        // Upstream asks for a reply within half of the answer's cap (1024 of 2048): the JSON
        // wrapper and the reasoning fields take the rest.
        let budget = (probe.max_tokens / 2).max(1);
        let instruction = self.prompts.render(
            Prompt::ProactiveJson,
            serde_json::json!({"conversation": transcript(history),
                "task_type": task.task_type.to_string(), "max_tokens": budget}),
        )?;
        let req = make(vec![ChatMessage::user(instruction)]).json_mode(true);
        let seed = req.seed.unwrap_or(0);
        let resp = self.call(&req).await?;
        let mut out = Vec::with_capacity(resp.choices.len());
        for (i, c) in resp.choices.into_iter().enumerate() {
            let mut drawn = json_response(&c.content).map(|text| Drawn {
                text,
                finish: c.finish_reason,
            });
            let mut attempt = 0u32;
            while drawn.is_none() && attempt < self.retries {
                attempt += 1;
                // A seed outside the batch's range, as the user simulator's redraws.
                let retry = req
                    .clone()
                    .n(1)
                    .seed(seed.wrapping_add((u64::from(attempt) << 32) + i as u64));
                let r = self.call(&retry).await?;
                drawn = r.choices.into_iter().next().and_then(|c| {
                    json_response(&c.content).map(|text| Drawn {
                        text,
                        finish: c.finish_reason,
                    })
                });
            }
            let drawn = match drawn {
                Some(d) => d,
                None => {
                    let fallback = system_req
                        .clone()
                        .n(1)
                        .seed(seed.wrapping_add((u64::from(self.retries + 1) << 32) + i as u64));
                    let r = self.call(&fallback).await?;
                    let c = r
                        .choices
                        .into_iter()
                        .next()
                        .ok_or_else(|| SimError::Model {
                            role: self.policy.name.clone(),
                            source: crate::llm::LlmError::InvalidRequest(
                                "no choice returned".into(),
                            ),
                        })?;
                    Drawn {
                        text: c.content,
                        finish: c.finish_reason,
                    }
                }
            };
            out.push(drawn);
        }
        Ok(out)
    }

    async fn call(&self, req: &ChatRequest) -> Result<ChatResponse, SimError> {
        self.policy
            .backend
            .chat(req)
            .await
            .map_err(|e| SimError::Model {
                role: self.policy.name.clone(),
                source: e,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_response_takes_the_reply_only() {
        let raw = r#"{"current_problem": "p", "thought": "t", "response": " Which base? "}"#;
        assert_eq!(json_response(raw).as_deref(), Some("Which base?"));
        assert_eq!(json_response(r#"{"thought": "t"}"#), None);
        assert_eq!(json_response(r#"{"response": "  "}"#), None);
        assert_eq!(json_response("plain text"), None);
        assert!(ProactiveStyle::Auto.uses_json(true) && !ProactiveStyle::Auto.uses_json(false));
        assert_eq!(
            "system".parse::<ProactiveStyle>(),
            Ok(ProactiveStyle::System)
        );
        assert!("yaml".parse::<ProactiveStyle>().is_err());
    }
}
