//! Who asks the questions inside a 20 Questions future, and the demonstrator as a chat
//! backend for it.
//!
//! A future that plays the game out values a candidate question by the game it leads to. With
//! the policy asking the later questions that value mixes the candidate with the policy's own
//! skill; with the demonstrator (a fixed competent continuation) it is how well the game goes
//! from the state the candidate leaves, which is what a question should be judged by.

use std::str::FromStr;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use super::chat::{answered_questions, default_world};
use super::{DemonstratorQuestioner, Questioner, World};
use crate::llm::{
    BackendId, ChatBackend, ChatMessage, ChatRequest, ChatResponse, Choice, FinishReason, LlmError,
    TokenUsage,
};

/// Who asks the questions after the candidate inside a future.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FutureQuestioner {
    /// The futures' assistant model (the policy unless `assistant` names another).
    #[default]
    Policy,
    /// The demonstrator: a draw among the top questions by expected gain, then guesses.
    Demonstrator,
}

impl FutureQuestioner {
    pub fn as_str(self) -> &'static str {
        match self {
            FutureQuestioner::Policy => "policy",
            FutureQuestioner::Demonstrator => "demonstrator",
        }
    }
}

impl std::fmt::Display for FutureQuestioner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for FutureQuestioner {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "policy" => Ok(FutureQuestioner::Policy),
            "demonstrator" => Ok(FutureQuestioner::Demonstrator),
            other => Err(format!("`{other}`: expected policy or demonstrator")),
        }
    }
}

/// The demonstrator's question for the game of `messages` (the questions answered so far are
/// read from the assistant and user turns), drawn with `seed`.
pub fn demonstrator_question(world: &World, messages: &[ChatMessage], seed: u64) -> String {
    DemonstratorQuestioner::new(world, seed).next_question(&answered_questions(messages))
}

/// The demonstrator behind the chat interface, so a future's assistant turns can be its
/// questions. Costs no model call; choice `i` is drawn with the request's seed + `i`.
pub struct DemonstratorBackend {
    id: BackendId,
    world: &'static World,
}

impl DemonstratorBackend {
    /// Over the bundled object table.
    pub fn new() -> Result<Self, String> {
        Ok(Self {
            id: BackendId {
                kind: "builtin".into(),
                model: "20q-demonstrator".into(),
                endpoint: String::new(),
            },
            world: default_world()?,
        })
    }
}

#[async_trait]
impl ChatBackend for DemonstratorBackend {
    fn id(&self) -> &BackendId {
        &self.id
    }

    async fn chat(&self, req: &ChatRequest) -> Result<ChatResponse, LlmError> {
        req.validate()?;
        let seed = req.seed.unwrap_or(0);
        let choices = (0..req.n)
            .map(|i| Choice {
                index: i,
                content: demonstrator_question(
                    self.world,
                    &req.messages,
                    seed.wrapping_add(i as u64),
                ),
                finish_reason: FinishReason::Stop,
                token_ids: None,
                logprobs: None,
            })
            .collect();
        Ok(ChatResponse {
            choices,
            usage: TokenUsage::default(),
            model: self.id.model.clone(),
            retries: 0,
            cached: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::task::twenty_questions::chat::questioner_messages;

    /// The backend's choice `i` is the demonstrator's question on the same answered questions
    /// with seed + `i`, whatever else the messages hold.
    #[tokio::test]
    async fn the_backend_asks_what_the_demonstrator_asks() {
        let world = default_world().unwrap();
        let history = vec![
            (world.attribute_question(0).unwrap().to_string(), true),
            (world.attribute_question(3).unwrap().to_string(), false),
        ];
        let messages = questioner_messages("the rules", &history, &[]);
        let backend = DemonstratorBackend::new().unwrap();
        let req = ChatRequest::new(messages).n(3).seed(41);
        let resp = backend.chat(&req).await.unwrap();
        for (i, choice) in resp.choices.iter().enumerate() {
            let mut demo = DemonstratorQuestioner::new(world, 41 + i as u64);
            assert_eq!(choice.content, demo.next_question(&history));
            assert!(world.parse(&choice.content).is_some());
        }
        assert_eq!(
            "demonstrator".parse::<FutureQuestioner>(),
            Ok(FutureQuestioner::Demonstrator)
        );
        assert!("oracle".parse::<FutureQuestioner>().is_err());
    }
}
