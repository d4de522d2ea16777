// GroupQueryAttention's prompt path on tensor cores (see attention_prefill.h for the diagram).
//
// Fragment layouts of mma.sync m16n8k16 (lane = 4 gid + tig): A rows gid and gid + 8, columns
// 2 tig, 2 tig + 1 (+ 8); B columns gid, rows 2 tig, 2 tig + 1 (+ 8); C rows gid, gid + 8, columns
// 2 tig, 2 tig + 1. So the S accumulators of a 16-key chunk are the A fragment of P (no shuffle), and
// one ldmatrix.x4 gives a K fragment for 16 keys x 16 dims (or, transposed, a V fragment).
#include "attention_prefill.h"

#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "../common/mma.cuh"
#include "launch.cuh"
#include "rotary.cuh"

#ifndef ES_GQA_PREFILL_MT64
#define ES_GQA_PREFILL_MT64 2  // 16-row m-tiles per warp at head size 64 (BM = 64 x this)
#endif

namespace enginesmith {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kStages = 2;  // K/V tiles in shared memory: one computing, one loading
constexpr float kLog2e = 1.4426950408889634f;

// Per head size: 16-row m-tiles per warp (kMT: a K/V fragment serves that many), keys per tile (kBN),
// and whether Q lives in registers (head size 256: in shared memory, its fragments loaded per use, so
// the D x 16 fp32 output tile fits the registers).
template <int D> struct Shape;
template <> struct Shape<64> {
  static constexpr int kMT = ES_GQA_PREFILL_MT64, kBN = 64;
  static constexpr bool kQRegs = true;
};
template <> struct Shape<128> {
  static constexpr int kMT = 1, kBN = 64;
  static constexpr bool kQRegs = true;
};
template <> struct Shape<256> {
  static constexpr int kMT = 1, kBN = 32;
  static constexpr bool kQRegs = false;
};

template <int D> __host__ __device__ constexpr int block_rows() { return kWarps * 16 * Shape<D>::kMT; }
// Shared-memory row stride in elements: +8 (16 bytes) puts the 8 rows an ldmatrix reads in 8 bank groups.
template <int D> __host__ __device__ constexpr int smem_stride() { return D + 8; }
template <int D> constexpr size_t smem_bytes() {
  return size_t(block_rows<D>() + 2 * kStages * Shape<D>::kBN) * smem_stride<D>() * sizeof(__half);
}

__device__ __forceinline__ float fast_exp2(float x) {  // 2^x; -inf -> 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The rotation (rotary.cuh) of 8 pairs: x1 = dims c .. c + 7, x2 = dims HALF + c .. HALF + c + 7.
__device__ __forceinline__ void rotate8(const uint4& x1, const uint4& x2, const uint4& cs, const uint4& sn, uint4& y1,
                                        uint4& y2) {
  const __half *a = reinterpret_cast<const __half*>(&x1), *b = reinterpret_cast<const __half*>(&x2);
  const __half *c = reinterpret_cast<const __half*>(&cs), *s = reinterpret_cast<const __half*>(&sn);
  __half *o1 = reinterpret_cast<__half*>(&y1), *o2 = reinterpret_cast<__half*>(&y2);
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    float r1, r2;
    rotate(__half2float(a[e]), __half2float(b[e]), __half2float(c[e]), __half2float(s[e]), r1, r2);
    o1[e] = __float2half_rn(r1);
    o2[e] = __float2half_rn(r2);
  }
}

__device__ __forceinline__ bool row_out_of_range(const AttentionProblem& p, int total) {
  return total < p.S || total > p.C || total > p.P;
}

// The S new tokens' keys (rotated) and values into the cache: a thread per (token, KV head, 8 pairs).
__global__ void __launch_bounds__(256) append_kv_kernel(AttentionProblem p) {
  allow_next_kernel();
  wait_for_previous_kernel();
  const int b = blockIdx.y, chunks = p.D / 16, per_token = p.Hkv * chunks;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const int total = p.seqlens[b] + 1, past = total - p.S;
  if (i >= p.S * per_token || row_out_of_range(p, total)) return;
  const int s = i / per_token, g = i % per_token / chunks, c = i % chunks * 8, half = p.D / 2, pos = past + s;
  const __half* k = p.qkv + (size_t(b) * p.S + s) * (p.H + 2 * p.Hkv) * p.D + (p.H + g) * p.D;
  const __half* v = k + p.Hkv * p.D;
  const uint4 k1 = *reinterpret_cast<const uint4*>(k + c), k2 = *reinterpret_cast<const uint4*>(k + half + c);
  const uint4 v1 = *reinterpret_cast<const uint4*>(v + c), v2 = *reinterpret_cast<const uint4*>(v + half + c);
  const uint4 cs = *reinterpret_cast<const uint4*>(p.cos + size_t(pos) * half + c);
  const uint4 sn = *reinterpret_cast<const uint4*>(p.sin + size_t(pos) * half + c);
  uint4 y1, y2;
  rotate8(k1, k2, cs, sn, y1, y2);
  const size_t at = ((size_t(b) * p.Hkv + g) * p.C + pos) * p.D;
  __half* k_cache = static_cast<__half*>(p.k_cache);  // fp16 caches only (prefill_applies)
  __half* v_cache = static_cast<__half*>(p.v_cache);
  *reinterpret_cast<uint4*>(k_cache + at + c) = y1;
  *reinterpret_cast<uint4*>(k_cache + at + half + c) = y2;
  *reinterpret_cast<uint4*>(v_cache + at + c) = v1;
  *reinterpret_cast<uint4*>(v_cache + at + half + c) = v2;
}

// kCap: soft-capped scores (p.softcap); kWindow: a sliding window (p.window).
// Grid (Hkv, m_blocks, B); m-blocks run last first (the longest key ranges start first).
template <int D, bool kCap, bool kWindow>
__global__ void __launch_bounds__(kThreads) prefill_kernel(AttentionProblem p, int m_blocks) {
  constexpr int kMT = Shape<D>::kMT, kBN = Shape<D>::kBN, BM = block_rows<D>(), kStride = smem_stride<D>();
  constexpr int HALF = D / 2;
  constexpr bool kQRegs = Shape<D>::kQRegs;
  static_assert(kQRegs || kMT == 1, "Q from shared memory: one m-tile per warp");
  static_assert(BM * kStride >= kWarps * 16 * kMT * kStride, "the output staging fits the Q buffer");
  extern __shared__ uint4 smem_raw[];
  __half* sQ = reinterpret_cast<__half*>(smem_raw);  // [BM][kStride] rotated q; at the end the output
  __half* sK = sQ + BM * kStride;                     // [kStages][kBN][kStride]
  __half* sV = sK + kStages * kBN * kStride;          // likewise

  allow_next_kernel();
  wait_for_previous_kernel();  // qkv and the cache (append_kv) come from the kernels before
  const int g = blockIdx.x, mb = m_blocks - 1 - blockIdx.y, b = blockIdx.z;
  const int G = p.H / p.Hkv, rows_total = p.S * G, m0 = mb * BM;
  const int rows = min(BM, rows_total - m0);
  const int total = p.seqlens[b] + 1, past = total - p.S;
  auto out_row = [&](int r) {  // block row r: token (m0 + r) / G, head g G + (m0 + r) % G
    const int R = m0 + r;
    return p.out + ((size_t(b) * p.S + R / G) * p.H + g * G + R % G) * D;
  };
  if (row_out_of_range(p, total)) {
    for (int i = threadIdx.x; i < rows * D; i += kThreads) out_row(i / D)[i % D] = __float2half(NAN);
    return;
  }

  // Keys [kv_begin, kv_end): from the first key the block's first token sees to its last token.
  const int t_first = m0 / G, t_last = (m0 + rows - 1) / G;
  const int kv_end = past + t_last + 1;
  const int kv_begin = kWindow ? max(0, past + t_first - p.window + 1) : 0;
  const int n_tiles = (kv_end - kv_begin + kBN - 1) / kBN;
  const __half* k_base = static_cast<const __half*>(p.k_cache) + (size_t(b) * p.Hkv + g) * p.C * D;  // fp16 caches
  const __half* v_base = static_cast<const __half*>(p.v_cache) + (size_t(b) * p.Hkv + g) * p.C * D;
  auto copy_tile = [&](int tile) {  // keys at or after kv_end: zero rows, nothing read
    const int t0 = kv_begin + tile * kBN;
    __half* dk = sK + (tile % kStages) * kBN * kStride;
    __half* dv = sV + (tile % kStages) * kBN * kStride;
    static_assert(kBN * (D / 8) % kThreads == 0, "every thread copies as many chunks");
#pragma unroll
    for (int j = 0; j < kBN * (D / 8) / kThreads; ++j) {
      const int i = threadIdx.x + j * kThreads;
      const int row = i / (D / 8), c = i % (D / 8) * 8, key = t0 + row;
      const bool valid = key < kv_end;
      const size_t off = size_t(valid ? key : 0) * D + c;
      ptx::cp_async_16(dk + row * kStride + c, k_base + off, valid);
      ptx::cp_async_16(dv + row * kStride + c, v_base + off, valid);
    }
  };
  copy_tile(0);
  ptx::cp_async_commit();

  // Q rotated at its positions into shared memory (rows past the problem's: zero), while tile 0 loads.
  const int token_stride = (p.H + 2 * p.Hkv) * D;
  for (int i = threadIdx.x; i < BM * (HALF / 8); i += kThreads) {
    const int r = i / (HALF / 8), c = i % (HALF / 8) * 8;
    uint4 y1 = make_uint4(0, 0, 0, 0), y2 = y1;
    if (r < rows) {
      const int R = m0 + r, pos = past + R / G;
      const __half* q = p.qkv + (size_t(b) * p.S + R / G) * token_stride + (g * G + R % G) * D;
      rotate8(*reinterpret_cast<const uint4*>(q + c), *reinterpret_cast<const uint4*>(q + HALF + c),
              *reinterpret_cast<const uint4*>(p.cos + size_t(pos) * HALF + c),
              *reinterpret_cast<const uint4*>(p.sin + size_t(pos) * HALF + c), y1, y2);
    }
    *reinterpret_cast<uint4*>(sQ + r * kStride + c) = y1;
    *reinterpret_cast<uint4*>(sQ + r * kStride + HALF + c) = y2;
  }

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gid = lane >> 2, tig = lane & 3;  // mma fragment row and column pair
  const int mi = lane >> 3, r8 = lane & 7;    // the 8x8 matrix and its row this lane addresses in ldmatrix.x4
  const int warp_row0 = warp * 16 * kMT;
  // Keys [lo, hi) each of the thread's rows sees (rows gid and gid + 8 of each m-tile); padding rows take
  // the last real row's.
  int lim_hi[kMT][2], lim_lo[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int pos = past + (m0 + min(warp_row0 + mt * 16 + gid + 8 * i, rows - 1)) / G;
      lim_hi[mt][i] = pos + 1;
      lim_lo[mt][i] = kWindow ? pos - p.window + 1 : INT_MIN;
    }
  // A tile needs no mask when every row sees all its keys.
  const int unmasked_hi = past + t_first + 1, unmasked_lo = kWindow ? past + t_last - p.window + 1 : INT_MIN;
  const float score_scale = kCap ? p.scale / p.softcap : p.scale * kLog2e;
  const float cap_log2e = kCap ? p.softcap * kLog2e : 0.f;

  uint32_t qf[kQRegs ? kMT : 1][kQRegs ? D / 16 : 1][4];
  float o[kMT][D / 8][4];
  float m_run[kMT][2], l_run[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
    m_run[mt][0] = m_run[mt][1] = -INFINITY;
    l_run[mt][0] = l_run[mt][1] = 0.f;
  }

  for (int tile = 0; tile < n_tiles; ++tile) {
    if (tile + 1 < n_tiles) copy_tile(tile + 1);
    ptx::cp_async_commit();  // (empty on the last tile: the group count stays uniform)
    ptx::cp_async_wait<1>();
    __syncthreads();
    if constexpr (kQRegs) {
      if (tile == 0) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int kk = 0; kk < D / 16; ++kk)
            ptx::ldmatrix_x4(qf[mt][kk],
                             sQ + (warp_row0 + mt * 16 + (mi & 1) * 8 + r8) * kStride + kk * 16 + (mi >> 1) * 8);
      }
    }
    const __half* tk = sK + (tile % kStages) * kBN * kStride;
    const __half* tv = sV + (tile % kStages) * kBN * kStride;

    // S = Q Kᵀ: n8 tile n holds keys 8n .. 8n + 7 of the tile; each K fragment serves the kMT m-tiles.
    float s[kMT][kBN / 8][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int n = 0; n < kBN / 8; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t qs[4];  // Q's fragment from shared memory (head size 256)
      if constexpr (!kQRegs)
        ptx::ldmatrix_x4(qs, sQ + (warp_row0 + (mi & 1) * 8 + r8) * kStride + kk * 16 + (mi >> 1) * 8);
#pragma unroll
      for (int c = 0; c < kBN / 16; ++c) {
        uint32_t kb[4];
        ptx::ldmatrix_x4(kb, tk + (c * 16 + (mi >> 1) * 8 + r8) * kStride + kk * 16 + (mi & 1) * 8);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          if constexpr (kQRegs) {
            ptx::mma_16816<__half>(s[mt][2 * c], qf[mt][kk], kb[0], kb[1]);
            ptx::mma_16816<__half>(s[mt][2 * c + 1], qf[mt][kk], kb[2], kb[3]);
          } else {
            ptx::mma_16816<__half>(s[mt][2 * c], qs, kb[0], kb[1]);
            ptx::mma_16816<__half>(s[mt][2 * c + 1], qs, kb[2], kb[3]);
          }
        }
      }
    }

    // Scores in the exp2 domain (soft-capped first), masked where the tile crosses a row's limits.
    const int t0 = kv_begin + tile * kBN;
    const bool masked = t0 + kBN > unmasked_hi || t0 < unmasked_lo;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int n = 0; n < kBN / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = kCap ? cap_log2e * tanhf(s[mt][n][e] * score_scale) : s[mt][n][e] * score_scale;
          if (masked) {
            const int key = t0 + n * 8 + tig * 2 + (e & 1);
            x = key < lim_hi[mt][e >> 1] && key >= lim_lo[mt][e >> 1] ? x : -INFINITY;
          }
          s[mt][n][e] = x;
        }

    // Online softmax of rows gid (i = 0) and gid + 8 (i = 1); a row spans the 4 threads of a quad.
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < kBN / 8; ++n) mx = fmaxf(mx, fmaxf(s[mt][n][2 * i], s[mt][n][2 * i + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_run[mt][i], mx);
        const float base = m_new == -INFINITY ? 0.f : m_new;  // nothing seen yet: keep zeros
        const float alpha = fast_exp2(m_run[mt][i] - base);
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < kBN / 8; ++n) {
          s[mt][n][2 * i] = fast_exp2(s[mt][n][2 * i] - base);
          s[mt][n][2 * i + 1] = fast_exp2(s[mt][n][2 * i + 1] - base);
          sum += s[mt][n][2 * i] + s[mt][n][2 * i + 1];
        }
        l_run[mt][i] = l_run[mt][i] * alpha + sum;  // this thread's columns; quad-reduced at the end
        m_run[mt][i] = m_new;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          o[mt][n][2 * i] *= alpha;
          o[mt][n][2 * i + 1] *= alpha;
        }
      }

    // O += P V: a 16-key chunk's two n8 S tiles are P's A fragment; each V fragment serves the kMT m-tiles.
#pragma unroll
    for (int c = 0; c < kBN / 16; ++c) {
      uint32_t pa[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        pa[mt][0] = ptx::pack2<__half>(s[mt][2 * c][0], s[mt][2 * c][1]);
        pa[mt][1] = ptx::pack2<__half>(s[mt][2 * c][2], s[mt][2 * c][3]);
        pa[mt][2] = ptx::pack2<__half>(s[mt][2 * c + 1][0], s[mt][2 * c + 1][1]);
        pa[mt][3] = ptx::pack2<__half>(s[mt][2 * c + 1][2], s[mt][2 * c + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t vb[4];
        ptx::ldmatrix_x4_trans(vb, tv + (c * 16 + (mi & 1) * 8 + r8) * kStride + dp * 16 + (mi >> 1) * 8);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          ptx::mma_16816<__half>(o[mt][2 * dp], pa[mt], vb[0], vb[1]);
          ptx::mma_16816<__half>(o[mt][2 * dp + 1], pa[mt], vb[2], vb[3]);
        }
      }
    }
    __syncthreads();  // this stage is refilled by the next step's copy
  }
  ptx::cp_async_wait<0>();

  // O / l into the warp's own rows of sQ (no other warp reads them any more), then 16-byte stores.
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float l = l_run[mt][i];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const float inv = l > 0.f ? 1.f / l : 0.f;  // every real row sees its own key: l >= 1
      __half* dst = sQ + (warp_row0 + mt * 16 + gid + 8 * i) * kStride + tig * 2;
#pragma unroll
      for (int n = 0; n < D / 8; ++n)
        *reinterpret_cast<__half2*>(dst + n * 8) = __floats2half2_rn(o[mt][n][2 * i] * inv, o[mt][n][2 * i + 1] * inv);
    }
  __syncwarp();
  for (int i = lane; i < 16 * kMT * (D / 8); i += 32) {
    const int r = warp_row0 + i / (D / 8), c = i % (D / 8) * 8;
    if (r < rows) *reinterpret_cast<uint4*>(out_row(r) + c) = *reinterpret_cast<const uint4*>(sQ + r * kStride + c);
  }
}

template <int D, bool kCap, bool kWindow>
cudaError_t launch_prefill(const AttentionProblem& p, bool dependent, cudaStream_t stream) {
  const int m_blocks = (p.S * (p.H / p.Hkv) + block_rows<D>() - 1) / block_rows<D>();
  auto kernel = prefill_kernel<D, kCap, kWindow>;
  // over 48 KiB of shared memory needs the opt-in (per device: set at every launch, a host-side attribute)
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem_bytes<D>()));
  if (err != cudaSuccess) return err;
  return launch_kernel(kernel, dim3(p.Hkv, m_blocks, p.B), kThreads, smem_bytes<D>(), stream, dependent, p, m_blocks);
}

template <bool kCap, bool kWindow>
cudaError_t launch_options(const AttentionProblem& p, bool dependent, cudaStream_t stream) {
  switch (p.D) {
    case 64: return launch_prefill<64, kCap, kWindow>(p, dependent, stream);
    case 128: return launch_prefill<128, kCap, kWindow>(p, dependent, stream);
    default: return launch_prefill<256, kCap, kWindow>(p, dependent, stream);
  }
}

}  // namespace

bool prefill_applies(const AttentionProblem& p) {
  if (p.S < kPrefillMinTokens || (p.D != 64 && p.D != 128 && p.D != 256)) return false;
  if (kv_quantized(p.kv)) return false;  // fp16 tiles only (attention_prefill.h): the decode kernel takes them
  // on unless ES_GQA_PREFILL=0: faster than attention.cu's kernel wherever it applies (H200, session 16,
  // attention_prefill_bench.py: a 4k prompt 263 vs 6,376 us a layer, a 192-token chunk after 4,000 78 vs 536 us)
  const char* env = std::getenv("ES_GQA_PREFILL");
  return !(env && std::strcmp(env, "0") == 0);
}

cudaError_t attention_prefill_launch(const AttentionProblem& p, bool dependent, cudaStream_t stream) {
  const int threads = 256, items = p.S * p.Hkv * (p.D / 16);
  cudaError_t err = launch_kernel(append_kv_kernel, dim3((items + threads - 1) / threads, p.B), threads, 0, stream,
                                  dependent, p);
  if (err != cudaSuccess) return err;
  const bool cap = p.softcap > 0.f, window = p.window > 0;
  if (cap && window) return launch_options<true, true>(p, dependent, stream);
  if (cap) return launch_options<true, false>(p, dependent, stream);
  if (window) return launch_options<false, true>(p, dependent, stream);
  return launch_options<false, false>(p, dependent, stream);
}

}  // namespace enginesmith
