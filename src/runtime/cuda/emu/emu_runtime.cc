// cuda-emu's CUDA runtime (emu.h): device memory as checked host memory, streams as queues of
// deferred work, events as markers in them, the legacy default stream's implicit ordering, sticky
// errors. Only the calls fsdp-run makes are emulated.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include "runtime/cuda/emu/emu.h"

struct EmuOp;
struct CUstream_st {  // cudaStream_t points at one
  std::shared_ptr<EmuOp> last;
  bool blocking = true;  // ordered against the legacy default stream
  int id = 0;            // its entry in the vector clocks
  uint64_t issued = 0;   // ops issued on it so far
};
struct CUevent_st {  // cudaEvent_t points at one
  std::shared_ptr<EmuOp> marker;  // the latest record; null before the first
  bool timing = true;
};

// ops[stream id] issued on each stream that an op (or the host) is ordered after
using VectorClock = std::vector<uint64_t>;

struct EmuOp {
  std::function<void()> run;
  std::vector<std::shared_ptr<EmuOp>> deps;
  std::vector<fsdp::emu::Access> accesses;
  VectorClock clock;
  const char* what = "";
  int stream = 0;
  bool stuck = false;    // a collective whose communicator failed: never completes until released
  bool queried = false;  // an event query has found it not ready once
  bool done = false;
  double done_ms = 0;  // host time when it ran
};

namespace fsdp::emu {
namespace {

using OpPtr = std::shared_ptr<EmuOp>;

size_t EnvBytes(const char* name, size_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? static_cast<size_t>(std::strtoull(v, nullptr, 10)) : fallback;
}

// One access of an allocation, by an op identified by its stream and its place there.
struct Stamp {
  int stream = -1;
  uint64_t seq = 0;
  const char* what = "";
};

struct Allocation {
  size_t bytes = 0;
  Stamp writer;                       // the latest write
  std::map<int, Stamp> readers;       // since it: the latest read per stream
};

// Pinned host memory (cudaHostAlloc), page-aligned.
struct PinnedHost {
  size_t bytes = 0, mapped = 0;
  int pending_copies = 0;  // host-to-device copies issued from it that have not run
};

struct Context {
  std::recursive_mutex mutex;
  std::map<uintptr_t, Allocation> allocations;  // by base address
  std::map<uintptr_t, Allocation> blocks;       // caching-allocator blocks inside them (RegisterBlock), by base
  std::map<uintptr_t, PinnedHost> pinned;       // by base address
  size_t used_bytes = 0;
  const size_t total_bytes = EnvBytes("FSDP_EMU_DEVICE_BYTES", size_t{16} << 30);
  CUstream_st null_stream;
  int next_stream_id = 1;
  std::set<CUstream_st*> streams;  // live created streams
  std::set<CUevent_st*> events;
  VectorClock host;  // what the host has seen complete
  cudaError_t sticky = cudaSuccess, last = cudaSuccess;
  int device = 0;
  const std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
};
Context& C() {
  static Context* c = new Context;  // never destroyed: static destructors elsewhere may still call in
  return *c;
}

double NowMs() { return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - C().start).count(); }

void Merge(VectorClock& into, const VectorClock& from) {
  if (into.size() < from.size()) into.resize(from.size(), 0);
  for (size_t i = 0; i < from.size(); ++i) into[i] = std::max(into[i], from[i]);
}

bool OrderedBefore(const Stamp& a, const EmuOp& op) {
  return a.stream < 0 || (static_cast<size_t>(a.stream) < op.clock.size() && op.clock[a.stream] >= a.seq);
}

Allocation* AllocationOf(const void* p) {
  auto& b = C().blocks;
  if (auto it = b.upper_bound(reinterpret_cast<uintptr_t>(p)); it != b.begin()) {
    --it;
    if (reinterpret_cast<uintptr_t>(p) - it->first < it->second.bytes) return &it->second;
  }
  auto& a = C().allocations;
  auto it = a.upper_bound(reinterpret_cast<uintptr_t>(p));
  if (it == a.begin()) return nullptr;
  --it;
  return reinterpret_cast<uintptr_t>(p) - it->first <= it->second.bytes ? &it->second : nullptr;
}

void ReportRace(const EmuOp& op, const Allocation& a, const Stamp& other, bool other_writes, bool op_writes) {
  Fail(cudaErrorLaunchFailure,
       "cuda-emu: race: " + std::string(op.what) + " on stream " + std::to_string(op.stream) + (op_writes ? " writes" : " reads") + " a " +
           std::to_string(a.bytes) + "-byte allocation that " + other.what + " on stream " + std::to_string(other.stream) +
           (other_writes ? " wrote" : " read") + " with nothing ordering the two (a missing cudaStreamWaitEvent, or a buffer freed "
                                                 "for reuse while another stream still used it)");
}

// Checks `op`'s accesses against the allocations' earlier ones and records them.
void CheckAccesses(const EmuOp& op) {
  const Stamp self{op.stream, op.clock[op.stream], op.what};
  for (const Access& access : op.accesses) {
    Allocation* a = AllocationOf(access.p);
    if (a == nullptr) continue;  // checked at the call; freed since only after a synchronize
    if (!OrderedBefore(a->writer, op)) return ReportRace(op, *a, a->writer, true, access.write);
    if (!access.write) {
      a->readers[op.stream] = self;
      continue;
    }
    for (const auto& [stream, reader] : a->readers) {
      if (!OrderedBefore(reader, op)) return ReportRace(op, *a, reader, false, true);
    }
    a->readers.clear();
    a->writer = self;
  }
}

// Runs `target` after everything it depends on, depth first without recursion. False when it
// cannot complete: something it waits for is stuck (a failed collective).
bool Run(const OpPtr& target) {
  if (target == nullptr) return true;
  std::vector<EmuOp*> stack{target.get()};
  while (!stack.empty()) {
    EmuOp* op = stack.back();
    if (op->done) {
      stack.pop_back();
      continue;
    }
    if (op->stuck) return false;
    EmuOp* next = nullptr;
    for (const OpPtr& d : op->deps) {
      if (!d->done) {
        next = d.get();
        break;
      }
    }
    if (next != nullptr) {
      stack.push_back(next);
      continue;
    }
    op->done = true;
    if (C().sticky == cudaSuccess) CheckAccesses(*op);
    if (C().sticky == cudaSuccess && op->run) op->run();
    op->done_ms = NowMs();
    op->run = nullptr;
    op->deps.clear();
    op->accesses.clear();
    stack.pop_back();
  }
  return true;
}

// Runs `target` and tells the host it has completed (a synchronize). A wait behind a stuck
// collective would hang on a GPU; here it fails the context with a message.
void Wait(const OpPtr& target) {
  if (target == nullptr) return;
  if (!Run(target)) {
    Fail(cudaErrorLaunchFailure, "cuda-emu: the host waits for work behind a collective that cannot finish (its NCCL communicator failed): "
                                 "on a GPU this wait hangs; poll with cudaEventQuery and ncclCommGetAsyncError instead");
    return;
  }
  Merge(C().host, target->clock);
}

std::map<int, std::weak_ptr<EmuOp>> g_stuck;  // by id, until released
int g_next_stuck = 1;

CUstream_st* Resolve(cudaStream_t stream) { return stream == nullptr ? &C().null_stream : stream; }

// A new op at the end of `stream`, ordered as the legacy default stream orders blocking streams and
// after what the host has seen complete.
OpPtr Append(cudaStream_t stream, std::function<void()> run, const char* what = "an event or wait", std::vector<Access> accesses = {},
             const OpPtr& also_after = nullptr) {
  Context& c = C();
  CUstream_st* s = Resolve(stream);
  auto op = std::make_shared<EmuOp>();
  op->run = std::move(run);
  op->what = what;
  op->accesses = std::move(accesses);
  op->stream = s->id;
  op->clock = c.host;
  auto after = [&](const OpPtr& d) {
    if (d == nullptr) return;
    op->deps.push_back(d);
    Merge(op->clock, d->clock);
  };
  after(s->last);
  after(also_after);
  if (s == &c.null_stream) {
    for (CUstream_st* other : c.streams) {
      if (other->blocking) after(other->last);
    }
  } else if (s->blocking) {
    after(c.null_stream.last);
  }
  if (op->clock.size() <= static_cast<size_t>(s->id)) op->clock.resize(s->id + 1, 0);
  op->clock[s->id] = ++s->issued;
  s->last = op;
  return op;
}

// Device memory ends (rounded to 256 bytes, CUDA's alignment) at a page that faults: a kernel
// that reads or writes past an allocation crashes here instead of corrupting its neighbour.
size_t PageBytes() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }
size_t MappedBytes(size_t rounded) { return (rounded + PageBytes() - 1) / PageBytes() * PageBytes() + PageBytes(); }
void* MapGuarded(size_t rounded) {
  const size_t mapped = MappedBytes(rounded);
  void* m = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return nullptr;
  char* guard = static_cast<char*>(m) + mapped - PageBytes();
  mprotect(guard, PageBytes(), PROT_NONE);
  return guard - rounded;
}
void UnmapGuarded(void* p, size_t bytes) {
  const size_t rounded = (bytes + 255) / 256 * 256, mapped = MappedBytes(rounded);
  munmap(static_cast<char*>(p) + rounded + PageBytes() - mapped, mapped);
}

// A host-to-device copy from pinned memory reads it when it runs, as the GPU's DMA does; until then
// the pages are read-only, so a host write the copy would see faults, with a message, instead of
// silently changing what the device receives. The read-only ranges, for the fault handler:
constexpr int kMaxReadOnly = 256;
std::atomic<uintptr_t> g_read_only_begin[kMaxReadOnly], g_read_only_end[kMaxReadOnly];
struct sigaction g_previous_segv;

void OnSegv(int, siginfo_t* info, void*) {
  const auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
  for (int i = 0; i < kMaxReadOnly; ++i) {
    if (addr >= g_read_only_begin[i].load() && addr < g_read_only_end[i].load()) {
      static const char kMessage[] =
          "cuda-emu: the host wrote pinned memory that a cudaMemcpyAsync (host to device) issued earlier has not read yet "
          "(wait for the copy, e.g. an event recorded after it, before reusing the buffer)\n";
      (void)!write(STDERR_FILENO, kMessage, sizeof(kMessage) - 1);
      break;
    }
  }
  sigaction(SIGSEGV, &g_previous_segv, nullptr);  // the write faults again, under the previous handler
}

// At each cudaHostAlloc, unless it is already the handler: whoever replaced it (a test runner's
// handler, SIG_DFL) becomes the one the fault is passed on to.
void InstallPinnedFaultHandler() {
  struct sigaction current {};
  sigaction(SIGSEGV, nullptr, &current);
  if ((current.sa_flags & SA_SIGINFO) != 0 && current.sa_sigaction == OnSegv) return;
  struct sigaction action {};
  action.sa_sigaction = OnSegv;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;  // as a test runner's handler: a stack overflow still reaches it
  sigemptyset(&action.sa_mask);
  sigaction(SIGSEGV, &action, &g_previous_segv);
}

void SetReadOnlyRange(uintptr_t begin, uintptr_t end, bool read_only) {
  for (int i = 0; i < kMaxReadOnly; ++i) {
    const uintptr_t current = g_read_only_begin[i].load();
    if (read_only ? current == 0 : current == begin) {
      g_read_only_end[i] = read_only ? end : 0;
      g_read_only_begin[i] = read_only ? begin : 0;
      return;
    }
  }
  if (read_only) std::fprintf(stderr, "cuda-emu: more than %d pinned buffers wait for copies at once: a write to this one faults unnamed\n", kMaxReadOnly);
}

// Counts a copy from the pinned allocation at `base` issued (+1) or run or dropped (-1).
void TrackPendingCopy(uintptr_t base, int delta) {
  std::lock_guard<std::recursive_mutex> lock(C().mutex);
  auto it = C().pinned.find(base);
  if (it == C().pinned.end()) return;  // freed since
  PinnedHost& h = it->second;
  const bool was_read_only = h.pending_copies > 0;
  h.pending_copies += delta;
  const bool read_only = h.pending_copies > 0;
  if (was_read_only == read_only) return;
  mprotect(reinterpret_cast<void*>(base), h.mapped, read_only ? PROT_READ : PROT_READ | PROT_WRITE);
  SetReadOnlyRange(base, base + h.mapped, read_only);
}

// Lives as long as the copy's op holds its work: it is released once the work has run or been dropped.
struct PendingPinnedCopy {
  explicit PendingPinnedCopy(uintptr_t base) : base(base) { TrackPendingCopy(base, +1); }
  ~PendingPinnedCopy() { TrackPendingCopy(base, -1); }
  PendingPinnedCopy(const PendingPinnedCopy&) = delete;
  PendingPinnedCopy& operator=(const PendingPinnedCopy&) = delete;
  uintptr_t base;
};

// The pinned allocation `p` points into, or end().
std::map<uintptr_t, PinnedHost>::iterator PinnedOf(const void* p) {
  auto& pinned = C().pinned;
  auto it = pinned.upper_bound(reinterpret_cast<uintptr_t>(p));
  if (it == pinned.begin()) return pinned.end();
  --it;
  return reinterpret_cast<uintptr_t>(p) - it->first < it->second.bytes ? it : pinned.end();
}

bool KnownStream(cudaStream_t stream) { return stream == nullptr || C().streams.count(stream) > 0; }
bool KnownEvent(cudaEvent_t event) { return event != nullptr && C().events.count(event) > 0; }

// The error a call returns: the sticky one if any, else `code`, which also becomes the last error.
cudaError_t Return(cudaError_t code) {
  Context& c = C();
  if (c.sticky != cudaSuccess) return c.sticky;
  if (code != cudaSuccess) c.last = code;
  return code;
}

bool IsDeviceRangeLocked(const void* p, size_t bytes) {
  const auto& a = C().allocations;
  const auto addr = reinterpret_cast<uintptr_t>(p);
  auto it = a.upper_bound(addr);
  if (it == a.begin()) return false;
  --it;
  const uintptr_t offset = addr - it->first;  // upper_bound - 1: it->first <= addr
  return offset <= it->second.bytes && bytes <= it->second.bytes - offset;
}

}  // namespace

bool Enqueue(cudaStream_t stream, const char* what, std::function<void()> run, std::vector<Access> accesses) {
  std::lock_guard<std::recursive_mutex> lock(C().mutex);
  if (!KnownStream(stream)) {
    std::fprintf(stderr, "cuda-emu: %s on a stream that was destroyed or never created\n", what);
    C().last = cudaErrorInvalidResourceHandle;
    return false;
  }
  Append(stream, std::move(run), what, std::move(accesses));
  return true;
}

int EnqueueStuck(cudaStream_t stream, const char* what) {
  std::lock_guard<std::recursive_mutex> lock(C().mutex);
  OpPtr op = Append(stream, nullptr, what);
  op->stuck = true;
  g_stuck[g_next_stuck] = op;
  return g_next_stuck++;
}

int RunAfter(cudaStream_t stream, const char* what, const std::function<void()>& run, std::vector<Access> accesses, bool host_waits) {
  std::lock_guard<std::recursive_mutex> lock(C().mutex);
  if (!KnownStream(stream)) {
    std::fprintf(stderr, "cuda-emu: %s on a stream that was destroyed or never created\n", what);
    C().last = cudaErrorInvalidResourceHandle;
    return -1;
  }
  OpPtr op = Append(stream, run, what, std::move(accesses));
  if (host_waits) {
    Wait(op);
    return 0;
  }
  if (Run(op)) return 0;
  // behind a stuck collective: on a GPU it would wait there forever, so it never runs here either
  op->run = nullptr;
  op->accesses.clear();
  op->stuck = true;
  g_stuck[g_next_stuck] = op;
  return g_next_stuck++;
}

void ReleaseStuck(int id) {
  std::lock_guard<std::recursive_mutex> lock(C().mutex);
  auto it = g_stuck.find(id);
  if (it == g_stuck.end()) return;
  if (OpPtr op = it->second.lock()) op->stuck = false;  // completes, doing nothing, when next run
  g_stuck.erase(it);
}

void RunAll() {
  std::lock_guard<std::recursive_mutex> lock(C().mutex);
  Context& c = C();
  for (CUstream_st* s : c.streams) Wait(s->last);
  Wait(c.null_stream.last);
}

bool IsDeviceRange(const void* p, size_t bytes) {
  std::lock_guard<std::recursive_mutex> lock(C().mutex);
  return IsDeviceRangeLocked(p, bytes);
}

bool IsDevicePointer(const void* p) { return IsDeviceRange(p, 0); }

void RegisterBlock(const void* p, size_t bytes) {
  std::lock_guard<std::recursive_mutex> lock(C().mutex);
  auto& blocks = C().blocks;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p), end = begin + bytes;
  Allocation merged;
  merged.bytes = bytes;
  bool first = true;
  auto it = blocks.upper_bound(begin);
  if (it != blocks.begin() && std::prev(it)->first + std::prev(it)->second.bytes > begin) --it;
  while (it != blocks.end() && it->first < end) {
    // the latest writer of the first overlapped block stays the writer; the others' writers
    // become readers, so that a write must still come after them
    const Allocation& old = it->second;
    if (first) merged.writer = old.writer;
    else if (old.writer.stream >= 0) merged.readers[old.writer.stream] = old.writer;
    for (const auto& [stream, reader] : old.readers) {
      auto& r = merged.readers[stream];
      if (r.stream < 0 || reader.seq > r.seq) r = reader;
    }
    first = false;
    it = blocks.erase(it);
  }
  blocks[begin] = std::move(merged);
}

void Fail(cudaError_t code, const std::string& message) {
  std::lock_guard<std::recursive_mutex> lock(C().mutex);
  std::fprintf(stderr, "%s\n", message.c_str());
  if (C().sticky == cudaSuccess) C().sticky = code;
}

cudaError_t StickyError() { return C().sticky; }

void SetLastError(cudaError_t code) { C().last = code; }

}  // namespace fsdp::emu

using fsdp::emu::C;

#define EMU_LOCK std::lock_guard<std::recursive_mutex> emu_lock(C().mutex)

extern "C" {

// ---- errors and devices
cudaError_t cudaGetLastError() {
  EMU_LOCK;
  if (C().sticky != cudaSuccess) return C().sticky;
  const cudaError_t code = C().last;
  C().last = cudaSuccess;
  return code;
}

cudaError_t cudaPeekAtLastError() {
  EMU_LOCK;
  return C().sticky != cudaSuccess ? C().sticky : C().last;
}

const char* cudaGetErrorString(cudaError_t code) {
  switch (code) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    default: return "cuda-emu: an error this emulation does not name";
  }
}

cudaError_t cudaGetDeviceCount(int* count) {
  *count = static_cast<int>(fsdp::emu::EnvBytes("FSDP_EMU_DEVICES", 8));
  return *count > 0 ? cudaSuccess : fsdp::emu::Return(cudaErrorNoDevice);
}

cudaError_t cudaSetDevice(int device) {
  EMU_LOCK;
  int count = 0;
  cudaGetDeviceCount(&count);
  if (device < 0 || device >= count) return fsdp::emu::Return(cudaErrorInvalidDevice);
  C().device = device;
  return fsdp::emu::Return(cudaSuccess);
}

cudaError_t cudaGetDevice(int* device) {
  EMU_LOCK;
  *device = C().device;
  return fsdp::emu::Return(cudaSuccess);
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  EMU_LOCK;
  int count = 0;
  cudaGetDeviceCount(&count);
  if (device < 0 || device >= count) return fsdp::emu::Return(cudaErrorInvalidDevice);
  std::memset(prop, 0, sizeof(*prop));
  const char* name = std::getenv("FSDP_EMU_DEVICE_NAME");
  std::snprintf(prop->name, sizeof(prop->name), "%s", name != nullptr ? name : "NVIDIA H200 (cuda-emu: host emulation, no GPU)");
  prop->totalGlobalMem = C().total_bytes;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 132;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  return fsdp::emu::Return(cudaSuccess);
}

cudaError_t cudaDeviceSynchronize() {
  EMU_LOCK;
  fsdp::emu::RunAll();
  return fsdp::emu::Return(cudaSuccess);
}

// Drops pending work, frees every allocation and forgets every stream and event (their handles
// become invalid), and clears the sticky error: cudaDeviceReset's effect on the context.
cudaError_t cudaDeviceReset() {
  EMU_LOCK;
  fsdp::emu::Context& c = C();
  std::vector<fsdp::emu::OpPtr> pending;  // released without recursion: a long chain would overflow the stack
  for (CUstream_st* s : c.streams) {
    pending.push_back(std::move(s->last));
    delete s;
  }
  pending.push_back(std::move(c.null_stream.last));
  for (CUevent_st* e : c.events) {
    pending.push_back(std::move(e->marker));
    delete e;
  }
  while (!pending.empty()) {
    fsdp::emu::OpPtr op = std::move(pending.back());
    pending.pop_back();
    if (op != nullptr && op.use_count() == 1) {
      for (fsdp::emu::OpPtr& d : op->deps) pending.push_back(std::move(d));
      op->deps.clear();
    }
  }
  for (const auto& [base, allocation] : c.allocations) fsdp::emu::UnmapGuarded(reinterpret_cast<void*>(base), allocation.bytes);
  c.allocations.clear();
  c.streams.clear();
  c.events.clear();
  c.used_bytes = 0;
  c.host.clear();
  c.sticky = c.last = cudaSuccess;
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  EMU_LOCK;
  *total_bytes = C().total_bytes;
  *free_bytes = C().total_bytes - C().used_bytes;
  return fsdp::emu::Return(cudaSuccess);
}

// ---- memory
cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  EMU_LOCK;
  *ptr = nullptr;
  if (C().sticky != cudaSuccess) return C().sticky;
  if (bytes == 0) return cudaSuccess;
  const size_t rounded = (bytes + 255) / 256 * 256;
  if (rounded > C().total_bytes - C().used_bytes) return fsdp::emu::Return(cudaErrorMemoryAllocation);
  void* p = fsdp::emu::MapGuarded(rounded);
  if (p == nullptr) return fsdp::emu::Return(cudaErrorMemoryAllocation);
  std::memset(p, 0xFF, rounded);  // NaN in fp32, bf16 and fp16: unwritten memory shows in the results
  C().allocations[reinterpret_cast<uintptr_t>(p)].bytes = bytes;
  C().used_bytes += rounded;
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  EMU_LOCK;
  fsdp::emu::RunAll();  // cudaFree synchronizes the device
  if (ptr == nullptr) return fsdp::emu::Return(cudaSuccess);
  auto it = C().allocations.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == C().allocations.end()) return fsdp::emu::Return(cudaErrorInvalidValue);
  C().used_bytes -= (it->second.bytes + 255) / 256 * 256;
  const uintptr_t base = it->first;
  auto& blocks = C().blocks;
  blocks.erase(blocks.lower_bound(base), blocks.lower_bound(base + it->second.bytes));
  fsdp::emu::UnmapGuarded(ptr, it->second.bytes);
  C().allocations.erase(it);
  return fsdp::emu::Return(cudaSuccess);
}

cudaError_t cudaHostAlloc(void** ptr, size_t bytes, unsigned int /*flags*/) {
  EMU_LOCK;
  *ptr = nullptr;
  if (C().sticky != cudaSuccess) return C().sticky;
  if (bytes == 0) return cudaSuccess;
  const size_t mapped = (bytes + fsdp::emu::PageBytes() - 1) / fsdp::emu::PageBytes() * fsdp::emu::PageBytes();
  void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return fsdp::emu::Return(cudaErrorMemoryAllocation);
  fsdp::emu::InstallPinnedFaultHandler();
  C().pinned[reinterpret_cast<uintptr_t>(p)] = fsdp::emu::PinnedHost{bytes, mapped, 0};
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void** ptr, size_t bytes) { return cudaHostAlloc(ptr, bytes, cudaHostAllocDefault); }

cudaError_t cudaFreeHost(void* ptr) {
  EMU_LOCK;
  fsdp::emu::RunAll();  // as cudaFree: the copies reading it complete first
  if (ptr == nullptr) return fsdp::emu::Return(cudaSuccess);
  auto it = C().pinned.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == C().pinned.end()) return fsdp::emu::Return(cudaErrorInvalidValue);
  if (it->second.pending_copies > 0) fsdp::emu::SetReadOnlyRange(it->first, it->first + it->second.mapped, false);  // behind a stuck collective
  munmap(ptr, it->second.mapped);
  C().pinned.erase(it);
  return fsdp::emu::Return(cudaSuccess);
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream) {
  EMU_LOCK;
  using fsdp::emu::IsDeviceRangeLocked;
  if (C().sticky != cudaSuccess) return C().sticky;
  if (!fsdp::emu::KnownStream(stream)) return fsdp::emu::Return(cudaErrorInvalidResourceHandle);
  if (bytes == 0) return cudaSuccess;
  const bool dst_device = IsDeviceRangeLocked(dst, bytes), src_device = IsDeviceRangeLocked(src, bytes);
  const bool ok = kind == cudaMemcpyHostToDevice ? dst_device && !fsdp::emu::IsDevicePointer(src)
                  : kind == cudaMemcpyDeviceToHost ? src_device && !fsdp::emu::IsDevicePointer(dst)
                  : kind == cudaMemcpyDeviceToDevice ? dst_device && src_device
                                                     : false;  // host-to-host and default are not emulated
  if (!ok) {
    std::fprintf(stderr, "cuda-emu: cudaMemcpyAsync of %zu bytes (kind %d): a buffer is not where the kind says or overruns its allocation\n", bytes,
                 static_cast<int>(kind));
    return fsdp::emu::Return(cudaErrorInvalidValue);
  }
  if (kind == cudaMemcpyDeviceToHost) {  // pageable host memory: returns once the copy is done
    fsdp::emu::RunAfter(stream, "cudaMemcpyAsync (device to host)", [=] { std::memcpy(dst, src, bytes); }, {{src, false}}, true);
  } else if (const auto pinned = fsdp::emu::PinnedOf(src); kind == cudaMemcpyHostToDevice && pinned != C().pinned.end()) {  // read when it runs
    if (static_cast<const char*>(src) + bytes > reinterpret_cast<const char*>(pinned->first) + pinned->second.bytes) {
      std::fprintf(stderr, "cuda-emu: cudaMemcpyAsync of %zu bytes overruns its pinned host allocation\n", bytes);
      return fsdp::emu::Return(cudaErrorInvalidValue);
    }
    auto pending = std::make_shared<fsdp::emu::PendingPinnedCopy>(pinned->first);
    fsdp::emu::Append(stream, [=] { std::memcpy(dst, src, bytes); (void)pending; }, "cudaMemcpyAsync (pinned host to device)", {{dst, true}});
  } else if (kind == cudaMemcpyHostToDevice) {  // pageable host memory is staged at the call
    auto staged = std::make_shared<std::vector<char>>(static_cast<const char*>(src), static_cast<const char*>(src) + bytes);
    fsdp::emu::Append(stream, [=] { std::memcpy(dst, staged->data(), bytes); }, "cudaMemcpyAsync (host to device)", {{dst, true}});
  } else {
    fsdp::emu::Append(stream, [=] { std::memmove(dst, src, bytes); }, "cudaMemcpyAsync (device to device)", {{src, false}, {dst, true}});
  }
  return fsdp::emu::Return(cudaSuccess);
}

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream) {
  EMU_LOCK;
  if (C().sticky != cudaSuccess) return C().sticky;
  if (!fsdp::emu::KnownStream(stream)) return fsdp::emu::Return(cudaErrorInvalidResourceHandle);
  if (bytes == 0) return cudaSuccess;
  if (!fsdp::emu::IsDeviceRangeLocked(ptr, bytes)) {
    std::fprintf(stderr, "cuda-emu: cudaMemsetAsync of %zu bytes outside a device allocation\n", bytes);
    return fsdp::emu::Return(cudaErrorInvalidValue);
  }
  fsdp::emu::Append(stream, [=] { std::memset(ptr, value, bytes); }, "cudaMemsetAsync", {{ptr, true}});
  return fsdp::emu::Return(cudaSuccess);
}

// ---- streams
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  EMU_LOCK;
  auto* s = new CUstream_st;
  s->blocking = (flags & cudaStreamNonBlocking) == 0;
  s->id = C().next_stream_id++;
  C().streams.insert(s);
  *stream = s;
  return fsdp::emu::Return(cudaSuccess);
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) { return cudaStreamCreateWithFlags(stream, cudaStreamDefault); }

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  EMU_LOCK;
  if (stream == nullptr || C().streams.erase(stream) == 0) return fsdp::emu::Return(cudaErrorInvalidResourceHandle);
  fsdp::emu::Run(stream->last);  // the stream's pending work still runs (here, now)
  delete stream;
  return fsdp::emu::Return(cudaSuccess);
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  EMU_LOCK;
  if (!fsdp::emu::KnownStream(stream)) return fsdp::emu::Return(cudaErrorInvalidResourceHandle);
  if (stream == nullptr) {
    fsdp::emu::Wait(fsdp::emu::Append(nullptr, nullptr));  // the default stream's work and the blocking streams' before it
  } else {
    fsdp::emu::Wait(stream->last);
  }
  return fsdp::emu::Return(cudaSuccess);
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int /*flags*/) {
  EMU_LOCK;
  if (!fsdp::emu::KnownStream(stream) || !fsdp::emu::KnownEvent(event)) return fsdp::emu::Return(cudaErrorInvalidResourceHandle);
  if (event->marker == nullptr) return fsdp::emu::Return(cudaSuccess);  // never recorded: nothing to wait for
  fsdp::emu::Append(stream, nullptr, "cudaStreamWaitEvent", {}, event->marker);
  return fsdp::emu::Return(cudaSuccess);
}

// ---- events
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  EMU_LOCK;
  auto* e = new CUevent_st;
  e->timing = (flags & cudaEventDisableTiming) == 0;
  C().events.insert(e);
  *event = e;
  return fsdp::emu::Return(cudaSuccess);
}

cudaError_t cudaEventCreate(cudaEvent_t* event) { return cudaEventCreateWithFlags(event, cudaEventDefault); }

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  EMU_LOCK;
  if (event == nullptr || C().events.erase(event) == 0) return fsdp::emu::Return(cudaErrorInvalidResourceHandle);
  delete event;  // a stream waiting on it keeps its marker
  return fsdp::emu::Return(cudaSuccess);
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  EMU_LOCK;
  if (!fsdp::emu::KnownStream(stream) || !fsdp::emu::KnownEvent(event)) return fsdp::emu::Return(cudaErrorInvalidResourceHandle);
  event->marker = fsdp::emu::Append(stream, nullptr, "cudaEventRecord");
  return fsdp::emu::Return(cudaSuccess);
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  EMU_LOCK;
  if (!fsdp::emu::KnownEvent(event)) return fsdp::emu::Return(cudaErrorInvalidResourceHandle);
  // A recorded event is not ready the first time it is queried (the GPU is still busy), then the
  // work it waits for runs: a polling loop ends, one query alone sees the work still pending.
  fsdp::emu::OpPtr marker = event->marker;
  if (marker == nullptr) return fsdp::emu::Return(cudaSuccess);
  if (!marker->done && (!marker->queried || !fsdp::emu::Run(marker))) {
    marker->queried = true;
    return fsdp::emu::Return(cudaErrorNotReady);
  }
  fsdp::emu::Merge(C().host, marker->clock);  // the host has seen it complete
  return fsdp::emu::Return(cudaSuccess);
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  EMU_LOCK;
  if (!fsdp::emu::KnownEvent(event)) return fsdp::emu::Return(cudaErrorInvalidResourceHandle);
  fsdp::emu::Wait(event->marker);
  return fsdp::emu::Return(cudaSuccess);
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  EMU_LOCK;
  if (!fsdp::emu::KnownEvent(start) || !fsdp::emu::KnownEvent(end)) return fsdp::emu::Return(cudaErrorInvalidResourceHandle);
  if (!start->timing || !end->timing || start->marker == nullptr || end->marker == nullptr) {
    std::fprintf(stderr, "cuda-emu: cudaEventElapsedTime on an event created with cudaEventDisableTiming or never recorded\n");
    return fsdp::emu::Return(cudaErrorInvalidResourceHandle);
  }
  if (!start->marker->done || !end->marker->done) return fsdp::emu::Return(cudaErrorNotReady);
  *ms = static_cast<float>(end->marker->done_ms - start->marker->done_ms);
  return fsdp::emu::Return(cudaSuccess);
}

}  // extern "C"
