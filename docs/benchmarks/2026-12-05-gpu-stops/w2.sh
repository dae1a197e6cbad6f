#!/usr/bin/env bash
# One call on a fresh machine: the router's ids written in the GPU's own queue (bin/hypura)
# against waiting for each copy (bin/hypura-a, the commit before, carried beside it). Build with
# the S6 model forged beside it, the model resident on the GPU (recorded); tiny-moe-30b pooled
# against resident (the same greedy tokens?); S6a tg128 cold, A B B A; S6b with bin/hypura.
# At most 8 files come back: build.log goes. The setup (the build, the forge, the time lines in
# forge.log) through the bundle's scripts/visit-lib.sh (scripts/gpu/visit-lib.sh).
cd "$(dirname "$0")" && . scripts/visit-lib.sh || exit 1
R=$OUT
visit_forge qwen3.6-35b-a3b /tmp/q36s8.gguf --router-skew 8
visit_setup 90 || exit 1
echo "built and forged at $SECONDS s" >> $R/forge.log
bin/hypura bench /tmp/q36s8.gguf --no-baseline --mode resident --no-repack --no-mmap -p 16 -n 128 -r 1 -t 16 \
  --context 1024 > $R/resident.txt 2>&1
tail -3 $R/build.txt >> $R/forge.log; rm -f $R/build.log $R/build.txt
prompt="The history of the lighthouse begins with fires lit on hills to guide ships home, and over the centuries keepers, lenses and lamps changed how far the light could reach across the sea"
p=tiny-moe-30b
bin/hypura-forge $p -o /tmp/$p.gguf > /dev/null 2>&1
run() { bin/hypura run /tmp/$p.gguf --raw -p "$prompt" -n 32 --temperature 0 --context 512 "$@"; }
pool() { bin/hypura inspect /tmp/$p.gguf --gpu-experts pool --gpu-budget ${1}MiB --memory-budget 48MiB --context 512 2>/dev/null | grep "^expert pool"; }
run --gpu-budget 100GiB --no-repack > $R/resident-tiny.txt 2> /dev/null
for m in $(seq 380 6 560); do pool $m | grep -q "slots" && { mib=$m; break; }; done
{
  echo "pool at ${mib} MiB: $(pool $mib)"
  for binary in hypura hypura-a; do
    bin/$binary run /tmp/$p.gguf --raw -p "$prompt" -n 32 --temperature 0 --context 512 --gpu-experts pool --gpu-budget ${mib}MiB --memory-budget 48MiB --stats > /tmp/pool-$binary.txt 2> /tmp/pool-$binary.log
    cmp -s /tmp/pool-$binary.txt $R/resident-tiny.txt && verdict="the same 32 tokens as resident" || verdict=DIFFERS
    echo "$binary: $verdict; $(grep -o 'gpu experts[^|]*' /tmp/pool-$binary.log | head -1)"
  done
} > $R/agree.txt 2>&1
rm -f $R/resident-tiny.txt
echo "agreement at $SECONDS s" >> $R/forge.log
# LIMIT: the call's seconds (a cold S6a run takes about 35 s, S6b about 45 s).
limit=${LIMIT:-560}
for side in a1 b1 b2 a2; do
  [ $side = b2 ] && [ $SECONDS -gt $((limit - 90)) ] && break
  binary=bin/hypura; case $side in a*) binary=bin/hypura-a;; esac
  visit_bench s6a-$side /tmp/q36s8.gguf 0.5701 128 HYPURA=$binary OUT=$R/s6a PEERS=0 HYPURA_ARGS="--gpu-budget 8GiB"
  echo "s6a $side at $SECONDS s" >> $R/forge.log
done
[ $SECONDS -lt $((limit - 60)) ] && visit_bench s6b /tmp/q36s8.gguf 1.2474 128 PEERS=0 HYPURA_ARGS="--gpu-budget 12GiB"
echo "done at $SECONDS s" >> $R/forge.log
rm -rf $R/s6a $R/s6b
