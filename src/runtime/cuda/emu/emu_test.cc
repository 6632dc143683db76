// cuda-emu's own checks (emu.h): that it exposes what it says it exposes (a missing stream wait,
// unwritten memory, overruns, a barrier some threads skip, bad launch and GEMM arguments), that the
// stream order, warp shuffles, GEMMs and one-rank collectives it runs compute what CUDA, cuBLAS and
// NCCL would, and that its errors are sticky until cudaDeviceReset, as a GPU's are.
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstring>
#include <string>
#include <vector>

#include <cublas_v2.h>
#include <nccl.h>
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include "runtime/cuda/cuda_launch.h"

namespace {

__global__ void FillKernel(float* out, int64_t n, float value) {
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = value;
}

__global__ void CopyKernel(const float* in, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = in[i];
}

// out[block] = the sum of the block's inputs: shuffles within warps, then shared memory across them.
__global__ void BlockSumKernel(const float* in, float* out) {
  __shared__ float partial[32];
  float v = in[blockIdx.x * blockDim.x + threadIdx.x];
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0;
    for (unsigned w = 0; w < blockDim.x / 32; ++w) s += partial[w];
    out[blockIdx.x] = s;
  }
}

// Undefined on a GPU: half of the block returns before the barrier.
__global__ void SkippedBarrierKernel(float* out) {
  if (threadIdx.x < 16) return;
  __syncthreads();
  out[threadIdx.x] = 1.0f;
}

// Writes one element past the end of out (n elements).
__global__ void OverrunKernel(float* out, int64_t n) {
  if (threadIdx.x == 0) out[n] = 1.0f;
}

struct Device {  // a fresh emulated context per test
  Device() { REQUIRE(cudaDeviceReset() == cudaSuccess); }
  ~Device() { cudaDeviceReset(); }
  float* Alloc(int64_t n) {
    void* p = nullptr;
    REQUIRE(cudaMalloc(&p, static_cast<size_t>(n) * 4) == cudaSuccess);
    return static_cast<float*>(p);
  }
  std::vector<float> Read(const float* d, int64_t n, cudaStream_t s = nullptr) {
    std::vector<float> h(static_cast<size_t>(n));
    REQUIRE(cudaMemcpyAsync(h.data(), d, h.size() * 4, cudaMemcpyDeviceToHost, s) == cudaSuccess);
    return h;
  }
  void Write(float* d, const std::vector<float>& h, cudaStream_t s = nullptr) {
    REQUIRE(cudaMemcpyAsync(d, h.data(), h.size() * 4, cudaMemcpyHostToDevice, s) == cudaSuccess);
  }
};

ncclComm_t OneRankComm() {
  ncclUniqueId id;
  REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  ncclComm_t comm = nullptr;
  REQUIRE(ncclCommInitRank(&comm, 1, id, 0) == ncclSuccess);
  return comm;
}

cudaStream_t NonBlocking() {
  cudaStream_t s = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  return s;
}

TEST_CASE("A consumer on another stream that does not wait for the producer reads unwritten memory and is reported as a race") {
  Device d;
  cudaStream_t producer = NonBlocking(), consumer = NonBlocking();
  float *x = d.Alloc(64), *y = d.Alloc(64);
  FSDP_LAUNCH(FillKernel, 1, 64, producer)(x, 64, 3.0f);
  FSDP_LAUNCH(CopyKernel, 1, 64, consumer)(static_cast<const float*>(x), y, 64);
  REQUIRE(cudaStreamSynchronize(consumer) == cudaSuccess);
  CHECK(std::isnan(d.Read(y, 64, consumer)[5]));  // the fill had not run: the copy read cudaMalloc's poison
  CHECK(cudaDeviceSynchronize() == cudaErrorLaunchFailure);  // the fill, run now, writes what the copy read unordered
}

TEST_CASE("With an event between them the consumer reads what the producer wrote, and two readers need no order") {
  Device d;
  cudaStream_t producer = NonBlocking(), consumer = NonBlocking();
  float *x = d.Alloc(64), *y = d.Alloc(64), *z = d.Alloc(64);
  cudaEvent_t filled = nullptr;
  REQUIRE(cudaEventCreateWithFlags(&filled, cudaEventDisableTiming) == cudaSuccess);
  FSDP_LAUNCH(FillKernel, 1, 64, producer)(x, 64, 5.0f);
  REQUIRE(cudaEventRecord(filled, producer) == cudaSuccess);
  REQUIRE(cudaStreamWaitEvent(consumer, filled, 0) == cudaSuccess);
  FSDP_LAUNCH(CopyKernel, 1, 64, consumer)(static_cast<const float*>(x), y, 64);
  FSDP_LAUNCH(CopyKernel, 1, 64, producer)(static_cast<const float*>(x), z, 64);  // concurrent with the other read: fine
  CHECK(d.Read(y, 64, consumer) == std::vector<float>(64, 5.0f));
  CHECK(d.Read(z, 64, producer) == std::vector<float>(64, 5.0f));
  CHECK(cudaDeviceSynchronize() == cudaSuccess);
}

TEST_CASE("A buffer reused on one stream while another still reads it is a race; after the host has waited it is not") {
  Device d;
  cudaStream_t owner = NonBlocking(), other = NonBlocking();
  float *x = d.Alloc(64), *y = d.Alloc(64);
  FSDP_LAUNCH(FillKernel, 1, 64, owner)(x, 64, 1.0f);
  REQUIRE(cudaStreamSynchronize(owner) == cudaSuccess);
  FSDP_LAUNCH(CopyKernel, 1, 64, other)(static_cast<const float*>(x), y, 64);  // after the fill: the host saw it done
  REQUIRE(cudaStreamSynchronize(other) == cudaSuccess);
  FSDP_LAUNCH(FillKernel, 1, 64, owner)(x, 64, 2.0f);  // after the read, which the host has seen complete
  CHECK(cudaDeviceSynchronize() == cudaSuccess);
  FSDP_LAUNCH(CopyKernel, 1, 64, other)(static_cast<const float*>(x), y, 64);
  FSDP_LAUNCH(FillKernel, 1, 64, owner)(x, 64, 3.0f);  // reuse while `other` may still read
  CHECK(cudaDeviceSynchronize() == cudaErrorLaunchFailure);
}

TEST_CASE("Host-to-device copies take the host data at the call; device-to-host copies return when done") {
  Device d;
  cudaStream_t s = NonBlocking();
  float* x = d.Alloc(4);
  std::vector<float> host = {1, 2, 3, 4};
  d.Write(x, host, s);
  host.assign(4, 9.0f);  // pageable memory is staged at the call: the copy keeps 1..4
  CHECK(d.Read(x, 4, s) == std::vector<float>{1, 2, 3, 4});
}

TEST_CASE("New memory reads as NaN; copies and memsets beyond an allocation or of the wrong kind are refused") {
  Device d;
  float* x = d.Alloc(100);
  CHECK(std::isnan(d.Read(x, 100)[99]));
  std::vector<float> host(101, 0.0f);
  CHECK(cudaMemcpyAsync(x, host.data(), 101 * 4, cudaMemcpyHostToDevice, nullptr) == cudaErrorInvalidValue);
  CHECK(cudaGetLastError() == cudaErrorInvalidValue);
  CHECK(cudaGetLastError() == cudaSuccess);  // not sticky
  CHECK(cudaMemcpyAsync(x, host.data(), 400, cudaMemcpyDeviceToHost, nullptr) == cudaErrorInvalidValue);
  CHECK(cudaMemsetAsync(x + 1, 0, 400, nullptr) == cudaErrorInvalidValue);
  CHECK(cudaMemsetAsync(x + 1, 0, 396, nullptr) == cudaSuccess);
  CHECK(cudaFree(host.data()) == cudaErrorInvalidValue);
}

TEST_CASE("Warp shuffles and __syncthreads: block sums of 1024 and 64 threads are exact") {
  Device d;
  for (unsigned threads : {1024u, 64u}) {
    const unsigned blocks = 3;
    std::vector<float> in(blocks * threads);
    for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(i % 97);
    float *x = d.Alloc(static_cast<int64_t>(in.size())), *out = d.Alloc(blocks);
    d.Write(x, in);
    FSDP_LAUNCH(BlockSumKernel, blocks, threads, nullptr)(x, out);
    const std::vector<float> sums = d.Read(out, blocks);
    for (unsigned b = 0; b < blocks; ++b) {
      double expected = 0;
      for (unsigned t = 0; t < threads; ++t) expected += in[b * threads + t];
      CHECK(sums[b] == static_cast<float>(expected));
    }
  }
}

TEST_CASE("A __syncthreads that some threads skip is a launch failure, sticky until cudaDeviceReset") {
  Device d;
  float* x = d.Alloc(64);
  FSDP_LAUNCH(SkippedBarrierKernel, 1, 64, nullptr)(x);
  CHECK(cudaDeviceSynchronize() == cudaErrorLaunchFailure);
  void* p = nullptr;
  CHECK(cudaMalloc(&p, 16) == cudaErrorLaunchFailure);  // the context is unusable, as on a GPU
  CHECK(cudaDeviceReset() == cudaSuccess);
  CHECK(cudaMalloc(&p, 16) == cudaSuccess);
}

TEST_CASE("Launches with an impossible configuration or a host pointer are refused as CUDA refuses them") {
  Device d;
  float* x = d.Alloc(8);
  FSDP_LAUNCH(FillKernel, 1, 2048, nullptr)(x, 8, 1.0f);  // more than 1024 threads per block
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
  CHECK(cudaDeviceSynchronize() == cudaSuccess);  // a configuration error is not sticky
  std::vector<float> host(8);
  FSDP_LAUNCH(FillKernel, 1, 8, nullptr)(host.data(), 8, 1.0f);
  CHECK(cudaDeviceSynchronize() == cudaErrorIllegalAddress);
}

TEST_CASE("A kernel that writes past its allocation faults at once (a guard page ends every allocation)") {
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {  // the crash happens here, not in the test runner
    std::signal(SIGSEGV, SIG_DFL);  // not doctest's handler: it would report a crashed test
    void* p = nullptr;
    cudaMalloc(&p, 256);  // 64 floats: a multiple of CUDA's 256-byte alignment, so no slack before the guard
    FSDP_LAUNCH(OverrunKernel, 1, 32, nullptr)(static_cast<float*>(p), int64_t{64});
    cudaDeviceSynchronize();
    _exit(0);
  }
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  CHECK(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGSEGV);
}

TEST_CASE("A copy from pinned host memory reads it when it runs, as DMA does") {
  Device d;
  cudaStream_t s = NonBlocking();
  float* staged = nullptr;
  REQUIRE(cudaHostAlloc(reinterpret_cast<void**>(&staged), 4 * sizeof(float), cudaHostAllocDefault) == cudaSuccess);
  for (int i = 0; i < 4; ++i) staged[i] = static_cast<float>(i + 1);
  float* x = d.Alloc(4);
  REQUIRE(cudaMemcpyAsync(x, staged, 4 * sizeof(float), cudaMemcpyHostToDevice, s) == cudaSuccess);
  CHECK(cudaMemcpyAsync(x, staged + 2, 4 * sizeof(float), cudaMemcpyHostToDevice, s) == cudaErrorInvalidValue);  // past its end
  (void)cudaGetLastError();
  // while the copy is pending the pages are read-only: the kernel refuses to write them (EFAULT)
  // where a store from this thread would fault
  int pipe_fds[2];
  REQUIRE(pipe(pipe_fds) == 0);
  const float nine = 9.0f;
  REQUIRE(write(pipe_fds[1], &nine, sizeof(nine)) == static_cast<ssize_t>(sizeof(nine)));
  CHECK(read(pipe_fds[0], staged, sizeof(float)) == -1);
  CHECK(errno == EFAULT);
  REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
  CHECK(read(pipe_fds[0], staged, sizeof(float)) == static_cast<ssize_t>(sizeof(float)));  // writable again once the copy has run
  CHECK(staged[0] == 9.0f);
  close(pipe_fds[0]);
  close(pipe_fds[1]);
  std::vector<float> back(4);
  REQUIRE(cudaMemcpyAsync(back.data(), x, 4 * sizeof(float), cudaMemcpyDeviceToHost, s) == cudaSuccess);
  CHECK(back == std::vector<float>{1, 2, 3, 4});
  CHECK(cudaFreeHost(staged) == cudaSuccess);
  CHECK(cudaFreeHost(staged) == cudaErrorInvalidValue);
  (void)cudaGetLastError();
  cudaStreamDestroy(s);
}

TEST_CASE("The host writing pinned memory a pending copy still reads faults, naming the mistake") {
  int pipe_fds[2];
  REQUIRE(pipe(pipe_fds) == 0);
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    dup2(pipe_fds[1], STDERR_FILENO);
    std::signal(SIGSEGV, SIG_DFL);  // cudaHostAlloc's handler passes the fault on to this one
    float *staged = nullptr, *x = nullptr;
    cudaHostAlloc(reinterpret_cast<void**>(&staged), 4 * sizeof(float), cudaHostAllocDefault);
    cudaMalloc(reinterpret_cast<void**>(&x), 4 * sizeof(float));
    cudaMemcpyAsync(x, staged, 4 * sizeof(float), cudaMemcpyHostToDevice, nullptr);
    staged[0] = 1.0f;  // the next micro-batch's tokens written before the copy of this one's has run
    _exit(0);
  }
  close(pipe_fds[1]);
  std::string err;
  char buf[512];
  for (ssize_t n; (n = read(pipe_fds[0], buf, sizeof(buf))) > 0;) err.append(buf, static_cast<size_t>(n));
  close(pipe_fds[0]);
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  CHECK(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGSEGV);
  CHECK(err.find("the host wrote pinned memory that a cudaMemcpyAsync (host to device) issued earlier has not read yet") != std::string::npos);
}

TEST_CASE("Work for a destroyed stream is refused, not run on freed memory") {
  Device d;
  cudaStream_t s = NonBlocking();
  float* x = d.Alloc(8);
  REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
  FSDP_LAUNCH(FillKernel, 1, 8, s)(x, 8, 1.0f);
  CHECK(cudaGetLastError() == cudaErrorInvalidResourceHandle);
  CHECK(cudaMemsetAsync(x, 0, 32, s) == cudaErrorInvalidResourceHandle);
  CHECK(cudaDeviceSynchronize() == cudaSuccess);
}

TEST_CASE("Events: queries say not ready until waited for; elapsed time needs completed timing events") {
  Device d;
  cudaStream_t s = NonBlocking();
  float* x = d.Alloc(1024);
  cudaEvent_t start = nullptr, end = nullptr, untimed = nullptr;
  REQUIRE(cudaEventCreate(&start) == cudaSuccess);
  REQUIRE(cudaEventCreate(&end) == cudaSuccess);
  REQUIRE(cudaEventCreateWithFlags(&untimed, cudaEventDisableTiming) == cudaSuccess);
  float ms = -1;
  CHECK(cudaEventElapsedTime(&ms, start, end) == cudaErrorInvalidResourceHandle);  // never recorded
  REQUIRE(cudaEventRecord(start, s) == cudaSuccess);
  FSDP_LAUNCH(FillKernel, 4, 256, s)(x, 1024, 2.0f);
  REQUIRE(cudaEventRecord(end, s) == cudaSuccess);
  REQUIRE(cudaEventRecord(untimed, s) == cudaSuccess);
  CHECK(cudaEventQuery(end) == cudaErrorNotReady);
  CHECK(cudaGetLastError() == cudaErrorNotReady);  // the runtime records it, as CUDA does
  CHECK(cudaEventElapsedTime(&ms, start, end) == cudaErrorNotReady);
  REQUIRE(cudaEventSynchronize(untimed) == cudaSuccess);
  CHECK(cudaEventQuery(end) == cudaSuccess);
  CHECK(cudaEventElapsedTime(&ms, start, end) == cudaSuccess);
  CHECK(ms >= 0.0f);
  CHECK(cudaEventElapsedTime(&ms, start, untimed) == cudaErrorInvalidResourceHandle);
}

// C (m x n, column-major, ld m) = op(A) op(B) in double, A and B column-major with leading dimensions lda, ldb.
std::vector<double> Reference(bool ta, bool tb, int m, int n, int k, const std::vector<float>& a, int lda, const std::vector<float>& b, int ldb) {
  std::vector<double> c(static_cast<size_t>(m * n), 0.0);
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      for (int p = 0; p < k; ++p) c[i + j * m] += double{a[ta ? p + i * lda : i + p * lda]} * b[tb ? j + p * ldb : p + j * ldb];
    }
  }
  return c;
}

TEST_CASE("cuBLAS GEMMs equal a float64 reference for every transpose; beta 0 ignores C; bad arguments are refused") {
  Device d;
  cublasHandle_t blas = nullptr;
  REQUIRE(cublasCreate(&blas) == CUBLAS_STATUS_SUCCESS);
  const int m = 5, n = 3, k = 4, ld = 7;  // leading dimensions larger than the rows
  std::vector<float> a(ld * 7), b(ld * 7);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>((i * 37 % 11)) - 5.0f, b[i] = static_cast<float>((i * 17 % 13)) - 6.0f;
  float *da = d.Alloc(ld * 7), *db = d.Alloc(ld * 7), *dc = d.Alloc(m * n);
  d.Write(da, a);
  d.Write(db, b);
  const float one = 1.0f, zero = 0.0f;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      CAPTURE(ta);
      CAPTURE(tb);
      REQUIRE(cublasGemmEx(blas, ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N, m, n, k, &one, da, CUDA_R_32F, ld, db, CUDA_R_32F, ld,
                           &zero, dc, CUDA_R_32F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
      const std::vector<float> c = d.Read(dc, m * n);  // beta 0: the poison in C does not show
      const std::vector<double> ref = Reference(ta, tb, m, n, k, a, ld, b, ld);
      for (int i = 0; i < m * n; ++i) CHECK(c[i] == static_cast<float>(ref[i]));  // small integers: exact
    }
  }
  CHECK(cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &one, da, CUDA_R_32F, m - 1, db, CUDA_R_32F, ld, &zero, dc, CUDA_R_32F, m,
                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_INVALID_VALUE);  // lda < m
  CHECK(cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &one, da, CUDA_R_32F, ld, db, CUDA_R_32F, ld, &zero, dc, CUDA_R_32F, m + 1,
                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_EXECUTION_FAILED);  // C (ldc m + 1) overruns its allocation
  CHECK(cudaDeviceSynchronize() == cudaErrorIllegalAddress);
  cublasDestroy(blas);
}

TEST_CASE("A strided batch of bf16 products accumulates in fp32 and rounds once, as CUBLAS_COMPUTE_32F") {
  Device d;
  cublasHandle_t blas = nullptr;
  REQUIRE(cublasCreate(&blas) == CUBLAS_STATUS_SUCCESS);
  const int m = 2, n = 2, k = 3, batch = 2;
  // 1 + 2^-8 + 2^-8: summed in bf16 (spacing 2^-7 at 1) each addition would round back to 1; in
  // fp32 the sum is 1 + 2^-7, which bf16 holds
  std::vector<__nv_bfloat16> a(m * k * batch, __float2bfloat16_rn(1.0f)), b(k * n * batch, __float2bfloat16_rn(0.0f));
  for (int i = 0; i < batch; ++i) {
    b[i * k * n] = __float2bfloat16_rn(1.0f);
    b[i * k * n + 1] = b[i * k * n + 2] = __float2bfloat16_rn(1.0f / 256);
  }
  void *da = nullptr, *db = nullptr, *dc = nullptr;
  REQUIRE(cudaMalloc(&da, a.size() * 2) == cudaSuccess);
  REQUIRE(cudaMalloc(&db, b.size() * 2) == cudaSuccess);
  REQUIRE(cudaMalloc(&dc, m * n * batch * 2) == cudaSuccess);
  REQUIRE(cudaMemcpyAsync(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice, nullptr) == cudaSuccess);
  REQUIRE(cudaMemcpyAsync(db, b.data(), b.size() * 2, cudaMemcpyHostToDevice, nullptr) == cudaSuccess);
  const float one = 1.0f, zero = 0.0f;
  REQUIRE(cublasGemmStridedBatchedEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &one, da, CUDA_R_16BF, m, m * k, db, CUDA_R_16BF, k, k * n, &zero, dc,
                                     CUDA_R_16BF, m, m * n, batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
  std::vector<__nv_bfloat16> c(m * n * batch);
  REQUIRE(cudaMemcpyAsync(c.data(), dc, c.size() * 2, cudaMemcpyDeviceToHost, nullptr) == cudaSuccess);
  for (int i = 0; i < batch; ++i) {
    CHECK(__bfloat162float(c[i * m * n]) == 1.0078125f);  // 1 + 2^-7
    CHECK(__bfloat162float(c[i * m * n + 2]) == 0.0f);    // column 1 of B is zero
  }
  cublasDestroy(blas);
}

TEST_CASE("One-rank NCCL: the collectives copy, are stream work, and refuse buffers that do not hold their counts") {
  Device d;
  ncclComm_t comm = OneRankComm();
  int size = 0;
  REQUIRE(ncclCommCount(comm, &size) == ncclSuccess);
  CHECK(size == 1);
  cudaStream_t s = NonBlocking();
  float *x = d.Alloc(8), *y = d.Alloc(8);
  d.Write(x, {1, 2, 3, 4, 5, 6, 7, 8}, s);
  REQUIRE(ncclAllReduce(x, y, 8, ncclFloat32, ncclSum, comm, s) == ncclSuccess);
  CHECK(d.Read(y, 8, s) == std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8});
  REQUIRE(ncclReduceScatter(x, y, 4, ncclFloat32, ncclSum, comm, s) == ncclSuccess);
  CHECK(d.Read(y, 4, s) == std::vector<float>{1, 2, 3, 4});
  CHECK(ncclAllGather(x, y, 9, ncclFloat32, comm, s) == ncclInvalidArgument);
  ncclComm_t half = nullptr;
  REQUIRE(ncclCommSplit(comm, 0, 0, &half, nullptr) == ncclSuccess);
  CHECK(half != nullptr);
  ncclComm_t none = nullptr;
  REQUIRE(ncclCommSplit(comm, NCCL_SPLIT_NOCOLOR, 0, &none, nullptr) == ncclSuccess);
  CHECK(none == nullptr);
  ncclUniqueId id;
  REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  ncclComm_t two = nullptr;
  CHECK(ncclCommInitRank(&two, 2, id, 0) == ncclInvalidUsage);  // no MPI job of two ranks here
  ncclCommDestroy(half);
  ncclCommDestroy(comm);
}

TEST_CASE("A collective whose peer failed never completes: queries stay not ready, a blocking wait fails, ncclCommAbort drains the stream") {
  Device d;
  ncclComm_t comm = OneRankComm();
  cudaStream_t s = NonBlocking();
  float *x = d.Alloc(8), *y = d.Alloc(8);
  setenv("FSDP_EMU_NCCL_FAIL_AFTER", "1", 1);  // the communicator's second collective fails
  REQUIRE(ncclAllReduce(x, y, 8, ncclFloat32, ncclSum, comm, s) == ncclSuccess);
  REQUIRE(ncclAllReduce(x, y, 8, ncclFloat32, ncclSum, comm, s) == ncclSuccess);  // the failure shows asynchronously
  unsetenv("FSDP_EMU_NCCL_FAIL_AFTER");
  ncclResult_t async = ncclSuccess;
  REQUIRE(ncclCommGetAsyncError(comm, &async) == ncclSuccess);
  CHECK(async == ncclRemoteError);
  cudaEvent_t after = nullptr;
  REQUIRE(cudaEventCreate(&after) == cudaSuccess);
  REQUIRE(cudaEventRecord(after, s) == cudaSuccess);
  for (int i = 0; i < 3; ++i) CHECK(cudaEventQuery(after) == cudaErrorNotReady);
  cudaGetLastError();
  SUBCASE("a synchronize behind it is reported (it would hang on a GPU)") { CHECK(cudaStreamSynchronize(s) == cudaErrorLaunchFailure); }
  SUBCASE("ncclCommAbort ends it: the stream drains") {
    REQUIRE(ncclCommAbort(comm) == ncclSuccess);
    CHECK(cudaEventQuery(after) == cudaSuccess);
    CHECK(cudaStreamSynchronize(s) == cudaSuccess);
  }
}

}  // namespace
