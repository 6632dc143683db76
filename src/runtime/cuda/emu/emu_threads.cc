// cuda-emu's kernel execution (emu_device.h): the threads of a block as fibers on one host thread,
// switched at __syncthreads and at warp shuffles, blocks one after another. A launch site whose
// first block needed no barrier runs its threads as plain calls from then on (elementwise kernels
// are most launches); should such a kernel reach a barrier later, the launch fails with a message.
// The context switch is x86-64 System V only (CMake builds cuda-emu on x86-64 hosts only); the
// MXCSR and x87 control words are not switched (no kernel changes the rounding mode).
#include <sys/mman.h>

#include <cstdio>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include "runtime/cuda/emu/emu_device.h"

// Saves the callee-saved registers and the stack pointer of the running context in *save and
// resumes the context whose stack pointer is `load` (x86-64 System V).
extern "C" void fsdp_emu_switch(void** save, void* load);
asm(R"(
  .text
  .globl fsdp_emu_switch
  .type fsdp_emu_switch, @function
fsdp_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size fsdp_emu_switch, .-fsdp_emu_switch
  .section .note.GNU-stack,"",@progbits
  .text
)");

namespace fsdp::emu {
namespace {

constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kGuardBytes = 4096;

enum class State { kReady, kAtBlockBarrier, kAtWarpBarrier, kDone };

struct Fiber {
  char* memory = nullptr;  // guard page, then the stack
  void* sp = nullptr;
  KernelThread thread{};
  State state = State::kReady;
  uint32_t shuffle_value[2] = {0, 0};  // published by alternate shuffles
  unsigned shuffles = 0;               // shuffles this thread has entered
  ~Fiber() {
    if (memory != nullptr) munmap(memory, kGuardBytes + kStackBytes);
  }
};

// One block at a time: the scheduler's context, the block's fibers and the kernel body.
struct BlockRun {
  void* scheduler_sp = nullptr;
  std::vector<std::unique_ptr<Fiber>> fibers;
  Fiber* current = nullptr;
  int threads = 0;  // of the block now running
  void (*body)(void*) = nullptr;
  void* ctx = nullptr;
  bool barrier_seen = false;  // some thread of this launch waited at a barrier
  bool direct = false;        // threads run as plain calls: no barrier may be reached
  std::string error;          // undefined behaviour seen in this launch
};
BlockRun g_run;
const KernelThread g_host_thread{};  // what the built-ins read outside a kernel
std::unordered_set<const void*> g_barrier_free;  // launch sites whose first block needed no barrier

[[noreturn]] void FiberEntry() {
  g_run.body(g_run.ctx);
  g_run.current->state = State::kDone;
  fsdp_emu_switch(&g_run.current->sp, g_run.scheduler_sp);
  __builtin_trap();  // a finished fiber is never resumed
}

// A fresh stack whose first switch enters FiberEntry as if called (rsp = 8 mod 16 at entry).
void Reset(Fiber& f) {
  if (f.memory == nullptr) {
    void* m = mmap(nullptr, kGuardBytes + kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) {
      std::fprintf(stderr, "cuda-emu: no memory for a thread stack\n");
      std::abort();
    }
    mprotect(m, kGuardBytes, PROT_NONE);  // a stack overflow faults instead of corrupting memory
    f.memory = static_cast<char*>(m);
  }
  auto* top = reinterpret_cast<uintptr_t*>(f.memory + kGuardBytes + kStackBytes);
  top -= 2;  // 16-byte aligned: FiberEntry's address, then a null return address for FiberEntry
  top[0] = reinterpret_cast<uintptr_t>(&FiberEntry);
  top[1] = 0;
  top -= 6;  // r15, r14, r13, r12, rbx, rbp
  for (int i = 0; i < 6; ++i) top[i] = 0;
  f.sp = top;
  f.state = State::kReady;
  f.shuffles = 0;
}

void SwitchToScheduler() { fsdp_emu_switch(&g_run.current->sp, g_run.scheduler_sp); }

void WaitAt(State barrier) {
  if (g_run.current == nullptr) {
    if (g_run.direct) g_run.error = "a barrier in a kernel whose first block reached none (not emulated)";
    Fail(cudaErrorLaunchFailure, g_run.direct ? "cuda-emu: a barrier in a kernel whose first block reached none (not emulated)"
                                              : "cuda-emu: a barrier outside a kernel");
    return;
  }
  g_run.barrier_seen = true;
  g_run.current->state = barrier;
  SwitchToScheduler();
}

// Releases the warps whose every lane waits at a shuffle and, once no warp can move, the block
// barrier if every thread waits there. Returns false when nothing can move (undefined behaviour:
// a barrier that some thread never reaches).
bool Release(int threads) {
  bool released = false;
  for (int warp = 0; warp * 32 < threads; ++warp) {
    const int first = warp * 32, last = std::min(threads, first + 32);
    int waiting = 0;
    for (int t = first; t < last; ++t) waiting += g_run.fibers[t]->state == State::kAtWarpBarrier;
    if (waiting == 0) continue;
    if (waiting != last - first) continue;
    for (int t = first; t < last; ++t) g_run.fibers[t]->state = State::kReady;
    released = true;
  }
  if (released) return true;
  int at_block = 0, done = 0;
  for (int t = 0; t < threads; ++t) {
    at_block += g_run.fibers[t]->state == State::kAtBlockBarrier;
    done += g_run.fibers[t]->state == State::kDone;
  }
  if (at_block == threads) {
    for (int t = 0; t < threads; ++t) g_run.fibers[t]->state = State::kReady;
    return true;
  }
  if (done == threads) return true;
  g_run.error = at_block > 0 && done > 0 ? "__syncthreads not reached by every thread of the block (some returned)"
                : at_block > 0        ? "threads wait at __syncthreads while others wait at a warp shuffle"
                                      : "a warp shuffle that not every lane of the warp reaches";
  return false;
}

// Runs one block to the end; false on undefined behaviour.
bool RunBlock(dim3 grid, dim3 block, uint3 block_idx) {
  const int threads = static_cast<int>(block.x * block.y * block.z);
  g_run.threads = threads;
  while (static_cast<int>(g_run.fibers.size()) < threads) g_run.fibers.push_back(std::make_unique<Fiber>());
  for (int t = 0; t < threads; ++t) {
    Fiber& f = *g_run.fibers[t];
    Reset(f);
    const unsigned x = t % block.x, y = (t / block.x) % block.y, z = t / (block.x * block.y);
    f.thread = KernelThread{uint3{x, y, z}, block_idx, block, grid};
  }
  for (;;) {
    bool all_done = true;
    for (int t = 0; t < threads; ++t) {
      Fiber& f = *g_run.fibers[t];
      if (f.state == State::kReady) {
        g_run.current = &f;
        g_thread = &f.thread;
        fsdp_emu_switch(&g_run.scheduler_sp, f.sp);
        g_run.current = nullptr;
        g_thread = &g_host_thread;
      }
      all_done = all_done && f.state == State::kDone;
    }
    if (all_done) return true;
    if (!Release(threads)) return false;
  }
}

// Runs one block's threads one after another (a kernel known to need no barrier).
void RunBlockDirect(dim3 grid, dim3 block, uint3 block_idx) {
  KernelThread t{uint3{0, 0, 0}, block_idx, block, grid};
  g_thread = &t;
  for (unsigned z = 0; z < block.z; ++z) {
    for (unsigned y = 0; y < block.y; ++y) {
      for (unsigned x = 0; x < block.x; ++x) {
        t.thread_idx = uint3{x, y, z};
        g_run.body(g_run.ctx);
      }
    }
  }
  g_thread = &g_host_thread;
}

}  // namespace

const KernelThread* g_thread = &g_host_thread;

void BlockBarrier() { WaitAt(State::kAtBlockBarrier); }

uint32_t WarpShuffleXor(unsigned mask, uint32_t bits, int lane_mask) {
  Fiber* self = g_run.current;
  if (self == nullptr || mask != 0xffffffffu) {
    Fail(cudaErrorLaunchFailure, "cuda-emu: __shfl_xor_sync outside a kernel or with a partial mask (not emulated)");
    return bits;
  }
  const KernelThread& t = self->thread;
  const int linear = static_cast<int>(t.thread_idx.x + t.block_dim.x * (t.thread_idx.y + t.block_dim.y * t.thread_idx.z));
  const int first = linear / 32 * 32, partner = first + ((linear % 32) ^ (lane_mask & 31));
  // Shuffle k publishes in slot k % 2: a lane writes that slot again only at shuffle k + 2, after
  // every lane has reached shuffle k + 1's barrier and so has read shuffle k's values.
  const unsigned slot = self->shuffles++ % 2;
  self->shuffle_value[slot] = bits;
  WaitAt(State::kAtWarpBarrier);  // every lane has published its value
  if (partner >= g_run.threads) {  // a lane of a partial warp: undefined on the GPU
    Fail(cudaErrorLaunchFailure, "cuda-emu: __shfl_xor_sync with a full mask in a partial warp");
    return bits;
  }
  return g_run.fibers[partner]->shuffle_value[slot];
}

bool ValidLaunch(dim3 grid, dim3 block, const char* kernel) {
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  const bool ok = threads >= 1 && threads <= 1024 && block.z <= 64 && grid.x >= 1 && grid.x <= 0x7fffffffu && grid.y >= 1 && grid.y <= 65535 &&
                  grid.z >= 1 && grid.z <= 65535;
  if (!ok) {
    std::fprintf(stderr, "cuda-emu: kernel %s: invalid configuration grid (%u, %u, %u) block (%u, %u, %u)\n", kernel, grid.x, grid.y, grid.z,
                 block.x, block.y, block.z);
    SetLastError(cudaErrorInvalidConfiguration);
  }
  return ok;
}

void RunGrid(dim3 grid, dim3 block, const char* kernel, const void* site, void (*body)(void*), void* ctx) {
  if (StickyError() != cudaSuccess) return;  // a failed context runs nothing more
  g_run.body = body;
  g_run.ctx = ctx;
  g_run.barrier_seen = false;
  g_run.direct = g_barrier_free.count(site) > 0;
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        if (g_run.direct) {
          RunBlockDirect(grid, block, uint3{x, y, z});
        } else if (!RunBlock(grid, block, uint3{x, y, z})) {
          Fail(cudaErrorLaunchFailure, std::string("cuda-emu: kernel ") + kernel + ", block (" + std::to_string(x) + ", " + std::to_string(y) +
                                           ", " + std::to_string(z) + "): " + g_run.error);
          return;
        }
        if (StickyError() != cudaSuccess) {
          g_run.direct = false;
          return;
        }
        if (!g_run.direct && !g_run.barrier_seen && x + y + z == 0) {  // the first block needed no barrier
          g_barrier_free.insert(site);
          g_run.direct = true;
        }
      }
    }
  }
  g_run.direct = false;
}

}  // namespace fsdp::emu
