// MPI backend (OpenMPI). Errors come back as return codes (MPI_ERRORS_RETURN), not aborts.
#include <chrono>
#include <vector>

#include <fmt/format.h>

#include "runtime/comm.h"

#ifdef FSDP_HAVE_MPI
#include <mpi.h>
#endif

namespace fsdp::runtime {

#ifdef FSDP_HAVE_MPI
namespace {

class MpiComm : public Comm {
 public:
  explicit MpiComm(MPI_Comm comm) : comm_(comm) {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  Status AllGather(const float* in, float* out, int64_t n) override {
    const auto start = std::chrono::steady_clock::now();
    Status s = Check(MPI_Allgather(in, static_cast<int>(n), MPI_FLOAT, out, static_cast<int>(n), MPI_FLOAT, comm_), "all-gather");
    stats_.all_gather_s += Since(start);
    stats_.all_gather_bytes += n * size_ * 4;
    ++stats_.all_gather_count;
    return s;
  }
  Result<int> StartAllGather(const float* in, float* out, int64_t n) override {
    requests_.push_back(MPI_REQUEST_NULL);
    const int handle = static_cast<int>(requests_.size() - 1);
    if (Status s = Check(MPI_Iallgather(in, static_cast<int>(n), MPI_FLOAT, out, static_cast<int>(n), MPI_FLOAT, comm_, &requests_[handle]), "all-gather");
        !s.ok()) {
      return s.error();
    }
    stats_.all_gather_bytes += n * size_ * 4;
    ++stats_.all_gather_count;
    return handle;
  }
  Status Wait(int handle) override {
    const auto start = std::chrono::steady_clock::now();
    Status s = Check(MPI_Wait(&requests_[handle], MPI_STATUS_IGNORE), "all-gather wait");
    stats_.all_gather_s += Since(start);
    return s;
  }
  Status ReduceScatter(const float* in, float* out, int64_t n) override {
    const auto start = std::chrono::steady_clock::now();
    Status s = Check(MPI_Reduce_scatter_block(in, out, static_cast<int>(n), MPI_FLOAT, MPI_SUM, comm_), "reduce-scatter");
    stats_.reduce_scatter_s += Since(start);
    stats_.reduce_scatter_bytes += n * size_ * 4;
    ++stats_.reduce_scatter_count;
    return s;
  }
  Status AllReduce(float* data, int64_t n) override {
    const auto start = std::chrono::steady_clock::now();
    Status s = Check(MPI_Allreduce(MPI_IN_PLACE, data, static_cast<int>(n), MPI_FLOAT, MPI_SUM, comm_), "all-reduce");
    stats_.all_reduce_s += Since(start);
    stats_.all_reduce_bytes += n * 4;
    ++stats_.all_reduce_count;
    return s;
  }
  Status Broadcast(void* data, int64_t bytes, int root) override {
    return Check(MPI_Bcast(data, static_cast<int>(bytes), MPI_BYTE, root, comm_), "broadcast");
  }
  Status CheckSame(uint64_t value, const std::string& what) override {
    unsigned long long mine = value, low = 0, high = 0;
    if (Status s = Check(MPI_Allreduce(&mine, &low, 1, MPI_UNSIGNED_LONG_LONG, MPI_MIN, comm_), "check"); !s.ok()) return s;
    if (Status s = Check(MPI_Allreduce(&mine, &high, 1, MPI_UNSIGNED_LONG_LONG, MPI_MAX, comm_), "check"); !s.ok()) return s;
    if (low != high) return Error::BadInput(fmt::format("ranks were started with different {} (rank {} differs from another)", what, rank_));
    return {};
  }
  Result<std::unique_ptr<Comm>> Split(int color, int key) override {
    MPI_Comm sub;
    if (Status s = Check(MPI_Comm_split(comm_, color, key, &sub), "split"); !s.ok()) return s.error();
    return std::unique_ptr<Comm>(new MpiComm(sub));
  }

 private:
  static double Since(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  }
  Status Check(int code, const char* what) const {
    if (code == MPI_SUCCESS) return {};
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(code, text, &len);
    return Error::RunFailed(fmt::format("rank {}: MPI {} failed: {}", rank_, what, std::string(text, len)));
  }
  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
  std::vector<MPI_Request> requests_;
};

}  // namespace

bool MpiAvailable() { return true; }
Result<std::unique_ptr<Comm>> MakeMpiComm() { return std::unique_ptr<Comm>(new MpiComm(MPI_COMM_WORLD)); }
#else
bool MpiAvailable() { return false; }
Result<std::unique_ptr<Comm>> MakeMpiComm() { return Error::RunFailed("this fsdp-run was built without MPI (install libopenmpi-dev and rebuild)"); }
#endif

}  // namespace fsdp::runtime
