//! What training can fail on, each error naming its input: the flag, the file, the step.

use std::path::{Path, PathBuf};

/// An error of `dpo_train`, `rl_train`'s update half, or the trainable model's files.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A flag or config value out of range, or settings that do not go together (the
    /// message names the flag and the value).
    #[error("{0}")]
    Setting(String),
    /// The output directory cannot take this command (a finished run, another run's
    /// settings, no checkpoint to resume).
    #[error("{}: {message}", path.display())]
    Run { path: PathBuf, message: String },
    /// A file that exists but is not what it should be (data, model, checkpoint).
    #[error("{}: {message}", path.display())]
    Input { path: PathBuf, message: String },
    #[error("{action} {}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: not valid JSON", path.display())]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// The `--model` spec does not name weights training can use.
    #[error("--model `{spec}`: {message}")]
    Model { spec: String, message: String },
    #[error("device `{device}` (is this build compiled with `--features cuda`?)")]
    Device {
        device: String,
        #[source]
        source: candle_core::Error,
    },
    /// A non-finite loss, gradient or weight; nothing was saved from the step.
    #[error("{0}")]
    Diverged(String),
    /// SIGINT or SIGTERM: the finished steps are saved as a checkpoint.
    #[error("{0}")]
    Interrupted(#[source] crate::run::Interrupted),
    /// `stop_after` (tests of resume) ended the run on purpose.
    #[error("stopped after step {0} (stop_after)")]
    Stopped(usize),
    /// Encoding our own records (logs, states) as JSON.
    #[error("encoding JSON")]
    Encode(#[from] serde_json::Error),
    #[error(transparent)]
    Tensor(#[from] candle_core::Error),
    #[error(transparent)]
    Data(#[from] super::data::DataError),
    #[error(transparent)]
    Dataset(#[from] crate::dataset::DatasetError),
    #[error(transparent)]
    Write(#[from] crate::run::WriteError),
    #[error(transparent)]
    Lock(#[from] crate::run::LockError),
    #[error(transparent)]
    Spec(#[from] crate::llm::spec::SpecError),
    #[error(transparent)]
    Engine(#[from] crate::engine::EngineError),
    #[error(transparent)]
    Config(#[from] crate::engine::config::ModelConfigError),
    #[error(transparent)]
    Peft(#[from] crate::engine::peft::PeftError),
}

pub type Result<T, E = TrainError> = std::result::Result<T, E>;

impl TrainError {
    pub(crate) fn io(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.to_path_buf();
        move |source| TrainError::Io {
            action,
            path,
            source,
        }
    }

    pub(crate) fn json(path: &Path) -> impl FnOnce(serde_json::Error) -> Self {
        let path = path.to_path_buf();
        move |source| TrainError::Json { path, source }
    }

    pub(crate) fn input(path: &Path, message: impl Into<String>) -> Self {
        TrainError::Input {
            path: path.to_path_buf(),
            message: message.into(),
        }
    }

    pub(crate) fn run(path: &Path, message: impl Into<String>) -> Self {
        TrainError::Run {
            path: path.to_path_buf(),
            message: message.into(),
        }
    }
}

/// Reads a JSON file, naming it in either failure.
pub(crate) fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(TrainError::io("reading", path))?;
    serde_json::from_str(&text).map_err(TrainError::json(path))
}
