//! Arbitrary bytes into the GGUF parser: it must return Ok or a typed error, never panic,
//! hang, or allocate far beyond the input size.
#![no_main]

use hypura_gguf::Gguf;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(gguf) = Gguf::parse(data, data.len() as u64) {
        // Whatever parses must describe tensors that lie inside the input.
        for tensor in &gguf.tensors {
            let end = gguf.data_offset + tensor.offset + tensor.bytes;
            assert!(end <= data.len() as u64);
            assert_eq!(gguf.tensor(&tensor.name), Some(tensor));
        }
        assert!(gguf.data_offset <= data.len() as u64);
    }
});
