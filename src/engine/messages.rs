//! The plain data the engine reads and answers with, shared with every backend: chat messages,
//! why a generation stopped, and option probabilities.

use serde::{Deserialize, Serialize};

/// One chat message in the OpenAI shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// One alternative at a sampled position: its token and log-probability.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TopLogprob {
    pub id: u32,
    /// The token's text on its own (a piece of a character decodes to U+FFFD).
    pub token: String,
    /// The bytes the token stands for (a piece of a character has its part).
    #[serde(default)]
    pub bytes: Vec<u8>,
    pub logprob: f32,
}

/// A sampled token's log-probability under the model (log-softmax of its logits, before
/// temperature and nucleus cuts) and the most likely tokens at its position.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    pub id: u32,
    /// The token's text on its own (a piece of a character decodes to U+FFFD).
    pub token: String,
    /// The bytes the token stands for: joined over a reply's tokens, its text exactly.
    #[serde(default)]
    pub bytes: Vec<u8>,
    pub logprob: f32,
    /// Most likely first; as many as asked (at most 20).
    pub top: Vec<TopLogprob>,
}

/// Why a choice stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// End-of-turn token or a stop string.
    Stop,
    /// `max_tokens` (or the context window) was reached.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Probabilities of a fixed set of options as the next tokens after a prompt (log-probability
/// judging).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptionProbs {
    /// One probability per option, summing to 1.
    pub probs: Vec<f64>,
    /// Tokens of the scored prompt.
    pub prompt_tokens: u64,
    /// True when the answer came from the request cache.
    #[serde(default)]
    pub cached: bool,
}
