//! Readers of the files the figures come from. Only serialized formats are read
//! (docs/formats.md): `dpo_train`'s `logs.jsonl`, `generate_conv`'s run directory,
//! `eval_multiturn`'s `summary.json` and `conversations/*.jsonl`. Every error names the file,
//! and the line and field where there is one.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::chart::{plottable, PLOT_LIMIT};
use super::PlotError;

/// The legend name of a directory: its last path component (`.` and `..` resolved).
pub fn dir_name(dir: &Path) -> String {
    let resolved = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    resolved
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| dir.display().to_string())
}

fn read_text(path: &Path) -> Result<String, PlotError> {
    std::fs::read_to_string(path).map_err(|source| PlotError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// Non-empty lines of a JSONL file, 1-based. A last line without its newline that does not
/// parse is an append in progress (the writer is still running), not data.
fn jsonl_values(path: &Path) -> Result<Vec<(usize, serde_json::Value)>, PlotError> {
    let text = read_text(path)?;
    let lines: Vec<&str> = text.lines().collect();
    let torn_tail = !text.ends_with('\n');
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str(line) {
            Ok(v) => out.push((i + 1, v)),
            Err(_) if torn_tail && i + 1 == lines.len() => {}
            Err(e) => {
                return Err(PlotError::Json {
                    path: path.to_path_buf(),
                    line: Some(i + 1),
                    message: e.to_string(),
                })
            }
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// dpo_train

/// One training run: metric → (step, value) in file order, train and eval lines apart.
#[derive(Clone, Debug, Default)]
pub struct TrainRun {
    pub name: String,
    pub path: PathBuf,
    pub train: BTreeMap<String, Vec<(f64, f64)>>,
    /// Eval lines, keyed without the `eval_` prefix (`loss`, `rewards/margins`, …).
    pub eval: BTreeMap<String, Vec<(f64, f64)>>,
}

pub const LOGS_FILE: &str = "logs.jsonl";

pub fn read_train_run(dir: &Path) -> Result<TrainRun, PlotError> {
    let path = dir.join(LOGS_FILE);
    let mut run = TrainRun {
        name: dir_name(dir),
        path: path.clone(),
        ..TrainRun::default()
    };
    let field = |line: usize, field: &str, message: &str| PlotError::Field {
        path: path.clone(),
        line: Some(line),
        field: field.to_string(),
        message: message.to_string(),
    };
    for (line, value) in jsonl_values(&path)? {
        let obj = value
            .as_object()
            .ok_or_else(|| field(line, "(line)", "not a JSON object"))?;
        let step = obj
            .get("step")
            .ok_or_else(|| field(line, "step", "missing"))?
            .as_f64()
            .filter(|s| plottable(*s) && *s >= 0.0)
            .ok_or_else(|| field(line, "step", "not a non-negative number up to 1e100"))?;
        let is_eval = obj.keys().any(|k| k.starts_with("eval_"));
        if !is_eval && !obj.contains_key("loss") {
            return Err(field(
                line,
                "loss",
                "missing (a training line needs the loss)",
            ));
        }
        for (key, v) in obj {
            if key == "step" || key == "epoch" {
                continue;
            }
            let x = match v {
                serde_json::Value::Null => continue,
                serde_json::Value::Number(n) => n.as_f64().unwrap_or(f64::NAN),
                _ => return Err(field(line, key, "not a number")),
            };
            if !plottable(x) {
                // A diverged run logs such values; its other points still make a figure.
                tracing::warn!(
                    "{}:{line}: `{key}` = {x:e} is beyond ±{PLOT_LIMIT:e}; left out of the figures",
                    path.display()
                );
                continue;
            }
            match key.strip_prefix("eval_") {
                Some(k) => run.eval.entry(k.to_string()).or_default().push((step, x)),
                None => run.train.entry(key.clone()).or_default().push((step, x)),
            }
        }
    }
    if run.train.is_empty() && run.eval.is_empty() {
        return Err(PlotError::Empty {
            path,
            what: "no log lines".into(),
        });
    }
    Ok(run)
}

// ---------------------------------------------------------------------------------------------
// generate_conv

/// What the data figures need from a generate_conv run directory.
#[derive(Clone, Debug, Default)]
pub struct DataRun {
    pub name: String,
    pub dir: PathBuf,
    pub min_gap: f64,
    /// (score_chosen, score_rejected, turn_id) of every pair, train then test.
    pub pairs: Vec<(f64, f64, u32)>,
    /// metric → every session's score (all candidates, all turns).
    pub session_scores: BTreeMap<String, Vec<f64>>,
}

pub const MANIFEST_FILE: &str = "manifest.json";

pub fn read_data_run(dir: &Path) -> Result<DataRun, PlotError> {
    let manifest_path = dir.join(MANIFEST_FILE);
    let manifest: serde_json::Value =
        serde_json::from_str(&read_text(&manifest_path)?).map_err(|e| PlotError::Json {
            path: manifest_path.clone(),
            line: None,
            message: e.to_string(),
        })?;
    let min_gap = manifest
        .pointer("/config/min_gap")
        .and_then(|v| v.as_f64())
        .ok_or_else(|| PlotError::Field {
            path: manifest_path.clone(),
            line: None,
            field: "config.min_gap".into(),
            message: "missing or not a number".into(),
        })?;
    let mut pairs = Vec::new();
    for split in ["train", "test"] {
        let path = dir.join("pairs").join(format!("{split}.parquet"));
        let rows = crate::dataset::read_pairs_parquet(&path)?;
        for (row, r) in rows.iter().enumerate() {
            for (field, v) in [
                ("score_chosen", r.score_chosen),
                ("score_rejected", r.score_rejected),
            ] {
                if !v.is_finite() {
                    return Err(PlotError::Field {
                        path: path.clone(),
                        line: Some(row),
                        field: field.into(),
                        message: "missing or not finite (row index shown as line)".into(),
                    });
                }
            }
            pairs.push((r.score_chosen, r.score_rejected, r.turn_id));
        }
    }
    let mut session_scores: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    // An imported run (`generate_conv --import`) has pairs but no conversations of ours:
    // its figures come from the pairs alone.
    let records = if manifest.get("import").is_some() {
        Vec::new()
    } else {
        crate::rollout::records::read_records(dir)?
    };
    for rec in records {
        for turn in &rec.turns {
            for cand in &turn.candidates {
                for session in &cand.sessions {
                    for (metric, score) in &session.scores {
                        if let Some(v) = score.value.filter(|v| v.is_finite()) {
                            session_scores.entry(metric.clone()).or_default().push(v);
                        }
                    }
                }
            }
        }
    }
    Ok(DataRun {
        name: dir_name(dir),
        dir: dir.to_path_buf(),
        min_gap,
        pairs,
        session_scores,
    })
}

// ---------------------------------------------------------------------------------------------
// eval_multiturn

#[derive(Clone, Debug, Deserialize)]
pub struct Stat {
    pub mean: f64,
    pub se: f64,
    pub n: usize,
}

#[derive(Clone, Debug, Deserialize)]
pub struct EvalModel {
    pub name: String,
    pub metrics: BTreeMap<String, Stat>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct Summary {
    pub task: String,
    pub models: Vec<EvalModel>,
}

#[derive(Clone, Debug)]
pub struct EvalRun {
    pub name: String,
    pub dir: PathBuf,
    pub summary: Summary,
}

pub const SUMMARY_FILE: &str = "summary.json";
pub const TWENTY_QUESTIONS: &str = "twenty_questions";

pub fn read_eval_run(dir: &Path) -> Result<EvalRun, PlotError> {
    let path = dir.join(SUMMARY_FILE);
    // serde's message names the missing or mistyped field (`missing field `models``).
    let summary: Summary =
        serde_json::from_str(&read_text(&path)?).map_err(|e| PlotError::Json {
            path: path.clone(),
            line: None,
            message: e.to_string(),
        })?;
    if summary.models.is_empty() {
        return Err(PlotError::Field {
            path,
            line: None,
            field: "models".into(),
            message: "empty".into(),
        });
    }
    Ok(EvalRun {
        name: dir_name(dir),
        dir: dir.to_path_buf(),
        summary,
    })
}

/// The parts of a 20 Questions game the figures use (eval's `GameRecord`, read by serde;
/// other fields are ignored).
#[derive(Clone, Debug, Deserialize)]
pub struct Game {
    pub max_questions: usize,
    pub won: bool,
    pub turns: Vec<GameTurn>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct GameTurn {
    pub realised_gain: f64,
}

#[derive(Deserialize)]
struct GameLine {
    model: String,
    game: Game,
}

/// model → games, from every `conversations/*.jsonl` of an eval directory.
pub fn read_games(dir: &Path) -> Result<BTreeMap<String, Vec<Game>>, PlotError> {
    let conv = dir.join("conversations");
    let entries = std::fs::read_dir(&conv).map_err(|source| PlotError::Read {
        path: conv.clone(),
        source,
    })?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .collect();
    files.sort();
    let mut out: BTreeMap<String, Vec<Game>> = BTreeMap::new();
    for path in files {
        for (line, value) in jsonl_values(&path)? {
            let g: GameLine = serde_json::from_value(value).map_err(|e| PlotError::Json {
                path: path.clone(),
                line: Some(line),
                message: e.to_string(),
            })?;
            out.entry(g.model).or_default().push(g.game);
        }
    }
    if out.is_empty() {
        return Err(PlotError::Empty {
            path: conv,
            what: "no games in conversations/*.jsonl".into(),
        });
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// eval_multiturn --study

pub const STUDY_FILE: &str = "study.json";

/// The parts of `study.json` a figure draws.
#[derive(Clone, Debug, Deserialize)]
pub struct Study {
    pub title: String,
    pub primary: String,
    pub arms: Vec<StudyArm>,
    pub comparisons: Vec<StudyComparison>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct StudyArm {
    pub name: String,
    pub pooled_rate: f64,
    pub pooled_ci95: (f64, f64),
    pub seeds: Vec<StudySeed>,
    /// Secondary metric → mean over seeds (absent in older files).
    #[serde(default)]
    pub secondary: std::collections::BTreeMap<String, Option<f64>>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct StudySeed {
    pub rate: f64,
    /// Secondary metric → this seed's mean (absent in older files).
    #[serde(default)]
    pub secondary: std::collections::BTreeMap<String, Option<f64>>,
    /// Every outcome 0 or 1 (absent in older files: a rate).
    #[serde(default = "yes")]
    pub binary: bool,
}

fn yes() -> bool {
    true
}

#[derive(Clone, Debug, Deserialize)]
pub struct StudyComparison {
    pub arm: String,
    pub against: String,
    pub pooled_difference: f64,
    pub ci95: (f64, f64),
}

/// `study.json` of an `eval_multiturn --study` output directory.
pub fn read_study(dir: &Path) -> Result<Study, PlotError> {
    let path = dir.join(STUDY_FILE);
    serde_json::from_str(&read_text(&path)?).map_err(|e| PlotError::Json {
        path,
        line: None,
        message: e.to_string(),
    })
}

/// One setting of an adaptive-futures replay (`bench adaptive-replay --json`).
#[derive(Clone, Debug, Deserialize)]
pub struct ReplayPoint {
    pub z: f64,
    /// Futures played as a share of the fixed-S run's.
    pub futures_share: f64,
    /// Share of pairs the fixed-S run could have made.
    pub agreement: f64,
}

/// A replay file: its points (the label is the file's stem).
#[derive(Clone, Debug, Deserialize)]
pub struct Replay {
    pub turns: usize,
    pub max_futures: usize,
    pub points: Vec<ReplayPoint>,
}

/// A `bench adaptive-replay --json` file.
pub fn read_replay(path: &Path) -> Result<Replay, PlotError> {
    let replay: Replay = serde_json::from_str(&read_text(path)?).map_err(|e| PlotError::Json {
        path: path.to_path_buf(),
        line: None,
        message: e.to_string(),
    })?;
    if replay.points.is_empty() {
        return Err(PlotError::Empty {
            path: path.to_path_buf(),
            what: "no replayed setting (`points` is empty)".into(),
        });
    }
    Ok(replay)
}
