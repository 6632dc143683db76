#!/usr/bin/env bash
# libFuzzer runs of every parser's harness (fuzz/, docs/fuzzing.md) in a clang build of its own.
#   tools/fuzz.sh build [DIR]             configure and build the harnesses (default DIR build-fuzz)
#   tools/fuzz.sh smoke [DIR] [SECONDS]   each harness for SECONDS (default 5) over its seed corpus: CTest's fuzz_smoke
#   tools/fuzz.sh long [DIR] [RUNS] [HARNESS...]
#                                         each harness (default: all) for RUNS executions (default 10000000), one
#                                         after another; logs in DIR/logs, the summary line of each printed at the
#                                         end. Two of these with different harnesses use both cores. Long runs keep
#                                         no allocation stacks (ASan's malloc_context_size=0, for speed): rerun a
#                                         reproducer alone for them
# Exit status non-zero when a harness finds a crash, a leak or a timeout (its reproducer is in DIR/artifacts).
set -euo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
mode=${1:-smoke}
DIR=${2:-$SRC/build-fuzz}
HARNESSES=(fuzz_model_config fuzz_hardware fuzz_sim_compare fuzz_safetensors fuzz_tokens fuzz_plan_flags fuzz_alloc_conf)

# Line tables only (file:line in the sanitizers' stacks, as OSS-Fuzz builds), not the full debug
# info: 6-11% less compile time than -O2 -g. -O2 stays: OSS-Fuzz's -O1 compiled faster still but its
# harnesses ran 19-69% fewer inputs in the same time (docs/fuzzing.md).
FUZZ_OPT_FLAGS="-O2 -gline-tables-only -DNDEBUG"

build() {
  command -v clang++ >/dev/null || { echo "fuzz.sh: clang++ not found (apt-get install clang)" >&2; exit 1; }
  if [ ! -f "$DIR/CMakeCache.txt" ]; then
    cmake -S "$SRC" -B "$DIR" -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$FUZZ_OPT_FLAGS" -DFSDP_FUZZ=ON -DFSDP_WITH_CUDA=OFF >"$DIR.configure.log" 2>&1 \
      || { cat "$DIR.configure.log" >&2; exit 1; }
  fi
  cmake --build "$DIR" -j2 >"$DIR.build.log" 2>&1 || { tail -30 "$DIR.build.log" >&2; exit 1; }
}

# Seed corpus of a harness: the catalog's and the tests' files of its kind (copied, libFuzzer adds to it).
seed() {
  local h=$1 corpus=$DIR/corpus/$1
  mkdir -p "$corpus"
  case $h in
    fuzz_model_config) cp "$SRC"/models/*.json "$SRC"/tests/cli/data/*.json "$corpus"/ 2>/dev/null || true
                       find "$SRC/tests/data/hf_configs" -name '*.json' -exec cp {} "$corpus"/ \; 2>/dev/null || true ;;
    fuzz_hardware) cp "$SRC"/hardware/*.json "$SRC"/hardware/clusters/*.json "$corpus"/ ;;
    fuzz_sim_compare) cp "$SRC"/fuzz/corpus/sim_compare/* "$corpus"/ ;;
    fuzz_safetensors) cp "$SRC"/tests/data/checkpoints/* "$corpus"/ ;;
    fuzz_tokens) cp "$SRC"/tests/cli/data/*tokens*.txt "$corpus"/ ;;
    fuzz_plan_flags) cp "$SRC"/fuzz/corpus/plan_flags/* "$corpus"/ ;;
    fuzz_alloc_conf) cp "$SRC"/fuzz/corpus/alloc_conf/* "$corpus"/ ;;
  esac
  echo "$corpus"
}

runs_of() { grep -o 'Done [0-9]* runs' "$DIR/logs/$1.log" | tail -1 | cut -d' ' -f2; }

run() {  # harness, extra libFuzzer flags...
  local h=$1; shift
  mkdir -p "$DIR/artifacts" "$DIR/logs"
  ASAN_OPTIONS=detect_leaks=1${ASAN_EXTRA:-} "$DIR/fuzz/$h" "$(seed "$h")" -artifact_prefix="$DIR/artifacts/$h-" -timeout=10 -rss_limit_mb=4096 \
    -max_len=65536 "$@" >"$DIR/logs/$h.log" 2>&1
}

case $mode in
  build) build ;;
  smoke)
    build
    seconds=${3:-5}
    status=0
    for h in "${HARNESSES[@]}"; do
      if run "$h" -max_total_time="$seconds" -seed=1; then echo "$h: ok, $(runs_of "$h") executions"
      else echo "$h: FAILED (log $DIR/logs/$h.log)"; tail -20 "$DIR/logs/$h.log"; status=1; fi
    done
    exit $status ;;
  long)
    build
    runs=${3:-10000000}
    selected=("${@:4}")
    [ ${#selected[@]} -eq 0 ] && selected=("${HARNESSES[@]}")
    export ASAN_EXTRA=:malloc_context_size=0
    status=0
    for h in "${selected[@]}"; do
      start=$(date +%s)
      if run "$h" -runs="$runs" -print_final_stats=1; then result=ok; else result=FAILED; status=1; fi
      echo "$h: $result, $(runs_of "$h") executions in $(( $(date +%s) - start )) s"
    done
    exit $status ;;
  *) echo "usage: tools/fuzz.sh build|smoke|long [DIR] [SECONDS|RUNS]" >&2; exit 2 ;;
esac
