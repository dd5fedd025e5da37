//! Repository layouts and cards: a `generate_conv` run → dataset files + dataset card; a
//! checkpoint directory → model files + model card.
//!
//! The dataset card's YAML front matter follows the Hub's format: `configs` (per config, the
//! `data_files` of each split) and `dataset_info` (features from the parquet schema, splits with
//! `num_examples`/`num_bytes`), so the viewer and `datasets.load_dataset` need no guessing.
//! YAML is written by hand; every free-text scalar is JSON-quoted, which YAML reads as a
//! double-quoted string.

use std::fs::File;
use std::path::{Path, PathBuf};

use arrow::datatypes::{DataType, Field};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use serde_json::Value;

use super::{io_err, HubError, RepoFile};
use crate::llm::spec::public_model_name;
use crate::run::Manifest;

/// One split of a config as written to the repository.
#[derive(Clone, Debug)]
pub struct SplitInfo {
    pub name: String,
    pub path_in_repo: String,
    pub num_examples: u64,
    pub num_bytes: u64,
}

/// A dataset config: its splits and the features (columns) of its files.
#[derive(Clone, Debug)]
pub struct ConfigInfo {
    pub name: String,
    pub splits: Vec<SplitInfo>,
    pub fields: Vec<Field>,
}

fn q(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// Row count, schema fields and size of a parquet file.
pub fn parquet_info(path: &Path) -> Result<(u64, Vec<Field>, u64), HubError> {
    let file = File::open(path).map_err(|e| io_err(path, e))?;
    let size = file.metadata().map_err(|e| io_err(path, e))?.len();
    let b = ParquetRecordBatchReaderBuilder::try_new(file).map_err(|e| io_err(path, e))?;
    let rows = u64::try_from(b.metadata().file_metadata().num_rows()).unwrap_or(0);
    let fields = b
        .schema()
        .fields()
        .iter()
        .map(|f| f.as_ref().clone())
        .collect();
    Ok((rows, fields, size))
}

/// `datasets` feature YAML for one field, at `indent` spaces.
fn feature_yaml(f: &Field, indent: usize, out: &mut String) {
    let pad = " ".repeat(indent);
    out.push_str(&format!("{pad}- name: {}\n", q(f.name())));
    type_yaml(f.data_type(), indent + 2, out);
}

fn dtype(t: &DataType) -> Option<&'static str> {
    Some(match t {
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => "string",
        DataType::Float64 => "float64",
        DataType::Float32 => "float32",
        DataType::Int64 => "int64",
        DataType::Int32 => "int32",
        DataType::Int16 => "int16",
        DataType::Int8 => "int8",
        DataType::UInt64 => "uint64",
        DataType::UInt32 => "uint32",
        DataType::Boolean => "bool",
        DataType::Binary | DataType::LargeBinary => "binary",
        _ => return None,
    })
}

fn type_yaml(t: &DataType, indent: usize, out: &mut String) {
    let pad = " ".repeat(indent);
    match t {
        DataType::List(item) | DataType::LargeList(item) => match item.data_type() {
            DataType::Struct(fields) => {
                out.push_str(&format!("{pad}list:\n"));
                for f in fields {
                    feature_yaml(f, indent, out);
                }
            }
            // Upstream's `sessions` (a list of message lists) reads `list:` then the inner list.
            inner @ (DataType::List(_) | DataType::LargeList(_)) => {
                out.push_str(&format!("{pad}list:\n"));
                type_yaml(inner, indent + 2, out);
            }
            inner => out.push_str(&format!(
                "{pad}sequence: {}\n",
                dtype(inner).unwrap_or("string")
            )),
        },
        DataType::Struct(fields) => {
            out.push_str(&format!("{pad}struct:\n"));
            for f in fields {
                feature_yaml(f, indent, out);
            }
        }
        other => out.push_str(&format!(
            "{pad}dtype: {}\n",
            dtype(other).unwrap_or("string")
        )),
    }
}

/// The YAML front matter (without the `---` lines).
pub fn dataset_yaml(configs: &[ConfigInfo]) -> String {
    let mut y = String::from("configs:\n");
    for c in configs {
        y.push_str(&format!("- config_name: {}\n", q(&c.name)));
        if c.name == "default" {
            y.push_str("  default: true\n");
        }
        y.push_str("  data_files:\n");
        for s in &c.splits {
            y.push_str(&format!(
                "  - split: {}\n    path: {}\n",
                q(&s.name),
                q(&s.path_in_repo)
            ));
        }
    }
    y.push_str("dataset_info:\n");
    for c in configs {
        y.push_str(&format!("- config_name: {}\n  features:\n", q(&c.name)));
        for f in &c.fields {
            feature_yaml(f, 2, &mut y);
        }
        y.push_str("  splits:\n");
        for s in &c.splits {
            y.push_str(&format!(
                "  - name: {}\n    num_bytes: {}\n    num_examples: {}\n",
                q(&s.name),
                s.num_bytes,
                s.num_examples
            ));
        }
        let total: u64 = c.splits.iter().map(|s| s.num_bytes).sum();
        y.push_str(&format!(
            "  download_size: {total}\n  dataset_size: {total}\n"
        ));
    }
    y.push_str("tags:\n- collabllm\n- dpo\n- preference\n- multi-turn\n- trl\n");
    y
}

fn text(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Keys whose values are model specs.
const MODEL_KEYS: [&str; 6] = [
    "model",
    "policy",
    "user",
    "judge",
    "assistant",
    "base_model",
];

/// A recorded setting as a published card may show it: models by their public name (no local
/// path, no endpoint URL), files by their name, other URLs not at all (they may be private or
/// carry credentials).
fn public_setting(key: &str, v: &Value) -> String {
    let Some(s) = v.as_str() else {
        return text(v);
    };
    if MODEL_KEYS.contains(&key) || s.starts_with("openai:") {
        public_model_name(s)
    } else if s.contains("://") {
        "(URL not published)".into()
    } else if s.contains(['/', '\\']) {
        Path::new(s)
            .file_name()
            .map_or_else(|| s.to_string(), |n| n.to_string_lossy().into_owned())
    } else {
        s.to_string()
    }
}

/// Markdown table cell: no pipes or newlines.
fn cell(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

/// The weights a run used: the configured ones, else those recorded on its conversations
/// (task-type defaults), read from the first record of `conversations.jsonl`.
fn weights_text(run_dir: &Path, manifest: &Manifest) -> String {
    let fmt = |m: &serde_json::Map<String, Value>| {
        m.iter()
            .map(|(k, v)| format!("{k}={}", text(v)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    if let Some(m) = manifest.config["metrics"]
        .as_object()
        .filter(|m| !m.is_empty())
    {
        return fmt(m);
    }
    let first = std::fs::read_to_string(run_dir.join("conversations.jsonl"))
        .ok()
        .and_then(|t| t.lines().next().map(str::to_string))
        .and_then(|l| serde_json::from_str::<Value>(&l).ok());
    match first.as_ref().and_then(|r| r["weights"].as_object()) {
        Some(m) => format!("{} (task-type defaults)", fmt(m)),
        None => "task-type defaults".into(),
    }
}

/// The dataset card: front matter + how the data was made + how to use it.
pub fn dataset_card(
    repo: &str,
    configs: &[ConfigInfo],
    run_dir: &Path,
    manifest: &Manifest,
) -> String {
    let c = &manifest.config;
    let import = manifest.field("import");
    let name = repo.rsplit('/').next().unwrap_or(repo);
    let mut md = format!("---\n{}---\n\n# {name}\n\n", dataset_yaml(configs));
    if let Some(src) = import["source"].as_str() {
        let src = if src.starts_with("hf:") {
            src.to_string()
        } else {
            public_setting("source", &import["source"])
        };
        md.push_str(&format!(
            "Preference pairs imported from `{src}` (upstream CollabLLM flat rows) by collabllm-rs \
             `generate_conv --import`: per conversation turn, the best- against the worst-scored \
             candidate.\n\n"
        ));
    } else {
        md.push_str(
            "Multi-turn preference pairs made with collabllm-rs `generate_conv` (CollabLLM, \
             multiturn-aware rewards): at every turn the policy proposes N candidate replies, a \
             simulated user who knows the hidden goal plays S short futures from each, judges and \
             task metrics score every future, and the mean weighted score (MR) ranks the \
             candidates. The best continues the conversation; best against worst is a pair.\n\n",
        );
    }
    md.push_str("## How the data was made\n\n| setting | value |\n|---|---|\n");
    let assistant = if c["policy"].is_null() {
        "-".to_string()
    } else if c["assistant"].is_null() {
        format!("{} (the policy)", public_setting("policy", &c["policy"]))
    } else {
        public_setting("assistant", &c["assistant"])
    };
    let rows: Vec<(&str, String)> = vec![
        ("tasks", public_setting("tasks", &c["tasks"])),
        (
            "policy (candidates)",
            public_setting("policy", &c["policy"]),
        ),
        ("user simulator", public_setting("user", &c["user"])),
        ("judge", public_setting("judge", &c["judge"])),
        ("assistant inside futures", assistant),
        (
            "metrics and weights",
            if import.is_object() {
                "as scored upstream (the `score` column)".to_string()
            } else {
                weights_text(run_dir, manifest)
            },
        ),
        ("MR formula", text(&c["mr_formula"])),
        ("candidates per turn (N)", text(&c["candidates"])),
        ("futures per candidate (S)", text(&c["samples"])),
        ("window (messages per future)", text(&c["window"])),
        ("max messages per conversation", text(&c["max_messages"])),
        ("minimum MR gap", text(&c["min_gap"])),
        ("pairs per turn", text(&c["pairs"])),
        (
            "test fraction (split by conversation)",
            text(&c["test_fraction"]),
        ),
        (
            "seed",
            manifest.seed.map_or_else(|| "-".into(), |s| s.to_string()),
        ),
        (
            "tool",
            format!(
                "{} {}{}",
                manifest.header.tool,
                manifest.header.version.as_deref().unwrap_or("-"),
                manifest
                    .header
                    .git_revision
                    .as_deref()
                    .map(|r| format!(" (git {r})"))
                    .unwrap_or_default()
            ),
        ),
    ];
    for (k, v) in rows.iter().filter(|(_, v)| v != "-") {
        md.push_str(&format!("| {k} | {} |\n", cell(v)));
    }
    if let Some(section) = twenty_questions_section(c, run_dir, manifest) {
        md.push_str(&section);
    }
    md.push_str("\n## Counts\n\n| count | value |\n|---|---|\n");
    if let Some(counts) = manifest.field("counts").as_object() {
        for (k, v) in counts {
            if !v.is_object() && !v.is_array() {
                md.push_str(&format!("| {k} | {} |\n", cell(&text(v))));
            }
        }
    }
    for cfg in configs {
        for s in &cfg.splits {
            md.push_str(&format!(
                "| rows in `{}` ({} / {}) | {} |\n",
                s.path_in_repo, cfg.name, s.name, s.num_examples
            ));
        }
    }
    md.push_str(&format!(
        "\n## Columns\n\n`prompt` is the conversation so far, `chosen` and `rejected` hold one \
         assistant message each (TRL's conversational format), `score_chosen`/`score_rejected` \
         are their multiturn-aware rewards, `conv_id`/`turn_id` say where the pair comes from. \
         Train and test never share a conversation.\n\n\
         ## Load\n\n```python\nfrom datasets import load_dataset\n\nds = load_dataset({repo})\n\
         print(ds[\"train\"][0][\"chosen\"])\n```\n\n\
         ## Train with TRL\n\n```python\nfrom datasets import load_dataset\n\
         from transformers import AutoModelForCausalLM, AutoTokenizer\n\
         from trl import DPOConfig, DPOTrainer\n\n\
         model_id = \"HuggingFaceTB/SmolLM2-135M-Instruct\"\n\
         model = AutoModelForCausalLM.from_pretrained(model_id)\n\
         tokenizer = AutoTokenizer.from_pretrained(model_id)\n\
         ds = load_dataset({repo})\n\
         trainer = DPOTrainer(\n    model=model,\n    args=DPOConfig(output_dir=\"dpo-out\", beta=0.1),\n\
         \x20   train_dataset=ds[\"train\"],\n    eval_dataset=ds.get(\"test\"),\n\
         \x20   processing_class=tokenizer,\n)\ntrainer.train()\n```\n",
        repo = q(repo)
    ));
    if configs.iter().any(|c| c.name == "flat") {
        md.push_str(&format!(
            "\nThe `flat` config holds every scored candidate in the upstream CollabLLM flat \
             schema (`load_dataset({}, \"flat\")`), nested as upstream published it: \
             `single_turn_metadata` is a struct of the task's metadata keys, `sessions` a list \
             of simulated futures (each a list of `{{role, content}}` messages) and `rewards` \
             a struct of per-session score lists (`MR` and one per metric), so \
             `row[\"rewards\"][\"MR\"]` needs no parsing. (A value whose kind differs \
             across rows is stored as JSON text at that spot.)\n",
            q(repo)
        ));
    }
    md
}

/// What a 20 Questions run's card must say: the oracle, the question budget, the object
/// split, and the rewards with their weights.
fn twenty_questions_section(c: &Value, run_dir: &Path, manifest: &Manifest) -> Option<String> {
    let tasks = c["tasks"].as_str().unwrap_or("");
    let split = tasks.strip_prefix("20q:");
    if split.is_none() && c["task_type"].as_str() != Some("twenty_questions") {
        return None;
    }
    let oracle = match c["oracle"].as_str().unwrap_or("table") {
        "table" => "the attribute table (exact; a question it cannot parse is answered \"No.\", \
                    LMRL-Gym's rule)"
            .to_string(),
        "llm" => format!(
            "the user model ({}) answering \"Yes.\"/\"No.\"",
            public_setting("user", &c["user"])
        ),
        other => format!(
            "{other}: the attribute table when it parses the question, the user model ({}) \
             otherwise",
            public_setting("user", &c["user"])
        ),
    };
    let objects = match split {
        Some(s) => format!(
            "bundled LMRL-Gym objects, split `{s}`: objects are split by a fixed hash of their \
             name, ~20% of each category held out as `test`; evaluate on `--split test` (never \
             generated from)"
        ),
        None => "from the task file (`reference` names the object)".to_string(),
    };
    let rows = [
        ("oracle (the simulated user)", oracle),
        ("questions per game", text(&c["max_questions"])),
        ("objects", objects),
        ("reward weights", weights_text(run_dir, manifest)),
    ];
    let mut md = String::from(
        "\n## 20 Questions\n\nThe user is an oracle who knows the hidden object and answers each \
         question \"Yes.\" or \"No.\"; a game ends on a win (LMRL-Gym's rule: a yes to a \
         question that ends with the object's name and names no other noun) or when the \
         questions run out. Candidates are the questioner's next question.\n\n\
         | setting | value |\n|---|---|\n",
    );
    for (k, v) in rows {
        md.push_str(&format!("| {k} | {} |\n", cell(&v)));
    }
    md.push_str(
        "\nRewards of a candidate and its futures, exact under the attribute table: \
         `info_gain` = log2(|objects consistent before| / |after|) over the candidate's and its \
         future's questions, divided by log2(|before|) (in [0, 1]); `success` = 1 when the game is \
         won within the future; `questions` = questions asked; `lmrl_return` = −1 per question, \
         0 for the winning one; `token_amount` = thousands of questioner tokens. Presets: \
         `20q-infogain` = success 1, info_gain 1, token_amount −0.5; `20q-interactive` = \
         success 1, interactivity 1 (LLM judge), token_amount −0.5.\n",
    );
    Some(md)
}

fn split_of(
    config: &str,
    split: &str,
    file: PathBuf,
) -> Result<(SplitInfo, Vec<Field>, RepoFile), HubError> {
    let (rows, fields, size) = parquet_info(&file)?;
    let path_in_repo = if config == "default" {
        format!("data/{split}-00000-of-00001.parquet")
    } else {
        format!("{config}/{split}-00000-of-00001.parquet")
    };
    Ok((
        SplitInfo {
            name: split.to_string(),
            path_in_repo: path_in_repo.clone(),
            num_examples: rows,
            num_bytes: size,
        },
        fields,
        RepoFile::file(path_in_repo, file),
    ))
}

/// The files of a dataset push from a run directory (see [`super::push_dataset_dir`]).
/// Empty splits are left out (`datasets` cannot load an empty split file by pattern).
pub fn dataset_files(run_dir: &Path, repo: &str, flat: bool) -> Result<Vec<RepoFile>, HubError> {
    let manifest_path = run_dir.join("manifest.json");
    let manifest = match Manifest::read(&manifest_path) {
        Ok(Some(m)) => m,
        Ok(None) => {
            return Err(HubError::Layout {
                path: manifest_path,
                message: "missing: not a generate_conv run directory".into(),
            })
        }
        Err(e) => return Err(e.into()),
    };
    let root = std::fs::canonicalize(run_dir).map_err(|e| io_err(run_dir, e))?;
    let mut files = Vec::new();
    let mut configs = Vec::new();
    let mut wanted = vec![(
        "default",
        vec![
            ("train", run_dir.join("pairs/train.parquet")),
            ("test", run_dir.join("pairs/test.parquet")),
        ],
    )];
    if flat {
        wanted.push(("flat", vec![("train", run_dir.join("flat.parquet"))]));
    }
    for (config, splits) in wanted {
        let mut info = ConfigInfo {
            name: config.to_string(),
            splits: Vec::new(),
            fields: Vec::new(),
        };
        for (split, path) in splits {
            if std::fs::symlink_metadata(&path).is_err() {
                return Err(HubError::Layout {
                    path,
                    message: "missing (run generate_conv to the end first)".into(),
                });
            }
            let rel = path
                .strip_prefix(run_dir)
                .unwrap_or(&path)
                .display()
                .to_string();
            let path = inside_file(&root, &path, &rel)?;
            let (s, fields, file) = split_of(config, split, path)?;
            if s.num_examples == 0 {
                continue;
            }
            info.fields = fields;
            info.splits.push(s);
            files.push(file);
        }
        if info.splits.is_empty() {
            return Err(HubError::Layout {
                path: run_dir.to_path_buf(),
                message: format!("config `{config}` has no rows to publish"),
            });
        }
        configs.push(info);
    }
    let card = dataset_card(repo, &configs, run_dir, &manifest);
    files.push(RepoFile::bytes("README.md", card.into_bytes()));
    Ok(files)
}

fn read_json(path: &Path) -> Option<Value> {
    serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
}

/// A value that the Hub accepts as `base_model`: an `org/name` id that is not a local path
/// (`default` is the Hub id of the default model, `hf:org/name@rev` its repository).
fn hub_model_id(v: &Value) -> Option<String> {
    let s = v.as_str()?;
    let spec: crate::llm::ModelSpec = s.parse().ok()?;
    let id = spec.hub_id()?;
    let valid = super::split_repo(id).is_ok() && !Path::new(s).exists();
    valid.then(|| id.to_string())
}

/// The files of a model push (see [`super::push_model_dir`]).
pub fn model_files(dir: &Path, repo: &str) -> Result<Vec<RepoFile>, HubError> {
    let has = |f: &str| dir.join(f).is_file();
    let peft = has("adapter_model.safetensors") && has("adapter_config.json");
    let full =
        (has("model.safetensors") || has("model.safetensors.index.json")) && has("config.json");
    if !peft && !full {
        return Err(HubError::Layout {
            path: dir.to_path_buf(),
            message: "not a checkpoint: expected model.safetensors + config.json (HF layout) \
                      or adapter_model.safetensors + adapter_config.json (PEFT)"
                .into(),
        });
    }
    // A truncated file, a missing tensor or a wrong shape is caught here, not by whoever
    // downloads the model.
    crate::engine::checkpoint::check_checkpoint_dir(dir).map_err(|e| HubError::Layout {
        path: e.path,
        message: e.message,
    })?;
    crate::run::verify_checksums(dir).map_err(|message| HubError::Layout {
        path: dir.to_path_buf(),
        message,
    })?;
    let root = std::fs::canonicalize(dir).map_err(|e| io_err(dir, e))?;
    let mut files = Vec::new();
    collect(&root, &root, "", &mut files)?;
    refuse_unlisted(dir, &files)?;
    // The optimizer state only serves `dpo_train --resume`; HF does not publish it either.
    // Nor the checksums of what `--resume` reads (they list the optimizer state too).
    files.retain(|f| {
        !matches!(
            f.path_in_repo.as_str(),
            "README.md" | "optimizer.safetensors" | crate::run::CHECKSUMS_FILE
        )
    });
    files.sort_by(|a, b| a.path_in_repo.cmp(&b.path_in_repo));
    let names: Vec<String> = files.iter().map(|f| f.path_in_repo.clone()).collect();
    if crate::run::recorded_checksums(dir).ok().flatten().is_none() {
        // Nothing vouches for these files: say which are published before any upload.
        tracing::warn!(
            "{}: no {}, so nothing is verified; publishing the {} files found: {}",
            dir.display(),
            crate::run::CHECKSUMS_FILE,
            names.len(),
            names.join(", ")
        );
    }
    let card = model_card(dir, repo, peft, &names);
    files.push(RepoFile::bytes("README.md", card.into_bytes()));
    Ok(files)
}

/// In a checkpoint with `checksums.json`, every file to publish must be one it lists: a file
/// added after the checkpoint was saved (a script, a replaced config) is refused by name
/// rather than uploaded unverified. The card is regenerated, so `README.md` may be anything.
fn refuse_unlisted(dir: &Path, files: &[RepoFile]) -> Result<(), HubError> {
    let listed = crate::run::recorded_checksums(dir).map_err(|message| HubError::Layout {
        path: dir.to_path_buf(),
        message,
    })?;
    let Some(listed) = listed else {
        return Ok(());
    };
    let unlisted: Vec<&str> = files
        .iter()
        .map(|f| f.path_in_repo.as_str())
        .filter(|p| !matches!(*p, "README.md" | crate::run::CHECKSUMS_FILE))
        .filter(|p| !listed.contains_key(*p))
        .collect();
    if unlisted.is_empty() {
        return Ok(());
    }
    Err(HubError::Layout {
        path: dir.to_path_buf(),
        message: format!(
            "{} not listed in {} (added after the checkpoint was saved), so not published: \
             {}; remove them, or push a copy of the directory without them",
            if unlisted.len() == 1 {
                "a file is"
            } else {
                "files are"
            },
            crate::run::CHECKSUMS_FILE,
            unlisted.join(", ")
        ),
    })
}

/// The file a published path reads: `path` itself, or for a symbolic link its target when
/// that is a regular file inside the folder being published (`root`, canonical). Any other
/// link (out of the folder, to a folder, dangling) is refused naming the link: a publish
/// never reads the host's files.
pub(crate) fn inside_file(root: &Path, path: &Path, rel: &str) -> Result<PathBuf, HubError> {
    let meta = std::fs::symlink_metadata(path).map_err(|e| io_err(path, e))?;
    let refuse = |message: String| HubError::Layout {
        path: path.to_path_buf(),
        message,
    };
    if meta.file_type().is_file() {
        // A regular file, but maybe reached through a linked folder.
        let real = std::fs::canonicalize(path).map_err(|e| io_err(path, e))?;
        if !real.starts_with(root) {
            return Err(refuse(format!(
                "`{rel}` lies out of the folder being published ({}), reached through a \
                 linked folder; push_hf never follows links out of the folder",
                real.display()
            )));
        }
        return Ok(path.to_path_buf());
    }
    if !meta.file_type().is_symlink() {
        return Err(refuse(format!(
            "`{rel}` is {}, not a regular file; not published",
            crate::run::file_type_name(&meta.file_type())
        )));
    }
    let shown = std::fs::read_link(path)
        .map(|t| t.display().to_string())
        .unwrap_or_default();
    let why = match std::fs::canonicalize(path) {
        Err(_) => "which leads nowhere",
        Ok(target) if !target.starts_with(root) => "out of the folder being published",
        Ok(target) if !target.is_file() => "to something that is not a regular file",
        Ok(target) => return Ok(target),
    };
    Err(refuse(format!(
        "`{rel}` is a symbolic link ({shown}) {why}; push_hf never follows links out of the \
         folder: replace it with the file itself"
    )))
}

/// Every file under `dir` (within `root`, canonical) to publish: hidden files (`.env`,
/// `.git/`, …) are skipped with a message; links only as [`inside_file`] allows.
fn collect(root: &Path, dir: &Path, prefix: &str, out: &mut Vec<RepoFile>) -> Result<(), HubError> {
    let entries = std::fs::read_dir(dir).map_err(|e| io_err(dir, e))?;
    let mut entries: Vec<std::fs::DirEntry> = entries
        .collect::<std::io::Result<_>>()
        .map_err(|e| io_err(dir, e))?;
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let name = e.file_name().to_string_lossy().into_owned();
        let path = e.path();
        let rel = format!("{prefix}{name}");
        let kind = e.file_type().map_err(|err| io_err(&path, err))?;
        if name.starts_with('.') {
            tracing::warn!(
                "{}: skipping `{rel}{}`: hidden files are never published",
                root.display(),
                if kind.is_dir() { "/" } else { "" }
            );
            continue;
        }
        if kind.is_dir() {
            collect(root, &path, &format!("{rel}/"), out)?;
        } else {
            let file = inside_file(root, &path, &rel)?;
            out.push(RepoFile::file(rel, file));
        }
    }
    Ok(())
}

/// The model card: front matter (library, base model, tags) + training settings and results
/// from `training_args.json` / `train_summary.json` when present.
pub fn model_card(dir: &Path, repo: &str, peft: bool, files: &[String]) -> String {
    let args = read_json(&dir.join("training_args.json"));
    let summary = read_json(&dir.join("train_summary.json")).or_else(|| {
        dir.parent()
            .and_then(|p| read_json(&p.join("train_summary.json")))
    });
    let adapter = read_json(&dir.join("adapter_config.json"));
    let base = adapter
        .as_ref()
        .and_then(|a| hub_model_id(&a["base_model_name_or_path"]))
        .or_else(|| {
            let a = args.as_ref()?;
            ["base_model", "model", "policy"]
                .iter()
                .find_map(|k| hub_model_id(&a[*k]))
        });
    // An adapter whose base is a local folder (`dpo_train --save-base`): the weights it was
    // trained on, which the Hub id (if any) only names.
    let local_base = adapter.as_ref().is_some_and(|a| {
        a["base_model_name_or_path"].is_string()
            && hub_model_id(&a["base_model_name_or_path"]).is_none()
    });
    let mut y = format!(
        "library_name: {}\n",
        if peft { "peft" } else { "transformers" }
    );
    if let Some(b) = &base {
        y.push_str(&format!("base_model: {}\n", q(b)));
    }
    y.push_str("tags:\n- collabllm\n- dpo\n- trl\n");
    if peft {
        y.push_str("- lora\n");
    }
    let name = repo.rsplit('/').next().unwrap_or(repo);
    let mut md = format!(
        "---\n{y}---\n\n# {name}\n\n{} trained with collabllm-rs `dpo_train` (CollabLLM: DPO on \
         multiturn-aware preference pairs){}.\n\n",
        if peft {
            "A LoRA adapter (PEFT layout)"
        } else {
            "A causal language model (Hugging Face layout)"
        },
        base.as_ref()
            .map(|b| format!(" from `{b}`"))
            .unwrap_or_default()
    );
    if local_base {
        md.push_str(
            "Its `adapter_config.json` names a local folder as the base: the weights the \
             adapter was trained on, saved beside it by `dpo_train --save-base` (for the \
             embedded default, its GGUF dequantized, which differs slightly from the Hub \
             checkpoint). Load it with that folder present, or point \
             `base_model_name_or_path` at another copy of the same weights.\n\n",
        );
    }
    let table = |title: &str, v: &Value, md: &mut String| {
        if let Some(o) = v.as_object() {
            md.push_str(&format!("## {title}\n\n| key | value |\n|---|---|\n"));
            for (k, v) in o {
                md.push_str(&format!("| {k} | {} |\n", cell(&public_setting(k, v))));
            }
            md.push('\n');
        }
    };
    match (&args, &summary) {
        (None, None) => md.push_str(
            "No training_args.json or train_summary.json was found next to the weights.\n\n",
        ),
        _ => {
            if let Some(a) = &args {
                table("Training settings", a, &mut md);
            }
            if let Some(s) = &summary {
                table("Training summary", s, &mut md);
            }
        }
    }
    md.push_str("## Files\n\n");
    for f in files {
        md.push_str(&format!("- `{f}`\n"));
    }
    md.push_str("\n## Use\n\n```python\n");
    if peft {
        md.push_str(&format!(
            "from peft import AutoPeftModelForCausalLM\n\nmodel = AutoPeftModelForCausalLM.from_pretrained({})\n",
            q(repo)
        ));
    } else {
        md.push_str(&format!(
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n\
             model = AutoModelForCausalLM.from_pretrained({r})\ntokenizer = AutoTokenizer.from_pretrained({r})\n",
            r = q(repo)
        ));
    }
    md.push_str("```\n");
    if !peft {
        md.push_str(&format!(
            "\nWith collabllm-rs: `serve --model {repo}` or `generate_conv --policy {repo}`.\n"
        ));
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    fn front_matter(card: &str) -> &str {
        card.strip_prefix("---\n")
            .and_then(|rest| rest.split("---\n").next())
            .unwrap_or_else(|| panic!("no front matter:\n{card}"))
    }

    /// Cards name the Hub id of the base, whatever spelling the run recorded, so the Hub
    /// links the model to it and PEFT finds it.
    #[test]
    fn model_cards_name_the_hub_base_model() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let card_with = |model: &str| {
            std::fs::write(
                dir.join("training_args.json"),
                serde_json::json!({ "model": model, "beta": 0.1 }).to_string(),
            )
            .unwrap();
            model_card(dir, "alice/m", false, &[])
        };
        let card = card_with("default");
        let y = front_matter(&card);
        assert!(y.contains("library_name: transformers\n"), "{y}");
        assert!(
            y.contains("base_model: \"HuggingFaceTB/SmolLM2-135M-Instruct\"\n"),
            "{y}"
        );
        let y = card_with("hf:org/base@v2");
        assert!(
            front_matter(&y).contains("base_model: \"org/base\"\n"),
            "{y}"
        );
        // A local path is no Hub id: no base_model rather than a path.
        let local = dir.display().to_string();
        assert!(!card_with(&local).contains("base_model:"));

        // An adapter: library peft, base from adapter_config.json.
        std::fs::write(
            dir.join("adapter_config.json"),
            r#"{"base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}"#,
        )
        .unwrap();
        let card = model_card(dir, "alice/m", true, &[]);
        assert!(!card.contains("saved beside it"), "a Hub base: {card}");
        let y = front_matter(&card);
        assert!(y.contains("library_name: peft\n"), "{y}");
        assert!(
            y.contains("base_model: \"HuggingFaceTB/SmolLM2-135M-Instruct\"\n"),
            "{y}"
        );
    }

    #[test]
    fn model_card_shows_no_local_path_or_endpoint() {
        let dir = tempfile::tempdir().unwrap();
        let home = dir.path().display().to_string();
        let args = serde_json::json!({
            "model": format!("{home}/models/base.gguf"),
            "data": format!("{home}/runs/math/pairs"),
            "output": format!("{home}/ckpt"),
            "eval_data": "openai:m@http://u:PASS@10.1.2.3/v1",
            "lr": 5e-6,
        });
        std::fs::write(dir.path().join("training_args.json"), args.to_string()).unwrap();
        let card = model_card(dir.path(), "alice/m", false, &["model.safetensors".into()]);
        for private in [home.as_str(), "PASS", "10.1.2.3", "u:"] {
            assert!(!card.contains(private), "card shows `{private}`:\n{card}");
        }
        assert!(card.contains("| model | local model base.gguf |"), "{card}");
        assert!(card.contains("| data | pairs |"), "{card}");
        assert!(
            card.contains("| lr | 0.000005 |") || card.contains("| lr | 5e-6 |"),
            "{card}"
        );
    }

    /// An adapter saved with its base (`--save-base`) records that folder's absolute path;
    /// the card says the base is the saved local copy, without printing the path.
    #[test]
    fn a_saved_base_is_named_without_its_path() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let base = dir.join("base").display().to_string();
        std::fs::write(
            dir.join("adapter_config.json"),
            serde_json::json!({ "base_model_name_or_path": base }).to_string(),
        )
        .unwrap();
        std::fs::write(
            dir.join("training_args.json"),
            serde_json::json!({ "model": "default" }).to_string(),
        )
        .unwrap();
        let card = model_card(dir, "alice/m", true, &[]);
        assert!(
            card.contains("saved beside it by `dpo_train --save-base`"),
            "{card}"
        );
        assert!(!card.contains(&base), "{card}");
    }
}
