// A Llama-style decoder (embedding, blocks of RMSNorm + GQA attention with RoPE + SwiGLU MLP, final
// norm, LM head, cross-entropy) over flat fp32 parameter buffers laid out like the checkpoint's
// tensors (ModelSpec inventory order), so that FSDP units are contiguous slices.
#pragma once

#include <cstdint>
#include <vector>

#include "core/model_spec.h"
#include "runtime/llama_ops.h"

namespace fsdp::runtime {

struct LlamaDims {
  int64_t vocab, hidden, inner, heads, kv_heads, head_dim, layers;
  bool qkv_bias = false;  ///< q/k/v projections with biases (Qwen2)
  bool qk_norm = false;   ///< an RMSNorm over head_dim on every head of q and of k before RoPE (Qwen3's q_norm, k_norm)
  float rms_eps = 1e-5f;
  std::vector<double> rope_inv_freq = {};  ///< RopeInverseFrequencies: head_dim / 2 values
  bool tied = false;
  /// Offsets of a block's tensors in its flat buffer: where the inventory (BuildInventory, from the
  /// family's Architecture) puts them (-1 for absent biases).
  struct BlockOffsets {
    int64_t in_norm = -1, wq = -1, bq = -1, wk = -1, bk = -1, wv = -1, bv = -1, wo = -1, q_norm = -1, k_norm = -1, post_norm = -1, wg = -1, wu = -1,
            wd = -1;
  };
  BlockOffsets offsets;
  int64_t block_numel = 0;  ///< parameters of one block
  int64_t BlockNumel() const { return block_numel; }
  const BlockOffsets& Offsets() const { return offsets; }
};

/// RoPE's inverse frequencies (head_dim / 2) as transformers computes them for `model` trained at
/// seq_len: rope_theta^(-2i/head_dim), then rope_scaling "linear" (divided by factor), "dynamic"
/// (NTK base, unchanged up to max_position_embeddings) or "llama3" (Llama 3.1's banded
/// interpolation); BadInput for types fsdp-run does not implement (yarn, longrope, ...).
/// Source: transformers' modeling_rope_utils.py (_compute_*_parameters).
Result<std::vector<double>> RopeInverseFrequencies(const ModelSpec& model, int64_t seq_len);

/// Dimensions of a llama, mistral, qwen2 or qwen3 model trained at seq_len (biases on q/k/v only,
/// as Qwen2's; Qwen3's per-head q/k norms); BadInput for other models or biases, for RoPE scaling
/// it does not implement, and for a sliding window shorter than seq_len (fsdp-run's attention is
/// fully causal).
Result<LlamaDims> DimsOf(const ModelSpec& model, int64_t seq_len);

/// What a block's forward keeps for its backward.
struct BlockCache {
  Mat x, n1, q, k, v, attn, x2, n2, gate, up, mid;
  Vec inv1, inv2;
  /// qk_norm: q and k before their norms, one head per row ((T x heads, head_dim)), and each row's inverse RMS
  Mat q_heads, k_heads;
  Vec inv_q, inv_k;
  std::vector<Mat> probs;
  int64_t SavedBytes() const;
};

/// Selective checkpointing: frees the attention probabilities (`cache.probs`) after the forward...
void DropAttentionCore(BlockCache& cache);
/// ...and recomputes them from the saved q and k (after RoPE) before the backward; returns their bytes.
int64_t RecomputeAttentionCore(const LlamaDims& d, BlockCache& cache, int64_t batch, int64_t seq);

/// x (T, h) -> block output; fills `cache` when non-null. `params` is the block's flat buffer.
Mat BlockForward(const LlamaDims& d, const float* params, const Mat& x, int64_t batch, int64_t seq, BlockCache* cache);
/// Returns dx; accumulates the block's parameter gradients into `grads` (same layout as params).
Mat BlockBackward(const LlamaDims& d, const float* params, float* grads, const Mat& dy, const BlockCache& cache, int64_t batch, int64_t seq);

}  // namespace fsdp::runtime
