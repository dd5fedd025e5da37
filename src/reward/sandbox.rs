//! Runs untrusted Python code against its unit tests in a separate, confined process
//! (never in the host process).
//!
//! [`run_python_tests`] starts `python3 -I -B -c <runner>` with the trusted runner
//! (`sandbox_runner.py`, compiled in) and hands it the code and the tests on stdin. Nothing of the
//! code under test runs in this process, and nothing it prints can count.
//!
//! # What cannot be forged
//!
//! The runner's first process (the *reporter*) never imports the code under test. It compiles the
//! code, loads the tests with a stand-in `solution` module, enumerates the tests, and takes a
//! snapshot of what a verdict depends on: every function and class (and their methods) of
//! `builtins`, `sys`, `unittest.*`, `contextlib`, `functools`, `operator`, `math`, … and of the
//! top level and `testing` modules of numpy/pandas/…, the dictionaries of the builtin types,
//! `sys.modules` entries, trace hooks, and the set of existing classes. Then, for each test, it
//! forks a child that imports the code, runs that one test with pristine unittest objects, and
//! checks the snapshot afterwards: anything replaced, a test method shadowed on the instance,
//! assertEqual's type dispatch changed, or a new class whose instances compare equal to an
//! object nobody could know (`__eq__` always true) makes that test fail as *tampered*. The
//! child reports over a pipe only it holds, tagged with a per-test random token; a missing,
//! duplicated or malformed report, or an exit before the report (`sys.exit`, `os._exit`, a
//! signal) fails the test. A test that skips itself while running fails (a skip decided by a
//! decorator is not run and not counted). The reporter writes the totals on a copy of stdout,
//! tagged with a nonce that it reads from stdin only after the last child is gone, so no process
//! that ran candidate code ever had it; stdout of the children goes to stderr. With a PID
//! namespace the reporter is the namespace's init (the code cannot kill it) and kills everything
//! else between tests; it is never dumpable (no ptrace, no `/proc/<pid>/fd` or `mem` access).
//!
//! What remains possible, honestly: code that knows this runner can forge **its own test's**
//! verdict inside its child — it runs in the same interpreter as that test, so with frame
//! walking, `gc`, `ctypes` (C-level slots, memory), threads or `/proc/self/fd` it can find the
//! per-test token and pipe, change expected values in the test's frame, or patch the checks
//! themselves. Objects that existed before the code ran and compare equal to anything
//! (`unittest.mock.ANY`) can be returned; a class made with `type()` that is freed before the
//! check escapes the equality probe. Tests share files, not memory: state kept in a class
//! attribute by one test is not seen by the next. Without a PID namespace, processes the code
//! detached with `setsid` live until the end of the run (then they are killed).
//!
//! # Confinement (Linux)
//!
//! The spawned process is a small **supervisor** (still our own code, forked from this process
//! and never `exec`ing) that:
//! * starts a new session, and tries `unshare(CLONE_NEWNET)` (no network),
//!   `unshare(CLONE_NEWPID)` (a PID namespace whose init is the Python process, so that when it
//!   dies the kernel kills and reaps everything it started) and `unshare(CLONE_NEWNS)` (a mount
//!   namespace: one private tmpfs of [`SandboxLimits::tmp_bytes`] on `/tmp`, also bound on
//!   `/var/tmp` and `/dev/shm`, and the rest of the file system read-only); each is skipped where
//!   not permitted (`EPERM`), reported in [`Isolation`] and warned about once per process;
//! * marks itself child subreaper, so that processes orphaned by the code are reaped here and not
//!   left as zombies (an init that does not reap is common in containers);
//! * forks the Python process, which mounts its own `/proc` (it sees only its own processes),
//!   creates its working directory inside the private `/tmp`, and gets its own process group,
//!   resource limits (`RLIMIT_CPU`, `RLIMIT_AS`, `RLIMIT_FSIZE`, `RLIMIT_NPROC`,
//!   `RLIMIT_CORE` = 0), `PR_SET_NO_NEW_PRIVS`, a parent-death signal, and — when we run as
//!   root, where `RLIMIT_NPROC` is not enforced and file permissions do not protect — drops to
//!   an unprivileged uid/gid with no supplementary groups;
//! * enforces the wall-clock timeout: kills the process group (repeatedly, until every
//!   descendant is gone and reaped), and when running as root with a private uid also kills every
//!   process of that uid (which catches code that escaped the group with `setsid`).
//!
//! Everything the code wrote lives in the namespace's tmpfs and disappears with it when the run
//! ends. Without a mount namespace the working directory is a fresh directory on the host's
//! temporary file system (removed after the run) and `/tmp` and `/dev/shm` are the host's.
//!
//! The environment is cleared (only `PATH=/usr/bin:/bin`, `LANG=C.UTF-8`, `HOME=<work dir>`,
//! and `OMP/OPENBLAS/MKL_NUM_THREADS=1` so numeric libraries stay within the limits),
//! and output is read with a cap (the last 64 KiB of stdout, the last 4 KiB of stderr are kept;
//! the rest is drained and dropped).
//!
//! **Private uids.** As root, each run uses its own uid (`PRIVATE_UID_BASE + slot`) when the
//! user namespace maps it, else `nobody` (65534). A private uid makes `RLIMIT_NPROC` a
//! per-run budget (with one shared `nobody`, a fork bomb in one run, or many concurrent runs,
//! would exhaust the budget of all the others) and makes "kill every process of this uid" a safe
//! cleanup.
//!
//! What this is not: a security boundary against a determined attacker (no seccomp filter; the
//! code can read world-readable files and use the kernel's whole system-call surface). It is
//! meant for model-generated code during reward computation. When running as root in a user
//! namespace that maps no unprivileged uid, it refuses to run
//! ([`SandboxError::NoUnprivilegedUser`]) rather than run the code as root. As an ordinary user
//! (no `CAP_SYS_ADMIN`) there are no namespaces: the code runs as that user.

use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Seconds of wall time of one sandboxed test run: more than 0, at most an hour.
pub const SANDBOX_TIMEOUT_S: crate::check::Range = crate::check::Range::open_closed(0.0, 3600.0);

/// Environment variable naming the Python interpreter to use instead of the default search.
pub const PYTHON_ENV: &str = "COLLABLLM_SANDBOX_PYTHON";

/// First uid of the private range used when running as root (`PRIVATE_UID_BASE..+65536`).
/// Chosen far above the ranges that distributions, systemd and container runtimes allocate.
pub const PRIVATE_UID_BASE: u32 = 0x7A00_0000;

/// The uid/gid of `nobody`, used as root when the private range is not mapped.
pub const NOBODY: u32 = 65534;

/// Bytes of stderr kept in [`SandboxOutcome::stderr_tail`].
pub const STDERR_TAIL_BYTES: usize = 4096;
/// Bytes of stdout kept for finding the runner's result line.
const STDOUT_TAIL_BYTES: usize = 64 * 1024;

/// Resource limits of one sandboxed run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxLimits {
    /// CPU seconds (`RLIMIT_CPU`; SIGXCPU at the limit, SIGKILL one second later).
    pub cpu_secs: u64,
    /// Address-space bytes (`RLIMIT_AS`); allocations beyond it raise `MemoryError`.
    pub memory_bytes: u64,
    /// Largest file the code may write (`RLIMIT_FSIZE`).
    pub file_size_bytes: u64,
    /// Processes + threads of the sandbox uid (`RLIMIT_NPROC`). Only enforced when the code runs
    /// under a non-root uid (always the case when we run as root; when we run as an ordinary
    /// user it counts all of that user's processes).
    pub max_processes: u64,
    /// Wall-clock limit; the whole process tree is killed when it is reached.
    pub wall_timeout: Duration,
    /// Size of the private tmpfs that holds the working directory, `/tmp`, `/var/tmp` and
    /// `/dev/shm` (together) when a mount namespace is available; writes beyond it fail with
    /// `ENOSPC`.
    #[serde(default = "default_tmp_bytes")]
    pub tmp_bytes: u64,
}

fn default_tmp_bytes() -> u64 {
    64 * 1024 * 1024
}

impl Default for SandboxLimits {
    fn default() -> Self {
        Self {
            cpu_secs: 5,
            memory_bytes: 512 * 1024 * 1024,
            file_size_bytes: 1024 * 1024,
            max_processes: 32,
            wall_timeout: Duration::from_secs(10),
            tmp_bytes: default_tmp_bytes(),
        }
    }
}

/// Which protections were in force for a run.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Isolation {
    /// The uid the code ran as, when privileges were dropped (we run as root); `None` when the
    /// code ran as our own (unprivileged) uid.
    pub uid: Option<u32>,
    /// The code ran in a fresh network namespace (no network, loopback down).
    pub net_namespace: bool,
    /// The code ran in a fresh PID namespace.
    pub pid_namespace: bool,
    /// Every process the code started was gone and reaped when the run ended.
    pub cleanup_complete: bool,
    /// The code ran in a fresh mount namespace with a private, size-limited tmpfs on `/tmp`,
    /// `/var/tmp` and `/dev/shm` holding its working directory.
    #[serde(default)]
    pub mount_namespace: bool,
    /// The rest of the file system was read-only.
    #[serde(default)]
    pub readonly_root: bool,
    /// `/proc` was the PID namespace's own (only the sandbox's processes visible).
    #[serde(default)]
    pub private_proc: bool,
}

/// The result of one sandboxed test run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SandboxOutcome {
    /// Exit status 0, at least one test ran, and every test passed.
    pub passed: bool,
    /// Tests run (0 when the solution or the tests failed to import).
    pub tests_run: u32,
    /// Tests that did not pass: failures, errors, skips while running, unexpected successes,
    /// tampering, and tests whose process ended without a report.
    pub failures: u32,
    /// Tests that passed (`tests_run - failures`).
    #[serde(default)]
    pub tests_passed: u32,
    /// Tests failed because the code under test tampered with what decides a verdict.
    #[serde(default)]
    pub tampered: u32,
    /// The tests that did not pass, with the reason (`Class.test: why`), at most 50.
    #[serde(default)]
    pub failed_tests: Vec<String>,
    /// Killed at the wall-clock limit, or by the CPU limit (SIGXCPU).
    pub timed_out: bool,
    /// Exit code of the Python process; `None` when it was killed by a signal.
    pub exit_code: Option<i32>,
    /// The last [`STDERR_TAIL_BYTES`] of stderr (unittest's verbose report, tracebacks).
    pub stderr_tail: String,
    /// Wall-clock seconds from spawn to the end of cleanup.
    pub duration_s: f64,
    /// The signal that killed the Python process, if any.
    #[serde(default)]
    pub signal: Option<i32>,
    /// Protections in force.
    #[serde(default)]
    pub isolation: Isolation,
}

impl SandboxOutcome {
    /// The fraction of tests that passed (0 when none ran or the run timed out).
    pub fn pass_fraction(&self) -> f64 {
        if self.tests_run == 0 || self.timed_out {
            0.0
        } else {
            f64::from(self.tests_passed) / f64::from(self.tests_run)
        }
    }
}

/// Why a sandboxed run could not take place (as opposed to code that failed its tests, which
/// is an [`SandboxOutcome`] with `passed == false`).
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// No usable Python 3 interpreter.
    #[error(
        "python3 not found (looked for {searched}); install Python 3 or set {PYTHON_ENV} to an interpreter"
    )]
    PythonNotFound { searched: String },
    /// Preparing the temporary directory or the confinement failed.
    #[error("sandbox setup failed ({what}): {source}")]
    Setup {
        what: String,
        #[source]
        source: io::Error,
    },
    /// The interpreter could not be started.
    #[error("could not start {python} in the sandbox (at step: {step}): {source}")]
    Spawn {
        python: PathBuf,
        step: &'static str,
        #[source]
        source: io::Error,
    },
    /// Running as root but no unprivileged uid is available to drop to.
    #[error("running as root but no unprivileged uid/gid is mapped in this user namespace; refusing to run untrusted code as root")]
    NoUnprivilegedUser,
    /// The sandbox is implemented for Linux only.
    #[error("the Python sandbox is only supported on Linux")]
    Unsupported,
}

/// Finds the interpreter: `$COLLABLLM_SANDBOX_PYTHON` if set (it must exist), else the first
/// executable of `/usr/bin/python3`, `/usr/local/bin/python3`, `/bin/python3`, else `python3`
/// on the host `PATH`. System locations come first because user-level shims (pyenv, conda)
/// often need environment variables or home directories the sandbox does not provide.
pub fn find_python() -> Result<PathBuf, SandboxError> {
    resolve_python(
        std::env::var_os(PYTHON_ENV),
        &["/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3"],
        std::env::var_os("PATH"),
    )
}

fn resolve_python(
    override_path: Option<OsString>,
    system: &[&str],
    path_var: Option<OsString>,
) -> Result<PathBuf, SandboxError> {
    if let Some(p) = override_path.filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        return if is_executable(&p) {
            Ok(p)
        } else {
            Err(SandboxError::PythonNotFound {
                searched: format!("{} (from {PYTHON_ENV})", p.display()),
            })
        };
    }
    let mut searched: Vec<String> = Vec::new();
    for s in system {
        let p = PathBuf::from(s);
        if is_executable(&p) {
            return Ok(p);
        }
        searched.push(s.to_string());
    }
    if let Some(path_var) = path_var {
        for dir in std::env::split_paths(&path_var) {
            let p = dir.join("python3");
            if is_executable(&p) {
                return Ok(p);
            }
        }
        searched.push("python3 on PATH".to_owned());
    }
    Err(SandboxError::PythonNotFound {
        searched: searched.join(", "),
    })
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The trusted runner (see the module docs and the file's own comments).
const RUNNER: &str = include_str!("sandbox_runner.py");

/// What the runner reads first on stdin: 16 ASCII digits (the byte count), then the JSON.
fn runner_input(code: &str, tests: &str) -> Vec<u8> {
    let payload = serde_json::json!({"solution": code, "tests": tests}).to_string();
    let mut input = format!("{:016}", payload.len()).into_bytes();
    input.extend_from_slice(payload.as_bytes());
    input
}

/// The runner's report, parsed from the last tagged line of stdout.
#[derive(Debug, Default, Deserialize)]
struct RunnerReport {
    tests_run: u32,
    #[serde(default)]
    passed: u32,
    failures: u32,
    errors: u32,
    #[allow(dead_code)]
    skipped: u32,
    #[serde(default)]
    tampered: u32,
    load_error: Option<String>,
    #[serde(default)]
    failed: Vec<String>,
}

fn find_report(stdout: &str, nonce: &str) -> Option<RunnerReport> {
    let tag = format!("COLLABLLM-RESULT-{nonce} ");
    stdout
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix(&tag))
        .and_then(|json| serde_json::from_str(json).ok())
}

/// Runs `tests` (unittest test cases) against `code` in the sandbox; see the module docs.
///
/// Returns `Ok` whenever the code ran, whatever it did (failed, crashed, hung, forked, ran out
/// of memory); `Err` only when the run could not take place (no Python, setup failure).
/// Cancelling the future does not leave processes behind: the supervisor still enforces the
/// wall timeout and cleans up on its own.
pub async fn run_python_tests(
    code: &str,
    tests: &str,
    limits: &SandboxLimits,
) -> Result<SandboxOutcome, SandboxError> {
    run_with_options(code, tests, limits, RunOptions::default()).await
}

/// Knobs for tests of the sandbox itself.
#[derive(Clone, Copy, Debug)]
struct RunOptions {
    try_pid_namespace: bool,
    try_net_namespace: bool,
    try_mount_namespace: bool,
}

impl Default for RunOptions {
    fn default() -> Self {
        Self {
            try_pid_namespace: true,
            try_net_namespace: true,
            try_mount_namespace: true,
        }
    }
}

#[cfg(not(target_os = "linux"))]
async fn run_with_options(
    _code: &str,
    _tests: &str,
    _limits: &SandboxLimits,
    _options: RunOptions,
) -> Result<SandboxOutcome, SandboxError> {
    Err(SandboxError::Unsupported)
}

#[cfg(target_os = "linux")]
async fn run_with_options(
    code: &str,
    tests: &str,
    limits: &SandboxLimits,
    options: RunOptions,
) -> Result<SandboxOutcome, SandboxError> {
    linux::run(code, tests, limits, options).await
}

#[cfg(target_os = "linux")]
mod linux {
    use std::os::unix::fs::PermissionsExt;
    use std::process::Stdio;
    use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};
    use std::time::Instant;

    use tokio::io::{AsyncRead, AsyncReadExt};
    use tokio::process::Command;

    use super::*;

    const MAGIC: u32 = 0xC011_AB11;
    const F_NETNS: u32 = 1;
    const F_PIDNS: u32 = 2;
    const F_TIMED_OUT: u32 = 4;
    const F_CHILD_DONE: u32 = 8;
    const F_STRAYS_LEFT: u32 = 16;
    const F_MNTNS: u32 = 32;
    const F_RDONLY: u32 = 64;
    const F_PROC: u32 = 128;
    /// The tmpfs is on /tmp (the working directory must be created in it).
    const F_TMPFS: u32 = 256;

    /// Steps of the child's setup, recorded so that a spawn error names the failing step.
    const STEPS: [&str; 10] = [
        "fork",
        "setsid",
        "fork python",
        "setpgid",
        "setrlimit",
        "drop privileges",
        "prctl",
        "exec python",
        "mount namespace",
        "working directory",
    ];

    /// Shared between this process and the supervisor (a `MAP_SHARED` anonymous page survives
    /// `fork`); written by the supervisor, read here after it exits.
    #[repr(C)]
    struct StatusPage {
        magic: AtomicU32,
        flags: AtomicU32,
        step: AtomicU32,
        child_pid: AtomicI32,
        child_status: AtomicI32,
        /// Set by the Python process before `exec` (the supervisor owns `flags`).
        child_flags: AtomicU32,
    }

    struct SharedPage {
        ptr: *mut libc::c_void,
        len: usize,
    }

    // SAFETY: the page is only touched through atomics.
    unsafe impl Send for SharedPage {}
    // SAFETY: as for Send: shared access goes through atomics only.
    unsafe impl Sync for SharedPage {}

    impl SharedPage {
        fn new() -> io::Result<Self> {
            let len = 4096;
            // SAFETY: anonymous shared mapping, no file descriptor involved.
            let ptr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if ptr == libc::MAP_FAILED {
                return Err(io::Error::last_os_error());
            }
            // The mapping is zero-filled, which is a valid StatusPage (all atomics 0).
            Ok(Self { ptr, len })
        }

        fn page(&self) -> &StatusPage {
            // SAFETY: page-aligned, zero-initialised, large enough, lives as long as self.
            unsafe { &*(self.ptr as *const StatusPage) }
        }
    }

    impl Drop for SharedPage {
        fn drop(&mut self) {
            // SAFETY: mapped in `new` with this length; the supervisor has its own mapping.
            unsafe {
                libc::munmap(self.ptr, self.len);
            }
        }
    }

    /// Everything the pre-exec code needs, by value (no allocation after fork).
    #[derive(Clone, Copy)]
    struct ExecConfig {
        page: usize,
        cpu_secs: u64,
        memory_bytes: u64,
        file_size_bytes: u64,
        max_processes: u64,
        wall_ns: u64,
        identity: Option<(u32, u32)>,
        /// The uid is private to this run: killing all its processes is safe.
        private_uid: bool,
        try_netns: bool,
        try_pidns: bool,
        try_mountns: bool,
        /// NUL-terminated strings owned by `run` (valid in the forked copy of its memory).
        work_dir: usize,
        tmpfs_options: usize,
    }

    /// Chooses the identity the code runs as: none unless we are root; as root a private uid
    /// when mapped, else nobody.
    fn choose_identity() -> Result<Option<(u32, u32, bool)>, SandboxError> {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Ok(None);
        }
        let slot = (std::process::id() % 256) * 256 + COUNTER.fetch_add(1, Ordering::Relaxed) % 256;
        let private = PRIVATE_UID_BASE + slot;
        if id_mapped("/proc/self/uid_map", private) && id_mapped("/proc/self/gid_map", private) {
            return Ok(Some((private, private, true)));
        }
        if id_mapped("/proc/self/uid_map", NOBODY) && id_mapped("/proc/self/gid_map", NOBODY) {
            return Ok(Some((NOBODY, NOBODY, false)));
        }
        Err(SandboxError::NoUnprivilegedUser)
    }

    /// Whether `id` is mapped in this user namespace (`/proc/self/{uid,gid}_map`). When the map
    /// cannot be read, assume the initial namespace (everything mapped).
    fn id_mapped(map_file: &str, id: u32) -> bool {
        let Ok(text) = std::fs::read_to_string(map_file) else {
            return true;
        };
        text.lines().any(|line| {
            let mut it = line.split_whitespace().map(|x| x.parse::<u64>().ok());
            match (
                it.next().flatten(),
                it.next().flatten(),
                it.next().flatten(),
            ) {
                (Some(inside), Some(_), Some(count)) => {
                    (id as u64) >= inside && (id as u64) < inside + count
                }
                _ => false,
            }
        })
    }

    /// Where the working directory is named: `/tmp` when it exists (with a mount namespace the
    /// directory is created inside the private tmpfs mounted there, under the same path), else
    /// `temp_dir()` if all its ancestors are world-traversable or we keep our uid.
    fn sandbox_parent_dir(dropping: bool) -> PathBuf {
        let slash_tmp = PathBuf::from("/tmp");
        if slash_tmp.is_dir() {
            return slash_tmp;
        }
        let tmp = std::env::temp_dir();
        let reachable = tmp
            .ancestors()
            .all(|a| std::fs::metadata(a).is_ok_and(|m| m.permissions().mode() & 0o001 != 0));
        if !dropping || reachable {
            tmp
        } else {
            slash_tmp
        }
    }

    fn setup_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> SandboxError {
        let what = what.into();
        move |source| SandboxError::Setup { what, source }
    }

    pub(super) async fn run(
        code: &str,
        tests: &str,
        limits: &SandboxLimits,
        options: RunOptions,
    ) -> Result<SandboxOutcome, SandboxError> {
        let python = find_python()?;
        let identity = choose_identity()?;

        // The working directory's name. With a mount namespace it is created inside the private
        // tmpfs on /tmp (and this host directory stays empty); without, it is the directory.
        let parent = sandbox_parent_dir(identity.is_some());
        let dir = tempfile::Builder::new()
            .prefix("collabllm-sandbox-")
            .tempdir_in(&parent)
            .map_err(setup_err("create temp dir"))?;
        if let Some((uid, gid, _)) = identity {
            chown(dir.path(), uid, gid)?;
            std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700))
                .map_err(setup_err("chmod temp dir"))?;
        }
        let work_dir = std::ffi::CString::new(dir.path().as_os_str().as_encoded_bytes())
            .map_err(|e| setup_err("temp dir path")(io::Error::other(e)))?;
        // Inodes bounded too (each costs kernel memory): one per 4 KiB of the size, at least 1024.
        let tmpfs_options = std::ffi::CString::new(format!(
            "size={},nr_inodes={},mode=1777",
            limits.tmp_bytes.max(4096),
            (limits.tmp_bytes / 4096).max(1024)
        ))
        .map_err(|e| setup_err("tmpfs options")(io::Error::other(e)))?;
        let nonce = format!("{:032x}", rand::random::<u128>());

        let shared = SharedPage::new().map_err(setup_err("mmap status page"))?;
        let cfg = ExecConfig {
            page: shared.ptr as usize,
            cpu_secs: limits.cpu_secs.max(1),
            memory_bytes: limits.memory_bytes,
            file_size_bytes: limits.file_size_bytes,
            max_processes: limits.max_processes.max(1),
            wall_ns: u64::try_from(limits.wall_timeout.as_nanos()).unwrap_or(u64::MAX),
            identity: identity.map(|(u, g, _)| (u, g)),
            private_uid: identity.is_some_and(|(_, _, private)| private),
            try_netns: options.try_net_namespace,
            try_pidns: options.try_pid_namespace,
            // The in-namespace path must lie in the tmpfs mounted on /tmp.
            try_mountns: options.try_mount_namespace && parent == Path::new("/tmp"),
            work_dir: work_dir.as_ptr() as usize,
            tmpfs_options: tmpfs_options.as_ptr() as usize,
        };

        let mut cmd = Command::new(&python);
        cmd.arg("-I")
            .arg("-B")
            .arg("-c")
            .arg(RUNNER)
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("LANG", "C.UTF-8")
            .env("HOME", dir.path())
            // Numeric libraries start one thread per core by default; each counts against
            // RLIMIT_NPROC and reserves address space against RLIMIT_AS.
            .env("OMP_NUM_THREADS", "1")
            .env("OPENBLAS_NUM_THREADS", "1")
            .env("MKL_NUM_THREADS", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(false);
        // SAFETY: `supervise_and_exec` only calls async-signal-safe functions (raw syscalls,
        // atomics on the shared page) and allocates nothing; see its docs.
        unsafe {
            cmd.pre_exec(move || supervise_and_exec(&cfg));
        }

        let started = Instant::now();
        let mut child = {
            let mut attempt = 0;
            loop {
                shared.page().step.store(0, Ordering::SeqCst);
                match cmd.spawn() {
                    Ok(child) => break child,
                    // EAGAIN: the process budget of the sandbox uid is momentarily exhausted.
                    Err(e) if e.raw_os_error() == Some(libc::EAGAIN) && attempt < 5 => {
                        attempt += 1;
                        tokio::time::sleep(Duration::from_millis(100 * attempt)).await;
                    }
                    Err(source) => {
                        let step = STEPS
                            .get(shared.page().step.load(Ordering::SeqCst) as usize)
                            .copied()
                            .unwrap_or("exec python");
                        return Err(SandboxError::Spawn {
                            python,
                            step,
                            source,
                        });
                    }
                }
            }
        };

        // The code and tests first; the nonce right after it, which the runner reads only when
        // every test process is gone.
        let mut input = runner_input(code, tests);
        input.extend_from_slice(nonce.as_bytes());
        input.push(b'\n');
        let stdin = child.stdin.take();
        let writer = tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            if let Some(mut stdin) = stdin {
                // A runner that died early closes the pipe (EPIPE): nothing to do then.
                let _ = stdin.write_all(&input).await;
            }
        });

        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        let out_task = tokio::spawn(read_tail(stdout, STDOUT_TAIL_BYTES, stop_rx.clone()));
        let err_task = tokio::spawn(read_tail(stderr, STDERR_TAIL_BYTES, stop_rx));

        // The supervisor enforces the wall timeout itself; this is only a backstop.
        let backstop = limits.wall_timeout + Duration::from_secs(5);
        let supervisor_ok = match tokio::time::timeout(backstop, child.wait()).await {
            Ok(Ok(_)) => true,
            Ok(Err(_)) | Err(_) => {
                let page = shared.page();
                let flags = page.flags.load(Ordering::SeqCst);
                let c = page.child_pid.load(Ordering::SeqCst);
                if c > 0 && flags & F_CHILD_DONE == 0 {
                    // SAFETY: plain kill(2); the child is not reaped (not done), so the pid and
                    // group id still name it.
                    unsafe {
                        libc::kill(-c, libc::SIGKILL);
                        libc::kill(c, libc::SIGKILL);
                    }
                }
                let _ = child.start_kill();
                let _ = child.wait().await;
                false
            }
        };

        // Output readers end at EOF; a process that escaped cleanup may hold the pipes open, so
        // give them a moment and then stop reading.
        let stop_later = async {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let _ = stop_tx.send(true);
        };
        let readers = async { (out_task.await, err_task.await) };
        tokio::pin!(readers);
        let (out, err) = tokio::select! {
            r = &mut readers => r,
            _ = stop_later => readers.await,
        };
        writer.abort();
        let duration_s = started.elapsed().as_secs_f64();
        let stdout = String::from_utf8_lossy(&out.unwrap_or_default()).into_owned();
        let stderr_tail = String::from_utf8_lossy(&err.unwrap_or_default()).into_owned();

        let page = shared.page();
        let magic_ok = page.magic.load(Ordering::SeqCst) == MAGIC;
        let flags = page.flags.load(Ordering::SeqCst);
        let status = page.child_status.load(Ordering::SeqCst);
        let child_done = magic_ok && flags & F_CHILD_DONE != 0;
        let (exit_code, signal) = if !child_done {
            (None, Some(libc::SIGKILL))
        } else if libc::WIFEXITED(status) {
            (Some(libc::WEXITSTATUS(status)), None)
        } else if libc::WIFSIGNALED(status) {
            (None, Some(libc::WTERMSIG(status)))
        } else {
            (None, None)
        };
        let timed_out = !supervisor_ok || flags & F_TIMED_OUT != 0 || signal == Some(libc::SIGXCPU);

        let report = find_report(&stdout, &nonce);
        let clean = report.as_ref().is_some_and(|r| r.load_error.is_none());
        let report = report.unwrap_or_default();
        let tests_run = report.tests_run;
        let failures = report.failures.saturating_add(report.errors).min(tests_run);
        let tests_passed = report.passed.min(tests_run - failures);
        let passed = exit_code == Some(0) && !timed_out && clean && tests_run > 0 && failures == 0;
        let child_flags = page.child_flags.load(Ordering::SeqCst);
        let isolation = Isolation {
            uid: cfg.identity.map(|(u, _)| u),
            net_namespace: flags & F_NETNS != 0,
            pid_namespace: flags & F_PIDNS != 0,
            cleanup_complete: magic_ok && supervisor_ok && flags & F_STRAYS_LEFT == 0,
            mount_namespace: flags & F_MNTNS != 0,
            readonly_root: flags & F_RDONLY != 0,
            private_proc: child_flags & F_PROC != 0,
        };
        warn_once_if_weaker(&isolation, magic_ok);

        Ok(SandboxOutcome {
            passed,
            tests_run,
            failures,
            tests_passed: if timed_out { 0 } else { tests_passed },
            tampered: report.tampered,
            failed_tests: report.failed,
            timed_out,
            exit_code,
            stderr_tail,
            duration_s,
            signal,
            isolation,
        })
    }

    /// One warning per process naming what the sandbox could not isolate here.
    fn warn_once_if_weaker(isolation: &Isolation, supervisor_reported: bool) {
        static WARNED: std::sync::Once = std::sync::Once::new();
        if !supervisor_reported {
            return;
        }
        let missing: Vec<&str> = [
            (isolation.net_namespace, "network (no network namespace)"),
            (
                isolation.pid_namespace,
                "processes (no PID namespace: host processes are visible)",
            ),
            (
                isolation.private_proc,
                "/proc (the host's, every host process visible)",
            ),
            (
                isolation.mount_namespace,
                "/tmp, /var/tmp, /dev/shm (no mount namespace: the host's, no size limit)",
            ),
            (
                isolation.readonly_root,
                "the file system (not read-only outside the private tmpfs)",
            ),
        ]
        .into_iter()
        .filter(|(held, _)| !held)
        .map(|(_, what)| what)
        .collect();
        if missing.is_empty() {
            return;
        }
        WARNED.call_once(|| {
            tracing::warn!(
                "the Python sandbox cannot isolate here (needs CAP_SYS_ADMIN for namespaces): {}",
                missing.join("; ")
            );
        });
    }

    fn chown(path: &Path, uid: u32, gid: u32) -> Result<(), SandboxError> {
        std::os::unix::fs::chown(path, Some(uid), Some(gid))
            .map_err(setup_err(format!("chown {}", path.display())))
    }

    /// Reads `r` to the end (or until `stop`), keeping only the last `cap` bytes.
    async fn read_tail<R: AsyncRead + Unpin>(
        r: Option<R>,
        cap: usize,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) -> Vec<u8> {
        let Some(mut r) = r else {
            return Vec::new();
        };
        let mut tail: Vec<u8> = Vec::with_capacity(cap.min(1 << 16));
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            tokio::select! {
                read = r.read(&mut buf) => match read {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        tail.extend_from_slice(&buf[..n]);
                        if tail.len() > 2 * cap {
                            tail.drain(..tail.len() - cap);
                        }
                    }
                },
                _ = stop.changed() => break,
            }
        }
        if tail.len() > cap {
            tail.drain(..tail.len() - cap);
        }
        tail
    }

    // ---------------------------------------------------------------------------------------
    // Code that runs between fork and exec. Only async-signal-safe calls, no allocation, no
    // locks: raw syscalls through `libc`, atomics on the shared page.
    // ---------------------------------------------------------------------------------------

    fn errno() -> i32 {
        // SAFETY: __errno_location returns this thread's errno slot.
        unsafe { *libc::__errno_location() }
    }

    fn now_ns() -> u64 {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: valid out-pointer.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        (ts.tv_sec as u64)
            .saturating_mul(1_000_000_000)
            .saturating_add(ts.tv_nsec as u64)
    }

    /// `fork` without glibc's atfork handlers (which take malloc locks that another thread of
    /// the parent may have held at the first fork): the raw `clone` syscall with `SIGCHLD`.
    unsafe fn raw_fork() -> libc::pid_t {
        libc::syscall(libc::SYS_clone, libc::SIGCHLD as libc::c_long, 0, 0, 0, 0) as libc::pid_t
    }

    /// Drops to `uid`/`gid` with no supplementary groups (raw syscalls: per-thread, and we are
    /// the only thread).
    unsafe fn drop_privileges(uid: u32, gid: u32) -> io::Result<()> {
        if libc::syscall(
            libc::SYS_setgroups,
            0 as libc::c_long,
            std::ptr::null::<libc::gid_t>(),
        ) != 0
        {
            return Err(io::Error::last_os_error());
        }
        if libc::syscall(libc::SYS_setresgid, gid, gid, gid) != 0 {
            return Err(io::Error::last_os_error());
        }
        if libc::syscall(libc::SYS_setresuid, uid, uid, uid) != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    #[cfg(target_env = "gnu")]
    type Resource = libc::__rlimit_resource_t;
    #[cfg(not(target_env = "gnu"))]
    type Resource = libc::c_int;

    unsafe fn set_limit(resource: Resource, soft: u64, hard: u64) -> io::Result<()> {
        let lim = libc::rlimit {
            rlim_cur: soft as libc::rlim_t,
            rlim_max: hard as libc::rlim_t,
        };
        if libc::setrlimit(resource, &lim) != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Runs in the process `std` forked for the command. Becomes the supervisor: new session,
    /// optional namespaces, subreaper; forks the Python process (which returns `Ok` from here
    /// and is `exec`ed by `std`), then supervises it and `_exit`s without returning.
    ///
    /// Async-signal-safety: every call below is a raw system call or an atomic store; nothing
    /// allocates (errors are `io::Error::last_os_error()`, an integer), nothing takes a lock.
    fn supervise_and_exec(cfg: &ExecConfig) -> io::Result<()> {
        // SAFETY: the page was mapped MAP_SHARED before fork and outlives this process's use.
        let page = unsafe { &*(cfg.page as *const StatusPage) };
        page.step.store(1, Ordering::SeqCst);
        // SAFETY: raw syscalls with valid arguments (the whole block; see the function docs).
        unsafe {
            if libc::setsid() < 0 {
                return Err(io::Error::last_os_error());
            }
            let mut flags = 0;
            if cfg.try_netns && libc::unshare(libc::CLONE_NEWNET) == 0 {
                flags |= F_NETNS;
            }
            if cfg.try_pidns && libc::unshare(libc::CLONE_NEWPID) == 0 {
                flags |= F_PIDNS;
            }
            let mut private_ns = false;
            if cfg.try_mountns {
                page.step.store(8, Ordering::SeqCst);
                let (mount_flags, private) = private_mounts(cfg)?;
                flags |= mount_flags;
                private_ns = private;
            }
            page.flags.store(flags, Ordering::SeqCst);
            libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong, 0, 0, 0);

            // Block SIGCHLD (so the supervisor can wait for it with a timeout) before forking,
            // and restore the mask in the child.
            let mut chld: libc::sigset_t = std::mem::zeroed();
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut chld);
            libc::sigaddset(&mut chld, libc::SIGCHLD);
            libc::sigprocmask(libc::SIG_BLOCK, &chld, &mut old);

            page.step.store(2, Ordering::SeqCst);
            let pid = raw_fork();
            if pid < 0 {
                return Err(io::Error::last_os_error());
            }
            if pid == 0 {
                libc::sigprocmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
                return child_setup(cfg, page, flags, private_ns);
            }
            page.child_pid.store(pid, Ordering::SeqCst);
            supervise(cfg, page, pid, &chld, flags)
        }
    }

    /// `struct mount_attr` of mount_setattr(2).
    #[repr(C)]
    struct MountAttr {
        attr_set: u64,
        attr_clr: u64,
        propagation: u64,
        userns_fd: u64,
    }
    const MOUNT_ATTR_RDONLY: u64 = 0x1;
    const AT_RECURSIVE: libc::c_int = 0x8000;

    /// In the supervisor: a new mount namespace with the whole tree read-only and one private
    /// tmpfs on `/tmp`, bound on `/dev/shm` and `/var/tmp` (one size limit for all three).
    /// Returns the flags achieved and whether we are in a private namespace at all (which makes
    /// mounting `/proc` safe). An error only when the tree is already read-only but the tmpfs
    /// could not be mounted (the code would have nowhere to write).
    unsafe fn private_mounts(cfg: &ExecConfig) -> io::Result<(u32, bool)> {
        let none = std::ptr::null::<libc::c_char>();
        if libc::unshare(libc::CLONE_NEWNS) != 0 {
            return Ok((0, false));
        }
        // Nothing mounted here may propagate back to the host's namespace.
        if libc::mount(
            none,
            c"/".as_ptr(),
            none,
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        ) != 0
        {
            return Ok((0, false));
        }
        let attr = MountAttr {
            attr_set: MOUNT_ATTR_RDONLY,
            attr_clr: 0,
            propagation: 0,
            userns_fd: 0,
        };
        let rdonly = libc::syscall(
            libc::SYS_mount_setattr,
            libc::AT_FDCWD,
            c"/".as_ptr(),
            AT_RECURSIVE,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        ) == 0;
        let tmp = c"/tmp".as_ptr();
        let fs_flags = libc::MS_NOSUID | libc::MS_NODEV;
        let tmpfs = c"tmpfs".as_ptr();
        if libc::mount(
            tmpfs,
            tmp,
            tmpfs,
            fs_flags,
            cfg.tmpfs_options as *const libc::c_void,
        ) != 0
        {
            return if rdonly {
                Err(io::Error::last_os_error())
            } else {
                Ok((0, true))
            };
        }
        let mut all_bound = true;
        for target in [c"/dev/shm", c"/var/tmp"] {
            if libc::mount(tmp, target.as_ptr(), none, libc::MS_BIND, std::ptr::null()) != 0
                && errno() != libc::ENOENT
            {
                all_bound = false;
            }
        }
        let mut flags = F_TMPFS | if rdonly { F_RDONLY } else { 0 };
        if all_bound {
            flags |= F_MNTNS;
        }
        Ok((flags, true))
    }

    /// The Python process, before `exec`: its own `/proc`, its working directory, own process
    /// group, limits, unprivileged identity.
    unsafe fn child_setup(
        cfg: &ExecConfig,
        page: &StatusPage,
        flags: u32,
        private_ns: bool,
    ) -> io::Result<()> {
        page.step.store(9, Ordering::SeqCst);
        // Only in a private mount namespace: elsewhere this would cover the host's /proc.
        if private_ns && flags & F_PIDNS != 0 {
            let proc_ = c"proc".as_ptr();
            let proc_flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
            if libc::mount(
                proc_,
                c"/proc".as_ptr(),
                proc_,
                proc_flags,
                std::ptr::null(),
            ) == 0
            {
                page.child_flags.fetch_or(F_PROC, Ordering::SeqCst);
            }
        }
        let work_dir = cfg.work_dir as *const libc::c_char;
        if flags & F_TMPFS != 0 {
            if libc::mkdir(work_dir, 0o700) != 0 {
                return Err(io::Error::last_os_error());
            }
            if let Some((uid, gid)) = cfg.identity {
                if libc::chown(work_dir, uid, gid) != 0 {
                    return Err(io::Error::last_os_error());
                }
            }
        }
        if libc::chdir(work_dir) != 0 {
            return Err(io::Error::last_os_error());
        }
        page.step.store(3, Ordering::SeqCst);
        if libc::setpgid(0, 0) != 0 {
            return Err(io::Error::last_os_error());
        }
        page.step.store(4, Ordering::SeqCst);
        set_limit(libc::RLIMIT_CORE, 0, 0)?;
        set_limit(
            libc::RLIMIT_CPU,
            cfg.cpu_secs,
            cfg.cpu_secs.saturating_add(1),
        )?;
        set_limit(libc::RLIMIT_AS, cfg.memory_bytes, cfg.memory_bytes)?;
        set_limit(libc::RLIMIT_FSIZE, cfg.file_size_bytes, cfg.file_size_bytes)?;
        set_limit(libc::RLIMIT_NPROC, cfg.max_processes, cfg.max_processes)?;
        page.step.store(5, Ordering::SeqCst);
        if let Some((uid, gid)) = cfg.identity {
            drop_privileges(uid, gid)?;
        }
        page.step.store(6, Ordering::SeqCst);
        // After the uid change (which clears it): die with the supervisor.
        libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0,
            0,
            0,
        );
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1 as libc::c_ulong, 0, 0, 0) != 0 {
            return Err(io::Error::last_os_error());
        }
        page.step.store(7, Ordering::SeqCst);
        Ok(())
    }

    /// Kills every process of `uid` from a helper running as that uid (`kill(-1)` reaches
    /// exactly the processes the uid may signal). Only used with a private uid.
    unsafe fn kill_all_of_uid(uid: u32, gid: u32) {
        let pid = raw_fork();
        if pid == 0 {
            if drop_privileges(uid, gid).is_err() {
                libc::_exit(1);
            }
            for _ in 0..64 {
                if libc::kill(-1, libc::SIGKILL) != 0 {
                    break;
                }
            }
            libc::_exit(0);
        }
        // The helper is reaped by the supervisor's wait loop.
    }

    /// The supervisor loop: reap, enforce the deadline, kill leftovers, report, `_exit`.
    unsafe fn supervise(
        cfg: &ExecConfig,
        page: &StatusPage,
        child: libc::pid_t,
        chld: &libc::sigset_t,
        mut flags: u32,
    ) -> ! {
        // Close every inherited descriptor: std's exec-error pipe (so `spawn` returns as soon
        // as Python is exec'd) and our copies of the stdio pipes (so readers see EOF when the
        // code's processes are gone).
        if libc::syscall(
            libc::SYS_close_range,
            0 as libc::c_uint,
            libc::c_uint::MAX,
            0 as libc::c_uint,
        ) != 0
        {
            for fd in 0..4096 {
                libc::close(fd);
            }
        }

        const GRACE_NS: u64 = 2_000_000_000;
        let deadline = now_ns().saturating_add(cfg.wall_ns);
        let mut child_done = false;
        let mut killing_since: Option<u64> = None;
        let mut last_sweep: u64 = 0;
        loop {
            // Reap everything that has exited.
            let no_children = loop {
                let mut status = 0;
                let r = libc::waitpid(-1, &mut status, libc::WNOHANG | libc::__WALL);
                if r > 0 {
                    if r == child {
                        page.child_status.store(status, Ordering::SeqCst);
                        child_done = true;
                        flags |= F_CHILD_DONE;
                    }
                    continue;
                }
                if r < 0 && errno() == libc::EINTR {
                    continue;
                }
                break r < 0;
            };
            if no_children {
                break;
            }
            let now = now_ns();
            if !child_done && now >= deadline {
                flags |= F_TIMED_OUT;
            }
            if child_done || flags & F_TIMED_OUT != 0 {
                let since = *killing_since.get_or_insert(now);
                if !child_done {
                    // Not reaped yet, so `child` still names the Python process and its group.
                    libc::kill(-child, libc::SIGKILL);
                    libc::kill(child, libc::SIGKILL);
                } else if cfg.identity.is_none() || !cfg.private_uid {
                    // Leftovers of the group (orphans reparented to us). Without a private uid
                    // the group id is all we have.
                    libc::kill(-child, libc::SIGKILL);
                }
                if cfg.private_uid && now.saturating_sub(last_sweep) >= 20_000_000 {
                    if let Some((uid, gid)) = cfg.identity {
                        kill_all_of_uid(uid, gid);
                        last_sweep = now;
                    }
                }
                if now.saturating_sub(since) >= GRACE_NS {
                    flags |= F_STRAYS_LEFT;
                    break;
                }
            }
            let wait_ns = if killing_since.is_some() {
                5_000_000
            } else {
                deadline.saturating_sub(now).clamp(1_000_000, 50_000_000)
            };
            let ts = libc::timespec {
                tv_sec: (wait_ns / 1_000_000_000) as libc::time_t,
                tv_nsec: (wait_ns % 1_000_000_000) as libc::c_long,
            };
            libc::sigtimedwait(chld, std::ptr::null_mut(), &ts);
        }
        page.flags.store(flags, Ordering::SeqCst);
        page.magic.store(MAGIC, Ordering::SeqCst);
        libc::_exit(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    const ADD: &str = "def add(a, b):\n    return a + b\n";
    const ADD_TESTS: &str = "import unittest\n\nclass TestAdd(unittest.TestCase):\n    def test_small(self):\n        self.assertEqual(add(1, 2), 3)\n\n    def test_negative(self):\n        self.assertEqual(add(-1, -2), -3)\n";
    /// A test that passes as soon as the module imported.
    const TRIVIAL_TESTS: &str = "import unittest\n\nclass T(unittest.TestCase):\n    def test_ok(self):\n        self.assertTrue(True)\n";

    fn limits(wall_secs: u64) -> SandboxLimits {
        SandboxLimits {
            wall_timeout: Duration::from_secs(wall_secs),
            ..SandboxLimits::default()
        }
    }

    fn is_root() -> bool {
        // SAFETY: no preconditions.
        unsafe { libc::geteuid() == 0 }
    }

    /// Processes (including zombies) whose real uid is `uid`.
    fn processes_of_uid(uid: u32) -> Vec<String> {
        let mut found = Vec::new();
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return found;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !name.chars().all(|c| c.is_ascii_digit()) {
                continue;
            }
            let Ok(status) = std::fs::read_to_string(e.path().join("status")) else {
                continue;
            };
            let real_uid = status
                .lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|u| u.parse::<u32>().ok());
            if real_uid == Some(uid) {
                found.push(name);
            }
        }
        found
    }

    async fn run(code: &str, tests: &str, limits: &SandboxLimits) -> SandboxOutcome {
        run_python_tests(code, tests, limits)
            .await
            .unwrap_or_else(|e| panic!("sandbox error: {e}"))
    }

    #[tokio::test]
    async fn correct_solution_passes() {
        let out = run(ADD, ADD_TESTS, &limits(10)).await;
        assert!(out.passed, "{out:#?}");
        assert_eq!(out.tests_run, 2);
        assert_eq!(out.tests_passed, 2);
        assert_eq!(out.pass_fraction(), 1.0);
        assert_eq!(out.failures, 0);
        assert_eq!(out.exit_code, Some(0));
        assert!(!out.timed_out);
        assert!(
            out.stderr_tail.contains("test_small"),
            "{}",
            out.stderr_tail
        );
        assert!(out.isolation.cleanup_complete);
        if is_root() {
            assert!(out.isolation.uid.is_some_and(|u| u != 0));
        }
        eprintln!("isolation here: {:?}", out.isolation);
        // The outcome is serialisable for the run's records.
        let json = serde_json::to_string(&out).expect("serialise");
        let back: SandboxOutcome = serde_json::from_str(&json).expect("deserialise");
        assert_eq!(back, out);
    }

    #[tokio::test]
    async fn wrong_solution_fails_with_counts() {
        let wrong = "def add(a, b):\n    return a - b\n";
        let out = run(wrong, ADD_TESTS, &limits(10)).await;
        assert!(!out.passed);
        assert_eq!(out.tests_run, 2);
        assert!(out.failures > 0);
        assert_eq!(out.exit_code, Some(1));
        assert!(out.stderr_tail.contains("AssertionError"));
    }

    #[tokio::test]
    async fn syntax_error_fails() {
        let out = run("def add(a, b)\n    return a +\n", ADD_TESTS, &limits(10)).await;
        assert!(!out.passed);
        assert_eq!(out.tests_run, 0);
        assert!(
            out.stderr_tail.contains("SyntaxError"),
            "{}",
            out.stderr_tail
        );
    }

    #[tokio::test]
    async fn tests_that_import_solution_themselves_and_no_tests() {
        let tests = "import unittest\nimport solution\n\nclass T(unittest.TestCase):\n    def test_add(self):\n        self.assertEqual(solution.add(2, 2), 4)\n";
        assert!(run(ADD, tests, &limits(10)).await.passed);
        let out = run(ADD, "x = 1\n", &limits(10)).await;
        assert!(!out.passed, "no tests must not pass");
        assert_eq!(out.tests_run, 0);
    }

    #[tokio::test]
    async fn infinite_loop_is_killed_at_the_wall_timeout() {
        let start = Instant::now();
        let out = run("while True:\n    pass\n", TRIVIAL_TESTS, &limits(3)).await;
        let elapsed = start.elapsed();
        assert!(!out.passed);
        assert!(out.timed_out, "{out:#?}");
        assert_eq!(out.exit_code, None);
        assert!(elapsed < Duration::from_secs(5), "took {elapsed:?}");
        assert!(out.isolation.cleanup_complete);
    }

    #[tokio::test]
    async fn sleeping_code_is_killed_at_the_wall_timeout() {
        let start = Instant::now();
        let out = run("import time\ntime.sleep(60)\n", TRIVIAL_TESTS, &limits(2)).await;
        assert!(!out.passed && out.timed_out);
        assert!(start.elapsed() < Duration::from_secs(4));
    }

    #[tokio::test]
    async fn fork_bomb_is_contained_and_cleaned_up() {
        let start = Instant::now();
        let code = "import os\nwhile True:\n    os.fork()\n";
        let out = run(code, TRIVIAL_TESTS, &limits(3)).await;
        let elapsed = start.elapsed();
        assert!(!out.passed);
        assert!(elapsed < Duration::from_secs(5), "took {elapsed:?}");
        assert!(out.isolation.cleanup_complete, "{out:#?}");
        if let Some(uid) = out.isolation.uid {
            let left = processes_of_uid(uid);
            assert!(left.is_empty(), "processes of uid {uid} left: {left:?}");
        }
    }

    /// Code that escapes the process group with `setsid` is still killed: by the PID namespace
    /// where available, else (as root) by killing every process of the private uid.
    #[tokio::test]
    async fn escaped_processes_are_killed_with_and_without_pid_namespace() {
        let code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n    os._exit(0)\n";
        for pidns in [true, false] {
            let options = RunOptions {
                try_pid_namespace: pidns,
                ..RunOptions::default()
            };
            let start = Instant::now();
            let out = run_with_options(code, TRIVIAL_TESTS, &limits(5), options)
                .await
                .expect("sandbox runs");
            assert!(out.passed, "{out:#?}");
            assert!(start.elapsed() < Duration::from_secs(4), "pidns={pidns}");
            if out.isolation.pid_namespace || out.isolation.uid.is_some_and(|u| u != NOBODY) {
                assert!(out.isolation.cleanup_complete, "pidns={pidns}: {out:#?}");
                if let Some(uid) = out.isolation.uid {
                    let left = processes_of_uid(uid);
                    assert!(left.is_empty(), "pidns={pidns}: uid {uid} left {left:?}");
                }
            }
        }
    }

    #[tokio::test]
    async fn huge_allocation_fails_with_memory_error() {
        let out = run("x = bytearray(10**10)\n", TRIVIAL_TESTS, &limits(10)).await;
        assert!(!out.passed);
        assert!(
            out.stderr_tail.contains("MemoryError"),
            "{}",
            out.stderr_tail
        );
    }

    #[tokio::test]
    async fn cannot_write_outside_its_directory() {
        if !is_root() {
            eprintln!("skipped: file permissions only confine the code when we run as root");
            return;
        }
        let outside = tempfile::tempdir().expect("tempdir");
        std::fs::set_permissions(outside.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod");
        let target = outside.path().join("pwned.txt");
        let code = format!(
            "with open({:?}, 'w') as f:\n    f.write('pwned')\n",
            target.display().to_string()
        );
        let out = run(&code, TRIVIAL_TESTS, &limits(10)).await;
        assert!(!out.passed);
        // Refused by permissions, by the read-only tree, or the path is hidden under the
        // private /tmp.
        assert!(
            [
                "PermissionError",
                "Read-only file system",
                "FileNotFoundError"
            ]
            .iter()
            .any(|e| out.stderr_tail.contains(e)),
            "{}",
            out.stderr_tail
        );
        assert!(!target.exists());
    }

    use std::os::unix::fs::PermissionsExt;

    #[tokio::test]
    async fn host_environment_is_not_visible() {
        static SET: std::sync::Once = std::sync::Once::new();
        // Set once, before any sandbox run of this test reads it.
        SET.call_once(|| std::env::set_var("COLLABLLM_SECRET", "hunter2"));
        let code = "import os\nSEEN = dict(os.environ)\n";
        let tests = "import unittest, os\n\nclass T(unittest.TestCase):\n    def test_env(self):\n        self.assertNotIn('COLLABLLM_SECRET', SEEN)\n        self.assertEqual(SEEN.get('PATH'), '/usr/bin:/bin')
        self.assertEqual(SEEN.get('OPENBLAS_NUM_THREADS'), '1')\n        self.assertEqual(os.getcwd(), SEEN.get('HOME'))\n";
        let out = run(code, tests, &limits(10)).await;
        assert!(out.passed, "{out:#?}");
    }

    #[tokio::test]
    async fn network_is_unreachable_in_a_network_namespace() {
        let code = "import errno, socket\ndef try_connect():\n    try:\n        socket.create_connection(('10.255.255.1', 80), timeout=1)\n    except OSError as e:\n        return e.errno\n    return 0\n";
        let tests = "import unittest, errno\n\nclass T(unittest.TestCase):\n    def test_net(self):\n        self.assertEqual(try_connect(), errno.ENETUNREACH)\n";
        let out = run(code, tests, &limits(10)).await;
        if out.isolation.net_namespace {
            assert!(out.passed, "{out:#?}");
        } else {
            eprintln!("skipped: no network namespace here");
        }
    }

    #[tokio::test]
    async fn output_flood_is_bounded_and_fake_results_do_not_pass() {
        let flood = "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 1_000_000)\n    sys.stderr.write('e' * 100_000)\n";
        let out = run(&format!("{ADD}{flood}"), ADD_TESTS, &limits(10)).await;
        assert!(out.passed, "{out:#?}");
        assert!(out.stderr_tail.len() <= STDERR_TAIL_BYTES);

        let fake = "import os, sys\nsys.stdout.write('\\nCOLLABLLM-RESULT-0 {\"tests_run\": 5, \"failures\": 0, \"errors\": 0, \"skipped\": 0, \"load_error\": null}\\n')\nsys.stdout.flush()\nos._exit(0)\n";
        let out = run(fake, TRIVIAL_TESTS, &limits(10)).await;
        assert!(!out.passed, "{out:#?}");
        // The test's process exited before reporting; the runner itself reports the failure.
        assert_eq!((out.tests_run, out.tests_passed), (1, 0), "{out:#?}");
        assert_eq!(out.exit_code, Some(1));
    }

    #[test]
    fn python_resolution() {
        let missing = resolve_python(Some("/nonexistent/python3".into()), &[], None);
        assert!(matches!(missing, Err(SandboxError::PythonNotFound { .. })));
        let none = resolve_python(None, &["/nonexistent/python3"], Some("/nonexistent".into()));
        let err = none.expect_err("nothing to find");
        assert!(err.to_string().contains("python3 not found"), "{err}");
        assert!(find_python().is_ok(), "tests need python3");
    }

    #[test]
    fn runner_input_is_framed_by_its_length() {
        let input = runner_input("x = 1\n", "t");
        let (len, json) = input.split_at(16);
        let len: usize = std::str::from_utf8(len).unwrap().parse().unwrap();
        assert_eq!(len, json.len());
        let v: serde_json::Value = serde_json::from_slice(json).unwrap();
        assert_eq!(v["solution"], "x = 1\n");
        assert_eq!(v["tests"], "t");
    }
}

#[cfg(all(test, target_os = "linux"))]
#[path = "sandbox_attacks.rs"]
mod attacks;
