#!/usr/bin/env python3
"""Compares two folders written by tools/golden-outputs.sh, figure by figure.

    python3 tools/golden-diff.py BEFORE AFTER [--rel 1e-12] [--summary]

Numbers compare with a relative tolerance (default 1e-12: the last bits of a sum taken in another
order); fsdp-run's measured times, heap sizes and bandwidths vary run to run and are left out.
Prints one line per difference (file, JSON path, before, after) and exits 1 when there is any.
"""
import json
import math
import os
import sys

# Keys under fsdp-run's "measured" that are measurements of this machine, not figures of the model.
MEASURED_KEYS = {
    "steps_s", "step_s", "forward_s", "backward_s", "optimizer_s", "all_gather_s", "reduce_scatter_s", "all_reduce_s",
    "all_gather_busbw_bytes_per_s", "reduce_scatter_busbw_bytes_per_s", "all_reduce_busbw_bytes_per_s",
    "peak_bytes", "rank0_peak_bytes", "temporaries_bytes", "wall_s", "host_waits_per_step", "tokens_per_s", "tokens_per_s_per_gpu",
    "device_used_bytes", "context_bytes", "cublas_bytes", "nccl_bytes", "device_total_bytes",
}


def walk(a, b, path, out, rel, measured, run_file=False):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if (measured and k in MEASURED_KEYS) or k == "wall_s":
                continue
            inner = measured or (run_file and k == "measured")
            if k not in a:
                out.append((path + "." + k, "<absent>", b[k]))
            elif k not in b:
                out.append((path + "." + k, a[k], "<absent>"))
            else:
                walk(a[k], b[k], path + "." + k, out, rel, inner)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.append((path, f"<{len(a)} items>", f"<{len(b)} items>"))
        for i, (x, y) in enumerate(zip(a, b)):
            walk(x, y, f"{path}[{i}]", out, rel, measured)
    elif isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        if a == b or (math.isfinite(a) and math.isfinite(b) and abs(a - b) <= rel * max(abs(a), abs(b))):
            return
        out.append((path, a, b))
    elif a != b:
        out.append((path, a, b))


def main():
    args = [x for x in sys.argv[1:] if not x.startswith("--")]
    rel = 1e-12
    if "--rel" in sys.argv:
        rel = float(sys.argv[sys.argv.index("--rel") + 1])
        args = [x for x in args if x != sys.argv[sys.argv.index("--rel") + 1]]
    before, after = args[:2]
    names = sorted(set(os.listdir(before)) | set(os.listdir(after)))
    differences = 0
    for name in names:
        pa, pb = os.path.join(before, name), os.path.join(after, name)
        if not os.path.exists(pa) or not os.path.exists(pb):
            print(f"{name}: only in {'after' if not os.path.exists(pa) else 'before'}")
            differences += 1
            continue
        ta, tb = open(pa).read(), open(pb).read()
        if not name.endswith(".json"):
            if ta != tb:
                print(f"{name}: text differs")
                differences += 1
            continue
        try:
            ja, jb = json.loads(ta), json.loads(tb)
        except json.JSONDecodeError:
            if ta != tb:
                print(f"{name}: not JSON and differs: {ta[:80]!r} / {tb[:80]!r}")
                differences += 1
            continue
        out = []
        walk(ja, jb, "", out, rel, False, name.startswith("run."))
        for path, x, y in out:
            if "--summary" not in sys.argv:
                print(f"{name}{path}: {x} -> {y}")
        if out and "--summary" in sys.argv:
            print(f"{name}: {len(out)} differences")
        differences += len(out)
    print(f"{differences} differences in {len(names)} files", file=sys.stderr)
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
