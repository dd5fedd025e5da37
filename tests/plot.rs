//! `plot` end to end on fixture directories built here: files exist, PNGs decode with the
//! right size, SVGs parse as XML and name the series and axes, output is byte-identical on a
//! second render, bad inputs give errors naming file and field, one point still plots.

mod common;
use common::plot_fixtures;

use std::path::{Path, PathBuf};

use collabllm::plot::{self, Options, PlotError};
use plot_fixtures::*;

fn opts(out: &Path) -> Options {
    Options {
        output: out.to_path_buf(),
        ..Options::default()
    }
}

/// PNG signature, IHDR size, and a full decode.
fn check_png(path: &Path, width: u32) {
    let bytes = std::fs::read(path).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{}", path.display());
    assert_eq!(&bytes[12..16], b"IHDR");
    let w = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
    let h = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
    assert_eq!(w, width, "{}", path.display());
    assert!(h >= width / 2, "{}: height {h}", path.display());
    let decoder = png::Decoder::new(std::io::Cursor::new(&bytes));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    reader.next_frame(&mut buf).unwrap();
    // Not blank: the drawing put something other than white on the canvas.
    assert!(
        buf.iter().any(|&b| b < 200),
        "{}: blank image",
        path.display()
    );
    // 150 dpi recorded.
    let dims = reader.info().pixel_dims.unwrap();
    assert_eq!(dims.xppu, 5906);
    assert_clear_edges(path, &buf, w as usize, h as usize);
}

/// Nothing dark within `EDGE` pixels of the canvas edge: every title, label, legend and
/// annotation stays inside the canvas with a margin (a clipped label or a title touching the
/// top edge leaves dark pixels there).
fn assert_clear_edges(path: &Path, rgb: &[u8], w: usize, h: usize) {
    const EDGE: usize = 4;
    let dark = |x: usize, y: usize| {
        let i = 3 * (y * w + x);
        rgb[i..i + 3].iter().any(|&c| c < 160)
    };
    for y in 0..h {
        for x in 0..w {
            let near = x < EDGE || y < EDGE || x >= w - EDGE || y >= h - EDGE;
            assert!(
                !(near && dark(x, y)),
                "{}: dark pixel at ({x}, {y}), within {EDGE} px of the edge",
                path.display()
            );
        }
    }
}

/// Parses the SVG and returns all its text content.
fn svg_text(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    let doc = roxmltree::Document::parse(&text)
        .unwrap_or_else(|e| panic!("{}: not XML: {e}", path.display()));
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    doc.descendants()
        .filter(|n| n.is_text())
        .map(|n| n.text().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Checks each figure's PNG and SVG; the SVGs together must contain `texts`.
fn check_figures(out: &Path, names: &[&str], texts: &[&str]) {
    let mut all = String::new();
    for n in names {
        check_png(&out.join(format!("{n}.png")), 1200);
        all.push_str(&svg_text(&out.join(format!("{n}.svg"))));
    }
    for t in texts {
        assert!(all.contains(t), "no `{t}` in the SVGs of {names:?}");
    }
}

fn names(written: &[plot::Written]) -> Vec<String> {
    written.iter().map(|w| w.name.clone()).collect()
}

#[test]
fn train_overlays_runs_with_smoothing_and_eval_markers() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("run-a"), tmp.path().join("run-b"));
    write_train_run(&a, 40, 10, 0.0);
    write_train_run(&b, 25, 0, 1.0);
    let out = tmp.path().join("figs");
    let mut o = opts(&out);
    o.smooth = Some(0.6);
    let w = plot::plot_train(&[a, b], &o).unwrap();
    let expected = [
        "train_loss",
        "train_margins",
        "train_rewards",
        "train_accuracies",
        "train_learning_rate",
    ];
    assert_eq!(names(&w), expected);
    check_figures(
        &out,
        &expected,
        &[
            "run-a",
            "run-b",
            "run-a (eval)",
            "run-a chosen",
            "run-b rejected",
            "step (optimizer updates)",
            "loss (nats per pair)",
            "learning rate (per step)",
            "Training loss (EMA 0.6)",
        ],
    );
    // run-b has no eval lines: no eval legend entry for it.
    assert!(!svg_text(&out.join("train_loss.svg")).contains("run-b (eval)"));
    // Smoothing keeps the raw curves, faint, behind the smoothed ones (one per run); the
    // learning rate (a schedule) is never smoothed.
    let faint = |f: &str| {
        std::fs::read_to_string(out.join(f))
            .unwrap()
            .matches("<polyline fill=\"none\" opacity=\"0.25\"")
            .count()
    };
    assert_eq!(faint("train_loss.svg"), 2);
    assert_eq!(faint("train_learning_rate.svg"), 0);
    o.smooth = None;
    plot::plot_train(&[tmp.path().join("run-a")], &o).unwrap();
    assert_eq!(faint("train_loss.svg"), 0);
}

#[test]
fn data_figures_from_a_generate_run() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("gen-run");
    write_data_run(&run, 10, 0.1);
    let out = tmp.path().join("figs");
    let w = plot::plot_data(std::slice::from_ref(&run), &opts(&out)).unwrap();
    let expected = ["data_mr", "data_gap", "data_scores", "data_turns"];
    assert_eq!(names(&w), expected);
    check_figures(
        &out,
        &expected,
        &[
            "gen-run chosen",
            "gen-run rejected",
            "gen-run min_gap = 0.1",
            "pairs (count)",
            "interactivity",
            "token_amount (thousands of tokens)",
            "turn index (0 = first assistant turn)",
        ],
    );
    // --min-gap moves the line.
    let mut o = opts(&out);
    o.min_gap = Some(0.25);
    plot::plot_data(&[run], &o).unwrap();
    assert!(svg_text(&out.join("data_gap.svg")).contains("min_gap = 0.25"));
}

#[test]
fn data_figures_from_an_imported_run_need_no_conversations() {
    // `generate_conv --import` writes pairs and a manifest with `import`, no conversations.
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("imported");
    write_data_run(&run, 5, 0.1);
    std::fs::remove_file(run.join("conversations.jsonl")).unwrap();
    let manifest = serde_json::json!({"import": {"source": "upstream.parquet"},
                                      "config": {"min_gap": 0.1}});
    std::fs::write(run.join("manifest.json"), manifest.to_string()).unwrap();
    let out = tmp.path().join("figs");
    let w = plot::plot_data(std::slice::from_ref(&run), &opts(&out)).unwrap();
    assert_eq!(names(&w), ["data_mr", "data_gap", "data_turns"]);
    // A generate_conv run without its conversations is still an error naming the file.
    let broken = tmp.path().join("broken");
    write_data_run(&broken, 5, 0.1);
    std::fs::remove_file(broken.join("conversations.jsonl")).unwrap();
    let e = plot::plot_data(&[broken], &opts(&out))
        .unwrap_err()
        .to_string();
    assert!(e.contains("conversations.jsonl"), "{e}");
}

#[test]
fn eval_bars_and_cost_scatter() {
    let tmp = tempfile::tempdir().unwrap();
    let ev = tmp.path().join("eval-math");
    write_math_eval(&ev);
    let out = tmp.path().join("figs");
    let w = plot::plot_eval(&[ev], &opts(&out)).unwrap();
    assert_eq!(names(&w), ["eval_metrics", "eval_cost"]);
    check_figures(
        &out,
        &["eval_metrics", "eval_cost"],
        &[
            "default",
            "collabllm",
            "accuracy",
            "interactivity",
            "tokens per conversation (thousands, read + typed)",
            "fraction, 0–1 (mean ± s.e.)",
            // A metric that is 0 for every model says so instead of drawing empty axes.
            "0 for every model",
        ],
    );
}

#[test]
fn twenty_questions_figures_from_played_games() {
    let tmp = tempfile::tempdir().unwrap();
    let ev = tmp.path().join("eval-20q");
    write_twenty_questions_eval(&ev, Some(12), 20);
    let out = tmp.path().join("figs");
    let w = plot::plot_20q(&[ev], &opts(&out)).unwrap();
    let expected = [
        "20q_success_by_budget",
        "20q_game_lengths",
        "20q_info_gain_by_question",
        "20q_turns_vs_gain",
        "20q_proxy_correlation",
    ];
    assert_eq!(names(&w), expected);
    check_figures(
        &out,
        &expected,
        &[
            "reference",
            "random",
            "reference won",
            "question budget t (questions)",
            "mean realised information gain (bits)",
            "total realised information gain (bits)",
            "least squares, R²",
            "information gained in the game (bits)",
        ],
    );
}

/// `plot study` draws an `eval_multiturn --study` result: one forest-plot figure per study,
/// named after its directory, with every arm and comparison named.
/// The calls-vs-agreement curve of adaptive futures: one curve per replay file, named by
/// its stem, settings on one point sharing a label; a file without points is named.
#[test]
fn adaptive_curve_from_replay_files() {
    let tmp = tempfile::tempdir().unwrap();
    let point = |z: f64, share: f64, agree: f64| serde_json::json!({"z": z, "futures_share": share, "agreement": agree});
    let math = tmp.path().join("math.json");
    let clarify = tmp.path().join("clarify.json");
    let doc = |points: Vec<serde_json::Value>| {
        serde_json::json!({"turns": 13, "max_futures": 8, "points": points}).to_string()
    };
    std::fs::write(
        &math,
        doc(vec![point(0.5, 0.59, 0.76), point(1.0, 0.85, 0.96)]),
    )
    .unwrap();
    std::fs::write(
        &clarify,
        doc(vec![point(1.0, 0.25, 1.0), point(1.96, 0.25, 1.0)]),
    )
    .unwrap();
    let out = tmp.path().join("figs");
    let w = plot::plot_adaptive(&[math, clarify], &opts(&out)).unwrap();
    assert_eq!(names(&w), ["adaptive_futures"]);
    check_figures(
        &out,
        &["adaptive_futures"],
        &[
            "math (13 turns, S = 8)",
            "clarify",
            "z 1, 1.96",
            "z 0.5",
            "futures played / fixed S",
        ],
    );
    let empty = tmp.path().join("empty.json");
    std::fs::write(&empty, doc(Vec::new())).unwrap();
    let err = plot::plot_adaptive(&[empty], &opts(&out)).unwrap_err();
    assert!(err_text(err).contains("empty.json"));
}

#[test]
fn study_figures_name_every_arm_and_comparison() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("study-clarify");
    std::fs::create_dir_all(&dir).unwrap();
    let study = serde_json::json!({
        "title": "Clarify", "primary": "detail_used",
        "arms": [
            {"name": "base", "pooled_rate": 0.3, "pooled_ci95": [0.25, 0.36], "seeds": [{"rate": 0.3}]},
            {"name": "multiturn", "pooled_rate": 0.8, "pooled_ci95": [0.7, 0.88],
             "seeds": [{"rate": 0.78}, {"rate": 0.8}, {"rate": 0.82}]},
        ],
        "comparisons": [{"arm": "multiturn", "against": "base", "pooled_difference": 0.5,
                         "ci95": [0.4, 0.6]}],
    });
    std::fs::write(dir.join("study.json"), study.to_string()).unwrap();
    let out = tmp.path().join("figs");
    let w = plot::plot_study(&[dir], &opts(&out)).unwrap();
    assert_eq!(names(&w), ["study-clarify"]);
    check_figures(
        &out,
        &["study-clarify"],
        &[
            "Clarify",
            "multiturn vs base",
            "base",
            "detail_used by arm",
            "pooled differences",
        ],
    );
    // The rows are named on a categorical axis: no numeric row ticks such as 1.5 or 2.5,
    // and the rate axis runs to 1, not beyond.
    let text = svg_text(&out.join("study-clarify.svg"));
    for tick in ["1.5", "2.5", "1.2"] {
        assert!(
            !text.lines().any(|l| l.trim() == tick),
            "tick {tick} in {text}"
        );
    }
    // A missing study.json is named.
    let err = plot::plot_study(&[tmp.path().join("nothing")], &opts(&out)).unwrap_err();
    assert!(err_text(err).contains("study.json"));
}

#[test]
fn all_detects_kinds_writes_index_and_is_deterministic() {
    let tmp = tempfile::tempdir().unwrap();
    let dirs: Vec<PathBuf> = ["train", "gen", "eval-math", "eval-20q"]
        .iter()
        .map(|d| tmp.path().join(d))
        .collect();
    write_train_run(&dirs[0], 12, 4, 0.0);
    write_data_run(&dirs[1], 6, 0.05);
    write_math_eval(&dirs[2]);
    write_twenty_questions_eval(&dirs[3], Some(6), 20);
    let (out1, out2) = (tmp.path().join("figs1"), tmp.path().join("figs2"));
    let w = plot::plot_all(&dirs, &opts(&out1)).unwrap();
    plot::plot_all(&dirs, &opts(&out2)).unwrap();
    // 5 train + 4 data + 2 eval + 5 20q (the 20q summary has no task metric: no cost panel
    // from it, but the math one has).
    assert_eq!(w.len(), 16, "{:?}", names(&w));
    let index = std::fs::read_to_string(out1.join("index.md")).unwrap();
    for x in &w {
        assert!(index.contains(&format!("{}.png", x.name)), "{index}");
        assert!(index.contains(&format!("{}.svg", x.name)));
    }
    // Byte-identical on a second render.
    let mut files: Vec<_> = std::fs::read_dir(&out1)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    files.sort();
    assert_eq!(
        files.len(),
        2 * 16 + 1,
        "png + svg per figure, and index.md"
    );
    for f in &files {
        let (x, y) = (
            std::fs::read(out1.join(f)).unwrap(),
            std::fs::read(out2.join(f)).unwrap(),
        );
        assert!(x == y, "{f:?} differs between two renders");
    }
    // One colour per name across figures: `reference` is drawn in the same colour in the
    // eval bars and the 20q curves.
    let palette = plot::Palette::new(
        [
            "train",
            "gen",
            "default",
            "collabllm",
            "reference",
            "random",
        ]
        .map(String::from),
    );
    let c = palette.color("reference");
    let hex = format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2);
    for f in ["eval_metrics.svg", "20q_success_by_budget.svg"] {
        let svg = std::fs::read_to_string(out1.join(f)).unwrap();
        assert!(svg.contains(&hex), "{f} lacks {hex}");
    }
}

#[test]
fn single_point_run_still_plots() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("one");
    write_train_run(&run, 1, 1, 0.0);
    let out = tmp.path().join("figs");
    let w = plot::plot_train(&[run], &opts(&out)).unwrap();
    assert_eq!(w.len(), 5);
    check_png(&out.join("train_loss.png"), 1200);
    assert!(svg_text(&out.join("train_loss.svg")).contains("one"));
}

fn err_text(e: PlotError) -> String {
    e.to_string()
}

#[test]
fn bad_inputs_name_the_file_and_field() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("figs");
    // Training line without its step.
    let run = tmp.path().join("bad-train");
    std::fs::create_dir_all(&run).unwrap();
    std::fs::write(
        run.join("logs.jsonl"),
        "{\"step\": 1, \"loss\": 0.7}\n{\"loss\": 0.6}\n",
    )
    .unwrap();
    let e = err_text(plot::plot_train(std::slice::from_ref(&run), &opts(&out)).unwrap_err());
    assert!(e.contains("logs.jsonl:2") && e.contains("`step`"), "{e}");
    // A value that is not a number.
    std::fs::write(run.join("logs.jsonl"), "{\"step\": 1, \"loss\": \"x\"}\n").unwrap();
    let e = err_text(plot::plot_train(std::slice::from_ref(&run), &opts(&out)).unwrap_err());
    assert!(e.contains("logs.jsonl:1") && e.contains("`loss`"), "{e}");
    // Missing file.
    let e = err_text(plot::plot_train(&[tmp.path().join("nope")], &opts(&out)).unwrap_err());
    assert!(
        e.contains("nope/logs.jsonl") && e.contains("cannot read"),
        "{e}"
    );
    // Summary without models.
    let ev = tmp.path().join("bad-eval");
    std::fs::create_dir_all(&ev).unwrap();
    std::fs::write(ev.join("summary.json"), "{\"task\": \"math\"}").unwrap();
    let e = err_text(plot::plot_eval(std::slice::from_ref(&ev), &opts(&out)).unwrap_err());
    assert!(e.contains("summary.json") && e.contains("models"), "{e}");
    // A 20q game line without `won`.
    let ev = tmp.path().join("bad-20q");
    write_twenty_questions_eval(&ev, Some(2), 20);
    std::fs::write(
        ev.join("conversations/reference.jsonl"),
        "{\"model\": \"reference\", \"game\": {\"max_questions\": 20, \"turns\": []}}\n",
    )
    .unwrap();
    let e = err_text(plot::plot_20q(&[ev], &opts(&out)).unwrap_err());
    assert!(e.contains("reference.jsonl:1") && e.contains("won"), "{e}");
    // Manifest without min_gap.
    let gen = tmp.path().join("bad-gen");
    write_data_run(&gen, 3, 0.1);
    std::fs::write(gen.join("manifest.json"), "{\"config\": {}}").unwrap();
    let e = err_text(plot::plot_data(&[gen], &opts(&out)).unwrap_err());
    assert!(
        e.contains("manifest.json") && e.contains("config.min_gap"),
        "{e}"
    );
    // A directory of no known kind.
    let e = err_text(plot::plot_all(&[tmp.path().to_path_buf()], &opts(&out)).unwrap_err());
    assert!(e.contains("not a run directory"), "{e}");
}

#[test]
fn binary_writes_figures_and_reports_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let ev = tmp.path().join("eval-math");
    write_math_eval(&ev);
    let out = tmp.path().join("figs");
    let bin = env!("CARGO_BIN_EXE_plot");
    let o = std::process::Command::new(bin)
        .args([
            "eval",
            ev.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
        ])
        .args(["--width", "800", "--format", "png"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    check_png(&out.join("eval_metrics.png"), 800);
    assert!(!out.join("eval_metrics.svg").exists());
    let o = std::process::Command::new(bin)
        .args(["train", tmp.path().join("missing").to_str().unwrap()])
        .args(["--output", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.starts_with("error: ") && err.contains("logs.jsonl"),
        "{err}"
    );
}

/// A log value near f64::MAX (a diverged run) used to hang `plot train` at 100% CPU in the
/// axis computation: now the figures come out (the value is left out and reported) in bounded
/// time.
#[test]
fn huge_logged_values_are_left_out_not_a_hang() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("diverged");
    write_train_run(&run, 20, 5, 0.0);
    let mut logs = std::fs::read_to_string(run.join("logs.jsonl")).unwrap();
    let huge_line = format!("logs.jsonl:{}", logs.lines().count() + 1);
    logs.push_str("{\"step\": 21, \"loss\": 1.7e308, \"grad_norm\": -1.79e308}\n");
    logs.push_str("{\"step\": 22, \"loss\": 0.5, \"rewards/margins\": 1e250}\n");
    std::fs::write(run.join("logs.jsonl"), logs).unwrap();
    let out = tmp.path().join("figs");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_plot"))
        .args([
            "train",
            run.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > std::time::Duration::from_secs(60) {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("plot train still running after 60 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let done = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&done.stderr);
    assert!(done.status.success(), "{stderr}");
    assert!(
        stderr.contains(&huge_line) && stderr.contains("loss"),
        "the left-out value is not reported: {stderr}"
    );
    // stderr is a pipe here: no colour codes.
    assert!(
        !stderr.contains('\u{1b}'),
        "ANSI codes on a pipe: {stderr:?}"
    );
    check_png(&out.join("train_loss.png"), 1200);
}

/// `plot rl` on clarify-or-answer runs adds the ask-rate figure: vague and stated requests
/// per run, from the `clarify/asked_*` keys rl_train logs every step.
#[test]
fn rl_runs_of_clarify_draw_their_ask_rates() {
    let tmp = tempfile::tempdir().unwrap();
    let mut dirs = Vec::new();
    for (name, slope) in [("grpo_mr-s1", 0.02), ("grpo_st-s1", -0.02)] {
        let dir = tmp.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let lines: String = (1..=10)
            .map(|step| {
                let v = 0.5 + slope * step as f64;
                format!(
                    "{}\n",
                    serde_json::json!({"step": step, "loss": 0.1, "reward": v,
                        "clarify/asked_vague": v, "clarify/asked_stated": 0.2})
                )
            })
            .collect();
        std::fs::write(dir.join("logs.jsonl"), lines).unwrap();
        dirs.push(dir);
    }
    let out = tmp.path().join("figs");
    let w = plot::plot_rl(&dirs, &opts(&out)).unwrap();
    assert!(
        names(&w).contains(&"rl_ask_rate".to_string()),
        "{:?}",
        names(&w)
    );
    check_figures(
        &out,
        &["rl_ask_rate"],
        &[
            "grpo_mr-s1 (vague)",
            "grpo_st-s1 (stated)",
            "share of responses that ask",
        ],
    );
    // Runs of other tasks log no ask rate and get no such figure.
    let plain = tmp.path().join("plain");
    std::fs::create_dir_all(&plain).unwrap();
    std::fs::write(
        plain.join("logs.jsonl"),
        "{\"step\": 1, \"loss\": 0.1, \"reward\": 0.5}\n",
    )
    .unwrap();
    let w = plot::plot_rl(&[plain], &opts(&tmp.path().join("figs2"))).unwrap();
    assert!(!names(&w).contains(&"rl_ask_rate".to_string()));
}
