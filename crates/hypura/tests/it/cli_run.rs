//! `hypura run` and `hypura bench` end to end, including bad input: each gives one clear line
//! and exit status 1, never a panic.
use std::process::Output;

use crate::common;

use common::hypura;

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn assert_fails_with(output: &Output, needle: &str) {
    let text = stderr(output);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert_eq!(text.trim_end().lines().count(), 1, "{text}");
    assert!(text.contains(needle), "{text:?} should contain {needle:?}");
}

#[test]
fn run_generates_and_reports_stats() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let model = common::forge("tiny-dense-1b", directory.path());
    let output = hypura(&[
        "run",
        model.to_str().unwrap(),
        "-p",
        "hello world",
        "-n",
        "6",
        "--temperature",
        "0",
        "--stats",
        "-t",
        "1",
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    let stats = stderr(&output);
    assert!(stats.contains("eval 6 tokens"), "{stats}");
    assert!(stats.contains("done: Length"), "{stats}");
    assert!(!output.stdout.is_empty());
}

fn run_model(model: &std::path::Path, extra: &[&str]) -> String {
    let mut args = vec!["run", model.to_str().unwrap(), "-n", "8", "--temperature", "0", "-t", "1"];
    args.extend_from_slice(extra);
    let output = hypura(&args);
    assert!(output.status.success(), "{}", stderr(&output));
    String::from_utf8(output.stdout).unwrap()
}

#[test]
fn a_base_model_without_a_template_runs_chat_as_plain_completion() {
    let _machine = common::shared_machine();
    // Gemma 3 270M is a base model and its file has no chat template: a prompt is completed
    // as written, with or without --raw (a made-up template once made it answer "tersebut").
    let gemma = common::gemma_path();
    let raw = run_model(&gemma, &["--raw", "-p", "Water freezes at a temperature of"]);
    assert!(raw.contains('0') || raw.to_lowercase().contains("zero"), "{raw}");
    assert_eq!(raw, run_model(&gemma, &["--raw", "-p", "Water freezes at a temperature of"]), "greedy output repeats");
    assert_eq!(
        raw,
        run_model(&gemma, &["-p", "Water freezes at a temperature of"]),
        "no template: chat is the prompt as written"
    );
}

#[test]
fn an_instruct_model_answers_through_its_template() {
    let _machine = common::shared_machine();
    let qwen = common::chat_model_path();
    let chat = run_model(&qwen, &["-p", "What is the capital of France? One word."]);
    assert!(chat.contains("Paris"), "{chat}");
    // The same text without the template is a different prompt (and `-m` names the model as
    // llama.cpp's flag does).
    let output = hypura(&[
        "run",
        "-m",
        qwen.to_str().unwrap(),
        "--raw",
        "-p",
        "What is the capital of France? One word.",
        "-n",
        "8",
        "--temperature",
        "0",
        "-t",
        "1",
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert_ne!(String::from_utf8(output.stdout).unwrap(), chat);
}

#[test]
fn run_rejects_bad_input_clearly() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let model = common::forge("tiny-dense-1b", directory.path());
    let model = model.to_str().unwrap();
    assert_fails_with(&hypura(&["run", model, "-p", "hi", "--temperature", "-1"]), "temperature");
    assert_fails_with(&hypura(&["run", model, "-p", "hi", "--top-p", "1.5"]), "top_p");
    assert_fails_with(&hypura(&["run", model, "-p", "hi", "--min-p", "-0.1"]), "min_p");
    assert_fails_with(&hypura(&["run", model, "-p", "hi", "--repeat-penalty", "0"]), "repeat_penalty");
    let long_prompt = "the king of paris ".repeat(40);
    assert_fails_with(
        &hypura(&["run", model, "--raw", "-p", &long_prompt, "--context", "32"]),
        "the prompt is too long",
    );
    let missing = directory.path().join("absent.gguf");
    assert_fails_with(&hypura(&["run", missing.to_str().unwrap(), "-p", "hi"]), "absent.gguf");
    // An expert cache smaller than one token's picks (tiny-moe-30b picks 4 of 16 in a layer)
    // is refused for that reason, with the smallest cache that works, not as a budget.
    let moe = common::forge("tiny-moe-30b", directory.path());
    let refused = hypura(&["run", moe.to_str().unwrap(), "-p", "hi", "--mode", "expert-stream", "--expert-cache", "2"]);
    assert_fails_with(
        &refused,
        "an expert cache of 2 (layer, expert) units is too small: one token picks 4 experts in a layer",
    );
    assert_fails_with(&refused, "the smallest cache that works is --expert-cache 4");
    assert!(!stderr(&refused).contains("memory budget"), "{}", stderr(&refused));
    let works = hypura(&[
        "run",
        moe.to_str().unwrap(),
        "--raw",
        "-p",
        "hi",
        "-n",
        "2",
        "--mode",
        "expert-stream",
        "--expert-cache",
        "4",
    ]);
    assert!(works.status.success(), "{}", stderr(&works));
}

#[test]
fn bench_prints_a_table_json_and_a_picture_against_llama_cpp() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let model = common::forge("tiny-moe-8x", directory.path());
    let json = directory.path().join("bench.json");
    let svg = directory.path().join("bench.svg");
    let output = hypura(&[
        "bench",
        model.to_str().unwrap(),
        "-p",
        "32",
        "-n",
        "8",
        "-r",
        "2",
        "-t",
        "1",
        "--json",
        json.to_str().unwrap(),
        "--svg",
        svg.to_str().unwrap(),
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    let table = String::from_utf8_lossy(&output.stdout);
    assert!(table.contains("| pp32 |") && table.contains("| tg8 |"), "{table}");
    // The picture: both tests, each run of each side a dot.
    let picture = std::fs::read_to_string(&svg).unwrap();
    assert!(picture.starts_with("<svg") && picture.contains("pp32: Hypura") && picture.contains("tg8: Hypura"));
    assert_eq!(picture.matches("<circle").count(), 8, "{picture}");
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(json).unwrap()).unwrap();
    assert_eq!(report["results"].as_array().unwrap().len(), 2);
    for result in report["results"].as_array().unwrap() {
        assert_eq!(result["hypura"]["samples"].as_array().unwrap().len(), 2);
        assert_eq!(result["llama_cpp"]["samples"].as_array().unwrap().len(), 2);
        assert!(result["ratio"].as_f64().unwrap() > 0.0);
    }
    assert_eq!(report["same_output"], true, "greedy output must match llama.cpp");
    assert_eq!(report["mode"], "resident");
}

#[test]
fn run_and_inspect_take_a_model_pulled_by_ollama_by_name_and_llama_cpp_flags() {
    let _machine = common::shared_machine();
    // An Ollama store holding a forged model as `tiny:q4`.
    let store = tempfile::tempdir().unwrap();
    let model = common::forge("tiny-dense-1b", store.path());
    common::ollama_store(store.path(), &model, "tiny", "q4");
    let with_store = |args: &[&str]| {
        common::hypura_command()
            .args(args)
            .env("HYPURA_LOG", "off")
            .env("OLLAMA_MODELS", store.path())
            .output()
            .unwrap()
    };

    let output = with_store(&[
        "run",
        "tiny:q4",
        "-p",
        "hello",
        "-n",
        "4",
        "--temperature",
        "0",
        "-t",
        "1",
        "-c",
        "256",
        "-b",
        "64",
        "-ub",
        "64",
        "--stats",
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(stderr(&output).contains("eval 4 tokens"), "{}", stderr(&output));
    let output = with_store(&["inspect", "-m", "tiny:q4", "-c", "256"]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(String::from_utf8_lossy(&output.stdout).contains("plan"), "{}", String::from_utf8_lossy(&output.stdout));
    assert_fails_with(&with_store(&["run", "nothing:here", "-p", "hi"]), "neither a file nor a model pulled by Ollama");
}

/// `scripts/bench/bench-limited`'s picture: `bench-summary.py` over a recorded run (S6b with skewed
/// routing: Hypura and three llama.cpp placements) writes a summary that `hypura
/// summary-picture` draws, every run and the memory limit in it.
#[test]
fn a_limited_benchmarks_summary_is_drawn() {
    let recorded = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../docs/benchmarks/2026-12-03-skewed-routing/s6b-skew8");
    let directory = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&recorded).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|extension| extension == "json") && !path.ends_with("summary.json") {
            std::fs::copy(&path, directory.path().join(path.file_name().unwrap())).unwrap();
        }
    }
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/bench/bench-summary.py");
    let summarised = std::process::Command::new("python3")
        .arg(&script)
        .arg(directory.path())
        .args(["26196200000", "21000814624"])
        .output()
        .unwrap();
    assert!(summarised.status.success(), "{}", stderr(&summarised));
    let svg = directory.path().join("summary.svg");
    let drawn = common::hypura(&[
        "summary-picture",
        directory.path().join("summary.json").to_str().unwrap(),
        "--svg",
        svg.to_str().unwrap(),
    ]);
    assert!(drawn.status.success(), "{}", stderr(&drawn));
    let text = std::fs::read_to_string(&svg).unwrap();
    for label in
        ["hypura", "llama-fit", "llama-exps-cpu", "llama-n-cpu-moe-18", "72.86", "79.73", "memory limit 24.40 GiB"]
    {
        assert!(text.contains(label), "{label} is not in the picture");
    }
}
