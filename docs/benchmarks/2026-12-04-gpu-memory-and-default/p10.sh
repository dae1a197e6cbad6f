#!/usr/bin/env bash
# Visit 2, part C (the same machine, right after B): llama.cpp's 16K prompt, S6b's --fit, the
# model resident on the GPU without limits (the GPU's compute: the physical limit's term), and
# S4 with llama.cpp's --fit.
R=$OUT
cd "$(dirname "$0")"
./cuda-smoke build 90 > $R/build.txt 2>&1 || exit 1
eval "$(./cuda-smoke env)"
c="HYPURA=bin/hypura THREADS=16 RUN_TIMEOUT=90"
env $c SKIP_HYPURA=1 OUT=$R/p16384 PEERS=n-cpu-moe:26 N_CPU_MOE=26 CONTEXT=17408 PROMPT_TOKENS=16384 \
  HYPURA_ARGS="--gpu-budget 8GiB" scripts/bench-limited /tmp/q36s8.gguf 0.5701 16 1 > $R/p16384.txt 2>&1
env $c SKIP_HYPURA=1 OUT=$R/s6b PEERS=fit CONTEXT=1024 HYPURA_ARGS="--gpu-budget 12GiB" \
  scripts/bench-limited /tmp/q36s8.gguf 1.2474 128 1 > $R/s6b.txt 2>&1
bin/hypura bench /tmp/q36s8.gguf --no-baseline --mode resident --no-repack --no-mmap -p 16 -n 128 -r 1 -t 16 \
  --context 1024 > $R/resident.txt 2>&1
bin/hypura-forge moe-30b -o /tmp/m30.gguf > /dev/null 2>&1
env $c OUT=$R/s4 PEERS=fit SKIP_REFERENCE=1 CONTEXT=1024 HYPURA_ARGS="--gpu-budget 8GiB" \
  scripts/bench-limited /tmp/m30.gguf 0.3994 128 1 > $R/s4.txt 2>&1
cd $R && tar czf more.tgz p16384 s6b s4 && rm -rf p16384 s6b s4
