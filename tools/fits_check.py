#!/usr/bin/env python3
"""fsdp-plan's "fits" verdict against published runs that ran or ran out of memory.

Each run of docs/data/fits_published.json was published with its outcome on a named card: it
trained (often with its peak memory), or it stopped with a CUDA out-of-memory error. The tool plans
each one with the flags the file gives, on that card, and compares `memory.fits` with the outcome.
This is the question fsdp-plan exists to answer, asked of runs nobody tuned it on: the file was
collected after the memory model was written, and no constant of the model is read from it.

A run may carry `"known_disagreement": "why"`: the check then requires the verdict to differ from
the outcome (so the note cannot go stale when a change fixes it) and prints the reason.

Usage: tools/fits_check.py --fsdp-plan build/fsdp-plan [--data docs/data/fits_published.json]
Prints one line per run: outcome, verdict, the margin (headroom, negative when short) and the
reserved peak. Exit status: 0 every verdict as expected, 1 otherwise (each difference printed),
2 a run the file describes cannot be planned.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2.0 ** 30


def plan(fsdp_plan, flags):
    """fsdp-plan's JSON report's memory and hardware objects for these flags, or raises with its one-line error."""
    env = dict(os.environ, FSDPKIT_DATA_DIR=ROOT)
    out = subprocess.run([os.path.abspath(fsdp_plan)] + shlex.split(flags) + ["--json"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"fsdp-plan exit {out.returncode}: {out.stderr.strip()}")
    report = json.loads(out.stdout)
    return report["memory"], report["hardware"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fsdp-plan", required=True)
    ap.add_argument("--data", default=os.path.join(ROOT, "docs", "data", "fits_published.json"))
    args = ap.parse_args()
    runs = json.load(open(args.data))["runs"]
    unexpected, agree = [], 0
    print(f"{'run':44s} {'card':12s} {'outcome':8s} {'fsdp-plan':9s} {'margin GiB':>10s} {'reserved GiB':>12s} {'published GiB':>13s}")
    for run in runs:
        try:
            mem, hw = plan(args.fsdp_plan, run["flags"])
        except (RuntimeError, ValueError, KeyError, subprocess.TimeoutExpired) as e:
            print(f"{run['id']}: cannot plan: {e}")
            return 2
        verdict = "fits" if mem["fits"] else "OOM"
        expected = "fits" if run["outcome"] == "ran" else "OOM"
        published = run.get("published_gib")
        line = (f"{run['id']:44s} {hw['id']:12s} {run['outcome']:8s} {verdict:9s} {mem['headroom_bytes'] / GIB:10.2f} "
                f"{mem['per_gpu']['reserved_peak_bytes'] / GIB:12.2f} {('%.2f ' % published + run.get('published_kind', '')) if published else '':>13s}")
        known = run.get("known_disagreement")
        if verdict == expected and not known:
            agree += 1
            print(line)
        elif verdict != expected and known:
            print(line + "  (known: " + known + ")")
        elif known:
            unexpected.append(f"{run['id']}: listed as a known disagreement, but fsdp-plan now agrees ({verdict}); update the file")
            print(line + "  AGREES NOW")
        else:
            unexpected.append(f"{run['id']}: published {run['outcome']}, fsdp-plan says {verdict} "
                              f"(margin {mem['headroom_bytes'] / GIB:.2f} GiB)")
            print(line + "  DISAGREES")
    print(f"\n{agree} of {len(runs)} verdicts agree with the published outcome; "
          f"{sum(1 for r in runs if r.get('known_disagreement'))} known disagreements")
    for u in unexpected:
        print("unexpected: " + u)
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
