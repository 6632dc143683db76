// A Llama-style decoder (embedding, blocks of RMSNorm + GQA attention with RoPE + SwiGLU MLP, final
// norm, LM head, cross-entropy) over flat fp32 parameter buffers laid out like the checkpoint's
// tensors (ModelSpec inventory order), so that FSDP units are contiguous slices.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <vector>

#include "core/model_spec.h"
#include "runtime/llama_ops.h"

namespace fsdp::runtime {

struct LlamaDims {
  int64_t vocab, hidden, inner, heads, kv_heads, head_dim, layers;
  bool qkv_bias = false;  ///< q/k/v projections with biases (Qwen2)
  bool qk_norm = false;   ///< an RMSNorm over head_dim on every head of q and of k before RoPE (Qwen3's q_norm, k_norm)
  /// > 0: the MLP is Qwen3-MoE's routed experts (Qwen3MoeSparseMoeBlock), this many SwiGLU experts of
  /// `inner` features each, every token through experts_per_token of them; 0: one SwiGLU MLP
  int64_t experts = 0, experts_per_token = 0;
  bool norm_topk = false;  ///< the chosen experts' weights divided by their sum (norm_topk_prob)
  float rms_eps = 1e-5f;
  std::vector<double> rope_inv_freq = {};  ///< RopeInverseFrequencies: head_dim / 2 values
  bool tied = false;
  /// Offsets of a block's tensors in its flat buffer: where the inventory (BuildInventory, from the
  /// family's Architecture) puts them (-1 for absent biases).
  struct BlockOffsets {
    int64_t in_norm = -1, wq = -1, bq = -1, wk = -1, bk = -1, wv = -1, bv = -1, wo = -1, q_norm = -1, k_norm = -1, post_norm = -1, wg = -1, wu = -1,
            wd = -1;
    /// routed experts: the router mlp.gate.weight (experts, hidden), mlp.experts.gate_up_proj
    /// (experts, 2 x inner, hidden: gate's rows, then up's) and mlp.experts.down_proj (experts, hidden, inner)
    int64_t router = -1, experts_gate_up = -1, experts_down = -1;
  };
  BlockOffsets offsets;
  /// LoRA (peft's lora.Linear): where a projection's lora_A (rank, in) and lora_B (out, rank) sit,
  /// relative to the block's first adapter tensor; -1 for a projection without adapters.
  struct LoraOffsets {
    int64_t a = -1, b = -1;
  };
  /// In forward order: q, k, v, o, gate, up, down.
  enum Projection { kQ, kK, kV, kO, kGate, kUp, kDown, kProjections };
  std::array<LoraOffsets, kProjections> lora{};
  int64_t lora_rank = 0;     ///< r; 0 without adapters
  float lora_scale = 0;      ///< lora_alpha / r, peft's scaling of lora_B's output: set by the caller, who knows the LoraConfig
  double lora_dropout = 0;   ///< lora_dropout's p, in [0, 1): set by the caller with lora_scale
  bool base_frozen = false;  ///< the block's own tensors get no gradient (LoRA's base)
  int64_t block_numel = 0;  ///< parameters of one block, adapters included
  int64_t BlockNumel() const { return block_numel; }
  const BlockOffsets& Offsets() const { return offsets; }
};

/// RoPE's inverse frequencies (head_dim / 2) as transformers computes them for `model` trained at
/// seq_len: rope_theta^(-2i/head_dim), then rope_scaling "linear" (divided by factor), "dynamic"
/// (NTK base, unchanged up to max_position_embeddings) or "llama3" (Llama 3.1's banded
/// interpolation); BadInput for types fsdp-run does not implement (yarn, longrope, ...).
/// Source: transformers' modeling_rope_utils.py (_compute_*_parameters).
Result<std::vector<double>> RopeInverseFrequencies(const ModelSpec& model, int64_t seq_len);

/// Dimensions of a llama, mistral, qwen2, qwen3 or qwen3_moe model trained at seq_len (biases on q/k/v
/// only, as Qwen2's; Qwen3's per-head q/k norms; Qwen3-MoE's routed experts in every layer, stored
/// fused as transformers 5 holds them); BadInput for other models or biases, for RoPE scaling
/// it does not implement, and for a sliding window shorter than seq_len (fsdp-run's attention is
/// fully causal). A LoRA model's adapters (lora_A, lora_B of the q/k/v/o and MLP projections) are
/// found, LlamaDims::lora_scale is left for the caller.
Result<LlamaDims> DimsOf(const ModelSpec& model, int64_t seq_len);

/// Lays block 0's tensors out as a buffer holds them: `offset_of(t)` is tensor t's first element
/// there. LlamaDims::offsets become relative to the block's first own (base) tensor, LlamaDims::lora
/// to its first adapter (they may sit in another buffer: BlockWeights). DimsOf lays them out as the
/// inventory packs them.
void SetBlockLayout(const ModelSpec& model, const std::function<int64_t(int)>& offset_of, LlamaDims& d);

/// A block's parameters: its own tensors (laid out by LlamaDims::offsets) and its LoRA adapters
/// (by LlamaDims::lora; unused without them).
struct BlockWeights {
  BlockWeights(const float* base_in, const float* adapters_in = nullptr) : base(base_in), adapters(adapters_in) {}
  const float* base;
  const float* adapters;
};
/// Where a block's gradients accumulate, in the same layouts; `base` is ignored when
/// LlamaDims::base_frozen.
struct BlockGrads {
  BlockGrads(float* base_in, float* adapters_in = nullptr) : base(base_in), adapters(adapters_in) {}
  float* base;
  float* adapters;
};

/// Where a block call's LoRA dropout masks come from (LlamaDims::lora_dropout > 0). Row r of the
/// call's (T = batch x seq, features) input belongs to sequence first_sequence + r / seq; each
/// (sequence, block, projection) draws its own mask from mt19937_64 seeded by `seed` and those three,
/// so a rank's rows get the masks the same rows get in a one-process run (the losses of N ranks equal
/// one's) and a checkpointed block's recompute gets its forward's (torch.utils.checkpoint restores
/// the RNG state for the same reason).
struct DropoutKey {
  uint64_t seed = 0;
  int64_t first_sequence = 0;
  int64_t block = 0;
};

/// nn.Dropout(p) in training on x (T, in) as CUDA's fused native_dropout computes it (on the CPU
/// torch takes an unfused path that saves float noise instead of a bool mask): keep (T x in, 1 or
/// 0, a byte each as the bool mask) drawn with keep probability 1 - p, returns x * scale where kept
/// and 0 elsewhere, scale = 1 / (1 - p) computed in double and applied in fp32. x's rows are
/// sequences of `seq` rows each, every sequence from a stream of its own (DropoutKey);
/// `projection` is the LlamaDims::Projection the dropout feeds.
Mat LoraDropoutForward(const DropoutKey& key, int projection, double p, const Mat& x, int64_t seq, std::vector<uint8_t>& keep);

/// What a block's forward keeps for its backward.
struct BlockCache {
  Mat x, n1, q, k, v, attn, x2, n2, gate, up, mid;
  Vec inv1, inv2;
  /// qk_norm: q and k before their norms, one head per row ((T x heads, head_dim)), and each row's inverse RMS
  Mat q_heads, k_heads;
  Vec inv_q, inv_k;
  std::vector<Mat> probs;
  /// LoRA: each adapted projection's x A^T (T, rank), what lora_B's gradient needs (LlamaDims::Projection order)
  std::array<Mat, LlamaDims::kProjections> lora_mid{};
  /// LoRA with dropout: each adapted projection's dropout(x) (T, in), lora_A's input and what its
  /// gradient needs, and the dropout's keep mask (T x in bytes), what the input's gradient needs
  std::array<Mat, LlamaDims::kProjections> lora_dropped{};
  std::array<std::vector<uint8_t>, LlamaDims::kProjections> lora_keep{};
  /// Routed experts: the router's softmax (T, experts) and each token's expert weights (T, k), then
  /// per routed (token, expert) pair, the pairs grouped by expert (expert e's from pair_begin[e] to
  /// pair_begin[e + 1]): the pair's token and top-k slot, and the expert's output before its weight
  /// (T k, hidden); gate, up and mid above hold the pairs' rows then, (T k, inner) each.
  Mat router_probs{}, route_weight{}, expert_out{};
  std::vector<int32_t> pair_token{}, pair_slot{};
  std::vector<int64_t> pair_begin{};
  int64_t SavedBytes() const;
};

/// Selective checkpointing: frees the attention probabilities (`cache.probs`) after the forward...
void DropAttentionCore(BlockCache& cache);
/// ...and recomputes them from the saved q and k (after RoPE) before the backward; returns their bytes.
int64_t RecomputeAttentionCore(const LlamaDims& d, BlockCache& cache, int64_t batch, int64_t seq);

/// x (T, h) -> block output; fills `cache` when non-null. An adapted projection computes
/// x W^T + scale (dropout(x) A^T) B^T, as peft's lora.Linear.forward, its dropout's masks from
/// `dropout` (unused when LlamaDims::lora_dropout is 0, lora_dropout the identity then). Routed
/// experts as Qwen3MoeTopKRouter and Qwen3MoeExperts: softmax(x Wr^T) in fp32, its top-k (the
/// lower expert index first among equal weights), then sum over the chosen e of weight_e * down_e(
/// silu(gate_e x) * up_e x).
Mat BlockForward(const LlamaDims& d, const BlockWeights& params, const Mat& x, int64_t batch, int64_t seq, BlockCache* cache,
                 const DropoutKey& dropout = {});
/// Returns dx; accumulates the block's parameter gradients into `grads` (the layouts of params):
/// the adapters' always, the block's own unless LlamaDims::base_frozen.
Mat BlockBackward(const LlamaDims& d, const BlockWeights& params, const BlockGrads& grads, const Mat& dy, const BlockCache& cache, int64_t batch,
                  int64_t seq);

}  // namespace fsdp::runtime
