//! RAM capacity: what the kernel says is available, capped by the cgroup memory limit, because in
//! a container the OOM killer acts on the cgroup long before MemAvailable runs out.
//!
//! All parsing is pure (file contents in, numbers out) so it is tested with sample files; only
//! `memory_info` touches /proc and /sys.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::mountinfo::{parse_mountinfo, MountEntry};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryInfo {
    /// MemTotal.
    pub total_bytes: u64,
    /// MemAvailable: free memory plus page cache the kernel can reclaim.
    pub available_bytes: u64,
    /// The tightest cgroup memory limit above this process; `None` when unlimited.
    pub cgroup: Option<CgroupLimit>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CgroupLimit {
    /// 1 or 2.
    pub version: u8,
    pub limit_bytes: u64,
    /// Charged memory, page cache included (memory.current / memory.usage_in_bytes).
    pub usage_bytes: u64,
    /// Inactive file cache inside `usage_bytes` (memory.stat), which the kernel reclaims before
    /// the OOM killer acts; counted as free, like MemAvailable counts reclaimable cache.
    #[serde(default)]
    pub inactive_file_bytes: u64,
    /// The cgroup directory whose limit this is (the leaf's, or a tighter ancestor's).
    pub path: PathBuf,
}

impl CgroupLimit {
    /// Bytes that can still be charged before the limit: limit minus the working set.
    pub fn headroom_bytes(&self) -> u64 {
        let working_set_bytes = self.usage_bytes.saturating_sub(self.inactive_file_bytes);
        self.limit_bytes.saturating_sub(working_set_bytes)
    }
}

impl MemoryInfo {
    /// What the planner may spend: MemAvailable, capped by the cgroup headroom.
    pub fn effective_available_bytes(&self) -> u64 {
        match &self.cgroup {
            Some(cgroup) => self.available_bytes.min(cgroup.headroom_bytes()),
            None => self.available_bytes,
        }
    }
}

/// cgroup v1 reports "no limit" as a huge page-aligned number (e.g. 9223372036854771712);
/// anything at or above 2^60 bytes is treated as unlimited.
const CGROUP_V1_UNLIMITED_BYTES: u64 = 1 << 60;

/// MemTotal and MemAvailable from /proc/meminfo, in bytes.
pub(crate) fn parse_meminfo(contents: &str) -> Option<(u64, u64)> {
    let field = |name: &str| {
        contents.lines().find_map(|line| {
            let rest = line.strip_prefix(name)?.strip_prefix(':')?;
            let kibibytes: u64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
            Some(kibibytes * 1024)
        })
    };
    let total_bytes = field("MemTotal")?;
    // Kernels before 3.14 lack MemAvailable; free + buffers + cache is the classic estimate.
    let available_bytes = field("MemAvailable").unwrap_or_else(|| {
        field("MemFree").unwrap_or(0) + field("Buffers").unwrap_or(0) + field("Cached").unwrap_or(0)
    });
    Some((total_bytes, available_bytes))
}

/// This process's cgroup paths from /proc/self/cgroup.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct ProcessCgroups {
    /// The "0::/path" line (cgroup v2 unified hierarchy).
    pub unified: Option<String>,
    /// The path of the v1 hierarchy that has the memory controller.
    pub memory_v1: Option<String>,
}

pub(crate) fn parse_process_cgroups(contents: &str) -> ProcessCgroups {
    let mut cgroups = ProcessCgroups::default();
    for line in contents.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        if id == "0" && controllers.is_empty() {
            cgroups.unified = Some(path.to_string());
        } else if controllers.split(',').any(|controller| controller == "memory") {
            cgroups.memory_v1 = Some(path.to_string());
        }
    }
    cgroups
}

/// A limit file's value: `None` for "max" (v2) or a v1 value of 2^60 or more.
pub(crate) fn parse_limit(contents: &str) -> Option<u64> {
    let text = contents.trim();
    if text == "max" {
        return None;
    }
    text.parse::<u64>().ok().filter(|&bytes| bytes < CGROUP_V1_UNLIMITED_BYTES)
}

/// The "inactive_file" (v2) or "total_inactive_file" (v1, hierarchical) line of memory.stat.
pub(crate) fn parse_inactive_file(memory_stat: &str, version: u8) -> u64 {
    let key = if version == 1 { "total_inactive_file" } else { "inactive_file" };
    memory_stat
        .lines()
        .find_map(|line| {
            let (name, value) = line.split_once(' ')?;
            (name == key).then(|| value.trim().parse().ok()).flatten()
        })
        .unwrap_or(0)
}

/// Where a process's cgroup lives inside a cgroupfs mount. A mount's `root` is the cgroup that
/// is mounted (not "/" inside some containers), so it is stripped from the process path.
pub(crate) fn cgroup_directory(mount_point: &Path, mount_root: &str, process_path: &str) -> PathBuf {
    let relative = if mount_root == "/" {
        process_path
    } else {
        match process_path.strip_prefix(mount_root) {
            Some(rest) if rest.is_empty() || rest.starts_with('/') => rest,
            // The process is outside the mounted subtree (a cgroup namespace shows "/.."): the
            // mount point itself is the closest cgroup we can see.
            _ => "",
        }
    };
    mount_point.join(relative.trim_start_matches('/'))
}

/// Walk from `leaf` up to `mount_point` (inclusive) and return the limit with the least headroom,
/// since every ancestor's limit applies to this process too. `read` returns a file's contents.
pub(crate) fn tightest_cgroup_limit(
    version: u8,
    mount_point: &Path,
    leaf: &Path,
    read: &dyn Fn(&Path) -> Option<String>,
) -> Option<CgroupLimit> {
    let (limit_file, usage_file) = match version {
        1 => ("memory.limit_in_bytes", "memory.usage_in_bytes"),
        _ => ("memory.max", "memory.current"),
    };
    let mut tightest: Option<CgroupLimit> = None;
    let mut directory = Some(leaf);
    while let Some(current) = directory {
        if !current.starts_with(mount_point) {
            break;
        }
        if let Some(limit_bytes) = read(&current.join(limit_file)).as_deref().and_then(parse_limit) {
            let usage_bytes = read(&current.join(usage_file)).and_then(|text| text.trim().parse().ok()).unwrap_or(0);
            let inactive_file_bytes =
                read(&current.join("memory.stat")).map(|text| parse_inactive_file(&text, version)).unwrap_or(0);
            let candidate =
                CgroupLimit { version, limit_bytes, usage_bytes, inactive_file_bytes, path: current.to_path_buf() };
            if tightest.as_ref().is_none_or(|best| candidate.headroom_bytes() < best.headroom_bytes()) {
                tightest = Some(candidate);
            }
        }
        directory = current.parent();
    }
    tightest
}

/// The tightest limit over the v2 and v1 hierarchies (hybrid hosts mount both).
pub(crate) fn process_cgroup_limit(
    process_cgroups: &ProcessCgroups,
    mounts: &[MountEntry],
    read: &dyn Fn(&Path) -> Option<String>,
) -> Option<CgroupLimit> {
    let mut candidates = Vec::new();
    if let Some(path) = &process_cgroups.unified {
        let mount = mounts.iter().find(|mount| mount.filesystem == "cgroup2");
        let (mount_point, root) = match mount {
            Some(mount) => (mount.mount_point.clone(), mount.root.as_str()),
            None => (PathBuf::from("/sys/fs/cgroup"), "/"),
        };
        let leaf = cgroup_directory(&mount_point, root, path);
        candidates.extend(tightest_cgroup_limit(2, &mount_point, &leaf, read));
    }
    if let Some(path) = &process_cgroups.memory_v1 {
        let mount = mounts.iter().find(|mount| {
            mount.filesystem == "cgroup" && mount.super_options.split(',').any(|option| option == "memory")
        });
        let (mount_point, root) = match mount {
            Some(mount) => (mount.mount_point.clone(), mount.root.as_str()),
            None => (PathBuf::from("/sys/fs/cgroup/memory"), "/"),
        };
        let leaf = cgroup_directory(&mount_point, root, path);
        candidates.extend(tightest_cgroup_limit(1, &mount_point, &leaf, read));
    }
    candidates.into_iter().min_by_key(CgroupLimit::headroom_bytes)
}

/// Read RAM totals and the cgroup limit of this process now.
pub fn memory_info() -> MemoryInfo {
    let read = |path: &Path| std::fs::read_to_string(path).ok();
    let (total_bytes, available_bytes) =
        read(Path::new("/proc/meminfo")).as_deref().and_then(parse_meminfo).unwrap_or((0, 0));
    let process_cgroups = parse_process_cgroups(&read(Path::new("/proc/self/cgroup")).unwrap_or_default());
    let mounts = parse_mountinfo(&read(Path::new("/proc/self/mountinfo")).unwrap_or_default());
    MemoryInfo { total_bytes, available_bytes, cgroup: process_cgroup_limit(&process_cgroups, &mounts, &read) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const GIB: u64 = 1 << 30;

    fn fake_files(files: &[(&str, &str)]) -> impl Fn(&Path) -> Option<String> {
        let map: HashMap<PathBuf, String> =
            files.iter().map(|(path, text)| (PathBuf::from(path), text.to_string())).collect();
        move |path: &Path| map.get(path).cloned()
    }

    #[test]
    fn parses_meminfo_with_and_without_mem_available() {
        let modern = "MemTotal:       24684100 kB\nMemFree:        20000000 kB\nMemAvailable:   23000000 kB\n";
        assert_eq!(parse_meminfo(modern), Some((24_684_100 * 1024, 23_000_000 * 1024)));
        let old = "MemTotal: 1000 kB\nMemFree: 100 kB\nBuffers: 20 kB\nCached: 300 kB\nSwapCached: 5 kB\n";
        assert_eq!(parse_meminfo(old), Some((1000 * 1024, 420 * 1024)));
        assert_eq!(parse_meminfo("nonsense"), None);
    }

    #[test]
    fn parses_process_cgroup_files() {
        let v2 = parse_process_cgroups("0::/user.slice/user-1000.slice/session-3.scope\n");
        assert_eq!(v2.unified.as_deref(), Some("/user.slice/user-1000.slice/session-3.scope"));
        assert_eq!(v2.memory_v1, None);
        // Hybrid, like this build machine: v1 memory controller plus an empty v2 hierarchy.
        let v1 = parse_process_cgroups("9:name=systemd:/\n4:memory:/process_api/d922\n3:cpu,cpuacct:/\n0::/\n");
        assert_eq!(v1.memory_v1.as_deref(), Some("/process_api/d922"));
        assert_eq!(v1.unified.as_deref(), Some("/"));
    }

    #[test]
    fn parses_limits_and_unlimited_values() {
        assert_eq!(parse_limit("max\n"), None);
        assert_eq!(parse_limit("9223372036854771712\n"), None);
        assert_eq!(parse_limit("8589934592\n"), Some(8 * GIB));
        assert_eq!(parse_limit("garbage"), None);
    }

    #[test]
    fn maps_process_paths_into_mounts() {
        let mount = Path::new("/sys/fs/cgroup");
        assert_eq!(cgroup_directory(mount, "/", "/a/b"), PathBuf::from("/sys/fs/cgroup/a/b"));
        assert_eq!(cgroup_directory(mount, "/", "/"), PathBuf::from("/sys/fs/cgroup"));
        assert_eq!(cgroup_directory(mount, "/docker/abc", "/docker/abc"), PathBuf::from("/sys/fs/cgroup"));
        assert_eq!(cgroup_directory(mount, "/docker/abc", "/docker/abc/x"), PathBuf::from("/sys/fs/cgroup/x"));
        assert_eq!(cgroup_directory(mount, "/docker/abc", "/docker/abcdef"), PathBuf::from("/sys/fs/cgroup"));
        assert_eq!(cgroup_directory(mount, "/docker/abc", "/../.."), PathBuf::from("/sys/fs/cgroup"));
    }

    #[test]
    fn v2_limit_of_the_leaf() {
        let read = fake_files(&[
            ("/sys/fs/cgroup/app/memory.max", "4294967296\n"),
            ("/sys/fs/cgroup/app/memory.current", "1073741824\n"),
            ("/sys/fs/cgroup/app/memory.stat", "anon 536870912\ninactive_file 268435456\nactive_file 1\n"),
        ]);
        let mounts = parse_mountinfo("41 31 0:38 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n");
        let cgroups = parse_process_cgroups("0::/app\n");
        let limit = process_cgroup_limit(&cgroups, &mounts, &read).unwrap();
        assert_eq!(limit.version, 2);
        assert_eq!(limit.limit_bytes, 4 * GIB);
        assert_eq!(limit.usage_bytes, GIB);
        assert_eq!(limit.inactive_file_bytes, GIB / 4);
        assert_eq!(limit.path, PathBuf::from("/sys/fs/cgroup/app"));
        // 4 GiB limit - (1 GiB usage - 0.25 GiB reclaimable cache).
        assert_eq!(limit.headroom_bytes(), 4 * GIB - 3 * GIB / 4);
        let memory = MemoryInfo { total_bytes: 64 * GIB, available_bytes: 60 * GIB, cgroup: Some(limit) };
        assert_eq!(memory.effective_available_bytes(), 4 * GIB - 3 * GIB / 4);
    }

    #[test]
    fn v2_unlimited_everywhere_is_none() {
        let read = fake_files(&[
            ("/sys/fs/cgroup/a/b/memory.max", "max\n"),
            ("/sys/fs/cgroup/a/b/memory.current", "1000\n"),
            ("/sys/fs/cgroup/a/memory.max", "max\n"),
        ]);
        let cgroups = parse_process_cgroups("0::/a/b\n");
        assert_eq!(process_cgroup_limit(&cgroups, &[], &read), None);
        let memory = MemoryInfo { total_bytes: 8 * GIB, available_bytes: 5 * GIB, cgroup: None };
        assert_eq!(memory.effective_available_bytes(), 5 * GIB);
    }

    #[test]
    fn v2_nested_parent_with_the_smaller_limit_wins() {
        let read = fake_files(&[
            ("/sys/fs/cgroup/a/b/c/memory.max", "max\n"),
            ("/sys/fs/cgroup/a/b/memory.max", "17179869184\n"), // 16 GiB
            ("/sys/fs/cgroup/a/b/memory.current", "1073741824\n"),
            ("/sys/fs/cgroup/a/memory.max", "2147483648\n"), // 2 GiB: the binding one
            ("/sys/fs/cgroup/a/memory.current", "536870912\n"),
            // A limit file outside the mount must never be read.
            ("/sys/fs/memory.max", "1\n"),
        ]);
        let cgroups = parse_process_cgroups("0::/a/b/c\n");
        let limit = process_cgroup_limit(&cgroups, &[], &read).unwrap();
        assert_eq!(limit.path, PathBuf::from("/sys/fs/cgroup/a"));
        assert_eq!((limit.limit_bytes, limit.usage_bytes), (2 * GIB, GIB / 2));
        assert_eq!(limit.headroom_bytes(), 3 * GIB / 2);
    }

    #[test]
    fn v1_limit_with_unlimited_sentinel_and_nested_minimum() {
        let mounts = parse_mountinfo("35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n");
        let cgroups = parse_process_cgroups("4:memory:/process_api/job\n0::/\n");
        // Leaf unlimited (the v1 sentinel), parent limited to 8 GiB.
        let read = fake_files(&[
            ("/sys/fs/cgroup/memory/process_api/job/memory.limit_in_bytes", "9223372036854771712\n"),
            ("/sys/fs/cgroup/memory/process_api/job/memory.usage_in_bytes", "48574464\n"),
            ("/sys/fs/cgroup/memory/process_api/memory.limit_in_bytes", "8589934592\n"),
            ("/sys/fs/cgroup/memory/process_api/memory.usage_in_bytes", "2147483648\n"),
            (
                "/sys/fs/cgroup/memory/process_api/memory.stat",
                "cache 5\ninactive_file 7\ntotal_inactive_file 1073741824\n",
            ),
            ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n"),
        ]);
        let limit = process_cgroup_limit(&cgroups, &mounts, &read).unwrap();
        assert_eq!(limit.version, 1);
        assert_eq!(limit.path, PathBuf::from("/sys/fs/cgroup/memory/process_api"));
        assert_eq!(limit.limit_bytes, 8 * GIB);
        assert_eq!(limit.inactive_file_bytes, GIB, "v1 uses the hierarchical total_inactive_file");
        assert_eq!(limit.headroom_bytes(), 7 * GIB);

        // Everything unlimited: no cgroup limit at all.
        let unlimited = fake_files(&[
            ("/sys/fs/cgroup/memory/process_api/job/memory.limit_in_bytes", "9223372036854771712\n"),
            ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n"),
        ]);
        assert_eq!(process_cgroup_limit(&cgroups, &mounts, &unlimited), None);
    }

    #[test]
    fn the_tighter_of_v1_and_v2_wins_on_hybrid_hosts() {
        let mounts = parse_mountinfo(
            "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n\
             41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n",
        );
        let cgroups = parse_process_cgroups("4:memory:/job\n0::/job\n");
        let read = fake_files(&[
            ("/sys/fs/cgroup/memory/job/memory.limit_in_bytes", "4294967296\n"),
            ("/sys/fs/cgroup/memory/job/memory.usage_in_bytes", "0\n"),
            ("/sys/fs/cgroup/unified/job/memory.max", "3221225472\n"),
            ("/sys/fs/cgroup/unified/job/memory.current", "0\n"),
        ]);
        let limit = process_cgroup_limit(&cgroups, &mounts, &read).unwrap();
        assert_eq!((limit.version, limit.limit_bytes), (2, 3 * GIB));
    }

    #[test]
    fn live_memory_info_is_consistent() {
        let memory = memory_info();
        assert!(memory.total_bytes > 0);
        assert!(memory.available_bytes <= memory.total_bytes);
        assert!(memory.effective_available_bytes() <= memory.available_bytes);
    }
}

/// This process's peak resident set (VmHWM), for reports and the budget tests.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    parse_status_kib(&status, "VmHWM:").map(|kib| kib * 1024)
}

fn parse_status_kib(status: &str, key: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|line| line.strip_prefix(key))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|number| number.parse().ok())
}

#[cfg(test)]
mod peak_tests {
    #[test]
    fn parses_vm_hwm() {
        let status = "Name:\thypura\nVmPeak:\t  900 kB\nVmHWM:\t    1234 kB\nVmRSS:\t 1000 kB\n";
        assert_eq!(super::parse_status_kib(status, "VmHWM:"), Some(1234));
        assert!(super::peak_rss_bytes().is_some_and(|bytes| bytes > 0));
    }
}
