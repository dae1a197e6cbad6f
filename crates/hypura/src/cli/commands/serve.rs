//! `hypura serve`: resolve the models to serve, then run the HTTP server until SIGTERM or
//! Ctrl-C, which drain it (`server::serve`); a second signal exits at once.
use std::net::IpAddr;
use std::path::PathBuf;

use anyhow::Context;

use crate::cli::args::ServeArgs;
use crate::cli::settings;
use crate::server::catalog::ModelName;
use crate::server::wire::KeepAlive;
use crate::server::{ApiKey, AppState, Catalog, HttpConfig, SchedulerConfig};

pub fn run(args: &ServeArgs) -> anyhow::Result<()> {
    let catalog = catalog(args)?;
    let models = catalog.scan();
    if models.is_empty() {
        eprintln!("hypura: no models found; name GGUF files or directories, or use --models-dir");
    }
    let keep_alive = KeepAlive::parse(&serde_json::Value::String(args.keep_alive.clone()))
        .map_err(|error| anyhow::anyhow!("--keep-alive: {error}"))?;
    let body_limit = settings::parse_bytes(&args.max_body).context("--max-body")?;
    let shutdown_timeout = settings::duration(&args.shutdown_timeout).context("--shutdown-timeout")?;
    let parallel = args.parallel.clamp(1, 64);
    // The plan reserves KV cache for every parallel sequence; each sequence gets --context. The
    // server's kernels are batch-invariant unless asked otherwise: it is where prefixes are
    // cached and requests share batches, and a greedy answer should not depend on either.
    let run = crate::setup::RunSpec {
        n_sequences: parallel,
        batch_invariant: args.model_args.batch_invariant.unwrap_or(false),
        prompt_cache: settings::prompt_cache(&args.prompt_cache)?,
        ..settings::run_spec(&args.model_args)?
    };
    let scheduler = SchedulerConfig {
        n_parallel: parallel,
        max_queue: args.max_queue,
        default_keep_alive: keep_alive,
        run,
        embedding_context: args.embedding_context,
    };
    let api_key = match (&args.api_key, &args.api_key_file) {
        (Some(key), _) => Some(ApiKey::new(key).context("--api-key is empty")?),
        (None, Some(path)) => {
            let text =
                std::fs::read_to_string(path).with_context(|| format!("reading --api-key-file {}", path.display()))?;
            let key = ApiKey::new(text.lines().next().unwrap_or(""))
                .with_context(|| format!("--api-key-file {} holds no key on its first line", path.display()))?;
            Some(key)
        }
        (None, None) => None,
    };
    let http = HttpConfig {
        cors_origins: args.cors_origins.clone(),
        body_limit_bytes: usize::try_from(body_limit).unwrap_or(usize::MAX),
        api_key,
        metrics: args.metrics,
    };
    let http_key_missing = http.api_key.is_none();
    let state = AppState::new(catalog, scheduler, http);

    let host: IpAddr = args.host.parse().with_context(|| format!("--host {:?} is not an IP address", args.host))?;
    if !host.is_loopback() && http_key_missing {
        eprintln!(
            "hypura: listening on {host}, which other machines can reach; the API has no authentication (--api-key)"
        );
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind((host, args.port))
            .await
            .with_context(|| format!("binding {host}:{}", args.port))?;
        let address = listener.local_addr()?;
        eprintln!(
            "hypura: serving {} model(s) on http://{address} (Ollama API at /api, OpenAI API at /v1)",
            models.len()
        );
        for model in &models {
            eprintln!("  {}  {}", model.name, model.path.display());
        }
        let mut signals = StopSignals::new().context("listening for SIGTERM")?;
        let stop = async move {
            let signal = signals.next().await;
            eprintln!(
                "hypura: {signal}: stopping (running answers get {} s; a second signal exits at once)",
                shutdown_timeout.as_secs_f64()
            );
            tokio::spawn(async move {
                let signal = signals.next().await;
                eprintln!("hypura: {signal} again: exiting now");
                std::process::exit(1);
            });
        };
        crate::server::serve(listener, state, stop, shutdown_timeout).await.context("serving HTTP")?;
        eprintln!("hypura: stopped");
        Ok(())
    })
}

/// SIGTERM (how systemd, Docker and most supervisors stop a service) and Ctrl-C, one stream.
struct StopSignals {
    terminate: tokio::signal::unix::Signal,
}

impl StopSignals {
    fn new() -> std::io::Result<StopSignals> {
        Ok(StopSignals { terminate: tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())? })
    }

    /// The next stop signal's name.
    async fn next(&mut self) -> &'static str {
        tokio::select! {
            _ = self.terminate.recv() => "SIGTERM",
            _ = tokio::signal::ctrl_c() => "SIGINT",
        }
    }
}

/// Models from the command line: files, directories (of GGUF files, or an Ollama store), and
/// Ollama names, which must exist in Ollama's store.
fn catalog(args: &ServeArgs) -> anyhow::Result<Catalog> {
    let mut catalog = Catalog::default();
    let add_directory = |catalog: &mut Catalog, directory: PathBuf| {
        if directory.join("manifests").is_dir() {
            catalog.ollama_stores.push(directory);
        } else {
            catalog.directories.push(directory);
        }
    };
    for directory in &args.models_dir {
        anyhow::ensure!(directory.is_dir(), "--models-dir {} is not a directory", directory.display());
        add_directory(&mut catalog, directory.clone());
    }
    catalog.hub = Some(crate::cli::models::hub());
    if let Some(store) = Catalog::default_ollama_store() {
        if !catalog.ollama_stores.contains(&store) {
            catalog.ollama_stores.push(store);
        }
    }
    let mut names = Vec::new();
    for model in &args.models {
        let path = PathBuf::from(model);
        if path.is_dir() {
            add_directory(&mut catalog, path);
        } else if path.is_file() {
            catalog.files.push(path);
        } else if let Some(path) = crate::cli::models::local_path(model)? {
            // A hub name: pulled now if it was not (the catalog lists it by its name).
            tracing::info!("{model} is {}", path.display());
        } else if ModelName::parse(model).is_some() && !crate::server::is_gguf(&path) {
            names.push(model.clone());
        } else {
            anyhow::bail!("{model} is neither a file, a directory nor a model name");
        }
    }
    for name in names {
        catalog
            .resolve(&name)
            .map_err(|error| anyhow::anyhow!("{name}: {error} (looked in {:?})", catalog.ollama_stores))?;
    }
    Ok(catalog)
}
