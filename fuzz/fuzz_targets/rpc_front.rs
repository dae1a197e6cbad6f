//! The RPC front's command parser and checks: any byte stream as a client's side of a
//! connection. No input may panic them, leave memory counted after the connection, or let a
//! client's buffers exceed what is lent (`replay` asserts both).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|stream: &[u8]| {
    hypura::remote::protocol::replay(stream, 1 << 20);
});
