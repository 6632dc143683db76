#!/usr/bin/env python3
"""Whether this CPU gives PyTorch a bf16 matrix multiply fast enough for the bf16 cross-checks.

PyTorch multiplies bf16 matrices on the CPU through oneDNN only where oneDNN supports the type
(aten/src/ATen/native/mkldnn/Utils.h, mkldnn_bf16_device_check -> ideep::has_bf16_type_support():
AVX512 (avx512_core) or AVX2-VNNI-2); elsewhere, on a CPU with AVX2 alone, it falls back to
ATen's generic loops (aten/src/ATen/native/BlasKernel.cpp), about a hundred times slower than fp32:
a 512 x 768 x 3,072 product took 3.2 s in bf16 against 29 ms in fp32 on a 2-core AMD EPYC with
AVX2 (torch 2.11), and one bf16 step of llama-100m at 512 tokens 152 s. The checks that train bf16
models on PyTorch (bench/torch_memory_check.sh, tools/cpu_alloc_history_check.sh,
tools/reentrant_check.py) then run for hours, so on such a CPU they skip (exit 77) saying why,
unless FSDPKIT_SLOW_BF16=1 asks for them anyway; their fp32 rows, which this CPU runs fast, still
run (torch_memory_check.sh QUICK=fp32 or ROWS=fp32, cpu_alloc_history_check.sh's first row).

  python3 tools/cpu_bf16_gemm.py NAME    # exit 0: run; 77: skip (one line on stdout naming why)
"""
import os
import sys


def fast_bf16_gemm():
    """PyTorch's own test for the oneDNN bf16 path (the one torch.matmul takes on the CPU)."""
    import torch
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def skip_reason(name):
    """None when `name` should run here, else the line to print before exiting 77."""
    if os.environ.get("FSDPKIT_SLOW_BF16") == "1" or fast_bf16_gemm():
        return None
    return (f"{name}: skipped: PyTorch has no fast bf16 matrix multiply on this CPU (oneDNN needs AVX512 or "
            f"AVX2-VNNI-2; the fallback is ~100x slower than fp32, so its bf16 training runs would take hours); "
            f"FSDPKIT_SLOW_BF16=1 runs it anyway")


if __name__ == "__main__":
    reason = skip_reason(sys.argv[1] if len(sys.argv) > 1 else "check")
    if reason:
        print(reason)
        sys.exit(77)
