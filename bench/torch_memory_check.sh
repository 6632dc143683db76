#!/usr/bin/env bash
# fsdp-plan's PyTorch FSDP2 (and FSDP1) memory profile against PyTorch itself, on CPU ranks (gloo):
# tools/torch_reference.py runs llama-100m under fully_shard and records FSDPMemTracker's
# categories at the peak; fsdp-plan predicts the same configuration (--framework fsdp2, eager
# attention, --torch-device cpu: PyTorch's CPU kernels, without CUDA's softmax-backward product). Compared: the tensors at the peak (fsdp-plan's categories without the framework term,
# the tracker's Total). Needs torch and transformers: PYTHON=/path/to/python (default
# $FSDPKIT_PYTHON, which ./fsdpkit test sets up, else python3); exits 77 without them, and on a CPU
# where PyTorch has no fast bf16 matrix multiply (tools/cpu_bf16_gemm.py; FSDPKIT_SLOW_BF16=1 runs anyway),
# but for the fp32 rows.
#   bench/torch_memory_check.sh [build dir]
# MAX_ERROR_PCT=P makes it exit 1 when a configuration's |error| exceeds P percent; QUICK=1 runs
# the one-rank configurations of the first, third and fifth rows, the first FSDP1 row, one
# Llama and one GPT-2 block-backward row and the first op-SAC row, then one row of each newer
# family, LoRA, QLoRA and torchtitan; QUICK=llama the first part, QUICK=others the second (the
# CTest checks torch_memory_agreement and torch_memory_agreement_others, one each, with MAX_ERROR_PCT). ROWS=lora runs the LoRA, QLoRA and pure-bf16
# rows only, ROWS=qlora the QLoRA rows only, ROWS=pure-bf16 the pure-bf16 rows only, ROWS=fp32
# (QUICK=fp32: the first of them) the fp32-training rows, which run on any CPU, ROWS=families
# the rows of the newer model families (Qwen3, OLMo 2, ...) only, ROWS=transformers-versions the
# older transformers releases' loss paths only, ROWS=torchtitan fsdp-plan
# --impl torchtitan against torchtitan's own model (QUICK runs its AC full row).
# Rows marked RECORDED=1 (gpt-oss's: the row maximum's backward, scatter_'s fp32 buffer inside
# the kernel, which no tensor holds) compare with the most bytes the CPU allocated at once
# (torch_reference.py --memory-history: torch.profiler's allocation events) instead.
# FSDP_PLAN_ONLY=1 runs fsdp-plan alone and prints its column (no PyTorch figure, no error): what a
# change to the memory model moves, row by row, in seconds (run it before and after, and diff).
# Rows 8 and 9 use selective checkpointing (torch_reference.py --ac selective: HF's attention
# function under torch.utils.checkpoint), the second of them on llama-100m with 4 kv heads (GQA).
# The FSDP1 rows (torch_reference.py --framework fsdp1: FullyShardedDataParallel, MemTracker) use
# 2 ranks, but one: FSDP1 on one rank silently switches every strategy to NO_SHARD, which that row
# runs. The GPT-2 rows have
# dropout off (tests/data/hf_configs/gpt2-no-dropout.json): on the CPU, ATen's unfused dropout
# saves its noise in the input dtype where CUDA's fused kernel saves a bool mask, which fsdp-plan
# models. The "2k vocab" rows use a 2048-token vocabulary (and GPT-2 2048 positions), so that the
# peak falls in a block's backward (its softmax's gradients) rather than at the loss. The "holds
# outputs" row keeps each step's logits until the next step's loss exists, on both sides. The
# "flash" rows run SDPA (PyTorch's CPU flash kernel: output + logsumexp saved) against fsdp-plan's
# --attention flash; every other row is eager attention. The row after them checkpoints every
# second block (--ac-every 2 on both sides). The "op-SAC" rows run torchtitan's op-level selective
# AC (--ac selective-op on both sides: outputs of every second matmul and of SDPA kept), with eager
# attention, SDPA, GQA, and a 2k vocabulary that puts the peak in a block's backward.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
python=${PYTHON:-${FSDPKIT_PYTHON:-python3}}
export FSDPKIT_DATA_DIR=$root
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
plan_only=${FSDP_PLAN_ONLY:-}
[ -n "$plan_only" ] || "$python" -c "import torch, transformers" 2> /dev/null || { echo "torch_memory_check: $python has no torch/transformers"; exit 77; }
fp32_only=
if [ "${ROWS:-}" = fp32 ] || [ "${QUICK:-}" = fp32 ]; then fp32_only=1; fi
[ -n "$plan_only" ] || [ -n "$fp32_only" ] || "$python" "$root/tools/cpu_bf16_gemm.py" torch_memory_check || exit 77  # its rows train bf16 models
printf "%-44s %14s %14s %8s  %s\n" configuration "PyTorch bytes" "fsdp-plan" error "fsdp-plan's peak phase"
check() {  # name ranks strategy ac micro seq [model config, default models/llama-100m.json] [framework, default fsdp2] [flag both take] [attention: eager (default) | flash] [param dtype, default bf16] [reduce dtype, default fp32]
  local name=$1 ranks=$2 strategy=$3 ac=$4 micro=$5 seq=$6 model=${7:-$root/models/llama-100m.json} framework=${8:-fsdp2}
  local both=(${9:-}) attention=${10:-eager} param=${11:-bf16} reduce=${12:-fp32}
  local torch_attention=$attention; [ "$attention" = flash ] && torch_attention=sdpa  # SDPA: its flash kernel (CPU and CUDA)
  local args=(--device cpu --model "$model" --framework "$framework" --strategy "$strategy" --ac "$ac" --micro-batch "$micro" --seq-len "$seq"
              --steps 1 --warmup 1 --param-dtype "$param" --reduce-dtype "$reduce" --attention "$torch_attention" --out "$out/$name.json" ${both[@]+"${both[@]}"})
  args+=(${TORCH_ONLY:-})
  [ -z "${RECORDED:-}" ] || args+=(--memory-history "$out/$name.history.json")
  if [ -n "$plan_only" ]; then
    :
  elif [ "$ranks" -gt 1 ]; then  # a rank that gloo's transport aborted (an uncaught gloo::IoException, rare) gets one more run
    "$python" -m torch.distributed.run --standalone --nproc-per-node "$ranks" "$root/tools/torch_reference.py" "${args[@]}" > "$out/$name.log" 2>&1 ||
      { grep -q "Signal [0-9]* (SIG" "$out/$name.log" && echo "torch_memory_check: $name: a rank died by a signal, run again" >&2 &&
        "$python" -m torch.distributed.run --standalone --nproc-per-node "$ranks" "$root/tools/torch_reference.py" "${args[@]}" > /dev/null 2>&1; }
  else
    "$python" "$root/tools/torch_reference.py" "${args[@]}" > /dev/null 2>&1
  fi
  "$build/fsdp-plan" --model "$model" --gpu h100-sxm --gpus "$ranks" --gpus-per-node "$ranks" --framework "$framework" --strategy "$strategy" \
    --ac "$ac" --micro-batch "$micro" --seq-len "$seq" --attention "$attention" --param-dtype "$param" --reduce-dtype "$reduce" --cublas-workspace-bytes 0 --torch-device cpu \
    ${both[@]+"${both[@]}"} ${PLAN_ONLY:-} --json > "$out/$name.plan.json"
  compare "$name" "$out/$name.json" "$out/$name.plan.json"
}
compare() {  # name torch.json plan.json: prints the row; exits 1 past MAX_ERROR_PCT
  python3 - "$1" "$2" "$3" <<'PY'
import json, sys
name, torch_path, plan_path = sys.argv[1:]
per_gpu = json.load(open(plan_path))["memory"]["per_gpu"]
if __import__("os").environ.get("FSDP_PLAN_ONLY"):
    print(f"{name:44s} {'-':>14s} {per_gpu['allocated_peak_bytes']:14d} {'-':>8s}  {per_gpu['peak_phase']}")
    sys.exit(0)
memory = json.load(open(torch_path))["measured"]["memory"]
# RECORDED rows: the CPU's every allocation (kernels' own buffers too), else FSDPMemTracker's tensors
tracked = memory.get("recorded_peak_bytes") or memory["categories_at_peak"]["Total"]
# tensors only: the allocated peak, which without a cuBLAS workspace holds no framework term and no
# blocks FSDP1's record_stream keeps reserved on a GPU (none exist on the CPU)
planned = per_gpu["allocated_peak_bytes"]
error = 100 * (planned - tracked) / tracked
print(f"{name:44s} {tracked:14d} {planned:14d} {error:+7.2f}%  {per_gpu['peak_phase']}")
limit = float(__import__("os").environ.get("MAX_ERROR_PCT") or "inf")
if abs(error) > limit:
    print(f"torch_memory_check: {' '.join(name.split())}: error {error:+.2f}% exceeds {limit}%")
    sys.exit(1)
PY
}
[ -n "${ROWS:-}" ] || [ -n "$fp32_only" ] || check "1 rank  FULL_SHARD     seq 512  x 1"      1 FULL_SHARD    none 1 512
fsdp1_row() { check "2 ranks FSDP1 FULL_SHARD seq 1024 x 2"   2 FULL_SHARD none 2 1024 "$root/models/llama-100m.json" fsdp1; }
llama_block_row() { check "1 rank  llama 2k vocab AC seq 2048 x 1"     1 FULL_SHARD full 1 2048 "$root/tests/data/hf_configs/llama-100m-2k-vocab.json"; }
gpt2_block_row() { check "1 rank  GPT-2 2k ctx 2k vocab seq 2048 x 1" 1 FULL_SHARD none 1 2048 "$root/tests/data/hf_configs/gpt2-2k-context-2k-vocab.json"; }
op_sac_row() { check "1 rank  FULL_SHARD op-SAC seq 1024 x 2"   1 FULL_SHARD selective-op 2 1024; }
# LoRA (peft get_peft_model on both sides; FSDP1 with peft's fsdp_auto_wrap_policy, which fsdp-plan
# takes by default for LoRA under FSDP1): peft's default q_proj/v_proj, all-linear, dropout, a 2k
# vocabulary that puts the peak in a block's backward, --ac full, SDPA, k_proj/up_proj only (the
# first block's q then needs no gradient). No FSDP1 row: MemTracker cannot follow FSDP1's frozen flat
# parameters ("cannot register a hook on a tensor that doesn't require gradient"), and under bf16
# MixedPrecision without autocast FSDP1 with peft's wrap fails in PyTorch itself (peft casts
# lora_A's input to the fp32 weight it sees outside that unit's forward: "expected m1 and m2 to
# have the same dtype"); core/lora_test.cc and planner/memory_model_test.cc check FSDP1's rules. The
# dropout row differs by ATen's CPU dropout, which saves its noise in the input dtype (bf16) where
# CUDA's fused kernel saves the bool mask fsdp-plan counts: 1 byte per element of each adapted
# linear's input in every block whose input requires grad.
L=$root/models/llama-100m.json V2K=$root/tests/data/hf_configs/llama-100m-2k-vocab.json DEEP=$root/tests/data/hf_configs/llama-24-layers-2k-vocab.json
lora_quick_row() { check "1 rank  LoRA q,v r8 seq 1024 x 2"          1 FULL_SHARD none 2 1024 "$L" fsdp2 "--lora-rank 8"; }
# QLoRA: the model saved in bf16 and loaded back through bitsandbytes' BitsAndBytesConfig (NF4 in
# bf16 storage) on both sides' terms; FSDPMemTracker does not see bitsandbytes' QuantState tensors
# (neither parameters nor buffers), which torch_reference.py adds to its Total from the model.
qlora_quick_row() { check "1 rank  QLoRA q,v r8 seq 1024 x 2"         1 FULL_SHARD none 2 1024 "$L" fsdp2 "--lora-rank 8 --qlora"; }
lora_rows() {
  lora_quick_row
  check "1 rank  LoRA all-linear r16 1024 x 2"       1 FULL_SHARD none 2 1024 "$L" fsdp2 "--lora-rank 16 --lora-targets all-linear"
  check "1 rank  LoRA dropout 0.1 1024 x 2"          1 FULL_SHARD none 2 1024 "$L" fsdp2 "--lora-rank 8 --lora-dropout 0.1"
  check "1 rank  LoRA 2k vocab seq 2048 x 1"         1 FULL_SHARD none 1 2048 "$V2K" fsdp2 "--lora-rank 8"
  check "1 rank  LoRA k,up 2k vocab 2048 x 1"        1 FULL_SHARD none 1 2048 "$V2K" fsdp2 "--lora-rank 8 --lora-targets k_proj,up_proj"
  check "1 rank  LoRA AC full 1024 x 2"              1 FULL_SHARD full 2 1024 "$L" fsdp2 "--lora-rank 8"
  check "1 rank  LoRA o,down flash 1024 x 2"         1 FULL_SHARD none 2 1024 "$L" fsdp2 "--lora-rank 8 --lora-targets o_proj,down_proj" flash
  check "1 rank  LoRA bf16 base all-linear 1024 x 2" 1 FULL_SHARD none 2 1024 "$L" fsdp2 "--lora-rank 16 --lora-targets all-linear --base-dtype bf16"
  check "2 ranks LoRA bf16 base AC full 1024 x 2"    2 FULL_SHARD full 2 1024 "$L" fsdp2 "--lora-rank 8 --base-dtype bf16"
  qlora_rows
  pure_bf16_rows
}
# pure bf16 (--master-dtype bf16 on both sides: the model itself in bf16, AdamW's states too)
pure_bf16_rows() {
  check "1 rank  pure bf16 seq 1024 x 2"             1 FULL_SHARD none 2 1024 "$L" fsdp2 "--master-dtype bf16"
  check "1 rank  pure bf16 reduce bf16 512 x 1"      1 FULL_SHARD none 1 512  "$L" fsdp2 "--master-dtype bf16" eager bf16 bf16
  check "1 rank  pure bf16 reduce fp32 512 x 1"      1 FULL_SHARD none 1 512  "$L" fsdp2 "--master-dtype bf16"
}
qlora_rows() {
  qlora_quick_row
  check "2 ranks QLoRA dq all-linear AC 1024 x 2"    2 FULL_SHARD full 2 1024 "$L" fsdp2 "--lora-rank 16 --lora-targets all-linear --qlora --qlora-double-quant"
  check "1 rank  QLoRA 2k vocab seq 2048 x 1"        1 FULL_SHARD none 1 2048 "$V2K" fsdp2 "--lora-rank 8 --qlora"
}
# Older transformers releases (fsdp-plan --transformers-version, core/fsdp_config.h HfLoss): 4.44's
# loss (the model returns fp32 logits; the loss copies the shifted rows) and 4.48's (the loss
# upcasts and copies them), each run by that release from $TORCH_VENV/transformers-<version>
# (./fsdpkit test installs them) on PYTHONPATH, the model built on the device (4.44 has no
# initialize_weights); a micro-batch that puts the peak at the loss. Skipped where not installed.
transformers_version_rows() {
  local v dir
  # 4.31's tuple cache under use_cache=True (fsdp-plan --use-cache): every layer's k and v held
  # until the output is dropped, on a deep, narrow model (24 layers of 512) with a 2k vocabulary.
  # 16 x 512: the peak is the last block's forward at its eager softmax (scores, their fp32 copy
  # and the fp32 output beside 23 layers' caches); 32 x 256: the loss, with all 24. Both also hold
  # 4.31's per-layer RoPE tables (cos_cached, sin_cached: 2 x 512 positions x 64 fp32 a layer).
  dir=$(dirname "$(dirname "$python")")/transformers-4.31.0
  if [ ! -d "$dir/transformers" ]; then echo "transformers 4.31.0: not installed in $dir, skipped"; else
    PYTHONPATH=$dir TORCH_ONLY="--init device" PLAN_ONLY="--transformers-version 4.31" \
      check "1 rank  transformers 4.31 use_cache AC 512 x 16" 1 FULL_SHARD full 16 512 "$DEEP" fsdp2 --use-cache
    PYTHONPATH=$dir TORCH_ONLY="--init device" PLAN_ONLY="--transformers-version 4.31" \
      check "1 rank  transformers 4.31 use_cache AC 256 x 32" 1 FULL_SHARD full 32 256 "$DEEP" fsdp2 --use-cache
  fi
  for v in 4.44.2 4.48.1; do
    dir=$(dirname "$(dirname "$python")")/transformers-$v
    if [ ! -d "$dir/transformers" ]; then echo "transformers $v: not installed in $dir, skipped"; continue; fi
    PYTHONPATH=$dir TORCH_ONLY="--init device" PLAN_ONLY="--transformers-version $v" \
      check "1 rank  transformers $v AC full 1024 x 4" 1 FULL_SHARD full 4 1024
  done
  # one sequence: its logits[..., :-1, :] is contiguous already, so 4.48's loss makes no copy (with
  # one, the loss's forward would be the peak, 8% above this row's)
  if [ -d "$dir/transformers" ]; then
    PYTHONPATH=$dir TORCH_ONLY="--init device" PLAN_ONLY="--transformers-version $v" \
      check "1 rank  transformers $v flash AC 4096 x 1" 1 FULL_SHARD full 1 4096 "$root/models/llama-100m.json" fsdp2 "" flash
  fi
}
# the newer families (issue 18), built by transformers from small configs of their own: Qwen3's
# per-head q/k norms, OLMo 2's post-sub-layer norms and whole-projection q/k norms, Phi-3's fused
# qkv_proj and gate_up_proj, Gemma 2's four norms and soft-capping, Gemma 3's q/k norms and sliding
# windows (SDPA with a mask)
# and Qwen3-MoE's router and fused experts (transformers 5.24's grouped_mm path on the CPU, as on CUDA),
# DeepSeek-V3's latent attention, dense first layer, grouped sigmoid router and shared expert (eager
# only: with q/k and v head dims that differ the CPU runs SDPA's fp32 math fallback, where CUDA runs
# the memory-efficient kernel fsdp-plan models), Qwen3-MoE with two dense layers (mlp_only_layers),
# gpt-oss's attention sinks, biased experts and clamped SwiGLU (eager: it has no SDPA path), and
# Llama 4's dense and routed layers, NoPE layers and every-token experts, and Gemma 3's multimodal
# model with its SigLIP vision tower idle in text-only steps (FSDP2: no gradients or optimizer
# states for it; FSDP1: its FlatParameter's gradient and states cover it)
Q3=$root/tests/data/hf_configs/qwen3-100m.json O2=$root/tests/data/hf_configs/olmo2-100m.json
DS3=$root/tests/data/hf_configs/deepseek-v3-tiny.json Q3D=$root/tests/data/hf_configs/qwen3-moe-mlp-only.json
GO=$root/tests/data/hf_configs/gpt-oss-tiny.json L4=$root/tests/data/hf_configs/llama4-text-tiny.json
Q3M=$root/tests/data/hf_configs/qwen3-moe-tiny.json P3=$root/tests/data/hf_configs/phi3-100m.json
G2=$root/tests/data/hf_configs/gemma2-100m.json G3=$root/tests/data/hf_configs/gemma3-text-100m.json
G3V=$root/tests/data/hf_configs/gemma3-100m.json
family_quick_rows() {
  check "1 rank  Qwen3 GQA seq 1024 x 2"             1 FULL_SHARD none 2 1024 "$Q3"
  check "1 rank  OLMo 2 GQA seq 1024 x 2"            1 FULL_SHARD none 2 1024 "$O2"
  check "1 rank  Qwen3-MoE flash seq 1024 x 2"       1 FULL_SHARD none 2 1024 "$Q3M" fsdp2 "" flash
  check "1 rank  Phi-3 flash seq 1024 x 2"           1 FULL_SHARD none 2 1024 "$P3" fsdp2 "" flash
  check "1 rank  Gemma 2 soft-capped eager 1024 x 2"  1 FULL_SHARD none 2 1024 "$G2"
  check "1 rank  Gemma 3 windows flash 1024 x 2"     1 FULL_SHARD none 2 1024 "$G3" fsdp2 "" flash
  check "1 rank  DeepSeek-V3 eager seq 1024 x 2"     1 FULL_SHARD none 2 1024 "$DS3"
  RECORDED=1 check "1 rank  gpt-oss eager seq 1024 x 2"  1 FULL_SHARD none 2 1024 "$GO"
  check "1 rank  Llama 4 flash seq 1024 x 2"         1 FULL_SHARD none 2 1024 "$L4" fsdp2 "" flash
  check "2 ranks Gemma 3 + vision flash 1024 x 2"    2 FULL_SHARD none 2 1024 "$G3V" fsdp2 "" flash
}
family_rows() {
  family_quick_rows
  # the peak in a block's backward, scatter_'s buffer (CI's memory_model_test holds the H200 row)
  RECORDED=1 check "1 rank  gpt-oss eager seq 2048 x 2"  1 FULL_SHARD none 2 2048 "$GO"
  check "1 rank  Qwen3 flash seq 1024 x 2"           1 FULL_SHARD none 2 1024 "$Q3" fsdp2 "" flash
  check "2 ranks Qwen3 AC full seq 1024 x 2"         2 FULL_SHARD full 2 1024 "$Q3"
  check "1 rank  OLMo 2 flash seq 1024 x 2"          1 FULL_SHARD none 2 1024 "$O2" fsdp2 "" flash
  check "1 rank  OLMo 2 SAC seq 1024 x 2"            1 FULL_SHARD selective 2 1024 "$O2"
  check "1 rank  Qwen3-MoE eager seq 1024 x 2"       1 FULL_SHARD none 2 1024 "$Q3M"
  check "2 ranks Qwen3-MoE AC full seq 1024 x 2"     2 FULL_SHARD full 2 1024 "$Q3M"
  check "1 rank  Phi-3 eager seq 1024 x 2"           1 FULL_SHARD none 2 1024 "$P3"
  check "1 rank  Gemma 3 eager seq 1024 x 2"          1 FULL_SHARD none 2 1024 "$G3"
  check "2 ranks Gemma 2 AC full 1024 x 2"            2 FULL_SHARD full 2 1024 "$G2"
  check "1 rank  Gemma 3 windows flash SAC 1024 x 2" 1 FULL_SHARD selective 2 1024 "$G3" fsdp2 "" flash
  check "2 ranks DeepSeek-V3 AC full seq 1024 x 2"   2 FULL_SHARD full 2 1024 "$DS3"
  check "1 rank  DeepSeek-V3 SAC seq 1024 x 2"       1 FULL_SHARD selective 2 1024 "$DS3"
  check "1 rank  DeepSeek-V3 FSDP1 seq 2048 x 1"     1 FULL_SHARD none 1 2048 "$DS3" fsdp1
  check "1 rank  Qwen3-MoE 2 dense layers 1024 x 2"  1 FULL_SHARD none 2 1024 "$Q3D"
  # one rank: with two, gloo's threads free the collectives' buffers at varying moments, and the
  # recorded peak varies by 13% from run to run
  RECORDED=1 check "1 rank  gpt-oss AC full seq 1024 x 2"  1 FULL_SHARD full 2 1024 "$GO"
  RECORDED=1 check "1 rank  gpt-oss SAC seq 1024 x 2"      1 FULL_SHARD selective 2 1024 "$GO"
  check "2 ranks Gemma 3 + vision FSDP1 1024 x 2"    2 FULL_SHARD none 2 1024 "$G3V" fsdp1 "" flash
  check "1 rank  Llama 4 eager seq 1024 x 2"         1 FULL_SHARD none 2 1024 "$L4"
  check "2 ranks Llama 4 AC full seq 1024 x 2"       2 FULL_SHARD full 2 1024 "$L4"
  check "1 rank  Llama 4 SAC seq 1024 x 2"           1 FULL_SHARD selective 2 1024 "$L4"
  family_lora_rows
}
# LoRA on the routed families (peft's adapters, the experts frozen: their matmuls save no inputs)
family_lora_rows() {
  check "1 rank  Qwen3-MoE LoRA q,v r8 1024 x 2"     1 FULL_SHARD none 2 1024 "$Q3M" fsdp2 "--lora-rank 8 --lora-targets q_proj,v_proj"
  check "1 rank  gpt-oss LoRA q,v r8 1024 x 2"       1 FULL_SHARD none 2 1024 "$GO" fsdp2 "--lora-rank 8 --lora-targets q_proj,v_proj"
  check "1 rank  DeepSeek-V3 LoRA q_a,kv_b,o 1024 x 2" 1 FULL_SHARD none 2 1024 "$DS3" fsdp2 "--lora-rank 8 --lora-targets q_a_proj,kv_b_proj,o_proj"
  check "1 rank  Llama 4 LoRA q,down r8 1024 x 2"    1 FULL_SHARD none 2 1024 "$L4" fsdp2 "--lora-rank 8 --lora-targets q_proj,down_proj"
  check "2 ranks Gemma 3 + vision LoRA q,v 1024 x 2" 2 FULL_SHARD none 2 1024 "$G3V" fsdp2 "--lora-rank 8 --lora-targets q_proj,v_proj" flash
}
# fsdp-plan --impl torchtitan against torchtitan 0.2.2's own Llama 3, apply_fsdp, apply_ac and loss
# (tools/torchtitan_memory.py; RMSNorm saving what CUDA's fused kernel saves, its default) at
# llama-100m's shape (dim 768, 8 layers, 12 heads, FFN 2048: the same 105,788,160 parameters) or
# with the 2k vocabulary; skipped where torchtitan does not import. SDPA on both sides. The
# --impl torchtitan-2025-01 rows run torchtitan's January 2025 tree from $TORCHTITAN_2025_01.
titan_check() {  # name ranks ac micro seq vocab [version: 0.2.2 (default) | 2025-01, from $TORCHTITAN_2025_01]
  local model=$root/models/llama-100m.json; [ "$6" = 2048 ] && model=$root/tests/data/hf_configs/llama-100m-2k-vocab.json
  titan_run "$@" -- "$model" --family llama3 --dim 768 --layers 8 --heads 12 --kv-heads 12 --vocab "$6"
}
# torchtitan 0.2.2's Qwen3 on qwen3-100m's shape (tests/data/hf_configs/qwen3-100m.json: dim 768,
# 4 layers, 8 heads and 4 kv heads of 128, MLP 2048, 40,902,400 parameters) or its 2k vocabulary
titan_qwen3_check() {  # name ranks ac micro seq vocab
  local model=$root/tests/data/hf_configs/qwen3-100m.json; [ "$6" = 2048 ] && model=$root/tests/data/hf_configs/qwen3-100m-2k-vocab.json
  titan_run "$@" 0.2.2 -- "$model" --family qwen3 --dim 768 --layers 4 --heads 8 --kv-heads 4 --head-dim 128 --hidden-dim 2048 --vocab "$6"
}
titan_run() {  # name ranks ac micro seq vocab [version] -- model.json torchtitan_memory.py's model arguments...
  local name=$1 ranks=$2 ac=$3 micro=$4 seq=$5 version=0.2.2
  shift 6
  if [ "$1" != -- ]; then version=$1; shift; fi
  shift
  local model=$1
  shift
  local impl=torchtitan; [ "$version" = 2025-01 ] && impl=torchtitan-2025-01
  if [ -n "$plan_only" ]; then
    :
  elif [ "$version" = 2025-01 ]; then
    [ -n "${TORCHTITAN_2025_01:-}" ] || { echo "torch_memory_check: $name: skipped (TORCHTITAN_2025_01 unset)"; return 0; }
  elif ! "$python" -c "import torchtitan.models.llama3.infra.parallelize" 2> /dev/null; then
    echo "torch_memory_check: $name: skipped (torchtitan does not import)"
    return 0
  fi
  local args=(--version "$version" "$@" --ac "$ac" --micro-batch "$micro" --seq-len "$seq")
  if [ -z "$plan_only" ]; then
    [ "$version" = 2025-01 ] && export PYTHONPATH=$TORCHTITAN_2025_01
    if [ "$ranks" -gt 1 ]; then
      "$python" -m torch.distributed.run --standalone --nproc-per-node "$ranks" "$root/tools/torchtitan_memory.py" "${args[@]}" --out "$out/$name.json" > "$out/$name.log" 2>&1
    else
      "$python" "$root/tools/torchtitan_memory.py" "${args[@]}" --out "$out/$name.json" > "$out/$name.log" 2>&1
    fi
    [ "$version" = 2025-01 ] && unset PYTHONPATH
    python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); json.dump({"measured": {"memory": {"categories_at_peak": r["categories_at_peak"]}}}, open(sys.argv[1], "w"))' "$out/$name.json"
  fi
  "$build/fsdp-plan" --model "$model" --gpu h100-sxm --gpus "$ranks" --gpus-per-node "$ranks" --framework fsdp2 --impl "$impl" --ac "$ac" \
    --micro-batch "$micro" --seq-len "$seq" --attention flash --cublas-workspace-bytes 0 --torch-device cpu --json > "$out/$name.plan.json"
  compare "$name" "$out/$name.json" "$out/$name.plan.json"
}
titan_rows() {
  titan_check "1 rank  torchtitan        seq 1024 x 2" 1 none 2 1024 32000
  titan_check "1 rank  torchtitan AC     seq 1024 x 2" 1 full 2 1024 32000
  titan_check "1 rank  torchtitan op-SAC seq 1024 x 2" 1 selective-op 2 1024 32000
  titan_check "1 rank  torchtitan 2k vocab seq 2048 x 1" 1 none 1 2048 2048
  titan_check "1 rank  torchtitan 2k op-SAC seq 2048 x 1" 1 selective-op 1 2048 2048
  titan_check "2 ranks torchtitan        seq 1024 x 2" 2 none 2 1024 32000
  # torchtitan's main branch of January 2025 (its published Llama 3.1 8B runs): TORCHTITAN_2025_01=DIR
  # holding its torchtitan/ tree (tools/torchtitan_memory.py says how to extract it)
  titan_check "1 rank  tt-2025-01        seq 1024 x 2" 1 none 2 1024 32000 2025-01
  titan_check "1 rank  tt-2025-01 AC     seq 1024 x 2" 1 full 2 1024 32000 2025-01
  titan_check "1 rank  tt-2025-01 op-SAC seq 1024 x 2" 1 selective-op 2 1024 32000 2025-01
  titan_check "1 rank  tt-2025-01 2k vocab seq 2048 x 1" 1 none 1 2048 2048 2025-01
  titan_check "1 rank  tt-2025-01 2k op-SAC seq 2048 x 1" 1 selective-op 1 2048 2048 2025-01
  titan_check "2 ranks tt-2025-01        seq 1024 x 2" 2 none 2 1024 32000 2025-01
  # with GQA (4 kv heads of 12): January 2025's repeat_kv copies k and v to every head
  titan_run "1 rank  tt-2025-01 GQA     seq 1024 x 2" 1 none 2 1024 32000 2025-01 -- "$root/tests/data/hf_configs/llama-100m-gqa.json" \
    --family llama3 --dim 768 --layers 8 --heads 12 --kv-heads 4 --vocab 32000
  titan_run "1 rank  tt-2025-01 GQA op-SAC 1024 x 2" 1 selective-op 2 1024 32000 2025-01 -- "$root/tests/data/hf_configs/llama-100m-gqa.json" \
    --family llama3 --dim 768 --layers 8 --heads 12 --kv-heads 4 --vocab 32000
  titan_qwen3_check "1 rank  tt Qwen3        seq 1024 x 2" 1 none 2 1024 8192
  titan_qwen3_check "2 ranks tt Qwen3        seq 1024 x 2" 2 none 2 1024 8192
  titan_qwen3_check "1 rank  tt Qwen3 AC     seq 2048 x 2" 1 full 2 2048 8192
  titan_qwen3_check "2 ranks tt Qwen3 AC     seq 2048 x 2" 2 full 2 2048 8192
  titan_qwen3_check "2 ranks tt Qwen3 op-SAC seq 2048 x 2" 2 selective-op 2 2048 8192
  titan_qwen3_check "1 rank  tt Qwen3 2k vocab seq 2048 x 1" 1 none 1 2048 2048
  titan_qwen3_check "1 rank  tt Qwen3 2k op-SAC seq 2048 x 1" 1 selective-op 1 2048 2048
  titan_qwen3_check "1 rank  tt Qwen3 2k AC  seq 2048 x 1" 1 full 1 2048 2048
}
# fp32 training (--param-dtype fp32 --reduce-dtype fp32 on both sides: no casts, the model's own
# fp32 parameters gathered): the norms' and the eager softmax's upcasts are the tensors themselves,
# the loss's upcast of the logits too. PyTorch's CPU runs fp32 matrix products fast on any x86, so
# these rows run where the bf16 ones cannot (tools/cpu_bf16_gemm.py): QUICK=fp32 (CTest
# torch_memory_agreement_fp32) runs the first (a block's backward peak), ROWS=fp32 all eleven.
fp32_quick_rows() {
  check "1 rank  fp32 2k vocab seq 2048 x 1"         1 FULL_SHARD none 1 2048 "$V2K" fsdp2 "" eager fp32 fp32
}
fp32_rows() {
  fp32_quick_rows
  check "2 ranks fp32 FSDP1 seq 1024 x 2"            2 FULL_SHARD none 2 1024 "$L" fsdp1 "" eager fp32 fp32
  check "1 rank  fp32 Gemma 2 seq 1024 x 2"          1 FULL_SHARD none 2 1024 "$G2" fsdp2 "" eager fp32 fp32
  check "1 rank  fp32 FULL_SHARD seq 1024 x 2"       1 FULL_SHARD none 2 1024 "$L" fsdp2 "" eager fp32 fp32
  check "1 rank  fp32 AC full seq 1024 x 2"          1 FULL_SHARD full 2 1024 "$L" fsdp2 "" eager fp32 fp32
  check "1 rank  fp32 flash seq 1024 x 2"            1 FULL_SHARD none 2 1024 "$L" fsdp2 "" flash fp32 fp32
  check "1 rank  fp32 Qwen3 seq 1024 x 2"            1 FULL_SHARD none 2 1024 "$Q3" fsdp2 "" eager fp32 fp32
  check "1 rank  fp32 OLMo 2 seq 1024 x 2"           1 FULL_SHARD none 2 1024 "$O2" fsdp2 "" eager fp32 fp32
  check "1 rank  fp32 Phi-3 flash seq 1024 x 2"      1 FULL_SHARD none 2 1024 "$P3" fsdp2 "" flash fp32 fp32
  check "1 rank  fp32 Qwen3-MoE flash 1024 x 2"      1 FULL_SHARD none 2 1024 "$Q3M" fsdp2 "" flash fp32 fp32
  check "1 rank  fp32 LoRA q,v r8 seq 1024 x 2"      1 FULL_SHARD none 2 1024 "$L" fsdp2 "--lora-rank 8" eager fp32 fp32
}
if [ "${ROWS:-}" = fp32 ]; then
  fp32_rows
  exit 0
fi
if [ "${QUICK:-}" = fp32 ]; then
  fp32_quick_rows
  exit 0
fi
if [ "${ROWS:-}" = torchtitan ]; then
  [ -n "$plan_only" ] || "$python" -c "import torchtitan.models.llama3.infra.parallelize" 2> /dev/null || { echo "torch_memory_check: $python has no torchtitan"; exit 77; }
  titan_rows
  exit 0
fi
if [ "${ROWS:-}" = transformers-versions ]; then
  transformers_version_rows
  exit 0
fi
if [ "${ROWS:-}" = families ]; then
  family_rows
  exit 0
fi
if [ "${ROWS:-}" = lora ]; then
  lora_rows
  exit 0
fi
if [ "${ROWS:-}" = qlora ]; then
  qlora_rows
  exit 0
fi
if [ "${ROWS:-}" = pure-bf16 ]; then
  pure_bf16_rows
  exit 0
fi
if [ -n "${QUICK:-}" ]; then
  if [ "$QUICK" != others ]; then  # QUICK=llama: the Llama and GPT-2 rows
    check "1 rank  FULL_SHARD AC  seq 1024 x 2"      1 FULL_SHARD    full 2 1024
    check "1 rank  SHARD_GRAD_OP  seq 1024 x 2"      1 SHARD_GRAD_OP none 2 1024
    fsdp1_row
    llama_block_row
    gpt2_block_row
    op_sac_row
  fi
  if [ "$QUICK" != llama ]; then  # QUICK=others: the families, LoRA, QLoRA and torchtitan rows
    family_quick_rows
    check "2 ranks Llama 4 AC full seq 1024 x 2"       2 FULL_SHARD full 2 1024 "$L4"  # a softmax's-backward peak
    lora_quick_row
    qlora_quick_row
    titan_check "1 rank  torchtitan AC     seq 1024 x 2" 1 full 2 1024 32000
    titan_qwen3_check "1 rank  tt Qwen3 AC     seq 2048 x 2" 1 full 2 2048 8192
  fi
  exit 0
fi
check "1 rank  FULL_SHARD     seq 1024 x 2"      1 FULL_SHARD    none 2 1024
check "1 rank  FULL_SHARD AC  seq 1024 x 2"      1 FULL_SHARD    full 2 1024
check "1 rank  FULL_SHARD holds outputs 1024 x 2"  1 FULL_SHARD none 2 1024 "$root/models/llama-100m.json" fsdp2 --loop-holds-outputs
check "1 rank  SHARD_GRAD_OP  seq 1024 x 2"      1 SHARD_GRAD_OP none 2 1024
check "2 ranks FULL_SHARD     seq 1024 x 2"      2 FULL_SHARD    none 2 1024
check "2 ranks FULL_SHARD AC  seq 1024 x 2"      2 FULL_SHARD    full 2 1024
check "1 rank  FULL_SHARD SAC seq 1024 x 4"      1 FULL_SHARD    selective 4 1024
check "1 rank  FULL_SHARD SAC seq 2048 x 2 GQA"  1 FULL_SHARD    selective 2 2048 "$root/tests/data/hf_configs/llama-100m-gqa.json"
fsdp1_row
check "1 rank  FSDP1 NO_SHARD   seq 1024 x 2"    1 NO_SHARD none 2 1024 "$root/models/llama-100m.json" fsdp1
check "2 ranks FSDP1 SHARD_GRAD_OP seq 1024 x 2" 2 SHARD_GRAD_OP none 2 1024 "$root/models/llama-100m.json" fsdp1
check "2 ranks FSDP1 FULL_SHARD AC seq 1024 x 2" 2 FULL_SHARD full 2 1024 "$root/models/llama-100m.json" fsdp1
check "1 rank  llama 2k vocab    seq 2048 x 1"     1 FULL_SHARD none 1 2048 "$root/tests/data/hf_configs/llama-100m-2k-vocab.json"
llama_block_row
check "1 rank  GPT-2 FULL_SHARD   seq 1024 x 2"    1 FULL_SHARD    none 2 1024 "$root/tests/data/hf_configs/gpt2-no-dropout.json"
gpt2_block_row
check "1 rank  GPT-2 2k ctx 2k vocab AC 2048 x 1" 1 FULL_SHARD full 1 2048 "$root/tests/data/hf_configs/gpt2-2k-context-2k-vocab.json"
check "1 rank  FULL_SHARD flash seq 1024 x 2"    1 FULL_SHARD    none 2 1024 "$root/models/llama-100m.json" fsdp2 "" flash
check "1 rank  2k vocab flash SAC seq 2048 x 1"  1 FULL_SHARD selective 1 2048 "$root/tests/data/hf_configs/llama-100m-2k-vocab.json" fsdp2 "" flash
check "1 rank  FULL_SHARD AC every 2nd 1024 x 2"  1 FULL_SHARD full 2 1024 "$root/models/llama-100m.json" fsdp2 "--ac-every 2"
op_sac_row
check "1 rank  op-SAC flash seq 1024 x 2"        1 FULL_SHARD selective-op 2 1024 "$root/models/llama-100m.json" fsdp2 "" flash
check "1 rank  op-SAC seq 2048 x 2 GQA"          1 FULL_SHARD selective-op 2 2048 "$root/tests/data/hf_configs/llama-100m-gqa.json"
check "1 rank  2k vocab op-SAC seq 2048 x 1"     1 FULL_SHARD selective-op 1 2048 "$root/tests/data/hf_configs/llama-100m-2k-vocab.json"
# SDPA with the peak in a block's backward (a 256-token vocabulary): fsdp-plan's known excess there
check "1 rank  256 vocab flash seq 2048 x 1"     1 FULL_SHARD none 1 2048 "$root/tests/data/hf_configs/llama-100m-256-vocab.json" fsdp2 "" flash
lora_rows
family_rows
transformers_version_rows
