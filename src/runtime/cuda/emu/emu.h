// cuda-emu: a host emulation of the parts of the CUDA runtime, cuBLAS and NCCL that fsdp-run's GPU
// engine calls, so that the engine's host logic, its kernels and cuda_test run on a machine
// without a GPU. It is a test harness, linked only into the *_emu test targets: nothing it prints
// is a GPU measurement (times are the host's, the device is host memory, there is no CUDA
// context, cuBLAS workspace or NCCL buffer).
//
// What it checks that a GPU would only show as wrong numbers, a hang or a crash:
// - stream order: every op (kernel, copy, memset, GEMM, collective) says which allocations it reads
//   and writes, and carries a vector clock of what it happens after (its stream's earlier work, the
//   events it waits for, what the host had seen complete when it was issued); two accesses to one
//   allocation from ops not ordered so, one of them a write, are reported as a race, whatever order
//   they ran in. Work also runs only when something waits for it (a synchronize, a device-to-host
//   copy, cudaFree), as late as its dependencies allow, so a missing wait often shows as NaN too;
// - pinned host memory (cudaHostAlloc): a host-to-device copy reads it when it runs, and it is
//   read-only until then, so a host write the copy could still see faults with a message;
// - uninitialised reads: cudaMalloc fills new memory with 0xFF bytes (NaN in fp32, bf16 and fp16);
// - bounds: every copy, memset, GEMM operand and collective buffer must lie inside one
//   allocation, and every pointer a kernel is given must be device memory or null;
// - arguments as the libraries check them: launch configurations, cuBLAS leading dimensions and
//   types, events created without timing, NCCL counts;
// - kernels: every CUDA thread runs as a fiber, so __syncthreads and warp shuffles behave as on the
//   GPU, and a barrier that not every thread of a block reaches is reported.
// Errors are sticky as on a GPU: after a kernel or library failure every call returns it.
// Multi-process NCCL runs over MPI where fsdp-run was built with it (one emulated GPU per rank).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <cuda_runtime.h>

namespace fsdp::emu {

/// A device buffer an op reads or writes: the allocation holding `p`.
struct Access {
  const void* p;
  bool write;
};

/// Enqueues `run` on `stream` (nullptr: the legacy default stream) after the stream's earlier work;
/// it runs when something waits for it. `what` names it in reports (a string literal). False, with
/// the last error cudaErrorInvalidResourceHandle, when the stream does not exist.
bool Enqueue(cudaStream_t stream, const char* what, std::function<void()> run, std::vector<Access> accesses);
/// Runs `run` now as an op of `stream`, after everything enqueued there so far; with `host_waits`
/// the host has seen it complete (a device-to-host copy), else it is only issued early (a
/// collective). Returns 0 when it ran, -1 when the stream does not exist, and, when it sits behind a
/// stuck op (EnqueueStuck), the id under which it is now stuck itself, its work dropped.
int RunAfter(cudaStream_t stream, const char* what, const std::function<void()>& run, std::vector<Access> accesses, bool host_waits);
/// Runs every enqueued op (cudaDeviceSynchronize).
void RunAll();
/// Enqueues an op that never completes, as a collective whose peers are gone: work behind it waits,
/// queries say not ready, a synchronize fails the context (it would hang on a GPU). Returns its id.
int EnqueueStuck(cudaStream_t stream, const char* what);
/// Lets a stuck op complete (ncclCommAbort ends the communicator's kernels).
void ReleaseStuck(int id);

/// True when [p, p + bytes) lies inside one live emulated device allocation.
bool IsDeviceRange(const void* p, size_t bytes);
/// True when p points into a live emulated device allocation.
bool IsDevicePointer(const void* p);
/// A caching allocator handed out [p, p + bytes) of one of its cudaMalloc segments: stream order is
/// checked per such block from now on, not per segment. The history of the blocks it overlaps
/// (freed ones included) carries over, so reusing memory another stream still uses is a race.
void RegisterBlock(const void* p, size_t bytes);

/// Makes `code` the sticky error of the emulated context and prints `message` on stderr.
void Fail(cudaError_t code, const std::string& message);
/// The sticky error, cudaSuccess while there is none.
cudaError_t StickyError();
/// Sets what cudaGetLastError returns next (a launch error; not sticky).
void SetLastError(cudaError_t code);

}  // namespace fsdp::emu
