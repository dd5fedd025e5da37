//! Re-scoring 20 Questions games published in LMRL-Gym's offline form (`eval_multiturn --task
//! twenty_questions --transcripts FILE`): one JSON object per line, `{"lines": ["<question>?
//! <answer>", …], "word": [names…], "correct": …}`. Each game is replayed through [`play`]
//! with its own questions and answers, so the win rule, the information gain under the table
//! and every metric are ours; the file's `correct` is kept only to report disagreements.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::summary::{summarize_games, write_atomic, ModelSummary, Summary, SummaryError};
use crate::task::twenty_questions::chat::normalise_yes_no;
use crate::task::twenty_questions::{
    play, GameMetrics, GameRecord, Object, Oracle, OracleAnswer, Questioner, World, MAX_QUESTIONS,
};
use crate::task::TaskType;

/// The per-game output file.
pub const GAMES_FILE: &str = "games.jsonl";

#[derive(Debug, thiserror::Error)]
pub enum TranscriptError {
    #[error("{}: {source}", file.display())]
    Io {
        file: PathBuf,
        source: std::io::Error,
    },
    #[error("{}:{line}: {message}", file.display())]
    Line {
        file: PathBuf,
        line: usize,
        message: String,
    },
    #[error("{}: no games", file.display())]
    Empty { file: PathBuf },
    /// The output directory holds another run; re-scoring would overwrite its summary.
    #[error("{}: holds another run (`{entry}`); give --output a new directory or an earlier --transcripts output", dir.display())]
    OtherRun { dir: PathBuf, entry: String },
    #[error(transparent)]
    Summary(#[from] SummaryError),
    #[error(transparent)]
    Data(#[from] crate::task::twenty_questions::WorldDataError),
}

/// One line of an LMRL-Gym offline file.
#[derive(Debug, Clone, Deserialize)]
pub struct LmrlGame {
    pub lines: Vec<String>,
    pub word: WordField,
    #[serde(default)]
    pub correct: Option<bool>,
}

/// `word`: a list of names (LMRL-Gym writes the object's variants) or one name.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum WordField {
    Many(Vec<String>),
    One(String),
}

impl WordField {
    fn names(&self) -> Vec<&str> {
        match self {
            WordField::Many(v) => v.iter().map(String::as_str).collect(),
            WordField::One(s) => vec![s.as_str()],
        }
    }
}

/// LMRL-Gym's `split_question_answer`: everything up to the last "? " is the question (with
/// its "?"), the rest the answer. `None` for a line without "? ".
pub fn split_line(line: &str) -> Option<(String, String)> {
    let (q, a) = line.trim().rsplit_once("? ")?;
    Some((format!("{q}?"), a.trim().to_string()))
}

/// Replays stored questions in order.
struct Replay<'a> {
    turns: &'a [(String, bool)],
}

impl Questioner for Replay<'_> {
    fn next_question(&mut self, history: &[(String, bool)]) -> String {
        self.turns
            .get(history.len())
            .map(|(q, _)| q.clone())
            .unwrap_or_default()
    }
}

/// Replays stored answers; what the question asks comes from the table's parser, so the
/// information gain is exact wherever it parses.
struct ReplayOracle<'a> {
    world: &'a World,
    turns: &'a [(String, bool)],
    asked: usize,
}

impl Oracle for ReplayOracle<'_> {
    fn answer(&mut self, _object: &Object, question: &str) -> OracleAnswer {
        let yes = self.turns.get(self.asked).is_some_and(|(_, y)| *y);
        self.asked += 1;
        OracleAnswer {
            yes,
            parsed: self.world.parse(question).map(|q| self.world.query_key(&q)),
        }
    }
}

/// One re-scored game: `games.jsonl` line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RescoredGame {
    /// 0-based position in the input file.
    pub index: usize,
    pub object: String,
    pub object_index: usize,
    /// Won under our rules.
    pub success: bool,
    /// The file's own `correct` (ignored for scoring).
    pub given_correct: Option<bool>,
    /// Questions played (the game stops at a win and after 20).
    pub questions: usize,
    /// Realised information gain in bits under the table.
    pub info_gain: f64,
    pub unparsed: usize,
    /// Answers that were neither yes nor no (scored as "No.", LMRL-Gym's normalisation).
    pub invalid_answers: usize,
    /// Lines after a win or past the 20-question budget (not played).
    pub lines_ignored: usize,
    pub game: GameRecord,
    pub metrics: GameMetrics,
}

/// Refuses an output directory that holds anything but an earlier re-scoring's files (an
/// evaluation's summary, a generate_conv run): those would be overwritten or mixed.
fn refuse_other_runs(output: &Path) -> Result<(), TranscriptError> {
    let Ok(entries) = std::fs::read_dir(output) else {
        return Ok(());
    };
    let names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    let ours = [GAMES_FILE, "summary.json", "summary.csv"];
    let foreign = names.iter().find(|n| !ours.contains(&n.as_str()));
    let summary_without_games =
        names.iter().any(|n| n == "summary.json") && !names.iter().any(|n| n == GAMES_FILE);
    match (foreign, summary_without_games) {
        (Some(entry), _) => Err(TranscriptError::OtherRun {
            dir: output.to_path_buf(),
            entry: entry.clone(),
        }),
        (None, true) => Err(TranscriptError::OtherRun {
            dir: output.to_path_buf(),
            entry: "summary.json".into(),
        }),
        _ => Ok(()),
    }
}

/// Re-scores one game (`line` is 1-based, for errors).
pub fn rescore(
    world: &World,
    game: &LmrlGame,
    index: usize,
    file: &Path,
    line: usize,
) -> Result<RescoredGame, TranscriptError> {
    let err = |message: String| TranscriptError::Line {
        file: file.to_path_buf(),
        line,
        message,
    };
    let names = game.word.names();
    let object = names
        .iter()
        .find_map(|n| world.find(n))
        .ok_or_else(|| err(format!("`word` {names:?} names none of the 158 objects")))?;
    let mut turns = Vec::new();
    let mut invalid_answers = 0;
    for (k, l) in game.lines.iter().enumerate() {
        let (q, a) = split_line(l).ok_or_else(|| {
            err(format!(
                "`lines`[{k}] {l:?} is not \"<question>? <answer>\""
            ))
        })?;
        let yes = normalise_yes_no(&a).unwrap_or_else(|| {
            invalid_answers += 1;
            false
        });
        turns.push((q, yes));
    }
    let budget = turns.len().min(MAX_QUESTIONS);
    let mut record = play(
        world,
        object,
        &mut Replay { turns: &turns },
        &mut ReplayOracle {
            world,
            turns: &turns,
            asked: 0,
        },
        budget,
    );
    // A lost game counts the full budget, as for games we play.
    record.max_questions = MAX_QUESTIONS;
    let metrics = GameMetrics::of(&record);
    Ok(RescoredGame {
        index,
        object: object.name.clone(),
        object_index: object.index,
        success: record.won,
        given_correct: game.correct,
        questions: record.turns.len(),
        info_gain: metrics.info_gain,
        unparsed: metrics.unparsed,
        invalid_answers,
        lines_ignored: turns.len() - record.turns.len(),
        game: record,
        metrics,
    })
}

/// Reads every game of `file` (blank lines skipped; any bad line is an error naming it).
pub fn read_games(world: &World, file: &Path) -> Result<Vec<RescoredGame>, TranscriptError> {
    let text = std::fs::read_to_string(file).map_err(|source| TranscriptError::Io {
        file: file.to_path_buf(),
        source,
    })?;
    let mut out = Vec::new();
    for (i, l) in text.lines().enumerate() {
        if l.trim().is_empty() {
            continue;
        }
        let game: LmrlGame = serde_json::from_str(l).map_err(|e| TranscriptError::Line {
            file: file.to_path_buf(),
            line: i + 1,
            message: format!("not an LMRL-Gym game ({{\"lines\", \"word\", \"correct\"}}): {e}"),
        })?;
        out.push(rescore(world, &game, out.len(), file, i + 1)?);
    }
    if out.is_empty() {
        return Err(TranscriptError::Empty {
            file: file.to_path_buf(),
        });
    }
    Ok(out)
}

/// What `--transcripts` did.
#[derive(Debug, Clone)]
pub struct TranscriptReport {
    pub games: Vec<RescoredGame>,
    pub summary: Summary,
    /// Games whose `correct` differs from our verdict.
    pub disagreements: usize,
}

impl std::fmt::Display for TranscriptReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.summary.table())?;
        let given = self
            .games
            .iter()
            .filter(|g| g.given_correct.is_some())
            .count();
        writeln!(
            f,
            "{} game(s); the file's `correct` disagrees with our rules on {} of {given}",
            self.games.len(),
            self.disagreements
        )
    }
}

/// Re-scores `file` and writes `games.jsonl`, `summary.json` and `summary.csv` into `output`
/// (each atomically); the model is named after the file's stem.
pub fn rescore_file(file: &Path, output: &Path) -> Result<TranscriptReport, TranscriptError> {
    refuse_other_runs(output)?;
    let world = World::load_default()?;
    let games = read_games(&world, file)?;
    let records: Vec<serde_json::Value> = games
        .iter()
        .map(|g| serde_json::json!({ "metrics": g.metrics }))
        .collect();
    let name = file
        .file_stem()
        .map(|s| s.to_string_lossy().to_string())
        .unwrap_or_else(|| "transcripts".into());
    let model: ModelSummary = summarize_games(&name, &file.display().to_string(), &records)?;
    let summary = Summary {
        task: TaskType::TwentyQuestions,
        seed: 0,
        tool_version: env!("CARGO_PKG_VERSION").to_string(),
        models: vec![model],
    };
    std::fs::create_dir_all(output).map_err(|source| TranscriptError::Io {
        file: output.to_path_buf(),
        source,
    })?;
    let mut text = String::new();
    for g in &games {
        text.push_str(&serde_json::to_string(g).unwrap_or_default());
        text.push('\n');
    }
    write_atomic(&output.join(GAMES_FILE), text.as_bytes())?;
    summary.write(output)?;
    let disagreements = games
        .iter()
        .filter(|g| g.given_correct.is_some_and(|c| c != g.success))
        .count();
    Ok(TranscriptReport {
        games,
        summary,
        disagreements,
    })
}
