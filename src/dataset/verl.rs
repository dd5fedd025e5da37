//! Export of flat rows (a `generate_conv` run or an imported upstream dataset) for verl's
//! CollabLLM recipe, so the data trains on a GPU cluster with the engine people already run
//! there (docs/formats.md):
//!
//! - `rl_{train,validation}.parquet`: one row per distinct conversation prefix — `prompt` (the
//!   system prompt, then the prefix, ending with the user), `raw_prompt` (the same),
//!   `ground_truth`, `reward_model` {style "rule", ground_truth}, `extra_info` (the row's other
//!   fields with upstream's arrow types — `single_turn_metadata` and `rewards` structs,
//!   `sessions` a list of lists of messages — the prompt, and `interaction_kwargs` {name
//!   "collabllm", single_turn_prompt, task_desc} for the recipe's simulated user), `data_source` "collabllm", `agent_name`
//!   "collabllm_agent", `index` ("conv_id:turn_id").
//! - `sft_{train,validation}.parquet`: one row per conversation, `prompt` only: the system
//!   prompt, the last turn's prefix and its best-scored completion.
//!
//! Unlike the recipe's script (a random split by row, which puts turns of one conversation on
//! both sides), validation is chosen by conversation, with the pairs' rule and seed.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::{ArrayRef, Float64Array, Int64Array, RecordBatch, StringArray, StructArray};
use arrow::datatypes::{Field, Fields};

use super::columnar::messages_array;
use super::flat::FlatRow;
use super::pairs::test_conversations;
use super::sft::best_final_rows;
use super::{write_batch, Ctx, DatasetError};
use crate::llm::ChatMessage;

/// Our collaborative system prompt (`prompts/verl_system.txt`); `--system-prompt FILE`
/// replaces it, e.g. with the recipe's own.
pub const SYSTEM_PROMPT: &str = include_str!("../../prompts/verl_system.txt");

/// Settings of an export.
#[derive(Clone, Debug)]
pub struct VerlOptions {
    pub system_prompt: String,
    /// Task description for the recipe's user simulator; `None`: from each row's task type.
    pub task_desc: Option<String>,
    /// Share of conversations in the validation files.
    pub validation_fraction: f64,
    pub seed: u64,
}

impl Default for VerlOptions {
    fn default() -> Self {
        Self {
            system_prompt: SYSTEM_PROMPT.trim_end().to_string(),
            task_desc: None,
            validation_fraction: 0.1,
            seed: 0,
        }
    }
}

/// What an export wrote.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct VerlSummary {
    pub files: Vec<PathBuf>,
    pub rl_train: usize,
    pub rl_validation: usize,
    pub sft_train: usize,
    pub sft_validation: usize,
    /// Rows whose prompt repeats an earlier row's (the candidates of one turn): one RL row each.
    pub duplicate_prompts: usize,
    /// Prefixes that do not end with a user message (nothing to answer): left out of RL.
    pub not_ending_with_user: usize,
}

impl std::fmt::Display for VerlSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "rl             {} train + {} validation prompts ({} repeated prompts merged, {} not ending with the user left out)",
            self.rl_train, self.rl_validation, self.duplicate_prompts, self.not_ending_with_user
        )?;
        write!(
            f,
            "sft            {} train + {} validation conversations",
            self.sft_train, self.sft_validation
        )
    }
}

/// The recipe's default description of a task type.
fn task_desc_of(row: &FlatRow) -> &'static str {
    match row.single_turn_metadata["task_type"].as_str() {
        Some("math") => "solving math problems",
        Some("doc_edit") => "editing and writing documents",
        Some("code") => "writing code",
        Some("twenty_questions") => "playing 20 Questions",
        _ => "general ask-for-assistance task",
    }
}

/// Writes the four files under `dir` (each atomically) from `rows`.
pub fn export_verl(
    rows: &[FlatRow],
    dir: &Path,
    opts: &VerlOptions,
) -> Result<VerlSummary, DatasetError> {
    let mut validation = test_conversations(
        rows.iter().map(|r| r.conv_id.as_str()),
        opts.validation_fraction,
        opts.seed,
    );
    let system = ChatMessage::system(opts.system_prompt.clone());
    let (rl, duplicate_prompts, not_ending_with_user) = rl_rows(rows);
    keep_both_splits(&rl, &mut validation);
    let sft = best_final_rows(rows);
    let (rl_val, rl_train): (Vec<&FlatRow>, Vec<&FlatRow>) = rl
        .into_iter()
        .partition(|r| validation.contains(&r.conv_id));
    let (sft_val, sft_train): (Vec<&FlatRow>, Vec<&FlatRow>) = sft
        .into_iter()
        .partition(|r| validation.contains(&r.conv_id));
    if rl_train.is_empty() && rl_val.is_empty() {
        return Err(DatasetError::Empty {
            path: dir.to_path_buf(),
            message: format!(
                "{} rows and no prompt that ends with a user message (did every task fail? \
                 the run's manifest.json says)",
                rows.len()
            ),
        });
    }
    std::fs::create_dir_all(dir).map_err(|source| DatasetError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut files = Vec::new();
    for (name, part) in [("rl_train", &rl_train), ("rl_validation", &rl_val)] {
        let path = dir.join(format!("{name}.parquet"));
        write_batch(&path, &rl_batch(&path, part, &system, opts)?)?;
        files.push(path);
    }
    for (name, part) in [("sft_train", &sft_train), ("sft_validation", &sft_val)] {
        let path = dir.join(format!("{name}.parquet"));
        write_batch(&path, &sft_batch(&path, part, &system)?)?;
        files.push(path);
    }
    Ok(VerlSummary {
        files,
        rl_train: rl_train.len(),
        rl_validation: rl_val.len(),
        sft_train: sft_train.len(),
        sft_validation: sft_val.len(),
        duplicate_prompts,
        not_ending_with_user,
    })
}

/// Moves one whole conversation across the split when the RL prompts would all land on one
/// side: `datasets.load_dataset` fails on an empty parquet file ("corresponds to no data").
/// With a single conversation there is nothing to move; its validation file stays empty
/// only when the run is that small.
fn keep_both_splits(rl: &[&FlatRow], validation: &mut HashSet<String>) {
    let mut convs: Vec<&str> = Vec::new();
    for r in rl {
        if !convs.contains(&r.conv_id.as_str()) {
            convs.push(&r.conv_id);
        }
    }
    if convs.len() < 2 {
        return;
    }
    if convs.iter().all(|c| validation.contains(*c)) {
        validation.remove(convs[0]);
    }
    if convs.iter().all(|c| !validation.contains(*c)) {
        validation.insert(convs[convs.len() - 1].to_string());
    }
}

/// The first row of every distinct prompt that ends with a user message, in input order.
fn rl_rows(rows: &[FlatRow]) -> (Vec<&FlatRow>, usize, usize) {
    let mut seen = HashSet::new();
    let (mut out, mut duplicates, mut not_user) = (Vec::new(), 0, 0);
    for r in rows {
        if r.prompt.last().is_none_or(|m| m.role != "user") {
            not_user += 1;
            continue;
        }
        let key = serde_json::to_string(&r.prompt).unwrap_or_default();
        if seen.insert(key) {
            out.push(r);
        } else {
            duplicates += 1;
        }
    }
    (out, duplicates, not_user)
}

fn strings<'a>(values: impl Iterator<Item = &'a str>) -> ArrayRef {
    Arc::new(StringArray::from_iter_values(values))
}

/// A JSON field of the flat rows with the arrow type upstream's files give it (structs and
/// lists, not JSON text): the recipe's metrics index `extra_info["single_turn_metadata"]`.
fn json_field(rows: &[&FlatRow], f: impl Fn(&FlatRow) -> &serde_json::Value) -> ArrayRef {
    let values: Vec<&serde_json::Value> = rows.iter().map(|r| f(r)).collect();
    super::flat::json_values_array(&values)
}

fn struct_array(path: &Path, columns: Vec<(&str, ArrayRef)>) -> Result<ArrayRef, DatasetError> {
    let fields: Fields = columns
        .iter()
        // Nullable, as pyarrow writes every field.
        .map(|(name, a)| Field::new(*name, a.data_type().clone(), true))
        .collect();
    let arrays = columns.into_iter().map(|(_, a)| a).collect();
    StructArray::try_new(fields, arrays, None)
        .map(|a| Arc::new(a) as ArrayRef)
        .map_err(|e| Ctx { path }.parquet(e))
}

fn batch(path: &Path, columns: Vec<(&str, ArrayRef)>) -> Result<RecordBatch, DatasetError> {
    // Nullable columns, as pyarrow (and so the recipe's script) writes them.
    RecordBatch::try_from_iter_with_nullable(columns.into_iter().map(|(n, a)| (n, a, true)))
        .map_err(|e| Ctx { path }.parquet(e))
}

/// `system` then the prompt; a prompt that opens with its own system message (a run made
/// with `--policy-system-prompt`) keeps it instead.
fn with_system<'a>(
    system: &ChatMessage,
    prompt: &'a [ChatMessage],
) -> impl Iterator<Item = ChatMessage> + 'a {
    let own = prompt.first().is_some_and(|m| m.role == "system");
    (!own)
        .then(|| system.clone())
        .into_iter()
        .chain(prompt.iter().cloned())
}

fn rl_batch(
    path: &Path,
    rows: &[&FlatRow],
    system: &ChatMessage,
    opts: &VerlOptions,
) -> Result<RecordBatch, DatasetError> {
    let prompts: Vec<Vec<ChatMessage>> = rows
        .iter()
        .map(|r| with_system(system, &r.prompt).collect())
        .collect();
    let messages = || messages_array(prompts.iter().map(Vec::as_slice));
    let truth = || strings(rows.iter().map(|r| r.single_turn_completion.as_str()));
    let n = rows.len();
    let interaction = struct_array(
        path,
        vec![
            ("name", strings(std::iter::repeat_n("collabllm", n))),
            (
                "single_turn_prompt",
                strings(rows.iter().map(|r| r.single_turn_prompt.as_str())),
            ),
            (
                "task_desc",
                strings(
                    rows.iter()
                        .map(|r| opts.task_desc.as_deref().unwrap_or_else(|| task_desc_of(r))),
                ),
            ),
        ],
    )?;
    let extra_info = struct_array(
        path,
        vec![
            (
                "completion",
                strings(rows.iter().map(|r| r.completion.as_str())),
            ),
            ("conv_id", strings(rows.iter().map(|r| r.conv_id.as_str()))),
            (
                "score",
                Arc::new(Float64Array::from_iter_values(rows.iter().map(|r| r.score))),
            ),
            ("single_turn_completion", truth()),
            (
                "single_turn_metadata",
                json_field(rows, |r| &r.single_turn_metadata),
            ),
            // The flat file's column order, as the recipe's script copies the columns.
            (
                "turn_id",
                Arc::new(Int64Array::from_iter_values(
                    rows.iter().map(|r| i64::from(r.turn_id)),
                )),
            ),
            ("sessions", json_field(rows, |r| &r.sessions)),
            ("rewards", json_field(rows, |r| &r.rewards)),
            ("prompt", messages()),
            ("interaction_kwargs", interaction),
        ],
    )?;
    let reward_model = struct_array(
        path,
        vec![
            ("style", strings(std::iter::repeat_n("rule", n))),
            ("ground_truth", truth()),
        ],
    )?;
    let index: Vec<String> = rows
        .iter()
        .map(|r| format!("{}:{}", r.conv_id, r.turn_id))
        .collect();
    batch(
        path,
        vec![
            ("prompt", messages()),
            ("ground_truth", truth()),
            ("raw_prompt", messages()),
            ("extra_info", extra_info),
            ("reward_model", reward_model),
            ("data_source", strings(std::iter::repeat_n("collabllm", n))),
            (
                "agent_name",
                strings(std::iter::repeat_n("collabllm_agent", n)),
            ),
            ("index", strings(index.iter().map(String::as_str))),
        ],
    )
}

fn sft_batch(
    path: &Path,
    rows: &[&FlatRow],
    system: &ChatMessage,
) -> Result<RecordBatch, DatasetError> {
    let convs: Vec<Vec<ChatMessage>> = rows
        .iter()
        .map(|r| {
            with_system(system, &r.prompt)
                .chain([ChatMessage::assistant(r.completion.clone())])
                .collect()
        })
        .collect();
    batch(
        path,
        vec![("prompt", messages_array(convs.iter().map(Vec::as_slice)))],
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Array, AsArray, ListArray};
    use serde_json::json;

    fn row(conv: &str, turn: u32, score: f64, prompt: Vec<ChatMessage>) -> FlatRow {
        FlatRow {
            prompt,
            completion: format!("answer {conv}{turn} {score}"),
            conv_id: conv.into(),
            turn_id: turn,
            score,
            single_turn_prompt: format!("goal of {conv}"),
            single_turn_completion: "42".into(),
            single_turn_metadata: json!({"task_type": "math", "level": 3}),
            sessions: json!([{"turns": 1}]),
            rewards: json!({"accuracy": [1.0]}),
        }
    }

    fn read(path: &Path) -> RecordBatch {
        let reader = crate::dataset::open(path).unwrap();
        let batches: Vec<RecordBatch> = reader.map(Result::unwrap).collect();
        arrow::compute::concat_batches(&batches[0].schema(), &batches).unwrap()
    }

    fn messages(list: &ListArray, i: usize) -> Vec<(String, String)> {
        let v = list.value(i);
        let s = v.as_struct();
        let role = s.column_by_name("role").unwrap().as_string::<i32>();
        let content = s.column_by_name("content").unwrap().as_string::<i32>();
        (0..s.len())
            .map(|k| (role.value(k).to_string(), content.value(k).to_string()))
            .collect()
    }

    #[test]
    fn rl_and_sft_files_have_the_recipe_fields_split_by_conversation() {
        let u = |t: &str| ChatMessage::user(t.to_string());
        let a = |t: &str| ChatMessage::assistant(t.to_string());
        let mut rows = Vec::new();
        for c in 0..10 {
            let conv = format!("c{c}");
            rows.push(row(&conv, 0, 0.2, vec![u("hi")]));
            rows.push(row(&conv, 0, 0.9, vec![u("hi")])); // same prompt: one RL row
            rows.push(row(
                &conv,
                1,
                0.5,
                vec![u("hi"), a("which?"), u(&format!("this {c}"))],
            ));
        }
        let mut odd = row("c0", 2, 0.1, vec![u("hi"), a("done")]);
        odd.prompt.push(a("again"));
        rows.push(odd);
        let dir = tempfile::tempdir().unwrap();
        let opts = VerlOptions {
            validation_fraction: 0.2,
            seed: 7,
            ..Default::default()
        };
        // Every conversation drawn for validation (fraction 1), or none (fraction 0): one
        // whole conversation crosses, so neither RL file is empty.
        for fraction in [1.0, 0.0] {
            let d = dir.path().join(format!("split-{fraction}"));
            let o = VerlOptions {
                validation_fraction: fraction,
                ..opts.clone()
            };
            let s = export_verl(&rows, &d, &o).unwrap();
            assert!(s.rl_train > 0 && s.rl_validation > 0, "{fraction}: {s:?}");
        }
        let nothing = dir.path().join("empty");
        let e = export_verl(&[], &nothing, &opts).unwrap_err().to_string();
        assert!(
            e.contains("nothing to write") && e.contains("0 rows"),
            "{e}"
        );
        assert!(
            !nothing.exists(),
            "an empty export wrote {}",
            nothing.display()
        );
        let s = export_verl(&rows, dir.path(), &opts).unwrap();
        assert_eq!(s.not_ending_with_user, 1);
        // "hi" is one prompt across all conversations; each second turn is its own.
        assert_eq!(s.rl_train + s.rl_validation, 11);
        assert_eq!(s.sft_train + s.sft_validation, 10);
        assert_eq!((s.sft_train, s.sft_validation), (8, 2));

        let rl = read(&dir.path().join("rl_train.parquet"));
        let names: Vec<String> = rl
            .schema()
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .collect();
        assert_eq!(
            names,
            [
                "prompt",
                "ground_truth",
                "raw_prompt",
                "extra_info",
                "reward_model",
                "data_source",
                "agent_name",
                "index"
            ]
        );
        let prompt = rl.column_by_name("prompt").unwrap().as_list::<i32>();
        let first = messages(prompt, 0);
        assert_eq!(first[0], ("system".to_string(), opts.system_prompt.clone()));
        assert_eq!(first.last().unwrap().0, "user");
        let extra = rl.column_by_name("extra_info").unwrap().as_struct();
        let kwargs = extra
            .column_by_name("interaction_kwargs")
            .unwrap()
            .as_struct();
        let col = |s: &StructArray, n: &str, i: usize| {
            s.column_by_name(n)
                .unwrap()
                .as_string::<i32>()
                .value(i)
                .to_string()
        };
        assert_eq!(col(kwargs, "name", 0), "collabllm");
        assert_eq!(col(kwargs, "task_desc", 0), "solving math problems");
        assert!(col(kwargs, "single_turn_prompt", 0).starts_with("goal of c"));
        let meta = extra
            .column_by_name("single_turn_metadata")
            .unwrap()
            .as_struct();
        let level = meta.column_by_name("level").unwrap();
        assert_eq!(
            level.as_primitive::<arrow::datatypes::Int64Type>().value(0),
            3
        );
        let rm = rl.column_by_name("reward_model").unwrap().as_struct();
        assert_eq!(col(rm, "style", 0), "rule");
        assert_eq!(col(rm, "ground_truth", 0), "42");
        let index = rl.column_by_name("index").unwrap().as_string::<i32>();
        let turn = extra.column_by_name("turn_id").unwrap();
        let turn = turn.as_primitive::<arrow::datatypes::Int64Type>().value(0);
        assert_eq!(
            index.value(0),
            format!("{}:{turn}", col(extra, "conv_id", 0))
        );

        // No conversation on both sides.
        let convs = |file: &str| -> HashSet<String> {
            let b = read(&dir.path().join(file));
            let e = b.column_by_name("extra_info").unwrap().as_struct();
            (0..b.num_rows()).map(|i| col(e, "conv_id", i)).collect()
        };
        let (train, val) = (convs("rl_train.parquet"), convs("rl_validation.parquet"));
        assert!(train.is_disjoint(&val), "{train:?} {val:?}");

        // SFT: the last turn's best completion closes each conversation.
        let sft = read(&dir.path().join("sft_train.parquet"));
        assert_eq!(sft.num_columns(), 1);
        let conv = messages(sft.column(0).as_list::<i32>(), 0);
        assert_eq!(conv[0].0, "system");
        assert_eq!(conv.last().unwrap().0, "assistant");
        assert!(conv.last().unwrap().1.starts_with("answer c"), "{conv:?}");
        assert_eq!(conv.len(), 5, "system + 3 prefix messages + completion");
    }

    /// The recipe's metrics read `extra_info` fields as structures (`pass_rate` indexes
    /// `single_turn_metadata["entry_point"]`; as JSON text that raised and the reward
    /// manager scored 0): each nested field has the arrow type upstream's flat file gives
    /// the same rows.
    #[test]
    fn extra_info_keeps_upstream_nested_types() {
        let mut rows = Vec::new();
        for c in 0..4 {
            let ask = ChatMessage::user(format!("code {c}?"));
            let mut r = row(&format!("c{c}"), 0, 0.5, vec![ask]);
            r.single_turn_metadata = json!({"task_type": "code", "entry_point": "task_func",
                "test": "import unittest", "libs": ["numpy"]});
            r.sessions = json!([
                [{"role": "user", "content": "and?"}, {"role": "assistant", "content": "x"}],
                [{"role": "user", "content": "ok"}]
            ]);
            r.rewards = json!({"MR": [0.5, 0.25], "pass_rate": [1.0, 0.0]});
            rows.push(r);
        }
        let dir = tempfile::tempdir().unwrap();
        export_verl(&rows, dir.path(), &VerlOptions::default()).unwrap();
        let flat_path = dir.path().join("flat.parquet");
        crate::dataset::flat::write_flat_parquet(&flat_path, &rows).unwrap();
        let flat = read(&flat_path);
        let rl = read(&dir.path().join("rl_train.parquet"));
        let extra = rl.column_by_name("extra_info").unwrap().as_struct();
        for name in ["single_turn_metadata", "sessions", "rewards"] {
            let ours = extra.column_by_name(name).unwrap().data_type();
            let upstream = flat.column_by_name(name).unwrap().data_type();
            assert_eq!(ours, upstream, "{name}");
        }
        assert!(matches!(
            extra.column_by_name("sessions").unwrap().data_type(),
            arrow::datatypes::DataType::List(f)
                if matches!(f.data_type(), arrow::datatypes::DataType::List(g)
                    if matches!(g.data_type(), arrow::datatypes::DataType::Struct(_)))
        ));
        let meta = extra
            .column_by_name("single_turn_metadata")
            .unwrap()
            .as_struct();
        let entry = meta
            .column_by_name("entry_point")
            .unwrap()
            .as_string::<i32>();
        assert_eq!(entry.value(0), "task_func");
        let rewards = extra.column_by_name("rewards").unwrap().as_struct();
        let mr = rewards.column_by_name("MR").unwrap().as_list::<i32>();
        let mr0 = mr.value(0);
        assert_eq!(
            mr0.as_primitive::<arrow::datatypes::Float64Type>().values(),
            &[0.5, 0.25]
        );
    }
}
