//! `hypura inspect` end to end: good files print the inventory, bad files give one clear line
//! on stderr and exit 1, never a panic or an abort.
use std::path::Path;
use std::process::Output;

use hypura_gguf::{GgmlType, GgufWriter, Value};

use crate::common;

use common::hypura;

/// Exit status 1 (an error, not a panic's 101 or a signal) and exactly one line on stderr.
fn assert_clean_failure(output: &Output, must_mention: &str) -> String {
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(output.status.code(), Some(1), "stderr: {stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "one line expected, got: {stderr}");
    assert!(stderr.starts_with("hypura: "), "{stderr}");
    assert!(stderr.contains(must_mention), "{stderr:?} should mention {must_mention:?}");
    assert!(output.stdout.is_empty());
    stderr
}

#[test]
fn inspect_gemma_reports_architecture_layers_and_tensors() {
    let _machine = common::shared_machine();
    let path = common::gemma_path();
    let output = hypura(&["inspect", path.to_str().unwrap()]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("architecture gemma3"), "{stdout}");
    assert!(stdout.contains("n_layer 18"), "{stdout}");
    assert!(stdout.contains("236 tensors"), "{stdout}");

    let output = hypura(&["inspect", path.to_str().unwrap(), "--json", "--tensors"]);
    assert!(output.status.success());
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(report["arch"], "gemma3");
    assert_eq!(report["tensor_count"], 236);
    assert_eq!(report["tensors"].as_array().unwrap().len(), 236);
    let role_total: u64 =
        report["bytes_by_role"].as_array().unwrap().iter().map(|pair| pair[1].as_u64().unwrap()).sum();
    assert_eq!(role_total, report["tensor_data_bytes"].as_u64().unwrap());
}

#[test]
fn inspect_moe_shows_expert_slices() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let path = common::forge("tiny-moe-30b", directory.path());
    let output = hypura(&["inspect", path.to_str().unwrap()]);
    assert!(output.status.success());
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("16 experts in 4 of 4 layers, 4 used per token"), "{stdout}");
    assert!(stdout.contains("blk.0.ffn_down_exps.weight"), "{stdout}");
}

/// DeepSeek's layout: a leading dense layer, MoE layers and an MTP block, each summarized on
/// one line; the expert slice shown is the first MoE layer's; the MTP block is planned unused.
#[test]
fn inspect_summarizes_layers_by_kind() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let path = common::forge("tiny-deepseek2", directory.path());
    let output = hypura(&["inspect", path.to_str().unwrap()]);
    assert!(output.status.success());
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("16 experts in 3 of 5 layers"), "{stdout}");
    assert!(stdout.contains("one expert of layer 1 (all its tensors)"), "{stdout}");
    let kinds: Vec<&str> = stdout
        .lines()
        .skip_while(|line| !line.starts_with("bytes by layer"))
        .skip(1)
        .take_while(|line| !line.is_empty())
        .collect();
    assert_eq!(kinds.len(), 3, "{stdout}");
    assert!(kinds[0].contains("dense") && kinds[0].contains("layers 0"), "{kinds:?}");
    assert!(kinds[1].contains("moe") && kinds[1].contains("3 layers") && kinds[1].contains("layers 1-3"), "{kinds:?}");
    assert!(kinds[2].contains("mtp") && kinds[2].contains("layers 4"), "{kinds:?}");
    assert!(stdout.lines().any(|line| line.trim_start().starts_with("unused") && line.contains("MTP")), "{stdout}");
    assert!(!stdout.lines().any(|line| line.trim_start().starts_with("other ")), "a tensor without a role: {stdout}");
}

#[test]
fn bad_inputs_fail_with_one_clear_line() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let dir = directory.path();

    let missing = dir.join("no-such-model.gguf");
    assert_clean_failure(&hypura(&["inspect", missing.to_str().unwrap()]), "no-such-model.gguf");

    assert_clean_failure(&hypura(&["inspect", dir.to_str().unwrap()]), dir.to_str().unwrap());

    let text = dir.join("notes.txt");
    std::fs::write(&text, "this is not a model\n").unwrap();
    assert_clean_failure(&hypura(&["inspect", text.to_str().unwrap()]), "notes.txt");

    let empty = dir.join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    assert_clean_failure(&hypura(&["inspect", empty.to_str().unwrap()]), "empty.gguf");

    // A real model cut inside its index, inside its data, and one byte short.
    let gemma = std::fs::read(common::gemma_path()).unwrap();
    for cut in [7usize, 1000, 3_000_000, gemma.len() - 1] {
        let truncated = dir.join(format!("cut-{cut}.gguf"));
        std::fs::write(&truncated, &gemma[..cut]).unwrap();
        assert_clean_failure(&hypura(&["inspect", truncated.to_str().unwrap()]), &format!("cut-{cut}.gguf"));
    }

    // A hostile header: a tensor count no file could hold.
    let hostile = dir.join("hostile.gguf");
    let mut bytes = b"GGUF".to_vec();
    bytes.extend_from_slice(&3u32.to_le_bytes());
    bytes.extend_from_slice(&u64::MAX.to_le_bytes());
    bytes.extend_from_slice(&0u64.to_le_bytes());
    std::fs::write(&hostile, bytes).unwrap();
    assert_clean_failure(&hypura(&["inspect", hostile.to_str().unwrap()]), "hostile.gguf");

    let alien = dir.join("alien.gguf");
    write_alien(&alien);
    let stderr = assert_clean_failure(&hypura(&["inspect", alien.to_str().unwrap()]), "alien.gguf");
    assert!(stderr.contains("unknown architecture \"alien9000\""), "{stderr}");
}

fn write_alien(path: &Path) {
    let mut writer = GgufWriter::new();
    writer.add_metadata("general.architecture", Value::String("alien9000".into()));
    writer.add_tensor("token_embd.weight", &[32, 4], GgmlType::F32);
    writer.write_file(path, |_| vec![0; 32 * 4 * 4]).unwrap();
}

/// `--gpu-budget` puts what every token touches on a GPU when ggml has one, and says so; where
/// it has none (CI), the plan keeps everything on the host instead of counting device memory
/// that does not exist.
#[test]
fn a_gpu_budget_places_on_a_gpu_only_where_there_is_one() {
    let _machine = common::shared_machine();
    let path = common::gemma_path();
    let has_gpu = hypura_sys::Backend::get().devices().iter().any(|device| device.kind == hypura_sys::DeviceKind::Gpu);
    let output = common::hypura_command()
        .args(["inspect", path.to_str().unwrap(), "--gpu-budget", "4GiB"])
        .output()
        .expect("run hypura");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    if has_gpu {
        assert!(stdout.contains("gpu          ") && stdout.contains("of a 4.00 GiB budget"), "{stdout}");
    } else {
        assert!(!stdout.contains("gpu          "), "{stdout}");
        assert!(stdout.contains("the whole model fits") && stdout.contains("KV cache"), "{stdout}");
        assert!(stderr.contains("ggml sees no dedicated GPU here"), "{stderr}");
    }
}

/// Qwen2.5's 152K-token vocabulary makes the logits of a 512-token prompt batch alone 311 MB of
/// compute buffer. A budget that holds the rest takes a smaller batch before it is refused, and
/// the run generates with it; a batch the user chose is kept, and refused.
#[test]
fn a_budget_too_small_for_the_default_batch_takes_a_smaller_one() {
    let _machine = common::shared_machine();
    let model = common::chat_model_path();
    let model = model.to_str().unwrap();
    let output = hypura(&["inspect", model, "--memory-budget", "520MB"]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let batch: u32 = stdout
        .lines()
        .find_map(|line| line.strip_prefix("batch        prompt batches of ")?.split(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!((32..512).contains(&batch), "{stdout}");
    assert_clean_failure(&hypura(&["inspect", model, "--memory-budget", "520MB", "-b", "512"]), "too small");
    let run = hypura(&[
        "run",
        model,
        "--memory-budget",
        "520MB",
        "-p",
        "Say hello.",
        "-n",
        "4",
        "--temperature",
        "0",
        "-t",
        "2",
    ]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    assert!(!run.stdout.is_empty());
}
