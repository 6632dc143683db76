#include "runtime/cuda/cuda_kernels.h"

#include <algorithm>
#include <cmath>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "runtime/cuda/cuda_check.h"
#include "runtime/cuda/cuda_launch.h"

namespace fsdp::runtime::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float ToF(float x) { return x; }
__device__ __forceinline__ float ToF(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float ToF(__half x) { return __half2float(x); }
template <typename T>
__device__ __forceinline__ T FromF(float x);
template <>
__device__ __forceinline__ float FromF<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 FromF<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half FromF<__half>(float x) { return __float2half_rn(x); }

// Runs the statements with TYPE the C++ type of `dtype` (the .cu sources are C++17: no template lambdas).
#define FSDP_DISPATCH(dtype, TYPE, ...)         \
  switch (dtype) {                              \
    case DType::kFp32: {                        \
      using TYPE = float;                       \
      __VA_ARGS__;                              \
    } break;                                    \
    case DType::kBf16: {                        \
      using TYPE = __nv_bfloat16;               \
      __VA_ARGS__;                              \
    } break;                                    \
    case DType::kFp16: {                        \
      using TYPE = __half;                      \
      __VA_ARGS__;                              \
    } break;                                    \
  }

unsigned Blocks(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 65535 * 16 ? (blocks > 0 ? blocks : 1) : 65535 * 16);
}

// Sum of v over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
__device__ float BlockSum(float v) {
  __shared__ float partial[32];
  __shared__ float total;
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // partial may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float s = lane < static_cast<int>(blockDim.x / 32) ? partial[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset >>= 1) s += __shfl_xor_sync(0xffffffffu, s, offset);
    if (lane == 0) total = s;
  }
  __syncthreads();
  return total;
}

__device__ float BlockMax(float v) {
  __shared__ float partial[32];
  __shared__ float total;
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float s = lane < static_cast<int>(blockDim.x / 32) ? partial[lane] : -INFINITY;
    for (int offset = 16; offset > 0; offset >>= 1) s = fmaxf(s, __shfl_xor_sync(0xffffffffu, s, offset));
    if (lane == 0) total = s;
  }
  __syncthreads();
  return total;
}

#define GRID_STRIDE(i, n) for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < (n); i += static_cast<int64_t>(gridDim.x) * blockDim.x)

__device__ uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

__global__ void FillNormalKernel(float* out, int64_t n, uint64_t seed, int64_t first_index, float std) {
  GRID_STRIDE(i, n) {
    const uint64_t bits = SplitMix64(seed ^ SplitMix64(static_cast<uint64_t>(first_index + i)));
    const float u1 = (static_cast<float>(bits >> 40) + 1.0f) / 16777217.0f;  // (0, 1]
    const float u2 = static_cast<float>((bits >> 16) & 0xFFFFFF) / 16777216.0f;
    out[i] = std * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
  }
}

__global__ void FillKernel(float* out, int64_t n, float value) {
  GRID_STRIDE(i, n) out[i] = value;
}

template <typename TIn, typename TOut>
__global__ void CastKernel(const TIn* in, TOut* out, int64_t n) {
  GRID_STRIDE(i, n) out[i] = FromF<TOut>(ToF(in[i]));
}

template <typename T>
__global__ void AccumulateKernel(const T* in, float scale, float* acc, int64_t n) {
  GRID_STRIDE(i, n) acc[i] += scale * ToF(in[i]);
}

template <typename T>
__global__ void AddF32Kernel(const float* in, T* out, int64_t n) {
  GRID_STRIDE(i, n) out[i] = FromF<T>(ToF(out[i]) + in[i]);
}

template <typename T>
__global__ void BroadcastRowsKernel(const T* bias, T* out, int64_t rows, int64_t cols) {
  GRID_STRIDE(i, rows * cols) out[i] = bias[i % cols];
}

template <typename T>
__global__ void ScaleKernel(T* x, float scale, int64_t n) {
  GRID_STRIDE(i, n) x[i] = FromF<T>(ToF(x[i]) * scale);
}

template <typename T>
__global__ void EmbeddingForwardKernel(const T* table, const int32_t* ids, T* out, int64_t rows, int64_t h) {
  GRID_STRIDE(i, rows * h) out[i] = table[static_cast<int64_t>(ids[i / h]) * h + i % h];
}

// One block per distinct token: its threads walk the hidden dimension, each summing the token's
// rows of d_out in fp32 for its columns.
template <typename T>
__global__ void EmbeddingBackwardKernel(const T* d_out, const int32_t* ids, const int32_t* offsets, const int32_t* rows, T* d_table, int64_t h) {
  const int64_t token = blockIdx.x;
  T* out = d_table + static_cast<int64_t>(ids[token]) * h;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
    float sum = 0;
    for (int32_t r = offsets[token]; r < offsets[token + 1]; ++r) sum += ToF(d_out[static_cast<int64_t>(rows[r]) * h + j]);
    out[j] = FromF<T>(ToF(out[j]) + sum);
  }
}

template <typename T>
__global__ void RmsNormForwardKernel(const T* x, const T* w, T* y, float* inv_rms, int64_t h, float eps) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * h;
  float ss = 0;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) ss += ToF(xr[j]) * ToF(xr[j]);
  const float inv = rsqrtf(BlockSum(ss) / static_cast<float>(h) + eps);
  if (threadIdx.x == 0) inv_rms[row] = inv;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) y[row * h + j] = FromF<T>(ToF(xr[j]) * inv * ToF(w[j]));
}

// dx_j = inv * dy_j * w_j - inv^3 * x_j * sum_k(dy_k * w_k * x_k) / h (+ residual_j)
template <typename T>
__global__ void RmsNormBackwardKernel(const T* dy, const T* x, const T* w, const float* inv_rms, const T* residual, T* dx, int64_t h) {
  const int64_t row = blockIdx.x;
  const float inv = inv_rms[row];
  float dot = 0;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) dot += ToF(dy[row * h + j]) * ToF(w[j]) * ToF(x[row * h + j]);
  const float c = BlockSum(dot) * inv * inv * inv / static_cast<float>(h);
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
    const int64_t i = row * h + j;
    float v = inv * ToF(dy[i]) * ToF(w[j]) - c * ToF(x[i]);
    if (residual != nullptr) v += ToF(residual[i]);
    dx[i] = FromF<T>(v);
  }
}

// Terms of the column reductions: x[r, c] (a bias's gradient) and dy * x * inv_rms (RMSNorm's weight).
template <typename T>
struct ElementTerm {
  const T* x;
  __device__ float operator()(int64_t r, int64_t c, int64_t cols) const { return ToF(x[r * cols + c]); }
};
template <typename T>
struct NormWeightTerm {
  const T* dy;
  const T* x;
  const float* inv_rms;
  __device__ float operator()(int64_t r, int64_t c, int64_t cols) const { return ToF(dy[r * cols + c]) * ToF(x[r * cols + c]) * inv_rms[r]; }
};

// out_c += sum over a chunk of rows of term(r, c); blockDim (32, 8): 32 columns, 8 row lanes; the
// chunks meet in fp32 atomics.
template <typename Term>
__global__ void ColumnReduceKernel(Term term, float* out, int64_t rows, int64_t cols, int64_t rows_per_chunk) {
  __shared__ float partial[8][33];
  const int64_t col = blockIdx.x * 32 + threadIdx.x;
  const int64_t begin = blockIdx.y * rows_per_chunk;
  const int64_t end = min(rows, begin + rows_per_chunk);
  float s = 0;
  if (col < cols) {
    for (int64_t r = begin + threadIdx.y; r < end; r += 8) s += term(r, col, cols);
  }
  partial[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float total = 0;
    for (int k = 0; k < 8; ++k) total += partial[k][threadIdx.x];
    atomicAdd(out + col, total);
  }
}

template <typename T>
__global__ void RopeKernel(T* x, const float* table, int64_t rows, int64_t heads, int64_t head_dim, int64_t seq, float sign) {
  const int64_t half = head_dim / 2;
  GRID_STRIDE(idx, rows * heads * half) {
    const int64_t i = idx % half;
    const int64_t head = (idx / half) % heads;
    const int64_t row = idx / (half * heads);
    const int64_t angle = (row % seq) * half + i;
    const float c = table[angle], s = sign * table[seq * half + angle];
    T* a = x + row * heads * head_dim + head * head_dim + i;
    T* b = a + half;
    const float x1 = ToF(*a), x2 = ToF(*b);
    *a = FromF<T>(x1 * c - x2 * s);
    *b = FromF<T>(x2 * c + x1 * s);
  }
}

template <typename T>
__global__ void CausalSoftmaxForwardKernel(T* scores, int64_t seq, float scale) {
  const int64_t row = blockIdx.x;  // over matrices * seq
  const int64_t i = row % seq;
  T* s = scores + row * seq;
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) m = fmaxf(m, scale * ToF(s[j]));
  m = BlockMax(m);
  float sum = 0;
  for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) sum += __expf(scale * ToF(s[j]) - m);
  const float inv = 1.0f / BlockSum(sum);
  for (int64_t j = threadIdx.x; j < seq; j += blockDim.x) s[j] = FromF<T>(j <= i ? __expf(scale * ToF(s[j]) - m) * inv : 0.0f);
}

template <typename T>
__global__ void CausalSoftmaxBackwardKernel(const T* probs, T* d_probs, int64_t seq, float scale) {
  const int64_t row = blockIdx.x;
  const int64_t i = row % seq;
  const T* p = probs + row * seq;
  T* dp = d_probs + row * seq;
  float dot = 0;
  for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) dot += ToF(p[j]) * ToF(dp[j]);
  dot = BlockSum(dot);
  for (int64_t j = threadIdx.x; j < seq; j += blockDim.x) dp[j] = FromF<T>(j <= i ? scale * ToF(p[j]) * (ToF(dp[j]) - dot) : 0.0f);
}

template <typename T>
__global__ void SumHeadGroupsKernel(const T* in, T* out, int64_t rows, int64_t kv_heads, int64_t rep, int64_t head_dim) {
  GRID_STRIDE(idx, rows * kv_heads * head_dim) {
    const int64_t e = idx % head_dim;
    const int64_t g = (idx / head_dim) % kv_heads;
    const int64_t row = idx / (head_dim * kv_heads);
    const T* src = in + row * kv_heads * rep * head_dim + g * rep * head_dim + e;
    float s = 0;
    for (int64_t r = 0; r < rep; ++r) s += ToF(src[r * head_dim]);
    out[idx] = FromF<T>(s);
  }
}

__device__ __forceinline__ float Sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

template <typename T>
__global__ void SwiGluForwardKernel(const T* gate, const T* up, T* mid, int64_t n) {
  GRID_STRIDE(i, n) {
    const float g = ToF(gate[i]);
    mid[i] = FromF<T>(g * Sigmoid(g) * ToF(up[i]));
  }
}

template <typename T>
__global__ void SwiGluBackwardKernel(const T* d_mid, const T* gate, const T* up, T* d_gate, T* d_up, int64_t n) {
  GRID_STRIDE(i, n) {
    const float g = ToF(gate[i]), u = ToF(up[i]), dm = ToF(d_mid[i]);
    const float sig = Sigmoid(g);
    d_up[i] = FromF<T>(dm * g * sig);
    d_gate[i] = FromF<T>(dm * u * sig * (1.0f + g * (1.0f - sig)));
  }
}

template <typename T>
__global__ void CrossEntropyKernel(T* logits, const int32_t* targets, float* loss_sum, int64_t vocab, float grad_scale) {
  const int64_t row = blockIdx.x;
  T* x = logits + row * vocab;
  const int32_t target = targets[row];
  const float x_target = ToF(x[target]);
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) m = fmaxf(m, ToF(x[j]));
  m = BlockMax(m);
  float sum = 0;
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) sum += __expf(ToF(x[j]) - m);
  sum = BlockSum(sum);  // also orders every read of x[target] before the writes below
  if (threadIdx.x == 0) atomicAdd(loss_sum, logf(sum) + m - x_target);
  const float inv = 1.0f / sum;
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
    const float p = __expf(ToF(x[j]) - m) * inv;
    x[j] = FromF<T>((p - (j == target ? 1.0f : 0.0f)) * grad_scale);
  }
}

__global__ void AdamWKernel(float* param, const float* grad, float* m, float* v, int64_t n, float lr, float b1, float b2, float eps,
                            float wd, float c1, float c2) {
  GRID_STRIDE(i, n) {
    const float g = grad != nullptr ? grad[i] : 0.0f;
    m[i] = b1 * m[i] + (1 - b1) * g;
    v[i] = b2 * v[i] + (1 - b2) * g * g;
    float p = param[i];
    p -= lr * wd * p;
    p -= lr * (m[i] / c1) / (sqrtf(v[i] / c2) + eps);
    param[i] = p;
  }
}

}  // namespace

void FillNormal(float* out, int64_t n, uint64_t seed, int64_t first_index, float std, cudaStream_t stream) {
  FSDP_LAUNCH(FillNormalKernel, Blocks(n), kThreads, stream)(out, n, seed, first_index, std);
}

void Fill(float* out, int64_t n, float value, cudaStream_t stream) { FSDP_LAUNCH(FillKernel, Blocks(n), kThreads, stream)(out, n, value); }

void CastFromF32(const float* in, void* out, DType dtype, int64_t n, cudaStream_t stream) {
  Cast(in, DType::kFp32, out, dtype, n, stream);
}

void Cast(const void* in, DType from, void* out, DType to, int64_t n, cudaStream_t stream) {
  FSDP_DISPATCH(from, TIn, FSDP_DISPATCH(to, TOut, FSDP_LAUNCH(CastKernel, Blocks(n), kThreads, stream)(static_cast<const TIn*>(in), static_cast<TOut*>(out), n)));
}

__global__ void FlagNonFiniteKernel(const float* x, int64_t n, float* found) {
  GRID_STRIDE(i, n) {
    if (!isfinite(x[i])) *found = 1.0f;  // every writer writes the same value
  }
}
void FlagNonFinite(const float* x, int64_t n, float* found, cudaStream_t stream) {
  FSDP_LAUNCH(FlagNonFiniteKernel, Blocks(n), kThreads, stream)(x, n, found);
}
void AccumulateF32(const void* in, DType dtype, float scale, float* acc, int64_t n, cudaStream_t stream) {
  FSDP_DISPATCH(dtype, T, FSDP_LAUNCH(AccumulateKernel, Blocks(n), kThreads, stream)(static_cast<const T*>(in), scale, acc, n))
}

void AddF32(const float* in, void* out, DType dtype, int64_t n, cudaStream_t stream) {
  FSDP_DISPATCH(dtype, T, FSDP_LAUNCH(AddF32Kernel, Blocks(n), kThreads, stream)(in, static_cast<T*>(out), n))
}

// out (cols, fp32) = sum over rows of term: zeroed, then one (32, 8) block per 32 columns and chunk of rows.
template <typename Term>
void ColumnReduce(Term term, float* out, int64_t rows, int64_t cols, cudaStream_t stream) {
  cudaMemsetAsync(out, 0, static_cast<size_t>(cols) * sizeof(float), stream);
  const int64_t chunks = rows < 256 ? 1 : 64;
  const int64_t rows_per_chunk = (rows + chunks - 1) / chunks;
  const dim3 grid(static_cast<unsigned>((cols + 31) / 32), static_cast<unsigned>(chunks));
  FSDP_LAUNCH(ColumnReduceKernel, grid, dim3(32, 8), stream)(term, out, rows, cols, rows_per_chunk);
}

void BroadcastRows(const void* bias, void* out, int64_t rows, int64_t cols, DType dtype, cudaStream_t stream) {
  FSDP_DISPATCH(dtype, T, FSDP_LAUNCH(BroadcastRowsKernel, Blocks(rows * cols), kThreads, stream)(static_cast<const T*>(bias), static_cast<T*>(out), rows, cols))
}

void ColumnSums(const void* x, float* out, int64_t rows, int64_t cols, DType dtype, cudaStream_t stream) {
  FSDP_DISPATCH(dtype, T, ColumnReduce(ElementTerm<T>{static_cast<const T*>(x)}, out, rows, cols, stream))
}

void Scale(void* x, DType dtype, float scale, int64_t n, cudaStream_t stream) {
  FSDP_DISPATCH(dtype, T, FSDP_LAUNCH(ScaleKernel, Blocks(n), kThreads, stream)(static_cast<T*>(x), scale, n))
}

void EmbeddingForward(const void* table, const int32_t* ids, void* out, int64_t rows, int64_t h, DType dtype, cudaStream_t stream) {
  FSDP_DISPATCH(dtype, T, FSDP_LAUNCH(EmbeddingForwardKernel, Blocks(rows * h), kThreads, stream)(static_cast<const T*>(table), ids, static_cast<T*>(out), rows, h))
}

std::vector<int32_t> TokenGroups::Packed() const {
  std::vector<int32_t> packed(ids);
  packed.insert(packed.end(), offsets.begin(), offsets.end());
  packed.insert(packed.end(), rows.begin(), rows.end());
  return packed;
}

TokenGroups GroupTokens(const std::vector<int32_t>& token_ids) {
  TokenGroups g;
  g.rows.resize(token_ids.size());
  for (size_t i = 0; i < token_ids.size(); ++i) g.rows[i] = static_cast<int32_t>(i);
  std::stable_sort(g.rows.begin(), g.rows.end(), [&](int32_t a, int32_t b) { return token_ids[a] < token_ids[b]; });
  for (size_t i = 0; i < g.rows.size(); ++i) {
    if (i == 0 || token_ids[g.rows[i]] != token_ids[g.rows[i - 1]]) {
      g.ids.push_back(token_ids[g.rows[i]]);
      g.offsets.push_back(static_cast<int32_t>(i));
    }
  }
  g.offsets.push_back(static_cast<int32_t>(g.rows.size()));
  return g;
}

void EmbeddingBackward(const void* d_out, const int32_t* packed, int64_t tokens, void* d_table, int64_t h, DType dtype, cudaStream_t stream) {
  if (tokens == 0) return;
  const int32_t *ids = packed, *offsets = packed + tokens, *rows = offsets + tokens + 1;
  FSDP_DISPATCH(dtype, T, FSDP_LAUNCH(EmbeddingBackwardKernel, static_cast<unsigned>(tokens), kThreads, stream)(static_cast<const T*>(d_out), ids, offsets, rows,
                                                                                                       static_cast<T*>(d_table), h))
}

void RmsNormForward(const void* x, const void* w, void* y, float* inv_rms, int64_t rows, int64_t h, float eps, DType dtype, cudaStream_t stream) {
  FSDP_DISPATCH(dtype, T, FSDP_LAUNCH(RmsNormForwardKernel, static_cast<unsigned>(rows), kThreads, stream)(static_cast<const T*>(x), static_cast<const T*>(w),
                                                                              static_cast<T*>(y), inv_rms, h, eps))
}

void RmsNormBackward(const void* dy, const void* x, const void* w, const float* inv_rms, const void* residual, void* dx, float* dw_f32,
                     int64_t rows, int64_t h, DType dtype, cudaStream_t stream) {
  FSDP_DISPATCH(dtype, T, FSDP_LAUNCH(RmsNormBackwardKernel, static_cast<unsigned>(rows), kThreads, stream)(static_cast<const T*>(dy), static_cast<const T*>(x),
                                                                               static_cast<const T*>(w), inv_rms,
                                                                               static_cast<const T*>(residual), static_cast<T*>(dx), h);
    ColumnReduce(NormWeightTerm<T>{static_cast<const T*>(dy), static_cast<const T*>(x), inv_rms}, dw_f32, rows, h, stream))
}

Status RopeTable(float* table, int64_t seq, const std::vector<double>& inv_freq, cudaStream_t stream) {
  const auto half = static_cast<int64_t>(inv_freq.size());
  std::vector<float> host(static_cast<size_t>(2 * seq * half));
  for (int64_t pos = 0; pos < seq; ++pos) {
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(pos) * inv_freq[static_cast<size_t>(i)];
      host[static_cast<size_t>(pos * half + i)] = static_cast<float>(std::cos(angle));
      host[static_cast<size_t>(seq * half + pos * half + i)] = static_cast<float>(std::sin(angle));
    }
  }
  FSDP_CUDA_TRY(cudaMemcpyAsync(table, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice, stream));
  FSDP_CUDA_TRY(cudaStreamSynchronize(stream));  // `host` dies on return
  return {};
}

void Rope(void* x, const float* table, int64_t rows, int64_t heads, int64_t head_dim, int64_t seq, bool inverse, DType dtype,
          cudaStream_t stream) {
  FSDP_DISPATCH(dtype, T,
                FSDP_LAUNCH(RopeKernel, Blocks(rows * heads * head_dim / 2), kThreads, stream)(static_cast<T*>(x), table, rows, heads, head_dim, seq,
                                                                                         inverse ? -1.0f : 1.0f))
}

void CausalSoftmaxForward(void* scores, int64_t matrices, int64_t seq, float scale, DType dtype, cudaStream_t stream) {
  FSDP_DISPATCH(dtype, T, FSDP_LAUNCH(CausalSoftmaxForwardKernel, static_cast<unsigned>(matrices * seq), kThreads, stream)(static_cast<T*>(scores), seq, scale))
}

void CausalSoftmaxBackward(const void* probs, void* d_probs, int64_t matrices, int64_t seq, float scale, DType dtype, cudaStream_t stream) {
  FSDP_DISPATCH(dtype, T, FSDP_LAUNCH(CausalSoftmaxBackwardKernel, static_cast<unsigned>(matrices * seq), kThreads, stream)(static_cast<const T*>(probs),
                                                                                               static_cast<T*>(d_probs), seq, scale))
}

void SumHeadGroups(const void* in, void* out, int64_t rows, int64_t kv_heads, int64_t rep, int64_t head_dim, DType dtype, cudaStream_t stream) {
  FSDP_DISPATCH(dtype, T, FSDP_LAUNCH(SumHeadGroupsKernel, Blocks(rows * kv_heads * head_dim), kThreads, stream)(static_cast<const T*>(in), static_cast<T*>(out), rows,
                                                                                     kv_heads, rep, head_dim))
}

void SwiGluForward(const void* gate, const void* up, void* mid, int64_t n, DType dtype, cudaStream_t stream) {
  FSDP_DISPATCH(dtype, T, FSDP_LAUNCH(SwiGluForwardKernel, Blocks(n), kThreads, stream)(static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<T*>(mid), n))
}

void SwiGluBackward(const void* d_mid, const void* gate, const void* up, void* d_gate, void* d_up, int64_t n, DType dtype, cudaStream_t stream) {
  FSDP_DISPATCH(dtype, T, FSDP_LAUNCH(SwiGluBackwardKernel, Blocks(n), kThreads, stream)(static_cast<const T*>(d_mid), static_cast<const T*>(gate),
                                                             static_cast<const T*>(up), static_cast<T*>(d_gate), static_cast<T*>(d_up), n))
}

void CrossEntropyInPlace(void* logits, const int32_t* targets, float* loss_sum, int64_t rows, int64_t vocab, float grad_scale, DType dtype,
                         cudaStream_t stream) {
  FSDP_DISPATCH(dtype, T, FSDP_LAUNCH(CrossEntropyKernel, static_cast<unsigned>(rows), 1024, stream)(static_cast<T*>(logits), targets, loss_sum, vocab, grad_scale))
}

void AdamW(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n, float lr, float beta1, float beta2, float eps,
           float weight_decay, float bias_correction1, float bias_correction2, cudaStream_t stream) {
  FSDP_LAUNCH(AdamWKernel, Blocks(n), kThreads, stream)(param, grad, exp_avg, exp_avg_sq, n, lr, beta1, beta2, eps, weight_decay, bias_correction1,
                                                  bias_correction2);
}

}  // namespace fsdp::runtime::cuda
