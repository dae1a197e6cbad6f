#!/usr/bin/env bash
# One point of the forge's routing calibration: forge PRESET narrow (256 wide, the preset's
# layers, experts and top-k) with FORGE_ARGS, decode 128 tokens greedily after each of four
# prompts with the router traced, and print the three statistics of what was decoded.
#
#   calibrate.sh NAME PRESET "FORGE_ARGS"      (HYPURA_BIN: the directory of hypura and hypura-forge)
set -u
bin=${HYPURA_BIN:-target/release}
name=$1; preset=$2; args=$3
narrow="--n-embd 256 --n-ff 64 --n-head 4 --n-head-kv 2 --head-dim 64"
[ -f "$name.gguf" ] || "$bin/hypura-forge" "$preset" -o "$name.gguf" $narrow $args > /dev/null || exit 1
i=0
for prompt in "Explain how a hash map works." "Write a poem about the sea." "def fibonacci(n):" "La recette de la soupe"; do
  i=$((i + 1))
  "$bin/hypura" run -m "$name.gguf" --mode expert-stream --trace "$name.$i.jsonl" --temperature 0 -n 128 --raw \
    -p "$prompt" > "$name.$i.txt" 2>/dev/null
done
echo "$name [$args]: $("$bin/hypura" simulate --model "$name.gguf" "$name".[1-4].jsonl --capacity 1 | grep routing)"
