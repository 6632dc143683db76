#include "cli/plan_cli.h"

#include <fmt/format.h>
#include <fmt/ostream.h>
#include <fmt/ranges.h>

#include <optional>

#include "cli/cli_util.h"
#include "core/limits.h"
#include "core/lora.h"
#include "core/workload.h"
#include "planner/memory_model.h"
#include "planner/export.h"
#include "planner/plan_report.h"
#include "planner/step_model.h"

#include <algorithm>
#include <cmath>

namespace fsdp {
namespace {

template <typename T>
Status Assign(T& out, Result<T> value) {
  if (!value.ok()) return value.error();
  out = value.value();
  return {};
}

Result<FrameworkOverheads> OverheadsFromFlags(const PlanFlags& f, const Workload& w) {
  FrameworkOverheads o = FrameworkOverheadsFor(w);
  auto non_negative = [](std::optional<int64_t> v, const char* flag, int64_t& out) -> Status {
    if (!v) return {};
    if (*v < 0 || static_cast<double>(*v) > limits::kOverheadBytes.max) {
      return Error::BadInput(fmt::format("{} must be between 0 and {:.3g} bytes, got {}", flag, limits::kOverheadBytes.max, *v));
    }
    out = *v;
    return {};
  };
  if (Status s = non_negative(f.cuda_context_bytes, "--cuda-context-bytes", o.cuda_context_bytes); !s.ok()) return s.error();
  if (Status s = non_negative(f.nccl_bytes, "--nccl-bytes", o.nccl_bytes_per_communicator); !s.ok()) return s.error();
  if (Status s = non_negative(f.cublas_workspace_bytes, "--cublas-workspace-bytes", o.cublas_workspace_bytes); !s.ok()) return s.error();
  if (f.cublas_workspace_bytes) o.cublas_workspace_blocks = o.cublas_workspace_bytes > 0 ? std::vector<int64_t>{o.cublas_workspace_bytes} : std::vector<int64_t>{};
  if (f.fragmentation) {
    if (!(*f.fragmentation >= 0 && *f.fragmentation < 1)) {
      return Error::BadInput(fmt::format("--fragmentation must be in [0, 1), got {}", *f.fragmentation));
    }
    o.fragmentation_fraction = *f.fragmentation;
  }
  o.one_stream = f.one_stream;
  return o;
}

std::string Percent(int64_t part, int64_t whole) {
  return whole > 0 ? fmt::format("{:.1f}%", 100.0 * static_cast<double>(part) / static_cast<double>(whole)) : "-";
}

void PrintHeader(const Workload& w, std::ostream& out) {
  const FsdpConfig& c = w.config;
  const std::string cuda_total = w.hardware.DeviceTotalBytes() < w.hardware.memory_bytes
                                     ? fmt::format(", {} GiB of it for CUDA", Gib(w.hardware.DeviceTotalBytes()))
                                     : std::string();
  fmt::print(out, "{} ({} parameters) on {} x {} ({} GiB each{}), {} GPUs per node\n", w.model.id, WithCommas(w.model.ParamsTotal()), c.gpus,
             w.hardware.id, Gib(w.hardware.memory_bytes), cuda_total, c.gpus_per_node);
  fmt::print(out, "{} {}, {} wrap ({} units), seq {} x micro-batch {}, grad-accum {}{}, params {}, reduce {}, {}, AC {}, {} attention{}\n",
             FrameworkName(c.framework), StrategyName(c.strategy), IsTorchtitan(c.impl) ? "torchtitan's" : WrapPolicyName(c.wrap), w.units.size(), c.seq_len, c.micro_batch,
             c.grad_accum, c.no_sync ? " (no_sync)" : "", DTypeName(c.param_dtype), DTypeName(c.reduce_dtype), OptimizerName(c.optimizer),
             c.ac_every > 1 ? fmt::format("full on 1 block in {}", c.ac_every) : std::string(CheckpointingName(c.checkpointing)),
             AttentionName(c.attention), c.cpu_offload ? ", CPU offload" : "");
  if (c.impl == Impl::kTorchtitan) {
    fmt::print(out, "torchtitan 0.2.2's {} (--impl torchtitan): units tok_embeddings, each block, [norm, output] (kept unsharded after forward), root\n",
               w.model.model_type == "qwen3" ? "Qwen3" : "Llama 3");
  } else if (c.impl == Impl::kTorchtitan202501) {
    fmt::print(out, "torchtitan's Llama 3 of January 2025 (--impl torchtitan-2025-01): units each block (the last kept unsharded after forward), root\n");
  }
  if (c.transformers != TransformersVersion{}) {
    static constexpr std::string_view kLossPaths[] = {
        "the loss upcasts the logits and pads the labels",
        "the loss upcasts the logits and copies logits[..., :-1, :] contiguous",
        "the model returns the logits upcast to fp32, the loss copies logits[..., :-1, :] contiguous"};
    const HfLoss loss = HfLossOf(c.transformers, w.model.model_type);
    fmt::print(out, "transformers {}: {}{}\n", TransformersVersionName(c.transformers), kLossPaths[static_cast<int>(loss)],
               loss != HfLoss::kPaddedLabels && c.micro_batch == 1 ? " (one sequence: contiguous already, no copy)" : "");
  }
  if (const int64_t vision = w.model.VisionParams(); vision > 0) {
    fmt::print(out, "vision tower: {} parameters ({}), held in the root unit but idle in these text-only steps: no FLOPs, no activations, {}\n",
               WithCommas(vision), Percent(vision, w.model.ParamsTotal()),
               c.framework == Framework::kFsdp2 ? "and under FSDP2 no gradients or optimizer states"
                                                : "but FSDP1's flat gradient and optimizer states cover it");
  }
  if (c.master_dtype != DType::kFp32) {
    fmt::print(out, "pure {}: parameters, gradients and optimizer states in {} (no fp32 master copy)\n", DTypeName(c.master_dtype),
               DTypeName(c.master_dtype));
  }
  if (c.lora.rank > 0) {
    const std::string targets = fmt::format("{}", fmt::join(AdaptedModules(w.model.arch), ", "));
    const DType base = FrozenStorageDtype(c);
    fmt::print(out, "{} r={} (alpha {}, dropout {}) on {}: {} trainable parameters ({}) in {}, the base frozen in {}\n",
               c.lora.qlora ? "QLoRA" : "LoRA", c.lora.rank, c.lora.alpha, c.lora.dropout, targets, WithCommas(w.model.ParamsTrainable()),
               Percent(w.model.ParamsTrainable(), w.model.ParamsTotal()), DTypeName(c.master_dtype), DTypeName(base));
    if (c.lora.qlora) {
      const Nf4Bytes nf4 = Nf4ModelBytes(w.model, c.lora, c.param_dtype);
      fmt::print(out, "QLoRA: the blocks' linears in NF4 ({} GiB packed in {}, sharded; {} GiB of quantization state{} on every rank), computed in {}\n",
                 Gib(nf4.packed), DTypeName(c.param_dtype), Gib(nf4.quant_state), c.lora.double_quant ? ", double-quantized," : "",
                 DTypeName(QloraComputeDtype(c)));
    }
  }
  if (c.loop_holds_outputs) fmt::print(out, "the training loop keeps `outputs`: the logits stay alive through the step\n");
  if (c.use_cache) {
    fmt::print(out, "use_cache=True: every layer returns its keys and values (past_key_values), alive {}\n",
               c.loop_holds_outputs ? "through the step" : "until the loss has been computed");
  }
  if (c.ac_reentrant) {
    fmt::print(out, "reentrant checkpointing (transformers' gradient_checkpointing_enable){}\n",
               ReentrantHoldsInputs(c) ? ": FSDP1's frozen layer units (LoRA, QLoRA) keep each layer's input and its gradient until the end of backward"
                                       : ": nothing held beyond non-reentrant checkpointing (FSDP2, or transformers 4.52 on)");
  }
}

void PrintTable(const Workload& w, const MemoryEstimate& m, std::ostream& out) {
  fmt::print(out, "\n  {:<24}{:>10}{:>11}\n", "per GPU at the peak", "GiB", "% of card");
  for (MemCategory c : kPlannerCategories) {
    fmt::print(out, "  {:<24}{:>10}{:>11}\n", MemCategoryLabel(c), Gib(At(m.peak, c)), Percent(At(m.peak, c), m.capacity_bytes));
  }
  fmt::print(out, "  {:<24}{:>10}{:>11}   ({})\n", "peak", Gib(m.peak_bytes), Percent(m.peak_bytes, m.capacity_bytes), m.peak_phase);
  fmt::print(out, "  {:<24}{:>10}{:>11}   (the tensors, as FSDPMemTracker counts them; {})\n", "tensors only", Gib(m.allocated_peak_bytes),
             Percent(m.allocated_peak_bytes, m.capacity_bytes), m.allocated_peak_phase);
  if (m.overheads.caching_allocator) {
    fmt::print(out, "  {:<24}{:>10}{:>11}   (torch.cuda.max_memory_allocated: the allocator's blocks, unsplit remainders in)\n",
               "allocated blocks", Gib(m.allocated_blocks_peak_bytes), Percent(m.allocated_blocks_peak_bytes, m.capacity_bytes));
    if (m.active_peak_bytes != m.allocated_blocks_peak_bytes) {  // blocks awaiting another stream's event (FSDP1's record_stream)
      fmt::print(out, "  {:<24}{:>10}{:>11}   (active_bytes.all.peak: the blocks and the freed ones another stream still uses)\n", "active blocks",
                 Gib(m.active_peak_bytes), Percent(m.active_peak_bytes, m.capacity_bytes));
    }
    fmt::print(out, "  {:<24}{:>10}{:>11}   (torch.cuda.max_memory_reserved, {}{}{})\n", "reserved", Gib(m.reserved_peak_bytes),
               Percent(m.reserved_peak_bytes, m.capacity_bytes), m.reserved_peak_phase,
               m.overheads.allocator.text.empty() ? "" : "; PYTORCH_CUDA_ALLOC_CONF=" + m.overheads.allocator.text,
               m.overheads.one_stream ? "; --one-stream: every request on one stream, as on a CPU device" : "");
    fmt::print(out, "  {:<24}{:>10}{:>11}   (reserved - the most allocated at that peak; allocator retries: {})\n", "fragmentation",
               Gib(m.fragmentation_bytes), Percent(m.fragmentation_bytes, m.capacity_bytes), m.alloc_retries);
    const int64_t over = ReservedOverAllocatedPeakBytes(m);
    fmt::print(out, "  {:<24}{:>10}{:>11}   (the reserved peak - the allocated peak: what the cache holds over the tensors)\n", "cache over tensors",
               Gib(over), Percent(over, m.capacity_bytes));
  }
  if (m.host_bytes > 0) fmt::print(out, "  {:<24}{:>10}            (pinned host memory per GPU; x{} per node)\n", "host (CPU offload)", Gib(m.host_bytes), w.config.gpus_per_node);
  if (m.allocator_out_of_memory) {
    fmt::print(out, "\nthe caching allocator runs out of memory even after freeing its cache and retrying\n");
  }
  if (m.fits) {
    fmt::print(out, "\nfits: yes, {} GiB headroom on a {} GiB card (reserved + CUDA context + NCCL)\n", Gib(m.headroom_bytes), Gib(m.capacity_bytes));
    if (m.alloc_retries > 0) {  // CUDACachingAllocator's malloc: release_cached_blocks, then alloc_block(isRetry)
      fmt::print(out, "  only with {} allocator {} over the two replayed steps: each waits for the device and frees the cache (PyTorch's "
                      "num_alloc_retries), which slows a step\n", m.alloc_retries, m.alloc_retries == 1 ? "retry" : "retries");
    }
  } else if (m.headroom_bytes >= 0) {  // the replay on the card failed a malloc that the unlimited one did not need
    fmt::print(out, "\nfits: NO, the caching allocator runs out of memory on a {} GiB card\n", Gib(m.capacity_bytes));
  } else {
    fmt::print(out, "\nfits: NO, short by {} GiB on a {} GiB card\n", Gib(-m.headroom_bytes), Gib(m.capacity_bytes));
  }
  if (m.allocator_cap_bytes >= 0) {
    fmt::print(out, "  per_process_memory_fraction {}: the caching allocator may reserve {} GiB of the card's {} GiB\n",
               m.overheads.allocator.per_process_memory_fraction, Gib(m.allocator_cap_bytes), Gib(m.capacity_bytes));
  }
  const auto& ck = m.checkpoint;
  fmt::print(out, "checkpoint: full state dict +{} GiB GPU per rank (offload_to_cpu: +{} GiB GPU, {} GiB host on rank 0); "
                  "sharded (DCP) +0 GiB; files: model {} GiB, optimizer {} GiB\n",
             Gib(ck.full_gpu_extra_bytes), Gib(ck.full_offload_gpu_extra_bytes), Gib(ck.full_offload_host_rank0_bytes),
             Gib(ck.model_file_bytes), Gib(ck.optimizer_file_bytes));
}

void PrintTimeline(const MemoryEstimate& m, std::ostream& out) {
  fmt::print(out, "\n  {:<60}{:>10}\n", "timeline (highest device GiB in each phase)", "GiB");
  // One line per run of events in the same phase, with the highest total reached in it.
  for (size_t i = 0; i < m.timeline.size();) {
    int64_t high = 0;
    size_t j = i;
    for (; j < m.timeline.size() && m.timeline[j].phase == m.timeline[i].phase; ++j) high = std::max(high, TotalBytes(m.timeline[j].device));
    // the replay skips micro-batches that repeat the one before them byte for byte
    if (i > 0 && m.timeline[i].micro > m.timeline[i - 1].micro + 1) {
      const int first = m.timeline[i - 1].micro + 2, last = m.timeline[i].micro;
      fmt::print(out, "  {}\n", first == last ? fmt::format("(micro-batch {} repeats micro-batch {})", first, first - 1)
                                                : fmt::format("(micro-batches {} to {} repeat micro-batch {})", first, last, first - 1));
    }
    fmt::print(out, "  {:<60}{:>10}\n", m.timeline[i].phase, Gib(high));
    i = j;
  }
}

Result<Workload> BuildFromFlags(const PlanFlags& flags, const std::string& model_id) {
  auto config = ConfigFromFlags(flags);
  if (!config.ok()) return config.error();
  auto model = LoadModel(model_id);
  if (!model.ok()) return model.error();
  ApplyModelDefaults(flags, model.value(), config.value());
  std::string gpu = flags.gpu;
  std::optional<ClusterSpec> cluster;
  if (!flags.cluster.empty()) {
    auto c = LoadCluster(flags.cluster);
    if (!c.ok()) return c.error();
    cluster = c.value();
    if (!flags.gpu_given) gpu = cluster->gpu;
    if (!flags.gpus_given) config.value().gpus = cluster->Gpus();
    if (config.value().gpus_per_node == 0) config.value().gpus_per_node = cluster->gpus_per_node;
  }
  auto hw = LoadHardware(gpu);
  if (!hw.ok()) return hw.error();
  if (cluster) ApplyCluster(*cluster, hw.value());
  const Strategy asked = config.value().strategy;
  const bool switched = flags.fsdp1_world_of_one && ApplyFsdp1WorldOfOne(config.value());
  auto w = BuildWorkload(std::move(model).value(), std::move(hw).value(), config.value());
  if (w.ok() && IsTorchtitan(w.value().config.impl) && w.value().shard_world == 1) {
    fmt::print(stderr, "note: torchtitan applies fully_shard only when data_parallel_shard_degree > 1 (on one GPU of a shard group it trains without FSDP, under "
                       "autocast); planned as fully_shard on a one-rank mesh, as tools/torchtitan_memory.py runs it\n");
  }
  if (w.ok() && switched) {
    fmt::print(stderr, "note: FSDP1 on one GPU runs {} as NO_SHARD (FullyShardedDataParallel switches when the world size is 1); planned as NO_SHARD\n",
               StrategyName(asked));
  }
  return w;
}

Result<std::pair<Workload, MemoryEstimate>> Evaluate(const PlanFlags& flags, const std::string& model_id, bool timeline) {
  auto w = BuildFromFlags(flags, model_id);
  if (!w.ok()) return w.error();
  auto overheads = OverheadsFromFlags(flags, w.value());
  if (!overheads.ok()) return overheads.error();
  MemoryOptions options{overheads.value(), timeline};
  MemoryEstimate m = EstimateMemory(w.value(), options);
  return std::make_pair(std::move(w).value(), std::move(m));
}

// Step time of the same run under NO_SHARD (DDP), for the slowdown figure; 0 if it cannot be built.
double DdpStepSeconds(const Workload& w) {
  FsdpConfig ddp = w.config;
  ddp.strategy = Strategy::kNoShard;
  ddp.shard_group_size = 0;
  ddp.framework = Framework::kFsdp1;
  auto dw = BuildWorkload(w.model, w.hardware, ddp);
  return dw.ok() ? EstimateTime(dw.value()).step.step_s : 0.0;
}

std::string Ms(double seconds) { return fmt::format("{:.1f} ms", seconds * 1e3); }
std::string Gb(double bytes) { return fmt::format("{:.2f} GB", bytes / kGB); }

// What a routed model's experts cost: FSDP shards, all-gathers and reduces every expert, whichever
// the tokens pick (expert parallelism is not modelled).
void PrintExperts(const Workload& w, const CommVolume& v, std::ostream& out) {
  const RoutedExpertBytes e = RoutedExpertBytesPerGpu(w);
  if (e.params == 0) return;
  const int64_t total = w.model.ParamsTotal();
  fmt::print(out, "  routed experts: {} of the {} parameters ({}; {} of them active per token), {} of the all-gathers and {} of the reductions\n",
             WithCommas(e.params), WithCommas(total), Percent(e.params, total), Percent(std::llround(e.active_params_per_token), e.params),
             Gb(v.routed_expert_gather_bytes), Gb(v.routed_expert_reduce_bytes));
  fmt::print(out, "  {} keeps {} GiB of their sharded parameters, {} GiB of gradients and {} GiB of optimizer states between steps\n",
             w.config.cpu_offload ? "the host of each GPU" : "each GPU", Gib(e.sharded_param_bytes), Gib(e.gradient_bytes), Gib(e.optimizer_state_bytes));
}

void PrintTime(const Workload& w, const TimeEstimate& t, double ddp_step_s, std::ostream& out) {
  const CommVolume& v = t.comm.volume;
  fmt::print(out, "\ncommunication per step per GPU (nccl-tests sizes; {} ranks per shard group, {} per node):\n",
             t.comm.shard_group.ranks, t.comm.shard_group.ranks_per_node);
  if (v.forward_all_gather_count > 0) fmt::print(out, "  forward all-gathers   {:>5} x  {:>10}\n", v.forward_all_gather_count, Gb(v.forward_all_gather_bytes));
  if (v.backward_all_gather_count > 0) fmt::print(out, "  backward all-gathers  {:>5} x  {:>10}\n", v.backward_all_gather_count, Gb(v.backward_all_gather_bytes));
  if (v.reduce_scatter_count > 0) fmt::print(out, "  reduce-scatters       {:>5} x  {:>10}\n", v.reduce_scatter_count, Gb(v.reduce_scatter_bytes));
  if (v.all_reduce_count > 0) fmt::print(out, "  all-reduces           {:>5} x  {:>10}\n", v.all_reduce_count, Gb(v.all_reduce_bytes));
  if (v.host_to_device_bytes > 0) fmt::print(out, "  host<->device (PCIe)          {:>10} in, {} out\n", Gb(v.host_to_device_bytes), Gb(v.device_to_host_bytes));
  fmt::print(out, "  sent on the links {} in {} of collectives if nothing overlapped\n", Gb(v.sent_bytes), Ms(v.total_comm_s));
  PrintExperts(w, v, out);
  const StepEstimate& s = t.step;
  fmt::print(out, "\nstep time {} = compute {} + exposed communication {} (first all-gather {}, after the last backward {})\n",
             Ms(s.step_s), Ms(s.compute_s), Ms(s.exposed_comm_s), Ms(s.first_all_gather_s), Ms(s.last_reduce_s));
  fmt::print(out, "  {:.0f} tokens/s per GPU, {:.0f} TFLOP/s per GPU, MFU {:.1f}% ({} peak {:.0f} TFLOP/s x matmul efficiency {:.2f})\n",
             s.tokens_per_s_per_gpu, s.tflops_per_gpu, 100 * s.mfu, DTypeName(w.config.param_dtype),
             w.hardware.PeakFlops(w.config.param_dtype) / 1e12, w.hardware.matmul_efficiency);
  if (s.mfu_capped) {
    fmt::print(out, "  MFU capped at 100%: PaLM's 6N + 12Lsd counts the masked half of causal attention, which flash attention skips; "
                    "the GPU executes {:.1f}% of its peak\n", 100 * s.hfu);
  }
  std::vector<std::pair<double, int>> waits;
  for (int u = 0; u < static_cast<int>(s.unit_exposed_s.size()); ++u) if (s.unit_exposed_s[u] > 0) waits.emplace_back(s.unit_exposed_s[u], u);
  std::sort(waits.rbegin(), waits.rend());
  if (!waits.empty()) {
    std::string list;
    for (size_t i = 0; i < waits.size() && i < 4; ++i) list += fmt::format("{}{} {}", i ? ", " : "", w.units[waits[i].second].name, Ms(waits[i].first));
    fmt::print(out, "  compute waits on all-gathers of {} unit(s): {}{}\n", waits.size(), list, waits.size() > 4 ? ", ..." : "");
  }
  if (ddp_step_s > 0 && w.config.strategy != Strategy::kNoShard) {
    fmt::print(out, "  vs DDP (NO_SHARD, same batch, memory permitting): {} per step, so {} is {:+.1f}% {}\n", Ms(ddp_step_s),
               StrategyName(w.config.strategy), 100.0 * std::fabs(s.step_s / ddp_step_s - 1.0), s.step_s >= ddp_step_s ? "slower" : "faster");
  }
}

}  // namespace

Result<Workload> WorkloadFromFlags(const PlanFlags& flags) {
  if (flags.model.empty()) return Error::BadInput("--model is required");
  return BuildFromFlags(flags, flags.model);
}

void AddPlanFlags(CLI::App& app, PlanFlags& f) {
  app.add_option("--model", f.model, "catalog id (models/), or a HuggingFace config.json or the directory holding it");
  app.add_option("--gpu", f.gpu, "catalog id (hardware/) or path to a hardware JSON")->capture_default_str();
  app.add_option("--cluster", f.cluster, "cluster id (hardware/clusters/) or path: sets --gpu, --gpus and --gpus-per-node unless given");
  app.add_option("--gpus", f.config.gpus, "total number of GPUs")->capture_default_str();
  app.add_option("--gpus-per-node", f.config.gpus_per_node, "GPUs per node (default: the hardware file's)");
  app.add_option("--shard-group-size", f.config.shard_group_size, "HYBRID_SHARD shard group (default: one node)");
  app.add_option("--strategy", f.strategy, "full_shard | shard_grad_op | no_shard | hybrid_shard")->capture_default_str();
  app.add_option("--seq-len", f.config.seq_len, "sequence length (default: min(4096, max positions))");
  app.add_option("--micro-batch", f.config.micro_batch, "sequences per GPU per micro-batch")->capture_default_str();
  app.add_option("--grad-accum", f.config.grad_accum, "micro-batches per optimizer step")->capture_default_str();
  app.add_flag("--no-sync", f.config.no_sync, "accumulate unsharded gradients under no_sync()");
  app.add_option("--ac", f.ac, "activation checkpointing: none | selective (the attention core) | selective-op (torchtitan's op-level policy) | full")
      ->capture_default_str();
  app.add_option("--ac-every", f.config.ac_every, "with --ac full, checkpoint only every N-th block (torchtitan's layer-level selective AC)")
      ->capture_default_str();
  app.add_option("--attention", f.attention, "eager (materialised scores) | flash (SDPA)")->capture_default_str();
  app.add_option("--param-dtype", f.param_dtype, "MixedPrecision param_dtype: bf16 | fp16 | fp32")->capture_default_str();
  app.add_option("--reduce-dtype", f.reduce_dtype, "MixedPrecision reduce_dtype")->capture_default_str();
  app.add_option("--buffer-dtype", f.buffer_dtype, "MixedPrecision buffer_dtype")->capture_default_str();
  app.add_option("--master-dtype", f.master_dtype,
                 "dtype of the sharded parameters, gradients and optimizer states: fp32 (mixed precision) | bf16 (pure bf16, no fp32 copy)")
      ->capture_default_str();
  app.add_option("--lora-rank", f.config.lora.rank, "LoRA rank r (peft); 0 is full fine-tuning")->capture_default_str();
  app.add_option("--lora-alpha", f.config.lora.alpha, "lora_alpha (scales the adapters' output; no memory or time effect)")->capture_default_str();
  app.add_option("--lora-dropout", f.config.lora.dropout, "lora_dropout p")->capture_default_str();
  app.add_option("--lora-targets", f.config.lora.targets,
                 "target_modules: module names (q_proj,v_proj) or all-linear (default: peft's for the model type)");
  app.add_flag("--qlora", f.config.lora.qlora,
               "QLoRA: the blocks' linears stored by bitsandbytes as NF4, packed in the param dtype (bnb_4bit_quant_storage); needs --lora-rank");
  app.add_flag("--qlora-double-quant", f.config.lora.double_quant, "bnb_4bit_use_double_quant=True: the absmax quantized again");
  app.add_option("--qlora-compute-dtype", f.qlora_compute_dtype,
                 "bnb_4bit_compute_dtype: fp32 | bf16 | fp16, the dtype QLoRA's linears dequantize into and multiply in (default: the param dtype)");
  app.add_option("--base-dtype", f.base_dtype,
                 "LoRA: the frozen base's dtype, from_pretrained's torch_dtype: fp32 | bf16 (default: the master dtype; QLoRA: the param dtype)");
  app.add_option("--optimizer", f.optimizer, "adamw | adam | sgd | sgd-momentum")->capture_default_str();
  app.add_flag("--cpu-offload", f.config.cpu_offload, "CPUOffload(offload_params=True): params, grads and optimizer on the host");
  app.add_option("--wrap", f.wrap, "block | size:N | none | linear | peft (with LoRA: adapters in units of their own)")->capture_default_str();
  app.add_option("--framework", f.framework, "fsdp1 (FullyShardedDataParallel) | fsdp2 (fully_shard)")->capture_default_str();
  app.add_option("--impl", f.impl,
                 "whose model code runs: transformers (HF modules) | torchtitan (0.2.2's Llama 3 or dense Qwen3: its wrap units, nn.RMSNorm, RoPE table) | torchtitan-2025-01 (the January 2025 main branch of torchtitan's published Llama 3.1 runs); torchtitan needs --framework fsdp2")
      ->capture_default_str();
  app.add_option("--transformers-version", f.transformers_version,
                 "the transformers release the run uses (4.31 to 4.57, or 5.x), for its loss: before 4.49 it copies the shifted logits (micro-batch > 1), and before 4.46 (Mistral: 4.48) the model returns them in fp32")
      ->capture_default_str();
  app.add_flag("--forward-prefetch", f.config.forward_prefetch, "FSDP1 forward_prefetch=True");
  app.add_option("--backward-prefetch", f.backward_prefetch, "pre | post | none")->capture_default_str();
  app.add_flag("--no-limit-all-gathers", f.no_limit_all_gathers, "FSDP1 limit_all_gathers=False");
  app.add_flag("--use-orig-params", f.config.use_orig_params, "FSDP1 use_orig_params=True (16-byte aligned flat parameters)");
  app.add_flag("--loop-holds-outputs", f.config.loop_holds_outputs,
               "the training loop keeps `outputs` (outputs = model(...); outputs.loss.backward()): its logits live until the next forward");
  app.add_flag("--use-cache", f.config.use_cache,
               "the forward runs with use_cache=True (transformers 4.31 to 4.35, checkpointing not HF's own): every layer's keys and values live until the loop drops the output");
  app.add_flag("--ac-reentrant", f.config.ac_reentrant,
               "--ac full as transformers' gradient_checkpointing_enable() runs it (use_reentrant=True, 4.35 to 4.51: the HF Trainer's "
               "gradient_checkpointing=True): under FSDP1, frozen units keep each layer's input and its gradient until backward ends");
  app.add_option("--cuda-context-bytes", f.cuda_context_bytes, "override the CUDA context size");
  app.add_option("--nccl-bytes", f.nccl_bytes, "override NCCL buffer bytes per communicator");
  app.add_option("--cublas-workspace-bytes", f.cublas_workspace_bytes, "override the cuBLAS workspace");
  app.add_option("--fragmentation", f.fragmentation, "an extra reserve as a fraction of the caching allocator's reserved peak (default 0)");
  app.add_option("--alloc-conf", f.config.alloc_conf, "PYTORCH_CUDA_ALLOC_CONF, verbatim (e.g. expandable_segments:True)");
  app.add_flag("--json", f.json, "print one JSON object (schema: docs/cli.md)");
  app.add_flag("--timeline", f.timeline, "also print the memory after each phase of the step");
  app.add_option("--export", f.export_format, "print the configuration as code: pytorch (FSDP1) | fsdp2 | accelerate | lightning");
}

void AddReplayFlags(CLI::App& app, PlanFlags& f) {
  app.add_flag("--one-stream", f.one_stream,
               "replay every allocation on one stream, as PyTorch makes them on a CPU device: to compare with a CPU recording "
               "(tools/torch_reference.py --device cpu --memory-history); not a GPU's reserved figure");
  app.add_option("--torch-device", f.torch_device,
                 "the device PyTorch's kernels run on: cuda (the GPU planned) | cpu (to compare with PyTorch on CPU ranks: no CUDA-only "
                 "working buffers, such as the eager softmax backward's grad * output)")
      ->capture_default_str();
  app.add_option("--alloc-trace", f.alloc_trace_path,
                 "write every allocator request of the replay (both steps, each with its phase and category) to this file, as an allocator "
                 "history (the format tools/torch_reference.py --memory-history writes; bench/allocator_replay replays it)");
}

void FinishPlanFlags(const CLI::App& app, PlanFlags& flags) {
  flags.gpu_given = app.count("--gpu") > 0;
  flags.gpus_given = app.count("--gpus") > 0;
  flags.attention_given = app.count("--attention") > 0;
  flags.model_given = app.count("--model") > 0;
  flags.wrap_given = app.count("--wrap") > 0;
}

void ApplyModelDefaults(const PlanFlags& flags, const ModelSpec& model, FsdpConfig& config) {
  if (!flags.attention_given && !SdpaRuledOut(model).empty()) config.attention = Attention::kEager;
}

Result<FsdpConfig> ConfigFromFlags(const PlanFlags& f) {
  FsdpConfig c = f.config;
  Status s;
  if (!(s = Assign(c.strategy, ParseStrategy(f.strategy))).ok()) return s.error();
  if (!(s = ParseWrap(f.wrap, c)).ok()) return s.error();
  if (!(s = Assign(c.checkpointing, ParseCheckpointing(f.ac))).ok()) return s.error();
  if (!(s = Assign(c.attention, ParseAttention(f.attention))).ok()) return s.error();
  if (!(s = Assign(c.param_dtype, ParseDType(f.param_dtype, "--param-dtype"))).ok()) return s.error();
  if (!(s = Assign(c.reduce_dtype, ParseDType(f.reduce_dtype, "--reduce-dtype"))).ok()) return s.error();
  if (!(s = Assign(c.buffer_dtype, ParseDType(f.buffer_dtype, "--buffer-dtype"))).ok()) return s.error();
  if (!(s = Assign(c.master_dtype, ParseDType(f.master_dtype, "--master-dtype"))).ok()) return s.error();
  if (!f.qlora_compute_dtype.empty()) {
    auto compute = ParseDType(f.qlora_compute_dtype, "--qlora-compute-dtype");
    if (!compute.ok()) return compute.error();
    c.lora.compute_dtype = compute.value();
  }
  if (!f.base_dtype.empty()) {
    auto base = ParseDType(f.base_dtype, "--base-dtype");
    if (!base.ok()) return base.error();
    c.lora.base_dtype = base.value();
  }
  // LoRA under FSDP1 without a --wrap: peft's policy, as transformers' Trainer installs it for a
  // PeftModel (transformers/distributed/fsdp.py update_fsdp_plugin_peft); a decoder-layer unit
  // would mix frozen and trainable parameters, which FSDP1 refuses without use_orig_params.
  // A base stored in another dtype than the adapters (QLoRA's, --base-dtype) may not share a unit
  // with them even with use_orig_params: FSDP1 flattens one dtype.
  const bool base_dtype_differs = FrozenStorageDtype(c) != c.master_dtype;
  if (c.lora.rank > 0 && !f.wrap_given && c.wrap == WrapPolicy::kBlock && f.framework == "fsdp1" && (!c.use_orig_params || base_dtype_differs)) {
    c.wrap = WrapPolicy::kPeft;
  }
  if (!(s = Assign(c.optimizer, ParseOptimizer(f.optimizer))).ok()) return s.error();
  if (!(s = Assign(c.framework, ParseFramework(f.framework))).ok()) return s.error();
  if (!(s = Assign(c.impl, ParseImpl(f.impl))).ok()) return s.error();
  if (!(s = Assign(c.torch_device, ParseTorchDevice(f.torch_device))).ok()) return s.error();
  if (!(s = Assign(c.transformers, ParseTransformersVersion(f.transformers_version))).ok()) return s.error();
  if (!(s = Assign(c.backward_prefetch, ParseBackwardPrefetch(f.backward_prefetch))).ok()) return s.error();
  if (auto alloc = ParseAllocatorConfig(c.alloc_conf); !alloc.ok()) return alloc.error();
  c.limit_all_gathers = !f.no_limit_all_gathers;
  if (c.framework == Framework::kFsdp2 && f.no_limit_all_gathers) {
    return Error::BadInput("--no-limit-all-gathers is an FSDP1 option; FSDP2 has no all-gather rate limiter");
  }
  return c;
}

// --alloc-trace: the requests of the plan's replay (the unlimited one, before any replay on the
// card), every micro-batch played.
Status WriteAllocTrace(const Workload& w, const FrameworkOverheads& overheads, const std::string& path) {
  ReplayOptions options = ReplayOptionsFor(overheads, /*record_timeline=*/false);
  options.record_requests = true;
  const MemoryEstimate replay = EstimateTensorMemory(w, options);
  const std::string source = fmt::format("fsdp-plan {} on {}: its caching-allocator replay's requests, two steps{}", w.model.id, w.hardware.id,
                                         overheads.one_stream ? ", on one stream (--one-stream)" : "");
  return WriteTextFile(path, DumpJson(AllocatorHistoryJson(replay.requests, source)) + "\n");
}

Status RunPlan(const PlanFlags& flags, std::ostream& out) {
  if (!flags.alloc_trace_path.empty() && !flags.export_format.empty()) {
    return Error::BadInput("--alloc-trace writes the replay of a plan; --export prints code instead of one: give one of them");
  }
  auto result = Evaluate(flags, flags.model, flags.timeline);
  if (!result.ok()) return result.error();
  const auto& [w, m] = result.value();
  if (!flags.alloc_trace_path.empty()) {
    if (Status s = WriteAllocTrace(w, m.overheads, flags.alloc_trace_path); !s.ok()) return s;
  }
  if (!flags.export_format.empty()) {
    auto format = ParseExportFormat(flags.export_format);
    if (!format.ok()) return format.error();
    if (w.config.impl != Impl::kTransformers) {
      return Error::BadInput(fmt::format("--export writes code around transformers' modules; --impl {} is planned, not exported (torchtitan takes a TOML job config)", ImplName(w.config.impl)));
    }
    if (w.config.transformers != TransformersVersion{}) return Error::BadInput(ExportNeedsCurrentTransformers(w.config.transformers));
    if (flags.json) {
      out << DumpJson(Json{{"export", {{"format", flags.export_format}, {"code", ExportConfig(w, format.value())}}}}, 2) << "\n";
    } else {
      out << ExportConfig(w, format.value());
    }
    return {};
  }
  const TimeEstimate time = EstimateTime(w);
  const double ddp_step_s = DdpStepSeconds(w);
  if (flags.json) {
    Json j = PlanToJson(w, m);
    AddTimeToJson(time, ddp_step_s, j);
    AddExpertsToJson(w, time.comm.volume, j);
    if (flags.timeline) {
      Json points = Json::array();
      for (const auto& p : m.timeline) points.push_back({{"phase", p.phase}, {"bytes", TotalBytes(p.device)}});
      j["memory"]["timeline"] = points;
    }
    out << DumpJson(j, 2) << "\n";
    return {};
  }
  PrintHeader(w, out);
  PrintTable(w, m, out);
  PrintTime(w, time, ddp_step_s, out);
  if (flags.timeline) PrintTimeline(m, out);
  return {};
}

// One column of the default scenario: a strategy with optional checkpointing and offload.
struct ScenarioColumn {
  const char* title;
  const char* strategy;
  const char* ac;
  bool offload;
};

// One column of the fine-tuning table: the flags it sets on top of FULL_SHARD with full checkpointing.
struct FineTuningColumn {
  const char* title;
  int64_t lora_rank;
  bool qlora;
};

// The seeds' own question, "can I fine-tune 7B-70B on four RTX 4090s or A6000s, or on eight A100s?":
// full fine-tuning, LoRA and QLoRA (r=16 on every linear of the blocks, peft's recipe of a bf16
// base and fp32 adapters), each FULL_SHARD with full checkpointing; rows model x cluster.
Status FineTuningTable(const PlanFlags& base, const char* const* models, size_t model_count, Json& rows, std::ostream& out) {
  struct Cluster {
    std::string gpu;
    int64_t gpus;
  };
  std::vector<Cluster> clusters = {{"rtx-4090", 4}, {"rtx-a6000", 4}, {"a100-80gb-sxm", 8}};
  if (base.gpu_given) clusters = {{base.gpu, base.config.gpus}};
  const FineTuningColumn columns[] = {{"full", 0, false}, {"LoRA r16", 16, false}, {"QLoRA r16", 16, true}};
  PlanFlags flags = base;
  flags.strategy = "full_shard";
  flags.ac = "full";
  flags.config.cpu_offload = false;
  if (!flags.json) {
    fmt::print(out, "\nFine-tuning: peak memory per GPU and tokens/s per GPU, FULL_SHARD with AC full, seq {} x micro-batch {};\n"
                    "LoRA and QLoRA r=16 on every linear of the blocks, a bf16 base and fp32 adapters\n\n",
               flags.config.seq_len, flags.config.micro_batch);
    fmt::print(out, "  {:<14}{:<18}", "model", "GPUs");
    for (const auto& col : columns) fmt::print(out, "{:>24}", col.title);
    fmt::print(out, "\n");
  }
  for (size_t i = 0; i < model_count; ++i) {
    for (const Cluster& cluster : clusters) {
      flags.gpu = cluster.gpu;
      flags.config.gpus = cluster.gpus;
      flags.gpu_given = flags.gpus_given = true;
      std::string line;
      for (const auto& col : columns) {
        flags.config.lora = LoraConfig{};
        flags.config.lora.rank = col.lora_rank;
        flags.config.lora.qlora = col.qlora;
        flags.config.lora.targets = col.lora_rank > 0 ? "all-linear" : "";
        flags.base_dtype = col.lora_rank > 0 ? "bf16" : "";
        flags.wrap_given = false;
        auto result = Evaluate(flags, models[i], false);
        if (!result.ok()) return result.error();
        const auto& [w, m] = result.value();
        const double tokens_per_s = EstimateTime(w).step.tokens_per_s_per_gpu;
        line += fmt::format("{:>24}", fmt::format("{} GiB{} {:>6.0f}/s", Gib(m.peak_bytes), m.fits ? " " : "*", tokens_per_s));
        Json row = PlanToJson(w, m);
        row["tokens_per_s_per_gpu"] = tokens_per_s;
        rows.push_back(std::move(row));
      }
      if (!flags.json) fmt::print(out, "  {:<14}{:<18}{}\n", models[i], fmt::format("{} x {}", cluster.gpus, cluster.gpu), line);
    }
  }
  if (!flags.json) {
    fmt::print(out, "\n  * does not fit. One of them in detail: fsdp-plan --model llama-2-70b --gpu rtx-4090 --gpus 4 --ac full --lora-rank 16 "
                    "--lora-targets all-linear --qlora\n");
  }
  return {};
}

Status RunDefaultScenario(const PlanFlags& base, std::ostream& out) {
  if (base.model_given) return Error::BadInput("--model needs a catalog id or a path, got ''");
  PlanFlags flags = base;
  if (!flags.gpu_given) flags.gpu = "a100-80gb-sxm";
  if (!flags.gpus_given) flags.config.gpus = 4;
  if (flags.config.seq_len == 0) flags.config.seq_len = 2048;
  const char* models[] = {"llama-2-7b", "llama-2-13b", "codellama-34b", "llama-2-70b"};
  const ScenarioColumn columns[] = {{"NO_SHARD (DDP)", "no_shard", "none", false},
                                    {"SHARD_GRAD_OP", "shard_grad_op", "none", false},
                                    {"FULL_SHARD", "full_shard", "none", false},
                                    {"+ AC full", "full_shard", "full", false},
                                    {"+ CPU offload", "full_shard", "full", true}};
  Json rows = Json::array();
  std::string host_note;
  if (!flags.json) {
    fmt::print(out, "DDP vs FSDP: peak memory per GPU, {} x {}, seq {} x micro-batch {}, bf16 mixed precision, AdamW\n\n",
               flags.config.gpus, flags.gpu, flags.config.seq_len, flags.config.micro_batch);
    fmt::print(out, "  {:<14}{:>7}", "model", "params");
    for (const auto& col : columns) fmt::print(out, "{:>16}", col.title);
    fmt::print(out, "{:>16}\n", "seed's 2 B/p/N");
  }
  for (const char* model : models) {
    std::string line;
    int64_t params = 0;
    for (const auto& col : columns) {
      flags.strategy = col.strategy;
      flags.ac = col.ac;
      flags.config.cpu_offload = col.offload;
      auto result = Evaluate(flags, model, false);
      if (!result.ok()) return result.error();
      const auto& [w, m] = result.value();
      params = w.model.ParamsTotal();
      line += fmt::format("{:>16}", fmt::format("{} GiB{}", Gib(m.peak_bytes), m.fits ? " " : "*"));
      if (col.offload) host_note += fmt::format("{}{} {} GiB", host_note.empty() ? "" : ", ", model, Gib(m.host_bytes * w.config.gpus_per_node));
      rows.push_back(PlanToJson(w, m));
    }
    if (!flags.json) {
      fmt::print(out, "  {:<14}{:>6.1f}B{}{:>12} GiB\n", model, static_cast<double>(params) / 1e9, line,
                 Gib(params * 2 / flags.config.gpus));
    }
  }
  Json fine_tuning = Json::array();
  if (flags.json) {
    if (Status s = FineTuningTable(flags, models, std::size(models), fine_tuning, out); !s.ok()) return s;
    out << DumpJson(Json{{"scenario", "ddp-vs-fsdp"}, {"plans", rows}, {"fine_tuning", fine_tuning}}, 2) << "\n";
    return {};
  }
  fmt::print(out, "\n  * does not fit in the card's memory. \"+ AC full\": FULL_SHARD with activation checkpointing;\n"
                  "    \"+ CPU offload\": also CPUOffload(offload_params=True) (parameters, gradients, AdamW on the host).\n"
                  "    Pinned host memory that offload needs per node: {}.\n"
                  "The seed's table counts only the bf16 weights (2 bytes/parameter, divided by the GPU count for FSDP). It\n"
                  "leaves out the fp32 master weights (4 B/param), the fp32 gradients (4 B/param), AdamW's two fp32 states\n"
                  "(8 B/param), the all-gathered bf16 units, activations and logits, and the CUDA/NCCL/cuBLAS overheads;\n"
                  "this table counts all of them.\n"
                  "One configuration in detail: fsdp-plan --model llama-2-13b --gpu a100-80gb-sxm --gpus 4 --ac full\n",
             host_note);
  return FineTuningTable(flags, models, std::size(models), fine_tuning, out);
}

}  // namespace fsdp
