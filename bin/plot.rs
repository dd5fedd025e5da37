//! `plot`: publication figures (PNG + SVG) from dpo_train logs, generate_conv runs and
//! eval_multiturn evaluations. `plot <train|rl|data|eval|20q|study|adaptive|all> <dir>... --output <dir>`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args as ClapArgs, Parser, Subcommand, ValueEnum};
use collabllm::plot::{self, Format, Options, Written};
use collabllm::reward::pairs::MIN_GAP;

/// Figures for papers from run directories; every figure is written as PNG and SVG.
#[derive(Parser, Debug)]
#[command(name = "plot", version, about)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Training curves from dpo_train output directories (`logs.jsonl`): loss, reward
    /// margins, reward accuracies, chosen vs rejected rewards, learning rate; runs overlaid,
    /// eval lines as markers.
    Train {
        /// dpo_train output directories (the legend uses each directory's name).
        #[arg(required = true)]
        runs: Vec<PathBuf>,
        #[command(flatten)]
        common: Common,
        /// Smooth the curves with an exponential moving average of this weight in [0, 1)
        /// (0.9 = heavy); the raw curve stays faint behind.
        #[arg(long, value_parser = plot::SMOOTH.parser())]
        smooth: Option<f64>,
    },
    /// RL curves from rl_train output directories (`logs.jsonl`): reward (held-out reward
    /// as markers), each metric's reward, KL to the reference, response length; runs overlaid.
    Rl {
        /// rl_train output directories (the legend uses each directory's name).
        #[arg(required = true)]
        runs: Vec<PathBuf>,
        #[command(flatten)]
        common: Common,
        /// Smooth the curves with an exponential moving average of this weight in [0, 1).
        #[arg(long, value_parser = plot::SMOOTH.parser())]
        smooth: Option<f64>,
    },
    /// Data figures from generate_conv run directories: MR of chosen vs rejected, the gap
    /// histogram with the min-gap line, per-metric session scores, pairs per turn.
    Data {
        /// generate_conv output directories (manifest.json, pairs/, conversations.jsonl).
        #[arg(required = true)]
        runs: Vec<PathBuf>,
        #[command(flatten)]
        common: Common,
        /// Draw the threshold line here instead of each run's `config.min_gap`.
        #[arg(long, value_parser = MIN_GAP.parser())]
        min_gap: Option<f64>,
    },
    /// Evaluation figures from eval_multiturn output directories (`summary.json`): metric
    /// bars with standard errors per model, task metric against tokens.
    Eval {
        /// eval_multiturn output directories.
        #[arg(required = true)]
        evals: Vec<PathBuf>,
        #[command(flatten)]
        common: Common,
    },
    /// 20 Questions figures from eval_multiturn output directories of task twenty_questions
    /// (`conversations/*.jsonl`): success by question budget, game lengths, information gain.
    #[command(name = "20q")]
    TwentyQ {
        /// eval_multiturn output directories (task twenty_questions).
        #[arg(required = true)]
        evals: Vec<PathBuf>,
        #[command(flatten)]
        common: Common,
    },
    /// Study figures from `eval_multiturn --study` output directories (`study.json`): the
    /// primary outcome of each arm pooled over seeds with its 95% interval (seeds as rings),
    /// and each comparison's difference with its interval against zero.
    Study {
        /// eval_multiturn --study output directories.
        #[arg(required = true)]
        studies: Vec<PathBuf>,
        #[command(flatten)]
        common: Common,
    },
    /// Adaptive futures from `bench adaptive-replay --json` files: futures played (share of
    /// fixed S) against pairs equal to fixed S's, one curve per file (named by its stem).
    Adaptive {
        /// Replay files (JSON).
        #[arg(required = true)]
        files: Vec<PathBuf>,
        #[command(flatten)]
        common: Common,
    },
    /// Every figure that applies to each directory (kind detected from its files), plus an
    /// index.md listing them.
    All {
        /// Any mix of dpo_train, generate_conv and eval_multiturn output directories.
        #[arg(required = true)]
        dirs: Vec<PathBuf>,
        #[command(flatten)]
        common: Common,
        /// EMA weight for training curves (see `plot train --smooth`).
        #[arg(long, value_parser = plot::SMOOTH.parser())]
        smooth: Option<f64>,
        /// Min-gap line for data figures (see `plot data --min-gap`).
        #[arg(long, value_parser = MIN_GAP.parser())]
        min_gap: Option<f64>,
    },
}

#[derive(ClapArgs, Debug)]
struct Common {
    /// Directory the figures are written to (created, with any missing parent folders, if
    /// missing; an existing path that is not a directory is refused).
    #[arg(long, default_value = "outputs/figures")]
    output: PathBuf,
    /// Figure width in pixels; fonts scale with it (1200 = 8 in at 150 dpi).
    #[arg(long, default_value_t = 1200)]
    width: u32,
    /// Formats to write (repeat or comma-separate).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Fmt::Png, Fmt::Svg])]
    format: Vec<Fmt>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Fmt {
    Png,
    Svg,
}

impl std::fmt::Display for Fmt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Fmt::Png => "png",
            Fmt::Svg => "svg",
        })
    }
}

fn options(c: Common, smooth: Option<f64>, min_gap: Option<f64>) -> anyhow::Result<Options> {
    collabllm::run::check_output_dir("--output", &c.output, collabllm::run::Parents::Create)?;
    let mut formats: Vec<Format> = c
        .format
        .iter()
        .map(|f| match f {
            Fmt::Png => Format::Png,
            Fmt::Svg => Format::Svg,
        })
        .collect();
    formats.sort();
    formats.dedup();
    Ok(Options {
        output: c.output,
        width: c.width,
        formats,
        smooth,
        min_gap,
    })
}

fn run(args: Args) -> anyhow::Result<()> {
    let written: Vec<Written> = match args.command {
        Command::Train {
            runs,
            common,
            smooth,
        } => plot::plot_train(&runs, &options(common, smooth, None)?)?,
        Command::Rl {
            runs,
            common,
            smooth,
        } => plot::plot_rl(&runs, &options(common, smooth, None)?)?,
        Command::Data {
            runs,
            common,
            min_gap,
        } => plot::plot_data(&runs, &options(common, None, min_gap)?)?,
        Command::Eval { evals, common } => plot::plot_eval(&evals, &options(common, None, None)?)?,
        Command::TwentyQ { evals, common } => {
            plot::plot_20q(&evals, &options(common, None, None)?)?
        }
        Command::Study { studies, common } => {
            plot::plot_study(&studies, &options(common, None, None)?)?
        }
        Command::Adaptive { files, common } => {
            plot::plot_adaptive(&files, &options(common, None, None)?)?
        }
        Command::All {
            dirs,
            common,
            smooth,
            min_gap,
        } => plot::plot_all(&dirs, &options(common, smooth, min_gap)?)?,
    };
    for w in &written {
        for f in &w.files {
            println!("{}", f.display());
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    collabllm::cli::init_logging();
    collabllm::cli::exit_on_error(run(args))
}
