#!/usr/bin/env bash
# Part 4: S4 at tg128: moe-30b (16.9 GiB), GPU 8 GiB, cgroup 6.75 GiB; Hypura's default, whole
# layers, llama.cpp --fit and -ot exps=CPU.
R=$OUT
cd "$(dirname "$0")"
./cuda-smoke build 90 || exit 1
eval "$(./cuda-smoke env)"
rm -f /tmp/q36s8.gguf
[ -f /tmp/moe30b.gguf ] || bin/hypura-forge moe-30b -o /tmp/moe30b.gguf > /dev/null 2>&1
bin/hypura inspect /tmp/moe30b.gguf --gpu-budget 8GiB --context 1024 --memory-budget 6GiB > $R/s4-inspect.txt 2>&1
OUT=$R/s4 HYPURA=bin/hypura PEERS=gpu SKIP_REFERENCE=1 THREADS=16 CONTEXT=1024 RUN_TIMEOUT=90 \
  HYPURA_ARGS="--gpu-budget 8GiB" HYPURA_B_ARGS="--gpu-experts layers" scripts/bench-limited /tmp/moe30b.gguf 0.3994 128 1 > $R/s4.txt 2>&1
cd $R && tar czf s4.tgz s4 && rm -rf s4
