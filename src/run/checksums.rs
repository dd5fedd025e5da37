//! Per-file SHA-256 of a checkpoint directory (`checksums.json`), written when the checkpoint
//! is saved and checked before it is resumed from, loaded for training or published: flipped
//! bytes or a file replaced by hand are refused by name, not found later as a "non-finite
//! loss".
//!
//! One rule for every reader ([`verify_checksums`]): each listed file must have its recorded
//! digest, and each file of the folder must be listed (hidden files and the regenerated
//! `README.md` excepted), so a partial or empty list refuses the same files on `--resume` as
//! on `push_hf`.

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

/// The digests `dir`'s `checksums.json` records, by file name; `None` when the directory has
/// no list (a checkpoint written by an older version). A list that exists but cannot be read,
/// is not UTF-8 JSON, or names anything but a plain file of the directory is an error: a
/// damaged list must never turn verification off.
pub fn recorded_checksums(dir: &Path) -> Result<Option<BTreeMap<String, String>>, String> {
    let list = dir.join(CHECKSUMS_FILE);
    let bytes = match std::fs::read(&list) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("{}: cannot be read ({e})", list.display())),
    };
    let damaged = |why: String| {
        format!(
            "{}: {why}; the list is damaged, so the checkpoint cannot be verified (restore \
             the list, or delete it to accept the files unverified)",
            list.display()
        )
    };
    let text = String::from_utf8(bytes).map_err(|_| damaged("not UTF-8 text".into()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| damaged(format!("not valid JSON ({e})")))?;
    let sums = v["sha256"]
        .as_object()
        .ok_or_else(|| damaged("no `sha256` map".into()))?;
    let mut out = BTreeMap::new();
    for (name, want) in sums {
        let plain = !name.is_empty()
            && !name.contains(['/', '\\'])
            && name != "."
            && name != ".."
            && name != CHECKSUMS_FILE;
        let digest = want
            .as_str()
            .filter(|d| d.len() == 64 && d.bytes().all(|b| b.is_ascii_hexdigit()));
        match (plain, digest) {
            (true, Some(d)) => out.insert(name.clone(), d.to_ascii_lowercase()),
            (false, _) => return Err(damaged(format!("`{name}` is not a file name"))),
            (true, None) => return Err(damaged(format!("`{name}` has no SHA-256 digest"))),
        };
    }
    Ok(Some(out))
}

/// Files of a folder that a checksum list must name: every entry but hidden ones, the list
/// itself and `README.md` (a model card, regenerated on every push), sorted.
pub fn files_to_list(dir: &Path) -> Result<Vec<String>, String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut names = Vec::new();
    for e in entries {
        let e = e.map_err(|e| format!("{}: {e}", dir.display()))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || name == CHECKSUMS_FILE || name == "README.md" {
            continue;
        }
        names.push(name);
    }
    names.sort();
    Ok(names)
}

/// Checks every file `checksums.json` lists, and that it lists every file of the folder (see
/// the module docs); a checkpoint without a list (written by an older version) passes, a
/// damaged list does not. The error names the file.
pub fn verify_checksums(dir: &Path) -> Result<(), String> {
    let Some(sums) = recorded_checksums(dir)? else {
        return Ok(());
    };
    let unlisted: Vec<String> = files_to_list(dir)?
        .into_iter()
        .filter(|name| !sums.contains_key(name))
        .collect();
    if !unlisted.is_empty() {
        return Err(format!(
            "{}: {} not listed in {CHECKSUMS_FILE} (added after the checkpoint was saved, or \
             the list is partial), so the folder cannot be verified: {}; remove them, or use \
             a copy of the folder without them",
            dir.display(),
            if unlisted.len() == 1 {
                "a file is"
            } else {
                "files are"
            },
            unlisted.join(", ")
        ));
    }
    for (name, want) in sums {
        let path = dir.join(&name);
        let got = sha256_file(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        if got != want {
            return Err(format!(
                "{}: its SHA-256 differs from the one recorded in {CHECKSUMS_FILE} when the \
                 checkpoint was saved, so the file is corrupt or was replaced. Resume from \
                 another checkpoint; or, if you changed `{name}` on purpose, delete \
                 {CHECKSUMS_FILE} to accept the folder unverified (a list must name every \
                 file)",
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
            e.contains("model.safetensors") && e.contains("SHA-256") && e.contains("on purpose"),
            "{e}"
        );
    }

    /// A damaged list is an error, never "no checksums": one byte that makes it non-UTF-8,
    /// truncated JSON, a path instead of a file name, a digest that is not one.
    #[test]
    fn a_damaged_list_refuses_instead_of_turning_checks_off() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("model.safetensors"), b"weights").unwrap();
        write_checksums(dir.path()).unwrap();
        let list = dir.path().join(CHECKSUMS_FILE);
        let good = std::fs::read(&list).unwrap();
        let mut non_utf8 = good.clone();
        non_utf8[3] = 0xFF;
        let digest = "a".repeat(64);
        for damaged in [
            non_utf8,
            good[..good.len() / 2].to_vec(),
            format!("{{\"sha256\": {{\"../x\": \"{digest}\"}}}}").into_bytes(),
            b"{\"sha256\": {\"model.safetensors\": \"abc\"}}".to_vec(),
            b"{\"files\": {}}".to_vec(),
        ] {
            std::fs::write(&list, &damaged).unwrap();
            let e = verify_checksums(dir.path()).unwrap_err();
            assert!(e.contains(CHECKSUMS_FILE) && e.contains("damaged"), "{e}");
        }
        std::fs::remove_file(&list).unwrap();
        assert_eq!(recorded_checksums(dir.path()).unwrap(), None);
    }

    /// A partial list (an empty one included) refuses the files it leaves out, by name; a
    /// hidden file and a README.md need no entry.
    #[test]
    fn a_partial_list_refuses_what_it_leaves_out() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("model.safetensors"), b"weights").unwrap();
        std::fs::write(dir.path().join("config.json"), b"{}").unwrap();
        let list = dir.path().join(CHECKSUMS_FILE);
        std::fs::write(&list, b"{\"sha256\": {}}").unwrap();
        let e = verify_checksums(dir.path()).unwrap_err();
        assert!(
            e.contains("not listed") && e.contains("config.json, model.safetensors"),
            "{e}"
        );
        write_checksums(dir.path()).unwrap();
        std::fs::write(dir.path().join(".hidden"), b"x").unwrap();
        std::fs::write(dir.path().join("README.md"), b"card").unwrap();
        verify_checksums(dir.path()).unwrap();
        std::fs::write(dir.path().join("evil.py"), b"import os").unwrap();
        let e = verify_checksums(dir.path()).unwrap_err();
        assert!(
            e.contains("a file is not listed") && e.contains("evil.py"),
            "{e}"
        );
    }
}
