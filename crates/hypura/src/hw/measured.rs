//! What earlier runs measured about one model on this machine, kept as a small JSON file under
//! the cache directory so the next plan can use it: the decode compute time per token of
//! streaming runs (it sizes the dense window and states the physical limit). The key is the model file's identity (path,
//! size, modification time) and the machine key, so a changed file or machine starts afresh.
//! The model file itself is only ever read.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::cache::{fnv1a, machine_key, write_json_atomically};
use super::HwError;

/// Bumped when a field changes meaning; an older record is then ignored.
pub const RECORD_SCHEMA_VERSION: u32 = 1;

/// Measurements of one model on one machine.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelRecord {
    pub schema_version: u32,
    pub model_path: PathBuf,
    /// Decode time per token of streaming runs not spent waiting on reads, by CPU thread
    /// count. On a machine with few cores it includes the share of the CPU the reader threads
    /// take, which is what the window must plan around.
    #[serde(default)]
    pub compute_by_threads: BTreeMap<u32, ComputeMeasurement>,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ComputeMeasurement {
    pub seconds_per_token: f64,
    /// Tokens the figure averages over.
    pub tokens: u64,
}

impl ModelRecord {
    /// Fold in a new run: a running mean over all measured tokens.
    pub fn add_compute(&mut self, threads: u32, seconds: f64, tokens: u64) {
        if tokens == 0 || !seconds.is_finite() || seconds <= 0.0 {
            return;
        }
        let entry =
            self.compute_by_threads.entry(threads).or_insert(ComputeMeasurement { seconds_per_token: 0.0, tokens: 0 });
        let total = entry.tokens + tokens;
        entry.seconds_per_token = (entry.seconds_per_token * entry.tokens as f64 + seconds) / total as f64;
        entry.tokens = total;
    }

    pub fn compute_seconds_per_token(&self, threads: u32) -> Option<f64> {
        self.compute_by_threads.get(&threads).map(|measurement| measurement.seconds_per_token)
    }
}

/// The records under one cache directory.
#[derive(Clone, Debug)]
pub struct ModelRecords {
    dir: PathBuf,
}

impl ModelRecords {
    pub fn new(cache_dir: impl AsRef<Path>) -> ModelRecords {
        ModelRecords { dir: cache_dir.as_ref().join("measured") }
    }

    /// `<cache>/measured/<hash of machine and file identity>.json`.
    pub fn path_for(&self, model: &Path) -> Option<PathBuf> {
        let canonical = std::fs::canonicalize(model).ok()?;
        let metadata = std::fs::metadata(&canonical).ok()?;
        let modified =
            metadata.modified().ok()?.duration_since(std::time::UNIX_EPOCH).map_or(0, |since| since.as_nanos());
        let key = fnv1a(&[
            machine_key().as_bytes(),
            canonical.as_os_str().as_encoded_bytes(),
            &metadata.len().to_le_bytes(),
            &modified.to_le_bytes(),
        ]);
        Some(self.dir.join(format!("{key:016x}.json")))
    }

    /// The record for `model`, or an empty one (never an error: a record is only a hint).
    pub fn load(&self, model: &Path) -> ModelRecord {
        let empty = ModelRecord {
            schema_version: RECORD_SCHEMA_VERSION,
            model_path: model.to_path_buf(),
            ..ModelRecord::default()
        };
        let Some(path) = self.path_for(model) else { return empty };
        let Ok(text) = std::fs::read_to_string(&path) else { return empty };
        match serde_json::from_str::<ModelRecord>(&text) {
            Ok(record) if record.schema_version == RECORD_SCHEMA_VERSION => record,
            Ok(_) => empty,
            Err(error) => {
                tracing::warn!(path = %path.display(), %error, "ignoring an unreadable measurement record");
                empty
            }
        }
    }

    /// Load, change and write back the record of `model` (through a temporary file and a
    /// rename, so a reader never sees half a file).
    pub fn update(&self, model: &Path, change: impl FnOnce(&mut ModelRecord)) -> Result<(), HwError> {
        let Some(path) = self.path_for(model) else { return Ok(()) };
        let mut record = self.load(model);
        change(&mut record);
        write_json_atomically(&self.dir, &path, &record)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small "model" file and the records under the same temporary directory.
    fn fixture() -> (tempfile::TempDir, PathBuf, ModelRecords) {
        let directory = tempfile::tempdir().unwrap();
        let model = directory.path().join("model.gguf");
        std::fs::write(&model, b"GGUF").unwrap();
        let records = ModelRecords::new(directory.path());
        (directory, model, records)
    }

    #[test]
    fn records_round_trip_and_average_over_tokens() {
        let (directory, model, records) = fixture();
        assert_eq!(records.load(&model).compute_seconds_per_token(2), None);
        records.update(&model, |record| record.add_compute(2, 1.0, 10)).unwrap();
        records.update(&model, |record| record.add_compute(2, 3.0, 10)).unwrap();
        records.update(&model, |record| record.add_compute(4, 0.0, 10)).unwrap();
        let record = records.load(&model);
        assert!((record.compute_seconds_per_token(2).unwrap() - 0.2).abs() < 1e-12);
        assert_eq!(record.compute_by_threads[&2].tokens, 20);
        assert_eq!(record.compute_seconds_per_token(4), None, "a zero time is not a measurement");
        // Only the record, no temporary file.
        assert_eq!(std::fs::read_dir(directory.path().join("measured")).unwrap().count(), 1);
    }

    #[test]
    fn a_changed_file_or_garbage_starts_afresh() {
        let (_directory, model, records) = fixture();
        records.update(&model, |record| record.add_compute(2, 1.0, 10)).unwrap();
        let old_path = records.path_for(&model).unwrap();
        std::fs::write(&model, b"GGUF and more").unwrap();
        assert_ne!(records.path_for(&model).unwrap(), old_path, "another size is another file");
        assert_eq!(records.load(&model).compute_seconds_per_token(2), None);
        std::fs::write(records.path_for(&model).unwrap(), "{ not json").unwrap();
        assert_eq!(records.load(&model).compute_seconds_per_token(2), None);
        records.update(&model, |record| record.add_compute(2, 0.5, 5)).unwrap();
        assert_eq!(records.load(&model).compute_seconds_per_token(2), Some(0.1));
    }
}
