//! On-policy RL training core: the training half of `rl_train`.
//! The rollout half samples [`Group`]s of responses and scores them with the multiturn-aware
//! reward; this half turns groups into advantages ([`advantage`]), token batches
//! ([`batch`]), PPO/GRPO updates ([`loss`], [`step`]), weights for the sampler ([`sync`]) and
//! resumable state ([`state`]).

pub(crate) mod advantage;
pub mod batch;
pub mod config;
pub mod loss;
pub(crate) mod rollout;
pub mod run;
pub mod state;
pub mod step;
pub mod sync;

/// One sampled response of a group, with its multiturn-aware reward.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ScoredResponse {
    /// The assistant reply as sampled.
    pub text: String,
    /// MR; `None` = no valid score: the response leaves its group.
    pub reward: Option<f64>,
    /// Per-metric mean over the sampled futures.
    pub metrics: std::collections::BTreeMap<String, f64>,
    /// Hit `max_new_tokens`.
    pub truncated: bool,
    /// The token ids the sampler drew (the end-of-turn token included when sampled): what
    /// trains. `None` (an old rollout file) re-tokenizes `text` with the chat template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// n responses to one prompt (a conversation prefix ending in a user turn).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Group {
    pub task_id: String,
    /// System message first if any.
    pub prompt: Vec<crate::llm::ChatMessage>,
    pub responses: Vec<ScoredResponse>,
}
