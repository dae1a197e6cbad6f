#!/usr/bin/env bash
# The second call of 2026-12-07, for the device time the first left (about 15 minutes, a start
# included): where a split layer's CPU share spends its time, and S6a cold with every log kept.
# The first call's S6a case ran past its deadline and its logs did not come back (more than
# eight files, no archive), so this one writes its outputs outside the returned folder and
# archives them into it (results.tgz) after every step: a call cut off at any time brings back
# what the steps before finished.
#
#   DEADLINE=S ./visit-b.sh
#
#   1. a warm split run at S6a's budgets (GPU 8 GiB, host 11 GiB), `run --stats`: the CPU
#      share's time split into the hand-over to the lanes, the slowest lane's wait for reads,
#      and the rest;
#   2. the same with the lanes sleeping between parts (bin/hypura-base, the bundle's binary
#      before they polled: carried beside it), then the split with a host budget that holds
#      every expert (no read on the CPU's path);
#   3. as time allows, S6a cold under the memory cgroup (Hypura's default beside llama.cpp's
#      --fit), and whole layers warm with their figures.
set -uo pipefail
cd "$(dirname "$0")" && . scripts/visit-lib.sh || exit 1
visit_write_outside /tmp/visit-b
R=$OUT
visit_watchdog "${DEADLINE:-430}"
# run_split SECONDS HOST_BUDGET GPU_EXPERTS FILE [BINARY]
run_split() {
  timeout -k 5 "$1" "${5:-bin/hypura}" run /tmp/q36.gguf --gpu-budget 8GiB --memory-budget "$2" --gpu-experts "$3" --raw \
    --stats -p "Write a story about the sea." -n 96 --temperature 0 --context 1024 > "$R/$4" 2>&1
  visit_mark "$4 at $SECONDS s"
  visit_snapshot
}

lscpu > "$R/lscpu.txt" 2>&1; nvidia-smi -q -d CLOCK,POWER > "$R/gpu.txt" 2>&1
visit_forge qwen3.6-35b-a3b /tmp/q36.gguf
visit_setup 90 || { visit_snapshot; exit 1; }
visit_mark "built and forged at $SECONDS s"
visit_snapshot
# The lanes sleeping between parts (bin/hypura-base: the commit before they polled), then
# polling (bin/hypura).
run_split 60 11GiB split split-11-base.txt bin/hypura-base
visit_fits 70 && run_split 60 11GiB split split-11.txt
visit_fits 70 && run_split 65 22GiB split split-22.txt
visit_fits 150 && visit_case s6a /tmp/q36.gguf 0.5701 128 PEERS=fit RUN_TIMEOUT=70 HYPURA_ARGS="--gpu-budget 8GiB"
visit_snapshot
visit_fits 50 && run_split 45 11GiB layers layers-11.txt
kill "$visit_watchdog" 2>/dev/null
free -g > "$R/free.txt"; dmesg 2>/dev/null | tail -40 > "$R/dmesg.txt"
visit_mark "done at $SECONDS s"
visit_wait_cuda
visit_snapshot
