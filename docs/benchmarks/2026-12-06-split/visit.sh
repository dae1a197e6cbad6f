#!/usr/bin/env bash
# S6 with the split pool, in two calls on one H100/H200 machine (each under 10 minutes), run from a
# `scripts/gpu/cuda-bundle` directory with this file copied into it:
#
#   ./visit.sh 1   ggml's CUDA library built (kept in /tmp for call 2) while the forge writes S6's
#                  model with its default routing (real models' statistics); a dense model resident
#                  on the CPU (this machine's CPU rate), S6's model resident on the GPU (the
#                  device's time) and a short split run (the model's routing: which experts the
#                  pool starts with), which `auto` predicts from; `inspect`'s three predictions for S6a
#                  and S6b; S6a tg128, cold, under the memory cgroup: Hypura's default (auto) beside
#                  `--gpu-experts split` and llama.cpp's --fit, then `layers` and S6b as time allows.
#   ./visit.sh agree every tiny MoE preset split on the GPU against resident (32 greedy tokens).
#   ./visit.sh proof the split and whole layers, one warm run each (the shortest session).
#   ./visit.sh lean  call 1's essentials for a short session (no device record, no auto run).
#   ./visit.sh 2   S6b: Hypura's auto and split against llama.cpp's --n-cpu-moe 17; then S6a's
#                  4,096-token prompt, Hypura's default and llama.cpp's --fit (given 5x Hypura's time).
# The steps every visit repeats come from the bundle's scripts/visit-lib.sh (scripts/gpu/visit-lib.sh).
set -uo pipefail
cd "$(dirname "$0")" && . scripts/visit-lib.sh || exit 1
R=$OUT
visit_forge qwen3.6-35b-a3b /tmp/q36.gguf
visit_forge dense-1b /tmp/d1.gguf
visit_setup 90 || exit 1
visit_mark "built and forged at $SECONDS s"
if [ "${1:-1}" = agree ]; then
  # Every tiny MoE preset split on the GPU against the same model resident there (the pool's
  # agreement, kept with the split's CPU share summed in).
  scripts/pool-agreement $R split > /dev/null 2>&1
  visit_mark "agreement at $SECONDS s"
elif [ "${1:-1}" = proof ]; then
  # The least a device session can show: the split and whole layers on S6a's budgets, each a
  # run of 128 tokens with its figures (warm: no cgroup, the file in the page cache).
  for experts in split layers; do
    timeout 75 bin/hypura run /tmp/q36.gguf --gpu-budget 8GiB --memory-budget 11GiB --gpu-experts $experts \
      --raw --stats -p "Write a story about the sea." -n 128 --temperature 0 --context 1024 > $R/run-$experts.txt 2>&1
    visit_mark "$experts at $SECONDS s"
  done
elif [ "${1:-1}" = lean ]; then
  # What a short device session allows: the CPU's rate, a split run with its figures, then S6a's
  # default (auto) beside the split, and llama.cpp's --fit while time is left.
  bin/hypura bench /tmp/d1.gguf --no-baseline --mode resident --gpu-budget 0 -p 16 -n 16 -r 1 -t 16 > $R/cpu.txt 2>&1
  timeout 80 bin/hypura run /tmp/q36.gguf --gpu-budget 8GiB --gpu-experts split --raw --stats \
    -p "Write a story about the sea." -n 128 --temperature 0 --context 1024 > $R/routing-run.txt 2>&1
  visit_mark "recorded at $SECONDS s"
  bin/hypura inspect /tmp/q36.gguf --gpu-budget 8GiB --memory-budget 11GiB --context 1024 2>/dev/null \
    | grep -E "^(plan|gpu|expert pool|predict)" > $R/inspect.txt
  visit_case s6a /tmp/q36.gguf 0.5701 128 RUN_TIMEOUT=80 PEERS=fit HYPURA_ARGS="--gpu-budget 8GiB" \
    HYPURA_B_ARGS="--gpu-experts split"
elif [ "${1:-1}" = 1 ]; then
  bin/hypura bench /tmp/d1.gguf --no-baseline --mode resident --gpu-budget 0 -p 16 -n 16 -r 1 -t 16 > $R/cpu.txt 2>&1
  bin/hypura bench /tmp/q36.gguf --no-baseline --mode resident --no-repack --no-mmap -p 16 -n 64 -r 1 -t 16 \
    --context 1024 > $R/resident.txt 2>&1
  # A short streaming run records the model's routing (its reuse and which experts decode picks
  # most): the plans below predict from it, and the pool starts warm with it.
  timeout 90 bin/hypura run /tmp/q36.gguf --gpu-budget 8GiB --gpu-experts split --raw --stats \
    -p "Write a story about the sea." -n 128 --temperature 0 --context 1024 > $R/routing-run.txt 2>&1
  visit_mark "recorded at $SECONDS s"
  visit_inspect /tmp/q36.gguf 8GiB 11GiB
  visit_inspect /tmp/q36.gguf 12GiB 22GiB
  # Hypura's default (auto) beside the split and llama.cpp's --fit (its best placement within
  # the budget on this model before), each its own process, cold; then whole layers, and S6b.
  visit_case s6a /tmp/q36.gguf 0.5701 128 PEERS=fit HYPURA_ARGS="--gpu-budget 8GiB" \
    HYPURA_B_ARGS="--gpu-experts split"
  [ $SECONDS -lt ${LAYERS_BEFORE:-500} ] && visit_case s6a-layers /tmp/q36.gguf 0.5701 128 PEERS=0 \
    HYPURA_ARGS="--gpu-budget 8GiB --gpu-experts layers"
  [ $SECONDS -lt ${S6B_BEFORE:-420} ] && visit_bench s6b /tmp/q36.gguf 1.2474 128 PEERS=n-cpu-moe:17 N_CPU_MOE=17 \
    HYPURA_ARGS="--gpu-budget 12GiB" HYPURA_B_ARGS="--gpu-experts split"
  visit_mark "s6b at $SECONDS s"
else
  # S6b: Hypura's default and the split beside llama.cpp's --n-cpu-moe 17 (its best there under
  # this routing before); then S6a's 4,096-token prompt: Hypura's default, then llama.cpp's --fit
  # given five times Hypura's time (a run cut off there is still a ratio: over 5x).
  visit_case s6b /tmp/q36.gguf 1.2474 128 PEERS=n-cpu-moe:17 N_CPU_MOE=17 HYPURA_ARGS="--gpu-budget 12GiB" \
    HYPURA_B_ARGS="--gpu-experts split"
  started=$SECONDS
  visit_bench s6a-4k /tmp/q36.gguf 0.5701 1 RUN_TIMEOUT=150 PEERS=0 PROMPT_TOKENS=4096 CONTEXT=4352 \
    HYPURA_ARGS="--gpu-budget 8GiB"
  own=$((SECONDS - started)); visit_mark "s6a-4k hypura at $SECONDS s ($own s)"
  left=$((560 - SECONDS)); give=$((own * 5 + 20)); [ $give -gt $left ] && give=$left
  # llama.cpp's side in the same run folder (s6a-4k), its summary in s6a-4k-fit.txt.
  [ $give -gt 30 ] && visit_bench s6a-4k-fit /tmp/q36.gguf 0.5701 1 RUN_TIMEOUT=$give OUT=$R/s6a-4k SKIP_HYPURA=1 \
    PEERS=fit PROMPT_TOKENS=4096 CONTEXT=4352 HYPURA_ARGS="--gpu-budget 8GiB"
  visit_mark "s6a-4k fit at $SECONDS s (given $give s)"
fi
# At most eight files come back: the runs' folders and logs go in one archive.
visit_archive
