#!/usr/bin/env bash
# The next visit's first call, after 2026-12-07's visit-c (README): S6a as a user meets it on a
# fresh machine, where `auto` now weighs its options at assumed disk and CPU rates instead of
# taking the split by rule, beside llama.cpp's --fit given longer; then the records the limits and
# predictions take (S6's model resident on the GPU and on the CPU); then S6b beside llama.cpp's
# --n-cpu-moe 17 and 20 (its best placement at 12 GiB is near there), predicted from those records.
#
#   DEADLINE=S ./visit-d.sh        (from a scripts/gpu/cuda-bundle folder, carried)
#   DEADLINE=S ./visit-d.sh 2      a second call: S6a's 4,096-token prompt, Hypura's default (by
#                                  prediction) then llama.cpp's --fit given five times its time
set -uo pipefail
cd "$(dirname "$0")" && . scripts/visit-lib.sh || exit 1
visit_begin /tmp/visit-d qwen3.6-35b-a3b /tmp/q36.gguf || exit 1
R=$OUT
if [ "${1:-1}" = 2 ]; then
  started=$SECONDS
  visit_case s6a-4k /tmp/q36.gguf 0.5701 1 RUN_TIMEOUT=200 PEERS=0 PROMPT_TOKENS=4096 CONTEXT=4352 \
    HYPURA_ARGS="--gpu-budget 8GiB"
  own=$((SECONDS - started)); give=$((own * 5 + 20)); left=$((${DEADLINE:-560} - 20 - SECONDS))
  [ $give -gt $left ] && give=$left
  # llama.cpp's side in the same run folder (s6a-4k), its summary in s6a-4k-fit.txt.
  [ $give -gt 30 ] && visit_case s6a-4k-fit /tmp/q36.gguf 0.5701 1 RUN_TIMEOUT=$give OUT=$R/s6a-4k SKIP_HYPURA=1 \
    PEERS=fit PROMPT_TOKENS=4096 CONTEXT=4352 HYPURA_ARGS="--gpu-budget 8GiB"
  kill "$visit_watchdog" 2>/dev/null
  visit_mark "done at $SECONDS s (fit given $give s)"
  visit_snapshot
  exit 0
fi
visit_inspect /tmp/q36.gguf 8GiB 11GiB
visit_snapshot
# No record, no profile: auto by prediction (at S6a's budgets it predicts whole layers 22.4,
# the split 21.6, the pool 12.5 tok/s). --fit took over 70 s for tg128 on 2026-12-07.
visit_fits 150 && visit_case s6a /tmp/q36.gguf 0.5701 64 PEERS=fit RUN_TIMEOUT=110 HYPURA_ARGS="--gpu-budget 8GiB"
visit_snapshot
visit_fits 40 && visit_resident /tmp/q36.gguf 64 && visit_mark "resident at $SECONDS s"
ln -f /tmp/q36.gguf /tmp/q36-cpu.gguf
visit_fits 60 && timeout -k 5 50 bin/hypura bench /tmp/q36-cpu.gguf --no-baseline --mode resident --no-repack --gpu-budget 0 \
  -p 16 -n 32 -r 1 -t 16 > "$R/cpu-moe.txt" 2>&1 && visit_mark "cpu record at $SECONDS s"
visit_inspect /tmp/q36.gguf 8GiB 11GiB
visit_inspect /tmp/q36.gguf 12GiB 22GiB
visit_snapshot
visit_fits 110 && visit_case s6b /tmp/q36.gguf 1.2474 128 PEERS="n-cpu-moe:17 n-cpu-moe:20" N_CPU_MOE="17 20" RUN_TIMEOUT=60 \
  HYPURA_ARGS="--gpu-budget 12GiB"
kill "$visit_watchdog" 2>/dev/null
visit_mark "done at $SECONDS s"
visit_wait_cuda
visit_snapshot
