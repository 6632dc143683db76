// Row-major matrix products through cuBLAS (cublasGemmEx / cublasGemmStridedBatchedEx) in the
// compute dtype with fp32 accumulation (CUBLAS_COMPUTE_32F, as PyTorch's default for bf16/fp16;
// no TF32 for fp32, as torch.backends.cuda.matmul.allow_tf32 = False by default).
#pragma once

#include <cstdint>

#include <cublas_v2.h>

#include "core/dtype.h"
#include "core/status.h"

namespace fsdp::runtime::cuda {

/// Operand of a row-major product: `data` holds rows of `ld` elements; `stride` elements between
/// consecutive matrices of a batch.
struct MatrixArg {
  const void* data;
  int64_t ld;
  int64_t stride = 0;
};

/// C (m, n) = alpha * op(A) op(B) + beta * C for `batch` matrices, all row-major; op transposes
/// when the flag is set (A is (k, m) then).
Status Gemm(cublasHandle_t handle, DType dtype, bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, MatrixArg a,
            MatrixArg b, void* c, int64_t ldc, float beta, int64_t batch = 1, int64_t stride_c = 0, float alpha = 1.0f);

/// y (rows, out) = x (rows, in) W^T with W (out, in).
Status LinearForward(cublasHandle_t handle, DType dtype, const void* x, const void* w, void* y, int64_t rows, int64_t in, int64_t out);
/// dx (rows, in) = dy W (beta_dx 1 adds to dx); dW (out, in) += dy^T x.
Status LinearBackward(cublasHandle_t handle, DType dtype, const void* dy, const void* x, const void* w, void* dx, void* dw, int64_t rows,
                      int64_t in, int64_t out, float beta_dx = 0.0f);

/// Pointer `elements` elements of `dtype` past p.
inline void* Offset(const void* p, int64_t elements, DType dtype) {
  return static_cast<char*>(const_cast<void*>(p)) + elements * BytesPerElement(dtype);
}

}  // namespace fsdp::runtime::cuda
