#!/usr/bin/env python3
"""Puts PYTORCH_CUDA_ALLOC_CONF strings to PyTorch itself and to `fsdp-plan --alloc-conf`.

PyTorch's verdict: `torch._C._accelerator_setAllocatorSettings(text)`, the parser behind
PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF (c10/core/AllocatorConfig.cpp and, for the CUDA keys,
c10/cuda/CUDAAllocatorConfig.cpp), in a child process of its own for each string (a parse that
fails half way leaves settings behind: `large_segment_size_mb:25` then rejects a later
`max_split_size_mb:20`). fsdp-plan's: its exit status, 0 or 2 (the one-line error).

Checked: every string gets the same verdict from both, except the ones in STRICTER, which PyTorch
accepts and fsdp-plan refuses by design (and the check fails if PyTorch ever refuses one of them:
the list must stay true). The strings: CASES below and the seed corpus of fuzz_alloc_conf.

And where both accept, the values: PyTorch's AcceleratorAllocatorConfig singleton (libc10.so) read
after the parse through ctypes (large_segment_size_, max_split_size_, max_non_split_rounding_size_,
roundup_power2_divisions_, garbage_collection_threshold_, use_expandable_segments_, at the offsets of
the 2.11 build, checked first on the defaults; where they do not read as the defaults, the values
are not compared and the check says so) against fsdp-plan's memory.framework_terms.allocator.

Usage: tools/alloc_conf_check.py --fsdp-plan build/fsdp-plan
Exit status: 0 all agree, 1 a disagreement (each printed), 77 torch missing.
"""

import argparse
import glob
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = [
    "", "expandable_segments:True", "expandable_segments:False", "expandable_segments:true",
    "expandable_segments:yes", "expandable_segments:True\n", "\texpandable_segments:True",
    "max_split_size_mb:20", "max_split_size_mb:19", "max_split_size_mb:512", "max_split_size_mb:x",
    "max_split_size_mb", "max_split_size_mb:", "max_non_split_rounding_mb:20", "max_non_split_rounding_mb:19",
    "max_non_split_rounding_mb:64",
    "large_segment_size_mb:10", "large_segment_size_mb:11", "large_segment_size_mb:40",
    "max_split_size_mb:20,large_segment_size_mb:25", "large_segment_size_mb:25,max_split_size_mb:20",
    "max_split_size_mb:64,large_segment_size_mb:25", "large_segment_size_mb:40,max_non_split_rounding_mb:30",
    "large_segment_size_mb:40,max_non_split_rounding_mb:40",
    "garbage_collection_threshold:0.6", "garbage_collection_threshold:1.0", "garbage_collection_threshold:0",
    "garbage_collection_threshold:1.5",
    "per_process_memory_fraction:0.9", "per_process_memory_fraction:0", "per_process_memory_fraction:1",
    "per_process_memory_fraction:1.5", "per_process_memory_fraction:-0.1",
    "garbage_collection_threshold:0.8,per_process_memory_fraction:0.9",
    "roundup_power2_divisions:4", "roundup_power2_divisions:3", "roundup_power2_divisions:[256:1,512:2,>:4]",
    "roundup_power2_divisions:[>:4]", "roundup_power2_divisions:[256:3]", "roundup_power2_divisions:[256:1",
    "roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1]",
    "backend:native", "backend:cudaMallocAsync", "backend:foo",
    "release_lock_on_cudamalloc:True", "release_lock_on_hipmalloc:True", "pinned_use_cuda_host_register:True",
    "pinned_use_hip_host_register:False", "pinned_use_background_threads:True",
    "graph_capture_record_stream_reuse:True",
    "pinned_num_register_threads:8", "pinned_num_register_threads:128", "pinned_num_register_threads:3",
    "pinned_num_register_threads:256", "pinned_reserve_segment_size_mb:64", "pinned_reserve_segment_size_mb:0",
    "foo:1", "expandable_segments:True max_split_size_mb:64", "max_split_size_mb:1234567890123456",
    "max_split_size_mb:18446744073709551615", "max_split_size_mb:18446744073709551616",
    "roundup_power2_divisions:9223372036854775808", "roundup_power2_divisions:[9223372036854775808:2]",
    "large_segment_size_mb:40,max_split_size_mb:30,large_segment_size_mb:25",
    "large_segment_size_mb:25,max_split_size_mb:30,large_segment_size_mb:40", "max_split_size_mb:0000000000000000000000512",
    "expandable_segments:True,max_split_size_mb:128,garbage_collection_threshold:0.6",
]

# PyTorch accepts these; fsdp-plan refuses them (docs/memory-model.md, "The caching allocator"):
# std::stoull / std::stod read a leading number and drop the rest, and ConfigTokenizer::checkToken's
# result is never used, so the ':' and ',' between keys and values go unchecked.
STRICTER = {
    "max_split_size_mb:512MB": "a number followed by text",
    "garbage_collection_threshold:0.6abc": "a number followed by text",
    "max_split_size_mb:+64": "a signed number",
    "max_split_size_mb:-1": "a signed number (PyTorch: 2^64 - 1, no limit)",
    "max_split_size_mb,64": "',' where ':' belongs",
    "large_segment_size_mb:2000000000": "a segment larger than any device (over 1 PiB)",
}


UNLIMITED = 1 << 62  # a max_split_size at or above this splits nothing either way (PyTorch: SIZE_MAX)
DIVISIONS_CAP = 1 << 62  # fsdp-plan keeps divisions from here up as this, which rounds alike
MIB = 1 << 20


def torch_config_values():
    """AcceleratorAllocatorConfig's fields as this process's libc10.so holds them (2.11 layout)."""
    import ctypes
    import torch
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    instance = lib._ZN3c1016CachingAllocator26AcceleratorAllocatorConfig8instanceEv
    instance.restype = ctypes.c_void_p
    base = instance()
    u64 = lambda off: ctypes.c_uint64.from_address(base + off).value  # noqa: E731
    begin, end = u64(24), u64(32)
    count = (end - begin) // 8 if 0 < end - begin <= 8 * 64 else 0
    max_split = u64(8)
    return {"large_segment_bytes": u64(0),
            "max_split_size_bytes": None if max_split >= UNLIMITED else max_split,
            "max_non_split_rounding_bytes": u64(16),
            "roundup_power2_divisions": [ctypes.c_uint64.from_address(begin + 8 * i).value for i in range(count)],
            "garbage_collection_threshold": ctypes.c_double.from_address(base + 48).value,
            "expandable_segments": bool(ctypes.c_bool.from_address(base + 56).value)}


def torch_verdict(text):
    """(accepted, first line of PyTorch's message, its parsed values), parsed in a forked child."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: parse once, report, exit without running atexit handlers
        os.close(read_end)
        import torch
        try:
            torch._C._accelerator_setAllocatorSettings(text)
            message, code = json.dumps(torch_config_values()).encode(), 0
        except Exception as e:  # noqa: BLE001 - PyTorch raises RuntimeError or ValueError
            message, code = str(e).splitlines()[0].encode()[:300], 3
        os.write(write_end, message)
        os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        message = f.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code not in (0, 3):
        raise RuntimeError(f"child for {text!r} exited {code}")
    return (True, "", json.loads(message)) if code == 0 else (False, message, None)


def plan_verdict(fsdp_plan, text):
    """(accepted, fsdp-plan's error line, its parsed values)."""
    p = subprocess.run([fsdp_plan, "--model", "tiny-llama", "--gpus", "1", "--json", "--alloc-conf", text],
                       capture_output=True, text=True, timeout=60)
    if p.returncode not in (0, 2):
        raise RuntimeError(f"fsdp-plan --alloc-conf {text!r} exited {p.returncode}: {p.stderr.strip()}")
    if p.returncode != 0:
        return False, p.stderr.strip().splitlines()[-1] if p.stderr.strip() else "", None
    values = dict(json.loads(p.stdout)["memory"]["framework_terms"]["allocator"])
    if values["max_split_size_bytes"] is not None and values["max_split_size_bytes"] >= UNLIMITED:
        values["max_split_size_bytes"] = None
    return True, "", values


def layout_known():
    """Whether the ctypes offsets read PyTorch's defaults as the defaults (else values are not compared)."""
    ok, _, values = torch_verdict("")
    return ok and values == {"large_segment_bytes": 20 * MIB, "max_split_size_bytes": None,
                             "max_non_split_rounding_bytes": 20 * MIB, "roundup_power2_divisions": [0] * 16,
                             "garbage_collection_threshold": 0.0, "expandable_segments": False}


def differing_values(torch_values, plan_values):
    # (caching_allocator.cc's Capped)
    torch_values = dict(torch_values, roundup_power2_divisions=[min(d, DIVISIONS_CAP) for d in torch_values["roundup_power2_divisions"]])
    return {k: (v, plan_values.get(k)) for k, v in torch_values.items() if plan_values.get(k) != v}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fsdp-plan", required=True)
    args = ap.parse_args()
    try:
        import torch  # noqa: F401 - imported once here, so that each forked child has it
    except ImportError as e:
        print(f"alloc_conf_check: skipped, torch is not installed ({e})")
        return 77
    corpus = []
    for path in sorted(glob.glob(os.path.join(ROOT, "fuzz", "corpus", "alloc_conf", "*"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            corpus.append(f.read())
    compare_values = layout_known()
    if not compare_values:
        print("alloc_conf_check: this torch's AcceleratorAllocatorConfig does not read as 2.11's layout: verdicts only")
    failures, agreed, values_compared = [], 0, 0
    for text in CASES + corpus + list(STRICTER):
        torch_ok, torch_msg, torch_values = torch_verdict(text)
        plan_ok, plan_msg, plan_values = plan_verdict(args.fsdp_plan, text)
        if text in STRICTER:
            if not torch_ok or plan_ok:
                failures.append(f"{text!r}: listed as stricter ({STRICTER[text]}), but PyTorch "
                                f"{'accepts' if torch_ok else 'refuses'} and fsdp-plan {'accepts' if plan_ok else 'refuses'}")
            continue
        if torch_ok != plan_ok:
            failures.append(f"{text!r}: PyTorch {'accepts' if torch_ok else 'refuses (' + torch_msg + ')'}, "
                            f"fsdp-plan {'accepts' if plan_ok else 'refuses (' + plan_msg + ')'}")
            continue
        agreed += 1
        if torch_ok and compare_values:
            values_compared += 1
            diff = differing_values(torch_values, plan_values)
            if diff:
                failures.append(f"{text!r}: parsed differently (PyTorch, fsdp-plan): {diff}")
    for f in failures:
        print("DISAGREE", f)
    total = len(CASES) + len(corpus) + len(STRICTER)
    print(f"alloc_conf_check: {total} strings (torch {torch.__version__}): {agreed} same verdict "
          f"({values_compared} accepted with their values compared), {len(STRICTER)} refused here by design, "
          f"{len(failures)} disagreements")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
