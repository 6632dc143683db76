#!/usr/bin/env python3
"""One row of tools/cpu_alloc_history_check.sh: PyTorch's CPU requests replayed (build/bench/
allocator_replay's output) against fsdp-plan's JSON, planned as on a GPU and with --one-stream.

  cpu_alloc_history_compare.py NAME ALLOCATED_LIMIT_PCT ONE_STREAM_RESERVED_LIMIT_PCT|- REPLAY_TXT PLAN_JSON ONE_STREAM_JSON

The allocated peaks compared are the allocator's blocks at their peak, both replayed on one stream
(torch.cuda.max_memory_allocated's figure: a block counted whole where the rest of its segment was
too small to split off), the replay's and fsdp-plan's --one-stream allocated_blocks_peak_bytes.
Prints one line; exits 1 naming what failed: a free of a storage the recording never saw, the
allocated peaks apart by more than ALLOCATED_LIMIT_PCT, or (unless the limit is -) the one-stream
reserved peak apart from the recording's by more than ONE_STREAM_RESERVED_LIMIT_PCT.
"""
import json
import re
import sys


def replay_number(replay, key):
    return int(re.search(key + r" (\d+)", replay).group(1))


def per_gpu(path):
    return json.load(open(path))["memory"]["per_gpu"]


def error_pct(planned, measured):
    return 100 * (planned - measured) / measured


def main(argv):
    name, limit, reserved_limit, replay_path, plan_path, one_path = argv[1:7]
    replay = open(replay_path).read()
    plan, one = per_gpu(plan_path), per_gpu(one_path)
    if not one["allocator"]["one_stream"] or plan["allocator"]["one_stream"]:
        return f"cpu_alloc_history_check: {name}: fsdp-plan's one_stream keys are not what --one-stream asked"
    unknown = int(re.search(r"made before the recording (\d+)", replay).group(1))
    allocated, reserved = replay_number(replay, "allocated_peak_bytes"), replay_number(replay, "reserved_peak_bytes")
    planned = one["allocator"]["allocated_blocks_peak_bytes"]
    allocated_error = error_pct(planned, allocated)
    one_error = error_pct(one["reserved_peak_bytes"], reserved)
    print(f"{name}: PyTorch's CPU requests replayed: allocated {allocated} reserved {reserved}; fsdp-plan allocated "
          f"{planned} ({allocated_error:+.2f}%), reserved on one stream {one['reserved_peak_bytes']} "
          f"({one_error:+.2f}%), on the GPU's streams {plan['reserved_peak_bytes']} "
          f"({error_pct(plan['reserved_peak_bytes'], reserved):+.1f}%)")
    if unknown:
        return f"cpu_alloc_history_check: {name}: {unknown} frees of storages the recording never saw"
    if one["allocated_peak_bytes"] != plan["allocated_peak_bytes"]:
        return f"cpu_alloc_history_check: {name}: --one-stream changed the allocated peak"
    if abs(allocated_error) > float(limit):
        return f"cpu_alloc_history_check: {name}: allocated peaks differ by {allocated_error:+.2f}% (limit {limit}%)"
    if reserved_limit != "-" and abs(one_error) > float(reserved_limit):
        return f"cpu_alloc_history_check: {name}: reserved peaks on one stream differ by {one_error:+.2f}% (limit {reserved_limit}%)"
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
