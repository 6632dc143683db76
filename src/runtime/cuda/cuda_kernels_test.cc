// The GPU backend against the CPU implementation (llama_ops.h, llama_model.h, fsdp_engine.h):
// every kernel, the attention and block products through cuBLAS, the caching allocator, and whole
// training steps (losses equal to the CPU engine's; allocated peak equal to the planner's replay).
// Tolerance |gpu - cpu| <= atol + rtol * |cpu|. Without a CUDA device the binary exits 77, which
// CTest reports as skipped.
#include <cstdio>
#include <random>

#include <cuda_runtime.h>
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "core/catalog.h"
#include "core/hardware_spec.h"
#include "core/json_io.h"
#include "core/model_spec.h"
#include "core/workload.h"
#include "planner/runtime_profile.h"
#include "runtime/cuda/cuda_block.h"
#include "runtime/cuda/cuda_kernels.h"
#include "runtime/fsdp_engine.h"
#include "runtime/gpu_engine.h"
#include "runtime/llama_ops.h"

namespace fsdp::runtime::cuda {
namespace {

struct Tolerance {
  float atol, rtol;
};
constexpr Tolerance kFp32{2e-4f, 2e-3f}, kBf16{3e-2f, 3e-2f};

Mat Random(int64_t rows, int64_t cols, uint64_t seed, float scale = 1.0f) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::normal_distribution<float> normal(0.0f, scale);
  Mat m(rows, cols);
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = normal(rng);
  return m;
}

// A test's device state: a stream, cuBLAS and an allocator.
struct Gpu {
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  DeviceAllocator alloc;
  Gpu() {
    cudaStreamCreate(&stream);
    cublasCreate(&blas);
    cublasSetStream(blas, stream);
  }
  ~Gpu() {
    cudaStreamSynchronize(stream);
    cublasDestroy(blas);
  }
  // a device copy of m in dtype
  DeviceBuffer Upload(const Mat& m, DType dtype) {
    const int64_t n = m.size();
    DeviceBuffer f32 = alloc.Allocate(n * 4, Mem::kTemporaries, stream).value();
    cudaMemcpyAsync(f32.get(), m.data(), static_cast<size_t>(n * 4), cudaMemcpyHostToDevice, stream);
    if (dtype == DType::kFp32) return f32;
    DeviceBuffer out = alloc.Allocate(n * BytesPerElement(dtype), Mem::kTemporaries, stream).value();
    CastFromF32(f32.as<float>(), out.get(), dtype, n, stream);
    return out;
  }
  Mat Download(const void* data, int64_t rows, int64_t cols, DType dtype) {
    DeviceBuffer f32 = alloc.Allocate(rows * cols * 4, Mem::kTemporaries, stream).value();
    Cast(data, dtype, f32.get(), DType::kFp32, rows * cols, stream);
    Mat m(rows, cols);
    cudaMemcpyAsync(m.data(), f32.get(), static_cast<size_t>(m.size() * 4), cudaMemcpyDeviceToHost, stream);
    cudaStreamSynchronize(stream);
    return m;
  }
};

void CheckClose(const Mat& gpu, const Mat& cpu, Tolerance t, const char* what) {
  REQUIRE(gpu.rows() == cpu.rows());
  REQUIRE(gpu.cols() == cpu.cols());
  int bad = 0;
  for (Eigen::Index i = 0; i < cpu.size(); ++i) {
    const float diff = std::abs(gpu.data()[i] - cpu.data()[i]);
    if (!(diff <= t.atol + t.rtol * std::abs(cpu.data()[i]))) {
      if (bad++ < 3) MESSAGE(what << "[" << i << "]: gpu " << gpu.data()[i] << " cpu " << cpu.data()[i]);
    }
  }
  CHECK_MESSAGE(bad == 0, what << ": " << bad << " of " << cpu.size() << " outside tolerance");
  CHECK(cudaGetLastError() == cudaSuccess);
}

Mat Column(const Vec& v) { return Mat(Eigen::Map<const Mat>(v.data(), 1, v.size())); }

TEST_CASE("RMSNorm forward and backward match the CPU, in fp32 and bf16") {
  for (DType dtype : {DType::kFp32, DType::kBf16}) {
    const Tolerance tol = dtype == DType::kFp32 ? kFp32 : kBf16;
    Gpu g;
    const int64_t rows = 300, h = 96;
    const Mat x = Random(rows, h, 1), dy = Random(rows, h, 2), wm = Random(1, h, 3, 0.5f);
    Vec w = Eigen::Map<const Vec>(wm.data(), h), inv, dw_cpu = Vec::Zero(h);
    const Mat y_cpu = runtime::RmsNormForward(x, Eigen::Map<const Vec>(w.data(), h), 1e-5f, inv);
    Eigen::Map<Vec> dw_map(dw_cpu.data(), h);
    const Mat dx_cpu = runtime::RmsNormBackward(dy, x, Eigen::Map<const Vec>(w.data(), h), inv, dw_map);
    DeviceBuffer dx_ = g.Upload(x, dtype), ddy = g.Upload(dy, dtype), dw_ = g.Upload(wm, dtype);
    DeviceBuffer y = g.alloc.Allocate(rows * h * 4, Mem::kTemporaries, g.stream).value();
    DeviceBuffer dinv = g.alloc.Allocate(rows * 4, Mem::kTemporaries, g.stream).value();
    DeviceBuffer dx = g.alloc.Allocate(rows * h * 4, Mem::kTemporaries, g.stream).value();
    DeviceBuffer dw = g.alloc.Allocate(h * 4, Mem::kTemporaries, g.stream).value();
    RmsNormForward(dx_.get(), dw_.get(), y.get(), dinv.as<float>(), rows, h, 1e-5f, dtype, g.stream);
    CheckClose(g.Download(y.get(), rows, h, dtype), y_cpu, tol, "rmsnorm y");
    RmsNormBackward(ddy.get(), dx_.get(), dw_.get(), dinv.as<float>(), nullptr, dx.get(), dw.as<float>(), rows, h, dtype, g.stream);
    CheckClose(g.Download(dx.get(), rows, h, dtype), dx_cpu, tol, "rmsnorm dx");
    CheckClose(g.Download(dw.get(), 1, h, DType::kFp32), Column(dw_cpu), {tol.atol * 10, tol.rtol}, "rmsnorm dw");
  }
}

TEST_CASE("RoPE and its inverse match the CPU") {
  Gpu g;
  const int64_t rows = 64, heads = 4, d = 16, seq = 32;
  Mat x = Random(rows, heads * d, 4);
  DeviceBuffer dev = g.Upload(x, DType::kFp32);
  DeviceBuffer table = g.alloc.Allocate(seq * d * 4, Mem::kTemporaries, g.stream).value();
  RopeTable(table.as<float>(), seq, d, 10000.0f, g.stream);
  runtime::Rope(x, heads, d, seq, 10000.0f, false);
  Rope(dev.get(), table.as<float>(), rows, heads, d, seq, false, DType::kFp32, g.stream);
  CheckClose(g.Download(dev.get(), rows, heads * d, DType::kFp32), x, kFp32, "rope");
  runtime::Rope(x, heads, d, seq, 10000.0f, true);
  Rope(dev.get(), table.as<float>(), rows, heads, d, seq, true, DType::kFp32, g.stream);
  CheckClose(g.Download(dev.get(), rows, heads * d, DType::kFp32), x, kFp32, "rope inverse");
}

TEST_CASE("Causal grouped-query attention through cuBLAS matches the CPU, forward and backward") {
  Gpu g;
  const int64_t batch = 2, seq = 24, heads = 4, kv = 2, d = 8, T = batch * seq;
  const Mat q = Random(T, heads * d, 5), k = Random(T, kv * d, 6), v = Random(T, kv * d, 7), dout = Random(T, heads * d, 8);
  std::vector<Mat> probs;
  const Mat out_cpu = AttentionForward(q, k, v, batch, seq, heads, kv, d, probs);
  Mat dq_cpu, dk_cpu, dv_cpu;
  AttentionBackward(dout, q, k, v, probs, batch, seq, heads, kv, d, dq_cpu, dk_cpu, dv_cpu);
  LlamaDims dims{};
  dims.heads = heads;
  dims.kv_heads = kv;
  dims.head_dim = d;
  DeviceContext c{dims, DType::kFp32, batch, seq, g.blas, g.stream, &g.alloc};
  DeviceBuffer dq_ = g.Upload(q, DType::kFp32), dk_ = g.Upload(k, DType::kFp32), dv_ = g.Upload(v, DType::kFp32);
  DeviceBuffer ddout = g.Upload(dout, DType::kFp32);
  DeviceBuffer p = c.Buffer(batch * heads * seq * seq, Mem::kTemporaries).value(), out = c.Buffer(T * heads * d, Mem::kTemporaries).value();
  REQUIRE(DeviceAttentionForward(c, dq_.get(), dk_.get(), dv_.get(), p.get(), out.get()).ok());
  CheckClose(g.Download(out.get(), T, heads * d, DType::kFp32), out_cpu, kFp32, "attention out");
  DeviceBuffer gq = c.Buffer(T * heads * d, Mem::kTemporaries).value(), gk = c.Buffer(T * kv * d, Mem::kTemporaries).value();
  DeviceBuffer gv = c.Buffer(T * kv * d, Mem::kTemporaries).value();
  REQUIRE(DeviceAttentionBackward(c, dq_.get(), dk_.get(), dv_.get(), p.get(), ddout.get(), gq.get(), gk.get(), gv.get()).ok());
  CheckClose(g.Download(gq.get(), T, heads * d, DType::kFp32), dq_cpu, kFp32, "attention dq");
  CheckClose(g.Download(gk.get(), T, kv * d, DType::kFp32), dk_cpu, kFp32, "attention dk");
  CheckClose(g.Download(gv.get(), T, kv * d, DType::kFp32), dv_cpu, kFp32, "attention dv");
}

TEST_CASE("SwiGLU, cross-entropy and embedding match the CPU") {
  Gpu g;
  const int64_t rows = 40, n = 72, vocab = 50;
  const Mat gate = Random(rows, n, 9), up = Random(rows, n, 10), dmid = Random(rows, n, 11);
  Mat dg_cpu, du_cpu;
  runtime::SwiGluBackward(dmid, gate, up, dg_cpu, du_cpu);
  DeviceBuffer dgate = g.Upload(gate, DType::kFp32), dup = g.Upload(up, DType::kFp32), ddmid = g.Upload(dmid, DType::kFp32);
  DeviceBuffer mid = g.Upload(gate, DType::kFp32), dg = g.Upload(gate, DType::kFp32), du = g.Upload(gate, DType::kFp32);
  SwiGluForward(dgate.get(), dup.get(), mid.get(), rows * n, DType::kFp32, g.stream);
  CheckClose(g.Download(mid.get(), rows, n, DType::kFp32), runtime::SwiGluForward(gate, up), kFp32, "swiglu");
  SwiGluBackward(ddmid.get(), dgate.get(), dup.get(), dg.get(), du.get(), rows * n, DType::kFp32, g.stream);
  CheckClose(g.Download(dg.get(), rows, n, DType::kFp32), dg_cpu, kFp32, "swiglu d_gate");
  CheckClose(g.Download(du.get(), rows, n, DType::kFp32), du_cpu, kFp32, "swiglu d_up");

  const Mat logits = Random(rows, vocab, 12, 3.0f);
  std::vector<int32_t> targets(rows);
  for (int64_t i = 0; i < rows; ++i) targets[i] = static_cast<int32_t>((i * 7) % vocab);
  Mat dl_cpu;
  const float loss_cpu = CrossEntropy(logits, targets, dl_cpu);
  DeviceBuffer dl = g.Upload(logits, DType::kFp32);
  DeviceBuffer ids = g.alloc.Allocate(rows * 4, Mem::kTemporaries, g.stream).value(), loss = g.alloc.Allocate(4, Mem::kTemporaries, g.stream).value();
  cudaMemcpyAsync(ids.get(), targets.data(), rows * 4, cudaMemcpyHostToDevice, g.stream);
  cudaMemsetAsync(loss.get(), 0, 4, g.stream);
  CrossEntropyInPlace(dl.get(), ids.as<int32_t>(), loss.as<float>(), rows, vocab, 1.0f / rows, DType::kFp32, g.stream);
  CheckClose(g.Download(dl.get(), rows, vocab, DType::kFp32), dl_cpu, kFp32, "cross-entropy d_logits");
  CHECK(g.Download(loss.get(), 1, 1, DType::kFp32)(0, 0) / rows == doctest::Approx(loss_cpu).epsilon(1e-5));

  const Mat table = Random(vocab, n, 13), dout = Random(rows, n, 14);
  Mat dtable_cpu = Mat::Zero(vocab, n);
  MatMap dtable_map(dtable_cpu.data(), vocab, n);
  runtime::EmbeddingBackward(dout, targets, dtable_map);
  DeviceBuffer dtable = g.Upload(table, DType::kFp32), out = g.Upload(dout, DType::kFp32), grad = g.Upload(Mat::Zero(vocab, n), DType::kFp32);
  DeviceBuffer ddout = g.Upload(dout, DType::kFp32);
  EmbeddingForward(dtable.get(), ids.as<int32_t>(), out.get(), rows, n, DType::kFp32, g.stream);
  CheckClose(g.Download(out.get(), rows, n, DType::kFp32), runtime::EmbeddingForward(ConstMatMap(table.data(), vocab, n), targets), kFp32, "embedding");
  EmbeddingBackward(ddout.get(), ids.as<int32_t>(), grad.get(), rows, n, DType::kFp32, g.stream);
  CheckClose(g.Download(grad.get(), vocab, n, DType::kFp32), dtable_cpu, kFp32, "embedding backward");
}

TEST_CASE("A whole block's forward and backward match the CPU block") {
  auto model = LoadModel("tiny-llama");
  REQUIRE(model.ok());
  const LlamaDims d = DimsOf(model.value()).value();
  const int64_t batch = 2, seq = 16, T = batch * seq;
  const Mat params = Random(1, d.BlockNumel(), 15, 0.05f), x = Random(T, d.hidden, 16), dy = Random(T, d.hidden, 17);
  BlockCache cache;
  const Mat y_cpu = BlockForward(d, params.data(), x, batch, seq, &cache);
  Mat grads_cpu = Mat::Zero(1, d.BlockNumel());
  const Mat dx_cpu = BlockBackward(d, params.data(), grads_cpu.data(), dy, cache, batch, seq);
  for (DType dtype : {DType::kFp32, DType::kBf16}) {
    const Tolerance tol = dtype == DType::kFp32 ? kFp32 : kBf16;
    Gpu g;
    DeviceContext c{d, dtype, batch, seq, g.blas, g.stream, &g.alloc};
    DeviceBuffer table = g.alloc.Allocate(seq * d.head_dim * 4, Mem::kTemporaries, g.stream).value();
    RopeTable(table.as<float>(), seq, d.head_dim, d.rope_theta, g.stream);
    c.rope_table = table.as<float>();
    DeviceBuffer p = g.Upload(params, dtype), dx_in = g.Upload(x, dtype), ddy = g.Upload(dy, dtype), grads = g.Upload(Mat::Zero(1, d.BlockNumel()), dtype);
    DeviceBuffer scratch = g.alloc.Allocate(d.hidden * 4, Mem::kTemporaries, g.stream).value();
    DeviceBlockCache dc;
    auto y = DeviceBlockForward(c, p.get(), dx_in, &dc);
    REQUIRE(y.ok());
    CheckClose(g.Download(y.value().get(), T, d.hidden, dtype), y_cpu, tol, "block y");
    auto dx = DeviceBlockBackward(c, p.get(), grads.get(), scratch.as<float>(), dx_in, std::move(ddy), dc);
    REQUIRE(dx.ok());
    CheckClose(g.Download(dx.value().get(), T, d.hidden, dtype), dx_cpu, tol, "block dx");
    CheckClose(g.Download(grads.get(), 1, d.BlockNumel(), dtype), grads_cpu, {tol.atol * 5, tol.rtol * 2}, "block parameter gradients");
    CHECK(dc.Bytes() == 0);  // the backward consumed the cache
  }
}

TEST_CASE("The caching allocator reuses blocks per stream, waits for other streams and counts categories") {
  Gpu g;
  cudaStream_t other = nullptr;
  cudaStreamCreate(&other);
  {
    DeviceBuffer a = g.alloc.Allocate(1000, Mem::kActivations, g.stream).value();
    CHECK(g.alloc.allocated() == 1024);
    CHECK(g.alloc.live(Mem::kActivations) == 1024);
    a.Release();
    DeviceBuffer b = g.alloc.Allocate(1000, Mem::kGradients, g.stream).value();  // same block, no cudaMalloc
    CHECK(g.alloc.device_mallocs() == 1);
    CHECK(g.alloc.live(Mem::kActivations) == 0);
    CHECK(g.alloc.live(Mem::kGradients) == 1024);
    DeviceBuffer c = g.alloc.Allocate(1000, Mem::kGradients, other).value();  // another stream's pool
    CHECK(g.alloc.device_mallocs() == 2);
    b.Release({other});  // used on `other`: reusable once its event completes
    cudaStreamSynchronize(other);
    DeviceBuffer d = g.alloc.Allocate(900, Mem::kTemporaries, g.stream).value();
    CHECK(g.alloc.device_mallocs() == 2);
    CHECK(g.alloc.peak_allocated() == 2048);
    g.alloc.set_limit(4096);
    auto too_big = g.alloc.Allocate(1 << 20, Mem::kActivations, g.stream);
    REQUIRE_FALSE(too_big.ok());
    CHECK(too_big.error().message.find("out of memory") == 0);
  }
  cudaStreamDestroy(other);
}

Workload TinyWorkload(Strategy strategy, Checkpointing ac, DType param_dtype, int gpus, WrapPolicy wrap = WrapPolicy::kBlock,
                      int64_t grad_accum = 1, bool no_sync = false, int64_t gpus_per_node = 0) {
  FsdpConfig config;
  config.wrap = wrap;
  config.grad_accum = grad_accum;
  config.no_sync = no_sync;
  config.gpus = gpus;
  config.gpus_per_node = gpus_per_node > 0 ? gpus_per_node : gpus;
  config.strategy = strategy;
  config.checkpointing = ac;
  config.param_dtype = param_dtype;
  config.reduce_dtype = DType::kFp32;
  config.micro_batch = 2;
  config.seq_len = 32;
  return BuildWorkload(LoadModel("tiny-llama").value(), LoadHardware("h200-sxm").value(), config).value();
}

TEST_CASE("Training steps: fp32 losses equal the CPU engine's; allocated peak equals the planner's replay") {
  std::unique_ptr<Comm> host = MakeSingleComm();
  TrainOptions o;
  for (Strategy s : {Strategy::kFullShard, Strategy::kShardGradOp, Strategy::kNoShard, Strategy::kHybridShard}) {
    // HYBRID_SHARD stands for the whole model in one unit here (--wrap none)
    const bool whole = s == Strategy::kHybridShard;
    const Workload w = TinyWorkload(whole ? Strategy::kFullShard : s, Checkpointing::kNone, DType::kFp32, 1,
                                    whole ? WrapPolicy::kNone : WrapPolicy::kBlock);
    auto cpu = FsdpEngine::Create(w, *host, o).value();
    auto gpu = CreateGpuEngine(w, *host, o, 0);
    REQUIRE(gpu.ok());
    for (int64_t step = 0; step < 3; ++step) {
      const float a = cpu->Step(step).value(), b = gpu.value()->Step(step).value();
      CHECK(b == doctest::Approx(a).epsilon(1e-3));  // Adam normalises updates: rounding differences in near-zero gradients show
    }
    CHECK(gpu.value()->memory().peak_allocated_bytes == EstimateGpuRuntimeMemory(w).peak_bytes);
  }
  for (Checkpointing ac : {Checkpointing::kNone, Checkpointing::kFull}) {
    for (int world : {1, 8}) {  // virtual world of 8 on this GPU
      const Workload w = TinyWorkload(Strategy::kFullShard, ac, DType::kBf16, world);
      auto gpu = CreateGpuEngine(w, *host, o, world == 1 ? 0 : world);
      REQUIRE(gpu.ok());
      for (int64_t step = 0; step < 2; ++step) REQUIRE(gpu.value()->Step(step).ok());
      const GpuRuntimeMemory predicted = EstimateGpuRuntimeMemory(w);
      const GpuMemoryReport measured = gpu.value()->memory();
      CHECK(measured.peak_allocated_bytes == predicted.peak_bytes);
      for (int c = 0; c < kMemKinds; ++c) CHECK(measured.at_peak[c] == predicted.at_peak[c]);
      CHECK(gpu.value()->shard_stats().all_gather_count > 0);
    }
  }
}

TEST_CASE("Gradient accumulation with and without no_sync matches the CPU; HYBRID_SHARD's replica all-reduce in a virtual world") {
  std::unique_ptr<Comm> host = MakeSingleComm();
  TrainOptions o;
  for (bool no_sync : {false, true}) {
    const Workload w = TinyWorkload(Strategy::kFullShard, Checkpointing::kNone, DType::kFp32, 1, WrapPolicy::kBlock, 2, no_sync);
    auto cpu = FsdpEngine::Create(w, *host, o).value();
    auto gpu = CreateGpuEngine(w, *host, o, 0);
    REQUIRE(gpu.ok());
    for (int64_t step = 0; step < 2; ++step) CHECK(gpu.value()->Step(step).value() == doctest::Approx(cpu->Step(step).value()).epsilon(1e-3));
    CHECK(gpu.value()->memory().peak_allocated_bytes == EstimateGpuRuntimeMemory(w).peak_bytes);
  }
  const Workload hybrid = TinyWorkload(Strategy::kHybridShard, Checkpointing::kNone, DType::kBf16, 8, WrapPolicy::kBlock, 1, false, 4);
  REQUIRE(hybrid.shard_world == 4);
  auto gpu = CreateGpuEngine(hybrid, *host, o, 8);
  REQUIRE(gpu.ok());
  REQUIRE(gpu.value()->Step(0).ok());
  CHECK(gpu.value()->replica_stats().all_reduce_count == static_cast<int64_t>(hybrid.units.size()));
  CHECK(gpu.value()->memory().peak_allocated_bytes == EstimateGpuRuntimeMemory(hybrid).peak_bytes);
}

TEST_CASE("calibrate --device cuda measures rates into the catalog entry's efficiencies") {
  auto model = LoadModel("tiny-llama");
  auto catalog = LoadJsonFile(ResolveCatalogPath("hardware", "GPU", "h200-sxm").value());
  REQUIRE(catalog.ok());
  std::unique_ptr<Comm> host = MakeSingleComm();
  auto hw = CalibrateGpu(model.value(), *host, catalog.value(), DType::kBf16, 256, 128, 2, 1 << 20);
  REQUIRE(hw.ok());
  for (const char* key : {"matmul", "memory_bandwidth", "attention"}) {
    const double e = hw.value()["efficiency"][key].get<double>();
    CHECK(e > 0.0);
    CHECK(e <= 1.0);
  }
  CHECK(hw.value()["id"] == "calibrated-h200-sxm");
  CHECK(HardwareFromJson(hw.value(), "calibrated-h200-sxm", "calibration").ok());  // fsdp-plan accepts it as --gpu
}

}  // namespace
}  // namespace fsdp::runtime::cuda

int main(int argc, char** argv) {
  int devices = 0;
  const cudaError_t code = cudaGetDeviceCount(&devices);
  if (code != cudaSuccess || devices == 0) {
    std::printf("SKIP: no CUDA device (%s)\n", code != cudaSuccess ? cudaGetErrorString(code) : "none found");
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
