// The GPU entry points of a build without the CUDA toolkit: every one says so.
#include "runtime/gpu_engine.h"

namespace fsdp::runtime {
namespace {

Error NotBuilt() {
  return Error::RunFailed(
      "fsdp-run was built without the CUDA backend (CMake found no CUDA toolkit with cuBLAS and NCCL; rebuild with -DFSDP_WITH_CUDA=ON "
      "where nvcc is installed)");
}

}  // namespace

bool GpuBackendBuilt() { return false; }
Result<int> GpuDeviceCount() { return NotBuilt(); }
Result<std::string> GpuDeviceName(int) { return NotBuilt(); }
int GpuDeviceOfRank(int rank, int devices) { return devices > 0 ? rank % devices : 0; }
Result<std::unique_ptr<GpuEngine>> CreateGpuEngine(const Workload&, Comm&, const TrainOptions&, int) { return NotBuilt(); }
Result<Json> CalibrateGpu(const ModelSpec&, Comm&, const Json&, DType, int64_t, int64_t, int, int64_t) { return NotBuilt(); }

}  // namespace fsdp::runtime
