//! `serve`: an OpenAI-compatible HTTP server over a local model.

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use collabllm::llm::local::{LoadOptions, LocalBackend};
use collabllm::llm::{ModelSpec, SharedBackend};

/// Serve a local model over an OpenAI-compatible HTTP API.
///
/// Endpoints: POST /v1/chat/completions (with `stream: true` for SSE), GET /v1/models,
/// GET /health. Any OpenAI client works with base URL http://HOST:PORT/v1 and any API key;
/// the request's `model` field is ignored (one model per server). Stop with ctrl-c: requests
/// in flight are finished first.
#[derive(Parser, Debug)]
#[command(name = "serve", version, about, long_about)]
struct Args {
    /// Model to serve: `default` (the embedded SmolLM2-135M-Instruct GGUF), a path to a
    /// `.gguf` file, a Hugging Face model directory (config.json, tokenizer.json,
    /// *.safetensors), or an HF model id (`org/name` or `hf:org/name[@revision]`, fetched into
    /// the HF cache). `openai:` endpoints cannot be served: point clients at them directly.
    #[arg(long, value_name = "SPEC", value_parser = parse_local_spec)]
    model: ModelSpec,

    /// Address to bind. The default accepts local connections only; the server has no
    /// authentication, so think twice before binding 0.0.0.0.
    #[arg(long, value_name = "HOST", default_value = "127.0.0.1")]
    host: String,

    /// Port to listen on (0 picks a free one; the address is printed at start-up).
    #[arg(long, value_name = "PORT", default_value_t = 8000)]
    port: u16,

    /// Threads for the model's compute kernels [default: CANDLE_NUM_THREADS, else all cores].
    /// More threads than free cores slows generation down sharply.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1024))]
    threads: Option<u64>,

    /// Model name reported in responses and by GET /v1/models [default: the loaded model's
    /// name].
    #[arg(long, value_name = "NAME")]
    model_id: Option<String>,
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
async fn load_backend(spec: &ModelSpec) -> anyhow::Result<(SharedBackend, String)> {
    let backend = LocalBackend::load(spec, &LoadOptions::default()).await?;
    let name = backend.model_name();
    Ok((backend, name))
}

async fn run(args: Args) -> anyhow::Result<()> {
    tracing::info!(model = %args.model, "loading model");
    let (backend, name) = load_backend(&args.model)
        .await
        .with_context(|| format!("loading model {}", args.model))?;
    let model_id = args.model_id.unwrap_or(name);
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("binding {}:{}", args.host, args.port))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    println!("listening on http://{addr}/v1 (model {model_id})");
    collabllm::serve::serve(listener, backend, model_id)
        .await
        .context("serving HTTP")
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
