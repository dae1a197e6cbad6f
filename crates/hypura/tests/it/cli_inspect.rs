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

/// A directory served over HTTP on a free loopback port: `/files/NAME` with range requests
/// (tower-http's file service), `/whole/NAME` always as the whole file with 200, as a server
/// without range support answers. Returns the base URL.
fn serve_over_http(directory: &Path) -> String {
    use axum::extract::Path as UrlPath;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    listener.set_nonblocking(true).unwrap();
    let root = directory.to_path_buf();
    let whole_root = root.clone();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async move {
            let whole = axum::routing::get(move |UrlPath(name): UrlPath<String>| {
                let path = whole_root.join(name);
                async move { tokio::fs::read(path).await.map_err(|_| axum::http::StatusCode::NOT_FOUND) }
            });
            let app = axum::Router::new()
                .nest_service("/files", tower_http::services::ServeDir::new(root))
                .route("/whole/{name}", whole);
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            axum::serve(listener, app).await.unwrap();
        });
    });
    base
}

/// `path` rewritten as two split files named as llama.cpp's gguf-split names them, the tensors
/// shared between them in order; returns the first.
pub fn split_in_two(path: &Path, directory: &Path) -> std::path::PathBuf {
    let source = hypura_gguf::Gguf::open(path).unwrap();
    let bytes = std::fs::read(path).unwrap();
    let half = source.tensors.len() / 2;
    let parts = [&source.tensors[..half], &source.tensors[half..]];
    for (index, tensors) in parts.iter().enumerate() {
        let mut writer = GgufWriter::new();
        if index == 0 {
            for (key, value) in &source.metadata {
                writer.add_metadata(key.clone(), value.clone());
            }
        }
        writer
            .add_metadata("split.no", Value::U16(index as u16))
            .add_metadata("split.count", Value::U16(2))
            .add_metadata("split.tensors.count", Value::I32(source.tensors.len() as i32));
        for tensor in tensors.iter() {
            writer.add_tensor(tensor.name.clone(), &tensor.dims, tensor.ggml_type);
        }
        let target = directory.join(hypura_gguf::split_file_name("split", index as u64, 2));
        writer
            .write_file(&target, |at| {
                let tensor = &tensors[at];
                let start = (source.data_offset + tensor.offset) as usize;
                bytes[start..start + tensor.bytes as usize].to_vec()
            })
            .unwrap();
    }
    directory.join(hypura_gguf::split_file_name("split", 0, 2))
}

/// `inspect URL` plans a model on a server from its index alone, fetched by range requests: the
/// same report and plan as the file on this disk, a plain file and a split one, for a small
/// share of the file's bytes. A server without ranges, a file that is not a GGUF, an index cut
/// short and a connection that drops each get one clear line and exit 1.
#[test]
fn inspect_a_url_plans_from_the_index_alone() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let model = common::chat_model_path();
    std::fs::copy(&model, directory.path().join("model.gguf")).unwrap();
    let split = split_in_two(&common::smollm_path(), directory.path());
    std::fs::write(directory.path().join("notes.txt"), "not a model at all").unwrap();
    let head = std::fs::read(&model).unwrap()[..100_000].to_vec();
    std::fs::write(directory.path().join("cut.gguf"), head).unwrap();
    let base = serve_over_http(directory.path());

    let report = |target: &str| -> serde_json::Value {
        let output = hypura(&["inspect", target, "--json", "--memory-budget", "300MiB", "--context", "2048"]);
        assert!(output.status.success(), "{target}: {}", String::from_utf8_lossy(&output.stderr));
        serde_json::from_slice(&output.stdout).unwrap()
    };
    for (local, remote) in [
        (model.display().to_string(), format!("{base}/files/model.gguf")),
        (split.display().to_string(), format!("{base}/files/{}", split.file_name().unwrap().to_str().unwrap())),
    ] {
        let (mut local, mut remote) = (report(&local), report(&remote));
        let fetched = remote.as_object_mut().unwrap().remove("fetched").expect("a URL's report says what it fetched");
        let file_bytes = remote["file_bytes"].as_u64().unwrap();
        let bytes = fetched["bytes"].as_u64().unwrap();
        let index = fetched["index_bytes"].as_u64().unwrap();
        // Ranges double from 1 MiB: at most twice the index, or a first range per file.
        assert!(bytes >= index && bytes <= 2 * index + (2 << 20), "{bytes} bytes fetched for an index of {index}");
        assert!(bytes * 20 < file_bytes, "{bytes} of {file_bytes} bytes fetched for the index");
        local.as_object_mut().unwrap().remove("path");
        remote.as_object_mut().unwrap().remove("path");
        assert_eq!(local, remote, "the plan from the URL differs from the plan of the file on disk");
    }
    let output = hypura(&["inspect", &format!("{base}/files/model.gguf")]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("range requests") && stdout.contains("for its index of"), "{stdout}");

    let whole = hypura(&["inspect", &format!("{base}/whole/model.gguf")]);
    assert_clean_failure(&whole, "does not answer range requests");
    assert_clean_failure(&hypura(&["inspect", &format!("{base}/files/notes.txt")]), "not a GGUF file");
    assert_clean_failure(&hypura(&["inspect", &format!("{base}/files/cut.gguf")]), "truncated");
    assert_clean_failure(&hypura(&["inspect", &format!("{base}/files/missing.gguf")]), "missing.gguf");

    // A server that promises a range and closes the connection partway, and one that answers
    // with a gigabyte more than was asked.
    let raw_server = |answer: &'static [u8]| {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            use std::io::{Read, Write};
            for stream in listener.incoming().take(1) {
                let mut stream = stream.unwrap();
                let mut request = [0u8; 4096];
                let _ = stream.read(&mut request);
                let _ = stream.write_all(answer);
            }
        });
        format!("http://{address}/model.gguf")
    };
    let dropped = raw_server(
        b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-1048575/4000000\r\nContent-Length: 1048576\r\n\r\nGGUF\x03\x00",
    );
    assert_clean_failure(&hypura(&["inspect", &dropped]), "reading bytes 0-");
    let oversized = raw_server(
        b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-999999999/2000000000\r\nContent-Length: 1000000000\r\n\r\nGGUF",
    );
    assert_clean_failure(&hypura(&["inspect", &oversized]), "the server sent \"bytes 0-999999999/2000000000\"");
}

/// `inspect --svg`: the plan at budgets from a sixteenth of the file to twice it, drawn; a small
/// model streams its FFN layers at the low budgets and is resident at the high ones, each point
/// in its mode's color, and this machine's budget is marked.
#[test]
fn inspect_draws_the_plan_at_every_budget() {
    let model = common::chat_model_path();
    let directory = tempfile::tempdir().unwrap();
    let svg = directory.path().join("budgets.svg");
    let output =
        common::hypura(&["inspect", model.to_str().unwrap(), "--context", "2048", "--svg", svg.to_str().unwrap()]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let text = std::fs::read_to_string(&svg).unwrap();
    for words in [
        "memory budget (GiB)",
        "predicted decode tokens per second",
        "this machine&apos;s memory budget",
        "dense-stream",
        "resident",
    ] {
        assert!(text.contains(words), "{words:?} is not in the picture");
    }
    // Both modes' strips: dense-stream's blue and resident's green rectangles.
    for color in ["#1F6FB4", "#2A9D55"] {
        assert!(text.matches(&format!("fill=\"{color}\"")).count() >= 3, "{color} is missing");
    }
}
