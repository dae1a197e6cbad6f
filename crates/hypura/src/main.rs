//! The `hypura` binary: parse, set up logging, run one command, report errors in one line.
use clap::Parser;

fn main() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("HYPURA_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    let cli = hypura::cli::args::Cli::parse_from(std::env::args_os().map(llama_spelling));
    if let Err(error) = hypura::cli::run(cli) {
        eprintln!("hypura: {}", one_line(&error));
        std::process::exit(1);
    }
}

/// llama.cpp's single-dash long flag `-ub` (physical batch size) as our long spelling; clap's
/// short flags are one letter.
fn llama_spelling(argument: std::ffi::OsString) -> std::ffi::OsString {
    match argument.to_str() {
        Some("-ub") => "--ubatch-size".into(),
        _ => argument,
    }
}

/// The error and its causes on one line, skipping a cause that the message already quotes
/// (most of our errors embed their source in their own text).
fn one_line(error: &anyhow::Error) -> String {
    let mut message = error.to_string();
    for cause in error.chain().skip(1) {
        let text = cause.to_string();
        if !message.contains(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
    }
    message.replace('\n', " ")
}
