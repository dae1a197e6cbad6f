//! Clap definitions only: no logic, no defaults that need the environment.
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(name = "hypura", version, about = "Run GGUF models larger than memory: placement across GPU, RAM and NVMe, with streaming")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Measure this machine: CPU, RAM (cgroup-aware), ggml devices, disk bandwidth. Cached.
    Profile(ProfileArgs),
    /// Show what a model file holds, without loading tensor data.
    Inspect(InspectArgs),
}

#[derive(Args, Debug)]
pub struct ProfileArgs {
    /// Measure again even if a cached profile exists.
    #[arg(long)]
    pub refresh: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// A file or directory on the volume to measure (default: the cache directory). A model
    /// file is read, never written.
    #[arg(long)]
    pub path: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// A GGUF file (the first file of a split model).
    pub model: PathBuf,
    /// List every tensor.
    #[arg(long)]
    pub tensors: bool,
    /// Print JSON instead of tables.
    #[arg(long)]
    pub json: bool,
}
