#!/usr/bin/env bash
# w2.sh for a short visit (under 6 minutes): no resident run (S6a's limit then takes this run's
# GPU side), and S6a with the ids queued (bin/hypura) before waiting for them (bin/hypura-a).
R=$OUT
cd "$(dirname "$0")"
eval "$(./cuda-smoke env)"
( bin/hypura-forge qwen3.6-35b-a3b --router-skew 8 -o /tmp/q36s8.gguf > $R/forge.log 2>&1; echo "forged $?" >> $R/forge.log ) &
./cuda-smoke build 90 > $R/build.txt 2>&1 || { tail -30 $R/build.txt; exit 1; }
wait
echo "built and forged at $SECONDS s" >> $R/forge.log
rm -f $R/build.log $R/build.txt
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
common="THREADS=16 RUN_TIMEOUT=100 SKIP_REFERENCE=1 CONTEXT=1024"
# LIMIT: the call's seconds (a cold S6a run takes about 35 s, S6b about 45 s).
limit=${LIMIT:-560}
for side in b1 a1 a2 b2; do
  [ $side != b1 ] && [ $SECONDS -gt $((limit - 45)) ] && break
  [ $side = a2 ] && [ $SECONDS -gt $((limit - 90)) ] && break
  binary=bin/hypura; case $side in a*) binary=bin/hypura-a;; esac
  env $common HYPURA=$binary OUT=$R/s6a PEERS=0 HYPURA_ARGS="--gpu-budget 8GiB" \
    scripts/bench-limited /tmp/q36s8.gguf 0.5701 128 1 > $R/s6a-$side.txt 2>&1
  echo "s6a $side at $SECONDS s" >> $R/forge.log
done
[ $SECONDS -lt $((limit - 60)) ] && env $common HYPURA=bin/hypura OUT=$R/s6b PEERS=0 HYPURA_ARGS="--gpu-budget 12GiB" \
  scripts/bench-limited /tmp/q36s8.gguf 1.2474 128 1 > $R/s6b.txt 2>&1
echo "done at $SECONDS s" >> $R/forge.log
rm -rf $R/s6a $R/s6b
