//! Atomic, durable file replacement: temp file in the destination's directory → fsync →
//! rename → fsync of the directory (without the last step a power cut can undo the rename).

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde::Serialize;

/// A write that failed, naming the file.
#[derive(Debug, thiserror::Error)]
#[error("writing {path}: {source}")]
pub struct WriteError {
    pub path: String,
    #[source]
    pub source: io::Error,
}

impl WriteError {
    pub(crate) fn new(path: &Path, source: io::Error) -> Self {
        Self {
            path: path.display().to_string(),
            source,
        }
    }
}

/// Replaces `path` with `bytes` atomically and durably (see the module docs).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), WriteError> {
    let err = |e| WriteError::new(path, e);
    let (guard, mut file) = AtomicFile::create(path).map_err(err)?;
    file.write_all(bytes).map_err(err)?;
    guard.commit(file).map_err(err)
}

/// [`write_atomic`] of `value` as pretty-printed JSON.
pub fn write_json_atomic(path: &Path, value: &impl Serialize) -> Result<(), WriteError> {
    let text = serde_json::to_vec_pretty(value).map_err(|e| WriteError::new(path, e.into()))?;
    write_atomic(path, &text)
}

/// Flushes a directory's entries (a rename or a new file in it) to disk.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// A file written under a temporary name in the destination's directory and renamed over the
/// destination on [`AtomicFile::commit`]; dropped uncommitted, the temporary file is removed, so
/// a crash or an error never leaves a half-written destination behind.
pub(crate) struct AtomicFile {
    tmp: PathBuf,
    dest: PathBuf,
    committed: bool,
}

impl AtomicFile {
    /// Refuses a destination that is neither absent, a regular file nor a symbolic link (a
    /// device, FIFO, socket or directory is never replaced).
    pub(crate) fn create(dest: &Path) -> io::Result<(Self, File)> {
        super::output::check_replaceable(dest)?;
        let dir = parent_dir(dest);
        let name = dest
            .file_name()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"))?
            .to_string_lossy()
            .into_owned();
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let mut attempt = 0u32;
        loop {
            let tmp = dir.join(format!(
                ".{name}.tmp-{}-{nanos}-{attempt}",
                std::process::id()
            ));
            match File::options().write(true).create_new(true).open(&tmp) {
                Ok(file) => {
                    return Ok((
                        Self {
                            tmp,
                            dest: dest.to_path_buf(),
                            committed: false,
                        },
                        file,
                    ))
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists && attempt < 100 => attempt += 1,
                Err(e) => return Err(e),
            }
        }
    }

    /// Flushes `file` to disk, renames the temporary file over the destination and flushes
    /// the directory.
    pub(crate) fn commit(mut self, file: File) -> io::Result<()> {
        file.sync_all()?;
        drop(file);
        std::fs::rename(&self.tmp, &self.dest)?;
        self.committed = true;
        sync_dir(&parent_dir(&self.dest))
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_whole_files_and_leaves_no_temp_behind() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.json");
        write_json_atomic(&path, &serde_json::json!({"a": 1})).unwrap();
        write_atomic(&path, b"second").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"second");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("m.json")]);
        // A failed write names the file and keeps the old content.
        let err = write_atomic(&dir.path().join("no/such/dir/x"), b"x").unwrap_err();
        assert!(err.to_string().contains("no/such/dir/x"), "{err}");
        assert!(std::error::Error::source(&err).is_some());
    }
}
