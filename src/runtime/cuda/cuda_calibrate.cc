// fsdp-run calibrate --device cuda (gpu_engine.h): the GPU's rates at the model's shapes.
#include <algorithm>

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include "runtime/calibrate.h"
#include "runtime/cuda/cuda_block.h"
#include "runtime/cuda/cuda_check.h"
#include "runtime/cuda/cuda_gemm.h"
#include "runtime/cuda/cuda_kernels.h"
#include "runtime/cuda/device_comm.h"
#include "runtime/gpu_engine.h"

namespace fsdp::runtime {
namespace cuda {
namespace {

// Best time of `repeats` runs of `work` on `stream`, after one warm-up, from CUDA events; the
// waits poll `comm` (the collectives' communicator, else null) for NCCL errors.
template <typename Work>
Result<double> BestSeconds(cudaStream_t stream, int repeats, DeviceComm* comm, Work&& work) {
  cudaEvent_t start = nullptr, end = nullptr;
  FSDP_CUDA_TRY(cudaEventCreate(&start));
  if (Status s = CudaStatus(cudaEventCreate(&end), "cudaEventCreate"); !s.ok()) {
    cudaEventDestroy(start);
    return s.error();
  }
  double best = 1e300;
  Status status;
  for (int i = 0; i <= repeats && status.ok(); ++i) {
    cudaEventRecord(start, stream);
    status = work();
    cudaEventRecord(end, stream);
    if (status.ok()) status = WaitForEvent(end, {comm});
    if (!status.ok()) break;
    float ms = 0;
    cudaEventElapsedTime(&ms, start, end);
    if (i > 0) best = std::min(best, ms / 1e3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(end);
  if (!status.ok()) return status.error();
  FSDP_TRY(CudaStatus(cudaGetLastError(), "calibration"));
  return best;
}

// Fills a compute-dtype buffer with N(0, 1) values (matmuls on zeros run faster than on data).
Status FillRandom(const DeviceContext& c, const DeviceBuffer& buffer, uint64_t seed) {
  const int64_t n = buffer.bytes() / c.elem();
  FSDP_ALLOC(f32, c.alloc->Allocate(n * 4, MemCategory::kTemporaries, c.stream));
  FillNormal(f32.as<float>(), n, seed, 0, 1.0f, c.stream);
  CastFromF32(f32.as<float>(), buffer.get(), c.dtype, n, c.stream);
  return CudaStatus(cudaGetLastError(), "random operands");
}

struct Rates {
  double gemm_flops = 0, attention_flops = 0, copy_bytes_per_s = 0;
};

Result<Rates> MeasureRates(const ModelSpec& m, const DeviceContext& c, int repeats) {
  Rates r;
  const int64_t T = c.tokens(), q = m.num_heads * m.head_dim, kv = m.num_kv_heads * m.head_dim;
  double flops = 0, seconds = 0;
  for (const auto& [out, in] : LinearShapes(m)) {  // the three products of a linear layer in a training step
    FSDP_ALLOC(x, c.Buffer(T * in, MemCategory::kTemporaries));
    FSDP_ALLOC(w, c.Buffer(out * in, MemCategory::kTemporaries));
    FSDP_ALLOC(y, c.Buffer(T * out, MemCategory::kTemporaries));
    FSDP_ALLOC(dx, c.Buffer(T * in, MemCategory::kTemporaries));
    FSDP_ALLOC(dw, c.Buffer(out * in, MemCategory::kTemporaries));
    uint64_t seed = 1;
    for (const DeviceBuffer* b : {&x, &w, &y, &dw}) FSDP_TRY(FillRandom(c, *b, seed++));
    auto fwd = BestSeconds(c.stream, repeats, nullptr, [&] { return LinearForward(c.blas, c.dtype, x.get(), w.get(), y.get(), T, in, out); });
    auto bwd = BestSeconds(c.stream, repeats, nullptr, [&] { return LinearBackward(c.blas, c.dtype, y.get(), x.get(), w.get(), dx.get(), dw.get(), T, in, out); });
    if (!fwd.ok()) return fwd.error();
    if (!bwd.ok()) return bwd.error();
    seconds += fwd.value() + bwd.value();
    flops += 3 * 2.0 * static_cast<double>(T * in * out);
  }
  r.gemm_flops = flops / seconds;
  const int64_t scores = c.batch * m.num_heads * c.seq * c.seq;
  FSDP_ALLOC(qb, c.Buffer(T * q, MemCategory::kTemporaries));
  FSDP_ALLOC(kb, c.Buffer(T * kv, MemCategory::kTemporaries));
  FSDP_ALLOC(vb, c.Buffer(T * kv, MemCategory::kTemporaries));
  FSDP_ALLOC(probs, c.Buffer(scores, MemCategory::kTemporaries));
  FSDP_ALLOC(out, c.Buffer(T * q, MemCategory::kTemporaries));
  FSDP_ALLOC(dq, c.Buffer(T * q, MemCategory::kTemporaries));
  FSDP_ALLOC(dk, c.Buffer(T * kv, MemCategory::kTemporaries));
  FSDP_ALLOC(dv, c.Buffer(T * kv, MemCategory::kTemporaries));
  uint64_t seed = 11;
  for (const DeviceBuffer* b : {&qb, &kb, &vb}) FSDP_TRY(FillRandom(c, *b, seed++));
  auto attention = BestSeconds(c.stream, repeats, nullptr, [&]() -> Status {
    FSDP_TRY(DeviceAttentionForward(c, qb.get(), kb.get(), vb.get(), probs.get(), out.get()));
    return DeviceAttentionBackward(c, qb.get(), kb.get(), vb.get(), probs.get(), out.get(), dq.get(), dk.get(), dv.get());
  });
  if (!attention.ok()) return attention.error();
  r.attention_flops = AttentionTrainingFlops(m, c.batch, c.seq) / attention.value();
  const int64_t copy_bytes = int64_t{1} << 30;
  FSDP_ALLOC(src, c.alloc->Allocate(copy_bytes, MemCategory::kTemporaries, c.stream));
  FSDP_ALLOC(dst, c.alloc->Allocate(copy_bytes, MemCategory::kTemporaries, c.stream));
  auto copy = BestSeconds(c.stream, repeats, nullptr, [&] {
    return CudaStatus(cudaMemcpyAsync(dst.get(), src.get(), static_cast<size_t>(copy_bytes), cudaMemcpyDeviceToDevice, c.stream), "copy");
  });
  if (!copy.ok()) return copy.error();
  r.copy_bytes_per_s = 2.0 * static_cast<double>(copy_bytes) / copy.value();
  return r;
}

// NCCL all-gather, reduce-scatter and all-reduce across sizes (nccl-tests sizes and bus bandwidth).
Result<Json> CollectiveSweep(DeviceComm& comm, DeviceAllocator& alloc, cudaStream_t stream, DType dtype, int64_t max_bytes, int repeats) {
  Json rows = Json::array();
  const int n = comm.size();
  if (n < 2) return rows;
  const int64_t e = BytesPerElement(dtype);
  for (int64_t bytes = 4096; bytes <= max_bytes; bytes *= 4) {
    const int64_t per_rank = std::max<int64_t>(1, bytes / e / n);
    FSDP_ALLOC(small, alloc.Allocate(per_rank * e, MemCategory::kCommBuffers, stream));
    FSDP_ALLOC(big, alloc.Allocate(per_rank * n * e, MemCategory::kCommBuffers, stream));
    // each checked before the next is issued: nothing more queues behind a collective that failed
    auto ag = BestSeconds(stream, repeats, &comm, [&] { return comm.AllGather(small.get(), big.get(), per_rank, dtype, stream); });
    if (!ag.ok()) return ag.error();
    auto rs = BestSeconds(stream, repeats, &comm, [&] { return comm.ReduceScatter(big.get(), small.get(), per_rank, dtype, stream); });
    if (!rs.ok()) return rs.error();
    auto ar = BestSeconds(stream, repeats, &comm, [&] { return comm.AllReduce(big.get(), per_rank * n, dtype, stream); });
    if (!ar.ok()) return ar.error();
    rows.push_back(CollectiveRow(n, per_rank * n * e, ag.value(), rs.value(), ar.value()));
  }
  FSDP_TRY(comm.CollectTimes());
  return rows;
}

}  // namespace
}  // namespace cuda

Result<Json> CalibrateGpu(const ModelSpec& m, Comm& host, const Json& catalog, DType dtype, int64_t tokens, int64_t seq_len, int repeats,
                          int64_t max_collective_bytes) {
  using namespace cuda;
  auto devices = GpuDeviceCount();
  if (!devices.ok()) return devices.error();
  FSDP_CUDA_TRY(cudaSetDevice(GpuDeviceOfRank(host.rank(), devices.value())));
  auto name = GpuDeviceName(host.rank());
  if (!name.ok()) return name.error();
  ModelSpec shapes = m;  // calibration times the products only: RoPE scaling and the window do not matter
  shapes.rope_scaling = RopeScaling{};
  shapes.sliding_window = 0;
  auto dims = DimsOf(shapes, seq_len);
  if (!dims.ok()) return dims.error();
  struct Handles {  // destroyed last, after the allocator and the communicator below
    cudaStream_t stream = nullptr;
    cublasHandle_t blas = nullptr;
    ~Handles() {
      if (blas != nullptr) cublasDestroy(blas);
      if (stream != nullptr) cudaStreamDestroy(stream);
    }
  } handles;
  FSDP_CUDA_TRY(cudaStreamCreateWithFlags(&handles.stream, cudaStreamNonBlocking));
  FSDP_CUBLAS_TRY(cublasCreate(&handles.blas));
  FSDP_CUBLAS_TRY(cublasSetStream(handles.blas, handles.stream));
  cudaStream_t stream = handles.stream;
  cublasHandle_t blas = handles.blas;
  Result<Json> result = Error::RunFailed("calibration did not run");
  {
    DeviceAllocator alloc;
    const int64_t seq = std::max<int64_t>(1, std::min(seq_len, tokens));
    DeviceContext c{dims.value(), dtype, std::max<int64_t>(1, tokens / seq), seq, blas, stream, &alloc};
    auto rates = MeasureRates(m, c, repeats);
    auto comm = host.size() > 1 ? MakeNcclComm(host) : Result<std::unique_ptr<DeviceComm>>(MakeVirtualComm(1));
    Result<Json> sweep = comm.ok() ? CollectiveSweep(*comm.value(), alloc, stream, dtype, max_collective_bytes, repeats) : Result<Json>(comm.error());
    if (!sweep.ok() && comm.ok()) comm.value()->Abort();  // its pending collectives end, so freeing memory below cannot wait on them
    if (!rates.ok()) {
      result = rates.error();
    } else if (!sweep.ok()) {
      result = sweep.error();
    } else {
      const Rates& r = rates.value();
      Json hw = catalog;
      const std::string dtype_key(DTypeName(dtype));
      const double peak = hw["peak_flops"].value(dtype_key, 0.0), bandwidth = hw.value("memory_bandwidth_bytes_per_s", 0.0);
      hw["id"] = "calibrated-" + hw.value("id", std::string("gpu"));
      hw["name"] = fmt::format("{}, measured by fsdp-run calibrate on {}", hw.value("name", name.value()), name.value());
      hw["efficiency"]["matmul"] = peak > 0 ? std::min(1.0, r.gemm_flops / peak) : 1.0;
      hw["efficiency"]["memory_bandwidth"] = bandwidth > 0 ? std::min(1.0, r.copy_bytes_per_s / bandwidth) : 1.0;
      hw["efficiency"]["attention"] = std::min(1.0, r.attention_flops / (peak > 0 ? peak : r.gemm_flops));  // as compute_model reads it
      if (!sweep.value().empty()) hw["measured_collectives"] = sweep.value();
      // The card's total as CUDA reports it, which "fits" is judged on (hardware/README.md); a card
      // larger than the catalog entry it was calibrated from has at least that much memory.
      size_t free_bytes = 0, total_bytes = 0;
      FSDP_CUDA_TRY(cudaMemGetInfo(&free_bytes, &total_bytes));
      const auto cuda_total = static_cast<int64_t>(total_bytes);
      hw["cuda_total_bytes"] = cuda_total;
      hw["sources"]["cuda_total_bytes"] = fmt::format("measured by fsdp-run calibrate: cudaMemGetInfo's total on {}", name.value());
      if (cuda_total > hw.value("memory_bytes", int64_t{0})) {
        hw["memory_bytes"] = cuda_total;
        hw["sources"]["memory_bytes"] = "fsdp-run calibrate: at least the CUDA total it measured, above the catalog entry's figure";
      }
      hw["sources"]["efficiency"] = fmt::format(
          "measured by fsdp-run calibrate: {} GEMMs at {}'s linear shapes ({} rows, forward and both backward products) {:.1f} TFLOP/s against the "
          "datasheet {:.1f}; the engine's attention at {} x {} over the same peak; a 1 GiB device copy {:.0f} GB/s (read + write); best of {}",
          dtype_key, m.id, tokens, r.gemm_flops / 1e12, peak / 1e12, c.batch, seq, r.copy_bytes_per_s / 1e9, repeats);
      result = hw;
    }
  }
  return result;
}

}  // namespace fsdp::runtime
