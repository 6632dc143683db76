// cuda-emu's cuBLAS (emu.h): handles, streams, and the two GEMMs fsdp-run calls, with cuBLAS's own
// argument checks (cuBLAS Library User Guide, cublasGemmEx: "CUBLAS_STATUS_INVALID_VALUE if m < 0 or
// n < 0 or k < 0, or lda, ldb, ldc not properly defined") and the operands' extents checked against
// their allocations. Column-major as cuBLAS; fp32 accumulation (CUBLAS_COMPUTE_32F), one rounding to
// C's type; with beta == 0, C is not read (as cuBLAS: NaN there does not propagate).
#include <cstdio>
#include <string>

#include <Eigen/Dense>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "runtime/cuda/emu/emu.h"

struct cublasContext {  // cublasHandle_t points at one
  cudaStream_t stream = nullptr;
};

namespace fsdp::emu {
namespace {

using MatrixF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>;

int64_t ElementBytes(cudaDataType t) { return t == CUDA_R_32F ? 4 : 2; }

float Load(const void* base, int64_t i, cudaDataType t) {
  if (t == CUDA_R_32F) return static_cast<const float*>(base)[i];
  if (t == CUDA_R_16BF) return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
  return __half2float(static_cast<const __half*>(base)[i]);
}

void Store(void* base, int64_t i, cudaDataType t, float v) {
  if (t == CUDA_R_32F) {
    static_cast<float*>(base)[i] = v;
  } else if (t == CUDA_R_16BF) {
    static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(v);
  } else {
    static_cast<__half*>(base)[i] = __float2half_rn(v);
  }
}

// op(X) as a rows x cols matrix of fp32, X column-major with leading dimension ld.
MatrixF Operand(const void* x, cudaDataType t, int64_t ld, bool transposed, int64_t rows, int64_t cols) {
  MatrixF m(rows, cols);
  for (int64_t j = 0; j < cols; ++j) {
    for (int64_t i = 0; i < rows; ++i) m(i, j) = Load(x, transposed ? j + i * ld : i + j * ld, t);
  }
  return m;
}

// Bytes a stored rows x cols column-major matrix with leading dimension ld spans, `batch` of them
// `stride` elements apart.
int64_t Extent(int64_t rows, int64_t cols, int64_t ld, int64_t batch, int64_t stride, cudaDataType t) {
  if (rows == 0 || cols == 0 || batch == 0) return 0;
  return ((cols - 1) * ld + rows + (batch - 1) * stride) * ElementBytes(t);
}

struct Gemm {
  cublasOperation_t transa, transb;
  int64_t m, n, k;
  float alpha, beta;
  const void *a, *b;
  void* c;
  cudaDataType type;
  int64_t lda, ldb, ldc, stride_a, stride_b, stride_c, batch;
};

void RunGemm(const Gemm& g) {
  const bool ta = g.transa != CUBLAS_OP_N, tb = g.transb != CUBLAS_OP_N;
  const int64_t e = ElementBytes(g.type);
  for (int64_t i = 0; i < g.batch; ++i) {
    const char* a = static_cast<const char*>(g.a) + i * g.stride_a * e;
    const char* b = static_cast<const char*>(g.b) + i * g.stride_b * e;
    char* c = static_cast<char*>(g.c) + i * g.stride_c * e;
    MatrixF result = MatrixF::Zero(g.m, g.n);
    if (g.k > 0) result.noalias() = g.alpha * (Operand(a, g.type, g.lda, ta, g.m, g.k) * Operand(b, g.type, g.ldb, tb, g.k, g.n));
    if (g.beta != 0.0f) result += g.beta * Operand(c, g.type, g.ldc, false, g.m, g.n);
    for (int64_t col = 0; col < g.n; ++col) {
      for (int64_t row = 0; row < g.m; ++row) Store(c, row + col * g.ldc, g.type, result(row, col));
    }
  }
}

cublasStatus_t EnqueueGemm(cublasHandle_t handle, const Gemm& g, cublasComputeType_t compute) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (StickyError() != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
  const bool ta = g.transa != CUBLAS_OP_N, tb = g.transb != CUBLAS_OP_N;
  const int64_t a_rows = ta ? g.k : g.m, b_rows = tb ? g.n : g.k;
  if (g.m < 0 || g.n < 0 || g.k < 0 || g.batch < 0 || g.lda < std::max<int64_t>(1, a_rows) || g.ldb < std::max<int64_t>(1, b_rows) ||
      g.ldc < std::max<int64_t>(1, g.m)) {
    std::fprintf(stderr, "cuda-emu: cuBLAS GEMM m %ld n %ld k %ld lda %ld ldb %ld ldc %ld: CUBLAS_STATUS_INVALID_VALUE\n", static_cast<long>(g.m),
                 static_cast<long>(g.n), static_cast<long>(g.k), static_cast<long>(g.lda), static_cast<long>(g.ldb), static_cast<long>(g.ldc));
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const bool supported = (g.type == CUDA_R_32F || g.type == CUDA_R_16BF || g.type == CUDA_R_16F) && compute == CUBLAS_COMPUTE_32F;
  if (!supported) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (g.m == 0 || g.n == 0 || g.batch == 0) return CUBLAS_STATUS_SUCCESS;
  const int64_t a_cols = ta ? g.m : g.k, b_cols = tb ? g.k : g.n;
  const struct {
    const void* p;
    int64_t bytes;
    const char* name;
  } operands[] = {{g.a, Extent(a_rows, a_cols, g.lda, g.batch, g.stride_a, g.type), "A"},
                  {g.b, Extent(b_rows, b_cols, g.ldb, g.batch, g.stride_b, g.type), "B"},
                  {g.c, Extent(g.m, g.n, g.ldc, g.batch, g.stride_c, g.type), "C"}};
  for (const auto& o : operands) {
    if (o.bytes > 0 && !IsDeviceRange(o.p, static_cast<size_t>(o.bytes))) {
      Fail(cudaErrorIllegalAddress, std::string("cuda-emu: cuBLAS GEMM operand ") + o.name + " (" + std::to_string(o.bytes) +
                                        " bytes) is not inside one device allocation");
      return CUBLAS_STATUS_EXECUTION_FAILED;
    }
  }
  const bool queued = fsdp::emu::Enqueue(handle->stream, g.batch > 1 ? "cublasGemmStridedBatchedEx" : "cublasGemmEx", [g] { RunGemm(g); },
                                         {{g.a, false}, {g.b, false}, {g.c, true}});
  return queued ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_EXECUTION_FAILED;
}

}  // namespace
}  // namespace fsdp::emu

extern "C" {

cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
  if (fsdp::emu::StickyError() != cudaSuccess) return CUBLAS_STATUS_NOT_INITIALIZED;
  *handle = new cublasContext;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete handle;  // enqueued products hold copies of their arguments, not the handle
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n, int k, const void* alpha,
                            const void* A, cudaDataType Atype, int lda, const void* B, cudaDataType Btype, int ldb, const void* beta, void* C,
                            cudaDataType Ctype, int ldc, cublasComputeType_t computeType, cublasGemmAlgo_t /*algo*/) {
  if (Atype != Btype || Atype != Ctype) return CUBLAS_STATUS_NOT_SUPPORTED;
  const fsdp::emu::Gemm g{transa, transb, m, n, k, *static_cast<const float*>(alpha), *static_cast<const float*>(beta), A, B, C, Atype, lda, ldb, ldc,
                          0, 0, 0, 1};
  return fsdp::emu::EnqueueGemm(handle, g, computeType);
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n, int k,
                                          const void* alpha, const void* A, cudaDataType Atype, int lda, long long int strideA, const void* B,
                                          cudaDataType Btype, int ldb, long long int strideB, const void* beta, void* C, cudaDataType Ctype, int ldc,
                                          long long int strideC, int batchCount, cublasComputeType_t computeType, cublasGemmAlgo_t /*algo*/) {
  if (Atype != Btype || Atype != Ctype) return CUBLAS_STATUS_NOT_SUPPORTED;
  const fsdp::emu::Gemm g{transa, transb, m, n, k, *static_cast<const float*>(alpha), *static_cast<const float*>(beta), A, B, C, Atype, lda, ldb, ldc,
                          strideA, strideB, strideC, batchCount};
  return fsdp::emu::EnqueueGemm(handle, g, computeType);
}

}  // extern "C"
