#!/usr/bin/env bash
# Part 3: S6a time to first token, 4,096 and 16,384 tokens: Hypura's default, llama.cpp --fit
# and --n-cpu-moe 26.
R=$OUT
cd "$(dirname "$0")"
./cuda-smoke build 90 || exit 1
eval "$(./cuda-smoke env)"
[ -f /tmp/q36s8.gguf ] || bin/hypura-forge qwen3.6-35b-a3b --router-skew 8 -o /tmp/q36s8.gguf > /dev/null 2>&1
for n in 4096 16384; do
  ctx=$((n + 1024))
  OUT=$R/p$n HYPURA=bin/hypura PEERS=fit SKIP_REFERENCE=1 THREADS=16 CONTEXT=$ctx PROMPT_TOKENS=$n RUN_TIMEOUT=100 \
    HYPURA_ARGS="--gpu-budget 8GiB" scripts/bench-limited /tmp/q36s8.gguf 0.5701 16 1 > $R/p$n.txt 2>&1
  OUT=$R/p$n HYPURA=bin/hypura PEERS=n-cpu-moe:26 N_CPU_MOE=26 SKIP_HYPURA=1 THREADS=16 CONTEXT=$ctx PROMPT_TOKENS=$n RUN_TIMEOUT=100 \
    HYPURA_ARGS="--gpu-budget 8GiB" scripts/bench-limited /tmp/q36s8.gguf 0.5701 16 1 >> $R/p$n.txt 2>&1
done
cd $R && tar czf prompts.tgz p4096 p16384 && rm -rf p4096 p16384
