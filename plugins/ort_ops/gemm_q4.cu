// Batched W4A16 products on tensor cores (gemm_q4.h says what and how).
#include "gemm_q4.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "../common/mma.cuh"
#include "gemv.h"

namespace enginesmith {
namespace {

constexpr int kWarps = 4;
constexpr int kBlockN = 64;         // output columns a block owns: 16 a warp, two n8 tiles
constexpr int kChunkK = 64;         // K values a block stages per step
constexpr int kRowWords = 34;       // x's shared row: 64 halves + 4 (34 words: the 64-bit fragment
                                    // reads of a half warp fall on distinct banks)
constexpr int kMinChunksPerSplit = 4;

__device__ __forceinline__ float silu(float g) { return g / (1.f + __expf(-g)); }

// Two int4 codes of one byte (low nibble first) -> two fp16 values (q - 8) * scale.
__device__ __forceinline__ uint32_t dequant_pair(uint32_t byte, __half2 scale) {
  const __half2 q = __floats2half2_rn(float(int(byte & 0xFu) - 8), float(int(byte >> 4) - 8));
  const __half2 v = __hmul2(q, scale);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// One block: 64 columns from n0 = blockIdx.x * 64, every row (MT m16 tiles), the K chunks of split blockIdx.y.
// partial[w][split][M][N] (fp32) for the weights w < (SW ? 2 : 1).
template <int MT, bool SW>
__global__ void __launch_bounds__(kWarps * 32) gemm_q4_kernel(GemvProblem p, const __half* x, float* partial,
                                                               int chunks_per_split) {
  constexpr int NW = SW ? 2 : 1;
  __shared__ __align__(16) uint32_t xs[MT * 16 * kRowWords];  // read as uint2: 8-byte aligned at least
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.x * kBlockN + warp * 16;
  const int chunks = p.K / kChunkK;
  const int c_begin = blockIdx.y * chunks_per_split, c_end = min(chunks, c_begin + chunks_per_split);
  const int blocks_per_row = p.K / p.block_size;

  float acc[NW][MT][2][4];
#pragma unroll
  for (int w = 0; w < NW; ++w)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[w][mt][j][i] = 0.f;

  // this lane's weights of chunk c: 16 int4 values (8 bytes) of column n, K values 64c + 16t .. + 15, one scale;
  // the next chunk's are loaded before this chunk's products (their latency behind the MMAs)
  uint2 wbits[NW][2], wnext[NW][2];
  __half2 scale[NW][2], snext[NW][2];
  auto load_weights = [&](int c, uint2 (&bits)[NW][2], __half2 (&sc)[NW][2]) {
#pragma unroll
    for (int w = 0; w < NW; ++w)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int n = n0 + 8 * j + g;
        if (n < p.N) {
          const uint8_t* row = static_cast<const uint8_t*>(p.w[w]) + size_t(n) * (p.K / 2);
          bits[w][j] = *reinterpret_cast<const uint2*>(row + c * (kChunkK / 2) + 8 * t);
          sc[w][j] = __half2half2(p.scales[w][size_t(n) * blocks_per_row + (c * kChunkK + 16 * t) / p.block_size]);
        } else {  // a column past N: zero weights (code 8, scale 0), never written
          bits[w][j] = make_uint2(0x88888888u, 0x88888888u);
          sc[w][j] = __float2half2_rn(0.f);
        }
      }
  };
  if (c_begin < c_end) load_weights(c_begin, wbits, scale);
  for (int c = c_begin; c < c_end; ++c) {
    const int kc = c * kChunkK;
    if (c + 1 < c_end) load_weights(c + 1, wnext, snext);
    // x's rows for this chunk into shared memory (rows past M as zeros), 8 halves a copy
    for (int v = threadIdx.x; v < MT * 16 * 8; v += kWarps * 32) {
      const int r = v >> 3, col = (v & 7) * 8;
      uint4 val = make_uint4(0, 0, 0, 0);
      if (r < p.M) val = *reinterpret_cast<const uint4*>(x + size_t(r) * p.K + kc + col);
      uint2* dst = reinterpret_cast<uint2*>(&xs[r * kRowWords + col / 2]);
      dst[0] = make_uint2(val.x, val.y);
      dst[1] = make_uint2(val.z, val.w);
    }
    __syncthreads();
#pragma unroll
    for (int s = 0; s < 4; ++s) {  // k16 step s: this lane's K values 16t + 4s .. 16t + 4s + 3
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const uint2 lo = *reinterpret_cast<const uint2*>(&xs[(mt * 16 + g) * kRowWords + 8 * t + 2 * s]);
        const uint2 hi = *reinterpret_cast<const uint2*>(&xs[(mt * 16 + g + 8) * kRowWords + 8 * t + 2 * s]);
        a[mt][0] = lo.x;  // row g,     MMA columns 2t, 2t + 1   = K values +0, +1
        a[mt][1] = hi.x;  // row g + 8, MMA columns 2t, 2t + 1
        a[mt][2] = lo.y;  // row g,     MMA columns 2t + 8, + 9  = K values +2, +3
        a[mt][3] = hi.y;  // row g + 8, MMA columns 2t + 8, + 9
      }
#pragma unroll
      for (int w = 0; w < NW; ++w)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          // bytes 2s and 2s + 1 of the lane's 8: K values 4s, 4s + 1 (b0) and 4s + 2, 4s + 3 (b1)
          const uint32_t word = s < 2 ? wbits[w][j].x : wbits[w][j].y;
          const uint32_t shift = (s & 1) * 16;
          const uint32_t b0 = dequant_pair((word >> shift) & 0xFFu, scale[w][j]);
          const uint32_t b1 = dequant_pair((word >> (shift + 8)) & 0xFFu, scale[w][j]);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) ptx::mma_16816<__half>(acc[w][mt][j], a[mt], b0, b1);
        }
    }
    __syncthreads();
#pragma unroll
    for (int w = 0; w < NW; ++w)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        wbits[w][j] = wnext[w][j];
        scale[w][j] = snext[w][j];
      }
  }
  // C fragment: rows g and g + 8 of each m tile, columns 2t and 2t + 1 of each n8 tile
#pragma unroll
  for (int w = 0; w < NW; ++w) {
    float* out = partial + (size_t(w) * gridDim.y + blockIdx.y) * size_t(p.M) * p.N;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int row = mt * 16 + g + (i >= 2 ? 8 : 0), col = n0 + 8 * j + 2 * t + (i & 1);
          if (row < p.M && col < p.N) out[size_t(row) * p.N + col] = acc[w][mt][j][i];
        }
  }
}

// y[m, n] = the splits' sum, in split order (silu(gate) * up with two weights), as fp16.
__global__ void gemm_q4_reduce_kernel(const float* partial, __half* y, int M, int N, int splits, bool swiglu) {
  const size_t count = size_t(M) * N;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x) {
    float gate = 0.f, up = 0.f;
    for (int s = 0; s < splits; ++s) gate += partial[size_t(s) * count + i];
    if (swiglu) {
      for (int s = 0; s < splits; ++s) up += partial[(size_t(splits) + s) * count + i];
      gate = silu(gate) * up;
    }
    y[i] = __float2half_rn(gate);
  }
}

template <int MT, bool SW>
cudaError_t launch_tiles(const GemvProblem& p, const __half* x, float* partial, int splits, cudaStream_t stream) {
  const int chunks = p.K / kChunkK, per = (chunks + splits - 1) / splits;
  const dim3 grid((p.N + kBlockN - 1) / kBlockN, splits);
  gemm_q4_kernel<MT, SW><<<grid, kWarps * 32, 0, stream>>>(p, x, partial, per);
  return cudaGetLastError();
}

static_assert(kGemmQ4MaxRows <= 4 * 16, "launch_rows instantiates at most 4 m16 tiles");

template <bool SW>
cudaError_t launch_rows(const GemvProblem& p, const __half* x, float* partial, int splits, cudaStream_t stream) {
  switch ((p.M + 15) / 16) {
    case 1: return launch_tiles<1, SW>(p, x, partial, splits, stream);
    case 2: return launch_tiles<2, SW>(p, x, partial, splits, stream);
    case 3: return launch_tiles<3, SW>(p, x, partial, splits, stream);
    default: return launch_tiles<4, SW>(p, x, partial, splits, stream);
  }
}

int multiprocessors() {
  static const int count = [] {
    int device = 0, sms = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0)
      return 132;
    return sms;
  }();
  return count;
}

}  // namespace

bool gemm_q4_applies(const GemvProblem& p) {
  if (!p.q4 || p.M < 5 || p.M > kGemmQ4MaxRows || p.K % kChunkK != 0) return false;
  const char* env = std::getenv("ES_Q4_MMA");
  return env != nullptr && std::strcmp(env, "1") == 0;
}

int gemm_q4_splits(int N, int K) {
  // about two blocks a multiprocessor, each split at least kMinChunksPerSplit chunks of K, and no split
  // left empty by the rounding of chunks per split
  const int column_blocks = (N + kBlockN - 1) / kBlockN, chunks = K / kChunkK;
  const int want = (2 * multiprocessors() + column_blocks - 1) / column_blocks;
  const int splits = std::max(1, std::min(want, chunks / kMinChunksPerSplit));
  const int per = (chunks + splits - 1) / splits;
  return (chunks + per - 1) / per;
}

size_t gemm_q4_workspace_bytes(const GemvProblem& p) {
  return size_t(p.swiglu ? 2 : 1) * gemm_q4_splits(p.N, p.K) * size_t(p.M) * p.N * sizeof(float);
}

cudaError_t gemm_q4_launch(const GemvProblem& p, const __half* x, float* workspace, cudaStream_t stream) {
  const int splits = gemm_q4_splits(p.N, p.K);
  const cudaError_t err = p.swiglu ? launch_rows<true>(p, x, workspace, splits, stream)
                                   : launch_rows<false>(p, x, workspace, splits, stream);
  if (err != cudaSuccess) return err;
  const size_t count = size_t(p.M) * p.N;
  const int blocks = int(std::min<size_t>((count + 255) / 256, 4096));
  gemm_q4_reduce_kernel<<<blocks, 256, 0, stream>>>(workspace, p.y, p.M, p.N, splits, p.swiglu);
  return cudaGetLastError();
}

}  // namespace enginesmith
