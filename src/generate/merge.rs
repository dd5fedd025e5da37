//! `generate_conv --merge SHARD_DIR... --output DIR`: shard runs (`--shard i/n`, one per
//! machine) combined into one run directory — conversations concatenated, then pairs, flat
//! and SFT data rebuilt from them as `--rescore` does (pairs re-split by conversation over the
//! whole set), and a manifest whose usage is the sum of the shards'. Refused: a shard still
//! running or unfinished, shards made with different settings (named), a task in two shards.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use serde_json::Value;

use super::config::GenerateConfig;
use super::run::{rescore, RunSummary, MANIFEST_FILE};
use crate::rollout::records::{read_records, ConversationRecord, CONVERSATIONS_FILE};
use crate::run::{changed_keys, write_atomic, write_json_atomic, RunLock};

/// One shard run as read for a merge.
struct ShardRun {
    dir: PathBuf,
    manifest: Value,
    records: Vec<ConversationRecord>,
}

fn read_shard(dir: &Path) -> anyhow::Result<ShardRun> {
    let _lock = RunLock::acquire(dir).with_context(|| format!("--merge {}", dir.display()))?;
    let path = dir.join(MANIFEST_FILE);
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("--merge {}: not a generate_conv run", dir.display()))?;
    let manifest: Value =
        serde_json::from_str(&text).with_context(|| format!("reading {}", path.display()))?;
    let status = manifest["status"].as_str().unwrap_or("unknown");
    if status != "complete" {
        bail!(
            "--merge {}: the run is {status}; finish it (rerun its command) before merging",
            dir.display()
        );
    }
    let failed = manifest["failed_tasks"].as_array().map_or(0, Vec::len);
    if failed > 0 {
        bail!(
            "--merge {}: {failed} task(s) failed; rerun its command to retry them first",
            dir.display()
        );
    }
    let records = read_records(dir)?;
    Ok(ShardRun {
        dir: dir.to_path_buf(),
        manifest,
        records,
    })
}

/// The settings that must agree between shards: the generation identity without the shard.
fn identity(m: &Value) -> Value {
    let mut id = m["generation_identity"].clone();
    if let Some(o) = id.as_object_mut() {
        o.remove("shard");
    }
    id
}

/// Sums two JSON usage tables (numbers added, objects merged key by key).
fn add_usage(a: &mut Value, b: &Value) {
    match (a, b) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                add_usage(a.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
        (a @ Value::Null, b) => *a = b.clone(),
        (Value::Number(x), Value::Number(y)) => {
            let sum = match (x.as_u64(), y.as_u64()) {
                (Some(x), Some(y)) => Value::from(x + y),
                _ => Value::from(x.as_f64().unwrap_or(0.0) + y.as_f64().unwrap_or(0.0)),
            };
            *x = match sum {
                Value::Number(n) => n,
                _ => unreachable!("a sum is a number"),
            };
        }
        _ => {}
    }
}

/// Merges the shard runs in `shards` into `output` (which must not hold a run yet).
pub fn merge_runs(shards: &[PathBuf], output: &Path) -> anyhow::Result<RunSummary> {
    if shards.len() < 2 {
        bail!("--merge needs at least two shard run directories");
    }
    if output.join(MANIFEST_FILE).exists() || output.join(CONVERSATIONS_FILE).exists() {
        bail!(
            "{}: already holds a run; merge into a new --output",
            output.display()
        );
    }
    let runs: Vec<ShardRun> = shards
        .iter()
        .map(|d| read_shard(d))
        .collect::<anyhow::Result<_>>()?;
    let first = &runs[0];
    let want = identity(&first.manifest);
    for r in &runs[1..] {
        let got = identity(&r.manifest);
        let names = changed_keys(&got, &want);
        if !names.is_empty() {
            bail!(
                "--merge: {} and {} were made with different settings ({})",
                first.dir.display(),
                r.dir.display(),
                names.join(", ")
            );
        }
    }
    let mut owner: HashMap<&str, &Path> = HashMap::new();
    for r in &runs {
        for rec in &r.records {
            if let Some(other) = owner.insert(&rec.task_id, &r.dir) {
                bail!(
                    "--merge: task {} is in both {} and {}; shards must not overlap",
                    rec.task_id,
                    other.display(),
                    r.dir.display()
                );
            }
        }
    }
    let shard_specs: Vec<Value> = runs
        .iter()
        .map(|r| r.manifest["config"]["shard"].clone())
        .collect();

    std::fs::create_dir_all(output).with_context(|| format!("creating {}", output.display()))?;
    let mut lines = String::new();
    for r in &runs {
        for rec in &r.records {
            lines.push_str(&serde_json::to_string(rec)?);
            lines.push('\n');
        }
    }
    {
        let _lock = RunLock::acquire(output)?;
        write_atomic(&output.join(CONVERSATIONS_FILE), lines.as_bytes())?;
        let mut usage_total = Value::Null;
        for r in &runs {
            add_usage(&mut usage_total, &r.manifest["usage_total"]);
        }
        let mut m = first.manifest.clone();
        m["config"]["output"] = Value::from(output.display().to_string());
        m["config"]["shard"] = Value::Null;
        m["generation_identity"]["shard"] = Value::Null;
        m["usage_total"] = usage_total;
        m["usage"] = Value::Null;
        m["merged_from"] = Value::from(
            runs.iter()
                .zip(&shard_specs)
                .map(|(r, s)| {
                    let mut o = BTreeMap::new();
                    o.insert("dir", Value::from(r.dir.display().to_string()));
                    o.insert("shard", s.clone());
                    o.insert("tasks", Value::from(r.records.len()));
                    serde_json::to_value(o).unwrap_or_default()
                })
                .collect::<Vec<_>>(),
        );
        write_json_atomic(&output.join(MANIFEST_FILE), &m)?;
    }
    // Pairs, flat and SFT data from the merged conversations, with the shards' own scoring.
    let mut cfg: GenerateConfig = serde_json::from_value(first.manifest["config"].clone())
        .with_context(|| format!("{}: config in manifest.json", first.dir.display()))?;
    cfg.output = output.to_path_buf();
    cfg.shard = None;
    rescore(&cfg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn usage_tables_add_key_by_key() {
        let mut a = json!({"user": {"calls": 2, "cost": 0.5}, "judge": {"calls": 1}});
        add_usage(
            &mut a,
            &json!({"user": {"calls": 3, "cost": 0.25}, "policy": {"calls": 4}}),
        );
        assert_eq!(
            a,
            json!({"user": {"calls": 5, "cost": 0.75}, "judge": {"calls": 1}, "policy": {"calls": 4}})
        );
    }
}
