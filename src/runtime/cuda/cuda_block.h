// A Llama decoder block on the GPU (the same computation as llama_model.h's BlockForward /
// BlockBackward, in the compute dtype): RMSNorm, q/k/v projections, RoPE, causal GQA attention
// with materialised scores (as HF's eager attention), output projection, residual, RMSNorm,
// SwiGLU MLP, residual. Buffers come from the DeviceAllocator on the context's stream.
#pragma once

#include <cublas_v2.h>

#include "core/dtype.h"
#include "runtime/cuda/device_allocator.h"
#include "runtime/llama_model.h"

namespace fsdp::runtime::cuda {

struct DeviceContext {
  LlamaDims dims{};
  DType dtype = DType::kBf16;
  int64_t batch = 1, seq = 1;
  cublasHandle_t blas = nullptr;
  cudaStream_t stream = nullptr;
  DeviceAllocator* alloc = nullptr;
  const float* rope_table = nullptr;  ///< RopeTable(seq, inv_freq): cos then sin, seq x head_dim/2 each
  int64_t tokens() const { return batch * seq; }
  int64_t elem() const { return BytesPerElement(dtype); }
  /// An activation-sized buffer of `elements` compute-dtype values.
  Result<DeviceBuffer> Buffer(int64_t elements, MemCategory category) const { return alloc->Allocate(elements * elem(), category, stream); }
};

/// What a block's forward keeps for its backward (the block input is kept by the caller).
struct DeviceBlockCache {
  DeviceBuffer n1, q, k, v, probs, attn, x2, n2, gate, up, mid, inv1, inv2;
  /// Bytes held: n1, x2, n2 (T*h), q, attn (T*a*d), k, v (T*g*d), gate, up, mid (T*I), probs
  /// (B*a*s*s) in the compute dtype, inv1, inv2 (T) fp32; each rounded to 512 B.
  int64_t Bytes() const;
};

/// y (T, h) = block(x); fills `cache` (as activations) when non-null, else frees everything.
Result<DeviceBuffer> DeviceBlockForward(const DeviceContext& c, const void* params, const DeviceBuffer& x, DeviceBlockCache* cache);
/// dx from dy (consumed) and the cache (consumed); accumulates parameter gradients into `grads`
/// (the block's flat gradient, compute dtype); `dw_scratch` holds hidden fp32 values.
Result<DeviceBuffer> DeviceBlockBackward(const DeviceContext& c, const void* params, void* grads, float* dw_scratch, const DeviceBuffer& x,
                                         DeviceBuffer dy, DeviceBlockCache& cache);

/// The causal softmax probabilities (B*a, s, s) of q (T, a*d) against k (T, g*d): the first half of
/// DeviceAttentionForward, and what --ac selective recomputes before a block's backward.
Status DeviceAttentionProbs(const DeviceContext& c, const void* q, const void* k, void* probs);
/// Causal GQA attention: out (T, a*d) from q (T, a*d), k, v (T, g*d); probs (B*a, s, s) is written.
Status DeviceAttentionForward(const DeviceContext& c, const void* q, const void* k, const void* v, void* probs, void* out);
/// dq (T, a*d), dk, dv (T, g*d) from d_out and the saved probs.
Status DeviceAttentionBackward(const DeviceContext& c, const void* q, const void* k, const void* v, const void* probs, const void* d_out,
                               void* dq, void* dk, void* dv);

}  // namespace fsdp::runtime::cuda
