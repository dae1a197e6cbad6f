#!/usr/bin/env bash
# The split's shortest visit: build, forge, a split run with its figures, then S6a's split beside llama.cpp's --fit.
# The repeated steps come from the bundle's scripts/visit-lib.sh (scripts/gpu/visit-lib.sh).
cd "$(dirname "$0")" && . scripts/visit-lib.sh || exit 1; R=$OUT
visit_forge qwen3.6-35b-a3b /tmp/q36.gguf
visit_setup 90 || exit 1
visit_mark "built $SECONDS"
timeout 80 bin/hypura run /tmp/q36.gguf --gpu-budget 8GiB --gpu-experts split --raw --stats \
  -p "Write a story about the sea." -n 128 --temperature 0 --context 1024 > $R/routing-run.txt 2>&1
visit_mark "recorded $SECONDS"
visit_bench s6a /tmp/q36.gguf 0.5701 128 RUN_TIMEOUT=80 PEERS=fit HYPURA_ARGS="--gpu-budget 8GiB --gpu-experts split"
visit_mark "s6a $SECONDS"
visit_archive s6a && rm -f $R/build.log
