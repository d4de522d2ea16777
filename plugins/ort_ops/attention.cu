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
#include "attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "attention_prefill.h"
#include "launch.cuh"
#include "rotary.cuh"

namespace enginesmith {
namespace {

constexpr int kKeyTile = 32;  // keys a warp scores at once (one per lane)
// Warps per block: as many as shared memory (their outputs, R x D floats each) and registers allow,
// so a few hundred keys take one tile per warp (the kernel is latency-bound at decode sizes).
// Head size 256: R <= 8 (R x D floats per warp) with 8 warps at R = 4, 4 at R = 8.
__host__ __device__ constexpr int warps_for(int D, int R) {
  return D == 64 && R == 4 ? 16 : D == 128 && R == 16 ? 4 : D == 256 && R == 8 ? 4 : 8;
}
// Most query rows a block holds at head size D.
__host__ __device__ constexpr int max_rows(int D) { return D == 256 ? 8 : 16; }
// At least a tile per warp in a split.
__host__ __device__ constexpr int min_keys_per_split(int D, int R) { return warps_for(D, R) * kKeyTile; }
constexpr int kMaxSplits = 64;
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

// A lane's DL dims of one V row: 8-byte loads up to head size 128, 16-byte at 256.
template <int DL> struct VLoad { using type = uint2; };
template <> struct VLoad<8> { using type = uint4; };

struct Row {  // where a (row, token) of the problem lives
  const __half* token0;  // qkv of the row's first new token
  int stride;            // qkv elements per token
  size_t cache0;         // k/v cache offset of (row, KV head g, position 0)
};

// kCap: soft-capped scores (p.softcap); kWindow: a sliding window (p.window). Both off: the plain kernel.
template <int D, int R, bool kCap, bool kWindow, int kWarps = warps_for(D, R), int kThreads = kWarps * 32>
__global__ void __launch_bounds__(kThreads) attention_kernel(AttentionProblem p, int tile_tokens, int tiles,
                                                             int splits, float* partials, int32_t* counters) {
  constexpr int DL = D / 32;  // output dims per lane
  constexpr int HALF = D / 2;
  constexpr int KC = D <= 128 ? HALF : 32;  // dims of each half of the K row a lane holds at once
  // V rows loaded ahead, as registers allow
  constexpr int VG = D == 256 ? (R <= 4 ? 8 : 4) : kWarps == 16 || D == 128 ? (R <= 8 ? 16 : 8) : kKeyTile;
  using VVec = typename VLoad<DL>::type;
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
  const Row row{p.qkv + size_t(b) * p.S * (p.H + 2 * p.Hkv) * D, (p.H + 2 * p.Hkv) * D,
                (size_t(b) * p.Hkv + g) * p.C * D};
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
  const int first = kWindow ? max(0, past + s0 - p.window + 1) : 0;
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
  const float q_scale = kCap ? p.scale : p.scale * kLog2e;
  const float cap_inv = kCap ? 1.f / p.softcap : 0.f, cap_log2e = kCap ? p.softcap * kLog2e : 0.f;
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
    q_s[r][d] = y1 * q_scale;
    q_s[r][d + HALF] = y2 * q_scale;
    if (kv_row) {
      rotate(__half2float(k1), __half2float(k2), __half2float(kc), __half2float(ks), y1, y2);
      __half* kd = p.k_cache + row.cache0 + size_t(kv_pos) * D;
      __half* vd = p.v_cache + row.cache0 + size_t(kv_pos) * D;
      kd[d] = __float2half_rn(y1);
      kd[d + HALF] = __float2half_rn(y2);
      vd[d] = v1;
      vd[d + HALF] = v2;
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
  // A new key or value (position >= past) comes from qkv: the cache write above is not visible yet.
  auto k_row = [&](int j) {
    return j >= past ? row.token0 + size_t(j - past) * row.stride + (p.H + g) * D : p.k_cache + row.cache0 + size_t(j) * D;
  };
  auto v_row = [&](int j) {
    return j >= past ? row.token0 + size_t(j - past) * row.stride + (p.H + p.Hkv + g) * D
                     : p.v_cache + row.cache0 + size_t(j) * D;
  };
  auto load_v = [&](int t0, int k0, VVec (&v)[VG]) {  // lane's DL dims of keys t0 + k0 .. + VG - 1
#pragma unroll
    for (int u = 0; u < VG; ++u) {
      const int key = t0 + k0 + u;
      v[u] = VVec{};
      if (key < hi) {
        const __half* vr = v_row(key) + lane * DL;
        if constexpr (DL == 2) v[u].x = *reinterpret_cast<const uint32_t*>(vr);
        else v[u] = *reinterpret_cast<const VVec*>(vr);
      }
    }
  };
  // lane's K row (key j), dims c0 .. c0 + KC - 1 of each half: kv[0, KC/8) then kv[KC/8, KC/4)
  auto load_k = [&](int j, int c0, uint4 (&kv)[KC / 4]) {
    if (j < hi) {
      const __half* k = k_row(j);
#pragma unroll
      for (int c = 0; c < KC / 4; ++c)
        kv[c] = *reinterpret_cast<const uint4*>(k + (c < KC / 8 ? c0 : HALF + c0 - KC) + c * 8);
    } else {
#pragma unroll
      for (int c = 0; c < KC / 4; ++c) kv[c] = make_uint4(0, 0, 0, 0);
    }
  };

  for (int t0 = lo + warp * kKeyTile; t0 < hi; t0 += kWarps * kKeyTile) {
    const int j = t0 + lane;
    // issue the tile's K row (lane j; its first chunk) and V loads first: one memory latency per tile
    uint4 kv[KC / 4];
    load_k(j, 0, kv);
    VVec v[VG];
    load_v(t0, 0, v);
    float sc[R][2];  // two chains per row (halves of the head)
#pragma unroll
    for (int r = 0; r < R; ++r) sc[r][0] = sc[r][1] = 0.f;
    const bool fresh = j < hi && j >= past;
#pragma unroll
    for (int c = 0; c < HALF; c += 8) {
      if (c % KC == 0 && c > 0) load_k(j, c, kv);  // head size 256: the next chunk
      float x1[8], x2[8];
      to_floats(kv[(c % KC) / 8], x1);
      to_floats(kv[(c % KC + KC) / 8], x2);
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
      const bool valid = j < hi && r < rows && j <= past + s0 + r / G && (!kWindow || j > past + s0 + r / G - p.window);
      float score = sc[r][0] + sc[r][1];
      if constexpr (kCap) score = cap_log2e * tanhf(score * cap_inv);
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
        const __half2* vh = reinterpret_cast<const __half2*>(&v[u]);
#pragma unroll
        for (int e = 0; e < DL; e += 2) {
          const float2 f = __half22float2(vh[e / 2]);
          vf[e] = f.x;
          vf[e + 1] = f.y;
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
    for (int e = 0; e < DL; ++e) o_s[warp][r][lane * DL + e] = o[r][e];
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

template <int D, int R, bool kCap, bool kWindow>
cudaError_t launch_dr(const AttentionProblem& p, const AttentionPlan& plan, float* partials, int32_t* counters,
                      cudaStream_t stream) {
  const dim3 grid(plan.splits, p.Hkv, p.B * plan.tiles);
  return launch_kernel(attention_kernel<D, R, kCap, kWindow>, grid, 32 * warps_for(D, R), 0, stream, plan.dependent, p,
                       plan.tile_tokens, plan.tiles, plan.splits, partials, counters);
}

template <int D, bool kCap, bool kWindow>
cudaError_t launch_d(const AttentionProblem& p, const AttentionPlan& plan, float* partials, int32_t* counters,
                     cudaStream_t stream) {
  switch (plan.rows_max) {
    case 4: return launch_dr<D, 4, kCap, kWindow>(p, plan, partials, counters, stream);
    case 8: return launch_dr<D, 8, kCap, kWindow>(p, plan, partials, counters, stream);
    default:
      if constexpr (max_rows(D) >= 16) return launch_dr<D, 16, kCap, kWindow>(p, plan, partials, counters, stream);
      return cudaErrorInvalidValue;  // attention_plan never asks for it (attention_check: at most 8 per KV head)
  }
}

template <bool kCap, bool kWindow>
cudaError_t launch_options(const AttentionProblem& p, const AttentionPlan& plan, float* partials, int32_t* counters,
                           cudaStream_t stream) {
  switch (p.D) {
    case 64: return launch_d<64, kCap, kWindow>(p, plan, partials, counters, stream);
    case 128: return launch_d<128, kCap, kWindow>(p, plan, partials, counters, stream);
    default: return launch_d<256, kCap, kWindow>(p, plan, partials, counters, stream);
  }
}

}  // namespace

const char* attention_check(const AttentionProblem& p) {
  if (p.B <= 0 || p.S <= 0 || p.H <= 0 || p.Hkv <= 0 || p.C <= 0 || p.P <= 0) return "empty or negative dimension";
  if (p.D != 64 && p.D != 128 && p.D != 256) return "head size must be 64, 128 or 256";
  if (p.H % p.Hkv != 0) return "num_heads must be a multiple of kv_num_heads";
  if (p.H / p.Hkv > 16) return "at most 16 query heads per KV head";
  if (p.D == 256 && p.H / p.Hkv > max_rows(256)) return "at most 8 query heads per KV head at head size 256";
  if (!(p.softcap >= 0.f) || !std::isfinite(p.softcap)) return "softcap must be >= 0 (0: off)";
  if (p.window == 0 || p.window < -1) return "local_window_size must be positive, or -1 (off)";
  if (!(p.scale > 0.f) || !std::isfinite(p.scale)) return "scale must be positive";
  if (p.max_total < 1 || p.max_total > p.C) return "total_sequence_length must be in [1, the cache capacity]";
  for (const void* ptr : {static_cast<const void*>(p.qkv), static_cast<const void*>(p.k_cache),
                          static_cast<const void*>(p.v_cache), static_cast<const void*>(p.cos),
                          static_cast<const void*>(p.sin)})
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return "qkv, caches and rotary tables must be 16-byte aligned";
  return "";
}

AttentionPlan attention_plan(const AttentionProblem& p, int sms) {
  AttentionPlan plan;
  if (prefill_applies(p)) {
    plan.prefill = true;
    return plan;
  }
  const int G = p.H / p.Hkv;
  // the fewest rows that hold the group; for prompts more (several tokens share each K/V read), as
  // registers allow (head size 128 spills at 16)
  const int fit = G <= 4 ? 4 : G <= 8 ? 8 : 16;
  plan.rows_max = p.S == 1 ? fit : std::max(fit, p.D == 64 ? 16 : 8);
  plan.tile_tokens = std::max(1, std::min(plan.rows_max / G, p.S));
  plan.tiles = (p.S + plan.tile_tokens - 1) / plan.tile_tokens;
  const long triples = long(p.B) * plan.tiles * p.Hkv;
  if (triples < sms) {  // too few blocks to fill the GPU: split the keys
    const int min_keys = min_keys_per_split(p.D, plan.rows_max);
    // a block reads at most its tile's window of keys
    const int keys = p.window > 0 ? std::min(p.max_total, p.window + plan.tile_tokens - 1) : p.max_total;
    const int by_keys = (keys + min_keys - 1) / min_keys;
    const int by_gpu = int((2L * sms + triples - 1) / triples);
    plan.splits = std::max(1, std::min({kMaxSplits, by_keys, by_gpu}));
  }
  if (plan.splits > 1) {
    plan.partial_floats = size_t(triples) * plan.splits * plan.rows_max * (p.D + 2);
    plan.counters = size_t(triples);
  }
  return plan;
}

cudaError_t attention_launch(const AttentionProblem& p, const AttentionPlan& plan, float* partials,
                             int32_t* counters, cudaStream_t stream) {
  if (plan.prefill) return attention_prefill_launch(p, plan.dependent, stream);
  const bool cap = p.softcap > 0.f, window = p.window > 0;
  if (cap && window) return launch_options<true, true>(p, plan, partials, counters, stream);
  if (cap) return launch_options<true, false>(p, plan, partials, counters, stream);
  if (window) return launch_options<false, true>(p, plan, partials, counters, stream);
  return launch_options<false, false>(p, plan, partials, counters, stream);
}

void attention_reference(const AttentionProblem& p) {
  const int G = p.H / p.Hkv, D = p.D, HALF = D / 2, stride = (p.H + 2 * p.Hkv) * D;
  auto f = [](const __half& h) { return __half2float(h); };
  std::vector<float> q(D), score;
  for (int b = 0; b < p.B; ++b) {
    const int total = p.seqlens[b] + 1, past = total - p.S;
    const __half* tok = p.qkv + size_t(b) * p.S * stride;
    __half* out = p.out + size_t(b) * p.S * p.H * D;
    if (past < 0 || total > p.C || total > p.P) {
      std::fill(out, out + size_t(p.S) * p.H * D, __float2half(NAN));
      continue;
    }
    for (int s = 0; s < p.S; ++s) {  // the new keys (rotated) and values into the cache
      const int pos = past + s;
      for (int g = 0; g < p.Hkv; ++g) {
        const __half* k = tok + size_t(s) * stride + (p.H + g) * D;
        const __half* v = k + p.Hkv * D;
        const size_t at = ((size_t(b) * p.Hkv + g) * p.C + pos) * D;
        for (int d = 0; d < HALF; ++d) {
          float y1, y2;
          rotate(f(k[d]), f(k[d + HALF]), f(p.cos[size_t(pos) * HALF + d]), f(p.sin[size_t(pos) * HALF + d]), y1, y2);
          p.k_cache[at + d] = __float2half_rn(y1);
          p.k_cache[at + d + HALF] = __float2half_rn(y2);
          p.v_cache[at + d] = v[d];
          p.v_cache[at + d + HALF] = v[d + HALF];
        }
      }
    }
    for (int s = 0; s < p.S; ++s) {
      const int pos = past + s;
      for (int h = 0; h < p.H; ++h) {
        const int g = h / G;
        const __half* qh = tok + size_t(s) * stride + h * D;
        for (int d = 0; d < HALF; ++d)
          rotate(f(qh[d]), f(qh[d + HALF]), f(p.cos[size_t(pos) * HALF + d]), f(p.sin[size_t(pos) * HALF + d]), q[d],
                 q[d + HALF]);
        const size_t c0 = (size_t(b) * p.Hkv + g) * p.C * D;
        const int first = p.window > 0 ? std::max(0, pos - p.window + 1) : 0;  // keys first .. pos
        score.assign(pos + 1 - first, 0.f);
        float mx = -INFINITY;
        for (int j = first; j <= pos; ++j) {
          float dot = 0.f;
          for (int d = 0; d < D; ++d) dot += q[d] * f(p.k_cache[c0 + size_t(j) * D + d]);
          float sj = dot * p.scale;
          if (p.softcap > 0.f) sj = p.softcap * std::tanh(sj / p.softcap);
          score[j - first] = sj;
          mx = std::max(mx, sj);
        }
        float sum = 0.f;
        for (float& sj : score) sum += (sj = std::exp(sj - mx));
        for (int d = 0; d < D; ++d) {
          float acc = 0.f;
          for (int j = first; j <= pos; ++j) acc += score[j - first] * f(p.v_cache[c0 + size_t(j) * D + d]);
          out[(size_t(s) * p.H + h) * D + d] = __float2half_rn(acc / sum);
        }
      }
    }
  }
}

}  // namespace enginesmith
