#!/usr/bin/env python3
"""fsdp-plan's "fits" verdict against published runs that ran or ran out of memory.

Each run of docs/data/fits_published.json was published with its outcome on a named card: it
trained ("ran", often with its peak memory), or it stopped with a CUDA out-of-memory error ("oom").
The tool plans each one with the flags the file gives, on that card, and compares `memory.fits` with
the outcome. This is the question fsdp-plan exists to answer, asked of runs nobody tuned it on: the
file was collected after the memory model was written, and no constant of the model is read from it.

A run may carry `"known_disagreement": "why"`: the check then requires the verdict to differ from
the outcome (so the note cannot go stale when a change fixes it) and prints the reason. A run may
carry `"close_call": "why"`: its verdict is printed, not held, because its margin lies within what
the card's CUDA total moves by between drivers.

Usage: python3 tools/fits_check.py --fsdp-plan build/fsdp-plan [--data docs/data/fits_published.json]
Prints one line per run: outcome, verdict, the margin (headroom, negative when short) and the
reserved peak. Exit status: 0 every held verdict as expected, 1 otherwise (each difference printed),
2 the file or a run in it cannot be read or planned (the reason printed).
"""

import argparse
import json
import os
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2.0 ** 30
OUTCOMES = {"ran": "fits", "oom": "OOM"}


class Unplannable(Exception):
    pass


def plan(fsdp_plan, flags):
    """(memory.fits, memory.headroom_bytes, reserved peak bytes, hardware id) of fsdp-plan's JSON
    report for these flags; Unplannable with the reason where there is none."""
    env = dict(os.environ, FSDPKIT_DATA_DIR=ROOT)
    try:
        out = subprocess.run([os.path.abspath(fsdp_plan)] + shlex.split(flags) + ["--json"], capture_output=True, text=True, env=env,
                             cwd=ROOT, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Unplannable(f"cannot run fsdp-plan: {e}")
    if out.returncode != 0:
        raise Unplannable(f"fsdp-plan exit {out.returncode}: {out.stderr.strip()}")
    try:
        report = json.loads(out.stdout)
        memory = report["memory"]
        return bool(memory["fits"]), memory["headroom_bytes"], memory["per_gpu"]["reserved_peak_bytes"], report["hardware"]["id"]
    except (ValueError, KeyError, TypeError) as e:
        raise Unplannable(f"fsdp-plan's report lacks {e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fsdp-plan", required=True)
    ap.add_argument("--data", default=os.path.join(ROOT, "docs", "data", "fits_published.json"))
    args = ap.parse_args()
    try:
        runs = json.load(open(args.data))["runs"]
    except (OSError, ValueError, KeyError) as e:
        print(f"{args.data}: cannot read its runs: {e}")
        return 2
    unexpected, agree, known, close = [], 0, 0, 0
    print(f"{'run':50s} {'card':14s} {'outcome':8s} {'fsdp-plan':9s} {'margin GiB':>10s} {'reserved GiB':>12s}  published GiB")
    for run in runs:
        rid = run.get("id", "?")
        if run.get("outcome") not in OUTCOMES or not isinstance(run.get("flags"), str):
            print(f"{rid}: needs an outcome ('ran' or 'oom') and flags")
            return 2
        try:
            fits, headroom, reserved, card = plan(args.fsdp_plan, run["flags"])
        except Unplannable as e:
            print(f"{rid}: cannot plan: {e}")
            return 2
        verdict = "fits" if fits else "OOM"
        published = run.get("published_gib")
        line = (f"{rid:50s} {card:14s} {run['outcome']:8s} {verdict:9s} {headroom / GIB:10.2f} {reserved / GIB:12.2f}  "
                f"{('%.2f %s' % (published, run.get('published_kind', ''))) if published else ''}")
        same = verdict == OUTCOMES[run["outcome"]]
        if run.get("close_call"):
            close += 1
            print(line + f"  (close call, not held: {'agrees' if same else 'differs'})")
        elif run.get("known_disagreement"):
            if same:
                unexpected.append(f"{rid}: listed as a known disagreement, but fsdp-plan now agrees ({verdict}); update the file")
                print(line + "  AGREES NOW")
            else:
                known += 1
                print(line + "  (known disagreement)")
        elif same:
            agree += 1
            print(line)
        else:
            unexpected.append(f"{rid}: published {run['outcome']}, fsdp-plan says {verdict} (margin {headroom / GIB:.2f} GiB)")
            print(line + "  DISAGREES")
    held = len(runs) - close
    print(f"\n{agree} of {held} held verdicts agree with the published outcome, {known} known disagreement(s); "
          f"{close} close call(s) printed, not held")
    for u in unexpected:
        print("unexpected: " + u)
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
