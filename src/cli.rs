//! What every binary shares: logging set-up, thread settings, and error reporting without a
//! backtrace.

use std::process::ExitCode;

/// Sets up `tracing` to stderr; `RUST_LOG` overrides the default level (`info`).
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}

/// Fixes the number of threads candle's CPU kernels use. Must run before the first model is
/// loaded: candle reads the variables once, when its thread pool starts (DESIGN §8: its
/// workers spin-wait, so more threads than free cores collapses throughput).
pub fn set_compute_threads(threads: Option<usize>) {
    let n = threads.unwrap_or_else(|| {
        std::env::var("CANDLE_NUM_THREADS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
    });
    // SAFETY: called at start-up, before any other thread of ours exists.
    unsafe {
        std::env::set_var("CANDLE_NUM_THREADS", n.to_string());
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
}

/// Runs a binary's body and turns an error into one readable message and exit code 1.
pub fn exit_on_error(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            for cause in e.chain().skip(1) {
                eprintln!("  caused by: {cause}");
            }
            ExitCode::FAILURE
        }
    }
}

/// Peak resident set size of this process in bytes (Linux `VmHWM`), if known.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Keeps freed heap memory for reuse instead of returning it to the kernel after every large
/// tensor (glibc's trim threshold). Training allocates and frees the same activation sizes
/// each layer and step; returning and re-faulting those pages cost about 8 % of a CPU step
/// (BENCHMARKS.md), for no gain in peak memory. No-op elsewhere.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator parameters; called at start-up.
    unsafe {
        // Setting either value turns glibc's adaptive mmap threshold off, so both are set:
        // blocks up to 32 MiB (glibc's maximum) come from the heap and are reused.
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}
