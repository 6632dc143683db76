#include "planner/activation_model.h"

#include <algorithm>
#include <array>
#include <initializer_list>
#include <limits>
#include <set>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "core/lora.h"
#include "core/workload.h"

namespace fsdp {
namespace {

// No eager core's forward moment in a block (AddSplitAttention)
constexpr size_t kNoMoment = std::numeric_limits<size_t>::max();

// Whether BlockActivations::forward_moment is modelled for this block's eager core: split q, k,
// v projections with a Llama-style fp32 softmax (Gemma 2's soft-capping too) or gpt-oss's sink
// logits (not GPT-2's fused core, MLA's or attention dropout)
bool EagerCoreMomentModelled(const ModelShape& m) {
  return !m.arch.fused_qkv && !m.mla.enabled() && m.attention_dropout <= 0 && (m.arch.softmax_fp32 || m.attention_sinks);
}

// softmax(x, dtype=float32) of fp16 scores on CUDA fuses the upcast (ATen's SoftMax.cpp, softmax:
// _softmax(half_to_float=true)), so no fp32 copy is made and the backward writes an fp16 input
// gradient; bf16 scores, and fp16 ones on a CPU, are converted to a fp32 copy first.
bool FusesSoftmaxUpcast(const FsdpConfig& cfg) { return cfg.param_dtype == DType::kFp16 && cfg.torch_device == TorchDevice::kCuda; }

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
  bool masked = false;  // SDPA runs with an explicit mask (WindowMasksSdpa)
  bool fused_rms_norm = false;  // torch's nn.RMSNorm on CUDA (--impl torchtitan), not transformers' own
  bool rope_cache_cast = false;  // torchtitan's Qwen3: FSDP2 casts the fp32 rope_cache, an argument of each block
  bool repeats_kv = false;  // torchtitan of January 2025: repeat_kv copies k and v to every head before SDPA
};

// torchtitan 0.2.2's Qwen3 (models/qwen3/model/model.py): a fp32 rope_cache buffer [max_seq_len,
// 2 head_dim] (cos, then sin) that the model passes to every block's forward.
bool TorchtitanQwen3(const ModelShape& m, const FsdpConfig& cfg) { return cfg.impl == Impl::kTorchtitan && m.model_type == "qwen3"; }

Dims DimsOf(const ModelShape& m, const FsdpConfig& cfg, int64_t window = 0) {
  return Dims{cfg.micro_batch * cfg.seq_len, cfg.seq_len, BytesPerElement(cfg.param_dtype), m.hidden_size,
              m.intermediate_size, m.num_heads, m.num_kv_heads, m.head_dim, m.num_experts, m.experts_per_token,
              WindowMasksSdpa(cfg, window), cfg.impl == Impl::kTorchtitan,  // 2025-01's Python RMSNorm saves transformers' set
              TorchtitanQwen3(m, cfg) && BytesPerElement(cfg.param_dtype) != 4,  // to(fp32) of the fp32 cache: itself
              cfg.impl == Impl::kTorchtitan202501};
}

// Interns "<module>.<what>" for the lifetime of the process: SavedTensor names are string_views.
// Static text for a name made at run time (SavedTensor's string_views outlive the model).
std::string_view Interned(std::string_view text) {
  static std::set<std::string, std::less<>> names;
  if (auto it = names.find(text); it != names.end()) return *it;
  return *names.emplace(text).first;
}

std::string_view Name(std::string_view module, std::string_view what) { return Interned(fmt::format("{}.{}", module, what)); }

// Which inputs of a norm need a gradient.
struct NormGrad {
  bool input = true;   // its input requires grad
  bool weight = true;  // its weight is trainable
};

// The block's first parameter-owning module whose path is `name` or ends in "." + `name`, or null.
const ParamOp* FindOp(const ModelShape& m, std::string_view name) {
  for (const ParamOp& op : m.arch.block) {
    if (ModulePathMatches(op.module, name)) return &op;
  }
  return nullptr;
}

// The linear computing a block's q, k or v ("q_proj"), or gate or up ("gate_proj"): its own, or
// the fused projection whose output holds it (Phi-3's qkv_proj, gate_up_proj), or null.
const ParamOp* ProjectionOf(const ModelShape& m, std::string_view name) {
  if (const ParamOp* op = FindOp(m, name)) return op;
  const bool mlp = name == "gate_proj" || name == "up_proj";
  return FindOp(m, mlp ? "gate_up_proj" : "qkv_proj");
}

// A linear's output requires grad whatever its input: its weight is trained or an adapter is.
bool Trains(const ParamOp* op) { return op == nullptr || op->trainable || op->lora_rank > 0; }
// A linear saves its input: for its weight's gradient, or for lora_A's when no dropout copies it.
bool SavesInput(const ParamOp* op) { return op == nullptr || op->trainable || (op->lora_rank > 0 && op->lora_dropout == 0); }

// What peft's LoRA adds for an adapted linear reading `in` features (peft/tuners/lora/layer.py
// Linear.forward: lora_B(lora_A(dropout(x))) * scaling): lora_B saves lora_A's [T, r] output; with
// dropout lora_A saves the dropout's output, and the dropout its mask when x requires grad.
void AddLoraSaved(std::vector<SavedTensor>& out, const ParamOp* op, bool input_requires_grad, const Dims& d) {
  if (op == nullptr || op->lora_rank == 0) return;
  out.push_back({Name(op->module, "lora_A_out"), d.c * op->lora_rank * d.tokens});
  if (op->lora_dropout == 0) return;
  out.push_back({Name(op->module, "lora_dropout_out"), d.c * op->in * d.tokens});
  if (input_requires_grad) out.push_back({Name(op->module, "lora_dropout_mask"), op->in * d.tokens});
}

// The hidden-state norms a block runs, in forward order (core/families/: the attention's, then
// the MLP's), for the names of their saved tensors; q/k norms are the attention's own.
std::vector<std::string_view> BlockNorms(const ModelShape& m) {
  std::vector<std::string_view> norms;
  for (const ParamOp& op : m.arch.block) {
    if (op.kind == ParamOp::Kind::kNorm && !op.qk_norm) norms.push_back(op.module);
  }
  return norms;
}

// What a norm's forward saves. LlamaRMSNorm upcasts to fp32: pow() saves the fp32 input, rsqrt()
// its [T,1] result, weight * x.to(dtype) the normalised input in the compute dtype (for the
// weight's gradient) (saved_tensors_hooks on transformers 5.24: docs/memory-model.md). Native
// LayerNorm saves its input and fp32 mean and rstd.
// Autograd saves an op's input only for the gradients it will compute (torchgen's
// gen_variable_type.py guards each SavedVariable with should_compute_output): RMSNorm's fp32 input
// and rsqrt only when its input requires grad, the normalised input only for a trainable weight;
// LayerNorm's input and statistics when either does. Full training: all of them. An RMSNorm
// that multiplies by its weight in fp32 (Architecture::norm_weight_fp32) saves the normalised
// input in fp32.
// torch's nn.RMSNorm (torchtitan's) on CUDA runs aten::_fused_rms_norm when input and weight
// dtypes match (torch 2.11's rms_norm_symint; FakeTensorMode on a 'cuda' bf16 input shows the
// dispatch), whose FusedRmsNormBackward0 saves the input itself and an fp32 rstd per row
// (derivatives.yaml): no fp32 copy, no normalised input. Both for either gradient.
void AddNorm(std::vector<SavedTensor>& out, const Architecture& a, std::string_view module, const Dims& d, const NormGrad& g = {}) {
  if (d.fused_rms_norm && a.norm == NormKind::kRms) {
    if (!g.input && !g.weight) return;
    out.push_back({Name(module, "in"), d.c * d.h * d.tokens});
    out.push_back({Name(module, "rstd"), 4 * d.tokens});
    return;
  }
  if (a.norm == NormKind::kLayer) {
    if (!g.input && !g.weight) return;
    out.push_back({Name(module, "in"), d.c * d.h * d.tokens});
    out.push_back({Name(module, "stats"), 8 * d.tokens});
    return;
  }
  if (g.input) {
    out.push_back({Name(module, "x_fp32"), 4 * d.h * d.tokens});
    out.push_back({Name(module, "rsqrt"), 4 * d.tokens});
  }
  if (g.weight) out.push_back({Name(module, "x_normalized"), (a.norm_weight_fp32 ? 4 : d.c) * d.h * d.tokens});
}

// A norm followed by the linear(s) that read its output, which save it (once, when several do):
// unless every reader is frozen (a frozen linear needs only its weight for the input's gradient)
// and none has a LoRA adapter reading it undropped.
void AddNormAndLinearInput(std::vector<SavedTensor>& out, const Architecture& a, std::string_view module, const Dims& d, const NormGrad& g = {},
                           bool read_saved = true) {
  AddNorm(out, a, module, d, g);
  if (read_saved) out.push_back({Name(module, "out"), d.c * d.h * d.tokens});
}

// Which tensors of a block's forward require grad, in forward order, from its input's and its
// modules' (Trains). Full training: every one.
struct BlockFlow {
  bool input = true;           // the block's input hidden states
  bool norm1 = true, q = true, k = true, v = true;  // outputs of the first norm and the projections
  bool scores = true;          // q k^T
  bool attn_out = true;        // the attention core's output (SDPA: any of q, k, v)
  bool hidden = true;          // after the attention residual
  bool norm2 = true;
};

// The attention core between the projections. Eager: the softmax's output (HF Llama-style
// eager_attention_forward runs it in fp32 and casts the probabilities back; GPT-2's runs in the
// compute dtype) and dropout's mask and output. SDPA's flash/memory-efficient kernels save a fp32
// log-sum-exp per row beside q, k, v and the output. The softmax saves its output when the scores
// require grad; probs @ v saves the probabilities only for v's gradient.
void AddAttentionCore(std::vector<SavedTensor>& out, const ModelShape& m, const FsdpConfig& cfg, const Dims& d, const BlockFlow& f) {
  const int64_t scores = d.heads * d.seq * d.tokens;  // B * a * s * s
  if (cfg.attention != Attention::kEager) {
    if (f.attn_out) out.push_back({m.arch.fused_qkv ? "attn.lse" : "self_attn.lse", 4 * d.heads * d.tokens});
    return;
  }
  // Gemma 2's soft-capping, cap * tanh(scores / cap), before the softmax: tanh saves its output
  // (for its own backward, which runs after the softmax's: still saved at MarkSoftmaxBackward's moment)
  if (m.attn_logit_softcapping > 0 && f.scores) out.push_back({"self_attn.softcap_tanh", d.c * scores, true});
  if (m.attention_sinks) {
    // gpt-oss: the scores joined by the head's sink logit (torch.cat), less their row maximum
    // (max saves its int64 indices), a softmax in c over s + 1 keys whose output the product
    // with v saves too (the sink's column sliced off: a view)
    if (f.scores) out.push_back({"attn_core.max_indices", 8 * d.heads * d.tokens, true});
    if (f.scores || f.v) out.push_back({"attn_core.probs", d.c * d.heads * (d.seq + 1) * d.tokens, true});
  } else if (m.arch.softmax_fp32) {
    if (f.scores) out.push_back({"attn_core.softmax_fp32", 4 * scores, true});
    if (d.c != 4 && f.v) out.push_back({"attn_core.probs", d.c * scores, true});
  } else if (f.scores || f.v) {
    out.push_back({"attn_core.probs", d.c * scores, true});
  }
  if (m.attention_dropout > 0 && f.scores) {
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
// that same tensor (counted once, as o_proj_in). Eager q k^T saves q for k's gradient and k for
// q's; SDPA saves all of them once any requires grad.
//
// Returns where in `out` an eager core's highest forward moment falls (EagerCoreMoment): before its
// probabilities where the softmax itself is that moment (a bf16 softmax's fp32 copy; a
// sink-joined core's subtraction), else after the core; kNoMoment for SDPA.
size_t AddSplitAttention(std::vector<SavedTensor>& out, const ModelShape& m, const FsdpConfig& cfg, const Dims& d, const BlockFlow& f) {
  const int64_t q = d.heads * d.head_dim * d.tokens, kv = d.kv_heads * d.head_dim * d.tokens;
  const ParamOp* fused_qkv = FindOp(m, "qkv_proj");
  for (const char* name : {"q_proj", "k_proj", "v_proj", "qkv_proj"}) AddLoraSaved(out, FindOp(m, name), f.norm1, d);
  // q_norm / k_norm (before RoPE): as AddNorm's RMSNorm over q's or k's features, its rsqrt one
  // per (token, head) for Qwen3's per-head norms and one per token for OLMo 2's whole-projection
  // ones. torch_reference.py on tests/data/hf_configs/qwen3-100m.json and olmo2-100m.json.
  // torchtitan's nn.RMSNorm q_norm / k_norm save what the fused CUDA kernel saves (AddNorm): the
  // projection's output itself and a fp32 rstd per row.
  for (const ParamOp& op : m.arch.block) {
    if (op.kind != ParamOp::Kind::kNorm || !op.qk_norm) continue;
    const bool is_k = op.module.find("k_norm") != std::string::npos;
    const int64_t features = is_k ? kv : q, rows = (op.head_norm ? (is_k ? d.kv_heads : d.heads) : 1) * d.tokens;
    if (d.fused_rms_norm) {
      if ((is_k ? f.k : f.q) || op.trainable) {
        out.push_back({Name(op.module, "in"), d.c * features});
        out.push_back({Name(op.module, "rstd"), 4 * rows});
      }
      continue;
    }
    if (is_k ? f.k : f.q) {
      out.push_back({Name(op.module, "x_fp32"), 4 * features});
      out.push_back({Name(op.module, "rsqrt"), 4 * rows});
    }
    if (op.trainable) out.push_back({Name(op.module, "x_normalized"), (m.arch.norm_weight_fp32 ? 4 : d.c) * features});
  }
  // Llama 4's RoPE layers: a weightless L2 norm over each head's q and k (Llama4TextL2Norm:
  // x.float() saved by pow and the product, rsqrt's result per head); its NoPE layers scale q by
  // a fp32 factor per position (saved by the product, one per position of the micro-batch)
  if (m.qk_l2_norm && !m.nope) {
    if (f.q) {
      out.push_back({"self_attn.q_l2_fp32", 4 * q});
      out.push_back({"self_attn.q_l2_rsqrt", 4 * d.heads * d.tokens});
    }
    if (f.k) {
      out.push_back({"self_attn.k_l2_fp32", 4 * kv});
      out.push_back({"self_attn.k_l2_rsqrt", 4 * d.kv_heads * d.tokens});
    }
  }
  if (m.nope && m.nope_temperature_tuning && f.q) out.push_back({"self_attn.attn_scales", 4 * d.seq});
  const bool eager = cfg.attention == Attention::kEager;
  size_t moment_at = kNoMoment;
  if (eager ? f.k : f.attn_out) out.push_back({"self_attn.q_rope", d.c * q});
  if (eager) {
    const bool gqa = d.kv_heads < d.heads;
    if (f.q) out.push_back({"self_attn.k_repeated", d.c * q, gqa});
    if (f.scores) out.push_back({"self_attn.v_repeated", d.c * q, gqa});
    const size_t core_begin = out.size();
    AddAttentionCore(out, m, cfg, d, f);
    // The core's kept tensors made after its forward moment (EagerCoreMoment): in 16 bits the
    // probabilities cast back from the fp32 softmax, which is made at the moment; in fp32 the
    // softmax itself, which `softmax(scores, dtype=float32)` writes from the masked scores with
    // no copy (the moment is the product and its scaled copy)
    moment_at = out.size();
    for (size_t i = core_begin; i < out.size(); ++i) {
      const bool made_after = d.c == 4 && !m.attention_sinks ? out[i].name == "attn_core.softmax_fp32" : out[i].name == "attn_core.probs";
      if (made_after) moment_at = i;
    }
  } else if (f.attn_out && d.masked) {
    // With a mask transformers' use_gqa_in_sdpa is false: repeat_kv expands k and v to every head
    // (with as many kv heads as heads it returns them), and SDPA converts the boolean mask into
    // one of the compute dtype per call (convert_boolean_attn_mask), which the kernel (CUDA's
    // memory-efficient one: flash takes no mask) saves as its attn_bias. Inside the attention
    // function: recomputed by selective checkpointing. Measured on the CPU, gemma3-text-100m.json.
    const bool gqa = d.kv_heads < d.heads;
    out.push_back({"self_attn.k_rope", d.c * q, gqa});
    out.push_back({"self_attn.v", d.c * (gqa ? q : fused_qkv != nullptr ? q + 2 * kv : kv), gqa});
    out.push_back({"self_attn.sdpa_mask", d.c * d.tokens * d.seq, true});
    AddAttentionCore(out, m, cfg, d, f);
  } else if (f.attn_out && d.repeats_kv && d.kv_heads < d.heads) {
    // torchtitan's Attention of January 2025 (models/llama/model.py, commit d4c86e3): repeat_kv
    // (expand, then reshape: a copy) gives SDPA k and v of every head, which it saves; v's
    // projection output is read by that copy only. Enable_gqa replaced it in 0.2.2.
    out.push_back({"self_attn.k_repeated", d.c * q});
    out.push_back({"self_attn.v_repeated", d.c * q});
    AddAttentionCore(out, m, cfg, d, f);
  } else if (f.attn_out) {
    // v's projection runs before RoPE: made before q after RoPE (the last tensor), then k
    // (Gemma 3: before q_norm's and k_norm's tensors too)
    auto v_at = out.end() - 1;
    if (m.arch.qk_norms_after_projections) {
      v_at = std::find_if(out.begin(), out.end(), [](const SavedTensor& t) {
        return t.name.starts_with("self_attn.q_norm.") || t.name.starts_with("self_attn.k_norm.");
      });
    }
    out.insert(v_at, {"self_attn.v", d.c * (fused_qkv != nullptr ? q + 2 * kv : kv)});
    out.push_back({"self_attn.k_rope", d.c * kv});
    // v as a view of its projection's output: a fused qkv_proj's keeps all of q, k and v alive.
    // RoPE's output from a slice of that output (not dense) is contiguous as [B, a, s, d], and
    // the flash kernels allocate their output like q (empty_like in mha_fwd on CUDA, the CPU
    // kernel the same), so HF's transpose(1, 2).contiguous() copies it for o_proj: SDPA's own
    // output stays saved beside o_proj's input (measured on the CPU: phi3-100m.json).
    if (fused_qkv != nullptr) out.push_back({"self_attn.sdpa_out", d.c * q});
    AddAttentionCore(out, m, cfg, d, f);
  }
  const ParamOp* o = FindOp(m, "o_proj");
  if ((!eager && f.attn_out) || SavesInput(o)) out.push_back({"self_attn.o_proj_in", d.c * q});
  AddLoraSaved(out, o, f.attn_out, d);
  return moment_at;
}

// DeepSeek's multi-head latent attention (DeepseekV3Attention, ModelShape::mla). q_a_proj and
// kv_a_proj_with_mqa read the normed hidden states (saved by the caller); each latent's RMSNorm
// saves as AddNorm does over the latent's width, and q_b_proj / kv_b_proj save that norm's
// output. RoPE runs on slices whose results are copied into new q and k tensors of qk_head_dim
// per head (torch.cat; new_empty + copy_), saving only the shared cos and sin; the values are a
// view of kv_b_proj's output. Eager: q k^T saves q and k, probs @ v a contiguous copy of the
// values (matmul's of the strided view), the softmax core as Llama's, o_proj its input.
// saved_tensors_hooks on a bf16 DeepseekV3DecoderLayer (transformers 5.24, deepseek-v3-tiny.json).
// SDPA: q's and k's head dim differs from v's, which rules out the flash kernel
// (sdp_utils.cpp, check_head_dim_size_flash); CUDA runs the memory-efficient one, which saves
// q, k, v (the view: all of kv_b_proj's output), its output (o_proj's input, the same tensor)
// and a fp32 log-sum-exp per row. The CPU runs SDPA's math fallback for such shapes, so these
// SDPA entries follow the kernel's code and are not measured here.
void AddLatentAttention(std::vector<SavedTensor>& out, const ModelShape& m, const FsdpConfig& cfg, const Dims& d, const BlockFlow& f) {
  const LatentAttention& a = m.mla;
  const int64_t qk = d.heads * d.head_dim * d.tokens, v = d.heads * a.v_head_dim * d.tokens;
  auto latent = [&](std::string_view norm, std::string_view reader, int64_t width, bool input_rg) {
    const ParamOp* op = FindOp(m, norm);
    const int64_t features = width * d.tokens;
    if (input_rg) {
      out.push_back({Name(norm, "x_fp32"), 4 * features});
      out.push_back({Name(norm, "rsqrt"), 4 * d.tokens});
    }
    if (op == nullptr || op->trainable) out.push_back({Name(norm, "x_normalized"), (m.arch.norm_weight_fp32 ? 4 : d.c) * features});
    if (SavesInput(FindOp(m, reader))) out.push_back({Name(norm, "out"), d.c * features});
  };
  // peft's adapters on the projections: those reading the normed hidden states, then those
  // reading a latent's norm (whose output requires grad when anything before it trains)
  for (const char* reader : {"q_proj", "q_a_proj", "kv_a_proj_with_mqa"}) AddLoraSaved(out, FindOp(m, reader), f.norm1, d);
  auto latent_rg = [&](const char* projection, const char* norm) {
    const ParamOp* n = FindOp(m, norm);
    return f.norm1 || Trains(FindOp(m, projection)) || (n != nullptr && n->trainable);
  };
  if (a.q_lora_rank > 0) {
    latent("q_a_layernorm", "q_b_proj", a.q_lora_rank, f.norm1 || Trains(FindOp(m, "q_a_proj")));
    AddLoraSaved(out, FindOp(m, "q_b_proj"), latent_rg("q_a_proj", "q_a_layernorm"), d);
  }
  latent("kv_a_layernorm", "kv_b_proj", a.kv_lora_rank, f.norm1 || Trains(FindOp(m, "kv_a_proj_with_mqa")));
  AddLoraSaved(out, FindOp(m, "kv_b_proj"), latent_rg("kv_a_proj_with_mqa", "kv_a_layernorm"), d);
  if (cfg.attention == Attention::kEager) {
    if (f.k) out.push_back({"self_attn.q", d.c * qk});
    if (f.q) out.push_back({"self_attn.k", d.c * qk});
    if (f.scores) out.push_back({"self_attn.v_contiguous", d.c * v, true});
    AddAttentionCore(out, m, cfg, d, f);
  } else if (f.attn_out) {
    out.push_back({"self_attn.q", d.c * qk});
    out.push_back({"self_attn.k", d.c * qk});
    out.push_back({"self_attn.kv_b_out", d.c * d.heads * (a.qk_nope_head_dim + a.v_head_dim) * d.tokens});
    AddAttentionCore(out, m, cfg, d, f);
  }
  const ParamOp* o = FindOp(m, "o_proj");
  if ((cfg.attention != Attention::kEager && f.attn_out) || SavesInput(o)) out.push_back({"self_attn.o_proj_in", d.c * v});
  AddLoraSaved(out, o, f.attn_out, d);
}

// One fused q/k/v projection (GPT-2's c_attn) without RoPE: q, k and v are views of its output,
// which stays saved.
void AddFusedAttention(std::vector<SavedTensor>& out, const ModelShape& m, const FsdpConfig& cfg, const Dims& d, const BlockFlow& f) {
  AddLoraSaved(out, FindOp(m, "attn.c_attn"), f.norm1, d);
  if (f.scores) out.push_back({"attn.qkv", d.c * (d.heads + 2 * d.kv_heads) * d.head_dim * d.tokens});
  AddAttentionCore(out, m, cfg, d, f);
  const ParamOp* proj = FindOp(m, "attn.c_proj");
  if (SavesInput(proj)) out.push_back({"attn.c_proj_in", d.c * d.h * d.tokens});
  AddLoraSaved(out, proj, f.attn_out, d);
}

// The block's router (ParamOp::Kind::kRouter), or null.
const ParamOp* RouterOf(const ModelShape& m) {
  for (const ParamOp& op : m.arch.block) {
    if (op.kind == ParamOp::Kind::kRouter) return &op;
  }
  return nullptr;
}

// Whether the routed experts' projections have biases (gpt-oss): their gathers by the sorted
// expert ids save those ids.
bool ExpertsBiased(const ModelShape& m) {
  const ParamOp* experts = FindOp(m, "experts.gate_up_proj");
  return experts != nullptr && experts->bias;
}

// Bytes of each (token, expert) pair's routing weight as the experts' outputs are weighed by it:
// fp32 (Mixtral's, DeepSeek-V3's), or the compute dtype (gpt-oss's softmax in it; Qwen3-MoE's cast).
int64_t PairWeightBytes(const ModelShape& m, const Dims& d) {
  if (m.router == ModelShape::Router::kTopKThenSoftmax) return d.c;
  if (m.router == ModelShape::Router::kSoftmaxThenTopK && m.router_weights_in_compute_dtype) return d.c;
  return 4;
}

// norm_topk_prob's in-place division of the fp32 top-k weights by their sum (Qwen3MoeTopKRouter,
// MixtralTopKRouter, DeepseekV3MoE.route_tokens_to_experts): DivBackward0 saves the denominator
// and, the division being in place, a copy of the weights it overwrites (autograd's original_self),
// allocated in that order.
void AddTopKNormalisation(std::vector<SavedTensor>& out, const ModelShape& m, const Dims& d) {
  if (!m.router_norm_topk) return;
  out.push_back({"moe.topk_denominator", 4 * d.tokens});
  out.push_back({"moe.topk_weights", 4 * d.top_k * d.tokens});
}

// DeepSeek-V3's router (DeepseekV3TopkRouter.forward): F.linear on fp32 copies of the input and
// of the weight (each saved for the other's gradient), sigmoid's output, topk's int64 indices of
// the best two scores of every group and of the kept groups, the bool mask of the kept groups'
// experts (masked_fill), the top-k indices, and for norm_topk_prob the denominator and the
// weights the in-place division saves. saved_tensors_hooks on deepseek-v3-tiny.json's routed layer.
void AddGroupedSigmoidRouter(std::vector<SavedTensor>& out, const ModelShape& m, const Dims& d) {
  const int64_t pairs = d.top_k * d.tokens;
  if (SavesInput(RouterOf(m))) out.push_back({"moe.router_in_fp32", 4 * d.h * d.tokens});
  out.push_back({"moe.router_weight_fp32", 4 * d.experts * d.h});
  out.push_back({"moe.sigmoid_out", 4 * d.experts * d.tokens});
  out.push_back({"moe.group_top2_indices", 8 * 2 * m.expert_groups * d.tokens});
  out.push_back({"moe.kept_group_indices", 8 * m.expert_groups_kept * d.tokens});
  out.push_back({"moe.group_mask", d.experts * d.tokens});
  out.push_back({"moe.topk_indices", 8 * pairs});
  AddTopKNormalisation(out, m, d);
}

// Whether the routed experts' first and last projections train: their matmuls (grouped_mm, bmm,
// a linear per expert) save their inputs only for the weights' gradients, so frozen experts
// (LoRA's base) save neither the gathered tokens nor down's input.
struct ExpertWeights {
  bool gate_up_trains = true, down_trains = true;
};
ExpertWeights ExpertWeightsOf(const ModelShape& m) {
  const ParamOp *first = nullptr, *last = nullptr;
  for (const ParamOp& op : m.arch.block) {
    if (op.experts == 0 || op.kind != ParamOp::Kind::kLinear) continue;
    if (first == nullptr) first = &op;
    last = &op;
  }
  return {first == nullptr || first->trainable, last == nullptr || last->trainable};
}

// A SwiGLU MLP reading `input_rg` hidden states, `x` bytes per inner tensor: gate's output (SiLU's
// input), SiLU's output, up's output and down's input, with peft's adapters; a fused gate_up
// projection's output one tensor of 2x, as the allocator gets it. Under LoRA SiLU saves
// its input when gate's output requires grad, act * up saves each factor for the other's gradient,
// down saves its input as any linear (SavesInput).
void AddSwiGlu(std::vector<SavedTensor>& out, std::string_view prefix, const ParamOp* gate, const ParamOp* up, const ParamOp* down, int64_t x,
               bool input_rg, const Dims& d) {
  AddLoraSaved(out, gate, input_rg, d);
  if (up != gate) AddLoraSaved(out, up, input_rg, d);
  const bool gate_rg = input_rg || Trains(gate), up_rg = input_rg || Trains(up);
  if (up == gate) {  // Phi-3's gate_up_proj: SiLU and the product save views of its one output
    if (gate_rg) out.push_back({Name(prefix, "gate_up_out"), 2 * x});
    if (up_rg) out.push_back({Name(prefix, "act_out"), x});
  } else {
    if (gate_rg) out.push_back({Name(prefix, "gate_out"), x});
    if (up_rg) out.push_back({Name(prefix, "act_out"), x});
    if (gate_rg) out.push_back({Name(prefix, "up_out"), x});
  }
  if (SavesInput(down)) out.push_back({Name(prefix, "down_in"), x});
  AddLoraSaved(out, down, gate_rg || up_rg, d);
}

// A shared expert every token runs beside the routed ones (DeepSeek's shared_experts, Llama 4's
// shared_expert): a SwiGLU MLP over its width, reading the normed hidden states.
void AddSharedExpert(std::vector<SavedTensor>& out, const ModelShape& m, const Dims& d, bool input_rg) {
  for (const char* module : {"shared_experts", "shared_expert"}) {
    const std::string name(module);
    const ParamOp* gate = FindOp(m, name + ".gate_proj");
    if (gate == nullptr) continue;
    AddSwiGlu(out, "moe.shared", gate, FindOp(m, name + ".up_proj"), FindOp(m, name + ".down_proj"), d.c * gate->out * d.tokens, input_rg, d);
    return;
  }
}

// transformers' Llama4TextMoe: every token to every expert. The tokens repeated once per expert
// and the column of scores they are multiplied by (each saved for the other's gradient), that
// product (bmm's input), gate_up's output (SiLU and the product save its halves), the
// activation and the product (down's bmm input): E rows per token, whatever top-k is.
// saved_tensors_hooks on tests/data/hf_configs/llama4-text-tiny.json (transformers 5.24).
void AddDenseDispatchExperts(std::vector<SavedTensor>& out, const ModelShape& m, const Dims& d, bool input_rg) {
  const int64_t rows = d.experts * d.tokens;
  const ExpertWeights w = ExpertWeightsOf(m);
  out.push_back({"moe.scores_column", d.c * rows});
  out.push_back({"moe.tokens_repeated", d.c * d.h * rows});
  if (w.gate_up_trains) out.push_back({"moe.expert_in", d.c * d.h * rows});
  out.push_back({"moe.gate_up_out", 2 * d.c * d.inner * rows});
  out.push_back({"moe.act_out", d.c * d.inner * rows});
  if (w.down_trains) out.push_back({"moe.down_in", d.c * d.inner * rows});
  AddSharedExpert(out, m, d, input_rg);
}

// The MLP after its norm. Gated (SwiGLU): gate's output (SiLU's input), SiLU's output, up's output
// and down's input. Routed experts (MixtralSparseMoeBlock): router logits, fp32 routing softmax,
// then for each of the top_k (token, expert) pairs the gathered input, w1/act/w3/product and w2's
// output. Plain (GPT-2's fc + activation + proj): the activation's saved tensors (transformers'
// NewGELUActivation is written in Python and saves input, tanh, 0.5*x and 1+tanh) and proj's input.
// Gated under LoRA: SiLU saves its input when gate's output requires grad, act * up saves each
// factor for the other's gradient, down saves its input as any linear (SavesInput).
void AddMlp(std::vector<SavedTensor>& out, const ModelShape& m, const Dims& d, const BlockFlow& f) {
  const int64_t x = d.c * d.inner * d.tokens;
  switch (m.arch.mlp) {
    case MlpKind::kGated:
      // Phi-3's gate_up_proj: gate and up are halves of its output, which SiLU and the product save
      // between them (the same bytes as the two outputs)
      AddSwiGlu(out, "mlp", ProjectionOf(m, "gate_proj"), ProjectionOf(m, "up_proj"), FindOp(m, "down_proj"), x, f.norm2, d);
      return;
    case MlpKind::kMoe: {
      // transformers 5.24's routed experts: the router (Qwen3MoeTopKRouter, MixtralTopKRouter)
      // saves its fp32 softmax and the top-k indices; integrations/moe.py's
      // grouped_mm_experts_forward (the default on CUDA and on the CPU) then, per routed (token,
      // expert) pair: the gathered input (its grouped_mm's), gate_up's output (SiLU saves its gate
      // half, the product its up half), the activation, the product (down's input), down's output
      // with the pair's routing weight (their product's; fp32, or the compute dtype Qwen3-MoE casts
      // it to), and three int64 index vectors (perm, perm // top_k and inv_perm, each saved by the
      // gather it drives).
      const int64_t pairs = d.top_k * d.tokens;
      const int64_t weight_bytes = PairWeightBytes(m, d);
      switch (m.router) {
        case ModelShape::Router::kSoftmaxThenTopK:
          out.push_back({"moe.routing_fp32", 4 * d.experts * d.tokens});
          out.push_back({"moe.topk_indices", 8 * pairs});
          AddTopKNormalisation(out, m, d);
          break;
        case ModelShape::Router::kTopKThenSoftmax:  // GptOssTopKRouter: topk's indices, softmax's output in c
          out.push_back({"moe.topk_indices", 8 * pairs});
          out.push_back({"moe.topk_softmax", d.c * pairs});
          break;
        case ModelShape::Router::kGroupedSigmoid: AddGroupedSigmoidRouter(out, m, d); break;
        case ModelShape::Router::kTopKThenSigmoid:  // Llama4Router: topk's indices (scatter's too), the fp32 sigmoid over every expert
          out.push_back({"moe.topk_indices", 8 * pairs});
          out.push_back({"moe.sigmoid_fp32", 4 * d.experts * d.tokens});
          break;
      }
      if (m.arch.experts_dense_dispatch) {
        AddDenseDispatchExperts(out, m, d, f.norm2);
        return;
      }
      // in grouped_mm_experts_forward's order, one tensor each: sort's perm (the pair weights'
      // gather saves it), perm // top_k (the tokens' gather's), the gathered tokens and pair
      // weights, with expert biases the sorted expert ids (the biases' gathers'), ..., inv_perm
      const ExpertWeights w = ExpertWeightsOf(m);
      out.push_back({"moe.perm", 8 * pairs});
      out.push_back({"moe.perm_token", 8 * pairs});
      if (w.gate_up_trains) out.push_back({"moe.expert_in", d.c * d.h * pairs});
      out.push_back({"moe.pair_weights", weight_bytes * pairs});
      if (ExpertsBiased(m)) out.push_back({"moe.expert_ids", 8 * pairs});
      out.push_back({"moe.gate_up_out", 2 * d.c * d.inner * pairs});
      if (m.arch.experts_clamped_swiglu) {
        // gpt-oss's _apply_gate on gate_up's strided halves: the clamped gate, sigmoid's output,
        // their product, the shifted clamped up, and the product down's input (clamp saves its
        // input: gate_up's output again)
        out.push_back({"moe.clamped_swiglu", 4 * d.c * d.inner * pairs});
      } else {
        out.push_back({"moe.act_out", d.c * d.inner * pairs});
      }
      if (w.down_trains) out.push_back({"moe.down_in", d.c * d.inner * pairs});
      out.push_back({"moe.down_out", d.c * d.h * pairs});
      out.push_back({"moe.inv_perm", 8 * pairs});
      AddSharedExpert(out, m, d, f.norm2);
      return;
    }
    case MlpKind::kPlain: {
      const ParamOp *fc = FindOp(m, "mlp.c_fc"), *proj = FindOp(m, "mlp.c_proj");
      AddLoraSaved(out, fc, f.norm2, d);
      const bool fc_rg = f.norm2 || Trains(fc);
      if (fc_rg) out.push_back({m.activation == "gelu_new" ? "mlp.gelu_new_saved" : "mlp.act_in", m.activation == "gelu_new" ? 4 * x : x});
      if (SavesInput(proj)) out.push_back({"mlp.c_proj_in", x});
      AddLoraSaved(out, proj, fc_rg, d);
      return;
    }
  }
}

// Which of BlockNorms' entries sits where (-1: none), by Architecture::norm_placement: before
// the attention and the MLP (their input norms), on their outputs (before the residual adds).
struct NormRoles {
  int pre_attn = -1, post_attn = -1, pre_mlp = -1, post_mlp = -1;
};

NormRoles RolesOf(NormPlacement placement) {
  switch (placement) {
    case NormPlacement::kPre: return {0, -1, 1, -1};
    case NormPlacement::kPost: return {-1, 0, -1, 1};
    case NormPlacement::kSandwich: return {0, 1, 2, 3};
  }
  return {};
}

// The grad flow through a block from its input's.
BlockFlow FlowOf(const ModelShape& m, bool input_requires_grad) {
  BlockFlow f;
  const std::vector<std::string_view> norms = BlockNorms(m);
  const NormRoles roles = RolesOf(m.arch.norm_placement);
  auto norm_trains = [&](int i) {  // a norm the block lacks adds nothing
    if (i < 0) return false;
    const ParamOp* op = static_cast<size_t>(i) < norms.size() ? FindOp(m, norms[i]) : nullptr;
    return op == nullptr || op->trainable;
  };
  f.input = input_requires_grad;
  f.norm1 = f.input || norm_trains(roles.pre_attn);  // what the projections read
  if (m.arch.fused_qkv) {
    f.q = f.k = f.v = f.norm1 || Trains(FindOp(m, "c_attn"));
  } else if (m.mla.enabled()) {
    // q through q_a_proj and q_b_proj (or one q_proj), k and v both through kv_a_proj_with_mqa and kv_b_proj
    const ParamOp* q_proj = FindOp(m, "q_proj");
    f.q = f.norm1 || (q_proj != nullptr ? Trains(q_proj) : Trains(FindOp(m, "q_a_proj")) || Trains(FindOp(m, "q_b_proj")));
    f.k = f.v = f.norm1 || Trains(FindOp(m, "kv_a_proj_with_mqa")) || Trains(FindOp(m, "kv_b_proj"));
  } else {
    f.q = f.norm1 || Trains(ProjectionOf(m, "q_proj"));
    f.k = f.norm1 || Trains(ProjectionOf(m, "k_proj"));
    f.v = f.norm1 || Trains(ProjectionOf(m, "v_proj"));
  }
  f.scores = f.q || f.k;
  f.attn_out = f.scores || f.v;
  f.hidden = f.input || f.attn_out || Trains(FindOp(m, m.arch.fused_qkv ? "attn.c_proj" : "o_proj")) || norm_trains(roles.post_attn);
  f.norm2 = f.hidden || norm_trains(roles.pre_mlp);
  return f;
}

// A decoder block: [norm], attention, [norm], residual (dropout), [norm], MLP, [norm], residual
// (dropout), its norms where Architecture::norm_placement puts them. A norm before a sub-layer
// saves its output for the sub-layer's linears; without one the linears save the hidden states
// themselves. A norm after a sub-layer reads the sub-layer's output. Residual dropout saves a bool
// mask of the hidden states.
std::vector<SavedTensor> BlockSaved(const ModelShape& m, const FsdpConfig& cfg, const Dims& d, bool input_requires_grad) {
  const std::vector<std::string_view> norms = BlockNorms(m);
  const NormRoles roles = RolesOf(m.arch.norm_placement);
  const BlockFlow f = FlowOf(m, input_requires_grad);
  auto norm_weight = [&](int i) { const ParamOp* op = FindOp(m, norms.at(i)); return op == nullptr || op->trainable; };
  auto reads_saved = [&](std::initializer_list<const char*> readers) {  // those of them the block has
    for (const char* r : readers) {
      const ParamOp* op = FindOp(m, r);
      if (op != nullptr && SavesInput(op)) return true;
    }
    return false;
  };
  // the input a sub-layer's linears save: its norm's output, or the hidden states
  auto add_sublayer_input = [&](std::vector<SavedTensor>& out, int norm, bool norm_input_rg, bool saved, std::string_view hidden_name) {
    if (norm >= 0) {
      AddNormAndLinearInput(out, m.arch, norms.at(norm), d, {norm_input_rg, norm_weight(norm)}, saved);
    } else if (saved) {
      out.push_back({hidden_name, d.c * d.h * d.tokens});
    }
  };
  const bool attention_input_saved = m.arch.fused_qkv ? reads_saved({"attn.c_attn"})
                                                      : reads_saved({"q_proj", "k_proj", "v_proj", "qkv_proj", "q_a_proj", "kv_a_proj_with_mqa"});
  // a routed MLP: the router saves it for its weight's gradient (DeepSeek's a fp32 copy instead),
  // and a shared expert's gate and up for theirs; the experts' gather saves only indices
  const ParamOp* router = RouterOf(m);
  const bool mlp_input_saved = m.arch.mlp == MlpKind::kGated ? reads_saved({"gate_proj", "up_proj", "gate_up_proj"})
                               : m.arch.mlp == MlpKind::kPlain ? reads_saved({"mlp.c_fc"})
                                                               : (m.router != ModelShape::Router::kGroupedSigmoid && SavesInput(router)) ||
                                                                     reads_saved({"shared_experts.gate_proj", "shared_experts.up_proj",
                                                                                  "shared_expert.gate_proj", "shared_expert.up_proj"});
  std::vector<SavedTensor> out;
  // which module's backward releases each tensor: a norm's own, down's input its projection's,
  // the rest the sub-layer's that reads it (a norm's output: the sub-layer's linears')
  const std::string_view mlp_output = Interned(m.arch.mlp_output);
  auto within = [](std::string_view name, std::string_view module) {  // "module.<what>"
    return name.size() > module.size() && name.starts_with(module) && name[module.size()] == '.';
  };
  auto tag_releases = [&](size_t begin, const std::string& reader_module) {
    const std::string_view reader = Interned(reader_module);
    for (size_t i = begin; i < out.size(); ++i) {
      SavedTensor& t = out[i];
      if (t.block_argument || !t.freed_after.empty()) continue;
      t.freed_after = reader;
      if (t.name == "mlp.down_in" || t.name == "mlp.c_proj_in" || within(t.name, mlp_output)) t.freed_after = mlp_output;
      for (std::string_view norm : norms) {
        if (within(t.name, norm) && !t.name.ends_with(".out")) t.freed_after = Interned(norm);
      }
    }
  };
  add_sublayer_input(out, roles.pre_attn, f.input, attention_input_saved, "block.input");
  if (d.fused_rms_norm && roles.pre_attn >= 0 && !out.empty() && out.front().name == Name(norms.at(roles.pre_attn), "in")) {
    out.front().is_block_input = true;
  }
  // torchtitan's Qwen3 passes its fp32 rope_cache [seq, 2 head_dim] to each block, whose FSDP2
  // pre-forward casts floating-point arguments to the param dtype (MixedPrecisionPolicy's
  // cast_forward_inputs): a copy per block, held as the checkpoint's input or, un-checkpointed,
  // through the cos and sin views RoPE's products save (its own .to() is then a no-op). Measured:
  // 1 MiB a block more under --ac full at seq 2048 (tools/torchtitan_memory.py --family qwen3).
  if (d.rope_cache_cast) {
    out.push_back({"block.rope_cache_cast", d.c * d.seq * 2 * d.head_dim});
    out.back().block_argument = true;
  }
  size_t moment_at = kNoMoment;
  if (m.arch.fused_qkv) {
    AddFusedAttention(out, m, cfg, d, f);
  } else if (m.mla.enabled()) {
    AddLatentAttention(out, m, cfg, d, f);
  } else {
    moment_at = AddSplitAttention(out, m, cfg, d, f);
  }
  if (roles.post_attn >= 0) AddNorm(out, m.arch, norms.at(roles.post_attn), d, {f.attn_out || Trains(FindOp(m, "o_proj")), norm_weight(roles.post_attn)});
  if (m.residual_dropout > 0) out.push_back({"attn.resid_dropout_mask", d.h * d.tokens});
  tag_releases(0, m.arch.attention_module);
  const size_t mlp_begin = out.size();
  add_sublayer_input(out, roles.pre_mlp, f.hidden, mlp_input_saved, "mlp.input");
  AddMlp(out, m, d, f);
  if (roles.post_mlp >= 0) AddNorm(out, m.arch, norms.at(roles.post_mlp), d, {f.norm2 || Trains(FindOp(m, "down_proj")), norm_weight(roles.post_mlp)});
  if (m.residual_dropout > 0) out.push_back({"mlp.dropout_mask", d.h * d.tokens});
  tag_releases(mlp_begin, m.arch.mlp_module);
  for (size_t i = mlp_begin; i < out.size(); ++i) out[i].mlp_sublayer = true;
  if (EagerCoreMomentModelled(m)) {
    for (size_t i = moment_at; i < out.size(); ++i) out[i].after_forward_moment = true;
  }
  return out;
}

// What selective checkpointing keeps beyond the un-recomputed tensors: the checkpointed attention
// function's inputs stay referenced until its recomputation. q (after RoPE) is saved anyway; with
// GQA k and v are kept at kv-head width where the matmuls would have saved their expansions.
// GPT-2's q/k/v are views of c_attn's output, which stays saved; so do MLA's values of
// kv_b_proj's.
std::vector<SavedTensor> SelectiveCheckpointInputs(const ModelShape& m, const FsdpConfig& cfg, const Dims& d) {
  // MLA's values: a view of kv_b_proj's output, which eager attention copies inside the function
  if (m.mla.enabled()) {
    if (cfg.attention != Attention::kEager) return {};
    return {{"attn_core.kv_b_out", d.c * d.heads * (m.mla.qk_nope_head_dim + m.mla.v_head_dim) * d.tokens}};
  }
  if (m.arch.fused_qkv || (cfg.attention != Attention::kEager && !d.masked) || d.kv_heads >= d.heads) return {};
  const int64_t kv = d.kv_heads * d.head_dim * d.tokens;
  return {{"attn_core.k_input", d.c * kv}, {"attn_core.v_input", d.c * kv}};
}

// What the recomputed attention function copies under --ac selective, beside the inputs the
// checkpoint holds: torch.matmul's contiguous copies of q (for q k^T) and, without GQA (repeat_kv
// returns k and v themselves), of k and v, when they arrive as transposed views
// (Architecture::qkv_transposed_views) and the micro-batch has more than one sequence (one merges
// batch and heads in a view). Un-checkpointed, the copies are what the matmuls save and the views
// die: the same bytes as q_rope, k_repeated and v_repeated. tools/peak_trace.py: OLMo 2 (GQA,
// 2 x 1024) recomputes q's copy; Llama (MHA, 1 x 2048) none.
std::vector<SavedTensor> MatmulCopies(const ModelShape& m, const FsdpConfig& cfg, const Dims& d, const std::vector<SavedTensor>& full) {
  std::vector<SavedTensor> copies;
  if (cfg.attention != Attention::kEager || m.arch.fused_qkv || m.mla.enabled() || !m.arch.qkv_transposed_views || cfg.micro_batch < 2) return copies;
  const bool mha = d.kv_heads >= d.heads;
  for (const SavedTensor& t : full) {
    if (t.name == "self_attn.q_rope") copies.push_back({"attn_core.q_copy", t.bytes, true});
    if (mha && t.name == "self_attn.k_repeated") copies.push_back({"attn_core.k_copy", t.bytes, true});
    if (mha && t.name == "self_attn.v_repeated") copies.push_back({"attn_core.v_copy", t.bytes, true, false, true});
  }
  return copies;
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
// By the softmax's backward v's and gate's are gone too (SiLU's backward and probs @ v's have run:
// tools/peak_trace.py on the 2k-vocabulary op-SAC row, which still holds down's there).
// torchtitan's Qwen3: q_norm's fused kernel saves q's output, which then stays until its backward.
std::vector<SavedTensor> OpCheckpointKept(const FsdpConfig& cfg, const Dims& d, bool q_norm_saves_q) {
  const int64_t q = d.heads * d.head_dim * d.tokens, kv = d.kv_heads * d.head_dim * d.tokens;
  const bool v_copied = (cfg.attention == Attention::kEager || d.repeats_kv) && d.kv_heads < d.heads;
  std::vector<SavedTensor> kept = {{"checkpoint.block_input", d.c * d.h * d.tokens},
                                   {"op_sac.q_proj_out", d.c * q, false, !q_norm_saves_q},
                                   {"op_sac.v_proj_out", d.c * kv, false, v_copied, true},
                                   {"op_sac.gate_proj_out", d.c * d.inner * d.tokens, false, false, true},
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
  if (t.name == "mlp.gate_out" || t.name == "self_attn.q_norm.in") return true;  // (the fused q_norm's input: q's output)
  if (cfg.attention == Attention::kFlash) return t.name == "self_attn.v" || t.name == "self_attn.o_proj_in" || t.name == "self_attn.lse";
  return t.name == "self_attn.v_repeated" && d.kv_heads >= d.heads;
}

// probs @ v's own copy of v: repeat_kv's expansion, or MLA's contiguous values.
bool IsValueCopy(const SavedTensor& t) { return t.name == "self_attn.v_repeated" || t.name == "self_attn.v_contiguous"; }

// What a block's backward has released of its saved tensors when its softmax's backward runs:
// everything the forward saved after the attention core (the output projection, the second norm,
// the MLP), the core's tensors after the softmax's output (dropout's mask and output; Llama's c
// copy of the fp32 probabilities) and, with separate projections, probs @ v's copy of v. Marks
// them (SavedTensor::freed_by_softmax_backward) and returns the softmax output's index,
// block.size() when the block saves none (then nothing is marked).
size_t MarkFreedBySoftmaxBackward(std::vector<SavedTensor>& block, std::string_view softmax_output, bool value_copy) {
  size_t softmax = block.size(), last_core = 0;
  for (size_t i = 0; i < block.size(); ++i) {
    if (block[i].name == softmax_output) softmax = i;
    if (block[i].attention_core) last_core = i;
  }
  if (softmax == block.size()) return softmax;
  for (size_t i = 0; i < block.size(); ++i) {
    SavedTensor& t = block[i];
    const bool value = value_copy && IsValueCopy(t);
    t.freed_by_softmax_backward = value || i > last_core || (i > softmax && t.attention_core);
  }
  return softmax;
}

// Eager attention: marks what is freed by the softmax's backward (above) and, over separate q, k
// and v projections, returns the gradients alive while it runs (one tensor each), beyond the saved tensors still
// referenced. By then autograd has run the backward of everything after the attention core
// (their weight gradients exist) and of probs @ v. Alive: the residual stream's gradient (c h per
// token), v's gradient (v's saved shape), and two gradients of the softmax output's shape (its
// output's and its input's; fp32 for Llama's fp32 softmax, the probabilities' gradient cast up
// first). FSDPMemTracker at the peak of a two-rank --ac full step (tools/peak_trace.py: Llama 3
// 2k-vocab, Gemma 2, gpt-oss, Llama 4) holds exactly these. gpt-oss's peak comes one op later, in
// the row maximum's backward (zeros and a scatter of the scores' shape while the probabilities
// are freed): the same bytes. GPT-2's fused c_attn (q, k, v views of one saved output, its
// softmax in c) the same: v's gradient is one of c_attn's output width h, q's and k's come after
// (PEAK_TRACE_WITHIN=bw:h.11 tools/peak_trace.py on the 2k-context, 2k-vocabulary GPT-2: the
// step's peak is _softmax_backward_data with these alive). Returns 0 where the scores need no
// gradient (LoRA on v alone: the probabilities are saved for v's gradient only; then none); v's
// gradient only where v needs one.
std::vector<SavedTensor> MarkSoftmaxBackward(const ModelShape& m, const FsdpConfig& cfg, const Dims& d, const BlockFlow& f,
                                             std::vector<SavedTensor>& block) {
  if (cfg.attention != Attention::kEager) return {};
  const std::string_view softmax_output = m.arch.softmax_fp32 && !m.attention_sinks ? "attn_core.softmax_fp32" : "attn_core.probs";
  const size_t softmax = MarkFreedBySoftmaxBackward(block, softmax_output, !m.arch.fused_qkv);
  if (!f.scores || softmax == block.size()) return {};
  int64_t value_grad = m.arch.fused_qkv && f.v ? d.c * d.h * d.tokens : 0;
  for (const SavedTensor& t : block) {
    if (f.v && IsValueCopy(t)) value_grad = t.bytes;
  }
  // separate tensors, as the caching allocator sees them: two [B, a, s, s] fp32 gradients reuse
  // the segments of the forward's and the recomputation's fp32 scores, where one block of their
  // sum needs a segment of its own
  std::vector<SavedTensor> grads = {{"grad.hidden", d.c * d.h * d.tokens}};
  if (value_grad > 0) grads.push_back({"grad.v", value_grad});
  if (m.attention_sinks && d.c < 4) {
    // gpt-oss in 16 bits: the row maximum's backward is the higher moment. MaxBackward0 makes zeros
    // of the joined scores' shape and scatter_s the maximum's gradient into them, and scatter_
    // allocates a fp32 buffer of that whole shape for a 16-bit tensor (tools/torch_reference.py
    // --memory-history on the CPU: aten::empty inside aten::scatter_, 4 bytes an element; none in
    // fp32); the probabilities and their gradient are gone by then, the softmax input's gradient
    // alive. The CPU's requests replayed peak there at 5,440,057,328 bytes (gpt-oss-tiny, 8 x
    // 2048), and the H200's max_memory_allocated of that run is those plus its 64 MiB cuBLAS
    // workspace to within 278,544 bytes.
    block[softmax].freed_by_softmax_backward = true;
    grads.push_back({"grad.softmax_input", block[softmax].bytes});
    grads.push_back({"grad.row_max_zeros", block[softmax].bytes});
    grads.push_back({"grad.row_max_scatter_fp32", 4 * block[softmax].bytes / d.c});
    return grads;
  }
  grads.push_back({"grad.softmax_output", block[softmax].bytes});
  // fp16 on CUDA: the forward fused the upcast (_softmax(half_to_float=true) of the fp16 scores),
  // so its backward writes the input's gradient in fp16 (derivatives.yaml: _softmax_backward_data(
  // grad, result, dim, self.scalar_type())); elsewhere the input was the fp32 copy or the scores
  const bool half_to_float = FusesSoftmaxUpcast(cfg) && softmax_output == "attn_core.softmax_fp32";
  grads.push_back({"grad.softmax_input", half_to_float ? d.c * block[softmax].bytes / 4 : block[softmax].bytes});
  // CUDA's softmax backward (SoftMax.cu, softmax_backward_cuda_out) computes `tmp = grad *
  // output` into a tensor of the gradient's shape before its kernel, after the structured op has
  // allocated grad_input: a fourth [B, a, s, s] tensor there, freed as the op returns. The
  // CPU's kernel makes none (PyTorch's CPU requests: _softmax_backward_data's output alone). On
  // the H200 it is what the un-checkpointed eager TinyLlama rows lacked: max_memory_allocated
  // 512.5 MiB over fsdp-plan's (one [1, 32, 2048, 2048] fp32), +0.00% with it.
  if (cfg.torch_device == TorchDevice::kCuda) grads.push_back({"grad.softmax_product", block[softmax].bytes});
  return grads;
}

// The gradients alive inside a block's backward beyond its saved tensors: those held through it
// (the incoming and outgoing hidden-state gradients and the largest op-level transient outside
// the MLP) and the MLP's moment beyond them (BlockActivations::backward_working,
// mlp_working_bytes). `softmax_moment`: the attention core's backward is MarkSoftmaxBackward's
// moment, not a term here.
// transformers' RMSNorm backward runs in fp32 over the whole [T, h], three such tensors at
// once (12 bytes a element); the fused CUDA kernel writes only the input's gradient (one of the
// hidden-state gradients its caller counts). (GPT-2's LayerNorm rows were measured with the same
// three: activation_model_test.)
std::vector<SavedTensor> NormBackwardWorking(const Dims& d) {
  if (d.fused_rms_norm) return {};
  return std::vector<SavedTensor>(3, SavedTensor{"grad.norm_fp32", 4 * d.h * d.tokens});
}

struct BackwardWorking {
  std::vector<SavedTensor> held;
  int64_t mlp_moment = 0;
};
BackwardWorking BackwardWorkingOf(const ModelShape& m, const FsdpConfig& cfg, const Dims& d, bool softmax_moment) {
  const int64_t hT = d.h * d.tokens;
  std::vector<SavedTensor> attention;
  if (!softmax_moment && cfg.attention != Attention::kEager) {
    // dq, dk, dv (repeat_kv's: of every head) and the kernel's fp32 dq accumulator
    const int64_t kv_grad_heads = d.repeats_kv ? d.heads : d.kv_heads;
    attention = {{"grad.q", d.c * d.heads * d.head_dim * d.tokens},
                 {"grad.k", d.c * kv_grad_heads * d.head_dim * d.tokens},
                 {"grad.v", d.c * kv_grad_heads * d.head_dim * d.tokens},
                 {"grad.q_accumulator_fp32", 4 * d.heads * d.head_dim * d.tokens}};
  }
  // rows per token through the experts: top-k, or every expert (Llama 4's dense dispatch)
  const int64_t mlp_factor = d.experts == 0 ? 1 : m.arch.experts_dense_dispatch ? d.experts : d.top_k;
  const int64_t mlp = (m.arch.mlp == MlpKind::kPlain ? 4 : 3) * d.c * d.inner * d.tokens * mlp_factor;
  const std::vector<SavedTensor> norm = NormBackwardWorking(d);
  BackwardWorking w;
  w.held = {{"grad.hidden_in", d.c * hT}, {"grad.hidden_out", d.c * hT}};
  const std::vector<SavedTensor>& larger = SumBytes(attention) > SumBytes(norm) ? attention : norm;
  w.held.insert(w.held.end(), larger.begin(), larger.end());
  w.mlp_moment = std::max<int64_t>(0, d.c * hT + mlp - SumBytes(w.held));
  return w;
}

// The key and value states transformers 4.31 to 4.35 return per layer under use_cache
// (LlamaAttention.forward: `past_key_value = (key_states, value_states) if use_cache else None`,
// after RoPE, before repeat_kv; [B, kv_heads, s, head_dim] each), less those a kept tensor already
// is: eager attention's k and v without GQA (repeat_kv returns them as they are), SDPA's or
// FlashAttention-2's k and v of the kv heads, selective checkpointing's attention inputs under GQA,
// op-level checkpointing's v_proj output (v is its view; k is RoPE's output, which it recomputes).
std::vector<SavedTensor> CacheBeyondKept(const Dims& d, const std::vector<SavedTensor>& kept) {
  const int64_t bytes = d.c * d.kv_heads * d.head_dim * d.tokens;
  const auto holds = [&](std::initializer_list<std::string_view> names) {
    return std::any_of(kept.begin(), kept.end(), [&](const SavedTensor& t) {
      return t.bytes == bytes && std::find(names.begin(), names.end(), t.name) != names.end();
    });
  };
  std::vector<SavedTensor> cache;
  if (!holds({"self_attn.k_rope", "self_attn.k_repeated", "attn_core.k_input"})) cache.push_back({"cache.key", bytes});
  if (!holds({"self_attn.v", "self_attn.v_repeated", "attn_core.v_input", "op_sac.v_proj_out"})) cache.push_back({"cache.value", bytes});
  return cache;
}

// The tensors alive at an eager core's highest forward moment that `kept` does not hold (a
// block's forward allocates its kept tensors before the moment unless flagged
// after_forward_moment). Llama-style (eager_attention_forward of 5.x; LlamaAttention.forward of
// 4.31 to 4.35 the same way): `attn_weights = softmax(attn_weights, dtype=float32).to(query.dtype)`
// with the masked scores still bound to attn_weights. ATen's softmax(input, dim, dtype)
// (aten/src/ATen/native/SoftMax.cpp) fuses the upcast only for fp16 on CUDA
// (_softmax(half_to_float=true)); a bf16 input (and fp16 on a CPU: `upcast_copy`) is first
// converted to a fp32 copy, alive while
// _softmax writes its fp32 output: scores + copy + output, 10 bytes a score. Otherwise the highest
// moment is the cast back: scores + fp32 softmax + probabilities (fp16: 8 bytes; under fp32 the
// copy and the cast return their inputs: the product and its scaled copy, then the masked scores
// and the softmax, 8; AddSplitAttention makes the kept softmax after the moment). gpt-oss (GptOss eager_attention_forward): the masked
// scores stay bound to attn_weights until the dropout line, and at the subtraction of the row
// maximum its join with the sink logits (torch.cat, one more key) and the difference are alive
// beside the maximum's values: c (s + (s + 1) + (s + 1) + 1) a score row; the softmax's moment
// after it holds the same less the row maximum. Measured on the CPU (tools/peak_trace.py):
// transformers 4.31's llama-24-layers-2k-vocab.json under --ac full peaks at aten._softmax with
// the scores, the fp32 copy and the output alive; gpt-oss-tiny.json un-checkpointed at 2 x 2048
// at aten.sub.Tensor in its last block's forward, with these and what the block saved before.
std::vector<SavedTensor> EagerCoreMoment(const ModelShape& m, const Dims& d, bool upcast_copy, const std::vector<SavedTensor>& kept) {
  if (!EagerCoreMomentModelled(m)) return {};
  const int64_t scores = d.heads * d.seq * d.tokens;  // B * a * s * s
  auto held = [&](std::string_view name) {
    return std::any_of(kept.begin(), kept.end(), [&](const SavedTensor& t) { return t.name == name; });
  };
  // `matmul(q, k^T) * scaling + mask`: the product, then its scaled copy, each freed once the
  // next exists; the masked scores stay. Gemma 2's soft-capping (its eager_attention_forward:
  // `/ softcap`, tanh, `* softcap` before the mask) adds three more of the same, each gone once
  // the next exists, tanh's output among them where it is not kept (a checkpointed forward)
  std::vector<SavedTensor> moment = {{"moment.scores_product", d.c * scores}, {"moment.scores_scaled", d.c * scores}};
  if (m.attn_logit_softcapping > 0) {
    moment.push_back({"moment.scores_divided", d.c * scores});
    if (!held("self_attn.softcap_tanh")) moment.push_back({"moment.scores_tanh", d.c * scores});
    moment.push_back({"moment.scores_capped", d.c * scores});
  }
  for (SavedTensor& t : moment) t.freed_by_next_in_moment = true;
  moment.push_back({"moment.scores", d.c * scores});
  if (m.attention_sinks) {
    const int64_t joined = d.c * (scores + d.heads * d.tokens);  // one more key: the sink
    moment.push_back({"moment.joined", joined});
    moment.push_back({"moment.row_max", d.c * d.heads * d.tokens});
    moment.push_back({"moment.shifted", joined});
    return moment;
  }
  if (upcast_copy) moment.push_back({"moment.scores_fp32", 4 * scores});
  if (!held("attn_core.softmax_fp32")) moment.push_back({"moment.softmax", 4 * scores});
  if (!upcast_copy && d.c != 4 && !held("attn_core.probs")) moment.push_back({"moment.probs", d.c * scores});  // fp16: the cast back
  return moment;
}

// An un-checkpointed (or selectively checkpointed) block's forward at its eager core's moment:
// the core's tensors it does not keep, and what the attention function holds unsaved beside
// them: the block's input, bound as the residual (in fp32 the norm's upcast returns that very
// tensor, kept already; a block whose projections read it saves it; ResidualStreamApart: the
// memory model holds it), and with GQA k after RoPE
// and v at kv-head width, whose products save repeat_kv's copies instead (selective
// checkpointing keeps them as the function's inputs; use_cache, `cached`, as the cache's).
// tools/peak_trace.py, gpt-oss-tiny.json at 2 x 2048: the last block's forward holds these.
std::vector<SavedTensor> UncheckpointedForwardMoment(const ModelShape& m, const Dims& d, bool upcast_copy, bool cached, bool stream_apart,
                                                     const std::vector<SavedTensor>& kept) {
  const std::vector<SavedTensor> core = EagerCoreMoment(m, d, upcast_copy, kept);
  if (core.empty()) return {};
  auto kept_any = [&](auto&& pred) { return std::any_of(kept.begin(), kept.end(), pred); };
  std::vector<SavedTensor> moment;
  if (d.c != 4 && !stream_apart && !kept_any([](const SavedTensor& t) { return t.is_block_input || t.name == "block.input"; })) {
    moment.push_back({"moment.residual", d.c * d.h * d.tokens});
  }
  if (d.kv_heads < d.heads && !cached && !kept_any([](const SavedTensor& t) { return t.name == "attn_core.k_input"; })) {
    const int64_t kv = d.kv_heads * d.head_dim * d.tokens;
    moment.push_back({"moment.k_rope", d.c * kv});
    moment.push_back({"moment.v", d.c * kv});
  }
  moment.insert(moment.end(), core.begin(), core.end());
  return moment;
}

// A fully checkpointed block's forward (no_grad) at its eager core's moment: the core's tensors
// (none kept) and the inputs it reads: the normed hidden states the projections read (pre-norm
// blocks), q after RoPE, k and v (unless `cached`: the cache's, which a checkpointed block keeps
// whole, allocated already) and, with GQA, repeat_kv's copies. The block's input is the
// checkpoint's, kept already.
std::vector<SavedTensor> CheckpointedForwardMoment(const ModelShape& m, const Dims& d, bool upcast_copy, bool cached,
                                                   const std::vector<SavedTensor>& kept) {
  std::vector<SavedTensor> core = EagerCoreMoment(m, d, upcast_copy, kept);
  if (core.empty()) return {};
  const int64_t q = d.heads * d.head_dim * d.tokens, kv = d.kv_heads * d.head_dim * d.tokens;
  std::vector<SavedTensor> moment;
  if (RolesOf(m.arch.norm_placement).pre_attn >= 0) moment.push_back({"moment.normed", d.c * d.h * d.tokens});
  moment.push_back({"moment.q_rope", d.c * q});
  if (!cached) {
    moment.push_back({"moment.k_rope", d.c * kv});
    moment.push_back({"moment.v", d.c * kv});
  }
  if (d.kv_heads < d.heads) {
    moment.push_back({"moment.k_repeated", d.c * q});
    moment.push_back({"moment.v_repeated", d.c * q});
  }
  moment.insert(moment.end(), core.begin(), core.end());
  return moment;
}

// A forward's unsaved tensors, written as PyTorch makes and frees them among a list's saved
// tensors, turned into the SavedTensor::made_before lists TransientsBetween replays (`outlives`
// counted as it counts). A step naming a tensor the list lacks spoils the script: Apply then
// changes nothing.
class TransientScript {
 public:
  explicit TransientScript(std::vector<SavedTensor>& list) : list_(list) {}
  /// A transient made now, before the list's next tensor; returns its id.
  int Make(int64_t bytes) {
    if (next_ >= list_.size()) spoiled_ = true;
    made_.push_back({next_, bytes, allocs_++, std::numeric_limits<int>::max()});
    return static_cast<int>(made_.size()) - 1;
  }
  /// The output of the norm whose tensors (names starting with `norm_prefix`) were made last, a
  /// transient made now: the norm's fp32 product (MarkNormTransients's then_transient after its
  /// rsqrt or x_normalized) is referenced until the norm returns, so it lives through this too.
  int MakeNormOutput(int64_t bytes, std::string_view norm_prefix) {
    WidenNormProduct(norm_prefix);
    return Make(bytes);
  }
  /// Transient `id` (none: -1) freed now, before the next allocation.
  void Free(int id) {
    if (id >= 0) made_[static_cast<size_t>(id)].outlives = allocs_ - made_[static_cast<size_t>(id)].at - 1;
  }
  /// The list's tensors up to the next one named `name` are made now.
  void Saved(std::string_view name) {
    size_t i = next_;
    while (i < list_.size() && list_[i].name != name) ++i;
    if (i == list_.size()) {
      spoiled_ = true;
      return;
    }
    MadeThrough(i + 1);
  }
  /// The list's tensors before the next one whose name starts with `prefix` are made now (all of
  /// them when none does).
  void SavedBefore(std::string_view prefix) {
    size_t i = next_;
    while (i < list_.size() && !list_[i].name.starts_with(prefix)) ++i;
    MadeThrough(i);
  }
  /// `count` allocations another script adds here, before the list's next tensor (o_proj's output:
  /// MarkResidualTransients, MarkPostNormTransients)
  void Skip(int count) { allocs_ += count; }
  /// The list's tensors all made, the last made so far a norm's (names starting with `norm_prefix`),
  /// whose output the memory model makes next, at a block's end, through the same
  /// TransientsBetween: one allocation after the list, which the norm's fp32 product outlives.
  void NormOutputAfterList(std::string_view norm_prefix) {
    WidenNormProduct(norm_prefix);
    MadeThrough(list_.size());
    ++allocs_;
  }
  /// The list's next tensors whose names start with `prefix`, if any, are made now.
  void SavedWithin(std::string_view prefix) {
    size_t i = next_;
    while (i < list_.size() && list_[i].name.starts_with(prefix)) ++i;
    MadeThrough(i);
  }
  /// Writes the made_before lists and the widened spans; nothing when a step named a missing tensor.
  void Apply() {
    if (spoiled_) return;
    for (const Made& t : made_) list_[t.holder].made_before.push_back({t.bytes, t.outlives});
    for (size_t i : widened_) ++list_[i].then_transient_spans;
  }

 private:
  struct Made {
    size_t holder;  // the list tensor it is made before
    int64_t bytes;
    int at;         // its allocation's number in the script
    int outlives;
  };
  // the norm whose tensors were made last: its fp32 product (MarkNormTransients's then_transient
  // after its rsqrt or x_normalized) lives through one allocation more
  void WidenNormProduct(std::string_view norm_prefix) {
    for (size_t i = next_; i-- > 0 && list_[i].name.starts_with(norm_prefix);) {
      if (list_[i].then_transient_bytes > 0 && !list_[i].name.ends_with(".x_fp32")) widened_.push_back(i);
    }
  }
  void MadeThrough(size_t end) {
    allocs_ += static_cast<int>(end - next_);
    next_ = end;
  }
  std::vector<SavedTensor>& list_;
  std::vector<Made> made_;
  std::vector<size_t> widened_;  // norms' products alive through one allocation more
  size_t next_ = 0;
  int allocs_ = 0;
  bool spoiled_ = false;
};

// The unsaved tensors of transformers' Llama-style attention (Architecture::rope_rotate_half) up
// to SDPA: q's projection output (where a q_norm reads it, alive through the norm, whose own
// output RoPE reads instead), then k's, both alive until apply_rotary_pos_emb has returned; v's
// projection (saved); for q, then k, RoPE's `x * cos`, rotate_half's `-x2` and its torch.cat,
// that cat times sin, and their sum (q_embed; with Phi-3's partial rotary the sum of the rotated
// features, joined to the rest by a new cat). A fused qkv_proj's q and k are views. SDPA with a
// mask and GQA (Dims::masked: repeat_kv's copies of k and v are what SDPA saves): k's embedding and
// v's projection are transients, alive until the attention returns, after o_proj's output (made
// by the residual stream's scripts where it is apart). Each a tensor of the compute dtype.
// torch_reference.py --device cpu --memory-history, transformers 5.24: phi3-100m.json at 8 x 2048
// (fused, partial rotary), qwen3-100m.json at 8 x 2048 (per-head q_norm), gemma3-text-100m.json at
// 2 x 2048 (sliding-window layers: masked); ModelShape::rotary_fraction's int(head_dim * f)
// features rotate.
void MarkRopeTransients(std::vector<SavedTensor>& list, const ModelShape& m, const FsdpConfig& cfg, const Dims& d) {
  if (!m.arch.rope_rotate_half || m.nope || m.mla.enabled() || cfg.impl != Impl::kTransformers || cfg.attention == Attention::kEager) {
    return;
  }
  const bool fused = FindOp(m, "qkv_proj") != nullptr;
  const bool repeated = d.masked;  // repeat_kv's copies saved
  if (repeated && (fused || d.kv_heads >= d.heads)) return;  // (without GQA the list's order is not PyTorch's)
  const int64_t q = d.c * d.heads * d.head_dim * d.tokens, kv = d.c * d.kv_heads * d.head_dim * d.tokens;
  const int64_t rotary_dim = static_cast<int64_t>(static_cast<double>(d.head_dim) * m.rotary_fraction);
  TransientScript script(list);
  script.SavedBefore(m.arch.attention_module + ".");
  // a projection's output, or its q_norm/k_norm's (the projection's then freed): what RoPE reads
  auto normed = [&](int projected, int64_t bytes, std::string_view norm) {
    if (FindOp(m, norm) == nullptr) return projected;
    const std::string prefix = std::string(norm) + ".";
    script.SavedWithin(prefix);
    const int output = script.MakeNormOutput(bytes, prefix);
    script.Free(projected);
    return output;
  };
  auto rope = [&](int64_t bytes, std::string_view embedded) {
    const int64_t rotated = bytes / d.head_dim * rotary_dim;
    const bool partial = rotated != bytes;
    const int cos_product = script.Make(rotated);
    const int negated = script.Make(rotated / 2);
    const int joined = script.Make(rotated);  // rotate_half's
    script.Free(negated);
    const int sin_product = script.Make(rotated);
    script.Free(joined);
    // the sum (the embedding itself unless partial rotary joins it to the rest); a transient
    // where `embedded` is empty, whose id is returned
    const int sum = partial || embedded.empty() ? script.Make(rotated) : -1;
    if (!partial && !embedded.empty()) script.Saved(embedded);
    script.Free(cos_product);
    script.Free(sin_product);
    if (partial) {  // the cat of the rotated and unrotated features is the embedding
      const int joined_all = embedded.empty() ? script.Make(bytes) : -1;
      if (!embedded.empty()) script.Saved(embedded);
      script.Free(sum);
      return joined_all;
    }
    return sum;
  };
  // v's projection: the saved v, or (repeated) a transient
  int v_projected = -1;
  auto project_v = [&] {
    if (repeated) v_projected = script.Make(kv);
    else script.Saved("self_attn.v");
  };
  int q_in = -1, k_in = -1;  // (a fused qkv_proj's q and k are views)
  if (fused) {
    project_v();
  } else if (m.arch.qk_norms_after_projections) {  // Gemma 3: the three projections, then the norms
    const int q_projected = script.Make(q), k_projected = script.Make(kv);
    project_v();
    q_in = normed(q_projected, q, "self_attn.q_norm");
    k_in = normed(k_projected, kv, "self_attn.k_norm");
  } else {  // Qwen3, OLMo 2: each norm on its projection's output as it is made, v's after both
    q_in = normed(script.Make(q), q, "self_attn.q_norm");
    k_in = normed(script.Make(kv), kv, "self_attn.k_norm");
    project_v();
  }
  rope(q, "self_attn.q_rope");
  const int k_embedded = rope(kv, repeated ? "" : "self_attn.k_rope");
  script.Free(q_in);
  script.Free(k_in);
  if (repeated) {  // repeat_kv's copies, the mask, SDPA; freed once o_proj's output exists
    script.Saved("self_attn.o_proj_in");
    if (ResidualStreamApart(m, cfg) || ResidualStreamCarried(m, cfg)) script.Skip(1);
    script.Free(k_embedded);
    script.Free(v_projected);
  }
  script.Apply();
}

// ResidualStreamApart's tensors inside a block's list: the attention output projection's output
// and its sum with the residual (the hidden states through the MLP), made before the MLP
// sub-layer's first tensor (its norm's), the first freed once the second is made, the second at
// the block's end (after its output: MemoryModel). Measured as MarkRopeTransients's.
void MarkResidualTransients(std::vector<SavedTensor>& list, const Dims& d) {
  const auto mlp = std::find_if(list.begin(), list.end(), [](const SavedTensor& t) { return t.mlp_sublayer; });
  if (mlp == list.end()) return;
  TransientScript script(list);
  script.SavedBefore(mlp->name);
  const int projected = script.Make(d.c * d.h * d.tokens);
  script.Make(d.c * d.h * d.tokens);
  script.Free(projected);
  script.Apply();
}

// The transients of a block whose sub-layers' outputs are normed (Olmo2DecoderLayer, the
// sandwich of Gemma2DecoderLayer and Gemma3DecoderLayer, transformers 5.24): o_proj's output,
// alive until its post-norm has made its output (the norm's fp32 product until then too), which
// lives until its sum with the residual is made; that sum is "mlp.input" where gate and up save it
// (OLMo 2: `sum_saved`), else a transient held to the block's end (Gemma: the pre-MLP norm saves
// an fp32 copy); then down's output, alive through its post-norm and the norm's output, the memory
// model's first allocation at the block's end (the second is the block's output). Measured as
// MarkRopeTransients's: olmo2-100m.json at 8 x 2048, gemma3-text-100m.json at 2 x 2048.
void MarkPostNormTransients(std::vector<SavedTensor>& list, const ModelShape& m, const Dims& d, bool sum_saved) {
  const std::vector<std::string_view> norms = BlockNorms(m);
  const NormRoles roles = RolesOf(m.arch.norm_placement);
  if (roles.post_attn < 0 || roles.post_mlp < 0 || norms.size() <= static_cast<size_t>(std::max(roles.post_attn, roles.post_mlp))) {
    return;
  }
  const std::string post_attn = std::string(norms[static_cast<size_t>(roles.post_attn)]) + ".";
  const std::string post_mlp = std::string(norms[static_cast<size_t>(roles.post_mlp)]) + ".";
  const int64_t hidden = d.c * d.h * d.tokens;
  TransientScript script(list);
  script.SavedBefore(post_attn);
  const int projected = script.Make(hidden);
  script.SavedWithin(post_attn);
  const int normed = script.MakeNormOutput(hidden, post_attn);
  script.Free(projected);
  if (sum_saved) script.Saved("mlp.input");
  else script.Make(hidden);
  script.Free(normed);
  script.SavedBefore(post_mlp);
  const int down = script.Make(hidden);
  script.SavedWithin(post_mlp);
  script.NormOutputAfterList(post_mlp);
  script.Free(down);
  script.Apply();
}

}  // namespace

int64_t SumBytes(const std::vector<SavedTensor>& tensors) {
  int64_t total = 0;
  for (const auto& t : tensors) total += t.bytes;
  return total;
}

std::vector<int64_t> ModelBuffers(const ModelSpec& m, const FsdpConfig& cfg) {
  if (IsTorchtitan(cfg.impl)) {
    if (TorchtitanQwen3(m, cfg)) return {4 * cfg.seq_len * 2 * m.head_dim};  // rope_cache, fp32 [seq, 2 head_dim]
    return {8 * cfg.seq_len * (m.head_dim / 2)};                             // freqs_cis, complex64 [seq, head_dim / 2]
  }
  std::vector<int64_t> buffers;
  const int64_t positions = m.max_position_embeddings;
  if (HasPerLayerRopeTables(cfg.transformers, m.model_type)) {
    // each layer's rotary embedding: cos_cached and sin_cached [P, head_dim] (4.31: [1, 1, P,
    // head_dim]) and inv_freq [head_dim / 2], made in the default dtype, which from_pretrained's
    // torch_dtype and model.to() set to the model's; FSDP1's MixedPrecision casts every floating
    // buffer to its buffer_dtype (fsdp/_runtime_utils.py, _cast_buffers_to_dtype_and_device), FSDP2 none
    const DType stored = FrozenStorageDtype(cfg);
    const int64_t c = BytesPerElement(cfg.framework == Framework::kFsdp1 && cfg.param_dtype != stored ? cfg.buffer_dtype : stored);
    for (int64_t layer = 0; layer < m.num_layers; ++layer) {
      for (int64_t bytes : {c * positions * m.head_dim, c * positions * m.head_dim, c * (m.head_dim / 2)}) buffers.push_back(bytes);
    }
  }
  if (HasCausalMaskBuffer(cfg.transformers, m.model_type)) buffers.push_back(positions * positions);  // bool: no cast
  return buffers;
}

void MarkNormTransients(std::vector<SavedTensor>& tensors, const Architecture& arch, int64_t compute_bytes) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].name.ends_with(".x_fp32")) continue;
    const std::string_view module = tensors[i].name.substr(0, tensors[i].name.size() - std::string_view(".x_fp32").size());
    auto of_module = [&](size_t j, std::string_view what) {
      return j < tensors.size() && tensors[j].name.size() == module.size() + 1 + what.size() && tensors[j].name.starts_with(module) &&
             tensors[j].name.ends_with(what) && tensors[j].name[module.size()] == '.';
    };
    const int64_t fp32_bytes = tensors[i].bytes;
    tensors[i].then_transient_bytes = fp32_bytes;  // pow(2)
    if (compute_bytes == 4 || !of_module(i + 1, "rsqrt")) continue;
    size_t anchor = i + 1;
    if (arch.norm_weight_fp32) {
      if (!of_module(i + 2, "x_normalized")) continue;  // frozen weight: its product is not kept apart
      anchor = i + 2;
    }
    int spans = 0;
    for (size_t j = anchor + 1; of_module(j, "x_normalized") || of_module(j, "out"); ++j) ++spans;
    tensors[anchor].then_transient_bytes = fp32_bytes;
    tensors[anchor].then_transient_spans = spans;
  }
}

int64_t BlockActivations::FullBytes() const { return SumBytes(full); }
int64_t BlockActivations::KeptBytes() const { return SumBytes(kept); }
int64_t BlockActivations::SoftmaxBackwardBytes() const { return SumBytes(softmax_backward); }
int64_t BlockActivations::BackwardWorkingBytes() const { return SumBytes(backward_working); }
int64_t BlockActivations::ForwardMomentBytes() const {
  int64_t live = 0, highest = 0;
  for (size_t i = 0; i < forward_moment.size(); ++i) {
    live += forward_moment[i].bytes;
    highest = std::max(highest, live);
    if (i > 0 && forward_moment[i - 1].freed_by_next_in_moment) live -= forward_moment[i - 1].bytes;
  }
  return highest;
}
int64_t HeadActivations::SavedBytes() const {
  return SumBytes(embedding) + SumBytes(final_norm) + logits_bytes + loss_saved_bytes;
}

// transformers' RMSNorm upcasting a bf16 or fp16 stream, without or with selective checkpointing
static bool StreamOfTransformersHalfRms(const ModelShape& m, const FsdpConfig& cfg) {
  return cfg.impl == Impl::kTransformers && BytesPerElement(cfg.param_dtype) != 4 && m.arch.norm == NormKind::kRms &&
         (cfg.checkpointing == Checkpointing::kNone || cfg.checkpointing == Checkpointing::kSelective);
}

bool ResidualStreamApart(const ModelShape& m, const FsdpConfig& cfg) {
  return StreamOfTransformersHalfRms(m, cfg) && m.arch.norm_placement != NormPlacement::kPost;
}

bool ResidualStreamCarried(const ModelShape& m, const FsdpConfig& cfg) {
  return StreamOfTransformersHalfRms(m, cfg) && m.arch.norm_placement == NormPlacement::kPost && !m.arch.base_frozen;
}

bool BlockInputRequiresGrad(const ModelSpec& m, int block) {
  if (!m.arch.base_frozen) return true;
  for (int earlier = 0; earlier < block; ++earlier) {  // none: a frozen embedding's output
    for (const ParamOp& op : m.arch.BlockOf(earlier)) {
      if (Trains(&op)) return true;  // its output carries the adapters' contribution onwards
    }
  }
  return false;
}

// BlockActivations::experts_forward_moment: what the routed experts' forward (transformers 5.24,
// integrations/moe.py grouped_mm_experts_forward, and the sparse MoE block around it) holds at its
// end beyond what it saves, in the order it makes them: the decoder layer's residual (the hidden
// states after attention, bound as `residual` through the MLP; in fp32 the norm's upcast saves
// that very tensor; ResidualStreamApart: the block's transients hold it), the router's logits
// (F.linear's output in the compute dtype, DeepSeek-V3's on fp32 copies) and the routing weights
// the block passes on (gpt-oss's are its saved softmax), sort's sorted expert ids unless the
// biases' gathers save them, histc's 4-byte copy of them, then the weighted outputs (the pair
// weight's dtype promotes them: fp32 beside fp32 weights), their gather back to token order (the
// weighted outputs die with it), the sum over each token's top-k (the gather dies with it), and
// its cast to the compute dtype where the sum is fp32. One tensor each; the memory model frees
// them all at the moment's end.
std::vector<SavedTensor> RoutedExpertsForwardMoment(const ModelShape& m, const Dims& d, bool stream_apart) {
  if (m.arch.mlp != MlpKind::kMoe || m.arch.experts_dense_dispatch) return {};
  const int64_t pairs = d.top_k * d.tokens;
  const int64_t weight_bytes = PairWeightBytes(m, d);
  const int64_t out_bytes = std::max(d.c, weight_bytes);
  std::vector<SavedTensor> moment;
  if (d.c != 4 && !stream_apart) moment.push_back({"moe.residual", d.c * d.h * d.tokens});
  moment.push_back({"moe.router_logits", (m.router == ModelShape::Router::kGroupedSigmoid ? 4 : d.c) * d.experts * d.tokens});
  if (m.router != ModelShape::Router::kTopKThenSoftmax) moment.push_back({"moe.routing_weights", weight_bytes * pairs});
  if (!ExpertsBiased(m)) moment.push_back({"moe.sorted_expert_ids", 8 * pairs});
  moment.push_back({"moe.histc_input", 4 * pairs});
  moment.push_back({"moe.weighted_out", out_bytes * d.h * pairs});
  moment.back().freed_by_next_in_moment = true;
  moment.push_back({"moe.weighted_out_token_order", out_bytes * d.h * pairs});
  moment.back().freed_by_next_in_moment = true;
  moment.push_back({"moe.token_sum", out_bytes * d.h * d.tokens});
  if (out_bytes != d.c) {
    moment.back().freed_by_next_in_moment = true;
    moment.push_back({"moe.token_sum_cast", d.c * d.h * d.tokens});
  }
  return moment;
}

BlockActivations BlockActivationProfile(const ModelShape& m, const FsdpConfig& cfg, bool input_requires_grad, int64_t window) {
  const Dims d = DimsOf(m, cfg, window);
  BlockActivations a;
  a.full = BlockSaved(m, cfg, d, input_requires_grad);
  MarkNormTransients(a.full, m.arch, d.c);
  MarkRopeTransients(a.full, m, cfg, d);
  a.softmax_backward = MarkSoftmaxBackward(m, cfg, d, FlowOf(m, input_requires_grad), a.full);
  switch (cfg.checkpointing) {
    case Checkpointing::kNone: a.kept = a.full; break;
    case Checkpointing::kSelective:
      for (const auto& t : a.full) (t.attention_core ? a.recomputed : a.kept).push_back(t);
      // without GQA v itself is an input of the checkpointed attention function, which holds it
      // until the function's whole backward has run (recomputed copies are the ones released)
      for (auto& t : a.kept) {
        if (t.name == "self_attn.v_repeated") t.freed_by_softmax_backward = false;
      }
      for (const auto& t : SelectiveCheckpointInputs(m, cfg, d)) a.kept.push_back(t);
      for (const auto& t : MatmulCopies(m, cfg, d, a.full)) a.recomputed.push_back(t);
      break;
    case Checkpointing::kSelectiveOp:
      a.kept = OpCheckpointKept(cfg, d, d.fused_rms_norm && FindOp(m, "q_norm") != nullptr);
      for (const auto& t : a.full) {
        if (t.block_argument) a.kept.push_back(t);
        else if (!KeptByOpCheckpointing(t, cfg, d) && !t.is_block_input) a.recomputed.push_back(t);
      }
      break;
    case Checkpointing::kFull:
      // checkpoint_wrapper (non-reentrant) saves only the block's inputs: the hidden states (and
      // any other argument: block_argument)
      a.kept = {{"checkpoint.block_input", d.c * d.h * d.tokens}};
      for (const auto& t : a.full) {
        if (t.block_argument) a.kept.push_back(t);
        else if (!t.is_block_input) a.recomputed.push_back(t);
      }
      // reentrant checkpointing (CheckpointFunction.backward) reruns the whole layer and holds its
      // output through the layer's backward (`outputs = ctx.run_function(*detached_inputs)`, then
      // torch.autograd.backward on them); non-reentrant recomputation stops once the saved
      // tensors are back, before the last residual add
      if (cfg.ac_reentrant) {
        a.recomputed.push_back({"checkpoint.reentrant_output", d.c * d.h * d.tokens});
        a.recomputed.back().mlp_sublayer = true;
      }
      break;
  }
  if (cfg.use_cache) a.cache = CacheBeyondKept(d, a.kept);
  const bool stream_apart = ResidualStreamApart(m, cfg);
  if (cfg.attention == Attention::kEager) {
    const bool upcast_copy = cfg.param_dtype == DType::kBf16 || (cfg.param_dtype == DType::kFp16 && !FusesSoftmaxUpcast(cfg));
    if (cfg.checkpointing == Checkpointing::kFull) a.forward_moment = CheckpointedForwardMoment(m, d, upcast_copy, !a.cache.empty(), a.kept);
    else if (cfg.checkpointing != Checkpointing::kSelectiveOp) {
      a.forward_moment = UncheckpointedForwardMoment(m, d, upcast_copy, !a.cache.empty(), stream_apart, a.kept);
    }
  }
  if (stream_apart && m.arch.norm_placement == NormPlacement::kPre) MarkResidualTransients(a.kept, d);
  if (stream_apart && m.arch.norm_placement == NormPlacement::kSandwich) MarkPostNormTransients(a.kept, m, d, false);
  if (ResidualStreamCarried(m, cfg)) MarkPostNormTransients(a.kept, m, d, true);
  a.experts_forward_moment = RoutedExpertsForwardMoment(m, d, stream_apart);
  if (cfg.checkpointing == Checkpointing::kFull) {
    // the recomputation stops once the last saved tensor, inv_perm, is saved (torch.utils.checkpoint's
    // early stop: the gather that saves it has not run); reentrant checkpointing reruns it all
    a.experts_recompute_moment = a.experts_forward_moment;
    if (!cfg.ac_reentrant) {
      std::erase_if(a.experts_recompute_moment, [](const SavedTensor& t) {
        return t.name == "moe.weighted_out_token_order" || t.name == "moe.token_sum" || t.name == "moe.token_sum_cast";
      });
    }
  }
  BackwardWorking working = BackwardWorkingOf(m, cfg, d, !a.softmax_backward.empty());
  a.backward_working = std::move(working.held);
  a.mlp_working_bytes = working.mlp_moment;
  return a;
}

bool WindowMasksSdpa(const FsdpConfig& cfg, int64_t window) {
  return cfg.attention != Attention::kEager && window > 0 && window < cfg.seq_len;
}

BlockProfiles BlockProfilesOf(const ModelSpec& m, const FsdpConfig& cfg) {
  FsdpConfig uncheckpointed = cfg;
  uncheckpointed.checkpointing = Checkpointing::kNone;
  uncheckpointed.ac_every = 1;
  BlockProfiles p;
  std::vector<std::array<bool, 5>> keys;
  p.of_block.resize(static_cast<size_t>(m.num_layers));
  for (int b = 0; b < m.num_layers; ++b) {
    const int64_t window = m.WindowOf(b);
    // reentrant checkpointing needs an input that requires grad: transformers' enable_input_require_grads()
    // makes a frozen embedding's output require it (the HF Trainer and TRL call it)
    const std::array<bool, 5> key = {m.arch.DenseLayer(b), m.LayerWithoutRope(b), BlockInputRequiresGrad(m, b) || cfg.ac_reentrant, BlockCheckpointed(cfg, b),
                                     WindowMasksSdpa(cfg, window)};
    const auto known = std::find(keys.begin(), keys.end(), key);
    p.of_block[static_cast<size_t>(b)] = static_cast<size_t>(known - keys.begin());
    if (known != keys.end()) continue;
    keys.push_back(key);
    const FsdpConfig& c = key[3] ? cfg : uncheckpointed;
    const int64_t masked_window = key[4] ? window : 0;
    if (key[0] || key[1]) {
      p.kinds.push_back(BlockActivationProfile(m.LayerShape(b), c, key[2], masked_window));
    } else {
      p.kinds.push_back(BlockActivationProfile(m, c, key[2], masked_window));
    }
  }
  return p;
}

HeadActivations HeadActivationProfile(const ModelSpec& m, const FsdpConfig& cfg) {
  const Dims d = DimsOf(m, cfg);
  const int64_t vT = m.vocab_size * d.tokens;
  HeadActivations head;
  if (m.embedding_dropout > 0) head.embedding.push_back({"embedding.dropout_mask", d.h * d.tokens});
  // The final norm and lm_head's input (its output). GPT-2's ln_f is counted without the latter,
  // as docs/memory-model.md measured it.
  // Under LoRA the final norm's weight and lm_head are frozen: the norm keeps what its input's
  // gradient needs and lm_head saves nothing.
  const std::string_view final_norm = LastComponent(m.arch.names.final_norm);
  const NormGrad grad{BlockInputRequiresGrad(m, static_cast<int>(m.num_layers)) || cfg.ac_reentrant, !m.arch.base_frozen};
  if (m.arch.norm == NormKind::kLayer) {
    AddNorm(head.final_norm, m.arch, final_norm, d, grad);
  } else {
    AddNormAndLinearInput(head.final_norm, m.arch, final_norm, d, grad, !m.arch.base_frozen);
  }
  MarkNormTransients(head.final_norm, m.arch, d.c);
  if (grad.input) head.final_norm_backward = NormBackwardWorking(d);
  // transformers' loss (HfLoss): cross_entropy = log_softmax (saves its fp32 output) + nll_loss,
  // over every position with the labels padded (4.49 on) or over logits[..., :-1, :] copied
  // contiguous (before 4.49: B (T - 1) rows). The logits the model returns stay referenced by its
  // output until backward ends.
  const HfLoss loss = IsTorchtitan(cfg.impl) ? HfLoss::kPaddedLabels : HfLossOf(cfg.transformers, m.model_type);
  const int64_t loss_rows = loss == HfLoss::kPaddedLabels ? d.tokens : d.tokens - cfg.micro_batch;
  const int64_t v_rows = m.vocab_size * loss_rows;
  head.logits_bytes = d.c * vT;
  head.loss_saved_bytes = 4 * v_rows;
  // Gemma 2's final_logit_softcapping (Gemma2ForCausalLM: logits / cap, tanh, * cap): tanh saves
  // its output in c
  if (m.final_logit_softcapping > 0) head.loss_saved_bytes += d.c * vT;
  head.loss_forward_transient_bytes = d.c == 4 ? 0 : 4 * vT;  // logits.float()
  if (loss == HfLoss::kFp32Logits && d.c != 4) {  // the model returns the upcast; lm_head's output is the transient
    head.upcast_in_model = true;
    std::swap(head.logits_bytes, head.loss_forward_transient_bytes);
  }
  if (loss != HfLoss::kPaddedLabels) {
    // .contiguous() copies only a slice spanning sequences: one sequence's rows are contiguous already
    head.shift_copy_bytes = cfg.micro_batch > 1 ? 4 * v_rows : 0;
    head.slice_grad_bytes = 4 * vT;
  }
  // nll_loss_backward's dense fp32 gradient, then log_softmax_backward's fp32 result.
  head.loss_grad_bytes = 4 * v_rows;
  return head;
}

}  // namespace fsdp
