//! DPO preference pairs in TRL's conversational format, and the split of pairs into
//! train/test **by conversation**.
//!
//! Schema written (every field nullable, as `datasets`/pyarrow writes it; list items are named
//! `item`; struct fields in the order role, content):
//!
//! | column | arrow type |
//! |---|---|
//! | `prompt` | `List<Struct<role: Utf8, content: Utf8>>` — history, optional system message first |
//! | `chosen` | `List<Struct<role: Utf8, content: Utf8>>` — the one assistant message |
//! | `rejected` | `List<Struct<role: Utf8, content: Utf8>>` — the one assistant message |
//! | `score_chosen` | `Float64` |
//! | `score_rejected` | `Float64` |
//! | `conv_id` | `Utf8` |
//! | `turn_id` | `Int64` |

use std::collections::{BTreeSet, HashSet};
use std::path::Path;
use std::sync::Arc;

use arrow::array::{
    Array as _, ArrayRef, Float64Array, Int64Array, RecordBatch, RecordBatchReader as _,
    StringArray,
};
use arrow::datatypes::{DataType, Field, Schema};
use serde::{Deserialize, Serialize};

use super::{open, write_batch, Ctx, DatasetError};
use crate::dataset::columnar::{self, MessagesColumn};
use crate::llm::ChatMessage;

/// One preference pair: at turn `turn_id` of conversation `conv_id`, after `prompt`, `chosen`
/// scored `score_chosen` (multiturn-aware reward) and `rejected` scored `score_rejected`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PairRow {
    pub prompt: Vec<ChatMessage>,
    pub chosen: Vec<ChatMessage>,
    pub rejected: Vec<ChatMessage>,
    pub score_chosen: f64,
    pub score_rejected: f64,
    pub conv_id: String,
    pub turn_id: u32,
}

/// The exact arrow schema [`write_pairs_parquet`] writes.
pub fn pairs_schema() -> Schema {
    Schema::new(vec![
        Field::new("prompt", columnar::messages_type(), true),
        Field::new("chosen", columnar::messages_type(), true),
        Field::new("rejected", columnar::messages_type(), true),
        Field::new("score_chosen", DataType::Float64, true),
        Field::new("score_rejected", DataType::Float64, true),
        Field::new("conv_id", DataType::Utf8, true),
        Field::new("turn_id", DataType::Int64, true),
    ])
}

/// Writes `rows` as TRL conversational-format parquet (schema: [`pairs_schema`]), atomically,
/// snappy-compressed.
pub fn write_pairs_parquet(path: &Path, rows: &[PairRow]) -> Result<(), DatasetError> {
    let ctx = Ctx { path };
    let columns: Vec<ArrayRef> = vec![
        columnar::messages_array(rows.iter().map(|r| r.prompt.as_slice())),
        columnar::messages_array(rows.iter().map(|r| r.chosen.as_slice())),
        columnar::messages_array(rows.iter().map(|r| r.rejected.as_slice())),
        Arc::new(Float64Array::from_iter_values(
            rows.iter().map(|r| r.score_chosen),
        )),
        Arc::new(Float64Array::from_iter_values(
            rows.iter().map(|r| r.score_rejected),
        )),
        Arc::new(StringArray::from_iter_values(
            rows.iter().map(|r| r.conv_id.as_str()),
        )),
        Arc::new(Int64Array::from_iter_values(
            rows.iter().map(|r| i64::from(r.turn_id)),
        )),
    ];
    let batch =
        RecordBatch::try_new(Arc::new(pairs_schema()), columns).map_err(|e| ctx.parquet(e))?;
    write_batch(path, &batch)
}

/// Reads pairs written by [`write_pairs_parquet`] or by other TRL tooling.
///
/// - `prompt`, `chosen`, `rejected` (required): conversational (`list<struct<role, content>>`,
///   any field order, `List` or `LargeList`) or TRL's *standard* form (plain strings: the prompt
///   becomes one user message, chosen/rejected one assistant message each).
/// - `score_chosen`, `score_rejected`: any numeric type; absent or null → NaN.
/// - `conv_id`: string or integer; absent → the row index (each row its own conversation, which
///   is right for datasets of independent prompts).
/// - `turn_id`: any integer type in `u32` range; absent → 0.
pub fn read_pairs_parquet(path: &Path) -> Result<Vec<PairRow>, DatasetError> {
    let ctx = Ctx { path };
    let reader = open(path)?;
    let schema = reader.schema();
    for c in ["prompt", "chosen", "rejected"] {
        if schema.index_of(c).is_err() {
            return Err(ctx.missing(c));
        }
    }
    let mut out = Vec::new();
    for batch in reader {
        let batch = batch.map_err(|e| ctx.parquet(e))?;
        let row0 = out.len();
        let msgs = |name: &'static str, role: &'static str| {
            MessagesColumn::new(ctx.required(&batch, name)?, role).map_err(|m| ctx.coltype(name, m))
        };
        let prompt = msgs("prompt", "user")?;
        let chosen = msgs("chosen", "assistant")?;
        let rejected = msgs("rejected", "assistant")?;
        let score = |name: &'static str| {
            columnar::column(&batch, name)
                .map(|c| columnar::as_f64(c).map_err(|m| ctx.coltype(name, m)))
                .transpose()
        };
        let score_chosen = score("score_chosen")?;
        let score_rejected = score("score_rejected")?;
        let conv_id = columnar::column(&batch, "conv_id")
            .map(|c| columnar::as_utf8(c).map_err(|m| ctx.coltype("conv_id", m)))
            .transpose()?;
        let turn_id = columnar::column(&batch, "turn_id")
            .map(|c| columnar::as_i64(c).map_err(|m| ctx.coltype("turn_id", m)))
            .transpose()?;
        for i in 0..batch.num_rows() {
            let row = row0 + i;
            let get_msgs = |col: &MessagesColumn, name: &'static str| {
                col.get(i)
                    .map_err(|m| ctx.invalid(name, row, m))?
                    .ok_or_else(|| ctx.invalid(name, row, "null"))
            };
            let f = |a: &Option<Float64Array>| match a {
                Some(a) if a.is_valid(i) => a.value(i),
                _ => f64::NAN,
            };
            let conv_id = match &conv_id {
                None => row.to_string(),
                Some(a) if a.is_valid(i) => a.value(i).to_string(),
                Some(_) => return Err(ctx.invalid("conv_id", row, "null")),
            };
            let turn_id = match &turn_id {
                None => 0,
                Some(a) => ctx.turn_id(a, "turn_id", row, i)?,
            };
            out.push(PairRow {
                prompt: get_msgs(&prompt, "prompt")?,
                chosen: get_msgs(&chosen, "chosen")?,
                rejected: get_msgs(&rejected, "rejected")?,
                score_chosen: f(&score_chosen),
                score_rejected: f(&score_rejected),
                conv_id,
                turn_id,
            });
        }
    }
    Ok(out)
}

/// 64-bit FNV-1a of the seed and the id, finished with the splitmix64 mixer: a hash that is
/// fixed forever (unlike `std`'s hasher or `rand`'s generators, which may change between
/// versions), so a split is reproducible from its seed on any build.
fn conv_key(seed: u64, conv_id: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in seed.to_le_bytes().iter().chain(conv_id.as_bytes()) {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// Splits pairs into `(train, test)` by **conversation**: every row of a `conv_id` lands on the
/// same side, so no conversation leaks across the split.
///
/// The unique conversation ids are ordered by a fixed hash of `(seed, conv_id)` and the first
/// `round(test_fraction × #conversations)` go to test. With ≥ 2 conversations and
/// `0 < test_fraction < 1`, that count is clamped to `1..=#conversations − 1` so both sides are
/// non-empty. `test_fraction ≤ 0` (or NaN) puts everything in train, `≥ 1` everything in test.
/// Rows keep their input order within each side. Deterministic given `seed`, independent of the
/// order of `rows`.
pub fn split_by_conversation(
    rows: Vec<PairRow>,
    test_fraction: f64,
    seed: u64,
) -> (Vec<PairRow>, Vec<PairRow>) {
    let test_ids = test_conversations(rows.iter().map(|r| r.conv_id.as_str()), test_fraction, seed);
    rows.into_iter()
        .partition(|r| !test_ids.contains(r.conv_id.as_str()))
}

/// The conversation ids [`split_by_conversation`] puts in the test split (same rule, any
/// rows that carry a conversation id).
pub fn test_conversations<'a>(
    ids: impl Iterator<Item = &'a str>,
    test_fraction: f64,
    seed: u64,
) -> HashSet<String> {
    let ids: BTreeSet<&str> = ids.collect();
    let n = ids.len();
    let n_test = if test_fraction.is_nan() || test_fraction <= 0.0 {
        0
    } else if test_fraction >= 1.0 {
        n
    } else if n >= 2 {
        ((test_fraction * n as f64).round() as usize).clamp(1, n - 1)
    } else {
        0
    };
    let mut keyed: Vec<(u64, &str)> = ids.into_iter().map(|id| (conv_key(seed, id), id)).collect();
    keyed.sort_unstable();
    keyed[..n_test]
        .iter()
        .map(|(_, id)| id.to_string())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::datatypes::Fields;
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    use parquet::arrow::ArrowWriter;

    fn row(conv: &str, turn: u32) -> PairRow {
        PairRow {
            prompt: vec![
                ChatMessage::system("Be proactive."),
                ChatMessage::user(format!("hi from {conv}")),
                ChatMessage::assistant("What do you need?"),
                ChatMessage::user("A plan, with ünïcödé ✓"),
            ],
            chosen: vec![ChatMessage::assistant("Could you tell me the deadline?")],
            rejected: vec![ChatMessage::assistant("Here is a plan.")],
            score_chosen: 0.75 + f64::from(turn),
            score_rejected: -0.125,
            conv_id: conv.to_string(),
            turn_id: turn,
        }
    }

    #[test]
    fn writes_exact_trl_schema_and_round_trips() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("train.parquet");
        let rows = vec![row("c1", 0), row("c1", 1), row("c2", 0)];
        write_pairs_parquet(&p, &rows).unwrap();

        let file = std::fs::File::open(&p).unwrap();
        let builder = ParquetRecordBatchReaderBuilder::try_new(file).unwrap();
        let md = builder.metadata().clone();
        let schema = builder.schema().clone();
        // Lists name their items `element`, as pyarrow (and so TRL's own files) write them.
        let msg = DataType::List(Arc::new(Field::new(
            "element",
            DataType::Struct(Fields::from(vec![
                Field::new("role", DataType::Utf8, true),
                Field::new("content", DataType::Utf8, true),
            ])),
            true,
        )));
        let expected = Schema::new(vec![
            Field::new("prompt", msg.clone(), true),
            Field::new("chosen", msg.clone(), true),
            Field::new("rejected", msg, true),
            Field::new("score_chosen", DataType::Float64, true),
            Field::new("score_rejected", DataType::Float64, true),
            Field::new("conv_id", DataType::Utf8, true),
            Field::new("turn_id", DataType::Int64, true),
        ]);
        assert_eq!(schema.fields(), expected.fields());
        for rg in md.row_groups() {
            for c in rg.columns() {
                assert_eq!(c.compression(), parquet::basic::Compression::SNAPPY);
            }
        }
        let batches: Vec<_> = builder.build().unwrap().collect::<Result<_, _>>().unwrap();
        assert_eq!(batches.iter().map(|b| b.num_rows()).sum::<usize>(), 3);

        assert_eq!(read_pairs_parquet(&p).unwrap(), rows);
        // Overwrite in place (atomic rename over the existing file), no temp files left.
        write_pairs_parquet(&p, &rows[..1]).unwrap();
        assert_eq!(read_pairs_parquet(&p).unwrap(), rows[..1]);
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
        // Empty datasets are valid.
        write_pairs_parquet(&p, &[]).unwrap();
        assert!(read_pairs_parquet(&p).unwrap().is_empty());
    }

    fn write_raw(path: &Path, cols: Vec<(&str, ArrayRef)>) {
        let batch = RecordBatch::try_from_iter(cols).unwrap();
        let mut w =
            ArrowWriter::try_new(std::fs::File::create(path).unwrap(), batch.schema(), None)
                .unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
    }

    #[test]
    fn reads_standard_string_form_and_integer_conv_ids() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("std.parquet");
        write_raw(
            &p,
            vec![
                (
                    "prompt",
                    Arc::new(StringArray::from(vec!["Q1", "Q2"])) as ArrayRef,
                ),
                (
                    "chosen",
                    Arc::new(StringArray::from(vec!["good1", "good2"])),
                ),
                (
                    "rejected",
                    Arc::new(StringArray::from(vec!["bad1", "bad2"])),
                ),
                (
                    "score_chosen",
                    Arc::new(arrow::array::Float32Array::from(vec![1.5, 2.0])),
                ),
                ("conv_id", Arc::new(Int64Array::from(vec![17, 18]))),
                (
                    "turn_id",
                    Arc::new(arrow::array::Int32Array::from(vec![0, 3])),
                ),
            ],
        );
        let rows = read_pairs_parquet(&p).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].prompt, vec![ChatMessage::user("Q1")]);
        assert_eq!(rows[0].chosen, vec![ChatMessage::assistant("good1")]);
        assert_eq!(rows[1].rejected, vec![ChatMessage::assistant("bad2")]);
        assert_eq!(rows[0].score_chosen, 1.5);
        assert!(rows[0].score_rejected.is_nan());
        assert_eq!(rows[1].conv_id, "18");
        assert_eq!(rows[1].turn_id, 3);

        // Minimal: no scores, ids or turns.
        write_raw(
            &p,
            vec![
                (
                    "prompt",
                    Arc::new(StringArray::from(vec!["Q1", "Q2"])) as ArrayRef,
                ),
                ("chosen", Arc::new(StringArray::from(vec!["a", "b"]))),
                ("rejected", Arc::new(StringArray::from(vec!["c", "d"]))),
            ],
        );
        let rows = read_pairs_parquet(&p).unwrap();
        assert_eq!(
            (rows[0].conv_id.as_str(), rows[1].conv_id.as_str()),
            ("0", "1")
        );
        assert_eq!(rows[1].turn_id, 0);
    }

    #[test]
    fn reader_errors_name_file_column_row() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("bad.parquet");
        write_raw(
            &p,
            vec![
                ("prompt", Arc::new(StringArray::from(vec!["Q"])) as ArrayRef),
                ("chosen", Arc::new(StringArray::from(vec!["a"]))),
            ],
        );
        let e = read_pairs_parquet(&p).unwrap_err();
        assert!(matches!(
            e,
            DatasetError::MissingColumn {
                column: "rejected",
                ..
            }
        ));
        assert!(e.to_string().contains("bad.parquet") && e.to_string().contains("`rejected`"));

        write_raw(
            &p,
            vec![
                (
                    "prompt",
                    Arc::new(StringArray::from(vec!["Q", "R"])) as ArrayRef,
                ),
                ("chosen", Arc::new(StringArray::from(vec![Some("a"), None]))),
                ("rejected", Arc::new(StringArray::from(vec!["b", "c"]))),
            ],
        );
        let e = read_pairs_parquet(&p).unwrap_err();
        assert!(
            matches!(
                e,
                DatasetError::InvalidValue {
                    column: "chosen",
                    row: 1,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("row 1"));

        write_raw(
            &p,
            vec![
                ("prompt", Arc::new(StringArray::from(vec!["Q"])) as ArrayRef),
                ("chosen", Arc::new(StringArray::from(vec!["a"]))),
                ("rejected", Arc::new(StringArray::from(vec!["b"]))),
                ("turn_id", Arc::new(Int64Array::from(vec![-1]))),
            ],
        );
        let e = read_pairs_parquet(&p).unwrap_err();
        assert!(matches!(
            e,
            DatasetError::InvalidValue {
                column: "turn_id",
                row: 0,
                ..
            }
        ));

        write_raw(
            &p,
            vec![
                ("prompt", Arc::new(Int64Array::from(vec![1])) as ArrayRef),
                ("chosen", Arc::new(StringArray::from(vec!["a"]))),
                ("rejected", Arc::new(StringArray::from(vec!["b"]))),
            ],
        );
        let e = read_pairs_parquet(&p).unwrap_err();
        assert!(
            matches!(
                e,
                DatasetError::ColumnType {
                    column: "prompt",
                    ..
                }
            ),
            "{e}"
        );

        let e = read_pairs_parquet(&d.path().join("missing.parquet")).unwrap_err();
        assert!(matches!(e, DatasetError::Read { .. }));
    }

    fn many(n_conv: usize) -> Vec<PairRow> {
        (0..n_conv)
            .flat_map(|c| (0..(c % 4 + 1) as u32).map(move |t| row(&format!("conv-{c}"), t)))
            .collect()
    }

    #[test]
    fn split_keeps_conversations_whole_and_is_deterministic() {
        let rows = many(200);
        let (train, test) = split_by_conversation(rows.clone(), 0.1, 7);
        assert_eq!(train.len() + test.len(), rows.len());
        let tr: HashSet<_> = train.iter().map(|r| r.conv_id.clone()).collect();
        let te: HashSet<_> = test.iter().map(|r| r.conv_id.clone()).collect();
        assert!(tr.is_disjoint(&te));
        assert_eq!(te.len(), 20, "10% of 200 conversations");
        // Deterministic, and independent of input order.
        let (train2, test2) = split_by_conversation(rows.clone(), 0.1, 7);
        assert_eq!((&train, &test), (&train2, &test2));
        let mut rev = rows.clone();
        rev.reverse();
        let (_, test3) = split_by_conversation(rev, 0.1, 7);
        let te3: HashSet<_> = test3.iter().map(|r| r.conv_id.clone()).collect();
        assert_eq!(te, te3);
        // Another seed, another split.
        let (_, test4) = split_by_conversation(rows.clone(), 0.1, 8);
        let te4: HashSet<_> = test4.iter().map(|r| r.conv_id.clone()).collect();
        assert_ne!(te, te4);
        // Order within a side is the input order.
        let pos = |r: &PairRow| rows.iter().position(|x| x == r).unwrap();
        assert!(train.windows(2).all(|w| pos(&w[0]) < pos(&w[1])));
    }

    #[test]
    fn split_edge_cases() {
        let two = many(2);
        let (train, test) = split_by_conversation(two.clone(), 0.01, 1);
        assert!(
            !train.is_empty() && !test.is_empty(),
            "≥1 conversation on each side"
        );
        let (train, test) = split_by_conversation(two.clone(), 0.99, 1);
        assert!(!train.is_empty() && !test.is_empty());
        let (train, test) = split_by_conversation(two.clone(), 0.0, 1);
        assert_eq!((train.len(), test.len()), (two.len(), 0));
        let (train, test) = split_by_conversation(two.clone(), 1.0, 1);
        assert_eq!((train.len(), test.len()), (0, two.len()));
        let one = many(1);
        let (train, test) = split_by_conversation(one.clone(), 0.5, 1);
        assert_eq!((train.len(), test.len()), (one.len(), 0));
        let (train, test) = split_by_conversation(Vec::new(), 0.5, 1);
        assert!(train.is_empty() && test.is_empty());
        // Proportions roughly right across fractions.
        for frac in [0.05, 0.2, 0.5] {
            let (_, test) = split_by_conversation(many(100), frac, 3);
            let n: HashSet<_> = test.iter().map(|r| &r.conv_id).collect();
            assert_eq!(n.len(), (frac * 100.0).round() as usize);
        }
    }
}
