//! Predictions before a run (decision 31): what a run records is what the next plan of the model
//! predicts from, and the predictions recorded beside the benchmark cases' measurements hold.
use std::path::Path;
use std::process::Command;

use crate::common;

/// `hypura` with `args` and the cache directory `cache` (kept across the calls of one test).
fn hypura_in(cache: &Path, args: &[&str]) -> std::process::Output {
    let output = Command::new(env!("CARGO_BIN_EXE_hypura"))
        .args(args)
        .env("HYPURA_CACHE_DIR", cache)
        .env("HYPURA_LOG", "off")
        .output()
        .expect("run hypura");
    assert!(output.status.success(), "hypura {args:?}: {}", String::from_utf8_lossy(&output.stderr));
    output
}

fn prediction(cache: &Path, model: &str, plan: &[&str]) -> serde_json::Value {
    let mut args = vec!["inspect", model, "--json"];
    args.extend_from_slice(plan);
    let report: serde_json::Value = serde_json::from_slice(&hypura_in(cache, &args).stdout).unwrap();
    let prediction = report["plan"]["prediction"].clone();
    assert_eq!(report["predicted_decode_tokens_per_sec"], prediction["decode_tokens_per_sec"]);
    assert_eq!(report["predicted_prompt_tokens_per_sec"], prediction["prompt_tokens_per_sec"]);
    prediction
}

#[test]
fn a_run_records_what_the_next_plan_predicts_from() {
    let directory = tempfile::tempdir().unwrap();
    let model = common::forge_with("tiny-moe-30b", directory.path(), |spec| spec.residual_scale = 0.3);
    let model = model.to_str().unwrap();
    let cache = directory.path().join("cache");
    // A cache of 24 of the 4 × 16 units (a token picks 16), LRU, no prefetch: the hit rate the
    // stack distances model is the one the run has.
    let plan = ["--mode", "expert-stream", "--expert-cache", "24", "--cache-policy", "lru", "--prefetch", "off"];
    let before = prediction(&cache, model, &plan);
    // No record yet: real models' routing, the share of Qwen3-30B-A3B's recorded picks whose
    // distance is below 24 of 64 units (3/8 of them: step 48 of the table's 128).
    assert_eq!(before["hit_rate_from"], hypura::plan::REAL_ROUTING_FROM, "{before}");
    let real = hypura::plan::REAL_ROUTING_BELOW[48];
    assert!((before["expert_hit_rate"].as_f64().unwrap() - real).abs() < 1e-3, "{before}");
    assert!(before["decode_tokens_per_sec"].is_null(), "no compute measured yet: {before}");
    assert!(before["prompt_tokens_per_sec"].is_null(), "{before}");

    // A benchmark's tg runs (the end of text ignored, so every run decodes 96 tokens).
    let report = directory.path().join("bench.json");
    let mut bench = vec!["bench", model, "--no-baseline", "-p", "16", "-n", "96", "-r", "2", "--json"];
    bench.push(report.to_str().unwrap());
    bench.extend_from_slice(&plan);
    hypura_in(&cache, &bench);
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let measured = report["expert_hit_rate"].as_f64().unwrap();

    let after = prediction(&cache, model, &plan);
    assert_eq!(after["hit_rate_from"], "recorded routing", "{after}");
    assert_eq!(after["compute_from"], "streaming runs", "{after}");
    let predicted = after["expert_hit_rate"].as_f64().unwrap();
    // The recorded stack distances give the hit rate the tg runs had, within three points (their
    // start tokens' picks are counted in the run, not in the distances), and closer than
    // uniform routing's guess.
    assert!((predicted - measured).abs() < 0.03, "predicted hit rate {predicted}, measured {measured}");
    assert!((predicted - measured).abs() < (24.0 / 64.0 - measured).abs(), "{predicted} {measured}");
    assert!(after["decode_tokens_per_sec"].as_f64().is_some_and(|rate| rate > 0.0), "{after}");
    // A larger cache is predicted to serve more of the same routing.
    let mut larger = plan;
    larger[3] = "40";
    let more = prediction(&cache, model, &larger)["expert_hit_rate"].as_f64().unwrap();
    assert!(more > predicted, "{more} against {predicted}");

    // A resident run records the prompt's compute, and the resident plan predicts from it.
    let resident = ["--mode", "resident"];
    let before = prediction(&cache, model, &resident);
    assert_eq!(before["compute_from"], "streaming runs", "the streaming compute, until a resident run: {before}");
    assert!(before["prompt_tokens_per_sec"].is_null(), "{before}");
    let prompt = "the river ".repeat(24);
    hypura_in(&cache, &["run", model, "--raw", "-p", &prompt, "-n", "16", "--temperature", "0", "--mode", "resident"]);
    let resident = prediction(&cache, model, &resident);
    assert_eq!(resident["compute_from"], "resident runs", "{resident}");
    assert!(resident["prompt_tokens_per_sec"].as_f64().is_some_and(|rate| rate > 0.0), "{resident}");

    // Another model, never run here: its bytes at the rate this machine computed the first.
    let other = common::forge("tiny-moe-8x", directory.path());
    let estimated = prediction(&cache, other.to_str().unwrap(), &["--mode", "resident"]);
    assert!(estimated["compute_from"].as_str().is_some_and(|from| from.starts_with("estimated")), "{estimated}");
    assert!(estimated["decode_tokens_per_sec"].as_f64().is_some_and(|rate| rate > 0.0), "{estimated}");
}

/// The benchmark cases of `docs/benchmarks/2026-12-04-predictions/`: each Hypura run's report
/// carries the prediction its plan made before it ran; it is `1 / max(compute, bytes / rate)`
/// of the figures it names (the form of that day: an expert stream's reads now add to its
/// compute, `plan::predict`), and within 30% of the tg rate measured.
#[test]
fn recorded_predictions_hold_within_30_percent() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/benchmarks/2026-12-04-predictions");
    let mut cases = 0;
    for case in std::fs::read_dir(&root).unwrap() {
        let case = case.unwrap().path();
        for label in ["hypura", "hypura-b"] {
            let Ok(text) = std::fs::read_to_string(case.join(format!("{label}.json"))) else { continue };
            let report: serde_json::Value = serde_json::from_str(&text).unwrap();
            let prediction = &report["prediction"];
            let predicted = prediction["decode_tokens_per_sec"].as_f64().unwrap_or_else(|| panic!("{case:?}"));
            let compute = prediction["compute_seconds_per_token"].as_f64().unwrap();
            let reads = match prediction["disk_bytes_per_sec"].as_f64() {
                Some(rate) => prediction["bytes_per_token"].as_f64().unwrap() / rate,
                None => 0.0,
            };
            assert!((predicted - 1.0 / compute.max(reads)).abs() < 1e-6 * predicted, "{case:?}: {prediction}");
            let measured = report["results"]
                .as_array()
                .unwrap()
                .iter()
                .find(|result| result["test"].as_str().unwrap().starts_with("tg"))
                .map(|result| result["hypura"]["mean"].as_f64().unwrap())
                .unwrap();
            let ratio = measured / predicted;
            assert!((0.7..=1.3).contains(&ratio), "{case:?} {label}: measured {measured}, predicted {predicted}");
            cases += 1;
        }
    }
    assert!(cases >= 5, "S1, S2, S3 (two models) and S6a: {cases} found under {root:?}");
}
