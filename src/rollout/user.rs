//! The simulated user and the futures it plays out. The simulator knows the task's hidden goal
//! and reveals it gradually; its state is the request itself (task + history), so concurrent
//! rollouts can never leak one task's goal into another. A failed simulation is retried and,
//! when every try fails, an error: never an empty user turn.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::llm::roles::Role;
use crate::llm::{ChatMessage, ChatRequest, LlmError};
use crate::task::clarify;
use crate::task::prompts::{transcript, Prompt, PromptError, Prompts};
use crate::task::twenty_questions::chat::{self, OracleMode};
use crate::task::{Task, UserKind};

#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("{role}: {source}")]
    Model {
        role: String,
        #[source]
        source: LlmError,
    },
    #[error(transparent)]
    Prompt(#[from] PromptError),
    #[error("20 Questions: {0}")]
    TwentyQuestions(String),
    #[error("{0}")]
    Clarify(String),
    #[error(
        "user simulator gave no usable message after {attempts} attempts (last output: {last:?})"
    )]
    NoUserMessage { attempts: u32, last: String },
}

/// Sampling settings of one role.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Sampling {
    pub temperature: f32,
    pub top_p: f32,
    pub max_tokens: usize,
}

impl Sampling {
    /// Accepted temperatures (0 is greedy).
    pub const TEMPERATURE: crate::check::Range = crate::check::Range::at_least(0.0);
    /// Accepted nucleus masses.
    pub const TOP_P: crate::check::Range = crate::check::Range::open_closed(0.0, 1.0);

    /// A request for `messages` with these settings (the one place a role's sampling
    /// becomes request fields).
    pub fn request(&self, messages: Vec<ChatMessage>) -> ChatRequest {
        ChatRequest::new(messages)
            .temperature(self.temperature)
            .top_p(self.top_p)
            .max_tokens(self.max_tokens)
    }
}

impl Default for Sampling {
    /// The assistant's settings for generation: temperature 0.7 and nucleus 0.9 (upstream
    /// CollabLLM samples at 0.8 with no nucleus cut; `--compat upstream` restores that): a
    /// small model at temperature 1 writes mostly off-task text, so its candidates differ in
    /// noise instead of in quality. 2048 new tokens (upstream's cap).
    fn default() -> Self {
        Self {
            temperature: 0.7,
            top_p: 0.9,
            max_tokens: POLICY_MAX_TOKENS,
        }
    }
}

/// Upstream CollabLLM's token caps per role (`--max-tokens ROLE=N`): the assistant (policy and
/// future assistant turns) 2048, the simulated user 1024, a judge 512 (upstream leaves the
/// judge uncapped; its JSON verdict is short), an extraction 2048 (the whole final document
/// or program).
pub const POLICY_MAX_TOKENS: usize = 2048;
pub const USER_MAX_TOKENS: usize = 1024;
pub const JUDGE_MAX_TOKENS: usize = 512;
pub const EXTRACTOR_MAX_TOKENS: usize = 2048;

/// A role whose replies have a token cap (`--max-tokens ROLE=N`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenRole {
    /// The policy's candidates, and the future assistant turns unless `assistant` is given.
    Policy,
    /// Only the assistant turns inside futures.
    Assistant,
    User,
    Judge,
    Extractor,
}

impl TokenRole {
    pub const NAMES: &'static str = "policy, assistant, user, judge, extractor";
}

/// Parses `ROLE=N` (`--max-tokens policy=2048`): a known role and a cap of at least 1.
pub fn parse_role_max_tokens(arg: &str) -> Result<(TokenRole, usize), String> {
    let (role, n) = arg.split_once('=').ok_or_else(|| {
        format!(
            "`{arg}`: expected ROLE=N with ROLE one of {}",
            TokenRole::NAMES
        )
    })?;
    let role = match role.trim() {
        "policy" => TokenRole::Policy,
        "assistant" => TokenRole::Assistant,
        "user" => TokenRole::User,
        "judge" => TokenRole::Judge,
        "extractor" => TokenRole::Extractor,
        other => {
            return Err(format!(
                "`{arg}`: unknown role `{other}` (expected one of {})",
                TokenRole::NAMES
            ))
        }
    };
    let n: usize = n
        .trim()
        .parse()
        .map_err(|_| format!("`{arg}`: the cap must be a whole number of tokens"))?;
    crate::check::at_least(&format!("--max-tokens {}", role_name(role)), n, 1)?;
    Ok((role, n))
}

fn role_name(role: TokenRole) -> &'static str {
    match role {
        TokenRole::Policy => "policy",
        TokenRole::Assistant => "assistant",
        TokenRole::User => "user",
        TokenRole::Judge => "judge",
        TokenRole::Extractor => "extractor",
    }
}

/// One simulated user message.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct UserTurn {
    pub text: String,
    /// The message is (or contains) the termination signal.
    pub terminated: bool,
    /// The simulator's raw output (JSON for API simulators).
    pub raw: String,
}

/// A stable seed for one call site of a run: (run seed, task, turn, purpose, index).
pub fn derive_seed(run_seed: u64, parts: &[&str]) -> u64 {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(run_seed.to_le_bytes());
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p.as_bytes());
    }
    let d = h.finalize();
    // Keep seeds within i64: OpenAI-compatible servers take a signed 64-bit seed.
    u64::from_le_bytes(d[..8].try_into().unwrap_or([0; 8])) >> 1
}

pub struct UserSimulator {
    pub role: Role,
    pub prompts: Arc<Prompts>,
    pub sampling: Sampling,
    pub termination: String,
    /// Ask for `{current_answer, thought, response}` JSON (API models); local models answer in
    /// plain text.
    pub json: bool,
    /// Extra attempts per sample when the output is unusable.
    pub retries: u32,
    /// 20 Questions tasks: who answers the questions (the table, this simulator's model, or
    /// both) and the question budget.
    pub oracle: OracleMode,
    pub max_questions: usize,
}

impl UserSimulator {
    fn prompt(&self, task: &Task, history: &[ChatMessage]) -> Result<String, PromptError> {
        self.prompts.render(
            Prompt::User(task.task_type),
            serde_json::json!({
                "goal": task.prompt,
                "reference": task.reference,
                "show_reference": task.task_type.facts().user_sees_reference,
                "task_type": task.task_type.to_string(),
                "conversation": transcript(history),
                "termination": self.termination,
                "json": self.json,
            }),
        )
    }

    /// `n` independent next user messages for `history` (an empty history asks for the
    /// opening message). Sample `i` is seeded `seed + i`; an unusable sample is redrawn with
    /// another seed, at most `retries` times.
    pub async fn next_messages(
        &self,
        task: &Task,
        history: &[ChatMessage],
        n: usize,
        seed: u64,
    ) -> Result<Vec<UserTurn>, SimError> {
        match task.task_type.facts().user {
            UserKind::Oracle => return self.oracle_turns(task, history, n, seed).await,
            UserKind::Scripted => return self.clarify_turns(task, history, n),
            UserKind::Simulated => {}
        }
        let prompt = self.prompt(task, history)?;
        let req = self
            .sampling
            .request(vec![ChatMessage::user(prompt)])
            .json_mode(self.json)
            .n(n)
            .seed(seed);
        let resp = self.call(&req).await?;
        let mut out = Vec::with_capacity(n);
        for (i, choice) in resp.choices.iter().enumerate() {
            let mut parsed = self.parse(&choice.content);
            let mut last = choice.content.clone();
            let mut attempt = 0;
            while parsed.is_none() && attempt < self.retries {
                attempt += 1;
                // Redraw this one sample with a seed outside the batch's range.
                let retry = req
                    .clone()
                    .n(1)
                    .seed(seed.wrapping_add(((attempt as u64) << 32) + i as u64))
                    .temperature(self.sampling.temperature.max(0.7));
                let r = crate::llm::usage::reask(true, self.call(&retry)).await?;
                last = r.choices[0].content.clone();
                parsed = self.parse(&last);
            }
            out.push(parsed.ok_or(SimError::NoUserMessage {
                attempts: attempt + 1,
                last,
            })?);
        }
        Ok(out)
    }

    /// 20 Questions: the opening (the rules) or the oracle's "Yes."/"No." to the last
    /// question. The answer is deterministic, so the `n` samples are one answer repeated (one
    /// model call at most). The game ends (`terminated`) on a win or when the budget is spent;
    /// `raw` records how the answer was reached (`{"oracle", "parsed", "model"}`).
    async fn oracle_turns(
        &self,
        task: &Task,
        history: &[ChatMessage],
        n: usize,
        seed: u64,
    ) -> Result<Vec<UserTurn>, SimError> {
        let (world, object) = chat::world_and_object(task).map_err(SimError::TwentyQuestions)?;
        let Some(question) = chat::unanswered_question(history) else {
            let intro = chat::intro_message(&self.prompts, self.max_questions)?;
            let turn = UserTurn {
                text: intro.clone(),
                terminated: false,
                raw: intro,
            };
            return Ok(vec![turn; n]);
        };
        let (table_yes, parsed) = chat::table_answer(world, object, &question);
        let ask_model = match self.oracle {
            OracleMode::Table => false,
            OracleMode::Llm => true,
            OracleMode::Hybrid => parsed.is_none(),
        };
        let (yes, model_raw) = if ask_model {
            let req = chat::oracle_request(&self.prompts, object, &question, seed)?;
            let raw = self.call(&req).await?.choices[0].content.clone();
            (chat::normalise_yes_no(&raw).unwrap_or(false), Some(raw))
        } else {
            (table_yes, None)
        };
        let won = chat::wins(world, object, &question, yes);
        let turn = UserTurn {
            text: chat::answer_text(yes).to_string(),
            terminated: won || chat::questions_asked(history) >= self.max_questions,
            raw: serde_json::json!({
                "oracle": if ask_model { "llm" } else { "table" },
                "parsed": parsed,
                "model": model_raw,
                "win": won,
            })
            .to_string(),
        };
        Ok(vec![turn; n])
    }

    /// Clarify-or-answer: the scripted user ([`clarify::user_turn`]) — the request, the
    /// detail after a question, the termination signal after an answer. No model call.
    fn clarify_turns(
        &self,
        task: &Task,
        history: &[ChatMessage],
        n: usize,
    ) -> Result<Vec<UserTurn>, SimError> {
        let said = clarify::user_turn(task, history).map_err(SimError::Clarify)?;
        let turn = match said {
            Some(text) => UserTurn {
                raw: text.clone(),
                text,
                terminated: false,
            },
            None => UserTurn {
                text: self.termination.clone(),
                terminated: true,
                raw: self.termination.clone(),
            },
        };
        Ok(vec![turn; n])
    }

    async fn call(&self, req: &ChatRequest) -> Result<crate::llm::ChatResponse, SimError> {
        self.role
            .backend
            .chat(req)
            .await
            .map_err(|e| SimError::Model {
                role: self.role.name.clone(),
                source: e,
            })
    }

    /// A usable user message from raw simulator output, or `None`.
    pub fn parse(&self, raw: &str) -> Option<UserTurn> {
        let text = if self.json {
            let obj = crate::llm::parse::parse_json_object(raw)?;
            obj.get("response")?.as_str()?.to_string()
        } else {
            clean_plain_user_text(raw)
        };
        let terminated = text.contains(&self.termination);
        let text = if terminated {
            self.termination.clone()
        } else {
            text.trim().to_string()
        };
        if text.is_empty() {
            return None;
        }
        Some(UserTurn {
            text,
            terminated,
            raw: raw.to_string(),
        })
    }
}

/// A small local model often writes the speaker's label or keeps going as the assistant: keep
/// only the user's own words.
fn clean_plain_user_text(raw: &str) -> String {
    let mut t = raw.trim();
    for prefix in ["USER:", "User:", "user:"] {
        if let Some(rest) = t.strip_prefix(prefix) {
            t = rest.trim();
        }
    }
    let cut = [
        "\nAssistant:",
        "\nASSISTANT:",
        "\nassistant:",
        "\nUser:",
        "\nUSER:",
    ]
    .iter()
    .filter_map(|m| t.find(m))
    .min()
    .unwrap_or(t.len());
    t[..cut].trim().trim_matches('"').trim().to_string()
}

/// One simulated continuation of a conversation (the messages after the candidate).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Future {
    pub messages: Vec<ChatMessage>,
    /// Ended by the user's termination signal (rather than the window).
    pub terminated: bool,
    /// Raw simulator outputs, one per user message.
    pub user_raw: Vec<String>,
}

/// Plays a future out from `base` (history + candidate) for at most `window` messages,
/// starting from an already sampled first user message and stopping right after a message
/// that carries the termination signal.
pub async fn rollout_future(
    user: &UserSimulator,
    (assistant, assistant_sampling): (&Role, &Sampling),
    task: &Task,
    base: &[ChatMessage],
    first_user: UserTurn,
    window: usize,
    seed: u64,
) -> Result<Future, SimError> {
    let mut future = Future {
        messages: Vec::new(),
        terminated: false,
        user_raw: Vec::new(),
    };
    let mut next_user = Some(first_user);
    let mut step = 0u64;
    while future.messages.len() < window {
        let turn = match next_user.take() {
            Some(t) => t,
            None => {
                let history = [base, &future.messages[..]].concat();
                let mut turns = user
                    .next_messages(task, &history, 1, seed.wrapping_add(step))
                    .await?;
                turns.remove(0)
            }
        };
        future.user_raw.push(turn.raw.clone());
        future.messages.push(ChatMessage::user(turn.text.clone()));
        if turn.terminated {
            future.terminated = true;
            break;
        }
        if future.messages.len() >= window {
            break;
        }
        let history = [base, &future.messages[..]].concat();
        let req = assistant_sampling
            .request(history)
            .seed(seed.wrapping_add(1000 + step));
        let resp = assistant
            .backend
            .chat(&req)
            .await
            .map_err(|e| SimError::Model {
                role: assistant.name.clone(),
                source: e,
            })?;
        future
            .messages
            .push(ChatMessage::assistant(resp.choices[0].content.clone()));
        step += 1;
    }
    Ok(future)
}
