#!/usr/bin/env bash
# Part 1: build; six tiny MoE presets (one of each routing shape) pooled against the same model
# resident on the GPU, twice: the second pass plans with the routing the first recorded, at the
# first budget (or a little more) where whole MoE layers go beside the pool. The S6 model is
# forged behind them, then runs resident on the GPU (recorded: a pooled decode's limit takes its
# time), and S6b runs a first time (no routing of the model recorded: every MoE layer pooled).
R=$OUT
cd "$(dirname "$0")"
./cuda-smoke build 90 > $R/build.txt 2>&1 || { tail -30 $R/build.txt; exit 1; }
eval "$(./cuda-smoke env)"
( bin/hypura-forge qwen3.6-35b-a3b --router-skew 8 -o /tmp/q36s8.gguf > $R/forge.log 2>&1; echo "forged $?" >> $R/forge.log ) &
mkdir -p $R/agree
prompt="The history of the lighthouse begins with fires lit on hills to guide ships home, and over the centuries keepers, lenses and lamps changed how far the light could reach across the sea"
pool_line() { bin/hypura inspect /tmp/$1.gguf --gpu-experts pool --gpu-budget ${2}MiB --memory-budget ${3}MiB --context 512 2>/dev/null | grep "^expert pool" || true; }
while read -r p budget host <&3; do
  bin/hypura-forge $p -o /tmp/$p.gguf > /dev/null 2>&1 || { echo "$p: forge failed"; continue; }
  experts=$(bin/hypura inspect /tmp/$p.gguf 2>/dev/null | grep -o "[0-9]* experts in" | head -1 | cut -d' ' -f1)
  chosen=""
  for mib in $budget $((budget + 1)) $((budget + 2)) $((budget + 4)) $((budget - 2)); do
    slots=$(pool_line $p $mib $host | grep -o "^expert pool  [0-9]*" | grep -o "[0-9]*$" || true)
    if [ -n "$slots" ] && [ "$slots" -lt "${experts:-0}" ]; then chosen=$mib; break; fi
  done
  [ -n "$chosen" ] || { echo "$p ($experts experts): no budget gave a pool"; continue; }
  bin/hypura run /tmp/$p.gguf --raw -p "$prompt" -n 32 --temperature 0 --context 512 --gpu-budget 100GiB --no-repack > $R/agree/$p-resident.txt 2> $R/agree/$p-resident.log
  for pass in 1 2; do
    mib=$chosen
    if [ $pass = 2 ]; then
      mib=""
      for extra in 0 4 16 64; do
        pool_line $p $((chosen + extra)) $host | grep -q "whole on the GPU instead" && { mib=$((chosen + extra)); break; }
      done
      [ -n "$mib" ] || { echo "$p pass 2: no budget up to +64 MiB put a layer whole beside the pool"; continue; }
    fi
    line=$(pool_line $p $mib $host)
    bin/hypura run /tmp/$p.gguf --raw -p "$prompt" -n 32 --temperature 0 --context 512 --gpu-experts pool --gpu-budget ${mib}MiB --memory-budget ${host}MiB --stats > $R/agree/$p-pool$pass.txt 2> $R/agree/$p-pool$pass.log
    status=$?
    gpu=$(grep -o "gpu experts[^|]*" $R/agree/$p-pool$pass.log | head -1)
    if [ $status -ne 0 ]; then verdict="pool run failed ($status)"; elif cmp -s $R/agree/$p-pool$pass.txt $R/agree/$p-resident.txt; then verdict="same 32 tokens"; else verdict="DIFFERS"; fi
    whole=$(echo "$line" | grep -o "; [0-9]* MoE layers\? whole" || true)
    echo "$p pass $pass: $experts experts, --gpu-budget ${mib}MiB: ${line:0:40}${whole}; $verdict; $gpu"
  done
done 3<<'TABLE' | tee $R/agree.txt
tiny-moe-30b 435 48
tiny-qwen35moe 427 42
tiny-deepseek2 435 47
tiny-glm4moe 435 47
tiny-gpt-oss 436 50
tiny-llama4 428 42
TABLE
wait
cat $R/forge.log
bin/hypura bench /tmp/q36s8.gguf --no-baseline --mode resident --no-repack --no-mmap -p 16 -n 128 -r 1 -t 16 \
  --context 1024 > $R/resident.txt 2>&1
OUT=$R/s6b-1 HYPURA=bin/hypura PEERS=0 SKIP_REFERENCE=1 THREADS=16 RUN_TIMEOUT=100 CONTEXT=1024 \
  HYPURA_ARGS="--gpu-budget 12GiB" scripts/bench-limited /tmp/q36s8.gguf 1.2474 128 1 > $R/s6b-1.txt 2>&1
cd $R && tar czf v1.tgz agree s6b-1 && rm -rf agree s6b-1
