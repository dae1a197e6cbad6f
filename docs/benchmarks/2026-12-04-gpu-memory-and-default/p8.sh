#!/usr/bin/env bash
# Visit 2, part A: Hypura's rows after the changes (the device's compute
# estimate, the pool by default where the host would compute experts, staging copies on the
# device): S6a tg128, the two long prompts (device memory against the 8 GiB budget), S6b tg128.
R=$OUT
cd "$(dirname "$0")"
./cuda-smoke build 90 > $R/build.txt 2>&1 || { tail -30 $R/build.txt; exit 1; }
eval "$(./cuda-smoke env)"
bin/hypura-forge qwen3.6-35b-a3b --router-skew 8 -o /tmp/q36s8.gguf > /dev/null 2>&1
for ctx in 1024 5120 17408; do
  echo "== ctx $ctx" >> $R/inspect.txt
  bin/hypura inspect /tmp/q36s8.gguf --gpu-budget 8GiB --memory-budget 10GiB --context $ctx 2>/dev/null | grep -E "^(plan|memory|gpu|expert pool|batch)" >> $R/inspect.txt
done
common="HYPURA=bin/hypura PEERS=0 SKIP_REFERENCE=1 THREADS=16 RUN_TIMEOUT=100"
env $common OUT=$R/s6a CONTEXT=1024 HYPURA_ARGS="--gpu-budget 8GiB" \
  scripts/bench-limited /tmp/q36s8.gguf 0.5701 128 1 > $R/s6a.txt 2>&1
for n in 16384 4096; do
  env $common OUT=$R/p$n CONTEXT=$((n + 1024)) PROMPT_TOKENS=$n HYPURA_ARGS="--gpu-budget 8GiB" \
    scripts/bench-limited /tmp/q36s8.gguf 0.5701 16 1 > $R/p$n.txt 2>&1
done
env $common OUT=$R/s6b CONTEXT=1024 HYPURA_ARGS="--gpu-budget 12GiB" \
  scripts/bench-limited /tmp/q36s8.gguf 1.2474 128 1 > $R/s6b.txt 2>&1
cd $R && tar czf runs.tgz s6a p16384 p4096 s6b && rm -rf s6a p16384 p4096 s6b
