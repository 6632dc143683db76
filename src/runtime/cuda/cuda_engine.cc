// The GPU FSDP engine (gpu_engine.h): streams, events, the rate limiter and the per-unit buffers.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <deque>
#include <thread>

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include "runtime/cuda/cuda_block.h"
#include "runtime/cuda/cuda_check.h"
#include "runtime/cuda/cuda_gemm.h"
#include "runtime/cuda/cuda_kernels.h"
#include "runtime/cuda/device_comm.h"
#include "runtime/gpu_engine.h"

namespace fsdp::runtime {

bool GpuBackendBuilt() { return true; }

Result<int> GpuDeviceCount() {
  int count = 0;
  const cudaError_t code = cudaGetDeviceCount(&count);
  if (code != cudaSuccess) return Error::RunFailed(fmt::format("no CUDA device: {}", cudaGetErrorString(code)));
  if (count == 0) return Error::RunFailed("no CUDA device: cudaGetDeviceCount found none");
  return count;
}

int GpuDeviceOfRank(int rank, int devices) {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID", "LOCAL_RANK"}) {
    if (const char* value = std::getenv(name)) return std::atoi(value) % devices;
  }
  return rank % devices;
}

Result<std::string> GpuDeviceName(int rank) {
  auto count = GpuDeviceCount();
  if (!count.ok()) return count.error();
  cudaDeviceProp prop{};
  const cudaError_t code = cudaGetDeviceProperties(&prop, GpuDeviceOfRank(rank, count.value()));
  if (code != cudaSuccess) return Error::RunFailed(fmt::format("cudaGetDeviceProperties: {}", cudaGetErrorString(code)));
  return std::string(prop.name);
}

namespace cuda {
namespace {

int64_t DeviceUsedBytes() {
  size_t free_bytes = 0, total = 0;
  if (cudaMemGetInfo(&free_bytes, &total) != cudaSuccess) return 0;
  return static_cast<int64_t>(total - free_bytes);
}

class CudaEngine : public GpuEngine {
 public:
  CudaEngine(const Workload& w, Comm& host, const TrainOptions& o) : w_(w), host_(host), o_(o), schedule_(BuildSchedule(w)), phases_(w), scaler_(o.loss_scaling) {
    alloc_.set_namer([&w](const Phase& p) { return PhaseName(w, p); });
  }
  ~CudaEngine() override;
  /// Sets up the device, the communicators and the sharded model.
  Status Init(int virtual_world) { return Guarded(InitDevice(virtual_world)); }

  Result<float> Step(int64_t step) override { return Guarded(StepOnce(step)); }
  void set_memory_limit(int64_t bytes) override { alloc_.set_limit(bytes); }
  GpuMemoryReport memory() const override;
  GpuPhaseTimes times() const override { return times_; }
  const CommStats& shard_stats() const override { return shard_->stats(); }
  const CommStats& replica_stats() const override { return replica_->stats(); }
  int64_t shard_world() const override { return w_.shard_world; }
  std::string device_name() const override { return device_name_; }
  const LossScaler& loss_scaler() const override { return scaler_; }

 private:
  template <typename R>
  R Guarded(R r) {
    if (!r.ok()) failed_ = true;
    return r;
  }
  Status InitDevice(int virtual_world);
  Status MeasureCublas();
  Status MakeGroups();
  Result<float> StepOnce(int64_t step);
  Status InitUnit(int u);
  /// Enqueues unit u's all-gather; with FSDP1's rate limiter the host first waits for the oldest
  /// queued free event when the schedule says so.
  Status Unshard(int u, bool rate_limit_wait);
  Status Reshard(int u, bool queues_free_event);
  Status Reduce(int u);
  Result<float> MicroBatch(int64_t step, int64_t micro);
  /// Copies a micro-batch's token ids, targets and token groups to the device through staging_[micro].
  Status UploadTokens(int64_t micro, const std::vector<int32_t>& ids, const std::vector<int32_t>& targets, const std::vector<int32_t>& packed);
  /// The micro-batch's schedule: hooks unshard, reshard and reduce; segments run the modules.
  Status PlaySchedule(int64_t micro);
  Status ForwardNode(int node);
  Status BackwardNode(int node);
  Status Optimizer();
  /// Whether any rank's gradient shards hold an inf or NaN: a device flag, summed over the ranks.
  Result<bool> FoundNonFinite();
  /// WaitForEvent (device_comm.h) polling this engine's communicators for NCCL errors, counting
  /// the waits that found the device busy: the end of a step, FSDP1's rate limiter, the fp16 inf
  /// check, the allocator's out-of-memory retry.
  Status WaitEvent(cudaEvent_t event);
  /// The same for the work enqueued on `stream` so far.
  Status WaitStream(cudaStream_t stream);
  /// Module node `node`'s parameters in its unit's unsharded buffer (a tied lm_head's: the
  /// embedding's), and its gradients, allocated at the unit's first backward.
  void* Params(int node) const;
  Result<void*> Grads(int node);
  int ParamTensor(int node) const;
  int64_t world() const { return virtual_world_ > 0 ? virtual_world_ : host_.size(); }

  const Workload& w_;
  Comm& host_;
  TrainOptions o_;
  int virtual_world_ = 0;
  std::string device_name_;
  cudaStream_t compute_ = nullptr, gather_ = nullptr, reduce_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  DeviceAllocator alloc_;  // before every DeviceBuffer member: destroyed after them
  DeviceContext ctx_;
  std::unique_ptr<DeviceComm> shard_, replica_;
  bool failed_ = false;  // Init or a step returned an error: the destructor aborts the communicators
  DType dtype_ = DType::kBf16, reduce_dtype_ = DType::kFp32;
  std::vector<DeviceBuffer> shard_params_, exp_avg_, exp_avg_sq_, grad_shard_, full_, full_grad_;
  Schedule schedule_;
  PhaseTracker phases_;  // the phase the allocator is told (core/phase.h)
  std::vector<cudaEvent_t> gathered_;
  std::deque<cudaEvent_t> reshard_events_;  // limit_all_gathers: frees the CPU may run ahead of
  EventPool events_{cudaEventDisableTiming};
  cudaEvent_t params_ready_ = nullptr, reduced_ = nullptr;
  DeviceBuffer dw_scratch_, rope_table_, loss_sum_, ids_, targets_;
  DeviceBuffer token_groups_;  // GroupTokens(ids).Packed(): the embedding backward's rows per token
  // Pinned host memory each micro-batch of a step stages its tokens in, and the event after the
  // copies that read it: a copy from pinned memory is asynchronous, where from pageable memory
  // cudaMemcpyAsync may first wait for the stream (CUDA runtime API, "API synchronization behavior").
  struct TokenStaging {
    int32_t* host = nullptr;
    cudaEvent_t copied = nullptr;
  };
  std::vector<TokenStaging> staging_;
  int64_t host_waits_ = 0;  // WaitEvent calls that found the device still working
  int64_t distinct_tokens_ = 0;
  // per micro-batch state
  std::vector<DeviceBuffer> inputs_;  // block inputs (block 0's is the embedding output)
  std::vector<DeviceBlockCache> caches_;
  DeviceBuffer x_, final_x_, normed_, inv_final_, logits_, d_normed_;
  std::array<cudaEvent_t, 4> phase_events_{};
  GpuPhaseTimes times_;
  GpuMemoryReport device_view_;
  LossScaler scaler_;
  int64_t optimizer_steps_ = 0;  // AdamW's step count: skipped steps do not count
  DeviceBuffer found_inf_;       // FoundNonFinite's flag
};

CudaEngine::~CudaEngine() {
  if (failed_) {  // collectives left pending may wait for peers that have given up: stop them, not wait
    for (DeviceComm* c : {shard_.get(), replica_.get()}) {
      if (c != nullptr) c->Abort();
    }
  }
  if (compute_ != nullptr) cudaDeviceSynchronize();
  for (cudaEvent_t e : gathered_) cudaEventDestroy(e);
  for (cudaEvent_t e : reshard_events_) cudaEventDestroy(e);
  for (cudaEvent_t e : phase_events_) cudaEventDestroy(e);
  cudaEventDestroy(params_ready_);
  cudaEventDestroy(reduced_);
  for (const TokenStaging& slot : staging_) {
    if (slot.host != nullptr) cudaFreeHost(slot.host);
    if (slot.copied != nullptr) cudaEventDestroy(slot.copied);
  }
  if (blas_ != nullptr) cublasDestroy(blas_);
  for (cudaStream_t s : {compute_, gather_, reduce_}) {
    if (s != nullptr) cudaStreamDestroy(s);
  }
}

// The cuBLAS handle and a first product (cuBLAS takes its workspace then), measured as the growth of
// the device's used memory with the product's buffers already allocated.
Status CudaEngine::MeasureCublas() {
  FSDP_ALLOC(probe, alloc_.Allocate(3 * 64 * 64 * 4, MemCategory::kTemporaries, compute_));
  const int64_t before = DeviceUsedBytes();
  FSDP_CUBLAS_TRY(cublasCreate(&blas_));
  FSDP_CUBLAS_TRY(cublasSetStream(blas_, compute_));
  FSDP_TRY(Gemm(blas_, dtype_, false, true, 64, 64, 64, {probe.get(), 64}, {Offset(probe.get(), 4096, dtype_), 64},
                Offset(probe.get(), 8192, dtype_), 64, 0.0f));
  FSDP_CUDA_TRY(cudaStreamSynchronize(compute_));
  device_view_.cublas_bytes = DeviceUsedBytes() - before;
  return {};
}

// The shard and replica groups. In a virtual world, stand-ins of their sizes. Over NCCL, as PyTorch
// makes them: the world's communicator itself for a group of every rank, a one-rank stand-in for a
// group of one (FULL_SHARD's replicas, NO_SHARD's shards), and splits of the world for
// HYBRID_SHARD (the world's own communicator is then released). Each NCCL communicator runs one
// all-reduce on the loss buffer, as NCCL connects lazily, before its memory is read.
Status CudaEngine::MakeGroups() {
  const int shard_world = static_cast<int>(w_.shard_world);
  if (virtual_world_ > 0) {
    shard_ = MakeVirtualComm(shard_world);
    replica_ = MakeVirtualComm(virtual_world_ / shard_world);
    return {};
  }
  const int64_t before = DeviceUsedBytes();
  auto world = MakeNcclComm(host_);
  if (!world.ok()) return world.error();
  const int rank = host_.rank(), size = host_.size();
  std::vector<DeviceComm*> nccl;
  if (shard_world == size) {
    shard_ = std::move(world).value();
    replica_ = MakeVirtualComm(1);
    nccl = {shard_.get()};
  } else if (shard_world == 1) {
    replica_ = std::move(world).value();
    shard_ = MakeVirtualComm(1);
    nccl = {replica_.get()};
  } else {
    auto shard = world.value()->Split(rank / shard_world, rank);
    auto replica = shard.ok() ? world.value()->Split(rank % shard_world, rank) : shard.error();
    if (!replica.ok()) {
      world.value()->Abort();
      return replica.error();
    }
    shard_ = std::move(shard).value();
    replica_ = std::move(replica).value();
    world.value().reset();  // PyTorch's HSDP keeps only the two groups' communicators
    nccl = {shard_.get(), replica_.get()};
  }
  for (DeviceComm* c : nccl) FSDP_TRY(c->AllReduce(loss_sum_.get(), 1, DType::kFp32, compute_));
  FSDP_TRY(WaitStream(compute_));
  for (DeviceComm* c : nccl) FSDP_TRY(c->ClearStats());  // the warm-up is not the training's
  device_view_.nccl_bytes = DeviceUsedBytes() - before;
  device_view_.nccl_communicators = static_cast<int>(nccl.size());
  return {};
}

Status CudaEngine::InitDevice(int virtual_world) {
  auto devices = GpuDeviceCount();
  if (!devices.ok()) return devices.error();
  const int device = GpuDeviceOfRank(host_.rank(), devices.value());
  FSDP_CUDA_TRY(cudaSetDevice(device));
  FSDP_CUDA_TRY(cudaFree(nullptr));  // creates the context
  cudaDeviceProp prop{};
  FSDP_CUDA_TRY(cudaGetDeviceProperties(&prop, device));
  device_name_ = prop.name;
  size_t free_bytes = 0, total = 0;
  FSDP_CUDA_TRY(cudaMemGetInfo(&free_bytes, &total));
  device_view_.device_total_bytes = static_cast<int64_t>(total);
  device_view_.context_bytes = static_cast<int64_t>(total - free_bytes);
  FSDP_CUDA_TRY(cudaStreamCreateWithFlags(&compute_, cudaStreamNonBlocking));
  FSDP_CUDA_TRY(cudaStreamCreateWithFlags(&gather_, cudaStreamNonBlocking));
  FSDP_CUDA_TRY(cudaStreamCreateWithFlags(&reduce_, cudaStreamNonBlocking));
  alloc_.set_device_wait([this]() -> Status {
    for (cudaStream_t s : {compute_, gather_, reduce_}) FSDP_TRY(WaitStream(s));
    return {};
  });
  auto alloc_conf = ParseAllocatorConfig(w_.config.alloc_conf);
  if (!alloc_conf.ok()) return alloc_conf.error();
  FSDP_TRY(alloc_.Configure(alloc_conf.value()));
  virtual_world_ = virtual_world;
  dtype_ = w_.config.param_dtype;
  reduce_dtype_ = w_.config.reduce_dtype;
  auto dims = DimsOf(w_.model, w_.config.seq_len);
  if (!dims.ok()) return dims.error();
  FSDP_TRY(MeasureCublas());
  ctx_ = DeviceContext{dims.value(), dtype_, w_.config.micro_batch, w_.config.seq_len, blas_, compute_, &alloc_};
  FSDP_ALLOC(loss, alloc_.Allocate(4, MemCategory::kTemporaries, compute_));
  loss_sum_ = std::move(loss);
  FSDP_ALLOC(found, alloc_.Allocate(4, MemCategory::kTemporaries, compute_));
  found_inf_ = std::move(found);
  FSDP_TRY(MakeGroups());
  FSDP_ALLOC(dw, alloc_.Allocate(ctx_.dims.hidden * 4, MemCategory::kTemporaries, compute_));
  dw_scratch_ = std::move(dw);
  FSDP_ALLOC(rope, alloc_.Allocate(ctx_.seq * ctx_.dims.head_dim * 4, MemCategory::kTemporaries, compute_));  // cos and sin, seq x head_dim/2 each
  FSDP_TRY(RopeTable(rope.as<float>(), ctx_.seq, ctx_.dims.rope_inv_freq, compute_));
  rope_table_ = std::move(rope);
  ctx_.rope_table = rope_table_.as<float>();
  for (cudaEvent_t* e : {&params_ready_, &reduced_}) FSDP_CUDA_TRY(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  for (cudaEvent_t& e : phase_events_) FSDP_CUDA_TRY(cudaEventCreate(&e));
  // before the steps: a page-locked allocation can stop the streams running concurrently
  staging_.resize(static_cast<size_t>(w_.config.grad_accum));
  for (TokenStaging& slot : staging_) {
    FSDP_CUDA_TRY(cudaEventCreateWithFlags(&slot.copied, cudaEventDisableTiming));
    void* p = nullptr;
    FSDP_CUDA_TRY(cudaHostAlloc(&p, static_cast<size_t>(5 * ctx_.tokens() + 1) * 4, cudaHostAllocDefault));  // ids, targets, at most 3T + 1 group entries
    slot.host = static_cast<int32_t*>(p);
  }
  const size_t n = w_.units.size();
  for (auto* v : {&shard_params_, &exp_avg_, &exp_avg_sq_, &grad_shard_, &full_, &full_grad_}) v->resize(n);
  gathered_.assign(n, nullptr);
  for (size_t u = 0; u < n; ++u) {
    FSDP_CUDA_TRY(cudaEventCreateWithFlags(&gathered_[u], cudaEventDisableTiming));
    FSDP_TRY(InitUnit(static_cast<int>(u)));
  }
  FSDP_CUDA_TRY(cudaEventRecord(params_ready_, compute_));
  FSDP_CUDA_TRY(cudaStreamSynchronize(compute_));
  return {};
}

// Units up to this size start from the CPU engine's values (StartingUnit), so that a small model
// trains the same on both; larger ones are initialised on the device (a host mt19937 would take
// about 15 s for TinyLlama 1.1B's 44M-parameter blocks).
constexpr int64_t kHostInitMaxNumel = 8 << 20;

// This rank's slice of the unit's flat parameter: the checkpoint's values (--init-from), else norms
// 1, other tensors N(0, 0.02); padding 0; AdamW states 0.
Status CudaEngine::InitUnit(int u) {
  const WrapUnit& unit = w_.units[u];
  const int64_t s = unit.shard_numel, first = shard_->rank() * s;
  FSDP_ALLOC(p, alloc_.Allocate(s * 4, MemCategory::kShardedParams, compute_));
  FSDP_ALLOC(m, alloc_.Allocate(s * 4, MemCategory::kOptimizerStates, compute_));
  FSDP_ALLOC(v, alloc_.Allocate(s * 4, MemCategory::kOptimizerStates, compute_));
  FSDP_CUDA_TRY(cudaMemsetAsync(p.get(), 0, static_cast<size_t>(s * 4), compute_));
  FSDP_CUDA_TRY(cudaMemsetAsync(m.get(), 0, static_cast<size_t>(s * 4), compute_));
  FSDP_CUDA_TRY(cudaMemsetAsync(v.get(), 0, static_cast<size_t>(s * 4), compute_));
  if (o_.checkpoint || unit.padded_numel <= kHostInitMaxNumel) {
    auto start = StartingUnit(w_, LayoutOf(w_), u, o_);
    if (!start.ok()) return start.error();
    const std::vector<float>& flat = start.value();
    FSDP_CUDA_TRY(cudaMemcpyAsync(p.get(), flat.data() + first, static_cast<size_t>(s * 4), cudaMemcpyHostToDevice, compute_));
    FSDP_CUDA_TRY(cudaStreamSynchronize(compute_));  // after the memset on the same stream; `flat` dies here
  } else {
    int64_t offset = 0;
    for (int t : unit.tensors) {
      const TensorSpec& ts = w_.model.tensors[t];
      const int64_t begin = std::max(offset, first), end = std::min(offset + ts.numel(), first + s);
      if (begin < end) {
        float* out = p.as<float>() + (begin - first);
        if (ts.shape.size() == 1) {
          Fill(out, end - begin, 1.0f, compute_);
        } else {
          FillNormal(out, end - begin, o_.seed * 7919 + static_cast<uint64_t>(t), begin - offset, 0.02f, compute_);
        }
      }
      offset += ts.numel();
    }
    FSDP_TRY(CudaStatus(cudaGetLastError(), "initialisation kernels"));
  }
  shard_params_[u] = std::move(p);
  exp_avg_[u] = std::move(m);
  exp_avg_sq_[u] = std::move(v);
  return {};
}

Status CudaEngine::WaitEvent(cudaEvent_t event) {
  bool busy = false;
  Status s = WaitForEvent(event, {shard_.get(), replica_.get()}, &busy);
  if (busy) ++host_waits_;
  return s;
}

Status CudaEngine::WaitStream(cudaStream_t stream) {
  auto done = events_.Take();
  if (!done.ok()) return done.error();
  Status s = CudaStatus(cudaEventRecord(done.value(), stream), "cudaEventRecord");
  if (s.ok()) s = WaitEvent(done.value());
  events_.Give(done.value());
  return s;
}

// Enqueues unit u's all-gather on the all-gather stream (no CPU wait, except the rate limiter's).
Status CudaEngine::Unshard(int u, bool rate_limit_wait) {
  if (rate_limit_wait) {  // FSDP1 _free_event_queue.dequeue_if_needed
    FSDP_TRY(WaitEvent(reshard_events_.front()));
    events_.Give(reshard_events_.front());
    reshard_events_.pop_front();
  }
  if (!full_[u].empty()) return {};
  const WrapUnit& unit = w_.units[u];
  FSDP_CUDA_TRY(cudaStreamWaitEvent(gather_, params_ready_, 0));
  FSDP_ALLOC(low, alloc_.Allocate(unit.shard_numel * ctx_.elem(), MemCategory::kCommBuffers, gather_));
  CastFromF32(shard_params_[u].as<float>(), low.get(), dtype_, unit.shard_numel, gather_);
  FSDP_ALLOC(full, alloc_.Allocate(unit.padded_numel * ctx_.elem(), MemCategory::kUnshardedParams, gather_));
  FSDP_TRY(shard_->AllGather(low.get(), full.get(), unit.shard_numel, dtype_, gather_));
  full_[u] = std::move(full);
  FSDP_CUDA_TRY(cudaEventRecord(gathered_[u], gather_));
  return {};
}

Status CudaEngine::Reshard(int u, bool queues_free_event) {
  full_[u].Release({compute_});
  if (!queues_free_event) return {};
  auto e = events_.Take();
  if (!e.ok()) return e.error();
  FSDP_CUDA_TRY(cudaEventRecord(e.value(), compute_));
  reshard_events_.push_back(e.value());
  return {};
}

// On the reduce-scatter stream, after the unit's backward: cast to reduce_dtype, reduce-scatter,
// all-reduce across replicas, accumulate into the fp32 gradient shard scaled to the mean.
Status CudaEngine::Reduce(int u) {
  const WrapUnit& unit = w_.units[u];
  auto ready = events_.Take();
  if (!ready.ok()) return ready.error();
  FSDP_CUDA_TRY(cudaEventRecord(ready.value(), compute_));
  FSDP_CUDA_TRY(cudaStreamWaitEvent(reduce_, ready.value(), 0));
  events_.Give(ready.value());  // the wait is enqueued: it may be re-recorded
  DeviceBuffer cast;
  const void* input = full_grad_[u].get();
  if (reduce_dtype_ != dtype_) {
    FSDP_ALLOC(c, alloc_.Allocate(unit.padded_numel * BytesPerElement(reduce_dtype_), MemCategory::kCommBuffers, reduce_));
    Cast(full_grad_[u].get(), dtype_, c.get(), reduce_dtype_, unit.padded_numel, reduce_);
    cast = std::move(c);
    input = cast.get();
  }
  FSDP_ALLOC(out, alloc_.Allocate(unit.shard_numel * BytesPerElement(reduce_dtype_), MemCategory::kCommBuffers, reduce_));
  FSDP_TRY(shard_->ReduceScatter(input, out.get(), unit.shard_numel, reduce_dtype_, reduce_));
  if (replica_->size() > 1) FSDP_TRY(replica_->AllReduce(out.get(), unit.shard_numel, reduce_dtype_, reduce_));
  if (grad_shard_[u].empty()) {
    FSDP_ALLOC(g, alloc_.Allocate(unit.shard_numel * 4, MemCategory::kGradients, reduce_));
    FSDP_CUDA_TRY(cudaMemsetAsync(g.get(), 0, static_cast<size_t>(unit.shard_numel * 4), reduce_));
    grad_shard_[u] = std::move(g);
  }
  // the mean over the world's micro-batches, unscaled (S a power of two: exact)
  const float scale = 1.0f / (static_cast<float>(world() * w_.config.grad_accum) * scaler_.scale());
  AccumulateF32(out.get(), reduce_dtype_, scale, grad_shard_[u].as<float>(), unit.shard_numel, reduce_);
  out.Release();
  cast.Release();
  full_grad_[u].Release({reduce_});
  FSDP_CUDA_TRY(cudaEventRecord(reduced_, reduce_));
  return CudaStatus(cudaGetLastError(), "reduce kernels");
}

int CudaEngine::ParamTensor(int node) const {
  return w_.WeightTensor(node);
}

void* CudaEngine::Params(int node) const {
  const int t = ParamTensor(node);
  return Offset(full_[w_.tensor_unit[t]].get(), w_.tensor_offset[t], dtype_);
}

Result<void*> CudaEngine::Grads(int node) {
  const int t = ParamTensor(node);
  const int u = w_.tensor_unit[t];
  if (full_grad_[u].empty()) {  // under no_sync it holds the earlier micro-batches' gradients
    FSDP_ALLOC(g, alloc_.Allocate(w_.units[u].padded_numel * ctx_.elem(), MemCategory::kGradients, compute_));
    FSDP_CUDA_TRY(cudaMemsetAsync(g.get(), 0, static_cast<size_t>(g.bytes()), compute_));
    full_grad_[u] = std::move(g);
  }
  return Offset(full_grad_[u].get(), w_.tensor_offset[t], dtype_);
}

Status CudaEngine::ForwardNode(int node) {
  const LlamaDims& d = ctx_.dims;
  const int64_t T = ctx_.tokens(), h = d.hidden;
  switch (w_.nodes[node].role) {
    case ModuleNode::Role::kEmbedding: {
      FSDP_ALLOC(x0, ctx_.Buffer(T * h, MemCategory::kActivations));
      EmbeddingForward(Params(node), ids_.as<int32_t>(), x0.get(), T, h, dtype_, compute_);
      x_ = std::move(x0);
      return {};
    }
    case ModuleNode::Role::kBlock: {
      const int b = w_.nodes[node].block;
      const bool ac = w_.config.checkpointing == Checkpointing::kFull;
      auto y = DeviceBlockForward(ctx_, Params(node), x_, ac ? nullptr : &caches_[b]);
      if (!y.ok()) return y.error();
      if (w_.config.checkpointing == Checkpointing::kSelective) caches_[b].probs.Release();  // recomputed in backward
      inputs_[b] = std::move(x_);
      x_ = std::move(y).value();
      return {};
    }
    case ModuleNode::Role::kFinalNorm: {
      FSDP_ALLOC(inv, alloc_.Allocate(T * 4, MemCategory::kActivations, compute_));
      FSDP_ALLOC(normed, ctx_.Buffer(T * h, MemCategory::kActivations));
      RmsNormForward(x_.get(), Params(node), normed.get(), inv.as<float>(), T, h, d.rms_eps, dtype_, compute_);
      inv_final_ = std::move(inv);
      normed_ = std::move(normed);
      final_x_ = std::move(x_);
      return {};
    }
    case ModuleNode::Role::kLmHead: {
      // the logits are overwritten by their gradient, which carries the loss scale
      // (GradScaler.scale(loss).backward())
      FSDP_ALLOC(logits, ctx_.Buffer(T * d.vocab, MemCategory::kActivations));
      FSDP_TRY(LinearForward(blas_, dtype_, normed_.get(), Params(node), logits.get(), T, h, d.vocab));
      CrossEntropyInPlace(logits.get(), targets_.as<int32_t>(), loss_sum_.as<float>(), T, d.vocab, scaler_.scale() / static_cast<float>(T),
                          dtype_, compute_);
      logits_ = std::move(logits);
      return CudaStatus(cudaGetLastError(), "forward kernels");
    }
    case ModuleNode::Role::kOther: return {};
  }
  return {};
}

Status CudaEngine::BackwardNode(int node) {
  const LlamaDims& d = ctx_.dims;
  const int64_t T = ctx_.tokens(), h = d.hidden;
  switch (w_.nodes[node].role) {
    case ModuleNode::Role::kLmHead: {
      FSDP_ASSIGN_OR_RETURN(void* g_head, Grads(node));
      FSDP_ALLOC(d_normed, ctx_.Buffer(T * h, MemCategory::kTemporaries));
      FSDP_TRY(LinearBackward(blas_, dtype_, logits_.get(), normed_.get(), Params(node), d_normed.get(), g_head, T, h, d.vocab));
      logits_.Release();
      normed_.Release();
      d_normed_ = std::move(d_normed);
      return {};
    }
    case ModuleNode::Role::kFinalNorm: {
      FSDP_ASSIGN_OR_RETURN(void* g_norm, Grads(node));
      FSDP_ALLOC(dx, ctx_.Buffer(T * h, MemCategory::kActivations));
      RmsNormBackward(d_normed_.get(), final_x_.get(), Params(node), inv_final_.as<float>(), nullptr, dx.get(), dw_scratch_.as<float>(), T, h,
                      dtype_, compute_);
      AddF32(dw_scratch_.as<float>(), g_norm, dtype_, h, compute_);
      d_normed_.Release();
      inv_final_.Release();
      final_x_.Release();
      x_ = std::move(dx);
      return {};
    }
    case ModuleNode::Role::kBlock: {
      const int b = w_.nodes[node].block;
      FSDP_ASSIGN_OR_RETURN(void* grads, Grads(node));
      if (w_.config.checkpointing == Checkpointing::kFull) {
        auto y = DeviceBlockForward(ctx_, Params(node), inputs_[b], &caches_[b]);
        if (!y.ok()) return y.error();
      }
      if (w_.config.checkpointing == Checkpointing::kSelective) {  // the attention core, from the saved q and k
        FSDP_ALLOC(probs, ctx_.Buffer(ctx_.batch * d.heads * ctx_.seq * ctx_.seq, MemCategory::kActivations));
        FSDP_TRY(DeviceAttentionProbs(ctx_, caches_[b].q.get(), caches_[b].k.get(), probs.get()));
        caches_[b].probs = std::move(probs);
      }
      auto next = DeviceBlockBackward(ctx_, Params(node), grads, dw_scratch_.as<float>(), inputs_[b], std::move(x_), caches_[b]);
      if (!next.ok()) return next.error();
      x_ = std::move(next).value();
      inputs_[b].Release();  // block 0's input is the embedding output
      return {};
    }
    case ModuleNode::Role::kEmbedding: {
      FSDP_ASSIGN_OR_RETURN(void* g_embed, Grads(node));
      EmbeddingBackward(x_.get(), token_groups_.as<int32_t>(), distinct_tokens_, g_embed, h, dtype_, compute_);
      x_.Release();
      return CudaStatus(cudaGetLastError(), "backward kernels");
    }
    case ModuleNode::Role::kOther: return {};
  }
  return {};
}

Status CudaEngine::PlaySchedule(int64_t micro) {
  phases_.StartMicroBatch(static_cast<int>(micro));
  for (const Action& a : schedule_.MicroBatch(micro)) {
    if (phases_.Enter(a)) alloc_.set_phase(phases_.phase());
    switch (a.kind) {
      case ActionKind::kUnshard: FSDP_TRY(Unshard(a.unit, a.rate_limit_wait)); break;
      case ActionKind::kWaitUnshard: FSDP_CUDA_TRY(cudaStreamWaitEvent(compute_, gathered_[a.unit], 0)); break;
      case ActionKind::kForward:
      case ActionKind::kBackward:
        for (const NodeVisit& v : schedule_.Visits(schedule_.segments()[a.segment])) {
          if (phases_.Enter(v, a.kind == ActionKind::kForward)) alloc_.set_phase(phases_.phase());
          if (a.kind == ActionKind::kForward) FSDP_TRY(ForwardNode(v.node));
          else if (v.enter) FSDP_TRY(BackwardNode(v.node));
        }
        break;
      case ActionKind::kReshard: FSDP_TRY(Reshard(a.unit, a.queues_free_event)); break;
      case ActionKind::kReduce: FSDP_TRY(Reduce(a.unit)); break;
      case ActionKind::kEndForward:
        if (micro == 0) FSDP_CUDA_TRY(cudaEventRecord(phase_events_[1], compute_));
        break;
      case ActionKind::kPreForward:
      case ActionKind::kPostForward:
      case ActionKind::kPreBackward:
      case ActionKind::kPostBackward:
      case ActionKind::kEndBackward:
      case ActionKind::kOptimizer: break;  // StepOnce runs the optimizer after the last micro-batch
    }
  }
  return {};
}

Result<float> CudaEngine::MicroBatch(int64_t step, int64_t micro) {
  const int64_t seq = w_.config.seq_len, mb = w_.config.micro_batch, T = ctx_.tokens();
  const std::vector<int32_t> all = TrainingTokens(w_, o_, step, micro, host_.rank(), static_cast<int>(world()));
  std::vector<int32_t> ids, targets;
  for (int64_t i = 0; i < mb; ++i) {
    ids.insert(ids.end(), all.begin() + i * (seq + 1), all.begin() + i * (seq + 1) + seq);
    targets.insert(targets.end(), all.begin() + i * (seq + 1) + 1, all.begin() + (i + 1) * (seq + 1));
  }
  if (ids_.empty()) {
    FSDP_ALLOC(a, alloc_.Allocate(T * 4, MemCategory::kTemporaries, compute_));
    FSDP_ALLOC(b, alloc_.Allocate(T * 4, MemCategory::kTemporaries, compute_));
    FSDP_ALLOC(c, alloc_.Allocate((3 * T + 1) * 4, MemCategory::kTemporaries, compute_));  // at most T distinct tokens
    ids_ = std::move(a);
    targets_ = std::move(b);
    token_groups_ = std::move(c);
  }
  const TokenGroups groups = GroupTokens(ids);
  const std::vector<int32_t> packed = groups.Packed();
  distinct_tokens_ = static_cast<int64_t>(groups.ids.size());
  FSDP_TRY(UploadTokens(micro, ids, targets, packed));
  inputs_.resize(static_cast<size_t>(ctx_.dims.layers));
  caches_.resize(static_cast<size_t>(ctx_.dims.layers));
  FSDP_TRY(PlaySchedule(micro));
  return 0.0f;  // no wait: the host goes on to the next micro-batch while the device works
}

// The copies read pinned memory, asynchronously: a slot is rewritten only once the copies that
// read it last have completed, which the previous step's end has already waited for.
Status CudaEngine::UploadTokens(int64_t micro, const std::vector<int32_t>& ids, const std::vector<int32_t>& targets,
                                const std::vector<int32_t>& packed) {
  const size_t T = ids.size();
  TokenStaging& slot = staging_[static_cast<size_t>(micro)];
  FSDP_TRY(WaitEvent(slot.copied));  // not recorded yet in the first step: no wait
  int32_t* const staged_ids = slot.host;
  int32_t* const staged_targets = std::copy(ids.begin(), ids.end(), staged_ids);
  int32_t* const staged_groups = std::copy(targets.begin(), targets.end(), staged_targets);
  std::copy(packed.begin(), packed.end(), staged_groups);
  FSDP_CUDA_TRY(cudaMemcpyAsync(ids_.get(), staged_ids, T * 4, cudaMemcpyHostToDevice, compute_));
  FSDP_CUDA_TRY(cudaMemcpyAsync(targets_.get(), staged_targets, T * 4, cudaMemcpyHostToDevice, compute_));
  FSDP_CUDA_TRY(cudaMemcpyAsync(token_groups_.get(), staged_groups, packed.size() * 4, cudaMemcpyHostToDevice, compute_));
  FSDP_CUDA_TRY(cudaEventRecord(slot.copied, compute_));
  return {};
}

Result<bool> CudaEngine::FoundNonFinite() {
  FSDP_CUDA_TRY(cudaMemsetAsync(found_inf_.get(), 0, 4, compute_));
  for (size_t u = 0; u < grad_shard_.size(); ++u) {
    if (!grad_shard_[u].empty()) FlagNonFinite(grad_shard_[u].as<float>(), w_.units[u].shard_numel, found_inf_.as<float>(), compute_);
  }
  float found = 0.0f;
  FSDP_TRY(WaitStream(compute_));  // GradScaler.step's found_inf.item(); the copy below then waits for nothing
  FSDP_CUDA_TRY(cudaMemcpyAsync(&found, found_inf_.get(), 4, cudaMemcpyDeviceToHost, compute_));
  if (virtual_world_ == 0) FSDP_TRY(host_.AllReduce(&found, 1));
  return found > 0.0f;
}

Status CudaEngine::Optimizer() {
  FSDP_CUDA_TRY(cudaStreamWaitEvent(compute_, reduced_, 0));
  FSDP_CUDA_TRY(cudaEventRecord(phase_events_[2], compute_));
  auto allowed = scaler_.CheckAndUpdate([this] { return FoundNonFinite(); });
  if (!allowed.ok()) return allowed.error();
  const bool apply = allowed.value();
  const auto [c1, c2] = AdamBiasCorrections(o_, optimizer_steps_);
  for (size_t u = 0; u < shard_params_.size(); ++u) {
    if (apply) {
      AdamW(shard_params_[u].as<float>(), grad_shard_[u].empty() ? nullptr : grad_shard_[u].as<float>(), exp_avg_[u].as<float>(),
            exp_avg_sq_[u].as<float>(), w_.units[u].shard_numel, o_.lr, o_.beta1, o_.beta2, o_.eps, o_.weight_decay, c1, c2, compute_);
    }
    grad_shard_[u].Release({compute_});  // zero_grad(set_to_none=True)
  }
  if (apply) ++optimizer_steps_;
  FSDP_CUDA_TRY(cudaEventRecord(params_ready_, compute_));
  FSDP_CUDA_TRY(cudaEventRecord(phase_events_[3], compute_));
  return CudaStatus(cudaGetLastError(), "optimizer kernels");
}

Result<float> CudaEngine::StepOnce(int64_t step) {
  const int64_t waits_before = host_waits_;
  FSDP_CUDA_TRY(cudaMemsetAsync(loss_sum_.get(), 0, 4, compute_));
  FSDP_CUDA_TRY(cudaEventRecord(phase_events_[0], compute_));
  for (int64_t m = 0; m < w_.config.grad_accum; ++m) {
    auto r = MicroBatch(step, m);
    if (!r.ok()) return r.error();
  }
  FSDP_TRY(Optimizer());
  float loss_sum = 0;
  for (cudaStream_t s : {compute_, gather_, reduce_}) FSDP_TRY(WaitStream(s));  // the step's work, collectives included
  FSDP_CUDA_TRY(cudaMemcpyAsync(&loss_sum, loss_sum_.get(), 4, cudaMemcpyDeviceToHost, compute_));
  float ms[3] = {0, 0, 0};
  for (int i = 0; i < 3; ++i) FSDP_CUDA_TRY(cudaEventElapsedTime(&ms[i], phase_events_[i], phase_events_[i + 1]));
  times_.forward_s.push_back(ms[0] / 1e3);   // first micro-batch's forward
  times_.backward_s.push_back(ms[1] / 1e3);  // the rest, through the last reduction
  times_.optimizer_s.push_back(ms[2] / 1e3);
  times_.host_waits.push_back(host_waits_ - waits_before);
  for (DeviceComm* c : {shard_.get(), replica_.get()}) FSDP_TRY(c->CollectTimes());
  device_view_.device_used_bytes = std::max(device_view_.device_used_bytes, DeviceUsedBytes());
  float mean = loss_sum / static_cast<float>(ctx_.tokens() * w_.config.grad_accum);
  if (virtual_world_ == 0) FSDP_TRY(host_.AllReduce(&mean, 1));
  return mean / static_cast<float>(virtual_world_ == 0 ? host_.size() : 1);
}

GpuMemoryReport CudaEngine::memory() const {
  GpuMemoryReport r = device_view_;
  r.peak_allocated_bytes = alloc_.peak_allocated();
  r.peak_reserved_bytes = alloc_.peak_reserved();
  r.device_mallocs = alloc_.device_mallocs();
  r.at_peak = alloc_.at_peak();
  r.peak_phase = PhaseName(w_, alloc_.peak_phase());
  return r;
}

}  // namespace
}  // namespace cuda

Result<std::unique_ptr<GpuEngine>> CreateGpuEngine(const Workload& w, Comm& host, const TrainOptions& o, int virtual_world) {
  auto dims = DimsOf(w.model, w.config.seq_len);
  if (!dims.ok()) return dims.error();
  if (dims.value().experts > 0) return Error::BadInput(fmt::format("--device cuda does not implement routed experts yet ({}); the CPU engine does", w.model.id));
  if (dims.value().qk_norm) return Error::BadInput(fmt::format("--device cuda does not implement Qwen3's q/k norms yet ({}); the CPU engine does", w.model.id));
  if (dims.value().qkv_bias && dims.value().heads * dims.value().head_dim > dims.value().hidden) {  // the bias gradient uses the norm's scratch
    return Error::BadInput(fmt::format("--device cuda implements q/k/v biases only with heads x head_dim <= hidden ({})", w.model.id));
  }
  if (w.config.wrap != WrapPolicy::kBlock && w.config.wrap != WrapPolicy::kNone) {
    return Error::BadInput("fsdp-run wraps per block (--wrap block) or the whole model (--wrap none)");
  }
  if (virtual_world > 0) {
    if (host.size() != 1) return Error::BadInput("--virtual-world runs one process (rank 0 of the virtual world); start 1 rank");
    if (virtual_world != w.config.gpus) {
      return Error::BadInput(fmt::format("--virtual-world {} but --gpus {} (the virtual world stands for the --gpus ranks)", virtual_world, w.config.gpus));
    }
  } else if (host.size() != w.config.gpus) {
    return Error::BadInput(fmt::format("--gpus {} but {} ranks are running (start one rank per GPU, or use --virtual-world)", w.config.gpus, host.size()));
  }
  if (Status s = CheckLossScalerOptions(o.loss_scaling); !s.ok()) return s.error();
  if (Status s = CheckEveryParameterTrains(w); !s.ok()) return s.error();
  if (Status s = host.CheckSame(ConfigFingerprint(w, o), "configurations"); !s.ok()) return s.error();
  auto engine = std::make_unique<cuda::CudaEngine>(w, host, o);
  if (Status s = engine->Init(virtual_world); !s.ok()) return s.error();
  return std::unique_ptr<GpuEngine>(std::move(engine));
}

}  // namespace fsdp::runtime
