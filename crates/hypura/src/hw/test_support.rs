//! A fully populated profile shared by the cache and render tests.

use std::path::PathBuf;

use super::{CgroupLimit, CpuInfo, DeviceInfo, DiskProfile, MemoryInfo, Profile, ReadPoint, PROFILE_SCHEMA_VERSION};

pub(crate) fn point(block_bytes: u64, queue_depth: u32, bytes_per_sec: f64) -> ReadPoint {
    ReadPoint {
        block_bytes,
        queue_depth,
        bytes_per_sec,
        bytes_read: 1 << 29,
        seconds: (1u64 << 29) as f64 / bytes_per_sec,
    }
}

pub(crate) fn sample_profile() -> Profile {
    let mib = 1u64 << 20;
    let direct: Vec<ReadPoint> = [mib, 4 * mib, 16 * mib]
        .iter()
        .flat_map(|&block| {
            [1u32, 4, 16]
                .map(|depth| point(block, depth, 0.5e9 * (block / mib) as f64 / 4.0 + 0.1e9 * f64::from(depth)))
        })
        .collect();
    let best_direct =
        direct.iter().max_by(|left, right| left.bytes_per_sec.total_cmp(&right.bytes_per_sec)).cloned().unwrap();
    Profile {
        schema_version: PROFILE_SCHEMA_VERSION,
        machine_key: "0123456789abcdef".to_string(),
        measured_at_unix_secs: 1_738_332_309,
        cpu: CpuInfo {
            model_name: "AMD EPYC".to_string(),
            logical_cores: 2,
            physical_cores: 2,
            available_parallelism: 2,
            simd: vec!["avx2".to_string(), "avx512_bf16".to_string()],
        },
        memory: MemoryInfo {
            total_bytes: 24 << 30,
            available_bytes: 22 << 30,
            cgroup: Some(CgroupLimit {
                version: 1,
                limit_bytes: 8 << 30,
                usage_bytes: 3 << 30,
                inactive_file_bytes: 1 << 30,
                path: PathBuf::from("/sys/fs/cgroup/memory/job"),
            }),
        },
        devices: vec![DeviceInfo {
            name: "CUDA0".to_string(),
            description: "NVIDIA H200".to_string(),
            kind: "gpu".to_string(),
            free_bytes: 140 << 30,
            total_bytes: 143 << 30,
            unified_memory: false,
            host_to_device_bytes_per_sec: Some(25e9),
        }],
        disk: Some(DiskProfile {
            probe_path: PathBuf::from("/work"),
            volume: "/dev/vda at /".to_string(),
            filesystem: "ext4".to_string(),
            direct_supported: true,
            direct,
            random_1mib: point(mib, 16, 1.7e9),
            buffered_bytes_per_sec: 1.2e9,
            best_direct,
            file_bytes: 1 << 30,
            scratch_file: true,
            sustained: Some(point(4 * mib, 16, 1.9e9)),
        }),
    }
}
