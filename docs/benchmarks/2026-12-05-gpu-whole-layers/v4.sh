#!/usr/bin/env bash
# One call on a fresh machine (about 8 minutes on the H200 machine, whose CUDA build takes 264 s):
# the model resident on the GPU (recorded: the pooled decode's limit and prediction take it); S6b
# with the routing recorded (a short pooled bench records it), Hypura beside llama.cpp's
# --n-cpu-moe 17 (its placement nearest --fit's), then --fit, as time allows. Eight files at most
# come back from a call: this writes eight.
. "$(dirname "$0")/vsetup.sh"
bin/hypura bench /tmp/q36s8.gguf --no-baseline -p 16 -n 32 -r 1 -t 16 --context 1024 --gpu-budget 12GiB > $R/record.txt 2>&1
bin/hypura inspect /tmp/q36s8.gguf --gpu-budget 12GiB --memory-budget 22GiB --context 1024 2>/dev/null | grep -E "^(gpu|expert pool|predict)" > $R/inspect.txt
common="HYPURA=bin/hypura THREADS=16 RUN_TIMEOUT=100 SKIP_REFERENCE=1 CONTEXT=1024"
env $common OUT=$R/s6b PEERS=n-cpu-moe:17 N_CPU_MOE=17 HYPURA_ARGS="--gpu-budget 12GiB" \
  scripts/bench-limited /tmp/q36s8.gguf 1.2474 128 1 > $R/s6b.txt 2>&1
echo "s6b at $SECONDS s" >> $R/forge.log
[ $SECONDS -lt 480 ] && env $common OUT=$R/s6b SKIP_HYPURA=1 PEERS=fit HYPURA_ARGS="--gpu-budget 12GiB" \
  scripts/bench-limited /tmp/q36s8.gguf 1.2474 128 1 > $R/s6b-fit.txt 2>&1
rm -rf $R/s6b
