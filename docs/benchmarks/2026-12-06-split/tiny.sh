#!/usr/bin/env bash
# The least visit: ggml's CUDA library built while S6's model is forged, then one warm split run with its figures.
# The repeated steps come from the bundle's scripts/visit-lib.sh (scripts/gpu/visit-lib.sh).
cd "$(dirname "$0")" && . scripts/visit-lib.sh || exit 1; R=$OUT
visit_forge qwen3.6-35b-a3b /tmp/q36.gguf
visit_setup 90 || exit 1
visit_mark "built $SECONDS"; rm -f $R/build.log
timeout 60 bin/hypura run /tmp/q36.gguf --gpu-budget 8GiB --memory-budget 11GiB --gpu-experts split --raw --stats \
  -p "Write a story about the sea." -n 96 --temperature 0 --context 1024 > $R/split-run.txt 2>&1
visit_mark "split $SECONDS"
