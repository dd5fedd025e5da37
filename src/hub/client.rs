//! The Hub HTTP endpoints a push uses, with one bounded retry loop: connection errors, 429 and
//! 5xx are retried with capped exponential backoff (honouring `Retry-After` up to the cap);
//! 401/403 fail at once with a clear message; other statuses fail with the server's text.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use base64::Engine as _;
use reqwest::{Method, RequestBuilder, StatusCode};
use serde::Deserialize;
use serde_json::{json, Value};

use super::{HubError, RepoKind, Token};
use crate::hub::Hashed;

/// How often and how long to retry a transient failure.
#[derive(Clone, Debug)]
pub struct RetryPolicy {
    /// Retries after the first attempt.
    pub max_retries: u32,
    /// First backoff; doubles per retry.
    pub base: Duration,
    /// Longest single wait.
    pub cap: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_retries: 5,
            base: Duration::from_millis(500),
            cap: Duration::from_secs(8),
        }
    }
}

impl RetryPolicy {
    fn delay(&self, attempt: u32, retry_after: Option<Duration>) -> Duration {
        let exp = self.base.saturating_mul(1u32 << attempt.min(16));
        retry_after.unwrap_or(exp).min(self.cap)
    }
}

/// LFS pointer info of a remote file.
#[derive(Clone, Debug, Deserialize)]
pub struct RemoteLfs {
    pub oid: String,
    pub size: u64,
}

/// A file of the remote tree: git blob id, and the LFS object when the file is LFS-stored.
#[derive(Clone, Debug, Deserialize)]
pub struct RemoteFile {
    #[serde(rename = "type")]
    pub kind: String,
    pub path: String,
    #[serde(default)]
    pub oid: String,
    #[serde(default)]
    pub size: u64,
    #[serde(default)]
    pub lfs: Option<RemoteLfs>,
}

/// A client bound to one Hub endpoint and token.
pub struct HubClient {
    http: reqwest::Client,
    endpoint: String,
    token: Option<Token>,
    retry: RetryPolicy,
}

impl HubClient {
    pub fn new(endpoint: &str, token: Option<Token>, retry: RetryPolicy) -> Result<Self, HubError> {
        let http = reqwest::Client::builder()
            .user_agent(concat!("collabllm-rs/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(Duration::from_secs(30))
            .build()
            .map_err(|e| HubError::Protocol {
                url: endpoint.to_string(),
                message: e.to_string(),
            })?;
        Ok(Self {
            http,
            endpoint: endpoint.trim_end_matches('/').to_string(),
            token,
            retry,
        })
    }

    fn redact(&self, text: &str) -> String {
        match &self.token {
            Some(t) => t.redact(text),
            None => text.to_string(),
        }
    }

    /// Whether `url` is on the endpoint's own origin (only there is the token sent: LFS
    /// upload URLs usually point at object storage).
    fn same_origin(&self, url: &str) -> bool {
        let origin = |u: &str| -> Option<String> {
            let p = reqwest::Url::parse(u).ok()?;
            Some(format!(
                "{}://{}:{}",
                p.scheme(),
                p.host_str()?,
                p.port_or_known_default()?
            ))
        };
        origin(url).is_some() && origin(url) == origin(&self.endpoint)
    }

    fn request(&self, method: Method, url: &str) -> RequestBuilder {
        let rb = self.http.request(method, url);
        match &self.token {
            Some(t) if self.same_origin(url) => rb.bearer_auth(t.secret()),
            _ => rb,
        }
    }

    /// Sends with retries. Statuses in `accept` are returned to the caller like successes.
    async fn send(
        &self,
        url: &str,
        accept: &[u16],
        build: impl Fn() -> RequestBuilder,
    ) -> Result<reqwest::Response, HubError> {
        let url_r = self.redact(url);
        let mut attempt = 0u32;
        loop {
            let (last, retry_after) = match build().send().await {
                Ok(resp) => {
                    let status = resp.status();
                    if status.is_success() || accept.contains(&status.as_u16()) {
                        return Ok(resp);
                    }
                    if matches!(status, StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN) {
                        return Err(HubError::Auth {
                            url: url_r,
                            status: status.as_u16(),
                        });
                    }
                    let retry_after = resp
                        .headers()
                        .get(reqwest::header::RETRY_AFTER)
                        .and_then(|v| v.to_str().ok())
                        .and_then(|s| s.trim().parse::<f64>().ok())
                        .filter(|s| s.is_finite() && *s >= 0.0)
                        .map(Duration::from_secs_f64);
                    let body = resp.text().await.unwrap_or_default();
                    let body = self.redact(&excerpt(&body));
                    if !(status == StatusCode::TOO_MANY_REQUESTS || status.is_server_error()) {
                        return Err(HubError::Status {
                            url: url_r,
                            status: status.as_u16(),
                            body,
                        });
                    }
                    (format!("HTTP {}: {body}", status.as_u16()), retry_after)
                }
                Err(e) => (self.redact(&e.to_string()), None),
            };
            if attempt >= self.retry.max_retries {
                return Err(HubError::GaveUp {
                    url: url_r,
                    attempts: attempt + 1,
                    last,
                });
            }
            let wait = self.retry.delay(attempt, retry_after);
            tracing::warn!(url = %url_r, error = %last, wait_s = wait.as_secs_f64(), "Hub request failed; retrying");
            tokio::time::sleep(wait).await;
            attempt += 1;
        }
    }

    async fn json(&self, url: &str, resp: reqwest::Response) -> Result<Value, HubError> {
        let text = resp.text().await.map_err(|e| self.protocol(url, e))?;
        serde_json::from_str(&text).map_err(|e| self.protocol(url, e))
    }

    fn protocol(&self, url: &str, e: impl std::fmt::Display) -> HubError {
        HubError::Protocol {
            url: self.redact(url),
            message: self.redact(&e.to_string()),
        }
    }

    /// Creates the repository; `Ok(false)` when it already exists (HTTP 409).
    pub async fn create_repo(
        &self,
        kind: RepoKind,
        repo: &str,
        private: bool,
    ) -> Result<bool, HubError> {
        let (org, name) = super::split_repo(repo)?;
        let url = format!("{}/api/repos/create", self.endpoint);
        let mut body = json!({"name": name, "organization": org, "private": private});
        if kind == RepoKind::Dataset {
            body["type"] = json!("dataset");
        }
        let resp = self
            .send(&url, &[409], || {
                self.request(Method::POST, &url).json(&body)
            })
            .await?;
        let created = resp.status() != StatusCode::CONFLICT;
        if created {
            tracing::info!(repo, private, "created repository");
        }
        Ok(created)
    }

    /// Every file of the `main` branch, by path (empty when the branch does not exist yet).
    pub async fn tree(
        &self,
        kind: RepoKind,
        repo: &str,
    ) -> Result<HashMap<String, RemoteFile>, HubError> {
        let mut out = HashMap::new();
        let mut next = Some(format!(
            "{}/api/{}/{repo}/tree/main?recursive=true",
            self.endpoint,
            kind.plural()
        ));
        // The Hub pages long listings with a `Link: <…>; rel="next"` header.
        while let Some(url) = next.take() {
            let resp = self
                .send(&url, &[404], || self.request(Method::GET, &url))
                .await?;
            if resp.status() == StatusCode::NOT_FOUND {
                return Ok(out);
            }
            next = next_link(resp.headers());
            let entries: Vec<RemoteFile> = serde_json::from_value(self.json(&url, resp).await?)
                .map_err(|e| self.protocol(&url, e))?;
            for e in entries.into_iter().filter(|e| e.kind == "file") {
                out.insert(e.path.clone(), e);
            }
        }
        Ok(out)
    }

    /// Asks the Hub which files go through LFS: path → `true` for LFS.
    pub(crate) async fn preupload(
        &self,
        kind: RepoKind,
        repo: &str,
        files: &[&Hashed],
    ) -> Result<HashMap<String, bool>, HubError> {
        let url = format!(
            "{}/api/{}/{repo}/preupload/main",
            self.endpoint,
            kind.plural()
        );
        let b64 = base64::engine::general_purpose::STANDARD;
        let body = json!({"files": files.iter().map(|h| json!({
            "path": h.file.path_in_repo, "size": h.size, "sample": b64.encode(&h.sample),
        })).collect::<Vec<_>>()});
        let resp = self
            .send(&url, &[], || self.request(Method::POST, &url).json(&body))
            .await?;
        let v = self.json(&url, resp).await?;
        let list = v["files"]
            .as_array()
            .ok_or_else(|| self.protocol(&url, "no `files` list"))?;
        let mut out = HashMap::new();
        for f in list {
            let (Some(path), Some(mode)) = (f["path"].as_str(), f["uploadMode"].as_str()) else {
                return Err(self.protocol(&url, "file entry without path/uploadMode"));
            };
            out.insert(path.to_string(), mode == "lfs");
        }
        // Empty files are always stored inline.
        for h in files {
            if h.size == 0 {
                out.insert(h.file.path_in_repo.clone(), false);
            }
        }
        Ok(out)
    }

    /// LFS batch negotiation and basic-transfer uploads; returns the OIDs actually uploaded
    /// (objects the server already has get no `upload` action and are skipped).
    pub(crate) async fn upload_lfs(
        &self,
        kind: RepoKind,
        repo: &str,
        files: &[&Hashed],
    ) -> Result<HashSet<String>, HubError> {
        let mut uploaded = HashSet::new();
        if files.is_empty() {
            return Ok(uploaded);
        }
        let url = format!(
            "{}/{}{repo}.git/info/lfs/objects/batch",
            self.endpoint,
            kind.url_prefix()
        );
        let body = json!({
            "operation": "upload",
            "transfers": ["basic"],
            "hash_algo": "sha256",
            "ref": {"name": "main"},
            "objects": files.iter().map(|h| json!({"oid": h.sha256, "size": h.size})).collect::<Vec<_>>(),
        });
        let lfs_json = "application/vnd.git-lfs+json";
        let resp = self
            .send(&url, &[], || {
                self.request(Method::POST, &url)
                    .header(reqwest::header::ACCEPT, lfs_json)
                    .header(reqwest::header::CONTENT_TYPE, lfs_json)
                    .body(body.to_string())
            })
            .await?;
        let v = self.json(&url, resp).await?;
        let objects = v["objects"]
            .as_array()
            .ok_or_else(|| self.protocol(&url, "no `objects` list"))?;
        let total: u64 = files.iter().map(|h| h.size).sum();
        let bar = indicatif::ProgressBar::new(total);
        bar.set_style(
            indicatif::ProgressStyle::with_template("LFS {bar:30} {bytes}/{total_bytes} {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        for obj in objects {
            let oid = obj["oid"].as_str().unwrap_or_default();
            let Some(h) = files.iter().find(|h| h.sha256 == oid) else {
                return Err(self.protocol(&url, format!("object {oid} was not requested")));
            };
            if let Some(err) = obj.get("error") {
                return Err(self.protocol(&url, format!("object {oid}: {err}")));
            }
            let Some(upload) = obj["actions"].get("upload") else {
                bar.inc(h.size);
                continue; // The server has it already.
            };
            if upload["header"].get("chunk_size").is_some() {
                return Err(self.protocol(
                    &url,
                    "the server asked for a multipart upload, which is not supported",
                ));
            }
            bar.set_message(h.file.path_in_repo.clone());
            self.put_object(upload, h).await?;
            if let Some(verify) = obj["actions"].get("verify") {
                let href = action_href(verify)
                    .ok_or_else(|| self.protocol(&url, "verify without href"))?;
                let payload = json!({"oid": h.sha256, "size": h.size});
                self.send(&href, &[], || {
                    with_headers(self.request(Method::POST, &href), verify).json(&payload)
                })
                .await?;
            }
            bar.inc(h.size);
            uploaded.insert(h.sha256.clone());
        }
        bar.finish_and_clear();
        Ok(uploaded)
    }

    async fn put_object(&self, upload: &Value, h: &Hashed) -> Result<(), HubError> {
        let href = action_href(upload)
            .ok_or_else(|| self.protocol(&h.file.path_in_repo, "upload action without href"))?;
        // Read once; the retry loop clones the bytes (cheap next to the network).
        let bytes = h.file.read_all()?;
        self.send(&href, &[], || {
            with_headers(self.request(Method::PUT, &href), upload).body(bytes.clone())
        })
        .await?;
        Ok(())
    }

    /// One commit on `main`; returns its id.
    pub async fn commit(
        &self,
        kind: RepoKind,
        repo: &str,
        lines: &[Value],
    ) -> Result<String, HubError> {
        let url = format!("{}/api/{}/{repo}/commit/main", self.endpoint, kind.plural());
        let mut body = String::new();
        for l in lines {
            body.push_str(&l.to_string());
            body.push('\n');
        }
        let resp = self
            .send(&url, &[], || {
                self.request(Method::POST, &url)
                    .header(reqwest::header::CONTENT_TYPE, "application/x-ndjson")
                    .body(body.clone())
            })
            .await?;
        let v = self.json(&url, resp).await?;
        let oid = v["commitOid"].as_str().unwrap_or_default().to_string();
        tracing::info!(repo, commit = %oid, "committed");
        Ok(oid)
    }
}

fn action_href(action: &Value) -> Option<String> {
    action["href"].as_str().map(str::to_string)
}

fn with_headers(mut rb: RequestBuilder, action: &Value) -> RequestBuilder {
    if let Some(h) = action["header"].as_object() {
        for (k, v) in h {
            if let Some(v) = v.as_str() {
                rb = rb.header(k.as_str(), v);
            }
        }
    }
    rb
}

fn next_link(headers: &reqwest::header::HeaderMap) -> Option<String> {
    let link = headers.get(reqwest::header::LINK)?.to_str().ok()?;
    link.split(',').find_map(|part| {
        let (url, rel) = part.split_once(';')?;
        rel.contains("rel=\"next\"").then(|| {
            url.trim()
                .trim_start_matches('<')
                .trim_end_matches('>')
                .to_string()
        })
    })
}

fn excerpt(body: &str) -> String {
    let t = body.trim();
    if t.chars().count() > 300 {
        format!("{}…", t.chars().take(300).collect::<String>())
    } else {
        t.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_is_capped_and_honours_retry_after() {
        let p = RetryPolicy {
            max_retries: 5,
            base: Duration::from_millis(100),
            cap: Duration::from_secs(1),
        };
        assert_eq!(p.delay(0, None), Duration::from_millis(100));
        assert_eq!(p.delay(2, None), Duration::from_millis(400));
        assert_eq!(p.delay(10, None), Duration::from_secs(1));
        assert_eq!(
            p.delay(0, Some(Duration::from_secs(60))),
            Duration::from_secs(1)
        );
    }

    #[test]
    fn link_header_next() {
        let mut h = reqwest::header::HeaderMap::new();
        h.insert(
            reqwest::header::LINK,
            "<https://hub/api/x?cursor=2>; rel=\"next\""
                .parse()
                .unwrap(),
        );
        assert_eq!(next_link(&h).as_deref(), Some("https://hub/api/x?cursor=2"));
    }

    #[test]
    fn token_only_to_same_origin() {
        let c = HubClient::new(
            "http://127.0.0.1:9000",
            Some(Token::new("hf_x")),
            RetryPolicy::default(),
        )
        .unwrap();
        assert!(c.same_origin("http://127.0.0.1:9000/api/x"));
        assert!(!c.same_origin("http://127.0.0.1:9001/lfs"));
        assert!(!c.same_origin("https://s3.example/obj"));
    }
}
