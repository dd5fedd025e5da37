//! `serve`: an OpenAI-compatible HTTP server over a local model.

use std::process::ExitCode;

use anyhow::Context;
use clap::builder::TypedValueParser;
use clap::Parser;
use collabllm::engine::llama::WeightFormat;
use collabllm::llm::local::{LoadOptions, LocalBackend};
use collabllm::llm::{ModelSpec, SharedBackend};
use collabllm::serve::ModelNames;

/// Serve a local model over an OpenAI-compatible HTTP API.
///
/// Endpoints: POST /v1/chat/completions and POST /v1/completions (raw text or token ids, no
/// chat template; `echo` with `logprobs` scores the prompt; `stream: true` for SSE on both),
/// GET /v1/models, GET /health, and vLLM's POST /tokenize, POST /detokenize and GET
/// /tokenizer_info (lm-evaluation-harness's `local-completions` tokenizes through them, so it
/// needs only the URL). Any OpenAI client works with base URL http://HOST:PORT/v1 and any API key.
/// One model per server: a request's `model` must be the reported id (--model-id), the
/// --model value as given, or an --alias; any other name is a 404 `model_not_found`.
///
/// Limits: request bodies up to 16 MiB; a prompt whose bytes alone cannot fit the context is
/// refused before tokenizing, an explicit max_tokens must fit beside the prompt (400
/// `context_length_exceeded`). Concurrent requests are decoded together (continuous batching,
/// up to --max-batch samples at once) and `stream: true` sends the reply token by token; a
/// client that disconnects stops its generation at the next token, or before it starts if it
/// was still queued.
/// Stop with ctrl-c: requests in flight are finished first.
#[derive(Parser, Debug)]
#[command(name = "serve", version, about, long_about)]
struct Args {
    /// Model to serve: `default` (the embedded SmolLM2-135M-Instruct GGUF), a path to a
    /// `.gguf` file, a Hugging Face model directory (config.json, tokenizer.json,
    /// *.safetensors), or an HF model id (`org/name` or `hf:org/name[@revision]`, fetched into
    /// the HF cache). `openai:` endpoints cannot be served: point clients at them directly.
    #[arg(long, value_name = "SPEC", value_parser = parse_local_spec)]
    model: ModelSpec,

    /// Address to bind. The default accepts local connections only; without --api-key-env
    /// the server has no authentication, so think twice before binding 0.0.0.0.
    #[arg(long, value_name = "HOST", default_value = "127.0.0.1")]
    host: String,

    /// Require `Authorization: Bearer <key>` on every request but /health, the key being the
    /// value of environment variable VAR (e.g. --api-key-env SERVE_API_KEY; clients send it
    /// as their OpenAI API key). Refused at start-up when VAR is unset or empty.
    #[arg(long, value_name = "VAR")]
    api_key_env: Option<String>,

    /// Port to listen on (0 picks a free one; the address is printed at start-up).
    #[arg(long, value_name = "PORT", default_value_t = 8000)]
    port: u16,

    /// Threads for the model's compute kernels [default: CANDLE_NUM_THREADS, else all cores].
    /// More threads than free cores slows generation down sharply.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1024))]
    threads: Option<u64>,

    /// Model name reported in responses and by GET /v1/models [default: the loaded model's
    /// name].
    #[arg(long, value_name = "NAME", value_parser = parse_name)]
    model_id: Option<String>,

    /// Another name a request's `model` may give (repeatable), e.g. the name a client is
    /// configured with.
    #[arg(long = "alias", value_name = "NAME", value_parser = parse_name)]
    aliases: Vec<String>,

    /// How the weights are held in memory: `auto` (the file's own quantization, Q8_0 and Q4_1
    /// in our CPU kernel, GGUF Q5_0/Q5_1 and (on the CPU) K-quants re-quantized to Q8_0;
    /// safetensors in f32), `q8`
    /// (every linear layer re-quantized to Q8_0; output differs slightly from the original
    /// weights), `native` (each GGUF tensor in the file's own type: what the file holds, with
    /// candle's slower kernels for Q5_x and K-quants), `f32` (dequantized
    /// to f32: the exact reference, for checking output token for token against
    /// transformers; about 4x the memory of q8 and slower).
    #[arg(long, value_name = "FORMAT", default_value = "auto",
          value_parser = clap::builder::PossibleValuesParser::new(WeightFormat::NAMES)
              .try_map(|s| s.parse::<WeightFormat>()))]
    weights: WeightFormat,

    /// Samples (over all requests in flight) decoded together in one batch; requests beyond
    /// it wait for a free row. 1 serves one request at a time.
    #[arg(long, value_name = "ROWS", default_value_t = collabllm::llm::local::DEFAULT_MAX_BATCH,
          value_parser = clap::value_parser!(u64).range(1..=256).map(|v| v as usize))]
    max_batch: usize,

    /// Prompt positions a new request prefills per round while other requests decode: a long
    /// prompt then delays their next token by one chunk instead of its whole prefill. 0
    /// prefills each prompt whole on arrival. The tokens are the same either way.
    #[arg(long, value_name = "TOKENS", default_value_t = collabllm::llm::local::PREFILL_CHUNK,
          value_parser = clap::value_parser!(u64).range(0..=1_000_000).map(|v| v as usize))]
    prefill_chunk: usize,

    /// Memory (MiB) for the key/value caches of recent prompts: a request whose prompt
    /// starts like an earlier one (the same system prompt, a conversation one turn longer)
    /// prefills only the rest. Reuse changes no output token. 0 turns it off.
    #[arg(long, value_name = "MIB", default_value_t = 256,
          value_parser = clap::value_parser!(u64).range(0..=65536).map(|v| v as usize))]
    prefix_cache_mb: usize,

    /// Memory (MiB) the key/value caches of the requests in flight may take: a request
    /// reserves its prompt and n × max_tokens positions when admitted and waits while
    /// those running leave no room for it (one that cannot fit alone is refused, 400
    /// `context_length_exceeded`). Default: 16 rows at the model's full context, at most
    /// half the memory available once the model is loaded, within the process's cgroup
    /// limit (printed at start-up). The prompt cache (--prefix-cache-mb) comes on top.
    #[arg(long, value_name = "MIB",
          value_parser = clap::value_parser!(u64).range(1..=16_777_216).map(|v| v as usize))]
    kv_cache_mb: Option<usize>,

    /// A Jinja chat template (HF's format: `messages`, `add_generation_prompt`, `bos_token`,
    /// `eos_token`) to use instead of the model's own. A model whose files carry none (a base
    /// model) answers /v1/completions, and refuses chat completions (400) unless given one.
    /// At most 1 MiB; an empty (or all-whitespace) file is refused.
    #[arg(long, value_name = "FILE")]
    chat_template: Option<std::path::PathBuf>,
}

fn parse_name(s: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        return Err("a model name must not be empty".into());
    }
    Ok(s.to_string())
}

fn parse_local_spec(s: &str) -> Result<ModelSpec, String> {
    let spec: ModelSpec = s.parse().map_err(|e| format!("{e}"))?;
    if !spec.is_local() {
        return Err(format!(
            "`{spec}` is an OpenAI-compatible endpoint; `serve` serves local models only \
             (`default`, a .gguf file, an HF directory or an HF model id)"
        ));
    }
    Ok(spec)
}

/// Loads the local engine for `spec` and returns it with its model name.
async fn load_backend(args: &Args) -> anyhow::Result<(SharedBackend, String)> {
    let opts = LoadOptions {
        weights: args.weights,
        prefix_cache_mb: Some(args.prefix_cache_mb),
        ..LoadOptions::default()
    };
    let backend = match &args.chat_template {
        Some(file) => LocalBackend::load_with_chat_template(&args.model, &opts, file).await?,
        None => LocalBackend::load(&args.model, &opts).await?,
    };
    backend.set_max_batch(args.max_batch);
    backend.set_prefill_chunk(args.prefill_chunk);
    if let Some(mib) = args.kv_cache_mb {
        backend.set_kv_budget_bytes(mib << 20);
    }
    tracing::info!(
        max_batch = args.max_batch,
        kv_cache_mb = backend.kv_budget_bytes() >> 20,
        prefix_cache_mb = args.prefix_cache_mb,
        "batching"
    );
    let name = backend.model_name();
    Ok((backend, name))
}

/// The reported id, then every other name a client may use: the spec as given (and an HF id
/// without its `hf:` prefix), then the aliases.
fn model_names(args: &Args, loaded_name: String) -> ModelNames {
    let mut implied = vec![args.model.to_string()];
    if let ModelSpec::HfId { repo, .. } = &args.model {
        implied.push(repo.clone());
    }
    ModelNames::new(args.model_id.clone().unwrap_or(loaded_name))
        .with_aliases(implied)
        .with_aliases(args.aliases.iter().cloned())
}

async fn run(args: Args) -> anyhow::Result<()> {
    let key = args.api_key_env.as_deref().map(api_key).transpose()?;
    tracing::info!(model = %args.model, weights = %args.weights, "loading model");
    let (backend, name) = load_backend(&args)
        .await
        .with_context(|| format!("loading model {}", args.model))?;
    let names = model_names(&args, name);
    let model_id = names.id().to_string();
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("binding {}:{}", args.host, args.port))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    println!(
        "listening on http://{addr}/v1 (model {model_id}; also answers to: {})",
        names.all()[1..].join(", ")
    );
    let mut router = collabllm::serve::router(backend, names);
    if let Some(key) = key {
        router = collabllm::serve::require_api_key(router, key)?;
    }
    collabllm::serve::serve_router(listener, router)
        .await
        .context("serving HTTP")
}

/// The key in environment variable `var`; its value is never printed.
fn api_key(var: &str) -> anyhow::Result<String> {
    let key = match std::env::var(var) {
        Ok(k) if !k.trim().is_empty() => k.trim().to_string(),
        Err(std::env::VarError::NotUnicode(_)) => {
            anyhow::bail!("--api-key-env {var}: the environment variable is not valid UTF-8")
        }
        _ => anyhow::bail!("--api-key-env {var}: the environment variable is unset or empty"),
    };
    collabllm::serve::check_api_key(&key).with_context(|| format!("--api-key-env {var}"))?;
    Ok(key)
}

fn main() -> ExitCode {
    let args = Args::parse();
    collabllm::cli::init_logging();
    let threads = args.threads.map(|t| t as usize);
    // Before any other thread exists (the tokio runtime included) and before the model loads.
    collabllm::cli::set_compute_threads(threads);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return collabllm::cli::exit_on_error(Err(e.into())),
    };
    collabllm::cli::exit_on_error(runtime.block_on(run(args)))
}
