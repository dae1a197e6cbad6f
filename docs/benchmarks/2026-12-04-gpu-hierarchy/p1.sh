#!/usr/bin/env bash
# Part 1: build; every tiny MoE preset pooled against resident with CUDA's fusion ON; the
# whole-layer placement against llama.cpp's same placement with fusion on; q36s8 forged behind.
R=$OUT
cd "$(dirname "$0")"
./cuda-smoke build 90 || exit 1
eval "$(./cuda-smoke env)"
( bin/hypura-forge qwen3.6-35b-a3b --router-skew 8 -o /tmp/q36s8.gguf > $R/forge.log 2>&1; echo "forged $?" >> $R/forge.log ) &
# The agreement loop of the 2026-12-03 pool-agreement visit (the bundle's scripts/pool-agreement):
# every tiny MoE preset pooled against the same model resident on the GPU.
(
scripts/pool-agreement $R pool
) > $R/agree-stdout.txt 2>&1
export GGML_CUDA_DISABLE_FUSION=0
mkdir -p $R/check
for p in tiny-moe-30b tiny-deepseek4 tiny-glm4moe tiny-glm5-next tiny-qwen35moe; do
  OUT=$R/check ./cuda-smoke check /tmp/$p.gguf --gpu-experts layers --gpu-budget 430MiB --memory-budget 48MiB --context 512 > $R/check/$p.txt 2>&1
  echo "$p: $(grep -iE 'same|differ|agree|identical' $R/check/$p.txt | tail -2 | tr '\n' ' ')"
done | tee $R/check.txt
wait
cat $R/forge.log
cd $R && tar czf all.tgz agree agree.txt check forge.log && rm -rf agree check
