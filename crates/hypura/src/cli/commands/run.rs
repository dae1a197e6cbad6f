//! `hypura run`: one prompt, or an interactive chat that keeps the model and the conversation.
use std::io::{BufRead, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Context;

use crate::cli::args::RunArgs;
use crate::cli::settings;
use crate::engine::{
    ChatMessage, ChatRequest, Control, DoneReason, Engine, GenerateOutput, GenerateRequest, LimitFacts, Prompt, Session,
};

pub fn run(args: &RunArgs) -> anyhow::Result<()> {
    let path = settings::model_path(args.model.as_deref().or(args.model_flag.as_deref()))?;
    let sampling = settings::sampler_params(&args.sampling)?;
    let mut setup = settings::setup(&args.model_args, &path)?;
    setup.options.prompt_cache = settings::prompt_cache(&args.prompt_cache)?;
    // Free memory of each GPU before the load, so --stats can say what the model took there.
    let gpu_free_before = args.stats.then(crate::setup::gpu_free_by_name);
    let limits = Limits {
        disk_rate: setup.facts.profile_disk_bytes_per_sec,
        facts: LimitFacts {
            resident_seconds_per_token: setup.facts.device_resident_seconds_per_token(),
            cpu_bytes_per_sec: setup.facts.cpu_bytes_per_sec,
        },
    };
    let engine =
        Arc::new(Engine::load(setup.inventory, setup.options).with_context(|| format!("loading {}", path.display()))?);
    if args.stats {
        if let Some(plan) = &engine.options().plan {
            eprint!("{}", plan.render());
        }
    }
    let mut session = Session::new(engine)?;
    // Ctrl-C stops the answer being generated, not the program.
    let cancel = Arc::new(AtomicBool::new(false));
    {
        let cancel = cancel.clone();
        ctrlc::set_handler(move || cancel.store(true, Ordering::Relaxed)).context("installing the Ctrl-C handler")?;
    }
    let request = |prompt: Prompt| GenerateRequest {
        max_tokens: args.max_tokens,
        sampling: sampling.clone(),
        stop: args.stop.clone(),
        cancel: Some(cancel.clone()),
        ..GenerateRequest::new(prompt)
    };
    let mut messages = Vec::new();
    if let Some(system) = &args.system {
        messages.push(ChatMessage::new("system", system.clone()));
    }
    if !args.interactive {
        let text = match &args.prompt {
            Some(text) => text.clone(),
            None => {
                let mut text = String::new();
                std::io::stdin().read_line(&mut text).context("reading the prompt from stdin")?;
                text
            }
        };
        let prompt = if args.raw {
            Prompt::Raw(text)
        } else {
            messages.push(ChatMessage::new("user", text));
            Prompt::Chat(ChatRequest::new(messages))
        };
        let output = answer(&mut session, &request(prompt))?;
        print_stats(gpu_free_before.as_deref(), &limits, &output);
        // A run with remote layers measured other machines and links too: not this machine's
        // compute for the model.
        if output.stats.links.is_none() {
            let engine = session.engine();
            let stats = &output.stats;
            crate::setup::record_run(
                &path,
                &crate::setup::RunMeasurements {
                    threads: settings::threads(engine.options().n_threads),
                    streamed: engine.streaming().is_some(),
                    decode_seconds_per_token: stats.eval_compute_seconds_per_token(),
                    decode_tokens: u64::from(stats.eval_decodes),
                    prompt_seconds: stats.prompt_eval_duration.as_secs_f64(),
                    prompt_tokens: u64::from(stats.prompt_eval_count),
                    routing: stats.experts.as_ref().map(|experts| experts.reuse.clone()),
                    read_bytes: stats.io.map_or(0, |io| io.bytes_read),
                    busy_seconds: stats.io.map_or(0.0, |io| io.busy_seconds),
                    host_share: engine
                        .options()
                        .plan
                        .as_ref()
                        .and_then(|plan| plan.prediction.as_ref())
                        .map_or(1.0, |prediction| prediction.host_share),
                    touched_bytes_per_token: engine
                        .options()
                        .plan
                        .as_ref()
                        .and_then(|plan| plan.prediction.as_ref())
                        .map(|prediction| prediction.touched_bytes_per_token),
                    routes_experts: engine.inventory().hparams.routes_experts(),
                    // A request's reads include its prompt's sweep: only benchmarks' tg runs
                    // measure decode's reads alone.
                    expert_reads: None,
                    pooled: engine
                        .options()
                        .plan
                        .as_ref()
                        .and_then(|plan| plan.gpu.as_ref())
                        .is_some_and(|gpu| gpu.expert_pool.is_some()),
                    pool: None,
                },
            );
        }
        write_trace(&session, args.model_args.plan.trace.as_deref())?;
        return Ok(());
    }
    chat_loop(&mut session, &request, &cancel, &mut messages, gpu_free_before.as_deref(), &limits)?;
    write_trace(&session, args.model_args.plan.trace.as_deref())?;
    Ok(())
}

/// The interactive chat: keeps the conversation; the KV cache reuses its shared prefix.
fn chat_loop(
    session: &mut Session,
    request: &dyn Fn(Prompt) -> GenerateRequest,
    cancel: &Arc<AtomicBool>,
    messages: &mut Vec<ChatMessage>,
    // With --stats: the GPUs' free memory before the load.
    stats: Option<&[(String, u64)]>,
    limits: &Limits,
) -> anyhow::Result<()> {
    let stdin = std::io::stdin();
    loop {
        eprint!(">>> ");
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 {
            eprintln!();
            return Ok(());
        }
        let line = line.trim_end_matches(['\n', '\r']);
        match line.trim() {
            "" => continue,
            "/bye" | "/exit" => return Ok(()),
            "/clear" => {
                messages.retain(|message: &ChatMessage| message.role == "system");
                session.reset();
                continue;
            }
            _ => {}
        }
        cancel.store(false, Ordering::Relaxed);
        messages.push(ChatMessage::new("user", line));
        let output = answer(session, &request(Prompt::Chat(ChatRequest::new(messages.clone()))))?;
        if output.done_reason == DoneReason::Cancelled {
            eprintln!("[stopped]");
        }
        messages.push(ChatMessage::new("assistant", output.text.clone()));
        print_stats(stats, limits, &output);
    }
}

/// Write the router's choices as JSON lines (one per MoE layer call).
fn write_trace(session: &Session, path: Option<&std::path::Path>) -> anyhow::Result<()> {
    let (Some(path), Some(experts)) =
        (path, session.engine().streaming().and_then(|streaming| streaming.driver.experts()))
    else {
        return Ok(());
    };
    let mut text = String::new();
    for record in experts.take_trace() {
        text.push_str(&serde_json::to_string(&record)?);
        text.push('\n');
    }
    std::fs::write(path, text).with_context(|| format!("writing the trace {}", path.display()))
}

fn answer(session: &mut Session, request: &GenerateRequest) -> anyhow::Result<GenerateOutput> {
    let mut stdout = std::io::stdout().lock();
    let output = session.generate(request, &mut |text| {
        // A closed stdout (a pipe into `head`) ends the answer, not the program with a panic.
        if stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush()).is_err() {
            return Control::Stop;
        }
        Control::Continue
    })?;
    let _ = writeln!(stdout);
    Ok(output)
}

/// What the physical limit takes from earlier runs on this machine: the profile's streaming
/// rate, and a pooled decode's facts.
struct Limits {
    disk_rate: Option<f64>,
    facts: LimitFacts,
}

/// With --stats (`gpu_free_before`: the GPUs' free memory before the load), what a run took,
/// against its physical limit (`limits`).
fn print_stats(gpu_free_before: Option<&[(String, u64)]>, limits: &Limits, output: &GenerateOutput) {
    let Some(gpu_free_before) = gpu_free_before else {
        return;
    };
    let stats = &output.stats;
    // With drafts a decode verifies several tokens: the rate is then the tokens generated.
    let (rate, rate_label) = if stats.draft_tokens > 0 {
        (stats.eval_tokens_per_sec(), "generated")
    } else {
        (stats.decode_tokens_per_sec(), "decoded")
    };
    eprintln!(
        "load {:.2} s | prompt {} tokens in {:.3} s ({:.1} tok/s, {} reused{}) | eval {} tokens ({} decoded) in {:.3} s ({:.1} tok/s {rate_label}) | total {:.3} s | done: {:?}",
        stats.load_duration.as_secs_f64(),
        stats.prompt_eval_count,
        stats.prompt_eval_duration.as_secs_f64(),
        stats.prompt_tokens_per_sec(),
        stats.reused_prompt_tokens,
        if stats.prompt_cache_tokens > 0 {
            format!(
                ", {} from the prompt cache ({:.1} MB read)",
                stats.prompt_cache_tokens,
                stats.prompt_cache_bytes_read as f64 / 1e6
            )
        } else {
            String::new()
        },
        stats.eval_count,
        stats.eval_decodes,
        stats.eval_duration.as_secs_f64(),
        rate,
        stats.total_duration.as_secs_f64(),
        output.done_reason
    );
    if let Some(acceptance) = stats.draft_acceptance() {
        let streamed = stats
            .io
            .as_ref()
            .map(|io| {
                format!(
                    " | {:.1} MB read per generated token",
                    io.bytes_read as f64 / f64::from(stats.eval_count.max(1)) / 1e6
                )
            })
            .unwrap_or_default();
        eprintln!(
            "draft {} tokens drafted, {} accepted ({:.1}%) | {:.2} tokens per pass, {:.1} tok/s generated{streamed}",
            stats.draft_tokens,
            stats.draft_accepted,
            100.0 * acceptance,
            stats.tokens_per_pass().unwrap_or(0.0),
            stats.eval_tokens_per_sec()
        );
    }
    if let Some(experts) = &stats.experts {
        eprintln!(
            "experts {} hits, {} misses over {} router calls: hit rate {:.1}% | prefetch {} issued, {} used, {} cancelled | {} read into the cache's free room",
            experts.hits,
            experts.misses,
            experts.layer_visits,
            100.0 * experts.hit_rate(),
            experts.prefetch_issued,
            experts.prefetch_used,
            experts.prefetch_cancelled,
            experts.warm_reads
        );
        let device = &experts.device;
        if device.hits + device.uploads + device.staged_layers > 0 {
            eprintln!(
                "gpu experts {} picks from the GPU's slots, {} uploaded into them (hit rate {:.1}%) | {} prompt layers staged whole ({} uploaded, {} from the slots on the GPU; {} experts into empty slots) | {} uploaded, {} copied back in {:.3} s | the host's work at the pool's stops {:.3} s",
                device.hits,
                device.uploads,
                100.0 * device.hits as f64 / (device.hits + device.uploads).max(1) as f64,
                device.staged_layers,
                crate::format::format_bytes(device.staged_bytes),
                crate::format::format_bytes(device.staged_on_device_bytes),
                device.staged_into_slots,
                crate::format::format_bytes(device.upload_bytes),
                crate::format::format_bytes(device.copied_back_bytes),
                device.transfer_seconds,
                device.host_seconds
            );
            if device.cpu_picks > 0 {
                eprintln!(
                    "split {} picks no slot held computed by the CPU ({} in {:.3} s beside the GPU: {:.3} s handing them to the lanes, {:.3} s the slowest lane waiting for reads; the GPU waited {:.3} s for them at the layers' sums)",
                    device.cpu_picks,
                    crate::format::format_bytes(device.cpu_bytes),
                    device.cpu_seconds,
                    device.cpu_start_seconds,
                    device.cpu_read_wait_seconds,
                    device.cpu_wait_seconds
                );
            }
        }
    }
    if let Some(tiers) = stats.tiers() {
        let rate = |rate: Option<f64>| rate.map_or("-".to_string(), |rate| format!("{:.2} GB/s", rate / 1e9));
        eprintln!(
            "tiers expert picks: {} from the GPU's slots, {} from the host's cache, {} from disk ({} of these computed by the CPU) | per pass: {:.2} MB from disk ({} while reading{}), {:.2} MB over the bus ({} while moving)",
            tiers.picks_gpu,
            tiers.picks_host,
            tiers.picks_disk,
            tiers.picks_cpu,
            tiers.disk_bytes_per_pass / 1e6,
            rate(tiers.disk_bytes_per_sec),
            if tiers.warm_bytes_per_pass > 0.0 {
                format!("; {:.2} MB of it the host cache's warm fill", tiers.warm_bytes_per_pass / 1e6)
            } else {
                String::new()
            },
            tiers.bus_bytes_per_pass / 1e6,
            rate(tiers.bus_bytes_per_sec),
        );
    }
    if let Some(peak) = crate::hw::peak_rss_bytes() {
        eprintln!("peak memory {} ({peak} bytes resident)", crate::format::format_bytes(peak));
    }
    // What the model, its context and the answer took on each GPU (free memory before the
    // load less free memory now; other processes on the device count too).
    for ((name, before), (_, now)) in gpu_free_before.iter().zip(crate::setup::gpu_free_by_name()) {
        eprintln!("gpu memory  {} used on {name}", crate::format::format_bytes(before.saturating_sub(now)));
    }
    if let Some(links) = &stats.links {
        let decodes = f64::from(stats.eval_decodes.max(1));
        let eval = stats.eval_links.unwrap_or_default();
        eprintln!(
            "links {} sent, {} received over the RPC workers' links | per decoded token: {:.1} KB, {:.1} round trips",
            crate::format::format_bytes(links.sent_bytes),
            crate::format::format_bytes(links.received_bytes),
            eval.bytes() as f64 / decodes / 1e3,
            eval.round_trips as f64 / decodes
        );
    }
    if let Some(io) = &stats.io {
        let graphs = stats.weight_passes().max(1) as f64;
        let wall = stats.total_duration.as_secs_f64().max(1e-9);
        eprintln!(
            "io   {} read ({:.1} MB/token, {:.2} GB/s over the request) | read time {:.3} s over {} reads | stall {:.3} s ({:.1}% of the request) | per token: compute {:.1} ms, stall {:.1} ms",
            crate::format::format_bytes(io.bytes_read),
            io.bytes_read as f64 / graphs / 1e6,
            io.bytes_read as f64 / wall / 1e9,
            io.read_seconds,
            io.reads,
            io.stall_seconds,
            100.0 * io.stall_seconds / wall,
            (wall - io.stall_seconds) / graphs * 1e3,
            io.stall_seconds / graphs * 1e3,
        );
        // The profile's rate, or this request's while busy where that was faster: a run that
        // reads faster than the profile says shows the profile low, and a limit it beats is no
        // limit.
        let busy = stats.disk_while_busy(&limits.facts);
        let (rate, source) = match (limits.disk_rate, busy.map(|disk| disk.bytes_per_sec)) {
            (Some(profile), Some(busy)) if busy > profile => {
                (Some(busy), format!("this request's reads, faster than the profile's {:.2} GB/s", profile / 1e9))
            }
            (Some(profile), _) => (Some(profile), "the profile's".to_string()),
            (None, busy) => (busy, "this request's reads".to_string()),
        };
        if let Some((rate, limit)) =
            rate.and_then(|rate| stats.decode_limit(rate, &limits.facts).map(|limit| (rate, limit)))
        {
            // A pooled decode's compute term is the device's or the misses' (not this run's).
            let compute = match stats.pool_limit(&limits.facts) {
                Some(pool) => format!(
                    "compute {:.1} ms: the device's {:.1} ms{}, the misses over the bus and on the CPU {:.1} ms ({})",
                    limit.compute_seconds * 1e3,
                    pool.device_compute_seconds_per_token() * 1e3,
                    if pool.resident_seconds_per_token.is_some() { " resident" } else { "" },
                    pool.miss_seconds_per_token() * 1e3,
                    pool.cpu_rate_text()
                ),
                None => format!("compute {:.1} ms", limit.compute_seconds * 1e3),
            };
            eprintln!(
                "limit {:.2} tok/s (per pass: {compute}, reads {:.1} ms at {:.2} GB/s, {source}) -> reached {:.2} of it | disk busy {:.0}% of that rate over the request",
                limit.tokens_per_sec,
                limit.read_seconds * 1e3,
                rate / 1e9,
                limit.fraction,
                100.0 * limit.disk_busy
            );
        }
        // The same limit at the rate the disk delivered in this request: what its reads
        // reached while asked for bytes, whatever a profile measured on other bytes.
        if let Some(disk) = busy {
            eprintln!(
                "disk reads in flight {:.0}% of the request at {:.2} GB/s (idle {:.0}%) | limit at that rate {:.2} tok/s -> the request's passes reached {:.2} of it",
                100.0 * disk.busy,
                disk.bytes_per_sec / 1e9,
                100.0 * (1.0 - disk.busy),
                disk.limit_tokens_per_sec,
                disk.fraction
            );
        }
    }
}
