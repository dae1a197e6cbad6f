//! Measure this machine's hardware profile and print it, without touching the profile cache.
//!
//! `cargo run --release --example hw_probe -- [PATH] [--quick] [--json]`
//!
//! PATH (default ".") is a directory, where a 1 GiB scratch file is written, measured and
//! deleted, or a file of at least 512 MiB (e.g. a model), which is read in place. `--quick`
//! reads only a few MiB (checks the machinery, not the disk). Used to cross-check `hw` against
//! `dd iflag=direct`.

use std::path::PathBuf;

use hypura::hw::{DiskOptions, Profile};

fn main() -> anyhow::Result<()> {
    let mut probe = PathBuf::from(".");
    let mut options = DiskOptions::default();
    let mut print_json = false;
    for argument in std::env::args().skip(1) {
        match argument.as_str() {
            "--quick" => options = DiskOptions::quick(),
            "--json" => print_json = true,
            "--help" | "-h" => {
                eprintln!("usage: hw_probe [PATH] [--quick] [--json]");
                return Ok(());
            }
            path => probe = PathBuf::from(path),
        }
    }

    let devices = hypura::cli::commands::profile::ggml_devices();

    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(indicatif::ProgressStyle::with_template(
        "measuring disk {bar:40} {bytes}/{total_bytes} ({elapsed})",
    )?);
    let started = std::time::Instant::now();
    let profile = Profile::measure(devices, Some(&probe), &options, &|done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })?;
    bar.finish_and_clear();
    eprintln!("measured in {:.1} s", started.elapsed().as_secs_f64());

    if print_json {
        println!("{}", serde_json::to_string_pretty(&profile)?);
    } else {
        print!("{}", profile.render_human());
    }
    Ok(())
}
