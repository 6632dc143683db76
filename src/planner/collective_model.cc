#include "planner/collective_model.h"

#include <algorithm>
#include <array>
#include <cmath>

namespace fsdp {
namespace {

enum Proto { kLL = 0, kLL128 = 1, kSimple = 2 };
enum Link { kNvlink = 0, kPci = 1, kNet = 2 };
constexpr std::array<std::string_view, 3> kProtoNames = {"LL", "LL128", "Simple"};

// NCCL src/graph/tuning.cc (2.20.3): baseLat[algorithm][protocol] and hwLat[hw][algorithm][protocol], µs.
constexpr double kBaseLatRing[3] = {6.6, 14.0, 8.4};
constexpr double kBaseLatTree[3] = {6.8, 14.0, 0.0};
constexpr double kHwLatRing[3][3] = {{0.6, 1.9, 3.4}, {1.0, 2.5, 5.7}, {2.7, 4.0, 14.0}};
constexpr double kHwLatTree[3][3] = {{0.6, 1.25, 28.0}, {1.0, 1.9, 28.0}, {5.0, 8.5, 28.0}};
// NVLS (NVLink SHARP through NVSwitch, sm90+): Simple only, hwLat[NVLINK][NVLS] = 23.
constexpr double kNvlsLatUs = 23.0;

// Share of the link bandwidth the data gets per protocol (tuning.cc): ring LL 1/3 on one node for
// all-gather/reduce-scatter, 1/4 across nodes or for all-reduce; LL128 0.92 (0.7 with one GPU per
// node); Simple 1.
double ProtoBwFactor(int proto, Collective c, int64_t nodes, int64_t ranks_per_node) {
  if (proto == 0) return (nodes > 1 || c == Collective::kAllReduce) ? 0.25 : 1.0 / 3.0;
  if (proto == 1) return ranks_per_node < 2 ? 0.7 : 0.92;
  return 1.0;
}

// Fitted to published nccl-tests results (docs/time-model.md; bench/collective_check prints the
// comparison): the largest bus bandwidth reached, as a share of the per-direction link bandwidth,
// and, per protocol, the message size at which half of it is reached
// (bandwidth(S) = peak * S / (S + half_size)): LL is built for small messages, Simple pipelines
// large chunks over many channels.
constexpr double kPeakShare[3] = {0.80, 0.80, 0.92};
constexpr double kHalfSizeBytes[3] = {64.0 * 1024, 1.0 * (1 << 20), 6.0 * (1 << 20)};
// Across nodes every protocol needs far larger messages (network round trips, proxy threads).
constexpr double kNetHalfSizeBytes = 16.0 * (1 << 20);
// NVLS all-reduce bus bandwidth relative to ring on the same NVSwitch node (NVIDIA, H100 nccl-tests).
constexpr double kNvlsAllReduceGain = 1.3;

struct Path {
  double bandwidth_bytes_per_s;  // per-rank bus bandwidth ceiling
  Link bottleneck;
  Link intra;
};

Link IntraLink(const HardwareSpec& hw, int64_t ranks_per_node) {
  if (hw.intra_node_bandwidth_bytes_per_s <= 0) return kPci;
  if (hw.intra_node_link == "nvlink-bridge" && ranks_per_node > 2) return kPci;  // bridges join pairs only
  return kNvlink;
}

double IntraBandwidth(const HardwareSpec& hw, Link link) {
  return link == kNvlink ? hw.intra_node_bandwidth_bytes_per_s : hw.pcie_bandwidth_bytes_per_s;
}

// A ring crosses each node boundary once per channel; with one NIC per GPU the channels spread
// over the node's NICs, so the inter-node share of the bus bandwidth is the node's NIC total.
Path PathFor(const CommGroup& g, const HardwareSpec& hw) {
  const Link intra = IntraLink(hw, g.ranks_per_node);
  const double intra_bw = IntraBandwidth(hw, intra) * kPeakShare[intra];
  if (g.Nodes() <= 1) return {intra_bw, intra, intra};
  const double net_bw = hw.inter_node_bandwidth_per_gpu_bytes_per_s * static_cast<double>(g.ranks_per_node) * kPeakShare[kNet];
  if (g.ranks_per_node <= 1 || net_bw < intra_bw) return {net_bw, kNet, intra};
  return {intra_bw, intra, intra};
}

// NCCL's tree all-reduce reduces inside each node, then each node sends its data across once (a
// ring sends 2(n-1)/n of it): the network allows BusFactor x the node's NIC bandwidth. Inside the
// node the chain reaches kTreeIntraShare of the ring's bus bandwidth (NVLS-capable nodes more).
constexpr double kTreeIntraShare = 0.8;

double TreeBandwidth(const CommGroup& g, const HardwareSpec& hw) {
  const Link intra = IntraLink(hw, g.ranks_per_node);
  double intra_bw = IntraBandwidth(hw, intra) * kPeakShare[intra] * kTreeIntraShare;
  if (hw.intra_node_switched && (hw.architecture == "hopper" || hw.architecture == "blackwell")) intra_bw *= kNvlsAllReduceGain;
  const double net_bw = hw.inter_node_bandwidth_per_gpu_bytes_per_s * static_cast<double>(g.ranks_per_node) * kPeakShare[kNet] *
                        BusFactor(Collective::kAllReduce, g.ranks);
  return std::min(intra_bw, net_bw);
}

double SaturatedBandwidth(double peak, int proto, double size_bytes, bool multi_node = false) {
  const double half = multi_node ? std::max(kNetHalfSizeBytes, kHalfSizeBytes[proto]) : kHalfSizeBytes[proto];
  return peak * size_bytes / (size_bytes + half);
}

// NCCL's ring latency: nsteps hops, the ones that cross nodes at network latency.
double RingLatencyUs(Collective c, const CommGroup& g, Link intra, Proto p) {
  const int64_t n = g.ranks, nodes = g.Nodes();
  const int64_t steps = c == Collective::kAllReduce ? 2 * (n - 1) : n - 1;
  const int64_t inter_steps = nodes > 1 ? (c == Collective::kAllReduce ? 2 * (nodes - 1) : nodes - 1) : 0;
  return kBaseLatRing[p] + static_cast<double>(steps - inter_steps) * kHwLatRing[intra][p] +
         static_cast<double>(inter_steps) * kHwLatRing[kNet][p];
}

// NCCL's tree (all-reduce across nodes): up and down a chain inside the node and a tree across nodes.
double TreeLatencyUs(const CommGroup& g, Link intra, Proto p) {
  const double levels = std::ceil(std::log2(static_cast<double>(g.Nodes())));
  return kBaseLatTree[p] + 2.0 * (static_cast<double>(g.ranks_per_node - 1) * kHwLatTree[intra][p] + levels * kHwLatTree[kNet][p]);
}

CollectiveEstimate Make(Collective c, int64_t size, int64_t ranks, double latency_us, double busbw, std::string_view algo, Proto p) {
  CollectiveEstimate e;
  const double bus_bytes = static_cast<double>(size) * BusFactor(c, ranks);
  e.latency_s = latency_us * 1e-6;
  e.time_s = e.latency_s + bus_bytes / busbw;
  e.algbw_bytes_per_s = static_cast<double>(size) / e.time_s;
  e.busbw_bytes_per_s = e.algbw_bytes_per_s * BusFactor(c, ranks);
  e.algorithm = algo;
  e.protocol = kProtoNames[p];
  return e;
}

}  // namespace

namespace {

// Time of a collective from the hardware file's measurements for this group size, interpolated
// linearly in the size between measured points (latency + bytes / bandwidth), scaled beyond them;
// negative when nothing was measured for this many ranks.
double MeasuredSeconds(Collective c, int64_t size_bytes, const CommGroup& g, const HardwareSpec& hw) {
  std::vector<std::pair<double, double>> points;
  for (const auto& m : hw.measured_collectives) {
    if (m.ranks != g.ranks) continue;
    const double t = c == Collective::kAllGather ? m.all_gather_s : c == Collective::kReduceScatter ? m.reduce_scatter_s : m.all_reduce_s;
    points.emplace_back(static_cast<double>(m.bytes), t);
  }
  if (points.empty()) return -1;
  const double s = static_cast<double>(size_bytes);
  if (s <= points.front().first) return points.front().second;
  if (s >= points.back().first) return points.back().second * s / points.back().first;
  for (size_t i = 1; i < points.size(); ++i) {
    if (s <= points[i].first) {
      const auto& [s0, t0] = points[i - 1];
      const auto& [s1, t1] = points[i];
      return t0 + (t1 - t0) * (s - s0) / (s1 - s0);
    }
  }
  return points.back().second;
}

}  // namespace

CollectiveEstimate EstimateCollective(Collective c, int64_t size_bytes, const CommGroup& g, const HardwareSpec& hw) {
  if (g.ranks <= 1 || size_bytes <= 0) return {};
  if (const double measured = MeasuredSeconds(c, size_bytes, g, hw); measured > 0) {
    CollectiveEstimate e;
    e.time_s = measured;
    e.latency_s = std::min(measured, hw.measured_collectives.front().all_gather_s);
    e.algbw_bytes_per_s = static_cast<double>(size_bytes) / measured;
    e.busbw_bytes_per_s = e.algbw_bytes_per_s * BusFactor(c, g.ranks);
    e.algorithm = "measured";
    e.protocol = "calibration";
    return e;
  }
  const Path path = PathFor(g, hw);
  const double size = static_cast<double>(size_bytes);
  CollectiveEstimate best;
  best.time_s = INFINITY;
  auto consider = [&](const CollectiveEstimate& e) { if (e.time_s < best.time_s) best = e; };
  for (Proto p : {kLL, kLL128, kSimple}) {
    const double bw = SaturatedBandwidth(path.bandwidth_bytes_per_s * ProtoBwFactor(p, c, g.Nodes(), g.ranks_per_node), p, size, g.Nodes() > 1);
    consider(Make(c, size_bytes, g.ranks, RingLatencyUs(c, g, path.intra, p), bw, "ring", p));
    if (c == Collective::kAllReduce && g.Nodes() > 1) {
      const double tree_bw = SaturatedBandwidth(TreeBandwidth(g, hw) * ProtoBwFactor(p, c, g.Nodes(), g.ranks_per_node), p, size, true);
      consider(Make(c, size_bytes, g.ranks, TreeLatencyUs(g, path.intra, p), tree_bw, "tree", p));
    }
  }
  const bool nvls = hw.intra_node_switched && g.Nodes() == 1 && g.ranks > 2 &&
                    (hw.architecture == "hopper" || hw.architecture == "blackwell");
  if (nvls && c == Collective::kAllReduce) {
    const double bw = SaturatedBandwidth(path.bandwidth_bytes_per_s * kNvlsAllReduceGain, kSimple, size);
    consider(Make(c, size_bytes, g.ranks, kNvlsLatUs, bw, "nvls", kSimple));
  }
  return best;
}

double HostCopySeconds(int64_t bytes, const HardwareSpec& hw) {
  if (bytes <= 0) return 0.0;
  const double size = static_cast<double>(bytes);
  return size / SaturatedBandwidth(hw.pcie_bandwidth_bytes_per_s * kPeakShare[kPci], kSimple, size);
}

}  // namespace fsdp
