//! Temporary files: named uniquely per process, locked (`flock`) while they live, and swept at
//! start when no live process holds them.
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

static TEMPORARY_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A name no other process or call uses: `<dir>/.tmp-<what>-<pid>-<n>`.
fn temporary_path(dir: &Path, what: &str) -> PathBuf {
    let n = TEMPORARY_COUNTER.fetch_add(1, Ordering::Relaxed);
    dir.join(format!("{TEMPORARY_PREFIX}{what}-{}-{n}", std::process::id()))
}

const TEMPORARY_PREFIX: &str = ".tmp-";

/// A temporary file of this process's, locked (`flock`) for as long as it lives and removed
/// when dropped, unless `persist` renamed it into place. The lock tells a start that a live
/// process is writing the file; the kernel drops it with the process, however it ends.
#[derive(Debug)]
pub(super) struct Temporary {
    pub(super) path: PathBuf,
    pub(super) file: File,
}

impl Temporary {
    pub(super) fn create(dir: &Path, what: &str) -> std::io::Result<Temporary> {
        use std::os::unix::fs::MetadataExt;
        loop {
            let path = temporary_path(dir, what);
            let file = File::options().read(true).write(true).create_new(true).open(&path)?;
            file.lock()?;
            // A start's sweep may have taken the file between its creation and the lock: then
            // the name is gone (or another file's), and a new name is tried.
            let (ours, named) = (file.metadata()?, std::fs::metadata(&path));
            if named.is_ok_and(|named| named.ino() == ours.ino() && named.dev() == ours.dev()) {
                return Ok(Temporary { path, file });
            }
        }
    }

    /// Rename the file to `path`; it is no longer removed when dropped.
    pub(super) fn persist(mut self, path: &Path) -> std::io::Result<()> {
        std::fs::rename(&self.path, path)?;
        // The name is gone: nothing is left to remove, and the lock goes with the file.
        self.path = PathBuf::new();
        Ok(())
    }
}

impl Drop for Temporary {
    fn drop(&mut self) {
        if !self.path.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Remove the temporary files in `root` that no live process holds, and say so.
pub(super) fn sweep(root: &Path) {
    let removed = remove_stale_temporaries(root);
    if removed > 0 {
        tracing::info!("prompt cache: {removed} temporary file(s) that no running process writes removed");
    }
}

/// Remove the temporary files in `root` that no live process holds (see `Temporary`); returns
/// how many.
fn remove_stale_temporaries(root: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(root) else { return 0 };
    let mut removed = 0;
    for entry in entries.flatten() {
        if !entry.file_name().to_string_lossy().starts_with(TEMPORARY_PREFIX) {
            continue;
        }
        let Ok(file) = File::open(entry.path()) else { continue };
        // Held: its writer lives. Taken: nobody writes it, and holding the lock while removing
        // it keeps a writer that just created the name from believing it still has it.
        if file.try_lock().is_ok() && std::fs::remove_file(entry.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}
