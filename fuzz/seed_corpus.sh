#!/bin/sh
# Seeds fuzz/corpus/gguf_parse with small valid files from the writer and the committed
# malformed-input corpus. Run from the workspace root.
set -e
mkdir -p fuzz/corpus/gguf_parse
cp crates/gguf/tests/corpus/*.bin fuzz/corpus/gguf_parse/
HYPURA_FUZZ_SEED_DIR="$PWD/fuzz/corpus/gguf_parse" cargo test --release -p hypura-gguf --test roundtrip write_fuzz_seeds
