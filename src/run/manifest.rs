//! A run's `manifest.json`: the header every stage writes first ([`ManifestHeader`]: which
//! tool and revision, [`RunStatus`], times, the signal that stopped it), the typed reader of
//! any stage's manifest ([`Manifest`]), and the resume check of its recorded settings.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::Signal;

/// Where a run stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RunStatus {
    /// Still writing (or killed before it could say otherwise).
    Running,
    /// Every planned item finished.
    Complete,
    /// Some items failed; a rerun retries them.
    Incomplete,
    /// Stopped by a signal after recording what it finished.
    Interrupted,
}

impl RunStatus {
    /// The status of a run that ended: a signal wins, then any failure.
    pub fn at_end(signal: Option<Signal>, failures: usize) -> Self {
        match (signal, failures) {
            (Some(_), _) => RunStatus::Interrupted,
            (None, 0) => RunStatus::Complete,
            (None, _) => RunStatus::Incomplete,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            RunStatus::Running => "running",
            RunStatus::Complete => "complete",
            RunStatus::Incomplete => "incomplete",
            RunStatus::Interrupted => "interrupted",
        }
    }
}

/// The fields every stage's `manifest.json` starts with. The revision is the one the library
/// was built from ([`super::git_revision`]), never what the build directory holds at run time.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ManifestHeader {
    pub tool: String,
    #[serde(default)]
    pub version: Option<String>,
    #[serde(default)]
    pub git_revision: Option<String>,
    pub status: RunStatus,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<f64>,
    /// Set once the status is no longer `running`.
    #[serde(default)]
    pub finished_at: Option<f64>,
    /// The signal that stopped the run (`interrupted` only).
    #[serde(default)]
    pub signal: Option<String>,
}

impl ManifestHeader {
    /// The header of `tool` (e.g. "collabllm-rs generate_conv"), written now, of a run that
    /// started at `started_at` (Unix seconds).
    pub fn now(tool: &str, started_at: f64, status: RunStatus, signal: Option<Signal>) -> Self {
        let now = super::now_secs();
        ManifestHeader {
            tool: tool.to_string(),
            version: Some(env!("CARGO_PKG_VERSION").to_string()),
            git_revision: super::git_revision(),
            status,
            started_at: Some(started_at),
            updated_at: Some(now),
            finished_at: (status != RunStatus::Running).then_some(now),
            signal: signal.map(|s| s.name().to_string()),
        }
    }

    /// The whole manifest: this header, then the stage's own fields (`stage`, an object; a
    /// stage field never replaces a header field).
    pub fn with_fields(self, stage: Value) -> Value {
        let mut m = Map::new();
        if let Value::Object(stage) = stage {
            m.extend(stage);
        }
        // Strings, options and numbers: serializing the header cannot fail.
        if let Ok(Value::Object(header)) = serde_json::to_value(&self) {
            m.extend(header);
        }
        Value::Object(m)
    }
}

/// Writes the summary of a run that `signal` stopped after `wall_s` seconds: an interrupted
/// run's header, then `fields` (what it finished, where it resumes).
pub fn write_interrupted_summary(
    path: &Path,
    tool: &str,
    wall_s: f64,
    signal: super::Signal,
    fields: Value,
) -> Result<(), super::WriteError> {
    let header = ManifestHeader::now(
        tool,
        super::now_secs() - wall_s,
        RunStatus::Interrupted,
        Some(signal),
    );
    super::write_json_atomic(path, &header.with_fields(fields))
}

/// Writes the summary of a run that finished after `wall_s` seconds (`train_summary.json`,
/// `rl_summary.json`): a complete run's header, then the summary's own fields.
pub fn write_finished_summary(
    path: &Path,
    tool: &str,
    wall_s: f64,
    summary: &impl Serialize,
) -> Result<(), super::WriteError> {
    let fields =
        serde_json::to_value(summary).map_err(|e| super::WriteError::new(path, e.into()))?;
    let header = ManifestHeader::now(tool, super::now_secs() - wall_s, RunStatus::Complete, None);
    super::write_json_atomic(path, &header.with_fields(fields))
}

/// Any stage's manifest as read back: the typed header, the run's `config` and `seed`, and
/// the stage's own fields in `rest`.
#[derive(Clone, Debug, Deserialize)]
pub struct Manifest {
    #[serde(flatten)]
    pub header: ManifestHeader,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub config: Value,
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

impl Manifest {
    /// The manifest at `path`; `Ok(None)` when there is none.
    pub fn read(path: &Path) -> Result<Option<Manifest>, ManifestError> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => {
                return Err(ManifestError::Read {
                    path: path.to_path_buf(),
                    source: e,
                })
            }
        };
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|source| ManifestError::Parse {
                path: path.to_path_buf(),
                source,
            })
    }

    /// A stage field (`counts`, `import`, `usage_total`, …); `Null` when absent.
    pub fn field(&self, name: &str) -> &Value {
        self.rest.get(name).unwrap_or(&Value::Null)
    }
}

/// A manifest that cannot be read, or is not one of ours (hand-edited, another tool's).
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("{}: not a run manifest: {source}", path.display())]
    Parse {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("reading {}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The settings of `now` (a JSON object) that differ from the object `field` of the manifest
/// at `path`: what a resume with these settings would change. Empty when there is no manifest
/// yet or it has no such field (written before the field existed).
pub fn changed_settings(
    path: &Path,
    field: &str,
    now: &serde_json::Value,
) -> Result<Vec<String>, ManifestError> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(Vec::new());
    };
    let old: serde_json::Value =
        serde_json::from_str(&text).map_err(|source| ManifestError::Parse {
            path: path.to_path_buf(),
            source,
        })?;
    let before = &old[field];
    if before.is_null() {
        return Ok(Vec::new());
    }
    Ok(changed_keys(before, now))
}

/// The keys of the object `now` whose values differ in `before` (absent counts as different).
pub fn changed_keys(before: &serde_json::Value, now: &serde_json::Value) -> Vec<String> {
    if before == now {
        return Vec::new();
    }
    now.as_object()
        .map(|o| {
            o.iter()
                .filter(|(k, v)| before.get(k.as_str()) != Some(v))
                .map(|(k, _)| k.clone())
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn names_the_changed_settings_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("manifest.json");
        let now = json!({"seed": 1, "n": 3});
        assert!(changed_settings(&path, "identity", &now)
            .unwrap()
            .is_empty());
        std::fs::write(&path, json!({"identity": {"seed": 0, "n": 3}}).to_string()).unwrap();
        assert_eq!(changed_settings(&path, "identity", &now).unwrap(), ["seed"]);
        assert!(changed_settings(&path, "other", &now).unwrap().is_empty());
        std::fs::write(&path, "{").unwrap();
        let e = changed_settings(&path, "identity", &now).unwrap_err();
        assert!(e.to_string().contains("manifest.json"), "{e}");
    }

    #[test]
    fn a_written_header_reads_back_typed_with_the_stage_fields() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("manifest.json");
        assert!(Manifest::read(&path).unwrap().is_none());
        let header = ManifestHeader::now(
            "collabllm-rs test",
            1.0,
            RunStatus::at_end(Some(Signal::Terminate), 0),
            Some(Signal::Terminate),
        );
        let mut v = header.clone().with_fields(json!({
            "seed": 7,
            "status": "forged by a stage",
            "config": {"min_gap": 0.1},
        }));
        v["counts"] = json!({"pairs": 3});
        std::fs::write(&path, v.to_string()).unwrap();
        let m = Manifest::read(&path).unwrap().unwrap();
        assert_eq!(m.header, header);
        assert_eq!(m.header.status, RunStatus::Interrupted);
        assert_eq!(m.header.signal.as_deref(), Some("SIGTERM"));
        assert!(m.header.finished_at.is_some());
        assert_eq!(m.seed, Some(7));
        assert_eq!(m.config["min_gap"], 0.1);
        assert_eq!(m.field("counts")["pairs"], 3);
        assert!(m.field("absent").is_null());
        assert!(
            !m.rest.contains_key("tool"),
            "header fields are not stage fields"
        );
        // A manifest of an older release without the optional fields still reads.
        std::fs::write(&path, r#"{"tool": "x", "status": "complete"}"#).unwrap();
        let old = Manifest::read(&path).unwrap().unwrap();
        assert_eq!(old.header.status, RunStatus::Complete);
        std::fs::write(&path, r#"{"tool": "x", "status": "exploded"}"#).unwrap();
        assert!(matches!(
            Manifest::read(&path),
            Err(ManifestError::Parse { .. })
        ));
    }

    #[test]
    fn status_at_end_prefers_the_signal_then_failures() {
        assert_eq!(RunStatus::at_end(None, 0), RunStatus::Complete);
        assert_eq!(RunStatus::at_end(None, 2), RunStatus::Incomplete);
        assert_eq!(
            RunStatus::at_end(Some(Signal::Interrupt), 2),
            RunStatus::Interrupted
        );
        assert_eq!(
            serde_json::to_value(RunStatus::Incomplete).unwrap(),
            "incomplete"
        );
    }
}
