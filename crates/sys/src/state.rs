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
                let bytes = (u64::from(element_bytes) * u64::from(n_embd))
                    .checked_mul(cell_count)
                    .ok_or_else(|| layout("a value column size overflows"))?;
                columns.push(Columns { type_id, element_bytes, n_embd, at: reader.skip(bytes)? });
            }
            Values::Columns(columns)
        };
        Ok(Section { positions, exts, ext_bytes, header, keys, values, end: reader.at })
    }

    /// The section at `at`, which must end at `end`; the cell ext's size is whichever of the
    /// two the pinned llama.cpp writes makes the section end there.
    fn read_ending_at(file: &File, at: u64, end: u64) -> Result<Section, StateError> {
        let mut first_error = None;
        for ext_bytes in [0, CELL_EXT_BYTES] {
            let error = match Section::read_with(file, at, end, ext_bytes) {
                Ok(section) if section.end == end => return Ok(section),
                Ok(section) => layout(format!(
                    "{} bytes follow the cells' data (a second cache, or recurrent state)",
                    end - section.end
                )),
                Err(error) => error,
            };
            first_error.get_or_insert(error);
        }
        Err(first_error.unwrap_or_else(|| layout("empty")))
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const LAYERS: usize = 2;
    const K_ROW: usize = 6;
    const V_ROW: usize = 4;
    const V_EMBD: usize = 3;

    /// A byte for (layer, cell, byte within the row) of keys or values, so that a misplaced
    /// copy shows.
    fn byte(kind: u8, layer: usize, position: i32, index: usize) -> u8 {
        kind.wrapping_mul(31)
            .wrapping_add((layer * 59) as u8)
            .wrapping_add((position * 7) as u8)
            .wrapping_add(index as u8)
    }

    /// A section in the pinned llama.cpp's layout, for cells at `positions` (in cell order), of
    /// sequence `stream` (the stream of a sequence of its own is its id).
    fn section(positions: &[i32], v_trans: bool, ext: bool, seq_id: i32) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&(positions.len() as u32).to_le_bytes());
        for &position in positions {
            out.extend_from_slice(&position.to_le_bytes());
            out.extend_from_slice(&1u32.to_le_bytes());
            if ext {
                out.extend_from_slice(&[position as u8; CELL_EXT_BYTES as usize]);
            }
            out.extend_from_slice(&seq_id.to_le_bytes());
        }
        for field in [u32::from(v_trans), LAYERS as u32, 0, 0] {
            out.extend_from_slice(&field.to_le_bytes());
        }
        for layer in 0..LAYERS {
            out.extend_from_slice(&1i32.to_le_bytes());
            out.extend_from_slice(&(K_ROW as u64).to_le_bytes());
            for &position in positions {
                out.extend((0..K_ROW).map(|index| byte(1, layer, position, index)));
            }
        }
        for layer in 0..LAYERS {
            out.extend_from_slice(&1i32.to_le_bytes());
            if v_trans {
                out.extend_from_slice(&1u32.to_le_bytes());
                out.extend_from_slice(&(V_EMBD as u32).to_le_bytes());
                for element in 0..V_EMBD {
                    out.extend(positions.iter().map(|&position| byte(2, layer, position, element)));
                }
            } else {
                out.extend_from_slice(&(V_ROW as u64).to_le_bytes());
                for &position in positions {
                    out.extend((0..V_ROW).map(|index| byte(2, layer, position, index)));
                }
            }
        }
        out
    }

    /// A sequence file as `llama_state_seq_save_file` writes it, the cells in stream `stream`
    /// of `n_stream`.
    fn sequence(positions: &[i32], v_trans: bool, ext: bool, stream: u32, n_stream: u32) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&SEQ_MAGIC.to_le_bytes());
        out.extend_from_slice(&SEQ_VERSION.to_le_bytes());
        out.extend_from_slice(&(positions.len() as u32).to_le_bytes());
        for &position in positions {
            out.extend_from_slice(&(1000 + position).to_le_bytes());
        }
        out.extend_from_slice(&n_stream.to_le_bytes());
        for index in 0..n_stream {
            if index == stream {
                out.extend(section(positions, v_trans, ext, stream as i32));
            } else {
                out.extend_from_slice(&0u32.to_le_bytes());
            }
        }
        out
    }

    fn file_with(bytes: &[u8]) -> File {
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(bytes).unwrap();
        file
    }

    /// Cut a sequence into blocks of positions and join them again: the result is the
    /// sequence llama.cpp would have written for those positions in order, whatever order the
    /// cells had, with or without transposed values and cell exts.
    #[test]
    fn blocks_cut_from_a_sequence_join_into_the_sequence_in_position_order() {
        for v_trans in [false, true] {
            for ext in [false, true] {
                // Cells out of position order, as a reused KV cache leaves them.
                let positions = [4, 5, 6, 7, 0, 1, 2, 3];
                let saved = file_with(&sequence(&positions, v_trans, ext, 1, 3));
                let (tokens, section) = read_sequence(&saved).unwrap();
                assert_eq!(tokens, positions.iter().map(|position| 1000 + position).collect::<Vec<_>>());
                assert_eq!(section.positions(), positions);
                let mut blocks = Vec::new();
                for block in [[4, 5], [6, 7]] {
                    let mut bytes = Vec::new();
                    write_section(&mut bytes, &[Part { file: &saved, section: &section, cells: &block }]).unwrap();
                    let file = file_with(&bytes);
                    let section = Section::read(&file, 0, bytes.len() as u64).unwrap();
                    blocks.push((file, section));
                }
                let all = [0, 1];
                let parts: Vec<Part<'_>> =
                    blocks.iter().map(|(file, section)| Part { file, section, cells: &all }).collect();
                let tokens: Vec<Token> = (0..4).map(|position| 1000 + position).collect();
                let mut joined = Vec::new();
                write_sequence(&mut joined, &tokens, 3, &parts).unwrap();
                // llama.cpp reads any stream's cells into the sequence's own stream (and the
                // sequence id written is read and dropped).
                assert_eq!(joined, sequence(&[0, 1, 2, 3], v_trans, ext, 0, 3), "v_trans {v_trans} ext {ext}");
            }
        }
    }

    #[test]
    fn blocks_of_other_layouts_do_not_join() {
        let rows = file_with(&section(&[0, 1], false, false, 0));
        let columns = file_with(&section(&[2, 3], true, false, 0));
        let rows_section = Section::read(&rows, 0, rows.metadata().unwrap().len()).unwrap();
        let columns_section = Section::read(&columns, 0, columns.metadata().unwrap().len()).unwrap();
        let cells = [0, 1];
        let parts = [
            Part { file: &rows, section: &rows_section, cells: &cells },
            Part { file: &columns, section: &columns_section, cells: &cells },
        ];
        assert!(matches!(write_section(&mut Vec::new(), &parts), Err(StateError::Mismatch(_))));
        let beyond = [0, 2];
        let part = [Part { file: &rows, section: &rows_section, cells: &beyond }];
        assert!(matches!(write_section(&mut Vec::new(), &part), Err(StateError::Mismatch(_))));
    }

    /// A second cache after the first (a sliding-window model's) is refused, not misread.
    #[test]
    fn a_state_with_more_than_one_cache_is_refused() {
        let mut bytes = sequence(&[0, 1], false, false, 0, 1);
        bytes.extend(sequence(&[0, 1], false, false, 0, 1)[12 + 8..].iter());
        let error = read_sequence(&file_with(&bytes)).unwrap_err();
        assert!(matches!(error, StateError::Layout(_)), "{error}");
    }

    proptest! {
        /// Truncated or damaged files are errors, never panics or huge allocations.
        #[test]
        fn damaged_files_are_errors(cut in 0usize..400, flips in proptest::collection::vec((0usize..400, any::<u8>()), 0..4)) {
            let mut bytes = sequence(&[0, 1, 2], true, false, 0, 2);
            for (at, value) in flips {
                let at = at % bytes.len();
                bytes[at] ^= value;
            }
            bytes.truncate(cut.min(bytes.len()));
            let file = file_with(&bytes);
            let _ = read_sequence(&file);
            let _ = Section::read(&file, 0, bytes.len() as u64);
        }
    }
}
