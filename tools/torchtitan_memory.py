"""The tensors PyTorch FSDP2 holds at the peak of a torchtitan training step, on CPU ranks: the
reference side of issue 17's implementation profile (`--impl torchtitan`, not built yet). Runs
torchtitan's own Llama 3 model, its own FSDP2 wrapping and activation checkpointing, and its own
loss, and records FSDPMemTracker's categories at the peak the way tools/torch_reference.py does
for transformers' models (the same tracker, less its own reference: fsdp2_tracker_class).

    PYTHONPATH=DIR python tools/torchtitan_memory.py --dim 768 --layers 8 --heads 12 --kv-heads 4 \
        --vocab 32000 --seq-len 1024 --micro-batch 2 --ac none --out result.json
    python -m torch.distributed.run --standalone --nproc-per-node 2 tools/torchtitan_memory.py ...

Needs torchtitan 0.2.2 (the last release that imports on the project's torch 2.11; 0.3.0 needs
2.14, docs/torchtitan-0.3.0.md) and what its package imports:
    pip install --no-deps torchtitan==0.2.2 torchdata && pip install tyro tensorboard
(DIR: where they were installed, when not into the venv itself).
--version 2025-01 runs the main branch as it stood for torchtitan's January 2025 performance
tables (docs/performance.md of commit d4c86e3, the Llama 3.1 8B rows of docs/data): its
models/llama/model.py (a Python RMSNorm upcasting to fp32) and parallelisms/parallelize_llama.py
(blocks, the last one not resharded after forward, then the root; op-SAC's _save_list), which
import on torch 2.11. Its Python files from a torchtitan clone, with an __init__.py it lacked:
    git -C TORCHTITAN archive d4c86e375 -- $(git -C TORCHTITAN ls-tree -r --name-only d4c86e375 torchtitan | grep '\.py$') | tar -x -C DIR
    touch DIR/torchtitan/__init__.py

What it follows of torchtitan 0.2.2 (paths in its wheel):
* models/llama3/model/model.py, model/args.py   Transformer, TransformerModelArgs (attn_type
  "sdpa", causal mask), init_weights under no_grad
* models/qwen3/model/model.py, model/args.py     Qwen3Model (--family qwen3: nn.RMSNorm q_norm and
  k_norm per head, a fp32 rope_cache [max_seq_len, 2 head_dim] cast to the activations' dtype in
  every attention); its infra/parallelize.py: llama4's apply_fsdp (the same units) and the same
  op-SAC save list
* models/llama3/infra/parallelize.py apply_fsdp  fully_shard(tok_embeddings), each block,
  [norm, output] (not resharded after forward), then the root; MixedPrecisionPolicy(bf16, fp32);
  on more than one rank FSDP's own gradient division instead of its factor 1.0 (gloo has no
  PREMUL_SUM; the division is in place either way)
* distributed/activation_checkpoint.py apply_ac  "full" and op-level "selective" with
  llama3's _op_sac_save_list
* components/loss.py cross_entropy_loss          cross_entropy(pred.flatten(0, 1).float(), sum)
* train.py forward_backward_step                 `del pred` before loss.backward()
* components/optimizer                           AdamW (foreach), zero_grad(set_to_none=True)
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--family", choices=["llama3", "qwen3"], default="llama3",
                   help="torchtitan 0.2.2's models/llama3 or models/qwen3 (dense: q/k norms, its own RoPE cache)")
    p.add_argument("--head-dim", type=int, default=128, help="qwen3: head_dim (Qwen3 sets it apart from dim / heads)")
    p.add_argument("--hidden-dim", type=int, default=2048, help="qwen3: the MLP's width (hidden_dim, taken as given)")
    p.add_argument("--multiple-of", type=int, default=256)
    p.add_argument("--ffn-dim-multiplier", type=float, default=None)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--ac", choices=["none", "full", "selective-op"], default="none")
    p.add_argument("--norm", choices=["cuda", "cpu"], default="cuda",
                   help="cuda: RMSNorm saves what CUDA's _fused_rms_norm saves (the default: the GPU being planned); "
                        "cpu: ATen's CPU composite, which saves fp32 copies")
    p.add_argument("--version", choices=["0.2.2", "2025-01"], default="0.2.2",
                   help="0.2.2: the PyPI release; 2025-01: the main branch of torchtitan's January 2025 Llama 3.1 "
                        "performance tables (commit d4c86e3), its torchtitan/ tree on PYTHONPATH (see below)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    return p.parse_args()


def build(args):
    import torch
    if args.family == "qwen3":
        from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
        from torchtitan.models.qwen3.model.model import Qwen3Model
        # Qwen3ModelArgs.update_from_config sets max_seq_len to the training seq_len
        model_args = Qwen3ModelArgs(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
                                    vocab_size=args.vocab, head_dim=args.head_dim, hidden_dim=args.hidden_dim,
                                    max_seq_len=args.seq_len, qk_norm=True)
        torch.manual_seed(args.seed)
        model = Qwen3Model(model_args)
        with torch.no_grad():
            model.init_weights()
        return model, model_args
    if args.version == "2025-01":
        from torchtitan.models.llama.model import ModelArgs as TransformerModelArgs, Transformer
    else:
        from torchtitan.models.llama3.model.args import TransformerModelArgs
        from torchtitan.models.llama3.model.model import Transformer

    model_args = TransformerModelArgs(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
                                      vocab_size=args.vocab, multiple_of=args.multiple_of,
                                      ffn_dim_multiplier=args.ffn_dim_multiplier, max_seq_len=args.seq_len)
    torch.manual_seed(args.seed)
    model = Transformer(model_args)
    with torch.no_grad():
        model.init_weights()
    return model, model_args


def apply_ac(model, mode, version, family):
    if mode == "none":
        return
    import torch
    aten = torch.ops.aten
    if version == "2025-01":
        import importlib
        from types import SimpleNamespace
        parallelize_llama = importlib.import_module("torchtitan.parallelisms.parallelize_llama")  # the package exports a function of that name

        if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):  # as below
            parallelize_llama._save_list.add(aten._scaled_dot_product_flash_attention_for_cpu.default)
        parallelize_llama.apply_ac(model, SimpleNamespace(mode="full" if mode == "full" else "selective", selective_ac_option="op"))
        return
    from torchtitan.config.job_config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import apply_ac as titan_apply_ac
    import importlib
    parallelize = importlib.import_module(f"torchtitan.models.{family}.infra.parallelize")

    config = ActivationCheckpoint(mode="full" if mode == "full" else "selective", selective_ac_option="op")
    # the list names CUDA's SDPA kernels; the CPU runs its own flash kernel, which CUDA's
    # _scaled_dot_product_flash_attention stands for (as tools/torch_reference.py does)
    save_list = set(parallelize._op_sac_save_list)
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        save_list.add(aten._scaled_dot_product_flash_attention_for_cpu.default)
    titan_apply_ac(model, config, op_sac_save_list=save_list)


def use_fused_rms_norm():
    """nn.RMSNorm as CUDA runs it. torch 2.11's rms_norm_symint sends a CUDA input whose dtype
    matches the weight's to aten::_fused_rms_norm, whose autograd node (FusedRmsNormBackward0,
    derivatives.yaml) saves the input and its fp32 rstd [..., 1] only (checked with FakeTensorMode on a
    'cuda' bf16 tensor); the CPU has no such kernel and runs the composite, which saves the fp32 input
    and the fp32 normalised input besides. This autograd.Function saves what the CUDA node saves and
    works row-chunk by row-chunk, so that its fp32 temporaries stay as small as the CUDA kernel's."""
    import torch

    rows_per_chunk = 256

    class FusedRmsNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, eps):
            flat = x.reshape(-1, x.shape[-1])
            out = torch.empty_like(flat)
            rstd = torch.empty(flat.shape[0], 1, dtype=torch.float32)
            for r in range(0, flat.shape[0], rows_per_chunk):
                xf = flat[r:r + rows_per_chunk].float()
                rstd[r:r + rows_per_chunk] = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
                out[r:r + rows_per_chunk] = (xf * rstd[r:r + rows_per_chunk] * weight.float()).to(x.dtype)
            ctx.save_for_backward(x, rstd, weight)
            return out.view(x.shape)

        @staticmethod
        def backward(ctx, grad):
            x, rstd, weight = ctx.saved_tensors
            flat, gflat = x.reshape(-1, x.shape[-1]), grad.reshape(-1, x.shape[-1])
            grad_x = torch.empty_like(flat)
            grad_w = torch.zeros(x.shape[-1], dtype=torch.float32)
            w = weight.float()
            for r in range(0, flat.shape[0], rows_per_chunk):
                xhat = flat[r:r + rows_per_chunk].float() * rstd[r:r + rows_per_chunk]
                g = gflat[r:r + rows_per_chunk].float()
                grad_w += (g * xhat).sum(0)
                wg = g * w
                grad_x[r:r + rows_per_chunk] = (rstd[r:r + rows_per_chunk] * (wg - xhat * (wg * xhat).mean(-1, keepdim=True))).to(x.dtype)
            return grad_x.view(x.shape), grad_w.to(weight.dtype), None

    def forward(self, x):
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return FusedRmsNorm.apply(x, self.weight, eps)

    torch.nn.RMSNorm.forward = forward


def shard(model, world, version, family):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    if version == "2025-01":  # blocks (the last not resharded after forward), then the root; FSDP's own division
        from torchtitan.parallelisms.parallelize_llama import apply_fsdp
        apply_fsdp(model, init_device_mesh("cpu", (world,)), param_dtype=torch.bfloat16, reduce_dtype=torch.float32, pp_enabled=False)
        # its fully_shard(model, reshard_after_forward=True): the torch of January 2025 kept the root
        # unsharded after forward whatever it was told; torch 2.11 does as told (pytorch#154704,
        # June 2025). The runs it published had the root kept, so the reference restores that.
        model.set_reshard_after_forward(False, recurse=False)
        return
    import importlib
    apply_fsdp = importlib.import_module(f"torchtitan.models.{family}.infra.parallelize").apply_fsdp  # qwen3's: llama4's, the same units

    mesh = init_device_mesh("cpu", (world,))
    apply_fsdp(model, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, pp_enabled=False)
    if world > 1:
        # apply_fsdp's disable_fsdp_gradient_division (factor 1.0) reduces with ReduceOp.PREMUL_SUM,
        # which gloo lacks: back to FSDP's own division, an in-place op on the same buffers
        from torch.distributed.fsdp import FSDPModule
        for module in model.modules():
            if isinstance(module, FSDPModule) and (group := module._get_fsdp_state()._fsdp_param_group) is not None:
                group.gradient_divide_factor = None


def step(model, optimizer, inputs, labels):
    import torch

    optimizer.zero_grad(set_to_none=True)
    pred = model(inputs)
    loss = torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")
    del pred
    loss.backward()
    optimizer.step()
    return loss.detach()


def main():
    args = parse_args()
    if args.family == "qwen3" and args.version != "0.2.2":
        sys.exit("torchtitan_memory.py: --family qwen3 is torchtitan 0.2.2's (the January 2025 tree had no Qwen3)")
    import torch
    import torch.distributed as dist
    from torch_reference import fsdp2_tracker_class

    if "RANK" not in os.environ:  # one process: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.norm == "cuda":
        use_fused_rms_norm()
    model, model_args = build(args)
    apply_ac(model, args.ac, args.version, args.family)
    shard(model, world, args.version, args.family)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=True)
    g = torch.Generator().manual_seed(args.seed + rank)
    tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq_len + 1), generator=g)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    first = step(model, optimizer, inputs, labels)  # creates AdamW's states
    tracker = fsdp2_tracker_class()(model, optimizer)
    tracker.track_inputs((inputs, labels))
    with tracker:
        second = step(model, optimizer, inputs, labels)
    snapshot = tracker.get_tracker_snapshot("peak")
    per_device = next(v for k, v in snapshot.items() if str(k) == "cpu")
    categories = {str(getattr(k, "value", k)): int(v) for k, v in per_device.items()}
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        report = {"torchtitan_model": args.family, "torchtitan_version": args.version, "model_args": {k: getattr(model_args, k, None) for k in
                                                              ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim", "vocab_size", "multiple_of",
                                                               "ffn_dim_multiplier", "norm_eps", "rope_theta", "attn_type")},
                  "params": params, "world": world, "seq_len": args.seq_len, "micro_batch": args.micro_batch, "ac": args.ac, "norm": args.norm,
                  "loss": [float(first), float(second)], "categories_at_peak": categories}
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"torchtitan {args.version} {args.family} {params:,} params, world {world}, ac {args.ac}: peak {categories['Total']:,} bytes")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
