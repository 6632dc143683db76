// Turns CUDA, cuBLAS and NCCL return codes into fsdpkit Errors (one line naming the call), so a
// failing rank prints the cause and exits instead of aborting.
#pragma once

#include <string>
#include <vector>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "core/status.h"

namespace fsdp::runtime::cuda {

inline Status CudaStatus(cudaError_t code, const char* what) {
  if (code == cudaSuccess) return {};
  return Error::RunFailed(std::string(what) + ": " + cudaGetErrorString(code));
}

inline Status CublasStatus(cublasStatus_t code, const char* what) {
  if (code == CUBLAS_STATUS_SUCCESS) return {};
  return Error::RunFailed(std::string(what) + ": cuBLAS status " + std::to_string(static_cast<int>(code)));
}

}  // namespace fsdp::runtime::cuda

/// Returns the Status of a failing CUDA runtime call from the enclosing function.
#define FSDP_CUDA_TRY(call) FSDP_TRY(::fsdp::runtime::cuda::CudaStatus((call), #call))
/// The same for a cuBLAS call.
#define FSDP_CUBLAS_TRY(call) FSDP_TRY(::fsdp::runtime::cuda::CublasStatus((call), #call))

namespace fsdp::runtime::cuda {

/// Reusable CUDA events created with `flags`: Take() hands out a spare one or creates one, Give()
/// returns it (a recorded event may be re-recorded once every wait on it has been enqueued);
/// every event is destroyed with the pool.
class EventPool {
 public:
  explicit EventPool(unsigned flags) : flags_(flags) {}
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;
  ~EventPool() {
    for (cudaEvent_t e : spare_) cudaEventDestroy(e);
  }
  Result<cudaEvent_t> Take() {
    if (!spare_.empty()) {
      cudaEvent_t e = spare_.back();
      spare_.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    FSDP_CUDA_TRY(cudaEventCreateWithFlags(&e, flags_));
    return e;
  }
  void Give(cudaEvent_t e) { spare_.push_back(e); }

 private:
  unsigned flags_;
  std::vector<cudaEvent_t> spare_;
};

}  // namespace fsdp::runtime::cuda
