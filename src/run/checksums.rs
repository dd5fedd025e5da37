//! Per-file SHA-256 of a checkpoint directory (`checksums.json`), written when the checkpoint
//! is saved and checked before it is resumed from: flipped bytes or a file replaced by
//! hand are refused by name, not found later as a "non-finite loss".

use std::collections::BTreeMap;
use std::path::Path;

/// The file in a checkpoint directory that lists its other files' SHA-256.
pub const CHECKSUMS_FILE: &str = "checksums.json";

/// The SHA-256 of a file's bytes, streamed, as lowercase hex.
pub fn sha256_file(path: &Path) -> std::io::Result<String> {
    use sha2::Digest as _;
    let mut f = std::fs::File::open(path)?;
    let mut h = sha2::Sha256::new();
    std::io::copy(&mut f, &mut h)?;
    Ok(format!("{:x}", h.finalize()))
}

/// Writes `checksums.json` into `dir`: every regular file of it (not recursing) but itself.
pub fn write_checksums(dir: &Path) -> Result<(), super::WriteError> {
    let mut sums = BTreeMap::new();
    let entries = std::fs::read_dir(dir).map_err(|e| super::WriteError::new(dir, e))?;
    for e in entries.filter_map(|e| e.ok()) {
        let name = e.file_name().to_string_lossy().into_owned();
        if name == CHECKSUMS_FILE || !e.file_type().is_ok_and(|t| t.is_file()) {
            continue;
        }
        let sum = sha256_file(&e.path()).map_err(|err| super::WriteError::new(&e.path(), err))?;
        sums.insert(name, sum);
    }
    super::write_json_atomic(
        &dir.join(CHECKSUMS_FILE),
        &serde_json::json!({ "sha256": sums }),
    )
}

/// Checks every file `checksums.json` lists; a checkpoint without one (written by an older
/// version) passes. The error names the file.
pub fn verify_checksums(dir: &Path) -> Result<(), String> {
    let list = dir.join(CHECKSUMS_FILE);
    let Ok(text) = std::fs::read_to_string(&list) else {
        return Ok(());
    };
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", list.display()))?;
    let Some(sums) = v["sha256"].as_object() else {
        return Err(format!("{}: no `sha256` map", list.display()));
    };
    for (name, want) in sums {
        let path = dir.join(name);
        let got = sha256_file(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        if Some(got.as_str()) != want.as_str() {
            return Err(format!(
                "{}: its SHA-256 differs from the one recorded when the checkpoint was saved \
                 (the file is corrupt or was replaced); resume from another checkpoint",
                path.display()
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flipped_byte_is_named() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("model.safetensors"), b"weights").unwrap();
        std::fs::write(dir.path().join("trainer_state.json"), b"{}").unwrap();
        verify_checksums(dir.path()).unwrap();
        write_checksums(dir.path()).unwrap();
        verify_checksums(dir.path()).unwrap();
        std::fs::write(dir.path().join("model.safetensors"), b"weightS").unwrap();
        let e = verify_checksums(dir.path()).unwrap_err();
        assert!(
            e.contains("model.safetensors") && e.contains("SHA-256"),
            "{e}"
        );
    }
}
