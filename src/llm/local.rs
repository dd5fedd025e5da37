//! The local candle engine as a [`ChatBackend`]. All local model work in a process runs on one
//! worker thread, fed by a queue: concurrent callers are served in turn, and two models never
//! compete for the same cores (candle's CPU kernels spin-wait, DESIGN §8). A model spec loaded
//! twice with the same options is loaded once.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, OnceLock, Weak};

use async_trait::async_trait;

pub use super::engine::LoadOptions;
use super::engine::{CancelFlag, Engine, EngineError, GenParams};
use super::spec::{resolve_local, ModelSpec, SpecError};
use super::{
    BackendId, ChatBackend, ChatMessage, ChatRequest, ChatResponse, Choice, ContextLimits,
    LlmError, OptionProbs, TokenUsage,
};

#[derive(Debug, thiserror::Error)]
pub enum LocalLoadError {
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error(transparent)]
    Engine(#[from] EngineError),
}

type Job = Box<dyn FnOnce() + Send>;

fn worker() -> &'static mpsc::Sender<Job> {
    static WORKER: OnceLock<mpsc::Sender<Job>> = OnceLock::new();
    WORKER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("collabllm-model".into())
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    // A panicking job must not take the queue down with it; its caller sees
                    // the dropped reply channel.
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                }
            })
            .expect("spawning the model worker thread");
        tx
    })
}

/// Sets the flag when dropped: dropping the future that waits for a job (an HTTP client that
/// left) tells the job to stop. Also set after a normal finish, when the job is already done.
struct CancelOnDrop(CancelFlag);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// Runs `f` on the model worker thread and waits for its result without blocking the runtime.
/// `f` gets a flag that is set once nobody waits for its result any more.
async fn on_worker<T: Send + 'static>(
    what: &str,
    f: impl FnOnce(&CancelFlag) -> T + Send + 'static,
) -> Result<T, String> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let cancel = CancelFlag::default();
    let job_cancel = cancel.clone();
    worker()
        .send(Box::new(move || {
            let _ = tx.send(f(&job_cancel));
        }))
        .map_err(|_| format!("{what}: the model worker has stopped"))?;
    let _cancel_on_drop = CancelOnDrop(cancel);
    rx.await
        .map_err(|_| format!("{what}: the model worker panicked"))
}

/// What a local backend's generation jobs came to (counted since it was loaded).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LocalStats {
    /// Chat requests handed to the worker queue.
    pub queued: u64,
    /// Generations that started (prompt encoded, prefill under way).
    pub started: u64,
    /// Generations stopped part-way because their caller left.
    pub cancelled: u64,
    /// Tokens the cancelled generations had produced when they stopped.
    pub cancelled_tokens: u64,
    /// Queued requests never started because their caller had left.
    pub skipped: u64,
}

#[derive(Debug, Default)]
struct Counters {
    queued: AtomicU64,
    started: AtomicU64,
    cancelled: AtomicU64,
    cancelled_tokens: AtomicU64,
    skipped: AtomicU64,
}

impl Counters {
    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
    fn snapshot(&self) -> LocalStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        LocalStats {
            queued: get(&self.queued),
            started: get(&self.started),
            cancelled: get(&self.cancelled),
            cancelled_tokens: get(&self.cancelled_tokens),
            skipped: get(&self.skipped),
        }
    }
}

type Registry = HashMap<(PathBuf, String), Weak<Engine>>;

fn registry() -> &'static tokio::sync::Mutex<Registry> {
    static REG: OnceLock<tokio::sync::Mutex<Registry>> = OnceLock::new();
    REG.get_or_init(Default::default)
}

/// A local model served through the [`ChatBackend`] interface.
pub struct LocalBackend {
    id: BackendId,
    engine: Arc<Engine>,
    counters: Arc<Counters>,
}

impl LocalBackend {
    /// Resolves `spec` (fetching an HF id into the HF cache if needed) and loads it, or reuses
    /// an already loaded copy.
    pub async fn load(
        spec: &ModelSpec,
        opts: &LoadOptions,
    ) -> Result<Arc<LocalBackend>, LocalLoadError> {
        let files = resolve_local(spec).await?;
        let path = files.path().to_path_buf();
        let key = (
            std::fs::canonicalize(&path).unwrap_or_else(|_| path.clone()),
            format!("{opts:?}"),
        );
        let mut reg = registry().lock().await;
        let engine = match reg.get(&key).and_then(Weak::upgrade) {
            Some(e) => e,
            None => {
                let opts = *opts;
                let loaded = on_worker("loading", move |_| Engine::load(&files, &opts))
                    .await
                    .map_err(|message| EngineError::Load {
                        path: path.clone(),
                        message,
                    })??;
                let e = Arc::new(loaded);
                reg.insert(key, Arc::downgrade(&e));
                e
            }
        };
        tracing::info!(
            model = engine.name(),
            fingerprint = engine.fingerprint(),
            context = engine.context_length(),
            "local model ready"
        );
        Ok(Arc::new(LocalBackend {
            id: BackendId {
                kind: "local".into(),
                model: format!("{}@{}", engine.name(), engine.fingerprint()),
                endpoint: String::new(),
            },
            engine,
            counters: Arc::default(),
        }))
    }

    /// What this backend's generation jobs came to so far.
    pub fn stats(&self) -> LocalStats {
        self.counters.snapshot()
    }

    /// A backend over an engine built in memory (e.g. the policy weights after an RL
    /// update); not registered for reuse by [`LocalBackend::load`].
    pub fn from_engine(engine: Arc<Engine>) -> Arc<LocalBackend> {
        Arc::new(LocalBackend {
            id: BackendId {
                kind: "local".into(),
                model: format!("{}@{}", engine.name(), engine.fingerprint()),
                endpoint: String::new(),
            },
            engine,
            counters: Arc::default(),
        })
    }

    pub fn model_name(&self) -> String {
        self.engine.name().to_string()
    }
    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    fn local_err(&self, e: impl std::fmt::Display) -> LlmError {
        LlmError::Local {
            model: self.engine.name().to_string(),
            message: e.to_string(),
        }
    }
}

fn to_llm_error(model: &str, e: EngineError) -> LlmError {
    match e {
        EngineError::PromptTooLong { .. } | EngineError::PromptTooManyBytes { .. } => {
            LlmError::ContextExceeded {
                model: model.to_string(),
                param: "messages",
                message: e.to_string(),
            }
        }
        EngineError::NoRoomForMaxTokens { .. } => LlmError::ContextExceeded {
            model: model.to_string(),
            param: "max_tokens",
            message: e.to_string(),
        },
        other => LlmError::Local {
            model: model.to_string(),
            message: other.to_string(),
        },
    }
}

/// One chat request on the worker thread: skipped when its caller already left, refused when
/// a strict `max_tokens` does not fit beside the prompt, cancelled at the next token when the
/// caller leaves mid-way.
fn run_chat(
    engine: &Engine,
    messages: &[ChatMessage],
    params: &GenParams,
    strict_max_tokens: bool,
    cancel: &CancelFlag,
    counters: &Counters,
) -> Result<super::engine::GenOutput, EngineError> {
    if cancel.is_cancelled() {
        Counters::add(&counters.skipped, 1);
        tracing::info!(
            model = engine.name(),
            "skipped a queued request: its client left"
        );
        return Err(EngineError::Cancelled {
            model: engine.name().to_string(),
            tokens: 0,
        });
    }
    let prompt = engine.encode_chat(messages)?;
    let context = engine.context_length();
    if strict_max_tokens && prompt.len() + params.max_new_tokens > context {
        return Err(EngineError::NoRoomForMaxTokens {
            model: engine.name().to_string(),
            prompt: prompt.len(),
            max_tokens: params.max_new_tokens,
            context,
        });
    }
    Counters::add(&counters.started, 1);
    let out = engine.generate_cancellable(&prompt, params, cancel);
    if let Err(EngineError::Cancelled { tokens, .. }) = &out {
        Counters::add(&counters.cancelled, 1);
        Counters::add(&counters.cancelled_tokens, *tokens as u64);
        tracing::info!(
            model = engine.name(),
            tokens,
            max_tokens = params.max_new_tokens,
            "generation stopped: its client left"
        );
    }
    out
}

#[async_trait]
impl ChatBackend for LocalBackend {
    fn id(&self) -> &BackendId {
        &self.id
    }

    fn context_limits(&self) -> Option<ContextLimits> {
        Some(ContextLimits {
            context_tokens: self.engine.context_length(),
            max_token_bytes: self.engine.max_token_bytes(),
        })
    }

    async fn chat(&self, req: &ChatRequest) -> Result<ChatResponse, LlmError> {
        req.validate()?;
        let engine = self.engine.clone();
        let messages = req.messages.clone();
        let params = GenParams {
            temperature: req.temperature,
            top_p: req.top_p,
            max_new_tokens: req.max_tokens,
            stop: req.stop.clone(),
            seed: req.seed,
            n: req.n,
            ignore_eos: false,
        };
        let counters = self.counters.clone();
        let strict = req.strict_max_tokens;
        Counters::add(&self.counters.queued, 1);
        let out = on_worker("generation", move |cancel| {
            run_chat(&engine, &messages, &params, strict, cancel, &counters)
        })
        .await
        .map_err(|e| self.local_err(e))?
        .map_err(|e| to_llm_error(self.engine.name(), e))?;
        if out.samples.iter().any(|s| s.text.trim().is_empty()) {
            return Err(LlmError::EmptyReply {
                backend: self.id.to_string(),
                attempts: 1,
            });
        }
        let completion_tokens = out.samples.iter().map(|s| s.tokens as u64).sum();
        Ok(ChatResponse {
            choices: out
                .samples
                .into_iter()
                .enumerate()
                .map(|(index, s)| Choice {
                    index,
                    content: s.text,
                    finish_reason: s.finish,
                })
                .collect(),
            usage: TokenUsage {
                prompt_tokens: out.prompt_tokens as u64,
                completion_tokens,
            },
            model: self.engine.name().to_string(),
            retries: 0,
            cached: false,
        })
    }

    async fn option_probs(
        &self,
        messages: &[ChatMessage],
        prefix: &str,
        options: &[String],
    ) -> Result<OptionProbs, LlmError> {
        let engine = self.engine.clone();
        let (messages, prefix, options) = (messages.to_vec(), prefix.to_string(), options.to_vec());
        on_worker("scoring", move |_| {
            engine.option_probs(&messages, &prefix, &options)
        })
        .await
        .map_err(|e| self.local_err(e))?
        .map_err(|e| to_llm_error(self.engine.name(), e))
    }
}
