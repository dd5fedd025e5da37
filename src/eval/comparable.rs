//! Which eval runs may be compared or pooled: runs whose numbers mean the same thing. A run
//! against the table oracle and one against an LLM oracle, a 20-question and a 10-question
//! budget, the training and the held-out split, f32 and q8 weights: each pair measures
//! something else, and a test between them reports a difference the models did not make.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::run::MANIFEST_FILE;

/// The `eval_multiturn` settings (as `manifest.json` records them under `config`) that must be
/// equal in runs that are compared or pooled.
pub const COMPARABLE_SETTINGS: &[&str] = &[
    "task",
    "tasks",
    "oracle",
    "max_questions",
    "split",
    "weights",
    "max_turns",
];

/// The comparable settings of one run, by name.
pub type Settings = BTreeMap<String, Value>;

/// The comparable settings `dir`'s manifest records (none for a directory without one, such
/// as a `--transcripts` output).
pub fn recorded(dir: &Path) -> Result<Settings, String> {
    let path = dir.join(MANIFEST_FILE);
    let manifest = crate::run::Manifest::read(&path).map_err(|e| e.to_string())?;
    let Some(m) = manifest else {
        return Ok(BTreeMap::new());
    };
    Ok(COMPARABLE_SETTINGS
        .iter()
        .filter_map(|k| {
            let v = m.config.get(*k)?;
            (!v.is_null()).then(|| (k.to_string(), v.clone()))
        })
        .collect())
}

/// Refuses runs that differ in a comparable setting, naming the setting and each run's value;
/// a setting a run does not record is not compared.
pub fn check_comparable(dirs: &[PathBuf]) -> Result<(), String> {
    let mut unique: Vec<&PathBuf> = Vec::new();
    for d in dirs {
        if !unique.contains(&d) {
            unique.push(d);
        }
    }
    let settings = unique
        .iter()
        .map(|d| recorded(d).map(|s| (d.display().to_string(), s)))
        .collect::<Result<Vec<_>, _>>()?;
    check_settings(&settings)
}

/// [`check_comparable`] on runs' settings already read: `(name, settings)` of each.
pub fn check_settings(settings: &[(String, Settings)]) -> Result<(), String> {
    for key in COMPARABLE_SETTINGS {
        let values: Vec<(&String, &Value)> = settings
            .iter()
            .filter_map(|(d, s)| s.get(*key).map(|v| (d, v)))
            .collect();
        if values.iter().all(|(_, v)| *v == values[0].1) {
            continue;
        }
        let each: Vec<String> = values.iter().map(|(d, v)| format!("{d} has {v}")).collect();
        return Err(format!(
            "the runs differ in `{key}` ({}): their numbers are not comparable; compare or \
             pool runs made with the same {key}",
            each.join(", ")
        ));
    }
    Ok(())
}
