// What PyTorch's autograd keeps alive for one micro-batch of a HuggingFace decoder: the tensors each
// op saves for backward (docs/memory-model.md, "Activations", derives every entry).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/fsdp_config.h"
#include "core/model_spec.h"

namespace fsdp {

/// One tensor saved for backward, in bytes for one micro-batch.
struct SavedTensor {
  std::string_view name;          ///< static text, e.g. "self_attn.q_rope"
  int64_t bytes = 0;
  bool attention_core = false;    ///< scores/softmax/dropout: recomputed by selective checkpointing
  /// a kept tensor only the recomputation reads (selective-op's q and down outputs): freed as soon as
  /// the block's backward has recomputed the block, not at its end
  bool freed_after_recompute = false;
  /// freed by the time the softmax's backward runs (BlockActivations::softmax_backward):
  /// saved after the attention core, or by a core op whose backward has run (probs @ v's copy of v)
  bool freed_by_softmax_backward = false;
  /// the block's input hidden states themselves (torchtitan's fused RMSNorm saves its input): the
  /// tensor a checkpointed block keeps anyway, so recomputation does not allocate it again
  bool is_block_input = false;
  /// another input of the block's forward, held by a checkpointed block as its input and by an
  /// un-checkpointed one as what its ops save: kept under every checkpointing, never recomputed
  bool block_argument = false;
  /// made by the block's MLP sub-layer (from the norm before it on), not by the attention
  /// sub-layer: a checkpointed forward, under no_grad, has freed the attention's by then
  bool mlp_sublayer = false;
  /// made after the eager attention core's highest forward moment (BlockActivations::
  /// forward_moment): the probabilities cast back from the fp32 softmax (16 bits) or from a
  /// sink-joined core's, the softmax itself in fp32, and everything the block makes after its core. An un-checkpointed or
  /// selectively checkpointed forward allocates these once that moment's transients are gone.
  bool after_forward_moment = false;
  /// in BlockActivations::forward_moment: freed once the moment's next tensor is allocated (q k^T's
  /// raw product and its scaled copy, each replaced by the next op's result)
  bool freed_by_next_in_moment = false;
  /// The module (path inside the block: Architecture::attention_module, mlp_module, mlp_output, a
  /// norm's) whose backward's end releases the tensor: autograd frees an op's saved tensors once
  /// the op's backward has run (torch/csrc/autograd/engine.cpp, release_variables). Empty: the
  /// block's end (a block argument; the kept inputs checkpointing adds). Static text.
  std::string_view freed_after = {};
  /// A tensor the forward makes right after this one and frees once `then_transient_spans` more
  /// allocations of the list are made (0: before the next; counted as made_before's `outlives`):
  /// transformers' RMSNorm's `pow(2)` after its fp32 input, its fp32 product `x * rsqrt(...)` (or,
  /// weighing in fp32, `weight * x`) while the cast and the output are made (MarkNormTransients).
  /// Not saved: no byte total counts it.
  int64_t then_transient_bytes = 0;
  int then_transient_spans = 0;
  /// Tensors the forward makes before this one, in order, that nothing saves (MarkRopeTransients:
  /// the projections' outputs RoPE reads, RoPE's own products). Each stays alive through
  /// `outlives` further allocations of the list (of its tensors and of their made_before ones;
  /// then_transient ones do not count) and is freed before the next; ones that outlive the list
  /// are freed at its end. Not saved: no byte total counts them.
  struct Transient {
    int64_t bytes;
    int outlives;
  };
  std::vector<Transient> made_before = {};
};

/// Activation memory of one decoder block for one micro-batch.
struct BlockActivations {
  std::vector<SavedTensor> full;       ///< saved by an un-checkpointed forward (eager or flash attention)
  std::vector<SavedTensor> kept;       ///< kept until backward under the configured checkpointing
  std::vector<SavedTensor> recomputed; ///< of `full`, what checkpointing re-creates for the block's backward (alive through it)
  /// Transient gradients held through the block's backward beyond its saved tensors: the
  /// incoming and outgoing hidden-state gradients (c h a token each) and the largest op-level
  /// working set outside the MLP (SDPA's backward: dq, dk, dv and the kernel's fp32 dq
  /// accumulator; transformers' fp32 norm backward: three fp32 [T, h]); with softmax_backward, the
  /// norms' only. One tensor each, as the caching allocator gets them.
  std::vector<SavedTensor> backward_working;
  int64_t BackwardWorkingBytes() const;
  /// The MLP's moment beyond backward_working: right after the down projection's backward
  /// (its weight gradient made, its saved input released) the product's backward holds three
  /// [T, I] gradients (3 c I a token for a gated MLP, 4 for GPT-2's) beside the incoming c h,
  /// before the outgoing gradient exists: max(0, c h + mlp - BackwardWorkingBytes()). The memory
  /// model allocates and frees it there (Architecture::mlp_output), or, for routed experts
  /// without such a module, holds it through the MLP's backward.
  int64_t mlp_working_bytes = 0;
  /// Eager attention: the gradients alive while the softmax's backward runs (after the output
  /// projection's backward, so with the weight gradients of everything from it on, and after the
  /// tensors marked freed_by_softmax_backward are gone), one tensor each as autograd makes them:
  /// the residual stream's, v's (GPT-2's fused c_attn: v's view, h wide; q's and k's come after)
  /// and two of the scores' shape (the softmax output's gradient, then its input's). Empty: no
  /// such moment modelled (SDPA, or scores that need no gradient)
  std::vector<SavedTensor> softmax_backward;
  int64_t SoftmaxBackwardBytes() const;
  /// FsdpConfig::use_cache: the key and value states the layer returns (past_key_values) that
  /// `kept` does not already hold (the same storage: an un-checkpointed layer's attention saves
  /// them unless it saves copies, repeat_kv's under GQA), alive from the block's forward until
  /// the loop drops the model's output. Empty without use_cache.
  std::vector<SavedTensor> cache;
  /// The tensors an eager attention core's forward holds at its highest moment beyond the kept
  /// ones made before it (those not flagged after_forward_moment), allocated together and freed
  /// together. Llama-style cores (an fp32 softmax): the masked scores, in bf16 their fp32 copy,
  /// and whichever of the softmax's output and the probabilities are not kept; gpt-oss's
  /// sink-joined core: the masked scores, their join with the sink logits, the row maximum and
  /// the join less it. A fully checkpointed block's forward (no_grad) keeps none of the core's
  /// tensors and holds its inputs too (the normed hidden states, q, k, v, repeat_kv's copies).
  /// Empty: not modelled (SDPA, whose kernels hold no scores; op-level selective checkpointing;
  /// eager cores other than these: GPT-2's, MLA's, soft-capped, with dropout).
  std::vector<SavedTensor> forward_moment;
  /// forward_moment's bytes at its highest, as the memory model makes it: each tensor allocated
  /// in turn, one freed_by_next_in_moment gone once the next exists
  int64_t ForwardMomentBytes() const;
  /// Routed experts (MlpKind::kMoe, not dense dispatch): what their forward holds at its end
  /// beyond the tensors it saves (the router's logits, the routing weights, the sorted expert
  /// ids and their histc copy, the weighted outputs, their gather to token order and each
  /// token's sum; before them the residual the decoder layer holds through its MLP), allocated in
  /// order after every kept tensor of the block, a tensor flagged
  /// freed_by_next_in_moment freed once the next exists, all freed at the end. Under any
  /// checkpointing: a no_grad forward makes them too. Empty for other blocks.
  std::vector<SavedTensor> experts_forward_moment;
  /// Under full checkpointing, what the block's recomputation holds at its end beyond the
  /// recomputed tensors: non-reentrant checkpointing stops once the last saved tensor (inv_perm)
  /// is saved, with experts_forward_moment up to the weighted outputs alive (CPU allocation events
  /// of qwen3-moe-mini under --ac full); reentrant checkpointing reruns the whole forward.
  std::vector<SavedTensor> experts_recompute_moment;
  int64_t FullBytes() const;
  int64_t KeptBytes() const;
};

/// Activation memory outside the blocks (embedding, final norm, logits and loss), as the
/// configured transformers release computes the loss (FsdpConfig::transformers, HfLoss).
struct HeadActivations {
  std::vector<SavedTensor> embedding;     ///< kept from embedding forward to its backward
  std::vector<SavedTensor> final_norm;    ///< kept from final norm forward to its backward
  /// held during the final norm's backward (its input's gradient in fp32: the blocks' rule,
  /// BlockActivations::backward_working); none when its input needs no gradient
  std::vector<SavedTensor> final_norm_backward;
  /// the logits the model returns (lm_head's output, or under HfLoss::kFp32Logits its fp32
  /// upcast), alive from forward to the end of the loss backward, or longer in a loop that keeps them
  int64_t logits_bytes = 0;
  int64_t loss_saved_bytes = 0;           ///< log_softmax output saved by cross_entropy
  /// while the loss is computed: the fp32 upcast of 16-bit logits; under HfLoss::kFp32Logits
  /// lm_head's 16-bit output instead, which dies once the model has upcast it
  int64_t loss_forward_transient_bytes = 0;
  bool upcast_in_model = false;           ///< HfLoss::kFp32Logits: the transient is lm_head's output
  /// The loss's contiguous copy of logits[..., :-1, :] in fp32 (HfLoss::kShiftedCopy,
  /// kFp32Logits; 0 under kPaddedLabels), alive until the loss returns.
  int64_t shift_copy_bytes = 0;
  /// Each of the loss backward's two fp32 gradients of the loss's input shape (nll_loss_backward's
  /// zero-filled one, then _log_softmax_backward_data's result): separate allocations, as the
  /// caching allocator sees them.
  int64_t loss_grad_bytes = 0;
  /// SliceBackward0's zero-filled fp32 gradient of the whole logits, behind the shifted copy
  /// (0 under kPaddedLabels).
  int64_t slice_grad_bytes = 0;
  /// lm_head's output, in the compute dtype (the gradient its backward reads has this size)
  int64_t LmHeadOutputBytes() const { return upcast_in_model ? loss_forward_transient_bytes : logits_bytes; }
  int64_t SavedBytes() const;
};

/// Saved tensors of one block for the model family, micro-batch, sequence length, attention kernel
/// and checkpointing mode in `config` (compute dtype = config.param_dtype). What autograd saves
/// depends on which tensors require grad: with frozen weights (LoRA) a linear saves its input only
/// for an adapter, a norm its normalised input not at all, and a block whose input does not
/// require grad (the first, behind a frozen embedding) saves less again.
/// `window`: the block's attention window (ModelSpec::WindowOf); one shorter than the sequence
/// makes SDPA run with a mask, which changes what it saves.
BlockActivations BlockActivationProfile(const ModelShape& model, const FsdpConfig& config, bool input_requires_grad = true,
                                        int64_t window = 0);
/// Whether a block with this attention window runs SDPA with an explicit mask: a window shorter
/// than the sequence (otherwise transformers' sdpa_mask returns None and SDPA runs is_causal).
bool WindowMasksSdpa(const FsdpConfig& config, int64_t window);

/// Every decoder block's saved tensors, computed once per kind of block: its shape
/// (ModelShape::LayerShape: a dense layer of a routed model, a layer without RoPE), whether its
/// input requires grad (BlockInputRequiresGrad), whether it is checkpointed (BlockCheckpointed:
/// --ac-every leaves some without) and whether its window masks SDPA.
struct BlockProfiles {
  std::vector<BlockActivations> kinds;
  std::vector<size_t> of_block;  ///< per decoder block, its index into kinds
  const BlockActivations& Of(int block) const { return kinds[of_block.at(static_cast<size_t>(block))]; }
};
BlockProfiles BlockProfilesOf(const ModelSpec& model, const FsdpConfig& config);

/// Whether decoder block `block`'s input hidden states require grad (block num_layers: the final
/// norm's input): always in full training; under LoRA (a frozen base) not for the first block,
/// then once a block has trained anything.
bool BlockInputRequiresGrad(const ModelSpec& model, int block);

/// Whether transformers' residual stream is tensors apart from the saved ones, which the memory
/// model then holds: the embedding's output (`inputs_embeds`, referenced until the decoder
/// returns, after its final norm), each block's output (the model's loop holds it until the next
/// block has returned) and, inside a block, the attention output projection's output, its sum with
/// the residual (held through the MLP) and the down projection's output (Gemma's sandwich: each of
/// the two normed before its sum, the norms' outputs transients too). So in a pre-norm or sandwich
/// RMSNorm model in bf16 or fp16, whose norms save fp32 copies (in fp32 the upcast returns the
/// stream's tensor itself: saved), without or with selective checkpointing (full checkpointing
/// keeps each block's input as the checkpoint's, OLMo 2's post-norms (ResidualStreamCarried) and
/// torchtitan's fused norm save it). tools/torch_reference.py --memory-history, phi3-100m.json at
/// 8 x 2048: the embedding's output freed after the final norm, each block's two blocks on;
/// gemma3-text-100m.json at 2 x 2048 the sandwich's order.
bool ResidualStreamApart(const ModelShape& model, const FsdpConfig& config);

/// OLMo 2's residual stream (Architecture::norm_placement kPost, under ResidualStreamApart's other
/// conditions, the base trained): saved tensors made elsewhere than their list's place. Each
/// block's input, which q, k and v save, is the previous block's output (its residual sum with
/// the post-MLP norm's output, made as that block returns) or the embedding's: the memory model
/// makes it there and hands it to the block's list as its first tensor ("block.input"). Inside a
/// block, the attention output projection's output, the two post-norms' outputs and the down
/// projection's output are transients; the sum after the attention is "mlp.input", which gate
/// and up save. tools/torch_reference.py --memory-history, olmo2-100m.json at 8 x 2048.
bool ResidualStreamCarried(const ModelShape& model, const FsdpConfig& config);

/// Saved tensors of the embedding, final norm and HF's ForCausalLMLoss.
HeadActivations HeadActivationProfile(const ModelSpec& model, const FsdpConfig& config);

int64_t SumBytes(const std::vector<SavedTensor>& tensors);

/// Sets then_transient_bytes on a list's transformers RMSNorm tensors (each module's
/// "<norm>.x_fp32", "<norm>.rsqrt", "<norm>.x_normalized", "<norm>.out", in that order):
/// LlamaRMSNorm.forward's `hidden_states.pow(2)` (4 bytes a feature, freed once `mean` has run)
/// after the fp32 input, and its fp32 `hidden_states * torch.rsqrt(...)` (bound until the norm
/// returns) after the rsqrt, alive while the cast and the weighted output are made; a norm that
/// multiplies by its weight in fp32 (Architecture::norm_weight_fp32: Gemma's, OLMo 2's) saves
/// that product and holds the weighted fp32 one instead, after it. In fp32 the casts are the
/// tensors themselves: no second transient. Norms whose fp32 input is not saved are left alone.
void MarkNormTransients(std::vector<SavedTensor>& tensors, const Architecture& arch, int64_t compute_bytes);

/// The model's persistent buffers on each rank, bytes of each tensor (FSDP moves buffers to the
/// device whole; they are not sharded): torchtitan's RoPE table freqs_cis, complex64 [seq_len, head_dim / 2]
/// (models/llama3/model/model.py precompute_freqs_cis; args.py update_from_config sets
/// max_seq_len to the training seq_len); its Qwen3's rope_cache, fp32 [seq_len, 2 head_dim]
/// (models/qwen3/model/model.py precompute_rope_cache: cos then sin). transformers' one
/// inv_freq of the model (head_dim / 2 floats): 0 here; in releases whose attention layers each
/// hold RoPE tables of every position (HasPerLayerRopeTables: Llama 4.31 to 4.40, ...), those, in
/// the model's dtype or FSDP1's buffer_dtype; 4.38's Llama adds its bool [P, P] causal_mask.
std::vector<int64_t> ModelBuffers(const ModelSpec& model, const FsdpConfig& config);

}  // namespace fsdp
