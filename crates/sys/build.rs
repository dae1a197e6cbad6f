//! Builds the C shims (Hypura's stream buffer type, the memory-capped device of `hypura rpc-server`, the context's kernel switch, and the C interfaces of the chat layer and of speculative decoding) against the exact ggml headers that
//! llama-cpp-sys-2 vendors (`ggml-backend-impl.h` lives in `ggml/src`).
use std::path::PathBuf;

fn main() {
    let ggml = find_vendored_ggml();
    println!("cargo:rerun-if-changed=csrc/stream_buft.c");
    cc::Build::new()
        .file("csrc/stream_buft.c")
        .include(ggml.join("include"))
        .include(ggml.join("src"))
        .warnings(true)
        .compile("hypura_stream_buft");
    println!("cargo:rerun-if-changed=csrc/expert_ffn.c");
    cc::Build::new()
        .file("csrc/expert_ffn.c")
        .include(ggml.join("include"))
        .warnings(true)
        .compile("hypura_expert_ffn");
    println!("cargo:rerun-if-changed=csrc/rpc_device.c");
    cc::Build::new()
        .file("csrc/rpc_device.c")
        .include(ggml.join("include"))
        .include(ggml.join("src"))
        .warnings(true)
        .compile("hypura_rpc_device");
    // The context shim includes llama.cpp's own context header (its scheduler accessor).
    let llama = ggml.parent().expect("ggml sits in the llama.cpp tree").to_path_buf();
    println!("cargo:rerun-if-changed=csrc/context_kernels.cpp");
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .file("csrc/context_kernels.cpp")
        .include(llama.join("include"))
        .include(llama.join("src"))
        .include(ggml.join("include"))
        .warnings(true)
        .compile("hypura_context_kernels");
    // The chat shim reaches llama.cpp's chat layer (common/chat.h) and its JSON-schema
    // converter (common/json-schema-to-grammar.h), and the speculative shim its drafters
    // (common/speculative.h), all compiled into the llama-common library that the crate's
    // `common` feature links.
    println!("cargo:rerun-if-changed=csrc/shim_error.h");
    for (file, library) in [("csrc/chat.cpp", "hypura_chat"), ("csrc/speculative.cpp", "hypura_speculative")] {
        println!("cargo:rerun-if-changed={file}");
        cc::Build::new()
            .cpp(true)
            .std("c++17")
            .file(file)
            .include(llama.join("common"))
            .include(llama.join("include"))
            .include(llama.join("vendor"))
            .include(ggml.join("include"))
            .warnings(true)
            // llama.cpp's Jinja headers define static helpers that this file does not call.
            .flag_if_supported("-Wno-unused-function")
            .compile(library);
    }
}

/// The `ggml` directory of the llama-cpp-sys-2 source this build links.
fn find_vendored_ggml() -> PathBuf {
    println!("cargo:rerun-if-env-changed=HYPURA_LLAMA_CPP_DIR");
    // Cargo places the crate source next to ours in the registry; find it by its pinned version.
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let candidates = [
        std::env::var("HYPURA_LLAMA_CPP_DIR").ok().map(PathBuf::from),
        home_registry().map(|registry| registry.join(concat!("llama-cpp-sys-2-", "0.1.161")).join("llama.cpp")),
        Some(manifest.join("../../vendor/llama-cpp-sys-2/llama.cpp")),
    ];
    for candidate in candidates.into_iter().flatten() {
        if candidate.join("ggml/include/ggml.h").exists() {
            return candidate.join("ggml");
        }
    }
    panic!("cannot find the llama.cpp sources of llama-cpp-sys-2 0.1.161; set HYPURA_LLAMA_CPP_DIR");
}

fn home_registry() -> Option<PathBuf> {
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cargo")))?;
    let sources = cargo_home.join("registry/src");
    std::fs::read_dir(sources)
        .ok()?
        .flatten()
        .map(|entry| entry.path())
        .find(|path| path.join("llama-cpp-sys-2-0.1.161").exists())
}
