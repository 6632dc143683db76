#!/usr/bin/env bash
# fsdp-run's GPU engine on cuda-emu (fsdp-run-emu --device cuda: the engine, its kernels and its NCCL
# calls, emulated on the host; NCCL over MPI) against the CPU engine, both on RANKS MPI ranks with the
# same flags in fp32: the losses must agree to 1e-5 relative, and the GPU engine's allocated peak
# must equal its replay (fsdp-plan's profile of that engine) to the byte, category by category.
#   gpu_emu_compare.sh FSDP_RUN FSDP_RUN_EMU COMPARE MPIRUN OUT_DIR RANKS [extra fsdp-run flags]
set -euo pipefail
run=$1 emu=$2 compare=$3 mpirun=$4 out=$5 ranks=$6
shift 6
common=(--model tiny-llama --seq-len 16 --micro-batch 2 --steps 3 --quiet --gpus "$ranks" --param-dtype fp32 --reduce-dtype fp32 "$@")
mkdir -p "$out"
mpi=("$mpirun" --allow-run-as-root --oversubscribe -np "$ranks")
timeout 120 "${mpi[@]}" "$run" "${common[@]}" --out "$out/cpu.json" > /dev/null
timeout 240 "${mpi[@]}" "$emu" --device cuda "${common[@]}" --out "$out/gpu.json" > /dev/null
"$compare" "$out/cpu.json" "$out/gpu.json" 1e-5
python3 - "$out/gpu.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
m, p = r["measured"]["memory"], r["predicted"]["memory"]
print("GPU engine peak allocated", m["rank0_peak_bytes"], "replay", p["peak_bytes"])
sys.exit(0 if m["rank0_peak_bytes"] == p["peak_bytes"] and m["rank0_categories"] == p["categories"] else 1)
PY
