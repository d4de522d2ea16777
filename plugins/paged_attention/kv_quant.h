// Quantized KV-cache pages: the cache formats and the one definition of how a value becomes a code
// and back, shared by the CUDA kernels (paged_attention_kernels.cuh, ort_ops/paged_gqa.cu) and the CPU
// references (ort_ops/paged_gqa.cu; plugins/reference.py mirrors it in numpy).
//
// Dimension legend: Hkv key/value heads, D head size.
//
// Formats (the element type of the pools [NB, BS, Hkv, D]):
//   kNative   the compute dtype (fp16 / bf16): the cache holds the values
//   kInt8     int8 codes,        value = code * scale[h][d],  code = sat_127(rn_even(x / scale))
//   kFp8E4M3  fp8 e4m3 codes (uint8 bytes), value = e4m3(code) * scale[h][d],
//             code = e4m3_rn_satfinite(x / scale)
// Scales are static, per (layer, KV head, channel), float32 [2, Hkv, D] per layer: K's then V's,
// positive and finite (the paged lowering pass calibrates them). Static channel scales fold out of the
// attention's inner loops: K's into the query (q·k = Σ_d (q_d s_d) code_d), V's into the output
// (o_d = s_d Σ_j p_j code_jd), so the kernel only widens codes to fp16 (exact for both formats).
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>

namespace enginesmith {

enum class KvFormat : int { kNative = 0, kInt8 = 1, kFp8E4M3 = 2 };

inline const char* kv_format_name(KvFormat f) {
  return f == KvFormat::kInt8 ? "int8" : f == KvFormat::kFp8E4M3 ? "fp8e4m3" : "native";
}

__host__ __device__ constexpr bool kv_quantized(KvFormat f) { return f != KvFormat::kNative; }

constexpr int kInt8CodeMax = 127;  // symmetric: -128 is never written

// The code of x under `scale` (IEEE division and round-to-nearest-even on host and device alike:
// the library is compiled with --use_fast_math, so the device division is spelled out).
template <KvFormat F>
__host__ __device__ __forceinline__ uint8_t kv_encode(float x, float scale) {
  static_assert(F != KvFormat::kNative, "native caches hold values, not codes");
#ifdef __CUDA_ARCH__
  const float v = __fdiv_rn(x, scale);
#else
  const float v = x / scale;
#endif
  if constexpr (F == KvFormat::kInt8) {
#ifdef __CUDA_ARCH__
    const float r = rintf(v);
#else
    const float r = std::nearbyint(v);  // the default rounding mode: to nearest, ties to even
#endif
    const float c = fminf(fmaxf(r, -float(kInt8CodeMax)), float(kInt8CodeMax));  // NaN -> -127 (fmaxf drops it)
    return static_cast<uint8_t>(static_cast<int8_t>(c));
  } else {
    return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
  }
}

// The code widened to a float (exact): the value is this times the scale.
template <KvFormat F>
__host__ __device__ __forceinline__ float kv_decode(uint8_t code) {
  if constexpr (F == KvFormat::kInt8) {
    return static_cast<float>(static_cast<int8_t>(code));
  } else {
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3)));
  }
}

}  // namespace enginesmith
