#!/usr/bin/env python3
"""Writes tests/data/nf4_bitsandbytes.json: bitsandbytes' own NF4 quantization of seeded values, the
reference runtime/nf4_test.cc checks fsdp-run's Nf4Quantize and Nf4Dequantize against byte for byte.

The values: 1001 draws of N(0, 1) (15 full blocks of 64 and a tail of 41, an odd count), with block 0
holding every NF4 bucket bound exactly (absmax 1, so that scaled equals the bound: the tie goes to the
lower index) and the value one fp32 step above each; block 1 all zeros (absmax 0). Quantized by
bitsandbytes.functional.quantize_4bit(blocksize=64, quant_type="nf4", quant_storage=torch.uint8) on
the CPU and dequantized by dequantize_4bit to fp32 (an odd count: the default backend's
_dequantize_4bit_compute); and a (24, 128) weight of N(0, 1) draws as Linear4bit holds one, dequantized
by the CPU backend's native kernel (cdequantize_blockwise_cpu_nf4_fp32, for an even last dimension).

And double quantization (compress_statistics=True) of the 300 absmax of 19,200 N(0, 0.02) weights:
the offset, the byte per absmax, the fp32 absmax of each block of 256, the nested code, and the
absmax dequantized back (dequantize_blockwise + offset).

That native kernel takes row r, column c's absmax from block r * (in // 64) + c // 64, which is the
block quantize_4bit used (i // 64 of the flattened index) only when in_features is a multiple of 64:
a (8, 96) or (8, 160) weight dequantizes with other blocks' absmax on bitsandbytes 0.50.2's CPU
backend (checked here against the default backend's _dequantize_4bit_compute, which follows i // 64
as the CUDA kernels do). fsdp-run follows i // 64; its QLoRA parity case (tools/hf_parity.py) keeps
every in_features a multiple of 64.

Usage: build/torch-venv/bin/python tools/nf4_fixture.py [OUT]
"""
import json
import sys

import numpy as np
import torch
import bitsandbytes
import bitsandbytes.functional as F


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/data/nf4_bitsandbytes.json"
    g = torch.Generator().manual_seed(7)
    values = torch.randn(1001, generator=g, dtype=torch.float32)
    code = F.get_4bit_type("nf4", device="cpu")
    bounds = (code[:-1] + code[1:]) / 2
    block0 = [1.0]
    for b in bounds.tolist():
        block0 += [b, float(np.nextafter(np.float32(b), np.float32(2)))]
    values[:len(block0)] = torch.tensor(block0, dtype=torch.float32)
    values[len(block0):64] = 0.0  # the block's absmax stays 1
    values[64:128] = 0.0
    packed, state = F.quantize_4bit(values, blocksize=64, quant_type="nf4", quant_storage=torch.uint8)
    dequantized = F.dequantize_4bit(packed, state)
    weight = torch.randn(24, 128, generator=g, dtype=torch.float32)
    weight_packed, weight_state = F.quantize_4bit(weight, blocksize=64, quant_type="nf4", quant_storage=torch.uint8)
    weight_dequantized = F.dequantize_4bit(weight_packed, weight_state)
    # double quantization (compress_statistics=True): the 300 absmax of 19,200 N(0, 0.02) weights, their
    # mean as offset, quantized by blocks of 256 (a full block and a tail of 44)
    small = torch.randn(300 * 64, generator=g, dtype=torch.float32) * 0.02
    _, plain = F.quantize_4bit(small, blocksize=64, quant_type="nf4")
    _, nested = F.quantize_4bit(small, blocksize=64, quant_type="nf4", compress_statistics=True)
    nested_absmax = F.dequantize_blockwise(nested.absmax, nested.state2) + nested.offset
    fixture = {
        "source": f"bitsandbytes {bitsandbytes.__version__}, torch {torch.__version__}: tools/nf4_fixture.py",
        "values": [float(v) for v in values.tolist()],
        "packed": [int(b) for b in packed.reshape(-1).tolist()],
        "absmax": [float(a) for a in state.absmax.tolist()],
        "dequantized": [float(d) for d in dequantized.reshape(-1).tolist()],
        "weight": [float(v) for v in weight.reshape(-1).tolist()],
        "weight_packed": [int(b) for b in weight_packed.reshape(-1).tolist()],
        "weight_absmax": [float(a) for a in weight_state.absmax.tolist()],
        "weight_dequantized": [float(d) for d in weight_dequantized.reshape(-1).tolist()],
        "dq_absmax": [float(a) for a in plain.absmax.tolist()],
        "dq_offset": float(nested.offset),
        "dq_absmax_q": [int(q) for q in nested.absmax.tolist()],
        "dq_absmax2": [float(a) for a in nested.state2.absmax.tolist()],
        "dq_code": [float(c) for c in nested.state2.code.tolist()],
        "dq_dequantized": [float(a) for a in nested_absmax.tolist()],
    }
    with open(out, "w") as f:
        json.dump(fixture, f)
        f.write("\n")
    print(f"wrote {out}: {len(fixture['values'])} values, {len(fixture['packed'])} bytes, {len(fixture['absmax'])} blocks")


if __name__ == "__main__":
    main()
