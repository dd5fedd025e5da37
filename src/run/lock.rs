//! One writer per run directory.
//!
//! `flock(LOCK_EX | LOCK_NB)` on `<dir>/.lock`, which holds the holder's pid for the message a
//! second writer gets. The lock belongs to the open file: it is released when the [`RunLock`]
//! is dropped and, because the kernel closes every file of a dead process, when the process
//! dies in any way (kill -9 included); a stale pid in the file is harmless. The file itself is
//! never removed: unlinking it while another process waits on it would let a third process
//! lock a new file beside the old lock.

use std::fs::File;
use std::io::{self, Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// Name of the lock file inside a run directory.
pub const LOCK_FILE: &str = ".lock";

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error(
        "{dir}: another process ({holder}) is writing this run directory; wait for it to \
         finish, or choose another --output"
    )]
    Held { dir: String, holder: String },
    #[error("{path}: cannot lock: {source}")]
    Io {
        path: String,
        #[source]
        source: io::Error,
    },
}

/// An exclusive lock on a run directory (see the module docs).
#[derive(Debug)]
pub struct RunLock {
    // Held open: closing it releases the lock.
    _file: File,
    path: PathBuf,
}

impl RunLock {
    /// Locks `dir` (which must exist) for this process, or says which process holds it.
    pub fn acquire(dir: &Path) -> Result<RunLock, LockError> {
        let path = dir.join(LOCK_FILE);
        let io_err = |source| LockError::Io {
            path: path.display().to_string(),
            source,
        };
        let mut file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io_err)?;
        // SAFETY: flock on a descriptor this function owns; no memory is involved.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::WouldBlock {
                return Err(io_err(e));
            }
            let mut text = String::new();
            let _ = file.read_to_string(&mut text);
            let holder = match text.trim().parse::<u32>() {
                Ok(pid) => format!("pid {pid}"),
                Err(_) => "pid unknown".to_string(),
            };
            return Err(LockError::Held {
                dir: dir.display().to_string(),
                holder,
            });
        }
        file.set_len(0)
            .and_then(|_| file.rewind())
            .and_then(|_| writeln!(file, "{}", std::process::id()))
            .and_then(|_| file.flush())
            .map_err(io_err)?;
        Ok(RunLock { _file: file, path })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_is_refused_with_the_holders_pid_until_the_first_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let first = RunLock::acquire(dir.path()).unwrap();
        // flock locks belong to the open file description: a second open in the same process
        // conflicts as a second process would.
        let err = RunLock::acquire(dir.path()).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("pid {}", std::process::id())),
            "{msg}"
        );
        assert!(msg.contains(&dir.path().display().to_string()), "{msg}");
        drop(first);
        let again = RunLock::acquire(dir.path()).unwrap();
        assert!(again.path().ends_with(LOCK_FILE));
    }

    #[test]
    fn a_missing_directory_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("absent");
        let err = RunLock::acquire(&missing).unwrap_err();
        assert!(matches!(err, LockError::Io { .. }));
        assert!(err.to_string().contains("absent"), "{err}");
    }
}
