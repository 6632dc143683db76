// Floating-point work and compute time of one training step, per wrap unit (docs/time-model.md).
#pragma once

#include <vector>

#include "core/workload.h"

namespace fsdp {

/// Compute of one unit for one micro-batch, on one GPU.
struct UnitCompute {
  double forward_flops = 0, backward_flops = 0, recompute_flops = 0;
  double forward_s = 0, backward_s = 0, recompute_s = 0;   ///< GEMMs at peak x efficiency + memory-bound work
};

/// Compute of one module-tree node's own ops (not its children's) for one micro-batch.
struct NodeCompute {
  double forward_s = 0, backward_s = 0, recompute_s = 0;
};

struct ComputeModel {
  std::vector<UnitCompute> units;      ///< indexed like Workload::units: the sums of their nodes
  std::vector<NodeCompute> nodes;      ///< indexed like Workload::nodes
  std::vector<double> segments_s;      ///< per ModuleWalk segment: SegmentSeconds of `nodes`
  double optimizer_s = 0;              ///< the optimizer step (on the GPU, or on the host under CPU offload)
  double model_flops_per_token = 0;    ///< 6 N + 12 L s a d (PaLM's MFU convention; N = matmul parameters)
  double executed_flops_per_step = 0;  ///< what the GPU really computes (attention as run, recomputation)
  double compute_s_per_step = 0;       ///< sum of all units' times over the micro-batches + optimizer
};

/// Memory-bound traffic of eager PyTorch's un-fused elementwise work, in bytes moved per byte
/// autograd saves in forward; the backward moves twice the forward's. Counting HF Llama's ops
/// (LlamaRMSNorm's fp32 cast, pow, mean, multiply, cast back and weight multiply; RoPE's
/// rotate_half; SiLU, the gate product, the residual adds) gives about 5; 10 is fitted, jointly
/// with the GEMM efficiencies of the A100 and H100 hardware files, on the 20 published FSDP results
/// of docs/accuracy.md (build/bench/accuracy_check: mean error 9.2% -> 5.6% from this factor, 4.1%
/// with IBM's "selective" read as --ac-every 2, 4.0% with torchtitan's as --ac selective-op;
/// leave-one-out with this factor refitted too 4.9%).
/// The fitted GEMM efficiencies (A100 0.88, H100 0.70) then sit near the chips' GEMM-level
/// figures, which fsdp-run calibrate measures, where with 5 they had to absorb the rest (0.66, 0.40).
constexpr double kEagerTrafficPerSavedByte = 10.0;
/// fsdp-run's kernels fuse what eager PyTorch runs op by op (one pass for RMSNorm, SwiGLU, the
/// softmax): the counted 5 bytes per saved byte bound their traffic from above.
constexpr double kFusedEngineTrafficPerSavedByte = 5.0;

/// GEMM FLOPs from the tensor inventory (2 x weight elements per token; experts weighted by
/// top_k / experts), attention from the sequence length (causal flash computes half the scores),
/// backward 2x forward (flash attention 2.5x), recomputation under checkpointing; times from
/// peak FLOP/s x matmul efficiency plus activation traffic / (bandwidth x memory efficiency), the
/// traffic being `traffic_per_saved_byte` per byte saved (fsdp-run's fused kernels move less).
ComputeModel EstimateCompute(const Workload& workload, double traffic_per_saved_byte = kEagerTrafficPerSavedByte);

/// The per-unit part of EstimateCompute (units, model FLOPs per token): depends on the GPU type,
/// wrap policy, micro-batch, sequence and checkpointing, not on the GPU count or strategy.
ComputeModel EstimateUnitCompute(const Workload& workload, double traffic_per_saved_byte = kEagerTrafficPerSavedByte);
/// Completes a per-unit estimate for the workload's strategy, offload and accumulation: the
/// optimizer step and the per-step totals.
void FinishCompute(const Workload& workload, ComputeModel& model);

/// A compute model of known per-node durations (golden tests): units and per-step totals summed
/// from `nodes` (indexed like Workload::nodes), FLOPs 0, one model FLOP per token.
ComputeModel ComputeFromNodes(const Workload& workload, std::vector<NodeCompute> nodes, double optimizer_s);

/// Seconds of each of the module walk's compute segments (core/workload.h) for one micro-batch: a
/// forward segment its nodes' forward, a backward segment its nodes' backward and recomputation
/// (at their `enter`).
std::vector<double> SegmentSeconds(const ModuleWalk& walk, const std::vector<NodeCompute>& nodes);

/// The optimizer step alone: memory-bound on the GPU (AdamW moves 36 bytes per sharded element),
/// or PyTorch's CPU AdamW under CPU offload.
double OptimizerSeconds(const Workload& workload);

/// Bytes one dequantization of an NF4 weight of `weight_numel` elements moves (bitsandbytes'
/// dequantize_4bit: the packed codes and fp32 absmax read, the weight written in `compute_dtype`);
/// QLoRA pays it in every forward, recomputation and backward of a quantized linear, at the
/// memory-bound rate.
double Nf4DequantTrafficBytes(int64_t weight_numel, DType compute_dtype);

/// Host elements per second of PyTorch's CPU AdamW under CPU offload (docs/time-model.md).
constexpr double kHostAdamElementsPerSecond = 1.0e9;

}  // namespace fsdp
