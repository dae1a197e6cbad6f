#!/usr/bin/env bash
# S6 under real routing, in two calls on one H100/H200 machine (each under 10 minutes), run from a
# `scripts/gpu/cuda-bundle` directory with this file copied into it:
#
#   ./visit.sh 1   ggml's CUDA library built (kept in /tmp for call 2) while the forge writes S6's
#                  model with its default routing (real models' statistics); a small dense model
#                  resident on the CPU (records this machine's CPU rate, which `--gpu-experts auto`
#                  and the pooled limit use); S6's model resident on the GPU (records the device's
#                  time); a trace of what the benchmark decodes, with its routing statistics;
#                  `inspect`'s predictions for S6a and S6b; S6a tg128, cold, under the memory
#                  cgroup: Hypura's default (auto) beside `--gpu-experts layers`, then `pool`.
#   ./visit.sh 2   llama.cpp's placements on S6a, each in its own process (--fit, -ot exps=CPU,
#                  --n-cpu-moe 24/26/28), then S6b (Hypura auto and layers, llama.cpp's
#                  --n-cpu-moe 17) as time allows. Rebuilds or re-forges what a fresh machine lacks.
set -uo pipefail
cd "$(dirname "$0")"
R=$OUT
eval "$(./cuda-smoke env)"
[ -f /tmp/libggml-cuda.so ] && cp /tmp/libggml-cuda.so lib/
forge() { [ -f /tmp/q36.gguf ] || bin/hypura-forge qwen3.6-35b-a3b -o /tmp/q36.gguf > $R/forge.log 2>&1; }
( forge; [ -f /tmp/d1.gguf ] || bin/hypura-forge dense-1b -o /tmp/d1.gguf >> $R/forge.log 2>&1 ) &
./cuda-smoke build 90 > $R/build.txt 2>&1 || { tail -30 $R/build.txt; exit 1; }
cp lib/libggml-cuda.so /tmp/
wait
echo "built and forged at $SECONDS s" >> $R/time.log
common="HYPURA=bin/hypura THREADS=16 RUN_TIMEOUT=100 SKIP_REFERENCE=1 CONTEXT=1024"
if [ "${1:-1}" = 1 ]; then
  bin/hypura bench /tmp/d1.gguf --no-baseline --mode resident --gpu-budget 0 -p 16 -n 32 -r 1 -t 16 > $R/cpu.txt 2>&1
  bin/hypura bench /tmp/q36.gguf --no-baseline --mode resident --no-repack --no-mmap -p 16 -n 128 -r 1 -t 16 \
    --context 1024 > $R/resident.txt 2>&1
  echo "recorded at $SECONDS s" >> $R/time.log
  # What the benchmark decodes (greedy from a short start), traced through the pool's hook.
  i=0
  for p in "The" "Write a story about the sea." "def fibonacci(n):"; do
    i=$((i + 1))
    timeout 60 bin/hypura run /tmp/q36.gguf --gpu-budget 8GiB --gpu-experts pool --raw -p "$p" -n 128 \
      --temperature 0 --context 1024 --trace /tmp/trace$i.jsonl > /tmp/text$i.txt 2>/dev/null
  done
  bin/hypura simulate --model /tmp/q36.gguf /tmp/trace*.jsonl > $R/routing.txt 2>&1
  head -c 400 /tmp/text1.txt >> $R/routing.txt
  for budget in "8GiB 11GiB" "12GiB 22GiB"; do
    set -- $budget
    echo "== gpu $1 host $2 ctx 1024" >> $R/inspect.txt
    bin/hypura inspect /tmp/q36.gguf --gpu-budget $1 --memory-budget $2 --context 1024 2>/dev/null \
      | grep -E "^(plan|gpu|expert pool|predict)" >> $R/inspect.txt
  done
  echo "inspected at $SECONDS s" >> $R/time.log
  env $common OUT=$R/s6a PEERS=0 HYPURA_ARGS="--gpu-budget 8GiB" HYPURA_B_ARGS="--gpu-experts layers" \
    scripts/bench-limited /tmp/q36.gguf 0.5701 128 1 > $R/s6a.txt 2>&1
  echo "s6a at $SECONDS s" >> $R/time.log
  [ $SECONDS -lt 470 ] && env $common OUT=$R/s6a-pool PEERS=0 HYPURA_ARGS="--gpu-budget 8GiB --gpu-experts pool" \
    scripts/bench-limited /tmp/q36.gguf 0.5701 128 1 > $R/s6a-pool.txt 2>&1
  echo "s6a pool at $SECONDS s" >> $R/time.log
else
  env $common OUT=$R/s6a-peers SKIP_HYPURA=1 PEERS=gpu N_CPU_MOE="24 26 28" HYPURA_ARGS="--gpu-budget 8GiB" \
    scripts/bench-limited /tmp/q36.gguf 0.5701 128 1 > $R/s6a-peers.txt 2>&1
  echo "s6a peers at $SECONDS s" >> $R/time.log
  [ $SECONDS -lt 420 ] && env $common OUT=$R/s6b PEERS=n-cpu-moe:17 N_CPU_MOE=17 HYPURA_ARGS="--gpu-budget 12GiB" \
    HYPURA_B_ARGS="--gpu-experts layers" scripts/bench-limited /tmp/q36.gguf 1.2474 128 1 > $R/s6b.txt 2>&1
  echo "s6b at $SECONDS s" >> $R/time.log
fi
cd $R && tar czf results.tgz s6* 2>/dev/null; rm -rf s6a s6a-pool s6a-peers s6b
