// cuda_kernels.cu compiled as host C++ for cuda-emu (emu.h): the same kernels, launched through
// FSDP_LAUNCH's emulated form (cuda_launch.h, FSDP_CUDA_EMU).
#include "runtime/cuda/cuda_kernels.cu"
