# Sourced by v3.sh and v4.sh on a fresh machine: the CUDA library built with the S6 model forged
# beside it, then the model resident on the GPU (recorded: the pooled decode's limit and the
# plan's prediction take its time).
R=$OUT
cd "$(dirname "$0")"
eval "$(./cuda-smoke env)"
( bin/hypura-forge qwen3.6-35b-a3b --router-skew 8 -o /tmp/q36s8.gguf > $R/forge.log 2>&1; echo "forged $?" >> $R/forge.log ) &
./cuda-smoke build 90 > $R/build.txt 2>&1 || { tail -30 $R/build.txt; exit 1; }
wait
echo "built and forged at $SECONDS s" >> $R/forge.log
bin/hypura bench /tmp/q36s8.gguf --no-baseline --mode resident --no-repack --no-mmap -p 16 -n 128 -r 1 -t 16 \
  --context 1024 > $R/resident.txt 2>&1
