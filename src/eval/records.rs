//! `conversations/<model>.jsonl`: one JSON object per finished conversation or game,
//! append-only and synced line by line. On reopen a line torn by a crash is cut off, so a
//! restart skips what is finished and appends after the last whole line.

use std::path::Path;

pub use crate::run::LogError;
use crate::run::{read_log, AppendLog};

/// An append-only JSONL file of records (JSON objects).
pub struct RecordLog(AppendLog<serde_json::Value>);

impl RecordLog {
    /// Opens (creating) `path`, cuts a torn last line, and returns the records already there.
    pub fn open(path: &Path) -> Result<(Self, Vec<serde_json::Value>), LogError> {
        let (log, records) = AppendLog::open(path)?;
        check_objects(path, &records)?;
        Ok((Self(log), records))
    }

    /// Appends one record as one line and syncs it.
    pub fn append(&mut self, record: &serde_json::Value) -> Result<(), LogError> {
        self.0.append(record)
    }
}

/// Reads a record file without opening it for writing (a missing file has no records; a torn
/// last line is ignored).
pub fn read_records(path: &Path) -> Result<Vec<serde_json::Value>, LogError> {
    let records = match read_log(path) {
        Err(LogError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            return Ok(Vec::new())
        }
        r => r?,
    };
    check_objects(path, &records)?;
    Ok(records)
}

fn check_objects(path: &Path, records: &[serde_json::Value]) -> Result<(), LogError> {
    match records.iter().position(|r| !r.is_object()) {
        // Records are one per line, blank lines aside (never written).
        Some(i) => Err(LogError::Malformed {
            path: path.to_path_buf(),
            line: i + 1,
            message: "not a JSON object".into(),
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

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
