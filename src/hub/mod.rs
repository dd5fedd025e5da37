//! The Hugging Face Hub client: publish a run's pairs or a checkpoint (`push_hf`,
//! `--push-to-hub`), with its dataset or model card, and download a Hub dataset's parquet
//! files ([`download`], for `--tasks hf:…` and `generate_conv --import`). What those files
//! mean is `task::source`'s business, not this module's.
//!
//! Why our own HTTP code: hf-hub 1.0 can create repos and commit, but it uploads large files
//! only through Xet; when a Hub answers the LFS batch call with the plain `basic` transfer it
//! falls back to inline (base64) upload. We need the basic LFS protocol (every Hub-compatible
//! server and our test server speak it), so [`client`] implements the few endpoints a push uses
//! with reqwest. Downloads for the importer still go through hf-hub (its cache layout).
//!
//! A push: hash every local file (SHA-256 for LFS, git blob SHA-1 for inline files) → create the
//! repo if missing → list the remote tree and drop files that are already identical (all
//! identical → no commit at all) → preupload check (LFS or inline) → LFS batch, upload only the
//! objects the server lacks, verify → one commit.
//!
//! The token is a [`Token`]: its `Debug` prints `***`, it is sent only to the endpoint's own
//! origin, and every error text is passed through a redaction of the token's value.

pub(crate) mod card;
pub(crate) mod client;
pub mod download;

use std::io::Read as _;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use serde::Serialize;
use sha1::Digest as _;

pub use client::{HubClient, RemoteFile, RetryPolicy};

/// The default Hub.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Errors of the Hub module; each names the repository, URL or file it concerns. No variant
/// ever contains the token (texts from servers are redacted).
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error(
        "no Hugging Face token: set HF_TOKEN or write the token to {} (`hf auth login` does)",
        path.display()
    )]
    NoToken { path: PathBuf },
    #[error(
        "invalid repository id `{repo}`: expected <org>/<name> with letters, digits, '-', '_', '.'"
    )]
    InvalidRepo { repo: String },
    #[error("hf:{repo}: {message}")]
    Download { repo: String, message: String },
    #[error("{url}: HTTP {status}: the token was rejected or lacks write access to this repository (check HF_TOKEN or the token file; no retry)")]
    Auth { url: String, status: u16 },
    #[error("{url}: HTTP {status}: {body}")]
    Status {
        url: String,
        status: u16,
        body: String,
    },
    #[error("{url}: gave up after {attempts} attempts: {last}")]
    GaveUp {
        url: String,
        attempts: u32,
        last: String,
    },
    #[error("{url}: unexpected answer: {message}")]
    Protocol { url: String, message: String },
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        /// The io (or parquet, JSON) error itself, kept as the cause.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("{}: {message}", path.display())]
    Layout { path: PathBuf, message: String },
    #[error(transparent)]
    Manifest(#[from] crate::run::ManifestError),
}

pub(crate) fn io_err(
    path: &Path,
    e: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> HubError {
    HubError::Io {
        path: path.to_path_buf(),
        source: e.into(),
    }
}

/// A Hub access token. Never printed: `Debug` shows `***`.
#[derive(Clone)]
pub struct Token(String);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(***)")
    }
}

impl Token {
    pub fn new(secret: impl Into<String>) -> Self {
        Token(secret.into().trim().to_string())
    }

    pub(crate) fn secret(&self) -> &str {
        &self.0
    }

    /// `HF_TOKEN`, else the token file ([`token_path`]); `None` when neither has one.
    pub fn from_env() -> Option<Token> {
        if let Ok(t) = std::env::var("HF_TOKEN") {
            if !t.trim().is_empty() {
                return Some(Token::new(t));
            }
        }
        let text = std::fs::read_to_string(token_path()).ok()?;
        (!text.trim().is_empty()).then(|| Token::new(text))
    }

    /// Replaces every occurrence of the token in `text` (servers may echo headers back).
    pub(crate) fn redact(&self, text: &str) -> String {
        if self.0.is_empty() {
            text.to_string()
        } else {
            text.replace(&self.0, "***")
        }
    }
}

/// The standard token file: `$HF_TOKEN_PATH`, else `$HF_HOME/token`, else
/// `~/.cache/huggingface/token`.
pub fn token_path() -> PathBuf {
    if let Ok(p) = std::env::var("HF_TOKEN_PATH") {
        return PathBuf::from(p);
    }
    let home = std::env::var("HF_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            let base = std::env::var("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|_| {
                    PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| ".".into()))
                        .join(".cache")
                });
            base.join("huggingface")
        });
    home.join("token")
}

/// `--endpoint`, else `HF_ENDPOINT`, else the public Hub; without a trailing slash.
pub fn resolve_endpoint(flag: Option<&str>) -> String {
    let e = flag
        .map(str::to_string)
        .or_else(|| std::env::var("HF_ENDPOINT").ok().filter(|s| !s.is_empty()))
        .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string());
    e.trim_end_matches('/').to_string()
}

/// Dataset or model repository.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RepoKind {
    Dataset,
    Model,
}

impl RepoKind {
    /// Path segment of the API (`/api/datasets/…`).
    pub fn plural(self) -> &'static str {
        match self {
            RepoKind::Dataset => "datasets",
            RepoKind::Model => "models",
        }
    }

    /// Prefix of the repository's web and git URLs (`/datasets/org/name`, `/org/name`).
    pub fn url_prefix(self) -> &'static str {
        match self {
            RepoKind::Dataset => "datasets/",
            RepoKind::Model => "",
        }
    }
}

/// Checks `org/name` (the Hub's allowed characters) and returns (org, name).
pub fn split_repo(repo: &str) -> Result<(&str, &str), HubError> {
    let bad = || HubError::InvalidRepo {
        repo: repo.to_string(),
    };
    let (org, name) = repo.split_once('/').ok_or_else(bad)?;
    let ok = |s: &str| {
        !s.is_empty()
            && !s.starts_with(['.', '-'])
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    if ok(org) && ok(name) {
        Ok((org, name))
    } else {
        Err(bad())
    }
}

/// Settings of one push.
#[derive(Clone, Debug)]
pub struct PushOptions {
    /// Hub base URL (see [`resolve_endpoint`]).
    pub endpoint: String,
    /// Needed unless `dry_run` is set.
    pub token: Option<Token>,
    /// Create the repository private (the default) or public. An existing repository keeps
    /// its visibility.
    pub private: bool,
    /// Commit message; `None` → a generated one.
    pub message: Option<String>,
    /// Write the repository layout into this folder instead of uploading.
    pub dry_run: Option<PathBuf>,
    pub retry: RetryPolicy,
}

impl PushOptions {
    /// Endpoint from `HF_ENDPOINT`, token from the environment, private, default retries.
    pub fn from_env() -> Self {
        Self {
            endpoint: resolve_endpoint(None),
            token: Token::from_env(),
            private: true,
            message: None,
            dry_run: None,
            retry: RetryPolicy::default(),
        }
    }
}

/// Where a file's bytes come from.
#[derive(Clone, Debug)]
pub enum Source {
    File(PathBuf),
    Bytes(Vec<u8>),
}

/// One file of the repository to push.
#[derive(Clone, Debug)]
pub struct RepoFile {
    pub path_in_repo: String,
    pub source: Source,
}

impl RepoFile {
    pub fn file(path_in_repo: impl Into<String>, path: impl Into<PathBuf>) -> Self {
        Self {
            path_in_repo: path_in_repo.into(),
            source: Source::File(path.into()),
        }
    }
    pub fn bytes(path_in_repo: impl Into<String>, bytes: Vec<u8>) -> Self {
        Self {
            path_in_repo: path_in_repo.into(),
            source: Source::Bytes(bytes),
        }
    }

    fn label(&self) -> PathBuf {
        match &self.source {
            Source::File(p) => p.clone(),
            Source::Bytes(_) => PathBuf::from(&self.path_in_repo),
        }
    }

    pub(crate) fn read_all(&self) -> Result<Vec<u8>, HubError> {
        match &self.source {
            Source::File(p) => std::fs::read(p).map_err(|e| io_err(p, e)),
            Source::Bytes(b) => Ok(b.clone()),
        }
    }
}

/// A local file with the identities the Hub reports for it.
#[derive(Clone, Debug)]
pub(crate) struct Hashed {
    pub file: RepoFile,
    pub size: u64,
    /// LFS object id.
    pub sha256: String,
    /// Git blob id (`sha1("blob <size>\0" + bytes)`), what the tree reports for inline files.
    pub git_sha1: String,
    /// First 512 bytes, for the preupload check.
    pub sample: Vec<u8>,
}

fn hash_file(file: RepoFile) -> Result<Hashed, HubError> {
    let label = file.label();
    let mut reader: Box<dyn std::io::Read> = match &file.source {
        Source::File(p) => Box::new(std::fs::File::open(p).map_err(|e| io_err(p, e))?),
        Source::Bytes(b) => Box::new(std::io::Cursor::new(b.clone())),
    };
    let size = match &file.source {
        Source::File(p) => std::fs::metadata(p).map_err(|e| io_err(p, e))?.len(),
        Source::Bytes(b) => b.len() as u64,
    };
    let mut s256 = sha2::Sha256::new();
    let mut s1 = sha1::Sha1::new();
    s1.update(format!("blob {size}\0").as_bytes());
    let mut sample = Vec::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = reader.read(&mut buf).map_err(|e| io_err(&label, e))?;
        if n == 0 {
            break;
        }
        if sample.len() < 512 {
            let take = (512 - sample.len()).min(n);
            sample.extend_from_slice(&buf[..take]);
        }
        s256.update(&buf[..n]);
        s1.update(&buf[..n]);
        total += n as u64;
    }
    if total != size {
        return Err(io_err(&label, "file changed while it was being read"));
    }
    Ok(Hashed {
        file,
        size,
        sha256: hex::encode(s256.finalize()),
        git_sha1: hex::encode(s1.finalize()),
        sample,
    })
}

/// Whether the remote file is byte-identical to the local one.
fn same_as_remote(local: &Hashed, remote: Option<&RemoteFile>) -> bool {
    match remote {
        None => false,
        Some(r) => match &r.lfs {
            Some(lfs) => lfs.oid == local.sha256 && lfs.size == local.size,
            None => r.oid == local.git_sha1,
        },
    }
}

/// One file of a push and what happened to it.
#[derive(Clone, Debug, Serialize)]
pub struct PushedFile {
    pub path: String,
    pub size: u64,
    pub sha256: String,
    /// `unchanged`, `inline`, `lfs` (uploaded), `lfs_present` (the server had the object), or
    /// `written` (dry run).
    pub action: String,
}

/// What a push did.
#[derive(Clone, Debug, Serialize)]
pub struct PushReport {
    pub repo: String,
    pub kind: RepoKind,
    /// Repository web URL, or the dry-run folder.
    pub url: String,
    pub created: bool,
    /// The new commit's id; `None` when nothing changed (or dry run).
    pub commit: Option<String>,
    pub files: Vec<PushedFile>,
    pub dry_run: bool,
}

impl std::fmt::Display for PushReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = if self.dry_run {
            "dry run: wrote"
        } else {
            "pushed"
        };
        writeln!(f, "{what} {:?} {} → {}", self.kind, self.repo, self.url)?;
        for file in &self.files {
            writeln!(
                f,
                "  {:<12} {:>12} B  {}",
                file.action, file.size, file.path
            )?;
        }
        match (&self.commit, self.dry_run) {
            (_, true) => write!(f, "nothing uploaded"),
            (Some(c), _) => write!(f, "commit {c}"),
            (None, _) => write!(f, "no change: every file is already on the Hub (no commit)"),
        }
    }
}

/// Pushes `files` to `repo` as one commit (or writes them under `opts.dry_run`).
pub async fn push_files(
    kind: RepoKind,
    repo: &str,
    files: Vec<RepoFile>,
    opts: &PushOptions,
) -> Result<PushReport, HubError> {
    split_repo(repo)?;
    let mut seen = std::collections::HashSet::new();
    for f in &files {
        if !seen.insert(f.path_in_repo.clone()) {
            return Err(HubError::Layout {
                path: f.label(),
                message: format!("two files map to `{}`", f.path_in_repo),
            });
        }
    }
    let hashed = tokio::task::spawn_blocking(move || {
        files
            .into_iter()
            .map(hash_file)
            .collect::<Result<Vec<_>, _>>()
    })
    .await
    .map_err(|e| io_err(Path::new(repo), e))??;
    if let Some(dir) = &opts.dry_run {
        return write_dry_run(kind, repo, dir, &hashed);
    }
    let token = opts
        .token
        .clone()
        .ok_or_else(|| HubError::NoToken { path: token_path() })?;
    let client = HubClient::new(&opts.endpoint, Some(token), opts.retry.clone())?;
    let created = client.create_repo(kind, repo, opts.private).await?;
    let remote = client.tree(kind, repo).await?;
    let url = format!("{}/{}{}", opts.endpoint, kind.url_prefix(), repo);
    let mut report = PushReport {
        repo: repo.to_string(),
        kind,
        url,
        created,
        commit: None,
        files: Vec::new(),
        dry_run: false,
    };
    let (same, changed): (Vec<&Hashed>, Vec<&Hashed>) = hashed
        .iter()
        .partition(|h| same_as_remote(h, remote.get(&h.file.path_in_repo)));
    for h in &same {
        report.files.push(pushed(h, "unchanged"));
    }
    if changed.is_empty() {
        tracing::info!(repo, "every file already on the Hub; no commit");
        return Ok(report);
    }
    let modes = client.preupload(kind, repo, &changed).await?;
    let lfs: Vec<&Hashed> = changed
        .iter()
        .copied()
        .filter(|h| modes.get(&h.file.path_in_repo).copied().unwrap_or(false))
        .collect();
    let uploaded = client.upload_lfs(kind, repo, &lfs).await?;
    let mut lines = vec![serde_json::json!({"key": "header", "value": {
        "summary": opts.message.clone().unwrap_or_else(|| default_message(kind)),
        "description": "",
    }})];
    for h in &changed {
        let path = &h.file.path_in_repo;
        if modes.get(path).copied().unwrap_or(false) {
            lines.push(serde_json::json!({"key": "lfsFile", "value": {
                "path": path, "algo": "sha256", "oid": h.sha256, "size": h.size,
            }}));
            let action = if uploaded.contains(&h.sha256) {
                "lfs"
            } else {
                "lfs_present"
            };
            report.files.push(pushed(h, action));
        } else {
            let content = base64::engine::general_purpose::STANDARD.encode(h.file.read_all()?);
            lines.push(serde_json::json!({"key": "file", "value": {
                "path": path, "content": content, "encoding": "base64",
            }}));
            report.files.push(pushed(h, "inline"));
        }
    }
    report.commit = Some(client.commit(kind, repo, &lines).await?);
    report.files.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(report)
}

fn pushed(h: &Hashed, action: &str) -> PushedFile {
    PushedFile {
        path: h.file.path_in_repo.clone(),
        size: h.size,
        sha256: h.sha256.clone(),
        action: action.to_string(),
    }
}

fn default_message(kind: RepoKind) -> String {
    let what = match kind {
        RepoKind::Dataset => "dataset",
        RepoKind::Model => "model",
    };
    format!(
        "Upload {what} with collabllm-rs {}",
        env!("CARGO_PKG_VERSION")
    )
}

/// Marks a directory as `--dry-run` output, which a later dry run may replace.
pub const DRY_RUN_MARKER: &str = ".collabllm-dry-run";

/// Writes the exact repository layout into a fresh directory beside `dir`, then puts it in
/// place of `dir`: no file of an earlier layout survives. A `dir` that holds anything but a
/// previous dry run is refused, never overwritten.
fn write_dry_run(
    kind: RepoKind,
    repo: &str,
    dir: &Path,
    hashed: &[Hashed],
) -> Result<PushReport, HubError> {
    let replaces = dry_run_target(dir)?;
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(|e| io_err(&parent, e))?;
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "dry-run".into());
    let fresh = parent.join(format!(".{name}.new-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&fresh);
    let written = write_layout(&fresh, hashed);
    let placed = written.and_then(|files| {
        if replaces {
            let old = parent.join(format!(".{name}.old-{}", std::process::id()));
            std::fs::rename(dir, &old).map_err(|e| io_err(dir, e))?;
            std::fs::rename(&fresh, dir).map_err(|e| io_err(dir, e))?;
            let _ = std::fs::remove_dir_all(&old);
        } else {
            std::fs::rename(&fresh, dir).map_err(|e| io_err(dir, e))?;
        }
        Ok(files)
    });
    if placed.is_err() {
        let _ = std::fs::remove_dir_all(&fresh);
    }
    let files = placed?;
    Ok(PushReport {
        repo: repo.to_string(),
        kind,
        url: dir.display().to_string(),
        created: false,
        commit: None,
        files,
        dry_run: true,
    })
}

/// Whether `dir` is an earlier dry run to replace (`true`), or absent or empty (`false`); any
/// other existing path is refused.
fn dry_run_target(dir: &Path) -> Result<bool, HubError> {
    let mut entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(io_err(dir, e)),
    };
    if dir.join(DRY_RUN_MARKER).is_file() {
        return Ok(true);
    }
    if entries.next().is_none() {
        return Ok(false);
    }
    Err(HubError::Layout {
        path: dir.to_path_buf(),
        message: "--dry-run needs a new or empty directory, or an earlier --dry-run output \
                  (this one holds other files)"
            .into(),
    })
}

/// Every file of the layout under `dir`, and the dry-run marker.
fn write_layout(dir: &Path, hashed: &[Hashed]) -> Result<Vec<PushedFile>, HubError> {
    let mut files = Vec::new();
    for h in hashed {
        let dest = dir.join(&h.file.path_in_repo);
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent).map_err(|e| io_err(parent, e))?;
        }
        match &h.file.source {
            Source::File(p) => std::fs::copy(p, &dest).map(|_| ()),
            Source::Bytes(b) => std::fs::write(&dest, b),
        }
        .map_err(|e| io_err(&dest, e))?;
        files.push(pushed(h, "written"));
    }
    let marker = dir.join(DRY_RUN_MARKER);
    std::fs::write(
        &marker,
        "written by push_hf --dry-run; a later dry run may replace it\n",
    )
    .map_err(|e| io_err(&marker, e))?;
    Ok(files)
}

/// Pushes a `generate_conv` run directory as a dataset: `data/{train,test}-00000-of-00001.parquet`
/// from `pairs/`, with `flat` also `flat/train-00000-of-00001.parquet` (config `flat`), and the
/// generated `README.md` dataset card.
pub async fn push_dataset_dir(
    run_dir: &Path,
    repo: &str,
    flat: bool,
    opts: &PushOptions,
) -> Result<PushReport, HubError> {
    split_repo(repo)?;
    let files = card::dataset_files(run_dir, repo, flat)?;
    push_files(RepoKind::Dataset, repo, files, opts).await
}

/// Pushes a `dpo_train` checkpoint directory (HF layout or PEFT adapter) with a generated
/// model card `README.md`. Every other file of the directory is uploaded as is (hidden files
/// and an existing README.md excepted).
pub async fn push_model_dir(
    checkpoint_dir: &Path,
    repo: &str,
    opts: &PushOptions,
) -> Result<PushReport, HubError> {
    split_repo(repo)?;
    let files = card::model_files(checkpoint_dir, repo)?;
    push_files(RepoKind::Model, repo, files, opts).await
}
