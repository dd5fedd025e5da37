//! `conversations/<model>.jsonl`: one JSON object per finished conversation or game,
//! append-only and synced line by line. On reopen a line torn by a crash is cut off, so a
//! restart skips what is finished and appends after the last whole line.

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("{path}: {message}")]
    Io { path: PathBuf, message: String },
    #[error("{path}:{line}: not a JSON object: {message}")]
    Malformed {
        path: PathBuf,
        line: usize,
        message: String,
    },
}

/// An append-only JSONL file of records.
pub struct RecordLog {
    path: PathBuf,
    file: std::fs::File,
}

impl RecordLog {
    /// Opens (creating) `path`, cuts a torn last line, and returns the records already there.
    pub fn open(path: &Path) -> Result<(Self, Vec<serde_json::Value>), LogError> {
        let io = |e: std::io::Error| LogError::Io {
            path: path.to_path_buf(),
            message: e.to_string(),
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(path)
            .map_err(io)?;
        let mut text = String::new();
        file.read_to_string(&mut text).map_err(io)?;
        if !text.is_empty() && !text.ends_with('\n') {
            let keep = text.rfind('\n').map_or(0, |i| i + 1);
            tracing::warn!(
                file = %path.display(),
                bytes = text.len() - keep,
                "cutting off a torn last record (the previous run was interrupted mid-write)"
            );
            file.set_len(keep as u64).map_err(io)?;
            text.truncate(keep);
        }
        file.seek(SeekFrom::End(0)).map_err(io)?;
        let records = parse(path, &text)?;
        Ok((
            Self {
                path: path.to_path_buf(),
                file,
            },
            records,
        ))
    }

    /// Appends one record as one line and syncs it.
    pub fn append(&mut self, record: &serde_json::Value) -> Result<(), LogError> {
        let io = |e: std::io::Error| LogError::Io {
            path: self.path.clone(),
            message: e.to_string(),
        };
        let mut line = serde_json::to_string(record).map_err(|e| LogError::Io {
            path: self.path.clone(),
            message: e.to_string(),
        })?;
        line.push('\n');
        self.file.write_all(line.as_bytes()).map_err(io)?;
        self.file.sync_data().map_err(io)
    }
}

/// Reads a record file without opening it for writing (a missing file has no records; a torn
/// last line is ignored).
pub fn read_records(path: &Path) -> Result<Vec<serde_json::Value>, LogError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => {
            return Err(LogError::Io {
                path: path.to_path_buf(),
                message: e.to_string(),
            })
        }
    };
    let complete = text.rfind('\n').map_or("", |i| &text[..=i]);
    parse(path, complete)
}

fn parse(path: &Path, text: &str) -> Result<Vec<serde_json::Value>, LogError> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str::<serde_json::Value>(l)
                .map_err(|e| e.to_string())
                .and_then(|v| {
                    if v.is_object() {
                        Ok(v)
                    } else {
                        Err("not an object".to_string())
                    }
                })
                .map_err(|message| LogError::Malformed {
                    path: path.to_path_buf(),
                    line: i + 1,
                    message,
                })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torn_tail_is_cut_and_appends_continue() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c").join("m.jsonl");
        {
            let (mut log, recs) = RecordLog::open(&path).unwrap();
            assert!(recs.is_empty());
            log.append(&serde_json::json!({"k": 1})).unwrap();
        }
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        f.write_all(b"{\"k\": 2, \"torn").unwrap();
        assert_eq!(read_records(&path).unwrap().len(), 1);
        let (mut log, recs) = RecordLog::open(&path).unwrap();
        assert_eq!(recs, [serde_json::json!({"k": 1})]);
        log.append(&serde_json::json!({"k": 3})).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text, "{\"k\":1}\n{\"k\":3}\n");
        std::fs::write(&path, "{\"k\":1}\n[1]\n").unwrap();
        let e = read_records(&path).unwrap_err().to_string();
        assert!(e.contains("m.jsonl:2"), "{e}");
    }
}
