pub fn run(_args: &crate::cli::args::BenchArgs) -> anyhow::Result<()> { anyhow::bail!("bench: not built yet") }
