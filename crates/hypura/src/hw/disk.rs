//! Disk bandwidth: how fast the volume holding the model delivers bytes, read the way the
//! streaming store reads them (`O_DIRECT`, aligned blocks, N reader threads as the queue depth).
//!
//! Every measurement starts from an evicted page cache, so a figure is the device's and never
//! memory's. The probe either reads an existing large file read-only (the model file itself, so
//! its own volume is measured) or writes, measures and deletes a scratch file.

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Barrier;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::mountinfo::{parse_mountinfo, split_device_number};
use super::HwError;
use crate::io::{evict_file, evict_from_page_cache, AlignedBuf, DirectFile, IoError, ReadPath};

const MIB: u64 = 1 << 20;

/// The store's reader threads at most (`setup`'s default): the sustained point reads as it does.
pub const STORE_READERS: u32 = 4;

/// Direct reads must be multiples of this; see `io::DEFAULT_ALIGNMENT_BYTES`.
const ALIGNMENT_BYTES: u64 = crate::io::DEFAULT_ALIGNMENT_BYTES as u64;

/// Disk results, all in bytes and seconds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DiskProfile {
    /// The file that was read, or the directory a scratch file was written in.
    pub probe_path: PathBuf,
    /// Block device and mount point, e.g. "/dev/nvme0n1p2 at /".
    pub volume: String,
    pub filesystem: String,
    /// Whether reads really bypassed the page cache; if not, `direct` holds buffered reads of an
    /// evicted file.
    pub direct_supported: bool,
    /// Sequential reads for every block size × queue depth.
    pub direct: Vec<ReadPoint>,
    /// Random 1 MiB direct reads at the queue depth that was fastest for 1 MiB blocks.
    pub random_1mib: ReadPoint,
    /// Sequential 4 MiB reads through the page cache, starting from an evicted file.
    pub buffered_bytes_per_sec: f64,
    /// The fastest of `direct`.
    pub best_direct: ReadPoint,
    /// Size of the file that was read.
    #[serde(default)]
    pub file_bytes: u64,
    /// True when a scratch file was written (and deleted) rather than an existing file read.
    #[serde(default)]
    pub scratch_file: bool,
    /// Streaming's own pattern held for a long run: reads of the store's chunk size at the
    /// best queue depth, over the whole file, pass after pass from an evicted page cache (a
    /// short burst's rate is not what a token's worth of reads sustains). Absent in profiles
    /// made before it was measured.
    #[serde(default)]
    pub sustained: Option<ReadPoint>,
}

impl DiskProfile {
    /// The rate streaming can count on: the sustained one where it was measured, else the best
    /// short burst.
    pub fn streaming_bytes_per_sec(&self) -> f64 {
        self.sustained.as_ref().map_or(self.best_direct.bytes_per_sec, |point| point.bytes_per_sec)
    }
}

/// One timed read pattern.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReadPoint {
    pub block_bytes: u64,
    /// Reader threads, each with one read in flight.
    pub queue_depth: u32,
    pub bytes_per_sec: f64,
    pub bytes_read: u64,
    pub seconds: f64,
}

/// How much to read. [`DiskOptions::default`] keeps a profile under a minute on a 1-2 GB/s disk
/// (about 5.5 GiB read plus a 1 GiB scratch write); [`DiskOptions::quick`] is for tests.
#[derive(Clone, Debug, PartialEq)]
pub struct DiskOptions {
    /// An existing file at least this large is read in place; smaller probes get a scratch file.
    pub min_file_bytes: u64,
    /// Size of the scratch file written when the probe is a directory or a small file.
    pub scratch_bytes: u64,
    /// Bytes read per sequential point (capped by the file size).
    pub bytes_per_point: u64,
    /// Sequential block sizes; each a multiple of 4096.
    pub block_sizes_bytes: Vec<u64>,
    /// Queue depths, i.e. reader thread counts.
    pub queue_depths: Vec<u32>,
    pub random_block_bytes: u64,
    /// Bytes read by the random-read point.
    pub random_bytes: u64,
    pub buffered_block_bytes: u64,
    /// Bytes read by the buffered point.
    pub buffered_bytes: u64,
    /// Seed for scratch contents and random offsets, so runs are repeatable.
    pub seed: u64,
    /// Bytes read by the sustained point (passes over the file until this much is read).
    pub sustained_bytes: u64,
}

impl Default for DiskOptions {
    fn default() -> DiskOptions {
        DiskOptions {
            min_file_bytes: 512 * MIB,
            scratch_bytes: 1024 * MIB,
            bytes_per_point: 512 * MIB,
            block_sizes_bytes: vec![MIB, 4 * MIB, 16 * MIB],
            queue_depths: vec![1, 4, 16],
            random_block_bytes: MIB,
            random_bytes: 256 * MIB,
            buffered_block_bytes: 4 * MIB,
            buffered_bytes: 512 * MIB,
            seed: 0x4879_7075_7261, // "Hypura"
            sustained_bytes: 4096 * MIB,
        }
    }
}

impl DiskOptions {
    /// A few MiB per point: checks the machinery, not the disk.
    pub fn quick() -> DiskOptions {
        DiskOptions {
            min_file_bytes: 512 * MIB,
            scratch_bytes: 16 * MIB,
            bytes_per_point: 4 * MIB,
            block_sizes_bytes: vec![64 * 1024, 256 * 1024, MIB],
            queue_depths: vec![1, 2, 4],
            random_block_bytes: MIB,
            random_bytes: 4 * MIB,
            buffered_block_bytes: MIB,
            buffered_bytes: 4 * MIB,
            sustained_bytes: 8 * MIB,
            ..DiskOptions::default()
        }
    }
}

/// The block device a path lives on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Volume {
    /// The mount source, e.g. "/dev/nvme0n1p2"; "major:minor" when mountinfo has no match.
    pub device: String,
    pub mount_point: PathBuf,
    pub filesystem: String,
}

/// Find the mount holding `path` by matching its `st_dev` against /proc/self/mountinfo.
pub fn volume_of(path: &Path) -> Result<Volume, HwError> {
    let metadata = fs::metadata(path).map_err(|source| HwError::file("inspect", path, source))?;
    let (major, minor) = split_device_number(metadata.dev());
    let mountinfo = fs::read_to_string("/proc/self/mountinfo")
        .map_err(|source| HwError::file("read", "/proc/self/mountinfo", source))?;
    let canonical = fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    // Bind mounts list one device several times; the mount point that is the longest prefix of
    // the path is the one the path was reached through.
    let best = parse_mountinfo(&mountinfo)
        .into_iter()
        .filter(|mount| (mount.major, mount.minor) == (major, minor))
        .max_by_key(|mount| {
            let is_prefix = canonical.starts_with(&mount.mount_point);
            (is_prefix, mount.mount_point.as_os_str().len())
        });
    Ok(match best {
        Some(mount) => Volume { device: mount.source, mount_point: mount.mount_point, filesystem: mount.filesystem },
        None => Volume {
            device: format!("{major}:{minor}"),
            mount_point: PathBuf::from("/"),
            filesystem: "unknown".to_string(),
        },
    })
}

/// Measure read bandwidth of the volume at `probe`.
///
/// A regular file of at least `options.min_file_bytes` is read in place, read-only. Otherwise a
/// scratch file of `options.scratch_bytes` is written in `probe` (or, for a small file, its
/// directory), measured and deleted, also on error or panic. `progress(done, total)` is called
/// with bytes written and read so far, from this thread only.
pub fn measure_disk(probe: &Path, options: &DiskOptions, progress: &dyn Fn(u64, u64)) -> Result<DiskProfile, HwError> {
    validate(probe, options)?;
    let metadata = fs::metadata(probe).map_err(|source| HwError::file("inspect", probe, source))?;
    let read_in_place = metadata.is_file() && metadata.len() >= options.min_file_bytes;
    let scratch_directory = match (read_in_place, metadata.is_dir()) {
        (true, _) => None,
        (false, true) => Some(probe.to_path_buf()),
        (false, false) => Some(match probe.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
            _ => PathBuf::from("."),
        }),
    };
    let file_bytes = if read_in_place { metadata.len() } else { options.scratch_bytes };
    let direct_bytes = file_bytes / ALIGNMENT_BYTES * ALIGNMENT_BYTES;

    // Plan every point before touching the disk, so a file too small fails before any writing.
    let mut sequential_plans = Vec::new();
    for &block_bytes in &options.block_sizes_bytes {
        for &queue_depth in &options.queue_depths {
            let region_bytes = options.bytes_per_point.min(direct_bytes);
            let blocks_per_thread = region_bytes / (block_bytes * u64::from(queue_depth));
            if blocks_per_thread == 0 {
                return Err(too_small(probe, file_bytes, block_bytes, queue_depth));
            }
            sequential_plans.push((block_bytes, queue_depth, blocks_per_thread));
        }
    }
    if direct_bytes < options.random_block_bytes {
        return Err(too_small(probe, file_bytes, options.random_block_bytes, 1));
    }
    let buffered_blocks = options.buffered_bytes.min(file_bytes) / options.buffered_block_bytes;
    if buffered_blocks == 0 {
        return Err(too_small(probe, file_bytes, options.buffered_block_bytes, 1));
    }
    // The random point's exact size depends on the queue depth chosen later; progress counts
    // its planned size so that it still ends exactly at 100%.
    let random_progress_bytes = options.random_bytes;
    let sequential_total: u64 =
        sequential_plans.iter().map(|&(block, depth, per_thread)| block * u64::from(depth) * per_thread).sum();
    // The sustained point: the store's chunks, whole passes over the file.
    let chunk_bytes =
        crate::plan::READ_CHUNK_BYTES.min(direct_bytes / ALIGNMENT_BYTES * ALIGNMENT_BYTES).max(ALIGNMENT_BYTES);
    let chunks_per_pass = direct_bytes / chunk_bytes;
    let sustained_passes = options.sustained_bytes.div_ceil((chunks_per_pass * chunk_bytes).max(1)).max(1);
    let sustained_total = sustained_passes * chunks_per_pass * chunk_bytes;
    let total_bytes = if read_in_place { 0 } else { file_bytes }
        + sequential_total
        + random_progress_bytes
        + buffered_blocks * options.buffered_block_bytes
        + sustained_total;
    let mut done_bytes = 0u64;
    progress(done_bytes, total_bytes);

    // Declared before any file is opened so it is dropped (and deletes the file) last.
    let scratch = match &scratch_directory {
        Some(directory) => {
            let scratch = ScratchFile::create(directory, file_bytes, options.seed, &mut |written| {
                progress(done_bytes + written, total_bytes);
            })?;
            done_bytes += file_bytes;
            Some(scratch)
        }
        None => None,
    };
    let target: &Path = match &scratch {
        Some(scratch) => &scratch.path,
        None => probe,
    };

    let file = DirectFile::open(target)?;
    let mut direct = Vec::with_capacity(sequential_plans.len());
    for &(block_bytes, queue_depth, blocks_per_thread) in &sequential_plans {
        evict_from_page_cache(target)?;
        let point = time_parallel_reads(
            &file,
            block_bytes,
            queue_depth,
            |thread_index, read_index| (u64::from(thread_index) * blocks_per_thread + read_index) * block_bytes,
            blocks_per_thread,
        )?;
        done_bytes += point.bytes_read;
        progress(done_bytes, total_bytes);
        direct.push(point);
    }
    let best_direct = fastest(&direct).clone();

    // Random reads at the queue depth that served this block size best sequentially.
    let random_queue_depth = fastest_matching(&direct, options.random_block_bytes)
        .map_or(best_direct.queue_depth, |point| point.queue_depth);
    let random_reads_per_thread =
        (options.random_bytes / (options.random_block_bytes * u64::from(random_queue_depth))).max(1);
    let random_slots = (direct_bytes - options.random_block_bytes) / ALIGNMENT_BYTES + 1;
    evict_from_page_cache(target)?;
    let random_1mib = time_parallel_reads(
        &file,
        options.random_block_bytes,
        random_queue_depth,
        |thread_index, read_index| {
            let mut generator = SplitMix64::new(options.seed ^ (u64::from(thread_index) << 32) ^ read_index);
            generator.next_u64() % random_slots * ALIGNMENT_BYTES
        },
        random_reads_per_thread,
    )?;
    done_bytes += random_progress_bytes;
    progress(done_bytes, total_bytes);

    evict_from_page_cache(target)?;
    let buffered = DirectFile::open_buffered(target)?;
    let mut buffer = AlignedBuf::new(options.buffered_block_bytes as usize);
    let start = Instant::now();
    for block_index in 0..buffered_blocks {
        buffered.read_exact_at(buffer.as_mut_slice(), block_index * options.buffered_block_bytes)?;
    }
    let buffered_seconds = seconds_since(start);
    let buffered_bytes = buffered_blocks * options.buffered_block_bytes;
    done_bytes += buffered_bytes;
    progress(done_bytes, total_bytes);
    // Streaming's pattern, held: each pass over the file from an evicted page cache, the
    // chunks dealt round-robin to as many threads as the store reads with (the best queue
    // depth, at most its four readers).
    let depth = best_direct.queue_depth.clamp(1, STORE_READERS);
    let per_thread = chunks_per_pass.div_ceil(u64::from(depth));
    let mut sustained_read = 0u64;
    let mut sustained_seconds = 0.0;
    for _ in 0..sustained_passes {
        evict_from_page_cache(target)?;
        let point = time_parallel_reads(
            &file,
            chunk_bytes,
            depth,
            |thread_index, read_index| {
                (read_index * u64::from(depth) + u64::from(thread_index)) % chunks_per_pass.max(1) * chunk_bytes
            },
            per_thread,
        )?;
        sustained_read += point.bytes_read;
        sustained_seconds += point.seconds;
        done_bytes += point.bytes_read.min(chunks_per_pass * chunk_bytes);
        progress(done_bytes.min(total_bytes), total_bytes);
    }
    let sustained = ReadPoint {
        block_bytes: chunk_bytes,
        queue_depth: depth,
        bytes_per_sec: sustained_read as f64 / sustained_seconds.max(1e-9),
        bytes_read: sustained_read,
        seconds: sustained_seconds,
    };
    progress(total_bytes, total_bytes);
    // Leave the page cache as we found it rather than full of probe data.
    evict_from_page_cache(target)?;

    let volume = volume_of(target)?;
    Ok(DiskProfile {
        probe_path: scratch_directory.unwrap_or_else(|| probe.to_path_buf()),
        volume: format!("{} at {}", volume.device, volume.mount_point.display()),
        filesystem: volume.filesystem,
        // Checked after the reads: a run-time EINVAL may have moved the file to buffered.
        direct_supported: file.read_path() == ReadPath::Direct,
        direct,
        random_1mib,
        buffered_bytes_per_sec: buffered_bytes as f64 / buffered_seconds,
        best_direct,
        file_bytes,
        scratch_file: scratch.is_some(),
        sustained: Some(sustained),
    })
}

fn validate(probe: &Path, options: &DiskOptions) -> Result<(), HwError> {
    let invalid = |reason: String| Err(HwError::Probe { path: probe.to_path_buf(), reason });
    if options.block_sizes_bytes.is_empty() || options.queue_depths.is_empty() {
        return invalid("options need at least one block size and one queue depth".to_string());
    }
    for &block in options.block_sizes_bytes.iter().chain([&options.random_block_bytes]) {
        if block == 0 || block % ALIGNMENT_BYTES != 0 {
            return invalid(format!("block size {block} is not a positive multiple of {ALIGNMENT_BYTES}"));
        }
    }
    if options.buffered_block_bytes == 0 {
        return invalid("buffered block size is 0".to_string());
    }
    if options.queue_depths.contains(&0) {
        return invalid("queue depth 0".to_string());
    }
    Ok(())
}

fn too_small(probe: &Path, file_bytes: u64, block_bytes: u64, queue_depth: u32) -> HwError {
    HwError::Probe {
        path: probe.to_path_buf(),
        reason: format!(
            "{} is too small for {} blocks at queue depth {queue_depth}",
            crate::format::format_bytes(file_bytes),
            crate::format::format_bytes(block_bytes),
        ),
    }
}

/// Run `queue_depth` threads, each reading `reads_per_thread` blocks at `offset(thread, read)`,
/// and time them from a common start (the barrier) to the last one finishing.
fn time_parallel_reads(
    file: &DirectFile,
    block_bytes: u64,
    queue_depth: u32,
    offset: impl Fn(u32, u64) -> u64 + Sync,
    reads_per_thread: u64,
) -> Result<ReadPoint, HwError> {
    let barrier = Barrier::new(queue_depth as usize + 1);
    let (bytes_read, seconds) = std::thread::scope(|scope| {
        let readers: Vec<_> = (0..queue_depth)
            .map(|thread_index| {
                let (barrier, offset) = (&barrier, &offset);
                scope.spawn(move || -> Result<u64, IoError> {
                    // Allocate before the barrier so the timing covers reads only.
                    let mut buffer = AlignedBuf::new(block_bytes as usize);
                    barrier.wait();
                    for read_index in 0..reads_per_thread {
                        file.read_exact_at(buffer.as_mut_slice(), offset(thread_index, read_index))?;
                    }
                    Ok(reads_per_thread * block_bytes)
                })
            })
            .collect();
        barrier.wait();
        let start = Instant::now();
        let mut bytes_read = 0u64;
        let mut first_error = None;
        for reader in readers {
            match reader.join() {
                Ok(Ok(bytes)) => bytes_read += bytes,
                Ok(Err(error)) => first_error = first_error.or(Some(error)),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        let seconds = seconds_since(start);
        match first_error {
            Some(error) => Err(error),
            None => Ok((bytes_read, seconds)),
        }
    })?;
    Ok(ReadPoint { block_bytes, queue_depth, bytes_per_sec: bytes_read as f64 / seconds, bytes_read, seconds })
}

fn seconds_since(start: Instant) -> f64 {
    // A zero duration would make the rate infinite; a nanosecond is below any real read.
    start.elapsed().as_secs_f64().max(1e-9)
}

fn fastest(points: &[ReadPoint]) -> &ReadPoint {
    points
        .iter()
        .max_by(|left, right| left.bytes_per_sec.total_cmp(&right.bytes_per_sec))
        .expect("validate() guarantees at least one point")
}

fn fastest_matching(points: &[ReadPoint], block_bytes: u64) -> Option<&ReadPoint> {
    points
        .iter()
        .filter(|point| point.block_bytes == block_bytes)
        .max_by(|left, right| left.bytes_per_sec.total_cmp(&right.bytes_per_sec))
}

/// A probe file this process wrote; deleted on drop, so an error or panic cannot leave a
/// gigabyte behind.
struct ScratchFile {
    path: PathBuf,
}

impl ScratchFile {
    /// How much is written before flushing and evicting, so the scratch file never holds more
    /// than this much dirty page cache (which a tight cgroup would be charged for).
    const FLUSH_EVERY_BYTES: u64 = 256 * MIB;
    const CHUNK_BYTES: u64 = 16 * MIB;

    fn create(
        directory: &Path,
        len_bytes: u64,
        seed: u64,
        progress: &mut dyn FnMut(u64),
    ) -> Result<ScratchFile, HwError> {
        let unique = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|elapsed| elapsed.as_nanos())
            .unwrap_or(0);
        let path = directory.join(format!(".hypura-disk-probe-{}-{unique}.tmp", std::process::id()));
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|source| HwError::file("create scratch file", &path, source))?;
        // From here on the guard owns the path.
        let scratch = ScratchFile { path };
        let write_error = |source| HwError::file("write scratch file", &scratch.path, source);
        // Pseudo-random contents, so neither compression nor sparse-file tricks shrink the reads.
        let mut generator = SplitMix64::new(seed);
        let mut chunk = vec![0u8; ScratchFile::CHUNK_BYTES as usize];
        let mut written = 0u64;
        let mut next_flush_bytes = ScratchFile::FLUSH_EVERY_BYTES;
        while written < len_bytes {
            let chunk_bytes = (len_bytes - written).min(ScratchFile::CHUNK_BYTES) as usize;
            for word in chunk[..chunk_bytes].chunks_mut(8) {
                let bytes = generator.next_u64().to_le_bytes();
                word.copy_from_slice(&bytes[..word.len()]);
            }
            file.write_all(&chunk[..chunk_bytes]).map_err(write_error)?;
            written += chunk_bytes as u64;
            if written >= next_flush_bytes || written == len_bytes {
                next_flush_bytes += ScratchFile::FLUSH_EVERY_BYTES;
                // fadvise(DONTNEED) skips dirty pages, so flush before evicting.
                file.sync_data().map_err(write_error)?;
                evict_file(&file)?;
            }
            progress(written);
        }
        file.sync_all().map_err(write_error)?;
        Ok(scratch)
    }
}

impl Drop for ScratchFile {
    fn drop(&mut self) {
        if let Err(error) = fs::remove_file(&self.path) {
            tracing::warn!(path = %self.path.display(), %error, "could not delete the disk probe's scratch file");
        }
    }
}

/// SplitMix64: a tiny, well-mixed generator; enough for scratch contents and random offsets.
struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    fn new(seed: u64) -> SplitMix64 {
        SplitMix64 { state: seed }
    }

    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut value = self.state;
        value = (value ^ (value >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        value = (value ^ (value >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        value ^ (value >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::panic::{catch_unwind, AssertUnwindSafe};

    /// A directory on the build disk (inside the ignored target directory), because /tmp may be
    /// tmpfs and the point is to read a real device.
    fn disk_test_directory() -> tempfile::TempDir {
        let executable = std::env::current_exe().expect("test binary path");
        tempfile::Builder::new()
            .prefix(".hypura-hw-test-")
            .tempdir_in(executable.parent().expect("test binary directory"))
            .expect("create a test directory on the build disk")
    }

    fn directory_entries(directory: &Path) -> Vec<PathBuf> {
        fs::read_dir(directory).unwrap().map(|entry| entry.unwrap().path()).collect()
    }

    fn assert_points_complete(profile: &DiskProfile, options: &DiskOptions) {
        assert_eq!(profile.direct.len(), options.block_sizes_bytes.len() * options.queue_depths.len());
        // The sustained point: the store's chunk (capped by the file), whole passes, at least
        // the bytes asked for, at the best queue depth; planning uses it.
        let sustained = profile.sustained.as_ref().expect("a sustained point");
        assert_eq!(sustained.block_bytes, crate::plan::READ_CHUNK_BYTES.min(profile.file_bytes / 4096 * 4096));
        assert_eq!(sustained.queue_depth, profile.best_direct.queue_depth);
        assert!(
            sustained.bytes_read >= options.sustained_bytes
                && sustained.bytes_read.is_multiple_of(sustained.block_bytes),
            "{sustained:?}"
        );
        assert!(sustained.bytes_per_sec > 0.0 && sustained.bytes_per_sec.is_finite());
        assert_eq!(profile.streaming_bytes_per_sec(), sustained.bytes_per_sec);
        for point in &profile.direct {
            // quick(): every block × depth divides bytes_per_point exactly.
            assert_eq!(point.bytes_read, options.bytes_per_point, "{point:?}");
            assert!(point.bytes_per_sec > 0.0 && point.bytes_per_sec.is_finite(), "{point:?}");
            assert!(point.seconds > 0.0);
        }
        let pairs: Vec<(u64, u32)> =
            profile.direct.iter().map(|point| (point.block_bytes, point.queue_depth)).collect();
        for &block in &options.block_sizes_bytes {
            for &depth in &options.queue_depths {
                assert!(pairs.contains(&(block, depth)), "missing {block} x {depth}");
            }
        }
        assert_eq!(profile.random_1mib.block_bytes, options.random_block_bytes);
        assert_eq!(profile.random_1mib.bytes_read, options.random_bytes);
        assert!(profile.random_1mib.bytes_per_sec > 0.0);
        assert!(profile.buffered_bytes_per_sec > 0.0 && profile.buffered_bytes_per_sec.is_finite());
        let fastest = profile.direct.iter().map(|point| point.bytes_per_sec).fold(0.0, f64::max);
        assert_eq!(profile.best_direct.bytes_per_sec, fastest);
        assert!(!profile.volume.is_empty() && !profile.filesystem.is_empty());
    }

    #[test]
    fn quick_scratch_measurement_reads_everything_and_deletes_the_scratch_file() {
        let directory = disk_test_directory();
        let options = DiskOptions::quick();
        let calls = std::cell::RefCell::new(Vec::new());
        let profile =
            measure_disk(directory.path(), &options, &|done, total| calls.borrow_mut().push((done, total))).unwrap();
        eprintln!("{profile:#?}");
        assert_points_complete(&profile, &options);
        assert!(profile.scratch_file);
        assert_eq!(profile.file_bytes, options.scratch_bytes);
        assert_eq!(profile.probe_path, directory.path());
        assert!(profile.direct_supported, "the build disk should support O_DIRECT");
        assert!(directory_entries(directory.path()).is_empty(), "scratch file left behind");
        let calls = calls.into_inner();
        let (done, total) = *calls.last().unwrap();
        assert_eq!(done, total, "progress ends at 100%");
        assert!(calls.windows(2).all(|pair| pair[0].0 <= pair[1].0), "progress never goes back");
    }

    #[test]
    fn large_enough_file_is_read_in_place_and_left_untouched() {
        let directory = disk_test_directory();
        let path = directory.path().join("model.gguf");
        let mut generator = SplitMix64::new(7);
        // 64 MiB plus an odd tail, like a real model file.
        let contents: Vec<u8> = (0..(64 * MIB as usize + 1234)).map(|_| generator.next_u64() as u8).collect();
        fs::write(&path, &contents).unwrap();
        let before = fs::metadata(&path).unwrap();

        let options = DiskOptions { min_file_bytes: 64 * MIB, ..DiskOptions::quick() };
        let profile = measure_disk(&path, &options, &|_, _| {}).unwrap();
        assert_points_complete(&profile, &options);
        assert!(!profile.scratch_file);
        assert_eq!(profile.probe_path, path);
        assert_eq!(profile.file_bytes, contents.len() as u64);

        let after = fs::metadata(&path).unwrap();
        assert_eq!(after.len(), before.len());
        assert_eq!(after.modified().unwrap(), before.modified().unwrap());
        assert_eq!(after.ino(), before.ino());
        assert!(fs::read(&path).unwrap() == contents, "probe file contents changed");
        assert_eq!(directory_entries(directory.path()), vec![path], "no scratch file may be created");
    }

    #[test]
    fn small_file_probe_measures_a_scratch_file_in_its_directory() {
        let directory = disk_test_directory();
        let path = directory.path().join("small.bin");
        fs::write(&path, b"tiny").unwrap();
        let options = DiskOptions::quick();
        let profile = measure_disk(&path, &options, &|_, _| {}).unwrap();
        assert!(profile.scratch_file);
        assert_eq!(profile.probe_path, directory.path());
        assert_eq!(fs::read(&path).unwrap(), b"tiny");
        assert_eq!(directory_entries(directory.path()), vec![path]);
    }

    #[test]
    fn scratch_file_is_deleted_when_measurement_panics() {
        let directory = disk_test_directory();
        let options = DiskOptions::quick();
        let result = catch_unwind(AssertUnwindSafe(|| {
            measure_disk(directory.path(), &options, &|done, _| {
                // The first call with progress is after the first chunk reached the scratch file.
                if done > 0 {
                    assert!(!directory_entries(directory.path()).is_empty(), "scratch file should exist now");
                    panic!("interrupted");
                }
            })
        }));
        assert!(result.is_err());
        assert!(directory_entries(directory.path()).is_empty(), "scratch file left behind after panic");
    }

    #[test]
    fn too_small_scratch_and_bad_options_fail_before_writing() {
        let directory = disk_test_directory();
        let options = DiskOptions { scratch_bytes: MIB, ..DiskOptions::quick() };
        // 1 MiB cannot hold a 1 MiB block for each of 4 threads.
        assert!(matches!(measure_disk(directory.path(), &options, &|_, _| {}), Err(HwError::Probe { .. })));
        let unaligned = DiskOptions { block_sizes_bytes: vec![1000], ..DiskOptions::quick() };
        assert!(matches!(measure_disk(directory.path(), &unaligned, &|_, _| {}), Err(HwError::Probe { .. })));
        assert!(directory_entries(directory.path()).is_empty());
        let missing = directory.path().join("missing");
        assert!(matches!(measure_disk(&missing, &DiskOptions::quick(), &|_, _| {}), Err(HwError::File { .. })));
    }

    #[test]
    fn volume_of_the_root_is_found() {
        let volume = volume_of(Path::new("/")).unwrap();
        assert_eq!(volume.mount_point, PathBuf::from("/"));
        assert_ne!(volume.filesystem, "unknown");
    }

    #[test]
    fn default_options_fit_the_scratch_file() {
        // Every default point must be plannable on the default 1 GiB scratch file.
        let options = DiskOptions::default();
        for &block in &options.block_sizes_bytes {
            for &depth in &options.queue_depths {
                assert!(options.bytes_per_point.min(options.scratch_bytes) / (block * u64::from(depth)) >= 1);
            }
        }
    }
}
