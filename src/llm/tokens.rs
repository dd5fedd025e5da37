//! Counting tokens of text for cost metrics: the local model's own tokenizer, or OpenAI's
//! cl100k_base for API models (the recorded name says which).

use std::sync::Arc;

use crate::engine::Engine;

#[derive(Clone)]
pub enum TokenCounter {
    Local(Arc<Engine>),
    Cl100k(Arc<tiktoken_rs::CoreBPE>),
    /// Whitespace-separated words (the verl recipe's token_amount counts words).
    Words,
}

/// Which counter a run uses for `token_amount` and token counts (`--token-counter`).
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "snake_case")]
pub enum TokenCounterKind {
    /// The policy's own tokenizer when it is a local model, else cl100k_base.
    #[default]
    Policy,
    /// OpenAI's cl100k_base for every model, so counts compare across models.
    Cl100k,
    /// Whitespace-separated words (verl's recipe).
    Words,
}

impl TokenCounterKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Policy => "policy",
            Self::Cl100k => "cl100k",
            Self::Words => "words",
        }
    }
}

impl TokenCounter {
    /// cl100k_base, built from the ranks shipped inside the `tiktoken-rs` crate (no download).
    pub fn cl100k() -> Result<Self, String> {
        tiktoken_rs::cl100k_base()
            .map(|b| TokenCounter::Cl100k(Arc::new(b)))
            .map_err(|e| format!("cl100k_base tokenizer: {e}"))
    }

    /// The counter of `kind` for a model whose local engine (if any) is `engine`.
    pub fn of_kind(kind: TokenCounterKind, engine: Option<&Arc<Engine>>) -> Result<Self, String> {
        match (kind, engine) {
            (TokenCounterKind::Policy, Some(e)) => Ok(TokenCounter::Local(e.clone())),
            (TokenCounterKind::Policy | TokenCounterKind::Cl100k, _) => Self::cl100k(),
            (TokenCounterKind::Words, _) => Ok(TokenCounter::Words),
        }
    }

    pub fn count(&self, text: &str) -> usize {
        match self {
            TokenCounter::Local(e) => e
                .tokenizer()
                .encode(text, false)
                .map(|enc| enc.len())
                .unwrap_or_else(|_| text.split_whitespace().count()),
            TokenCounter::Cl100k(b) => b.encode_ordinary(text).len(),
            TokenCounter::Words => text.split_whitespace().count(),
        }
    }

    /// Recorded beside every token count.
    pub fn name(&self) -> String {
        match self {
            TokenCounter::Local(e) => format!("{} tokenizer", e.name()),
            TokenCounter::Cl100k(_) => "cl100k_base".into(),
            TokenCounter::Words => "words".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_pick_their_counter() {
        let words = TokenCounter::of_kind(TokenCounterKind::Words, None).unwrap();
        assert_eq!(words.count("one two  three\nfour"), 4);
        assert_eq!(words.name(), "words");
        let c = TokenCounter::of_kind(TokenCounterKind::Policy, None).unwrap();
        assert_eq!(
            c.name(),
            "cl100k_base",
            "an endpoint policy falls back to cl100k"
        );
        assert_eq!(c.count("hello world"), 2);
    }
}
