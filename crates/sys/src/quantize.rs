//! ggml's own quantize functions, used by the forge to write real quantized tensors.
use llama_cpp_sys_2 as raw;

use crate::error::SysError;

fn checked_type(type_id: u32) -> Result<raw::ggml_type, SysError> {
    if type_id >= raw::GGML_TYPE_COUNT {
        return Err(SysError::Quantize(format!("ggml type id {type_id} is out of range")));
    }
    let ggml_type = type_id as raw::ggml_type;
    // SAFETY: the id is in range; ggml's type traits table has an entry for every id below
    // GGML_TYPE_COUNT (removed types have block size 0, which callers check).
    if unsafe { raw::ggml_blck_size(ggml_type) } <= 0 {
        return Err(SysError::Quantize(format!("ggml type id {type_id} is not a live type")));
    }
    Ok(ggml_type)
}

/// Elements per block of a ggml type, as ggml itself reports it.
pub fn ggml_type_block_size(type_id: u32) -> Result<u64, SysError> {
    let ggml_type = checked_type(type_id)?;
    // SAFETY: the type id was checked above.
    Ok(unsafe { raw::ggml_blck_size(ggml_type) } as u64)
}

/// Bytes per block of a ggml type, as ggml itself reports it.
pub fn ggml_type_size(type_id: u32) -> Result<u64, SysError> {
    let ggml_type = checked_type(type_id)?;
    // SAFETY: the type id was checked above.
    Ok(unsafe { raw::ggml_type_size(ggml_type) } as u64)
}

/// ggml's name of a type ("q4_K", "f16", ...).
pub fn ggml_type_name(type_id: u32) -> Result<String, SysError> {
    let ggml_type = checked_type(type_id)?;
    // SAFETY: the type id was checked; the name is a static string.
    let name = unsafe { std::ffi::CStr::from_ptr(raw::ggml_type_name(ggml_type)) };
    Ok(name.to_string_lossy().into_owned())
}

/// Quantize rows of `n_per_row` f32 values into `type_id`, returning the packed bytes.
/// Types that need an importance matrix are refused, because the forge has none.
pub fn quantize_rows(type_id: u32, source: &[f32], n_per_row: usize) -> Result<Vec<u8>, SysError> {
    let ggml_type = checked_type(type_id)?;
    let block = ggml_type_block_size(type_id)? as usize;
    if n_per_row == 0 || !source.len().is_multiple_of(n_per_row) {
        return Err(SysError::Quantize(format!("{} values do not split into rows of {n_per_row}", source.len())));
    }
    if !n_per_row.is_multiple_of(block) {
        return Err(SysError::Quantize(format!(
            "row length {n_per_row} is not a multiple of the block size {block} of {}",
            ggml_type_name(type_id)?
        )));
    }
    // SAFETY: the type id was checked above.
    if unsafe { raw::ggml_quantize_requires_imatrix(ggml_type) } {
        return Err(SysError::Quantize(format!("{} needs an importance matrix", ggml_type_name(type_id)?)));
    }
    let rows = source.len() / n_per_row;
    // SAFETY: the type id was checked above.
    let row_bytes = unsafe { raw::ggml_row_size(ggml_type, n_per_row as i64) };
    let mut destination = vec![0u8; row_bytes * rows];
    // SAFETY: ggml_quantize_init is idempotent and thread-safe (it takes ggml's critical
    // section). ggml_quantize_chunk reads rows × n_per_row floats from `source` (checked above)
    // and writes rows × row_bytes into `destination` (sized above); the imatrix is null, which
    // the type allows (checked above).
    let written = unsafe {
        raw::ggml_quantize_init(ggml_type);
        raw::ggml_quantize_chunk(
            ggml_type,
            source.as_ptr(),
            destination.as_mut_ptr().cast(),
            0,
            rows as i64,
            n_per_row as i64,
            std::ptr::null(),
        )
    };
    if written != destination.len() {
        return Err(SysError::Quantize(format!("ggml wrote {written} bytes, expected {}", destination.len())));
    }
    Ok(destination)
}

/// Unpack rows of `n_per_row` values of `type_id` into f32, with ggml's own `to_float` (f32
/// itself, which has none, is copied).
pub fn dequantize_rows(type_id: u32, source: &[u8], n_per_row: usize) -> Result<Vec<f32>, SysError> {
    let ggml_type = checked_type(type_id)?;
    let block = ggml_type_block_size(type_id)? as usize;
    if n_per_row == 0 || !n_per_row.is_multiple_of(block) {
        return Err(SysError::Quantize(format!(
            "row length {n_per_row} is not a multiple of the block size {block} of {}",
            ggml_type_name(type_id)?
        )));
    }
    // SAFETY: the type id was checked above.
    let row_bytes = unsafe { raw::ggml_row_size(ggml_type, n_per_row as i64) };
    if !source.len().is_multiple_of(row_bytes) {
        return Err(SysError::Quantize(format!("{} bytes do not split into rows of {row_bytes} bytes", source.len())));
    }
    if ggml_type == raw::GGML_TYPE_F32 {
        return Ok(source
            .chunks_exact(4)
            .map(|bytes| f32::from_le_bytes(bytes.try_into().expect("chunks of 4")))
            .collect());
    }
    // SAFETY: the type id was checked above; the traits table is static.
    let to_float = unsafe { (*raw::ggml_get_type_traits(ggml_type)).to_float };
    let Some(to_float) = to_float else {
        return Err(SysError::Quantize(format!("ggml cannot unpack {}", ggml_type_name(type_id)?)));
    };
    let rows = source.len() / row_bytes;
    let mut destination = vec![0f32; rows * n_per_row];
    // SAFETY: `source` holds rows × row_bytes bytes, which is whole blocks of rows × n_per_row
    // values (checked above), and `destination` has room for rows × n_per_row floats.
    unsafe { to_float(source.as_ptr().cast(), destination.as_mut_ptr(), (rows * n_per_row) as i64) };
    Ok(destination)
}
