//! The local candle engine as a [`ChatBackend`]. All local model work in a process runs on one
//! worker thread, fed by a queue, so two models never compete for the same cores (candle's CPU
//! kernels spin-wait). Generations are batched continuously: a request joins the
//! running decode batch at the next token boundary while the batch has room
//! ([`LocalBackend::set_max_batch`]) and leaves it when done or abandoned. A model spec loaded
//! twice with the same options is loaded once.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use async_trait::async_trait;

use super::spec::{resolve_local, ModelSpec, SpecError};
use super::{
    BackendId, ChatBackend, ChatMessage, ChatRequest, ChatResponse, Choice, CompletionPrompt,
    CompletionRequest, CompletionResponse, ContextLimits, FinishReason, LlmError, OptionProbs,
    TokenUsage, TokenizeInput, Tokenized, TokenizerInfo,
};
use crate::engine::scheduler::{
    default_kv_budget, on_worker, worker, CancelOnDrop, Counters, GenJob, GenReply, Job, Task,
};
pub use crate::engine::scheduler::{LocalStats, DEFAULT_MAX_BATCH, PREFILL_CHUNK};
pub use crate::engine::LoadOptions;
use crate::engine::{CancelFlag, Engine, EngineError, EosRule, GenParams, TokenLogprob, TokenSink};

#[derive(Debug, thiserror::Error)]
pub enum LocalLoadError {
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error(transparent)]
    Engine(#[from] EngineError),
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
    max_batch: AtomicUsize,
    prefill_chunk: AtomicUsize,
    kv_budget: AtomicUsize,
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
                let loaded = on_worker("loading", move || Engine::load(&files, &opts))
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
            counters: Arc::default(),
            max_batch: AtomicUsize::new(DEFAULT_MAX_BATCH),
            prefill_chunk: AtomicUsize::new(PREFILL_CHUNK),
            kv_budget: AtomicUsize::new(default_kv_budget(&engine)),
            engine,
        }))
    }

    /// Caps the rows (samples, over all requests in flight) that the decode batch may hold
    /// while this backend's requests join it; 1 serves one request at a time. A request
    /// with more samples than the cap runs alone.
    pub fn set_max_batch(&self, rows: usize) {
        self.max_batch.store(rows.max(1), Ordering::Relaxed);
    }

    pub fn max_batch(&self) -> usize {
        self.max_batch.load(Ordering::Relaxed)
    }

    /// Prompt positions this backend's requests prefill per scheduler round while others
    /// decode (default [`PREFILL_CHUNK`]); 0 prefills each prompt whole on admission, which
    /// stalls the running batch for the whole prompt.
    pub fn set_prefill_chunk(&self, tokens: usize) {
        self.prefill_chunk.store(tokens, Ordering::Relaxed);
    }

    pub fn prefill_chunk(&self) -> usize {
        self.prefill_chunk.load(Ordering::Relaxed)
    }

    /// Caps the key/value memory (bytes, at least 1) that requests in flight may reserve
    /// while this backend's requests join the batch: a request reserves its prompt and
    /// `n` × `max_tokens` positions ([`Engine::kv_reservation`]) and waits, behind it the
    /// queue, until those in flight leave room; one that cannot fit alone is refused. The
    /// default is [`DEFAULT_MAX_BATCH`] rows at the model's full context, at most half the
    /// memory available once the model was loaded. Stored prompts (the prompt cache) have
    /// their own budget.
    pub fn set_kv_budget_bytes(&self, bytes: usize) {
        self.kv_budget.store(bytes.max(1), Ordering::Relaxed);
    }

    /// The key/value budget of this backend's requests, in bytes.
    pub fn kv_budget_bytes(&self) -> usize {
        self.kv_budget.load(Ordering::Relaxed)
    }

    /// What this backend's generation jobs came to so far.
    pub fn stats(&self) -> LocalStats {
        self.counters.snapshot()
    }

    /// [`LocalBackend::load`] with the Jinja chat template in `template` instead of the
    /// model's own (`serve --chat-template FILE`; a base model has none). Not shared with
    /// other loads: the template makes it another model.
    pub async fn load_with_chat_template(
        spec: &ModelSpec,
        opts: &LoadOptions,
        template: &std::path::Path,
    ) -> Result<Arc<LocalBackend>, LocalLoadError> {
        let files = resolve_local(spec).await?;
        let path = files.path().to_path_buf();
        let (opts, template) = (*opts, template.to_path_buf());
        let engine = on_worker("loading", move || -> Result<Engine, EngineError> {
            let mut engine = Engine::load(&files, &opts)?;
            engine.set_chat_template(&template)?;
            Ok(engine)
        })
        .await
        .map_err(|message| EngineError::Load { path, message })??;
        Ok(Self::from_engine(Arc::new(engine)))
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
            counters: Arc::default(),
            max_batch: AtomicUsize::new(DEFAULT_MAX_BATCH),
            prefill_chunk: AtomicUsize::new(PREFILL_CHUNK),
            kv_budget: AtomicUsize::new(default_kv_budget(&engine)),
            engine,
        })
    }

    pub fn model_name(&self) -> String {
        self.engine.name().to_string()
    }
    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// A request as the scheduler's job (checked), and the receiver of its answer.
    fn job(
        &self,
        req: &ChatRequest,
        stream: Option<TokenSink>,
    ) -> Result<(GenJob, GenReply), LlmError> {
        req.validate()?;
        let (mut job, rx) =
            self.generation(req.sampling().gen_params(), req.strict_max_tokens, stream);
        job.messages = req.messages.clone();
        Ok((job, rx))
    }

    /// A generation job (no prompt yet) and the receiver of its answer.
    fn generation(
        &self,
        params: GenParams,
        strict_max_tokens: bool,
        stream: Option<TokenSink>,
    ) -> (GenJob, GenReply) {
        let (reply, rx) = tokio::sync::oneshot::channel();
        let mut job = self.scheduled(params, Task::Generate(reply));
        job.strict_max_tokens = strict_max_tokens;
        job.stream = stream;
        (job, rx)
    }

    /// A job of this backend (its limits, counters and a fresh cancel flag) for `task`, with
    /// no messages, stream or strict `max_tokens`.
    fn scheduled(&self, params: GenParams, task: Task) -> GenJob {
        GenJob {
            engine: self.engine.clone(),
            messages: Vec::new(),
            prompt_ids: None,
            params,
            strict_max_tokens: false,
            cancel: CancelFlag::default(),
            counters: self.counters.clone(),
            max_batch: self.max_batch(),
            kv_budget: self.kv_budget_bytes(),
            prefill_chunk: self.prefill_chunk(),
            stream: None,
            task,
        }
    }

    /// Hands `job` to the scheduler and waits for `rx`; dropping the future cancels the job
    /// (skipped if not started, stopped at the next token otherwise). `what` names it in
    /// errors.
    async fn run_job<T>(
        &self,
        what: &str,
        job: GenJob,
        rx: tokio::sync::oneshot::Receiver<Result<T, EngineError>>,
    ) -> Result<T, LlmError> {
        let _cancel_on_drop = CancelOnDrop(job.cancel.clone());
        worker()
            .send(Job::Generate(Box::new(job)))
            .map_err(|_| self.local_err(format!("{what}: the model worker has stopped")))?;
        rx.await
            .map_err(|_| self.local_err(format!("{what}: the model worker panicked")))?
            .map_err(|e| to_llm_error(self.engine.name(), e))
    }

    /// Hands a chat request to the scheduler and waits for it; dropping the future cancels
    /// it (skipped if not started, stopped at the next token otherwise).
    async fn generate(
        &self,
        req: &ChatRequest,
        stream: Option<TokenSink>,
    ) -> Result<ChatResponse, LlmError> {
        let (job, rx) = self.job(req, stream)?;
        Counters::add(&self.counters.queued, 1);
        let out = self.run_job("generation", job, rx).await?;
        if out.samples.iter().any(|s| s.text.trim().is_empty()) {
            return Err(LlmError::EmptyReply {
                backend: self.id.to_string(),
                attempts: 1,
            });
        }
        let completion_tokens = out.samples.iter().map(|s| s.tokens as u64).sum();
        Ok(ChatResponse {
            choices: choices_of(out.samples),
            usage: TokenUsage {
                prompt_tokens: out.prompt_tokens as u64,
                completion_tokens,
                cached_prompt_tokens: out.cached_tokens as u64,
            },
            model: self.engine.name().to_string(),
            retries: 0,
            cached: false,
        })
    }

    fn local_err(&self, e: impl std::fmt::Display) -> LlmError {
        LlmError::Local {
            model: self.engine.name().to_string(),
            message: e.to_string(),
        }
    }
}

/// The engine's samples as choices, in order.
fn choices_of(samples: Vec<crate::engine::Generation>) -> Vec<Choice> {
    samples
        .into_iter()
        .enumerate()
        .map(|(index, s)| Choice {
            index,
            content: s.text,
            finish_reason: s.finish,
            token_ids: Some(s.token_ids),
            logprobs: s.logprobs,
        })
        .collect()
}

/// Text prompts tokenized at once, at most (a quarter of the cores, at least 1): tokenizing is
/// CPU work (a 1.3 MB prompt: 0.6 s) done on tokio's blocking pool, never on the async
/// threads that answer `/health` and the other requests, and bounded so that huge prompts
/// queue for a permit instead of taking every core.
fn tokenize_permits() -> &'static tokio::sync::Semaphore {
    static PERMITS: OnceLock<tokio::sync::Semaphore> = OnceLock::new();
    PERMITS.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        tokio::sync::Semaphore::new((cores / 4).max(1))
    })
}

/// Runs CPU-bound `f` (tokenizing a text prompt) off the async threads, under a
/// [`tokenize_permits`] permit.
async fn off_async<T: Send + 'static>(
    model: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, LlmError> {
    let local = |message: String| LlmError::Local {
        model: model.to_string(),
        message,
    };
    let _permit = tokenize_permits()
        .acquire()
        .await
        .map_err(|e| local(format!("tokenizing: {e}")))?;
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| local(format!("tokenizing: {e}")))
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
        EngineError::NoRoomForMaxTokens { .. } | EngineError::KvBudget { .. } => {
            LlmError::ContextExceeded {
                model: model.to_string(),
                param: "max_tokens",
                message: e.to_string(),
            }
        }
        EngineError::NoChatTemplate(message) => LlmError::Unsupported {
            backend: model.to_string(),
            what: format!("chat completions: {message}"),
        },
        EngineError::EmptyChatPrompt { .. } => LlmError::InvalidRequest(format!("`messages`: {e}")),
        EngineError::InvalidPrompt { message, .. } => {
            LlmError::InvalidRequest(format!("`prompt`: {message}"))
        }
        other => LlmError::Local {
            model: model.to_string(),
            message: other.to_string(),
        },
    }
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
        self.generate(req, None).await
    }

    async fn chat_stream(
        &self,
        req: &ChatRequest,
        sink: &super::DeltaSink,
    ) -> Result<ChatResponse, LlmError> {
        let sink = sink.clone();
        self.generate(
            req,
            Some(Box::new(
                move |i: usize, text: &str, lps: &[TokenLogprob]| {
                    sink.send_with_logprobs(i, text, lps)
                },
            )),
        )
        .await
    }

    /// Scored as a job of the scheduler: the prompt prefilled in chunks beside the decoding
    /// requests (and with other prompts in one forward pass), under the key/value budget,
    /// from a stored prefix where there is one; cancelled when the caller leaves.
    async fn option_probs(
        &self,
        messages: &[ChatMessage],
        prefix: &str,
        options: &[String],
    ) -> Result<OptionProbs, LlmError> {
        let (prompt, option_ids) = self
            .engine
            .option_prompt(messages, prefix, options)
            .map_err(|e| to_llm_error(self.engine.name(), e))?;
        let (reply, rx) = tokio::sync::oneshot::channel();
        let params = GenParams {
            temperature: 0.0,
            top_p: 1.0,
            max_new_tokens: 1,
            stop: Vec::new(),
            seed: None,
            n: 1,
            eos: EosRule::AfterText,
            logprobs: None,
        };
        let task = Task::Score {
            prompt,
            option_ids,
            reply,
        };
        self.run_job("scoring", self.scheduled(params, task), rx)
            .await
    }

    /// The prompt decodes in the batch like a chat prompt (the same scheduler, prefix cache
    /// and budget); with `echo` and `logprobs` its tokens are scored on the model thread.
    async fn complete(
        &self,
        req: &CompletionRequest,
        sink: Option<&super::DeltaSink>,
    ) -> Result<CompletionResponse, LlmError> {
        req.validate()?;
        let engine = self.engine.clone();
        let as_llm = |e: EngineError| to_llm_error(engine.name(), e);
        let (prompt_ids, prompt_text) = match &req.prompt {
            CompletionPrompt::Text(t) => {
                let (e, text) = (engine.clone(), t.clone());
                let ids = off_async(engine.name(), move || e.encode_raw(&text)).await?;
                (ids.map_err(as_llm)?, t.clone())
            }
            CompletionPrompt::Tokens(ids) => {
                engine.check_prompt_ids(ids).map_err(as_llm)?;
                (ids.clone(), engine.decode(ids).map_err(as_llm)?)
            }
        };
        let prompt_logprobs = match (req.echo, req.logprobs) {
            (true, Some(k)) => {
                let (e, ids) = (engine.clone(), prompt_ids.clone());
                let scored = on_worker("prompt scoring", move || e.prompt_logprobs(&ids, k))
                    .await
                    .map_err(|m| self.local_err(m))?;
                Some(super::PromptLogprobs {
                    first_token: engine.decode(&prompt_ids[..1]).map_err(as_llm)?,
                    rest: scored.map_err(as_llm)?,
                })
            }
            _ => None,
        };
        let (choices, completion_tokens, cached) = if req.max_tokens == 0 {
            let empty = |index| Choice {
                index,
                content: String::new(),
                finish_reason: FinishReason::Length,
                token_ids: Some(Vec::new()),
                logprobs: req.logprobs.map(|_| Vec::new()),
            };
            ((0..req.n).map(empty).collect(), 0, 0)
        } else {
            self.continue_ids(req, &prompt_ids, sink).await?
        };
        Ok(CompletionResponse {
            usage: TokenUsage {
                prompt_tokens: prompt_ids.len() as u64,
                completion_tokens,
                cached_prompt_tokens: cached,
            },
            prompt_ids,
            prompt_text,
            prompt_logprobs,
            choices,
        })
    }

    /// Tokenized off the async threads: a long text takes a while (1.3 MB: 0.6 s).
    async fn tokenize(&self, input: &TokenizeInput) -> Result<Tokenized, LlmError> {
        let (engine, input) = (self.engine.clone(), input.clone());
        let name = self.engine.name().to_string();
        off_async(&name, move || -> Result<Tokenized, EngineError> {
            let ids = match &input {
                TokenizeInput::Text {
                    text,
                    add_special_tokens,
                } => engine.tokenize_text(text, *add_special_tokens)?,
                TokenizeInput::Chat {
                    messages,
                    add_generation_prompt,
                    add_special_tokens,
                } => {
                    let text = engine.render_conversation(messages, *add_generation_prompt)?;
                    engine.tokenize_text(&text, *add_special_tokens)?
                }
            };
            let tokenizer = engine.tokenizer();
            let token_strs = ids
                .iter()
                .map(|&id| tokenizer.id_to_token(id).unwrap_or_default())
                .collect();
            Ok(Tokenized { ids, token_strs })
        })
        .await?
        .map_err(|e| to_llm_error(&name, e))
    }

    async fn detokenize(&self, ids: &[u32]) -> Result<String, LlmError> {
        self.engine.detokenize(ids).map_err(|e| match e {
            EngineError::InvalidPrompt { message, .. } => {
                LlmError::InvalidRequest(format!("`tokens`: {message}"))
            }
            e => to_llm_error(self.engine.name(), e),
        })
    }

    fn tokenizer_info(&self) -> Option<TokenizerInfo> {
        let codec = self.engine.codec();
        let named = |t: &str| (!t.is_empty()).then(|| t.to_string());
        // An HF `tokenizer_config.json` may write a token as an AddedToken object.
        let special = |key: &str| match codec.special_tokens.get(key) {
            Some(serde_json::Value::String(t)) => named(t),
            Some(serde_json::Value::Object(o)) => o
                .get("content")
                .and_then(serde_json::Value::as_str)
                .and_then(named),
            _ => None,
        };
        Some(TokenizerInfo {
            bos_token: named(codec.template.bos_token()),
            eos_token: named(codec.template.eos_token()),
            pad_token: special("pad_token"),
            unk_token: special("unk_token"),
            chat_template: codec
                .template
                .is_present()
                .then(|| codec.template.source().to_string()),
            model_max_length: self.engine.context_length(),
            add_bos_token: self.engine.added_bos().ok().flatten().is_some(),
        })
    }
}

impl LocalBackend {
    /// Generates `req.n` continuations of `prompt_ids`: (choices, completion tokens, cached
    /// prompt tokens). Empty continuations are answers here (a base model may end at once).
    async fn continue_ids(
        &self,
        req: &CompletionRequest,
        prompt_ids: &[u32],
        sink: Option<&super::DeltaSink>,
    ) -> Result<(Vec<Choice>, u64, u64), LlmError> {
        let stream = sink.cloned().map(|sink| -> TokenSink {
            Box::new(move |i: usize, text: &str, lps: &[TokenLogprob]| {
                sink.send_with_logprobs(i, text, lps)
            })
        });
        // A raw completion decodes as the model does: it may end at its first token.
        let params = GenParams {
            eos: EosRule::Stop,
            ..req.sampling().gen_params()
        };
        let (mut job, rx) = self.generation(params, req.strict_max_tokens, stream);
        job.prompt_ids = Some(prompt_ids.to_vec());
        Counters::add(&self.counters.queued, 1);
        let out = self.run_job("completion", job, rx).await?;
        let completion_tokens = out.samples.iter().map(|s| s.tokens as u64).sum();
        let cached = out.cached_tokens as u64;
        Ok((choices_of(out.samples), completion_tokens, cached))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::{ChatBackend, ChatMessage, ChatRequest};

    /// The tiny random llama written to a temporary directory and loaded as a local backend
    /// (keep the directory while the backend is used).
    async fn tiny_backend() -> (tempfile::TempDir, Arc<LocalBackend>) {
        use crate::engine::tiny::{write_tiny_llama, TinySpec};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny-llama");
        write_tiny_llama(&path, &TinySpec::default()).unwrap();
        let backend = LocalBackend::load(&ModelSpec::HfDir(path), &LoadOptions::default())
            .await
            .unwrap();
        (dir, backend)
    }

    /// A short greedy chat request.
    fn greedy(max_tokens: usize) -> ChatRequest {
        ChatRequest::new(vec![ChatMessage::user("one two three")])
            .temperature(0.0)
            .max_tokens(max_tokens)
    }

    /// Holds the model worker for a while: requests sent meanwhile queue, and it finds them
    /// all at once.
    async fn hold_worker() -> tokio::task::JoinHandle<Result<(), String>> {
        let hold = tokio::spawn(on_worker("hold", || {
            std::thread::sleep(std::time::Duration::from_millis(300))
        }));
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        hold
    }

    /// A request held for room in the key/value budget whose client leaves is answered as
    /// cancelled at the next round and no longer holds the queue: the request behind it
    /// starts once there is room. (Driven on a scheduler of its own, round by round: through
    /// the worker, the tiny model's requests finish before a client could leave.)
    #[tokio::test]
    async fn a_held_request_whose_client_leaves_frees_the_queue() {
        let (_dir, backend) = tiny_backend().await;
        let req = greedy(8);
        let engine = backend.engine();
        let prefill = engine.begin_prefill(&engine.encode_chat(&req.messages).unwrap());
        let one = engine.kv_reservation(&prefill.unwrap(), 1, 8);
        backend.set_kv_budget_bytes(one + one / 2);
        let before = backend.stats();
        let (first, second, third) = (
            backend.job(&req, None).unwrap(),
            backend.job(&req, None).unwrap(),
            backend.job(&req, None).unwrap(),
        );
        let (mut first_rx, mut second_rx, mut third_rx) = (first.1, second.1, third.1);
        let second_cancel = second.0.cancel.clone();
        let mut scheduler = crate::engine::scheduler::Scheduler::default();
        for job in [first.0, second.0, third.0] {
            scheduler.pending.push_back(Box::new(job));
        }
        scheduler.admit();
        assert_eq!(scheduler.prefilling.len(), 1, "room for one request");
        assert!(scheduler.held.is_some(), "the second waits for room");
        assert_eq!(scheduler.pending.len(), 1, "the third waits behind it");
        assert_eq!(backend.stats().kv_waits, before.kv_waits + 1);

        second_cancel.cancel();
        scheduler.admit();
        let answer = second_rx.try_recv().expect("answered at once");
        let err = answer.expect_err("a cancelled request has no output");
        assert!(
            matches!(err, EngineError::Cancelled { .. }),
            "answered as cancelled: {err}"
        );
        assert_eq!(backend.stats().cancelled, before.cancelled + 1);
        // The third took its place (the first still runs), and starts once the first is done.
        assert!(scheduler.held.is_some() && scheduler.pending.is_empty());
        let mut rounds = 0;
        let third = loop {
            match third_rx.try_recv() {
                Ok(answer) => break answer.expect("the third request's output"),
                Err(_) => {
                    scheduler.admit();
                    scheduler.prefill_round();
                    scheduler.step();
                    rounds += 1;
                    assert!(rounds < 100, "the third request never finished");
                }
            }
        };
        let first = first_rx.try_recv().expect("the first finished before it");
        let alone = backend.chat(&req).await.unwrap();
        assert_eq!(first.unwrap().samples[0].text, alone.choices[0].content);
        assert_eq!(third.samples[0].text, alone.choices[0].content);
        assert_eq!(backend.stats().kv_waits, before.kv_waits + 2);
    }

    /// Calls of other kinds queued together (loading models, say) take one round each while
    /// a generation decodes, a decode step between two, instead of all running before its
    /// next token.
    #[tokio::test]
    async fn other_calls_take_turns_with_decode_steps() {
        let (_dir, backend) = tiny_backend().await;
        let req = greedy(12);
        let alone = backend.chat(&req).await.unwrap();
        assert!(alone.usage.completion_tokens >= 5, "{:?}", alone.usage);
        let hold = hold_worker().await;
        let chat = backend.chat(&req);
        let calls = (0..4).map(|_| {
            let counters = backend.counters.clone();
            on_worker("count", move || {
                counters.decode_steps.load(Ordering::Relaxed)
            })
        });
        let (reply, seen) = futures::join!(chat, futures::future::join_all(calls));
        hold.await.unwrap().unwrap();
        assert_eq!(reply.unwrap().choices, alone.choices);
        let seen: Vec<u64> = seen.into_iter().map(Result::unwrap).collect();
        assert!(
            seen.windows(2).all(|w| w[1] > w[0]),
            "decode steps seen by four calls queued together: {seen:?}"
        );
    }

    /// Scoring options is a job of the scheduler: beside a decoding generation its prompt is
    /// prefilled a chunk a round (the generation's tokens go on meanwhile) and scores as the
    /// engine does alone; the generation's reply does not change.
    #[tokio::test]
    async fn scoring_is_prefilled_in_chunks_beside_decoding() {
        let (_dir, backend) = tiny_backend().await;
        let messages = vec![ChatMessage::user("one two three four ".repeat(12))];
        let options: Vec<String> = ["1", "2", "3"].iter().map(|o| o.to_string()).collect();
        let engine = backend.engine().clone();
        let expected = engine.option_probs(&messages, "Score: ", &options).unwrap();
        let chat_alone = backend.chat(&greedy(12)).await.unwrap();
        engine.clear_prefix_cache();
        backend.set_prefill_chunk(8);
        let before = backend.stats();
        let req = greedy(12);
        let hold = hold_worker().await;
        let (chat, scored) = futures::join!(
            backend.chat(&req),
            backend.option_probs(&messages, "Score: ", &options)
        );
        hold.await.unwrap().unwrap();
        assert_eq!(chat.unwrap().choices, chat_alone.choices);
        let scored = scored.unwrap();
        // The tiny model's f32 weights round differently in passes of other sizes (the int8
        // ones do not, see the model tests): equal to float noise.
        for (got, want) in scored.probs.iter().zip(&expected.probs) {
            assert!(
                (got - want).abs() < 1e-5,
                "{:?} vs {:?}",
                scored.probs,
                expected.probs
            );
        }
        assert_eq!(scored.prompt_tokens, expected.prompt_tokens);
        let after = backend.stats();
        let passes = after.prefill_passes - before.prefill_passes;
        // 8 positions a pass while the generation decodes (the rest whole once it is done):
        // prefilled whole on arrival it would have taken one or two.
        assert!(
            passes >= 8,
            "a {}-token prompt beside a 12-token generation in {passes} passes",
            expected.prompt_tokens
        );
        assert_eq!(
            after.started - before.started,
            1,
            "scoring is not a chat request"
        );
    }

    /// Requests whose prompt is cached need no prefill: queued together, they join the decode
    /// batch in one round (not one per round behind each other) and step together.
    #[tokio::test]
    async fn cached_prompts_join_the_batch_together() {
        let (_dir, backend) = tiny_backend().await;
        let max_tokens = 12;
        let req = greedy(max_tokens);
        // Warms the prefix cache with the prompt.
        let first = backend.chat(&req).await.unwrap();
        let before = backend.stats();
        // The worker is held while the requests queue, so it finds them all at once.
        let hold = hold_worker().await;
        let replies = futures::future::join_all((0..6).map(|_| backend.chat(&req))).await;
        hold.await.unwrap().unwrap();
        for r in replies {
            let r = r.unwrap();
            assert_eq!(r.choices[0].content, first.choices[0].content);
            assert_eq!(r.usage.cached_prompt_tokens, r.usage.prompt_tokens);
        }
        let steps = backend.stats().decode_steps - before.decode_steps;
        // One per token when all six step together (one request a round late: one more);
        // admitted one per round they took 17.
        assert!(
            steps <= max_tokens as u64 + 1,
            "6 cached requests of {} tokens took {steps} decode steps",
            first.usage.completion_tokens
        );
        assert_eq!(backend.stats().prefill_passes, before.prefill_passes);
    }

    /// With room in the key/value budget for one request, three that arrive together run
    /// one after another (each with the reply it gets alone); one whose reservation alone
    /// exceeds the budget is refused with a `max_tokens` error naming the budget.
    #[tokio::test]
    async fn requests_wait_for_room_in_the_kv_budget() {
        let (_dir, backend) = tiny_backend().await;
        let max_tokens = 8;
        let req = greedy(max_tokens);
        let alone = backend.chat(&req).await.unwrap();
        let engine = backend.engine();
        let prompt = engine.encode_chat(&req.messages).unwrap();
        let prefill = engine.begin_prefill(&prompt).unwrap();
        let one = engine.kv_reservation(&prefill, 1, max_tokens);
        drop(prefill);
        assert!(
            backend.kv_budget_bytes() >= 16 * one,
            "the default holds 16 of them"
        );

        backend.set_kv_budget_bytes(one + one / 2);
        let before = backend.stats();
        let hold = hold_worker().await;
        let replies = futures::future::join_all((0..3).map(|_| backend.chat(&req))).await;
        hold.await.unwrap().unwrap();
        for r in replies {
            assert_eq!(r.unwrap().choices[0].content, alone.choices[0].content);
        }
        let steps = backend.stats().decode_steps - before.decode_steps;
        assert_eq!(backend.stats().kv_waits - before.kv_waits, 2);
        let each = alone.usage.completion_tokens.saturating_sub(1);
        // Together they would step `each` times (plus one for a late joiner).
        assert!(
            steps >= 3 * each,
            "3 requests that fit the budget one at a time took {steps} steps, {each} each"
        );

        backend.set_kv_budget_bytes(one - 1);
        match backend.chat(&req).await {
            Err(LlmError::ContextExceeded { param, message, .. }) => {
                assert_eq!(param, "max_tokens");
                assert!(message.contains("key/value"), "{message}");
            }
            other => panic!("a request over the budget alone: {other:?}"),
        }
        // The queue is not stuck behind it.
        backend.set_kv_budget_bytes(one);
        assert_eq!(
            backend.chat(&req).await.unwrap().choices[0].content,
            alone.choices[0].content
        );
    }

    /// Requests that arrive together are prefilled in one forward pass, and each gets the
    /// reply it gets alone (greedy).
    #[tokio::test]
    async fn prompts_arriving_together_share_one_prefill_pass() {
        let (_dir, backend) = tiny_backend().await;
        let reqs: Vec<ChatRequest> = ["one two", "three four five", "six", "seven eight"]
            .iter()
            .map(|t| {
                ChatRequest::new(vec![ChatMessage::user(*t)])
                    .temperature(0.0)
                    .max_tokens(8)
            })
            .collect();
        let mut alone = Vec::new();
        for r in &reqs {
            alone.push(backend.chat(r).await.unwrap().choices[0].content.clone());
            backend.engine().clear_prefix_cache();
        }
        let before = backend.stats();
        let hold = hold_worker().await;
        let replies = futures::future::join_all(reqs.iter().map(|r| backend.chat(r))).await;
        hold.await.unwrap().unwrap();
        for (r, want) in replies.into_iter().zip(&alone) {
            let r = r.unwrap();
            assert_eq!(&r.choices[0].content, want);
            assert_eq!(r.usage.cached_prompt_tokens, 0);
        }
        let passes = backend.stats().prefill_passes - before.prefill_passes;
        assert_eq!(
            passes, 1,
            "4 prompts arriving together took {passes} prefill passes"
        );
    }
}
