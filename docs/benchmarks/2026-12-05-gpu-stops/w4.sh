#!/usr/bin/env bash
# The queued ids' agreement in a short visit (about 5 minutes): ggml's CUDA backend built without
# its FlashAttention kernels (about half the build; both sides run the same kernels), then the tiny
# MoE presets pooled against resident, as the 2026-12-03 pool-agreement visit did, until LIMIT
# seconds have passed (default 270).
set -uo pipefail
cd "$(dirname "$0")"
eval "$(./cuda-smoke env)"
limit=${LIMIT:-270}
# Each preset with the GPU budget and host budget (MiB) that gave about k + 1 slots a layer in
# the 2026-12-03 pool-agreement visit; the pool forms in a window a few MiB wide, so each is
# scanned around its budget.
table="tiny-moe-30b 435 48,tiny-qwen35moe 427 42,tiny-deepseek2 435 47,tiny-gpt-oss 436 50,tiny-glm4moe 435 47,tiny-llama4 428 42,tiny-minimax-m2 434 48,tiny-gemma4 431 43,tiny-kimi-k3 444 50,tiny-moe 434 48,tiny-moe-8x 434 48,tiny-qwen3next 427 42,tiny-deepseek4 439 47,tiny-glm5-next 437 47"
presets=$(echo "$table" | tr ',' '\n' | cut -d' ' -f1)
( for p in $presets; do bin/hypura-forge $p -o /tmp/$p.gguf > /dev/null 2>&1; done ) &
cmake -S ggml -B /tmp/g -G Ninja -DGGML_CUDA=ON -DGGML_BACKEND_DL=ON -DBUILD_SHARED_LIBS=ON \
  -DGGML_CPU=OFF -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF -DGGML_CUDA_FA=OFF \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release > /tmp/build.log 2>&1
cmake --build /tmp/g --target ggml-cuda -j"$(nproc)" >> /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
cp /tmp/g/bin/libggml-cuda.so lib/
wait
echo "built at $SECONDS s"
prompt="The history of the lighthouse begins with fires lit on hills to guide ships home, and over the centuries keepers, lenses and lamps changed how far the light could reach across the sea"
run() { bin/hypura run /tmp/$p.gguf --raw -p "$prompt" -n 32 --temperature 0 --context 512 "$@"; }
pool() { bin/hypura inspect /tmp/$p.gguf --gpu-experts pool --gpu-budget ${1}MiB --memory-budget ${host}MiB --context 512 2>/dev/null | grep "^expert pool" || true; }
while read -r p budget host <&3; do
  [ $SECONDS -gt $limit ] && { echo "stopped at $SECONDS s"; break; }
  experts=$(bin/hypura inspect /tmp/$p.gguf 2>/dev/null | grep -o "[0-9]* experts in" | head -1 | cut -d' ' -f1)
  chosen=""; line=""
  for mib in $budget $((budget + 1)) $((budget - 1)) $((budget + 2)) $((budget - 2)) $((budget + 4)) $((budget - 4)) $((budget + 8)); do
    line=$(pool $mib); slots=$(echo "$line" | grep -o "^expert pool  [0-9]*" | grep -o "[0-9]*$" || true)
    if [ -n "$slots" ] && [ "$slots" -lt "${experts:-0}" ]; then chosen=$mib; break; fi
  done
  [ -z "$chosen" ] && { echo "$p: no budget gave a pool"; continue; }
  run --gpu-experts pool --gpu-budget ${chosen}MiB --memory-budget ${host}MiB --stats > /tmp/$p-pool.txt 2> /tmp/$p-pool.log
  status=$?
  run --gpu-budget 100GiB --no-repack > /tmp/$p-resident.txt 2> /dev/null
  if [ $status -ne 0 ]; then verdict="pool run failed ($status)"; elif cmp -s /tmp/$p-pool.txt /tmp/$p-resident.txt; then verdict="same 32 tokens"; else verdict=DIFFERS; fi
  echo "$p: $experts experts, --gpu-budget ${chosen}MiB: ${line:0:40}; $verdict; $(grep -o 'gpu experts[^|]*' /tmp/$p-pool.log | head -1)"
done 3< <(echo "$table" | tr ',' '\n') | tee $OUT/agree.txt
tail -3 /tmp/tiny-moe-30b-pool.log > $OUT/tiny-moe-30b-pool-stats.txt 2>/dev/null
