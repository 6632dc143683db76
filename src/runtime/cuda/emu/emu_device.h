// cuda-emu's device side (emu.h): what a .cu file's kernels need to compile as host C++ and run on
// cuda-emu: the thread indices, __syncthreads, warp shuffles, atomics, the device math functions,
// and FSDP_LAUNCH's emulated form. Included through cuda_launch.h only in the emulation build.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "runtime/cuda/emu/emu.h"

// host code: the CUDA qualifiers lose their meaning; a block's threads run one at a time on one
// host thread, so __shared__ storage is a static
#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __shared__
#define __shared__ static
#undef __forceinline__
#define __forceinline__ inline

namespace fsdp::emu {

/// The CUDA built-in variables of the thread now running.
struct KernelThread {
  uint3 thread_idx, block_idx;
  dim3 block_dim, grid_dim;
};
/// The thread now running (a host-side placeholder outside kernels); what threadIdx and the other
/// built-ins read.
extern const KernelThread* g_thread;
/// __syncthreads(): waits until every thread of the block has reached it.
void BlockBarrier();
/// __shfl_xor_sync on 4-byte values: the value of lane (lane ^ lane_mask) of the warp.
uint32_t WarpShuffleXor(unsigned mask, uint32_t bits, int lane_mask);
/// Runs body(ctx) as every thread of every block of the grid, block after block: each thread a
/// fiber, or, once a launch of `site` (one per launch site and argument types) has run a first
/// block without any barrier, one call after another.
void RunGrid(dim3 grid, dim3 block, const char* kernel, const void* site, void (*body)(void*), void* ctx);
/// False, with the last error set as CUDA would, when the configuration cannot launch.
bool ValidLaunch(dim3 grid, dim3 block, const char* kernel);

// A pointer argument must be device memory or null; it is read when it points to const (pass read-only
// buffers so), else written.
template <typename Arg>
bool DeviceArgument(const Arg& arg, const char* kernel, int index, std::vector<Access>& accesses) {
  if constexpr (std::is_pointer_v<Arg>) {
    if (arg == nullptr) return true;
    if (!IsDevicePointer(arg)) {
      Fail(cudaErrorIllegalAddress, std::string("cuda-emu: kernel ") + kernel + ": argument " + std::to_string(index) +
                                        " is not device memory (a host pointer or a freed buffer)");
      return false;
    }
    accesses.push_back(Access{arg, !std::is_const_v<std::remove_pointer_t<Arg>>});
  }
  return true;
}

/// kernel<<<grid, block, 0, stream>>>(args...): checks the configuration and the pointer
/// arguments, then enqueues the grid with copies of the arguments. Buffers reached through a
/// struct argument are not seen by the race check.
template <typename Body>
class Launch {
 public:
  Launch(dim3 grid, dim3 block, cudaStream_t stream, const char* kernel, Body body)
      : grid_(grid), block_(block), stream_(stream), kernel_(kernel), body_(body) {}
  template <typename... Args>
  void operator()(Args... args) const {
    if (!ValidLaunch(grid_, block_, kernel_)) return;
    int index = 0;
    std::vector<Access> accesses;
    if (!(DeviceArgument(args, kernel_, index++, accesses) && ...)) return;
    static const char site = 0;  // this launch site's identity for RunGrid
    Enqueue(
        stream_, kernel_,
        [grid = grid_, block = block_, kernel = kernel_, body = body_, args...]() {
          auto call = [&] { body(args...); };
          RunGrid(grid, block, kernel, &site, [](void* c) { (*static_cast<decltype(call)*>(c))(); }, &call);
        },
        std::move(accesses));
  }

 private:
  dim3 grid_, block_;
  cudaStream_t stream_;
  const char* kernel_;
  Body body_;
};

inline float Expf(float x) { return std::exp(x); }

}  // namespace fsdp::emu

#define threadIdx (::fsdp::emu::g_thread->thread_idx)
#define blockIdx (::fsdp::emu::g_thread->block_idx)
#define blockDim (::fsdp::emu::g_thread->block_dim)
#define gridDim (::fsdp::emu::g_thread->grid_dim)
#undef __expf
#define __expf ::fsdp::emu::Expf

inline void __syncthreads() { ::fsdp::emu::BlockBarrier(); }
inline float __shfl_xor_sync(unsigned mask, float v, int lane_mask) {
  uint32_t bits;
  __builtin_memcpy(&bits, &v, 4);
  bits = ::fsdp::emu::WarpShuffleXor(mask, bits, lane_mask);
  __builtin_memcpy(&v, &bits, 4);
  return v;
}
inline float atomicAdd(float* address, float value) {  // one host thread runs the kernels: no race
  const float old = *address;
  *address = old + value;
  return old;
}
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float cospif(float x) { return static_cast<float>(std::cos(3.14159265358979323846 * static_cast<double>(x))); }
template <typename T>
inline T min(T a, T b) {
  return b < a ? b : a;
}
using std::isfinite;

#define FSDP_LAUNCH(kernel, grid, block, stream) \
  (::fsdp::emu::Launch((grid), (block), (stream), #kernel, [](auto... fsdp_args) { kernel(fsdp_args...); }))
