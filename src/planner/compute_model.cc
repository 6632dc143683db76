#include "planner/compute_model.h"

#include <algorithm>

#include <vector>

#include "planner/activation_model.h"

namespace fsdp {
namespace {

// Bytes AdamW's foreach step moves per sharded element: param r+w (8), grad r (4), exp_avg and
// exp_avg_sq r+w (16), the sqrt temporary w+r (8).
constexpr double kAdamBytesPerElement = 36.0;
constexpr double kSgdBytesPerElement = 12.0;   // param r+w, grad r
constexpr double kBackwardTrafficFactor = 2.0;
// Backward GEMMs compute the input and the weight gradients: 2x the forward FLOPs. FlashAttention-2
// backward runs 5 matmuls for the forward's 2 (it recomputes the scores): 2.5x.
constexpr double kBackwardGemmFactor = 2.0;
constexpr double kFlashBackwardFactor = 2.5;

struct NodeWork {
  double gemm_flops = 0;        // forward GEMMs of the node's own weights, per micro-batch
  double frozen_gemm_flops = 0; // of those, the ones of weights without gradients: no weight-gradient GEMM in backward
  double nf4_gemm_flops = 0;    // of those, QLoRA's quantized weights': multiplied in bnb_4bit_compute_dtype
  double attention_flops = 0;   // forward score and value products
  double traffic_bytes = 0;     // forward memory-bound traffic
  double dequant_bytes = 0;     // QLoRA: traffic of dequantizing the NF4 weights, once per forward and once per backward
};

// A weight the forward multiplies by: a linear's [out, in] (GPT-2's Conv1D [in, out]) or fused
// routed experts' [experts, out, in], each token through experts_per_token of them (active_share).
// A vision tower's (image_only) runs in no text-only step.
bool IsMatmulWeight(const TensorSpec& t) { return t.in_linear && t.shape.size() >= 2 && !t.image_only; }

// Forward work of a module-tree node (its own tensors and role), not of its children.
NodeWork OwnWork(const Workload& w, const ModuleNode& n, const BlockActivations& block, const HeadActivations& head,
                 double traffic_per_saved_byte) {
  const ModelSpec& m = w.model;
  const double tokens = static_cast<double>(w.TokensPerMicroBatch());
  NodeWork work;
  for (int t : n.tensors) {
    const TensorSpec& ts = m.tensors[t];
    if (!IsMatmulWeight(ts)) continue;
    const double share = ts.ComputedShare();
    work.gemm_flops += 2.0 * static_cast<double>(ts.LogicalNumel()) * tokens * share;
    if (!ts.trainable) work.frozen_gemm_flops += 2.0 * static_cast<double>(ts.LogicalNumel()) * tokens * share;
    if (ts.nf4_numel > 0) {
      work.nf4_gemm_flops += 2.0 * static_cast<double>(ts.LogicalNumel()) * tokens * share;
      work.dequant_bytes += Nf4DequantTrafficBytes(ts.nf4_numel, QloraComputeDtype(w.config));
    }
  }
  const bool flash = w.config.attention == Attention::kFlash;
  const double seq = static_cast<double>(w.config.seq_len);
  const double keys = flash ? (seq + 1) / 2 : seq;  // causal flash skips the masked half
  if (n.role == ModuleNode::Role::kBlock) {
    // q k^T over q's and k's head dim, probs @ v over v's (they differ in MLA)
    work.attention_flops = 2.0 * keys * static_cast<double>(m.num_heads * (m.head_dim + m.ValueHeadDim())) * tokens;
    work.traffic_bytes = traffic_per_saved_byte * static_cast<double>(block.FullBytes());
  } else if (n.role == ModuleNode::Role::kLmHead) {
    if (n.tensors.empty()) {  // tied: the embedding's weight
      const double flops = 2.0 * static_cast<double>(m.vocab_size * m.hidden_size) * tokens;
      work.gemm_flops += flops;
      if (!m.tensors.front().trainable) work.frozen_gemm_flops += flops;
    }
    work.traffic_bytes = traffic_per_saved_byte *
                         static_cast<double>(head.logits_bytes + head.loss_saved_bytes + head.loss_forward_transient_bytes + head.shift_copy_bytes);
  } else if (n.role == ModuleNode::Role::kFinalNorm) {
    work.traffic_bytes = traffic_per_saved_byte * static_cast<double>(SumBytes(head.final_norm));
  }
  return work;
}

// The decoder block (0-based) a node belongs to, or -1 outside the blocks.
int EnclosingBlock(const Workload& w, int node) {
  for (; node >= 0; node = w.nodes[node].parent) {
    if (w.nodes[node].role == ModuleNode::Role::kBlock) return w.nodes[node].block;
  }
  return -1;
}

int OwningUnit(const Workload& w, int node) {
  while (w.nodes[node].unit < 0) node = w.nodes[node].parent;
  return w.nodes[node].unit;
}

double MatmulParams(const ModelSpec& m) {
  double n = 0;
  for (const auto& t : m.tensors) {
    if (!IsMatmulWeight(t)) continue;
    n += static_cast<double>(t.LogicalNumel()) * t.active_share;
  }
  if (m.tie_word_embeddings) n += static_cast<double>(m.vocab_size * m.hidden_size);
  return n;
}

bool RunsMatmul(const Workload& w, const ModuleNode& n) {
  for (int t : n.tensors) {
    if (IsMatmulWeight(w.model.tensors[t])) return true;
  }
  return false;
}

// The linear modules whose products torchtitan's op-level policy (--ac selective-op) runs again in
// backward: the second, fourth, ... matmul of each block (k, o and up in a Llama block), in the
// order the block runs them, which is the module tree's (children in execution order).
std::vector<bool> OpRecomputedMatmuls(const Workload& w) {
  std::vector<bool> recomputed(w.nodes.size(), false);
  for (const ModuleNode& block : w.nodes) {
    if (block.role != ModuleNode::Role::kBlock) continue;
    int calls = 0;
    std::vector<int> pending(block.children.rbegin(), block.children.rend());  // depth first, in order
    while (!pending.empty()) {
      const int id = pending.back();
      pending.pop_back();
      if (RunsMatmul(w, w.nodes[id]) && ++calls % 2 == 0) recomputed[id] = true;
      pending.insert(pending.end(), w.nodes[id].children.rbegin(), w.nodes[id].children.rend());
    }
  }
  return recomputed;
}

}  // namespace

double Nf4DequantTrafficBytes(int64_t weight_numel, DType compute_dtype) {
  // reads the packed codes (n / 2 bytes) and one absmax per 64, writes n weights in the compute dtype
  const double n = static_cast<double>(weight_numel);
  return n / 2 + n / 64 * 4 + n * static_cast<double>(BytesPerElement(compute_dtype));
}

double OptimizerSeconds(const Workload& w) {
  const double elements = static_cast<double>(w.GradShardNumelTotal());
  const bool adam = w.config.optimizer == Optimizer::kAdamW || w.config.optimizer == Optimizer::kAdam;
  if (w.config.cpu_offload) return elements / kHostAdamElementsPerSecond * (adam ? 1.0 : kSgdBytesPerElement / kAdamBytesPerElement);
  // every term moves master-dtype elements (fp32 above; bf16 halves them under pure bf16)
  const double bytes = elements * (adam ? kAdamBytesPerElement : kSgdBytesPerElement) * static_cast<double>(BytesPerElement(w.config.master_dtype)) / 4;
  return bytes / (w.hardware.memory_bandwidth_bytes_per_s * w.hardware.memory_efficiency);
}

ComputeModel EstimateUnitCompute(const Workload& w, double traffic_per_saved_byte) {
  ComputeModel cm;
  cm.units.assign(w.units.size(), UnitCompute{});
  cm.nodes.assign(w.nodes.size(), NodeCompute{});
  const BlockActivations block = BlockActivationProfile(w.model, w.config);
  // a routed model's dense layers (Architecture::dense_block) save what their own shape does
  const auto& dense_layers = w.model.arch.dense_layers;
  const auto first_dense = std::find(dense_layers.begin(), dense_layers.end(), true);
  const BlockActivations dense_block =
      first_dense == dense_layers.end() ? block : BlockActivationProfile(w.model.LayerShape(static_cast<int>(first_dense - dense_layers.begin())), w.config);
  const HeadActivations head = HeadActivationProfile(w.model, w.config);
  const double gemm_rate = w.hardware.PeakFlops(w.config.param_dtype) * w.hardware.matmul_efficiency;
  // the attention's products run at their own measured rate when the hardware file has one
  const double attention_rate = w.hardware.attention_efficiency > 0 ? w.hardware.PeakFlops(w.config.param_dtype) * w.hardware.attention_efficiency
                                                                     : gemm_rate;
  const double mem_rate = w.hardware.memory_bandwidth_bytes_per_s * w.hardware.memory_efficiency;
  // QLoRA's quantized weights multiply in bnb_4bit_compute_dtype (fp32: no tensor-core rate), the
  // rest in the param dtype
  const double nf4_rate = w.hardware.PeakFlops(QloraComputeDtype(w.config)) * w.hardware.matmul_efficiency;
  auto gemm_seconds = [&](double flops, double nf4_flops) {
    return nf4_flops == 0 || nf4_rate == gemm_rate ? flops / gemm_rate : (flops - nf4_flops) / gemm_rate + nf4_flops / nf4_rate;
  };
  const bool flash = w.config.attention == Attention::kFlash;
  const Checkpointing ac = w.config.checkpointing;
  const std::vector<bool> op_recomputed = ac == Checkpointing::kSelectiveOp ? OpRecomputedMatmuls(w) : std::vector<bool>(w.nodes.size(), false);
  const double recomputed_bytes = static_cast<double>(SumBytes(block.recomputed));
  for (int id = 0; id < static_cast<int>(w.nodes.size()); ++id) {
    const ModuleNode& n = w.nodes[id];
    const NodeWork work = OwnWork(w, n, n.role == ModuleNode::Role::kBlock && w.model.arch.DenseLayer(n.block) ? dense_block : block, head,
                                  traffic_per_saved_byte);
    UnitCompute& u = cm.units[OwningUnit(w, id)];
    NodeCompute& own = cm.nodes[id];
    const double fwd_flops = work.gemm_flops + work.attention_flops;
    // backward: the input gradient of every GEMM, the weight gradient of the trainable ones
    const double bwd_gemm_flops = kBackwardGemmFactor * work.gemm_flops - work.frozen_gemm_flops;
    const double bwd_flops = bwd_gemm_flops + (flash ? kFlashBackwardFactor : kBackwardGemmFactor) * work.attention_flops;
    const double attn_bwd = (flash ? kFlashBackwardFactor : kBackwardGemmFactor) * work.attention_flops;
    // (bitsandbytes' MatMul4Bit dequantizes the weight in forward and again for the input gradient)
    const double fwd_gemm_s = gemm_seconds(work.gemm_flops, work.nf4_gemm_flops);
    const double fwd_s = fwd_gemm_s + work.attention_flops / attention_rate + (work.traffic_bytes + work.dequant_bytes) / mem_rate;
    own.forward_s = fwd_s;
    // a quantized weight is frozen: its input gradient's GEMM only
    own.backward_s = gemm_seconds(bwd_gemm_flops, (kBackwardGemmFactor - 1) * work.nf4_gemm_flops) + attn_bwd / attention_rate +
                     (kBackwardTrafficFactor * work.traffic_bytes + work.dequant_bytes) / mem_rate;
    double recompute_flops = 0;
    const int block_index = EnclosingBlock(w, id);
    if (ac == Checkpointing::kFull && block_index >= 0 && BlockCheckpointed(w.config, block_index)) {
      // checkpoint_wrapper reruns the whole block forward (its linears included) in backward
      recompute_flops = fwd_flops;
      own.recompute_s = fwd_s;
    } else if ((ac == Checkpointing::kSelective || ac == Checkpointing::kSelectiveOp) && n.role == ModuleNode::Role::kBlock) {
      // selective: the checkpointed attention function runs again (eager or SDPA), rewriting its
      // core tensors; selective-op: every op but the kept ones, so the attention core unless SDPA's
      // output is kept (flash), and all the memory-bound ops (the matmuls it reruns come below)
      const bool core = ac == Checkpointing::kSelective || !flash;
      recompute_flops = core ? work.attention_flops : 0.0;
      own.recompute_s = (core ? work.attention_flops / attention_rate : 0.0) + traffic_per_saved_byte * recomputed_bytes / mem_rate;
    } else if (op_recomputed[id]) {
      recompute_flops = work.gemm_flops;
      own.recompute_s = fwd_gemm_s;
    }
    u.forward_flops += fwd_flops;
    u.forward_s += own.forward_s;
    u.backward_flops += bwd_flops;
    u.backward_s += own.backward_s;
    u.recompute_flops += recompute_flops;
    u.recompute_s += own.recompute_s;
  }
  cm.segments_s = SegmentSeconds(*w.walk, cm.nodes);
  const ModelSpec& m = w.model;
  cm.model_flops_per_token = 6.0 * MatmulParams(m) +
                             6.0 * static_cast<double>(m.num_layers * w.config.seq_len * m.num_heads * (m.head_dim + m.ValueHeadDim()));
  return cm;
}

ComputeModel ComputeFromNodes(const Workload& w, std::vector<NodeCompute> nodes, double optimizer_s) {
  ComputeModel cm;
  cm.units.assign(w.units.size(), UnitCompute{});
  for (int id = 0; id < static_cast<int>(w.nodes.size()); ++id) {
    UnitCompute& u = cm.units[OwningUnit(w, id)];
    u.forward_s += nodes[id].forward_s;
    u.backward_s += nodes[id].backward_s;
    u.recompute_s += nodes[id].recompute_s;
  }
  cm.nodes = std::move(nodes);
  cm.segments_s = SegmentSeconds(*w.walk, cm.nodes);
  cm.model_flops_per_token = 1;
  const double micro = static_cast<double>(w.config.grad_accum);
  for (const UnitCompute& u : cm.units) cm.compute_s_per_step += micro * (u.forward_s + u.backward_s + u.recompute_s);
  cm.optimizer_s = optimizer_s;
  cm.compute_s_per_step += optimizer_s;
  return cm;
}

std::vector<double> SegmentSeconds(const ModuleWalk& walk, const std::vector<NodeCompute>& nodes) {
  std::vector<double> seconds;
  seconds.reserve(walk.segments.size());
  for (const ComputeSegment& segment : walk.segments) {
    double s = 0;
    for (int i = segment.first_visit; i < segment.first_visit + segment.visit_count; ++i) {
      const NodeVisit& v = walk.visits[i];
      const NodeCompute& n = nodes[v.node];
      if (segment.forward) s += n.forward_s;
      else if (v.enter) s += n.backward_s + n.recompute_s;
    }
    seconds.push_back(s);
  }
  return seconds;
}

void FinishCompute(const Workload& w, ComputeModel& cm) {
  const double micro = static_cast<double>(w.config.grad_accum);
  cm.executed_flops_per_step = 0;
  cm.compute_s_per_step = 0;
  for (const auto& u : cm.units) {
    cm.executed_flops_per_step += micro * (u.forward_flops + u.backward_flops + u.recompute_flops);
    cm.compute_s_per_step += micro * (u.forward_s + u.backward_s + u.recompute_s);
  }
  cm.optimizer_s = OptimizerSeconds(w);
  cm.compute_s_per_step += cm.optimizer_s;
}

ComputeModel EstimateCompute(const Workload& w, double traffic_per_saved_byte) {
  ComputeModel cm = EstimateUnitCompute(w, traffic_per_saved_byte);
  FinishCompute(w, cm);
  return cm;
}

}  // namespace fsdp
