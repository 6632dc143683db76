// cuda-emu's NCCL (emu.h): communicators and the three collectives fsdp-run calls. A one-rank
// communicator's collectives are stream work like any other (deferred until waited for). With more
// ranks, each rank is a process with its own emulated GPU and the collective runs over MPI when it
// is issued, after the stream's earlier work: issue order is then execution order, the same on every
// rank, as NCCL requires of the program. bf16 and fp16 sums round after every addition, as NCCL's
// reduction kernels do; buffers are checked against their allocations.
#include <climits>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <nccl.h>
#ifdef FSDP_HAVE_MPI
#include <mpi.h>
#endif

#include "runtime/cuda/emu/emu.h"

struct ncclComm {  // ncclComm_t points at one
  int rank = 0, nranks = 1;
  int issued = 0;                          // collectives issued on it
  ncclResult_t async_error = ncclSuccess;  // what ncclCommGetAsyncError reports
  std::vector<int> stuck;                  // its collectives that cannot finish (emu.h EnqueueStuck)
#ifdef FSDP_HAVE_MPI
  MPI_Comm mpi = MPI_COMM_NULL;
#endif
};

namespace fsdp::emu {
namespace {

std::string g_last_error;

ncclResult_t Failed(ncclResult_t code, const std::string& message) {
  g_last_error = "cuda-emu: " + message;
  std::fprintf(stderr, "%s\n", g_last_error.c_str());
  return code;
}

size_t TypeBytes(ncclDataType_t t) { return t == ncclFloat32 ? 4 : 2; }
bool Emulated(ncclDataType_t t) { return t == ncclFloat32 || t == ncclBfloat16 || t == ncclFloat16; }

ncclResult_t CheckBuffers(const void* send, size_t send_bytes, const void* recv, size_t recv_bytes, ncclDataType_t type, ncclComm_t comm,
                          const char* what) {
  if (comm == nullptr) return Failed(ncclInvalidArgument, std::string(what) + ": null communicator");
  if (!Emulated(type)) return Failed(ncclInvalidArgument, std::string(what) + ": a data type this emulation does not implement");
  if (StickyError() != cudaSuccess) return ncclUnhandledCudaError;
  if ((send_bytes > 0 && !IsDeviceRange(send, send_bytes)) || (recv_bytes > 0 && !IsDeviceRange(recv, recv_bytes))) {
    return Failed(ncclInvalidArgument, std::string(what) + ": a buffer is not inside one device allocation");
  }
  if (send_bytes > INT_MAX || recv_bytes > INT_MAX) return Failed(ncclInvalidArgument, std::string(what) + ": more than 2 GiB (not emulated)");
  return ncclSuccess;
}

#ifdef FSDP_HAVE_MPI
template <typename T, float (*ToF)(T), T (*FromF)(float)>
void RoundedSum(void* in, void* inout, int* len, MPI_Datatype*) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = FromF(ToF(a[i]) + ToF(b[i]));
}
float Bf16ToF(__nv_bfloat16 x) { return __bfloat162float(x); }
__nv_bfloat16 FToBf16(float x) { return __float2bfloat16_rn(x); }
float HalfToF(__half x) { return __half2float(x); }
__half FToHalf(float x) { return __float2half_rn(x); }

// The MPI element type and sum of an NCCL type.
std::pair<MPI_Datatype, MPI_Op> SumOf(ncclDataType_t t) {
  static MPI_Op bf16 = MPI_OP_NULL, fp16 = MPI_OP_NULL;
  if (t == ncclFloat32) return {MPI_FLOAT, MPI_SUM};
  MPI_Op& op = t == ncclBfloat16 ? bf16 : fp16;
  if (op == MPI_OP_NULL) {
    MPI_Op_create(t == ncclBfloat16 ? &RoundedSum<__nv_bfloat16, Bf16ToF, FToBf16> : &RoundedSum<__half, HalfToF, FToHalf>, 1, &op);
  }
  return {MPI_UINT16_T, op};
}
#endif

enum class Kind { kAllGather, kReduceScatter, kAllReduce };

// What a deferred collective needs of its communicator, by value: the op may run after the
// communicator is destroyed or aborted.
struct Group {
  int nranks = 1;
#ifdef FSDP_HAVE_MPI
  MPI_Comm mpi = MPI_COMM_NULL;
#endif
};

Group GroupOf(ncclComm_t comm) {
  Group g;
  g.nranks = comm->nranks;
#ifdef FSDP_HAVE_MPI
  g.mpi = comm->mpi;
#endif
  return g;
}

// Runs one collective on this rank's buffers (host memory here): `count` is NCCL's count argument.
void Collective(Kind kind, const void* send, void* recv, size_t count, ncclDataType_t type, const Group& group) {
  const size_t e = TypeBytes(type), n = static_cast<size_t>(group.nranks);
  const size_t in_bytes = kind == Kind::kReduceScatter ? count * n * e : count * e;
  const size_t out_bytes = kind == Kind::kAllGather ? count * n * e : count * e;
  std::vector<char> in(static_cast<const char*>(send), static_cast<const char*>(send) + in_bytes), out(out_bytes);
  if (n == 1) {
    std::memcpy(out.data(), in.data(), out_bytes);
  } else {
#ifdef FSDP_HAVE_MPI
    const auto [mpi_type, sum] = SumOf(type);
    const int elements = static_cast<int>(count);
    if (kind == Kind::kAllGather) {
      MPI_Allgather(in.data(), static_cast<int>(in_bytes), MPI_BYTE, out.data(), static_cast<int>(in_bytes), MPI_BYTE, group.mpi);
    } else if (kind == Kind::kReduceScatter) {
      MPI_Reduce_scatter_block(in.data(), out.data(), elements, mpi_type, sum, group.mpi);
    } else {
      MPI_Allreduce(in.data(), out.data(), elements, mpi_type, sum, group.mpi);
    }
#endif
  }
  std::memcpy(recv, out.data(), out_bytes);
}

// Whether the collective now issued on `comm` is the one FSDP_EMU_NCCL_FAIL_AFTER says fails.
bool InjectedFailure(ncclComm_t comm) {
  const char* after = std::getenv("FSDP_EMU_NCCL_FAIL_AFTER");
  return ++comm->issued == (after != nullptr ? std::atoi(after) + 1 : 0);
}

ncclResult_t Issue(Kind kind, const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream,
                   const char* what) {
  const size_t e = TypeBytes(type), n = comm != nullptr ? static_cast<size_t>(comm->nranks) : 1;
  const size_t in_bytes = kind == Kind::kReduceScatter ? count * n * e : count * e;
  const size_t out_bytes = kind == Kind::kAllGather ? count * n * e : count * e;
  if (ncclResult_t r = CheckBuffers(send, in_bytes, recv, out_bytes, type, comm, what); r != ncclSuccess) return r;
  if (kind != Kind::kAllGather && op != ncclSum) return Failed(ncclInvalidArgument, std::string(what) + ": only ncclSum is emulated");
  if (count == 0) return ncclSuccess;
  if (InjectedFailure(comm) || comm->async_error != ncclSuccess) {
    comm->async_error = ncclRemoteError;
    g_last_error = "cuda-emu: injected by FSDP_EMU_NCCL_FAIL_AFTER";
    comm->stuck.push_back(EnqueueStuck(stream, what));
    return ncclSuccess;  // as NCCL: the failure shows asynchronously
  }
  auto run = [=, group = GroupOf(comm)] { Collective(kind, send, recv, count, type, group); };
  std::vector<Access> accesses = {{send, false}, {recv, true}};
  if (comm->nranks == 1) return Enqueue(stream, what, run, std::move(accesses)) ? ncclSuccess : ncclUnhandledCudaError;
  // run at the call: every rank issues its collectives in the same order, so MPI matches them; one
  // behind a failed collective never runs, as it would never start on a GPU, and ncclCommAbort ends it
  const int ran = RunAfter(stream, what, run, std::move(accesses), false);
  if (ran < 0) return ncclUnhandledCudaError;
  if (ran > 0) comm->stuck.push_back(ran);
  return ncclSuccess;
}

}  // namespace
}  // namespace fsdp::emu

extern "C" {

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    default: return "cuda-emu: an NCCL result this emulation does not name";
  }
}

const char* ncclGetLastError(ncclComm_t) { return fsdp::emu::g_last_error.c_str(); }

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  std::random_device device;
  for (char& c : id->internal) c = static_cast<char>(device());
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  *comm = nullptr;
  if (nranks < 1 || rank < 0 || rank >= nranks) return fsdp::emu::Failed(ncclInvalidArgument, "ncclCommInitRank: rank outside [0, nranks)");
  auto* c = new ncclComm;
  c->rank = rank;
  c->nranks = nranks;
  if (nranks > 1) {
#ifdef FSDP_HAVE_MPI
    int initialized = 0, world = 0;
    MPI_Initialized(&initialized);
    if (initialized) MPI_Comm_size(MPI_COMM_WORLD, &world);
    if (world != nranks) {
      delete c;
      return fsdp::emu::Failed(ncclInvalidUsage, "ncclCommInitRank: the emulation makes communicators of every MPI rank only");
    }
    MPI_Comm_split(MPI_COMM_WORLD, 0, rank, &c->mpi);
    char first[NCCL_UNIQUE_ID_BYTES];  // every rank must have been given rank 0's id
    std::memcpy(first, id.internal, sizeof(first));
    MPI_Bcast(first, sizeof(first), MPI_BYTE, 0, c->mpi);
    int same = std::memcmp(first, id.internal, sizeof(first)) == 0, all_same = 0;
    MPI_Allreduce(&same, &all_same, 1, MPI_INT, MPI_LAND, c->mpi);
    if (!all_same) {
      MPI_Comm_free(&c->mpi);
      delete c;
      return fsdp::emu::Failed(ncclInvalidArgument, "ncclCommInitRank: the ranks were given different unique ids");
    }
#else
    delete c;
    return fsdp::emu::Failed(ncclInvalidUsage, "ncclCommInitRank: communicators of more than one rank need MPI, which this build lacks");
#endif
  }
  *comm = c;
  return ncclSuccess;
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t*) {
  *newcomm = nullptr;
  if (comm == nullptr) return fsdp::emu::Failed(ncclInvalidArgument, "ncclCommSplit: null communicator");
  if (comm->nranks == 1) {
    if (color != NCCL_SPLIT_NOCOLOR) *newcomm = new ncclComm;
    return ncclSuccess;
  }
#ifdef FSDP_HAVE_MPI
  MPI_Comm sub = MPI_COMM_NULL;
  MPI_Comm_split(comm->mpi, color == NCCL_SPLIT_NOCOLOR ? MPI_UNDEFINED : color, key, &sub);
  if (sub == MPI_COMM_NULL) return ncclSuccess;
  auto* c = new ncclComm;
  c->mpi = sub;
  MPI_Comm_rank(sub, &c->rank);
  MPI_Comm_size(sub, &c->nranks);
  *newcomm = c;
#endif
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (comm == nullptr) return ncclInvalidArgument;
#ifdef FSDP_HAVE_MPI
  if (comm->mpi != MPI_COMM_NULL) MPI_Comm_free(&comm->mpi);
#endif
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;
  for (int id : comm->stuck) fsdp::emu::ReleaseStuck(id);  // its kernels end, as an abort ends them
  delete comm;  // peers may be gone: its MPI communicator is left to MPI_Finalize
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* error) {
  if (comm == nullptr) return ncclInvalidArgument;
  *error = comm->async_error;
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  if (comm == nullptr) return ncclInvalidArgument;
  *count = comm->nranks;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  if (comm == nullptr) return ncclInvalidArgument;
  *rank = comm->rank;
  return ncclSuccess;
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t count, ncclDataType_t type, ncclComm_t comm, cudaStream_t stream) {
  return fsdp::emu::Issue(fsdp::emu::Kind::kAllGather, send, recv, count, type, ncclSum, comm, stream, "ncclAllGather");
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return fsdp::emu::Issue(fsdp::emu::Kind::kReduceScatter, send, recv, count, type, op, comm, stream, "ncclReduceScatter");
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return fsdp::emu::Issue(fsdp::emu::Kind::kAllReduce, send, recv, count, type, op, comm, stream, "ncclAllReduce");
}

}  // extern "C"
