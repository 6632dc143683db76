#!/bin/sh
# PyTorch's request sequence from the CPU, replayed on fsdp's caching-allocator model: two steps of
# PyTorch FSDP2 on one CPU rank (llama-100m, 1 x 512, eager, bf16) recorded by
# tools/torch_reference.py --memory-history (torch.profiler's allocation events), replayed by
# build/bench/allocator_replay, beside fsdp-plan's replay of the same configuration. Checks that
# the recording holds PyTorch's requests (every free matched, the allocated peak within 2% of
# fsdp-plan's, which FSDPMemTracker confirms to 0.02% in bench/torch_memory_check.sh) and prints
# both reserved peaks: the CPU's kernels and single stream are not CUDA's, so the reserved
# figures are compared in docs/accuracy.md, not asserted. Exit 77 without torch.
#   tools/cpu_alloc_history_check.sh BUILD_DIR
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
python=${FSDPKIT_PYTHON:-python3}
"$python" -c "import torch, transformers" 2> /dev/null || { echo "cpu_alloc_history_check: $python has no torch/transformers"; exit 77; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
flags="--model $root/models/llama-100m.json --framework fsdp2 --strategy FULL_SHARD --micro-batch 1 --seq-len 512 --attention eager --param-dtype bf16 --reduce-dtype fp32"
FSDPKIT_DATA_DIR=$root "$python" "$root/tools/torch_reference.py" --device cpu $flags --steps 2 --warmup 0 --no-tracker \
  --memory-history "$out/history.json" --out "$out/run.json" > "$out/run.log" 2>&1 || { tail -5 "$out/run.log"; exit 1; }
"$build/bench/allocator_replay" "$out/history.json" > "$out/replay.txt"
"$build/fsdp-plan" $flags --gpu h200-sxm --gpus 1 --gpus-per-node 1 --cublas-workspace-bytes 0 --json > "$out/plan.json"
python3 - "$out/replay.txt" "$out/plan.json" <<'PY'
import json, re, sys
replay = open(sys.argv[1]).read()
plan = json.load(open(sys.argv[2]))["memory"]["per_gpu"]
number = lambda key: int(re.search(key + r" (\d+)", replay).group(1))
unknown = int(re.search(r"made before the recording (\d+)", replay).group(1))
allocated, reserved = number("allocated_peak_bytes"), number("reserved_peak_bytes")
error = 100 * (plan["allocated_peak_bytes"] - allocated) / allocated
print(f"PyTorch's CPU requests replayed: allocated {allocated} reserved {reserved}; fsdp-plan allocated "
      f"{plan['allocated_peak_bytes']} ({error:+.2f}%) reserved {plan['reserved_peak_bytes']} "
      f"({100 * (plan['reserved_peak_bytes'] - reserved) / reserved:+.1f}%)")
if unknown:
    sys.exit(f"cpu_alloc_history_check: {unknown} frees of storages the recording never saw")
if abs(error) > 2:
    sys.exit(f"cpu_alloc_history_check: allocated peaks differ by {error:+.2f}% (limit 2%)")
PY
