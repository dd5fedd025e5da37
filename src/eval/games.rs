//! One 20 Questions game of an evaluation: the questioner (built-in or model), the oracle
//! (table or LLM), [`play`] and the record of `conversations/<model>.jsonl`. Synchronous:
//! the runner calls it on a blocking thread; model calls wait on the runtime `handle`.

use std::sync::Arc;

use tokio::runtime::Handle;

use super::players::{LlmOracle, ModelQuestioner};
use crate::llm::roles::Role;
use crate::rollout::user::{derive_seed, Sampling};
use crate::task::prompts::Prompts;
use crate::task::twenty_questions::{
    play, DemonstratorQuestioner, GameMetrics, Oracle, Questioner, RandomGuessQuestioner,
    ReferenceQuestioner, TableOracle, World,
};

/// Who asks the questions.
#[derive(Clone)]
pub enum Player {
    Reference,
    Random,
    Demonstrator,
    Model(Role),
}

/// What every game of a run shares.
#[derive(Clone)]
pub struct GameSettings {
    pub prompts: Arc<Prompts>,
    /// `None`: the table oracle.
    pub oracle: Option<Role>,
    /// With `oracle`: the table answers what it parses, the model the rest.
    pub hybrid: bool,
    /// The model questioner's sampling (`max_tokens` = the question cap).
    pub sampling: Sampling,
    pub max_questions: usize,
    pub seed: u64,
}

/// The seed of one game: from (run seed + repeat, object), never from the model.
pub fn game_seed(seed: u64, repeat: usize, object: usize) -> u64 {
    repeat_game_seed(seed.wrapping_add(repeat as u64), object)
}

/// [`game_seed`] from the repeat's seed (run seed + repeat), the `seed` a game record stores.
fn repeat_game_seed(repeat_seed: u64, object: usize) -> u64 {
    derive_seed(repeat_seed, &["game", &object.to_string()])
}

/// Plays object `object` (repeat `repeat`); `Err` when a model call failed (the game is not
/// recorded, so a rerun plays it again).
pub fn play_game(
    world: &World,
    player: &Player,
    label: &str,
    s: &GameSettings,
    handle: &Handle,
    object: usize,
    repeat: usize,
) -> Result<serde_json::Value, String> {
    let seed = game_seed(s.seed, repeat, object);
    let target = &world.objects[object];
    let (mut model_q, mut reference, mut random, mut demo) = (None, None, None, None);
    let questioner: &mut dyn Questioner = match player {
        Player::Reference => reference.insert(ReferenceQuestioner::new(world)),
        Player::Random => random.insert(RandomGuessQuestioner::new(world, seed)),
        Player::Demonstrator => demo.insert(DemonstratorQuestioner::new(world, seed)),
        Player::Model(role) => model_q.insert(ModelQuestioner {
            role: role.clone(),
            prompts: s.prompts.clone(),
            handle: handle.clone(),
            sampling: s.sampling.clone(),
            max_questions: s.max_questions,
            seed,
            raw: Vec::new(),
            error: None,
        }),
    };
    let (mut table, mut llm) = (None, None);
    let oracle: &mut dyn Oracle = match &s.oracle {
        None => table.insert(TableOracle::new(world)),
        Some(role) => llm.insert(LlmOracle {
            hybrid: s.hybrid,
            table_answers: 0,
            role: role.clone(),
            prompts: s.prompts.clone(),
            handle: handle.clone(),
            world,
            seed,
            raw: Vec::new(),
            invalid: 0,
            error: None,
        }),
    };
    let game = play(world, target, questioner, oracle, s.max_questions);
    let (q_raw, q_err) = match model_q {
        Some(q) => (Some(q.raw), q.error),
        None => (None, None),
    };
    let (o_raw, o_invalid, o_table, o_err) = match llm {
        Some(o) => (Some(o.raw), Some(o.invalid), Some(o.table_answers), o.error),
        None => (None, None, None, None),
    };
    if let Some(e) = q_err.or(o_err) {
        return Err(e);
    }
    let metrics = GameMetrics::of(&game);
    let mut rec = serde_json::json!({
        "model": label,
        "repeat": repeat,
        "seed": s.seed.wrapping_add(repeat as u64),
        "game": game,
        "metrics": metrics,
    });
    if let Some(raw) = q_raw {
        rec["questioner_raw"] = serde_json::json!(raw);
    }
    if let Some(raw) = o_raw {
        rec["oracle_raw"] = serde_json::json!(raw);
        rec["oracle_invalid"] = serde_json::json!(o_invalid);
        rec["oracle_table_answers"] = serde_json::json!(o_table);
    }
    rec["oracle"] = serde_json::json!(match (&s.oracle, s.hybrid) {
        (None, _) => "table",
        (Some(_), false) => "llm",
        (Some(_), true) => "hybrid",
    });
    Ok(rec)
}

/// Oracle honesty: with the table oracle, every model whose questions did not all parse gets a
/// line saying how many were answered "No." without being understood.
pub fn unparsed_warnings(
    oracle: &super::config::OracleChoice,
    summary: &super::summary::Summary,
) -> Vec<String> {
    if *oracle != super::config::OracleChoice::Table {
        return Vec::new();
    }
    summary
        .models
        .iter()
        .filter_map(|m| {
            let rate = m.get("unparsed_rate")?;
            let per_game = m.get("unparsed")?;
            (rate.mean > 0.0).then(|| {
                format!(
                    "{}: {:.1}% of a game's questions on average ({:.2} per game) did not parse; the table oracle \
                     answered them \"No.\" (LMRL-Gym's rule) — --oracle hybrid lets a model \
                     answer those",
                    m.name,
                    100.0 * rate.mean,
                    per_game.mean
                )
            })
        })
        .collect()
}

/// The won games of `recs` (records of `conversations/<model>.jsonl`) as SFT conversations:
/// the rules (`intro`), then each question (as the game recorded it, cleaned to one line) and
/// its answer, ending at the winning question. Lost games teach nothing and are left out.
pub fn won_games_as_sft(
    label: &str,
    intro: &str,
    recs: &[serde_json::Value],
) -> Result<Vec<crate::dataset::sft::SftRow>, String> {
    use crate::task::twenty_questions::{chat::questioner_messages, GameRecord};
    let mut out = Vec::new();
    for (i, r) in recs.iter().enumerate() {
        let game: GameRecord = serde_json::from_value(r["game"].clone())
            .map_err(|e| format!("{label}: record {i}: `game`: {e}"))?;
        if !game.won {
            continue;
        }
        let history: Vec<(String, bool)> = game
            .turns
            .iter()
            .map(|t| (t.question.clone(), t.yes))
            .collect();
        let mut messages = questioner_messages(intro, &history, &[]);
        messages.pop(); // the "Yes." to the winning question: nothing to learn after it
        let repeat = r["repeat"].as_u64().unwrap_or(0);
        out.push(crate::dataset::sft::SftRow {
            messages,
            conv_id: format!("{label}-{}-{repeat}", game.object_index),
            score: 1.0,
        });
    }
    Ok(out)
}

/// The demonstrator's seed at question `k` of a game played with `game_seed` (DAgger labels).
pub fn dagger_seed(game_seed: u64, k: usize) -> u64 {
    derive_seed(game_seed, &["dagger", &k.to_string()])
}

/// The `conv_id` prefix of a questioner's DAgger rows (its rows are replaced as a whole when
/// it is labelled again).
pub fn dagger_conv_prefix(label: &str) -> String {
    format!("dagger:{label}:")
}

/// DAgger rows from the games of `recs` (records of `conversations/<model>.jsonl`, won or
/// lost): every state at which the questioner asked — the rules and the questions and answers
/// before, as the questioner wrote and read them — labelled with the demonstrator's question
/// at that state (`chosen`, a draw among its top questions by expected gain, seeded by
/// [`dagger_seed`]) beside the questioner's own (`rejected`); the scores are the two
/// questions' expected gains. `dpo_train --loss sft` trains on the labels alone.
pub fn games_as_dagger_rows(
    world: &World,
    label: &str,
    intro: &str,
    recs: &[serde_json::Value],
) -> Result<Vec<crate::dataset::pairs::PairRow>, String> {
    use crate::llm::ChatMessage;
    use crate::task::twenty_questions::{
        chat::questioner_messages, consistent_after, expected_gain, GameRecord,
    };
    let mut out = Vec::new();
    for (i, r) in recs.iter().enumerate() {
        let game: GameRecord = serde_json::from_value(r["game"].clone())
            .map_err(|e| format!("{label}: record {i}: `game`: {e}"))?;
        let raw: Vec<String> = serde_json::from_value(r["questioner_raw"].clone())
            .unwrap_or_else(|_| game.turns.iter().map(|t| t.question.clone()).collect());
        let repeat = r["repeat"].as_u64().unwrap_or(0);
        let repeat_seed = r["seed"]
            .as_u64()
            .ok_or_else(|| format!("{label}: record {i}: no `seed`"))?;
        let seed = repeat_game_seed(repeat_seed, game.object_index);
        let history: Vec<(String, bool)> = game
            .turns
            .iter()
            .map(|t| (t.question.clone(), t.yes))
            .collect();
        for (k, turn) in game.turns.iter().enumerate() {
            let state = &history[..k];
            let label_q =
                DemonstratorQuestioner::new(world, dagger_seed(seed, k)).next_question(state);
            let consistent = consistent_after(world, state);
            let gain = |q: &str| {
                world
                    .parse(q)
                    .map_or(0.0, |p| expected_gain(world, &p, &consistent))
            };
            let asked = raw.get(k).cloned().unwrap_or_else(|| turn.question.clone());
            out.push(crate::dataset::pairs::PairRow {
                prompt: questioner_messages(intro, state, &raw[..k.min(raw.len())]),
                score_chosen: gain(&label_q),
                score_rejected: gain(&turn.question),
                chosen: vec![ChatMessage::assistant(label_q)],
                rejected: vec![ChatMessage::assistant(asked)],
                conv_id: format!(
                    "{}{}-{repeat}",
                    dagger_conv_prefix(label),
                    game.object_index
                ),
                turn_id: k as u32,
            });
        }
    }
    Ok(out)
}
