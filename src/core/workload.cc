#include "core/workload.h"

#include <algorithm>
#include <functional>
#include <map>

#include <fmt/format.h>

#include "core/lora.h"

namespace fsdp {
namespace {

bool IsNumber(const std::string& s) {
  return !s.empty() && s.find_first_not_of("0123456789") == std::string::npos;
}

std::string LastComponent(const std::string& path) {
  auto dot = path.rfind('.');
  return dot == std::string::npos ? path : path.substr(dot + 1);
}

// Creates (or finds) the node for `path` and all its ancestors.
int EnsureNode(std::vector<ModuleNode>& nodes, std::map<std::string, int>& index, const std::string& path) {
  if (auto it = index.find(path); it != index.end()) return it->second;
  auto dot = path.rfind('.');
  int parent = EnsureNode(nodes, index, dot == std::string::npos ? std::string() : path.substr(0, dot));
  int id = static_cast<int>(nodes.size());
  nodes.push_back(ModuleNode{path, parent, {}, {}, ModuleNode::Role::kOther, -1, -1, 0, -1});
  nodes[parent].children.push_back(id);
  index[path] = id;
  return id;
}

void AssignRoles(std::vector<ModuleNode>& nodes, const ModelSpec& model) {
  const ModuleNames& names = model.arch.names;
  const std::string prefix = names.blocks + ".";
  for (auto& n : nodes) {
    if (n.path.starts_with(prefix) && IsNumber(n.path.substr(prefix.size()))) {
      n.role = ModuleNode::Role::kBlock;
      n.block = std::stoi(n.path.substr(prefix.size()));
    } else if (n.path == names.embedding) {
      n.role = ModuleNode::Role::kEmbedding;
    } else if (n.path == names.final_norm) {
      n.role = ModuleNode::Role::kFinalNorm;
    } else if (n.path == names.lm_head) {
      n.role = ModuleNode::Role::kLmHead;
    }
  }
}

// torchtitan's apply_fsdp shards [norm, output] as one group (fully_shard on a list of modules):
// a node of its own, between the decoder and the loss, whose children are the final norm and
// lm_head (their paths and roles unchanged), so that the walk hooks the group around both.
void GroupFinalNormWithLmHead(std::vector<ModuleNode>& nodes) {
  int norm = -1, head = -1;
  for (int i = 0; i < static_cast<int>(nodes.size()); ++i) {
    if (nodes[i].role == ModuleNode::Role::kFinalNorm) norm = i;
    if (nodes[i].role == ModuleNode::Role::kLmHead) head = i;
  }
  if (norm < 0 || head < 0 || nodes[head].parent != 0) return;  // TorchtitanRuledOut keeps such models out
  auto detach = [&](int id) {
    std::vector<int>& siblings = nodes[nodes[id].parent].children;
    siblings.erase(std::find(siblings.begin(), siblings.end(), id));
  };
  detach(norm);
  detach(head);
  const int group = static_cast<int>(nodes.size());
  nodes.push_back(ModuleNode{std::string(kNormOutputGroup), 0, {norm, head}, {}, ModuleNode::Role::kOther, -1, -1, 0, -1});
  nodes[norm].parent = group;
  nodes[head].parent = group;
  nodes[0].children.push_back(group);
}

std::vector<ModuleNode> BuildModuleTree(const ModelSpec& model, Impl impl) {
  std::vector<ModuleNode> nodes;
  nodes.push_back(ModuleNode{});
  std::map<std::string, int> index{{"", 0}};
  for (int t = 0; t < static_cast<int>(model.tensors.size()); ++t) {
    int node = EnsureNode(nodes, index, model.tensors[t].module());
    nodes[node].tensors.push_back(t);
  }
  // A tied lm_head owns no parameter but still runs (and holds the logits): give it a node.
  EnsureNode(nodes, index, model.arch.names.lm_head);
  AssignRoles(nodes, model);
  if (impl == Impl::kTorchtitan) GroupFinalNormWithLmHead(nodes);
  std::function<int64_t(int)> count = [&](int id) {
    int64_t n = 0;
    ModuleNode& node = nodes[id];
    auto first = [&](int t) { if (t >= 0 && (node.first_tensor < 0 || t < node.first_tensor)) node.first_tensor = t; };
    for (int t : node.tensors) {
      n += model.tensors[t].numel();
      first(t);
    }
    for (int c : node.children) {
      n += count(c);
      first(nodes[c].first_tensor);
    }
    node.numel = n;
    return n;
  };
  count(0);
  return nodes;
}

// True for containers that size_based_auto_wrap_policy never wraps (nn.ModuleList / ModuleDict).
bool IsModuleList(const std::vector<ModuleNode>& nodes, const ModuleNode& n) {
  if (n.children.empty() || !n.tensors.empty()) return false;
  for (int c : n.children) if (!IsNumber(LastComponent(nodes[c].path))) return false;
  return true;
}

// size_based_auto_wrap_policy: bottom-up, wrap a module when the parameters not already wrapped
// below it reach min_params (torch/distributed/fsdp/wrap.py). Returns the unwrapped count.
int64_t MarkSizeBased(std::vector<ModuleNode>& nodes, const ModelSpec& model, int id, int64_t min_params) {
  int64_t nonwrapped = 0;
  for (int t : nodes[id].tensors) nonwrapped += model.tensors[t].numel();
  for (int c : nodes[id].children) nonwrapped += MarkSizeBased(nodes, model, c, min_params);
  if (id != 0 && nonwrapped >= min_params && !IsModuleList(nodes, nodes[id])) {
    nodes[id].unit = 1;  // marked; numbered later in pre-order
    return 0;
  }
  return nonwrapped;
}

void MarkUnits(std::vector<ModuleNode>& nodes, const ModelSpec& model, const FsdpConfig& config) {
  for (auto& n : nodes) {
    switch (config.wrap) {
      case WrapPolicy::kBlock:
        if (n.role == ModuleNode::Role::kBlock) n.unit = 1;
        // torchtitan's apply_fsdp: tok_embeddings, each block, [norm, output], then the model
        if (config.impl == Impl::kTorchtitan && (n.role == ModuleNode::Role::kEmbedding || n.path == kNormOutputGroup)) n.unit = 1;
        break;
      case WrapPolicy::kLinear:
        if (!n.tensors.empty() && model.tensors[n.tensors.front()].in_linear) n.unit = 1;
        break;
      case WrapPolicy::kPeft:
        // peft's fsdp_auto_wrap_policy: the decoder layers, and every leaf module whose weight
        // requires grad (the LoRA adapters) in a unit of its own (peft/utils/other.py)
        if (n.role == ModuleNode::Role::kBlock ||
            (n.children.empty() && !n.tensors.empty() && model.tensors[n.tensors.front()].trainable && n.path != "")) {
          n.unit = 1;
        }
        break;
      case WrapPolicy::kNone:
      case WrapPolicy::kSize: break;
    }
  }
  if (config.wrap == WrapPolicy::kSize) MarkSizeBased(nodes, model, 0, config.wrap_min_params);
  nodes[0].unit = 1;
}

// Numbers marked nodes in pre-order and collects each unit's tensors (those not claimed by a
// nested unit).
void CollectUnits(Workload& w, int id, int enclosing_unit) {
  ModuleNode& n = w.nodes[id];
  int unit = enclosing_unit;
  if (n.unit >= 0) {
    unit = static_cast<int>(w.units.size());
    n.unit = unit;
    WrapUnit u;
    u.name = id == 0 ? "root" : n.path;
    u.node = id;
    u.parent_unit = enclosing_unit;
    u.is_root = id == 0;
    if (n.path == kNormOutputGroup) u.hook_nodes = n.children;  // norm, then lm_head
    // apply_fsdp: torchtitan 0.2.2's [norm, output] with reshard_after_forward=(policy == "always"),
    // January 2025's last block with `int(layer_id) < len(model.layers) - 1`: their backward comes first
    u.reshard_after_forward = n.path != kNormOutputGroup &&
                              !(w.config.impl == Impl::kTorchtitan202501 && n.role == ModuleNode::Role::kBlock && n.block == w.model.num_layers - 1);
    w.units.push_back(std::move(u));
  }
  for (int t : n.tensors) w.units[unit].tensors.push_back(t);
  for (int c : w.nodes[id].children) CollectUnits(w, c, unit);
}

void CollectPostOrder(const Workload& w, int id, std::vector<int>& order) {
  for (int c : w.nodes[id].children) CollectPostOrder(w, c, order);
  if (w.nodes[id].unit >= 0) order.push_back(w.nodes[id].unit);
}

}  // namespace

int64_t Fsdp2ShardNumel(const TensorSpec& tensor, int64_t world) {
  const int64_t rest = tensor.numel() / tensor.shape[0];
  return RoundUp(tensor.shape[0], world) / world * rest;
}

int64_t PaddedNumel(const ModelSpec& model, const std::vector<int>& tensors, const FsdpConfig& config, int64_t world) {
  if (config.framework == Framework::kFsdp2) {
    int64_t total = 0;
    for (int t : tensors) total += Fsdp2ShardNumel(model.tensors[t], world) * world;
    return total;
  }
  // FSDP1 FlatParamHandle: with use_orig_params each parameter starts at a 16-byte boundary of the
  // flat parameter's dtype (_get_aligned_numel); the total is then padded to a multiple of world.
  const std::vector<int64_t> starts = Fsdp1FlatOffsets(model, tensors, config);
  const int64_t total = tensors.empty() ? 0 : starts.back() + model.tensors[tensors.back()].numel();
  return RoundUp(total, world);
}

DType FrozenStorageDtype(const FsdpConfig& config) {
  if (config.lora.rank == 0) return config.master_dtype;
  return config.lora.base_dtype.value_or(config.lora.qlora ? config.param_dtype : config.master_dtype);
}

DType QloraComputeDtype(const FsdpConfig& config) { return config.lora.compute_dtype.value_or(config.param_dtype); }

DType StorageDtype(const FsdpConfig& config, const TensorSpec& tensor) {
  // a vision tower's parameters keep the dtype they require grad in, gradient or not (FSDP2's idle tower)
  return tensor.RequiresGrad() ? config.master_dtype : FrozenStorageDtype(config);
}

std::vector<int64_t> Fsdp1FlatOffsets(const ModelSpec& model, const std::vector<int>& tensors, const FsdpConfig& config) {
  const DType dtype = tensors.empty() ? config.master_dtype : StorageDtype(config, model.tensors[tensors.front()]);
  const int64_t align = config.use_orig_params ? 16 / BytesPerElement(dtype) : 1;
  std::vector<int64_t> starts;
  starts.reserve(tensors.size());
  int64_t total = 0;
  for (int t : tensors) {
    starts.push_back(RoundUp(total, align));
    total = starts.back() + model.tensors[t].numel();
  }
  return starts;
}

int64_t Workload::ShardNumelTotal() const {
  int64_t total = 0;
  for (const auto& u : units) total += u.shard_numel;
  return total;
}

std::vector<ElementRun> SteppedShardRuns(const Workload& w, int u, int64_t shard_rank) {
  const WrapUnit& unit = w.units[u];
  if (unit.grad_shard_numel == 0) return {};
  if (unit.trainable_numel == unit.numel || unit.grad_padded_numel != unit.padded_numel) return {{0, unit.grad_shard_numel}};
  const int64_t lo = shard_rank * unit.grad_shard_numel, hi = lo + unit.grad_shard_numel;
  std::vector<ElementRun> runs;
  for (int t : unit.tensors) {
    if (!w.model.tensors[t].trainable) continue;
    const int64_t first = std::max(lo, w.tensor_offset[t]), last = std::min(hi, w.tensor_offset[t] + w.model.tensors[t].numel());
    if (last <= first) continue;
    if (!runs.empty() && runs.back().first + runs.back().numel == first - lo) runs.back().numel += last - first;  // adjacent tensors
    else runs.push_back({first - lo, last - first});
  }
  return runs;
}

int64_t Workload::GradShardNumelTotal() const {
  int64_t total = 0;
  for (const auto& u : units) total += u.grad_shard_numel;
  return total;
}

int Workload::EmbeddingNode() const {
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (nodes[i].role == ModuleNode::Role::kEmbedding) return static_cast<int>(i);
  }
  return -1;
}

int Workload::WeightTensor(int node) const {
  const int own = nodes[static_cast<size_t>(node)].first_tensor;
  return own >= 0 ? own : nodes[static_cast<size_t>(EmbeddingNode())].first_tensor;
}

int64_t Workload::PaddedNumelTotal() const {
  int64_t total = 0;
  for (const auto& u : units) total += u.padded_numel;
  return total;
}

namespace {

// Walks the module tree in execution order, cutting compute segments at every unit's hooks.
class WalkBuilder {
 public:
  explicit WalkBuilder(const Workload& w) : w_(w), hook_of_(w.nodes.size(), {-1, 0}), group_(w.nodes.size(), 0) {
    for (int u = 0; u < static_cast<int>(w.units.size()); ++u) {
      const WrapUnit& unit = w.units[u];
      if (unit.hook_nodes.empty()) {
        hook_of_[unit.node] = {u, 0};
        continue;
      }
      group_[unit.node] = 1;  // hooked at its modules, and running nothing of its own
      for (int s = 0; s < static_cast<int>(unit.hook_nodes.size()); ++s) hook_of_[unit.hook_nodes[s]] = {u, s};
    }
  }

  ModuleWalk Build() {
    forward_ = true;
    Forward(0);
    Flush();
    forward_ = false;
    Backward(0);
    Flush();
    return std::move(walk_);
  }

 private:
  void Forward(int id) {
    const ModuleNode& n = w_.nodes[id];
    const auto [u, site] = hook_of_[id];
    if (u >= 0) Hook(ModuleWalk::Step::kPreHook, u, site);
    for (int c : n.children) Forward(c);
    if (!group_[id]) pending_.push_back(NodeVisit{id, false});
    if (u >= 0) Hook(ModuleWalk::Step::kPostHook, u, site);
  }

  void Backward(int id) {
    const ModuleNode& n = w_.nodes[id];
    const auto [u, site] = hook_of_[id];
    if (u >= 0) Hook(ModuleWalk::Step::kPreHook, u, site);
    if (!group_[id]) pending_.push_back(NodeVisit{id, true});
    for (auto it = n.children.rbegin(); it != n.children.rend(); ++it) Backward(*it);
    if (!group_[id]) pending_.push_back(NodeVisit{id, false});
    if (u >= 0) Hook(ModuleWalk::Step::kPostHook, u, site);
  }

  void Hook(ModuleWalk::Step step, int unit, int site) {
    Flush();
    Steps().push_back({step, unit, site});
  }

  void Flush() {
    if (pending_.empty()) return;
    int owner = pending_.front().node;
    while (w_.nodes[owner].unit < 0) owner = w_.nodes[owner].parent;
    walk_.segments.push_back(ComputeSegment{w_.nodes[owner].unit, forward_, static_cast<int>(walk_.visits.size()),
                                            static_cast<int>(pending_.size())});
    walk_.visits.insert(walk_.visits.end(), pending_.begin(), pending_.end());
    pending_.clear();
    Steps().push_back({ModuleWalk::Step::kSegment, static_cast<int>(walk_.segments.size()) - 1});
  }

  std::vector<ModuleWalk::Entry>& Steps() { return forward_ ? walk_.forward : walk_.backward; }

  const Workload& w_;
  std::vector<std::pair<int, int>> hook_of_;  // per node: the unit whose hooks run around it (-1: none) and the site
  std::vector<char> group_;                   // per node: a group of modules, hooked at each of them
  ModuleWalk walk_;
  std::vector<NodeVisit> pending_;
  bool forward_ = true;
};

void ApplyWrapPolicy(Workload& w, const FsdpConfig& config) {
  for (auto& n : w.nodes) n.unit = -1;
  w.units.clear();
  w.post_forward_order.clear();
  MarkUnits(w.nodes, w.model, config);
  CollectUnits(w, 0, -1);
  CollectPostOrder(w, 0, w.post_forward_order);
  w.walk = std::make_shared<const ModuleWalk>(WalkBuilder(w).Build());
  w.tensor_unit.assign(w.model.tensors.size(), -1);
  w.tensor_offset.assign(w.model.tensors.size(), 0);
  for (int u = 0; u < static_cast<int>(w.units.size()); ++u) {
    WrapUnit& unit = w.units[u];
    for (int t : unit.tensors) {
      w.tensor_unit[t] = u;
      w.tensor_offset[t] = unit.numel;
      unit.numel += w.model.tensors[t].numel();
      if (w.model.tensors[t].trainable) unit.trainable_numel += w.model.tensors[t].numel();
    }
  }
}

// A text-only step never runs the vision tower (TensorSpec::image_only). FSDP2 then leaves its
// gradients None: FSDPParamGroup.post_backward reduce-scatters only the parameters whose grad is
// set, and AdamW keeps no state for a parameter without one (torch/optim/adamw.py,
// _init_group's `if p.grad is not None`), as for a frozen one. FSDP1 flattens them into their
// unit's FlatParameter, whose gradient covers every element and is reduced and stepped whole.
// Sets `trainable` (what gets a gradient) on those tensors for `framework`; true when it changed.
bool SetImageOnlyGradients(ModelSpec& m, Framework framework) {
  bool changed = false;
  for (TensorSpec& t : m.tensors) {
    const bool grads = t.requires_grad && framework == Framework::kFsdp1;
    if (!t.image_only || t.trainable == grads) continue;
    t.trainable = grads;
    changed = true;
  }
  return changed;
}

}  // namespace

// FSDP1 flattens a unit's parameters into one FlatParameter, which takes one requires_grad unless
// use_orig_params=True (torch/distributed/fsdp/_flat_param.py, FlatParamHandle._init_flat_param_and_metadata).
Status CheckUniformRequiresGrad(const Workload& w, const FsdpConfig& config) {
  if (config.framework != Framework::kFsdp1 || config.use_orig_params) return {};
  for (const WrapUnit& u : w.units) {
    if (u.trainable_numel != 0 && u.trainable_numel != u.numel) {
      return Error::BadInput(fmt::format("FSDP1 unit '{}' mixes frozen and trainable parameters, which PyTorch refuses without use_orig_params "
                                         "(\"Must flatten tensors with uniform requires_grad when use_orig_params=False\"): add --use-orig-params, "
                                         "or --wrap peft (adapters in units of their own)",
                                         u.name));
    }
  }
  return {};
}

// FSDP1's FlatParameter holds one dtype (_flat_param.py _validate_tensors_to_flatten), with or
// without use_orig_params: a base stored apart from the adapters (QLoRA's, --base-dtype) needs units apart.
Status CheckUniformDtype(const Workload& w, const FsdpConfig& config) {
  // one dtype for every parameter unless the frozen base is stored apart from what trains
  if (config.framework != Framework::kFsdp1 || FrozenStorageDtype(config) == config.master_dtype) return {};
  for (const WrapUnit& u : w.units) {
    if (u.tensors.empty()) continue;
    const DType a = StorageDtype(config, w.model.tensors[u.tensors.front()]);
    for (int t : u.tensors) {
      const DType b = StorageDtype(config, w.model.tensors[t]);
      if (a == b) continue;
      return Error::BadInput(fmt::format("FSDP1 unit '{}' holds {} and {} parameters (the frozen base and the adapters), which PyTorch refuses "
                                         "(\"Must flatten tensors with uniform dtype\"): use --wrap peft (adapters in units of their own) or "
                                         "--framework fsdp2",
                                         u.name, DTypeName(a), DTypeName(b)));
    }
  }
  return {};
}

// Each unit's stored bytes per rank, and whether FSDP casts it for the all-gather.
void SetShardBytes(Workload& w, const FsdpConfig& config) {
  for (WrapUnit& u : w.units) {
    u.shard_bytes = 0;
    u.casts_for_compute = false;
    for (int t : u.tensors) {
      const DType dtype = StorageDtype(config, w.model.tensors[t]);
      u.casts_for_compute = u.casts_for_compute || dtype != config.param_dtype;
      if (config.framework == Framework::kFsdp2) u.shard_bytes += Fsdp2ShardNumel(w.model.tensors[t], w.shard_world) * BytesPerElement(dtype);
    }
    if (config.framework == Framework::kFsdp1 && !u.tensors.empty()) {
      u.shard_bytes = u.shard_numel * BytesPerElement(StorageDtype(config, w.model.tensors[u.tensors.front()]));
    }
  }
}

Status Reconfigure(Workload& w, const HardwareSpec& hardware, FsdpConfig config) {
  if (config.lora != w.config.lora) return Error::BadInput("Reconfigure cannot change the LoRA configuration: build a new workload");
  if (config.impl != w.config.impl) return Error::BadInput("Reconfigure cannot change --impl (the module tree differs): build a new workload");
  if (config.lora.qlora && config.param_dtype != w.config.param_dtype) {
    return Error::BadInput("Reconfigure cannot change the param dtype under QLoRA (the 4-bit weights are packed in it): build a new workload");
  }
  if (Status s = ResolveAndValidate(config, w.model, hardware); !s.ok()) return s;
  const bool regrad = SetImageOnlyGradients(w.model, config.framework);
  const bool rewrap = w.units.empty() || regrad || config.wrap != w.config.wrap ||
                      (config.wrap == WrapPolicy::kSize && config.wrap_min_params != w.config.wrap_min_params);
  if (rewrap) ApplyWrapPolicy(w, config);
  const int64_t world = ShardWorldSize(config);
  // padding depends only on the units, the shard world and the flat-parameter layout
  const bool repad = rewrap || world != w.shard_world || config.framework != w.config.framework ||
                     config.use_orig_params != w.config.use_orig_params || config.master_dtype != w.config.master_dtype;
  Status uniform = CheckUniformRequiresGrad(w, config);
  if (uniform.ok()) uniform = CheckUniformDtype(w, config);
  if (!uniform.ok()) {
    if (regrad) SetImageOnlyGradients(w.model, w.config.framework);
    if (rewrap && !w.units.empty()) ApplyWrapPolicy(w, w.config);  // left as it was
    return uniform;
  }
  w.shard_world = world;
  w.replicas = ReplicaCount(config);
  if (repad) {
    for (auto& u : w.units) {
      u.padded_numel = PaddedNumel(w.model, u.tensors, config, w.shard_world);
      u.shard_numel = u.padded_numel / w.shard_world;
      if (u.trainable_numel == 0) {
        u.grad_padded_numel = 0;
      } else if (u.trainable_numel == u.numel || config.framework == Framework::kFsdp1) {
        u.grad_padded_numel = u.padded_numel;
      } else {
        std::vector<int> trainable;
        for (int t : u.tensors) if (w.model.tensors[t].trainable) trainable.push_back(t);
        u.grad_padded_numel = PaddedNumel(w.model, trainable, config, w.shard_world);
      }
      u.grad_shard_numel = u.grad_padded_numel / w.shard_world;
      u.hook_grad_padded_numel.clear();
      u.hook_grad_shard_numel.clear();
      for (int node : u.hook_nodes) {  // FSDP2 only (torchtitan): each parameter padded on its own
        std::vector<int> trainable;
        for (int t : w.nodes[node].tensors) if (w.model.tensors[t].trainable) trainable.push_back(t);
        const int64_t padded = trainable.empty() ? 0 : PaddedNumel(w.model, trainable, config, w.shard_world);
        u.hook_grad_padded_numel.push_back(padded);
        u.hook_grad_shard_numel.push_back(padded / w.shard_world);
      }
    }
  }
  if (repad || config.param_dtype != w.config.param_dtype) SetShardBytes(w, config);
  w.hardware = hardware;
  w.config = config;
  return {};
}

Result<Workload> BuildWorkload(ModelSpec model, HardwareSpec hardware, FsdpConfig config) {
  if (Status s = ResolveAndValidate(config, model, hardware); !s.ok()) return s.error();
  if (Status s = ApplyLora(model, config.lora, config.param_dtype); !s.ok()) return s.error();
  Workload w;
  w.config.lora = config.lora;
  w.config.param_dtype = config.param_dtype;
  w.config.impl = config.impl;
  w.nodes = BuildModuleTree(model, config.impl);
  w.model = std::move(model);
  if (Status s = Reconfigure(w, hardware, config); !s.ok()) return s.error();
  return w;
}

}  // namespace fsdp
