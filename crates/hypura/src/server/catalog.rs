//! The catalog: which models the server can serve, and how a request's model name finds its
//! file.
//!
//! Models come from GGUF paths named on the command line, every GGUF in the given directories,
//! and models already pulled by Ollama (its manifests and blobs, under `OLLAMA_MODELS` or
//! `~/.ollama/models`). A request's name is only ever compared with the names of files found by
//! scanning, never joined onto a path, so no name can reach outside the models directories;
//! names are also checked against Ollama's grammar first, and a manifest's blob digest must be
//! a sha256 in hex before it becomes a file name.
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use sha2::{Digest, Sha256};

use super::error::AppError;
use crate::format::hex;

const DEFAULT_HOST: &str = "registry.ollama.ai";
const DEFAULT_NAMESPACE: &str = "library";
const DEFAULT_TAG: &str = "latest";
const MODEL_MEDIA_TYPE: &str = "application/vnd.ollama.image.model";

/// A model the server can load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelEntry {
    /// The short display form, `model:tag` (Ollama's `/api/tags` form).
    pub name: String,
    /// `host/namespace/model:tag`, lower case: what requests are matched against.
    pub key: String,
    pub path: PathBuf,
    pub size: u64,
    pub modified: SystemTime,
    /// Hex sha256 of the manifest (Ollama models) or of the file's identity (plain files).
    pub digest: String,
    /// The namespace (`library` unless the model came from another one): OpenAI's `owned_by`.
    pub owner: String,
}

/// Where models are found.
#[derive(Clone, Debug, Default)]
pub struct Catalog {
    /// GGUF files named on the command line.
    pub files: Vec<PathBuf>,
    /// Directories whose GGUF files (top level) are served.
    pub directories: Vec<PathBuf>,
    /// Ollama model stores (each holding `manifests/` and `blobs/`).
    pub ollama_stores: Vec<PathBuf>,
    /// Models pulled from the hub (`hypura pull`, `/api/pull`), by the names they were pulled
    /// as (`hf.co/ORG/REPO:QUANT`; a file or URL pulled is named after its file).
    pub hub: Option<crate::hub::Hub>,
}

/// A parsed model name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelName {
    pub host: String,
    pub namespace: String,
    pub model: String,
    pub tag: String,
}

impl ModelName {
    /// Parse `[host/][namespace/]model[:tag]`, case-insensitively. None for names outside
    /// Ollama's grammar (empty parts, `..`, slashes in the tag, odd characters).
    pub fn parse(name: &str) -> Option<ModelName> {
        let name = name.trim().to_ascii_lowercase();
        let (path, tag) = match name.rfind(':') {
            Some(colon) if !name[colon + 1..].contains('/') => (&name[..colon], &name[colon + 1..]),
            _ => (name.as_str(), DEFAULT_TAG),
        };
        let parts: Vec<&str> = path.split('/').collect();
        if parts.len() > 3 || !parts.iter().all(|part| valid_part(part)) || !valid_part(tag) {
            return None;
        }
        let (host, namespace, model) = match parts.as_slice() {
            [model] => (DEFAULT_HOST, DEFAULT_NAMESPACE, *model),
            [namespace, model] => (DEFAULT_HOST, *namespace, *model),
            [host, namespace, model] => (*host, *namespace, *model),
            _ => return None,
        };
        Some(ModelName { host: host.into(), namespace: namespace.into(), model: model.into(), tag: tag.into() })
    }

    pub fn key(&self) -> String {
        format!("{}/{}/{}:{}", self.host, self.namespace, self.model, self.tag)
    }

    /// The shortest form: `model:tag` for the default host and namespace.
    pub fn display(&self) -> String {
        match (self.host.as_str(), self.namespace.as_str()) {
            (DEFAULT_HOST, DEFAULT_NAMESPACE) => format!("{}:{}", self.model, self.tag),
            (DEFAULT_HOST, namespace) => format!("{namespace}/{}:{}", self.model, self.tag),
            (host, namespace) => format!("{host}/{namespace}/{}:{}", self.model, self.tag),
        }
    }
}

/// A name part: letters, digits, `_`, `-` and `.`, starting with a letter, digit or `_`, at most
/// 128 characters. This excludes `.`, `..`, empty parts and every path separator.
fn valid_part(part: &str) -> bool {
    let mut characters = part.chars();
    let Some(first) = characters.next() else { return false };
    part.len() <= 128
        && (first.is_ascii_alphanumeric() || first == '_')
        && characters.all(|character| character.is_ascii_alphanumeric() || matches!(character, '_' | '-' | '.'))
}

impl Catalog {
    /// The Ollama store from the environment: `OLLAMA_MODELS`, else `~/.ollama/models`, if it
    /// exists.
    pub fn default_ollama_store() -> Option<PathBuf> {
        let path = match std::env::var_os("OLLAMA_MODELS") {
            Some(path) if !path.is_empty() => PathBuf::from(path),
            _ => dirs::home_dir()?.join(".ollama/models"),
        };
        path.join("manifests").is_dir().then_some(path)
    }

    /// Every model, sorted by name. Duplicate names keep the first found (command-line files
    /// first, then directories, then Ollama stores).
    pub fn scan(&self) -> Vec<ModelEntry> {
        let mut entries = Vec::new();
        for path in &self.files {
            if let Some(entry) = file_entry(path) {
                entries.push(entry);
            }
        }
        for directory in &self.directories {
            let Ok(listing) = std::fs::read_dir(directory) else { continue };
            let mut paths: Vec<PathBuf> = listing
                .filter_map(|item| item.ok().map(|item| item.path()))
                .filter(|path| is_first_gguf(path))
                .collect();
            paths.sort();
            entries.extend(paths.iter().filter_map(|path| file_entry(path)));
        }
        for store in &self.ollama_stores {
            entries.extend(ollama_entries(store));
        }
        if let Some(hub) = &self.hub {
            entries.extend(hub.list().iter().filter_map(|manifest| pulled_entry(hub, manifest)));
        }
        let mut seen = std::collections::HashSet::new();
        entries.retain(|entry| seen.insert(entry.key.clone()));
        entries.sort_by(|left, right| left.name.cmp(&right.name));
        entries
    }

    /// Find a model by name: 400 for a name outside Ollama's grammar, 404 for an unknown one.
    pub fn resolve(&self, name: &str) -> Result<ModelEntry, AppError> {
        let parsed = ModelName::parse(name).ok_or_else(|| AppError::bad_request("invalid model name"))?;
        let key = parsed.key();
        self.scan()
            .into_iter()
            .find(|entry| entry.key == key)
            .ok_or_else(|| AppError::not_found(format!("model '{name}' not found")))
    }
}

/// A GGUF file that is a model's first (or only) file: split parts after the first are
/// loaded through the first.
fn is_first_gguf(path: &Path) -> bool {
    let Some(name) = path.file_name().and_then(|name| name.to_str()) else { return false };
    if !name.to_ascii_lowercase().ends_with(".gguf") || !path.is_file() {
        return false;
    }
    // Split files are named `prefix-00001-of-00003.gguf`. Bytes, not a str slice: the name
    // may hold multi-byte characters.
    match name.rfind("-of-") {
        Some(index) if index >= 5 => {
            let part = &name.as_bytes()[index - 5..index];
            !part.iter().all(u8::is_ascii_digit) || part == b"00001"
        }
        _ => true,
    }
}

/// A plain file: named after its stem (lower case), tag `latest`.
fn file_entry(path: &Path) -> Option<ModelEntry> {
    let metadata = std::fs::metadata(path).ok()?;
    if !metadata.is_file() {
        return None;
    }
    let stem = path.file_stem()?.to_str()?;
    let parsed = ModelName::parse(stem)?;
    let modified = metadata.modified().unwrap_or(SystemTime::UNIX_EPOCH);
    // Hashing a multi-gigabyte file per listing is too slow: the digest identifies the file
    // by path, size and time instead, which changes whenever the file does.
    let identity = format!("{}\n{}\n{:?}", path.display(), metadata.len(), modified);
    Some(ModelEntry {
        name: parsed.display(),
        key: parsed.key(),
        path: path.to_path_buf(),
        size: metadata.len(),
        modified,
        digest: hex(&Sha256::digest(identity.as_bytes())),
        owner: parsed.namespace.clone(),
    })
}

/// A model pulled from the hub whose files are all there.
fn pulled_entry(hub: &crate::hub::Hub, manifest: &crate::hub::Manifest) -> Option<ModelEntry> {
    let path = hub.path_of(manifest);
    if !manifest.files.iter().all(|file| hub.models.join(&file.path).is_file()) {
        return None;
    }
    let Some(Ok(crate::hub::Source::Repo { .. })) = crate::hub::Source::parse(&manifest.name) else {
        return file_entry(&path);
    };
    let parsed = ModelName::parse(&manifest.name)?;
    Some(ModelEntry {
        name: parsed.display(),
        key: parsed.key(),
        size: manifest.bytes(),
        modified: SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(manifest.pulled_at),
        digest: manifest.files[0].sha256.clone(),
        owner: parsed.namespace.clone(),
        path,
    })
}

/// Models in an Ollama store: `manifests/<host>/<namespace>/<model>/<tag>`, each pointing at
/// its GGUF blob by digest.
fn ollama_entries(store: &Path) -> Vec<ModelEntry> {
    let mut entries = Vec::new();
    let manifests = store.join("manifests");
    for host in subdirectories(&manifests) {
        for namespace in subdirectories(&host) {
            for model in subdirectories(&namespace) {
                let Ok(tags) = std::fs::read_dir(&model) else { continue };
                for tag in tags.filter_map(|item| item.ok().map(|item| item.path())) {
                    let name = [&host, &namespace, &model, &tag]
                        .iter()
                        .map(|path| path.file_name().and_then(|name| name.to_str()).unwrap_or(""))
                        .collect::<Vec<_>>();
                    let Some(parsed) = ModelName::parse(&format!("{}/{}/{}:{}", name[0], name[1], name[2], name[3]))
                    else {
                        continue;
                    };
                    if let Some(entry) = manifest_entry(store, &tag, &parsed) {
                        entries.push(entry);
                    }
                }
            }
        }
    }
    entries
}

fn subdirectories(path: &Path) -> Vec<PathBuf> {
    let Ok(listing) = std::fs::read_dir(path) else { return Vec::new() };
    let mut directories: Vec<PathBuf> =
        listing.filter_map(|item| item.ok().map(|item| item.path())).filter(|path| path.is_dir()).collect();
    directories.sort();
    directories
}

fn manifest_entry(store: &Path, manifest_path: &Path, name: &ModelName) -> Option<ModelEntry> {
    let bytes = std::fs::read(manifest_path).ok()?;
    let manifest: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    let layer = manifest
        .get("layers")?
        .as_array()?
        .iter()
        .find(|layer| layer.get("mediaType").and_then(|kind| kind.as_str()) == Some(MODEL_MEDIA_TYPE))?;
    let digest = layer.get("digest")?.as_str()?;
    let hex_digest = digest.strip_prefix("sha256:")?;
    // The digest becomes a file name: only 64 hex digits may.
    if hex_digest.len() != 64 || !hex_digest.chars().all(|character| character.is_ascii_hexdigit()) {
        return None;
    }
    let blob = store.join("blobs").join(format!("sha256-{hex_digest}"));
    let blob_metadata = std::fs::metadata(&blob).ok()?;
    let modified =
        std::fs::metadata(manifest_path).and_then(|metadata| metadata.modified()).unwrap_or(SystemTime::UNIX_EPOCH);
    Some(ModelEntry {
        name: name.display(),
        key: name.key(),
        path: blob,
        size: blob_metadata.len(),
        modified,
        digest: hex(&Sha256::digest(&bytes)),
        owner: name.namespace.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_like_ollama() {
        let name = ModelName::parse("Llama3.2").unwrap();
        assert_eq!(name.key(), "registry.ollama.ai/library/llama3.2:latest");
        assert_eq!(name.display(), "llama3.2:latest");
        assert_eq!(ModelName::parse("me/model:q4").unwrap().display(), "me/model:q4");
        assert_eq!(ModelName::parse("host.io/me/model:q4").unwrap().key(), "host.io/me/model:q4");
        for bad in [
            "",
            "../etc/passwd",
            "a/../b",
            "a:b/c",
            "a//b",
            ".hidden",
            "a/b/c/d",
            "a:",
            "x\\y",
            "a b",
            "model:..",
            "/abs",
        ] {
            assert!(ModelName::parse(bad).is_none(), "{bad:?} should be refused");
        }
    }

    #[test]
    fn split_parts_after_the_first_are_not_models() {
        let directory = tempfile::tempdir().unwrap();
        for name in ["solo.gguf", "big-00001-of-00002.gguf", "big-00002-of-00002.gguf", "notes.txt"] {
            std::fs::write(directory.path().join(name), b"x").unwrap();
        }
        let catalog = Catalog { directories: vec![directory.path().to_path_buf()], ..Catalog::default() };
        let names: Vec<String> = catalog.scan().into_iter().map(|entry| entry.name).collect();
        assert_eq!(names, ["big-00001-of-00002:latest", "solo:latest"]);
    }

    #[test]
    fn ollama_manifests_resolve_to_blobs_and_bad_digests_are_ignored() {
        let store = tempfile::tempdir().unwrap();
        let digest = "a".repeat(64);
        std::fs::create_dir_all(store.path().join("blobs")).unwrap();
        std::fs::write(store.path().join(format!("blobs/sha256-{digest}")), b"gguf").unwrap();
        let write_manifest = |model: &str, digest: &str| {
            let directory = store.path().join("manifests/registry.ollama.ai/library").join(model);
            std::fs::create_dir_all(&directory).unwrap();
            let manifest = serde_json::json!({"layers": [{"mediaType": MODEL_MEDIA_TYPE, "digest": format!("sha256:{digest}"), "size": 4}]});
            std::fs::write(directory.join("latest"), manifest.to_string()).unwrap();
        };
        write_manifest("good", &digest);
        write_manifest("evil", "../../../../etc/passwd");
        let catalog = Catalog { ollama_stores: vec![store.path().to_path_buf()], ..Catalog::default() };
        let entry = catalog.resolve("good").unwrap();
        assert_eq!(entry.path, store.path().join(format!("blobs/sha256-{digest}")));
        assert_eq!(entry.name, "good:latest");
        assert_eq!(catalog.resolve("GOOD:latest").unwrap().path, entry.path);
        assert_eq!(catalog.resolve("evil").unwrap_err().status, axum::http::StatusCode::NOT_FOUND);
        assert_eq!(catalog.resolve("../good").unwrap_err().status, axum::http::StatusCode::BAD_REQUEST);
    }
}
