#!/usr/bin/env bash
# The split's shortest visit: build, forge, a split run with its figures, then S6a's split beside llama.cpp's --fit.
cd "$(dirname "$0")"; R=$OUT
eval "$(./cuda-smoke env)"
( bin/hypura-forge qwen3.6-35b-a3b -o /tmp/q36.gguf > $R/forge.log 2>&1 ) &
./cuda-smoke build 90 > $R/build.txt 2>&1 || { tail -20 $R/build.txt; exit 1; }
wait; echo "built $SECONDS" >> $R/time.log
timeout 80 bin/hypura run /tmp/q36.gguf --gpu-budget 8GiB --gpu-experts split --raw --stats \
  -p "Write a story about the sea." -n 128 --temperature 0 --context 1024 > $R/routing-run.txt 2>&1
echo "recorded $SECONDS" >> $R/time.log
env HYPURA=bin/hypura THREADS=16 RUN_TIMEOUT=80 SKIP_REFERENCE=1 CONTEXT=1024 OUT=$R/s6a PEERS=fit \
  HYPURA_ARGS="--gpu-budget 8GiB --gpu-experts split" scripts/bench-limited /tmp/q36.gguf 0.5701 128 1 > $R/s6a.txt 2>&1
echo "s6a $SECONDS" >> $R/time.log
cd $R && tar czf results.tgz s6a && rm -rf s6a build.log
