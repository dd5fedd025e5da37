//! `eval_multiturn`: multi-turn evaluation of one or more assistant models against a
//! simulated user (math, doc_edit, code) or in 20 Questions.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::builder::TypedValueParser;
use clap::Parser;
use collabllm::cli::EndpointArgs;
use collabllm::engine::llama::WeightFormat;
use collabllm::eval::{self, EvalConfig, EvalModel, ObjectSelection, OracleChoice};
use collabllm::llm::{parse_price, ModelSpec, Price};
use collabllm::reward::judge::{InteractivityScale, JudgeMode};
use collabllm::rollout::config::RolloutConfig;
use collabllm::rollout::user::{parse_role_max_tokens, Sampling, TokenRole};
use collabllm::task::prompts::SystemPromptSource;
use collabllm::task::twenty_questions::chat::ObjectSplit;
use collabllm::task::TaskType;

/// Multi-turn evaluation: task success, interactivity and cost of chat models in
/// conversations with a simulated user, or 20 Questions by the LMRL-Gym rules.
///
/// Every model meets the same tasks, seeds, user simulator and judge (or oracle). Outputs in
/// --output: conversations/<model>.jsonl (one line per conversation or game, append-only),
/// summary.json and summary.csv (mean, standard error and n per model × metric),
/// lmrl/<model>.jsonl (20 Questions in LMRL's offline schema), sft/<model>.parquet (with
/// --sft), manifest.json, and cache
/// (a file: every model answer). Killed at any moment, the same command resumes; rerun with more
/// --model flags to add models to an evaluation.
#[derive(Parser, Debug)]
// Negative numbers parse as values: `--flag -1` gets the range check's message.
#[command(
    name = "eval_multiturn",
    version,
    about,
    long_about,
    allow_negative_numbers = true
)]
struct Args {
    /// Task: math, doc_edit, code, twenty_questions or clarify (clarify-or-answer: built-in
    /// requests that state or leave out the one detail the reply needs; --tasks
    /// clarify:test, the held-out requests, by default).
    #[arg(long, value_name = "TASK", required_unless_present_any = ["compare", "study"])]
    task: Option<TaskType>,
    /// Model to evaluate, repeatable: `default`, a .gguf file, an HF directory or id,
    /// `openai:<model>[@<base_url>]`; `proactive:SPEC` (that model with the collaborative
    /// system prompt: the paper's prompted baseline, its own row `<label>-proactive`); for 20
    /// Questions also `reference` (greedy information gain), `random` (random distinct
    /// guesses) and `demonstrator` (a noisy halving questioner: one of the 3 questions of
    /// highest expected gain at random, guesses once 4 or fewer objects remain; with --sft its games
    /// are SFT data); for clarify also `demonstrator` (the mixed demonstrator: on a vague
    /// request asks a short question with probability --ask-rate, else answers generically;
    /// on a stated request answers with the detail, after a needless question with
    /// probability --needless-ask-rate; with --sft its conversations are warm-start data).
    #[arg(
        long = "model",
        value_name = "SPEC",
        required_unless_present_any = ["transcripts", "compare", "study"]
    )]
    models: Vec<EvalModel>,
    /// Output directory (with --compare: where compare.json and compare.md go, optional),
    /// created with any missing parent folders; an existing path that is not a directory is
    /// refused.
    #[arg(long, value_name = "DIR", required_unless_present = "compare")]
    output: Option<PathBuf>,
    /// Statistics of a trained-arms study from finished evaluations: a TOML file naming the
    /// arms (each a list of eval outputs, one per seed, `DIR` or `DIR:label`), the primary
    /// outcome (0/1: `success`, `detail_used`; or a number: clarify's `task_reward`), the
    /// cluster (`task`, or `template` for clarify), secondary metrics and the comparisons.
    /// Writes study.json and study.md to --output: per-seed exact sign tests (McNemar's for
    /// 0/1), and the pooled difference with a 95% bootstrap interval that resamples clusters
    /// (objects, requests or templates), so repeats of one unit are not counted as
    /// independent.
    #[arg(long, value_name = "SPEC", conflicts_with_all = ["models", "compare", "transcripts"])]
    study: Option<PathBuf>,
    /// 20 Questions: re-score games in LMRL-Gym's offline form (JSON lines `{"lines":
    /// ["<question>? <answer>", …], "word": [names…], "correct": …}`) under our rules instead of
    /// playing: writes games.jsonl (one line per input game, in order) and summary.json/.csv.
    /// The file's `correct` is ignored (disagreements are counted).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["models", "compare"])]
    transcripts: Option<PathBuf>,
    /// Compare finished 20 Questions runs on paired games (same object and repeat): each RUN is
    /// an eval_multiturn output directory (every model in it is a row) or a --transcripts
    /// output; the first row is the base. Prints success with 95% Wilson intervals, mean turns,
    /// turns on a win, information gain per question, unparsed rate and McNemar's exact test.
    /// Takes no flag but --output (a run's settings are its own; any other flag is refused),
    /// and a run named twice is refused.
    #[arg(long, value_name = "RUN", num_args = 1.., conflicts_with_all = COMPARE_CONFLICTS)]
    compare: Vec<PathBuf>,
    /// Tasks for math/doc_edit/code/clarify, read as generate_conv reads them: a JSONL or
    /// parquet task file, an upstream flat parquet file, hf:<org>/<name>, or clarify:SPLIT
    /// (the built-in templates: train, test or all) or clarify:FILE.jsonl[#SPLIT] (your own
    /// templates; docs/formats.md) [default: data/<task>.jsonl; clarify:test for clarify].
    #[arg(long, value_name = "PATH")]
    tasks: Option<String>,
    /// Simulated user model.
    #[arg(long, value_name = "SPEC")]
    user: Option<ModelSpec>,
    /// Judge and extractor model.
    #[arg(long, value_name = "SPEC")]
    judge: Option<ModelSpec>,
    /// Evaluate only the first K tasks.
    #[arg(long, value_name = "K")]
    max_tasks: Option<usize>,
    /// Seed of every sampling decision (repeat r uses seed + r).
    #[arg(long, value_name = "X", default_value_t = 0)]
    seed: u64,
    /// Play every task (or object) this many times, with seeds seed, seed+1, ….
    #[arg(long, value_name = "K", default_value_t = 1)]
    repeats: usize,
    /// Assistant replies per conversation at most.
    #[arg(long, value_name = "T")]
    max_turns: Option<usize>,
    /// Conversations (or games) in flight at once.
    #[arg(long, value_name = "C")]
    concurrency: Option<usize>,
    /// 20 Questions oracle: `table` (the attribute table; a question it cannot parse is
    /// answered "No." and counted as unparsed), `llm[:SPEC]` (a model answers "Yes."/"No."; a
    /// bare model spec also means this) or `hybrid[:SPEC]` (the table when the question
    /// parses, the model otherwise); SPEC defaults to `default` [default: hybrid when a model
    /// questioner plays, table for reference/random only].
    #[arg(long, value_name = "ORACLE")]
    oracle: Option<OracleChoice>,
    /// 20 Questions objects: `all` (every object of --split in task order, once each) or N
    /// (the first N of them).
    #[arg(long, value_name = "all|N")]
    objects: Option<ObjectSelection>,
    /// 20 Questions objects by generate_conv's fixed object split: `test` (the held-out
    /// objects, ~20% of each category, that `--tasks 20q:train` never generates data for),
    /// `train` or `all`.
    #[arg(long, value_name = "SPLIT")]
    split: Option<ObjectSplit>,
    /// Evaluate every model row with this system prompt: `proactive` (the collaborative prompt
    /// of prompts/assistant_proactive.j2) or a text file. For the paper's prompted baseline as a
    /// row of its own, add `--model proactive:SPEC` instead.
    #[arg(long, value_name = "FILE|proactive")]
    system_prompt: Option<SystemPromptSource>,
    /// How local models hold their weights: `auto` (GGUF Q5_x and, on the CPU, K-quants
    /// re-quantized to Q8_0, safetensors in f32), `q8` (every linear layer in Q8_0: fastest, and puts a GGUF base and
    /// a merged dpo_train checkpoint on the same footing), `native`, `f32`.
    #[arg(long, value_name = "FORMAT", value_parser = clap::builder::PossibleValuesParser::new(WeightFormat::NAMES)
              .try_map(|s| s.parse::<WeightFormat>()))]
    weights: Option<WeightFormat>,
    /// 20 Questions question budget per game.
    #[arg(long, value_name = "Q")]
    max_questions: Option<usize>,
    /// A generate_conv run directory whose tasks must not be evaluated (repeatable): any
    /// shared task id, goal or 20 Questions object is refused.
    #[arg(long = "exclude-run", value_name = "DIR")]
    exclude_runs: Vec<PathBuf>,
    /// Only warn when evaluation tasks overlap an --exclude-run.
    #[arg(long)]
    allow_overlap: bool,
    /// Sampling temperature of the evaluated models; 0 is greedy [default: 0].
    #[arg(long, value_name = "T", value_parser = Sampling::TEMPERATURE.parser())]
    temperature: Option<f64>,
    /// Also write SFT conversations, sft/<model>.parquet (TRL `messages` form), for
    /// `dpo_train --loss sft --data <that file>`: for 20 Questions each questioner's won games
    /// (the rules, each question and answer, ending at the winning question); for dialogue
    /// tasks every conversation as played (the clarify demonstrator's warm-start data).
    #[arg(long)]
    sft: bool,
    /// 20 Questions, DAgger: label every state of each questioner's games (won or lost) with
    /// the demonstrator's question at that state and merge them into this pairs parquet
    /// (`prompt` = the state as the questioner saw it, `chosen` = the demonstrator's question,
    /// `rejected` = the questioner's own, scores = their expected gains). A questioner's
    /// earlier rows in FILE are replaced, others' kept, so DAgger rounds grow one file;
    /// `dpo_train --loss sft --data FILE` trains on the labels only. FILE's folder must exist,
    /// and an existing FILE must be a regular file (both checked before any game).
    #[arg(long, value_name = "FILE")]
    dagger: Option<PathBuf>,
    /// Clarify `demonstrator`: probability of a clarifying question on a vague request.
    #[arg(long, value_name = "P", value_parser = collabllm::task::clarify::RATE.parser())]
    ask_rate: Option<f64>,
    /// Clarify `demonstrator`: probability of a needless question on a stated request.
    #[arg(long, value_name = "Q", value_parser = collabllm::task::clarify::RATE.parser())]
    needless_ask_rate: Option<f64>,
    /// Token cap of one reply, repeatable: ROLE=N with ROLE policy (the evaluated models), user,
    /// judge or extractor; a bare N caps the evaluated models [default: upstream's policy=2048
    /// user=1024 judge=512 extractor=2048].
    #[arg(long = "max-tokens", value_name = "ROLE=N", value_parser = parse_eval_max_tokens)]
    max_tokens: Vec<(TokenRole, usize)>,
    /// Interactivity judge scale: v2 (0 / 0.5 / 1, upstream CollabLLM), verl, v1 (1–3
    /// rescaled (x − 2.5)·2) or likert5 (1–5 mapped onto [0, 1]).
    #[arg(long, value_name = "SCALE")]
    interactivity_scale: Option<InteractivityScale>,
    /// What token counts (tokens_read_k, tokens_typed_k, token_amount) count: policy (the model's own tokenizer; cl100k_base for endpoints),
    /// cl100k (OpenAI's cl100k_base for every model, comparable across models) or words
    /// (whitespace words; token_amount then counts every message after the prompt, as the
    /// verl recipe).
    #[arg(long, value_enum, value_name = "COUNTER")]
    token_counter: Option<collabllm::llm::tokens::TokenCounterKind>,
    /// Judge mode: auto (log-probabilities for local judges, JSON for endpoints), json, logprob.
    #[arg(long, value_name = "MODE")]
    judge_mode: Option<JudgeMode>,
    #[command(flatten)]
    endpoint: EndpointArgs,
    /// Price of an endpoint model, repeatable: SPEC=INPUT,OUTPUT in USD per million prompt and
    /// completion tokens (e.g. --price openai:gpt-4o=2.5,10). The manifest's cost_usd prices
    /// each role's tokens; local models cost 0, unpriced endpoints null.
    #[arg(long = "price", value_name = "SPEC=IN,OUT", value_parser = parse_price)]
    prices: Vec<(String, Price)>,
    /// Compute threads for local models [default: CANDLE_NUM_THREADS, else all cores].
    #[arg(long, value_name = "N",
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1024))]
    threads: Option<usize>,
    /// Folder of prompt templates replacing the built-in ones (same file names as prompts/).
    #[arg(long, value_name = "DIR")]
    prompts: Option<PathBuf>,
}

/// `ROLE=N`, or a bare `N` for the evaluated models (the flag's older form).
fn parse_eval_max_tokens(s: &str) -> Result<(TokenRole, usize), String> {
    match s.trim().parse::<usize>() {
        Ok(n) => parse_role_max_tokens(&format!("policy={n}")),
        Err(_) => parse_role_max_tokens(s),
    }
}

/// Every flag but --output: --compare reads finished runs, whose settings are their own.
const COMPARE_CONFLICTS: &[&str] = &[
    "task",
    "models",
    "study",
    "transcripts",
    "tasks",
    "user",
    "judge",
    "max_tasks",
    "seed",
    "repeats",
    "max_turns",
    "concurrency",
    "oracle",
    "objects",
    "split",
    "system_prompt",
    "weights",
    "max_questions",
    "exclude_runs",
    "allow_overlap",
    "temperature",
    "sft",
    "dagger",
    "ask_rate",
    "needless_ask_rate",
    "max_tokens",
    "interactivity_scale",
    "token_counter",
    "judge_mode",
    "api_key_env",
    "max_concurrency",
    "timeout",
    "max_retries",
    "prices",
    "threads",
    "prompts",
];

/// Flags that must be given: their config values are no defaults.
const REQUIRED: &[&str] = &["task", "output"];

fn resolve(args: Args) -> anyhow::Result<EvalConfig> {
    let oracle_given = args.oracle.is_some();
    let (Some(task), Some(output)) = (args.task, args.output) else {
        anyhow::bail!("--task and --output are required");
    };
    let mut cfg = EvalConfig {
        task,
        models: args.models,
        output,
        tasks: args.tasks,
        max_tasks: args.max_tasks,
        seed: args.seed,
        repeats: args.repeats,
        exclude_runs: args.exclude_runs,
        allow_overlap: args.allow_overlap,
        sft: args.sft,
        dagger: args.dagger,
        rollout: RolloutConfig {
            threads: args.threads,
            prompts: args.prompts,
            prices: args.prices.into_iter().collect(),
            ..RolloutConfig::default()
        },
        ..EvalConfig::default()
    };
    macro_rules! set {
        ($($field:ident),* $(; rollout: $($shared:ident),*)?) => {
            $( if let Some(v) = args.$field { cfg.$field = v; } )*
            $($( if let Some(v) = args.$shared { cfg.rollout.$shared = v; } )*)?
        };
    }
    set!(
        max_turns,
        ask_rate,
        needless_ask_rate,
        oracle,
        weights,
        split,
        objects,
        token_counter;
        rollout: user, judge, concurrency, max_questions, judge_mode, interactivity_scale
    );
    if args.system_prompt.is_some() {
        cfg.system_prompt = args.system_prompt.clone();
    }
    cfg.set_max_tokens(&args.max_tokens);
    if let Some(t) = args.temperature {
        cfg.assistant_sampling.temperature = t as f32;
    }
    args.endpoint.apply(&mut cfg.rollout.endpoint);
    if cfg.task.is_game() && !oracle_given {
        cfg.oracle = OracleChoice::default_for(&cfg.models);
    }
    cfg.validate()?;
    Ok(cfg)
}

async fn run(cfg: EvalConfig) -> anyhow::Result<()> {
    let shutdown = collabllm::cli::catch_signals()?;
    let report = eval::evaluate_until(cfg, &shutdown).await?;
    println!("{report}");
    println!(
        "summary: {} and {}",
        report.output.join("summary.json").display(),
        report.output.join("summary.csv").display()
    );
    if !report.failed.is_empty() {
        anyhow::bail!(
            "{} conversation(s) failed; rerun the same command to retry them (finished work is kept)",
            report.failed.len()
        );
    }
    Ok(())
}

/// Every output path, checked before any work: an existing one of the wrong kind is refused,
/// as is a missing folder of --dagger's file.
fn check_outputs(args: &Args) -> anyhow::Result<()> {
    use collabllm::run::{check_output_dir, check_output_file, Parents};
    if let Some(dir) = &args.output {
        check_output_dir("--output", dir, Parents::Create)?;
    }
    if let Some(file) = &args.dagger {
        check_output_file("--dagger", file, Parents::MustExist)?;
    }
    Ok(())
}

/// `--compare`: the table, and its files when --output is given.
fn compare(runs: &[PathBuf], output: Option<&std::path::Path>) -> anyhow::Result<()> {
    let cmp = eval::compare::compare_runs(runs, output)?;
    print!("{}", cmp.table());
    if let Some(dir) = output {
        println!(
            "comparison: {} and {}",
            dir.join("compare.json").display(),
            dir.join("compare.md").display()
        );
    }
    Ok(())
}

/// `--transcripts`: re-scores LMRL-Gym games under our rules.
fn transcripts(
    task: Option<TaskType>,
    file: &std::path::Path,
    output: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    if !task.is_some_and(TaskType::is_game) {
        anyhow::bail!("--transcripts needs --task twenty_questions");
    }
    let output = output.context("--transcripts needs --output")?;
    let report = eval::transcripts::rescore_file(file, output)?;
    print!("{report}");
    println!(
        "games: {}; summary: {}",
        output.join(eval::transcripts::GAMES_FILE).display(),
        output.join("summary.json").display()
    );
    Ok(())
}

fn main() -> ExitCode {
    let args: Args = collabllm::cli::parse_with_config_defaults(
        &collabllm::eval::EvalConfig::default(),
        REQUIRED,
    );
    collabllm::cli::init_logging();
    if let Err(e) = check_outputs(&args) {
        return collabllm::cli::exit_on_error(Err(e));
    }
    if !args.compare.is_empty() {
        return collabllm::cli::exit_on_error(compare(&args.compare, args.output.as_deref()));
    }
    if let Some(spec) = &args.study {
        let r = match &args.output {
            Some(out) => eval::study::study_files(spec, out).map(|s| {
                print!("{}", s.table());
                println!("study: {}", out.join("study.json").display());
            }),
            None => Err(anyhow::anyhow!("--study needs --output")),
        };
        return collabllm::cli::exit_on_error(r);
    }
    if let Some(file) = &args.transcripts {
        let r = transcripts(args.task, file, args.output.as_deref());
        return collabllm::cli::exit_on_error(r);
    }
    let cfg = match resolve(args) {
        Ok(c) => c,
        Err(e) => return collabllm::cli::exit_on_error(Err(e)),
    };
    collabllm::cli::set_compute_threads(cfg.rollout.threads);
    let (output, existed) = (cfg.output.clone(), cfg.output.exists());
    let result = collabllm::cli::block_on(run(cfg));
    if result.is_err() {
        collabllm::cli::remove_unused_output(&output, existed);
    }
    collabllm::cli::exit_on_error(result)
}

#[cfg(test)]
mod help_tests {
    use super::*;
    use clap::CommandFactory;

    /// Every `[default: …]` in `--help` is the config's real default, but for the few stated
    /// in words; every flag sets the config field of its name, but for the actions and flags
    /// listed.
    #[test]
    fn help_matches_the_config() {
        let cfg = collabllm::eval::EvalConfig::default();
        assert_eq!(
            cfg.assistant_sampling.temperature, 0.0,
            "--temperature [default: 0]"
        );
        let described = ["temperature", "tasks", "oracle", "max_tokens", "threads"];
        let without_setting = [
            "compare",
            "max_tokens",
            "study",
            "temperature",
            "transcripts",
        ];
        collabllm::cli::assert_help_matches_config(
            Args::command(),
            &cfg,
            REQUIRED,
            &described,
            &without_setting,
        );
    }
}
