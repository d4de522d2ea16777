// The rotary embedding of the attention ops (GroupQueryAttention, PagedGroupQueryAttention): the
// half-split rotation (pairs x[i], x[i + D/2], not interleaved) of com.microsoft's GroupQueryAttention
// with do_rotary=1, rounded to fp16 as the cache stores it. One definition for the CUDA kernels and
// the CPU references, so both round alike.
#pragma once

#include <cuda_fp16.h>

namespace enginesmith {

__host__ __device__ __forceinline__ float round_half(float v) { return __half2float(__float2half_rn(v)); }

// The rotation of the pair (x1, x2) = (x[i], x[i + D/2]) at a position with (cos, sin), rounded to
// fp16. No fused multiply-add on either side, so host and device round alike.
__host__ __device__ __forceinline__ void rotate(float x1, float x2, float c, float s, float& y1, float& y2) {
#ifdef __CUDA_ARCH__
  y1 = round_half(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
  y2 = round_half(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
#else
  const float a = x1 * c, b = x2 * s, e = x2 * c, f = x1 * s;
  y1 = round_half(a - b);
  y2 = round_half(e + f);
#endif
}

}  // namespace enginesmith
