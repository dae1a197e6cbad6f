#!/usr/bin/env bash
# The least visit: ggml's CUDA library built while S6's model is forged, then one warm split run with its figures.
cd "$(dirname "$0")"; R=$OUT
eval "$(./cuda-smoke env)"
( bin/hypura-forge qwen3.6-35b-a3b -o /tmp/q36.gguf > $R/forge.log 2>&1 ) &
./cuda-smoke build 90 > $R/build.txt 2>&1 || { tail -20 $R/build.txt; exit 1; }
wait; echo "built $SECONDS" >> $R/time.log; rm -f $R/build.log
timeout 60 bin/hypura run /tmp/q36.gguf --gpu-budget 8GiB --memory-budget 11GiB --gpu-experts split --raw --stats \
  -p "Write a story about the sea." -n 96 --temperature 0 --context 1024 > $R/split-run.txt 2>&1
echo "split $SECONDS" >> $R/time.log
