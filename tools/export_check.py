#!/usr/bin/env python3
"""Runs the PyTorch code `fsdp-plan --export fsdp2` writes, on real PyTorch FSDP2 (CPU, gloo).

For each case a small model is built with transformers, fsdp-plan exports the configuration, the
exported code is executed on that model (the device mesh moved from "cuda" to "cpu", nothing else
changed), and two AdamW steps are trained. Checked:
  * the exported code runs and shards the model (every decoder layer and the root are FSDP2
    modules);
  * its losses equal those of the same model trained without FSDP and without checkpointing
    (fp32, 1 rank: relative difference below 1e-5), so the checkpointing code recomputes exactly;
  * with --ac selective, no tensor of the attention scores' shape [B, heads, s, s] is saved for
    backward (the attention core is recomputed), while without checkpointing one is saved per layer;
  * with --ac full --ac-every N, exactly the blocks N, 2N, ... (counting from 1) are wrapped in
    checkpoint_wrapper;
  * with --ac selective-op (torchtitan's op-level policy), every block is wrapped in
    checkpoint_wrapper and, with eager attention, no scores-shaped tensor is saved (the core is
    among the ops recomputed);
  * with --lora-rank, the export wraps the model with peft itself: its losses equal peft's own
    LoRA model trained without FSDP, and only the adapters require grad (as many as peft's);
  * the QLoRA exports (pytorch, fsdp2, lightning) compile;
  * with --param-dtype fp16, the export's ShardedGradScaler (moved to the CPU) drives the loop as
    its comment says (scaler.scale(loss).backward(), scaler.step, scaler.update), the scale stays at
    2^16 (no step overflows) and the losses stay within fp16 rounding (5e-3) of the fp32 reference.

Usage: tools/export_check.py --fsdp-plan build/fsdp-plan
Exit status: 0 all cases pass, 1 a case fails, 77 torch/transformers missing.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ, BATCH = 12, 2  # SEQ differs from head_dim (16): only the scores are [B, heads, SEQ, SEQ]
TINY = {
    "llama": {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "tie_word_embeddings": False},
    "qwen3": {"model_type": "qwen3", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
              "max_position_embeddings": 64, "tie_word_embeddings": False},
    "qwen3_moe": {"model_type": "qwen3_moe", "vocab_size": 128, "hidden_size": 64, "moe_intermediate_size": 32,
                  "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64, "tie_word_embeddings": False},
    "olmo2": {"model_type": "olmo2", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "tie_word_embeddings": False, "pad_token_id": 1, "eos_token_id": 2},
    "phi3": {"model_type": "phi3", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 64, "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1,
             "eos_token_id": 2},
    "gemma2": {"model_type": "gemma2", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
               "query_pre_attn_scalar": 16, "sliding_window": 8, "max_position_embeddings": 64},
    "gemma3_text": {"model_type": "gemma3_text", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                    "query_pre_attn_scalar": 16, "sliding_window": 8, "sliding_window_pattern": 2, "max_position_embeddings": 64},
    "deepseek_v3": {"model_type": "deepseek_v3", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
                    "moe_intermediate_size": 32, "num_hidden_layers": 2, "first_k_dense_replace": 1, "num_attention_heads": 4,
                    "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
                    "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2,
                    "topk_group": 1, "max_position_embeddings": 64, "tie_word_embeddings": False},
    "gpt_oss": {"model_type": "gpt_oss", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 32,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8, "max_position_embeddings": 64,
                "tie_word_embeddings": False},
    "llama4_text": {"model_type": "llama4_text", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 32,
                    "intermediate_size_mlp": 96, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2,
                    "max_position_embeddings": 64, "tie_word_embeddings": False},
    "gemma3": {"model_type": "gemma3", "mm_tokens_per_image": 4,
               "text_config": {"model_type": "gemma3_text", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                               "query_pre_attn_scalar": 16, "sliding_window": 8, "sliding_window_pattern": 2,
                               "max_position_embeddings": 64},
               "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 48,
                                 "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 28, "patch_size": 14,
                                 "vision_use_head": False}},
    "gpt2": {"model_type": "gpt2", "vocab_size": 128, "n_embd": 64, "n_layer": 2, "n_head": 4,
             "n_positions": 64, "attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
             "bos_token_id": 0, "eos_token_id": 0},
}
# (name, family, param dtype, fsdp-plan flags): selective with eager and with SDPA attention, full
# checkpointing, fp16 with its loss scaler, and the newer families' decoder layers (issue 18)
CASES = [
    ("llama selective eager", "llama", "fp32", ["--ac", "selective", "--attention", "eager"]),
    ("llama selective sdpa", "llama", "fp32", ["--ac", "selective", "--attention", "flash"]),
    ("gpt2 selective eager", "gpt2", "fp32", ["--ac", "selective", "--attention", "eager"]),
    ("llama full", "llama", "fp32", ["--ac", "full", "--attention", "eager"]),
    ("llama full every 2nd", "llama", "fp32", ["--ac", "full", "--ac-every", "2", "--attention", "eager"]),
    ("llama selective-op", "llama", "fp32", ["--ac", "selective-op", "--attention", "eager"]),
    ("llama fp16 scaler", "llama", "fp16", ["--ac", "none", "--attention", "eager"]),
    ("llama lora full ac", "llama", "fp32", ["--ac", "full", "--attention", "eager", "--lora-rank", "4", "--lora-targets", "q_proj,v_proj",
                                             "--lora-alpha", "16"]),
    ("qwen3 selective eager", "qwen3", "fp32", ["--ac", "selective", "--attention", "eager"]),
    ("qwen3_moe full sdpa", "qwen3_moe", "fp32", ["--ac", "full", "--attention", "flash"]),
    ("olmo2 full eager", "olmo2", "fp32", ["--ac", "full", "--attention", "eager"]),
    ("phi3 selective sdpa", "phi3", "fp32", ["--ac", "selective", "--attention", "flash"]),
    ("gemma2 full eager", "gemma2", "fp32", ["--ac", "full", "--attention", "eager"]),
    ("gemma3_text selective sdpa", "gemma3_text", "fp32", ["--ac", "selective", "--attention", "flash"]),
    ("deepseek_v3 selective eager", "deepseek_v3", "fp32", ["--ac", "selective", "--attention", "eager"]),
    ("gpt_oss selective eager", "gpt_oss", "fp32", ["--ac", "selective", "--attention", "eager"]),
    ("llama4_text full sdpa", "llama4_text", "fp32", ["--ac", "full", "--attention", "flash"]),
    ("gemma3 vision selective sdpa", "gemma3", "fp32", ["--ac", "selective", "--attention", "flash"]),
    ("gemma3 vision lora q,v", "gemma3", "fp32", ["--ac", "none", "--attention", "flash", "--lora-rank", "4",
                                                   "--lora-targets", "q_proj,v_proj"]),
    ("gpt2 lora all-linear", "gpt2", "fp32", ["--ac", "none", "--attention", "eager", "--lora-rank", "2", "--lora-targets", "all-linear"]),
]
# QLoRA plans, whose exports load the model through bitsandbytes (a comment here): each format's
# Python is compiled, not run
QLORA_FLAGS = ["--lora-rank", "8", "--qlora", "--qlora-double-quant", "--ac", "full"]


def exported_code(fsdp_plan, config_path, dtype, flags):
    cmd = [fsdp_plan, "--model", config_path, "--gpu", "h100-sxm", "--gpus", "1", "--framework", "fsdp2",
           "--strategy", "FULL_SHARD", "--param-dtype", dtype, "--reduce-dtype", "fp32", "--seq-len", str(SEQ),
           "--micro-batch", str(BATCH), "--export", "fsdp2", *flags]
    code = subprocess.run(cmd, check=True, capture_output=True, text=True,
                          env=dict(os.environ, FSDPKIT_DATA_DIR=ROOT)).stdout
    if 'init_device_mesh("cuda"' not in code:
        raise SystemExit("export_check: the export has no init_device_mesh(\"cuda\", ...) to move to the CPU")
    if dtype == "fp16" and "scaler = ShardedGradScaler()" not in code:
        raise SystemExit("export_check: the fp16 export has no ShardedGradScaler")
    code = code.replace("scaler = ShardedGradScaler()", 'scaler = ShardedGradScaler(device="cpu")')
    return code.replace('init_device_mesh("cuda"', 'init_device_mesh("cpu"')


def flag(flags, name, default=None):
    return flags[flags.index(name) + 1] if name in flags else default


def with_lora(model, flags):
    """peft's LoRA as the plan's flags give it (the reference of a LoRA export), or the model as it is."""
    if "--lora-rank" not in flags:
        return model
    from peft import LoraConfig, get_peft_model

    targets = flag(flags, "--lora-targets")
    targets = targets if targets == "all-linear" else targets.split(",")
    return get_peft_model(model, LoraConfig(r=int(flag(flags, "--lora-rank")), lora_alpha=float(flag(flags, "--lora-alpha", 8)),
                                            target_modules=targets, task_type="CAUSAL_LM"))


def build(family, attention):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**TINY[family])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    model.train()
    return model


def batches():
    import torch

    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (BATCH, SEQ + 1), generator=g) for _ in range(2)]


def train(model, data, watch_shape=None, scaler=None):
    """Two AdamW steps (through `scaler` when given); returns the losses and how many saved tensors
    had watch_shape."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, matches = [], 0

    def pack(t):
        nonlocal matches
        matches += watch_shape is not None and tuple(t.shape) == watch_shape
        return t

    for tokens in data:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(input_ids=tokens[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, matches


def run_case(fsdp_plan, name, family, dtype, flags, workdir):
    from torch.distributed.fsdp import FSDPModule

    config_path = os.path.join(workdir, f"{family}.json")
    with open(config_path, "w") as f:
        json.dump(TINY[family], f)
    code = exported_code(fsdp_plan, config_path, dtype, flags)
    attention = "eager" if "eager" in flags else "sdpa"
    text = TINY[family].get("text_config", TINY[family])  # a multimodal config's language model
    heads = text.get("num_attention_heads", text.get("n_head"))
    # gpt-oss's softmax runs over SEQ keys and the head's sink
    scores = (BATCH, heads, SEQ, SEQ + 1 if family == "gpt_oss" else SEQ)
    data = batches()
    reference_model = with_lora(build(family, attention), flags)
    reference_trainable = sum(p.numel() for p in reference_model.parameters() if p.requires_grad)
    reference, saved_scores = train(reference_model, data, scores)
    model = build(family, attention)
    scope = {"model": model}
    exec(compile(code, f"<fsdp-plan --export fsdp2 {' '.join(flags)}>", "exec"), scope)
    model = scope["model"]
    scaler = scope.get("scaler")
    sharded = sum(isinstance(m, FSDPModule) for m in model.modules())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    losses, kept_scores = train(model, data, scores, scaler)
    problems = []
    if trainable != reference_trainable:
        problems.append(f"{trainable} parameters require grad, {reference_trainable} in the reference")
    if sharded != text.get("num_hidden_layers", text.get("n_layer")) + 1:
        problems.append(f"{sharded} FSDP modules")
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    if worst > (5e-3 if dtype == "fp16" else 1e-5):
        problems.append(f"losses {losses} differ from {reference} by {worst:.1e}")
    if (scaler is not None) != (dtype == "fp16"):
        problems.append(f"a {dtype} export {'with' if scaler is not None else 'without'} a loss scaler")
    elif scaler is not None and scaler.get_scale() != 2.0**16:
        problems.append(f"loss scale {scaler.get_scale()} after {len(data)} steps (expected 65536: no overflow)")
    if "--ac-every" in flags or "selective-op" in flags:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

        every = int(flags[flags.index("--ac-every") + 1]) if "--ac-every" in flags else 1
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        layers = base.model.layers if family == "llama" else base.transformer.h  # a wrapped block sits in its place
        wrapped_layers = [i + 1 for i, m in enumerate(layers) if isinstance(m, CheckpointWrapper)]
        wrappers = sum(isinstance(m, CheckpointWrapper) for m in model.modules())
        expected = [n for n in range(1, len(layers) + 1) if n % every == 0]
        if wrapped_layers != expected or wrappers != len(expected):
            problems.append(f"checkpoint_wrapper on blocks {wrapped_layers} ({wrappers} wrappers), expected {expected}")
    if "selective-op" in flags and attention == "eager" and (kept_scores != 0 or saved_scores == 0):
        problems.append(f"saved score-shaped tensors: {kept_scores} with the export, {saved_scores} without")
    if "selective" in flags:
        if model.config._attn_implementation != "fsdpkit_selective":
            problems.append(f"attn_implementation is {model.config._attn_implementation}")
        if attention == "eager" and (kept_scores != 0 or saved_scores == 0):
            problems.append(f"saved score-shaped tensors: {kept_scores} with the export, {saved_scores} without")
    status = "ok" if not problems else "FAIL: " + "; ".join(problems)
    print(f"{name:24s} losses {' '.join(f'{x:.7f}' for x in losses)}  reference "
          f"{' '.join(f'{x:.7f}' for x in reference)}  rel {worst:.1e}  {status}")
    return not problems


def compile_qlora_exports(fsdp_plan, workdir):
    config_path = os.path.join(workdir, "llama.json")
    with open(config_path, "w") as f:
        json.dump(TINY["llama"], f)
    ok = True
    for fmt in ("pytorch", "fsdp2", "lightning"):
        framework = "fsdp2" if fmt == "fsdp2" else "fsdp1"
        code = subprocess.run([fsdp_plan, "--model", config_path, "--gpus", "8", "--framework", framework, "--export", fmt, *QLORA_FLAGS],
                              check=True, capture_output=True, text=True, env=dict(os.environ, FSDPKIT_DATA_DIR=ROOT)).stdout
        try:
            compile(code, f"<fsdp-plan --export {fmt} {' '.join(QLORA_FLAGS)}>", "exec")
            good = "BitsAndBytesConfig(" in code and "get_peft_model(" in code and "bnb_4bit_quant_storage=torch.bfloat16" in code
        except SyntaxError as e:
            print(f"qlora export {fmt}: {e}")
            good = False
        print(f"{'qlora export ' + fmt:24s} {'ok' if good else 'FAIL'}")
        ok = ok and good
    return ok


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fsdp-plan", required=True)
    args = parser.parse_args()
    try:
        import torch
        import torch.distributed as dist
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"export_check: needs torch and transformers: {e}")
        return 77
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.use_deterministic_algorithms(True)
    try:
        with tempfile.TemporaryDirectory() as workdir:
            ok = [run_case(args.fsdp_plan, name, family, dtype, flags, workdir) for name, family, dtype, flags in CASES]
            ok.append(compile_qlora_exports(args.fsdp_plan, workdir))
    finally:
        dist.destroy_process_group()
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
