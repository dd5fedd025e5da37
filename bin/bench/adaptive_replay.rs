//! Adaptive future sampling replayed over a finished generate_conv run (made with a fixed S):
//! for each interval width, the futures the rule plays as a share of the run's, and how often
//! its (chosen, rejected) pair is the fixed-S pair. No model is called.

use std::path::{Path, PathBuf};

use anyhow::Context;
use collabllm::reward::adaptive::{pair_of, replay, AdaptiveRule};
use rand::SeedableRng;
use serde_json::Value;

#[derive(clap::Args, Debug)]
pub struct Params {
    /// generate_conv run directories (their conversations.jsonl), made with --samples S ≥ 4.
    #[arg(required = true)]
    runs: Vec<PathBuf>,
    /// Interval widths (standard errors) to try, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,1.645,1.96,2.576")]
    z: Vec<f64>,
    /// Futures every candidate gets first.
    #[arg(long, default_value_t = 2)]
    min_futures: usize,
    /// Random orders of each turn's stored futures.
    #[arg(long, default_value_t = 200)]
    orders: usize,
    /// The pair's minimum MR gap (generate_conv's --min-gap).
    #[arg(long, default_value_t = 0.02)]
    min_gap: f64,
    /// Also write the table as JSON (for `plot adaptive`); its folder must exist, and an
    /// existing FILE must be a regular file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

/// One stored turn: each candidate's text and its futures' rewards.
struct Turn {
    texts: Vec<String>,
    futures: Vec<Vec<f64>>,
}

impl Turn {
    /// Whether the fixed-S run could have made this pair: no pair where it made none, else
    /// a chosen reply among its best (by text, or tied with its best mean) and a rejected one
    /// among its worst — candidates the fixed-S means cannot tell apart make the same pair.
    fn fixed_s_would_pick(&self, pair: Option<(usize, usize)>, min_gap: f64) -> bool {
        let fixed = pair_of(&self.futures, min_gap);
        let (Some((c, r)), Some((fc, fr))) = (pair, fixed) else {
            return pair.is_none() && fixed.is_none();
        };
        let mean = |i: usize| self.futures[i].iter().sum::<f64>() / self.futures[i].len() as f64;
        let same = |a: usize, b: usize| {
            self.texts[a] == self.texts[b] || (mean(a) - mean(b)).abs() <= 1e-9
        };
        same(c, fc) && same(r, fr)
    }
}

/// Each turn's candidates: text, and per stored session Σ weight × metric value.
fn turns(run: &Path) -> anyhow::Result<Vec<Turn>> {
    let path = run.join("conversations.jsonl");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    for (n, line) in text.lines().filter(|l| !l.trim().is_empty()).enumerate() {
        let rec: Value = serde_json::from_str(line)
            .with_context(|| format!("{}: line {}", path.display(), n + 1))?;
        let weights = rec["weights"].as_object().cloned().unwrap_or_default();
        for turn in rec["turns"].as_array().into_iter().flatten() {
            let candidates = turn["candidates"].as_array().into_iter().flatten();
            let futures: Vec<Vec<f64>> = candidates
                .clone()
                .map(|c| {
                    c["sessions"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|s| {
                            weights.iter().try_fold(0.0, |sum, (m, w)| {
                                Some(sum + w.as_f64()? * s["scores"][m]["value"].as_f64()?)
                            })
                        })
                        .collect()
                })
                .collect();
            let texts = candidates
                .map(|c| c["text"].as_str().unwrap_or_default().to_string())
                .collect();
            if futures.len() >= 2 && futures.iter().all(|c| c.len() >= 2) {
                out.push(Turn { texts, futures });
            }
        }
    }
    Ok(out)
}

/// One setting's replay: futures played as a share of the stored ones, and how often the
/// pair's replies are the fixed-S pair's.
#[derive(serde::Serialize)]
struct Point {
    z: f64,
    futures_share: f64,
    agreement: f64,
}

fn replay_all(all: &[Turn], rule: &AdaptiveRule, p: &Params) -> Point {
    let stored: usize = all.iter().flat_map(|t| &t.futures).map(Vec::len).sum();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    let (mut used, mut agree, mut trials) = (0usize, 0usize, 0usize);
    for turn in all {
        for _ in 0..p.orders {
            let out = replay(&turn.futures, rule, p.min_gap, &mut rng);
            used += out.futures;
            agree += usize::from(turn.fixed_s_would_pick(out.pair, p.min_gap));
            trials += 1;
        }
    }
    Point {
        z: rule.z,
        futures_share: used as f64 / (stored * p.orders) as f64,
        agreement: agree as f64 / trials as f64,
    }
}

pub fn run(p: Params) -> anyhow::Result<()> {
    if let Some(path) = &p.json {
        collabllm::run::check_output_file("--json", path, collabllm::run::Parents::MustExist)?;
    }
    let mut all = Vec::new();
    for r in &p.runs {
        all.extend(turns(r)?);
    }
    anyhow::ensure!(
        !all.is_empty(),
        "no turn with two or more candidates of two or more scored futures in {:?}",
        p.runs
    );
    let stored: usize = all.iter().flat_map(|t| &t.futures).map(Vec::len).sum();
    let max_s = all
        .iter()
        .flat_map(|t| &t.futures)
        .map(Vec::len)
        .max()
        .unwrap_or(0);
    println!(
        "{} turns, {} stored futures (S up to {max_s}), {} orders each",
        all.len(),
        stored,
        p.orders
    );
    println!("| z | futures / fixed S | pair = a fixed-S pair |");
    println!("|---|---|---|");
    let mut points = Vec::new();
    for &z in &p.z {
        let rule = AdaptiveRule {
            min_futures: p.min_futures,
            max_futures: max_s,
            z,
        };
        rule.validate().map_err(anyhow::Error::msg)?;
        let point = replay_all(&all, &rule, &p);
        println!(
            "| {z} | {:.3} | {:.3} |",
            point.futures_share, point.agreement
        );
        points.push(point);
    }
    if let Some(path) = &p.json {
        let runs: Vec<String> = p.runs.iter().map(|r| r.display().to_string()).collect();
        let doc = serde_json::json!({"runs": runs, "turns": all.len(), "stored_futures": stored,
            "max_futures": max_s, "orders": p.orders, "min_gap": p.min_gap, "points": points});
        collabllm::run::write_atomic(path, serde_json::to_string_pretty(&doc)?.as_bytes())?;
    }
    Ok(())
}
