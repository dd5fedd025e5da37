//! Append-only JSON-lines logs of finished work (`conversations.jsonl`,
//! `conversations/<model>.jsonl`): one record per line, each synced to disk when appended. A
//! line torn by a crash is cut off when the log is reopened for writing (and ignored when it is
//! only read), so a restart appends after the last whole record.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::marker::PhantomData;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Serialize;

#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{}:{line}: not a valid record: {message}", path.display())]
    Malformed {
        path: PathBuf,
        line: usize,
        message: String,
    },
}

/// An open log of `T` records.
pub struct AppendLog<T> {
    path: PathBuf,
    file: File,
    _records: PhantomData<fn(&T)>,
}

impl<T: Serialize + DeserializeOwned> AppendLog<T> {
    /// Opens (creating it and its folder) the log at `path`, cuts a torn last line, and
    /// returns the records already there, in order.
    pub fn open(path: &Path) -> Result<(Self, Vec<T>), LogError> {
        let io = |source| LogError::Io {
            path: path.to_path_buf(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let mut file = File::options()
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
        let log = Self {
            path: path.to_path_buf(),
            file,
            _records: PhantomData,
        };
        Ok((log, records))
    }

    /// Appends one record as one line and syncs it to disk.
    pub fn append(&mut self, record: &T) -> Result<(), LogError> {
        let io = |source| LogError::Io {
            path: self.path.clone(),
            source,
        };
        let mut line = serde_json::to_vec(record).map_err(|e| io(e.into()))?;
        line.push(b'\n');
        self.file.write_all(&line).map_err(io)?;
        self.file.sync_data().map_err(io)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The whole records of a log, without opening it for writing (a torn last line is ignored).
pub fn read_log<T: DeserializeOwned>(path: &Path) -> Result<Vec<T>, LogError> {
    let text = std::fs::read_to_string(path).map_err(|source| LogError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let complete = text.rfind('\n').map_or("", |i| &text[..=i]);
    parse(path, complete)
}

fn parse<T: DeserializeOwned>(path: &Path, text: &str) -> Result<Vec<T>, LogError> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| LogError::Malformed {
                path: path.to_path_buf(),
                line: i + 1,
                message: e.to_string(),
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
            let (mut log, recs) = AppendLog::<serde_json::Value>::open(&path).unwrap();
            assert!(recs.is_empty());
            log.append(&serde_json::json!({"k": 1})).unwrap();
        }
        let mut f = File::options().append(true).open(&path).unwrap();
        f.write_all(b"{\"k\": 2, \"torn").unwrap();
        assert_eq!(read_log::<serde_json::Value>(&path).unwrap().len(), 1);
        let (mut log, recs) = AppendLog::<serde_json::Value>::open(&path).unwrap();
        assert_eq!(recs, [serde_json::json!({"k": 1})]);
        log.append(&serde_json::json!({"k": 3})).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text, "{\"k\":1}\n{\"k\":3}\n");
        std::fs::write(&path, "{\"k\":1}\nnot json\n").unwrap();
        let e = read_log::<serde_json::Value>(&path)
            .unwrap_err()
            .to_string();
        assert!(e.contains("m.jsonl:2"), "{e}");
    }
}
