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
    #[arg(long, default_value_t = 0.0)]
    min_gap: f64,
}

/// Each turn's candidates' future rewards: Σ weight × metric value per stored session.
fn turns(run: &Path) -> anyhow::Result<Vec<Vec<Vec<f64>>>> {
    let path = run.join("conversations.jsonl");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    for (n, line) in text.lines().filter(|l| !l.trim().is_empty()).enumerate() {
        let rec: Value = serde_json::from_str(line)
            .with_context(|| format!("{}: line {}", path.display(), n + 1))?;
        let weights = rec["weights"].as_object().cloned().unwrap_or_default();
        for turn in rec["turns"].as_array().into_iter().flatten() {
            let candidates: Vec<Vec<f64>> = turn["candidates"]
                .as_array()
                .into_iter()
                .flatten()
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
            if candidates.len() >= 2 && candidates.iter().all(|c| c.len() >= 2) {
                out.push(candidates);
            }
        }
    }
    Ok(out)
}

pub fn run(p: Params) -> anyhow::Result<()> {
    let mut all = Vec::new();
    for r in &p.runs {
        all.extend(turns(r)?);
    }
    anyhow::ensure!(
        !all.is_empty(),
        "no turn with two or more candidates of two or more scored futures in {:?}",
        p.runs
    );
    let stored: usize = all.iter().flatten().map(Vec::len).sum();
    let max_s = all.iter().flatten().map(Vec::len).max().unwrap_or(0);
    println!(
        "{} turns, {} stored futures (S up to {max_s}), {} orders each",
        all.len(),
        stored,
        p.orders
    );
    println!("| z | futures / fixed S | pair = fixed-S pair |");
    println!("|---|---|---|");
    for &z in &p.z {
        let rule = AdaptiveRule {
            min_futures: p.min_futures,
            max_futures: max_s,
            z,
        };
        rule.validate().map_err(anyhow::Error::msg)?;
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        let (mut used, mut agree, mut trials) = (0usize, 0usize, 0usize);
        for turn in &all {
            let fixed = pair_of(turn, p.min_gap);
            for _ in 0..p.orders {
                let out = replay(turn, &rule, p.min_gap, &mut rng);
                used += out.futures;
                agree += usize::from(out.pair == fixed);
                trials += 1;
            }
        }
        println!(
            "| {z} | {:.3} | {:.3} |",
            used as f64 / (stored * p.orders) as f64,
            agree as f64 / trials as f64
        );
    }
    Ok(())
}
