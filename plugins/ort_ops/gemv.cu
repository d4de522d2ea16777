// Weight-streaming GEMV kernels (see gemv.h).
//
// Work split: a warp owns ROWS output rows (of NW weight matrices) and walks K in 16-byte weight
// loads, lane-interleaved so a warp reads 512 contiguous bytes per row per step; U steps are issued
// before any is consumed, so each thread keeps U * NW * ROWS loads in flight. x (M <= kGemvMaxRows rows) is
// read through the read-only cache. Partial sums are fp32 (int4: 8-element fp16 partials of
// scale-applied products, flushed to fp32); a warp reduction finishes each output.
#include "gemv.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace enginesmith {
namespace {

constexpr int kWarps = 4;

__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;  // weights are read once per step: don't let them evict x (or anything else) from L1
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ float silu(float g) { return g / (1.f + __expf(-g)); }

__device__ __forceinline__ __half2 as_h2(uint32_t u) {
  __half2 h;
  memcpy(&h, &u, 4);
  return h;
}

// fp16 weights: acc += x[0:8] · w[0:8] in fp32.
__device__ __forceinline__ float dot8(const uint4& xv, const uint4& wv, float acc) {
  const uint32_t xs[4] = {xv.x, xv.y, xv.z, xv.w}, ws[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 xf = __half22float2(as_h2(xs[i])), wf = __half22float2(as_h2(ws[i]));
    acc = fmaf(xf.x, wf.x, acc);
    acc = fmaf(xf.y, wf.y, acc);
  }
  return acc;
}

// int4 word (8 values, low nibble first) -> 4 half2 of (q - 8) * scale, paired (e_j, e_{j+4}).
__device__ __forceinline__ void dequant8(uint32_t q, __half2 s2, __half2 out[4]) {
  const __half2 bias = __float2half2_rn(1032.f);  // 1024 (the exponent trick) + zero point 8
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t bits = ((q >> (4 * j)) & 0x000F000Fu) | 0x64006400u;  // 1024 + e_j | 1024 + e_{j+4}
    out[j] = __hmul2(__hsub2(as_h2(bits), bias), s2);
  }
}

// x[0:8] as the pairs dequant8 produces: (x0,x4), (x1,x5), (x2,x6), (x3,x7).
__device__ __forceinline__ void pair8(const uint4& xv, __half2 out[4]) {
  out[0] = as_h2(__byte_perm(xv.x, xv.z, 0x5410));
  out[1] = as_h2(__byte_perm(xv.x, xv.z, 0x7632));
  out[2] = as_h2(__byte_perm(xv.y, xv.w, 0x5410));
  out[3] = as_h2(__byte_perm(xv.y, xv.w, 0x7632));
}

template <int MR, bool Q4, int NW, int ROWS, int U>
__global__ void __launch_bounds__(kWarps * 32) gemv_kernel(GemvProblem p, int m0, int m_count) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n0 = (blockIdx.x * kWarps + warp) * ROWS;
  if (n0 >= p.N) return;
  constexpr int E = Q4 ? 32 : 8;  // K elements per 16-byte weight load
  const int chunks = p.K / E;
  const size_t row_bytes = Q4 ? size_t(p.K) / 2 : size_t(p.K) * 2;
  const int blocks_per_row = Q4 ? p.K / p.block_size : 0;

  const uint4* wrow[NW][ROWS];
  const __half* srow[NW][ROWS];
#pragma unroll
  for (int w = 0; w < NW; ++w)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int n = min(n0 + r, p.N - 1);
      wrow[w][r] = reinterpret_cast<const uint4*>(static_cast<const char*>(p.w[w]) + n * row_bytes);
      srow[w][r] = Q4 ? p.scales[w] + size_t(n) * blocks_per_row : nullptr;
    }
  const uint4* xrow[MR];
#pragma unroll
  for (int m = 0; m < MR; ++m)
    xrow[m] = reinterpret_cast<const uint4*>(p.x + size_t(m0 + min(m, m_count - 1)) * p.K);

  float acc[NW][ROWS][MR];
#pragma unroll
  for (int w = 0; w < NW; ++w)
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
      for (int m = 0; m < MR; ++m) acc[w][r][m] = 0.f;

  for (int c0 = 0; c0 < chunks; c0 += 32 * U) {
    uint4 wv[U][NW][ROWS];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * 32 + lane;
#pragma unroll
      for (int w = 0; w < NW; ++w)
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
          wv[u][w][r] = c < chunks ? load_stream(wrow[w][r] + c) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * 32 + lane;
      if (c >= chunks) break;
      if constexpr (!Q4) {
#pragma unroll
        for (int m = 0; m < MR; ++m) {
          const uint4 xv = __ldg(xrow[m] + c);
#pragma unroll
          for (int w = 0; w < NW; ++w)
#pragma unroll
            for (int r = 0; r < ROWS; ++r) acc[w][r][m] = dot8(xv, wv[u][w][r], acc[w][r][m]);
        }
      } else {
        const int blk = c * E / p.block_size;
        __half2 s2[NW][ROWS];
#pragma unroll
        for (int w = 0; w < NW; ++w)
#pragma unroll
          for (int r = 0; r < ROWS; ++r) s2[w][r] = __half2half2(srow[w][r][blk]);
        const uint32_t* words[NW][ROWS];
#pragma unroll
        for (int w = 0; w < NW; ++w)
#pragma unroll
          for (int r = 0; r < ROWS; ++r) words[w][r] = reinterpret_cast<const uint32_t*>(&wv[u][w][r]);
#pragma unroll
        for (int i = 0; i < 4; ++i) {  // 4 words of 8 values each
          __half2 wq[NW][ROWS][4];
#pragma unroll
          for (int w = 0; w < NW; ++w)
#pragma unroll
            for (int r = 0; r < ROWS; ++r) dequant8(words[w][r][i], s2[w][r], wq[w][r]);
#pragma unroll
          for (int m = 0; m < MR; ++m) {
            __half2 xp[4];
            pair8(__ldg(xrow[m] + c * 4 + i), xp);
#pragma unroll
            for (int w = 0; w < NW; ++w)
#pragma unroll
              for (int r = 0; r < ROWS; ++r) {
                __half2 part = __hmul2(xp[0], wq[w][r][0]);
                part = __hfma2(xp[1], wq[w][r][1], part);
                part = __hfma2(xp[2], wq[w][r][2], part);
                part = __hfma2(xp[3], wq[w][r][3], part);
                const float2 f = __half22float2(part);
                acc[w][r][m] += f.x + f.y;
              }
          }
        }
      }
    }
  }

#pragma unroll
  for (int w = 0; w < NW; ++w)
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
      for (int m = 0; m < MR; ++m)
#pragma unroll
        for (int off = 16; off > 0; off /= 2) acc[w][r][m] += __shfl_xor_sync(0xffffffffu, acc[w][r][m], off);
  if (lane != 0) return;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    if (n0 + r >= p.N) break;
#pragma unroll
    for (int m = 0; m < MR; ++m) {
      if (m >= m_count) break;
      const float v = NW == 2 ? silu(acc[0][r][m]) * acc[NW - 1][r][m] : acc[0][r][m];
      p.y[size_t(m0 + m) * p.N + n0 + r] = __float2half_rn(v);
    }
  }
}

template <int MR, bool Q4, int NW, int ROWS>
cudaError_t launch_rows(const GemvProblem& p, int m0, int m_count, cudaStream_t stream) {
  constexpr int U = Q4 ? 2 : 4;
  const int warps = (p.N + ROWS - 1) / ROWS;
  const int blocks = (warps + kWarps - 1) / kWarps;
  gemv_kernel<MR, Q4, NW, ROWS, U><<<blocks, kWarps * 32, 0, stream>>>(p, m0, m_count);
  return cudaGetLastError();
}

// Rows per warp: enough warps to cover the GPU (~2k), then more rows per warp so x is reused.
template <int MR, bool Q4>
cudaError_t launch_m(const GemvProblem& p, int m0, int m_count, cudaStream_t stream) {
  if (p.swiglu) {
    // int4 SwiGLU: two rows per warp at every N. The one-row instance failed to launch on the H200
    // ("invalid argument", then "device kernel image is invalid"; not understood, not yet retried).
    if constexpr (Q4) return launch_rows<MR, Q4, 2, 2>(p, m0, m_count, stream);
    return launch_rows<MR, Q4, 2, 1>(p, m0, m_count, stream);
  }
  if (Q4 && p.N >= 8192) return launch_rows<MR, Q4, 1, 4>(p, m0, m_count, stream);
  if (p.N >= 4096) return launch_rows<MR, Q4, 1, 2>(p, m0, m_count, stream);
  return launch_rows<MR, Q4, 1, 1>(p, m0, m_count, stream);
}

template <bool Q4>
cudaError_t launch_chunk(const GemvProblem& p, int m0, int m_count, cudaStream_t stream) {
  if (m_count == 1) return launch_m<1, Q4>(p, m0, m_count, stream);
  if (m_count == 2) return launch_m<2, Q4>(p, m0, m_count, stream);
  return launch_m<4, Q4>(p, m0, m_count, stream);
}

float half_to_float(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  float v;
  if (exp == 0) v = std::ldexp(float(man), -24);
  else if (exp == 31) v = man ? NAN : INFINITY;
  else v = std::ldexp(float(man | 0x400), int(exp) - 25);
  return sign ? -v : v;
}

}  // namespace

const char* gemv_check(const GemvProblem& p) {
  if (p.M <= 0 || p.N <= 0 || p.K <= 0) return "empty or negative dimension";
  if (!p.q4 && p.K % 8 != 0) return "K must be a multiple of 8 for fp16 weights";
  if (p.q4) {
    if (p.block_size != 32 && p.block_size != 64 && p.block_size != 128 && p.block_size != 256)
      return "block_size must be 32, 64, 128 or 256";
    if (p.K % p.block_size != 0) return "K must be a multiple of block_size";
  }
  const int nw = p.swiglu ? 2 : 1;
  for (int w = 0; w < nw; ++w) {
    if (p.w[w] == nullptr || (p.q4 && p.scales[w] == nullptr)) return "missing weight or scales";
    if (reinterpret_cast<uintptr_t>(p.w[w]) % 16 != 0) return "weights must be 16-byte aligned";
  }
  if (reinterpret_cast<uintptr_t>(p.x) % 16 != 0) return "x must be 16-byte aligned";
  return "";
}

cudaError_t gemv_launch(const GemvProblem& p, cudaStream_t stream) {
  for (int m0 = 0; m0 < p.M; m0 += kGemvMaxRows) {
    const int m_count = std::min(kGemvMaxRows, p.M - m0);
    const cudaError_t err = p.q4 ? launch_chunk<true>(p, m0, m_count, stream)
                                 : launch_chunk<false>(p, m0, m_count, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

void gemv_reference(const GemvProblem& p) {
  static const std::vector<float> lut = [] {  // every fp16 bit pattern -> float
    std::vector<float> t(65536);
    for (uint32_t i = 0; i < 65536; ++i) t[i] = half_to_float(uint16_t(i));
    return t;
  }();
  const auto* x = reinterpret_cast<const uint16_t*>(p.x);
  auto* y = reinterpret_cast<uint16_t*>(p.y);
  const int nw = p.swiglu ? 2 : 1;
  const int nb = p.q4 ? p.K / p.block_size : 0;
  std::vector<float> xf(size_t(p.M) * p.K), row[2] = {std::vector<float>(p.K), std::vector<float>(p.K)};
  for (size_t i = 0; i < xf.size(); ++i) xf[i] = lut[x[i]];
  for (int n = 0; n < p.N; ++n) {
    for (int w = 0; w < nw; ++w) {  // row n of W, dequantized
      for (int k = 0; k < p.K; ++k) {
        if (p.q4) {
          const auto* b = static_cast<const uint8_t*>(p.w[w]) + size_t(n) * (p.K / 2);
          const int q = (k % 2 == 0) ? (b[k / 2] & 0xF) : (b[k / 2] >> 4);
          row[w][k] = float(q - 8) * lut[reinterpret_cast<const uint16_t*>(p.scales[w])[size_t(n) * nb + k / p.block_size]];
        } else {
          row[w][k] = lut[static_cast<const uint16_t*>(p.w[w])[size_t(n) * p.K + k]];
        }
      }
    }
    for (int m = 0; m < p.M; ++m) {
      float dot[2] = {0.f, 0.f};
      for (int w = 0; w < nw; ++w)
        for (int k = 0; k < p.K; ++k) dot[w] += xf[size_t(m) * p.K + k] * row[w][k];
      const float v = p.swiglu ? dot[0] / (1.f + std::exp(-dot[0])) * dot[1] : dot[0];
      const __half h = __float2half_rn(v);
      memcpy(&y[size_t(m) * p.N + n], &h, 2);
    }
  }
}

__global__ void swiglu_combine_kernel(__half* gate_out, const __half* up, size_t count) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x) {
    const float g = __half2float(gate_out[i]);
    gate_out[i] = __float2half_rn(silu(g) * __half2float(up[i]));
  }
}

cudaError_t swiglu_combine(__half* gate_out, const __half* up, size_t count, cudaStream_t stream) {
  const int blocks = int(std::min<size_t>((count + 255) / 256, 4096));
  swiglu_combine_kernel<<<blocks, 256, 0, stream>>>(gate_out, up, count);
  return cudaGetLastError();
}

}  // namespace enginesmith
