//! The compute threads of a forward pass's small parallel loops: helpers that spin between
//! loops instead of sleeping.
//!
//! A decode step of 16 requests runs ~200 parallel loops (every projection, the attention of
//! every layer), each 20–100 µs. Rayon's idle workers yield for a few dozen rounds and then
//! sleep; on this VM a sleeping thread takes tens of microseconds to wake, so the loop that
//! wakes it runs mostly on the calling thread. Profiled at 16 clients: each compute thread
//! was off its core or yielding for ~25 % of a step. The helpers here spin for
//! [`SPIN`] after each loop (yielding the core to anything else runnable), then park; a loop
//! finds them awake during a forward pass. One loop at a time: a caller that finds the team
//! busy (another thread's loop) falls back to rayon.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long a helper stays awake after its last loop: longer than the gaps between a
/// forward pass's loops (and between decode steps), short enough not to hold a core long
/// when inference stops.
const SPIN: Duration = Duration::from_millis(2);

/// Spins between a helper's yields of its core while it waits for a loop (~20 µs): often
/// enough that a thread with work (a server's) waits little for the core, rare enough that
/// the next loop seldom finds the helper inside the system call. Every 64 spins (~1.4 µs),
/// 16-request decode steps took 1.8 % and 3.4 % longer in two runs of three, one request's
/// 1.7 % and 3.0 % (medians, steps alternating in one process).
const YIELD_EVERY: u32 = 1024;

/// One parallel loop: `f(i)` for `i` in `0..n`, indices claimed from `next`.
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    n: usize,
    next: AtomicUsize,
    panicked: AtomicBool,
}

impl Job<'_> {
    fn run(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.n {
                return;
            }
            if catch_unwind(AssertUnwindSafe(|| (self.f)(i))).is_err() {
                self.panicked.store(true, Ordering::Relaxed);
            }
        }
    }
}

struct Team {
    /// The loop in progress (a `Job` on its caller's stack), or null.
    job: AtomicPtr<Job<'static>>,
    /// Bumped for each loop, so that a helper joins each loop once.
    generation: AtomicU64,
    /// Helpers inside `job`: its caller returns only once this is 0 with `job` null.
    inside: AtomicUsize,
    /// Held by the thread whose loop the team runs.
    busy: AtomicBool,
    /// Parked helpers, and what they park on.
    parked: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    helpers: usize,
}

fn team() -> &'static Team {
    static TEAM: OnceLock<&'static Team> = OnceLock::new();
    TEAM.get_or_init(|| {
        let helpers = compute_threads().saturating_sub(1);
        let team: &'static Team = Box::leak(Box::new(Team {
            job: AtomicPtr::new(std::ptr::null_mut()),
            generation: AtomicU64::new(0),
            inside: AtomicUsize::new(0),
            busy: AtomicBool::new(false),
            parked: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            helpers,
        }));
        for i in 0..helpers {
            // A helper that cannot start leaves the loops to the others (and the caller).
            let _ = std::thread::Builder::new()
                .name(format!("collabllm-compute-{i}"))
                .spawn(move || team.help());
        }
        team
    })
}

impl Team {
    fn help(&self) {
        let mut seen = 0u64;
        loop {
            let since = Instant::now();
            let mut spins = 0u32;
            // Spin (then yield) until a new loop is published, or park after SPIN.
            loop {
                let generation = self.generation.load(Ordering::SeqCst);
                if generation != seen {
                    seen = generation;
                    self.join();
                    break;
                }
                spins += 1;
                if spins.is_multiple_of(YIELD_EVERY) {
                    if since.elapsed() > SPIN {
                        self.park(seen);
                        break;
                    }
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
        }
    }

    /// Runs the published loop's indices, if it is still open.
    fn join(&self) {
        self.inside.fetch_add(1, Ordering::SeqCst);
        let job = self.job.load(Ordering::SeqCst);
        if !job.is_null() {
            // SAFETY: the caller keeps its job alive until `inside` is back to 0 after it
            // cleared `job`; this helper counted itself in before reading `job` (both SeqCst),
            // so either it read null or the caller waits for it.
            unsafe { (*job).run() };
        }
        self.inside.fetch_sub(1, Ordering::SeqCst);
    }

    fn park(&self, seen: u64) {
        let mut guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.parked.fetch_add(1, Ordering::SeqCst);
        while self.generation.load(Ordering::SeqCst) == seen {
            guard = self.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
        }
        self.parked.fetch_sub(1, Ordering::SeqCst);
    }

    fn run(&self, f: &(dyn Fn(usize) + Sync), n: usize) {
        let job = Job {
            f,
            n,
            next: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
        };
        // SAFETY: the pointer is cleared below, and this waits for every helper that may
        // have read it, before `job` goes out of scope.
        let ptr = &job as *const Job as *mut Job<'static>;
        self.job.store(ptr, Ordering::SeqCst);
        self.generation.fetch_add(1, Ordering::SeqCst);
        if self.parked.load(Ordering::SeqCst) > 0 {
            let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.wake.notify_all();
        }
        job.run();
        self.job.store(std::ptr::null_mut(), Ordering::SeqCst);
        while self.inside.load(Ordering::SeqCst) > 0 {
            std::hint::spin_loop();
        }
        if job.panicked.load(Ordering::Relaxed) {
            panic!("a parallel loop's task panicked");
        }
    }
}

/// Runs `f(i)` for every `i` in `0..n`, on the calling thread and the team's helpers (each
/// index once, in no set order across threads); on rayon's pool when another thread's loop
/// holds the team (or inline when there is one compute thread).
pub fn for_each_index(n: usize, f: impl Fn(usize) + Sync) {
    let team = team();
    if n == 0 {
        return;
    }
    if team.helpers == 0 || n == 1 {
        (0..n).for_each(f);
        return;
    }
    if team
        .busy
        .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        use rayon::prelude::*;
        (0..n).into_par_iter().for_each(&f);
        return;
    }
    struct Release<'a>(&'a AtomicBool);
    impl Drop for Release<'_> {
        fn drop(&mut self) {
            self.0.store(false, Ordering::Release);
        }
    }
    let _release = Release(&team.busy);
    team.run(&f, n);
}

/// `m` locked; a lock that a panicking task poisoned is taken as it is (the slots these
/// loops fill hold no invariant a task could break halfway).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// `f(i)` for every `i` in `0..n`, spread as [`for_each_index`] spreads them; the results
/// in index order.
pub fn map<R: Send>(n: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    let slots: Vec<Mutex<Option<R>>> = (0..n).map(|_| Mutex::new(None)).collect();
    for_each_index(n, |i| {
        let r = f(i);
        *lock(&slots[i]) = Some(r);
    });
    slots
        .into_iter()
        .map(|s| {
            let r = s
                .into_inner()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            // `for_each_index` ran every index or panicked.
            r.expect("every index ran")
        })
        .collect()
}

/// [`map`] over `items`, each given to `f` mutably with its index.
pub fn map_mut<T: Send, R: Send>(items: &mut [T], f: impl Fn(usize, &mut T) -> R + Sync) -> Vec<R> {
    let cells: Vec<Mutex<&mut T>> = items.iter_mut().map(Mutex::new).collect();
    map(cells.len(), |i| f(i, &mut lock(&cells[i])))
}

/// `f(i, chunk)` for the `i`-th `chunk`-long piece of `data` (the last may be shorter), as
/// [`for_each_index`] runs indices.
pub fn for_each_chunk_mut<T: Send>(
    data: &mut [T],
    chunk: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    let pieces: Vec<Mutex<&mut [T]>> = data.chunks_mut(chunk.max(1)).map(Mutex::new).collect();
    for_each_index(pieces.len(), |i| f(i, &mut lock(&pieces[i])));
}

/// Compute threads: `CANDLE_NUM_THREADS`, else the available cores. The first call also sizes
/// rayon's global pool to it (when nothing built that pool before).
pub fn compute_threads() -> usize {
    static THREADS: OnceLock<usize> = OnceLock::new();
    *THREADS.get_or_init(|| {
        let n = std::env::var("CANDLE_NUM_THREADS")
            .ok()
            .and_then(|s| s.parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global();
        n
    })
}

/// Runs `f` on a worker of rayon's global pool (inline when already on one, or with one compute
/// thread), so that the parallel kernels inside it fork and join within the pool instead of
/// handing work over from an outside thread at every call.
pub fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if compute_threads() <= 1 || rayon::current_thread_index().is_some() {
        f()
    } else {
        rayon::scope(|_| f())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_index_runs_once_also_when_loops_overlap() {
        let counts: Vec<AtomicUsize> = (0..1000).map(|_| AtomicUsize::new(0)).collect();
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| {
                    for _ in 0..200 {
                        for_each_index(counts.len(), |i| {
                            counts[i].fetch_add(1, Ordering::Relaxed);
                        });
                    }
                });
            }
        });
        assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 600));
    }

    #[test]
    fn maps_keep_the_index_order() {
        assert_eq!(
            map(500, |i| i * 3),
            (0..500).map(|i| i * 3).collect::<Vec<_>>()
        );
        let mut items: Vec<usize> = (0..300).collect();
        let doubled = map_mut(&mut items, |i, x| {
            *x += i;
            *x
        });
        assert_eq!(doubled, (0..300).map(|i| 2 * i).collect::<Vec<_>>());
        assert_eq!(items, doubled);
    }

    #[test]
    fn chunks_cover_the_slice_with_their_indices() {
        let mut v = vec![0usize; 103];
        for_each_chunk_mut(&mut v, 10, |i, c| c.iter_mut().for_each(|x| *x = i));
        assert!(v.iter().enumerate().all(|(j, &x)| x == j / 10));
    }

    #[test]
    fn a_panicking_task_reaches_the_caller_and_the_team_goes_on() {
        let hit = std::panic::catch_unwind(|| {
            for_each_index(64, |i| assert!(i != 17, "task 17 fails"));
        });
        assert!(hit.is_err());
        let sum = AtomicUsize::new(0);
        for_each_index(100, |i| {
            sum.fetch_add(i, Ordering::Relaxed);
        });
        assert_eq!(sum.into_inner(), 4950);
    }

    #[test]
    fn loops_after_the_helpers_parked_still_run_everything() {
        let sum = AtomicUsize::new(0);
        for_each_index(10, |i| {
            sum.fetch_add(i, Ordering::Relaxed);
        });
        std::thread::sleep(SPIN * 3);
        for_each_index(10, |i| {
            sum.fetch_add(i, Ordering::Relaxed);
        });
        assert_eq!(sum.into_inner(), 90);
    }
}
