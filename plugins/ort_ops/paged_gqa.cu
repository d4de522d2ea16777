// Paged group-query attention with rotary embedding (see paged_gqa.h): the rotary/split kernel, the
// launch (it and plugins/paged_attention's kernel with the fused KV write) and the CPU reference.
#include "paged_gqa.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <vector>

#include "../paged_attention/paged_attention.h"
#include "launch.cuh"
#include "rotary.cuh"

namespace enginesmith {
namespace {

namespace pa = paged_attention;

constexpr int kRotaryThreads = 128;
constexpr size_t kAlign = 256;

size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// Where the scratch buffer's parts start (bytes), in the order q, k, v, lens, split workspace.
struct ScratchLayout {
  size_t q = 0, k = 0, v = 0, lens = 0, workspace = 0, workspace_bytes = 0, total = 0;
};

ScratchLayout scratch_layout(const PagedGqaProblem& p, int splits) {
  ScratchLayout l;
  const size_t tokens = size_t(p.B) * p.S;
  const size_t kv_item = kv_quantized(p.kv) ? 1 : sizeof(__half);  // the new K/V in the pools' format
  l.k = l.q + align_up(tokens * p.H * p.D * sizeof(__half));
  l.v = l.k + align_up(tokens * p.Hkv * p.D * kv_item);
  l.lens = l.v + align_up(tokens * p.Hkv * p.D * kv_item);
  l.workspace = l.lens + align_up(size_t(p.B) * sizeof(int32_t));
  l.workspace_bytes = pa::workspace_size(p.B, p.S, p.H, p.D, splits);
  l.total = l.workspace + l.workspace_bytes;
  return l;
}

// Eight fp16 values (a 16-byte chunk) -> their eight codes under scales[0..7] (an 8-byte chunk).
template <KvFormat KV>
__device__ __forceinline__ uint2 encode8(uint4 values, const float* scales) {
  const __half* h = reinterpret_cast<const __half*>(&values);
  uint32_t w[2] = {0, 0};
#pragma unroll
  for (int e = 0; e < 8; ++e) w[e / 4] |= uint32_t(kv_encode<KV>(__half2float(h[e]), __ldg(scales + e))) << (8 * (e % 4));
  return make_uint2(w[0], w[1]);
}

// One 8-element chunk of the new K or V into the scratch: as is (native) or encoded with `scales`.
template <KvFormat KV>
__device__ __forceinline__ void store_kv(void* base, size_t at, uint4 values, const float* scales) {
  if constexpr (kv_quantized(KV)) {
    *reinterpret_cast<uint2*>(static_cast<uint8_t*>(base) + at) = encode8<KV>(values, scales);
  } else {
    *reinterpret_cast<uint4*>(static_cast<__half*>(base) + at) = values;
  }
}

// One block per (column s, row b): q and k of the token rotated at its position (16-byte chunks of
// 8 pairs), v copied, into the paged kernel's layouts (k and v encoded into codes for quantized
// pools); the row's block (s = 0) also writes lens[b]: context_lens[b], or 0 (a bad length for the
// paged kernel: NaN, nothing written) when a real column sits beyond the rotary tables. Columns outside
// the tables (padding, bad rows) get zeros.
template <KvFormat KV>
__global__ void __launch_bounds__(kRotaryThreads) rotary_split_kernel(PagedGqaProblem p, __half* q_out, void* k_out,
                                                                      void* v_out, int32_t* lens) {
  wait_for_previous_kernel();  // qkv, the lengths and slots may come from the kernel before
  allow_next_kernel();         // the paged kernel waits for this whole grid before its first read
  const int s = blockIdx.x, b = blockIdx.y, D = p.D, HALF = D / 2;
  const int ctx = p.context_lens[b];
  if (s == 0 && threadIdx.x < 32) {
    const int j = threadIdx.x;  // S <= 16 < 32 columns
    const bool beyond = j < p.S && p.slot_mapping[size_t(b) * p.S + j] != -1 && ctx - p.S + j >= p.P;
    const bool any = __any_sync(0xffffffffu, beyond);
    if (j == 0) lens[b] = any ? 0 : ctx;
  }
  const int pos = ctx - p.S + s;
  const bool in_table = pos >= 0 && pos < p.P;
  const size_t tok = size_t(b) * p.S + s;
  const __half* x = p.qkv + tok * (p.H + 2 * p.Hkv) * D;
  const int chunks = HALF / 8, rot_items = (p.H + p.Hkv) * chunks, items = rot_items + p.Hkv * (D / 8);
  for (int i = threadIdx.x; i < items; i += kRotaryThreads) {
    if (i >= rot_items) {  // v: a plain copy (quantized: encoded)
      const int j = i - rot_items, head = j / (D / 8), c = (j % (D / 8)) * 8;
      store_kv<KV>(v_out, (tok * p.Hkv + head) * D + c, *reinterpret_cast<const uint4*>(x + (p.H + p.Hkv + head) * D + c),
                   p.kv_scale + (p.Hkv + head) * D + c);
      continue;
    }
    const int head = i / chunks, c = (i % chunks) * 8;  // head < H: a q head, else k head head - H
    const __half* src = x + head * D + c;
    uint4 y1 = make_uint4(0, 0, 0, 0), y2 = make_uint4(0, 0, 0, 0);
    if (in_table) {
      const uint4 a = *reinterpret_cast<const uint4*>(src), bb = *reinterpret_cast<const uint4*>(src + HALF);
      const uint4 cs = *reinterpret_cast<const uint4*>(p.cos + size_t(pos) * HALF + c);
      const uint4 sn = *reinterpret_cast<const uint4*>(p.sin + size_t(pos) * HALF + c);
      const __half2 *a2 = reinterpret_cast<const __half2*>(&a), *b2 = reinterpret_cast<const __half2*>(&bb),
                    *c2 = reinterpret_cast<const __half2*>(&cs), *s2 = reinterpret_cast<const __half2*>(&sn);
      __half2 *o1 = reinterpret_cast<__half2*>(&y1), *o2 = reinterpret_cast<__half2*>(&y2);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 fa = __half22float2(a2[e]), fb = __half22float2(b2[e]), fc = __half22float2(c2[e]),
                     fs = __half22float2(s2[e]);
        float lo1, lo2, hi1, hi2;
        rotate(fa.x, fb.x, fc.x, fs.x, lo1, lo2);
        rotate(fa.y, fb.y, fc.y, fs.y, hi1, hi2);
        o1[e] = __floats2half2_rn(lo1, hi1);  // exact: rotate rounds to fp16
        o2[e] = __floats2half2_rn(lo2, hi2);
      }
    }
    if (head < p.H) {
      __half* dst = q_out + (tok * p.H + head) * D + c;
      *reinterpret_cast<uint4*>(dst) = y1;
      *reinterpret_cast<uint4*>(dst + HALF) = y2;
    } else {
      const size_t at = (tok * p.Hkv + head - p.H) * D + c;
      const float* scales = p.kv_scale + (head - p.H) * D + c;  // K's: kv_scale[0, g]
      store_kv<KV>(k_out, at, y1, scales);
      store_kv<KV>(k_out, at + HALF, y2, scales + HALF);
    }
  }
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

}  // namespace

std::string paged_gqa_check(const PagedGqaProblem& p) {
  if (p.B <= 0 || p.S <= 0 || p.H <= 0 || p.Hkv <= 0 || p.NB <= 0 || p.MB <= 0 || p.P <= 0)
    return "empty or negative dimension";
  const Status config = pa::check_config(DType::kFloat16, p.D, p.BS, p.H, p.Hkv, p.S, p.kv);
  if (!config.ok) return config.message;
  if (kv_quantized(p.kv) && p.kv_scale == nullptr)
    return std::string(kv_format_name(p.kv)) + " pools need kv_scale [2, kv_num_heads, head_size]";
  if (!(p.scale > 0.f) || !std::isfinite(p.scale)) return "scale must be positive (or 0 for 1 / sqrt(head_size))";
  if (!(p.softcap >= 0.f) || !std::isfinite(p.softcap)) return "softcap must be >= 0 (0: off)";
  if (p.window == 0 || p.window < -1) return "local_window_size must be positive, or -1 (off)";
  if (int64_t(p.NB) * p.BS > std::numeric_limits<int32_t>::max()) return "the pool has more slots than int32 holds";
  return "";
}

// ES_PAGED_SPLIT_WAVES=W (1..16, read per plan; default 1): the key splits are chosen for W waves of blocks
// instead of one. A knob for measuring whether more splits pay at mid batches (at batch 64 the step's
// attention ran unsplit at ~2 TB/s on an H200, session 18); the default is unchanged.
static int split_waves() {
  const char* env = std::getenv("ES_PAGED_SPLIT_WAVES");
  const int w = env ? std::atoi(env) : 1;
  return w >= 1 && w <= 16 ? w : 1;
}

Status paged_gqa_plan(const PagedGqaProblem& p, PagedGqaPlan* plan, bool batch_invariant) {
  int slots = 0;
  ES_RETURN_IF_ERROR(pa::resident_slots(DType::kFloat16, p.D, p.BS, &slots, p.kv));
  if (!batch_invariant) slots *= split_waves();
  plan->splits = batch_invariant ? pa::choose_num_splits(1, 1, p.H, p.Hkv, p.MB, p.BS, slots, p.window)
                                 : pa::choose_num_splits(p.B, p.S, p.H, p.Hkv, p.MB, p.BS, slots, p.window);
  plan->scratch_bytes = scratch_layout(p, plan->splits).total;
  plan->counters = plan->splits > 1 ? pa::split_counters_needed(p.B, p.S, p.H, p.Hkv) : 0;
  return Status::Ok();
}

Status paged_gqa_launch(const PagedGqaProblem& p, const PagedGqaPlan& plan, void* scratch, int32_t* counters,
                        cudaStream_t stream) {
  for (const void* ptr : {static_cast<const void*>(p.qkv), static_cast<const void*>(p.key_pool),
                          static_cast<const void*>(p.value_pool), static_cast<const void*>(p.cos),
                          static_cast<const void*>(p.sin), static_cast<const void*>(scratch)})
    if (!aligned16(ptr))
      return Status::Error("qkv, the pools, the rotary tables and the scratch must be 16-byte aligned");
  const ScratchLayout l = scratch_layout(p, plan.splits);
  char* base = static_cast<char*>(scratch);
  auto* q = reinterpret_cast<__half*>(base + l.q);
  void* k = base + l.k;
  void* v = base + l.v;
  auto* lens = reinterpret_cast<int32_t*>(base + l.lens);
  auto rotary = p.kv == KvFormat::kInt8      ? rotary_split_kernel<KvFormat::kInt8>
                : p.kv == KvFormat::kFp8E4M3 ? rotary_split_kernel<KvFormat::kFp8E4M3>
                                             : rotary_split_kernel<KvFormat::kNative>;
  ES_RETURN_IF_CUDA_ERROR(launch_kernel(rotary, dim3(p.S, p.B), kRotaryThreads, 0, stream, plan.dependent, p, q, k, v,
                                        lens));
  pa::Params a;
  a.query = q;
  a.k_cache = p.key_pool;
  a.v_cache = p.value_pool;
  a.block_tables = p.block_tables;
  a.context_lens = lens;
  a.out = p.out;
  a.split_counters = counters;
  a.num_split_counters = plan.counters;
  a.dependent_launch = plan.dependent ? 1 : 0;
  a.new_key = k;
  a.new_value = v;
  a.slot_mapping = p.slot_mapping;
  a.batch = p.B;
  a.query_len = p.S;
  a.num_heads = p.H;
  a.num_kv_heads = p.Hkv;
  a.head_size = p.D;
  a.block_size = p.BS;
  a.num_blocks = p.NB;
  a.max_blocks_per_seq = p.MB;
  a.num_splits = plan.splits;
  a.scale = p.scale;
  a.softcap = p.softcap;
  a.window = p.window;
  a.kv_format = p.kv;
  if (kv_quantized(p.kv)) {
    a.k_scale = p.kv_scale;
    a.v_scale = p.kv_scale + size_t(p.Hkv) * p.D;
  }
  return pa::launch_paged_attention(a, base + l.workspace, l.workspace_bytes, 0, stream);
}

void paged_gqa_reference(const PagedGqaProblem& p) {
  const int G = p.H / p.Hkv, D = p.D, HALF = D / 2, stride = (p.H + 2 * p.Hkv) * D;
  const int64_t pool_slots = int64_t(p.NB) * p.BS;
  auto f = [](const __half& h) { return __half2float(h); };
  std::vector<float> q(D), k(D), acc(D), score, row(D);
  // The pools' elements at element offset `at` (a row of D): stored from fp32 values (native: the
  // value rounded to fp16, as given; quantized: its code), and read back as values (code * scale).
  // `which` 0: K, 1: V; g the KV head.
  auto put = [&](void* pool, size_t at, int which, int g, int d, float value) {
    const float s = kv_quantized(p.kv) ? p.kv_scale[(size_t(which) * p.Hkv + g) * D + d] : 0.f;
    if (p.kv == KvFormat::kInt8)
      static_cast<uint8_t*>(pool)[at + d] = kv_encode<KvFormat::kInt8>(value, s);
    else if (p.kv == KvFormat::kFp8E4M3)
      static_cast<uint8_t*>(pool)[at + d] = kv_encode<KvFormat::kFp8E4M3>(value, s);
    else
      static_cast<__half*>(pool)[at + d] = __float2half_rn(value);
  };
  auto get = [&](const void* pool, size_t at, int which, int g, std::vector<float>& y) {
    const float* s = p.kv_scale + (size_t(which) * p.Hkv + g) * D;
    for (int d = 0; d < D; ++d) {
      if (p.kv == KvFormat::kInt8)
        y[d] = kv_decode<KvFormat::kInt8>(static_cast<const uint8_t*>(pool)[at + d]) * s[d];
      else if (p.kv == KvFormat::kFp8E4M3)
        y[d] = kv_decode<KvFormat::kFp8E4M3>(static_cast<const uint8_t*>(pool)[at + d]) * s[d];
      else
        y[d] = f(static_cast<const __half*>(pool)[at + d]);
    }
  };
  for (int b = 0; b < p.B; ++b) {
    const int ctx = p.context_lens[b];
    const int32_t* table = p.block_tables + size_t(b) * p.MB;
    const int32_t* slots = p.slot_mapping + size_t(b) * p.S;
    const __half* tok = p.qkv + size_t(b) * p.S * stride;
    __half* out = p.out + size_t(b) * p.S * p.H * D;
    auto poison = [&] { std::fill(out, out + size_t(p.S) * p.H * D, __float2half(NAN)); };
    bool bad = ctx < p.S || int64_t(ctx) > int64_t(p.MB) * p.BS;
    for (int s = 0; s < p.S && !bad; ++s) bad = slots[s] != -1 && ctx - p.S + s >= p.P;
    if (bad) {  // nothing of the row is written
      poison();
      continue;
    }
    // the rotary input of column s, head offset `at` (q: h * D, k: (H + g) * D), rotated at pos
    auto rotated = [&](int s, int at, int pos, std::vector<float>& y) {
      const __half* x = tok + size_t(s) * stride + at;
      for (int d = 0; d < HALF; ++d)
        rotate(f(x[d]), f(x[d + HALF]), f(p.cos[size_t(pos) * HALF + d]), f(p.sin[size_t(pos) * HALF + d]), y[d],
               y[d + HALF]);
    };
    for (int s = 0; s < p.S; ++s) {  // the new keys (rotated) and values into their slots
      const int pos = ctx - p.S + s;
      const int64_t slot = slots[s];
      if (slot == -1) continue;
      if (slot < 0 || slot >= pool_slots || slot != int64_t(table[pos / p.BS]) * p.BS + pos % p.BS) {
        bad = true;  // not its position's slot: not written
        continue;
      }
      for (int g = 0; g < p.Hkv; ++g) {
        rotated(s, (p.H + g) * D, pos, k);
        const __half* v = tok + size_t(s) * stride + (p.H + p.Hkv + g) * D;
        const size_t at = (size_t(slot) * p.Hkv + g) * D;
        for (int d = 0; d < D; ++d) {
          put(p.key_pool, at, 0, g, d, k[d]);  // k[d] is fp16-exact (rotate rounds)
          put(p.value_pool, at, 1, g, d, f(v[d]));
        }
      }
    }
    // the pages read: all of the row's, or (window) from the page of the first column's window start
    const int first_page = p.window > 0 ? std::max(0, ctx - p.S - p.window + 1) / p.BS : 0;
    for (int i = first_page; i < (ctx + p.BS - 1) / p.BS; ++i) bad |= table[i] < 0 || table[i] >= p.NB;
    if (bad) {
      poison();
      continue;
    }
    auto cached = [&](int j, int g) {  // element offset of position j of the row, KV head g
      return ((size_t(table[j / p.BS]) * p.BS + j % p.BS) * p.Hkv + g) * D;
    };
    for (int s = 0; s < p.S; ++s) {
      const int pos = ctx - p.S + s;
      if (slots[s] == -1) {  // padding: unspecified, zeros here
        std::fill(out + size_t(s) * p.H * D, out + size_t(s + 1) * p.H * D, __float2half(0.f));
        continue;
      }
      const int first = p.window > 0 ? std::max(0, pos - p.window + 1) : 0;  // keys first .. pos
      for (int h = 0; h < p.H; ++h) {
        const int g = h / G;
        rotated(s, h * D, pos, q);
        score.assign(pos + 1 - first, 0.f);
        float mx = -INFINITY;
        for (int j = first; j <= pos; ++j) {
          get(p.key_pool, cached(j, g), 0, g, row);
          float dot = 0.f;
          for (int d = 0; d < D; ++d) dot += q[d] * row[d];
          float sj = dot * p.scale;
          if (p.softcap > 0.f) sj = p.softcap * std::tanh(sj / p.softcap);
          score[j - first] = sj;
          mx = std::max(mx, sj);
        }
        float sum = 0.f;
        for (float& sj : score) sum += (sj = std::exp(sj - mx));
        acc.assign(D, 0.f);  // each dimension summed over j in order (as attention_reference does)
        for (int j = first; j <= pos; ++j) {
          get(p.value_pool, cached(j, g), 1, g, row);
          for (int d = 0; d < D; ++d) acc[d] += score[j - first] * row[d];
        }
        for (int d = 0; d < D; ++d) out[(size_t(s) * p.H + h) * D + d] = __float2half_rn(acc[d] / sum);
      }
    }
  }
}

}  // namespace enginesmith
