//! The `hypura` binary: parse, set up logging, run one command, report errors in one line.
use clap::Parser;

fn main() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("HYPURA_LOG").unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    let cli = hypura::cli::args::Cli::parse();
    if let Err(error) = hypura::cli::run(cli) {
        eprintln!("hypura: {error:#}");
        std::process::exit(1);
    }
}
