// Turns CUDA, cuBLAS and NCCL return codes into fsdpkit Errors (one line naming the call), so a
// failing rank prints the cause and exits instead of aborting.
#pragma once

#include <string>

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
#define FSDP_CUDA_TRY(call)                                                                         \
  do {                                                                                              \
    if (::fsdp::Status fsdp_s = ::fsdp::runtime::cuda::CudaStatus((call), #call); !fsdp_s.ok()) { \
      return fsdp_s.error();                                                                        \
    }                                                                                               \
  } while (0)

#define FSDP_CUBLAS_TRY(call)                                                                         \
  do {                                                                                                \
    if (::fsdp::Status fsdp_s = ::fsdp::runtime::cuda::CublasStatus((call), #call); !fsdp_s.ok()) { \
      return fsdp_s.error();                                                                          \
    }                                                                                                 \
  } while (0)

/// Propagates a failed Status.
#define FSDP_TRY(expr)                                           \
  do {                                                           \
    if (::fsdp::Status fsdp_s = (expr); !fsdp_s.ok()) {          \
      return fsdp_s.error();                                     \
    }                                                            \
  } while (0)
