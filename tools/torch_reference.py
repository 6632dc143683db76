#!/usr/bin/env python3
"""PyTorch FSDP2 reference run for fsdpkit.

Trains one Llama or GPT-2 configuration (a HuggingFace config.json from models/) for a
few steps with real PyTorch FSDP2 (``fully_shard``) and writes a JSON of the
measured memory and speed, so fsdpkit's predictions and its C++ GPU engine can
be compared with PyTorch itself.

Usage (one GPU; plain python3 starts a 1-rank process group by itself):

    python3 tools/torch_reference.py --model models/tinyllama-1.1b.json \
        --strategy FULL_SHARD --ac none --micro-batch 1 --seq-len 2048 \
        --steps 6 --warmup 2 --param-dtype bf16 --reduce-dtype fp32 \
        --attention eager --device cuda --out result.json

Several GPUs: ``torchrun --nproc-per-node N tools/torch_reference.py ...``.
CPU smoke test (gloo): ``--device cpu``; CUDA-only memory fields are null.

How fsdpkit's options map to PyTorch
------------------------------------
* Model: ``LlamaForCausalLM(LlamaConfig.from_dict(json, attn_implementation=
  --attention))`` built directly on the target device in fp32 after
  ``torch.manual_seed(--seed)`` (same seed on every rank, so every rank starts
  from the same full weights before sharding). ``use_cache`` is off (--use-cache:
  on, transformers 4.31 to 4.35 only). A GPT-2
  config (model_type gpt2) builds ``GPT2LMHeadModel`` the same way, with its
  config's dropout; its decoder blocks are ``transformer.h`` (GPT2Block).
* Wrapping: ``fully_shard`` on every ``model.model.layers[i]`` (one FSDP
  parameter group per decoder layer), then on the root ``LlamaForCausalLM``
  (embedding, final norm and lm_head form the root group). The root is given
  FSDP2's default ``reshard_after_forward``: FSDP2 never reshards the root
  after forward (torch >= 2.7: default None = False for the root; torch 2.6:
  lazy init clears the root's post-forward mesh).
* --strategy FULL_SHARD: layers use ``reshard_after_forward=True``.
  SHARD_GRAD_OP: ``reshard_after_forward=False`` (parameters stay unsharded
  from forward to backward; gradients and optimizer state stay sharded).
  NO_SHARD: FSDP2 has no NO_SHARD. On 1 rank it is mapped to
  ``reshard_after_forward=False`` (with one rank nothing is sharded anyway).
  On N > 1 ranks it is mapped to HSDP over a 2-D mesh (N replicas x 1 shard):
  every rank holds full parameters, gradients and optimizer state and gradients
  are all-reduced, i.e. DDP semantics, while keeping the same
  MixedPrecisionPolicy (``replicate``/DDP do not take that policy).
  Each mapping is also written to the JSON "notes".
* --framework fsdp1: ``FullyShardedDataParallel`` instead (transformer_auto_wrap_policy
  on LlamaDecoderLayer, flat parameters, ``MixedPrecision(param, reduce,
  buffer=param)``, BACKWARD_PRE, limit_all_gathers; NO_SHARD is FSDP1's own;
  ``device_id=cpu`` on the CPU), --ac full applied after wrapping as fsdp-plan
  --export pytorch writes it, and ``MemTracker`` instead of FSDPMemTracker. FSDP1
  runs every strategy as NO_SHARD on one rank.
* --ac full: every decoder layer is wrapped with ``checkpoint_wrapper``
  (CheckpointImpl.NO_REENTRANT, preserve_rng_state=False) before
  ``fully_shard``, the torchtitan way. HF's own gradient checkpointing is off.
* --ac selective: HF's attention function (eager_attention_forward, or SDPA's)
  runs under ``torch.utils.checkpoint(use_reentrant=False)``, registered with
  ``AttentionInterface`` and its mask function with ``AttentionMaskInterface``
  as attn_implementation "fsdpkit_selective": the scores and probabilities are
  recomputed in the backward (Korthikanti et al.'s selective recomputation);
  q, k, v and the mask stay referenced. fsdp-plan --export writes the same code.
* --param-dtype / --reduce-dtype: ``MixedPrecisionPolicy(param_dtype,
  reduce_dtype)`` on every ``fully_shard`` call. The sharded parameters, the
  gradients FSDP hands to the optimizer and the AdamW states stay fp32.
* Loss: HF's, inside the model's forward as the Trainer runs it
  (``model(input_ids, labels=targets, shift_labels=targets)``: ForCausalLMLoss,
  ``cross_entropy(logits.float().view(-1, V), targets.view(-1))``, the mean
  over every position). Inside matters for FSDP1 NO_SHARD, whose root frees
  its low-precision parameters after the forward: the root's pre-backward hook
  then runs before the loss's backward, not after. The reported loss is the
  mean over ranks. The logits are dropped before backward, unless
  --loop-holds-outputs keeps them as a loop holding ``outputs = model(...)``
  does: until the next step's loss exists (the tracker step counts the
  previous step's with ``track_external``).
* Data: synthetic and deterministic. Sequence i (global index over steps and
  ranks) starts at a token drawn from ``torch.Generator().manual_seed(seed)``;
  then t' = (5 t + 3) mod vocab for seq_len + 1 tokens; inputs are the first
  seq_len tokens, targets the last seq_len. With --tokens FILE, fsdp-run's
  windows instead: sequence (step * world + rank) * micro_batch + i is the
  file's tokens [index * (seq + 1), (index + 1) * (seq + 1)), cycled.
* Weights: seeded random (transformers' init) unless --init-from DIR loads a
  safetensors checkpoint (``from_pretrained``, fp32). With --init-from and
  --tokens the losses are fsdp-run's on the same flags (fsdp-run --init-from
  DIR --tokens FILE).
* Optimizer: ``AdamW(lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01,
  foreach=True)``, ``zero_grad(set_to_none=True)`` every step.
* Measurement: peak stats are reset after init, before the first warmup step
  (so the peak includes the creation of the optimizer state), read after the
  warmup, reset again and read after the timed steps. ``max_*`` fields are the
  max over both windows, ``timed_max_allocated_bytes`` is the timed window.
  Each timed step is timed with CUDA events and with the wall clock (after
  ``torch.cuda.synchronize``). ``measured.loss`` holds every step, warmup
  steps first. One extra step then runs under ``FSDPMemTracker`` (less a
  reference of its own: fsdp2_tracker_class) for the
  per-category memory at peak (``categories_at_peak``, bytes, keyed by the
  tracker's category names, plus its "Total"; null plus ``categories_error``
  if it fails). The tracker counts every tensor made inside optimizer.step()
  as "OptState", so when the peak falls in the step (small activations)
  OptState includes AdamW's foreach temporaries (up to ~3x fp32 params, not
  2x). Memory numbers are those of rank 0; device_used_bytes comes from
  mem_get_info and counts other processes on the GPU too.

Sources (PyTorch 2.11 file paths) of the APIs used
--------------------------------------------------
* torch/distributed/fsdp/_fully_shard/_fully_shard.py   fully_shard
* torch/distributed/fsdp/_fully_shard/_fsdp_api.py      MixedPrecisionPolicy
* torch/distributed/fsdp/_fully_shard/_fsdp_state.py    root lazy init
  (root not resharded after forward)
* torch/distributed/fsdp/__init__.py                    public re-exports
  (torch >= 2.6; torch/distributed/_composable/fsdp/ before)
* torch/distributed/device_mesh.py                      init_device_mesh
* torch/distributed/algorithms/_checkpoint/checkpoint_wrapper.py
                                                        checkpoint_wrapper
* torch/distributed/_tools/fsdp2_mem_tracker.py         FSDPMemTracker
* torch/distributed/_tools/mem_tracker.py               get_tracker_snapshot
* torch/cuda/memory.py  max_memory_allocated, max_memory_reserved,
                        memory_allocated, mem_get_info, reset_peak_memory_stats
Transformers: models/llama/modeling_llama.py (LlamaForCausalLM),
configuration_utils.py (PreTrainedConfig.from_dict, attn_implementation).

Notes on the versions: tested on CPU/gloo (1 and 2 ranks) with torch 2.11.0
and transformers 5.17.0; see tools/torch_reference_selftest.sh. FSDP2 on CPU
needs torch >= 2.7, so --device cpu is refused on older torch. torch 2.6 on
CPU hits three CPU-only gaps, none of which affects CUDA: (1) torch.cpu.Stream
lacks record_event/wait_event ('Stream' object has no attribute
'record_event'; no-ops added by pytorch/pytorch PR 145935); (2) FULL_SHARD
without AC fails in backward with "modified by an inplace operation", because
the CPU split_with_sizes_copy bumps the version counter of the re-all-gathered
parameters while the CUDA kernel does not (pytorch/pytorch issue 132014; later
torch wraps the copy in _unsafe_preserve_version_counter); (3) with more than
one rank FSDP2 reduces fp32/bf16 gradients with ReduceOp.AVG, which gloo
rejects ("Cannot use ReduceOp.AVG with Gloo").
"""

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
DTYPES = ("bf16", "fp16", "fp32")


# ---------------------------------------------------------------- arguments

class OneLineParser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line and exit with status 2."""

    def error(self, message):
        sys.stderr.write(f"torch_reference.py: error: {message}\n")
        sys.exit(2)


def int_at_least(minimum):
    """An argparse type: an integer >= minimum."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {'> 0' if minimum == 1 else f'>= {minimum}'}, got {value}")
        return value
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}")
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def build_parser():
    p = OneLineParser(description="Measure one Llama or GPT-2 config under PyTorch FSDP2.")
    p.add_argument("--model", required=True, help="HuggingFace config.json")
    p.add_argument("--strategy", default="FULL_SHARD", choices=STRATEGIES)
    p.add_argument("--ac", default="none", choices=("none", "selective", "selective-op", "full"))
    p.add_argument("--ac-every", type=positive_int, default=1,
                   help="with --ac full (fsdp2), checkpoint only layers N, 2N, ... (fsdp-plan --ac-every)")
    p.add_argument("--micro-batch", type=positive_int, default=1)
    p.add_argument("--seq-len", type=positive_int, default=2048)
    p.add_argument("--steps", type=positive_int, default=6, help="timed steps")
    p.add_argument("--warmup", type=non_negative_int, default=2, help="untimed steps")
    p.add_argument("--param-dtype", default="bf16", choices=DTYPES)
    p.add_argument("--reduce-dtype", default="fp32", choices=DTYPES)
    p.add_argument("--attention", default="eager", choices=("eager", "sdpa"))
    p.add_argument("--framework", default="fsdp2", choices=("fsdp1", "fsdp2"),
                   help="fully_shard (default) or FullyShardedDataParallel")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--lr", type=positive_float, default=1e-3)
    p.add_argument("--seed", type=non_negative_int, default=1)
    p.add_argument("--init-from", default="",
                   help="safetensors checkpoint directory to start from (as fsdp-run --init-from)")
    p.add_argument("--tokens", default="",
                   help="file of whitespace-separated token ids, windowed as fsdp-run --tokens")
    p.add_argument("--lora-rank", type=non_negative_int, default=0,
                   help="peft LoRA rank r (0: full fine-tuning): get_peft_model before sharding")
    p.add_argument("--lora-alpha", type=positive_float, default=8.0, help="lora_alpha")
    p.add_argument("--lora-dropout", type=float, default=0.0, help="lora_dropout")
    p.add_argument("--lora-targets", default="",
                   help="target_modules, comma-separated or all-linear (default: peft's for the model type)")
    p.add_argument("--base-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="LoRA: the frozen base's dtype (the model cast to it before get_peft_model, whose "
                        "autocast_adapter_dtype keeps the adapters fp32), as fsdp-plan --base-dtype")
    p.add_argument("--master-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="the dtype the model is stored and trained in (bf16: pure bf16, no fp32 master), "
                        "as fsdp-plan --master-dtype")
    p.add_argument("--qlora", action="store_true",
                   help="QLoRA: the model loaded 4-bit through bitsandbytes (NF4 in bf16 storage), as fsdp-plan --qlora")
    p.add_argument("--qlora-double-quant", action="store_true", help="bnb_4bit_use_double_quant=True")
    p.add_argument("--loop-holds-outputs", action="store_true",
                   help="keep each step's logits until the next step's loss exists "
                        "(a loop holding outputs = model(...)), as fsdp-plan --loop-holds-outputs")
    p.add_argument("--use-cache", action="store_true",
                   help="run the forward with use_cache=True: transformers 4.31 to 4.35 return every layer's key and "
                        "value states (past_key_values), dropped with the output after the loss (kept with it under "
                        "--loop-holds-outputs), as fsdp-plan --use-cache")
    p.add_argument("--hf-reentrant-checkpointing", action="store_true",
                   help="--ac full as transformers 4.35 to 4.x's Trainer does it (gradient_checkpointing=True without "
                        "kwargs): the model's gradient_checkpointing_enable(use_reentrant=True) and "
                        "enable_input_require_grads() before FSDP1 wraps it, so each checkpoint runs around an "
                        "FSDP-wrapped decoder layer; as fsdp-plan --ac-reentrant (FSDP1, transformers before 4.52)")
    p.add_argument("--init", default="", choices=("", "meta", "device"),
                   help="where the model is built: 'meta' (the default for FSDP2 from seeded weights: built "
                        "on the meta device, sharded, then to_empty and initialize_weights, as torchtitan and "
                        "accelerate's FSDP2 do, so no full-size parameter ever lives on the device) or "
                        "'device' (built whole on the device, then sharded: the freed originals stay in "
                        "the caching allocator's cache; the default with --init-from, LoRA, QLoRA or FSDP1)")
    p.add_argument("--memory-history", default="",
                   help="CUDA: record the caching allocator's events from the first step on "
                        "(torch.cuda.memory._record_memory_history, no stacks) and write them, with the "
                        "segments at the start and at the end, to this JSON file. CPU: the same steps' "
                        "allocations and frees as torch.profiler records them, with the storages alive "
                        "at the start (build/bench/allocator_replay replays either)")
    p.add_argument("--no-tracker", action="store_true",
                   help="skip the extra FSDPMemTracker step")
    p.add_argument("--out", required=True, help="output JSON path")
    return p


def load_model_json(parser, path):
    if not os.path.isfile(path):
        parser.error(f"--model: no such file: {path}")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        parser.error(f"--model: cannot read {path}: {e}")
    if not isinstance(config, dict) or not isinstance(config.get("model_type", "llama"), str):
        parser.error(f"--model: {path} is not a transformers config (no model_type string)")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    if config.get("model_type", "llama") not in CONFIG_MAPPING:
        parser.error(f"--model: {path}: model_type '{config['model_type']}' is not a transformers model type")
    keys = ("vocab_size", "n_embd", "n_layer", "n_head") if config.get("model_type") == "gpt2" else \
        ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    text = text_config_dict(config)
    for key in keys:
        if not isinstance(text.get(key), int) or text[key] <= 0:
            parser.error(f"--model: {path}: missing or non-positive {key}")
    return config


def text_config_dict(config):
    """The language model's keys: a multimodal config's text_config (Gemma 3's), else the config."""
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def load_tokens(parser, path, vocab):
    """Token ids as fsdp-run's ReadTokens accepts them: plain decimal, at least 2."""
    try:
        with open(path) as f:
            words = f.read().split()
    except OSError as e:
        parser.error(f"--tokens: cannot read {path}: {e}")
    bad_word = next((w for w in words if not w.isascii() or not w.isdigit()), None)
    if bad_word is not None:
        parser.error(f"--tokens: {path}: '{bad_word}' is not a token id")
    ids = [int(w) for w in words]
    if len(ids) < 2:
        parser.error(f"--tokens: {path} needs at least 2 tokens")
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        parser.error(f"--tokens: token id {bad} is outside the vocabulary [0, {vocab})")
    return ids


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    args.model_dict = load_model_json(parser, args.model)
    if args.ac_every > 1 and (args.ac != "full" or args.framework != "fsdp2"):
        parser.error("--ac-every needs --ac full and --framework fsdp2")
    if args.init_from and not os.path.isdir(args.init_from):
        parser.error(f"--init-from: not a directory: {args.init_from}")
    if args.init == "meta" and not meta_init_possible(args):
        parser.error("--init meta needs --framework fsdp2 without --init-from, --lora-rank or --qlora")
    args.token_ids = load_tokens(parser, args.tokens, text_config_dict(args.model_dict)["vocab_size"]) if args.tokens else None
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        parser.error(f"--out: directory does not exist: {out_dir}")
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        parser.error(f"needs torch and transformers: {e}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device available (use --device cpu)")
    if args.device == "cpu" and torch.__version__ < (2, 7):
        parser.error(f"--device cpu: FSDP2 on CPU/gloo needs torch >= 2.7, "
                     f"this is {torch.__version__} (see the docstring)")
    return args


# ---------------------------------------------------------- process group

def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device_kind):
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_kind == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend=backend)
    return device, dist.get_rank(), dist.get_world_size()


# ------------------------------------------------------------------- model

def torch_dtype(name):
    import torch
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def is_gpt2(args):
    return args.model_dict.get("model_type", "llama") == "gpt2"


def decoder_layers(model):
    """The decoder blocks FSDP wraps: LlamaForCausalLM's model.layers, GPT2LMHeadModel's transformer.h,
    Gemma3ForConditionalGeneration's model.language_model.layers (its vision tower stays in the root)."""
    if hasattr(model, "transformer"):
        return model.transformer.h
    return model.model.language_model.layers if hasattr(model.model, "language_model") else model.model.layers


def decoder_layer_class(args):
    """The decoder-layer class of the model type (GPT2Block, LlamaDecoderLayer, Qwen3DecoderLayer, ...):
    what FSDP wraps, as the model's own _no_split_modules names it."""
    return args.layer_class


def model_classes(args):
    """(config class, causal-LM class) of the model type: LlamaConfig / LlamaForCausalLM when the
    file names none, as fsdp-plan reads it."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config_class = type(AutoConfig.for_model(args.model_dict.get("model_type", "llama")))
    return config_class, AutoModelForCausalLM._model_mapping[config_class]


def meta_init(args):
    """Whether the model is built on the meta device (--init, and its default)."""
    if args.init:
        return args.init == "meta"
    return meta_init_possible(args)


def meta_init_possible(args):
    """Meta-device init materialises after fully_shard with transformers' own initialisation: FSDP2
    from seeded weights only (a checkpoint's weights, peft's adapters and bitsandbytes' packing
    need real tensors, and FSDP1 materialises through reset_parameters, which leaves RMSNorm
    weights and RoPE's inverse frequencies unset)."""
    return args.framework == "fsdp2" and not (args.init_from or args.lora_rank or args.qlora)


def materialize(model, args, device):
    """After fully_shard on a meta-device model: storage for the shards on `device`, then
    transformers' own initialisation (PreTrainedModel.initialize_weights, which also recomputes the
    RoPE inverse frequencies to_empty left uninitialised), seeded."""
    import torch
    if not meta_init(args):
        return
    model.to_empty(device=device)
    torch.manual_seed(args.seed)
    with torch.no_grad():
        model.initialize_weights()


def build_model(args, device):
    import torch
    from transformers import LlamaForCausalLM

    config_class, model_class = model_classes(args)
    config = config_class.from_dict(dict(args.model_dict),
                                    attn_implementation=attention_implementation(args))
    config.use_cache = False
    torch.manual_seed(args.seed)
    if args.init_from and is_gpt2(args):
        raise SystemExit("torch_reference: error: --init-from takes Llama checkpoints only")
    if args.init_from:  # every weight from the checkpoint; a missing one is an error
        model, info = LlamaForCausalLM.from_pretrained(args.init_from, config=config, dtype=torch.float32,
                                                       output_loading_info=True)
        if info["missing_keys"] or info["mismatched_keys"]:
            raise SystemExit(f"torch_reference: error: --init-from {args.init_from}: missing "
                             f"{info['missing_keys']}, mismatched {info['mismatched_keys']}")
        model.to(device)
    else:
        with torch.device("meta" if meta_init(args) else device):
            model = model_class(config)
    args.layer_class = type(decoder_layers(model)[0])
    model.to(dtype=torch.float32)
    if args.master_dtype == "bf16":  # pure bf16: the model itself in bf16, so are its gradients and AdamW's states
        model.to(dtype=torch.bfloat16)
    if args.qlora:
        model = quantized(model, args)
    model.train()
    return model


def quantized(model, args):
    """QLoRA's model as fsdp-plan --qlora plans it: saved in bf16 and loaded back through
    BitsAndBytesConfig (NF4, bnb_4bit_quant_storage and compute dtype bf16), on the CPU."""
    import tempfile
    import torch
    import transformers

    bnb_config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                 bnb_4bit_use_double_quant=args.qlora_double_quant,
                                                 bnb_4bit_quant_storage=torch.bfloat16, bnb_4bit_compute_dtype=torch.bfloat16)
    from safetensors.torch import save_model

    model.to(dtype=torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        # written by hand: under torch.distributed, save_pretrained writes on rank 0 only
        model.config.to_json_file(os.path.join(tmp, "config.json"))
        save_model(model, os.path.join(tmp, "model.safetensors"))
        return transformers.AutoModelForCausalLM.from_pretrained(
            tmp, quantization_config=bnb_config, dtype=torch.bfloat16, device_map="cpu",
            attn_implementation=model.config._attn_implementation)


def apply_lora(model, args):
    """peft's LoRA as fsdp-plan --lora-rank models it: LoraConfig(r, lora_alpha, lora_dropout,
    target_modules) through get_peft_model, which freezes every base parameter; the adapters are
    fp32 (autocast_adapter_dtype upcasts bf16/fp16 adapters), the base in --base-dtype."""
    if not args.lora_rank:
        return model
    if args.base_dtype == "bf16":
        import torch
        model.to(dtype=torch.bfloat16)
    from peft import LoraConfig, get_peft_model
    targets = args.lora_targets
    if targets and targets != "all-linear":
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                        target_modules=targets or None, task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def base_model(model):
    """The transformers model under a PeftModel (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def import_fsdp2():
    try:  # torch >= 2.6
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch 2.4 / 2.5
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


def make_mesh(strategy, device, world):
    from torch.distributed.device_mesh import init_device_mesh

    if strategy == "NO_SHARD" and world > 1:
        return init_device_mesh(device.type, (world, 1),
                                mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))


def strategy_notes(strategy, world):
    notes = ["fully_shard on each model.model.layers[i], then on the root "
             "LlamaForCausalLM with FSDP2's default reshard_after_forward "
             "(FSDP2 does not reshard the root after forward)"]
    if strategy == "FULL_SHARD":
        notes.append("FULL_SHARD -> decoder layers reshard_after_forward=True")
    elif strategy == "SHARD_GRAD_OP":
        notes.append("SHARD_GRAD_OP -> decoder layers reshard_after_forward=False")
    elif world == 1:
        notes.append("NO_SHARD -> FSDP2 has no NO_SHARD; on 1 rank mapped to "
                     "reshard_after_forward=False on a 1-rank mesh (nothing is sharded)")
    else:
        notes.append(f"NO_SHARD -> FSDP2 has no NO_SHARD; mapped to HSDP on a 2-D "
                     f"mesh ({world} replicas x 1 shard): full params/grads/optimizer "
                     f"state on every rank, gradients all-reduced (DDP semantics), "
                     f"reshard_after_forward=False")
    return notes


def family_eager_attention(args):
    """The model type's own eager_attention_forward, from the modeling module beside its
    configuration class (gpt-oss's adds the sinks, Gemma 2's soft-caps, GPT-2's runs its softmax
    in the compute dtype), as `fsdp-plan --export` imports it; Llama's where the module has none."""
    import importlib
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import eager_attention_forward
    config_module = type(AutoConfig.for_model(args.model_dict.get("model_type", "llama"))).__module__
    modeling = importlib.import_module(config_module.replace(".configuration_", ".modeling_"))
    return getattr(modeling, "eager_attention_forward", eager_attention_forward)


def attention_implementation(args):
    """The attn_implementation name for --attention. With --ac selective, "fsdpkit_selective": HF's
    attention function under a non-reentrant torch.utils.checkpoint, registered with its mask
    function as `fsdp-plan --export` writes it. The attention core (repeat_kv, scores, softmax,
    probabilities x V) is recomputed in the backward; its inputs (q and k after RoPE, v, the
    mask) stay referenced."""
    if args.ac != "selective":
        return args.attention
    from torch.utils.checkpoint import checkpoint
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import eager_mask, sdpa_mask
    eager = args.attention == "eager"
    core = family_eager_attention(args) if eager else sdpa_attention_forward

    def checkpointed_attention(module, query, key, value, attention_mask, **kwargs):
        return checkpoint(core, module, query, key, value, attention_mask, use_reentrant=False, **kwargs)

    AttentionInterface.register("fsdpkit_selective", checkpointed_attention)
    # without its own mask function a new name gets none for a causal batch: no causal mask
    AttentionMaskInterface.register("fsdpkit_selective", eager_mask if eager else sdpa_mask)
    return "fsdpkit_selective"


def apply_activation_checkpointing(model, every=1):
    """checkpoint_wrapper on decoder layers every, 2 x every, ... (counting from 1)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, checkpoint_wrapper)

    layers = decoder_layers(base_model(model))
    for i in range(len(layers)):
        if (i + 1) % every != 0:
            continue
        layers[i] = checkpoint_wrapper(layers[i],
                                       checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                       preserve_rng_state=False)


def op_sac_saved_ops():
    """The ops whose outputs apply_op_selective_checkpointing keeps: aten.mm (every second call
    excepted by the policy) and every SDPA kernel of torchtitan's _op_sac_save_list, plus the CPU's
    flash kernel (tools/torch_reference_selftest.sh checks the list against torchtitan's own)."""
    import torch

    aten = torch.ops.aten
    saved = {aten.mm.default}
    for kernel in ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                   "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math",
                   "_scaled_dot_product_fused_attention_overrideable", "_scaled_dot_product_flash_attention_for_cpu"):
        if hasattr(aten, kernel):
            saved.add(getattr(aten, kernel).default)
    return saved


def apply_op_selective_checkpointing(model):
    """torchtitan's op-level selective AC (selective_ac_option "op", in its
    parallelize_llama.py): every decoder layer under checkpoint_wrapper with a selective-checkpoint
    context whose policy keeps the outputs of aten.mm, except every second one of the layer, and
    of every SDPA kernel its _op_sac_save_list names (torchtitan 0.2.2, models/llama3/infra/
    parallelize.py: flash, memory-efficient, cuDNN, math, the overrideable fused one), and
    recomputes every other op in the backward. On the CPU the save list also holds SDPA's CPU
    flash kernel, standing for the CUDA one. (Until 2026-12-05 the list held the flash and
    memory-efficient kernels only: the H200 sweep's selective-op row, whose attention ran another
    kernel, recomputed its attention; docs/accuracy.md.)"""
    from collections import defaultdict
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    saved_ops = op_sac_saved_ops()

    def context():
        mm_seen = defaultdict(int)  # per pass (forward, recompute) of this layer

        def policy(ctx, func, *args, **kwargs):
            pass_name = "recompute" if ctx.is_recompute else "forward"
            if func == aten.mm.default:
                mm_seen[pass_name] += 1
            keep = func in saved_ops and not (func == aten.mm.default and mm_seen[pass_name] % 2 == 0)
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
        return create_selective_checkpoint_contexts(policy)

    layers = decoder_layers(base_model(model))
    for i in range(len(layers)):
        layers[i] = checkpoint_wrapper(layers[i], context_fn=context, preserve_rng_state=False)


def shard_model_fsdp1(model, args, device):
    """FullyShardedDataParallel as fsdp-plan --framework fsdp1 models it and --export pytorch writes
    it: one FSDP unit per decoder layer plus the root, flat parameters (use_orig_params=False),
    MixedPrecision(param, reduce, buffer=param), BACKWARD_PRE, limit_all_gathers; NO_SHARD is
    FSDP1's own. On the CPU, device_id=cpu (FSDP1 otherwise refuses to run without an accelerator)."""
    import functools
    import torch
    from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    param = torch_dtype(args.param_dtype)
    layer = decoder_layer_class(args)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={layer})
    if args.lora_rank:  # peft's policy, as transformers' Trainer installs it for a PeftModel
        from peft.utils.other import fsdp_auto_wrap_policy
        policy = fsdp_auto_wrap_policy(model)
    return FullyShardedDataParallel(
        model, auto_wrap_policy=policy,
        sharding_strategy=getattr(ShardingStrategy, args.strategy),
        mixed_precision=MixedPrecision(param_dtype=param, reduce_dtype=torch_dtype(args.reduce_dtype), buffer_dtype=param),
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE, limit_all_gathers=True, use_orig_params=False,
        device_id=device)


def apply_activation_checkpointing_fsdp1(model, args):
    import functools
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)

    layer = decoder_layer_class(args)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, layer))


def shard_model(model, args, mesh):
    fully_shard, MixedPrecisionPolicy = import_fsdp2()
    mp = MixedPrecisionPolicy(param_dtype=torch_dtype(args.param_dtype),
                              reduce_dtype=torch_dtype(args.reduce_dtype))
    reshard = args.strategy == "FULL_SHARD"
    for layer in decoder_layers(base_model(model)):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


# -------------------------------------------------------------------- data

def make_batches(args, vocab, n_steps, rank, world):
    """Per-step (inputs, targets) CPU tensors of shape [micro_batch, seq_len]."""
    import torch

    if args.token_ids is not None:
        ids, seq, batches = args.token_ids, args.seq_len, []
        for s in range(n_steps):
            first = [((s * world + rank) * args.micro_batch + i) * (seq + 1) for i in range(args.micro_batch)]
            rows = [[ids[(f + j) % len(ids)] for j in range(seq + 1)] for f in first]
            t = torch.tensor(rows, dtype=torch.int64)
            batches.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
        return batches
    gen = torch.Generator().manual_seed(args.seed)
    per_step = args.micro_batch * world
    starts = torch.randint(0, vocab, (n_steps * per_step,), generator=gen,
                           dtype=torch.int64)
    tokens = torch.empty(starts.numel(), args.seq_len + 1, dtype=torch.int64)
    tokens[:, 0] = starts
    for k in range(args.seq_len):
        tokens[:, k + 1] = (5 * tokens[:, k] + 3) % vocab
    batches = []
    for s in range(n_steps):
        lo = s * per_step + rank * args.micro_batch
        seq = tokens[lo:lo + args.micro_batch]
        batches.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return batches


# ------------------------------------------------------------------- steps

def make_optimizer(model, lr):
    import torch
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95),
                             eps=1e-8, weight_decay=0.01, foreach=True)


def loss_takes_shift_labels():
    """Whether this transformers' ForCausalLMLoss takes already shifted labels (4.50 on)."""
    import inspect
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:  # before 4.46 the model's forward computed the loss itself
        return False
    return "shift_labels" in inspect.signature(ForCausalLMLoss).parameters


def train_step(model, optimizer, inputs, targets, held=None, use_cache=False):
    """One step. ``held`` (a list, --loop-holds-outputs) plays a loop that keeps
    ``outputs = model(...)``: the previous step's logits (and, with ``use_cache``, its
    past_key_values) are dropped only once this step's loss exists, and this step's stay
    referenced through its backward and optimizer step."""
    optimizer.zero_grad(set_to_none=True)
    # HF's loss inside the model's forward, as the Trainer runs it (ForCausalLMLoss: logits.float(),
    # mean cross-entropy); shift_labels = the already shifted targets, so no position is dropped.
    if loss_takes_shift_labels():
        outputs = model(input_ids=inputs, labels=targets, shift_labels=targets, use_cache=use_cache)
    else:  # before 4.50 the loss shifts the labels itself (logits[..., :-1, :]): one position fewer
        outputs = model(input_ids=inputs, labels=targets, use_cache=use_cache)
    loss = outputs.loss
    if held is not None:
        held[:] = [outputs.logits] + ([t for layer in outputs.past_key_values for t in layer] if use_cache else [])
    del outputs
    loss.backward()
    optimizer.step()
    return loss.detach()


def to_device(batch, device):
    return tuple(t.to(device, non_blocking=True) for t in batch)


def timed_step(model, optimizer, batch, device, held=None, use_cache=False):
    """Runs one step; returns (loss, event_seconds or None, wall_seconds)."""
    import torch

    inputs, targets = to_device(batch, device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    loss = train_step(model, optimizer, inputs, targets, held, use_cache)
    if cuda:
        end.record()
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    event = start.elapsed_time(end) / 1000.0 if cuda else None
    return mean_over_ranks(loss), event, wall


def mean_over_ranks(loss):
    """Mean of the per-rank losses (after the timed region; gloo has no AVG)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    if world > 1:
        loss = loss.clone()
        dist.all_reduce(loss, op=dist.ReduceOp.SUM)
        loss /= world
    return float(loss.item())


# ------------------------------------------------------------------ memory

def peak_stats(device):
    import torch
    if device.type != "cuda":
        return None
    return (torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device))


def reset_peaks(device):
    import torch
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def device_memory(device):
    import torch
    if device.type != "cuda":
        return {"device_used_bytes": None, "device_total_bytes": None,
                "reserved_bytes_at_end": None, "context_overhead_bytes": None}
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    return {"device_used_bytes": total - free, "device_total_bytes": total,
            "reserved_bytes_at_end": reserved,
            "context_overhead_bytes": total - free - reserved}


def segments_of(snapshot):
    """A snapshot's segments as [address, bytes, stream, pool, [[block bytes, state], ...]]."""
    return [[seg["address"], seg["total_size"], seg["stream"], seg["segment_type"],
             [[b["size"], b["state"]] for b in seg["blocks"]]] for seg in snapshot["segments"]]


def live_cpu_storages():
    """[address, bytes] of every CPU storage a live tensor holds (parameters, DTensors' local
    shards, buffers, inputs), once each, by address."""
    import gc
    import torch
    live = {}
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor):
            continue
        try:
            st = obj.untyped_storage()
            if st.device.type == "cpu" and st.nbytes() > 0:
                live[st.data_ptr()] = st.nbytes()
        except (RuntimeError, NotImplementedError):  # wrapper subclasses (DTensor) hold no storage
            continue
    return sorted([address, nbytes] for address, nbytes in live.items())


def start_cpu_allocation_trace():
    """Starts torch.profiler with profile_memory: every CPU allocation and free (c10's CPU
    allocator reports each to the profiler: c10/core/CPUAllocator.cpp, reportMemoryUsageToProfiler)."""
    from torch.profiler import ProfilerActivity, profile
    live = live_cpu_storages()
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False, with_stack=False)
    prof.__enter__()
    return {"profiler": prof, "live_at_start": live}


def write_cpu_allocation_trace(path, trace):
    """The profiler's allocation events in time order as [action, address, bytes, 0, op] ("alloc",
    or "free_completed" for a free: the CPU frees at once; op: the innermost op it happened in),
    with the storages alive at the start."""
    from torch._C._profiler import _EventType
    prof = trace["profiler"]
    prof.__exit__(None, None, None)
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu" and node.extra_fields.alloc_size != 0:
            f = node.extra_fields
            op = node.parent.name if node.parent is not None else ""
            events.append((node.start_time_ns, "alloc" if f.alloc_size > 0 else "free_completed", f.ptr, abs(f.alloc_size), op))
    events.sort(key=lambda e: e[0])
    sizes = dict(trace["live_at_start"])
    live = peak = sum(sizes.values())
    for _, action, ptr, nbytes, _ in events:
        if action == "alloc":
            sizes[ptr] = nbytes
            live += nbytes
            peak = max(peak, live)
        elif ptr in sizes:
            live -= sizes.pop(ptr)
    trace["recorded_peak_bytes"] = peak
    doc = {"source": "torch.profiler(profile_memory=True) allocation events on the CPU, each with the op it happened in; "
                     "live_at_start from the live tensors' storages",
           "device": "cpu", "events": [[action, ptr, nbytes, 0, op] for _, action, ptr, nbytes, op in events],
           "live_at_start": trace["live_at_start"]}
    with open(path, "w") as f:
        json.dump(doc, f, separators=(",", ":"))


def start_memory_history(args, device):
    """Starts recording the caching allocator's events (torch/cuda/memory.py _record_memory_history:
    every alloc, free_requested, free_completed, segment_alloc, segment_free, segment_map and
    segment_unmap with its address, size and stream); returns the segments held at the start.
    On the CPU, start_cpu_allocation_trace."""
    import torch
    if not args.memory_history:
        return None
    if device.type == "cpu":
        return start_cpu_allocation_trace()
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    start = segments_of(torch.cuda.memory._snapshot())
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=1_000_000)
    return start


def history_frame(event):
    """The Python line behind an allocator event (stacks='python'): the innermost frame in
    transformers', peft's or torchtitan's code ("modeling_olmo2.py:63 forward"), else the
    innermost frame, else ""."""
    frames = event.get("frames") or []
    for f in frames:
        name = f.get("filename", "")
        if "/transformers/" in name or "/peft/" in name or "/torchtitan/" in name:
            return f"{os.path.basename(name)}:{f.get('line')} {f.get('name')}"
    if frames:
        return f"{os.path.basename(frames[0].get('filename', ''))}:{frames[0].get('line')} {frames[0].get('name')}"
    return ""


def write_memory_history(path, start_segments, device):
    """The recorded events as [action, address, size, stream] (the trace of this rank's device) and
    the segments at the start and now."""
    import torch
    if device.type == "cpu":
        return write_cpu_allocation_trace(path, start_segments)
    torch.cuda.synchronize(device)
    snapshot = torch.cuda.memory._snapshot(device)
    torch.cuda.memory._record_memory_history(enabled=None)
    index = device.index or 0
    traces = snapshot["device_traces"][index] if len(snapshot["device_traces"]) > index else []
    doc = {"source": "torch.cuda.memory._snapshot() with _record_memory_history(enabled='all', context=None); "
                     "an event's fifth field is the Python line that made it (history_frame)",
           "events": [[e["action"], e["addr"], e["size"], e["stream"], history_frame(e)] for e in traces],
           "segments_at_start": start_segments, "segments_at_end": segments_of(snapshot)}
    with open(path, "w") as f:
        json.dump(doc, f, separators=(",", ":"))


ALLOCATOR_STAT_KEYS = (  # torch.cuda.memory_stats() (c10/cuda/CUDACachingAllocator.cpp DeviceStats)
    "num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free",
    "segment.all.peak", "segment.small_pool.peak", "segment.large_pool.peak",
    "reserved_bytes.small_pool.peak", "reserved_bytes.large_pool.peak",
    "allocated_bytes.small_pool.peak", "allocated_bytes.large_pool.peak",
    "active_bytes.all.peak", "inactive_split_bytes.all.peak", "allocation.all.peak",
    "requested_bytes.all.peak")


def allocator_stats(device):
    """The caching allocator's own counters since the last reset (the timed window for the
    .peak values; the whole run for the num_* counts), or None off CUDA."""
    import torch
    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    return {k: int(stats[k]) for k in ALLOCATOR_STAT_KEYS if k in stats}


def category_name(key):
    return str(getattr(key, "value", key))


def fsdp2_tracker_class():
    """FSDPMemTracker without one reference of its own. Its wrapper of FSDPParamGroup.post_backward
    (torch/distributed/_tools/fsdp2_mem_tracker.py, _fsdp_param_group_post_backward.inner, PyTorch
    2.11) labels each unsharded gradient in a loop whose variable ``unsharded_grad`` still holds
    the group's last parameter's gradient while the wrapped post_backward runs, so that gradient
    outlives foreach_reduce's copy-in: one more unsharded gradient than PyTorch holds without the
    tracker (49,152,000 bytes for llama-100m's lm_head at the root's reduce-scatter, the peak of
    a one-rank bf16-parameter fp32-reduce step; tools/peak_trace.py found it). The same wrapper,
    the loop variable deleted."""
    from functools import wraps

    import torch.distributed._tools.fsdp2_mem_tracker as tracker_module

    class Tracker(tracker_module.FSDPMemTracker):
        def _fsdp_param_group_post_backward(self, fsdp_mod, orig_post_backward):
            @wraps(orig_post_backward)
            def inner(*args, **kwargs):
                fsdp_state = fsdp_mod._get_fsdp_state()
                if fsdp_param_group := fsdp_state._fsdp_param_group:
                    for fsdp_param in fsdp_param_group.fsdp_params:
                        unsharded_grad = fsdp_param._unsharded_param.grad
                        if unsharded_grad is not None:
                            self._update_and_maybe_create_winfos(
                                unsharded_grad, tracker_module._FSDPRefType.UNSHARDED_GRAD, update_existing=True)
                        del unsharded_grad  # the one change
                mod_stat = self.memory_tracking[fsdp_mod]
                mod_stat.snapshots.setdefault(tracker_module._FSDPModState.BEF_POST_BW, []).append(self.get_tracker_snapshot())
                self._fsdp_state = tracker_module._FSDPState.POST_BW
                orig_post_backward(*args, **kwargs)
                if fsdp_param_group := fsdp_state._fsdp_param_group:
                    for fsdp_param in fsdp_param_group.fsdp_params:
                        sharded_grad = fsdp_param.sharded_param.grad
                        if sharded_grad is not None:
                            self._update_and_maybe_create_winfos(sharded_grad, tracker_module._FSDPRefType.SHARDED_GRAD)
                mod_stat.snapshots.setdefault(tracker_module._FSDPModState.AFT_POST_BW, []).append(self.get_tracker_snapshot())
            return inner

    return Tracker


def tracked_categories(model, optimizer, batch, device, held=None, use_cache=False):
    """One extra step under FSDPMemTracker (FSDP2) or MemTracker (FSDP1); returns (categories,
    loss, error)."""
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
        from torch.distributed.fsdp import FullyShardedDataParallel

        inputs, targets = to_device(batch, device)
        if isinstance(model, FullyShardedDataParallel):
            tracker = MemTracker()
            tracker.track_external(model, optimizer, inputs, targets)
        else:
            tracker = fsdp2_tracker_class()(model, optimizer)
            tracker.track_inputs((inputs, targets))
        if held:
            tracker.track_external(*held)  # the previous step's logits, still referenced
        with tracker:
            loss = train_step(model, optimizer, inputs, targets, held, use_cache)
        snapshot = tracker.get_tracker_snapshot("peak")
        per_device = next((v for k, v in snapshot.items()
                           if str(k) == str(device)), None)
        if per_device is None:
            raise RuntimeError(f"no {device} entry in tracker snapshot "
                               f"(devices: {[str(k) for k in snapshot]})")
        cats = {category_name(k): int(v) for k, v in per_device.items()}
        return cats, mean_over_ranks(loss), None
    except Exception as e:  # the tracker is a private API: never fail the run
        return None, None, f"{type(e).__name__}: {e}"


# ------------------------------------------------------------------ report

def max_or_none(a, b):
    return None if a is None or b is None else max(a, b)


def build_report(args, env, params, notes, run):
    import torch
    import transformers

    step_s = statistics.median(run["steps_s"])
    tokens = args.micro_batch * args.seq_len * env["world"]
    warm, timed = run["warm_peaks"], run["timed_peaks"]
    memory = {
        "max_allocated_bytes": max_or_none(warm and warm[0], timed and timed[0]),
        "max_reserved_bytes": max_or_none(warm and warm[1], timed and timed[1]),
        "timed_max_allocated_bytes": timed and timed[0],
        "timed_max_reserved_bytes": timed and timed[1],
        "after_init_allocated_bytes": run["after_init_allocated"],
        **run["device_memory"],
        "categories_at_peak": run["categories"],
        "allocator_stats": run["allocator_stats"],
        # CPU with --memory-history: the most bytes live at once in the recording, kernels' own
        # buffers included (FSDPMemTracker's categories see tensors only); None otherwise
        "recorded_peak_bytes": run.get("recorded_peak_bytes"),
    }
    if run["categories_error"]:
        memory["categories_error"] = run["categories_error"]
    return {
        "tool": "torch_reference",
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "device_name": env["device_name"],
        "world_size": env["world"],
        "config": {
            "model": os.path.splitext(os.path.basename(args.model))[0], "model_path": args.model,
            "params": params, "strategy": args.strategy, "ac": args.ac,
            "micro_batch": args.micro_batch, "seq_len": args.seq_len,
            "param_dtype": args.param_dtype, "reduce_dtype": args.reduce_dtype,
            "attention": args.attention, "framework": args.framework,
            "steps": args.steps, "warmup": args.warmup, "ac_every": args.ac_every,
            "loop_holds_outputs": args.loop_holds_outputs,
            "lr": args.lr, "seed": args.seed, "device": args.device,
            "init_from": args.init_from or None, "tokens": args.tokens or None,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or None,
            "init": "meta" if meta_init(args) else "device",
            "lora_rank": args.lora_rank, "lora_alpha": args.lora_alpha,
            "lora_targets": args.lora_targets or None, "base_dtype": args.base_dtype,
            "master_dtype": args.master_dtype, "qlora": args.qlora,
            "lora_dropout": args.lora_dropout, "qlora_double_quant": args.qlora_double_quant,
        },
        "notes": notes,
        "measured": {
            "loss": run["loss"],
            "tracker_step_loss": run["tracker_loss"],
            "time": {"step_s": step_s, "steps_s": run["steps_s"],
                     "wall_steps_s": run["wall_steps_s"],
                     "timer": "cuda_event" if args.device == "cuda" else "wall_clock"},
            "tokens_per_s": tokens / step_s if step_s > 0 else None,
            "tokens_per_s_per_gpu": tokens / env["world"] / step_s if step_s > 0 else None,
            "memory": memory,
        },
    }


def fmt_bytes(n):
    if n is None:
        return "n/a"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def print_summary(report):
    c, m = report["config"], report["measured"]
    mem = m["memory"]
    print(f"torch_reference: {c['model']} ({c['params']:,} params) {c['strategy']} "
          f"ac={c['ac']} mb={c['micro_batch']} seq={c['seq_len']} "
          f"{c['param_dtype']}/{c['reduce_dtype']} {c['attention']} "
          f"world={report['world_size']} on {report['device_name']}")
    print(f"  loss: {' '.join(f'{x:.4f}' for x in m['loss'])}")
    print(f"  step: {m['time']['step_s'] * 1e3:.2f} ms (median), "
          f"{m['tokens_per_s']:.1f} tokens/s")
    print(f"  peak allocated {fmt_bytes(mem['max_allocated_bytes'])}, "
          f"reserved {fmt_bytes(mem['max_reserved_bytes'])}, "
          f"after init {fmt_bytes(mem['after_init_allocated_bytes'])}, "
          f"device used {fmt_bytes(mem['device_used_bytes'])}")
    cats = mem["categories_at_peak"]
    if cats:
        print("  at peak: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in cats.items()))
    else:
        print(f"  categories: n/a ({mem.get('categories_error')})")


# -------------------------------------------------------------------- main

def run_training(args, model, device, rank, world):
    import torch

    import transformers
    if args.use_cache and not (4, 31) <= tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (4, 36):
        raise SystemExit(f"torch_reference: error: --use-cache runs transformers 4.31 to 4.35 (the tuple cache), not {transformers.__version__}")
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config  # 4.45 on
    vocab = text_config.vocab_size
    batches = make_batches(args, vocab, args.warmup + args.steps + 1, rank, world)
    optimizer = make_optimizer(model, args.lr)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    run = {"after_init_allocated": torch.cuda.memory_allocated(device)
           if device.type == "cuda" else None, "loss": []}
    held = [] if args.loop_holds_outputs else None
    reset_peaks(device)
    history = start_memory_history(args, device)
    for i in range(args.warmup):
        run["loss"].append(timed_step(model, optimizer, batches[i], device, held, args.use_cache)[0])
    run["warm_peaks"] = peak_stats(device) if args.warmup else None
    reset_peaks(device)
    run["steps_s"], run["wall_steps_s"] = [], []
    for i in range(args.warmup, args.warmup + args.steps):
        loss, event, wall = timed_step(model, optimizer, batches[i], device, held, args.use_cache)
        run["loss"].append(loss)
        run["steps_s"].append(event if event is not None else wall)
        run["wall_steps_s"].append(wall)
    run["timed_peaks"] = peak_stats(device)
    if history is not None and rank == 0:  # every rank records its own device; rank 0's is written
        write_memory_history(args.memory_history, history, device)
        if device.type == "cpu":
            run["recorded_peak_bytes"] = history["recorded_peak_bytes"]
    elif history is not None and device.type == "cpu":
        history["profiler"].__exit__(None, None, None)
    if run["warm_peaks"] is None:
        run["warm_peaks"] = run["timed_peaks"]
    run["device_memory"] = device_memory(device)
    run["allocator_stats"] = allocator_stats(device)
    run["categories"], run["tracker_loss"], run["categories_error"] = (
        (None, None, "skipped (--no-tracker)") if args.no_tracker else
        tracked_categories(model, optimizer, batches[-1], device, held, args.use_cache))
    state = quant_state_bytes(model)
    if state and run["categories"]:
        # bitsandbytes' QuantState tensors are neither parameters nor buffers: the tracker does not
        # see them, though they are alive (on every rank, whole) throughout the step
        run["categories"]["QuantState"] = state
        run["categories"]["Total"] += state
    return run


def quant_state_bytes(model):
    """Bytes of every bitsandbytes QuantState tensor of the model (nested state included), each storage once."""
    import torch

    seen, total = set(), 0
    for module in model.modules():
        state = getattr(module, "quant_state", None)
        if state is None:
            state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is None:
            continue
        tensors = [state.absmax, state.code, getattr(state, "offset", None)]
        if getattr(state, "state2", None) is not None:
            tensors += [state.state2.absmax, state.state2.code]
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def main(argv=None):
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    device, rank, world = init_distributed(args.device)
    try:
        model = apply_lora(build_model(args, device), args)
        params = sum(p.numel() for p in model.parameters())
        notes = (strategy_notes(args.strategy, world) if args.framework == "fsdp2" else
                 [f"FullyShardedDataParallel({args.strategy}) per decoder layer and the root, "
                  "flat parameters, BACKWARD_PRE, limit_all_gathers; categories_at_peak from MemTracker"])
        if args.ac == "selective":
            notes.append(f"ac=selective -> HF's {args.attention} attention function under "
                         "torch.utils.checkpoint(use_reentrant=False), registered with its mask "
                         "function as attn_implementation 'fsdpkit_selective' (the attention core "
                         "is recomputed)")
        if args.ac == "selective-op":
            if args.framework != "fsdp2" or is_gpt2(args):
                raise SystemExit("torch_reference: error: --ac selective-op runs with --framework fsdp2 on Llama-style models")
            apply_op_selective_checkpointing(model)
            notes.append("ac=selective-op -> torchtitan's op-level selective AC: checkpoint_wrapper with a "
                         "selective-checkpoint policy saving aten.mm outputs but every second one and the "
                         "outputs of every SDPA kernel torchtitan 0.2.2's list names (flash, memory-efficient, cuDNN, math, "
                         "overrideable; on the CPU its flash kernel too), on each decoder layer before fully_shard")
        if args.ac == "full" and args.framework == "fsdp2":
            apply_activation_checkpointing(model, args.ac_every)
            notes.append("ac=full -> checkpoint_wrapper(NO_REENTRANT, "
                         "preserve_rng_state=False) on each decoder layer before fully_shard")
        notes.append("loss = HF's ForCausalLMLoss inside the forward (labels=targets, "
                     "shift_labels=targets), averaged over ranks; "
                     "measured.loss lists warmup steps first")
        notes.append("memory numbers are rank 0's; categories_at_peak from one extra "
                     "step under FSDPMemTracker (FSDP1: MemTracker) after the timed steps")
        if args.lora_rank:
            notes.append(f"LoRA: peft get_peft_model(LoraConfig(r={args.lora_rank}, lora_alpha={args.lora_alpha}, "
                         f"lora_dropout={args.lora_dropout}, target_modules={args.lora_targets or 'peft default'})); "
                         "FSDP1 wraps with peft's fsdp_auto_wrap_policy")
        if args.param_dtype == "fp16":
            notes.append("param_dtype fp16 runs without loss scaling (no GradScaler)")
        if args.seq_len > args.model_dict.get("max_position_embeddings", args.seq_len):
            notes.append("seq_len exceeds max_position_embeddings (RoPE extrapolates)")
        if args.hf_reentrant_checkpointing:
            import transformers
            if args.framework != "fsdp1" or args.ac != "full":
                raise SystemExit("torch_reference: error: --hf-reentrant-checkpointing runs with --framework fsdp1 --ac full")
            if tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (4, 52):
                raise SystemExit("torch_reference: error: --hf-reentrant-checkpointing needs a transformers release whose "
                                 f"model loop calls the checkpoint around each layer (before 4.52), not {transformers.__version__}")
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
            model.enable_input_require_grads()
            notes.append("ac=full -> the model's gradient_checkpointing_enable(use_reentrant=True) and "
                         "enable_input_require_grads() before FullyShardedDataParallel (the HF Trainer's "
                         "gradient_checkpointing=True on transformers 4.35 to 4.x)")
        if args.framework == "fsdp1":
            model = shard_model_fsdp1(model, args, device)
            if args.ac == "full" and not args.hf_reentrant_checkpointing:  # inside each FSDP unit, as fsdp-plan --export pytorch writes it
                apply_activation_checkpointing_fsdp1(model, args)
                notes.append("ac=full -> apply_activation_checkpointing(checkpoint_wrapper NO_REENTRANT) "
                             "on each decoder layer after FullyShardedDataParallel")
        else:
            shard_model(model, args, make_mesh(args.strategy, device, world))
            materialize(model, args, device)
        notes.append("init: built on the meta device, fully_shard, to_empty, initialize_weights" if meta_init(args)
                     else "init: built whole on the device (or loaded), then sharded")
        run = run_training(args, model, device, rank, world)
        env = {"world": world, "device_name": torch.cuda.get_device_name(device)
               if device.type == "cuda" else "cpu"}
        report = build_report(args, env, params, notes, run)
        if rank == 0:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)
                f.write("\n")
            print_summary(report)
        dist.barrier()  # gloo can abort if one rank tears down while another still talks
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
