#!/usr/bin/env bash
# The split pool on S6 again, with the pool starting warm (the host cache filled at load), the
# CPU lanes waiting for their own picks' reads, and a split plan's context threads sleeping
# between graphs. One call of under ten minutes on an H100/H200 machine, run from a
# `scripts/gpu/cuda-bundle` directory with this file copied into it:
#
#   ./visit.sh 1   ggml's CUDA library built while the forge writes S6's model (default routing:
#                  real models' statistics) and a dense 1B; the CPU's and the device's records; a
#                  warm split run with its figures (it records the routing the plans predict
#                  from); `inspect` at S6a's and S6b's budgets; S6a tg128 cold under the memory
#                  cgroup: Hypura's default (auto) beside `--gpu-experts split` and llama.cpp's
#                  --fit; then, as time allows, S6a's 4,096-token prompt (Hypura's default),
#                  whole layers, and S6b beside llama.cpp's --n-cpu-moe 17.
#   ./visit.sh short  S6a's default beside the split, then the split run with its figures and
#                  --fit as time allows (DEADLINE set to the session's device time left).
#   ./visit.sh 2   S6a's 4,096-token prompt: Hypura's default, then llama.cpp's --fit given five
#                  times Hypura's time; then S6b as in call 1 if it was not reached there.
#
# A watchdog stops whatever runs at DEADLINE seconds (default 560), so the outputs are archived
# within the call's ten minutes. The repeated steps come from the bundle's scripts/visit-lib.sh.
set -uo pipefail
cd "$(dirname "$0")" && . scripts/visit-lib.sh || exit 1
R=$OUT
DEADLINE=${DEADLINE:-560}
(
  sleep "$DEADLINE"
  echo "deadline: runs stopped at $DEADLINE s" >> "$R/time.log"
  pkill -f scripts/bench-limited; pkill -f bin/hypura; pkill -f llama-
) &
watchdog=$!
visit_watchdog=$watchdog   # visit_setup waits for every background job but this one
# Whether a step that takes about $1 seconds still fits before the deadline.
fits() { [ $((SECONDS + $1)) -lt "$DEADLINE" ]; }

visit_forge qwen3.6-35b-a3b /tmp/q36.gguf
visit_forge dense-1b /tmp/d1.gguf
visit_setup 90 || exit 1
visit_mark "built and forged at $SECONDS s"
s6b() {
  visit_case s6b /tmp/q36.gguf 1.2474 128 PEERS=n-cpu-moe:17 N_CPU_MOE=17 RUN_TIMEOUT=70 \
    HYPURA_ARGS="--gpu-budget 12GiB" HYPURA_B_ARGS="--gpu-experts split"
}
if [ "${1:-1}" = short ]; then
  # What a short session allows: S6a cold, Hypura's default beside the split (no record yet:
  # planned for real models' routing), then a warm split run with its figures, then llama.cpp's
  # --fit if time is left.
  visit_case s6a /tmp/q36.gguf 0.5701 128 PEERS=0 RUN_TIMEOUT=60 HYPURA_ARGS="--gpu-budget 8GiB" \
    HYPURA_B_ARGS="--gpu-experts split"
  fits 50 && timeout 45 bin/hypura run /tmp/q36.gguf --gpu-budget 8GiB --memory-budget 11GiB --gpu-experts split \
    --raw --stats -p "Write a story about the sea." -n 96 --temperature 0 --context 1024 > $R/split-run.txt 2>&1
  visit_mark "split run at $SECONDS s"
  fits 70 && visit_case s6a-fit /tmp/q36.gguf 0.5701 128 SKIP_HYPURA=1 OUT=$R/s6a PEERS=fit RUN_TIMEOUT=60 \
    HYPURA_ARGS="--gpu-budget 8GiB"
elif [ "${1:-1}" = 1 ]; then
  bin/hypura bench /tmp/d1.gguf --no-baseline --mode resident --gpu-budget 0 -p 16 -n 16 -r 1 -t 16 > $R/cpu.txt 2>&1
  visit_resident /tmp/q36.gguf 64
  # A warm split run with its figures; it records the model's routing (its reuse and which
  # experts decode picks most), which the plans predict from and the pool starts warm with.
  timeout 70 bin/hypura run /tmp/q36.gguf --gpu-budget 8GiB --memory-budget 11GiB --gpu-experts split --raw --stats \
    -p "Write a story about the sea." -n 128 --temperature 0 --context 1024 > $R/split-run.txt 2>&1
  visit_mark "split run at $SECONDS s"
  visit_inspect /tmp/q36.gguf 8GiB 11GiB
  visit_inspect /tmp/q36.gguf 12GiB 22GiB
  visit_case s6a /tmp/q36.gguf 0.5701 128 PEERS=fit RUN_TIMEOUT=80 HYPURA_ARGS="--gpu-budget 8GiB" \
    HYPURA_B_ARGS="--gpu-experts split"
  # S6a's 4,096-token prompt, Hypura's default alone (llama.cpp's side is call 2's).
  fits 100 && visit_case s6a-4k /tmp/q36.gguf 0.5701 1 RUN_TIMEOUT=90 PEERS=0 PROMPT_TOKENS=4096 CONTEXT=4352 \
    HYPURA_ARGS="--gpu-budget 8GiB"
  fits 60 && visit_case s6a-layers /tmp/q36.gguf 0.5701 128 PEERS=0 RUN_TIMEOUT=60 \
    HYPURA_ARGS="--gpu-budget 8GiB --gpu-experts layers"
  fits 150 && s6b
else
  started=$SECONDS
  visit_bench s6a-4k /tmp/q36.gguf 0.5701 1 RUN_TIMEOUT=150 PEERS=0 PROMPT_TOKENS=4096 CONTEXT=4352 \
    HYPURA_ARGS="--gpu-budget 8GiB"
  own=$((SECONDS - started)); visit_mark "s6a-4k hypura at $SECONDS s ($own s)"
  give=$((own * 5 + 20)); left=$((DEADLINE - 20 - SECONDS)); [ $give -gt $left ] && give=$left
  # llama.cpp's side in the same run folder (s6a-4k), its summary in s6a-4k-fit.txt.
  [ $give -gt 30 ] && visit_bench s6a-4k-fit /tmp/q36.gguf 0.5701 1 RUN_TIMEOUT=$give OUT=$R/s6a-4k SKIP_HYPURA=1 \
    PEERS=fit PROMPT_TOKENS=4096 CONTEXT=4352 HYPURA_ARGS="--gpu-budget 8GiB"
  visit_mark "s6a-4k fit at $SECONDS s (given $give s)"
  fits 150 && s6b
fi
kill $watchdog 2>/dev/null
visit_mark "done at $SECONDS s"
# At most eight files come back: the runs' folders and logs go in one archive.
visit_archive
