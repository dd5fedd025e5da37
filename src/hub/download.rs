//! Downloads of Hub datasets (`hf:<org>/<name>`): every parquet file of the dataset, into the
//! standard HF cache through hf-hub (its cache layout, shared with the Python tools); with
//! `HF_HUB_OFFLINE=1`, or when listing fails, the cached snapshot.

use std::path::{Path, PathBuf};

use futures::TryStreamExt as _;

use super::HubError;

/// Whether a tasks argument names a Hub dataset (`hf:<org>/<name>`).
pub fn is_hub_source(source: &str) -> bool {
    source.starts_with("hf:")
}

/// The parquet files of a source: a local file, or every parquet file of a Hub dataset
/// (downloaded into the standard HF cache; with `HF_HUB_OFFLINE=1` only the cache is used).
pub async fn fetch_source(source: &str, endpoint: Option<&str>) -> Result<Vec<PathBuf>, HubError> {
    match source.strip_prefix("hf:") {
        Some(repo) => fetch_hf_parquet(repo, endpoint).await,
        None => Ok(vec![PathBuf::from(source)]),
    }
}

fn hf_offline() -> bool {
    std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| !v.is_empty() && v != "0")
}

/// `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`.
fn hub_cache() -> PathBuf {
    if let Ok(p) = std::env::var("HF_HUB_CACHE") {
        return PathBuf::from(p);
    }
    super::token_path()
        .parent()
        .map(|p| p.join("hub"))
        .unwrap_or_else(|| PathBuf::from("hub"))
}

/// Parquet files of a cached snapshot of the dataset (newest snapshot first found).
fn cached_parquet(repo: &str) -> Vec<PathBuf> {
    let dir = hub_cache()
        .join(format!("datasets--{}", repo.replace('/', "--")))
        .join("snapshots");
    let Ok(snaps) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    for snap in snaps.flatten() {
        let mut files = Vec::new();
        walk_parquet(&snap.path(), &mut files);
        if !files.is_empty() {
            files.sort();
            return files;
        }
    }
    Vec::new()
}

fn walk_parquet(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            walk_parquet(&p, out);
        } else if p.extension().is_some_and(|x| x == "parquet") {
            out.push(p);
        }
    }
}

async fn fetch_hf_parquet(repo: &str, endpoint: Option<&str>) -> Result<Vec<PathBuf>, HubError> {
    let (owner, name) = super::split_repo(repo)?;
    let err = |message: String| HubError::Download {
        repo: repo.to_string(),
        message,
    };
    if hf_offline() {
        let files = cached_parquet(repo);
        if files.is_empty() {
            return Err(err(format!(
                "HF_HUB_OFFLINE is set and the dataset is not in the cache ({}); go online once \
                 or pass a downloaded parquet file",
                hub_cache().display()
            )));
        }
        return Ok(files);
    }
    let mut builder = hf_hub::HFClient::builder();
    if let Some(e) = endpoint {
        builder = builder.endpoint(e);
    }
    let client = builder.build().map_err(|e| err(e.to_string()))?;
    let handle = client.dataset(owner, name);
    let listed: Result<Vec<hf_hub::repository::RepoTreeEntry>, _> =
        match handle.list_tree().recursive(true).send() {
            Ok(stream) => stream.try_collect().await,
            Err(e) => Err(e),
        };
    let entries = match listed {
        Ok(e) => e,
        Err(e) => {
            // Offline without the variable: fall back to the cache, else say what failed.
            let files = cached_parquet(repo);
            if files.is_empty() {
                return Err(err(format!(
                    "cannot list the dataset's files ({e}); check the name and the network, or \
                     set HF_HUB_OFFLINE=1 to use the cache"
                )));
            }
            tracing::warn!(repo, error = %e, "listing failed; using the cached snapshot");
            return Ok(files);
        }
    };
    let mut paths: Vec<String> = entries
        .into_iter()
        .filter_map(|e| match e {
            hf_hub::repository::RepoTreeEntry::File { path, .. } if path.ends_with(".parquet") => {
                Some(path)
            }
            _ => None,
        })
        .collect();
    paths.sort();
    if paths.is_empty() {
        return Err(err("the dataset has no parquet files".into()));
    }
    let mut out = Vec::new();
    for p in paths {
        let file = handle
            .download_file()
            .filename(p.clone())
            .send()
            .await
            .map_err(|e| err(format!("{p}: {e}")))?;
        out.push(file);
    }
    Ok(out)
}
