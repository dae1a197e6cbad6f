//! The command line: clap parses (`args`), settings resolve flags, environment and defaults,
//! and each command is one thin file in `commands` that calls the library.
pub mod args;
pub mod commands;
pub mod models;
pub mod progress;
pub mod settings;

use args::{Cli, Command};

/// Run the parsed command line.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Profile(args) => commands::profile::run(&args),
        Command::Inspect(args) => commands::inspect::run(&args),
        Command::Run(args) => commands::run::run(&args),
        Command::Bench(args) => commands::bench::run(&args),
        Command::Simulate(args) => commands::simulate::run(&args),
        Command::Serve(args) => commands::serve::run(&args),
        Command::RpcServer(args) => commands::rpc_server::run(&args),
        Command::Pull(args) => commands::pull::run(&args),
        Command::List => commands::pull::list(),
        Command::Rm(args) => commands::pull::remove(&args),
        Command::SummaryPicture(args) => commands::bench::summary_picture(&args),
    }
}
