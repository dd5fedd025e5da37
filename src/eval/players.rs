//! Model-backed 20 Questions players: a questioner (the evaluated assistant model, asked in
//! the chat form of [`chat`](crate::task::twenty_questions::chat): the rules, then its own
//! questions and the answers as turns) and an LLM oracle. Both implement the synchronous traits of
//! [`twenty_questions`](crate::task::twenty_questions) so that [`play`](crate::task::twenty_questions::play)
//! stays the one game loop: each game runs on a blocking thread that waits on the async model
//! call through the runtime handle.

use std::sync::Arc;

use tokio::runtime::Handle;

use crate::llm::roles::Role;
use crate::rollout::user::{derive_seed, Sampling};
use crate::task::prompts::Prompts;
use crate::task::twenty_questions::chat::{
    clean_question, intro_message, normalise_yes_no, oracle_request, questioner_messages,
};
use crate::task::twenty_questions::{Object, Oracle, OracleAnswer, Questioner, World};

/// The assistant model as a questioner. A model error stops the game's model calls; the game
/// is then discarded by the runner (and retried by a rerun), never scored.
pub struct ModelQuestioner {
    pub role: Role,
    pub prompts: Arc<Prompts>,
    pub handle: Handle,
    pub sampling: Sampling,
    pub max_questions: usize,
    /// Seed of this game; question k is drawn with a seed derived from it.
    pub seed: u64,
    /// Raw model outputs, one per question.
    pub raw: Vec<String>,
    pub error: Option<String>,
}

impl Questioner for ModelQuestioner {
    fn next_question(&mut self, history: &[(String, bool)]) -> String {
        if self.error.is_some() {
            return String::new();
        }
        // The chat form `generate_conv` and `rl_train` train on: the intro, then each
        // question as the model wrote it and the oracle's answer.
        let intro = match intro_message(&self.prompts, self.max_questions) {
            Ok(p) => p,
            Err(e) => {
                self.error = Some(e.to_string());
                return String::new();
            }
        };
        let messages = questioner_messages(&intro, history, &self.raw);
        let k = history.len().to_string();
        let req = self
            .sampling
            .request(messages)
            .seed(derive_seed(self.seed, &["question", &k]));
        match self.handle.block_on(self.role.backend.chat(&req)) {
            Ok(resp) => {
                let raw = resp.choices[0].content.clone();
                let q = clean_question(&raw);
                self.raw.push(raw);
                q
            }
            Err(e) => {
                self.error = Some(format!("{}: {e}", self.role.name));
                String::new()
            }
        }
    }
}

/// An LLM oracle: the model decides "Yes."/"No."; the table parser still reads the question so
/// that information gain is computed whenever the table understands it (`parsed`). A reply
/// with neither yes nor no counts as "No." and in `invalid`. `hybrid`: a question the table
/// parses is answered from the table (exact, no model call; counted in `table_answers`), only
/// the others go to the model.
pub struct LlmOracle<'a> {
    pub hybrid: bool,
    pub table_answers: usize,
    pub role: Role,
    pub prompts: Arc<Prompts>,
    pub handle: Handle,
    pub world: &'a World,
    pub seed: u64,
    pub raw: Vec<String>,
    pub invalid: usize,
    pub error: Option<String>,
}

impl Oracle for LlmOracle<'_> {
    fn answer(&mut self, object: &Object, question: &str) -> OracleAnswer {
        let query = self.world.parse(question);
        let parsed = query.as_ref().map(|q| self.world.query_key(q));
        if let (true, Some(q)) = (self.hybrid, &query) {
            self.table_answers += 1;
            return OracleAnswer {
                yes: self.world.eval(q, object.index),
                parsed,
            };
        }
        if self.error.is_some() {
            return OracleAnswer { yes: false, parsed };
        }
        let k = self.raw.len().to_string();
        let seed = derive_seed(self.seed, &["oracle", &k]);
        let req = match oracle_request(&self.prompts, object, question, seed) {
            Ok(r) => r,
            Err(e) => {
                self.error = Some(e.to_string());
                return OracleAnswer { yes: false, parsed };
            }
        };
        match self.handle.block_on(self.role.backend.chat(&req)) {
            Ok(resp) => {
                let raw = resp.choices[0].content.clone();
                let yes = normalise_yes_no(&raw).unwrap_or_else(|| {
                    self.invalid += 1;
                    false
                });
                self.raw.push(raw);
                OracleAnswer { yes, parsed }
            }
            Err(e) => {
                self.error = Some(format!("{}: {e}", self.role.name));
                OracleAnswer { yes: false, parsed }
            }
        }
    }
}
