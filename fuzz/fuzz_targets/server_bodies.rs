//! The server's request bodies through the real handlers (`hypura::server::fuzz::Harness`),
//! against a tiny forged Qwen3 that really loads and answers: Ollama's and OpenAI's chat,
//! generate and embed, with tools, options and formats. The first byte picks the endpoint, the
//! rest is the body. No body may panic a handler or get a 500.
#![no_main]
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;

fn harness() -> &'static hypura::server::fuzz::Harness {
    static HARNESS: OnceLock<hypura::server::fuzz::Harness> = OnceLock::new();
    HARNESS.get_or_init(|| {
        let directory = std::env::temp_dir().join(format!("hypura-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&directory).expect("a temporary directory");
        let path = directory.join("tiny-qwen3.gguf");
        let spec = hypura_forge::preset("tiny-qwen3").expect("the preset");
        hypura_forge::write_model(&spec, &path, &|_, _| {}).expect("the forged model");
        hypura::server::fuzz::Harness::new(&path)
    })
}

fuzz_target!(|input: &[u8]| {
    if let Err(why) = harness().request(input) {
        panic!("{why}");
    }
});
