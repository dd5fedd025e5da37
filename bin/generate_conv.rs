//! `generate_conv`: build multi-turn conversations with a simulated user, score every
//! candidate reply by the futures it leads to, and write DPO preference pairs.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use collabllm::cli::{EndpointArgs, TwentyQuestionsArgs, TwentyQuestionsTargets};
use collabllm::dataset::verl;
use collabllm::generate::config::TWENTY_QUESTIONS_SOURCE;
use collabllm::generate::import;
use collabllm::generate::proactive::ProactiveStyle;
use collabllm::generate::{self, config, GenerateConfig};
use collabllm::hub;
use collabllm::llm::{parse_price, ModelSpec, Price};
use collabllm::reward::judge::{InteractivityScale, JudgeMode};
use collabllm::reward::metrics::parse_metric_weight;
use collabllm::reward::mr::MrFormula;
use collabllm::reward::pairs::PairMode;
use collabllm::rollout::user::{parse_role_max_tokens, TokenRole};
use collabllm::run::{check_output_dir, Parents, RunLock, Shutdown};
use collabllm::task::prompts::SystemPromptSource;
use collabllm::task::twenty_questions::chat::QUESTION_MAX_TOKENS;
use collabllm::task::TaskType;

/// Multiturn-aware rewards → DPO preference pairs (CollabLLM).
///
/// For every task a simulated user (who knows the hidden goal) opens a conversation; each turn
/// the policy proposes N candidate replies, the user simulator plays S futures from each, the
/// judges and task metrics score every future, and the mean weighted score (the multiturn-aware
/// reward, MR) ranks the candidates. The best continues the conversation; best vs worst becomes
/// a preference pair. Outputs in --output: conversations.jsonl (append-only, every score kept),
/// flat.parquet (upstream schema), pairs/{train,test}.parquet (TRL format, split by
/// conversation), manifest.json, and cache (a file: every model answer, so reruns are free).
///
/// 20 Questions (`--task-type twenty_questions`, objects of `--tasks 20q:train`): the user is
/// the oracle that knows the object (`--oracle`), the candidates are the questioner's next
/// question, and futures are scored exactly under the attribute table (`--metric-preset`).
///
/// Killed at any moment, a rerun with the same --output resumes: finished tasks are kept,
/// half-finished ones replay from the cache. Settings are: built-in defaults ← --config TOML ←
/// flags.
#[derive(Parser, Debug)]
// Negative numbers parse as values: `--flag -1` gets the range check's message.
#[command(
    name = "generate_conv",
    version,
    about,
    long_about,
    allow_negative_numbers = true
)]
struct Args {
    /// Tasks: a JSONL or parquet file of {id, task_type, prompt, reference, metadata}; a parquet
    /// file in the upstream CollabLLM flat schema; hf:<org>/<name>, a published CollabLLM
    /// dataset (e.g. hf:collabllm/collabllm-multiturn-math-hard) whose unique single-turn goals
    /// become the tasks; or 20q:train | 20q:test | 20q:all, the bundled 20 Questions objects
    /// (split by object with a fixed hash, ~20% of each category held out for evaluation)
    /// [default: data/math.jsonl; 20q:train with --task-type twenty_questions].
    #[arg(long, value_name = "PATH")]
    tasks: Option<String>,
    /// Task type of imported flat-schema tasks (math, doc_edit, code, twenty_questions) when
    /// their metadata has none [default: guessed from the dataset's name].
    #[arg(long, value_name = "TYPE")]
    task_type: Option<TaskType>,
    /// Import instead of generating: read hf:<org>/<name> or a local parquet file in the upstream
    /// flat schema and write tasks.jsonl, pairs/{train,test}.parquet (best vs worst score per
    /// turn above --min-gap, split by conversation with --test-fraction and --seed),
    /// flat.parquet and manifest.json into --output. No model is loaded.
    #[arg(long, value_name = "SOURCE", conflicts_with_all = ["rescore", "dry_run"])]
    import: Option<String>,
    /// Generate only shard i of n (0 <= i < n) of the tasks: a task's shard is a hash of its
    /// id, so shards are disjoint, cover every task, and do not move when tasks are added.
    /// Run one shard per machine (same settings, own --output), then --merge.
    #[arg(long, value_name = "I/N")]
    shard: Option<collabllm::generate::config::Shard>,
    /// Merge finished shard runs (the directories given) into --output: conversations
    /// concatenated, pairs / flat / SFT data rebuilt over all of them (pairs re-split by
    /// conversation), usage summed. Refuses unfinished shards, different settings (named) and
    /// a task in two shards. No model is loaded.
    #[arg(long, value_name = "SHARD_DIR", num_args = 2.., conflicts_with_all = ["rescore", "dry_run", "import", "shard"])]
    merge: Vec<PathBuf>,
    /// After a successful run (or import), publish the output as a private dataset repository
    /// <org>/<name> on the Hub (like `push_hf dataset`). Token: HF_TOKEN or the HF token file;
    /// endpoint: HF_ENDPOINT. Never runs mid-run or after failed tasks.
    #[arg(long, value_name = "REPO")]
    push_to_hub: Option<String>,
    /// With --push-to-hub: create the repository public instead of private.
    #[arg(long, requires = "push_to_hub")]
    hub_public: bool,
    /// Export a finished run (or, with --import, the imported data) for a cluster trainer
    /// instead of generating: `verl` writes verl's CollabLLM-recipe parquet files
    /// (rl_{train,validation}.parquet, sft_{train,validation}.parquet; validation chosen by
    /// conversation with --test-fraction and --seed) from --output's flat.parquet.
    #[arg(long, value_name = "FORMAT", value_parser = ["verl"], conflicts_with_all = ["rescore", "dry_run"])]
    export: Option<String>,
    /// Directory of the exported files, created with any missing parent folders [default:
    /// <output>/verl].
    #[arg(long, value_name = "DIR", requires = "export")]
    export_dir: Option<PathBuf>,
    /// With --export: the task description given to verl's simulated user [default: from each
    /// row's task type, e.g. "solving math problems"].
    #[arg(long, value_name = "TEXT", requires = "export")]
    task_desc: Option<String>,
    /// With --export: a file whose text replaces our collaborative system prompt
    /// (prompts/verl_system.txt), e.g. the recipe's own.
    #[arg(long, value_name = "FILE", requires = "export")]
    system_prompt: Option<PathBuf>,
    /// Run directory, created with any missing parent folders (an existing path that is not
    /// a directory is refused).
    #[arg(long, value_name = "DIR")]
    output: Option<PathBuf>,
    /// TOML file with any of the settings below (flags override it).
    #[arg(long, value_name = "TOML")]
    config: Option<PathBuf>,
    /// Policy model proposing the candidates: `default`, a .gguf file, an HF directory or id,
    /// or `openai:<model>[@<base_url>]`.
    #[arg(long, value_name = "SPEC")]
    policy: Option<ModelSpec>,
    /// Simulated user model.
    #[arg(long, value_name = "SPEC")]
    user: Option<ModelSpec>,
    /// Judge and extractor model.
    #[arg(long, value_name = "SPEC")]
    judge: Option<ModelSpec>,
    /// Model for the assistant turns inside futures [default: the policy].
    #[arg(long, value_name = "SPEC")]
    assistant: Option<ModelSpec>,
    /// Candidate replies per turn, N.
    #[arg(long, value_name = "N")]
    candidates: Option<usize>,
    /// Sampling temperature of the candidates (0: greedy, all N alike) [default: 0.7]; a
    /// higher one makes more candidates differ in what they do.
    #[arg(long, value_name = "T", value_parser = collabllm::rollout::user::Sampling::TEMPERATURE.parser())]
    temperature: Option<f64>,
    /// Simulated futures per candidate, S; 0 scores each reply alone (the single-turn reward,
    /// the paper's ablation: pairs from the same candidates without looking ahead);
    /// `adaptive`: every candidate gets --adaptive-min futures, then more only while its
    /// place as best or worst is in doubt (intervals of --adaptive-z standard errors), up to
    /// --adaptive-max (docs/generate_conv.md#adaptive-futures).
    #[arg(long, value_name = "S|adaptive")]
    samples: Option<SamplesArg>,
    /// With --samples adaptive: futures every candidate gets first [default: 2].
    #[arg(long, value_name = "N")]
    adaptive_min: Option<usize>,
    /// With --samples adaptive: futures a candidate gets at most [default: 8].
    #[arg(long, value_name = "N")]
    adaptive_max: Option<usize>,
    /// With --samples adaptive: interval width in standard errors; smaller stops sooner and
    /// agrees less often with the fixed-S pair (1 was the smallest width that kept it in 95 %
    /// of replays on math, 20 Questions and clarify) [default: 1].
    #[arg(long, value_name = "Z", value_parser = collabllm::reward::adaptive::Z.parser())]
    adaptive_z: Option<f64>,
    /// Messages per future (user, assistant, …), W.
    #[arg(long, value_name = "W")]
    window: Option<usize>,
    /// Cap on the real conversation's length in messages [default: 14; 1 + 2 × max_questions
    /// for 20 Questions].
    #[arg(long, value_name = "M")]
    max_messages: Option<usize>,
    /// Follow upstream's defaults where ours differ (docs/fidelity.md): `upstream-v2`
    /// (CollabLLM v2's build_dataset.py: 2 candidates, temperature 0.8, any MR gap pairs,
    /// cl100k token counts, judges uncapped) or `verl` (the verl recipe: MR formula
    /// verl_clamp, its interactivity rubric, a word count for token_amount, S = 3, W = 4).
    /// Applied after --config and before the other flags (a flag still wins); the manifest
    /// records the preset and every value it set.
    #[arg(long, value_name = "PRESET")]
    compat: Option<collabllm::generate::compat::Compat>,
    /// The policy's system prompt: `proactive` (the collaborative prompt of
    /// prompts/assistant_proactive.j2) or a text file. It opens every conversation, so every
    /// pair's prompt keeps it (as upstream), and the futures' assistant sees it too.
    #[arg(long, value_name = "FILE|proactive")]
    policy_system_prompt: Option<SystemPromptSource>,
    #[command(flatten)]
    twenty_questions: TwentyQuestionsArgs,
    /// Use only the first K tasks.
    #[arg(long, value_name = "K")]
    max_tasks: Option<usize>,
    /// Metric weight, repeatable: accuracy, interactivity, token_amount, bleu, pass_rate
    /// (e.g. --metric accuracy=1 --metric token_amount=-0.1) |weight| at most 1e6
    /// [default: per task type].
    #[arg(long = "metric", value_name = "NAME=WEIGHT", value_parser = parse_metric)]
    metrics: Vec<(String, f64)>,
    /// MR formula: mean (Σ_m w_m·mean_k s) or verl_clamp (Σ_m clamp(w_m·mean_k s, −1, 1)).
    #[arg(long, value_name = "FORMULA")]
    mr_formula: Option<MrFormula>,
    /// Minimum MR gap between chosen and rejected.
    #[arg(long, value_name = "G", value_parser = config::MIN_GAP.parser())]
    min_gap: Option<f64>,
    /// Pairs per turn: best (best vs worst), all (every pair above the gap), contrast (action
    /// contrast: the best reply against the worst one that takes the other action, a question
    /// vs an answer by the task's question detector; a turn whose replies all take one action
    /// yields none) or contrast_or_best (contrast where the turn has both actions, else best
    /// vs worst).
    #[arg(long, value_name = "MODE")]
    pairs: Option<PairMode>,
    /// Balance the pairs across strata, repeatable or comma-separated: task metadata fields
    /// (e.g. `stated` for clarify's vague vs stated requests) or `turn` / `action` (the
    /// chosen reply's); each stratum keeps as many pairs as the smallest (within each
    /// --balance-within group), drawn with --seed. Counts by stratum and action go to the
    /// manifest. Re-scorable without calls.
    #[arg(long, value_name = "FIELD", value_delimiter = ',')]
    balance_by: Vec<String>,
    /// With --balance-by: balance each group of this task metadata field on its own (e.g.
    /// `template`: vague and stated 1:1 per template).
    #[arg(long, value_name = "FIELD")]
    balance_within: Option<String>,
    /// Fraction of candidates drawn with the proactive prompt; int(N·R) of them, as upstream.
    #[arg(long, value_name = "R", value_parser = config::PROACT_RATIO.parser())]
    proact_ratio: Option<f64>,
    /// How proactive candidates are prompted: json (upstream's instruction: the conversation in
    /// one user message, a {current_problem, thought, response} answer of which the response is
    /// kept), system (a collaborator system prompt before the conversation), auto (json for
    /// endpoint policies, system for local ones).
    #[arg(long, value_name = "STYLE")]
    proactive_style: Option<ProactiveStyle>,
    /// Share of conversations in pairs/test.parquet.
    #[arg(long, value_name = "F", value_parser = config::TEST_FRACTION.parser())]
    test_fraction: Option<f64>,
    /// Seed of every sampling decision and of the train/test split.
    #[arg(long, value_name = "X")]
    seed: Option<u64>,
    /// Conversations in flight at once.
    #[arg(long, value_name = "C")]
    concurrency: Option<usize>,
    /// Judge mode: auto (log-probabilities for local judges, JSON for endpoints), json, logprob.
    #[arg(long, value_name = "MODE")]
    judge_mode: Option<JudgeMode>,
    /// Interactivity judge scale: v2 (0 / 0.5 / 1, upstream CollabLLM), verl (mean of
    /// understanding, clarification and suggestion, each in [0, 1]), v1 (1–3 rescaled
    /// (x − 2.5)·2, the paper-era scripts), likert5 (1–5 mapped onto [0, 1]).
    #[arg(long, value_name = "SCALE")]
    interactivity_scale: Option<InteractivityScale>,
    /// What token_amount count: policy (the model's own tokenizer; cl100k_base for endpoints),
    /// cl100k (OpenAI's cl100k_base for every model, comparable across models) or words
    /// (the whitespace words of every message after the prompt, the simulated user's
    /// included, as the verl recipe counts).
    #[arg(long, value_enum, value_name = "COUNTER")]
    token_counter: Option<collabllm::llm::tokens::TokenCounterKind>,
    /// Token cap of one reply, repeatable: ROLE=N with ROLE policy (candidates, and the future
    /// assistant turns unless assistant= is given), assistant, user, judge or extractor
    /// [default: upstream's policy=2048 user=1024 judge=512 extractor=2048]. A candidate cut
    /// at its cap is recorded (finish_reason "length") and counted in the summary.
    #[arg(long = "max-tokens", value_name = "ROLE=N", value_parser = parse_role_max_tokens)]
    max_tokens: Vec<(TokenRole, usize)>,
    #[command(flatten)]
    endpoint: EndpointArgs,
    /// Price of an endpoint model, repeatable: SPEC=INPUT,OUTPUT in USD per million prompt and
    /// completion tokens (e.g. --price openai:gpt-4o-mini=0.15,0.60). The manifest's cost_usd
    /// prices each role's tokens; local models cost 0, unpriced endpoints null.
    #[arg(long = "price", value_name = "SPEC=IN,OUT", value_parser = parse_price)]
    prices: Vec<(String, Price)>,
    /// Compute threads for local models [default: CANDLE_NUM_THREADS, else all cores].
    #[arg(long, value_name = "N",
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1024))]
    threads: Option<usize>,
    /// Folder of prompt templates replacing the built-in ones (same file names as prompts/).
    #[arg(long, value_name = "DIR")]
    prompts: Option<PathBuf>,
    /// Rebuild MR, pairs and parquet files from conversations.jsonl with the given weights,
    /// --min-gap, --pairs, --balance-by and --mr-formula, without any model call.
    #[arg(long)]
    rescore: bool,
    /// Print the plan and an upper bound on the model calls, then exit.
    #[arg(long)]
    dry_run: bool,
}

fn parse_metric(s: &str) -> Result<(String, f64), String> {
    parse_metric_weight(s).map_err(|e| e.to_string())
}

/// `--samples`: a number of futures, or `adaptive`.
#[derive(Clone, Copy, Debug)]
enum SamplesArg {
    Fixed(usize),
    Adaptive,
}

impl std::str::FromStr for SamplesArg {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "adaptive" {
            return Ok(Self::Adaptive);
        }
        s.parse()
            .map(Self::Fixed)
            .map_err(|_| format!("`{s}`: expected a number of futures (0 or more) or `adaptive`"))
    }
}

/// `--samples` and the `--adaptive-*` settings (which need adaptive sampling, from the flag
/// or the config's `[adaptive]` table).
fn apply_samples(args: &Args, cfg: &mut GenerateConfig) -> anyhow::Result<()> {
    match args.samples {
        Some(SamplesArg::Fixed(s)) => {
            cfg.samples = s;
            cfg.adaptive = None;
        }
        Some(SamplesArg::Adaptive) => cfg.adaptive = Some(cfg.adaptive.unwrap_or_default()),
        None => {}
    }
    let given =
        args.adaptive_min.is_some() || args.adaptive_max.is_some() || args.adaptive_z.is_some();
    let Some(rule) = cfg.adaptive.as_mut() else {
        anyhow::ensure!(
            !given,
            "--adaptive-min, --adaptive-max and --adaptive-z need --samples adaptive"
        );
        return Ok(());
    };
    if let Some(n) = args.adaptive_min {
        rule.min_futures = n;
    }
    if let Some(n) = args.adaptive_max {
        rule.max_futures = n;
    }
    if let Some(z) = args.adaptive_z {
        rule.z = z;
    }
    Ok(())
}

fn resolve(args: &Args) -> anyhow::Result<GenerateConfig> {
    let mut cfg = match &args.config {
        Some(p) => GenerateConfig::from_toml_file(p)?,
        None => GenerateConfig::default(),
    };
    // defaults ← --config ← --compat ← the other flags.
    if let Some(c) = args.compat {
        cfg.compat = Some(c.apply(&mut cfg));
    }
    macro_rules! set {
        ($($field:ident),* $(; rollout: $($shared:ident),*)?) => {
            $( if let Some(v) = args.$field.clone() { cfg.$field = v; } )*
            $($( if let Some(v) = args.$shared.clone() { cfg.rollout.$shared = v; } )*)?
        };
    }
    set!(
        tasks,
        output,
        policy,
        candidates,
        window,
        max_messages,
        mr_formula,
        min_gap,
        pairs,
        proact_ratio,
        test_fraction,
        seed,
        token_counter,
        proactive_style;
        rollout: user, judge, concurrency, judge_mode, interactivity_scale
    );
    apply_samples(args, &mut cfg)?;
    if let Some(t) = args.temperature {
        cfg.policy_sampling.temperature = t as f32;
    }
    if !args.balance_by.is_empty() {
        cfg.balance_by = args.balance_by.clone();
    }
    if args.balance_within.is_some() {
        cfg.balance_within = args.balance_within.clone();
    }
    cfg.set_max_tokens(&args.max_tokens);
    if args.task_type.is_some() {
        cfg.task_type = args.task_type;
    }
    if args.assistant.is_some() {
        cfg.assistant = args.assistant.clone();
    }
    if args.shard.is_some() {
        cfg.shard = args.shard;
    }
    if args.max_tasks.is_some() {
        cfg.max_tasks = args.max_tasks;
    }
    if args.threads.is_some() {
        cfg.rollout.threads = args.threads;
    }
    if args.prompts.is_some() {
        cfg.rollout.prompts = args.prompts.clone();
    }
    args.twenty_questions.apply(
        &args.metrics,
        args.window.is_some(),
        TwentyQuestionsTargets {
            metrics: &mut cfg.metrics,
            oracle: &mut cfg.oracle,
            max_questions: &mut cfg.rollout.max_questions,
            midgame: &mut cfg.midgame,
            future_questioner: &mut cfg.rollout.future_questioner,
            window: &mut cfg.window,
        },
    );
    if args.policy_system_prompt.is_some() {
        cfg.system_prompt = args.policy_system_prompt.clone();
    }
    if cfg.task_type.is_some_and(TaskType::is_game) && args.tasks.is_none() && args.config.is_none()
    {
        cfg.tasks = format!("{TWENTY_QUESTIONS_SOURCE}train");
    }
    if cfg.plays_twenty_questions() {
        // A game's own length (the rules, then a question and its answer each), and a
        // question's length, unless given.
        if args.max_messages.is_none() && args.config.is_none() {
            cfg.max_messages = 1 + 2 * cfg.rollout.max_questions;
        }
        let capped = |r: TokenRole| args.max_tokens.iter().any(|(role, _)| *role == r);
        if args.config.is_none() && !capped(TokenRole::Policy) {
            cfg.policy_sampling.max_tokens = QUESTION_MAX_TOKENS;
            if !capped(TokenRole::Assistant) {
                cfg.assistant_sampling.max_tokens = QUESTION_MAX_TOKENS;
            }
        }
    }
    cfg.rollout.prices.extend(args.prices.iter().cloned());
    args.endpoint.apply(&mut cfg.rollout.endpoint);
    cfg.validate()?;
    check_output_dir("--output", &cfg.output, Parents::Create)?;
    if let Some(dir) = &args.export_dir {
        check_output_dir("--export-dir", dir, Parents::Create)?;
    }
    Ok(cfg)
}

async fn run(args: Args, cfg: GenerateConfig) -> anyhow::Result<()> {
    if let Some(repo) = &args.push_to_hub {
        // Fail before hours of generation, not after.
        hub::split_repo(repo)?;
        if hub::Token::from_env().is_none() {
            return Err(hub::HubError::NoToken {
                path: hub::token_path(),
            })
            .context("--push-to-hub");
        }
    }
    if args.dry_run {
        let tasks = generate::run::fetch_config_tasks(&cfg).await?;
        println!("{}", generate::plan(&cfg, &tasks));
        return Ok(());
    }
    if !args.merge.is_empty() {
        let summary = generate::merge::merge_runs(&args.merge, &cfg.output)?;
        println!("{summary}");
        return push_at_end(&args, &cfg).await;
    }
    if let Some(source) = &args.import {
        let opts = import::ImportOptions {
            task_type: cfg.task_type,
            min_gap: cfg.min_gap,
            pairs: cfg.pairs,
            test_fraction: cfg.test_fraction,
            seed: cfg.seed,
            endpoint: None,
        };
        std::fs::create_dir_all(&cfg.output)
            .with_context(|| format!("creating {}", cfg.output.display()))?;
        let _lock = RunLock::acquire(&cfg.output)?;
        let summary = import::import(source, &cfg.output, &opts).await?;
        println!("{summary}\noutput         {}", cfg.output.display());
        export(&args, &cfg)?;
        return push_at_end(&args, &cfg).await;
    }
    if args.export.is_some() {
        flat_to_export(&cfg)?;
        let _lock = RunLock::acquire(&cfg.output)?;
        return export(&args, &cfg);
    }
    let (summary, shutdown) = if args.rescore {
        (generate::rescore(&cfg)?, Shutdown::never())
    } else {
        // From here a signal stops the run cleanly (status `interrupted`), and the push too.
        let shutdown = collabllm::cli::catch_signals()?;
        (
            generate::generate_until(cfg.clone(), &shutdown).await?,
            shutdown,
        )
    };
    println!("{summary}");
    let pairs = cfg.output.join("pairs");
    println!(
        "pairs: {} and {}",
        pairs.join("train.parquet").display(),
        pairs.join("test.parquet").display()
    );
    if !summary.tasks_failed.is_empty() {
        anyhow::bail!(
            "{} task(s) failed; rerun the same command to retry them (finished work is kept){}",
            summary.tasks_failed.len(),
            if args.push_to_hub.is_some() {
                "; nothing was pushed to the Hub"
            } else {
                ""
            }
        );
    }
    shutdown.guard(push_at_end(&args, &cfg)).await?
}

/// The flat rows file of the run directory being exported.
fn flat_to_export(cfg: &GenerateConfig) -> anyhow::Result<PathBuf> {
    let flat = cfg.output.join("flat.parquet");
    if !flat.is_file() {
        anyhow::bail!(
            "--export: {} not found; export a finished generate_conv run or an --import",
            flat.display()
        );
    }
    Ok(flat)
}

/// `--export verl`: the run's flat rows as verl's CollabLLM-recipe parquet files.
fn export(args: &Args, cfg: &GenerateConfig) -> anyhow::Result<()> {
    if args.export.is_none() {
        return Ok(());
    }
    let rows = collabllm::dataset::read_flat_parquet(&flat_to_export(cfg)?)?;
    let mut opts = verl::VerlOptions {
        task_desc: args.task_desc.clone(),
        validation_fraction: cfg.test_fraction,
        seed: cfg.seed,
        ..Default::default()
    };
    if let Some(path) = &args.system_prompt {
        opts.system_prompt = std::fs::read_to_string(path)
            .with_context(|| format!("--system-prompt {}", path.display()))?
            .trim_end()
            .to_string();
    }
    let dir = args
        .export_dir
        .clone()
        .unwrap_or_else(|| cfg.output.join("verl"));
    let summary = verl::export_verl(&rows, &dir, &opts)?;
    println!("{summary}\nexport         {}", dir.display());
    Ok(())
}

/// `--push-to-hub`: one push of the finished output directory.
async fn push_at_end(args: &Args, cfg: &GenerateConfig) -> anyhow::Result<()> {
    let Some(repo) = &args.push_to_hub else {
        return Ok(());
    };
    let opts = hub::PushOptions {
        private: !args.hub_public,
        ..hub::PushOptions::from_env()
    };
    let report = hub::push_dataset_dir(&cfg.output, repo, false, &opts)
        .await
        .with_context(|| format!("--push-to-hub {repo}"))?;
    println!("{report}");
    Ok(())
}

fn main() -> ExitCode {
    let args: Args = collabllm::cli::parse_with_config_defaults(&GenerateConfig::default(), &[]);
    collabllm::cli::init_logging();
    let cfg = match resolve(&args) {
        Ok(c) => c,
        Err(e) => return collabllm::cli::exit_on_error(Err(e)),
    };
    collabllm::cli::set_compute_threads(cfg.rollout.threads);
    let (output, existed) = (cfg.output.clone(), cfg.output.exists());
    let result = collabllm::cli::block_on(run(args, cfg));
    if result.is_err() {
        collabllm::cli::remove_unused_output(&output, existed);
    }
    collabllm::cli::exit_on_error(result)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// Every `[default: …]` in `--help` is the config's real default, but for the few stated
    /// in words; every flag sets the config field of its name, but for the actions and flags
    /// listed.
    #[test]
    fn help_matches_the_config() {
        let cfg = GenerateConfig::default();
        // The adaptive flags state their defaults by hand: they must be the rule's.
        let rule = collabllm::reward::adaptive::AdaptiveRule::default();
        assert_eq!((rule.min_futures, rule.max_futures, rule.z), (2, 8, 1.0));
        // --temperature states the policy sampling's default by hand.
        assert_eq!(cfg.policy_sampling.temperature, 0.7);
        // The adaptive rule's defaults live in `reward::adaptive::AdaptiveRule`, a table
        // that is absent from a default config.
        let described = [
            "adaptive_max",
            "adaptive_min",
            "adaptive_z",
            "task_type",
            "export_dir",
            "task_desc",
            "assistant",
            "metrics",
            "max_tokens",
            "threads",
            "max_messages",
            "temperature",
        ];
        let without_setting = [
            "adaptive_max",
            "adaptive_min",
            "adaptive_z",
            "balance_by",
            "balance_within",
            "config",
            "dry_run",
            "export",
            "export_dir",
            "hub_public",
            "import",
            "max_tokens",
            "merge",
            "metric_preset",
            "policy_system_prompt",
            "push_to_hub",
            "rescore",
            "task_desc",
            "temperature",
        ];
        collabllm::cli::assert_help_matches_config(
            Args::command(),
            &cfg,
            &[],
            &described,
            &without_setting,
        );
    }
}
