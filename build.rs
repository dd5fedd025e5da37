//! Records the git revision the library is built from (`COLLABLLM_GIT_REVISION`), so run
//! manifests name the code that ran, not whatever the build directory holds at run time.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    // Without git (a source tarball) the revision is simply unknown.
    let Some(git_dir) = git(&["rev-parse", "--absolute-git-dir"]) else {
        return;
    };
    // A commit or checkout moves HEAD or a ref: rebuild the revision then, and only then.
    for p in ["HEAD", "refs/heads", "packed-refs"] {
        let path = std::path::Path::new(&git_dir).join(p);
        if path.exists() {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
    if let Some(common) = git(&["rev-parse", "--git-common-dir"]) {
        let refs = std::path::Path::new(&common).join("refs/heads");
        if refs.exists() {
            println!("cargo:rerun-if-changed={}", refs.display());
        }
    }
    if let Some(rev) = git(&["rev-parse", "HEAD"]) {
        println!("cargo:rustc-env=COLLABLLM_GIT_REVISION={rev}");
    }
}
