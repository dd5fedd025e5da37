//! How much more memory this process may take: the system's available memory, or less where
//! its control group (a container, a Slurm or Kubernetes job) sets a lower limit. On a large
//! node `/proc/meminfo` alone would size the key/value budget for memory the job may not
//! use, and the kernel would kill the process once the caches grew into it.

use std::path::Path;

/// Bytes this process may still allocate, where the system says: the smaller of
/// `MemAvailable` and the room left under every memory limit of its cgroups.
pub fn available() -> Option<usize> {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let system = read("/proc/meminfo").and_then(|info| mem_available(&info));
    let cgroup = read("/proc/self/cgroup").and_then(|groups| cgroup_room(&groups, read));
    match (system, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
fn mem_available(meminfo: &str) -> Option<usize> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib.saturating_mul(1024))
}

/// Limits at or above this are "no limit" (cgroup v1 writes its largest page-aligned value).
const UNLIMITED: u64 = 1 << 62;

/// The least room (limit − usage not counting reclaimable inactive page cache) over the memory
/// limits of this process's cgroup and its ancestors, from `/proc/self/cgroup`'s text; `read`
/// gives a file's text. cgroup v2 (`0::/path`, `memory.max`, `memory.current`) and the v1
/// memory controller (`memory.limit_in_bytes`, `memory.usage_in_bytes`); `None` when no limit
/// applies or none can be read.
fn cgroup_room(groups: &str, read: impl Fn(&str) -> Option<String>) -> Option<usize> {
    let mut room: Option<u64> = None;
    for line in groups.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let (root, files) = if id == "0" && controllers.is_empty() {
            ("/sys/fs/cgroup", V2)
        } else if controllers.split(',').any(|c| c == "memory") {
            ("/sys/fs/cgroup/memory", V1)
        } else {
            continue;
        };
        // Inside a container its own group is mounted at the root and `path` may not exist
        // there: the root is always looked at too.
        let mut dir = Path::new(path);
        loop {
            let at = format!("{root}{}", dir.display())
                .trim_end_matches('/')
                .to_string();
            if let Some(r) = group_room(&at, &files, &read) {
                room = Some(room.map_or(r, |x| x.min(r)));
            }
            match dir.parent() {
                Some(parent) => dir = parent,
                None => break,
            }
        }
    }
    room.map(|r| usize::try_from(r).unwrap_or(usize::MAX))
}

/// A cgroup version's file names: limit, usage, and the `memory.stat` key of its inactive
/// page cache.
struct Files {
    limit: &'static str,
    usage: &'static str,
    inactive: &'static str,
}

const V2: Files = Files {
    limit: "memory.max",
    usage: "memory.current",
    inactive: "inactive_file",
};

const V1: Files = Files {
    limit: "memory.limit_in_bytes",
    usage: "memory.usage_in_bytes",
    inactive: "total_inactive_file",
};

/// Room under the limit of the cgroup at directory `dir`, if it has one.
fn group_room(dir: &str, files: &Files, read: &impl Fn(&str) -> Option<String>) -> Option<u64> {
    let number =
        |name: &str| -> Option<u64> { read(&format!("{dir}/{name}"))?.trim().parse().ok() };
    let limit = number(files.limit).filter(|&l| l < UNLIMITED)?;
    let usage = number(files.usage).unwrap_or(0);
    let inactive = read(&format!("{dir}/memory.stat"))
        .and_then(|stat| {
            stat.lines().find_map(|l| {
                let (key, value) = l.split_once(' ')?;
                (key == files.inactive).then(|| value.trim().parse::<u64>().ok())?
            })
        })
        .unwrap_or(0);
    Some(limit.saturating_sub(usage.saturating_sub(inactive)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn files(entries: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = entries
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |p: &str| map.get(p).cloned()
    }

    const GIB: u64 = 1 << 30;

    #[test]
    fn v2_limits_of_the_group_and_its_ancestors() {
        let read = files(&[
            ("/sys/fs/cgroup/job/step/memory.max", "max\n"),
            ("/sys/fs/cgroup/job/step/memory.current", "1000\n"),
            ("/sys/fs/cgroup/job/memory.max", &format!("{}\n", 8 * GIB)),
            (
                "/sys/fs/cgroup/job/memory.current",
                &format!("{}\n", 3 * GIB),
            ),
            (
                "/sys/fs/cgroup/job/memory.stat",
                &format!("anon 5\ninactive_file {}\nactive_file 7\n", GIB),
            ),
        ]);
        // 8 GiB limit, 3 GiB used of which 1 GiB is reclaimable page cache.
        assert_eq!(
            cgroup_room("0::/job/step\n", read),
            Some((6 * GIB) as usize)
        );
    }

    #[test]
    fn v1_memory_controller_and_a_container_root() {
        let read = files(&[
            (
                "/sys/fs/cgroup/memory/memory.limit_in_bytes",
                &format!("{}", 4 * GIB),
            ),
            (
                "/sys/fs/cgroup/memory/memory.usage_in_bytes",
                &format!("{}", GIB),
            ),
        ]);
        // The group's own path does not exist inside the container: its root holds the limit.
        let groups = "4:memory:/docker/abc\n3:cpu:/\n0::/\n";
        assert_eq!(cgroup_room(groups, read), Some((3 * GIB) as usize));
    }

    #[test]
    fn no_limit_is_none() {
        let read = files(&[
            (
                "/sys/fs/cgroup/memory/memory.limit_in_bytes",
                "9223372036854771712",
            ),
            ("/sys/fs/cgroup/memory/memory.usage_in_bytes", "8310341632"),
            ("/sys/fs/cgroup/memory.max", "max"),
        ]);
        assert_eq!(cgroup_room("4:memory:/a/b\n0::/\n", &read), None);
        assert_eq!(cgroup_room("", &read), None);
        assert_eq!(cgroup_room("garbage\n", &read), None);
    }

    #[test]
    fn usage_over_the_limit_leaves_no_room() {
        let read = files(&[
            ("/sys/fs/cgroup/memory.max", "100"),
            ("/sys/fs/cgroup/memory.current", "250"),
        ]);
        assert_eq!(cgroup_room("0::/\n", read), Some(0));
    }

    #[test]
    fn meminfo_and_this_machine() {
        let info = "MemTotal: 100 kB\nMemFree: 10 kB\nMemAvailable:   2048 kB\n";
        assert_eq!(mem_available(info), Some(2 << 20));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
        // Whatever this machine's groups say, the answer is at most what the system has.
        let system = mem_available(&std::fs::read_to_string("/proc/meminfo").unwrap());
        if let (Some(all), Some(sys)) = (available(), system) {
            assert!(all <= sys);
        }
    }
}
