// GPU and node description read from hardware/<id>.json.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/json_io.h"
#include "core/status.h"

namespace fsdp {

/// One GPU type and the usual node it sits in. Bandwidths are per GPU and per direction.
struct HardwareSpec {
  std::string id;
  std::string name;
  std::string vendor;
  std::string architecture;      ///< ampere, ada, hopper, blackwell, cdna3, cpu
  int64_t memory_bytes = 0;      ///< the card's memory as nvidia-smi reports it (memory.total)
  /// The total CUDA reports for the card (cudaMemGetInfo's total, torch.cuda's
  /// get_device_properties().total_memory), below nvidia-smi's: all the CUDA context, NCCL,
  /// cuBLAS and the caching allocator can ever share. 0 where the hardware file does not say.
  int64_t cuda_total_bytes = 0;
  double peak_flops_bf16 = 0, peak_flops_fp16 = 0, peak_flops_fp32 = 0;  ///< dense FLOP/s
  double memory_bandwidth_bytes_per_s = 0;
  std::string intra_node_link;   ///< "nvlink4", "nvlink-bridge", "infinity-fabric", "none", ...
  double intra_node_bandwidth_bytes_per_s = 0;  ///< 0 when there is no GPU-GPU link (PCIe is used)
  bool intra_node_switched = false;             ///< NVSwitch-style all-to-all fabric
  int pcie_generation = 0;
  double pcie_bandwidth_bytes_per_s = 0;
  int64_t gpus_per_node = 1;
  double inter_node_bandwidth_per_gpu_bytes_per_s = 0;
  double inter_node_latency_s = 0;
  int64_t cuda_context_bytes = 0;   ///< device memory of the CUDA/ROCm context of one process
  double price_per_gpu_hour_usd = 0;
  /// Collective times measured on this machine (fsdp-run calibrate): used instead of the NCCL
  /// model for groups of the measured size.
  struct MeasuredCollective {
    int64_t ranks = 0, bytes = 0;
    double all_gather_s = 0, reduce_scatter_s = 0, all_reduce_s = 0;
  };
  std::vector<MeasuredCollective> measured_collectives;
  double matmul_efficiency = 0.7;     ///< share of dense peak reached by GEMMs at training shapes
  double memory_efficiency = 0.85;    ///< share of memory bandwidth reached by memory-bound kernels
  double attention_efficiency = 0;    ///< share of peak for the attention's score/value products (0: as matmul)

  /// Dense peak FLOP/s for arithmetic in `dtype`.
  double PeakFlops(DType dtype) const;
  /// The device memory a process can use: cuda_total_bytes, or memory_bytes where that is not
  /// known (or lower: a card whose memory_bytes was set on its own). "Fits" and
  /// per_process_memory_fraction's cap are judged on it.
  int64_t DeviceTotalBytes() const { return cuda_total_bytes > 0 ? std::min(cuda_total_bytes, memory_bytes) : memory_bytes; }
};

/// A cluster of identical nodes (hardware/clusters/<id>.json).
struct ClusterSpec {
  std::string id;
  std::string gpu;               ///< hardware id or path of its GPU
  int64_t gpus_per_node = 1;
  int64_t nodes = 1;
  double inter_node_bandwidth_per_gpu_bytes_per_s = 0;
  double inter_node_latency_s = 0;
  int64_t Gpus() const { return gpus_per_node * nodes; }
};

/// Parses a cluster JSON document; BadInput naming origin and key (nodes x GPUs per node is at
/// most limits::kMaxGpus).
Result<ClusterSpec> ClusterFromJson(const Json& json, const std::string& id, const std::string& origin);
/// Loads hardware/clusters/<id>.json or a path; BadInput naming the file and key.
Result<ClusterSpec> LoadCluster(const std::string& id_or_path);

/// Replaces the node figures of `hw` by the cluster's (GPUs per node, inter-node bandwidth, latency).
void ApplyCluster(const ClusterSpec& cluster, HardwareSpec& hw);

/// Parses a hardware JSON document (schema in hardware/README.md); BadInput naming origin and key.
Result<HardwareSpec> HardwareFromJson(const Json& json, const std::string& id, const std::string& origin);

/// Loads hardware/<id>.json or a path to such a file.
Result<HardwareSpec> LoadHardware(const std::string& id_or_path);

}  // namespace fsdp
