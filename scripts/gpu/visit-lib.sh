# The steps a GPU visit's script repeats, for a bundle from scripts/gpu/cuda-bundle (which copies
# this file to DIR/scripts/visit-lib.sh). A visit's script, copied to the bundle's top, starts:
#
#   cd "$(dirname "$0")" && . scripts/visit-lib.sh || exit 1
#   visit_forge qwen3.6-35b-a3b /tmp/q36.gguf     # in the background, beside the build
#   visit_setup || exit 1                         # ggml's CUDA library; waits for the forges
#   visit_mark "built and forged at $SECONDS s"
#   visit_case s6a /tmp/q36.gguf 0.5701 128 PEERS=fit HYPURA_ARGS="--gpu-budget 8GiB"
#   visit_archive
#
# Sourcing it sets cuda-smoke's environment (LD_LIBRARY_PATH, HYPURA_GGML_BACKEND_DIR,
# HYPURA_CACHE_DIR), exports OUT (the folder that comes back; default ./cuda-results, as
# cuda-smoke's) and restores lib/libggml-cuda.so from /tmp, where visit_setup keeps it between
# calls on one machine. Outputs go to $OUT; at most eight files come back from a call.
# Bash, sourced; the functions hold under `set -uo pipefail`.

if [ ! -x ./cuda-smoke ] || [ ! -x scripts/bench-limited ]; then
  echo "visit-lib.sh: source it from a bundle's top (scripts/gpu/cuda-bundle DIR; cd DIR)" >&2
  return 1
fi
export OUT=${OUT:-$PWD/cuda-results}
mkdir -p "$OUT"
eval "$(./cuda-smoke env)"
[ -f /tmp/libggml-cuda.so ] && cp /tmp/libggml-cuda.so lib/

# The environment every scripts/bench-limited call of a visit takes (a case's own VAR=VALUE
# words come after it and win).
VISIT_ENV=${VISIT_ENV:-"HYPURA=bin/hypura THREADS=16 RUN_TIMEOUT=100 SKIP_REFERENCE=1 CONTEXT=1024"}
_visit_forge_last=""
_visit_forges=()
_visit_cuda_return=

# visit_forge PRESET PATH [FORGE ARGS...]
#   `bin/hypura-forge PRESET -o PATH ARGS` in the background, its output appended to
#   $OUT/forge.log; nothing when PATH is there (forged by an earlier call on this machine). Forges
#   run one after another, in the order asked; visit_setup waits for them.
visit_forge() {
  local preset=$1 path=$2 before=$_visit_forge_last
  shift 2
  (
    # (an exited forge no shell has reaped yet counts as done)
    while [ -n "$before" ] && kill -0 "$before" 2>/dev/null &&
      ! grep -qs '^State:[[:space:]]*Z' "/proc/$before/status"; do sleep 1; done
    [ -f "$path" ] || bin/hypura-forge "$preset" -o "$path" "$@" >> "$OUT/forge.log" 2>&1
  ) &
  _visit_forge_last=$!
  _visit_forges+=("$! $preset $path")
}

# visit_setup [CUDA_ARCHITECTURES]
#   ggml's CUDA library: `./cuda-smoke build` (default 90; about 4 minutes, nothing when the
#   library was restored from /tmp) with its output in $OUT/build.txt, then kept in /tmp for the
#   next call; then waits for the forges (and any other background job), telling on stderr of a
#   forge that failed. A failed build prints its log's last lines and returns 1.
visit_setup() {
  if ! ./cuda-smoke build "${1:-90}" > "$OUT/build.txt" 2>&1; then
    tail -30 "$OUT/build.txt"
    return 1
  fi
  cp lib/libggml-cuda.so /tmp/
  local forge status
  for forge in "${_visit_forges[@]}"; do
    set -- $forge
    wait "$1"; status=$?
    [ $status -eq 0 ] || echo "visit_forge $2 -o $3: exit $status (see $OUT/forge.log)" >&2
  done
  _visit_forges=()
  # Any other background job, but not the watchdog (it ends at the deadline).
  local job
  for job in $(jobs -p); do [ "$job" = "${visit_watchdog:-}" ] || wait "$job"; done
  # A library built here (not restored) goes back compressed, in parts the call returns, so
  # that the next visit carries it instead of building (cuda-bundle --keep-cuda): compressed
  # at the lowest priority beside the runs; visit_archive waits for it.
  if grep -q "built in" "$OUT/build.txt"; then
    visit_return_cuda "${1:-90}" >> "$OUT/build.txt" 2>&1 &
    _visit_cuda_return=$!
  fi
}

# visit_return_cuda CUDA_ARCHITECTURES
#   lib/libggml-cuda.so xz-compressed into ${VISIT_RETURN:-$OUT}/libggml-cuda-smARCH.so.xz.NN,
#   parts of 15 MiB (a returned file holds at most 16), which visit_archive leaves out of its
#   archive: at most three of the call's eight returned files (64 MiB together). Over 45 MiB
#   compressed it stays here (a bundle carries it beside its binaries packed, within 64 MiB
#   with the repository's files: sm_90 compressed to 37 MiB on 2026-12-07).
visit_return_cuda() {
  nice -n 19 python3 - "$1" "${VISIT_RETURN:-$OUT}" <<'PY'
import lzma, os, sys
arch, into = sys.argv[1], sys.argv[2]
data = lzma.compress(open("lib/libggml-cuda.so", "rb").read(), preset=6)
if len(data) > 45 << 20:
    print(f"libggml-cuda.so not returned: {len(data) >> 20} MiB compressed, over 45")
    sys.exit(0)
part = 15 << 20
for index in range(0, len(data), part):
    with open(f"{into}/libggml-cuda-sm{arch}.so.xz.{index // part:02d}.part", "wb") as out:
        out.write(data[index:index + part])
for index in range(0, len(data), part):
    name = f"{into}/libggml-cuda-sm{arch}.so.xz.{index // part:02d}"
    os.rename(name + ".part", name)
print(f"libggml-cuda.so returned: {len(data) >> 20} MiB compressed")
PY
}

# visit_wait_cuda
#   Wait for visit_return_cuda's parts, if a build started it (before the call's files go back).
visit_wait_cuda() {
  [ -n "${_visit_cuda_return:-}" ] && wait "$_visit_cuda_return" 2>/dev/null
  _visit_cuda_return=
  return 0
}

# visit_write_outside DIR
#   Outputs go to DIR from here on, outside the folder that comes back (VISIT_RETURN, which
#   visit_snapshot archives them into and visit_return_cuda writes to).
visit_write_outside() {
  export VISIT_RETURN=$OUT OUT=$1
  mkdir -p "$OUT"
}

# visit_begin DIR PRESET GGUF
#   The start of a visit that writes outside the returned folder and stops its runs at
#   ${DEADLINE:-560} s: outputs to DIR (visit_write_outside), the watchdog, the machine's CPU and
#   clocks (lscpu.txt, gpu.txt), PRESET forged to GGUF beside ggml's CUDA build (visit_setup),
#   "built and forged at S s" in time.log. Returns 1 (after a snapshot) where the build failed.
visit_begin() {
  visit_write_outside "$1"
  visit_watchdog "${DEADLINE:-560}"
  lscpu > "$OUT/lscpu.txt" 2>&1
  nvidia-smi -q -d CLOCK,POWER > "$OUT/gpu.txt" 2>&1
  visit_forge "$2" "$3"
  visit_setup 90 || { visit_snapshot; return 1; }
  visit_mark "built and forged at $SECONDS s"
}

# visit_snapshot
#   For a visit that writes outside the returned folder (visit_write_outside): everything in
#   $OUT so far into $VISIT_RETURN/results.tgz, replaced whole, so a call cut off at any time
#   brings back what the steps before it finished.
visit_snapshot() {
  tar czf "$VISIT_RETURN/results.tgz.part" -C "$OUT" . && mv "$VISIT_RETURN/results.tgz.part" "$VISIT_RETURN/results.tgz"
}

# visit_watchdog DEADLINE
#   In the background: at DEADLINE seconds the runs are stopped (bench-limited, hypura and
#   llama.cpp's tools; killed 5 s later), and time.log says so. visit_fits SECONDS tells whether
#   a step of about that long still ends before it; kill "$visit_watchdog" once the steps are done.
visit_watchdog() {
  _visit_deadline=$1
  (
    sleep "$1"
    echo "deadline: runs stopped at $1 s" >> "$OUT/time.log"
    pkill -f scripts/bench-limited; pkill -f bin/hypura; pkill -f llama-
    sleep 5
    pkill -9 -f bin/hypura; pkill -9 -f llama-
  ) &
  visit_watchdog=$!
}
visit_fits() {
  [ $((SECONDS + $1)) -lt "${_visit_deadline:-560}" ]
}

# visit_mark TEXT
#   One line in $OUT/time.log (e.g. visit_mark "built $SECONDS").
visit_mark() {
  echo "$*" >> "$OUT/time.log"
}

# visit_resident GGUF N_GEN [FILE]
#   The model resident on the GPU (every weight loaded before the clock starts), tg N_GEN after a
#   16-token prompt, in $OUT/FILE (default resident.txt): the device's time, which a pooled
#   decode's limit and the plan's predictions take from the model's record.
visit_resident() {
  bin/hypura bench "$1" --no-baseline --mode resident --no-repack --no-mmap -p 16 -n "$2" -r 1 -t 16 \
    --context 1024 > "$OUT/${3:-resident.txt}" 2>&1
}

# visit_setup_resident PRESET GGUF N_GEN [FORGE ARGS...]
#   The common start of a visit of one model: PRESET forged to GGUF beside ggml's CUDA build,
#   "built and forged at S s" in $OUT/forge.log, then the model resident on the GPU
#   (visit_resident, tg N_GEN). Returns 1 where the build failed.
visit_setup_resident() {
  local preset=$1 gguf=$2 n_gen=$3
  shift 3
  visit_forge "$preset" "$gguf" "$@"
  visit_setup 90 || return 1
  echo "built and forged at $SECONDS s" >> "$OUT/forge.log"
  visit_resident "$gguf" "$n_gen"
}

# visit_inspect GGUF GPU_BUDGET HOST_BUDGET
#   The plan at those budgets (context 1024) appended to $OUT/inspect.txt: a line
#   "== gpu GPU_BUDGET host HOST_BUDGET ctx 1024", then `bin/hypura inspect`'s plan, gpu, expert
#   pool and predict lines.
visit_inspect() {
  echo "== gpu $2 host $3 ctx 1024" >> "$OUT/inspect.txt"
  bin/hypura inspect "$1" --gpu-budget "$2" --memory-budget "$3" --context 1024 2>/dev/null \
    | grep -E "^(plan|gpu|expert pool|predict)" >> "$OUT/inspect.txt"
}

# visit_bench NAME GGUF FRACTION N_GEN [VAR=VALUE...]
#   One scripts/bench-limited run (one repetition), cold under the memory cgroup: the environment
#   $VISIT_ENV, OUT=$OUT/NAME, then the VAR=VALUEs (PEERS, HYPURA_ARGS, a RUN_TIMEOUT or an OUT
#   of their own...); its summary in $OUT/NAME.txt. Returns bench-limited's status.
visit_bench() {
  local name=$1 gguf=$2 fraction=$3 n_gen=$4
  shift 4
  # shellcheck disable=SC2086 # VISIT_ENV is words
  env $VISIT_ENV OUT="$OUT/$name" "$@" scripts/bench-limited "$gguf" "$fraction" "$n_gen" 1 > "$OUT/$name.txt" 2>&1
}

# visit_case NAME GGUF FRACTION N_GEN [VAR=VALUE...]
#   visit_bench, then "NAME at S s" in $OUT/time.log. Returns bench-limited's status.
visit_case() {
  local status
  visit_bench "$@"; status=$?
  visit_mark "$1 at $SECONDS s"
  return $status
}

# visit_archive [NAME...]
#   With no NAME: everything in $OUT but results.tgz, time.log and a returned CUDA library's
#   parts into $OUT/results.tgz, then removed (the call brings back two files and the parts). With NAMEs (patterns in $OUT, quoted: 's6*'): those
#   there into results.tgz, then the folders among them removed (a named file stays beside it).
visit_archive() {
  visit_wait_cuda
  (
    cd "$OUT" || exit 1
    if [ $# -eq 0 ]; then
      tar czf results.tgz --exclude=results.tgz --exclude=time.log --exclude='libggml-cuda-*.so.xz.*' . &&
        find . -mindepth 1 -maxdepth 1 ! -name results.tgz ! -name time.log ! -name 'libggml-cuda-*.so.xz.*' \
          -exec rm -rf {} +
      exit
    fi
    local names=() name
    # shellcheck disable=SC2068 # the patterns expand here, in $OUT
    for name in $@; do [ -e "$name" ] && names+=("$name"); done
    [ ${#names[@]} -gt 0 ] || exit 0
    tar czf results.tgz "${names[@]}" || exit
    for name in "${names[@]}"; do [ -d "$name" ] && rm -rf "$name"; done
    exit 0
  )
}
