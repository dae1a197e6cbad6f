//! The profile cache: one JSON file per machine, so the tens of seconds of disk measurement are
//! paid once, not on every run. The key changes when the machine does (another host, CPU or RAM
//! size), which makes a stale profile unreachable rather than wrong.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use super::cpu::parse_cpuinfo;
use super::memory::parse_meminfo;
use super::{HwError, Profile, PROFILE_SCHEMA_VERSION};

/// Stable id of this machine: a hash of host name, CPU model and total RAM, as 16 hex digits.
pub fn machine_key() -> String {
    let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
    let hostname = read("/proc/sys/kernel/hostname");
    let cpu_model = parse_cpuinfo(&read("/proc/cpuinfo")).model_name.unwrap_or_default();
    let total_ram_bytes = parse_meminfo(&read("/proc/meminfo")).map_or(0, |(total, _)| total);
    machine_key_from(hostname.trim(), &cpu_model, total_ram_bytes)
}

fn machine_key_from(hostname: &str, cpu_model: &str, total_ram_bytes: u64) -> String {
    format!("{:016x}", fnv1a(&[hostname.as_bytes(), cpu_model.as_bytes(), &total_ram_bytes.to_le_bytes()]))
}

/// FNV-1a over `fields`, rather than std's hasher, whose output may change between Rust
/// releases and would silently orphan every cached file. A separator byte after each field
/// keeps ("ab", "c") and ("a", "bc") apart.
pub(crate) fn fnv1a(fields: &[&[u8]]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for field in fields {
        for &byte in field.iter().chain([&0xffu8]) {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    }
    hash
}

/// Where profiles live: `$HYPURA_CACHE_DIR` if set, else the platform cache directory plus
/// "hypura" (`~/.cache/hypura` on Linux), else `~/.cache/hypura`, else a temp-dir folder.
pub fn default_cache_dir() -> PathBuf {
    cache_dir_from(std::env::var_os("HYPURA_CACHE_DIR"), dirs::cache_dir(), dirs::home_dir())
}

fn cache_dir_from(environment: Option<OsString>, platform_cache: Option<PathBuf>, home: Option<PathBuf>) -> PathBuf {
    if let Some(directory) = environment.filter(|value| !value.is_empty()) {
        return PathBuf::from(directory);
    }
    if let Some(cache) = platform_cache {
        return cache.join("hypura");
    }
    match home {
        Some(home) => home.join(".cache").join("hypura"),
        None => std::env::temp_dir().join("hypura-cache"),
    }
}

/// JSON profiles under one directory (the caller passes `<cache dir>/hypura`).
#[derive(Clone, Debug)]
pub struct ProfileCache {
    dir: PathBuf,
}

impl ProfileCache {
    pub fn new(dir: impl Into<PathBuf>) -> ProfileCache {
        ProfileCache { dir: dir.into() }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `<dir>/profile-<machine_key>.json`.
    pub fn path_for(&self, machine_key: &str) -> PathBuf {
        // Keys are hex, but keep the file name safe whatever a caller passes.
        let safe_key: String = machine_key
            .chars()
            .map(|character| if character.is_ascii_alphanumeric() || character == '-' { character } else { '_' })
            .collect();
        self.dir.join(format!("profile-{safe_key}.json"))
    }

    /// The cached profile for `machine_key`, or `None` if there is none, it is unreadable, or it
    /// was written by another schema version or for another machine (then it is re-measured).
    pub fn load(&self, machine_key: &str) -> Option<Profile> {
        let path = self.path_for(machine_key);
        let text = std::fs::read_to_string(&path).ok()?;
        let profile: Profile = match serde_json::from_str(&text) {
            Ok(profile) => profile,
            Err(error) => {
                tracing::warn!(path = %path.display(), %error, "ignoring unreadable cached profile");
                return None;
            }
        };
        if profile.schema_version != PROFILE_SCHEMA_VERSION || profile.machine_key != machine_key {
            tracing::info!(path = %path.display(), "cached profile is for another schema or machine; ignoring it");
            return None;
        }
        Some(profile)
    }

    /// Write `profile` under its own machine key, creating the directory. Written to a temporary
    /// name and renamed, so a crash never leaves half a JSON file to be read back.
    pub fn save(&self, profile: &Profile) -> Result<PathBuf, HwError> {
        let path = self.path_for(&profile.machine_key);
        write_json_atomically(&self.dir, &path, profile)?;
        Ok(path)
    }
}

/// Write `value` as JSON to `path` in `dir` (created if needed), through a temporary name and a
/// rename, so a crash never leaves half a file to be read back.
pub(crate) fn write_json_atomically(dir: &Path, path: &Path, value: &impl serde::Serialize) -> Result<(), HwError> {
    std::fs::create_dir_all(dir).map_err(|source| HwError::file("create cache directory", dir, source))?;
    let json = serde_json::to_string_pretty(value)
        .map_err(|source| HwError::CacheFormat { path: path.to_path_buf(), source })?;
    let temporary = path.with_extension(format!("json.tmp-{}", std::process::id()));
    std::fs::write(&temporary, json).map_err(|source| HwError::file("write", &temporary, source))?;
    std::fs::rename(&temporary, path).map_err(|source| {
        let _ = std::fs::remove_file(&temporary);
        HwError::file("rename into place", path, source)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hw::test_support::sample_profile;

    #[test]
    fn save_then_load_round_trips_and_other_keys_miss() {
        let directory = tempfile::tempdir().unwrap();
        let cache = ProfileCache::new(directory.path().join("hypura"));
        let profile = sample_profile();
        let path = cache.save(&profile).unwrap();
        assert_eq!(path, directory.path().join("hypura/profile-0123456789abcdef.json"));
        assert_eq!(cache.load(&profile.machine_key), Some(profile.clone()));
        assert_eq!(cache.load("fedcba9876543210"), None);
        // Only the final file remains, no temporary.
        assert_eq!(std::fs::read_dir(cache.dir()).unwrap().count(), 1);
    }

    #[test]
    fn stale_schema_mismatched_key_and_garbage_are_misses() {
        let directory = tempfile::tempdir().unwrap();
        let cache = ProfileCache::new(directory.path());
        let mut old = sample_profile();
        old.schema_version = PROFILE_SCHEMA_VERSION + 1;
        cache.save(&old).unwrap();
        assert_eq!(cache.load(&old.machine_key), None);

        // A file renamed by hand to another machine's key is not trusted.
        let profile = sample_profile();
        cache.save(&profile).unwrap();
        std::fs::copy(cache.path_for(&profile.machine_key), cache.path_for("aaaaaaaaaaaaaaaa")).unwrap();
        assert_eq!(cache.load("aaaaaaaaaaaaaaaa"), None);

        std::fs::write(cache.path_for("bbbbbbbbbbbbbbbb"), "{ not json").unwrap();
        assert_eq!(cache.load("bbbbbbbbbbbbbbbb"), None);
    }

    #[test]
    fn json_uses_documented_field_names() {
        let json = serde_json::to_value(sample_profile()).unwrap();
        assert_eq!(json["memory"]["cgroup"]["limit_bytes"], 8u64 << 30);
        assert_eq!(json["disk"]["best_direct"]["block_bytes"], 16u64 << 20);
        assert_eq!(json["disk"]["random_1mib"]["queue_depth"], 16);
        assert_eq!(json["disk"]["buffered_bytes_per_sec"], 1.2e9);
        assert_eq!(json["devices"][0]["kind"], "gpu");
    }

    #[test]
    fn machine_key_is_stable_and_sensitive_to_each_field() {
        let key = machine_key_from("host", "AMD EPYC", 24 << 30);
        assert_eq!(key.len(), 16);
        assert_eq!(key, machine_key_from("host", "AMD EPYC", 24 << 30));
        assert_ne!(key, machine_key_from("host2", "AMD EPYC", 24 << 30));
        assert_ne!(key, machine_key_from("host", "AMD EPYC 9654", 24 << 30));
        assert_ne!(key, machine_key_from("host", "AMD EPYC", 48 << 30));
        assert_ne!(machine_key_from("ab", "c", 0), machine_key_from("a", "bc", 0));
        // Pinned (computed independently in Python), so a change of hash, which orphans every
        // cached profile, is a deliberate one.
        assert_eq!(key, "799958f4df31eaf3");
        assert_eq!(machine_key(), machine_key());
    }

    #[test]
    fn cache_dir_precedence() {
        let platform = Some(PathBuf::from("/home/u/.cache"));
        let home = Some(PathBuf::from("/home/u"));
        assert_eq!(
            cache_dir_from(Some("/srv/cache".into()), platform.clone(), home.clone()),
            PathBuf::from("/srv/cache")
        );
        assert_eq!(
            cache_dir_from(Some("".into()), platform.clone(), home.clone()),
            PathBuf::from("/home/u/.cache/hypura")
        );
        assert_eq!(cache_dir_from(None, platform, home.clone()), PathBuf::from("/home/u/.cache/hypura"));
        assert_eq!(cache_dir_from(None, None, home), PathBuf::from("/home/u/.cache/hypura"));
    }
}
