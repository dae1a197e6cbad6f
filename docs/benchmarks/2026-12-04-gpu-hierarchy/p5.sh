#!/usr/bin/env bash
# Part 5: whole layers' agreement with llama.cpp's same placement, fusion on and off, across
# GPU budgets (deepseek4, glm5-next); then S6b: Hypura's default, the pool, --fit, --n-cpu-moe 17.
R=$OUT
cd "$(dirname "$0")"
./cuda-smoke build 90 || exit 1
eval "$(./cuda-smoke env)"
( bin/hypura-forge qwen3.6-35b-a3b --router-skew 8 -o /tmp/q36s8.gguf > $R/forge.log 2>&1 ) &
mkdir -p $R/check
for p in tiny-deepseek4 tiny-glm5-next; do
  bin/hypura-forge $p -o /tmp/$p.gguf > /dev/null 2>&1
  for fusion in 0 1; do
    for mib in 430 460 100000; do
      GGML_CUDA_DISABLE_FUSION=$fusion OUT=$R/check ./cuda-smoke check /tmp/$p.gguf --gpu-experts layers --gpu-budget ${mib}MiB --memory-budget 48MiB --context 512 > $R/check/$p-$fusion-$mib.txt 2>&1
      echo "$p fusion-off=$fusion gpu ${mib}MiB: $(grep -E '^gpu ' $R/check/$p-$fusion-$mib.txt | cut -c1-120) | $(grep -o 'llama.cpp placement.*' $R/check/$p-$fusion-$mib.txt | cut -c1-60) | $(grep -o 'identical to llama.cpp: [a-z]*' $R/check/$p-$fusion-$mib.txt)"
    done
  done
done | tee $R/check.txt
wait
OUT=$R/s6b HYPURA=bin/hypura PEERS=fit SKIP_REFERENCE=1 THREADS=16 CONTEXT=1024 RUN_TIMEOUT=80 \
  HYPURA_ARGS="--gpu-budget 12GiB" HYPURA_B_ARGS="--gpu-experts pool" scripts/bench-limited /tmp/q36s8.gguf 1.2474 128 1 > $R/s6b.txt 2>&1
OUT=$R/s6b HYPURA=bin/hypura PEERS=n-cpu-moe:17 N_CPU_MOE=17 SKIP_HYPURA=1 THREADS=16 CONTEXT=1024 RUN_TIMEOUT=80 \
  HYPURA_ARGS="--gpu-budget 12GiB" scripts/bench-limited /tmp/q36s8.gguf 1.2474 128 1 >> $R/s6b.txt 2>&1
cd $R && tar czf p5.tgz check check.txt s6b && rm -rf check s6b
