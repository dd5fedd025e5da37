//! Per-model aggregates of the per-conversation metrics (mean, standard error, n), written as
//! `summary.json` and `summary.csv` and printed as a comparison table. Everything here is
//! computed from the records in `conversations/<model>.jsonl`, so a summary can always be
//! recomputed from the transcripts.

use std::collections::BTreeMap;
use std::path::Path;

use serde::ser::SerializeMap;
use serde::{Serialize, Serializer};

use crate::task::twenty_questions::{AggregateMetrics, GameMetrics, Stat};
use crate::task::TaskType;

/// The 20 Questions metrics, in report order: the fields of [`AggregateMetrics`] (less
/// `games`). A test checks that the two lists agree.
pub const TWENTY_QUESTIONS_METRICS: &[&str] = &[
    "success_rate",
    "mean_return",
    "mean_turns",
    "turns_on_win",
    "eda_score",
    "yes_answers",
    "info_gain_per_game",
    "info_gain_per_question",
    "expected_gain_per_question",
    "unparsed",
    "unparsed_rate",
    "repeated",
    "inconsistent_guesses",
];

/// The dialogue metrics after the task metric, in report order.
pub const DIALOGUE_METRICS: &[&str] = &[
    "interactivity",
    "tokens_read_k",
    "tokens_typed_k",
    "turns",
    "judge_failures",
];

/// Second views of the task metric, reported right after it: math's judge-vs-programmatic
/// disagreement (mean = rate over conversations with both), doc_edit's character-level BLEU
/// (upstream's number), clarify's task reward, and success and asking rate on stated and
/// vague requests.
fn task_metric_companions(task: TaskType) -> &'static [&'static str] {
    task.facts().task_metric_companions
}

/// Metric names reported for a task, in order.
pub fn metric_names(task: TaskType) -> Vec<&'static str> {
    match crate::reward::metrics::task_metric(task) {
        Some(m) => std::iter::once(m)
            .chain(task_metric_companions(task).iter().copied())
            .chain(DIALOGUE_METRICS.iter().copied())
            .collect(),
        None => TWENTY_QUESTIONS_METRICS.to_vec(),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SummaryError {
    #[error("{model}: record {index}: {message}")]
    Record {
        model: String,
        index: usize,
        message: String,
    },
    /// Encoding our own summary (cannot happen with finite numbers).
    #[error("{what}: encoding JSON")]
    Encode {
        what: String,
        #[source]
        source: serde_json::Error,
    },
    #[error(transparent)]
    Write(#[from] crate::run::WriteError),
}

/// Mean, standard error of the mean (sample sd / √n; 0 when n < 2) and n.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct MetricStat {
    pub mean: f64,
    pub se: f64,
    pub n: usize,
}

impl From<Stat> for MetricStat {
    fn from(s: Stat) -> Self {
        MetricStat {
            mean: s.mean,
            se: s.stderr,
            n: s.n,
        }
    }
}

/// One model's aggregates, metrics in report order.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSummary {
    pub name: String,
    pub spec: String,
    pub metrics: Vec<(String, MetricStat)>,
}

impl ModelSummary {
    pub fn get(&self, metric: &str) -> Option<&MetricStat> {
        self.metrics
            .iter()
            .find(|(m, _)| m == metric)
            .map(|(_, s)| s)
    }
}

struct OrderedMetrics<'a>(&'a [(String, MetricStat)]);

impl Serialize for OrderedMetrics<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in self.0 {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

impl Serialize for ModelSummary {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(3))?;
        map.serialize_entry("name", &self.name)?;
        map.serialize_entry("spec", &self.spec)?;
        map.serialize_entry("metrics", &OrderedMetrics(&self.metrics))?;
        map.end()
    }
}

/// `summary.json`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Summary {
    pub task: TaskType,
    pub seed: u64,
    pub tool_version: String,
    pub models: Vec<ModelSummary>,
}

/// Aggregates dialogue records: every metric over the conversations where it is not null.
pub fn summarize_dialogues(
    name: &str,
    spec: &str,
    task: TaskType,
    records: &[serde_json::Value],
) -> Result<ModelSummary, SummaryError> {
    let names = metric_names(task);
    let mut values: BTreeMap<&str, Vec<f64>> = names.iter().map(|m| (*m, Vec::new())).collect();
    for (i, rec) in records.iter().enumerate() {
        let metrics = rec["metrics"]
            .as_object()
            .ok_or_else(|| SummaryError::Record {
                model: name.into(),
                index: i,
                message: "no `metrics` object".into(),
            })?;
        for m in &names {
            match metrics.get(*m) {
                Some(serde_json::Value::Null) | None => {}
                Some(v) => {
                    let x = v.as_f64().ok_or_else(|| SummaryError::Record {
                        model: name.into(),
                        index: i,
                        message: format!("metric `{m}` is not a number"),
                    })?;
                    values.entry(m).or_default().push(x);
                }
            }
        }
    }
    Ok(ModelSummary {
        name: name.into(),
        spec: spec.into(),
        metrics: names
            .iter()
            .map(|m| (m.to_string(), Stat::of(&values[m]).into()))
            .collect(),
    })
}

/// Aggregates 20 Questions records with [`AggregateMetrics`].
pub fn summarize_games(
    name: &str,
    spec: &str,
    records: &[serde_json::Value],
) -> Result<ModelSummary, SummaryError> {
    let games: Vec<GameMetrics> = records
        .iter()
        .enumerate()
        .map(|(i, r)| {
            serde_json::from_value(r["metrics"].clone()).map_err(|e| SummaryError::Record {
                model: name.into(),
                index: i,
                message: format!("`metrics` is not a game's metrics: {e}"),
            })
        })
        .collect::<Result<_, _>>()?;
    let agg = serde_json::to_value(AggregateMetrics::of(&games)).map_err(|source| {
        SummaryError::Encode {
            what: "summary".into(),
            source,
        }
    })?;
    let metrics = TWENTY_QUESTIONS_METRICS
        .iter()
        .map(|m| {
            let stat: Stat = serde_json::from_value(agg[*m].clone()).unwrap_or(Stat {
                mean: f64::NAN,
                stderr: f64::NAN,
                n: 0,
            });
            (m.to_string(), stat.into())
        })
        .collect();
    Ok(ModelSummary {
        name: name.into(),
        spec: spec.into(),
        metrics,
    })
}

impl Summary {
    /// `summary.csv`: `model,metric,mean,se,n`.
    pub fn csv(&self) -> String {
        let mut out = String::from("model,metric,mean,se,n\n");
        for m in &self.models {
            for (metric, s) in &m.metrics {
                out.push_str(&format!(
                    "{},{metric},{},{},{}\n",
                    csv_field(&m.name),
                    s.mean,
                    s.se,
                    s.n
                ));
            }
        }
        out
    }

    /// Models as columns, metrics as rows, `mean ± se` (n).
    pub fn table(&self) -> String {
        let Some(first) = self.models.first() else {
            return String::new();
        };
        let rows: Vec<&str> = first.metrics.iter().map(|(m, _)| m.as_str()).collect();
        let cell = |s: Option<&MetricStat>| match s {
            Some(s) if s.n > 0 => format!("{:.4} ± {:.4} (n={})", s.mean, s.se, s.n),
            _ => "-".to_string(),
        };
        let mut grid: Vec<Vec<String>> = vec![std::iter::once("metric".to_string())
            .chain(self.models.iter().map(|m| m.name.clone()))
            .collect()];
        for r in &rows {
            grid.push(
                std::iter::once(r.to_string())
                    .chain(self.models.iter().map(|m| cell(m.get(r))))
                    .collect(),
            );
        }
        let widths: Vec<usize> = (0..grid[0].len())
            .map(|c| {
                grid.iter()
                    .map(|row| row[c].chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut out = format!("task {} (seed {})\n", self.task, self.seed);
        for (i, row) in grid.iter().enumerate() {
            let line: Vec<String> = row
                .iter()
                .zip(&widths)
                .enumerate()
                .map(|(c, (v, w))| {
                    let pad = w - v.chars().count();
                    if c == 0 {
                        format!("{v}{}", " ".repeat(pad))
                    } else {
                        format!("{}{v}", " ".repeat(pad))
                    }
                })
                .collect();
            out.push_str(line.join("  ").trim_end());
            out.push('\n');
            if i == 0 {
                out.push_str(&"-".repeat(widths.iter().sum::<usize>() + 2 * (widths.len() - 1)));
                out.push('\n');
            }
        }
        out
    }

    /// Writes `summary.json` and `summary.csv` into `dir`, each atomically.
    pub fn write(&self, dir: &Path) -> Result<(), SummaryError> {
        let json = serde_json::to_string_pretty(self).map_err(|source| SummaryError::Encode {
            what: dir.join("summary.json").display().to_string(),
            source,
        })?;
        write_atomic(&dir.join("summary.json"), json.as_bytes())?;
        write_atomic(&dir.join("summary.csv"), self.csv().as_bytes())
    }
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// Writes a file atomically and durably ([`crate::run::write_atomic`]).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), SummaryError> {
    Ok(crate::run::write_atomic(path, bytes)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn twenty_questions_names_are_the_aggregate_fields() {
        let agg = serde_json::to_value(AggregateMetrics::of(&[])).unwrap();
        let mut fields: Vec<&str> = agg
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .filter(|k| *k != "games")
            .collect();
        fields.sort_unstable();
        let mut ours = TWENTY_QUESTIONS_METRICS.to_vec();
        ours.sort_unstable();
        assert_eq!(fields, ours);
    }

    #[test]
    fn dialogue_stats_skip_missing_values_and_render() {
        let recs: Vec<serde_json::Value> = [
            serde_json::json!({"metrics": {"accuracy": 1.0, "interactivity": 0.5, "tokens_read_k": 0.1,
                "tokens_typed_k": 0.01, "turns": 2, "judge_failures": 0}}),
            serde_json::json!({"metrics": {"accuracy": 0.0, "interactivity": null, "tokens_read_k": 0.3,
                "tokens_typed_k": 0.03, "turns": 4, "judge_failures": 1}}),
        ]
        .into();
        let m = summarize_dialogues("tiny", "x", TaskType::Math, &recs).unwrap();
        let names: Vec<&str> = m.metrics.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(names[0], "accuracy");
        assert_eq!(m.get("accuracy").unwrap().mean, 0.5);
        assert_eq!(m.get("accuracy").unwrap().se, 0.5);
        assert_eq!(
            *m.get("interactivity").unwrap(),
            MetricStat {
                mean: 0.5,
                se: 0.0,
                n: 1
            }
        );
        assert_eq!(m.get("turns").unwrap().mean, 3.0);
        let s = Summary {
            task: TaskType::Math,
            seed: 0,
            tool_version: "0.1.0".into(),
            models: vec![m],
        };
        let csv = s.csv();
        assert!(
            csv.starts_with("model,metric,mean,se,n\ntiny,accuracy,0.5,0.5,2\n"),
            "{csv}"
        );
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(json["models"][0]["metrics"]["interactivity"]["n"], 1);
        assert_eq!(json["task"], "math");
        let table = s.table();
        assert!(table.contains("0.5000 ± 0.5000 (n=2)"), "{table}");
        let bad = [serde_json::json!({"metrics": {"accuracy": "yes"}})];
        assert!(summarize_dialogues("m", "x", TaskType::Math, &bad)
            .unwrap_err()
            .to_string()
            .contains("accuracy"));
    }
}
