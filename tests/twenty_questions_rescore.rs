//! 20 Questions games from elsewhere re-scored under our rules (`--transcripts`, LMRL-Gym's
//! offline form) and runs compared on paired games (`--compare`: Wilson intervals, McNemar's
//! exact test), through the library and the binary.

use std::path::{Path, PathBuf};

use collabllm::eval::compare::{compare_runs, mcnemar_exact, wilson_interval, Z95};
use collabllm::eval::transcripts::{read_games, rescore_file, split_line, RescoredGame};
use collabllm::task::twenty_questions::World;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/lmrl_twenty_questions.jsonl")
}

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_eval_multiturn")
}

fn run_bin(args: &[&str]) -> std::process::Output {
    std::process::Command::new(bin())
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("running eval_multiturn")
}

fn read_games_jsonl(path: &Path) -> Vec<RescoredGame> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn lines_split_at_the_last_question_mark_as_lmrl_gym() {
    assert_eq!(
        split_line("Is it a car? Yes."),
        Some(("Is it a car?".into(), "Yes.".into()))
    );
    assert_eq!(
        split_line("Really? Is it a car? No."),
        Some(("Really? Is it a car?".into(), "No.".into()))
    );
    assert_eq!(split_line("Is it a car Yes."), None);
}

#[test]
fn transcripts_are_rescored_under_our_rules_in_input_order() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("rescored");
    let report = rescore_file(&fixture(), &out).unwrap();
    let games = read_games_jsonl(&out.join("games.jsonl"));
    assert_eq!(
        games.len(),
        6,
        "one line per input game, blank lines skipped"
    );
    assert_eq!(games, report.games);
    let objects: Vec<&str> = games.iter().map(|g| g.object.as_str()).collect();
    assert_eq!(
        objects,
        ["Car", "Car", "Cat", "Rock", "Airplane", "Truck"],
        "input order"
    );
    let success: Vec<bool> = games.iter().map(|g| g.success).collect();
    // Only a question that names the target and no other noun wins: "wheels, like a car" and
    // "cats" do not, whatever the file's `correct` says.
    assert_eq!(success, [true, false, false, false, true, false]);
    assert_eq!(report.disagreements, 2);
    // Vehicle → wheels → car: every bit of the 158 objects, log2 158, in three questions.
    let car = &games[0];
    assert_eq!(car.questions, 3);
    assert!(
        (car.info_gain - (158f64).log2()).abs() < 1e-12,
        "{}",
        car.info_gain
    );
    assert_eq!(car.metrics.turns, 3);
    assert_eq!(car.metrics.return_, -2.0);
    // A lost game counts the full budget of 20 whatever its length.
    assert_eq!(games[1].metrics.turns, 20);
    assert_eq!(games[1].questions, 2);
    // Unparsed question and a reply that is neither yes nor no ("Maybe." → "No.").
    let rock = &games[3];
    assert_eq!(rock.unparsed, 1);
    assert!(rock.game.turns[0].unparsed && rock.game.turns[0].realised_gain == 0.0);
    assert_eq!(rock.invalid_answers, 1);
    assert!(!rock.game.turns[1].yes);
    // The game ends at the win; the line after it is not played.
    assert_eq!((games[4].questions, games[4].lines_ignored), (1, 1));
    assert_eq!(games[4].given_correct, Some(true));
    // The summary is the aggregate of these games.
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    let m = &s["models"][0]["metrics"];
    assert_eq!(s["models"][0]["name"], "lmrl_twenty_questions");
    assert!((m["success_rate"]["mean"].as_f64().unwrap() - 2.0 / 6.0).abs() < 1e-12);
    assert_eq!(m["success_rate"]["n"], 6);
    let turns = (3 + 20 + 20 + 20 + 1 + 20) as f64 / 6.0;
    assert!((m["mean_turns"]["mean"].as_f64().unwrap() - turns).abs() < 1e-12);
    // Unparsed: Rock's "what could it be?" and "wheels, like a car" (an object inside an
    // attribute question is read as neither).
    assert!((m["unparsed"]["mean"].as_f64().unwrap() - 2.0 / 6.0).abs() < 1e-12);
}

#[test]
fn bad_transcripts_name_file_and_line() {
    let world = World::load_default().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let f = tmp.path().join("bad.jsonl");
    for (text, needle) in [
        (
            "{\"lines\": [\"Is it a car? Yes.\"], \"word\": [\"Car\"]}\n{\"lines\": 3}\n",
            ":2: not an LMRL-Gym game",
        ),
        (
            "{\"lines\": [\"Is it a car? Yes.\"], \"word\": [\"Spaceship\"]}\n",
            ":1: `word` [\"Spaceship\"] names none",
        ),
        (
            "{\"lines\": [\"Is it a car Yes.\"], \"word\": [\"Car\"]}\n",
            ":1: `lines`[0]",
        ),
        ("\n\n", "no games"),
    ] {
        std::fs::write(&f, text).unwrap();
        let e = read_games(&world, &f).unwrap_err().to_string();
        assert!(
            e.contains("bad.jsonl") && e.contains(needle),
            "{e} / {needle}"
        );
    }
}

/// An LMRL file in which object `o` is won at once (`wins[o]`) or lost after one question.
fn lmrl_file(path: &Path, world: &World, wins: &[bool]) {
    let mut text = String::new();
    for (o, &w) in wins.iter().enumerate() {
        let line = if w {
            format!("{} Yes.", world.guess_question(o))
        } else {
            "Is it made of metal? No.".to_string()
        };
        text.push_str(
            &serde_json::json!({"lines": [line], "word": world.objects[o].variants, "correct": w})
                .to_string(),
        );
        text.push('\n');
    }
    std::fs::write(path, text).unwrap();
}

#[test]
fn compare_pairs_games_and_tests_with_mcnemar() {
    let world = World::load_default().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    // 12 objects: base wins 0..3; the other run wins 2..12 (b = 2 only-base, c = 9 only-other)
    // and has two extra objects that the base never played (left out).
    let base: Vec<bool> = (0..12).map(|o| o < 3 || o == 11).collect();
    let other: Vec<bool> = (0..14).map(|o| o >= 2).collect();
    let (fa, fb) = (tmp.path().join("a.jsonl"), tmp.path().join("b.jsonl"));
    lmrl_file(&fa, &world, &base);
    lmrl_file(&fb, &world, &other);
    let (da, db) = (tmp.path().join("base"), tmp.path().join("trained"));
    rescore_file(&fa, &da).unwrap();
    rescore_file(&fb, &db).unwrap();
    let out = tmp.path().join("cmp");
    let cmp = compare_runs(&[da.clone(), db.clone()], Some(&out)).unwrap();
    assert_eq!(cmp.paired_games, 12);
    let (r0, r1) = (&cmp.rows[0], &cmp.rows[1]);
    assert_eq!((r0.label.as_str(), r1.label.as_str()), ("base", "trained"));
    assert_eq!((r0.wins, r1.wins, r1.games), (4, 10, 12));
    // Discordant: objects 0, 1 (base only) vs 3..=10 (trained only); 2 and 11 both won.
    assert_eq!((r1.only_base_won, r1.only_this_won), (Some(2), Some(8)));
    let p = r1.mcnemar_p.unwrap();
    assert!((p - 2.0 * 56.0 / 1024.0).abs() < 1e-15, "{p}");
    assert_eq!(p, mcnemar_exact(2, 8));
    assert!(r0.mcnemar_p.is_none());
    let (lo, hi) = r1.success_ci95;
    assert!(lo < 10.0 / 12.0 && 10.0 / 12.0 < hi && hi < 1.0);
    assert!(cmp
        .warnings
        .iter()
        .any(|w| w.contains("trained: 2 game(s)")));
    assert!((r1.mean_turns.mean - (10.0 + 2.0 * 20.0) / 12.0).abs() < 1e-12);
    assert_eq!(r1.turns_on_win.mean, 1.0);
    let md = std::fs::read_to_string(out.join("compare.md")).unwrap();
    assert!(
        md.contains("| trained | 83.3% (10/12;") && md.contains("| 2 / 8 | 0.1094 |"),
        "{md}"
    );
    assert!(out.join("compare.json").is_file());

    // The binary: --transcripts then --compare, and their errors.
    let dc = tmp.path().join("bin-base");
    let res = run_bin(&[
        "--task",
        "twenty_questions",
        "--transcripts",
        fa.to_str().unwrap(),
        "--output",
        dc.to_str().unwrap(),
    ]);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    assert!(String::from_utf8_lossy(&res.stdout).contains("success_rate"));
    let res = run_bin(&["--compare", dc.to_str().unwrap(), db.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&res.stdout);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    assert!(
        stdout.contains("McNemar") && stdout.contains("| 2 / 8 |"),
        "{stdout}"
    );
    let res = run_bin(&["--compare", dc.to_str().unwrap()]);
    assert!(!res.status.success());
    assert!(String::from_utf8_lossy(&res.stderr).contains("at least two models"));
    let res = run_bin(&[
        "--compare",
        dc.to_str().unwrap(),
        tmp.path().to_str().unwrap(),
    ]);
    assert!(!res.status.success());
    assert!(String::from_utf8_lossy(&res.stderr).contains("neither an eval_multiturn output"));
    let res = run_bin(&[
        "--task",
        "math",
        "--transcripts",
        fa.to_str().unwrap(),
        "--output",
        dc.to_str().unwrap(),
    ]);
    assert!(!res.status.success());
    assert!(String::from_utf8_lossy(&res.stderr).contains("--task twenty_questions"));
}

#[test]
fn mcnemar_exact_matches_known_values() {
    // Two-sided exact binomial (scipy.stats.binomtest(k, n, 0.5).pvalue, statsmodels
    // mcnemar(exact=True)).
    assert_eq!(mcnemar_exact(0, 0), 1.0);
    assert_eq!(mcnemar_exact(3, 3), 1.0);
    assert!((mcnemar_exact(0, 6) - 2.0 / 64.0).abs() < 1e-15);
    assert!((mcnemar_exact(6, 0) - 0.031_25).abs() < 1e-15);
    assert!((mcnemar_exact(1, 9) - 22.0 / 1024.0).abs() < 1e-15);
    assert!((mcnemar_exact(0, 1) - 1.0).abs() < 1e-15);
    // 2·P(X ≤ 2), X ~ Bin(12, ½) = 2·79/4096.
    assert!((mcnemar_exact(2, 10) - 158.0 / 4096.0).abs() < 1e-15);
    // Large counts: no underflow; symmetric; P(X ≤ 400) for Bin(1000, ½) ≈ 1.364e-10.
    let p = mcnemar_exact(400, 600);
    assert!(
        p > 0.0 && (p / 2.0 - 1.364e-10).abs() / 1.364e-10 < 1e-2,
        "{p}"
    );
    assert_eq!(mcnemar_exact(400, 600), mcnemar_exact(600, 400));
    assert_eq!(mcnemar_exact(5000, 5000), 1.0);
}

#[test]
fn wilson_interval_matches_known_values() {
    let (lo, hi) = wilson_interval(0, 10, Z95);
    assert!(lo == 0.0 && (hi - 0.277_532).abs() < 1e-6, "{hi}");
    let (lo, hi) = wilson_interval(5, 10, Z95);
    assert!((lo - 0.236_593).abs() < 1e-6 && (hi - 0.763_407).abs() < 1e-6);
    let (lo, hi) = wilson_interval(10, 10, Z95);
    assert!((lo - 0.722_468).abs() < 1e-6 && (hi - 1.0).abs() < 1e-12);
    assert_eq!(wilson_interval(0, 0, Z95), (0.0, 1.0));
}

/// Re-scoring into a directory that holds another run (an evaluation, a generate_conv run)
/// is refused before anything is written; into its own earlier output it is not.
#[test]
fn rescoring_never_overwrites_another_run() {
    let world = World::load_default().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("games.jsonl");
    lmrl_file(&file, &world, &[true, false]);
    let eval_dir = tmp.path().join("eval");
    std::fs::create_dir_all(eval_dir.join("conversations")).unwrap();
    std::fs::write(eval_dir.join("summary.json"), "{\"models\": []}").unwrap();
    let e = rescore_file(&file, &eval_dir).unwrap_err().to_string();
    assert!(
        e.contains("holds another run") && e.contains("conversations"),
        "{e}"
    );
    assert_eq!(
        std::fs::read_to_string(eval_dir.join("summary.json")).unwrap(),
        "{\"models\": []}"
    );
    let summary_only = tmp.path().join("summary-only");
    std::fs::create_dir_all(&summary_only).unwrap();
    std::fs::write(summary_only.join("summary.json"), "{}").unwrap();
    assert!(rescore_file(&file, &summary_only).is_err());
    let mine = tmp.path().join("mine");
    rescore_file(&file, &mine).unwrap();
    rescore_file(&file, &mine).unwrap();
}
