// Kernel launches of the ORT custom ops: programmatic dependent launches (sm_90+), shared by the GEMV
// and attention kernels.
//
// A kernel launched as a programmatic dependent may start while the kernel before it in the stream
// still runs: it must call wait_for_previous_kernel() before reading anything an earlier kernel
// writes (after the wait, every earlier kernel has finished and its writes are visible). Only
// constant data (weights, tables) may be read before it.
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>

namespace enginesmith {

__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel in the stream start launching now (a no-op unless it is a dependent launch).
__device__ __forceinline__ void allow_next_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether launches from kernels created now are programmatic dependents: the device is sm_90+ and
// ES_ORT_OPS_PDL is not "0". Read at kernel creation (outside any capture), so a benchmark can compare
// both settings in one process.
inline bool dependent_launches_enabled() {
  static const bool sm90 = [] {
    int device = 0, major = 0;
    const bool ok = cudaGetDevice(&device) == cudaSuccess &&
                    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess;
    (void)cudaGetLastError();
    return ok && major >= 9;
  }();
  const char* env = std::getenv("ES_ORT_OPS_PDL");
  return sm90 && !(env && std::strcmp(env, "0") == 0);
}

template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, int threads, size_t smem, cudaStream_t stream,
                          bool dependent, Args... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = dependent ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

}  // namespace enginesmith
