//! Loading a model through a reader that Hypura controls, instead of llama.cpp's own file I/O.
//!
//! llama.cpp's mmap load populates the whole file (MAP_POPULATE), and its read load fills every
//! host tensor, streamed ones included. Handing llama.cpp a stdio stream whose reads we serve
//! (glibc `fopencookie`) lets Hypura read resident tensors with its own direct I/O and skip the
//! disk for the bytes of streamed tensors, so loading reads only the non-streamed bytes.
//!
//! glibc serves every fread of a cookie stream through the stream's own buffer, so the reader
//! sees file positions, not destinations: it recognises streamed tensors by position and leaves
//! those buffer bytes unread. llama.cpp then copies them into the tensor's memory, which the
//! stream buffer type points at a small sink until the load is done.
use std::ffi::{c_char, c_int, c_void};

/// Serves the bytes llama.cpp asks for.
#[allow(clippy::len_without_is_empty)] // a model file is never empty, and nothing asks
pub trait LoadReader: Send {
    /// File length in bytes.
    fn len(&self) -> u64;
    /// Fill `buffer` with the file's bytes at `offset`, except bytes of streamed tensors,
    /// which may be left as they are (their destination is refilled on demand later).
    fn read_at(&mut self, offset: u64, buffer: &mut [u8]) -> std::io::Result<()>;
}

#[repr(C)]
struct CookieIoFunctions {
    read: Option<unsafe extern "C" fn(*mut c_void, *mut c_char, usize) -> isize>,
    write: Option<unsafe extern "C" fn(*mut c_void, *const c_char, usize) -> isize>,
    seek: Option<unsafe extern "C" fn(*mut c_void, *mut i64, c_int) -> c_int>,
    close: Option<unsafe extern "C" fn(*mut c_void) -> c_int>,
}

extern "C" {
    fn fopencookie(cookie: *mut c_void, mode: *const c_char, functions: CookieIoFunctions) -> *mut libc::FILE;
    fn setvbuf(stream: *mut libc::FILE, buffer: *mut c_char, mode: c_int, size: usize) -> c_int;
}

const STDIO_BUFFER_BYTES: usize = 1 << 20;

pub(crate) struct Cookie {
    reader: Box<dyn LoadReader>,
    position: u64,
    /// The first error, reported after the load fails.
    pub(crate) error: Option<std::io::Error>,
}

unsafe extern "C" fn cookie_read(cookie: *mut c_void, buffer: *mut c_char, size: usize) -> isize {
    // SAFETY: `cookie` is the Box<Cookie> that `open_stream` registered and that outlives the
    // stream; stdio calls us from the loading thread only. `buffer` is writable for `size`.
    let (cookie, buffer) =
        unsafe { (&mut *(cookie as *mut Cookie), std::slice::from_raw_parts_mut(buffer as *mut u8, size)) };
    let available = cookie.reader.len().saturating_sub(cookie.position);
    let count = (size as u64).min(available) as usize;
    if count == 0 {
        return 0;
    }
    match cookie.reader.read_at(cookie.position, &mut buffer[..count]) {
        Ok(()) => {
            cookie.position += count as u64;
            count as isize
        }
        Err(error) => {
            cookie.error.get_or_insert(error);
            -1
        }
    }
}

unsafe extern "C" fn cookie_seek(cookie: *mut c_void, offset: *mut i64, whence: c_int) -> c_int {
    // SAFETY: as in cookie_read; `offset` points to a valid i64 that stdio owns.
    let (cookie, offset) = unsafe { (&mut *(cookie as *mut Cookie), &mut *offset) };
    let base = match whence {
        libc::SEEK_SET => 0,
        libc::SEEK_CUR => cookie.position as i64,
        libc::SEEK_END => cookie.reader.len() as i64,
        _ => return -1,
    };
    let Some(target) = base.checked_add(*offset).filter(|&target| target >= 0) else {
        return -1;
    };
    cookie.position = target as u64;
    *offset = target;
    0
}

unsafe extern "C" fn cookie_close(_cookie: *mut c_void) -> c_int {
    0 // the Box<Cookie> is owned and dropped by Rust
}

/// A fully buffered stdio stream over `cookie`: glibc reads through its buffer in
/// `STDIO_BUFFER_BYTES` pieces, so the header's many tiny reads cost no system calls.
pub(crate) fn open_stream(cookie: &mut Box<Cookie>) -> Option<*mut libc::FILE> {
    let functions =
        CookieIoFunctions { read: Some(cookie_read), write: None, seek: Some(cookie_seek), close: Some(cookie_close) };
    let pointer = &mut **cookie as *mut Cookie as *mut c_void;
    // SAFETY: the mode string is NUL-terminated; the cookie outlives the stream (the caller
    // closes the stream before dropping it).
    let stream = unsafe { fopencookie(pointer, c"rb".as_ptr(), functions) };
    if stream.is_null() {
        return None;
    }
    // SAFETY: called before any I/O on the stream, as setvbuf requires; a null buffer makes
    // glibc allocate (and later free) its own.
    unsafe { setvbuf(stream, std::ptr::null_mut(), libc::_IOFBF, STDIO_BUFFER_BYTES) };
    Some(stream)
}

pub(crate) fn new_cookie(reader: Box<dyn LoadReader>) -> Box<Cookie> {
    Box::new(Cookie { reader, position: 0, error: None })
}
