//! The local candle engine as a [`ChatBackend`]. All local model work in a process runs on one
//! worker thread, fed by a queue, so two models never compete for the same cores (candle's CPU
//! kernels spin-wait). Generations are batched continuously: a request joins the
//! running decode batch at the next token boundary while the batch has room
//! ([`LocalBackend::set_max_batch`]) and leaves it when done or abandoned. A model spec loaded
//! twice with the same options is loaded once.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, OnceLock, Weak};

use async_trait::async_trait;

pub use super::engine::LoadOptions;
use super::engine::{
    option_probs_after, CancelFlag, Engine, EngineError, GenOutput, GenParams, GenState, Prefill,
    TokenSink,
};
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

/// Work for the model thread: a plain job (loading, scoring) runs on its own; generations
/// join the running decode batch.
enum Job {
    Run(Box<dyn FnOnce() + Send>),
    Generate(Box<GenJob>),
}

/// One chat request for the scheduler.
struct GenJob {
    engine: Arc<Engine>,
    messages: Vec<ChatMessage>,
    params: GenParams,
    strict_max_tokens: bool,
    cancel: CancelFlag,
    counters: Arc<Counters>,
    /// Rows this request's backend lets the batch hold (see [`LocalBackend::set_max_batch`]).
    max_batch: usize,
    /// Key/value bytes this request's backend lets requests in flight reserve (see
    /// [`LocalBackend::set_kv_budget_bytes`]).
    kv_budget: usize,
    /// Prompt positions prefilled per round while others decode (0: the whole prompt).
    prefill_chunk: usize,
    stream: Option<TokenSink>,
    task: Task,
}

/// Where a [`GenJob`]'s answer arrives.
type GenReply = tokio::sync::oneshot::Receiver<Result<GenOutput, EngineError>>;

/// What a job's prefill is for, and where its answer goes.
enum Task {
    /// A chat generation: the prompt decodes in the batch.
    Generate(tokio::sync::oneshot::Sender<Result<GenOutput, EngineError>>),
    /// Scoring options ([`Engine::option_probs`]): the prompt's next-token distribution over
    /// each option's first token, answered once the prompt is in; it never decodes.
    Score {
        prompt: Vec<u32>,
        option_ids: Vec<u32>,
        reply: tokio::sync::oneshot::Sender<Result<OptionProbs, EngineError>>,
    },
}

impl GenJob {
    /// Rows of the decode batch the job takes (a scoring job never decodes).
    fn rows(&self) -> usize {
        match self.task {
            Task::Generate(_) => self.params.n,
            Task::Score { .. } => 0,
        }
    }
}

impl Task {
    fn fail(self, e: EngineError) {
        match self {
            Task::Generate(reply) => drop(reply.send(Err(e))),
            Task::Score { reply, .. } => drop(reply.send(Err(e))),
        }
    }
}

/// Rows (samples being decoded, over all requests) one decode batch holds unless a backend
/// says otherwise: enough for the concurrency of a pipeline turn (N candidates × S futures)
/// while a step of the default model stays a small fraction of a second.
pub const DEFAULT_MAX_BATCH: usize = 16;

/// Prompt positions a request's prefill runs per scheduler round while other generations
/// are decoding, unless a backend says otherwise ([`LocalBackend::set_prefill_chunk`]): a
/// long prompt then delays their next token by one chunk's time instead of its whole
/// prefill (with nothing decoding, a prompt is prefilled at once). The cache and logits are
/// the same bits whatever the chunk size (`cpu_attention`).
pub const PREFILL_CHUNK: usize = 256;

/// The key/value memory requests in flight may reserve unless a backend says otherwise:
/// [`DEFAULT_MAX_BATCH`] rows at the model's full context, but at most half the memory the
/// process could still take once the model was loaded ([`super::memory::available`]: the
/// system's, or its cgroup's where that is less; the prompt cache has its own budget).
fn default_kv_budget(engine: &Engine) -> usize {
    let full = DEFAULT_MAX_BATCH
        .saturating_mul(engine.context_length())
        .saturating_mul(engine.kv_bytes_per_position());
    super::memory::available().map_or(full, |m| full.min(m / 2))
}

fn worker() -> &'static mpsc::Sender<Job> {
    static WORKER: OnceLock<mpsc::Sender<Job>> = OnceLock::new();
    WORKER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("collabllm-model".into())
            .spawn(move || Scheduler::default().run(&rx))
            .expect("spawning the model worker thread");
        tx
    })
}

/// A generation in the decode batch, and the key/value bytes it reserved.
struct Active {
    job: Box<GenJob>,
    state: GenState,
    reserved: usize,
}

/// A request admitted to the batch whose prompt is being prefilled, and the key/value bytes
/// it reserved ([`Engine::kv_reservation`]).
struct Prefilling {
    job: Box<GenJob>,
    prefill: Prefill,
    reserved: usize,
}

/// Continuous batching on the model thread: requests are admitted in order while the batch
/// has room, their prompts prefilled one chunk per round ([`PREFILL_CHUNK`], oldest first)
/// between decode steps, and they join the running batch at the next token boundary and
/// leave when done or when their caller leaves; one decode step per loaded model and round,
/// and at most one call of another kind (loading a model). Scoring options
/// ([`ChatBackend::option_probs`]) is a job like a generation that never decodes.
#[derive(Default)]
struct Scheduler {
    pending: std::collections::VecDeque<Box<GenJob>>,
    /// The oldest queued request, begun (encoded, its stored prefix found) but waiting until
    /// the requests in flight leave room in the key/value budget for its reservation; the
    /// queue waits behind it.
    held: Option<Prefilling>,
    prefilling: std::collections::VecDeque<Prefilling>,
    active: Vec<Active>,
    /// Calls of other kinds (loading a model) waiting for their round.
    runs: std::collections::VecDeque<Box<dyn FnOnce() + Send>>,
}

impl Scheduler {
    fn run(mut self, rx: &mpsc::Receiver<Job>) {
        loop {
            let idle = self.active.is_empty()
                && self.pending.is_empty()
                && self.prefilling.is_empty()
                && self.held.is_none()
                && self.runs.is_empty();
            let first = if idle {
                match rx.recv() {
                    Ok(job) => Some(job),
                    Err(_) => return,
                }
            } else {
                None
            };
            for job in first.into_iter().chain(rx.try_iter()) {
                match job {
                    Job::Run(f) => self.runs.push_back(f),
                    Job::Generate(g) => self.pending.push_back(g),
                }
            }
            // One call of another kind a round: each may take a while (loading a model), so
            // several in a row would stall every decoding request for all of them. A
            // panicking call must not take the thread down with it; its caller sees the
            // dropped reply channel.
            if let Some(f) = self.runs.pop_front() {
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
            }
            self.admit();
            self.prefill_round();
            self.step();
        }
    }

    fn rows_in_use(&self) -> usize {
        let decoding = self.active.iter().map(|a| a.state.rows());
        let prefilling = self.prefilling.iter().map(|p| p.job.rows());
        decoding.chain(prefilling).fold(0, usize::saturating_add)
    }

    /// Key/value bytes the requests in flight reserved.
    fn kv_in_use(&self) -> usize {
        let decoding = self.active.iter().map(|a| a.reserved);
        decoding
            .chain(self.prefilling.iter().map(|p| p.reserved))
            .fold(0, usize::saturating_add)
    }

    /// Starts queued requests, oldest first, while their rows fit the batch (a request
    /// larger than the cap runs when the batch is empty) and their key/value reservations
    /// fit the budget beside those in flight (a request whose reservation alone exceeds it
    /// is refused). Requests whose caller left are skipped.
    fn admit(&mut self) {
        loop {
            let (next, waited) = match self.held.take() {
                Some(held) => (held, true),
                None => match self.begin_next() {
                    Some(Ok(next)) => (next, false),
                    Some(Err(())) => continue,
                    None => return,
                },
            };
            if next.job.cancel.is_cancelled() {
                let stage = if waited {
                    "while it waited for room in the key/value budget"
                } else {
                    "before its prefill"
                };
                retire_unstarted(*next.job, stage);
                continue;
            }
            let budget = next.job.kv_budget;
            if next.reserved > budget {
                let err = over_budget(&next);
                next.job.task.fail(err);
                continue;
            }
            let in_use = self.kv_in_use();
            if in_use.saturating_add(next.reserved) > budget {
                if !waited {
                    Counters::add(&next.job.counters.kv_waits, 1);
                    tracing::debug!(
                        model = next.job.engine.name(),
                        reserved_mib = next.reserved >> 20,
                        in_use_mib = in_use >> 20,
                        budget_mib = budget >> 20,
                        "a request waits for room in the key/value budget"
                    );
                }
                self.held = Some(next);
                return;
            }
            self.prefilling.push_back(next);
        }
    }

    /// Begins the oldest queued request if its rows fit the batch: `None` when there is
    /// none or it must wait, `Err` when it was answered instead (its caller left, or its
    /// prompt was refused).
    fn begin_next(&mut self) -> Option<Result<Prefilling, ()>> {
        let job = self.pending.front()?;
        if job.cancel.is_cancelled() {
            let job = self.pending.pop_front().expect("front exists");
            let err = skip(&job);
            job.task.fail(err);
            return Some(Err(()));
        }
        let used = self.rows_in_use();
        if used > 0 && used.saturating_add(job.rows()) > job.max_batch {
            return None;
        }
        let job = self.pending.pop_front().expect("front exists");
        let began = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let prefill = begin(&job)?;
            let (n, max_new) = (job.params.n, job.params.max_new_tokens);
            let reserved = job.engine.kv_reservation(&prefill, n, max_new);
            Ok((prefill, reserved))
        }));
        match began {
            Ok(Ok((prefill, reserved))) => Some(Ok(Prefilling {
                job,
                prefill,
                reserved,
            })),
            Ok(Err(e)) => {
                job.task.fail(e);
                Some(Err(()))
            }
            Err(_) => Some(Err(())), // the reply channel drops: "the model worker panicked"
        }
    }

    /// Up to one chunk of prefill work (one whole prompt when nothing is decoding or the
    /// chunk size is 0, with more prompts up to a chunk behind it), oldest request first, in
    /// one forward pass for all the requests it covers; finished prefills join the decode
    /// batch. Requests whose prompt is already cached cost nothing here, so as many of them
    /// join in one round as are waiting.
    fn prefill_round(&mut self) {
        // Callers that left before their prompt was in are answered and forgotten.
        let (left, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.prefilling)
            .into_iter()
            .partition(|p| p.job.cancel.is_cancelled());
        self.prefilling = waiting.into();
        for p in left {
            retire_unstarted(*p.job, "during its prefill");
        }
        let Some(front) = self.prefilling.front() else {
            return;
        };
        let engine = front.job.engine.clone();
        let chunk = front.job.prefill_chunk;
        // The front requests of this model.
        let needs: Vec<usize> = self
            .prefilling
            .iter()
            .take_while(|p| Arc::ptr_eq(&p.job.engine, &engine))
            .map(|p| p.prefill.remaining())
            .collect();
        let decoding = !self.active.is_empty() && chunk != 0;
        let sizes = chunk_sizes(&needs, chunk, decoding);
        let taken = sizes.len();
        if sizes.iter().any(|&n| n > 0) {
            let backends = self.prefilling.iter().take(taken).map(|p| &p.job.counters);
            Counters::once_each(backends, |c| &c.prefill_passes);
        }
        let mut prefills: Vec<&mut Prefill> = self
            .prefilling
            .iter_mut()
            .take(taken)
            .map(|p| &mut p.prefill)
            .collect();
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            engine.prefill_chunks(&mut prefills, &sizes)
        }));
        drop(prefills);
        let batch: Vec<Prefilling> = self.prefilling.drain(..taken).collect();
        match ran {
            Ok(Ok(finished)) => {
                let mut unfinished = Vec::new();
                for (p, done) in batch.into_iter().zip(finished) {
                    if done {
                        self.start(p);
                    } else {
                        unfinished.push(p);
                    }
                }
                // Unfinished prefills stay at the front, in order.
                for p in unfinished.into_iter().rev() {
                    self.prefilling.push_front(p);
                }
            }
            Ok(Err(e)) if batch.len() == 1 => {
                if let Some(p) = batch.into_iter().next() {
                    p.job.task.fail(e);
                }
            }
            Ok(Err(e)) => {
                // The pass failed: every prefill in it fails with it.
                let message = e.to_string();
                for p in batch {
                    p.job.task.fail(EngineError::Generate {
                        model: engine.name().to_string(),
                        message: message.clone(),
                    });
                }
            }
            Err(_) => {} // the reply channels drop: "the model worker panicked"
        }
    }

    /// A request whose prompt is in joins the decode batch (or is answered with its error); a
    /// scoring job is answered from its prompt's logits.
    fn start(&mut self, p: Prefilling) {
        let Prefilling {
            mut job,
            prefill,
            reserved,
        } = p;
        if matches!(job.task, Task::Score { .. }) {
            answer_score(*job, &prefill);
            return;
        }
        let started = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            job.engine.start_prefilled(prefill, &job.params)
        }));
        match started {
            Ok(Ok(mut state)) => {
                if let Some(sink) = job.stream.take() {
                    state.set_stream(sink);
                }
                self.active.push(Active {
                    job,
                    state,
                    reserved,
                });
            }
            Ok(Err(e)) => job.task.fail(e),
            Err(_) => {}
        }
    }

    /// One decode step for every model with generations in flight; finished and abandoned
    /// generations leave the batch and are answered.
    fn step(&mut self) {
        self.retire_done();
        if self.active.is_empty() {
            return;
        }
        // Group by model: rows of different models never share a forward pass.
        let mut engines: Vec<Arc<Engine>> = Vec::new();
        for a in &self.active {
            if !engines.iter().any(|e| Arc::ptr_eq(e, &a.job.engine)) {
                engines.push(a.job.engine.clone());
            }
        }
        for engine in engines {
            let backends = self
                .active
                .iter()
                .filter(|a| Arc::ptr_eq(&a.job.engine, &engine))
                .map(|a| &a.job.counters);
            Counters::once_each(backends, |c| &c.decode_steps);
            let mut states: Vec<&mut GenState> = self
                .active
                .iter_mut()
                .filter(|a| Arc::ptr_eq(&a.job.engine, &engine))
                .map(|a| &mut a.state)
                .collect();
            let stepped =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| engine.step(&mut states)));
            drop(states);
            let failure = match stepped {
                Ok(Ok(())) => continue,
                Ok(Err(e)) => Some(e.to_string()),
                Err(_) => None,
            };
            // The batch's forward pass failed: every generation in it fails with it.
            let (failed, kept): (Vec<Active>, Vec<Active>) = std::mem::take(&mut self.active)
                .into_iter()
                .partition(|a| Arc::ptr_eq(&a.job.engine, &engine));
            self.active = kept;
            for a in failed {
                if let Some(message) = &failure {
                    a.job.task.fail(EngineError::Generate {
                        model: engine.name().to_string(),
                        message: message.clone(),
                    });
                }
            }
        }
        self.retire_done();
    }

    /// Answers the generations that finished or whose caller left (at the token boundary).
    fn retire_done(&mut self) {
        let mut i = 0;
        while i < self.active.len() {
            let a = &self.active[i];
            if a.job.cancel.is_cancelled() || a.state.is_finished() {
                retire(self.active.remove(i));
            } else {
                i += 1;
            }
        }
    }
}

/// The answer to a request whose caller left before it started.
fn skip(job: &GenJob) -> EngineError {
    Counters::add(&job.counters.skipped, 1);
    tracing::info!(
        model = job.engine.name(),
        "skipped a queued request: its client left"
    );
    job.engine.cancelled(0)
}

/// The refusal of a request whose key/value reservation alone exceeds its budget.
fn over_budget(p: &Prefilling) -> EngineError {
    let job = &p.job;
    let prompt = p.prefill.prompt_len();
    EngineError::KvBudget {
        model: job.engine.name().to_string(),
        need_mib: p.reserved.div_ceil(1 << 20),
        budget_mib: job.kv_budget >> 20,
        prompt,
        max_tokens: job
            .engine
            .new_tokens_after(prompt, job.params.max_new_tokens),
        n: job.params.n,
    }
}

/// Encodes a request and begins its prefill (refused when a strict `max_tokens` does not fit
/// beside the prompt).
fn begin(job: &GenJob) -> Result<Prefill, EngineError> {
    let engine = &job.engine;
    if let Task::Score { prompt, .. } = &job.task {
        return engine.begin_prefill(prompt);
    }
    let prompt = engine.encode_chat(&job.messages)?;
    let context = engine.context_length();
    if job.strict_max_tokens && prompt.len() + job.params.max_new_tokens > context {
        return Err(EngineError::NoRoomForMaxTokens {
            model: engine.name().to_string(),
            prompt: prompt.len(),
            max_tokens: job.params.max_new_tokens,
            context,
        });
    }
    Counters::add(&job.counters.started, 1);
    engine.begin_prefill(&prompt)
}

/// Prompt positions each of the front prefills runs this round, in one forward pass (`needs`:
/// what each has left, in queue order, all of one model): with something decoding, `chunk`
/// in all; otherwise the first prompt whole and what is left of `chunk` after it (0: the first
/// prompt whole, alone). When the first prompt needs more than that, shorter ones behind it
/// go first, each whole, up to half a chunk in all: otherwise a long cold prompt would take
/// every round's budget while they wait; it still gets at least half a chunk a round. The
/// pass covers a prefix of the queue: the result's length, each prompt in it with positions
/// left given at least one, and the exact repeats (nothing left) just behind it taken along.
fn chunk_sizes(needs: &[usize], chunk: usize, decoding: bool) -> Vec<usize> {
    let Some(&front) = needs.first() else {
        return Vec::new();
    };
    let mut sizes = vec![0; needs.len()];
    let mut budget = if decoding { chunk } else { front.max(chunk) };
    if front > budget || (!decoding && front > chunk) {
        let mut allowance = chunk / 2;
        for (size, &need) in sizes.iter_mut().zip(needs).skip(1) {
            if need > 0 && need <= allowance {
                *size = need;
                allowance -= need;
                if decoding {
                    budget -= need;
                }
            }
        }
    }
    for (size, &need) in sizes.iter_mut().zip(needs) {
        if *size == 0 {
            *size = need.min(budget);
            budget -= *size;
        }
    }
    let last = sizes.iter().rposition(|&n| n > 0).unwrap_or(0);
    let taken = last + 1 + needs[last + 1..].iter().take_while(|&&n| n == 0).count();
    sizes.truncate(taken);
    for (size, &need) in sizes.iter_mut().zip(needs) {
        if need > 0 {
            *size = (*size).max(1);
        }
    }
    sizes
}

/// Answers a scoring job from its finished prefill.
fn answer_score(job: GenJob, prefill: &Prefill) {
    let GenJob { engine, task, .. } = job;
    let Task::Score {
        option_ids, reply, ..
    } = task
    else {
        return;
    };
    let out = prefill
        .logits()
        .map(|l| option_probs_after(prefill.prompt_len(), l, &option_ids))
        .ok_or_else(|| EngineError::Generate {
            model: engine.name().to_string(),
            message: "internal: a finished prefill without logits".into(),
        });
    let _ = reply.send(out);
}

/// Answers a request whose caller left after it began (its prompt encoded) but before it
/// decoded: `stage` says where it was.
fn retire_unstarted(job: GenJob, stage: &str) {
    Counters::add(&job.counters.cancelled, 1);
    tracing::info!(
        model = job.engine.name(),
        "generation stopped {stage}: its client left"
    );
    let err = job.engine.cancelled(0);
    job.task.fail(err);
}

/// Answers a generation that left the batch: finished, or stopped because its caller left.
fn retire(a: Active) {
    let Active { job, state, .. } = a;
    let out = if state.is_finished() {
        job.engine.finish(state)
    } else {
        let tokens = state.generated();
        Counters::add(&job.counters.cancelled, 1);
        Counters::add(&job.counters.cancelled_tokens, tokens as u64);
        tracing::info!(
            model = job.engine.name(),
            tokens,
            max_tokens = job.params.max_new_tokens,
            "generation stopped: its client left"
        );
        Err(job.engine.cancelled(tokens))
    };
    match job.task {
        Task::Generate(reply) => drop(reply.send(out)),
        // Never in the decode batch (answered at the end of its prefill).
        score @ Task::Score { .. } => score.fail(EngineError::Generate {
            model: job.engine.name().to_string(),
            message: "internal: a scoring job in the decode batch".into(),
        }),
    }
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
async fn on_worker<T: Send + 'static>(
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    worker()
        .send(Job::Run(Box::new(move || {
            let _ = tx.send(f());
        })))
        .map_err(|_| format!("{what}: the model worker has stopped"))?;
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
    /// Decode steps (a token sampled for every row of the batch, then its forward pass unless
    /// every row finished) that advanced this backend's generations.
    pub decode_steps: u64,
    /// Forward passes that ran prompt positions of this backend's requests (requests
    /// prefilled together share one).
    pub prefill_passes: u64,
    /// Requests that waited for room in the key/value budget before they started (see
    /// [`LocalBackend::set_kv_budget_bytes`]).
    pub kv_waits: u64,
}

#[derive(Debug, Default)]
struct Counters {
    queued: AtomicU64,
    started: AtomicU64,
    cancelled: AtomicU64,
    cancelled_tokens: AtomicU64,
    skipped: AtomicU64,
    decode_steps: AtomicU64,
    prefill_passes: AtomicU64,
    kv_waits: AtomicU64,
}

impl Counters {
    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Adds one to `field` of each backend's counters among `jobs`' (once per backend, however
    /// many of its jobs a forward pass held).
    fn once_each<'a>(
        jobs: impl Iterator<Item = &'a Arc<Counters>>,
        field: fn(&Counters) -> &AtomicU64,
    ) {
        let mut counted: Vec<&Arc<Counters>> = Vec::new();
        for c in jobs {
            if !counted.iter().any(|seen| Arc::ptr_eq(seen, c)) {
                Counters::add(field(c), 1);
                counted.push(c);
            }
        }
    }
    fn snapshot(&self) -> LocalStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        LocalStats {
            queued: get(&self.queued),
            started: get(&self.started),
            cancelled: get(&self.cancelled),
            cancelled_tokens: get(&self.cancelled_tokens),
            skipped: get(&self.skipped),
            decode_steps: get(&self.decode_steps),
            prefill_passes: get(&self.prefill_passes),
            kv_waits: get(&self.kv_waits),
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
        let params = GenParams {
            temperature: req.temperature,
            top_p: req.top_p,
            max_new_tokens: req.max_tokens,
            stop: req.stop.clone(),
            seed: req.seed,
            n: req.n,
            ignore_eos: false,
        };
        let (reply, rx) = tokio::sync::oneshot::channel();
        let mut job = self.scheduled(params, Task::Generate(reply));
        job.messages = req.messages.clone();
        job.strict_max_tokens = req.strict_max_tokens;
        job.stream = stream;
        Ok((job, rx))
    }

    /// A job of this backend (its limits, counters and a fresh cancel flag) for `task`, with
    /// no messages, stream or strict `max_tokens`.
    fn scheduled(&self, params: GenParams, task: Task) -> GenJob {
        GenJob {
            engine: self.engine.clone(),
            messages: Vec::new(),
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
            Some(Box::new(move |i: usize, text: &str| sink.send(i, text))),
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
            ignore_eos: false,
        };
        let task = Task::Score {
            prompt,
            option_ids,
            reply,
        };
        self.run_job("scoring", self.scheduled(params, task), rx)
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::test_util::tiny_backend;
    use crate::llm::{ChatBackend, ChatMessage, ChatRequest};

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
        let mut scheduler = Scheduler::default();
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

    /// A round's prefill sizes: in order up to the budget; short prompts behind a long one
    /// first, whole, up to half a chunk; the pass a prefix of the queue.
    #[test]
    fn chunk_sizes_let_short_prompts_past_a_long_one() {
        // In order while the front fits: as before.
        assert_eq!(chunk_sizes(&[100, 50, 400], 256, true), vec![100, 50, 106]);
        assert_eq!(chunk_sizes(&[300, 0, 0], 256, true), vec![256, 0, 0]);
        assert_eq!(chunk_sizes(&[256, 10, 0], 256, true), vec![256]);
        // A long front: the short ones behind it first, the front the rest.
        assert_eq!(chunk_sizes(&[8000, 20], 256, true), vec![236, 20]);
        assert_eq!(chunk_sizes(&[300, 0, 0, 5], 256, true), vec![251, 0, 0, 5]);
        assert_eq!(
            chunk_sizes(&[8000, 5000, 20, 30], 256, true),
            vec![206, 1, 20, 30]
        );
        assert_eq!(chunk_sizes(&[8000, 100, 100], 256, true), vec![156, 100]);
        // Nothing decoding: the front whole, the short ones beside it, the rest of the chunk.
        assert_eq!(chunk_sizes(&[8000, 20, 9000], 256, false), vec![8000, 20]);
        assert_eq!(chunk_sizes(&[100, 50, 400], 256, false), vec![100, 50, 106]);
        assert_eq!(chunk_sizes(&[8000, 20], 0, false), vec![8000]);
        assert_eq!(chunk_sizes(&[0, 0], 256, true), vec![0, 0]);
        assert!(chunk_sizes(&[], 256, true).is_empty());
        // Rounds: the 20-token prompt behind an 8000-token one is in after one, the front
        // keeps at least half a chunk a round however many short ones arrive.
        let mut needs = vec![8000, 20];
        let sizes = chunk_sizes(&needs, 256, true);
        needs = needs.iter().zip(&sizes).map(|(n, s)| n - s).collect();
        assert_eq!(needs, vec![7764, 0]);
        let many = [vec![7764], vec![10; 40]].concat();
        assert!(chunk_sizes(&many, 256, true)[0] >= 128);
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
