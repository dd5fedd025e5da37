//! `push_hf`: publish a `generate_conv` run as a Hub dataset, or a `dpo_train` checkpoint as a
//! Hub model, in one idempotent commit.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args as ClapArgs, Parser, Subcommand};
use collabllm::hub::{self, PushOptions, Token};

/// Publish to the Hugging Face Hub.
///
/// The repository is created if missing (private unless --public). Small files are committed
/// inline, large ones (parquet, safetensors) go through the LFS protocol; everything lands in one
/// commit. A second push of the same content makes no commit and uploads nothing. The token comes
/// from HF_TOKEN or the HF token file ($HF_HOME/token, default ~/.cache/huggingface/token) and is
/// never printed.
#[derive(Parser, Debug)]
#[command(name = "push_hf", version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    what: What,
}

#[derive(Subcommand, Debug)]
enum What {
    /// A generate_conv run directory (or a `generate_conv --import` output) as a dataset:
    /// data/{train,test}-00000-of-00001.parquet from pairs/, and a README.md dataset card made
    /// from manifest.json.
    Dataset {
        /// The run directory (holds manifest.json and pairs/).
        #[arg(value_name = "RUN_DIR")]
        dir: PathBuf,
        /// Also publish flat.parquet (every scored candidate, upstream schema) as config `flat`.
        #[arg(long)]
        flat: bool,
        #[command(flatten)]
        common: Common,
    },
    /// A dpo_train checkpoint directory (model.safetensors + config.json + tokenizer files, or a
    /// PEFT adapter: adapter_model.safetensors + adapter_config.json) with a README.md model card
    /// made from training_args.json / train_summary.json when present.
    Model {
        /// The checkpoint directory.
        #[arg(value_name = "CHECKPOINT_DIR")]
        dir: PathBuf,
        #[command(flatten)]
        common: Common,
    },
}

#[derive(ClapArgs, Debug)]
struct Common {
    /// Target repository, <org>/<name>.
    #[arg(long, value_name = "ORG/NAME")]
    repo: String,
    /// Create the repository public (default: private). An existing repository keeps its
    /// visibility.
    #[arg(long)]
    public: bool,
    /// Write the exact repository layout into DIR instead of uploading (no token needed). DIR
    /// is created, with any missing parent folders; an existing DIR must be an empty folder
    /// or an earlier dry run.
    #[arg(long, value_name = "DIR")]
    dry_run: Option<PathBuf>,
    /// Hub URL [default: HF_ENDPOINT, else https://huggingface.co].
    #[arg(long, value_name = "URL")]
    endpoint: Option<String>,
    /// Commit message [default: "Upload dataset|model with collabllm-rs <version>"].
    #[arg(long, value_name = "TEXT")]
    message: Option<String>,
    /// Retries of a request that failed with a network error, 429 or 5xx.
    #[arg(long, value_name = "N", default_value_t = 5)]
    max_retries: u32,
}

impl Common {
    fn options(&self) -> PushOptions {
        PushOptions {
            endpoint: hub::resolve_endpoint(self.endpoint.as_deref()),
            token: Token::from_env(),
            private: !self.public,
            message: self.message.clone(),
            dry_run: self.dry_run.clone(),
            retry: hub::RetryPolicy {
                max_retries: self.max_retries,
                ..hub::RetryPolicy::default()
            },
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let (What::Dataset { common, .. } | What::Model { common, .. }) = &cli.what;
    if let Some(dir) = &common.dry_run {
        collabllm::run::check_output_dir("--dry-run", dir, collabllm::run::Parents::Create)?;
    }
    let report = match &cli.what {
        What::Dataset { dir, flat, common } => {
            hub::push_dataset_dir(dir, &common.repo, *flat, &common.options())
                .await
                .with_context(|| format!("pushing dataset {}", common.repo))?
        }
        What::Model { dir, common } => hub::push_model_dir(dir, &common.repo, &common.options())
            .await
            .with_context(|| format!("pushing model {}", common.repo))?,
    };
    println!("{report}");
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    collabllm::cli::init_logging();
    let result = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
        .and_then(|rt| rt.block_on(run(cli)));
    collabllm::cli::exit_on_error(result)
}
