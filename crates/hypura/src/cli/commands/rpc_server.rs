//! `hypura rpc-server`: ggml's own RPC server in Hypura's binary, so a machine that lends its
//! devices needs nothing but Hypura. Each device reports the memory this process may use
//! (cgroup-aware, or `--mem`), not the machine's, since clients plan layers by that figure.
use anyhow::Context;

use crate::cli::args::RpcServerArgs;
use crate::cli::settings;
use crate::format::format_bytes;

pub fn run(args: &RpcServerArgs) -> anyhow::Result<()> {
    let backend = hypura_sys::Backend::get();
    let host: std::net::IpAddr =
        args.host.parse().with_context(|| format!("--host {:?} is not an IP address", args.host))?;
    if !host.is_loopback() {
        eprintln!("hypura: lending this machine's devices on {host}:{}: ggml's RPC protocol has no authentication, so anyone who reaches this port can use them", args.port);
    }
    let memory = crate::hw::memory_info();
    let available = memory.effective_available_bytes();
    let total = memory.cgroup.as_ref().map_or(memory.total_bytes, |cgroup| cgroup.limit_bytes.min(memory.total_bytes));
    let lent = match args.mem.as_deref() {
        Some(text) => {
            let asked = settings::parse_bytes(text).context("--mem")?;
            if asked > available {
                eprintln!(
                    "hypura: --mem {} is more than the {} this process may use; lending {}",
                    format_bytes(asked),
                    format_bytes(available),
                    format_bytes(available)
                );
            }
            asked.min(available)
        }
        // A run's default budget: available memory less the headroom the process and the page
        // cache need.
        None => crate::setup::default_memory_budget(available, false),
    };
    let names: Vec<String> = if args.device.is_empty() { vec!["CPU".to_string()] } else { args.device.clone() };
    // Host memory is what this process may use; a device with memory of its own (a GPU)
    // reports its own.
    let devices = names
        .iter()
        .map(|name| {
            let device = hypura_sys::local_device(backend, name)?;
            if name.eq_ignore_ascii_case("CPU") {
                hypura_sys::capped_device(device, lent, total)
            } else {
                Ok(device)
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(cache) = &args.cache {
        std::fs::create_dir_all(cache).with_context(|| format!("creating the cache directory {}", cache.display()))?;
    }
    let threads = args.threads.unwrap_or_else(|| settings::threads(None) as usize);
    eprintln!("hypura: lending {} of memory on {}:{} ({} thread(s))", format_bytes(lent), host, args.port, threads);
    let endpoint = format!("{}:{}", args.host, args.port);
    hypura_sys::rpc_serve(backend, &endpoint, args.cache.as_deref(), threads, &devices)?;
    Ok(())
}
