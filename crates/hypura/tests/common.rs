//! Shared helpers for integration tests: forged models in a temp dir and the real Gemma file.
#![allow(dead_code)]
use std::path::{Path, PathBuf};

use hypura_forge::{preset, write_model};

/// Forge `name` into `directory` and return its path.
pub fn forge(name: &str, directory: &Path) -> PathBuf {
    forge_with(name, directory, |_| {})
}

/// Forge `name`, changed by `adjust`, into `directory`.
pub fn forge_with(name: &str, directory: &Path, adjust: impl FnOnce(&mut hypura_forge::ForgeSpec)) -> PathBuf {
    let mut spec = preset(name).unwrap_or_else(|| panic!("no preset {name}"));
    adjust(&mut spec);
    let path = directory.join(format!("{name}.gguf"));
    write_model(&spec, &path, &|_, _| {}).unwrap_or_else(|error| panic!("forging {name}: {error}"));
    path
}

/// The real Gemma 3 270M file, fetched by `scripts/fetch-test-model` (CI runs it before the
/// tests). `HYPURA_TEST_MODEL` overrides the path.
pub fn gemma_path() -> PathBuf {
    if let Some(path) = std::env::var_os("HYPURA_TEST_MODEL") {
        return PathBuf::from(path);
    }
    let cache = std::env::var_os("HYPURA_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| dirs::cache_dir().map(|dir| dir.join("hypura")))
        .expect("a cache directory");
    let path = cache.join("models/gemma-3-270m-q4_k_m.gguf");
    assert!(path.exists(), "{} is missing: run scripts/fetch-test-model first", path.display());
    path
}
