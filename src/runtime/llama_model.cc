#include "runtime/llama_model.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <random>
#include <string_view>

#include <fmt/format.h>

#include "core/hash.h"
#include "core/lora.h"

namespace fsdp::runtime {

Result<std::vector<double>> RopeInverseFrequencies(const ModelSpec& m, int64_t seq_len) {
  const RopeScaling& s = m.rope_scaling;
  const auto dim = static_cast<double>(m.head_dim);
  if (s.type == "default") return RopeBaseFrequencies(m.rope_theta, m.head_dim);
  if (s.type == "linear") {
    std::vector<double> inv_freq = RopeBaseFrequencies(m.rope_theta, m.head_dim);
    for (double& f : inv_freq) f /= s.factor;
    return inv_freq;
  }
  if (s.type == "dynamic") {
    if (m.head_dim <= 2) return Error::BadInput("dynamic RoPE scaling needs head_dim > 2");
    const double max_positions = static_cast<double>(m.max_position_embeddings);
    const double length = std::max(static_cast<double>(seq_len), max_positions);
    const double base = m.rope_theta * std::pow(s.factor * length / max_positions - (s.factor - 1), dim / (dim - 2));
    return RopeBaseFrequencies(base, m.head_dim);
  }
  if (s.type == "llama3") {
    std::vector<double> inv_freq = RopeBaseFrequencies(m.rope_theta, m.head_dim);
    const double old_context = static_cast<double>(s.original_max_positions);
    const double low_freq_wavelen = old_context / s.low_freq_factor, high_freq_wavelen = old_context / s.high_freq_factor;
    for (double& f : inv_freq) {
      const double wavelen = 2 * std::numbers::pi / f;
      if (wavelen > low_freq_wavelen) {
        f /= s.factor;  // long wavelengths: interpolated
      } else if (wavelen >= high_freq_wavelen && s.high_freq_factor > s.low_freq_factor) {  // between the bands: smoothed
        const double smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        f = (1 - smooth) * f / s.factor + smooth * f;
      }  // short wavelengths: unchanged
    }
    return inv_freq;
  }
  return Error::BadInput(fmt::format("fsdp-run does not implement rope_scaling type '{}' ({})", s.type, m.id));
}

namespace {

// The block the kernels below implement: RMSNorm, separate q/k/v/o projections, RMSNorm, SwiGLU,
// RoPE positions, with the module names its weight offsets (LlamaDims::Offsets) follow.
// Qwen3's block adds per-head q_norm and k_norm after o_proj, where Qwen3Attention registers them;
// Qwen3-MoE's replaces the MLP by a router and fused experts ([experts, out, in], no biases).
bool RunsLlamaBlock(const Architecture& a) {
  static const std::vector<std::string_view> kLlama = {"input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                       "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
                                                       "mlp.down_proj"};
  static const std::vector<std::string_view> kQwen3 = {"input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                       "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "post_attention_layernorm",
                                                       "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"};
  static const std::vector<std::string_view> kQwen3Moe = {"input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                          "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "post_attention_layernorm",
                                                          "mlp.gate", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"};
  if (a.norm != NormKind::kRms || a.fused_qkv || !a.names.positions.empty() || a.norm_weight_fp32) return false;
  if (a.norm_placement != NormPlacement::kPre || !a.dense_layers.empty() || a.vision.present()) return false;
  const bool moe = a.mlp == MlpKind::kMoe;
  if (!moe && a.mlp != MlpKind::kGated) return false;
  if (moe && (a.experts_clamped_swiglu || a.experts_dense_dispatch)) return false;
  auto matches = [&](const std::vector<std::string_view>& modules) {
    if (a.block.size() != modules.size()) return false;
    for (size_t i = 0; i < a.block.size(); ++i) {
      const ParamOp& op = a.block[i];
      if (op.module != modules[i] || (op.qk_norm && !op.head_norm)) return false;
      if (op.experts != 0 && (!op.fused_experts || op.bias || op.conv1d || op.dense_dispatch)) return false;
    }
    return true;
  };
  return moe ? matches(kQwen3Moe) : matches(kLlama) || matches(kQwen3);
}

}  // namespace

Result<LlamaDims> DimsOf(const ModelSpec& m, int64_t seq_len) {
  if (!RunsLlamaBlock(m.arch)) {
    return Error::BadInput(fmt::format("fsdp-run trains llama, mistral, qwen2, qwen3 and qwen3_moe models (every layer routed); {} is {}{}", m.id,
                                       m.model_type, m.arch.dense_layers.empty() ? "" : " with dense layers"));
  }
  if (m.arch.mlp == MlpKind::kMoe && m.router != ModelShape::Router::kSoftmaxThenTopK) {
    return Error::BadInput(fmt::format("fsdp-run's router is a softmax then top-k (Qwen3-MoE's); {}'s is another", m.id));
  }
  if (m.o_bias || m.mlp_bias) {
    return Error::BadInput(fmt::format("fsdp-run implements biases on q/k/v only (Qwen2's); {} has {} biases", m.id, m.o_bias ? "o_proj" : "MLP"));
  }
  if (m.head_dim % 2 != 0) return Error::BadInput("RoPE needs an even head_dim");
  if (m.sliding_window > 0 && seq_len > m.sliding_window) {
    return Error::BadInput(fmt::format("--seq-len {} exceeds {}'s sliding_window {}: fsdp-run's attention is fully causal", seq_len, m.id,
                                       m.sliding_window));
  }
  auto inv_freq = RopeInverseFrequencies(m, seq_len);
  if (!inv_freq.ok()) return inv_freq.error();
  LlamaDims d{.vocab = m.vocab_size, .hidden = m.hidden_size, .inner = m.intermediate_size, .heads = m.num_heads,
              .kv_heads = m.num_kv_heads, .head_dim = m.head_dim, .layers = m.num_layers, .qkv_bias = m.qkv_bias,
              .rms_eps = static_cast<float>(m.norm_eps), .rope_inv_freq = std::move(inv_freq).value(), .tied = m.tie_word_embeddings, .offsets = {}, .block_numel = 0};
  if (m.arch.mlp == MlpKind::kMoe) {
    d.experts = m.num_experts;
    d.experts_per_token = m.experts_per_token;
    d.norm_topk = m.router_norm_topk;
  }
  d.lora_rank = m.arch.block.empty() ? 0 : std::max_element(m.arch.block.begin(), m.arch.block.end(), [](const ParamOp& x, const ParamOp& y) {
                                                return x.lora_rank < y.lora_rank;
                                              })->lora_rank;
  std::vector<int64_t> packed(m.tensors.size(), 0);  // the inventory's packing, block by block
  for (size_t t = 1; t < m.tensors.size(); ++t) packed[t] = packed[t - 1] + m.tensors[t - 1].numel();
  SetBlockLayout(m, [&packed](int t) { return packed[static_cast<size_t>(t)]; }, d);
  d.qk_norm = d.offsets.q_norm >= 0;
  int64_t adapters = 0, placed = 0;  // every adapter of the block on one of the seven projections
  for (const TensorSpec& t : m.tensors) adapters += t.block == 0 && IsLoraAdapter(t.name);
  for (const LlamaDims::LoraOffsets& lo : d.lora) placed += (lo.a >= 0) + (lo.b >= 0);
  if (adapters != placed) {
    return Error::BadInput(fmt::format("fsdp-run's LoRA adapts q/k/v/o_proj and gate/up/down_proj only; {} has {} adapter tensors elsewhere", m.id,
                                       adapters - placed));
  }
  return d;
}

void SetBlockLayout(const ModelSpec& m, const std::function<int64_t(int)>& offset_of, LlamaDims& d) {
  LlamaDims::BlockOffsets& o = d.offsets;
  o = {};
  d.lora.fill({});
  const std::pair<std::string_view, int64_t*> fields[] = {
      {"input_layernorm.weight", &o.in_norm}, {"self_attn.q_proj.weight", &o.wq}, {"self_attn.q_proj.bias", &o.bq},
      {"self_attn.k_proj.weight", &o.wk},     {"self_attn.k_proj.bias", &o.bk},   {"self_attn.v_proj.weight", &o.wv},
      {"self_attn.v_proj.bias", &o.bv},       {"self_attn.o_proj.weight", &o.wo}, {"self_attn.q_norm.weight", &o.q_norm},
      {"self_attn.k_norm.weight", &o.k_norm}, {"post_attention_layernorm.weight", &o.post_norm},
      {"mlp.gate_proj.weight", &o.wg},        {"mlp.up_proj.weight", &o.wu},      {"mlp.down_proj.weight", &o.wd},
      {"mlp.gate.weight", &o.router},         {"mlp.experts.gate_up_proj", &o.experts_gate_up}, {"mlp.experts.down_proj", &o.experts_down}};
  constexpr std::string_view kProjection[] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                              "mlp.gate_proj",    "mlp.up_proj",      "mlp.down_proj"};
  const std::string prefix = m.arch.names.blocks + ".0.";
  int64_t base_start = -1, adapter_start = -1, numel = 0;
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    if (m.tensors[t].block != 0) continue;
    const int64_t at = offset_of(static_cast<int>(t));
    int64_t& start = IsLoraAdapter(m.tensors[t].name) ? adapter_start : base_start;
    start = start < 0 ? at : std::min(start, at);
    numel += m.tensors[t].numel();
  }
  d.block_numel = numel;
  d.base_frozen = false;
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    if (m.tensors[t].block != 0) continue;
    std::string name = m.tensors[t].name.substr(prefix.size());
    const int64_t at = offset_of(static_cast<int>(t));
    if (IsLoraAdapter(name)) {
      const bool a = name.ends_with(kLoraASuffix);
      const std::string_view module = std::string_view(name).substr(0, name.size() - (a ? kLoraASuffix : kLoraBSuffix).size());
      for (int p = 0; p < LlamaDims::kProjections; ++p) {
        if (module == kProjection[p]) (a ? d.lora[p].a : d.lora[p].b) = at - adapter_start;
      }
      continue;
    }
    if (!m.tensors[t].trainable) d.base_frozen = true;
    if (const size_t base = name.find(kLoraBaseLayer); base != std::string::npos) name.erase(base, kLoraBaseLayer.size());
    for (const auto& [field_name, field] : fields) {
      if (name == field_name) *field = at - base_start;
    }
  }
}

int64_t BlockCache::SavedBytes() const {
  int64_t floats = x.size() + n1.size() + q.size() + k.size() + v.size() + attn.size() + x2.size() + n2.size() + gate.size() + up.size() +
                   mid.size() + inv1.size() + inv2.size() + q_heads.size() + k_heads.size() + inv_q.size() + inv_k.size();
  for (const auto& p : probs) floats += p.size();
  for (const auto& m : lora_mid) floats += m.size();
  for (const auto& m : lora_dropped) floats += m.size();
  int64_t bools = 0;
  for (const auto& k : lora_keep) bools += static_cast<int64_t>(k.size());
  floats += router_probs.size() + route_weight.size() + expert_out.size();
  const auto ints = static_cast<int64_t>(pair_token.size() + pair_slot.size());  // int32
  return floats * 4 + ints * 4 + static_cast<int64_t>(pair_begin.size()) * 8 + bools;
}

namespace {
// native_dropout's scale: 1 / (1 - p) in double, applied to fp32 values
float DropoutScale(double p) { return static_cast<float>(1.0 / (1.0 - p)); }
}  // namespace

Mat LoraDropoutForward(const DropoutKey& key, int projection, double p, const Mat& x, int64_t seq, std::vector<uint8_t>& keep) {
  const int64_t features = x.cols(), rows = x.rows();
  const double keep_probability = 1.0 - p;
  const float scale = DropoutScale(p);  // input * mask * scale
  keep.assign(static_cast<size_t>(x.size()), 0);
  Mat out(rows, features);
  for (int64_t first = 0; first < rows; first += seq) {
    const uint64_t stream[] = {key.seed, static_cast<uint64_t>(key.first_sequence + first / seq), static_cast<uint64_t>(key.block),
                               static_cast<uint64_t>(projection)};
    std::mt19937_64 rng(Fnv1a(std::string_view(reinterpret_cast<const char*>(stream), sizeof stream)));
    for (int64_t i = first * features; i < std::min(first + seq, rows) * features; ++i) {
      const bool kept = static_cast<double>(rng() >> 11) * 0x1p-53 < keep_probability;  // uniform in [0, 1), 53 bits
      keep[static_cast<size_t>(i)] = kept;
      out.data()[i] = kept ? x.data()[i] * scale : 0.0f;
    }
  }
  return out;
}

void DropAttentionCore(BlockCache& cache) { std::vector<Mat>().swap(cache.probs); }

int64_t RecomputeAttentionCore(const LlamaDims& d, BlockCache& cache, int64_t batch, int64_t seq) {
  AttentionProbs(cache.q, cache.k, batch, seq, d.heads, d.kv_heads, d.head_dim, cache.probs);
  int64_t floats = 0;
  for (const auto& p : cache.probs) floats += p.size();
  return floats * 4;
}

namespace {
ConstMatMap W(const float* p, int64_t rows, int64_t cols) { return ConstMatMap(p, rows, cols); }
Eigen::Map<const Vec> V(const float* p, int64_t n) { return Eigen::Map<const Vec>(p, n); }

// x (T, heads x head_dim) seen as one head per row, (T x heads, head_dim): the same row-major data.
Mat Heads(const Mat& x, int64_t head_dim) { return ConstMatMap(x.data(), x.size() / head_dim, head_dim); }
Mat Tokens(const Mat& heads, int64_t rows) { return ConstMatMap(heads.data(), rows, heads.size() / rows); }

// Qwen3's q_norm / k_norm: an RMSNorm over each head's features (Qwen3RMSNorm), `x` replaced by
// its normalised self; `pre` and `inv` keep what the backward needs.
void HeadNormForward(const LlamaDims& d, const float* w, Mat& x, Mat& pre, Vec& inv) {
  pre = Heads(x, d.head_dim);
  x = Tokens(RmsNormForward(pre, V(w, d.head_dim), d.rms_eps, inv), x.rows());
}

// The gradient through it: `dx` (of the normalised x) becomes that of x; dw accumulates.
void HeadNormBackward(const LlamaDims& d, const float* w, float* dw, Mat& dx, const Mat& pre, const Vec& inv) {
  Eigen::Map<Vec> g(dw, d.head_dim);
  dx = Tokens(RmsNormBackward(Heads(dx, d.head_dim), pre, V(w, d.head_dim), inv, g), dx.rows());
}
}  // namespace

namespace {
// What lora_A of projection `proj` reads: dropout(x) as the forward kept it when lora_dropout > 0, else x.
const Mat& LoraAInput(const LlamaDims& d, const BlockCache& c, int proj, const Mat& x) { return d.lora_dropout > 0 ? c.lora_dropped[proj] : x; }

// One projection of the block: x W^T, plus scale (dropout(x) A^T) B^T when LoRA adapts it (peft's
// lora.Linear.forward: base_layer(x) + lora_B(lora_A(dropout(x))) * scaling), dropout(x) A^T kept in
// the cache's lora_mid, with dropout dropout(x) and its mask in lora_dropped and lora_keep.
Mat Project(const LlamaDims& d, const BlockWeights& p, int64_t w, int proj, int64_t out, int64_t in, const Mat& x, int64_t seq, const DropoutKey& key,
            BlockCache& c) {
  Mat y = LinearForward(x, W(p.base + w, out, in));
  const LlamaDims::LoraOffsets lo = d.lora[proj];
  if (lo.a < 0) return y;
  if (d.lora_dropout > 0) c.lora_dropped[proj] = LoraDropoutForward(key, proj, d.lora_dropout, x, seq, c.lora_keep[proj]);
  Mat& mid = c.lora_mid[proj];
  mid = LinearForward(LoraAInput(d, c, proj, x), W(p.adapters + lo.a, d.lora_rank, in));
  y += LinearForward(mid, W(p.adapters + lo.b, out, d.lora_rank)) * d.lora_scale;
  return y;
}

// Its backward: returns dx; dW += dy^T x unless the base is frozen (no weight-gradient GEMM then);
// dB += (s dy)^T mid and dA += (s dy B)^T dropout(x) for the adapters, whose path's dx passes back
// through the dropout (native_dropout_backward: times keep / (1 - p)).
Mat ProjectBackward(const LlamaDims& d, const BlockWeights& p, const BlockGrads& g, int64_t w, int proj, int64_t out, int64_t in, const Mat& dy,
                    const Mat& x, const BlockCache& c) {
  Mat dx;
  if (d.base_frozen) {
    dx = dy * W(p.base + w, out, in);
  } else {
    MatMap gw(g.base + w, out, in);
    dx = LinearBackward(dy, x, W(p.base + w, out, in), gw);
  }
  const LlamaDims::LoraOffsets lo = d.lora[proj];
  if (lo.a < 0) return dx;
  MatMap gb(g.adapters + lo.b, out, d.lora_rank), ga(g.adapters + lo.a, d.lora_rank, in);
  const Mat d_mid = LinearBackward(dy * d.lora_scale, c.lora_mid[proj], W(p.adapters + lo.b, out, d.lora_rank), gb);
  const Mat d_a_in = LinearBackward(d_mid, LoraAInput(d, c, proj, x), W(p.adapters + lo.a, d.lora_rank, in), ga);
  if (d.lora_dropout == 0) return dx + d_a_in;
  const float scale = DropoutScale(d.lora_dropout);
  const std::vector<uint8_t>& keep = c.lora_keep[proj];
  for (size_t i = 0; i < keep.size(); ++i) dx.data()[i] += keep[i] ? d_a_in.data()[i] * scale : 0.0f;
  return dx;
}
}  // namespace

namespace {
// Qwen3-MoE's router (Qwen3MoeTopKRouter.forward): probs = softmax(x Wr^T) (T, experts); each
// token's experts_per_token largest, the lower index first among equal ones, their probabilities
// divided by their sum under norm_topk_prob. Fills the cache's router_probs, route_weight and the
// pairs grouped by expert (pair_begin, pair_token, pair_slot), within an expert by token.
void Route(const LlamaDims& d, const float* p, const Mat& x, BlockCache& c) {
  const int64_t tokens = x.rows(), k = d.experts_per_token;
  Mat logits = LinearForward(x, W(p + d.offsets.router, d.experts, d.hidden));
  c.router_probs.resize(tokens, d.experts);
  c.route_weight.resize(tokens, k);
  std::vector<int32_t> chosen(static_cast<size_t>(tokens * k));
  std::vector<int32_t> order(static_cast<size_t>(d.experts));
  c.pair_begin.assign(static_cast<size_t>(d.experts + 1), 0);
  for (int64_t t = 0; t < tokens; ++t) {
    auto probs = c.router_probs.row(t);
    probs = (logits.row(t).array() - logits.row(t).maxCoeff()).exp();
    probs /= probs.sum();
    for (int32_t e = 0; e < d.experts; ++e) order[static_cast<size_t>(e)] = e;
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int32_t a, int32_t b) { return probs(a) > probs(b) || (probs(a) == probs(b) && a < b); });
    float sum = 0;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = order[static_cast<size_t>(j)];
      chosen[static_cast<size_t>(t * k + j)] = e;
      c.route_weight(t, j) = probs(e);
      sum += probs(e);
      ++c.pair_begin[static_cast<size_t>(e) + 1];
    }
    if (d.norm_topk) c.route_weight.row(t) /= sum;
  }
  for (int64_t e = 0; e < d.experts; ++e) c.pair_begin[static_cast<size_t>(e) + 1] += c.pair_begin[static_cast<size_t>(e)];
  c.pair_token.resize(static_cast<size_t>(tokens * k));
  c.pair_slot.resize(static_cast<size_t>(tokens * k));
  std::vector<int64_t> next(c.pair_begin.begin(), c.pair_begin.end() - 1);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const auto pair = static_cast<size_t>(next[static_cast<size_t>(chosen[static_cast<size_t>(t * k + j)])]++);
      c.pair_token[pair] = static_cast<int32_t>(t);
      c.pair_slot[pair] = static_cast<int32_t>(j);
    }
  }
}

// Expert e's weights: gate_up (2 inner, hidden), gate's rows first, and down (hidden, inner).
struct ExpertWeights {
  ConstMatMap gate_up, down;
};
ExpertWeights ExpertOf(const LlamaDims& d, const float* p, int64_t e) {
  return {W(p + d.offsets.experts_gate_up + e * 2 * d.inner * d.hidden, 2 * d.inner, d.hidden),
          W(p + d.offsets.experts_down + e * d.hidden * d.inner, d.hidden, d.inner)};
}

// The rows of x at the pairs' tokens [begin, begin + n).
Mat GatherPairs(const Mat& x, const BlockCache& c, int64_t begin, int64_t n) {
  Mat rows(n, x.cols());
  for (int64_t i = 0; i < n; ++i) rows.row(i) = x.row(c.pair_token[static_cast<size_t>(begin + i)]);
  return rows;
}

// Routed experts' forward (Qwen3MoeExperts.forward): y (T, h) = sum over a token's pairs of
// weight * down_e(silu(gate_e x) * up_e x).
Mat MoeForward(const LlamaDims& d, const float* p, const Mat& x, BlockCache& c) {
  Route(d, p, x, c);
  const int64_t pairs = x.rows() * d.experts_per_token;
  c.gate.resize(pairs, d.inner);
  c.up.resize(pairs, d.inner);
  c.mid.resize(pairs, d.inner);
  c.expert_out.resize(pairs, d.hidden);
  Mat y = Mat::Zero(x.rows(), d.hidden);
  for (int64_t e = 0; e < d.experts; ++e) {
    const int64_t begin = c.pair_begin[static_cast<size_t>(e)], n = c.pair_begin[static_cast<size_t>(e) + 1] - begin;
    if (n == 0) continue;
    const ExpertWeights ew = ExpertOf(d, p, e);
    const Mat gate_up = LinearForward(GatherPairs(x, c, begin, n), ew.gate_up);
    c.gate.middleRows(begin, n) = gate_up.leftCols(d.inner);
    c.up.middleRows(begin, n) = gate_up.rightCols(d.inner);
    c.mid.middleRows(begin, n) = SwiGluForward(c.gate.middleRows(begin, n), c.up.middleRows(begin, n));
    c.expert_out.middleRows(begin, n) = LinearForward(c.mid.middleRows(begin, n), ew.down);
    for (int64_t i = 0; i < n; ++i) {
      const auto pair = static_cast<size_t>(begin + i);
      y.row(c.pair_token[pair]) += c.route_weight(c.pair_token[pair], c.pair_slot[pair]) * c.expert_out.row(begin + i);
    }
  }
  return y;
}

// dx = dy W, and dW += dy^T x unless the base is frozen (`g` null).
Mat LinearGrad(const Mat& dy, const Mat& x, const ConstMatMap& w, float* g) {
  if (!g) return dy * w;
  MatMap gw(g, w.rows(), w.cols());
  return LinearBackward(dy, x, w, gw);
}

// Expert e's first pair (pair_begin[e]); e = experts: the end of the last expert's.
size_t PairsBegin(const BlockCache& c, int64_t e) { return static_cast<size_t>(c.pair_begin[static_cast<size_t>(e)]); }

// The router's backward: d_weight (T, k) of each token's chosen weights -> the gradient of the
// softmax's input, through the division by their sum s under norm_topk_prob
// (w_j = p_j / s: dp_j = (dw_j - sum_i dw_i w_i) / s).
Mat RouterLogitsGrad(const LlamaDims& d, const BlockCache& c, const Mat& d_weight) {
  const int64_t tokens = c.router_probs.rows();
  Vec chosen_sum = Vec::Zero(tokens), weighted = Vec::Zero(tokens);
  for (int64_t e = 0; e < d.experts; ++e) {
    for (size_t pair = PairsBegin(c, e); pair < PairsBegin(c, e + 1); ++pair) {
      chosen_sum(c.pair_token[pair]) += c.router_probs(c.pair_token[pair], e);
    }
  }
  if (d.norm_topk) weighted = d_weight.cwiseProduct(c.route_weight).rowwise().sum();
  Mat d_probs = Mat::Zero(tokens, d.experts);
  for (int64_t e = 0; e < d.experts; ++e) {
    for (size_t pair = PairsBegin(c, e); pair < PairsBegin(c, e + 1); ++pair) {
      const int32_t t = c.pair_token[pair], j = c.pair_slot[pair];
      d_probs(t, e) = d.norm_topk ? (d_weight(t, j) - weighted(t)) / chosen_sum(t) : d_weight(t, j);
    }
  }
  const Vec inner = d_probs.cwiseProduct(c.router_probs).rowwise().sum();  // the softmax's backward
  return c.router_probs.cwiseProduct(d_probs - inner.replicate(1, d.experts));
}

// Its backward: returns d x (T, h); the experts' and the router's gradients into g (null: frozen).
Mat MoeBackward(const LlamaDims& d, const float* p, float* g, const Mat& dy, const Mat& x, const BlockCache& c) {
  Mat dx = Mat::Zero(x.rows(), d.hidden);
  Mat d_weight = Mat::Zero(x.rows(), d.experts_per_token);
  for (int64_t e = 0; e < d.experts; ++e) {
    const int64_t begin = c.pair_begin[static_cast<size_t>(e)], n = c.pair_begin[static_cast<size_t>(e) + 1] - begin;
    if (n == 0) continue;
    const ExpertWeights ew = ExpertOf(d, p, e);
    Mat d_out = GatherPairs(dy, c, begin, n);
    for (int64_t i = 0; i < n; ++i) {
      const int32_t t = c.pair_token[static_cast<size_t>(begin + i)], j = c.pair_slot[static_cast<size_t>(begin + i)];
      d_weight(t, j) = d_out.row(i).dot(c.expert_out.row(begin + i));
      d_out.row(i) *= c.route_weight(t, j);
    }
    const Mat d_mid = LinearGrad(d_out, c.mid.middleRows(begin, n), ew.down, g ? g + d.offsets.experts_down + e * d.hidden * d.inner : nullptr);
    Mat d_gate, d_up, d_gate_up(n, 2 * d.inner);
    SwiGluBackward(d_mid, c.gate.middleRows(begin, n), c.up.middleRows(begin, n), d_gate, d_up);
    d_gate_up << d_gate, d_up;
    const Mat d_in = LinearGrad(d_gate_up, GatherPairs(x, c, begin, n), ew.gate_up,
                                g ? g + d.offsets.experts_gate_up + e * 2 * d.inner * d.hidden : nullptr);
    for (int64_t i = 0; i < n; ++i) dx.row(c.pair_token[static_cast<size_t>(begin + i)]) += d_in.row(i);
  }
  return dx + LinearGrad(RouterLogitsGrad(d, c, d_weight), x, W(p + d.offsets.router, d.experts, d.hidden), g ? g + d.offsets.router : nullptr);
}
}  // namespace

Mat BlockForward(const LlamaDims& d, const BlockWeights& w, const Mat& x, int64_t batch, int64_t seq, BlockCache* cache, const DropoutKey& key) {
  const auto o = d.Offsets();
  const float* p = w.base;
  const int64_t qd = d.heads * d.head_dim, kvd = d.kv_heads * d.head_dim;
  BlockCache local;
  BlockCache& c = cache ? *cache : local;
  c.x = x;
  c.n1 = RmsNormForward(x, V(p + o.in_norm, d.hidden), d.rms_eps, c.inv1);
  c.q = Project(d, w, o.wq, LlamaDims::kQ, qd, d.hidden, c.n1, seq, key, c);
  c.k = Project(d, w, o.wk, LlamaDims::kK, kvd, d.hidden, c.n1, seq, key, c);
  c.v = Project(d, w, o.wv, LlamaDims::kV, kvd, d.hidden, c.n1, seq, key, c);
  if (d.qkv_bias) {
    c.q.rowwise() += V(p + o.bq, qd).transpose();
    c.k.rowwise() += V(p + o.bk, kvd).transpose();
    c.v.rowwise() += V(p + o.bv, kvd).transpose();
  }
  if (d.qk_norm) {
    HeadNormForward(d, p + o.q_norm, c.q, c.q_heads, c.inv_q);
    HeadNormForward(d, p + o.k_norm, c.k, c.k_heads, c.inv_k);
  }
  Rope(c.q, d.heads, d.head_dim, seq, d.rope_inv_freq, false);
  Rope(c.k, d.kv_heads, d.head_dim, seq, d.rope_inv_freq, false);
  c.attn = AttentionForward(c.q, c.k, c.v, batch, seq, d.heads, d.kv_heads, d.head_dim, c.probs);
  c.x2 = x + Project(d, w, o.wo, LlamaDims::kO, d.hidden, qd, c.attn, seq, key, c);
  c.n2 = RmsNormForward(c.x2, V(p + o.post_norm, d.hidden), d.rms_eps, c.inv2);
  if (d.experts > 0) return c.x2 + MoeForward(d, p, c.n2, c);
  c.gate = Project(d, w, o.wg, LlamaDims::kGate, d.inner, d.hidden, c.n2, seq, key, c);
  c.up = Project(d, w, o.wu, LlamaDims::kUp, d.inner, d.hidden, c.n2, seq, key, c);
  c.mid = SwiGluForward(c.gate, c.up);
  return c.x2 + Project(d, w, o.wd, LlamaDims::kDown, d.hidden, d.inner, c.mid, seq, key, c);
}

Mat BlockBackward(const LlamaDims& d, const BlockWeights& w, const BlockGrads& grads, const Mat& dy, const BlockCache& c, int64_t batch,
                  int64_t seq) {
  const auto o = d.Offsets();
  const float* p = w.base;
  const int64_t qd = d.heads * d.head_dim, kvd = d.kv_heads * d.head_dim;
  // a frozen base's norms still pass the gradient through; their weights' gradients go to a scratch
  std::vector<float> scratch(d.base_frozen ? static_cast<size_t>(std::max(d.hidden, d.head_dim)) : 0);
  auto norm_grad = [&](int64_t off, int64_t n) { return Eigen::Map<Vec>(d.base_frozen ? scratch.data() : grads.base + off, n); };
  Eigen::Map<Vec> g_post = norm_grad(o.post_norm, d.hidden);
  // MLP branch
  Mat d_n2;
  if (d.experts > 0) {
    d_n2 = MoeBackward(d, p, d.base_frozen ? nullptr : grads.base, dy, c.n2, c);
  } else {
    Mat d_mid = ProjectBackward(d, w, grads, o.wd, LlamaDims::kDown, d.hidden, d.inner, dy, c.mid, c);
    Mat d_gate, d_up;
    SwiGluBackward(d_mid, c.gate, c.up, d_gate, d_up);
    d_n2 = ProjectBackward(d, w, grads, o.wg, LlamaDims::kGate, d.inner, d.hidden, d_gate, c.n2, c) +
           ProjectBackward(d, w, grads, o.wu, LlamaDims::kUp, d.inner, d.hidden, d_up, c.n2, c);
  }
  Mat d_x2 = dy + RmsNormBackward(d_n2, c.x2, V(p + o.post_norm, d.hidden), c.inv2, g_post);
  // attention branch
  Mat d_attn = ProjectBackward(d, w, grads, o.wo, LlamaDims::kO, d.hidden, qd, d_x2, c.attn, c);
  Mat dq, dk, dv;
  AttentionBackward(d_attn, c.q, c.k, c.v, c.probs, batch, seq, d.heads, d.kv_heads, d.head_dim, dq, dk, dv);
  Rope(dq, d.heads, d.head_dim, seq, d.rope_inv_freq, true);
  Rope(dk, d.kv_heads, d.head_dim, seq, d.rope_inv_freq, true);
  if (d.qk_norm) {
    HeadNormBackward(d, p + o.q_norm, norm_grad(o.q_norm, d.head_dim).data(), dq, c.q_heads, c.inv_q);
    HeadNormBackward(d, p + o.k_norm, norm_grad(o.k_norm, d.head_dim).data(), dk, c.k_heads, c.inv_k);
  }
  if (d.qkv_bias && !d.base_frozen) {  // the projections' outputs' gradients, summed over tokens
    Eigen::Map<Vec>(grads.base + o.bq, qd) += dq.colwise().sum().transpose();
    Eigen::Map<Vec>(grads.base + o.bk, kvd) += dk.colwise().sum().transpose();
    Eigen::Map<Vec>(grads.base + o.bv, kvd) += dv.colwise().sum().transpose();
  }
  Mat d_n1 = ProjectBackward(d, w, grads, o.wq, LlamaDims::kQ, qd, d.hidden, dq, c.n1, c) +
             ProjectBackward(d, w, grads, o.wk, LlamaDims::kK, kvd, d.hidden, dk, c.n1, c) +
             ProjectBackward(d, w, grads, o.wv, LlamaDims::kV, kvd, d.hidden, dv, c.n1, c);
  Eigen::Map<Vec> g_in = norm_grad(o.in_norm, d.hidden);
  return d_x2 + RmsNormBackward(d_n1, c.x, V(p + o.in_norm, d.hidden), c.inv1, g_in);
}

}  // namespace fsdp::runtime
