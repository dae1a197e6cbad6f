#!/usr/bin/env bash
# One call, for a visit too short for parts 1 and 2: build with the S6 model forged beside it;
# the model resident on the GPU (recorded: the plan's prediction and the pooled decode's limit
# take its time); S6b a first time (no routing of the model recorded: every MoE layer pooled), the plan, S6b a
# second time (whole MoE layers beside the pool) with llama.cpp's --fit after it; then two tiny
# presets pooled against resident with whole layers beside the pool, as time allows.
R=$OUT
cd "$(dirname "$0")"
eval "$(./cuda-smoke env)"
( bin/hypura-forge qwen3.6-35b-a3b --router-skew 8 -o /tmp/q36s8.gguf > $R/forge.log 2>&1; echo "forged $?" >> $R/forge.log ) &
./cuda-smoke build 90 > $R/build.txt 2>&1 || { tail -30 $R/build.txt; exit 1; }
wait
bin/hypura bench /tmp/q36s8.gguf --no-baseline --mode resident --no-repack --no-mmap -p 16 -n 128 -r 1 -t 16 \
  --context 1024 > $R/resident.txt 2>&1
common="HYPURA=bin/hypura THREADS=16 RUN_TIMEOUT=100 SKIP_REFERENCE=1 CONTEXT=1024"
env $common OUT=$R/s6b-1 PEERS=0 HYPURA_ARGS="--gpu-budget 12GiB" \
  scripts/bench-limited /tmp/q36s8.gguf 1.2474 128 1 > $R/s6b-1.txt 2>&1
bin/hypura inspect /tmp/q36s8.gguf --gpu-budget 12GiB --memory-budget 22GiB --context 1024 2>/dev/null | grep -E "^(plan|memory|gpu|expert pool|batch|predict)" > $R/inspect.txt
env $common OUT=$R/s6b-2 PEERS=fit HYPURA_ARGS="--gpu-budget 12GiB" \
  scripts/bench-limited /tmp/q36s8.gguf 1.2474 128 1 > $R/s6b-2.txt 2>&1
prompt="The history of the lighthouse begins with fires lit on hills to guide ships home, and over the centuries keepers, lenses and lamps changed how far the light could reach across the sea"
for p in tiny-moe-30b tiny-qwen35moe; do
  [ $SECONDS -lt 540 ] || break
  bin/hypura-forge $p -o /tmp/$p.gguf > /dev/null 2>&1
  run() { bin/hypura run /tmp/$p.gguf --raw -p "$prompt" -n 32 --temperature 0 --context 512 "$@"; }
  run --gpu-budget 100GiB --no-repack > $R/$p-resident.txt 2> /dev/null
  pool() { bin/hypura inspect /tmp/$p.gguf --gpu-experts pool --gpu-budget ${1}MiB --memory-budget 48MiB --context 512 2>/dev/null | grep "^expert pool"; }
  for pass in 1 2; do
    mib=435
    if [ $pass = 2 ]; then for mib in 435 451 467 499; do pool $mib | grep -q "whole on the GPU instead" && break; done; fi
    line=$(pool $mib)
    run --gpu-experts pool --gpu-budget ${mib}MiB --memory-budget 48MiB --stats > $R/$p-pool$pass.txt 2> $R/$p-pool$pass.log
    cmp -s $R/$p-pool$pass.txt $R/$p-resident.txt && verdict="same 32 tokens" || verdict=DIFFERS
    echo "$p pass $pass, ${mib} MiB: ${line:0:40} $(echo "$line" | grep -o '[0-9]* MoE layers\? whole'); $verdict; $(grep -o 'gpu experts[^|]*' $R/$p-pool$pass.log | head -1)"
  done
done | tee $R/agree.txt
cd $R && tar czf v0.tgz s6b-1 s6b-2 tiny-* && rm -rf s6b-1 s6b-2 tiny-*
