#!/usr/bin/env bash
# One call on a fresh machine: where a pool's stop spends its time. Build with the S6 model
# forged beside it, the model resident on the GPU (recorded); S6a tg128 cold with the stops'
# split (`bench`'s "pool stops" line), first with bin/hypura-a (the build before the bounce
# buffer, carried beside it) then bin/hypura; the pool and the resident model with ggml's CUDA
# graphs on and off, warm (does a segment between stops replay a graph?); then S6b with the
# routing recorded beside llama.cpp's --n-cpu-moe 17 and --fit, as time allows. At most 8 files.
# The setup, through the bundle's scripts/visit-lib.sh: the CUDA library built with the S6 model
# forged beside it, then the model resident on the GPU (recorded: the pooled decode's limit and
# the plan's prediction take its time).
cd "$(dirname "$0")" && . scripts/visit-lib.sh || exit 1
visit_setup_resident qwen3.6-35b-a3b /tmp/q36s8.gguf 128 --router-skew 8 || exit 1
R=$OUT
tail -3 $R/build.txt >> $R/forge.log; rm -f $R/build.txt
common="HYPURA=bin/hypura THREADS=16 RUN_TIMEOUT=100 SKIP_REFERENCE=1 CONTEXT=1024"
for side in a b; do
  binary=bin/hypura; [ $side = a ] && binary=bin/hypura-a
  env $common HYPURA=$binary OUT=$R/s6a PEERS=0 HYPURA_ARGS="--gpu-budget 8GiB" \
    scripts/bench-limited /tmp/q36s8.gguf 0.5701 128 1 > $R/s6a-$side.txt 2>&1
  echo "s6a $side at $SECONDS s" >> $R/forge.log
done
warm() { bin/hypura bench /tmp/q36s8.gguf --no-baseline -p 16 -n 32 -r 1 -t 16 --context 1024 "$@" 2>&1 | grep -E "tg32|pool stops|physical limit|expert tiers"; }
for graphs in on off; do
  [ $graphs = off ] && export GGML_CUDA_DISABLE_GRAPHS=1
  echo "== CUDA graphs $graphs: the pool at 8 GiB, then resident" >> $R/graphs.txt
  warm --gpu-budget 8GiB >> $R/graphs.txt
  warm --mode resident --no-repack --no-mmap >> $R/graphs.txt
done
unset GGML_CUDA_DISABLE_GRAPHS
echo "graphs at $SECONDS s" >> $R/forge.log
bin/hypura bench /tmp/q36s8.gguf --no-baseline -p 16 -n 32 -r 1 -t 16 --context 1024 --gpu-budget 12GiB > /dev/null 2>&1
bin/hypura inspect /tmp/q36s8.gguf --gpu-budget 12GiB --memory-budget 22GiB --context 1024 2>/dev/null | grep -E "^(gpu|expert pool|predict)" > $R/inspect.txt
[ $SECONDS -lt 430 ] && env $common OUT=$R/s6b PEERS=n-cpu-moe:17 N_CPU_MOE=17 HYPURA_ARGS="--gpu-budget 12GiB" \
  scripts/bench-limited /tmp/q36s8.gguf 1.2474 128 1 > $R/s6b.txt 2>&1
echo "s6b at $SECONDS s" >> $R/forge.log
[ $SECONDS -lt 510 ] && env $common OUT=$R/s6b SKIP_HYPURA=1 PEERS=fit HYPURA_ARGS="--gpu-budget 12GiB" \
  scripts/bench-limited /tmp/q36s8.gguf 1.2474 128 1 > $R/s6b-fit.txt 2>&1
echo "done at $SECONDS s" >> $R/forge.log
rm -rf $R/s6a $R/s6b
