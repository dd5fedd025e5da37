//! 20 Questions as a conversation: the form in which `generate_conv` and `rl_train`
//! play it and `eval_multiturn`'s model questioner is asked, so a model is evaluated in the
//! form it was trained on.
//!
//! The first user message states the game (never empty); every assistant message is one
//! question; the user (the oracle, who knows the object) answers each with "Yes." or "No.".
//! A game ends on a win or after `max_questions` questions.
//!
//! Objects are split train/test by object with a fixed hash, per category, so that no test
//! object is ever trained on and the split never moves when code or dependencies change.

use std::str::FromStr;
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{is_win, Object, World, WorldDataError};
use crate::llm::{ChatMessage, ChatRequest};
use crate::task::prompts::{Prompt, PromptError, Prompts};
use crate::task::{Task, TaskType};

/// The salt of the object split; changing it changes which objects are held out.
const SPLIT_SALT: &str = "collabllm-rs 20q split v1";
/// Share of each category held out for evaluation (at least one object per category).
pub const TEST_FRACTION: f64 = 0.2;

/// Which objects: the training split, the held-out test split, or all 158.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ObjectSplit {
    #[default]
    Train,
    Test,
    All,
}

impl ObjectSplit {
    pub fn as_str(self) -> &'static str {
        match self {
            ObjectSplit::Train => "train",
            ObjectSplit::Test => "test",
            ObjectSplit::All => "all",
        }
    }
}

impl std::fmt::Display for ObjectSplit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ObjectSplit {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "train" => Ok(ObjectSplit::Train),
            "test" => Ok(ObjectSplit::Test),
            "all" => Ok(ObjectSplit::All),
            other => Err(format!("`{other}`: expected train, test or all")),
        }
    }
}

/// Who answers the questioner: the attribute `table` (exact; a question it cannot parse is
/// answered "No.", LMRL-Gym's rule, and counted), the user model (`llm`), or `hybrid` (the
/// table when the question parses, the model otherwise).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OracleMode {
    #[default]
    Table,
    Llm,
    Hybrid,
}

impl OracleMode {
    pub fn as_str(self) -> &'static str {
        match self {
            OracleMode::Table => "table",
            OracleMode::Llm => "llm",
            OracleMode::Hybrid => "hybrid",
        }
    }
}

impl std::fmt::Display for OracleMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for OracleMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "table" => Ok(OracleMode::Table),
            "llm" => Ok(OracleMode::Llm),
            "hybrid" => Ok(OracleMode::Hybrid),
            other => Err(format!("`{other}`: expected table, llm or hybrid")),
        }
    }
}

/// The bundled world, loaded once per process.
pub fn default_world() -> Result<&'static World, String> {
    static WORLD: OnceLock<Result<World, String>> = OnceLock::new();
    WORLD
        .get_or_init(|| World::load_default().map_err(|e: WorldDataError| e.to_string()))
        .as_ref()
        .map_err(Clone::clone)
}

fn split_key(name: &str) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(SPLIT_SALT.as_bytes());
    h.update(name.as_bytes());
    h.finalize().into()
}

/// Object indices of a split, in task order. Per category (in the order categories first
/// appear), the objects with the smallest hash of (salt, name) are held out:
/// `max(1, round(TEST_FRACTION × size))` of them.
pub fn split_objects(world: &World, split: ObjectSplit) -> Vec<usize> {
    if split == ObjectSplit::All {
        return (0..world.objects.len()).collect();
    }
    let mut categories: Vec<&str> = Vec::new();
    for o in &world.objects {
        if !categories.contains(&o.category.as_str()) {
            categories.push(&o.category);
        }
    }
    let mut test = vec![false; world.objects.len()];
    for c in categories {
        let mut members: Vec<&Object> = world.objects.iter().filter(|o| o.category == c).collect();
        members.sort_by_key(|o| split_key(&o.name));
        let k = ((members.len() as f64 * TEST_FRACTION).round() as usize).max(1);
        for o in members.into_iter().take(k) {
            test[o.index] = true;
        }
    }
    (0..world.objects.len())
        .filter(|&i| test[i] == (split == ObjectSplit::Test))
        .collect()
}

/// The id of an object's task: `20q-<index>-<name>` (stable, sortable, readable).
pub fn task_id(object: &Object) -> String {
    let slug: String = object
        .name
        .to_ascii_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    format!("20q-{:03}-{slug}", object.index)
}

/// One task per object of `split`: the hidden goal is the object; `reference` its name;
/// `metadata` its index, category, accepted names and split.
pub fn object_tasks(world: &World, split: ObjectSplit) -> Vec<Task> {
    let test = split_objects(world, ObjectSplit::Test);
    split_objects(world, split)
        .into_iter()
        .map(|i| {
            let o = &world.objects[i];
            let in_split = if test.contains(&i) { "test" } else { "train" };
            Task {
                id: task_id(o),
                task_type: TaskType::TwentyQuestions,
                prompt: format!(
                    "20 Questions: the hidden object is {} (category: {}).",
                    o.name, o.category
                ),
                reference: o.name.clone(),
                metadata: serde_json::json!({
                    "object_index": o.index,
                    "category": o.category,
                    "names": o.variants,
                    "split": in_split,
                }),
            }
        })
        .collect()
}

/// The object a 20 Questions task is about: `metadata.object_index` when it names the same
/// object as the reference, else the object the reference (or the id) names.
pub fn object_of_task<'w>(world: &'w World, task: &Task) -> Option<&'w Object> {
    if task.task_type != TaskType::TwentyQuestions {
        return None;
    }
    let by_name = world.find(&task.reference);
    if let Some(i) = task.metadata.get("object_index").and_then(|v| v.as_u64()) {
        let o = world.objects.get(i as usize)?;
        return match by_name {
            Some(n) if n.index != o.index => None,
            _ => Some(o),
        };
    }
    by_name
}

/// The opening user message: the rules and the question budget (the questioner prompt with
/// an empty history).
pub fn intro_message(prompts: &Prompts, max_questions: usize) -> Result<String, PromptError> {
    prompts.render(
        Prompt::TwentyQuestionsQuestioner,
        serde_json::json!({
            "history": [],
            "questions_left": max_questions,
            "max_questions": max_questions,
        }),
    )
}

/// The request that asks an LLM oracle about `question` (the oracle prompt, greedy, a few
/// tokens: its answer is read with [`normalise_yes_no`]). One definition for the user
/// simulator of generation and RL and for evaluation's oracle.
pub fn oracle_request(
    prompts: &Prompts,
    object: &Object,
    question: &str,
    seed: u64,
) -> Result<ChatRequest, PromptError> {
    let prompt = prompts.render(
        Prompt::TwentyQuestionsOracle,
        serde_json::json!({
            "object": object.name,
            "names": object.variants.join(", "),
            "question": question,
        }),
    )?;
    Ok(ChatRequest::new(vec![ChatMessage::user(prompt)])
        .temperature(0.0)
        .max_tokens(8)
        .seed(seed))
}

/// The bundled world and the object a 20 Questions task is about, or why there is none.
pub fn world_and_object(task: &Task) -> Result<(&'static World, &'static Object), String> {
    let world = default_world()?;
    let object = object_of_task(world, task).ok_or_else(|| {
        format!(
            "task {}: its reference `{}` names none of the 20 Questions objects",
            task.id, task.reference
        )
    })?;
    Ok((world, object))
}

/// [`demonstrator_prefix`] of a 20 Questions task's object.
pub fn task_prefix(
    task: &Task,
    intro: &str,
    max_questions: usize,
    max_prefix: usize,
    seed: u64,
) -> Result<Vec<ChatMessage>, String> {
    let (world, object) = world_and_object(task)?;
    Ok(demonstrator_prefix(
        world,
        intro,
        object,
        max_questions,
        max_prefix,
        seed,
    ))
}

/// A mid-game prefix of a game of `object`: the rules, then `k` questions of the
/// [`DemonstratorQuestioner`](super::DemonstratorQuestioner) with the table's answers, `k`
/// drawn uniformly from `0..=max_prefix` (at most `max_questions − 1`, so a question is
/// left). The prefix stops before a winning question, so the game is still open. All draws
/// come from `seed`: the same seed gives the same prefix.
pub fn demonstrator_prefix(
    world: &World,
    intro: &str,
    object: &Object,
    max_questions: usize,
    max_prefix: usize,
    seed: u64,
) -> Vec<ChatMessage> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let k = rng
        .random_range(0..=max_prefix)
        .min(max_questions.saturating_sub(1));
    let mut demo = super::DemonstratorQuestioner::new(world, rng.random());
    let mut history: Vec<(String, bool)> = Vec::new();
    use super::Questioner as _;
    while history.len() < k {
        let q = demo.next_question(&history);
        let (yes, _) = table_answer(world, object, &q);
        if wins(world, object, &q, yes) {
            break;
        }
        history.push((q, yes));
    }
    questioner_messages(intro, &history, &[])
}

/// The conversation a chat questioner sees: the intro, then each question as an assistant
/// message (`raw` when given: what the model itself wrote) and the answer as a user message.
pub fn questioner_messages(
    intro: &str,
    history: &[(String, bool)],
    raw: &[String],
) -> Vec<ChatMessage> {
    let mut out = vec![ChatMessage::user(intro.to_string())];
    for (k, (q, yes)) in history.iter().enumerate() {
        out.push(ChatMessage::assistant(
            raw.get(k).cloned().unwrap_or_else(|| q.clone()),
        ));
        out.push(ChatMessage::user(answer_text(*yes).to_string()));
    }
    out
}

/// "Yes." or "No.".
pub fn answer_text(yes: bool) -> &'static str {
    if yes {
        "Yes."
    } else {
        "No."
    }
}

/// The (question, answer-was-yes) pairs of a conversation: each assistant message (cleaned to
/// one question line) with the user message that follows it. User messages before the first
/// question (the intro) are skipped; a trailing question without an answer is left out.
pub fn answered_questions(messages: &[ChatMessage]) -> Vec<(String, bool)> {
    let mut out = Vec::new();
    let mut pending: Option<String> = None;
    for m in messages {
        match m.role.as_str() {
            "assistant" => pending = Some(clean_question(&m.content)),
            "user" => {
                if let Some(q) = pending.take() {
                    out.push((q, normalise_yes_no(&m.content).unwrap_or(false)));
                }
            }
            _ => {}
        }
    }
    out
}

/// The last assistant message when no user message follows it (a question still unanswered).
pub fn unanswered_question(messages: &[ChatMessage]) -> Option<String> {
    let last = messages.iter().rev().find(|m| m.role != "system")?;
    (last.role == "assistant").then(|| clean_question(&last.content))
}

/// Number of questions asked (assistant messages).
pub fn questions_asked(messages: &[ChatMessage]) -> usize {
    messages.iter().filter(|m| m.role == "assistant").count()
}

/// The table's answer to `question` about `object`: `(yes, parsed key)`; an unparsed question
/// is "No." with no key.
pub fn table_answer(world: &World, object: &Object, question: &str) -> (bool, Option<String>) {
    match world.parse(question) {
        Some(q) => (world.eval(&q, object.index), Some(world.query_key(&q))),
        None => (false, None),
    }
}

/// A "yes" that wins the game (LMRL-Gym's rule, [`is_win`]).
pub fn wins(world: &World, object: &Object, question: &str, yes: bool) -> bool {
    yes && is_win(question, object, &world.objects)
}

/// Token cap of one question (a questioner's reply) unless given.
pub const QUESTION_MAX_TOKENS: usize = 64;

/// The model's reply as one question line: the first line with a question mark, cut after
/// it, without speaker labels, list markers, quotes or a lead-in sentence ("Great! Is it …?"
/// → "Is it …?"). Without a question mark, the first line as it is (a statement, which
/// [`World::parse`] does not read as a question).
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
    // A line without "?" stays a statement: the parser reads only questions.
    let mut q = match line.find('?') {
        Some(i) => line[..=i].to_string(),
        None => line.trim_end().to_string(),
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

/// "Yes."/"No." from an oracle's reply: the first word that is yes or no (case and
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

#[cfg(test)]
mod tests {
    use super::*;

    fn world() -> &'static World {
        default_world().expect("bundled world")
    }

    #[test]
    fn the_split_is_disjoint_covers_every_object_and_every_category_is_tested() {
        let w = world();
        let train = split_objects(w, ObjectSplit::Train);
        let test = split_objects(w, ObjectSplit::Test);
        assert_eq!(train.len() + test.len(), w.objects.len());
        assert!(train.iter().all(|i| !test.contains(i)));
        let cats = |ix: &[usize]| {
            ix.iter()
                .map(|&i| w.objects[i].category.clone())
                .collect::<std::collections::BTreeSet<_>>()
        };
        assert_eq!(cats(&test), cats(&(0..w.objects.len()).collect::<Vec<_>>()));
        // Roughly a fifth, decided by the hash and nothing else (stable across runs).
        assert!((28..=40).contains(&test.len()), "{}", test.len());
        assert_eq!(test, split_objects(w, ObjectSplit::Test));
    }

    #[test]
    fn tasks_name_their_object_and_split() {
        let w = world();
        let tasks = object_tasks(w, ObjectSplit::Test);
        assert_eq!(tasks.len(), split_objects(w, ObjectSplit::Test).len());
        for t in &tasks {
            let o = object_of_task(w, t).expect("object");
            assert_eq!(t.reference, o.name);
            assert_eq!(t.metadata["split"], "test");
            assert!(t.id.starts_with("20q-"));
        }
        let all = object_tasks(w, ObjectSplit::All);
        assert_eq!(
            all.iter().filter(|t| t.metadata["split"] == "test").count(),
            tasks.len()
        );
        // A task whose index and name disagree names no object.
        let mut bad = tasks[0].clone();
        bad.reference = "Airplane".into();
        bad.metadata["object_index"] = serde_json::json!(0);
        if w.objects[0].name != "Airplane" {
            assert!(object_of_task(w, &bad).is_none());
        }
    }

    #[test]
    fn questions_and_answers_read_back_from_a_conversation() {
        let msgs = vec![
            ChatMessage::user("Let's play"),
            ChatMessage::assistant("Great! Is it an animal?"),
            ChatMessage::user("Yes."),
            ChatMessage::assistant("1. Does it fly?"),
            ChatMessage::user("no"),
            ChatMessage::assistant("Is it a dog?"),
        ];
        assert_eq!(
            answered_questions(&msgs),
            vec![
                ("Is it an animal?".to_string(), true),
                ("Does it fly?".to_string(), false)
            ]
        );
        assert_eq!(unanswered_question(&msgs).as_deref(), Some("Is it a dog?"));
        assert_eq!(unanswered_question(&msgs[..5]), None);
        assert_eq!(questions_asked(&msgs), 3);
        let back = questioner_messages("Let's play", &answered_questions(&msgs), &[]);
        assert_eq!(back.len(), 5);
        assert_eq!(back[2].content, "Yes.");
    }

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
            ("Is it a cat", "Is it a cat"),
            ("Is it a cat.", "Is it a cat."),
            ("It is a cat.", "It is a cat."),
            ("My question: is it soft?", "is it soft?"),
            ("", ""),
            ("\n  \n", ""),
            ("%\u{fffd}\u{fffd}7V\u{fffd}", "%\u{fffd}\u{fffd}7V\u{fffd}"),
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

    #[test]
    fn demonstrator_prefixes_are_open_games_drawn_from_the_seed() {
        let w = world();
        let intro = "Let's play";
        let mut lengths = std::collections::BTreeSet::new();
        for (k, o) in w.objects.iter().enumerate().take(40) {
            let seed = 1000 + k as u64;
            let p = demonstrator_prefix(w, intro, o, 20, 12, seed);
            assert_eq!(p, demonstrator_prefix(w, intro, o, 20, 12, seed), "seeded");
            assert_eq!(p[0].content, intro);
            assert_eq!(p.len() % 2, 1, "ends with an answer");
            let qa = answered_questions(&p);
            assert!(qa.len() <= 12);
            lengths.insert(qa.len());
            for (q, yes) in &qa {
                let (truth, parsed) = table_answer(w, o, q);
                assert!(parsed.is_some() && truth == *yes, "{q}");
                assert!(!wins(w, o, q, *yes), "the prefix stops before a win: {q}");
            }
        }
        assert!(lengths.len() >= 5, "prefix lengths vary: {lengths:?}");
        // At most max_questions − 1 questions: the game is never over.
        let p = demonstrator_prefix(w, intro, &w.objects[0], 3, 12, 9);
        assert!(answered_questions(&p).len() <= 2);
        assert_eq!(
            demonstrator_prefix(w, intro, &w.objects[0], 20, 0, 9).len(),
            1
        );
    }
}
