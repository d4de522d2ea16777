// Group-query attention with rotary embedding over a dense KV cache (see attention.h).
//
// One block = 4 to 16 warps (warps_for) on (split, KV head, query tile, row). Its R query rows (token t
// of the tile x head i of the group: row t * G + i) are rotated once into shared memory. Each warp walks
// 32-key tiles of the block's key range, loading a tile's K row (lane j) and V values before using them:
//   scores: lane l takes key l of the tile, its whole K row (16-byte loads), against all R rows of q;
//   online softmax per row (running max m and sum l, exp2 domain: q carries scale * log2(e));
//   P·V: lane l owns D/32 output dims; each key's probability comes from its lane by a shuffle.
// Head size 256 reads the K row in chunks of 32 dims of each half (64 and 128: the whole row at once).
// With a window, the block's key range starts at the window of its first query token.
// The warps merge (m, l, O) in shared memory; then the output (one used split) or the partial + the
// last-block merge (see attention.h). Prompts go to attention_prefill.cu (tensor cores).
// Quantized caches (kv_quant.h): the K row and V values are loaded as codes (8 bytes per 8 dims) and
// widened to fp32 (exact); q carries K's channel scales and the warps' outputs take V's; the new keys
// and values, read from qkv, are encoded as the cache write encodes them, so every read is a code.
//
// This header holds the kernel template and its launchers (included by attention_decode_instance.cu only).
#pragma once

#include <type_traits>

#include "attention_decode.h"
#include "launch.cuh"
#include "rotary.cuh"

namespace enginesmith {
namespace attention_decode {

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ void to_floats(const uint4& v, float f[8]) {
  const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __half22float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

__device__ __forceinline__ float warp_max(float v) {
  for (int off = 16; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// A lane's DL dims of one V row: 8-byte loads up to head size 128, 16-byte at 256; codes (quantized
// caches, one byte a dim): DL bytes.
template <int DL, bool kCodes = false> struct VLoad { using type = uint2; };
template <> struct VLoad<8> { using type = uint4; };
template <> struct VLoad<2, true> { using type = unsigned short; };
template <> struct VLoad<4, true> { using type = uint32_t; };
template <> struct VLoad<8, true> { using type = uint2; };

// The 32-bit words of N <= 8 packed codes, and back.
__device__ __forceinline__ void code_words(unsigned short v, uint32_t w[2]) { w[0] = v, w[1] = 0; }
__device__ __forceinline__ void code_words(uint32_t v, uint32_t w[2]) { w[0] = v, w[1] = 0; }
__device__ __forceinline__ void code_words(uint2 v, uint32_t w[2]) { w[0] = v.x, w[1] = v.y; }
template <typename T> __device__ __forceinline__ T pack_codes(const uint32_t w[2]) {
  if constexpr (std::is_same_v<T, uint2>) return make_uint2(w[0], w[1]);
  else return static_cast<T>(w[0]);
}

// N codes (a multiple of 2) packed in w, widened to floats (exact: kv_decode's values, in pairs for fp8).
template <KvFormat KV, int N> __device__ __forceinline__ void widen_codes(const uint32_t w[2], float f[N]) {
#pragma unroll
  for (int e = 0; e < N; e += 2) {
    const uint32_t pair = (w[e / 4] >> (8 * (e % 4))) & 0xffffu;
    if constexpr (KV == KvFormat::kInt8) {
      f[e] = kv_decode<KV>(uint8_t(pair & 0xffu));
      f[e + 1] = kv_decode<KV>(uint8_t(pair >> 8));
    } else {
      const float2 x = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(pair), __NV_E4M3)));
      f[e] = x.x;
      f[e + 1] = x.y;
    }
  }
}

// N <= 8 values -> their codes under scales[0 .. N), packed (kv_encode: the cache write's rounding).
template <KvFormat KV, int N> __device__ __forceinline__ void encode_codes(const float x[N], const float* scales,
                                                                          uint32_t w[2]) {
  w[0] = w[1] = 0;
#pragma unroll
  for (int e = 0; e < N; ++e) w[e / 4] |= uint32_t(kv_encode<KV>(x[e], __ldg(scales + e))) << (8 * (e % 4));
}

struct Row {  // where a (row, token) of the problem lives
  const __half* token0;  // qkv of the row's first new token
  int stride;            // qkv elements per token
  size_t cache0;         // k/v cache offset of (row, KV head g, position 0)
};

// kOptions: soft-capped scores (p.softcap > 0) and a sliding window (p.window > 0), each read at run time
// (uniform branches; off, the kernel compiles to the plain one: ES_PLAIN_VARIANTS); KV: the caches' format
// (p.kv). All off (kNative): the plain kernel.
template <int D, int R, bool kOptions, KvFormat KV, int kWarps = warps_for(D, R), int kThreads = kWarps * 32>
__global__ void __launch_bounds__(kThreads) attention_kernel(AttentionProblem p, int tile_tokens, int tiles,
                                                             int splits, float* partials, int32_t* counters) {
  constexpr int DL = D / 32;  // output dims per lane
  constexpr int HALF = D / 2;
  constexpr int KC = D <= 128 ? HALF : 32;  // dims of each half of the K row a lane holds at once
  // V rows loaded ahead, as registers allow
  constexpr int VG = D == 256 ? (R <= 4 ? 8 : 4) : kWarps == 16 || D == 128 ? (R <= 8 ? 16 : 8) : kKeyTile;
  constexpr bool kCodes = kv_quantized(KV);
  using VVec = typename VLoad<DL, kCodes>::type;
  using KChunk = std::conditional_t<kCodes, uint2, uint4>;  // 8 dims of a K row: fp16 values or codes
  using KvT = std::conditional_t<kCodes, uint8_t, __half>;  // the caches' element
  KvT* const k_cache = static_cast<KvT*>(p.k_cache);
  KvT* const v_cache = static_cast<KvT*>(p.v_cache);
  static_assert(R <= max_rows(D), "the warps' outputs fit in shared memory");
  __shared__ float q_s[R][D];  // rotated q (fp16 values) times scale * log2(e); rows >= `rows` are 0
  __shared__ float m_s[kWarps][R], l_s[kWarps][R];
  __shared__ float o_s[kWarps][R][D];  // the warps' outputs; then (last block) the splits' weights
  __shared__ int last_s;
  static_assert(kWarps * D >= kMaxSplits + 1, "the last block's merge weights fit in o_s");

  allow_next_kernel();  // the next kernel may preload its weights; it waits for this one to finish
  wait_for_previous_kernel();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int G = p.H / p.Hkv, g = blockIdx.y, split = blockIdx.x;
  const int b = blockIdx.z / tiles, s0 = (blockIdx.z % tiles) * tile_tokens;
  const int qn = min(tile_tokens, p.S - s0), rows = qn * G;
  const int total = p.seqlens[b] + 1, past = total - p.S;
  const bool cap = kOptions && p.softcap > 0.f, windowed = kOptions && p.window > 0;  // uniform
  const Row row{p.qkv + size_t(b) * p.S * (p.H + 2 * p.Hkv) * D, (p.H + 2 * p.Hkv) * D,
                (size_t(b) * p.Hkv + g) * p.C * D};
  // quantized caches: the KV head's channel scales, K's and V's (the lane's DL output dims in registers)
  const float* k_scale = kCodes ? p.kv_scale + size_t(g) * D : nullptr;
  const float* v_scale = kCodes ? p.kv_scale + size_t(p.Hkv + g) * D : nullptr;
  float vs[DL];
#pragma unroll
  for (int e = 0; e < DL; ++e) vs[e] = kCodes ? __ldg(v_scale + lane * DL + e) : 1.f;
  auto out_at = [&](int r, int d) -> __half& {
    return p.out[((size_t(b) * p.S + s0 + r / G) * p.H + g * G + r % G) * D + d];
  };

  if (past < 0 || total > p.C || total > p.P) {  // the same for every block of the row: no counter
    if (split == 0)
      for (int i = threadIdx.x; i < rows * D; i += kThreads) out_at(i / D, i % D) = __float2half(NAN);
    return;
  }
  // This split's keys: [lo, hi) of the tile's range [first, past + s0 + qn): causal, and with a window
  // from the first key its first query token sees.
  const int keys = past + s0 + qn;
  const int first = windowed ? max(0, past + s0 - p.window + 1) : 0;
  const int span = keys - first;
  const int per_split =
      max(min_keys_per_split(D, R), (span + splits - 1) / splits + kKeyTile - 1) / kKeyTile * kKeyTile;
  const int used = (span + per_split - 1) / per_split;
  const int lo = first + split * per_split, hi = min(keys, lo + per_split);
  if (split >= used) return;  // keys enough for fewer splits: nothing to do, no counter to bump
  const bool merged = used > 1;  // else split 0 writes the output itself

  // q rotated into shared memory; the split-0 block also writes the tile's new keys (rotated) and
  // values into the cache. All loads of an iteration are issued before any is used.
  // q carries scale * log2(e) (scores in the exp2 domain); soft-capping needs the plain scaled score
  // first, so then q carries the scale alone and the cap multiplies by log2(e).
  const float q_scale = cap ? p.scale : p.scale * kLog2e;
  const float cap_inv = cap ? 1.f / p.softcap : 0.f, cap_log2e = cap ? p.softcap * kLog2e : 0.f;
  for (int i = threadIdx.x; i < R * HALF; i += kThreads) {
    const int r = i / HALF, d = i % HALF;         // q: row r (token r / G of the tile, head r % G)
    const bool q_row = r < rows, kv_row = split == 0 && i < qn * HALF;  // k, v: token i / HALF
    const int q_pos = past + s0 + r / G, kv_pos = past + s0 + i / HALF;
    const __half* q = row.token0 + size_t(s0 + r / G) * row.stride + (g * G + r % G) * D;
    const __half* k = row.token0 + size_t(s0 + i / HALF) * row.stride + (p.H + g) * D;
    const __half* v = k + p.Hkv * D;
    __half q1, q2, qc, qs, k1, k2, v1, v2, kc, ks;
    if (q_row) {
      q1 = q[d], q2 = q[d + HALF];
      qc = p.cos[size_t(q_pos) * HALF + d], qs = p.sin[size_t(q_pos) * HALF + d];
    }
    if (kv_row) {
      k1 = k[d], k2 = k[d + HALF], v1 = v[d], v2 = v[d + HALF];
      kc = p.cos[size_t(kv_pos) * HALF + d], ks = p.sin[size_t(kv_pos) * HALF + d];
    }
    float y1 = 0.f, y2 = 0.f;
    if (q_row) rotate(__half2float(q1), __half2float(q2), __half2float(qc), __half2float(qs), y1, y2);
    if constexpr (kCodes) {  // K's channel scales fold into q: q . (s * code) = (q * s) . code
      q_s[r][d] = y1 * q_scale * __ldg(k_scale + d);
      q_s[r][d + HALF] = y2 * q_scale * __ldg(k_scale + d + HALF);
    } else {
      q_s[r][d] = y1 * q_scale;
      q_s[r][d + HALF] = y2 * q_scale;
    }
    if (kv_row) {
      rotate(__half2float(k1), __half2float(k2), __half2float(kc), __half2float(ks), y1, y2);
      KvT* kd = k_cache + row.cache0 + size_t(kv_pos) * D;
      KvT* vd = v_cache + row.cache0 + size_t(kv_pos) * D;
      if constexpr (kCodes) {  // y1, y2 are fp16 values (rotate rounds): the paged op's codes of them
        kd[d] = kv_encode<KV>(y1, __ldg(k_scale + d));
        kd[d + HALF] = kv_encode<KV>(y2, __ldg(k_scale + d + HALF));
        vd[d] = kv_encode<KV>(__half2float(v1), __ldg(v_scale + d));
        vd[d + HALF] = kv_encode<KV>(__half2float(v2), __ldg(v_scale + d + HALF));
      } else {
        kd[d] = __float2half_rn(y1);
        kd[d + HALF] = __float2half_rn(y2);
        vd[d] = v1;
        vd[d + HALF] = v2;
      }
    }
  }
  __syncthreads();

  float m[R], l[R], o[R][DL];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int j = 0; j < DL; ++j) o[r][j] = 0.f;
  }
  // A new key or value (position >= past) comes from qkv: the cache write above is not visible yet
  // (quantized caches: encoded as it was written).
  auto new_k = [&](int j) { return row.token0 + size_t(j - past) * row.stride + (p.H + g) * D; };
  auto new_v = [&](int j) { return row.token0 + size_t(j - past) * row.stride + (p.H + p.Hkv + g) * D; };
  auto k_row = [&](int j) -> const KvT* {
    if constexpr (kCodes) return k_cache + row.cache0 + size_t(j) * D;
    else return j >= past ? new_k(j) : k_cache + row.cache0 + size_t(j) * D;
  };
  auto v_row = [&](int j) -> const KvT* {
    if constexpr (kCodes) return v_cache + row.cache0 + size_t(j) * D;
    else return j >= past ? new_v(j) : v_cache + row.cache0 + size_t(j) * D;
  };
  auto load_v = [&](int t0, int k0, VVec (&v)[VG]) {  // lane's DL dims of keys t0 + k0 .. + VG - 1
#pragma unroll
    for (int u = 0; u < VG; ++u) {
      const int key = t0 + k0 + u;
      v[u] = VVec{};
      if (key < hi) {
        if constexpr (kCodes) {
          if (key >= past) {  // a new value: its codes
            float x[DL];
            const __half* vr = new_v(key) + lane * DL;
#pragma unroll
            for (int e = 0; e < DL; ++e) x[e] = __half2float(vr[e]);
            uint32_t w[2];
            encode_codes<KV, DL>(x, v_scale + lane * DL, w);
            v[u] = pack_codes<VVec>(w);
          } else {
            v[u] = *reinterpret_cast<const VVec*>(v_row(key) + lane * DL);
          }
        } else {
          const __half* vr = v_row(key) + lane * DL;
          if constexpr (DL == 2) v[u].x = *reinterpret_cast<const uint32_t*>(vr);
          else v[u] = *reinterpret_cast<const VVec*>(vr);
        }
      }
    }
  };
  // lane's K row (key j), dims c0 .. c0 + KC - 1 of each half: kv[0, KC/8) then kv[KC/8, KC/4)
  auto load_k = [&](int j, int c0, KChunk (&kv)[KC / 4]) {
    bool from_row = j < hi;
    if constexpr (kCodes) {
      if (j < hi && j >= past) {  // a new key: rotated and encoded as the cache write does
        from_row = false;
#pragma unroll
        for (int c = 0; c < KC / 8; ++c) {
          const int dd = c0 + c * 8;
          float x1[8], x2[8], cs[8], sn[8];
          to_floats(*reinterpret_cast<const uint4*>(new_k(j) + dd), x1);
          to_floats(*reinterpret_cast<const uint4*>(new_k(j) + HALF + dd), x2);
          to_floats(*reinterpret_cast<const uint4*>(p.cos + size_t(j) * HALF + dd), cs);
          to_floats(*reinterpret_cast<const uint4*>(p.sin + size_t(j) * HALF + dd), sn);
#pragma unroll
          for (int e = 0; e < 8; ++e) rotate(x1[e], x2[e], cs[e], sn[e], x1[e], x2[e]);
          uint32_t w[2];
          encode_codes<KV, 8>(x1, k_scale + dd, w);
          kv[c] = pack_codes<KChunk>(w);
          encode_codes<KV, 8>(x2, k_scale + HALF + dd, w);
          kv[KC / 8 + c] = pack_codes<KChunk>(w);
        }
        return;
      }
    }
    if (from_row) {
      const KvT* k = k_row(j);
#pragma unroll
      for (int c = 0; c < KC / 4; ++c)
        kv[c] = *reinterpret_cast<const KChunk*>(k + (c < KC / 8 ? c0 : HALF + c0 - KC) + c * 8);
    } else {
#pragma unroll
      for (int c = 0; c < KC / 4; ++c) kv[c] = KChunk{};
    }
  };

  for (int t0 = lo + warp * kKeyTile; t0 < hi; t0 += kWarps * kKeyTile) {
    const int j = t0 + lane;
    // issue the tile's K row (lane j; its first chunk) and V loads first: one memory latency per tile
    KChunk kv[KC / 4];
    load_k(j, 0, kv);
    VVec v[VG];
    load_v(t0, 0, v);
    float sc[R][2];  // two chains per row (halves of the head)
#pragma unroll
    for (int r = 0; r < R; ++r) sc[r][0] = sc[r][1] = 0.f;
    const bool fresh = !kCodes && j < hi && j >= past;  // fp16: a new key, rotated here (codes: in load_k)
#pragma unroll
    for (int c = 0; c < HALF; c += 8) {
      if (c % KC == 0 && c > 0) load_k(j, c, kv);  // head size 256: the next chunk
      float x1[8], x2[8];
      if constexpr (kCodes) {
        uint32_t w[2];
        code_words(kv[(c % KC) / 8], w);
        widen_codes<KV, 8>(w, x1);
        code_words(kv[(c % KC + KC) / 8], w);
        widen_codes<KV, 8>(w, x2);
      } else {
        to_floats(kv[(c % KC) / 8], x1);
        to_floats(kv[(c % KC + KC) / 8], x2);
      }
      if (fresh) {  // rotated as the cache write does
        float cs[8], sn[8];
        to_floats(*reinterpret_cast<const uint4*>(p.cos + size_t(j) * HALF + c), cs);
        to_floats(*reinterpret_cast<const uint4*>(p.sin + size_t(j) * HALF + c), sn);
#pragma unroll
        for (int e = 0; e < 8; ++e) rotate(x1[e], x2[e], cs[e], sn[e], x1[e], x2[e]);
      }
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          sc[r][0] = fmaf(q_s[r][c + e], x1[e], sc[r][0]);
          sc[r][1] = fmaf(q_s[r][c + e + HALF], x2[e], sc[r][1]);
        }
    }
    float pr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const bool valid = j < hi && r < rows && j <= past + s0 + r / G && (!windowed || j > past + s0 + r / G - p.window);
      float score = sc[r][0] + sc[r][1];
      if (cap) score = cap_log2e * tanhf(score * cap_inv);
      const float mt = warp_max(valid ? score : -INFINITY);
      const float m_new = fmaxf(m[r], mt);
      const float corr = m_new == -INFINITY ? 1.f : exp2f(m[r] - m_new);
      pr[r] = valid ? exp2f(score - m_new) : 0.f;
      l[r] = l[r] * corr + pr[r];
      m[r] = m_new;
#pragma unroll
      for (int e = 0; e < DL; ++e) o[r][e] *= corr;
    }
#pragma unroll
    for (int k0 = 0; k0 < kKeyTile; k0 += VG) {
      if (k0 > 0) load_v(t0, k0, v);
#pragma unroll
      for (int u = 0; u < VG; ++u) {
        float vf[DL];
        if constexpr (kCodes) {  // codes: V's scales multiply the warps' outputs
          uint32_t w[2];
          code_words(v[u], w);
          widen_codes<KV, DL>(w, vf);
        } else {
          const __half2* vh = reinterpret_cast<const __half2*>(&v[u]);
#pragma unroll
          for (int e = 0; e < DL; e += 2) {
            const float2 f = __half22float2(vh[e / 2]);
            vf[e] = f.x;
            vf[e + 1] = f.y;
          }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const float pk = __shfl_sync(0xffffffffu, pr[r], k0 + u);
#pragma unroll
          for (int e = 0; e < DL; ++e) o[r][e] = fmaf(pk, vf[e], o[r][e]);
        }
      }
    }
  }

  // Merge the warps: (m, l, o) per row.
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float lr = warp_sum(l[r]);
    if (lane == 0) {
      m_s[warp][r] = m[r];
      l_s[warp][r] = lr;
    }
#pragma unroll
    for (int e = 0; e < DL; ++e) o_s[warp][r][lane * DL + e] = kCodes ? o[r][e] * vs[e] : o[r][e];
  }
  __syncthreads();
  const int triple = blockIdx.z * p.Hkv + g;
  auto record = [&](int sp, int r) { return partials + ((size_t(triple) * splits + sp) * R + r) * (D + 2); };
  for (int i = threadIdx.x; i < R * D; i += kThreads) {
    const int r = i / D, d = i % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, m_s[w][r]);
    float sum = 0.f, acc = 0.f;
    if (mx != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float wt = exp2f(m_s[w][r] - mx);
        sum += l_s[w][r] * wt;
        acc += o_s[w][r][d] * wt;
      }
    }
    if (!merged) {
      if (r < rows) out_at(r, d) = __float2half_rn(acc / sum);
    } else {
      float* rec = record(split, r);
      if (d == 0) {
        rec[0] = mx;
        rec[1] = sum;
      }
      rec[2 + d] = acc;
    }
  }
  if (!merged) return;

  // The last block of the (row, tile, head) to finish merges the used splits, in split order.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last_s = atomicAdd(&counters[triple], 1) == used - 1;
  __syncthreads();
  if (!last_s) return;
  __threadfence();
  float* w_s = &o_s[0][0][0];  // [used][R] weights 2^(m - max), then [R] 1 / sum
  float* inv_s = w_s + kMaxSplits * R;
  for (int i = threadIdx.x; i < used * R; i += kThreads) w_s[i] = __ldcg(record(i / R, i % R));
  __syncthreads();
  for (int r = threadIdx.x; r < rows; r += kThreads) {
    float mx = -INFINITY, sum = 0.f;
    for (int sp = 0; sp < used; ++sp) mx = fmaxf(mx, w_s[sp * R + r]);
    for (int sp = 0; sp < used; ++sp) {
      const float mr = w_s[sp * R + r];
      const float wt = mr == -INFINITY ? 0.f : exp2f(mr - mx);
      sum += __ldcg(record(sp, r) + 1) * wt;
      w_s[sp * R + r] = wt;
    }
    inv_s[r] = 1.f / sum;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < rows * D; i += kThreads) {
    const int r = i / D, d = i % D;
    float acc = 0.f;
#pragma unroll 8
    for (int sp = 0; sp < used; ++sp) acc = fmaf(__ldcg(record(sp, r) + 2 + d), w_s[sp * R + r], acc);
    out_at(r, d) = __float2half_rn(acc * inv_s[r]);
  }
  if (threadIdx.x == 0) counters[triple] = 0;
}

template <int D, int R, bool kOptions, KvFormat KV>
cudaError_t launch_dr(const AttentionProblem& p, const AttentionPlan& plan, float* partials, int32_t* counters,
                      cudaStream_t stream) {
  const dim3 grid(plan.splits, p.Hkv, p.B * plan.tiles);
  return launch_kernel(attention_kernel<D, R, kOptions, KV>, grid, 32 * warps_for(D, R), 0, stream,
                       plan.dependent, p, plan.tile_tokens, plan.tiles, plan.splits, partials, counters);
}

template <KvFormat KV, int D, bool kOptions>
cudaError_t launch(const AttentionProblem& p, const AttentionPlan& plan, float* partials, int32_t* counters,
                   cudaStream_t stream) {
  switch (plan.rows_max) {
    case 4: return launch_dr<D, 4, kOptions, KV>(p, plan, partials, counters, stream);
    case 8: return launch_dr<D, 8, kOptions, KV>(p, plan, partials, counters, stream);
    default:
      if constexpr (max_rows(D) >= 16) return launch_dr<D, 16, kOptions, KV>(p, plan, partials, counters, stream);
      return cudaErrorInvalidValue;  // attention_plan never asks for it (attention_check: at most 8 per KV head)
  }
}

}  // namespace attention_decode
}  // namespace enginesmith
