//! Paired comparison of 20 Questions runs (`eval_multiturn --compare RUN…`), printed as the
//! 20 Questions study's Table 1: success with a 95% Wilson score interval, mean turns (a loss
//! counts the full budget), turns on a win, information gain per question, the unparsed
//! rate, and McNemar's exact test of every row against the first (the base).
//!
//! A RUN is an `eval_multiturn` output directory (`conversations/<model>.jsonl`; one row per
//! model, in `summary.json` order) or a `--transcripts` output directory (`games.jsonl`; one
//! row). Games are paired by (object, repeat): only the games every row played are compared.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::records::read_records;
use super::run::CONVERSATIONS_DIR;
use super::summary::{write_atomic, SummaryError};
use super::transcripts::{RescoredGame, GAMES_FILE};
use crate::task::twenty_questions::{GameMetrics, Stat};

/// z for a two-sided 95% interval.
pub const Z95: f64 = 1.959_963_984_540_054;

#[derive(Debug, thiserror::Error)]
pub enum CompareError {
    #[error("{}: {message}", path.display())]
    Input { path: PathBuf, message: String },
    /// One run given twice (under any spelling of its path): it would be compared with itself.
    #[error("--compare names {} twice ({first} and {second}); a run compared with itself tells nothing", path.display())]
    SameRun {
        path: PathBuf,
        first: String,
        second: String,
    },
    #[error("--compare needs at least two models in all, got {0}")]
    TooFew(usize),
    #[error("the compared runs share no game (object and repeat); nothing to pair")]
    NothingPaired,
    /// Runs made with different oracles, budgets, splits, tasks or weights.
    #[error("{0}")]
    Incomparable(String),
    /// Games under different question budgets are not comparable (a loss counts the budget).
    #[error("the runs played with different question budgets ({0}): compare runs of one --max-questions")]
    Budgets(String),
    #[error(transparent)]
    Summary(#[from] SummaryError),
}

/// Wilson score interval of `k` successes in `n` trials at normal quantile `z`; (0, 1) for
/// n = 0.
pub fn wilson_interval(k: usize, n: usize, z: f64) -> (f64, f64) {
    if n == 0 {
        return (0.0, 1.0);
    }
    let (n, p) = (n as f64, k as f64 / n as f64);
    let z2 = z * z;
    let denom = 1.0 + z2 / n;
    let centre = (p + z2 / (2.0 * n)) / denom;
    let half = z / denom * (p * (1.0 - p) / n + z2 / (4.0 * n * n)).sqrt();
    ((centre - half).max(0.0), (centre + half).min(1.0))
}

/// McNemar's exact test: two-sided binomial test of `b` against `b + c` discordant pairs at
/// p = ½, i.e. min(1, 2·P(X ≤ min(b, c))) for X ~ Bin(b + c, ½); 1 without discordant pairs.
/// Summed in log space so that large counts do not underflow.
pub fn mcnemar_exact(b: usize, c: usize) -> f64 {
    let n = b + c;
    let k = b.min(c);
    if n == 0 {
        return 1.0;
    }
    let mut log_term = -(n as f64) * std::f64::consts::LN_2; // log C(n,0) / 2^n
    let mut sum = log_term.exp();
    for i in 0..k {
        log_term += ((n - i) as f64).ln() - ((i + 1) as f64).ln();
        sum += log_term.exp();
    }
    (2.0 * sum).min(1.0)
}

/// One compared model: its games by (object, repeat).
#[derive(Debug, Clone)]
pub struct CompareInput {
    pub label: String,
    pub source: PathBuf,
    /// Seed of each game, when known (eval runs), to warn about unpaired seeds.
    pub seeds: BTreeMap<(usize, usize), u64>,
    pub games: BTreeMap<(usize, usize), GameMetrics>,
    /// The question budget of every game (`--max-questions`; 20 for re-scored transcripts).
    pub max_questions: BTreeSet<usize>,
}

fn input_err(path: &Path, message: impl Into<String>) -> CompareError {
    CompareError::Input {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// Model labels of an eval run in `summary.json` order, else the conversation files' names.
fn run_labels(dir: &Path) -> Result<Vec<String>, CompareError> {
    let conv = dir.join(CONVERSATIONS_DIR);
    let from_summary: Option<Vec<String>> = std::fs::read_to_string(dir.join("summary.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| {
            v["models"].as_array().map(|ms| {
                ms.iter()
                    .filter_map(|m| m["name"].as_str().map(str::to_string))
                    .collect()
            })
        });
    if let Some(ls) = from_summary.filter(|l| !l.is_empty()) {
        return Ok(ls);
    }
    let mut ls: Vec<String> = std::fs::read_dir(&conv)
        .map_err(|e| input_err(&conv, e.to_string()))?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let p = e.path();
            if p.extension()? != "jsonl" {
                return None;
            }
            Some(p.file_stem()?.to_string_lossy().to_string())
        })
        .collect();
    ls.sort();
    Ok(ls)
}

/// Reads every model of an eval run, or the one of a `--transcripts` output.
pub fn read_run(dir: &Path) -> Result<Vec<CompareInput>, CompareError> {
    let games_file = dir.join(GAMES_FILE);
    if games_file.is_file() {
        return Ok(vec![read_rescored(dir, &games_file)?]);
    }
    if !dir.join(CONVERSATIONS_DIR).is_dir() {
        return Err(input_err(
            dir,
            format!(
                "neither an eval_multiturn output ({CONVERSATIONS_DIR}/) nor a --transcripts \
                 output ({GAMES_FILE})"
            ),
        ));
    }
    let mut out = Vec::new();
    for label in run_labels(dir)? {
        let path = dir.join(CONVERSATIONS_DIR).join(format!("{label}.jsonl"));
        let recs = read_records(&path).map_err(|e| input_err(&path, e.to_string()))?;
        let mut input = CompareInput {
            label: label.clone(),
            source: path.clone(),
            seeds: BTreeMap::new(),
            games: BTreeMap::new(),
            max_questions: BTreeSet::new(),
        };
        for (i, r) in recs.iter().enumerate() {
            let bad = |m: &str| input_err(&path, format!("record {}: {m}", i + 1));
            let object = r["game"]["object_index"]
                .as_u64()
                .ok_or_else(|| bad("no game.object_index (not a 20 Questions record)"))?
                as usize;
            let repeat = r["repeat"].as_u64().unwrap_or(0) as usize;
            let metrics: GameMetrics = serde_json::from_value(r["metrics"].clone())
                .map_err(|e| bad(&format!("`metrics`: {e}")))?;
            if let Some(budget) = r["game"]["max_questions"].as_u64() {
                input.max_questions.insert(budget as usize);
            }
            // The first record of a game counts, as in the run's own summary.
            if let std::collections::btree_map::Entry::Vacant(v) =
                input.games.entry((object, repeat))
            {
                v.insert(metrics);
                if let Some(s) = r["seed"].as_u64() {
                    input.seeds.insert((object, repeat), s);
                }
            }
        }
        out.push(input);
    }
    Ok(out)
}

fn read_rescored(dir: &Path, file: &Path) -> Result<CompareInput, CompareError> {
    let text = std::fs::read_to_string(file).map_err(|e| input_err(file, e.to_string()))?;
    let mut games = BTreeMap::new();
    let mut seen: BTreeMap<usize, usize> = BTreeMap::new();
    for (i, l) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let g: RescoredGame =
            serde_json::from_str(l).map_err(|e| input_err(file, format!("line {}: {e}", i + 1)))?;
        // The k-th game of an object in the file pairs with repeat k.
        let k = seen.entry(g.object_index).or_default();
        games.insert((g.object_index, *k), g.metrics);
        *k += 1;
    }
    let label = dir
        .file_name()
        .map(|s| s.to_string_lossy().to_string())
        .unwrap_or_else(|| "transcripts".into());
    Ok(CompareInput {
        label,
        source: file.to_path_buf(),
        seeds: BTreeMap::new(),
        games,
        max_questions: BTreeSet::from([crate::task::twenty_questions::MAX_QUESTIONS]),
    })
}

/// One row of the table.
#[derive(Debug, Clone, Serialize)]
pub struct CompareRow {
    pub label: String,
    pub source: String,
    pub games: usize,
    pub wins: usize,
    pub success: f64,
    /// 95% Wilson score interval of the success rate.
    pub success_ci95: (f64, f64),
    pub mean_turns: Stat,
    pub turns_on_win: Stat,
    pub info_gain_per_question: Stat,
    /// All unparsed questions / all questions asked.
    pub unparsed_rate: f64,
    /// Against the first row: games only the base won (b), only this row won (c), and
    /// McNemar's exact p; `None` for the base itself.
    pub only_base_won: Option<usize>,
    pub only_this_won: Option<usize>,
    pub mcnemar_p: Option<f64>,
}

/// The whole comparison.
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    /// Games every row played (the compared set).
    pub paired_games: usize,
    pub rows: Vec<CompareRow>,
    pub warnings: Vec<String>,
}

/// Pairs the inputs' games and computes every row (the first is the base).
pub fn compare(inputs: &[CompareInput]) -> Result<Comparison, CompareError> {
    if inputs.len() < 2 {
        return Err(CompareError::TooFew(inputs.len()));
    }
    let mut common: BTreeSet<(usize, usize)> = inputs[0].games.keys().copied().collect();
    for i in &inputs[1..] {
        common.retain(|k| i.games.contains_key(k));
    }
    if common.is_empty() {
        return Err(CompareError::NothingPaired);
    }
    let budgets: BTreeSet<usize> = inputs
        .iter()
        .flat_map(|i| &i.max_questions)
        .copied()
        .collect();
    if budgets.len() > 1 {
        let each: Vec<String> = inputs
            .iter()
            .map(|i| {
                let b: Vec<String> = i.max_questions.iter().map(usize::to_string).collect();
                format!("{}: {}", i.label, b.join(" and "))
            })
            .collect();
        return Err(CompareError::Budgets(each.join("; ")));
    }
    let mut warnings = Vec::new();
    for i in inputs {
        let dropped = i.games.len() - common.len();
        if dropped > 0 {
            warnings.push(format!(
                "{}: {dropped} game(s) not played by every row are left out",
                i.label
            ));
        }
    }
    let seed_sets: Vec<HashSet<u64>> = inputs
        .iter()
        .filter(|i| !i.seeds.is_empty())
        .map(|i| {
            common
                .iter()
                .filter_map(|k| i.seeds.get(k).copied())
                .collect()
        })
        .collect();
    if seed_sets.windows(2).any(|w| w[0] != w[1]) {
        warnings
            .push("the runs used different seeds: games are paired by object and repeat".into());
    }
    let base: Vec<bool> = common.iter().map(|k| inputs[0].games[k].success).collect();
    let rows = inputs
        .iter()
        .enumerate()
        .map(|(r, input)| {
            let games: Vec<&GameMetrics> = common.iter().map(|k| &input.games[k]).collect();
            let wins = games.iter().filter(|g| g.success).count();
            let asked: usize = games.iter().map(|g| g.questions_asked).sum();
            let unparsed: usize = games.iter().map(|g| g.unparsed).sum();
            let (b, c) = games
                .iter()
                .zip(&base)
                .fold((0, 0), |(b, c), (g, &base_won)| {
                    match (base_won, g.success) {
                        (true, false) => (b + 1, c),
                        (false, true) => (b, c + 1),
                        _ => (b, c),
                    }
                });
            let n = games.len();
            CompareRow {
                label: input.label.clone(),
                source: input.source.display().to_string(),
                games: n,
                wins,
                success: wins as f64 / n as f64,
                success_ci95: wilson_interval(wins, n, Z95),
                mean_turns: Stat::of(&games.iter().map(|g| g.turns as f64).collect::<Vec<_>>()),
                turns_on_win: Stat::of(
                    &games
                        .iter()
                        .filter_map(|g| g.turns_on_win.map(|t| t as f64))
                        .collect::<Vec<_>>(),
                ),
                info_gain_per_question: Stat::of(
                    &games
                        .iter()
                        .map(|g| g.info_gain_per_question)
                        .collect::<Vec<_>>(),
                ),
                unparsed_rate: if asked == 0 {
                    0.0
                } else {
                    unparsed as f64 / asked as f64
                },
                only_base_won: (r > 0).then_some(b),
                only_this_won: (r > 0).then_some(c),
                mcnemar_p: (r > 0).then(|| mcnemar_exact(b, c)),
            }
        })
        .collect();
    Ok(Comparison {
        paired_games: common.len(),
        rows,
        warnings,
    })
}

/// Reads the runs and compares them; with `output`, writes `compare.json` and `compare.md`.
pub fn compare_runs(runs: &[PathBuf], output: Option<&Path>) -> Result<Comparison, CompareError> {
    refuse_repeated_runs(runs)?;
    super::comparable::check_comparable(runs).map_err(CompareError::Incomparable)?;
    let mut inputs = Vec::new();
    let mut dirs = Vec::new();
    for r in runs {
        for i in read_run(r)? {
            inputs.push(i);
            dirs.push(r);
        }
    }
    // Labels must tell rows apart: a repeated label gets its run directory in front.
    let mut count: BTreeMap<String, usize> = BTreeMap::new();
    for i in &inputs {
        *count.entry(i.label.clone()).or_default() += 1;
    }
    for (i, dir) in inputs.iter_mut().zip(dirs) {
        if count[&i.label] > 1 {
            let name = dir
                .file_name()
                .map(|s| s.to_string_lossy().to_string())
                .unwrap_or_default();
            i.label = format!("{name}/{}", i.label);
        }
    }
    let cmp = compare(&inputs)?;
    if let Some(dir) = output {
        std::fs::create_dir_all(dir).map_err(|e| input_err(dir, e.to_string()))?;
        let json = serde_json::to_string_pretty(&cmp).unwrap_or_default();
        write_atomic(&dir.join("compare.json"), json.as_bytes())?;
        write_atomic(&dir.join("compare.md"), cmp.table().as_bytes())?;
    }
    Ok(cmp)
}

/// A run named twice, as the same path or through another spelling of it (`./a`, a link),
/// is refused.
fn refuse_repeated_runs(runs: &[PathBuf]) -> Result<(), CompareError> {
    let mut seen: BTreeMap<PathBuf, &PathBuf> = BTreeMap::new();
    for r in runs {
        let key = std::fs::canonicalize(r).unwrap_or_else(|_| r.clone());
        if let Some(first) = seen.insert(key.clone(), r) {
            return Err(CompareError::SameRun {
                path: key,
                first: first.display().to_string(),
                second: r.display().to_string(),
            });
        }
    }
    Ok(())
}

fn fmt_p(p: f64) -> String {
    if p < 0.0001 {
        format!("{p:.1e}")
    } else {
        format!("{p:.4}")
    }
}

impl Comparison {
    /// The study's Table 1 as a Markdown table.
    pub fn table(&self) -> String {
        let mut out = format!(
            "20 Questions, {} paired games (same object and repeat in every row); success with a \
             95% Wilson score interval; a lost game counts 20 turns; McNemar's exact test \
             against the first row (b = won only by the first row, c = won only by this one).\n\n",
            self.paired_games
        );
        out.push_str(
            "| model | success (95% CI) | mean turns | turns on a win | info gain / question (bits) | unparsed | b / c | McNemar p |\n",
        );
        out.push_str("|---|---|---|---|---|---|---|---|\n");
        for r in &self.rows {
            let (lo, hi) = r.success_ci95;
            let won = if r.turns_on_win.n == 0 {
                "-".to_string()
            } else {
                format!("{:.2} ± {:.2}", r.turns_on_win.mean, r.turns_on_win.stderr)
            };
            let (bc, p) = match (r.only_base_won, r.only_this_won, r.mcnemar_p) {
                (Some(b), Some(c), Some(p)) => (format!("{b} / {c}"), fmt_p(p)),
                _ => ("base".to_string(), "-".to_string()),
            };
            out.push_str(&format!(
                "| {} | {:.1}% ({}/{}; {:.1}–{:.1}%) | {:.2} ± {:.2} | {won} | {:.3} ± {:.3} | {:.1}% | {bc} | {p} |\n",
                r.label,
                100.0 * r.success,
                r.wins,
                r.games,
                100.0 * lo,
                100.0 * hi,
                r.mean_turns.mean,
                r.mean_turns.stderr,
                r.info_gain_per_question.mean,
                r.info_gain_per_question.stderr,
                100.0 * r.unparsed_rate,
            ));
        }
        for w in &self.warnings {
            out.push_str(&format!("\nwarning: {w}"));
        }
        if !self.warnings.is_empty() {
            out.push('\n');
        }
        out
    }
}
