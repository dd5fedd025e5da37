//! Inputs → figure descriptions: which series, which axes (with units), which titles.

use std::collections::{BTreeMap, BTreeSet};

use plotters::style::RGBColor;

use super::chart::{
    BarGroup, Bars, Figure, Layer, LegendAt, Marker, Panel, PanelKind, Shape, OKABE_ITO,
};
use super::inputs::{DataRun, EvalRun, Game, TrainRun};
use super::Palette;

const STEP_AXIS: &str = "step (optimizer updates)";

fn line(label: Option<String>, color: RGBColor, points: Vec<(f64, f64)>) -> Layer {
    // Few points: show each one (a single point would otherwise draw nothing).
    let markers = points.len() <= 12;
    Layer {
        label,
        color,
        shape: Shape::Line {
            points,
            dashed: false,
            faint: false,
            markers,
        },
    }
}

/// Exponential moving average with weight `w` (TensorBoard's smoothing: 0 = raw).
pub fn ema(points: &[(f64, f64)], w: f64) -> Vec<(f64, f64)> {
    let mut s = None;
    points
        .iter()
        .map(|&(x, y)| {
            let v = match s {
                None => y,
                Some(prev) => w * prev + (1.0 - w) * y,
            };
            s = Some(v);
            (x, v)
        })
        .collect()
}

/// A training curve: the raw line faint behind the smoothed one when smoothing.
fn train_curve(
    label: String,
    color: RGBColor,
    points: &[(f64, f64)],
    smooth: Option<f64>,
    dashed: bool,
) -> Vec<Layer> {
    let mut out = Vec::new();
    let main = match smooth {
        Some(w) if w > 0.0 && points.len() > 1 => {
            out.push(Layer {
                label: None,
                color,
                shape: Shape::Line {
                    points: points.to_vec(),
                    dashed,
                    faint: true,
                    markers: false,
                },
            });
            ema(points, w)
        }
        _ => points.to_vec(),
    };
    let mut l = line(Some(label), color, main);
    if let Shape::Line { dashed: d, .. } = &mut l.shape {
        *d = dashed;
    }
    out.push(l);
    out
}

fn eval_markers(label: String, color: RGBColor, points: &[(f64, f64)]) -> Layer {
    Layer {
        label: Some(label),
        color,
        shape: Shape::Markers {
            points: points.to_vec(),
            marker: Marker::Triangle,
        },
    }
}

/// Training figures; a figure is left out when no run logged its metric.
pub fn train(runs: &[TrainRun], palette: &Palette, smooth: Option<f64>) -> Vec<Figure> {
    let single: [(&str, &str, &str, &str); 4] = [
        (
            "train_loss",
            "Training loss",
            "loss",
            "loss (nats per pair)",
        ),
        (
            "train_margins",
            "Reward margin (chosen − rejected)",
            "rewards/margins",
            "reward margin (β · log-ratio, nats)",
        ),
        (
            "train_accuracies",
            "Reward accuracy",
            "rewards/accuracies",
            "accuracy (fraction of pairs)",
        ),
        (
            "train_learning_rate",
            "Learning rate",
            "learning_rate",
            "learning rate (per step)",
        ),
    ];
    let smooth_note = match smooth {
        Some(w) if w > 0.0 => format!(" (EMA {w})"),
        _ => String::new(),
    };
    let mut figs = Vec::new();
    for (name, title, key, y) in single {
        let mut layers = Vec::new();
        for r in runs {
            let c = palette.color(&r.name);
            // The learning rate is a schedule, not a noisy measurement: never smoothed.
            let sm = if key == "learning_rate" { None } else { smooth };
            if let Some(p) = r.train.get(key) {
                layers.extend(train_curve(r.name.clone(), c, p, sm, false));
            }
            if let Some(p) = r.eval.get(key) {
                layers.push(eval_markers(format!("{} (eval)", r.name), c, p));
            }
        }
        if layers.is_empty() {
            continue;
        }
        let mut panel = Panel::xy(STEP_AXIS, y, layers);
        panel.y_from_zero = key == "learning_rate";
        if key == "rewards/accuracies" || key == "rewards/margins" {
            panel.legend_at = LegendAt::LowerRight;
        }
        let note = if key == "learning_rate" {
            ""
        } else {
            smooth_note.as_str()
        };
        figs.push(Figure {
            name: name.into(),
            title: format!("{title}{note}"),
            panels: vec![panel],
        });
    }
    // Chosen (solid) and rejected (dashed) implicit rewards in one panel.
    let mut layers = Vec::new();
    for r in runs {
        let c = palette.color(&r.name);
        for (key, side, dashed) in [
            ("rewards/chosen", "chosen", false),
            ("rewards/rejected", "rejected", true),
        ] {
            if let Some(p) = r.train.get(key) {
                layers.extend(train_curve(
                    format!("{} {side}", r.name),
                    c,
                    p,
                    smooth,
                    dashed,
                ));
            }
            if let Some(p) = r.eval.get(key) {
                layers.push(eval_markers(format!("{} {side} (eval)", r.name), c, p));
            }
        }
    }
    if !layers.is_empty() {
        figs.insert(
            2,
            Figure {
                name: "train_rewards".into(),
                title: format!("Implicit rewards: chosen vs rejected{smooth_note}"),
                panels: vec![{
                    // Chosen rises and rejected falls: the middle right is usually free.
                    let mut p =
                        Panel::xy(STEP_AXIS, "implicit reward (β · log-ratio, nats)", layers);
                    p.legend_at = LegendAt::MiddleRight;
                    p
                }],
            },
        );
    }
    figs
}

/// RL figures (`rl_train` logs): reward (eval reward as markers), each metric's mean
/// reward, KL to the reference and response length over steps; a figure is left out when no
/// run logged its metric.
pub fn rl(runs: &[TrainRun], palette: &Palette, smooth: Option<f64>) -> Vec<Figure> {
    let metrics: BTreeSet<&str> = runs
        .iter()
        .flat_map(|r| r.train.keys())
        .filter_map(|k| k.strip_prefix("rewards/")?.strip_suffix("/mean"))
        .filter(|m| !m.starts_with("mr_"))
        .collect();
    let mut single: Vec<(String, String, String, String)> = vec![(
        "rl_reward".into(),
        "Reward (multiturn-aware, mean over responses)".into(),
        "reward".into(),
        "MR (weighted metric sum)".into(),
    )];
    for m in metrics {
        single.push((
            format!("rl_reward_{}", m.replace('/', "_")),
            format!("Metric {m} (mean over responses' futures)"),
            format!("rewards/{m}/mean"),
            format!("{m} (native range, unweighted)"),
        ));
    }
    single.push((
        "rl_kl".into(),
        "KL to the reference (k3, token mean)".into(),
        "kl".into(),
        "KL (nats per token)".into(),
    ));
    single.push((
        "rl_length".into(),
        "Response length".into(),
        "completions/mean_length".into(),
        "tokens per response".into(),
    ));
    let mut figs = Vec::new();
    for (name, title, key, y) in single {
        let mut layers = Vec::new();
        for r in runs {
            let c = palette.color(&r.name);
            if let Some(p) = r.train.get(&key) {
                layers.extend(train_curve(r.name.clone(), c, p, smooth, false));
            }
            if key == "reward" {
                if let Some(p) = r.train.get("eval/reward") {
                    layers.push(eval_markers(format!("{} (held-out)", r.name), c, p));
                }
            }
        }
        if layers.is_empty() {
            continue;
        }
        figs.push(Figure {
            name,
            title,
            panels: vec![Panel::xy("step (rollout batches)", &y, layers)],
        });
    }
    figs.extend(ask_rate_figure(runs, palette, smooth));
    figs
}

/// Clarify-or-answer: the share of sampled responses that ask, on vague requests (solid)
/// and on stated ones (dashed), per run: the behaviour the two rewards disagree on.
fn ask_rate_figure(runs: &[TrainRun], palette: &Palette, smooth: Option<f64>) -> Option<Figure> {
    let mut layers = Vec::new();
    for r in runs {
        let c = palette.color(&r.name);
        for (key, kind, dashed) in [
            ("clarify/asked_vague", "vague", false),
            ("clarify/asked_stated", "stated", true),
        ] {
            if let Some(p) = r.train.get(key) {
                layers.extend(train_curve(
                    format!("{} ({kind})", r.name),
                    c,
                    p,
                    smooth,
                    dashed,
                ));
            }
        }
    }
    (!layers.is_empty()).then(|| Figure {
        name: "rl_ask_rate".into(),
        title: "Clarifying questions asked (sampled responses; solid vague, dashed stated)".into(),
        panels: vec![Panel::xy(
            "step (rollout batches)",
            "share of responses that ask",
            layers,
        )],
    })
}

// ---------------------------------------------------------------------------------------------
// Histograms.

/// Shared bin edges for all value sets of one panel; never a zero-width range.
pub fn bin_edges<'a>(sets: impl Iterator<Item = &'a [f64]>) -> Vec<f64> {
    let (mut lo, mut hi, mut n) = (f64::MAX, f64::MIN, 0usize);
    for set in sets {
        for &v in set {
            lo = lo.min(v);
            hi = hi.max(v);
        }
        n = n.max(set.len());
    }
    if lo > hi {
        (lo, hi) = (0.0, 1.0);
    }
    if hi - lo <= 0.0 {
        let p = if lo != 0.0 { lo.abs() * 0.1 } else { 0.5 };
        (lo, hi) = (lo - p, hi + p);
    }
    let bins = ((n as f64).sqrt().ceil() as usize).clamp(5, 30);
    (0..=bins)
        .map(|i| lo + (hi - lo) * i as f64 / bins as f64)
        .collect()
}

/// Counts per bin as a closed step outline (starts and ends on y = 0).
pub fn hist_steps(values: &[f64], edges: &[f64]) -> Vec<(f64, f64)> {
    let bins = edges.len() - 1;
    let (lo, hi) = (edges[0], edges[bins]);
    let mut counts = vec![0usize; bins];
    for &v in values {
        let i = (((v - lo) / (hi - lo)) * bins as f64).floor() as isize;
        counts[i.clamp(0, bins as isize - 1) as usize] += 1;
    }
    let mut pts = vec![(lo, 0.0)];
    for (i, &c) in counts.iter().enumerate() {
        pts.push((edges[i], c as f64));
        pts.push((edges[i + 1], c as f64));
    }
    pts.push((hi, 0.0));
    pts
}

/// A histogram: a light fill and an outline (dashed for the second of a pair).
fn hist_layers(label: String, color: RGBColor, steps: Vec<(f64, f64)>, dashed: bool) -> Vec<Layer> {
    let mut out = Vec::new();
    if !dashed {
        out.push(Layer {
            label: None,
            color,
            shape: Shape::Area {
                points: steps.clone(),
            },
        });
    }
    out.push(Layer {
        label: Some(label),
        color,
        shape: Shape::Line {
            points: steps,
            dashed,
            faint: false,
            markers: false,
        },
    });
    out
}

fn hist_panel(x: &str, y: &str, layers: Vec<Layer>) -> Panel {
    let mut p = Panel::xy(x, y, layers);
    p.y_from_zero = true;
    p
}

// ---------------------------------------------------------------------------------------------
// generate_conv data.

/// Axis text for a generate_conv metric.
fn metric_unit(metric: &str) -> String {
    let unit = match metric {
        "accuracy" | "pass_rate" => "fraction correct, 0–1",
        "bleu" => "BLEU, 0–1",
        "interactivity" => "judge score, 0–1",
        "token_amount" => "thousands of tokens",
        _ => "score",
    };
    format!("{metric} ({unit})")
}

pub fn data(runs: &[DataRun], palette: &Palette, min_gap: Option<f64>) -> Vec<Figure> {
    let mut figs = Vec::new();
    // MR of chosen vs rejected.
    let sides: Vec<(String, RGBColor, Vec<f64>, bool)> = runs
        .iter()
        .flat_map(|r| {
            let c = palette.color(&r.name);
            [
                (
                    format!("{} chosen", r.name),
                    c,
                    r.pairs.iter().map(|p| p.0).collect(),
                    false,
                ),
                (
                    format!("{} rejected", r.name),
                    c,
                    r.pairs.iter().map(|p| p.1).collect(),
                    true,
                ),
            ]
        })
        .collect();
    let edges = bin_edges(sides.iter().map(|s| s.2.as_slice()));
    let layers = sides
        .into_iter()
        .flat_map(|(l, c, v, d)| hist_layers(l, c, hist_steps(&v, &edges), d))
        .collect();
    figs.push(Figure {
        name: "data_mr".into(),
        title: "Multiturn-aware reward of chosen vs rejected responses".into(),
        panels: vec![hist_panel(
            "MR (reward units, weighted metric mean)",
            "pairs (count)",
            layers,
        )],
    });
    // Gap with the min-gap threshold.
    let gaps: Vec<Vec<f64>> = runs
        .iter()
        .map(|r| r.pairs.iter().map(|p| p.0 - p.1).collect())
        .collect();
    let edges = bin_edges(gaps.iter().map(|g| g.as_slice()));
    let mut layers = Vec::new();
    for (r, g) in runs.iter().zip(&gaps) {
        let c = palette.color(&r.name);
        layers.extend(hist_layers(r.name.clone(), c, hist_steps(g, &edges), false));
        let mg = min_gap.unwrap_or(r.min_gap);
        layers.push(Layer {
            label: Some(format!(
                "{} min_gap = {}",
                r.name,
                super::chart::fmt_tick(mg)
            )),
            color: c,
            shape: Shape::VLine { x: mg },
        });
    }
    figs.push(Figure {
        name: "data_gap".into(),
        title: "Reward gap of the selected pairs".into(),
        panels: vec![hist_panel(
            "MR(chosen) − MR(rejected) (reward units)",
            "pairs (count)",
            layers,
        )],
    });
    // Per-metric session score distributions.
    let metrics: BTreeSet<&String> = runs.iter().flat_map(|r| r.session_scores.keys()).collect();
    let mut panels = Vec::new();
    for (i, m) in metrics.iter().enumerate() {
        let sets: Vec<(&DataRun, &[f64])> = runs
            .iter()
            .filter_map(|r| r.session_scores.get(*m).map(|v| (r, v.as_slice())))
            .collect();
        let edges = bin_edges(sets.iter().map(|s| s.1));
        let layers = sets
            .iter()
            .flat_map(|(r, v)| {
                hist_layers(
                    r.name.clone(),
                    palette.color(&r.name),
                    hist_steps(v, &edges),
                    false,
                )
            })
            .collect();
        let mut p = hist_panel(&metric_unit(m), "sessions (count)", layers);
        p.title = Some((*m).clone());
        p.legend = i == 0;
        panels.push(p);
    }
    if !panels.is_empty() {
        figs.push(Figure {
            name: "data_scores".into(),
            title: "Session scores per metric (all candidates' future sessions)".into(),
            panels,
        });
    }
    // Pairs per turn index.
    let turns: BTreeSet<u32> = runs
        .iter()
        .flat_map(|r| r.pairs.iter().map(|p| p.2))
        .collect();
    let turns: Vec<u32> = turns.into_iter().collect();
    let groups = runs
        .iter()
        .map(|r| BarGroup {
            label: r.name.clone(),
            color: palette.color(&r.name),
            values: turns
                .iter()
                .map(|t| Some((r.pairs.iter().filter(|p| p.2 == *t).count() as f64, 0.0)))
                .collect(),
        })
        .collect();
    figs.push(Figure {
        name: "data_turns".into(),
        title: "Pairs per turn index".into(),
        panels: vec![Panel {
            title: None,
            x_label: "turn index (0 = first assistant turn)".into(),
            y_label: "pairs (count)".into(),
            kind: PanelKind::Bars(Bars {
                categories: turns.iter().map(|t| t.to_string()).collect(),
                groups,
                dodge: true,
            }),
            y_from_zero: true,
            legend: true,
            legend_at: LegendAt::UpperRight,
            y_categories: Vec::new(),
            x_range: None,
        }],
    });
    figs
}

// ---------------------------------------------------------------------------------------------
// eval_multiturn.

/// Legend label of each model of each run: its name, or `run/name` when the name occurs in
/// more than one run of the invocation.
pub fn eval_labels(runs: &[EvalRun]) -> Vec<Vec<String>> {
    let mut count: BTreeMap<&str, usize> = BTreeMap::new();
    for r in runs {
        for m in &r.summary.models {
            *count.entry(m.name.as_str()).or_default() += 1;
        }
    }
    runs.iter()
        .map(|r| {
            r.summary
                .models
                .iter()
                .map(|m| {
                    if count[m.name.as_str()] > 1 {
                        format!("{}/{}", r.name, m.name)
                    } else {
                        m.name.clone()
                    }
                })
                .collect()
        })
        .collect()
}

/// Axis text for an eval_multiturn metric.
fn eval_unit(metric: &str) -> &'static str {
    match metric {
        "accuracy" | "pass_rate" | "success_rate" => "fraction, 0–1",
        "bleu" => "BLEU, 0–1",
        "interactivity" | "eda_score" => "score, 0–1",
        "tokens_read_k" | "tokens_typed_k" => "thousands of tokens",
        "turns" | "mean_turns" | "turns_on_win" => "turns",
        "mean_return" => "return (−questions + win)",
        "info_gain_per_game" | "info_gain_per_question" | "expected_gain_per_question" => "bits",
        "judge_failures" | "yes_answers" | "unparsed" | "repeated" | "inconsistent_guesses" => {
            "count per conversation"
        }
        _ => "mean",
    }
}

const TASK_METRICS: [&str; 3] = ["accuracy", "bleu", "pass_rate"];

pub fn eval(runs: &[EvalRun], palette: &Palette) -> Vec<Figure> {
    let labels = eval_labels(runs);
    let models: Vec<(&String, &super::inputs::EvalModel)> = labels
        .iter()
        .zip(runs)
        .flat_map(|(ls, r)| ls.iter().zip(&r.summary.models))
        .collect();
    let metrics: BTreeSet<&String> = models.iter().flat_map(|(_, m)| m.metrics.keys()).collect();
    // One panel per metric, one bar per model (± standard error).
    let categories: Vec<String> = models.iter().map(|(l, _)| (*l).clone()).collect();
    let mut panels = Vec::new();
    for metric in &metrics {
        // A metric that is 0 for every model draws no bars: say so instead of empty axes,
        // which read as missing data.
        let all_zero = models.iter().all(|(_, m)| {
            m.metrics
                .get(*metric)
                .is_some_and(|s| s.mean == 0.0 && s.se == 0.0)
        });
        if all_zero {
            panels.push(Panel::note(metric, "0 for every model"));
            continue;
        }
        let groups = models
            .iter()
            .enumerate()
            .map(|(i, (l, m))| BarGroup {
                label: (*l).clone(),
                color: palette.color(l),
                values: (0..models.len())
                    .map(|j| {
                        (j == i)
                            .then(|| m.metrics.get(*metric).map(|s| (s.mean, s.se)))
                            .flatten()
                    })
                    .collect(),
            })
            .collect();
        panels.push(Panel {
            title: Some((*metric).clone()),
            x_label: "model".into(),
            y_label: format!("{} (mean ± s.e.)", eval_unit(metric)),
            kind: PanelKind::Bars(Bars {
                categories: categories.clone(),
                groups,
                dodge: false,
            }),
            y_from_zero: true,
            legend: false,
            legend_at: LegendAt::UpperRight,
            y_categories: Vec::new(),
            x_range: None,
        });
    }
    let mut figs = vec![Figure {
        name: "eval_metrics".into(),
        title: "Evaluation metrics per model (mean ± standard error)".into(),
        panels,
    }];
    // Cost vs quality: the task metric against tokens read + typed.
    let mut cost_panels = Vec::new();
    for metric in TASK_METRICS {
        let mut layers = Vec::new();
        for (l, m) in &models {
            let (Some(q), Some(r), Some(t)) = (
                m.metrics.get(metric),
                m.metrics.get("tokens_read_k"),
                m.metrics.get("tokens_typed_k"),
            ) else {
                continue;
            };
            let (x, c) = (r.mean + t.mean, palette.color(l));
            layers.push(Layer {
                label: None,
                color: c,
                shape: Shape::ErrorBars {
                    points: vec![(x, q.mean, q.se)],
                },
            });
            layers.push(Layer {
                label: Some((*l).clone()),
                color: c,
                shape: Shape::Markers {
                    points: vec![(x, q.mean)],
                    marker: Marker::Circle { filled: true },
                },
            });
            layers.push(Layer {
                label: None,
                color: c,
                shape: Shape::Label {
                    x,
                    y: q.mean,
                    text: (*l).clone(),
                },
            });
        }
        if !layers.is_empty() {
            let mut p = Panel::xy(
                "tokens per conversation (thousands, read + typed)",
                &format!("{metric} ({}, mean ± s.e.)", eval_unit(metric)),
                layers,
            );
            p.title = Some(metric.to_string());
            cost_panels.push(p);
        }
    }
    if !cost_panels.is_empty() {
        figs.push(Figure {
            name: "eval_cost".into(),
            title: "Cost vs quality".into(),
            panels: cost_panels,
        });
    }
    figs
}

// ---------------------------------------------------------------------------------------------
// 20 Questions.

/// Labelled games of every model, in summary order; models without games are left out.
fn labelled_games<'a>(
    runs: &'a [EvalRun],
    games: &'a [BTreeMap<String, Vec<Game>>],
) -> Vec<(String, &'a [Game])> {
    let labels = eval_labels(runs);
    let mut out = Vec::new();
    for ((r, ls), g) in runs.iter().zip(&labels).zip(games) {
        for (m, l) in r.summary.models.iter().zip(ls) {
            if let Some(v) = g.get(&m.name) {
                out.push((l.clone(), v.as_slice()));
            }
        }
        // Games of a model the summary does not list still show, under their own name.
        for (name, v) in g {
            if !r.summary.models.iter().any(|m| &m.name == name) {
                out.push((name.clone(), v.as_slice()));
            }
        }
    }
    out
}

/// Least squares `y = a + b·x` and its R²; `None` with fewer than two distinct x.
pub fn least_squares(points: &[(f64, f64)]) -> Option<(f64, f64, f64)> {
    let n = points.len() as f64;
    let (mx, my) = points
        .iter()
        .fold((0.0, 0.0), |(a, b), (x, y)| (a + x / n, b + y / n));
    let sxx: f64 = points.iter().map(|(x, _)| (x - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|(x, y)| (x - mx) * (y - my)).sum();
    let syy: f64 = points.iter().map(|(_, y)| (y - my).powi(2)).sum();
    if points.len() < 2 || sxx <= 0.0 {
        return None;
    }
    let b = sxy / sxx;
    let r2 = if syy > 0.0 {
        sxy * sxy / (sxx * syy)
    } else {
        0.0
    };
    Some((my - b * mx, b, r2))
}

/// The study's proxy check: every game's total information gain (bits) against its outcome
/// (won 1, lost 0; jittered ±0.04 so equal points stay visible), per model, with one least
/// squares line over all games and its R² (the point-biserial r²).
fn proxy_correlation(models: &[(String, &[Game])], palette: &Palette) -> Panel {
    let bits = |g: &Game| g.turns.iter().map(|t| t.realised_gain).sum::<f64>();
    let mut all = Vec::new();
    let mut layers = Vec::new();
    for (l, g) in models {
        let pts: Vec<(f64, f64)> = g
            .iter()
            .enumerate()
            .map(|(i, x)| {
                let j = ((i as f64 * 0.618_034) % 1.0 - 0.5) * 0.08;
                all.push((bits(x), if x.won { 1.0 } else { 0.0 }));
                (bits(x), if x.won { 1.0 } else { 0.0 } + j)
            })
            .collect();
        layers.push(Layer {
            label: Some(l.clone()),
            color: palette.color(l),
            shape: Shape::Markers {
                points: pts,
                marker: Marker::Circle { filled: true },
            },
        });
    }
    if let Some((a, b, r2)) = least_squares(&all) {
        let (lo, hi) = all
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), (x, _)| {
                (lo.min(*x), hi.max(*x))
            });
        let mut fit = line(
            Some(format!("least squares, R² = {r2:.2} ({} games)", all.len())),
            RGBColor(60, 60, 60),
            vec![(lo, a + b * lo), (hi, a + b * hi)],
        );
        if let Shape::Line {
            dashed, markers, ..
        } = &mut fit.shape
        {
            *dashed = true;
            *markers = false;
        }
        layers.push(fit);
    }
    let mut panel = Panel::xy(
        "information gained in the game (bits)",
        "game won (1) or lost (0), jittered ±0.04",
        layers,
    );
    panel.legend_at = LegendAt::MiddleRight;
    panel
}

pub fn twenty_questions(
    runs: &[EvalRun],
    games: &[BTreeMap<String, Vec<Game>>],
    palette: &Palette,
) -> Vec<Figure> {
    let models = labelled_games(runs, games);
    let budget = models
        .iter()
        .flat_map(|(_, g)| g.iter().map(|x| x.max_questions.max(x.turns.len())))
        .max()
        .unwrap_or(20)
        .max(1);
    // Success rate by question budget.
    let layers = models
        .iter()
        .map(|(l, g)| {
            let pts = (1..=budget)
                .map(|t| {
                    let wins = g.iter().filter(|x| x.won && x.turns.len() <= t).count();
                    (t as f64, wins as f64 / g.len().max(1) as f64)
                })
                .collect();
            let mut layer = line(Some(l.clone()), palette.color(l), pts);
            if let Shape::Line { markers, .. } = &mut layer.shape {
                *markers = true;
            }
            layer
        })
        .collect();
    let mut success = Panel::xy(
        "question budget t (questions)",
        "success rate (fraction of games won within t)",
        layers,
    );
    success.y_from_zero = true;
    success.legend_at = LegendAt::LowerRight;
    // Game lengths.
    let groups = models
        .iter()
        .map(|(l, g)| BarGroup {
            label: l.clone(),
            color: palette.color(l),
            values: (1..=budget)
                .map(|t| Some((g.iter().filter(|x| x.turns.len() == t).count() as f64, 0.0)))
                .collect(),
        })
        .collect();
    let lengths = Panel {
        title: None,
        x_label: "questions asked in the game (count)".into(),
        y_label: "games (count)".into(),
        kind: PanelKind::Bars(Bars {
            categories: (1..=budget).map(|t| t.to_string()).collect(),
            groups,
            dodge: true,
        }),
        y_from_zero: true,
        legend: true,
        legend_at: LegendAt::UpperLeft,
        y_categories: Vec::new(),
        x_range: None,
    };
    // Mean realised information gain by question index (games that reached it).
    let layers = models
        .iter()
        .map(|(l, g)| {
            let pts = (0..budget)
                .filter_map(|i| {
                    let v: Vec<f64> = g
                        .iter()
                        .filter_map(|x| x.turns.get(i).map(|t| t.realised_gain))
                        .collect();
                    (!v.is_empty())
                        .then(|| ((i + 1) as f64, v.iter().sum::<f64>() / v.len() as f64))
                })
                .collect();
            let mut layer = line(Some(l.clone()), palette.color(l), pts);
            if let Shape::Line { markers, .. } = &mut layer.shape {
                *markers = true;
            }
            layer
        })
        .collect();
    let mut gain = Panel::xy(
        "question index (1 = first question)",
        "mean realised information gain (bits)",
        layers,
    );
    gain.y_from_zero = true;
    // Per game: questions asked vs total information gain; wins filled, losses hollow.
    let mut layers = Vec::new();
    for (l, g) in &models {
        let c = palette.color(l);
        for won in [true, false] {
            let pts: Vec<(f64, f64)> = g
                .iter()
                .enumerate()
                .filter(|(_, x)| x.won == won)
                .map(|(i, x)| {
                    // Fixed jitter (golden-ratio sequence) so equal points stay visible.
                    let j = ((i as f64 * 0.618_034) % 1.0 - 0.5) * 0.3;
                    let bits: f64 = x.turns.iter().map(|t| t.realised_gain).sum();
                    (x.turns.len() as f64 + j, bits)
                })
                .collect();
            if pts.is_empty() {
                continue;
            }
            layers.push(Layer {
                label: Some(format!("{l} {}", if won { "won" } else { "lost" })),
                color: c,
                shape: Shape::Markers {
                    points: pts,
                    marker: Marker::Circle { filled: won },
                },
            });
        }
    }
    let mut scatter = Panel::xy(
        "questions asked (count, jittered ±0.15)",
        "total realised information gain (bits)",
        layers,
    );
    scatter.y_from_zero = true;
    scatter.legend_at = LegendAt::MiddleRight;
    let proxy = proxy_correlation(&models, palette);
    let fig = |name: &str, title: &str, p: Panel| Figure {
        name: name.into(),
        title: title.into(),
        panels: vec![p],
    };
    vec![
        fig(
            "20q_success_by_budget",
            "20 Questions: success rate by question budget",
            success,
        ),
        fig("20q_game_lengths", "20 Questions: game lengths", lengths),
        fig(
            "20q_info_gain_by_question",
            "20 Questions: information gain per question",
            gain,
        ),
        fig(
            "20q_turns_vs_gain",
            "20 Questions: questions asked vs information gained",
            scatter,
        ),
        fig(
            "20q_proxy_correlation",
            "20 Questions: information gain as a proxy for success",
            proxy,
        ),
    ]
}

// ---------------------------------------------------------------------------------------------
// Studies (eval_multiturn --study).

/// One figure per study, named after its directory, as two forest plots (a row each, named at
/// its right): the primary outcome of each arm (pooled, with its bootstrap interval; each
/// seed a ring) and each comparison's pooled difference with its interval, against a dashed
/// zero line.
pub fn study(studies: &[(String, super::inputs::Study)], palette: &Palette) -> Vec<Figure> {
    let mut figs = Vec::new();
    for (name, s) in studies {
        let rows: Vec<Row> = s
            .arms
            .iter()
            .map(|a| Row {
                label: a.name.clone(),
                color: palette.color(&a.name),
                value: a.pooled_rate,
                ci: a.pooled_ci95,
                seeds: a.seeds.iter().map(|x| x.rate).collect(),
            })
            .collect();
        // A 0/1 outcome is a rate: its axis is [0, 1] whatever the data.
        let rate = s.arms.iter().flat_map(|a| &a.seeds).all(|x| x.binary);
        let mut arm_panel = Panel::xy(
            &format!("{}, pooled (95% CI; rings: seeds)", s.primary),
            "",
            forest(&rows, None),
        );
        arm_panel.title = Some(format!("{} by arm", s.primary));
        arm_panel.legend = false;
        arm_panel.y_categories = rows.iter().map(|r| r.label.clone()).collect();
        if rate {
            arm_panel.x_range = Some((0.0, 1.0));
        }
        let rows: Vec<Row> = s
            .comparisons
            .iter()
            .map(|c| Row {
                label: format!("{} vs {}", c.arm, c.against),
                color: palette.color(&c.arm),
                value: c.pooled_difference,
                ci: c.ci95,
                seeds: Vec::new(),
            })
            .collect();
        let mut diff_panel = Panel::xy(
            &format!("difference in {} (95% CI)", s.primary),
            "",
            forest(&rows, Some(0.0)),
        );
        diff_panel.title = Some("pooled differences".into());
        diff_panel.legend = false;
        diff_panel.y_categories = rows.iter().map(|r| r.label.clone()).collect();
        figs.push(Figure {
            name: name.clone(),
            title: s.title.clone(),
            panels: vec![arm_panel, diff_panel],
        });
        figs.extend(asking(name, s, palette));
    }
    figs
}

/// Clarify studies that report `asked_vague` and `asked_stated`: where each arm asks, one
/// ring per seed and a filled dot for the mean over seeds, x the share of stated requests
/// asked about (needless), y the share of vague ones (needed); the ideal corner (0, 1) is
/// marked. An arm that asks everyone sits on the diagonal.
fn asking(name: &str, s: &super::inputs::Study, palette: &Palette) -> Option<Figure> {
    let point = |m: &BTreeMap<String, Option<f64>>| {
        Some((
            m.get("asked_stated").copied()??,
            m.get("asked_vague").copied()??,
        ))
    };
    let mut layers = vec![
        Layer {
            label: None,
            color: OKABE_ITO[6],
            shape: Shape::Line {
                points: vec![(0.0, 0.0), (1.0, 1.0)],
                dashed: true,
                faint: true,
                markers: false,
            },
        },
        Layer {
            label: None,
            color: OKABE_ITO[6],
            shape: Shape::Label {
                x: 0.0,
                y: 1.0,
                text: "ideal: ask only when vague".into(),
            },
        },
    ];
    for a in &s.arms {
        let Some(mean) = point(&a.secondary) else {
            continue;
        };
        let color = palette.color(&a.name);
        let seeds: Vec<(f64, f64)> = a.seeds.iter().filter_map(|x| point(&x.secondary)).collect();
        if seeds.len() > 1 {
            layers.push(Layer {
                label: None,
                color,
                shape: Shape::Markers {
                    points: seeds,
                    marker: Marker::Circle { filled: false },
                },
            });
        }
        layers.push(Layer {
            label: Some(a.name.clone()),
            color,
            shape: Shape::Markers {
                points: vec![mean],
                marker: Marker::Circle { filled: true },
            },
        });
    }
    if layers.len() == 2 {
        return None;
    }
    let mut panel = Panel::xy(
        "asked on stated requests (needless)",
        "asked on vague requests (needed)",
        layers,
    );
    panel.x_range = Some((0.0, 1.0));
    panel.y_from_zero = true;
    panel.legend_at = LegendAt::LowerRight;
    Some(Figure {
        name: format!("{name}-asking"),
        title: format!("{}: where each arm asks (rings: seeds)", s.title),
        panels: vec![panel],
    })
}

/// One row of a forest plot.
struct Row {
    label: String,
    color: RGBColor,
    value: f64,
    ci: (f64, f64),
    seeds: Vec<f64>,
}

/// Rows top to bottom at y = k, …, 1 (the panel names them on its categorical axis): the
/// interval as a line, the value as a dot, the seeds as small rings on the same row;
/// `reference` a dashed vertical line.
fn forest(rows: &[Row], reference: Option<f64>) -> Vec<Layer> {
    let mut layers = Vec::new();
    if let Some(x) = reference {
        layers.push(Layer {
            label: None,
            color: OKABE_ITO[6],
            shape: Shape::VLine { x },
        });
    }
    let k = rows.len();
    for (i, r) in rows.iter().enumerate() {
        let y = (k - i) as f64;
        layers.push(Layer {
            label: None,
            color: r.color,
            shape: Shape::Line {
                points: vec![(r.ci.0, y), (r.ci.1, y)],
                dashed: false,
                faint: false,
                markers: false,
            },
        });
        layers.push(Layer {
            label: Some(r.label.clone()),
            color: r.color,
            shape: Shape::Markers {
                points: vec![(r.value, y)],
                marker: Marker::Circle { filled: true },
            },
        });
        if !r.seeds.is_empty() {
            layers.push(Layer {
                label: None,
                color: r.color,
                shape: Shape::Markers {
                    points: r.seeds.iter().map(|&x| (x, y)).collect(),
                    marker: Marker::Circle { filled: false },
                },
            });
        }
    }
    layers
}

/// Adaptive futures: the share of the fixed-S futures played against how often the pair is
/// one the fixed-S run could have made, one curve per replay (task), each point labelled
/// with its interval width z.
pub fn adaptive(replays: &[(String, super::inputs::Replay)], palette: &Palette) -> Vec<Figure> {
    let mut layers = Vec::new();
    for (name, r) in replays {
        let color = palette.color(name);
        let mut points: Vec<(f64, f64)> = r
            .points
            .iter()
            .map(|p| (p.futures_share, p.agreement))
            .collect();
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        layers.push(Layer {
            label: Some(format!("{name} ({} turns, S = {})", r.turns, r.max_futures)),
            color,
            shape: Shape::Line {
                points,
                dashed: false,
                faint: false,
                markers: true,
            },
        });
        // Settings that land on one point share one label.
        let mut labels: Vec<((f64, f64), Vec<String>)> = Vec::new();
        for p in &r.points {
            let at = (p.futures_share, p.agreement);
            let near = |(x, y): (f64, f64)| (x - at.0).abs() < 5e-3 && (y - at.1).abs() < 5e-3;
            match labels.iter_mut().find(|(xy, _)| near(*xy)) {
                Some((_, zs)) => zs.push(p.z.to_string()),
                None => labels.push((at, vec![p.z.to_string()])),
            }
        }
        for ((x, y), zs) in labels {
            layers.push(Layer {
                label: None,
                color,
                shape: Shape::Label {
                    x,
                    y,
                    text: format!("z {}", zs.join(", ")),
                },
            });
        }
    }
    let mut panel = Panel::xy("futures played / fixed S", "pair = a fixed-S pair", layers);
    panel.legend_at = LegendAt::LowerRight;
    panel.x_range = Some((0.0, 1.0));
    vec![Figure {
        name: "adaptive_futures".into(),
        title: "Adaptive futures, replayed over fixed-S runs".into(),
        panels: vec![panel],
    }]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn least_squares_fits_and_reports_r2() {
        let (a, b, r2) = least_squares(&[(0.0, 1.0), (1.0, 3.0), (2.0, 5.0)]).unwrap();
        assert!((a - 1.0).abs() < 1e-12 && (b - 2.0).abs() < 1e-12 && (r2 - 1.0).abs() < 1e-12);
        // y = 0, 1, 0, 1 at x = 0..3: sxx 5, sxy 1, syy 1: slope 0.2, r² = 1/5.
        let (_, b, r2) = least_squares(&[(0.0, 0.0), (1.0, 1.0), (2.0, 0.0), (3.0, 1.0)]).unwrap();
        assert!(
            (b - 0.2).abs() < 1e-12 && (r2 - 0.2).abs() < 1e-12,
            "{b} {r2}"
        );
        assert!(least_squares(&[(1.0, 0.0), (1.0, 1.0)]).is_none());
        assert!(least_squares(&[]).is_none());
    }

    #[test]
    fn ema_weight_zero_is_raw_and_smooths_otherwise() {
        let p = [(0.0, 0.0), (1.0, 1.0), (2.0, 1.0)];
        assert_eq!(ema(&p, 0.0), p.to_vec());
        let s = ema(&p, 0.5);
        assert_eq!(s[1], (1.0, 0.5));
        assert_eq!(s[2], (2.0, 0.75));
    }

    #[test]
    fn histogram_counts_every_value_once() {
        let v = [0.0, 0.1, 0.5, 1.0, 1.0];
        let e = bin_edges(std::iter::once(&v[..]));
        let steps = hist_steps(&v, &e);
        let total: f64 = steps.iter().skip(1).step_by(2).map(|p| p.1).sum();
        assert_eq!(total, 5.0);
        // One value: a real range around it.
        let e = bin_edges(std::iter::once(&[2.0][..]));
        assert!(e[0] < 2.0 && *e.last().unwrap() > 2.0);
    }
}
