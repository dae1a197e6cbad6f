#!/usr/bin/env bash
# Part 2 (the same machine, right after part 1): the plans with the routing part 1 recorded;
# S6b a second time (whole MoE layers beside the pool) and llama.cpp's --fit and --n-cpu-moe 17
# beside it; S6a tg128, Hypura and llama.cpp's --n-cpu-moe 26 (its best in earlier visits).
R=$OUT
cd "$(dirname "$0")"
./cuda-smoke build 90 > $R/build.txt 2>&1 || { tail -30 $R/build.txt; exit 1; }
eval "$(./cuda-smoke env)"
[ -f /tmp/q36s8.gguf ] || bin/hypura-forge qwen3.6-35b-a3b --router-skew 8 -o /tmp/q36s8.gguf > /dev/null 2>&1
for budget in "8GiB 10GiB" "12GiB 22GiB"; do
  set -- $budget
  echo "== gpu $1 host $2 ctx 1024 (routing recorded)" >> $R/inspect.txt
  bin/hypura inspect /tmp/q36s8.gguf --gpu-budget $1 --memory-budget $2 --context 1024 2>/dev/null | grep -E "^(plan|memory|gpu|expert pool|batch|predict)" >> $R/inspect.txt
done
common="HYPURA=bin/hypura THREADS=16 RUN_TIMEOUT=100 SKIP_REFERENCE=1 CONTEXT=1024"
env $common OUT=$R/s6b PEERS=fit HYPURA_ARGS="--gpu-budget 12GiB" \
  scripts/bench-limited /tmp/q36s8.gguf 1.2474 128 1 > $R/s6b.txt 2>&1
env $common OUT=$R/s6a PEERS=n-cpu-moe:26 N_CPU_MOE=26 HYPURA_ARGS="--gpu-budget 8GiB" \
  scripts/bench-limited /tmp/q36s8.gguf 0.5701 128 1 > $R/s6a.txt 2>&1
[ $SECONDS -lt 480 ] && env $common OUT=$R/s6b SKIP_HYPURA=1 PEERS=n-cpu-moe:17 N_CPU_MOE=17 HYPURA_ARGS="--gpu-budget 12GiB" \
  scripts/bench-limited /tmp/q36s8.gguf 1.2474 128 1 >> $R/s6b.txt 2>&1
cd $R && tar czf v2.tgz s6b s6a && rm -rf s6b s6a
