//! The human-readable profile printed by `hypura profile` (the JSON form is the struct itself).

use std::collections::BTreeSet;
use std::fmt::Write;

use super::{DiskProfile, Profile};
use crate::format::{format_bytes, format_bytes_per_sec, format_unix_time_utc};

const LABEL_WIDTH: usize = 9;

pub(super) fn render_profile(profile: &Profile) -> String {
    let mut out = String::new();
    let indent = " ".repeat(LABEL_WIDTH);
    // Writing to a String cannot fail; the results are ignored for brevity.
    let _ = writeln!(
        out,
        "Hypura hardware profile (machine {}, measured {})",
        profile.machine_key,
        format_unix_time_utc(profile.measured_at_unix_secs)
    );

    let cpu = &profile.cpu;
    let _ = writeln!(out, "\n{:<LABEL_WIDTH$}{}", "CPU", cpu.model_name);
    let _ = writeln!(
        out,
        "{indent}{} logical / {} physical cores, {} usable by this process",
        cpu.logical_cores, cpu.physical_cores, cpu.available_parallelism
    );
    let simd = if cpu.simd.is_empty() { "none detected".to_string() } else { cpu.simd.join(" ") };
    let _ = writeln!(out, "{indent}SIMD: {simd}");

    let memory = &profile.memory;
    let _ = writeln!(
        out,
        "\n{:<LABEL_WIDTH$}total {}, available {}",
        "RAM",
        format_bytes(memory.total_bytes),
        format_bytes(memory.available_bytes)
    );
    match &memory.cgroup {
        Some(cgroup) => {
            let _ = writeln!(
                out,
                "{indent}cgroup v{} limit {}, usage {} ({} reclaimable cache) at {}",
                cgroup.version,
                format_bytes(cgroup.limit_bytes),
                format_bytes(cgroup.usage_bytes),
                format_bytes(cgroup.inactive_file_bytes),
                cgroup.path.display()
            );
        }
        None => {
            let _ = writeln!(out, "{indent}no cgroup memory limit");
        }
    }
    let _ = writeln!(out, "{indent}effective available {}", format_bytes(memory.effective_available_bytes()));

    let _ = writeln!(out, "\nDevices");
    if profile.devices.is_empty() {
        let _ = writeln!(out, "{indent}none listed");
    } else {
        let name_width = profile.devices.iter().map(|device| device.name.len()).max().unwrap_or(0).max(4);
        let _ = writeln!(
            out,
            "{indent}{:<name_width$}  {:<5}  {:>11}  {:>11}  {:<9}  description",
            "name", "kind", "free", "total", "memory"
        );
        for device in &profile.devices {
            let _ = writeln!(
                out,
                "{indent}{:<name_width$}  {:<5}  {:>11}  {:>11}  {:<9}  {}",
                device.name,
                device.kind,
                format_bytes(device.free_bytes),
                format_bytes(device.total_bytes),
                if device.unified_memory { "unified" } else { "dedicated" },
                match device.host_to_device_bytes_per_sec {
                    Some(rate) => format!("{} (host to device {})", device.description, format_bytes_per_sec(rate)),
                    None => device.description.clone(),
                }
            );
        }
    }

    match &profile.disk {
        Some(disk) => render_disk(&mut out, disk, &indent),
        None => {
            let _ = writeln!(out, "\n{:<LABEL_WIDTH$}not measured", "Disk");
        }
    }
    out
}

fn render_disk(out: &mut String, disk: &DiskProfile, indent: &str) {
    let source = if disk.scratch_file {
        format!("scratch file of {}", format_bytes(disk.file_bytes))
    } else {
        format!("existing file of {}", format_bytes(disk.file_bytes))
    };
    let _ = writeln!(
        out,
        "\n{:<LABEL_WIDTH$}{} on {} ({}), {source}",
        "Disk",
        disk.probe_path.display(),
        disk.volume,
        disk.filesystem
    );
    if !disk.direct_supported {
        let _ =
            writeln!(out, "{indent}O_DIRECT not supported: \"direct\" figures are page-cache reads of an evicted file");
    }
    let blocks: BTreeSet<u64> = disk.direct.iter().map(|point| point.block_bytes).collect();
    let depths: BTreeSet<u32> = disk.direct.iter().map(|point| point.queue_depth).collect();
    let _ = write!(out, "{indent}sequential direct reads, GB/s\n{indent}{:>9}", "block");
    for depth in &depths {
        let _ = write!(out, "{:>9}", format!("QD {depth}"));
    }
    out.push('\n');
    for &block in &blocks {
        let _ = write!(out, "{indent}{:>9}", block_label(block));
        for &depth in &depths {
            let cell = disk
                .direct
                .iter()
                .find(|point| point.block_bytes == block && point.queue_depth == depth)
                .map_or_else(|| "-".to_string(), |point| format!("{:.2}", point.bytes_per_sec / 1e9));
            let _ = write!(out, "{cell:>9}");
        }
        out.push('\n');
    }
    let best = &disk.best_direct;
    let _ = writeln!(
        out,
        "{indent}best direct       {} ({} blocks, QD {})",
        format_bytes_per_sec(best.bytes_per_sec),
        block_label(best.block_bytes),
        best.queue_depth
    );
    if let Some(sustained) = &disk.sustained {
        let _ = writeln!(
            out,
            "{indent}sustained         {} ({} chunks, QD {}, {} over {:.1} s: what streaming plans with)",
            format_bytes_per_sec(sustained.bytes_per_sec),
            block_label(sustained.block_bytes),
            sustained.queue_depth,
            format_bytes(sustained.bytes_read),
            sustained.seconds
        );
    }
    let random = &disk.random_1mib;
    let _ = writeln!(
        out,
        "{indent}random {:<10} {} (QD {})",
        block_label(random.block_bytes),
        format_bytes_per_sec(random.bytes_per_sec),
        random.queue_depth
    );
    let _ = writeln!(
        out,
        "{indent}buffered          {} (sequential, from an evicted page cache)",
        format_bytes_per_sec(disk.buffered_bytes_per_sec)
    );
}

/// "1 MiB", "64 KiB": exact sizes for table labels, where "1.00 MiB" would be noise.
fn block_label(bytes: u64) -> String {
    if bytes > 0 && bytes.trailing_zeros() >= 20 {
        format!("{} MiB", bytes >> 20)
    } else if bytes > 0 && bytes.trailing_zeros() >= 10 {
        format!("{} KiB", bytes >> 10)
    } else {
        format!("{bytes} B")
    }
}

#[cfg(test)]
mod tests {
    use crate::hw::test_support::sample_profile;

    #[test]
    fn renders_every_section_with_units() {
        let text = sample_profile().render_human();
        eprintln!("{text}");
        for expected in [
            "machine 0123456789abcdef, measured 2025-01-31 14:05:09 UTC",
            "AMD EPYC",
            "2 logical / 2 physical cores",
            "SIMD: avx2 avx512_bf16",
            "total 24.0 GiB, available 22.0 GiB",
            "cgroup v1 limit 8.00 GiB, usage 3.00 GiB (1.00 GiB reclaimable cache)",
            // 8 GiB - (3 GiB - 1 GiB reclaimable).
            "effective available 6.00 GiB",
            "CUDA0",
            "140.0 GiB",
            "dedicated",
            "/work on /dev/vda at / (ext4), scratch file of 1.00 GiB",
            "best direct       3.60 GB/s (16 MiB blocks, QD 16)",
            "random 1 MiB      1.70 GB/s (QD 16)",
            "buffered          1.20 GB/s",
        ] {
            assert!(text.contains(expected), "missing {expected:?} in\n{text}");
        }
    }

    #[test]
    fn disk_table_is_blocks_by_queue_depths() {
        let text = sample_profile().render_human();
        let header = text.lines().find(|line| line.contains("QD 1")).expect("table header");
        let columns: Vec<&str> = header.split_whitespace().collect();
        assert_eq!(columns, ["block", "QD", "1", "QD", "4", "QD", "16"]);
        // Sample rates are 0.5 GB/s × block/4 MiB + 0.1 GB/s × depth.
        let row = text.lines().find(|line| line.trim_start().starts_with("4 MiB")).expect("4 MiB row");
        let cells: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(cells, ["4", "MiB", "0.60", "0.90", "2.10"]);
    }

    #[test]
    fn missing_disk_and_cgroup_are_stated() {
        let mut profile = sample_profile();
        profile.disk = None;
        profile.memory.cgroup = None;
        profile.devices.clear();
        let text = profile.render_human();
        assert!(text.contains("not measured"));
        assert!(text.contains("no cgroup memory limit"));
        assert!(text.contains("none listed"));
        assert!(text.contains("effective available 22.0 GiB"));
    }
}
