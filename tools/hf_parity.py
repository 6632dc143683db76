#!/usr/bin/env python3
"""fsdp-run's numerics against HuggingFace transformers on the same weights and tokens.

For each case a small model is built with transformers (LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM; seeded), saved with save_pretrained (config.json and safetensors: fp32, one case
sharded over several files, one in bf16), and trained for a few
AdamW steps in plain PyTorch fp32 on a token file. fsdp-run then starts from that checkpoint
(--init-from) with the same tokens (--tokens), fp32 parameters and reductions, and the losses of
every step are compared. Step 1's loss checks the forward (embedding, RMSNorm eps, RoPE with the
config's scaling, grouped-query attention, SwiGLU, tied or untied head, cross-entropy); later steps
check the backward, gradient accumulation and AdamW (lr, betas, eps, decoupled weight decay on every
parameter, as torch.optim.AdamW over model.parameters()). The LoRA cases wrap the model with peft's
get_peft_model (adapters drawn non-zero) and train the parameters that require grad; fsdp-run
starts from the peft model's own parameters under FSDP2 with the same LoRA flags. The QLoRA cases
load the checkpoint quantized by bitsandbytes (NF4, fp32 storage and compute) before peft wraps it.

fsdp-run's token windows are TrainingTokens' (runtime/fsdp_engine.h): sequence index
((step * grad_accum + micro) * world + rank) * micro_batch + i takes tokens
[index * (seq + 1), (index + 1) * (seq + 1)) of the file, cycled; inputs are the first seq tokens,
targets the last seq.

Usage: hf_parity.py --fsdp-run build/fsdp-run [--mpirun "mpirun --oversubscribe"] [--device cuda] [--keep DIR] [--only NAME]
       hf_parity.py --fsdp-run build/fsdp-run --config path/to/config.json [--seq-len 64] [--steps 2]
         (one real model's shapes at full size instead of the built-in small cases)
Exit status: 0 all cases agree, 1 a case disagrees or fsdp-run failed, 77 torch/transformers missing.
"""
import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

# Relative agreement of the losses. fp32 on both sides, sums in different orders (Eigen vs ATen):
# measured agreement is <= 1e-7 (docs/accuracy.md). Weights are drawn with std 0.1
# (initializer_range) so that the logits are far from uniform and the details matter: on the first
# case, dropping the llama3 RoPE scaling moves step 1's loss by 6e-3 relative, rms_norm_eps 1e-6
# instead of 1e-5 by 1.4e-5.
FIRST_STEP_REL = 2e-6
LATER_STEP_REL = 2e-5
# Pure bf16: bf16 rounding of every activation on transformers' side (2^-8 relative) against fp32
# compute on fsdp-run's
PURE_BF16_REL = 3e-3
GPU_FACTOR = 5  # --device cuda: cuBLAS fp32 (CUBLAS_COMPUTE_32F, no TF32) and CUDA reductions in another order

# A small untied Llama with GQA and plain RoPE: the pure-bf16 and LoRA cases' model
SMALL_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "initializer_range": 0.1,
               "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
               "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}

CASES = [
    {   # Llama 3.1's RoPE bands (original context 16 < seq 32: every band is used), GQA, tied head
        "name": "llama3-rope-gqa-tied",
        "config": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "initializer_range": 0.1,
                   "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
                   "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True,
                   "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},
        "seq": 32, "micro_batch": 2, "grad_accum": 1, "steps": 3, "flags": ["--wrap", "block"],
        "mpi_ranks": 2,
    },
    {   # untied head, linear RoPE scaling, whole-model wrap, activation checkpointing, grad accumulation
        "name": "llama-linear-untied-ac-accum",
        "config": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 300, "initializer_range": 0.1,
                   "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2,
                   "num_attention_heads": 6, "num_key_value_heads": 6, "max_position_embeddings": 128,
                   "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
                   "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        "seq": 24, "micro_batch": 1, "grad_accum": 2, "steps": 3, "flags": ["--wrap", "none", "--ac", "full"],
    },
    {   # Mistral with head_dim * heads != hidden_size, window wider than the sequence; selective checkpointing
        "name": "mistral-head-dim",
        "config": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "vocab_size": 200, "initializer_range": 0.1,
                   "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
                   "max_position_embeddings": 256, "sliding_window": 64, "rms_norm_eps": 1e-5,
                   "rope_theta": 1000000.0, "tie_word_embeddings": False},
        "seq": 20, "micro_batch": 2, "grad_accum": 1, "steps": 3, "flags": ["--strategy", "shard_grad_op", "--ac", "selective"],
        "max_shard_size": "150KB",  # several files and model.safetensors.index.json, as large checkpoints are saved
    },
    {   # Qwen2: q/k/v biases (drawn non-zero below), tied head, theta 1e6; 2 ranks NO_SHARD
        "name": "qwen2-qkv-bias",
        "config": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 240, "initializer_range": 0.1,
                   "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
                   "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
                   "use_sliding_window": False},
        "seq": 16, "micro_batch": 2, "grad_accum": 1, "steps": 3, "flags": ["--strategy", "no_shard"],
        "mpi_ranks": 2, "save_bf16": True,  # a bf16 checkpoint, as Hub models are stored; both sides train from its values in fp32
    },
    {   # Qwen3: per-head q_norm and k_norm (drawn away from 1 below), head_dim 24 != hidden / heads,
        # untied head, theta 1e6; 2 ranks FULL_SHARD
        "name": "qwen3-qk-norm",
        "config": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 200, "initializer_range": 0.1,
                   "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "head_dim": 24,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
                   "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False},
        "seq": 16, "micro_batch": 2, "grad_accum": 2, "steps": 3, "flags": [], "mpi_ranks": 2,
        "cpu_only": "the GPU engine does not implement Qwen3's q/k norms yet",
    },
    {   # Qwen3-MoE: Qwen3's attention, then a router (fp32 softmax, top 2 of 8, divided by their sum:
        # norm_topk_prob) over SwiGLU experts held fused (Qwen3MoeExperts), saved by save_pretrained in
        # the Hub's per-expert format; 2 ranks FULL_SHARD, gradient accumulation 2
        "name": "qwen3-moe-router-experts",
        "config": {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 200, "initializer_range": 0.1,
                   "hidden_size": 48, "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 8,
                   "num_experts_per_tok": 2, "norm_topk_prob": True, "num_hidden_layers": 2, "head_dim": 16,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
                   "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False},
        "seq": 16, "micro_batch": 2, "grad_accum": 2, "steps": 3, "flags": [], "mpi_ranks": 2,
        "cpu_only": "the GPU engine does not implement routed experts yet",
    },
    {   # pure bf16 (--master-dtype bf16; torchtune's dtype: bf16): the model and AdamW in bf16, no fp32
        # copy. transformers computes every op in bf16, fsdp-run in fp32 from bf16 weights (its
        # gathered and compute buffers are fp32), so the losses agree only to bf16's precision;
        # lr 1e-2 so that the steps move the loss (3% a step) by far more than that (measured: 6e-4)
        "name": "llama-pure-bf16",
        "config": SMALL_LLAMA,
        "seq": 32, "micro_batch": 2, "grad_accum": 1, "steps": 3, "flags": ["--framework", "fsdp2"], "mpi_ranks": 2,
        "pure_bf16": True, "lr": 1e-2, "limits": (PURE_BF16_REL, PURE_BF16_REL),
        "cpu_only": "the GPU engine keeps fp32 masters",
    },
    {   # LoRA (peft) on q_proj and v_proj under FSDP2: the base frozen, adapters trained; lora_B drawn
        # non-zero (init_lora_weights=False) so that step 1 checks the adapters' forward too; 2 ranks
        "name": "llama-lora-qv",
        "config": SMALL_LLAMA,
        "seq": 32, "micro_batch": 2, "grad_accum": 1, "steps": 3, "flags": ["--framework", "fsdp2"], "mpi_ranks": 2,
        "lora": {"r": 4, "alpha": 16, "targets": ["q_proj", "v_proj"]},
        "cpu_only": "the GPU engine does not implement LoRA",
    },
    {   # the same under FSDP1 with use_orig_params: the flat gradient covers the frozen base, AdamW
        # steps the adapters' parts of each rank's shard; 2 ranks
        "name": "llama-lora-qv-fsdp1",
        "config": SMALL_LLAMA,
        "seq": 32, "micro_batch": 2, "grad_accum": 1, "steps": 3, "flags": ["--wrap", "block", "--use-orig-params"],
        "mpi_ranks": 2, "lora": {"r": 4, "alpha": 16, "targets": ["q_proj", "v_proj"]},
        "cpu_only": "the GPU engine does not implement LoRA",
    },
    {   # LoRA on every linear of a Qwen2 (frozen q/k/v biases, tied head), whole-model wrap, full
        # activation checkpointing, gradient accumulation; 2 ranks
        "name": "qwen2-lora-all-linear-ac",
        "config": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 240, "initializer_range": 0.1,
                   "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
                   "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
                   "use_sliding_window": False},
        "seq": 16, "micro_batch": 2, "grad_accum": 2, "steps": 3, "flags": ["--framework", "fsdp2", "--wrap", "none", "--ac", "full"],
        "mpi_ranks": 2, "lora": {"r": 2, "alpha": 5, "targets": "all-linear"},
        "cpu_only": "the GPU engine does not implement LoRA",
    },
    {   # QLoRA: from_pretrained with bitsandbytes 0.50.2's NF4 (BitsAndBytesConfig load_in_4bit,
        # quant_storage and compute dtype fp32) quantizes the fp32 checkpoint's block linears as they
        # load; peft's Linear4bit adapters on every linear; fsdp-run quantizes the same checkpoint
        # itself (runtime/nf4.h) and shards the packed codes. Every in_features a multiple of 64
        # (intermediate 192), where bitsandbytes' CPU dequantize kernel agrees with its quantizer
        # (tools/nf4_fixture.py); under FSDP2, and double-quantized under FSDP1 with use_orig_params
        # (one fp32 flat parameter of codes and adapters); 2 ranks
        "name": "llama-qlora-all-linear",
        "config": dict(SMALL_LLAMA, intermediate_size=192),
        "seq": 32, "micro_batch": 2, "grad_accum": 1, "steps": 3, "flags": ["--framework", "fsdp2"], "mpi_ranks": 2,
        "lora": {"r": 4, "alpha": 16, "targets": "all-linear"}, "qlora": True,
        "cpu_only": "the GPU engine does not implement LoRA",
    },
    {
        "name": "llama-qlora-double-quant-fsdp1-ac",
        "config": dict(SMALL_LLAMA, intermediate_size=192),
        "seq": 32, "micro_batch": 2, "grad_accum": 2, "steps": 3, "flags": ["--wrap", "block", "--use-orig-params", "--ac", "full"],
        "mpi_ranks": 2, "lora": {"r": 4, "alpha": 16, "targets": ["q_proj", "o_proj", "down_proj"]}, "qlora": True, "double_quant": True,
        "cpu_only": "the GPU engine does not implement LoRA",
    },
]

LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.95), 1e-8, 0.01  # fsdp-run's TrainOptions defaults


def build_model(case, seed):
    import torch
    import transformers
    config_class = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                    "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
                    "qwen3_moe": transformers.Qwen3MoeConfig}[case["config"]["model_type"]]
    model_class = getattr(transformers, case["config"]["architectures"][0])
    config = config_class.from_dict(dict(case["config"]), attn_implementation="eager")
    config.use_cache = False
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    with torch.no_grad():  # norms away from 1 and biases away from 0, so that they matter
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
            elif p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model


def window(tokens, index, seq):
    n = len(tokens)
    return [tokens[(index * (seq + 1) + j) % n] for j in range(seq + 1)]


def quantized(case, model, directory):
    """The checkpoint in DIR loaded as QLoRA loads it: the block linears quantized to NF4 by
    bitsandbytes on the CPU, packed in fp32 elements and computed in fp32."""
    import torch
    import transformers
    config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=bool(case.get("double_quant")),
                                             bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=torch.float32)
    return type(model).from_pretrained(directory, quantization_config=config, dtype=torch.float32, device_map="cpu",
                                       attn_implementation="eager")


def with_lora(case, model, directory, seed):
    """peft's get_peft_model on the case's LoRA; the whole model (base and adapters, under the names
    peft gives them, which fsdp-run's inventory uses) saved to DIR/lora/model.safetensors. QLoRA: the
    adapters saved beside the unquantized checkpoint's tensors, which fsdp-run quantizes itself."""
    import peft
    import torch
    from safetensors.torch import load_file, save_file
    lora = case["lora"]
    torch.manual_seed(seed + 1)
    config = peft.LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], target_modules=lora["targets"], lora_dropout=0.0,
                             init_lora_weights=False)  # lora_B drawn like lora_A (kaiming uniform), not zero
    model = peft.get_peft_model(model, config)
    inner = model.base_model.model  # the transformers model, its modules wrapped
    os.makedirs(os.path.join(directory, "lora"), exist_ok=True)
    tensors = {name: p.detach().contiguous() for name, p in inner.named_parameters()}  # a tied head once
    if case.get("qlora"):
        tensors = {name: p for name, p in tensors.items() if ".lora_" in name}
        tensors.update(load_file(os.path.join(directory, "model.safetensors")))
    save_file(tensors, os.path.join(directory, "lora", "model.safetensors"))
    return model


def lora_flags(case):
    lora = case["lora"]
    targets = lora["targets"] if isinstance(lora["targets"], str) else ",".join(lora["targets"])
    return ["--lora-rank", str(lora["r"]), "--lora-alpha", str(lora["alpha"]), "--lora-targets", targets] + \
        (["--qlora"] if case.get("qlora") else []) + (["--qlora-double-quant"] if case.get("double_quant") else [])


def reference_losses(case, model, tokens):
    import torch
    import torch.nn.functional as F
    seq, mb, accum = case["seq"], case["micro_batch"], case["grad_accum"]
    trained = [p for p in model.parameters() if p.requires_grad]  # all of them, or LoRA's adapters
    optimizer = torch.optim.AdamW(trained, lr=case.get("lr", LR), betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    model.train()
    losses = []
    for step in range(case["steps"]):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in range(accum):
            rows = [window(tokens, (step * accum + micro) * mb + i, seq) for i in range(mb)]
            batch = torch.tensor(rows, dtype=torch.long)
            logits = model(input_ids=batch[:, :-1]).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
            (loss / accum).backward()
            total += loss.item() / accum
        optimizer.step()
        losses.append(total)
    return losses


def run_fsdp(args, case, directory, token_file, ranks):
    out = os.path.join(directory, f"run-{ranks}.json")
    cmd = [args.fsdp_run, "--model", directory, "--init-from", directory,
           "--tokens", token_file, "--gpus", str(ranks), "--steps", str(case["steps"]),
           "--seq-len", str(case["seq"]), "--micro-batch", str(case["micro_batch"] // ranks),
           "--grad-accum", str(case["grad_accum"]), "--lr", str(case.get("lr", LR)), "--device", args.device, "--quiet", "--out", out] + case["flags"]
    dtype = "bf16" if case.get("pure_bf16") else "fp32"
    cmd += ["--param-dtype", dtype, "--reduce-dtype", dtype] + (["--master-dtype", "bf16"] if case.get("pure_bf16") else [])
    if case.get("lora"):  # from the peft model's own checkpoint: base_layer names and its adapters
        cmd[cmd.index("--init-from") + 1] = os.path.join(directory, "lora", "model.safetensors")
        cmd += lora_flags(case)
    if ranks > 1:
        cmd = shlex.split(args.mpirun) + ["-np", str(ranks)] + cmd
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return None, f"{' '.join(cmd)}\n{done.stdout}{done.stderr}"
    with open(out) as f:
        return json.load(f)["measured"]["loss"], None


def compare(name, reference, measured, factor, limits=(FIRST_STEP_REL, LATER_STEP_REL)):
    ok = len(reference) == len(measured)
    rows = []
    for i, (r, m) in enumerate(zip(reference, measured)):
        rel = abs(m - r) / abs(r)
        limit = factor * (limits[0] if i == 0 else limits[1])
        ok = ok and rel <= limit
        rows.append(f"  step {i + 1}: transformers {r:.7f}  fsdp-run {m:.7f}  rel {rel:.2e} (limit {limit:.0e})")
    print(("ok   " if ok else "FAIL ") + name)
    print("\n".join(rows))
    return ok


def run_case(args, case, root):
    """Saves the case's checkpoint and tokens, trains the reference, runs fsdp-run; True if they agree."""
    if args.device != "cpu" and case.get("cpu_only"):
        print(f"skip {case['name']} ({args.device}): {case['cpu_only']}")
        return True
    import random
    import torch
    directory = os.path.join(root, case["name"])
    os.makedirs(directory, exist_ok=True)
    model = build_model(case, args.seed)
    if case.get("save_bf16"):  # the reference reloads it in fp32 as a user would (module.to() would also round RoPE's buffer)
        model.to(torch.bfloat16).save_pretrained(directory)
        model = type(model).from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    else:
        model.save_pretrained(directory, max_shard_size=case.get("max_shard_size", "5GB"))  # config.json + safetensors
    rng = random.Random(args.seed)
    tokens = [rng.randrange(case["config"]["vocab_size"]) for _ in range(4000)]
    token_file = os.path.join(directory, "tokens.txt")
    with open(token_file, "w") as f:
        f.write(" ".join(map(str, tokens)) + "\n")
    if case.get("pure_bf16"):  # loaded in bf16 and trained in it (RoPE's inv_freq stays fp32, as from_pretrained makes it)
        model = type(model).from_pretrained(directory, dtype=torch.bfloat16, attn_implementation="eager")
    if case.get("lora"):
        try:
            import peft  # noqa: F401
        except ImportError:
            print(f"skip {case['name']}: peft is not installed")
            return True
        if case.get("qlora"):
            try:
                import bitsandbytes  # noqa: F401
            except ImportError:
                print(f"skip {case['name']}: bitsandbytes is not installed")
                return True
            model = quantized(case, model, directory)
        model = with_lora(case, model, directory, args.seed)
    reference = reference_losses(case, model, tokens)
    del model
    ok = True
    multi = args.mpirun and case.get("mpi_ranks") and args.device == "cpu"
    for ranks in [1] + ([case["mpi_ranks"]] if multi else []):
        measured, error = run_fsdp(args, case, directory, token_file, ranks)
        label = f"{case['name']} ({args.device}, {ranks} rank{'s' if ranks > 1 else ''})"
        if error:
            print(f"FAIL {label}: fsdp-run failed\n{error}")
            ok = False
            continue
        ok = compare(label, reference, measured, GPU_FACTOR if args.device == "cuda" else 1,
                     case.get("limits", (FIRST_STEP_REL, LATER_STEP_REL))) and ok
    return ok


def case_from_config(args):
    """One case from a HuggingFace config.json (--config): a seeded bf16 checkpoint of that model."""
    with open(args.config) as f:
        config = json.load(f)
    kind = config.get("model_type")
    classes = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "qwen3_moe": "Qwen3MoeForCausalLM"}
    config.setdefault("architectures", [classes.get(kind, "")])
    if kind not in classes:
        raise SystemExit(f"hf_parity: --config {args.config}: model_type {kind!r} is not one of {', '.join(classes)}")
    name = os.path.basename(os.path.dirname(os.path.abspath(args.config))) if os.path.basename(args.config) == "config.json" \
        else os.path.splitext(os.path.basename(args.config))[0]
    return {"name": name, "config": config, "seq": args.seq_len, "micro_batch": 2, "grad_accum": 1, "steps": args.steps,
            "flags": [], "save_bf16": True}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fsdp-run", required=True, help="path to the fsdp-run binary")
    parser.add_argument("--mpirun", default="",
                        help="mpirun command (with its options) to also run the multi-rank cases (empty: skip them)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="fsdp-run's --device (cuda: one GPU, 1 rank)")
    parser.add_argument("--config", default="",
                        help="instead of the built-in cases: one model's HuggingFace config.json, at full size (seeded bf16 weights)")
    parser.add_argument("--seq-len", type=int, default=64, help="with --config: sequence length (micro-batch 2)")
    parser.add_argument("--steps", type=int, default=2, help="with --config: AdamW steps")
    parser.add_argument("--keep", default="", help="keep the checkpoints and results in this directory")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--only", default="", help="run the built-in cases whose name contains this")
    args = parser.parse_args()
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"hf_parity: needs torch and transformers ({e}): skipped")
        return 77
    cases = [case_from_config(args)] if args.config else [c for c in CASES if args.only in c["name"]]
    root = args.keep or tempfile.mkdtemp(prefix="fsdpkit-hf-parity-")
    all_ok = True
    try:
        for case in cases:
            all_ok = run_case(args, case, root) and all_ok
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
