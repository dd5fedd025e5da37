//! `plot`: paper figures from run directories (last stage of the flow: it only reads the
//! files the other stages wrote — `dpo_train` logs, `generate_conv` runs, `eval_multiturn`
//! summaries and games — never their code paths beyond the serialized formats).
//!
//! - `inputs` — readers with errors that name the file, line and field.
//! - `figures` — inputs → figure descriptions (which series, axes, titles, colours).
//! - `chart` — figure descriptions → PNG and SVG through plotters with an embedded font.
//!
//! Colours: every legend name (run or model) of one invocation gets an Okabe–Ito colour by
//! its sorted position, so a model has the same colour in every figure of that invocation.
//! Output is deterministic: the same inputs give byte-identical files.

pub(crate) mod chart;
pub(crate) mod figures;
pub mod inputs;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use plotters::style::RGBColor;

use crate::dataset::DatasetError;
use crate::rollout::records::RecordError;

pub use chart::{render_png, render_svg, Figure};

#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("{}: cannot read: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: invalid JSON: {message}", at(path, *line))]
    Json {
        path: PathBuf,
        line: Option<usize>,
        message: String,
    },
    #[error("{}: field `{field}`: {message}", at(path, *line))]
    Field {
        path: PathBuf,
        line: Option<usize>,
        field: String,
        message: String,
    },
    #[error("{}: {what}", path.display())]
    Empty { path: PathBuf, what: String },
    #[error(transparent)]
    Dataset(#[from] DatasetError),
    #[error(transparent)]
    Record(#[from] RecordError),
    #[error(
        "{}: not a run directory this tool knows (expected logs.jsonl, summary.json, or \
         manifest.json with pairs/)",
        path.display()
    )]
    UnknownDir { path: PathBuf },
    #[error("figure `{figure}`: cannot draw: {message}")]
    Draw { figure: String, message: String },
    #[error("{}: cannot write: {source}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Option(String),
}

fn at(path: &Path, line: Option<usize>) -> String {
    match line {
        Some(l) => format!("{}:{l}", path.display()),
        None => path.display().to_string(),
    }
}

/// File formats written for each figure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Format {
    Png,
    Svg,
}

impl Format {
    pub fn ext(self) -> &'static str {
        match self {
            Format::Png => "png",
            Format::Svg => "svg",
        }
    }
}

/// Options shared by every subcommand.
#[derive(Clone, Debug)]
pub struct Options {
    pub output: PathBuf,
    /// Figure width in pixels (fonts scale with it; 1200 = 8 in at 150 dpi).
    pub width: u32,
    pub formats: Vec<Format>,
    /// EMA weight for training curves, in [0, 1): s ← w·s + (1 − w)·x. `None` = raw only.
    pub smooth: Option<f64>,
    /// Overrides each data run's `config.min_gap` line.
    pub min_gap: Option<f64>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            output: PathBuf::from("outputs/figures"),
            width: chart::BASE_WIDTH,
            formats: vec![Format::Png, Format::Svg],
            smooth: None,
            min_gap: None,
        }
    }
}

/// EMA weights of `--smooth`.
pub const SMOOTH: crate::check::Range = crate::check::Range::closed_open(0.0, 1.0);

impl Options {
    fn check(&self) -> Result<(), PlotError> {
        if let Some(w) = self.smooth {
            SMOOTH.check("--smooth", w).map_err(PlotError::Option)?;
        }
        if let Some(g) = self.min_gap {
            crate::reward::pairs::MIN_GAP
                .check("--min-gap", g)
                .map_err(PlotError::Option)?;
        }
        if !(300..=6000).contains(&self.width) {
            return Err(PlotError::Option(format!(
                "--width {}: must be between 300 and 6000 pixels",
                self.width
            )));
        }
        if self.formats.is_empty() {
            return Err(PlotError::Option("no output format".into()));
        }
        Ok(())
    }
}

/// Legend name → colour, by sorted position over all names of one invocation.
#[derive(Clone, Debug, Default)]
pub struct Palette(BTreeMap<String, RGBColor>);

impl Palette {
    pub fn new<I: IntoIterator<Item = String>>(names: I) -> Palette {
        let sorted: std::collections::BTreeSet<String> = names.into_iter().collect();
        Palette(
            sorted
                .into_iter()
                .enumerate()
                .map(|(i, n)| (n, chart::OKABE_ITO[i % chart::OKABE_ITO.len()]))
                .collect(),
        )
    }

    pub fn color(&self, name: &str) -> RGBColor {
        self.0.get(name).copied().unwrap_or(chart::OKABE_ITO[6])
    }
}

/// One figure written to disk.
#[derive(Clone, Debug)]
pub struct Written {
    pub name: String,
    pub title: String,
    pub files: Vec<PathBuf>,
}

/// Writes `bytes` to `path` atomically and durably ([`crate::run::write_atomic`]).
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), PlotError> {
    crate::run::write_atomic(path, bytes).map_err(|e| PlotError::Write {
        path: path.to_path_buf(),
        source: e.source,
    })
}

/// Renders and writes figures in every requested format.
pub fn write_figures(figs: &[Figure], opts: &Options) -> Result<Vec<Written>, PlotError> {
    std::fs::create_dir_all(&opts.output).map_err(|source| PlotError::Write {
        path: opts.output.clone(),
        source,
    })?;
    let mut out = Vec::new();
    for fig in figs {
        let draw = |message: String| PlotError::Draw {
            figure: fig.name.clone(),
            message,
        };
        let mut files = Vec::new();
        for &f in &opts.formats {
            let bytes = match f {
                Format::Png => render_png(fig, opts.width).map_err(draw)?,
                Format::Svg => render_svg(fig, opts.width).map_err(draw)?.into_bytes(),
            };
            let path = opts.output.join(format!("{}.{}", fig.name, f.ext()));
            write_atomic(&path, &bytes)?;
            files.push(path);
        }
        out.push(Written {
            name: fig.name.clone(),
            title: fig.title.clone(),
            files,
        });
    }
    Ok(out)
}

fn need_dirs(dirs: &[PathBuf]) -> Result<(), PlotError> {
    if dirs.is_empty() {
        return Err(PlotError::Option("no input directory given".into()));
    }
    Ok(())
}

/// `plot train`: loss, margins, accuracies, chosen/rejected rewards and learning rate.
pub fn plot_train(dirs: &[PathBuf], opts: &Options) -> Result<Vec<Written>, PlotError> {
    opts.check()?;
    need_dirs(dirs)?;
    let runs = dirs
        .iter()
        .map(|d| inputs::read_train_run(d))
        .collect::<Result<Vec<_>, _>>()?;
    let palette = Palette::new(runs.iter().map(|r| r.name.clone()));
    write_figures(&figures::train(&runs, &palette, opts.smooth), opts)
}

/// `plot rl`: reward, per-metric reward, KL and response length of rl_train runs.
pub fn plot_rl(dirs: &[PathBuf], opts: &Options) -> Result<Vec<Written>, PlotError> {
    opts.check()?;
    need_dirs(dirs)?;
    let runs = dirs
        .iter()
        .map(|d| inputs::read_train_run(d))
        .collect::<Result<Vec<_>, _>>()?;
    let palette = Palette::new(runs.iter().map(|r| r.name.clone()));
    write_figures(&figures::rl(&runs, &palette, opts.smooth), opts)
}

/// `plot data`: MR of chosen vs rejected, gap histogram, session scores, pairs per turn.
pub fn plot_data(dirs: &[PathBuf], opts: &Options) -> Result<Vec<Written>, PlotError> {
    opts.check()?;
    need_dirs(dirs)?;
    let runs = dirs
        .iter()
        .map(|d| inputs::read_data_run(d))
        .collect::<Result<Vec<_>, _>>()?;
    let palette = Palette::new(runs.iter().map(|r| r.name.clone()));
    write_figures(&figures::data(&runs, &palette, opts.min_gap), opts)
}

fn read_evals(dirs: &[PathBuf]) -> Result<Vec<inputs::EvalRun>, PlotError> {
    dirs.iter().map(|d| inputs::read_eval_run(d)).collect()
}

/// `plot eval`: metric bars with standard errors; task metric against tokens.
pub fn plot_eval(dirs: &[PathBuf], opts: &Options) -> Result<Vec<Written>, PlotError> {
    opts.check()?;
    need_dirs(dirs)?;
    let runs = read_evals(dirs)?;
    let palette = Palette::new(figures::eval_labels(&runs).into_iter().flatten());
    write_figures(&figures::eval(&runs, &palette), opts)
}

/// `plot 20q`: success by question budget, game lengths, information gain.
pub fn plot_20q(dirs: &[PathBuf], opts: &Options) -> Result<Vec<Written>, PlotError> {
    opts.check()?;
    need_dirs(dirs)?;
    let runs = read_evals(dirs)?;
    let games = read_20q(&runs)?;
    let palette = Palette::new(figures::eval_labels(&runs).into_iter().flatten());
    write_figures(&figures::twenty_questions(&runs, &games, &palette), opts)
}

/// `plot study`: each `eval_multiturn --study` output's arms and comparisons.
pub fn plot_study(dirs: &[PathBuf], opts: &Options) -> Result<Vec<Written>, PlotError> {
    opts.check()?;
    need_dirs(dirs)?;
    let studies = dirs
        .iter()
        .map(|d| Ok((inputs::dir_name(d), inputs::read_study(d)?)))
        .collect::<Result<Vec<_>, PlotError>>()?;
    let palette = Palette::new(
        studies
            .iter()
            .flat_map(|(_, s)| s.arms.iter().map(|a| a.name.clone())),
    );
    write_figures(&figures::study(&studies, &palette), opts)
}

/// `plot adaptive`: replays of adaptive futures (`bench adaptive-replay --json` files), one
/// curve each.
pub fn plot_adaptive(files: &[PathBuf], opts: &Options) -> Result<Vec<Written>, PlotError> {
    opts.check()?;
    if files.is_empty() {
        return Err(PlotError::Option("no replay file given".into()));
    }
    let replays = files
        .iter()
        .map(|f| {
            let name = f.file_stem().map_or_else(
                || f.display().to_string(),
                |s| s.to_string_lossy().into_owned(),
            );
            Ok((name, inputs::read_replay(f)?))
        })
        .collect::<Result<Vec<_>, PlotError>>()?;
    let palette = Palette::new(replays.iter().map(|(n, _)| n.clone()));
    write_figures(&figures::adaptive(&replays, &palette), opts)
}

/// Games of each eval run (which must be a 20 Questions evaluation).
fn read_20q(
    runs: &[inputs::EvalRun],
) -> Result<Vec<BTreeMap<String, Vec<inputs::Game>>>, PlotError> {
    runs.iter()
        .map(|r| {
            if r.summary.task != inputs::TWENTY_QUESTIONS {
                return Err(PlotError::Field {
                    path: r.dir.join(inputs::SUMMARY_FILE),
                    line: None,
                    field: "task".into(),
                    message: format!(
                        "is `{}`; `plot 20q` needs `{}`",
                        r.summary.task,
                        inputs::TWENTY_QUESTIONS
                    ),
                });
            }
            inputs::read_games(&r.dir)
        })
        .collect()
}

/// What a directory holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DirKind {
    Train,
    Eval,
    Data,
}

/// Detects a directory's kind by its files.
pub fn detect(dir: &Path) -> Result<DirKind, PlotError> {
    if dir.join(inputs::LOGS_FILE).is_file() {
        Ok(DirKind::Train)
    } else if dir.join(inputs::SUMMARY_FILE).is_file() {
        Ok(DirKind::Eval)
    } else if dir.join(inputs::MANIFEST_FILE).is_file() && dir.join("pairs").is_dir() {
        Ok(DirKind::Data)
    } else {
        Err(PlotError::UnknownDir {
            path: dir.to_path_buf(),
        })
    }
}

pub const INDEX_FILE: &str = "index.md";

/// `plot all`: every figure that applies to each directory, plus `index.md`.
pub fn plot_all(dirs: &[PathBuf], opts: &Options) -> Result<Vec<Written>, PlotError> {
    opts.check()?;
    need_dirs(dirs)?;
    let (mut train, mut eval, mut data) = (Vec::new(), Vec::new(), Vec::new());
    for d in dirs {
        match detect(d)? {
            DirKind::Train => train.push(inputs::read_train_run(d)?),
            DirKind::Eval => eval.push(inputs::read_eval_run(d)?),
            DirKind::Data => data.push(inputs::read_data_run(d)?),
        }
    }
    let tq: Vec<inputs::EvalRun> = eval
        .iter()
        .filter(|r| r.summary.task == inputs::TWENTY_QUESTIONS)
        .cloned()
        .collect();
    let games = read_20q(&tq)?;
    // One palette over every legend name of the invocation.
    let names = train
        .iter()
        .map(|r| r.name.clone())
        .chain(data.iter().map(|r| r.name.clone()))
        .chain(figures::eval_labels(&eval).into_iter().flatten());
    let palette = Palette::new(names);
    let mut figs = Vec::new();
    if !train.is_empty() {
        figs.extend(figures::train(&train, &palette, opts.smooth));
    }
    if !data.is_empty() {
        figs.extend(figures::data(&data, &palette, opts.min_gap));
    }
    if !eval.is_empty() {
        figs.extend(figures::eval(&eval, &palette));
    }
    if !tq.is_empty() {
        figs.extend(figures::twenty_questions(&tq, &games, &palette));
    }
    let written = write_figures(&figs, opts)?;
    write_atomic(
        &opts.output.join(INDEX_FILE),
        index_markdown(dirs, &written, &opts.output).as_bytes(),
    )?;
    Ok(written)
}

/// `index.md`: the inputs and one entry per figure with links relative to the index.
pub fn index_markdown(dirs: &[PathBuf], written: &[Written], output: &Path) -> String {
    let mut s = String::from("# Figures\n\nGenerated by `plot all` from:\n\n");
    for d in dirs {
        s.push_str(&format!("- `{}`\n", d.display()));
    }
    s.push('\n');
    for w in written {
        let links: Vec<String> = w
            .files
            .iter()
            .map(|f| {
                let rel = f.strip_prefix(output).unwrap_or(f);
                format!("[{}]({})", rel.display(), rel.display())
            })
            .collect();
        s.push_str(&format!("## {}\n\n{}\n\n", w.title, links.join(" · ")));
        if let Some(png) = w
            .files
            .iter()
            .find(|f| f.extension().is_some_and(|e| e == "png"))
        {
            let rel = png.strip_prefix(output).unwrap_or(png);
            s.push_str(&format!("![{}]({})\n\n", w.title, rel.display()));
        }
    }
    s
}
