"""What PyTorch holds at its peak, tensor by tensor: tools/torch_reference.py's tracked step, with
FSDPMemTracker replaced by a subclass that records, whenever the tracked total reaches a new
maximum, every live storage with its tracker category and the op that made it (sequence number,
aten op, shape, dtype, forward or backward, innermost module). Written per rank as JSON, with a
summary of the largest tensors printed by rank 0.

    python tools/peak_trace.py OUT_PREFIX [torch_reference.py arguments]
    python tools/peak_trace.py OUT_PREFIX --script torchtitan_memory.py [its arguments]
    python -m torch.distributed.run --standalone --nproc-per-node 2 tools/peak_trace.py OUT_PREFIX ...

writes OUT_PREFIX.<rank>.json: {"seq", "op", "where", "parents", "snap" (the tracker's categories),
"live": [[bytes, category, [seq, op, shape, dtype, fw|bw, module] or null], ...]}. fsdp-plan's
backward moments (src/planner/activation_model.cc, MarkSoftmaxBackward; memory_model.cc, the
eager masks) were derived from these lists.

Reads: torch/distributed/_tools/mem_tracker.py (MemTracker.__torch_dispatch__, _WINFO,
_curr_mem_snap) of the pinned torch; a private API, as torch_reference.py's tracker step is.
"""
import atexit
import json
import os
import runpy
import sys

import torch
import torch.distributed._tools.fsdp2_mem_tracker as fsdp2_mem_tracker
from torch.distributed._tools.mem_tracker import _TOTAL_KEY
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary


# PEAK_TRACE_WITHIN="bw:layers.7": the highest moment inside one module's backward (or "fw:" forward)
# instead of the step's, with the tracked total after each of its ops ("path" in the JSON)
WITHIN = tuple(os.environ["PEAK_TRACE_WITHIN"].split(":", 1)) if os.environ.get("PEAK_TRACE_WITHIN") else None


class PeakTracker(fsdp2_mem_tracker.FSDPMemTracker):
    last = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.origin = WeakIdKeyDictionary()
        self.best = 0
        self.at_peak = None
        self.seq = 0
        self.path = []  # under PEAK_TRACE_WITHIN: (seq, op, module, tracked total) after each op of the window
        PeakTracker.last = self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        res = super().__torch_dispatch__(func, types, args, kwargs)
        if res is NotImplemented:
            return res
        self.seq += 1
        where = "bw" if self._mod_tracker.is_bw else "fw"
        parents = sorted(self._mod_tracker.parents, key=len)
        for t in tree_flatten(res)[0]:
            if isinstance(t, torch.Tensor):
                try:
                    st = t.untyped_storage()
                except (RuntimeError, NotImplementedError):
                    continue
                if st not in self.origin:
                    self.origin[st] = (self.seq, str(func), list(t.shape), str(t.dtype).replace("torch.", ""),
                                       where, parents[-1] if parents else "")
        if WITHIN and not (where == WITHIN[0] and any(WITHIN[1] in p for p in parents)):
            return res
        for snap in self._curr_mem_snap.values():
            if WITHIN:
                self.path.append((self.seq, str(func), parents[-1] if parents else "", snap[_TOTAL_KEY]))
            if snap[_TOTAL_KEY] > self.best:
                self.best = snap[_TOTAL_KEY]
                live = [(winfo.mem_consumed, str(winfo.reftype), self.origin.get(st, None))
                        for st, (winfo, _) in self._WINFO.items()]
                self.at_peak = {"seq": self.seq, "op": str(func), "where": where, "parents": parents,
                                "snap": {str(k): v for k, v in snap.items()}, "live": live}
        return res


def dump(prefix):
    tracker = PeakTracker.last
    if tracker is None or tracker.at_peak is None:
        return
    rank = os.environ.get("RANK", "0")
    with open(f"{prefix}.{rank}.json", "w") as f:
        json.dump(dict(tracker.at_peak, path=tracker.path), f)
    if rank == "0":
        peak = tracker.at_peak
        print(f"peak_trace: {peak['snap'][_TOTAL_KEY]} bytes at op {peak['seq']} ({peak['op']}, {peak['where']})")
        for size, kind, origin in sorted(peak["live"], key=lambda x: -x[0])[:25]:
            print(f"  {size:12d} {kind.split('.')[-1]:15s} {origin}")


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: peak_trace.py OUT_PREFIX [torch_reference.py arguments]")
    prefix = sys.argv[1]
    fsdp2_mem_tracker.FSDPMemTracker = PeakTracker
    atexit.register(dump, prefix)
    script, rest = "torch_reference.py", sys.argv[2:]
    if rest[:1] == ["--script"] and len(rest) > 1:  # another tool of this directory that tracks with FSDPMemTracker
        script, rest = rest[1], rest[2:]
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    sys.argv = [script] + rest
    runpy.run_path(os.path.join(here, script), run_name="__main__")


if __name__ == "__main__":
    main()
