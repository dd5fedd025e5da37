//! From conversation records to the run's datasets: MR under the current weights, preference
//! pairs (split by conversation), the upstream flat rows. Used at the end of a run and by
//! `--rescore`, which makes no model call.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use serde::Serialize;

use crate::dataset::flat::{write_flat_parquet, FlatRow};
use crate::dataset::pairs::{split_by_conversation, write_pairs_parquet, PairRow};
use crate::dataset::sft::{sft_from_flat, write_sft_parquet};
use crate::dataset::DatasetError;
use crate::llm::{ChatMessage, FinishReason};
use crate::reward::mr::{multiturn_reward, MrFormula};
use crate::reward::pairs::{balanced, select_pairs, Balance, PairMode};
use crate::rollout::records::{CandidateRecord, ConversationRecord};
use crate::task::Action;

/// How records become pairs.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Scoring {
    /// Explicit weights; `None` = each record's own generation weights.
    pub weights: Option<BTreeMap<String, f64>>,
    pub formula: MrFormula,
    pub min_gap: f64,
    pub pairs: PairMode,
    /// Balance of the pair set across request strata (before the split).
    pub balance: Balance,
    pub test_fraction: f64,
    pub seed: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    #[error(transparent)]
    Dataset(#[from] DatasetError),
    #[error("metric `{metric}` has a weight but was not computed for task {task} (computed: {computed}); re-scoring cannot add metrics, only re-weight them")]
    MetricNotComputed {
        metric: String,
        task: String,
        computed: String,
    },
    #[error("creating {}", path.display())]
    CreateDir {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Write(#[from] crate::run::WriteError),
    #[error("balance field `{field}`: task {task} has no metadata field `{field}` (pseudo-fields: turn, action)")]
    BalanceField { field: String, task: String },
}

/// Counts and means for the summary and the manifest.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct DatasetStats {
    pub conversations: usize,
    pub turns: usize,
    pub candidates: usize,
    pub sessions: usize,
    pub pairs_train: usize,
    pub pairs_test: usize,
    /// Turns that gave no pair, by reason.
    pub turns_without_pair: BTreeMap<String, usize>,
    pub mean_mr_chosen: Option<f64>,
    pub mean_mr_rejected: Option<f64>,
    /// Scores a judge or the sandbox could not produce (counted per metric).
    pub missing_scores: BTreeMap<String, usize>,
    /// Pairs by turn index.
    pub pairs_per_turn: BTreeMap<u32, usize>,
    /// Pairs by stratum (the balance fields' values, when set) and by the actions of the
    /// chosen and the rejected reply (`ask>answer`: a question preferred to an answer).
    pub pairs_by_stratum_action: BTreeMap<String, usize>,
    /// Pairs the turns yielded before balancing, and how many balancing left out.
    pub pairs_selected: usize,
    pub pairs_left_out_by_balance: usize,
    /// Candidates cut at their token cap (`finish_reason` "length").
    pub candidates_truncated: usize,
    /// Sessions whose accuracy has both a judge verdict and a programmatic check of an
    /// explicit final answer, and how many of those disagree (judge ≥ 0.5 vs the check).
    pub accuracy_checks: usize,
    pub accuracy_disagreements: usize,
    /// `accuracy_disagreements / accuracy_checks`; `None` without checks.
    pub accuracy_disagreement_rate: Option<f64>,
}

/// Checks that every weighted metric was computed for every record.
fn check_metrics(records: &[ConversationRecord], scoring: &Scoring) -> Result<(), OutputError> {
    let Some(weights) = &scoring.weights else {
        return Ok(());
    };
    for rec in records {
        let computed: Vec<&String> = rec.weights.keys().collect();
        for m in weights.keys() {
            if !rec.weights.contains_key(m) {
                return Err(OutputError::MetricNotComputed {
                    metric: m.clone(),
                    task: rec.task_id.clone(),
                    computed: computed
                        .iter()
                        .map(|s| s.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                });
            }
        }
    }
    Ok(())
}

/// What a run's records become: pairs split by conversation, flat rows, statistics.
pub struct Built {
    pub train: Vec<PairRow>,
    pub test: Vec<PairRow>,
    pub flat: Vec<FlatRow>,
    pub stats: DatasetStats,
}

/// Pairs (train, test), flat rows and statistics of `records` under `scoring`.
pub fn build(records: &[ConversationRecord], scoring: &Scoring) -> Result<Built, OutputError> {
    check_metrics(records, scoring)?;
    let mut stats = DatasetStats {
        conversations: records.len(),
        ..Default::default()
    };
    let mut pairs = Vec::new();
    let mut keys: Vec<PairKey> = Vec::new();
    let mut flat = Vec::new();
    let (mut sum_c, mut sum_r) = (0.0, 0.0);
    for rec in records {
        let weights = scoring.weights.as_ref().unwrap_or(&rec.weights);
        for turn in &rec.turns {
            stats.turns += 1;
            let mrs: Vec<Option<f64>> = (0..turn.candidates.len())
                .map(|ci| {
                    multiturn_reward(
                        &turn.candidates[ci].session_scores(),
                        weights,
                        scoring.formula,
                    )
                })
                .collect();
            for (ci, cand) in turn.candidates.iter().enumerate() {
                stats.candidates += 1;
                stats.sessions += cand.sessions.len();
                stats.candidates_truncated +=
                    usize::from(cand.finish_reason == FinishReason::Length);
                for s in &cand.sessions {
                    for (m, score) in &s.scores {
                        if score.value.is_none() {
                            *stats.missing_scores.entry(m.clone()).or_default() += 1;
                        }
                    }
                    let agree = s.scores.get("accuracy").and_then(|a| a.detail.as_ref());
                    if let Some(agree) = agree.and_then(|d| d["agree"].as_bool()) {
                        stats.accuracy_checks += 1;
                        stats.accuracy_disagreements += usize::from(!agree);
                    }
                }
                flat.push(FlatRow {
                    prompt: turn.history.clone(),
                    completion: cand.text.clone(),
                    conv_id: rec.task_id.clone(),
                    turn_id: turn.turn_id,
                    score: mrs[ci].unwrap_or(f64::NAN),
                    single_turn_prompt: rec.goal.clone(),
                    single_turn_completion: rec.reference.clone(),
                    single_turn_metadata: metadata_with_task_type(rec),
                    sessions: sessions_json(cand),
                    rewards: rewards_json(cand, weights, scoring.formula),
                });
            }
            let actions: Vec<Action> = turn
                .candidates
                .iter()
                .map(|c| rec.task_type.action_of(&c.text))
                .collect();
            let selected = select_pairs(&mrs, &actions, scoring.min_gap, scoring.pairs);
            if selected.is_empty() {
                let one_action = actions.iter().all(|a| *a == actions[0]);
                let reason = if turn.candidates.len() < 2 {
                    "fewer than 2 candidates"
                } else if mrs.iter().filter(|m| m.is_some()).count() < 2 {
                    "missing scores"
                } else if scoring.pairs == PairMode::Contrast && one_action {
                    "one action only"
                } else {
                    "gap below min_gap"
                };
                *stats.turns_without_pair.entry(reason.into()).or_default() += 1;
            }
            for (c, r) in selected {
                let (mc, mr) = (mrs[c].unwrap_or(0.0), mrs[r].unwrap_or(0.0));
                keys.push(PairKey {
                    group: balance_value(
                        rec,
                        turn.turn_id,
                        actions[c],
                        scoring.balance.within.as_deref(),
                    )?,
                    stratum: scoring
                        .balance
                        .by
                        .iter()
                        .map(|f| {
                            balance_value(rec, turn.turn_id, actions[c], Some(f))
                                .map(|v| format!("{f}={v}"))
                        })
                        .collect::<Result<Vec<_>, _>>()?
                        .join(","),
                    actions: format!("{}>{}", actions[c].as_str(), actions[r].as_str()),
                    turn: turn.turn_id,
                    scores: (mc, mr),
                });
                pairs.push(PairRow {
                    prompt: turn.history.clone(),
                    chosen: vec![ChatMessage::assistant(turn.candidates[c].text.clone())],
                    rejected: vec![ChatMessage::assistant(turn.candidates[r].text.clone())],
                    score_chosen: mc,
                    score_rejected: mr,
                    conv_id: rec.task_id.clone(),
                    turn_id: turn.turn_id,
                });
            }
        }
    }
    if stats.accuracy_checks > 0 {
        stats.accuracy_disagreement_rate =
            Some(stats.accuracy_disagreements as f64 / stats.accuracy_checks as f64);
    }
    stats.pairs_selected = pairs.len();
    let keep: Vec<usize> = if scoring.balance.is_off() {
        (0..pairs.len()).collect()
    } else {
        let strata: Vec<(String, String)> = keys
            .iter()
            .map(|k| (k.group.clone(), k.stratum.clone()))
            .collect();
        balanced(&strata, scoring.seed)
    };
    stats.pairs_left_out_by_balance = pairs.len() - keep.len();
    let mut kept = Vec::with_capacity(keep.len());
    let mut pairs = pairs.into_iter().map(Some).collect::<Vec<_>>();
    for i in keep {
        let k = &keys[i];
        sum_c += k.scores.0;
        sum_r += k.scores.1;
        *stats.pairs_per_turn.entry(k.turn).or_default() += 1;
        let name = if k.stratum.is_empty() {
            k.actions.clone()
        } else {
            format!("{} {}", k.stratum, k.actions)
        };
        *stats.pairs_by_stratum_action.entry(name).or_default() += 1;
        if let Some(p) = pairs[i].take() {
            kept.push(p);
        }
    }
    let pairs = kept;
    let n = pairs.len();
    if n > 0 {
        stats.mean_mr_chosen = Some(sum_c / n as f64);
        stats.mean_mr_rejected = Some(sum_r / n as f64);
    }
    let (train, test) = split_by_conversation(pairs, scoring.test_fraction, scoring.seed);
    stats.pairs_train = train.len();
    stats.pairs_test = test.len();
    Ok(Built {
        train,
        test,
        flat,
        stats,
    })
}

/// What balancing and the counts need to know of a pair.
struct PairKey {
    group: String,
    stratum: String,
    /// `chosen>rejected` actions.
    actions: String,
    turn: u32,
    scores: (f64, f64),
}

/// The value of a balance field for a pair of `rec` at `turn` whose chosen reply takes
/// `action`: a task metadata field, or the pseudo-fields `turn` and `action`; `None` (no
/// field) is the empty group.
fn balance_value(
    rec: &ConversationRecord,
    turn: u32,
    action: Action,
    field: Option<&str>,
) -> Result<String, OutputError> {
    match field {
        None => Ok(String::new()),
        Some("turn") => Ok(turn.to_string()),
        Some("action") => Ok(action.as_str().to_string()),
        Some(f) => match rec.metadata.get(f).filter(|v| !v.is_null()) {
            Some(serde_json::Value::String(s)) => Ok(s.clone()),
            Some(v) => Ok(v.to_string()),
            None => Err(OutputError::BalanceField {
                field: f.to_string(),
                task: rec.task_id.clone(),
            }),
        },
    }
}

/// Upstream's `sessions`: each simulated future's messages (user first).
fn sessions_json(cand: &CandidateRecord) -> serde_json::Value {
    serde_json::json!(cand
        .sessions
        .iter()
        .map(|s| &s.messages)
        .collect::<Vec<_>>())
}

/// Upstream's `rewards`: metric → per-session scores, and `MR` → each session's own reward
/// (the candidate's score is their mean when no score is missing); missing values are null.
fn rewards_json(
    cand: &CandidateRecord,
    weights: &BTreeMap<String, f64>,
    formula: MrFormula,
) -> serde_json::Value {
    let per_session = cand.session_scores();
    let mut out = serde_json::Map::new();
    let mr: Vec<Option<f64>> = per_session
        .iter()
        .map(|s| multiturn_reward(std::slice::from_ref(s), weights, formula))
        .collect();
    out.insert("MR".into(), serde_json::json!(mr));
    let metrics: BTreeSet<&String> = per_session.iter().flat_map(|s| s.keys()).collect();
    for m in metrics {
        let values: Vec<Option<f64>> = per_session
            .iter()
            .map(|s| s.get(m).copied().flatten())
            .collect();
        out.insert(m.clone(), serde_json::json!(values));
    }
    serde_json::Value::Object(out)
}

/// Writes `flat.parquet`, `sft.parquet` and `pairs/{train,test}.parquet` under `dir` (each
/// atomically).
pub fn write(dir: &Path, built: &Built) -> Result<(), OutputError> {
    let (train, test, flat) = (&built.train, &built.test, &built.flat);
    let pairs_dir = dir.join("pairs");
    std::fs::create_dir_all(&pairs_dir).map_err(|source| OutputError::CreateDir {
        path: pairs_dir.clone(),
        source,
    })?;
    write_pairs_parquet(&pairs_dir.join("train.parquet"), train)?;
    write_pairs_parquet(&pairs_dir.join("test.parquet"), test)?;
    write_flat_parquet(&dir.join("flat.parquet"), flat)?;
    write_sft_parquet(&dir.join("sft.parquet"), &sft_from_flat(flat))?;
    Ok(())
}

/// Writes JSON atomically and durably ([`crate::run::write_json_atomic`]).
pub fn write_json_atomic(path: &Path, value: &impl Serialize) -> Result<(), OutputError> {
    Ok(crate::run::write_json_atomic(path, value)?)
}

/// The task's metadata with its `task_type` (as upstream's rows carry it), so that an import
/// or export of `flat.parquet` knows the type without a flag.
fn metadata_with_task_type(rec: &ConversationRecord) -> serde_json::Value {
    let ty = serde_json::to_value(rec.task_type).unwrap_or_default();
    match &rec.metadata {
        serde_json::Value::Object(m) if m.contains_key("task_type") => rec.metadata.clone(),
        serde_json::Value::Object(m) => {
            let mut m = m.clone();
            m.insert("task_type".into(), ty);
            serde_json::Value::Object(m)
        }
        serde_json::Value::Null => serde_json::json!({ "task_type": ty }),
        other => serde_json::json!({ "task_type": ty, "value": other }),
    }
}
