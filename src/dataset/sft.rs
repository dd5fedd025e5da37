//! `sft.parquet`: the SFT warm-up data of a run, as upstream CollabLLM builds it — per
//! conversation, the whole conversation up to its last turn with that turn's best-scored
//! candidate as the closing assistant message — in TRL's conversational `messages` form, with
//! the closing candidate's MR (`score`) so a trainer can keep only conversations above a
//! bound (`dpo_train --loss sft --sft-min-score`).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use arrow::array::{Array as _, ArrayRef, Float64Array, RecordBatch, StringArray};

use super::columnar::{self, messages_array, MessagesColumn};
use super::flat::FlatRow;
use super::{open, write_batch, Ctx, DatasetError};
use crate::llm::ChatMessage;

/// One SFT conversation.
#[derive(Clone, Debug, PartialEq)]
pub struct SftRow {
    pub messages: Vec<ChatMessage>,
    pub conv_id: String,
    /// MR of the closing assistant message (NaN when unknown).
    pub score: f64,
}

/// Per conversation, the row of its last turn with the best score, in the order
/// conversations first appear (upstream's SFT choice; also verl's recipe).
pub fn best_final_rows(rows: &[FlatRow]) -> Vec<&FlatRow> {
    let mut best: HashMap<&str, &FlatRow> = HashMap::new();
    let mut order = Vec::new();
    for r in rows {
        match best.get(r.conv_id.as_str()) {
            None => {
                order.push(r.conv_id.as_str());
                best.insert(&r.conv_id, r);
            }
            // NaN scores never win a tie-break against a real one.
            Some(b) if r.turn_id > b.turn_id || (r.turn_id == b.turn_id && r.score > b.score) => {
                best.insert(&r.conv_id, r);
            }
            Some(b) if r.turn_id == b.turn_id && b.score.is_nan() && !r.score.is_nan() => {
                best.insert(&r.conv_id, r);
            }
            Some(_) => {}
        }
    }
    order.into_iter().map(|c| best[c]).collect()
}

/// The SFT conversations of flat rows: prefix + best final completion.
pub fn sft_from_flat(rows: &[FlatRow]) -> Vec<SftRow> {
    best_final_rows(rows)
        .into_iter()
        .map(|r| SftRow {
            messages: r
                .prompt
                .iter()
                .cloned()
                .chain([ChatMessage::assistant(r.completion.clone())])
                .collect(),
            conv_id: r.conv_id.clone(),
            score: r.score,
        })
        .collect()
}

/// Writes `messages`, `conv_id`, `score` (atomically).
pub fn write_sft_parquet(path: &Path, rows: &[SftRow]) -> Result<(), DatasetError> {
    let columns: Vec<(&str, ArrayRef)> = vec![
        (
            "messages",
            messages_array(rows.iter().map(|r| r.messages.as_slice())),
        ),
        (
            "conv_id",
            Arc::new(StringArray::from_iter_values(
                rows.iter().map(|r| r.conv_id.as_str()),
            )),
        ),
        (
            "score",
            Arc::new(Float64Array::from_iter_values(rows.iter().map(|r| r.score))),
        ),
    ];
    let batch = RecordBatch::try_from_iter(columns).map_err(|e| Ctx { path }.parquet(e))?;
    write_batch(path, &batch)
}

/// Whether a parquet file holds conversations (a `messages` column) rather than pairs.
pub fn is_sft_parquet(path: &Path) -> bool {
    open(path).is_ok_and(|r| {
        arrow::array::RecordBatchReader::schema(&r)
            .index_of("messages")
            .is_ok()
    })
}

/// Reads a `messages` parquet file (ours or TRL's conversational SFT form); `conv_id` and
/// `score` are optional (row index, NaN).
pub fn read_sft_parquet(path: &Path) -> Result<Vec<SftRow>, DatasetError> {
    let ctx = Ctx { path };
    let mut out = Vec::new();
    for batch in open(path)? {
        let batch = batch.map_err(|e| ctx.parquet(e))?;
        let messages = MessagesColumn::new(ctx.required(&batch, "messages")?, "user")
            .map_err(|m| ctx.coltype("messages", m))?;
        let conv = columnar::column(&batch, "conv_id")
            .map(|c| columnar::as_utf8(c).map_err(|m| ctx.coltype("conv_id", m)))
            .transpose()?;
        let score = columnar::column(&batch, "score")
            .map(|c| columnar::as_f64(c).map_err(|m| ctx.coltype("score", m)))
            .transpose()?;
        for i in 0..batch.num_rows() {
            let row = out.len();
            let messages = messages
                .get(i)
                .map_err(|m| ctx.invalid("messages", row, m))?
                .ok_or_else(|| ctx.invalid("messages", row, "null"))?;
            let conv_id = match &conv {
                Some(c) if !c.is_null(i) => c.value(i).to_string(),
                _ => row.to_string(),
            };
            let score = match &score {
                Some(s) if !s.is_null(i) => s.value(i),
                _ => f64::NAN,
            };
            out.push(SftRow {
                messages,
                conv_id,
                score,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn row(conv: &str, turn: u32, score: f64) -> FlatRow {
        FlatRow {
            prompt: vec![ChatMessage::user(format!("{conv} turn {turn}"))],
            completion: format!("{conv}/{turn}/{score}"),
            conv_id: conv.into(),
            turn_id: turn,
            score,
            single_turn_prompt: "g".into(),
            single_turn_completion: "r".into(),
            single_turn_metadata: json!({}),
            sessions: Value::Null,
            rewards: Value::Null,
        }
    }

    #[test]
    fn last_turn_best_candidate_round_trips() {
        let rows = vec![
            row("a", 0, 0.9),
            row("a", 1, 0.1),
            row("a", 1, f64::NAN),
            row("a", 1, 0.4),
            row("b", 0, f64::NAN),
            row("b", 0, 0.2),
        ];
        let sft = sft_from_flat(&rows);
        assert_eq!(sft.len(), 2);
        assert_eq!(sft[0].messages.last().unwrap().content, "a/1/0.4");
        assert_eq!(sft[0].messages[0].content, "a turn 1");
        assert_eq!(sft[1].score, 0.2, "a real score beats NaN");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sft.parquet");
        write_sft_parquet(&path, &sft).unwrap();
        assert!(is_sft_parquet(&path));
        let back = read_sft_parquet(&path).unwrap();
        assert_eq!(back, sft);
    }
}
