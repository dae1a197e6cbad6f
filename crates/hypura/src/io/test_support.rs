//! Files on the build disk for the raw I/O tests.
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// A directory on the disk the build lives on (next to the test binary, inside the ignored
/// target directory), because /tmp may be tmpfs, where O_DIRECT behaves differently.
pub(crate) fn disk_test_directory() -> tempfile::TempDir {
    let executable = std::env::current_exe().expect("test binary path");
    let directory = executable.parent().expect("test binary directory");
    tempfile::Builder::new()
        .prefix(".hypura-io-test-")
        .tempdir_in(directory)
        .expect("create a test directory on the build disk")
}

/// Bytes that differ at every offset, so a read from the wrong offset cannot pass.
pub(crate) fn patterned_bytes(len: usize) -> Vec<u8> {
    (0..len).map(|index| ((index * 7 + index / 4096) % 251) as u8).collect()
}

pub(crate) fn write_file(directory: &Path, name: &str, contents: &[u8]) -> PathBuf {
    let path = directory.join(name);
    let mut file = File::create(&path).unwrap();
    file.write_all(contents).unwrap();
    file.sync_all().unwrap();
    path
}
