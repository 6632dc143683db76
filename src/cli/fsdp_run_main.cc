// fsdp-run: train an FSDP configuration for real on CPU ranks (one process, or mpirun -np N) and
// report the losses and step times (thin main; the engine is src/runtime).
#include <chrono>
#include <cstdlib>
#include <malloc.h>
#include <thread>
#include <memory>

#include <fmt/format.h>
#include <iostream>

#include "cli/cli_util.h"
#include "cli/run_cli.h"

#ifdef FSDP_HAVE_MPI
#include <mpi.h>
#endif

namespace {

// Started by mpirun / srun: OpenMPI and PMI set these.
bool LaunchedByMpi() { return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr; }

}  // namespace

int main(int argc, char** argv) {
  // Keep freed buffers in the heap instead of returning them to the kernel, as a GPU caching
  // allocator does: otherwise every step's unsharded buffers are fresh mmaps whose pages the
  // kernel zeroes again (a sixth of a llama-100m step on this machine).
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  CLI::App app{"fsdp-run: train an FSDP configuration on CPU ranks (single process, or under mpirun -np N) and report losses and step times."};
  fsdp::RunFlags flags;
  fsdp::AddRunFlags(app, flags);
  fsdp::RunFlags calibrate_flags;
  CLI::App* calibrate = app.add_subcommand("calibrate", "measure this machine (GEMM FLOP/s, memory bandwidth, collectives) into a hardware JSON (--out)");
  fsdp::AddRunFlags(*calibrate, calibrate_flags);
  if (int code = fsdp::ParseOrExitCode(app, argc, argv, "fsdp-run"); code >= 0) return code;
  fsdp::StartRunDeadline(calibrate->parsed() ? calibrate_flags.timeout_s : flags.timeout_s);
  if (calibrate->parsed()) {
    fsdp::FinishPlanFlags(*calibrate, calibrate_flags.plan);
    if (calibrate_flags.plan.model.empty()) calibrate_flags.plan.model = "tiny-llama";
  }
  fsdp::FinishPlanFlags(app, flags.plan);
  if (flags.plan.model.empty()) flags.plan.model = "tiny-llama";
  if (!flags.plan.gpus_given) flags.plan.config.gpus = 1;
  std::unique_ptr<fsdp::runtime::Comm> comm;
  const bool mpi = LaunchedByMpi();
#ifdef FSDP_HAVE_MPI
  if (mpi) MPI_Init(&argc, &argv);
#endif
  if (mpi) {
    auto c = fsdp::runtime::MakeMpiComm();
    if (!c.ok()) return fsdp::ReportError("fsdp-run", c.error());
    comm = std::move(c).value();
    if (!flags.plan.gpus_given) flags.plan.config.gpus = comm->size();
  } else {
    comm = fsdp::runtime::MakeSingleComm();
  }
  fsdp::Status status = calibrate->parsed() ? fsdp::RunCalibrate(calibrate_flags, *comm, std::cout) : fsdp::RunTraining(flags, *comm, std::cout);
  int code = status.ok() ? fsdp::kExitOk : fsdp::ReportError(fmt::format("fsdp-run (rank {})", comm->rank()), status.error());
#ifdef FSDP_HAVE_MPI
  if (mpi) {
    comm.reset();
    if (code != 0) {
      // give ranks that hit the same error time to print it, then stop every rank instead of
      // leaving some waiting in a collective
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      MPI_Abort(MPI_COMM_WORLD, code);
    }
    MPI_Finalize();
  }
#endif
  return code;
}
