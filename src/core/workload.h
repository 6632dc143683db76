// The Workload: model + hardware + configuration resolved into FSDP wrap units with their
// padded shard sizes. Built once here; planner, simulator and runtime consume it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/fsdp_config.h"
#include "core/hardware_spec.h"
#include "core/model_spec.h"

namespace fsdp {

/// A node of the model's module tree (derived from tensor names), in forward execution order.
struct ModuleNode {
  enum class Role { kOther, kEmbedding, kBlock, kFinalNorm, kLmHead };
  std::string path;            ///< "" for the model itself
  int parent = -1;
  std::vector<int> children;   ///< node indices in execution order
  std::vector<int> tensors;    ///< tensors this module owns directly
  Role role = Role::kOther;
  int block = -1;              ///< decoder block index when role == kBlock
  int unit = -1;               ///< FSDP unit rooted here, -1 if not wrapped
  int64_t numel = 0;           ///< parameters in this subtree
  int first_tensor = -1;       ///< the subtree's first parameter in inventory order (-1: none, e.g. a tied lm_head)
};

/// The path of the module node that groups the final norm with lm_head under --impl torchtitan
/// (its apply_fsdp's fully_shard([model.norm, model.output])): the unit's name.
inline constexpr std::string_view kNormOutputGroup = "[norm, lm_head]";

/// One FSDP unit (FSDP1 FlatParameter / FSDP2 parameter group).
/// FSDP2's shard of one parameter (Shard(0) on a group of `world`): dim 0 padded to a multiple of
/// the world, divided by it (_fsdp_param.py FSDPParam._init_sharded_param).
int64_t Fsdp2ShardNumel(const TensorSpec& tensor, int64_t world);

struct WrapUnit {
  std::string name;            ///< module path, "root" for the root unit
  int node = 0;                ///< ModuleNode the unit wraps
  int parent_unit = -1;        ///< enclosing unit (-1 for the root)
  bool is_root = false;
  /// FSDP2's reshard_after_forward for the unit (FULL_SHARD's True), before the strategy's rules
  /// (ReshardsAfterForward): false for torchtitan's [norm, output] group
  bool reshard_after_forward = true;
  /// A group of several modules (fully_shard([norm, output])): the module nodes whose own forward
  /// and backward hooks run the group's, in forward order. torch 2.11's FSDP2 runs them per
  /// module: each post-backward reduce-scatters the gradients computed since the last and
  /// reshards, each pre-backward gathers the whole group again. Empty: the unit's `node`.
  std::vector<int> hook_nodes;
  /// Per hook node: the padded gradient its post-backward reduces, and its shard (FSDP2 pads
  /// each parameter: they sum to grad_padded_numel and grad_shard_numel).
  std::vector<int64_t> hook_grad_padded_numel, hook_grad_shard_numel;
  /// The padded gradient the post-backward at hook site `site` reduces, and its per-rank shard.
  int64_t SiteGradPaddedNumel(int site) const { return hook_nodes.empty() ? grad_padded_numel : hook_grad_padded_numel.at(static_cast<size_t>(site)); }
  int64_t SiteGradShardNumel(int site) const { return hook_nodes.empty() ? grad_shard_numel : hook_grad_shard_numel.at(static_cast<size_t>(site)); }
  int HookSites() const { return hook_nodes.empty() ? 1 : static_cast<int>(hook_nodes.size()); }
  std::vector<int> tensors;    ///< parameters managed by this unit
  int64_t numel = 0;           ///< sum of its parameters' elements
  int64_t padded_numel = 0;    ///< unsharded size after alignment and padding to the shard group
  int64_t shard_numel = 0;     ///< per-rank shard: padded_numel / shard world size
  int64_t trainable_numel = 0; ///< of numel, the parameters that require gradients
  /// The gradient FSDP reduces for the unit, padded as the reduce-scatter input: FSDP1 the whole
  /// flat parameter once any part of it is trainable (its gradient is one flat tensor), FSDP2 the
  /// trainable parameters only (each padded on dim 0); 0 for a unit with nothing to train.
  int64_t grad_padded_numel = 0;
  /// Per rank: grad_padded_numel / shard world size. The sharded gradient and the optimizer states.
  int64_t grad_shard_numel = 0;
  /// Bytes of each rank's sharded parameters: FSDP1 shard_numel in the flat parameter's one dtype,
  /// FSDP2 every parameter's shard in its own (StorageDtype).
  int64_t shard_bytes = 0;
  /// Some stored parameter is not in param_dtype: FSDP casts it for the all-gather (FSDP1's
  /// _mp_shard, FSDP2's all-gather copy-in).
  bool casts_for_compute = false;
};

/// The dtype a parameter is stored in (its sharded form): the master dtype, except LoRA's frozen
/// base: LoraConfig::base_dtype, by default the param dtype under QLoRA (bnb_4bit_quant_storage)
/// and the master dtype otherwise.
DType StorageDtype(const FsdpConfig& config, const TensorSpec& tensor);
/// StorageDtype of a frozen parameter (LoRA's base; the master dtype in full fine-tuning).
DType FrozenStorageDtype(const FsdpConfig& config);
/// The dtype a QLoRA weight is dequantized into and multiplied in (bnb_4bit_compute_dtype):
/// LoraConfig::compute_dtype, by default the param dtype.
DType QloraComputeDtype(const FsdpConfig& config);

/// A module-tree node reached by a compute segment. Forward segments visit nodes in post-order
/// (children first, `enter` false). Backward segments enter a node before its children, in reverse,
/// and leave it after them: a node's own backward runs at `enter`, its gradients exist at the exit.
struct NodeVisit {
  int node = 0;
  bool enter = false;
};

/// The compute between two FSDP hooks: contiguous module-tree visits, all inside one unit's
/// parameters (no unit boundary in between). With one unit per block: the root's embedding, each
/// block, then the root's final norm, lm_head and loss (forward); the reverse in backward.
struct ComputeSegment {
  int unit = 0;            ///< the unit whose parameters the segment uses
  bool forward = true;
  int first_visit = 0;     ///< range in ModuleWalk::visits
  int visit_count = 0;
};

/// The module tree as FSDP's hooks see it, per pass: each unit's pre- and post-hook and the
/// compute segments between them, in execution order. Depends on the wrap only (BuildSchedule
/// applies the configuration's rules to it).
struct ModuleWalk {
  enum class Step : uint8_t { kPreHook, kSegment, kPostHook };
  struct Entry {
    Step step;
    int index;     ///< the unit (hooks) or the segment
    int site = 0;  ///< hooks: which of the unit's WrapUnit::hook_nodes (0 for a unit of one module)
  };
  std::vector<Entry> forward, backward;
  std::vector<ComputeSegment> segments;
  std::vector<NodeVisit> visits;
};

struct Workload {
  ModelSpec model;
  HardwareSpec hardware;
  FsdpConfig config;
  int64_t shard_world = 1;     ///< W: ranks sharing one shard group
  int64_t replicas = 1;        ///< gpus / W
  std::vector<ModuleNode> nodes;  ///< nodes[0] is the model
  std::vector<WrapUnit> units;    ///< units[0] is the root; the rest in pre-forward order
  std::vector<int> post_forward_order;  ///< unit indices in the order their forward ends (root last)
  std::vector<int> tensor_unit;         ///< per tensor: the unit whose flat parameter holds it
  /// per tensor: its first element in that unit's flat buffer, the unit's tensors packed in order
  /// (fsdp-run's layout; FSDP1's use_orig_params alignment only pads the end)
  std::vector<int64_t> tensor_offset;
  std::shared_ptr<const ModuleWalk> walk;  ///< made with the wrap units

  int64_t TokensPerMicroBatch() const { return config.micro_batch * config.seq_len; }
  /// Sum of all units' shard_numel (elements each rank stores).
  int64_t ShardNumelTotal() const;
  /// Sum of all units' grad_shard_numel (elements of each rank's gradients and optimizer states).
  int64_t GradShardNumelTotal() const;
  /// Sum of all units' padded_numel.
  int64_t PaddedNumelTotal() const;
  /// Index in `nodes` of the token embedding (the node of role kEmbedding), -1 when it has none.
  int EmbeddingNode() const;
  /// The first parameter tensor of module node `node`; for a tied lm_head, which owns none, the
  /// embedding's (the weight it uses).
  int WeightTensor(int node) const;
};

/// Resolves the configuration against model and hardware (ResolveAndValidate), builds the module
/// tree, applies the wrap policy and computes padding. BadInput on inconsistent configurations.
Result<Workload> BuildWorkload(ModelSpec model, HardwareSpec hardware, FsdpConfig config);

/// A vision tower's tensors (TensorSpec::image_only) run no forward in the text-only steps
/// planned: under FSDP2 they get no gradient and no optimizer state (`trainable` false in
/// Workload::model), under FSDP1 their unit's FlatParameter gradient covers them (trainable unless
/// the base is frozen). BuildWorkload and Reconfigure set this for the framework.
///
/// Re-targets an existing workload (same model) at another GPU and configuration: re-applies the
/// wrap policy only when it changed and recomputes the padding. Cheaper than BuildWorkload, for
/// searches. On error the workload is left unchanged.
Status Reconfigure(Workload& workload, const HardwareSpec& hardware, FsdpConfig config);

/// Padded unsharded numel of a unit's tensors for a shard world of `world` ranks:
/// FSDP1 flat parameter (16-byte alignment per parameter when use_orig_params, total padded to a
/// multiple of world) or FSDP2 per-parameter dim-0 padding.
int64_t PaddedNumel(const ModelSpec& model, const std::vector<int>& tensors, const FsdpConfig& config, int64_t world);

/// A run of elements: [first, first + numel).
struct ElementRun {
  int64_t first = 0, numel = 0;
  bool operator==(const ElementRun&) const = default;
};
/// The elements of unit u's gradient shard on `shard_rank` that fsdp-run's optimizer steps, as runs
/// within that shard: all grad_shard_numel of them, except where the unit's gradient covers frozen
/// parameters (FSDP1 with use_orig_params, whose flat gradient is the whole flat parameter): then
/// the trainable tensors' parts of the shard, the tensors packed as Workload::tensor_offset packs
/// them, as FlatParamHandle's sharded views give AdamW only those.
std::vector<ElementRun> SteppedShardRuns(const Workload& workload, int u, int64_t shard_rank);

/// FSDP1: where each of `tensors` starts in its unit's flat parameter (16-byte aligned in the
/// parameters' storage dtype with use_orig_params, packed without), in elements.
std::vector<int64_t> Fsdp1FlatOffsets(const ModelSpec& model, const std::vector<int>& tensors, const FsdpConfig& config);

}  // namespace fsdp
