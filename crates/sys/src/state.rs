//! The layout of a sequence's saved KV cache, as the pinned llama.cpp writes it
//! (`llama_state_seq_save_file`, then `llama_kv_cache::state_write`), so that a saved sequence
//! can be cut into blocks of positions and blocks joined into a sequence again.
//!
//! Only a plain KV cache is read: one section of cells (a position each) and, per layer, the
//! keys' rows and the values' rows (or, transposed, one run of cells per value element). A
//! sliding-window cache writes a second section and a recurrent one other state, so their files
//! are refused as "not a plain KV cache", never misread. Every offset is checked against the
//! file's length before it is read.
//!
//! A section in the file:
//!
//! ```text
//! cell_count u32
//! per cell:  pos i32, n_seq_id u32 (1), [cell ext, 12 bytes, for M-RoPE models], seq_id i32
//! v_trans u32, n_layer u32, n_rot_k u32, n_rot_v u32
//! per layer: k_type i32, k_row u64, cell_count rows of k_row bytes
//! v_trans 0, per layer: v_type i32, v_row u64, cell_count rows of v_row bytes
//! v_trans 1, per layer: v_type i32, v_element u32, n_embd_v u32, per element cell_count × v_element bytes
//! ```
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;

use crate::Token;

/// `LLAMA_STATE_SEQ_MAGIC` ('ggsq') and `LLAMA_STATE_SEQ_VERSION` of the pinned llama.cpp.
const SEQ_MAGIC: u32 = 0x6767_7371;
const SEQ_VERSION: u32 = 4;
/// `llama_kv_cell_ext` (two positions and a token), written per cell by models that need it.
const CELL_EXT_BYTES: u64 = 12;
/// Copies between files go through a buffer of this size.
const COPY_BYTES: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("not a saved sequence of a plain KV cache: {0}")]
    Layout(String),
    #[error("the blocks do not join: {0}")]
    Mismatch(String),
}

fn layout(reason: impl Into<String>) -> StateError {
    StateError::Layout(reason.into())
}

/// One layer's keys, or values that are not transposed: a row per cell.
#[derive(Clone, Debug, PartialEq)]
struct Rows {
    type_id: i32,
    row_bytes: u64,
    /// Offset of cell 0's row.
    at: u64,
}

/// One layer's transposed values: per element of the value vector, a run of cells.
#[derive(Clone, Debug, PartialEq)]
struct Columns {
    type_id: i32,
    element_bytes: u32,
    n_embd: u32,
    at: u64,
}

#[derive(Clone, Debug)]
enum Values {
    Rows(Vec<Rows>),
    Columns(Vec<Columns>),
}

/// The cells of one saved sequence and where each layer's data for them lies in its file.
#[derive(Clone, Debug)]
pub struct Section {
    /// Each cell's position, in the file's order.
    positions: Vec<i32>,
    /// Each cell's ext bytes (`ext_bytes` per cell), in the file's order.
    exts: Vec<u8>,
    ext_bytes: u64,
    /// v_trans, n_layer, n_rot_k, n_rot_v.
    header: [u32; 4],
    keys: Vec<Rows>,
    values: Values,
    /// Offset just past the section.
    end: u64,
}

/// Reads at offsets of one file, each checked against its length.
struct At<'a> {
    file: &'a File,
    at: u64,
    len: u64,
}

impl At<'_> {
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N], StateError> {
        let mut buffer = [0u8; N];
        if self.at + N as u64 > self.len {
            return Err(layout(format!("the file ends at byte {} inside a field at {}", self.len, self.at)));
        }
        self.file.read_exact_at(&mut buffer, self.at)?;
        self.at += N as u64;
        Ok(buffer)
    }

    fn u32(&mut self) -> Result<u32, StateError> {
        self.bytes::<4>().map(u32::from_le_bytes)
    }

    fn i32(&mut self) -> Result<i32, StateError> {
        self.bytes::<4>().map(i32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, StateError> {
        self.bytes::<8>().map(u64::from_le_bytes)
    }

    fn skip(&mut self, bytes: u64) -> Result<u64, StateError> {
        let start = self.at;
        let end = start.checked_add(bytes).filter(|&end| end <= self.len);
        self.at = end.ok_or_else(|| layout(format!("{bytes} bytes at {start} run past the end ({})", self.len)))?;
        Ok(start)
    }
}

impl Section {
    /// The section that starts at `at` of `file` (its first field is the cell count), for
    /// cells whose ext is `ext_bytes` long.
    fn read_with(file: &File, at: u64, len: u64, ext_bytes: u64) -> Result<Section, StateError> {
        let mut reader = At { file, at, len };
        let cell_count = u64::from(reader.u32()?);
        // Each cell takes at least 12 bytes of metadata: a count beyond the file is no count.
        if cell_count * (12 + ext_bytes) > len {
            return Err(layout(format!("{cell_count} cells do not fit in {len} bytes")));
        }
        let mut positions = Vec::with_capacity(cell_count as usize);
        let mut exts = Vec::with_capacity((cell_count * ext_bytes) as usize);
        for _ in 0..cell_count {
            positions.push(reader.i32()?);
            let n_seq_id = reader.u32()?;
            if n_seq_id != 1 {
                return Err(layout(format!("a cell belongs to {n_seq_id} sequences, not one")));
            }
            let start = reader.skip(ext_bytes)?;
            let mut ext = vec![0u8; ext_bytes as usize];
            file.read_exact_at(&mut ext, start)?;
            exts.extend_from_slice(&ext);
            reader.i32()?;
        }
        let header = [reader.u32()?, reader.u32()?, reader.u32()?, reader.u32()?];
        let [v_trans, n_layer, ..] = header;
        if v_trans > 1 || u64::from(n_layer) > len / 12 {
            return Err(layout(format!("v_trans {v_trans} and {n_layer} layers are not a KV cache's")));
        }
        let mut keys = Vec::with_capacity(n_layer as usize);
        for _ in 0..n_layer {
            let type_id = reader.i32()?;
            let row_bytes = reader.u64()?;
            let at =
                reader.skip(row_bytes.checked_mul(cell_count).ok_or_else(|| layout("a key row size overflows"))?)?;
            keys.push(Rows { type_id, row_bytes, at });
        }
        let values = if v_trans == 0 {
            let mut rows = Vec::with_capacity(n_layer as usize);
            for _ in 0..n_layer {
                let type_id = reader.i32()?;
                let row_bytes = reader.u64()?;
                let bytes = row_bytes.checked_mul(cell_count).ok_or_else(|| layout("a value row size overflows"))?;
                rows.push(Rows { type_id, row_bytes, at: reader.skip(bytes)? });
            }
            Values::Rows(rows)
        } else {
            let mut columns = Vec::with_capacity(n_layer as usize);
            for _ in 0..n_layer {
                let type_id = reader.i32()?;
                let element_bytes = reader.u32()?;
                let n_embd = reader.u32()?;
                let bytes = u64::from(element_bytes) * u64::from(n_embd) * cell_count;
                columns.push(Columns { type_id, element_bytes, n_embd, at: reader.skip(bytes)? });
            }
            Values::Columns(columns)
        };
        Ok(Section { positions, exts, ext_bytes, header, keys, values, end: reader.at })
    }

    /// The section at `at`, which must end at `end`; the cell ext's size is whichever of the
    /// two the pinned llama.cpp writes makes the section end there.
    fn read_ending_at(file: &File, at: u64, end: u64) -> Result<Section, StateError> {
        let mut last = None;
        for ext_bytes in [0, CELL_EXT_BYTES] {
            match Section::read_with(file, at, end, ext_bytes) {
                Ok(section) if section.end == end => return Ok(section),
                Ok(section) => {
                    last = Some(layout(format!("{} bytes follow the cells' data", end - section.end)));
                }
                Err(error) => last = Some(error),
            }
        }
        Err(last.unwrap_or_else(|| layout("empty")))
    }

    /// The section from `at` to `end` of `file` (a block file's).
    pub fn read(file: &File, at: u64, end: u64) -> Result<Section, StateError> {
        Section::read_ending_at(file, at, end)
    }

    pub fn positions(&self) -> &[i32] {
        &self.positions
    }

    pub fn len(&self) -> usize {
        self.positions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }

    /// Whether cells of the two sections can share one section: the same layers, types and
    /// row sizes.
    fn joins(&self, other: &Section) -> bool {
        let strip = |rows: &[Rows]| rows.iter().map(|row| (row.type_id, row.row_bytes)).collect::<Vec<_>>();
        let values_match = match (&self.values, &other.values) {
            (Values::Rows(a), Values::Rows(b)) => strip(a) == strip(b),
            (Values::Columns(a), Values::Columns(b)) => {
                a.iter()
                    .zip(b)
                    .all(|(a, b)| (a.type_id, a.element_bytes, a.n_embd) == (b.type_id, b.element_bytes, b.n_embd))
                    && a.len() == b.len()
            }
            _ => false,
        };
        self.header == other.header
            && self.ext_bytes == other.ext_bytes
            && strip(&self.keys) == strip(&other.keys)
            && values_match
    }
}

/// A saved sequence file (`Context::save_sequence`): its tokens and its one section of cells.
pub fn read_sequence(file: &File) -> Result<(Vec<Token>, Section), StateError> {
    let len = file.metadata()?.len();
    let mut reader = At { file, at: 0, len };
    let (magic, version) = (reader.u32()?, reader.u32()?);
    if (magic, version) != (SEQ_MAGIC, SEQ_VERSION) {
        return Err(layout(format!("magic {magic:08x} version {version}, not a sequence state of this build")));
    }
    let n_tokens = u64::from(reader.u32()?);
    let start = reader.skip(n_tokens * 4)?;
    let mut raw = vec![0u8; (n_tokens * 4) as usize];
    file.read_exact_at(&mut raw, start)?;
    let tokens = raw.chunks_exact(4).map(|bytes| i32::from_le_bytes(bytes.try_into().unwrap())).collect();
    let n_stream = reader.u32()?;
    if u64::from(n_stream) > len / 4 {
        return Err(layout(format!("{n_stream} streams")));
    }
    let mut found: Option<Section> = None;
    for stream in 0..n_stream {
        let cells_at = reader.at;
        if reader.u32()? == 0 {
            continue;
        }
        if found.is_some() {
            return Err(layout("one sequence's cells are in two streams"));
        }
        // Each stream after this one is a cell count of zero, four bytes.
        let trailing = u64::from(n_stream - stream - 1) * 4;
        let end = len.checked_sub(trailing).ok_or_else(|| layout("the streams run past the end"))?;
        let section = Section::read_ending_at(file, cells_at, end)?;
        reader.at = section.end;
        found = Some(section);
    }
    if reader.at != len {
        return Err(layout(format!("{} bytes after the streams", len - reader.at)));
    }
    let section = found.ok_or_else(|| layout("the sequence holds no cells"))?;
    Ok((tokens, section))
}

/// Cells `cells` (indices into `section`, in the order they are written) of a section in `file`.
pub struct Part<'a> {
    pub file: &'a File,
    pub section: &'a Section,
    pub cells: &'a [usize],
}

/// Runs of consecutive indices: (first, count).
fn runs(cells: &[usize]) -> Vec<(usize, usize)> {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for &cell in cells {
        match runs.last_mut() {
            Some((first, count)) if *first + *count == cell => *count += 1,
            _ => runs.push((cell, 1)),
        }
    }
    runs
}

fn copy(
    out: &mut impl Write,
    file: &File,
    mut at: u64,
    mut bytes: u64,
    buffer: &mut Vec<u8>,
) -> Result<(), StateError> {
    while bytes > 0 {
        let chunk = bytes.min(COPY_BYTES as u64) as usize;
        buffer.resize(chunk, 0);
        file.read_exact_at(&mut buffer[..chunk], at)?;
        out.write_all(&buffer[..chunk])?;
        at += chunk as u64;
        bytes -= chunk as u64;
    }
    Ok(())
}

/// Write one section holding the chosen cells of every part, in order, as the pinned llama.cpp
/// lays a section out. The parts must come from sections that join (the same model and cache
/// types). Returns the bytes written.
pub fn write_section(out: &mut impl Write, parts: &[Part<'_>]) -> Result<u64, StateError> {
    let Some(first) = parts.first() else { return Err(StateError::Mismatch("no cells".into())) };
    if let Some(part) = parts.iter().find(|part| !part.section.joins(first.section)) {
        return Err(StateError::Mismatch(format!(
            "a block of {} cells has other layers or types than the first",
            part.section.len()
        )));
    }
    if let Some(&bad) =
        parts.iter().flat_map(|part| part.cells.iter().filter(|&&cell| cell >= part.section.len())).next()
    {
        return Err(StateError::Mismatch(format!("cell {bad} is not in its section")));
    }
    let mut out = Counted { inner: out, bytes: 0 };
    let cell_count: usize = parts.iter().map(|part| part.cells.len()).sum();
    out.write_all(&(cell_count as u32).to_le_bytes())?;
    for part in parts {
        let ext_bytes = part.section.ext_bytes as usize;
        for &cell in part.cells {
            out.write_all(&part.section.positions[cell].to_le_bytes())?;
            out.write_all(&1u32.to_le_bytes())?;
            out.write_all(&part.section.exts[cell * ext_bytes..(cell + 1) * ext_bytes])?;
            out.write_all(&0i32.to_le_bytes())?;
        }
    }
    for field in first.section.header {
        out.write_all(&field.to_le_bytes())?;
    }
    let runs: Vec<Vec<(usize, usize)>> = parts.iter().map(|part| runs(part.cells)).collect();
    let mut buffer = Vec::new();
    let mut write_rows = |out: &mut Counted<_>, pick: &dyn Fn(&Section) -> &Rows| {
        let head = pick(first.section);
        out.write_all(&head.type_id.to_le_bytes())?;
        out.write_all(&head.row_bytes.to_le_bytes())?;
        for (part, runs) in parts.iter().zip(&runs) {
            let rows = pick(part.section);
            for &(cell, count) in runs {
                copy(
                    out,
                    part.file,
                    rows.at + cell as u64 * rows.row_bytes,
                    count as u64 * rows.row_bytes,
                    &mut buffer,
                )?;
            }
        }
        Ok::<(), StateError>(())
    };
    for layer in 0..first.section.keys.len() {
        write_rows(&mut out, &|section: &Section| &section.keys[layer])?;
    }
    match &first.section.values {
        Values::Rows(rows) => {
            for layer in 0..rows.len() {
                write_rows(&mut out, &|section: &Section| match &section.values {
                    Values::Rows(rows) => &rows[layer],
                    Values::Columns(_) => unreachable!("sections that join have the same value layout"),
                })?;
            }
        }
        Values::Columns(columns) => {
            for (layer, head) in columns.iter().enumerate() {
                out.write_all(&head.type_id.to_le_bytes())?;
                out.write_all(&head.element_bytes.to_le_bytes())?;
                out.write_all(&head.n_embd.to_le_bytes())?;
                let element = u64::from(head.element_bytes);
                for row in 0..u64::from(head.n_embd) {
                    for (part, runs) in parts.iter().zip(&runs) {
                        let Values::Columns(columns) = &part.section.values else {
                            unreachable!("sections that join have the same value layout")
                        };
                        let n_cells = part.section.len() as u64;
                        for &(cell, count) in runs {
                            let at = columns[layer].at + (row * n_cells + cell as u64) * element;
                            copy(&mut out, part.file, at, count as u64 * element, &mut buffer)?;
                        }
                    }
                }
            }
        }
    }
    Ok(out.bytes)
}

/// A saved sequence file that `Context::load_sequence` reads: `tokens` and one section of the
/// parts' cells, for a context of `n_stream` streams.
pub fn write_sequence(
    out: &mut impl Write,
    tokens: &[Token],
    n_stream: u32,
    parts: &[Part<'_>],
) -> Result<u64, StateError> {
    let mut head = Vec::with_capacity(16 + tokens.len() * 4);
    head.extend_from_slice(&SEQ_MAGIC.to_le_bytes());
    head.extend_from_slice(&SEQ_VERSION.to_le_bytes());
    head.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
    for token in tokens {
        head.extend_from_slice(&token.to_le_bytes());
    }
    head.extend_from_slice(&n_stream.max(1).to_le_bytes());
    out.write_all(&head)?;
    let mut bytes = head.len() as u64 + write_section(out, parts)?;
    for _ in 1..n_stream.max(1) {
        out.write_all(&0u32.to_le_bytes())?;
        bytes += 4;
    }
    Ok(bytes)
}

struct Counted<'a, W: Write> {
    inner: &'a mut W,
    bytes: u64,
}

impl<W: Write> Write for Counted<'_, W> {
    fn write(&mut self, buffer: &[u8]) -> std::io::Result<usize> {
        let written = self.inner.write(buffer)?;
        self.bytes += written as u64;
        Ok(written)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}
