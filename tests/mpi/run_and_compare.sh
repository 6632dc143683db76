#!/usr/bin/env bash
# Trains tiny-llama for 3 steps in one process and under mpirun with RANKS ranks (same global
# batch), and checks that the losses agree to 1e-5 relative.
#   run_and_compare.sh FSDP_RUN COMPARE MPIRUN OUT_DIR RANKS MICRO_BATCH [extra fsdp-run flags]
set -euo pipefail
run=$1 compare=$2 mpirun=$3 out=$4 ranks=$5 micro=$6
shift 6
common=(--model tiny-llama --seq-len 16 --steps 3 --quiet "$@")
mkdir -p "$out"
"$run" "${common[@]}" --gpus 1 --micro-batch $((ranks * micro)) --out "$out/single.json" >/dev/null
timeout 120 "$mpirun" --allow-run-as-root --oversubscribe -np "$ranks" "$run" "${common[@]}" --gpus "$ranks" \
  --micro-batch "$micro" --out "$out/ranks.json" >/dev/null
"$compare" "$out/single.json" "$out/ranks.json" 1e-5
