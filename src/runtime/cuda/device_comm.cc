#include "runtime/cuda/device_comm.h"

#include <thread>

#include <fmt/format.h>
#include <nccl.h>

#include "runtime/cuda/cuda_check.h"
#include "runtime/cuda/cuda_kernels.h"

namespace fsdp::runtime::cuda {

DeviceComm::~DeviceComm() {
  for (const Timed& t : timed_) {
    cudaEventDestroy(t.start);
    cudaEventDestroy(t.end);
  }
  if (last_end_ != nullptr) cudaEventDestroy(last_end_);
}

template <typename Call>
Status DeviceComm::Time(Kind kind, int64_t bytes, cudaStream_t stream, Call&& call) {
  if (last_end_ == nullptr) FSDP_CUDA_TRY(cudaEventCreateWithFlags(&last_end_, cudaEventDisableTiming));
  auto start = events_.Take();
  if (!start.ok()) return start.error();
  auto end = events_.Take();
  if (!end.ok()) {
    events_.Give(start.value());
    return end.error();
  }
  timed_.push_back({kind, start.value(), end.value()});  // destroyed with the communicator even if a call below fails
  FSDP_CUDA_TRY(cudaStreamWaitEvent(stream, last_end_, 0));
  FSDP_CUDA_TRY(cudaEventRecord(start.value(), stream));
  FSDP_TRY(call());
  FSDP_CUDA_TRY(cudaEventRecord(end.value(), stream));
  FSDP_CUDA_TRY(cudaEventRecord(last_end_, stream));
  switch (kind) {
    case Kind::kAllGather: stats_.all_gather_bytes += bytes, ++stats_.all_gather_count; break;
    case Kind::kReduceScatter: stats_.reduce_scatter_bytes += bytes, ++stats_.reduce_scatter_count; break;
    case Kind::kAllReduce: stats_.all_reduce_bytes += bytes, ++stats_.all_reduce_count; break;
  }
  return {};
}

// nccl-tests sizes: the all-gather's output, the reduce-scatter's input, the all-reduce's buffer.
Status DeviceComm::AllGather(const void* in, void* out, int64_t count, DType dtype, cudaStream_t stream) {
  return Time(Kind::kAllGather, count * size() * BytesPerElement(dtype), stream, [&] { return DoAllGather(in, out, count, dtype, stream); });
}

Status DeviceComm::ReduceScatter(const void* in, void* out, int64_t count, DType dtype, cudaStream_t stream) {
  return Time(Kind::kReduceScatter, count * size() * BytesPerElement(dtype), stream,
              [&] { return DoReduceScatter(in, out, count, dtype, stream); });
}

Status DeviceComm::AllReduce(void* data, int64_t count, DType dtype, cudaStream_t stream) {
  return Time(Kind::kAllReduce, count * BytesPerElement(dtype), stream, [&] { return DoAllReduce(data, count, dtype, stream); });
}

Status WaitForEvent(cudaEvent_t event, std::initializer_list<DeviceComm*> comms, bool* found_busy) {
  if (found_busy != nullptr) *found_busy = false;
  FSDP_TRY(CudaStatus(cudaGetLastError(), "a kernel launch before a wait"));
  for (int polls = 1;; ++polls) {
    const cudaError_t code = cudaEventQuery(event);
    if (code == cudaSuccess) return {};
    if (code != cudaErrorNotReady) return CudaStatus(code, "cudaEventQuery");
    (void)cudaGetLastError();  // not ready is not an error
    if (polls == 1 && found_busy != nullptr) *found_busy = true;
    if (polls % 256 == 0) {
      for (DeviceComm* c : comms) {
        if (c != nullptr) FSDP_TRY(c->AsyncError());
      }
    }
    std::this_thread::yield();  // a sleep would delay the all-gathers the engine's rate limiter releases
  }
}

Status DeviceComm::CollectTimes() {
  size_t done = 0;  // entries whose events went back to the pool leave timed_ even if a later one fails
  auto forget_done = [&] { timed_.erase(timed_.begin(), timed_.begin() + static_cast<std::ptrdiff_t>(done)); };
  for (const Timed& t : timed_) {
    float ms = 0;
    if (const cudaError_t code = cudaEventElapsedTime(&ms, t.start, t.end); code != cudaSuccess) {
      forget_done();
      return CudaStatus(code, "cudaEventElapsedTime");
    }
    const double s = ms / 1e3;
    switch (t.kind) {
      case Kind::kAllGather: stats_.all_gather_s += s; break;
      case Kind::kReduceScatter: stats_.reduce_scatter_s += s; break;
      case Kind::kAllReduce: stats_.all_reduce_s += s; break;
    }
    events_.Give(t.start);
    events_.Give(t.end);
    ++done;
  }
  timed_.clear();
  return {};
}

Status DeviceComm::ClearStats() {
  FSDP_TRY(CollectTimes());
  stats_ = {};
  return {};
}

namespace {

ncclDataType_t NcclType(DType dtype) {
  switch (dtype) {
    case DType::kBf16: return ncclBfloat16;
    case DType::kFp16: return ncclFloat16;
    case DType::kFp32: break;
  }
  return ncclFloat32;
}

Status NcclStatus(ncclResult_t code, const char* what) {
  if (code == ncclSuccess) return {};
  return Error::RunFailed(fmt::format("{}: {} ({})", what, ncclGetErrorString(code), ncclGetLastError(nullptr)));
}

class NcclComm : public DeviceComm {
 public:
  explicit NcclComm(ncclComm_t comm) : comm_(comm) {
    ncclCommUserRank(comm_, &rank_);
    ncclCommCount(comm_, &size_);
  }
  ~NcclComm() override {
    if (comm_ != nullptr) ncclCommDestroy(comm_);
  }
  void Abort() override {
    if (comm_ != nullptr) ncclCommAbort(comm_);
    comm_ = nullptr;
  }
  Status AsyncError() override {
    if (comm_ == nullptr) return Error::RunFailed("NCCL communicator already aborted");
    ncclResult_t async = ncclSuccess;
    if (Status s = NcclStatus(ncclCommGetAsyncError(comm_, &async), "ncclCommGetAsyncError"); !s.ok()) return s;
    if (async == ncclSuccess || async == ncclInProgress) return {};
    return Error::RunFailed(fmt::format("NCCL reported {} ({}) while collectives were pending: a peer rank died or the network failed",
                                        ncclGetErrorString(async), ncclGetLastError(comm_)));
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Result<std::unique_ptr<DeviceComm>> Split(int color, int key) override {
    ncclComm_t sub = nullptr;
    if (Status s = NcclStatus(ncclCommSplit(comm_, color, key, &sub, nullptr), "ncclCommSplit"); !s.ok()) return s.error();
    return std::unique_ptr<DeviceComm>(new NcclComm(sub));
  }

 protected:
  Status DoAllGather(const void* in, void* out, int64_t count, DType dtype, cudaStream_t stream) override {
    return NcclStatus(ncclAllGather(in, out, static_cast<size_t>(count), NcclType(dtype), comm_, stream), "ncclAllGather");
  }
  Status DoReduceScatter(const void* in, void* out, int64_t count, DType dtype, cudaStream_t stream) override {
    return NcclStatus(ncclReduceScatter(in, out, static_cast<size_t>(count), NcclType(dtype), ncclSum, comm_, stream), "ncclReduceScatter");
  }
  Status DoAllReduce(void* data, int64_t count, DType dtype, cudaStream_t stream) override {
    return NcclStatus(ncclAllReduce(data, data, static_cast<size_t>(count), NcclType(dtype), ncclSum, comm_, stream), "ncclAllReduce");
  }

 private:
  ncclComm_t comm_;
  int rank_ = 0, size_ = 1;
};

// Rank 0 of size_ ranks: the all-gather writes the rank's shard into every slot (size * count
// elements written, as the real one), the reduce-scatter writes size * the rank's slice (what
// size ranks holding this rank's gradient would sum to, so the gradient keeps its scale), the
// all-reduce multiplies its buffer by size in place (a read and a write of count elements).
class VirtualComm : public DeviceComm {
 public:
  explicit VirtualComm(int size) : size_(size) {}
  int rank() const override { return 0; }
  int size() const override { return size_; }
  Result<std::unique_ptr<DeviceComm>> Split(int, int) override {
    return Error::RunFailed("a virtual world is split by group size (MakeVirtualComm), not by color");
  }

 protected:
  Status DoAllGather(const void* in, void* out, int64_t count, DType dtype, cudaStream_t stream) override {
    const size_t bytes = static_cast<size_t>(count * BytesPerElement(dtype));
    for (int r = 0; r < size_; ++r) {
      FSDP_CUDA_TRY(cudaMemcpyAsync(static_cast<char*>(out) + r * bytes, in, bytes, cudaMemcpyDeviceToDevice, stream));
    }
    return {};
  }
  Status DoReduceScatter(const void* in, void* out, int64_t count, DType dtype, cudaStream_t stream) override {
    FSDP_CUDA_TRY(cudaMemcpyAsync(out, in, static_cast<size_t>(count * BytesPerElement(dtype)), cudaMemcpyDeviceToDevice, stream));
    Scale(out, dtype, static_cast<float>(size_), count, stream);
    return CudaStatus(cudaGetLastError(), "virtual reduce-scatter");
  }
  Status DoAllReduce(void* data, int64_t count, DType dtype, cudaStream_t stream) override {
    Scale(data, dtype, static_cast<float>(size_), count, stream);
    return CudaStatus(cudaGetLastError(), "virtual all-reduce");
  }

 private:
  int size_;
};

}  // namespace

Result<std::unique_ptr<DeviceComm>> MakeNcclComm(Comm& host) {
  struct {
    ncclUniqueId id;
    int32_t ok;  // rank 0 sends its failure too, so that no rank waits for an id that never comes
  } boot{};
  Status made;
  if (host.rank() == 0) {
    made = NcclStatus(ncclGetUniqueId(&boot.id), "ncclGetUniqueId");
    boot.ok = made.ok() ? 1 : 0;
  }
  if (Status s = host.Broadcast(&boot, sizeof(boot), 0); !s.ok()) return s.error();
  if (!made.ok()) return made.error();
  if (boot.ok == 0) return Error::RunFailed("rank 0 could not create the NCCL unique id (ncclGetUniqueId failed there)");
  const ncclUniqueId& id = boot.id;
  ncclComm_t comm = nullptr;
  if (Status s = NcclStatus(ncclCommInitRank(&comm, host.size(), id, host.rank()), "ncclCommInitRank"); !s.ok()) return s.error();
  return std::unique_ptr<DeviceComm>(new NcclComm(comm));
}

std::unique_ptr<DeviceComm> MakeVirtualComm(int virtual_size) { return std::make_unique<VirtualComm>(virtual_size); }

}  // namespace fsdp::runtime::cuda
