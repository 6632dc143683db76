#!/usr/bin/env python3
"""fsdp-plan against PyTorch's own memory counters on a GPU, run by run.

    python3 tools/gpu_memory_check.py docs/data/gpu_h200_2026-12-04.json [--fsdp-plan build/fsdp-plan]
        [--gpu h200-sxm] [--json OUT] [--max-mean-error ALLOCATED_PCT RESERVED_PCT]

Reads the merged device check (tools/device-check.sh's device-check.json). For every
tools/torch_reference.py run on CUDA in it (the pairs' PyTorch side, "torch_*", and the
reserved-memory sweep, "sweep_*") it runs fsdp-plan on the same configuration (model file,
world size, strategy, framework, checkpointing, micro-batch, sequence, attention, dtypes, LoRA,
PYTORCH_CUDA_ALLOC_CONF) and prints, per run:
  * torch.cuda.max_memory_allocated against fsdp-plan's allocated blocks at their peak (the
    replay's allocated_bytes.all.peak: the tensors, each block counted whole where the rest of its
    segment was too small to split off);
  * torch.cuda.max_memory_reserved against fsdp-plan's caching-allocator replay;
  * the device memory outside the allocator (mem_get_info's used minus reserved, at the end:
    CUDA context, cuBLAS handles, NCCL) against fsdp-plan's CUDA context + NCCL terms;
then the mean and worst absolute error of each. Nothing is fitted here: fsdp-plan is run as a
user would run it. Exit 1 on a missing file, a run fsdp-plan refuses, or (--max-mean-error) a mean
error past its limit.
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATTENTION = {"eager": "eager", "sdpa": "flash"}


def plan_flags(config, world, gpu):
    """fsdp-plan's flags for one torch_reference run's "config" (its own key names)."""
    model = config.get("model_path") or config["model"]
    flags = ["--model", model, "--gpu", gpu, "--gpus", str(world),
             "--framework", config["framework"], "--strategy", config["strategy"].lower(),
             "--ac", config["ac"], "--micro-batch", str(config["micro_batch"]),
             "--seq-len", str(config["seq_len"]), "--attention", ATTENTION[config["attention"]],
             "--param-dtype", config["param_dtype"], "--reduce-dtype", config["reduce_dtype"]]
    if config.get("ac") == "full" and config.get("ac_every", 1) != 1:
        flags += ["--ac-every", str(config["ac_every"])]
    if config.get("loop_holds_outputs"):
        flags.append("--loop-holds-outputs")
    if config.get("master_dtype", "fp32") != "fp32":
        flags += ["--master-dtype", config["master_dtype"]]
    if config.get("lora_rank"):
        flags += ["--lora-rank", str(config["lora_rank"]), "--lora-alpha", str(config["lora_alpha"])]
        if config.get("lora_targets"):
            flags += ["--lora-targets", config["lora_targets"]]
        if config.get("base_dtype"):
            flags += ["--base-dtype", config["base_dtype"]]
        if config.get("lora_dropout"):
            flags += ["--lora-dropout", str(config["lora_dropout"])]
        if config.get("qlora"):
            flags.append("--qlora")
        if config.get("qlora_double_quant"):
            flags.append("--qlora-double-quant")
    if config.get("alloc_conf"):
        flags += ["--alloc-conf", config["alloc_conf"]]
    return flags


def run_plan(fsdp_plan, flags):
    result = subprocess.run([fsdp_plan, *flags, "--json"], cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"gpu_memory_check: fsdp-plan {' '.join(flags)}: {result.stderr.strip()}")
    return json.loads(result.stdout)


def error_pct(measured, predicted):
    return 100.0 * (predicted - measured) / measured if measured else None


def compare(name, run, fsdp_plan, gpu):
    config, memory = run["config"], run["measured"]["memory"]
    plan = run_plan(fsdp_plan, plan_flags(config, run.get("world_size", 1), gpu))
    per_gpu, terms = plan["memory"]["per_gpu"], plan["memory"]["framework_terms"]
    # mem_get_info counts every process on the GPU: the sweep's runs shared it, so only the runs
    # that had it alone say what lives outside the allocator
    outside = None if name.startswith("sweep_") else memory.get("context_overhead_bytes")
    stats = memory.get("allocator_stats") or {}
    replay = per_gpu.get("allocator", {})
    # max_memory_allocated counts the allocator's blocks (a block's unsplit remainder in): the
    # replay's figure of that, where this fsdp-plan has it; the tensors' figure before
    allocated = replay.get("allocated_blocks_peak_bytes", per_gpu["allocated_peak_bytes"])
    # active_bytes.all.peak: the blocks and the freed ones still awaiting another stream's event
    # (FSDP1's record_stream); the replay's, where this fsdp-plan has it
    torch_active = stats.get("active_bytes.all.peak")
    plan_active = replay.get("active_peak_bytes")
    return {
        "run": name, "alloc_conf": config.get("alloc_conf"),
        "torch_allocated_bytes": memory["max_allocated_bytes"],
        "plan_allocated_bytes": allocated,
        "allocated_error_pct": error_pct(memory["max_allocated_bytes"], allocated),
        "torch_active_bytes": torch_active,
        "plan_active_bytes": plan_active,
        "active_error_pct": error_pct(torch_active, plan_active) if torch_active and plan_active else None,
        "torch_requested_bytes": stats.get("requested_bytes.all.peak"),
        "plan_tensors_bytes": per_gpu["allocated_peak_bytes"],
        "torch_reserved_bytes": memory["max_reserved_bytes"],
        "plan_reserved_bytes": per_gpu["reserved_peak_bytes"],
        "reserved_error_pct": error_pct(memory["max_reserved_bytes"], per_gpu["reserved_peak_bytes"]),
        "torch_alloc_retries": stats.get("num_alloc_retries"),
        "plan_alloc_retries": per_gpu.get("alloc_retries"),
        "torch_large_pool_reserved_bytes": stats.get("reserved_bytes.large_pool.peak"),
        "plan_large_pool_reserved_bytes": replay.get("large_pool_reserved_peak_bytes"),
        "torch_small_pool_reserved_bytes": stats.get("reserved_bytes.small_pool.peak"),
        "plan_small_pool_reserved_bytes": replay.get("small_pool_reserved_peak_bytes"),
        "torch_device_allocs": stats.get("num_device_alloc"),
        "plan_device_allocs": replay.get("device_allocs"),
        "torch_outside_allocator_bytes": outside,
        # what fsdp-plan's "fits" adds to the reserve: the CUDA context and a communicator's
        # buffers for each NCCL communicator the rank creates (none for FSDP2 on one GPU)
        "plan_context_nccl_bytes": per_gpu["peak_bytes"] - per_gpu["reserved_peak_bytes"],
    }


def gib(b):
    return "      -" if b is None else f"{b / 2**30:7.2f}"


def pct(x):
    return "     -" if x is None else f"{x:+6.1f}"


def summary(rows, key):
    errors = [abs(r[key]) for r in rows if r[key] is not None]
    if not errors:
        return "n/a"
    return f"mean |error| {sum(errors) / len(errors):.1f}%, worst {max(errors):.1f}% over {len(errors)} runs"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("device_check", help="device-check.json from tools/device-check.sh")
    p.add_argument("--fsdp-plan", default=os.path.join(ROOT, "build", "fsdp-plan"))
    p.add_argument("--gpu", default="h200-sxm", help="fsdp-plan's hardware file for the GPU that ran")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--max-mean-error", type=float, nargs=2, metavar=("ALLOCATED_PCT", "RESERVED_PCT"),
                   help="exit 1 when the mean |error| of the allocated or of the reserved figures passes these")
    args = p.parse_args()
    try:
        with open(args.device_check) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"gpu_memory_check: {args.device_check}: {e}")
    rows = []
    for name, run in sorted(doc["runs"].items()):
        if run.get("tool") != "torch_reference" or run.get("config", {}).get("device") != "cuda":
            continue
        rows.append(compare(name, run, args.fsdp_plan, args.gpu))
    print(f"{'run':28s} {'alloc_conf':24s} {'alloc GiB':>9s} {'plan':>7s} {'err%':>6s}"
          f" {'reserved':>8s} {'plan':>7s} {'err%':>6s}  {'small pool MiB':>14s} {'mallocs':>9s}"
          f" {'retries':>7s} {'outside':>7s} {'plan':>7s}")
    mib = lambda b: "-" if b is None else f"{b / 2**20:.0f}"
    for r in rows:
        print(f"{r['run']:28s} {str(r['alloc_conf'] or '-'):24s} {gib(r['torch_allocated_bytes'])}   "
              f"{gib(r['plan_allocated_bytes'])} {pct(r['allocated_error_pct'])}  {gib(r['torch_reserved_bytes'])} "
              f"{gib(r['plan_reserved_bytes'])} {pct(r['reserved_error_pct'])}  "
              f"{mib(r['torch_small_pool_reserved_bytes']) + '/' + mib(r['plan_small_pool_reserved_bytes']):>14s} "
              f"{str(r['torch_device_allocs']) + '/' + str(r['plan_device_allocs']):>9s} "
              f"{str(r['torch_alloc_retries']) + '/' + str(r['plan_alloc_retries']):>7s} "
              f"{gib(r['torch_outside_allocator_bytes'])} {gib(r['plan_context_nccl_bytes'])}")
    print(f"allocated: {summary(rows, 'allocated_error_pct')}")
    print(f"reserved:  {summary(rows, 'reserved_error_pct')}")
    # the runs where a block waited on another stream at PyTorch's peak (active above allocated)
    waited = [r for r in rows if r["active_error_pct"] is not None and r["torch_active_bytes"] > r["torch_allocated_bytes"]]
    for r in waited:
        print(f"active ({r['run']}): {gib(r['torch_active_bytes']).strip()} GiB, plan {gib(r['plan_active_bytes']).strip()} "
              f"({pct(r['active_error_pct']).strip()}%); over allocated {(r['torch_active_bytes'] - r['torch_allocated_bytes']) / 2**20:.0f} MiB, "
              f"plan {(r['plan_active_bytes'] - r['plan_allocated_bytes']) / 2**20:.0f} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.max_mean_error:
        for key, limit in zip(("allocated_error_pct", "reserved_error_pct"), args.max_mean_error):
            errors = [abs(r[key]) for r in rows if r[key] is not None]
            if errors and sum(errors) / len(errors) > limit:
                sys.exit(f"gpu_memory_check: mean |{key}| {sum(errors) / len(errors):.2f}% passes {limit}%")


if __name__ == "__main__":
    main()
