//! Serving llama.cpp's load-time reads (through `hypura_sys::LoadReader`).
//!
//! Resident tensors are read with direct I/O through an aligned bounce buffer, so loading
//! leaves nothing in the page cache. File ranges of streamed tensors are not read at all: their
//! bytes arrive later, on demand. (llama.cpp still copies whatever its stdio buffer held into
//! those tensors; the stream buffer type points them at a sink during the load, the size of the
//! largest of them, whose pages this reader gives back as the load goes, so that the sink never
//! holds more than `SINK_RELEASE_BYTES` of memory.)
use std::ops::Range;
use std::sync::Arc;

use super::stats::IoStats;
use crate::io::{AlignedBuf, DirectFile, Region, PAGE_BYTES};

const BOUNCE_BYTES: usize = 8 << 20;
/// Skipped bytes after which the sink's pages are given back (glibc copies its stdio buffer
/// into the sink after each skipped read; the copies land in pages released in between).
const SINK_RELEASE_BYTES: u64 = 16 << 20;

pub struct StoreLoadReader {
    file: DirectFile,
    /// File ranges of streamed tensors, sorted by start.
    streamed: Vec<Range<u64>>,
    bounce: AlignedBuf,
    /// The file range the bounce buffer currently holds.
    bounce_range: Range<u64>,
    stats: Arc<IoStats>,
    skipped_bytes: u64,
    /// The load-time sink the skipped tensors point at, and the bytes skipped since its pages
    /// were last given back.
    sink: Option<Arc<Region>>,
    skipped_since_release: u64,
}

impl StoreLoadReader {
    pub fn new(
        file: DirectFile,
        mut streamed: Vec<Range<u64>>,
        sink: Option<Arc<Region>>,
        stats: Arc<IoStats>,
    ) -> StoreLoadReader {
        streamed.sort_by_key(|range| range.start);
        StoreLoadReader {
            file,
            streamed,
            bounce: AlignedBuf::new(BOUNCE_BYTES),
            bounce_range: 0..0,
            stats,
            skipped_bytes: 0,
            sink,
            skipped_since_release: 0,
        }
    }

    /// Give the sink's pages back once enough skipped bytes may have been copied into it: no
    /// one reads the sink, so its contents can go at any time.
    fn release_sink(&mut self, skipped: u64) {
        self.skipped_since_release += skipped;
        if self.skipped_since_release < SINK_RELEASE_BYTES {
            return;
        }
        self.skipped_since_release = 0;
        if let Some(sink) = &self.sink {
            if let Err(error) = sink.release(0..sink.len() as u64) {
                tracing::debug!("the load's sink kept its pages: {error}");
            }
        }
    }

    /// The streamed range containing `position`, if any.
    fn streamed_at(&self, position: u64) -> Option<Range<u64>> {
        let index = self.streamed.partition_point(|streamed| streamed.start <= position);
        (index > 0 && self.streamed[index - 1].end > position).then(|| self.streamed[index - 1].clone())
    }

    /// The start of the next streamed range after `position` (or the end of the file).
    fn next_streamed_start(&self, position: u64) -> u64 {
        let index = self.streamed.partition_point(|streamed| streamed.start <= position);
        self.streamed.get(index).map_or(u64::MAX, |streamed| streamed.start)
    }

    fn fill_bounce(&mut self, offset: u64) -> std::io::Result<()> {
        let start = offset / PAGE_BYTES * PAGE_BYTES;
        let started = std::time::Instant::now();
        self.stats.read_started();
        let read = self.file.read_at(self.bounce.as_mut_slice(), start).map_err(|error| {
            self.stats.read_ended();
            std::io::Error::other(error)
        })?;
        self.stats.record_read(read as u64, started.elapsed());
        self.bounce_range = start..start + read as u64;
        if read == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("end of {} at offset {offset}", self.file.path().display()),
            ));
        }
        Ok(())
    }
}

impl hypura_sys::LoadReader for StoreLoadReader {
    fn len(&self) -> u64 {
        self.file.len()
    }

    fn read_at(&mut self, offset: u64, buffer: &mut [u8]) -> std::io::Result<()> {
        let mut filled = 0usize;
        while filled < buffer.len() {
            let position = offset + filled as u64;
            let remaining = (buffer.len() - filled) as u64;
            if let Some(streamed) = self.streamed_at(position) {
                // Not read: these bytes come from disk on demand, into the same pages.
                let count = (streamed.end - position).min(remaining);
                self.skipped_bytes += count;
                self.release_sink(count);
                filled += count as usize;
                continue;
            }
            if !self.bounce_range.contains(&position) {
                self.fill_bounce(position)?;
            }
            let from = (position - self.bounce_range.start) as usize;
            let count = (self.bounce_range.end - position)
                .min(remaining)
                .min(self.next_streamed_start(position) - position) as usize;
            buffer[filled..filled + count].copy_from_slice(&self.bounce.as_slice()[from..from + count]);
            filled += count;
        }
        Ok(())
    }
}

impl Drop for StoreLoadReader {
    fn drop(&mut self) {
        tracing::debug!("load reader skipped {} streamed bytes", self.skipped_bytes);
    }
}
