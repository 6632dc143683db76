// The memory of fsdp-run's own CPU engine (src/runtime/fsdp_engine.cc), played out like the
// PyTorch model but with that engine's buffers: fp32 storage of the gathered parameters and
// gradients, the tensors its kernels save per block (BlockCache), the logits and their gradient.
// fsdp-run prints it next to what it measures. Under LoRA the engine gathers the frozen base with
// the adapters and reduces, stores and steps the adapters' group only (runtime/fsdp_engine.h,
// EngineLayout). Its sharded parameters, gradient shards and AdamW states are in the master dtype
// (bf16 under --master-dtype bf16: MasterBuffer), its gathered buffers in fp32. Under QLoRA each
// rank also holds every quantized weight's fp32 absmax (sharded_params), and a gathered unit's own
// tensors dequantized to fp32 (Nf4ComputeNumel, unsharded_params) until its reshard.
#pragma once

#include <array>
#include <string>

#include "core/workload.h"
#include "planner/memory_model.h"

namespace fsdp {

/// Bytes one block's forward saves in fsdp-run's engine for T = micro_batch * seq_len tokens:
/// x, n1, x2, n2 (T*h each), q and attn (T*a*d), k and v (T*g*d), gate, up, mid (T*I), two
/// inverse RMS vectors (T), and the attention probabilities (B*a*s*s), all fp32; with Qwen3's q/k
/// norms q and k before them and their inverse RMS; under LoRA each adapted projection's x A^T (T*r)
/// and with lora_dropout its dropout(x) (T*in) and keep mask (T*in bytes);
/// with routed experts (Qwen3-MoE) gate, up and mid per (token, expert) pair (T*k*I each), the
/// pairs' expert outputs (T*k*h), the router's softmax (T*E) and weights (T*k), the pairs' token and
/// slot (int32) and the experts' first pairs ((E+1) int64).
int64_t RuntimeBlockSavedBytes(const Workload& workload);

/// Of those, the attention probabilities (B*a*s*s fp32): what --ac selective frees after a block's
/// forward and recomputes before its backward.
int64_t RuntimeAttentionCoreBytes(const Workload& workload);

/// Peak and categories at the same sample points the engine's ledger uses (tensor memory only:
/// no framework terms; the hidden-state matrices are counted as activations), with the AdamW
/// states of the rank that holds the most (they differ only under FSDP1 with frozen parameters).
MemoryEstimate EstimateRuntimeMemory(const Workload& workload);

/// Step time of fsdp-run's engine, which runs its collectives blocking (no overlap): compute of
/// every unit (attention over the full s x s scores, as its kernels compute them) + every
/// collective at fp32 sizes + the optimizer + the engine's memory-bound passes over its flat
/// buffers (rounding copies, zero fills, gradient accumulation). Meaningful with a hardware file from
/// `fsdp-run calibrate`.
double EstimateRuntimeStepSeconds(const Workload& workload);

/// The memory of fsdp-run's GPU engine (src/runtime/cuda/cuda_engine.cc), replayed allocation by
/// allocation as its caching allocator counts it: sizes rounded up to 512 B, parameters and
/// gradients in param_dtype, activations and the engine's temporaries in param_dtype (inverse RMS
/// and token ids fp32/int32), fp32 shards and AdamW states, reduce_dtype casts and reduce-scatter
/// outputs as communication buffers. Categories in fsdp-run's order: sharded_params,
/// unsharded_params, gradients, optimizer_states, activations, comm_buffers, temporaries.
struct GpuRuntimeMemory {
  CategoryBytes at_peak{};
  int64_t peak_bytes = 0;
  std::string peak_phase;
  /// The engine's caching allocator replayed on the same calls, over two steps (no limit, the
  /// run's --alloc-conf). When a block one stream frees after another used it becomes reusable
  /// depends on how far the host runs ahead of the GPU, which the replay does not know, so it
  /// gives both ends: reusable at the engine's next allocation (the GPU keeps up: the least the
  /// engine reserves), and only at the end of the step (the host a whole step ahead: the most).
  int64_t reserved_peak_bytes = 0;
  int64_t reserved_peak_lagging_bytes = 0;
};
GpuRuntimeMemory EstimateGpuRuntimeMemory(const Workload& workload);

}  // namespace fsdp
