#!/usr/bin/env bash
# tools/device-check.sh's merge on two hand-made results (tests/data/device_check): fsdp-run's peak
# 1 GiB against a predicted 1.02 GiB (+2%), fsdp-plan's PyTorch profile 1.1 GiB against PyTorch's
# 1 GiB (+10%), step 0.1 s against 0.09 s (-10%), 20480 tokens/s against PyTorch's 16384 (1.25),
# losses 10.4 10.2 against PyTorch's 10.4 10.251 from the same checkpoint (max rel 0.051/10.251),
# fsdp-plan's PyTorch step 0.1 s against PyTorch's 0.125 s (-20%).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
mkdir -p "$out/runs"
cp "$root"/tests/data/device_check/*.json "$out/runs/"
OUT=$out RUNS=$out/runs MERGE_ONLY=1 bash "$root/tools/device-check.sh" > /dev/null
python3 - "$out/device-check.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))["comparison"]["full_shard"]
expect = {"peak_error_pct": 2.0, "plan_vs_torch_error_pct": 10.0, "step_error_pct": -10.0, "tokens_ratio_vs_torch": 1.25,
          "loss_max_rel_diff_vs_torch": 0.051 / 10.251, "plan_vs_torch_step_error_pct": -20.0}
for key, value in expect.items():
    assert abs(c[key] - value) < 1e-6, f"{key}: {c[key]} != {value}"
print("merge ok")
PY
