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
//! | `single_turn_metadata` | `Struct` of the metadata keys (union over the file's rows) |
//! | `turn_id` | `Int64` |
//! | `sessions` | `List<List<Struct<content, role>>>` — each simulated future |
//! | `rewards` | `Struct<MR: List<Float64>, <metric>: List<Float64>, …>` — per session |
//!
//! The last three are nested, as upstream published them, so that `datasets` users index
//! `row["rewards"]["MR"]` without parsing. Their arrow type is inferred from the rows (see
//! [`JsonShape`]): a key missing in a row is null there, integers mixed with floats are
//! floats, and a value whose kind conflicts across rows is stored as JSON text at that spot.
//! A column with no object or list at all (e.g. no task has metadata) is stored as JSON text.
//!
//! The reader accepts what upstream published (`conv_id` as an integer) and both encodings of
//! the last three columns: nested arrow values (structs, lists, maps, primitives) and JSON text
//! (what earlier versions of this tool wrote), converted to JSON.

use std::path::Path;
use std::sync::Arc;

use arrow::array::{
    Array as _, ArrayRef, Float64Array, Int64Array, RecordBatch, RecordBatchReader as _,
    StringArray,
};
use arrow::datatypes::{Field, Schema};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{open, write_batch, Ctx, DatasetError};
use crate::dataset::columnar::{self, JsonColumn, JsonShape, MessagesColumn};
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

fn json_text(values: &[&Value]) -> ArrayRef {
    // Serializing a `serde_json::Value` cannot fail (its map keys are strings).
    Arc::new(StringArray::from_iter_values(
        values
            .iter()
            .map(|v| serde_json::to_string(v).expect("Value serializes")),
    ))
}

/// One JSON-valued column: nested when the rows hold objects or lists, else JSON text.
fn json_column(rows: &[FlatRow], f: impl Fn(&FlatRow) -> &Value) -> ArrayRef {
    let values: Vec<&Value> = rows.iter().map(f).collect();
    json_values_array(&values)
}

/// JSON values as one arrow column, typed as upstream's flat files type them: nested
/// (structs, lists) when the values hold objects or lists, else JSON text.
pub(crate) fn json_values_array(values: &[&Value]) -> ArrayRef {
    let shape = JsonShape::of_values(values.iter().copied());
    if shape.is_nested() {
        shape.array(values)
    } else {
        json_text(values)
    }
}

/// Writes flat rows in the upstream schema (module docs), atomically, snappy-compressed.
pub fn write_flat_parquet(path: &Path, rows: &[FlatRow]) -> Result<(), DatasetError> {
    let ctx = Ctx { path };
    let text = |f: fn(&FlatRow) -> &str| -> ArrayRef {
        Arc::new(StringArray::from_iter_values(rows.iter().map(f)))
    };
    let columns: Vec<(&str, ArrayRef)> = vec![
        (
            "prompt",
            columnar::messages_array(rows.iter().map(|r| r.prompt.as_slice())),
        ),
        ("completion", text(|r| &r.completion)),
        ("conv_id", text(|r| &r.conv_id)),
        (
            "score",
            Arc::new(Float64Array::from_iter_values(rows.iter().map(|r| r.score))),
        ),
        ("single_turn_prompt", text(|r| &r.single_turn_prompt)),
        (
            "single_turn_completion",
            text(|r| &r.single_turn_completion),
        ),
        (
            "single_turn_metadata",
            json_column(rows, |r| &r.single_turn_metadata),
        ),
        (
            "turn_id",
            Arc::new(Int64Array::from_iter_values(
                rows.iter().map(|r| i64::from(r.turn_id)),
            )),
        ),
        ("sessions", json_column(rows, |r| &r.sessions)),
        ("rewards", json_column(rows, |r| &r.rewards)),
    ];
    // Every field nullable, as pyarrow writes them.
    let schema = Schema::new(
        columns
            .iter()
            .map(|(name, a)| Field::new(*name, a.data_type().clone(), true))
            .collect::<Vec<_>>(),
    );
    let batch = RecordBatch::try_new(
        Arc::new(schema),
        columns.into_iter().map(|(_, a)| a).collect(),
    )
    .map_err(|e| ctx.parquet(e))?;
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
    use arrow::datatypes::{DataType, Fields};
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

    fn file_schema(p: &Path) -> arrow::datatypes::SchemaRef {
        ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(p).unwrap())
            .unwrap()
            .schema()
            .clone()
    }

    #[test]
    fn round_trip_in_the_upstream_nested_schema() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("flat.parquet");
        let mut rows = vec![flat("0", 0, 0.5), flat("0", 1, -0.25), flat("9", 0, 1.0)];
        rows[2].single_turn_metadata = Value::Null;
        write_flat_parquet(&p, &rows).unwrap();
        assert_eq!(read_flat_parquet(&p).unwrap(), rows);

        let schema = file_schema(&p);
        let names: Vec<_> = schema.fields().iter().map(|f| f.name().clone()).collect();
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
        // Lists name their items `element`, as pyarrow writes upstream's files.
        let list = |t: DataType| DataType::List(Arc::new(Field::new("element", t, true)));
        let strukt = |fields: Vec<(&str, DataType)>| {
            DataType::Struct(
                fields
                    .into_iter()
                    .map(|(n, t)| Field::new(n, t, true))
                    .collect(),
            )
        };
        let ty = |name: &str| schema.field_with_name(name).unwrap().data_type().clone();
        assert_eq!(
            ty("prompt"),
            list(DataType::Struct(columnar::message_struct_fields()))
        );
        assert_eq!(
            ty("single_turn_metadata"),
            strukt(vec![("level", DataType::Utf8), ("type", DataType::Utf8)])
        );
        assert_eq!(
            ty("sessions"),
            list(list(strukt(vec![
                ("content", DataType::Utf8),
                ("role", DataType::Utf8)
            ])))
        );
        assert_eq!(
            ty("rewards"),
            strukt(vec![
                ("accuracy", list(DataType::Float64)),
                ("token_amount", list(DataType::Float64))
            ])
        );
    }

    /// Values that fit no single nested shape are kept exactly, as JSON text.
    #[test]
    fn conflicting_shapes_fall_back_to_json_text() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("flat.parquet");
        let mut rows = vec![flat("0", 0, 0.5), flat("9", 0, 1.0)];
        rows[1].sessions = json!("plain string");
        rows[0].single_turn_metadata = json!("just text");
        rows[1].single_turn_metadata = Value::Null;
        write_flat_parquet(&p, &rows).unwrap();
        assert_eq!(read_flat_parquet(&p).unwrap(), rows);
        let schema = file_schema(&p);
        for name in ["sessions", "single_turn_metadata"] {
            assert_eq!(
                schema.field_with_name(name).unwrap().data_type(),
                &DataType::Utf8,
                "{name}"
            );
        }
        assert!(schema
            .field_with_name("rewards")
            .unwrap()
            .data_type()
            .is_nested());
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
