//! A fake Hugging Face Hub on 127.0.0.1 (port 0) with just the endpoints a push uses, storing
//! repositories, commits and LFS objects in memory: `POST /api/repos/create`, `GET
//! /api/{datasets|models}/{org}/{name}/tree/main`, `POST …/preupload/main`, `POST …/commit/main`
//! (NDJSON), `POST [datasets/]{org}/{name}.git/info/lfs/objects/batch`, and the upload/verify
//! URLs it hands out. Every request must carry `Authorization: Bearer <token>`; faults can be
//! queued per path fragment (the error body echoes the Authorization header, like a careless
//! server, to check that the token never reaches an error message).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use base64::Engine as _;
use serde_json::{json, Value};
use sha2::Digest as _;

/// A file stored in a fake repository.
#[derive(Clone, Debug, PartialEq)]
pub enum Stored {
    Inline(Vec<u8>),
    Lfs { oid: String, size: u64 },
}

#[derive(Clone, Debug, Default)]
pub struct Repo {
    pub private: bool,
    pub files: BTreeMap<String, Stored>,
}

#[derive(Clone, Debug)]
pub struct Commit {
    /// `datasets/org/name` or `models/org/name`.
    pub repo: String,
    pub summary: String,
    pub paths: Vec<String>,
}

#[derive(Default)]
pub struct HubState {
    pub base: String,
    pub token: String,
    pub repos: HashMap<String, Repo>,
    pub lfs: HashMap<String, Vec<u8>>,
    pub commits: Vec<Commit>,
    pub lfs_uploads: usize,
    /// (method, path) of every request, in order.
    pub requests: Vec<(String, String)>,
    /// (path fragment, status, remaining count).
    pub faults: Vec<(String, u16, usize)>,
}

pub type Shared = Arc<Mutex<HubState>>;

pub struct FakeHub {
    pub url: String,
    pub state: Shared,
}

fn git_sha1(bytes: &[u8]) -> String {
    let mut h = sha1::Sha1::new();
    h.update(format!("blob {}\0", bytes.len()).as_bytes());
    h.update(bytes);
    hex::encode(h.finalize())
}

impl FakeHub {
    pub async fn start(token: &str) -> FakeHub {
        let state: Shared = Arc::new(Mutex::new(HubState {
            token: token.to_string(),
            ..HubState::default()
        }));
        let app = Router::new()
            .route("/api/repos/create", post(create))
            .route("/api/{plural}/{org}/{name}/tree/{rev}", get(tree))
            .route(
                "/api/{plural}/{org}/{name}/preupload/{rev}",
                post(preupload),
            )
            .route("/api/{plural}/{org}/{name}/commit/{rev}", post(commit))
            .route(
                "/datasets/{org}/{namegit}/info/lfs/objects/batch",
                post(batch_dataset),
            )
            .route("/{org}/{namegit}/info/lfs/objects/batch", post(batch_model))
            .route("/lfs-upload/{oid}", put(upload))
            .route("/lfs-verify/{oid}", post(verify))
            .layer(middleware::from_fn_with_state(state.clone(), guard))
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        state.lock().unwrap().base = url.clone();
        tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        FakeHub { url, state }
    }

    /// The next `count` requests whose path contains `fragment` answer `status`.
    pub fn fail(&self, fragment: &str, status: u16, count: usize) {
        self.state
            .lock()
            .unwrap()
            .faults
            .push((fragment.to_string(), status, count));
    }

    pub fn clear_faults(&self) {
        self.state.lock().unwrap().faults.clear();
    }

    pub fn repo(&self, key: &str) -> Repo {
        self.state.lock().unwrap().repos.get(key).cloned().unwrap()
    }

    pub fn commits(&self) -> Vec<Commit> {
        self.state.lock().unwrap().commits.clone()
    }

    pub fn lfs_uploads(&self) -> usize {
        self.state.lock().unwrap().lfs_uploads
    }

    pub fn lfs_object(&self, oid: &str) -> Option<Vec<u8>> {
        self.state.lock().unwrap().lfs.get(oid).cloned()
    }

    pub fn count(&self, fragment: &str) -> usize {
        self.state
            .lock()
            .unwrap()
            .requests
            .iter()
            .filter(|(_, p)| p.contains(fragment))
            .count()
    }
}

/// Logs, injects faults, checks the token (LFS upload URLs are exempt, like object storage).
async fn guard(State(s): State<Shared>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let auth = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    {
        let mut st = s.lock().unwrap();
        st.requests.push((req.method().to_string(), path.clone()));
        if let Some(f) = st
            .faults
            .iter_mut()
            .find(|(frag, _, n)| *n > 0 && path.contains(frag.as_str()))
        {
            f.2 -= 1;
            let status = StatusCode::from_u16(f.1).unwrap();
            return (status, format!("injected failure; request had `{auth}`")).into_response();
        }
        if !path.starts_with("/lfs-upload/") && auth != format!("Bearer {}", st.token) {
            return (
                StatusCode::UNAUTHORIZED,
                format!("Invalid credentials in Authorization header `{auth}`"),
            )
                .into_response();
        }
    }
    next.run(req).await
}

fn key(plural: &str, org: &str, name: &str) -> String {
    format!("{plural}/{org}/{name}")
}

async fn create(State(s): State<Shared>, Json(b): Json<Value>) -> Response {
    let plural = match b["type"].as_str() {
        Some("dataset") => "datasets",
        None | Some("model") => "models",
        Some(_) => return (StatusCode::BAD_REQUEST, "bad type").into_response(),
    };
    let k = key(
        plural,
        b["organization"].as_str().unwrap_or(""),
        b["name"].as_str().unwrap_or(""),
    );
    let mut st = s.lock().unwrap();
    if st.repos.contains_key(&k) {
        return (StatusCode::CONFLICT, "You already created this repo").into_response();
    }
    let mut repo = Repo {
        private: b["private"].as_bool().unwrap_or(false),
        ..Repo::default()
    };
    // Like the Hub: a new repository starts with a .gitattributes commit.
    repo.files.insert(
        ".gitattributes".into(),
        Stored::Inline(b"*.parquet filter=lfs diff=lfs merge=lfs -text\n".to_vec()),
    );
    st.repos.insert(k.clone(), repo);
    Json(json!({"url": format!("{}/{k}", st.base)})).into_response()
}

async fn tree(
    State(s): State<Shared>,
    Path((plural, org, name, _rev)): Path<(String, String, String, String)>,
) -> Response {
    let st = s.lock().unwrap();
    let Some(repo) = st.repos.get(&key(&plural, &org, &name)) else {
        return (StatusCode::NOT_FOUND, "Repository not found").into_response();
    };
    let entries: Vec<Value> = repo
        .files
        .iter()
        .map(|(path, f)| match f {
            Stored::Inline(b) => {
                json!({"type": "file", "path": path, "oid": git_sha1(b), "size": b.len()})
            }
            Stored::Lfs { oid, size } => {
                let pointer = format!(
                    "version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n"
                );
                json!({"type": "file", "path": path, "oid": git_sha1(pointer.as_bytes()),
                       "size": size, "lfs": {"oid": oid, "size": size, "pointerSize": pointer.len()}})
            }
        })
        .collect();
    Json(Value::Array(entries)).into_response()
}

async fn preupload(Json(b): Json<Value>) -> Response {
    let files: Vec<Value> = b["files"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .map(|f| {
            let path = f["path"].as_str().unwrap_or("").to_string();
            let lfs = path.ends_with(".parquet")
                || path.ends_with(".safetensors")
                || f["size"].as_u64().unwrap_or(0) > 10_000;
            json!({"path": path, "uploadMode": if lfs {"lfs"} else {"regular"}, "shouldIgnore": false})
        })
        .collect();
    Json(json!({"files": files})).into_response()
}

fn batch(s: &Shared, b: &Value) -> Response {
    let st = s.lock().unwrap();
    let objects: Vec<Value> = b["objects"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .map(|o| {
            let oid = o["oid"].as_str().unwrap_or("").to_string();
            if st.lfs.contains_key(&oid) {
                json!({"oid": oid, "size": o["size"]})
            } else {
                json!({"oid": oid, "size": o["size"], "actions": {
                    "upload": {"href": format!("{}/lfs-upload/{oid}", st.base),
                               "header": {"x-upload-ticket": "t1"}},
                    "verify": {"href": format!("{}/lfs-verify/{oid}", st.base)},
                }})
            }
        })
        .collect();
    Json(json!({"transfer": "basic", "objects": objects})).into_response()
}

async fn batch_dataset(State(s): State<Shared>, body: Bytes) -> Response {
    batch(&s, &serde_json::from_slice(&body).unwrap_or(Value::Null))
}

async fn batch_model(State(s): State<Shared>, body: Bytes) -> Response {
    batch(&s, &serde_json::from_slice(&body).unwrap_or(Value::Null))
}

async fn upload(
    State(s): State<Shared>,
    Path(oid): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if headers.get("x-upload-ticket").is_none() {
        return (StatusCode::BAD_REQUEST, "missing the action's header").into_response();
    }
    if hex::encode(sha2::Sha256::digest(&body)) != oid {
        return (StatusCode::BAD_REQUEST, "sha256 mismatch").into_response();
    }
    let mut st = s.lock().unwrap();
    st.lfs.insert(oid, body.to_vec());
    st.lfs_uploads += 1;
    StatusCode::OK.into_response()
}

async fn verify(
    State(s): State<Shared>,
    Path(oid): Path<String>,
    Json(b): Json<Value>,
) -> Response {
    let st = s.lock().unwrap();
    match st.lfs.get(&oid) {
        Some(data) if b["size"].as_u64() == Some(data.len() as u64) => {
            StatusCode::OK.into_response()
        }
        _ => (StatusCode::NOT_FOUND, "object not found").into_response(),
    }
}

async fn commit(
    State(s): State<Shared>,
    Path((plural, org, name, _rev)): Path<(String, String, String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if headers.get("content-type").and_then(|v| v.to_str().ok()) != Some("application/x-ndjson") {
        return (StatusCode::BAD_REQUEST, "expected NDJSON").into_response();
    }
    let k = key(&plural, &org, &name);
    let mut st = s.lock().unwrap();
    let mut summary = String::new();
    let mut changes = Vec::new();
    for line in String::from_utf8_lossy(&body).lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        let val = &v["value"];
        let path = val["path"].as_str().unwrap_or("").to_string();
        match v["key"].as_str() {
            Some("header") => summary = val["summary"].as_str().unwrap_or("").to_string(),
            Some("file") => {
                let bytes = base64::engine::general_purpose::STANDARD
                    .decode(val["content"].as_str().unwrap_or(""))
                    .unwrap();
                changes.push((path, Stored::Inline(bytes)));
            }
            Some("lfsFile") => {
                let oid = val["oid"].as_str().unwrap_or("").to_string();
                let Some(data) = st.lfs.get(&oid) else {
                    return (StatusCode::BAD_REQUEST, format!("LFS object {oid} missing"))
                        .into_response();
                };
                let size = data.len() as u64;
                changes.push((path, Stored::Lfs { oid, size }));
            }
            _ => return (StatusCode::BAD_REQUEST, "unknown key").into_response(),
        }
    }
    let Some(repo) = st.repos.get_mut(&k) else {
        return (StatusCode::NOT_FOUND, "Repository not found").into_response();
    };
    let paths: Vec<String> = changes.iter().map(|(p, _)| p.clone()).collect();
    for (p, f) in changes {
        repo.files.insert(p, f);
    }
    st.commits.push(Commit {
        repo: k,
        summary,
        paths,
    });
    let oid = format!("{:040x}", st.commits.len());
    Json(json!({"commitOid": oid, "commitUrl": format!("{}/commit/{oid}", st.base)}))
        .into_response()
}
