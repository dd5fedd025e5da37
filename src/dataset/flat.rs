//! The upstream CollabLLM flat schema (the public `collabllm/collabllm-multiturn-*` datasets):
//! one row per (conversation, turn, candidate) with the candidate's score.
//!
//! Columns written, in upstream order:
//!
//! | column | arrow type |
//! |---|---|
//! | `prompt` | `List<Struct<role: Utf8, content: Utf8>>` — history up to the candidate |
//! | `completion` | `Utf8` — the candidate reply |
//! | `conv_id` | `Utf8` |
//! | `score` | `Float64` — the candidate's multiturn-aware reward |
//! | `single_turn_prompt` | `Utf8` — the hidden goal `q` |
//! | `single_turn_completion` | `Utf8` — the reference `a` |
//! | `single_turn_metadata` | `Utf8`, JSON text |
//! | `turn_id` | `Int64` |
//! | `sessions` | `Utf8`, JSON text |
//! | `rewards` | `Utf8`, JSON text |
//!
//! Why JSON text for the last three: their nested shapes vary per task type and per metric set
//! (code tasks carry test code and library lists, math a level and a type; `rewards` has one key
//! per configured metric; `sessions` holds the simulated futures). A parquet column needs one
//! fixed type for the whole file, so nested structs would force every row into the union of all
//! shapes (nulls everywhere), and two files made with different metrics could no longer be
//! concatenated. JSON text keeps every row exact and every file compatible; `json.loads` restores
//! it on the Python side.
//!
//! The reader also accepts what upstream published: `conv_id` as an integer, and these three
//! columns as nested arrow values (structs, lists, maps, primitives), converted to JSON.

use std::path::Path;
use std::sync::Arc;

use arrow::array::{
    Array as _, ArrayRef, Float64Array, Int64Array, RecordBatch, RecordBatchReader as _,
    StringArray,
};
use arrow::datatypes::{DataType, Field, Schema};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{open, write_batch, Ctx, DatasetError};
use crate::columnar::{self, JsonColumn, MessagesColumn};
use crate::llm::ChatMessage;

/// One upstream flat row: candidate `completion` at turn `turn_id` of `conv_id`, after `prompt`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FlatRow {
    pub prompt: Vec<ChatMessage>,
    pub completion: String,
    pub conv_id: String,
    pub turn_id: u32,
    pub score: f64,
    pub single_turn_prompt: String,
    pub single_turn_completion: String,
    pub single_turn_metadata: Value,
    pub sessions: Value,
    pub rewards: Value,
}

/// The exact arrow schema [`write_flat_parquet`] writes (every field nullable, as pyarrow).
pub fn flat_schema() -> Schema {
    Schema::new(vec![
        Field::new("prompt", columnar::messages_type(), true),
        Field::new("completion", DataType::Utf8, true),
        Field::new("conv_id", DataType::Utf8, true),
        Field::new("score", DataType::Float64, true),
        Field::new("single_turn_prompt", DataType::Utf8, true),
        Field::new("single_turn_completion", DataType::Utf8, true),
        Field::new("single_turn_metadata", DataType::Utf8, true),
        Field::new("turn_id", DataType::Int64, true),
        Field::new("sessions", DataType::Utf8, true),
        Field::new("rewards", DataType::Utf8, true),
    ])
}

fn json_text(rows: &[FlatRow], f: impl Fn(&FlatRow) -> &Value) -> ArrayRef {
    // Serializing a `serde_json::Value` cannot fail (its map keys are strings).
    Arc::new(StringArray::from_iter_values(
        rows.iter()
            .map(|r| serde_json::to_string(f(r)).expect("Value serializes")),
    ))
}

/// Writes flat rows (schema: [`flat_schema`]), atomically, snappy-compressed.
pub fn write_flat_parquet(path: &Path, rows: &[FlatRow]) -> Result<(), DatasetError> {
    let ctx = Ctx { path };
    let text = |f: fn(&FlatRow) -> &str| -> ArrayRef {
        Arc::new(StringArray::from_iter_values(rows.iter().map(f)))
    };
    let columns: Vec<ArrayRef> = vec![
        columnar::messages_array(rows.iter().map(|r| r.prompt.as_slice())),
        text(|r| &r.completion),
        text(|r| &r.conv_id),
        Arc::new(Float64Array::from_iter_values(rows.iter().map(|r| r.score))),
        text(|r| &r.single_turn_prompt),
        text(|r| &r.single_turn_completion),
        json_text(rows, |r| &r.single_turn_metadata),
        Arc::new(Int64Array::from_iter_values(
            rows.iter().map(|r| i64::from(r.turn_id)),
        )),
        json_text(rows, |r| &r.sessions),
        json_text(rows, |r| &r.rewards),
    ];
    let batch =
        RecordBatch::try_new(Arc::new(flat_schema()), columns).map_err(|e| ctx.parquet(e))?;
    write_batch(path, &batch)
}

/// Reads flat rows written by [`write_flat_parquet`] or published upstream.
///
/// Required: `prompt` (conversational list, or a plain string → one user message),
/// `completion`, `conv_id` (string or integer), `turn_id` (integer), `score` (numeric).
/// Optional: `single_turn_prompt`/`single_turn_completion` (absent or null → ""),
/// `single_turn_metadata`/`sessions`/`rewards` (JSON text or nested arrow values; absent or
/// null → JSON null). Other columns are ignored.
pub fn read_flat_parquet(path: &Path) -> Result<Vec<FlatRow>, DatasetError> {
    let ctx = Ctx { path };
    let reader = open(path)?;
    let schema = reader.schema();
    for c in ["prompt", "completion", "conv_id", "turn_id", "score"] {
        if schema.index_of(c).is_err() {
            return Err(ctx.missing(c));
        }
    }
    let mut out = Vec::new();
    for batch in reader {
        let batch = batch.map_err(|e| ctx.parquet(e))?;
        let row0 = out.len();
        let prompt = MessagesColumn::new(ctx.required(&batch, "prompt")?, "user")
            .map_err(|m| ctx.coltype("prompt", m))?;
        let text = |name: &'static str| -> Result<Option<StringArray>, DatasetError> {
            columnar::column(&batch, name)
                .map(|c| columnar::as_text(c).map_err(|m| ctx.coltype(name, m)))
                .transpose()
        };
        let completion = text("completion")?.expect("checked above");
        let st_prompt = text("single_turn_prompt")?;
        let st_completion = text("single_turn_completion")?;
        let conv_id = columnar::as_utf8(ctx.required(&batch, "conv_id")?)
            .map_err(|m| ctx.coltype("conv_id", m))?;
        let turn_id = columnar::as_i64(ctx.required(&batch, "turn_id")?)
            .map_err(|m| ctx.coltype("turn_id", m))?;
        let score = columnar::as_f64(ctx.required(&batch, "score")?)
            .map_err(|m| ctx.coltype("score", m))?;
        let json = |name: &'static str| -> Result<Option<JsonColumn>, DatasetError> {
            columnar::column(&batch, name)
                .map(|c| JsonColumn::new(c).map_err(|m| ctx.coltype(name, m)))
                .transpose()
        };
        let metadata = json("single_turn_metadata")?;
        let sessions = json("sessions")?;
        let rewards = json("rewards")?;
        for i in 0..batch.num_rows() {
            let row = row0 + i;
            let req_text = |a: &StringArray, name: &'static str| {
                if a.is_valid(i) {
                    Ok(a.value(i).to_string())
                } else {
                    Err(ctx.invalid(name, row, "null"))
                }
            };
            let opt_text = |a: &Option<StringArray>| match a {
                Some(a) if a.is_valid(i) => a.value(i).to_string(),
                _ => String::new(),
            };
            let json_at = |c: &Option<JsonColumn>, name: &'static str| match c {
                None => Ok(Value::Null),
                Some(c) => c.get(i).map_err(|m| ctx.invalid(name, row, m)),
            };
            if score.is_null(i) {
                return Err(ctx.invalid("score", row, "null"));
            }
            out.push(FlatRow {
                prompt: prompt
                    .get(i)
                    .map_err(|m| ctx.invalid("prompt", row, m))?
                    .ok_or_else(|| ctx.invalid("prompt", row, "null"))?,
                completion: req_text(&completion, "completion")?,
                conv_id: req_text(&conv_id, "conv_id")?,
                turn_id: ctx.turn_id(&turn_id, "turn_id", row, i)?,
                score: score.value(i),
                single_turn_prompt: opt_text(&st_prompt),
                single_turn_completion: opt_text(&st_completion),
                single_turn_metadata: json_at(&metadata, "single_turn_metadata")?,
                sessions: json_at(&sessions, "sessions")?,
                rewards: json_at(&rewards, "rewards")?,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{BooleanArray, Float32Array, ListArray, StructArray};
    use arrow::buffer::OffsetBuffer;
    use arrow::datatypes::Fields;
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    use parquet::arrow::ArrowWriter;
    use serde_json::json;

    fn flat(conv: &str, turn: u32, score: f64) -> FlatRow {
        FlatRow {
            prompt: vec![ChatMessage::user("help me with a sum")],
            completion: "Which numbers?".into(),
            conv_id: conv.into(),
            turn_id: turn,
            score,
            single_turn_prompt: "What is 2+3?".into(),
            single_turn_completion: "5".into(),
            single_turn_metadata: json!({"level": "Level 1", "type": "Algebra"}),
            sessions: json!([[{"role": "user", "content": "2 and 3"}]]),
            rewards: json!({"accuracy": [1.0, 0.0, 1.0], "token_amount": [0.1, 0.2, 0.1]}),
        }
    }

    #[test]
    fn round_trip_and_schema() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("flat.parquet");
        let mut rows = vec![flat("0", 0, 0.5), flat("0", 1, -0.25), flat("9", 0, 1.0)];
        rows[2].single_turn_metadata = Value::Null;
        rows[2].sessions = json!("plain string");
        write_flat_parquet(&p, &rows).unwrap();
        assert_eq!(read_flat_parquet(&p).unwrap(), rows);

        let b = ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(&p).unwrap()).unwrap();
        assert_eq!(b.schema().fields(), flat_schema().fields());
        let names: Vec<_> = b
            .schema()
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .collect();
        assert_eq!(
            names,
            [
                "prompt",
                "completion",
                "conv_id",
                "score",
                "single_turn_prompt",
                "single_turn_completion",
                "single_turn_metadata",
                "turn_id",
                "sessions",
                "rewards"
            ]
        );
    }

    /// Upstream-style file: integer conv_id, nested struct metadata, list-of-struct sessions,
    /// struct-of-lists rewards, large strings.
    #[test]
    fn reads_upstream_nested_columns() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("upstream.parquet");
        let prompt = columnar::messages_array(
            [vec![ChatMessage::user("hi")], vec![ChatMessage::user("yo")]]
                .iter()
                .map(|v| v.as_slice()),
        );
        let meta = StructArray::new(
            Fields::from(vec![
                Field::new("level", DataType::Utf8, true),
                Field::new("hard", DataType::Boolean, true),
            ]),
            vec![
                Arc::new(StringArray::from(vec![Some("Level 5"), None])) as ArrayRef,
                Arc::new(BooleanArray::from(vec![true, false])),
            ],
            None,
        );
        let rewards = StructArray::new(
            Fields::from(vec![Field::new(
                "accuracy",
                DataType::List(Arc::new(Field::new_list_field(DataType::Float32, true))),
                true,
            )]),
            vec![Arc::new(ListArray::new(
                Arc::new(Field::new_list_field(DataType::Float32, true)),
                OffsetBuffer::from_lengths([2, 1]),
                Arc::new(Float32Array::from(vec![1.0, 0.5, 0.0])),
                None,
            )) as ArrayRef],
            None,
        );
        let batch = RecordBatch::try_from_iter(vec![
            ("prompt", prompt),
            (
                "completion",
                Arc::new(arrow::array::LargeStringArray::from(vec!["a", "b"])) as ArrayRef,
            ),
            ("conv_id", Arc::new(Int64Array::from(vec![3, 4]))),
            ("score", Arc::new(Float32Array::from(vec![0.5, 1.0]))),
            (
                "single_turn_prompt",
                Arc::new(StringArray::from(vec!["q1", "q2"])),
            ),
            ("single_turn_metadata", Arc::new(meta)),
            (
                "turn_id",
                Arc::new(arrow::array::Int32Array::from(vec![1, 2])),
            ),
            ("rewards", Arc::new(rewards)),
        ])
        .unwrap();
        let mut w =
            ArrowWriter::try_new(std::fs::File::create(&p).unwrap(), batch.schema(), None).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();

        let rows = read_flat_parquet(&p).unwrap();
        assert_eq!(rows[0].conv_id, "3");
        assert_eq!(rows[1].turn_id, 2);
        assert_eq!(rows[0].completion, "a");
        assert_eq!(rows[0].single_turn_completion, "");
        assert_eq!(
            rows[0].single_turn_metadata,
            json!({"level": "Level 5", "hard": true})
        );
        assert_eq!(
            rows[1].single_turn_metadata,
            json!({"level": null, "hard": false})
        );
        assert_eq!(rows[0].rewards, json!({"accuracy": [1.0, 0.5]}));
        assert_eq!(rows[1].rewards, json!({"accuracy": [0.0]}));
        assert_eq!(rows[0].sessions, Value::Null);
    }

    #[test]
    fn errors_name_column_and_row() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f.parquet");
        let rows = [flat("a", 0, 0.0)];
        // Corrupt JSON text in `rewards` (written by hand).
        let prompt = columnar::messages_array(rows.iter().map(|r| r.prompt.as_slice()));
        let batch = RecordBatch::try_from_iter(vec![
            ("prompt", prompt),
            (
                "completion",
                Arc::new(StringArray::from(vec!["x"])) as ArrayRef,
            ),
            ("conv_id", Arc::new(StringArray::from(vec!["a"]))),
            ("score", Arc::new(Float64Array::from(vec![0.0]))),
            ("turn_id", Arc::new(Int64Array::from(vec![0]))),
            ("rewards", Arc::new(StringArray::from(vec!["{oops"]))),
        ])
        .unwrap();
        let mut w =
            ArrowWriter::try_new(std::fs::File::create(&p).unwrap(), batch.schema(), None).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
        let e = read_flat_parquet(&p).unwrap_err();
        assert!(
            matches!(
                e,
                DatasetError::InvalidValue {
                    column: "rewards",
                    row: 0,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("f.parquet"));

        // Unconvertible nested type names the column.
        let batch = RecordBatch::try_from_iter(vec![
            ("prompt", Arc::new(StringArray::from(vec!["q"])) as ArrayRef),
            ("completion", Arc::new(StringArray::from(vec!["x"]))),
            ("conv_id", Arc::new(StringArray::from(vec!["a"]))),
            ("score", Arc::new(Float64Array::from(vec![0.0]))),
            ("turn_id", Arc::new(Int64Array::from(vec![0]))),
            (
                "sessions",
                Arc::new(arrow::array::BinaryArray::from(vec![b"xx".as_slice()])),
            ),
        ])
        .unwrap();
        let mut w =
            ArrowWriter::try_new(std::fs::File::create(&p).unwrap(), batch.schema(), None).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
        let e = read_flat_parquet(&p).unwrap_err();
        assert!(
            matches!(
                e,
                DatasetError::ColumnType {
                    column: "sessions",
                    ..
                }
            ),
            "{e}"
        );

        let batch = RecordBatch::try_from_iter(vec![
            ("prompt", Arc::new(StringArray::from(vec!["q"])) as ArrayRef),
            ("completion", Arc::new(StringArray::from(vec!["x"]))),
            ("conv_id", Arc::new(StringArray::from(vec!["a"]))),
            ("turn_id", Arc::new(Int64Array::from(vec![0]))),
        ])
        .unwrap();
        let mut w =
            ArrowWriter::try_new(std::fs::File::create(&p).unwrap(), batch.schema(), None).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
        let e = read_flat_parquet(&p).unwrap_err();
        assert!(
            matches!(
                e,
                DatasetError::MissingColumn {
                    column: "score",
                    ..
                }
            ),
            "{e}"
        );
    }
}
