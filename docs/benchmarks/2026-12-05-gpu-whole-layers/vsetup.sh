# Sourced by v3.sh and v4.sh on a fresh machine, through the bundle's scripts/visit-lib.sh: the
# CUDA library built with the S6 model forged beside it, then the model resident on the GPU
# (recorded: the pooled decode's limit and the plan's prediction take its time).
cd "$(dirname "$0")" && . scripts/visit-lib.sh || exit 1
visit_setup_resident qwen3.6-35b-a3b /tmp/q36s8.gguf 128 --router-skew 8 || exit 1
R=$OUT
