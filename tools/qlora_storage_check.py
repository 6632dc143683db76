#!/usr/bin/env python3
"""fsdp-plan's QLoRA storage against bitsandbytes' own quantization of the same model (issue 19).

  tools/qlora_storage_check.py --fsdp-plan build/fsdp-plan [--double-quant] [--lora-rank R] CONFIG.json

transformers builds the model of CONFIG.json in bf16 with random weights, saves it, and loads it back
on the CPU through BitsAndBytesConfig(load_in_4bit, nf4, bnb_4bit_quant_storage=bf16,
bnb_4bit_compute_dtype=bf16), as the FSDP-QLoRA recipes load it; peft's get_peft_model adds LoRA
adapters (fp32: autocast_adapter_dtype). Then, against fsdp-plan --qlora --json on the same config:

- the packed NF4 storage: the bytes of every Params4bit (model.nf4_packed_bytes);
- the quantization state: every tensor of each weight's QuantState, nested state included, counted
  once per distinct storage (model.nf4_quant_state_bytes);
- the parameters as the model computes with them: the unpacked weight counts (model.params_total)
  and the adapters (model.params_trainable).

Exit 0 when all are equal, 1 otherwise, 77 when torch, transformers, peft or bitsandbytes is missing.
"""
import argparse
import json
import subprocess
import sys
import tempfile

try:
    import torch
    import transformers
    import peft
    import bitsandbytes as bnb
except ImportError as e:
    print(f"qlora_storage_check: {e.name} not installed: skipped")
    sys.exit(77)


def quantized_model(config_path, double_quant, rank):
    with open(config_path) as f:
        raw = json.load(f)
    config = transformers.AutoConfig.for_model(**raw)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    bnb_config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double_quant,
                                                 bnb_4bit_quant_storage=torch.bfloat16, bnb_4bit_compute_dtype=torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        quantized = transformers.AutoModelForCausalLM.from_pretrained(tmp, quantization_config=bnb_config, dtype=torch.bfloat16,
                                                                      device_map="cpu")
    return peft.get_peft_model(quantized, peft.LoraConfig(r=rank))


def state_tensors(state):
    """Every tensor of a bitsandbytes QuantState, the nested state's included."""
    out = [state.absmax, state.code]
    if getattr(state, "offset", None) is not None:
        out.append(state.offset)
    if getattr(state, "state2", None) is not None:
        out += [state.state2.absmax, state.state2.code]
    return [t for t in out if isinstance(t, torch.Tensor)]


def bnb_figures(model):
    packed = state = logical = trainable = 0
    seen = set()
    for p in model.parameters():
        if isinstance(p, bnb.nn.Params4bit):
            packed += p.numel() * p.element_size()
            logical += p.quant_state.shape.numel()
            for t in state_tensors(p.quant_state):
                if t.data_ptr() in seen:
                    continue
                seen.add(t.data_ptr())
                state += t.numel() * t.element_size()
        else:
            logical += p.numel()
        if p.requires_grad:
            trainable += p.numel()
    return {"nf4_packed_bytes": packed, "nf4_quant_state_bytes": state, "params_total": logical, "params_trainable": trainable}


def plan_figures(fsdp_plan, config_path, double_quant, rank):
    args = [fsdp_plan, "--model", config_path, "--gpus", "1", "--framework", "fsdp2", "--lora-rank", str(rank), "--qlora", "--json"]
    if double_quant:
        args.append("--qlora-double-quant")
    out = subprocess.run(args, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"fsdp-plan failed on {config_path}: {out.stderr.strip()}")
    model = json.loads(out.stdout)["model"]
    return {k: model[k] for k in ("nf4_packed_bytes", "nf4_quant_state_bytes", "params_total", "params_trainable")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fsdp-plan", required=True)
    ap.add_argument("--double-quant", action="store_true")
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("config")
    a = ap.parse_args()
    theirs = bnb_figures(quantized_model(a.config, a.double_quant, a.lora_rank))
    ours = plan_figures(a.fsdp_plan, a.config, a.double_quant, a.lora_rank)
    bad = 0
    for key in ours:
        ok = ours[key] == theirs[key]
        bad += not ok
        print(f"{key:24s} fsdp-plan {ours[key]:>14,}  bitsandbytes {bnb.__version__} {theirs[key]:>14,}  {'equal' if ok else 'DIFFERENT'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
