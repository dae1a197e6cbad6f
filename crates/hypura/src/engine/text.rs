//! Streaming text: joining token bytes into valid UTF-8, and holding back text that may be the
//! start of a stop string.

/// Joins token pieces into UTF-8 text. A multi-byte character split across tokens is held until
/// it is complete; bytes that can never become valid UTF-8 come out as U+FFFD.
#[derive(Default, Debug)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// Add a token's bytes; return the text that is now complete.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(text) => {
                    out.push_str(text);
                    self.pending.clear();
                    return out;
                }
                Err(error) => {
                    let valid = error.valid_up_to();
                    // SAFETY-free: from_utf8 guarantees the prefix is valid.
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).unwrap_or_default());
                    match error.error_len() {
                        // Incomplete sequence at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// Whatever is left at the end of generation.
    pub fn finish(&mut self) -> String {
        let rest = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        rest
    }
}

/// Finds stop strings in streamed text. Text that could still turn into a stop string is held
/// back, so a client never sees part of a stop string.
#[derive(Debug)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

/// What `StopMatcher::push` decided.
#[derive(Debug, PartialEq, Eq)]
pub enum StopScan {
    /// Emit this text and go on.
    Continue(String),
    /// Emit this text (everything before the stop string) and stop.
    Stopped(String),
}

impl StopMatcher {
    pub fn new(stops: &[String]) -> StopMatcher {
        StopMatcher { stops: stops.iter().filter(|stop| !stop.is_empty()).cloned().collect(), held: String::new() }
    }

    pub fn push(&mut self, text: &str) -> StopScan {
        self.held.push_str(text);
        if let Some(position) = self.stops.iter().filter_map(|stop| self.held.find(stop.as_str())).min() {
            let before = self.held[..position].to_string();
            self.held.clear();
            return StopScan::Stopped(before);
        }
        // Keep the longest tail that is a proper prefix of some stop string.
        let keep = self
            .stops
            .iter()
            .map(|stop| {
                (1..stop.len().min(self.held.len() + 1))
                    .rev()
                    .filter(|&length| {
                        stop.is_char_boundary(length) && self.held.is_char_boundary(self.held.len() - length)
                    })
                    .find(|&length| self.held.ends_with(&stop[..length]))
                    .unwrap_or(0)
            })
            .max()
            .unwrap_or(0);
        let emit_to = self.held.len() - keep;
        let emitted = self.held[..emit_to].to_string();
        self.held.drain(..emit_to);
        StopScan::Continue(emitted)
    }

    /// Text still held at the end (no stop string completed).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_split_across_tokens_is_joined() {
        let mut stream = Utf8Stream::default();
        let bytes = "é€😀".as_bytes();
        let mut out = String::new();
        for byte in bytes {
            out.push_str(&stream.push(&[*byte]));
        }
        out.push_str(&stream.finish());
        assert_eq!(out, "é€😀");
        assert_eq!(stream.push(&bytes[..1]), "");
        assert_eq!(stream.push(&bytes[1..]), "é€😀");
    }

    #[test]
    fn invalid_bytes_become_replacement_characters() {
        let mut stream = Utf8Stream::default();
        assert_eq!(stream.push(&[b'a', 0xFF, b'b']), "a\u{FFFD}b");
        assert_eq!(stream.push(&[0xE2, 0x82]), "");
        assert_eq!(stream.finish(), "\u{FFFD}");
    }

    #[test]
    fn stop_strings_are_held_back_and_cut() {
        let mut matcher = StopMatcher::new(&["</s>".to_string(), "STOP".to_string()]);
        assert_eq!(matcher.push("Hello <"), StopScan::Continue("Hello ".into()));
        assert_eq!(matcher.push("/"), StopScan::Continue(String::new()));
        assert_eq!(matcher.push("x"), StopScan::Continue("</x".into()));
        assert_eq!(matcher.push(" ST"), StopScan::Continue(" ".into()));
        assert_eq!(matcher.push("OP and more"), StopScan::Stopped(String::new()));
    }

    #[test]
    fn stop_inside_one_piece_cuts_there() {
        let mut matcher = StopMatcher::new(&["\n\n".to_string()]);
        assert_eq!(matcher.push("line one\n\nline two"), StopScan::Stopped("line one".into()));
        let mut matcher = StopMatcher::new(&[]);
        assert_eq!(matcher.push("anything\n"), StopScan::Continue("anything\n".into()));
        assert_eq!(matcher.finish(), "");
    }

    #[test]
    fn held_text_is_returned_at_the_end() {
        let mut matcher = StopMatcher::new(&["<end>".to_string()]);
        assert_eq!(matcher.push("abc<en"), StopScan::Continue("abc".into()));
        assert_eq!(matcher.finish(), "<en");
    }
}
