//! `hypura pull`, `list` and `rm`: models from the hub by name (`hub`; the pull that `run`,
//! `serve`, `bench` and `inspect` make of a name not yet pulled is `cli::models`).
use std::io::{IsTerminal, Write};
use std::time::SystemTime;

use anyhow::Context;

use crate::cli::args::{PullArgs, RemoveArgs};
use crate::cli::models::{hub, pull_with_progress};
use crate::format::format_bytes;
use crate::hub::Source;
use crate::model::Inventory;

/// `hypura pull MODEL`: the plan this machine would give it, a confirmation where it would not
/// run here, then the download.
pub fn run(args: &PullArgs) -> anyhow::Result<()> {
    let source = Source::parse(&args.model).unwrap_or_else(|| {
        Err(crate::hub::HubError::Name(format!(
            "{:?} is no hub name: pull hf.co/ORG/REPO[:QUANT], hf://ORG/REPO/FILE.gguf or an https:// URL",
            args.model
        )))
    })?;
    let hub = hub();
    eprintln!("hypura: resolving {}", source.name());
    let files = hub.resolve(&source)?;
    let bytes: u64 = files.iter().filter_map(|file| file.size).sum();
    eprintln!(
        "hypura: {} file(s){}: {}",
        files.len(),
        if bytes > 0 { format!(", {}", format_bytes(bytes)) } else { String::new() },
        files.iter().map(|file| file.relative.display().to_string()).collect::<Vec<_>>().join(", ")
    );
    let runs = match plan_before_pull(&files[0].url, &args.model_args) {
        Ok(plan) => {
            print!("{plan}");
            true
        }
        Err(error) => {
            eprintln!("hypura: this model would not run here: {error:#}");
            false
        }
    };
    if !runs && !args.yes && !confirm("pull it anyway?")? {
        anyhow::bail!("not pulled (--yes pulls without asking)");
    }
    let manifest = pull_with_progress(&hub, &source, &files)?;
    eprintln!(
        "hypura: pulled {} ({}) to {}",
        manifest.name,
        format_bytes(manifest.bytes()),
        hub.path_of(&manifest).display()
    );
    Ok(())
}

/// The plan `inspect` gives the model at `url` on this machine, from its index alone.
fn plan_before_pull(url: &str, model_args: &crate::cli::args::ModelArgs) -> anyhow::Result<String> {
    let (files, _) = crate::model::url::open(url)?;
    let inventory = Inventory::from_files(std::path::Path::new(url), &files)?;
    let spec = crate::cli::settings::run_spec(model_args)?;
    let facts = crate::setup::machine_facts(&spec, &inventory)?;
    let choice = crate::setup::choose(&inventory, &spec, &facts)?;
    Ok(choice.plan.render())
}

fn confirm(question: &str) -> anyhow::Result<bool> {
    if !std::io::stdin().is_terminal() {
        return Ok(false);
    }
    eprint!("{question} [y/N] ");
    std::io::stderr().flush()?;
    let mut answer = String::new();
    std::io::stdin().read_line(&mut answer)?;
    Ok(matches!(answer.trim(), "y" | "Y" | "yes"))
}

/// `hypura list`: what was pulled.
pub fn list() -> anyhow::Result<()> {
    let manifests = hub().list();
    let width = manifests.iter().map(|manifest| manifest.name.len()).max().unwrap_or(4).max(4);
    println!("{:<width$}  {:>10}  {:>5}  MODIFIED", "NAME", "SIZE", "FILES");
    let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |since| since.as_secs());
    for manifest in &manifests {
        println!(
            "{:<width$}  {:>10}  {:>5}  {}",
            manifest.name,
            format_bytes(manifest.bytes()),
            manifest.files.len(),
            ago(now.saturating_sub(manifest.pulled_at))
        );
    }
    Ok(())
}

fn ago(seconds: u64) -> String {
    match seconds {
        0..=59 => "just now".into(),
        60..=3599 => format!("{} minutes ago", seconds / 60),
        3600..=86_399 => format!("{} hours ago", seconds / 3600),
        _ => format!("{} days ago", seconds / 86_400),
    }
}

/// `hypura rm NAME`.
pub fn remove(args: &RemoveArgs) -> anyhow::Result<()> {
    for name in &args.models {
        let manifest = hub().remove(name).with_context(|| format!("removing {name}"))?;
        println!("deleted '{}' ({})", manifest.name, format_bytes(manifest.bytes()));
    }
    Ok(())
}
