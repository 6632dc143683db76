#include "runtime/calibrate.h"

#include "core/vocabulary.h"

#include <algorithm>
#include <chrono>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "runtime/llama_ops.h"

namespace fsdp::runtime {
namespace {

template <typename F>
double BestSeconds(int repeats, F&& f) {
  double best = 1e300;
  for (int i = 0; i < repeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return best;
}

// FLOP/s of x (T, in) W^T (out, in) for the model's linear shapes, weighted by their FLOPs.
double GemmFlops(const ModelSpec& m, int64_t tokens, int repeats) {
  double flops = 0, seconds = 0;
  for (const auto& [out, in] : LinearShapes(m)) {
    Mat x = Mat::Random(tokens, in), w = Mat::Random(out, in), dy = Mat::Random(tokens, out), dw = Mat::Zero(out, in);
    Mat y;
    MatMap dw_map(dw.data(), out, in);
    // forward (x W^T) and backward (dy W and dW += dy^T x): the three GEMMs of a training step
    seconds += BestSeconds(repeats, [&] { y = LinearForward(x, ConstMatMap(w.data(), out, in)); });
    seconds += BestSeconds(repeats, [&] { y = LinearBackward(dy, x, ConstMatMap(w.data(), out, in), dw_map); });
    flops += 3 * 2.0 * static_cast<double>(tokens * in * out);
  }
  return flops / seconds;
}

// FLOP/s of the engine's attention at the model's shapes: per head (s, d) x (d, s) scores and
// (s, s) x (s, d) values, forward and backward (AttentionForward / AttentionBackward).
double AttentionFlops(const ModelSpec& m, int64_t batch, int64_t seq, int repeats) {
  const int64_t heads = m.num_heads, kv = m.num_kv_heads, d = m.head_dim;
  Mat q = Mat::Random(batch * seq, heads * d), k = Mat::Random(batch * seq, kv * d), v = Mat::Random(batch * seq, kv * d);
  std::vector<Mat> probs;
  Mat out, dq, dk, dv;
  const double s = BestSeconds(repeats, [&] {
    out = AttentionForward(q, k, v, batch, seq, heads, kv, d, probs);
    AttentionBackward(out, q, k, v, probs, batch, seq, heads, kv, d, dq, dk, dv);
  });
  return AttentionTrainingFlops(m, batch, seq) / s;
}

// Bytes read + written per second by a large copy.
double CopyBandwidth(int repeats) {
  std::vector<float> a(32 << 20, 1.0f), b(32 << 20);
  const double s = BestSeconds(repeats, [&] { std::copy(a.begin(), a.end(), b.begin()); });
  return 2.0 * static_cast<double>(a.size()) * 4 / s;
}

// Bus bandwidth (nccl-tests convention) of an all-gather of `bytes` output, and its latency from
// the smallest size.
Result<std::pair<double, double>> CollectiveFit(Comm& comm, int64_t max_bytes, int repeats) {
  const int n = comm.size();
  if (n < 2) return std::make_pair(0.0, 0.0);
  double latency = 0, busbw = 0;
  for (int64_t bytes : {int64_t{4096}, max_bytes}) {
    const int64_t per_rank = std::max<int64_t>(1, bytes / 4 / n);
    std::vector<float> in(static_cast<size_t>(per_rank), 1.0f), out(static_cast<size_t>(per_rank * n));
    Status status;
    const double s = BestSeconds(repeats, [&] { status = comm.AllGather(in.data(), out.data(), per_rank); });
    if (!status.ok()) return status.error();
    if (bytes == 4096) latency = s;
    else busbw = static_cast<double>(per_rank * n * 4) / (s - latency) * BusFactor(Collective::kAllGather, n);
  }
  return std::make_pair(latency, busbw);
}

// All-gather, reduce-scatter and all-reduce times across sizes (nccl-tests sizes and bus bandwidth).
Result<Json> CollectiveSweep(Comm& comm, int64_t max_bytes, int repeats) {
  Json rows = Json::array();
  const int n = comm.size();
  if (n < 2) return rows;
  for (int64_t bytes = 4096; bytes <= max_bytes; bytes *= 4) {
    const int64_t per_rank = std::max<int64_t>(1, bytes / 4 / n);
    std::vector<float> small(static_cast<size_t>(per_rank), 1.0f), big(static_cast<size_t>(per_rank * n), 1.0f);
    Status status;
    const double ag = BestSeconds(repeats, [&] { if (status.ok()) status = comm.AllGather(small.data(), big.data(), per_rank); });
    const double rs = BestSeconds(repeats, [&] { if (status.ok()) status = comm.ReduceScatter(big.data(), small.data(), per_rank); });
    const double ar = BestSeconds(repeats, [&] { if (status.ok()) status = comm.AllReduce(big.data(), per_rank * n); });
    if (!status.ok()) return status.error();
    rows.push_back(CollectiveRow(n, per_rank * n * 4, ag, rs, ar));
  }
  return rows;
}

}  // namespace

std::vector<std::pair<int64_t, int64_t>> LinearShapes(const ModelSpec& m) {
  const int64_t h = m.hidden_size, q = m.num_heads * m.head_dim, kv = m.num_kv_heads * m.head_dim, inner = m.intermediate_size;
  return {{q, h}, {kv, h}, {h, q}, {inner, h}, {h, inner}, {m.vocab_size, h}};
}

double AttentionTrainingFlops(const ModelSpec& m, int64_t batch, int64_t seq) {
  // forward 4 s d per token and head, backward twice that
  return 3.0 * 4.0 * static_cast<double>(seq) * static_cast<double>(m.num_heads * m.head_dim) * static_cast<double>(batch * seq);
}

Json CollectiveRow(int n, int64_t bytes, double ag, double rs, double ar) {
  const double size = static_cast<double>(bytes);
  return {{"ranks", n},
          {"bytes", bytes},
          {"all_gather_s", ag},
          {"reduce_scatter_s", rs},
          {"all_reduce_s", ar},
          {"all_gather_busbw", size / ag * BusFactor(Collective::kAllGather, n)},
          {"reduce_scatter_busbw", size / rs * BusFactor(Collective::kReduceScatter, n)},
          {"all_reduce_busbw", size / ar * BusFactor(Collective::kAllReduce, n)}};
}

Result<Json> Calibrate(const ModelSpec& m, Comm& comm, const CalibrationOptions& o) {
  const double gemm = GemmFlops(m, o.tokens, o.repeats);
  const int64_t seq = std::max<int64_t>(1, std::min<int64_t>(o.seq_len, o.tokens));
  const double attention = AttentionFlops(m, std::max<int64_t>(1, o.tokens / seq), seq, o.repeats);
  const double copy = CopyBandwidth(o.repeats);
  auto fit = CollectiveFit(comm, o.max_collective_bytes, o.repeats);
  if (!fit.ok()) return fit.error();
  const auto [latency, busbw] = fit.value();
  auto sweep = CollectiveSweep(comm, o.max_collective_bytes, o.repeats);
  if (!sweep.ok()) return sweep.error();
  const double link = busbw > 0 ? busbw / 0.80 : copy;  // the collective model applies 0.80 of the link
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  Json hw = {{"id", "calibrated-cpu"},
             {"name", fmt::format("this machine ({} cores), measured by fsdp-run calibrate", cores)},
             {"vendor", "cpu"},
             {"architecture", "cpu"},
             {"memory_bytes", 24.0 * (1LL << 30)},
             {"peak_flops", {{"bf16", gemm}, {"fp16", gemm}, {"fp32", gemm}, {"tf32", gemm}}},
             {"memory_bandwidth_bytes_per_s", copy},
             {"intra_node_link", {{"type", "shared-memory"}, {"bandwidth_bytes_per_s", link}, {"switched", false}}},
             {"pcie", {{"generation", 4}, {"lanes", 16}, {"bandwidth_bytes_per_s", copy}}},
             {"node", {{"gpus_per_node", comm.size()}, {"inter_node_bandwidth_per_gpu_bytes_per_s", link}, {"inter_node_latency_s", latency}}},
             {"cuda_context_bytes", 0},
             {"price_per_gpu_hour_usd", 0},
             {"efficiency", {{"matmul", 1.0}, {"memory_bandwidth", 1.0}, {"attention", std::min(1.0, attention / gemm)}}},
             {"measured_collectives", sweep.value()},
             {"sources",
              {{"peak_flops", fmt::format("measured: Eigen fp32 forward and backward GEMMs at {}'s linear shapes, {} rows, best of {}", m.id, o.tokens, o.repeats)},
               {"memory_bandwidth_bytes_per_s", "measured: 128 MiB copy, read + write bytes"},
               {"efficiency", "measured: the attention's per-head products (forward and backward) relative to the GEMM rate"},
               {"intra_node_link", fmt::format("measured: all-gather of {} bytes over {} MPI ranks, bus bandwidth / 0.80 (the collective model's peak share)", o.max_collective_bytes, comm.size())},
               {"memory_bytes", "assumption: this workplace's 24 GiB machines"}}}};
  return hw;
}

}  // namespace fsdp::runtime
