//! The scheduler of local generation: all local model work in a process runs on one worker
//! thread, fed by a queue, so two models never compete for the same cores. Generations are
//! batched continuously: a request joins the running decode batch at the next token boundary
//! while the batch has room and leaves it when done or abandoned; prompts are prefilled in
//! chunks beside the decoding rows, under a key/value budget. `llm::local` is the chat-backend
//! face of this queue.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, OnceLock};

use super::messages::{ChatMessage, OptionProbs};
use super::runtime::{
    option_probs_after, CancelFlag, Engine, EngineError, GenOutput, GenParams, GenState, Prefill,
    TokenSink,
};

/// Work for the model thread: a plain job (loading, scoring) runs on its own; generations
/// join the running decode batch.
pub(crate) enum Job {
    Run(Box<dyn FnOnce() + Send>),
    Generate(Box<GenJob>),
}

/// One chat request for the scheduler.
pub(crate) struct GenJob {
    pub(crate) engine: Arc<Engine>,
    pub(crate) messages: Vec<ChatMessage>,
    /// Token ids to continue as they are, instead of the chat prompt of `messages`.
    pub(crate) prompt_ids: Option<Vec<u32>>,
    pub(crate) params: GenParams,
    pub(crate) strict_max_tokens: bool,
    pub(crate) cancel: CancelFlag,
    pub(crate) counters: Arc<Counters>,
    /// Rows this request's backend lets the batch hold (see [`LocalBackend::set_max_batch`]).
    pub(crate) max_batch: usize,
    /// Key/value bytes this request's backend lets requests in flight reserve (see
    /// [`LocalBackend::set_kv_budget_bytes`]).
    pub(crate) kv_budget: usize,
    /// Prompt positions prefilled per round while others decode, `IDLE_PREFILL_CHUNKS` times
    /// as many while none do (0: the whole prompt at once).
    pub(crate) prefill_chunk: usize,
    pub(crate) stream: Option<TokenSink>,
    pub(crate) task: Task,
}

/// Where a [`GenJob`]'s answer arrives.
pub(crate) type GenReply = tokio::sync::oneshot::Receiver<Result<GenOutput, EngineError>>;

/// What a job's prefill is for, and where its answer goes.
pub(crate) enum Task {
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
/// prefill (with nothing decoding, [`IDLE_PREFILL_CHUNKS`] chunks a round). The cache and
/// logits are the same bits whatever the chunk size (`cpu_attention`).
pub const PREFILL_CHUNK: usize = 256;

/// Chunks a prompt prefills per round while nothing decodes: large passes keep the matrix
/// products efficient, and between rounds a request whose client left is dropped, so an
/// abandoned long prompt stops after at most this many chunks instead of running to its end.
pub const IDLE_PREFILL_CHUNKS: usize = 4;

/// The key/value memory requests in flight may reserve unless a backend says otherwise:
/// [`DEFAULT_MAX_BATCH`] rows at the model's full context, but at most half the memory the
/// process could still take once the model was loaded ([`super::memory::available`]: the
/// system's, or its cgroup's where that is less; the prompt cache has its own budget).
pub(crate) fn default_kv_budget(engine: &Engine) -> usize {
    let full = DEFAULT_MAX_BATCH
        .saturating_mul(engine.context_length())
        .saturating_mul(engine.kv_bytes_per_position());
    super::memory::available().map_or(full, |m| full.min(m / 2))
}

pub(crate) fn worker() -> &'static mpsc::Sender<Job> {
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
pub(crate) struct Active {
    job: Box<GenJob>,
    state: GenState,
    reserved: usize,
}

/// A request admitted to the batch whose prompt is being prefilled, and the key/value bytes
/// it reserved ([`Engine::kv_reservation`]).
pub(crate) struct Prefilling {
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
pub(crate) struct Scheduler {
    pub(crate) pending: std::collections::VecDeque<Box<GenJob>>,
    /// The oldest queued request, begun (encoded, its stored prefix found) but waiting until
    /// the requests in flight leave room in the key/value budget for its reservation; the
    /// queue waits behind it.
    pub(crate) held: Option<Prefilling>,
    pub(crate) prefilling: std::collections::VecDeque<Prefilling>,
    pub(crate) active: Vec<Active>,
    /// Calls of other kinds (loading a model) waiting for their round.
    pub(crate) runs: std::collections::VecDeque<Box<dyn FnOnce() + Send>>,
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
    pub(crate) fn admit(&mut self) {
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

    /// Up to one chunk of prefill work ([`IDLE_PREFILL_CHUNKS`] chunks of one prompt when
    /// nothing is decoding, the prompt whole when the chunk size is 0, with more prompts up to
    /// a chunk behind it; requests whose client left are dropped first), oldest request first, in
    /// one forward pass for all the requests it covers; finished prefills join the decode
    /// batch. Requests whose prompt is already cached cost nothing here, so as many of them
    /// join in one round as are waiting.
    pub(crate) fn prefill_round(&mut self) {
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
            for (p, &n) in self.prefilling.iter().zip(&sizes) {
                Counters::add(&p.job.counters.prefill_positions, n as u64);
            }
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
    pub(crate) fn step(&mut self) {
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
    let prompt = match &job.prompt_ids {
        Some(ids) => ids.clone(),
        None => engine.encode_chat(&job.messages)?,
    };
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
/// in all; otherwise the first prompt up to [`IDLE_PREFILL_CHUNKS`] chunks and what is left
/// of `chunk` after it (0: the first prompt whole, alone, so a client that leaves does not
/// stop it). When the first prompt needs more than that, shorter ones behind it go first,
/// each whole, up to half a chunk in all: otherwise a long cold prompt would take
/// every round's budget while they wait; it still gets at least half a chunk a round. The
/// pass covers a prefix of the queue: the result's length, each prompt in it with positions
/// left given at least one, and the exact repeats (nothing left) just behind it taken along.
pub(crate) fn chunk_sizes(needs: &[usize], chunk: usize, decoding: bool) -> Vec<usize> {
    let Some(&front) = needs.first() else {
        return Vec::new();
    };
    let mut sizes = vec![0; needs.len()];
    let idle = match chunk {
        0 => front,
        _ => front
            .min(chunk.saturating_mul(IDLE_PREFILL_CHUNKS))
            .max(chunk),
    };
    let mut budget = if decoding { chunk } else { idle };
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
pub(crate) struct CancelOnDrop(pub(crate) CancelFlag);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// Runs `f` on the model worker thread and waits for its result without blocking the runtime.
pub(crate) async fn on_worker<T: Send + 'static>(
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
    /// Prompt positions those passes ran (cached prefixes not counted).
    pub prefill_positions: u64,
    /// Requests that waited for room in the key/value budget before they started (see
    /// [`LocalBackend::set_kv_budget_bytes`]).
    pub kv_waits: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) queued: AtomicU64,
    pub(crate) started: AtomicU64,
    pub(crate) cancelled: AtomicU64,
    pub(crate) cancelled_tokens: AtomicU64,
    pub(crate) skipped: AtomicU64,
    pub(crate) decode_steps: AtomicU64,
    pub(crate) prefill_passes: AtomicU64,
    pub(crate) prefill_positions: AtomicU64,
    pub(crate) kv_waits: AtomicU64,
}

impl Counters {
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
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
    pub(crate) fn snapshot(&self) -> LocalStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        LocalStats {
            queued: get(&self.queued),
            started: get(&self.started),
            cancelled: get(&self.cancelled),
            cancelled_tokens: get(&self.cancelled_tokens),
            skipped: get(&self.skipped),
            decode_steps: get(&self.decode_steps),
            prefill_passes: get(&self.prefill_passes),
            prefill_positions: get(&self.prefill_positions),
            kv_waits: get(&self.kv_waits),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        // Nothing decoding: the front up to IDLE_PREFILL_CHUNKS chunks (so a request whose
        // client left stops between them), the short ones beside it, the rest of the chunk.
        assert_eq!(chunk_sizes(&[8000, 20, 9000], 256, false), vec![1024, 20]);
        assert_eq!(chunk_sizes(&[1000, 20], 256, false), vec![1000, 20]);
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
}
