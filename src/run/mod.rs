//! Run directories: what every stage that writes an output directory shares.
//!
//! - `lock`: [`RunLock`], one writer per run directory (an exclusive `flock` on `<dir>/.lock`
//!   holding the writer's pid; the kernel drops it when the process ends, kill -9 included).
//! - `atomic`: [`write_atomic`] / [`write_json_atomic`] and the crate's `AtomicFile`: a file is
//!   written under a temporary name in its own directory, fsynced, renamed over the
//!   destination, and the directory fsynced, so a reader (or a crash) sees the old file or the
//!   new one, never a half-written one.
//! - `log`: [`AppendLog`], an append-only JSON-lines log of finished work, synced per record,
//!   its torn last line cut on reopen.
//! - `manifest`: [`ManifestHeader`] (tool, revision at build time, [`RunStatus`], times,
//!   signal) that every stage's `manifest.json` starts with, [`Manifest`] (any stage's
//!   manifest read back, typed), and [`changed_settings`], the resume check of a manifest's
//!   recorded settings.
//! - `jobs`: [`drive_jobs`], the job-stream driver (up to C items at a time, each result
//!   handed over as it finishes, a signal stops it between results).
//! - `signal`: [`Shutdown`] (SIGINT/SIGTERM as a future a run can race its work against) and
//!   [`Interrupted`], the error a run returns after recording status `interrupted`; binaries
//!   exit with 128 + the signal's number.
//!
//! - `output`: [`check_output_file`] / [`check_output_dir`], every binary's output flags
//!   checked before work starts (an existing destination of the wrong kind, a device, FIFO,
//!   socket or directory where a file is meant, is refused by name; missing parents are an
//!   error unless the flag creates them).
//! - `checksums`: [`write_checksums`] / [`verify_checksums`], the per-file SHA-256 of a
//!   checkpoint directory, checked before a resume.
//!
//! Depends on nothing else in the crate.

mod atomic;
mod checksums;
mod jobs;
mod lock;
mod log;
mod manifest;
mod output;
mod signal;

pub(crate) use atomic::AtomicFile;
pub use atomic::{sync_dir, write_atomic, write_json_atomic, WriteError};
pub use checksums::{
    files_to_list, recorded_checksums, sha256_file, verify_checksums, write_checksums,
    CHECKSUMS_FILE,
};
pub use jobs::drive_jobs;
pub use lock::{LockError, RunLock, LOCK_FILE};
pub use log::{read_log, AppendLog, LogError};
pub use manifest::{
    changed_keys, changed_settings, write_finished_summary, write_interrupted_summary, Manifest,
    ManifestError, ManifestHeader, RunStatus,
};
pub use output::{check_output_dir, check_output_file, file_type_name, OutputPathError, Parents};
pub use signal::{interrupted_exit_code, Interrupted, Shutdown, Signal};

/// Seconds since the Unix epoch (manifest times).
pub fn now_secs() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The git revision this library was built from (`build.rs`), if the build had git.
pub fn git_revision() -> Option<String> {
    option_env!("COLLABLLM_GIT_REVISION").map(str::to_string)
}

/// Peak resident set size of this process in bytes (Linux `VmHWM`), if known.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
