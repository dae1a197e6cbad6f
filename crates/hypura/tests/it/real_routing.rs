//! Real routing: `hypura-forge --from-dense` turns a real dense model into a mixture of experts
//! whose router follows the model's own hidden states. These tests check that the conversion
//! keeps the model's function, that using fewer experts keeps less of it, and that a trace of real
//! routing through `hypura run --trace` and `hypura simulate` is what real text gives: valid
//! picks that change from token to token, neither stuck nor random.
use std::collections::HashSet;
use std::path::Path;

use hypura::bench::peer::PlainLlama;
use hypura::store::RouteRecord;
use hypura_forge::{moe_from_dense, FromDense};

use crate::common;

const TEXT: &str = "A binary search looks at the middle element of a sorted list. If the element is larger than the value it wants, it continues in the left half; otherwise in the right half. Each step halves the list, so it needs about log2(n) steps for n elements.";

fn convert(source: &Path, output: &Path, n_expert: u64, n_expert_used: u64, n_shared: Option<u64>) {
    let options = FromDense { n_expert, n_expert_used, n_shared, seed: 42, calibration: None };
    moe_from_dense(source, output, &options).unwrap_or_else(|error| panic!("converting {}: {error}", source.display()));
}

/// The greedy next token after each prefix of `text` (teacher-forced), from plain llama.cpp.
fn next_tokens(path: &Path, text: &str) -> Vec<i32> {
    let mut peer = PlainLlama::load(path, 512, 2, false).unwrap();
    let tokens = peer.tokenize(text).unwrap();
    (4..=tokens.len())
        .map(|length| {
            peer.prefill(&tokens[..length]).unwrap();
            hypura_sys::first_maximum(&peer.last_logits().unwrap())
        })
        .collect()
}

fn agreement(a: &[i32], b: &[i32]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).filter(|(x, y)| x == y).count() as f64 / a.len() as f64
}

#[test]
fn every_expert_used_predicts_as_the_dense_model_and_fewer_keep_less() {
    let _machine = common::whole_machine();
    let directory = tempfile::tempdir().unwrap();
    let dense = common::smollm_path();
    let dense_next = next_tokens(&dense, TEXT);
    let all = directory.path().join("all.gguf");
    convert(&dense, &all, 8, 8, None);
    let all_agreement = agreement(&dense_next, &next_tokens(&all, TEXT));
    // The layers are the dense FFN again, but for the down projections' Q8_0 rounding.
    assert!(all_agreement >= 0.9, "every expert used: {all_agreement:.2} of next tokens agree with the dense model");
    // Fewer experts keep less of it; the router ranks them, so more used is closer.
    let mut agreements = Vec::new();
    for used in [6, 2] {
        let path = directory.path().join(format!("top{used}.gguf"));
        convert(&dense, &path, 8, used, None);
        agreements.push(agreement(&dense_next, &next_tokens(&path, TEXT)));
    }
    eprintln!(
        "next-token agreement with the dense model: every expert {all_agreement:.2}, top-6 {:.2}, top-2 {:.2}",
        agreements[0], agreements[1]
    );
    assert!(
        agreements[0] > agreements[1] && agreements[0] < all_agreement + 1e-9,
        "top-6 {:.2}, top-2 {:.2}, all {all_agreement:.2}",
        agreements[0],
        agreements[1]
    );
}

#[test]
fn a_trace_of_real_routing_changes_from_token_to_token_and_simulates() {
    let _machine = common::whole_machine();
    let directory = tempfile::tempdir().unwrap();
    let model = directory.path().join("qwen-16x.gguf");
    // Qwen2.5-Coder-0.5B: 4864 neurons in 19 clusters of 256, 3 of them the shared expert.
    convert(&common::chat_model_path(), &model, 16, 8, Some(3));
    let trace = directory.path().join("trace.jsonl");
    let run = common::hypura_command()
        .args([
            "run",
            "--threads",
            "2",
            "--context",
            "512",
            "--mode",
            "expert-stream",
            "--temperature",
            "0",
            "-n",
            "64",
            "--trace",
        ])
        .arg(&trace)
        .arg("-m")
        .arg(&model)
        .args(["-p", "Explain how a hash map works, then write one in Python."])
        .output()
        .unwrap();
    assert!(run.status.success(), "hypura run: {}", String::from_utf8_lossy(&run.stderr));
    let text = String::from_utf8_lossy(&run.stdout);
    assert!(text.to_lowercase().contains("hash"), "the converted model should still answer: {text:?}");
    let records: Vec<RouteRecord> =
        std::fs::read_to_string(&trace).unwrap().lines().map(|line| serde_json::from_str(line).unwrap()).collect();
    let layers: HashSet<u32> = records.iter().map(|record| record.layer).collect();
    assert_eq!(layers.len(), 24, "every layer routes");
    let mut changed = 0usize;
    let mut picks = 0usize;
    for layer in 0..24 {
        let rows: Vec<&Vec<i32>> =
            records.iter().filter(|record| record.layer == layer).flat_map(|record| &record.experts).collect();
        assert!(rows.len() >= 64, "layer {layer}: {} routed tokens", rows.len());
        for row in &rows {
            let distinct: HashSet<i32> = row.iter().copied().collect();
            assert!(
                row.len() == 8 && distinct.len() == 8 && row.iter().all(|&expert| (0..16).contains(&expert)),
                "layer {layer}: picks {row:?}"
            );
        }
        for pair in rows.windows(2) {
            let before: HashSet<i32> = pair[0].iter().copied().collect();
            changed += pair[1].iter().filter(|expert| !before.contains(expert)).count();
            picks += 8;
        }
    }
    // Independent random picks of 8 of 16 would change half; a router stuck on one set, none.
    let change = changed as f64 / picks as f64;
    assert!((0.1..0.45).contains(&change), "{change:.3} of picks are new from one token to the next");

    let simulate = common::hypura_command()
        .args(["simulate", "--json", "--capacity", "192,336", "--model"])
        .arg(&model)
        .arg(&trace)
        .output()
        .unwrap();
    assert!(simulate.status.success(), "hypura simulate: {}", String::from_utf8_lossy(&simulate.stderr));
    let results: serde_json::Value = serde_json::from_slice(&simulate.stdout).unwrap();
    let rates: Vec<f64> =
        results["caches"].as_array().unwrap().iter().map(|result| result["hit_rate"].as_f64().unwrap()).collect();
    assert_eq!(rates.len(), 4, "{results}");
    assert!(rates.iter().all(|rate| (0.0..1.0).contains(rate)), "{results}");
    // The routing's statistics, from the decoded tokens: the next token's reuse is what the
    // trace's own count of new picks says.
    let reuse = results["routing"]["next_token_reuse"].as_f64().unwrap();
    assert!((0.0..1.0).contains(&reuse), "{results}");
    let top = results["routing"]["top_tenth_share"].as_f64().unwrap();
    assert!(top > 0.0 && top <= 1.0, "{results}");
}

#[test]
fn models_it_cannot_convert_are_refused_with_the_reason() {
    let _machine = common::whole_machine();
    let directory = tempfile::tempdir().unwrap();
    let output = directory.path().join("out.gguf");
    let refuse = |source: &Path, n_expert: u64, n_shared: Option<u64>| {
        let options = FromDense { n_expert, n_expert_used: 2, n_shared, seed: 1, calibration: None };
        let error = moe_from_dense(source, &output, &options).expect_err("should be refused").to_string();
        assert!(!output.exists(), "nothing is written for a refused model");
        error
    };
    let gemma = refuse(&common::gemma_path(), 8, None);
    assert!(gemma.contains("gemma3") && gemma.contains("supported: qwen2, llama"), "{gemma}");
    // SmolLM2's 1536 neurons do not split into 7 experts.
    let uneven = refuse(&common::smollm_path(), 7, None);
    assert!(uneven.contains("1536") && uneven.contains("7 equal experts"), "{uneven}");
    let shared = refuse(&common::smollm_path(), 8, Some(2));
    assert!(shared.contains("no shared expert"), "{shared}");
    let moe = directory.path().join("moe.gguf");
    convert(&common::smollm_path(), &moe, 8, 2, None);
    let again = refuse(&moe, 8, None);
    assert!(again.contains("already has experts"), "{again}");
}
