"""Reentrant checkpointing under FSDP1 against fsdp-plan --ac-reentrant, on CPU ranks.

transformers before 4.52 calls the checkpoint around each decoder layer from the model's layer loop,
so around the layer's FSDP1 unit; with use_reentrant=True (the HF Trainer's gradient_checkpointing=True
from 4.35) the unit's pre-forward first runs with grad enabled in the recomputation, on a detached
input, and a frozen unit (LoRA under peft's wrap) registers its reshard-only post-backward hook there
(torch/distributed/fsdp/_runtime_utils.py, _register_post_backward_reshard_only_hook), which holds
the input and its gradient until _finalize_params at the end of backward.

This runs one step of a peft LoRA Llama under FullyShardedDataParallel (peft's fsdp_auto_wrap_policy,
pure bf16, no MixedPrecision, as fms-acceleration's benchmark runs it) twice, with HF's gradient
checkpointing reentrant (and enable_input_require_grads, which it needs) and non-reentrant, and counts the bytes of the tensors the step makes (a
dispatch mode that follows every new storage until it is freed; FSDP1's frozen flat parameters are
beyond MemTracker). The difference of the two peaks is set against fsdp-plan's, with and without
--ac-reentrant. Needs a transformers before 4.52 on PYTHONPATH (./fsdpkit test installs 4.48.1 in the
venv's transformers-4.48.1).

    python tools/reentrant_check.py --fsdp-plan build/fsdp-plan [--model CONFIG] [--max-error-pct 3]

Exit 0 within the bound, 1 past it, 77 when torch, peft or a transformers before 4.52 is missing.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import weakref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ, MICRO, RANKS = 1024, 2, 2


def run_rank(mode, model_path, out):
    """One step under a storage-following dispatch mode (a torchrun worker)."""
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from peft import LoraConfig, get_peft_model
    from peft.utils.other import fsdp_auto_wrap_policy
    from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel, ShardingStrategy
    from transformers import LlamaConfig, LlamaForCausalLM

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    config = LlamaConfig.from_json_file(model_path)
    config._attn_implementation = "sdpa"
    torch.set_default_dtype(torch.bfloat16)  # pure bf16: the base and the adapters
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"})
    if mode == "reentrant":  # which reentrant checkpointing needs (the HF Trainer and TRL call it), as fsdp-plan --ac-reentrant
        model.enable_input_require_grads()
    model = FullyShardedDataParallel(model, auto_wrap_policy=fsdp_auto_wrap_policy(model), sharding_strategy=ShardingStrategy.FULL_SHARD,
                                     backward_prefetch=BackwardPrefetch.BACKWARD_PRE, limit_all_gathers=True, device_id=torch.device("cpu"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, config.vocab_size, (MICRO, SEQ))

    class Storages(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live, self.now, self.peak = {}, 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            for t in tree_flatten(result)[0]:
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    key = storage._cdata
                    if key in self.live:
                        continue
                    self.live[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self.freed, key)
            return result

        def freed(self, key):
            self.now -= self.live.pop(key, 0)

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer's states exist before the measured step
    tracker = Storages()
    with tracker:
        step()
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"peak_bytes": tracker.peak}, f)
    dist.destroy_process_group()


def plan_peak(fsdp_plan, model_path, reentrant):
    args = [fsdp_plan, "--model", model_path, "--gpu", "h100-sxm", "--gpus", str(RANKS), "--framework", "fsdp1", "--ac", "full",
            "--micro-batch", str(MICRO), "--seq-len", str(SEQ), "--attention", "flash", "--lora-rank", "8", "--lora-targets", "q_proj,v_proj",
            "--master-dtype", "bf16", "--reduce-dtype", "bf16", "--transformers-version", "4.48", "--cublas-workspace-bytes", "0", "--torch-device", "cpu", "--json"]
    out = subprocess.run(args + (["--ac-reentrant"] if reentrant else []), check=True, capture_output=True, text=True).stdout
    return json.loads(out)["memory"]["per_gpu"]["allocated_peak_bytes"]


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        run_rank(sys.argv[2], sys.argv[3], sys.argv[4])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fsdp-plan", required=True)
    p.add_argument("--model", default=os.path.join(ROOT, "tests/data/hf_configs/llama-100m-2k-vocab.json"))
    p.add_argument("--max-error-pct", type=float, default=3.0)
    args = p.parse_args()
    try:
        import peft  # noqa: F401
        import torch  # noqa: F401
        import transformers
    except ImportError as e:
        print(f"reentrant_check: skipped: {e}")
        return 77
    if tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (4, 52):
        print(f"reentrant_check: skipped: transformers {transformers.__version__} checkpoints inside the layer (4.52 on); put 4.48.1 on PYTHONPATH")
        return 77
    from cpu_bf16_gemm import skip_reason  # tools/, beside this file
    if reason := skip_reason("reentrant_check"):  # it trains pure bf16
        print(reason)
        return 77
    measured = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("reentrant", "non-reentrant"):
            out = os.path.join(tmp, mode + ".json")
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
                            os.path.abspath(__file__), "--rank", mode, args.model, out], check=True, stdout=subprocess.DEVNULL)
            with open(out) as f:
                measured[mode] = json.load(f)["peak_bytes"]
    torch_more = measured["reentrant"] - measured["non-reentrant"]
    plan_more = plan_peak(args.fsdp_plan, args.model, True) - plan_peak(args.fsdp_plan, args.model, False)
    error = 100 * (plan_more - torch_more) / torch_more
    print(f"transformers {transformers.__version__}, FSDP1 LoRA, {RANKS} ranks, {SEQ} x {MICRO}: reentrant checkpointing holds "
          f"{torch_more} bytes more at the peak in PyTorch, {plan_more} in fsdp-plan ({error:+.2f}%)")
    return 0 if abs(error) <= args.max_error_pct else 1


if __name__ == "__main__":
    sys.exit(main())
