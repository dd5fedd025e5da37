//! Model-backed 20 Questions players: a questioner (the evaluated assistant model, prompted
//! with the game so far) and an LLM oracle. Both implement the synchronous traits of
//! [`twenty_questions`](crate::task::twenty_questions) so that [`play`](crate::task::twenty_questions::play)
//! stays the one game loop: each game runs on a blocking thread that waits on the async model
//! call through the runtime handle.

use std::sync::Arc;

use tokio::runtime::Handle;

use crate::llm::roles::Role;
use crate::llm::{ChatMessage, ChatRequest};
use crate::rollout::user::{derive_seed, Sampling};
use crate::task::prompts::{Prompt, Prompts};
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
        let turns: Vec<serde_json::Value> = history
            .iter()
            .map(|(q, yes)| {
                serde_json::json!({"question": q, "answer": if *yes { "Yes." } else { "No." }})
            })
            .collect();
        let prompt = match self.prompts.render(
            Prompt::TwentyQuestionsQuestioner,
            serde_json::json!({
                "history": turns,
                "questions_left": self.max_questions.saturating_sub(history.len()),
                "max_questions": self.max_questions,
            }),
        ) {
            Ok(p) => p,
            Err(e) => {
                self.error = Some(e.to_string());
                return String::new();
            }
        };
        let k = history.len().to_string();
        let req = ChatRequest::new(vec![ChatMessage::user(prompt)])
            .temperature(self.sampling.temperature)
            .top_p(self.sampling.top_p)
            .max_tokens(self.sampling.max_tokens)
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

/// The model's reply as one question line: the first line with a question mark, cut after
/// it, without speaker labels, list markers, quotes or a lead-in sentence ("Great! Is it …?"
/// → "Is it …?"). Without a question mark, the first line with one added.
pub fn clean_question(raw: &str) -> String {
    let lines: Vec<String> = raw
        .lines()
        .map(strip_line_decoration)
        .filter(|l| !l.is_empty())
        .collect();
    let Some(line) = lines
        .iter()
        .find(|l| l.contains('?'))
        .or_else(|| lines.first())
    else {
        return String::new();
    };
    let mut q = match line.find('?') {
        Some(i) => line[..=i].to_string(),
        None => format!("{}?", line.trim_end_matches(['.', '!', ':', ' '])),
    };
    // Drop a lead-in sentence before the question itself.
    if let Some(cut) = [". ", "! ", ": "]
        .iter()
        .filter_map(|sep| q.rfind(sep).map(|i| i + sep.len()))
        .max()
    {
        if cut < q.len() - 1 {
            q = q[cut..].to_string();
        }
    }
    let q = q
        .trim()
        .trim_matches(['"', '\'', '*', '`'])
        .trim()
        .to_string();
    q.chars().take(300).collect()
}

fn strip_line_decoration(line: &str) -> String {
    let mut t = line.trim();
    loop {
        let before = t;
        t = t
            .trim_start_matches(['-', '*', '#', '>', '"', '\'', '`'])
            .trim();
        for label in [
            "question:",
            "q:",
            "assistant:",
            "questioner:",
            "my question:",
            "next question:",
        ] {
            // `get` keeps the cut on a char boundary (model output can be any UTF-8).
            if t.get(..label.len())
                .is_some_and(|head| head.eq_ignore_ascii_case(label))
            {
                t = t[label.len()..].trim();
            }
        }
        // "1." / "12)" list numbers.
        let digits = t.chars().take_while(char::is_ascii_digit).count();
        if digits > 0 && t[digits..].starts_with(['.', ')']) {
            t = t[digits + 1..].trim();
        }
        if t == before {
            return t.trim_end_matches(['"', '\'', '*', '`']).trim().to_string();
        }
    }
}

/// "Yes."/"No." from an oracle model's reply: the first word that is yes or no (case and
/// punctuation ignored); `None` when neither appears.
pub fn normalise_yes_no(raw: &str) -> Option<bool> {
    raw.split(|c: char| !c.is_alphanumeric())
        .map(str::to_ascii_lowercase)
        .find_map(|w| match w.as_str() {
            "yes" => Some(true),
            "no" => Some(false),
            _ => None,
        })
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
        let prompt = match self.prompts.render(
            Prompt::TwentyQuestionsOracle,
            serde_json::json!({
                "object": object.name,
                "names": object.variants.join(", "),
                "question": question,
            }),
        ) {
            Ok(p) => p,
            Err(e) => {
                self.error = Some(e.to_string());
                return OracleAnswer { yes: false, parsed };
            }
        };
        let k = self.raw.len().to_string();
        let req = ChatRequest::new(vec![ChatMessage::user(prompt)])
            .temperature(0.0)
            .max_tokens(8)
            .seed(derive_seed(self.seed, &["oracle", &k]));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_become_one_question_line() {
        let cases = [
            ("Is it an animal?", "Is it an animal?"),
            ("  Is it an animal?  Let me think more.", "Is it an animal?"),
            ("Question: Is it alive?", "Is it alive?"),
            ("Q: Can it fly?\nA: ...", "Can it fly?"),
            ("Assistant: Is it a dog?", "Is it a dog?"),
            (
                "3. Is it bigger than a person?",
                "Is it bigger than a person?",
            ),
            ("- \"Is it a fruit?\"", "Is it a fruit?"),
            ("**Is it made of metal?**", "Is it made of metal?"),
            ("Great! Is it a vehicle?", "Is it a vehicle?"),
            ("OK. So far so good. Is it a pet?", "Is it a pet?"),
            ("Sure thing.\n\nIs it edible? I think so.", "Is it edible?"),
            ("Is it a cat", "Is it a cat?"),
            ("Is it a cat.", "Is it a cat?"),
            ("Is it a cat .", "Is it a cat?"),
            ("My question: is it soft?", "is it soft?"),
            ("", ""),
            ("\n  \n", ""),
            (
                "%\u{fffd}\u{fffd}7V\u{fffd}",
                "%\u{fffd}\u{fffd}7V\u{fffd}?",
            ),
            ("Q\u{e9}: est-ce un chat ?", "est-ce un chat ?"),
            ("日本語? はい", "日本語?"),
        ];
        for (raw, want) in cases {
            assert_eq!(clean_question(raw), want, "{raw:?}");
        }
        assert!(clean_question(&"a".repeat(1000)).chars().count() <= 300);
    }

    #[test]
    fn oracle_replies_normalise_to_yes_or_no() {
        for (raw, want) in [
            ("Yes.", Some(true)),
            ("yes", Some(true)),
            ("YES!", Some(true)),
            ("No.", Some(false)),
            ("no, it is not", Some(false)),
            ("Answer: Yes", Some(true)),
            ("Nope", None),
            ("I cannot say", None),
            ("Not sure... no.", Some(false)),
            ("", None),
        ] {
            assert_eq!(normalise_yes_no(raw), want, "{raw:?}");
        }
    }
}
