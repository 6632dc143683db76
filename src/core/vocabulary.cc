#include "core/vocabulary.h"

namespace fsdp {

std::string_view MemCategoryKey(MemCategory c) {
  static constexpr std::string_view kKeys[] = {"sharded_params", "unsharded_params", "gradients", "optimizer_states",
                                               "activations",    "comm_buffers",     "temporaries", "framework"};
  return kKeys[static_cast<int>(c)];
}

std::string_view MemCategoryLabel(MemCategory c) {
  static constexpr std::string_view kLabels[] = {"sharded parameters", "unsharded parameters", "gradients", "optimizer states",
                                                 "activations", "communication buffers", "temporaries", "framework overhead"};
  return kLabels[static_cast<int>(c)];
}

int64_t TotalBytes(const CategoryBytes& bytes) {
  int64_t total = 0;
  for (int64_t b : bytes) total += b;
  return total;
}

std::string_view CollectiveName(Collective c) {
  switch (c) {
    case Collective::kAllGather: return "all_gather";
    case Collective::kReduceScatter: return "reduce_scatter";
    case Collective::kAllReduce: return "all_reduce";
  }
  return "?";
}

double BusFactor(Collective c, int64_t ranks) {
  if (ranks <= 1) return 0.0;
  const double n = static_cast<double>(ranks);
  return c == Collective::kAllReduce ? 2.0 * (n - 1) / n : (n - 1) / n;
}

}  // namespace fsdp
