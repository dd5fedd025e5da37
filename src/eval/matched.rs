//! Matched training arms of a study: arms compared as equals must have trained alike. For each
//! seed, every matched arm's training run (a `dpo_train` or `rl_train` output directory) must
//! have taken the same number of optimizer steps under the same learning rate, schedule and
//! warm-up, and trained tokens within [`TOKEN_TOLERANCE`] of each other; a study whose arms
//! differ is refused, not reported. What each run did goes into the results.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// Default largest ratio of trained tokens between matched arms of one seed, minus 1.
pub const TOKEN_TOLERANCE: f64 = 0.10;

/// What one training run did, read from its output directory.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainedRun {
    pub dir: String,
    pub steps: u64,
    /// Tokens the optimizer steps processed (TRL's `num_tokens`).
    pub num_tokens: u64,
    pub lr: f64,
    pub schedule: String,
    pub warmup_ratio: f64,
}

fn read_json(path: &Path) -> Result<serde_json::Value, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// Reads a `dpo_train` (`train_summary.json`, `training_args.json`) or `rl_train`
/// (`rl_summary.json`, `rl_config.json`) output directory.
pub fn read_trained_run(dir: &str) -> Result<TrainedRun, String> {
    let root = Path::new(dir);
    let (summary, args) = if root.join("train_summary.json").is_file() {
        ("train_summary.json", "training_args.json")
    } else {
        ("rl_summary.json", "rl_config.json")
    };
    let summary = read_json(&root.join(summary))?;
    let args = read_json(&root.join(args))?;
    let field = |v: &serde_json::Value, key: &str, file: &str| {
        v.get(key)
            .cloned()
            .ok_or_else(|| format!("{dir}: {file} has no `{key}`"))
    };
    let number = |v: serde_json::Value, what: &str| {
        v.as_f64()
            .ok_or_else(|| format!("{dir}: `{what}` is not a number"))
    };
    Ok(TrainedRun {
        dir: dir.to_string(),
        steps: number(field(&summary, "steps", "its summary")?, "steps")? as u64,
        num_tokens: number(
            field(&summary["last_log"], "num_tokens", "its summary's last_log")?,
            "num_tokens",
        )? as u64,
        lr: number(field(&args, "lr", "its settings")?, "lr")?,
        schedule: field(&args, "schedule", "its settings")?
            .as_str()
            .unwrap_or_default()
            .to_string(),
        warmup_ratio: number(
            field(&args, "warmup_ratio", "its settings")?,
            "warmup_ratio",
        )?,
    })
}

/// Checks that the runs of one seed (arm name, run) trained alike, their tokens within
/// `tolerance`; the error names the arms and what differs.
pub fn check_matched(
    seed: usize,
    runs: &[(&str, &TrainedRun)],
    tolerance: f64,
) -> Result<(), String> {
    let Some((first_arm, first)) = runs.first() else {
        return Ok(());
    };
    for (arm, run) in &runs[1..] {
        let differ = |what: &str, a: String, b: String| {
            Err(format!(
                "matched arms differ at seed {}: `{first_arm}` {what} {a} ({}), `{arm}` {b} ({})",
                seed + 1,
                first.dir,
                run.dir
            ))
        };
        if run.steps != first.steps {
            return differ(
                "took optimizer steps:",
                first.steps.to_string(),
                run.steps.to_string(),
            );
        }
        if run.lr != first.lr
            || run.schedule != first.schedule
            || run.warmup_ratio != first.warmup_ratio
        {
            return differ(
                "trained with learning rate, schedule, warm-up",
                format!("{} {} {}", first.lr, first.schedule, first.warmup_ratio),
                format!("{} {} {}", run.lr, run.schedule, run.warmup_ratio),
            );
        }
    }
    let tokens = runs.iter().map(|(_, r)| r.num_tokens);
    let (lo, hi) = (tokens.clone().min().unwrap_or(0), tokens.max().unwrap_or(0));
    if lo == 0 || hi as f64 > lo as f64 * (1.0 + tolerance) {
        let all: Vec<String> = runs
            .iter()
            .map(|(arm, r)| format!("`{arm}` {}", r.num_tokens))
            .collect();
        return Err(format!(
            "matched arms differ at seed {} in trained tokens by more than {:.0}%: {}",
            seed + 1,
            100.0 * tolerance,
            all.join(", ")
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(steps: u64, tokens: u64) -> TrainedRun {
        TrainedRun {
            dir: "d".into(),
            steps,
            num_tokens: tokens,
            lr: 1e-5,
            schedule: "linear".into(),
            warmup_ratio: 0.0,
        }
    }

    #[test]
    fn arms_must_match_in_steps_schedule_and_tokens() {
        let (a, b) = (run(30, 1000), run(30, 1090));
        assert!(check_matched(0, &[("control", &a), ("dpo", &b)], TOKEN_TOLERANCE).is_ok());
        let e = check_matched(
            0,
            &[("control", &a), ("dpo", &run(31, 1000))],
            TOKEN_TOLERANCE,
        )
        .unwrap_err();
        assert!(
            e.contains("optimizer steps: 30") && e.contains("`dpo` 31"),
            "{e}"
        );
        let e = check_matched(
            2,
            &[("control", &a), ("dpo", &run(30, 1200))],
            TOKEN_TOLERANCE,
        )
        .unwrap_err();
        assert!(e.contains("seed 3") && e.contains("trained tokens"), "{e}");
        assert!(check_matched(2, &[("control", &a), ("dpo", &run(30, 1200))], 0.25).is_ok());
        let mut c = run(30, 1000);
        c.lr = 2e-5;
        assert!(
            check_matched(0, &[("control", &a), ("dpo", &c)], TOKEN_TOLERANCE)
                .unwrap_err()
                .contains("learning rate")
        );
    }
}
