#!/usr/bin/env bash
# One call for a session whose device starts keep failing: S6a cold beside llama.cpp's --fit,
# the prefetch under real routing, the predictions' new inputs, then more as time allows. Outputs are
# written outside the returned folder and archived into it (results.tgz) after every step, so a
# call cut off at any time brings back what the steps before finished.
#
#   DEADLINE=S ./visit-c.sh
#
#   1. ggml's CUDA build beside the forge of S6's model (real routing);
#   2. S6a cold under the memory cgroup, as a user meets it (no record of the model yet):
#      Hypura's default beside llama.cpp's --fit;
#   3. whole layers warm at S6a's budgets with the stale-gate prefetch on, then off (auto turns
#      it off where every layer attends on the GPU, as measured under skewed routing);
#   4. the CPU's record of an MoE model: S6's model resident on the CPU, through a hard link (a
#      model of its own to the records), without repacking as streamed experts are not; then
#      `inspect` at S6a's and S6b's budgets (the predictions, against step 2's runs);
#   5. as time allows: the device's record (S6's model resident on the GPU), a warm split run
#      with --stats (its lanes poll before they sleep: lane-spin.patch), and S6b beside
#      llama.cpp's --n-cpu-moe 17.
set -uo pipefail
cd "$(dirname "$0")" && . scripts/visit-lib.sh || exit 1
visit_write_outside /tmp/visit-c
R=$OUT
visit_watchdog "${DEADLINE:-560}"

lscpu > "$R/lscpu.txt" 2>&1; nvidia-smi -q -d CLOCK,POWER > "$R/gpu.txt" 2>&1
visit_forge qwen3.6-35b-a3b /tmp/q36.gguf
visit_setup 90 || { visit_snapshot; exit 1; }
visit_mark "built and forged at $SECONDS s"
visit_snapshot
# S6a first, as a user meets it: no record of the model yet (planned for real models' routing).
visit_fits 120 && visit_case s6a /tmp/q36.gguf 0.5701 128 PEERS=fit RUN_TIMEOUT=70 HYPURA_ARGS="--gpu-budget 8GiB"
visit_snapshot
for prefetch in on off; do
  visit_fits 50 && timeout -k 5 45 bin/hypura run /tmp/q36.gguf --gpu-budget 8GiB --memory-budget 11GiB --gpu-experts layers \
    --prefetch $prefetch --raw --stats -p "Write a story about the sea." -n 64 --temperature 0 --context 1024 \
    > "$R/layers-prefetch-$prefetch.txt" 2>&1 && visit_mark "layers, prefetch $prefetch, at $SECONDS s"
  visit_snapshot
done
ln -f /tmp/q36.gguf /tmp/q36-cpu.gguf
visit_fits 60 && timeout -k 5 50 bin/hypura bench /tmp/q36-cpu.gguf --no-baseline --mode resident --no-repack --gpu-budget 0 \
  -p 16 -n 32 -r 1 -t 16 > "$R/cpu-moe.txt" 2>&1
visit_mark "cpu record at $SECONDS s"
visit_inspect /tmp/q36.gguf 8GiB 11GiB
visit_inspect /tmp/q36.gguf 12GiB 22GiB
visit_snapshot
visit_fits 40 && visit_resident /tmp/q36.gguf 64 && visit_mark "resident at $SECONDS s"
visit_fits 60 && timeout -k 5 50 bin/hypura run /tmp/q36.gguf --gpu-budget 8GiB --memory-budget 11GiB --gpu-experts split --raw \
  --stats -p "Write a story about the sea." -n 64 --temperature 0 --context 1024 > "$R/split-run.txt" 2>&1 &&
  visit_mark "split run at $SECONDS s"
visit_snapshot
visit_fits 100 && visit_case s6b /tmp/q36.gguf 1.2474 128 PEERS=n-cpu-moe:17 N_CPU_MOE=17 RUN_TIMEOUT=60 \
  HYPURA_ARGS="--gpu-budget 12GiB"
kill "$visit_watchdog" 2>/dev/null
free -g > "$R/free.txt"; dmesg 2>/dev/null | tail -40 > "$R/dmesg.txt"
visit_mark "done at $SECONDS s"
visit_wait_cuda
visit_snapshot
