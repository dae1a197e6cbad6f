//! `hypura profile`: print the cached hardware profile, or measure it (`--refresh`, or when
//! none is cached for this machine).
use anyhow::Context;

use crate::cli::args::ProfileArgs;
use crate::hw::{default_cache_dir, machine_key, DeviceInfo, DiskOptions, Profile, ProfileCache};

/// Bytes each host-to-device copy measurement moves: large enough to reach the link's rate.
const HOST_TO_DEVICE_PROBE_BYTES: usize = 256 << 20;

/// ggml's devices, as the profile stores them, with the host-to-device copy rate of each
/// dedicated device.
pub fn ggml_devices() -> Vec<DeviceInfo> {
    let backend = hypura_sys::Backend::get();
    backend
        .devices()
        .into_iter()
        .enumerate()
        .map(|(index, device)| DeviceInfo {
            host_to_device_bytes_per_sec: (!device.kind.unified_memory())
                .then(|| {
                    backend.host_to_device_bytes_per_sec(
                        index,
                        HOST_TO_DEVICE_PROBE_BYTES.min(device.free_bytes as usize / 4),
                        3,
                    )
                })
                .flatten(),
            name: device.name,
            description: device.description,
            kind: device.kind.as_str().to_string(),
            free_bytes: device.free_bytes,
            total_bytes: device.total_bytes,
            unified_memory: device.kind.unified_memory(),
        })
        .collect()
}

pub fn run(args: &ProfileArgs) -> anyhow::Result<()> {
    let cache_dir = default_cache_dir();
    let cache = ProfileCache::new(&cache_dir);
    let cached = if args.refresh { None } else { cache.load(&machine_key()) };
    let profile = match cached {
        Some(mut profile) => {
            profile.refresh_memory();
            profile
        }
        None => {
            let probe = args.path.clone().unwrap_or_else(|| cache_dir.clone());
            std::fs::create_dir_all(&cache_dir).with_context(|| format!("creating {}", cache_dir.display()))?;
            let bar = crate::cli::progress::bytes_bar("measuring disk");
            let profile = Profile::measure(ggml_devices(), Some(&probe), &DiskOptions::default(), &|done, total| {
                bar.set_length(total);
                bar.set_position(done);
            })?;
            bar.finish_and_clear();
            let saved = cache.save(&profile)?;
            tracing::info!("saved profile to {}", saved.display());
            profile
        }
    };
    crate::cli::settings::use_rpc_key(args.rpc_key_file.as_deref())?;
    let links = args
        .rpc
        .iter()
        .map(|worker| crate::remote::profile_link(worker.trim(), LINK_PINGS, LINK_PROBE_BYTES))
        .collect::<Result<Vec<_>, _>>()?;
    if args.json {
        let mut value = serde_json::to_value(&profile)?;
        if !links.is_empty() {
            value["links"] = serde_json::to_value(&links)?;
        }
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        print!("{}", profile.render_human());
        for link in &links {
            let rate = |rate: Option<f64>| rate.map_or_else(|| "n/a".to_string(), crate::format::format_bytes_per_sec);
            println!(
                "link {}: round trip {:.3} ms median, {:.3} ms p90; {} up, {} down",
                link.worker,
                link.round_trip_median_secs * 1e3,
                link.round_trip_p90_secs * 1e3,
                rate(link.upload_bytes_per_sec),
                rate(link.download_bytes_per_sec)
            );
            for (name, free, total) in &link.devices {
                println!(
                    "  {name}: {} free of {}",
                    crate::format::format_bytes(*free),
                    crate::format::format_bytes(*total)
                );
            }
        }
    }
    Ok(())
}

/// Round trips timed per link, and bytes moved each way to time its rate.
const LINK_PINGS: usize = 50;
const LINK_PROBE_BYTES: usize = 64 << 20;
