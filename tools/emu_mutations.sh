#!/usr/bin/env bash
# Does cuda-emu catch a missing synchronisation in the GPU engine? Removes one stream wait or
# record_stream-style release at a time from src/runtime/cuda/cuda_engine.cc (or reuses one pinned
# staging buffer without waiting, or adds a host wait per micro-batch), rebuilds cuda_emu_test in
# BUILD (default build) and runs its two training test cases; a row says whether they failed and
# the first report (a race, a pinned-memory fault, the host-wait check). The source file is
# restored after each mutation and on exit.
# Not part of CTest (about a minute per mutation on 2 cores); docs/cuda-emu.md quotes its output.
#   tools/emu_mutations.sh [BUILD [NAME...]]   (NAMEs: only those mutations)
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
src=src/runtime/cuda/cuda_engine.cc
saved=$(mktemp)
cp "$src" "$saved"
trap 'cp "$saved" "$src"; rm -f "$saved"' EXIT
log=$(mktemp)

only=("${@:2}")
mutate() {  # name, then pairs: a line as it is, what it becomes
  local name=$1
  shift
  if [ ${#only[@]} -gt 0 ] && [[ ! " ${only[*]} " == *" $name "* ]]; then return; fi
  python3 - "$src" "$@" <<'PY' || { echo "$name: line not found"; return; }
import sys
path, pairs = sys.argv[1], sys.argv[2:]
text = open(path).read()
for old, new in zip(pairs[::2], pairs[1::2]):
    if old not in text:
        sys.exit(1)
    text = text.replace(old, new, 1)
open(path, "w").write(text)
PY
  cmake --build "$build" -j2 --target cuda_emu_test > /dev/null 2>&1 || { echo "$name: build failed"; cp "$saved" "$src"; return; }
  FSDPKIT_DATA_DIR=$PWD timeout 900 "$build/src/runtime/cuda_emu_test" --abort-after=1 -tc="Training steps*,Gradient accumulation*" > "$log" 2>&1
  local code=$?
  local race
  race=$(grep -m1 -o -E "race: .* (wrote|read)|cuda-emu: the host wrote pinned memory|CHECK\( n (<=|==) 3 \) is NOT correct" "$log" | cut -c1-150)
  printf '%-16s %s  %s\n' "$name" "$([ $code -ne 0 ] && echo "caught" || echo "MISSED")" "${race:-nothing reported}"
  cp "$saved" "$src"
}

mutate reduce_wait "  FSDP_CUDA_TRY(cudaStreamWaitEvent(reduce_, ready.value(), 0));" ""
mutate gather_wait "  FSDP_CUDA_TRY(cudaStreamWaitEvent(compute_, gathered_[u], 0));" ""
mutate optimizer_wait "  FSDP_CUDA_TRY(cudaStreamWaitEvent(compute_, reduced_, 0));" ""
mutate grad_release "  full_grad_[u].Release({reduce_});" "  full_grad_[u].Release();"
mutate reshard_release "  full_[u].Release({compute_});" "  full_[u].Release();"
mutate params_ready "  FSDP_CUDA_TRY(cudaStreamWaitEvent(gather_, params_ready_, 0));" ""
mutate staging_reuse "  TokenStaging& slot = staging_[static_cast<size_t>(micro)];" "  TokenStaging& slot = staging_[0];" \
  "  FSDP_TRY(WaitEvent(slot.copied));" "  (void)0;"
mutate micro_batch_wait "  return 0.0f;  // no wait" "  FSDP_TRY(WaitStream(compute_));
  return 0.0f;  // no wait"
cp "$saved" "$src"
cmake --build "$build" -j2 --target cuda_emu_test > /dev/null 2>&1
rm -f "$log"
