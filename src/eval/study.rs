//! A trained-arms study (`eval_multiturn --study SPEC.toml`): the statistics a reviewer asks
//! for when a method claims to beat its baselines.
//!
//! The spec names arms (each a list of evaluated runs, one per seed: an `eval_multiturn`
//! output directory, optionally `DIR:label` when it holds several models) and the
//! comparisons to make. Every record's primary outcome (`success` of a 20 Questions game,
//! `detail_used` or `task_reward` of a clarify conversation, or any metric named by
//! `primary`: 0/1 or any number) is read per conversation (task or object, and repeat) and
//! grouped into *clusters*: the 20 Questions object or the task id, or with
//! `cluster = "template"` the clarify template a request was made from (the unit that
//! repeats: every value of a template, stated or vague, moves together). For each
//! comparison:
//!
//! - per seed, an exact sign test on the paired outcomes (seed k of the arm against seed k of
//!   the other, or against its only run): McNemar's exact test when the outcome is 0/1;
//! - pooled over seeds, the difference of means with a percentile bootstrap interval that
//!   resamples *clusters* (an object carries all its seeds' games with it, a template all
//!   its requests, so the interval does not pretend that repeats of one unit are independent),
//!   and the bootstrap's two-sided p (twice the smaller tail beyond 0);
//! - pooled over seeds, the *cluster-level* sign-flip test (the primary test where clusters
//!   are templates): each cluster's difference, pooled over its seeds, keeps or flips its
//!   sign at random under the null that the two arms are exchangeable within a cluster; the
//!   statistic is the pooled difference (clusters weighted by their conversations), and p
//!   the share of the 2^m sign patterns (exact up to 22 clusters, else 200,000 random ones)
//!   at least as far from 0. Per-seed sign tests treat conversations of one cluster as
//!   independent; this test does not.
//!
//! The secondary `ask_macro_f1` (clarify) is the macro F1 of the ask/answer decision over
//! a run's first replies: a question is the right action on a vague request, an answer on a
//! stated one.
//!
//! The output (`study.json`, `study.md`) holds every per-cluster outcome, so the numbers can be
//! checked and recomputed, and whatever the spec carries under `[meta]` (commands, revision,
//! wall time).
//!
//! **Recorded seeds.** Each study also writes `seeds/ARM-K.json`: seed K of an arm (its
//! position in `runs`, from 1) as a self-contained record — its outcomes by conversation,
//! clusters and secondaries, its evaluation's comparable settings, its training summary and
//! the spec fields they depend on (`primary`, `cluster`, `filter`, `secondary`). A later
//! study may name such a file in an arm's `runs` (and in `trained`, for its training summary)
//! instead of an evaluation directory, so seeds run in different sittings or on different
//! machines pool without their evaluation outputs; a record made under other spec fields is
//! refused.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use super::comparable::{check_settings, recorded as comparable_settings, Settings};
use super::compare::{mcnemar_exact, wilson_interval, Z95};
use super::matched::{check_matched, read_trained_run, TrainedRun, TOKEN_TOLERANCE};
use super::records::read_records;
use super::run::CONVERSATIONS_DIR;
use super::summary::write_atomic;

/// Bootstrap resamples of the pooled difference.
pub const BOOTSTRAP_RESAMPLES: usize = 10_000;

#[derive(Debug, thiserror::Error)]
pub enum StudyError {
    #[error("{}: {message}", path.display())]
    Input { path: PathBuf, message: String },
    #[error("study spec: {0}")]
    Spec(String),
}

fn input_err(path: &Path, message: impl Into<String>) -> StudyError {
    StudyError::Input {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// The study spec (TOML).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct StudySpec {
    /// Title of the tables.
    pub title: String,
    /// The outcome compared: a metric of each record, 0/1 (`success` for 20 Questions,
    /// `detail_used` for clarify) or any number (clarify's `task_reward`).
    pub primary: String,
    /// What the bootstrap resamples: `task` (the 20 Questions object or the task id, the
    /// default) or `template` (the record's clarify template).
    #[serde(default)]
    pub cluster: ClusterBy,
    /// Further per-record metrics reported per arm (means over seeds' records); for 20
    /// Questions `identified` (one object left consistent at some point) is computed from
    /// the game.
    #[serde(default)]
    pub secondary: Vec<String>,
    pub arms: Vec<ArmSpec>,
    pub comparisons: Vec<ComparisonSpec>,
    /// Arms that must have trained alike (each names its `trained` runs): per seed the same
    /// optimizer steps, learning rate, schedule and warm-up, and trained tokens within 10%;
    /// a study whose matched arms differ is refused.
    #[serde(default)]
    pub matched: Vec<String>,
    /// How far matched arms' trained tokens may differ: the largest over the smallest, minus
    /// 1 (default 0.10).
    #[serde(default = "default_token_tolerance")]
    pub token_tolerance: f64,
    /// Keep only the records whose top-level field equals the value (e.g. `{ split = "far" }`
    /// for clarify's far-transfer templates); empty: every record.
    #[serde(default)]
    pub filter: BTreeMap<String, String>,
    /// Seed of the bootstrap.
    #[serde(default)]
    pub seed: u64,
    /// Copied into the output as is (commands, revision, wall time, notes).
    #[serde(default)]
    pub meta: toml::Table,
}

fn default_token_tolerance() -> f64 {
    TOKEN_TOLERANCE
}

/// The unit a bootstrap resamples.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ClusterBy {
    #[default]
    Task,
    Template,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ArmSpec {
    pub name: String,
    /// One evaluated run per seed: `DIR` or `DIR:label`.
    pub runs: Vec<String>,
    /// The training run (`dpo_train` or `rl_train` output directory) of each seed's model,
    /// in the order of `runs`: read for `matched` and reported.
    #[serde(default)]
    pub trained: Vec<String>,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ComparisonSpec {
    pub arm: String,
    pub against: String,
}

/// One run of an arm: outcomes by conversation, and the secondary metrics' values.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunOutcomes {
    pub run: String,
    pub label: String,
    pub n: usize,
    /// Outcomes of at least 0.5 (the successes of a 0/1 outcome).
    pub successes: usize,
    /// The mean outcome (the success rate of a 0/1 outcome).
    pub rate: f64,
    /// Wilson's interval for a 0/1 outcome; the normal interval of the mean otherwise.
    pub rate_ci95: (f64, f64),
    /// Whether every outcome is 0 or 1.
    pub binary: bool,
    /// `task#repeat` (20 Questions: `object-NNN#repeat`) → outcome.
    pub outcomes: BTreeMap<String, f64>,
    /// `task#repeat` → its cluster, where the cluster is not the task.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub clusters: BTreeMap<String, String>,
    /// metric → mean over the records that have it.
    pub secondary: BTreeMap<String, Option<f64>>,
    /// The evaluation's comparable settings (kept in a recorded seed, not in `study.json`).
    #[serde(skip)]
    pub comparable: Settings,
}

/// The format tag of a recorded seed (`seeds/ARM-K.json`).
pub const SEED_FORMAT: &str = "collabllm-study-seed/1";

/// One seed of an arm as a study records it for later pooling (see the module docs).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordedSeed {
    pub format: String,
    /// The study (its title: for clarify, the held-out set, evaluation mode and outcome) and
    /// the arm the seed was recorded for: a record pools only into the same arm of the same
    /// study.
    pub title: String,
    pub arm: String,
    pub primary: String,
    pub cluster: ClusterBy,
    pub filter: BTreeMap<String, String>,
    pub secondary: Vec<String>,
    /// The evaluation's comparable settings (an empty map: not compared).
    pub comparable: Settings,
    pub outcomes: RunOutcomes,
    /// The training summary of the seed's model, when the arm named its training run.
    pub trained: Option<TrainedRun>,
}

/// Whether an arm's run (or trained run) names a recorded seed rather than a directory.
fn is_recorded(run: &str) -> bool {
    run.ends_with(".json")
}

/// Reads a recorded seed of arm `arm` and refuses one recorded for another arm or study, or
/// under other spec fields than `spec`'s.
fn read_recorded(spec: &StudySpec, arm: &str, run: &str) -> Result<RecordedSeed, StudyError> {
    let path = Path::new(run);
    let text = std::fs::read_to_string(path).map_err(|e| input_err(path, e.to_string()))?;
    let seed: RecordedSeed = serde_json::from_str(&text)
        .map_err(|e| input_err(path, format!("not a recorded seed: {e}")))?;
    if seed.format != SEED_FORMAT {
        return Err(input_err(
            path,
            format!("format `{}`, expected `{SEED_FORMAT}`", seed.format),
        ));
    }
    let sorted = |v: &[String]| v.iter().cloned().collect::<BTreeSet<_>>();
    let differs = [
        (
            "title",
            seed.title != spec.title,
            format!("{:?}", seed.title),
            format!("{:?}", spec.title),
        ),
        (
            "arm",
            seed.arm != arm,
            format!("{:?}", seed.arm),
            format!("{arm:?}"),
        ),
        (
            "primary",
            seed.primary != spec.primary,
            format!("{:?}", seed.primary),
            format!("{:?}", spec.primary),
        ),
        (
            "cluster",
            seed.cluster != spec.cluster,
            format!("{:?}", seed.cluster),
            format!("{:?}", spec.cluster),
        ),
        (
            "filter",
            seed.filter != spec.filter,
            format!("{:?}", seed.filter),
            format!("{:?}", spec.filter),
        ),
        (
            "secondary",
            sorted(&seed.secondary) != sorted(&spec.secondary),
            format!("{:?}", seed.secondary),
            format!("{:?}", spec.secondary),
        ),
    ];
    if let Some((field, _, was, is)) = differs.into_iter().find(|d| d.1) {
        return Err(input_err(
            path,
            format!(
                "recorded with {field} {was}, here it is {is}: pool seeds of the same arm of the \
                 same study"
            ),
        ));
    }
    Ok(seed)
}

#[derive(Clone, Debug, Serialize)]
pub struct ArmResult {
    pub name: String,
    pub seeds: Vec<RunOutcomes>,
    /// The mean outcome over every seed's records (the success rate of a 0/1 outcome).
    pub pooled_rate: f64,
    /// Bootstrap interval of the pooled rate, clusters resampled.
    pub pooled_ci95: (f64, f64),
    /// metric → mean of the seeds' means.
    pub secondary: BTreeMap<String, Option<f64>>,
}

#[derive(Clone, Debug, Serialize)]
pub struct SeedTest {
    pub arm_run: String,
    pub against_run: String,
    pub paired: usize,
    /// Better for `against` (b) and better for `arm` (c): for a 0/1 outcome, won only by
    /// one of them.
    pub b: usize,
    pub c: usize,
    /// The exact two-sided sign test of b against c (McNemar's exact test for 0/1).
    pub mcnemar_p: f64,
    /// The arm's mean minus the other's on the paired conversations.
    pub difference: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct ComparisonResult {
    pub arm: String,
    pub against: String,
    pub per_seed: Vec<SeedTest>,
    /// Mean over seeds of (arm rate − against rate) on the paired outcomes.
    pub pooled_difference: f64,
    pub ci95: (f64, f64),
    pub p_bootstrap: f64,
    pub clusters: usize,
    /// The cluster-level sign-flip test of the pooled difference.
    pub sign_flip: SignFlip,
}

/// A cluster-level sign-flip (permutation) test: clusters whose pooled difference favours
/// the arm, the other, or neither, and the two-sided p.
#[derive(Clone, Debug, Serialize)]
pub struct SignFlip {
    pub favour_arm: usize,
    pub favour_against: usize,
    pub ties: usize,
    pub p: f64,
    /// `exact` (every sign pattern) or `monte_carlo` (random patterns).
    pub method: String,
}

/// Sign patterns a test enumerates exactly; beyond, [`SIGN_FLIP_DRAWS`] random ones.
const SIGN_FLIP_EXACT_MAX: usize = 22;
const SIGN_FLIP_DRAWS: usize = 200_000;

/// The two-sided sign-flip test of `Σ w_c d_c` (cluster differences `d`, weights `w`).
pub fn sign_flip_test(d: &[f64], w: &[f64], seed: u64) -> SignFlip {
    let observed: f64 = d.iter().zip(w).map(|(d, w)| d * w).sum();
    let terms: Vec<f64> = d.iter().zip(w).map(|(d, w)| (d * w).abs()).collect();
    // A pattern counts when its statistic is as far from 0 as the observed one; the slack
    // absorbs the rounding of sums taken in another order.
    let tol = 1e-12 * (1.0 + terms.iter().sum::<f64>());
    let extreme = |t: f64| t.abs() >= observed.abs() - tol;
    let m = terms.len();
    let (hits, total, method) = if m <= SIGN_FLIP_EXACT_MAX {
        let mut hits = 0u64;
        for mask in 0u64..(1u64 << m) {
            let t: f64 = (0..m)
                .map(|i| {
                    if mask >> i & 1 == 1 {
                        -terms[i]
                    } else {
                        terms[i]
                    }
                })
                .sum();
            hits += u64::from(extreme(t));
        }
        (hits as f64, (1u64 << m) as f64, "exact")
    } else {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut hits = 1u64; // the observed pattern itself (a valid Monte Carlo p)
        for _ in 0..SIGN_FLIP_DRAWS {
            let t: f64 = terms
                .iter()
                .map(|x| if rng.random_bool(0.5) { -x } else { *x })
                .sum();
            hits += u64::from(extreme(t));
        }
        (hits as f64, (SIGN_FLIP_DRAWS + 1) as f64, "monte_carlo")
    };
    SignFlip {
        favour_arm: d.iter().filter(|x| **x > 0.0).count(),
        favour_against: d.iter().filter(|x| **x < 0.0).count(),
        ties: d.iter().filter(|x| **x == 0.0).count(),
        p: (hits / total).min(1.0),
        method: method.into(),
    }
}

/// Each cluster's difference pooled over seeds (the mean over seeds of the two arms' cluster
/// means) and its weight (its share of a seed's conversations).
fn cluster_differences(ca: &[&Vec<(f64, f64)>], cb: &[&Vec<(f64, f64)>]) -> (Vec<f64>, Vec<f64>) {
    let seeds = ca.first().map_or(0, |c| c.len()).max(1);
    let total: f64 = ca.iter().map(|c| c.first().map_or(0.0, |x| x.1)).sum();
    let mut d = Vec::with_capacity(ca.len());
    let mut w = Vec::with_capacity(ca.len());
    for (a, b) in ca.iter().zip(cb) {
        let mean = |c: &Vec<(f64, f64)>| {
            c.iter()
                .map(|(y, n)| if *n > 0.0 { y / n } else { 0.0 })
                .sum::<f64>()
                / seeds as f64
        };
        d.push(mean(a) - mean(b));
        w.push(a.first().map_or(0.0, |x| x.1) / total.max(1.0));
    }
    (d, w)
}

#[derive(Clone, Debug, Serialize)]
pub struct StudyResult {
    pub title: String,
    pub primary: String,
    pub bootstrap_resamples: usize,
    pub arms: Vec<ArmResult>,
    pub comparisons: Vec<ComparisonResult>,
    /// Arm → what each seed's training run did (the arms that name `trained` runs).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub training: BTreeMap<String, Vec<TrainedRun>>,
    pub meta: toml::Table,
}

/// A record's unit (the 20 Questions object, else the task id) and repeat.
fn unit_of(rec: &serde_json::Value) -> Option<(String, u64)> {
    let repeat = rec["repeat"].as_u64().unwrap_or(0);
    if let Some(o) = rec["game"]["object_index"].as_u64() {
        return Some((format!("object-{o:03}"), repeat));
    }
    rec["task_id"].as_str().map(|t| (t.to_string(), repeat))
}

/// A record's value of `metric`: its `metrics` entry (a boolean is 0/1), or for 20 Questions
/// `identified`: some answer left exactly one object consistent.
fn metric_of(rec: &serde_json::Value, metric: &str) -> Option<f64> {
    if metric == "identified" {
        let turns = rec["game"]["turns"].as_array()?;
        return Some(if turns.iter().any(|t| t["consistent_after"] == 1) {
            1.0
        } else {
            0.0
        });
    }
    match &rec["metrics"][metric] {
        serde_json::Value::Bool(b) => Some(if *b { 1.0 } else { 0.0 }),
        v => v.as_f64(),
    }
}

/// A run's directory and its model label: `DIR` or `DIR:label`.
fn split_run(run: &str) -> (PathBuf, Option<String>) {
    match run.rsplit_once(':') {
        Some((d, l)) if Path::new(d).is_dir() => (PathBuf::from(d), Some(l.to_string())),
        _ => (PathBuf::from(run), None),
    }
}

/// The comparable settings of one run of arm `arm`: its manifest's, or its record's.
fn run_settings(spec: &StudySpec, arm: &str, run: &str) -> Result<Settings, StudyError> {
    if is_recorded(run) {
        return Ok(read_recorded(spec, arm, run)?.comparable);
    }
    comparable_settings(&split_run(run).0).map_err(StudyError::Spec)
}

/// Reads one run (`DIR`, `DIR:label` or a recorded seed's `.json`) of arm `arm`.
fn read_run(spec: &StudySpec, arm: &str, run: &str) -> Result<RunOutcomes, StudyError> {
    if is_recorded(run) {
        let seed = read_recorded(spec, arm, run)?;
        return Ok(RunOutcomes {
            comparable: seed.comparable,
            ..seed.outcomes
        });
    }
    let (dir, label) = split_run(run);
    let comparable = comparable_settings(&dir).map_err(StudyError::Spec)?;
    let conv = dir.join(CONVERSATIONS_DIR);
    let label = match label {
        Some(l) => l,
        None => {
            let files: Vec<String> = std::fs::read_dir(&conv)
                .map_err(|e| input_err(&conv, e.to_string()))?
                .filter_map(|e| e.ok())
                .filter_map(|e| {
                    let p = e.path();
                    if p.extension()? != "jsonl" {
                        return None;
                    }
                    Some(p.file_stem()?.to_string_lossy().into_owned())
                })
                .collect();
            match files.as_slice() {
                [one] => one.clone(),
                _ => {
                    return Err(input_err(
                        &conv,
                        format!(
                            "{} models here ({}); name one as DIR:label",
                            files.len(),
                            files.join(", ")
                        ),
                    ))
                }
            }
        }
    };
    let path = conv.join(format!("{label}.jsonl"));
    let recs = read_records(&path).map_err(|e| input_err(&path, e.to_string()))?;
    if recs.is_empty() {
        return Err(input_err(&path, "no records"));
    }
    let mut outcomes = BTreeMap::new();
    let mut clusters = BTreeMap::new();
    let mut sums: BTreeMap<String, (f64, usize)> = BTreeMap::new();
    let mut decisions = AskDecisions::default();
    let kept = |r: &serde_json::Value| {
        spec.filter
            .iter()
            .all(|(k, v)| r.get(k).and_then(|x| x.as_str()) == Some(v.as_str()))
    };
    for (i, r) in recs.iter().enumerate().filter(|(_, r)| kept(r)) {
        let (unit, repeat) = unit_of(r)
            .ok_or_else(|| input_err(&path, format!("record {}: no object or task id", i + 1)))?;
        let key = format!("{unit}#{repeat}");
        if outcomes.contains_key(&key) {
            continue; // the first record of a game counts, as in the run's summary
        }
        let y = metric_of(r, &spec.primary)
            .filter(|y| y.is_finite())
            .ok_or_else(|| {
                input_err(
                    &path,
                    format!("record {}: no `{}` outcome", i + 1, spec.primary),
                )
            })?;
        if spec.cluster == ClusterBy::Template {
            let t = r["template"].as_str().ok_or_else(|| {
                input_err(
                    &path,
                    format!(
                        "record {}: no `template` to cluster by (cluster = \"template\" is for clarify runs)",
                        i + 1
                    ),
                )
            })?;
            clusters.insert(key.clone(), t.to_string());
        }
        outcomes.insert(key, y);
        decisions.add(r);
        for m in &spec.secondary {
            if let Some(v) = metric_of(r, m) {
                let e = sums.entry(m.clone()).or_default();
                e.0 += v;
                e.1 += 1;
            }
        }
    }
    if outcomes.is_empty() {
        return Err(input_err(
            &path,
            format!("no record matches the filter {:?}", spec.filter),
        ));
    }
    let n = outcomes.len();
    let successes = outcomes.values().filter(|v| **v >= 0.5).count();
    let binary = outcomes.values().all(|v| *v == 0.0 || *v == 1.0);
    let rate = outcomes.values().sum::<f64>() / n as f64;
    let rate_ci95 = if binary {
        wilson_interval(successes, n, Z95)
    } else {
        let var =
            outcomes.values().map(|v| (v - rate).powi(2)).sum::<f64>() / (n.max(2) - 1) as f64;
        let half = Z95 * (var / n as f64).sqrt();
        (rate - half, rate + half)
    };
    Ok(RunOutcomes {
        run: dir.display().to_string(),
        label,
        n,
        successes,
        rate,
        rate_ci95,
        binary,
        outcomes,
        clusters,
        comparable,
        secondary: spec
            .secondary
            .iter()
            .map(|m| {
                let v = match m.as_str() {
                    ASK_MACRO_F1 => decisions.macro_f1(),
                    _ => sums.get(m).map(|(s, k)| s / *k as f64),
                };
                (m.clone(), v)
            })
            .collect(),
    })
}

/// The secondary that scores a clarify run's ask/answer decisions as a classifier.
pub const ASK_MACRO_F1: &str = "ask_macro_f1";

/// Clarify's first-reply decisions as a confusion table: asked on a vague request (right),
/// answered it, asked on a stated one, answered it (right).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AskDecisions {
    pub asked_vague: f64,
    pub answered_vague: f64,
    pub asked_stated: f64,
    pub answered_stated: f64,
}

impl AskDecisions {
    /// Counts a record by its `asked_vague` / `asked_stated` metric (whichever it has).
    fn add(&mut self, rec: &serde_json::Value) {
        if let Some(a) = metric_of(rec, "asked_vague") {
            self.asked_vague += a;
            self.answered_vague += 1.0 - a;
        } else if let Some(a) = metric_of(rec, "asked_stated") {
            self.asked_stated += a;
            self.answered_stated += 1.0 - a;
        }
    }

    /// The mean of the F1 of "ask" (positive: vague) and of "answer" (positive: stated);
    /// `None` without both kinds of request. A class never predicted nor present scores 0.
    pub fn macro_f1(&self) -> Option<f64> {
        let vague = self.asked_vague + self.answered_vague;
        let stated = self.asked_stated + self.answered_stated;
        if vague == 0.0 || stated == 0.0 {
            return None;
        }
        let f1 = |tp: f64, fp: f64, fn_: f64| {
            let d = 2.0 * tp + fp + fn_;
            if d > 0.0 {
                2.0 * tp / d
            } else {
                0.0
            }
        };
        let ask = f1(self.asked_vague, self.asked_stated, self.answered_vague);
        let answer = f1(self.answered_stated, self.answered_vague, self.asked_stated);
        Some((ask + answer) / 2.0)
    }
}

/// The cluster of a conversation's key: its template where the run records one, else the
/// unit part of `unit#repeat`.
fn cluster_key<'a>(run: &'a RunOutcomes, key: &'a str) -> &'a str {
    match run.clusters.get(key) {
        Some(c) => c,
        None => key.rsplit_once('#').map_or(key, |(c, _)| c),
    }
}

/// Percentile interval of `values` (sorted in place).
fn percentile_interval(values: &mut [f64]) -> (f64, f64) {
    values.sort_by(f64::total_cmp);
    let at = |q: f64| {
        let i = ((values.len() as f64 - 1.0) * q).round() as usize;
        values[i.min(values.len() - 1)]
    };
    (at(0.025), at(0.975))
}

/// Per cluster: (sum of outcomes, count) of each seed's run.
type ClusterTable = BTreeMap<String, Vec<(f64, f64)>>;

fn cluster_table(runs: &[&RunOutcomes], keys: &BTreeSet<String>) -> ClusterTable {
    let mut t: ClusterTable = BTreeMap::new();
    for k in keys {
        let row = t
            .entry(cluster_key(runs[0], k).to_string())
            .or_insert_with(|| vec![(0.0, 0.0); runs.len()]);
        for (s, r) in runs.iter().enumerate() {
            row[s].0 += r.outcomes[k];
            row[s].1 += 1.0;
        }
    }
    t
}

/// Mean over seeds of the rate in the clusters `pick` (indices into `clusters`).
fn pooled(clusters: &[&Vec<(f64, f64)>], pick: impl Iterator<Item = usize> + Clone) -> f64 {
    let seeds = clusters.first().map_or(0, |c| c.len());
    if seeds == 0 {
        return 0.0;
    }
    (0..seeds)
        .map(|s| {
            let (y, n) = pick.clone().fold((0.0, 0.0), |(y, n), i| {
                (y + clusters[i][s].0, n + clusters[i][s].1)
            });
            if n > 0.0 {
                y / n
            } else {
                0.0
            }
        })
        .sum::<f64>()
        / seeds as f64
}

fn arm<'a>(arms: &'a [ArmResult], name: &str) -> Result<&'a ArmResult, StudyError> {
    arms.iter()
        .find(|a| a.name == name)
        .ok_or_else(|| StudyError::Spec(format!("comparison names an unknown arm `{name}`")))
}

fn compare_arms(a: &ArmResult, b: &ArmResult, seed: u64) -> Result<ComparisonResult, StudyError> {
    let k = a.seeds.len();
    if !(b.seeds.len() == k || b.seeds.len() == 1) {
        return Err(StudyError::Spec(format!(
            "{} has {k} runs and {} has {}: give the second one run or as many",
            a.name,
            b.name,
            b.seeds.len()
        )));
    }
    let other = |s: usize| &b.seeds[if b.seeds.len() == 1 { 0 } else { s }];
    // Keys every run of both arms has: the same games everywhere.
    let mut keys: BTreeSet<String> = a.seeds[0].outcomes.keys().cloned().collect();
    for r in a.seeds.iter().chain(&b.seeds) {
        keys.retain(|key| r.outcomes.contains_key(key));
    }
    if keys.is_empty() {
        return Err(StudyError::Spec(format!(
            "{} and {} share no game or conversation",
            a.name, b.name
        )));
    }
    let per_seed = (0..k)
        .map(|s| {
            let (ra, rb) = (&a.seeds[s], other(s));
            let (bb, cc) = keys.iter().fold((0, 0), |(bb, cc), key| {
                let (x, y) = (rb.outcomes[key], ra.outcomes[key]);
                if x > y {
                    (bb + 1, cc)
                } else if y > x {
                    (bb, cc + 1)
                } else {
                    (bb, cc)
                }
            });
            let difference = keys
                .iter()
                .map(|key| ra.outcomes[key] - rb.outcomes[key])
                .sum::<f64>()
                / keys.len() as f64;
            SeedTest {
                arm_run: ra.run.clone(),
                against_run: rb.run.clone(),
                paired: keys.len(),
                b: bb,
                c: cc,
                mcnemar_p: mcnemar_exact(bb, cc),
                difference,
            }
        })
        .collect();
    let a_runs: Vec<&RunOutcomes> = a.seeds.iter().collect();
    let b_runs: Vec<&RunOutcomes> = (0..k).map(other).collect();
    let ta = cluster_table(&a_runs, &keys);
    let tb = cluster_table(&b_runs, &keys);
    let names: Vec<&String> = ta.keys().collect();
    let ca: Vec<&Vec<(f64, f64)>> = names.iter().map(|n| &ta[*n]).collect();
    let cb: Vec<&Vec<(f64, f64)>> = names.iter().map(|n| &tb[*n]).collect();
    let m = names.len();
    let diff =
        |pick: &[usize]| pooled(&ca, pick.iter().copied()) - pooled(&cb, pick.iter().copied());
    let all: Vec<usize> = (0..m).collect();
    let observed = diff(&all);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut boots: Vec<f64> = (0..BOOTSTRAP_RESAMPLES)
        .map(|_| {
            let pick: Vec<usize> = (0..m).map(|_| rng.random_range(0..m)).collect();
            diff(&pick)
        })
        .collect();
    let below = boots.iter().filter(|d| **d <= 0.0).count() as f64 / boots.len() as f64;
    let above = boots.iter().filter(|d| **d >= 0.0).count() as f64 / boots.len() as f64;
    let ci95 = percentile_interval(&mut boots);
    let (d, w) = cluster_differences(&ca, &cb);
    let sign_flip = sign_flip_test(&d, &w, seed);
    Ok(ComparisonResult {
        arm: a.name.clone(),
        against: b.name.clone(),
        per_seed,
        pooled_difference: observed,
        ci95,
        p_bootstrap: (2.0 * below.min(above)).min(1.0),
        clusters: m,
        sign_flip,
    })
}

fn arm_result(spec: &StudySpec, a: &ArmSpec, seed: u64) -> Result<ArmResult, StudyError> {
    if a.runs.is_empty() {
        return Err(StudyError::Spec(format!("arm `{}` has no runs", a.name)));
    }
    let seeds = a
        .runs
        .iter()
        .map(|r| read_run(spec, &a.name, r))
        .collect::<Result<Vec<_>, _>>()?;
    let mut origins = BTreeSet::new();
    for s in &seeds {
        if !origins.insert((s.run.as_str(), s.label.as_str())) {
            return Err(StudyError::Spec(format!(
                "arm `{}` holds the run {} twice (a recorded seed and its own evaluation?)",
                a.name, s.run
            )));
        }
    }
    let runs: Vec<&RunOutcomes> = seeds.iter().collect();
    let mut keys: BTreeSet<String> = seeds[0].outcomes.keys().cloned().collect();
    for r in &seeds[1..] {
        keys.retain(|key| r.outcomes.contains_key(key));
    }
    let table = cluster_table(&runs, &keys);
    let clusters: Vec<&Vec<(f64, f64)>> = table.values().collect();
    let m = clusters.len();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut boots: Vec<f64> = (0..BOOTSTRAP_RESAMPLES)
        .map(|_| {
            pooled(
                &clusters,
                (0..m)
                    .map(|_| rng.random_range(0..m))
                    .collect::<Vec<_>>()
                    .into_iter(),
            )
        })
        .collect();
    let total: usize = seeds.iter().map(|s| s.n).sum();
    let sum: f64 = seeds.iter().map(|s| s.rate * s.n as f64).sum();
    let secondary = spec
        .secondary
        .iter()
        .map(|m| {
            let vals: Vec<f64> = seeds.iter().filter_map(|s| s.secondary[m]).collect();
            let mean = (!vals.is_empty()).then(|| vals.iter().sum::<f64>() / vals.len() as f64);
            (m.clone(), mean)
        })
        .collect();
    Ok(ArmResult {
        name: a.name.clone(),
        pooled_rate: sum / total.max(1) as f64,
        pooled_ci95: if m == 0 {
            (0.0, 1.0)
        } else {
            percentile_interval(&mut boots)
        },
        seeds,
        secondary,
    })
}

/// Reads every arm's runs and makes every comparison.
pub fn run_study(spec: &StudySpec) -> Result<StudyResult, StudyError> {
    let mut names = BTreeSet::new();
    for a in &spec.arms {
        if !names.insert(a.name.as_str()) {
            return Err(StudyError::Spec(format!("arm `{}` is named twice", a.name)));
        }
    }
    // Settings first: runs that do not measure the same thing are refused before any reading.
    let mut settings: Vec<(String, Settings)> = Vec::new();
    for a in &spec.arms {
        for r in &a.runs {
            settings.push((r.clone(), run_settings(spec, &a.name, r)?));
        }
    }
    check_settings(&settings).map_err(StudyError::Spec)?;
    let training = check_training(spec)?;
    let arms = spec
        .arms
        .iter()
        .map(|a| arm_result(spec, a, spec.seed))
        .collect::<Result<Vec<_>, _>>()?;
    let comparisons = spec
        .comparisons
        .iter()
        .map(|c| compare_arms(arm(&arms, &c.arm)?, arm(&arms, &c.against)?, spec.seed))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(StudyResult {
        title: spec.title.clone(),
        primary: spec.primary.clone(),
        bootstrap_resamples: BOOTSTRAP_RESAMPLES,
        arms,
        comparisons,
        training,
        meta: spec.meta.clone(),
    })
}

/// Reads every arm's `trained` runs and refuses matched arms that did not train alike.
fn check_training(spec: &StudySpec) -> Result<BTreeMap<String, Vec<TrainedRun>>, StudyError> {
    let mut training = BTreeMap::new();
    for a in spec.arms.iter().filter(|a| !a.trained.is_empty()) {
        if a.trained.len() != a.runs.len() {
            return Err(StudyError::Spec(format!(
                "arm `{}` names {} trained runs for {} evaluated runs",
                a.name,
                a.trained.len(),
                a.runs.len()
            )));
        }
        let runs = a
            .trained
            .iter()
            .map(|d| {
                if !is_recorded(d) {
                    return read_trained_run(d).map_err(StudyError::Spec);
                }
                read_recorded(spec, &a.name, d)?
                    .trained
                    .ok_or_else(|| input_err(Path::new(d), "records no training run"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        training.insert(a.name.clone(), runs);
    }
    if !(spec.token_tolerance.is_finite() && (0.0..=1.0).contains(&spec.token_tolerance)) {
        return Err(StudyError::Spec(format!(
            "token_tolerance must be in [0, 1], got {}",
            spec.token_tolerance
        )));
    }
    let mut seeds = 0;
    for name in &spec.matched {
        let runs = training.get(name).ok_or_else(|| {
            StudyError::Spec(format!(
                "matched arm `{name}` is not an arm with `trained` runs"
            ))
        })?;
        seeds = seeds.max(runs.len());
    }
    for k in 0..seeds {
        let of_seed: Vec<(&str, &TrainedRun)> = spec
            .matched
            .iter()
            .filter_map(|name| Some((name.as_str(), training[name].get(k)?)))
            .collect();
        check_matched(k, &of_seed, spec.token_tolerance).map_err(StudyError::Spec)?;
    }
    Ok(training)
}

/// Reads the spec file, runs the study and writes `study.json` and `study.md` to `output`.
pub fn study_files(spec_path: &Path, output: &Path) -> anyhow::Result<StudyResult> {
    let text =
        std::fs::read_to_string(spec_path).map_err(|e| input_err(spec_path, e.to_string()))?;
    let spec: StudySpec = toml::from_str(&text).map_err(|e| input_err(spec_path, e.to_string()))?;
    let result = run_study(&spec)?;
    std::fs::create_dir_all(output).map_err(|e| input_err(output, e.to_string()))?;
    let json = serde_json::to_string_pretty(&result)?;
    write_atomic(&output.join("study.json"), json.as_bytes())?;
    write_atomic(&output.join("study.md"), result.table().as_bytes())?;
    write_recorded_seeds(&spec, &result, &output.join("seeds"))?;
    Ok(result)
}

/// Writes every arm's seeds as `dir/ARM-K.json` (see [`RecordedSeed`]).
fn write_recorded_seeds(spec: &StudySpec, result: &StudyResult, dir: &Path) -> anyhow::Result<()> {
    // An arm's name is the spec's text: only its plain characters make the file name.
    let file_name = |arm: &str| -> String {
        arm.chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect()
    };
    let mut names = BTreeSet::new();
    for arm in &result.arms {
        if !names.insert(file_name(&arm.name)) {
            return Err(StudyError::Spec(format!(
                "arms named like `{}` share the record file name {}: rename one",
                arm.name,
                file_name(&arm.name)
            ))
            .into());
        }
    }
    // Records an earlier study left in this folder (other arms, more seeds) would read as
    // this one's.
    if dir.is_dir() {
        for entry in std::fs::read_dir(dir).map_err(|e| input_err(dir, e.to_string()))? {
            let path = entry.map_err(|e| input_err(dir, e.to_string()))?.path();
            if path.extension().is_some_and(|x| x == "json") {
                std::fs::remove_file(&path).map_err(|e| input_err(&path, e.to_string()))?;
            }
        }
    }
    std::fs::create_dir_all(dir).map_err(|e| input_err(dir, e.to_string()))?;
    for arm in &result.arms {
        for (k, outcomes) in arm.seeds.iter().enumerate() {
            let seed = RecordedSeed {
                format: SEED_FORMAT.to_string(),
                title: spec.title.clone(),
                arm: arm.name.clone(),
                primary: spec.primary.clone(),
                cluster: spec.cluster,
                filter: spec.filter.clone(),
                secondary: spec.secondary.clone(),
                comparable: outcomes.comparable.clone(),
                outcomes: outcomes.clone(),
                trained: result
                    .training
                    .get(&arm.name)
                    .and_then(|t| t.get(k))
                    .cloned(),
            };
            let json = serde_json::to_string_pretty(&seed)?;
            let name = file_name(&arm.name);
            write_atomic(&dir.join(format!("{name}-{}.json", k + 1)), json.as_bytes())?;
        }
    }
    Ok(())
}

fn pct(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}

fn fmt_p(p: f64) -> String {
    if p == 0.0 {
        // Below the bootstrap's resolution (no resample crossed 0).
        format!("< {:.0e}", 1.0 / BOOTSTRAP_RESAMPLES as f64)
    } else if p < 0.001 {
        format!("{p:.1e}")
    } else {
        format!("{p:.3}")
    }
}

fn fmt_sign_flip_p(p: f64) -> String {
    if p < 0.001 {
        format!("{p:.1e}")
    } else {
        format!("{p:.3}")
    }
}

impl StudyResult {
    /// Whether every record of every arm had a 0/1 outcome (rates and McNemar tests).
    pub fn binary(&self) -> bool {
        self.arms.iter().flat_map(|a| &a.seeds).all(|s| s.binary)
    }

    /// The arms' table and the comparisons' table, as Markdown.
    pub fn table(&self) -> String {
        let binary = self.binary();
        // A rate in percent (differences in points); any other outcome as its mean.
        let value = |x: f64| {
            if binary {
                pct(x)
            } else {
                format!("{x:.3}")
            }
        };
        let diff = |x: f64| {
            if binary {
                format!("{:+.1}", 100.0 * x)
            } else {
                format!("{x:+.3}")
            }
        };
        let mut out = format!("### {}\n\n", self.title);
        let secondary: Vec<&String> = self
            .arms
            .first()
            .map(|a| a.secondary.keys().collect())
            .unwrap_or_default();
        out.push_str(&format!(
            "| arm | {} pooled (95% CI, clusters resampled) | per seed |",
            self.primary
        ));
        for m in &secondary {
            out.push_str(&format!(" {m} |"));
        }
        out.push_str("\n|---|---|---|");
        out.push_str(&"---|".repeat(secondary.len()));
        out.push('\n');
        for a in &self.arms {
            let per: Vec<String> = a
                .seeds
                .iter()
                .map(|s| {
                    if binary {
                        format!("{}/{}", s.successes, s.n)
                    } else {
                        format!("{:.3}", s.rate)
                    }
                })
                .collect();
            out.push_str(&format!(
                "| {} | {} ({}–{}) | {} |",
                a.name,
                value(a.pooled_rate),
                value(a.pooled_ci95.0),
                value(a.pooled_ci95.1),
                per.join(", ")
            ));
            for m in &secondary {
                match a.secondary[*m] {
                    Some(v) => out.push_str(&format!(" {v:.3} |")),
                    None => out.push_str(" - |"),
                }
            }
            out.push('\n');
        }
        let (unit, test, b_c) = if binary {
            (
                " pts",
                "McNemar p",
                "b (only the baseline won) / c (only the arm won)",
            )
        } else {
            ("", "sign-test p", "b (baseline better) / c (arm better)")
        };
        out.push_str(&format!(
            "\n| comparison | difference, pooled (95% bootstrap CI) | bootstrap p | clusters for / against the arm, sign-flip p | per seed: {b_c}, {test} |\n|---|---|---|---|---|\n"
        ));
        for c in &self.comparisons {
            let seeds: Vec<String> = c
                .per_seed
                .iter()
                .map(|s| format!("{} / {}, {}", s.b, s.c, fmt_p(s.mcnemar_p)))
                .collect();
            let f = &c.sign_flip;
            out.push_str(&format!(
                "| {} vs {} | {}{unit} ({} to {}) | {} | {} / {}, {} | {} |\n",
                c.arm,
                c.against,
                diff(c.pooled_difference),
                diff(c.ci95.0),
                diff(c.ci95.1),
                fmt_p(c.p_bootstrap),
                f.favour_arm,
                f.favour_against,
                fmt_sign_flip_p(f.p),
                seeds.join("; ")
            ));
        }
        if !self.training.is_empty() {
            out.push_str(
                "\n| arm | training per seed: optimizer steps, trained tokens, lr |\n|---|---|\n",
            );
            for (arm, runs) in &self.training {
                let per: Vec<String> = runs
                    .iter()
                    .map(|r| format!("{}, {}, {:e}", r.steps, r.num_tokens, r.lr))
                    .collect();
                out.push_str(&format!("| {arm} | {} |\n", per.join("; ")));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An eval output with one model whose conversation `i` has outcome `wins(i)`.
    fn run_dir(root: &Path, name: &str, n: usize, wins: impl Fn(usize) -> bool) -> String {
        let dir = root.join(name);
        std::fs::create_dir_all(dir.join(CONVERSATIONS_DIR)).unwrap();
        let lines: String = (0..n)
            .map(|i| {
                let rec = serde_json::json!({"task_id": format!("t{i:02}"), "repeat": 0,
                    "metrics": {"detail_used": if wins(i) { 1.0 } else { 0.0 }, "turns": 1 + i % 2}});
                format!("{rec}\n")
            })
            .collect();
        std::fs::write(dir.join(CONVERSATIONS_DIR).join("m.jsonl"), lines).unwrap();
        dir.display().to_string()
    }

    fn spec(arms: Vec<(&str, Vec<String>)>, comparisons: &[(&str, &str)]) -> StudySpec {
        StudySpec {
            title: "t".into(),
            primary: "detail_used".into(),
            cluster: ClusterBy::Task,
            secondary: vec!["turns".into()],
            arms: arms
                .into_iter()
                .map(|(name, runs)| ArmSpec {
                    name: name.into(),
                    runs,
                    trained: Vec::new(),
                })
                .collect(),
            comparisons: comparisons
                .iter()
                .map(|(a, b)| ComparisonSpec {
                    arm: a.to_string(),
                    against: b.to_string(),
                })
                .collect(),
            seed: 1,
            filter: BTreeMap::new(),
            matched: Vec::new(),
            token_tolerance: TOKEN_TOLERANCE,
            meta: toml::Table::new(),
        }
    }

    /// Hand-computed: three clusters all for the arm are 2 of 8 sign patterns as extreme;
    /// differences 0.5, 0.3, −0.1 (equal weights) are matched by 4 of 8 (±(0.5+0.3±0.1)).
    #[test]
    fn the_sign_flip_test_counts_sign_patterns_at_the_cluster_level() {
        let w = [1.0 / 3.0; 3];
        let t = sign_flip_test(&[1.0, 1.0, 1.0], &w, 0);
        assert_eq!((t.favour_arm, t.favour_against, t.ties), (3, 0, 0));
        assert!((t.p - 0.25).abs() < 1e-12, "{t:?}");
        assert_eq!(t.method, "exact");
        let t = sign_flip_test(&[0.5, 0.3, -0.1], &w, 0);
        assert_eq!((t.favour_arm, t.favour_against), (2, 1));
        assert!((t.p - 0.5).abs() < 1e-12, "{t:?}");
        // Weights matter: one large cluster decides every pattern's size (|±0.4 ± 0.05 ±
        // 0.05| ≥ 0.3 = |observed|), so two small clusters for the arm prove nothing.
        let t = sign_flip_test(&[0.5, 0.5, -0.5], &[0.1, 0.1, 0.8], 0);
        assert_eq!(t.p, 1.0, "{t:?}");
        let t = sign_flip_test(&[0.5, 0.5, 0.5], &[0.1, 0.1, 0.8], 0);
        assert!((t.p - 0.25).abs() < 1e-12, "{t:?}");
        // Twelve clusters all for the arm: 2 of 4096.
        let t = sign_flip_test(&[0.2; 12], &[1.0 / 12.0; 12], 0);
        assert!((t.p - 2.0 / 4096.0).abs() < 1e-12, "{t:?}");
        // Beyond the exact limit the random patterns agree with the binomial answer: 30
        // equal clusters, 20 for and 10 against (p = P(|2B − 30| ≥ 10) = 0.0987).
        let d: Vec<f64> = (0..30).map(|i| if i < 20 { 1.0 } else { -1.0 }).collect();
        let t = sign_flip_test(&d, &[1.0 / 30.0; 30], 3);
        assert_eq!(t.method, "monte_carlo");
        assert!((t.p - 0.0987).abs() < 0.005, "{t:?}");
    }

    #[test]
    fn the_ask_macro_f1_scores_first_reply_decisions() {
        let d = AskDecisions {
            asked_vague: 8.0,
            answered_vague: 2.0,
            asked_stated: 1.0,
            answered_stated: 9.0,
        };
        let want = (16.0 / 19.0 + 18.0 / 21.0) / 2.0;
        assert!((d.macro_f1().unwrap() - want).abs() < 1e-12);
        // Always asking: ask F1 2·10/(20 + 10) = 2/3, answer F1 0.
        let always = AskDecisions {
            asked_vague: 10.0,
            asked_stated: 10.0,
            ..Default::default()
        };
        assert!((always.macro_f1().unwrap() - 1.0 / 3.0).abs() < 1e-12);
        assert_eq!(AskDecisions::default().macro_f1(), None);
    }

    #[test]
    fn seeds_pair_with_one_base_run_and_clusters_are_resampled() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        // Base wins requests 0..10 of 40; every seed of the arm wins those and 10 more.
        let base = run_dir(root, "base", 40, |i| i < 10);
        let arm: Vec<String> = (0..3)
            .map(|s| run_dir(root, &format!("arm{s}"), 40, move |i| i < 20 + s))
            .collect();
        let same = run_dir(root, "same", 40, |i| i < 10);
        let s = spec(
            vec![("base", vec![base]), ("arm", arm), ("same", vec![same])],
            &[("arm", "base"), ("same", "base")],
        );
        let r = run_study(&s).unwrap();
        let c = &r.comparisons[0];
        assert_eq!(c.per_seed.len(), 3);
        let bc: Vec<(usize, usize)> = c.per_seed.iter().map(|t| (t.b, t.c)).collect();
        assert_eq!(bc, [(0, 10), (0, 11), (0, 12)]);
        assert!((c.per_seed[0].mcnemar_p - mcnemar_exact(0, 10)).abs() < 1e-15);
        // Pooled: mean over seeds of (20..22)/40 − 10/40.
        assert!((c.pooled_difference - (11.0 / 40.0)).abs() < 1e-12, "{c:?}");
        assert!(c.ci95.0 > 0.0 && c.ci95.0 < c.pooled_difference && c.pooled_difference < c.ci95.1);
        assert!(c.p_bootstrap < 0.01);
        assert_eq!(c.clusters, 40);
        // An arm equal to the base: no difference, interval around 0, p = 1.
        let z = &r.comparisons[1];
        assert_eq!((z.pooled_difference, z.ci95), (0.0, (0.0, 0.0)));
        assert_eq!(z.p_bootstrap, 1.0);
        // Arm rates and their secondary metric.
        let a = &r.arms[1];
        assert!((a.pooled_rate - 63.0 / 120.0).abs() < 1e-12);
        assert!((a.secondary["turns"].unwrap() - 1.5).abs() < 1e-12);
        assert!(
            r.table().contains("| arm vs base | +27.5 pts"),
            "{}",
            r.table()
        );
    }

    /// A clarify eval output: conversation i of template `tpl(i)` has task_reward `y(i)`.
    fn clarify_dir(
        root: &Path,
        name: &str,
        n: usize,
        tpl: impl Fn(usize) -> &'static str,
        y: impl Fn(usize) -> f64,
    ) -> String {
        let dir = root.join(name);
        std::fs::create_dir_all(dir.join(CONVERSATIONS_DIR)).unwrap();
        let lines: String = (0..n)
            .map(|i| {
                let rec = serde_json::json!({"task_id": format!("t{i}"), "repeat": 0,
                    "template": tpl(i), "split": if tpl(i) == "far" { "far" } else { "test" },
                    "metrics": {"task_reward": y(i)}});
                format!("{rec}\n")
            })
            .collect();
        std::fs::write(dir.join(CONVERSATIONS_DIR).join("m.jsonl"), lines).unwrap();
        dir.display().to_string()
    }

    #[test]
    fn template_clusters_move_together_in_the_bootstrap() {
        // Two templates of two requests each. The arm gains 0.7 on both requests of
        // template A and nothing on B. Resampling the two templates gives AA, AB, BA, BB with
        // probability 1/4 each: differences 0.7, 0.35, 0.35, 0 — so the interval is [0, 0.7]
        // and the bootstrap p is 2 · P(d ≤ 0) = 0.5. Resampling the four requests as if
        // independent would give P(d ≤ 0) = 1/16 and p = 0.125.
        let tmp = tempfile::tempdir().unwrap();
        let tpl = |i: usize| if i < 2 { "a" } else { "b" };
        let base = clarify_dir(tmp.path(), "base", 4, tpl, |_| 0.0);
        let arm = clarify_dir(tmp.path(), "arm", 4, tpl, |i| if i < 2 { 0.7 } else { 0.0 });
        let mut sp = spec(
            vec![("base", vec![base]), ("arm", vec![arm])],
            &[("arm", "base")],
        );
        sp.primary = "task_reward".into();
        sp.secondary.clear();
        sp.cluster = ClusterBy::Template;
        let r = run_study(&sp).unwrap();
        let c = &r.comparisons[0];
        assert_eq!(c.clusters, 2);
        assert!((c.pooled_difference - 0.35).abs() < 1e-12, "{c:?}");
        assert_eq!(c.ci95, (0.0, 0.7));
        assert!((c.p_bootstrap - 0.5).abs() < 0.03, "{}", c.p_bootstrap);
        // Per seed: the sign test of 0 against 2 requests better for the arm.
        let t = &c.per_seed[0];
        assert_eq!((t.b, t.c), (0, 2));
        assert!((t.difference - 0.35).abs() < 1e-12);
        assert!(!r.binary());
        assert!(
            r.table()
                .contains("| arm vs base | +0.350 (+0.000 to +0.700) |"),
            "{}",
            r.table()
        );
        // The sign-flip test sees two templates, one for the arm and one tied: every sign
        // pattern is as far from 0, p = 1.
        assert_eq!((c.sign_flip.favour_arm, c.sign_flip.ties), (1, 1));
        assert_eq!(c.sign_flip.p, 1.0);
        // By request instead, the same data looks four times as certain.
        sp.cluster = ClusterBy::Task;
        let by_request = run_study(&sp).unwrap();
        let c = &by_request.comparisons[0];
        assert_eq!(c.clusters, 4);
        assert!((c.p_bootstrap - 0.125).abs() < 0.02, "{}", c.p_bootstrap);
        // A run without templates cannot be clustered by template.
        let plain = run_dir(tmp.path(), "plain", 4, |_| true);
        let mut sp = spec(vec![("p", vec![plain])], &[]);
        sp.cluster = ClusterBy::Template;
        let err = run_study(&sp).unwrap_err().to_string();
        assert!(err.contains("no `template` to cluster by"), "{err}");
    }

    /// A filter keeps one held-out set: the far template's requests only, or none at all.
    #[test]
    fn a_filter_keeps_the_records_of_one_set() {
        let tmp = tempfile::tempdir().unwrap();
        let tpl = |i: usize| if i < 3 { "near" } else { "far" };
        let base = clarify_dir(tmp.path(), "base", 5, tpl, |_| 0.0);
        let arm = clarify_dir(tmp.path(), "arm", 5, tpl, |i| if i < 3 { 0.3 } else { 1.0 });
        let mut sp = spec(
            vec![("base", vec![base]), ("arm", vec![arm])],
            &[("arm", "base")],
        );
        sp.primary = "task_reward".into();
        sp.secondary.clear();
        sp.filter = [("split".to_string(), "far".to_string())].into();
        let r = run_study(&sp).unwrap();
        assert_eq!(r.arms[1].seeds[0].n, 2);
        assert!((r.comparisons[0].pooled_difference - 1.0).abs() < 1e-12);
        sp.filter = [("split".to_string(), "dev".to_string())].into();
        let err = run_study(&sp).unwrap_err().to_string();
        assert!(err.contains("no record matches the filter"), "{err}");
    }

    /// A training output directory as `dpo_train` leaves it.
    fn trained_dir(root: &Path, name: &str, steps: u64, tokens: u64) -> String {
        let dir = root.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let summary = serde_json::json!({"steps": steps, "last_log": {"num_tokens": tokens}});
        let args = serde_json::json!({"lr": 1e-5, "schedule": "linear", "warmup_ratio": 0.1});
        std::fs::write(dir.join("train_summary.json"), summary.to_string()).unwrap();
        std::fs::write(dir.join("training_args.json"), args.to_string()).unwrap();
        dir.display().to_string()
    }

    /// Matched arms are refused when one seed's runs took different step counts, and
    /// reported with their steps and tokens when they match.
    #[test]
    fn matched_arms_with_different_step_counts_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        let runs = |arm: &str| -> Vec<String> {
            (0..2)
                .map(|s| run_dir(root, &format!("{arm}-e{s}"), 6, |i| i % 2 == 0))
                .collect()
        };
        let mut s = spec(
            vec![("control", runs("control")), ("dpo", runs("dpo"))],
            &[("dpo", "control")],
        );
        s.matched = vec!["control".into(), "dpo".into()];
        s.arms[0].trained = (0..2)
            .map(|k| trained_dir(root, &format!("control-t{k}"), 30, 1000))
            .collect();
        s.arms[1].trained = vec![
            trained_dir(root, "dpo-t0", 30, 1050),
            trained_dir(root, "dpo-t1", 28, 1000),
        ];
        let e = run_study(&s).unwrap_err().to_string();
        assert!(e.contains("seed 2") && e.contains("optimizer steps"), "{e}");
        s.arms[1].trained[1] = trained_dir(root, "dpo-t1b", 30, 990);
        let r = run_study(&s).unwrap();
        assert_eq!(r.training["dpo"][1].steps, 30);
        assert!(
            r.table()
                .contains("| dpo | 30, 1050, 1e-5; 30, 990, 1e-5 |"),
            "{}",
            r.table()
        );
        // A matched arm must name its training runs.
        s.arms[1].trained.clear();
        assert!(run_study(&s)
            .unwrap_err()
            .to_string()
            .contains("matched arm `dpo`"));
    }

    /// Seed 1 of every arm read back from the records a first study wrote pools exactly as
    /// its evaluation did (outcomes, secondaries, training summary); records made under
    /// another primary or with other comparable settings are refused by name.
    #[test]
    fn recorded_seeds_pool_like_their_runs() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        let runs = |arm: &str, shift: usize| -> Vec<String> {
            (0..2)
                .map(|s| {
                    run_dir(root, &format!("{arm}-e{s}"), 9, |i| {
                        (i + s + shift).is_multiple_of(3)
                    })
                })
                .collect()
        };
        let mut live = spec(
            vec![("a", runs("a", 0)), ("b", runs("b", 1))],
            &[("a", "b")],
        );
        live.arms[0].trained = (0..2)
            .map(|k| trained_dir(root, &format!("a-t{k}"), 30, 1000 + k as u64))
            .collect();
        let first = run_study(&live).unwrap();
        let seeds = root.join("seeds");
        write_recorded_seeds(&live, &first, &seeds).unwrap();
        let record = |arm: &str| seeds.join(format!("{arm}-1.json")).display().to_string();
        let mut mixed = live.clone();
        for arm in &mut mixed.arms {
            arm.runs[0] = record(&arm.name);
        }
        mixed.arms[0].trained[0] = record("a");
        let second = run_study(&mixed).unwrap();
        fn json<T: Serialize>(v: &T) -> serde_json::Value {
            serde_json::to_value(v).unwrap()
        }
        assert_eq!(json(&first.arms), json(&second.arms));
        assert_eq!(json(&first.comparisons), json(&second.comparisons));
        assert_eq!(first.training["a"][0], second.training["a"][0]);
        assert_eq!(second.training["a"][0].num_tokens, 1000);

        let mut other_primary = mixed.clone();
        other_primary.primary = "turns".into();
        let e = run_study(&other_primary).unwrap_err().to_string();
        assert!(
            e.contains("a-1.json") && e.contains("recorded with primary \"detail_used\""),
            "{e}"
        );
        let mut other_filter = mixed.clone();
        other_filter.filter = BTreeMap::from([("split".to_string(), "far".to_string())]);
        let e = run_study(&other_filter).unwrap_err().to_string();
        assert!(e.contains("recorded with filter {}"), "{e}");
        // Another arm's record, or a record beside its own evaluation, is refused.
        let mut swapped = mixed.clone();
        swapped.arms[1].runs[0] = record("a");
        let e = run_study(&swapped).unwrap_err().to_string();
        assert!(
            e.contains("recorded with arm \"a\", here it is \"b\""),
            "{e}"
        );
        let mut twice = mixed.clone();
        twice.arms[1].runs[1] = live.arms[1].runs[0].clone();
        let e = run_study(&twice).unwrap_err().to_string();
        assert!(e.contains("holds the run") && e.contains("b-e0"), "{e}");

        // Rewrites a record's comparable settings to `weights`.
        let set_weights = |arm: &str, weights: &str| {
            let path = record(arm);
            let mut v: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            v["comparable"] = serde_json::json!({ "weights": weights });
            std::fs::write(&path, v.to_string()).unwrap();
        };
        set_weights("a", "f32");
        set_weights("b", "q8");
        let e = run_study(&mixed).unwrap_err().to_string();
        assert!(
            e.contains("differ in `weights`") && e.contains("b-1.json has \"q8\""),
            "{e}"
        );
        // A record against a live run whose manifest records another setting.
        set_weights("a", "q4");
        set_weights("b", "q4");
        std::fs::write(
            Path::new(&mixed.arms[0].runs[1]).join(super::super::run::MANIFEST_FILE),
            serde_json::json!({"tool": "collabllm-rs eval_multiturn", "status": "complete",
                "config": {"weights": "f32"}})
            .to_string(),
        )
        .unwrap();
        let e = run_study(&mixed).unwrap_err().to_string();
        assert!(
            e.contains("differ in `weights`") && e.contains("a-e1 has \"f32\""),
            "{e}"
        );
    }

    #[test]
    fn bad_specs_and_runs_are_named() {
        let tmp = tempfile::tempdir().unwrap();
        let a = run_dir(tmp.path(), "a", 5, |_| true);
        let err = run_study(&spec(vec![("a", vec![a.clone()])], &[("a", "b")])).unwrap_err();
        assert!(err.to_string().contains("unknown arm `b`"), "{err}");
        let two: Vec<String> = (0..2)
            .map(|s| run_dir(tmp.path(), &format!("x{s}"), 5, |_| true))
            .collect();
        let three: Vec<String> = (0..3)
            .map(|s| run_dir(tmp.path(), &format!("y{s}"), 5, |_| true))
            .collect();
        let err = run_study(&spec(vec![("x", two), ("y", three)], &[("y", "x")])).unwrap_err();
        assert!(
            err.to_string()
                .contains("give the second one run or as many"),
            "{err}"
        );
        // A directory holding two models needs DIR:label.
        std::fs::copy(
            Path::new(&a).join(CONVERSATIONS_DIR).join("m.jsonl"),
            Path::new(&a).join(CONVERSATIONS_DIR).join("n.jsonl"),
        )
        .unwrap();
        let err = run_study(&spec(vec![("a", vec![a.clone()])], &[])).unwrap_err();
        assert!(err.to_string().contains("name one as DIR:label"), "{err}");
        run_study(&spec(vec![("a", vec![format!("{a}:n")])], &[])).unwrap();
    }
}
