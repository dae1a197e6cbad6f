#!/usr/bin/env bash
# Visit 2, part B (the same machine, right after A): llama.cpp's rows.
R=$OUT
cd "$(dirname "$0")"
./cuda-smoke build 90 > $R/build.txt 2>&1 || { tail -30 $R/build.txt; exit 1; }
eval "$(./cuda-smoke env)"
[ -f /tmp/q36s8.gguf ] || bin/hypura-forge qwen3.6-35b-a3b --router-skew 8 -o /tmp/q36s8.gguf > /dev/null 2>&1
common="HYPURA=bin/hypura SKIP_HYPURA=1 THREADS=16 RUN_TIMEOUT=90"
env $common OUT=$R/s6a PEERS=gpu N_CPU_MOE=26 CONTEXT=1024 HYPURA_ARGS="--gpu-budget 8GiB" \
  scripts/bench-limited /tmp/q36s8.gguf 0.5701 128 1 > $R/s6a.txt 2>&1
env $common OUT=$R/s6b PEERS=n-cpu-moe:17 N_CPU_MOE=17 CONTEXT=1024 HYPURA_ARGS="--gpu-budget 12GiB" \
  scripts/bench-limited /tmp/q36s8.gguf 1.2474 128 1 > $R/s6b.txt 2>&1
env $common OUT=$R/p4096 PEERS=n-cpu-moe:26 N_CPU_MOE=26 CONTEXT=5120 PROMPT_TOKENS=4096 HYPURA_ARGS="--gpu-budget 8GiB" \
  scripts/bench-limited /tmp/q36s8.gguf 0.5701 16 1 > $R/p4096.txt 2>&1
cd $R && tar czf peers.tgz s6a s6b p4096 && rm -rf s6a s6b p4096
