//! Tasks: the hidden goals `q` (with reference `a`) that conversations are generated from
//!. Loaded from `.jsonl` (one object per line) or `.parquet`.
//!
//! JSONL fields: `id` (string, or an integer written as its text), `task_type` (one of
//! [`TaskType::ALL`], snake_case), `prompt` (non-empty), `reference` (string or number; absent or
//! null → ""), `metadata` (any JSON; absent → null). Unknown fields are an error so that a typo
//! such as `"refrence"` cannot silently drop the reference.
//!
//! Parquet columns: `id`, `task_type`, `prompt` (required), `reference` (nullable → ""),
//! `metadata` (JSON text, or a nested struct column as Hugging Face `datasets` writes it; absent
//! → null). Other columns are ignored. Errors name JSONL lines 1-based (as editors do) and
//! parquet rows 0-based (as dataframes do).

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use arrow::array::{Array as _, RecordBatchReader as _};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::dataset::columnar::{self, AtomicFile};

pub mod clarify;
mod kind;
pub mod prompts;
pub mod source;
pub mod twenty_questions;

pub use kind::{Action, TaskFacts, TaskType, UnknownTaskType, UserKind};

/// One task: hidden goal `prompt` (= q), `reference` (= a: answer, target document, reference
/// solution), and free-form `metadata` (e.g. `tests` for code tasks).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Task {
    pub id: String,
    pub task_type: TaskType,
    pub prompt: String,
    #[serde(default)]
    pub reference: String,
    #[serde(default, skip_serializing_if = "Value::is_null")]
    pub metadata: Value,
}

/// Where in a task file something is: a JSONL line (1-based) or a parquet row (0-based).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Location {
    Line(usize),
    Row(usize),
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Line(n) => write!(f, "line {n}"),
            Location::Row(n) => write!(f, "row {n}"),
        }
    }
}

/// Everything that can go wrong loading or writing tasks; every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    #[error("{}: cannot read: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: cannot write: {source}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: unsupported extension (expected .jsonl or .parquet)", path.display())]
    UnsupportedExtension { path: PathBuf },
    #[error("{}: line {line}: malformed JSON: {message}", path.display())]
    MalformedJson {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("{}: {at}: missing field `{field}`", path.display())]
    MissingField {
        path: PathBuf,
        at: Location,
        field: &'static str,
    },
    #[error("{}: {at}: field `{field}` is empty", path.display())]
    EmptyField {
        path: PathBuf,
        at: Location,
        field: &'static str,
    },
    #[error("{}: {at}: field `{field}`: {message}", path.display())]
    InvalidField {
        path: PathBuf,
        at: Location,
        field: String,
        message: String,
    },
    #[error(
        "{}: {at}: unknown task_type `{value}` (valid: math, doc_edit, code, twenty_questions, clarify)",
        path.display()
    )]
    UnknownTaskType {
        path: PathBuf,
        at: Location,
        value: String,
    },
    #[error("{}: duplicate id `{id}` at {first} and {second}", path.display())]
    DuplicateId {
        path: PathBuf,
        id: String,
        first: Location,
        second: Location,
    },
    #[error("{}: missing required column `{column}`", path.display())]
    MissingColumn { path: PathBuf, column: &'static str },
    #[error("{}: column `{column}`: {message}", path.display())]
    ColumnType {
        path: PathBuf,
        column: &'static str,
        message: String,
    },
    #[error("{}: not a readable parquet file: {message}", path.display())]
    Parquet { path: PathBuf, message: String },
}

/// Loads tasks from a `.jsonl` or `.parquet` file, validating every field and the uniqueness
/// of ids. See the module documentation for the accepted shapes.
pub fn load_tasks(path: &Path) -> Result<Vec<Task>, TaskError> {
    let ext = path
        .extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase());
    let tasks = match ext.as_deref() {
        Some("jsonl") => load_jsonl(path)?,
        Some("parquet") => load_parquet(path)?,
        _ => {
            return Err(TaskError::UnsupportedExtension {
                path: path.to_path_buf(),
            })
        }
    };
    let mut seen: HashMap<&str, Location> = HashMap::new();
    for (task, at) in &tasks {
        if let Some(first) = seen.insert(&task.id, *at) {
            return Err(TaskError::DuplicateId {
                path: path.to_path_buf(),
                id: task.id.clone(),
                first,
                second: *at,
            });
        }
    }
    Ok(tasks.into_iter().map(|(t, _)| t).collect())
}

/// Writes tasks as JSONL, one object per line, atomically (temporary file + rename).
pub fn write_tasks_jsonl(path: &Path, tasks: &[Task]) -> Result<(), TaskError> {
    let werr = |source| TaskError::Write {
        path: path.to_path_buf(),
        source,
    };
    let (guard, file) = AtomicFile::create(path).map_err(werr)?;
    let mut w = BufWriter::new(file);
    for t in tasks {
        serde_json::to_writer(&mut w, t).map_err(|e| werr(e.into()))?;
        w.write_all(b"\n").map_err(werr)?;
    }
    let file = w.into_inner().map_err(|e| werr(e.into_error()))?;
    guard.commit(file).map_err(werr)
}

const JSONL_FIELDS: [&str; 5] = ["id", "task_type", "prompt", "reference", "metadata"];

fn load_jsonl(path: &Path) -> Result<Vec<(Task, Location)>, TaskError> {
    let text = std::fs::read_to_string(path).map_err(|source| TaskError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let p = || path.to_path_buf();
    let mut out = Vec::new();
    for (idx, raw) in text.lines().enumerate() {
        let line = idx + 1;
        if raw.trim().is_empty() {
            continue;
        }
        let at = Location::Line(line);
        let value: Value = serde_json::from_str(raw).map_err(|e| TaskError::MalformedJson {
            path: p(),
            line,
            message: e.to_string(),
        })?;
        let Value::Object(mut obj) = value else {
            return Err(TaskError::MalformedJson {
                path: p(),
                line,
                message: "expected a JSON object".into(),
            });
        };
        if let Some(k) = obj.keys().find(|k| !JSONL_FIELDS.contains(&k.as_str())) {
            return Err(TaskError::InvalidField {
                path: p(),
                at,
                field: k.clone(),
                message: format!(
                    "unknown field (valid: {}; put anything else in `metadata`)",
                    JSONL_FIELDS.join(", ")
                ),
            });
        }
        let invalid = |field: &str, message: &str| TaskError::InvalidField {
            path: p(),
            at,
            field: field.to_string(),
            message: message.to_string(),
        };
        let id = match obj.remove("id") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s),
            Some(Value::Number(n)) if n.is_i64() || n.is_u64() => Some(n.to_string()),
            Some(_) => return Err(invalid("id", "expected a string")),
        };
        let task_type = match obj.remove("task_type") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s),
            Some(_) => return Err(invalid("task_type", "expected a string")),
        };
        let prompt = match obj.remove("prompt") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s),
            Some(_) => return Err(invalid("prompt", "expected a string")),
        };
        let reference = match obj.remove("reference") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s,
            Some(Value::Number(n)) => n.to_string(),
            Some(_) => return Err(invalid("reference", "expected a string or a number")),
        };
        let metadata = obj.remove("metadata").unwrap_or(Value::Null);
        let task = build_task(path, at, id, task_type, prompt, reference, metadata)?;
        out.push((task, at));
    }
    Ok(out)
}

fn build_task(
    path: &Path,
    at: Location,
    id: Option<String>,
    task_type: Option<String>,
    prompt: Option<String>,
    reference: String,
    metadata: Value,
) -> Result<Task, TaskError> {
    let missing = |field| TaskError::MissingField {
        path: path.to_path_buf(),
        at,
        field,
    };
    let empty = |field| TaskError::EmptyField {
        path: path.to_path_buf(),
        at,
        field,
    };
    let id = id.ok_or_else(|| missing("id"))?;
    if id.trim().is_empty() {
        return Err(empty("id"));
    }
    let task_type = task_type.ok_or_else(|| missing("task_type"))?;
    let task_type = task_type
        .parse::<TaskType>()
        .map_err(|_| TaskError::UnknownTaskType {
            path: path.to_path_buf(),
            at,
            value: task_type.clone(),
        })?;
    let prompt = prompt.ok_or_else(|| missing("prompt"))?;
    if prompt.trim().is_empty() {
        return Err(empty("prompt"));
    }
    Ok(Task {
        id,
        task_type,
        prompt,
        reference,
        metadata,
    })
}

fn load_parquet(path: &Path) -> Result<Vec<(Task, Location)>, TaskError> {
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    let file = File::open(path).map_err(|source| TaskError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let perr = |e: &dyn fmt::Display| TaskError::Parquet {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    let reader = ParquetRecordBatchReaderBuilder::try_new(file)
        .map_err(|e| perr(&e))?
        .build()
        .map_err(|e| perr(&e))?;
    let schema = reader.schema();
    for column in ["id", "task_type", "prompt"] {
        if schema.index_of(column).is_err() {
            return Err(TaskError::MissingColumn {
                path: path.to_path_buf(),
                column,
            });
        }
    }
    let coltype = |column: &'static str, message: String| TaskError::ColumnType {
        path: path.to_path_buf(),
        column,
        message,
    };
    let mut out = Vec::new();
    let mut row0 = 0usize;
    for batch in reader {
        let batch = batch.map_err(|e| perr(&e))?;
        let text = |column: &'static str| -> Result<Option<arrow::array::StringArray>, TaskError> {
            columnar::column(&batch, column)
                .map(|c| {
                    if column == "id" {
                        columnar::as_utf8(c)
                    } else {
                        columnar::as_text(c)
                    }
                    .map_err(|m| coltype(column, m))
                })
                .transpose()
        };
        let ids = text("id")?.expect("checked above");
        let types = text("task_type")?.expect("checked above");
        let prompts = text("prompt")?.expect("checked above");
        let refs = text("reference")?;
        let meta = columnar::column(&batch, "metadata")
            .map(|c| columnar::JsonColumn::new(c).map_err(|m| coltype("metadata", m)))
            .transpose()?;
        for i in 0..batch.num_rows() {
            let at = Location::Row(row0 + i);
            let get = |a: &arrow::array::StringArray| a.is_valid(i).then(|| a.value(i).to_string());
            let metadata = match &meta {
                None => Value::Null,
                Some(m) => m.get(i).map_err(|message| TaskError::InvalidField {
                    path: path.to_path_buf(),
                    at,
                    field: "metadata".into(),
                    message,
                })?,
            };
            let reference = refs.as_ref().and_then(get).unwrap_or_default();
            let task = build_task(
                path,
                at,
                get(&ids),
                get(&types),
                get(&prompts),
                reference,
                metadata,
            )?;
            out.push((task, at));
        }
        row0 += batch.num_rows();
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use arrow::array::{ArrayRef, Int64Array, RecordBatch, StringArray};
    use parquet::arrow::ArrowWriter;

    fn write(dir: &tempfile::TempDir, name: &str, text: &str) -> PathBuf {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    const GOOD: &str = r#"{"id":"a","task_type":"math","prompt":"1+1?","reference":"2"}"#;

    #[test]
    fn task_type_round_trips() {
        for t in TaskType::ALL {
            assert_eq!(t.to_string().parse::<TaskType>().unwrap(), t);
            assert_eq!(
                serde_json::to_string(&t).unwrap(),
                format!("\"{}\"", t.as_str())
            );
        }
        assert_eq!(" Doc_Edit ".parse::<TaskType>().unwrap(), TaskType::DocEdit);
        let e = "essay".parse::<TaskType>().unwrap_err();
        assert!(e.to_string().contains("twenty_questions"), "{e}");
    }

    #[test]
    fn jsonl_loads_with_blank_lines_and_defaults() {
        let d = tempfile::tempdir().unwrap();
        let p = write(
            &d,
            "t.jsonl",
            &format!(
                "{GOOD}\n\n   \n{}\n",
                r#"{"id":7,"task_type":"code","prompt":"write f","metadata":{"tests":"x"}}"#
            ),
        );
        let tasks = load_tasks(&p).unwrap();
        assert_eq!(tasks.len(), 2);
        assert_eq!(tasks[0].reference, "2");
        assert_eq!(tasks[0].metadata, Value::Null);
        assert_eq!(tasks[1].id, "7");
        assert_eq!(tasks[1].reference, "");
        assert_eq!(tasks[1].metadata["tests"], "x");
    }

    fn err_of(name: &str, text: &str) -> (TaskError, String) {
        let d = tempfile::tempdir().unwrap();
        let p = write(&d, name, text);
        let e = load_tasks(&p).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains(name), "error must name the file: {msg}");
        (e, msg)
    }

    #[test]
    fn missing_and_empty_prompt() {
        let (e, msg) = err_of(
            "p.jsonl",
            &format!("{GOOD}\n{}", r#"{"id":"b","task_type":"math"}"#),
        );
        assert!(matches!(
            e,
            TaskError::MissingField {
                at: Location::Line(2),
                field: "prompt",
                ..
            }
        ));
        assert!(msg.contains("line 2") && msg.contains("prompt"), "{msg}");
        let (e, _) = err_of("p.jsonl", r#"{"id":"b","task_type":"math","prompt":"  "}"#);
        assert!(matches!(
            e,
            TaskError::EmptyField {
                at: Location::Line(1),
                field: "prompt",
                ..
            }
        ));
    }

    #[test]
    fn unknown_task_type_lists_valid_ones() {
        let (e, msg) = err_of("t.jsonl", r#"{"id":"b","task_type":"essay","prompt":"x"}"#);
        assert!(matches!(e, TaskError::UnknownTaskType { ref value, .. } if value == "essay"));
        for v in ["math", "doc_edit", "code", "twenty_questions", "line 1"] {
            assert!(msg.contains(v), "{msg}");
        }
    }

    #[test]
    fn missing_id_and_duplicate_id() {
        let (e, _) = err_of("i.jsonl", r#"{"task_type":"math","prompt":"x"}"#);
        assert!(matches!(
            e,
            TaskError::MissingField {
                field: "id",
                at: Location::Line(1),
                ..
            }
        ));
        let (e, msg) = err_of("i.jsonl", &format!("{GOOD}\n\n{GOOD}\n"));
        assert!(matches!(
            e,
            TaskError::DuplicateId {
                first: Location::Line(1),
                second: Location::Line(3),
                ..
            }
        ));
        assert!(
            msg.contains("line 1") && msg.contains("line 3") && msg.contains("`a`"),
            "{msg}"
        );
    }

    #[test]
    fn malformed_json_names_line() {
        let (e, msg) = err_of("m.jsonl", &format!("{GOOD}\n{{\"id\": \"b\",\n"));
        assert!(matches!(e, TaskError::MalformedJson { line: 2, .. }));
        assert!(msg.contains("line 2") && msg.contains("EOF"), "{msg}");
        let (e, _) = err_of("m.jsonl", "[1,2]\n");
        assert!(matches!(e, TaskError::MalformedJson { line: 1, .. }));
    }

    #[test]
    fn unknown_field_is_an_error() {
        let (e, msg) = err_of(
            "u.jsonl",
            r#"{"id":"a","task_type":"math","prompt":"x","refrence":"2"}"#,
        );
        assert!(matches!(e, TaskError::InvalidField { ref field, .. } if field == "refrence"));
        assert!(msg.contains("refrence"), "{msg}");
    }

    #[test]
    fn unreadable_and_unsupported() {
        let d = tempfile::tempdir().unwrap();
        let missing = d.path().join("nope.jsonl");
        let e = load_tasks(&missing).unwrap_err();
        assert!(matches!(e, TaskError::Read { .. }));
        assert!(e.to_string().contains("nope.jsonl"));
        let p = write(&d, "tasks.csv", "id,prompt\n");
        let e = load_tasks(&p).unwrap_err();
        assert!(matches!(e, TaskError::UnsupportedExtension { .. }));
        assert!(e.to_string().contains("tasks.csv"));
        let p = write(&d, "bad.parquet", "not parquet at all");
        let e = load_tasks(&p).unwrap_err();
        assert!(matches!(e, TaskError::Parquet { .. }), "{e}");
    }

    fn write_parquet(path: &Path, cols: Vec<(&str, ArrayRef)>) {
        let batch = RecordBatch::try_from_iter(cols).unwrap();
        let mut w =
            ArrowWriter::try_new(File::create(path).unwrap(), batch.schema(), None).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
    }

    fn strs(v: &[Option<&str>]) -> ArrayRef {
        Arc::new(StringArray::from(v.to_vec()))
    }

    #[test]
    fn parquet_round_trip() {
        let d = tempfile::tempdir().unwrap();
        let tasks = vec![
            Task {
                id: "math-1".into(),
                task_type: TaskType::Math,
                prompt: "What is 6*7?".into(),
                reference: "42".into(),
                metadata: serde_json::json!({"level": 1}),
            },
            Task {
                id: "doc-1".into(),
                task_type: TaskType::DocEdit,
                prompt: "Write a note.".into(),
                reference: String::new(),
                metadata: Value::Null,
            },
        ];
        let p = d.path().join("t.parquet");
        write_parquet(
            &p,
            vec![
                ("id", strs(&[Some("math-1"), Some("doc-1")])),
                ("task_type", strs(&[Some("math"), Some("doc_edit")])),
                (
                    "prompt",
                    strs(&[Some("What is 6*7?"), Some("Write a note.")]),
                ),
                ("reference", strs(&[Some("42"), None])),
                ("metadata", strs(&[Some(r#"{"level": 1}"#), None])),
                ("extra", strs(&[Some("ignored"), None])),
            ],
        );
        assert_eq!(load_tasks(&p).unwrap(), tasks);

        // JSONL round trip through the writer, too.
        let j = d.path().join("t.jsonl");
        write_tasks_jsonl(&j, &tasks).unwrap();
        assert_eq!(load_tasks(&j).unwrap(), tasks);
        let only_tmp: Vec<_> = std::fs::read_dir(d.path())
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .contains(".tmp")
            })
            .collect();
        assert!(only_tmp.is_empty(), "temporary file left behind");
    }

    #[test]
    fn parquet_integer_ids_no_reference_no_metadata() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("t.parquet");
        write_parquet(
            &p,
            vec![
                ("id", Arc::new(Int64Array::from(vec![1, 2])) as ArrayRef),
                ("task_type", strs(&[Some("code"), Some("math")])),
                ("prompt", strs(&[Some("a"), Some("b")])),
            ],
        );
        let t = load_tasks(&p).unwrap();
        assert_eq!(t[0].id, "1");
        assert_eq!(t[1].reference, "");
        assert_eq!(t[1].metadata, Value::Null);
    }

    #[test]
    fn parquet_errors_name_column_and_row() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("t.parquet");
        write_parquet(
            &p,
            vec![
                ("id", strs(&[Some("a")])),
                ("task_type", strs(&[Some("math")])),
            ],
        );
        let e = load_tasks(&p).unwrap_err();
        assert!(
            matches!(
                e,
                TaskError::MissingColumn {
                    column: "prompt",
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("`prompt`") && e.to_string().contains("t.parquet"));

        write_parquet(
            &p,
            vec![
                ("id", strs(&[Some("a"), Some("b"), Some("a")])),
                (
                    "task_type",
                    strs(&[Some("math"), Some("math"), Some("math")]),
                ),
                ("prompt", strs(&[Some("x"), Some("y"), Some("z")])),
            ],
        );
        let e = load_tasks(&p).unwrap_err();
        assert!(matches!(
            e,
            TaskError::DuplicateId {
                first: Location::Row(0),
                second: Location::Row(2),
                ..
            }
        ));

        write_parquet(
            &p,
            vec![
                ("id", strs(&[Some("a"), None])),
                ("task_type", strs(&[Some("math"), Some("math")])),
                ("prompt", strs(&[Some("x"), Some("y")])),
            ],
        );
        let e = load_tasks(&p).unwrap_err();
        assert!(matches!(
            e,
            TaskError::MissingField {
                field: "id",
                at: Location::Row(1),
                ..
            }
        ));
        assert!(e.to_string().contains("row 1"), "{e}");

        write_parquet(
            &p,
            vec![
                ("id", strs(&[Some("a")])),
                ("task_type", strs(&[Some("poetry")])),
                ("prompt", strs(&[Some("x")])),
            ],
        );
        let e = load_tasks(&p).unwrap_err();
        assert!(matches!(
            e,
            TaskError::UnknownTaskType {
                at: Location::Row(0),
                ..
            }
        ));

        write_parquet(
            &p,
            vec![
                ("id", strs(&[Some("a")])),
                ("task_type", strs(&[Some("math")])),
                ("prompt", strs(&[Some("x")])),
                ("metadata", strs(&[Some("{not json")])),
            ],
        );
        let e = load_tasks(&p).unwrap_err();
        assert!(
            matches!(e, TaskError::InvalidField { ref field, at: Location::Row(0), .. } if field == "metadata"),
            "{e}"
        );

        write_parquet(
            &p,
            vec![
                ("id", strs(&[Some("a")])),
                ("task_type", strs(&[Some("math")])),
                ("prompt", Arc::new(Int64Array::from(vec![3])) as ArrayRef),
            ],
        );
        let e = load_tasks(&p).unwrap_err();
        assert!(
            matches!(
                e,
                TaskError::ColumnType {
                    column: "prompt",
                    ..
                }
            ),
            "{e}"
        );
    }
}
