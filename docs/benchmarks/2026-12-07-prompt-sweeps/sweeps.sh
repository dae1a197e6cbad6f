#!/usr/bin/env bash
# A long prompt in several batches through an expert cache that holds under half of the routed
# experts, with two builds of hypura (before and after the sweep eviction), each run twice
# alternating; the lines that matter go to stdout.
#
#   docs/benchmarks/2026-12-07-prompt-sweeps/sweeps.sh BEFORE_BINARY AFTER_BINARY [MODEL]
#
# MODEL (default /tmp/moe-small.gguf) is forged first where missing: a 16-layer, 128-expert
# Qwen3-MoE (1.91 GiB, real routing by default). The prompt: 750 seeded random common words (about 3,200 tokens),
# in the plan's batches of 1,024 at a 1200 MiB budget.
set -euo pipefail
before=${1:?usage: sweeps.sh BEFORE AFTER [MODEL]}
after=${2:?usage: sweeps.sh BEFORE AFTER [MODEL]}
model=${3:-/tmp/moe-small.gguf}
cd "$(dirname "$0")/../../.."
[ -f "$model" ] || target/release/hypura-forge moe-30b --n-embd 1024 --n-layer 16 --n-ff 512 -o "$model"
prompt=$(python3 -c "
import random
random.seed(7)
words = 'the of and to in a is that for it as was with be by on not he this are or his from at which but have an they you were her she there one all we their streaming expert memory disk layer token'.split()
print(' '.join(random.choice(words) for _ in range(750)))")
for round in 1 2; do
  for side in before after; do
    binary=$before; [ $side = after ] && binary=$after
    echo "== $side (round $round)"
    "$binary" run "$model" --memory-budget 1200MiB --raw --stats -p "$prompt" -n 4 --temperature 0 --context 4096 2>&1 |
      grep -E "^(experts  |load|experts|io)" | cut -c1-220
  done
done
