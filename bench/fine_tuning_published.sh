#!/usr/bin/env bash
# fsdp-plan against the published LoRA / QLoRA / pure-bf16 FSDP memory figures of
# docs/data/fine_tuning_published.json whose configuration is known well enough to plan (the row
# number in that file is in each name): the figure's kind (torch.cuda.max_memory_allocated or
# max_memory_reserved per GPU) against the same figure of fsdp-plan. Prints one line per run.
#   bench/fine_tuning_published.sh [build dir]
# Settings the sources leave open and that are taken here: adapters in bf16 where the whole model
# is bf16 (--master-dtype bf16: the Answer.AI and fms runs load bf16 and do not upcast), reduction
# in bf16 where FSDP runs without MixedPrecision (fms, llama-recipes' pure_bf16), SDPA / flash
# attention except llama-recipes' 2023 run (transformers 4.31: eager), full checkpointing where
# the run checkpoints (HF gradient_checkpointing, reentrant or not, checkpoints every layer).
# fms-acceleration's benchmark (scripts/benchmarks/defaults.yaml: gradient_checkpointing: True, no
# gradient_checkpointing_kwargs; accelerate.yaml: FSDP FULL_SHARD, mixed_precision 'no') runs the HF
# Trainer on transformers 4.48.1, whose gradient_checkpointing_enable() then takes use_reentrant=True
# (modeling_utils.py) and calls the checkpoint around each FSDP1-wrapped layer: --ac-reentrant, under
# which the frozen LoRA / QLoRA units hold each layer's input and its gradient to the end of backward
# (tools/reentrant_check.py measures it on CPU ranks).
# llama-recipes at e5970e2e loads LlamaForCausalLM.from_pretrained without use_cache=False (Llama 2's
# config has use_cache true) and checkpoints with torch's checkpoint_wrapper (policies/
# activation_checkpointing_functions.py), not HF's gradient_checkpointing_enable, which is what turns
# the cache off: its forward returns every layer's keys and values (--use-cache), the "~4 GB of
# activation memory" its PR #165 later saved with use_cache=False.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
P=${1:-$root/build}/fsdp-plan
export FSDPKIT_DATA_DIR=$root
while IFS='|' read -r name pub kind flags tps; do
  [ -z "$name" ] && continue
  out=$($P $flags --json 2>&1) || { echo "$name: ERROR $out"; continue; }
  echo "$out" | python3 -c "
import json,sys
j=json.load(sys.stdin); p=j['memory']['per_gpu']
kind='$kind'; pub=float('$pub')
v={'allocated': p['allocator']['allocated_blocks_peak_bytes'], 'active': p['allocator']['active_peak_bytes'], 'reserved': p['reserved_peak_bytes']}[kind]
t=j['time']['tokens_per_s_per_gpu']; tp='$tps'
speed=f'tokens/s/GPU published {float(tp):6.0f} fsdp-plan {t:6.0f} {100*(t-float(tp))/float(tp):+5.1f}%' if tp else f'tokens/s/GPU fsdp-plan {t:6.0f}'
retries=f'  allocator retries {p[\"alloc_retries\"]}' if p['alloc_retries'] else ''
print(f'{\"$name\":36s} {kind:9s} published {pub/2**30:6.2f} GiB  fsdp-plan {v/2**30:6.2f} GiB {100*(v-pub)/pub:+6.1f}%  {speed}{retries}')
"
done <<'ROWS'
#20 fms mistral7b lora 2xA100|15144870400|allocated|--model mistral-7b --gpu a100-80gb-sxm --gpus 2 --lora-rank 16 --lora-targets q_proj,k_proj,v_proj,o_proj --lora-dropout 0.1 --master-dtype bf16 --reduce-dtype bf16 --seq-len 4096 --micro-batch 2 --ac full --transformers-version 4.48 --ac-reentrant|2946.3
#21 fms mistral7b qlora 2xA100|9424594432|allocated|--model mistral-7b --gpu a100-80gb-sxm --gpus 2 --lora-rank 16 --lora-targets q_proj,k_proj,v_proj,o_proj --lora-dropout 0.1 --master-dtype bf16 --reduce-dtype bf16 --qlora --qlora-double-quant --seq-len 4096 --micro-batch 2 --ac full --transformers-version 4.48 --ac-reentrant|2949.2
#22 fms llama70b qlora 2xA100|46685287936|allocated|--model llama-2-70b --gpu a100-80gb-sxm --gpus 2 --lora-rank 16 --lora-targets q_proj,k_proj,v_proj,o_proj --lora-dropout 0.1 --master-dtype bf16 --reduce-dtype bf16 --qlora --qlora-double-quant --seq-len 4096 --micro-batch 2 --ac full --transformers-version 4.48 --ac-reentrant|433.5
#23 fms mistral7b full bf16|36225939968|allocated|--model mistral-7b --gpu a100-80gb-sxm --gpus 2 --master-dtype bf16 --reduce-dtype bf16 --seq-len 4096 --micro-batch 2 --ac full --transformers-version 4.48 --ac-reentrant|2777.2
#9 answerai llama7b qlora 2x3090|5594194575|reserved|--model llama-2-7b --gpu rtx-3090 --gpus 2 --lora-rank 64 --lora-alpha 16 --lora-targets k_proj,q_proj,v_proj,up_proj,down_proj,gate_proj --lora-dropout 0.1 --master-dtype bf16 --qlora --qlora-double-quant --seq-len 2048 --micro-batch 1 --ac full --transformers-version 4.38 --loop-holds-outputs
#10 answerai llama7b lora 2x3090|10973880893|reserved|--model llama-2-7b --gpu rtx-3090 --gpus 2 --lora-rank 64 --lora-alpha 16 --lora-targets k_proj,q_proj,v_proj,up_proj,down_proj,gate_proj --lora-dropout 0.1 --master-dtype bf16 --seq-len 2048 --micro-batch 1 --ac full --transformers-version 4.38 --loop-holds-outputs
#10 answerai llama7b lora 3090 alloc|9835475107|allocated|--model llama-2-7b --gpu rtx-3090 --gpus 2 --lora-rank 64 --lora-alpha 16 --lora-targets k_proj,q_proj,v_proj,up_proj,down_proj,gate_proj --lora-dropout 0.1 --master-dtype bf16 --seq-len 2048 --micro-batch 1 --ac full --transformers-version 4.38 --loop-holds-outputs
#11 answerai llama7b qlora 4090 mb10|22516567818|reserved|--model llama-2-7b --gpu rtx-4090 --gpus 2 --lora-rank 64 --lora-alpha 16 --lora-targets k_proj,q_proj,v_proj,up_proj,down_proj,gate_proj --lora-dropout 0.1 --master-dtype bf16 --qlora --qlora-double-quant --seq-len 2048 --micro-batch 10 --ac full --transformers-version 4.38 --loop-holds-outputs
#12 answerai llama7b lora 4090 mb6|22924573573|reserved|--model llama-2-7b --gpu rtx-4090 --gpus 2 --lora-rank 64 --lora-alpha 16 --lora-targets k_proj,q_proj,v_proj,up_proj,down_proj,gate_proj --lora-dropout 0.1 --master-dtype bf16 --seq-len 2048 --micro-batch 6 --ac full --transformers-version 4.38 --loop-holds-outputs
#13 answerai 70b qlora offload 4090|16020422328|reserved|--model llama-2-70b --gpu rtx-4090 --gpus 2 --lora-rank 64 --lora-alpha 16 --lora-targets k_proj,q_proj,v_proj,up_proj,down_proj,gate_proj --lora-dropout 0.1 --master-dtype bf16 --qlora --qlora-double-quant --seq-len 2048 --micro-batch 2 --ac full --cpu-offload --transformers-version 4.38 --loop-holds-outputs
#25 llama-recipes 7b lora bf16 reserved|19360000000|reserved|--model llama-2-7b --gpu a100-40gb-sxm --gpus 4 --lora-rank 8 --lora-alpha 32 --lora-targets q_proj,v_proj --lora-dropout 0.05 --master-dtype bf16 --reduce-dtype bf16 --seq-len 2048 --micro-batch 4 --ac full --attention eager --transformers-version 4.31 --use-cache
#25 llama-recipes 7b lora bf16 active|15220000000|active|--model llama-2-7b --gpu a100-40gb-sxm --gpus 4 --lora-rank 8 --lora-alpha 32 --lora-targets q_proj,v_proj --lora-dropout 0.05 --master-dtype bf16 --reduce-dtype bf16 --seq-len 2048 --micro-batch 4 --ac full --attention eager --transformers-version 4.31 --use-cache
#25 llama-recipes holds outputs reserved|27360000000|reserved|--model llama-2-7b --gpu a100-40gb-sxm --gpus 4 --lora-rank 8 --lora-alpha 32 --lora-targets q_proj,v_proj --lora-dropout 0.05 --master-dtype bf16 --reduce-dtype bf16 --seq-len 2048 --micro-batch 4 --ac full --attention eager --transformers-version 4.31 --use-cache --loop-holds-outputs
#25 llama-recipes holds outputs active|20200000000|active|--model llama-2-7b --gpu a100-40gb-sxm --gpus 4 --lora-rank 8 --lora-alpha 32 --lora-targets q_proj,v_proj --lora-dropout 0.05 --master-dtype bf16 --reduce-dtype bf16 --seq-len 2048 --micro-batch 4 --ac full --attention eager --transformers-version 4.31 --use-cache --loop-holds-outputs
#25 llama-recipes no limit reserved|32670000000|reserved|--model llama-2-7b --gpu a100-40gb-sxm --gpus 4 --lora-rank 8 --lora-alpha 32 --lora-targets q_proj,v_proj --lora-dropout 0.05 --master-dtype bf16 --reduce-dtype bf16 --seq-len 2048 --micro-batch 4 --ac full --attention eager --transformers-version 4.31 --use-cache --loop-holds-outputs --no-limit-all-gathers
#25 llama-recipes no limit active|25860000000|active|--model llama-2-7b --gpu a100-40gb-sxm --gpus 4 --lora-rank 8 --lora-alpha 32 --lora-targets q_proj,v_proj --lora-dropout 0.05 --master-dtype bf16 --reduce-dtype bf16 --seq-len 2048 --micro-batch 4 --ac full --attention eager --transformers-version 4.31 --use-cache --loop-holds-outputs --no-limit-all-gathers
ROWS
