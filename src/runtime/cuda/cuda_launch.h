// FSDP_LAUNCH(kernel, grid, block, stream)(args...): a kernel launch, kernel<<<grid, block, 0,
// stream>>>(args...) under nvcc; in the cuda-emu test build (FSDP_CUDA_EMU, emu/emu.h) the same
// launch enqueued on the host emulation, where the kernels compile as host C++.
#pragma once

#if defined(FSDP_CUDA_EMU)
#include "runtime/cuda/emu/emu_device.h"
#else
#define FSDP_LAUNCH(kernel, grid, block, stream) kernel<<<(grid), (block), 0, (stream)>>>
#endif
