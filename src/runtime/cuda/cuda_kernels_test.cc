// The GPU backend against the CPU implementation (llama_ops.h, llama_model.h, fsdp_engine.h):
// every kernel, the attention and block products through cuBLAS, the caching allocator, and whole
// training steps (losses equal to the CPU engine's; allocated peak equal to the planner's replay).
// Tolerance |gpu - cpu| <= atol + rtol * |cpu|. Without a CUDA device only the host checks run and
// the binary then exits 77, which CTest reports as skipped (a failing host check still fails).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <cuda_runtime.h>
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "core/caching_allocator.h"

#include "core/catalog.h"
#include "core/hardware_spec.h"
#include "core/json_io.h"
#include "core/model_spec.h"
#include "core/workload.h"
#include "planner/runtime_profile.h"
#include "runtime/cuda/cuda_block.h"
#include "runtime/cuda/cuda_kernels.h"
#include "runtime/cuda/device_comm.h"
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
    DeviceBuffer f32 = alloc.Allocate(n * 4, MemCategory::kTemporaries, stream).value();
    cudaMemcpyAsync(f32.get(), m.data(), static_cast<size_t>(n * 4), cudaMemcpyHostToDevice, stream);
    if (dtype == DType::kFp32) return f32;
    DeviceBuffer out = alloc.Allocate(n * BytesPerElement(dtype), MemCategory::kTemporaries, stream).value();
    CastFromF32(f32.as<float>(), out.get(), dtype, n, stream);
    return out;
  }
  Mat Download(const void* data, int64_t rows, int64_t cols, DType dtype) {
    DeviceBuffer f32 = alloc.Allocate(rows * cols * 4, MemCategory::kTemporaries, stream).value();
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

// ||gpu - cpu|| / ||cpu|| (Frobenius): for quantities whose elements span orders of magnitude,
// where an element-wise atol would pass a zero or swapped result. Limits: fp32 results agree to
// about 1e-6 and a bf16 block to about 1e-2 (PyTorch's own bf16 block on the CPU against float64,
// the block test's shapes and initialisation), so 1e-4 and 5e-2 leave room and still fail a zero
// (error 1) or a swap.
constexpr double kRelFp32 = 1e-4, kRelBf16 = 5e-2;
void CheckRelative(const Mat& gpu, const Mat& cpu, double max_rel, const std::string& what) {
  REQUIRE(gpu.rows() == cpu.rows());
  REQUIRE(gpu.cols() == cpu.cols());
  const double ref = cpu.cast<double>().norm();
  REQUIRE_MESSAGE(ref > 0, what << ": the reference is zero");
  const double rel = (gpu.cast<double>() - cpu.cast<double>()).norm() / ref;
  CHECK_MESSAGE(rel <= max_rel, what << ": relative error " << rel << " above " << max_rel);
}

Mat Column(const Vec& v) { return Mat(Eigen::Map<const Mat>(v.data(), 1, v.size())); }

TEST_CASE("RMSNorm forward and backward match the CPU, in fp32 and bf16") {
  for (DType dtype : {DType::kFp32, DType::kBf16}) {
    const Tolerance tol = dtype == DType::kFp32 ? kFp32 : kBf16;
    Gpu g;
    const int64_t rows = 300, h = 300;  // h: more than one pass of 256 threads, not a multiple of 32
    const Mat x = Random(rows, h, 1), dy = Random(rows, h, 2), wm = Random(1, h, 3, 0.5f);
    Vec w = Eigen::Map<const Vec>(wm.data(), h), inv, dw_cpu = Vec::Zero(h);
    const Mat y_cpu = runtime::RmsNormForward(x, Eigen::Map<const Vec>(w.data(), h), 1e-5f, inv);
    Eigen::Map<Vec> dw_map(dw_cpu.data(), h);
    const Mat dx_cpu = runtime::RmsNormBackward(dy, x, Eigen::Map<const Vec>(w.data(), h), inv, dw_map);
    DeviceBuffer dx_ = g.Upload(x, dtype), ddy = g.Upload(dy, dtype), dw_ = g.Upload(wm, dtype);
    DeviceBuffer y = g.alloc.Allocate(rows * h * 4, MemCategory::kTemporaries, g.stream).value();
    DeviceBuffer dinv = g.alloc.Allocate(rows * 4, MemCategory::kTemporaries, g.stream).value();
    DeviceBuffer dx = g.alloc.Allocate(rows * h * 4, MemCategory::kTemporaries, g.stream).value();
    DeviceBuffer dw = g.alloc.Allocate(h * 4, MemCategory::kTemporaries, g.stream).value();
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
  std::vector<double> inv_freq = RopeBaseFrequencies(500000.0, d);
  inv_freq.back() /= 8;  // scaled frequencies, as Llama 3.1's, come from the table too
  Mat x = Random(rows, heads * d, 4);
  DeviceBuffer dev = g.Upload(x, DType::kFp32);
  DeviceBuffer table = g.alloc.Allocate(seq * d * 4, MemCategory::kTemporaries, g.stream).value();
  REQUIRE(RopeTable(table.as<float>(), seq, inv_freq, g.stream).ok());
  runtime::Rope(x, heads, d, seq, inv_freq, false);
  Rope(dev.get(), table.as<float>(), rows, heads, d, seq, false, DType::kFp32, g.stream);
  CheckClose(g.Download(dev.get(), rows, heads * d, DType::kFp32), x, kFp32, "rope");
  runtime::Rope(x, heads, d, seq, inv_freq, true);
  Rope(dev.get(), table.as<float>(), rows, heads, d, seq, true, DType::kFp32, g.stream);
  CheckClose(g.Download(dev.get(), rows, heads * d, DType::kFp32), x, kFp32, "rope inverse");
}

struct AttentionShape {
  int64_t batch, seq, heads, kv;
  DType dtype;
};

TEST_CASE("Causal grouped-query attention through cuBLAS matches the CPU, forward and backward") {
  // two query heads per kv head, multi-head (one per kv head) with rows longer than a thread block,
  // multi-query (one kv head: the plain GEMM path), and the first again in bf16
  for (AttentionShape shape : {AttentionShape{2, 24, 4, 2, DType::kFp32}, AttentionShape{1, 300, 4, 4, DType::kFp32},
                               AttentionShape{2, 24, 4, 1, DType::kFp32}, AttentionShape{2, 24, 4, 2, DType::kBf16}}) {
    const auto [batch, seq, heads, kv, dtype] = shape;
    CAPTURE(seq);
    CAPTURE(kv);
    const bool fp32 = dtype == DType::kFp32;
    const int64_t d = 8, T = batch * seq;
    const Mat q = Random(T, heads * d, 5), k = Random(T, kv * d, 6), v = Random(T, kv * d, 7), dout = Random(T, heads * d, 8);
    std::vector<Mat> probs;
    const Mat out_cpu = AttentionForward(q, k, v, batch, seq, heads, kv, d, probs);
    Mat dq_cpu, dk_cpu, dv_cpu;
    AttentionBackward(dout, q, k, v, probs, batch, seq, heads, kv, d, dq_cpu, dk_cpu, dv_cpu);
    Gpu g;
    LlamaDims dims{};
    dims.heads = heads;
    dims.kv_heads = kv;
    dims.head_dim = d;
    DeviceContext c{dims, dtype, batch, seq, g.blas, g.stream, &g.alloc};
    DeviceBuffer dq_ = g.Upload(q, dtype), dk_ = g.Upload(k, dtype), dv_ = g.Upload(v, dtype), ddout = g.Upload(dout, dtype);
    DeviceBuffer p = c.Buffer(batch * heads * seq * seq, MemCategory::kTemporaries).value(), out = c.Buffer(T * heads * d, MemCategory::kTemporaries).value();
    REQUIRE(DeviceAttentionForward(c, dq_.get(), dk_.get(), dv_.get(), p.get(), out.get()).ok());
    DeviceBuffer gq = c.Buffer(T * heads * d, MemCategory::kTemporaries).value(), gk = c.Buffer(T * kv * d, MemCategory::kTemporaries).value();
    DeviceBuffer gv = c.Buffer(T * kv * d, MemCategory::kTemporaries).value();
    REQUIRE(DeviceAttentionBackward(c, dq_.get(), dk_.get(), dv_.get(), p.get(), ddout.get(), gq.get(), gk.get(), gv.get()).ok());
    const std::vector<std::tuple<const char*, Mat, const Mat*>> results = {
        {"attention out", g.Download(out.get(), T, heads * d, dtype), &out_cpu},
        {"attention dq", g.Download(gq.get(), T, heads * d, dtype), &dq_cpu},
        {"attention dk", g.Download(gk.get(), T, kv * d, dtype), &dk_cpu},
        {"attention dv", g.Download(gv.get(), T, kv * d, dtype), &dv_cpu}};
    for (const auto& [what, gpu, cpu] : results) {
      if (fp32) CheckClose(gpu, *cpu, kFp32, what);
      CheckRelative(gpu, *cpu, fp32 ? kRelFp32 : kRelBf16, what);
    }
  }
}

TEST_CASE("SwiGLU matches the CPU, in fp32 and bf16") {
  for (DType dtype : {DType::kFp32, DType::kBf16}) {
    const bool fp32 = dtype == DType::kFp32;
    Gpu g;
    const int64_t rows = 40, n = 72;
    const Mat gate = Random(rows, n, 9), up = Random(rows, n, 10), dmid = Random(rows, n, 11);
    Mat dg_cpu, du_cpu;
    runtime::SwiGluBackward(dmid, gate, up, dg_cpu, du_cpu);
    DeviceBuffer dgate = g.Upload(gate, dtype), dup = g.Upload(up, dtype), ddmid = g.Upload(dmid, dtype);
    DeviceBuffer mid = g.Upload(gate, dtype), dg = g.Upload(gate, dtype), du = g.Upload(gate, dtype);
    SwiGluForward(dgate.get(), dup.get(), mid.get(), rows * n, dtype, g.stream);
    CheckClose(g.Download(mid.get(), rows, n, dtype), runtime::SwiGluForward(gate, up), fp32 ? kFp32 : kBf16, "swiglu");
    SwiGluBackward(ddmid.get(), dgate.get(), dup.get(), dg.get(), du.get(), rows * n, dtype, g.stream);
    CheckClose(g.Download(dg.get(), rows, n, dtype), dg_cpu, fp32 ? kFp32 : kBf16, "swiglu d_gate");
    CheckClose(g.Download(du.get(), rows, n, dtype), du_cpu, fp32 ? kFp32 : kBf16, "swiglu d_up");
  }
}

TEST_CASE("Bias broadcast and column sums (a bias's gradient) match the CPU, over one and many row chunks") {
  for (int64_t rows : {40, 700}) {  // 700: 64 chunks of rows summed with atomics
    Gpu g;
    const int64_t cols = 72;
    const Mat x = Random(rows, cols, 12), bias = Random(1, cols, 13);
    DeviceBuffer dx = g.Upload(x, DType::kFp32), dbias = g.Upload(bias, DType::kFp32), out = g.Upload(x, DType::kFp32);
    DeviceBuffer sums = g.alloc.Allocate(cols * 4, MemCategory::kTemporaries, g.stream).value();
    BroadcastRows(dbias.get(), out.get(), rows, cols, DType::kFp32, g.stream);
    CheckClose(g.Download(out.get(), rows, cols, DType::kFp32), bias.replicate(rows, 1), kFp32, "broadcast rows");
    ColumnSums(dx.get(), sums.as<float>(), rows, cols, DType::kFp32, g.stream);
    CheckClose(g.Download(sums.get(), 1, cols, DType::kFp32), x.colwise().sum(), {1e-3f, 1e-4f}, "column sums");
  }
}

TEST_CASE("Cross-entropy matches the CPU: vocabularies below and above one pass of 1024 threads, fp32 and bf16") {
  for (int64_t vocab : {50, 1500}) {
    for (DType dtype : {DType::kFp32, DType::kBf16}) {
      CAPTURE(vocab);
      const bool fp32 = dtype == DType::kFp32;
      Gpu g;
      const int64_t rows = 40;
      const Mat logits = Random(rows, vocab, 12, 3.0f);
      std::vector<int32_t> targets(rows);
      for (int64_t i = 0; i < rows; ++i) targets[i] = static_cast<int32_t>((i * 37) % vocab);
      Mat dl_cpu;
      const float loss_cpu = CrossEntropy(logits, targets, dl_cpu);
      DeviceBuffer dl = g.Upload(logits, dtype);
      DeviceBuffer ids = g.alloc.Allocate(rows * 4, MemCategory::kTemporaries, g.stream).value(), loss = g.alloc.Allocate(4, MemCategory::kTemporaries, g.stream).value();
      cudaMemcpyAsync(ids.get(), targets.data(), rows * 4, cudaMemcpyHostToDevice, g.stream);
      cudaMemsetAsync(loss.get(), 0, 4, g.stream);
      CrossEntropyInPlace(dl.get(), ids.as<int32_t>(), loss.as<float>(), rows, vocab, 1.0f / rows, dtype, g.stream);
      const Mat dl_gpu = g.Download(dl.get(), rows, vocab, dtype);
      if (fp32) CheckClose(dl_gpu, dl_cpu, kFp32, "cross-entropy d_logits");
      CheckRelative(dl_gpu, dl_cpu, fp32 ? kRelFp32 : kRelBf16, "cross-entropy d_logits");
      // the loss is reduced in fp32 from logits rounded to the dtype
      CHECK(g.Download(loss.get(), 1, 1, DType::kFp32)(0, 0) / rows == doctest::Approx(loss_cpu).epsilon(fp32 ? 1e-5 : 1e-2));
    }
  }
}

// Host-only checks (suite "host") also run without a GPU.
TEST_CASE("Token groups list each distinct id once with its rows, in order" * doctest::test_suite("host")) {
  const TokenGroups g = GroupTokens({5, 2, 5, 9, 2, 5});
  CHECK(g.ids == std::vector<int32_t>{2, 5, 9});
  CHECK(g.offsets == std::vector<int32_t>{0, 2, 5, 6});
  CHECK(g.rows == std::vector<int32_t>{1, 4, 0, 2, 5, 3});
  CHECK(g.Packed() == std::vector<int32_t>{2, 5, 9, 0, 2, 5, 6, 1, 4, 0, 2, 5, 3});
}

TEST_CASE("Embedding forward and backward match the CPU, with repeated tokens, in fp32 and bf16") {
  for (DType dtype : {DType::kFp32, DType::kBf16}) {
    const bool fp32 = dtype == DType::kFp32;
    Gpu g;
    const int64_t rows = 40, n = 300, vocab = 50;  // n: more than one pass of 256 threads
    std::vector<int32_t> ids_host(rows);
    for (int64_t i = 0; i < rows; ++i) ids_host[i] = static_cast<int32_t>((i * 7) % 13);  // each of 13 tokens 3 or 4 times
    const Mat table = Random(vocab, n, 13), dout = Random(rows, n, 14);
    // the gradient accumulates into what is there (the tied head's, earlier micro-batches')
    const Mat grad_before = Random(vocab, n, 15);
    Mat dtable_cpu = grad_before;
    MatMap dtable_map(dtable_cpu.data(), vocab, n);
    runtime::EmbeddingBackward(dout, ids_host, dtable_map);
    DeviceBuffer ids = g.alloc.Allocate(rows * 4, MemCategory::kTemporaries, g.stream).value();
    cudaMemcpyAsync(ids.get(), ids_host.data(), rows * 4, cudaMemcpyHostToDevice, g.stream);
    const TokenGroups groups = GroupTokens(ids_host);
    REQUIRE(groups.ids.size() == 13);
    const std::vector<int32_t> packed = groups.Packed();
    DeviceBuffer dpacked = g.alloc.Allocate(static_cast<int64_t>(packed.size()) * 4, MemCategory::kTemporaries, g.stream).value();
    cudaMemcpyAsync(dpacked.get(), packed.data(), packed.size() * 4, cudaMemcpyHostToDevice, g.stream);
    DeviceBuffer dtable = g.Upload(table, dtype), out = g.Upload(dout, dtype), grad = g.Upload(grad_before, dtype);
    DeviceBuffer ddout = g.Upload(dout, dtype);
    EmbeddingForward(dtable.get(), ids.as<int32_t>(), out.get(), rows, n, dtype, g.stream);
    CheckClose(g.Download(out.get(), rows, n, dtype), runtime::EmbeddingForward(ConstMatMap(table.data(), vocab, n), ids_host),
               fp32 ? kFp32 : kBf16, "embedding");
    EmbeddingBackward(ddout.get(), dpacked.as<int32_t>(), static_cast<int64_t>(groups.ids.size()), grad.get(), n, dtype, g.stream);
    const Mat grad_gpu = g.Download(grad.get(), vocab, n, dtype);
    if (fp32) CheckClose(grad_gpu, dtable_cpu, kFp32, "embedding backward");
    CheckRelative(grad_gpu, dtable_cpu, fp32 ? kRelFp32 : kRelBf16, "embedding backward");
    CheckRelative(grad_gpu - grad_before, dtable_cpu - grad_before, fp32 ? kRelFp32 : kRelBf16, "embedding backward's increment");
    if (fp32) CHECK(grad_gpu.bottomRows(vocab - 13) == grad_before.bottomRows(vocab - 13));  // tokens never seen: untouched
  }
}

// A block's tensors as (name, offset, numel) in its flat buffer.
struct BlockTensor {
  const char* name;
  int64_t offset, numel;
};
std::vector<BlockTensor> BlockTensors(const LlamaDims& d) {
  const auto o = d.Offsets();
  std::vector<BlockTensor> t = {{"in_norm", o.in_norm, 0}, {"wq", o.wq, 0}, {"wk", o.wk, 0}, {"wv", o.wv, 0}, {"wo", o.wo, 0},
                                {"post_norm", o.post_norm, 0}, {"wg", o.wg, 0}, {"wu", o.wu, 0}, {"wd", o.wd, 0}};
  if (d.qkv_bias) t.insert(t.end(), {{"bq", o.bq, 0}, {"bk", o.bk, 0}, {"bv", o.bv, 0}});
  std::sort(t.begin(), t.end(), [](const BlockTensor& a, const BlockTensor& b) { return a.offset < b.offset; });
  for (size_t i = 0; i < t.size(); ++i) t[i].numel = (i + 1 < t.size() ? t[i + 1].offset : d.BlockNumel()) - t[i].offset;
  return t;
}

// tiny-llama's block, or with Qwen2's q/k/v biases (drawn like the weights) when qkv_bias.
void CheckDeviceBlock(bool qkv_bias) {
  CAPTURE(qkv_bias);
  auto model = LoadModel("tiny-llama");
  REQUIRE(model.ok());
  const int64_t batch = 2, seq = 16, T = batch * seq;
  ModelSpec spec = model.value();
  if (qkv_bias) {  // the architecture's q/k/v projections get biases; the inventory follows
    for (ParamOp& op : spec.arch.block) op.bias = op.module == "self_attn.q_proj" || op.module == "self_attn.k_proj" || op.module == "self_attn.v_proj";
    spec.qkv_bias = true;
    spec.tensors = BuildInventory(spec);
  }
  const LlamaDims d = DimsOf(spec, seq).value();
  REQUIRE(d.qkv_bias == qkv_bias);
  REQUIRE(d.Offsets().bq == (qkv_bias ? d.Offsets().wq + d.heads * d.head_dim * d.hidden : -1));
  // Linear weights of std 0.1 (about 1/sqrt(hidden)) and norm weights near 1, as after training
  // starts: every path through the block then carries a gradient well above the tolerances.
  Mat params = Random(1, d.BlockNumel(), 15, 0.1f);
  const auto o = d.Offsets();
  for (int64_t norm : {o.in_norm, o.post_norm}) params.middleCols(norm, d.hidden) = Random(1, d.hidden, norm, 0.1f).array() + 1.0f;
  const Mat x = Random(T, d.hidden, 16), dy = Random(T, d.hidden, 17);
  BlockCache cache;
  const Mat y_cpu = BlockForward(d, params.data(), x, batch, seq, &cache);
  Mat grads_cpu = Mat::Zero(1, d.BlockNumel());
  const Mat dx_cpu = BlockBackward(d, params.data(), grads_cpu.data(), dy, cache, batch, seq);
  for (DType dtype : {DType::kFp32, DType::kBf16}) {
    const bool fp32 = dtype == DType::kFp32;
    const double rel = fp32 ? kRelFp32 : kRelBf16;
    Gpu g;
    DeviceContext c{d, dtype, batch, seq, g.blas, g.stream, &g.alloc};
    DeviceBuffer table = g.alloc.Allocate(seq * d.head_dim * 4, MemCategory::kTemporaries, g.stream).value();
    REQUIRE(RopeTable(table.as<float>(), seq, d.rope_inv_freq, g.stream).ok());
    c.rope_table = table.as<float>();
    DeviceBuffer p = g.Upload(params, dtype), dx_in = g.Upload(x, dtype), ddy = g.Upload(dy, dtype), grads = g.Upload(Mat::Zero(1, d.BlockNumel()), dtype);
    // x and dy as the GPU holds them (rounded in bf16)
    const Mat x_gpu = g.Download(dx_in.get(), T, d.hidden, dtype), dy_gpu = g.Download(ddy.get(), T, d.hidden, dtype);
    DeviceBuffer scratch = g.alloc.Allocate(d.hidden * 4, MemCategory::kTemporaries, g.stream).value();
    DeviceBlockCache dc;
    auto y = DeviceBlockForward(c, p.get(), dx_in, &dc);
    REQUIRE(y.ok());
    const Mat y_gpu = g.Download(y.value().get(), T, d.hidden, dtype);
    if (fp32) CheckClose(y_gpu, y_cpu, kFp32, "block y");
    CheckRelative(y_gpu - x_gpu, y_cpu - x, rel, "block y - x (what attention and MLP add)");
    auto dx = DeviceBlockBackward(c, p.get(), grads.get(), scratch.as<float>(), dx_in, std::move(ddy), dc);
    REQUIRE(dx.ok());
    const Mat dx_gpu = g.Download(dx.value().get(), T, d.hidden, dtype);
    if (fp32) CheckClose(dx_gpu, dx_cpu, kFp32, "block dx");
    CheckRelative(dx_gpu - dy_gpu, dx_cpu - dy, rel, "block dx - dy (what flows back through attention and MLP)");
    const Mat grads_gpu = g.Download(grads.get(), 1, d.BlockNumel(), dtype);
    for (const BlockTensor& t : BlockTensors(d)) {
      CheckRelative(grads_gpu.middleCols(t.offset, t.numel), grads_cpu.middleCols(t.offset, t.numel), rel,
                    std::string("block gradient of ") + t.name + (fp32 ? " (fp32)" : " (bf16)"));
    }
    CHECK(dc.Bytes() == 0);  // the backward consumed the cache
  }
}

TEST_CASE("A whole block's forward and backward match the CPU block") { CheckDeviceBlock(false); }
TEST_CASE("A block with q/k/v biases (Qwen2) matches the CPU block") { CheckDeviceBlock(true); }

TEST_CASE("The caching allocator reuses blocks per stream, waits for other streams and counts categories") {
  Gpu g;
  cudaStream_t other = nullptr;
  cudaStreamCreate(&other);
  {
    DeviceBuffer a = g.alloc.Allocate(1000, MemCategory::kActivations, g.stream).value();
    CHECK(g.alloc.allocated() == 1024);
    CHECK(g.alloc.live(MemCategory::kActivations) == 1024);
    a.Release();
    DeviceBuffer b = g.alloc.Allocate(1000, MemCategory::kGradients, g.stream).value();  // same block, no cudaMalloc
    CHECK(g.alloc.device_mallocs() == 1);
    CHECK(g.alloc.live(MemCategory::kActivations) == 0);
    CHECK(g.alloc.live(MemCategory::kGradients) == 1024);
    DeviceBuffer c = g.alloc.Allocate(1000, MemCategory::kGradients, other).value();  // another stream's pool
    CHECK(g.alloc.device_mallocs() == 2);
    b.Release({other});  // used on `other`: reusable once its event completes
    cudaStreamSynchronize(other);
    DeviceBuffer d = g.alloc.Allocate(900, MemCategory::kTemporaries, g.stream).value();
    CHECK(g.alloc.device_mallocs() == 2);
    CHECK(g.alloc.peak_allocated() == 2048);
    g.alloc.set_limit(4096);
    auto too_big = g.alloc.Allocate(1 << 20, MemCategory::kActivations, g.stream);
    REQUIRE_FALSE(too_big.ok());
    CHECK(too_big.error().message.find("out of memory") == 0);
  }
  cudaStreamDestroy(other);
}

TEST_CASE("One policy, two backends: the device allocator reserves what the planner's counting replay does") {
  Gpu g;
  cudaStream_t other = nullptr;
  cudaStreamCreate(&other);
  CountingDeviceMemory counting(int64_t{1} << 40, int64_t{1} << 40);
  CachingAllocator replay(AllocatorConfig{}, counting);
  {
    const int64_t sizes[] = {1000, 3 << 20, 16 << 20, (11 << 20) + 1, 300, 5 << 20};
    std::vector<DeviceBuffer> live;
    std::vector<CachingAllocator::Handle> handles;
    for (int i = 0; i < 6; ++i) {
      cudaStream_t s = i % 3 == 2 ? other : g.stream;
      live.push_back(g.alloc.Allocate(sizes[i], MemCategory::kActivations, s).value());
      handles.push_back(replay.Malloc(sizes[i], i % 3 == 2 ? 1 : 0));
    }
    for (int i : {1, 4}) {
      live[i].Release();
      replay.Free(handles[i]);
    }
    live.push_back(g.alloc.Allocate(2 << 20, MemCategory::kGradients, g.stream).value());  // into the freed 3 MiB block
    handles.push_back(replay.Malloc(2 << 20, 0));
    CHECK(g.alloc.reserved() == replay.stats().reserved_bytes);
    CHECK(g.alloc.peak_reserved() == replay.stats().reserved_peak_bytes);
    CHECK(g.alloc.device_mallocs() == replay.stats().num_device_alloc);
    // by hand: a 2 MiB small segment and a 20 MiB one on the compute stream (the 11 MiB request and
    // the 2 MiB one fit the 20 MiB segment's free parts), 16 MiB and 20 MiB on the other stream
    CHECK(replay.stats().reserved_bytes == int64_t{2 + 20 + 16 + 20} << 20);
  }
  cudaStreamDestroy(other);
}

TEST_CASE("A virtual world's collectives write what its size of identical ranks would") {
  Gpu g;
  std::unique_ptr<DeviceComm> comm = MakeVirtualComm(4);
  const int64_t count = 3;
  const Mat in = Random(1, 4 * count, 21), shard = Random(1, count, 22);
  DeviceBuffer din = g.Upload(in, DType::kFp32), dshard = g.Upload(shard, DType::kFp32);
  DeviceBuffer out = g.Upload(Mat::Zero(1, count), DType::kFp32), gathered = g.Upload(Mat::Zero(1, 4 * count), DType::kFp32);
  REQUIRE(comm->ReduceScatter(din.get(), out.get(), count, DType::kFp32, g.stream).ok());
  CHECK(g.Download(out.get(), 1, count, DType::kFp32) == Mat(4.0f * in.leftCols(count)));  // rank 0's slice from 4 ranks
  REQUIRE(comm->AllReduce(out.get(), count, DType::kFp32, g.stream).ok());
  CHECK(g.Download(out.get(), 1, count, DType::kFp32) == Mat(16.0f * in.leftCols(count)));
  REQUIRE(comm->AllGather(dshard.get(), gathered.get(), count, DType::kFp32, g.stream).ok());
  const Mat all = g.Download(gathered.get(), 1, 4 * count, DType::kFp32);
  for (int r = 0; r < 4; ++r) CHECK(all.middleCols(r * count, count) == shard);
  REQUIRE(comm->CollectTimes().ok());
  CHECK(comm->stats().reduce_scatter_count == 1);
  CHECK(comm->stats().reduce_scatter_bytes == 4 * count * 4);
  CHECK(comm->stats().all_gather_bytes == 4 * count * 4);
}

Workload TinyWorkload(Strategy strategy, Checkpointing ac, DType param_dtype, int gpus, WrapPolicy wrap = WrapPolicy::kBlock,
                      int64_t grad_accum = 1, bool no_sync = false, int64_t gpus_per_node = 0, Framework framework = Framework::kFsdp1) {
  FsdpConfig config;
  config.framework = framework;
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
  for (Checkpointing ac : {Checkpointing::kNone, Checkpointing::kSelective, Checkpointing::kFull}) {
    for (int world : {1, 8}) {  // virtual world of 8 on this GPU
      const Workload w = TinyWorkload(Strategy::kFullShard, ac, DType::kBf16, world);
      auto gpu = CreateGpuEngine(w, *host, o, world == 1 ? 0 : world);
      REQUIRE(gpu.ok());
      // bf16 activations against the CPU engine's fp32 arithmetic on bf16-rounded parameters: the
      // same loss to rounding; a virtual world's copies stand in for other ranks' shards, so its loss
      // only has to be a finite cross-entropy
      auto cpu = world == 1 ? FsdpEngine::Create(w, *host, o).value() : nullptr;
      for (int64_t step = 0; step < 2; ++step) {
        auto loss = gpu.value()->Step(step);
        REQUIRE(loss.ok());
        CHECK(std::isfinite(loss.value()));
        CHECK(loss.value() > 0.0f);
        if (cpu) CHECK(loss.value() == doctest::Approx(cpu->Step(step).value()).epsilon(2e-2));
      }
      const GpuRuntimeMemory predicted = EstimateGpuRuntimeMemory(w);
      const GpuMemoryReport measured = gpu.value()->memory();
      CHECK(measured.peak_allocated_bytes == predicted.peak_bytes);
      for (MemCategory c : kRuntimeCategories) CHECK(At(measured.at_peak, c) == At(predicted.at_peak, c));
      // the reserve lies between the replay's two ends: events passed at the next allocation, and
      // only at the end of the step (on the H200 all nine measured runs did)
      CHECK(measured.peak_reserved_bytes >= predicted.reserved_peak_bytes);
      CHECK(measured.peak_reserved_bytes <= predicted.reserved_peak_lagging_bytes);
      CHECK(gpu.value()->shard_stats().all_gather_count > 0);
    }
  }
}

TEST_CASE("Gradient accumulation with and without no_sync matches the CPU; HYBRID_SHARD's replica all-reduce in a virtual world") {
  std::unique_ptr<Comm> host = MakeSingleComm();
  TrainOptions o;
  // FULL_SHARD with and without no_sync, and SHARD_GRAD_OP under no_sync, which keeps the
  // parameters unsharded from one micro-batch to the next (one all-gather per unit and step)
  for (auto [strategy, no_sync] : {std::pair{Strategy::kFullShard, false}, std::pair{Strategy::kFullShard, true}, std::pair{Strategy::kShardGradOp, true}}) {
    const Workload w = TinyWorkload(strategy, Checkpointing::kNone, DType::kFp32, 1, WrapPolicy::kBlock, 2, no_sync);
    auto cpu = FsdpEngine::Create(w, *host, o).value();
    auto gpu = CreateGpuEngine(w, *host, o, 0);
    REQUIRE(gpu.ok());
    for (int64_t step = 0; step < 2; ++step) CHECK(gpu.value()->Step(step).value() == doctest::Approx(cpu->Step(step).value()).epsilon(1e-3));
    CHECK(gpu.value()->memory().peak_allocated_bytes == EstimateGpuRuntimeMemory(w).peak_bytes);
    if (strategy == Strategy::kShardGradOp) CHECK(gpu.value()->shard_stats().all_gather_count == 2 * static_cast<int64_t>(w.units.size()));
  }
  // the host waits for the device at the end of a step only, however many micro-batches: FSDP2
  // (no rate limiter), fp32 (no inf check); the three streams' ends at most
  for (int64_t grad_accum : {1, 4}) {
    const Workload w = TinyWorkload(Strategy::kFullShard, Checkpointing::kNone, DType::kFp32, 1, WrapPolicy::kBlock, grad_accum, false, 0, Framework::kFsdp2);
    auto gpu = CreateGpuEngine(w, *host, o, 0);
    REQUIRE(gpu.ok());
    for (int64_t step = 0; step < 3; ++step) REQUIRE(gpu.value()->Step(step).ok());
    const std::vector<int64_t> waits = gpu.value()->times().host_waits;
    REQUIRE(waits.size() == 3);
    // cuda-emu runs work only when waited for, so each of the three waits finds it unfinished
    const bool emulated = gpu.value()->device_name().find("cuda-emu") != std::string::npos;
    for (int64_t n : waits) {
      if (emulated) {
        CHECK(n == 3);
      } else {
        CHECK(n <= 3);
      }
    }
  }
  const Workload hybrid = TinyWorkload(Strategy::kHybridShard, Checkpointing::kNone, DType::kBf16, 8, WrapPolicy::kBlock, 1, false, 4);
  REQUIRE(hybrid.shard_world == 4);
  auto gpu = CreateGpuEngine(hybrid, *host, o, 8);
  REQUIRE(gpu.ok());
  REQUIRE(gpu.value()->Step(0).ok());
  CHECK(gpu.value()->replica_stats().all_reduce_count == static_cast<int64_t>(hybrid.units.size()));
  CHECK(gpu.value()->memory().peak_allocated_bytes == EstimateGpuRuntimeMemory(hybrid).peak_bytes);
}

TEST_CASE("The inf/NaN flag is set by an inf or a NaN anywhere, and only then") {
  Gpu g;
  Mat x = Random(1, 5000, 31);
  DeviceBuffer data = g.Upload(x, DType::kFp32);
  DeviceBuffer flag = g.alloc.Allocate(4, MemCategory::kTemporaries, g.stream).value();
  auto flagged = [&]() {
    cudaMemsetAsync(flag.get(), 0, 4, g.stream);
    FlagNonFinite(data.as<float>(), x.size(), flag.as<float>(), g.stream);
    return g.Download(flag.get(), 1, 1, DType::kFp32)(0, 0);
  };
  CHECK(flagged() == 0.0f);
  for (float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(), std::nanf("")}) {
    Mat y = x;
    y(0, 4999) = bad;
    data = g.Upload(y, DType::kFp32);
    CHECK(flagged() == 1.0f);
  }
}

TEST_CASE("Dynamic loss scaling: exact where nothing overflows; an fp16 overflow skips the step and halves the scale") {
  std::unique_ptr<Comm> host = MakeSingleComm();
  TrainOptions none, dynamic;
  dynamic.loss_scaling.mode = LossScaling::kDynamic;
  const Workload fp32 = TinyWorkload(Strategy::kFullShard, Checkpointing::kNone, DType::kFp32, 1);
  auto a = CreateGpuEngine(fp32, *host, none, 0);
  auto b = CreateGpuEngine(fp32, *host, dynamic, 0);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  for (int64_t step = 0; step < 3; ++step) CHECK(b.value()->Step(step).value() == doctest::Approx(a.value()->Step(step).value()).epsilon(1e-5));
  CHECK(b.value()->loss_scaler().skipped_steps().empty());
  CHECK(b.value()->loss_scaler().scale() == 65536.0f);
  // 2^30 / 64 tokens makes the fp16 logits' gradient overflow at once
  TrainOptions huge = dynamic;
  huge.loss_scaling.init_scale = std::ldexp(1.0f, 30);
  const Workload fp16 = TinyWorkload(Strategy::kFullShard, Checkpointing::kNone, DType::kFp16, 1);
  auto c = CreateGpuEngine(fp16, *host, huge, 0);
  REQUIRE(c.ok());
  auto loss = c.value()->Step(0);
  REQUIRE(loss.ok());
  CHECK(std::isfinite(loss.value()));  // the loss itself is not scaled
  CHECK(c.value()->loss_scaler().skipped_steps() == std::vector<int64_t>{0});
  CHECK(c.value()->loss_scaler().scale() == std::ldexp(1.0f, 29));
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
  doctest::Context context(argc, argv);
  if (code != cudaSuccess || devices == 0) {  // the host-only checks, then skipped
    context.setOption("test-suite", "host");
    if (const int failed = context.run(); failed != 0) return failed;
    std::printf("SKIP: no CUDA device (%s): only the host checks ran\n", code != cudaSuccess ? cudaGetErrorString(code) : "none found");
    return 77;
  }
  return context.run();
}
