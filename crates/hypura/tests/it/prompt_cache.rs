//! The prompt cache on disk (`--prompt-cache`): a prefix saved by one process is loaded by the
//! next, greedy text is the same bits as a fresh evaluation's (batch-invariant kernels), and a
//! corrupt, truncated or foreign block, an unwritable directory and two processes sharing one
//! directory each cost only the blocks involved, never a wrong token.
use std::path::{Path, PathBuf};
use std::sync::Arc;

use hypura::engine::chat::{ChatMessage, ChatRequest};
use hypura::engine::prompt_cache::{PromptCacheOptions, BLOCK_TOKENS};
use hypura::engine::{Control, Engine, EngineOptions, GenerateOutput, GenerateRequest, Prompt, SamplerParams, Session};
use serde_json::{json, Value};

use crate::common::{self, Server};

/// A system prompt of about `rules` × 24 tokens (SmolLM2's tokenizer), the same each time.
fn system_prompt(rules: usize) -> String {
    let mut text = String::from("You are a careful assistant for a warehouse. Follow every rule below.\n");
    for rule in 0..rules {
        text.push_str(&format!(
            "Rule {rule}: shelf {} holds item {} and is checked every {} days.\n",
            rule % 17,
            rule * 7,
            rule % 5 + 1
        ));
    }
    text
}

fn chat(model: &str, system: &str, question: &str) -> Value {
    json!({
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "stream": false,
        "options": {"temperature": 0, "num_predict": 24, "seed": 1},
    })
}

/// `serve`'s flags for these tests: one sequence of 4,096 tokens, two threads, batch-invariant
/// kernels, and the prompt cache in `cache` where given.
fn serve_arguments(model: &Path, cache: Option<&Path>) -> Vec<String> {
    let mut arguments = vec![model.display().to_string()];
    arguments.extend(["--context", "4096", "--parallel", "1", "--threads", "2", "--batch-invariant"].map(String::from));
    if let Some(cache) = cache {
        arguments.extend(["--prompt-cache".to_string(), cache.display().to_string()]);
    }
    arguments
}

/// Stop a server as a user does (Ctrl-C), so that it finishes its writes, and wait for it.
fn interrupt(mut server: Server) {
    let pid = server.child.id().to_string();
    assert!(std::process::Command::new("kill").args(["-INT", &pid]).status().unwrap().success());
    let status = server.child.wait().unwrap();
    assert!(status.success(), "serve exited with {status} after SIGINT: {}", server.log_text());
}

/// The test: a 2,500-token system prompt answered, the server restarted, and another
/// question with the same system prompt: nine tenths of the prompt come from the cache, the
/// prompt takes at most a quarter of a fresh server's time, and the greedy text is a fresh
/// server's.
#[test]
fn a_restarted_server_loads_a_shared_system_prompt_from_disk() {
    let _machine = common::whole_machine();
    let directory = tempfile::tempdir().unwrap();
    let cache = directory.path().join("prompt-cache");
    let model_path = common::smollm_path();
    let model = model_path.file_stem().unwrap().to_str().unwrap().to_ascii_lowercase();
    let system = system_prompt(107);
    let arguments = |with_cache: bool| serve_arguments(&model_path, with_cache.then_some(cache.as_path()));

    let first = Server::start(&arguments(true), directory.path().join("first.log"));
    let answer = first.post("/api/chat", &chat(&model, &system, "Which shelf holds item 70?"));
    let prompt_tokens = answer["prompt_eval_count"].as_u64().unwrap();
    assert!(prompt_tokens >= 2500, "the system prompt is {prompt_tokens} tokens, not 2,500: {answer}");
    interrupt(first);
    let blocks = block_files(&cache);
    assert!(blocks.len() as u64 >= prompt_tokens / BLOCK_TOKENS as u64, "{} blocks saved", blocks.len());

    let question = chat(&model, &system, "How often is shelf 3 checked?");
    let restarted = Server::start(&arguments(true), directory.path().join("restarted.log"));
    let cached = restarted.post("/api/chat", &question);
    drop(restarted);
    let fresh = Server::start(&arguments(false), directory.path().join("fresh.log"));
    let evaluated = fresh.post("/api/chat", &question);

    // Ollama's prompt_eval_count is the whole prompt, cached or not.
    let from_cache = cached["hypura_prompt_cached"].as_u64().unwrap();
    let total = cached["prompt_eval_count"].as_u64().unwrap();
    assert_eq!(evaluated["prompt_eval_count"].as_u64().unwrap(), total, "{evaluated}");
    assert_eq!(evaluated["hypura_prompt_cached"].as_u64(), Some(0), "{evaluated}");
    assert!(from_cache * 10 >= total * 9, "{from_cache} of {total} prompt tokens came from the cache: {cached}");
    assert_eq!(cached["hypura_prompt_cache_loaded"].as_u64(), Some(from_cache), "{cached}");
    assert!(cached["hypura_prompt_cache_bytes_read"].as_u64().unwrap() > 0, "{cached}");
    let (cached_time, fresh_time) =
        (cached["prompt_eval_duration"].as_u64().unwrap(), evaluated["prompt_eval_duration"].as_u64().unwrap());
    assert!(
        cached_time * 4 <= fresh_time,
        "the prompt took {:.3} s from the cache and {:.3} s fresh",
        cached_time as f64 / 1e9,
        fresh_time as f64 / 1e9
    );
    assert_eq!(cached["message"], evaluated["message"], "a greedy answer changed with its prefix from disk");
}

fn block_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for model in std::fs::read_dir(dir).unwrap().flatten().filter(|entry| entry.path().is_dir()) {
        for file in std::fs::read_dir(model.path()).unwrap().flatten() {
            if file.path().extension().is_some_and(|extension| extension == "kv") {
                files.push(file.path());
            }
        }
    }
    files
}

/// The block file that starts at `position` (its header names it: magic, settings digest,
/// previous chain hash, then the first position).
fn block_at(dir: &Path, position: usize) -> PathBuf {
    block_files(dir)
        .into_iter()
        .find(|path| {
            let bytes = std::fs::read(path).unwrap();
            bytes.len() > 76 && u32::from_le_bytes(bytes[72..76].try_into().unwrap()) as usize == position
        })
        .unwrap_or_else(|| panic!("no block starts at {position}"))
}

fn engine(path: &Path, cache: Option<&Path>) -> Arc<Engine> {
    let options = EngineOptions {
        n_ctx_seq: 1024,
        n_threads: Some(1),
        batch_invariant: true,
        prompt_cache: cache.map(|dir| PromptCacheOptions { dir: dir.to_path_buf(), max_bytes: 1 << 30 }),
        ..EngineOptions::default()
    };
    Arc::new(Engine::open(path, options).unwrap())
}

/// One greedy answer from a session of its own, which writes its blocks before it returns.
fn answer(engine: &Arc<Engine>, prompt: &str) -> GenerateOutput {
    let request = GenerateRequest {
        max_tokens: Some(12),
        sampling: SamplerParams::greedy(),
        ignore_eos: true,
        ..GenerateRequest::new(Prompt::Raw(prompt.to_string()))
    };
    Session::new(engine.clone()).unwrap().generate(&request, &mut |_| Control::Continue).unwrap()
}

#[test]
fn a_bad_block_costs_its_blocks_and_never_a_wrong_token() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let cache = directory.path().join("cache");
    let model = common::smollm_path();
    let prefix = system_prompt(20);
    let (first_prompt, prompt) =
        (format!("{prefix}Question: where is item 7?"), format!("{prefix}Question: where is item 14?"));
    let reference = answer(&engine(&model, None), &prompt);

    let cached = engine(&model, Some(&cache));
    answer(&cached, &first_prompt);
    let shared = answer(&cached, &prompt).stats.prompt_cache_tokens as usize;
    assert!(shared >= 6 * BLOCK_TOKENS, "only {shared} tokens of the shared prefix loaded");
    let with_all = answer(&cached, &prompt);
    assert_eq!(with_all.stats.prompt_cache_tokens as usize, shared);
    assert_eq!(with_all.tokens, reference.tokens, "greedy tokens changed with the prefix from disk");

    // A flipped byte in block 2's data: blocks 0 and 1 load, block 2 is removed and saved again.
    let corrupt = block_at(&cache, 2 * BLOCK_TOKENS);
    let mut bytes = std::fs::read(&corrupt).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(&corrupt, &bytes).unwrap();
    let after_corruption = answer(&cached, &prompt);
    assert_eq!(after_corruption.stats.prompt_cache_tokens as usize, 2 * BLOCK_TOKENS);
    assert_eq!(after_corruption.tokens, reference.tokens);
    assert_eq!(answer(&cached, &prompt).stats.prompt_cache_tokens as usize, shared, "block 2 was not saved again");

    // A truncated block 3.
    let truncated = block_at(&cache, 3 * BLOCK_TOKENS);
    let length = std::fs::metadata(&truncated).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&truncated).unwrap().set_len(length / 2).unwrap();
    let after_truncation = answer(&cached, &prompt);
    assert_eq!(after_truncation.stats.prompt_cache_tokens as usize, 3 * BLOCK_TOKENS);
    assert_eq!(after_truncation.tokens, reference.tokens);

    // Block 1 made by another model or build (its header's settings digest differs).
    let foreign = block_at(&cache, BLOCK_TOKENS);
    let mut bytes = std::fs::read(&foreign).unwrap();
    bytes[8] ^= 0xff;
    std::fs::write(&foreign, &bytes).unwrap();
    let after_foreign = answer(&cached, &prompt);
    assert_eq!(after_foreign.stats.prompt_cache_tokens as usize, BLOCK_TOKENS);
    assert_eq!(after_foreign.tokens, reference.tokens);

    // Two engines on one directory, answering at once: both answers are right, and the blocks
    // they both wrote load.
    std::fs::remove_dir_all(&cache).unwrap();
    let other = engine(&model, Some(&cache));
    let (one, two) = std::thread::scope(|scope| {
        let one = scope.spawn(|| answer(&cached, &prompt));
        let two = scope.spawn(|| answer(&other, &prompt));
        (one.join().unwrap(), two.join().unwrap())
    });
    assert_eq!(one.tokens, reference.tokens);
    assert_eq!(two.tokens, reference.tokens);
    let after_sharing = answer(&other, &prompt);
    assert_eq!(after_sharing.stats.prompt_cache_tokens as usize, shared);
    assert_eq!(after_sharing.tokens, reference.tokens);
    let leftovers: Vec<_> = std::fs::read_dir(&cache)
        .unwrap()
        .flatten()
        .filter(|entry| entry.file_name().to_string_lossy().starts_with(".tmp-"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
}

#[test]
fn an_unwritable_prompt_cache_is_refused_at_startup() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let file = directory.path().join("a-file");
    std::fs::write(&file, b"not a directory").unwrap();
    let inside_a_file = file.join("cache");
    let options = PromptCacheOptions { dir: inside_a_file.clone(), max_bytes: 1 << 20 };
    assert!(options.check().is_err());
    let model = common::smollm_path();
    let output = common::hypura(&[
        "run",
        model.to_str().unwrap(),
        "-p",
        "hi",
        "-n",
        "1",
        "--prompt-cache",
        inside_a_file.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(stderr.contains("--prompt-cache") && stderr.contains("a-file"), "{stderr}");
}

/// The least recently used blocks go beyond `--prompt-cache-size`.
#[test]
fn the_prompt_cache_keeps_to_its_size() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let cache = directory.path().join("cache");
    let model = common::smollm_path();
    let unlimited = engine(&model, Some(&cache));
    let prompt = format!("{}Question: where is item 21?", system_prompt(20));
    answer(&unlimited, &prompt);
    let sizes: Vec<u64> = block_files(&cache).iter().map(|path| std::fs::metadata(path).unwrap().len()).collect();
    let total: u64 = sizes.iter().sum();
    assert!(sizes.len() >= 6);
    std::fs::remove_dir_all(&cache).unwrap();
    let limit = total / 2;
    // Everything in the directory counts: a foreign file takes half of the limit.
    std::fs::create_dir_all(&cache).unwrap();
    let foreign = limit / 2;
    std::fs::write(cache.join("notes.bin"), vec![0u8; foreign as usize]).unwrap();
    let options = EngineOptions {
        n_ctx_seq: 1024,
        n_threads: Some(1),
        batch_invariant: true,
        prompt_cache: Some(PromptCacheOptions { dir: cache.clone(), max_bytes: limit }),
        ..EngineOptions::default()
    };
    let limited = Arc::new(Engine::open(&model, options).unwrap());
    answer(&limited, &prompt);
    let kept: u64 = block_files(&cache).iter().map(|path| std::fs::metadata(path).unwrap().len()).sum();
    assert!(kept + foreign <= limit && kept > 0, "{kept} bytes kept beside {foreign} foreign under a limit of {limit}");
}

/// The temporary files in the cache's directory (`.tmp-*`).
fn temporaries(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    entries
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| path.file_name().unwrap().to_string_lossy().starts_with(".tmp-"))
        .collect()
}

/// A start removes the temporary files no live process holds (one a killed process left) and
/// keeps the ones a live process is writing (locked).
#[test]
fn a_start_removes_the_temporaries_of_processes_that_are_gone() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let cache = directory.path().join("cache");
    std::fs::create_dir_all(&cache).unwrap();
    let stale = cache.join(".tmp-save-4194303-0");
    std::fs::write(&stale, vec![7u8; 1 << 20]).unwrap();
    let held = cache.join(".tmp-block-4194302-3");
    let writer = std::fs::File::create(&held).unwrap();
    writer.lock().unwrap();
    let engine = engine(&common::smollm_path(), Some(&cache));
    let _session = Session::new(engine).unwrap();
    assert!(!stale.exists(), "a temporary nobody writes was kept");
    assert!(held.exists(), "a temporary a live process holds was removed");
    drop(writer);
}

/// The test: SIGTERM half a second after an answer, as a supervisor stops a service, and
/// a restart: the prompt comes from disk and the greedy answer is the same; nothing temporary
/// is left behind.
#[test]
fn sigterm_after_an_answer_keeps_its_prompt_for_the_restart() {
    let _machine = common::whole_machine();
    let directory = tempfile::tempdir().unwrap();
    let cache = directory.path().join("prompt-cache");
    let model_path = common::smollm_path();
    let model = model_path.file_stem().unwrap().to_str().unwrap().to_ascii_lowercase();
    let arguments = serve_arguments(&model_path, Some(&cache));
    let question = chat(&model, &system_prompt(60), "Which shelf holds item 140?");

    let first = Server::start(&arguments, directory.path().join("first.log"));
    let answered = first.post("/api/chat", &question);
    std::thread::sleep(std::time::Duration::from_millis(500));
    first.terminate();
    assert_eq!(temporaries(&cache), Vec::<PathBuf>::new(), "temporary files left after SIGTERM");

    let restarted = Server::start(&arguments, directory.path().join("restarted.log"));
    let again = restarted.post("/api/chat", &question);
    let total = again["prompt_eval_count"].as_u64().unwrap();
    let loaded = again["hypura_prompt_cache_loaded"].as_u64().unwrap();
    assert!(loaded * 10 >= total * 9, "{loaded} of {total} prompt tokens came from disk: {again}");
    assert_eq!(again["message"], answered["message"], "the answer changed with its prompt from disk");
    restarted.terminate();
}

/// `kill -9` while the cache is being written costs that write only: the next start removes
/// what it left, loads only whole files (no check fails), and answers as a fresh server does.
#[test]
fn a_kill_during_a_save_costs_that_save_and_the_next_start_loads_whole_files_only() {
    let _machine = common::whole_machine();
    let directory = tempfile::tempdir().unwrap();
    let cache = directory.path().join("prompt-cache");
    let model_path = common::smollm_path();
    let model = model_path.file_stem().unwrap().to_str().unwrap().to_ascii_lowercase();
    let arguments = |with_cache: bool| serve_arguments(&model_path, with_cache.then_some(cache.as_path()));
    let question = chat(&model, &system_prompt(100), "How often is shelf 5 checked?");

    // Killed while the writer cuts the saved sequence into blocks: some blocks are whole and
    // renamed into place, one is a temporary cut short, and the sequence's copy is left too.
    let mut killed = Server::start(&arguments(true), directory.path().join("killed.log"));
    let caught = std::thread::scope(|scope| {
        let server = &killed;
        // The answer's connection dies with the server: its result is not needed.
        scope.spawn(|| std::panic::catch_unwind(|| server.post_status("/api/chat", &question)));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
        while std::time::Instant::now() < deadline {
            if temporaries(&cache).iter().any(|path| path.to_string_lossy().contains(".tmp-block-")) {
                server.signal("KILL");
                return true;
            }
            std::thread::yield_now();
        }
        false
    });
    assert!(caught, "no block was seen being written: {}", killed.log_text());
    killed.wait_exit(std::time::Duration::from_secs(10));
    let left = temporaries(&cache);
    assert!(!left.is_empty(), "the kill left nothing to clean");
    let whole = block_files(&cache).len();

    let restarted = Server::start(&arguments(true), directory.path().join("restarted.log"));
    // The start cleaned what the kill left, before any request.
    assert_eq!(temporaries(&cache), Vec::<PathBuf>::new(), "{left:?} were kept at the start");
    let cached = restarted.post("/api/chat", &question);
    let log = restarted.log_text();
    restarted.terminate();
    assert_eq!(temporaries(&cache), Vec::<PathBuf>::new(), "temporaries left after the restart");
    for failed in ["truncated", "checksum", "corrupt", "removed and the prompt evaluated"] {
        assert!(!log.contains(failed), "a file that was cut short was read: {log}");
    }
    let fresh = Server::start(&arguments(false), directory.path().join("fresh.log"));
    let evaluated = fresh.post("/api/chat", &question);
    assert_eq!(cached["message"], evaluated["message"], "{cached}");
    // The blocks written whole before the kill are loaded, as a run from the first.
    let loaded = cached["hypura_prompt_cache_loaded"].as_u64().unwrap_or(0);
    assert_eq!(loaded % BLOCK_TOKENS as u64, 0, "{cached}");
    assert!(loaded <= (whole * BLOCK_TOKENS) as u64, "{loaded} tokens loaded from {whole} whole blocks");
    assert!(whole == 0 || loaded > 0, "none of {whole} whole blocks was loaded: {cached}");
    assert!(log.contains("temporary file(s) that no running process writes removed"), "{log}");
}

/// Without `--prompt-cache`, a reload for a longer `num_ctx` and a load after an unload start
/// from the prefix the last load held in memory, and answer the same.
#[test]
fn a_reloaded_model_keeps_its_cached_prefix_in_memory() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let model_path = common::smollm_path();
    let model = model_path.file_stem().unwrap().to_str().unwrap().to_ascii_lowercase();
    let mut arguments = vec![model_path.display().to_string()];
    arguments.extend(["--context", "512", "--parallel", "1", "--threads", "1", "--batch-invariant"].map(String::from));
    let server = Server::start(&arguments, directory.path().join("serve.log"));
    let prompt = format!("{}Question: where is item 28?", system_prompt(8));
    let request = |num_ctx: u32| {
        json!({"model": model, "prompt": prompt, "raw": true, "stream": false,
               "options": {"temperature": 0, "num_predict": 12, "seed": 1, "num_ctx": num_ctx}})
    };
    let first = server.post("/api/generate", &request(512));
    let prompt_tokens = first["prompt_eval_count"].as_u64().unwrap();
    assert!(prompt_tokens > 100, "{first}");
    let reloaded = server.post("/api/generate", &request(1024));
    assert!(server.log_text().contains("cached prefixes kept from the last load"), "{}", server.log_text());
    assert!(reloaded["hypura_prompt_cached"].as_u64().unwrap() >= prompt_tokens - 1, "{reloaded}");
    assert_eq!(reloaded["response"], first["response"]);
    let unloaded = server.post("/api/generate", &json!({"model": model, "keep_alive": 0}));
    assert_eq!(unloaded["done_reason"], "unload", "{unloaded}");
    let again = server.post("/api/generate", &request(1024));
    assert!(again["hypura_prompt_cached"].as_u64().unwrap() >= prompt_tokens - 1, "{again}");
    assert_eq!(again["response"], first["response"]);
}

/// A chat template for Gemma 3 (the test file is a base model and has none): the system
/// prompt opens the first turn, as Gemma's own template puts it.
const GEMMA_TEMPLATE: &str = "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}\
{{ message['content'] }}\n\n{% else %}<start_of_turn>{{ message['role'] }}\n{{ message['content'] }}<end_of_turn>\n\
{% endif %}{% endfor %}<start_of_turn>model\n";

fn chat_engine(path: &Path, cache: Option<&Path>) -> Arc<Engine> {
    let options = EngineOptions {
        n_ctx_seq: 4096,
        n_threads: Some(2),
        batch_invariant: true,
        chat_template: Some(GEMMA_TEMPLATE.to_string()),
        prompt_cache: cache.map(|dir| PromptCacheOptions { dir: dir.to_path_buf(), max_bytes: 1 << 30 }),
        ..EngineOptions::default()
    };
    Arc::new(Engine::open(path, options).unwrap())
}

fn chat_request(system: &str, question: &str) -> GenerateRequest {
    let messages = vec![ChatMessage::new("system", system), ChatMessage::new("user", question)];
    GenerateRequest {
        max_tokens: Some(12),
        sampling: SamplerParams::greedy(),
        ignore_eos: true,
        prompt_logits: true,
        ..GenerateRequest::new(Prompt::Chat(ChatRequest::new(messages)))
    }
}

fn snapshot_files(dir: &Path) -> Vec<(usize, PathBuf)> {
    let mut files = Vec::new();
    for model in std::fs::read_dir(dir).unwrap().flatten().filter(|entry| entry.path().is_dir()) {
        for file in std::fs::read_dir(model.path()).unwrap().flatten() {
            let path = file.path();
            if path.extension().is_some_and(|extension| extension == "snap") {
                let stem = path.file_stem().unwrap().to_str().unwrap().to_string();
                files.push((stem.split_once('-').unwrap().0.parse().unwrap(), path));
            }
        }
    }
    files.sort();
    files
}

/// Gemma 3's sliding-window cache cannot be cut into blocks: it is kept whole, at the end of
/// the system prompt (where the prompt's evaluation stops for it) and at the end of each
/// answer. Another engine answering another question under the same system prompt loads the
/// first snapshot, and its greedy tokens and prompt logits are a fresh evaluation's bits. A
/// corrupt or truncated snapshot is removed with a warning and costs only the load.
#[test]
fn a_sliding_window_prefix_is_loaded_from_a_snapshot_with_the_same_bits() {
    let _machine = common::whole_machine();
    let directory = tempfile::tempdir().unwrap();
    let cache = directory.path().join("cache");
    // Longer than Gemma 3's 512-position window.
    let system = system_prompt(40);
    let question = chat_request(&system, "How often is shelf 3 checked?");
    let fresh = Session::new(chat_engine(&common::gemma_path(), None))
        .unwrap()
        .generate(&question, &mut |_| Control::Continue)
        .unwrap();

    let first = Session::new(chat_engine(&common::gemma_path(), Some(&cache)))
        .unwrap()
        .generate(&chat_request(&system, "Which shelf holds item 70?"), &mut |_| Control::Continue)
        .unwrap();
    let snapshots = snapshot_files(&cache);
    assert_eq!(snapshots.len(), 2, "a snapshot at the system prompt's end and one at the answer's: {snapshots:?}");
    let (at_system, system_file) = snapshots[0].clone();
    let first_total = first.stats.prompt_eval_count as usize;
    assert!(
        at_system > 700 && at_system + 10 < first_total,
        "the system prompt's snapshot at {at_system} of {first_total}"
    );
    assert_eq!(snapshots[1].0, first_total + first.tokens.len() - 1, "the answer's snapshot");

    let load = || {
        Session::new(chat_engine(&common::gemma_path(), Some(&cache)))
            .unwrap()
            .generate(&question, &mut |_| Control::Continue)
            .unwrap()
    };
    let cached = load();
    assert_eq!(cached.stats.prompt_cache_tokens as usize, at_system);
    assert!(cached.stats.prompt_cache_bytes_read > 0);
    // The stats' prompt_eval_count is what was evaluated, past the tokens loaded.
    let (loaded, evaluated) = (cached.stats.prompt_cache_tokens, cached.stats.prompt_eval_count);
    assert!(loaded * 10 >= (loaded + evaluated) * 9, "{loaded} of {} prompt tokens from the cache", loaded + evaluated);
    assert_eq!(cached.tokens, fresh.tokens, "greedy tokens changed with the prefix from disk");
    assert_eq!(cached.prompt_logits, fresh.prompt_logits, "the prompt's logits changed with the prefix from disk");

    // A flipped byte in the snapshot's state: removed, the prompt evaluated, the same tokens.
    let mut bytes = std::fs::read(&system_file).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(&system_file, &bytes).unwrap();
    let after_corruption = load();
    assert_eq!(after_corruption.stats.prompt_cache_tokens, 0);
    assert_eq!(after_corruption.tokens, fresh.tokens);
    assert_eq!(after_corruption.prompt_logits, fresh.prompt_logits);
    // ... and taken again on the way, so the next load finds it; then a truncated one.
    assert!(system_file.is_file(), "the system prompt's snapshot was not taken again");
    let length = std::fs::metadata(&system_file).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&system_file).unwrap().set_len(length / 2).unwrap();
    let after_truncation = load();
    assert_eq!(after_truncation.stats.prompt_cache_tokens, 0);
    assert_eq!(after_truncation.tokens, fresh.tokens);
}

/// A hybrid model (Qwen3.5's recurrent layers beside attention, forged tiny) is kept whole too:
/// the next session's question under the same system prompt loads it, with a fresh
/// evaluation's greedy tokens and prompt logits.
#[test]
fn a_hybrid_models_prefix_is_loaded_from_a_snapshot_with_the_same_bits() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let model = common::forge("tiny-qwen35moe", directory.path());
    let cache = directory.path().join("cache");
    let system = system_prompt(30);
    let question = chat_request(&system, "How often is shelf 3 checked?");
    let answer = |cache: Option<&Path>, request: &GenerateRequest| {
        Session::new(chat_engine(&model, cache)).unwrap().generate(request, &mut |_| Control::Continue).unwrap()
    };
    let fresh = answer(None, &question);
    answer(Some(&cache), &chat_request(&system, "Which shelf holds item 70?"));
    let cached = answer(Some(&cache), &question);
    let at_system = snapshot_files(&cache)[0].0;
    assert!(at_system > 500, "the system prompt's snapshot at {at_system}");
    assert_eq!(cached.stats.prompt_cache_tokens as usize, at_system);
    assert_eq!(cached.tokens, fresh.tokens, "greedy tokens changed with the prefix from disk");
    assert_eq!(cached.prompt_logits, fresh.prompt_logits, "the prompt's logits changed with the prefix from disk");
}
