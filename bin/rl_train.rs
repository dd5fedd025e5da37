//! `rl_train`: online RL of a local chat model with the multiturn-aware reward.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use collabllm::cli::{EndpointArgs, TwentyQuestionsArgs, TwentyQuestionsTargets};
use collabllm::generate::compat::Compat;
use collabllm::llm::tokens::TokenCounterKind;
use collabllm::llm::ModelSpec;
use collabllm::reward::judge::{InteractivityScale, JudgeMode};
use collabllm::reward::metrics::parse_metric_weight;
use collabllm::reward::mr::MrFormula;
use collabllm::reward::pairs::PairMode;
use collabllm::rollout::user::{parse_role_max_tokens, TokenRole};
use collabllm::run::{check_output_dir, Parents};
use collabllm::task::TaskType;
use collabllm::train::rl::config::{self as rl, Algo, Opening, RlRunConfig, TruncatedReward};
use collabllm::train::rl::run::rl_train_until;
use collabllm::train::settings::{self, Schedule};

/// Online RL with the multiturn-aware reward (CollabLLM's verl recipe: GRPO; also Dr. GRPO,
/// RLOO and online DPO), on our own trainer and sampler.
///
/// Each step takes B prompts (the simulated user opens each task's conversation from its
/// hidden goal); the current policy samples n responses per prompt; each response is
/// continued S times by the simulated user and the same policy for up to W messages and
/// every future is scored by the task metrics (the same rollout core generate_conv uses); the
/// multiturn-aware reward (MR) of each response gives group-relative advantages, and the
/// clipped surrogate with a k3 KL term to the initial model updates the weights (response
/// tokens only). A response with no valid score leaves its group. The sampler is rebuilt
/// from the updated weights after every step.
///
/// Outputs in --output: logs.jsonl (per step, TRL/verl names: reward, reward_std,
/// rewards/<metric>/mean, kl, clip_ratio, entropy, completion_length, advantages/*, loss,
/// grad_norm, learning_rate, time/*, api/*), rollouts.jsonl (every prompt, response, future
/// and score), checkpoint-<k>/ and final/ (HF layout, or PEFT with --lora-r; servable by
/// `serve`), rl_config.json, rl_summary.json, cache. Settings: defaults ← --config TOML ←
/// flags.
#[derive(Parser, Debug)]
// Negative numbers parse as values: `--lr -1` gets the range check's message.
#[command(
    name = "rl_train",
    version,
    about,
    long_about,
    allow_negative_numbers = true
)]
struct Args {
    /// Tasks: a JSONL or parquet file of {id, task_type, prompt, reference, metadata}, an
    /// upstream CollabLLM flat parquet file, hf:<org>/<name>, or 20q:train | 20q:test |
    /// 20q:all (the bundled 20 Questions objects: the user is the oracle, rewards are exact).
    #[arg(long, value_name = "PATH")]
    tasks: Option<String>,
    /// Task type of imported flat-schema tasks without one in their metadata.
    #[arg(long, value_name = "TYPE")]
    task_type: Option<TaskType>,
    /// Use only the first K tasks.
    #[arg(long, value_name = "K")]
    max_tasks: Option<usize>,
    /// Held-out tasks, scored with one response each every --eval-every steps (logged as
    /// eval/reward).
    #[arg(long, value_name = "PATH")]
    eval_tasks: Option<String>,
    /// Validate on --eval-tasks every K steps (and after the last step).
    #[arg(long, value_name = "K")]
    eval_every: Option<usize>,
    /// Use only the first K held-out tasks.
    #[arg(long, value_name = "K")]
    eval_max_tasks: Option<usize>,
    /// Run directory, created with any missing parent folders (an existing path that is not
    /// a directory is refused).
    #[arg(long, value_name = "DIR")]
    output: Option<PathBuf>,
    /// TOML file with any of the settings (field names as in rl_config.json); flags override it.
    #[arg(long, value_name = "TOML")]
    config: Option<PathBuf>,
    /// Continue the run in --output from its last checkpoint (same data order and seeds);
    /// on a finished run, does nothing and says so. Refuses changed math settings.
    #[arg(long)]
    resume: bool,
    /// Model to train: `default`, a .gguf file, an HF directory (e.g. a dpo_train final/) or
    /// an HF id.
    #[arg(long, value_name = "SPEC")]
    model: Option<String>,
    /// Simulated user model: a local spec or openai:<model>[@<base_url>].
    #[arg(long, value_name = "SPEC")]
    user: Option<ModelSpec>,
    /// Judge and extractor model.
    #[arg(long, value_name = "SPEC")]
    judge: Option<ModelSpec>,
    /// Prompts per step, B (at most 65536).
    #[arg(long, value_name = "B")]
    batch_prompts: Option<usize>,
    /// Responses sampled per prompt, n (2 to 1024).
    #[arg(long, value_name = "N")]
    group_size: Option<usize>,
    /// Who writes each prompt: `user` (the simulated user opens the conversation from the
    /// task's hidden goal), `task` (the task's prompt verbatim: a fixed prompt set, no
    /// simulator call) or `dataset` (every conversation prefix of an upstream flat dataset,
    /// as the verl recipe trains: multi-turn histories ending in a user turn).
    #[arg(long, value_name = "FROM")]
    opening: Option<Opening>,
    /// Futures per response, S; 0 scores each response alone (the single-turn reward, as
    /// TRL's GRPOTrainer optimises; at most 64).
    #[arg(long, value_name = "S")]
    samples: Option<usize>,
    /// Messages per future (user, assistant, …), W.
    #[arg(long, value_name = "W")]
    window: Option<usize>,
    /// Longest sampled response and assistant turn in a future, in tokens (at most
    /// --max-length).
    #[arg(long, value_name = "T")]
    max_new_tokens: Option<usize>,
    /// Sampling temperature of the policy, in (0, 10]; 0.7 suits small models, whose samples
    /// at 1.0 are mostly off-task (the verl recipe samples at 1.0).
    #[arg(long, value_name = "T", value_parser = rl::TEMPERATURE.parser())]
    temperature: Option<f64>,
    /// Nucleus sampling mass of the policy, in (0, 1].
    #[arg(long, value_name = "P", value_parser = rl::TOP_P.parser())]
    top_p: Option<f64>,
    /// Steps (rollout batches) to train.
    #[arg(long, value_name = "N")]
    max_steps: Option<usize>,
    /// Metric weight, repeatable: accuracy, interactivity, token_amount, bleu, pass_rate, and
    /// for 20 Questions info_gain, success, questions, lmrl_return (e.g. --metric
    /// token_amount=-1) |weight| at most 1e6
    /// [default: per task type].
    #[arg(long = "metric", value_name = "NAME=WEIGHT", value_parser = parse_metric)]
    metrics: Vec<(String, f64)>,
    #[command(flatten)]
    twenty_questions: TwentyQuestionsArgs,
    /// MR formula used as reward: mean or verl_clamp (both are recorded).
    #[arg(long, value_name = "FORMULA")]
    mr_formula: Option<MrFormula>,
    /// grpo ((R−mean)/(std+1e-6)), drgrpo (R−mean), rloo (leave-one-out), or online_dpo
    /// (best vs worst of each group as a DPO pair).
    #[arg(long, value_name = "ALGO")]
    algo: Option<Algo>,
    /// Peak learning rate (see --schedule) [default: 1e-6 (the verl recipe's, for all weights),
    /// or 2e-5 with --lora-r (as dpo_train: adapters need a larger rate; 3e-4 drifted the
    /// default model 1–4 nats a token from its reference in a few steps)].
    #[arg(long, value_name = "X", value_parser = settings::LR.parser())]
    lr: Option<f64>,
    /// Coefficient of the k3 KL loss to the initial model; 0 turns the reference off.
    #[arg(long, value_name = "X", value_parser = rl::KL_COEF.parser())]
    kl_coef: Option<f64>,
    /// PPO clip range ε: the ratio is clipped to [1−ε, 1+ε], ε in (0, 1].
    #[arg(long, value_name = "EPS", value_parser = rl::CLIP_RATIO.parser())]
    clip_ratio: Option<f64>,
    /// Dual-clip bound c (> 1) for negative advantages.
    #[arg(long, value_name = "C", value_parser = rl::CLIP_RATIO_C.parser())]
    clip_ratio_c: Option<f64>,
    /// Entropy bonus coefficient.
    #[arg(long, value_name = "X", value_parser = rl::ENTROPY_COEF.parser())]
    entropy_coef: Option<f64>,
    /// How per-token losses become the step's loss, as verl's `loss_agg_mode` names them:
    /// token-mean (every response token of the mini-batch alike), seq-mean-token-sum,
    /// seq-mean-token-mean (the original GRPO), seq-mean-token-sum-norm (token sums over the
    /// constant --max-new-tokens: Dr. GRPO).
    #[arg(long, value_name = "MODE", value_parser = parse_loss_agg)]
    loss_agg: Option<String>,
    /// Passes over each step's responses.
    #[arg(long, value_name = "E")]
    ppo_epochs: Option<usize>,
    /// Responses per optimizer step; 0 = all of the step's.
    #[arg(long, value_name = "M")]
    mini_batch: Option<usize>,
    /// Prompts per optimizer step, as verl's ppo_mini_batch_size counts them (each brings
    /// its --group-size responses), 1 to --batch-prompts; replaces --mini-batch. Two or
    /// more mini-batches a step let the importance ratio move, so the clip acts.
    #[arg(long, value_name = "P")]
    ppo_mini_batch: Option<usize>,
    /// Follow the verl CollabLLM recipe (recipe/collabllm/train_rl_collabllm.sh): GRPO, lr
    /// 1e-6, low-variance KL loss 0.001, entropy 0, token-mean, 16 prompts × 8 responses in
    /// mini-batches of 8 prompts, temperature 1 (top_p 1), 2048-token responses, S = 3,
    /// W = 4, judge cap 2048, MR verl_clamp, its interactivity rubric, token_amount as
    /// words of every message after the prompt, truncated responses scored 0 without
    /// futures. Applied after --config and before the other flags (a flag still wins);
    /// rl_config.json and rl_summary.json record every value it set.
    #[arg(long, value_name = "PRESET")]
    compat: Option<Compat>,
    /// Interactivity judge scale: v2 (0 / 0.5 / 1, upstream CollabLLM), verl (mean of
    /// understanding, clarification and suggestion, each in [0, 1]), v1, likert5.
    #[arg(long, value_name = "SCALE")]
    interactivity_scale: Option<InteractivityScale>,
    /// What token_amount counts: policy (the trained model's tokens of the assistant
    /// turns), cl100k, or words (the whitespace words of every message after the prompt,
    /// the simulated user's included, as the verl recipe counts).
    #[arg(long, value_enum, value_name = "COUNTER")]
    token_counter: Option<TokenCounterKind>,
    /// A response cut at --max-new-tokens: futures (played and scored like any other) or
    /// zero (no futures, reward 0, as verl does, so running long never pays).
    #[arg(long, value_enum, value_name = "HOW")]
    truncated: Option<TruncatedReward>,
    /// Responses (online DPO: pairs) per forward/backward pass; 0 = the whole mini-batch.
    #[arg(long, value_name = "M")]
    micro_batch: Option<usize>,
    /// AdamW weight decay, >= 0.
    #[arg(long, value_name = "W", value_parser = settings::WEIGHT_DECAY.parser())]
    weight_decay: Option<f64>,
    /// Clip the global gradient norm to this; 0: no clipping.
    #[arg(long, value_name = "N", value_parser = settings::MAX_GRAD_NORM.parser())]
    max_grad_norm: Option<f64>,
    /// Longest prompt + response that trains, in tokens (longer ones are dropped, counted).
    #[arg(long, value_name = "L")]
    max_length: Option<usize>,
    /// Online DPO temperature β.
    #[arg(long, value_name = "B", value_parser = rl::BETA.parser())]
    beta: Option<f64>,
    /// Online DPO: minimum MR gap between best and worst of a group.
    #[arg(long, value_name = "G", value_parser = rl::MIN_GAP.parser())]
    min_gap: Option<f64>,
    /// Online DPO: the pair a group yields — best (best vs worst reward), contrast (the best
    /// against the worst response that takes the other action, ask vs answer; none when all
    /// take one) or contrast_or_best (contrast where possible, else best vs worst).
    #[arg(long, value_name = "MODE")]
    pairs: Option<PairMode>,
    /// Temperature of the policy's replies inside futures (0: greedy) [default: --temperature].
    /// A lower one makes a response's reward depend less on a lucky or unlucky future.
    #[arg(long, value_name = "T", value_parser = rl::FUTURE_TEMPERATURE.parser())]
    future_temperature: Option<f64>,
    /// Draw each step's prompts evenly from the values of this task metadata field (e.g.
    /// `stated`: half stated, half vague clarify requests), each value's tasks in their own
    /// seeded epochs [default: one shuffled order over all tasks].
    #[arg(long, value_name = "FIELD")]
    balance_by: Option<String>,
    /// Share of a step's prompts that start one exchange later: the current policy replies to
    /// the opening once and, where the simulated user answers instead of ending, the group
    /// answers that — the later turns the policy itself reaches (e.g. a clarify request after
    /// the user gave the detail) train too. In [0, 1].
    #[arg(long, value_name = "P", value_parser = rl::CONTINUE_RATE.parser())]
    continue_rate: Option<f64>,
    /// Train LoRA adapters of rank R (1 to 4096; PEFT layout) instead of all weights.
    #[arg(long, value_name = "R")]
    lora_r: Option<usize>,
    /// LoRA α.
    #[arg(long, value_name = "A", value_parser = settings::LORA_ALPHA.parser())]
    lora_alpha: Option<f64>,
    /// Save a checkpoint every K steps (always final/ at the end).
    #[arg(long, value_name = "K")]
    save_steps: Option<usize>,
    /// Seed of the data order, every sample and the LoRA initialisation.
    #[arg(long, value_name = "X")]
    seed: Option<u64>,
    /// Trainer device: cpu, cuda or cuda:N (needs a build with --features cuda).
    #[arg(long, value_name = "DEV")]
    device: Option<String>,
    /// How the sampler holds the synced weights: auto (q8 on the CPU), f32 or q8.
    #[arg(long, value_name = "FMT")]
    sampler_weights: Option<String>,
    /// Responses scored at once.
    #[arg(long, value_name = "C")]
    concurrency: Option<usize>,
    /// Judge mode: auto, json, logprob.
    #[arg(long, value_name = "MODE")]
    judge_mode: Option<JudgeMode>,
    #[command(flatten)]
    endpoint: EndpointArgs,
    /// Compute threads [default: CANDLE_NUM_THREADS, else all cores].
    #[arg(long, value_name = "N",
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1024))]
    threads: Option<usize>,
    /// Folder of prompt templates replacing the built-in ones.
    #[arg(long, value_name = "DIR")]
    prompts: Option<PathBuf>,
    /// Learning-rate schedule over the run's optimizer steps: constant, linear or cosine.
    #[arg(long, value_enum, value_name = "SCHEDULE")]
    schedule: Option<Schedule>,
    /// Share of the optimizer steps that warm the rate up linearly from 0, in [0, 1].
    #[arg(long, value_name = "R")]
    warmup_ratio: Option<f64>,
    /// Recompute each layer's activations in the backward pass: less memory, one more
    /// forward pass per micro-batch.
    #[arg(long)]
    gradient_checkpointing: bool,
    /// Train on groups whose responses differ only in token counts (token_amount,
    /// reply_tokens). By default such groups get zero advantage and are counted
    /// (advantages/length_only_groups): under GRPO their few-thousandths reward differences
    /// would become ±1 advantages for length alone.
    #[arg(long)]
    keep_length_only_groups: bool,
    /// Per-role token cap, repeatable: user=N (simulated user's turns, default 1024),
    /// judge=N (512), extractor=N (2048); policy=N and assistant=N set --max-new-tokens
    /// (the trained model plays the assistant inside futures). Futures usually dominate a
    /// step's time: a short user cap is the cheapest speed-up.
    #[arg(long = "max-tokens", value_name = "ROLE=N", value_parser = parse_role_max_tokens)]
    max_tokens: Vec<(TokenRole, usize)>,
}

fn parse_loss_agg(s: &str) -> Result<String, String> {
    s.parse::<collabllm::train::rl::loss::LossAgg>()
        .map(|a| a.as_str().to_string())
}

fn parse_metric(s: &str) -> Result<(String, f64), String> {
    parse_metric_weight(s).map_err(|e| e.to_string())
}

fn resolve(args: &Args) -> anyhow::Result<RlRunConfig> {
    let mut cfg = match &args.config {
        Some(p) => RlRunConfig::from_toml_file(p)?,
        None => RlRunConfig::default(),
    };
    // defaults ← --config ← --compat ← the other flags.
    if let Some(c) = args.compat {
        cfg.apply_compat(c)?;
    }
    macro_rules! set {
        ($($field:ident),*; optim: $($trainer:ident),*; rollout: $($shared:ident),*) => {
            $( if let Some(v) = args.$field.clone() { cfg.$field = v; } )*
            $( if let Some(v) = args.$trainer.clone() { cfg.optim.$trainer = v; } )*
            $( if let Some(v) = args.$shared.clone() { cfg.rollout.$shared = v; } )*
        };
    }
    macro_rules! set_opt {
        ($($field:ident),*; optim: $($trainer:ident),*; rollout: $($shared:ident),*) => {
            $( if args.$field.is_some() { cfg.$field = args.$field.clone(); } )*
            $( if args.$trainer.is_some() { cfg.optim.$trainer = args.$trainer.clone(); } )*
            $( if args.$shared.is_some() { cfg.rollout.$shared = args.$shared.clone(); } )*
        };
    }
    set!(
        tasks,
        output,
        model,
        batch_prompts,
        group_size,
        opening,
        samples,
        window,
        max_new_tokens,
        temperature,
        top_p,
        max_steps,
        mr_formula,
        algo,
        kl_coef,
        clip_ratio,
        clip_ratio_c,
        entropy_coef,
        loss_agg,
        ppo_epochs,
        mini_batch,
        micro_batch,
        max_length,
        beta,
        min_gap,
        pairs,
        continue_rate,
        lora_alpha,
        sampler_weights,
        token_counter,
        truncated;
        optim: lr, weight_decay, max_grad_norm, schedule, warmup_ratio, seed, device;
        rollout: user, judge, concurrency, judge_mode, interactivity_scale
    );
    // One way to size mini-batches: the flag given wins over the preset's or file's other.
    if args.mini_batch.is_some() {
        cfg.ppo_mini_batch = None;
    }
    if let Some(p) = args.ppo_mini_batch {
        (cfg.ppo_mini_batch, cfg.mini_batch) = (Some(p), 0);
    }
    set_opt!(
        task_type,
        max_tasks,
        eval_tasks,
        eval_every,
        eval_max_tasks,
        balance_by,
        future_temperature,
        lora_r;
        optim: save_steps;
        rollout: threads, prompts
    );
    if args.lr.is_none() && cfg.lora_r.is_some() && cfg.optim.lr == RlRunConfig::default().optim.lr
    {
        cfg.optim.lr = settings::LORA_LR;
    }
    cfg.optim.gradient_checkpointing |= args.gradient_checkpointing;
    cfg.keep_length_only_groups |= args.keep_length_only_groups;
    cfg.set_max_tokens(&args.max_tokens);
    if let Some(v) = args.max_new_tokens {
        // The dedicated flag wins over policy=/assistant= caps.
        cfg.max_new_tokens = v;
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
    args.endpoint.apply(&mut cfg.rollout.endpoint);
    cfg.validate()?;
    check_output_dir("--output", &cfg.output, Parents::Create)?;
    Ok(cfg)
}

fn main() -> ExitCode {
    let args: Args = collabllm::cli::parse_with_config_defaults(&RlRunConfig::default(), &[]);
    collabllm::cli::init_logging();
    let cfg = match resolve(&args) {
        Ok(c) => c,
        Err(e) => return collabllm::cli::exit_on_error(Err(e)),
    };
    collabllm::cli::set_compute_threads(cfg.rollout.threads);
    collabllm::cli::keep_freed_memory();
    let (output, existed) = (cfg.output.clone(), cfg.output.exists());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime");
    let result = runtime.and_then(|rt| {
        let summary = rt.block_on(async {
            // From here SIGINT/SIGTERM stop the run after the step in progress, saved.
            let shutdown = collabllm::cli::catch_signals()?;
            rl_train_until(cfg, args.resume, true, &shutdown).await
        })?;
        println!("{summary}");
        Ok(())
    });
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
        let cfg = RlRunConfig::default();
        let described = [
            "metrics",
            "threads",
            "lr",
            "save_steps",
            "eval_every",
            "balance_by",
            "future_temperature",
        ];
        let without_setting = [
            "balance_by",
            "compat",
            "config",
            "future_temperature",
            "max_tokens",
            "metric_preset",
            "ppo_mini_batch",
            "resume",
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
