#include "planner/plan_report.h"

#include <cmath>
#include <string>

#include "core/lora.h"

namespace fsdp {
namespace {

Json CategoriesToJson(const CategoryBytes& bytes) {
  Json out = Json::object();
  for (MemCategory c : kPlannerCategories) out[std::string(MemCategoryKey(c)) + "_bytes"] = At(bytes, c);
  return out;
}

Json UnitsToJson(const Workload& w) {
  int64_t largest = 0, padding = 0;
  for (const auto& u : w.units) {
    largest = std::max(largest, u.padded_numel);
    padding += u.padded_numel - u.numel;
  }
  return {{"count", w.units.size()},
          {"root_numel", w.units.front().numel},
          {"largest_padded_numel", largest},
          {"padding_numel", padding},
          {"shard_numel_per_gpu", w.ShardNumelTotal()},
          {"shard_world_size", w.shard_world},
          {"replicas", w.replicas}};
}

Json CheckpointToJson(const CheckpointMemory& c) {
  return {{"full_state_dict_gpu_extra_bytes", c.full_gpu_extra_bytes},
          {"full_state_dict_offload_gpu_extra_bytes", c.full_offload_gpu_extra_bytes},
          {"full_state_dict_offload_host_rank0_bytes", c.full_offload_host_rank0_bytes},
          {"full_state_dict_offload_host_per_node_bytes", c.full_offload_host_per_node_bytes},
          {"full_optim_state_dict_host_rank0_bytes", c.full_optim_host_rank0_bytes},
          {"sharded_state_dict_gpu_extra_bytes", c.sharded_gpu_extra_bytes},
          {"model_file_bytes", c.model_file_bytes},
          {"optimizer_file_bytes", c.optimizer_file_bytes},
          {"sharded_file_bytes_per_rank", c.sharded_file_bytes_per_rank}};
}

// --alloc-conf as parsed (the fields of PyTorch's AcceleratorAllocatorConfig and CUDAAllocatorConfig
// that change device memory); max_split_size_bytes null when unlimited.
Json AllocatorConfigToJson(const AllocatorConfig& a) {
  return {{"max_split_size_bytes", a.max_split_size_bytes == alloc::kNoMaxSplit ? Json(nullptr) : Json(a.max_split_size_bytes)},
          {"max_non_split_rounding_bytes", a.max_non_split_rounding_bytes},
          {"large_segment_bytes", a.large_segment_bytes},
          {"roundup_power2_divisions", a.roundup_power2_divisions},
          {"garbage_collection_threshold", a.garbage_collection_threshold},
          {"expandable_segments", a.expandable_segments},
          {"per_process_memory_fraction", a.per_process_memory_fraction}};
}

Json OverheadsToJson(const FrameworkOverheads& o) {
  return {{"cuda_context_bytes", o.cuda_context_bytes},
          {"nccl_bytes_per_communicator", o.nccl_bytes_per_communicator},
          {"cublas_workspace_bytes", o.cublas_workspace_bytes},
          {"fragmentation_fraction", o.fragmentation_fraction},
          {"allocation_rounding_bytes", o.allocation_rounding_bytes},
          {"allocator", AllocatorConfigToJson(o.allocator)}};
}

}  // namespace

void AddExpertsToJson(const Workload& w, const CommVolume& v, Json& plan) {
  const RoutedExpertBytes e = RoutedExpertBytesPerGpu(w);
  if (e.params == 0) return;
  plan["experts"] = {{"routed_params", e.params},
                     {"routed_params_active_per_token", std::llround(e.active_params_per_token)},
                     {"sharded_param_bytes_per_gpu", e.sharded_param_bytes},
                     {"gradient_bytes_per_gpu", e.gradient_bytes},
                     {"optimizer_state_bytes_per_gpu", e.optimizer_state_bytes},
                     {"all_gather_bytes_per_step", v.routed_expert_gather_bytes},
                     {"reduce_bytes_per_step", v.routed_expert_reduce_bytes}};
}

void AddTimeToJson(const TimeEstimate& t, double ddp_step_s, Json& plan) {
  const CommVolume& v = t.comm.volume;
  plan["comm"] = {{"per_step",
                   {{"forward_all_gather_bytes", v.forward_all_gather_bytes},
                    {"forward_all_gather_count", v.forward_all_gather_count},
                    {"backward_all_gather_bytes", v.backward_all_gather_bytes},
                    {"backward_all_gather_count", v.backward_all_gather_count},
                    {"reduce_scatter_bytes", v.reduce_scatter_bytes},
                    {"reduce_scatter_count", v.reduce_scatter_count},
                    {"all_reduce_bytes", v.all_reduce_bytes},
                    {"all_reduce_count", v.all_reduce_count},
                    {"host_to_device_bytes", v.host_to_device_bytes},
                    {"device_to_host_bytes", v.device_to_host_bytes},
                    {"sent_bytes", v.sent_bytes},
                    {"total_comm_s", v.total_comm_s}}},
                  {"shard_group", {{"ranks", t.comm.shard_group.ranks}, {"ranks_per_node", t.comm.shard_group.ranks_per_node}}},
                  {"replica_group", {{"ranks", t.comm.replica_group.ranks}, {"ranks_per_node", t.comm.replica_group.ranks_per_node}}}};
  const StepEstimate& s = t.step;
  Json time = {{"step_s", s.step_s},
               {"compute_s", s.compute_s},
               {"comm_s", s.comm_s},
               {"exposed_comm_s", s.exposed_comm_s},
               {"first_all_gather_s", s.first_all_gather_s},
               {"last_reduce_s", s.last_reduce_s},
               {"forward_s", s.forward_s},
               {"backward_s", s.backward_s},
               {"optimizer_s", s.optimizer_s},
               {"tokens_per_s_per_gpu", s.tokens_per_s_per_gpu},
               {"tflops_per_gpu", s.tflops_per_gpu},
               {"mfu", s.mfu},
               {"mfu_capped", s.mfu_capped},
               {"hfu", s.hfu},
               {"model_flops_per_token", t.compute.model_flops_per_token},
               {"executed_flops_per_step", t.compute.executed_flops_per_step}};
  if (ddp_step_s > 0) {
    time["ddp_step_s"] = ddp_step_s;
    time["slowdown_vs_ddp_pct"] = 100.0 * (s.step_s / ddp_step_s - 1.0);
  }
  plan["time"] = time;
}

Json ConfigToJson(const FsdpConfig& c) {
  return {{"gpus", c.gpus},
          {"gpus_per_node", c.gpus_per_node},
          {"shard_group_size", c.shard_group_size},
          {"strategy", StrategyName(c.strategy)},
          {"wrap", WrapPolicyName(c.wrap)},
          {"wrap_min_params", c.wrap_min_params},
          {"seq_len", c.seq_len},
          {"micro_batch", c.micro_batch},
          {"grad_accum", c.grad_accum},
          {"no_sync", c.no_sync},
          {"activation_checkpointing", CheckpointingName(c.checkpointing)},
          {"ac_every", c.ac_every},
          {"attention", AttentionName(c.attention)},
          {"param_dtype", DTypeName(c.param_dtype)},
          {"reduce_dtype", DTypeName(c.reduce_dtype)},
          {"buffer_dtype", DTypeName(c.buffer_dtype)},
          {"master_dtype", DTypeName(c.master_dtype)},
          {"lora",
           {{"rank", c.lora.rank},
            {"alpha", c.lora.alpha},
            {"dropout", c.lora.dropout},
            {"targets", c.lora.targets},
            {"qlora", c.lora.qlora},
            {"double_quant", c.lora.double_quant},
            {"base_dtype", c.lora.base_dtype ? Json(DTypeName(*c.lora.base_dtype)) : Json(nullptr)},
            {"compute_dtype", c.lora.compute_dtype ? Json(DTypeName(*c.lora.compute_dtype)) : Json(nullptr)}}},
          {"optimizer", OptimizerName(c.optimizer)},
          {"cpu_offload", c.cpu_offload},
          {"framework", FrameworkName(c.framework)},
          {"impl", ImplName(c.impl)},
          {"transformers_version", TransformersVersionName(c.transformers)},
          {"forward_prefetch", c.forward_prefetch},
          {"backward_prefetch", BackwardPrefetchName(c.backward_prefetch)},
          {"limit_all_gathers", c.limit_all_gathers},
          {"use_orig_params", c.use_orig_params},
          {"loop_holds_outputs", c.loop_holds_outputs},
          {"use_cache", c.use_cache},
          {"ac_reentrant", c.ac_reentrant},
          {"torch_device", TorchDeviceName(c.torch_device)},
          {"alloc_conf", c.alloc_conf}};
}

Json PlanToJson(const Workload& w, const MemoryEstimate& m) {
  Json per_gpu = {{"peak_bytes", m.peak_bytes},
                  {"peak_phase", m.peak_phase},
                  {"allocated_peak_bytes", m.allocated_peak_bytes},
                  {"allocated_peak_phase", m.allocated_peak_phase},
                  {"pending_free_bytes_at_peak", m.pending_free_bytes_at_peak},
                  {"reserved_peak_bytes", m.reserved_peak_bytes},
                  {"reserved_peak_phase", m.reserved_peak_phase},
                  {"fragmentation_bytes", m.fragmentation_bytes},
                  {"reserved_over_allocated_peak_bytes", ReservedOverAllocatedPeakBytes(m)},
                  {"alloc_retries", m.alloc_retries},
                  {"allocator",
                   {{"allocated_blocks_peak_bytes", m.allocated_blocks_peak_bytes},
                    {"active_peak_bytes", m.active_peak_bytes},
                    {"small_pool_reserved_peak_bytes", m.small_pool.reserved_peak_bytes},
                    {"large_pool_reserved_peak_bytes", m.large_pool.reserved_peak_bytes},
                    {"small_pool_segments_peak", m.small_pool.segments_peak},
                    {"large_pool_segments_peak", m.large_pool.segments_peak},
                    {"device_allocs", m.device_allocs},
                    {"one_stream", m.overheads.one_stream}}},
                  {"categories", CategoriesToJson(m.peak)}};
  Json host = {{"total_bytes", m.host_bytes}, {"categories", CategoriesToJson(m.host)}};
  const Nf4Bytes nf4 = Nf4ModelBytes(w.model, w.config.lora, w.config.param_dtype);
  return {{"model",
           {{"id", w.model.id},
            {"model_type", w.model.model_type},
            {"params_total", w.model.ParamsTotal()},
            {"params_trainable", w.model.ParamsTrainable()},
            {"nf4_packed_bytes", nf4.packed},
            {"nf4_quant_state_bytes", nf4.quant_state},
            {"layers", w.model.num_layers},
            {"hidden_size", w.model.hidden_size}}},
          {"hardware", {{"id", w.hardware.id}, {"name", w.hardware.name}, {"memory_bytes", w.hardware.memory_bytes}, {"cuda_total_bytes", w.hardware.DeviceTotalBytes()}}},
          {"config", ConfigToJson(w.config)},
          {"units", UnitsToJson(w)},
          {"memory",
           {{"per_gpu", per_gpu},
            {"host_per_gpu", host},
            {"fits", m.fits},
            {"capacity_bytes", m.capacity_bytes},
            {"headroom_bytes", m.headroom_bytes},
            {"allocator_cap_bytes", m.allocator_cap_bytes},
            {"framework_terms", OverheadsToJson(m.overheads)},
            {"checkpoint", CheckpointToJson(m.checkpoint)}}}};
}

}  // namespace fsdp
