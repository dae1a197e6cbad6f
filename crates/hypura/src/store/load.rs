//! Serving llama.cpp's load-time reads (through `hypura_sys::LoadReader`).
//!
//! Resident tensors are read with direct I/O through an aligned bounce buffer, so loading
//! leaves nothing in the page cache. Reads whose destination is a streamed tensor's place in
//! the region are skipped: those bytes arrive later, on demand. A destination inside the region
//! that is not exactly a streamed tensor's mirror position is refused, so a placement mistake
//! fails the load instead of computing on wrong weights.
use std::ops::Range;
use std::sync::Arc;

use super::io::{AlignedBuf, DirectFile, Region, PAGE_BYTES};
use super::stats::IoStats;

const BOUNCE_BYTES: usize = 8 << 20;

pub struct StoreLoadReader {
    file: DirectFile,
    region: Option<Arc<Region>>,
    /// File ranges of streamed tensors, sorted by start.
    streamed: Vec<Range<u64>>,
    bounce: AlignedBuf,
    /// The file range the bounce buffer currently holds.
    bounce_range: Range<u64>,
    stats: Arc<IoStats>,
    skipped_bytes: u64,
}

impl StoreLoadReader {
    pub fn new(file: DirectFile, region: Option<Arc<Region>>, mut streamed: Vec<Range<u64>>, stats: Arc<IoStats>) -> StoreLoadReader {
        streamed.sort_by_key(|range| range.start);
        StoreLoadReader { file, region, streamed, bounce: AlignedBuf::new(BOUNCE_BYTES), bounce_range: 0..0, stats, skipped_bytes: 0 }
    }

    fn is_streamed(&self, range: &Range<u64>) -> bool {
        let index = self.streamed.partition_point(|streamed| streamed.start <= range.start);
        index > 0 && self.streamed[index - 1].end >= range.end
    }

    fn fill_bounce(&mut self, offset: u64) -> std::io::Result<()> {
        let start = offset / PAGE_BYTES * PAGE_BYTES;
        let started = std::time::Instant::now();
        let read = self.file.read_at(self.bounce.as_mut_slice(), start).map_err(std::io::Error::other)?;
        self.stats.record_read(read as u64, started.elapsed());
        self.bounce_range = start..start + read as u64;
        if read == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, format!("end of {} at offset {offset}", self.file.path().display())));
        }
        Ok(())
    }
}

impl hypura_sys::LoadReader for StoreLoadReader {
    fn len(&self) -> u64 {
        self.file.len()
    }

    fn read_at(&mut self, offset: u64, buffer: &mut [u8]) -> std::io::Result<()> {
        let range = offset..offset + buffer.len() as u64;
        if let Some(region) = &self.region {
            let address = buffer.as_ptr() as usize;
            if region.contains(address, buffer.len()) {
                if address == region.address() + offset as usize && self.is_streamed(&range) {
                    self.skipped_bytes += buffer.len() as u64;
                    return Ok(());
                }
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("llama.cpp asked for file bytes {range:?} into the stream region at an address that is not their mirror"),
                ));
            }
        }
        let mut filled = 0usize;
        while filled < buffer.len() {
            let position = offset + filled as u64;
            if !self.bounce_range.contains(&position) {
                self.fill_bounce(position)?;
            }
            let from = (position - self.bounce_range.start) as usize;
            let count = (self.bounce_range.end - position).min((buffer.len() - filled) as u64) as usize;
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
