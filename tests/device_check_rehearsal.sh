#!/usr/bin/env bash
# tools/device-check.sh rehearsed without a GPU (REHEARSE=1: the GPU engine on cuda-emu, PyTorch FSDP2
# on the CPU, tiny-llama): every step must run, and the merge must read what the steps wrote: a row
# for each of the nine fsdp-run configurations, each with the engine's allocated peak equal to its
# prediction (the replay), the kernel checks and hf_parity passing, and the FULL_SHARD pair, started
# from one bf16 checkpoint on one token file, within 1e-3 of PyTorch's losses (5.3e-5 seen).
#   device_check_rehearsal.sh BUILD_DIR      (FSDPKIT_PYTHON: a python with torch; else skipped, 77)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "$1" && pwd)
python=${FSDPKIT_PYTHON:-python3}
"$python" -c "import torch, transformers" 2>/dev/null || { echo "SKIP: no torch/transformers (set FSDPKIT_PYTHON)"; exit 77; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
REHEARSE=1 BUILD=$build OUT=$out RUNS=$out/runs TMPDIR=$out FSDPKIT_PYTHON=$python bash "$root/tools/device-check.sh" > "$out/stdout.txt" 2>&1 \
  || { tail -40 "$out/stdout.txt"; exit 1; }
grep -q "^cuda_test exit 0$" "$out/device-check.log" || { echo "cuda_test failed"; exit 1; }
grep -q "^hf_parity exit 0$" "$out/device-check.log" || { echo "hf_parity failed"; exit 1; }
python3 - "$out/device-check.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
assert doc["rehearsal"] is True, "the merge does not say it is a rehearsal"
c = doc["comparison"]
expected = {"full_shard", "full_shard_ac", "shard_grad_op", "no_shard", "full_shard_sac", "full_shard_v8", "full_shard_ac_v8",
            "shard_grad_op_v8", "full_shard_calibrated"}
assert set(c) == expected, f"configurations: {sorted(c)}"
for name, row in c.items():
    assert row["peak_error_pct"] == 0.0, f"{name}: allocated peak {row['fsdp_run_peak_bytes']} vs predicted {row['fsdp_run_predicted_peak_bytes']}"
for name in ("full_shard", "full_shard_ac", "shard_grad_op", "no_shard", "full_shard_sac"):
    assert c[name]["torch_tokens_per_s"], f"{name}: no PyTorch result"
loss = c["full_shard"]["loss_max_rel_diff_vs_torch"]
assert loss is not None and loss < 1e-3, f"losses vs PyTorch: {loss}"
print(f"rehearsal ok: {len(c)} configurations, losses vs PyTorch FSDP2 within {loss:.1e}")
PY
