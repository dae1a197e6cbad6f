//! `hypura rpc-server`: lends this machine's devices over ggml's RPC protocol, so a machine that
//! lends them needs nothing but Hypura. Each device reports the memory this process may use
//! (cgroup-aware, or `--mem`), not the machine's, since clients plan layers by that figure.
//!
//! The port is served by Hypura's validating front (`remote::front`), which checks every
//! request and gives each client a ggml server of its own (this command again, with the hidden
//! `--serve-one-client`, on a private loopback address). With a key, clients must prove it
//! over an encrypted link; without one, only loopback is served unless `--insecure-no-auth`.
//!
//! SIGTERM or Ctrl-C stops it: connections that arrive are closed, the connected clients get
//! `--shutdown-timeout` to finish, and the process exits 0; a second signal exits at once.
use anyhow::Context;

use crate::cli::args::RpcServerArgs;
use crate::cli::settings;
use crate::format::format_bytes;
use crate::remote::front::{self, ChildCommand, Front};
use crate::remote::protocol::Ledger;
use crate::remote::secure::Key;

pub fn run(args: &RpcServerArgs) -> anyhow::Result<()> {
    let backend = hypura_sys::Backend::get();
    let host: std::net::IpAddr =
        args.host.parse().with_context(|| format!("--host {:?} is not an IP address", args.host))?;
    let key = Key::from_file_or_environment(args.key_file.as_deref()).map_err(anyhow::Error::msg)?;
    if args.serve_one_client && !host.is_loopback() {
        anyhow::bail!("--serve-one-client serves a loopback address only");
    }
    if !args.serve_one_client && !host.is_loopback() && key.is_none() {
        if !args.insecure_no_auth {
            anyhow::bail!(
                "--host {host} lends this machine to everyone who reaches the port: give a key (--key-file FILE or HYPURA_RPC_KEY, 64 hexadecimal digits from `openssl rand -hex 32`; clients pass --rpc-key-file), or say --insecure-no-auth"
            );
        }
        eprintln!("hypura: lending this machine's devices on {host}:{} without a key (--insecure-no-auth): anyone who reaches this port can use them", args.port);
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
    if args.serve_one_client {
        // ggml's server runs until the process ends; the front holds this process's stdin and
        // closes it when it is done with it, or when it dies, so no server outlives its front.
        let endpoint = format!("{}:{}", args.host, args.port);
        let cache = args.cache.clone();
        std::thread::spawn(move || {
            if let Err(error) = hypura_sys::rpc_serve(backend, &endpoint, cache.as_deref(), threads, &devices) {
                eprintln!("hypura: {error}");
            }
            std::process::exit(1);
        });
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut Vec::new());
        return Ok(());
    }
    // Each client's server lends the same devices and memory; the front counts the host
    // memory every client holds against what is lent.
    let mut child_args = vec![
        "rpc-server".to_string(),
        "--serve-one-client".into(),
        "--mem".into(),
        lent.to_string(),
        "--threads".into(),
        threads.to_string(),
        "--device".into(),
        names.join(","),
    ];
    if let Some(cache) = &args.cache {
        child_args.extend(["--cache".into(), cache.display().to_string()]);
    }
    let child = ChildCommand {
        program: std::env::current_exe().context("finding this program, to start each client's server")?,
        args: child_args,
    };
    let shutdown_timeout = settings::duration(&args.shutdown_timeout).context("--shutdown-timeout")?;
    let limits = names.iter().map(|name| name.eq_ignore_ascii_case("CPU").then_some(lent)).collect();
    let listener =
        std::net::TcpListener::bind((host, args.port)).with_context(|| format!("binding {host}:{}", args.port))?;
    eprintln!(
        "hypura: lending {} of memory on {}:{} ({} thread(s)), {}; every request checked",
        format_bytes(lent),
        host,
        listener.local_addr().map_or(args.port, |address| address.port()),
        threads,
        if key.is_some() { "to clients that hold the key, encrypted" } else { "without a key" }
    );
    let front = Front::new(child, Ledger::new(limits), key);
    stop_on_signals(front.clone(), shutdown_timeout)?;
    front::serve(listener, front)?;
    Ok(())
}

/// On the first SIGTERM or Ctrl-C, close new connections and exit 0 once the connected
/// clients are gone or `timeout` has passed (their ggml servers end with this process); on a
/// second, exit at once.
fn stop_on_signals(front: std::sync::Arc<Front>, timeout: std::time::Duration) -> anyhow::Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT]).context("listening for SIGTERM")?;
    let name = |signal: i32| if signal == SIGTERM { "SIGTERM" } else { "SIGINT" };
    std::thread::Builder::new().name("rpc-stop".into()).spawn(move || {
        let mut received = signals.forever();
        let Some(signal) = received.next() else { return };
        front.stop();
        eprintln!(
            "hypura: {}: stopping ({} client(s) connected get {} s; a second signal exits at once)",
            name(signal),
            front.clients(),
            timeout.as_secs_f64()
        );
        let draining = front.clone();
        let _ = std::thread::Builder::new().name("rpc-drain".into()).spawn(move || {
            let deadline = std::time::Instant::now() + timeout;
            while draining.clients() > 0 && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            if draining.clients() > 0 {
                eprintln!(
                    "hypura: {} client(s) still connected after {} s are closed",
                    draining.clients(),
                    timeout.as_secs_f64()
                );
            }
            eprintln!("hypura: stopped");
            std::process::exit(0);
        });
        if let Some(signal) = received.next() {
            eprintln!("hypura: {} again: exiting now", name(signal));
            std::process::exit(1);
        }
    })?;
    Ok(())
}
