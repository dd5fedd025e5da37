//! `push_hf` against a fake Hub on 127.0.0.1: a dataset run and a LoRA adapter are pushed with
//! the exact files, LFS objects and commit message expected; a second push is a no-op; 401 and
//! 5xx are reported clearly (5xx retried); the token never appears in an error; the dataset
//! card's YAML parses and lists what was written; `--dry-run` writes the same layout.

mod common;
use common::fake_hub;
use common::model_util;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use collabllm::dataset::{write_flat_parquet, write_pairs_parquet, FlatRow, PairRow};
use collabllm::hub::{self, HubError, PushOptions, RetryPolicy, Token};
use collabllm::llm::ChatMessage;
use fake_hub::{FakeHub, Stored};
use serde_json::json;
use sha2::Digest as _;
use yaml_rust2::{Yaml, YamlLoader};

const TOKEN: &str = "hf_TestSecretToken123";

fn pair(conv: &str, turn: u32) -> PairRow {
    PairRow {
        prompt: vec![
            ChatMessage::user("I need help with a sum."),
            ChatMessage::assistant("Which numbers?"),
            ChatMessage::user(format!("conversation {conv}")),
        ],
        chosen: vec![ChatMessage::assistant("Do you want the exact value?")],
        rejected: vec![ChatMessage::assistant("42.")],
        score_chosen: 0.8,
        score_rejected: 0.1,
        conv_id: conv.into(),
        turn_id: turn,
    }
}

fn flat(conv: &str, turn: u32, score: f64) -> FlatRow {
    FlatRow {
        prompt: vec![ChatMessage::user("I need help with a sum.")],
        completion: format!("candidate {score}"),
        conv_id: conv.into(),
        turn_id: turn,
        score,
        single_turn_prompt: "What is 2+3?".into(),
        single_turn_completion: "5".into(),
        single_turn_metadata: json!({"level": "Level 1"}),
        sessions: json!([[{"role": "user", "content": "2 and 3"}]]),
        rewards: json!({"MR": [score], "accuracy": [1.0]}),
    }
}

/// A finished generate_conv run directory: 3 train pairs (2 conversations), 1 test pair,
/// 4 flat rows, and a manifest in the generate_conv format.
fn write_run(dir: &Path) {
    std::fs::create_dir_all(dir.join("pairs")).unwrap();
    write_pairs_parquet(
        &dir.join("pairs/train.parquet"),
        &[pair("c1", 0), pair("c1", 1), pair("c2", 0)],
    )
    .unwrap();
    write_pairs_parquet(&dir.join("pairs/test.parquet"), &[pair("c3", 0)]).unwrap();
    write_flat_parquet(
        &dir.join("flat.parquet"),
        &[
            flat("c1", 0, 0.8),
            flat("c1", 0, 0.1),
            flat("c2", 0, 0.5),
            flat("c3", 0, 0.2),
        ],
    )
    .unwrap();
    let manifest = json!({
        "tool": "collabllm-rs generate_conv", "version": "0.1.0", "git_revision": "abc123",
        "status": "complete", "seed": 7,
        "config": {"tasks": "data/math.jsonl", "policy": "default", "user": "default",
                   "judge": "openai:gpt-4o-mini", "assistant": null, "candidates": 3,
                   "samples": 2, "window": 4, "max_messages": 14, "min_gap": 0.05,
                   "pairs": "best", "mr_formula": "mean", "test_fraction": 0.25, "seed": 7,
                   "metrics": {"accuracy": 1.0, "token_amount": -0.1}},
        "counts": {"conversations": 3, "turns": 5, "pairs_train": 3, "pairs_test": 1},
    });
    std::fs::write(
        dir.join("manifest.json"),
        serde_json::to_string_pretty(&manifest).unwrap(),
    )
    .unwrap();
}

/// A PEFT LoRA adapter directory (hand-written safetensors) inside a dpo_train output.
fn write_adapter(root: &Path) -> PathBuf {
    let dir = root.join("final");
    std::fs::create_dir_all(&dir).unwrap();
    let header = br#"{"base_model.model.layers.0.self_attn.q_proj.lora_A.weight":{"dtype":"F32","shape":[2,4],"data_offsets":[0,32]}}"#;
    let mut st = (header.len() as u64).to_le_bytes().to_vec();
    st.extend_from_slice(header);
    for i in 0..8u32 {
        st.extend_from_slice(&(i as f32 * 0.25).to_le_bytes());
    }
    std::fs::write(dir.join("adapter_model.safetensors"), st).unwrap();
    std::fs::write(
        dir.join("adapter_config.json"),
        r#"{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
            "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "task_type": "CAUSAL_LM"}"#,
    )
    .unwrap();
    std::fs::write(
        dir.join("training_args.json"),
        r#"{"loss": "sigmoid", "beta": 0.1, "learning_rate": 5e-6, "epochs": 1, "lora_r": 8}"#,
    )
    .unwrap();
    std::fs::write(
        root.join("train_summary.json"),
        r#"{"steps": 12, "final_loss": 0.61, "eval_rewards/accuracies": 0.75}"#,
    )
    .unwrap();
    dir
}

fn opts(hub: &FakeHub, token: &str) -> PushOptions {
    PushOptions {
        endpoint: hub.url.clone(),
        token: Some(Token::new(token)),
        private: true,
        message: None,
        dry_run: None,
        retry: RetryPolicy {
            max_retries: 3,
            base: Duration::from_millis(10),
            cap: Duration::from_millis(50),
        },
    }
}

fn sha256(bytes: &[u8]) -> String {
    hex::encode(sha2::Sha256::digest(bytes))
}

/// The card's YAML front matter, parsed.
fn front_matter(card: &str) -> Yaml {
    let rest = card.strip_prefix("---\n").expect("card starts with ---");
    let end = rest.find("\n---\n").expect("front matter ends with ---");
    let docs = YamlLoader::load_from_str(&rest[..end]).expect("front matter is valid YAML");
    docs.into_iter().next().unwrap()
}

fn names(list: &Yaml, key: &str) -> Vec<String> {
    list.as_vec()
        .unwrap()
        .iter()
        .map(|f| f[key].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test]
async fn dataset_push_lfs_card_and_idempotence() {
    let hub = FakeHub::start(TOKEN).await;
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    write_run(&run);
    let mut o = opts(&hub, TOKEN);
    o.message = Some("Add CollabLLM math pairs".into());

    let report = hub::push_dataset_dir(&run, "alice/collab-math", true, &o)
        .await
        .unwrap();
    assert!(report.created);
    assert!(report.commit.is_some());
    let repo = hub.repo("datasets/alice/collab-math");
    assert!(repo.private, "private by default");
    let paths: BTreeSet<&str> = repo.files.keys().map(String::as_str).collect();
    assert_eq!(
        paths,
        BTreeSet::from([
            ".gitattributes",
            "README.md",
            "data/test-00000-of-00001.parquet",
            "data/train-00000-of-00001.parquet",
            "flat/train-00000-of-00001.parquet",
        ])
    );
    // Parquet files went through LFS with their SHA-256 and size; the bytes arrived intact.
    for (remote, local) in [
        ("data/train-00000-of-00001.parquet", "pairs/train.parquet"),
        ("data/test-00000-of-00001.parquet", "pairs/test.parquet"),
        ("flat/train-00000-of-00001.parquet", "flat.parquet"),
    ] {
        let bytes = std::fs::read(run.join(local)).unwrap();
        let expected = Stored::Lfs {
            oid: sha256(&bytes),
            size: bytes.len() as u64,
        };
        assert_eq!(repo.files[remote], expected, "{remote}");
        assert_eq!(hub.lfs_object(&sha256(&bytes)).unwrap(), bytes);
    }
    assert_eq!(hub.lfs_uploads(), 3);
    let commits = hub.commits();
    assert_eq!(commits.len(), 1);
    assert_eq!(commits[0].summary, "Add CollabLLM math pairs");
    assert_eq!(commits[0].repo, "datasets/alice/collab-math");

    // The card: YAML front matter in the Hub's format, listing the splits and features written.
    let Stored::Inline(card) = &repo.files["README.md"] else {
        panic!("README.md should be inline");
    };
    let card = String::from_utf8(card.clone()).unwrap();
    let y = front_matter(&card);
    let configs = y["configs"].as_vec().unwrap();
    assert_eq!(names(&y["configs"], "config_name"), ["default", "flat"]);
    let files: Vec<(String, String)> = configs[0]["data_files"]
        .as_vec()
        .unwrap()
        .iter()
        .map(|d| {
            (
                d["split"].as_str().unwrap().into(),
                d["path"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert_eq!(
        files,
        [
            ("train".into(), "data/train-00000-of-00001.parquet".into()),
            ("test".into(), "data/test-00000-of-00001.parquet".into())
        ]
    );
    let info = &y["dataset_info"].as_vec().unwrap()[0];
    assert_eq!(
        names(&info["features"], "name"),
        [
            "prompt",
            "chosen",
            "rejected",
            "score_chosen",
            "score_rejected",
            "conv_id",
            "turn_id"
        ]
    );
    let prompt = &info["features"].as_vec().unwrap()[0];
    assert_eq!(names(&prompt["list"], "name"), ["role", "content"]);
    assert_eq!(prompt["list"][0]["dtype"].as_str(), Some("string"));
    assert_eq!(info["features"][3]["dtype"].as_str(), Some("float64"));
    assert_eq!(info["features"][6]["dtype"].as_str(), Some("int64"));
    let splits: Vec<(String, i64)> = info["splits"]
        .as_vec()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["name"].as_str().unwrap().into(),
                s["num_examples"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(splits, [("train".into(), 3), ("test".into(), 1)]);
    let flat_info = &y["dataset_info"].as_vec().unwrap()[1];
    assert!(names(&flat_info["features"], "name").contains(&"single_turn_prompt".to_string()));
    // The card describes the nested columns as what they are, not as JSON text.
    assert!(!card.contains("json.loads"), "{card}");
    for needle in [
        "`single_turn_metadata` is a struct",
        "`sessions` a list",
        "`rewards` a struct",
    ] {
        assert!(card.contains(needle), "card lacks {needle:?}:\n{card}");
    }
    // The nested upstream columns are declared the way the public CollabLLM cards declare them.
    let feature = |name: &str| {
        flat_info["features"]
            .as_vec()
            .unwrap()
            .iter()
            .find(|f| f["name"].as_str() == Some(name))
            .unwrap()
            .clone()
    };
    assert_eq!(
        names(&feature("sessions")["list"]["list"], "name"),
        ["content", "role"]
    );
    let rewards = feature("rewards");
    assert_eq!(names(&rewards["struct"], "name"), ["MR", "accuracy"]);
    assert_eq!(rewards["struct"][0]["sequence"].as_str(), Some("float64"));
    assert_eq!(
        feature("single_turn_metadata")["struct"][0]["name"].as_str(),
        Some("level")
    );
    assert_eq!(flat_info["splits"][0]["num_examples"].as_i64(), Some(4));
    // The body says how the data was made, from the manifest.
    for needle in [
        "| candidates per turn (N) | 3 |",
        "| futures per candidate (S) | 2 |",
        "| window (messages per future) | 4 |",
        "| minimum MR gap | 0.05 |",
        "| seed | 7 |",
        "accuracy=1.0, token_amount=-0.1",
        "| judge | OpenAI-compatible endpoint, model gpt-4o-mini |",
        "collabllm-rs generate_conv 0.1.0 (git abc123)",
        "| pairs_train | 3 |",
        "load_dataset(\"alice/collab-math\")",
        "DPOTrainer(",
    ] {
        assert!(card.contains(needle), "card lacks {needle:?}:\n{card}");
    }

    // Second push of the same content: no commit, no upload.
    let lfs_before = hub.count("/lfs-upload/");
    let again = hub::push_dataset_dir(&run, "alice/collab-math", true, &o)
        .await
        .unwrap();
    assert!(!again.created);
    assert_eq!(again.commit, None);
    assert!(
        again.files.iter().all(|f| f.action == "unchanged"),
        "{again}"
    );
    assert_eq!(hub.commits().len(), 1);
    assert_eq!(hub.count("/lfs-upload/"), lfs_before);
    assert_eq!(
        hub.count("/preupload/"),
        1,
        "no preupload when nothing changed"
    );

    // Without the flat config only the card changes: one commit with README.md alone.
    let third = hub::push_dataset_dir(&run, "alice/collab-math", false, &o)
        .await
        .unwrap();
    assert!(third.commit.is_some());
    let commits = hub.commits();
    assert_eq!(commits.len(), 2);
    assert_eq!(commits[1].paths, ["README.md"]);
    assert_eq!(hub.lfs_uploads(), 3);
}

#[tokio::test]
async fn lora_adapter_push_and_model_card() {
    let hub = FakeHub::start(TOKEN).await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = write_adapter(tmp.path());
    let mut o = opts(&hub, TOKEN);
    o.private = false;
    let report = hub::push_model_dir(&dir, "alice/smol-collab-lora", &o)
        .await
        .unwrap();
    assert!(report.commit.is_some());
    let repo = hub.repo("models/alice/smol-collab-lora");
    assert!(!repo.private, "--public");
    let paths: BTreeSet<&str> = repo.files.keys().map(String::as_str).collect();
    assert_eq!(
        paths,
        BTreeSet::from([
            ".gitattributes",
            "README.md",
            "adapter_config.json",
            "adapter_model.safetensors",
            "training_args.json",
        ])
    );
    let weights = std::fs::read(dir.join("adapter_model.safetensors")).unwrap();
    assert_eq!(
        repo.files["adapter_model.safetensors"],
        Stored::Lfs {
            oid: sha256(&weights),
            size: weights.len() as u64
        }
    );
    assert_eq!(
        repo.files["adapter_config.json"],
        Stored::Inline(std::fs::read(dir.join("adapter_config.json")).unwrap())
    );
    let commits = hub.commits();
    assert_eq!(commits.len(), 1);
    assert_eq!(
        commits[0].summary,
        format!(
            "Upload model with collabllm-rs {}",
            env!("CARGO_PKG_VERSION")
        )
    );
    let Stored::Inline(card) = &repo.files["README.md"] else {
        panic!("README.md should be inline");
    };
    let card = String::from_utf8(card.clone()).unwrap();
    let y = front_matter(&card);
    assert_eq!(y["library_name"].as_str(), Some("peft"));
    assert_eq!(
        y["base_model"].as_str(),
        Some("HuggingFaceTB/SmolLM2-135M-Instruct")
    );
    for needle in [
        "| beta | 0.1 |",
        "| final_loss | 0.61 |",
        "AutoPeftModelForCausalLM.from_pretrained(\"alice/smol-collab-lora\")",
        "- `adapter_model.safetensors`",
    ] {
        assert!(card.contains(needle), "card lacks {needle:?}:\n{card}");
    }

    let again = hub::push_model_dir(&dir, "alice/smol-collab-lora", &o)
        .await
        .unwrap();
    assert_eq!(again.commit, None);
    assert_eq!(hub.commits().len(), 1);
    assert_eq!(hub.lfs_uploads(), 1);

    // A directory that is no checkpoint is refused, naming it.
    let e = hub::push_model_dir(tmp.path(), "alice/x", &o)
        .await
        .unwrap_err();
    assert!(matches!(e, HubError::Layout { .. }), "{e}");
    assert!(e.to_string().contains("adapter_model.safetensors"), "{e}");
}

#[tokio::test]
async fn unauthorized_is_clear_not_retried_and_never_shows_the_token() {
    let hub = FakeHub::start(TOKEN).await;
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    write_run(&run);
    let wrong = "hf_WrongSecretValue987";
    let e = hub::push_dataset_dir(&run, "alice/d", false, &opts(&hub, wrong))
        .await
        .unwrap_err();
    assert!(matches!(e, HubError::Auth { status: 401, .. }), "{e}");
    let text = format!("{e} {e:?}");
    assert!(
        text.contains("401") && text.contains("/api/repos/create"),
        "{text}"
    );
    assert!(!text.contains(wrong), "token leaked: {text}");
    assert_eq!(hub.count("/api/repos/create"), 1, "401 is not retried");

    // No token at all.
    let mut o = opts(&hub, TOKEN);
    o.token = None;
    let e = hub::push_dataset_dir(&run, "alice/d", false, &o)
        .await
        .unwrap_err();
    assert!(matches!(e, HubError::NoToken { .. }), "{e}");
    assert!(e.to_string().contains("HF_TOKEN"));

    // Invalid repository id.
    let e = hub::push_dataset_dir(&run, "not-a-repo", false, &opts(&hub, TOKEN))
        .await
        .unwrap_err();
    assert!(matches!(e, HubError::InvalidRepo { .. }), "{e}");
}

#[tokio::test]
async fn server_errors_are_retried_then_reported() {
    let hub = FakeHub::start(TOKEN).await;
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    write_run(&run);
    // Two 503s on the commit and one 429 on the LFS batch: retried, then the push succeeds.
    hub.fail("/commit/main", 503, 2);
    hub.fail("/info/lfs/objects/batch", 429, 1);
    let report = hub::push_dataset_dir(&run, "alice/d", false, &opts(&hub, TOKEN))
        .await
        .unwrap();
    assert!(report.commit.is_some());
    assert_eq!(hub.count("/commit/main"), 3);
    assert_eq!(hub.count("/info/lfs/objects/batch"), 2);
    assert_eq!(hub.commits().len(), 1);

    // A server that keeps failing: bounded retries (1 + 3), then a clear error whose text
    // has the status but not the token the server echoed back.
    hub.fail("/tree/main", 500, 100);
    let e = hub::push_dataset_dir(&run, "alice/d", false, &opts(&hub, TOKEN))
        .await
        .unwrap_err();
    match &e {
        HubError::GaveUp { attempts, last, .. } => {
            assert_eq!(*attempts, 4);
            assert!(last.contains("HTTP 500"), "{last}");
        }
        other => panic!("expected GaveUp, got {other}"),
    }
    assert_eq!(hub.count("/tree/main"), 1 + 4);
    let text = format!("{e} {e:?}");
    assert!(text.contains("Bearer ***"), "the echo is redacted: {text}");
    assert!(!text.contains(TOKEN), "token leaked: {text}");

    // A 4xx other than 401/403/429 is not retried.
    hub.clear_faults();
    let before = hub.count("/preupload/");
    hub.fail("/preupload/", 400, 1);
    let mut o = opts(&hub, TOKEN);
    o.message = Some("changed".into());
    // Change the card so that a preupload is needed.
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("manifest.json")).unwrap()).unwrap();
    m["seed"] = json!(8);
    std::fs::write(run.join("manifest.json"), m.to_string()).unwrap();
    let e = hub::push_dataset_dir(&run, "alice/d", false, &o)
        .await
        .unwrap_err();
    assert!(matches!(e, HubError::Status { status: 400, .. }), "{e}");
    assert_eq!(hub.count("/preupload/"), before + 1);
}

#[tokio::test]
async fn dry_run_writes_the_exact_layout() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    write_run(&run);
    let out = tmp.path().join("layout");
    let o = PushOptions {
        endpoint: "http://127.0.0.1:9".into(),
        token: None,
        private: true,
        message: None,
        dry_run: Some(out.clone()),
        retry: RetryPolicy::default(),
    };
    let report = hub::push_dataset_dir(&run, "alice/collab-math", false, &o)
        .await
        .unwrap();
    assert!(report.dry_run);
    let layout = |out: &Path| {
        let mut written: Vec<String> = walk(out)
            .iter()
            .map(|e| e.strip_prefix(out).unwrap().display().to_string())
            .filter(|p| p != hub::DRY_RUN_MARKER)
            .collect();
        written.sort();
        written
    };
    assert_eq!(
        layout(&out),
        [
            "README.md",
            "data/test-00000-of-00001.parquet",
            "data/train-00000-of-00001.parquet"
        ]
    );
    assert_eq!(
        std::fs::read(out.join("data/train-00000-of-00001.parquet")).unwrap(),
        std::fs::read(run.join("pairs/train.parquet")).unwrap()
    );
    let card = std::fs::read_to_string(out.join("README.md")).unwrap();
    assert_eq!(
        names(&front_matter(&card)["configs"], "config_name"),
        ["default"]
    );

    // A second dry run over the first replaces it: no stale file of the first survives.
    std::fs::write(out.join("data/stale.parquet"), b"old").unwrap();
    hub::push_dataset_dir(&run, "alice/collab-math", false, &o)
        .await
        .unwrap();
    assert!(!out.join("data/stale.parquet").exists());
    assert_eq!(layout(&out).len(), 3);

    // A directory with other files is refused and left as it was.
    let other = tmp.path().join("mine");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("notes.txt"), b"keep").unwrap();
    let o2 = PushOptions {
        dry_run: Some(other.clone()),
        ..o.clone()
    };
    let e = hub::push_dataset_dir(&run, "alice/collab-math", false, &o2)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("--dry-run"), "{e}");
    assert_eq!(std::fs::read(other.join("notes.txt")).unwrap(), b"keep");
    assert_eq!(walk(&other).len(), 1);
    // An empty existing directory is fine.
    let empty = tmp.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let o3 = PushOptions {
        dry_run: Some(empty.clone()),
        ..o.clone()
    };
    hub::push_dataset_dir(&run, "alice/collab-math", false, &o3)
        .await
        .unwrap();
    assert_eq!(layout(&empty).len(), 3);
    // Nothing left beside them.
    let mut beside: Vec<String> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    beside.sort();
    assert_eq!(beside, ["empty", "layout", "mine", "run"]);
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

fn run_push_hf(
    args: Vec<String>,
    token: &'static str,
    home: PathBuf,
) -> (Option<i32>, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_push_hf"))
        .args(args)
        .env("HF_TOKEN", token)
        .env("HF_HOME", home)
        .env("RUST_LOG", "debug")
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The binary end to end: token from HF_TOKEN, endpoint from --endpoint, the report on stdout;
/// a wrong token exits 1 with a clear message and no token anywhere in the output.
#[tokio::test]
async fn push_hf_binary() {
    let hub = FakeHub::start(TOKEN).await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = write_adapter(tmp.path());
    let args: Vec<String> = [
        "model",
        dir.to_str().unwrap(),
        "--repo",
        "bob/lora",
        "--endpoint",
        &hub.url,
        "--message",
        "first",
        "--max-retries",
        "0",
    ]
    .map(String::from)
    .to_vec();
    let home = tmp.path().join("hf-home");
    let (a, h) = (args.clone(), home.clone());
    let (code, stdout, stderr) = tokio::task::spawn_blocking(move || run_push_hf(a, TOKEN, h))
        .await
        .unwrap();
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    assert!(stdout.contains("commit "), "{stdout}");
    assert!(!stdout.contains(TOKEN) && !stderr.contains(TOKEN));
    assert_eq!(hub.commits()[0].summary, "first");

    let wrong = "hf_BinaryWrongSecret55";
    let (code, stdout, stderr) =
        tokio::task::spawn_blocking(move || run_push_hf(args, wrong, home))
            .await
            .unwrap();
    assert_eq!(code, Some(1), "{stdout}\n{stderr}");
    assert!(stderr.contains("error: pushing model bob/lora"), "{stderr}");
    assert!(stderr.contains("HTTP 401"), "{stderr}");
    assert!(
        !stdout.contains(wrong) && !stderr.contains(wrong),
        "{stderr}"
    );
}

/// `generate_conv --import … --push-to-hub` pushes once, at the end, with HF_TOKEN and
/// HF_ENDPOINT; without a token it refuses before doing any work.
#[tokio::test]
async fn generate_conv_push_to_hub_at_the_end() {
    let hub = FakeHub::start(TOKEN).await;
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    write_run(&run);
    let flat = run.join("flat.parquet");
    let out = tmp.path().join("imported");
    let home = tmp.path().join("hf-home");
    let cmd = |token: Option<&'static str>, out: PathBuf| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_generate_conv"));
        c.args(["--import", flat.to_str().unwrap(), "--task-type", "math"])
            .args(["--output", out.to_str().unwrap()])
            .args(["--test-fraction", "0", "--push-to-hub", "alice/imported"])
            .env("HF_ENDPOINT", &hub.url)
            .env("HF_HOME", &home)
            .env_remove("HF_TOKEN");
        if let Some(t) = token {
            c.env("HF_TOKEN", t);
        }
        c
    };
    let mut no_token = cmd(None, tmp.path().join("never"));
    let o = tokio::task::spawn_blocking(move || no_token.output().unwrap())
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(stderr.contains("HF_TOKEN"), "{stderr}");
    assert!(
        !tmp.path().join("never").exists(),
        "refused before any work"
    );
    assert!(hub.commits().is_empty());

    let mut with_token = cmd(Some(TOKEN), out.clone());
    let o = tokio::task::spawn_blocking(move || with_token.output().unwrap())
        .await
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(o.status.success(), "{stdout}\n{stderr}");
    assert!(!stdout.contains(TOKEN) && !stderr.contains(TOKEN));
    let commits = hub.commits();
    assert_eq!(commits.len(), 1);
    assert_eq!(commits[0].repo, "datasets/alice/imported");
    let repo = hub.repo("datasets/alice/imported");
    assert!(repo.private);
    // 4 flat rows → 1 pair (c1 turn 0; c2 and c3 have one candidate each), in train.
    let bytes = std::fs::read(out.join("pairs/train.parquet")).unwrap();
    assert_eq!(
        repo.files["data/train-00000-of-00001.parquet"],
        Stored::Lfs {
            oid: sha256(&bytes),
            size: bytes.len() as u64
        }
    );
    assert!(
        !repo.files.contains_key("data/test-00000-of-00001.parquet"),
        "empty split left out"
    );
}

#[tokio::test]
async fn a_twenty_questions_card_states_oracle_rewards_weights_and_split() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    write_run(&run);
    let mut manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("manifest.json")).unwrap()).unwrap();
    manifest["config"]["tasks"] = json!("20q:train");
    manifest["config"]["task_type"] = json!("twenty_questions");
    manifest["config"]["oracle"] = json!("hybrid");
    manifest["config"]["max_questions"] = json!(20);
    manifest["config"]["metrics"] = json!({"success": 1.0, "info_gain": 1.0, "token_amount": -0.5});
    std::fs::write(run.join("manifest.json"), manifest.to_string()).unwrap();
    let out = tmp.path().join("layout");
    let o = PushOptions {
        endpoint: "http://127.0.0.1:9".into(),
        token: None,
        private: true,
        message: None,
        dry_run: Some(out.clone()),
        retry: RetryPolicy::default(),
    };
    hub::push_dataset_dir(&run, "alice/collab-20q", false, &o)
        .await
        .unwrap();
    let card = std::fs::read_to_string(out.join("README.md")).unwrap();
    for want in [
        "## 20 Questions",
        "| oracle (the simulated user) | hybrid: the attribute table when it parses the question, the user model (local model SmolLM2-135M-Instruct (the built-in default)) otherwise |",
        "| questions per game | 20 |",
        "split `train`",
        "~20% of each category held out",
        "| reward weights | info_gain=1.0, success=1.0, token_amount=-0.5 |",
        "`20q-infogain` = success 1, info_gain 1, token_amount −0.5",
        "log2(|objects consistent before| / |after|)",
    ] {
        assert!(card.contains(want), "card lacks {want:?}:\n{card}");
    }
    // A math run's card says nothing about 20 Questions.
    write_run(&run);
    hub::push_dataset_dir(&run, "alice/collab-math", false, &o)
        .await
        .unwrap();
    let card = std::fs::read_to_string(out.join("README.md")).unwrap();
    assert!(!card.contains("20 Questions"), "{card}");
}

/// A checkpoint that is not whole is refused before anything is uploaded: a truncated
/// safetensors file, a tensor missing, a shape its config.json does not imply.
#[tokio::test]
async fn broken_checkpoints_are_refused_before_any_upload() {
    use collabllm::engine::checkpoint::check_checkpoint_dir;
    let hub = FakeHub::start(TOKEN).await;
    let o = opts(&hub, TOKEN);
    let (_g, dir) = model_util::tiny_model_dir(&collabllm::engine::tiny::TinySpec::default());
    check_checkpoint_dir(&dir).unwrap();
    let weights = dir.join("model.safetensors");
    let whole = std::fs::read(&weights).unwrap();
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let refused = |needle: &'static str| {
        let dir = dir.clone();
        let o = o.clone();
        async move {
            let e = hub::push_model_dir(&dir, "alice/broken", &o)
                .await
                .unwrap_err();
            assert!(matches!(e, HubError::Layout { .. }), "{e}");
            assert!(e.to_string().contains(needle), "{needle}: {e}");
        }
    };

    std::fs::write(&weights, &whole[..whole.len() - 10]).unwrap();
    refused("truncated").await;

    std::fs::write(&weights, &whole).unwrap();
    let mut tensors = candle_core::safetensors::load(&weights, &candle_core::Device::Cpu).unwrap();
    tensors.remove("model.layers.0.mlp.up_proj.weight").unwrap();
    candle_core::safetensors::save(&tensors, &weights).unwrap();
    refused("missing tensor `model.layers.0.mlp.up_proj.weight`").await;

    std::fs::write(&weights, &whole).unwrap();
    let v: serde_json::Value = serde_json::from_str(&config).unwrap();
    let mut wrong = v.clone();
    wrong["intermediate_size"] = json!(v["intermediate_size"].as_u64().unwrap() + 8);
    std::fs::write(dir.join("config.json"), wrong.to_string()).unwrap();
    refused("config.json implies").await;

    // With checksums.json: a file added afterwards is named and not published; a list made
    // unreadable by one byte refuses the push instead of turning verification off.
    std::fs::write(dir.join("config.json"), &config).unwrap();
    collabllm::run::write_checksums(&dir).unwrap();
    std::fs::write(dir.join("evil.py"), "import os").unwrap();
    refused("evil.py").await;
    std::fs::remove_file(dir.join("evil.py")).unwrap();
    let list = dir.join(collabllm::run::CHECKSUMS_FILE);
    let mut bytes = std::fs::read(&list).unwrap();
    bytes[2] = 0xFF;
    std::fs::write(&list, bytes).unwrap();
    refused("damaged").await;
    assert!(hub.commits().is_empty(), "nothing was pushed");
    assert_eq!(hub.lfs_uploads(), 0);
}

/// A checkpoint folder without checksums.json: a link to a file outside the folder, or to a
/// folder outside it, is refused naming the link before anything is uploaded; a link to a
/// file inside is published as that file; dot-files (`.env`, `.git/`) are skipped. With a
/// partial list (an empty one), the push refuses the files it leaves out, as `--resume` does.
#[tokio::test]
async fn links_out_of_the_folder_are_refused_and_hidden_files_skipped() {
    let hub = FakeHub::start(TOKEN).await;
    let o = opts(&hub, TOKEN);
    let (_g, dir) = model_util::tiny_model_dir(&collabllm::engine::tiny::TinySpec::default());
    let outside = tempfile::tempdir().unwrap();
    let secret = outside.path().join("passwd");
    std::fs::write(&secret, "root:x:0:0").unwrap();
    std::fs::create_dir_all(outside.path().join("secrets")).unwrap();
    std::fs::write(outside.path().join("secrets/key"), "k").unwrap();
    let push = |dir: PathBuf, o: PushOptions| async move {
        hub::push_model_dir(&dir, "alice/linked", &o).await
    };

    let link = dir.join("notes.txt");
    std::os::unix::fs::symlink(&secret, &link).unwrap();
    let e = push(dir.clone(), o.clone()).await.unwrap_err().to_string();
    assert!(
        e.contains("`notes.txt` is a symbolic link") && e.contains("out of the folder"),
        "{e}"
    );
    std::fs::remove_file(&link).unwrap();
    std::os::unix::fs::symlink(outside.path().join("secrets"), dir.join("extra")).unwrap();
    let e = push(dir.clone(), o.clone()).await.unwrap_err().to_string();
    assert!(e.contains("`extra` is a symbolic link"), "{e}");
    std::fs::remove_file(dir.join("extra")).unwrap();
    assert!(hub.commits().is_empty(), "nothing was pushed");
    assert_eq!(hub.lfs_uploads(), 0);

    // A link inside the folder is published as the file; hidden files are skipped.
    std::fs::write(dir.join("notes.md"), "about").unwrap();
    std::os::unix::fs::symlink(dir.join("notes.md"), dir.join("notes.txt")).unwrap();
    std::fs::write(dir.join(".env"), "HF_TOKEN=x").unwrap();
    std::fs::create_dir_all(dir.join(".git")).unwrap();
    std::fs::write(dir.join(".git/config"), "x").unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("layout");
    let dry = PushOptions {
        dry_run: Some(out.clone()),
        ..o.clone()
    };
    push(dir.clone(), dry.clone()).await.unwrap();
    assert_eq!(std::fs::read(out.join("notes.txt")).unwrap(), b"about");
    assert!(!out.join(".env").exists() && !out.join(".git").exists());

    // An empty checksum list verifies nothing: refused, naming what it leaves out.
    std::fs::write(
        dir.join(collabllm::run::CHECKSUMS_FILE),
        r#"{"sha256": {}}"#,
    )
    .unwrap();
    let e = push(dir.clone(), dry).await.unwrap_err().to_string();
    assert!(e.contains("not listed") && e.contains("config.json"), "{e}");
}
