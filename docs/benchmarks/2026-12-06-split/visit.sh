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
#   ./visit.sh proof the split and whole layers, one warm run each (the shortest session).
#   ./visit.sh lean  call 1's essentials for a short session (no device record, no auto run).
#   ./visit.sh 2   S6b: Hypura's auto and split against llama.cpp's --n-cpu-moe 17; then S6a's
#                  4,096-token prompt, Hypura's default and llama.cpp's --fit (given 5x Hypura's time).
set -uo pipefail
cd "$(dirname "$0")"
R=$OUT
eval "$(./cuda-smoke env)"
[ -f /tmp/libggml-cuda.so ] && cp /tmp/libggml-cuda.so lib/
( [ -f /tmp/q36.gguf ] || bin/hypura-forge qwen3.6-35b-a3b -o /tmp/q36.gguf > $R/forge.log 2>&1
  [ -f /tmp/d1.gguf ] || bin/hypura-forge dense-1b -o /tmp/d1.gguf >> $R/forge.log 2>&1 ) &
[ -f lib/libggml-cuda.so ] || { ./cuda-smoke build 90 > $R/build.txt 2>&1 || { tail -30 $R/build.txt; exit 1; }; }
cp lib/libggml-cuda.so /tmp/
wait
echo "built and forged at $SECONDS s" >> $R/time.log
common="HYPURA=bin/hypura THREADS=16 RUN_TIMEOUT=100 SKIP_REFERENCE=1 CONTEXT=1024"
s6a() { # NAME "HYPURA ARGS" [more env]
  local name=$1 args=$2; shift 2
  env $common OUT=$R/$name PEERS=0 HYPURA_ARGS="--gpu-budget 8GiB $args" "$@" \
    scripts/bench-limited /tmp/q36.gguf 0.5701 128 1 > $R/$name.txt 2>&1
  echo "$name at $SECONDS s" >> $R/time.log
}
if [ "${1:-1}" = proof ]; then
  # The least a device session can show: the split and whole layers on S6a's budgets, each a
  # run of 128 tokens with its figures (warm: no cgroup, the file in the page cache).
  for experts in split layers; do
    timeout 75 bin/hypura run /tmp/q36.gguf --gpu-budget 8GiB --memory-budget 11GiB --gpu-experts $experts \
      --raw --stats -p "Write a story about the sea." -n 128 --temperature 0 --context 1024 > $R/run-$experts.txt 2>&1
    echo "$experts at $SECONDS s" >> $R/time.log
  done
elif [ "${1:-1}" = lean ]; then
  # What a short device session allows: the CPU's rate, a split run with its figures, then S6a's
  # default (auto) beside the split, and llama.cpp's --fit while time is left.
  bin/hypura bench /tmp/d1.gguf --no-baseline --mode resident --gpu-budget 0 -p 16 -n 16 -r 1 -t 16 > $R/cpu.txt 2>&1
  timeout 80 bin/hypura run /tmp/q36.gguf --gpu-budget 8GiB --gpu-experts split --raw --stats \
    -p "Write a story about the sea." -n 128 --temperature 0 --context 1024 > $R/routing-run.txt 2>&1
  echo "recorded at $SECONDS s" >> $R/time.log
  bin/hypura inspect /tmp/q36.gguf --gpu-budget 8GiB --memory-budget 11GiB --context 1024 2>/dev/null \
    | grep -E "^(plan|gpu|expert pool|predict)" > $R/inspect.txt
  env $common RUN_TIMEOUT=80 OUT=$R/s6a PEERS=fit HYPURA_ARGS="--gpu-budget 8GiB" \
    HYPURA_B_ARGS="--gpu-experts split" scripts/bench-limited /tmp/q36.gguf 0.5701 128 1 > $R/s6a.txt 2>&1
  echo "s6a at $SECONDS s" >> $R/time.log
elif [ "${1:-1}" = 1 ]; then
  bin/hypura bench /tmp/d1.gguf --no-baseline --mode resident --gpu-budget 0 -p 16 -n 16 -r 1 -t 16 > $R/cpu.txt 2>&1
  bin/hypura bench /tmp/q36.gguf --no-baseline --mode resident --no-repack --no-mmap -p 16 -n 64 -r 1 -t 16 \
    --context 1024 > $R/resident.txt 2>&1
  # A short streaming run records the model's routing (its reuse and which experts decode picks
  # most): the plans below predict from it, and the pool starts warm with it.
  timeout 90 bin/hypura run /tmp/q36.gguf --gpu-budget 8GiB --gpu-experts split --raw --stats \
    -p "Write a story about the sea." -n 128 --temperature 0 --context 1024 > $R/routing-run.txt 2>&1
  echo "recorded at $SECONDS s" >> $R/time.log
  for budget in "8GiB 11GiB" "12GiB 22GiB"; do
    set -- $budget
    echo "== gpu $1 host $2 ctx 1024" >> $R/inspect.txt
    bin/hypura inspect /tmp/q36.gguf --gpu-budget $1 --memory-budget $2 --context 1024 2>/dev/null \
      | grep -E "^(plan|gpu|expert pool|predict)" >> $R/inspect.txt
  done
  # Hypura's default (auto) beside the split and llama.cpp's --fit (its best placement within
  # the budget on this model before), each its own process, cold; then whole layers, and S6b.
  env $common OUT=$R/s6a PEERS=fit HYPURA_ARGS="--gpu-budget 8GiB" \
    HYPURA_B_ARGS="--gpu-experts split" scripts/bench-limited /tmp/q36.gguf 0.5701 128 1 > $R/s6a.txt 2>&1
  echo "s6a at $SECONDS s" >> $R/time.log
  [ $SECONDS -lt ${LAYERS_BEFORE:-500} ] && s6a s6a-layers "--gpu-experts layers"
  [ $SECONDS -lt ${S6B_BEFORE:-420} ] && env $common OUT=$R/s6b PEERS=n-cpu-moe:17 N_CPU_MOE=17 HYPURA_ARGS="--gpu-budget 12GiB" \
    HYPURA_B_ARGS="--gpu-experts split" scripts/bench-limited /tmp/q36.gguf 1.2474 128 1 > $R/s6b.txt 2>&1
  echo "s6b at $SECONDS s" >> $R/time.log
else
  # S6b: Hypura's default and the split beside llama.cpp's --n-cpu-moe 17 (its best there under
  # this routing before); then S6a's 4,096-token prompt: Hypura's default, then llama.cpp's --fit
  # given five times Hypura's time (a run cut off there is still a ratio: over 5x).
  env $common OUT=$R/s6b PEERS=n-cpu-moe:17 N_CPU_MOE=17 HYPURA_ARGS="--gpu-budget 12GiB" \
    HYPURA_B_ARGS="--gpu-experts split" scripts/bench-limited /tmp/q36.gguf 1.2474 128 1 > $R/s6b.txt 2>&1
  echo "s6b at $SECONDS s" >> $R/time.log
  started=$SECONDS
  env $common RUN_TIMEOUT=150 OUT=$R/s6a-4k PEERS=0 PROMPT_TOKENS=4096 CONTEXT=4352 HYPURA_ARGS="--gpu-budget 8GiB" \
    scripts/bench-limited /tmp/q36.gguf 0.5701 1 1 > $R/s6a-4k.txt 2>&1
  own=$((SECONDS - started)); echo "s6a-4k hypura at $SECONDS s ($own s)" >> $R/time.log
  left=$((560 - SECONDS)); give=$((own * 5 + 20)); [ $give -gt $left ] && give=$left
  [ $give -gt 30 ] && env $common RUN_TIMEOUT=$give OUT=$R/s6a-4k SKIP_HYPURA=1 PEERS=fit PROMPT_TOKENS=4096 CONTEXT=4352 \
    HYPURA_ARGS="--gpu-budget 8GiB" scripts/bench-limited /tmp/q36.gguf 0.5701 1 1 > $R/s6a-4k-fit.txt 2>&1
  echo "s6a-4k fit at $SECONDS s (given $give s)" >> $R/time.log
fi
# At most eight files come back: the runs' folders and logs go in one archive.
cd $R && tar czf results.tgz --exclude=results.tgz --exclude=time.log . && find . -mindepth 1 -maxdepth 1 ! -name results.tgz ! -name time.log -exec rm -rf {} +
