#!/usr/bin/env bash
# Records the JSON outputs of fsdp-plan, fsdp-sim and fsdp-run (CPU ranks and cuda-emu) over a matrix
# of models, strategies, frameworks, checkpointing, offload, prefetch, wrapping and world sizes, one
# file per case, so that a refactor can be checked figure by figure:
#
#   tools/golden-outputs.sh build /tmp/before     # before the change
#   ... change, rebuild ...
#   tools/golden-outputs.sh build /tmp/after
#   python3 tools/golden-diff.py /tmp/before /tmp/after
#
# Measured times and heap sizes of fsdp-run vary run to run; golden-diff.py leaves them out.
# FAST=1 skips the fsdp-run cases (about two minutes of the run).
set -euo pipefail
BUILD=${1:?usage: tools/golden-outputs.sh BUILD_DIR OUT_DIR}
OUT=${2:?usage: tools/golden-outputs.sh BUILD_DIR OUT_DIR}
cd "$(dirname "$0")/.."
export FSDPKIT_DATA_DIR=$PWD
mkdir -p "$OUT"
PLAN=$BUILD/fsdp-plan SIM=$BUILD/fsdp-sim RUN=$BUILD/fsdp-run RUN_EMU=$BUILD/fsdp-run-emu

# One configuration per line: a name, then fsdp-plan / fsdp-sim flags.
CASES=$(cat <<'EOF'
l7b_fs_8           --model llama-2-7b --gpus 8
l7b_fs_8_fsdp2     --model llama-2-7b --gpus 8 --framework fsdp2
l7b_sgo_8          --model llama-2-7b --gpus 8 --strategy shard_grad_op
l7b_ns_8           --model llama-2-7b --gpus 8 --strategy no_shard
l7b_ns_8_fsdp2     --model llama-2-7b --gpus 8 --strategy no_shard --framework fsdp2
l7b_hs_16          --model llama-2-7b --gpus 16 --strategy hybrid_shard
l7b_hs_16_fsdp2    --model llama-2-7b --gpus 16 --strategy hybrid_shard --framework fsdp2
l7b_fs_16_ga4      --model llama-2-7b --gpus 16 --grad-accum 4
l7b_fs_16_ga4_ns   --model llama-2-7b --gpus 16 --grad-accum 4 --no-sync
l7b_sgo_16_ga4_ns  --model llama-2-7b --gpus 16 --grad-accum 4 --no-sync --strategy shard_grad_op
l7b_fs2_ga4_ns     --model llama-2-7b --gpus 16 --grad-accum 4 --no-sync --framework fsdp2
l7b_ac_full        --model llama-2-7b --gpus 8 --ac full
l7b_ac_sel         --model llama-2-7b --gpus 8 --ac selective --attention eager
l7b_ac_every2      --model llama-2-7b --gpus 8 --ac full --ac-every 2
l8b_ac_selop       --model llama-3.1-8b --gpus 8 --seq-len 8192 --micro-batch 2 --ac selective-op
l8b_16_fsdp2       --model llama-3.1-8b --gpus 16 --seq-len 8192 --framework fsdp2
l8b_16_fsdp1       --model llama-3.1-8b --gpus 16 --seq-len 8192
l7b_offload        --model llama-2-7b --gpus 8 --cpu-offload
l7b_offload_fsdp2  --model llama-2-7b --gpus 8 --cpu-offload --framework fsdp2
l7b_post           --model llama-2-7b --gpus 8 --backward-prefetch post
l7b_none           --model llama-2-7b --gpus 8 --backward-prefetch none
l7b_fwdpre         --model llama-2-7b --gpus 8 --forward-prefetch
l7b_nolimit        --model llama-2-7b --gpus 8 --no-limit-all-gathers
l7b_origparams     --model llama-2-7b --gpus 6 --gpus-per-node 6 --use-orig-params
l7b_fp16           --model llama-2-7b --gpus 8 --param-dtype fp16 --reduce-dtype fp16
l7b_fp32           --model llama-2-7b --gpus 8 --param-dtype fp32 --reduce-dtype fp32
l7b_sgd            --model llama-2-7b --gpus 8 --optimizer sgd-momentum
l7b_loop_outputs   --model llama-2-7b --gpus 8 --loop-holds-outputs
l7b_wrap_none      --model llama-2-7b --gpus 8 --wrap none
l7b_wrap_size      --model llama-2-7b --gpus 8 --wrap size:1e8
l7b_wrap_linear    --model llama-2-7b --gpus 8 --wrap linear
l7b_wrap_linear2   --model llama-2-7b --gpus 8 --wrap linear --framework fsdp2
l7b_1gpu_fsdp2     --model llama-2-7b --gpus 1 --framework fsdp2
l7b_1gpu_fsdp1     --model llama-2-7b --gpus 1
l70b_64            --model llama-2-70b --gpus 64 --ac full
l70b_64_fsdp2      --model llama-2-70b --gpus 64 --ac full --framework fsdp2 --micro-batch 2
l405b_1024         --model llama-3.1-405b --gpus 1024 --seq-len 4096 --ac full
mistral_8          --model mistral-7b --gpus 8
mixtral_32         --model mixtral-8x7b --gpus 32 --ac full
qwen_8             --model qwen2.5-7b --gpus 8
qwen72_fsdp2       --model qwen2.5-72b --gpus 64 --framework fsdp2 --ac full
gpt2_4             --model gpt2 --gpus 4 --seq-len 1024
gpt2xl_8_eager     --model gpt2-xl --gpus 8 --seq-len 1024 --attention eager
tiny_3             --model tiny-llama --gpus 3 --gpus-per-node 3 --seq-len 32
tiny_3_fsdp2       --model tiny-llama --gpus 3 --gpus-per-node 3 --seq-len 32 --framework fsdp2
l100m_2_fsdp2      --model llama-100m --gpus 2 --gpus-per-node 2 --seq-len 512 --framework fsdp2 --attention eager
l7b_a100_efa       --model llama-2-7b --gpus 16 --cluster a100-40gb-efa --gpu a100-40gb-sxm --seq-len 2048
l7b_rtx4090        --model llama-2-7b --gpu rtx-4090 --gpus 4 --gpus-per-node 4 --ac full
l13b_mb4_ga8       --model llama-2-13b --gpus 32 --micro-batch 4 --grad-accum 8 --ac full
l7b_lora_fsdp1     --model llama-2-7b --gpus 8 --lora-rank 16 --lora-targets all-linear
l7b_lora_fsdp2     --model llama-2-7b --gpus 8 --framework fsdp2 --lora-rank 16 --lora-dropout 0.05 --base-dtype bf16 --ac full
l7b_lora_origp     --model llama-2-7b --gpus 8 --lora-rank 8 --wrap block --use-orig-params
l70b_qlora_4090    --model llama-2-70b --gpu rtx-4090 --gpus 4 --gpus-per-node 4 --seq-len 2048 --lora-rank 16 --lora-targets all-linear --qlora --ac full
l7b_qlora_dq_fp32  --model llama-2-7b --gpus 8 --framework fsdp2 --lora-rank 8 --qlora --qlora-double-quant --qlora-compute-dtype fp32
l7b_qlora_offload  --model llama-2-7b --gpus 8 --lora-rank 8 --qlora --cpu-offload
l7b_pure_bf16      --model llama-2-7b --gpus 8 --framework fsdp2 --master-dtype bf16 --reduce-dtype bf16
l7b_tf444_holds    --model llama-2-7b --gpu rtx-4090 --gpus 2 --lora-rank 64 --qlora --micro-batch 6 --seq-len 2048 --ac full --transformers-version 4.44 --loop-holds-outputs
mistral_tf448      --model mistral-7b --gpus 2 --gpu a100-80gb-sxm --master-dtype bf16 --micro-batch 2 --ac full --transformers-version 4.48.1
l8b_titan          --model llama-3.1-8b --gpus 8 --seq-len 8192 --framework fsdp2 --impl torchtitan --ac selective-op
l8b_alloc_conf     --model llama-3.1-8b --gpus 8 --seq-len 8192 --framework fsdp2 --alloc-conf expandable_segments:True
qwen3_8b_8         --model qwen3-8b --gpus 8 --framework fsdp2 --ac full
qwen3_moe_16       --model qwen3-30b-a3b --gpus 16 --framework fsdp2 --ac full
gemma3_27b_16      --model gemma-3-27b --gpus 16 --framework fsdp2 --ac full
olmo2_8            --model olmo-2-7b --gpus 8
phi4_8             --model phi-4 --gpus 8 --ac full
dsv3_256           --model deepseek-v3 --gpus 256 --framework fsdp2 --ac full --seq-len 4096
gptoss_20b_8       --model gpt-oss-20b --gpus 8 --framework fsdp2 --ac full
llama4_scout_32    --model llama-4-scout --gpus 32 --framework fsdp2 --ac full
EOF
)

n=0
while read -r name args; do
  [ -n "$name" ] || continue
  # shellcheck disable=SC2086
  $PLAN $args --json >"$OUT/plan.$name.json" 2>/dev/null || echo "fsdp-plan $name: exit $?" >"$OUT/plan.$name.json"
  # shellcheck disable=SC2086
  $PLAN $args --timeline >"$OUT/plan.$name.timeline.txt" 2>/dev/null || true
  # shellcheck disable=SC2086
  $SIM $args --json >"$OUT/sim.$name.json" 2>/dev/null || echo "fsdp-sim $name: exit $?" >"$OUT/sim.$name.json"
  n=$((n + 1))
done <<<"$CASES"
$SIM --model llama-2-7b --gpus 64 --per-rank --jitter 0.05 --slow-rank 7=1.1 --json >"$OUT/sim.per_rank_64.json"
$SIM --model llama-2-7b --gpus 8 --separate-process-groups --json >"$OUT/sim.separate_pg.json"
$SIM --model llama-2-7b --gpus 8 --launch-overhead 0 --json >"$OUT/sim.no_launch.json"
$PLAN recommend --model llama-2-7b --gpu-types h100-sxm,a100-80gb-sxm --gpus-max 16 --json --quiet >"$OUT/recommend.l7b.json"
$PLAN recommend --model gpt2 --seq-len 1024 --gpu-types rtx-4090 --gpus-max 4 --global-batch 64 --json --quiet >"$OUT/recommend.gpt2.json"
$PLAN advise --model llama-2-13b --gpu rtx-4090 --gpus 4 >"$OUT/advise.l13b.txt"
$PLAN >"$OUT/plan.default.txt"
echo "recorded $n plan/sim cases" >&2

[ "${FAST:-0}" = 1 ] && exit 0
# fsdp-run: CPU ranks (one process, and MPI) and the GPU engine on cuda-emu.
RUN_CASES=$(cat <<'EOF'
cpu_fs_1        1 --model tiny-llama --seq-len 16 --steps 2
cpu_fs_3        3 --model tiny-llama --seq-len 16 --steps 2 --gpus 3
cpu_sgo_2_ga3   2 --model tiny-llama --seq-len 16 --steps 2 --gpus 2 --strategy shard_grad_op --grad-accum 3 --no-sync
cpu_ns_2        2 --model tiny-llama --seq-len 16 --steps 2 --gpus 2 --strategy no_shard
cpu_hs_4        4 --model tiny-llama --seq-len 16 --steps 2 --gpus 4 --gpus-per-node 2 --strategy hybrid_shard
cpu_ac_2        2 --model tiny-llama --seq-len 16 --steps 2 --gpus 2 --ac full --forward-prefetch --backward-prefetch post
cpu_sel_2       2 --model tiny-llama --seq-len 16 --steps 2 --gpus 2 --ac selective --wrap none
cpu_lora_3      3 --model tiny-llama --seq-len 16 --steps 2 --gpus 3 --framework fsdp2 --lora-rank 4 --lora-targets all-linear --lora-dropout 0.1 --base-dtype bf16
cpu_lora_f1_2   2 --model tiny-llama --seq-len 16 --steps 2 --gpus 2 --lora-rank 4 --wrap block --use-orig-params
cpu_qlora_2     2 --model tiny-llama --seq-len 16 --steps 2 --gpus 2 --framework fsdp2 --lora-rank 4 --lora-targets all-linear --qlora
cpu_qlora_f1_2  2 --model tiny-llama --seq-len 16 --steps 2 --gpus 2 --lora-rank 4 --qlora --wrap block --use-orig-params --param-dtype fp32 --reduce-dtype fp32
cpu_pure_bf16_2 2 --model tiny-llama --seq-len 16 --steps 2 --gpus 2 --framework fsdp2 --master-dtype bf16 --reduce-dtype bf16
EOF
)
MPI="mpirun --allow-run-as-root --oversubscribe -np"
while read -r name ranks args; do
  [ -n "$name" ] || continue
  # shellcheck disable=SC2086
  $MPI "$ranks" $RUN $args --quiet --out "$OUT/run.$name.json" </dev/null >/dev/null 2>&1 || echo "fsdp-run $name failed" >"$OUT/run.$name.json"
done <<<"$RUN_CASES"
if [ -x "$RUN_EMU" ]; then
  EMU_CASES=$(cat <<'EOF'
emu_fs_1        --model tiny-llama --seq-len 16 --steps 2
emu_v8          --model tiny-llama --seq-len 16 --steps 2 --gpus 8 --virtual-world 8
emu_v4_ga2_ac   --model tiny-llama --seq-len 16 --steps 2 --gpus 4 --virtual-world 4 --grad-accum 2 --ac full --param-dtype fp32 --reduce-dtype fp32
emu_v4_sel      --model tiny-llama --seq-len 16 --steps 2 --gpus 4 --virtual-world 4 --ac selective --forward-prefetch --backward-prefetch post
emu_v2_sgo_ns   --model tiny-llama --seq-len 16 --steps 2 --gpus 2 --virtual-world 2 --strategy shard_grad_op --grad-accum 2 --no-sync
emu_v2_wrapnone --model tiny-llama --seq-len 16 --steps 2 --gpus 2 --virtual-world 2 --wrap none --framework fsdp2
EOF
)
  while read -r name args; do
    [ -n "$name" ] || continue
    # shellcheck disable=SC2086
    $RUN_EMU --device cuda $args --quiet --out "$OUT/run.$name.json" </dev/null >/dev/null 2>&1 || echo "fsdp-run-emu $name failed" >"$OUT/run.$name.json"
  done <<<"$EMU_CASES"
fi
echo "recorded the fsdp-run cases" >&2
