#!/usr/bin/env bash
# fsdp-run's GPU checks in one go, for a machine with one NVIDIA GPU and the CUDA toolkit but no
# Debian packages (carry .device-deps, made by tools/prepare-device-deps.sh). Steps, most important
# first, so that a session cut short still brings back what matters:
#   1. builds fsdp-run and cuda_test for this GPU's architecture (Ninja, all cores);
#   2. runs cuda_test: every CUDA kernel, the attention, a whole block and training steps against
#      the CPU implementation, and the allocated peak against the planner's replay;
#   3. runs fsdp-run --device cuda and tools/torch_reference.py (PyTorch FSDP2) pair by pair on
#      TinyLlama 1.1B at sequence length 2048 (FULL_SHARD, AC off and on, SHARD_GRAD_OP, NO_SHARD,
#      selective AC), each writing predicted vs measured JSON; the FULL_SHARD pair starts both from
#      one seeded bf16 checkpoint on one token file (--init-from, --tokens), so their losses are
#      compared too; after the first two pairs, the reserved-memory sweep: PyTorch FSDP2 alone on
#      five models with and without expandable segments, LoRA (also as peft recipes run it: dropout, a bf16
#      base), QLoRA (bitsandbytes on the GPU) and pure bf16 (SWEEP below), for
#      tools/gpu_memory_check.py to compare with fsdp-plan's caching-allocator replay;
#   4. runs tools/hf_parity.py --device cuda: fsdp-run's fp32 losses against transformers' training
#      of the same safetensors checkpoint on the same tokens;
#   5. runs fsdp-run alone with virtual world 8 (FULL_SHARD with and without AC, SHARD_GRAD_OP);
#   6. runs fsdp-run calibrate --device cuda and one more FULL_SHARD run with the calibrated
#      hardware file ($OUT/calibrated-gpu.json);
#   7. runs the kernel checks again under compute-sanitizer's memcheck where it works;
#   and merges everything into $OUT/device-check.json after every run, keeping the log in
#   $OUT/device-check.log.
# Must finish in under 8 minutes including the build: every step has a `timeout`, so one hang (an
# NCCL bootstrap, a kernel) costs its limit, not the device session, and a step after the build
# starts only if it ends within BUDGET_S (default 480 s) even when it runs to its timeout.
# Environment: OUT (default ./device-out), RUNS,
# MODEL, SEQ, STEPS to shrink or grow the runs; DRY_RUN=1 prints the commands instead; MERGE_ONLY=1
# only merges the JSON files already in $RUNS. PARTS picks the steps after the build (default
# "kernels pairs sweep hf_parity virtual calibrate memcheck"; also "sdpa": the FULL_SHARD pairs
# again with PyTorch on SDPA, and "large": fsdp-run on LARGE_MODEL, default llama-3.1-8b, rank 0 of
# a virtual world of 8 at seq 4096 with full AC); SWEEP_FILE replaces the sweep's table (same format).
# HISTORY=1 also records each sweep run's allocator history (torch_reference.py --memory-history:
# every alloc and free with its stream and the Python line that made it) and brings them back as
# $OUT/histories.tar.gz, for build/bench/allocator_replay and a trace like docs/accuracy.md's of
# Llama 3.2 1B. Without a part that needs fsdp-run (PARTS="sweep" alone) nothing is built:
#   SWEEP_FILE=tools/device-sweep-outliers.txt HISTORY=1 PARTS=sweep tools/device-check.sh
#
# REHEARSE=1 runs the whole script on a machine without a GPU, to find what would break before a GPU
# session: fsdp-run-emu and cuda_emu_test from $BUILD (default build; the GPU engine on cuda-emu,
# src/runtime/cuda/emu) stand for the device build, PyTorch runs on the CPU (FSDPKIT_PYTHON, gloo),
# MODEL defaults to tiny-llama at SEQ 32 for 3 STEPS, and the build, nvidia-smi and memcheck are
# skipped; OUT defaults to ./device-out-rehearsal and device-check.json says "rehearsal": true.
# Nothing it writes is a measurement; it checks that every step runs and that the merge reads what
# the steps write.
set -uo pipefail
cd "$(dirname "$0")/.."
# What fsdp-run and cuda_test are built from, as one hash. Binaries built off the device go into
# prebuilt-device/ with it: `PRINT_SOURCE_HASH=1 tools/device-check.sh > prebuilt-device/source.sha256`.
source_hash() { find src CMakeLists.txt -type f | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1; }
[ -n "${PRINT_SOURCE_HASH:-}" ] && { source_hash; exit 0; }
REHEARSE=${REHEARSE:-}
OUT=${OUT:-$PWD/device-out${REHEARSE:+-rehearsal}}
if [ -n "$REHEARSE" ]; then
  BUILD=${BUILD:-build}
  FSDP_RUN=${FSDP_RUN:-$BUILD/fsdp-run-emu}
  CUDA_TEST=${CUDA_TEST:-$BUILD/src/runtime/cuda_emu_test}
  CUDA_TEST_ARGS=${CUDA_TEST_ARGS:---test-case=RoPE*,Cross-entropy*}  # the whole suite is CTest's cuda_emu_test
  PYTHON=${PYTHON:-${FSDPKIT_PYTHON:-python3}}
  TORCH_DEVICE=cpu
  MODEL=${MODEL:-tiny-llama}
  SEQ=${SEQ:-32}
  STEPS=${STEPS:-3}
else
  FSDP_RUN=${FSDP_RUN:-build-device/fsdp-run}
  CUDA_TEST=${CUDA_TEST:-build-device/src/runtime/cuda_test}
  CUDA_TEST_ARGS=${CUDA_TEST_ARGS:-}
  PYTHON=${PYTHON:-python3}
  TORCH_DEVICE=cuda
  MODEL=${MODEL:-tinyllama-1.1b}
  SEQ=${SEQ:-2048}
  STEPS=${STEPS:-6}
fi
# bitsandbytes for the sweep's QLoRA row, carried in .device-deps/python (tools/prepare-device-deps.sh)
# for a machine without its own
if [ -z "$REHEARSE" ] && [ -d .device-deps/python/bitsandbytes ] && ! "$PYTHON" -c "import bitsandbytes" > /dev/null 2>&1; then
  export PYTHONPATH=$PWD/.device-deps/python${PYTHONPATH:+:$PYTHONPATH}
fi
BUDGET_S=${BUDGET_S:-480}
PARTS=" ${PARTS:-kernels pairs sweep hf_parity virtual calibrate memcheck} "
part() { [[ "$PARTS" == *" $1 "* ]]; }
needs_engine() {  # any part that runs fsdp-run or cuda_test
  local p
  for p in kernels pairs sdpa large hf_parity virtual calibrate memcheck; do part "$p" && return 0; done
  return 1
}
read -r -a cuda_test_args <<< "$CUDA_TEST_ARGS"  # words, not globbed
RUNS=${RUNS:-${TMPDIR:-/tmp}/fsdpkit-device-runs}  # one JSON per run; only the merge goes to $OUT (8 files come back)
HIST=${RUNS}_histories  # HISTORY=1's allocator histories: apart from $RUNS, whose every file the merge reads
[ -n "${MERGE_ONLY:-}" ] || rm -rf "$RUNS" "$HIST"
mkdir -p "$RUNS" "$OUT" "$HIST"
LOG=$OUT/device-check.log
: > "$LOG"
say() { echo "== $*" | tee -a "$LOG"; }
run() {  # run a command, logging it; DRY_RUN prints it only
  echo "\$ $*" | tee -a "$LOG"
  [ -n "${DRY_RUN:-}" ] && return 0
  "$@" 2>&1 | tee -a "$LOG"
  return "${PIPESTATUS[0]}"
}
merge() {
python3 - "$RUNS" "$OUT/device-check.json" <<'PY'
# Merges the runs and compares, per configuration: fsdp-run's peak with its own prediction,
# fsdp-plan's PyTorch FSDP2 profile with PyTorch's max_memory_allocated and its caching-allocator
# replay with max_memory_reserved, fsdp-run's step time with
# fsdp-plan's model of its fused kernels, PyTorch's step time with fsdp-plan's PyTorch eager model,
# and fsdp-run's tokens/s with PyTorch's.
import json, os, sys, datetime
runs, out = sys.argv[1], sys.argv[2]
doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "rehearsal": bool(os.environ.get("REHEARSE")), "runs": {}, "comparison": {}}
for name in sorted(os.listdir(runs)):
    with open(os.path.join(runs, name)) as f:
        doc["runs"][name[:-5]] = json.load(f)
def err(measured, predicted):
    return None if not measured or predicted is None else 100.0 * (predicted - measured) / measured
print(f"{'configuration':20s} {'peak GiB':>9s} {'pred':>7s} {'err%':>6s} {'torch GiB':>9s} {'plan':>7s} {'err%':>6s} "
      f"{'step s':>7s} {'pred':>7s} {'err%':>6s} {'tok/s':>8s} {'torch':>8s} {'ratio':>6s} {'pt-step%':>8s}")
for name, r in doc["runs"].items():
    if not name.startswith("fsdp_"):
        continue
    key = name[5:]
    m, p = r["measured"], r["predicted"]
    t = doc["runs"].get("torch_" + key, {}).get("measured", {})
    row = {
        "fsdp_run_peak_bytes": m["memory"]["rank0_peak_bytes"],
        "fsdp_run_predicted_peak_bytes": p["memory"]["peak_bytes"],
        "fsdp_run_reserved_bytes": m["memory"].get("rank0_peak_reserved_bytes"),
        # the engine's replay: reserved if the GPU keeps up with the host, and if the host runs a step ahead
        "fsdp_run_predicted_reserved_bytes": p["memory"].get("reserved_peak_bytes"),
        "fsdp_run_predicted_reserved_lagging_bytes": p["memory"].get("reserved_peak_lagging_bytes"),
        "plan_pytorch_peak_bytes": p["pytorch_profile"]["allocated_peak_bytes"],
        "torch_max_allocated_bytes": t.get("memory", {}).get("max_allocated_bytes"),
        "plan_pytorch_reserved_bytes": p["pytorch_profile"].get("reserved_peak_bytes"),
        "torch_max_reserved_bytes": t.get("memory", {}).get("max_reserved_bytes"),
        "fsdp_run_step_s": m["time"]["step_s"], "plan_step_s": p["time"]["step_s"],
        "fsdp_run_tokens_per_s": m["tokens_per_s_per_gpu"], "torch_tokens_per_s": t.get("tokens_per_s_per_gpu", t.get("tokens_per_s")),
        "torch_step_s": t.get("time", {}).get("step_s"), "plan_pytorch_step_s": p["pytorch_profile"].get("step_s"),
    }
    row["peak_error_pct"] = err(row["fsdp_run_peak_bytes"], row["fsdp_run_predicted_peak_bytes"])
    row["plan_vs_torch_error_pct"] = err(row["torch_max_allocated_bytes"], row["plan_pytorch_peak_bytes"])
    # the caching allocator's replay against torch.cuda.max_memory_reserved (issue 17)
    row["plan_vs_torch_reserved_error_pct"] = err(row["torch_max_reserved_bytes"], row["plan_pytorch_reserved_bytes"])
    row["step_error_pct"] = err(row["fsdp_run_step_s"], row["plan_step_s"])
    row["plan_vs_torch_step_error_pct"] = err(row["torch_step_s"], row["plan_pytorch_step_s"])
    row["tokens_ratio_vs_torch"] = row["fsdp_run_tokens_per_s"] / row["torch_tokens_per_s"] if row["torch_tokens_per_s"] else None
    # same checkpoint and tokens (torch's --init-from): the losses of the steps both ran, warm-up first
    same = doc["runs"].get("torch_" + key, {}).get("config", {}).get("init_from") and r.get("inputs", {}).get("init_from")
    pairs = list(zip(m.get("loss", []), t.get("loss", []))) if same else []
    row["loss_max_rel_diff_vs_torch"] = max(abs(a - b) / abs(b) for a, b in pairs) if pairs else None
    doc["comparison"][key] = row
    g = lambda b: b / 2**30 if b else float("nan")
    f = lambda x: x if x is not None else float("nan")
    print(f"{key:20s} {g(row['fsdp_run_peak_bytes']):9.3f} {g(row['fsdp_run_predicted_peak_bytes']):7.3f} {f(row['peak_error_pct']):6.1f} "
          f"{g(row['torch_max_allocated_bytes']):9.3f} {g(row['plan_pytorch_peak_bytes']):7.3f} {f(row['plan_vs_torch_error_pct']):6.1f} "
          f"{row['fsdp_run_step_s']:7.4f} {row['plan_step_s']:7.4f} {f(row['step_error_pct']):6.1f} "
          f"{row['fsdp_run_tokens_per_s']:8.0f} {f(row['torch_tokens_per_s']):8.0f} {f(row['tokens_ratio_vs_torch']):6.2f} "
          f"{f(row['plan_vs_torch_step_error_pct']):8.1f}"
          + (f"  losses vs torch: max rel {row['loss_max_rel_diff_vs_torch']:.1e}" if pairs else "")
          + f"  reserved torch {g(row['torch_max_reserved_bytes']):.3f} plan {g(row['plan_pytorch_reserved_bytes']):.3f} GiB"
            f" ({f(row['plan_vs_torch_reserved_error_pct']):.1f}%)")
with open(out, "w") as f:
    json.dump(doc, f, indent=1)
PY
}
[ -n "${MERGE_ONLY:-}" ] && { merge; exit; }  # only re-merge the runs already in $RUNS
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }
in_budget() {  # step name, its timeout: true if it ends within the budget even at its timeout
  [ $(( $(elapsed) + $2 )) -le "$BUDGET_S" ] && return 0
  say "skipped $1: $(elapsed) s elapsed + its $2 s limit would pass the budget of $BUDGET_S s"
  return 1
}
export FSDPKIT_DATA_DIR=$PWD

if [ -n "$REHEARSE" ]; then
  say "rehearsal without a GPU: $FSDP_RUN, $CUDA_TEST, PyTorch on the CPU ($PYTHON); nothing here is a measurement"
  for f in "$FSDP_RUN" "$CUDA_TEST"; do
    needs_engine || break
    [ -x "$f" ] || { echo "device-check: $f missing: build the cuda-emu targets (cmake --build $BUILD)" | tee -a "$LOG"; exit 2; }
  done
elif ! needs_engine; then
  say "machine (parts: $PARTS; no fsdp-run needed, nothing built)"
  run timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
else
  say "machine"
  run timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  run timeout 30 nvcc --version

  say "build"
  deps=$PWD/.device-deps/usr
  [ -d "$deps" ] || { echo "device-check: .device-deps missing: run tools/prepare-device-deps.sh here and carry .device-deps" | tee -a "$LOG"; exit 2; }
  export LD_LIBRARY_PATH="$deps/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
  nccl_root=""
  if [ ! -e /usr/local/cuda/include/nccl.h ] && [ ! -e /usr/include/nccl.h ]; then  # the pip wheel that PyTorch uses
    nccl_root=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) if nvidia.nccl.__file__ else list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)
    [ -n "$nccl_root" ] && export LD_LIBRARY_PATH="$nccl_root/lib:$LD_LIBRARY_PATH"
  fi
  arch=$(timeout 30 nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '.')
  # Binaries built off the device (PREBUILT, default prebuilt-device: fsdp-run and cuda_test built
  # with this script's configure line for sm_90 against .device-deps, without MPI) save the build
  # when the GPU is sm_90 and their libraries load here (exit 127 is the loader's failure).
  PREBUILT=${PREBUILT:-prebuilt-device}
  prebuilt_ok() {
    [ "${arch:-}" = 90 ] && [ -x "$PREBUILT/fsdp-run" ] && [ -x "$PREBUILT/cuda_test" ] || return 1
    # built from these sources: the stamp source_hash() wrote when they were copied in
    [ "$(cat "$PREBUILT/source.sha256" 2>/dev/null)" = "$(source_hash)" ] || { say "$PREBUILT is stale or unstamped: building"; return 1; }
    local cuda_libs=/usr/local/cuda/lib64:/usr/local/cuda/lib
    export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$cuda_libs:$(python3 -c 'import nvidia, os; print(":".join(os.path.join(p, d, "lib") for p in nvidia.__path__ for d in os.listdir(p)))' 2>/dev/null)"
    "$PREBUILT/fsdp-run" --help > /dev/null 2>&1 || return 1
    "$PREBUILT/cuda_test" --help > /dev/null 2>&1; [ $? -ne 127 ]
  }
  if prebuilt_ok; then
    FSDP_RUN=$PREBUILT/fsdp-run; CUDA_TEST=$PREBUILT/cuda_test
    say "using $PREBUILT's binaries (sm_90, built off the device): no build"
  else
    generator=$(command -v ninja > /dev/null && echo Ninja || echo "Unix Makefiles")
    run timeout 120 cmake -S . -B build-device -G "$generator" -DCMAKE_BUILD_TYPE=Release -DFSDP_WITH_CUDA=ON -DCMAKE_PREFIX_PATH="$deps" \
      -DCMAKE_CUDA_ARCHITECTURES="${arch:-90}" ${nccl_root:+-DNCCL_ROOT=$nccl_root} || exit 1
    run timeout 300 cmake --build build-device -j"$(nproc)" --target fsdp-run cuda_test || exit 1
    say "build done after $(elapsed) s"
  fi
fi

if part kernels; then
  say "kernel and engine checks ($CUDA_TEST)"
  run timeout 180 "$CUDA_TEST" ${cuda_test_args[@]+"${cuda_test_args[@]}"}
  echo "cuda_test exit $?" | tee -a "$LOG"
fi

# One checkpoint and token file for the FULL_SHARD pair, so that fsdp-run and PyTorch FSDP2 train the
# same weights on the same tokens and their bf16 losses can be compared step by step.
CKPT=${TMPDIR:-/tmp}/fsdpkit-device-ckpt
part pairs && say "checkpoint of $MODEL for the FULL_SHARD pair (seeded, bf16 safetensors)"
part pairs && in_budget "checkpoint" 90 || CKPT=""
[ -n "$CKPT" ] && run timeout 90 "$PYTHON" - "$CKPT" "models/$MODEL.json" "$TORCH_DEVICE" <<'PY' || CKPT=""
import json, random, sys
import torch, transformers
out, model_json, device = sys.argv[1], sys.argv[2], sys.argv[3]
config = transformers.LlamaConfig.from_dict(json.load(open(model_json)))
torch.manual_seed(7)
with torch.device(device):
    model = transformers.LlamaForCausalLM(config)
model.to(torch.bfloat16).save_pretrained(out)
rng = random.Random(7)
with open(out + "/tokens.txt", "w") as f:
    f.write(" ".join(str(rng.randrange(config.vocab_size)) for _ in range(100000)))
print("checkpoint", out)
PY
same=(); [ -n "$CKPT" ] && same=(--init-from "$CKPT" --tokens "$CKPT/tokens.txt")

say "fsdp-run --device cuda, $MODEL, seq $SEQ"
common=(--device cuda --model "$MODEL" --seq-len "$SEQ" --micro-batch 1 --steps "$STEPS" --quiet --param-dtype bf16 --reduce-dtype fp32)
fsdp() {  # name, then extra flags; the merge is refreshed after every run, so a cut-short session still brings results back
  local name=$1; shift
  in_budget "fsdp-run $name" 90 || return 0
  run timeout 90 "$FSDP_RUN" "${common[@]}" "$@" --out "$RUNS/fsdp_$name.json"
  [ -n "${DRY_RUN:-}" ] || merge > /dev/null 2>&1 || true
}
torch_run() {  # name, strategy, ac, extra flags
  local name=$1 strategy=$2 ac=$3; shift 3
  in_budget "PyTorch $name" 90 || return 0
  run timeout 90 "$PYTHON" tools/torch_reference.py --device "$TORCH_DEVICE" --model "models/$MODEL.json" --strategy "$strategy" --ac "$ac" \
    --micro-batch 1 --seq-len "$SEQ" --steps "$STEPS" --warmup 2 --param-dtype bf16 --reduce-dtype fp32 --attention eager --out "$RUNS/torch_$name.json" "$@"
  [ -n "${DRY_RUN:-}" ] || merge > /dev/null 2>&1 || true
}
# PyTorch FSDP2 alone on more models, micro-batches and allocator settings, for the caching
# allocator's replay (issue 17): max_memory_allocated, max_memory_reserved and the allocator's own
# counters per run; fsdp-plan's figures for them are computed off the device by
# tools/gpu_memory_check.py. Each line: name, PYTORCH_CUDA_ALLOC_CONF (- for none), the wave it
# runs in, torch_reference flags. The runs of one wave share the GPU at once: their memory
# figures are per process and exact, their times are not used. A wave's predicted reserved peaks
# add up to at most ~110 GiB of the H200's 140 (fsdp-plan --gpu h200-sxm --gpus 1).
SWEEP=$(cat <<'TABLE'
tinyllama_eager_exp expandable_segments:True 1 --model models/tinyllama-1.1b.json --seq-len 2048 --micro-batch 1 --attention eager
tinyllama_ac_mb8 - 1 --model models/tinyllama-1.1b.json --seq-len 2048 --micro-batch 8 --attention sdpa --ac full
tinyllama_ac_mb8_exp expandable_segments:True 1 --model models/tinyllama-1.1b.json --seq-len 2048 --micro-batch 8 --attention sdpa --ac full
llama32_1b_mb2 - 2 --model tests/data/hf_configs/llama-3.2-1b.json --seq-len 2048 --micro-batch 2 --attention sdpa
llama32_1b_mb2_exp expandable_segments:True 2 --model tests/data/hf_configs/llama-3.2-1b.json --seq-len 2048 --micro-batch 2 --attention sdpa
qwen2_1.5b_ac - 2 --model tests/data/hf_configs/qwen2-1.5b.json --seq-len 4096 --micro-batch 2 --attention sdpa --ac full
qwen2_1.5b_ac_exp expandable_segments:True 3 --model tests/data/hf_configs/qwen2-1.5b.json --seq-len 4096 --micro-batch 2 --attention sdpa --ac full
gemma3_1b_mb2 - 3 --model models/gemma-3-1b.json --seq-len 2048 --micro-batch 2 --attention sdpa
qwen3_100m_mb8 - 3 --model tests/data/hf_configs/qwen3-100m.json --seq-len 2048 --micro-batch 8 --attention sdpa
qwen25_05b_ac_mb4 - 4 --model tests/data/hf_configs/qwen2.5-0.5b.json --seq-len 4096 --micro-batch 4 --attention sdpa --ac full
tinyllama_lora_mb4 - 4 --model models/tinyllama-1.1b.json --seq-len 2048 --micro-batch 4 --attention sdpa --lora-rank 16 --lora-targets all-linear
qwen25_05b_ac_mb4_exp expandable_segments:True 5 --model tests/data/hf_configs/qwen2.5-0.5b.json --seq-len 4096 --micro-batch 4 --attention sdpa --ac full
tinyllama_bf16_mb4 - 5 --model models/tinyllama-1.1b.json --seq-len 2048 --micro-batch 4 --attention sdpa --master-dtype bf16
tinyllama_max_split max_split_size_mb:512 6 --model models/tinyllama-1.1b.json --seq-len 2048 --micro-batch 1 --attention eager
tinyllama_qlora_mb4 - 6 --model models/tinyllama-1.1b.json --seq-len 2048 --micro-batch 4 --attention sdpa --lora-rank 16 --lora-targets all-linear --qlora
tinyllama_lora_recipe_mb4 - 6 --model models/tinyllama-1.1b.json --seq-len 2048 --micro-batch 4 --attention sdpa --lora-rank 16 --lora-targets all-linear --lora-dropout 0.05 --base-dtype bf16
TABLE
)
[ -n "${SWEEP_FILE:-}" ] && SWEEP=$(grep -v '^#' "$SWEEP_FILE")
reserved_sweep() {
  part sweep || return 0
  in_budget "reserved sweep" 120 || return 0
  say "reserved-memory sweep: PyTorch FSDP2 alone, one wave of runs at a time sharing the GPU"
  local wave name conf w flags pids=()
  for wave in $(awk '{print $3}' <<< "$SWEEP" | sort -un); do
    in_budget "sweep wave $wave" 120 || break  # a wave's runs end within their 120 s timeout
    while read -r name conf w flags; do
      [ "$w" = "$wave" ] || continue
      [ -n "$REHEARSE" ] && { flags="--model models/$MODEL.json --seq-len $SEQ --micro-batch 1 --attention eager"; [ "$wave" = 1 ] || continue; }
      read -r -a flag_words <<< "$flags"
      [ -n "${HISTORY:-}" ] && flag_words+=(--memory-history "$HIST/hist_$name.json")
      echo "\$ PYTORCH_CUDA_ALLOC_CONF=$conf torch_reference.py ${flags} (wave $wave)" | tee -a "$LOG"
      [ -n "${DRY_RUN:-}" ] && continue
      ( [ "$conf" = - ] || export PYTORCH_CUDA_ALLOC_CONF=$conf
        timeout 120 "$PYTHON" tools/torch_reference.py --device "$TORCH_DEVICE" --framework fsdp2 --strategy FULL_SHARD \
          "${flag_words[@]}" --steps 2 --warmup 2 --no-tracker --param-dtype bf16 --reduce-dtype fp32 \
          --out "$RUNS/sweep_$name.json" > "$RUNS/sweep_$name.log" 2>&1
        echo "sweep $name exit $?" >> "$RUNS/sweep_$name.log" ) &
      pids+=($!)
    done <<< "$SWEEP"
    [ ${#pids[@]} -eq 0 ] || wait "${pids[@]}"
    pids=()
    for log in "$RUNS"/sweep_*.log; do  # a run's figures, or the end of what it printed when it failed
      [ -e "$log" ] || continue
      if grep -q "exit 0$" "$log"; then grep -E "exit|peak allocated" "$log"; else tail -8 "$log"; fi
    done | tee -a "$LOG"
    rm -f "$RUNS"/sweep_*.log
  done
  if [ -n "${HISTORY:-}" ] && [ -z "${DRY_RUN:-}" ] && compgen -G "$HIST/hist_*.json" > /dev/null; then
    tar -czf "$OUT/histories.tar.gz" -C "$HIST" . && say "allocator histories: $OUT/histories.tar.gz ($(du -h "$OUT/histories.tar.gz" | cut -f1))"
  fi
  [ -n "${DRY_RUN:-}" ] || merge > /dev/null 2>&1 || true
}
# The pairs with PyTorch first (fsdp2 profiles against fully_shard; FSDP2 has no NO_SHARD, so that
# pair is FSDP1's on both sides), then the runs without a PyTorch counterpart.
if part pairs; then
  fsdp full_shard --framework fsdp2 --strategy FULL_SHARD ${same[@]+"${same[@]}"}
  torch_run full_shard FULL_SHARD none ${same[@]+"${same[@]}"}
  fsdp full_shard_ac --framework fsdp2 --strategy FULL_SHARD --ac full
  torch_run full_shard_ac FULL_SHARD full
fi
if part sdpa; then  # PyTorch with SDPA (its flash kernel) against fsdp-run's own fused attention
  fsdp full_shard_sdpa --framework fsdp2 --strategy FULL_SHARD
  torch_run full_shard_sdpa FULL_SHARD none --attention sdpa
  fsdp full_shard_ac_sdpa --framework fsdp2 --strategy FULL_SHARD --ac full
  torch_run full_shard_ac_sdpa FULL_SHARD full --attention sdpa
fi
reserved_sweep
if part pairs; then
  fsdp shard_grad_op --framework fsdp2 --strategy SHARD_GRAD_OP
  torch_run shard_grad_op SHARD_GRAD_OP none
  fsdp no_shard --framework fsdp1 --strategy NO_SHARD
  torch_run no_shard NO_SHARD none --framework fsdp1
  fsdp full_shard_sac --framework fsdp2 --strategy FULL_SHARD --ac selective
  torch_run full_shard_sac FULL_SHARD selective
  say "pairs with PyTorch done after $(elapsed) s"
fi
if part large && in_budget "fsdp-run ${LARGE_MODEL:=llama-3.1-8b}" 120; then  # memory and speed at a larger model's shapes
  run timeout 120 "$FSDP_RUN" --device cuda --model "$LARGE_MODEL" --seq-len 4096 --micro-batch 1 --steps 4 --quiet --param-dtype bf16 \
    --reduce-dtype fp32 --framework fsdp2 --strategy FULL_SHARD --ac full --virtual-world 8 --out "$RUNS/fsdp_large_v8.json"
  [ -n "${DRY_RUN:-}" ] || merge > /dev/null 2>&1 || true
fi

if part hf_parity && in_budget "hf_parity" 120; then
  say "fsdp-run --device cuda against transformers on the same checkpoint and tokens (tools/hf_parity.py, fp32)"
  run timeout 120 "$PYTHON" tools/hf_parity.py --fsdp-run "$FSDP_RUN" --device cuda
  echo "hf_parity exit $?" | tee -a "$LOG"
fi
if part virtual; then
  fsdp full_shard_v8 --framework fsdp2 --strategy FULL_SHARD --virtual-world 8
  fsdp full_shard_ac_v8 --framework fsdp2 --strategy FULL_SHARD --ac full --virtual-world 8
  fsdp shard_grad_op_v8 --framework fsdp2 --strategy SHARD_GRAD_OP --virtual-world 8
fi
if part calibrate && in_budget "calibrate" 120; then
  say "fsdp-run calibrate --device cuda"
  run timeout 120 "$FSDP_RUN" calibrate --device cuda --model "$MODEL" --seq-len "$SEQ" --micro-batch 1 --out "$OUT/calibrated-gpu.json"
  [ -e "$OUT/calibrated-gpu.json" ] && fsdp full_shard_calibrated --framework fsdp2 --strategy FULL_SHARD --gpu "$OUT/calibrated-gpu.json"
fi
# out-of-bounds and misaligned accesses in the kernels (not on gVisor machines); cuda-emu checks
# bounds only per allocation, so this still has something to find
if part memcheck && [ -z "$REHEARSE" ] && command -v compute-sanitizer > /dev/null && in_budget "compute-sanitizer" 120; then
  say "compute-sanitizer memcheck on the kernel checks"
  run timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 "$CUDA_TEST" \
    --test-case-exclude="Training steps*,Gradient accumulation*,calibrate*,Dynamic loss scaling*"
  echo "memcheck exit $?" | tee -a "$LOG"
fi
say "fsdp-run done after $(elapsed) s"

[ -n "${DRY_RUN:-}" ] && exit 0
merge
say "total $(elapsed) s"
