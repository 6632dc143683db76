#include "planner/activation_model.h"

#include <algorithm>
#include <set>
#include <string>

#include <fmt/format.h>

namespace fsdp {
namespace {

std::string_view LastComponent(std::string_view path) {
  const size_t dot = path.rfind('.');
  return dot == std::string_view::npos ? path : path.substr(dot + 1);
}

// Shapes of one micro-batch, in elements.
struct Dims {
  int64_t tokens;      // T = micro_batch * seq_len
  int64_t seq;         // s
  int64_t c;           // compute dtype bytes (param_dtype under mixed precision)
  int64_t h, inner, heads, kv_heads, head_dim, experts, top_k;
};

Dims DimsOf(const ModelSpec& m, const FsdpConfig& cfg) {
  return Dims{cfg.micro_batch * cfg.seq_len, cfg.seq_len, BytesPerElement(cfg.param_dtype), m.hidden_size,
              m.intermediate_size, m.num_heads, m.num_kv_heads, m.head_dim, m.num_experts, m.experts_per_token};
}

// The norms a block runs, in forward order (core/families/: the input norm, then the
// post-attention one), for the names of their saved tensors.
std::vector<std::string_view> BlockNorms(const ModelSpec& m) {
  std::vector<std::string_view> norms;
  for (const ParamOp& op : m.arch.block) {
    if (op.kind == ParamOp::Kind::kNorm && !op.head_norm) norms.push_back(op.module);
  }
  return norms;
}

// Interns "<module>.<what>" for the lifetime of the process: SavedTensor names are string_views.
std::string_view Name(std::string_view module, std::string_view what) {
  static std::set<std::string, std::less<>> names;
  std::string name = fmt::format("{}.{}", module, what);
  return *names.insert(std::move(name)).first;
}

// What a norm's forward saves. LlamaRMSNorm upcasts to fp32: pow() saves the fp32 input, rsqrt()
// its [T,1] result, weight * x.to(dtype) the normalised input in the compute dtype (for the
// weight's gradient) (saved_tensors_hooks on transformers 5.24: docs/memory-model.md). Native
// LayerNorm saves its input and fp32 mean and rstd.
void AddNorm(std::vector<SavedTensor>& out, NormKind kind, std::string_view module, const Dims& d) {
  if (kind == NormKind::kLayer) {
    out.push_back({Name(module, "in"), d.c * d.h * d.tokens});
    out.push_back({Name(module, "stats"), 8 * d.tokens});
    return;
  }
  out.push_back({Name(module, "x_fp32"), 4 * d.h * d.tokens});
  out.push_back({Name(module, "rsqrt"), 4 * d.tokens});
  out.push_back({Name(module, "x_normalized"), d.c * d.h * d.tokens});
}

// A norm followed by the linear(s) that read its output, which save it (once, when several do).
void AddNormAndLinearInput(std::vector<SavedTensor>& out, NormKind kind, std::string_view module, const Dims& d) {
  AddNorm(out, kind, module, d);
  out.push_back({Name(module, "out"), d.c * d.h * d.tokens});
}

// The attention core between the projections. Eager: the softmax's output (HF Llama-style
// eager_attention_forward runs it in fp32 and casts the probabilities back; GPT-2's runs in the
// compute dtype) and dropout's mask and output. SDPA's flash/memory-efficient kernels save a fp32
// log-sum-exp per row beside q, k, v and the output.
void AddAttentionCore(std::vector<SavedTensor>& out, const ModelSpec& m, const FsdpConfig& cfg, const Dims& d) {
  const int64_t scores = d.heads * d.seq * d.tokens;  // B * a * s * s
  if (cfg.attention != Attention::kEager) {
    out.push_back({m.arch.fused_qkv ? "attn.lse" : "self_attn.lse", 4 * d.heads * d.tokens});
    return;
  }
  if (m.arch.softmax_fp32) {
    out.push_back({"attn_core.softmax_fp32", 4 * scores, true});
    if (d.c != 4) out.push_back({"attn_core.probs", d.c * scores, true});
  } else {
    out.push_back({"attn_core.probs", d.c * scores, true});
  }
  if (m.attention_dropout > 0) {
    out.push_back({"attn_core.dropout_mask", scores, true});
    out.push_back({"attn_core.dropout_out", d.c * scores, true});
  }
}

// Separate q/k/v projections with RoPE (Llama-style): q after RoPE is saved; eager attention
// saves k and v as repeat_kv expands them to all heads (with as many kv heads as heads it returns
// them as they are). The expansion runs inside HF's eager_attention_forward, so with GQA it
// belongs to the core that selective checkpointing recomputes (SelectiveCheckpointInputs then
// keeps k and v at kv-head width). SDPA saves k after RoPE and v at kv-head width; its output is
// [B, s, a, d] underneath, so HF's transpose(1, 2).contiguous() copies nothing and o_proj saves
// that same tensor (counted once, as o_proj_in).
void AddSplitAttention(std::vector<SavedTensor>& out, const ModelSpec& m, const FsdpConfig& cfg, const Dims& d) {
  const int64_t q = d.heads * d.head_dim * d.tokens, kv = d.kv_heads * d.head_dim * d.tokens;
  // Qwen3's q_norm / k_norm (an RMSNorm per head, before RoPE): as AddNorm's RMSNorm, over the
  // heads' features, its rsqrt one per (token, head). Not yet checked against PyTorch.
  for (const ParamOp& op : m.arch.block) {
    if (op.kind != ParamOp::Kind::kNorm || !op.head_norm) continue;
    const bool is_k = op.module.find("k_norm") != std::string::npos;
    const int64_t features = is_k ? kv : q, heads = (is_k ? d.kv_heads : d.heads) * d.tokens;
    out.push_back({Name(op.module, "x_fp32"), 4 * features});
    out.push_back({Name(op.module, "rsqrt"), 4 * heads});
    out.push_back({Name(op.module, "x_normalized"), d.c * features});
  }
  out.push_back({"self_attn.q_rope", d.c * q});
  if (cfg.attention == Attention::kEager) {
    const bool gqa = d.kv_heads < d.heads;
    out.push_back({"self_attn.k_repeated", d.c * q, gqa});
    out.push_back({"self_attn.v_repeated", d.c * q, gqa});
    AddAttentionCore(out, m, cfg, d);
  } else {
    out.push_back({"self_attn.k_rope", d.c * kv});
    out.push_back({"self_attn.v", d.c * kv});
    AddAttentionCore(out, m, cfg, d);
  }
  out.push_back({"self_attn.o_proj_in", d.c * q});
}

// One fused q/k/v projection (GPT-2's c_attn) without RoPE: q, k and v are views of its output,
// which stays saved.
void AddFusedAttention(std::vector<SavedTensor>& out, const ModelSpec& m, const FsdpConfig& cfg, const Dims& d) {
  out.push_back({"attn.qkv", d.c * (d.heads + 2 * d.kv_heads) * d.head_dim * d.tokens});
  AddAttentionCore(out, m, cfg, d);
  out.push_back({"attn.c_proj_in", d.c * d.h * d.tokens});
}

// The MLP after its norm. Gated (SwiGLU): gate's output (SiLU's input), SiLU's output, up's output
// and down's input. Routed experts (MixtralSparseMoeBlock): router logits, fp32 routing softmax,
// then for each of the top_k (token, expert) pairs the gathered input, w1/act/w3/product and w2's
// output. Plain (GPT-2's fc + activation + proj): the activation's saved tensors (transformers'
// NewGELUActivation is written in Python and saves input, tanh, 0.5*x and 1+tanh) and proj's input.
void AddMlp(std::vector<SavedTensor>& out, const ModelSpec& m, const Dims& d) {
  const int64_t x = d.c * d.inner * d.tokens;
  switch (m.arch.mlp) {
    case MlpKind::kGated:
      out.push_back({"mlp.gate_out", x});
      out.push_back({"mlp.act_out", x});
      out.push_back({"mlp.up_out", x});
      out.push_back({"mlp.down_in", x});
      return;
    case MlpKind::kMoe: {
      const int64_t pairs = d.top_k * d.tokens;
      out.push_back({"moe.router_logits", d.c * d.experts * d.tokens});
      out.push_back({"moe.routing_fp32", 4 * d.experts * d.tokens});
      out.push_back({"moe.expert_in", d.c * d.h * pairs});
      out.push_back({"moe.w1_w3_act_prod", 4 * d.c * d.inner * pairs});
      out.push_back({"moe.w2_out", d.c * d.h * pairs});
      return;
    }
    case MlpKind::kPlain:
      if (m.activation == "gelu_new") {
        out.push_back({"mlp.gelu_new_saved", 4 * x});
      } else {
        out.push_back({"mlp.act_in", x});
      }
      out.push_back({"mlp.c_proj_in", x});
      return;
  }
}

// A pre-norm decoder block: norm, attention, residual (dropout), norm, MLP, residual (dropout).
// Residual dropout saves a bool mask of the hidden states.
std::vector<SavedTensor> BlockSaved(const ModelSpec& m, const FsdpConfig& cfg, const Dims& d) {
  const std::vector<std::string_view> norms = BlockNorms(m);
  std::vector<SavedTensor> out;
  AddNormAndLinearInput(out, m.arch.norm, norms.at(0), d);
  if (m.arch.fused_qkv) {
    AddFusedAttention(out, m, cfg, d);
  } else {
    AddSplitAttention(out, m, cfg, d);
  }
  if (m.residual_dropout > 0) out.push_back({"attn.resid_dropout_mask", d.h * d.tokens});
  AddNormAndLinearInput(out, m.arch.norm, norms.at(1), d);
  AddMlp(out, m, d);
  if (m.residual_dropout > 0) out.push_back({"mlp.dropout_mask", d.h * d.tokens});
  return out;
}

// What selective checkpointing keeps beyond the un-recomputed tensors: the checkpointed attention
// function's inputs stay referenced until its recomputation. q (after RoPE) is saved anyway; with
// GQA k and v are kept at kv-head width where the matmuls would have saved their expansions.
// GPT-2's q/k/v are views of c_attn's output, which stays saved.
std::vector<SavedTensor> SelectiveCheckpointInputs(const ModelSpec& m, const FsdpConfig& cfg, const Dims& d) {
  if (m.arch.fused_qkv || cfg.attention != Attention::kEager || d.kv_heads >= d.heads) return {};
  const int64_t kv = d.kv_heads * d.head_dim * d.tokens;
  return {{"attn_core.k_input", d.c * kv}, {"attn_core.v_input", d.c * kv}};
}

// torchtitan's op-level selective AC on a Llama block (selective_ac_option "op": a selective-checkpoint
// policy with MUST_SAVE for aten.mm, except every second call in the block, and for the SDPA flash
// and memory-efficient kernels). HF's block calls mm for q, k, v, o, gate, up and down in that order,
// so the outputs of q, v, gate and down are kept, with the SDPA kernel's output and log-sum-exp
// under flash attention; with the block input (the checkpoint's) that is all a block keeps.
// torch_reference.py --ac selective-op on llama-100m: exactly these bytes per block beyond --ac
// full's, with eager attention and with SDPA (docs/memory-model.md). The recomputation takes each
// kept output out of the policy's cache; those the recomputed ops do not save again (q's, which
// RoPE reads; down's, which the residual add reads; v's when repeat_kv copies it) are freed then.
std::vector<SavedTensor> OpCheckpointKept(const FsdpConfig& cfg, const Dims& d) {
  const int64_t q = d.heads * d.head_dim * d.tokens, kv = d.kv_heads * d.head_dim * d.tokens;
  const bool v_copied = cfg.attention == Attention::kEager && d.kv_heads < d.heads;
  std::vector<SavedTensor> kept = {{"checkpoint.block_input", d.c * d.h * d.tokens},
                                   {"op_sac.q_proj_out", d.c * q, false, true},
                                   {"op_sac.v_proj_out", d.c * kv, false, v_copied},
                                   {"op_sac.gate_proj_out", d.c * d.inner * d.tokens},
                                   {"op_sac.down_proj_out", d.c * d.h * d.tokens, false, true}};
  if (cfg.attention == Attention::kFlash) {
    kept.push_back({"op_sac.sdpa_out", d.c * q});
    kept.push_back({"op_sac.sdpa_lse", 4 * d.heads * d.tokens});
  }
  return kept;
}

// Whether a tensor the un-checkpointed block saves is one of the outputs op-level selective AC
// keeps (or a view of one), so that its recomputation does not allocate it again: SiLU's input is
// gate's output; SDPA saves v_proj's output (a view) and its own output and log-sum-exp, which
// o_proj then saves; eager attention without GQA multiplies by v itself (repeat_kv returns it).
bool KeptByOpCheckpointing(const SavedTensor& t, const FsdpConfig& cfg, const Dims& d) {
  if (t.name == "mlp.gate_out") return true;
  if (cfg.attention == Attention::kFlash) return t.name == "self_attn.v" || t.name == "self_attn.o_proj_in" || t.name == "self_attn.lse";
  return t.name == "self_attn.v_repeated" && d.kv_heads >= d.heads;
}

// What a block's backward has freed of its saved tensors when its softmax's backward runs:
// everything the forward saved after the attention core (the output projection, the second norm,
// the MLP) and the core's tensors other than the softmax's own output (dropout's mask and output;
// Llama's probabilities copy in c, the softmax having run in fp32).
int64_t FreedBeforeSoftmaxBackward(const std::vector<SavedTensor>& block, std::string_view softmax_output) {
  int64_t core = 0, after = 0;
  bool past_core = false;
  for (const SavedTensor& t : block) {
    if (t.attention_core) {
      past_core = true;
      after = 0;
      if (t.name.starts_with("attn_core.") && t.name != softmax_output) core += t.bytes;
    } else if (past_core) {
      after += t.bytes;
    }
  }
  return core + after;
}

// Largest set of gradients alive at once inside a block's backward, beyond its saved tensors:
// the incoming and outgoing hidden-state gradients plus the largest op-level transient. `block`
// is what the block's forward saves (LlamaBlock / Gpt2Block).
int64_t BackwardWorkingBytes(const ModelSpec& m, const FsdpConfig& cfg, const Dims& d, const std::vector<SavedTensor>& block) {
  const int64_t hT = d.h * d.tokens, scores = d.heads * d.seq * d.tokens;
  int64_t attention = 0;
  if (cfg.attention == Attention::kEager && !m.arch.softmax_fp32) {
    // GPT-2's softmax runs in c: the probabilities' gradient and the softmax input's (2 c a s per
    // token) and 3 c h of q/k/v gradients, while the probabilities are still saved. MemTracker on
    // one GPT2Block (transformers 5.24, bf16, 2048 tokens, no dropout): 138.4 MB beyond the saved
    // tensors, the incoming gradient and the weight gradients, as this term gives (docs/memory-model.md).
    attention = 2 * d.c * scores + 3 * d.c * hT - FreedBeforeSoftmaxBackward(block, "attn_core.probs");
  } else if (cfg.attention == Attention::kEager) {
    // Llama's softmax runs in fp32: two fp32 scores-sized gradients (the probabilities' gradient
    // cast up, the softmax input's) while the fp32 softmax output is still saved. MemTracker on a
    // one-layer LlamaModel (transformers 5.24, bf16): 95.4 MB beyond the saved tensors and weight
    // gradients at 2 x 1024 tokens and 246.4 MB at 1 x 2048, as this term (with 2 c h) gives; the
    // earlier constant 4 a s matched the first shape only (docs/memory-model.md).
    attention = 8 * scores - FreedBeforeSoftmaxBackward(block, "attn_core.softmax_fp32");
  } else {
    attention = d.c * (d.heads + 2 * d.kv_heads) * d.head_dim * d.tokens + 4 * d.heads * d.head_dim * d.tokens;
  }
  const int64_t mlp_factor = d.experts > 0 ? d.top_k : 1;
  const int64_t mlp = (m.arch.mlp == MlpKind::kPlain ? 4 : 3) * d.c * d.inner * d.tokens * mlp_factor;
  const int64_t norm = 12 * hT;
  return 2 * d.c * hT + std::max({attention, mlp, norm});
}

}  // namespace

int64_t SumBytes(const std::vector<SavedTensor>& tensors) {
  int64_t total = 0;
  for (const auto& t : tensors) total += t.bytes;
  return total;
}

int64_t BlockActivations::FullBytes() const { return SumBytes(full); }
int64_t BlockActivations::KeptBytes() const { return SumBytes(kept); }
int64_t HeadActivations::SavedBytes() const {
  return SumBytes(embedding) + SumBytes(final_norm) + logits_bytes + loss_saved_bytes;
}

BlockActivations BlockActivationProfile(const ModelSpec& m, const FsdpConfig& cfg) {
  const Dims d = DimsOf(m, cfg);
  BlockActivations a;
  a.full = BlockSaved(m, cfg, d);
  switch (cfg.checkpointing) {
    case Checkpointing::kNone: a.kept = a.full; break;
    case Checkpointing::kSelective:
      for (const auto& t : a.full) (t.attention_core ? a.recomputed : a.kept).push_back(t);
      for (const auto& t : SelectiveCheckpointInputs(m, cfg, d)) a.kept.push_back(t);
      break;
    case Checkpointing::kSelectiveOp:
      a.kept = OpCheckpointKept(cfg, d);
      for (const auto& t : a.full) {
        if (!KeptByOpCheckpointing(t, cfg, d)) a.recomputed.push_back(t);
      }
      break;
    case Checkpointing::kFull:
      // checkpoint_wrapper (non-reentrant) saves only the block's input hidden states.
      a.kept = {{"checkpoint.block_input", d.c * d.h * d.tokens}};
      a.recomputed = a.full;
      break;
  }
  a.backward_working_bytes = BackwardWorkingBytes(m, cfg, d, a.full);
  return a;
}

HeadActivations HeadActivationProfile(const ModelSpec& m, const FsdpConfig& cfg) {
  const Dims d = DimsOf(m, cfg);
  const int64_t vT = m.vocab_size * d.tokens;
  HeadActivations head;
  if (m.embedding_dropout > 0) head.embedding.push_back({"embedding.dropout_mask", d.h * d.tokens});
  // The final norm and lm_head's input (its output). GPT-2's ln_f is counted without the latter,
  // as docs/memory-model.md measured it.
  const std::string_view final_norm = LastComponent(m.arch.names.final_norm);
  if (m.arch.norm == NormKind::kLayer) {
    AddNorm(head.final_norm, m.arch.norm, final_norm, d);
  } else {
    AddNormAndLinearInput(head.final_norm, m.arch.norm, final_norm, d);
  }
  // transformers' ForCausalLMLoss: logits.float() (a copy unless already fp32), cross_entropy =
  // log_softmax (saves its fp32 output) + nll_loss; the compute-dtype logits stay referenced by the
  // model output until backward ends.
  head.logits_bytes = d.c * vT;
  head.loss_saved_bytes = 4 * vT;
  head.loss_forward_transient_bytes = d.c == 4 ? 0 : 4 * vT;
  // nll_loss_backward's dense fp32 gradient + log_softmax_backward's fp32 result.
  head.loss_backward_transient_bytes = 8 * vT;
  return head;
}

}  // namespace fsdp
