//! Models split by llama.cpp's `gguf-split` into `<prefix>-00001-of-0000N.gguf` files.
//!
//! Only the first split carries the model metadata; every split carries `split.no` (0-based),
//! `split.count`, and the first one `split.tensors.count`. Each split has its own tensor index
//! and data section, so a tensor is located by (split, absolute offset in that file).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::GgufError;
use crate::reader::{Gguf, TensorInfo};
use crate::Result;

/// 0-based index of this split (u16 in files written by gguf-split).
pub const SPLIT_NO_KEY: &str = "split.no";
/// Number of splits (u16).
pub const SPLIT_COUNT_KEY: &str = "split.count";
/// Total tensors across all splits (i32).
pub const SPLIT_TENSORS_COUNT_KEY: &str = "split.tensors.count";

/// All the files of one model, in split order.
#[derive(Clone, Debug)]
pub struct ModelFiles {
    pub splits: Vec<SplitFile>,
}

/// One file of a model.
#[derive(Clone, Debug)]
pub struct SplitFile {
    pub path: PathBuf,
    pub gguf: Gguf,
}

/// A tensor together with the file that holds it.
#[derive(Clone, Copy, Debug)]
pub struct TensorRef<'a> {
    pub split: usize,
    pub path: &'a Path,
    pub info: &'a TensorInfo,
    /// Absolute offset of the tensor's data in `path`.
    pub file_offset: u64,
}

/// The file name llama.cpp gives split `index` (0-based) of `count` (`llama_split_path`).
pub fn split_file_name(prefix: &str, index: u64, count: u64) -> String {
    format!("{prefix}-{:05}-of-{count:05}.gguf", index + 1)
}

impl ModelFiles {
    /// Opens a plain GGUF file, or the first split of a split model together with all the
    /// other splits (found next to it by name). Checks each split's `split.no` and
    /// `split.count`, the total tensor count, and that no tensor name appears twice.
    pub fn open(path: &Path) -> Result<ModelFiles> {
        // The first file is opened whatever it is, so that its own error (a directory, no
        // permission, no such file) is the one reported, as before splits were read by name.
        ModelFiles::open_with(path, |split| {
            if split == path || split.is_file() {
                Gguf::open(split).map(Some)
            } else {
                Ok(None)
            }
        })
    }

    /// `open`, with each file's index read by `open_split` (None: there is no such file), so
    /// that the files may be elsewhere than on this disk: `path` and the splits' names next to
    /// it are only names here (a URL's last segment works as a file name does).
    pub fn open_with(path: &Path, mut open_split: impl FnMut(&Path) -> Result<Option<Gguf>>) -> Result<ModelFiles> {
        let first = open_split(path)?.ok_or_else(|| GgufError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        })?;
        let count = match first.get(SPLIT_COUNT_KEY) {
            None => 1,
            Some(value) => {
                value.as_u64().ok_or(GgufError::SplitKey { path: path.to_path_buf(), key: SPLIT_COUNT_KEY })?
            }
        };
        if count <= 1 {
            let files = ModelFiles { splits: vec![SplitFile { path: path.to_path_buf(), gguf: first }] };
            files.check_unique_names()?;
            return Ok(files);
        }
        let index = split_no(&first, path)?;
        if index != 0 {
            return Err(GgufError::NotFirstSplit { path: path.to_path_buf(), index });
        }
        // split.count is a u16 in gguf-split files; anything larger is corrupt, and this also
        // bounds the number of file names generated below.
        if count > u64::from(u16::MAX) {
            return Err(GgufError::SplitCount {
                path: path.to_path_buf(),
                expected: u64::from(u16::MAX),
                found: count,
            });
        }

        let file_name = path.file_name().and_then(|name| name.to_str()).unwrap_or("");
        let suffix = format!("-{:05}-of-{count:05}.gguf", 1);
        let prefix = file_name
            .strip_suffix(&suffix)
            .filter(|prefix| !prefix.is_empty())
            .ok_or(GgufError::SplitName { path: path.to_path_buf(), index: 0, count })?;
        let directory = path.parent().unwrap_or(Path::new(""));

        let mut splits = vec![SplitFile { path: path.to_path_buf(), gguf: first }];
        for index in 1..count {
            let split_path = directory.join(split_file_name(prefix, index, count));
            let Some(gguf) = open_split(&split_path)? else {
                return Err(GgufError::SplitMissing { path: split_path, index, count });
            };
            let found_index = split_no(&gguf, &split_path)?;
            if found_index != index {
                return Err(GgufError::SplitIndex { path: split_path, expected: index, found: found_index });
            }
            let found_count = gguf
                .get_u64(SPLIT_COUNT_KEY)
                .ok_or(GgufError::SplitKey { path: split_path.clone(), key: SPLIT_COUNT_KEY })?;
            if found_count != count {
                return Err(GgufError::SplitCount { path: split_path, expected: count, found: found_count });
            }
            splits.push(SplitFile { path: split_path, gguf });
        }

        let files = ModelFiles { splits };
        let found: u64 = files.splits.iter().map(|split| split.gguf.tensors.len() as u64).sum();
        if let Some(expected) = files.first().get(SPLIT_TENSORS_COUNT_KEY) {
            let expected = expected
                .as_u64()
                .ok_or(GgufError::SplitKey { path: path.to_path_buf(), key: SPLIT_TENSORS_COUNT_KEY })?;
            if expected != found {
                return Err(GgufError::SplitTensorCount { expected, found });
            }
        }
        files.check_unique_names()?;
        Ok(files)
    }

    fn check_unique_names(&self) -> Result<()> {
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for tensor in self.tensors() {
            if let Some(&first) = seen.get(tensor.info.name.as_str()) {
                return Err(GgufError::DuplicateTensorAcrossSplits {
                    name: tensor.info.name.clone(),
                    first,
                    second: tensor.split,
                });
            }
            seen.insert(&tensor.info.name, tensor.split);
        }
        Ok(())
    }

    /// The first split, which holds the model metadata.
    pub fn first(&self) -> &Gguf {
        &self.splits[0].gguf
    }

    /// Every tensor of every split, in split then file order.
    pub fn tensors(&self) -> impl Iterator<Item = TensorRef<'_>> {
        self.splits.iter().enumerate().flat_map(|(split, file)| {
            file.gguf.tensors.iter().map(move |info| TensorRef {
                split,
                path: &file.path,
                info,
                file_offset: file.gguf.data_offset + info.offset,
            })
        })
    }

    /// Sum of the sizes of all split files.
    pub fn total_file_bytes(&self) -> u64 {
        self.splits.iter().map(|split| split.gguf.file_bytes).sum()
    }
}

fn split_no(gguf: &Gguf, path: &Path) -> Result<u64> {
    gguf.get_u64(SPLIT_NO_KEY).ok_or(GgufError::SplitKey { path: path.to_path_buf(), key: SPLIT_NO_KEY })
}
