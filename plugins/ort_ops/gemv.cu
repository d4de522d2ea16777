// Weight-streaming GEMV kernels (see gemv.h).
//
// Work split: a warp owns ROWS output rows (of NW weight matrices) and walks K in 16-byte weight
// loads, lane-interleaved so a warp reads 512 contiguous bytes per row per step; U steps are issued
// before any is consumed, so each thread keeps U * NW * ROWS loads in flight. x (M <= kGemvMaxRows rows) is
// read through the read-only cache. Partial sums are fp32 (int4: the fp16 sum of x·(q-8)/16 over a
// 16-byte load, 32 values, flushed to fp32 and scaled there); a warp reduction finishes each output.
#include "gemv.h"
#include "launch.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace enginesmith {
namespace {

// Tuning knobs (compile-time; benchmarks/gpu builds variants with -D to compare them).
#ifndef ES_GEMV_WARPS_FP16
#define ES_GEMV_WARPS_FP16 8  // warps per block, fp16 (H200: 8 beat 4 by 3.5 % on Llama-1B decode)
#endif
#ifndef ES_GEMV_WARPS_Q4
#define ES_GEMV_WARPS_Q4 4  // the same, int4 (there 4 beat 8 by 4 %)
#endif
#ifndef ES_GEMV_U_FP16
#define ES_GEMV_U_FP16 4  // 16-byte weight loads in flight per thread and row, fp16
#endif
#ifndef ES_GEMV_U_Q4
#define ES_GEMV_U_Q4 2  // the same, int4
#endif
#ifndef ES_GEMV_Q4_ROWS_SMALL
#define ES_GEMV_Q4_ROWS_SMALL 4  // rows per warp, int4 without SwiGLU at N < 4096: 1, 2 or 4 (H200: 4 best)
#endif
static_assert(ES_GEMV_Q4_ROWS_SMALL == 1 || ES_GEMV_Q4_ROWS_SMALL == 2 || ES_GEMV_Q4_ROWS_SMALL == 4,
              "ES_GEMV_Q4_ROWS_SMALL must be 1, 2 or 4");
template <bool Q4>
constexpr int kWarps = Q4 ? ES_GEMV_WARPS_Q4 : ES_GEMV_WARPS_FP16;

__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;  // weights are read once per step: don't let them evict x (or anything else) from L1
#if ES_GEMV_L2_PREFETCH
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#else
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#endif
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

// (a & b) | c in one instruction.
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// int4 word (8 values, low nibble first) -> 4 half2 of (q - 8) / DIV, paired (e_j, e_{j+4}), exact.
// A nibble masked in place under the fp16 exponent of 1024 reads as 1024 + e (even nibbles) or
// 1024 + 16·e (odd ones): one HFMA2 each scales and re-centres it. DIV = 16 keeps the GEMV's fp16 sums
// of 32 products within range for |x| up to ~4000 (the 1/16 is exact and comes back in fp32).
template <int DIV>
__device__ __forceinline__ void offsets8(uint32_t q, __half2 out[4]) {
  static_assert(DIV == 1 || DIV == 16, "(q - 8) or (q - 8) / 16");
  const __half2 even_a = __float2half2_rn(1.f / DIV), even_b = __float2half2_rn(-1032.f / DIV);
  const __half2 odd_a = __float2half2_rn(1.f / (16 * DIV)), odd_b = __float2half2_rn(-72.f / DIV);
  const uint32_t q2 = q >> 8;
  out[0] = __hfma2(as_h2(and_or(q, 0x000F000Fu, 0x64006400u)), even_a, even_b);   // e0, e4
  out[1] = __hfma2(as_h2(and_or(q, 0x00F000F0u, 0x64006400u)), odd_a, odd_b);     // e1, e5
  out[2] = __hfma2(as_h2(and_or(q2, 0x000F000Fu, 0x64006400u)), even_a, even_b);  // e2, e6
  out[3] = __hfma2(as_h2(and_or(q2, 0x00F000F0u, 0x64006400u)), odd_a, odd_b);    // e3, e7
}

// The same times the scale: (q - 8) * scale, for the dequantize kernel.
__device__ __forceinline__ void dequant8(uint32_t q, __half2 s2, __half2 out[4]) {
  offsets8<1>(q, out);
#pragma unroll
  for (int j = 0; j < 4; ++j) out[j] = __hmul2(out[j], s2);
}

// x[0:8] as the pairs dequant8 produces: (x0,x4), (x1,x5), (x2,x6), (x3,x7).
__device__ __forceinline__ void pair8(const uint4& xv, __half2 out[4]) {
  out[0] = as_h2(__byte_perm(xv.x, xv.z, 0x5410));
  out[1] = as_h2(__byte_perm(xv.x, xv.z, 0x7632));
  out[2] = as_h2(__byte_perm(xv.y, xv.w, 0x5410));
  out[3] = as_h2(__byte_perm(xv.y, xv.w, 0x7632));
}

// The whole block normalizes row `row` of p.x (+ p.skip) into dst[0:K] (see gemv.h for the rounding);
// with `write_sum`, fp16(x + skip) also goes to p.sum_out. Every thread of the block must call it.
__device__ void rmsnorm_row(const GemvProblem& p, int row, uint4* dst, bool write_sum) {
  __shared__ float partial[32];
  const int k8 = p.K / 8;
  const auto* xr = reinterpret_cast<const uint4*>(p.x + size_t(row) * p.K);
  const auto* sr = p.skip ? reinterpret_cast<const uint4*>(p.skip + size_t(row) * p.K) : nullptr;
  auto* out = write_sum && p.sum_out ? reinterpret_cast<uint4*>(p.sum_out + size_t(row) * p.K) : nullptr;
  float ss = 0.f;
  for (int i = threadIdx.x; i < k8; i += blockDim.x) {
    uint4 v = xr[i];
    uint32_t* h = reinterpret_cast<uint32_t*>(&v);
    const uint4 sv = sr ? sr[i] : make_uint4(0, 0, 0, 0);
    const uint32_t* sh = reinterpret_cast<const uint32_t*>(&sv);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float2 f = __half22float2(as_h2(h[j]));
      if (sr) {
        const float2 g = __half22float2(as_h2(sh[j]));
        f.x += g.x;
        f.y += g.y;
        const __half2 r = __floats2half2_rn(f.x, f.y);
        memcpy(&h[j], &r, 4);
      }
      ss = fmaf(f.x, f.x, fmaf(f.y, f.y, ss));
    }
    dst[i] = v;
    if (out) out[i] = v;
  }
  for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  if (threadIdx.x % 32 == 0) partial[warp] = ss;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < warps; ++w) total += partial[w];
  const float rstd = rsqrtf(total / float(p.K) + p.eps);
  const auto* gr = reinterpret_cast<const uint4*>(p.gamma);
  for (int i = threadIdx.x; i < k8; i += blockDim.x) {
    uint4 v = dst[i];
    const uint4 gv = __ldg(gr + i);
    uint32_t* h = reinterpret_cast<uint32_t*>(&v);
    const uint32_t* g = reinterpret_cast<const uint32_t*>(&gv);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __half22float2(as_h2(h[j])), gf = __half22float2(as_h2(g[j]));
      const __half2 r = __floats2half2_rn(f.x * rstd * gf.x, f.y * rstd * gf.y);
      memcpy(&h[j], &r, 4);
    }
    dst[i] = v;
  }
  __syncthreads();  // dst complete; `partial` free for the next row
}

template <int MR, bool Q4, int NW, int ROWS, int U, bool NORM>
__global__ void __launch_bounds__(kWarps<Q4> * 32) gemv_kernel(GemvProblem p, int m0, int m_count) {
  extern __shared__ uint4 x_norm[];  // NORM: the MR normalized rows of x, [MR][K / 8]
  allow_next_kernel();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n0 = (blockIdx.x * kWarps<Q4> + warp) * ROWS;
  const bool active = n0 < p.N;  // idle warps still take part in the block's norm
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

  // U steps of weights (and int4 scales) in registers: the first are loaded before waiting for x.
  uint4 wv[U][NW][ROWS];
  __half sv[U][NW][ROWS];
  auto load = [&](int c0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * 32 + lane;
      const bool in = active && c < chunks;
#pragma unroll
      for (int w = 0; w < NW; ++w)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          wv[u][w][r] = in ? load_stream(wrow[w][r] + c) : make_uint4(0, 0, 0, 0);
          if constexpr (Q4) sv[u][w][r] = in ? __ldg(srow[w][r] + c * E / p.block_size) : __half(0.f);
        }
    }
  };
  load(0);
  wait_for_previous_kernel();
  const int k8 = p.K / 8;
  if constexpr (NORM) {
    for (int m = 0; m < MR; ++m) rmsnorm_row(p, m0 + min(m, m_count - 1), x_norm + m * k8, blockIdx.x == 0 && m < m_count);
  }
  if (!active) return;
  const uint4* xrow[MR];  // without the norm: the rows of x in global memory
#pragma unroll
  for (int m = 0; m < MR; ++m) xrow[m] = reinterpret_cast<const uint4*>(p.x + size_t(m0 + min(m, m_count - 1)) * p.K);
  auto x_at = [&](int m, int i) { return NORM ? x_norm[m * k8 + i] : __ldg(xrow[m] + i); };

  float acc[NW][ROWS][MR] = {};

  for (int c0 = 0; c0 < chunks; c0 += 32 * U) {
    if (c0 > 0) load(c0);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * 32 + lane;
      if (c >= chunks) break;
      if constexpr (!Q4) {
#pragma unroll
        for (int m = 0; m < MR; ++m) {
          const uint4 xv = x_at(m, c);
#pragma unroll
          for (int w = 0; w < NW; ++w)
#pragma unroll
            for (int r = 0; r < ROWS; ++r) acc[w][r][m] = dot8(xv, wv[u][w][r], acc[w][r][m]);
        }
      } else {
        // Σ x·(q-8)/16 over the load's 32 values in fp16 (|sum| <= 16·max|x|), then × 16·scale in fp32:
        // one conversion per 32 values.
        __half2 part[NW][ROWS][MR];
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
            for (int r = 0; r < ROWS; ++r) offsets8<16>(words[w][r][i], wq[w][r]);
#pragma unroll
          for (int m = 0; m < MR; ++m) {
            __half2 xp[4];
            pair8(x_at(m, c * 4 + i), xp);
#pragma unroll
            for (int w = 0; w < NW; ++w)
#pragma unroll
              for (int r = 0; r < ROWS; ++r) {
                __half2 sum = i > 0 ? __hfma2(xp[0], wq[w][r][0], part[w][r][m]) : __hmul2(xp[0], wq[w][r][0]);
                sum = __hfma2(xp[1], wq[w][r][1], sum);
                sum = __hfma2(xp[2], wq[w][r][2], sum);
                part[w][r][m] = __hfma2(xp[3], wq[w][r][3], sum);
              }
          }
        }
#pragma unroll
        for (int w = 0; w < NW; ++w)
#pragma unroll
          for (int r = 0; r < ROWS; ++r) {
            const float scale = 16.f * __half2float(sv[u][w][r]);
#pragma unroll
            for (int m = 0; m < MR; ++m) {
              const float2 f = __half22float2(part[w][r][m]);
              acc[w][r][m] = fmaf(scale, f.x + f.y, acc[w][r][m]);
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

// One block per row: the norm alone (fused ops whose product runs in cuBLAS).
__global__ void __launch_bounds__(256) rmsnorm_kernel(GemvProblem p, __half* xn) {
  wait_for_previous_kernel();
  rmsnorm_row(p, blockIdx.x, reinterpret_cast<uint4*>(xn + size_t(blockIdx.x) * p.K), true);
}

bool g_pdl = false;  // set by gemv_prepare

template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), int blocks, int threads, size_t smem, cudaStream_t stream,
                   Args... args) {
  return launch_kernel(kernel, dim3(blocks), threads, smem, stream, g_pdl, args...);
}

// The fused norm keeps MR rows of x in shared memory: rows per launch so that fits the default 48 KiB.
constexpr size_t kNormSmem = 48 << 10;

int rows_per_launch(const GemvProblem& p) {
  if (p.gamma == nullptr) return kGemvMaxRows;
  for (int rows = kGemvMaxRows; rows > 1; rows /= 2)
    if (size_t(rows) * p.K * sizeof(__half) <= kNormSmem) return rows;
  return 1;
}

template <int MR, bool Q4, int NW, int ROWS>
cudaError_t launch_rows(const GemvProblem& p, int m0, int m_count, cudaStream_t stream) {
  constexpr int U = Q4 ? ES_GEMV_U_Q4 : ES_GEMV_U_FP16;
  const int warps = (p.N + ROWS - 1) / ROWS;
  const int blocks = (warps + kWarps<Q4> - 1) / kWarps<Q4>;
  if (p.gamma)
    return launch(gemv_kernel<MR, Q4, NW, ROWS, U, true>, blocks, kWarps<Q4> * 32, size_t(MR) * p.K * sizeof(__half),
                  stream, p, m0, m_count);
  return launch(gemv_kernel<MR, Q4, NW, ROWS, U, false>, blocks, kWarps<Q4> * 32, 0, stream, p, m0, m_count);
}

// Rows per warp: enough warps to cover the GPU (~2k), then more rows per warp so x is reused.
template <int MR, bool Q4>
cudaError_t launch_m(const GemvProblem& p, int m0, int m_count, cudaStream_t stream) {
  if (p.swiglu) {
    // int4 SwiGLU: two rows per warp at every N. (A one-row instance once failed to launch on the
    // H200, most likely the duplicate CUDA runtime that plugins/CMakeLists.txt now avoids; not retried.)
    if constexpr (Q4) return launch_rows<MR, Q4, 2, 2>(p, m0, m_count, stream);
    return launch_rows<MR, Q4, 2, 1>(p, m0, m_count, stream);
  }
  if (Q4 && p.N >= 8192) return launch_rows<MR, Q4, 1, 4>(p, m0, m_count, stream);
  if (p.N >= 4096) return launch_rows<MR, Q4, 1, 2>(p, m0, m_count, stream);
  return launch_rows<MR, Q4, 1, Q4 ? ES_GEMV_Q4_ROWS_SMALL : 1>(p, m0, m_count, stream);
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
  if (p.gamma) {
    if (size_t(p.K) * sizeof(__half) > kNormSmem) return "K is too large for the fused norm (at most 24576)";
    for (const void* ptr : {static_cast<const void*>(p.gamma), static_cast<const void*>(p.skip),
                            static_cast<const void*>(p.sum_out)})
      if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return "norm inputs and outputs must be 16-byte aligned";
    if (p.skip != nullptr && p.sum_out == nullptr) return "a skip input needs a sum output";
  } else if (p.skip != nullptr) {
    return "a skip input needs gamma";
  }
  return "";
}

void gemv_prepare() {
  g_pdl = dependent_launches_enabled();  // read per session: benchmarks compare both
  static const bool pool_kept = [] {
    // The GEMM path's temporaries come from the device's default stream-ordered pool. By default it
    // returns freed memory to the driver at every synchronization (each ORT run ends with one), so each
    // prefill would allocate anew: keep it instead.
    int device = 0;
    cudaMemPool_t pool;
    uint64_t keep = UINT64_MAX;
    const bool ok = cudaGetDevice(&device) == cudaSuccess && cudaDeviceGetDefaultMemPool(&pool, device) == cudaSuccess &&
                    cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep) == cudaSuccess;
    (void)cudaGetLastError();
    return ok;
  }();
  (void)pool_kept;
}

cudaError_t gemv_launch(const GemvProblem& p, cudaStream_t stream) {
  const int rows = rows_per_launch(p);
  for (int m0 = 0; m0 < p.M; m0 += rows) {
    const int m_count = std::min(rows, p.M - m0);
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
  if (p.gamma) {  // the folded RMSNorm, rounded as the kernel rounds (gemv.h)
    auto to_half = [](float v) {
      const __half h = __float2half_rn(v);
      uint16_t bits;
      memcpy(&bits, &h, 2);
      return bits;
    };
    const auto* skip = reinterpret_cast<const uint16_t*>(p.skip);
    const auto* gamma = reinterpret_cast<const uint16_t*>(p.gamma);
    auto* sum_out = reinterpret_cast<uint16_t*>(p.sum_out);
    for (int m = 0; m < p.M; ++m) {
      float* r = &xf[size_t(m) * p.K];
      float ss = 0.f;
      for (int k = 0; k < p.K; ++k) {
        const float s = r[k] + (skip ? lut[skip[size_t(m) * p.K + k]] : 0.f);
        ss += s * s;
        const uint16_t h = to_half(s);
        if (skip) sum_out[size_t(m) * p.K + k] = h;
        r[k] = lut[h];
      }
      const float rstd = 1.f / std::sqrt(ss / float(p.K) + p.eps);
      for (int k = 0; k < p.K; ++k) r[k] = lut[to_half(r[k] * rstd * lut[gamma[k]])];
    }
  }
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

// One 32-bit word = 8 consecutive values of a row (K is a multiple of block_size >= 32, so a word never
// straddles two rows or two blocks).
__global__ void dequant_q4_kernel(const uint32_t* packed, const __half* scales, uint4* w, int rows, int K,
                                  int block_size) {
  const int row_words = K / 8, words_per_block = block_size / 8, blocks_per_row = K / block_size;
  for (int n = blockIdx.y; n < rows; n += gridDim.y) {  // a row per block row: no 64-bit division
    const size_t row = size_t(n) * row_words;
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < row_words; j += gridDim.x * blockDim.x) {
      const size_t i = row + j;
      const __half2 s2 = __half2half2(scales[size_t(n) * blocks_per_row + j / words_per_block]);
      __half2 v[4];
      dequant8(__ldg(packed + i), s2, v);  // pairs (e_t, e_{t+4})
      uint32_t u[4];
#pragma unroll
      for (int t = 0; t < 4; ++t) memcpy(&u[t], &v[t], 4);
      // back to e0..e7: the low halves of the pairs, then the high halves
      w[i] = make_uint4(__byte_perm(u[0], u[1], 0x5410), __byte_perm(u[2], u[3], 0x5410),
                        __byte_perm(u[0], u[1], 0x7632), __byte_perm(u[2], u[3], 0x7632));
    }
  }
}

cudaError_t dequant_q4(const void* packed, const __half* scales, __half* w, int N, int K, int block_size,
                       cudaStream_t stream) {
  const dim3 grid((K / 8 + 255) / 256, std::min(N, 65535));
  dequant_q4_kernel<<<grid, 256, 0, stream>>>(static_cast<const uint32_t*>(packed), scales,
                                               reinterpret_cast<uint4*>(w), N, K, block_size);
  return cudaGetLastError();
}

cudaError_t rmsnorm_launch(const GemvProblem& p, __half* xn, cudaStream_t stream) {
  return launch(rmsnorm_kernel, p.M, 256, 0, stream, p, xn);
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
