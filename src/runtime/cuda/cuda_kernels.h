// CUDA kernels of fsdp-run's GPU backend: the element-wise and row-wise parts of a Llama
// decoder's forward and backward (the matrix products go through cuBLAS, cuda_gemm.h), the dtype
// casts around FSDP's collectives, and AdamW. Activations are row-major (tokens, features) in the
// compute dtype (bf16, fp16 or fp32); reductions accumulate in fp32. Each kernel is checked
// against the CPU implementation (llama_ops.h) in cuda_kernels_test.cc.
#pragma once

#include <cstdint>
#include <vector>

#include <cuda_runtime.h>

#include "core/dtype.h"
#include "core/status.h"

namespace fsdp::runtime::cuda {

/// out[i] = std * N(0, 1) drawn from a hash of (seed, first_index + i): the same value for a
/// parameter whichever rank initialises it (Box-Muller on splitmix64 uniforms).
void FillNormal(float* out, int64_t n, uint64_t seed, int64_t first_index, float std, cudaStream_t stream);
/// out[i] = value.
void Fill(float* out, int64_t n, float value, cudaStream_t stream);

/// out (n, dtype) = in (n, fp32) rounded to nearest.
void CastFromF32(const float* in, void* out, DType dtype, int64_t n, cudaStream_t stream);
/// out (n, to) = in (n, from).
void Cast(const void* in, DType from, void* out, DType to, int64_t n, cudaStream_t stream);
/// acc (n, fp32) += scale * in (n, dtype).
void AccumulateF32(const void* in, DType dtype, float scale, float* acc, int64_t n, cudaStream_t stream);
/// *found = 1 when some x[i] (n, fp32) is inf or NaN; otherwise *found is left as it was
/// (ShardedGradScaler.unscale_'s check, _amp_foreach_non_finite_check_and_unscale_).
void FlagNonFinite(const float* x, int64_t n, float* found, cudaStream_t stream);
/// out (n, dtype) += in (n, fp32).
void AddF32(const float* in, void* out, DType dtype, int64_t n, cudaStream_t stream);
/// out (rows, cols) = bias (cols) in every row: a Linear's output preset to its bias, so that the
/// product added with beta 1 rounds once, as PyTorch's fused addmm does.
void BroadcastRows(const void* bias, void* out, int64_t rows, int64_t cols, DType dtype, cudaStream_t stream);
/// out (cols, fp32, zeroed here) = sum over rows of x (rows, cols): a bias's gradient.
void ColumnSums(const void* x, float* out, int64_t rows, int64_t cols, DType dtype, cudaStream_t stream);
/// x (n) *= scale, in place.
void Scale(void* x, DType dtype, float scale, int64_t n, cudaStream_t stream);

/// out (rows, h) = table rows at ids (rows).
void EmbeddingForward(const void* table, const int32_t* ids, void* out, int64_t rows, int64_t h, DType dtype, cudaStream_t stream);
/// The rows of each distinct token id, for the embedding backward (PyTorch sorts the ids for the
/// same purpose): token i is ids[i], its rows are rows[offsets[i] .. offsets[i + 1]); ids ascending.
struct TokenGroups {
  std::vector<int32_t> ids, offsets, rows;
  /// ids, offsets and rows one after another (3 * tokens + 1 int32 at most): what the kernel reads.
  std::vector<int32_t> Packed() const;
};
TokenGroups GroupTokens(const std::vector<int32_t>& token_ids);
/// d_table rows of the grouped tokens += the sum of their d_out rows, summed in fp32 and written
/// once per token (no atomics: deterministic). `packed` is TokenGroups::Packed() on the device,
/// `tokens` its ids.size().
void EmbeddingBackward(const void* d_out, const int32_t* packed, int64_t tokens, void* d_table, int64_t h, DType dtype, cudaStream_t stream);

/// y = x * inv_rms * w with inv_rms = 1 / sqrt(mean(x^2) + eps), saved per row (fp32).
void RmsNormForward(const void* x, const void* w, void* y, float* inv_rms, int64_t rows, int64_t h, float eps, DType dtype,
                    cudaStream_t stream);
/// dx = RMSNorm backward (+ residual when non-null, the gradient arriving by the skip connection);
/// dw (h, fp32 scratch, zeroed here) = sum over rows of dy * x * inv_rms.
void RmsNormBackward(const void* dy, const void* x, const void* w, const float* inv_rms, const void* residual, void* dx,
                     float* dw_f32, int64_t rows, int64_t h, DType dtype, cudaStream_t stream);

/// Fills the device rotary table of `seq` positions: cos then sin of pos * inv_freq[i] for
/// i < head_dim/2 (inv_freq from RopeInverseFrequencies), computed on the host in double as the
/// CPU's Rope computes them and stored fp32 (2 * seq * head_dim/2 floats). Returns when the copy
/// on `stream` is done.
Status RopeTable(float* table, int64_t seq, const std::vector<double>& inv_freq, cudaStream_t stream);
/// Rotary embedding in place on x (rows, heads * head_dim), position = row % seq, HF rotate_half
/// layout, angles from RopeTable; `inverse` applies the transpose (backward).
void Rope(void* x, const float* table, int64_t rows, int64_t heads, int64_t head_dim, int64_t seq, bool inverse, DType dtype,
          cudaStream_t stream);

/// In place on scores (matrices, seq, seq): p = softmax(scale * s) over j <= i, 0 above the diagonal.
void CausalSoftmaxForward(void* scores, int64_t matrices, int64_t seq, float scale, DType dtype, cudaStream_t stream);
/// In place on d_probs: ds = scale * p * (dp - sum_j p * dp), 0 above the diagonal.
void CausalSoftmaxBackward(const void* probs, void* d_probs, int64_t matrices, int64_t seq, float scale, DType dtype,
                           cudaStream_t stream);
/// out (rows, kv_heads * d) = sum over the `rep` query heads of each kv head in in (rows, kv_heads * rep * d).
void SumHeadGroups(const void* in, void* out, int64_t rows, int64_t kv_heads, int64_t rep, int64_t head_dim, DType dtype,
                   cudaStream_t stream);

/// mid = silu(gate) * up.
void SwiGluForward(const void* gate, const void* up, void* mid, int64_t n, DType dtype, cudaStream_t stream);
/// d_gate, d_up from d_mid.
void SwiGluBackward(const void* d_mid, const void* gate, const void* up, void* d_gate, void* d_up, int64_t n, DType dtype,
                    cudaStream_t stream);

/// Cross-entropy of logits (rows, vocab) against targets: loss_sum (one fp32 on the device) +=
/// sum of per-row losses; logits are overwritten with d_logits = (softmax - onehot) * grad_scale.
void CrossEntropyInPlace(void* logits, const int32_t* targets, float* loss_sum, int64_t rows, int64_t vocab, float grad_scale,
                         DType dtype, cudaStream_t stream);

/// One AdamW step (decoupled weight decay, bias-corrected) on fp32 parameter, gradient and states;
/// a null grad counts as zeros.
void AdamW(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n, float lr, float beta1, float beta2,
           float eps, float weight_decay, float bias_correction1, float bias_correction2, cudaStream_t stream);

}  // namespace fsdp::runtime::cuda
