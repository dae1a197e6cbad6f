#!/usr/bin/env bash
# Every tiny MoE preset on the GPU with the expert hierarchy on (--gpu-experts pool, the
# GPU budget for about k + 1 slots a layer, a host budget of two layers' experts: slots, the
# host cache and disk all serve), against the same model resident on the GPU: 32 greedy tokens
# each. The loop is the bundle's scripts/pool-agreement (scripts/gpu/ in the repository).
set -uo pipefail
cd carry
./cuda-smoke build 90 || exit 1
scripts/pool-agreement $OUT pool
cd $OUT && tar czf /tmp/all.tgz . && mv /tmp/all.tgz $OUT/all.tgz
