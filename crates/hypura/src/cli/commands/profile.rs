//! `hypura profile`: print the cached hardware profile, or measure it (`--refresh`, or when
//! none is cached for this machine).
use anyhow::Context;

use crate::cli::args::ProfileArgs;
use crate::hw::{default_cache_dir, machine_key, DeviceInfo, DiskOptions, Profile, ProfileCache};

/// ggml's devices, as the profile stores them.
pub fn ggml_devices() -> Vec<DeviceInfo> {
    hypura_sys::Backend::get()
        .devices()
        .into_iter()
        .map(|device| DeviceInfo {
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
    if args.json {
        println!("{}", serde_json::to_string_pretty(&profile)?);
    } else {
        print!("{}", profile.render_human());
    }
    Ok(())
}
