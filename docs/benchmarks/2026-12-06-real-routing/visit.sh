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
# The steps every visit repeats come from the bundle's scripts/visit-lib.sh (scripts/gpu/visit-lib.sh).
set -uo pipefail
cd "$(dirname "$0")" && . scripts/visit-lib.sh || exit 1
R=$OUT
visit_forge qwen3.6-35b-a3b /tmp/q36.gguf
visit_forge dense-1b /tmp/d1.gguf
visit_setup 90 || exit 1
visit_mark "built and forged at $SECONDS s"
if [ "${1:-1}" = 1 ]; then
  bin/hypura bench /tmp/d1.gguf --no-baseline --mode resident --gpu-budget 0 -p 16 -n 32 -r 1 -t 16 > $R/cpu.txt 2>&1
  bin/hypura bench /tmp/q36.gguf --no-baseline --mode resident --no-repack --no-mmap -p 16 -n 128 -r 1 -t 16 \
    --context 1024 > $R/resident.txt 2>&1
  visit_mark "recorded at $SECONDS s"
  # What the benchmark decodes (greedy from a short start), traced through the pool's hook.
  i=0
  for p in "The" "Write a story about the sea." "def fibonacci(n):"; do
    i=$((i + 1))
    timeout 60 bin/hypura run /tmp/q36.gguf --gpu-budget 8GiB --gpu-experts pool --raw -p "$p" -n 128 \
      --temperature 0 --context 1024 --trace /tmp/trace$i.jsonl > /tmp/text$i.txt 2>/dev/null
  done
  bin/hypura simulate --model /tmp/q36.gguf /tmp/trace*.jsonl > $R/routing.txt 2>&1
  head -c 400 /tmp/text1.txt >> $R/routing.txt
  visit_inspect /tmp/q36.gguf 8GiB 11GiB
  visit_inspect /tmp/q36.gguf 12GiB 22GiB
  visit_mark "inspected at $SECONDS s"
  visit_case s6a /tmp/q36.gguf 0.5701 128 PEERS=0 HYPURA_ARGS="--gpu-budget 8GiB" HYPURA_B_ARGS="--gpu-experts layers"
  [ $SECONDS -lt 470 ] && visit_bench s6a-pool /tmp/q36.gguf 0.5701 128 PEERS=0 \
    HYPURA_ARGS="--gpu-budget 8GiB --gpu-experts pool"
  visit_mark "s6a pool at $SECONDS s"
else
  visit_bench s6a-peers /tmp/q36.gguf 0.5701 128 SKIP_HYPURA=1 PEERS=gpu N_CPU_MOE="24 26 28" \
    HYPURA_ARGS="--gpu-budget 8GiB"
  visit_mark "s6a peers at $SECONDS s"
  [ $SECONDS -lt 420 ] && visit_bench s6b /tmp/q36.gguf 1.2474 128 PEERS=n-cpu-moe:17 N_CPU_MOE=17 \
    HYPURA_ARGS="--gpu-budget 12GiB" HYPURA_B_ARGS="--gpu-experts layers"
  visit_mark "s6b at $SECONDS s"
fi
# The runs' folders in results.tgz with their summaries (which stay beside it too).
visit_archive 's6*'
