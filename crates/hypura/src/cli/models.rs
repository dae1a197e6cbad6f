//! A command's model argument as a file: a GGUF path, a hub name (`hf.co/...`, pulled first
//! with its progress where it is not yet, as `ollama run` does), and the hub's pulls with their
//! progress, which `pull`, `run`, `serve`, `bench` and `inspect` share.
use std::io::IsTerminal;
use std::time::Instant;

use crate::format::format_bytes;
use crate::hub::{Hub, Manifest, Progress, Source};

/// The hub of pulled models, in Hypura's cache unless the environment says otherwise.
pub fn hub() -> Hub {
    Hub::from_env(&crate::hw::default_cache_dir())
}

/// The path of a hub name, pulled first (with its progress) when it is not yet, as `ollama
/// run` does; None for names that are not hub names.
pub fn local_path(model: &str) -> anyhow::Result<Option<std::path::PathBuf>> {
    let Some(source) = Source::parse(model) else { return Ok(None) };
    let source = source?;
    let hub = hub();
    if let Some(manifest) = hub.pulled(&source) {
        return Ok(Some(hub.path_of(&manifest)));
    }
    eprintln!("hypura: {} is not pulled yet; pulling it", source.name());
    let files = hub.resolve(&source)?;
    let manifest = pull_with_progress(&hub, &source, &files)?;
    Ok(Some(hub.path_of(&manifest)))
}

/// Pull `files` with a progress bar on a terminal, or a line every tenth in a pipe.
pub fn pull_with_progress(hub: &Hub, source: &Source, files: &[crate::hub::RemoteFile]) -> anyhow::Result<Manifest> {
    let terminal = std::io::stderr().is_terminal();
    let bar = crate::cli::progress::bytes_bar("pulling");
    let started = Instant::now();
    let mut last_tenth = None;
    let mut report = |progress: Progress| match progress {
        Progress::File { index, count, name, completed, total, .. } => {
            bar.set_message(format!("pulling {name} ({}/{count})", index + 1));
            bar.set_length(total.unwrap_or(completed));
            bar.set_position(completed);
            if !terminal {
                let tenth = total.map(|total| completed * 10 / total.max(1));
                if tenth != last_tenth || total.is_none() && completed == 0 {
                    let rate = completed as f64 / started.elapsed().as_secs_f64().max(1e-3);
                    eprintln!(
                        "hypura: pulling {name}: {} of {} ({}/s)",
                        format_bytes(completed),
                        total.map_or("?".into(), format_bytes),
                        format_bytes(rate as u64)
                    );
                    last_tenth = tenth;
                }
            }
        }
        Progress::Verifying { name } => {
            last_tenth = None;
            if !terminal {
                eprintln!("hypura: verifying {name}'s sha256");
            }
        }
        Progress::Resolving | Progress::Done => {}
    };
    let manifest = hub.pull_files(source, files, &mut report);
    bar.finish_and_clear();
    let manifest = manifest?;
    for file in manifest.files.iter().filter(|file| !file.verified) {
        eprintln!("hypura: {} is not verified: its server gives no SHA-256", file.path.display());
    }
    Ok(manifest)
}
