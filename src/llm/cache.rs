//! On-disk request cache shared by all backends, and [`CachedBackend`], which puts it in front
//! of any [`ChatBackend`].
//!
//! The file is append-only: one record per line, `crc32hex \t {"key":..,"value":<Choice>}`.
//! Every batch of records is one `write_all` on a file opened with `O_APPEND`, so processes
//! appending to the same file do not interleave; a record torn by a crash fails its checksum
//! and is skipped (and counted) at the next open, which also terminates the torn line so that
//! later records start on a fresh one. The first record for a key wins.
//!
//! One entry per *sample*: the key is the SHA-256 of the canonical JSON of (backend kind, model,
//! endpoint, messages, temperature, top_p, max_tokens, stop, seed, json_mode, sample index) —
//! `n` is not part of it. A request for `n` samples is a hit when all `n` are cached. Otherwise
//! the inner backend is asked only for the tail from the first missing index `m`: a request
//! with `n - m` samples and, when a seed is set, seed `seed + m` (sample `i` is drawn with seed
//! `seed + i`, see [`ChatRequest::seed`]). So after n = 3, a request for n = 5 reuses samples
//! 0..3 and asks for 2. Samples already cached inside that tail (only possible after a torn
//! write or a concurrent writer) keep their cached value.
//!
//! `option_probs` answers are cached too, under a key of (backend, messages, prefix, options),
//! stored as a one-choice entry whose content is the JSON of the answer.
//!
//! The same log is the run's durable record of spend: a [`CachedBackend`] given a role
//! ([`CachedBackend::for_role`]) appends a usage record `{"usage": {"role", …}}` *before* it
//! sends a call to the model (one call, and whether it is a re-ask), another when the answer
//! comes (tokens, retries, or a failure), and one per cache hit. A call in flight when the
//! process is killed (kill -9 included) is therefore counted: an endpoint bills it anyway.
//! [`RequestCache::usage_totals`] sums every record ever written, so a resumed run's totals
//! are what was really sent, whatever happened to the processes before it.

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::usage::{attempts, in_reask, UsageSnapshot};
use super::{
    BackendId, ChatBackend, ChatMessage, ChatRequest, ChatResponse, Choice, LlmError, OptionProbs,
    TokenUsage,
};

/// File name used when [`RequestCache::open`] is given a directory.
pub const CACHE_FILE_NAME: &str = "requests.log";

#[derive(Serialize)]
struct RecordRef<'a> {
    key: &'a str,
    value: &'a Choice,
}

/// One line of the log: a cached sample, or a usage record.
#[derive(Deserialize)]
#[serde(untagged)]
enum Record {
    Entry { key: String, value: Choice },
    Usage { usage: UsageLine },
}

fn is_zero(x: &u64) -> bool {
    *x == 0
}

/// A usage record: one role's counters to add (zeros left out to keep lines short).
#[derive(Serialize, Deserialize)]
struct UsageLine {
    role: String,
    #[serde(default, skip_serializing_if = "is_zero")]
    calls: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    cache_hits: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    prompt_tokens: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    completion_tokens: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    retries: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    failures: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    reasks: u64,
}

impl UsageLine {
    fn new(role: &str, u: UsageSnapshot) -> Self {
        Self {
            role: role.to_string(),
            calls: u.calls,
            cache_hits: u.cache_hits,
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            retries: u.retries,
            failures: u.failures,
            reasks: u.reasks,
        }
    }

    fn snapshot(&self) -> UsageSnapshot {
        UsageSnapshot {
            calls: self.calls,
            cache_hits: self.cache_hits,
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.completion_tokens,
            retries: self.retries,
            failures: self.failures,
            reasks: self.reasks,
        }
    }
}

fn add_to(totals: &mut BTreeMap<String, UsageSnapshot>, role: &str, u: UsageSnapshot) {
    let t = totals.entry(role.to_string()).or_default();
    *t = *t + u;
}

/// The cache: an in-memory map loaded from, and appended to, one log file.
#[derive(Debug)]
pub struct RequestCache {
    path: PathBuf,
    entries: Mutex<HashMap<String, Choice>>,
    file: Mutex<File>,
    skipped: usize,
    /// Usage records: every one in the file (`.0`), and whether the file had any when opened.
    usage: Mutex<BTreeMap<String, UsageSnapshot>>,
    usage_at_open: bool,
}

impl RequestCache {
    /// Opens (creating if needed) the cache at `path`: a file, or a directory (existing, or
    /// given with a trailing `/`) in which `requests.log` is used.
    pub fn open(path: impl AsRef<Path>) -> Result<Arc<Self>, LlmError> {
        let given = path.as_ref();
        let is_dir = given.is_dir() || given.as_os_str().to_string_lossy().ends_with('/');
        let path = if is_dir {
            given.join(CACHE_FILE_NAME)
        } else {
            given.to_path_buf()
        };
        let err = |message: String| LlmError::Cache {
            path: path.display().to_string(),
            message,
        };
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| err(format!("create directory: {e}")))?;
        }
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(&path)
            .map_err(|e| err(format!("open: {e}")))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)
            .map_err(|e| err(format!("read: {e}")))?;

        let mut entries = HashMap::new();
        let mut usage = BTreeMap::new();
        let mut skipped = 0;
        let torn_tail = !bytes.is_empty() && !bytes.ends_with(b"\n");
        for line in bytes.split(|b| *b == b'\n') {
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            match parse_line(line) {
                Some(Record::Entry { key, value }) => {
                    entries.entry(key).or_insert(value);
                }
                Some(Record::Usage { usage: u }) => add_to(&mut usage, &u.role, u.snapshot()),
                None => skipped += 1,
            }
        }
        if torn_tail {
            // Terminate the torn line so the next record does not extend it.
            file.write_all(b"\n")
                .and_then(|_| file.flush())
                .map_err(|e| err(format!("append: {e}")))?;
        }
        if skipped > 0 {
            tracing::warn!(
                path = %path.display(),
                skipped,
                "request cache: ignored corrupt or torn records"
            );
        }
        Ok(Arc::new(Self {
            path,
            entries: Mutex::new(entries),
            file: Mutex::new(file),
            skipped,
            usage_at_open: !usage.is_empty(),
            usage: Mutex::new(usage),
        }))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Number of cached samples.
    pub fn len(&self) -> usize {
        self.map().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Records found corrupt or torn when the file was opened.
    pub fn skipped_records(&self) -> usize {
        self.skipped
    }

    pub fn get(&self, key: &str) -> Option<Choice> {
        self.map().get(key).cloned()
    }

    /// Usage per role of every usage record in the file: this process's and every earlier
    /// one's (see the module docs).
    pub fn usage_totals(&self) -> BTreeMap<String, UsageSnapshot> {
        self.usage
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Whether the file held usage records when it was opened (a log written before they
    /// existed has none: its spend is only in the run's manifest).
    pub fn had_usage_records(&self) -> bool {
        self.usage_at_open
    }

    /// Appends a usage record for `role` (one write; see the module docs).
    pub fn record_usage(&self, role: &str, delta: UsageSnapshot) -> Result<(), LlmError> {
        let err = |message: String| LlmError::Cache {
            path: self.path.display().to_string(),
            message,
        };
        let json = serde_json::to_vec(&serde_json::json!({"usage": UsageLine::new(role, delta)}))
            .map_err(|e| err(format!("serialize: {e}")))?;
        let mut line = format!("{:08x}\t", crc32fast::hash(&json)).into_bytes();
        line.extend_from_slice(&json);
        line.push(b'\n');
        {
            let mut file = self.file.lock().unwrap_or_else(PoisonError::into_inner);
            file.write_all(&line)
                .and_then(|_| file.flush())
                .map_err(|e| err(format!("append: {e}")))?;
        }
        add_to(
            &mut self.usage.lock().unwrap_or_else(PoisonError::into_inner),
            role,
            delta,
        );
        Ok(())
    }

    /// Adds entries whose key is not cached yet (first record wins), appending them to the file
    /// in one write. Entries with empty content are never cached.
    pub fn insert_many(&self, items: &[(String, Choice)]) -> Result<(), LlmError> {
        let mut buf = Vec::new();
        {
            let mut map = self.map();
            for (key, choice) in items {
                if choice.content.trim().is_empty() || map.contains_key(key) {
                    continue;
                }
                let json = serde_json::to_vec(&RecordRef { key, value: choice }).map_err(|e| {
                    LlmError::Cache {
                        path: self.path.display().to_string(),
                        message: format!("serialize: {e}"),
                    }
                })?;
                buf.extend_from_slice(format!("{:08x}\t", crc32fast::hash(&json)).as_bytes());
                buf.extend_from_slice(&json);
                buf.push(b'\n');
                map.insert(key.clone(), choice.clone());
            }
        }
        if buf.is_empty() {
            return Ok(());
        }
        let mut file = self.file.lock().unwrap_or_else(PoisonError::into_inner);
        file.write_all(&buf)
            .and_then(|_| file.flush())
            .map_err(|e| LlmError::Cache {
                path: self.path.display().to_string(),
                message: format!("append: {e}"),
            })
    }

    /// Cache key of sample `index` of `req` sent to backend `id` (`req.n` is not part of it).
    pub fn key(id: &BackendId, req: &ChatRequest, index: usize) -> String {
        let messages: Vec<[&str; 2]> = req
            .messages
            .iter()
            .map(|m: &ChatMessage| [m.role.as_str(), m.content.as_str()])
            .collect();
        let mut canonical = serde_json::json!({
            "v": 1,
            "kind": id.kind,
            "model": id.model,
            "endpoint": id.endpoint,
            "messages": messages,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "max_tokens": req.max_tokens,
            "stop": req.stop,
            "seed": req.seed,
            "json_mode": req.json_mode,
            "index": index,
        });
        // Only when asked for, so the keys of every earlier entry stay as they were.
        if let Some(k) = req.logprobs {
            canonical["logprobs"] = serde_json::json!(k);
        }
        hex::encode(Sha256::digest(canonical.to_string().as_bytes()))
    }

    /// Cache key of an `option_probs` call.
    pub fn probe_key(
        id: &BackendId,
        messages: &[ChatMessage],
        prefix: &str,
        options: &[String],
    ) -> String {
        let messages: Vec<[&str; 2]> = messages
            .iter()
            .map(|m| [m.role.as_str(), m.content.as_str()])
            .collect();
        let canonical = serde_json::json!({
            "v": 1, "kind": id.kind, "model": id.model, "endpoint": id.endpoint,
            "messages": messages, "option_probs": {"prefix": prefix, "options": options},
        });
        hex::encode(Sha256::digest(canonical.to_string().as_bytes()))
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Choice>> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn parse_line(line: &[u8]) -> Option<Record> {
    let tab = line.iter().position(|b| *b == b'\t')?;
    let (crc, json) = (&line[..tab], &line[tab + 1..]);
    let crc = u32::from_str_radix(std::str::from_utf8(crc).ok()?, 16).ok()?;
    if crc32fast::hash(json) != crc {
        return None;
    }
    serde_json::from_slice(json).ok()
}

/// A backend whose answers go through a [`RequestCache`] (see the module docs for the rules).
pub struct CachedBackend<B: ?Sized> {
    inner: Arc<B>,
    cache: Arc<RequestCache>,
    /// The role usage records are written for; `None`: none are written.
    role: Option<String>,
}

impl<B: ChatBackend + ?Sized> CachedBackend<B> {
    pub fn new(inner: Arc<B>, cache: Arc<RequestCache>) -> Self {
        Self {
            inner,
            cache,
            role: None,
        }
    }

    /// Records this backend's spend in the cache log under `role` (see the module docs).
    pub fn for_role(mut self, role: &str) -> Self {
        self.role = Some(role.to_string());
        self
    }

    /// Appends a usage record when this backend has a role; a failed write only warns (the
    /// call itself is not at fault).
    fn record(&self, delta: UsageSnapshot) {
        if let Some(role) = &self.role {
            if let Err(e) = self.cache.record_usage(role, delta) {
                tracing::warn!(error = %e, "could not record usage in the request cache");
            }
        }
    }

    /// Before a call is sent: it counts from now on, answered or not.
    fn record_sent(&self) {
        self.record(UsageSnapshot {
            calls: 1,
            reasks: u64::from(in_reask()),
            ..UsageSnapshot::default()
        });
    }

    /// After a sent call: what it cost, or that it failed.
    fn record_outcome(&self, tokens: (u64, u64), retries: u32, error: Option<&LlmError>) {
        self.record(UsageSnapshot {
            prompt_tokens: tokens.0,
            completion_tokens: tokens.1,
            retries: u64::from(match error {
                Some(e) => attempts(e).saturating_sub(1),
                None => retries,
            }),
            failures: u64::from(error.is_some()),
            ..UsageSnapshot::default()
        });
    }

    fn record_hit(&self) {
        self.record(UsageSnapshot {
            cache_hits: 1,
            ..UsageSnapshot::default()
        });
    }
    pub fn inner(&self) -> &Arc<B> {
        &self.inner
    }
    pub fn cache(&self) -> &Arc<RequestCache> {
        &self.cache
    }
}

#[async_trait]
impl<B: ChatBackend + ?Sized> ChatBackend for CachedBackend<B> {
    fn id(&self) -> &BackendId {
        self.inner.id()
    }

    fn context_limits(&self) -> Option<super::ContextLimits> {
        self.inner.context_limits()
    }

    async fn chat(&self, req: &ChatRequest) -> Result<ChatResponse, LlmError> {
        req.validate()?;
        let id = self.inner.id();
        let keys: Vec<String> = (0..req.n).map(|i| RequestCache::key(id, req, i)).collect();
        let found: Vec<Option<Choice>> = keys.iter().map(|k| self.cache.get(k)).collect();
        let Some(first) = found.iter().position(Option::is_none) else {
            self.record_hit();
            let choices = found
                .into_iter()
                .flatten()
                .enumerate()
                .map(|(index, c)| Choice { index, ..c })
                .collect();
            return Ok(ChatResponse {
                choices,
                usage: TokenUsage::default(),
                model: id.model.clone(),
                retries: 0,
                cached: true,
            });
        };

        let missing = req.n - first;
        let mut sub = req.clone();
        sub.n = missing;
        if let Some(seed) = req.seed {
            let shifted = u64::try_from(first)
                .ok()
                .and_then(|f| seed.checked_add(f))
                .ok_or_else(|| {
                    LlmError::InvalidRequest(format!(
                        "`seed` = {seed} overflows with n = {}",
                        req.n
                    ))
                })?;
            sub.seed = Some(shifted);
        }
        self.record_sent();
        let resp = match self.inner.chat(&sub).await {
            Ok(r) => r,
            Err(e) => {
                self.record_outcome((0, 0), 0, Some(&e));
                return Err(e);
            }
        };
        self.record_outcome(
            (resp.usage.prompt_tokens, resp.usage.completion_tokens),
            resp.retries,
            None,
        );
        if resp.choices.len() < missing {
            return Err(LlmError::MalformedResponse {
                endpoint: id.to_string(),
                attempts: 1,
                message: format!(
                    "asked for {missing} samples, the backend returned {}",
                    resp.choices.len()
                ),
            });
        }
        let mut choices: Vec<Choice> = found[..first].iter().flatten().cloned().collect();
        let mut fresh = Vec::new();
        for (j, c) in resp.choices.into_iter().take(missing).enumerate() {
            let index = first + j;
            match &found[index] {
                Some(cached) => choices.push(cached.clone()),
                None => {
                    let c = Choice { index, ..c };
                    fresh.push((keys[index].clone(), c.clone()));
                    choices.push(c);
                }
            }
        }
        for (index, c) in choices.iter_mut().enumerate() {
            c.index = index;
        }
        if let Err(e) = self.cache.insert_many(&fresh) {
            // The answer is paid for: return it, but say that it was not stored.
            tracing::warn!("{e}");
        }
        Ok(ChatResponse {
            choices,
            usage: resp.usage,
            model: resp.model,
            retries: resp.retries,
            cached: false,
        })
    }

    async fn option_probs(
        &self,
        messages: &[ChatMessage],
        prefix: &str,
        options: &[String],
    ) -> Result<OptionProbs, LlmError> {
        let key = RequestCache::probe_key(self.inner.id(), messages, prefix, options);
        if let Some(hit) = self.cache.get(&key) {
            if let Ok(mut p) = serde_json::from_str::<OptionProbs>(&hit.content) {
                p.cached = true;
                self.record_hit();
                return Ok(p);
            }
        }
        self.record_sent();
        let p = match self.inner.option_probs(messages, prefix, options).await {
            Ok(p) => p,
            Err(e) => {
                self.record_outcome((0, 0), 0, Some(&e));
                return Err(e);
            }
        };
        self.record_outcome((p.prompt_tokens, 0), 0, None);
        let stored = Choice {
            index: 0,
            content: serde_json::to_string(&p).unwrap_or_default(),
            finish_reason: crate::llm::FinishReason::Stop,
            token_ids: None,
            logprobs: None,
        };
        if let Err(e) = self.cache.insert_many(&[(key, stored)]) {
            tracing::warn!(error = %e, "could not write the request cache");
        }
        Ok(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::scripted::ScriptedBackend;
    use crate::llm::FinishReason;

    fn choice(i: usize, s: &str) -> Choice {
        Choice {
            index: i,
            content: s.into(),
            finish_reason: FinishReason::Stop,
            token_ids: None,
            logprobs: None,
        }
    }

    #[test]
    fn reopen_sees_entries_and_torn_tail_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let c = RequestCache::open(dir.path()).unwrap();
        c.insert_many(&[("a".into(), choice(0, "x")), ("b".into(), choice(1, "y"))])
            .unwrap();
        drop(c);
        let path = dir.path().join(CACHE_FILE_NAME);
        // A crash mid-write: half a record, no newline.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(b"deadbeef\t{\"key\":\"c\",\"val").unwrap();
        drop(f);

        let c = RequestCache::open(&path).unwrap();
        assert_eq!(c.len(), 2);
        assert_eq!(c.skipped_records(), 1);
        assert_eq!(c.get("b").unwrap().content, "y");
        c.insert_many(&[("c".into(), choice(0, "z"))]).unwrap();
        drop(c);

        let c = RequestCache::open(&path).unwrap();
        assert_eq!(c.len(), 3, "a record after the torn one is intact");
        assert_eq!(c.skipped_records(), 1);
        assert_eq!(c.get("c").unwrap().content, "z");
    }

    #[test]
    fn corrupt_records_are_skipped_and_duplicates_not_written() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/cache.log");
        let c = RequestCache::open(&path).unwrap();
        c.insert_many(&[("a".into(), choice(0, "x"))]).unwrap();
        c.insert_many(&[("a".into(), choice(0, "other"))]).unwrap();
        assert_eq!(c.get("a").unwrap().content, "x");
        drop(c);
        let mut text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 1);
        text = text.replace("\"x\"", "\"X\"") + "00000000\tnot json\n";
        std::fs::write(&path, text).unwrap();
        let c = RequestCache::open(&path).unwrap();
        assert_eq!(c.len(), 0);
        assert_eq!(c.skipped_records(), 2);
    }

    #[test]
    fn key_depends_on_sampling_and_index_not_n() {
        let id = BackendId {
            kind: "openai".into(),
            model: "m".into(),
            endpoint: "http://h/v1".into(),
        };
        let r = ChatRequest::new(vec![ChatMessage::user("hi")]);
        let k = RequestCache::key(&id, &r, 0);
        assert_eq!(k, RequestCache::key(&id, &r.clone().n(5), 0));
        assert_ne!(k, RequestCache::key(&id, &r, 1));
        assert_ne!(k, RequestCache::key(&id, &r.clone().temperature(0.5), 0));
        assert_ne!(k, RequestCache::key(&id, &r.clone().seed(1), 0));
        assert_ne!(k, RequestCache::key(&id, &r.clone().json_mode(true), 0));
        assert_ne!(k, RequestCache::key(&id, &r.clone().logprobs(0), 0));
        let other = BackendId {
            model: "m2".into(),
            ..id.clone()
        };
        assert_ne!(k, RequestCache::key(&other, &r, 0));
    }

    #[tokio::test]
    async fn tail_request_shifts_seed() {
        let dir = tempfile::tempdir().unwrap();
        let cache = RequestCache::open(dir.path()).unwrap();
        let inner = ScriptedBackend::new("s", |req, i| {
            Ok(format!("seed {} sample {i}", req.seed.unwrap_or(0)))
        });
        let b = CachedBackend::new(inner.clone(), cache.clone());
        let req = ChatRequest::new(vec![ChatMessage::user("q")]).seed(10);
        let r3 = b.chat(&req.clone().n(3)).await.unwrap();
        assert!(!r3.cached);
        let r5 = b.chat(&req.clone().n(5)).await.unwrap();
        assert_eq!(inner.calls(), 2);
        assert_eq!(r5.choices[..3], r3.choices[..]);
        assert_eq!(r5.choices[3].content, "seed 13 sample 0");
        assert_eq!(r5.choices[4].index, 4);
        let again = b.chat(&req.clone().n(4)).await.unwrap();
        assert!(again.cached);
        assert_eq!(inner.calls(), 2);
        assert_eq!(again.usage, TokenUsage::default());
    }

    #[tokio::test]
    async fn usage_records_count_sent_calls_hits_failures_and_reasks_across_reopens() {
        use crate::llm::usage::reask;
        let dir = tempfile::tempdir().unwrap();
        let cache = RequestCache::open(dir.path()).unwrap();
        assert!(!cache.had_usage_records());
        let inner = ScriptedBackend::new("s", |req, _| {
            let last = &req.messages[0].content;
            if last == "fail" {
                Err(LlmError::InvalidRequest("no".into()))
            } else {
                Ok(format!("answer to {last}"))
            }
        });
        let b = CachedBackend::new(inner.clone(), cache.clone()).for_role("judge");
        let req = |t: &str| ChatRequest::new(vec![ChatMessage::user(t)]).seed(1);
        b.chat(&req("a")).await.unwrap();
        b.chat(&req("a")).await.unwrap(); // a hit
        reask(true, b.chat(&req("b"))).await.unwrap();
        assert!(b.chat(&req("fail")).await.is_err());
        // A backend without a role records nothing.
        CachedBackend::new(inner, cache.clone())
            .chat(&req("c"))
            .await
            .unwrap();
        let judge = cache.usage_totals()["judge"];
        assert_eq!(
            (judge.calls, judge.cache_hits, judge.reasks, judge.failures),
            (3, 1, 1, 1)
        );
        assert!(judge.prompt_tokens > 0 && judge.completion_tokens > 0);
        assert_eq!(cache.usage_totals().len(), 1);
        drop((b, cache));

        // Reopened (a resumed run): the totals are rebuilt from the log, entries still load,
        // and new records add to them.
        let cache = RequestCache::open(dir.path()).unwrap();
        assert!(cache.had_usage_records());
        assert_eq!(cache.usage_totals()["judge"], judge);
        assert_eq!(cache.len(), 3);
        assert_eq!(cache.skipped_records(), 0);
        cache
            .record_usage(
                "judge",
                UsageSnapshot {
                    calls: 2,
                    ..Default::default()
                },
            )
            .unwrap();
        assert_eq!(cache.usage_totals()["judge"].calls, 5);
    }
}
