//! Models from the hub by name: `hypura pull`, a name that `run`, `serve`, `bench` and
//! `inspect` pull on first use, and the server's `/api/pull`.
//!
//! A name is one of:
//! - `hf.co/ORG/REPO[:QUANT]`, Ollama's form. It means the repository's GGUF whose name
//!   carries that quantization (Q4_K_M by default), with every part of a split model.
//! - `hf://ORG/REPO/FILE.gguf`, one file on the main branch.
//! - an `http(s)://` URL.
//!
//! The hub is `HF_ENDPOINT` (a mirror), or huggingface.co. `HF_TOKEN` is sent as a bearer
//! token to it, as the Hub's own tools send it. A repository's files, their sizes and their
//! SHA-256 (the LFS oid) come from its tree (`/api/models/ORG/REPO/tree/main`); a plain URL's
//! hash comes from the `X-Linked-Etag` header where the server gives one.
//!
//! Files land in the models directory (`HYPURA_MODELS`, else `~/.cache/hypura/models`), under
//! `hf.co/ORG/REPO/` or `urls/HOST/`, and each pulled name has a manifest in `manifests/`
//! (`Manifest`) that `list`, `rm` and the server's catalog read. `download` writes a file as
//! `NAME.partial`, resumes it with a range request, checks its size and hash, and only then
//! renames it into place.
mod download;

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

pub use download::Progress;

/// The quantization `hf.co/ORG/REPO` means without a tag, as Ollama picks it.
pub const DEFAULT_QUANT: &str = "Q4_K_M";
const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
const MANIFESTS: &str = "manifests";

#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error("{0}")]
    Name(String),
    #[error("{url}: {message}")]
    Http { url: String, message: String },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{0}")]
    NotFound(String),
    /// The hub answered 401 or 403.
    #[error("{0}")]
    Unauthorized(String),
    /// No space for it, or a hash that does not match.
    #[error("{0}")]
    Refused(String),
}

pub(crate) fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> HubError + '_ {
    move |source| HubError::Io { path: path.to_path_buf(), source }
}

/// What a name asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// `hf.co/ORG/REPO[:QUANT]`.
    Repo { org: String, repo: String, quant: String },
    /// `hf://ORG/REPO/FILE`.
    File { org: String, repo: String, file: String },
    /// An `http(s)://` URL.
    Url(String),
}

impl Source {
    /// The name's source, or None when `name` is no hub name (a path, an Ollama name).
    pub fn parse(name: &str) -> Option<Result<Source, HubError>> {
        let name = name.trim();
        if name.starts_with("http://") || name.starts_with("https://") {
            return Some(Ok(Source::Url(name.to_string())));
        }
        let bad = |form: &str| Some(Err(HubError::Name(format!("{name:?}: a hub name is {form}"))));
        if let Some(rest) = name.strip_prefix("hf://") {
            let mut parts = rest.splitn(3, '/');
            return match (parts.next(), parts.next(), parts.next()) {
                (Some(org), Some(repo), Some(file)) if valid(org) && valid(repo) && valid_path(file) => {
                    Some(Ok(Source::File { org: org.into(), repo: repo.into(), file: file.into() }))
                }
                _ => bad("hf://ORG/REPO/FILE.gguf"),
            };
        }
        let rest = ["hf.co/", "huggingface.co/"].iter().find_map(|host| strip_prefix_ignore_case(name, host))?;
        let (path, quant) = match rest.rsplit_once(':') {
            Some((path, quant)) => (path, quant),
            None => (rest, DEFAULT_QUANT),
        };
        match path.split_once('/') {
            Some((org, repo)) if valid(org) && valid(repo) && valid(quant) && !quant.eq_ignore_ascii_case("latest") => {
                Some(Ok(Source::Repo { org: org.into(), repo: repo.into(), quant: quant.to_ascii_uppercase() }))
            }
            Some((org, repo)) if valid(org) && valid(repo) && quant.eq_ignore_ascii_case("latest") => {
                Some(Ok(Source::Repo { org: org.into(), repo: repo.into(), quant: DEFAULT_QUANT.into() }))
            }
            _ => bad("hf.co/ORG/REPO[:QUANT]"),
        }
    }

    /// The name a pull of it is listed by: `hf.co/ORG/REPO:QUANT`, `hf://ORG/REPO/FILE`, or
    /// the URL.
    pub fn name(&self) -> String {
        match self {
            Source::Repo { org, repo, quant } => format!("hf.co/{org}/{repo}:{quant}"),
            Source::File { org, repo, file } => format!("hf://{org}/{repo}/{file}"),
            Source::Url(url) => url.clone(),
        }
    }
}

fn strip_prefix_ignore_case<'a>(text: &'a str, prefix: &str) -> Option<&'a str> {
    let head = text.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix).then(|| &text[prefix.len()..])
}

/// An organisation, repository or tag: letters, digits, `-`, `_` and `.`, not a dot alone.
fn valid(part: &str) -> bool {
    !part.is_empty()
        && part.len() <= 128
        && !part.starts_with('.')
        && part.chars().all(|character| character.is_ascii_alphanumeric() || matches!(character, '-' | '_' | '.'))
}

/// A file's path in a repository: valid parts joined by `/`.
fn valid_path(path: &str) -> bool {
    path.split('/').all(valid)
}

/// A file to pull.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteFile {
    pub url: String,
    /// Where it lands, under the models directory.
    pub relative: PathBuf,
    pub size: Option<u64>,
    /// Hex SHA-256 the hub gives for it.
    pub sha256: Option<String>,
}

/// A name pulled: its files, first first.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub name: String,
    pub files: Vec<PulledFile>,
    /// Seconds since the epoch.
    pub pulled_at: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PulledFile {
    /// Relative to the models directory.
    pub path: PathBuf,
    pub bytes: u64,
    pub sha256: String,
    /// Whether the hub gave the hash it was checked against.
    pub verified: bool,
    pub url: String,
}

impl Manifest {
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|file| file.bytes).sum()
    }
}

/// The hub and the models directory.
#[derive(Clone, Debug)]
pub struct Hub {
    pub endpoint: String,
    token: Option<String>,
    pub models: PathBuf,
}

/// One entry of a repository's tree.
#[derive(Debug, Deserialize)]
struct TreeEntry {
    #[serde(rename = "type")]
    kind: String,
    path: String,
    #[serde(default)]
    size: Option<u64>,
    #[serde(default)]
    lfs: Option<Lfs>,
}

#[derive(Debug, Deserialize)]
struct Lfs {
    oid: String,
}

impl Hub {
    /// From the environment: `HF_ENDPOINT`, `HF_TOKEN` (or `HUGGING_FACE_HUB_TOKEN`), and
    /// `HYPURA_MODELS`, else `models` under Hypura's cache directory.
    pub fn from_env(cache_dir: &Path) -> Hub {
        let variable = |name: &str| {
            std::env::var(name).ok().map(|value| value.trim().to_string()).filter(|value| !value.is_empty())
        };
        Hub {
            endpoint: variable("HF_ENDPOINT")
                .unwrap_or_else(|| DEFAULT_ENDPOINT.into())
                .trim_end_matches('/')
                .to_string(),
            token: variable("HF_TOKEN").or_else(|| variable("HUGGING_FACE_HUB_TOKEN")),
            models: variable("HYPURA_MODELS").map(PathBuf::from).unwrap_or_else(|| cache_dir.join("models")),
        }
    }

    pub(crate) fn agent(&self) -> ureq::Agent {
        ureq::Agent::config_builder()
            .timeout_connect(Some(Duration::from_secs(30)))
            .timeout_recv_response(Some(Duration::from_secs(120)))
            .timeout_recv_body(Some(Duration::from_secs(120)))
            .http_status_as_error(false)
            .build()
            .into()
    }

    /// The token goes to the hub only, never to another host a URL names.
    pub(crate) fn authorize(
        &self,
        request: ureq::RequestBuilder<ureq::typestate::WithoutBody>,
        url: &str,
    ) -> ureq::RequestBuilder<ureq::typestate::WithoutBody> {
        match &self.token {
            Some(token) if url.starts_with(&self.endpoint) => {
                request.header("Authorization", format!("Bearer {token}"))
            }
            _ => request,
        }
    }

    /// The files `source` stands for, first first.
    pub fn resolve(&self, source: &Source) -> Result<Vec<RemoteFile>, HubError> {
        match source {
            Source::Url(url) => {
                let name = url.rsplit('/').next().filter(|name| valid(name)).unwrap_or("model.gguf");
                let host = url.split("://").nth(1).and_then(|rest| rest.split(['/', ':']).next()).unwrap_or("host");
                let host = if valid(host) { host } else { "host" };
                Ok(vec![RemoteFile {
                    url: url.clone(),
                    relative: Path::new("urls").join(host).join(name),
                    size: None,
                    sha256: None,
                }])
            }
            Source::File { org, repo, file } => {
                let tree = self.tree(org, repo)?;
                let entry = tree
                    .iter()
                    .find(|entry| entry.path == *file)
                    .ok_or_else(|| HubError::NotFound(format!("{org}/{repo} has no file {file} on its main branch")))?;
                Ok(vec![self.remote_file(org, repo, entry)])
            }
            Source::Repo { org, repo, quant } => {
                let tree = self.tree(org, repo)?;
                let ggufs: Vec<&TreeEntry> = tree
                    .iter()
                    .filter(|entry| entry.kind == "file" && entry.path.to_ascii_lowercase().ends_with(".gguf"))
                    .filter(|entry| !entry.path.to_ascii_lowercase().contains("mmproj"))
                    .collect();
                let wanted = quant.to_ascii_lowercase();
                let mut matching: Vec<&TreeEntry> =
                    ggufs.iter().copied().filter(|entry| carries_quant(&entry.path, &wanted)).collect();
                matching.sort_by(|left, right| left.path.cmp(&right.path));
                let Some(first) = matching.first() else {
                    let mut quants: Vec<String> = ggufs.iter().filter_map(|entry| quant_of(&entry.path)).collect();
                    quants.sort();
                    quants.dedup();
                    return Err(HubError::NotFound(if ggufs.is_empty() {
                        format!("{org}/{repo} holds no GGUF file")
                    } else {
                        format!("{org}/{repo} has no {quant} GGUF; it has {}", quants.join(", "))
                    }));
                };
                // A split model's parts share the first's name up to `-NNNNN-of-MMMMM.gguf`.
                let files: Vec<&TreeEntry> = match split_stem(&first.path) {
                    Some((stem, count)) => {
                        let parts: Vec<&TreeEntry> = matching
                            .iter()
                            .copied()
                            .filter(|entry| split_stem(&entry.path).is_some_and(|(other, _)| other == stem))
                            .collect();
                        if parts.len() != count {
                            return Err(HubError::NotFound(format!(
                                "{org}/{repo}: {} has {} of its {count} parts",
                                first.path,
                                parts.len()
                            )));
                        }
                        parts
                    }
                    None => vec![*first],
                };
                Ok(files.into_iter().map(|entry| self.remote_file(org, repo, entry)).collect())
            }
        }
    }

    fn remote_file(&self, org: &str, repo: &str, entry: &TreeEntry) -> RemoteFile {
        RemoteFile {
            url: format!("{}/{org}/{repo}/resolve/main/{}", self.endpoint, entry.path),
            relative: Path::new("hf.co").join(org).join(repo).join(&entry.path),
            size: entry.size,
            sha256: entry.lfs.as_ref().map(|lfs| lfs.oid.to_ascii_lowercase()).filter(|oid| is_sha256(oid)),
        }
    }

    /// A repository's files on its main branch, every page of them.
    fn tree(&self, org: &str, repo: &str) -> Result<Vec<TreeEntry>, HubError> {
        let agent = self.agent();
        let mut url = format!("{}/api/models/{org}/{repo}/tree/main?recursive=true", self.endpoint);
        let mut entries = Vec::new();
        for _ in 0..1000 {
            let mut response = self
                .authorize(agent.get(&url), &url)
                .call()
                .map_err(|error| HubError::Http { url: url.clone(), message: error.to_string() })?;
            check_status(response.status().as_u16(), &format!("{org}/{repo}"), &url)?;
            let next = response.headers().get("link").and_then(|link| link.to_str().ok()).and_then(next_link);
            let page = response.body_mut().with_config().limit(64 << 20).read_to_vec().map_err(|error| {
                HubError::Http { url: url.clone(), message: format!("the repository's tree: {error}") }
            })?;
            let page: Vec<TreeEntry> = serde_json::from_slice(&page).map_err(|error| HubError::Http {
                url: url.clone(),
                message: format!("the repository's tree: {error}"),
            })?;
            entries.extend(page);
            match next {
                Some(next) => url = next,
                None => return Ok(entries),
            }
        }
        Err(HubError::Http { url, message: "the repository's tree has more than 1,000 pages".into() })
    }

    fn manifest_path(&self, name: &str) -> PathBuf {
        let escaped: String = name
            .chars()
            .map(|character| match character {
                'a'..='z' | 'A'..='Z' | '0'..='9' | '-' | '_' | '.' => character.to_string(),
                other => format!("%{:02X}", other as u32 & 0xff),
            })
            .collect();
        self.models.join(MANIFESTS).join(format!("{escaped}.json"))
    }

    /// The manifest of a pulled name whose files are all on disk.
    pub fn pulled(&self, source: &Source) -> Option<Manifest> {
        let manifest = read_manifest(&self.manifest_path(&source.name()))?;
        manifest.files.iter().all(|file| self.models.join(&file.path).is_file()).then_some(manifest)
    }

    /// The first file of a pulled manifest.
    pub fn path_of(&self, manifest: &Manifest) -> PathBuf {
        self.models.join(&manifest.files[0].path)
    }

    /// Every pulled name, sorted.
    pub fn list(&self) -> Vec<Manifest> {
        let Ok(entries) = std::fs::read_dir(self.models.join(MANIFESTS)) else { return Vec::new() };
        let mut manifests: Vec<Manifest> = entries.flatten().filter_map(|entry| read_manifest(&entry.path())).collect();
        manifests.sort_by(|left, right| left.name.cmp(&right.name));
        manifests
    }

    /// Remove a pulled name: its files and its manifest.
    pub fn remove(&self, name: &str) -> Result<Manifest, HubError> {
        let manifest = self
            .list()
            .into_iter()
            .find(|manifest| {
                manifest.name.eq_ignore_ascii_case(name)
                    || Source::parse(name).and_then(Result::ok).is_some_and(|source| source.name() == manifest.name)
            })
            .ok_or_else(|| HubError::NotFound(format!("model '{name}' not found")))?;
        for file in &manifest.files {
            let path = self.models.join(&file.path);
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                Err(error) => return Err(HubError::Io { path, source: error }),
            }
        }
        let path = self.manifest_path(&manifest.name);
        std::fs::remove_file(&path).map_err(io_error(&path))?;
        Ok(manifest)
    }

    /// Pull `source`: every file, resumed where an earlier pull stopped, checked, renamed into
    /// place; then its manifest. `progress` hears of each step.
    pub fn pull(&self, source: &Source, progress: &mut dyn FnMut(Progress)) -> Result<Manifest, HubError> {
        progress(Progress::Resolving);
        let files = self.resolve(source)?;
        self.pull_files(source, &files, progress)
    }

    /// Pull files already resolved (`resolve`).
    pub fn pull_files(
        &self,
        source: &Source,
        files: &[RemoteFile],
        progress: &mut dyn FnMut(Progress),
    ) -> Result<Manifest, HubError> {
        std::fs::create_dir_all(&self.models).map_err(io_error(&self.models))?;
        download::check_space(&self.models, files, &self.models)?;
        let mut pulled = Vec::new();
        for (index, file) in files.iter().enumerate() {
            pulled.push(download::fetch(self, file, index, files.len(), progress)?);
        }
        let manifest = Manifest {
            name: source.name(),
            files: pulled,
            pulled_at: SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |since| since.as_secs()),
        };
        let path = self.manifest_path(&manifest.name);
        let directory = path.parent().expect("a manifest has a directory");
        std::fs::create_dir_all(directory).map_err(io_error(directory))?;
        let text = serde_json::to_string_pretty(&manifest).expect("a manifest serialises");
        let temporary = path.with_extension("json.partial");
        std::fs::write(&temporary, text).map_err(io_error(&temporary))?;
        std::fs::rename(&temporary, &path).map_err(io_error(&path))?;
        progress(Progress::Done);
        Ok(manifest)
    }
}

fn read_manifest(path: &Path) -> Option<Manifest> {
    if path.extension()? != "json" {
        return None;
    }
    let text = std::fs::read_to_string(path).ok()?;
    let manifest: Manifest = serde_json::from_str(&text).ok()?;
    // A manifest names files under the models directory only.
    let inside = |path: &Path| path.components().all(|part| matches!(part, std::path::Component::Normal(_)));
    (!manifest.files.is_empty() && manifest.files.iter().all(|file| inside(&file.path))).then_some(manifest)
}

/// One line for a status the hub answered with: 401 and 403 say what a token does, 404 what
/// was missing.
pub(crate) fn check_status(status: u16, what: &str, url: &str) -> Result<(), HubError> {
    match status {
        200..=299 => Ok(()),
        401 | 403 => Err(HubError::Unauthorized(format!(
            "{what}: the hub refused access ({status}); a private or gated repository needs HF_TOKEN with access to it"
        ))),
        404 => Err(HubError::NotFound(format!("{what}: not found on {} (404)", host_of(url)))),
        _ => Err(HubError::Http { url: url.to_string(), message: format!("the server answered {status}") }),
    }
}

fn host_of(url: &str) -> &str {
    url.split("://").nth(1).and_then(|rest| rest.split('/').next()).unwrap_or(url)
}

/// The `rel="next"` address of a `Link` header.
fn next_link(link: &str) -> Option<String> {
    link.split(',').find(|part| part.contains("rel=\"next\"")).and_then(|part| {
        let start = part.find('<')? + 1;
        let end = part.find('>')?;
        Some(part[start..end].to_string())
    })
}

pub(crate) fn is_sha256(text: &str) -> bool {
    text.len() == 64 && text.bytes().all(|byte| byte.is_ascii_hexdigit())
}

/// Whether a file's name carries `quant` (lower case) as a word: `model-Q4_K_M.gguf`, not
/// `model-Q4_K_M_L.gguf` for `q4_k_m`.
fn carries_quant(path: &str, quant: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path).to_ascii_lowercase();
    let directory = path.to_ascii_lowercase();
    let word = |text: &str| {
        text.match_indices(quant).any(|(at, _)| {
            let before = text[..at].chars().next_back();
            let after = text[at + quant.len()..].chars().next();
            before.is_none_or(|character| !character.is_ascii_alphanumeric() && character != '_')
                && after.is_none_or(|character| !character.is_ascii_alphanumeric() && character != '_')
        })
    };
    word(&name) || word(&directory)
}

/// The quantization a GGUF's name carries, for the list of what a repository has.
fn quant_of(path: &str) -> Option<String> {
    let name = path.rsplit('/').next()?.to_ascii_uppercase();
    let stem = name.strip_suffix(".GGUF")?;
    let stem = split_stem(path)
        .map_or(stem.to_string(), |(stem, _)| stem.rsplit('/').next().unwrap_or(stem).to_ascii_uppercase());
    stem.split(['-', '.'])
        .rev()
        .find(|word| word.starts_with('Q') || word.starts_with("IQ") || ["F16", "BF16", "F32"].contains(word))
        .map(str::to_string)
}

/// For `…-00001-of-00003.gguf`: the name before `-00001` and the part count.
fn split_stem(path: &str) -> Option<(&str, usize)> {
    let lower = path.to_ascii_lowercase();
    let stem = lower.strip_suffix(".gguf")?;
    let (before, count) = stem.rsplit_once("-of-")?;
    let (name, _part) = before.rsplit_once('-')?;
    let digits = |text: &str| text.len() == 5 && text.bytes().all(|byte| byte.is_ascii_digit());
    if !digits(count) || !digits(&before[name.len() + 1..]) {
        return None;
    }
    Some((&path[..name.len()], count.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        let repo = |org: &str, repo: &str, quant: &str| Source::Repo {
            org: org.into(),
            repo: repo.into(),
            quant: quant.into(),
        };
        assert_eq!(Source::parse("hf.co/Qwen/Qwen2.5-GGUF").unwrap().unwrap(), repo("Qwen", "Qwen2.5-GGUF", "Q4_K_M"));
        assert_eq!(
            Source::parse("hf.co/Qwen/Qwen2.5-GGUF:q8_0").unwrap().unwrap(),
            repo("Qwen", "Qwen2.5-GGUF", "Q8_0")
        );
        assert_eq!(Source::parse("huggingface.co/a/b:latest").unwrap().unwrap(), repo("a", "b", "Q4_K_M"));
        assert_eq!(
            Source::parse("hf://a/b/dir/m.gguf").unwrap().unwrap(),
            Source::File { org: "a".into(), repo: "b".into(), file: "dir/m.gguf".into() }
        );
        assert!(Source::parse("hf://a/../m.gguf").unwrap().is_err());
        assert!(Source::parse("hf.co/a").unwrap().is_err());
        assert!(Source::parse("smollm2:135m").is_none() && Source::parse("/models/m.gguf").is_none());
        assert_eq!(repo("a", "b", "Q8_0").name(), "hf.co/a/b:Q8_0");
    }

    #[test]
    fn quantizations_and_splits() {
        assert!(carries_quant("m-Q4_K_M.gguf", "q4_k_m"));
        assert!(!carries_quant("m-Q4_K_M_L.gguf", "q4_k_m"));
        assert!(!carries_quant("m-Q4_K_S.gguf", "q4_k_m"));
        assert!(carries_quant("Q8_0/m-00001-of-00002.gguf", "q8_0"));
        assert_eq!(split_stem("big-Q8_0-00002-of-00003.gguf"), Some(("big-Q8_0", 3)));
        assert_eq!(split_stem("m-Q8_0.gguf"), None);
        assert_eq!(quant_of("m-q4_k_m.gguf").as_deref(), Some("Q4_K_M"));
        assert_eq!(quant_of("big-Q8_0-00001-of-00003.gguf").as_deref(), Some("Q8_0"));
        assert_eq!(next_link("<https://h/api?cursor=x>; rel=\"next\"").as_deref(), Some("https://h/api?cursor=x"));
    }
}
