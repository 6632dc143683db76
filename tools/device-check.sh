#!/usr/bin/env bash
# fsdp-run's GPU checks in one go, for a machine with one NVIDIA GPU and the CUDA toolkit but no
# Debian packages (carry .device-deps, made by tools/prepare-device-deps.sh). It
#   1. builds fsdp-run and cuda_test for this GPU's architecture (Ninja, all cores);
#   2. runs cuda_test: every CUDA kernel, the attention, a whole block and training steps against
#      the CPU implementation, and the allocated peak against the planner's replay;
#   3. runs fsdp-run --device cuda on a set of configurations (FULL_SHARD, SHARD_GRAD_OP,
#      NO_SHARD; activation checkpointing off and on; virtual world 1 and 8; TinyLlama 1.1B at
#      sequence length 2048), each writing predicted vs measured JSON;
#   4. runs tools/torch_reference.py (PyTorch FSDP2) on the same 1-GPU configurations;
#   5. merges everything into $OUT/device-check.json (and the log into $OUT/device-check.log).
# Must finish in under 8 minutes including the build. Environment: OUT (default ./device-out),
# MODEL, SEQ, STEPS to shrink or grow the runs; DRY_RUN=1 prints the commands instead.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device-out}
MODEL=${MODEL:-tinyllama-1.1b}
SEQ=${SEQ:-2048}
STEPS=${STEPS:-6}
RUNS=$OUT/runs
mkdir -p "$RUNS"
LOG=$OUT/device-check.log
: > "$LOG"
say() { echo "== $*" | tee -a "$LOG"; }
run() {  # run a command, logging it; DRY_RUN prints it only
  echo "\$ $*" | tee -a "$LOG"
  [ -n "${DRY_RUN:-}" ] && return 0
  "$@" 2>&1 | tee -a "$LOG"
  return "${PIPESTATUS[0]}"
}
start=$(date +%s)

say "machine"
run nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
run nvcc --version

say "build"
deps=$PWD/.device-deps/usr
[ -d "$deps" ] || { echo "device-check: .device-deps missing: run tools/prepare-device-deps.sh here and carry .device-deps" | tee -a "$LOG"; exit 2; }
export LD_LIBRARY_PATH="$deps/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
nccl_root=""
if [ ! -e /usr/local/cuda/include/nccl.h ] && [ ! -e /usr/include/nccl.h ]; then  # the pip wheel that PyTorch uses
  nccl_root=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) if nvidia.nccl.__file__ else list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)
  [ -n "$nccl_root" ] && export LD_LIBRARY_PATH="$nccl_root/lib:$LD_LIBRARY_PATH"
fi
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '.')
generator=$(command -v ninja > /dev/null && echo Ninja || echo "Unix Makefiles")
run cmake -S . -B build-device -G "$generator" -DCMAKE_BUILD_TYPE=Release -DFSDP_WITH_CUDA=ON -DCMAKE_PREFIX_PATH="$deps" \
  -DCMAKE_CUDA_ARCHITECTURES="${arch:-90}" ${nccl_root:+-DNCCL_ROOT=$nccl_root} || exit 1
run cmake --build build-device -j"$(nproc)" --target fsdp-run cuda_test || exit 1
say "build done after $(( $(date +%s) - start )) s"

say "kernel and engine checks (cuda_test)"
FSDPKIT_DATA_DIR=$PWD run build-device/src/runtime/cuda_test
echo "cuda_test exit $?" | tee -a "$LOG"

say "fsdp-run --device cuda, $MODEL, seq $SEQ"
common=(--device cuda --model "$MODEL" --seq-len "$SEQ" --micro-batch 1 --steps "$STEPS" --quiet --param-dtype bf16 --reduce-dtype fp32)
fsdp() {  # name, then extra flags
  local name=$1; shift
  FSDPKIT_DATA_DIR=$PWD run build-device/fsdp-run "${common[@]}" "$@" --out "$RUNS/fsdp_$name.json"
}
fsdp full_shard --strategy FULL_SHARD
fsdp full_shard_ac --strategy FULL_SHARD --ac full
fsdp shard_grad_op --strategy SHARD_GRAD_OP
fsdp no_shard --strategy NO_SHARD
fsdp full_shard_v8 --strategy FULL_SHARD --virtual-world 8
fsdp full_shard_ac_v8 --strategy FULL_SHARD --ac full --virtual-world 8
fsdp shard_grad_op_v8 --strategy SHARD_GRAD_OP --virtual-world 8
say "fsdp-run done after $(( $(date +%s) - start )) s"

say "PyTorch FSDP2 reference (tools/torch_reference.py)"
torch_run() {  # name, strategy, ac
  run python3 tools/torch_reference.py --device cuda --model "models/$MODEL.json" --strategy "$2" --ac "$3" --micro-batch 1 \
    --seq-len "$SEQ" --steps "$STEPS" --warmup 2 --param-dtype bf16 --reduce-dtype fp32 --attention eager --out "$RUNS/torch_$1.json"
}
torch_run full_shard FULL_SHARD none
torch_run full_shard_ac FULL_SHARD full
torch_run shard_grad_op SHARD_GRAD_OP none
torch_run no_shard NO_SHARD none
say "torch done after $(( $(date +%s) - start )) s"

[ -n "${DRY_RUN:-}" ] && exit 0
python3 - "$RUNS" "$OUT/device-check.json" <<'PY'
import json, os, sys, datetime
runs, out = sys.argv[1], sys.argv[2]
doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "runs": {}}
for name in sorted(os.listdir(runs)):
    with open(os.path.join(runs, name)) as f:
        doc["runs"][name[:-5]] = json.load(f)
with open(out, "w") as f:
    json.dump(doc, f, indent=1)
for name, r in doc["runs"].items():
    m = r.get("measured", {})
    mem = m.get("memory", {})
    peak = mem.get("rank0_peak_allocated_bytes") or mem.get("max_allocated_bytes") or 0
    pred = r.get("predicted", {}).get("memory", {}).get("peak_bytes")
    step = m.get("time", {}).get("step_s")
    tps = m.get("tokens_per_s_per_gpu") or m.get("tokens_per_s")
    print(f"{name:22s} peak {peak / 2**30:8.3f} GiB  predicted {pred / 2**30 if pred else float('nan'):8.3f} GiB  step {step or 0:8.4f} s  {tps or 0:10.0f} tokens/s")
PY
say "total $(( $(date +%s) - start )) s"
