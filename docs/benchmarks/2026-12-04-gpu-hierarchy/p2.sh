#!/usr/bin/env bash
# Part 2: S6a decode, every row in one visit: Hypura's default (auto: the pool here), whole
# layers, llama.cpp --fit, -ot exps=CPU, --n-cpu-moe 26 (Hypura's own 14 GPU layers).
R=$OUT
cd "$(dirname "$0")"
./cuda-smoke build 90 || exit 1
eval "$(./cuda-smoke env)"
[ -f /tmp/q36s8.gguf ] || bin/hypura-forge qwen3.6-35b-a3b --router-skew 8 -o /tmp/q36s8.gguf > /dev/null 2>&1
bin/hypura inspect /tmp/q36s8.gguf --gpu-budget 8GiB --context 1024 --memory-budget 10GiB > $R/s6a-inspect.txt 2>&1
OUT=$R/s6a HYPURA=bin/hypura PEERS=gpu N_CPU_MOE=26 SKIP_REFERENCE=1 THREADS=16 CONTEXT=1024 RUN_TIMEOUT=90 \
  HYPURA_ARGS="--gpu-budget 8GiB" HYPURA_B_ARGS="--gpu-experts layers" scripts/bench-limited /tmp/q36s8.gguf 0.5701 128 1 > $R/s6a.txt 2>&1
cd $R && tar czf s6a.tgz s6a && rm -rf s6a
