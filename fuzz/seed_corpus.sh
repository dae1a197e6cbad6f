#!/bin/sh
# Seeds fuzz/corpus/gguf_parse with small valid files from the writer and the committed
# malformed-input corpus. Run from the workspace root.
set -e
mkdir -p fuzz/corpus/gguf_parse
cp crates/gguf/tests/corpus/*.bin fuzz/corpus/gguf_parse/
HYPURA_FUZZ_SEED_DIR="$PWD/fuzz/corpus/gguf_parse" cargo test --release -p hypura-gguf --test roundtrip write_fuzz_seeds
# The RPC front's seeds (a well-behaved connection and the hostile requests its tests send) and
# the server's request bodies.
mkdir -p fuzz/corpus/rpc_front
HYPURA_FUZZ_SEED_DIR="$PWD/fuzz/corpus/rpc_front" cargo test --release -p hypura --lib the_fuzz_seeds_replay_as_they_should
python3 fuzz/seed_server_bodies.py
