//! CPU identity, core counts and SIMD extensions. The planner uses the core count for thread
//! counts, and the SIMD list explains CPU matmul speed in reports.

use std::collections::BTreeSet;
use std::path::Path;

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuInfo {
    pub model_name: String,
    /// Hardware threads the kernel knows about.
    pub logical_cores: u32,
    /// Distinct (package, core) pairs; equals `logical_cores` without SMT.
    pub physical_cores: u32,
    /// Threads this process may actually use (affinity mask and cgroup CPU quota applied).
    pub available_parallelism: u32,
    /// SIMD extensions usable here, from: sse4_2 avx avx2 fma f16c avx_vnni avx512f avx512bw
    /// avx512vl avx512vnni avx512_bf16 amx_tile amx_int8 amx_bf16 (x86_64); neon fp16 dotprod
    /// i8mm bf16 sve sve2 (aarch64).
    pub simd: Vec<String>,
}

/// What /proc/cpuinfo says, parsed without touching the system.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct CpuinfoFacts {
    pub model_name: Option<String>,
    pub logical_cores: usize,
    /// `None` when the file has no "physical id"/"core id" lines (most ARM kernels).
    pub physical_cores: Option<usize>,
    /// The "flags" (x86) or "Features" (ARM) words of the first processor.
    pub flags: BTreeSet<String>,
}

pub(crate) fn parse_cpuinfo(contents: &str) -> CpuinfoFacts {
    let mut facts = CpuinfoFacts::default();
    let mut implementer = None;
    let mut part = None;
    let mut physical_id = None;
    let mut core_pairs = BTreeSet::new();
    let mut saw_flags = false;
    for line in contents.lines() {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let (key, value) = (key.trim(), value.trim());
        match key {
            "processor" => facts.logical_cores += 1,
            "model name" | "Hardware" if facts.model_name.is_none() && !value.is_empty() => {
                facts.model_name = Some(value.to_string());
            }
            "CPU implementer" if implementer.is_none() => implementer = Some(value.to_string()),
            "CPU part" if part.is_none() => part = Some(value.to_string()),
            "physical id" => physical_id = Some(value.to_string()),
            "core id" => {
                core_pairs.insert((physical_id.clone().unwrap_or_default(), value.to_string()));
            }
            "flags" | "Features" if !saw_flags => {
                saw_flags = true;
                facts.flags = value.split_whitespace().map(str::to_string).collect();
            }
            _ => {}
        }
    }
    if facts.model_name.is_none() {
        if let (Some(implementer), Some(part)) = (implementer, part) {
            facts.model_name = Some(format!("ARM implementer {implementer} part {part}"));
        }
    }
    if !core_pairs.is_empty() {
        facts.physical_cores = Some(core_pairs.len());
    }
    facts
}

/// Read the CPU's identity and features from /proc/cpuinfo, sysfs and CPUID.
pub fn cpu_info() -> CpuInfo {
    let facts = parse_cpuinfo(&std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default());
    let available_parallelism = std::thread::available_parallelism().map(|count| count.get()).unwrap_or(1);
    let logical_cores = if facts.logical_cores > 0 { facts.logical_cores } else { available_parallelism };
    let physical_cores =
        sysfs_physical_cores(Path::new("/sys/devices/system/cpu")).or(facts.physical_cores).unwrap_or(logical_cores);
    CpuInfo {
        model_name: facts.model_name.clone().unwrap_or_else(|| std::env::consts::ARCH.to_string()),
        logical_cores: logical_cores as u32,
        physical_cores: physical_cores as u32,
        available_parallelism: available_parallelism as u32,
        simd: simd_extensions(&facts.flags),
    }
}

/// Distinct (package, core) pairs in sysfs topology, which exists on every architecture.
fn sysfs_physical_cores(cpu_directory: &Path) -> Option<usize> {
    let mut pairs = BTreeSet::new();
    for entry in std::fs::read_dir(cpu_directory).ok()?.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let is_cpu = name
            .strip_prefix("cpu")
            .is_some_and(|digits| !digits.is_empty() && digits.bytes().all(|byte| byte.is_ascii_digit()));
        if !is_cpu {
            continue;
        }
        let topology = entry.path().join("topology");
        let read = |file: &str| std::fs::read_to_string(topology.join(file)).ok().map(|text| text.trim().to_string());
        if let (Some(package), Some(core)) = (read("physical_package_id"), read("core_id")) {
            pairs.insert((package, core));
        }
    }
    (!pairs.is_empty()).then_some(pairs.len())
}

/// SIMD extensions, detected with CPUID where std offers a stable check, and from the kernel's
/// flag list where it does not (AMX detection is still unstable in std).
fn simd_extensions(cpuinfo_flags: &BTreeSet<String>) -> Vec<String> {
    let mut found: Vec<&str> = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as detected;
        let checks = [
            ("sse4_2", detected!("sse4.2")),
            ("avx", detected!("avx")),
            ("avx2", detected!("avx2")),
            ("fma", detected!("fma")),
            ("f16c", detected!("f16c")),
            ("avx_vnni", detected!("avxvnni")),
            ("avx512f", detected!("avx512f")),
            ("avx512bw", detected!("avx512bw")),
            ("avx512vl", detected!("avx512vl")),
            ("avx512vnni", detected!("avx512vnni")),
            ("avx512_bf16", detected!("avx512bf16")),
        ];
        found.extend(checks.iter().filter(|(_, present)| *present).map(|(name, _)| *name));
        for flag in ["amx_tile", "amx_int8", "amx_bf16"] {
            if cpuinfo_flags.contains(flag) {
                found.push(flag);
            }
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        use std::arch::is_aarch64_feature_detected as detected;
        let checks = [
            ("neon", detected!("neon")),
            ("fp16", detected!("fp16")),
            ("dotprod", detected!("dotprod")),
            ("i8mm", detected!("i8mm")),
            ("bf16", detected!("bf16")),
            ("sve", detected!("sve")),
            ("sve2", detected!("sve2")),
        ];
        found.extend(checks.iter().filter(|(_, present)| *present).map(|(name, _)| *name));
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = cpuinfo_flags;
    found.into_iter().map(str::to_string).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const X86_SMT: &str = "\
processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
physical id\t: 0
core id\t\t: 0
flags\t\t: fpu sse4_2 avx avx2 amx_tile avx512f
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
physical id\t: 0
core id\t\t: 0
flags\t\t: fpu sse4_2 avx avx2 amx_tile avx512f
processor\t: 2
physical id\t: 0
core id\t\t: 1
processor\t: 3
physical id\t: 1
core id\t\t: 0
";

    const ARM: &str = "\
processor\t: 0
BogoMIPS\t: 48.00
Features\t: fp asimd evtstrm aes sve
CPU implementer\t: 0x41
CPU part\t: 0xd0c

processor\t: 1
Features\t: fp asimd evtstrm aes sve
CPU implementer\t: 0x41
CPU part\t: 0xd0c
";

    #[test]
    fn parses_x86_cpuinfo_with_smt_and_two_packages() {
        let facts = parse_cpuinfo(X86_SMT);
        assert_eq!(facts.model_name.as_deref(), Some("Intel(R) Xeon(R) Platinum 8480+"));
        assert_eq!(facts.logical_cores, 4);
        // (0,0) twice (SMT siblings), (0,1), and (1,0) on the second package.
        assert_eq!(facts.physical_cores, Some(3));
        assert!(facts.flags.contains("amx_tile"));
        assert!(facts.flags.contains("avx2"));
    }

    #[test]
    fn parses_arm_cpuinfo_without_core_ids() {
        let facts = parse_cpuinfo(ARM);
        assert_eq!(facts.model_name.as_deref(), Some("ARM implementer 0x41 part 0xd0c"));
        assert_eq!(facts.logical_cores, 2);
        assert_eq!(facts.physical_cores, None);
        assert!(facts.flags.contains("sve"));
    }

    #[test]
    fn live_cpu_info_is_consistent() {
        let info = cpu_info();
        assert!(info.logical_cores >= 1);
        assert!(info.physical_cores >= 1 && info.physical_cores <= info.logical_cores);
        assert!(info.available_parallelism >= 1 && info.available_parallelism <= info.logical_cores);
        assert!(!info.model_name.is_empty());
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            assert!(info.simd.iter().any(|name| name == "avx2"), "{:?}", info.simd);
        }
    }
}
