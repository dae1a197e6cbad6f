#!/usr/bin/env bash
# Part 6: the host cache's warm fill beside the pool: S6a (Hypura's default) and S6b (the pool).
R=$OUT
cd "$(dirname "$0")"
./cuda-smoke build 90 || exit 1
eval "$(./cuda-smoke env)"
bin/hypura-forge qwen3.6-35b-a3b --router-skew 8 -o /tmp/q36s8.gguf > /dev/null 2>&1
OUT=$R/s6a-warm HYPURA=bin/hypura PEERS=0 SKIP_REFERENCE=1 THREADS=16 CONTEXT=1024 RUN_TIMEOUT=70 \
  HYPURA_ARGS="--gpu-budget 8GiB" scripts/bench-limited /tmp/q36s8.gguf 0.5701 128 1 > $R/s6a-warm.txt 2>&1
tar czf $R/s6a-warm.tgz -C $R s6a-warm
OUT=$R/s6b-warm HYPURA=bin/hypura PEERS=0 SKIP_REFERENCE=1 THREADS=16 CONTEXT=1024 RUN_TIMEOUT=70 \
  HYPURA_ARGS="--gpu-budget 12GiB --gpu-experts pool" scripts/bench-limited /tmp/q36s8.gguf 1.2474 128 1 > $R/s6b-warm.txt 2>&1
cd $R && tar czf s6b-warm.tgz s6b-warm && rm -rf s6a-warm s6b-warm
