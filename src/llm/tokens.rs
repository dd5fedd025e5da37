//! Counting tokens of text for cost metrics: the local model's own tokenizer, or OpenAI's
//! cl100k_base for API models (the recorded name says which).

use std::sync::Arc;

use super::engine::Engine;

#[derive(Clone)]
pub enum TokenCounter {
    Local(Arc<Engine>),
    Cl100k(Arc<tiktoken_rs::CoreBPE>),
}

impl TokenCounter {
    /// cl100k_base, built from the ranks shipped inside the `tiktoken-rs` crate (no download).
    pub fn cl100k() -> Result<Self, String> {
        tiktoken_rs::cl100k_base()
            .map(|b| TokenCounter::Cl100k(Arc::new(b)))
            .map_err(|e| format!("cl100k_base tokenizer: {e}"))
    }

    pub fn count(&self, text: &str) -> usize {
        match self {
            TokenCounter::Local(e) => e
                .tokenizer()
                .encode(text, false)
                .map(|enc| enc.len())
                .unwrap_or_else(|_| text.split_whitespace().count()),
            TokenCounter::Cl100k(b) => b.encode_ordinary(text).len(),
        }
    }

    /// Recorded beside every token count.
    pub fn name(&self) -> String {
        match self {
            TokenCounter::Local(e) => format!("{} tokenizer", e.name()),
            TokenCounter::Cl100k(_) => "cl100k_base".into(),
        }
    }
}
