//! What every binary shares: logging set-up, thread settings, and error reporting without a
//! backtrace.

use std::io::IsTerminal;
use std::path::Path;
use std::process::ExitCode;

use crate::llm::EndpointOptions;
use crate::task::twenty_questions::chat::OracleMode;
use crate::task::twenty_questions::future::FutureQuestioner;
use crate::task::twenty_questions::GAME_PRESET;

/// The 20 Questions and reward-preset flags of `generate_conv` and `rl_train`, defined once
/// (flattened into each binary's arguments).
#[derive(clap::Args, Clone, Debug, Default)]
pub struct TwentyQuestionsArgs {
    /// Named metric weights: `20q-infogain` (success=1, info_gain=1, reply_tokens=-0.5:
    /// exact, no judge; the 20 Questions default), `20q-interactive` (success=1,
    /// interactivity=1, reply_tokens=-0.5), or `20q-game` (success=1, lmrl_return=0.04,
    /// reply_tokens=-0.5, and futures that play the game out: the window becomes the whole
    /// game, 2 × max_questions messages, and the demonstrator asks the later questions,
    /// unless --window or --future-questioner say otherwise). info_gain is the candidate
    /// question's expected gain under the table; lmrl_return is −1 per question and +1 for a
    /// win over the candidate and its future; reply_tokens counts the candidate alone.
    /// --metric flags add to or override its weights.
    #[arg(long, value_name = "NAME", value_parser = crate::reward::metrics::parse_metric_preset)]
    pub metric_preset: Option<String>,
    /// 20 Questions: who answers the questions. `table`: the attribute table, exact (a
    /// question it cannot parse is answered "No.", LMRL-Gym's rule, and counted); `llm`: the
    /// --user model; `hybrid`: the table when the question parses, the model otherwise
    /// [default: table].
    #[arg(long, value_name = "ORACLE")]
    pub oracle: Option<OracleMode>,
    /// 20 Questions: questions per game; a game also ends on a win [default: 20].
    #[arg(long, value_name = "Q")]
    pub max_questions: Option<usize>,
    /// 20 Questions: start each game after N or fewer questions of the demonstrator (a noisy
    /// halving questioner; the number drawn uniformly in 0..=N per game, the table
    /// answering), so the model is trained in mid-game positions, not only on its first
    /// question [default: 0, the opening only].
    #[arg(long, value_name = "N")]
    pub midgame: Option<usize>,
    /// 20 Questions: who asks the questions after the candidate inside a future. `policy`:
    /// the futures' assistant (the policy unless --assistant names another model);
    /// `demonstrator`: the built-in noisy halving questioner, a fixed competent continuation,
    /// so a question is valued by how the game goes from the state it leaves (no model call)
    /// [default: policy; demonstrator with --metric-preset 20q-game].
    #[arg(long, value_name = "WHO")]
    pub future_questioner: Option<FutureQuestioner>,
}

/// The settings [`TwentyQuestionsArgs::apply`] may set.
pub struct TwentyQuestionsTargets<'a> {
    pub metrics: &'a mut std::collections::BTreeMap<String, f64>,
    pub oracle: &'a mut OracleMode,
    pub max_questions: &'a mut usize,
    pub midgame: &'a mut usize,
    pub future_questioner: &'a mut FutureQuestioner,
    /// Messages per future.
    pub window: &'a mut usize,
}

impl TwentyQuestionsArgs {
    /// Sets what was given: the weights (preset, then `--metric` flags) when either was
    /// given, the oracle, the question budget, the future questioner; the `20q-game` preset
    /// also sets the whole-game window (unless `window_given`) and the demonstrator (unless
    /// --future-questioner was given).
    pub fn apply(
        &self,
        metric_flags: &[(String, f64)],
        window_given: bool,
        t: TwentyQuestionsTargets<'_>,
    ) {
        if let Some(w) =
            crate::reward::metrics::weights_from_flags(self.metric_preset.as_deref(), metric_flags)
        {
            *t.metrics = w;
        }
        if let Some(o) = self.oracle {
            *t.oracle = o;
        }
        if let Some(q) = self.max_questions {
            *t.max_questions = q;
        }
        if let Some(n) = self.midgame {
            *t.midgame = n;
        }
        if self.metric_preset.as_deref() == Some(GAME_PRESET) {
            *t.future_questioner = FutureQuestioner::Demonstrator;
            if !window_given {
                *t.window = 2 * *t.max_questions;
            }
        }
        if let Some(q) = self.future_questioner {
            *t.future_questioner = q;
        }
    }
}

/// The OpenAI-compatible endpoint flags of every binary that calls models; each replaces the
/// config file's `endpoint` value only when given. The `[default: …]` texts are checked
/// against [`EndpointOptions::default`] by a test.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct EndpointArgs {
    /// Environment variable holding the API key of OpenAI-compatible endpoints [default: OPENAI_API_KEY].
    #[arg(long, value_name = "VAR")]
    pub api_key_env: Option<String>,
    /// Requests in flight per endpoint [default: 16].
    #[arg(long, value_name = "N")]
    pub max_concurrency: Option<usize>,
    /// Seconds before one endpoint attempt is abandoned, in (0, 86400] [default: 120].
    #[arg(long, value_name = "SECS", value_parser = EndpointOptions::TIMEOUT_S.parser())]
    pub timeout: Option<f64>,
    /// Retries per endpoint call after the first attempt [default: 5].
    #[arg(long, value_name = "N")]
    pub max_retries: Option<u32>,
}

impl EndpointArgs {
    /// Overrides the settings given on the command line.
    pub fn apply(&self, endpoint: &mut EndpointOptions) {
        if let Some(v) = &self.api_key_env {
            endpoint.api_key_env = v.clone();
        }
        if let Some(v) = self.max_concurrency {
            endpoint.max_concurrency = v;
        }
        if let Some(v) = self.timeout {
            endpoint.timeout_s = v;
        }
        if let Some(v) = self.max_retries {
            endpoint.max_retries = v;
        }
    }
}

/// Sets up `tracing` to stderr; `RUST_LOG` overrides the default level (`info`). Colours only
/// on a terminal, and never with `NO_COLOR` set (no-color.org).
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(use_color(
            std::io::stderr().is_terminal(),
            std::env::var_os("NO_COLOR"),
        ))
        .with_target(false)
        .try_init();
}

/// Whether to write ANSI colour codes: only to a terminal, and not when `NO_COLOR` is set to a
/// non-empty value.
pub fn use_color(terminal: bool, no_color: Option<std::ffi::OsString>) -> bool {
    terminal && no_color.is_none_or(|v| v.is_empty())
}

/// After a failed run: removes the output directory `dir` when the run created it (`existed`
/// is false) and it holds nothing but empty files and folders (and the run lock, which
/// only names a pid), which is what a setup that failed (a model that would not load)
/// leaves. A directory that existed before, or that holds any byte of output, is never
/// touched.
pub fn remove_unused_output(dir: &Path, existed: bool) {
    fn unused(dir: &Path) -> bool {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return false;
        };
        entries.into_iter().all(|e| {
            let Ok(e) = e else { return false };
            if e.file_name() == crate::run::LOCK_FILE {
                return true;
            }
            match e.file_type() {
                Ok(t) if t.is_dir() => unused(&e.path()),
                Ok(t) if t.is_file() => e.metadata().is_ok_and(|m| m.len() == 0),
                _ => false,
            }
        })
    }
    if !existed && unused(dir) {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Fixes the number of threads candle's CPU kernels use. Must run before the first model is
/// loaded: candle reads the variables once, when its thread pool starts (its
/// workers spin-wait, so more threads than free cores collapses throughput).
pub fn set_compute_threads(threads: Option<usize>) {
    let n = threads.unwrap_or_else(|| {
        std::env::var("CANDLE_NUM_THREADS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
    });
    // SAFETY: called at start-up, before any other thread of ours exists.
    unsafe {
        std::env::set_var("CANDLE_NUM_THREADS", n.to_string());
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
}

/// Runs a binary's body and turns an error into one readable message and exit code 1, or
/// 128 + the signal's number for a run [interrupted](crate::run::Interrupted) by a signal.
pub fn exit_on_error(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            for line in error_lines(&e) {
                eprintln!("{line}");
            }
            match crate::run::interrupted_exit_code(&e) {
                Some(code) => ExitCode::from(code),
                None => ExitCode::FAILURE,
            }
        }
    }
}

/// How a binary reports `e`: the error, then each cause the messages before it do not
/// already name (many errors state their cause in their own message).
fn error_lines(e: &anyhow::Error) -> Vec<String> {
    let mut shown = e.to_string();
    let mut lines = vec![format!("error: {shown}")];
    for cause in e.chain().skip(1).map(|c| c.to_string()) {
        if !shown.contains(&cause) {
            lines.push(format!("  caused by: {cause}"));
            shown = cause;
        }
    }
    lines
}

/// Runs a binary's async body on a multi-threaded runtime, then shuts the runtime down
/// without waiting long for blocking work that a run stopped by a signal left behind (its
/// results are not wanted).
pub fn block_on(body: impl std::future::Future<Output = anyhow::Result<()>>) -> anyhow::Result<()> {
    use anyhow::Context;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let result = rt.block_on(body);
    rt.shutdown_timeout(std::time::Duration::from_millis(200));
    result
}

/// Catches SIGINT/SIGTERM from now on (see [`Shutdown::on_signals`](crate::run::Shutdown)):
/// call it just before the work that stops on them, so that everything before keeps the
/// default (a signal ends the process).
pub fn catch_signals() -> anyhow::Result<crate::run::Shutdown> {
    use anyhow::Context;
    crate::run::Shutdown::on_signals().context("catching SIGINT/SIGTERM")
}

/// Peak resident set size (run bookkeeping; re-exported for the binaries).
pub use crate::run::peak_rss_bytes;

/// Keeps freed heap memory for reuse instead of returning it to the kernel after every large
/// tensor (glibc's trim threshold). Training allocates and frees the same activation sizes
/// each layer and step; returning and re-faulting those pages cost about 8 % of a CPU step
/// (BENCHMARKS.md), for no gain in peak memory. No-op elsewhere.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator parameters; called at start-up.
    unsafe {
        // Setting either value turns glibc's adaptive mmap threshold off, so both are set:
        // blocks up to 32 MiB (glibc's maximum) come from the heap and are reused.
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

/// Parses a binary's flags with `--help` stating each setting's default from `defaults` (the
/// config's `Default`, serialized): a flag whose clap id is a config field with a number or
/// text default gets `[default: …]` appended, so the default is written once, in the config.
/// Flags that state their default by hand (in words, or from another field) keep their text,
/// as do flags with a clap default; `required` names flags that must be given (required
/// unless another flag is), whose config value is no default. A binary's test checks the
/// hand-written texts with [`assert_help_defaults`].
pub fn parse_with_config_defaults<A: clap::Parser>(
    defaults: &impl serde::Serialize,
    required: &[&str],
) -> A {
    let command = with_config_defaults(A::command(), defaults, required);
    let parsed = command
        .try_get_matches()
        .and_then(|m| A::from_arg_matches(&m));
    parsed.unwrap_or_else(|e| e.exit())
}

/// `command` with `[default: …]` added to the help of every flag that has a config default
/// and states none by hand (see [`parse_with_config_defaults`]).
pub fn with_config_defaults(
    mut command: clap::Command,
    defaults: &impl serde::Serialize,
    required: &[&str],
) -> clap::Command {
    let defaults = serde_json::to_value(defaults).unwrap_or_default();
    let additions: Vec<(String, String)> = command
        .get_arguments()
        .filter(|arg| {
            !help_text(arg).contains("[default: ")
                && arg.get_default_values().is_empty()
                && !required.contains(&arg.get_id().as_str())
        })
        .filter_map(|arg| {
            let id = arg.get_id().as_str();
            default_text(defaults.get(id)?).map(|text| (id.to_string(), text))
        })
        .collect();
    for (id, text) in additions {
        command = command.mut_arg(id, |arg| {
            let with_default = |h: &clap::builder::StyledStr| {
                let h = h.to_string();
                let h = h.trim_end();
                match h.strip_suffix('.') {
                    Some(stem) => format!("{stem} [default: {text}]."),
                    None => format!("{h} [default: {text}]"),
                }
            };
            let help = arg.get_help().map(with_default);
            let long = arg.get_long_help().map(with_default);
            let arg = match help {
                Some(h) => arg.help(h),
                None => arg,
            };
            match long {
                Some(h) => arg.long_help(h),
                None => arg,
            }
        });
    }
    command
}

/// A flag's help as `--help` prints it (the long form where there is one).
fn help_text(arg: &clap::Arg) -> String {
    arg.get_long_help()
        .or_else(|| arg.get_help())
        .map(|h| h.to_string())
        .unwrap_or_default()
}

/// How a config default reads in `--help`: numbers and non-empty texts; not switches
/// (`false` goes without saying), absent values, lists or tables.
fn default_text(value: &serde_json::Value) -> Option<String> {
    match value {
        // `16`, not `16.0`: a whole float reads as the integer the user would type.
        serde_json::Value::Number(n) => Some(match n.as_f64() {
            Some(f) if n.is_f64() && f.fract() == 0.0 && f.abs() < 1e15 => format!("{f:.0}"),
            _ => n.to_string(),
        }),
        serde_json::Value::String(s) if !s.is_empty() => Some(s.clone()),
        _ => None,
    }
}

/// The `[default: …]` texts a binary's `--help` states by hand that disagree with the
/// defaults its config really has (`defaults`: the config's `Default`, serialized; a flag's
/// clap id is its field name). Numbers are compared as numbers (`1e-6` = `0.000001`), other
/// values as their serialized text; a default stated in words (`per task type`) is skipped
/// when its flag is listed in `described`. Every `[default: …]` must be checked or described:
/// one whose flag has no config field is reported too.
/// The endpoint flags' ids: their `[default: …]` texts are checked against
/// `EndpointOptions::default` by this module's own test, not against a binary's config.
const ENDPOINT_FLAG_IDS: [&str; 4] = ["api_key_env", "max_concurrency", "timeout", "max_retries"];

/// The flags of `command` that set no config field of the same name (`defaults`: the
/// config's `Default`, serialized), sorted: a binary's test lists the ones it expects (actions
/// such as `--resume`, flags that set a field of another name), so a renamed setting cannot
/// silently lose its flag's derived `[default: …]`.
pub fn flags_without_setting(
    command: &clap::Command,
    defaults: &impl serde::Serialize,
) -> Vec<String> {
    let defaults = serde_json::to_value(defaults).unwrap_or_default();
    let mut ids: Vec<String> = command
        .get_arguments()
        .map(|arg| arg.get_id().as_str())
        .filter(|id| !matches!(*id, "help" | "version") && !ENDPOINT_FLAG_IDS.contains(id))
        .filter(|id| defaults.get(id).is_none())
        .map(str::to_string)
        .collect();
    ids.sort();
    ids
}

/// A binary's `--help` against its config (the binary's unit test), as
/// [`parse_with_config_defaults`] builds it: every `[default: …]`, derived or written by hand,
/// is the config's real default but for the flags in `described` (defaults stated in words),
/// and the flags that set no config field of their name are exactly `without_setting`
/// (actions, flags of other names, settings absent from a default config), so a renamed
/// setting cannot silently lose its derived default.
pub fn assert_help_matches_config(
    command: clap::Command,
    defaults: &impl serde::Serialize,
    required: &[&str],
    described: &[&str],
    without_setting: &[&str],
) {
    assert_eq!(flags_without_setting(&command, defaults), without_setting);
    let command = with_config_defaults(command, defaults, required);
    assert_help_defaults(&command, defaults, described);
}

/// Panics, listing them, if [`stale_help_defaults`] finds any (a binary's unit test).
pub fn assert_help_defaults(
    command: &clap::Command,
    defaults: &impl serde::Serialize,
    described: &[&str],
) {
    let defaults = serde_json::to_value(defaults).expect("the config serializes");
    let wrong = stale_help_defaults(command, &defaults, described);
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

pub fn stale_help_defaults(
    command: &clap::Command,
    defaults: &serde_json::Value,
    described: &[&str],
) -> Vec<String> {
    let mut wrong = Vec::new();
    for arg in command.get_arguments() {
        let id = arg.get_id().as_str();
        let help = help_text(arg);
        let Some(start) = help.find("[default: ") else {
            continue;
        };
        if described.contains(&id) || ENDPOINT_FLAG_IDS.contains(&id) {
            continue;
        }
        let stated = help[start + 10..]
            .split([']', ' ', ',', ';'])
            .next()
            .unwrap_or_default()
            .trim_end_matches('.');
        let Some(actual) = defaults.get(id) else {
            wrong.push(format!(
                "--{id}: `[default: {stated}]` names no config field `{id}`"
            ));
            continue;
        };
        let agrees = match actual {
            serde_json::Value::Number(n) => stated
                .parse::<f64>()
                .is_ok_and(|s| n.as_f64().is_some_and(|a| (a - s).abs() <= 1e-12 * a.abs())),
            serde_json::Value::String(s) => s == stated,
            serde_json::Value::Bool(b) => b.to_string() == stated,
            _ => false,
        };
        if !agrees {
            wrong.push(format!(
                "--{id}: help says `[default: {stated}]`, the config's default is {actual}"
            ));
        }
    }
    wrong
}

#[cfg(test)]
mod tests {
    use super::use_color;

    #[test]
    fn a_cause_the_message_already_names_is_said_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file");
        let read = crate::task::TaskError::Read {
            path: "data/x.jsonl".into(),
            source: io,
        };
        let e = anyhow::Error::new(read).context("--tasks");
        assert_eq!(
            super::error_lines(&e),
            [
                "error: --tasks",
                "  caused by: data/x.jsonl: cannot read: No such file",
            ]
        );
        let plain = anyhow::anyhow!("disk full").context("writing out/manifest.json");
        assert_eq!(super::error_lines(&plain).len(), 2);
    }

    #[test]
    fn help_states_the_configs_defaults_unless_the_flag_states_its_own() {
        use clap::{CommandFactory, FromArgMatches, Parser};
        #[derive(Parser)]
        struct Cli {
            /// Futures per reply.
            #[arg(long)]
            samples: Option<usize>,
            /// Learning rate
            #[arg(long)]
            lr: Option<f64>,
            /// LoRA α.
            #[arg(long)]
            alpha: Option<f64>,
            /// Weights [default: per task type].
            #[arg(long)]
            metrics: Option<String>,
            /// Skip the judge.
            #[arg(long)]
            no_judge: bool,
            /// Threads.
            #[arg(long)]
            threads: Option<usize>,
            /// Repeats.
            #[arg(long, default_value_t = 1)]
            repeats: usize,
        }
        #[derive(serde::Serialize)]
        struct Config {
            samples: usize,
            lr: f64,
            alpha: f64,
            metrics: String,
            no_judge: bool,
            threads: Option<usize>,
            repeats: usize,
        }
        let config = Config {
            samples: 3,
            lr: 1e-6,
            alpha: 16.0,
            metrics: "accuracy".into(),
            no_judge: false,
            threads: None,
            repeats: 1,
        };
        let command = super::with_config_defaults(Cli::command(), &config, &[]);
        let help = |id: &str| {
            let arg = command.get_arguments().find(|a| a.get_id() == id).unwrap();
            super::help_text(arg)
        };
        assert_eq!(help("samples"), "Futures per reply [default: 3]");
        assert_eq!(help("lr"), "Learning rate [default: 1e-6]");
        assert_eq!(help("alpha"), "LoRA α [default: 16]");
        assert_eq!(help("metrics"), "Weights [default: per task type]");
        assert_eq!(help("no_judge"), "Skip the judge");
        assert_eq!(help("threads"), "Threads");
        // clap states its own default (once); a required flag states none.
        let rendered = command.clone().render_long_help().to_string();
        assert_eq!(rendered.matches("[default: 1]").count(), 1, "{rendered}");
        let required = super::with_config_defaults(Cli::command(), &config, &["samples"]);
        let samples = required.get_arguments().find(|a| a.get_id() == "samples");
        assert_eq!(super::help_text(samples.unwrap()), "Futures per reply");
        assert!(super::stale_help_defaults(
            &command,
            &serde_json::to_value(&config).unwrap(),
            &["metrics"]
        )
        .is_empty());
        // The flags parse as before: the defaults are help text, not values.
        let parsed = Cli::from_arg_matches(&command.try_get_matches_from(["cli"]).unwrap());
        assert_eq!(parsed.unwrap().samples, None);
    }

    #[test]
    fn endpoint_flag_defaults_in_help_match_the_library() {
        use clap::CommandFactory;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            endpoint: super::EndpointArgs,
        }
        let d = crate::llm::EndpointOptions::default();
        let cmd = Cli::command();
        let help = |id: &str| {
            cmd.get_arguments()
                .find(|a| a.get_id() == id)
                .and_then(|a| a.get_help())
                .map(|h| h.to_string())
                .unwrap_or_default()
        };
        let expect = [
            ("api_key_env", d.api_key_env.clone()),
            ("max_concurrency", d.max_concurrency.to_string()),
            ("timeout", d.timeout_s.to_string()),
            ("max_retries", d.max_retries.to_string()),
        ];
        for (id, value) in expect {
            let h = help(id);
            assert!(h.contains(&format!("[default: {value}]")), "--{id}: {h}");
        }
        let mut e = crate::llm::EndpointOptions::default();
        let args = super::EndpointArgs {
            timeout: Some(3.0),
            ..Default::default()
        };
        args.apply(&mut e);
        assert_eq!((e.timeout_s, e.max_retries), (3.0, d.max_retries));
    }

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(use_color(true, None));
        assert!(use_color(true, Some("".into())));
        assert!(!use_color(true, Some("1".into())));
        assert!(!use_color(false, None));
    }
}
