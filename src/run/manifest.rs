//! What a run's `manifest.json` is checked against on resume.

use std::path::{Path, PathBuf};

/// A manifest that is not JSON (hand-edited, or not ours).
#[derive(Debug, thiserror::Error)]
#[error("{}: not valid JSON: {source}", path.display())]
pub struct ManifestError {
    pub path: PathBuf,
    #[source]
    pub source: serde_json::Error,
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
    let old: serde_json::Value = serde_json::from_str(&text).map_err(|source| ManifestError {
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
}
