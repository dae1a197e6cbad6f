# Sourced by v3.sh and v4.sh on a fresh machine, through the bundle's scripts/visit-lib.sh: the
# CUDA library built with the S6 model forged beside it, then the model resident on the GPU
# (recorded: the pooled decode's limit and the plan's prediction take its time).
cd "$(dirname "$0")" && . scripts/visit-lib.sh || exit 1
visit_forge qwen3.6-35b-a3b /tmp/q36s8.gguf --router-skew 8
visit_setup 90 || exit 1
echo "built and forged at $SECONDS s" >> $OUT/forge.log
visit_resident /tmp/q36s8.gguf 128
R=$OUT
