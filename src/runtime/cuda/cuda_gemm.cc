#include "runtime/cuda/cuda_gemm.h"

#include "runtime/cuda/cuda_check.h"

namespace fsdp::runtime::cuda {
namespace {

cudaDataType_t CudaType(DType dtype) {
  switch (dtype) {
    case DType::kBf16: return CUDA_R_16BF;
    case DType::kFp16: return CUDA_R_16F;
    case DType::kFp32: break;
  }
  return CUDA_R_32F;
}

}  // namespace

// Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands.
Status Gemm(cublasHandle_t handle, DType dtype, bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, MatrixArg a, MatrixArg b,
            void* c, int64_t ldc, float beta, int64_t batch, int64_t stride_c, float alpha) {
  const cudaDataType_t t = CudaType(dtype);
  const cublasOperation_t op_b = transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (batch == 1) {
    FSDP_CUBLAS_TRY(cublasGemmEx(handle, op_b, op_a, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha, b.data, t,
                                 static_cast<int>(b.ld), a.data, t, static_cast<int>(a.ld), &beta, c, t, static_cast<int>(ldc),
                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return {};
  }
  FSDP_CUBLAS_TRY(cublasGemmStridedBatchedEx(handle, op_b, op_a, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha, b.data,
                                             t, static_cast<int>(b.ld), b.stride, a.data, t, static_cast<int>(a.ld), a.stride, &beta, c, t,
                                             static_cast<int>(ldc), stride_c, static_cast<int>(batch), CUBLAS_COMPUTE_32F,
                                             CUBLAS_GEMM_DEFAULT));
  return {};
}

Status LinearForward(cublasHandle_t handle, DType dtype, const void* x, const void* w, void* y, int64_t rows, int64_t in, int64_t out) {
  return Gemm(handle, dtype, false, true, rows, out, in, {x, in}, {w, in}, y, out, 0.0f);
}

Status LinearBackward(cublasHandle_t handle, DType dtype, const void* dy, const void* x, const void* w, void* dx, void* dw, int64_t rows,
                      int64_t in, int64_t out, float beta_dx) {
  FSDP_TRY(Gemm(handle, dtype, false, false, rows, in, out, {dy, out}, {w, in}, dx, in, beta_dx));
  return Gemm(handle, dtype, true, false, out, in, rows, {dy, out}, {x, in}, dw, in, 1.0f);
}

}  // namespace fsdp::runtime::cuda
