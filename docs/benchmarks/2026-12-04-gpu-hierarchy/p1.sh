#!/usr/bin/env bash
# Part 1: build; every tiny MoE preset pooled against resident with CUDA's fusion ON; the
# whole-layer placement against llama.cpp's same placement with fusion on; q36s8 forged behind.
R=$OUT
cd "$(dirname "$0")"
./cuda-smoke build 90 || exit 1
eval "$(./cuda-smoke env)"
( bin/hypura-forge qwen3.6-35b-a3b --router-skew 8 -o /tmp/q36s8.gguf > $R/forge.log 2>&1; echo "forged $?" >> $R/forge.log ) &
# The agreement loop of the 2026-12-03 pool-agreement visit, unchanged, in a shell of its own
# (its settings, OUT=$R): every tiny MoE preset pooled against the same model resident on the GPU.
(
set -uo pipefail
OUT=$R
./cuda-smoke build 90 || exit 1
export LD_LIBRARY_PATH=$PWD/lib HYPURA_GGML_BACKEND_DIR=$PWD/lib HYPURA_CACHE_DIR=/tmp/hc
mkdir -p $OUT/agree
prompt="The history of the lighthouse begins with fires lit on hills to guide ships home, and over the centuries keepers, lenses and lamps changed how far the light could reach across the sea"
while read -r p budget host <&3; do
  bin/hypura-forge $p -o /tmp/$p.gguf > /dev/null 2>&1 || { echo "$p: forge failed"; continue; }
  experts=$(bin/hypura inspect /tmp/$p.gguf 2>/dev/null | grep -o "[0-9]* experts in" | head -1 | cut -d' ' -f1)
  chosen=""; line=""
  for mib in $budget $((budget + 1)) $((budget + 2)) $((budget + 4)) $((budget - 2)); do
    line=$(bin/hypura inspect /tmp/$p.gguf --gpu-experts pool --gpu-budget ${mib}MiB --memory-budget ${host}MiB --context 512 2>/dev/null | grep "^expert pool" || true)
    slots=$(echo "$line" | grep -o "^expert pool  [0-9]*" | grep -o "[0-9]*$" || true)
    if [ -n "$slots" ] && [ "$slots" -lt "${experts:-0}" ]; then chosen=$mib; break; fi
  done
  if [ -z "$chosen" ]; then echo "$p ($experts experts): no budget gave a pool"; bin/hypura inspect /tmp/$p.gguf --gpu-experts pool --gpu-budget ${budget}MiB --memory-budget ${host}MiB --context 512 > $OUT/agree/$p-inspect.txt 2>&1; continue; fi
  bin/hypura run /tmp/$p.gguf --raw -p "$prompt" -n 32 --temperature 0 --context 512 --gpu-experts pool --gpu-budget ${chosen}MiB --memory-budget ${host}MiB --stats > $OUT/agree/$p-pool.txt 2> $OUT/agree/$p-pool.log
  pool_status=$?
  bin/hypura run /tmp/$p.gguf --raw -p "$prompt" -n 32 --temperature 0 --context 512 --gpu-budget 100GiB --no-repack > $OUT/agree/$p-resident.txt 2> $OUT/agree/$p-resident.log
  gpu=$(grep -o "gpu experts[^|]*" $OUT/agree/$p-pool.log | head -1)
  if [ $pool_status -ne 0 ]; then verdict="pool run failed ($pool_status)"; elif cmp -s $OUT/agree/$p-pool.txt $OUT/agree/$p-resident.txt; then verdict="same 32 tokens"; else verdict="DIFFERS"; fi
  echo "$p: $experts experts, --gpu-budget ${chosen}MiB: ${line:0:40}; $verdict; $gpu"
done 3<<'TABLE' | tee $OUT/agree.txt
tiny-moe 434 48
tiny-moe-8x 434 48
tiny-moe-30b 435 48
tiny-qwen35moe 427 42
tiny-qwen3next 427 42
tiny-deepseek2 435 47
tiny-deepseek4 439 47
tiny-glm4moe 435 47
tiny-glm5-next 437 47
tiny-kimi-k3 444 50
tiny-llama4 428 42
tiny-minimax-m2 434 48
tiny-gemma4 431 43
tiny-gpt-oss 436 50
TABLE
cd $OUT && tar czf /tmp/all.tgz . && mv /tmp/all.tgz $OUT/all.tgz
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
