#!/usr/bin/env bash
# One call on a fresh machine: build with the S6 model forged beside it; the model resident on the
# GPU (recorded); S6b a first time (no routing recorded: every MoE layer pooled), the plans, S6b a
# second time (whole MoE layers beside the pool) with llama.cpp's --fit after it; S6a tg128 beside
# llama.cpp's --n-cpu-moe 26; then tiny presets pooled against resident, as time allows, each at
# the first budget (scanned) where a pool forms and then where a layer goes whole beside it.
. "$(dirname "$0")/vsetup.sh"
common="HYPURA=bin/hypura THREADS=16 RUN_TIMEOUT=100 SKIP_REFERENCE=1 CONTEXT=1024"
env $common OUT=$R/s6b-1 PEERS=0 HYPURA_ARGS="--gpu-budget 12GiB" \
  scripts/bench-limited /tmp/q36s8.gguf 1.2474 128 1 > $R/s6b-1.txt 2>&1
for budget in "8GiB 10GiB" "12GiB 22GiB"; do
  set -- $budget
  echo "== gpu $1 host $2 ctx 1024 (routing recorded)" >> $R/inspect.txt
  bin/hypura inspect /tmp/q36s8.gguf --gpu-budget $1 --memory-budget $2 --context 1024 2>/dev/null | grep -E "^(plan|memory|gpu|expert pool|batch|predict)" >> $R/inspect.txt
done
env $common OUT=$R/s6b-2 PEERS=fit HYPURA_ARGS="--gpu-budget 12GiB" \
  scripts/bench-limited /tmp/q36s8.gguf 1.2474 128 1 > $R/s6b-2.txt 2>&1
[ $SECONDS -lt 420 ] && env $common OUT=$R/s6a PEERS=n-cpu-moe:26 N_CPU_MOE=26 HYPURA_ARGS="--gpu-budget 8GiB" \
  scripts/bench-limited /tmp/q36s8.gguf 0.5701 128 1 > $R/s6a.txt 2>&1
prompt="The history of the lighthouse begins with fires lit on hills to guide ships home, and over the centuries keepers, lenses and lamps changed how far the light could reach across the sea"
for p in tiny-qwen35moe tiny-moe-30b tiny-deepseek2 tiny-gpt-oss; do
  [ $SECONDS -lt 540 ] || break
  bin/hypura-forge $p -o /tmp/$p.gguf > /dev/null 2>&1
  run() { bin/hypura run /tmp/$p.gguf --raw -p "$prompt" -n 32 --temperature 0 --context 512 "$@"; }
  pool() { bin/hypura inspect /tmp/$p.gguf --gpu-experts pool --gpu-budget ${1}MiB --memory-budget 48MiB --context 512 2>/dev/null | grep "^expert pool"; }
  run --gpu-budget 100GiB --no-repack > $R/$p-resident.txt 2> /dev/null
  for pass in 1 2; do
    want="slots"; [ $pass = 2 ] && want="whole on the GPU instead"
    mib=""
    for m in $(seq 380 6 560); do pool $m | grep -q "$want" && { mib=$m; break; }; done
    [ -n "$mib" ] || { echo "$p pass $pass: no budget from 380 to 560 MiB gave '$want'"; continue; }
    line=$(pool $mib)
    run --gpu-experts pool --gpu-budget ${mib}MiB --memory-budget 48MiB --stats > $R/$p-pool$pass.txt 2> $R/$p-pool$pass.log
    cmp -s $R/$p-pool$pass.txt $R/$p-resident.txt && verdict="same 32 tokens" || verdict=DIFFERS
    echo "$p pass $pass, ${mib} MiB: ${line:0:48} $(echo "$line" | grep -o '[0-9]* MoE layers\? whole'); $verdict; $(grep -o 'gpu experts[^|]*' $R/$p-pool$pass.log | head -1)"
  done
done | tee $R/agree.txt
cd $R && tar czf v3.tgz s6b-1 s6b-2 s6a tiny-* 2>/dev/null && rm -rf s6b-1 s6b-2 s6a tiny-*
