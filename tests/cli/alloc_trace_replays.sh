#!/bin/sh
# fsdp-plan --alloc-trace writes its replay's requests; bench/allocator_replay replays the file to
# the plan's own reserved peak and cudaMalloc count, on the GPU's streams and on one:
#   alloc_trace_replays.sh PLAN ALLOCATOR_REPLAY
set -u
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
for flags in "--framework fsdp1" "--framework fsdp2 --alloc-conf expandable_segments:True" "--framework fsdp1 --one-stream"; do
  # shellcheck disable=SC2086
  "$1" --model llama-2-7b --gpus 8 --seq-len 2048 $flags --alloc-trace "$dir/trace.json" --json > "$dir/plan.json" || fail "fsdp-plan $flags: exit $?"
  conf=$(echo "$flags" | sed -n 's/.*--alloc-conf \([^ ]*\).*/\1/p')
  "$2" "$dir/trace.json" $conf > "$dir/replay.txt" || fail "allocator_replay $flags: exit $?"
  python3 - "$dir/plan.json" "$dir/replay.txt" "$flags" <<'PY' || exit 1
import json, sys
per_gpu = json.load(open(sys.argv[1]))["memory"]["per_gpu"]
replay = dict(line.split()[:2] for line in open(sys.argv[2]) if line.split())
planned = (per_gpu["reserved_peak_bytes"], per_gpu["allocator"]["device_allocs"])
replayed = (int(replay["reserved_peak_bytes"]), int(replay["device_allocs"]))
print(f"{sys.argv[3]}: fsdp-plan reserved {planned[0]} in {planned[1]} mallocs, its trace replayed {replayed[0]} in {replayed[1]}")
if planned != replayed:
    sys.exit("FAIL: the trace does not replay to the plan's reserve")
PY
done
echo "every trace replays to its plan's reserve"
