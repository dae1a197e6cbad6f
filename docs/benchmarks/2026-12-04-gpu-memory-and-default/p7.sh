#!/usr/bin/env bash
# Visit 1: device memory against the plan at contexts 1,024 / 5,120 / 17,408
# (llama.cpp's buffer sizes from its log), the pooled decode's limit split into the GPU's
# compute, the host's work at the stops and the bus (S6a), the prompts with staging copies on
# the device, and S6b: whole layers against the pool in one visit.
R=$OUT
cd "$(dirname "$0")"
nvidia-smi --query-gpu=memory.used,memory.total --format=csv > $R/baseline.txt 2>&1
./cuda-smoke build 90 > $R/build.txt 2>&1 || { tail -30 $R/build.txt; exit 1; }
eval "$(./cuda-smoke env)"
bin/hypura-forge qwen3.6-35b-a3b --router-skew 8 -o /tmp/q36s8.gguf > /dev/null 2>&1
export HYPURA_LOG=warn,hypura=info,llama=trace
for ctx in 1024 5120 17408; do
  echo "== ctx $ctx" >> $R/inspect.txt
  bin/hypura inspect /tmp/q36s8.gguf --gpu-budget 8GiB --memory-budget 10GiB --context $ctx 2>/dev/null | grep -E "^(plan|memory|gpu|expert pool|batch)" >> $R/inspect.txt
done
common="HYPURA=bin/hypura PEERS=0 SKIP_REFERENCE=1 THREADS=16 RUN_TIMEOUT=100"
env $common OUT=$R/s6a CONTEXT=1024 HYPURA_ARGS="--gpu-budget 8GiB" \
  scripts/bench-limited /tmp/q36s8.gguf 0.5701 128 1 > $R/s6a.txt 2>&1
for n in 4096 16384; do
  env $common OUT=$R/p$n CONTEXT=$((n + 1024)) PROMPT_TOKENS=$n HYPURA_ARGS="--gpu-budget 8GiB" \
    scripts/bench-limited /tmp/q36s8.gguf 0.5701 16 1 > $R/p$n.txt 2>&1
done
env $common OUT=$R/s6b CONTEXT=1024 HYPURA_ARGS="--gpu-budget 12GiB" HYPURA_B_ARGS="--gpu-experts pool" \
  scripts/bench-limited /tmp/q36s8.gguf 1.2474 128 1 > $R/s6b.txt 2>&1
cd $R
for d in s6a p4096 p16384 s6b; do
  for log in $d/*.log; do
    grep -E "buffer size|expert pool on|prompt batches|n_ubatch|n_batch|flash_attn|KV self size|graph splits|compute buffer" $log > ${log%.log}.buffers.txt
    gzip -9 $log
  done
done
du -sh $R
