//! `generate_conv --merge SHARD_DIR... --output DIR`: shard runs (`--shard i/n`, one per
//! machine) combined into one run directory — conversations concatenated, then pairs, flat
//! and SFT data rebuilt from them as `--rescore` does (pairs re-split by conversation over the
//! whole set), and a manifest whose usage is the sum of the shards'. Refused: a shard still
//! running or unfinished, shards made with different settings (named: any setting but where
//! and how fast each ran), a task in two shards, and shards that are not one whole `i/n`
//! split (a shard missing, twice, or of another count).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use serde_json::{json, Value};

use super::config::GenerateConfig;
use super::run::{rescore, RunSummary, MANIFEST_FILE};
use crate::llm::add_usage;
use crate::llm::usage::manifest_usage;
use crate::rollout::records::{read_records, ConversationRecord, CONVERSATIONS_FILE};
use crate::run::{
    changed_keys, now_secs, write_atomic, write_json_atomic, Manifest, ManifestHeader, RunLock,
    RunStatus,
};

/// One shard run as read for a merge.
struct ShardRun {
    dir: PathBuf,
    manifest: Manifest,
    config: GenerateConfig,
    records: Vec<ConversationRecord>,
}

fn read_shard(dir: &Path) -> anyhow::Result<ShardRun> {
    let _lock = RunLock::acquire(dir).with_context(|| format!("--merge {}", dir.display()))?;
    let path = dir.join(MANIFEST_FILE);
    let Some(manifest) = Manifest::read(&path)? else {
        bail!(
            "--merge {}: not a generate_conv run (no {MANIFEST_FILE})",
            dir.display()
        );
    };
    let status = manifest.header.status;
    if status != RunStatus::Complete {
        bail!(
            "--merge {}: the run is {}; finish it (rerun its command) before merging",
            dir.display(),
            status.name()
        );
    }
    let failed = manifest
        .field("failed_tasks")
        .as_array()
        .map_or(0, Vec::len);
    if failed > 0 {
        bail!(
            "--merge {}: {failed} task(s) failed; rerun its command to retry them first",
            dir.display()
        );
    }
    let config: GenerateConfig = serde_json::from_value(manifest.config.clone())
        .with_context(|| format!("{}: config", path.display()))?;
    let records = read_records(dir)?;
    Ok(ShardRun {
        dir: dir.to_path_buf(),
        manifest,
        config,
        records,
    })
}

/// The settings that must agree between shards: the generation identity without the shard.
fn identity(m: &Manifest) -> Value {
    let mut id = m.field("generation_identity").clone();
    if let Some(o) = id.as_object_mut() {
        o.remove("shard");
    }
    id
}

/// Settings that may differ between shards: where and how fast each ran, never what it made.
const MAY_DIFFER: &[&str] = &[
    "output",
    "shard",
    "threads",
    "concurrency",
    "endpoint",
    "prices",
    "judge_retries",
    "user_retries",
    "proactive_retries",
    "sandbox_timeout_s",
];

/// The run's settings that decide its data (tasks, pairs, scoring): all but [`MAY_DIFFER`].
fn data_settings(m: &Manifest) -> Value {
    let mut c = m.config.clone();
    if let Some(o) = c.as_object_mut() {
        for k in MAY_DIFFER {
            o.remove(*k);
        }
    }
    c
}

/// The shards must be every shard `0..n` of one `n`, each once.
fn check_whole(runs: &[ShardRun]) -> anyhow::Result<()> {
    let mut seen: BTreeMap<usize, &Path> = BTreeMap::new();
    let mut count = None;
    for r in runs {
        let Some(shard) = r.config.shard else {
            bail!(
                "--merge {}: not a shard run (made without --shard i/n)",
                r.dir.display()
            );
        };
        match count {
            None => count = Some((shard.count, &r.dir)),
            Some((n, dir)) if n != shard.count => bail!(
                "--merge: {} is a shard of {n} but {} is shard {shard}; merge the shards of one \
                 --shard i/n split",
                dir.display(),
                r.dir.display()
            ),
            Some(_) => {}
        }
        if let Some(other) = seen.insert(shard.index, &r.dir) {
            bail!(
                "--merge: {} and {} are both shard {shard}",
                other.display(),
                r.dir.display()
            );
        }
    }
    let n = count.map_or(0, |c| c.0);
    let missing: Vec<String> = (0..n)
        .filter(|i| !seen.contains_key(i))
        .map(|i| format!("{i}/{n}"))
        .collect();
    if !missing.is_empty() {
        bail!(
            "--merge: shard(s) {} missing; a merge needs all {n} shards",
            missing.join(", ")
        );
    }
    Ok(())
}

/// Merges the shard runs in `shards` into `output` (which must not hold a run yet).
pub fn merge_runs(shards: &[PathBuf], output: &Path) -> anyhow::Result<RunSummary> {
    let started_at = now_secs();
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
    let want_data = data_settings(&first.manifest);
    for r in &runs[1..] {
        let got = identity(&r.manifest);
        let mut names = changed_keys(&got, &want);
        for k in changed_keys(&data_settings(&r.manifest), &want_data)
            .into_iter()
            .chain(changed_keys(&want_data, &data_settings(&r.manifest)))
        {
            if !names.contains(&k) {
                names.push(k);
            }
        }
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
    check_whole(&runs)?;
    // Pairs, flat and SFT data from the merged conversations, with the shards' own scoring.
    let mut cfg = first.config.clone();
    cfg.output = output.to_path_buf();
    cfg.shard = None;

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
        let usage_total = runs.iter().fold(BTreeMap::new(), |sum, r| {
            add_usage(&sum, &manifest_usage(&r.manifest))
        });
        // The first shard's stage fields, made the merged run's.
        let mut stage = first.manifest.rest.clone();
        stage.insert("config".into(), serde_json::to_value(&cfg)?);
        stage.insert("seed".into(), json!(first.manifest.seed));
        if let Some(id) = stage
            .get_mut("generation_identity")
            .and_then(Value::as_object_mut)
        {
            id.insert("shard".into(), Value::Null);
        }
        stage.insert("usage_total".into(), serde_json::to_value(&usage_total)?);
        stage.insert("usage".into(), Value::Null);
        stage.insert(
            "merged_from".into(),
            runs.iter()
                .map(|r| {
                    json!({
                        "dir": r.dir.display().to_string(),
                        "shard": r.config.shard,
                        "tasks": r.records.len(),
                    })
                })
                .collect(),
        );
        let header = ManifestHeader::now(
            &first.manifest.header.tool,
            started_at,
            RunStatus::Complete,
            None,
        );
        write_json_atomic(
            &output.join(MANIFEST_FILE),
            &header.with_fields(Value::Object(stage)),
        )?;
    }
    rescore(&cfg)
}
