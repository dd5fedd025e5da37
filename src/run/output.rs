//! Output paths checked before a run starts: a binary's output flag never replaces what is not
//! its own.
//!
//! An atomic write renames its temporary file over the destination, whatever the destination
//! is: run as root, `--dagger /dev/null` would turn the system's `/dev/null` into a regular
//! file, and a directory as the destination would fail only after the work was done. So every
//! output path a binary takes is checked here first, by its flag's name:
//!
//! - a file output ([`check_output_file`]) that exists must be a regular file (or a symbolic
//!   link to one); a directory, FIFO, socket or device is refused;
//! - a folder output ([`check_output_dir`]) that exists must be a directory (or a link to one);
//! - missing parent folders are an error ([`Parents::MustExist`]) unless the flag documents
//!   that it creates them ([`Parents::Create`]); then every existing ancestor must still be a
//!   directory.
//!
//! [`AtomicFile`](super::AtomicFile) applies the destination rule once more at the moment it
//! writes, for outputs whose names a run derives itself.

use std::fs::FileType;
use std::io;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

/// Whether an output flag creates missing parent folders (it says so in its `--help`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parents {
    /// Missing parent folders are created (the flag documents it).
    Create,
    /// The parent folder must exist.
    MustExist,
}

/// An output path refused before any work started, naming the flag and the path.
#[derive(Debug, thiserror::Error)]
pub enum OutputPathError {
    #[error("{flag} {path}: exists and is {what}, not a regular file; give a file path")]
    NotAFile {
        flag: String,
        path: PathBuf,
        what: &'static str,
    },
    #[error("{flag} {path}: exists and is {what}, not a directory; give a folder path")]
    NotADir {
        flag: String,
        path: PathBuf,
        what: &'static str,
    },
    #[error("{flag} {path}: the folder {parent} does not exist; create it first")]
    MissingParent {
        flag: String,
        path: PathBuf,
        parent: PathBuf,
    },
    #[error("{flag} {path}: {ancestor} is {what}, not a directory")]
    ParentNotADir {
        flag: String,
        path: PathBuf,
        ancestor: PathBuf,
        what: &'static str,
    },
    #[error("{flag} {path}: {source}")]
    Io {
        flag: String,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// What a file type is, in words ("a FIFO", "a directory", …).
pub fn file_type_name(t: &FileType) -> &'static str {
    if t.is_dir() {
        "a directory"
    } else if t.is_file() {
        "a regular file"
    } else if t.is_symlink() {
        "a symbolic link"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else {
        "a special file"
    }
}

/// The type of what `path` names, following symbolic links; `Ok(None)` when nothing is there.
/// A dangling link is reported as a symbolic link.
fn existing_type(path: &Path) -> io::Result<Option<FileType>> {
    // ENOTDIR: an ancestor is not a directory, which the parent check names.
    let absent = |e: &io::Error| {
        e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ENOTDIR)
    };
    match std::fs::metadata(path) {
        Ok(m) => Ok(Some(m.file_type())),
        Err(e) if absent(&e) => match std::fs::symlink_metadata(path) {
            Ok(m) => Ok(Some(m.file_type())),
            Err(e) if absent(&e) => Ok(None),
            Err(e) => Err(e),
        },
        Err(e) => Err(e),
    }
}

/// Checks a file output: an existing `path` must be a regular file; its parent folder must
/// exist unless `parents` is [`Parents::Create`].
pub fn check_output_file(flag: &str, path: &Path, parents: Parents) -> Result<(), OutputPathError> {
    let io_err = |source| OutputPathError::Io {
        flag: flag.to_string(),
        path: path.to_path_buf(),
        source,
    };
    if path.file_name().is_none() {
        return Err(OutputPathError::NotAFile {
            flag: flag.to_string(),
            path: path.to_path_buf(),
            what: "a path without a file name",
        });
    }
    match existing_type(path).map_err(io_err)? {
        Some(t) if t.is_file() => Ok(()),
        Some(t) => Err(OutputPathError::NotAFile {
            flag: flag.to_string(),
            path: path.to_path_buf(),
            what: file_type_name(&t),
        }),
        None => check_parents(flag, path, parents),
    }
}

/// Checks a folder output: an existing `path` must be a directory; its parent folder must exist
/// unless `parents` is [`Parents::Create`].
pub fn check_output_dir(flag: &str, path: &Path, parents: Parents) -> Result<(), OutputPathError> {
    let io_err = |source| OutputPathError::Io {
        flag: flag.to_string(),
        path: path.to_path_buf(),
        source,
    };
    match existing_type(path).map_err(io_err)? {
        Some(t) if t.is_dir() => Ok(()),
        Some(t) => Err(OutputPathError::NotADir {
            flag: flag.to_string(),
            path: path.to_path_buf(),
            what: file_type_name(&t),
        }),
        None => check_parents(flag, path, parents),
    }
}

/// `path` is absent: its parent must exist (or, with [`Parents::Create`], the nearest existing
/// ancestor must be a directory).
fn check_parents(flag: &str, path: &Path, parents: Parents) -> Result<(), OutputPathError> {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => return Ok(()), // relative to the working directory, which exists
    };
    let mut ancestor = parent;
    loop {
        match existing_type(ancestor) {
            Ok(Some(t)) if t.is_dir() => return Ok(()),
            Ok(Some(t)) => {
                return Err(OutputPathError::ParentNotADir {
                    flag: flag.to_string(),
                    path: path.to_path_buf(),
                    ancestor: ancestor.to_path_buf(),
                    what: file_type_name(&t),
                })
            }
            Ok(None) if parents == Parents::MustExist => {
                return Err(OutputPathError::MissingParent {
                    flag: flag.to_string(),
                    path: path.to_path_buf(),
                    parent: parent.to_path_buf(),
                })
            }
            Ok(None) => match ancestor.parent() {
                Some(p) if !p.as_os_str().is_empty() => ancestor = p,
                _ => return Ok(()),
            },
            Err(source) => {
                return Err(OutputPathError::Io {
                    flag: flag.to_string(),
                    path: ancestor.to_path_buf(),
                    source,
                })
            }
        }
    }
}

/// The atomic writer's own check of a destination it is about to replace: nothing, a regular
/// file or a symbolic link (the rename replaces the link, never its target) may be replaced;
/// anything else (a device, FIFO, socket or directory) is refused.
pub(crate) fn check_replaceable(dest: &Path) -> io::Result<()> {
    match std::fs::symlink_metadata(dest) {
        Ok(m) if m.file_type().is_file() || m.file_type().is_symlink() => Ok(()),
        Ok(m) => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "exists and is {}, not a regular file; refusing to replace it",
                file_type_name(&m.file_type())
            ),
        )),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
pub(crate) fn mkfifo(path: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path; mkfifo touches no memory of ours.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fifo_or_a_directory_is_refused_by_name_where_a_file_is_meant() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("pipe");
        mkfifo(&fifo);
        let e = check_output_file("--dagger", &fifo, Parents::MustExist).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("--dagger") && msg.contains("pipe"), "{msg}");
        assert!(msg.contains("a FIFO"), "{msg}");
        let e = check_output_file("--dagger", dir.path(), Parents::MustExist).unwrap_err();
        assert!(e.to_string().contains("a directory"), "{e}");
        // A FIFO where a folder is meant, and the folder check on a directory.
        let e = check_output_dir("--output", &fifo, Parents::Create).unwrap_err();
        assert!(
            matches!(e, OutputPathError::NotADir { what: "a FIFO", .. }),
            "{e}"
        );
        check_output_dir("--output", dir.path(), Parents::MustExist).unwrap();
        // A regular file, or nothing yet, is fine.
        let file = dir.path().join("x.parquet");
        check_output_file("--dagger", &file, Parents::MustExist).unwrap();
        std::fs::write(&file, b"x").unwrap();
        check_output_file("--dagger", &file, Parents::MustExist).unwrap();
        // The atomic writer refuses the FIFO too, and leaves it a FIFO.
        let e = crate::run::write_atomic(&fifo, b"x").unwrap_err();
        assert!(e.to_string().contains("a FIFO"), "{e}");
        let t = std::fs::symlink_metadata(&fifo).unwrap().file_type();
        assert!(t.is_fifo());
    }

    #[test]
    fn missing_parents_are_refused_unless_the_flag_creates_them() {
        let dir = tempfile::tempdir().unwrap();
        let deep = dir.path().join("no/such/x.parquet");
        let e = check_output_file("--dagger", &deep, Parents::MustExist).unwrap_err();
        assert!(matches!(e, OutputPathError::MissingParent { .. }), "{e}");
        assert!(e.to_string().contains("no/such"), "{e}");
        check_output_file("--dagger", &deep, Parents::Create).unwrap();
        check_output_dir("--output", &dir.path().join("a/b/c"), Parents::Create).unwrap();
        // An ancestor that is a file is refused even when parents are created.
        let file = dir.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        let e = check_output_dir("--output", &file.join("run"), Parents::Create).unwrap_err();
        assert!(
            matches!(
                e,
                OutputPathError::ParentNotADir {
                    what: "a regular file",
                    ..
                }
            ),
            "{e}"
        );
        // A bare name lives in the working directory.
        check_output_file("--json", Path::new("x.json"), Parents::MustExist).unwrap();
    }
}
