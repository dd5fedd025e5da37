//! Model weights on 2 MiB pages. Decoding one request streams every weight from memory each
//! step (~96 MB for the default model): on 4 KiB pages that is ~24 000 TLB misses a step,
//! and glibc's malloc never asks for transparent huge pages where the system leaves them to
//! `madvise` (the common default). A one-request decode step is memory-bound, so it runs
//! faster on huge pages (the measurement: BENCHMARKS.md, "Weights on 2 MiB pages").

use std::collections::BTreeSet;

/// The size of a transparent huge page on x86-64 and most arm64 kernels.
pub const HUGE_PAGE: usize = 2 << 20;

/// Asks the kernel to back now, with huge pages, every 2 MiB-aligned stretch of memory that
/// holds part of `ranges` ((first byte, length) pairs): `MADV_COLLAPSE` (Linux 6.1+), which
/// leaves the contents as they are. Stretches it cannot collapse (not wholly mapped
/// anonymous memory, an older kernel, no THP support, huge pages of another size) stay on
/// small pages. Returns the bytes of the stretches it moved.
pub fn collapse(ranges: &[(usize, usize)]) -> usize {
    if !pmd_pages_are_2_mib() {
        // Kernels on 16 or 64 KiB base pages have larger huge pages: a 2 MiB stretch
        // collapses nothing there.
        return 0;
    }
    let mut stretches = BTreeSet::new();
    for &(start, len) in ranges.iter().filter(|r| r.1 > 0) {
        stretches.extend(start / HUGE_PAGE..=(start + len - 1) / HUGE_PAGE);
    }
    let collapsed = stretches
        .into_iter()
        .filter(|&s| advise_collapse(s * HUGE_PAGE));
    collapsed.count() * HUGE_PAGE
}

/// Whether the kernel's transparent huge page is [`HUGE_PAGE`] (where it says; a kernel
/// without the file is assumed to have the x86-64 size, and `madvise` tells).
fn pmd_pages_are_2_mib() -> bool {
    let size = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size");
    size.ok()
        .and_then(|s| s.trim().parse::<usize>().ok())
        .is_none_or(|bytes| bytes == HUGE_PAGE)
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn advise_collapse(at: usize) -> bool {
    // SAFETY: `MADV_COLLAPSE` changes how the range is backed, never its contents (what the
    // process reads stays the same, other allocations in the stretch included); a stretch
    // not wholly mapped, or holding pinned pages, fails with an error (part of it may then
    // be collapsed all the same: the count is a lower bound).
    unsafe { libc::madvise(at as *mut libc::c_void, HUGE_PAGE, libc::MADV_COLLAPSE) == 0 }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn advise_collapse(_at: usize) -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collapsing_keeps_every_value_and_counts_whole_huge_pages() {
        let values: Vec<u64> = (0..3 * HUGE_PAGE as u64 / 8).map(|i| i * 7 + 3).collect();
        let bytes = std::mem::size_of_val(&values[..]);
        let moved = collapse(&[(values.as_ptr() as usize, bytes), (0, 0)]);
        // Where the kernel can, the two or three stretches inside the buffer move; the
        // contents never change.
        assert_eq!(moved % HUGE_PAGE, 0);
        assert!(moved <= 4 * HUGE_PAGE, "{moved}");
        assert!(values
            .iter()
            .enumerate()
            .all(|(i, &v)| v == i as u64 * 7 + 3));
        assert_eq!(collapse(&[]), 0);
    }
}
